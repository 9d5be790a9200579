//! The reactive engine: a compiled model plus its persistent state, and the reactive cycle that
//! every mutation runs (validate → apply → defaults → propagate → derive by level → meta →
//! constraints → effects requested → commit). Atomic: a failed cycle leaves the state exactly as
//! it was. Never does I/O and never reads the clock; the caller passes `now`.

// What is not part of the crate's API is pub(crate): the compiler keeps it so.
#![warn(unreachable_pub)]

pub mod compile;
mod cycle;
pub use cycle::Undo;
pub mod graph;
pub mod jit;
pub mod merged;
pub mod schema;
mod shapes;
pub mod testrun;
pub mod trace;
pub mod trie;
pub mod validate;
pub mod view;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use imbl::{OrdMap, OrdSet};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value as Json};

pub use compile::{CompileError, CompiledModel, NodeId};
pub use schema::SchemaViolation;
pub use trace::{Paths, Trace, TraceSource, TraceTable, Traces};

use merged::{Cells, Merged};
use valem_core::expr::path::{render, Address};
use valem_core::expr::Limits;
use valem_core::prefetch;
use valem_core::spec::{kind_of, ModelSpec};
pub use valem_core::time::Timestamp;
use valem_core::value::{json_deeper_than, room_below, Seg, TooDeep, Val, MAX_DEPTH};

/// A mutation of at most this many writes starts loading what each reads first
/// ([`Model::prefetch_write`]); a larger batch would evict the first before it is used.
const PREFETCH_WRITES: usize = 4;

/// Limits of the engine beyond expression evaluation.
#[derive(Clone, Debug)]
pub struct EngineLimits {
    pub expr: Limits,
    /// Largest array index a write may create (the reference's `max-array-index`).
    pub max_array_index: usize,
    /// Most mutations in one cycle.
    pub max_mutations: usize,
    /// Time one cycle may take, all its evaluations together, on the caller's clock: past it
    /// the cycle stops at its next evaluation, rolls back and fails (each evaluation is
    /// bounded by `expr.timeout_ms` too, so a cycle ends within about one evaluation timeout
    /// of its budget). `None`: unbounded, as a replay of committed records must be.
    pub cycle_budget: Option<CycleBudget>,
    /// Most instances one `[*]` derivation, meta-derivation or constraint may have in a
    /// cycle (the elements of the arrays its pattern spans).
    pub max_instances: usize,
    /// The arithmetic fast path's settings.
    pub jit: JitConfig,
}

/// A monotonic clock in milliseconds. The engine reads no clock of its own: a caller that
/// wants a cycle's time bounded gives it one (the service's is the kernel's coarse clock).
pub type Clock = fn() -> u64;

/// The time one cycle may take.
#[derive(Clone, Copy, Debug)]
pub struct CycleBudget {
    pub ms: u64,
    pub clock: Clock,
}

/// The JIT tier: whether it runs, and after how many runs of a node its code is requested.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JitConfig {
    /// Off: every arithmetic derivation is interpreted by JSONata (the answers are the same).
    pub enabled: bool,
    /// Runs of a node before its code is requested (0: at once); the IR interpreter answers
    /// until the code is ready.
    pub tier_after: u32,
}

impl Default for JitConfig {
    fn default() -> Self {
        JitConfig {
            enabled: true,
            tier_after: 2,
        }
    }
}

impl EngineLimits {
    /// These limits without the bounds on a cycle's work (its time budget, its instances),
    /// for cycles that rebuild committed state: a replay, a recompute, a read materialising
    /// lazy values.
    pub fn unbounded(&self) -> EngineLimits {
        EngineLimits {
            cycle_budget: None,
            max_instances: usize::MAX,
            ..self.clone()
        }
    }
}

impl Default for EngineLimits {
    fn default() -> Self {
        EngineLimits {
            expr: Limits::default(),
            max_array_index: 1_000_000,
            max_mutations: 10_000,
            cycle_budget: None,
            max_instances: 200_000,
            jit: JitConfig::default(),
        }
    }
}

/// A live meta value and the node that computed it.
#[derive(Clone, Debug, PartialEq)]
pub struct MetaEntry {
    pub node: NodeId,
    pub value: Val,
}

/// A model's state: base document, merged document (base + derived values: the tree and the
/// cells, `merged.rs`), meta cache, stale lazy derivations and effect dedupe keys. Every part is
/// persistent, so cloning is O(1): a snapshot, a rollback point or a reader's view is a clone.
#[derive(Clone, Debug, Default)]
pub struct State {
    pub base: Val,
    /// The merged document's tree; `None` when it is `base` itself (no derivation of the
    /// model writes into the tree).
    tree: Option<Val>,
    /// Derived values of top-level members.
    cells: Cells,
    /// `"$.path#prop"` (the reference's key spelling) → value.
    pub meta: OrdMap<Arc<str>, MetaEntry>,
    pub lazy_stale: OrdSet<NodeId>,
    /// Effect id → the dedupe key it last fired with.
    pub effect_keys: OrdMap<Arc<str>, Val>,
    /// What the delta-kept aggregates last saw (a cache of `merged`; not observable).
    pub aggregates: OrdMap<NodeId, AggMemo>,
}

/// An aggregate's running totals over its leaves (`cycle.rs`, delta aggregates). `exact`: every
/// leaf is an integer and the sum of their magnitudes is at most 2^53, so any order of
/// additions — the left-to-right scan, or a delta — gives the same, exact, sum.
#[derive(Clone, Debug, PartialEq)]
pub struct AggMemo {
    pub sum: f64,
    pub abs_sum: f64,
    pub count: usize,
    pub exact: bool,
    /// When the sum is not exact and every element of the array has its number: those numbers
    /// in order. A changed leaf is replaced here and the sum taken again over them, left to
    /// right as the scan does (the same bits), without walking the document.
    pub leaves: Option<Arc<Vec<f64>>>,
}

impl State {
    /// An empty state for a compiled model.
    fn empty(cm: &CompiledModel) -> State {
        State {
            base: Val::object(),
            tree: (!cm.merged_is_base).then(Val::object),
            cells: Cells::new(cm.cells.clone()),
            ..State::default()
        }
    }

    /// The merged document: base values and derived values.
    #[inline]
    pub fn merged(&self) -> Merged<'_> {
        Merged {
            doc: self.tree.as_ref().unwrap_or(&self.base),
            cells: &self.cells,
        }
    }

    /// The merged document as JSON in the reference's order (lazy values as they stand).
    pub fn merged_json(&self) -> Json {
        self.merged().ordered_json(&self.base)
    }

    pub fn meta_json(&self) -> Map<String, Json> {
        self.meta
            .iter()
            .map(|(k, e)| (k.to_string(), e.value.to_json()))
            .collect()
    }

    /// Byte-level fingerprint of everything observable, for tests that assert "unchanged".
    pub fn fingerprint(&self) -> String {
        let meta = self.meta_json();
        let keys: Map<String, Json> = self
            .effect_keys
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_json()))
            .collect();
        let stale: Vec<u32> = self.lazy_stale.iter().copied().collect();
        serde_json::json!({
            "base": self.base.to_json(),
            "merged": self.merged_json(),
            "meta": meta,
            "stale": stale,
            "effectKeys": keys,
        })
        .to_string()
    }
}

/// A failed constraint (the contract's violation item).
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConstraintViolation {
    pub constraint_id: String,
    pub message: String,
    #[schemars(extend("enum" = ["rollback", "flag"]))]
    pub policy: &'static str,
}

/// An effect the cycle requested; executed (if at all) by the shell after commit.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EffectRequest {
    pub effect_id: String,
    pub executor: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub emit: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<Map<String, Json>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedupe_key: Option<Json>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_path: Option<String>,
    /// Timer effects: the fire time (epoch ms or ISO-8601) or the delay, as evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<Json>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_ms: Option<Json>,
}

/// The outcome of a committed cycle.
#[derive(Clone, Debug, PartialEq, Serialize, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = traces_schema)]
pub struct MutationResult {
    pub success: bool,
    /// The base addresses the mutation wrote.
    #[schemars(with = "Vec<String>")]
    pub mutated_paths: trace::PathList,
    /// The derived addresses whose values changed.
    #[schemars(with = "Vec<String>")]
    pub derived_updated: Paths,
    /// The meta keys (`$.path#prop`) whose values changed.
    pub meta_updated: Vec<String>,
    /// Violated `flag` constraints (the mutation committed anyway).
    pub flagged_constraints: Vec<ConstraintViolation>,
    /// Effects the cycle requested.
    pub dispatched_effects: Vec<EffectRequest>,
    /// Not serialized: `to_json(true)` adds it (the schema gets it from `traces_schema`).
    #[serde(skip)]
    pub traces: Traces,
}

/// The schema of the optional `traces` array `to_json(true)` adds. Self-contained (inlined), as a
/// transform has no generator to reference `Trace` through.
fn traces_schema(schema: &mut schemars::Schema) {
    let mut traces = schemars::generate::SchemaSettings::draft2020_12()
        .for_serialize()
        .with(|s| s.inline_subschemas = true)
        .into_generator()
        .subschema_for::<Vec<Trace>>();
    traces.insert(
        "description".into(),
        "Every evaluation of the cycle; present only when traces were requested.".into(),
    );
    if let Some(Json::Object(props)) = schema.ensure_object().get_mut("properties") {
        props.insert("traces".into(), traces.to_value());
    }
}

impl MutationResult {
    /// A result read back from its wire shape (`to_json(false)`), as kept with an idempotency
    /// key or sent in a WebSocket frame (which has no `success` or `metaUpdated`: committed, no
    /// meta named); `None` when `v` is not one. Its traces are not kept.
    pub fn from_json(v: &Json) -> Option<MutationResult> {
        let strings = |key: &str| -> Option<Vec<&str>> {
            v.get(key)?.as_array()?.iter().map(Json::as_str).collect()
        };
        let mutated_paths: trace::PathList = strings("mutatedPaths")?.into_iter().collect();
        let derived_updated: Paths = strings("derivedUpdated")?.into_iter().collect();
        let flagged = v
            .get("flaggedConstraints")?
            .as_array()?
            .iter()
            .map(|c| {
                Some(ConstraintViolation {
                    constraint_id: c.get("constraintId")?.as_str()?.to_string(),
                    message: c.get("message")?.as_str()?.to_string(),
                    policy: match c.get("policy")?.as_str()? {
                        "rollback" => "rollback",
                        _ => "flag",
                    },
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let meta_updated = match v.get("metaUpdated") {
            None => Vec::new(),
            Some(_) => strings("metaUpdated")?
                .into_iter()
                .map(str::to_string)
                .collect(),
        };
        Some(MutationResult {
            success: match v.get("success") {
                None => true,
                Some(b) => b.as_bool()?,
            },
            mutated_paths,
            derived_updated,
            meta_updated,
            flagged_constraints: flagged,
            dispatched_effects: serde_json::from_value(v.get("dispatchedEffects")?.clone()).ok()?,
            traces: Traces::default(),
        })
    }

    /// The wire shape; traces only on request.
    pub fn to_json(&self, include_traces: bool) -> Json {
        let mut v = serde_json::to_value(self).unwrap_or(Json::Null);
        if include_traces {
            if let Json::Object(m) = &mut v {
                m.insert(
                    "traces".into(),
                    serde_json::to_value(&self.traces).unwrap_or(Json::Null),
                );
            }
        }
        v
    }
}

/// Why a cycle did not commit. The state is unchanged in every case.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum MutationError {
    #[error("Schema violation: {}", .0.iter().map(|v| format!("{}: {}", v.path, v.message)).collect::<Vec<_>>().join("; "))]
    Schema(Vec<SchemaViolation>),
    #[error("{}", constraint_message(.violations))]
    Constraint {
        violations: Vec<ConstraintViolation>,
        traces: Traces,
    },
    #[error("invalid mutation: {0}")]
    Invalid(String),
}

fn constraint_message(v: &[ConstraintViolation]) -> String {
    match v {
        [one] => format!("Constraint violated: {}", one.message),
        many => format!(
            "{} constraints violated: [{}]",
            many.len(),
            many.iter()
                .map(|c| c.message.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

impl MutationError {
    /// The contract's structured error body.
    pub fn to_json(&self) -> Json {
        match self {
            MutationError::Schema(v) => serde_json::json!({
                "error": "Schema violation",
                "violations": v,
            }),
            MutationError::Constraint { violations, .. } => serde_json::json!({
                "error": "Constraint violation",
                "message": self.to_string(),
                "violations": violations,
            }),
            MutationError::Invalid(m) => serde_json::json!({
                "error": "Invalid mutation",
                "message": m,
            }),
        }
    }
}

/// Why a model could not be created.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CreateError {
    #[error("the spec does not compile: {}", .0.iter().map(|e| format!("{}: {}", e.location, e.message)).collect::<Vec<_>>().join("; "))]
    Compile(Vec<CompileError>),
    #[error("the initial state was refused: {0}")]
    Initial(MutationError),
}

thread_local! {
    /// Compiled models by their spec's content (see [`content_hash`]): every model of one
    /// content on this thread shares one compiled model, held only by the models using it;
    /// the newest few small ones are also kept alive for dry runs, tests and re-creation.
    /// Compiled models are not `Send`, so the cache is per thread.
    static COMPILED: RefCell<CompiledCache> = RefCell::new(CompiledCache::default());
}
/// Compiled models kept alive by the cache itself, newest last.
const COMPILED_CACHE_SIZE: usize = 64;
/// Graph nodes the compiled models kept alive by the cache itself may have in all: a large
/// spec's compiled model (~0.7 KB a node) lives only as long as a model uses it, so that
/// deleting or evicting a model of a million derivations gives its memory back.
const COMPILED_CACHE_NODES: usize = 100_000;

struct CompiledCache {
    /// Every compiled model still alive, by content.
    live: HashMap<[u8; 32], std::rc::Weak<CompiledModel>>,
    /// The newest ones, kept alive by the cache.
    recent: std::collections::VecDeque<Rc<CompiledModel>>,
    /// The nodes of those in `recent`.
    recent_nodes: usize,
    /// At most this many nodes in `recent` ([`COMPILED_CACHE_NODES`]).
    node_budget: usize,
    /// `live`'s size after its last sweep of dead entries.
    swept: usize,
}

impl Default for CompiledCache {
    fn default() -> Self {
        CompiledCache {
            live: HashMap::new(),
            recent: std::collections::VecDeque::new(),
            recent_nodes: 0,
            node_budget: COMPILED_CACHE_NODES,
            swept: 0,
        }
    }
}

impl CompiledCache {
    fn get(&self, hash: &[u8; 32]) -> Option<Rc<CompiledModel>> {
        self.live.get(hash).and_then(std::rc::Weak::upgrade)
    }

    fn insert(&mut self, hash: [u8; 32], cm: &Rc<CompiledModel>) {
        self.live.insert(hash, Rc::downgrade(cm));
        let nodes = cm.nodes.len();
        if nodes <= self.node_budget {
            self.recent.push_back(cm.clone());
            self.recent_nodes += nodes;
        }
        while self.recent.len() > COMPILED_CACHE_SIZE || self.recent_nodes > self.node_budget {
            let Some(old) = self.recent.pop_front() else {
                break;
            };
            self.recent_nodes -= old.nodes.len();
        }
        // Sweep the dead entries once the map has doubled since the last sweep: amortised
        // O(1) per insert, and the map stays within twice the live compiled models.
        if self.live.len() > 2 * self.swept.max(COMPILED_CACHE_SIZE) {
            self.live.retain(|_, w| w.strong_count() > 0);
            self.swept = self.live.len();
        }
    }
}

/// The blake3 hash of a spec's content, its `id` left out (specs that differ only by it compile
/// to the same model), and of whether the arithmetic tier is on.
pub fn content_hash(spec: &ModelSpec, jit: bool) -> [u8; 32] {
    let text = serde_json::to_string(spec).unwrap_or_default();
    content_hash_of(&text, &spec.id, jit)
}

/// [`content_hash`] of a spec already serialised (`text`, its id `id`).
pub fn content_hash_of(text: &str, id: &str, jit: bool) -> [u8; 32] {
    // The id is the first member the spec serialises: hash what follows it. Should the text
    // ever start otherwise, the whole of it is hashed (no sharing, still exact).
    let mut prefix = br#"{"id":"#.to_vec();
    let bytes = text.as_bytes();
    let body = match serde_json::to_writer(&mut prefix, id) {
        Ok(()) => bytes.strip_prefix(prefix.as_slice()),
        Err(_) => None,
    };
    let mut h = blake3::Hasher::new();
    match body {
        Some(rest) => {
            h.update(b"{");
            h.update(rest);
        }
        None => {
            h.update(bytes);
        }
    }
    // Compiled with the tier off, arithmetic derivations keep their parsed form.
    h.update(&[u8::from(jit)]);
    *h.finalize().as_bytes()
}

thread_local! {
    /// The state and result a compiled model's creation seeds, by the compiled model's address
    /// (with a weak reference, which keeps that address from being reused while the entry is),
    /// for the compiled models whose creation does not depend on the instant (see
    /// [`clock_free`]): creating many models of one spec runs its seeding cycle once. `None`:
    /// this compiled model's seeding reads the clock.
    static SEEDED: RefCell<HashMap<usize, SeededEntry>> = RefCell::new(HashMap::new());
}
/// A compiled model (weakly) and its seeded state and result, when they can be reused.
type SeededEntry = (
    std::rc::Weak<CompiledModel>,
    Option<(State, MutationResult)>,
);
/// Seeded states kept (per thread); the oldest half goes when it is full.
const SEEDED_CACHE_SIZE: usize = 256;

/// Most nodes of a spec whose seeded state is kept: a large spec is seldom created twice, and a
/// kept copy would hold its initial state alive beside the model's.
const SEEDED_MAX_NODES: usize = 1024;

/// Whether nothing a creation evaluates can depend on the instant or on chance: no expression
/// text of the spec (the serialised spec as a whole, conservatively) names `$now`, `$millis`,
/// `$random` or `$eval` (whose code could name them). Only asked of small specs.
fn clock_free(spec: &ModelSpec) -> bool {
    let nodes = spec.derivations.len()
        + spec.meta_derivations.len()
        + spec.constraints.len()
        + spec.effects.len()
        + spec.default_values.len();
    if nodes > SEEDED_MAX_NODES {
        return false;
    }
    let text = serde_json::to_string(spec).unwrap_or_default();
    !["$now", "$millis", "$random", "$eval"]
        .iter()
        .any(|f| text.contains(f))
}

/// `cm`'s entry in [`SEEDED`], when it has one. The weak reference an entry holds keeps its
/// allocation, so no other compiled model can take its address: a live one is `cm`'s.
fn seeded_entry<'a>(
    c: &'a HashMap<usize, SeededEntry>,
    cm: &Rc<CompiledModel>,
) -> Option<&'a Option<(State, MutationResult)>> {
    let (weak, seeded) = c.get(&(Rc::as_ptr(cm) as usize))?;
    (weak.strong_count() > 0).then_some(seeded)
}

fn seeded(cm: &Rc<CompiledModel>) -> Option<(State, MutationResult)> {
    SEEDED.with(|c| seeded_entry(&c.borrow(), cm)?.clone())
}

fn remember_seeded(cm: &Rc<CompiledModel>, state: &State, result: &MutationResult) {
    if SEEDED.with(|c| seeded_entry(&c.borrow(), cm).is_some()) {
        return; // known already: its seeding reads the clock
    }
    let entry = clock_free(&cm.spec).then(|| (state.clone(), result.clone()));
    SEEDED.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= SEEDED_CACHE_SIZE {
            c.retain(|_, (w, _)| w.strong_count() > 0);
            if c.len() >= SEEDED_CACHE_SIZE {
                c.clear();
            }
        }
        c.insert(Rc::as_ptr(cm) as usize, (Rc::downgrade(cm), entry));
    });
}

/// Compile a spec, reusing the compiled model of a spec of the same content (its id aside)
/// that this thread compiled and that is still alive. The compiled model's `spec` is the first
/// such spec, so its `id` may be another model's.
pub fn compile_cached(
    spec: &ModelSpec,
    limits: &EngineLimits,
) -> Result<Rc<CompiledModel>, Vec<CompileError>> {
    compile_hashed(spec, content_hash(spec, limits.jit.enabled), limits)
}

/// [`compile_cached`] with the spec's [`content_hash`] already known (under `limits`' tier).
pub fn compile_hashed(
    spec: &ModelSpec,
    hash: [u8; 32],
    limits: &EngineLimits,
) -> Result<Rc<CompiledModel>, Vec<CompileError>> {
    if let Some(cm) = COMPILED.with(|c| c.borrow().get(&hash)) {
        return Ok(cm);
    }
    let cm = Rc::new(compile::compile(Arc::new(spec.clone()), limits)?);
    COMPILED.with(|c| c.borrow_mut().insert(hash, &cm));
    Ok(cm)
}

/// A cycle's writes with their addresses parsed (transient keys, see
/// [`Address::parse_transient`]): at most `max` of them, each at a concrete address.
pub fn parse_writes<K: AsRef<str>, V>(
    writes: impl ExactSizeIterator<Item = (K, V)>,
    max: usize,
) -> Result<Vec<(Vec<Seg>, V)>, MutationError> {
    if writes.len() > max {
        return Err(MutationError::Invalid(format!(
            "{} mutations in one cycle; the limit is {max}",
            writes.len()
        )));
    }
    let mut parsed = Vec::with_capacity(writes.len());
    for (k, v) in writes {
        let k = k.as_ref();
        let addr = Address::parse_transient(k).map_err(|e| MutationError::Invalid(e.message))?;
        let Some(segs) = addr.into_concrete() else {
            return Err(MutationError::Invalid(format!(
                "mutation address `{k}` contains `[*]`; write concrete element addresses"
            )));
        };
        parsed.push((segs, v));
    }
    Ok(parsed)
}

/// A live model: its compiled spec and its committed state.
pub struct Model {
    pub compiled: Rc<CompiledModel>,
    state: State,
    pub limits: EngineLimits,
    /// When recording ([`Model::record_undo`]): what each commit and materialisation changed
    /// since the log was last taken, oldest first.
    undo: Option<Vec<Undo>>,
}

impl Model {
    /// Create a model: `$` default rules and schema `default` keywords seed the document, then
    /// every eager derivation and meta-derivation is computed.
    pub fn create(
        spec: &ModelSpec,
        now: Timestamp,
        limits: EngineLimits,
    ) -> Result<(Model, MutationResult), CreateError> {
        let compiled = compile_cached(spec, &limits).map_err(CreateError::Compile)?;
        Model::from_compiled(compiled, now, limits)
    }

    /// [`create`](Self::create) with the spec's [`content_hash`] already known.
    pub fn create_hashed(
        spec: &ModelSpec,
        hash: [u8; 32],
        now: Timestamp,
        limits: EngineLimits,
    ) -> Result<(Model, MutationResult), CreateError> {
        let compiled = compile_hashed(spec, hash, &limits).map_err(CreateError::Compile)?;
        Model::from_compiled(compiled, now, limits)
    }

    pub fn from_compiled(
        compiled: Rc<CompiledModel>,
        now: Timestamp,
        limits: EngineLimits,
    ) -> Result<(Model, MutationResult), CreateError> {
        let now_ms = now.ms();
        if let Some((state, result)) = seeded(&compiled) {
            let model = Model {
                state,
                compiled,
                limits,
                undo: None,
            };
            return Ok((model, result));
        }
        let mut model = Model {
            state: State::empty(&compiled),
            compiled,
            limits,
            undo: None,
        };
        let result = cycle::initialize(&model.compiled, &model.limits, &mut model.state, now_ms)
            .map_err(CreateError::Initial)?;
        remember_seeded(&model.compiled, &model.state, &result);
        Ok((model, result))
    }

    /// A model over an existing base document (evolution, restore): every derivation and
    /// meta-derivation is recomputed from `base`; dedupe keys carry over.
    pub fn from_base(
        compiled: Rc<CompiledModel>,
        base: Val,
        effect_keys: OrdMap<Arc<str>, Val>,
        now: Timestamp,
        limits: EngineLimits,
    ) -> Model {
        let now_ms = now.ms();
        let mut model = Model {
            state: State {
                base,
                effect_keys,
                ..State::empty(&compiled)
            },
            compiled,
            limits,
            undo: None,
        };
        cycle::recompute(&model.compiled, &model.limits, &mut model.state, now_ms);
        model
    }

    /// Run one reactive cycle for `mutations` (applied in order).
    pub fn mutate(
        &mut self,
        mutations: &[(String, Json)],
        now: Timestamp,
    ) -> Result<MutationResult, MutationError> {
        // The values are borrowed, not copied (a load's is the whole document).
        let writes = mutations.iter().map(|(k, v)| (k, v));
        let parsed = parse_writes(writes, self.limits.max_mutations)?;
        self.mutate_parsed(&parsed, now)
    }

    /// Run a cycle for already-parsed addresses (their values owned or borrowed).
    pub fn mutate_parsed<J: std::borrow::Borrow<Json>>(
        &mut self,
        mutations: &[(Vec<Seg>, J)],
        now: Timestamp,
    ) -> Result<MutationResult, MutationError> {
        let now_ms = now.ms();
        if mutations.len() <= PREFETCH_WRITES {
            for (segs, _) in mutations {
                self.prefetch_write(segs);
            }
        }
        // Before anything walks a value (schema validation recurses as deep as it goes): an
        // address and its value may nest at most `MAX_DEPTH` levels together, a scalar at an
        // address of more segments than that included.
        for (segs, v) in mutations {
            // The document is an object whatever the schema says (a snapshot, a patch and the
            // merged document's derived members need one).
            let root = match (segs.first(), J::borrow(v)) {
                (None, Json::Object(_)) | (Some(Seg::Field(_)), _) => None,
                (None, other) => Some(format!("writes {} at $", kind_of(other))),
                (Some(Seg::Index(_)), _) => Some(format!("indexes it at {}", render(segs))),
            };
            if let Some(what) = root {
                return Err(MutationError::Invalid(format!(
                    "the document is an object; this mutation {what}"
                )));
            }
            if segs.len() > MAX_DEPTH {
                return Err(MutationError::Invalid(format!(
                    "address {} is {} levels deep; a document nests at most {MAX_DEPTH}",
                    render(segs),
                    segs.len()
                )));
            }
            if json_deeper_than(J::borrow(v), room_below(segs.len())) {
                return Err(MutationError::Invalid(format!(
                    "the value written at {}: {TooDeep}",
                    render(segs)
                )));
            }
        }
        let mut violations = Vec::new();
        for (segs, v) in mutations {
            violations.extend(schema::validate_write(
                &self.compiled,
                &self.state.meta,
                segs,
                J::borrow(v),
            ));
        }
        if !violations.is_empty() {
            return Err(MutationError::Schema(violations));
        }
        cycle::run(
            &self.compiled,
            &self.limits,
            &mut self.state,
            mutations,
            now_ms,
            self.undo.as_mut(),
        )
    }

    /// Start loading what a write of a top-level member reads first, so that those cache
    /// misses overlap the validation instead of following one another: the member in the
    /// document and, when one derivation alone reads it, that derivation's node.
    fn prefetch_write(&self, segs: &[Seg]) {
        let Some(Seg::Field(k)) = segs.first() else {
            return;
        };
        if let Val::Obj(o) = &self.state.base {
            o.prefetch_hashed(valem_core::value::member_hash(k));
        }
        if let Some(leaf) = self.compiled.readers.member(k).and_then(|(_, m)| m.leaf()) {
            self.compiled.prefetch_node(leaf);
        }
    }

    /// Run `f` without the limits on a cycle's work ([`EngineLimits::unbounded`]): a replay of
    /// records that committed once must commit again, however long it takes here and now.
    pub fn unbounded<R>(&mut self, f: impl FnOnce(&mut Model) -> R) -> R {
        let limits = std::mem::take(&mut self.limits);
        self.limits = limits.unbounded();
        let out = f(self);
        self.limits = limits;
        out
    }

    /// Start (or stop) logging what every later commit and materialisation changes, so that
    /// earlier states can be rebuilt from the current one ([`Model::state_before`]) instead of
    /// being kept: a kept state makes the next commit copy what it writes.
    pub fn record_undo(&mut self, on: bool) {
        self.undo = on.then(Vec::new);
    }

    /// The changes logged since the last call, oldest first (empty when not recording).
    pub fn take_undo(&mut self) -> Vec<Undo> {
        self.undo.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The current state with `changes` undone, given newest first: the state from before the
    /// oldest of them when they are every change since then.
    pub fn state_before<'u>(&self, changes: impl IntoIterator<Item = &'u Undo>) -> State {
        let mut st = self.state.clone();
        for u in changes {
            u.apply(&mut st);
        }
        st
    }

    /// The committed state (lazy derivations may be stale: see [`Model::materialize`]).
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Evaluate stale lazy derivations (reads do this before answering).
    pub fn materialize(&mut self, now: Timestamp) {
        let now_ms = now.ms();
        if self.state.lazy_stale.is_empty() {
            return;
        }
        cycle::materialize_lazy(
            &self.compiled,
            &self.limits,
            &mut self.state,
            now_ms,
            self.undo.as_mut(),
        );
    }

    /// The merged document as JSON, lazy derivations evaluated.
    pub fn merged_json(&mut self, now: Timestamp) -> Json {
        self.materialize(now);
        self.state.merged_json()
    }

    /// The value at an address (lazy derivations evaluated); `None` when absent.
    pub fn get(&mut self, path: &[Seg], now: Timestamp) -> Option<Json> {
        self.materialize(now);
        if path.is_empty() {
            return Some(self.state.merged_json());
        }
        let merged = self.state.merged().get_path(path)?;
        Some(ordered_json(self.state.base.get_path(path), merged))
    }

    /// Replace the state wholesale (restore of a snapshot taken from this model).
    pub fn restore(&mut self, state: State) {
        self.state = state;
        self.forget_undo();
    }

    /// A change not logged (restore, reset): the logged changes no longer lead back from here.
    fn forget_undo(&mut self) {
        if let Some(log) = &mut self.undo {
            log.clear();
        }
    }

    /// Replace the base document and recompute everything derived from it.
    pub fn reset_base(&mut self, base: Val, now: Timestamp) {
        let now_ms = now.ms();
        self.state.base = base;
        cycle::recompute(&self.compiled, &self.limits, &mut self.state, now_ms);
        self.forget_undo();
    }

    /// Derived values: every address whose merged value is not (or not wholly) the base value,
    /// keyed by canonical address (the snapshot's `derivedCache`).
    pub fn derived_cache(&mut self, now: Timestamp) -> Map<String, Json> {
        self.materialize(now);
        let mut out = Map::new();
        self.state.merged().derived_diff(&self.state.base, &mut out);
        out
    }

    pub fn meta_value(&self, path: &[Seg], prop: valem_core::spec::MetaProp) -> Option<Json> {
        let key = format!("{}#{}", render(path), prop.key_name());
        self.state.meta.get(key.as_str()).map(|e| e.value.to_json())
    }
}

pub use merged::ordered_json;

// The unit tests count their allocations, so that memory budgets are enforced there too.
#[cfg(test)]
#[global_allocator]
static GLOBAL: valem_core::budget::Counting<std::alloc::System> =
    valem_core::budget::Counting(std::alloc::System);

#[cfg(test)]
mod compiled_cache_tests {
    use super::*;

    fn compiled(n: usize) -> Rc<CompiledModel> {
        let derivations: Vec<_> = (0..n)
            .map(|i| serde_json::json!({"path": format!("$.d{i}"), "expr": format!("x + {i}")}))
            .collect();
        let spec = valem_core::spec::parse_spec(&serde_json::json!({
            "id": "c", "schema": {}, "derivations": derivations
        }))
        .unwrap();
        Rc::new(compile::compile(Arc::new(spec), &EngineLimits::default()).unwrap())
    }

    /// The cache keeps the newest compiled models alive within its node budget: a model
    /// larger than the budget lives only while something uses it, and newer ones push the
    /// oldest out once the budget is passed.
    #[test]
    fn the_cache_keeps_the_newest_compiled_models_within_its_node_budget() {
        let mut c = CompiledCache {
            node_budget: 10,
            ..CompiledCache::default()
        };
        c.insert([1; 32], &compiled(3));
        assert!(c.get(&[1; 32]).is_some(), "kept by the cache");
        let big = compiled(11);
        c.insert([2; 32], &big);
        assert!(c.get(&[2; 32]).is_some(), "alive while used");
        drop(big);
        assert!(c.get(&[2; 32]).is_none(), "over the budget: not kept");
        assert!(c.get(&[1; 32]).is_some());
        for i in 3..6 {
            c.insert([i; 32], &compiled(3));
        }
        assert!(c.get(&[1; 32]).is_none(), "the oldest went");
        assert!((3..6).all(|i| c.get(&[i; 32]).is_some()));
        assert_eq!((c.recent.len(), c.recent_nodes), (3, 9));
    }
}

#[cfg(test)]
mod flat_model_tests {
    use super::*;
    use serde_json::json;

    /// A write of the whole document to a flat model (its producers answered from its cells)
    /// recomputes every derivation, even one that reads nothing, and a later write of one
    /// member only its readers.
    #[test]
    fn a_root_write_to_a_flat_model_recomputes_every_derivation() {
        let spec = valem_core::spec::parse_spec(&json!({"id": "f", "schema": {}, "derivations": [
            {"path": "$.a", "expr": "x + 1"},
            {"path": "$.b", "expr": "a * 2"},
            {"path": "$.c", "expr": "y - 1"},
            {"path": "$.k", "expr": "5"}
        ]}))
        .unwrap();
        let now = Timestamp::from_ms(0);
        let (mut m, _) = Model::create(&spec, now, EngineLimits::default()).unwrap();
        let r = m
            .mutate(&[("$".into(), json!({"x": 1, "y": 10}))], now)
            .unwrap();
        assert_eq!(r.traces.len(), 4);
        assert_eq!(
            m.merged_json(now),
            json!({"x": 1, "y": 10, "a": 2, "c": 9, "k": 5, "b": 4})
        );
        // `k` reads nothing: only the root write's marking brings it back.
        let r = m.mutate(&[("$".into(), json!({"x": 5}))], now).unwrap();
        assert_eq!(r.traces.len(), 4);
        assert_eq!(
            m.merged_json(now),
            json!({"x": 5, "a": 6, "c": null, "k": 5, "b": 12})
        );
        let r = m.mutate(&[("$.y".into(), json!(3))], now).unwrap();
        assert_eq!(r.traces.len(), 1);
        assert_eq!(
            m.get(&[valem_core::value::Seg::Field("c".into())], now),
            Some(json!(2))
        );
    }
}
