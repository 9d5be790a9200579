//! Resident memory of large models: builds the 100k fan-out model and the 100k items model,
//! applies 1000 mutations to each and prints VmRSS / VmHWM (MB) from /proc/self/status after
//! each step. Target: ≤ 300 MB at 100k. Each shape runs in a child process so the high-water
//! mark of one does not hide the other (`memory <shape> <n>` runs one shape directly).

use std::process::Command;
use std::time::Instant;

use serde_json::json;
use valem_benches::*;
use valem_engine::Model;

// The daemon's allocator with its settings (`valem::allocator::configure`, called first), so
// the engine costs here what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const TARGET_MB: f64 = 300.0;
const MUTATIONS: usize = 1000;

fn report(shape: &str, n: usize, step: &str, started: Instant) {
    let (rss, hwm) = rss_mb();
    println!(
        "memory {shape} N={n} after {step}: VmRSS {rss:.1} MB, VmHWM {hwm:.1} MB (elapsed {:.2} s)",
        started.elapsed().as_secs_f64()
    );
}

fn verdict(shape: &str, n: usize) {
    let (rss, hwm) = rss_mb();
    let pass = |v: f64| if v <= TARGET_MB { "PASS" } else { "FAIL" };
    println!(
        "RESULT memory {shape} N={n}: VmRSS {rss:.1} MB [{}], VmHWM {hwm:.1} MB [{}] (target ≤ {TARGET_MB} MB)",
        pass(rss),
        pass(hwm)
    );
}

fn fanout(n: usize) {
    let t = Instant::now();
    report("fanout", n, "start", t);
    let spec = fanout_spec(n);
    let (mut model, _) = Model::create(&spec, NOW_MS, limits()).expect("model creates");
    drop(spec);
    report("fanout", n, "create", t);
    seed(&mut model, fanout_data(n));
    report("fanout", n, "initial data", t);
    let muts = fanout_mutations(n, MUTATIONS, 7);
    for m in &muts {
        model
            .mutate_parsed(std::slice::from_ref(m), NOW_MS)
            .expect("mutation commits");
    }
    drop(muts);
    report("fanout", n, &format!("{MUTATIONS} mutations"), t);
    verdict("fanout", n);
}

fn items(n: usize) {
    let t = Instant::now();
    report("items", n, "start", t);
    let (mut model, _) = Model::create(&items_spec(), NOW_MS, limits()).expect("model creates");
    report("items", n, "create", t);
    seed(&mut model, items_data(n));
    report("items", n, "initial data", t);
    let mut rng = Rng::new(11);
    let muts: Vec<_> = (0..MUTATIONS)
        .map(|j| {
            let k = rng.below(n);
            (segs(&format!("$.items[{k}].qty")), json!(10 + j))
        })
        .collect();
    for m in &muts {
        model
            .mutate_parsed(std::slice::from_ref(m), NOW_MS)
            .expect("mutation commits");
    }
    drop(muts);
    report("items", n, &format!("{MUTATIONS} mutations"), t);
    verdict("items", n);
}

fn main() {
    valem::allocator::configure();
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; ignore flags.
    let pos: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    match pos.as_slice() {
        [shape, n] => {
            let n: usize = n.parse().expect("N is a number");
            match shape.as_str() {
                "fanout" => fanout(n),
                "items" => items(n),
                other => panic!("unknown shape {other}; use fanout or items"),
            }
        }
        _ => {
            let exe = std::env::current_exe().expect("current exe");
            for shape in ["fanout", "items"] {
                let status = Command::new(&exe)
                    .args([shape, "100000"])
                    .status()
                    .expect("child runs");
                assert!(status.success(), "memory {shape} child failed: {status}");
            }
        }
    }
}
