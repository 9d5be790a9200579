//! `valem bench`: measure a model in-process (no transport): through the engine alone, or the
//! model service in memory (`--service`) or over a durable store (`--durable`).
//!
//! A run builds one model — a synthetic shape (`fanout`, `chain`, `items`, `mixed`) of size `n`,
//! or a user's spec seeded from its first test's `given` — times its compilation and its first
//! cycle (the initial data in one mutation), runs untimed mutations for the warm-up time, then
//! applies mutations one cycle each, timing every one, until the count or the time budget runs
//! out. [`Report`] is what it prints; its JSON form
//! (`--json`) is documented field by field below and in `docs/bench.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Map, Value as Json};

use valem_core::expr::path::Address;
use valem_core::spec::{parse_spec, ModelSpec};
use valem_core::value::Seg;
use valem_engine::{EngineLimits, JitConfig, Model, Timestamp};

/// The clock every cycle of a run sees.
const NOW: Timestamp = Timestamp::from_ms(1_700_000_000_000);

/// The synthetic shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Shape {
    /// `total_i = price_i * qty_i` for i < n; a mutation writes one `price_k`.
    Fanout,
    /// `f_0 = seed + 1`, `f_i = f_{i-1} + 1`; a mutation writes `seed` (all n recompute).
    Chain,
    /// n items, `items[*].total = $parent.price * $parent.qty`, `sum = $sum(items.total)`; a
    /// mutation writes one item's `qty`.
    Items,
    /// `items` plus a tax, a grand total, a meta-derivation per item and two constraints (one
    /// rollback, one flag); a mutation writes one item's `qty` or `discount`.
    Mixed,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    pub workload: Workload,
    /// Most timed mutations.
    pub mutations: usize,
    /// Stop timing mutations after this long (at least one always runs).
    pub max_time: Duration,
    /// Untimed mutations for this long before the timed ones. Right after a build the model's
    /// memory is not in the caches (the build's is): a 100k fan-out's first thousand mutations
    /// take ~1.4x as long as the ones after a few thousand.
    pub warmup: Duration,
    pub jit: bool,
    pub seed: u64,
    /// Through the model service in memory (its shard, history ring, traces and audit trail),
    /// instead of the engine alone.
    pub service: bool,
    /// Through the model service over a durable store in a temporary directory (strict: every
    /// mutation acknowledged after its fsync), instead of the engine alone.
    pub durable: bool,
    /// The most instances one `[*]` derivation may span (the daemon's `--max-instances`).
    pub max_instances: usize,
}

#[derive(Clone, Debug)]
pub enum Workload {
    Shape(Shape, usize),
    /// A spec with its name (the file argument); mutations from the file, else generated.
    Spec {
        name: String,
        spec: Box<ModelSpec>,
        mutations: Option<Vec<Vec<(String, Json)>>>,
    },
}

/// The measurements of one run (`--json` prints exactly this object).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// `fanout`, `chain`, `items`, `mixed`, or `spec`.
    pub shape: String,
    /// The spec's file argument (`spec` runs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<String>,
    /// The size parameter (`spec` runs: the number of derivations).
    pub n: usize,
    /// Graph nodes: derivations, meta-derivations, constraints, effects.
    pub nodes: usize,
    pub jit: bool,
    /// Through the model service (in memory, or over the store when `durable`).
    pub service: bool,
    /// Through the service and a strict durable store (each mutation fsynced before it counts).
    pub durable: bool,
    /// Compiling the spec into its graph, in ms (service runs: creating the model through the
    /// service, its first stored record included when durable).
    pub compile_ms: f64,
    /// The first cycle: creating the model and applying the initial data in one mutation.
    pub first_cycle_ms: f64,
    /// Untimed mutations run before the timed ones, and how long they took (`--warmup`).
    pub warmup_mutations: usize,
    pub warmup_ms: f64,
    /// Timed mutations (each one cycle).
    pub mutations: usize,
    /// Of those, refused by the schema or rolled back by a constraint (still timed).
    pub rejected: usize,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
    pub mutations_per_s: f64,
    /// Mean evaluations per committed mutation (derivations, meta, constraints run).
    pub recomputed_per_mutation: f64,
    /// Mean derived values changed per committed mutation.
    pub derived_updated_per_mutation: f64,
    /// Resident memory at the end of the run with the model loaded, MB, after mimalloc returned
    /// its free pages (peak in `peak_rss_mb`).
    pub rss_mb: f64,
    pub peak_rss_mb: f64,
    /// Whether the allocator may use transparent huge pages (off unless `MIMALLOC_ALLOW_THP=1`).
    pub huge_pages: bool,
}

/// How far a run is, for a progress bar.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Progress {
    /// Building the model: compiling `nodes` derivations, meta-derivations, constraints and
    /// effects (`first_cycle` false), then its first cycle.
    Building { nodes: usize, first_cycle: bool },
    /// Warming up: this long of that long.
    WarmUp { elapsed: Duration, of: Duration },
    /// Timing: this many mutations of at most that many.
    Timed { done: usize, of: usize },
}

/// Run one benchmark. Errors are messages for the command line.
pub fn run(opts: &Options, progress: &mut dyn FnMut(Progress)) -> Result<Report, String> {
    // The daemon's engine limits (its cycle budget's clock reads are timed too).
    let limits = EngineLimits {
        max_mutations: usize::MAX,
        jit: JitConfig {
            enabled: opts.jit,
            ..JitConfig::default()
        },
        max_instances: opts.max_instances,
        ..valem_service::ServiceLimits::default().engine
    };
    let (shape, name, n, spec, seed_data) = match &opts.workload {
        Workload::Shape(s, n) => {
            let (spec, data) = shape_spec(*s, *n)?;
            (format!("{s:?}").to_lowercase(), None, *n, spec, data)
        }
        Workload::Spec { name, spec, .. } => {
            let data = spec
                .tests
                .first()
                .map(|t| {
                    t.given
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                })
                .unwrap_or_default();
            let n = spec.derivations.len();
            ("spec".into(), Some(name.clone()), n, (**spec).clone(), data)
        }
    };
    let mut gen = Mutations::new(&opts.workload, &seed_data, opts.seed)?;
    let service = opts.service || opts.durable;
    let mut target: Box<dyn Target> = if service {
        Box::new(Service::open(
            spec,
            &seed_data,
            limits,
            opts.durable,
            progress,
        )?)
    } else {
        Box::new(Engine::open(spec, &seed_data, limits, progress)?)
    };
    // The initial data is in the model now; what stays resident is the model's.
    drop(seed_data);
    let (compile_ms, first_cycle_ms, nodes) = target.built();
    let (warmup_mutations, warmup_ms) = warm_up(target.as_mut(), &mut gen, opts.warmup, progress);
    // Latencies in nanoseconds as u32 (a mutation over 4 s counts as 4 s): 4 bytes a sample
    // rather than a Duration's 16, so a long run's own record stays out of `rss_mb`.
    let mut times: Vec<u32> = Vec::with_capacity(opts.mutations.min(1 << 20));
    let (mut rejected, mut evaluated, mut updated, mut committed) =
        (0usize, 0usize, 0usize, 0usize);
    let started = Instant::now();
    while times.len() < opts.mutations.max(1)
        && (times.is_empty() || started.elapsed() < opts.max_time)
    {
        let batch = gen.next();
        let t = Instant::now();
        let r = target.mutate(batch);
        times.push(u32::try_from(t.elapsed().as_nanos()).unwrap_or(u32::MAX));
        match r {
            Some((e, u)) => {
                committed += 1;
                evaluated += e;
                updated += u;
            }
            None => rejected += 1,
        }
        if times.len().is_multiple_of(64) {
            progress(Progress::Timed {
                done: times.len(),
                of: opts.mutations,
            });
        }
    }
    let total = started.elapsed();
    // Resident memory with the model still loaded (the model is what is being measured).
    let (rss, peak) = rss_mb();
    drop(target);
    progress(Progress::Timed {
        done: times.len(),
        of: times.len(),
    });
    times.sort_unstable();
    let pct = |p: f64| ns_us(times[rank(times.len(), p)]);
    let sum: u64 = times.iter().map(|&t| u64::from(t)).sum();
    let per = |x: usize| {
        if committed == 0 {
            0.0
        } else {
            x as f64 / committed as f64
        }
    };
    Ok(Report {
        shape,
        spec: name,
        n,
        nodes,
        jit: opts.jit,
        service,
        durable: opts.durable,
        compile_ms,
        first_cycle_ms,
        warmup_mutations,
        warmup_ms,
        mutations: times.len(),
        rejected,
        p50_us: pct(0.50),
        p90_us: pct(0.90),
        p99_us: pct(0.99),
        max_us: times.last().map_or(0.0, |&t| ns_us(t)),
        mean_us: sum as f64 / 1e3 / times.len() as f64,
        mutations_per_s: times.len() as f64 / total.as_secs_f64().max(1e-9),
        recomputed_per_mutation: per(evaluated),
        derived_updated_per_mutation: per(updated),
        rss_mb: rss,
        peak_rss_mb: peak,
        huge_pages: crate::allocator::huge_pages(),
    })
}

/// Run untimed mutations for `time`: how many ran, and how long they took in ms.
fn warm_up(
    target: &mut dyn Target,
    gen: &mut Mutations,
    time: Duration,
    progress: &mut dyn FnMut(Progress),
) -> (usize, f64) {
    let started = Instant::now();
    let mut done = 0usize;
    loop {
        let elapsed = started.elapsed();
        if elapsed >= time {
            break;
        }
        if done.is_multiple_of(256) {
            progress(Progress::WarmUp { elapsed, of: time });
        }
        target.mutate(gen.next());
        done += 1;
    }
    (done, ms(started.elapsed()))
}

/// What a run drives: the engine alone, or the service (in memory or over a store).
trait Target {
    /// Compile ms, first-cycle ms, graph nodes.
    fn built(&self) -> (f64, f64, usize);
    /// One cycle: (evaluations, derived values changed), or `None` when refused.
    fn mutate(&mut self, batch: Vec<(String, Json)>) -> Option<(usize, usize)>;
}

struct Engine {
    model: Model,
    built: (f64, f64, usize),
}

impl Engine {
    fn open(
        spec: ModelSpec,
        seed_data: &[(String, Json)],
        limits: EngineLimits,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Engine, String> {
        progress(Progress::Building {
            nodes: spec_nodes(&spec),
            first_cycle: false,
        });
        let spec = Arc::new(spec);
        let t = Instant::now();
        let compiled = valem_engine::compile::compile(spec.clone(), &limits).map_err(|errs| {
            let first = errs
                .first()
                .map_or(String::new(), |e| format!("{}: {}", e.location, e.message));
            format!("the spec does not compile: {first}")
        })?;
        let compile_ms = ms(t.elapsed());
        let nodes = compiled.nodes.len();

        progress(Progress::Building {
            nodes,
            first_cycle: true,
        });
        let t = Instant::now();
        let (mut model, _) = Model::from_compiled(std::rc::Rc::new(compiled), NOW, limits)
            .map_err(|e| format!("the model cannot be created: {e}"))?;
        if !seed_data.is_empty() {
            model
                .mutate(seed_data, NOW)
                .map_err(|e| format!("the initial data does not apply: {e}"))?;
        }
        let first_cycle_ms = ms(t.elapsed());
        Ok(Engine {
            model,
            built: (compile_ms, first_cycle_ms, nodes),
        })
    }
}

impl Target for Engine {
    fn built(&self) -> (f64, f64, usize) {
        self.built
    }

    fn mutate(&mut self, batch: Vec<(String, Json)>) -> Option<(usize, usize)> {
        let r = self.model.mutate(&batch, NOW).ok()?;
        Some((r.traces.len(), r.derived_updated.len()))
    }
}

/// The service with one shard, in memory or over a strict store in a temporary directory
/// (removed after).
struct Service {
    service: Arc<valem_service::ModelService>,
    id: valem_service::ModelId,
    built: (f64, f64, usize),
    _dir: Option<tempfile::TempDir>,
}

impl Service {
    fn open(
        spec: ModelSpec,
        seed_data: &[(String, Json)],
        engine: EngineLimits,
        durable: bool,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Service, String> {
        let limits = valem_service::ServiceLimits {
            engine,
            ..Default::default()
        };
        let (service, dir) = if durable {
            let dir = tempfile::Builder::new()
                .prefix("valem-bench-")
                .tempdir()
                .map_err(|e| format!("cannot create a temporary data directory: {e}"))?;
            let store =
                valem_store::SqliteStore::open(dir.path(), valem_store::StoreOptions::default())
                    .map_err(|e| format!("cannot open a store in {}: {e}", dir.path().display()))?;
            let service = valem_service::ModelService::open(1, limits, Arc::new(store))
                .map_err(|e| format!("the service does not start: {e}"))?;
            (service, Some(dir))
        } else {
            (valem_service::ModelService::new(1, limits), None)
        };
        let id = valem_service::ModelId::from(&spec.id);
        let nodes = spec_nodes(&spec);
        progress(Progress::Building {
            nodes,
            first_cycle: false,
        });
        let t = Instant::now();
        service
            .create(spec)
            .map_err(|e| format!("the model cannot be created: {e}"))?;
        let compile_ms = ms(t.elapsed());
        progress(Progress::Building {
            nodes,
            first_cycle: true,
        });
        let t = Instant::now();
        if !seed_data.is_empty() {
            service
                .mutate(&id, seed_data.to_vec())
                .wait()
                .map_err(|e| format!("the initial data does not apply: {e}"))?;
        }
        let first_cycle_ms = ms(t.elapsed());
        Ok(Service {
            service,
            id,
            built: (compile_ms, first_cycle_ms, nodes),
            _dir: dir,
        })
    }
}

impl Target for Service {
    fn built(&self) -> (f64, f64, usize) {
        self.built
    }

    fn mutate(&mut self, batch: Vec<(String, Json)>) -> Option<(usize, usize)> {
        let r = self.service.mutate(&self.id, batch).wait().ok()?;
        Some((r.traces.len(), r.derived_updated.len()))
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.service.drain();
    }
}

/// A spec's graph nodes, one per derivation, meta-derivation, constraint and effect (what the
/// service's model info counts too).
fn spec_nodes(spec: &ModelSpec) -> usize {
    spec.derivations.len()
        + spec.meta_derivations.len()
        + spec.constraints.len()
        + spec.effects.len()
}

/// The index of quantile `p` among `len` sorted samples (nearest rank; `len` ≥ 1).
pub(crate) fn rank(len: usize, p: f64) -> usize {
    ((len as f64 * p).ceil() as usize).clamp(1, len.max(1)) - 1
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ns_us(ns: u32) -> f64 {
    f64::from(ns) / 1e3
}

/// Resident memory in MB from /proc/self/status: (VmRSS, VmHWM); NaN where unavailable.
/// mimalloc first returns the pages it holds free (`mi_collect`), so VmRSS is the live
/// footprint rather than depending on whether a delayed purge has run yet.
pub fn rss_mb() -> (f64, f64) {
    crate::allocator::release();
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

// --- shapes ------------------------------------------------------------------------------------

/// A shape's spec and its initial data (one mutation).
pub fn shape_spec(shape: Shape, n: usize) -> Result<(ModelSpec, Vec<(String, Json)>), String> {
    if n == 0 {
        return Err("--n must be at least 1".into());
    }
    let mut data = Vec::new();
    let spec = match shape {
        Shape::Fanout => {
            // The whole document in one write, as a client loading a model sends it (not 2n
            // addresses, each parsed, validated and written on its own).
            let mut doc = serde_json::Map::with_capacity(2 * n);
            for i in 0..n {
                doc.insert(format!("price_{i}"), json!(i + 1));
                doc.insert(format!("qty_{i}"), json!(2));
            }
            data.push(("$".into(), Json::Object(doc)));
            json!({
                "id": "fanout",
                "schema": {"type": "object"},
                "derivations": (0..n)
                    .map(|i| json!({"path": format!("$.total_{i}"), "expr": format!("price_{i} * qty_{i}")}))
                    .collect::<Vec<_>>(),
            })
        }
        Shape::Chain => {
            data.push(("$.seed".into(), json!(0)));
            json!({
                "id": "chain",
                "schema": {"type": "object"},
                "derivations": (0..n)
                    .map(|i| {
                        let expr = if i == 0 { "seed + 1".to_string() } else { format!("f_{} + 1", i - 1) };
                        json!({"path": format!("$.f_{i}"), "expr": expr})
                    })
                    .collect::<Vec<_>>(),
            })
        }
        Shape::Items | Shape::Mixed => {
            let items: Vec<Json> = (0..n)
                .map(|i| json!({"price": (i % 97) + 1, "qty": 2, "discount": 0}))
                .collect();
            data.push(("$.items".into(), Json::Array(items)));
            let mut spec = json!({
                "id": if shape == Shape::Items { "items" } else { "mixed" },
                "schema": {"type": "object"},
                "derivations": [
                    {"path": "$.items[*].total", "expr": "$parent.price * $parent.qty"},
                    {"path": "$.sum", "expr": "$sum(items.total)"}
                ],
            });
            if shape == Shape::Mixed {
                spec = json!({
                    "id": "mixed",
                    "schema": {"type": "object", "properties": {"items": {"type": "array", "items": {
                        "type": "object",
                        "properties": {
                            "price": {"type": "number", "minimum": 0},
                            "qty": {"type": "integer", "minimum": 0},
                            "discount": {"type": "number", "minimum": 0, "maximum": 1}
                        }
                    }}}},
                    "constants": {"taxRate": 0.2, "maxDiscount": 0.5},
                    "derivations": [
                        {"path": "$.items[*].total", "expr": "$parent.price * $parent.qty * (1 - $parent.discount)"},
                        {"path": "$.sum", "expr": "$sum(items.total)"},
                        {"path": "$.tax", "expr": "$round(sum * $const.taxRate, 2)"},
                        {"path": "$.grand", "expr": "sum + tax"}
                    ],
                    "metaDerivations": [
                        {"path": "$.items[*].discount", "property": "readOnly", "expr": "qty = 0"}
                    ],
                    "constraints": [
                        {"id": "discount-cap", "path": "$.items[*]", "expr": "discount <= $const.maxDiscount",
                         "message": "discount above the cap", "policy": "rollback"},
                        {"id": "big-order", "expr": "grand < 1000000000", "message": "very large order", "policy": "flag"}
                    ]
                });
            }
            spec
        }
    };
    let spec = parse_spec(&spec).map_err(|e| format!("{}: {}", e.location(), e.message()))?;
    Ok((spec, data))
}

// --- mutations ---------------------------------------------------------------------------------

/// A writable leaf the generator may write, with what values it accepts.
#[derive(Clone, Debug)]
struct Field {
    addr: String,
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    Number { min: f64, max: f64, integer: bool },
    Bool,
    Enum(Vec<Json>),
    Text { max_len: usize },
}

enum Mutations {
    Shape {
        shape: Shape,
        n: usize,
        counter: u64,
        rng: Rng,
    },
    File {
        list: Vec<Vec<(String, Json)>>,
        i: usize,
    },
    Fields {
        fields: Vec<Field>,
        rng: Rng,
    },
}

impl Mutations {
    fn new(w: &Workload, seed_data: &[(String, Json)], seed: u64) -> Result<Mutations, String> {
        Ok(match w {
            Workload::Shape(shape, n) => Mutations::Shape {
                shape: *shape,
                n: *n,
                counter: 1_000,
                rng: Rng::new(seed),
            },
            Workload::Spec {
                mutations: Some(list),
                ..
            } => {
                if list.is_empty() {
                    return Err("the mutations file holds no mutation".into());
                }
                Mutations::File {
                    list: list.clone(),
                    i: 0,
                }
            }
            Workload::Spec { spec, name, .. } => {
                let fields = writable_fields(spec, seed_data);
                if fields.is_empty() {
                    return Err(format!(
                        "{name}: no writable number, integer, boolean or string field found in the \
                         schema or the first test's data; give the mutations with --mutations FILE"
                    ));
                }
                Mutations::Fields {
                    fields,
                    rng: Rng::new(seed),
                }
            }
        })
    }

    fn next(&mut self) -> Vec<(String, Json)> {
        match self {
            Mutations::Shape {
                shape,
                n,
                counter,
                rng,
            } => {
                *counter += 1;
                let k = rng.below(*n);
                match shape {
                    Shape::Fanout => vec![(format!("$.price_{k}"), json!(*counter))],
                    Shape::Chain => vec![("$.seed".into(), json!(*counter))],
                    // Values only grow: every write changes its item (no early cutoff).
                    Shape::Items => vec![(format!("$.items[{k}].qty"), json!(*counter))],
                    Shape::Mixed => {
                        if *counter % 2 == 0 {
                            vec![(format!("$.items[{k}].qty"), json!(*counter))]
                        } else {
                            // Now and then above the cap: a rollback.
                            let d = (*counter % 7) as f64 / 10.0;
                            vec![(format!("$.items[{k}].discount"), json!(d))]
                        }
                    }
                }
            }
            Mutations::File { list, i } => {
                let m = list[*i % list.len()].clone();
                *i += 1;
                m
            }
            Mutations::Fields { fields, rng } => {
                let f = &fields[rng.below(fields.len())];
                vec![(f.addr.clone(), f.kind.value(rng))]
            }
        }
    }
}

impl Kind {
    fn value(&self, rng: &mut Rng) -> Json {
        match self {
            Kind::Number { min, max, integer } => {
                let x = min + (max - min) * rng.unit();
                if *integer {
                    json!(x.round().clamp(min.ceil(), max.floor()) as i64)
                } else {
                    json!((x * 100.0).round() / 100.0)
                }
            }
            Kind::Bool => json!(rng.below(2) == 1),
            Kind::Enum(vals) => vals[rng.below(vals.len())].clone(),
            Kind::Text { max_len } => {
                let s = format!("v{}", rng.below(100_000));
                json!(s.chars().take((*max_len).max(1)).collect::<String>())
            }
        }
    }
}

/// Writable leaves: the schema's properties (recursively; array elements at the indices the
/// seeded data has), minus derived targets and `readOnly` fields.
fn writable_fields(spec: &ModelSpec, seed_data: &[(String, Json)]) -> Vec<Field> {
    let derived: Vec<Address> = spec
        .derivations
        .iter()
        .filter_map(|d| Address::parse(&d.path).ok())
        .collect();
    // The seeded base document, from a scratch model (spec workloads are small).
    let limits = EngineLimits {
        max_mutations: usize::MAX,
        ..EngineLimits::default()
    };
    let doc = match Model::create(spec, NOW, limits) {
        Ok((mut m, _)) => {
            let _ = m.mutate(seed_data, NOW);
            m.state().base.to_json()
        }
        Err(_) => Json::Null,
    };
    let mut out = Vec::new();
    walk_schema(&spec.schema, &spec.schema, "$", Some(&doc), &mut out, 0);
    out.retain(|f| {
        let Ok(a) = Address::parse(&f.addr) else {
            return false;
        };
        let Some(c) = a.concrete() else { return false };
        !derived.iter().any(|d| matches_concrete(d, &c))
    });
    out
}

fn matches_concrete(pattern: &Address, c: &[Seg]) -> bool {
    use valem_core::expr::path::PathSeg;
    pattern.segs.len() == c.len()
        && pattern.segs.iter().zip(c).all(|(p, s)| match (p, s) {
            (PathSeg::Wild, Seg::Index(_)) => true,
            (PathSeg::Index(i), Seg::Index(j)) => i == j,
            (PathSeg::Field(a), Seg::Field(b)) => **a == **b,
            _ => false,
        })
}

/// Resolve a local `$ref` (`#/...`) against the root schema.
fn resolve<'a>(root: &'a Json, s: &'a Json) -> &'a Json {
    let mut s = s;
    for _ in 0..16 {
        match s.get("$ref").and_then(Json::as_str) {
            Some(r) => match r.strip_prefix('#').and_then(|p| root.pointer(p)) {
                Some(t) => s = t,
                None => return s,
            },
            None => return s,
        }
    }
    s
}

fn walk_schema(
    root: &Json,
    s: &Json,
    at: &str,
    data: Option<&Json>,
    out: &mut Vec<Field>,
    depth: usize,
) {
    if depth > 32 {
        return;
    }
    let s = resolve(root, s);
    if s.get("readOnly") == Some(&Json::Bool(true)) {
        return;
    }
    if let Some(vals) = s.get("enum").and_then(Json::as_array) {
        if !vals.is_empty() {
            out.push(Field {
                addr: at.into(),
                kind: Kind::Enum(vals.clone()),
            });
        }
        return;
    }
    let ty = match s.get("type") {
        Some(Json::String(t)) => t.as_str(),
        Some(Json::Array(ts)) => ts
            .iter()
            .filter_map(Json::as_str)
            .find(|t| *t != "null")
            .unwrap_or(""),
        _ => "",
    };
    let num = |k: &str| s.get(k).and_then(Json::as_f64);
    match ty {
        "object" => {
            let empty = Map::new();
            let props = s
                .get("properties")
                .and_then(Json::as_object)
                .unwrap_or(&empty);
            for (k, sub) in props {
                if !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || k.is_empty() {
                    continue;
                }
                let child = data.and_then(|d| d.get(k));
                walk_schema(root, sub, &format!("{at}.{k}"), child, out, depth + 1);
            }
        }
        "array" => {
            let (Some(items), Some(Json::Array(elems))) = (s.get("items"), data) else {
                return;
            };
            for (i, e) in elems.iter().enumerate().take(1000) {
                walk_schema(root, items, &format!("{at}[{i}]"), Some(e), out, depth + 1);
            }
        }
        "number" | "integer" => {
            let min = num("minimum")
                .or(num("exclusiveMinimum").map(|x| x + 1.0))
                .unwrap_or(0.0);
            let max = num("maximum")
                .or(num("exclusiveMaximum").map(|x| x - 1.0))
                .unwrap_or(min + 1000.0);
            if max >= min {
                out.push(Field {
                    addr: at.into(),
                    kind: Kind::Number {
                        min,
                        max,
                        integer: ty == "integer",
                    },
                });
            }
        }
        "boolean" => out.push(Field {
            addr: at.into(),
            kind: Kind::Bool,
        }),
        "string" if s.get("pattern").is_none() && s.get("format").is_none() => {
            let max_len = num("maxLength").map_or(12, |m| m as usize);
            let min_len = num("minLength").map_or(0, |m| m as usize);
            if min_len <= 2 {
                out.push(Field {
                    addr: at.into(),
                    kind: Kind::Text { max_len },
                });
            }
        }
        _ => {}
    }
}

/// A cheap deterministic sequence (xorshift64*).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((self.next() >> 33) as usize) % n.max(1)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The human table.
pub fn table(r: &Report) -> String {
    let what = match &r.spec {
        Some(s) => format!("spec {s}"),
        None => format!("{} n={}", r.shape, r.n),
    };
    let rows = [
        (
            "model",
            format!(
                "{what} ({} nodes), jit {}, through {}",
                r.nodes,
                if r.jit { "on" } else { "off" },
                match (r.service, r.durable) {
                    (_, true) => "the service and a durable store",
                    (true, false) => "the service, in memory",
                    (false, false) => "the engine",
                }
            ),
        ),
        ("compile", format!("{:.1} ms", r.compile_ms)),
        ("first cycle", format!("{:.1} ms", r.first_cycle_ms)),
        (
            "warm-up",
            format!(
                "{} untimed mutations in {:.0} ms",
                r.warmup_mutations, r.warmup_ms
            ),
        ),
        (
            "mutations",
            format!(
                "{} ({} rejected), {:.0}/s",
                r.mutations, r.rejected, r.mutations_per_s
            ),
        ),
        (
            "latency",
            format!(
                "p50 {} · p90 {} · p99 {} · max {}",
                dur(r.p50_us),
                dur(r.p90_us),
                dur(r.p99_us),
                dur(r.max_us)
            ),
        ),
        (
            "recomputed",
            format!(
                "{:.1} evaluations, {:.1} derived values changed per mutation",
                r.recomputed_per_mutation, r.derived_updated_per_mutation
            ),
        ),
        (
            "memory",
            format!(
                "{:.1} MB resident ({:.1} MB peak), huge pages {}",
                r.rss_mb,
                r.peak_rss_mb,
                if r.huge_pages { "on" } else { "off" }
            ),
        ),
    ];
    rows.iter().map(|(k, v)| format!("{k:<12} {v}\n")).collect()
}

fn dur(us: f64) -> String {
    if us >= 1000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{us:.1} µs")
    }
}
