//! Fan-out: N independent derivations `$.total_i = price_i * qty_i`; one mutation of
//! `$.price_k` must recompute exactly `$.total_k`. Target ≤ 5 µs per mutation at N = 100k.
//! `mutate_string_history50` also keeps what each of the last 50 commits changed, as the
//! daemon's history ring does; `mutate_string_snapshots50` keeps the 50 states themselves, as
//! the ring did before: each commit then copies the paths it writes instead of writing in place.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use valem_benches::*;

// The daemon's allocator with its settings (`valem::allocator::configure`, called first), so
// the engine costs here what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const POOL: usize = 4096;

/// States the daemon's history ring holds by default (`history_entries`).
const HISTORY: usize = 50;

fn fanout(c: &mut Criterion) {
    valem::allocator::configure();
    let mut g = c.benchmark_group("fanout");
    g.sample_size(50)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for n in [1_000usize, 10_000, 100_000] {
        let mut model = fanout_model(n);
        let idx = random_indices(n, POOL, n as u64);

        // Check once that one write recomputes exactly its own total.
        let k = idx[0];
        let r = model
            .mutate(&[(format!("$.price_{k}"), 123_456_789.into())], NOW_MS)
            .expect("mutation commits");
        assert_eq!(
            derived(&r),
            vec![format!("$.total_{k}")],
            "fan-out recompute set"
        );

        let mut parsed = Pool::new(
            idx.iter().map(|k| segs(&format!("$.price_{k}"))).collect(),
            1_000_000,
        );
        g.bench_function(BenchmarkId::new("mutate_parsed", n), |b| {
            b.iter(|| black_box(model.mutate_parsed(parsed.next_batch(), NOW_MS).unwrap()))
        });

        let mut strings = Pool::new(
            idx.iter().map(|k| format!("$.price_{k}")).collect(),
            1_000_000_000,
        );
        g.bench_function(BenchmarkId::new("mutate_string", n), |b| {
            b.iter(|| black_box(model.mutate(strings.next_batch(), NOW_MS).unwrap()))
        });

        // The daemon's ring: what each of the last 50 commits changed (the model's undo log).
        model.record_undo(true);
        let mut history = std::collections::VecDeque::with_capacity(HISTORY + 1);
        g.bench_function(BenchmarkId::new("mutate_string_history50", n), |b| {
            b.iter(|| {
                let r = model.mutate(strings.next_batch(), NOW_MS).unwrap();
                history.push_back(model.take_undo());
                if history.len() > HISTORY {
                    history.pop_front();
                }
                black_box(r)
            })
        });
        model.record_undo(false);
        drop(history);

        // The ring as it was: a state per commit, shared with the live one.
        let mut snapshots = std::collections::VecDeque::with_capacity(HISTORY + 1);
        g.bench_function(BenchmarkId::new("mutate_string_snapshots50", n), |b| {
            b.iter(|| {
                let r = model.mutate(strings.next_batch(), NOW_MS).unwrap();
                snapshots.push_back(model.state().clone());
                if snapshots.len() > HISTORY {
                    snapshots.pop_front();
                }
                black_box(r)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, fanout);
criterion_main!(benches);
