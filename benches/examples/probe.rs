//! Profiling driver: `probe <shape> <n> <mutations>` builds one model (fanout, fanout-str,
//! chain, items, compile) and runs the hot loop, printing phase timings. Small enough to run
//! under `perf record` or `valgrind --tool=callgrind`.

use std::time::Instant;

use serde_json::json;
use valem_benches::*;
use valem_engine::Model;

/// Counts live heap bytes, so `mem` can attribute memory to each construction step.
struct Counting;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        LIVE.fetch_sub(l.size(), std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, std::sync::atomic::Ordering::Relaxed);
        LIVE.fetch_sub(l.size(), std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live_mb() -> f64 {
    LIVE.load(std::sync::atomic::Ordering::Relaxed) as f64 / (1024.0 * 1024.0)
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let shape = a.first().map_or("fanout", String::as_str);
    let n: usize = a.get(1).map_or(10_000, |s| s.parse().unwrap());
    let iters: usize = a.get(2).map_or(1000, |s| s.parse().unwrap());
    let t = Instant::now();
    let lap = |what: &str, t: &mut Instant, count: usize| {
        let e = t.elapsed();
        println!(
            "{shape} N={n} {what}: {:.3} ms total, {:.3} µs each",
            e.as_secs_f64() * 1e3,
            e.as_secs_f64() * 1e6 / count.max(1) as f64
        );
        *t = Instant::now();
    };
    let mut t = t;
    match shape {
        "compile" => {
            let spec = fanout_spec(n);
            lap("spec build", &mut t, 1);
            for _ in 0..iters {
                let cm = compile_uncached(&spec);
                std::hint::black_box(&cm);
            }
            lap("compile", &mut t, iters);
        }
        "fanout" | "fanout-str" => {
            let spec = fanout_spec(n);
            lap("spec build", &mut t, 1);
            let (mut m, _) = Model::create(&spec, NOW_MS, limits()).unwrap();
            lap("create", &mut t, 1);
            seed(&mut m, fanout_data(n));
            lap("initial data", &mut t, 1);
            let muts = fanout_mutations(n, iters, 1);
            if shape == "fanout" {
                for x in &muts {
                    std::hint::black_box(m.mutate_parsed(std::slice::from_ref(x), NOW_MS).unwrap());
                }
            } else {
                let strs: Vec<(String, serde_json::Value)> = muts
                    .iter()
                    .map(|(s, v)| (valem_core::expr::path::render(s), v.clone()))
                    .collect();
                lap("render", &mut t, 1);
                for x in &strs {
                    std::hint::black_box(m.mutate(std::slice::from_ref(x), NOW_MS).unwrap());
                }
            }
            lap("mutate", &mut t, iters);
        }
        "chain" => {
            let spec = chain_spec(n);
            let (mut m, _) = Model::create(&spec, NOW_MS, limits()).unwrap();
            lap("create", &mut t, 1);
            seed(&mut m, chain_data());
            lap("initial data", &mut t, 1);
            write_counts(&mut m, "$.seed", 1, iters);
            lap("mutate", &mut t, iters);
        }
        "items" => {
            let (mut m, _) = Model::create(&items_spec(), NOW_MS, limits()).unwrap();
            lap("create", &mut t, 1);
            seed(&mut m, items_data(n));
            lap("initial data", &mut t, 1);
            let mut rng = Rng::new(3);
            let muts: Vec<_> = (0..iters)
                .map(|j| {
                    (
                        segs(&format!("$.items[{}].qty", rng.below(n))),
                        json!(10 + j),
                    )
                })
                .collect();
            lap("parse", &mut t, 1);
            for x in &muts {
                std::hint::black_box(m.mutate_parsed(std::slice::from_ref(x), NOW_MS).unwrap());
            }
            lap("mutate", &mut t, iters);
        }
        "items-rate" => {
            // A 100k-row `[*]` recompute per write (the JIT bench's `jit_items`); VALEM_JIT
            // picks the tier.
            let spec = valem_core::spec::parse_spec(&json!({
                "id": "items-rate",
                "schema": {"type": "object"},
                "derivations": [
                    {"path": "$.items[*].line", "expr": "$parent.price * $parent.qty * rate"}
                ]
            }))
            .unwrap();
            let (mut m, _) = Model::create(&spec, NOW_MS, limits()).unwrap();
            seed(&mut m, items_data(n));
            seed(&mut m, vec![(segs("$.rate"), json!(1))]);
            m.limits.jit.tier_after = 0;
            seed(&mut m, vec![(segs("$.rate"), json!(2))]);
            valem_engine::jit::flush(std::time::Duration::from_secs(60));
            lap("setup", &mut t, 1);
            write_counts(&mut m, "$.rate", 3, iters);
            lap("recompute", &mut t, iters);
        }
        "sizes" => sizes_probe(n),
        "mem" => {
            // Resident memory by construction step of the fan-out model.
            let rss = |what: &str| {
                let (r, h) = rss_mb();
                println!(
                    "mem fanout N={n} {what}: live heap {:.1} MB, VmRSS {r:.1} MB, VmHWM {h:.1} MB",
                    live_mb()
                );
            };
            println!(
                "sizes: Val {} B, Seg {} B, Json {} B",
                std::mem::size_of::<valem_core::value::Val>(),
                std::mem::size_of::<valem_core::value::Seg>(),
                std::mem::size_of::<serde_json::Value>()
            );
            println!(
                "Node {} B, NodeJit {} B, JitCell {} B, Projection {} B, Address {} B, NodeExpr {} B, Location {} B",
                std::mem::size_of::<valem_engine::compile::Node>(),
                std::mem::size_of::<valem_engine::jit::NodeJit>(),
                std::mem::size_of::<valem_engine::jit::JitCell>(),
                std::mem::size_of::<valem_engine::compile::Projection>(),
                std::mem::size_of::<valem_core::expr::path::Address>(),
                std::mem::size_of::<valem_engine::compile::NodeExpr>(),
                std::mem::size_of::<valem_engine::compile::Location>(),
            );
            rss("start");
            let spec = fanout_spec(n);
            rss("spec built");
            let cm = std::rc::Rc::new(compile_uncached(&spec));
            rss("compiled (uncached)");
            drop(spec);
            rss("spec dropped (compiled keeps its own Arc<ModelSpec>)");
            let (mut m, _) = Model::from_compiled(cm, NOW_MS, limits()).unwrap();
            rss("model from compiled");
            let data = fanout_data(n);
            rss("data built");
            seed(&mut m, data);
            rss("initial data applied (data dropped)");
            if std::env::var_os("PROBE_LEAK").is_some() {
                // Keep the model alive to the end, for heap profilers' "at exit" view.
                std::mem::forget(m);
                return;
            }
            let st = m.state().clone();
            m.restore(valem_engine::State::default());
            rss("model state cleared (compiled model only)");
            drop(st);
            rss("state dropped");
            drop(m);
            rss("model dropped");
        }
        other => panic!("unknown shape {other}"),
    }
}

/// Write `from`, `from + 1`, … at `addr`, one cycle each.
fn write_counts(m: &mut Model, addr: &str, from: usize, count: usize) {
    let s = segs(addr);
    for j in 0..count {
        let r = m
            .mutate_parsed(&[(s.clone(), json!(from + j))], NOW_MS)
            .unwrap();
        std::hint::black_box(r);
    }
}

fn sizes_probe(n: usize) {
    use valem_core::expr::{Compiled, Limits};
    let before = live_mb();
    let v: Vec<Compiled> = (0..n)
        .map(|i| Compiled::compile(&format!("price_{i} * qty_{i}"), &Limits::default()).unwrap())
        .collect();
    println!(
        "Compiled: {} B inline, {:.0} B per expression live",
        std::mem::size_of::<Compiled>(),
        (live_mb() - before) * 1048576.0 / n as f64
    );
    drop(v);
    println!(
        "Node {} B, Trace {} B",
        std::mem::size_of::<valem_engine::compile::Node>(),
        std::mem::size_of::<valem_engine::Trace>()
    );
}
