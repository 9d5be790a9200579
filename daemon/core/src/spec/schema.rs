//! The JSON Schemas of ModelSpec and SpecEvolution, generated from the serde types (schemars), so
//! what `create_model` / `evolve_spec` advertise is exactly what they accept, and the output
//! schemas of the tools' object results.
//!
//! Every schema here is draft 2020-12 with all subschemas inlined (no `$ref`, no `$defs`), so it
//! can be embedded as one property of a tool's `inputSchema`.

use std::sync::OnceLock;

use schemars::generate::SchemaSettings;
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde_json::Value as Json;

use super::{ModelSpec, SpecEvolution};

/// The full ModelSpec JSON Schema (draft 2020-12, subschemas inlined: embeddable anywhere).
pub fn model_spec_schema() -> Json {
    static SCHEMA: OnceLock<Json> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            generate::<ModelSpec>(
                SchemaSettings::draft2020_12().for_deserialize(),
                "ModelSpec",
                "A Valem model specification: the JSON Schema of the document, and the derivations, \
                 meta-derivations, constraints, default values, effects, tests and views that run \
                 on it. Paths are canonical JSON Path (`$.items[*].qty`); expressions are JSONata.",
            )
        })
        .clone()
}

/// The SpecEvolution JSON Schema (draft 2020-12, subschemas inlined).
pub fn spec_evolution_schema() -> Json {
    static SCHEMA: OnceLock<Json> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            generate::<SpecEvolution>(
                SchemaSettings::draft2020_12().for_deserialize(),
                "SpecEvolution",
                "An incremental change to a live model's spec. Every field is optional: `new*` \
                 fields replace a section wholesale, `upsert*` add or replace entries by key, \
                 `remove*` drop entries by key. The evolved spec is validated before it applies.",
            )
        })
        .clone()
}

/// The output schema of a tool whose result serializes a `T` (draft 2020-12, inlined; an MCP
/// `outputSchema`, so the root is `"type": "object"`). Describes the serialized shape.
pub fn output_schema<T: JsonSchema>() -> Json {
    let mut schema = generate::<T>(SchemaSettings::draft2020_12().for_serialize(), "", "");
    if let Json::Object(m) = &mut schema {
        m.insert("type".into(), "object".into());
    }
    schema
}

/// The schema of a tool's arguments `T` as they are deserialized (optional fields are not
/// required), draft 2020-12, inlined, without the root `$schema`/`title`.
pub fn input_schema<T: JsonSchema>() -> Json {
    let mut schema = generate::<T>(SchemaSettings::draft2020_12().for_deserialize(), "", "");
    if let Json::Object(m) = &mut schema {
        m.shift_remove("$schema");
        m.shift_remove("title");
        m.insert("type".into(), "object".into());
    }
    schema
}

/// Generate `T`'s root schema with every subschema inlined (a recursive type would still get a
/// `$ref`; the tests check there is none). An empty `title`/`description` keeps what the type's
/// doc comment gave.
fn generate<T: JsonSchema>(settings: SchemaSettings, title: &str, description: &str) -> Json {
    let schema = settings
        .with(|s| s.inline_subschemas = true)
        .into_generator()
        .into_root_schema_for::<T>();
    let mut json = schema.to_value();
    tidy(&mut json);
    if let Json::Object(m) = &mut json {
        if !title.is_empty() {
            m.insert("title".into(), title.into());
        }
        if !description.is_empty() {
            m.insert("description".into(), description.into());
        }
    }
    json
}

/// Two clean-ups over the generated tree:
/// - doc comments arrive with their line wrapping: join the lines of a paragraph (a single
///   newline) so a description reads as one sentence, keeping blank-line paragraph breaks;
/// - schemars marks Rust integer widths with non-standard formats (`"format": "uint"`), which
///   strict validators (Ajv, as MCP clients use) reject as unknown: drop them (`minimum` stays).
fn tidy(j: &mut Json) {
    match j {
        Json::Object(m) => {
            if m.get("format")
                .and_then(Json::as_str)
                .is_some_and(is_rust_number_format)
            {
                m.remove("format");
            }
            for (k, v) in m.iter_mut() {
                match v {
                    Json::String(s) if k == "description" => {
                        *s = s
                            .split("\n\n")
                            .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
                            .collect::<Vec<_>>()
                            .join("\n\n");
                    }
                    _ => tidy(v),
                }
            }
        }
        Json::Array(a) => a.iter_mut().for_each(tidy),
        _ => {}
    }
}

/// `uint`, `uint64`, `int32`, `float`, `double`, ...: schemars' names for Rust number types.
fn is_rust_number_format(f: &str) -> bool {
    matches!(f, "int" | "uint" | "float" | "double")
        || ["int", "uint"].iter().any(|p| {
            f.strip_prefix(p)
                .is_some_and(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit()))
        })
}

// ---- `schema_with` / `transform` helpers for the spec types ----------------------------------

/// A field holding a JSON Schema (an object or a boolean; the validator rejects anything else).
pub(crate) fn json_schema_value(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": ["object", "boolean"] })
}

/// An optional field holding a JSON Schema (`null` means absent).
pub(crate) fn opt_json_schema_value(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": ["object", "boolean", "null"] })
}

/// `deserialize_with = "one_or_many"`: a string or an array of strings.
pub(crate) fn one_or_many_strings(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "anyOf": [
            { "type": "string" },
            { "type": "array", "items": { "type": "string" } }
        ]
    })
}

/// `deserialize_with = "stringified"` / `"opt_stringified"`: any JSON token (a non-string is
/// used as its JSON text, so `100` is the expression `100`).
pub fn any_token(_: &mut SchemaGenerator) -> Schema {
    true.into()
}

/// `ConstraintSpec.policy` defaults to `""` for the deserializer, but the validator rejects a
/// missing policy: the schema requires it (and drops the misleading `"default": ""`).
pub(crate) fn require_policy(schema: &mut Schema) {
    let obj = schema.ensure_object();
    if let Some(Json::Object(policy)) = obj.get_mut("properties").and_then(|p| p.get_mut("policy"))
    {
        policy.remove("default");
    }
    if let Some(Json::Array(req)) = obj.get_mut("required") {
        if !req.iter().any(|r| r == "policy") {
            req.push("policy".into());
        }
    }
}
