//! The MCP server core: JSON-RPC 2.0 and the MCP protocol (handshake, version negotiation,
//! tools, resources, subscriptions, logging, cancellation) over any transport. Transport-free:
//! a transport hands each parsed message to [`Session::handle`] and writes what comes back;
//! notifications the session emits on its own go through the transport's [`Outbox`]. Tools
//! call only the [`ModelService`](valem_service::ModelService) and the authoring functions.

// What is not part of the crate's API is pub(crate): the compiler keeps it so.
#![warn(unreachable_pub)]

#[cfg(feature = "fixtures")]
pub mod fixtures;
#[cfg(feature = "fixtures")]
mod fixtures2026;
pub mod guidance;
pub mod listen;
pub mod modern;
pub mod mrtr;
pub mod ops;
pub mod pairing;
pub mod proxy;
pub mod resources;
mod session_modern;
use session_modern::modern_response;
#[cfg(feature = "fixtures")]
use session_modern::with_id;
pub mod stdio;
pub mod tasks;
pub mod tools;
pub mod wire;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};

use serde_json::{json, Map, Value as Json};

use guidance::Catalog;
use valem_service::plugins::Plugins;
use valem_service::{Event, EventFilter, ModelService};

/// Revisions we speak, oldest first; the last is the default.
pub const PROTOCOL_VERSIONS: &[&str] = &["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];

/// JSON-RPC error codes.
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const INTERNAL_ERROR: i64 = -32603;
    /// MCP: resource not found.
    pub const RESOURCE_NOT_FOUND: i64 = -32002;
}

/// What a transport drives: a session, or the stdio proxy in front of a daemon.
pub trait Handler: Send + Sync {
    /// Act at once on messages that must not wait behind a running request; true when consumed.
    fn intercept(&self, msg: &Json) -> bool;
    /// Handle one message or a batch; the reply to send, if any.
    fn handle(&self, msg: Json) -> Option<Json>;
}

impl Handler for Session {
    fn intercept(&self, msg: &Json) -> bool {
        Session::intercept(self, msg)
    }
    fn handle(&self, msg: Json) -> Option<Json> {
        Session::handle(self, msg)
    }
}

/// Where a session's unsolicited messages (notifications) go.
pub type Outbox = Arc<dyn Fn(&Json) + Send + Sync>;

/// How the server runs (changes the instructions and, later, the tool list).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// An in-process engine, state in memory.
    Embedded,
    /// The daemon's `/mcp`: models shared with every other client of the daemon.
    Daemon,
    /// The daemon with the conformance suite's fixtures (tests only).
    DaemonWithFixtures,
    /// `valem mcp --url`: model tools run on a daemon, authoring tools here.
    Proxy,
    /// `valem mcp --url --browser`: the proxy, plus `pair_browser` to share a sandbox session.
    ProxyWithBrowser,
}

/// What every session shares: the service, the tool catalog, the guidance topics, the plugins.
pub struct Server {
    pub service: Arc<ModelService>,
    pub guidance: Catalog,
    pub tools: tools::Catalog,
    pub plugins: Arc<Plugins>,
    pub mode: Mode,
    /// The tasks of the modern era's tasks extension.
    pub tasks: Arc<tasks::Tasks>,
    /// Seals the `requestState` of multi round-trip requests.
    pub state_key: Option<mrtr::StateKey>,
    /// The input schemas of the tools that mirror a parameter into an `Mcp-Param-*` header
    /// (`x-mcp-header`), by tool name: what Streamable HTTP checks those headers against.
    pub mirrored: std::collections::HashMap<String, Json>,
}

/// A modern-era request's context: what its `_meta` declared, and whose it is (the caller
/// scope: `""` for the operator, a sandbox session's namespace for its token's requests).
pub struct Modern<'a> {
    pub meta: modern::Meta,
    pub principal: &'a str,
}

impl Server {
    /// A server without plugins (tool plugins add nothing; guidance is whatever `guidance` holds).
    pub fn new(service: Arc<ModelService>, guidance: Catalog, mode: Mode) -> Arc<Server> {
        Server::with_plugins(service, guidance, Arc::new(Plugins::none()), mode)
    }

    /// A server with loaded plugins: their tools join the catalog, and their host calls reach
    /// this server's built-in tools.
    pub fn with_plugins(
        service: Arc<ModelService>,
        guidance: Catalog,
        plugins: Arc<Plugins>,
        mode: Mode,
    ) -> Arc<Server> {
        let tools = tools::Catalog::new(&guidance, &plugins);
        let server = Arc::new(Server {
            service,
            guidance,
            tools,
            plugins: plugins.clone(),
            mode,
            tasks: tasks::Tasks::new(),
            state_key: mrtr::StateKey::random(),
            mirrored: Default::default(),
        });
        let mut server = server;
        if let Some(s) = Arc::get_mut(&mut server) {
            s.mirrored = session_modern::mirrored_schemas(&s.tools_list(true));
        }
        if server.service.store().is_some() {
            // Tasks survive a restart in their final state; those that were running fail.
            match server
                .tasks
                .persist(Arc::new(tasks::ServiceLog(server.service.clone())))
            {
                Ok(0) => {}
                Ok(n) => tracing::info!(tasks = n, "tasks loaded from the store"),
                Err(e) => tracing::error!("tasks could not be loaded from the store: {e}"),
            }
        }
        let weak = Arc::downgrade(&server);
        plugins.set_dispatcher(Box::new(move |name, args| {
            let fail = |m: String| ("tool_error".to_string(), m);
            let server = weak
                .upgrade()
                .ok_or_else(|| fail("the daemon is shutting down".into()))?;
            let tool = server
                .tools
                .get(name)
                .filter(|t| !t.is_plugin())
                .ok_or_else(|| {
                    (
                        "unknown_tool".to_string(),
                        format!("the host has no built-in tool `{name}`"),
                    )
                })?;
            let ctx = tools::Ctx::new(&server);
            tool.call(&ctx, args).map_err(|e| match e {
                tools::ToolError::Structured(v) => fail(v.to_string()),
                tools::ToolError::Message(m) => fail(m),
            })
        }));
        server
    }

    /// The `tools/list` result (with the fixtures' tools when serving them; those of MCP
    /// 2026-07-28 when `modern`).
    #[cfg_attr(not(feature = "fixtures"), allow(unused_variables))]
    pub fn tools_list(&self, modern: bool) -> Json {
        #[cfg_attr(not(feature = "fixtures"), allow(unused_mut))]
        let mut list = self.tools.list_json();
        #[cfg(feature = "fixtures")]
        if self.fixtures() {
            fixtures::add_tools(&mut list, modern);
        }
        list
    }

    /// Serving the conformance suite's fixtures?
    pub fn fixtures(&self) -> bool {
        cfg!(feature = "fixtures") && self.mode == Mode::DaemonWithFixtures
    }

    fn instructions(&self) -> String {
        "valem runs reactive JSON models: a JSON document plus a ModelSpec (JSON Schema, JSONata \
         derivations, meta-derivations, constraints, effects, tests, a view). Typical flow: author \
         a spec (call get_domain_guidance with the matching topics first, then validate_spec, \
         test_spec and dry_run until clean), create_model, then mutate with {\"$.path\": value} \
         maps (or patch_model for array edits) — every write runs one reactive cycle that \
         recomputes what depends on it — and read with get_state (use paths/depth on large \
         models), get_field or get_view. Call explain when a value looks wrong, snapshot before \
         a risky evolve_spec, restore to roll back. Addresses are canonical JSON paths such as \
         $.order.items[0].qty. "
            .to_string() + match self.mode {
            Mode::Embedded => {
                "In embedded mode models live in this process's memory and are gone when it exits."
            }
            Mode::Daemon | Mode::DaemonWithFixtures | Mode::Proxy => {
                "Models live on a shared daemon: other clients may read and change them too."
            }
            Mode::ProxyWithBrowser => {
                "Models live on a shared daemon. Call pair_browser first: it pairs you with the \
                 developer's browser tab, and from then on the models you create appear there live \
                 and the developer's edits reach you (subscribe to valem://state/{id}). Model ids \
                 are scoped to the paired session. Prefer dry_run before evolve_spec on a shared \
                 model; evolutions that would strand its state are rejected."
            }
        }
    }
}

/// MCP log levels, least severe first.
const LEVELS: &[&str] = &[
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
];

fn level_rank(l: &str) -> Option<usize> {
    LEVELS.iter().position(|x| *x == l)
}

#[derive(Default)]
struct SessionState {
    initialized: bool,
    version: Option<&'static str>,
    min_level: usize,
    subscriptions: HashSet<String>,
    cancelled: HashSet<String>,
    in_flight: HashSet<String>,
    client_capabilities: Json,
}

/// One client connection.
pub struct Session {
    pub server: Arc<Server>,
    out: Outbox,
    state: Mutex<SessionState>,
    /// Model ids with a `valem://state/{id}` subscription. Read by the service's event filter on
    /// shard threads, so it has its own lock, never held across a service call.
    watched: Arc<RwLock<HashSet<String>>>,
    /// The event forwarder starts on the first subscription: a session that never subscribes
    /// costs no thread and no wake-up per commit.
    forwarding: std::sync::Once,
    me: std::sync::Weak<Session>,
    /// Requests we sent the client, waiting for its response (by id).
    asked: Mutex<std::collections::HashMap<String, std::sync::mpsc::SyncSender<Json>>>,
    next_ask: std::sync::atomic::AtomicU64,
    /// Open `subscriptions/listen` requests of this channel (stdio), by request id: set to end.
    listens: Mutex<std::collections::HashMap<String, Arc<std::sync::atomic::AtomicBool>>>,
}

/// Most `subscriptions/listen` streams one stdio channel may hold open.
pub const MAX_LISTENS_PER_CHANNEL: usize = 64;

/// Notifications a listen stream may have waiting for its reader before it is closed.
pub const LISTEN_QUEUE: usize = 1024;

/// A JSON-RPC response: no `method`, a `result` or an `error`. Never answered.
fn is_response(m: &Map<String, Json>) -> bool {
    !m.contains_key("method") && (m.contains_key("result") || m.contains_key("error"))
}

/// Whether a message (or batch) owes the sender an answer: anything but a notification or a
/// response does — a request, and an invalid message (answered `-32600`).
pub fn owes_reply(msg: &Json) -> bool {
    match msg {
        Json::Array(items) => items.is_empty() || items.iter().any(owes_reply),
        Json::Object(m) => {
            let notification = m.get("jsonrpc").and_then(Json::as_str) == Some("2.0")
                && m.get("method").is_some_and(Json::is_string)
                && !m.contains_key("id");
            !notification && !is_response(m)
        }
        _ => true,
    }
}

/// A request id as a set key (`1` and `"1"` are different ids).
fn id_key(id: &Json) -> String {
    id.to_string()
}

fn error(id: Json, code: i64, message: impl Into<String>) -> Json {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message.into()}})
}

fn result(id: Json, result: Json) -> Json {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

impl Session {
    pub fn new(server: Arc<Server>, out: Outbox) -> Arc<Session> {
        Arc::new_cyclic(|me| Session {
            server,
            out,
            state: Mutex::new(SessionState {
                min_level: 1,
                ..Default::default()
            }),
            watched: Arc::default(),
            forwarding: std::sync::Once::new(),
            me: me.clone(),
            asked: Mutex::default(),
            next_ask: std::sync::atomic::AtomicU64::new(1),
            listens: Mutex::default(),
        })
    }

    /// Forward committed changes of watched models as `notifications/resources/updated`.
    fn start_forwarding(&self) {
        self.forwarding.call_once(|| {
            let watched = self.watched.clone();
            let filter: EventFilter = Arc::new(move |ev: &Event| {
                watched
                    .read()
                    .map(|w| w.contains(ev.model_id()))
                    .unwrap_or(false)
            });
            let events = self.server.service.subscribe(filter);
            let weak = self.me.clone();
            let _ = std::thread::Builder::new()
                .name("valem-mcp-events".into())
                .spawn(move || {
                    while let Ok(ev) = events.recv() {
                        let Some(session) = weak.upgrade() else {
                            break;
                        };
                        session.on_event(&ev);
                    }
                });
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn on_event(&self, ev: &Event) {
        // A fleet moving the model changes nothing of its state.
        if matches!(ev, Event::Moved { .. }) {
            return;
        }
        let uri = format!("valem://state/{}", ev.model_id());
        if self.lock().subscriptions.contains(&uri) {
            (self.out)(&json!({
                "jsonrpc": "2.0",
                "method": "notifications/resources/updated",
                "params": {"uri": uri},
            }));
        }
    }

    /// Send a log notification if `level` is at or above the client's floor.
    pub fn log(&self, level: &str, data: Json) {
        let rank = level_rank(level).unwrap_or(1);
        if rank < self.lock().min_level {
            return;
        }
        (self.out)(&json!({
            "jsonrpc": "2.0",
            "method": "notifications/message",
            "params": {"level": level, "logger": "valem", "data": data},
        }));
    }

    /// Did the client declare this capability (`sampling`, `elicitation`, …) at initialize?
    pub fn client_can(&self, capability: &str) -> bool {
        self.client_capability(capability).is_some()
    }

    /// The client's declaration of a capability at initialize, if any.
    pub fn client_capability(&self, capability: &str) -> Option<Json> {
        self.lock().client_capabilities.get(capability).cloned()
    }

    /// Send the client a request (on `io`, else the session's outbox) and wait for its
    /// response, at most `timeout`. The result, or the client's error as a message.
    pub fn ask(
        &self,
        io: Option<&Outbox>,
        method: &str,
        params: Json,
        timeout: std::time::Duration,
    ) -> Result<Json, String> {
        let n = self
            .next_ask
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = json!(format!("valem-{n}"));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        if let Ok(mut a) = self.asked.lock() {
            a.insert(id_key(&id), tx);
        }
        let msg = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        match io {
            Some(send) => send(&msg),
            None => (self.out)(&msg),
        }
        let answer = rx.recv_timeout(timeout);
        if let Ok(mut a) = self.asked.lock() {
            a.remove(&id_key(&id));
        }
        match answer {
            Ok(reply) => match reply.get("result") {
                Some(r) => Ok(r.clone()),
                None => Err(format!(
                    "the client answered {method} with an error: {}",
                    reply.get("error").cloned().unwrap_or(Json::Null)
                )),
            },
            Err(_) => Err(format!(
                "the client did not answer {method} within {} s",
                timeout.as_secs()
            )),
        }
    }

    /// A notification for the running request's stream (`io`), else the session's outbox.
    pub fn notify(&self, io: Option<&Outbox>, msg: &Json) {
        match io {
            Some(send) => send(msg),
            None => (self.out)(msg),
        }
    }

    /// The client's log floor admits `level`.
    pub fn log_enabled(&self, level: &str) -> bool {
        level_rank(level).unwrap_or(1) >= self.lock().min_level
    }

    /// The negotiated revision (`None` before `initialize`).
    pub fn protocol_version(&self) -> Option<&'static str> {
        self.lock().version
    }

    /// Handle notifications that must act immediately, even while a request is being served
    /// (`notifications/cancelled`). Returns true when the message was consumed.
    pub fn intercept(&self, msg: &Json) -> bool {
        if msg.get("method").is_none()
            && (msg.get("result").is_some() || msg.get("error").is_some())
        {
            // A response to a request of ours: wake whoever waits for it.
            if let Some(id) = msg.get("id") {
                let waiter = self
                    .asked
                    .lock()
                    .ok()
                    .and_then(|mut a| a.remove(&id_key(id)));
                if let Some(w) = waiter {
                    let _ = w.try_send(msg.clone());
                    return true;
                }
            }
        }
        if msg.get("method").and_then(|m| m.as_str()) == Some("notifications/cancelled")
            && msg.get("id").is_none()
        {
            if let Some(rid) = msg.get("params").and_then(|p| p.get("requestId")) {
                let key = id_key(rid);
                let listen = self.listens.lock().ok().and_then(|mut l| l.remove(&key));
                if let Some(stop) = listen {
                    // Ends a subscription: it owes no reply.
                    stop.store(true, std::sync::atomic::Ordering::SeqCst);
                    return true;
                }
                let mut st = self.lock();
                st.cancelled.insert(key);
                // Bound the set: ids of requests that already finished are never removed.
                if st.cancelled.len() > 10_000 {
                    st.cancelled.clear();
                }
            }
            return true;
        }
        false
    }

    /// Handle one message or a batch; the reply to send, if any.
    pub fn handle(&self, msg: Json) -> Option<Json> {
        self.handle_in(msg, None)
    }

    /// Handle a message whose request-scoped messages (progress, logs of the running tool,
    /// requests to the client) go to `io` — the request's own response stream on HTTP —
    /// instead of the session's outbox.
    pub fn handle_in(&self, msg: Json, io: Option<&Outbox>) -> Option<Json> {
        self.handle_as(msg, io, "")
    }

    /// [`handle_in`](Self::handle_in) for a caller scope: a modern request's tasks belong to
    /// `principal`, and its sealed request states are bound to it.
    pub fn handle_as(&self, msg: Json, io: Option<&Outbox>, principal: &str) -> Option<Json> {
        match msg {
            Json::Array(items) => self.handle_batch(items, io),
            other => self.handle_one(other, io, principal),
        }
    }

    /// A single `tools/call` of a tool with an async form (`mutate`), as a future that awaits
    /// the shard instead of blocking a thread; `None` for every other message, which goes to
    /// [`handle_in`](Self::handle_in). The answer is the same either way; `None` from the
    /// future means the call was cancelled while it ran.
    pub fn call_deferred(
        &self,
        msg: &Json,
    ) -> Option<impl std::future::Future<Output = Option<Json>> + Send + 'static> {
        let m = msg.as_object()?;
        if m.get("jsonrpc")?.as_str()? != "2.0"
            || m.get("method")?.as_str()? != "tools/call"
            || self.server.fixtures()
        {
            return None;
        }
        let id = m
            .get("id")
            .filter(|i| i.is_string() || i.is_number())?
            .clone();
        let params = m.get("params")?;
        let tool = self
            .server
            .tools
            .get(params.get("name")?.as_str()?)
            .filter(|t| t.is_deferred())?;
        let args = call_arguments(params).ok()?;
        let me = self.me.upgrade()?;
        let key = id_key(&id);
        let modern = modern::selects_modern("tools/call", params);
        if modern && modern::read_meta("tools/call", params, &id).is_err() {
            return None;
        }
        {
            let mut st = self.lock();
            if !(st.initialized || modern) || st.cancelled.contains(&key) {
                return None;
            }
            st.in_flight.insert(key.clone());
        }
        let ctx = tools::Ctx::of_call(&self.server, params);
        let call = tool.call_deferred(&ctx, args);
        let name = tool.name;
        Some(async move {
            let outcome = match call {
                Some(c) => c.await,
                None => Err(tools::ToolError::Message(
                    "the tool has no async form".into(),
                )),
            };
            let mut st = me.lock();
            st.in_flight.remove(&key);
            if st.cancelled.remove(&key) {
                return None;
            }
            let reply = result(id, tools::envelope_for(name, outcome));
            Some(if modern {
                modern_response(reply, "tools/call", &Json::Null)
            } else {
                reply
            })
        })
    }

    fn handle_batch(&self, items: Vec<Json>, io: Option<&Outbox>) -> Option<Json> {
        let allowed = matches!(self.protocol_version(), Some("2024-11-05" | "2025-03-26"));
        if !allowed {
            let why = match self.protocol_version() {
                None => "a batch cannot carry or precede `initialize`; send initialize on its own"
                    .to_string(),
                Some(v) => format!("JSON-RPC batches are not part of MCP revision {v}"),
            };
            return Some(error(Json::Null, code::INVALID_REQUEST, why));
        }
        if items.is_empty() {
            return Some(error(
                Json::Null,
                code::INVALID_REQUEST,
                "an empty batch is not a valid request",
            ));
        }
        let replies: Vec<Json> = items
            .into_iter()
            .filter_map(|m| {
                if m.get("method").and_then(|x| x.as_str()) == Some("initialize") {
                    return Some(error(
                        m.get("id").cloned().unwrap_or(Json::Null),
                        code::INVALID_REQUEST,
                        "initialize must not be part of a batch",
                    ));
                }
                if self.intercept(&m) {
                    return None;
                }
                self.handle_one(m, io, "")
            })
            .collect();
        (!replies.is_empty()).then_some(Json::Array(replies))
    }

    fn handle_one(&self, msg: Json, io: Option<&Outbox>, principal: &str) -> Option<Json> {
        let Json::Object(mut m) = msg else {
            return Some(error(
                Json::Null,
                code::INVALID_REQUEST,
                "a JSON-RPC message must be an object",
            ));
        };
        if is_response(&m) {
            // A response nobody waits for (late, or never asked): nothing to answer.
            return None;
        }
        let id = m.remove("id");
        // An invalid request is answered with its id when it has a usable one, else null.
        let reply_id = || match &id {
            Some(i @ (Json::String(_) | Json::Number(_))) => i.clone(),
            _ => Json::Null,
        };
        if m.get("jsonrpc").and_then(|v| v.as_str()) != Some("2.0") {
            return Some(error(
                reply_id(),
                code::INVALID_REQUEST,
                "Invalid Request: missing or wrong `jsonrpc` member (must be \"2.0\")",
            ));
        }
        let method = match m.remove("method") {
            Some(Json::String(s)) => s,
            Some(_) => {
                return Some(error(
                    reply_id(),
                    code::INVALID_REQUEST,
                    "Invalid Request: `method` must be a string",
                ))
            }
            None => {
                return Some(error(
                    reply_id(),
                    code::INVALID_REQUEST,
                    "Invalid Request: no `method` (a request needs `method` and `id`, a \
                     notification `method`, a response `result` or `error`)",
                ))
            }
        };
        let params = m.remove("params").unwrap_or(Json::Object(Map::new()));
        let Some(id) = id else {
            self.notification(&method, &params);
            return None;
        };
        if !matches!(id, Json::String(_) | Json::Number(_)) {
            return Some(error(
                Json::Null,
                code::INVALID_REQUEST,
                "a request id must be a string or a number",
            ));
        }
        if !params.is_object() && !params.is_array() {
            return Some(error(
                id,
                code::INVALID_PARAMS,
                "`params` must be an object",
            ));
        }
        let key = id_key(&id);
        {
            let mut st = self.lock();
            if st.cancelled.remove(&key) {
                return None;
            }
            st.in_flight.insert(key.clone());
        }
        let reply = if modern::selects_modern(&method, &params) {
            self.modern_request(&method, params, id, io, principal)
        } else {
            Some(self.request(&method, params, id, io))
        };
        let mut st = self.lock();
        st.in_flight.remove(&key);
        if st.cancelled.remove(&key) {
            // Cancelled while running: the client no longer wants the answer.
            return None;
        }
        reply
    }

    fn notification(&self, method: &str, _params: &Json) {
        match method {
            "notifications/initialized" => {
                let tools = self.server.tools.tools.len();
                let mode = match self.server.mode {
                    Mode::Embedded => "embedded, in-memory",
                    Mode::Daemon | Mode::DaemonWithFixtures => "daemon, shared models",
                    Mode::Proxy => "proxy to a daemon",
                    Mode::ProxyWithBrowser => "proxy to a daemon, browser pairing",
                };
                self.log(
                    "info",
                    json!(format!(
                        "valem {} ready ({mode}; {tools} tools, protocol {})",
                        env!("CARGO_PKG_VERSION"),
                        self.protocol_version().unwrap_or("?")
                    )),
                );
            }
            "notifications/cancelled" => {}
            _ => {}
        }
    }

    /// A legacy-era request: the handshake, then what a session of a handshake revision may ask.
    fn request(&self, method: &str, params: Json, id: Json, io: Option<&Outbox>) -> Json {
        if method == "initialize" {
            return self.initialize(params, id);
        }
        if method == "ping" {
            return result(id, json!({}));
        }
        if !self.lock().initialized {
            return error(
                id,
                code::INVALID_REQUEST,
                format!(
                    "the session is not initialized: send `initialize` before `{method}`, or \
                     name the revision in `_meta[\"{}\"]` (one of {}) to speak MCP without a \
                     handshake",
                    modern::key::PROTOCOL_VERSION,
                    modern::MODERN_VERSIONS.join(", ")
                ),
            );
        }
        match method {
            "resources/subscribe" | "resources/unsubscribe" => {
                self.subscribe_legacy(method, &params, id)
            }
            "logging/setLevel" => match params.get("level").and_then(|l| l.as_str()) {
                Some(l) => match level_rank(l) {
                    Some(r) => {
                        self.lock().min_level = r;
                        result(id, json!({}))
                    }
                    None => error(
                        id,
                        code::INVALID_PARAMS,
                        format!("unknown log level `{l}`; use one of {}", LEVELS.join(", ")),
                    ),
                },
                None => error(
                    id,
                    code::INVALID_PARAMS,
                    "logging/setLevel needs a `level` string",
                ),
            },
            _ => self.common(method, params, id, io, None),
        }
    }

    /// `resources/subscribe` / `resources/unsubscribe` of a legacy session.
    fn subscribe_legacy(&self, method: &str, params: &Json, id: Json) -> Json {
        let Some(uri) = params.get("uri").and_then(|u| u.as_str()) else {
            return error(
                id,
                code::INVALID_PARAMS,
                format!("{method} needs a `uri` string"),
            );
        };
        if !resources::subscribable(uri) {
            return json!({"jsonrpc": "2.0", "id": id, "error": {
                "code": code::RESOURCE_NOT_FOUND,
                "message": format!("`{uri}` is not a subscribable resource; subscribe to valem://state/{{modelId}}"),
                "data": {"uri": uri},
            }});
        }
        let mut st = self.lock();
        if method == "resources/subscribe" {
            if st.subscriptions.len() >= 1000 && !st.subscriptions.contains(uri) {
                return error(
                    id,
                    code::INVALID_PARAMS,
                    "too many subscriptions in this session (limit 1000)",
                );
            }
            st.subscriptions.insert(uri.to_string());
        } else {
            st.subscriptions.remove(uri);
        }
        drop(st);
        if let Some(model) = uri.strip_prefix(resources::STATE_PREFIX) {
            if let Ok(mut w) = self.watched.write() {
                if method == "resources/subscribe" {
                    w.insert(model.to_string());
                } else {
                    w.remove(model);
                }
            }
        }
        if method == "resources/subscribe" {
            self.start_forwarding();
        }
        result(id, json!({}))
    }

    /// What both eras serve alike: tools, resources, prompts and completion. `meta` is the
    /// modern request's declaration (`None` in a legacy session).
    fn common(
        &self,
        method: &str,
        params: Json,
        id: Json,
        io: Option<&Outbox>,
        cx: Option<&Modern>,
    ) -> Json {
        match method {
            "tools/list" => result(id, self.server.tools_list(cx.is_some())),
            "tools/call" => self.call_tool(params, id, io, cx),
            "resources/list" => {
                #[cfg_attr(not(feature = "fixtures"), allow(unused_mut))]
                let mut r = resources::list(&self.server);
                #[cfg(feature = "fixtures")]
                if self.server.fixtures() {
                    fixtures::add_resources(&mut r);
                }
                result(id, r)
            }
            "resources/templates/list" => {
                #[cfg_attr(not(feature = "fixtures"), allow(unused_mut))]
                let mut r = resources::templates();
                #[cfg(feature = "fixtures")]
                if self.server.fixtures() {
                    fixtures::add_templates(&mut r);
                }
                result(id, r)
            }
            "resources/read" => match params.get("uri").and_then(|u| u.as_str()) {
                None => error(
                    id,
                    code::INVALID_PARAMS,
                    "resources/read needs a `uri` string",
                ),
                #[cfg(feature = "fixtures")]
                Some(uri) if self.server.fixtures() && uri.starts_with("test://") => {
                    match fixtures::read_resource(uri) {
                        Some(r) => result(id, r),
                        None => json!({"jsonrpc": "2.0", "id": id, "error": {
                            "code": code::RESOURCE_NOT_FOUND,
                            "message": format!("resource not found: {uri}"),
                            "data": {"uri": uri},
                        }}),
                    }
                }
                Some(uri) => match resources::read(&self.server, uri) {
                    Ok(r) => result(id, r),
                    Err(e) => json!({"jsonrpc": "2.0", "id": id, "error": e}),
                },
            },
            #[cfg(feature = "fixtures")]
            "prompts/list" | "prompts/get" | "completion/complete" if self.server.fixtures() => {
                match fixtures::prompts(self, method, &params, cx) {
                    Ok(r) => result(id, r),
                    Err(m) => error(id, code::INVALID_PARAMS, m),
                }
            }
            "prompts/list" | "prompts/get" | "completion/complete" => error(
                id,
                code::METHOD_NOT_FOUND,
                format!("method not found: {method} (this server offers no prompts)"),
            ),
            other => error(
                id,
                code::METHOD_NOT_FOUND,
                format!("method not found: {other}"),
            ),
        }
    }

    fn initialize(&self, params: Json, id: Json) -> Json {
        let requested = params.get("protocolVersion").and_then(|v| v.as_str());
        let version = requested
            .and_then(|r| PROTOCOL_VERSIONS.iter().find(|v| **v == r).copied())
            .unwrap_or(PROTOCOL_VERSIONS[PROTOCOL_VERSIONS.len() - 1]);
        {
            let mut st = self.lock();
            st.initialized = true;
            st.version = Some(version);
            st.client_capabilities = params.get("capabilities").cloned().unwrap_or(Json::Null);
        }
        let mut capabilities = json!({
            "tools": {"listChanged": false},
            "resources": {"subscribe": true, "listChanged": false},
            "logging": {},
        });
        if self.server.fixtures() {
            capabilities["prompts"] = json!({"listChanged": false});
            capabilities["completions"] = json!({});
        }
        result(
            id,
            json!({
                "protocolVersion": version,
                "capabilities": capabilities,
                "serverInfo": {
                    "name": "valem",
                    "title": "valem — reactive JSON models",
                    "version": env!("CARGO_PKG_VERSION"),
                },
                "instructions": self.server.instructions(),
            }),
        )
    }

    #[cfg_attr(not(feature = "fixtures"), allow(unused_variables))]
    fn call_tool(&self, params: Json, id: Json, io: Option<&Outbox>, cx: Option<&Modern>) -> Json {
        let Some(name) = params.get("name").and_then(|n| n.as_str()) else {
            return error(id, code::INVALID_PARAMS, "tools/call needs a `name` string");
        };
        #[cfg(feature = "fixtures")]
        if self.server.fixtures() {
            match fixtures::call_tool(self, name, &params, io, cx) {
                Some(Ok(r)) => return result(id, r),
                Some(Err(e)) => return with_id(e, id),
                None => {}
            }
        }
        let Some(tool) = self.server.tools.get(name) else {
            return error(
                id,
                code::INVALID_PARAMS,
                format!("unknown tool `{name}`; tools/list shows the available tools"),
            );
        };
        let args = match call_arguments(&params) {
            Ok(a) => a,
            Err(why) => return error(id, code::INVALID_PARAMS, why),
        };
        if let Some(cx) = cx {
            if let Some(r) = self.call_as_task(tool, args.clone(), &id, cx) {
                return r;
            }
        }
        let ctx = tools::Ctx::of_call(&self.server, &params);
        result(id, tools::envelope_for(tool.name, tool.call(&ctx, args)))
    }
}

/// A `tools/call`'s `arguments`: an object (absent or null: an empty one).
fn call_arguments(params: &Json) -> Result<Json, &'static str> {
    match params.get("arguments") {
        None | Some(Json::Null) => Ok(Json::Object(Map::new())),
        Some(a @ Json::Object(_)) => Ok(a.clone()),
        Some(_) => Err("tools/call `arguments` must be an object"),
    }
}

// The unit tests count their allocations, so that memory budgets are enforced there too.
#[cfg(test)]
#[global_allocator]
static GLOBAL: valem_core::budget::Counting<std::alloc::System> =
    valem_core::budget::Counting(std::alloc::System);
