//! Store tests against real SQLite files: round trip across reopen, writer semantics (acks after
//! commit, per-op and per-batch failures, group commit bounds), tampering done with rusqlite on
//! the file itself, schema migration from v1, and torn WAL / database files.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};

use rusqlite::{params, Connection};
use serde_json::{json, Value as Json};

use super::*;

mod pg;

/// Builds a model's chain the way the service does (same record fields).
struct Chain {
    model: String,
    next: u64,
    prev: String,
    /// Records are hashed with this key (a keyed store).
    key: Option<AuditKey>,
}

impl Chain {
    fn new(model: &str) -> Chain {
        Chain {
            model: model.to_string(),
            next: 0,
            prev: GENESIS.to_string(),
            key: None,
        }
    }

    fn record(&mut self, at_us: i64, qty: i64) -> Json {
        let mut r = json!({
            "modelId": self.model,
            "sequence": self.next,
            "timestamp": format!("t{at_us}"),
            "modelVersion": "1.0.0",
            "source": "client",
            "mutations": {"$.qty": qty},
            "derivedUpdated": ["$.total"],
            "flaggedConstraints": [],
            "dispatchedEffects": [],
            "traces": [{"targetPath": "$.total", "expression": "qty * 2", "inputPaths": ["$.qty"],
                        "result": qty * 2, "constraintPassed": null, "errorMessage": null}],
            "prevHash": self.prev,
        });
        let h = match &self.key {
            Some(k) => chain::record_hash_keyed(k, &self.prev, &r),
            None => record_hash(&self.prev, &r),
        };
        r["hash"] = json!(h);
        self.prev = h;
        self.next += 1;
        r
    }

    fn op(&mut self, at_us: i64, qty: i64) -> Op {
        let r = self.record(at_us, qty);
        Op::AppendAudit(
            AuditAppend::new(
                Timestamp::from_us(at_us),
                &r,
                vec!["$.qty".into(), "$.total".into()],
                self.key.as_ref(),
            )
            .expect("valid record"),
        )
    }
}

fn put_model(id: &str) -> Op {
    Op::PutModel {
        id: id.into(),
        spec_text: format!("{{\"id\":\"{id}\"}}"),
        version: "1.0.0".into(),
        at: Timestamp::from_us(1),
    }
}

fn open(dir: &Path) -> SqliteStore {
    SqliteStore::open(dir, StoreOptions::default()).expect("store opens")
}

/// Block the writer thread inside a completion until the returned sender fires, so ops submitted
/// meanwhile queue up and are drained together.
fn hold_writer(w: &Writer) -> mpsc::Sender<()> {
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let (held_tx, held_rx) = mpsc::channel::<()>();
    w.submit(
        Op::DeleteSnapshot {
            model_id: "-".into(),
            snapshot_id: "-".into(),
        },
        Box::new(move |r| {
            assert!(r.is_ok(), "{r:?}");
            let _ = held_tx.send(());
            let _ = release_rx.recv();
        }),
    );
    held_rx.recv().expect("writer is held");
    release_tx
}

/// Submit without waiting; the result of each op arrives on the returned channel in order.
fn submit_all(w: &Writer, ops: Vec<Op>) -> mpsc::Receiver<(usize, Result<(), StoreError>)> {
    let (tx, rx) = mpsc::channel();
    for (i, op) in ops.into_iter().enumerate() {
        let tx = tx.clone();
        w.submit(
            op,
            Box::new(move |r| {
                let _ = tx.send((i, r));
            }),
        );
    }
    rx
}

/// Opens the store under test (again: the same data) with these options.
type Opener<'a> = &'a dyn Fn(StoreOptions) -> Box<dyn Store>;
/// Runs a `SELECT count(*) …` on the store's database from a connection of its own.
type Count<'a> = &'a dyn Fn(&str) -> i64;

fn boxed(dir: &Path) -> impl Fn(StoreOptions) -> Box<dyn Store> + '_ {
    move |opts| Box::new(SqliteStore::open(dir, opts).expect("store opens"))
}

fn sqlite_count(db: &Path) -> impl Fn(&str) -> i64 + '_ {
    move |sql| {
        Connection::open(db)
            .expect("direct")
            .query_row(sql, [], |r| r.get(0))
            .expect("count")
    }
}

fn records(store: &dyn Store, model: &str) -> Vec<Json> {
    let mut out = Vec::new();
    store
        .audit_after(model, None, None, &mut |e| {
            out.push(e.record);
            ControlFlow::Continue(())
        })
        .expect("audit reads");
    out
}

#[test]
fn open_creates_the_directory_and_names_a_bad_path() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("a/b/data");
    let store = open(&dir);
    assert!(dir.join(DB_FILE).is_file() && dir.join("blobs").is_dir());
    let mode: String = Connection::open(dir.join(DB_FILE))
        .and_then(|c| c.query_row("PRAGMA journal_mode", [], |r| r.get(0)))
        .expect("mode");
    assert_eq!(mode, "wal");
    drop(store);

    let file = tmp.path().join("plain-file");
    std::fs::write(&file, b"x").expect("write");
    let err = SqliteStore::open(&file, StoreOptions::default()).expect_err("a file is not a dir");
    assert!(matches!(err, StoreError::NotADirectory { ref path } if *path == file));
    assert!(err.to_string().contains("plain-file"), "{err}");

    // procfs refuses new entries, even for root.
    let bad = PathBuf::from("/proc/self/valem-store-test/data");
    let err = SqliteStore::open(&bad, StoreOptions::default()).expect_err("cannot create");
    assert!(matches!(err, StoreError::CreateDir { .. }), "{err:?}");
    assert!(
        err.to_string().contains("/proc/self/valem-store-test/data"),
        "{err}"
    );
}

#[test]
fn a_read_only_directory_is_refused_naming_it() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("ro");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).expect("chmod");
    let still_writable = std::fs::write(dir.join("probe"), b"x").is_ok();
    let result = SqliteStore::open(&dir, StoreOptions::default());
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod back");
    if still_writable {
        // Running as root: permission bits do not bind, so there is nothing read-only to test.
        assert!(result.is_ok());
        return;
    }
    let err = result.expect_err("read-only dir is refused");
    assert!(
        matches!(err, StoreError::NotWritable { ref path, .. } if *path == dir),
        "{err:?}"
    );
}

#[test]
fn everything_written_is_back_after_reopen() {
    let tmp = tempfile::tempdir().expect("tempdir");
    written_is_back(&boxed(tmp.path()));
    let hash = blake3::hash(b"hello blob").to_hex().to_string();
    assert!(tmp
        .path()
        .join("blobs")
        .join(&hash[..2])
        .join(&hash[2..])
        .is_file());
}

/// Everything written is back after the store is closed and opened again.
pub(super) fn written_is_back(open: Opener) {
    let mut chain = Chain::new("orders");
    {
        let store = open(StoreOptions::default());
        let w = store.writer();
        w.apply(put_model("orders")).expect("put");
        w.apply(put_model("empty")).expect("put");
        for i in 0..20 {
            w.apply(chain.op(1000 + i * 10, i)).expect("append");
        }
        w.apply(Op::Checkpoint {
            model_id: "orders".into(),
            sequence: Some(Seq::new(9)),
            at: Timestamp::from_us(1090),
            state: json!({"qty": 9}),
            kind: CheckpointKind::Periodic,
        })
        .expect("checkpoint");
        w.apply(Op::Checkpoint {
            model_id: "orders".into(),
            sequence: Some(Seq::new(19)),
            at: Timestamp::from_us(1190),
            state: json!({"qty": 19}),
            kind: CheckpointKind::Periodic,
        })
        .expect("checkpoint");
        w.apply(Op::PutSnapshot {
            model_id: "orders".into(),
            snapshot_id: "s1".into(),
            at: Timestamp::from_us(5),
            snapshot: json!({"state": {"qty": 3}}),
        })
        .expect("snapshot");
        let bytes = b"hello blob".to_vec();
        let hash = store.put_blob_bytes(&bytes).expect("bytes");
        assert_eq!(
            store.put_blob_bytes(&bytes).expect("again"),
            hash,
            "content addressed"
        );
        w.apply(Op::PutBlob(BlobMeta {
            id: hash.clone(),
            hash: hash.clone(),
            size: bytes.len() as u64,
            media_type: "text/plain".into(),
            filename: Some("h.txt".into()),
            created: Timestamp::from_us(7),
        }))
        .expect("blob meta");
    }
    let store = open(StoreOptions::default());
    let models = store.load_models().expect("models");
    assert_eq!(models.len(), 2);
    let orders = models.iter().find(|m| m.id == "orders").expect("orders");
    assert_eq!(orders.spec_text, "{\"id\":\"orders\"}");
    assert_eq!(
        (orders.head_seq, orders.head_hash.as_str()),
        (Some(Seq::new(19)), chain.prev.as_str())
    );
    let empty = models.iter().find(|m| m.id == "empty").expect("empty");
    assert_eq!((empty.head_seq, empty.head_hash.as_str()), (None, GENESIS));

    let usable = |at| {
        let choice = store.usable_checkpoint("orders", at).expect("cp");
        assert!(choice.refused.is_empty(), "{:?}", choice.refused);
        choice.checkpoint
    };
    let cp = usable(None).expect("some");
    assert_eq!(
        (cp.sequence, cp.state.clone(), cp.kind),
        (
            Some(Seq::new(19)),
            json!({"qty": 19}),
            CheckpointKind::Periodic
        )
    );
    let cp = usable(Some(Timestamp::from_us(1150))).expect("some");
    assert_eq!(cp.sequence, Some(Seq::new(9)));
    assert!(usable(Some(Timestamp::from_us(10))).is_none());

    // Replay after checkpoint 9 up to t=1125: records 10, 11, 12.
    let mut seen = Vec::new();
    let n = store
        .audit_after(
            "orders",
            Some(Seq::new(9)),
            Some(Timestamp::from_us(1125)),
            &mut |e| {
                seen.push((e.sequence, e.record["mutations"]["$.qty"].clone()));
                ControlFlow::Continue(())
            },
        )
        .expect("replay");
    assert_eq!(n, 3);
    assert_eq!(
        seen,
        vec![
            (Seq::new(10), json!(10)),
            (Seq::new(11), json!(11)),
            (Seq::new(12), json!(12))
        ]
    );
    let mut first = None;
    store
        .audit_after("orders", None, None, &mut |e| {
            first = Some(e.sequence);
            ControlFlow::Break(())
        })
        .expect("break");
    assert_eq!(first, Some(Seq::new(0)));

    let seqs = |f: AuditFilter| -> Vec<u64> {
        store
            .query_audit("orders", &f)
            .expect("query")
            .iter()
            .map(|r| r["sequence"].as_u64().expect("seq"))
            .collect()
    };
    assert_eq!(seqs(AuditFilter::default()).len(), 20);
    assert_eq!(seqs(AuditFilter::default())[0], 19, "newest first");
    let window = AuditFilter {
        from: Some(Timestamp::from_us(1030)),
        to: Some(Timestamp::from_us(1060)),
        limit: Some(3),
        ..Default::default()
    };
    assert_eq!(seqs(window), vec![6, 5, 4]);
    let by_path = |p: &str| AuditFilter {
        path_prefix: Some(p.into()),
        ..Default::default()
    };
    assert_eq!(seqs(by_path("$.tot")).len(), 20);
    assert_eq!(seqs(by_path("$.q")).len(), 20);
    assert!(seqs(by_path("$.r")).is_empty());
    assert!(seqs(by_path("$.qtyx")).is_empty());
    // The stored record is byte-for-byte what was served (field order kept).
    let served = serde_json::to_string(
        &store
            .query_audit("orders", &AuditFilter::default())
            .expect("q")[0],
    )
    .expect("text");
    assert!(
        served.starts_with("{\"modelId\":\"orders\",\"sequence\":19,"),
        "{served}"
    );

    let snaps = store.snapshots("orders").expect("snapshots");
    assert_eq!(snaps.len(), 1);
    assert_eq!(
        (snaps[0].snapshot_id.as_str(), &snaps[0].snapshot),
        ("s1", &json!({"state": {"qty": 3}}))
    );

    let hash = blake3::hash(b"hello blob").to_hex().to_string();
    let meta = store.blob(&hash).expect("meta").expect("some");
    assert_eq!(
        (
            meta.size,
            meta.media_type.as_str(),
            meta.filename.as_deref()
        ),
        (10, "text/plain", Some("h.txt"))
    );
    assert_eq!(store.blob_bytes(&hash).expect("bytes"), b"hello blob");

    let report = store.verify_chain("orders").expect("verify");
    assert_eq!((report.valid, report.records_checked), (true, 20));
    assert_eq!(
        store.verify_chain("empty").expect("verify").records_checked,
        0
    );
    assert!(matches!(
        store.verify_chain("nope"),
        Err(StoreError::ModelNotFound { .. })
    ));
}

#[test]
fn ops_that_break_the_chain_fail_alone_and_the_batch_goes_on() {
    let tmp = tempfile::tempdir().expect("tempdir");
    chain_breakers_fail_alone(&open(tmp.path()));
}

/// Ops that break the chain fail alone; the rest of their batch commits.
pub(super) fn chain_breakers_fail_alone(store: &dyn Store) {
    let w = store.writer();
    w.apply(put_model("m")).expect("put");
    let mut chain = Chain::new("m");
    let good0 = chain.op(1, 0);
    let good1 = chain.op(2, 1);
    let mut stray = Chain::new("m");
    let skipped = {
        stray.next = 5;
        stray.op(3, 5)
    };
    let relinked = Chain::new("m").op(3, 0); // sequence 0 again
    let mut other = Chain::new("m");
    other.next = 2; // right sequence, wrong prevHash
    let wrong_link = other.op(3, 2);
    let unknown = Chain::new("ghost").op(1, 0);
    let good2 = chain.op(4, 2);
    let ahead = Op::Checkpoint {
        model_id: "m".into(),
        sequence: Some(Seq::new(9)),
        at: Timestamp::from_us(5),
        state: json!({}),
        kind: CheckpointKind::Periodic,
    };
    let rx = submit_all(
        &w,
        vec![
            good0, good1, skipped, relinked, wrong_link, unknown, good2, ahead,
        ],
    );
    store.flush().expect("flush");
    let results: Vec<_> = rx.try_iter().collect();
    assert_eq!(
        results.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>(),
        "acks in order"
    );
    let r = |i: usize| &results[i].1;
    assert!(r(0).is_ok() && r(1).is_ok() && r(6).is_ok());
    assert!(
        matches!(
            r(2),
            Err(StoreError::OutOfSequence {
                expected: 2,
                got: 5,
                ..
            })
        ),
        "{:?}",
        r(2)
    );
    assert!(matches!(
        r(3),
        Err(StoreError::OutOfSequence {
            expected: 2,
            got: 0,
            ..
        })
    ));
    assert!(
        matches!(r(4), Err(StoreError::ChainMismatch { sequence: 2, .. })),
        "{:?}",
        r(4)
    );
    assert!(matches!(r(5), Err(StoreError::ModelNotFound { .. })));
    assert!(matches!(
        r(7),
        Err(StoreError::CheckpointAhead {
            sequence: 9,
            head: Some(2),
            ..
        })
    ));
    assert_eq!(records(store, "m").len(), 3);
    assert!(store.verify_chain("m").expect("verify").valid);

    let mut bad = Chain::new("m").record(1, 0);
    bad["mutations"]["$.qty"] = json!(1);
    assert!(matches!(
        AuditAppend::new(Timestamp::from_us(1), &bad, vec![], None),
        Err(StoreError::InvalidRecord { .. })
    ));
    assert!(matches!(
        AuditAppend::new(
            Timestamp::from_us(1),
            &json!({"modelId": "m"}),
            vec![],
            None
        ),
        Err(StoreError::InvalidRecord { .. })
    ));
}

#[test]
fn an_atomic_op_that_fails_half_way_leaves_nothing_and_its_batch_commits() {
    let tmp = tempfile::tempdir().expect("tempdir");
    atomic_fails_whole(&open(tmp.path()));
}

/// An `Atomic` op whose second part fails leaves nothing of its first; the ops around it in
/// the same batch commit.
pub(super) fn atomic_fails_whole(store: &dyn Store) {
    let w = store.writer();
    w.apply(put_model("m")).expect("put");
    let mut chain = Chain::new("m");
    w.apply(chain.op(1, 1)).expect("append");
    let release = hold_writer(&w);
    let half = Op::Atomic(vec![
        Op::PutSnapshot {
            model_id: "m".into(),
            snapshot_id: "s".into(),
            at: Timestamp::from_us(2),
            snapshot: json!({"x": 1}),
        },
        Op::Checkpoint {
            model_id: "m".into(),
            sequence: Some(Seq::new(99)),
            at: Timestamp::from_us(2),
            state: json!({}),
            kind: CheckpointKind::Base,
        },
    ]);
    let rx = submit_all(&w, vec![chain.op(3, 3), half, chain.op(4, 4)]);
    release.send(()).expect("release");
    store.flush().expect("flush");
    let results: Vec<_> = rx.iter().take(3).collect();
    assert!(results[0].1.is_ok() && results[2].1.is_ok(), "{results:?}");
    assert!(
        matches!(results[1].1, Err(StoreError::CheckpointAhead { .. })),
        "{results:?}"
    );
    assert!(store.snapshots("m").expect("snapshots").is_empty());
    assert_eq!(records(store, "m").len(), 3);
    assert!(store.verify_chain("m").expect("verify").valid);
}

#[test]
fn acks_follow_the_commit_in_submission_order_and_batches_are_bounded() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let db = tmp.path().join(DB_FILE);
    let count = move |sql: &str| -> i64 {
        Connection::open(&db)
            .expect("direct")
            .query_row(sql, [], |r| r.get(0))
            .expect("count")
    };
    acks_follow_commits(&boxed(tmp.path()), Arc::new(count));
}

/// Acknowledged means committed (another connection sees it), in submission order; batches
/// are bounded by `max_batch_ops`; strict mode syncs once per batch.
pub(super) fn acks_follow_commits(open: Opener, count: Arc<dyn Fn(&str) -> i64 + Send + Sync>) {
    let opts = StoreOptions {
        max_batch_ops: 32,
        ..Default::default()
    };
    let store = open(opts);
    let w = store.writer();
    w.apply(put_model("m")).expect("put");
    let mut chain = Chain::new("m");
    w.apply(chain.op(0, 0)).expect("first");

    // Hold the writer inside a completion while 100 ops queue up behind it.
    let release = hold_writer(&w);
    let before = store.stats();
    let probe = Arc::new(Mutex::new(count));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let (done_tx, done_rx) = mpsc::channel();
    for i in 1..=100u64 {
        let (probe, acked, done_tx) = (probe.clone(), acked.clone(), done_tx.clone());
        w.submit(
            chain.op(i as i64, i as i64),
            Box::new(move |r| {
                assert!(r.is_ok(), "{r:?}");
                // Acknowledged means committed: another connection already sees the record.
                let visible: i64 = (probe.lock().expect("probe"))(&format!(
                    "SELECT count(*) FROM audit WHERE model_id = 'm' AND sequence = {i}"
                ));
                assert_eq!(visible, 1, "record {i} acked before commit");
                acked.lock().expect("acked").push(i);
                let _ = done_tx.send(());
            }),
        );
    }
    release.send(()).expect("release");
    for _ in 0..100 {
        done_rx.recv().expect("ack");
    }
    assert_eq!(*acked.lock().expect("acked"), (1..=100).collect::<Vec<_>>());
    let after = store.stats();
    assert_eq!(after.ops_committed - before.ops_committed, 100);
    assert_eq!(
        after.batches_committed - before.batches_committed,
        4,
        "100 queued ops in batches of ≤ 32"
    );
    assert_eq!(
        after.fsyncs - before.fsyncs,
        4,
        "strict: one fsync per batch"
    );
}

#[test]
fn a_full_database_fails_whole_batches_and_the_writer_recovers_when_space_returns() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions {
        max_db_bytes: Some(512 << 10),
        ..Default::default()
    };
    let store = SqliteStore::open(tmp.path(), opts).expect("open");
    let w = store.writer();
    w.apply(put_model("m")).expect("put");
    w.apply(put_model("filler")).expect("put");
    let mut m = Chain::new("m");
    for i in 0..5 {
        w.apply(m.op(i, i)).expect("m fits");
    }
    let big = "x".repeat(16 << 10);
    let mut n = 0;
    let err = loop {
        let r = w.apply(Op::PutSnapshot {
            model_id: "filler".into(),
            snapshot_id: format!("s{n}"),
            at: Timestamp::from_us(n),
            snapshot: json!({"pad": big}),
        });
        match r {
            Ok(()) => n += 1,
            Err(e) => break e,
        }
        assert!(n < 1000, "the size limit never hit");
    };
    assert!(
        matches!(err, StoreError::DiskFull { ref path } if path == store.db_path()),
        "{err:?}"
    );
    assert!(err.to_string().contains("valem.db"), "{err}");
    assert!(store.stats().batches_failed >= 1);
    // Nothing acknowledged was lost, and the writer still serves.
    assert_eq!(
        store.snapshots("filler").expect("snapshots").len(),
        n as usize
    );
    assert!(store.verify_chain("m").expect("verify").valid);
    w.apply(Op::DeleteModel {
        id: "filler".into(),
    })
    .expect("delete frees pages");
    for i in 5..10 {
        w.apply(m.op(i, i)).expect("writes work again");
    }
    let report = store.verify_chain("m").expect("verify");
    assert_eq!((report.valid, report.records_checked), (true, 10));
}

#[test]
fn delete_model_removes_its_rows_from_every_table() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let db = tmp.path().join(DB_FILE);
    delete_removes_every_row(&open(tmp.path()), &sqlite_count(&db));
}

/// Deleting a model removes its rows from every table; deleting again is fine.
pub(super) fn delete_removes_every_row(store: &dyn Store, count: Count) {
    let w = store.writer();
    for id in ["a", "b"] {
        w.apply(put_model(id)).expect("put");
        let mut c = Chain::new(id);
        for i in 0..3 {
            w.apply(c.op(i, i)).expect("append");
        }
        w.apply(keyed(c.op(3, 3), "k")).expect("keyed append");
        w.apply(Op::Checkpoint {
            model_id: id.into(),
            sequence: Some(Seq::new(2)),
            at: Timestamp::from_us(2),
            state: json!({}),
            kind: CheckpointKind::Periodic,
        })
        .expect("cp");
        w.apply(Op::PutSnapshot {
            model_id: id.into(),
            snapshot_id: "s".into(),
            at: Timestamp::from_us(2),
            snapshot: json!({}),
        })
        .expect("snap");
    }
    w.apply(Op::DeleteSnapshot {
        model_id: "b".into(),
        snapshot_id: "s".into(),
    })
    .expect("del snap");
    assert!(store.snapshots("b").expect("snaps").is_empty());
    w.apply(Op::DeleteModel { id: "a".into() }).expect("delete");
    w.apply(Op::DeleteModel { id: "a".into() })
        .expect("idempotent");
    for table in [
        "audit",
        "audit_paths",
        "checkpoints",
        "snapshots",
        "idempotency",
    ] {
        let n = count(&format!(
            "SELECT count(*) FROM {table} WHERE model_id = 'a'"
        ));
        assert_eq!(n, 0, "{table} still has rows of the deleted model");
    }
    assert_eq!(
        store
            .load_models()
            .expect("models")
            .iter()
            .map(|m| m.id.as_str())
            .collect::<Vec<_>>(),
        vec!["b"]
    );
    assert_eq!(records(store, "b").len(), 4);
}

/// `op` (an append) made under idempotency key `key`.
fn keyed(op: Op, key: &str) -> Op {
    match op {
        Op::AppendAudit(a) => Op::AppendAudit(a.with_key(KeyedWrite {
            key: key.into(),
            request: format!("request of {key}"),
            answer: format!("{{\"answer\":\"{key}\"}}"),
        })),
        other => other,
    }
}

#[test]
fn appends_to_many_models_in_one_batch_fail_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    batched_appends_fail_alone(&*boxed(tmp.path())(StoreOptions::default()));
}

/// Appends to five models queued into one batch (the PostgreSQL writer writes such a run in one
/// statement), one of them out of sequence and one keyed: the bad one fails alone, with its
/// own error, and the others commit with their paths and key; then a clean run of five.
pub(super) fn batched_appends_fail_alone(store: &dyn Store) {
    let w = store.writer();
    let ids = ["b0", "b1", "b2", "b3", "b4"];
    let mut chains: Vec<Chain> = ids.iter().map(|id| Chain::new(id)).collect();
    for (id, c) in ids.iter().zip(chains.iter_mut()) {
        w.apply(put_model(id)).expect("put");
        w.apply(c.op(1, 1)).expect("first record");
    }
    let release = hold_writer(&w);
    let ops: Vec<Op> = chains
        .iter_mut()
        .enumerate()
        .map(|(i, c)| match i {
            // b2's record claims to be its first again: out of sequence.
            2 => Chain::new("b2").op(2, 20),
            1 => keyed(c.op(2, 2), "k-b1"),
            _ => c.op(2, 2),
        })
        .collect();
    let rx = submit_all(&w, ops);
    let _ = release.send(());
    let mut results: Vec<(usize, Result<(), StoreError>)> =
        (0..5).map(|_| rx.recv().expect("an answer")).collect();
    results.sort_by_key(|(i, _)| *i);
    for (i, r) in &results {
        match i {
            2 => assert!(
                matches!(
                    r,
                    Err(StoreError::OutOfSequence {
                        expected: 1,
                        got: 0,
                        ..
                    })
                ),
                "{r:?}"
            ),
            _ => assert!(r.is_ok(), "b{i}: {r:?}"),
        }
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(records(store, id).len(), if i == 2 { 1 } else { 2 }, "{id}");
        assert!(store.verify_chain(id).expect("verify").valid, "{id}");
    }
    let keys = store.idempotency_keys("b1").expect("keys");
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].sequence.get(), 1);
    let hit = store
        .query_audit(
            "b3",
            &AuditFilter {
                path_prefix: Some("$.qty".into()),
                ..Default::default()
            },
        )
        .expect("by path");
    assert_eq!(hit.len(), 2, "paths indexed for the batched records");
    // A clean run of five in one batch.
    let release = hold_writer(&w);
    let ops: Vec<Op> = chains.iter_mut().map(|c| c.op(3, 3)).collect();
    let rx = submit_all(&w, ops);
    let _ = release.send(());
    for _ in 0..5 {
        let (i, r) = rx.recv().expect("an answer");
        assert!(r.is_ok(), "b{i}: {r:?}");
    }
    assert_eq!(records(store, "b0").len(), 3);
    assert_eq!(records(store, "b2").len(), 2);
}

#[test]
fn keyed_writes_are_kept_with_their_records() {
    let tmp = tempfile::tempdir().expect("tempdir");
    keys_kept_with_records(&boxed(tmp.path()));
}

/// A keyed append keeps its key, request hash and answer in its transaction (a failed append
/// keeps none); reopening reads them back; a checkpoint forgets all but the newest KEYS_KEPT.
pub(super) fn keys_kept_with_records(open: &dyn Fn(StoreOptions) -> Box<dyn Store>) {
    let mut c = Chain::new("m");
    {
        let store = open(StoreOptions::default());
        let w = store.writer();
        w.apply(put_model("m")).expect("put");
        w.apply(keyed(c.op(1, 1), "first")).expect("keyed");
        w.apply(c.op(2, 2)).expect("plain");
        // Out of sequence: refused, and its key with it.
        let mut stale = Chain::new("m");
        assert!(w.apply(keyed(stale.op(3, 3), "lost")).is_err());
        w.apply(keyed(c.op(4, 4), "second")).expect("keyed");
    }
    let store = open(StoreOptions::default());
    let keys = store.idempotency_keys("m").expect("keys");
    let got: Vec<(&str, u64)> = keys
        .iter()
        .map(|k| (k.key.as_str(), k.sequence.get()))
        .collect();
    assert_eq!(got, vec![("second", 2), ("first", 0)]);
    assert_eq!(keys[1].request, "request of first");
    assert_eq!(
        store
            .idempotency_answer("m", "first")
            .expect("answer")
            .as_deref(),
        Some("{\"answer\":\"first\"}")
    );
    assert_eq!(store.idempotency_answer("m", "lost").expect("answer"), None);
    assert_eq!(
        store.idempotency_answer("other", "first").expect("answer"),
        None
    );
    // Past KEYS_KEPT keys, a checkpoint keeps the newest KEYS_KEPT.
    let w = store.writer();
    let mut last = 0;
    for i in 0..KEYS_KEPT + 5 {
        last = c.next;
        w.submit(
            keyed(c.op(10 + i as i64, i as i64), &format!("k{i}")),
            Box::new(|_| {}),
        );
    }
    w.apply(Op::Checkpoint {
        model_id: "m".into(),
        sequence: Some(Seq::new(last)),
        at: Timestamp::from_us(5_000),
        state: json!({}),
        kind: CheckpointKind::Periodic,
    })
    .expect("checkpoint");
    let keys = store.idempotency_keys("m").expect("keys");
    assert_eq!(keys.len(), KEYS_KEPT);
    assert_eq!(keys[0].key, format!("k{}", KEYS_KEPT + 4));
    assert_eq!(
        store.idempotency_answer("m", "second").expect("answer"),
        None
    );
    assert_eq!(store.idempotency_answer("m", "k4").expect("answer"), None);
    assert!(store
        .idempotency_answer("m", "k5")
        .expect("answer")
        .is_some());
}

#[test]
fn relaxed_mode_acks_after_commit_and_flush_fsyncs_the_wal() {
    let tmp = tempfile::tempdir().expect("tempdir");
    relaxed_flush_syncs(&boxed(tmp.path()));
}

/// Relaxed commits do not sync; a flush does, once; everything is there after a reopen.
pub(super) fn relaxed_flush_syncs(open: Opener) {
    let opts = StoreOptions {
        durability: Durability::Relaxed,
        ..Default::default()
    };
    let mut chain = Chain::new("m");
    {
        let store = open(opts.clone());
        let w = store.writer();
        w.apply(put_model("m")).expect("put");
        for i in 0..10 {
            w.apply(chain.op(i, i)).expect("append");
        }
        assert_eq!(store.stats().fsyncs, 0, "relaxed commits do not fsync");
        store.flush().expect("flush");
        assert_eq!(store.stats().fsyncs, 1, "flush fsyncs the WAL");
    }
    let store = open(opts);
    assert_eq!(records(&*store, "m").len(), 10);
}

#[test]
fn a_closed_store_answers_every_submit_and_a_panicking_completion_does_not_stop_the_writer() {
    let tmp = tempfile::tempdir().expect("tempdir");
    closed_store_answers(Box::new(open(tmp.path())));
}

/// A panicking completion does not stop the writer; a dropped store answers every submit.
pub(super) fn closed_store_answers(store: Box<dyn Store>) {
    let w = store.writer();
    w.submit(put_model("p"), Box::new(|_| panic!("completion panics")));
    w.apply(put_model("q")).expect("writer still runs");
    assert_eq!(store.load_models().expect("models").len(), 2);
    drop(store);
    assert!(matches!(
        w.apply(put_model("r")),
        Err(StoreError::WriterStopped)
    ));
    assert!(matches!(w.flush(), Err(StoreError::WriterStopped)));
}

#[test]
fn blobs_are_checked_on_read_and_hashes_are_validated() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let opts = StoreOptions {
        max_blob_bytes: 1024,
        ..Default::default()
    };
    let store = SqliteStore::open(tmp.path(), opts).expect("open");
    let hash = store.put_blob_bytes(b"abc").expect("put");
    assert!(matches!(
        store.put_blob_bytes(&[0; 2000]),
        Err(StoreError::BlobTooLarge {
            size: 2000,
            limit: 1024
        })
    ));
    for bad in [
        "../../etc/passwd",
        "ABC",
        &"g".repeat(64),
        &hash.to_uppercase(),
    ] {
        assert!(
            matches!(
                store.blob_bytes(bad),
                Err(StoreError::InvalidBlobHash { .. })
            ),
            "{bad}"
        );
    }
    assert!(matches!(
        store.blob_bytes(&"0".repeat(64)),
        Err(StoreError::BlobNotFound { .. })
    ));
    let file = tmp.path().join("blobs").join(&hash[..2]).join(&hash[2..]);
    std::fs::write(&file, b"abd").expect("damage");
    let err = store.blob_bytes(&hash).expect_err("damaged");
    assert!(
        matches!(err, StoreError::Corrupt { ref path, .. } if *path == file),
        "{err:?}"
    );
    assert_eq!(store.put_blob_bytes(b"abc").expect("repair"), hash);
    assert_eq!(store.blob_bytes(&hash).expect("bytes"), b"abc");
    let leftovers: Vec<_> = std::fs::read_dir(file.parent().expect("dir"))
        .expect("ls")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn prefix_upper_bound_brackets_exactly_the_strings_with_the_prefix() {
    let samples = [
        "",
        "$",
        "$.",
        "$.a",
        "$.a[0]",
        "$.ab",
        "$.b",
        "$/",
        "é",
        "$.\u{10FFFF}",
        "$.\u{D7FF}x",
        "\u{E000}",
        "z",
    ];
    for p in ["$.a", "$.", "$", "é", "$.\u{D7FF}", "$.\u{10FFFF}"] {
        let hi = prefix_upper_bound(p);
        for s in samples {
            let in_range = s >= p && hi.as_deref().is_none_or(|h| s < h);
            assert_eq!(in_range, s.starts_with(p), "prefix {p:?}, string {s:?}");
        }
    }
    assert_eq!(prefix_upper_bound("\u{10FFFF}"), None);
    assert_eq!(
        prefix_upper_bound("a\u{D7FF}").as_deref(),
        Some("a\u{E000}")
    );
}

// --- tampering: edit the real SQLite file, then verify --------------------------------------

/// A closed store with model `m` holding records 0..10; returns the tempdir and the records.
fn ten_records() -> (tempfile::TempDir, Vec<Json>) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = open(tmp.path());
    let w = store.writer();
    w.apply(put_model("m")).expect("put");
    let mut chain = Chain::new("m");
    let mut recs = Vec::new();
    for i in 0..10 {
        let r = chain.record(i, i);
        recs.push(r.clone());
        w.apply(Op::AppendAudit(
            AuditAppend::new(Timestamp::from_us(i), &r, vec![], None).expect("valid"),
        ))
        .expect("append");
    }
    store.close().expect("close");
    (tmp, recs)
}

fn tampered(edit: impl FnOnce(&Connection, &[Json])) -> ChainReport {
    let (tmp, recs) = ten_records();
    {
        let c = Connection::open(tmp.path().join(DB_FILE)).expect("direct");
        edit(&c, &recs);
    }
    open(tmp.path()).verify_chain("m").expect("verify runs")
}

fn set_record(c: &Connection, seq: i64, rec: &Json) {
    c.execute(
        "UPDATE audit SET record = ?2, prev_hash = ?3, hash = ?4 WHERE model_id = 'm' AND sequence = ?1",
        params![seq, rec.to_string(), rec["prevHash"].as_str(), rec["hash"].as_str()],
    )
    .expect("update");
}

fn assert_broken(r: &ChainReport, seq: u64, word: &str) {
    assert!(!r.valid, "{r:?}");
    assert_eq!(r.first_broken_sequence, Some(seq), "{r:?}");
    assert_eq!(r.records_checked, seq.min(10), "{r:?}");
    assert!(
        r.detail.contains(word),
        "expected {word:?} in {:?}",
        r.detail
    );
}

#[test]
fn untouched_chain_verifies() {
    let r = tampered(|_, _| {});
    assert_eq!(
        (r.valid, r.records_checked, r.first_broken_sequence),
        (true, 10, None)
    );
}

#[test]
fn tamper_one_flipped_byte_in_a_record() {
    let r = tampered(|c, _| {
        // `"$.qty":4` becomes `"$.qty":5`: still JSON, different content.
        c.execute(
            "UPDATE audit SET record = replace(record, '\"$.qty\":4', '\"$.qty\":5') WHERE sequence = 4",
            [],
        )
        .expect("flip");
    });
    assert_broken(&r, 4, "altered");
    let r = tampered(|c, _| {
        c.execute("UPDATE audit SET record = replace(record, '{\"modelId\"', '[\"modelId\"') WHERE sequence = 4", [])
            .expect("flip");
    });
    assert_broken(&r, 4, "not valid JSON");
}

#[test]
fn tamper_an_edited_hash() {
    let r = tampered(|c, recs| {
        let mut rec = recs[4].clone();
        rec["hash"] = json!("f".repeat(64));
        set_record(c, 4, &rec);
    });
    assert_broken(&r, 4, "hash");
    let r = tampered(|c, _| {
        c.execute(
            "UPDATE audit SET hash = ?1 WHERE sequence = 4",
            [recs_hash_stub()],
        )
        .expect("edit column");
    });
    assert_broken(&r, 4, "columns differ");
    let r = tampered(|c, _| {
        c.execute("UPDATE models SET head_hash = ?1", [recs_hash_stub()])
            .expect("edit head");
    });
    assert!(
        !r.valid && r.first_broken_sequence == Some(9) && r.detail.contains("chain head"),
        "{r:?}"
    );
}

fn recs_hash_stub() -> String {
    "e".repeat(64)
}

#[test]
fn tamper_two_records_swapped() {
    let r = tampered(|c, recs| {
        set_record(c, 3, &recs[4]);
        set_record(c, 4, &recs[3]);
    });
    assert_broken(&r, 3, "reordered");
    // Swapped with their sequence fields rewritten to fit their new places.
    let r = tampered(|c, recs| {
        let (mut a, mut b) = (recs[4].clone(), recs[3].clone());
        a["sequence"] = json!(3);
        b["sequence"] = json!(4);
        set_record(c, 3, &a);
        set_record(c, 4, &b);
    });
    assert_broken(&r, 3, "prevHash");
}

#[test]
fn tamper_a_deleted_record() {
    let r = tampered(|c, _| {
        c.execute("DELETE FROM audit WHERE sequence = 5", [])
            .expect("delete");
    });
    assert_broken(&r, 5, "missing");
    // Deleted and the later ones renumbered to close the gap.
    let r = tampered(|c, _| {
        c.execute("DELETE FROM audit WHERE sequence = 5", [])
            .expect("delete");
        c.execute(
            "UPDATE audit SET sequence = sequence - 1 WHERE sequence > 5",
            [],
        )
        .expect("renumber");
    });
    assert_broken(&r, 5, "reordered or renumbered");
}

#[test]
fn tamper_an_inserted_record() {
    // A forged record correctly linked to record 4, the later ones moved up by one.
    let r = tampered(|c, recs| {
        c.execute(
            "UPDATE audit SET sequence = sequence + 10 WHERE sequence >= 5",
            [],
        )
        .expect("move");
        c.execute(
            "UPDATE audit SET sequence = sequence - 9 WHERE sequence >= 15",
            [],
        )
        .expect("move");
        let mut forged = recs[5].clone();
        forged["mutations"]["$.qty"] = json!(1000);
        forged.as_object_mut().expect("object").shift_remove("hash");
        let h = record_hash(recs[4]["hash"].as_str().expect("hash"), &forged);
        forged["hash"] = json!(h);
        c.execute(
            "INSERT INTO audit (model_id, sequence, at_us, record, prev_hash, hash) VALUES ('m', 5, 5, ?1, ?2, ?3)",
            params![forged.to_string(), forged["prevHash"].as_str(), h],
        )
        .expect("insert");
    });
    // The forged record links; the displaced original after it does not.
    assert_broken(&r, 6, "reordered or renumbered");
    // A forged record appended after the committed head.
    let r = tampered(|c, recs| {
        let mut chain = Chain {
            model: "m".into(),
            next: 10,
            prev: recs[9]["hash"].as_str().expect("hash").into(),
            key: None,
        };
        let forged = chain.record(10, 10);
        c.execute(
            "INSERT INTO audit (model_id, sequence, at_us, record, prev_hash, hash) VALUES ('m', 10, 10, ?1, ?2, ?3)",
            params![forged.to_string(), forged["prevHash"].as_str(), forged["hash"].as_str()],
        )
        .expect("insert");
    });
    assert!(
        !r.valid && r.first_broken_sequence == Some(10) && r.detail.contains("beyond"),
        "{r:?}"
    );
}

#[test]
fn tamper_a_truncated_tail() {
    let r = tampered(|c, _| {
        c.execute("DELETE FROM audit WHERE sequence >= 7", [])
            .expect("truncate");
    });
    assert_broken(&r, 7, "truncated");
    let r = tampered(|c, _| {
        c.execute("DELETE FROM audit", []).expect("truncate all");
    });
    assert_broken(&r, 0, "truncated");
}

// --- checkpoints ---------------------------------------------------------------------------

fn checkpoint(
    model: &str,
    sequence: Option<u64>,
    at_us: i64,
    qty: i64,
    kind: CheckpointKind,
) -> Op {
    Op::Checkpoint {
        model_id: model.into(),
        sequence: sequence.map(Seq::new),
        at: Timestamp::from_us(at_us),
        state: json!({"base": {"qty": qty, "note": "b"}, "effectKeys": {}}),
        kind,
    }
}

/// A closed store with model `m` holding records 0..10 (record i at time i) and periodic
/// checkpoints after records 3, 6 and 9 (plus what `more` writes); opened with `key`.
fn checkpointed(key: Option<AuditKey>, more: impl FnOnce(&Writer)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = open_keyed(tmp.path(), key);
    let w = store.writer();
    w.apply(put_model("m")).expect("put");
    let mut chain = Chain::new("m");
    chain.key = key;
    for i in 0..10 {
        w.apply(chain.op(i, i)).expect("append");
        if i % 3 == 0 && i > 0 {
            w.apply(checkpoint(
                "m",
                Some(i as u64),
                i,
                i,
                CheckpointKind::Periodic,
            ))
            .expect("checkpoint");
        }
    }
    more(&w);
    store.close().expect("close");
    tmp
}

fn open_keyed(dir: &Path, key: Option<AuditKey>) -> SqliteStore {
    SqliteStore::open(
        dir,
        StoreOptions {
            audit_key: key,
            ..Default::default()
        },
    )
    .expect("store opens")
}

fn edit(dir: &Path, sql: &str) {
    Connection::open(dir.join(DB_FILE))
        .and_then(|c| c.execute_batch(sql))
        .expect("tamper");
}

/// The checkpoint recovery picks (its sequence), and the refused ones (sequence, fault label).
type Pick = (Option<Option<u64>>, Vec<(Option<u64>, &'static str)>);

fn pick(store: &SqliteStore, at: Option<i64>) -> Pick {
    let c = store
        .usable_checkpoint("m", at.map(Timestamp::from_us))
        .expect("a usable checkpoint");
    (
        c.checkpoint.map(|cp| cp.sequence.map(Seq::get)),
        c.refused
            .iter()
            .map(|r| (r.sequence.map(Seq::get), r.fault.label()))
            .collect(),
    )
}

fn assert_checkpoint_broken(r: &ChainReport, seq: Option<u64>, word: &str) {
    assert!(!r.valid, "{r:?}");
    assert_eq!(
        r.first_broken_sequence, None,
        "the records are sound: {r:?}"
    );
    assert_eq!(r.records_checked, 10, "{r:?}");
    let b = r.broken_checkpoint.as_ref().expect("a broken checkpoint");
    assert_eq!(b.sequence, seq.map(Seq::new), "{r:?}");
    assert!(
        b.detail.contains(word),
        "expected {word:?} in {:?}",
        b.detail
    );
    assert!(
        r.detail.contains(&checkpoints::describe(seq.map(Seq::new))),
        "{r:?}"
    );
}

#[test]
fn a_sound_checkpoint_names_its_record_and_its_state() {
    let tmp = checkpointed(None, |_| {});
    let store = open(tmp.path());
    assert_eq!(pick(&store, None), (Some(Some(9)), vec![]));
    let r = store.verify_chain("m").expect("verify");
    assert!(r.valid, "{r:?}");
    assert_eq!(r.checkpoints_checked, Some(3));
    assert_eq!(
        serde_json::to_value(&r).expect("serializes")["checkpointsChecked"],
        json!(3)
    );
    let c = Connection::open(tmp.path().join(DB_FILE)).expect("direct");
    let (head, state, state_hash, hash, kind): (String, String, String, String, String) = c
        .query_row(
            "SELECT head_hash, state, state_hash, hash, kind FROM checkpoints WHERE sequence = 6",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
        )
        .expect("row");
    let record6: String = c
        .query_row("SELECT hash FROM audit WHERE sequence = 6", [], |r| {
            r.get(0)
        })
        .expect("record");
    assert_eq!(
        head, record6,
        "a checkpoint names the hash of the record it follows"
    );
    assert_eq!(state_hash, blake3::hash(state.as_bytes()).to_hex().as_str());
    assert_eq!(kind, "periodic");
    let header = chain::CheckpointHeader {
        model_id: "m",
        sequence: Some(Seq::new(6)),
        at_us: 6,
        kind: "periodic",
        head_hash: &head,
        state_hash: &state_hash,
    };
    assert_eq!(hash, chain::checkpoint_hash(None, &header));
    // Every field is covered.
    for other in [
        chain::CheckpointHeader {
            sequence: Some(Seq::new(5)),
            ..header
        },
        chain::CheckpointHeader { at_us: 7, ..header },
        chain::CheckpointHeader {
            kind: "base",
            ..header
        },
        chain::CheckpointHeader {
            model_id: "n",
            ..header
        },
        chain::CheckpointHeader {
            head_hash: GENESIS,
            ..header
        },
        chain::CheckpointHeader {
            state_hash: GENESIS,
            ..header
        },
    ] {
        assert_ne!(chain::checkpoint_hash(None, &other), hash, "{other:?}");
    }
    let key = AuditKey::from_bytes([1; 32]);
    assert_ne!(chain::checkpoint_hash(Some(&key), &header), hash);
}

#[test]
fn a_tampered_checkpoint_is_refused_for_the_one_before_it_and_reported() {
    // The state edited (a value that still parses).
    let tmp = checkpointed(None, |_| {});
    edit(tmp.path(), "UPDATE checkpoints SET state = replace(state, '\"qty\":9', '\"qty\":99') WHERE sequence = 9");
    let store = open(tmp.path());
    assert_eq!(
        pick(&store, None),
        (Some(Some(6)), vec![(Some(9), "state_hash")])
    );
    assert_checkpoint_broken(&store.verify_chain("m").expect("verify"), Some(9), "state");
    drop(store);

    // One flipped bit: the high bit of a character, so the text is not even UTF-8 any more.
    let tmp = checkpointed(None, |_| {});
    {
        let c = Connection::open(tmp.path().join(DB_FILE)).expect("direct");
        let mut bytes: Vec<u8> = c
            .query_row(
                "SELECT state FROM checkpoints WHERE sequence = 9",
                [],
                |r| r.get(0),
            )
            .map(|s: String| s.into_bytes())
            .expect("state");
        let at = bytes.iter().position(|b| *b == b'b').expect("a `b`");
        bytes[at] ^= 0x80;
        c.execute(
            "UPDATE checkpoints SET state = CAST(?1 AS TEXT) WHERE sequence = 9",
            [bytes],
        )
        .expect("flip");
    }
    let store = open(tmp.path());
    assert_eq!(
        pick(&store, None),
        (Some(Some(6)), vec![(Some(9), "state_hash")])
    );
    assert_checkpoint_broken(&store.verify_chain("m").expect("verify"), Some(9), "state");
    drop(store);

    // The head hash edited: it must name record 9's hash.
    let tmp = checkpointed(None, |_| {});
    edit(
        tmp.path(),
        &format!(
            "UPDATE checkpoints SET head_hash = '{}' WHERE sequence = 9",
            "a".repeat(64)
        ),
    );
    let store = open(tmp.path());
    assert_eq!(
        pick(&store, None),
        (Some(Some(6)), vec![(Some(9), "head_hash")])
    );
    assert_checkpoint_broken(
        &store.verify_chain("m").expect("verify"),
        Some(9),
        "record 9",
    );
    drop(store);

    // Moved to another record (its head hash no longer fits), or its time edited (its hash).
    let tmp = checkpointed(None, |_| {});
    edit(
        tmp.path(),
        "UPDATE checkpoints SET sequence = 8 WHERE sequence = 9;
                      UPDATE checkpoints SET at_us = 1 WHERE sequence = 6",
    );
    let store = open(tmp.path());
    assert_eq!(
        pick(&store, None),
        (
            Some(Some(3)),
            vec![(Some(8), "head_hash"), (Some(6), "checkpoint_hash")]
        )
    );
    assert_checkpoint_broken(&store.verify_chain("m").expect("verify"), Some(6), "hash");
    // An `?at=` read refuses them too (by time: the moved one kept its time, 9).
    assert_eq!(
        pick(&store, Some(9)),
        (Some(Some(3)), vec![(Some(8), "head_hash")])
    );
    assert_eq!(
        pick(&store, Some(2)),
        (None, vec![(Some(6), "checkpoint_hash")])
    );
    drop(store);

    // Every checkpoint refused: replay from the spec's initial state.
    let tmp = checkpointed(None, |_| {});
    edit(tmp.path(), "UPDATE checkpoints SET state_hash = hash");
    let store = open(tmp.path());
    assert_eq!(
        pick(&store, None),
        (
            None,
            vec![
                (Some(9), "state_hash"),
                (Some(6), "state_hash"),
                (Some(3), "state_hash")
            ]
        )
    );
}

#[test]
fn recovery_never_falls_back_past_a_restore_or_an_evolve() {
    // A restore after record 4 (a base), periodic checkpoints before and after it.
    let with_base = |w: &Writer| {
        w.apply(checkpoint("m", Some(4), 40, 1000, CheckpointKind::Base))
            .expect("base");
        // A periodic checkpoint at the same record keeps the base.
        w.apply(checkpoint("m", Some(4), 41, 4, CheckpointKind::Periodic))
            .expect("periodic over base");
    };
    let tmp = checkpointed(None, with_base);
    let store = open(tmp.path());
    let cp = store
        .usable_checkpoint("m", Some(Timestamp::from_us(40)))
        .expect("cp")
        .checkpoint
        .expect("some");
    assert_eq!(
        (cp.sequence, cp.kind, cp.state["base"]["qty"].clone()),
        (Some(Seq::new(4)), CheckpointKind::Base, json!(1000))
    );
    drop(store);
    // A refused periodic checkpoint after the base falls back to the base.
    edit(
        tmp.path(),
        "UPDATE checkpoints SET state = replace(state, '\"b\"', '\"c\"') WHERE sequence IN (6, 9)",
    );
    let store = open(tmp.path());
    assert_eq!(
        pick(&store, None),
        (
            Some(Some(4)),
            vec![(Some(9), "state_hash"), (Some(6), "state_hash")]
        )
    );
    drop(store);
    // A refused base is an error, not a state without the restore: even with its kind edited
    // to look periodic, the model's base_seq floor holds.
    for sql in [
        "UPDATE checkpoints SET state = replace(state, '1000', '1001') WHERE sequence = 4",
        "UPDATE checkpoints SET kind = 'periodic' WHERE sequence = 4",
        "DELETE FROM checkpoints WHERE sequence = 4",
    ] {
        let tmp = checkpointed(None, with_base);
        // The periodic checkpoints after it are refused too, so recovery reaches it.
        edit(tmp.path(), "UPDATE checkpoints SET state = replace(state, '\"b\"', '\"c\"') WHERE sequence IN (6, 9)");
        edit(tmp.path(), sql);
        let store = open(tmp.path());
        let err = store.usable_checkpoint("m", None).expect_err(sql);
        assert!(
            matches!(
                &err,
                StoreError::CheckpointUnusable {
                    sequence: Some(s),
                    ..
                } if s.get() == 4
            ),
            "{sql}: {err}"
        );
        assert!(err.to_string().contains("restore"), "{err}");
        let r = store.verify_chain("m").expect("verify");
        assert_checkpoint_broken(
            &r,
            Some(4),
            if sql.starts_with("DELETE") {
                "missing"
            } else {
                ""
            },
        );
        assert_eq!(
            r.checkpoints_checked,
            Some(if sql.starts_with("DELETE") { 3 } else { 4 })
        );
        // Reads of instants before the restore do not need it (unless it is gone, and with
        // it when it was taken).
        if sql.starts_with("DELETE") {
            assert!(store
                .usable_checkpoint("m", Some(Timestamp::from_us(3)))
                .is_err());
        } else {
            assert_eq!(pick(&store, Some(3)).0, Some(Some(3)), "{sql}");
        }
    }
    // A base before the first record (a restore onto a fresh model).
    let tmp = tempfile::tempdir().expect("tempdir");
    {
        let store = open(tmp.path());
        store.writer().apply(put_model("m")).expect("put");
        store
            .writer()
            .apply(checkpoint("m", None, 5, 7, CheckpointKind::Base))
            .expect("base");
    }
    let store = open(tmp.path());
    let cp = store
        .usable_checkpoint("m", None)
        .expect("cp")
        .checkpoint
        .expect("some");
    assert_eq!((cp.sequence, cp.kind), (None, CheckpointKind::Base));
    drop(store);
    edit(
        tmp.path(),
        &format!("UPDATE checkpoints SET head_hash = '{}'", "1".repeat(64)),
    );
    let store = open(tmp.path());
    let err = store
        .usable_checkpoint("m", None)
        .expect_err("refused base");
    assert!(err.to_string().contains("before the first record"), "{err}");
    let r = store.verify_chain("m").expect("verify");
    let b = r.broken_checkpoint.expect("broken");
    assert_eq!(b.sequence, None);
    assert!(b.detail.contains("genesis"), "{}", b.detail);
}

// --- audit key -------------------------------------------------------------------------------

#[test]
fn audit_key_files_are_64_hex_characters_or_32_raw_bytes() {
    let hex = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
    let k = AuditKey::parse(format!("{hex}\n").as_bytes()).expect("hex");
    let mut raw = [0u8; 32];
    for (i, b) in raw.iter_mut().enumerate() {
        *b = [
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff,
        ][i % 16];
    }
    assert_eq!(k, AuditKey::from_bytes(raw));
    assert_eq!(AuditKey::parse(&raw).expect("raw"), k);
    for (bad, word) in [
        (&b""[..], "found 0 bytes"),
        (&hex.as_bytes()[..62], "62 hex characters"),
        (&b"0123456789abcdef0123456789abcdef"[..], "16-byte key"),
        (&[0u8; 33][..], "33 bytes"),
    ] {
        let e = AuditKey::parse(bad).expect_err("refused").to_string();
        assert!(e.contains(word), "{word:?} in {e}");
    }
    assert!(
        !format!("{k:?}").contains("0011"),
        "Debug does not show the key"
    );
    assert_ne!(k.fingerprint(), AuditKey::from_bytes([0; 32]).fingerprint());
}

#[test]
fn a_keyed_store_needs_its_key_and_catches_a_rewrite_without_it() {
    let key = AuditKey::from_bytes([9; 32]);
    let tmp = checkpointed(Some(key), |_| {});
    let store = open_keyed(tmp.path(), Some(key));
    let r = store.verify_chain("m").expect("verify");
    assert!(r.valid, "{r:?}");
    assert_eq!(r.checkpoints_checked, Some(3));
    assert_eq!(pick(&store, None), (Some(Some(9)), vec![]));
    drop(store);
    // Without the key, or with another, the store does not open.
    let err = SqliteStore::open(tmp.path(), StoreOptions::default()).expect_err("no key");
    assert!(matches!(err, StoreError::AuditKeyRequired { .. }), "{err}");
    assert!(err.to_string().contains(&key.fingerprint()[..16]), "{err}");
    let other = AuditKey::from_bytes([8; 32]);
    let err = SqliteStore::open(
        tmp.path(),
        StoreOptions {
            audit_key: Some(other),
            ..Default::default()
        },
    )
    .expect_err("another key");
    assert!(matches!(err, StoreError::AuditKeyMismatch { .. }), "{err}");

    // A consistent rewrite from record 3 on with plain blake3 (hash columns and head too).
    let rewrite = |c: &Connection| {
        let mut recs: Vec<Json> = {
            let mut st = c
                .prepare("SELECT record FROM audit ORDER BY sequence")
                .expect("select");
            st.query_map([], |r| r.get::<_, String>(0))
                .expect("rows")
                .map(|t| serde_json::from_str(&t.expect("text")).expect("json"))
                .collect()
        };
        recs[3]["mutations"]["$.qty"] = json!(333);
        let mut prev = recs[2]["hash"].as_str().expect("hash").to_string();
        for (i, r) in recs.iter_mut().enumerate().skip(3) {
            r["prevHash"] = json!(prev);
            let h = record_hash(&prev, r);
            r["hash"] = json!(h);
            set_record(c, i as i64, r);
            prev = h;
        }
        c.execute("UPDATE models SET head_hash = ?1", [&prev])
            .expect("head");
    };
    {
        let c = Connection::open(tmp.path().join(DB_FILE)).expect("direct");
        rewrite(&c);
    }
    let store = open_keyed(tmp.path(), Some(key));
    let r = store.verify_chain("m").expect("verify");
    assert_eq!(r.first_broken_sequence, Some(3), "{r:?}");
    assert!(r.detail.contains("without this store's audit key"), "{r:?}");
    // The checkpoints after it no longer name their records' hashes.
    assert_eq!(
        r.broken_checkpoint.map(|b| b.sequence),
        Some(Some(Seq::new(3)))
    );
    drop(store);

    // A checkpoint rehashed with plain blake3 after an edit: refused, and said so.
    let tmp = checkpointed(Some(key), |_| {});
    {
        let c = Connection::open(tmp.path().join(DB_FILE)).expect("direct");
        let (head, state): (String, String) = c
            .query_row(
                "SELECT head_hash, state FROM checkpoints WHERE sequence = 9",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("row");
        let state = state.replace("\"qty\":9", "\"qty\":99");
        let state_hash = chain::state_hash(state.as_bytes());
        let hash = chain::checkpoint_hash(
            None,
            &chain::CheckpointHeader {
                model_id: "m",
                sequence: Some(Seq::new(9)),
                at_us: 9,
                kind: "periodic",
                head_hash: &head,
                state_hash: &state_hash,
            },
        );
        c.execute(
            "UPDATE checkpoints SET state = ?1, state_hash = ?2, hash = ?3 WHERE sequence = 9",
            params![state, state_hash, hash],
        )
        .expect("rewrite");
    }
    let store = open_keyed(tmp.path(), Some(key));
    assert_eq!(
        pick(&store, None),
        (Some(Some(6)), vec![(Some(9), "checkpoint_hash")])
    );
    let r = store.verify_chain("m").expect("verify");
    assert_checkpoint_broken(&r, Some(9), "without this store's audit key");
}

#[test]
fn an_unkeyed_store_adopts_a_key_from_each_models_next_record() {
    let key = AuditKey::from_bytes([5; 32]);
    let tmp = checkpointed(None, |w| {
        w.apply(put_model("empty")).expect("put");
    });
    let store = open_keyed(tmp.path(), Some(key));
    let adoption = store.key_adoption().expect("adopted").clone();
    assert_eq!(
        adoption.models,
        vec![("empty".to_string(), 0), ("m".to_string(), 10)]
    );
    assert_eq!(adoption.checkpoints_rehashed, 3);
    assert_eq!(
        store.record_hasher("m").expect("hasher"),
        ChainHasher::keyed(key, 10)
    );
    assert!(store.verify_chain("m").expect("verify").valid);
    assert_eq!(pick(&store, None), (Some(Some(9)), vec![]));
    // Appends go on keyed.
    let mut chain = Chain::new("m");
    for i in 0..10 {
        chain.record(i, i);
    }
    chain.key = Some(key);
    store
        .writer()
        .apply(chain.op(10, 10))
        .expect("keyed append");
    let r = store.verify_chain("m").expect("verify");
    assert!(r.valid && r.records_checked == 11, "{r:?}");
    drop(store);
    assert!(
        open_keyed(tmp.path(), Some(key)).key_adoption().is_none(),
        "adopted once"
    );

    // The plain records before the key are pinned by the anchor: a consistent plain rewrite
    // of records 3..9 (relinking record 10) is caught.
    {
        let c = Connection::open(tmp.path().join(DB_FILE)).expect("direct");
        let mut recs: Vec<Json> = {
            let mut st = c
                .prepare("SELECT record FROM audit WHERE model_id = 'm' ORDER BY sequence")
                .expect("select");
            st.query_map([], |r| r.get::<_, String>(0))
                .expect("rows")
                .map(|t| serde_json::from_str(&t.expect("text")).expect("json"))
                .collect()
        };
        recs[3]["mutations"]["$.qty"] = json!(333);
        let mut prev = recs[2]["hash"].as_str().expect("hash").to_string();
        for (i, r) in recs.iter_mut().enumerate().skip(3).take(7) {
            r["prevHash"] = json!(prev);
            let h = record_hash(&prev, r);
            r["hash"] = json!(h);
            set_record(&c, i as i64, r);
            prev = h;
        }
        // Moving where keying starts needs the key too.
        c.execute("UPDATE models SET key_from = 11 WHERE id = 'm'", [])
            .expect("edit");
    }
    let store = open_keyed(tmp.path(), Some(key));
    let r = store.verify_chain("m").expect("verify");
    assert!(!r.valid, "{r:?}");
    assert_eq!(r.first_broken_sequence, Some(10), "{r:?}");
    drop(store);

    // The key's marking removed: refused with or without the key (no silent re-adoption).
    edit(tmp.path(), "DELETE FROM meta WHERE key = 'audit_key'");
    for k in [None, Some(key)] {
        let err = SqliteStore::open(
            tmp.path(),
            StoreOptions {
                audit_key: k,
                ..Default::default()
            },
        )
        .expect_err("marking removed");
        assert!(err.to_string().contains("anchors"), "{err}");
    }
}

#[test]
fn a_v1_database_migrates_and_its_records_become_path_queryable() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let db = tmp.path().join(DB_FILE);
    let mut chain = Chain::new("m");
    {
        let mut c = Connection::open(&db).expect("v1 db");
        c.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
            .expect("wal");
        schema::migrate(&mut c, &db, 1).expect("v1 schema");
        c.execute(
            "INSERT INTO models (id, spec, version, created_us, updated_us, head_seq, head_hash) VALUES ('m', '{}', '1', 0, 0, NULL, ?1)",
            [GENESIS],
        )
        .expect("model");
        for i in 0..3 {
            let r = chain.record(i, i);
            c.execute(
                "INSERT INTO audit (model_id, sequence, at_us, record, prev_hash, hash) VALUES ('m', ?1, ?1, ?2, ?3, ?4)",
                params![i, r.to_string(), r["prevHash"].as_str(), r["hash"].as_str()],
            )
            .expect("record");
            c.execute(
                "UPDATE models SET head_seq = ?1, head_hash = ?2",
                params![i, r["hash"].as_str()],
            )
            .expect("head");
        }
        // One record that is not JSON must not stop the migration.
        c.execute(
            "INSERT INTO audit VALUES ('junk', 0, 0, 'not json', '', '')",
            [],
        )
        .expect("junk");
    }
    let store = open(tmp.path());
    let v: i64 = Connection::open(&db)
        .and_then(|c| c.query_row("PRAGMA user_version", [], |r| r.get(0)))
        .expect("version");
    assert_eq!(v, schema::SCHEMA_VERSION);
    for prefix in ["$.qty", "$.total"] {
        let f = AuditFilter {
            path_prefix: Some(prefix.into()),
            ..Default::default()
        };
        assert_eq!(
            store.query_audit("m", &f).expect("query").len(),
            3,
            "{prefix} backfilled"
        );
    }
    assert!(store.verify_chain("m").expect("verify").valid);
    store
        .writer()
        .apply(chain.op(3, 3))
        .expect("appends continue the migrated chain");
    assert_eq!(store.verify_chain("m").expect("verify").records_checked, 4);
}

#[test]
fn v2_checkpoints_are_hashed_once_on_migration_and_kept_as_bases() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let db = tmp.path().join(DB_FILE);
    let mut chain = Chain::new("m");
    {
        let mut c = Connection::open(&db).expect("v2 db");
        c.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
            .expect("wal");
        schema::migrate(&mut c, &db, 2).expect("v2 schema");
        for id in ["m", "n"] {
            c.execute(
                "INSERT INTO models (id, spec, version, created_us, updated_us, head_seq, head_hash) VALUES (?1, '{}', '1', 0, 0, NULL, ?2)",
                params![id, GENESIS],
            )
            .expect("model");
        }
        for i in 0..3 {
            let r = chain.record(i, i);
            c.execute(
                "INSERT INTO audit (model_id, sequence, at_us, record, prev_hash, hash) VALUES ('m', ?1, ?1, ?2, ?3, ?4)",
                params![i, r.to_string(), r["prevHash"].as_str(), r["hash"].as_str()],
            )
            .expect("record");
            c.execute(
                "UPDATE models SET head_seq = ?1, head_hash = ?2 WHERE id = 'm'",
                params![i, r["hash"].as_str()],
            )
            .expect("head");
        }
        for (model, seq) in [("m", -1), ("m", 1), ("m", 2), ("n", 0)] {
            c.execute(
                "INSERT INTO checkpoints (model_id, sequence, at_us, state) VALUES (?1, ?2, ?2, ?3)",
                params![model, seq, json!({"base": {"qty": seq}}).to_string()],
            )
            .expect("checkpoint");
        }
    }
    let store = open(tmp.path());
    let c = Connection::open(&db).expect("direct");
    let rows: Vec<(String, i64, String, bool)> = {
        let mut st = c
            .prepare("SELECT model_id, sequence, kind, hash IS NOT NULL FROM checkpoints ORDER BY model_id, sequence")
            .expect("select");
        st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .expect("rows")
            .collect::<Result<_, _>>()
            .expect("read")
    };
    assert_eq!(
        rows,
        vec![
            ("m".to_string(), -1, "legacy".to_string(), true),
            ("m".to_string(), 1, "legacy".to_string(), true),
            ("m".to_string(), 2, "legacy".to_string(), true),
            // Its record is not stored: nothing to bind it to.
            ("n".to_string(), 0, "legacy".to_string(), false),
        ]
    );
    let base: Option<i64> = c
        .query_row("SELECT base_seq FROM models WHERE id = 'm'", [], |r| {
            r.get(0)
        })
        .expect("base");
    assert_eq!(base, Some(2), "the newest legacy checkpoint is the floor");
    let r = store.verify_chain("m").expect("verify");
    assert!(r.valid && r.checkpoints_checked == Some(3), "{r:?}");
    let cp = store
        .usable_checkpoint("m", None)
        .expect("cp")
        .checkpoint
        .expect("some");
    assert_eq!(
        (cp.sequence, cp.kind),
        (Some(Seq::new(2)), CheckpointKind::Legacy)
    );
    let err = store
        .usable_checkpoint("n", None)
        .expect_err("unhashed legacy");
    assert!(err.to_string().contains("no hashes"), "{err}");
    let r = store.verify_chain("n").expect("verify");
    assert_eq!(
        r.broken_checkpoint.map(|b| b.sequence),
        Some(Some(Seq::new(0)))
    );
    drop(store);
    // A legacy checkpoint edited after the migration is refused, and recovery does not guess.
    c.execute("UPDATE checkpoints SET state = replace(state, '2', '3') WHERE model_id = 'm' AND sequence = 2", [])
        .expect("tamper");
    let store = open(tmp.path());
    assert!(matches!(
        store.usable_checkpoint("m", None),
        Err(StoreError::CheckpointUnusable {
            sequence: Some(s),
            ..
        }) if s.get() == 2
    ));
    // New checkpoints are periodic and hashed, above the floor.
    store.writer().apply(chain.op(3, 3)).expect("append");
    store
        .writer()
        .apply(checkpoint("m", Some(3), 3, 3, CheckpointKind::Periodic))
        .expect("checkpoint");
    let cp = store
        .usable_checkpoint("m", None)
        .expect("cp")
        .checkpoint
        .expect("some");
    assert_eq!(
        (cp.sequence, cp.kind),
        (Some(Seq::new(3)), CheckpointKind::Periodic)
    );
}

// --- torn writes -----------------------------------------------------------------------------

const MODELS: [&str; 3] = ["m0", "m1", "m2"];

/// Hashes of acknowledged records per model, in sequence order.
type Acked = BTreeMap<String, Vec<String>>;

fn append_round(w: &Writer, chains: &mut [Chain], acked: &mut Acked, per_model: i64) {
    let mut ops = Vec::new();
    let mut hashes = Vec::new();
    for c in chains.iter_mut() {
        for _ in 0..per_model {
            let r = c.record(c.next as i64, c.next as i64);
            hashes.push((
                c.model.clone(),
                r["hash"].as_str().expect("hash").to_string(),
            ));
            ops.push(Op::AppendAudit(
                AuditAppend::new(
                    Timestamp::from_us(c.next as i64),
                    &r,
                    vec!["$.qty".into()],
                    None,
                )
                .expect("valid"),
            ));
        }
    }
    // Queue the whole round behind a held writer, so it commits as exactly one batch.
    let release = hold_writer(w);
    let rx = submit_all(w, ops);
    release.send(()).expect("release");
    w.flush().expect("flush");
    for ((_, r), (model, hash)) in rx.try_iter().zip(hashes) {
        r.expect("acknowledged");
        acked.entry(model).or_default().push(hash);
    }
}

/// What a reopened copy holds: per model, the number of records, after checking they are exactly
/// the first acknowledged ones and that the chain verifies.
fn surviving(dir: &Path, acked: &Acked) -> Result<usize, StoreError> {
    let store = SqliteStore::open(dir, StoreOptions::default())?;
    let mut total = 0;
    for m in MODELS {
        let report = store.verify_chain(m)?;
        assert!(report.valid, "{m}: {report:?}");
        let mut got: Vec<String> = Vec::new();
        store.audit_after(m, None, None, |e| {
            got.push(e.record["hash"].as_str().expect("hash").to_string());
            ControlFlow::Continue(())
        })?;
        assert_eq!(
            got[..],
            acked[m][..got.len()],
            "{m}: survivors are a prefix of the acknowledged records"
        );
        total += got.len();
    }
    Ok(total)
}

fn copy_truncated(from: &Path, to: &Path, file: &str, len: u64) {
    std::fs::create_dir_all(to).expect("mkdir");
    for name in [DB_FILE, &format!("{DB_FILE}-wal"), MARKER_FILE] {
        if from.join(name).exists() {
            std::fs::copy(from.join(name), to.join(name)).expect("copy");
        }
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(to.join(file))
        .expect("open copy");
    f.set_len(len).expect("truncate");
}

#[test]
fn a_torn_wal_loses_only_whole_batches_after_the_last_checkpoint() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let live = tmp.path().join("live");
    let mut chains: Vec<Chain> = MODELS.iter().map(|m| Chain::new(m)).collect();
    let mut acked = Acked::new();
    {
        let store = open(&live);
        let w = store.writer();
        for m in MODELS {
            w.apply(put_model(m)).expect("put");
        }
        for _ in 0..5 {
            append_round(&w, &mut chains, &mut acked, 20);
        }
        store
            .close()
            .expect("close folds the WAL into the database");
    }
    let checkpointed: usize = acked.values().map(Vec::len).sum();
    assert_eq!(checkpointed, 300);
    let store = open(&live);
    let w = store.writer();
    for _ in 0..12 {
        append_round(&w, &mut chains, &mut acked, 5);
    }
    let total: usize = acked.values().map(Vec::len).sum();
    let wal = live.join(format!("{DB_FILE}-wal"));
    let wal_len = std::fs::metadata(&wal).expect("wal").len();
    assert!(
        wal_len > 32 + 24 + 4096,
        "the second phase lives in the WAL ({wal_len} bytes)"
    );

    // Offsets: empty, header only, inside the first frame, every frame boundary ± a little, and a
    // spread of arbitrary ones.
    let frame = 24 + 4096u64;
    let mut offsets = vec![0, 16, 32, 32 + 10, 32 + 24 + 100, wal_len - 1, wal_len];
    let mut f = 32;
    while f < wal_len {
        offsets.extend([f, f + 1, f + 24 + 2048]);
        f += frame * (wal_len / frame / 10).max(1);
    }
    let mut x = 0x9E37_79B9u64;
    for _ in 0..10 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        offsets.push(x % wal_len);
    }
    offsets.sort_unstable();
    offsets.dedup();
    let mut last = 0;
    let mut outcomes = std::collections::BTreeSet::new();
    for (i, off) in offsets
        .iter()
        .copied()
        .filter(|o| *o <= wal_len)
        .enumerate()
    {
        let copy = tmp.path().join(format!("wal-{i}"));
        copy_truncated(&live, &copy, &format!("{DB_FILE}-wal"), off);
        let n = surviving(&copy, &acked).expect("a torn WAL always opens");
        assert!(
            n >= checkpointed,
            "offset {off}: {n} < {checkpointed} checkpointed records"
        );
        assert!(
            n >= last,
            "offset {off}: a longer WAL kept fewer records ({n} < {last})"
        );
        if off < 32 + 24 + 4096 {
            assert_eq!(
                n, checkpointed,
                "offset {off}: no whole frame, nothing beyond the checkpoint"
            );
        }
        outcomes.insert(n);
        last = n;
    }
    assert_eq!(last, total, "the whole WAL keeps every acknowledged record");
    // Commits are 15-record batches: every outcome is a whole number of batches, and the offsets
    // hit several of them (the test sees partial WALs, not only all-or-nothing).
    assert!(
        outcomes
            .iter()
            .all(|n| (n - checkpointed).is_multiple_of(15)),
        "{outcomes:?}"
    );
    assert!(outcomes.len() >= 5, "{outcomes:?}");
    drop(store);
}

#[test]
fn a_truncated_database_file_is_refused_naming_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let live = tmp.path().join("live");
    let mut chains: Vec<Chain> = MODELS.iter().map(|m| Chain::new(m)).collect();
    let mut acked = Acked::new();
    {
        let store = open(&live);
        let w = store.writer();
        for m in MODELS {
            w.apply(put_model(m)).expect("put");
        }
        for _ in 0..5 {
            append_round(&w, &mut chains, &mut acked, 20);
        }
        store.close().expect("close");
    }
    let db_len = std::fs::metadata(live.join(DB_FILE)).expect("db").len();
    assert!(
        !live.join(format!("{DB_FILE}-wal")).exists()
            || std::fs::metadata(live.join(format!("{DB_FILE}-wal")))
                .expect("wal")
                .len()
                == 0
    );
    // Without a WAL every truncation is visible in the header: refused at open, naming the file.
    for (i, off) in [
        0,
        50,
        99,
        100,
        4096,
        4097,
        db_len / 2,
        db_len - 4096,
        db_len - 1,
    ]
    .into_iter()
    .enumerate()
    {
        let copy = tmp.path().join(format!("db-{i}"));
        copy_truncated(&live, &copy, DB_FILE, off);
        match SqliteStore::open(&copy, StoreOptions::default()) {
            Err(StoreError::Corrupt { path, detail }) => {
                assert_eq!(path, copy.join(DB_FILE), "{detail}")
            }
            Err(e) => panic!("offset {off}: expected Corrupt, got {e:?}"),
            Ok(_) => panic!("offset {off}: a truncated database opened"),
        }
    }
    assert_eq!(surviving(&live, &acked).expect("the original opens"), 300);

    // With a WAL holding frames the header check is inconclusive; SQLite's quick_check decides at
    // open, so the store either opens with every acknowledged record intact or names the file.
    {
        let store = open(&live);
        let w = store.writer();
        for _ in 0..4 {
            append_round(&w, &mut chains, &mut acked, 5);
        }
        let db_len = std::fs::metadata(live.join(DB_FILE)).expect("db").len();
        for (i, off) in [4096, db_len / 2, db_len - 4096].into_iter().enumerate() {
            let copy = tmp.path().join(format!("dbwal-{i}"));
            copy_truncated(&live, &copy, DB_FILE, off);
            let outcome = surviving(&copy, &acked);
            match outcome {
                Ok(n) => assert_eq!(n, 360, "offset {off}: opened but lost acknowledged records"),
                Err(StoreError::Corrupt { path, .. }) => assert_eq!(path, copy.join(DB_FILE)),
                Err(e) => panic!("offset {off}: expected Corrupt, got {e:?}"),
            }
        }
    }
}

/// A record sealed once by the caller is the record the validating constructor accepts: the
/// same fields in the same order and the same hash, plain and keyed, and the store chains it.
#[test]
fn a_sealed_record_is_the_validated_record_and_chains_in_the_store() {
    for key in [None, Some(AuditKey::from_bytes([7; 32]))] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = open_keyed(tmp.path(), key);
        let w = store.writer();
        let mut chain = Chain::new("m");
        chain.key = key;
        let mut ops = vec![put_model("m")];
        for i in 0..3i64 {
            let validated = chain.record(10 + i, i);
            let mut fields = validated.as_object().expect("object").clone();
            for k in ["modelId", "sequence", "prevHash", "hash"] {
                fields.shift_remove(k);
            }
            let prev = validated["prevHash"].as_str().expect("prevHash");
            let sealed = Sealed::seal("m", Seq::new(i as u64), prev, fields, key.as_ref());
            assert_eq!(sealed.json(), &validated, "key {key:?}, record {i}");
            assert_eq!(
                serde_json::to_string(sealed.json()).expect("text"),
                serde_json::to_string(&validated).expect("text"),
                "member order, key {key:?}"
            );
            assert_eq!(Some(sealed.hash()), validated["hash"].as_str());
            let a = AuditAppend::sealed(
                Timestamp::from_us(10 + i),
                &sealed,
                vec!["$.qty".into(), "$.qty".into()],
            )
            .expect("appendable");
            assert_eq!((a.model_id(), a.sequence()), ("m", Seq::new(i as u64)));
            ops.push(Op::AppendAudit(a));
        }
        let rx = submit_all(&w, ops);
        store.flush().expect("flush");
        let results: Vec<_> = rx.try_iter().collect();
        assert_eq!(results.len(), 4);
        assert!(results.iter().all(|(_, r)| r.is_ok()), "{results:?}");
        assert_eq!(records(&store, "m").len(), 3);
        let report = store.verify_chain("m").expect("verify");
        assert!(report.valid, "{report:?}");
        assert_eq!(report.records_checked, 3);
    }
}

#[test]
fn models_of_one_content_share_one_spec_text_until_the_last_goes() {
    let dir = tempfile::tempdir().expect("tmp");
    let store = open(dir.path());
    let spec = |id: &str, v: &str| Op::PutModel {
        id: id.into(),
        spec_text: format!(r#"{{"id":"{id}","version":"{v}","schema":{{"type":"object"}}}}"#),
        version: v.into(),
        at: Timestamp::from_us(1),
    };
    let w = store.writer();
    for op in [spec("a", "1.0.0"), spec("b", "1.0.0"), spec("c", "1.0.0")] {
        w.apply(op).expect("stored");
    }
    let texts = |s: &SqliteStore| -> i64 {
        s.with_reader(|c| {
            c.query_row("SELECT count(*) FROM spec_texts", [], |r| r.get(0))
                .map_err(|e| sql_err(&s.db, e))
        })
        .expect("count")
    };
    assert_eq!(texts(&store), 1, "three models, one content");
    for id in ["a", "b", "c"] {
        let m = store.load_model(id).expect("read").expect("stored");
        assert_eq!(
            m.spec_text,
            format!(r#"{{"id":"{id}","version":"1.0.0","schema":{{"type":"object"}}}}"#)
        );
    }
    assert_eq!(
        store.model_ids(Some("\"object\"")).expect("ids"),
        ["a", "b", "c"]
    );
    assert!(store.model_ids(Some("statusPath")).expect("ids").is_empty());
    // An evolved spec is a second content; deleting the last model of one drops its text.
    w.apply(spec("b", "2.0.0")).expect("evolved");
    assert_eq!(texts(&store), 2);
    w.apply(Op::DeleteModel { id: "b".into() })
        .expect("deleted");
    assert_eq!(texts(&store), 1);
    for id in ["a", "c"] {
        w.apply(Op::DeleteModel { id: id.into() }).expect("deleted");
    }
    assert_eq!(texts(&store), 0);
    // A text that does not start with its id is kept whole, and read back as it was.
    let odd = r#"{"version":"1","id":"odd"}"#;
    w.apply(Op::PutModel {
        id: "odd".into(),
        spec_text: odd.into(),
        version: "1".into(),
        at: Timestamp::from_us(1),
    })
    .expect("stored");
    assert_eq!(texts(&store), 0);
    assert_eq!(
        store
            .load_model("odd")
            .expect("read")
            .expect("stored")
            .spec_text,
        odd
    );
    let all = store.load_models().expect("all");
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].spec_text, odd);
}
