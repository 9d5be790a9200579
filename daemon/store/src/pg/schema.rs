//! The PostgreSQL store's schema: every table in the schema `valem` of the database the URL
//! names, as numbered migration steps. `valem.schema_version` holds the number of steps
//! applied; nodes that start together serialise on an advisory lock, and each step commits with
//! its version (PostgreSQL's DDL is transactional). Never edit a released step: add one.

use postgres::Client;

use super::{pg_err, PgTarget};
use crate::StoreError;

/// The advisory lock that serialises migrations of nodes sharing one database ("valem" + 1).
const MIGRATION_LOCK: i64 = 0x7661_6c65_6d01;

/// Migration steps; step `i` takes the version from `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[V1, V2, V3];

// v1: what the SQLite store holds at its v5, in PostgreSQL's types, plus blob bytes (a fleet
// has no shared directory). Ids, paths and hashes compare bytewise (COLLATE "C"), as SQLite's
// BINARY does: prefix ranges over `audit_paths.path` and id order depend on it.
const V1: &str = r#"
    CREATE TABLE valem.meta (key TEXT COLLATE "C" PRIMARY KEY, value TEXT NOT NULL);
    INSERT INTO valem.meta (key, value) VALUES ('format', 'valem-store');
    CREATE TABLE valem.spec_texts (hash TEXT COLLATE "C" PRIMARY KEY, body TEXT NOT NULL);
    CREATE TABLE valem.models (
        id TEXT COLLATE "C" PRIMARY KEY,
        spec TEXT NOT NULL,
        version TEXT NOT NULL,
        created_us BIGINT NOT NULL,
        updated_us BIGINT NOT NULL,
        head_seq BIGINT,
        head_hash TEXT NOT NULL,
        base_seq BIGINT,
        key_from BIGINT,
        key_anchor TEXT,
        spec_hash TEXT COLLATE "C"
    );
    CREATE INDEX models_spec_hash ON valem.models (spec_hash) WHERE spec_hash IS NOT NULL;
    CREATE TABLE valem.audit (
        model_id TEXT COLLATE "C" NOT NULL,
        sequence BIGINT NOT NULL,
        at_us BIGINT NOT NULL,
        record TEXT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL,
        PRIMARY KEY (model_id, sequence)
    );
    CREATE INDEX audit_at ON valem.audit (model_id, at_us);
    CREATE TABLE valem.audit_paths (
        model_id TEXT COLLATE "C" NOT NULL,
        path TEXT COLLATE "C" NOT NULL,
        sequence BIGINT NOT NULL,
        PRIMARY KEY (model_id, path, sequence)
    );
    CREATE TABLE valem.checkpoints (
        model_id TEXT COLLATE "C" NOT NULL,
        sequence BIGINT NOT NULL,
        at_us BIGINT NOT NULL,
        state TEXT NOT NULL,
        kind TEXT NOT NULL,
        head_hash TEXT,
        state_hash TEXT,
        hash TEXT,
        PRIMARY KEY (model_id, sequence)
    );
    CREATE INDEX checkpoints_at ON valem.checkpoints (model_id, at_us);
    CREATE TABLE valem.snapshots (
        model_id TEXT COLLATE "C" NOT NULL,
        snapshot_id TEXT COLLATE "C" NOT NULL,
        at_us BIGINT NOT NULL,
        snapshot TEXT NOT NULL,
        PRIMARY KEY (model_id, snapshot_id)
    );
    CREATE TABLE valem.blobs (
        id TEXT COLLATE "C" PRIMARY KEY,
        hash TEXT NOT NULL,
        size BIGINT NOT NULL,
        media_type TEXT NOT NULL,
        filename TEXT,
        created_us BIGINT NOT NULL
    );
    CREATE INDEX blobs_hash ON valem.blobs (hash);
    CREATE TABLE valem.blob_bytes (hash TEXT COLLATE "C" PRIMARY KEY, bytes BYTEA NOT NULL);
    CREATE TABLE valem.tasks (
        id TEXT COLLATE "C" PRIMARY KEY,
        record TEXT NOT NULL,
        at_us BIGINT NOT NULL
    );
    "#;

// v2: a fleet's nodes, each with the lease it renews (one row per node, whatever its number of
// models), and the owner of each model with an epoch one higher at every change of owner. A
// model's claim holds while its owner node's lease does and it was not released; every commit
// that touches a model checks, in its transaction, that the committing node still holds that
// epoch (fencing). Times are the database's clock (µs since the epoch), so nodes' clocks need
// not agree.
const V2: &str = r#"
    CREATE TABLE valem.nodes (
        id TEXT COLLATE "C" PRIMARY KEY,
        url TEXT NOT NULL,
        started_us BIGINT NOT NULL,
        seen_us BIGINT NOT NULL,
        lease_until_us BIGINT NOT NULL
    );
    CREATE TABLE valem.owners (
        model_id TEXT COLLATE "C" PRIMARY KEY,
        node_id TEXT COLLATE "C" NOT NULL,
        epoch BIGINT NOT NULL,
        released BOOLEAN NOT NULL DEFAULT false
    );
    CREATE INDEX owners_node ON valem.owners (node_id);
    "#;

// v3: writes made under an idempotency key, as the SQLite store's v6 keeps them.
const V3: &str = r#"
    CREATE TABLE valem.idempotency (
        model_id TEXT COLLATE "C" NOT NULL,
        key TEXT COLLATE "C" NOT NULL,
        sequence BIGINT NOT NULL,
        request TEXT NOT NULL,
        answer TEXT NOT NULL,
        PRIMARY KEY (model_id, key)
    );
    CREATE INDEX idempotency_seq ON valem.idempotency (model_id, sequence);
    "#;

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Bring the database's `valem` schema to [`SCHEMA_VERSION`] (creating it in an empty
/// database); refuse one written by a newer build.
pub(super) fn migrate(client: &mut Client, target: &PgTarget) -> Result<(), StoreError> {
    let q = |e| pg_err(target, e);
    let mut tx = client.transaction().map_err(q)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .map_err(q)?;
    tx.batch_execute(
        "CREATE SCHEMA IF NOT EXISTS valem;
         CREATE TABLE IF NOT EXISTS valem.schema_version (version BIGINT NOT NULL);",
    )
    .map_err(q)?;
    let found: Option<i64> = tx
        .query_opt("SELECT max(version) FROM valem.schema_version", &[])
        .map_err(q)?
        .and_then(|r| r.get(0));
    let found = found.unwrap_or(0);
    if found > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            path: target.label(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    for version in found..SCHEMA_VERSION {
        let fail = |e: postgres::Error| StoreError::Migration {
            path: target.label(),
            to_version: version + 1,
            detail: e.to_string(),
        };
        tx.batch_execute(MIGRATIONS[version as usize])
            .map_err(fail)?;
        tx.execute("DELETE FROM valem.schema_version", &[])
            .map_err(fail)?;
        tx.execute(
            "INSERT INTO valem.schema_version (version) VALUES ($1)",
            &[&(version + 1)],
        )
        .map_err(fail)?;
    }
    tx.commit().map_err(q)
}
