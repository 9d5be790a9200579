//! Each plugin's own threads: a call runs on one of them and the caller waits at most the
//! timeout. A call that does not come back keeps its thread (a thread cannot be killed); the
//! pool grows to [`MAX_THREADS`] and, once that many calls are stuck, refuses further calls at
//! once instead of piling them up. Other plugins have their own pools and never notice.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Most threads (and so most calls at once) per plugin.
pub(super) const MAX_THREADS: usize = 8;

/// Why a plugin call failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PluginError {
    #[error("plugin `{plugin}` did not answer `{method}` within {secs:.1} s")]
    Timeout {
        plugin: String,
        method: String,
        secs: f64,
    },
    #[error("plugin `{plugin}` is not answering: {running} of its calls are still running; it gets no more calls until one returns")]
    Stuck { plugin: String, running: usize },
    #[error("plugin `{plugin}` panicked in `{method}`: {message}")]
    Panicked {
        plugin: String,
        method: String,
        message: String,
    },
    #[error("plugin `{plugin}` failed in `{method}` ({code}): {message}")]
    Failed {
        plugin: String,
        method: String,
        code: String,
        message: String,
    },
    #[error("plugin `{plugin}` gave a bad answer to `{method}`: {detail}")]
    BadAnswer {
        plugin: String,
        method: String,
        detail: String,
    },
}

impl PluginError {
    /// The plugin's own error code, for `Failed`.
    pub fn code(&self) -> Option<&str> {
        match self {
            PluginError::Failed { code, .. } => Some(code),
            _ => None,
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// How long a caller polls for its answer, and an idle worker for its next job, before sleeping.
const SPIN: Duration = Duration::from_micros(30);

/// The next job: polled for [`SPIN`] (calls often come in runs), then waited for.
fn next_job(rx: &Receiver<Job>) -> Result<Job, mpsc::RecvError> {
    let until = std::time::Instant::now() + SPIN;
    while std::time::Instant::now() < until {
        match rx.try_recv() {
            Ok(j) => return Ok(j),
            Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
            Err(mpsc::TryRecvError::Disconnected) => return Err(mpsc::RecvError),
        }
    }
    rx.recv()
}

pub(super) struct Pool {
    tx: Mutex<Sender<Job>>,
    rx: Arc<Mutex<Receiver<Job>>>,
    /// Calls handed to the pool and not finished (running or queued).
    running: Arc<AtomicUsize>,
    threads: AtomicUsize,
    timeout: Duration,
}

impl Pool {
    pub(super) fn new(timeout: Duration) -> Pool {
        let (tx, rx) = mpsc::channel::<Job>();
        Pool {
            tx: Mutex::new(tx),
            rx: Arc::new(Mutex::new(rx)),
            running: Arc::new(AtomicUsize::new(0)),
            threads: AtomicUsize::new(0),
            timeout,
        }
    }

    /// Run `f` on a pool thread; its result, or why there is none.
    pub(super) fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, PluginError> + Send + 'static,
        plugin: &str,
        method: &str,
    ) -> Result<T, PluginError> {
        let busy = self.running.fetch_add(1, Ordering::AcqRel);
        if busy >= MAX_THREADS {
            self.running.fetch_sub(1, Ordering::AcqRel);
            return Err(PluginError::Stuck {
                plugin: plugin.to_string(),
                running: busy,
            });
        }
        // One thread per call in flight, up to the cap: a queued call never waits behind a
        // stuck one.
        if self.threads.load(Ordering::Acquire) <= busy {
            self.spawn(plugin);
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let running = self.running.clone();
        let (p, m) = (plugin.to_string(), method.to_string());
        let job: Job = Box::new(move || {
            let r = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
                Err(PluginError::Panicked {
                    plugin: p,
                    method: m,
                    message: "the host's side of the call panicked".into(),
                })
            });
            running.fetch_sub(1, Ordering::AcqRel);
            let _ = tx.send(r);
        });
        let sent = self
            .tx
            .lock()
            .map(|tx| tx.send(job).is_ok())
            .unwrap_or(false);
        if !sent {
            self.running.fetch_sub(1, Ordering::AcqRel);
            return Err(PluginError::Stuck {
                plugin: plugin.to_string(),
                running: busy,
            });
        }
        // A quick plugin answers within a few µs: a short poll saves two thread wake-ups.
        let spin_until = std::time::Instant::now() + SPIN;
        while std::time::Instant::now() < spin_until {
            match rx.try_recv() {
                Ok(r) => return r,
                Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        }
        match rx.recv_timeout(self.timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                Err(PluginError::Timeout {
                    plugin: plugin.to_string(),
                    method: method.to_string(),
                    secs: self.timeout.as_secs_f64(),
                })
            }
        }
    }

    fn spawn(&self, plugin: &str) {
        let n = self.threads.fetch_add(1, Ordering::AcqRel);
        if n >= MAX_THREADS {
            self.threads.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        let rx = self.rx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("valem-plugin-{plugin}"))
            .spawn(move || loop {
                let job = match rx.lock() {
                    Ok(rx) => next_job(&rx),
                    Err(_) => return,
                };
                match job {
                    Ok(job) => job(),
                    Err(_) => return,
                }
            });
        if spawned.is_err() {
            self.threads.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Why [`once`] has no result.
#[derive(Debug)]
pub(super) enum OnceError {
    Timeout,
    Panicked(String),
}

/// Run `f` on a new thread and wait at most `timeout` (a plugin's initialisation).
pub(super) fn once<T: Send + 'static>(
    timeout: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, OnceError> {
    let (tx, rx) = mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("valem-plugin-load".into())
        .spawn(move || {
            let r =
                catch_unwind(AssertUnwindSafe(f)).map_err(|p| valem_sdk::shim::panic_message(&*p));
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return Err(OnceError::Panicked(format!("cannot start a thread: {e}")));
    }
    match rx.recv_timeout(timeout) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(m)) => Err(OnceError::Panicked(m)),
        Err(_) => Err(OnceError::Timeout),
    }
}
