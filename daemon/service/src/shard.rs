//! One shard: the models it owns and every operation on them. Runs on the shard's own thread
//! only (compiled models are not `Send`), so nothing here locks.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde_json::{json, Map, Value as Json};

use super::audit::{AuditTrail, Entry as AuditEntry};
use super::metrics::{CheckpointMetrics, CycleMetrics};
use super::time::{iso, now_us};
use super::{
    AuditQuery, Event, ModelInfo, Reply, ServiceError, ServiceLimits, Source, Subscribers,
};
use valem_core::expr::path::{render, Address};
use valem_core::spec::evolve;
use valem_core::spec::{ModelSpec, SpecEvolution};
use valem_core::value::{Seg, Val};
use valem_engine::schema::{effective_schema, SchemaViolation};
use valem_engine::validate::Finding;
use valem_engine::view::ViewError;
use valem_engine::{
    compile_cached, CreateError, Model, MutationError, MutationResult, Trace, Undo,
};
use valem_store::{AuditAppend, CheckpointChoice, CheckpointKind, Op, Store, StoredModel};

/// A live model and its rings.
pub(super) struct Entry {
    pub spec: Arc<ModelSpec>,
    pub model: Model,
    /// The newest commits, oldest first: the state after each is rebuilt from the current one
    /// by undoing what came after it (see [`Commit`]).
    history: VecDeque<Commit>,
    /// Most recent traces, oldest first.
    traces: VecDeque<Trace>,
    audit: AuditTrail,
    /// Last commit time: commit times are strictly increasing per model.
    last_us: i64,
    /// The verification report of `spec` (a pure function of it), once computed.
    verification: Option<Arc<Json>>,
    /// Set (by the store's writer) when a write of this model failed: memory is ahead of the
    /// store, so the model is reloaded from the store before its next operation.
    stale: Arc<std::sync::atomic::AtomicBool>,
    /// The sequence of the newest checkpoint written (with a store).
    checkpointed: Option<u64>,
    /// When the model was created (µs): nothing exists before it.
    created_us: i64,
    /// When its spec last changed (creation or evolve, µs): the history starts there.
    evolved_us: i64,
}

/// One commit of the history ring: its time, and what changed after it up to and including the
/// next commit (the model's undo log: materialised lazy values, then that commit's cycle).
/// The ring keeps these journals rather than a state per commit: a kept state is shared with
/// the live one, so the next commit would copy every branch on the paths it writes (criterion,
/// 100k fan-out: 7.4 µs a commit that way, 1.9 µs this way).
struct Commit {
    at_us: i64,
    after: Vec<Undo>,
}

impl Entry {
    /// Record a commit at `t` (µs) in the ring, keeping the newest `max`.
    fn remember(&mut self, t: i64, max: usize) {
        self.settle_history();
        self.history.push_back(Commit {
            at_us: t,
            after: Vec::new(),
        });
        while self.history.len() > max.max(1) {
            self.history.pop_front();
        }
    }

    /// Start the ring again at `t` (creation, evolution, restore): nothing before is carried;
    /// the model logs its changes from here.
    fn restart_history(&mut self, t: i64) {
        self.model.record_undo(true);
        self.history.clear();
        self.remember(t, 1);
    }

    /// Move what the model logged since the newest commit into that commit's entry.
    fn settle_history(&mut self) {
        let logged = self.model.take_undo();
        if let Some(last) = self.history.back_mut() {
            last.after.extend(logged);
        }
    }

    /// The merged document as it was right after the newest commit at or before `at` (µs), if
    /// the ring still holds it.
    fn state_at(&mut self, at: i64) -> Option<Json> {
        self.settle_history();
        let k = self.history.iter().rposition(|c| c.at_us <= at)?;
        let later = self.history.range(k..).rev();
        let st = self
            .model
            .state_before(later.flat_map(|c| c.after.iter().rev()));
        Some(st.merged_json())
    }

    fn tick(&mut self) -> i64 {
        let t = now_us().max(self.last_us + 1);
        self.last_us = t;
        t
    }
}

pub(super) struct Shard {
    models: HashMap<String, Entry>,
    /// Stored models whose recovery failed, with why: they stay in the store, untouched, and
    /// every request for one answers that (see [`ServiceError::Unrecovered`]); deleting one
    /// drops what is stored.
    unrecovered: HashMap<String, String>,
    store: Option<Arc<dyn Store>>,
    limits: ServiceLimits,
    subscribers: Arc<Subscribers>,
    metrics: Arc<CycleMetrics>,
    checkpoint_metrics: Arc<CheckpointMetrics>,
    /// The audit-store plugin's feed, once one is attached.
    audit_sink: Arc<std::sync::OnceLock<super::audit_sink::AuditSink>>,
}

/// The model `spec` defines, with the base document and effect dedupe keys of a checkpoint
/// (`{base, effectKeys}`), evaluated at `at_us`.
fn model_at(
    spec: &ModelSpec,
    state: &Json,
    at_us: i64,
    limits: &valem_engine::EngineLimits,
) -> Result<Model, ServiceError> {
    let compiled = compile_cached(spec, limits).map_err(|errs| {
        ServiceError::Storage(format!(
            "the stored spec of model `{}` no longer compiles: {}",
            spec.id,
            errs.iter()
                .map(|e| e.message.clone())
                .collect::<Vec<_>>()
                .join("; ")
        ))
    })?;
    let base = Val::from_json(state.get("base").unwrap_or(&Json::Null));
    let keys = state
        .get("effectKeys")
        .and_then(Json::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (Arc::<str>::from(k.as_str()), Val::from_json(v)))
                .collect()
        })
        .unwrap_or_default();
    Ok(Model::from_base(
        compiled,
        base,
        keys,
        at_us / 1000,
        limits.clone(),
    ))
}

/// The store write of `spec` as the model's current spec, at `at_us`.
fn put_model_op(spec: &ModelSpec, at_us: i64) -> Result<Op, ServiceError> {
    let text = serde_json::to_string(spec).map_err(|e| ServiceError::Storage(e.to_string()))?;
    Ok(Op::PutModel {
        id: spec.id.clone(),
        spec_text: text,
        version: spec.version_or_default().to_string(),
        at_us,
    })
}

/// A checkpoint of `e` as it is now: after its newest record (before any, when it has none).
/// `Base` when the state was set outside the records (a restore, an evolve).
fn checkpoint_op(id: &str, e: &Entry, kind: CheckpointKind) -> Op {
    let st = e.model.state();
    let keys: Map<String, Json> = st
        .effect_keys
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_json()))
        .collect();
    Op::Checkpoint {
        model_id: id.to_string(),
        sequence: e.audit.head(),
        at_us: e.last_us,
        state: json!({"base": st.base.to_json(), "effectKeys": keys}),
        kind,
    }
}

/// The writes of one cycle: concrete paths and their new values.
type Writes = Vec<(Vec<Seg>, Json)>;

/// The writes a stored audit record committed.
fn record_writes(rec: &valem_store::AuditEntry) -> Result<Writes, String> {
    let Some(Json::Object(muts)) = rec.record.get("mutations") else {
        return Err(format!("record {} has no mutations object", rec.sequence));
    };
    muts.iter()
        .map(|(k, v)| {
            concrete(k)
                .map(|segs| (segs, v.clone()))
                .map_err(|x| format!("record {}: {x}", rec.sequence))
        })
        .collect()
}

/// Apply one stored audit record to `e` (recovery): its mutations at its time, then its record
/// back into the in-memory trail and rings.
fn replay(
    e: &mut Entry,
    rec: valem_store::AuditEntry,
    history_max: usize,
    explain_max: usize,
) -> Result<(), String> {
    let result = apply_record(&mut e.model, &rec)?;
    push_traces(&mut e.traces, result.traces.iter(), explain_max);
    e.remember(rec.at_us, history_max);
    e.last_us = e.last_us.max(rec.at_us);
    e.audit.push_stored(rec.sequence, rec.at_us, rec.record);
    Ok(())
}

/// Run the cycle a stored audit record committed, at its recorded time.
fn apply_record(
    model: &mut Model,
    rec: &valem_store::AuditEntry,
) -> Result<MutationResult, String> {
    let writes = record_writes(rec)?;
    model
        .unbounded(|m| m.mutate_parsed(&writes, rec.at_us / 1000))
        .map_err(|x| format!("record {} no longer commits: {x}", rec.sequence))
}

/// Feed model `id`'s stored records after `after` (up to `up_to_us`) to `f`, oldest first,
/// stopping at its first failure.
fn replay_stored(
    store: &dyn Store,
    id: &str,
    after: Option<u64>,
    up_to_us: Option<i64>,
    mut f: impl FnMut(valem_store::AuditEntry) -> Result<(), String>,
) -> Result<(), ServiceError> {
    let mut failure = None;
    store
        .audit_after(id, after, up_to_us, &mut |rec| match f(rec) {
            Ok(()) => std::ops::ControlFlow::Continue(()),
            Err(m) => {
                failure = Some(m);
                std::ops::ControlFlow::Break(())
            }
        })
        .map_err(|x| ServiceError::Storage(x.to_string()))?;
    match failure {
        None => Ok(()),
        Some(m) => Err(ServiceError::Storage(format!(
            "replaying model `{id}`: {m}"
        ))),
    }
}

fn compile_findings(errs: Vec<valem_engine::CompileError>) -> Vec<Finding> {
    errs.into_iter()
        .map(|e| Finding {
            location: e.location,
            message: e.message,
        })
        .collect()
}

fn create_error(e: CreateError) -> ServiceError {
    match e {
        CreateError::Compile(errs) => ServiceError::InvalidSpec(compile_findings(errs)),
        CreateError::Initial(m) => ServiceError::Mutation(m),
    }
}

fn concrete(path: &str) -> Result<Vec<Seg>, ServiceError> {
    let addr = Address::parse(path).map_err(|e| ServiceError::BadRequest(e.message))?;
    addr.concrete().ok_or_else(|| {
        ServiceError::BadRequest(format!(
            "`{path}` contains `[*]`; name one element (e.g. `[0]`)"
        ))
    })
}

impl Shard {
    pub fn new(
        limits: ServiceLimits,
        subscribers: Arc<Subscribers>,
        metrics: Arc<CycleMetrics>,
        checkpoint_metrics: Arc<CheckpointMetrics>,
        store: Option<Arc<dyn Store>>,
        audit_sink: Arc<std::sync::OnceLock<super::audit_sink::AuditSink>>,
    ) -> Shard {
        Shard {
            models: HashMap::new(),
            unrecovered: HashMap::new(),
            store,
            limits,
            subscribers,
            metrics,
            checkpoint_metrics,
            audit_sink,
        }
    }

    pub fn entry(&mut self, id: &str) -> Result<&mut Entry, ServiceError> {
        let stale = self
            .models
            .get(id)
            .is_some_and(|e| e.stale.load(std::sync::atomic::Ordering::Acquire));
        if stale {
            self.reload(id)?;
        }
        self.entry_raw(id)
    }

    pub fn ids(&self) -> Vec<String> {
        self.models.keys().cloned().collect()
    }

    pub fn create(&mut self, spec: ModelSpec, reply: Reply<ModelInfo>) {
        if self.models.contains_key(&spec.id) {
            return reply.send(Err(ServiceError::Duplicate(spec.id)));
        }
        if let Some(why) = self.unrecovered.get(&spec.id) {
            return reply.send(Err(ServiceError::Unrecovered {
                id: spec.id,
                why: why.clone(),
            }));
        }
        let t = now_us();
        let persist = match &self.store {
            None => None,
            Some(_) => match put_model_op(&spec, t) {
                Ok(op) => Some(op),
                Err(e) => return reply.send(Err(e)),
            },
        };
        let (info, seeded) = match self.insert_seeded(spec, t) {
            Ok((e, seeded)) => (ModelInfo::of(&e.spec), seeded),
            Err(e) => return reply.send(Err(e)),
        };
        let id = info.id.clone();
        // Effects the seeding cycle requested reach the executors once the model is durable.
        let event = (!seeded.dispatched_effects.is_empty()).then(|| Event::Mutation {
            model_id: id.clone(),
            result: Arc::new(seeded),
        });
        self.durably(&id, persist, info, reply, event);
    }

    /// Compile `spec` into a fresh model created at `t` (µs) and register it.
    fn insert(&mut self, spec: ModelSpec, t: i64) -> Result<&mut Entry, ServiceError> {
        Ok(self.insert_seeded(spec, t)?.0)
    }

    /// [`insert`](Self::insert), with the result of the seeding cycle.
    fn insert_seeded(
        &mut self,
        spec: ModelSpec,
        t: i64,
    ) -> Result<(&mut Entry, MutationResult), ServiceError> {
        let (model, seeded) =
            Model::create(&spec, t / 1000, self.limits.engine.clone()).map_err(create_error)?;
        Ok((self.register(spec, model, t)?, seeded))
    }

    fn register(
        &mut self,
        spec: ModelSpec,
        model: Model,
        t: i64,
    ) -> Result<&mut Entry, ServiceError> {
        let id = spec.id.clone();
        self.models.insert(
            id.clone(),
            Entry {
                spec: Arc::new(spec),
                model,
                history: VecDeque::new(),
                traces: VecDeque::new(),
                audit: AuditTrail::new(
                    self.limits.audit_entries,
                    self.store.as_ref().and_then(|s| s.audit_key().copied()),
                ),
                last_us: t,
                verification: None,
                stale: Arc::default(),
                checkpointed: None,
                created_us: t,
                evolved_us: t,
            },
        );
        let e = self.entry_raw(&id)?;
        e.restart_history(t);
        Ok(e)
    }

    fn entry_raw(&mut self, id: &str) -> Result<&mut Entry, ServiceError> {
        if let Some(why) = self.unrecovered.get(id) {
            return Err(ServiceError::Unrecovered {
                id: id.to_string(),
                why: why.clone(),
            });
        }
        self.models
            .get_mut(id)
            .ok_or_else(|| ServiceError::NotFound(id.to_string()))
    }

    /// Answer `ok` now (no store, or nothing to write) or once `op` is durable, and only then tell
    /// the subscribers (`event`): nobody hears of a write a crash could still take back. A failed
    /// write marks model `id` stale and is announced to no one.
    fn durably<R: Send + 'static>(
        &self,
        id: &str,
        op: Option<Op>,
        ok: R,
        reply: Reply<R>,
        event: Option<Event>,
    ) {
        self.durably_then(id, op, ok, reply, event, None)
    }

    /// [`durably`](Self::durably), running `committed` too once the write is durable.
    fn durably_then<R: Send + 'static>(
        &self,
        id: &str,
        op: Option<Op>,
        ok: R,
        reply: Reply<R>,
        event: Option<Event>,
        then: Option<Box<dyn FnOnce() + Send>>,
    ) {
        let subscribers = self.subscribers.clone();
        match (&self.store, op) {
            (Some(store), Some(op)) => {
                let stale = self.models.get(id).map(|e| e.stale.clone());
                reply.after(&store.writer(), op, ok, move |committed| {
                    if !committed {
                        if let Some(s) = stale {
                            s.store(true, std::sync::atomic::Ordering::Release);
                        }
                        return;
                    }
                    if let Some(ev) = event {
                        subscribers.publish(ev);
                    }
                    if let Some(f) = then {
                        f();
                    }
                })
            }
            _ => {
                if let Some(ev) = event {
                    subscribers.publish(ev);
                }
                if let Some(f) = then {
                    f();
                }
                reply.send(Ok(ok));
            }
        }
    }

    /// Write a checkpoint of model `id` at its chain head (when it has records and the head is
    /// not checkpointed yet). Nobody waits for it: a lost checkpoint only means a longer replay.
    fn checkpoint(&mut self, id: &str) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let Ok(e) = self.entry_raw(id) else { return };
        let Some(seq) = e.audit.head() else { return };
        if e.checkpointed == Some(seq) {
            return;
        }
        e.checkpointed = Some(seq);
        let op = checkpoint_op(id, e, CheckpointKind::Periodic);
        let id = id.to_string();
        store.writer().submit(
            op,
            Box::new(move |r| {
                if let Err(err) = r {
                    tracing::warn!(model = %id, error = %err, "checkpoint not written");
                }
            }),
        );
    }

    /// Checkpoint every model at its head (shutdown: the next start replays nothing).
    pub fn checkpoint_all(&mut self) {
        for id in self.ids() {
            self.checkpoint(&id);
        }
    }

    /// Rebuild a model from the store: its spec, then every stored record replayed in order
    /// (each cycle at its recorded time, so the state is the one that was acknowledged). A model
    /// the store does not hold is dropped.
    /// Recover a stored model (see [`Shard::recover_model`]); one that cannot be is kept
    /// aside as unrecovered, so that the shard serves the others and answers for it.
    pub fn recover(&mut self, stored: StoredModel) -> Result<(), ServiceError> {
        let id = stored.id.clone();
        let result = self.recover_model(stored);
        let was = match &result {
            Ok(()) => self.unrecovered.remove(&id).is_some(),
            Err(e) => {
                self.models.remove(&id);
                self.unrecovered.insert(id, e.to_string()).is_some()
            }
        };
        if was != result.is_err() {
            self.checkpoint_metrics.unrecovered(result.is_err());
        }
        result
    }

    fn recover_model(&mut self, stored: StoredModel) -> Result<(), ServiceError> {
        let Some(store) = self.store.clone() else {
            return Ok(());
        };
        let id = stored.id.clone();
        self.models.remove(&id);
        let spec = valem_core::spec::parse_spec_text(&stored.spec_text).map_err(|e| {
            ServiceError::Storage(format!(
                "the stored spec of model `{id}` does not parse: {e}"
            ))
        })?;
        let (history_max, explain_max) = (self.limits.history_entries, self.limits.explain_entries);
        let storage = |x: valem_store::StoreError| ServiceError::Storage(x.to_string());
        let choice = store.usable_checkpoint(&id, None).map_err(storage)?;
        self.report_refused(&id, &choice, "recovery");
        let checkpoint = choice.checkpoint;
        let after = checkpoint.as_ref().and_then(|c| c.sequence);
        let e = match checkpoint {
            None => self.insert(spec, stored.created_us)?,
            Some(cp) => {
                let model = model_at(&spec, &cp.state, cp.at_us, &self.limits.engine)?;
                let e = self.register(spec, model, cp.at_us)?;
                e.checkpointed = cp.sequence;
                e
            }
        };
        e.created_us = stored.created_us;
        e.evolved_us = stored.updated_us.max(stored.created_us);
        if let Some(head) = stored.head_seq {
            e.audit.resume(head, &stored.head_hash);
        }
        replay_stored(&*store, &id, after, None, |rec| {
            replay(e, rec, history_max, explain_max)
        })
    }

    /// Log and count the checkpoints `choice` refused on its way (`purpose`: what reads it).
    fn report_refused(&self, id: &str, choice: &CheckpointChoice, purpose: &str) {
        let fallback = match &choice.checkpoint {
            Some(cp) => valem_store::checkpoints::describe(cp.sequence),
            None => "the spec's initial state".to_string(),
        };
        for r in &choice.refused {
            self.checkpoint_metrics.refused(&r.fault);
            tracing::warn!(
                model = %id,
                checkpoint = r.sequence.map_or(-1, |s| s as i64),
                reason = r.fault.label(),
                "model `{id}`: {} refused: {}; {purpose} starts from {fallback} instead and replays the records after it",
                valem_store::checkpoints::describe(r.sequence),
                r.fault,
            );
        }
    }

    /// Memory is ahead of the store (a write failed): wait for the writes in flight, then load
    /// the model as the store has it.
    fn reload(&mut self, id: &str) -> Result<(), ServiceError> {
        let Some(store) = self.store.clone() else {
            return Ok(());
        };
        store
            .flush()
            .map_err(|e| ServiceError::Storage(e.to_string()))?;
        let stored = store
            .load_models()
            .map_err(|e| ServiceError::Storage(e.to_string()))?
            .into_iter()
            .find(|m| m.id == id);
        match stored {
            Some(m) => self.recover(m),
            None => {
                self.models.remove(id);
                Err(ServiceError::NotFound(id.to_string()))
            }
        }
    }

    pub fn delete(&mut self, id: &str, reply: Reply<()>) {
        let unrecovered = self.unrecovered.remove(id).is_some();
        if unrecovered {
            self.checkpoint_metrics.unrecovered(false);
        }
        if self.models.remove(id).is_none() && !unrecovered {
            return reply.send(Err(ServiceError::NotFound(id.to_string())));
        }
        let op = Op::DeleteModel { id: id.to_string() };
        self.durably(id, Some(op), (), reply, None);
    }

    pub fn library(&mut self, id: &str) -> Result<Option<Json>, ServiceError> {
        let e = self.entry(id)?;
        let Some(lib) = &e.spec.library else {
            return Ok(None);
        };
        let layers: Vec<Json> = lib
            .layers()
            .into_iter()
            .map(|l| {
                json!({
                    "define": l.define,
                    "description": l.description,
                    "extends": l.extends,
                    "origin": l.origin,
                })
            })
            .collect();
        let exports: Vec<Json> = e
            .model
            .compiled
            .exports
            .iter()
            .map(|x| {
                json!({
                    "name": x.name,
                    "kind": if x.is_function { "function" } else { "value" },
                    "signature": x.signature,
                    "arity": x.arity,
                    "layer": x.layer,
                })
            })
            .collect();
        let description = layers
            .iter()
            .rev()
            .find_map(|l| l.get("description").filter(|d| !d.is_null()).cloned())
            .unwrap_or(Json::Null);
        Ok(Some(
            json!({"description": description, "layers": layers, "exports": exports}),
        ))
    }

    pub fn state(&mut self, id: &str, at: Option<i64>) -> Result<Json, ServiceError> {
        let e = self.entry(id)?;
        match at {
            None => {
                let now = now_us() / 1000;
                Ok(e.model.merged_json(now))
            }
            Some(at) => {
                // The ring holds the newest commits without a gap: a hit in it is the answer.
                if let Some(doc) = e.state_at(at) {
                    return Ok(doc);
                }
                let (spec, created_us, evolved_us) = (e.spec.clone(), e.created_us, e.evolved_us);
                if at < evolved_us {
                    // Before the current spec: that runtime's history is not carried.
                    return Err(ServiceError::HistoryNotFound(iso(at)));
                }
                match self.store.clone() {
                    Some(store) => self.state_from_store(&*store, &spec, created_us, id, at),
                    None => Err(ServiceError::HistoryNotFound(iso(at))),
                }
            }
        }
    }

    /// The state of model `id` at `at` (µs) rebuilt from the store: the newest checkpoint taken
    /// at or before it, plus the records committed up to it.
    fn state_from_store(
        &self,
        store: &dyn Store,
        spec: &ModelSpec,
        created_us: i64,
        id: &str,
        at: i64,
    ) -> Result<Json, ServiceError> {
        if at < created_us {
            return Err(ServiceError::HistoryNotFound(iso(at)));
        }
        let storage = |x: valem_store::StoreError| ServiceError::Storage(x.to_string());
        let limits = &self.limits.engine;
        let choice = store.usable_checkpoint(id, Some(at)).map_err(storage)?;
        self.report_refused(id, &choice, "the `?at=` read");
        let checkpoint = choice.checkpoint;
        let mut model = match &checkpoint {
            Some(cp) => model_at(spec, &cp.state, cp.at_us, limits)?,
            None => {
                Model::create(spec, created_us / 1000, limits.clone())
                    .map_err(create_error)?
                    .0
            }
        };
        replay_stored(
            store,
            id,
            checkpoint.and_then(|c| c.sequence),
            Some(at),
            |rec| apply_record(&mut model, &rec).map(|_| ()),
        )?;
        let st = model.state();
        Ok(st.merged_json())
    }

    pub fn field(&mut self, id: &str, path: &str) -> Result<Option<Json>, ServiceError> {
        let segs = concrete(path)?;
        let e = self.entry(id)?;
        Ok(e.model.get(&segs, now_us() / 1000))
    }

    pub fn effective_schema(&mut self, id: &str, path: &str) -> Result<Json, ServiceError> {
        let segs = concrete(path)?;
        let e = self.entry(id)?;
        e.model.materialize(now_us() / 1000);
        let node =
            effective_schema(&e.model.compiled, &e.model.state().meta, &segs).ok_or_else(|| {
                ServiceError::BadRequest(format!(
                    "`{path}` has no schema: it is not a field the model's schema admits"
                ))
            })?;
        // Served on its own, a node's local `$ref`s would dangle: inline them.
        Ok(inline_refs(&node, &e.model.compiled.schema, 0))
    }

    pub fn explain(
        &mut self,
        id: &str,
        path: &str,
        limit: Option<usize>,
    ) -> Result<Vec<Trace>, ServiceError> {
        let e = self.entry(id)?;
        let prefix = if path.is_empty() { "$" } else { path };
        let all = prefix == "$";
        let hits: Vec<&Trace> = e
            .traces
            .iter()
            .filter(|t| all || t.target_path.starts_with(prefix))
            .collect();
        let skip = limit.map_or(0, |l| hits.len().saturating_sub(l));
        Ok(hits.into_iter().skip(skip).cloned().collect())
    }

    pub fn history(&mut self, id: &str) -> Result<Vec<String>, ServiceError> {
        let max = self.limits.history_entries.max(1);
        let store = self.store.clone();
        let e = self.entry(id)?;
        let Some(store) = store else {
            return Ok(e.history.iter().map(|c| iso(c.at_us)).collect());
        };
        // The commit times the store holds (the ring restarts with the process): the creation
        // or last evolve, then one per record since, the newest `max` of them.
        let filter = valem_store::AuditFilter {
            limit: Some(max),
            from_us: Some(e.evolved_us),
            ..Default::default()
        };
        let newest = store
            .query_audit(id, &filter)
            .map_err(|x| ServiceError::Storage(x.to_string()))?;
        let mut times: Vec<String> = newest
            .iter()
            .rev()
            .filter_map(|r| {
                r.get("timestamp")
                    .and_then(Json::as_str)
                    .map(str::to_string)
            })
            .collect();
        if times.len() < max {
            times.insert(0, iso(e.evolved_us));
        }
        Ok(times)
    }

    pub fn audit(&mut self, id: &str, q: &AuditQuery) -> Result<Vec<Json>, ServiceError> {
        let store = self.store.clone();
        let e = self.entry(id)?;
        match store {
            // The store holds every record, indexed; memory only the newest.
            Some(store) => store
                .query_audit(
                    id,
                    &valem_store::AuditFilter {
                        path_prefix: q.path_prefix.clone(),
                        from_us: q.from_us,
                        to_us: q.to_us,
                        limit: q.limit,
                    },
                )
                .map_err(|x| ServiceError::Storage(x.to_string())),
            None => Ok(e.audit.query(q)),
        }
    }

    /// The newest audit sequence of model `id`.
    pub fn audit_head(&mut self, id: &str) -> Result<Option<u64>, ServiceError> {
        Ok(self.entry(id)?.audit.head())
    }

    pub fn verify_audit(&mut self, id: &str) -> Result<Json, ServiceError> {
        let store = self.store.clone();
        let e = self.entry(id)?;
        match store {
            // The whole stored chain, from genesis to the head.
            Some(store) => store
                .verify_chain(id)
                .map(|r| serde_json::to_value(r).unwrap_or(Json::Null))
                .map_err(|x| ServiceError::Storage(x.to_string())),
            None => Ok(e.audit.verify()),
        }
    }

    pub fn view(&mut self, id: &str, view_id: Option<&str>) -> Result<Json, ServiceError> {
        let limits = self.limits.engine.expr.clone();
        let e = self.entry(id)?;
        let now = now_us() / 1000;
        let merged = e.model.merged_json(now);
        let meta = e.model.state().meta_json();
        valem_engine::view::evaluate_view(&e.spec, &merged, &meta, view_id, now, &limits).map_err(
            |v| match v {
                ViewError::NoView(_) | ViewError::UnknownView(_) => {
                    ServiceError::ViewNotFound(v.to_string())
                }
                ViewError::Invalid(_) => ServiceError::BadRequest(v.to_string()),
            },
        )
    }

    pub fn graph(&mut self, id: &str) -> Result<Json, ServiceError> {
        Ok(valem_engine::graph::project(
            &self.entry(id)?.model.compiled,
        ))
    }

    pub fn verification(&mut self, id: &str) -> Result<Arc<Json>, ServiceError> {
        let limits = self.limits.engine.clone();
        let e = self.entry(id)?;
        if let Some(v) = &e.verification {
            return Ok(v.clone());
        }
        let report = valem_engine::testrun::verify(&e.spec, now_us() / 1000, &limits)
            .map_err(create_error)?;
        let v = Arc::new(serde_json::to_value(report).unwrap_or(Json::Null));
        e.verification = Some(v.clone());
        Ok(v)
    }

    pub fn references(&mut self, id: &str, blob_id: &str) -> Result<bool, ServiceError> {
        fn walk(v: &Json, id: &str) -> bool {
            match v {
                Json::String(s) => s == id || s.ends_with(&format!("/{id}")),
                Json::Array(a) => a.iter().any(|x| walk(x, id)),
                Json::Object(m) => m.values().any(|x| walk(x, id)),
                _ => false,
            }
        }
        let e = self.entry(id)?;
        Ok(walk(&e.model.merged_json(now_us() / 1000), blob_id))
    }

    // --- writes -----------------------------------------------------------------------------

    pub fn mutate(
        &mut self,
        id: &str,
        mutations: Vec<(String, Json)>,
        source: Source,
        reply: Reply<Arc<MutationResult>>,
    ) {
        match self.parse_mutations(mutations) {
            Ok(parsed) => self.commit(id, parsed, source, reply),
            Err(e) => reply.send(Err(e)),
        }
    }

    fn parse_mutations(&self, mutations: Vec<(String, Json)>) -> Result<Writes, ServiceError> {
        // The values are moved, not copied: an initial load can be one large array.
        valem_engine::parse_writes(mutations.into_iter(), self.limits.engine.max_mutations)
            .map_err(ServiceError::Mutation)
    }

    /// Run one cycle and answer it: at once in memory, or once its audit record is durable.
    fn commit(
        &mut self,
        id: &str,
        parsed: Vec<(Vec<Seg>, Json)>,
        source: Source,
        reply: Reply<Arc<MutationResult>>,
    ) {
        match self.cycle(id, parsed, source) {
            Ok((result, op)) => {
                let event = Event::Mutation {
                    model_id: id.to_string(),
                    result: result.clone(),
                };
                // The audit store hears of the record once it is committed, like subscribers.
                let fed = self.audit_sink.get().cloned().and_then(|sink| {
                    let r = self.models.get(id)?.audit.last()?;
                    let entry = valem_sdk::AuditEntry {
                        model_id: id.to_string(),
                        sequence: r.sequence,
                        at_us: r.at_us,
                        paths: r.paths.clone(),
                        record: r.json.clone(),
                    };
                    Some(Box::new(move || sink.append(entry)) as Box<dyn FnOnce() + Send>)
                });
                self.durably_then(id, op, result, reply, Some(event), fed);
                let every = self.limits.checkpoint_every.max(1) as u64;
                let due = self
                    .models
                    .get(id)
                    .and_then(|e| e.audit.head())
                    .is_some_and(|seq| (seq + 1).is_multiple_of(every));
                if due {
                    self.checkpoint(id);
                }
            }
            Err(e) => reply.send(Err(e)),
        }
    }

    /// The cycle itself; with a store, also the audit record to append.
    fn cycle(
        &mut self,
        id: &str,
        parsed: Vec<(Vec<Seg>, Json)>,
        source: Source,
    ) -> Result<(Arc<MutationResult>, Option<Op>), ServiceError> {
        let durable = self.store.is_some();
        let key = self.store.as_ref().and_then(|s| s.audit_key().copied());
        let (history_max, explain_max) = (self.limits.history_entries, self.limits.explain_entries);
        let metrics = self.metrics.clone();
        let e = self.entry(id)?;
        let t = e.tick();
        let started = std::time::Instant::now();
        let outcome = e.model.mutate_parsed(&parsed, t / 1000);
        let took = started.elapsed();
        let result = match outcome {
            Ok(r) => r,
            Err(err) => {
                let counter = match &err {
                    MutationError::Schema(_) => &metrics.rejected_schema,
                    MutationError::Constraint { .. } => &metrics.rejected_constraint,
                    _ => &metrics.rejected_other,
                };
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // Rejected cycles leave no history or audit; their constraint traces explain the
                // refusal (the derivation traces describe values that were never committed).
                if let MutationError::Constraint { traces, .. } = &err {
                    let refusal = traces
                        .iter()
                        .filter(|t| t.target_path.starts_with("$constraint:"));
                    push_traces(&mut e.traces, refusal, explain_max);
                }
                return Err(ServiceError::Mutation(err));
            }
        };
        push_traces(&mut e.traces, result.traces.iter(), explain_max);
        e.remember(t, history_max);
        let mutations: Map<String, Json> = parsed
            .into_iter()
            .map(|(segs, v)| (render(&segs), v))
            .collect();
        let version = e.spec.version_or_default().to_string();
        let rec = e.audit.append(AuditEntry {
            model_id: id,
            model_version: &version,
            source: source.as_str(),
            at_us: t,
            mutations,
            result: &result,
        });
        let op = if durable {
            let a = AuditAppend::new(rec.at_us, &rec.json, rec.paths.clone(), key.as_ref())
                .map_err(|x| ServiceError::Storage(x.to_string()))?;
            Some(Op::AppendAudit(a))
        } else {
            None
        };
        let result = Arc::new(result);
        metrics.committed(took);
        Ok((result, op))
    }

    /// Apply an RFC 6902 patch to the base document and commit the difference as one cycle.
    pub fn patch(&mut self, id: &str, patch: json_patch::Patch, reply: Reply<Arc<MutationResult>>) {
        match self.patch_writes(id, patch) {
            Ok(None) => reply.send(Ok(Arc::new(MutationResult {
                success: true,
                ..Default::default()
            }))),
            Ok(Some(writes)) => self.commit(id, writes, Source::Patch, reply),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// The writes a patch amounts to (`None`: it changes nothing).
    fn patch_writes(
        &mut self,
        id: &str,
        patch: json_patch::Patch,
    ) -> Result<Option<Writes>, ServiceError> {
        let e = self.entry(id)?;
        let old = e.model.state().base.to_json();
        let mut new = old.clone();
        apply_patch(&mut new, &patch).map_err(|m| {
            ServiceError::Mutation(MutationError::Invalid(format!("invalid patch: {m}")))
        })?;
        if !new.is_object() {
            return Err(ServiceError::Mutation(MutationError::Invalid(
                "the patched document must stay a JSON object".into(),
            )));
        }
        let mut writes = Vec::new();
        diff(&old, &new, &mut Vec::new(), &mut writes);
        Ok((!writes.is_empty()).then_some(writes))
    }

    pub fn snapshot(&mut self, id: &str) -> Result<Json, ServiceError> {
        let e = self.entry(id)?;
        let now = now_us();
        let derived = e.model.derived_cache(now / 1000);
        let st = e.model.state();
        Ok(json!({
            "modelId": id,
            "modelVersion": e.spec.version_or_default(),
            "takenAt": iso(now),
            "baseDoc": st.base.to_json(),
            "derivedCache": derived,
            "metaCache": st.meta_json(),
        }))
    }

    /// Replace the base document with a snapshot's; with a store, answered once a checkpoint of
    /// the restored state is durable (recovery starts from it).
    pub fn restore_durably(&mut self, id: &str, snapshot: Json, reply: Reply<Json>) {
        match self.restore(id, snapshot) {
            Ok(v) => {
                let op = match (&self.store, self.models.get_mut(id)) {
                    (Some(_), Some(e)) => {
                        e.checkpointed = e.audit.head();
                        Some(checkpoint_op(id, e, CheckpointKind::Base))
                    }
                    _ => None,
                };
                let event = Event::Restored {
                    model_id: id.to_string(),
                };
                self.durably(id, op, v, reply, Some(event))
            }
            Err(e) => reply.send(Err(e)),
        }
    }

    fn restore(&mut self, id: &str, snapshot: Json) -> Result<Json, ServiceError> {
        let bad = |m: String| ServiceError::BadRequest(m);
        let e = self.entry(id)?;
        let Json::Object(snap) = snapshot else {
            return Err(bad(
                "a snapshot is an object as `snapshot` returns it: {modelId, modelVersion, baseDoc, …}"
                    .into(),
            ));
        };
        if let Some(m) = snap.get("modelId").and_then(|m| m.as_str()) {
            if m != id {
                return Err(bad(format!("this snapshot is of model `{m}`, not `{id}`")));
            }
        }
        let Some(base @ Json::Object(_)) = snap.get("baseDoc") else {
            return Err(bad("the snapshot has no `baseDoc` object".into()));
        };
        if valem_core::value::json_deeper_than(base, valem_core::value::MAX_DEPTH) {
            return Err(bad(format!(
                "the snapshot's baseDoc {}",
                valem_core::value::TooDeep
            )));
        }
        // A base document may not hold derived values, and must satisfy the schema.
        let mut leaves = Vec::new();
        collect_leaves(base, &mut Vec::new(), &mut leaves);
        let mut violations = Vec::new();
        for segs in &leaves {
            if e.model.compiled.producers.above(segs).is_some() {
                violations.push(SchemaViolation {
                    path: render(segs),
                    keyword: "readOnly".into(),
                    message: "a derived field cannot be part of baseDoc".into(),
                });
            }
        }
        for i in evolve::strand_check(&e.model.compiled.schema, base) {
            violations.push(SchemaViolation {
                path: i.path,
                keyword: "schema".into(),
                message: i.message,
            });
        }
        if !violations.is_empty() {
            return Err(ServiceError::Mutation(MutationError::Schema(violations)));
        }
        let t = e.tick();
        e.model.reset_base(Val::from_json(base), t / 1000);
        e.traces.clear();
        e.restart_history(t);
        let version = e.spec.version_or_default().to_string();
        Ok(json!({"restored": true, "id": id, "version": version, "restoredAt": iso(t)}))
    }

    /// Evolve the spec; with a store, answered once the new spec and a checkpoint of the
    /// evolved state are durable, together (recovery and `?at=` start from it: the history of
    /// the old runtime is not carried, as in the reference).
    pub fn evolve_durably(&mut self, id: &str, evo: SpecEvolution, reply: Reply<ModelInfo>) {
        match self.evolve(id, evo) {
            // Nothing changed: nothing to store or announce.
            Ok(None) => match self.entry(id) {
                Ok(e) => reply.send(Ok(ModelInfo::of(&e.spec))),
                Err(x) => reply.send(Err(x)),
            },
            Ok(Some(info)) => {
                let op = match (&self.store, self.models.get_mut(id)) {
                    (Some(_), Some(e)) => {
                        e.checkpointed = e.audit.head();
                        e.evolved_us = e.last_us;
                        match put_model_op(&e.spec, e.last_us) {
                            Ok(put) => Some(Op::Atomic(vec![
                                put,
                                checkpoint_op(id, e, CheckpointKind::Base),
                            ])),
                            Err(x) => {
                                e.stale.store(true, std::sync::atomic::Ordering::Release);
                                return reply.send(Err(x));
                            }
                        }
                    }
                    _ => None,
                };
                let event = Event::SpecEvolved {
                    model_id: id.to_string(),
                    version: info.version.clone(),
                };
                self.durably(id, op, info, reply, Some(event))
            }
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Apply `evo`; `None` when the evolved spec is the live one and no backfill is written (the
    /// model, its history and traces are left as they are).
    fn evolve(&mut self, id: &str, evo: SpecEvolution) -> Result<Option<ModelInfo>, ServiceError> {
        let limits = self.limits.engine.clone();
        let e = self.entry(id)?;
        let actual = e.spec.version_or_default().to_string();
        if let Some(expected) = &evo.expected_version {
            if *expected != actual {
                return Err(ServiceError::VersionConflict {
                    expected: expected.clone(),
                    actual,
                });
            }
        }
        let spec = evolve::apply(&e.spec, &evo).map_err(|x| ServiceError::BadRequest(x.0))?;
        let backfills = evo.backfill.as_ref().is_some_and(|b| {
            b.keys().any(|k| {
                concrete(k)
                    .ok()
                    .is_none_or(|segs| e.model.state().base.get_path(&segs).is_none())
            })
        });
        if spec == *e.spec && !backfills {
            return Ok(None);
        }
        let report = valem_engine::validate::validate(&spec, &limits);
        if !report.valid {
            return Err(ServiceError::EvolutionInvalid(report.errors));
        }
        let compiled = compile_cached(&spec, &limits)
            .map_err(|errs| ServiceError::EvolutionInvalid(compile_findings(errs)))?;
        let t = e.tick();
        let st = e.model.state();
        let base = st.base.clone();
        let mut model = Model::from_base(
            compiled,
            base.clone(),
            st.effect_keys.clone(),
            t / 1000,
            limits,
        );
        if let Some(backfill) = &evo.backfill {
            let mut writes = Vec::new();
            for (k, v) in backfill {
                let segs = concrete(k)?;
                if base.get_path(&segs).is_none() {
                    writes.push((segs, v.clone()));
                }
            }
            if !writes.is_empty() {
                model
                    .mutate_parsed(&writes, t / 1000)
                    .map_err(ServiceError::Mutation)?;
            }
        }
        let schema_touched = evo.new_schema.is_some()
            || evo.upsert_schema_defs.is_some()
            || !evo.remove_schema_defs.is_empty()
            || !evo.upsert_schema_nodes.is_empty()
            || !evo.remove_schema_nodes.is_empty();
        if schema_touched {
            let stranded = evolve::strand_check(&spec.schema, &model.state().base.to_json());
            if !stranded.is_empty() {
                return Err(ServiceError::Stranded(stranded));
            }
        }
        let info = ModelInfo::of(&spec);
        e.spec = Arc::new(spec);
        e.verification = None;
        e.model = model;
        e.traces.clear();
        e.restart_history(t);
        Ok(Some(info))
    }
}

/// Replace local `{"$ref": "#/…"}` nodes by their targets. At most 16 references are followed
/// along any one branch, so a recursive schema keeps its `$ref` below that.
fn inline_refs(node: &Json, root: &Json, followed: usize) -> Json {
    const MAX_FOLLOWED: usize = 16;
    match node {
        Json::Object(m) => {
            if let Some(Json::String(r)) = m.get("$ref") {
                if followed < MAX_FOLLOWED {
                    if let Some(target) = r.strip_prefix('#').and_then(|p| root.pointer(p)) {
                        let mut out = match inline_refs(target, root, followed + 1) {
                            Json::Object(t) => t,
                            other => return other,
                        };
                        for (k, v) in m {
                            if k != "$ref" {
                                out.insert(k.clone(), inline_refs(v, root, followed));
                            }
                        }
                        return Json::Object(out);
                    }
                }
            }
            Json::Object(
                m.iter()
                    .map(|(k, v)| (k.clone(), inline_refs(v, root, followed)))
                    .collect(),
            )
        }
        Json::Array(a) => Json::Array(a.iter().map(|v| inline_refs(v, root, followed)).collect()),
        other => other.clone(),
    }
}

/// Keep the newest `max` of `traces` in the explain ring (only those are expanded).
fn push_traces(
    ring: &mut VecDeque<Trace>,
    traces: impl DoubleEndedIterator<Item = Trace>,
    max: usize,
) {
    let newest: Vec<Trace> = traces.rev().take(max).collect();
    for t in newest.into_iter().rev() {
        if ring.len() >= max {
            ring.pop_front();
        }
        ring.push_back(t);
    }
}

/// Apply `patch` to `doc` one operation at a time, refusing any operation that would place a
/// value deeper in the document than [`valem_core::value::MAX_DEPTH`] (a few `copy`s of a value under
/// a long path would double the document's depth each time). On error `doc` is left part-way:
/// the caller drops it.
fn apply_patch(doc: &mut Json, patch: &json_patch::Patch) -> Result<(), String> {
    use json_patch::PatchOperation as P;
    for (i, op) in patch.0.iter().enumerate() {
        let placed = match op {
            P::Add(a) => Some(&a.value),
            P::Replace(r) => Some(&r.value),
            P::Copy(c) => doc.pointer(c.from.as_str()),
            P::Move(m) => doc.pointer(m.from.as_str()),
            P::Remove(_) | P::Test(_) => None,
        };
        if let Some(v) = placed {
            let at = op.path().tokens().count();
            if valem_core::value::json_deeper_than(v, valem_core::value::room_below(at)) {
                return Err(format!(
                    "operation '/{i}' at path '{}': the value there {}",
                    op.path(),
                    valem_core::value::TooDeep
                ));
            }
        }
        json_patch::patch_unsafe(doc, std::slice::from_ref(op))
            .map_err(|e| format!("operation '/{i}' failed at path '{}': {}", e.path, e.kind))?;
    }
    Ok(())
}

fn collect_leaves(v: &Json, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    match v {
        Json::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                at.push(Seg::Field(valem_core::value::intern(k)));
                collect_leaves(x, at, out);
                at.pop();
            }
        }
        Json::Array(a) if !a.is_empty() => {
            for (i, x) in a.iter().enumerate() {
                at.push(Seg::Index(i));
                collect_leaves(x, at, out);
                at.pop();
            }
        }
        _ => out.push(at.clone()),
    }
}

/// The writes that turn `old` into `new`: objects are compared member by member (a removed
/// member rewrites its parent), arrays element by element when their length is unchanged
/// (otherwise the array is rewritten whole).
fn diff(old: &Json, new: &Json, at: &mut Vec<Seg>, out: &mut Vec<(Vec<Seg>, Json)>) {
    if old == new {
        return;
    }
    match (old, new) {
        (Json::Object(o), Json::Object(n)) if o.keys().all(|k| n.contains_key(k)) => {
            for (k, nv) in n {
                match o.get(k) {
                    Some(ov) => {
                        at.push(Seg::Field(valem_core::value::intern(k)));
                        diff(ov, nv, at, out);
                        at.pop();
                    }
                    None => {
                        let mut p = at.clone();
                        p.push(Seg::Field(valem_core::value::intern(k)));
                        out.push((p, nv.clone()));
                    }
                }
            }
        }
        (Json::Array(o), Json::Array(n)) if o.len() == n.len() => {
            for (i, (ov, nv)) in o.iter().zip(n).enumerate() {
                at.push(Seg::Index(i));
                diff(ov, nv, at, out);
                at.pop();
            }
        }
        _ => out.push((at.clone(), new.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_refs_resolves_local_refs_and_stops_on_recursion() {
        let root = json!({
            "$defs": {
                "Line": {"type": "object", "properties": {"qty": {"$ref": "#/$defs/Qty"}}},
                "Qty": {"type": "integer", "minimum": 0},
                "Tree": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"}}}}
            }
        });
        let got = inline_refs(
            &json!({"type": "array", "items": {"$ref": "#/$defs/Line"}, "readOnly": false}),
            &root,
            0,
        );
        assert_eq!(
            got,
            json!({"type": "array", "items": {"type": "object", "properties": {"qty": {"type": "integer", "minimum": 0}}}, "readOnly": false})
        );
        let tree = inline_refs(&json!({"$ref": "#/$defs/Tree"}), &root, 0).to_string();
        assert_eq!(tree.matches("\"kids\"").count(), 16);
        assert!(
            tree.contains("#/$defs/Tree"),
            "the 17th level keeps its $ref"
        );
        // A dangling ref is left as it is.
        assert_eq!(
            inline_refs(&json!({"$ref": "#/$defs/Nope"}), &root, 0),
            json!({"$ref": "#/$defs/Nope"})
        );
    }

    #[test]
    fn diff_writes_changed_members_and_rewrites_shrunk_containers() {
        let old = json!({"a": 1, "o": {"x": 1, "y": 2}, "l": [1, 2, 3], "k": [1, 2]});
        let new = json!({"a": 2, "o": {"x": 1}, "l": [1, 2], "k": [1, 5], "n": true});
        let mut out = Vec::new();
        diff(&old, &new, &mut Vec::new(), &mut out);
        let got: Vec<(String, Json)> = out.into_iter().map(|(s, v)| (render(&s), v)).collect();
        assert_eq!(
            got,
            vec![
                ("$.a".to_string(), json!(2)),
                ("$.o".to_string(), json!({"x": 1})),
                ("$.l".to_string(), json!([1, 2])),
                ("$.k[1]".to_string(), json!(5)),
                ("$.n".to_string(), json!(true)),
            ]
        );
    }
}
