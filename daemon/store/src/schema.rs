//! The store's SQLite schema as numbered migration steps (`PRAGMA user_version` is the number of
//! steps applied) and the pre-open check of the database file that refuses a torn main file
//! instead of letting SQLite treat it as an empty database. Never edit a released step: add one.

use std::fs;
use std::io::Read;
use std::path::Path;

use rusqlite::{Connection, Transaction};

use super::{sql_err, StoreError};

/// One migration step: SQL, then (for what SQL cannot compute, such as hashes) a function run in
/// the same transaction.
pub(super) struct Step {
    sql: &'static str,
    then: Option<fn(&Transaction<'_>) -> rusqlite::Result<()>>,
}

/// Migration steps; step `i` takes `user_version` from `i` to `i + 1`.
pub(super) const MIGRATIONS: &[Step] = &[
    Step {
        sql: V1,
        then: None,
    },
    Step {
        sql: V2,
        then: None,
    },
    Step {
        sql: V3,
        then: Some(hash_legacy_checkpoints),
    },
    Step {
        sql: V4,
        then: None,
    },
    Step {
        sql: V5,
        then: None,
    },
    Step {
        sql: V6,
        then: None,
    },
];

// v1: the registry and the hash-chained audit log.
const V1: &str = r#"
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
    INSERT INTO meta (key, value) VALUES ('format', 'valem-store');
    CREATE TABLE models (
        id TEXT PRIMARY KEY,
        spec TEXT NOT NULL,
        version TEXT NOT NULL,
        created_us INTEGER NOT NULL,
        updated_us INTEGER NOT NULL,
        head_seq INTEGER,
        head_hash TEXT NOT NULL
    );
    CREATE TABLE audit (
        model_id TEXT NOT NULL,
        sequence INTEGER NOT NULL,
        at_us INTEGER NOT NULL,
        record TEXT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL,
        PRIMARY KEY (model_id, sequence)
    );
    CREATE INDEX audit_at ON audit (model_id, at_us);
    "#;

// v2: indexed pathPrefix queries (backfilled from the records: mutation keys, derived updates
// and trace targets, as the service indexes them), checkpoints, snapshots, blobs.
const V2: &str = r#"
    CREATE TABLE audit_paths (
        model_id TEXT NOT NULL,
        path TEXT NOT NULL,
        sequence INTEGER NOT NULL,
        PRIMARY KEY (model_id, path, sequence)
    ) WITHOUT ROWID;
    INSERT OR IGNORE INTO audit_paths (model_id, path, sequence)
        SELECT a.model_id, j.key, a.sequence FROM audit a, json_each(a.record, '$.mutations') j
        WHERE json_valid(a.record);
    INSERT OR IGNORE INTO audit_paths (model_id, path, sequence)
        SELECT a.model_id, j.value, a.sequence FROM audit a, json_each(a.record, '$.derivedUpdated') j
        WHERE json_valid(a.record) AND j.type = 'text';
    INSERT OR IGNORE INTO audit_paths (model_id, path, sequence)
        SELECT a.model_id, json_extract(j.value, '$.targetPath'), a.sequence
        FROM audit a, json_each(a.record, '$.traces') j
        WHERE json_valid(a.record) AND json_type(j.value, '$.targetPath') = 'text';
    CREATE TABLE checkpoints (
        model_id TEXT NOT NULL,
        sequence INTEGER NOT NULL,
        at_us INTEGER NOT NULL,
        state TEXT NOT NULL,
        PRIMARY KEY (model_id, sequence)
    );
    CREATE INDEX checkpoints_at ON checkpoints (model_id, at_us);
    CREATE TABLE snapshots (
        model_id TEXT NOT NULL,
        snapshot_id TEXT NOT NULL,
        at_us INTEGER NOT NULL,
        snapshot TEXT NOT NULL,
        PRIMARY KEY (model_id, snapshot_id)
    );
    CREATE TABLE blobs (
        id TEXT PRIMARY KEY,
        hash TEXT NOT NULL,
        size INTEGER NOT NULL,
        media_type TEXT NOT NULL,
        filename TEXT,
        created_us INTEGER NOT NULL
    );
    CREATE INDEX blobs_hash ON blobs (hash);
    "#;

// v3: checkpoints bound to the chain (kind, the chain head they follow, the hash of their state,
// their own hash over those); the model's newest base checkpoint (`base_seq`: recovery never
// falls back below it) and, in a keyed store, where keying starts and its anchor. Checkpoints
// written before v3 are hashed once by `hash_legacy_checkpoints` (trust on first use: they were
// never verifiable, and skipping them would lose the states restores and evolves set) and kept
// as kind `legacy`, which recovery treats as a base: the newest of them is the model's floor.
const V3: &str = r#"
    ALTER TABLE checkpoints ADD COLUMN kind TEXT NOT NULL DEFAULT 'legacy';
    ALTER TABLE checkpoints ADD COLUMN head_hash TEXT;
    ALTER TABLE checkpoints ADD COLUMN state_hash TEXT;
    ALTER TABLE checkpoints ADD COLUMN hash TEXT;
    ALTER TABLE models ADD COLUMN base_seq INTEGER;
    ALTER TABLE models ADD COLUMN key_from INTEGER;
    ALTER TABLE models ADD COLUMN key_anchor TEXT;
    UPDATE models SET base_seq =
        (SELECT max(c.sequence) FROM checkpoints c WHERE c.model_id = models.id);
    "#;

// v4: the tasks of MCP's tasks extension (one JSON record each, replaced as the task moves).
const V4: &str = r#"
    CREATE TABLE tasks (
        id TEXT PRIMARY KEY,
        record TEXT NOT NULL,
        at_us INTEGER NOT NULL
    ) WITHOUT ROWID;
    "#;

// v5: spec texts kept once per content. A model written from v5 on has `spec` empty and
// `spec_hash` naming its spec's text without the id (`spec_texts.body`: what follows
// `{"id":<id>` in the text); its text is that id and body again. Rows written before keep their
// whole text in `spec` (`spec_hash` NULL).
const V5: &str = r#"
    CREATE TABLE spec_texts (
        hash TEXT PRIMARY KEY,
        body TEXT NOT NULL
    ) WITHOUT ROWID;
    ALTER TABLE models ADD COLUMN spec_hash TEXT;
    CREATE INDEX models_spec_hash ON models (spec_hash) WHERE spec_hash IS NOT NULL;
    "#;

// v6: writes made under an idempotency key, each committed with its record: the key, the
// blake3 of the request it came with, the record's sequence and the answer given (see
// `crate::KeyedWrite`). A model keeps the newest `crate::KEYS_KEPT`; older ones go at its
// checkpoints.
const V6: &str = r#"
    CREATE TABLE idempotency (
        model_id TEXT NOT NULL,
        key TEXT NOT NULL,
        sequence INTEGER NOT NULL,
        request TEXT NOT NULL,
        answer TEXT NOT NULL,
        PRIMARY KEY (model_id, key)
    ) WITHOUT ROWID;
    CREATE INDEX idempotency_seq ON idempotency (model_id, sequence);
    "#;

/// Hash every checkpoint as it stands (plain blake3: a store before v3 has no key). A checkpoint
/// whose record is not stored keeps no hashes, so it is refused (and reported) like a tampered
/// one.
fn hash_legacy_checkpoints(tx: &Transaction<'_>) -> rusqlite::Result<()> {
    let rows: Vec<(String, i64, i64, Vec<u8>)> = {
        let mut st = tx.prepare("SELECT model_id, sequence, at_us, state FROM checkpoints")?;
        let rows = st.query_map([], |r| {
            let state = r.get_ref(3)?;
            let bytes = state.as_bytes().map(<[u8]>::to_vec).unwrap_or_default();
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, bytes))
        })?;
        rows.collect::<Result<_, _>>()?
    };
    let mut record_hash =
        tx.prepare("SELECT hash FROM audit WHERE model_id = ?1 AND sequence = ?2")?;
    let mut update = tx.prepare(
        "UPDATE checkpoints SET head_hash = ?3, state_hash = ?4, hash = ?5
         WHERE model_id = ?1 AND sequence = ?2",
    )?;
    for (model_id, seq, at_us, state) in rows {
        let head: Option<String> = if seq == -1 {
            Some(super::GENESIS.to_string())
        } else {
            rusqlite::OptionalExtension::optional(
                record_hash.query_row(rusqlite::params![model_id, seq], |r| r.get(0)),
            )?
        };
        let Some(head) = head else { continue };
        let state_hash = super::chain::state_hash(&state);
        let hash = super::chain::checkpoint_hash(
            None,
            &super::chain::CheckpointHeader {
                model_id: &model_id,
                sequence: u64::try_from(seq).ok().map(super::Seq::new),
                at_us,
                kind: super::CheckpointKind::Legacy.as_str(),
                head_hash: &head,
                state_hash: &state_hash,
            },
        );
        update.execute(rusqlite::params![model_id, seq, head, state_hash, hash])?;
    }
    Ok(())
}

/// The schema version this build writes.
pub(super) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Apply the steps from the database's `user_version` up to `target`, each in its own transaction.
pub(super) fn migrate(conn: &mut Connection, db: &Path, target: i64) -> Result<(), StoreError> {
    let found: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| sql_err(db, e))?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            path: db.to_path_buf(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    for version in found..target.min(SCHEMA_VERSION) {
        let step = &MIGRATIONS[version as usize];
        let fail = |e: rusqlite::Error| StoreError::Migration {
            path: db.to_path_buf(),
            to_version: version + 1,
            detail: e.to_string(),
        };
        let tx = conn.transaction().map_err(fail)?;
        tx.execute_batch(step.sql).map_err(fail)?;
        if let Some(then) = step.then {
            then(&tx).map_err(fail)?;
        }
        tx.pragma_update(None, "user_version", version + 1)
            .map_err(fail)?;
        tx.commit().map_err(fail)?;
    }
    Ok(())
}

/// What the pre-open look at the database file found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum FileState {
    /// No database yet (missing or empty file, no WAL content, no store marker).
    Fresh,
    /// Header intact and the file as long as the header says.
    Sound,
    /// Shorter than the header says while the WAL holds frames: legitimate after a crash in the
    /// middle of a checkpoint (the WAL still has those pages), so SQLite's own check decides.
    NeedsCheck,
}

const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// Look at `db` before SQLite does: SQLite treats a file shorter than one page as an empty
/// database and would build a fresh schema over a torn one. `marker` exists once a store was
/// created in this directory.
pub(super) fn check_file(db: &Path, wal: &Path, marker: &Path) -> Result<FileState, StoreError> {
    let wal_len = fs::metadata(wal).map(|m| m.len()).unwrap_or(0);
    let len = match fs::metadata(db) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(StoreError::io(db, e)),
    };
    if len == 0 {
        if marker.exists() || wal_len > 0 {
            return Err(StoreError::Corrupt {
                path: db.to_path_buf(),
                detail: format!(
                    "the database is missing or empty although {} shows a store was created here{}; restore it from a backup, or remove {} (and the -wal file) to start an empty store",
                    marker.display(),
                    if wal_len > 0 { " and its WAL holds data" } else { "" },
                    marker.display()
                ),
            });
        }
        return Ok(FileState::Fresh);
    }
    let mut header = [0u8; 100];
    let read = fs::File::open(db)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => StoreError::Corrupt {
                path: db.to_path_buf(),
                detail: format!(
                    "the file is {len} bytes, shorter than the 100-byte SQLite header (torn)"
                ),
            },
            _ => StoreError::io(db, e),
        });
    read?;
    if &header[..16] != SQLITE_MAGIC {
        return Err(StoreError::Corrupt {
            path: db.to_path_buf(),
            detail: "not a SQLite database (bad header)".into(),
        });
    }
    let be32 = |at: usize| {
        u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let page_size = match u16::from_be_bytes([header[16], header[17]]) {
        1 => 65536u64,
        n => u64::from(n),
    };
    let pages = u64::from(be32(28));
    // The in-header size is valid when the change counter equals version-valid-for (always, for
    // files written by SQLite ≥ 3.7.0).
    if be32(24) != be32(92) || pages == 0 {
        return Ok(FileState::NeedsCheck);
    }
    let expected = pages * page_size;
    if len >= expected {
        return Ok(FileState::Sound);
    }
    if wal_len > 0 {
        return Ok(FileState::NeedsCheck);
    }
    Err(StoreError::Corrupt {
        path: db.to_path_buf(),
        detail: format!(
            "truncated: the header says {pages} pages ({expected} bytes) but the file has {len} bytes and there is no WAL to supply the rest"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_apply_in_order_and_a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("x.db");
        let mut conn = Connection::open(&db).expect("open");
        migrate(&mut conn, &db, 1).expect("v1");
        let v: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(v, 1);
        migrate(&mut conn, &db, SCHEMA_VERSION).expect("latest");
        let n: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_schema WHERE name = 'blobs'",
                [],
                |r| r.get(0),
            )
            .expect("schema");
        assert_eq!(n, 1);
        conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .expect("bump");
        let err = migrate(&mut conn, &db, SCHEMA_VERSION).expect_err("too new");
        assert!(
            matches!(err, StoreError::SchemaTooNew { found, .. } if found == SCHEMA_VERSION + 1)
        );
        assert!(err.to_string().contains("x.db"), "{err}");
    }

    #[test]
    fn torn_or_foreign_files_are_refused_before_sqlite_sees_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (db, wal, marker) = (
            dir.path().join("a.db"),
            dir.path().join("a.db-wal"),
            dir.path().join("m"),
        );
        assert_eq!(
            check_file(&db, &wal, &marker).expect("fresh"),
            FileState::Fresh
        );
        fs::write(&db, b"SQLite format 3\0short").expect("write");
        let err = check_file(&db, &wal, &marker).expect_err("torn header");
        assert!(
            err.to_string().contains("a.db") && err.to_string().contains("torn"),
            "{err}"
        );
        fs::write(&db, vec![b'x'; 4096]).expect("write");
        assert!(check_file(&db, &wal, &marker)
            .expect_err("foreign")
            .to_string()
            .contains("not a SQLite"));
        fs::write(&db, b"").expect("write");
        fs::write(&marker, b"").expect("write");
        assert!(check_file(&db, &wal, &marker)
            .expect_err("emptied")
            .to_string()
            .contains("missing or empty"));
    }
}
