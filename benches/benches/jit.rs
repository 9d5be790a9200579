//! The JIT tier against the interpreter, side by side in one run (issue 8 targets: ≥ 5× per
//! evaluation on arithmetic, ≥ 3× on the 100k recomputes, compile ≤ 500 µs and memory ≤ 8 KB
//! per compiled expression).
//!
//! - `jit_eval/<expr>/{interpreter,jit}`: one evaluation of each of six typical derivations.
//!   The interpreter is given its input already converted (what a projection hands it, without
//!   building the projection); the JIT reads its slots from the state value and runs the code.
//! - `jit_compile/<expr>`: lowering plus cranelift code generation of one expression into its
//!   own module (the worst case: the tier batches what is queued into one module).
//! - `jit_chain/100000/{off,on}` and `jit_items/100000/{off,on}`: a whole-model recompute,
//!   the same model with the tier off and on: a 100k chain `f_i = f_{i-1} + 1` after a write
//!   of its seed, and a 100k-row `items[*].line = $parent.price * $parent.qty * rate` after a
//!   write of `rate` (the batched entry).
//!
//! Before the groups it prints the memory of compiled code: resident-set growth over 2,000
//! distinct compiled expressions, compiled one module each and 256 per module.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode};
use serde_json::{json, Value};
use valem_benches::*;
use valem_core::expr::{to_jvalue, Compiled, Env, Limits};
use valem_core::value::{Seg, Val};
use valem_engine::jit;
use valem_engine::{EngineLimits, JitConfig, Model};
use valem_jit::codegen::{CodeSet, Shapes};
use valem_jit::ir;

// The daemon's allocator with its settings (`valem::allocator::configure`, called first), so
// the engine costs here what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const EXPRS: [(&str, &str); 6] = [
    ("price_x_qty", "price * qty"),
    ("discounted", "subtotal * (1 - discount) + tax"),
    ("round", "$round(amount * rate, 2)"),
    (
        "loan",
        "principal * (r / 12) / (1 - $power(1 + r / 12, -n))",
    ),
    (
        "grade",
        "score >= 90 ? 4 : score >= 80 ? 3 : score >= 70 ? 2 : 1",
    ),
    ("hypot_abs", "$sqrt(x * x + y * y) + $abs(x - y)"),
];

fn input() -> Value {
    json!({
        "price": 19.99, "qty": 3, "subtotal": 120.5, "discount": 0.15, "tax": 9.64,
        "amount": 1234.5678, "rate": 0.0725, "principal": 250000, "r": 0.045, "n": 360,
        "score": 84, "x": 3.5, "y": -1.25
    })
}

fn slots_of(p: &ir::Program) -> Vec<jit::SlotInput> {
    jit::slot_inputs(p)
}

fn memory_report() {
    for per_module in [1usize, 256] {
        let (before, _) = rss_mb();
        let mut sets = Vec::new();
        let mut bytes = 0;
        let programs: Vec<ir::Program> = (0..2000)
            .map(|i| {
                let text = format!("x * {} + y / {}", i + 2, i + 3);
                let c = Compiled::compile(&text, &Limits::default()).expect("compiles");
                ir::lower(c.ast(), &|_| None).expect("lowers")
            })
            .collect();
        let t = Instant::now();
        for chunk in programs.chunks(per_module) {
            let req: Vec<(&ir::Program, Shapes)> =
                chunk.iter().map(|p| (p, Shapes::SCALAR)).collect();
            let set = CodeSet::compile(&req).expect("compiles");
            bytes += set.code_bytes();
            sets.push(set);
        }
        let took = t.elapsed();
        let (after, _) = rss_mb();
        println!(
            "jit memory: 2000 expressions, {per_module} per module: resident +{:.1} KB per expression \
             ({} bytes of machine code each), compile {:.0} µs per expression",
            (after - before) * 1024.0 / 2000.0,
            bytes / 2000,
            took.as_secs_f64() * 1e6 / 2000.0
        );
        drop(sets);
    }
}

fn eval(c: &mut Criterion) {
    valem::allocator::configure();
    memory_report();
    let limits = Limits::default();
    let doc = input();
    let val = Val::from_json(&doc);
    let jdoc = to_jvalue(&val);
    let env = Env::default();
    let mut g = c.benchmark_group("jit_eval");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for (name, text) in EXPRS {
        let compiled = Compiled::compile(text, &limits).expect("compiles");
        let p = ir::lower(compiled.ast(), &|_| None).expect("in the subset");
        let code = CodeSet::compile(&[(&p, Shapes::SCALAR)]).expect("codegen");
        let inputs = slots_of(&p);
        let mut slots = Vec::new();
        // Same answer both ways (through the engine's conversion).
        let want = compiled.eval(&jdoc, &env, &limits).expect("evaluates");
        assert_eq!(
            jit::read_doc_slots(&inputs, &val, &mut slots),
            jit::Read::Numbers
        );
        let got = code.call(0, &slots).expect("finite");
        let want = valem_core::expr::from_jvalue(
            &want.expect("defined"),
            valem_core::value::MAX_DEPTH,
            &Limits::default(),
        )
        .expect("a number");
        assert_eq!(Val::num(got), want, "{name}");
        g.bench_function(BenchmarkId::new(name, "interpreter"), |b| {
            b.iter(|| black_box(compiled.eval(&jdoc, &env, &limits).unwrap()))
        });
        g.bench_function(BenchmarkId::new(name, "jit"), |b| {
            b.iter(|| {
                jit::read_doc_slots(&inputs, &val, &mut slots);
                black_box(code.call(0, &slots))
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("jit_compile");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for (name, text) in EXPRS {
        let compiled = Compiled::compile(text, &limits).expect("compiles");
        g.bench_function(name, |b| {
            b.iter(|| {
                let p = ir::lower(compiled.ast(), &|_| None).expect("lowers");
                black_box(CodeSet::compile(&[(&p, Shapes::SCALAR)]).expect("codegen"))
            })
        });
    }
    g.finish();
}

/// Run `model` hot with the tier on: compile from the first run, wait for the code.
fn warm(model: &mut Model, write: &[(Vec<Seg>, Value)]) {
    model.limits.jit = JitConfig {
        enabled: true,
        tier_after: 0,
    };
    model.mutate_parsed(write, NOW_MS).expect("mutates");
    assert!(jit::flush(Duration::from_secs(60)), "the JIT finishes");
}

/// One group: the same model recomputed with the tier off, then on, after each write of
/// `pool` (every write recomputes all `n` nodes).
fn off_and_on(
    c: &mut Criterion,
    name: &str,
    model: &mut Model,
    pool: &mut Pool<Vec<Seg>>,
    n: usize,
) {
    let mut g = c.benchmark_group(name);
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for on in [false, true] {
        if on {
            warm(model, pool.next_batch());
        }
        model.limits.jit.enabled = on;
        let r = model
            .mutate_parsed(pool.next_batch(), NOW_MS)
            .expect("mutates");
        assert_eq!(r.derived_updated.len(), n);
        g.bench_function(
            BenchmarkId::new(n.to_string(), if on { "on" } else { "off" }),
            |b| b.iter(|| black_box(model.mutate_parsed(pool.next_batch(), NOW_MS).unwrap())),
        );
    }
    g.finish();
}

fn recompute(c: &mut Criterion) {
    valem::allocator::configure();
    let n = 100_000;
    // Compiled with the tier off, as `--jit off` compiles (arithmetic keeps its parsed form).
    let off = EngineLimits {
        jit: JitConfig {
            enabled: false,
            ..JitConfig::default()
        },
        ..limits()
    };
    let mut model = chain_model_with(n, off);
    let mut pool = Pool::new(vec![segs("$.seed")], 0);
    off_and_on(c, "jit_chain", &mut model, &mut pool, n);
    drop(model);

    let spec = valem_core::spec::parse_spec(&json!({
        "id": "items-rate",
        "schema": {"type": "object"},
        "derivations": [
            {"path": "$.items[*].line", "expr": "$parent.price * $parent.qty * rate"}
        ]
    }))
    .expect("spec");
    let (mut model, _) = Model::create(&spec, NOW_MS, limits()).expect("creates");
    model.limits.jit.enabled = false;
    seed(&mut model, items_data(n));
    seed(&mut model, vec![(segs("$.rate"), json!(1))]);
    let mut pool = Pool::new(vec![segs("$.rate")], 2);
    off_and_on(c, "jit_items", &mut model, &mut pool, n);
    let (programs, bytes) = jit::stats();
    println!("jit: {programs} programs compiled by the tier, {bytes} bytes of machine code");
}

criterion_group!(benches, eval, recompute);
criterion_main!(benches);
