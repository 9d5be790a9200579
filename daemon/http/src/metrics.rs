//! `/metrics`: Prometheus text exposition (format 0.0.4) of the daemon — HTTP requests by
//! status class, errors by kind, reactive cycles and their latency histogram, live models and
//! MCP sessions, sandbox pairings waiting and the mints refused or dropped, and with a store
//! its writer counters and the checkpoints refused.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::AppState;
use valem_service::metrics::BUCKETS;

#[derive(Default)]
pub struct Metrics {
    requests: [AtomicU64; 6],
    errors: Mutex<BTreeMap<&'static str, u64>>,
    /// `subscriptions/listen` streams opened over `/mcp`.
    pub mcp_listens_opened: AtomicU64,
    /// Listen streams closed because their reader fell too far behind.
    pub mcp_listens_overflowed: AtomicU64,
    /// Requests forwarded to another node of the fleet: answered, owner unreachable.
    forwards: [AtomicU64; 2],
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    /// One answered request (counted by status class 1xx … 5xx).
    pub fn request(&self, status: u16) {
        let class = usize::from(status / 100).min(5);
        if let Some(c) = self.requests.get(class) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request forwarded to the model's owner node (`answered`: it answered).
    pub fn forwarded(&self, answered: bool) {
        self.forwards[usize::from(!answered)].fetch_add(1, Ordering::Relaxed);
    }

    /// A request refused by the guard.
    pub fn rejected(&self, status: u16) {
        self.error(match status {
            401 => "unauthorized",
            403 => "forbidden",
            _ => "rejected",
        });
    }

    /// One failure of the given kind (`not_found`, `schema_violation`, …).
    pub fn error(&self, kind: &'static str) {
        if let Ok(mut m) = self.errors.lock() {
            *m.entry(kind).or_default() += 1;
        }
    }
}

pub async fn serve(State(st): State<AppState>) -> Response {
    let mut out = String::with_capacity(4096);
    let cm = st.service.metrics();
    let _ = writeln!(
        out,
        "# HELP valem_cycles_total Reactive cycles, by outcome.\n# TYPE valem_cycles_total counter"
    );
    for (outcome, v) in [
        ("committed", &cm.committed),
        ("rejected_schema", &cm.rejected_schema),
        ("rejected_constraint", &cm.rejected_constraint),
        ("rejected_other", &cm.rejected_other),
    ] {
        let _ = writeln!(
            out,
            "valem_cycles_total{{outcome=\"{outcome}\"}} {}",
            v.load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(
        out,
        "# HELP valem_idempotent_replays_total Writes sent again under their idempotency key, answered without being applied again.\n# TYPE valem_idempotent_replays_total counter\nvalem_idempotent_replays_total {}",
        cm.replayed.load(Ordering::Relaxed)
    );
    histogram(
        &mut out,
        "valem_cycle_duration_seconds",
        "Time of committed cycles on their shard.",
        cm.histogram(),
    );
    let _ = writeln!(
        out,
        "# HELP valem_models Live models (in memory and hibernated).\n# TYPE valem_models gauge\nvalem_models {}",
        st.service.model_count()
    );
    if let Some(bytes) = resident_bytes() {
        let _ = writeln!(
            out,
            "# HELP process_resident_memory_bytes Resident memory of the daemon.\n# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {bytes}"
        );
    }
    let res = st.service.residency();
    let _ = writeln!(
        out,
        "# HELP valem_models_resident Models in memory.\n# TYPE valem_models_resident gauge\nvalem_models_resident {}\n# HELP valem_models_hibernated Models in the store only, woken by their next request (--max-resident-models).\n# TYPE valem_models_hibernated gauge\nvalem_models_hibernated {}",
        res.resident.load(Ordering::Relaxed),
        res.hibernated.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# HELP valem_models_evicted_total Models evicted from memory past --max-resident-models.\n# TYPE valem_models_evicted_total counter\nvalem_models_evicted_total {}",
        res.evicted.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# HELP valem_model_copies_total Creations of a copy of a spec remembered from an earlier request body that differed only in its leading id (not parsed again).\n# TYPE valem_model_copies_total counter\nvalem_model_copies_total {}",
        res.copies.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# HELP valem_model_wake_failures_total Hibernated models that could not be woken (not served; the log says why).\n# TYPE valem_model_wake_failures_total counter\nvalem_model_wake_failures_total {}",
        res.wake_failures.load(Ordering::Relaxed)
    );
    histogram(
        &mut out,
        "valem_model_wake_seconds",
        "Time to wake a hibernated model: its stored spec, checkpoint and the records after it.",
        res.wakes.cumulative(),
    );
    let _ = writeln!(
        out,
        "# HELP valem_mcp_sessions Live Streamable HTTP MCP sessions.\n# TYPE valem_mcp_sessions gauge\nvalem_mcp_sessions {}",
        st.sessions.len()
    );
    let _ = writeln!(
        out,
        "# HELP valem_event_subscribers Change subscribers registered with the service (closed ones leave at the next commit).\n# TYPE valem_event_subscribers gauge\nvalem_event_subscribers {}",
        st.service.subscriber_count()
    );
    let _ = writeln!(
        out,
        "# HELP valem_mcp_tasks Tasks of the MCP tasks extension kept, and running now.\n# TYPE valem_mcp_tasks gauge\nvalem_mcp_tasks{{state=\"kept\"}} {}\nvalem_mcp_tasks{{state=\"running\"}} {}",
        st.mcp.tasks.len(),
        st.mcp.tasks.running()
    );
    let _ = writeln!(
        out,
        "# HELP valem_mcp_listens Open subscriptions/listen streams (MCP 2026-07-28).\n# TYPE valem_mcp_listens gauge\nvalem_mcp_listens {}",
        st.sessions.listens.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# HELP valem_mcp_listens_opened_total subscriptions/listen streams opened.\n# TYPE valem_mcp_listens_opened_total counter\nvalem_mcp_listens_opened_total {}",
        st.metrics.mcp_listens_opened.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# HELP valem_mcp_listens_overflowed_total Listen streams closed because their reader fell too far behind.\n# TYPE valem_mcp_listens_overflowed_total counter\nvalem_mcp_listens_overflowed_total {}",
        st.metrics.mcp_listens_overflowed.load(Ordering::Relaxed)
    );
    let p = st.pairings.stats();
    let _ = writeln!(
        out,
        "# HELP valem_pairings_pending Sandbox pairings waiting for approval.\n# TYPE valem_pairings_pending gauge\nvalem_pairings_pending {}",
        p.pending
    );
    let _ = writeln!(
        out,
        "# HELP valem_pairings_refused_total Sandbox pairing mints refused (429), by reason.\n# TYPE valem_pairings_refused_total counter"
    );
    for (reason, v) in [
        ("rate_limited", p.refused_rate_limited),
        ("capacity", p.refused_capacity),
    ] {
        let _ = writeln!(
            out,
            "valem_pairings_refused_total{{reason=\"{reason}\"}} {v}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP valem_pairings_evicted_total Waiting pairings dropped for a newer one minted by the same client.\n# TYPE valem_pairings_evicted_total counter\nvalem_pairings_evicted_total {}",
        p.evicted
    );
    let _ = writeln!(
        out,
        "# HELP valem_http_requests_total HTTP requests answered, by status class.\n# TYPE valem_http_requests_total counter"
    );
    for (i, c) in st.metrics.requests.iter().enumerate().skip(1) {
        let _ = writeln!(
            out,
            "valem_http_requests_total{{code=\"{i}xx\"}} {}",
            c.load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(
        out,
        "# HELP valem_forwards_total REST requests forwarded to the node that owns their model, by outcome.\n# TYPE valem_forwards_total counter"
    );
    for (i, outcome) in ["answered", "unreachable"].iter().enumerate() {
        let _ = writeln!(
            out,
            "valem_forwards_total{{outcome=\"{outcome}\"}} {}",
            st.metrics.forwards[i].load(Ordering::Relaxed)
        );
    }
    if let Some(c) = st.service.store().and_then(|s| s.claim_stats()) {
        let _ = writeln!(
            out,
            "# HELP valem_fleet_claims_total Models this node claimed, by what it took them from (new: unowned; again: its own; handover: released by another node; failover: another node's whose lease ran out).\n# TYPE valem_fleet_claims_total counter"
        );
        for (kind, v) in [
            ("new", c.new),
            ("again", c.again),
            ("handover", c.handovers),
            ("failover", c.failovers),
        ] {
            let _ = writeln!(out, "valem_fleet_claims_total{{kind=\"{kind}\"}} {v}");
        }
        let _ = writeln!(
            out,
            "# HELP valem_fleet_claims_refused_total Claims refused: another live node owns the model (the request was forwarded).\n# TYPE valem_fleet_claims_refused_total counter\nvalem_fleet_claims_refused_total {}",
            c.refused
        );
        let _ = writeln!(
            out,
            "# HELP valem_fleet_models_lost_total Models another node took from this one after its lease ran out.\n# TYPE valem_fleet_models_lost_total counter\nvalem_fleet_models_lost_total {}",
            c.lost
        );
    }
    if let Some(store) = st.service.store() {
        let w = store.stats();
        for (name, help, v) in [
            (
                "valem_store_batches_total",
                "Write batches committed (one transaction each).",
                w.batches_committed,
            ),
            (
                "valem_store_ops_total",
                "Writes committed (audit records, models, checkpoints…).",
                w.ops_committed,
            ),
            (
                "valem_store_fsyncs_total",
                "fsyncs of the database (strict: one per batch).",
                w.fsyncs,
            ),
            (
                "valem_store_failed_batches_total",
                "Write batches that failed and were rolled back.",
                w.batches_failed,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP valem_checkpoints_refused_total Checkpoints recovery or an ?at= read refused (they did not match their state or the audit chain), by what did not match.\n# TYPE valem_checkpoints_refused_total counter"
        );
        for (reason, v) in st.service.checkpoint_metrics().refused_counts() {
            let _ = writeln!(
                out,
                "valem_checkpoints_refused_total{{reason=\"{reason}\"}} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP valem_models_unrecovered Stored models that could not be recovered: kept in the store, not served (the log says why).\n# TYPE valem_models_unrecovered gauge\nvalem_models_unrecovered {}",
            st.service.checkpoint_metrics().unrecovered_count()
        );
    }
    let _ = writeln!(
        out,
        "# HELP valem_errors_total Failed requests and tool calls, by kind.\n# TYPE valem_errors_total counter"
    );
    if let Ok(m) = st.metrics.errors.lock() {
        for (k, v) in m.iter() {
            let _ = writeln!(out, "valem_errors_total{{kind=\"{k}\"}} {v}");
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

/// A Prometheus histogram from cumulative bucket counts over [`BUCKETS`] and their sum.
fn histogram(out: &mut String, name: &str, help: &str, (counts, sum): (Vec<u64>, f64)) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (i, c) in counts.iter().enumerate() {
        let le = BUCKETS
            .get(i)
            .map_or_else(|| "+Inf".to_string(), |b| format!("{b}"));
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {c}");
    }
    let total = counts.last().copied().unwrap_or(0);
    let _ = writeln!(out, "{name}_sum {sum}");
    let _ = writeln!(out, "{name}_count {total}");
}

/// The process's resident memory (Linux: `VmRSS` of /proc/self/status).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}
