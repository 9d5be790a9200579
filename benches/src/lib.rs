//! Shared shape builders for the valem engine benchmarks: the fan-out, chain and items specs,
//! model construction with the initial data applied in one big mutation, and pre-parsed
//! mutation addresses. Used by the criterion benches and the memory binary. [`modern`] is the
//! client side of MCP's modern era for the end-to-end benches.

pub mod modern;

use std::sync::Arc;
use valem_engine::Timestamp;

use serde_json::{json, Value};
use valem_core::expr::path::Address;
use valem_core::spec::ModelSpec;
use valem_core::value::Seg;
use valem_engine::{EngineLimits, Model, MutationResult};

/// A fixed clock for every cycle.
pub const NOW_MS: Timestamp = Timestamp::from_ms(1_700_000_000_000);

/// Limits that let the initial data go in as one mutation.
pub fn limits() -> EngineLimits {
    // The daemon's engine limits (its cycle budget's clock reads are timed too).
    EngineLimits {
        max_mutations: usize::MAX,
        ..valem_service::ServiceLimits::default().engine
    }
}

fn shape(s: valem::bench::Shape, n: usize) -> ModelSpec {
    valem::bench::shape_spec(s, n).expect("bench spec parses").0
}

/// Fan-out: `$.total_i = price_i * qty_i` for i in 0..n (`valem bench --shape fanout`).
pub fn fanout_spec(n: usize) -> ModelSpec {
    shape(valem::bench::Shape::Fanout, n)
}

/// Chain: `$.f_0 = seed + 1`, `$.f_i = f_{i-1} + 1` for i in 1..n (`--shape chain`).
pub fn chain_spec(n: usize) -> ModelSpec {
    shape(valem::bench::Shape::Chain, n)
}

/// Items: `$.items[*].total = $parent.price * $parent.qty`, `$.sum = $sum(items.total)`
/// (`--shape items`).
pub fn items_spec() -> ModelSpec {
    shape(valem::bench::Shape::Items, 1)
}

/// Parse a concrete address into segments (for `mutate_parsed`).
pub fn segs(addr: &str) -> Vec<Seg> {
    Address::parse(addr)
        .expect("address parses")
        .concrete()
        .expect("address is concrete")
}

fn create(spec: &ModelSpec) -> Model {
    let (model, _) = Model::create(spec, NOW_MS, limits()).expect("model creates");
    model
}

/// Apply the initial data in one big mutation; returns the cycle's result.
pub fn seed(model: &mut Model, data: Vec<(Vec<Seg>, Value)>) -> MutationResult {
    model
        .mutate_parsed(&data, NOW_MS)
        .expect("initial data applies")
}

/// The fan-out base fields: price_i = i + 1, qty_i = 2.
pub fn fanout_data(n: usize) -> Vec<(Vec<Seg>, Value)> {
    let mut data = Vec::with_capacity(2 * n);
    for i in 0..n {
        data.push((segs(&format!("$.price_{i}")), json!(i + 1)));
        data.push((segs(&format!("$.qty_{i}")), json!(2)));
    }
    data
}

/// The fan-out base fields as one document: `{price_i: i + 1, qty_i: 2}`.
pub fn fanout_document(n: usize) -> Value {
    let mut doc = serde_json::Map::with_capacity(2 * n);
    for i in 0..n {
        doc.insert(format!("price_{i}"), json!(i + 1));
        doc.insert(format!("qty_{i}"), json!(2));
    }
    Value::Object(doc)
}

/// Chain base data: the seed.
pub fn chain_data() -> Vec<(Vec<Seg>, Value)> {
    vec![(segs("$.seed"), json!(0))]
}

/// Items base data: `{"$.items": [{price: i + 1, qty: 2}, ...]}`.
pub fn items_data(n: usize) -> Vec<(Vec<Seg>, Value)> {
    let items: Vec<Value> = (0..n).map(|i| json!({"price": i + 1, "qty": 2})).collect();
    vec![(segs("$.items"), Value::Array(items))]
}

/// The items model with decimal prices (`i + 1.25`): its totals, and so the sum, are not
/// integers, which the sum keeps by its leaves rather than by an exact running total.
pub fn items_decimal_model(n: usize) -> Model {
    let mut m = create(&items_spec());
    let items: Vec<Value> = (0..n)
        .map(|i| json!({"price": i as f64 + 1.25, "qty": 2}))
        .collect();
    seed(&mut m, vec![(segs("$.items"), Value::Array(items))]);
    m
}

/// A fan-out model of `n` derivations with its base data applied.
pub fn fanout_model(n: usize) -> Model {
    let mut m = create(&fanout_spec(n));
    seed(&mut m, fanout_data(n));
    m
}

/// A chain model of `n` derivations with `$.seed = 0` applied.
pub fn chain_model(n: usize) -> Model {
    chain_model_with(n, limits())
}

/// A chain model of `n` derivations under `limits`, seeded.
pub fn chain_model_with(n: usize, limits: EngineLimits) -> Model {
    let (mut m, _) = Model::create(&chain_spec(n), NOW_MS, limits).expect("model creates");
    seed(&mut m, chain_data());
    m
}

/// An items model with `n` items applied.
pub fn items_model(n: usize) -> Model {
    let mut m = create(&items_spec());
    seed(&mut m, items_data(n));
    m
}

/// Compile without the per-thread cache.
pub fn compile_uncached(spec: &ModelSpec) -> valem_engine::CompiledModel {
    valem_engine::compile::compile(
        Arc::new(spec.clone()),
        &valem_engine::EngineLimits::default(),
    )
    .unwrap_or_else(|e| panic!("spec compiles: {e:?}"))
}

/// A cheap deterministic sequence for picking `k` (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn below(&mut self, n: usize) -> usize {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// Pre-parsed fan-out mutations `$.price_k = v` for `count` distinct steps. Values increase
/// monotonically, so every mutation changes its field and its total (early cutoff never skips).
pub fn fanout_mutations(n: usize, count: usize, start: u64) -> Vec<(Vec<Seg>, Value)> {
    let mut rng = Rng::new(0x9e37_79b9 ^ start);
    (0..count)
        .map(|j| {
            let k = rng.below(n);
            (
                segs(&format!("$.price_{k}")),
                json!(1_000_000 + start + j as u64),
            )
        })
        .collect()
}

/// The derived paths a result reports, sorted.
pub fn derived(r: &MutationResult) -> Vec<String> {
    let mut d: Vec<String> = r.derived_updated.iter().map(|d| d.to_string()).collect();
    d.sort();
    d
}

/// Resident memory in MB from /proc/self/status: (VmRSS, VmHWM).
pub use valem::bench::rss_mb;

/// A ring of pre-built single-write mutations whose values never repeat: each `next` bumps a
/// counter into the next slot's value, so every cycle changes its field (no early cutoff).
pub struct Pool<K> {
    muts: Vec<(K, Value)>,
    i: usize,
    counter: u64,
}

impl<K> Pool<K> {
    /// `keys` are the addresses cycled through; values start at `start`.
    pub fn new(keys: Vec<K>, start: u64) -> Pool<K> {
        assert!(!keys.is_empty());
        Pool {
            muts: keys.into_iter().map(|k| (k, Value::Null)).collect(),
            i: 0,
            counter: start,
        }
    }

    /// The next one-write batch.
    pub fn next_batch(&mut self) -> &[(K, Value)] {
        self.i = (self.i + 1) % self.muts.len();
        self.counter += 1;
        self.muts[self.i].1 = Value::from(self.counter);
        std::slice::from_ref(&self.muts[self.i])
    }
}

/// `count` random fan-out indices in 0..n.
pub fn random_indices(n: usize, count: usize, seed: u64) -> Vec<usize> {
    let mut rng = Rng::new(seed);
    (0..count).map(|_| rng.below(n)).collect()
}

/// The release `valem` binary the end-to-end benches spawn: `$VALEM_BIN`, else
/// `target/release/valem`; `None` (with a hint on stderr naming `what` is skipped) when missing.
pub fn release_valem(what: &str) -> Option<std::path::PathBuf> {
    let bin = std::env::var_os("VALEM_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/valem")
        });
    if bin.exists() {
        return Some(bin);
    }
    eprintln!(
        "{what} skipped: {} not found (cargo build --release -p valem, or set VALEM_BIN)",
        bin.display()
    );
    None
}

/// A `valem serve --listen 127.0.0.1:0 EXTRA…` child on a free loopback port (logging at warn),
/// killed on drop. `None` when it does not start or report its address.
pub struct Serve {
    child: std::process::Child,
    /// `127.0.0.1:PORT`
    pub addr: String,
}

impl Serve {
    pub fn start(bin: &std::path::Path, extra: &[&std::ffi::OsStr]) -> Option<Serve> {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new(bin)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take()?)
            .read_line(&mut line)
            .ok()?;
        let addr = line.trim().rsplit("http://").next()?.to_string();
        Some(Serve { child, addr })
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The epoch (µs) of synthetic audit records.
pub const T0: i64 = 1_700_000_000_000_000;

/// A synthetic audit chain of one model, records shaped as the service writes them (one
/// mutation of `$.qty`, one derived update of `$.total = price * qty`, one trace), hashed and
/// validated: for benches that fill a store without running cycles.
pub struct AuditChain {
    pub model: String,
    pub next: u64,
    pub prev: String,
}

impl AuditChain {
    pub fn new(model: &str) -> AuditChain {
        AuditChain {
            model: model.to_string(),
            next: 0,
            prev: valem_store::GENESIS.to_string(),
        }
    }

    /// The next record's append (committed at `T0 + sequence` µs).
    pub fn next_op(&mut self) -> valem_store::Op {
        let at_us = T0 + self.next as i64;
        let qty = (self.next % 1000) as i64;
        let mut r: Value = json!({
            "modelId": self.model, "sequence": self.next, "timestamp": "2026-01-01T00:00:00.000000Z",
            "modelVersion": "1.0.0", "source": "client", "mutations": {"$.qty": qty},
            "derivedUpdated": ["$.total"], "flaggedConstraints": [], "dispatchedEffects": [],
            "traces": [{"targetPath": "$.total", "expression": "price * qty", "inputPaths": ["$.price", "$.qty"],
                        "result": qty * 3, "constraintPassed": null, "errorMessage": null}],
            "prevHash": self.prev,
        });
        let h = valem_store::record_hash(&self.prev, &r);
        r["hash"] = json!(h);
        let op = valem_store::AuditAppend::new(
            Timestamp::from_us(at_us),
            &r,
            vec!["$.qty".into(), "$.total".into()],
            None,
        )
        .expect("a synthetic record is valid");
        self.prev = h;
        self.next += 1;
        valem_store::Op::AppendAudit(op)
    }
}
