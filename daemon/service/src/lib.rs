//! ModelService: the one API every surface (MCP, REST, console, WebSocket) calls. Owns the
//! registry of live models, spread over shard threads (a model lives on one shard, chosen by a
//! hash of its id, and is touched only by that thread: no locks on the hot path), the per-model
//! history and explain rings, the session audit trail, the blob store and change subscriptions.
//! Never speaks a wire protocol: surfaces translate to and from these calls.

// What is not part of the crate's API is pub(crate): the compiler keeps it so.
#![warn(unreachable_pub)]

mod blob_ops;
mod pending;
mod types;

pub use pending::{Answer, Call, Pending};
// Engine types that are part of this API (a mutation's result and refusal, a validator
// finding): surfaces name them through the service, never the engine.
use pending::*;
pub use types::*;
pub use valem_core::id::ModelId;
pub use valem_core::time::Timestamp;
pub use valem_engine::validate::Finding;
pub use valem_engine::{MutationError, MutationResult};
pub use valem_store::Seq;

mod audit;
mod audit_sink;
pub mod authoring;
mod blobs;
pub mod effects;
pub mod egress;
pub mod metrics;
pub mod plugins;
pub mod scope;
mod shard;
pub mod time;

use std::sync::mpsc::{self, Receiver, SyncSender};
use std::task::Poll;

use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

use serde::Serialize;
use serde_json::{Map, Value as Json};

pub use audit::{AuditQuery, AuditRecord};
pub use blobs::{BlobRef, BlobStore};
use shard::Shard;

use valem_core::spec::evolve::Incompatibility;
use valem_core::spec::{ModelSpec, SpecEvolution};
use valem_engine::{EngineLimits, Trace};

/// Models of this many graph nodes or more give their memory back to the OS when they leave
/// memory (evicted or deleted): ~0.7 KB a node, so from ~7 MB.
pub(crate) const RELEASE_FROM_NODES: usize = 10_000;

static MEMORY_RELEASE: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// How the process gives the memory it holds free back to the OS (the daemon: mimalloc's
/// `mi_collect`), called on a shard's thread when a large model leaves memory. Set once, at
/// start; without it the allocator returns memory in its own time.
pub fn set_memory_release(release: fn()) {
    let _ = MEMORY_RELEASE.set(release);
}

pub(crate) fn release_memory() {
    if let Some(release) = MEMORY_RELEASE.get() {
        release();
    }
}

/// The model service. Cheap to share (`Arc`). A read blocks the caller until the owning shard
/// answers; a write returns a [`Call`], which a thread `wait`s for and async code `.await`s.
pub struct ModelService {
    shards: Vec<ShardHandle>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    limits: ServiceLimits,
    blobs: Mutex<BlobStore>,
    subscribers: Arc<Subscribers>,
    count: Arc<std::sync::atomic::AtomicUsize>,
    metrics: Arc<metrics::CycleMetrics>,
    checkpoint_metrics: Arc<metrics::CheckpointMetrics>,
    residency: Arc<metrics::ResidencyMetrics>,
    /// Whether async callers may poll for an answer at all (see [`Pending`]).
    async_polling: std::sync::atomic::AtomicBool,
    /// Specs created before, by the key of the body they came in (see [`PreparedSpec`]).
    prepared: Arc<Mutex<std::collections::HashMap<[u8; 32], Arc<PreparedSpec>>>>,
    store: Option<Arc<dyn valem_store::Store>>,
    /// A blob-store plugin keeping the blob bytes (metadata stays in the store, or in
    /// `plugin_blobs` without one).
    blob_plugin: std::sync::OnceLock<Arc<crate::plugins::Plugin>>,
    /// An audit-store plugin's feed (shared with the shards, which feed it).
    audit_sink: Arc<std::sync::OnceLock<audit_sink::AuditSink>>,
    plugin_blobs: Mutex<std::collections::HashMap<String, BlobRef>>,
}

impl ModelService {
    /// Start a service with `shards` shard threads (0: one per available core), in memory.
    pub fn new(shards: usize, limits: ServiceLimits) -> Arc<ModelService> {
        Self::start(shards, limits, None)
    }

    /// Start a service over a durable store: every model the store holds is recovered (its spec,
    /// then its audit records replayed in order) before this returns, and every acknowledged
    /// write is committed to the store first. Fails when a stored model cannot be recovered.
    pub fn open(
        shards: usize,
        limits: ServiceLimits,
        store: Arc<dyn valem_store::Store>,
    ) -> Result<Arc<ModelService>, ServiceError> {
        use std::sync::atomic::Ordering;
        let storage = |e: valem_store::StoreError| ServiceError::Storage(e.to_string());
        if limits.max_resident_models.is_some() {
            // Under a residency bound nothing is loaded now: each model wakes at its first
            // request (a model that cannot be recovered is found then, and answers so).
            let ids = store.model_ids(None).map_err(storage)?;
            let svc = Self::start(shards, limits, Some(store));
            svc.count.store(ids.len(), Ordering::SeqCst);
            let mut per_shard: Vec<Vec<String>> = vec![Vec::new(); svc.shards.len()];
            for id in ids {
                if let Some(v) = per_shard.get_mut(svc.shard_of(&id)) {
                    v.push(id);
                }
            }
            for (i, ids) in per_shard.into_iter().enumerate() {
                svc.on_shard(i, move |s| {
                    for id in ids {
                        s.hibernate_stored(id);
                    }
                })?;
            }
            return Ok(svc);
        }
        let stored = store.load_models().map_err(storage)?;
        let svc = Self::start(shards, limits, Some(store));
        let waits: Vec<_> = stored
            .into_iter()
            .map(|m| {
                let id = m.id.clone();
                (
                    id.clone(),
                    svc.submit(svc.shard_of(&id), true, move |s| s.recover(m)),
                )
            })
            .collect();
        for (id, w) in waits {
            match w.wait()? {
                Ok(()) => {
                    svc.count.fetch_add(1, Ordering::SeqCst);
                }
                // One model that cannot be recovered must not keep the others from being
                // served: it is kept aside (the shard answers for it) and reported.
                Err(e) => tracing::error!(
                    model = %id,
                    error = %e,
                    "a stored model could not be recovered: it is not served, its stored data \
                     stays as it is, and the other models are served"
                ),
            }
        }
        Ok(svc)
    }

    /// The durable store, when the service has one.
    pub fn store(&self) -> Option<&Arc<dyn valem_store::Store>> {
        self.store.as_ref()
    }

    /// Keep a task's record (MCP's tasks extension) durably: committed and synced when this
    /// returns. Without a store there is nothing to do.
    pub fn put_task(&self, id: &str, record: &Json) -> Result<(), String> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let w = store.writer();
        w.apply(valem_store::Op::PutTask {
            id: id.to_string(),
            record: record.to_string(),
            at: time::now(),
        })
        .and_then(|()| w.flush())
        .map_err(|e| e.to_string())
    }

    /// Forget a task's record.
    pub fn delete_task(&self, id: &str) {
        if let Some(store) = &self.store {
            store.writer().submit(
                valem_store::Op::DeleteTask { id: id.to_string() },
                Box::new(|_| {}),
            );
        }
    }

    /// The task records kept in the store (none without one); an unreadable record is skipped.
    pub fn stored_tasks(&self) -> Result<Vec<Json>, String> {
        let Some(store) = &self.store else {
            return Ok(Vec::new());
        };
        Ok(store
            .tasks()
            .map_err(|e| e.to_string())?
            .iter()
            .filter_map(|t| serde_json::from_str(t).ok())
            .collect())
    }

    fn start(
        shards: usize,
        limits: ServiceLimits,
        store: Option<Arc<dyn valem_store::Store>>,
    ) -> Arc<ModelService> {
        let n = if shards == 0 {
            std::thread::available_parallelism().map_or(2, |n| n.get())
        } else {
            shards
        };
        let subscribers = Arc::new(Subscribers::default());
        let metrics = Arc::new(metrics::CycleMetrics::default());
        let residency = Arc::new(metrics::ResidencyMetrics::default());
        // Each shard keeps its share of the bound (ids spread evenly over the shards).
        let resident_max = limits
            .max_resident_models
            .filter(|_| store.is_some())
            .map(|m| m.div_ceil(n).max(1));
        let checkpoint_metrics = Arc::new(metrics::CheckpointMetrics::default());
        let audit_sink: Arc<std::sync::OnceLock<audit_sink::AuditSink>> = Arc::default();
        let mut senders = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let (tx, rx) = mpsc::sync_channel::<Job>(SHARD_QUEUE);
            let depth = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let subs = subscribers.clone();
            let lim = limits.clone();
            let cycle_metrics = metrics.clone();
            let cp_metrics = checkpoint_metrics.clone();
            let shard_store = store.clone();
            let sink = audit_sink.clone();
            let res = (resident_max, residency.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("valem-shard-{i}"))
                .spawn(move || {
                    let mut shard =
                        Shard::new(lim, subs, cycle_metrics, cp_metrics, shard_store, sink, res);
                    while let Some(job) = next_job(&rx) {
                        job(&mut shard);
                    }
                });
            if let Ok(h) = spawned {
                threads.push(h);
                senders.push(ShardHandle {
                    tx,
                    depth,
                    poll: Arc::default(),
                });
            }
        }
        Arc::new(ModelService {
            shards: senders,
            threads: Mutex::new(threads),
            blobs: Mutex::new(BlobStore::new(
                limits.blob_max_bytes,
                limits.blob_max_total_bytes,
            )),
            limits,
            subscribers,
            count: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            metrics,
            checkpoint_metrics,
            residency,
            async_polling: std::sync::atomic::AtomicBool::new(true),
            prepared: Arc::default(),
            store,
            blob_plugin: std::sync::OnceLock::new(),
            audit_sink,
            plugin_blobs: Mutex::new(std::collections::HashMap::new()),
        })
    }

    pub fn limits(&self) -> &ServiceLimits {
        &self.limits
    }

    /// Receive the committed changes that `filter` accepts, from now on.
    pub fn subscribe(&self, filter: EventFilter) -> Receiver<Event> {
        let (tx, rx) = mpsc::channel::<Event>();
        self.subscribe_with(filter, Box::new(move |e| tx.send(e.clone()).is_ok()));
        rx
    }

    /// Hand the committed changes that `filter` accepts to `sink`, on the shard thread, until
    /// it returns false (an async surface passes a non-blocking channel send).
    pub fn subscribe_with(&self, filter: EventFilter, sink: EventSink) {
        if let Ok(mut l) = self.subscribers.list.lock() {
            l.push((filter, sink));
        }
    }

    /// Tell the subscribers of an event committed elsewhere: a fleet's node relaying what the
    /// owner of a model heard (see valem-http's `relay.rs`).
    pub fn publish_relayed(&self, event: Event) {
        self.subscribers.publish(event);
    }

    /// Change subscribers registered (WebSocket and MCP listen streams, event forwarders): a
    /// closed one is dropped at the next commit it would be told of.
    pub fn subscriber_count(&self) -> usize {
        self.subscribers.list.lock().map_or(0, |l| l.len())
    }

    /// Let async callers poll briefly for answers (the default), or not: a surface turns it off
    /// while it has more concurrent clients than reactor threads.
    pub fn set_async_polling(&self, on: bool) {
        self.async_polling
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Live models.
    pub fn model_count(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Cycle counters and latency histogram.
    pub fn metrics(&self) -> &metrics::CycleMetrics {
        &self.metrics
    }

    /// Models in memory and hibernated, evictions and wakes (`--max-resident-models`).
    pub fn residency(&self) -> &metrics::ResidencyMetrics {
        &self.residency
    }

    /// The ids of the models whose spec text contains `needle` (all with `None`), without
    /// waking any: hibernated models are looked up in the store. A cheap prefilter for callers
    /// that then read the spec of the few it returns.
    pub fn models_mentioning(&self, needle: &str) -> Result<Vec<String>, ServiceError> {
        match (&self.store, self.limits.max_resident_models) {
            (Some(store), Some(_)) => store
                .model_ids(Some(needle))
                .map_err(|e| ServiceError::Storage(e.to_string())),
            _ => self.list(),
        }
    }

    /// Checkpoints refused by recovery and `?at=` reads.
    pub fn checkpoint_metrics(&self) -> &metrics::CheckpointMetrics {
        &self.checkpoint_metrics
    }

    /// Wait until every job queued so far on every shard has run (in-flight cycles finish).
    pub fn drain(&self) {
        for i in 0..self.shards.len() {
            let _ = self.on_shard(i, |s| s.checkpoint_all());
        }
        if let Some(store) = &self.store {
            if let Err(e) = store.flush() {
                tracing::warn!(error = %e, "the store did not flush on shutdown");
            }
        }
    }

    fn shard_of(&self, id: &str) -> usize {
        let h = blake3::hash(id.as_bytes());
        let b = h.as_bytes();
        (u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as usize)
            % self.shards.len().max(1)
    }

    /// Queue `f` on shard `i`. `wait` blocks on a full queue (back-pressure for threads);
    /// `nowait` refuses it with [`ServiceError::Busy`] instead, for async callers.
    fn submit<R: Send + 'static>(
        &self,
        i: usize,
        wait: bool,
        f: impl FnOnce(&mut Shard) -> R + Send + 'static,
    ) -> Pending<R> {
        self.submit_with(i, wait, move |s, tx| {
            let _ = tx.send(f(s));
        })
    }

    /// [`submit`](Self::submit) for a job that answers through `tx` itself, possibly later
    /// (after the store acknowledged its write).
    fn submit_with<R: Send + 'static>(
        &self,
        i: usize,
        wait: bool,
        f: impl FnOnce(&mut Shard, oneshot::Sender<R>) + Send + 'static,
    ) -> Pending<R> {
        use std::sync::atomic::Ordering;
        let Some(shard) = self.shards.get(i) else {
            return Pending::failed(ServiceError::Unavailable);
        };
        let (tx, rx) = oneshot::channel();
        let depth = shard.depth.clone();
        let job: Job = Box::new(move |s| {
            f(s, tx);
            depth.fetch_sub(1, Ordering::Relaxed);
        });
        // Alone on an idle shard, the answer is one cycle away: perhaps worth a short poll.
        let alone = shard.depth.fetch_add(1, Ordering::Relaxed) == 0;
        let poll_first =
            (alone && !wait && self.async_polling.load(Ordering::Relaxed) && shard.poll.wanted())
                .then(|| shard.poll.clone());
        let sent = if wait {
            shard.tx.send(job).map_err(|_| ServiceError::Unavailable)
        } else {
            shard.tx.try_send(job).map_err(|e| match e {
                mpsc::TrySendError::Full(_) => ServiceError::Busy(SHARD_QUEUE),
                mpsc::TrySendError::Disconnected(_) => ServiceError::Unavailable,
            })
        };
        match sent {
            Ok(()) => Pending {
                rx: Ok(rx),
                poll_first,
            },
            Err(e) => {
                shard.depth.fetch_sub(1, Ordering::Relaxed);
                Pending::failed(e)
            }
        }
    }

    /// Run `f` on shard `i` and wait for its answer.
    fn on_shard<R: Send + 'static>(
        &self,
        i: usize,
        f: impl FnOnce(&mut Shard) -> R + Send + 'static,
    ) -> Result<R, ServiceError> {
        self.submit(i, true, f).wait()
    }

    /// Run `f` on the shard owning `id`.
    fn on_model<R: Send + 'static>(
        &self,
        id: &str,
        f: impl FnOnce(&mut Shard) -> Result<R, ServiceError> + Send + 'static,
    ) -> Result<R, ServiceError> {
        self.on_shard(self.shard_of(id), f)?
    }

    /// Run `f` on the shard owning `id`; `f` answers through its [`Reply`] (at once, or when the
    /// store has made its write durable).
    fn on_model_reply<R: Send + 'static>(
        &self,
        id: &str,
        wait: bool,
        f: impl FnOnce(&mut Shard, Reply<R>) + Send + 'static,
    ) -> Pending<Result<R, ServiceError>> {
        self.submit_with(self.shard_of(id), wait, move |s, tx| f(s, Reply::new(tx)))
    }

    // --- registry ---------------------------------------------------------------------------

    /// Validate, compile and register a new model. A spec with a `template` (and no lineage
    /// yet) is first materialized over the template model's spec (`spec::template`).
    pub fn create(&self, spec: ModelSpec) -> Result<ModelInfo, ServiceError> {
        let spec = self.materialize(spec)?;
        let answer = self.queue_create(spec, true, None);
        // Over a store the answer waits for its write to be durable: no use polling for it.
        if self.store.is_some() {
            answer.wait_long()?
        } else {
            answer.wait()?
        }
    }

    /// [`create`](Self::create) for async callers, of a spec without a `template` to
    /// materialize (one with is refused: [`create`](Self::create) it from a thread): queued on
    /// its shard at once, or refused with [`ServiceError::Busy`] on a full queue. `body_key`:
    /// the key of the members after the leading `id` of the request body the spec was parsed
    /// from, under which the spec, once found valid, is remembered for
    /// [`create_copy`](Self::create_copy).
    pub fn create_queued(&self, spec: ModelSpec, body_key: Option<[u8; 32]>) -> Answer<ModelInfo> {
        if spec.template.is_some() && spec.lineage.is_empty() {
            return Answer(Pending::failed(ServiceError::BadRequest(
                "a spec with a template is materialized before it is queued".into(),
            )));
        }
        Answer(self.queue_create(spec, false, body_key))
    }

    /// The spec created before from a body whose members after its leading `id` had the key
    /// `body_key`, if it is still remembered.
    pub fn prepared(&self, body_key: &[u8; 32]) -> Option<Arc<PreparedSpec>> {
        self.prepared.lock().ok()?.get(body_key).cloned()
    }

    /// Create model `id` as a copy of a spec created before: the same as creating the spec
    /// with its id replaced by `id`, without parsing, serialising or validating it again
    /// (only `id` is checked). Queued at once, as [`create_queued`](Self::create_queued).
    pub fn create_copy(&self, id: String, of: Arc<PreparedSpec>) -> Answer<ModelInfo> {
        let max = self.limits.max_models;
        let count = self.count.clone();
        let subscribers = self.subscribers.clone();
        let shard = self.shard_of(&id);
        let residency = self.residency.clone();
        Answer(self.submit_with(shard, false, move |s, tx| {
            residency
                .copies
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let reply = Reply::new(tx);
            if let Some(f) = valem_engine::validate::check_id(&id) {
                return reply.send(Err(ServiceError::InvalidSpec(vec![f])));
            }
            let Some(reply) = reserve(&count, max, subscribers, reply) else {
                return;
            };
            let text = of.text_for(&id);
            s.create(id, of.spec.clone(), (text, of.hash), reply)
        }))
    }

    /// Queue the creation of `spec` (materialized) on its shard, which serialises, hashes and
    /// validates it, reserves its place under `max_models` and creates it: the caller's thread
    /// waits for the store, never for that work. The reply's hook gives the place back when
    /// the creation fails and announces the model when it succeeds, whether or not the caller
    /// still waits.
    fn queue_create(
        &self,
        spec: ModelSpec,
        wait: bool,
        body_key: Option<[u8; 32]>,
    ) -> Pending<Result<ModelInfo, ServiceError>> {
        let engine = self.limits.engine.clone();
        let max = self.limits.max_models;
        let count = self.count.clone();
        let subscribers = self.subscribers.clone();
        let id = spec.id.clone();
        let memo = body_key.map(|k| (k, self.prepared_sink()));
        self.on_model_reply(&id, wait, move |s, reply: Reply<ModelInfo>| {
            let (text, hash) = match prepare_create(&spec, &engine) {
                Ok(prepared) => prepared,
                Err(e) => return reply.send(Err(e)),
            };
            let Some(reply) = reserve(&count, max, subscribers, reply) else {
                return;
            };
            let id = spec.id.clone();
            let spec = Arc::new(spec);
            if let Some((key, sink)) = memo {
                if let Some(p) = PreparedSpec::new(spec.clone(), &text, hash) {
                    sink(key, p);
                }
            }
            s.create(id, spec, (text, hash), reply)
        })
    }

    /// Where a shard remembers a prepared spec (bounded: emptied when full).
    fn prepared_sink(&self) -> impl FnOnce([u8; 32], PreparedSpec) + Send + 'static {
        let prepared = self.prepared.clone();
        move |key, p| {
            if let Ok(mut m) = prepared.lock() {
                if m.len() >= PREPARED_SPECS {
                    m.clear();
                }
                m.insert(key, Arc::new(p));
            }
        }
    }

    /// A branch flattened over its template (a model of this daemon; for a model of a sandbox
    /// session, one of that session's: [`scope::resolve`]); other specs unchanged.
    pub fn materialize(&self, spec: ModelSpec) -> Result<ModelSpec, ServiceError> {
        let Some(t) = spec.template.as_ref().filter(|_| spec.lineage.is_empty()) else {
            return Ok(spec);
        };
        let finding = |message: String| {
            ServiceError::InvalidSpec(vec![Finding {
                location: "template.ref".into(),
                message,
            }])
        };
        // A session's branch names its template among its own models: one outside the
        // namespace is as absent as one that does not exist, and the error names only the
        // reference as sent.
        let reference = scope::resolve(&spec.id, &t.reference);
        if reference == spec.id {
            return Err(finding(format!(
                "lineage is cyclic: `{}` cannot be its own template",
                t.reference
            )));
        }
        let template = match self.spec(&crate::ModelId::from(&reference)).wait() {
            Ok(s) => s,
            Err(ServiceError::NotFound(_)) => {
                return Err(finding(format!(
                    "template `{}` is not a model of this daemon; create it first",
                    t.reference
                )))
            }
            Err(e) => return Err(e),
        };
        valem_core::spec::template::materialize(&spec, &template)
            .map_err(|e| finding(e.to_string()))
    }

    /// Model ids, alphabetical.
    pub fn list(&self) -> Result<Vec<String>, ServiceError> {
        // A fleet's models are every node's: the store lists them.
        if let Some(store) = self.store.as_ref().filter(|s| s.is_fleet()) {
            return store
                .model_ids(None)
                .map_err(|e| ServiceError::Storage(e.to_string()));
        }
        let mut all = Vec::new();
        for i in 0..self.shards.len() {
            all.extend(self.on_shard(i, |s| s.ids())?);
        }
        all.sort();
        Ok(all)
    }

    pub fn delete(&self, id: &ModelId) -> Result<(), ServiceError> {
        let owned = id.clone();
        self.on_model_reply(id, true, move |s, r| s.delete(&owned, r))
            .wait()??;
        // A fleet's node may delete a model it never counted.
        let _ = self.count.fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |n| n.checked_sub(1),
        );
        if let Some(sink) = self.audit_sink.get() {
            sink.delete(id);
        }
        self.subscribers.publish(Event::Deleted {
            model_id: id.to_string(),
        });
        Ok(())
    }

    pub fn info(&self, id: &ModelId) -> Call<'_, ModelInfo> {
        let owned = id.clone();
        self.read(id, move |s| Ok(s.entry(&owned)?.info()))
    }

    pub fn spec(&self, id: &ModelId) -> Call<'_, Arc<ModelSpec>> {
        let owned = id.clone();
        self.read(id, move |s| Ok(s.entry(&owned)?.named_spec()))
    }

    /// The library a model binds: layers and exports (`None` when it has none).
    pub fn library(&self, id: &ModelId) -> Call<'_, Option<Json>> {
        let owned = id.clone();
        self.read(id, move |s| s.library(&owned))
    }

    // --- reads ------------------------------------------------------------------------------

    /// The merged state, now or as of `at`.
    pub fn state(&self, id: &ModelId, at: Option<Timestamp>) -> Call<'_, Json> {
        let owned = id.clone();
        self.read(id, move |s| s.state(&owned, at))
    }

    /// The merged value at `path`; `None` when absent.
    pub fn field(&self, id: &ModelId, path: &str) -> Call<'_, Option<Json>> {
        let (owned, p) = (id.clone(), path.to_string());
        self.read(id, move |s| s.field(&owned, &p))
    }

    /// The static schema at `path` overlaid with live meta.
    pub fn effective_schema(&self, id: &ModelId, path: &str) -> Call<'_, Json> {
        let (owned, p) = (id.clone(), path.to_string());
        self.read(id, move |s| s.effective_schema(&owned, &p))
    }

    /// Traces whose target starts with `path`, oldest first (the most recent `limit`).
    pub fn explain(&self, id: &ModelId, path: &str, limit: Option<usize>) -> Call<'_, Vec<Trace>> {
        let (owned, p) = (id.clone(), path.to_string());
        self.read(id, move |s| s.explain(&owned, &p, limit))
    }

    /// Commit times (ISO-8601), oldest first.
    pub fn history(&self, id: &ModelId) -> Call<'_, Vec<String>> {
        let owned = id.clone();
        self.read(id, move |s| s.history(&owned))
    }

    pub fn audit(&self, id: &ModelId, q: AuditQuery) -> Result<Vec<Json>, ServiceError> {
        if let Some(sink) = self.audit_sink.get() {
            self.info(id).wait()?;
            let mut records = self.plugin_audit(sink, id, q)?;
            records.reverse(); // newest first, as everywhere
            return Ok(records.into_iter().map(|e| e.record).collect());
        }
        let owned = id.clone();
        self.on_model(id, move |s| s.audit(&owned, &q))
    }

    pub fn verify_audit(&self, id: &ModelId) -> Result<Json, ServiceError> {
        if let Some(sink) = self.audit_sink.get() {
            let owned = id.clone();
            let head = self.on_model(id, move |s| s.audit_head(&owned))?;
            let records = self.plugin_audit(sink, id, AuditQuery::default())?;
            let storage = |e: valem_store::StoreError| ServiceError::Storage(e.to_string());
            let hasher = match &self.store {
                Some(s) => s.record_hasher(id).map_err(storage)?,
                None => valem_store::ChainHasher::plain(),
            };
            let mut report = audit::verify_stored(&records, head, &hasher);
            // The plugin holds the records; the checkpoints stay in the store.
            if let Some(store) = &self.store {
                let (checked, broken) = store.verify_model_checkpoints(id).map_err(storage)?;
                report["checkpointsChecked"] = Json::from(checked);
                if let Some(b) = broken {
                    if report["valid"] == Json::Bool(true) {
                        report["valid"] = Json::Bool(false);
                        report["detail"] = Json::String(format!(
                            "{}: {}",
                            valem_store::checkpoints::describe(b.sequence),
                            b.detail
                        ));
                    }
                    report["brokenCheckpoint"] = serde_json::to_value(b).unwrap_or(Json::Null);
                }
            }
            return Ok(report);
        }
        let owned = id.clone();
        self.on_model(id, move |s| s.verify_audit(&owned))
    }

    /// Feed committed audit records to an audit-store plugin from now on, and answer audit
    /// queries from it (set once, before serving).
    pub fn set_audit_plugin(&self, p: Arc<crate::plugins::Plugin>) -> bool {
        self.audit_sink.set(audit_sink::AuditSink::start(p)).is_ok()
    }

    /// Records the audit plugin holds for `id` (oldest first), once the feed has caught up.
    fn plugin_audit(
        &self,
        sink: &audit_sink::AuditSink,
        id: &str,
        q: AuditQuery,
    ) -> Result<Vec<valem_sdk::AuditEntry>, ServiceError> {
        sink.settle(std::time::Duration::from_secs(5));
        let query = valem_sdk::AuditQuery {
            model_id: id.to_string(),
            from_us: q.from.map(Timestamp::us),
            to_us: q.to.map(Timestamp::us),
            path_prefix: q.path_prefix,
            limit: q.limit,
        };
        let v = sink
            .plugin
            .call(
                "audit.query",
                serde_json::to_value(query).unwrap_or_default(),
            )
            .map_err(|e| ServiceError::Storage(e.to_string()))?;
        serde_json::from_value(v).map_err(|e| {
            ServiceError::Storage(format!(
                "audit store plugin `{}` answered records this daemon cannot read: {e}",
                sink.plugin.name
            ))
        })
    }

    pub fn view(&self, id: &ModelId, view_id: Option<&str>) -> Call<'_, Json> {
        let (owned, v) = (id.to_string(), view_id.map(String::from));
        self.read(id, move |s| s.view(&owned, v.as_deref()))
    }

    /// The dependency graph of the compiled spec: nodes, edges, topological levels.
    pub fn graph(&self, id: &ModelId) -> Call<'_, Json> {
        let owned = id.clone();
        self.read(id, move |s| s.graph(&owned))
    }

    /// The trust report of the spec's embedded tests (computed once per spec).
    pub fn verification(&self, id: &ModelId) -> Call<'_, Arc<Json>> {
        let owned = id.clone();
        self.read(id, move |s| s.verification(&owned))
    }

    // --- writes -----------------------------------------------------------------------------

    /// A write on the shard owning `id`, as a [`Call`]: `f` answers through its [`Reply`] (at
    /// once, or when the store has made its write durable).
    fn write<R: Send + 'static>(
        &self,
        id: &ModelId,
        f: impl FnOnce(&mut Shard, &str, Reply<R>) + Send + 'static,
    ) -> Call<'_, R> {
        let owned = id.clone();
        Call {
            service: self,
            shard: self.shard_of(id),
            job: Box::new(move |s, r| f(s, &owned, r)),
        }
    }

    /// A read on the shard owning `id`, as a [`Call`].
    fn read<R: Send + 'static>(
        &self,
        id: &ModelId,
        f: impl FnOnce(&mut Shard) -> Result<R, ServiceError> + Send + 'static,
    ) -> Call<'_, R> {
        self.write(id, move |s, _, r| r.send(f(s)))
    }

    /// One reactive cycle for a flat `{"$.path": value}` mutation set.
    pub fn mutate(
        &self,
        id: &ModelId,
        mutations: Vec<(String, Json)>,
    ) -> Call<'_, Arc<MutationResult>> {
        self.write(id, move |s, id, r| {
            s.mutate(id, mutations, Source::Client, r)
        })
    }

    /// An effect's fold-back: applied (as a `foldback` cycle) only while the effect's last
    /// dedupe key is still `key` — checked on the shard, so no write slips in between.
    pub fn foldback(
        &self,
        id: &ModelId,
        effect_id: &str,
        key: Option<Json>,
        mutations: Vec<(String, Json)>,
    ) -> Call<'_, Arc<MutationResult>> {
        let effect = effect_id.to_string();
        self.write(id, move |s, id, r| {
            if let Some(k) = &key {
                let current = s
                    .entry(id)
                    .map(|e| e.model.state().effect_keys.get(effect.as_str()).cloned());
                match current {
                    Ok(c) if c.as_ref() == Some(&valem_core::value::Val::from_json(k)) => {}
                    Ok(_) => return r.send(Err(ServiceError::Superseded(effect))),
                    Err(e) => return r.send(Err(e)),
                }
            }
            s.mutate(id, mutations, Source::Foldback, r)
        })
    }

    /// A write from another model's `target` link (audited `source: "link"`).
    pub fn mutate_linked(
        &self,
        id: &ModelId,
        mutations: Vec<(String, Json)>,
    ) -> Call<'_, Arc<MutationResult>> {
        self.write(id, move |s, id, r| s.mutate(id, mutations, Source::Link, r))
    }

    /// The dedupe key each effect of the model last fired with.
    pub fn effect_keys(&self, id: &ModelId) -> Call<'_, Map<String, Json>> {
        let owned = id.clone();
        self.read(id, move |s| {
            let e = s.entry(&owned)?;
            Ok(e.model
                .state()
                .effect_keys
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_json()))
                .collect())
        })
    }

    /// One write (mutations or a JSON Patch), answered with `view` of the state it committed
    /// when one is asked for: the check that the view exists, the cycle and the view are one
    /// shard job, so no other write comes between them.
    pub fn write_viewed(
        &self,
        id: &ModelId,
        change: Change,
        view: Option<String>,
    ) -> Call<'_, Viewed> {
        self.write_once(id, change, view, None)
    }

    /// [`write_viewed`](Self::write_viewed) under an idempotency key: a request sent again
    /// with the same key (and the same change and view) is answered as the first was
    /// (`replayed`) and applied once; with another change it is refused
    /// ([`ServiceError::KeyReused`]).
    pub fn write_once(
        &self,
        id: &ModelId,
        change: Change,
        view: Option<String>,
        key: Option<IdempotencyKey>,
    ) -> Call<'_, Viewed> {
        self.write(id, move |s, id, r| s.write_viewed(id, change, view, key, r))
    }

    /// One reactive cycle for an RFC 6902 JSON Patch of the base document.
    pub fn patch(&self, id: &ModelId, patch: json_patch::Patch) -> Call<'_, Viewed> {
        self.write_viewed(id, Change::Patch(patch), None)
    }

    pub fn snapshot(&self, id: &ModelId) -> Call<'_, Json> {
        let owned = id.clone();
        self.read(id, move |s| s.snapshot(&owned))
    }

    /// Replace the model's state with a snapshot's (one cycle, audited).
    pub fn restore(&self, id: &ModelId, snapshot: Json) -> Call<'_, Json> {
        self.write(id, move |s, id, r| s.restore_durably(id, snapshot, r))
    }

    /// Apply a SpecEvolution: the new spec and the state evolved under it, committed together.
    pub fn evolve(&self, id: &ModelId, evo: SpecEvolution) -> Call<'_, ModelInfo> {
        self.write(id, move |s, id, r| s.evolve_durably(id, evo, r))
    }
}

impl Drop for ModelService {
    fn drop(&mut self) {
        self.shards.clear();
        if let Ok(mut t) = self.threads.lock() {
            for h in t.drain(..) {
                let _ = h.join();
            }
        }
    }
}

/// A JSON object's entries as the ordered mutation list the engine takes.
pub fn mutation_list(m: &Map<String, Json>) -> Vec<(String, Json)> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// Specs remembered for [`ModelService::create_copy`]; past it the memory is emptied.
const PREPARED_SPECS: usize = 64;

/// A spec created before, kept to create copies of it under other ids: agents create a model
/// per conversation, quote or ticket from one spec, and a `POST /models` body that differs
/// from an earlier one only in its leading `id` then needs no parsing, serialising or
/// validating. Holds the parsed spec (under the id it was first created with), its
/// serialisation after the `id` member, and its content hash.
pub struct PreparedSpec {
    spec: Arc<ModelSpec>,
    /// The serialisation after `{"id":"…"`.
    rest: String,
    hash: [u8; 32],
}

impl PreparedSpec {
    fn new(spec: Arc<ModelSpec>, text: &str, hash: [u8; 32]) -> Option<PreparedSpec> {
        let mut prefix = String::from("{\"id\":");
        prefix.push_str(&serde_json::to_string(&spec.id).ok()?);
        let rest = text.strip_prefix(&prefix)?.to_string();
        Some(PreparedSpec { spec, rest, hash })
    }

    /// The serialisation of this spec under id `id`.
    fn text_for(&self, id: &str) -> String {
        let mut text = String::with_capacity(self.rest.len() + id.len() + 8);
        text.push_str("{\"id\":");
        text.push_str(&serde_json::Value::from(id).to_string());
        text.push_str(&self.rest);
        text
    }
}

/// Reserve a creation's place under `max` models (or answer `TooManyModels`): its reply then
/// gives the place back when the creation fails and announces the model when it succeeds.
fn reserve(
    count: &Arc<std::sync::atomic::AtomicUsize>,
    max: usize,
    subscribers: Arc<Subscribers>,
    reply: Reply<ModelInfo>,
) -> Option<Reply<ModelInfo>> {
    use std::sync::atomic::Ordering::SeqCst;
    if count
        .fetch_update(SeqCst, SeqCst, |c| (c < max).then_some(c + 1))
        .is_err()
    {
        reply.send(Err(ServiceError::TooManyModels(max)));
        return None;
    }
    let count = count.clone();
    Some(reply.hooked(Box::new(move |r| match r {
        Ok(info) => subscribers.publish(Event::Created {
            model_id: info.id.to_string(),
        }),
        Err(_) => {
            count.fetch_sub(1, SeqCst);
        }
    })))
}

/// A materialized spec's serialisation (hashed for the validation and compile caches, and
/// stored as it is) and content hash, once it is found valid.
fn prepare_create(
    spec: &ModelSpec,
    engine: &EngineLimits,
) -> Result<(String, [u8; 32]), ServiceError> {
    let text = serde_json::to_string(spec).map_err(|e| ServiceError::Storage(e.to_string()))?;
    let hash = valem_engine::content_hash_of(&text, &spec.id, engine.jit.enabled);
    let report = valem_engine::validate::validate_hashed(spec, Some(hash), engine);
    if !report.valid {
        return Err(ServiceError::InvalidSpec(report.errors));
    }
    Ok((text, hash))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn demo() -> Arc<ModelService> {
        let svc = ModelService::new(1, ServiceLimits::default());
        let spec = valem_core::spec::parse_spec_text(
            r#"{"id":"demo","version":"1","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}]}"#,
        )
        .expect("the demo spec parses");
        svc.create(spec).expect("the demo model is created");
        svc
    }

    fn write(price: i64) -> Vec<(String, Json)> {
        vec![
            ("$.price".to_string(), serde_json::json!(price)),
            ("$.qty".to_string(), serde_json::json!(3)),
        ]
    }

    static RELEASES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// A large model leaving memory (evicted under the residency bound, or deleted) gives
    /// its memory back through the release set at start; a small one does not ask.
    #[test]
    fn a_large_model_leaving_memory_releases_memory() {
        set_memory_release(|| {
            RELEASES.fetch_add(1, Ordering::SeqCst);
        });
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store =
            valem_store::SqliteStore::open(dir.path(), valem_store::StoreOptions::default())
                .expect("the store opens");
        let limits = ServiceLimits {
            max_resident_models: Some(1),
            ..ServiceLimits::default()
        };
        let svc = ModelService::open(1, limits, Arc::new(store)).expect("the service opens");
        let spec = |id: &str, n: usize| {
            let derivations: Vec<Json> = (0..n)
                .map(
                    |i| serde_json::json!({"path": format!("$.t{i}"), "expr": format!("p{i} * 2")}),
                )
                .collect();
            valem_core::spec::parse_spec(&serde_json::json!({
                "id": id, "schema": {}, "derivations": derivations
            }))
            .expect("the spec parses")
        };
        let released = || RELEASES.load(Ordering::SeqCst);
        svc.create(spec("big", RELEASE_FROM_NODES))
            .expect("created");
        let before = released();
        svc.create(spec("small", 3)).expect("created");
        assert_eq!(released(), before + 1, "the large model was evicted");
        svc.create(spec("other", 3)).expect("created");
        assert_eq!(released(), before + 1, "a small one evicted asks nothing");
        // Woken by a read (evicting `other`), then deleted.
        assert!(svc.field(&ModelId::from("big"), "$.t1").wait().is_ok());
        svc.delete(&ModelId::from("big")).expect("deleted");
        assert_eq!(released(), before + 2, "the large model was deleted");
    }

    #[test]
    fn async_cycles_queue_in_order_and_a_full_shard_refuses_more() {
        let svc = demo();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        // An awaited cycle answers as a waited one does.
        let r = rt
            .block_on(svc.mutate(&ModelId::from("demo"), write(2)).queue())
            .expect("the cycle commits");
        assert!(r.success);
        assert_eq!(
            svc.field(&ModelId::from("demo"), "$.total")
                .wait()
                .ok()
                .flatten(),
            Some(serde_json::json!(6))
        );

        // Hold the shard, then fill its queue with async cycles.
        let (started_tx, started) = mpsc::channel();
        let (release, held) = mpsc::channel::<()>();
        let hold = svc.submit(0, true, move |_| {
            let _ = started_tx.send(());
            let _ = held.recv();
        });
        started.recv().expect("the shard runs the holding job");
        let queued: Vec<_> = (0..SHARD_QUEUE)
            .map(|i| svc.mutate(&ModelId::from("demo"), write(i as i64)).queue())
            .collect();
        let refused = rt.block_on(svc.mutate(&ModelId::from("demo"), write(-1)).queue());
        assert!(
            matches!(refused, Err(ServiceError::Busy(n)) if n == SHARD_QUEUE),
            "{refused:?}"
        );
        let _ = release.send(());
        hold.wait().expect("the holding job finishes");
        for (i, q) in queued.into_iter().enumerate() {
            let r = rt.block_on(q).unwrap_or_else(|e| panic!("cycle {i}: {e}"));
            assert!(r.success);
        }
        // Every queued cycle ran, in order, and the refused one did not.
        let last = SHARD_QUEUE as i64 - 1;
        assert_eq!(
            svc.field(&ModelId::from("demo"), "$.total")
                .wait()
                .ok()
                .flatten(),
            Some(serde_json::json!(last * 3))
        );
        let newest = svc
            .audit(
                &ModelId::from("demo"),
                AuditQuery {
                    limit: Some(1),
                    ..Default::default()
                },
            )
            .expect("the audit trail");
        assert_eq!(newest[0]["sequence"], serde_json::json!(SHARD_QUEUE));
        // The queue gauge returns to zero once the shard is idle.
        let depth = &svc.shards[0].depth;
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while depth.load(Ordering::Relaxed) != 0 && std::time::Instant::now() < until {
            std::thread::yield_now();
        }
        assert_eq!(depth.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn poll_credit_stops_polling_after_misses_and_probes() {
        let c = PollCredit::default();
        c.record(true);
        assert!(c.wanted());
        for _ in 0..4 {
            c.record(false);
        }
        // Credit gone: only one call in 32 probes.
        let probes = (0..64).filter(|_| c.wanted()).count();
        assert_eq!(probes, 2);
        c.record(true);
        assert!((0..8).all(|_| c.wanted()));
    }
}

// The unit tests count their allocations, so that memory budgets are enforced there too.
#[cfg(test)]
#[global_allocator]
static GLOBAL: valem_core::budget::Counting<std::alloc::System> =
    valem_core::budget::Counting(std::alloc::System);
