//! The service's API types: limits, model info, sources, errors, and the events subscribers
//! hear.

use super::*;

/// Limits of the service (each configurable; a limit hit is a clear error).
#[derive(Clone, Debug)]
pub struct ServiceLimits {
    pub engine: EngineLimits,
    /// Most live models in the registry.
    pub max_models: usize,
    /// Commit times (and states) kept per model for `get_history` and `at=` reads.
    pub history_entries: usize,
    /// Traces kept per model for `explain`.
    pub explain_entries: usize,
    /// Audit records kept per model in memory (the durable store has no such bound).
    pub audit_entries: usize,
    /// With a store: a model's state is checkpointed every this many audit records (and at
    /// shutdown), so recovery replays at most this many records per model.
    pub checkpoint_every: usize,
    /// Largest blob, in bytes.
    pub blob_max_bytes: usize,
    /// All blobs together, in bytes.
    pub blob_max_total_bytes: usize,
    /// With a store: most models kept in memory (`None`: every model). Beyond it the least
    /// recently used are evicted (their state is durable already) and woken from the store by
    /// their next request. Split evenly over the shards.
    pub max_resident_models: Option<usize>,
}

/// A cycle's time budget unless configured otherwise (`--cycle-budget-ms`).
pub const DEFAULT_CYCLE_BUDGET_MS: u64 = 10_000;

impl Default for ServiceLimits {
    fn default() -> Self {
        ServiceLimits {
            engine: EngineLimits {
                cycle_budget: time::cycle_budget(DEFAULT_CYCLE_BUDGET_MS),
                ..EngineLimits::default()
            },
            max_models: 1000,
            history_entries: 50,
            explain_entries: 500,
            audit_entries: 10_000,
            checkpoint_every: 1000,
            blob_max_bytes: 50 << 20,
            blob_max_total_bytes: 512 << 20,
            max_resident_models: None,
        }
    }
}

/// What `create_model` and `get_model_info` return.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelInfo {
    pub id: String,
    pub version: String,
    pub derivation_count: usize,
    pub meta_derivation_count: usize,
    pub constraint_count: usize,
    pub effect_count: usize,
    pub test_count: usize,
    /// View ids of the spec's `viewDefinition` (empty when it has none).
    pub views: Vec<String>,
    pub has_library: bool,
}

impl ModelInfo {
    pub(super) fn of(spec: &ModelSpec) -> ModelInfo {
        Self::named(&spec.id, spec)
    }

    /// What `spec` defines, for the model `id` (a shared spec may name another).
    pub(super) fn named(id: &str, spec: &ModelSpec) -> ModelInfo {
        let views = spec
            .view_definition
            .as_ref()
            .and_then(|v| v.get("views"))
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.get("id").and_then(|i| i.as_str()).map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        ModelInfo {
            id: id.to_string(),
            version: spec.version_or_default().to_string(),
            derivation_count: spec.derivations.len(),
            meta_derivation_count: spec.meta_derivations.len(),
            constraint_count: spec.constraints.len(),
            effect_count: spec.effects.len(),
            test_count: spec.tests.len(),
            views,
            has_library: spec.library.is_some(),
        }
    }
}

/// A write to a model's base document: mutations (`{"$.path": value}` pairs) or an RFC 6902
/// JSON Patch.
#[derive(Debug)]
pub enum Change {
    Mutations(Vec<(String, Json)>),
    Patch(json_patch::Patch),
}

/// A JSON Patch document that does not parse: where in it, and why.
#[derive(Debug, thiserror::Error)]
#[error("invalid JSON Patch at `{path}`: {reason}")]
pub struct PatchParseError {
    pub path: String,
    pub reason: String,
}

/// Parse an RFC 6902 JSON Patch document (the one parser every surface uses).
pub fn parse_patch(v: Json) -> Result<json_patch::Patch, PatchParseError> {
    serde_path_to_error::deserialize(v).map_err(|e| PatchParseError {
        path: e.path().to_string(),
        reason: e.inner().to_string(),
    })
}

/// A committed write and, when one was asked for, the evaluated view of the state it
/// committed (an error when the view does not evaluate: the write stays committed).
#[derive(Debug)]
pub struct Viewed {
    pub result: Arc<MutationResult>,
    pub view: Option<Result<Json, ServiceError>>,
    /// The write was made before under the same idempotency key: this is its answer again
    /// (without traces; a view is of the state now), and nothing was applied this time.
    pub replayed: bool,
}

/// The longest idempotency key, in bytes.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// A client's idempotency key for one write of one model: the write is applied once, and a
/// request sent again with the same key (after an answer was lost, a node died, a proxy timed
/// out) is answered as the first was. 1 to [`MAX_IDEMPOTENCY_KEY`] printable ASCII characters;
/// a model keeps its newest `valem_store::KEYS_KEPT` keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// `key` as sent (`what` names where, for the error: "the Idempotency-Key header").
    pub fn parse(key: &str, what: &str) -> Result<IdempotencyKey, ServiceError> {
        if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY {
            return Err(ServiceError::BadRequest(format!(
                "{what} must be 1 to {MAX_IDEMPOTENCY_KEY} characters, not {}",
                key.len()
            )));
        }
        if let Some((i, c)) = key.char_indices().find(|(_, c)| !(' '..='~').contains(c)) {
            return Err(ServiceError::BadRequest(format!(
                "{what} holds {c:?} at byte {i}: only printable ASCII characters are allowed"
            )));
        }
        Ok(IdempotencyKey(key.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Where a mutation came from (recorded in the audit trail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Client,
    Patch,
    /// An effect executor folding its outcome back (status, `response.set`).
    Foldback,
    /// Another model's `server` effect writing through a `target` link.
    Link,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Client => "client",
            Source::Patch => "patch",
            Source::Foldback => "foldback",
            Source::Link => "link",
        }
    }
}

/// Every way a service call can fail. Surfaces map these to their wire shapes.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ServiceError {
    #[error("model `{0}` not found")]
    NotFound(String),
    #[error("model `{0}` already exists; delete it first or choose another id")]
    Duplicate(String),
    #[error("the registry is full ({0} models); delete a model first")]
    TooManyModels(usize),
    #[error("invalid spec: {}", findings_text(.0))]
    InvalidSpec(Vec<Finding>),
    #[error("{0}")]
    Mutation(MutationError),
    #[error("Version conflict: expected version `{expected}` but the model is at `{actual}`")]
    VersionConflict { expected: String, actual: String },
    #[error("Evolved spec failed validation: {}", findings_text(.0))]
    EvolutionInvalid(Vec<Finding>),
    #[error("the evolved schema strands existing state: {}", .0.iter().map(|i| format!("{}: {}", i.path, i.message)).collect::<Vec<_>>().join("; "))]
    Stranded(Vec<Incompatibility>),
    #[error("no state recorded at or before {0}")]
    HistoryNotFound(String),
    #[error("blob `{0}` not found")]
    BlobNotFound(String),
    /// The model has no view definition, or no view of that id.
    #[error("{0}")]
    ViewNotFound(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("the service is shutting down")]
    Unavailable,
    /// A stored model that could not be recovered at start-up: kept in the store as it is,
    /// not served; the other models are.
    #[error(
        "model `{id}` is in the store but could not be recovered ({why}); the daemon serves \
         the other models, and keeps this one's stored data untouched until it is deleted"
    )]
    Unrecovered { id: String, why: String },
    /// The durable store refused or failed a write: nothing was acknowledged, and the model is
    /// reloaded from what the store holds before its next operation.
    #[error("storage: {0}")]
    Storage(String),
    /// The model belongs to another node of the fleet (its lease holds): ask that node.
    #[error("model `{id}` is owned by node `{node}`; send the request to {url}")]
    Elsewhere {
        id: String,
        node: String,
        url: String,
    },
    /// The model's shard has this many requests queued already: the daemon is overloaded.
    #[error(
        "the daemon is overloaded ({0} requests are queued for this model's shard); retry shortly"
    )]
    Busy(usize),
    /// A fold-back whose effect fired again with another key meanwhile: not applied.
    #[error("effect `{0}` was superseded: its dedupe key changed while it ran")]
    Superseded(String),
    /// An idempotency key sent again with a different request: nothing was applied.
    #[error(
        "idempotency key `{key}` was used for another request to model `{id}`; a retry must \
         send the same request, a new request a new key"
    )]
    KeyReused { id: String, key: String },
}

impl ServiceError {
    /// The contract's structured failure body (schema violation, constraint violation, version
    /// conflict), the same on every surface; `None` for failures that are only a message.
    pub fn structured(&self) -> Option<Json> {
        match self {
            ServiceError::Mutation(
                m @ (MutationError::Schema(_) | MutationError::Constraint { .. }),
            ) => Some(m.to_json()),
            ServiceError::Elsewhere { node, url, .. } => Some(serde_json::json!({
                "error": "Owned by another node",
                "owner": node,
                "ownerUrl": url,
                "message": self.to_string(),
            })),
            ServiceError::VersionConflict { expected, actual } => Some(serde_json::json!({
                "error": "Version conflict",
                "expected": expected,
                "actual": actual,
                "message": self.to_string(),
            })),
            _ => None,
        }
    }
}

pub(super) fn findings_text(f: &[Finding]) -> String {
    f.iter()
        .map(|f| {
            if f.location.is_empty() {
                f.message.clone()
            } else {
                format!("{}: {}", f.location, f.message)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// A committed change, as subscribers see it.
#[derive(Clone, Debug)]
pub enum Event {
    Mutation {
        model_id: String,
        result: Arc<MutationResult>,
    },
    SpecEvolved {
        model_id: String,
        version: String,
    },
    Restored {
        model_id: String,
    },
    /// A model was created (the list of models changed).
    Created {
        model_id: String,
    },
    Deleted {
        model_id: String,
    },
    /// A fleet's node gave the model up (evicted and released, or taken by another node after
    /// its lease ran out): its next events happen on whichever node owns it next, so a
    /// subscription here ends and is opened again (any node forwards it to the owner).
    Moved {
        model_id: String,
    },
}

impl Event {
    pub fn model_id(&self) -> &str {
        match self {
            Event::Mutation { model_id, .. }
            | Event::SpecEvolved { model_id, .. }
            | Event::Restored { model_id }
            | Event::Created { model_id }
            | Event::Deleted { model_id }
            | Event::Moved { model_id } => model_id,
        }
    }
}

/// Which events a subscriber wants; evaluated on the shard thread, so it must be cheap and
/// must not wait on anything that may wait on the service.
pub type EventFilter = Arc<dyn Fn(&Event) -> bool + Send + Sync>;

/// Change subscribers; a closed receiver is dropped at the next event it would receive.
/// Events nobody asked for are not sent, so an idle subscriber costs no thread wake-up.
#[derive(Default)]
pub(crate) struct Subscribers {
    pub(super) list: Mutex<Vec<(EventFilter, EventSink)>>,
}

/// Where a subscriber's events go; returns false once the subscriber is gone (it is dropped).
pub type EventSink = Box<dyn Fn(&Event) -> bool + Send>;

impl Subscribers {
    pub(crate) fn publish(&self, e: Event) {
        if let Ok(mut l) = self.list.lock() {
            l.retain(|(wants, sink)| !wants(&e) || sink(&e));
        }
    }
}
