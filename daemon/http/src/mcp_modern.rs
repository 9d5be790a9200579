//! `/mcp` in the modern era (MCP 2026-07-28): a POST whose body names its protocol version in
//! `_meta` (or whose `MCP-Protocol-Version` header names a modern revision) is served without a
//! session. Its standard headers must agree with the body (`MCP-Protocol-Version`,
//! `Mcp-Method`, and `Mcp-Name` for `tools/call`, `resources/read` and `prompts/get`; a value
//! may be in the `=?base64?…?=` form): a missing or contradicting one is refused with `400` and
//! `HeaderMismatch` (-32020). An unsupported version is `400` with
//! `UnsupportedProtocolVersionError` (-32022), an unknown method `404` with -32601.
//! `subscriptions/listen` is answered with a long-lived SSE stream: the acknowledgement, then
//! the change notifications it asked for. A sandbox session's token scopes the request as it
//! scopes a legacy session.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value as Json};
use tokio::sync::mpsc;

use super::mcp::runs_inline;
use super::mcp::{message_event, plain_reply_as, refuse_scoped, reply_inline, reply_streamed};
use super::mcp::{Recipient, VERSION_HEADER};
use super::sandbox::Scoped;
use super::AppState;
use valem_mcp::modern::{self, codes};
use valem_mcp::{code, listen, Session};

pub(crate) const METHOD_HEADER: &str = "mcp-method";
pub(crate) const NAME_HEADER: &str = "mcp-name";

/// Does this POST speak the modern era? Its body names a version in `_meta` (or is
/// `server/discover`), or its `MCP-Protocol-Version` header names a modern revision.
pub(crate) fn is_modern(headers: &HeaderMap, msg: &Json) -> bool {
    let header_modern = headers
        .get(VERSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| modern::MODERN_VERSIONS.contains(&v));
    let body_modern = msg
        .get("method")
        .and_then(Json::as_str)
        .is_some_and(|m| modern::selects_modern(m, msg.get("params").unwrap_or(&Json::Null)));
    header_modern || body_modern
}

/// The HTTP status a modern reply travels with: 400 for the errors that say the request
/// itself was wrong for this server, 404 for an unknown method, else 200.
pub(crate) fn status_of(reply: &Json) -> StatusCode {
    match reply.pointer("/error/code").and_then(Json::as_i64) {
        Some(codes::HEADER_MISMATCH)
        | Some(codes::UNSUPPORTED_PROTOCOL_VERSION)
        | Some(codes::MISSING_REQUIRED_CLIENT_CAPABILITY)
        | Some(code::PARSE_ERROR)
        | Some(code::INVALID_REQUEST) => StatusCode::BAD_REQUEST,
        Some(code::METHOD_NOT_FOUND) => StatusCode::NOT_FOUND,
        _ => StatusCode::OK,
    }
}

fn rpc(status: StatusCode, id: &Json, code: i64, message: String) -> Response {
    let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}});
    (status, axum::Json(body)).into_response()
}

/// A header value in its plain or `=?base64?…?=` form, decoded; `Err` names what is wrong.
fn header_text(headers: &HeaderMap, name: &str) -> Result<Option<String>, String> {
    let Some(v) = headers.get(name) else {
        return Ok(None);
    };
    let raw = v
        .to_str()
        .map_err(|_| format!("the {name} header holds bytes that are not visible ASCII"))?
        .trim_matches([' ', '\t']);
    match raw
        .strip_prefix("=?base64?")
        .and_then(|r| r.strip_suffix("?="))
    {
        Some(b64) => {
            if b64.len() % 4 != 0 {
                return Err(format!(
                    "the {name} header's base64 value is not padded to a multiple of 4"
                ));
            }
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| format!("the {name} header's base64 value does not decode: {e}"))?;
            String::from_utf8(bytes)
                .map(Some)
                .map_err(|_| format!("the {name} header's base64 value is not UTF-8"))
        }
        None => Ok(Some(raw.to_string())),
    }
}

/// The standard headers agree with the body; the `HeaderMismatch` refusal otherwise.
/// The `HeaderMismatch` refusal (400) of request `msg`.
fn mismatch_of(msg: &Json) -> impl Fn(String) -> Response + '_ {
    move |m: String| {
        rpc(
            StatusCode::BAD_REQUEST,
            msg.get("id").unwrap_or(&Json::Null),
            codes::HEADER_MISMATCH,
            format!("Header mismatch: {m}"),
        )
    }
}

fn check_headers(headers: &HeaderMap, msg: &Json) -> Result<(), Response> {
    let mismatch = mismatch_of(msg);
    let method = msg.get("method").and_then(Json::as_str).unwrap_or("");
    let params = msg.get("params").unwrap_or(&Json::Null);
    let body_version = params
        .pointer("/_meta")
        .and_then(|m| m.get(modern::key::PROTOCOL_VERSION));
    match (headers.get(VERSION_HEADER), body_version) {
        (None, _) => {
            return Err(mismatch(
                "the MCP-Protocol-Version header is required on every request".into(),
            ))
        }
        (Some(h), Some(Json::String(b))) if h.to_str().ok() != Some(b.as_str()) => {
            return Err(mismatch(format!(
                "MCP-Protocol-Version header value '{}' does not match body value '{b}'",
                h.to_str().unwrap_or("?")
            )))
        }
        _ => {}
    }
    match header_text(headers, METHOD_HEADER) {
        Err(e) => return Err(mismatch(e)),
        Ok(None) => return Err(mismatch("the Mcp-Method header is required".into())),
        Ok(Some(h)) if h != method => {
            return Err(mismatch(format!(
                "Mcp-Method header value '{h}' does not match body value '{method}'"
            )))
        }
        Ok(Some(_)) => {}
    }
    let named = match method {
        "tools/call" | "prompts/get" => Some(("name", params.get("name"))),
        "resources/read" => Some(("uri", params.get("uri"))),
        "tasks/get" | "tasks/update" | "tasks/cancel" => Some(("taskId", params.get("taskId"))),
        _ => None,
    };
    if let Some((field, value)) = named {
        let body = value.and_then(Json::as_str);
        match header_text(headers, NAME_HEADER) {
            Err(e) => return Err(mismatch(e)),
            Ok(None) => {
                return Err(mismatch(format!(
                    "the Mcp-Name header is required on {method} (it carries params.{field})"
                )))
            }
            Ok(Some(h)) if Some(h.as_str()) != body => {
                return Err(mismatch(format!(
                    "Mcp-Name header value '{h}' does not match body value '{}'",
                    body.unwrap_or("")
                )))
            }
            Ok(Some(_)) => {}
        }
    }
    Ok(())
}

/// The tool's parameters that its input schema mirrors into `Mcp-Param-{Name}` headers
/// (`x-mcp-header`, reached through `properties` only): (header name, path of property names).
fn mirrored(schema: &Json) -> Vec<(String, Vec<String>)> {
    fn walk(s: &Json, path: &mut Vec<String>, out: &mut Vec<(String, Vec<String>)>) {
        let Some(props) = s.get("properties").and_then(Json::as_object) else {
            return;
        };
        for (k, p) in props {
            path.push(k.clone());
            if let Some(h) = p.get("x-mcp-header").and_then(Json::as_str) {
                out.push((h.to_string(), path.clone()));
            }
            walk(p, path, out);
            path.pop();
        }
    }
    let mut out = Vec::new();
    walk(schema, &mut Vec::new(), &mut out);
    out
}

/// `Mcp-Param-*` headers of a `tools/call` agree with the arguments they mirror.
fn check_params(headers: &HeaderMap, msg: &Json, schema: &Json) -> Result<(), Response> {
    let mismatch = mismatch_of(msg);
    for (name, path) in mirrored(schema) {
        let mut v = msg.pointer("/params/arguments");
        for k in &path {
            v = v.and_then(|x| x.get(k));
        }
        let header = format!("mcp-param-{}", name.to_ascii_lowercase());
        let given = header_text(headers, &header).map_err(&mismatch)?;
        let body = match v {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Bool(b)) => Some(b.to_string()),
            Some(Json::Number(n)) => Some(n.to_string()),
            Some(_) => None,
        };
        match (given, body) {
            (None, None) => {}
            (Some(_), None) => {}
            (None, Some(_)) => {
                return Err(mismatch(format!(
                    "the Mcp-Param-{name} header is required: arguments.{} has a value",
                    path.join(".")
                )))
            }
            (Some(h), Some(b)) => {
                let same = h == b
                    || matches!((h.parse::<f64>(), b.parse::<f64>()), (Ok(x), Ok(y)) if x == y && v.is_some_and(Json::is_number));
                if !same {
                    return Err(mismatch(format!(
                        "Mcp-Param-{name} header value '{h}' does not match body value '{b}'"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Serve one modern POST (its body read and parsed, its Accept and Content-Type checked).
pub(crate) async fn post(
    st: &AppState,
    headers: &HeaderMap,
    scoped: Option<Scoped>,
    mut msg: Json,
    json_ok: bool,
    sse_ok: bool,
) -> Response {
    if !msg.is_object() {
        return rpc(
            StatusCode::BAD_REQUEST,
            &Json::Null,
            code::INVALID_REQUEST,
            "Invalid Request: MCP 2026-07-28 has no JSON-RPC batches; send one message per POST"
                .into(),
        );
    }
    if msg.get("id").is_none() {
        // No client notification is defined over HTTP in this era (closing a stream cancels):
        // accepted and dropped, never handed to a session.
        return StatusCode::ACCEPTED.into_response();
    }
    // In this order: `_meta` lacking what the era requires (-32602), headers that disagree
    // with the body (-32020), a version we do not speak (-32022); each a 400.
    let method = msg.get("method").and_then(Json::as_str).unwrap_or("");
    let id = msg.get("id").cloned().unwrap_or(Json::Null);
    let meta = modern::read_meta(method, msg.get("params").unwrap_or(&Json::Null), &id);
    if let Err(e) = &meta {
        if e.pointer("/error/code").and_then(Json::as_i64) == Some(code::INVALID_PARAMS) {
            return (StatusCode::BAD_REQUEST, axum::Json(e.clone())).into_response();
        }
    }
    if let Err(r) = check_headers(headers, &msg) {
        return r;
    }
    if let Err(e) = meta {
        return (StatusCode::BAD_REQUEST, axum::Json(e)).into_response();
    }
    if let Some(schema) = tool_schema(st, &msg) {
        if let Err(r) = check_params(headers, &msg, schema) {
            return r;
        }
    }
    if let Some(s) = &scoped {
        if let Some(r) = refuse_scoped(s, &msg) {
            let r = r.unwrap_or(Json::Null);
            return (status_of(&r), axum::Json(r)).into_response();
        }
    }
    let request = msg.clone();
    if let Some(s) = &scoped {
        s.inbound_rpc(&mut msg);
    }
    let scope = scoped.clone();
    let out = move |mut r: Json| {
        if let Some(s) = &scope {
            s.outbound_rpc(&request, &mut r);
        }
        r
    };
    let session = st.sessions.stateless(st);
    if msg.get("method").and_then(Json::as_str) == Some("subscriptions/listen") {
        return listen_stream(st, msg, scoped);
    }
    if let Some(call) = session.call_deferred(&msg) {
        let reply = call.await.map(&out);
        return plain_reply_as(st, false, "", reply, json_ok, true);
    }
    let principal = scoped.as_ref().map(|s| s.ns.clone()).unwrap_or_default();
    let to = Recipient {
        st,
        created: false,
        sid: "",
        json_ok,
        sse_ok,
        modern: true,
        principal,
    };
    if runs_inline(st, &msg) {
        reply_inline(session, msg, to, out)
    } else {
        reply_streamed(session, msg, to, out).await
    }
}

/// The input schema of the tool a `tools/call` names, when it mirrors a parameter into a
/// header (fixtures included).
fn tool_schema<'a>(st: &'a AppState, msg: &Json) -> Option<&'a Json> {
    if st.mcp.mirrored.is_empty() || msg.get("method").and_then(Json::as_str) != Some("tools/call")
    {
        return None;
    }
    let name = msg.pointer("/params/name").and_then(Json::as_str)?;
    st.mcp.mirrored.get(name)
}

/// Counts the open listen streams; its drop (the stream ended) gives the place back.
struct ListenSlot {
    st: AppState,
    stop: Arc<AtomicBool>,
    /// In a fleet, the relays of the models it names that other nodes own (see `relay.rs`).
    _relays: Vec<crate::relay::RelayGuard>,
}

impl Drop for ListenSlot {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.st.sessions.listens.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `subscriptions/listen`: an SSE stream of the acknowledgement, then the notifications, until
/// the client closes it, its reader falls [`valem_mcp::LISTEN_QUEUE`] behind (an error response
/// ends it), or the daemon shuts down (the graceful completion result ends it).
fn listen_stream(st: &AppState, msg: Json, scoped: Option<Scoped>) -> Response {
    let id = msg.get("id").cloned().unwrap_or(Json::Null);
    let params = msg.get("params").cloned().unwrap_or(Json::Null);
    if let Err(e) = modern::read_meta("subscriptions/listen", &params, &id) {
        return (status_of(&e), axum::Json(e)).into_response();
    }
    let filter = match listen::Filter::parse(&params) {
        Ok(f) => Arc::new(match &scoped {
            Some(s) => f.within(s.prefix()),
            None => f,
        }),
        Err(why) => {
            return rpc(StatusCode::OK, &id, code::INVALID_PARAMS, why);
        }
    };
    let max = st.sessions.max_listens();
    if st
        .sessions
        .listens
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < max).then_some(n + 1)
        })
        .is_err()
    {
        return rpc(
            StatusCode::SERVICE_UNAVAILABLE,
            &id,
            code::INTERNAL_ERROR,
            format!("too many open subscriptions/listen streams ({max}); close one first"),
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let closed = stop.clone();
    let relays = match &scoped {
        None => filter
            .models()
            .filter_map(|m| st.relays.watch(st, m))
            .collect(),
        Some(_) => Vec::new(),
    };
    let slot = ListenSlot {
        st: st.clone(),
        stop: stop.clone(),
        _relays: relays,
    };
    let (tx, rx) = mpsc::channel::<listen::Notice>(valem_mcp::LISTEN_QUEUE);
    let full = Arc::new(AtomicBool::new(false));
    let sink_full = full.clone();
    let owner = scoped.as_ref().map(|s| s.ns.clone()).unwrap_or_default();
    let sink: listen::Sink = Arc::new(move |n| {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        match tx.try_send(n) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                sink_full.store(true, Ordering::SeqCst);
                false
            }
            Err(_) => false,
        }
    });
    listen::attach(
        &st.service,
        &st.mcp.tasks,
        &owner,
        filter.clone(),
        sink,
        closed,
    );
    st.metrics
        .mcp_listens_opened
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let strip = move |mut m: Json| {
        if let Some(s) = &scoped {
            s.strip(&mut m);
        }
        m
    };
    let ack = strip(listen::acknowledgement(&id, &filter));
    let shutdown = st.shutdown.clone();
    let metrics = st.metrics.clone();
    let notices = stream::unfold(
        (rx, shutdown, Some(slot), id.clone()),
        move |(mut rx, mut stop, slot, sub)| {
            let full = full.clone();
            let metrics = metrics.clone();
            async move {
                let slot = slot?;
                if *stop.borrow() {
                    return Some((listen::closed(&sub), (rx, stop, None, sub)));
                }
                tokio::select! {
                    n = rx.recv() => match n {
                        Some(n) => Some((listen::notification(&sub, &n), (rx, stop, Some(slot), sub))),
                        None if full.load(Ordering::SeqCst) => {
                            metrics.mcp_listens_overflowed.fetch_add(1, Ordering::Relaxed);
                            Some((listen::overflowed(&sub, valem_mcp::LISTEN_QUEUE), (rx, stop, None, sub)))
                        }
                        None => None,
                    },
                    _ = stop.changed() => Some((listen::closed(&sub), (rx, stop, None, sub))),
                }
            }
        },
    )
    .map(strip);
    let all = stream::once(async move { ack })
        .chain(notices)
        .map(|m| Ok::<_, Infallible>(message_event(&m)));
    let mut res = Sse::new(all)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response();
    res.headers_mut().insert(
        "x-accel-buffering",
        axum::http::HeaderValue::from_static("no"),
    );
    res
}

/// The session every modern request of a daemon is served by: it holds no per-client state
/// (a modern request carries what it needs), so one is shared.
pub(crate) fn stateless_session(st: &AppState) -> Arc<Session> {
    Session::new(st.mcp.clone(), Arc::new(|_: &Json| {}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn call(name: &str) -> Json {
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name,
            "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}})
    }

    #[test]
    fn headers_must_agree_with_the_body() {
        let ok = [
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "mutate"),
        ];
        assert!(check_headers(&headers(&ok), &call("mutate")).is_ok());
        // The name in the base64 sentinel form.
        let b64 = [
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "=?base64?bXV0YXRl?="),
        ];
        assert!(check_headers(&headers(&b64), &call("mutate")).is_ok());
        let spaced = [
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "  mutate  "),
        ];
        assert!(check_headers(&headers(&spaced), &call("mutate")).is_ok());
        for bad in [
            &ok[1..],                                          // no version header
            &[ok[0], ok[2]][..],                               // no Mcp-Method
            &ok[..2],                                          // no Mcp-Name
            &[ok[0], ("mcp-method", "tools/list"), ok[2]][..], // method differs
            &[ok[0], ok[1], ("mcp-name", "get_state")][..],    // name differs
            &[("mcp-protocol-version", "2025-11-25"), ok[1], ok[2]][..],
            &[ok[0], ok[1], ("mcp-name", "=?base64?!!?=")][..],
            &[ok[0], ok[1], ("mcp-name", "=?base64?bXV0YXRlcw?=")][..], // unpadded
            &[ok[0], ok[1], ("mcp-name", "=?base64?bXV0YXRlcw==?=")][..], // another name
        ] {
            let r = check_headers(&headers(bad), &call("mutate")).unwrap_err();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn mirrored_parameters_must_match_their_headers() {
        let schema = json!({"type": "object", "properties": {
            "region": {"type": "string", "x-mcp-header": "Region"},
            "opts": {"type": "object", "properties": {"n": {"type": "integer", "x-mcp-header": "N"}}}}});
        let msg = |args: Json| {
            json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {"name": "t", "arguments": args}})
        };
        let h = |p: &[(&str, &str)]| headers(p);
        let ok = check_params(
            &h(&[("mcp-param-region", "eu"), ("mcp-param-n", "42")]),
            &msg(json!({"region": "eu", "opts": {"n": 42}})),
            &schema,
        );
        assert!(ok.is_ok());
        // Numbers compare numerically; base64 values decode.
        assert!(check_params(
            &h(&[
                ("mcp-param-region", "=?base64?ZXU=?="),
                ("mcp-param-n", "42.0")
            ]),
            &msg(json!({"region": "eu", "opts": {"n": 42}})),
            &schema
        )
        .is_ok());
        // An absent argument needs no header.
        assert!(check_params(&h(&[]), &msg(json!({})), &schema).is_ok());
        for (hs, args) in [
            (vec![], json!({"region": "eu"})),
            (vec![("mcp-param-region", "us")], json!({"region": "eu"})),
            (
                vec![("mcp-param-region", "=?base64?ZXU?=")],
                json!({"region": "eu"}),
            ),
        ] {
            let r = check_params(&h(&hs), &msg(args), &schema).unwrap_err();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        }
    }

    /// A listen stream nobody reads: its queue fills, the sink gives up, and the stream ends
    /// with an error naming why; the metric counts it; writes never waited for it.
    #[test]
    fn an_unread_listen_stream_overflows_into_an_error() {
        use axum::body::{to_bytes, Body};
        use tower::ServiceExt;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let service =
                valem_service::ModelService::new(1, valem_service::ServiceLimits::default());
            let server = valem_mcp::Server::new(
                service.clone(),
                valem_mcp::guidance::Catalog::builtin(),
                valem_mcp::Mode::Daemon,
            );
            let (state, _stop) = AppState::new(crate::Config::default(), service, server);
            let app = crate::router(state.clone());
            let send = |path: &str, body: String, headers: &[(&str, &str)]| {
                let mut b = axum::http::Request::post(path)
                    .header("host", "127.0.0.1:8080")
                    .header("content-type", "application/json")
                    .header("accept", "application/json, text/event-stream");
                for (k, v) in headers {
                    b = b.header(*k, *v);
                }
                app.clone().oneshot(b.body(Body::from(body)).unwrap())
            };
            let r = send("/models", json!({"id": "m", "schema": {}}).to_string(), &[]).await;
            assert_eq!(r.unwrap().status(), 201);
            let listen = json!({"jsonrpc": "2.0", "id": "L", "method": "subscriptions/listen",
                "params": {"notifications": {"resourceSubscriptions": ["valem://state/m"]},
                    "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                        "io.modelcontextprotocol/clientCapabilities": {}}}});
            let res = send(
                "/mcp",
                listen.to_string(),
                &[
                    ("mcp-protocol-version", "2026-07-28"),
                    ("mcp-method", "subscriptions/listen"),
                ],
            )
            .await
            .unwrap();
            assert_eq!(res.status(), 200);
            // The body is not read while the writes go on.
            let n = valem_mcp::LISTEN_QUEUE + 50;
            for i in 0..n {
                let r = send("/models/m/mutations", json!({"$.i": i}).to_string(), &[]).await;
                assert_eq!(r.unwrap().status(), 200, "write {i}");
            }
            let body = to_bytes(res.into_body(), 64 << 20).await.unwrap();
            let text = String::from_utf8_lossy(&body);
            let updates = text.matches("notifications/resources/updated").count();
            assert_eq!(
                updates,
                valem_mcp::LISTEN_QUEUE,
                "the queue's worth, then the end"
            );
            assert!(text.contains("fell 1024 notifications behind"), "{text}");
            assert_eq!(
                state.metrics.mcp_listens_overflowed.load(Ordering::Relaxed),
                1
            );
            assert_eq!(state.sessions.listens.load(Ordering::Relaxed), 0);
        });
    }

    #[test]
    fn statuses_follow_the_error() {
        let e = |c: i64| json!({"error": {"code": c}});
        assert_eq!(
            status_of(&e(codes::UNSUPPORTED_PROTOCOL_VERSION)),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(status_of(&e(code::METHOD_NOT_FOUND)), StatusCode::NOT_FOUND);
        assert_eq!(status_of(&e(code::INVALID_PARAMS)), StatusCode::OK);
        assert_eq!(status_of(&json!({"result": {}})), StatusCode::OK);
    }

    #[test]
    fn the_era_is_read_from_the_body_or_the_header() {
        assert!(is_modern(&HeaderMap::new(), &call("x")));
        let legacy = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
        assert!(!is_modern(&HeaderMap::new(), &legacy));
        assert!(is_modern(
            &headers(&[("mcp-protocol-version", "2026-07-28")]),
            &legacy
        ));
        assert!(!is_modern(
            &headers(&[("mcp-protocol-version", "2025-11-25")]),
            &legacy
        ));
    }
}
