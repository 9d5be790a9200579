//! The PostgreSQL store's side of the single writer: one connection, one transaction per
//! batch, one savepoint per op; the same ops and checks as the SQLite writer, in PostgreSQL's
//! SQL. A lost connection fails the batch and is replaced at the next one.

use std::collections::{HashMap, HashSet};
use std::thread::JoinHandle;

use postgres::error::SqlState;
use postgres::{Statement, Transaction};
use serde_json::Value as Json;

use super::owners::Held;
use super::{pg_err, stmt, Conn, PgTarget};
use crate::chain::{self, AuditKey, Seq, GENESIS};
use crate::writer::{
    checkpoint_seq, record_not_stored, seal_checkpoint, seq_param, spawn_backend, to_text,
    AuditAppend, Backend, Op, SealedCheckpoint,
};
use crate::{CheckpointKind, Durability, StoreError, Writer};

/// Start the writer thread on `conn`.
pub(super) fn spawn(
    conn: Conn,
    target: PgTarget,
    durability: Durability,
    queue_capacity: usize,
    max_batch_ops: usize,
    key: Option<AuditKey>,
    fence: Option<(String, Held)>,
) -> Result<(Writer, JoinHandle<()>), StoreError> {
    let mut backend = PgBackend {
        conn: Some(conn),
        target: target.clone(),
        durability,
        key,
        fence: fence.map(|(node, held)| Fence {
            node,
            held,
            checked: HashSet::new(),
        }),
    };
    backend.configure().map_err(|e| pg_err(&target, e))?;
    spawn_backend(
        Box::new(backend),
        "valem-store-writer",
        queue_capacity,
        max_batch_ops,
    )
    .map_err(|e| StoreError::Postgres {
        path: target.label(),
        detail: format!("cannot start the writer thread: {e}"),
    })
}

struct PgBackend {
    /// `None` after the connection was lost, until the next batch reconnects.
    conn: Option<Conn>,
    target: PgTarget,
    durability: Durability,
    key: Option<AuditKey>,
    /// A fleet's node: every op on a model checks this node still holds its epoch.
    fence: Option<Fence>,
}

/// The fence of a fleet's node (see `owners.rs`).
struct Fence {
    node: String,
    held: Held,
    /// Models checked in the batch being written (their owner rows are locked until COMMIT).
    checked: HashSet<String>,
}

impl Fence {
    /// Fail the op unless this node holds `model_id` at the epoch it claimed; the owner row
    /// stays share-locked until the batch commits, so no claim can pass it meanwhile.
    fn check(
        &mut self,
        tx: &mut Transaction<'_>,
        stmts: &mut Stmts,
        model_id: &str,
    ) -> Result<(), Failure> {
        if self.checked.contains(model_id) {
            return Ok(());
        }
        let held = self.held.lock().ok().and_then(|h| h.get(model_id).copied());
        let st = stmt(
            tx,
            stmts,
            "SELECT node_id, epoch FROM valem.owners WHERE model_id = $1 AND NOT released
             FOR SHARE",
        )?;
        let row = tx.query_opt(&st, &[&model_id])?;
        let owner: Option<(String, i64)> = match row {
            Some(r) => Some((r.try_get(0)?, r.try_get(1)?)),
            None => None,
        };
        let fenced = |detail: String| {
            Failure::Op(StoreError::Fenced {
                model_id: model_id.to_string(),
                detail,
            })
        };
        match (owner, held) {
            (Some((node, epoch)), Some(mine)) if node == self.node && epoch == mine => {
                self.checked.insert(model_id.to_string());
                Ok(())
            }
            (Some((node, epoch)), _) => {
                Err(fenced(format!("node `{node}` holds it at epoch {epoch}")))
            }
            (None, _) => Err(fenced(
                "no node holds it (never claimed, or released): claim it first".into(),
            )),
        }
    }
}

/// The model an op writes, if any.
fn model_of(op: &Op) -> Option<&str> {
    match op {
        Op::PutModel { id, .. } | Op::DeleteModel { id } => Some(id),
        Op::AppendAudit(a) => Some(&a.model_id),
        Op::Checkpoint { model_id, .. }
        | Op::PutSnapshot { model_id, .. }
        | Op::DeleteSnapshot { model_id, .. } => Some(model_id),
        Op::PutBlob(_)
        | Op::PutTask { .. }
        | Op::DeleteTask { .. }
        | Op::Atomic(_)
        | Op::Release { .. } => None,
    }
}

/// How an op failed: on its own checks, before it wrote anything (`Op`), or in the database
/// (`Db`: a constraint, which fails that op alone when it runs in a savepoint, or anything
/// else, which fails the batch).
enum Failure {
    Op(StoreError),
    Db(postgres::Error),
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Failure {
        Failure::Op(e)
    }
}

impl From<postgres::Error> for Failure {
    fn from(e: postgres::Error) -> Failure {
        Failure::Db(e)
    }
}

/// The error of the op alone when the database refused it for its own content (a constraint,
/// a character PostgreSQL's text cannot hold); `None`: the batch fails.
fn op_error(e: &postgres::Error) -> Option<StoreError> {
    let constraint = [
        SqlState::UNIQUE_VIOLATION,
        SqlState::FOREIGN_KEY_VIOLATION,
        SqlState::CHECK_VIOLATION,
        SqlState::NOT_NULL_VIOLATION,
    ];
    let detail = || {
        e.as_db_error()
            .map_or_else(|| e.to_string(), |d| d.message().to_string())
    };
    match e.code() {
        Some(c) if constraint.contains(c) => Some(StoreError::Constraint { detail: detail() }),
        Some(c) if *c == SqlState::CHARACTER_NOT_IN_REPERTOIRE => {
            Some(StoreError::InvalidRecord { detail: detail() })
        }
        _ => None,
    }
}

/// Whether `op` fails its own checks before it writes anything, so that a batch without
/// savepoints can go on past its failure.
fn checks_before_writing(op: &Op) -> bool {
    matches!(
        op,
        Op::AppendAudit(_) | Op::Checkpoint { .. } | Op::PutSnapshot { .. } | Op::Release { .. }
    )
}

/// Why a batch stopped before COMMIT.
enum Abort {
    /// The database failed it: the batch fails.
    Db(postgres::Error),
    /// An op failed in a way only a savepoint undoes: run the batch again with savepoints.
    NeedsSavepoints,
}

impl PgBackend {
    /// One batch in one transaction; on failure, whether its COMMIT had been sent (after which
    /// the outcome is unknown and the batch must not run again).
    #[allow(clippy::type_complexity)]
    fn try_batch(
        &mut self,
        ops: &[&Op],
    ) -> Result<(Vec<Result<(), StoreError>>, bool), (StoreError, bool)> {
        let key = self.key;
        let target = self.target.clone();
        let mut fence = self.fence.take();
        if let Some(f) = fence.as_mut() {
            f.checked.clear();
        }
        let mut out = self.try_batch_fenced(ops, key, &target, fence.as_mut(), false);
        if matches!(out, Err(None)) {
            if let Some(f) = fence.as_mut() {
                f.checked.clear();
            }
            out = self.try_batch_fenced(ops, key, &target, fence.as_mut(), true);
        }
        self.fence = fence;
        match out {
            Ok(done) => Ok(done),
            Err(Some(failed)) => Err(failed),
            // The batch with savepoints never asks for them again.
            Err(None) => Err((StoreError::WriterStopped, false)),
        }
    }

    /// The batch in one transaction: without savepoints first (most ops check before they
    /// write, and the batch saves two round trips per op), with one per op when an op fails in
    /// a way only a savepoint undoes (`Err(None)`: run it again with `savepoints`).
    #[allow(clippy::type_complexity)]
    fn try_batch_fenced(
        &mut self,
        ops: &[&Op],
        key: Option<AuditKey>,
        target: &PgTarget,
        mut fence: Option<&mut Fence>,
        savepoints: bool,
    ) -> Result<(Vec<Result<(), StoreError>>, bool), Option<(StoreError, bool)>> {
        let conn = self.conn().map_err(|e| Some((e, false)))?;
        let Conn { client, stmts } = conn;
        let mut results: Vec<Result<(), StoreError>> = Vec::with_capacity(ops.len());
        let mut committing = false;
        let outcome = (|| -> Result<(), Abort> {
            let mut tx = client.transaction().map_err(Abort::Db)?;
            let mut grouped_until = 0;
            for (i, op) in ops.iter().enumerate() {
                if i < grouped_until {
                    continue;
                }
                // Appends to several models in a row: one statement for all of them (one round
                // trip instead of one each). Any of them failing its checks runs the batch
                // again with savepoints, op by op, which says which one.
                let run = if savepoints { 0 } else { append_run(&ops[i..]) };
                if run >= 2 {
                    let group: Vec<&AuditAppend> = ops[i..i + run]
                        .iter()
                        .filter_map(|o| match o {
                            Op::AppendAudit(a) => Some(a),
                            _ => None,
                        })
                        .collect();
                    if let Some(f) = fence.as_deref_mut() {
                        for a in &group {
                            match f.check(&mut tx, stmts, &a.model_id) {
                                Ok(()) => {}
                                Err(Failure::Db(e)) => return Err(Abort::Db(e)),
                                Err(Failure::Op(_)) => return Err(Abort::NeedsSavepoints),
                            }
                        }
                    }
                    match append_many(&mut tx, stmts, &group) {
                        Ok(true) => {
                            results.extend(group.iter().map(|_| Ok(())));
                            grouped_until = i + run;
                            continue;
                        }
                        Ok(false) | Err(Failure::Op(_)) => return Err(Abort::NeedsSavepoints),
                        Err(Failure::Db(e)) => match op_error(&e) {
                            Some(_) => return Err(Abort::NeedsSavepoints),
                            None => return Err(Abort::Db(e)),
                        },
                    }
                }
                if savepoints {
                    tx.batch_execute("SAVEPOINT op").map_err(Abort::Db)?;
                }
                let applied = match fence.as_deref_mut() {
                    Some(f) => fenced_apply(&mut tx, stmts, op, key.as_ref(), f),
                    None => apply(&mut tx, stmts, op, key.as_ref()),
                };
                let failed = match applied {
                    Ok(()) => {
                        if savepoints {
                            tx.batch_execute("RELEASE SAVEPOINT op")
                                .map_err(Abort::Db)?;
                        }
                        results.push(Ok(()));
                        continue;
                    }
                    // Refused by its own checks, or the fence, before it wrote anything.
                    Err(Failure::Op(e)) if !savepoints && checks_before_writing(op) => {
                        results.push(Err(e));
                        continue;
                    }
                    Err(Failure::Op(e)) => e,
                    Err(Failure::Db(e)) => match op_error(&e) {
                        Some(own) => own,
                        None => return Err(Abort::Db(e)),
                    },
                };
                if !savepoints {
                    return Err(Abort::NeedsSavepoints);
                }
                tx.batch_execute("ROLLBACK TO SAVEPOINT op; RELEASE SAVEPOINT op")
                    .map_err(Abort::Db)?;
                results.push(Err(failed));
            }
            committing = true;
            tx.commit().map_err(Abort::Db)
        })();
        match outcome {
            Ok(()) => {
                let wrote = results.iter().any(Result::is_ok);
                Ok((results, self.durability == Durability::Strict && wrote))
            }
            Err(Abort::NeedsSavepoints) => Err(None),
            Err(Abort::Db(e)) => {
                // The transaction rolled back when it was dropped (or the connection is gone,
                // and the server rolls it back).
                let err = pg_err(target, e);
                if self.conn.as_ref().is_some_and(|c| c.client.is_closed()) {
                    self.conn = None;
                }
                Err(Some((err, committing)))
            }
        }
    }

    /// Session settings of the writer's connection.
    fn configure(&mut self) -> Result<(), postgres::Error> {
        let sync = match self.durability {
            Durability::Strict => "on",
            Durability::Relaxed => "off",
        };
        if let Some(c) = self.conn.as_mut() {
            c.client
                .batch_execute(&format!("SET synchronous_commit TO {sync}"))?;
        }
        Ok(())
    }

    /// The connection, reconnecting after a loss.
    fn conn(&mut self) -> Result<&mut Conn, StoreError> {
        if self.conn.as_ref().is_none_or(|c| c.client.is_closed()) {
            self.conn = Some(Conn::new(self.target.connect()?));
            self.configure().map_err(|e| pg_err(&self.target, e))?;
        }
        self.conn.as_mut().ok_or(StoreError::WriterStopped)
    }
}

impl Backend for PgBackend {
    fn execute(&mut self, ops: &[&Op]) -> Result<(Vec<Result<(), StoreError>>, bool), StoreError> {
        match self.try_batch(ops) {
            // The connection had died while idle (the server restarted): nothing of this batch
            // reached the server, so it runs again, once, on a new connection.
            Err((StoreError::Unavailable { .. }, false)) => {
                self.conn = None;
                self.try_batch(ops).map_err(|(e, _)| e)
            }
            other => other.map_err(|(e, _)| e),
        }
    }

    fn sync_for_flush(&mut self) -> Result<bool, StoreError> {
        if self.durability == Durability::Strict {
            return Ok(false); // every commit was already flushed
        }
        let target = self.target.clone();
        let conn = self.conn()?;
        // A commit that has an xid and is synchronous flushes the WAL up to itself, so every
        // earlier asynchronous commit too.
        conn.client
            .batch_execute(
                "BEGIN; SET LOCAL synchronous_commit TO on; SELECT txid_current(); COMMIT",
            )
            .map_err(|e| pg_err(&target, e))?;
        Ok(true)
    }
}

/// `apply`, after the fence passed for every model the op (or its parts) writes.
fn fenced_apply(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    op: &Op,
    key: Option<&AuditKey>,
    fence: &mut Fence,
) -> Result<(), Failure> {
    fn each<'a>(op: &'a Op, out: &mut Vec<&'a str>) {
        match op {
            Op::Atomic(ops) => ops.iter().for_each(|o| each(o, out)),
            other => out.extend(model_of(other)),
        }
    }
    if let Op::Release { model_id } = op {
        exec(
            tx,
            stmts,
            "UPDATE valem.owners SET released = true WHERE model_id = $1 AND node_id = $2",
            &[model_id, &fence.node],
        )?;
        return Ok(());
    }
    let mut models = Vec::new();
    each(op, &mut models);
    for m in models {
        fence.check(tx, stmts, m)?;
    }
    apply(tx, stmts, op, key)
}

type Stmts = HashMap<&'static str, Statement>;

/// The chain head of a model: `Ok(None)` when it has no record yet. Locks the model's row
/// until the batch commits.
fn head(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    model_id: &str,
) -> Result<Option<(u64, String)>, Failure> {
    let st = stmt(
        tx,
        stmts,
        "SELECT head_seq, head_hash FROM valem.models WHERE id = $1 FOR UPDATE",
    )?;
    let Some(row) = tx.query_opt(&st, &[&model_id])? else {
        return Err(Failure::Op(StoreError::ModelNotFound {
            model_id: model_id.to_string(),
        }));
    };
    let seq: Option<i64> = row.try_get(0)?;
    let hash: String = row.try_get(1)?;
    Ok(seq.map(|s| (s.max(0) as u64, hash)))
}

fn exec(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    sql: &'static str,
    params: &[&(dyn postgres::types::ToSql + Sync)],
) -> Result<u64, Failure> {
    let st = stmt(tx, stmts, sql)?;
    Ok(tx.execute(&st, params)?)
}

fn apply(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    op: &Op,
    key: Option<&AuditKey>,
) -> Result<(), Failure> {
    match op {
        Op::Atomic(ops) => {
            for o in ops {
                apply(tx, stmts, o, key)?;
            }
        }
        Op::PutModel {
            id,
            spec_text,
            version,
            at,
        } => {
            let (key_from, anchor) = match key {
                Some(k) => (Some(0i64), Some(chain::key_anchor(k, id, 0, GENESIS))),
                None => (None, None),
            };
            let (spec, spec_hash) = match crate::spec_text::split(id, spec_text) {
                Some(body) => {
                    let hash = blake3::hash(body.as_bytes()).to_hex().to_string();
                    exec(
                        tx,
                        stmts,
                        "INSERT INTO valem.spec_texts (hash, body) VALUES ($1, $2)
                         ON CONFLICT (hash) DO NOTHING",
                        &[&hash, &body],
                    )?;
                    ("", Some(hash))
                }
                None => (spec_text.as_str(), None),
            };
            let before = spec_hash_of(tx, stmts, id)?;
            exec(
                tx,
                stmts,
                "INSERT INTO valem.models (id, spec, version, created_us, updated_us, head_seq,
                     head_hash, key_from, key_anchor, spec_hash)
                 VALUES ($1, $2, $3, $4, $4, NULL, $5, $6, $7, $8)
                 ON CONFLICT (id) DO UPDATE SET spec = excluded.spec, version = excluded.version,
                     updated_us = excluded.updated_us, spec_hash = excluded.spec_hash",
                &[
                    id,
                    &spec,
                    version,
                    &at.us(),
                    &GENESIS,
                    &key_from,
                    &anchor,
                    &spec_hash,
                ],
            )?;
            if let Some(old) = before.filter(|b| Some(b) != spec_hash.as_ref()) {
                forget_spec_text(tx, stmts, &old)?;
            }
        }
        Op::DeleteModel { id } => {
            let before = spec_hash_of(tx, stmts, id)?;
            for sql in [
                "DELETE FROM valem.audit_paths WHERE model_id = $1",
                "DELETE FROM valem.audit WHERE model_id = $1",
                "DELETE FROM valem.checkpoints WHERE model_id = $1",
                "DELETE FROM valem.snapshots WHERE model_id = $1",
                "DELETE FROM valem.idempotency WHERE model_id = $1",
                "DELETE FROM valem.models WHERE id = $1",
            ] {
                exec(tx, stmts, sql, &[id])?;
            }
            if let Some(old) = before {
                forget_spec_text(tx, stmts, &old)?;
            }
        }
        Op::AppendAudit(a) => append_audit(tx, stmts, a)?,
        Op::Checkpoint {
            model_id,
            sequence,
            at,
            state,
            kind,
        } => put_checkpoint(tx, stmts, model_id, *sequence, at.us(), state, *kind, key)?,
        Op::PutSnapshot {
            model_id,
            snapshot_id,
            at,
            snapshot,
        } => {
            head(tx, stmts, model_id)?;
            exec(
                tx,
                stmts,
                "INSERT INTO valem.snapshots (model_id, snapshot_id, at_us, snapshot)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (model_id, snapshot_id) DO UPDATE
                 SET at_us = excluded.at_us, snapshot = excluded.snapshot",
                &[model_id, snapshot_id, &at.us(), &to_text(snapshot)?],
            )?;
        }
        Op::DeleteSnapshot {
            model_id,
            snapshot_id,
        } => {
            exec(
                tx,
                stmts,
                "DELETE FROM valem.snapshots WHERE model_id = $1 AND snapshot_id = $2",
                &[model_id, snapshot_id],
            )?;
        }
        Op::PutTask { id, record, at } => {
            exec(
                tx,
                stmts,
                "INSERT INTO valem.tasks (id, record, at_us) VALUES ($1, $2, $3)
                 ON CONFLICT (id) DO UPDATE SET record = excluded.record, at_us = excluded.at_us",
                &[id, record, &at.us()],
            )?;
        }
        // Only a fleet's node releases (see `fenced_apply`).
        Op::Release { .. } => {}
        Op::DeleteTask { id } => {
            exec(tx, stmts, "DELETE FROM valem.tasks WHERE id = $1", &[id])?;
        }
        Op::PutBlob(b) => {
            let size = i64::try_from(b.size).map_err(|_| {
                Failure::Op(StoreError::InvalidRecord {
                    detail: format!("blob size {} exceeds 2^63-1", b.size),
                })
            })?;
            exec(
                tx,
                stmts,
                "INSERT INTO valem.blobs (id, hash, size, media_type, filename, created_us)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (id) DO UPDATE SET hash = excluded.hash, size = excluded.size,
                     media_type = excluded.media_type, filename = excluded.filename,
                     created_us = excluded.created_us",
                &[
                    &b.id,
                    &b.hash,
                    &size,
                    &b.media_type,
                    &b.filename,
                    &b.created.us(),
                ],
            )?;
        }
    }
    Ok(())
}

/// Append one audit record: in sequence, chained to the stored head, its paths indexed, the
/// head moved in the same transaction. One statement when the record follows the head (the
/// usual case); when it does not, nothing is written and the head is read to say why.
fn append_audit(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    a: &AuditAppend,
) -> Result<(), Failure> {
    let seq = seq_param(a.sequence)?;
    let st = stmt(
        tx,
        stmts,
        "WITH h AS (
             UPDATE valem.models SET head_seq = $2::bigint, head_hash = $6
             WHERE id = $1 AND coalesce(head_seq, -1) = $2::bigint - 1 AND head_hash = $5
             RETURNING id
         ), a AS (
             INSERT INTO valem.audit (model_id, sequence, at_us, record, prev_hash, hash)
             SELECT $1, $2::bigint, $3::bigint, $4, $5, $6 FROM h
         ), p AS (
             INSERT INTO valem.audit_paths (model_id, path, sequence)
             SELECT $1, x, $2::bigint FROM h, unnest($7::text[]) AS x
             ON CONFLICT DO NOTHING
         )
         SELECT count(*) FROM h",
    )?;
    let moved: i64 = tx
        .query_one(
            &st,
            &[
                &a.model_id,
                &seq,
                &a.at_us,
                &a.text,
                &a.prev_hash,
                &a.hash,
                &a.paths,
            ],
        )?
        .try_get(0)?;
    if moved == 1 {
        if let Some(k) = &a.keyed {
            exec(
                tx,
                stmts,
                "INSERT INTO valem.idempotency (model_id, key, sequence, request, answer)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (model_id, key) DO UPDATE SET sequence = excluded.sequence,
                     request = excluded.request, answer = excluded.answer",
                &[&a.model_id, &k.key, &seq, &k.request, &k.answer],
            )?;
        }
        return Ok(());
    }
    let expected = head(tx, stmts, &a.model_id)?.map_or(0, |(s, _)| s + 1);
    if a.sequence != expected {
        return Err(Failure::Op(StoreError::OutOfSequence {
            model_id: a.model_id.clone(),
            expected,
            got: a.sequence,
        }));
    }
    Err(Failure::Op(StoreError::ChainMismatch {
        model_id: a.model_id.clone(),
        sequence: a.sequence,
    }))
}

/// How many ops from the start of `ops` are appends to distinct models (a model's second
/// append in a batch must follow its first, which one statement cannot order).
fn append_run(ops: &[&Op]) -> usize {
    let mut seen = HashSet::new();
    ops.iter()
        .take_while(|o| matches!(o, Op::AppendAudit(a) if seen.insert(a.model_id.as_str())))
        .count()
}

/// Append `group` (records of distinct models) in one statement: every record follows its
/// model's stored head, its paths and idempotency key written with it; `Ok(false)` when one did
/// not follow its head (then what the statement wrote must be rolled back).
fn append_many(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    group: &[&AuditAppend],
) -> Result<bool, Failure> {
    let mut models = Vec::with_capacity(group.len());
    let mut seqs = Vec::with_capacity(group.len());
    let (mut ats, mut texts, mut prevs, mut hashes) = (vec![], vec![], vec![], vec![]);
    let (mut path_models, mut paths, mut path_seqs) = (vec![], vec![], vec![]);
    let (mut key_models, mut keys, mut key_seqs, mut requests, mut answers) =
        (vec![], vec![], vec![], vec![], vec![]);
    for a in group {
        let seq = seq_param(a.sequence)?;
        models.push(a.model_id.as_str());
        seqs.push(seq);
        ats.push(a.at_us);
        texts.push(a.text.as_str());
        prevs.push(a.prev_hash.as_str());
        hashes.push(a.hash.as_str());
        for p in &a.paths {
            path_models.push(a.model_id.as_str());
            paths.push(p.as_str());
            path_seqs.push(seq);
        }
        if let Some(k) = &a.keyed {
            key_models.push(a.model_id.as_str());
            keys.push(k.key.as_str());
            key_seqs.push(seq);
            requests.push(k.request.as_str());
            answers.push(k.answer.as_str());
        }
    }
    let st = stmt(
        tx,
        stmts,
        "WITH i AS (
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[],
                 $5::text[], $6::text[]) AS t(model_id, seq, at_us, record, prev_hash, hash)
         ), h AS (
             UPDATE valem.models m SET head_seq = i.seq, head_hash = i.hash FROM i
             WHERE m.id = i.model_id AND coalesce(m.head_seq, -1) = i.seq - 1
                 AND m.head_hash = i.prev_hash
             RETURNING m.id
         ), a AS (
             INSERT INTO valem.audit (model_id, sequence, at_us, record, prev_hash, hash)
             SELECT i.model_id, i.seq, i.at_us, i.record, i.prev_hash, i.hash
             FROM i JOIN h ON h.id = i.model_id
         ), p AS (
             INSERT INTO valem.audit_paths (model_id, path, sequence)
             SELECT x.model_id, x.path, x.seq
             FROM unnest($7::text[], $8::text[], $9::bigint[]) AS x(model_id, path, seq)
                 JOIN h ON h.id = x.model_id
             ON CONFLICT DO NOTHING
         ), k AS (
             INSERT INTO valem.idempotency (model_id, key, sequence, request, answer)
             SELECT y.model_id, y.key, y.seq, y.request, y.answer
             FROM unnest($10::text[], $11::text[], $12::bigint[], $13::text[], $14::text[])
                 AS y(model_id, key, seq, request, answer)
                 JOIN h ON h.id = y.model_id
             ON CONFLICT (model_id, key) DO UPDATE SET sequence = excluded.sequence,
                 request = excluded.request, answer = excluded.answer
         )
         SELECT count(*) FROM h",
    )?;
    let moved: i64 = tx
        .query_one(
            &st,
            &[
                &models,
                &seqs,
                &ats,
                &texts,
                &prevs,
                &hashes,
                &path_models,
                &paths,
                &path_seqs,
                &key_models,
                &keys,
                &key_seqs,
                &requests,
                &answers,
            ],
        )?
        .try_get(0)?;
    Ok(moved == group.len() as i64)
}

/// Store a checkpoint of `model_id` after record `sequence` (`None`: before the first),
/// hashed over its state and the record it follows (see `Op::Checkpoint`).
#[allow(clippy::too_many_arguments)]
fn put_checkpoint(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    model_id: &str,
    sequence: Option<Seq>,
    at_us: i64,
    state: &Json,
    kind: CheckpointKind,
    key: Option<&AuditKey>,
) -> Result<(), Failure> {
    let head = head(tx, stmts, model_id)?;
    let seq = checkpoint_seq(model_id, sequence, head.as_ref().map(|(s, _)| *s))?;
    if kind == CheckpointKind::Periodic {
        let existing = text_cell(
            tx,
            stmts,
            "SELECT kind FROM valem.checkpoints WHERE model_id = $1 AND sequence = $2",
            &[&model_id, &seq],
        )?;
        if existing.is_some_and(|k| CheckpointKind::parse(&k) != Some(CheckpointKind::Periodic)) {
            return Ok(());
        }
    }
    let head_hash = match (sequence.map(Seq::get), head) {
        (None, _) => GENESIS.to_string(),
        (Some(s), Some((h, hash))) if s == h => hash,
        (Some(s), _) => text_cell(
            tx,
            stmts,
            "SELECT hash FROM valem.audit WHERE model_id = $1 AND sequence = $2",
            &[&model_id, &seq],
        )?
        .ok_or_else(|| record_not_stored(model_id, s))?,
    };
    let SealedCheckpoint {
        text,
        state_hash,
        hash,
    } = seal_checkpoint(key, model_id, sequence, at_us, kind, &head_hash, state)?;
    exec(
        tx,
        stmts,
        "INSERT INTO valem.checkpoints
             (model_id, sequence, at_us, state, kind, head_hash, state_hash, hash)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
         ON CONFLICT (model_id, sequence) DO UPDATE SET at_us = excluded.at_us,
             state = excluded.state, kind = excluded.kind, head_hash = excluded.head_hash,
             state_hash = excluded.state_hash, hash = excluded.hash",
        &[
            &model_id,
            &seq,
            &at_us,
            &text,
            &kind.as_str(),
            &head_hash,
            &state_hash,
            &hash,
        ],
    )?;
    if kind.is_base() {
        exec(
            tx,
            stmts,
            "UPDATE valem.models SET base_seq = $2 WHERE id = $1",
            &[&model_id, &seq],
        )?;
    }
    // The model's idempotency keys past the newest KEYS_KEPT are forgotten.
    exec(
        tx,
        stmts,
        "DELETE FROM valem.idempotency WHERE model_id = $1 AND sequence <
             (SELECT sequence FROM valem.idempotency WHERE model_id = $1
              ORDER BY sequence DESC LIMIT 1 OFFSET $2)",
        &[&model_id, &(crate::KEYS_KEPT as i64 - 1)],
    )?;
    Ok(())
}

/// The spec text model `id`'s row names (`None`: no row, or a text kept whole).
fn spec_hash_of(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    id: &str,
) -> Result<Option<String>, Failure> {
    text_cell(
        tx,
        stmts,
        "SELECT spec_hash FROM valem.models WHERE id = $1",
        &[&id],
    )
}

/// The one text column `sql` selects (`None`: no row, or NULL there).
fn text_cell(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    sql: &'static str,
    params: &[&(dyn postgres::types::ToSql + Sync)],
) -> Result<Option<String>, Failure> {
    let st = stmt(tx, stmts, sql)?;
    Ok(tx
        .query_opt(&st, params)?
        .map(|r| r.try_get::<_, Option<String>>(0))
        .transpose()?
        .flatten())
}

/// Drop spec text `hash` when no model names it any more.
fn forget_spec_text(
    tx: &mut Transaction<'_>,
    stmts: &mut Stmts,
    hash: &str,
) -> Result<(), Failure> {
    exec(
        tx,
        stmts,
        "DELETE FROM valem.spec_texts WHERE hash = $1
         AND NOT EXISTS (SELECT 1 FROM valem.models WHERE spec_hash = $1)",
        &[&hash],
    )?;
    Ok(())
}
