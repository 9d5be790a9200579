//! Compile and create: uncached `compile` of a 100k-derivation fan-out spec (target ≤ 1 s),
//! model creation from the compiled model, `Model::create` with a warm compile cache (spec
//! hashing + initialization), and the initial data mutation (200k base fields, as that many
//! writes and as one write of the document). 1k and 10k as scaling references.

use std::hint::black_box;
use std::rc::Rc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode};
use valem_benches::*;
use valem_engine::Model;

// The daemon's allocator with its settings (`valem::allocator::configure`, called first), so
// the engine costs here what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn compile(c: &mut Criterion) {
    valem::allocator::configure();
    let mut g = c.benchmark_group("compile");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for n in [1_000usize, 10_000, 100_000] {
        let spec = fanout_spec(n);

        // Uncached compile; the drop of the compiled model is not timed.
        g.bench_function(BenchmarkId::new("fanout_compile", n), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let cm = compile_uncached(&spec);
                    total += t.elapsed();
                    drop(black_box(cm));
                }
                total
            })
        });

        // Creation from an already compiled model (the initial cycle).
        let cm = Rc::new(compile_uncached(&spec));
        g.bench_function(BenchmarkId::new("fanout_from_compiled", n), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let m = Model::from_compiled(cm.clone(), NOW_MS, limits()).unwrap();
                    total += t.elapsed();
                    drop(black_box(m));
                }
                total
            })
        });
        drop(cm);

        // `Model::create` with the compile cache warm: spec hash + initial cycle.
        let (mut model, _) = Model::create(&spec, NOW_MS, limits()).unwrap();
        g.bench_function(BenchmarkId::new("fanout_create_cached", n), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let m = Model::create(&spec, NOW_MS, limits()).unwrap();
                    total += t.elapsed();
                    drop(black_box(m));
                }
                total
            })
        });

        // The initial data: one mutation writing all 2N base fields into a fresh model, as
        // that many writes and as one write of the whole document (what `valem bench` loads).
        let empty = model.state().clone();
        let loads = [
            ("fanout_initial_data", fanout_data(n)),
            (
                "fanout_load_document",
                vec![(Vec::new(), fanout_document(n))],
            ),
        ];
        for (name, data) in loads {
            g.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        model.restore(empty.clone());
                        let t = Instant::now();
                        let r = model.mutate_parsed(&data, NOW_MS).unwrap();
                        total += t.elapsed();
                        drop(black_box(r));
                    }
                    total
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, compile);
criterion_main!(benches);
