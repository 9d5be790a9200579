//! The single writer: a dedicated thread owns the write connection and commits submitted ops in
//! batches (group commit), one transaction per batch, and calls each op's completion only after
//! the batch's commit returned. It never reads on behalf of callers and never reorders ops.

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

use rusqlite::{params, Connection, OptionalExtension};
use serde_json::Value as Json;

use super::chain::{
    self, record_hash, record_hash_keyed, AuditKey, CheckpointHeader, Sealed, Seq, GENESIS,
};
use super::{sql_err, BlobMeta, CheckpointKind, Durability, StoreError, Timestamp};

/// Completion of one op: called exactly once, on the writer thread, with `Ok` after the op's batch
/// committed (fsynced in strict mode) or with the error. It must not block or wait on the store.
pub type Done = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// One write.
#[derive(Clone, Debug)]
pub enum Op {
    /// Create a model or replace its spec and version (its audit chain and data are kept).
    PutModel {
        id: String,
        spec_text: String,
        version: String,
        at: Timestamp,
    },
    /// Remove the model and all its rows: audit, audit paths, checkpoints, snapshots. Idempotent.
    DeleteModel { id: String },
    /// Append the next record of a model's chain.
    AppendAudit(AuditAppend),
    /// The model's state after applying record `sequence` (which must be committed), or before
    /// its first record (`None`: a state set without a cycle, such as a restore). Stored with the
    /// hash of that record, the hash of its state text and its own hash over those. A periodic
    /// checkpoint never replaces a base one at the same sequence (they hold the same state, and
    /// the base must stay recognisable); a base one becomes the model's recovery floor.
    Checkpoint {
        model_id: String,
        sequence: Option<Seq>,
        at: Timestamp,
        state: Json,
        kind: CheckpointKind,
    },
    /// Store (or replace) a named snapshot of a model.
    PutSnapshot {
        model_id: String,
        snapshot_id: String,
        at: Timestamp,
        snapshot: Json,
    },
    /// Remove a named snapshot. Idempotent.
    DeleteSnapshot {
        model_id: String,
        snapshot_id: String,
    },
    /// Store (or replace) blob metadata; write the bytes first with `Store::put_blob_bytes`.
    PutBlob(BlobMeta),
    /// Store (or replace) the record of a task (MCP's tasks extension).
    PutTask {
        id: String,
        record: String,
        at: Timestamp,
    },
    /// Forget a task. Idempotent.
    DeleteTask { id: String },
    /// A fleet's node gives model `model_id` up (evicted): another node may claim it at once.
    /// After the ops before it (a checkpoint at its head); a store with one writer ignores it.
    Release { model_id: String },
    /// These ops together, all or none (one savepoint): e.g. a new spec and the checkpoint of
    /// the state evolved under it.
    Atomic(Vec<Op>),
}

/// An audit record ready to append: validated (chained fields present, hash correct) and
/// serialized on the caller's thread, so the writer thread only does SQL.
#[derive(Clone, Debug)]
pub struct AuditAppend {
    pub(crate) model_id: String,
    pub(crate) sequence: u64,
    pub(crate) at_us: i64,
    pub(crate) prev_hash: String,
    pub(crate) hash: String,
    pub(crate) text: String,
    pub(crate) paths: Vec<String>,
    /// The idempotency key the write came with, kept in the same transaction.
    pub(crate) keyed: Option<Box<crate::KeyedWrite>>,
}

impl AuditAppend {
    /// From the record as served (with `modelId`, `sequence`, `prevHash`, `hash`); `paths` are
    /// what a `pathPrefix` filter matches (duplicates are fine). Fails when a field is missing or
    /// `hash` is not [`record_hash`] of the record (keyed with `key`: the store's audit key).
    pub fn new(
        at: Timestamp,
        record: &Json,
        mut paths: Vec<String>,
        key: Option<&AuditKey>,
    ) -> Result<AuditAppend, StoreError> {
        // One index row per distinct path (a derived path is usually also a trace target).
        paths.sort_unstable();
        paths.dedup();
        let invalid = |detail: &str| StoreError::InvalidRecord {
            detail: detail.to_string(),
        };
        let model_id = record
            .get("modelId")
            .and_then(Json::as_str)
            .ok_or_else(|| invalid("no string modelId"))?;
        let sequence = record
            .get("sequence")
            .and_then(Json::as_u64)
            .filter(|s| i64::try_from(*s).is_ok())
            .ok_or_else(|| invalid("no sequence (an integer 0..2^63)"))?;
        let prev_hash = record
            .get("prevHash")
            .and_then(Json::as_str)
            .ok_or_else(|| invalid("no string prevHash"))?;
        let hash = record
            .get("hash")
            .and_then(Json::as_str)
            .ok_or_else(|| invalid("no string hash"))?;
        let expected = match key {
            Some(k) => record_hash_keyed(k, prev_hash, record),
            None => record_hash(prev_hash, record),
        };
        if expected != hash {
            return Err(StoreError::InvalidRecord {
                detail: format!(
                    "record {sequence} of model `{model_id}`: hash is not {}blake3(prevHash || RFC 8785 record without hash)",
                    if key.is_some() { "keyed " } else { "" }
                ),
            });
        }
        let text = serde_json::to_string(record).map_err(|e| invalid(&e.to_string()))?;
        Ok(AuditAppend {
            model_id: model_id.to_string(),
            sequence,
            at_us: at.us(),
            prev_hash: prev_hash.to_string(),
            hash: hash.to_string(),
            text,
            paths,
            keyed: None,
        })
    }

    /// From a record [`Sealed`] by the caller: serialised here, once, and not hashed again.
    /// Fails only when the sequence is past 2^63 (the store's integer).
    pub fn sealed(
        at: Timestamp,
        record: &Sealed,
        mut paths: Vec<String>,
    ) -> Result<AuditAppend, StoreError> {
        paths.sort_unstable();
        paths.dedup();
        let sequence = record.sequence();
        if i64::try_from(sequence.get()).is_err() {
            return Err(StoreError::InvalidRecord {
                detail: format!("sequence {sequence} is past the store's 2^63"),
            });
        }
        let (model_id, prev_hash) = record.parts();
        let text = serde_json::to_string(record.json()).map_err(|e| StoreError::InvalidRecord {
            detail: e.to_string(),
        })?;
        Ok(AuditAppend {
            model_id: model_id.to_string(),
            sequence: sequence.get(),
            at_us: at.us(),
            prev_hash: prev_hash.to_string(),
            hash: record.hash().to_string(),
            text,
            paths,
            keyed: None,
        })
    }

    /// Keep `keyed` with the record (committed together).
    pub fn with_key(mut self, keyed: crate::KeyedWrite) -> AuditAppend {
        self.keyed = Some(Box::new(keyed));
        self
    }

    /// The model the record belongs to.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The record's sequence.
    pub fn sequence(&self) -> Seq {
        Seq::new(self.sequence)
    }
}

/// Writer counters since open (for benchmarks and metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriterStats {
    /// Transactions committed with at least one successful op.
    pub batches_committed: u64,
    /// Ops committed.
    pub ops_committed: u64,
    /// Commit fsyncs: strict-mode batch commits plus relaxed-mode flushes (WAL checkpoints, which
    /// SQLite fsyncs too, are not counted).
    pub fsyncs: u64,
    /// Batches rolled back as a whole (disk full, read-only, I/O error).
    pub batches_failed: u64,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    ops: AtomicU64,
    fsyncs: AtomicU64,
    failed: AtomicU64,
}

/// A completion that reports `WriterStopped` if it is dropped unused (queued when the writer
/// stopped), so every submitted op is answered exactly once.
struct Ack(Option<Done>);

impl Ack {
    fn complete(mut self, r: Result<(), StoreError>) {
        if let Some(f) = self.0.take() {
            // A panicking callback must not take the writer down with it.
            let _ = catch_unwind(AssertUnwindSafe(move || f(r)));
        }
    }
}

impl Drop for Ack {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            let _ = catch_unwind(AssertUnwindSafe(move || f(Err(StoreError::WriterStopped))));
        }
    }
}

enum Msg {
    Op(Op, Ack),
    /// Answered once everything queued before it is durable.
    Flush(Ack),
    Shutdown,
}

/// A cheap, cloneable handle to the writer thread.
#[derive(Clone)]
pub struct Writer {
    tx: SyncSender<Msg>,
    counters: Arc<Counters>,
}

impl Writer {
    /// Queue `op`; `done` is called exactly once (see [`Done`]). Blocks while the queue is full
    /// (backpressure: the writer drains it at disk speed); after shutdown `done` gets
    /// `WriterStopped` at once.
    pub fn submit(&self, op: Op, done: Done) {
        // On a send error the message is dropped and its Ack answers WriterStopped.
        let _ = self.tx.send(Msg::Op(op, Ack(Some(done))));
    }

    /// Submit `op` and wait for its completion.
    pub fn apply(&self, op: Op) -> Result<(), StoreError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(
            op,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv().unwrap_or(Err(StoreError::WriterStopped))
    }

    /// Wait until everything submitted before this call is committed and durable (in relaxed mode
    /// this fsyncs the WAL). Errors of individual ops go to their own completions.
    pub fn flush(&self) -> Result<(), StoreError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let ack = Ack(Some(Box::new(move |r| {
            let _ = tx.send(r);
        })));
        let _ = self.tx.send(Msg::Flush(ack));
        rx.recv().unwrap_or(Err(StoreError::WriterStopped))
    }

    /// The counters so far.
    pub fn stats(&self) -> WriterStats {
        WriterStats {
            batches_committed: self.counters.batches.load(Ordering::Relaxed),
            ops_committed: self.counters.ops.load(Ordering::Relaxed),
            fsyncs: self.counters.fsyncs.load(Ordering::Relaxed),
            batches_failed: self.counters.failed.load(Ordering::Relaxed),
        }
    }

    /// Ask the thread to commit what is queued before this and stop.
    pub(crate) fn shutdown(&self) {
        let _ = self.tx.send(Msg::Shutdown);
    }
}

/// What the writer thread commits batches through: one database connection of a store.
pub(crate) trait Backend: Send + 'static {
    /// Run `ops` in ONE transaction and commit it: each op's own result in order (an op that
    /// fails alone is rolled back to its savepoint, the rest commit), and whether the commit
    /// was synced to stable storage; or the error that failed (and rolled back) the whole batch.
    fn execute(&mut self, ops: &[&Op]) -> Result<(Vec<Result<(), StoreError>>, bool), StoreError>;
    /// Make everything committed so far durable; `Ok(true)` when that took a sync of its own.
    fn sync_for_flush(&mut self) -> Result<bool, StoreError>;
    /// The writer stops: a last chance to tidy up (best effort).
    fn close(&mut self) {}
}

/// Start the writer thread on `backend`.
pub(crate) fn spawn_backend(
    backend: Box<dyn Backend>,
    name: &str,
    queue_capacity: usize,
    max_batch_ops: usize,
) -> std::io::Result<(Writer, JoinHandle<()>)> {
    let (tx, rx) = mpsc::sync_channel(queue_capacity.max(1));
    let counters = Arc::new(Counters::default());
    let state = WriterThread {
        backend,
        max_batch: max_batch_ops.max(1),
        counters: counters.clone(),
    };
    let handle = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || state.run(rx))?;
    Ok((Writer { tx, counters }, handle))
}

/// Start the writer thread on SQLite connection `conn`.
pub(super) fn spawn(
    conn: Connection,
    db: PathBuf,
    durability: Durability,
    queue_capacity: usize,
    max_batch_ops: usize,
    key: Option<AuditKey>,
) -> Result<(Writer, JoinHandle<()>), StoreError> {
    let mut wal = db.clone().into_os_string();
    wal.push("-wal");
    let backend = SqliteBackend {
        conn,
        db: db.clone(),
        wal: PathBuf::from(wal),
        durability,
        key,
    };
    spawn_backend(
        Box::new(backend),
        "valem-store-writer",
        queue_capacity,
        max_batch_ops,
    )
    .map_err(|e| StoreError::io(&db, e))
}

struct WriterThread {
    backend: Box<dyn Backend>,
    max_batch: usize,
    counters: Arc<Counters>,
}

struct SqliteBackend {
    conn: Connection,
    db: PathBuf,
    wal: PathBuf,
    durability: Durability,
    key: Option<AuditKey>,
}

/// How an op failed: alone (its savepoint is rolled back, the batch goes on) or the whole batch.
enum Failure {
    Op(StoreError),
    Batch(rusqlite::Error),
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Failure {
        Failure::Op(e)
    }
}

impl From<rusqlite::Error> for Failure {
    fn from(e: rusqlite::Error) -> Failure {
        match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::ConstraintViolation) => Failure::Op(StoreError::Constraint {
                detail: e.to_string(),
            }),
            _ => Failure::Batch(e),
        }
    }
}

impl WriterThread {
    fn run(mut self, rx: Receiver<Msg>) {
        let mut ops: Vec<(Op, Ack)> = Vec::with_capacity(self.max_batch);
        let mut flushes: Vec<Ack> = Vec::new();
        loop {
            let mut stop = match rx.recv() {
                Ok(m) => self.take(m, &mut ops, &mut flushes),
                Err(_) => true, // every handle is gone
            };
            while !stop && ops.len() < self.max_batch {
                match rx.try_recv() {
                    Ok(m) => stop = self.take(m, &mut ops, &mut flushes),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            if !ops.is_empty() {
                let results = self.execute(&ops);
                for ((_, ack), r) in ops.drain(..).zip(results) {
                    ack.complete(r);
                }
            }
            if !flushes.is_empty() {
                let r = match self.backend.sync_for_flush() {
                    Ok(synced) => {
                        if synced {
                            self.counters.fsyncs.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(())
                    }
                    Err(e) => Err(e),
                };
                for ack in flushes.drain(..) {
                    ack.complete(r.clone());
                }
            }
            if stop {
                break;
            }
        }
        self.backend.close();
        // Messages still queued are dropped with `rx`; their Acks answer WriterStopped.
    }

    /// Returns whether the writer should stop after this batch.
    fn take(&self, m: Msg, ops: &mut Vec<(Op, Ack)>, flushes: &mut Vec<Ack>) -> bool {
        match m {
            Msg::Op(op, ack) => ops.push((op, ack)),
            Msg::Flush(ack) => flushes.push(ack),
            Msg::Shutdown => return true,
        }
        false
    }

    /// One transaction for the whole batch; the result of each op in order.
    fn execute(&mut self, ops: &[(Op, Ack)]) -> Vec<Result<(), StoreError>> {
        let batch: Vec<&Op> = ops.iter().map(|(op, _)| op).collect();
        match self.backend.execute(&batch) {
            Ok((results, synced)) => {
                let ok = results.iter().filter(|r| r.is_ok()).count() as u64;
                if ok > 0 {
                    self.counters.batches.fetch_add(1, Ordering::Relaxed);
                    self.counters.ops.fetch_add(ok, Ordering::Relaxed);
                    if synced {
                        self.counters.fsyncs.fetch_add(1, Ordering::Relaxed);
                    }
                }
                results
            }
            Err(err) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                ops.iter().map(|_| Err(err.clone())).collect()
            }
        }
    }
}

impl Backend for SqliteBackend {
    fn execute(&mut self, ops: &[&Op]) -> Result<(Vec<Result<(), StoreError>>, bool), StoreError> {
        let mut results: Vec<Result<(), StoreError>> = Vec::with_capacity(ops.len());
        let changes_before = self.conn.total_changes();
        let outcome = (|| -> Result<(), rusqlite::Error> {
            self.conn.execute_batch("BEGIN IMMEDIATE")?;
            for op in ops {
                self.conn.prepare_cached("SAVEPOINT op")?.execute([])?;
                match apply(&self.conn, op, self.key.as_ref()) {
                    Ok(()) => {
                        self.conn.prepare_cached("RELEASE op")?.execute([])?;
                        results.push(Ok(()));
                    }
                    Err(Failure::Op(e)) => {
                        self.conn.prepare_cached("ROLLBACK TO op")?.execute([])?;
                        self.conn.prepare_cached("RELEASE op")?.execute([])?;
                        results.push(Err(e));
                    }
                    Err(Failure::Batch(e)) => return Err(e),
                }
            }
            self.conn.execute_batch("COMMIT")
        })();
        match outcome {
            Ok(()) => {
                // A commit that changed no row writes no WAL frame, so SQLite syncs nothing.
                let wrote = self.conn.total_changes() > changes_before;
                Ok((results, self.durability == Durability::Strict && wrote))
            }
            Err(e) => {
                if !self.conn.is_autocommit() {
                    let _ = self.conn.execute_batch("ROLLBACK");
                }
                Err(sql_err(&self.db, e))
            }
        }
    }

    fn sync_for_flush(&mut self) -> Result<bool, StoreError> {
        if self.durability == Durability::Strict {
            return Ok(false); // every commit was already fsynced
        }
        match fs::File::open(&self.wal) {
            Ok(f) => {
                f.sync_all().map_err(|e| StoreError::io(&self.wal, e))?;
                Ok(true)
            }
            // No WAL: everything was checkpointed into the database (and fsynced by it).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(StoreError::io(&self.wal, e)),
        }
    }

    fn close(&mut self) {
        // Clean shutdown: fold the WAL into the database (best effort: a reader may hold it).
        let _ = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
    }
}

/// A sequence as the stores keep it (a signed 64-bit integer).
pub(crate) fn seq_param(s: u64) -> Result<i64, StoreError> {
    i64::try_from(s).map_err(|_| StoreError::InvalidRecord {
        detail: format!("sequence {s} exceeds 2^63-1"),
    })
}

/// The chain head of a model: `Ok(None)` when it has no record yet.
fn head(conn: &Connection, model_id: &str) -> Result<Option<(u64, String)>, Failure> {
    let row: Option<(Option<i64>, String)> = conn
        .prepare_cached("SELECT head_seq, head_hash FROM models WHERE id = ?1")?
        .query_row([model_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let Some((seq, hash)) = row else {
        return Err(Failure::Op(StoreError::ModelNotFound {
            model_id: model_id.to_string(),
        }));
    };
    Ok(seq.map(|s| (s.max(0) as u64, hash)))
}

/// A value's JSON text as the stores keep it.
pub(crate) fn to_text(v: &Json) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::InvalidRecord {
        detail: e.to_string(),
    })
}

/// A checkpoint after record `sequence` (`None`: before the first) of a model whose committed
/// head is `head`: the sequence as stored (-1 before the first record, below every real one),
/// or `CheckpointAhead` when it is past the head.
pub(crate) fn checkpoint_seq(
    model_id: &str,
    sequence: Option<Seq>,
    head: Option<u64>,
) -> Result<i64, StoreError> {
    match sequence.map(Seq::get) {
        None => Ok(-1),
        Some(seq) if head.is_none_or(|h| seq > h) => Err(StoreError::CheckpointAhead {
            model_id: model_id.to_string(),
            sequence: seq,
            head,
        }),
        Some(seq) => seq_param(seq),
    }
}

/// A checkpoint that follows a record which is not stored.
pub(crate) fn record_not_stored(model_id: &str, sequence: u64) -> StoreError {
    StoreError::InvalidRecord {
        detail: format!(
            "model `{model_id}`: checkpoint after record {sequence}, which is not stored"
        ),
    }
}

/// A checkpoint as both stores keep it: its state text, the blake3 of that text, and its own
/// hash over those and the record it follows (`head_hash`).
pub(crate) struct SealedCheckpoint {
    pub(crate) text: String,
    pub(crate) state_hash: String,
    pub(crate) hash: String,
}

pub(crate) fn seal_checkpoint(
    key: Option<&AuditKey>,
    model_id: &str,
    sequence: Option<Seq>,
    at_us: i64,
    kind: CheckpointKind,
    head_hash: &str,
    state: &Json,
) -> Result<SealedCheckpoint, StoreError> {
    let text = to_text(state)?;
    let state_hash = chain::state_hash(text.as_bytes());
    let hash = chain::checkpoint_hash(
        key,
        &CheckpointHeader {
            model_id,
            sequence,
            at_us,
            kind: kind.as_str(),
            head_hash,
            state_hash: &state_hash,
        },
    );
    Ok(SealedCheckpoint {
        text,
        state_hash,
        hash,
    })
}

fn apply(conn: &Connection, op: &Op, key: Option<&AuditKey>) -> Result<(), Failure> {
    match op {
        Op::Atomic(ops) => {
            for o in ops {
                apply(conn, o, key)?;
            }
        }
        Op::PutModel {
            id,
            spec_text,
            version,
            at,
        } => {
            // In a keyed store a new model's chain is keyed from its first record.
            let (key_from, anchor) = match key {
                Some(k) => (Some(0i64), Some(chain::key_anchor(k, id, 0, GENESIS))),
                None => (None, None),
            };
            // The text's content is kept once (`spec_texts`), the model row names it.
            let (spec, spec_hash) = match crate::spec_text::split(id, spec_text) {
                Some(body) => {
                    let hash = blake3::hash(body.as_bytes()).to_hex().to_string();
                    conn.prepare_cached(
                        "INSERT OR IGNORE INTO spec_texts (hash, body) VALUES (?1, ?2)",
                    )?
                    .execute(params![hash, body])?;
                    ("", Some(hash))
                }
                None => (spec_text.as_str(), None),
            };
            let before = spec_hash_of(conn, id)?;
            conn.prepare_cached(
                "INSERT INTO models (id, spec, version, created_us, updated_us, head_seq, head_hash,
                     key_from, key_anchor, spec_hash)
                 VALUES (?1, ?2, ?3, ?4, ?4, NULL, ?5, ?6, ?7, ?8)
                 ON CONFLICT (id) DO UPDATE SET spec = excluded.spec, version = excluded.version,
                     updated_us = excluded.updated_us, spec_hash = excluded.spec_hash",
            )?
            .execute(params![
                id,
                spec,
                version,
                at.us(),
                GENESIS,
                key_from,
                anchor,
                spec_hash
            ])?;
            if let Some(old) = before.filter(|b| Some(b) != spec_hash.as_ref()) {
                forget_spec_text(conn, &old)?;
            }
        }
        Op::DeleteModel { id } => {
            let before = spec_hash_of(conn, id)?;
            for sql in [
                "DELETE FROM audit_paths WHERE model_id = ?1",
                "DELETE FROM audit WHERE model_id = ?1",
                "DELETE FROM checkpoints WHERE model_id = ?1",
                "DELETE FROM snapshots WHERE model_id = ?1",
                "DELETE FROM idempotency WHERE model_id = ?1",
                "DELETE FROM models WHERE id = ?1",
            ] {
                conn.prepare_cached(sql)?.execute([id])?;
            }
            if let Some(old) = before {
                forget_spec_text(conn, &old)?;
            }
        }
        Op::AppendAudit(a) => append_audit(conn, a)?,
        Op::Checkpoint {
            model_id,
            sequence,
            at,
            state,
            kind,
        } => put_checkpoint(conn, model_id, *sequence, &at.us(), state, kind, key)?,
        Op::PutSnapshot {
            model_id,
            snapshot_id,
            at,
            snapshot,
        } => {
            head(conn, model_id)?;
            conn.prepare_cached(
                "INSERT OR REPLACE INTO snapshots (model_id, snapshot_id, at_us, snapshot)
                 VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![model_id, snapshot_id, at.us(), to_text(snapshot)?])?;
        }
        Op::DeleteSnapshot {
            model_id,
            snapshot_id,
        } => {
            conn.prepare_cached("DELETE FROM snapshots WHERE model_id = ?1 AND snapshot_id = ?2")?
                .execute(params![model_id, snapshot_id])?;
        }
        Op::PutTask { id, record, at } => {
            conn.prepare_cached(
                "INSERT OR REPLACE INTO tasks (id, record, at_us) VALUES (?1, ?2, ?3)",
            )?
            .execute(params![id, record, at.us()])?;
        }
        Op::Release { .. } => {}
        Op::DeleteTask { id } => {
            conn.prepare_cached("DELETE FROM tasks WHERE id = ?1")?
                .execute(params![id])?;
        }
        Op::PutBlob(b) => {
            let size = i64::try_from(b.size).map_err(|_| {
                Failure::Op(StoreError::InvalidRecord {
                    detail: format!("blob size {} exceeds 2^63-1", b.size),
                })
            })?;
            conn.prepare_cached(
                "INSERT OR REPLACE INTO blobs (id, hash, size, media_type, filename, created_us)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?
            .execute(params![
                b.id,
                b.hash,
                size,
                b.media_type,
                b.filename,
                b.created.us()
            ])?;
        }
    }
    Ok(())
}

/// Append one audit record: in sequence, chained to the stored head, its paths indexed, the
/// head moved in the same transaction.
fn append_audit(conn: &Connection, a: &AuditAppend) -> Result<(), Failure> {
    let head = head(conn, &a.model_id)?;
    let (expected, prev) = match &head {
        Some((s, h)) => (s + 1, h.as_str()),
        None => (0, GENESIS),
    };
    if a.sequence != expected {
        return Err(Failure::Op(StoreError::OutOfSequence {
            model_id: a.model_id.clone(),
            expected,
            got: a.sequence,
        }));
    }
    if a.prev_hash != prev {
        return Err(Failure::Op(StoreError::ChainMismatch {
            model_id: a.model_id.clone(),
            sequence: a.sequence,
        }));
    }
    let seq = seq_param(a.sequence)?;
    conn.prepare_cached(
        "INSERT INTO audit (model_id, sequence, at_us, record, prev_hash, hash)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        a.model_id,
        seq,
        a.at_us,
        a.text,
        a.prev_hash,
        a.hash
    ])?;
    let mut path = conn.prepare_cached(
        "INSERT OR IGNORE INTO audit_paths (model_id, path, sequence) VALUES (?1, ?2, ?3)",
    )?;
    for p in &a.paths {
        path.execute(params![a.model_id, p, seq])?;
    }
    if let Some(k) = &a.keyed {
        conn.prepare_cached(
            "INSERT OR REPLACE INTO idempotency (model_id, key, sequence, request, answer)
             VALUES (?1, ?2, ?3, ?4, ?5)",
        )?
        .execute(params![a.model_id, k.key, seq, k.request, k.answer])?;
    }
    conn.prepare_cached("UPDATE models SET head_seq = ?2, head_hash = ?3 WHERE id = ?1")?
        .execute(params![a.model_id, seq, a.hash])?;
    Ok(())
}

/// Store a checkpoint of `model_id` after record `sequence` (`None`: before the first),
/// hashed over its state and the record it follows (see `Op::Checkpoint`).
fn put_checkpoint(
    conn: &Connection,
    model_id: &str,
    sequence: Option<Seq>,
    at_us: &i64,
    state: &Json,
    kind: &CheckpointKind,
    key: Option<&AuditKey>,
) -> Result<(), Failure> {
    let head = head(conn, model_id)?;
    let seq = checkpoint_seq(model_id, sequence, head.as_ref().map(|(s, _)| *s))?;
    if *kind == CheckpointKind::Periodic {
        let existing: Option<String> = conn
            .prepare_cached("SELECT kind FROM checkpoints WHERE model_id = ?1 AND sequence = ?2")?
            .query_row(params![model_id, seq], |r| r.get(0))
            .optional()?;
        if existing.is_some_and(|k| CheckpointKind::parse(&k) != Some(CheckpointKind::Periodic)) {
            return Ok(());
        }
    }
    let head_hash = match (sequence.map(Seq::get), head) {
        (None, _) => GENESIS.to_string(),
        (Some(s), Some((h, hash))) if s == h => hash,
        (Some(s), _) => conn
            .prepare_cached("SELECT hash FROM audit WHERE model_id = ?1 AND sequence = ?2")?
            .query_row(params![model_id, seq], |r| r.get(0))
            .optional()?
            .ok_or_else(|| record_not_stored(model_id, s))?,
    };
    let SealedCheckpoint {
        text,
        state_hash,
        hash,
    } = seal_checkpoint(key, model_id, sequence, *at_us, *kind, &head_hash, state)?;
    conn.prepare_cached(
        "INSERT OR REPLACE INTO checkpoints
             (model_id, sequence, at_us, state, kind, head_hash, state_hash, hash)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?
    .execute(params![
        model_id,
        seq,
        at_us,
        text,
        kind.as_str(),
        head_hash,
        state_hash,
        hash
    ])?;
    if kind.is_base() {
        conn.prepare_cached("UPDATE models SET base_seq = ?2 WHERE id = ?1")?
            .execute(params![model_id, seq])?;
    }
    // The model's idempotency keys past the newest KEYS_KEPT are forgotten.
    conn.prepare_cached(
        "DELETE FROM idempotency WHERE model_id = ?1 AND sequence <
             (SELECT sequence FROM idempotency WHERE model_id = ?1
              ORDER BY sequence DESC LIMIT 1 OFFSET ?2)",
    )?
    .execute(params![model_id, crate::KEYS_KEPT as i64 - 1])?;
    Ok(())
}

/// The spec text model `id`'s row names (`None`: no row, or a text kept whole).
fn spec_hash_of(conn: &Connection, id: &str) -> rusqlite::Result<Option<String>> {
    conn.prepare_cached("SELECT spec_hash FROM models WHERE id = ?1")?
        .query_row([id], |r| r.get::<_, Option<String>>(0))
        .optional()
        .map(Option::flatten)
}

/// Drop spec text `hash` when no model names it any more.
fn forget_spec_text(conn: &Connection, hash: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "DELETE FROM spec_texts WHERE hash = ?1
         AND NOT EXISTS (SELECT 1 FROM models WHERE spec_hash = ?1)",
    )?
    .execute([hash])?;
    Ok(())
}
