//! How a store is marked keyed, checked on open: the `meta` row `audit_key` holds the key's
//! fingerprint ([`AuditKey::fingerprint`]), and each model its `key_from` (the first record
//! hashed with the key) and `key_anchor` ([`chain::key_anchor`]). Opening a keyed store without
//! its key, or with another key, is an error naming the fingerprint; opening an unkeyed store
//! with a key adopts it: from each model's next record on its hashes are keyed, each anchor
//! binds the chain head at that moment (so the plain records before it cannot be rewritten
//! without the key either), and checkpoints whose plain hashes verify are rehashed with the key.
//! The adoption is trust on first use: what the store held when the key arrived is what the
//! key vouches for. A key is never removed.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use super::chain::{self, AuditKey, GENESIS};
use super::{checkpoints, sql_err, StoreError};

/// What adopting a key did: the models whose records are keyed from a sequence on, and the
/// checkpoints rehashed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyAdoption {
    /// `(model id, first keyed sequence)`, by id.
    pub models: Vec<(String, u64)>,
    /// Checkpoints whose hashes are now keyed (the rest did not verify and stay refused).
    pub checkpoints_rehashed: u64,
}

const META_KEY: &str = "audit_key";

/// Check the store's key marking against `key`; adopt `key` in an unkeyed store.
pub(super) fn settle(
    conn: &mut Connection,
    db: &Path,
    key: Option<&AuditKey>,
) -> Result<Option<KeyAdoption>, StoreError> {
    let q = |e| sql_err(db, e);
    let marked: Option<String> = conn
        .query_row("SELECT value FROM meta WHERE key = ?1", [META_KEY], |r| {
            r.get(0)
        })
        .optional()
        .map_err(q)?;
    let anchored: i64 = conn
        .query_row(
            "SELECT count(*) FROM models WHERE key_anchor IS NOT NULL",
            [],
            |r| r.get(0),
        )
        .map_err(q)?;
    let unmarked_but_anchored = || {
        StoreError::Corrupt {
        path: db.to_path_buf(),
        detail: format!(
            "{anchored} model(s) carry audit key anchors but the store has no key fingerprint (its `meta` row was removed); restore the database from a backup"
        ),
    }
    };
    match (marked, key) {
        (None, None) if anchored > 0 => Err(unmarked_but_anchored()),
        (None, None) => Ok(None),
        (Some(fingerprint), None) => Err(StoreError::AuditKeyRequired {
            path: db.to_path_buf(),
            fingerprint,
        }),
        (Some(expected), Some(k)) => {
            let given = k.fingerprint();
            if expected == given {
                Ok(None)
            } else {
                Err(StoreError::AuditKeyMismatch {
                    path: db.to_path_buf(),
                    expected,
                    given,
                })
            }
        }
        // Re-adopting over anchors would bless whatever was written since they were removed.
        (None, Some(_)) if anchored > 0 => Err(unmarked_but_anchored()),
        (None, Some(k)) => adopt(conn, db, k).map(Some),
    }
}

fn adopt(conn: &mut Connection, db: &Path, key: &AuditKey) -> Result<KeyAdoption, StoreError> {
    let q = |e| sql_err(db, e);
    let tx = conn.transaction().map_err(q)?;
    let models: Vec<(String, Option<i64>, String)> = {
        let mut st = tx
            .prepare("SELECT id, head_seq, head_hash FROM models ORDER BY id")
            .map_err(q)?;
        let rows = st
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .map_err(q)?;
        rows.collect::<Result<_, _>>().map_err(q)?
    };
    let mut adoption = KeyAdoption::default();
    for (id, head_seq, head_hash) in models {
        let (from, prev) = match head_seq {
            Some(h) => ((h.max(0) as u64) + 1, head_hash.as_str()),
            None => (0, GENESIS),
        };
        let anchor = chain::key_anchor(key, &id, from, prev);
        let from_param = i64::try_from(from).unwrap_or(i64::MAX);
        tx.execute(
            "UPDATE models SET key_from = ?2, key_anchor = ?3 WHERE id = ?1",
            params![id, from_param, anchor],
        )
        .map_err(q)?;
        adoption.models.push((id, from));
    }
    adoption.checkpoints_rehashed = checkpoints::rehash_keyed(&tx, key).map_err(q)?;
    tx.execute(
        "INSERT INTO meta (key, value) VALUES (?1, ?2)",
        params![META_KEY, key.fingerprint()],
    )
    .map_err(q)?;
    tx.commit().map_err(q)?;
    Ok(adoption)
}
