//! The PostgreSQL store's reads: models, audit records (streamed through a portal, or
//! filtered), snapshots, tasks, blobs, and the verification of a model's chain and
//! checkpoints, each in one read-only REPEATABLE READ transaction (one snapshot).

use std::ops::ControlFlow;

use postgres::types::ToSql;
use postgres::{IsolationLevel, Transaction};
use serde_json::Value as Json;

use super::{checkpoint_row, record_hash_of, PgStore};
use crate::chain::{self, AuditRow, BrokenCheckpoint, ChainHead, ChainReport, Seq};
use crate::checkpoints::{self, CheckpointChoice, COLUMNS};
use crate::{
    AuditEntry, AuditFilter, BlobMeta, StoreError, StoredKey, StoredModel, StoredSnapshot,
    Timestamp, DEFAULT_QUERY_LIMIT, KEYS_KEPT, MAX_QUERY_LIMIT,
};

/// Rows fetched per round trip when streaming.
const FETCH_ROWS: i32 = 512;

const MODEL_COLUMNS: &str = "m.id, m.spec, m.version, m.created_us, m.updated_us, m.head_seq,
    m.head_hash, s.body FROM valem.models m LEFT JOIN valem.spec_texts s ON s.hash = m.spec_hash";

fn stored_model(r: &postgres::Row) -> Result<StoredModel, postgres::Error> {
    let id: String = r.try_get(0)?;
    let spec_text = match r.try_get::<_, Option<String>>(7)? {
        Some(body) => crate::spec_text::join(&id, &body),
        None => r.try_get(1)?,
    };
    Ok(StoredModel {
        id,
        spec_text,
        version: r.try_get(2)?,
        created: Timestamp::from_us(r.try_get(3)?),
        updated: Timestamp::from_us(r.try_get(4)?),
        head_seq: r
            .try_get::<_, Option<i64>>(5)?
            .map(|s| Seq::new(s.max(0) as u64)),
        head_hash: r.try_get(6)?,
    })
}

/// A read-only transaction over one snapshot.
fn snapshot<'a>(c: &'a mut postgres::Client) -> Result<Transaction<'a>, postgres::Error> {
    c.build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
}

/// Stream the rows `sql` yields through a portal, `FETCH_ROWS` at a time; `f` returns `false`
/// to stop.
fn stream(
    tx: &mut Transaction<'_>,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
    mut f: impl FnMut(&postgres::Row) -> Result<bool, StoreError>,
) -> Result<Result<(), StoreError>, postgres::Error> {
    let portal = tx.bind(sql, params)?;
    loop {
        let rows = tx.query_portal(&portal, FETCH_ROWS)?;
        let done = rows.len() < FETCH_ROWS as usize;
        for r in &rows {
            match f(r) {
                Ok(true) => {}
                Ok(false) => return Ok(Ok(())),
                Err(e) => return Ok(Err(e)),
            }
        }
        if done {
            return Ok(Ok(()));
        }
    }
}

impl PgStore {
    /// Every stored model.
    pub fn load_models(&self) -> Result<Vec<StoredModel>, StoreError> {
        self.with_reader(|c| {
            c.client
                .query(&format!("SELECT {MODEL_COLUMNS} ORDER BY m.id"), &[])?
                .iter()
                .map(stored_model)
                .collect()
        })
    }

    /// One stored model, `None` when the store does not hold it.
    pub fn load_model(&self, id: &str) -> Result<Option<StoredModel>, StoreError> {
        self.with_reader(|c| {
            c.client
                .query_opt(&format!("SELECT {MODEL_COLUMNS} WHERE m.id = $1"), &[&id])?
                .as_ref()
                .map(stored_model)
                .transpose()
        })
    }

    /// The ids of the stored models, in order; only those whose stored spec text contains
    /// `needle` when one is given.
    pub fn model_ids(&self, needle: Option<&str>) -> Result<Vec<String>, StoreError> {
        self.with_reader(|c| {
            let rows = c.client.query(
                "SELECT m.id FROM valem.models m LEFT JOIN valem.spec_texts s
                     ON s.hash = m.spec_hash
                 WHERE $1::text IS NULL OR strpos(coalesce(s.body, m.spec), $1::text) > 0
                 ORDER BY m.id",
                &[&needle],
            )?;
            rows.iter().map(|r| r.try_get(0)).collect()
        })
    }

    /// Stream a model's records with sequence > `after` (all when `None`) oldest first,
    /// stopping before the first committed after `up_to`, or when `f` breaks; how many `f` saw.
    pub fn audit_after(
        &self,
        model_id: &str,
        after: Option<Seq>,
        up_to: Option<Timestamp>,
        f: &mut dyn FnMut(AuditEntry) -> ControlFlow<()>,
    ) -> Result<u64, StoreError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return self.audit_after_here(model_id, after, up_to, f);
        }
        // Inside a runtime: the records are read on a thread of their own and handed over
        // here, where `f` (which need not be Send) sees them; a break stops the reader.
        let (tx, rx) = std::sync::mpsc::sync_channel::<AuditEntry>(FETCH_ROWS as usize);
        std::thread::scope(|s| {
            let reader = s.spawn(move || {
                self.audit_after_here(model_id, after, up_to, &mut |e| match tx.send(e) {
                    Ok(()) => ControlFlow::Continue(()),
                    Err(_) => ControlFlow::Break(()),
                })
            });
            let mut seen = 0u64;
            while let Ok(e) = rx.recv() {
                seen += 1;
                if f(e).is_break() {
                    break;
                }
            }
            drop(rx);
            match reader.join() {
                Ok(r) => r.map(|_| seen),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    fn audit_after_here(
        &self,
        model_id: &str,
        after: Option<Seq>,
        up_to: Option<Timestamp>,
        f: &mut dyn FnMut(AuditEntry) -> ControlFlow<()>,
    ) -> Result<u64, StoreError> {
        let up_to_us = up_to.map(Timestamp::us);
        let after: i64 = match after {
            None => -1,
            Some(s) => i64::try_from(s.get()).unwrap_or(i64::MAX),
        };
        let mut seen = 0u64;
        let inner = self.with_reader_here(|c| {
            if seen > 0 {
                // A retry after the connection died mid-stream would deliver records twice.
                return Ok(Err(StoreError::Unavailable {
                    path: self.target.label(),
                    detail: format!("the connection was lost after {seen} records"),
                }));
            }
            let mut tx = snapshot(&mut c.client)?;
            let r = stream(
                &mut tx,
                "SELECT sequence, at_us, record FROM valem.audit
                 WHERE model_id = $1 AND sequence > $2 ORDER BY sequence",
                &[&model_id, &after],
                |r| {
                    let corrupt = |e: postgres::Error| StoreError::Corrupt {
                        path: self.target.label(),
                        detail: e.to_string(),
                    };
                    let seq: i64 = r.try_get(0).map_err(corrupt)?;
                    let at_us: i64 = r.try_get(1).map_err(corrupt)?;
                    if up_to_us.is_some_and(|t| at_us > t) {
                        return Ok(false);
                    }
                    let sequence = self.stored_seq(seq, model_id)?;
                    let text: String = r.try_get(2).map_err(corrupt)?;
                    let record = self.parse(&text, || {
                        format!("audit record {sequence} of model `{model_id}`")
                    })?;
                    seen += 1;
                    Ok(f(AuditEntry {
                        sequence: Seq::new(sequence),
                        at: Timestamp::from_us(at_us),
                        record,
                    })
                    .is_continue())
                },
            )?;
            tx.commit()?;
            Ok(r)
        })?;
        inner.map(|()| seen)
    }

    /// A model's records matching `filter`, newest first.
    pub fn query_audit(
        &self,
        model_id: &str,
        filter: &AuditFilter,
    ) -> Result<Vec<Json>, StoreError> {
        let limit = filter
            .limit
            .unwrap_or(DEFAULT_QUERY_LIMIT)
            .min(MAX_QUERY_LIMIT) as i64;
        let prefix = filter.path_prefix.clone().filter(|p| !p.is_empty());
        let upper = prefix.as_deref().and_then(crate::prefix_upper_bound);
        let (from, to) = (filter.from.map(Timestamp::us), filter.to.map(Timestamp::us));
        let mut sql = String::from("SELECT sequence, record FROM valem.audit WHERE model_id = $1");
        let mut args: Vec<&(dyn ToSql + Sync)> = vec![&model_id];
        if let Some(p) = &prefix {
            args.push(p);
            sql.push_str(&format!(
                " AND sequence IN (SELECT sequence FROM valem.audit_paths WHERE model_id = $1 AND path >= ${}",
                args.len()
            ));
            if let Some(u) = &upper {
                args.push(u);
                sql.push_str(&format!(" AND path < ${}", args.len()));
            }
            sql.push(')');
        }
        if let Some(from) = &from {
            args.push(from);
            sql.push_str(&format!(" AND at_us >= ${}", args.len()));
        }
        if let Some(to) = &to {
            args.push(to);
            sql.push_str(&format!(" AND at_us <= ${}", args.len()));
        }
        args.push(&limit);
        sql.push_str(&format!(" ORDER BY sequence DESC LIMIT ${}", args.len()));
        let rows = self.with_reader(|c| c.client.query(&sql, &args))?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let (seq, text): (i64, String) = (r.get(0), r.get(1));
            out.push(self.parse(&text, || {
                format!("audit record {seq} of model `{model_id}`")
            })?);
        }
        Ok(out)
    }

    /// The records of the tasks kept, oldest first.
    pub fn tasks(&self) -> Result<Vec<String>, StoreError> {
        self.with_reader(|c| {
            c.client
                .query("SELECT record FROM valem.tasks ORDER BY at_us, id", &[])?
                .iter()
                .map(|r| r.try_get(0))
                .collect()
        })
    }

    /// A model's idempotency keys, newest first (at most [`KEYS_KEPT`]).
    pub fn idempotency_keys(&self, model_id: &str) -> Result<Vec<StoredKey>, StoreError> {
        self.with_reader(|c| {
            c.client
                .query(
                    "SELECT key, request, sequence FROM valem.idempotency WHERE model_id = $1
                     ORDER BY sequence DESC LIMIT $2",
                    &[&model_id, &(KEYS_KEPT as i64)],
                )?
                .iter()
                .map(|r| {
                    Ok(StoredKey {
                        key: r.try_get(0)?,
                        request: r.try_get(1)?,
                        sequence: Seq::new(r.try_get::<_, i64>(2)?.max(0) as u64),
                    })
                })
                .collect()
        })
    }

    /// The answer a write made under `key` was given (`None`: no such key kept).
    pub fn idempotency_answer(
        &self,
        model_id: &str,
        key: &str,
    ) -> Result<Option<String>, StoreError> {
        self.with_reader(|c| {
            c.client
                .query_opt(
                    "SELECT answer FROM valem.idempotency WHERE model_id = $1 AND key = $2",
                    &[&model_id, &key],
                )?
                .map(|r| r.try_get(0))
                .transpose()
        })
    }

    /// A model's snapshots, oldest first.
    pub fn snapshots(&self, model_id: &str) -> Result<Vec<StoredSnapshot>, StoreError> {
        let rows = self.with_reader(|c| {
            c.client.query(
                "SELECT snapshot_id, at_us, snapshot FROM valem.snapshots WHERE model_id = $1
                 ORDER BY at_us, snapshot_id",
                &[&model_id],
            )
        })?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let (snapshot_id, at_us, text): (String, i64, String) = (r.get(0), r.get(1), r.get(2));
            let snapshot = self.parse(&text, || {
                format!("snapshot `{snapshot_id}` of model `{model_id}`")
            })?;
            out.push(StoredSnapshot {
                snapshot_id,
                at: Timestamp::from_us(at_us),
                snapshot,
            });
        }
        Ok(out)
    }

    /// Blob metadata by blob id.
    pub fn blob(&self, id: &str) -> Result<Option<BlobMeta>, StoreError> {
        self.with_reader(|c| {
            c.client
                .query_opt(
                    "SELECT id, hash, size, media_type, filename, created_us FROM valem.blobs
                     WHERE id = $1",
                    &[&id],
                )?
                .map(|r| {
                    Ok(BlobMeta {
                        id: r.try_get(0)?,
                        hash: r.try_get(1)?,
                        size: r.try_get::<_, i64>(2)?.max(0) as u64,
                        media_type: r.try_get(3)?,
                        filename: r.try_get(4)?,
                        created: Timestamp::from_us(r.try_get(5)?),
                    })
                })
                .transpose()
        })
    }

    /// Keep blob bytes (committed, synchronously, before this returns) under their blake3
    /// hash and return the hash. Idempotent; call before submitting `Op::PutBlob`.
    pub fn put_blob_bytes(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let size = bytes.len() as u64;
        if size > self.opts.max_blob_bytes {
            return Err(StoreError::BlobTooLarge {
                size,
                limit: self.opts.max_blob_bytes,
            });
        }
        let hash = blake3::hash(bytes).to_hex().to_string();
        self.with_reader(|c| {
            c.client.execute(
                "INSERT INTO valem.blob_bytes (hash, bytes) VALUES ($1, $2)
                 ON CONFLICT (hash) DO NOTHING",
                &[&hash, &bytes],
            )
        })?;
        Ok(hash)
    }

    /// Blob bytes by hash, checked against the hash (damaged bytes are `Corrupt`).
    pub fn blob_bytes(&self, hash: &str) -> Result<Vec<u8>, StoreError> {
        crate::check_blob_hash(hash)?;
        let limit = i64::try_from(self.opts.max_blob_bytes).unwrap_or(i64::MAX);
        let row = self.with_reader(|c| {
            c.client.query_opt(
                "SELECT octet_length(bytes)::bigint,
                        CASE WHEN octet_length(bytes) <= $2::bigint THEN bytes END
                 FROM valem.blob_bytes WHERE hash = $1",
                &[&hash, &limit],
            )
        })?;
        let Some(row) = row else {
            return Err(StoreError::BlobNotFound {
                hash: hash.to_string(),
            });
        };
        let len: i64 = row.get(0);
        let Some(bytes) = row.get::<_, Option<Vec<u8>>>(1) else {
            return Err(StoreError::BlobTooLarge {
                size: len.max(0) as u64,
                limit: self.opts.max_blob_bytes,
            });
        };
        if blake3::hash(&bytes).to_hex().as_str() != hash {
            return Err(StoreError::Corrupt {
                path: self.target.label(),
                detail: format!("the bytes of blob {hash} do not match their blake3 hash"),
            });
        }
        Ok(bytes)
    }

    /// The server answers and holds this build's schema (PostgreSQL checks its own pages).
    pub fn quick_check(&self) -> Result<(), StoreError> {
        let v: Option<i64> = self.with_reader(|c| {
            Ok(c.client
                .query_one("SELECT max(version) FROM valem.schema_version", &[])?
                .get(0))
        })?;
        match v {
            Some(v) if v <= super::SCHEMA_VERSION && v > 0 => Ok(()),
            other => Err(StoreError::Corrupt {
                path: self.target.label(),
                detail: format!(
                    "the schema version is {other:?}; this build writes {}",
                    super::SCHEMA_VERSION
                ),
            }),
        }
    }

    /// The model's registry row: head, base, keying.
    fn head_row(
        tx: &mut Transaction<'_>,
        model_id: &str,
    ) -> Result<Option<HeadRow>, postgres::Error> {
        tx.query_opt(
            "SELECT head_seq, head_hash, base_seq, key_from, key_anchor FROM valem.models
             WHERE id = $1",
            &[&model_id],
        )?
        .map(|r| {
            Ok(HeadRow {
                head_seq: r.try_get(0)?,
                head_hash: r.try_get(1)?,
                base_seq: r.try_get(2)?,
                key_from: r.try_get(3)?,
                key_anchor: r.try_get(4)?,
            })
        })
        .transpose()
    }

    /// Walk a model's stored audit chain oldest first (one snapshot) and check every link,
    /// hash and sequence against its head, then every checkpoint (as the SQLite store does).
    pub fn verify_chain(&self, model_id: &str) -> Result<ChainReport, StoreError> {
        let key = self.opts.audit_key;
        let out = self.with_reader(|c| {
            let mut tx = snapshot(&mut c.client)?;
            let Some(head) = Self::head_row(&mut tx, model_id)? else {
                return Ok(Err(StoreError::ModelNotFound {
                    model_id: model_id.to_string(),
                }));
            };
            // The records come a batch at a time through a portal.
            let portal = tx.bind(
                "SELECT sequence, prev_hash, hash, record FROM valem.audit WHERE model_id = $1
                 ORDER BY sequence",
                &[&model_id],
            )?;
            let mut batch: std::vec::IntoIter<postgres::Row> = Vec::new().into_iter();
            let mut exhausted = false;
            let mut rows = std::iter::from_fn(|| loop {
                if let Some(r) = batch.next() {
                    return Some(Ok(AuditRow {
                        sequence: r.try_get(0).unwrap_or(-1),
                        prev_hash: r.try_get(1).unwrap_or_default(),
                        hash: r.try_get(2).unwrap_or_default(),
                        record: r.try_get(3).unwrap_or_default(),
                    }));
                }
                if exhausted {
                    return None;
                }
                match tx.query_portal(&portal, FETCH_ROWS) {
                    Ok(next) => {
                        exhausted = next.len() < FETCH_ROWS as usize;
                        batch = next.into_iter();
                    }
                    Err(e) => return Some(Err(e)),
                }
            });
            let mut report = chain::walk_chain(
                key.as_ref(),
                model_id,
                &ChainHead {
                    head_seq: head.head_seq,
                    head_hash: &head.head_hash,
                    key_from: head.key_from,
                    key_anchor: head.key_anchor.as_deref(),
                },
                &mut rows,
            )?;
            let (checked, broken) = self.checkpoints_verdict(&mut tx, model_id, head.base_seq)?;
            checkpoints::fold_into(&mut report, checked, broken);
            tx.commit()?;
            Ok(Ok(report))
        })?;
        out
    }

    fn checkpoints_verdict(
        &self,
        tx: &mut Transaction<'_>,
        model_id: &str,
        base_seq: Option<i64>,
    ) -> Result<(u64, Option<BrokenCheckpoint>), postgres::Error> {
        let rows = tx.query(
            &format!(
                "SELECT {COLUMNS} FROM valem.checkpoints WHERE model_id = $1 ORDER BY sequence"
            ),
            &[&model_id],
        )?;
        let mut rows = rows.iter().map(checkpoint_row);
        checkpoints::verify_all(
            &mut rows,
            &mut |seq| record_hash_of(tx, model_id, seq),
            self.opts.audit_key.as_ref(),
            model_id,
            base_seq,
        )
    }

    /// How many of a model's checkpoints verify, and the first that does not.
    pub fn verify_model_checkpoints(
        &self,
        model_id: &str,
    ) -> Result<(u64, Option<BrokenCheckpoint>), StoreError> {
        self.with_reader(|c| {
            let mut tx = snapshot(&mut c.client)?;
            let Some(head) = Self::head_row(&mut tx, model_id)? else {
                return Ok(Err(StoreError::ModelNotFound {
                    model_id: model_id.to_string(),
                }));
            };
            let v = self.checkpoints_verdict(&mut tx, model_id, head.base_seq)?;
            tx.commit()?;
            Ok(Ok(v))
        })?
    }

    /// The newest checkpoint of `model_id` that verifies (at or before an instant, for
    /// `?at=`), as the SQLite store chooses it.
    pub fn usable_checkpoint(
        &self,
        model_id: &str,
        at_or_before: Option<Timestamp>,
    ) -> Result<CheckpointChoice, StoreError> {
        let at_or_before_us = at_or_before.map(Timestamp::us);
        let key = self.opts.audit_key;
        self.with_reader(|c| {
            let mut tx = snapshot(&mut c.client)?;
            let Some(head) = Self::head_row(&mut tx, model_id)? else {
                return Ok(Err(StoreError::ModelNotFound {
                    model_id: model_id.to_string(),
                }));
            };
            let base_at_us: Option<i64> = match (head.base_seq, at_or_before_us) {
                (Some(b), Some(_)) => tx
                    .query_opt(
                        "SELECT at_us FROM valem.checkpoints WHERE model_id = $1 AND sequence = $2",
                        &[&model_id, &b],
                    )?
                    .map(|r| r.try_get(0))
                    .transpose()?,
                _ => None,
            };
            let floor = checkpoints::floor(head.base_seq, at_or_before_us, base_at_us);
            let rows = match at_or_before_us {
                None => tx.query(
                    &format!(
                        "SELECT {COLUMNS} FROM valem.checkpoints WHERE model_id = $1
                         ORDER BY sequence DESC"
                    ),
                    &[&model_id],
                )?,
                Some(t) => tx.query(
                    &format!(
                        "SELECT {COLUMNS} FROM valem.checkpoints WHERE model_id = $1
                         AND at_us <= $2 ORDER BY at_us DESC, sequence DESC"
                    ),
                    &[&model_id, &t],
                )?,
            };
            let mut rows = rows.iter().map(checkpoint_row);
            let choice = checkpoints::choose(
                &mut rows,
                &mut |seq| record_hash_of(&mut tx, model_id, seq),
                key.as_ref(),
                model_id,
                floor,
            )?;
            tx.commit()?;
            Ok(choice)
        })?
    }
}

struct HeadRow {
    head_seq: Option<i64>,
    head_hash: String,
    base_seq: Option<i64>,
    key_from: Option<i64>,
    key_anchor: Option<String>,
}
