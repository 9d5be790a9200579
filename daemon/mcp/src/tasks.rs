//! The tasks extension (`io.modelcontextprotocol/tasks`, MCP 2026-07-28): a long call answered
//! with a task handle (`resultType: "task"`) instead of its result, then polled with
//! `tasks/get`, fed input with `tasks/update`, stopped with `tasks/cancel`. Only a request that
//! declared the extension in its capabilities gets a task. A task is visible only to the
//! caller scope that created it (a sandbox session sees its own). With a [`TaskLog`] (the
//! daemon's store) a task is written before its handle is answered and again when it ends; a
//! task that was still running when the daemon stopped reads as failed after a restart.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value as Json};

use super::code;
use super::modern::{codes, key};
use valem_service::time::{iso_millis, now};

/// How long a task is kept after it is created.
pub const TTL: Duration = Duration::from_secs(30 * 60);
/// The polling interval a task suggests.
pub const POLL_MS: u64 = 500;
/// Most tasks kept at once (finished ones are dropped oldest first past it).
pub const MAX_TASKS: usize = 10_000;
/// Most tasks running at once.
pub const MAX_RUNNING: usize = 64;

/// A task's status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Working,
    InputRequired,
    Completed,
    Failed,
    Cancelled,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Working => "working",
            Status::InputRequired => "input_required",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }

    fn parse(s: &str) -> Option<Status> {
        Some(match s {
            "working" => Status::Working,
            "input_required" => Status::InputRequired,
            "completed" => Status::Completed,
            "failed" => Status::Failed,
            "cancelled" => Status::Cancelled,
            _ => return None,
        })
    }

    pub fn terminal(self) -> bool {
        matches!(self, Status::Completed | Status::Failed | Status::Cancelled)
    }
}

struct State {
    status: Status,
    updated: String,
    message: Option<String>,
    /// Outstanding input requests, by key.
    asked: Map<String, Json>,
    /// Answers received for outstanding keys, not yet taken by the work.
    answers: Map<String, Json>,
    result: Option<Json>,
    error: Option<Json>,
}

/// One task.
pub struct Task {
    pub id: String,
    /// The caller scope that owns it (`""`: the operator).
    owner: String,
    created: String,
    expires: Instant,
    state: Mutex<State>,
    changed: Condvar,
    cancelled: AtomicBool,
}

impl Task {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn status(&self) -> Status {
        self.lock().status
    }

    /// The task as `tasks/get` (and a status notification) shows it.
    pub fn detail(&self) -> Json {
        let s = self.lock();
        let mut t = self.handle_fields(&s);
        match s.status {
            Status::InputRequired => t["inputRequests"] = Json::Object(s.asked.clone()),
            Status::Completed => {
                if let Some(r) = &s.result {
                    t["result"] = r.clone();
                }
            }
            Status::Failed => {
                if let Some(e) = &s.error {
                    t["error"] = e.clone();
                }
            }
            _ => {}
        }
        t
    }

    fn handle_fields(&self, s: &State) -> Json {
        let mut t = json!({
            "taskId": self.id,
            "status": s.status.as_str(),
            "createdAt": self.created,
            "lastUpdatedAt": s.updated,
            "ttlMs": TTL.as_millis() as u64,
            "pollIntervalMs": POLL_MS,
        });
        if let Some(m) = &s.message {
            t["statusMessage"] = json!(m);
        }
        t
    }

    /// The `CreateTaskResult` of this task.
    pub fn created_result(&self) -> Json {
        let s = self.lock();
        let mut t = self.handle_fields(&s);
        t["resultType"] = json!("task");
        t
    }

    fn record(&self) -> Json {
        let mut d = self.detail();
        d["owner"] = json!(self.owner);
        d
    }
}

/// Where tasks are kept durably (the daemon's store).
pub trait TaskLog: Send + Sync {
    /// Write a task's current record (insert or replace); durable when it returns.
    fn put(&self, id: &str, record: &Json) -> Result<(), String>;
    /// Every task record kept.
    fn load(&self) -> Result<Vec<Json>, String>;
    /// Forget a task.
    fn remove(&self, id: &str);
}

/// The service's store as a [`TaskLog`].
pub struct ServiceLog(pub Arc<valem_service::ModelService>);

impl TaskLog for ServiceLog {
    fn put(&self, id: &str, record: &Json) -> Result<(), String> {
        self.0.put_task(id, record)
    }
    fn load(&self) -> Result<Vec<Json>, String> {
        self.0.stored_tasks()
    }
    fn remove(&self, id: &str) {
        self.0.delete_task(id);
    }
}

/// A status change listener: gets each changed task's detail; returns false once gone.
type Watcher = Box<dyn Fn(&str, &Json) -> bool + Send>;

/// The tasks of a server.
#[derive(Default)]
pub struct Tasks {
    map: Mutex<HashMap<String, Arc<Task>>>,
    log: Mutex<Option<Arc<dyn TaskLog>>>,
    watchers: Mutex<Vec<(String, Vec<String>, Watcher)>>,
    running: std::sync::atomic::AtomicUsize,
}

/// Why a task could not be created.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CreateError {
    #[error("too many tasks are running ({MAX_RUNNING}); wait for one to finish or cancel one")]
    Busy,
    #[error("the task could not be stored durably: {0}")]
    Log(String),
    #[error("no randomness available for a task id")]
    NoRandomness,
}

/// What the work of a task holds: it reports, asks and learns of cancellation through it.
pub struct Running {
    task: Arc<Task>,
    tasks: Weak<Tasks>,
}

impl Running {
    pub fn id(&self) -> &str {
        &self.task.id
    }

    /// Was the task cancelled? Work that can stop early checks it.
    pub fn cancelled(&self) -> bool {
        self.task.cancelled.load(Ordering::SeqCst)
    }

    /// Ask the client: the task turns `input_required` with these requests until every key is
    /// answered through `tasks/update` (the answers, by key), or it is cancelled (`None`).
    pub fn ask(&self, requests: Map<String, Json>) -> Option<Map<String, Json>> {
        let keys: Vec<String> = requests.keys().cloned().collect();
        {
            let mut s = self.task.lock();
            if s.status.terminal() {
                return None;
            }
            s.asked = requests;
            s.answers.clear();
            s.status = Status::InputRequired;
            s.updated = iso_millis(now());
        }
        self.changed();
        let mut s = self.task.lock();
        loop {
            if self.cancelled() || s.status.terminal() {
                return None;
            }
            if s.asked.is_empty() && keys.iter().all(|k| s.answers.contains_key(k)) {
                let answers = std::mem::take(&mut s.answers);
                s.status = Status::Working;
                s.updated = iso_millis(now());
                drop(s);
                self.changed();
                return Some(answers);
            }
            let (g, _) = self
                .task
                .changed
                .wait_timeout(s, Duration::from_millis(200))
                .unwrap_or_else(|p| p.into_inner());
            s = g;
        }
    }

    /// A progress message for the client (`statusMessage`).
    pub fn say(&self, message: &str) {
        self.task.lock().message = Some(message.to_string());
        self.changed();
    }

    fn changed(&self) {
        if let Some(t) = self.tasks.upgrade() {
            t.notify(&self.task);
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(t) = self.tasks.upgrade() {
            t.running.fetch_sub(1, Ordering::SeqCst);
            // Work that ended without an outcome (it panicked) fails the task.
            if !self.task.status().terminal() {
                t.end(
                    &self.task,
                    Err(json!({"code": code::INTERNAL_ERROR, "message": "the task's work stopped without a result"})),
                );
            }
        }
    }
}

/// A task error (`error` of a failed task) from a JSON-RPC error code and message.
pub fn task_error(code: i64, message: impl Into<String>) -> Json {
    json!({"code": code, "message": message.into()})
}

/// `MissingRequiredClientCapabilityError` naming the tasks extension.
pub fn missing_extension(id: Json) -> Json {
    json!({"jsonrpc": "2.0", "id": id, "error": {
        "code": codes::MISSING_REQUIRED_CLIENT_CAPABILITY,
        "message": format!("Missing required client capability: declare the {} extension in \
            _meta[\"{}\"].extensions to use tasks", key::TASKS, key::CLIENT_CAPABILITIES),
        "data": {"requiredCapabilities": {"extensions": {key::TASKS: {}}}},
    }})
}

fn new_id() -> Option<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).ok()?;
    Some(b.iter().map(|x| format!("{x:02x}")).collect())
}

impl Tasks {
    pub fn new() -> Arc<Tasks> {
        Arc::new(Tasks::default())
    }

    /// Keep tasks in `log` from now on; the tasks it holds are loaded, and those that were
    /// still running are failed (their work died with the previous process) and written back.
    pub fn persist(&self, log: Arc<dyn TaskLog>) -> Result<usize, String> {
        let records = log.load()?;
        let mut n = 0;
        for mut r in records {
            let Some(id) = r.get("taskId").and_then(Json::as_str).map(str::to_string) else {
                continue;
            };
            let status = r
                .get("status")
                .and_then(Json::as_str)
                .and_then(Status::parse)
                .unwrap_or(Status::Failed);
            // A task past its time to live is forgotten rather than loaded.
            let age_ms = r
                .get("createdAt")
                .and_then(Json::as_str)
                .and_then(|c| valem_service::time::parse_iso(c).ok())
                .map(|c| now().ms().saturating_sub(c.ms()));
            if age_ms.is_some_and(|a| u128::from(a.unsigned_abs()) > TTL.as_millis()) {
                log.remove(&id);
                continue;
            }
            let (status, error) = if status.terminal() {
                (status, r.get("error").cloned())
            } else {
                (
                    Status::Failed,
                    Some(task_error(
                        code::INTERNAL_ERROR,
                        "the daemon stopped while the task ran; run the request again",
                    )),
                )
            };
            let text = |k: &str| r.get(k).and_then(Json::as_str).unwrap_or("").to_string();
            let task = Arc::new(Task {
                id: id.clone(),
                owner: text("owner"),
                created: text("createdAt"),
                expires: Instant::now() + TTL,
                state: Mutex::new(State {
                    status,
                    updated: if status.terminal()
                        && r.get("status") == Some(&json!(status.as_str()))
                    {
                        text("lastUpdatedAt")
                    } else {
                        iso_millis(now())
                    },
                    message: r
                        .get("statusMessage")
                        .and_then(Json::as_str)
                        .map(str::to_string),
                    asked: Map::new(),
                    answers: Map::new(),
                    result: r.get_mut("result").map(Json::take),
                    error,
                }),
                changed: Condvar::new(),
                cancelled: AtomicBool::new(false),
            });
            let _ = log.put(&id, &task.record());
            if let Ok(mut m) = self.map.lock() {
                m.insert(id, task);
            }
            n += 1;
        }
        if let Ok(mut l) = self.log.lock() {
            *l = Some(log);
        }
        Ok(n)
    }

    fn log(&self) -> Option<Arc<dyn TaskLog>> {
        self.log.lock().ok().and_then(|l| l.clone())
    }

    /// Create a task for `owner` and start `work` on its own thread; the task is stored (and
    /// written to the log) before this returns, so its handle can be answered.
    pub fn spawn(
        self: &Arc<Self>,
        owner: &str,
        work: impl FnOnce(&Running) -> Result<Json, Json> + Send + 'static,
    ) -> Result<Arc<Task>, CreateError> {
        if self
            .running
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_RUNNING).then_some(n + 1)
            })
            .is_err()
        {
            return Err(CreateError::Busy);
        }
        let release = || {
            self.running.fetch_sub(1, Ordering::SeqCst);
        };
        let Some(id) = new_id() else {
            release();
            return Err(CreateError::NoRandomness);
        };
        let at = iso_millis(now());
        let task = Arc::new(Task {
            id: id.clone(),
            owner: owner.to_string(),
            created: at.clone(),
            expires: Instant::now() + TTL,
            state: Mutex::new(State {
                status: Status::Working,
                updated: at,
                message: None,
                asked: Map::new(),
                answers: Map::new(),
                result: None,
                error: None,
            }),
            changed: Condvar::new(),
            cancelled: AtomicBool::new(false),
        });
        if let Some(log) = self.log() {
            if let Err(e) = log.put(&id, &task.record()) {
                release();
                return Err(CreateError::Log(e));
            }
        }
        self.insert(task.clone());
        let running = Running {
            task: task.clone(),
            tasks: Arc::downgrade(self),
        };
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("valem-task".into())
            .spawn(move || {
                let outcome =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&running)))
                        .unwrap_or_else(|_| {
                            Err(task_error(code::INTERNAL_ERROR, "the task's work panicked"))
                        });
                if let Some(t) = me.upgrade() {
                    t.end(&running.task, outcome);
                }
            });
        if spawned.is_err() {
            self.end(
                &task,
                Err(task_error(
                    code::INTERNAL_ERROR,
                    "could not start the task's thread",
                )),
            );
        }
        Ok(task)
    }

    fn insert(&self, task: Arc<Task>) {
        let Ok(mut m) = self.map.lock() else {
            return;
        };
        let now = Instant::now();
        let log = self.log();
        m.retain(|id, t| {
            let keep = t.expires > now || !t.status().terminal();
            if !keep {
                // Expired: forgotten by the store too.
                if let Some(l) = &log {
                    l.remove(id);
                }
            }
            keep
        });
        if m.len() >= MAX_TASKS {
            // Drop the finished task that expires first.
            if let Some(k) = m
                .iter()
                .filter(|(_, t)| t.status().terminal())
                .min_by_key(|(_, t)| t.expires)
                .map(|(k, _)| k.clone())
            {
                m.remove(&k);
                if let Some(log) = self.log() {
                    log.remove(&k);
                }
            }
        }
        m.insert(task.id.clone(), task);
    }

    /// The task `id` if `owner` may see it.
    pub fn get(&self, owner: &str, id: &str) -> Option<Arc<Task>> {
        let t = self.map.lock().ok()?.get(id).cloned()?;
        (t.owner == owner && (t.expires > Instant::now() || !t.status().terminal())).then_some(t)
    }

    /// End a task with its work's outcome (unless it already ended: a cancelled task stays so).
    fn end(&self, task: &Arc<Task>, outcome: Result<Json, Json>) {
        {
            let mut s = task.lock();
            if s.status.terminal() {
                return;
            }
            match outcome {
                Ok(r) => {
                    s.status = Status::Completed;
                    s.result = Some(r);
                }
                Err(e) => {
                    s.status = Status::Failed;
                    s.error = Some(e);
                }
            }
            s.asked.clear();
            s.updated = iso_millis(now());
        }
        self.settled(task);
    }

    fn settled(&self, task: &Arc<Task>) {
        task.changed.notify_all();
        if let Some(log) = self.log() {
            if let Err(e) = log.put(&task.id, &task.record()) {
                tracing::error!(task = %task.id, "task not stored: {e}");
            }
        }
        self.notify(task);
    }

    /// `tasks/update`: the answers for keys the task is waiting on are taken (others are
    /// ignored) before this returns.
    pub fn update(&self, task: &Arc<Task>, responses: &Map<String, Json>) {
        {
            let mut s = task.lock();
            if s.status != Status::InputRequired {
                return;
            }
            for (k, v) in responses {
                if s.asked.remove(k).is_some() {
                    s.answers.insert(k.clone(), v.clone());
                }
            }
            if !s.asked.is_empty() {
                s.updated = iso_millis(now());
            }
        }
        task.changed.notify_all();
        self.notify(task);
    }

    /// `tasks/cancel`: a task not yet ended is cancelled at once (its work is told, and what it
    /// still produces is dropped); an ended one stays as it is.
    pub fn cancel(&self, task: &Arc<Task>) {
        task.cancelled.store(true, Ordering::SeqCst);
        {
            let mut s = task.lock();
            if s.status.terminal() {
                return;
            }
            s.status = Status::Cancelled;
            s.asked.clear();
            s.updated = iso_millis(now());
        }
        self.settled(task);
    }

    /// Send each watcher of this task its detail.
    fn notify(&self, task: &Arc<Task>) {
        let Ok(mut w) = self.watchers.lock() else {
            return;
        };
        if w.is_empty() {
            return;
        }
        let detail = task.detail();
        w.retain(|(owner, ids, sink)| {
            if *owner != task.owner || !ids.iter().any(|i| *i == task.id) {
                return true;
            }
            sink(&task.id, &detail)
        });
    }

    /// Watch these tasks of `owner`: `sink` gets each status change until it returns false.
    pub fn watch(&self, owner: &str, ids: Vec<String>, sink: Watcher) {
        let Ok(mut w) = self.watchers.lock() else {
            return;
        };
        // Watchers of tasks that all ended (or are gone) have nothing more to hear.
        let live = |ids: &[String]| {
            ids.iter().any(|i| {
                self.map
                    .lock()
                    .ok()
                    .and_then(|m| m.get(i).cloned())
                    .is_some_and(|t| !t.status().terminal())
            })
        };
        w.retain(|(_, ids, _)| live(ids));
        w.push((owner.to_string(), ids, sink));
    }

    /// Tasks running now (for metrics).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Tasks kept (for metrics).
    pub fn len(&self) -> usize {
        self.map.lock().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `notifications/tasks` for a watcher on subscription `sub`.
pub fn notification(sub: &Json, detail: &Json) -> Json {
    let mut params = detail.clone();
    params["_meta"] = json!({key::SUBSCRIPTION_ID: sub});
    json!({"jsonrpc": "2.0", "method": "notifications/tasks", "params": params})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_for(t: &Task, s: Status) {
        let end = Instant::now() + Duration::from_secs(10);
        while t.status() != s {
            assert!(Instant::now() < end, "stuck at {:?}", t.status());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_task_runs_asks_and_completes() {
        let tasks = Tasks::new();
        let t = tasks
            .spawn("", |r| {
                let mut ask = Map::new();
                ask.insert("a".into(), json!({"method": "elicitation/create"}));
                ask.insert("b".into(), json!({"method": "elicitation/create"}));
                let answers = r.ask(ask).ok_or_else(|| json!({"code": 1}))?;
                Ok(json!({"content": [{"type": "text", "text": answers["a"].to_string()}]}))
            })
            .unwrap();
        let h = t.created_result();
        assert_eq!(h["resultType"], "task");
        for absent in ["result", "error", "inputRequests", "requestState"] {
            assert!(h.get(absent).is_none());
        }
        wait_for(&t, Status::InputRequired);
        let d = t.detail();
        assert_eq!(d["inputRequests"].as_object().unwrap().len(), 2);
        let mut one = Map::new();
        one.insert("a".into(), json!("A"));
        one.insert("zzz".into(), json!("ignored"));
        tasks.update(&t, &one);
        // The answered key is gone at once; the task still waits for the other.
        let d = t.detail();
        assert_eq!(d["status"], "input_required");
        assert_eq!(
            d["inputRequests"]
                .as_object()
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            ["b"]
        );
        let mut two = Map::new();
        two.insert("b".into(), json!("B"));
        tasks.update(&t, &two);
        wait_for(&t, Status::Completed);
        assert_eq!(t.detail()["result"]["content"][0]["text"], "\"A\"");
        // Owners see only their own tasks.
        assert!(tasks.get("", &t.id).is_some());
        assert!(tasks.get("sandbox-1", &t.id).is_none());
    }

    #[test]
    fn cancel_ends_a_task_at_once_and_stays() {
        let tasks = Tasks::new();
        let t = tasks
            .spawn("", |r| {
                while !r.cancelled() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(json!({"late": true}))
            })
            .unwrap();
        tasks.cancel(&t);
        assert_eq!(t.status(), Status::Cancelled);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(t.status(), Status::Cancelled);
        assert!(t.detail().get("result").is_none());
        tasks.cancel(&t);
        assert_eq!(t.status(), Status::Cancelled);
    }

    #[test]
    fn failures_and_panics_fail_the_task() {
        let tasks = Tasks::new();
        let t = tasks
            .spawn("", |_| Err(task_error(-32603, "boom")))
            .unwrap();
        wait_for(&t, Status::Failed);
        assert_eq!(t.detail()["error"]["message"], "boom");
        assert!(t.detail().get("result").is_none());
        let p = tasks.spawn("", |_| panic!("in the work")).unwrap();
        wait_for(&p, Status::Failed);
        assert!(p.detail()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("panicked"));
    }

    struct Mem(Mutex<HashMap<String, Json>>);
    impl TaskLog for Mem {
        fn put(&self, id: &str, r: &Json) -> Result<(), String> {
            self.0.lock().unwrap().insert(id.into(), r.clone());
            Ok(())
        }
        fn load(&self) -> Result<Vec<Json>, String> {
            Ok(self.0.lock().unwrap().values().cloned().collect())
        }
        fn remove(&self, id: &str) {
            self.0.lock().unwrap().remove(id);
        }
    }

    #[test]
    fn a_logged_task_that_was_running_reads_failed_after_a_restart() {
        let log = Arc::new(Mem(Mutex::default()));
        let before = Tasks::new();
        before.persist(log.clone()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = before
            .spawn("", move |_| {
                let _ = rx.recv_timeout(Duration::from_secs(5));
                Ok(json!({}))
            })
            .unwrap();
        let id = t.id.clone();
        // The record was written before spawn returned.
        assert_eq!(log.0.lock().unwrap()[&id]["status"], "working");
        let after = Tasks::new();
        assert_eq!(after.persist(log.clone()).unwrap(), 1);
        let again = after.get("", &id).unwrap();
        assert_eq!(again.status(), Status::Failed);
        assert!(again.detail()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("stopped"));
        assert_eq!(log.0.lock().unwrap()[&id]["status"], "failed");
        drop(tx);
        // A record past its time to live is dropped, not loaded.
        log.0.lock().unwrap().insert(
            "old".into(),
            json!({"taskId": "old", "status": "completed", "owner": "",
                "createdAt": "2020-01-01T00:00:00.000Z", "lastUpdatedAt": "2020-01-01T00:00:01.000Z"}),
        );
        let later = Tasks::new();
        assert_eq!(later.persist(log.clone()).unwrap(), 1);
        assert!(later.get("", "old").is_none());
        assert!(!log.0.lock().unwrap().contains_key("old"));
    }
}
