//! ModelService: the one API every surface (MCP, REST, console, WebSocket) calls. Owns the
//! registry of live models, spread over shard threads (a model lives on one shard, chosen by a
//! hash of its id, and is touched only by that thread: no locks on the hot path), the per-model
//! history and explain rings, the session audit trail, the blob store and change subscriptions.
//! Never speaks a wire protocol: surfaces translate to and from these calls.

mod audit;
mod audit_sink;
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
use valem_engine::validate::Finding;
use valem_engine::{EngineLimits, MutationError, MutationResult, Trace};

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
    fn of(spec: &ModelSpec) -> ModelInfo {
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
            id: spec.id.clone(),
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
    /// The model's shard has this many requests queued already: the daemon is overloaded.
    #[error(
        "the daemon is overloaded ({0} requests are queued for this model's shard); retry shortly"
    )]
    Busy(usize),
    /// A fold-back whose effect fired again with another key meanwhile: not applied.
    #[error("effect `{0}` was superseded: its dedupe key changed while it ran")]
    Superseded(String),
}

impl ServiceError {
    /// The contract's structured failure body (schema violation, constraint violation, version
    /// conflict), the same on every surface; `None` for failures that are only a message.
    pub fn structured(&self) -> Option<Json> {
        match self {
            ServiceError::Mutation(
                m @ (MutationError::Schema(_) | MutationError::Constraint { .. }),
            ) => Some(m.to_json()),
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

fn findings_text(f: &[Finding]) -> String {
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
    Deleted {
        model_id: String,
    },
}

impl Event {
    pub fn model_id(&self) -> &str {
        match self {
            Event::Mutation { model_id, .. }
            | Event::SpecEvolved { model_id, .. }
            | Event::Restored { model_id }
            | Event::Deleted { model_id } => model_id,
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
    list: Mutex<Vec<(EventFilter, EventSink)>>,
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

type Job = Box<dyn FnOnce(&mut Shard) + Send>;

/// Where a shard job's answer goes: now, or once the store has made the job's write durable.
pub(crate) struct Reply<R>(oneshot::Sender<Result<R, ServiceError>>);

impl<R: Send + 'static> Reply<R> {
    pub fn send(self, r: Result<R, ServiceError>) {
        let _ = self.0.send(r);
    }

    /// Answer `ok` once `op` is committed (fsynced in strict mode), or the store's error; `then`
    /// runs first with whether it committed (on the writer thread: it must not block).
    pub fn after(
        self,
        writer: &valem_store::Writer,
        op: valem_store::Op,
        ok: R,
        then: impl FnOnce(bool) + Send + 'static,
    ) {
        writer.submit(
            op,
            Box::new(move |res| {
                then(res.is_ok());
                self.send(
                    res.map(|()| ok)
                        .map_err(|e| ServiceError::Storage(e.to_string())),
                );
            }),
        );
    }
}

/// A shard's queue, how many of its jobs are queued or running, and whether polling for its
/// answers has been paying off.
struct ShardHandle {
    tx: SyncSender<Job>,
    depth: Arc<std::sync::atomic::AtomicUsize>,
    poll: Arc<PollCredit>,
}

/// Adaptive polling for async callers. A poll that catches the answer saves a reactor thread's
/// park and wake-up; one that misses burns a core for nothing, which on a loaded small machine
/// starves the very threads that would produce the answer. So a shard whose answers were caught
/// keeps being polled, and one whose polls missed stops (halving per miss) except for one
/// probe in 32 calls.
#[derive(Default)]
struct PollCredit {
    credit: std::sync::atomic::AtomicU32,
    calls: std::sync::atomic::AtomicU32,
}

impl PollCredit {
    const FULL: u32 = 8;

    fn wanted(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.credit.load(Relaxed) > 0 || self.calls.fetch_add(1, Relaxed).is_multiple_of(32)
    }

    fn record(&self, caught: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let next = if caught {
            Self::FULL
        } else {
            self.credit.load(Relaxed) / 2
        };
        self.credit.store(next, Relaxed);
    }
}

/// The model service. Cheap to share (`Arc`); every call blocks the caller until the owning
/// shard answers.
pub struct ModelService {
    shards: Vec<ShardHandle>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    limits: ServiceLimits,
    blobs: Mutex<BlobStore>,
    subscribers: Arc<Subscribers>,
    count: Arc<std::sync::atomic::AtomicUsize>,
    metrics: Arc<metrics::CycleMetrics>,
    checkpoint_metrics: Arc<metrics::CheckpointMetrics>,
    /// Whether async callers may poll for an answer at all (see [`Pending`]).
    async_polling: std::sync::atomic::AtomicBool,
    store: Option<Arc<dyn valem_store::Store>>,
    /// A blob-store plugin keeping the blob bytes (metadata stays in the store, or in
    /// `plugin_blobs` without one).
    blob_plugin: std::sync::OnceLock<Arc<crate::plugins::Plugin>>,
    /// An audit-store plugin's feed (shared with the shards, which feed it).
    audit_sink: Arc<std::sync::OnceLock<audit_sink::AuditSink>>,
    plugin_blobs: Mutex<std::collections::HashMap<String, BlobRef>>,
}

/// Jobs queued per shard before callers wait (back-pressure, not an error).
const SHARD_QUEUE: usize = 1024;

/// How long a thread polls for its shard's answer, and a shard for its next job, before
/// parking. A park/unpark pair costs tens of µs on a busy or virtualised host, more than a
/// small cycle; a short poll keeps a conversation of calls (an agent's session over stdio, a
/// lone HTTP client) off the scheduler. Async callers poll only when their job was alone on the
/// shard and polling has been catching answers ([`PollCredit`]).
const REPLY_SPIN: std::time::Duration = std::time::Duration::from_micros(50);
const SHARD_SPIN: std::time::Duration = std::time::Duration::from_micros(20);

/// Poll `ready` for up to `spin` (reading the clock only every 64 polls: on a virtualised host
/// a clock read is not free), then give up.
fn spin_until<T>(
    spin: std::time::Duration,
    mut ready: impl FnMut() -> Poll<Option<T>>,
) -> Poll<Option<T>> {
    let start = std::time::Instant::now();
    let mut n = 0u32;
    loop {
        if let Poll::Ready(v) = ready() {
            return Poll::Ready(v);
        }
        n = n.wrapping_add(1);
        if n.is_multiple_of(64) && start.elapsed() >= spin {
            return Poll::Pending;
        }
        std::hint::spin_loop();
    }
}

fn next_job(rx: &Receiver<Job>) -> Option<Job> {
    let polled = spin_until(SHARD_SPIN, || match rx.try_recv() {
        Ok(j) => Poll::Ready(Some(j)),
        Err(mpsc::TryRecvError::Disconnected) => Poll::Ready(None),
        Err(mpsc::TryRecvError::Empty) => Poll::Pending,
    });
    match polled {
        Poll::Ready(j) => j,
        Poll::Pending => rx.recv().ok(),
    }
}

/// A shard's answer on its way. A thread [`wait`](Pending::wait)s for it; async code awaits it
/// (it is a `Future`), so a reactor thread is never blocked on a shard. When the job was alone
/// on its shard, the first poll may poll for up to [`REPLY_SPIN`] before yielding (see
/// [`PollCredit`]): the answer is one cycle away, and a reactor thread's park and wake-up cost
/// more than that on a virtualised host. Behind other jobs the answer is far off.
pub struct Pending<R> {
    rx: Result<oneshot::Receiver<R>, ServiceError>,
    poll_first: Option<Arc<PollCredit>>,
}

fn try_answer<R>(rx: &mut oneshot::Receiver<R>) -> Poll<Option<R>> {
    match rx.try_recv() {
        Ok(v) => Poll::Ready(Some(v)),
        Err(oneshot::error::TryRecvError::Closed) => Poll::Ready(None),
        Err(oneshot::error::TryRecvError::Empty) => Poll::Pending,
    }
}

impl<R> Pending<R> {
    fn failed(e: ServiceError) -> Pending<R> {
        Pending {
            rx: Err(e),
            poll_first: None,
        }
    }

    /// Block the calling thread (never a reactor thread) until the shard answers.
    pub fn wait(self) -> Result<R, ServiceError> {
        let mut rx = self.rx?;
        match spin_until(REPLY_SPIN, || try_answer(&mut rx)) {
            Poll::Ready(v) => v.ok_or(ServiceError::Unavailable),
            Poll::Pending => rx.blocking_recv().map_err(|_| ServiceError::Unavailable),
        }
    }
}

impl<R> std::future::Future for Pending<R> {
    type Output = Result<R, ServiceError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Self::Output> {
        let first = std::mem::take(&mut self.poll_first);
        match &mut self.rx {
            Err(e) => Poll::Ready(Err(std::mem::replace(e, ServiceError::Unavailable))),
            Ok(rx) => {
                if let Some(credit) = first {
                    let polled = spin_until(REPLY_SPIN, || try_answer(rx));
                    credit.record(polled.is_ready());
                    if let Poll::Ready(v) = polled {
                        return Poll::Ready(v.ok_or(ServiceError::Unavailable));
                    }
                }
                std::pin::Pin::new(rx)
                    .poll(cx)
                    .map(|r| r.map_err(|_| ServiceError::Unavailable))
            }
        }
    }
}

impl<R> Pending<Result<R, ServiceError>> {
    /// Flatten a shard job that itself can fail.
    async fn flat(self) -> Result<R, ServiceError> {
        self.await?
    }
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
        let stored = store
            .load_models()
            .map_err(|e| ServiceError::Storage(e.to_string()))?;
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
            let spawned = std::thread::Builder::new()
                .name(format!("valem-shard-{i}"))
                .spawn(move || {
                    let mut shard =
                        Shard::new(lim, subs, cycle_metrics, cp_metrics, shard_store, sink);
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
            async_polling: std::sync::atomic::AtomicBool::new(true),
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
        self.submit_with(self.shard_of(id), wait, move |s, tx| f(s, Reply(tx)))
    }

    // --- registry ---------------------------------------------------------------------------

    /// Validate, compile and register a new model. A spec with a `template` (and no lineage
    /// yet) is first materialized over the template model's spec (`spec::template`).
    pub fn create(&self, spec: ModelSpec) -> Result<ModelInfo, ServiceError> {
        use std::sync::atomic::Ordering;
        let spec = self.materialize(spec)?;
        let report = valem_engine::validate::validate(&spec, &self.limits.engine);
        if !report.valid {
            return Err(ServiceError::InvalidSpec(report.errors));
        }
        let max = self.limits.max_models;
        if self
            .count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| {
                (c < max).then_some(c + 1)
            })
            .is_err()
        {
            return Err(ServiceError::TooManyModels(max));
        }
        let id = spec.id.clone();
        let r = self
            .on_model_reply(&id, true, move |s, r| s.create(spec, r))
            .wait()
            .and_then(|r| r);
        if r.is_err() {
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
        r
    }

    /// Model ids, alphabetical.
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
        let template = match self.spec(&reference) {
            Ok(s) => s,
            Err(ServiceError::NotFound(_)) => {
                return Err(finding(format!(
                    "template `{}` is not a model of this daemon; create it first",
                    t.reference
                )))
            }
            Err(e) => return Err(e),
        };
        valem_core::spec::template::materialize(&spec, &template).map_err(finding)
    }

    pub fn list(&self) -> Result<Vec<String>, ServiceError> {
        let mut all = Vec::new();
        for i in 0..self.shards.len() {
            all.extend(self.on_shard(i, |s| s.ids())?);
        }
        all.sort();
        Ok(all)
    }

    pub fn delete(&self, id: &str) -> Result<(), ServiceError> {
        let owned = id.to_string();
        self.on_model_reply(id, true, move |s, r| s.delete(&owned, r))
            .wait()??;
        self.count.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(sink) = self.audit_sink.get() {
            sink.delete(id);
        }
        self.subscribers.publish(Event::Deleted {
            model_id: id.to_string(),
        });
        Ok(())
    }

    pub fn info(&self, id: &str) -> Result<ModelInfo, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| Ok(ModelInfo::of(&s.entry(&owned)?.spec)))
    }

    pub fn spec(&self, id: &str) -> Result<Arc<ModelSpec>, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| Ok(s.entry(&owned)?.spec.clone()))
    }

    /// The library a model binds: layers and exports (`None` when it has none).
    pub fn library(&self, id: &str) -> Result<Option<Json>, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| s.library(&owned))
    }

    // --- reads ------------------------------------------------------------------------------

    /// The merged state, now or as of `at` (epoch µs).
    pub fn state(&self, id: &str, at: Option<i64>) -> Result<Json, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| s.state(&owned, at))
    }

    /// The merged value at `path`; `None` when absent.
    pub fn field(&self, id: &str, path: &str) -> Result<Option<Json>, ServiceError> {
        let (owned, p) = (id.to_string(), path.to_string());
        self.on_model(id, move |s| s.field(&owned, &p))
    }

    /// The static schema at `path` overlaid with live meta.
    pub fn effective_schema(&self, id: &str, path: &str) -> Result<Json, ServiceError> {
        let (owned, p) = (id.to_string(), path.to_string());
        self.on_model(id, move |s| s.effective_schema(&owned, &p))
    }

    /// Traces whose target starts with `path`, oldest first (the most recent `limit`).
    pub fn explain(
        &self,
        id: &str,
        path: &str,
        limit: Option<usize>,
    ) -> Result<Vec<Trace>, ServiceError> {
        let (owned, p) = (id.to_string(), path.to_string());
        self.on_model(id, move |s| s.explain(&owned, &p, limit))
    }

    /// Commit times (ISO-8601), oldest first.
    pub fn history(&self, id: &str) -> Result<Vec<String>, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| s.history(&owned))
    }

    pub fn audit(&self, id: &str, q: AuditQuery) -> Result<Vec<Json>, ServiceError> {
        if let Some(sink) = self.audit_sink.get() {
            self.info(id)?;
            let mut records = self.plugin_audit(sink, id, q)?;
            records.reverse(); // newest first, as everywhere
            return Ok(records.into_iter().map(|e| e.record).collect());
        }
        let owned = id.to_string();
        self.on_model(id, move |s| s.audit(&owned, &q))
    }

    pub fn verify_audit(&self, id: &str) -> Result<Json, ServiceError> {
        if let Some(sink) = self.audit_sink.get() {
            let owned = id.to_string();
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
        let owned = id.to_string();
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
            from_us: q.from_us,
            to_us: q.to_us,
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

    pub fn view(&self, id: &str, view_id: Option<&str>) -> Result<Json, ServiceError> {
        let (owned, v) = (id.to_string(), view_id.map(String::from));
        self.on_model(id, move |s| s.view(&owned, v.as_deref()))
    }

    /// The dependency graph of the compiled spec: nodes, edges, topological levels.
    pub fn graph(&self, id: &str) -> Result<Json, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| s.graph(&owned))
    }

    /// The trust report of the spec's embedded tests (computed once per spec).
    pub fn verification(&self, id: &str) -> Result<Arc<Json>, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| s.verification(&owned))
    }

    // --- writes -----------------------------------------------------------------------------

    /// One reactive cycle for a flat `{"$.path": value}` mutation set.
    pub fn mutate(
        &self,
        id: &str,
        mutations: Vec<(String, Json)>,
    ) -> Result<Arc<MutationResult>, ServiceError> {
        self.mutate_as(id, mutations, Source::Client)
    }

    fn mutate_as(
        &self,
        id: &str,
        mutations: Vec<(String, Json)>,
        source: Source,
    ) -> Result<Arc<MutationResult>, ServiceError> {
        let owned = id.to_string();
        self.on_model_reply(id, true, move |s, r| s.mutate(&owned, mutations, source, r))
            .wait()?
    }

    /// An effect's fold-back: applied (as a `foldback` cycle) only while the effect's last
    /// dedupe key is still `key` — checked on the shard, so no write slips in between.
    pub fn foldback(
        &self,
        id: &str,
        effect_id: &str,
        key: Option<Json>,
        mutations: Vec<(String, Json)>,
    ) -> Result<Arc<MutationResult>, ServiceError> {
        let (owned, effect) = (id.to_string(), effect_id.to_string());
        self.on_model_reply(id, true, move |s, r| {
            if let Some(k) = &key {
                let current = s
                    .entry(&owned)
                    .map(|e| e.model.state().effect_keys.get(effect.as_str()).cloned());
                match current {
                    Ok(c) if c.as_ref() == Some(&valem_core::value::Val::from_json(k)) => {}
                    Ok(_) => return r.send(Err(ServiceError::Superseded(effect))),
                    Err(e) => return r.send(Err(e)),
                }
            }
            s.mutate(&owned, mutations, Source::Foldback, r)
        })
        .wait()?
    }

    /// A write from another model's `target` link (audited `source: "link"`).
    pub fn mutate_linked(
        &self,
        id: &str,
        mutations: Vec<(String, Json)>,
    ) -> Result<Arc<MutationResult>, ServiceError> {
        self.mutate_as(id, mutations, Source::Link)
    }

    /// The dedupe key each effect of the model last fired with.
    pub fn effect_keys(&self, id: &str) -> Result<Map<String, Json>, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| {
            let e = s.entry(&owned)?;
            Ok(e.model
                .state()
                .effect_keys
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_json()))
                .collect())
        })
    }

    /// [`mutate`](Self::mutate) for async surfaces: the future waits for the cycle without
    /// blocking its thread.
    pub fn mutate_async(
        &self,
        id: &str,
        mutations: Vec<(String, Json)>,
    ) -> impl std::future::Future<Output = Result<Arc<MutationResult>, ServiceError>> + Send + 'static
    {
        let owned = id.to_string();
        self.on_model_reply(id, false, move |s, r| {
            s.mutate(&owned, mutations, Source::Client, r)
        })
        .flat()
    }

    /// One reactive cycle for an RFC 6902 JSON Patch of the base document.
    pub fn patch(
        &self,
        id: &str,
        patch: json_patch::Patch,
    ) -> Result<Arc<MutationResult>, ServiceError> {
        let owned = id.to_string();
        self.on_model_reply(id, true, move |s, r| s.patch(&owned, patch, r))
            .wait()?
    }

    pub fn snapshot(&self, id: &str) -> Result<Json, ServiceError> {
        let owned = id.to_string();
        self.on_model(id, move |s| s.snapshot(&owned))
    }

    pub fn restore(&self, id: &str, snapshot: Json) -> Result<Json, ServiceError> {
        let owned = id.to_string();
        self.on_model_reply(id, true, move |s, r| s.restore_durably(&owned, snapshot, r))
            .wait()?
    }

    pub fn evolve(&self, id: &str, evo: SpecEvolution) -> Result<ModelInfo, ServiceError> {
        let owned = id.to_string();
        self.on_model_reply(id, true, move |s, r| s.evolve_durably(&owned, evo, r))
            .wait()?
    }

    // --- blobs ------------------------------------------------------------------------------

    /// Keep blob bytes in a `blob_store` plugin from now on (set once, before serving).
    pub fn set_blob_plugin(&self, p: Arc<crate::plugins::Plugin>) -> bool {
        self.blob_plugin.set(p).is_ok()
    }

    /// Bytes into the blob plugin, metadata into the store (or memory).
    fn upload_to_plugin(
        &self,
        p: &crate::plugins::Plugin,
        data: Vec<u8>,
        media_type: Option<String>,
    ) -> Result<BlobRef, ServiceError> {
        blobs::check_size(data.len(), self.limits.blob_max_bytes)?;
        let hash = blake3::hash(&data).to_hex().to_string();
        let size = data.len();
        p.call_bytes("blob.put", serde_json::json!({"id": hash}), Arc::from(data))
            .map_err(|e| ServiceError::Storage(e.to_string()))?;
        let r = BlobRef {
            blob_id: hash.clone(),
            bytes: size,
            media_type: media_type.unwrap_or_else(|| "application/octet-stream".into()),
        };
        match &self.store {
            Some(store) => put_blob_meta(&**store, &r)?,
            None => {
                self.plugin_blobs
                    .lock()
                    .map_err(|_| ServiceError::Unavailable)?
                    .insert(hash, r.clone());
            }
        }
        Ok(r)
    }

    /// A blob's bytes from the blob plugin, checked against their content id.
    fn download_from_plugin(
        &self,
        p: &crate::plugins::Plugin,
        blob_id: &str,
    ) -> Result<(BlobRef, Arc<[u8]>), ServiceError> {
        let not_found = || ServiceError::BlobNotFound(blob_id.to_string());
        let meta = match &self.store {
            Some(store) => store
                .blob(blob_id)
                .map_err(|e| ServiceError::Storage(e.to_string()))?
                .map(|m| BlobRef {
                    blob_id: m.id,
                    bytes: m.size as usize,
                    media_type: m.media_type,
                }),
            None => self
                .plugin_blobs
                .lock()
                .map_err(|_| ServiceError::Unavailable)?
                .get(blob_id)
                .cloned(),
        }
        .ok_or_else(not_found)?;
        let bytes = p
            .call_bytes(
                "blob.get",
                serde_json::json!({"id": blob_id}),
                Arc::from([]),
            )
            .map_err(|e| match e.code() {
                Some("not_found") => not_found(),
                _ => ServiceError::Storage(e.to_string()),
            })?;
        if blake3::hash(&bytes).to_hex().as_str() != blob_id {
            return Err(ServiceError::Storage(format!(
                "blob store plugin `{}` returned bytes that do not match blob {blob_id}",
                p.name
            )));
        }
        Ok((meta, Arc::from(bytes)))
    }

    pub fn upload_blob(
        &self,
        data: Vec<u8>,
        media_type: Option<String>,
    ) -> Result<BlobRef, ServiceError> {
        if let Some(p) = self.blob_plugin.get() {
            return self.upload_to_plugin(p, data, media_type);
        }
        let Some(store) = &self.store else {
            return self
                .blobs
                .lock()
                .map_err(|_| ServiceError::Unavailable)?
                .put(data, media_type);
        };
        blobs::check_size(data.len(), self.limits.blob_max_bytes)?;
        // Bytes first (temp file, fsync, rename), then the metadata row: a crash between them
        // leaves an unreferenced file, never a row without bytes.
        let storage = |e: valem_store::StoreError| ServiceError::Storage(e.to_string());
        let hash = store.put_blob_bytes(&data).map_err(storage)?;
        let r = BlobRef {
            blob_id: hash,
            bytes: data.len(),
            media_type: media_type.unwrap_or_else(|| "application/octet-stream".into()),
        };
        put_blob_meta(&**store, &r)?;
        Ok(r)
    }

    /// A blob's bytes; with `model`, only when that model's state references it.
    pub fn download_blob(
        &self,
        blob_id: &str,
        model: Option<&str>,
    ) -> Result<(BlobRef, Arc<[u8]>), ServiceError> {
        if let Some(m) = model {
            let (owned, b) = (m.to_string(), blob_id.to_string());
            if !self.on_model(m, move |s| s.references(&owned, &b))? {
                return Err(ServiceError::BlobNotFound(blob_id.to_string()));
            }
        }
        if let Some(p) = self.blob_plugin.get() {
            return self.download_from_plugin(p, blob_id);
        }
        let Some(store) = &self.store else {
            return self
                .blobs
                .lock()
                .map_err(|_| ServiceError::Unavailable)?
                .get(blob_id)
                .ok_or_else(|| ServiceError::BlobNotFound(blob_id.to_string()));
        };
        let storage = |e: valem_store::StoreError| ServiceError::Storage(e.to_string());
        let meta = store
            .blob(blob_id)
            .map_err(storage)?
            .ok_or_else(|| ServiceError::BlobNotFound(blob_id.to_string()))?;
        let bytes = store.blob_bytes(&meta.hash).map_err(storage)?;
        Ok((
            BlobRef {
                blob_id: meta.id,
                bytes: bytes.len(),
                media_type: meta.media_type,
            },
            Arc::from(bytes),
        ))
    }
}

/// The metadata row of a blob whose bytes are already stored.
fn put_blob_meta(store: &dyn valem_store::Store, r: &BlobRef) -> Result<(), ServiceError> {
    store
        .writer()
        .apply(valem_store::Op::PutBlob(valem_store::BlobMeta {
            id: r.blob_id.clone(),
            hash: r.blob_id.clone(),
            size: r.bytes as u64,
            media_type: r.media_type.clone(),
            filename: None,
            created_us: time::now_us(),
        }))
        .map_err(|e| ServiceError::Storage(e.to_string()))
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

    #[test]
    fn async_cycles_queue_in_order_and_a_full_shard_refuses_more() {
        let svc = demo();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        // An awaited cycle answers as a waited one does.
        let r = rt
            .block_on(svc.mutate_async("demo", write(2)))
            .expect("the cycle commits");
        assert!(r.success);
        assert_eq!(
            svc.field("demo", "$.total").ok().flatten(),
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
            .map(|i| svc.mutate_async("demo", write(i as i64)))
            .collect();
        let refused = rt.block_on(svc.mutate_async("demo", write(-1)));
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
            svc.field("demo", "$.total").ok().flatten(),
            Some(serde_json::json!(last * 3))
        );
        let newest = svc
            .audit(
                "demo",
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
