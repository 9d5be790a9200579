//! The durable store: the [`Store`] trait the service writes through, and its first
//! implementation, [`SqliteStore`]: one SQLite database (`<dir>/valem.db`, WAL mode) holding the model
//! registry, the hash-chained audit log, checkpoints, snapshots and blob metadata, plus blob bytes
//! content-addressed by blake3 under `<dir>/blobs/`. It owns persistence and the chain check; it
//! never interprets specs, evaluates models or replays records (the service does that).
//!
//! # Writes
//! All writes go through one writer thread ([`Writer`]): ops are queued (bounded:
//! [`StoreOptions::queue_capacity`], `submit` blocks while it is full), drained into batches of
//! at most [`StoreOptions::max_batch_ops`], and each batch runs in ONE transaction. An op's
//! completion is called after the batch's COMMIT returned, in submission order:
//! - [`Durability::Strict`] (default, `synchronous=FULL`): COMMIT fsyncs the WAL, so an `Ok`
//!   completion means the op survives a process kill, an OS crash and a power loss.
//! - [`Durability::Relaxed`] (`synchronous=NORMAL`): COMMIT writes the WAL without fsync; the WAL
//!   is fsynced only at checkpoints (about every 4 MB of WAL) and by [`SqliteStore::flush`]. A process
//!   kill loses nothing acknowledged (the OS holds the written pages); an OS crash or power loss
//!   can lose the batches acknowledged since the last WAL fsync (the database stays consistent).
//!
//! An op that fails on its own (wrong sequence, broken link, unknown model, constraint) is rolled
//! back to its savepoint and answered with its error; the rest of the batch commits. A batch that
//! fails as a whole (disk full, read-only file, I/O error) is rolled back and every op in it is
//! answered with the error; the writer then goes on with later batches.
//!
//! # What SQLite guarantees on a crash or torn write (and what it does not)
//! Each WAL frame carries the WAL's salt and a running checksum over every frame before it; on
//! open SQLite replays frames only up to the last *commit* frame whose checksum chain is intact.
//! So a WAL truncated or torn at any offset yields the database as of some earlier committed
//! batch: batches are atomic, never half-applied, and the chain head in `models` is committed in
//! the same transaction as its records (the chain verifies after any such loss). In strict mode
//! an acknowledged batch was fsynced before its ack, so only unacknowledged batches can be torn.
//! What SQLite does not protect: the main database file has no page checksums. A truncated main
//! file is refused by [`SqliteStore::open`] before SQLite sees it when the truncation is visible in the
//! file header (see [`StoreError::Corrupt`]); a flipped byte in an audit record is caught by
//! [`SqliteStore::verify_chain`], and one in a checkpoint by its hashes (see below); a flipped byte
//! elsewhere (snapshot JSON, b-tree structure) surfaces as `Corrupt` on the read that hits it or
//! from [`SqliteStore::quick_check`].
//! A damaged frame in the *middle* of the WAL makes SQLite stop replaying there: later commits
//! are lost silently (and consistently, so the chain still verifies).
//!
//! # Hash chain
//! See [`chain`]: `hash = blake3(prevHash || RFC 8785 bytes of the record without "hash")`,
//! genesis `prevHash` = [`GENESIS`] (64 zeros). The functions are pure and usable without a store.
//!
//! # Checkpoints
//! Each checkpoint names the chain head it follows, the blake3 of its state text and its own
//! hash over those ([`chain::checkpoint_hash`]), so an edited or damaged checkpoint is refused by
//! [`SqliteStore::usable_checkpoint`] (which falls back to an older one, or to none) and reported by
//! [`SqliteStore::verify_chain`]; see [`checkpoints`] for which fallbacks are sound.
//!
//! # Audit key
//! Opened with [`StoreOptions::audit_key`], record and checkpoint hashes are keyed blake3; the
//! store records the key's fingerprint and refuses to open without it or with another key. An
//! unkeyed store given a key adopts it: see [`keys`].

// What is not part of the crate's API is pub(crate): the compiler keeps it so.
#![warn(unreachable_pub)]

mod reads;

mod api;
pub mod chain;
pub mod checkpoints;
pub mod keys;
pub mod pg;
mod schema;
mod spec_text;
mod writer;

#[cfg(test)]
mod tests;

use std::fs;
use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::types::ToSql;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use serde::Serialize;
use serde_json::Value as Json;

pub use api::Store;
pub use chain::{
    canonical, record_hash, AuditKey, BrokenCheckpoint, ChainHasher, ChainReport, ChainVerifier,
    NotAKey, Sealed, Seq, GENESIS,
};
pub use checkpoints::{CheckpointChoice, CheckpointFault, CheckpointKind, RefusedCheckpoint};
pub use keys::KeyAdoption;
pub use pg::PgStore;
pub use valem_core::time::Timestamp;
pub use writer::{AuditAppend, Done, Op, Writer, WriterStats};

/// File name of the database inside the data directory.
pub const DB_FILE: &str = "valem.db";
/// Marker written once a store exists in a directory, so a lost database is not mistaken for a
/// fresh directory.
const MARKER_FILE: &str = "valem.store";
/// Most rows `query_audit` returns, whatever the filter's limit.
pub const MAX_QUERY_LIMIT: usize = 10_000;
/// Rows `query_audit` returns when the filter has no limit.
pub const DEFAULT_QUERY_LIMIT: usize = 100;
/// How long a connection waits for a lock held by another connection (only a checkpoint or WAL
/// recovery can hold one against readers).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// The WAL is cut back to this size after a checkpoint.
const JOURNAL_SIZE_LIMIT: i64 = 64 << 20;

/// When an acknowledged write is durable; see the module doc for the loss window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// fsync per batch before acknowledging (`synchronous=FULL`).
    #[default]
    Strict,
    /// Acknowledge after COMMIT without fsync (`synchronous=NORMAL`).
    Relaxed,
}

/// Limits and modes of a store.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Strict (fsync per batch, default) or relaxed.
    pub durability: Durability,
    /// Ops the writer queue holds before `submit` blocks.
    pub queue_capacity: usize,
    /// Most ops in one transaction.
    pub max_batch_ops: usize,
    /// Largest database (`PRAGMA max_page_count`); past it writes fail with `DiskFull`.
    pub max_db_bytes: Option<u64>,
    /// Largest blob `put_blob_bytes` accepts and `blob_bytes` reads.
    pub max_blob_bytes: u64,
    /// Idle read connections kept open.
    pub read_pool: usize,
    /// The audit key: record and checkpoint hashes are keyed blake3 (see [`keys`]).
    pub audit_key: Option<AuditKey>,
    /// This node's identity in a fleet sharing one PostgreSQL database (`None`: the only
    /// writer). The SQLite store has one writer by construction and ignores it.
    pub node: Option<pg::NodeConfig>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            durability: Durability::Strict,
            queue_capacity: 65_536,
            max_batch_ops: 4096,
            max_db_bytes: None,
            max_blob_bytes: 50 << 20,
            read_pool: 4,
            audit_key: None,
            node: None,
        }
    }
}

/// Everything the store can fail with. Clone, so one batch failure answers every op of the batch.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The data directory could not be created.
    #[error("cannot create the data directory {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The data directory path exists and is not a directory.
    #[error("the data directory {} exists and is not a directory", path.display())]
    NotADirectory { path: PathBuf },
    /// The data directory or database cannot be written.
    #[error("{} is not writable ({detail}); give the daemon a writable data directory", path.display())]
    NotWritable { path: PathBuf, detail: String },
    /// A file operation failed.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The database (or a blob file) is damaged; `path` names the file.
    #[error("{} is corrupt: {detail}", path.display())]
    Corrupt { path: PathBuf, detail: String },
    /// The disk (or `max_db_bytes`) is full; nothing acknowledged was lost, writes work again once
    /// space is freed.
    #[error("no space left for {} (disk or max_db_bytes full); the write was rolled back", path.display())]
    DiskFull { path: PathBuf },
    /// Any other SQLite failure.
    #[error("database error on {}: {source}", path.display())]
    Sqlite {
        path: PathBuf,
        #[source]
        source: Arc<rusqlite::Error>,
    },
    /// Any other PostgreSQL failure (`path`: the database's URL without its password).
    #[error("database error on {}: {detail}", path.display())]
    Postgres { path: PathBuf, detail: String },
    /// The database server cannot be reached (down, restarting, network): the operation was
    /// not committed; it can be retried once the server is back.
    #[error("the database {} cannot be reached ({detail}); nothing was committed, retry once it is back", path.display())]
    Unavailable { path: PathBuf, detail: String },
    /// The model belongs to another node of the fleet, whose lease has not run out.
    #[error("model `{model_id}` is owned by node `{node}` ({url}) until its lease runs out")]
    OwnedElsewhere {
        model_id: String,
        node: String,
        url: String,
        lease_until: Timestamp,
    },
    /// This node no longer owns the model (another node claimed it after this one's lease
    /// ran out): the write was not committed, and this node must not write the model again.
    #[error("model `{model_id}` is no longer owned by this node ({detail}); the write was not committed")]
    Fenced { model_id: String, detail: String },
    /// The database was written by a newer build.
    #[error("{} has schema version {found}; this build supports up to {supported}: upgrade valem", path.display())]
    SchemaTooNew {
        path: PathBuf,
        found: i64,
        supported: i64,
    },
    /// A schema migration step failed (the database stays at the previous version).
    #[error("migrating {} to schema version {to_version} failed: {detail}", path.display())]
    Migration {
        path: PathBuf,
        to_version: i64,
        detail: String,
    },
    /// The writer has stopped (the store was closed).
    #[error("the store's writer has stopped (the store is closed)")]
    WriterStopped,
    /// No such model in the store.
    #[error("model `{model_id}` is not in the store")]
    ModelNotFound { model_id: String },
    /// An audit record does not follow the model's chain head.
    #[error("model `{model_id}`: audit record {got} does not follow the chain head (expected sequence {expected})")]
    OutOfSequence {
        model_id: String,
        expected: u64,
        got: u64,
    },
    /// An audit record's `prevHash` is not the hash of the model's last record.
    #[error("model `{model_id}`: audit record {sequence} has a prevHash that is not the chain head's hash")]
    ChainMismatch { model_id: String, sequence: u64 },
    /// A checkpoint names a record that is not committed.
    #[error("model `{model_id}`: checkpoint at record {sequence} but the last committed record is {head:?}")]
    CheckpointAhead {
        model_id: String,
        sequence: u64,
        head: Option<u64>,
    },
    /// A checkpoint recovery would have to start from does not verify, and no earlier one (or
    /// replay from the spec) reproduces its state: it was set by a restore or an evolve.
    #[error("model `{model_id}`: {} cannot be used ({detail}), and recovery cannot fall back past it: its state was set by a restore or a spec evolution (or written before schema v3), which no earlier checkpoint or replay of the records reproduces. Restore the data directory from a backup", checkpoints::describe(*sequence))]
    CheckpointUnusable {
        model_id: String,
        sequence: Option<Seq>,
        detail: String,
    },
    /// The store is keyed and no key was given.
    #[error("{} is keyed: its audit hashes need the key with fingerprint {}…; give the daemon that key (--audit-key-file)", path.display(), &fingerprint[..fingerprint.len().min(16)])]
    AuditKeyRequired { path: PathBuf, fingerprint: String },
    /// The store is keyed with another key.
    #[error("{} is keyed with another audit key (fingerprint {}…; the key given has {}…); give the daemon the key the store was keyed with", path.display(), &expected[..expected.len().min(16)], &given[..given.len().min(16)])]
    AuditKeyMismatch {
        path: PathBuf,
        expected: String,
        given: String,
    },
    /// An audit record or op payload is malformed.
    #[error("invalid audit record: {detail}")]
    InvalidRecord { detail: String },
    /// A uniqueness or other constraint rejected an op.
    #[error("constraint violated: {detail}")]
    Constraint { detail: String },
    /// A blob hash is not 64 lowercase hex characters.
    #[error("`{hash}` is not a blob hash (64 lowercase hex characters)")]
    InvalidBlobHash { hash: String },
    /// No blob bytes with that hash.
    #[error("blob {hash} is not in the store")]
    BlobNotFound { hash: String },
    /// A blob exceeds `max_blob_bytes`.
    #[error("blob of {size} bytes exceeds the limit of {limit} bytes")]
    BlobTooLarge { size: u64, limit: u64 },
}

impl StoreError {
    fn io(path: &Path, e: std::io::Error) -> StoreError {
        StoreError::Io {
            path: path.to_path_buf(),
            source: Arc::new(e),
        }
    }
}

/// `hash` is a blob hash: 64 lowercase hex characters (so it can name a file or a row).
pub(crate) fn check_blob_hash(hash: &str) -> Result<(), StoreError> {
    let valid = hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if valid {
        Ok(())
    } else {
        Err(StoreError::InvalidBlobHash {
            hash: hash.to_string(),
        })
    }
}

/// Map a SQLite error on `path` to the store's error, singling out the ones a caller reacts to.
pub(crate) fn sql_err(path: &Path, e: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode as C;
    let path = path.to_path_buf();
    match e.sqlite_error_code() {
        Some(C::DatabaseCorrupt | C::NotADatabase) => StoreError::Corrupt {
            path,
            detail: e.to_string(),
        },
        Some(C::DiskFull) => StoreError::DiskFull { path },
        Some(C::ReadOnly | C::PermissionDenied) => StoreError::NotWritable {
            path,
            detail: e.to_string(),
        },
        _ => StoreError::Sqlite {
            path,
            source: Arc::new(e),
        },
    }
}

/// How many idempotency keys a model keeps: the newest, by the sequence of their records; older
/// ones are forgotten at the model's checkpoints.
pub const KEYS_KEPT: usize = 1000;

/// A write made under an idempotency key, committed with its audit record (one transaction):
/// a retry with the same key is answered `answer` instead of being applied again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyedWrite {
    /// The client's key (unique per model).
    pub key: String,
    /// The blake3 hex of the request it came with: a key sent again with another request is
    /// refused.
    pub request: String,
    /// The answer given, as JSON text.
    pub answer: String,
}

/// An idempotency key as stored: its request's hash and the sequence of its record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredKey {
    pub key: String,
    pub request: String,
    pub sequence: Seq,
}

/// A model as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredModel {
    /// The model id.
    pub id: String,
    /// The spec text as it was submitted.
    pub spec_text: String,
    /// The model version.
    pub version: String,
    /// When it was first stored.
    pub created: Timestamp,
    /// When its spec was last stored.
    pub updated: Timestamp,
    /// Sequence of the last committed audit record (`None`: no record yet).
    pub head_seq: Option<Seq>,
    /// Hash of that record ([`GENESIS`] before the first).
    pub head_hash: String,
}

/// A checkpoint: the model's state after record `sequence` (`None`: before its first record).
#[derive(Clone, Debug, PartialEq)]
pub struct StoredCheckpoint {
    /// The last record applied.
    pub sequence: Option<Seq>,
    /// That record's commit time.
    pub at: Timestamp,
    /// The state.
    pub state: Json,
    /// Periodic, or a base set by a restore or an evolve.
    pub kind: CheckpointKind,
}

/// One stored audit record.
#[derive(Clone, Debug, PartialEq)]
pub struct AuditEntry {
    /// Its sequence.
    pub sequence: Seq,
    /// Its commit time.
    pub at: Timestamp,
    /// The record as served.
    pub record: Json,
}

/// A named snapshot.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredSnapshot {
    /// The snapshot id.
    pub snapshot_id: String,
    /// When it was taken.
    pub at: Timestamp,
    /// The snapshot document.
    pub snapshot: Json,
}

/// Blob metadata (the bytes live in `blobs/<hash[..2]>/<hash[2..]>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BlobMeta {
    /// The blob id served to clients.
    pub id: String,
    /// blake3 hex of the bytes.
    pub hash: String,
    /// Size in bytes.
    pub size: u64,
    /// Media type.
    pub media_type: String,
    /// Original file name, if any.
    pub filename: Option<String>,
    /// Upload time (serialised as `createdUs`, epoch µs).
    #[serde(rename = "createdUs")]
    pub created: Timestamp,
}

/// Filters of [`SqliteStore::query_audit`] (all optional; times inclusive).
#[derive(Clone, Debug, Default)]
pub struct AuditFilter {
    /// Records touching a path that starts with this string.
    pub path_prefix: Option<String>,
    /// Committed at or after.
    pub from: Option<Timestamp>,
    /// Committed at or before.
    pub to: Option<Timestamp>,
    /// Most records (default [`DEFAULT_QUERY_LIMIT`], capped at [`MAX_QUERY_LIMIT`]).
    pub limit: Option<usize>,
}

/// An open store. `Sync`: share it behind an `Arc`. Dropping it drains the writer.
pub struct SqliteStore {
    dir: PathBuf,
    db: PathBuf,
    opts: StoreOptions,
    /// What adopting the audit key at this open did (`None`: nothing to adopt).
    adoption: Option<KeyAdoption>,
    writer: Writer,
    thread: Option<JoinHandle<()>>,
    readers: Mutex<Vec<Connection>>,
}

impl SqliteStore {
    /// Open (creating if needed) the store in `dir`: checks the directory and the database file,
    /// migrates the schema, starts the writer thread.
    pub fn open(dir: &Path, opts: StoreOptions) -> Result<SqliteStore, StoreError> {
        ensure_writable_dir(dir)?;
        let blobs = dir.join("blobs");
        fs::create_dir_all(&blobs).map_err(|e| StoreError::NotWritable {
            path: blobs.clone(),
            detail: e.to_string(),
        })?;
        let db = dir.join(DB_FILE);
        let wal = dir.join(format!("{DB_FILE}-wal"));
        let marker = dir.join(MARKER_FILE);
        let state = schema::check_file(&db, &wal, &marker)?;

        let mut conn = Connection::open(&db).map_err(|e| sql_err(&db, e))?;
        if conn
            .is_readonly(rusqlite::MAIN_DB)
            .map_err(|e| sql_err(&db, e))?
        {
            return Err(StoreError::NotWritable {
                path: db,
                detail: "SQLite opened it read-only".into(),
            });
        }
        conn.busy_timeout(BUSY_TIMEOUT)
            .map_err(|e| sql_err(&db, e))?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(|e| sql_err(&db, e))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::NotWritable {
                path: db,
                detail: format!("cannot use WAL mode (got journal_mode={mode})"),
            });
        }
        let sync = match opts.durability {
            Durability::Strict => "FULL",
            Durability::Relaxed => "NORMAL",
        };
        conn.pragma_update(None, "synchronous", sync)
            .map_err(|e| sql_err(&db, e))?;
        conn.pragma_update(None, "journal_size_limit", JOURNAL_SIZE_LIMIT)
            .map_err(|e| sql_err(&db, e))?;
        if let Some(max) = opts.max_db_bytes {
            let page: i64 = conn
                .query_row("PRAGMA page_size", [], |r| r.get(0))
                .map_err(|e| sql_err(&db, e))?;
            let pages = i64::try_from(max).unwrap_or(i64::MAX) / page.max(512);
            conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |_| Ok(()))
                .map_err(|e| sql_err(&db, e))?;
        }
        if state == schema::FileState::NeedsCheck {
            quick_check(&conn, &db)?;
        }
        schema::migrate(&mut conn, &db, schema::SCHEMA_VERSION)?;
        let adoption = keys::settle(&mut conn, &db, opts.audit_key.as_ref())?;
        if !marker.exists() {
            write_marker(dir, &marker)?;
        }
        let (writer, thread) = writer::spawn(
            conn,
            db.clone(),
            opts.durability,
            opts.queue_capacity,
            opts.max_batch_ops,
            opts.audit_key,
        )?;
        Ok(SqliteStore {
            dir: dir.to_path_buf(),
            db,
            adoption,
            opts,
            writer,
            thread: Some(thread),
            readers: Mutex::new(Vec::new()),
        })
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The database file.
    pub fn db_path(&self) -> &Path {
        &self.db
    }

    /// The audit key hashes are keyed with (`None`: plain blake3).
    pub fn audit_key(&self) -> Option<&AuditKey> {
        self.opts.audit_key.as_ref()
    }

    /// What this open did to adopt the audit key, when the store had none before.
    pub fn key_adoption(&self) -> Option<&KeyAdoption> {
        self.adoption.as_ref()
    }

    /// How model `model_id`'s records are hashed (keyed from its `key_from` record on, in a
    /// keyed store; a model without one there is held to the key from its first record).
    pub fn record_hasher(&self, model_id: &str) -> Result<ChainHasher, StoreError> {
        let Some(key) = self.opts.audit_key else {
            return Ok(ChainHasher::plain());
        };
        let from: Option<Option<i64>> = self.with_reader(|c| {
            c.prepare_cached("SELECT key_from FROM models WHERE id = ?1")
                .and_then(|mut s| s.query_row([model_id], |r| r.get(0)).optional())
                .map_err(|e| sql_err(&self.db, e))
        })?;
        let Some(from) = from else {
            return Err(StoreError::ModelNotFound {
                model_id: model_id.to_string(),
            });
        };
        Ok(ChainHasher::keyed(key, from.map_or(0, |f| f.max(0) as u64)))
    }

    /// A handle for submitting writes (cheap to clone, `Send + Sync`).
    pub fn writer(&self) -> Writer {
        self.writer.clone()
    }

    /// Wait until everything submitted before this call is durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.writer.flush()
    }

    /// Writer counters (batches, ops, fsyncs).
    pub fn stats(&self) -> WriterStats {
        self.writer.stats()
    }

    /// Drain the writer (everything queued before this commits), fold the WAL into the database
    /// and stop. Later submits on surviving handles are answered `WriterStopped`.
    pub fn close(mut self) -> Result<(), StoreError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), StoreError> {
        // Readers first, so the final checkpoint can fold the whole WAL.
        if let Ok(mut r) = self.readers.lock() {
            r.clear();
        }
        let Some(t) = self.thread.take() else {
            return Ok(());
        };
        self.writer.shutdown();
        t.join().map_err(|_| StoreError::WriterStopped)
    }

    fn with_reader<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let pooled = self.readers.lock().ok().and_then(|mut p| p.pop());
        let conn = match pooled {
            Some(c) => c,
            None => open_reader(&self.db)?,
        };
        let out = f(&conn);
        if !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        if let Ok(mut p) = self.readers.lock() {
            if p.len() < self.opts.read_pool {
                p.push(conn);
            }
        }
        out
    }

    /// SQLite's `PRAGMA quick_check` over the whole database (O(size)); `Corrupt` names the file.
    pub fn quick_check(&self) -> Result<(), StoreError> {
        self.with_reader(|c| quick_check(c, &self.db))
    }

    fn stored_seq(&self, seq: i64, model_id: &str) -> Result<u64, StoreError> {
        u64::try_from(seq).map_err(|_| StoreError::Corrupt {
            path: self.db.clone(),
            detail: format!("model `{model_id}` has a row at negative sequence {seq}"),
        })
    }

    fn parse(&self, text: &str, what: impl FnOnce() -> String) -> Result<Json, StoreError> {
        serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
            path: self.db.clone(),
            detail: format!("{} is not valid JSON: {e}", what()),
        })
    }
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("db", &self.db)
            .field("durability", &self.opts.durability)
            .finish_non_exhaustive()
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The dir exists (created if missing), is a directory, and accepts a new file. (SQLite would
/// otherwise fall back to read-only silently.)
fn ensure_writable_dir(dir: &Path) -> Result<(), StoreError> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(StoreError::NotADirectory {
                path: dir.to_path_buf(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::create_dir_all(dir).map_err(|e| StoreError::CreateDir {
                path: dir.to_path_buf(),
                source: Arc::new(e),
            })?;
        }
        Err(e) => return Err(StoreError::io(dir, e)),
    }
    let probe = dir.join(".valem-write-probe");
    fs::write(&probe, b"probe")
        .and_then(|()| fs::remove_file(&probe))
        .map_err(|e| StoreError::NotWritable {
            path: dir.to_path_buf(),
            detail: e.to_string(),
        })
}

fn write_marker(dir: &Path, marker: &Path) -> Result<(), StoreError> {
    let mut f = fs::File::create(marker).map_err(|e| StoreError::io(marker, e))?;
    f.write_all(
        b"A valem store lives here; its database is valem.db. Do not delete valem.db alone.\n",
    )
    .and_then(|()| f.sync_all())
    .map_err(|e| StoreError::io(marker, e))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(dir, e))
}

fn open_reader(db: &Path) -> Result<Connection, StoreError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_URI;
    let c = Connection::open_with_flags(db, flags).map_err(|e| sql_err(db, e))?;
    c.busy_timeout(BUSY_TIMEOUT).map_err(|e| sql_err(db, e))?;
    c.pragma_update(None, "query_only", true)
        .map_err(|e| sql_err(db, e))?;
    Ok(c)
}

fn quick_check(c: &Connection, db: &Path) -> Result<(), StoreError> {
    let mut st = c
        .prepare("PRAGMA quick_check")
        .map_err(|e| sql_err(db, e))?;
    let lines: Vec<String> = st
        .query_map([], |r| r.get(0))
        .and_then(|rows| rows.collect())
        .map_err(|e| sql_err(db, e))?;
    if lines.len() == 1 && lines[0] == "ok" {
        return Ok(());
    }
    Err(StoreError::Corrupt {
        path: db.to_path_buf(),
        detail: format!("quick_check: {}", lines.join("; ")),
    })
}

/// The smallest string greater than every string that starts with `prefix` (by code point, which
/// is SQLite's BINARY order of UTF-8): the last code point incremented. `None` when no such string
/// exists (the prefix is all U+10FFFF).
fn prefix_upper_bound(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(c) = chars.pop() {
        let next = match c as u32 + 1 {
            0xD800 => 0xE000, // skip the surrogate gap
            n => n,
        };
        if let Some(n) = char::from_u32(next) {
            chars.push(n);
            return Some(chars.into_iter().collect());
        }
    }
    None
}
