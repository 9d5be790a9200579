//! Durable mutations through the real daemon: release `valem serve --data-dir` (strict: a
//! mutation is answered only after its batch is fsynced), REST keep-alive clients on one shared
//! model (every write through one shard, the worst case), 1, 4 and 16 writers. Prints
//! mutations/s, p50/p99, fsyncs/s and records per batch (from `/metrics`); then the restart
//! after `kill -9` (recovery from the newest checkpoint plus replay) and time-travel reads
//! (`?at=`, rebuilt from the store); last, recovery of a store filled with 1M records
//! (checkpointed every 1,000) and of 100k records without checkpoints (the engine's replay rate).
//! Issue 6 targets: >= 10,000 durable mutations/s with 16 writers, recovery of 1M records <= 10 s,
//! `at=` <= 10 ms.
//!
//! Needs `target/release/valem` (or `VALEM_BIN`); a plain run, no criterion group.

use std::time::Instant;

use serde_json::json;
use valem_tests::load::{self, Conn, Surface};

const DEMO: &str = r#"{"id":"demo","version":"1","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}]}"#;

struct Daemon(valem_benches::Serve);

impl std::ops::Deref for Daemon {
    type Target = valem_benches::Serve;
    fn deref(&self) -> &valem_benches::Serve {
        &self.0
    }
}

impl Daemon {
    fn start(bin: &std::path::Path, dir: &std::path::Path) -> Option<Daemon> {
        valem_benches::Serve::start(bin, &["--data-dir".as_ref(), dir.as_os_str()]).map(Daemon)
    }

    fn get(&self, path: &str) -> Option<load::RawReply> {
        Conn::open(&self.addr)
            .ok()?
            .request("GET", path, &[], b"")
            .ok()
    }

    /// A counter from `/metrics`.
    fn metric(&self, name: &str) -> f64 {
        let Some(r) = self.get("/metrics") else {
            return f64::NAN;
        };
        String::from_utf8_lossy(&r.body)
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or(f64::NAN)
    }
}

fn main() {
    let Some(bin) = valem_benches::release_valem("durable runs") else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temporary data directory");
    let Some(d) = Daemon::start(&bin, dir.path()) else {
        eprintln!("durable: valem serve did not start");
        return;
    };
    let mut c = Conn::open(&d.addr).expect("a connection");
    let r = c
        .request(
            "POST",
            "/models",
            &[("Content-Type", "application/json")],
            DEMO.as_bytes(),
        )
        .expect("create the demo model");
    assert_eq!(r.status, 201);
    let mut written = 0usize;
    let mut marks = Vec::new();
    for (clients, per_client) in [(1, 2_000), (4, 1_500), (16, 800)] {
        let (f0, b0, o0) = (
            d.metric("valem_store_fsyncs_total"),
            d.metric("valem_store_batches_total"),
            d.metric("valem_store_ops_total"),
        );
        let r = load::run(
            &d.addr,
            Surface::Rest,
            "demo",
            clients,
            per_client,
            |c, i| json!({"$.price": (c * 100_000 + i) as f64 + 0.5, "$.qty": 3}),
        );
        assert!(
            r.errors.is_empty(),
            "{:?}",
            &r.errors[..r.errors.len().min(3)]
        );
        written += r.mutations;
        let secs = r.wall.as_secs_f64();
        let fsyncs = d.metric("valem_store_fsyncs_total") - f0;
        let batches = d.metric("valem_store_batches_total") - b0;
        let ops = d.metric("valem_store_ops_total") - o0;
        println!(
            "{}; {:.0} fsyncs/s, {:.1} writes per batch",
            r.summary("durable/rest_strict"),
            fsyncs / secs,
            ops / batches.max(1.0)
        );
        marks.push(newest_instant(&d));
    }

    // Recovery after kill -9: no shutdown checkpoint, so the restart loads the newest periodic
    // checkpoint and replays the records after it.
    drop(d);
    let started = Instant::now();
    let Some(d) = Daemon::start(&bin, dir.path()) else {
        eprintln!("durable: the restart failed");
        return;
    };
    println!(
        "durable/recovery after kill -9: {written} records stored, listening again in {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );

    // Time travel to instants before the restart: checkpoint + replay from the store.
    let mut us = Vec::new();
    for i in 0..60 {
        let Some(at) = marks.get(i % marks.len()).cloned().flatten() else {
            continue;
        };
        let t = Instant::now();
        let r = d.get(&format!("/models/demo/state?at={at}"));
        us.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(r.map(|r| r.status), Some(200));
    }
    us.sort_by(f64::total_cmp);
    if !us.is_empty() {
        println!(
            "durable/state_at (rebuilt from the store, {} records): {} reads, p50 {:.0} µs, max {:.0} µs",
            written,
            us.len(),
            us[us.len() / 2],
            us[us.len() - 1]
        );
    }
    drop(d);

    // Recovery at scale: a store filled directly (synthetic records of the demo model), then the
    // daemon started on it. With checkpoints every 1,000 a restart replays at most 999 records;
    // without, every record goes through the engine again.
    for (n, every) in [(1_000_000u64, Some(1_000u64)), (100_000, None)] {
        let dir = tempfile::tempdir().expect("a temporary data directory");
        let t = Instant::now();
        fill(dir.path(), n, every);
        let filled = t.elapsed();
        let t = Instant::now();
        let Some(d) = Daemon::start(&bin, dir.path()) else {
            eprintln!("durable: the daemon did not start on the filled store");
            return;
        };
        let took = t.elapsed();
        let state = d.get("/models/demo/state").map(|r| r.status);
        assert_eq!(state, Some(200));
        let rate = match every {
            Some(k) => format!("checkpoint every {k}"),
            None => format!(
                "no checkpoints: {:.0} records/s replayed",
                n as f64 / took.as_secs_f64()
            ),
        };
        println!(
            "durable/recovery of {n} records ({rate}): ready in {:.0} ms; store filled in {:.1} s",
            took.as_secs_f64() * 1e3,
            filled.as_secs_f64()
        );
    }
}

/// A store holding the demo model and `n` records of it (`$.qty` writes), with a checkpoint of
/// the state every `every` records.
fn fill(dir: &std::path::Path, n: u64, every: Option<u64>) {
    use valem_store::{Op, SqliteStore, StoreOptions};
    let store = SqliteStore::open(dir, StoreOptions::default()).expect("open the store");
    let w = store.writer();
    w.apply(Op::PutModel {
        id: "demo".into(),
        spec_text: DEMO.into(),
        version: "1".into(),
        at: valem_store::Timestamp::from_us(valem_benches::T0 - 1),
    })
    .expect("the model");
    let mut chain = valem_benches::AuditChain::new("demo");
    for i in 0..n {
        w.submit(chain.next_op(), Box::new(|r| r.expect("append")));
        if every.is_some_and(|k| (i + 1) % k == 0) {
            let state = json!({"base": {"qty": i % 1000}, "effectKeys": {}});
            let op = Op::Checkpoint {
                model_id: "demo".into(),
                sequence: Some(valem_store::Seq::new(i)),
                at: valem_store::Timestamp::from_us(valem_benches::T0 + i as i64),
                state,
                kind: valem_store::CheckpointKind::Periodic,
            };
            w.submit(op, Box::new(|r| r.expect("checkpoint")));
        }
    }
    store.close().expect("close the store");
}

/// The newest commit instant of the demo model (ISO), to travel back to later.
fn newest_instant(d: &Daemon) -> Option<String> {
    let r = d.get("/models/demo/audit?limit=1")?;
    let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
    v[0]["timestamp"].as_str().map(str::to_string)
}
