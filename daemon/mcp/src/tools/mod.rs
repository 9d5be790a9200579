//! The MCP tool catalog: every tool's name, title, description, annotations, input schema
//! (generated from the argument types below, so it is what the handler accepts), output schema,
//! and its handler. Handlers only translate arguments into ModelService / authoring calls and
//! results into the result envelope; they hold no state.

mod args;
mod envelope;

pub use args::*;
pub use envelope::*;

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use std::sync::Arc;

use super::guidance::Catalog as Guidance;
use super::ops;
use super::Server;
use valem_core::spec::{parse_spec, TestCase};
use valem_service::authoring::{
    parse_batches, CreateError, DryRunError, Expression, Report, TestReport,
};
use valem_service::plugins::{Kind, Plugin, Plugins};
use valem_service::time::parse_iso;
use valem_service::MutationError;
use valem_service::{
    AuditQuery, BlobRef, IdempotencyKey, ModelId, ModelInfo, ServiceError, Timestamp,
};

/// The tools that never touch the registry (the proxy runs them locally).
pub const AUTHORING: &[&str] = &[
    "get_domain_guidance",
    "validate_spec",
    "eval_expression",
    "test_spec",
    "dry_run",
];

/// The tools that run as a task (MCP 2026-07-28, tasks extension) when the client takes tasks:
/// they may take long over large models.
pub const TASKS: &[&str] = &["test_spec", "dry_run", "evolve_spec"];

/// Pretty-printed results longer than this many characters are withheld.
pub const RESULT_LIMIT_CHARS: usize = 50_000;

/// The `_meta` member of a `tools/call` that names an idempotency key for `mutate` and
/// `patch_model`: the write is applied once however often it is sent with this key.
pub const IDEMPOTENCY_META: &str = "io.valem/idempotencyKey";

/// What a handler sees.
pub struct Ctx<'a> {
    pub server: &'a Server,
    /// `_meta[IDEMPOTENCY_META]` of the call, as sent.
    idempotency_key: Option<Json>,
}

impl<'a> Ctx<'a> {
    pub fn new(server: &'a Server) -> Ctx<'a> {
        Ctx {
            server,
            idempotency_key: None,
        }
    }

    /// For a `tools/call` with these `params` (their `_meta`).
    pub fn of_call(server: &'a Server, params: &Json) -> Ctx<'a> {
        Ctx {
            server,
            idempotency_key: params
                .get("_meta")
                .and_then(|m| m.get(IDEMPOTENCY_META))
                .cloned(),
        }
    }

    /// The call's idempotency key, checked.
    fn idempotency_key(&self) -> Result<Option<IdempotencyKey>, ToolError> {
        let what = format!("_meta[\"{IDEMPOTENCY_META}\"]");
        match &self.idempotency_key {
            None => Ok(None),
            Some(Json::String(k)) => Ok(Some(IdempotencyKey::parse(k, &what)?)),
            Some(_) => Err(ToolError::Message(format!("{what} must be a string"))),
        }
    }
}

/// A tool-level failure (an `isError: true` result).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolError {
    /// One of the contract's structured failures: the body is both text and structuredContent.
    Structured(Json),
    /// Anything else: a message for the agent.
    Message(String),
}

pub type Outcome = Result<Json, ToolError>;

type Handler = fn(&Ctx<'_>, Json) -> Outcome;

/// A tool call in flight.
pub type Deferred = std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>>;

/// The handler of a tool whose work is one reactive cycle: the cycle, not yet queued.
type CycleHandler = for<'a> fn(&Ctx<'a>, Json) -> Result<ops::Cycle<'a>, ToolError>;

/// One tool.
pub struct Tool {
    pub name: &'static str,
    pub title: &'static str,
    pub description: &'static str,
    pub input_schema: Json,
    pub output_schema: Option<Json>,
    pub annotations: Json,
    handler: Handler,
    /// A tool plugin's tool: the plugin and the tool's own (un-namespaced) name.
    plugin: Option<(Arc<Plugin>, String)>,
    /// A tool whose work is one reactive cycle (then `handler` is unused): threads wait for
    /// the cycle, `/mcp` awaits it without holding a reactor thread; the same cycle either way.
    cycle: Option<CycleHandler>,
}

impl Tool {
    pub fn call(&self, ctx: &Ctx<'_>, args: Json) -> Outcome {
        match (&self.plugin, self.cycle) {
            (Some((p, name)), _) => p
                .call("tools.call", json!({"name": name, "arguments": args}))
                .map_err(|e| ToolError::Message(e.to_string())),
            (None, Some(cycle)) => cycle(ctx, args)?.wait(),
            (None, None) => (self.handler)(ctx, args),
        }
    }

    /// Whether the tool comes from a plugin.
    pub fn is_plugin(&self) -> bool {
        self.plugin.is_some()
    }

    /// Whether the tool's work is one reactive cycle (it has an async form).
    pub fn is_deferred(&self) -> bool {
        self.cycle.is_some()
    }

    /// The call as a future, for a tool whose work is one cycle: the cycle is queued now.
    pub fn call_deferred(&self, ctx: &Ctx<'_>, args: Json) -> Option<Deferred> {
        let cycle = self.cycle?;
        Some(match cycle(ctx, args) {
            Ok(c) => Box::pin(c.queue()),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        })
    }

    fn json(&self) -> Json {
        let mut t = json!({
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "inputSchema": self.input_schema,
        });
        if let Some(o) = &self.output_schema {
            t["outputSchema"] = o.clone();
        }
        t["annotations"] = self.annotations.clone();
        t
    }
}

/// All tools, in a stable order.
pub struct Catalog {
    pub tools: Vec<Tool>,
    list: Json,
}

impl Catalog {
    pub fn new(guidance: &Guidance, plugins: &Plugins) -> Catalog {
        let mut tools = all_tools(guidance);
        for p in plugins.of_kind(Kind::Tool) {
            match plugin_tools(p) {
                Ok(t) => {
                    for t in t {
                        if tools.iter().any(|x| x.name == t.name) {
                            tracing::error!(plugin = %p.name, tool = t.name, "tool not added: the name is taken");
                        } else {
                            tools.push(t);
                        }
                    }
                }
                Err(e) => tracing::error!(plugin = %p.name, "tools not loaded: {e}"),
            }
        }
        let list = json!({"tools": tools.iter().map(Tool::json).collect::<Vec<_>>()});
        Catalog { tools, list }
    }

    pub fn get(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }

    pub fn list_json(&self) -> Json {
        self.list.clone()
    }
}

/// The MCP name of a plugin's tool: `<plugin>__<tool>`, `-` in the plugin's name as `_`.
pub fn plugin_tool_name(plugin: &str, tool: &str) -> String {
    format!("{}__{tool}", plugin.replace('-', "_"))
}

/// A tool plugin's tools that could not be added, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginToolsError {
    /// The plugin's `tools.list` call failed.
    #[error("{0}")]
    Plugin(String),
    #[error("plugin `{plugin}` listed tools this daemon cannot read: {error}")]
    Unreadable { plugin: String, error: String },
    #[error(
        "plugin `{plugin}` has a tool named {tool:?}: tool names are letters, digits, `_` and `-` \
         (at most 64 characters with the plugin's prefix)"
    )]
    BadName { plugin: String, tool: String },
    #[error("plugin `{plugin}` tool `{tool}`: inputSchema must be a JSON object schema")]
    BadInputSchema { plugin: String, tool: String },
}

/// A tool plugin's tools (`tools.list`), namespaced and checked. Their texts are leaked: plugins
/// load once per process.
pub fn plugin_tools(p: &Arc<Plugin>) -> Result<Vec<Tool>, PluginToolsError> {
    let list = p
        .call("tools.list", json!({}))
        .map_err(|e| PluginToolsError::Plugin(e.to_string()))?;
    let defs: Vec<valem_sdk::ToolDef> =
        serde_json::from_value(list).map_err(|e| PluginToolsError::Unreadable {
            plugin: p.name.clone(),
            error: e.to_string(),
        })?;
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let mut out = Vec::new();
    for d in defs {
        let name = plugin_tool_name(&p.name, &d.name);
        let ok = !d.name.is_empty()
            && name.len() <= 64
            && d.name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !ok {
            return Err(PluginToolsError::BadName {
                plugin: p.name.clone(),
                tool: d.name,
            });
        }
        let mut input = d.input_schema;
        if !input.is_object() {
            return Err(PluginToolsError::BadInputSchema {
                plugin: p.name.clone(),
                tool: d.name,
            });
        }
        if input.get("type").is_none() {
            input["type"] = json!("object");
        }
        out.push(Tool {
            name: leak(name),
            title: leak(d.title.unwrap_or_else(|| d.name.clone())),
            description: leak(d.description),
            input_schema: input,
            output_schema: d.output_schema,
            annotations: annotations(d.read_only, false, false),
            handler: |_, _| Err(ToolError::Message("not a built-in tool".into())),
            plugin: Some((p.clone(), d.name)),
            cycle: None,
        });
    }
    Ok(out)
}

// --- the result envelope --------------------------------------------------------------------

// --- argument parsing and schemas -----------------------------------------------------------

// --- the catalog ----------------------------------------------------------------------------

fn all_tools(guidance: &Guidance) -> Vec<Tool> {
    // The order is the catalog's (`tools/list`).
    let mut tools = model_tools();
    tools.extend(write_tools());
    tools.extend(lifecycle_tools());
    tools.extend(view_and_blob_tools());
    tools.extend(authoring_tools(guidance));
    tools
}

/// Registry and reads: list, create, info, spec, state, field, effective schema.
fn model_tools() -> Vec<Tool> {
    let ro = annotations(true, false, true);
    vec![
        Tool {
            name: "list_models",
            title: "List models",
            description: "The ids of every live model, alphabetical.",
            input_schema: schema_of::<NoArgs>(),
            output_schema: None,
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                args::<NoArgs>("list_models", a)?;
                ops::list_models(&c.server.service)
            },
        },
        Tool {
            name: "create_model",
            title: "Create a model",
            description: "Validate, compile and register a model from a full ModelSpec (id, version, schema, derivations, metaDerivations, constraints, effects, tests, viewDefinition…). Returns the model info: id, version and section counts. Validate first with validate_spec; a spec with errors is refused with every finding listed.",
            input_schema: object_schema(
                json!({"spec": valem_core::spec::schema::model_spec_schema()}),
                &["spec"],
            ),
            output_schema: Some(output_of::<ModelInfo>()),
            annotations: annotations(false, false, false),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: SpecArg = args("create_model", a)?;
                ops::create_model(&c.server.service, a.spec)
            },
        },
        Tool {
            name: "get_model_info",
            title: "Model info",
            description: "A model's id, version and section counts.",
            input_schema: schema_of::<IdArgs>(),
            output_schema: Some(output_of::<ModelInfo>()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: IdArgs = args("get_model_info", a)?;
                ops::model_info(&c.server.service, &a.id)
            },
        },
        Tool {
            name: "get_spec",
            title: "Get a model's spec",
            description: "The model's current ModelSpec, verbatim.",
            input_schema: schema_of::<IdArgs>(),
            output_schema: Some(any_object()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: IdArgs = args("get_spec", a)?;
                ops::model_spec(&c.server.service, &a.id)
            },
        },
        Tool {
            name: "get_state",
            title: "Get a model's state",
            description: "The merged state (base values plus derived values). On large models pass `paths` to return only some subtrees and/or `depth` to collapse deep containers; `at` reads the state as of an ISO-8601 instant.",
            input_schema: schema_of::<StateArgs>(),
            output_schema: Some(any_object()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: get_state,
        },
        Tool {
            name: "get_field",
            title: "Get one field",
            description: "The merged value at one canonical address, e.g. \"$.order.total\".",
            input_schema: schema_of::<PathArgs>(),
            output_schema: None,
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: PathArgs = args("get_field", a)?;
                ops::field(&c.server.service, &a.id, &a.path)
            },
        },
        Tool {
            name: "get_effective_schema",
            title: "Effective schema of a field",
            description: "The JSON Schema of the field at `path` overlaid with its live meta (current minimum/maximum/required/readOnly/relevant…): what a write there must satisfy now. An address the schema does not declare answers {} with a `$comment` saying so and naming the fields declared there (check the path's spelling).",
            input_schema: schema_of::<PathArgs>(),
            output_schema: None,
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: PathArgs = args("get_effective_schema", a)?;
                ops::effective_schema(&c.server.service, &a.id, &a.path)
            },
        },
    ]
}

/// Writes and their trail: mutate, patch, explain, history, audit, verify.
fn write_tools() -> Vec<Tool> {
    let ro = annotations(true, false, true);
    vec![
        Tool {
            name: "mutate",
            title: "Mutate a model",
            description: "Write values ({\"$.path\": value}) in one reactive cycle: validate against the effective schema, apply, recompute what depends on the change, check constraints (a rollback constraint refuses the whole write), request effects. Returns mutatedPaths, derivedUpdated, metaUpdated, flaggedConstraints, dispatchedEffects (traces with includeTraces); a summary over ~50 KB comes as a note with `committed: true` and its counts (the write is done: do not send it again).",
            input_schema: schema_of::<MutateArgs>(),
            output_schema: Some(mutation_result_schema()),
            annotations: annotations(false, false, false),
            plugin: None,
            cycle: Some(|c, a| {
                let a: MutateArgs = args("mutate", a)?;
                let key = c.idempotency_key()?;
                Ok(ops::mutate(&c.server.service, &a.id, &a.mutations, a.include_traces.unwrap_or(false), key))
            }),
            handler: |_, _| Err(ToolError::Message("a cycle tool: see `cycle`".into())),
        },
        Tool {
            name: "patch_model",
            title: "Patch a model (RFC 6902)",
            description: "Apply an RFC 6902 JSON Patch (add/remove/replace/move/copy/test) to the base document as one reactive cycle: insert, remove or reorder array elements. Paths are JSON Pointers (\"/items/0\", \"/items/-\" appends), not $-addresses. Returns the mutate summary (a note with `committed: true` over ~50 KB).",
            input_schema: schema_of::<PatchArgs>(),
            output_schema: Some(mutation_result_schema()),
            annotations: annotations(false, false, false),
            plugin: None,
            cycle: Some(|c, a| {
                let a: PatchArgs = args("patch_model", a)?;
                let key = c.idempotency_key()?;
                ops::patch(&c.server.service, &a.id, a.patch, a.include_traces.unwrap_or(false), key)
            }),
            handler: |_, _| Err(ToolError::Message("a cycle tool: see `cycle`".into())),
        },
        Tool {
            name: "explain",
            title: "Explain a value",
            description: "The recent derivation/constraint traces (expression, inputs, result, error) whose target starts with `path`, oldest first; `limit` keeps only the most recent N.",
            input_schema: schema_of::<ExplainArgs>(),
            output_schema: None,
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: ExplainArgs = args("explain", a)?;
                ops::explain(&c.server.service, &a.id, &a.path, a.limit)
            },
        },
        Tool {
            name: "get_history",
            title: "Commit history",
            description: "The commit times (ISO-8601) of the model's recent states, oldest first; pass one as get_state `at` to read that state.",
            input_schema: schema_of::<IdArgs>(),
            output_schema: None,
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: IdArgs = args("get_history", a)?;
                ops::history(&c.server.service, &a.id)
            },
        },
        Tool {
            name: "get_audit",
            title: "Audit trail",
            description: "Audit records (one per committed cycle: mutations, derivedUpdated, traces, flagged constraints, dispatched effects, source, sequence, hashes), newest first, filtered by pathPrefix and an ISO-8601 from/to window; limit defaults to 100.",
            input_schema: schema_of::<AuditArgs>(),
            output_schema: None,
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: AuditArgs = args("get_audit", a)?;
                let instant = |s: Option<String>| -> Result<Option<Timestamp>, ToolError> {
                    s.map(|s| parse_iso(&s).map_err(|e| ToolError::Message(e.to_string())))
                        .transpose()
                };
                let q = AuditQuery {
                    path_prefix: a.path_prefix,
                    from: instant(a.from)?,
                    to: instant(a.to)?,
                    limit: a.limit,
                };
                Ok(json!(c.server.service.audit(&a.id, q)?))
            },
        },
        Tool {
            name: "verify_audit",
            title: "Verify the audit chain",
            description: "Walk the audit trail's hash chain and report {valid, recordsChecked, firstBrokenSequence, detail}: the first altered, reordered or deleted record. With a data directory the state checkpoints are checked too (checkpointsChecked); one that no longer matches its state or the chain makes it invalid and is named in brokenCheckpoint {sequence: the record it follows, null before the first; detail}.",
            input_schema: schema_of::<IdArgs>(),
            output_schema: Some(verify_schema()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: IdArgs = args("verify_audit", a)?;
                Ok(c.server.service.verify_audit(&a.id)?)
            },
        },
    ]
}

/// A model's lifecycle: snapshot, restore, evolve, delete.
fn lifecycle_tools() -> Vec<Tool> {
    vec![
        Tool {
            name: "snapshot",
            title: "Snapshot a model",
            description: "An immutable point-in-time copy of the model's state {modelId, modelVersion, baseDoc, derivedCache, metaCache}; hand it back verbatim to restore.",
            input_schema: schema_of::<IdArgs>(),
            output_schema: Some(json!({
                "type": "object",
                "properties": {
                    "modelId": {"type": "string"},
                    "modelVersion": {"type": "string"},
                    "takenAt": {"type": "string"},
                    "baseDoc": {"type": "object"},
                    "derivedCache": {"type": "object"},
                    "metaCache": {"type": "object"}
                },
                "required": ["modelId", "modelVersion", "baseDoc", "derivedCache", "metaCache"]
            })),
            annotations: annotations(false, false, true),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: IdArgs = args("snapshot", a)?;
                ops::snapshot(&c.server.service, &a.id)
            },
        },
        Tool {
            name: "restore",
            title: "Restore a snapshot",
            description: "Roll the model's state back to a snapshot (as `snapshot` returned it). The base document is schema-checked, everything derived is recomputed, and the history and explain rings restart.",
            input_schema: schema_of::<RestoreArgs>(),
            output_schema: Some(any_object()),
            annotations: annotations(false, false, true),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: RestoreArgs = args("restore", a)?;
                ops::restore(&c.server.service, &a.id, a.snapshot)
            },
        },
        Tool {
            name: "evolve_spec",
            title: "Evolve a model's spec",
            description: "Change a live model's spec with a SpecEvolution (keyed upserts/removes, wholesale or targeted schema/view/constants edits, backfill). Pass expectedVersion to guard against concurrent changes (a mismatch returns a Version conflict). The state is kept, checked against the new schema (stranding evolutions are refused) and recomputed. The version changes only with newVersion. Returns the new model info. Keys a SpecEvolution does not have are refused when nothing else changes (named, with the key meant) and returned as `warnings` beside a change; an evolution that changes nothing leaves the model (and its history) as it was.",
            input_schema: object_schema(
                json!({
                    "id": {"type": "string", "description": "The model id."},
                    "evolution": valem_core::spec::schema::spec_evolution_schema(),
                }),
                &["id", "evolution"],
            ),
            output_schema: Some(or_structured_error(evolve_result_schema())),
            annotations: annotations(false, true, false),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct A {
                    id: ModelId,
                    evolution: Json,
                }
                let a: A = args("evolve_spec", a)?;
                ops::evolve(&c.server.service, &a.id, &a.evolution)
            },
        },
        Tool {
            name: "delete_model",
            title: "Delete a model",
            description: "Remove a model and its state from the registry.",
            input_schema: schema_of::<IdArgs>(),
            output_schema: Some(json!({
                "type": "object",
                "properties": {"deleted": {"type": "boolean"}, "id": {"type": "string"}},
                "required": ["deleted", "id"]
            })),
            annotations: annotations(false, true, true),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: IdArgs = args("delete_model", a)?;
                ops::delete(&c.server.service, &a.id)
            },
        },
    ]
}

/// Views, the library, blobs.
fn view_and_blob_tools() -> Vec<Tool> {
    let ro = annotations(true, false, true);
    vec![
        Tool {
            name: "get_view",
            title: "Evaluate a view",
            description: "The model's view definition evaluated against its current state: the component tree with bound values, labels, visibility, read-only and required flags and resolved options.",
            input_schema: schema_of::<ViewArgs>(),
            output_schema: Some(any_object()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: ViewArgs = args("get_view", a)?;
                ops::view(&c.server.service, &a.id, a.view_id.as_deref())
            },
        },
        Tool {
            name: "get_library",
            title: "A model's library",
            description: "The JSONata function library the model binds: its layers and exports (name, kind, signature, arity).",
            input_schema: schema_of::<IdArgs>(),
            output_schema: Some(any_object()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: IdArgs = args("get_library", a)?;
                c.server.service.library(&a.id).wait()?.ok_or_else(|| {
                    ToolError::Message(format!("model `{}` has no library", a.id))
                })
            },
        },
        Tool {
            name: "upload_blob",
            title: "Upload a blob",
            description: "Store binary content (base64 in `data`) in the content-addressed blob store; returns {blobId, bytes, mediaType}. For small binaries: results over ~50 KB are withheld.",
            input_schema: schema_of::<UploadArgs>(),
            output_schema: Some(output_of::<BlobRef>()),
            annotations: annotations(false, false, true),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: UploadArgs = args("upload_blob", a)?;
                ops::upload_blob(&c.server.service, &a.data, a.media_type)
            },
        },
        Tool {
            name: "download_blob",
            title: "Download a blob",
            description: "A blob's content as base64 {blobId, bytes, mediaType, data}; with modelId, only if that model's state references the blob.",
            input_schema: schema_of::<DownloadArgs>(),
            output_schema: Some(json!({
                "type": "object",
                "properties": {
                    "blobId": {"type": "string"},
                    "bytes": {"type": "integer"},
                    "mediaType": {"type": "string"},
                    "data": {"type": "string"}
                },
                "required": ["blobId", "bytes", "mediaType", "data"]
            })),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: DownloadArgs = args("download_blob", a)?;
                ops::download_blob(&c.server.service, &a.blob_id, a.model_id.as_deref())
            },
        },
        // --- authoring: never touch the registry ---------------------------------------------
    ]
}

/// Authoring: domain guidance, validation, evaluation, tests and dry runs.
fn authoring_tools(guidance: &Guidance) -> Vec<Tool> {
    let ro = annotations(true, false, true);
    let mut guidance_schema = schema_of::<GuidanceArgs>();
    if !guidance.ids().is_empty() {
        guidance_schema["properties"]["topics"]["items"] = json!({
            "type": "string",
            "enum": guidance.ids(),
        });
    }
    guidance_schema["properties"]["topics"]["description"] = json!(format!(
        "Topic ids matching the model being authored: {}",
        guidance.menu()
    ));
    vec![
        Tool {
            name: "get_domain_guidance",
            title: "Domain guidance for authoring",
            description: "Vetted instructions for modelling common domains (amortization, progressive charges, classification, date math, percentages, unit conversion, proration, …). Read the model's description, pick the matching topic ids, and call this before authoring the spec.",
            input_schema: guidance_schema,
            output_schema: Some(any_object()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: GuidanceArgs = args("get_domain_guidance", a)?;
                Ok(c.server.guidance.guidance(&a.topics))
            },
        },
        Tool {
            name: "validate_spec",
            title: "Validate a spec",
            description: "Check a candidate ModelSpec without creating it: {valid, errors: [{location, message}], warnings}. Draft → validate → fix → repeat.",
            input_schema: schema_of::<SpecArg>(),
            output_schema: Some(output_of::<Report>()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: SpecArg = args("validate_spec", a)?;
                Ok(json!(c.server.service.validate_spec(&Json::Object(a.spec))))
            },
        },
        Tool {
            name: "eval_expression",
            title: "Evaluate a JSONata expression",
            description: "Evaluate one JSONata expression against a sample input (with optional library and $const constants): {ok: true, undefined, result} or {ok: false, error: \"compile\"|\"evaluation\"|\"library\", message}. Check a derivation or constraint before committing it.",
            input_schema: schema_of::<EvalArgs>(),
            output_schema: Some(json!({
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "undefined": {"type": "boolean"},
                    "result": {},
                    "libraryExports": {"type": "array", "items": {"type": "string"}},
                    "error": {"enum": ["compile", "evaluation", "library"]},
                    "message": {"type": "string"},
                    "code": {"type": ["string", "null"]},
                    "position": {"type": ["integer", "null"]}
                },
                "required": ["ok"]
            })),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: eval_expression,
        },
        Tool {
            name: "test_spec",
            title: "Run a spec's tests",
            description: "Run the spec's embedded tests (or ad-hoc `tests` cases given → expect, keyed by canonical address, which replace them) in throwaway models: {total, passed, failed, results: [{description, passed, failures: [{path, expected, actual, message}]}]}.",
            input_schema: schema_of::<TestArgs>(),
            output_schema: Some(output_of::<TestReport>()),
            annotations: ro.clone(),
            plugin: None,
            cycle: None,
            handler: test_spec,
        },
        Tool {
            name: "dry_run",
            title: "Dry-run a spec",
            description: "Compile a candidate spec in a throwaway model, apply optional sample mutations (one {\"$.path\": value} map or an array of them), and return the resulting merged state. Nothing is registered.",
            input_schema: schema_of::<DryRunArgs>(),
            output_schema: Some(or_structured_error(any_object())),
            annotations: ro,
            plugin: None,
            cycle: None,
            handler: |c, a| {
                let a: DryRunArgs = args("dry_run", a)?;
                let spec = parse_spec(&Json::Object(a.spec))
                    .map_err(|e| ToolError::Message(format!("invalid spec at {}: {}", e.location(), e.message())))?;
                let batches = match &a.mutations {
                    None | Some(Json::Null) => Vec::new(),
                    Some(m) => parse_batches(m).map_err(|e| ToolError::Message(e.to_string()))?,
                };
                c.server.service.dry_run(&spec, &batches).map_err(|e| match e {
                    DryRunError::Mutation { index, error: m @ (MutationError::Schema(_) | MutationError::Constraint { .. }) } => {
                        let mut body = m.to_json();
                        body["batch"] = json!(index);
                        ToolError::Structured(body)
                    }
                    other => ToolError::Message(other.to_string()),
                })
            },
        },
    ]
}

fn get_state(c: &Ctx<'_>, a: Json) -> Outcome {
    let a: StateArgs = args("get_state", a)?;
    ops::state(
        &c.server.service,
        &a.id,
        a.at.as_deref(),
        a.paths.as_deref(),
        a.depth,
    )
}

fn eval_expression(c: &Ctx<'_>, a: Json) -> Outcome {
    let a: EvalArgs = args("eval_expression", a)?;
    Ok(c.server.service.eval_expression(Expression {
        expr: &a.expr,
        input: a.input.as_ref(),
        library: a.library.as_ref(),
        constants: a.constants.as_ref(),
    }))
}

fn test_spec(c: &Ctx<'_>, a: Json) -> Outcome {
    let a: TestArgs = args("test_spec", a)?;
    let spec = parse_spec(&Json::Object(a.spec)).map_err(|e| {
        ToolError::Message(format!("invalid spec at {}: {}", e.location(), e.message()))
    })?;
    let tests: Option<Vec<TestCase>> = match a.tests {
        None => None,
        Some(t) => Some(
            serde_path_to_error::deserialize(Json::Array(t)).map_err(|e| {
                ToolError::Message(format!(
                    "invalid test case at `tests{}`: {}",
                    e.path(),
                    e.inner()
                ))
            })?,
        ),
    };
    match c.server.service.test_spec(&spec, tests.as_deref()) {
        Ok(report) => Ok(json!(report)),
        Err(CreateError::Compile(errs)) => Err(ToolError::Message(format!(
            "the spec does not compile: {}",
            errs.iter()
                .map(|e| format!("{}: {}", e.location, e.message))
                .collect::<Vec<_>>()
                .join("; ")
        ))),
        Err(e) => Err(ToolError::Message(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(schema: &Json, v: &Json) -> bool {
        jsonschema::validator_for(schema).is_ok_and(|s| s.is_valid(v))
    }

    #[test]
    fn a_committed_write_over_the_guard_is_a_note_its_output_schema_admits() {
        let paths: Vec<String> = (0..3000).map(|i| format!("$.rows[{i}].label")).collect();
        let summary = json!({"success": true, "mutatedPaths": paths, "derivedUpdated": ["$.n"],
            "metaUpdated": [], "flaggedConstraints": [], "dispatchedEffects": []});
        let r = envelope_for("mutate", Ok(summary.clone()));
        assert_eq!(r["isError"], false);
        let note = &r["structuredContent"];
        assert_eq!(note["counts"]["mutatedPaths"], 3000);
        assert!(valid(&mutation_result_schema(), note), "{note}");
        // Not one of the structured failures either.
        assert!(!valid(
            &or_structured_error(json!({"type": "object", "required": ["x"]})),
            note
        ));
        // Any other tool's result over the guard is withheld as an error.
        let r = envelope_for("get_state", Ok(summary));
        assert_eq!(r["isError"], true);
        assert!(r.get("structuredContent").is_none());
    }

    #[test]
    fn lists_that_would_pass_the_guard_are_counted_not_carried() {
        let flags: Vec<Json> = (0..3000)
            .map(|i| json!({"constraintId": format!("c{i}"), "message": "m", "policy": "flag"}))
            .collect();
        let summary = json!({"success": true, "mutatedPaths": ["$.a"], "derivedUpdated": [],
            "metaUpdated": [], "flaggedConstraints": flags,
            "dispatchedEffects": [{"effectId": "e", "emit": "x"}]});
        let note = &envelope_for("patch_model", Ok(summary))["structuredContent"];
        assert_eq!(note["counts"]["flaggedConstraints"], 3000);
        assert!(note.get("flaggedConstraints").is_none());
        assert_eq!(note["dispatchedEffects"][0]["emit"], "x");
        assert!(pretty(note).chars().count() <= RESULT_LIMIT_CHARS);
    }
}
