//! `valem bench --models N`: many small models through the model service over a durable store
//! (strict, or `--durability relaxed`, in a temporary directory), as a daemon with `--data-dir` keeps them: how fast they
//! are created from one caller, what each costs in resident memory, and how long a read takes
//! when the model is in memory and when it must be woken from the store
//! (`--max-resident-models`).

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use serde_json::Value as Json;

use valem_core::spec::ModelSpec;
use valem_service::{ModelId, ModelService, ServiceLimits};

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// How many models.
    pub models: usize,
    /// The spec every model is a copy of (its id replaced), and its name.
    pub spec: ModelSpec,
    pub spec_name: String,
    /// `--max-resident-models` for the service (`None`: every model stays in memory).
    pub max_resident: Option<usize>,
    /// Shard threads (0: one per core, as `valem serve`).
    pub shards: usize,
    /// Reads to time in each read phase.
    pub reads: usize,
    pub seed: u64,
    /// Drive a running daemon at this URL over REST (one keep-alive client) instead of a
    /// service in this process; memory is then the daemon's, read from its `/metrics`.
    pub url: Option<String>,
    pub api_key: Option<String>,
    /// In-process: acknowledge after COMMIT without fsync (`--durability relaxed`).
    pub relaxed: bool,
    /// Creations in flight at once (each caller thread with its own connection over REST).
    pub concurrency: usize,
}

/// The measurements (`--json` prints exactly this object).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub spec: String,
    /// The daemon driven over REST (`--url`), or absent: a service in this process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    pub models: usize,
    /// The residency bound, when one was set.
    pub max_resident: Option<usize>,
    pub shards: usize,
    /// In-process: whether the store acknowledged after COMMIT without fsync.
    pub relaxed: bool,
    /// Creations in flight at once: 1 is one call after the other.
    pub concurrency: usize,
    /// Creations per second (all of them over the wall time of the phase), and their latency
    /// (µs), each call timed alone.
    pub creates_per_s: f64,
    pub create_p50_us: f64,
    pub create_p99_us: f64,
    /// Resident memory before the first model and after the last (MB), and the difference per
    /// model (KB): with a bound, the memory of the resident ones spread over all.
    pub rss_before_mb: f64,
    pub rss_after_mb: f64,
    pub kb_per_model: f64,
    /// Models in memory and hibernated at the end of the creations.
    pub resident: u64,
    pub hibernated: u64,
    /// Reads of the state of a model in memory (the same one, again and again).
    pub warm_read_p50_us: f64,
    pub warm_read_p99_us: f64,
    /// Reads of models picked at random among all: with a bound most are woken from the store
    /// (`cold_reads_woken` of them).
    pub cold_read_p50_us: f64,
    pub cold_read_p99_us: f64,
    pub cold_reads: usize,
    pub cold_reads_woken: u64,
}

/// Where the models live: a service in this process, or a daemon over REST.
trait Target: Send {
    /// Another handle on the same models, for one more caller thread (over REST: its own
    /// connection).
    fn fork(&self) -> Result<Box<dyn Target>, String>;
    fn create(&mut self, i: usize) -> Result<(), String>;
    fn read(&mut self, i: usize) -> Result<(), String>;
    /// Resident MB, models resident and hibernated, and wakes so far.
    fn memory(&mut self) -> Result<(f64, u64, u64, u64), String>;
}

fn id(i: usize) -> String {
    format!("m{i}")
}

struct InProcess {
    svc: Arc<ModelService>,
    spec: ModelSpec,
    _dir: Arc<tempfile::TempDir>,
}

impl Target for InProcess {
    fn fork(&self) -> Result<Box<dyn Target>, String> {
        Ok(Box::new(InProcess {
            svc: self.svc.clone(),
            spec: self.spec.clone(),
            _dir: self._dir.clone(),
        }))
    }

    fn create(&mut self, i: usize) -> Result<(), String> {
        let mut spec = self.spec.clone();
        spec.id = id(i);
        self.svc
            .create(spec)
            .map(|_| ())
            .map_err(|e| format!("model {} cannot be created: {e}", id(i)))
    }

    fn read(&mut self, i: usize) -> Result<(), String> {
        let state: Json = self
            .svc
            .state(&ModelId::from(&id(i)), None)
            .wait()
            .map_err(|e| format!("model {} cannot be read: {e}", id(i)))?;
        std::hint::black_box(state);
        Ok(())
    }

    fn memory(&mut self) -> Result<(f64, u64, u64, u64), String> {
        // What is in flight to the store (eviction checkpoints) lands first.
        if let Some(s) = self.svc.store() {
            s.flush()
                .map_err(|e| format!("the store does not flush: {e}"))?;
        }
        let res = self.svc.residency();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        Ok((
            crate::bench::rss_mb().0,
            load(&res.resident),
            load(&res.hibernated),
            res.wakes.cumulative().0.last().copied().unwrap_or(0),
        ))
    }
}

struct Rest {
    remote: crate::console::remote::Remote,
    url: String,
    api_key: Option<String>,
    /// The spec's text after its `id` member: a body is `{"id":"m<i>",` and this.
    tail: String,
}

impl Target for Rest {
    fn fork(&self) -> Result<Box<dyn Target>, String> {
        Ok(Box::new(Rest {
            remote: crate::console::remote::Remote::new(&self.url, self.api_key.clone())
                .map_err(|e| e.to_string())?,
            url: self.url.clone(),
            api_key: self.api_key.clone(),
            tail: self.tail.clone(),
        }))
    }

    fn create(&mut self, i: usize) -> Result<(), String> {
        use crate::console::remote::Body;
        let body = format!("{{\"id\":\"{}\",{}", id(i), self.tail);
        self.remote
            .call(
                "POST",
                "/models",
                None,
                Body::Raw {
                    content_type: "application/json".into(),
                    bytes: body.into_bytes(),
                },
            )
            .map(|_| ())
            .map_err(|e| format!("model {} cannot be created: {e}", id(i)))
    }

    fn read(&mut self, i: usize) -> Result<(), String> {
        use crate::console::remote::Body;
        self.remote
            .call("GET", &format!("/models/{}/state", id(i)), None, Body::None)
            .map(|r| {
                std::hint::black_box(r);
            })
            .map_err(|e| format!("model {} cannot be read: {e}", id(i)))
    }

    fn memory(&mut self) -> Result<(f64, u64, u64, u64), String> {
        use crate::console::remote::Body;
        let r = self
            .remote
            .call("GET", "/metrics", None, Body::None)
            .map_err(|e| format!("the daemon's metrics cannot be read: {e}"))?;
        let text = String::from_utf8_lossy(&r.bytes);
        let metric = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
                .unwrap_or(f64::NAN)
        };
        Ok((
            metric("process_resident_memory_bytes") / (1024.0 * 1024.0),
            metric("valem_models_resident") as u64,
            metric("valem_models_hibernated") as u64,
            metric("valem_model_wake_seconds_count") as u64,
        ))
    }
}

fn target(opts: &Options) -> Result<Box<dyn Target>, String> {
    if let Some(url) = &opts.url {
        let remote = crate::console::remote::Remote::new(url, opts.api_key.clone())
            .map_err(|e| e.to_string())?;
        let text = serde_json::to_string(&opts.spec).map_err(|e| e.to_string())?;
        let mut prefix = String::from("{\"id\":");
        prefix.push_str(&serde_json::to_string(&opts.spec.id).map_err(|e| e.to_string())?);
        prefix.push(',');
        let tail = text
            .strip_prefix(&prefix)
            .ok_or("the spec does not serialise with its id first")?
            .to_string();
        return Ok(Box::new(Rest {
            remote,
            url: url.clone(),
            api_key: opts.api_key.clone(),
            tail,
        }));
    }
    let dir = tempfile::Builder::new()
        .prefix("valem-bench-models-")
        .tempdir()
        .map_err(|e| format!("cannot create a temporary data directory: {e}"))?;
    let store_opts = valem_store::StoreOptions {
        durability: if opts.relaxed {
            valem_store::Durability::Relaxed
        } else {
            valem_store::Durability::Strict
        },
        ..Default::default()
    };
    let store = valem_store::SqliteStore::open(dir.path(), store_opts)
        .map_err(|e| format!("cannot open a store in {}: {e}", dir.path().display()))?;
    let limits = ServiceLimits {
        max_models: opts.models,
        max_resident_models: opts.max_resident,
        ..Default::default()
    };
    let svc = ModelService::open(opts.shards, limits, Arc::new(store))
        .map_err(|e| format!("the service does not start: {e}"))?;
    Ok(Box::new(InProcess {
        svc,
        spec: opts.spec.clone(),
        _dir: Arc::new(dir),
    }))
}

/// Run it. `progress` hears `(phase, done, of)`.
pub fn run(opts: &Options, progress: &mut dyn FnMut(&str, usize, usize)) -> Result<Report, String> {
    if opts.models == 0 {
        return Err("--models must be at least 1".into());
    }
    let mut t = target(opts)?;
    let (rss_before, ..) = t.memory()?;
    let started = Instant::now();
    let mut creates = create_all(&mut t, opts, progress)?;
    let wall_s = started.elapsed().as_secs_f64();
    let (rss_after, resident, hibernated, _) = t.memory()?;

    let reads = opts.reads.max(1);
    let timed = |t: &mut Box<dyn Target>, i: usize| -> Result<u64, String> {
        let started = Instant::now();
        t.read(i)?;
        Ok(started.elapsed().as_nanos() as u64)
    };
    // Warm: the newest model, in memory whatever the bound.
    let newest = opts.models - 1;
    timed(&mut t, newest)?;
    let mut warm = Vec::with_capacity(reads);
    for k in 0..reads {
        warm.push(timed(&mut t, newest)?);
        if k % 256 == 0 {
            progress("warm reads", k, reads);
        }
    }
    let (.., woken_before) = t.memory()?;
    let mut rng = crate::bench::Rng::new(opts.seed);
    let mut cold = Vec::with_capacity(reads);
    for k in 0..reads {
        cold.push(timed(&mut t, rng.below(opts.models))?);
        if k % 256 == 0 {
            progress("cold reads", k, reads);
        }
    }
    let (.., woken_after) = t.memory()?;
    Ok(Report {
        spec: opts.spec_name.clone(),
        url: opts.url.clone(),
        models: opts.models,
        max_resident: opts.max_resident,
        shards: opts.shards,
        relaxed: opts.relaxed,
        concurrency: opts.concurrency.max(1),
        creates_per_s: opts.models as f64 / wall_s.max(1e-9),
        create_p50_us: quantile(&mut creates, 0.5),
        create_p99_us: quantile(&mut creates, 0.99),
        rss_before_mb: rss_before,
        rss_after_mb: rss_after,
        kb_per_model: (rss_after - rss_before) * 1024.0 / opts.models as f64,
        resident,
        hibernated,
        warm_read_p50_us: quantile(&mut warm, 0.5),
        warm_read_p99_us: quantile(&mut warm, 0.99),
        cold_read_p50_us: quantile(&mut cold, 0.5),
        cold_read_p99_us: quantile(&mut cold, 0.99),
        cold_reads: reads,
        cold_reads_woken: woken_after.saturating_sub(woken_before),
    })
}

/// Create every model, `opts.concurrency` calls in flight at once (caller `c` creates the
/// models `i` with `i % concurrency == c`); the latency of each call (ns), in no set order.
fn create_all(
    t: &mut Box<dyn Target>,
    opts: &Options,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<Vec<u64>, String> {
    let k = opts.concurrency.clamp(1, opts.models);
    let timed = |t: &mut Box<dyn Target>, i: usize| -> Result<u64, String> {
        let started = Instant::now();
        t.create(i)?;
        Ok(started.elapsed().as_nanos() as u64)
    };
    if k == 1 {
        let mut creates = Vec::with_capacity(opts.models);
        for i in 0..opts.models {
            creates.push(timed(t, i)?);
            if i % 256 == 0 {
                progress("creating", i, opts.models);
            }
        }
        return Ok(creates);
    }
    let mut callers = Vec::with_capacity(k);
    for _ in 0..k {
        callers.push(t.fork()?);
    }
    progress("creating", 0, opts.models);
    let models = opts.models;
    let results: Vec<Result<Vec<u64>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = callers
            .into_iter()
            .enumerate()
            .map(|(c, mut caller)| {
                s.spawn(move || {
                    (c..models)
                        .step_by(k)
                        .map(|i| timed(&mut caller, i))
                        .collect::<Result<Vec<u64>, String>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a creating thread panicked".into()))
            })
            .collect()
    });
    let mut creates = Vec::with_capacity(models);
    for r in results {
        creates.extend(r?);
    }
    Ok(creates)
}

/// The `q` quantile of nanosecond samples, in µs.
fn quantile(ns: &mut [u64], q: f64) -> f64 {
    if ns.is_empty() {
        return f64::NAN;
    }
    ns.sort_unstable();
    ns[crate::bench::rank(ns.len(), q)] as f64 / 1e3
}

/// The report as a table.
pub fn table(r: &Report) -> String {
    let bound = match (&r.url, r.max_resident) {
        (Some(_), _) => "as the daemon has it".to_string(),
        (None, Some(m)) => m.to_string(),
        (None, None) => "none".to_string(),
    };
    format!(
        "valem bench --models {models}: {spec}, {place}, max resident {bound}\n\
         creates        {cps:>10.0} /s    p50 {cp50:>9.1} µs   p99 {cp99:>9.1} µs   ({k} in flight)\n\
         memory         {kb:>10.1} KB per model (RSS {before:.1} → {after:.1} MB); {resident} resident, {hib} hibernated\n\
         warm read      p50 {wp50:>9.1} µs   p99 {wp99:>9.1} µs\n\
         cold read      p50 {kp50:>9.1} µs   p99 {kp99:>9.1} µs   ({woken} of {reads} woken from the store)\n",
        models = r.models,
        spec = r.spec,
        place = match &r.url {
            Some(u) => format!("over REST at {u}"),
            None => format!(
                "{} shard(s), durable ({})",
                r.shards,
                if r.relaxed { "relaxed" } else { "strict" }
            ),
        },
        cps = r.creates_per_s,
        k = r.concurrency,
        cp50 = r.create_p50_us,
        cp99 = r.create_p99_us,
        kb = r.kb_per_model,
        before = r.rss_before_mb,
        after = r.rss_after_mb,
        resident = r.resident,
        hib = r.hibernated,
        wp50 = r.warm_read_p50_us,
        wp99 = r.warm_read_p99_us,
        kp50 = r.cold_read_p50_us,
        kp99 = r.cold_read_p99_us,
        woken = r.cold_reads_woken,
        reads = r.cold_reads,
    )
}
