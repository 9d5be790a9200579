//! Shard jobs and their answers: a job's one-shot reply (at once, or once its write is
//! durable), `Call` (an operation not yet queued: its caller's edge decides how to wait), and
//! `Pending`, which a thread waits for (a short spin, then park) or async code awaits.

use super::*;

pub(super) type Job = Box<dyn FnOnce(&mut Shard) + Send>;

/// A job that answers through its [`Reply`].
pub(super) type ReplyJob<R> = Box<dyn FnOnce(&mut Shard, Reply<R>) + Send>;

/// Where a shard job's answer goes: now, or once the store has made the job's write durable.
/// Its hook, if any, sees the answer first (on the thread that sends it), whether or not
/// anyone still waits for it; a reply dropped unsent (its job failed) answers
/// [`ServiceError::Unavailable`].
pub(crate) struct Reply<R> {
    tx: Option<oneshot::Sender<Result<R, ServiceError>>>,
    hook: Option<Hook<R>>,
}

/// What runs with a job's answer before it is sent: it must not block.
pub(crate) type Hook<R> = Box<dyn FnOnce(&Result<R, ServiceError>) + Send>;

impl<R> Reply<R> {
    pub(crate) fn new(tx: oneshot::Sender<Result<R, ServiceError>>) -> Reply<R> {
        Reply {
            tx: Some(tx),
            hook: None,
        }
    }

    /// This reply, with `hook` run on its answer.
    pub(crate) fn hooked(mut self, hook: Hook<R>) -> Reply<R> {
        self.hook = Some(hook);
        self
    }

    pub(crate) fn send(mut self, r: Result<R, ServiceError>) {
        self.answer(r);
    }

    fn answer(&mut self, r: Result<R, ServiceError>) {
        if let Some(hook) = self.hook.take() {
            hook(&r);
        }
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(r);
        }
    }
}

impl<R> Drop for Reply<R> {
    fn drop(&mut self) {
        if self.tx.is_some() {
            self.answer(Err(ServiceError::Unavailable));
        }
    }
}

impl<R: Send + 'static> Reply<R> {
    /// Answer `ok` once `op` is committed (fsynced in strict mode), or the store's error; `then`
    /// runs first with whether it committed (on the writer thread: it must not block).
    pub(crate) fn after(
        self,
        writer: &valem_store::Writer,
        op: valem_store::Op,
        ok: R,
        then: impl FnOnce(bool) + Send + 'static,
    ) {
        writer.submit(
            op,
            Box::new(move |res| {
                then(res.is_ok());
                self.send(
                    res.map(|()| ok)
                        .map_err(|e| ServiceError::Storage(e.to_string())),
                );
            }),
        );
    }
}

/// A shard's queue, how many of its jobs are queued or running, and whether polling for its
/// answers has been paying off.
pub(super) struct ShardHandle {
    pub(super) tx: SyncSender<Job>,
    pub(super) depth: Arc<std::sync::atomic::AtomicUsize>,
    pub(super) poll: Arc<PollCredit>,
}

/// Adaptive polling for async callers. A poll that catches the answer saves a reactor thread's
/// park and wake-up; one that misses burns a core for nothing, which on a loaded small machine
/// starves the very threads that would produce the answer. So a shard whose answers were caught
/// keeps being polled, and one whose polls missed stops (halving per miss) except for one
/// probe in 32 calls.
#[derive(Default)]
pub(super) struct PollCredit {
    pub(super) credit: std::sync::atomic::AtomicU32,
    pub(super) calls: std::sync::atomic::AtomicU32,
}

impl PollCredit {
    const FULL: u32 = 8;

    pub(super) fn wanted(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.credit.load(Relaxed) > 0 || self.calls.fetch_add(1, Relaxed).is_multiple_of(32)
    }

    pub(super) fn record(&self, caught: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let next = if caught {
            Self::FULL
        } else {
            self.credit.load(Relaxed) / 2
        };
        self.credit.store(next, Relaxed);
    }
}

/// Jobs queued per shard before callers wait (back-pressure, not an error).
pub(super) const SHARD_QUEUE: usize = 1024;

/// How long a thread polls for its shard's answer, and a shard for its next job, before
/// parking. A park/unpark pair costs tens of µs on a busy or virtualised host, more than a
/// small cycle; a short poll keeps a conversation of calls (an agent's session over stdio, a
/// lone HTTP client) off the scheduler. Async callers poll only when their job was alone on the
/// shard and polling has been catching answers ([`PollCredit`]).
pub(super) const REPLY_SPIN: std::time::Duration = std::time::Duration::from_micros(50);
pub(super) const SHARD_SPIN: std::time::Duration = std::time::Duration::from_micros(20);

/// Poll `ready` for up to `spin` (reading the clock only every 64 polls: on a virtualised host
/// a clock read is not free), then give up.
pub(super) fn spin_until<T>(
    spin: std::time::Duration,
    mut ready: impl FnMut() -> Poll<Option<T>>,
) -> Poll<Option<T>> {
    let start = std::time::Instant::now();
    let mut n = 0u32;
    loop {
        if let Poll::Ready(v) = ready() {
            return Poll::Ready(v);
        }
        n = n.wrapping_add(1);
        if n.is_multiple_of(64) && start.elapsed() >= spin {
            return Poll::Pending;
        }
        std::hint::spin_loop();
    }
}

pub(super) fn next_job(rx: &Receiver<Job>) -> Option<Job> {
    let polled = spin_until(SHARD_SPIN, || match rx.try_recv() {
        Ok(j) => Poll::Ready(Some(j)),
        Err(mpsc::TryRecvError::Disconnected) => Poll::Ready(None),
        Err(mpsc::TryRecvError::Empty) => Poll::Pending,
    });
    match polled {
        Poll::Ready(j) => j,
        Poll::Pending => rx.recv().ok(),
    }
}

/// A shard's answer on its way. A thread [`wait`](Pending::wait)s for it; async code awaits it
/// (it is a `Future`), so a reactor thread is never blocked on a shard. When the job was alone
/// on its shard, the first poll may poll for up to [`REPLY_SPIN`] before yielding (see
/// [`PollCredit`]): the answer is one cycle away, and a reactor thread's park and wake-up cost
/// more than that on a virtualised host. Behind other jobs the answer is far off.
pub struct Pending<R> {
    pub(super) rx: Result<oneshot::Receiver<R>, ServiceError>,
    pub(super) poll_first: Option<Arc<PollCredit>>,
}

pub(super) fn try_answer<R>(rx: &mut oneshot::Receiver<R>) -> Poll<Option<R>> {
    match rx.try_recv() {
        Ok(v) => Poll::Ready(Some(v)),
        Err(oneshot::error::TryRecvError::Closed) => Poll::Ready(None),
        Err(oneshot::error::TryRecvError::Empty) => Poll::Pending,
    }
}

impl<R> Pending<R> {
    pub(super) fn failed(e: ServiceError) -> Pending<R> {
        Pending {
            rx: Err(e),
            poll_first: None,
        }
    }

    /// [`wait`](Self::wait) without the poll first: for an answer that is far off (one
    /// that waits for the store's fsync), where polling would only take a core from the
    /// threads producing it.
    pub fn wait_long(self) -> Result<R, ServiceError> {
        self.rx?
            .blocking_recv()
            .map_err(|_| ServiceError::Unavailable)
    }

    /// Block the calling thread (never a reactor thread) until the shard answers.
    pub fn wait(self) -> Result<R, ServiceError> {
        let mut rx = self.rx?;
        match spin_until(REPLY_SPIN, || try_answer(&mut rx)) {
            Poll::Ready(v) => v.ok_or(ServiceError::Unavailable),
            Poll::Pending => rx.blocking_recv().map_err(|_| ServiceError::Unavailable),
        }
    }
}

impl<R> std::future::Future for Pending<R> {
    type Output = Result<R, ServiceError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Self::Output> {
        let first = std::mem::take(&mut self.poll_first);
        match &mut self.rx {
            Err(e) => Poll::Ready(Err(std::mem::replace(e, ServiceError::Unavailable))),
            Ok(rx) => {
                if let Some(credit) = first {
                    let polled = spin_until(REPLY_SPIN, || try_answer(rx));
                    credit.record(polled.is_ready());
                    if let Poll::Ready(v) = polled {
                        return Poll::Ready(v.ok_or(ServiceError::Unavailable));
                    }
                }
                std::pin::Pin::new(rx)
                    .poll(cx)
                    .map(|r| r.map_err(|_| ServiceError::Unavailable))
            }
        }
    }
}

/// One service operation on a model, not yet queued. A thread calls [`wait`](Call::wait): the
/// job is queued with back-pressure (a full shard queue makes it wait) and the thread blocks
/// until the answer. Async code `.await`s it: the job is queued at once or refused with
/// [`ServiceError::Busy`] on a full queue, and the task waits without blocking its thread.
/// Either way the same job runs: one path per operation, the caller's edge choosing how to
/// block.
#[must_use = "a Call does nothing until it is awaited or waited for"]
pub struct Call<'a, R> {
    pub(super) service: &'a ModelService,
    pub(super) shard: usize,
    pub(super) job: ReplyJob<R>,
}

impl<R: Send + 'static> Call<'_, R> {
    /// Queue the job (waiting for room) and block the calling thread (never a reactor
    /// thread) until the shard answers.
    pub fn wait(self) -> Result<R, ServiceError> {
        let job = self.job;
        self.service
            .submit_with(self.shard, true, move |s, tx| job(s, Reply::new(tx)))
            .wait()?
    }
}

impl<R: Send + 'static> Call<'_, R> {
    /// Queue the job now, without waiting for room (refused with `Busy` on a full queue); its
    /// answer is the future. What `.await` does; for a future that must outlive the borrow of
    /// the service (a boxed, spawned one).
    pub fn queue(self) -> Answer<R> {
        let job = self.job;
        Answer(
            self.service
                .submit_with(self.shard, false, move |s, tx| job(s, Reply::new(tx))),
        )
    }
}

impl<R: Send + 'static> std::future::IntoFuture for Call<'_, R> {
    type Output = Result<R, ServiceError>;
    type IntoFuture = Answer<R>;

    fn into_future(self) -> Answer<R> {
        self.queue()
    }
}

/// A queued [`Call`]'s answer, as a future (`'static`: it holds no borrow of the service).
pub struct Answer<R>(pub(super) Pending<Result<R, ServiceError>>);

impl<R> std::future::Future for Answer<R> {
    type Output = Result<R, ServiceError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|r| r?)
    }
}
