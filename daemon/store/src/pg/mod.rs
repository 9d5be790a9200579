//! The PostgreSQL store, [`PgStore`]: the second implementation of [`Store`], for nodes that
//! share one database (`valem serve --store postgres://…`). It keeps what the SQLite store
//! keeps — registry and spec texts, the hash-chained audit log, checkpoints, snapshots, tasks,
//! blob metadata — plus the blob bytes (a fleet shares no directory), in the schema `valem` of
//! the database the URL names ([`schema`]), with the same guarantees:
//! - **Writes** go through the same single writer thread ([`Writer`]): ops are drained into
//!   batches, each batch is ONE transaction, each op in a savepoint (an op that fails alone is
//!   rolled back, the rest commit), and an op's completion is called only after COMMIT returned.
//!   [`Durability::Strict`] commits with `synchronous_commit = on` (the server flushed its WAL
//!   before answering: the write survives a crash of the server, or of this process);
//!   [`Durability::Relaxed`] with `off` (a server crash can lose the last ~3 wal_writer_delay of
//!   acknowledged commits; [`Store::flush`] forces them out).
//! - **Connection loss** fails the batch in flight as a whole ([`StoreError::Unavailable`]: its
//!   transaction was not committed, or its COMMIT's answer was lost); the writer reconnects at
//!   its next batch. Reads reconnect on their own.
//! - **Chain, checkpoints and keys** are checked by the same code as in SQLite ([`crate::chain`],
//!   [`crate::checkpoints`]); the rows differ only in their SQL types.
//!
//! Not kept here: PostgreSQL's own integrity (page checksums, replication, backups) is the
//! server's; [`Store::quick_check`] only checks that the server answers and holds this schema.

mod owners;
mod reads;
mod schema;
#[cfg(any(test, feature = "pg-testing"))]
pub mod testing;
mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::Duration;

use postgres::config::Host;
use postgres::error::SqlState;
use postgres::{Client, NoTls, Statement};

use crate::chain::{self, AuditKey, ChainHasher, GENESIS};
use crate::checkpoints::{self, Row};
use crate::keys::KeyAdoption;
use crate::{Store, StoreError, StoreOptions, Writer, WriterStats};

pub use owners::{ClaimStats, NodeConfig, NodeInfo, Ownership};
pub use schema::SCHEMA_VERSION;

/// How long connecting may take before it counts as a failure.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long sent data may stay unacknowledged before the connection counts as lost (a server
/// that vanished without closing it).
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the database is: the parsed URL, and how messages name it (without its password).
#[derive(Clone)]
pub(crate) struct PgTarget {
    config: postgres::Config,
    label: String,
}

impl PgTarget {
    /// Parse a `postgres://` URL (or a `key=value` connection string).
    pub(crate) fn parse(url: &str) -> Result<PgTarget, StoreError> {
        let mut config = postgres::Config::from_str(url).map_err(|e| StoreError::Postgres {
            path: PathBuf::from("postgres://…"),
            detail: format!("the store URL is not a PostgreSQL connection string: {e}"),
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(TCP_USER_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("valem");
        }
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
            None => "localhost".into(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let user = config.get_user().unwrap_or("");
        let db = config.get_dbname().unwrap_or(user);
        let at = if user.is_empty() {
            String::new()
        } else {
            format!("{user}@")
        };
        let label = format!("postgres://{at}{host}:{port}/{db}");
        Ok(PgTarget { config, label })
    }

    /// The URL without its password, as a path for [`StoreError`]'s messages.
    pub(crate) fn label(&self) -> PathBuf {
        PathBuf::from(&self.label)
    }

    /// A new connection.
    pub(crate) fn connect(&self) -> Result<Client, StoreError> {
        self.config.connect(NoTls).map_err(|e| {
            use std::error::Error as _;
            let detail = match e.source() {
                Some(s) => format!("{e}: {s}"),
                None => e.to_string(),
            };
            StoreError::Unavailable {
                path: self.label(),
                detail,
            }
        })
    }
}

/// Map a PostgreSQL error to the store's, singling out the ones a caller reacts to.
pub(crate) fn pg_err(target: &PgTarget, e: postgres::Error) -> StoreError {
    let path = target.label();
    let Some(code) = e.code() else {
        // No SQLSTATE: the connection failed or closed, or a value did not convert.
        use std::error::Error as _;
        let io = e
            .source()
            .is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some());
        let detail = match e.source() {
            Some(s) => format!("{e}: {s}"),
            None => e.to_string(),
        };
        if e.is_closed() || io || detail.contains("connection") {
            return StoreError::Unavailable { path, detail };
        }
        return StoreError::Postgres { path, detail };
    };
    let detail = e
        .as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_string());
    match code {
        c if *c == SqlState::DISK_FULL || *c == SqlState::OUT_OF_MEMORY => {
            StoreError::DiskFull { path }
        }
        c if *c == SqlState::READ_ONLY_SQL_TRANSACTION
            || *c == SqlState::INSUFFICIENT_PRIVILEGE =>
        {
            StoreError::NotWritable { path, detail }
        }
        c if *c == SqlState::DATA_CORRUPTED || *c == SqlState::INDEX_CORRUPTED => {
            StoreError::Corrupt { path, detail }
        }
        // The server is shutting down, restarting or refusing connections.
        c if c.code().starts_with("57P") || c.code().starts_with("08") => {
            StoreError::Unavailable { path, detail }
        }
        _ => StoreError::Postgres { path, detail },
    }
}

/// A connection and its prepared statements (prepared once per connection, by their SQL).
pub(crate) struct Conn {
    pub(crate) client: Client,
    stmts: HashMap<&'static str, Statement>,
}

impl Conn {
    fn new(client: Client) -> Conn {
        Conn {
            client,
            stmts: HashMap::new(),
        }
    }
}

/// The statement for `sql` on the connection behind `c` (a client or a transaction of it),
/// prepared at its first use.
pub(crate) fn stmt<C: postgres::GenericClient>(
    c: &mut C,
    cache: &mut HashMap<&'static str, Statement>,
    sql: &'static str,
) -> Result<Statement, postgres::Error> {
    if let Some(s) = cache.get(sql) {
        return Ok(s.clone());
    }
    let s = c.prepare(sql)?;
    cache.insert(sql, s.clone());
    Ok(s)
}

/// Run `f` where the sync driver may block: here, or, when this thread is inside a tokio
/// runtime (an async handler, the daemon's main thread while it serves), on a scoped thread
/// of its own (`postgres` drives its connections with a runtime of its own, which tokio does
/// not let a runtime thread start).
pub(crate) fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if tokio::runtime::Handle::try_current().is_err() {
        return f();
    }
    std::thread::scope(|s| match s.spawn(f).join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

/// An open PostgreSQL store. `Sync`: share it behind an `Arc`. Dropping it drains the writer.
pub struct PgStore {
    target: PgTarget,
    opts: StoreOptions,
    adoption: Option<KeyAdoption>,
    writer: Writer,
    thread: Option<JoinHandle<()>>,
    readers: Mutex<Vec<Conn>>,
    /// The epoch of each model this node claimed (a fleet's node only).
    held: owners::Held,
    /// Models found lost by a renewal, until [`PgStore::take_lost`].
    lost: std::sync::Arc<Mutex<Vec<String>>>,
    /// When this node's lease runs out at the latest (a fleet's node only).
    lease_end: owners::LeaseEnd,
    /// What its claims did.
    claims: std::sync::Arc<owners::ClaimCounters>,
    /// The lease thread and what stops it.
    renewal: Option<(std::sync::mpsc::Sender<()>, JoinHandle<()>)>,
}

impl PgStore {
    /// Open the store in the database `url` names: connects once (an unreachable server is
    /// [`StoreError::Unavailable`]: the caller decides whether to retry), migrates the schema
    /// (refusing one from a newer build), settles the audit key, starts the writer thread.
    pub fn open(url: &str, opts: StoreOptions) -> Result<PgStore, StoreError> {
        off_runtime(|| PgStore::open_here(url, opts))
    }

    fn open_here(url: &str, opts: StoreOptions) -> Result<PgStore, StoreError> {
        let target = PgTarget::parse(url)?;
        let mut client = target.connect()?;
        schema::migrate(&mut client, &target)?;
        let adoption = settle_key(&mut client, &target, opts.audit_key.as_ref())?;
        let held = owners::Held::default();
        let fence = opts.node.as_ref().map(|n| (n.id.clone(), held.clone()));
        let (writer, thread) = writer::spawn(
            Conn::new(client),
            target.clone(),
            opts.durability,
            opts.queue_capacity,
            opts.max_batch_ops,
            opts.audit_key,
            fence,
        )?;
        let mut store = PgStore {
            target,
            opts,
            adoption,
            writer,
            thread: Some(thread),
            readers: Mutex::new(Vec::new()),
            held,
            lost: Default::default(),
            lease_end: Default::default(),
            claims: Default::default(),
            renewal: None,
        };
        if let Some(node) = store.opts.node.clone() {
            store.register_node()?;
            if node.renew {
                let (stop, stopped) = std::sync::mpsc::channel();
                let handle = store.spawn_renewal(stopped)?;
                store.renewal = Some((stop, handle));
            }
        }
        Ok(store)
    }

    /// The database's URL without its password.
    pub fn label(&self) -> &str {
        &self.target.label
    }

    /// How messages name the database of `url` (without its password); `None` when `url` is
    /// not a connection string.
    pub fn label_of(url: &str) -> Option<String> {
        PgTarget::parse(url).ok().map(|t| t.label)
    }

    /// Drain the writer (everything queued before this commits) and stop.
    pub fn close(mut self) -> Result<(), StoreError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), StoreError> {
        if let Some((stop, handle)) = self.renewal.take() {
            drop(stop);
            let _ = handle.join();
        }
        // Closing a connection blocks on the driver's runtime.
        let idle: Vec<Conn> = match self.readers.lock() {
            Ok(mut r) => r.drain(..).collect(),
            Err(_) => Vec::new(),
        };
        off_runtime(move || drop(idle));
        let Some(t) = self.thread.take() else {
            return Ok(());
        };
        self.writer.shutdown();
        t.join().map_err(|_| StoreError::WriterStopped)
    }

    /// Run `f` on a pooled connection (a new one when the pool is empty); a connection that
    /// failed is not pooled again.
    pub(crate) fn with_reader<T: Send>(
        &self,
        f: impl FnMut(&mut Conn) -> Result<T, postgres::Error> + Send,
    ) -> Result<T, StoreError> {
        off_runtime(|| self.with_reader_here(f))
    }

    /// [`with_reader`](Self::with_reader) on this thread (outside any tokio runtime). A pooled
    /// connection that turns out dead (the server restarted) empties the pool, and `f` runs
    /// again, once, on a new connection: `f` must be safe to run twice after a connection error.
    pub(crate) fn with_reader_here<T>(
        &self,
        mut f: impl FnMut(&mut Conn) -> Result<T, postgres::Error>,
    ) -> Result<T, StoreError> {
        let pooled = self.readers.lock().ok().and_then(|mut p| p.pop());
        let (mut conn, reused) = match pooled {
            Some(c) if !c.client.is_closed() => (c, true),
            _ => (Conn::new(self.target.connect()?), false),
        };
        let mut out = f(&mut conn).map_err(|e| pg_err(&self.target, e));
        if reused && matches!(out, Err(StoreError::Unavailable { .. })) {
            if let Ok(mut p) = self.readers.lock() {
                p.clear();
            }
            conn = Conn::new(self.target.connect()?);
            out = f(&mut conn).map_err(|e| pg_err(&self.target, e));
        }
        if !conn.client.is_closed() && out.is_ok() {
            if let Ok(mut p) = self.readers.lock() {
                if p.len() < self.opts.read_pool {
                    p.push(conn);
                }
            }
        }
        out
    }

    fn stored_seq(&self, seq: i64, model_id: &str) -> Result<u64, StoreError> {
        u64::try_from(seq).map_err(|_| StoreError::Corrupt {
            path: self.target.label(),
            detail: format!("model `{model_id}` has a row at negative sequence {seq}"),
        })
    }

    fn parse(
        &self,
        text: &str,
        what: impl FnOnce() -> String,
    ) -> Result<serde_json::Value, StoreError> {
        serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
            path: self.target.label(),
            detail: format!("{} is not valid JSON: {e}", what()),
        })
    }
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("db", &self.target.label)
            .field("durability", &self.opts.durability)
            .finish_non_exhaustive()
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// A checkpoint row as PostgreSQL returns [`checkpoints::COLUMNS`].
pub(crate) fn checkpoint_row(r: &postgres::Row) -> Result<Row, postgres::Error> {
    Ok(Row {
        sequence: r.try_get(0)?,
        at_us: r.try_get(1)?,
        state: r.try_get::<_, String>(2)?.into_bytes(),
        kind: r.try_get(3)?,
        head_hash: r.try_get(4)?,
        state_hash: r.try_get(5)?,
        hash: r.try_get(6)?,
    })
}

/// The stored hash of `model_id`'s record `seq`.
pub(crate) fn record_hash_of<C: postgres::GenericClient>(
    c: &mut C,
    model_id: &str,
    seq: i64,
) -> Result<Option<String>, postgres::Error> {
    Ok(c.query_opt(
        "SELECT hash FROM valem.audit WHERE model_id = $1 AND sequence = $2",
        &[&model_id, &seq],
    )?
    .map(|r| r.get(0)))
}

const META_KEY: &str = "audit_key";

/// As the SQLite store's [`crate::keys`]: check the store's key marking against `key`, adopt
/// `key` in an unkeyed store (anchoring every model's chain head, rehashing the checkpoints
/// whose plain hashes verify), in one transaction.
fn settle_key(
    client: &mut Client,
    target: &PgTarget,
    key: Option<&AuditKey>,
) -> Result<Option<KeyAdoption>, StoreError> {
    let q = |e| pg_err(target, e);
    let mut tx = client.transaction().map_err(q)?;
    // One node adopts; the others then find the store keyed.
    tx.execute("LOCK TABLE valem.meta IN EXCLUSIVE MODE", &[])
        .map_err(q)?;
    let marked: Option<String> = tx
        .query_opt("SELECT value FROM valem.meta WHERE key = $1", &[&META_KEY])
        .map_err(q)?
        .map(|r| r.get(0));
    let anchored: i64 = tx
        .query_one(
            "SELECT count(*) FROM valem.models WHERE key_anchor IS NOT NULL",
            &[],
        )
        .map_err(q)?
        .get(0);
    let unmarked_but_anchored = || {
        StoreError::Corrupt {
        path: target.label(),
        detail: format!(
            "{anchored} model(s) carry audit key anchors but the store has no key fingerprint (its `meta` row was removed); restore the database from a backup"
        ),
    }
    };
    let k = match (marked, key) {
        (None, None) if anchored > 0 => return Err(unmarked_but_anchored()),
        (None, None) => return Ok(None),
        (Some(fingerprint), None) => {
            return Err(StoreError::AuditKeyRequired {
                path: target.label(),
                fingerprint,
            })
        }
        (Some(expected), Some(k)) => {
            let given = k.fingerprint();
            if expected == given {
                return Ok(None);
            }
            return Err(StoreError::AuditKeyMismatch {
                path: target.label(),
                expected,
                given,
            });
        }
        (None, Some(_)) if anchored > 0 => return Err(unmarked_but_anchored()),
        (None, Some(k)) => k,
    };
    let models: Vec<(String, Option<i64>, String)> = tx
        .query(
            "SELECT id, head_seq, head_hash FROM valem.models ORDER BY id",
            &[],
        )
        .map_err(q)?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let mut adoption = KeyAdoption::default();
    for (id, head_seq, head_hash) in models {
        let (from, prev) = match head_seq {
            Some(h) => ((h.max(0) as u64) + 1, head_hash.as_str()),
            None => (0, GENESIS),
        };
        let anchor = chain::key_anchor(k, &id, from, prev);
        let from_param = i64::try_from(from).unwrap_or(i64::MAX);
        tx.execute(
            "UPDATE valem.models SET key_from = $2, key_anchor = $3 WHERE id = $1",
            &[&id, &from_param, &anchor],
        )
        .map_err(q)?;
        adoption.models.push((id, from));
    }
    let rows: Vec<(String, Row)> = tx
        .query(
            &format!(
                "SELECT {}, model_id FROM valem.checkpoints",
                checkpoints::COLUMNS
            ),
            &[],
        )
        .map_err(q)?
        .iter()
        .map(|r| Ok((r.try_get(7)?, checkpoint_row(r)?)))
        .collect::<Result<_, postgres::Error>>()
        .map_err(q)?;
    for (model, row) in rows {
        let mut lookup = |seq| record_hash_of(&mut tx, &model, seq);
        let Some(hash) = checkpoints::rekeyed_hash(&mut lookup, k, &model, &row).map_err(q)? else {
            continue;
        };
        tx.execute(
            "UPDATE valem.checkpoints SET hash = $3 WHERE model_id = $1 AND sequence = $2",
            &[&model, &row.sequence, &hash],
        )
        .map_err(q)?;
        adoption.checkpoints_rehashed += 1;
    }
    tx.execute(
        "INSERT INTO valem.meta (key, value) VALUES ($1, $2)",
        &[&META_KEY, &k.fingerprint()],
    )
    .map_err(q)?;
    tx.commit().map_err(q)?;
    Ok(Some(adoption))
}

impl Store for PgStore {
    fn dir(&self) -> Option<&Path> {
        None
    }
    fn audit_key(&self) -> Option<&AuditKey> {
        self.opts.audit_key.as_ref()
    }
    fn key_adoption(&self) -> Option<&KeyAdoption> {
        self.adoption.as_ref()
    }
    fn record_hasher(&self, model_id: &str) -> Result<ChainHasher, StoreError> {
        let Some(key) = self.opts.audit_key else {
            return Ok(ChainHasher::plain());
        };
        let from: Option<Option<i64>> = self.with_reader(|c| {
            Ok(c.client
                .query_opt(
                    "SELECT key_from FROM valem.models WHERE id = $1",
                    &[&model_id],
                )?
                .map(|r| r.get(0)))
        })?;
        let Some(from) = from else {
            return Err(StoreError::ModelNotFound {
                model_id: model_id.to_string(),
            });
        };
        Ok(ChainHasher::keyed(key, from.map_or(0, |f| f.max(0) as u64)))
    }
    fn writer(&self) -> Writer {
        self.writer.clone()
    }
    fn flush(&self) -> Result<(), StoreError> {
        self.writer.flush()
    }
    fn stats(&self) -> WriterStats {
        self.writer.stats()
    }
    fn load_models(&self) -> Result<Vec<crate::StoredModel>, StoreError> {
        PgStore::load_models(self)
    }
    fn load_model(&self, id: &str) -> Result<Option<crate::StoredModel>, StoreError> {
        PgStore::load_model(self, id)
    }
    fn model_ids(&self, needle: Option<&str>) -> Result<Vec<String>, StoreError> {
        PgStore::model_ids(self, needle)
    }
    fn audit_after(
        &self,
        model_id: &str,
        after: Option<crate::Seq>,
        up_to: Option<crate::Timestamp>,
        f: &mut dyn FnMut(crate::AuditEntry) -> std::ops::ControlFlow<()>,
    ) -> Result<u64, StoreError> {
        PgStore::audit_after(self, model_id, after, up_to, f)
    }
    fn query_audit(
        &self,
        model_id: &str,
        filter: &crate::AuditFilter,
    ) -> Result<Vec<serde_json::Value>, StoreError> {
        PgStore::query_audit(self, model_id, filter)
    }
    fn snapshots(&self, model_id: &str) -> Result<Vec<crate::StoredSnapshot>, StoreError> {
        PgStore::snapshots(self, model_id)
    }
    fn tasks(&self) -> Result<Vec<String>, StoreError> {
        PgStore::tasks(self)
    }
    fn idempotency_keys(&self, model_id: &str) -> Result<Vec<crate::StoredKey>, StoreError> {
        PgStore::idempotency_keys(self, model_id)
    }
    fn idempotency_answer(&self, model_id: &str, key: &str) -> Result<Option<String>, StoreError> {
        PgStore::idempotency_answer(self, model_id, key)
    }
    fn blob(&self, id: &str) -> Result<Option<crate::BlobMeta>, StoreError> {
        PgStore::blob(self, id)
    }
    fn put_blob_bytes(&self, bytes: &[u8]) -> Result<String, StoreError> {
        PgStore::put_blob_bytes(self, bytes)
    }
    fn blob_bytes(&self, hash: &str) -> Result<Vec<u8>, StoreError> {
        PgStore::blob_bytes(self, hash)
    }
    fn verify_chain(&self, model_id: &str) -> Result<crate::ChainReport, StoreError> {
        PgStore::verify_chain(self, model_id)
    }
    fn quick_check(&self) -> Result<(), StoreError> {
        PgStore::quick_check(self)
    }
    fn usable_checkpoint(
        &self,
        model_id: &str,
        at_or_before: Option<crate::Timestamp>,
    ) -> Result<crate::CheckpointChoice, StoreError> {
        PgStore::usable_checkpoint(self, model_id, at_or_before)
    }
    fn verify_model_checkpoints(
        &self,
        model_id: &str,
    ) -> Result<(u64, Option<crate::BrokenCheckpoint>), StoreError> {
        PgStore::verify_model_checkpoints(self, model_id)
    }
    fn claim(&self, model_id: &str) -> Result<Option<Ownership>, StoreError> {
        match self.opts.node {
            None => Ok(None),
            Some(_) => PgStore::claim(self, model_id).map(Some),
        }
    }
    fn release(&self, model_id: &str) -> Result<(), StoreError> {
        match self.opts.node {
            None => Ok(()),
            Some(_) => PgStore::release(self, model_id),
        }
    }
    fn take_lost(&self) -> Vec<String> {
        PgStore::take_lost(self)
    }
    fn holds(&self, model_id: &str) -> bool {
        self.opts.node.is_none()
            || (owners::lease_runs(&self.lease_end)
                && self
                    .held
                    .lock()
                    .map(|h| h.contains_key(model_id))
                    .unwrap_or(false))
    }
    fn is_fleet(&self) -> bool {
        self.opts.node.is_some()
    }
    fn node_id(&self) -> Option<String> {
        self.opts.node.as_ref().map(|n| n.id.clone())
    }
    fn owner(&self, model_id: &str) -> Result<Option<Ownership>, StoreError> {
        PgStore::owner(self, model_id)
    }
    fn nodes(&self) -> Result<Vec<NodeInfo>, StoreError> {
        PgStore::nodes(self)
    }
    fn claim_stats(&self) -> Option<owners::ClaimStats> {
        self.opts.node.is_some().then(|| self.claims.stats())
    }
}
