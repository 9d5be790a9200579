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

mod api;
pub mod chain;
pub mod checkpoints;
pub mod keys;
mod schema;
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
    GENESIS,
};
pub use checkpoints::{CheckpointChoice, CheckpointFault, CheckpointKind, RefusedCheckpoint};
pub use keys::KeyAdoption;
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
        sequence: Option<u64>,
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

/// A model as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredModel {
    /// The model id.
    pub id: String,
    /// The spec text as it was submitted.
    pub spec_text: String,
    /// The model version.
    pub version: String,
    /// When it was first stored (epoch µs).
    pub created_us: i64,
    /// When its spec was last stored (epoch µs).
    pub updated_us: i64,
    /// Sequence of the last committed audit record (`None`: no record yet).
    pub head_seq: Option<u64>,
    /// Hash of that record ([`GENESIS`] before the first).
    pub head_hash: String,
}

/// A checkpoint: the model's state after record `sequence` (`None`: before its first record).
#[derive(Clone, Debug, PartialEq)]
pub struct StoredCheckpoint {
    /// The last record applied.
    pub sequence: Option<u64>,
    /// That record's commit time (epoch µs).
    pub at_us: i64,
    /// The state.
    pub state: Json,
    /// Periodic, or a base set by a restore or an evolve.
    pub kind: CheckpointKind,
}

/// One stored audit record.
#[derive(Clone, Debug, PartialEq)]
pub struct AuditEntry {
    /// Its sequence.
    pub sequence: u64,
    /// Its commit time (epoch µs).
    pub at_us: i64,
    /// The record as served.
    pub record: Json,
}

/// A named snapshot.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredSnapshot {
    /// The snapshot id.
    pub snapshot_id: String,
    /// When it was taken (epoch µs).
    pub at_us: i64,
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
    /// Upload time (epoch µs).
    pub created_us: i64,
}

/// Filters of [`SqliteStore::query_audit`] (all optional; times inclusive, epoch µs).
#[derive(Clone, Debug, Default)]
pub struct AuditFilter {
    /// Records touching a path that starts with this string.
    pub path_prefix: Option<String>,
    /// Committed at or after.
    pub from_us: Option<i64>,
    /// Committed at or before.
    pub to_us: Option<i64>,
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

    /// Every stored model.
    pub fn load_models(&self) -> Result<Vec<StoredModel>, StoreError> {
        self.with_reader(|c| {
            let mut st = c
                .prepare_cached(
                    "SELECT id, spec, version, created_us, updated_us, head_seq, head_hash
                     FROM models ORDER BY id",
                )
                .map_err(|e| sql_err(&self.db, e))?;
            let rows = st
                .query_map([], |r| {
                    Ok(StoredModel {
                        id: r.get(0)?,
                        spec_text: r.get(1)?,
                        version: r.get(2)?,
                        created_us: r.get(3)?,
                        updated_us: r.get(4)?,
                        head_seq: r.get::<_, Option<i64>>(5)?.map(|s| s.max(0) as u64),
                        head_hash: r.get(6)?,
                    })
                })
                .map_err(|e| sql_err(&self.db, e))?;
            rows.collect::<Result<Vec<_>, _>>()
                .map_err(|e| sql_err(&self.db, e))
        })
    }

    /// Stream a model's records with sequence > `after_seq` (all when `None`) oldest first, stopping
    /// before the first record committed after `up_to_at_us`, or when `f` breaks. Returns how many
    /// records `f` saw. Records are read one at a time (no full load), in one read snapshot.
    pub fn audit_after(
        &self,
        model_id: &str,
        after_seq: Option<u64>,
        up_to_at_us: Option<i64>,
        mut f: impl FnMut(AuditEntry) -> ControlFlow<()>,
    ) -> Result<u64, StoreError> {
        let after = match after_seq {
            None => -1,
            Some(s) => i64::try_from(s).unwrap_or(i64::MAX),
        };
        self.with_reader(|c| {
            let mut st = c
                .prepare_cached(
                    "SELECT sequence, at_us, record FROM audit
                     WHERE model_id = ?1 AND sequence > ?2 ORDER BY sequence",
                )
                .map_err(|e| sql_err(&self.db, e))?;
            let mut rows = st
                .query(params![model_id, after])
                .map_err(|e| sql_err(&self.db, e))?;
            let mut seen = 0u64;
            while let Some(r) = rows.next().map_err(|e| sql_err(&self.db, e))? {
                let (seq, at_us): (i64, i64) = (
                    r.get(0).map_err(|e| sql_err(&self.db, e))?,
                    r.get(1).map_err(|e| sql_err(&self.db, e))?,
                );
                if up_to_at_us.is_some_and(|t| at_us > t) {
                    break;
                }
                let sequence = self.stored_seq(seq, model_id)?;
                let text: String = r.get(2).map_err(|e| sql_err(&self.db, e))?;
                let record = self.parse(&text, || {
                    format!("audit record {sequence} of model `{model_id}`")
                })?;
                seen += 1;
                if f(AuditEntry {
                    sequence,
                    at_us,
                    record,
                })
                .is_break()
                {
                    break;
                }
            }
            Ok(seen)
        })
    }

    /// A model's records matching `filter`, newest first (indexed: by path, by time, by sequence).
    pub fn query_audit(
        &self,
        model_id: &str,
        filter: &AuditFilter,
    ) -> Result<Vec<Json>, StoreError> {
        let limit = filter
            .limit
            .unwrap_or(DEFAULT_QUERY_LIMIT)
            .min(MAX_QUERY_LIMIT) as i64;
        let prefix = filter.path_prefix.as_deref().filter(|p| !p.is_empty());
        let upper = prefix.and_then(prefix_upper_bound);
        let mut sql = String::from("SELECT sequence, record FROM audit WHERE model_id = :m");
        let mut args: Vec<(&str, &dyn ToSql)> = vec![(":m", &model_id), (":limit", &limit)];
        if let Some(p) = &prefix {
            sql.push_str(
                " AND sequence IN (SELECT sequence FROM audit_paths WHERE model_id = :m AND path >= :lo",
            );
            args.push((":lo", p));
            if let Some(u) = &upper {
                sql.push_str(" AND path < :hi");
                args.push((":hi", u));
            }
            sql.push(')');
        }
        if let Some(from) = &filter.from_us {
            sql.push_str(" AND at_us >= :from");
            args.push((":from", from));
        }
        if let Some(to) = &filter.to_us {
            sql.push_str(" AND at_us <= :to");
            args.push((":to", to));
        }
        sql.push_str(" ORDER BY sequence DESC LIMIT :limit");
        self.with_reader(|c| {
            let mut st = c.prepare_cached(&sql).map_err(|e| sql_err(&self.db, e))?;
            let mut rows = st
                .query(args.as_slice())
                .map_err(|e| sql_err(&self.db, e))?;
            let mut out = Vec::new();
            while let Some(r) = rows.next().map_err(|e| sql_err(&self.db, e))? {
                let seq: i64 = r.get(0).map_err(|e| sql_err(&self.db, e))?;
                let text: String = r.get(1).map_err(|e| sql_err(&self.db, e))?;
                out.push(self.parse(&text, || {
                    format!("audit record {seq} of model `{model_id}`")
                })?);
            }
            Ok(out)
        })
    }

    /// A model's snapshots, oldest first.
    pub fn snapshots(&self, model_id: &str) -> Result<Vec<StoredSnapshot>, StoreError> {
        self.with_reader(|c| {
            let mut st = c
                .prepare_cached(
                    "SELECT snapshot_id, at_us, snapshot FROM snapshots WHERE model_id = ?1
                     ORDER BY at_us, snapshot_id",
                )
                .map_err(|e| sql_err(&self.db, e))?;
            let rows = st
                .query_map([model_id], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                    ))
                })
                .map_err(|e| sql_err(&self.db, e))?;
            let mut out = Vec::new();
            for row in rows {
                let (snapshot_id, at_us, text) = row.map_err(|e| sql_err(&self.db, e))?;
                let snapshot = self.parse(&text, || {
                    format!("snapshot `{snapshot_id}` of model `{model_id}`")
                })?;
                out.push(StoredSnapshot {
                    snapshot_id,
                    at_us,
                    snapshot,
                });
            }
            Ok(out)
        })
    }

    /// Blob metadata by blob id.
    pub fn blob(&self, id: &str) -> Result<Option<BlobMeta>, StoreError> {
        self.with_reader(|c| {
            c.prepare_cached(
                "SELECT id, hash, size, media_type, filename, created_us FROM blobs WHERE id = ?1",
            )
            .and_then(|mut s| {
                s.query_row([id], |r| {
                    Ok(BlobMeta {
                        id: r.get(0)?,
                        hash: r.get(1)?,
                        size: r.get::<_, i64>(2)?.max(0) as u64,
                        media_type: r.get(3)?,
                        filename: r.get(4)?,
                        created_us: r.get(5)?,
                    })
                })
                .optional()
            })
            .map_err(|e| sql_err(&self.db, e))
        })
    }

    /// Write blob bytes durably (temp file, fsync, rename, fsync of the directory) under their
    /// blake3 hash and return the hash. Idempotent; call before submitting `Op::PutBlob`, so
    /// metadata never names missing bytes (a crash in between leaves an unreferenced file).
    pub fn put_blob_bytes(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let size = bytes.len() as u64;
        if size > self.opts.max_blob_bytes {
            return Err(StoreError::BlobTooLarge {
                size,
                limit: self.opts.max_blob_bytes,
            });
        }
        let hash = blake3::hash(bytes).to_hex().to_string();
        let (sub, path) = self.blob_path(&hash)?;
        if let Ok(existing) = fs::read(&path) {
            if blake3::hash(&existing).to_hex().as_str() == hash {
                return Ok(hash);
            }
        }
        let new_dir = !sub.exists();
        fs::create_dir_all(&sub).map_err(|e| StoreError::io(&sub, e))?;
        if new_dir {
            sync_dir(&self.dir.join("blobs"))?;
        }
        static TMP_SEQ: AtomicU64 = AtomicU64::new(0);
        let tmp = sub.join(format!(
            ".tmp-{}-{}-{}",
            &hash[2..],
            std::process::id(),
            TMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(StoreError::io(&path, e));
        }
        sync_dir(&sub)?;
        Ok(hash)
    }

    /// Blob bytes by hash, checked against the hash (a damaged file is `Corrupt`).
    pub fn blob_bytes(&self, hash: &str) -> Result<Vec<u8>, StoreError> {
        let (_, path) = self.blob_path(hash)?;
        let len = match fs::metadata(&path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::BlobNotFound {
                    hash: hash.to_string(),
                })
            }
            Err(e) => return Err(StoreError::io(&path, e)),
        };
        if len > self.opts.max_blob_bytes {
            return Err(StoreError::BlobTooLarge {
                size: len,
                limit: self.opts.max_blob_bytes,
            });
        }
        let bytes = fs::read(&path).map_err(|e| StoreError::io(&path, e))?;
        if blake3::hash(&bytes).to_hex().as_str() != hash {
            return Err(StoreError::Corrupt {
                path,
                detail: "the blob's bytes do not match its blake3 hash".into(),
            });
        }
        Ok(bytes)
    }

    fn blob_path(&self, hash: &str) -> Result<(PathBuf, PathBuf), StoreError> {
        let valid =
            hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !valid {
            return Err(StoreError::InvalidBlobHash {
                hash: hash.to_string(),
            });
        }
        let sub = self.dir.join("blobs").join(&hash[..2]);
        let path = sub.join(&hash[2..]);
        Ok((sub, path))
    }

    /// Walk a model's stored audit chain oldest first (one read snapshot) and check every link,
    /// hash and sequence against the chain head recorded in `models` (in a keyed store, keyed
    /// hashes from the model's `key_from` on, and the anchor that pins it); then every
    /// checkpoint against its state and the chain ([`checkpoints`]).
    pub fn verify_chain(&self, model_id: &str) -> Result<ChainReport, StoreError> {
        self.with_reader(|c| {
            c.execute_batch("BEGIN").map_err(|e| sql_err(&self.db, e))?;
            type Head = (Option<i64>, String, Option<i64>, Option<i64>, Option<String>);
            let head: Option<Head> = c
                .prepare_cached(
                    "SELECT head_seq, head_hash, base_seq, key_from, key_anchor FROM models
                     WHERE id = ?1",
                )
                .and_then(|mut s| {
                    s.query_row([model_id], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                    })
                    .optional()
                })
                .map_err(|e| sql_err(&self.db, e))?;
            let Some((head_seq, head_hash, base_seq, key_from, anchor)) = head else {
                return Err(StoreError::ModelNotFound {
                    model_id: model_id.to_string(),
                });
            };
            let key = self.opts.audit_key;
            // In a keyed store a model without an anchor is held to the key from record 0.
            let keyed_from = key_from.map_or(0, |f| f.max(0) as u64);
            let mut v = match key {
                Some(k) => ChainVerifier::new().with_hasher(ChainHasher::keyed(k, keyed_from)),
                None => ChainVerifier::new(),
            };
            // The hash of record `keyed_from - 1` as the walk verified it: what the anchor binds.
            let mut anchored_prev: Option<String> = None;
            let mut st = c
                .prepare_cached(
                    "SELECT sequence, prev_hash, hash, record FROM audit WHERE model_id = ?1
                     ORDER BY sequence",
                )
                .map_err(|e| sql_err(&self.db, e))?;
            let mut rows = st.query([model_id]).map_err(|e| sql_err(&self.db, e))?;
            while let Some(r) = rows.next().map_err(|e| sql_err(&self.db, e))? {
                let get = |i| r.get_ref(i).map_err(|e| sql_err(&self.db, e));
                let seq = get(0)?.as_i64().unwrap_or(-1);
                let Ok(seq) = u64::try_from(seq) else {
                    v.fail(0, format!("a record is stored at invalid sequence {seq}"));
                    break;
                };
                let text = |i| get(i).map(|x| x.as_str().unwrap_or_default().to_string());
                let (prev_col, hash_col, record_text) = (text(1)?, text(2)?, text(3)?);
                let record: Json = match serde_json::from_str(&record_text) {
                    Ok(j) => j,
                    // A gap before it is the earlier break; otherwise the record itself is.
                    Err(_) if seq != v.next_sequence() => Json::Null,
                    Err(e) => {
                        v.fail(
                            seq,
                            format!("record {seq} is not valid JSON (altered): {e}"),
                        );
                        break;
                    }
                };
                let matches =
                    |col: &str, key: &str| record.get(key).and_then(Json::as_str) == Some(col);
                if seq == v.next_sequence()
                    && (!matches(&prev_col, "prevHash") || !matches(&hash_col, "hash"))
                {
                    v.fail(
                        seq,
                        format!(
                            "record {seq}: the stored hash columns differ from the record (edited)"
                        ),
                    );
                    break;
                }
                if seq == keyed_from && seq == v.next_sequence() {
                    anchored_prev = Some(v.prev_hash().to_string());
                }
                if !v.check(seq, &record) {
                    break;
                }
            }
            drop(rows);
            if let Some(k) = key.filter(|_| !v.is_broken()) {
                if anchored_prev.is_none() && v.next_sequence() == keyed_from {
                    anchored_prev = Some(v.prev_hash().to_string());
                }
                match (anchor, anchored_prev) {
                    (None, _) => v.fail(
                        0,
                        "the store is keyed but this model has no audit key anchor (removed)",
                    ),
                    (Some(_), None) => v.fail(
                        keyed_from,
                        format!("keying starts at record {keyed_from}, beyond the stored chain (edited)"),
                    ),
                    (Some(a), Some(prev)) => {
                        if chain::key_anchor(&k, model_id, keyed_from, &prev) != a {
                            v.fail(
                                keyed_from,
                                format!(
                                    "the audit key anchor does not match the chain at record {keyed_from}: records before it were rewritten, or where keying starts was edited"
                                ),
                            );
                        }
                    }
                }
            }
            let head_seq = head_seq.map(|s| s.max(0) as u64);
            let mut report = v.finish(head_seq.map(|s| (s, head_hash.as_str())));
            let (checked, broken) = self.verify_checkpoints(c, model_id, base_seq)?;
            report.checkpoints_checked = Some(checked);
            if let Some(b) = broken {
                if report.valid {
                    report.valid = false;
                    report.detail = format!("{}: {}", checkpoints::describe(b.sequence), b.detail);
                }
                report.broken_checkpoint = Some(b);
            }
            Ok(report)
        })
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
