//! Items: `$.items[*].total = $parent.price * $parent.qty` and `$.sum = $sum(items.total)`;
//! one mutation of `$.items[k].qty` must recompute only that item's total and the sum.
//! Target ≤ 1 ms at N = 10k. `mutate_qty_decimal` does the same over decimal prices, whose sum
//! is kept by its leaves (summed again left to right) instead of an exact running total.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use serde_json::json;
use valem_benches::*;

// The daemon's allocator with its settings (`valem::allocator::configure`, called first), so
// the engine costs here what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const POOL: usize = 4096;

fn items(c: &mut Criterion) {
    valem::allocator::configure();
    let mut g = c.benchmark_group("items");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for n in [1_000usize, 10_000, 100_000] {
        let mut model = items_model(n);
        let idx = random_indices(n, POOL, n as u64 + 1);

        // Check once that one write recomputes that item's total and the sum, nothing else.
        let k = idx[0];
        let r = model
            .mutate_parsed(&[(segs(&format!("$.items[{k}].qty")), json!(7))], NOW_MS)
            .expect("mutation commits");
        let mut want = vec![format!("$.items[{k}].total"), "$.sum".to_string()];
        want.sort();
        assert_eq!(derived(&r), want, "items recompute set");

        let mut pool = Pool::new(
            idx.iter()
                .map(|k| segs(&format!("$.items[{k}].qty")))
                .collect(),
            1_000,
        );
        g.bench_function(BenchmarkId::new("mutate_qty", n), |b| {
            b.iter(|| black_box(model.mutate_parsed(pool.next_batch(), NOW_MS).unwrap()))
        });

        let mut model = items_decimal_model(n);
        let r = model
            .mutate_parsed(&[(segs(&format!("$.items[{k}].qty")), json!(7))], NOW_MS)
            .expect("mutation commits");
        assert_eq!(derived(&r), want, "items recompute set (decimal prices)");
        g.bench_function(BenchmarkId::new("mutate_qty_decimal", n), |b| {
            b.iter(|| black_box(model.mutate_parsed(pool.next_batch(), NOW_MS).unwrap()))
        });
    }
    g.finish();
}

criterion_group!(benches, items);
criterion_main!(benches);
