//! The audit-store plugin's feed: every committed audit record, in commit order, handed to the
//! plugin by one thread (so a slow or failing plugin never holds a shard). A failed append is
//! retried with backoff, then logged and counted. Queries served by the plugin first wait until
//! everything sent before them was handed over, so a reader sees its own writes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde_json::json;

use crate::plugins::Plugin;

/// Attempts per record before it is given up (logged, counted).
const ATTEMPTS: u32 = 4;

enum Msg {
    Append(valem_sdk::AuditEntry),
    Delete(String),
}

#[derive(Default)]
struct Progress {
    sent: AtomicU64,
    done: Mutex<u64>,
    cv: Condvar,
    failed: AtomicU64,
}

/// A cheap handle to the feed.
#[derive(Clone)]
pub(crate) struct AuditSink {
    tx: Sender<Msg>,
    progress: Arc<Progress>,
    pub plugin: Arc<Plugin>,
}

impl AuditSink {
    /// Start the feed thread for `plugin`.
    pub(crate) fn start(plugin: Arc<Plugin>) -> AuditSink {
        let (tx, rx) = mpsc::channel::<Msg>();
        let progress = Arc::new(Progress::default());
        let (p, prog) = (plugin.clone(), progress.clone());
        let spawned = std::thread::Builder::new()
            .name("valem-audit-sink".into())
            .spawn(move || {
                for m in rx {
                    let (method, params, what) = match m {
                        Msg::Append(e) => {
                            let what = format!("record {} of `{}`", e.sequence, e.model_id);
                            ("audit.append", serde_json::to_value(e).unwrap_or_default(), what)
                        }
                        Msg::Delete(id) => {
                            let what = format!("the deletion of `{id}`");
                            ("audit.delete", json!({"modelId": id}), what)
                        }
                    };
                    let mut wait = Duration::from_millis(50);
                    for attempt in 1..=ATTEMPTS {
                        match p.call(method, &params) {
                            Ok(_) => break,
                            Err(e) if attempt == ATTEMPTS => {
                                prog.failed.fetch_add(1, Ordering::Relaxed);
                                tracing::error!(plugin = %p.name, "audit store lost {what}: {e}");
                            }
                            Err(e) => {
                                tracing::warn!(plugin = %p.name, "audit store: {what}, attempt {attempt}: {e}");
                                std::thread::sleep(wait);
                                wait *= 4;
                            }
                        }
                    }
                    if let Ok(mut d) = prog.done.lock() {
                        *d += 1;
                        prog.cv.notify_all();
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!("audit store feed not started: {e}");
        }
        AuditSink {
            tx,
            progress,
            plugin,
        }
    }

    fn send(&self, m: Msg) {
        self.progress.sent.fetch_add(1, Ordering::AcqRel);
        if self.tx.send(m).is_err() {
            // The thread is gone: count it as handled so readers do not wait for it.
            if let Ok(mut d) = self.progress.done.lock() {
                *d += 1;
            }
            self.progress.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A committed record.
    pub(crate) fn append(&self, e: valem_sdk::AuditEntry) {
        self.send(Msg::Append(e));
    }

    /// A deleted model.
    pub(crate) fn delete(&self, model_id: &str) {
        self.send(Msg::Delete(model_id.to_string()));
    }

    /// Wait (at most `limit`) until everything sent so far was handed to the plugin.
    pub(crate) fn settle(&self, limit: Duration) {
        let target = self.progress.sent.load(Ordering::Acquire);
        let Ok(d) = self.progress.done.lock() else {
            return;
        };
        let _ = self
            .progress
            .cv
            .wait_timeout_while(d, limit, |d| *d < target);
    }
}
