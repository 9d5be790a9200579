//! The model operations behind the MCP tools, on typed arguments, with their result shapes and
//! failure messages. The tool handlers and the console's embedded backend both call these, so
//! the two surfaces answer alike. Never parses wire arguments (the callers do) and never reaches
//! past the [`ModelService`].

use serde_json::{json, Map, Value as Json};

use super::tools::{Outcome, ToolError};
use valem_core::expr::path::Address;
use valem_core::spec::{parse_evolution_checked, parse_spec};
use valem_service::time::parse_iso;
use valem_service::{mutation_list, Call, Change, IdempotencyKey, ModelId, ModelService, Viewed};

pub fn list_models(s: &ModelService) -> Outcome {
    Ok(json!(s.list()?))
}

/// Validate, compile and register; the result is the model info.
pub fn create_model(s: &ModelService, spec: Map<String, Json>) -> Outcome {
    let spec = parse_spec(&Json::Object(spec)).map_err(|e| {
        ToolError::Message(format!("invalid spec at {}: {}", e.location(), e.message()))
    })?;
    Ok(json!(s.create(spec)?))
}

pub fn model_info(s: &ModelService, id: &ModelId) -> Outcome {
    Ok(json!(s.info(id).wait()?))
}

/// The spec verbatim.
pub fn model_spec(s: &ModelService, id: &ModelId) -> Outcome {
    let spec = s.spec(id).wait()?;
    serde_json::to_value(&*spec).map_err(|e| ToolError::Message(e.to_string()))
}

/// The merged state (as of the ISO-8601 instant `at`), projected on `paths`, trimmed to `depth`.
pub fn state(
    s: &ModelService,
    id: &ModelId,
    at: Option<&str>,
    paths: Option<&[String]>,
    depth: Option<usize>,
) -> Outcome {
    let at = at
        .map(parse_iso)
        .transpose()
        .map_err(|e| ToolError::Message(e.to_string()))?;
    let mut doc = s.state(id, at).wait()?;
    if let Some(paths) = paths {
        doc = project(&doc, paths)?;
    }
    if let Some(d) = depth {
        doc = trim(&doc, d, 0);
    }
    Ok(doc)
}

/// The merged value at `path`; an absent value is a failure naming it.
pub fn field(s: &ModelService, id: &ModelId, path: &str) -> Outcome {
    s.field(id, path)
        .wait()?
        .ok_or_else(|| ToolError::Message(format!("`{path}` has no value in model `{id}`")))
}

pub fn effective_schema(s: &ModelService, id: &ModelId, path: &str) -> Outcome {
    Ok(s.effective_schema(id, path).wait()?)
}

/// A write that is one reactive cycle, not yet queued: the service's call and whether its
/// MutationResult shows traces. A thread-driven edge (stdio, the console) [`wait`](Cycle::wait)s
/// for it; `/mcp` [`queue`](Cycle::queue)s it and awaits the shard without holding a thread.
#[must_use = "a Cycle does nothing until it is waited for or queued"]
pub struct Cycle<'a> {
    call: Call<'a, Viewed>,
    traces: bool,
}

impl Cycle<'_> {
    /// Queue the cycle (waiting for room) and block until it answers.
    pub fn wait(self) -> Outcome {
        let traces = self.traces;
        Ok(self.call.wait()?.result.to_json(traces))
    }

    /// Queue the cycle now; the answer as a future that holds no borrow.
    pub fn queue(self) -> impl std::future::Future<Output = Outcome> + Send + 'static {
        let (answer, traces) = (self.call.queue(), self.traces);
        async move { Ok(answer.await?.result.to_json(traces)) }
    }
}

/// One reactive cycle for a `{"$.path": value}` mutation set.
pub fn mutate<'a>(
    s: &'a ModelService,
    id: &ModelId,
    mutations: &Map<String, Json>,
    include_traces: bool,
    key: Option<IdempotencyKey>,
) -> Cycle<'a> {
    Cycle {
        call: s.write_once(id, Change::Mutations(mutation_list(mutations)), None, key),
        traces: include_traces,
    }
}

/// One reactive cycle for an RFC 6902 JSON Patch; fails at once when the patch does not parse.
pub fn patch<'a>(
    s: &'a ModelService,
    id: &ModelId,
    patch: Json,
    include_traces: bool,
    key: Option<IdempotencyKey>,
) -> Result<Cycle<'a>, ToolError> {
    let patch = valem_service::parse_patch(patch).map_err(|e| ToolError::Message(e.to_string()))?;
    Ok(Cycle {
        call: s.write_once(id, Change::Patch(patch), None, key),
        traces: include_traces,
    })
}

pub fn explain(s: &ModelService, id: &ModelId, path: &str, limit: Option<usize>) -> Outcome {
    Ok(json!(s.explain(id, path, limit).wait()?))
}

pub fn history(s: &ModelService, id: &ModelId) -> Outcome {
    Ok(json!(s.history(id).wait()?))
}

pub fn snapshot(s: &ModelService, id: &ModelId) -> Outcome {
    Ok(s.snapshot(id).wait()?)
}

pub fn restore(s: &ModelService, id: &ModelId, snapshot: Map<String, Json>) -> Outcome {
    Ok(s.restore(id, Json::Object(snapshot)).wait()?)
}

/// Apply a SpecEvolution; the result is the new model info, with `warnings` when the evolution
/// had keys it ignored or changed nothing.
pub fn evolve(s: &ModelService, id: &ModelId, evolution: &Json) -> Outcome {
    let (evo, warnings) = parse_evolution_checked(evolution).map_err(|e| {
        ToolError::Message(format!(
            "invalid evolution at {}: {}",
            e.location(),
            e.message()
        ))
    })?;
    let mut info = json!(s.evolve(id, evo).wait()?);
    if !warnings.is_empty() {
        info["warnings"] = json!(warnings);
    }
    Ok(info)
}

pub fn delete(s: &ModelService, id: &ModelId) -> Outcome {
    s.delete(id)?;
    Ok(json!({"deleted": true, "id": id}))
}

pub fn view(s: &ModelService, id: &ModelId, view_id: Option<&str>) -> Outcome {
    Ok(s.view(id, view_id).wait()?)
}

/// Store base64 `data`; the BlobRef.
pub fn upload_blob(s: &ModelService, data: &str, media_type: Option<String>) -> Outcome {
    use base64::Engine;
    let data = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| ToolError::Message(format!("`data` is not valid base64: {e}")))?;
    Ok(json!(s.upload_blob(data, media_type)?))
}

/// A blob as `{blobId, bytes, mediaType, data (base64)}`; with `model_id`, only if that
/// model's state references it.
pub fn download_blob(s: &ModelService, blob_id: &str, model_id: Option<&str>) -> Outcome {
    let (r, bytes) = s.download_blob(blob_id, model_id)?;
    Ok(blob_json(&r.blob_id, &r.media_type, &bytes))
}

/// The download shape of a blob's content.
pub fn blob_json(blob_id: &str, media_type: &str, bytes: &[u8]) -> Json {
    use base64::Engine;
    json!({
        "blobId": blob_id,
        "bytes": bytes.len(),
        "mediaType": media_type,
        "data": base64::engine::general_purpose::STANDARD.encode(bytes),
    })
}

/// Keep only the subtrees at `paths`, at their addresses (absent ones skipped).
fn project(doc: &Json, paths: &[String]) -> Result<Json, ToolError> {
    use valem_core::value::Seg;
    let mut out = Json::Object(Map::new());
    for p in paths {
        let addr =
            Address::parse(p).map_err(|e| ToolError::Message(format!("paths: {}", e.message)))?;
        let Some(segs) = addr.concrete() else {
            return Err(ToolError::Message(format!(
                "paths: `{p}` contains `[*]`; project a container (e.g. \"$.items\") instead"
            )));
        };
        let mut cur = doc;
        let mut found = true;
        for s in &segs {
            let next = match (s, cur) {
                (Seg::Field(k), Json::Object(m)) => m.get(&**k),
                (Seg::Index(i), Json::Array(a)) => a.get(*i),
                _ => None,
            };
            match next {
                Some(n) => cur = n,
                None => {
                    found = false;
                    break;
                }
            }
        }
        if !found {
            continue;
        }
        if segs.is_empty() {
            return Ok(doc.clone());
        }
        // Splice `cur` into `out` at `segs`, creating containers as in `doc`.
        let mut slot = &mut out;
        for (i, s) in segs.iter().enumerate() {
            let last = i + 1 == segs.len();
            slot = match s {
                Seg::Field(k) => {
                    if !slot.is_object() {
                        *slot = Json::Object(Map::new());
                    }
                    let Json::Object(m) = slot else {
                        unreachable!()
                    };
                    let e = m.entry(k.to_string()).or_insert(Json::Null);
                    e
                }
                Seg::Index(ix) => {
                    if !slot.is_array() {
                        *slot = Json::Array(Vec::new());
                    }
                    let Json::Array(a) = slot else { unreachable!() };
                    if a.len() <= *ix {
                        a.resize(ix + 1, Json::Null);
                    }
                    &mut a[*ix]
                }
            };
            if last {
                *slot = cur.clone();
            }
        }
    }
    Ok(out)
}

/// Collapse containers nested deeper than `depth` into a marker string.
fn trim(v: &Json, depth: usize, level: usize) -> Json {
    match v {
        Json::Object(m) if level > depth => Json::String(format!("<object: {} fields>", m.len())),
        Json::Array(a) if level > depth => Json::String(format!("<array: {} items>", a.len())),
        Json::Object(m) => Json::Object(
            m.iter()
                .map(|(k, x)| (k.clone(), trim(x, depth, level + 1)))
                .collect(),
        ),
        Json::Array(a) => Json::Array(a.iter().map(|x| trim(x, depth, level + 1)).collect()),
        other => other.clone(),
    }
}
