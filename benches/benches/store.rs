//! Durable audit appends through the store's group-commit writer, strict mode (fsync per batch):
//! 1, 4 and 16 threads, each appending to its own model's chain and waiting for every ack before
//! the next append (as a shard does for one mutation at a time), on the SQLite store and, in the
//! same run, on the PostgreSQL store over a local server started for the bench (Debian's
//! PostgreSQL with its defaults: `fsync` on, `synchronous_commit` on; loopback TCP). A record is the shape the service
//! writes (one mutation, one derived update, one trace), hashed and validated on the submitting
//! thread. Target (issue 6): ≥ 10,000 durable appends/s with 16 writers.
//!
//! Before each criterion group, a fixed 2 s run prints appends/s, fsyncs/s and ops per batch.
//!
//! `store_read`: one model with 100k records and a checkpoint every 1,000: a full streaming replay
//! read (`audit_after`, records parsed) and a time-travel read (latest checkpoint at or before an
//! instant, verified against its state and the chain, + the records after it up to the instant). Targets (issue 6): recovery of 1M records
//! ≤ 10 s (the replay read is part of it), `at=` read ≤ 10 ms at 100k records.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use serde_json::json;
use valem_benches::AuditChain as Chain;
use valem_store::pg::testing::TestServer;
use valem_store::{Op, PgStore, Seq, SqliteStore, Store, StoreOptions, Timestamp, Writer};

use valem_benches::T0;

// The daemon's allocator with its settings (`valem::allocator::configure`, called first), so
// the engine costs here what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Run `per_thread` appends on each chain concurrently; the wall time.
fn run(w: &Writer, chains: &mut [Chain], per_thread: u64) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for c in chains.iter_mut() {
            s.spawn(move || {
                for _ in 0..per_thread {
                    w.apply(c.next_op()).expect("durable append");
                }
            });
        }
    });
    start.elapsed()
}

fn setup(threads: usize) -> (tempfile::TempDir, SqliteStore, Vec<Chain>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path(), StoreOptions::default()).expect("store opens");
    let chains = models(&store, threads);
    (dir, store, chains)
}

/// A database on `server` (fresh for each call) and its store, with `threads` models.
fn setup_pg(server: &TestServer, db: &str, threads: usize) -> (PgStore, Vec<Chain>) {
    let url = server.create_db(db).expect("a database");
    let store = PgStore::open(&url, StoreOptions::default()).expect("store opens");
    let chains = models(&store, threads);
    (store, chains)
}

fn models(store: &dyn Store, threads: usize) -> Vec<Chain> {
    let chains = (0..threads)
        .map(|i| {
            let model = format!("m{i}");
            store
                .writer()
                .apply(Op::PutModel {
                    id: model.clone(),
                    spec_text: "{}".into(),
                    version: "1".into(),
                    at: Timestamp::from_us(0),
                })
                .expect("model");
            Chain::new(&model)
        })
        .collect();
    chains
}

fn appends(c: &mut Criterion) {
    valem::allocator::configure();
    let mut g = c.benchmark_group("store_strict_append");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements(1));
    let server = TestServer::start().expect("a PostgreSQL server for the bench");
    for threads in [1usize, 4, 16] {
        let (_dir, sqlite, chains) = setup(threads);
        let (pg, pg_chains) = setup_pg(&server, &format!("bench{threads}"), threads);
        let stores: [(&str, Box<dyn Store>, Vec<Chain>); 2] = [
            ("sqlite", Box::new(sqlite), chains),
            ("postgres", Box::new(pg), pg_chains),
        ];
        for (name, store, mut chains) in stores {
            append_runs(&mut g, name, &*store, &mut chains, threads);
        }
    }
    g.finish();
}

/// The fixed 2 s run (numbers for the note) and the criterion group of one store.
fn append_runs(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    store: &dyn Store,
    chains: &mut [Chain],
    threads: usize,
) {
    let w = store.writer();
    let before = store.stats();
    let start = Instant::now();
    let mut done = 0u64;
    let mut latencies = Vec::new();
    while start.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        run(&w, chains, 50);
        latencies.push(t.elapsed() / 50);
        done += 50 * threads as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    let after = store.stats();
    let batches = after.batches_committed - before.batches_committed;
    latencies.sort();
    println!(
        "store {name:>8} strict, {threads:>2} threads: {:>8.0} durable appends/s, {:>6.0} syncs/s, {:>5.1} ops/batch, ~{:.0} µs per append ({done} appends in {secs:.2} s)",
        done as f64 / secs,
        (after.fsyncs - before.fsyncs) as f64 / secs,
        (after.ops_committed - before.ops_committed) as f64 / batches.max(1) as f64,
        latencies[latencies.len() / 2].as_secs_f64() * 1e6,
    );
    g.bench_function(BenchmarkId::new(format!("{name}/threads"), threads), |b| {
        b.iter_custom(|iters| {
            let per_thread = iters.div_ceil(threads as u64);
            let t = run(&w, chains, per_thread);
            // Report per append: scale to the appends actually made.
            t.mul_f64(iters as f64 / (per_thread * threads as u64) as f64)
        })
    });
    let report = store.verify_chain("m0").expect("verify");
    assert!(report.valid, "{report:?}");
}

fn reads(c: &mut Criterion) {
    valem::allocator::configure();
    const N: u64 = 100_000;
    const K: u64 = 1_000;
    let (_dir, store, mut chains) = setup(1);
    let w = store.writer();
    let chain = &mut chains[0];
    let start = Instant::now();
    for i in 0..N {
        w.submit(chain.next_op(), Box::new(|r| r.expect("append")));
        if (i + 1) % K == 0 {
            let state = json!({"price": 3, "qty": i % 1000, "total": (i % 1000) * 3});
            w.submit(
                Op::Checkpoint {
                    model_id: "m0".into(),
                    sequence: Some(Seq::new(i)),
                    at: Timestamp::from_us(T0 + i as i64),
                    state,
                    kind: valem_store::CheckpointKind::Periodic,
                },
                Box::new(|r| r.expect("checkpoint")),
            );
        }
    }
    store.flush().expect("flush");
    println!(
        "store_read setup: {N} records + {} checkpoints written in {:.2} s",
        N / K,
        start.elapsed().as_secs_f64()
    );

    let mut g = c.benchmark_group("store_read");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(N));
    g.bench_function("replay_scan_100k", |b| {
        b.iter(|| {
            let mut n = 0u64;
            store
                .audit_after("m0", None, None, |e| {
                    n += e.record["mutations"]
                        .as_object()
                        .map_or(0, |m| m.len() as u64);
                    ControlFlow::Continue(())
                })
                .expect("scan");
            assert_eq!(n, N);
        })
    });
    g.throughput(Throughput::Elements(1));
    let mut m = 0u64;
    g.bench_function("time_travel_read_100k", |b| {
        b.iter(|| {
            // An instant 999 records past a checkpoint: the worst case for K = 1000.
            m = (m + 7) % (N / K);
            let at = m * K + K - 2;
            let instant = Timestamp::from_us(T0 + at as i64);
            let cp = store
                .usable_checkpoint("m0", Some(instant))
                .expect("checkpoint")
                .checkpoint;
            let after = cp.as_ref().and_then(|c| c.sequence);
            let mut last = None;
            store
                .audit_after("m0", after, Some(instant), |e| {
                    last = Some(e.sequence);
                    ControlFlow::Continue(())
                })
                .expect("replay");
            assert_eq!(last.or(after), Some(Seq::new(at)));
        })
    });
    g.finish();
    store.close().expect("close");
}

criterion_group!(benches, appends, reads);
criterion_main!(benches);
