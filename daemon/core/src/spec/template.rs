//! Branching: `template: {ref}` materialized (flattened) into the new model's own spec at
//! creation, as the reference does. The branch is not live-coupled to its template afterwards.
//!
//! Section by section, the branch wins by key: `schema` merges recursively (`properties` by
//! name, `required` as a union); `constants` by name; `derivations` and `defaultValues` by
//! `path`; `metaDerivations` by `path` + `property`; `constraints`, `effects` by `id`; `tests`
//! by `description` (cases without one are appended); `viewDefinition` and `version` are the
//! branch's when it has them. The `library` becomes layers — the template's (each marked with
//! the model that contributed it) first, the branch's own last — so a later layer's export of
//! the same name overrides an inherited function. Inherited effects carry
//! `origin: {fromRef, fromOwner}`. `lineage` pins the chain: the template (its version and a
//! digest of its spec), then the template's own lineage; the validator rejects a chain that
//! names a model twice or the branch itself (a cycle).

use serde_json::{json, Map, Value as Json};

use super::{LineageEntry, ModelSpec};

/// Why a branch could not be flattened over its template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// A spec, library layer or lineage did not serialise.
    #[error("{0}")]
    Encode(String),
    #[error("a spec is not an object")]
    NotAnObject,
    /// The flattened spec is not a ModelSpec.
    #[error("the materialized spec: {0}")]
    Materialized(String),
}

fn encode(e: serde_json::Error) -> TemplateError {
    TemplateError::Encode(e.to_string())
}

/// The branch `spec` flattened over `template` (whose id is `ref`).
pub fn materialize(spec: &ModelSpec, template: &ModelSpec) -> Result<ModelSpec, TemplateError> {
    let to_json = |s: &ModelSpec| serde_json::to_value(s).map_err(encode);
    let (Json::Object(mut b), Json::Object(t)) = (to_json(spec)?, to_json(template)?) else {
        return Err(TemplateError::NotAnObject);
    };
    let tref = template.id.clone();
    let get = |m: &Map<String, Json>, k: &str| m.get(k).cloned();

    // schema
    let schema = match (get(&t, "schema"), get(&b, "schema")) {
        (Some(ts), Some(bs)) => merge_schema(ts, bs),
        (Some(ts), None) => ts,
        (None, bs) => bs.unwrap_or_else(|| json!({})),
    };
    b.insert("schema".into(), schema);

    // constants
    let mut constants = get(&t, "constants")
        .and_then(|c| c.as_object().cloned())
        .unwrap_or_default();
    if let Some(Json::Object(own)) = get(&b, "constants") {
        constants.extend(own);
    }
    if !constants.is_empty() {
        b.insert("constants".into(), Json::Object(constants));
    }

    // keyed lists
    let by = |key: &'static [&'static str]| {
        move |v: &Json| -> Option<String> {
            let parts: Vec<&str> = key
                .iter()
                .map(|k| v.get(*k).and_then(|x| x.as_str()))
                .collect::<Option<Vec<&str>>>()?;
            Some(parts.join("#"))
        }
    };
    for (section, key) in [
        ("derivations", &["path"][..]),
        ("defaultValues", &["path"][..]),
        ("metaDerivations", &["path", "property"][..]),
        ("constraints", &["id"][..]),
        ("effects", &["id"][..]),
        ("tests", &["description"][..]),
    ] {
        let mut inherited: Vec<Json> = get(&t, section)
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default();
        if section == "effects" {
            for e in &mut inherited {
                if let Json::Object(m) = e {
                    m.entry("origin")
                        .or_insert_with(|| json!({"fromRef": tref, "fromOwner": null}));
                }
            }
        }
        let own: Vec<Json> = get(&b, section)
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default();
        let merged = merge_keyed(inherited, own, by(key));
        if merged.is_empty() {
            b.remove(section);
        } else {
            b.insert(section.into(), Json::Array(merged));
        }
    }

    // library: inherited layers first, the branch's own last
    let mut layers: Vec<Json> = Vec::new();
    for l in template.library_layers() {
        let mut v = serde_json::to_value(&l).map_err(encode)?;
        if let Json::Object(m) = &mut v {
            m.entry("origin").or_insert_with(|| json!(tref));
        }
        layers.push(v);
    }
    for l in spec.library_layers() {
        layers.push(serde_json::to_value(&l).map_err(encode)?);
    }
    if !layers.is_empty() {
        b.insert("library".into(), json!({"layers": layers}));
    }

    for k in ["viewDefinition", "version"] {
        if !b.contains_key(k) {
            if let Some(v) = get(&t, k) {
                b.insert(k.into(), v);
            }
        }
    }

    // lineage: the template, then its ancestors
    let digest = format!(
        "blake3:{}",
        blake3::hash(serde_json::to_string(&t).unwrap_or_default().as_bytes()).to_hex()
    );
    let mut lineage = vec![LineageEntry {
        reference: tref.clone(),
        version: Some(template.version_or_default().to_string()),
        digest: Some(digest),
        repo: Some("local".into()),
        owner: None,
    }];
    lineage.extend(template.lineage.iter().cloned());
    b.insert(
        "lineage".into(),
        serde_json::to_value(&lineage).map_err(encode)?,
    );
    serde_json::from_value(Json::Object(b)).map_err(|e| TemplateError::Materialized(e.to_string()))
}

/// `own` over `inherited`: an own entry replaces the inherited one of the same key in place;
/// the rest are appended in their order.
fn merge_keyed(
    inherited: Vec<Json>,
    own: Vec<Json>,
    key: impl Fn(&Json) -> Option<String>,
) -> Vec<Json> {
    let mut out = inherited;
    for o in own {
        match key(&o).and_then(|k| out.iter().position(|i| key(i).as_deref() == Some(&k))) {
            Some(i) => out[i] = o,
            None => out.push(o),
        }
    }
    out
}

/// A JSON Schema `own` over `base`: objects merge recursively (branch wins), `required`
/// unions, anything else is the branch's.
fn merge_schema(base: Json, own: Json) -> Json {
    match (base, own) {
        (Json::Object(mut b), Json::Object(o)) => {
            for (k, v) in o {
                let merged = match (k.as_str(), b.remove(&k), v) {
                    ("required", Some(Json::Array(mut r)), Json::Array(extra)) => {
                        for x in extra {
                            if !r.contains(&x) {
                                r.push(x);
                            }
                        }
                        Json::Array(r)
                    }
                    (_, Some(bv @ Json::Object(_)), ov @ Json::Object(_)) => merge_schema(bv, ov),
                    (_, _, ov) => ov,
                };
                b.insert(k, merged);
            }
            Json::Object(b)
        }
        (_, own) => own,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: Json) -> ModelSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn sections_merge_and_the_branch_wins() {
        let t = spec(json!({
            "id": "base", "version": "2.0.0",
            "schema": {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]},
            "constants": {"rate": 1, "fee": 2},
            "library": "( $f := function($x){ $x + 1 }; [\"f\"] )",
            "derivations": [{"path": "$.b", "expr": "a * 2"}, {"path": "$.c", "expr": "$f(a)"}],
            "effects": [{"id": "e", "executor": "caller", "trigger": "a > 1", "emit": "big"}],
            "tests": [{"description": "t1", "given": {"$.a": 1}, "expect": {"$.b": 2}}]
        }));
        let b = spec(json!({
            "id": "branch", "template": {"ref": "base"},
            "schema": {"properties": {"z": {"type": "string"}}, "required": ["z"]},
            "constants": {"rate": 5},
            "library": "( $f := function($x){ $x + 100 }; [\"f\"] )",
            "derivations": [{"path": "$.b", "expr": "a * 3"}]
        }));
        let m = materialize(&b, &t).unwrap();
        assert_eq!(m.id, "branch");
        assert_eq!(m.version.as_deref(), Some("2.0.0"));
        assert_eq!(m.schema["properties"]["a"]["type"], "number");
        assert_eq!(m.schema["properties"]["z"]["type"], "string");
        assert_eq!(m.schema["required"], json!(["a", "z"]));
        assert_eq!(m.constants["rate"], 5);
        assert_eq!(m.constants["fee"], 2);
        let d: Vec<(&str, &str)> = m.derivations.iter().map(|d| (&*d.path, &*d.expr)).collect();
        assert_eq!(d, vec![("$.b", "a * 3"), ("$.c", "$f(a)")]);
        let layers = m.library_layers();
        assert_eq!(layers.len(), 2);
        assert_eq!(layers[0].origin.as_deref(), Some("base"));
        assert!(layers[1].define.contains("100"));
        assert_eq!(
            m.effects[0].origin,
            Some(json!({"fromRef": "base", "fromOwner": null}))
        );
        assert_eq!(m.tests.len(), 1);
        assert_eq!(m.lineage.len(), 1);
        assert_eq!(m.lineage[0].reference, "base");
        assert_eq!(m.lineage[0].version.as_deref(), Some("2.0.0"));
        assert!(m.lineage[0]
            .digest
            .as_deref()
            .unwrap()
            .starts_with("blake3:"));
    }

    #[test]
    fn the_chain_carries_the_ancestors() {
        let root = spec(json!({"id": "root", "schema": {}}));
        let mid = materialize(
            &spec(json!({"id": "mid", "template": {"ref": "root"}, "schema": {}})),
            &root,
        )
        .unwrap();
        let leaf = materialize(
            &spec(json!({"id": "leaf", "template": {"ref": "mid"}, "schema": {}})),
            &mid,
        )
        .unwrap();
        let refs: Vec<&str> = leaf.lineage.iter().map(|l| l.reference.as_str()).collect();
        assert_eq!(refs, vec!["mid", "root"]);
    }
}
