//! Checkpoints bound to the chain: each row carries its kind, the hash of the record it follows
//! (`head_hash`), the blake3 of its state text (`state_hash`) and its own hash over those
//! ([`chain::checkpoint_hash`]). This module checks a row against the chain, chooses the
//! checkpoint a recovery or an `?at=` read starts from, and verifies every checkpoint of a model
//! for `verify_audit`. It never writes (the writer hashes what it stores).
//!
//! Which fallbacks are sound: a *periodic* checkpoint (every N records, at shutdown) holds the
//! state a replay of its records gives, so a refused one is skipped for an older one, or for the
//! spec's initial state. A *base* checkpoint (a restore, an evolve) holds a state no record
//! reproduces: recovery never goes below the model's newest one (`models.base_seq`, written with
//! it), and a refused base is an error ([`StoreError::CheckpointUnusable`]) rather than a wrong
//! state. A row's kind is covered by its hash, but a refused row's kind cannot be trusted: the
//! `base_seq` floor is what guards the newest base when a row was edited.

use rusqlite::{params, Connection, OptionalExtension};
use serde_json::Value as Json;

use super::chain::{self, AuditKey, BrokenCheckpoint, CheckpointHeader, GENESIS};
use super::{sql_err, Seq, SqliteStore, StoreError, StoredCheckpoint, Timestamp};

/// What a checkpoint's state is, and so whether recovery may fall back past it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointKind {
    /// The state after its record, as a replay gives it (every N records, at shutdown).
    Periodic,
    /// A state set outside the records (a restore, an evolve): the records after it apply to it.
    Base,
    /// Written before schema v3: its kind is unknown, so it is treated as a base.
    Legacy,
}

impl CheckpointKind {
    /// The stored form.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointKind::Periodic => "periodic",
            CheckpointKind::Base => "base",
            CheckpointKind::Legacy => "legacy",
        }
    }

    /// From the stored form (`None`: not a kind this build writes).
    pub fn parse(s: &str) -> Option<CheckpointKind> {
        match s {
            "periodic" => Some(CheckpointKind::Periodic),
            "base" => Some(CheckpointKind::Base),
            "legacy" => Some(CheckpointKind::Legacy),
            _ => None,
        }
    }

    /// Whether no earlier checkpoint or replay reproduces its state.
    pub fn is_base(self) -> bool {
        self != CheckpointKind::Periodic
    }
}

/// Why a checkpoint does not verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckpointFault {
    /// It has no hashes (the v3 migration found no record to bind it to).
    Unhashed,
    /// Its state text does not hash to its `state_hash`.
    StateHash,
    /// The record it follows is not stored.
    RecordMissing { sequence: Seq },
    /// Its `head_hash` is not the hash of the record it follows (or not the genesis).
    HeadHash { sequence: Option<Seq> },
    /// Its hash does not cover its fields; `unkeyed`: it is the plain hash, made without the key.
    Hash { unkeyed: bool },
    /// It verifies but its state is not JSON, or its row is not one this build wrote.
    Unreadable(String),
}

impl CheckpointFault {
    /// A short label (the `/metrics` reason).
    pub fn label(&self) -> &'static str {
        match self {
            CheckpointFault::Unhashed => "unhashed",
            CheckpointFault::StateHash => "state_hash",
            CheckpointFault::RecordMissing { .. } => "record_missing",
            CheckpointFault::HeadHash { .. } => "head_hash",
            CheckpointFault::Hash { .. } => "checkpoint_hash",
            CheckpointFault::Unreadable(_) => "unreadable",
        }
    }

    /// Every label, in a fixed order.
    pub const LABELS: [&'static str; 6] = [
        "unhashed",
        "state_hash",
        "record_missing",
        "head_hash",
        "checkpoint_hash",
        "unreadable",
    ];
}

impl std::fmt::Display for CheckpointFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointFault::Unhashed => {
                f.write_str("it has no hashes (the record it follows was missing when the store was migrated to schema v3)")
            }
            CheckpointFault::StateHash => {
                f.write_str("its state does not match its state hash (the state was edited or damaged)")
            }
            CheckpointFault::RecordMissing { sequence } => {
                write!(f, "record {sequence}, which it follows, is not stored")
            }
            CheckpointFault::HeadHash { sequence: Some(s) } => write!(
                f,
                "the chain head it names is not record {s}'s hash (its head hash was edited, or the record rewritten)"
            ),
            CheckpointFault::HeadHash { sequence: None } => {
                f.write_str("the chain head it names is not the genesis (its head hash was edited)")
            }
            CheckpointFault::Hash { unkeyed: true } => f.write_str(
                "its hash was made without this store's audit key (rewritten by someone without it)",
            ),
            CheckpointFault::Hash { unkeyed: false } => f.write_str(
                "its hash does not cover its fields (its sequence, time, kind, head hash or state hash was edited)",
            ),
            CheckpointFault::Unreadable(why) => write!(f, "it cannot be read: {why}"),
        }
    }
}

/// A checkpoint skipped by [`SqliteStore::usable_checkpoint`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusedCheckpoint {
    /// The record it claims to follow (`None`: before the first).
    pub sequence: Option<Seq>,
    /// What did not match.
    pub fault: CheckpointFault,
}

/// The checkpoint to start from and the newer ones refused on the way to it.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointChoice {
    /// The newest checkpoint that verifies (`None`: start from the spec's initial state).
    pub checkpoint: Option<StoredCheckpoint>,
    /// Refused checkpoints, newest first.
    pub refused: Vec<RefusedCheckpoint>,
}

/// "the checkpoint after record N" / "the checkpoint before the first record".
pub fn describe(sequence: Option<Seq>) -> String {
    match sequence {
        Some(s) => format!("the checkpoint after record {s}"),
        None => "the checkpoint before the first record".to_string(),
    }
}

pub(crate) struct Row {
    pub(crate) sequence: i64,
    pub(crate) at_us: i64,
    pub(crate) state: Vec<u8>,
    pub(crate) kind: String,
    pub(crate) head_hash: Option<String>,
    pub(crate) state_hash: Option<String>,
    pub(crate) hash: Option<String>,
}

impl Row {
    fn sequence(&self) -> Option<Seq> {
        u64::try_from(self.sequence).ok().map(Seq::new)
    }
}

pub(crate) const COLUMNS: &str = "sequence, at_us, state, kind, head_hash, state_hash, hash";

fn read_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    // Read as bytes: a flipped bit may leave the text invalid UTF-8, which is a refusal, not a
    // read error.
    let state = r
        .get_ref(2)?
        .as_bytes()
        .map(<[u8]>::to_vec)
        .unwrap_or_default();
    let kind = r.get_ref(3)?.as_str().unwrap_or_default().to_string();
    Ok(Row {
        sequence: r.get(0)?,
        at_us: r.get(1)?,
        state,
        kind,
        head_hash: r.get(4)?,
        state_hash: r.get(5)?,
        hash: r.get(6)?,
    })
}

/// Check `row` against its own hashes and the chain; its state parsed (when `parse`) if it
/// verifies. `record_hash(seq)` is the stored hash of the model's record `seq` (`None`: not
/// stored).
pub(crate) fn verify_row<E>(
    record_hash: &mut dyn FnMut(i64) -> Result<Option<String>, E>,
    key: Option<&AuditKey>,
    model_id: &str,
    row: &Row,
    parse: bool,
) -> Result<Result<Json, CheckpointFault>, E> {
    if row.sequence < -1 {
        return Ok(Err(CheckpointFault::Unreadable(format!(
            "it is stored at invalid sequence {}",
            row.sequence
        ))));
    }
    let (Some(head), Some(state_hash), Some(hash)) = (&row.head_hash, &row.state_hash, &row.hash)
    else {
        return Ok(Err(CheckpointFault::Unhashed));
    };
    if chain::state_hash(&row.state) != *state_hash {
        return Ok(Err(CheckpointFault::StateHash));
    }
    let sequence = row.sequence();
    let actual: Option<String> = match sequence {
        None => Some(GENESIS.to_string()),
        Some(_) => record_hash(row.sequence)?,
    };
    match (actual, sequence) {
        (None, Some(s)) => return Ok(Err(CheckpointFault::RecordMissing { sequence: s })),
        (Some(a), _) if a != *head => return Ok(Err(CheckpointFault::HeadHash { sequence })),
        _ => {}
    }
    let header = CheckpointHeader {
        model_id,
        sequence,
        at_us: row.at_us,
        kind: &row.kind,
        head_hash: head,
        state_hash,
    };
    if chain::checkpoint_hash(key, &header) != *hash {
        let unkeyed = key.is_some() && chain::checkpoint_hash(None, &header) == *hash;
        return Ok(Err(CheckpointFault::Hash { unkeyed }));
    }
    if CheckpointKind::parse(&row.kind).is_none() {
        return Ok(Err(CheckpointFault::Unreadable(format!(
            "its kind `{}` is not one this build knows",
            row.kind
        ))));
    }
    if !parse {
        return Ok(Ok(Json::Null));
    }
    Ok(serde_json::from_slice(&row.state)
        .map_err(|e| CheckpointFault::Unreadable(format!("its state is not valid JSON: {e}"))))
}

/// The stored hash of `model_id`'s record `seq` (SQLite).
fn sqlite_record_hash<'c>(
    c: &'c Connection,
    model_id: &str,
) -> impl FnMut(i64) -> rusqlite::Result<Option<String>> + 'c {
    let model_id = model_id.to_string();
    move |seq| {
        c.prepare_cached("SELECT hash FROM audit WHERE model_id = ?1 AND sequence = ?2")?
            .query_row(params![model_id, seq], |r| r.get(0))
            .optional()
    }
}

/// The keyed hash of `row` when its plain hashes verify (`lookup`: as for [`verify_row`]), for
/// adopting a key: `None` leaves the row refused as it was.
pub(crate) fn rekeyed_hash<E>(
    lookup: &mut dyn FnMut(i64) -> Result<Option<String>, E>,
    key: &AuditKey,
    model: &str,
    row: &Row,
) -> Result<Option<String>, E> {
    if verify_row(lookup, None, model, row, false)?.is_err() {
        return Ok(None);
    }
    let (Some(head), Some(state_hash)) = (&row.head_hash, &row.state_hash) else {
        return Ok(None);
    };
    Ok(Some(chain::checkpoint_hash(
        Some(key),
        &CheckpointHeader {
            model_id: model,
            sequence: row.sequence(),
            at_us: row.at_us,
            kind: &row.kind,
            head_hash: head,
            state_hash,
        },
    )))
}

/// Rehash with `key` every checkpoint whose plain hashes verify (adopting a key); how many.
pub(super) fn rehash_keyed(c: &Connection, key: &AuditKey) -> rusqlite::Result<u64> {
    let rows: Vec<(String, Row)> = {
        let mut st = c.prepare(&format!("SELECT {COLUMNS}, model_id FROM checkpoints"))?;
        let rows = st.query_map([], |r| Ok((r.get(7)?, read_row(r)?)))?;
        rows.collect::<Result<_, _>>()?
    };
    let mut n = 0;
    for (model, row) in rows {
        let Some(hash) = rekeyed_hash(&mut sqlite_record_hash(c, &model), key, &model, &row)?
        else {
            continue;
        };
        c.prepare_cached("UPDATE checkpoints SET hash = ?3 WHERE model_id = ?1 AND sequence = ?2")?
            .execute(params![model, row.sequence, hash])?;
        n += 1;
    }
    Ok(n)
}

/// The checkpoint recovery starts from among `rows` (newest first, as
/// [`SqliteStore::usable_checkpoint`] orders them), under the base floor `floor`.
pub(crate) fn choose<E>(
    rows: &mut dyn Iterator<Item = Result<Row, E>>,
    lookup: &mut dyn FnMut(i64) -> Result<Option<String>, E>,
    key: Option<&AuditKey>,
    model_id: &str,
    floor: Option<i64>,
) -> Result<Result<CheckpointChoice, StoreError>, E> {
    let missing_base = |f: i64| StoreError::CheckpointUnusable {
        model_id: model_id.to_string(),
        sequence: u64::try_from(f).ok().map(Seq::new),
        detail:
            "it is missing (deleted), although the model names it as its newest restore or evolve"
                .into(),
    };
    let mut refused = Vec::new();
    for row in rows {
        let row = row?;
        if let Some(f) = floor.filter(|f| row.sequence < *f) {
            return Ok(Err(missing_base(f)));
        }
        match verify_row(lookup, key, model_id, &row, true)? {
            Ok(state) => {
                return Ok(Ok(CheckpointChoice {
                    checkpoint: Some(StoredCheckpoint {
                        sequence: row.sequence(),
                        at: Timestamp::from_us(row.at_us),
                        state,
                        kind: CheckpointKind::parse(&row.kind).unwrap_or(CheckpointKind::Legacy),
                    }),
                    refused,
                }))
            }
            Err(fault) => {
                let base_kind =
                    CheckpointKind::parse(&row.kind).is_none_or(CheckpointKind::is_base);
                if floor == Some(row.sequence) || base_kind {
                    return Ok(Err(StoreError::CheckpointUnusable {
                        model_id: model_id.to_string(),
                        sequence: row.sequence(),
                        detail: fault.to_string(),
                    }));
                }
                refused.push(RefusedCheckpoint {
                    sequence: row.sequence(),
                    fault,
                });
            }
        }
    }
    if let Some(f) = floor {
        return Ok(Err(missing_base(f)));
    }
    Ok(Ok(CheckpointChoice {
        checkpoint: None,
        refused,
    }))
}

/// The base floor of a choice: the model's newest base (`base`), unless an `?at=` read
/// (`at_or_before_us`) is older than when that base was taken (`base_at_us`).
pub(crate) fn floor(
    base: Option<i64>,
    at_or_before_us: Option<i64>,
    base_at_us: Option<i64>,
) -> Option<i64> {
    match (base, at_or_before_us) {
        (None, _) => None,
        (Some(b), None) => Some(b),
        (Some(b), Some(t)) => match base_at_us {
            Some(a) if a > t => None,
            _ => Some(b),
        },
    }
}

/// Verify every checkpoint among `rows` (oldest first) and that the newest base `base_seq` is
/// among them: how many were checked and the first that does not verify.
pub(crate) fn verify_all<E>(
    rows: &mut dyn Iterator<Item = Result<Row, E>>,
    lookup: &mut dyn FnMut(i64) -> Result<Option<String>, E>,
    key: Option<&AuditKey>,
    model_id: &str,
    base_seq: Option<i64>,
) -> Result<(u64, Option<BrokenCheckpoint>), E> {
    let (mut checked, mut broken, mut base_seen) = (0u64, None, false);
    for row in rows {
        let row = row?;
        checked += 1;
        base_seen |= base_seq == Some(row.sequence);
        if broken.is_some() {
            continue;
        }
        if let Err(fault) = verify_row(lookup, key, model_id, &row, false)? {
            broken = Some(BrokenCheckpoint {
                sequence: row.sequence(),
                detail: fault.to_string(),
            });
        }
    }
    if let Some(b) = base_seq.filter(|_| !base_seen) {
        let sequence = u64::try_from(b).ok();
        let earlier = broken
            .as_ref()
            .is_none_or(|x: &BrokenCheckpoint| x.sequence.map_or(-1, |s| s.get() as i64) > b);
        if earlier {
            broken = Some(BrokenCheckpoint {
                sequence: sequence.map(Seq::new),
                detail: "it is missing (deleted), although the model names it as its newest restore or evolve".into(),
            });
        }
    }
    Ok((checked, broken))
}

/// Add the checkpoints' verdict to a chain's report: the first broken one breaks the chain
/// when nothing before it did.
pub(crate) fn fold_into(
    report: &mut chain::ChainReport,
    checked: u64,
    broken: Option<BrokenCheckpoint>,
) {
    report.checkpoints_checked = Some(checked);
    if let Some(b) = broken {
        if report.valid {
            report.valid = false;
            report.detail = format!("{}: {}", describe(b.sequence), b.detail);
        }
        report.broken_checkpoint = Some(b);
    }
}

impl SqliteStore {
    /// The newest checkpoint of `model_id` that verifies against its hashes, the stored
    /// state and the chain (`at_or_before`: the newest taken at or before that instant, for
    /// an `?at=` read), with the newer ones refused on the way (`checkpoint: None`: replay from
    /// the spec's initial state). Never falls back past a base checkpoint (see the module doc):
    /// a refused or missing one is [`StoreError::CheckpointUnusable`].
    pub fn usable_checkpoint(
        &self,
        model_id: &str,
        at_or_before: Option<Timestamp>,
    ) -> Result<CheckpointChoice, StoreError> {
        let at_or_before_us = at_or_before.map(Timestamp::us);
        let q = |e| sql_err(&self.db, e);
        self.with_reader(|c| {
            c.execute_batch("BEGIN").map_err(q)?;
            let base: Option<Option<i64>> = c
                .prepare_cached("SELECT base_seq FROM models WHERE id = ?1")
                .and_then(|mut s| s.query_row([model_id], |r| r.get(0)).optional())
                .map_err(q)?;
            let Some(base) = base else {
                return Err(StoreError::ModelNotFound {
                    model_id: model_id.to_string(),
                });
            };
            // The floor applies to an `?at=` read only at or after the base was taken.
            let base_at_us: Option<i64> = match (base, at_or_before_us) {
                (Some(b), Some(_)) => c
                    .prepare_cached(
                        "SELECT at_us FROM checkpoints WHERE model_id = ?1 AND sequence = ?2",
                    )
                    .and_then(|mut s| s.query_row(params![model_id, b], |r| r.get(0)).optional())
                    .map_err(q)?,
                _ => None,
            };
            let floor = floor(base, at_or_before_us, base_at_us);
            let mut st = match at_or_before_us {
                None => c.prepare_cached(&format!(
                    "SELECT {COLUMNS} FROM checkpoints WHERE model_id = ?1
                     ORDER BY sequence DESC"
                )),
                Some(_) => c.prepare_cached(&format!(
                    "SELECT {COLUMNS} FROM checkpoints WHERE model_id = ?1 AND at_us <= ?2
                     ORDER BY at_us DESC, sequence DESC"
                )),
            }
            .map_err(q)?;
            let rows = match at_or_before_us {
                None => st.query_map(params![model_id], read_row),
                Some(t) => st.query_map(params![model_id, t], read_row),
            }
            .map_err(q)?;
            let key = self.opts.audit_key.as_ref();
            let choice = choose(
                &mut rows.into_iter(),
                &mut sqlite_record_hash(c, model_id),
                key,
                model_id,
                floor,
            )
            .map_err(q)?;
            choice
        })
    }

    /// [`verify_checkpoints`](Self::verify_checkpoints) in a read snapshot of its own (the
    /// checkpoint part of `verify_chain`).
    pub fn verify_model_checkpoints(
        &self,
        model_id: &str,
    ) -> Result<(u64, Option<BrokenCheckpoint>), StoreError> {
        self.with_reader(|c| {
            c.execute_batch("BEGIN").map_err(|e| sql_err(&self.db, e))?;
            let base: Option<Option<i64>> = c
                .prepare_cached("SELECT base_seq FROM models WHERE id = ?1")
                .and_then(|mut s| s.query_row([model_id], |r| r.get(0)).optional())
                .map_err(|e| sql_err(&self.db, e))?;
            let Some(base) = base else {
                return Err(StoreError::ModelNotFound {
                    model_id: model_id.to_string(),
                });
            };
            self.verify_checkpoints(c, model_id, base)
        })
    }

    /// Verify every checkpoint of a model (oldest first) and that its newest base is stored:
    /// how many were checked and the first that does not verify.
    pub(super) fn verify_checkpoints(
        &self,
        c: &Connection,
        model_id: &str,
        base_seq: Option<i64>,
    ) -> Result<(u64, Option<BrokenCheckpoint>), StoreError> {
        let q = |e| sql_err(&self.db, e);
        let mut st = c
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM checkpoints WHERE model_id = ?1 ORDER BY sequence"
            ))
            .map_err(q)?;
        let rows = st.query_map([model_id], read_row).map_err(q)?;
        let verdict = verify_all(
            &mut rows.into_iter(),
            &mut sqlite_record_hash(c, model_id),
            self.opts.audit_key.as_ref(),
            model_id,
            base_seq,
        )
        .map_err(q);
        verdict
    }
}
