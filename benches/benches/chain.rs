//! Chain: `$.f_0 = seed + 1`, `$.f_i = f_{i-1} + 1`; one mutation of `$.seed` recomputes all N
//! derivations. Target ≤ 3 ms at N = 10k.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode};
use serde_json::json;
use valem_benches::*;

// The daemon's allocator with its settings (`valem::allocator::configure`, called first), so
// the engine costs here what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn chain(c: &mut Criterion) {
    valem::allocator::configure();
    let mut g = c.benchmark_group("chain");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for n in [1_000usize, 10_000, 100_000] {
        let mut model = chain_model(n);

        // Check once that a seed write recomputes the whole chain.
        let r = model
            .mutate_parsed(&[(segs("$.seed"), json!(-1))], NOW_MS)
            .expect("mutation commits");
        assert_eq!(r.derived_updated.len(), n, "chain recompute set");
        let last = format!("$.f_{}", n - 1);
        assert!(r.derived_updated.iter().any(|d| d == &*last));

        let mut pool = Pool::new(vec![segs("$.seed")], 0);
        g.bench_function(BenchmarkId::new("mutate_seed", n), |b| {
            b.iter(|| black_box(model.mutate_parsed(pool.next_batch(), NOW_MS).unwrap()))
        });
    }
    g.finish();
}

criterion_group!(benches, chain);
criterion_main!(benches);
