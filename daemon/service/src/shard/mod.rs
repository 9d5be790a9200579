//! One shard: the models it owns and every operation on them. Runs on the shard's own thread
//! only (compiled models are not `Send`), so nothing here locks.

mod durability;
mod keys;
mod reads;
mod residency;
mod writes;

use durability::*;
use writes::*;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use serde_json::{json, Map, Value as Json};

use super::audit::{AuditTrail, Entry as AuditEntry};
use super::metrics::{CheckpointMetrics, CycleMetrics, ResidencyMetrics};
use super::time::{iso, now, Timestamp};
use super::Seq;
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
use valem_store::{CheckpointChoice, CheckpointKind, Op, Store, StoredModel};

/// A live model and its rings.
pub(super) struct Entry {
    /// The model's id (its spec's `id`).
    id: String,
    /// The spec's content, shared with every model of this shard whose spec differs only by
    /// its id (it is the compiled model's): its `id` may be another model's, so what leaves the
    /// shard goes through [`Entry::named_spec`] or [`Entry::info`].
    spec: Arc<ModelSpec>,
    pub model: Model,
    /// The newest commits, oldest first: the state after each is rebuilt from the current one
    /// by undoing what came after it (see [`Commit`]).
    history: VecDeque<Commit>,
    /// Most recent traces, oldest first.
    traces: VecDeque<Trace>,
    audit: AuditTrail,
    /// Last commit time: commit times are strictly increasing per model.
    last: Timestamp,
    /// The verification report of `spec` (a pure function of it), once computed.
    verification: Option<Arc<Json>>,
    /// Set (by the store's writer) when a write of this model failed: memory is ahead of the
    /// store, so the model is reloaded from the store before its next operation.
    stale: Arc<std::sync::atomic::AtomicBool>,
    /// Writes of this model submitted to the store and not yet answered: such a model is not
    /// evicted (waking it before they commit would miss them).
    inflight: Arc<std::sync::atomic::AtomicUsize>,
    /// When it was last used, on the shard's clock (eviction takes the least recent).
    used: u64,
    /// The sequence of the newest checkpoint written (with a store).
    checkpointed: Option<Seq>,
    /// When the model was created: nothing exists before it.
    created: Timestamp,
    /// When its spec last changed (creation or evolve): the history starts there.
    evolved: Timestamp,
    /// Its idempotency keys, once a keyed write asked for them.
    keys: Option<Box<keys::KeyMemory>>,
}

/// One commit of the history ring: its time, and what changed after it up to and including the
/// next commit (the model's undo log: materialised lazy values, then that commit's cycle).
/// The ring keeps these journals rather than a state per commit: a kept state is shared with
/// the live one, so the next commit would copy every branch on the paths it writes (criterion,
/// 100k fan-out: 7.4 µs a commit that way, 1.9 µs this way).
struct Commit {
    at: Timestamp,
    after: Vec<Undo>,
}

impl Entry {
    /// The model's spec, with its own id.
    pub(super) fn named_spec(&self) -> Arc<ModelSpec> {
        if self.spec.id == self.id {
            return self.spec.clone();
        }
        let mut spec = ModelSpec::clone(&self.spec);
        spec.id.clone_from(&self.id);
        Arc::new(spec)
    }

    /// What the model is, under its own id.
    pub(super) fn info(&self) -> ModelInfo {
        ModelInfo::named(&self.id, &self.spec)
    }

    /// Record a commit at `t` in the ring, keeping the newest `max`.
    fn remember(&mut self, t: Timestamp, max: usize) {
        self.settle_history();
        self.history.push_back(Commit {
            at: t,
            after: Vec::new(),
        });
        while self.history.len() > max.max(1) {
            self.history.pop_front();
        }
    }

    /// Start the ring again at `t` (creation, evolution, restore): nothing before is carried;
    /// the model logs its changes from here.
    fn restart_history(&mut self, t: Timestamp) {
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

    /// The merged document as it was right after the newest commit at or before `at`, if the
    /// ring still holds it.
    fn state_at(&mut self, at: Timestamp) -> Option<Json> {
        self.settle_history();
        let k = self.history.iter().rposition(|c| c.at <= at)?;
        let later = self.history.range(k..).rev();
        let st = self
            .model
            .state_before(later.flat_map(|c| c.after.iter().rev()));
        Some(st.merged_json())
    }

    fn tick(&mut self) -> Timestamp {
        let t = now().max(self.last.next());
        self.last = t;
        t
    }
}

pub(super) struct Shard {
    /// The models in memory.
    models: HashMap<String, Entry>,
    /// Models kept in the store only (evicted, or not loaded at start under a residency
    /// bound): the next request for one wakes it.
    hibernated: HashSet<String>,
    /// Most models this shard keeps in memory (its share of `--max-resident-models`).
    resident_max: Option<usize>,
    /// Counts uses, for the eviction order.
    clock: u64,
    residency: Arc<ResidencyMetrics>,
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
    /// In a fleet: models another node was found to own, with its lease's end (no owner can
    /// change before it), so requests for them are answered without asking the store.
    elsewhere: HashMap<String, (String, String, Timestamp)>,
}

impl Shard {
    pub(crate) fn new(
        limits: ServiceLimits,
        subscribers: Arc<Subscribers>,
        metrics: Arc<CycleMetrics>,
        checkpoint_metrics: Arc<CheckpointMetrics>,
        store: Option<Arc<dyn Store>>,
        audit_sink: Arc<std::sync::OnceLock<super::audit_sink::AuditSink>>,
        residency: (Option<usize>, Arc<ResidencyMetrics>),
    ) -> Shard {
        Shard {
            models: HashMap::new(),
            hibernated: HashSet::new(),
            resident_max: residency.0,
            clock: 0,
            residency: residency.1,
            unrecovered: HashMap::new(),
            store,
            limits,
            subscribers,
            metrics,
            checkpoint_metrics,
            audit_sink,
            elsewhere: HashMap::new(),
        }
    }

    /// Model `id`, woken from the store when it is hibernated.
    pub(crate) fn entry(&mut self, id: &str) -> Result<&mut Entry, ServiceError> {
        self.drop_if_lost(id);
        self.clock += 1;
        let clock = self.clock;
        let stale = match self.models.get_mut(id) {
            Some(e) => {
                e.used = clock;
                e.stale.load(std::sync::atomic::Ordering::Acquire)
            }
            None => {
                self.wake(id)?;
                false
            }
        };
        if stale {
            self.reload(id)?;
        } else if self.resident_max.is_some_and(|m| self.models.len() > m) {
            // Over the bound still (the last eviction had to spare models with writes in
            // flight): try again now.
            self.evict_over_bound(id);
        }
        self.entry_raw(id)
    }

    /// Every model's id, hibernated ones included.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.models
            .keys()
            .chain(self.hibernated.iter())
            .cloned()
            .collect()
    }

    /// Create model `id` of `spec` (whose own id may be another's: a copy of a spec created
    /// before), `text` being its serialisation under `id` and `hash` its content hash.
    pub(crate) fn create(
        &mut self,
        id: String,
        spec: Arc<ModelSpec>,
        (text, hash): (String, [u8; 32]),
        reply: Reply<ModelInfo>,
    ) {
        self.drop_if_lost(&id);
        if self.models.contains_key(&id) || self.hibernated.contains(&id) {
            return reply.send(Err(ServiceError::Duplicate(id)));
        }
        // In a fleet: this node's before it exists, and not created by another node before.
        if let Some(store) = self.store.clone().filter(|s| s.is_fleet()) {
            if let Err(e) = residency::claim(&*store, &id, None) {
                return reply.send(Err(e));
            }
            match store.load_model(&id) {
                Ok(None) => {}
                Ok(Some(_)) => return reply.send(Err(ServiceError::Duplicate(id))),
                Err(e) => return reply.send(Err(ServiceError::Storage(e.to_string()))),
            }
        }
        if let Some(why) = self.unrecovered.get(&id) {
            return reply.send(Err(ServiceError::Unrecovered {
                id,
                why: why.clone(),
            }));
        }
        let t = now();
        let persist = self.store.as_ref().map(|_| Op::PutModel {
            id: id.clone(),
            spec_text: text,
            version: spec.version_or_default().to_string(),
            at: t,
        });
        let limits = self.limits.engine.clone();
        let (model, seeded) = match Model::create_hashed(&spec, hash, t, limits) {
            Ok(created) => created,
            Err(e) => return reply.send(Err(create_error(e))),
        };
        let info = match self.register(id, model, t) {
            Ok(e) => e.info(),
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

    /// Compile `spec` into a fresh model created at `t` and register it.
    fn insert(&mut self, spec: ModelSpec, t: Timestamp) -> Result<&mut Entry, ServiceError> {
        let limits = self.limits.engine.clone();
        let (model, _) = Model::create(&spec, t, limits).map_err(create_error)?;
        self.register(spec.id, model, t)
    }

    fn register(
        &mut self,
        id: String,
        model: Model,
        t: Timestamp,
    ) -> Result<&mut Entry, ServiceError> {
        self.clock += 1;
        let replaced = self.models.insert(
            id.clone(),
            Entry {
                id: id.clone(),
                spec: model.compiled.spec.clone(),
                model,
                history: VecDeque::new(),
                traces: VecDeque::new(),
                // With a store, the store answers audit queries: memory keeps the newest only.
                audit: AuditTrail::new(
                    if self.store.is_some() {
                        1
                    } else {
                        self.limits.audit_entries
                    },
                    self.store.as_ref().and_then(|s| s.audit_key().copied()),
                ),
                last: t,
                verification: None,
                stale: Arc::default(),
                inflight: Arc::default(),
                used: self.clock,
                checkpointed: None,
                created: t,
                evolved: t,
                keys: None,
            },
        );
        if replaced.is_none() {
            self.residency.resident(true);
            self.evict_over_bound(&id);
        }
        let e = self.entry_raw(&id)?;
        e.restart_history(t);
        Ok(e)
    }

    /// Drop model `id` from memory (it stays in the store, if any); whether it was there. A
    /// large model's memory is given back to the OS at once ([`crate::set_memory_release`]),
    /// not whenever the allocator next purges on this thread (an idle shard may not for a
    /// long time).
    fn unload(&mut self, id: &str) -> bool {
        let Some(e) = self.models.remove(id) else {
            return false;
        };
        self.residency.resident(false);
        let large = e.model.compiled.nodes.len() >= crate::RELEASE_FROM_NODES;
        drop(e);
        if large {
            crate::release_memory();
        }
        true
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

    pub(crate) fn delete(&mut self, id: &str, reply: Reply<()>) {
        self.drop_if_lost(id);
        // In a fleet, a stored model this node has not loaded is claimed (and woken) first.
        if !self.models.contains_key(id) && self.store.as_ref().is_some_and(|s| s.is_fleet()) {
            if let Err(e) = self.wake(id) {
                return reply.send(Err(e));
            }
        }
        let unrecovered = self.unrecovered.remove(id).is_some();
        if unrecovered {
            self.checkpoint_metrics.unrecovered(false);
        }
        let hibernated = self.hibernated.remove(id);
        if hibernated {
            self.residency.hibernated(false);
        }
        let resident = self.unload(id);
        if !resident && !hibernated && !unrecovered {
            return reply.send(Err(ServiceError::NotFound(id.to_string())));
        }
        let op = Op::DeleteModel { id: id.to_string() };
        self.durably(id, Some(op), (), reply, None);
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
