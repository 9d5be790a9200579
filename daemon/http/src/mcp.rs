//! Streamable HTTP transport of the MCP core at `/mcp` (revisions 2025-03-26 … 2025-11-25; the
//! 2024-11-05 HTTP+SSE transport is not served).
//!
//! - `POST /mcp`: one JSON-RPC message (or a batch where the revision allows it). `initialize`
//!   opens a session and the reply carries `Mcp-Session-Id`; every later request must carry it
//!   (400 without, 404 for an unknown or ended one). A body of notifications and responses
//!   only gets 202. Requests are answered with `application/json`, or with a one-event
//!   `text/event-stream` when the client accepts only that.
//! - `GET /mcp` (`Accept: text/event-stream`): the session's stream of server messages
//!   (`notifications/resources/updated`, log messages). Several streams may be open; each
//!   message goes to exactly one. Messages sent while none is open wait (up to 1,000).
//! - `DELETE /mcp`: ends the session.
//!
//! `MCP-Protocol-Version`, when sent, must be a revision we speak (400 otherwise).
//!
//! A POST of the modern era (MCP 2026-07-28: the version named in the body's `_meta`) needs no
//! session and is served by [`super::mcp_modern`]; GET and DELETE are not part of that era
//! (405 when their `MCP-Protocol-Version` names it).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value as Json};
use tokio::sync::mpsc;

use super::sandbox::Scoped;
use super::AppState;
use valem_mcp::{code, Outbox, Session, PROTOCOL_VERSIONS};

pub const SESSION_HEADER: &str = "mcp-session-id";
pub const VERSION_HEADER: &str = "mcp-protocol-version";

/// Server messages kept for a session while no stream is open.
const PENDING_MAX: usize = 1000;

pub fn routes(st: &AppState) -> Router<AppState> {
    Router::new()
        .route("/mcp", post(post_mcp).get(get_mcp).delete(delete_mcp))
        .layer(DefaultBodyLimit::max(st.config.max_body_bytes))
}

/// Where a session's server messages go: its open GET streams, else a bounded queue.
#[derive(Default)]
struct Outbound {
    streams: Vec<mpsc::UnboundedSender<Json>>,
    pending: VecDeque<Json>,
}

pub struct HttpSession {
    session: Arc<Session>,
    /// The sandbox session it was opened in (with `X-Session-Token`): every message of it is
    /// scoped to that session's models.
    scope: Option<Scoped>,
    out: Arc<Mutex<Outbound>>,
    last_used: Mutex<Instant>,
    /// In a fleet, the relays of the models it subscribed to (`valem://state/{id}`): another
    /// node's model is heard here while the subscription lasts.
    relayed: Mutex<HashMap<String, crate::relay::RelayGuard>>,
}

impl HttpSession {
    fn touch(&self) {
        if let Ok(mut t) = self.last_used.lock() {
            *t = Instant::now();
        }
    }

    fn idle_for(&self) -> Duration {
        self.last_used
            .lock()
            .map_or(Duration::ZERO, |t| t.elapsed())
    }

    fn open_streams(&self) -> usize {
        self.out
            .lock()
            .map_or(0, |o| o.streams.iter().filter(|s| !s.is_closed()).count())
    }
}

/// The live sessions of the daemon.
pub struct Sessions {
    map: Mutex<HashMap<String, Arc<HttpSession>>>,
    max: usize,
    idle: Duration,
    /// The one session modern-era requests are served by (made on first use).
    stateless: std::sync::OnceLock<Arc<Session>>,
    /// Open `subscriptions/listen` streams.
    pub listens: std::sync::atomic::AtomicUsize,
}

impl Sessions {
    pub fn new(max: usize, idle: Duration) -> Sessions {
        Sessions {
            map: Mutex::new(HashMap::new()),
            max,
            idle,
            stateless: std::sync::OnceLock::new(),
            listens: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// The session of modern-era requests.
    pub(crate) fn stateless(&self, st: &AppState) -> Arc<Session> {
        self.stateless
            .get_or_init(|| super::mcp_modern::stateless_session(st))
            .clone()
    }

    /// Most `subscriptions/listen` streams open at once (as many as legacy sessions).
    pub(crate) fn max_listens(&self) -> usize {
        self.max
    }

    pub fn len(&self) -> usize {
        self.map.lock().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, id: &str) -> Option<Arc<HttpSession>> {
        self.map.lock().ok()?.get(id).cloned()
    }

    fn remove(&self, id: &str) -> Option<Arc<HttpSession>> {
        self.map.lock().ok()?.remove(id)
    }

    /// Drop sessions idle past the limit with no open stream.
    fn reap(&self) -> usize {
        let Ok(mut m) = self.map.lock() else {
            return 0;
        };
        let before = m.len();
        m.retain(|_, s| s.open_streams() > 0 || s.idle_for() < self.idle);
        before - m.len()
    }
}

pub fn spawn_reaper(sessions: Arc<Sessions>, mut stop: tokio::sync::watch::Receiver<bool>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(30));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let n = sessions.reap();
                    if n > 0 {
                        tracing::info!(dropped = n, "idle MCP sessions dropped");
                    }
                }
                _ = stop.changed() => break,
            }
        }
    });
}

/// 128 random bits, hex.
fn new_session_id() -> Option<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).ok()?;
    Some(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn rpc_error(status: StatusCode, code: i64, message: impl Into<String>) -> Response {
    let body =
        json!({"jsonrpc": "2.0", "id": null, "error": {"code": code, "message": message.into()}});
    (status, axum::Json(body)).into_response()
}

fn accepts(headers: &HeaderMap, what: &str) -> bool {
    let Some(a) = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    a.split(',').any(|part| {
        let t = part.split(';').next().unwrap_or("").trim();
        t.eq_ignore_ascii_case(what) || t == "*/*"
    })
}

fn is_json_content(headers: &HeaderMap) -> bool {
    super::rest::extract::media_type(headers).as_deref() == Some("application/json")
}

fn check_version(headers: &HeaderMap, id: Option<&Json>) -> Result<(), Response> {
    match headers.get(VERSION_HEADER).map(|v| v.to_str()) {
        None => Ok(()),
        Some(Ok(v))
            if PROTOCOL_VERSIONS.contains(&v)
                || valem_mcp::modern::MODERN_VERSIONS.contains(&v) =>
        {
            Ok(())
        }
        Some(v) => {
            let requested = v.unwrap_or("?");
            let body = valem_mcp::modern::unsupported_version(
                id.filter(|i| i.is_string() || i.is_number())
                    .cloned()
                    .unwrap_or(Json::Null),
                requested,
                &format!("MCP-Protocol-Version `{requested}` is not a revision this server speaks"),
            );
            Err((StatusCode::BAD_REQUEST, axum::Json(body)).into_response())
        }
    }
}

fn session_of(st: &AppState, headers: &HeaderMap) -> Result<(String, Arc<HttpSession>), Response> {
    let Some(id) = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok()) else {
        return Err(rpc_error(
            StatusCode::BAD_REQUEST,
            code::INVALID_REQUEST,
            "Bad Request: no Mcp-Session-Id header; send `initialize` first and pass the id it returns",
        ));
    };
    match st.sessions.get(id) {
        Some(s) => {
            s.touch();
            Ok((id.to_string(), s))
        }
        None => Err(rpc_error(
            StatusCode::NOT_FOUND,
            code::INVALID_REQUEST,
            "Session not found: it ended or never existed; send `initialize` to start a new one",
        )),
    }
}

/// Is this message (or every member of this batch) something that gets no reply?
fn is_initialize(msg: &Json) -> bool {
    msg.get("method").and_then(|m| m.as_str()) == Some("initialize")
}

/// A POST to `/mcp` read and checked: its headers (size, version, Accept, Content-Type), its
/// body parsed; a refusal is the JSON-RPC error response to send.
struct Incoming {
    headers: axum::http::HeaderMap,
    scoped: Option<Scoped>,
    msg: Json,
    json_ok: bool,
    sse_ok: bool,
}

async fn read_incoming(st: &AppState, req: Request) -> Result<Incoming, Response> {
    let headers = req.headers().clone();
    let scoped = req.extensions().get::<Scoped>().cloned();
    let limit = st.config.max_body_bytes;
    let too_large = || {
        rpc_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            code::INVALID_REQUEST,
            format!("Request body too large: the limit is {limit} bytes (--max-body-bytes)"),
        )
    };
    if super::rest::extract::declares_over(&headers, limit) {
        return Err(too_large());
    }
    // The body is read before the headers are judged, so that a refusal on them (a client
    // probing with a protocol version we do not speak, say) leaves the connection reusable.
    let body = match Bytes::from_request(req, st).await {
        Ok(b) => b,
        Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_large()),
        Err(r) => {
            return Err(rpc_error(
                StatusCode::BAD_REQUEST,
                code::PARSE_ERROR,
                format!("Unreadable request body: {}", r.body_text()),
            ))
        }
    };
    let json_ok = accepts(&headers, "application/json");
    let sse_ok = accepts(&headers, "text/event-stream");
    if !json_ok && !sse_ok {
        return Err(rpc_error(
            StatusCode::NOT_ACCEPTABLE,
            code::INVALID_REQUEST,
            "Not Acceptable: the client must accept application/json and text/event-stream",
        ));
    }
    if !is_json_content(&headers) {
        return Err(rpc_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            code::INVALID_REQUEST,
            "Unsupported Media Type: the body must be application/json",
        ));
    }
    let msg: Json = match valem_mcp::wire::parse(&body) {
        Ok(m) => m,
        Err(e) => {
            return Err(rpc_error(
                StatusCode::BAD_REQUEST,
                code::PARSE_ERROR,
                format!("Parse error: {e}"),
            ))
        }
    };
    check_version(&headers, msg.get("id"))?;
    Ok(Incoming {
        headers,
        scoped,
        msg,
        json_ok,
        sse_ok,
    })
}

async fn post_mcp(State(st): State<AppState>, req: Request) -> Response {
    let Incoming {
        headers,
        scoped,
        mut msg,
        json_ok,
        sse_ok,
    } = match read_incoming(&st, req).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    if super::mcp_modern::is_modern(&headers, &msg) {
        return super::mcp_modern::post(&st, &headers, scoped, msg, json_ok, sse_ok).await;
    }
    let (sid, hs, created) = match session_for(&st, &headers, &msg, &scoped) {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Some(s) = &hs.scope {
        if let Some(r) = refuse_scoped(s, &msg) {
            return with_session_header(plain_reply(&st, created, &sid, r, json_ok), created, &sid);
        }
    }
    let request = msg.clone();
    let scope = hs.scope.clone();
    if let Some(s) = &scope {
        s.inbound_rpc(&mut msg);
    }
    let out = move |mut r: Json| {
        if let Some(s) = &scope {
            s.outbound_rpc(&request, &mut r);
        }
        r
    };
    if !valem_mcp::owes_reply(&msg) {
        let session = hs.session.clone();
        let _ = st
            .blocking(move |_| {
                if !session.intercept(&msg) {
                    session.handle(msg);
                }
            })
            .await;
        return StatusCode::ACCEPTED.into_response();
    }
    // In a fleet, a call about a model another node owns is that node's to answer, and a
    // subscription to one is relayed from there.
    if hs.scope.is_none() {
        relay_subscription(&st, &hs, &msg);
        if let Some(reply) = super::forward::legacy_call_elsewhere(&st, &msg).await {
            let res = plain_reply(&st, created, &sid, Some(reply), json_ok);
            return with_session_header(res, created, &sid);
        }
    }
    let session = hs.session.clone();
    let res = if let Some(call) = session.call_deferred(&msg) {
        // A cycle: await the shard; the worker serves other connections meanwhile.
        let reply = call.await.map(&out);
        plain_reply(&st, created, &sid, reply, json_ok)
    } else {
        let to = Recipient {
            st: &st,
            created,
            sid: &sid,
            json_ok,
            sse_ok,
            modern: false,
            principal: String::new(),
        };
        if runs_inline(&st, &msg) {
            reply_inline(session, msg, to, out)
        } else {
            reply_streamed(session, msg, to, out).await
        }
    };
    with_session_header(res, created, &sid)
}

/// A legacy session's `resources/subscribe` (or `unsubscribe`) of a model's state: in a fleet,
/// the model's events are relayed here while it lasts (they are published on this node's bus,
/// where the session hears them whether the model is here or on another node).
fn relay_subscription(st: &AppState, hs: &HttpSession, msg: &Json) {
    let method = msg.get("method").and_then(Json::as_str);
    let Some(model) = msg
        .pointer("/params/uri")
        .and_then(Json::as_str)
        .and_then(|u| u.strip_prefix(valem_mcp::resources::STATE_PREFIX))
    else {
        return;
    };
    let Ok(mut relayed) = hs.relayed.lock() else {
        return;
    };
    match method {
        // As many as the session itself keeps (it refuses more), of models that can exist.
        Some("resources/subscribe")
            if !model.is_empty() && !relayed.contains_key(model) && relayed.len() < 1000 =>
        {
            if let Some(g) = st.relays.watch(st, model) {
                relayed.insert(model.to_string(), g);
            }
        }
        Some("resources/unsubscribe") => {
            relayed.remove(model);
        }
        _ => {}
    }
}

/// The session a message belongs to: a new one for `initialize` (sent without a session id),
/// else the one its `Mcp-Session-Id` names, which a sandbox token must match.
fn session_for(
    st: &AppState,
    headers: &HeaderMap,
    msg: &Json,
    scoped: &Option<Scoped>,
) -> Result<(String, Arc<HttpSession>, bool), Response> {
    let (sid, hs, created) = if is_initialize(msg) {
        if headers.contains_key(SESSION_HEADER) {
            // Re-initializing inside a session is refused; a client starts a new one without the header.
            return Err(rpc_error(
                StatusCode::BAD_REQUEST,
                code::INVALID_REQUEST,
                "initialize must be sent without Mcp-Session-Id (it opens a new session)",
            ));
        }
        let (sid, hs) = open_session(st, scoped.clone())?;
        (sid, hs, true)
    } else {
        let (sid, hs) = session_of(st, headers)?;
        (sid, hs, false)
    };
    // A sandbox session is used with its own token only, and an operator's session never with one.
    match (&hs.scope, scoped) {
        (None, None) => Ok((sid, hs, created)),
        (Some(a), Some(b)) if a.ns == b.ns => Ok((sid, hs, created)),
        (Some(_), _) => Err(rpc_error(
            StatusCode::FORBIDDEN,
            code::INVALID_REQUEST,
            "this MCP session belongs to a sandbox session: send its X-Session-Token",
        )),
        (None, Some(_)) => Err(rpc_error(
            StatusCode::FORBIDDEN,
            code::INVALID_REQUEST,
            "this MCP session was opened without a session token; a token cannot join it",
        )),
    }
}

/// Who a reply goes to: the session (and whether this request opened it) and what the
/// request accepts (JSON, SSE); a modern-era request has no session.
pub(crate) struct Recipient<'a> {
    pub(crate) st: &'a AppState,
    pub(crate) created: bool,
    pub(crate) sid: &'a str,
    pub(crate) json_ok: bool,
    pub(crate) sse_ok: bool,
    pub(crate) modern: bool,
    /// A modern request's caller scope (its tasks are its own).
    pub(crate) principal: String,
}

/// A request in which nothing waits on the client or reports progress, run in place (no hop
/// to the blocking pool); what it emitted (logs) is sent before the reply.
pub(crate) fn reply_inline(
    session: Arc<Session>,
    msg: Json,
    to: Recipient<'_>,
    out: impl Fn(Json) -> Json,
) -> Response {
    let (st, created, sid) = (to.st, to.created, to.sid);
    let (json_ok, sse_ok, modern) = (to.json_ok, to.sse_ok, to.modern);
    let emitted: Arc<Mutex<Vec<Json>>> = Arc::default();
    let sink = emitted.clone();
    let io: Option<Outbox> = sse_ok.then(|| {
        Arc::new(move |m: &Json| {
            if let Ok(mut e) = sink.lock() {
                e.push(m.clone());
            }
        }) as Outbox
    });
    let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tokio::task::block_in_place(|| session.handle_as(msg, io.as_ref(), &to.principal))
    }));
    let Ok(reply) = reply else {
        return rpc_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            code::INTERNAL_ERROR,
            "the request's worker failed",
        );
    };
    let reply = reply.map(&out);
    let emitted: Vec<Json> = emitted
        .lock()
        .map(|mut e| std::mem::take(&mut *e))
        .unwrap_or_default()
        .into_iter()
        .map(&out)
        .collect();
    if emitted.is_empty() {
        plain_reply_as(st, created, sid, reply, json_ok, modern)
    } else {
        let all = emitted.into_iter().chain(reply);
        Sse::new(stream::iter(
            all.map(|m| Ok::<_, Infallible>(message_event(&m))),
        ))
        .into_response()
    }
}

/// A request that may emit messages while it runs (progress, logs, requests to the client),
/// run on the blocking pool: the reply switches to SSE at the first message; a plain call
/// stays JSON.
pub(crate) async fn reply_streamed(
    session: Arc<Session>,
    msg: Json,
    to: Recipient<'_>,
    out: impl Fn(Json) -> Json + Send + 'static,
) -> Response {
    let (st, created, sid) = (to.st, to.created, to.sid);
    let (json_ok, sse_ok, modern) = (to.json_ok, to.sse_ok, to.modern);
    let (tx, mut rx) = mpsc::unbounded_channel::<Json>();
    let io: Option<Outbox> = sse_ok.then(|| {
        Arc::new(move |m: &Json| {
            let _ = tx.send(m.clone());
        }) as Outbox
    });
    let principal = to.principal.clone();
    let task = tokio::task::spawn_blocking(move || session.handle_as(msg, io.as_ref(), &principal));
    match rx.recv().await {
        None => match task.await {
            Ok(reply) => plain_reply_as(st, created, sid, reply.map(&out), json_ok, modern),
            Err(_) => rpc_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                code::INTERNAL_ERROR,
                "the request's worker failed",
            ),
        },
        Some(first) => {
            let rest = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
            let reply = stream::once(async move { task.await.ok().flatten() })
                .filter_map(|r| async move { r });
            let all = stream::once(async move { first })
                .chain(rest)
                .chain(reply)
                .map(move |m| Ok::<_, Infallible>(message_event(&out(m))));
            Sse::new(all).into_response()
        }
    }
}

/// A sandbox session's call it may not make ([`Scoped::refused_call`]), answered here: an
/// `isError` tool result naming why (nothing for a notification); a batch holding one is
/// refused whole. `None` lets the message through.
pub(crate) fn refuse_scoped(s: &Scoped, msg: &Json) -> Option<Option<Json>> {
    if let Json::Array(items) = msg {
        let why = items.iter().find_map(|m| s.refused_call(m))?;
        return Some(Some(json!({"jsonrpc": "2.0", "id": null,
            "error": {"code": code::INVALID_REQUEST, "message": format!("the batch was refused: {why}")}})));
    }
    let why = s.refused_call(msg)?;
    Some(msg.get("id").map(|id| {
        json!({"jsonrpc": "2.0", "id": id, "result": {
            "content": [{"type": "text", "text": why}], "isError": true}})
    }))
}

/// A reply to the `initialize` that opened a session names it in `Mcp-Session-Id`.
fn with_session_header(mut res: Response, created: bool, sid: &str) -> Response {
    if created {
        if let Ok(v) = HeaderValue::from_str(sid) {
            res.headers_mut().insert(SESSION_HEADER, v);
        }
    }
    res
}

/// Whether a request can run in place on the reactor's worker: only when no tool may ask the
/// client something mid-call (the conformance fixtures do) and no progress is to be streamed.
pub(crate) fn runs_inline(st: &AppState, msg: &Json) -> bool {
    fn progress(m: &Json) -> bool {
        m.pointer("/params/_meta/progressToken").is_some()
    }
    let wants_progress = match msg {
        Json::Array(items) => items.iter().any(progress),
        m => progress(m),
    };
    !st.config.conformance_fixtures
        && !wants_progress
        && tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread
}

/// [`plain_reply`], with the status of a modern-era reply when `modern`.
pub(crate) fn plain_reply_as(
    st: &AppState,
    created: bool,
    sid: &str,
    reply: Option<Json>,
    json_ok: bool,
    modern: bool,
) -> Response {
    match reply {
        Some(r) if modern && json_ok => (
            super::mcp_modern::status_of(&r),
            [(header::CONTENT_TYPE, "application/json")],
            valem_mcp::wire::to_string(&r),
        )
            .into_response(),
        r => plain_reply(st, created, sid, r, json_ok),
    }
}

/// The answer to a request that emitted nothing: JSON (or one SSE event), 202 for no reply.
fn plain_reply(
    st: &AppState,
    created: bool,
    sid: &str,
    reply: Option<Json>,
    json_ok: bool,
) -> Response {
    if created && reply.as_ref().is_none_or(|r| r.get("error").is_some()) {
        // A failed initialize opens nothing.
        st.sessions.remove(sid);
    }
    match reply {
        None => StatusCode::ACCEPTED.into_response(),
        Some(r) if json_ok => (
            [(header::CONTENT_TYPE, "application/json")],
            valem_mcp::wire::to_string(&r),
        )
            .into_response(),
        Some(r) => Sse::new(stream::iter([Ok::<_, Infallible>(message_event(&r))])).into_response(),
    }
}

fn open_session(
    st: &AppState,
    scope: Option<Scoped>,
) -> Result<(String, Arc<HttpSession>), Response> {
    if st.sessions.len() >= st.sessions.max {
        st.sessions.reap();
        if st.sessions.len() >= st.sessions.max {
            return Err(rpc_error(
                StatusCode::SERVICE_UNAVAILABLE,
                code::INTERNAL_ERROR,
                format!(
                    "too many MCP sessions ({}); end unused sessions with DELETE /mcp",
                    st.sessions.max
                ),
            ));
        }
    }
    let Some(sid) = new_session_id() else {
        return Err(rpc_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            code::INTERNAL_ERROR,
            "no randomness available for a session id",
        ));
    };
    let out: Arc<Mutex<Outbound>> = Arc::default();
    let sink = out.clone();
    let strip = scope.clone();
    let outbox: Outbox = Arc::new(move |msg: &Json| {
        let msg = &match &strip {
            Some(s) => {
                let mut m = msg.clone();
                s.strip(&mut m);
                m
            }
            None => msg.clone(),
        };
        let Ok(mut o) = sink.lock() else { return };
        o.streams.retain(|s| !s.is_closed());
        // Round-robin: the first live stream takes it, then goes to the back.
        if !o.streams.is_empty() {
            let s = o.streams.remove(0);
            let ok = s.send(msg.clone()).is_ok();
            o.streams.push(s);
            if ok {
                return;
            }
        }
        if o.pending.len() >= PENDING_MAX {
            o.pending.pop_front();
        }
        o.pending.push_back(msg.clone());
    });
    let session = Session::new(st.mcp.clone(), outbox);
    let hs = Arc::new(HttpSession {
        session,
        scope,
        out,
        last_used: Mutex::new(Instant::now()),
        relayed: Mutex::default(),
    });
    if let Ok(mut m) = st.sessions.map.lock() {
        m.insert(sid.clone(), hs.clone());
    }
    Ok((sid, hs))
}

/// GET and DELETE are not part of the modern era: 405 when the request names it.
fn refuse_modern(headers: &HeaderMap, verb: &str) -> Option<Response> {
    let v = headers.get(VERSION_HEADER)?.to_str().ok()?;
    valem_mcp::modern::MODERN_VERSIONS.contains(&v).then(|| {
        let mut r = rpc_error(
            StatusCode::METHOD_NOT_ALLOWED,
            code::INVALID_REQUEST,
            format!(
                "{verb} /mcp is not part of MCP {v}: POST each request; POST                  subscriptions/listen for change notifications"
            ),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        r
    })
}

async fn get_mcp(State(st): State<AppState>, headers: HeaderMap) -> Response {
    if let Some(r) = refuse_modern(&headers, "GET") {
        return r;
    }
    if let Err(r) = check_version(&headers, None) {
        return r;
    }
    if !accepts(&headers, "text/event-stream") {
        return rpc_error(
            StatusCode::NOT_ACCEPTABLE,
            code::INVALID_REQUEST,
            "Not Acceptable: GET /mcp opens a text/event-stream",
        );
    }
    let (_, hs) = match session_of(&st, &headers) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let (tx, rx) = mpsc::unbounded_channel::<Json>();
    if let Ok(mut o) = hs.out.lock() {
        while let Some(m) = o.pending.pop_front() {
            let _ = tx.send(m);
        }
        o.streams.push(tx);
    }
    let stop = st.shutdown.clone();
    Sse::new(event_stream(rx, stop))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

pub(crate) fn message_event(m: &Json) -> SseEvent {
    SseEvent::default()
        .event("message")
        .data(valem_mcp::wire::to_string(m))
}

/// Messages as SSE `message` events until the session, the client or the daemon goes away.
fn event_stream(
    rx: mpsc::UnboundedReceiver<Json>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold((rx, stop), |(mut rx, mut stop)| async move {
        if *stop.borrow() {
            return None;
        }
        tokio::select! {
            m = rx.recv() => m.map(|m| (m, (rx, stop))),
            _ = stop.changed() => None,
        }
    })
    .map(|m| Ok(message_event(&m)))
}

async fn delete_mcp(State(st): State<AppState>, headers: HeaderMap) -> Response {
    if let Some(r) = refuse_modern(&headers, "DELETE") {
        return r;
    }
    let (sid, _) = match session_of(&st, &headers) {
        Ok(x) => x,
        Err(r) => return r,
    };
    st.sessions.remove(&sid);
    StatusCode::OK.into_response()
}
