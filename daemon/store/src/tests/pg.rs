//! The PostgreSQL store against a real PostgreSQL server (started per test by
//! [`crate::pg::testing::TestServer`]): the SQLite store's own scenarios through the `Store`
//! trait, tampering done with SQL on the server, keys, schema versions, and a server that is
//! down at start or goes away mid-run.

use super::*;
use crate::pg::testing::TestServer;

const DB: &str = "valem_test";

/// A fresh server and database; `Err` only when PostgreSQL's binaries are missing, which is a
/// failure (scripts/test installs them), with the reason.
fn server() -> (TestServer, String) {
    let s = TestServer::start().unwrap_or_else(|e| panic!("a PostgreSQL test server: {e}"));
    let url = s
        .create_db(DB)
        .unwrap_or_else(|e| panic!("create database: {e}"));
    (s, url)
}

fn pg_open(url: &str) -> impl Fn(StoreOptions) -> Box<dyn Store> + '_ {
    move |opts| Box::new(PgStore::open(url, opts).unwrap_or_else(|e| panic!("open: {e}")))
}

fn count(s: &TestServer) -> impl Fn(&str) -> i64 + '_ {
    move |sql| s.count(DB, sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[test]
fn pg_everything_written_is_back_after_reopen() {
    let (s, url) = server();
    written_is_back(&pg_open(&url));
    // The bytes live in the database (a fleet shares no directory).
    assert_eq!(count(&s)("SELECT count(*) FROM blob_bytes"), 1);
}

#[test]
fn pg_ops_that_break_the_chain_fail_alone() {
    let (_s, url) = server();
    chain_breakers_fail_alone(&*pg_open(&url)(StoreOptions::default()));
}

#[test]
fn pg_an_atomic_op_that_fails_half_way_leaves_nothing() {
    let (_s, url) = server();
    atomic_fails_whole(&*pg_open(&url)(StoreOptions::default()));
}

#[test]
fn pg_acks_follow_the_commit_in_order_and_batches_are_bounded() {
    let (s, url) = server();
    let probe = s.url(DB);
    let count = move |sql: &str| -> i64 {
        let mut c: postgres::Config = probe.parse().expect("url");
        c.options("-c search_path=valem");
        let mut c = c.connect(postgres::NoTls).expect("probe connection");
        c.query_one(sql, &[]).expect("probe query").get(0)
    };
    acks_follow_commits(&pg_open(&url), Arc::new(count));
}

#[test]
fn pg_delete_model_removes_its_rows_from_every_table() {
    let (s, url) = server();
    delete_removes_every_row(&*pg_open(&url)(StoreOptions::default()), &count(&s));
}

#[test]
fn pg_appends_to_many_models_in_one_batch_fail_alone() {
    let (_s, url) = server();
    batched_appends_fail_alone(&*pg_open(&url)(StoreOptions::default()));
}

#[test]
fn pg_keyed_writes_are_kept_with_their_records() {
    let (_s, url) = server();
    keys_kept_with_records(&pg_open(&url));
}

#[test]
fn pg_relaxed_commits_do_not_sync_and_a_flush_does() {
    let (_s, url) = server();
    relaxed_flush_syncs(&pg_open(&url));
}

#[test]
fn pg_a_closed_store_answers_every_submit() {
    let (_s, url) = server();
    closed_store_answers(pg_open(&url)(StoreOptions::default()));
}

#[test]
fn pg_models_of_one_content_share_one_spec_text() {
    let (s, url) = server();
    let store = pg_open(&url)(StoreOptions::default());
    let w = store.writer();
    let spec = |id: &str| format!("{{\"id\":\"{id}\",\"version\":\"1.0.0\",\"schema\":{{}}}}");
    for id in ["a", "b", "c"] {
        w.apply(Op::PutModel {
            id: id.into(),
            spec_text: spec(id),
            version: "1.0.0".into(),
            at: Timestamp::from_us(1),
        })
        .expect("put");
    }
    assert_eq!(count(&s)("SELECT count(*) FROM spec_texts"), 1);
    let b = store.load_model("b").expect("load").expect("stored");
    assert_eq!(b.spec_text, spec("b"));
    assert_eq!(
        store.model_ids(Some("schema")).expect("ids"),
        vec!["a", "b", "c"]
    );
    assert!(store.model_ids(Some("nowhere")).expect("ids").is_empty());
    for id in ["a", "b", "c"] {
        w.apply(Op::DeleteModel { id: id.into() }).expect("delete");
    }
    assert_eq!(count(&s)("SELECT count(*) FROM spec_texts"), 0);
}

/// Model `m` with records 0..10 and periodic checkpoints after 3 and 7.
fn ten(store: &dyn Store) -> Vec<Json> {
    let w = store.writer();
    w.apply(put_model("m")).expect("put");
    let mut chain = Chain::new("m");
    let mut recs = Vec::new();
    for i in 0..10 {
        let r = chain.record(100 + i, i);
        recs.push(r.clone());
        w.apply(Op::AppendAudit(
            AuditAppend::new(Timestamp::from_us(100 + i), &r, vec!["$.qty".into()], None)
                .expect("valid"),
        ))
        .expect("append");
        if i == 3 || i == 7 {
            w.apply(Op::Checkpoint {
                model_id: "m".into(),
                sequence: Some(Seq::new(i as u64)),
                at: Timestamp::from_us(100 + i),
                state: json!({"qty": i}),
                kind: CheckpointKind::Periodic,
            })
            .expect("checkpoint");
        }
    }
    recs
}

#[test]
fn pg_tampering_is_caught_by_the_chain_and_checkpoint_checks() {
    let (s, url) = server();
    let store = pg_open(&url)(StoreOptions::default());
    let recs = ten(&*store);
    let r = store.verify_chain("m").expect("verify");
    assert!(r.valid, "{r:?}");
    assert_eq!((r.records_checked, r.checkpoints_checked), (10, Some(2)));

    // A flipped value inside record 4.
    let edited = serde_json::to_string(&recs[4])
        .expect("text")
        .replace("\"$.qty\":4", "\"$.qty\":5");
    s.sql(
        DB,
        &format!(
            "UPDATE audit SET record = '{}' WHERE model_id = 'm' AND sequence = 4",
            edited.replace('\'', "''")
        ),
    )
    .expect("edit");
    let r = store.verify_chain("m").expect("verify");
    assert_eq!(
        (r.valid, r.first_broken_sequence),
        (false, Some(4)),
        "{r:?}"
    );
    // Put it back, then delete record 6.
    let original = serde_json::to_string(&recs[4]).expect("text");
    s.sql(
        DB,
        &format!(
            "UPDATE audit SET record = '{}' WHERE model_id = 'm' AND sequence = 4",
            original.replace('\'', "''")
        ),
    )
    .expect("restore");
    assert!(store.verify_chain("m").expect("verify").valid);
    s.sql(
        DB,
        "DELETE FROM audit WHERE model_id = 'm' AND sequence = 6",
    )
    .expect("delete");
    let r = store.verify_chain("m").expect("verify");
    assert_eq!(
        (r.valid, r.first_broken_sequence),
        (false, Some(6)),
        "{r:?}"
    );

    // An edited checkpoint state is refused; recovery falls back to the one before it.
    s.sql(
        DB,
        "UPDATE checkpoints SET state = '{\"qty\":70}' WHERE model_id = 'm' AND sequence = 7",
    )
    .expect("edit checkpoint");
    let choice = store.usable_checkpoint("m", None).expect("choice");
    assert_eq!(
        choice.checkpoint.map(|c| (c.sequence, c.state)),
        Some((Some(Seq::new(3)), json!({"qty": 3})))
    );
    assert_eq!(choice.refused.len(), 1);
    assert_eq!(choice.refused[0].fault, CheckpointFault::StateHash);
    // As of an instant before checkpoint 7: checkpoint 3, nothing refused.
    let at = store
        .usable_checkpoint("m", Some(Timestamp::from_us(105)))
        .expect("choice at");
    assert_eq!(at.checkpoint.map(|c| c.sequence), Some(Some(Seq::new(3))));
    assert!(at.refused.is_empty());
    let (checked, broken) = store.verify_model_checkpoints("m").expect("checkpoints");
    assert_eq!(checked, 2);
    assert_eq!(broken.map(|b| b.sequence), Some(Some(Seq::new(7))));
}

#[test]
fn pg_a_keyed_store_needs_its_key_and_an_unkeyed_one_adopts_it() {
    let (_s, url) = server();
    let key = AuditKey::from_bytes([7; 32]);
    {
        let store = pg_open(&url)(StoreOptions::default());
        ten(&*store);
    }
    let keyed = StoreOptions {
        audit_key: Some(key),
        ..Default::default()
    };
    {
        let store = PgStore::open(&url, keyed.clone()).expect("adopts");
        let a = store.key_adoption().expect("adopted").clone();
        assert_eq!(a.models, vec![("m".to_string(), 10)]);
        assert_eq!(a.checkpoints_rehashed, 2);
        // The next record is keyed.
        let mut chain = Chain::new("m");
        for i in 0..10 {
            chain.record(100 + i, i);
        }
        chain.key = Some(key);
        let hasher = Store::record_hasher(&store, "m").expect("hasher");
        assert!(hasher.key().is_some());
        store
            .writer()
            .apply(chain.op(200, 10))
            .expect("keyed append");
        let r = store.verify_chain("m").expect("verify");
        assert!(r.valid, "{r:?}");
        assert_eq!(r.records_checked, 11);
    }
    let err = PgStore::open(&url, StoreOptions::default()).expect_err("needs the key");
    assert!(matches!(err, StoreError::AuditKeyRequired { .. }), "{err}");
    let other = StoreOptions {
        audit_key: Some(AuditKey::from_bytes([8; 32])),
        ..Default::default()
    };
    let err = PgStore::open(&url, other).expect_err("another key");
    assert!(matches!(err, StoreError::AuditKeyMismatch { .. }), "{err}");
    assert!(PgStore::open(&url, keyed).is_ok(), "its own key opens it");
}

#[test]
fn pg_a_schema_from_a_newer_build_is_refused_naming_both_versions() {
    let (s, url) = server();
    drop(pg_open(&url)(StoreOptions::default()));
    s.sql(DB, "UPDATE schema_version SET version = 99")
        .expect("bump");
    let err = PgStore::open(&url, StoreOptions::default()).expect_err("too new");
    assert!(
        matches!(err, StoreError::SchemaTooNew { found: 99, supported, .. } if supported == crate::pg::SCHEMA_VERSION),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("99") && text.contains("upgrade valem"),
        "{text}"
    );
}

#[test]
fn pg_an_unreachable_server_is_unavailable_and_the_password_is_not_shown() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let url = format!("postgres://valem:s3cret@127.0.0.1:{port}/nowhere");
    let err = PgStore::open(&url, StoreOptions::default()).expect_err("nobody listens");
    assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("postgres://valem@127.0.0.1:{port}/nowhere")),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
    let err = PgStore::open("postgres://[::1", StoreOptions::default()).expect_err("bad url");
    assert!(
        err.to_string()
            .contains("not a PostgreSQL connection string"),
        "{err}"
    );
}

#[test]
fn pg_a_server_that_goes_away_fails_writes_whole_and_the_writer_reconnects() {
    let (mut s, url) = server();
    let store = pg_open(&url)(StoreOptions::default());
    let w = store.writer();
    w.apply(put_model("m")).expect("put");
    let mut chain = Chain::new("m");
    for i in 0..5 {
        w.apply(chain.op(i, i)).expect("append");
    }
    s.stop();
    // The write while the server is down fails as a whole, and says so.
    let pending = chain.op(5, 5);
    let err = w.apply(pending.clone()).expect_err("server down");
    assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
    assert!(matches!(
        store.load_model("m"),
        Err(StoreError::Unavailable { .. })
    ));
    assert!(store.stats().batches_failed >= 1);
    s.restart().expect("server back");
    // Nothing of the failed write was committed: the same op goes in now.
    w.apply(pending).expect("the writer reconnects");
    for i in 6..10 {
        w.apply(chain.op(i, i)).expect("append");
    }
    let r = store.verify_chain("m").expect("verify");
    assert_eq!((r.valid, r.records_checked), (true, 10), "{r:?}");
    assert_eq!(records(&*store, "m").len(), 10);
}

#[test]
fn pg_blobs_are_checked_on_read() {
    let (s, url) = server();
    let store = PgStore::open(
        &url,
        StoreOptions {
            max_blob_bytes: 64,
            ..Default::default()
        },
    )
    .expect("open");
    let hash = store.put_blob_bytes(b"some bytes").expect("put");
    assert_eq!(store.blob_bytes(&hash).expect("read"), b"some bytes");
    assert!(matches!(
        store.put_blob_bytes(&[0; 65]),
        Err(StoreError::BlobTooLarge { size: 65, .. })
    ));
    assert!(matches!(
        store.blob_bytes("ABC"),
        Err(StoreError::InvalidBlobHash { .. })
    ));
    assert!(matches!(
        store.blob_bytes(&"0".repeat(64)),
        Err(StoreError::BlobNotFound { .. })
    ));
    s.sql(DB, "UPDATE blob_bytes SET bytes = 'other bytes'::bytea")
        .expect("tamper");
    assert!(matches!(
        store.blob_bytes(&hash),
        Err(StoreError::Corrupt { .. })
    ));
    store
        .quick_check()
        .expect("the server answers with this schema");
}

fn node(id: &str, lease_ms: u64, renew: bool) -> StoreOptions {
    StoreOptions {
        node: Some(crate::pg::NodeConfig {
            id: id.into(),
            url: format!("http://{id}.test"),
            lease: std::time::Duration::from_millis(lease_ms),
            renew,
        }),
        ..Default::default()
    }
}

#[test]
fn pg_one_owner_at_a_time_and_a_node_past_its_lease_is_fenced() {
    let (_s, url) = server();
    let a = PgStore::open(&url, node("a", 400, false)).expect("node a");
    let b = PgStore::open(&url, node("b", 400, false)).expect("node b");
    let own = a.claim("m").expect("a claims");
    assert_eq!((own.node.as_str(), own.epoch), ("a", 1));
    assert_eq!(
        a.claim("m").expect("again").epoch,
        1,
        "a claim of its own keeps the epoch"
    );
    a.writer().apply(put_model("m")).expect("create");
    let mut mine = Chain::new("m");
    for i in 0..3 {
        a.writer().apply(mine.op(i, i)).expect("a writes");
    }
    // While a's lease holds, b can neither claim nor write.
    match b.claim("m") {
        Err(StoreError::OwnedElsewhere { node, url, .. }) => {
            assert_eq!((node.as_str(), url.as_str()), ("a", "http://a.test"));
        }
        other => panic!("b claimed a held model: {other:?}"),
    }
    let mut theirs = Chain::new("m");
    let err = b
        .writer()
        .apply(theirs.op(9, 9))
        .expect_err("b holds nothing");
    assert!(matches!(err, StoreError::Fenced { .. }), "{err}");
    assert!(a.renew().expect("renew").is_empty());

    // a is paused past its lease: b claims with the next epoch and continues the chain.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let own = b.claim("m").expect("b claims after the lease ran out");
    assert_eq!((own.node.as_str(), own.epoch), ("b", 2));
    let stored = b.load_model("m").expect("load").expect("stored");
    assert_eq!(stored.head_seq, Some(Seq::new(2)));
    let mut theirs = Chain::new("m");
    theirs.next = 3;
    theirs.prev = stored.head_hash.clone();
    b.writer()
        .apply(theirs.op(10, 30))
        .expect("b writes record 3");

    // a wakes up and commits its own record 3: fenced, nothing written.
    let err = a.writer().apply(mine.op(11, 3)).expect_err("a is fenced");
    assert!(
        matches!(&err, StoreError::Fenced { detail, .. } if detail.contains("node `b`")),
        "{err}"
    );
    assert_eq!(
        a.renew().expect("renew"),
        vec!["m".to_string()],
        "a learns it lost m"
    );
    let r = a.verify_chain("m").expect("verify");
    assert_eq!((r.valid, r.records_checked), (true, 4), "{r:?}");
    assert_eq!(
        records(&a, "m")[3]["mutations"]["$.qty"],
        json!(30),
        "record 3 is b's"
    );

    // b stops renewing: a takes it when b's lease runs out.
    assert!(b.renew().expect("renew").is_empty());
    assert!(matches!(
        a.claim("m"),
        Err(StoreError::OwnedElsewhere { .. })
    ));
    std::thread::sleep(std::time::Duration::from_millis(450));
    assert_eq!(a.claim("m").expect("a again").epoch, 3);
    // A release (written after the ops before it) hands it over at once.
    a.writer()
        .apply(Op::Release {
            model_id: "m".into(),
        })
        .expect("release");
    a.release("m").expect("forget");
    assert_eq!(b.claim("m").expect("b at once").epoch, 4);
    let err = a.writer().apply(mine.op(12, 5)).expect_err("a released it");
    assert!(matches!(err, StoreError::Fenced { .. }), "{err}");
    a.claim("m").expect_err("b holds it now");
    b.writer()
        .apply(Op::Release {
            model_id: "m".into(),
        })
        .expect("release");
    assert_eq!(a.claim("m").expect("a again").epoch, 5);
    let owner = b.owner("m").expect("owner").expect("owned");
    assert_eq!((owner.node.as_str(), owner.epoch), ("a", 5));
    let nodes = b.nodes().expect("nodes");
    assert_eq!(
        nodes
            .iter()
            .map(|n| (n.id.as_str(), n.url.as_str(), n.models))
            .collect::<Vec<_>>(),
        vec![("a", "http://a.test", 1), ("b", "http://b.test", 0)]
    );
}

#[test]
fn pg_a_renewing_node_keeps_its_models_past_many_leases() {
    let (_s, url) = server();
    let a = PgStore::open(&url, node("a", 300, true)).expect("node a");
    let b = PgStore::open(&url, node("b", 300, false)).expect("node b");
    a.claim("m").expect("claim");
    a.writer().apply(put_model("m")).expect("create");
    std::thread::sleep(std::time::Duration::from_millis(1000));
    assert!(matches!(
        b.claim("m"),
        Err(StoreError::OwnedElsewhere { .. })
    ));
    assert!(a.take_lost().is_empty());
    let nodes = b.nodes().expect("nodes");
    assert!(nodes.iter().any(|n| n.id == "a" && n.alive), "{nodes:?}");
    // Stopped, its leases run out and another node takes over.
    drop(a);
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert_eq!(b.claim("m").expect("b takes over").epoch, 2);
}
