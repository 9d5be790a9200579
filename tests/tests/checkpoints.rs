//! Checkpoints and the audit key against the real binary and its real database: a checkpoint
//! edited with SQL (its state, its head hash, one flipped bit) is refused on restart, the
//! model comes back with its true state, the log and `/metrics` say so and `verify_audit` (REST
//! and MCP) reports it; a refused restore checkpoint keeps that model aside (not served, its
//! data untouched) instead of losing the restore, and the other models are served — on the
//! SQLite and the PostgreSQL store alike; with `--audit-key-file` (SQLite here; the PostgreSQL
//! store's keys are checked by its own tests), a consistent rewrite of the records with plain
//! blake3 is caught, and a missing, wrong or malformed key is a clear start-up error.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use valem_tests::backing::Backing;
use valem_tests::{metric, run, stderr, Daemon, Http};

fn data_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary data directory")
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// `valem serve --data-dir DIR EXTRA…`, listening.
fn start(dir: &Path, extra: &[&str]) -> Daemon {
    let mut args = vec!["--data-dir", utf8(dir)];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

/// `valem serve --data-dir DIR EXTRA…` expected to fail before listening: its stderr.
fn refused_start(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--data-dir", utf8(dir)];
    args.extend_from_slice(extra);
    let o = run(&args, None);
    assert!(!o.status.success(), "valem serve started: {}", stderr(&o));
    stderr(&o)
}

fn db(dir: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open(dir.join("valem.db")).expect("open the database")
}

const DEMO: &str = r#"{"id": "demo", "version": "1.0.0", "schema": {},
  "derivations": [{"path": "$.total", "expr": "price * qty"}]}"#;

/// A store holding `demo` with records 0..=6 (`$.price` 10..=16), checkpointed every 3 records
/// (after records 2 and 5) and at the clean stop (after 6); the state it ended with.
fn seven_records(b: &Backing, extra: &[&str]) -> Value {
    let mut args = vec!["--checkpoint-every", "3"];
    args.extend_from_slice(extra);
    let d = b.start(&args);
    let http = Http::new(&d);
    let r = http.post(
        "/models",
        &[("Content-Type", "application/json")],
        DEMO.as_bytes(),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    for i in 0..7 {
        let r = http.post_json(
            "/models/demo/mutations",
            &json!({"$.price": 10 + i, "$.qty": 2}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let state = http.get("/models/demo/state").json();
    assert_eq!(state["total"], json!(32), "{state}");
    assert!(d.terminate().success());
    let listed = b.count("SELECT CAST(count(*) * 100 + sum(sequence) AS BIGINT) FROM checkpoints");
    assert_eq!(
        listed,
        3 * 100 + 2 + 5 + 6,
        "checkpoints after records 2, 5 and 6"
    );
    state
}

/// [`seven_records`] in a data directory of its own (the audit key's tests).
fn seven_on_disk(extra: &[&str]) -> (tempfile::TempDir, Value) {
    let b = Backing::sqlite();
    let state = seven_records(&b, extra);
    let Backing::Sqlite(dir) = b else {
        panic!("a SQLite store")
    };
    (dir, state)
}

#[test]
fn an_edited_checkpoint_is_refused_and_the_model_recovers_its_true_state_sqlite() {
    edited_checkpoint(Backing::sqlite);
}

#[test]
fn an_edited_checkpoint_is_refused_and_the_model_recovers_its_true_state_postgres() {
    edited_checkpoint(Backing::postgres);
}

/// One bit: '6' (0x36) becomes '7' (0x37), still JSON, another price.
const FLIP_ONE_BIT: &str =
    "UPDATE checkpoints SET state = replace(state, '\"price\":16', '\"price\":17') WHERE sequence = 6";

fn edited_checkpoint(fresh: fn() -> Backing) {
    // (case, the edit, the refusal's reason label, what the log says)
    let cases = [
        (
            "state edited",
            "UPDATE checkpoints SET state = replace(state, '\"price\":16', '\"price\":99')
             WHERE sequence = 6",
            "state_hash",
            "state does not match its state hash",
        ),
        (
            "head hash edited",
            "UPDATE checkpoints SET head_hash =
                 (SELECT hash FROM audit WHERE sequence = 5) WHERE sequence = 6",
            "head_hash",
            "is not record 6's hash",
        ),
        ("one bit flipped", FLIP_ONE_BIT, "state_hash", "state hash"),
    ];
    for (case, tamper, reason, said) in cases {
        let b = fresh();
        let state = seven_records(&b, &[]);
        b.sql(tamper);
        let d = b.start(&[]);
        let http = Http::new(&d);
        assert_eq!(
            http.get("/models/demo/state").json(),
            state,
            "{case}: the state of the records, not of the edited checkpoint"
        );
        let log = d.stderr_with("refused");
        assert!(
            log.contains("the checkpoint after record 6 refused") && log.contains(said),
            "{case}: the log names the model's checkpoint and what mismatched: {log}"
        );
        assert!(
            log.contains("`demo`") && log.contains("the checkpoint after record 5 instead"),
            "{case}: {log}"
        );
        let refused = format!("valem_checkpoints_refused_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&http, &refused), Some(1.0), "{case}");
        let v = http.get("/models/demo/audit/verify").json();
        assert_eq!(v["valid"], json!(false), "{case}: {v}");
        assert_eq!(
            v["recordsChecked"],
            json!(7),
            "{case}: the records are sound: {v}"
        );
        assert_eq!(v["firstBrokenSequence"], Value::Null, "{case}: {v}");
        assert_eq!(v["brokenCheckpoint"]["sequence"], json!(6), "{case}: {v}");
        assert_eq!(v["checkpointsChecked"], json!(3), "{case}: {v}");
        assert!(
            v["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with("the checkpoint after record 6")),
            "{case}: {v}"
        );
        assert!(d.terminate().success());
    }

    // The same report through the embedded MCP server's verify_audit.
    let b = fresh();
    let state = seven_records(&b, &[]);
    b.sql(FLIP_ONE_BIT);
    let store = b.args();
    let mut m = valem_tests::Mcp::start(&b.with(&store, &[]), &[]);
    m.handshake("2025-06-18");
    let r = m.tool(2, "get_state", json!({"id": "demo"}));
    assert_eq!(r["structuredContent"], state, "{r}");
    let r = m.tool(3, "verify_audit", json!({"id": "demo"}));
    let v = &r["structuredContent"];
    assert_eq!(
        (
            v["valid"].clone(),
            v["brokenCheckpoint"]["sequence"].clone()
        ),
        (json!(false), json!(6)),
        "{r}"
    );
    let (status, _) = m.close(15);
    assert!(status.success());
}

valem_tests::on_both_stores!(
    a_refused_restore_checkpoint_keeps_that_model_aside_rather_than_lose_the_restore,
    refused_restore_checkpoint
);

fn refused_restore_checkpoint(b: &Backing) {
    let d = b.start(&[]);
    let http = Http::new(&d);
    for spec in [DEMO, &DEMO.replace("\"demo\"", "\"other\"")] {
        let r = http.post(
            "/models",
            &[("Content-Type", "application/json")],
            spec.as_bytes(),
        );
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let r = http.post_json(
        "/models/other/mutations",
        &json!({"$.price": 7, "$.qty": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = http.post_json("/models/demo/mutations", &json!({"$.price": 3, "$.qty": 2}));
    assert_eq!(r.status, 200, "{}", r.text());
    let snap = http.post_json("/models/demo/snapshot", &json!({})).json();
    let r = http.post_json("/models/demo/mutations", &json!({"$.price": 50}));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = http.post_json("/models/demo/restore", &snap);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(http.get("/models/demo/state").json()["price"], json!(3));
    assert!(d.terminate().success());

    // Untouched, the restore is what recovery starts from.
    let d = b.start(&[]);
    assert_eq!(
        Http::new(&d).get("/models/demo/state").json()["price"],
        json!(3)
    );
    assert!(d.terminate().success());
    // Edited, no replay can give its state back: that model is kept aside, says why, and is
    // never served a wrong state; the other model is served as it was.
    b.sql(
        "UPDATE checkpoints SET state = replace(state, '\"price\":3', '\"price\":4')
         WHERE kind = 'base'",
    );
    let d = b.start(&[]);
    let http = Http::new(&d);
    let r = http.get("/models/demo/state");
    assert_eq!(r.status, 503, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.contains("demo")
            && msg.contains("the checkpoint after record 1")
            && msg.contains("restore"),
        "{msg}"
    );
    assert_eq!(http.get("/models/other/state").json()["total"], json!(14));
    assert_eq!(http.get("/healthz").json()["unrecovered"], json!(1));
    assert_eq!(metric(&http, "valem_models_unrecovered"), Some(1.0));
    // Its id stays taken: a create cannot overwrite what is stored.
    let r = http.post(
        "/models",
        &[("Content-Type", "application/json")],
        DEMO.as_bytes(),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(d.stderr_with("could not be recovered").contains("demo"));
    assert!(d.terminate().success());
    // The edit is still there: nothing was rewritten over it.
    let kept = b.count(
        "SELECT count(*) FROM checkpoints WHERE kind = 'base' AND state LIKE '%\"price\":4%'",
    );
    assert_eq!(kept, 1);
}

// --- the audit key ---------------------------------------------------------------------------

const KEY: &str = "3d2f9c1a8b7e6d5c4b3a29181706f5e4d3c2b1a09f8e7d6c5b4a392817161514";

fn key_file(dir: &Path, name: &str, content: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).expect("write the key file");
    p
}

/// RFC 8785 for the records of these tests: object keys sorted (all ASCII here), no
/// whitespace, integers and strings as serde_json writes them.
fn canonical(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let members: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::from(k.as_str()), canonical(&m[k])))
                .collect();
            format!("{{{}}}", members.join(","))
        }
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(canonical).collect::<Vec<_>>().join(",")
        ),
        other => other.to_string(),
    }
}

/// Rewrite record 2's `$.price` and every record after it the way someone without the key
/// would: each hash recomputed with plain blake3, the hash columns and the chain head to match.
fn rewrite_with_plain_blake3(dir: &Path) {
    let c = db(dir);
    let mut records: Vec<Value> = {
        let mut st = c
            .prepare("SELECT record FROM audit WHERE model_id = 'demo' ORDER BY sequence")
            .expect("select");
        st.query_map([], |r| r.get::<_, String>(0))
            .expect("rows")
            .map(|t| serde_json::from_str(&t.expect("text")).expect("JSON"))
            .collect()
    };
    records[2]["mutations"]["$.price"] = json!(1000);
    let mut prev = records[1]["hash"].as_str().expect("a hash").to_string();
    for (seq, r) in records.iter_mut().enumerate().skip(2) {
        r["prevHash"] = json!(prev);
        let obj = r.as_object_mut().expect("an object");
        obj.remove("hash");
        let mut h = blake3::Hasher::new();
        h.update(prev.as_bytes());
        h.update(canonical(r).as_bytes());
        let hash = h.finalize().to_hex().to_string();
        r["hash"] = json!(hash);
        c.execute(
            "UPDATE audit SET record = ?1, prev_hash = ?2, hash = ?3
             WHERE model_id = 'demo' AND sequence = ?4",
            rusqlite::params![r.to_string(), prev, hash, seq as i64],
        )
        .expect("rewrite");
        prev = hash;
    }
    c.execute(
        "UPDATE models SET head_hash = ?1 WHERE id = 'demo'",
        [&prev],
    )
    .expect("head");
}

#[test]
fn a_keyed_store_catches_a_rewrite_without_the_key() {
    let keys = data_dir();
    let key = key_file(keys.path(), "audit.key", format!("{KEY}\n").as_bytes());
    let (dir, _) = seven_on_disk(&["--audit-key-file", utf8(&key)]);
    // The test's canonical form is the daemon's: on an unkeyed store the same rewrite passes
    // record verification (only the checkpoints, which name the old hashes, object).
    let (plain, _) = seven_on_disk(&[]);
    rewrite_with_plain_blake3(plain.path());
    let d = start(plain.path(), &[]);
    let v = Http::new(&d).get("/models/demo/audit/verify").json();
    assert_eq!(
        (
            v["recordsChecked"].clone(),
            v["firstBrokenSequence"].clone()
        ),
        (json!(7), Value::Null),
        "{v}"
    );
    assert!(d.terminate().success());

    // The keyed store: sound, then rewritten.
    let d = start(dir.path(), &["--audit-key-file", utf8(&key)]);
    let http = Http::new(&d);
    let v = http.get("/models/demo/audit/verify").json();
    assert_eq!(v["valid"], json!(true), "{v}");
    assert!(d.terminate().success());
    rewrite_with_plain_blake3(dir.path());
    // The key comes from the environment this time.
    let d = Daemon::start_env(
        &["--data-dir", utf8(dir.path())],
        &[("VALEM_AUDIT_KEY_FILE", utf8(&key))],
    );
    let v = Http::new(&d).get("/models/demo/audit/verify").json();
    assert_eq!(v["valid"], json!(false), "{v}");
    assert_eq!(v["firstBrokenSequence"], json!(2), "{v}");
    assert!(
        v["detail"]
            .as_str()
            .is_some_and(|d| d.contains("without this store's audit key")),
        "{v}"
    );
    assert!(d.terminate().success());
}

#[test]
fn a_keyed_store_refuses_to_start_without_its_key_or_with_a_bad_one() {
    let keys = data_dir();
    let key = key_file(keys.path(), "audit.key", KEY.as_bytes());
    let (dir, state) = seven_on_disk(&["--audit-key-file", utf8(&key)]);

    let err = refused_start(dir.path(), &[]);
    assert!(
        err.contains("is keyed") && err.contains("--audit-key-file"),
        "{err}"
    );
    let other = key_file(keys.path(), "other.key", &[7u8; 32]);
    let err = refused_start(dir.path(), &["--audit-key-file", utf8(&other)]);
    assert!(err.contains("another audit key"), "{err}");
    let short = key_file(keys.path(), "short.key", &KEY.as_bytes()[..40]);
    let err = refused_start(dir.path(), &["--audit-key-file", utf8(&short)]);
    assert!(
        err.contains("short.key") && err.contains("holds no key") && err.contains("40 hex"),
        "{err}"
    );
    let missing = keys.path().join("missing.key");
    let err = refused_start(dir.path(), &["--audit-key-file", utf8(&missing)]);
    assert!(err.contains("cannot read the audit key file"), "{err}");
    let o = run(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--audit-key-file",
            utf8(&key),
        ],
        None,
    );
    assert!(
        !o.status.success() && stderr(&o).contains("needs a store (--data-dir or --store)"),
        "{}",
        stderr(&o)
    );
    // With its key it starts, whole.
    let d = start(dir.path(), &["--audit-key-file", utf8(&key)]);
    assert_eq!(Http::new(&d).get("/models/demo/state").json(), state);
    assert!(d.terminate().success());
}

#[test]
fn an_unkeyed_store_adopts_a_key_from_each_models_next_record() {
    let keys = data_dir();
    let key = key_file(keys.path(), "audit.key", KEY.as_bytes());
    let (dir, _) = seven_on_disk(&[]);
    let d = start(dir.path(), &["--audit-key-file", utf8(&key)]);
    assert!(
        d.stderr_with("adopts").contains("`demo` from record 7"),
        "{}",
        d.stderr()
    );
    let http = Http::new(&d);
    for i in 0..3 {
        let r = http.post_json("/models/demo/mutations", &json!({"$.qty": 3 + i}));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let state = http.get("/models/demo/state").json();
    assert!(d.terminate().success());
    // Plain up to record 6, keyed from 7; adopted once, needed from now on.
    let d = start(dir.path(), &["--audit-key-file", utf8(&key)]);
    let http = Http::new(&d);
    let v = http.get("/models/demo/audit/verify").json();
    assert_eq!(
        (v["valid"].clone(), v["recordsChecked"].clone()),
        (json!(true), json!(10)),
        "{v}"
    );
    assert_eq!(http.get("/models/demo/state").json(), state);
    assert!(!d.stderr().contains("adopts"), "{}", d.stderr());
    assert!(d.terminate().success());
    assert!(refused_start(dir.path(), &[]).contains("is keyed"));
}

#[test]
fn an_audit_store_plugin_receives_keyed_records_and_verify_checks_them_with_the_key() {
    let keys = data_dir();
    let key = key_file(keys.path(), "audit.key", KEY.as_bytes());
    let plugin = valem_tests::valem_bin()
        .parent()
        .expect("target/<profile>")
        .join("libvalem_audit_jsonl.so");
    assert!(
        plugin.is_file(),
        "{} is missing: cargo build --workspace",
        plugin.display()
    );
    let dir = data_dir();
    let args = [
        "--checkpoint-every",
        "2",
        "--audit-key-file",
        utf8(&key),
        "--plugin",
        utf8(&plugin),
    ];
    let d = start(dir.path(), &args);
    let http = Http::new(&d);
    let r = http.post(
        "/models",
        &[("Content-Type", "application/json")],
        DEMO.as_bytes(),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    for i in 0..5 {
        let r = http.post_json("/models/demo/mutations", &json!({"$.price": i, "$.qty": 2}));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Answered from the plugin's records (keyed) and the store's checkpoints.
    let v = http.get("/models/demo/audit/verify").json();
    assert_eq!(v["valid"], json!(true), "{v}");
    assert_eq!(v["recordsChecked"], json!(5), "{v}");
    assert_eq!(v["checkpointsChecked"], json!(2), "{v}");
    assert!(d.terminate().success());
    // An edited checkpoint is reported through the plugin's verify as well.
    db(dir.path())
        .execute(
            "UPDATE checkpoints SET state = replace(state, '\"price\":1', '\"price\":7')
             WHERE sequence = 1",
            [],
        )
        .expect("edit");
    let d = start(dir.path(), &args);
    let v = Http::new(&d).get("/models/demo/audit/verify").json();
    assert_eq!(
        (
            v["valid"].clone(),
            v["brokenCheckpoint"]["sequence"].clone()
        ),
        (json!(false), json!(1)),
        "{v}"
    );
    assert!(d.terminate().success());
}
