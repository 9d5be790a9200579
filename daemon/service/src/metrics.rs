//! Lock-free counters read by `/metrics`: committed and rejected reactive cycles, a latency
//! histogram of committed ones (time on the shard, validation to commit), and the checkpoints
//! recovery or an `?at=` read refused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds (Prometheus `le`), 10 µs … 10 s.
pub const BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Default)]
pub struct CycleMetrics {
    pub committed: AtomicU64,
    pub rejected_schema: AtomicU64,
    pub rejected_constraint: AtomicU64,
    pub rejected_other: AtomicU64,
    /// Writes answered from their idempotency key (sent again, applied once).
    pub replayed: AtomicU64,
    latency: Histogram,
}

impl CycleMetrics {
    pub fn committed(&self, took: Duration) {
        self.committed.fetch_add(1, Ordering::Relaxed);
        self.latency.record(took);
    }

    /// Cumulative bucket counts (one per `BUCKETS` entry, then `+Inf`) and the sum in seconds.
    pub fn histogram(&self) -> (Vec<u64>, f64) {
        self.latency.cumulative()
    }
}

/// A latency histogram over [`BUCKETS`].
#[derive(Default)]
pub struct Histogram {
    /// Non-cumulative counts per bucket; the last slot is `+Inf`.
    buckets: [AtomicU64; 20],
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub fn record(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS.len());
        if let Some(b) = self.buckets.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        self.sum_nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Cumulative bucket counts (one per `BUCKETS` entry, then `+Inf`) and the sum in seconds.
    pub fn cumulative(&self) -> (Vec<u64>, f64) {
        let mut acc = 0;
        let counts = self
            .buckets
            .iter()
            .map(|b| {
                acc += b.load(Ordering::Relaxed);
                acc
            })
            .collect();
        (counts, self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// Checkpoints refused (recovery, `?at=` reads), by what did not match
/// ([`CheckpointFault::label`](valem_store::CheckpointFault::label)).
#[derive(Default)]
pub struct CheckpointMetrics {
    refused: [AtomicU64; valem_store::CheckpointFault::LABELS.len()],
    /// Stored models that could not be recovered (kept in the store, not served).
    unrecovered: AtomicU64,
}

impl CheckpointMetrics {
    /// A stored model could not be recovered (`true`), or one that could not now is (`false`).
    pub fn unrecovered(&self, now_unrecovered: bool) {
        if now_unrecovered {
            self.unrecovered.fetch_add(1, Ordering::Relaxed);
        } else {
            self.unrecovered.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Stored models not served because they could not be recovered.
    pub fn unrecovered_count(&self) -> u64 {
        self.unrecovered.load(Ordering::Relaxed)
    }

    /// One refused checkpoint.
    pub fn refused(&self, fault: &valem_store::CheckpointFault) {
        let labels = valem_store::CheckpointFault::LABELS;
        if let Some(i) = labels.iter().position(|l| *l == fault.label()) {
            self.refused[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `(reason, count)` for every reason, in a fixed order.
    pub fn refused_counts(&self) -> Vec<(&'static str, u64)> {
        valem_store::CheckpointFault::LABELS
            .iter()
            .zip(&self.refused)
            .map(|(l, c)| (*l, c.load(Ordering::Relaxed)))
            .collect()
    }
}

/// Models in memory and hibernated in the store (`--max-resident-models`), and what moving them
/// between the two costs.
#[derive(Default)]
pub struct ResidencyMetrics {
    /// Models in memory.
    pub resident: AtomicU64,
    /// Models kept in the store only, woken by their next request.
    pub hibernated: AtomicU64,
    /// Models evicted from memory.
    pub evicted: AtomicU64,
    /// Wakes that failed (the model is then unrecovered: the log says why).
    pub wake_failures: AtomicU64,
    /// How long each wake took: the stored spec, the checkpoint and the records after it.
    pub wakes: Histogram,
    /// Creations of a copy of a spec remembered from an earlier request body (which differed
    /// only in its leading `id`): not parsed, serialised or validated again.
    pub copies: AtomicU64,
}

impl ResidencyMetrics {
    /// A model entered (`true`) or left memory.
    pub(crate) fn resident(&self, entered: bool) {
        gauge(&self.resident, entered);
    }

    /// A model went to (`true`) or left the store-only set.
    pub(crate) fn hibernated(&self, entered: bool) {
        gauge(&self.hibernated, entered);
    }
}

fn gauge(g: &AtomicU64, up: bool) {
    if up {
        g.fetch_add(1, Ordering::Relaxed);
    } else {
        g.fetch_sub(1, Ordering::Relaxed);
    }
}
