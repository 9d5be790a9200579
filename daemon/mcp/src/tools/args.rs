//! Tool arguments and schemas: typed argument structs (their JSON Schemas are the tools' input
//! schemas), output schemas, annotations.

use super::*;

pub(super) fn args<T: DeserializeOwned>(tool: &str, v: Json) -> Result<T, ToolError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." || path.is_empty() {
            String::new()
        } else {
            format!(" at `{path}`")
        };
        ToolError::Message(format!("invalid arguments for `{tool}`{at}: {}", e.inner()))
    })
}

/// A tool's input schema: `T` as it is deserialized.
pub fn schema_of<T: JsonSchema>() -> Json {
    valem_core::spec::schema::input_schema::<T>()
}

/// The output schema of an always-object result `T` as it is serialized.
pub(super) fn output_of<T: JsonSchema>() -> Json {
    let mut v = valem_core::spec::schema::output_schema::<T>();
    if let Json::Object(m) = &mut v {
        m.shift_remove("$schema");
    }
    v
}

/// An output schema that also admits the contract's structured failures (`isError` results
/// carry them as structuredContent, and clients validate that too).
pub(super) fn or_structured_error(result: Json) -> Json {
    json!({
        "type": "object",
        "anyOf": [
            result,
            {
                "type": "object",
                "description": "A structured failure (isError: true): Schema violation, Constraint violation, Version conflict or Invalid mutation.",
                "properties": {
                    "error": {"enum": ["Schema violation", "Constraint violation", "Version conflict", "Invalid mutation"]},
                    "message": {"type": "string"},
                    "violations": {"type": "array", "items": {"type": "object"}},
                    "expected": {"type": "string"},
                    "actual": {"type": "string"},
                    "batch": {"type": "integer"}
                },
                "required": ["error"]
            }
        ]
    })
}

pub(super) fn object_schema(props: Json, required: &[&str]) -> Json {
    json!({"type": "object", "properties": props, "required": required, "additionalProperties": false})
}

pub(super) fn annotations(read_only: bool, destructive: bool, idempotent: bool) -> Json {
    let mut a = json!({"readOnlyHint": read_only});
    if !read_only {
        a["destructiveHint"] = json!(destructive);
    }
    a["idempotentHint"] = json!(idempotent);
    a["openWorldHint"] = json!(false);
    a
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NoArgs {}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct IdArgs {
    /// The model id.
    pub(super) id: ModelId,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct StateArgs {
    /// The model id.
    pub(super) id: ModelId,
    /// Read the state as of this ISO-8601 instant (the most recent commit at or before it).
    pub(super) at: Option<String>,
    /// Return only these subtrees (canonical addresses such as "$.order"), spliced into a
    /// pruned document at their addresses; absent addresses are skipped.
    pub(super) paths: Option<Vec<String>>,
    /// Cap nesting: containers deeper than this collapse to "<object: N fields>" /
    /// "<array: N items>" (applied after `paths`).
    #[schemars(range(min = 0))]
    pub(super) depth: Option<usize>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct PathArgs {
    /// The model id.
    pub(super) id: ModelId,
    /// A canonical address, e.g. "$.order.items[0].qty".
    pub(super) path: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct MutateArgs {
    /// The model id.
    pub(super) id: ModelId,
    /// Writes as {"$.path": value}, applied in order in one reactive cycle.
    pub(super) mutations: Map<String, Json>,
    /// Include the derivation and constraint traces of the cycle (default false).
    pub(super) include_traces: Option<bool>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct PatchArgs {
    /// The model id.
    pub(super) id: ModelId,
    /// An RFC 6902 JSON Patch of the base document; paths are RFC 6901 JSON Pointers
    /// ("/items/0", "/items/-" to append).
    #[schemars(schema_with = "patch_schema")]
    pub(super) patch: Json,
    /// Include the derivation and constraint traces of the cycle (default false).
    pub(super) include_traces: Option<bool>,
}

pub(super) fn patch_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let s = json!({
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "op": {"enum": ["add", "remove", "replace", "move", "copy", "test"]},
                "path": {"type": "string", "description": "RFC 6901 JSON Pointer"},
                "from": {"type": "string", "description": "RFC 6901 JSON Pointer (move, copy)"},
                "value": {"description": "The value (add, replace, test)"}
            },
            "required": ["op", "path"]
        }
    });
    schemars::Schema::try_from(s).unwrap_or_default()
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct ExplainArgs {
    /// The model id.
    pub(super) id: ModelId,
    /// Traces whose target address starts with this path ("$" for all).
    pub(super) path: String,
    /// Only the most recent N traces.
    #[schemars(range(min = 1))]
    pub(super) limit: Option<usize>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct AuditArgs {
    /// The model id.
    pub(super) id: ModelId,
    /// Records whose mutations, derived updates or trace targets start with this address.
    pub(super) path_prefix: Option<String>,
    /// Records at or after this ISO-8601 instant.
    pub(super) from: Option<String>,
    /// Records at or before this ISO-8601 instant.
    pub(super) to: Option<String>,
    /// At most this many records, newest first (default 100).
    #[schemars(range(min = 1))]
    pub(super) limit: Option<usize>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RestoreArgs {
    /// The model id.
    pub(super) id: ModelId,
    /// A snapshot exactly as `snapshot` returned it.
    pub(super) snapshot: Map<String, Json>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct ViewArgs {
    /// The model id.
    pub(super) id: ModelId,
    /// The view to evaluate (default: the definition's defaultView).
    pub(super) view_id: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct UploadArgs {
    /// The content, base64-encoded.
    pub(super) data: String,
    /// Its media type (default application/octet-stream).
    pub(super) media_type: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct DownloadArgs {
    /// The blob id (the blake3 hash upload_blob returned).
    pub(super) blob_id: String,
    /// Only if this model's state references the blob.
    pub(super) model_id: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct GuidanceArgs {
    /// Topic ids matching the model being authored.
    pub(super) topics: Vec<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SpecArg {
    /// A candidate ModelSpec.
    pub(super) spec: Map<String, Json>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct EvalArgs {
    /// One JSONata expression.
    pub(super) expr: String,
    /// The input document (`$`); absent means undefined input.
    pub(super) input: Option<Json>,
    /// A library to bind: a definition string `( $f := function($x){…}; ["f"] )`, a layer
    /// object {define, …}, or an array of layers.
    pub(super) library: Option<Json>,
    /// Bound as `$const`.
    pub(super) constants: Option<Map<String, Json>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct TestArgs {
    /// The ModelSpec under test.
    pub(super) spec: Map<String, Json>,
    /// Ad-hoc cases [{description?, given: {"$.path": value}, expect: {"$.path": value}}]
    /// that replace the spec's embedded tests.
    pub(super) tests: Option<Vec<Json>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct DryRunArgs {
    /// The candidate ModelSpec.
    pub(super) spec: Map<String, Json>,
    /// One {"$.path": value} map, or an array of them applied as successive cycles.
    pub(super) mutations: Option<Json>,
}

// --- output schemas -------------------------------------------------------------------------

pub(super) fn any_object() -> Json {
    json!({"type": "object"})
}

pub(super) fn mutation_result_schema() -> Json {
    let mut s = or_structured_error(output_of::<valem_service::MutationResult>());
    if let Some(Json::Array(any)) = s.get_mut("anyOf") {
        any.push(json!({
            "type": "object",
            "description": "The size guard's note for a write that committed but whose summary is over ~50 KB (isError: false): its counts, and its flaggedConstraints and dispatchedEffects when they fit.",
            "properties": {
                "error": {"const": "Result too large"},
                "committed": {"const": true},
                "success": {"type": "boolean"},
                "resultChars": {"type": "integer"},
                "limitChars": {"type": "integer"},
                "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
                "flaggedConstraints": {"type": "array", "items": {"type": "object"}},
                "dispatchedEffects": {"type": "array", "items": {"type": "object"}},
                "hint": {"type": "string"}
            },
            "required": ["error", "committed", "counts", "hint"]
        }));
    }
    s
}

/// The model info, with the evolution's `warnings` when it had any.
pub(super) fn evolve_result_schema() -> Json {
    let mut s = output_of::<ModelInfo>();
    if let Some(Json::Object(props)) = s.get_mut("properties") {
        props.insert(
            "warnings".into(),
            json!({
                "type": "array",
                "description": "Keys of the evolution that were ignored, or that it changed nothing.",
                "items": {
                    "type": "object",
                    "properties": {"location": {"type": "string"}, "message": {"type": "string"}},
                    "required": ["location", "message"]
                }
            }),
        );
    }
    s
}

pub(super) fn verify_schema() -> Json {
    json!({
        "type": "object",
        "properties": {
            "valid": {"type": "boolean"},
            "recordsChecked": {"type": "integer"},
            "firstBrokenSequence": {"type": ["integer", "null"]},
            "detail": {"type": "string"},
            "checkpointsChecked": {"type": "integer"},
            "brokenCheckpoint": {
                "type": "object",
                "properties": {
                    "sequence": {"type": ["integer", "null"]},
                    "detail": {"type": "string"}
                },
                "required": ["sequence", "detail"]
            }
        },
        "required": ["valid", "recordsChecked", "firstBrokenSequence", "detail"]
    })
}
