//! A fleet's node forwards a request for a model another node owns: the request runs here
//! first; when the answer says another node owns the model (`ServiceError::Elsewhere`: a REST
//! `421`, or over `/mcp` a tool result with the owner's URL), the same request (method, path and
//! query, body, end-to-end headers) goes to the owner, carrying this daemon's API key when it
//! has one (else the client's `Authorization`), and the owner's answer is returned as it is.
//! Nothing ran here (the claim failed before the model was touched), so the request runs once.
//! A forwarded request carries `X-Valem-Forwarded` and is never forwarded again. Forwarded:
//! REST `/models…` and modern-era `/mcp` POSTs (WebSocket subscriptions are relayed by
//! `ws.rs`; a legacy MCP session, which lives on the node that opened it, sends its calls about
//! another node's model there as modern-era requests: [`legacy_call_elsewhere`]). Not
//! forwarded: a sandbox session's requests (their ids are rewritten per session), SSE answers. An owner that cannot be
//! reached answers 503 with `Retry-After` (its lease may still hold; once it runs out the next
//! request claims the model here).

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::{error_response, AppState};

/// Marks a request one node sent another.
pub(crate) const FORWARDED: &str = "x-valem-forwarded";
/// Names the node that answered (on every answer of a fleet's node).
pub(crate) const NODE: &str = "x-valem-node";

/// Largest owner answer relayed (a state or an audit page).
const MAX_ANSWER: u64 = 64 << 20;

/// REST model routes, and `/mcp` POSTs of the modern era (no session: each request stands
/// alone, so the owner can answer it as well as this node).
fn forwardable(req: &Request) -> bool {
    let path = req.uri().path();
    let rest = path == "/models" || path.starts_with("/models/");
    let mcp = path == "/mcp"
        && req.method() == Method::POST
        && !req.headers().contains_key("mcp-session-id");
    (rest || mcp)
        && !req.headers().contains_key(FORWARDED)
        && !req.headers().contains_key(header::UPGRADE)
        && !req.headers().contains_key("x-session-token")
}

/// The owner's URL when `answer` says the model is another node's: a REST 421, or a JSON-RPC
/// answer whose tool result is the `Owned by another node` error.
fn owner_of(status: StatusCode, answer: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(answer).ok()?;
    let url = if status == StatusCode::MISDIRECTED_REQUEST {
        v["ownerUrl"].as_str()
    } else if v["result"]["isError"] == json!(true) {
        v["result"]["structuredContent"]["ownerUrl"].as_str()
    } else {
        None
    }?;
    (url.starts_with("http://") || url.starts_with("https://")).then(|| url.to_string())
}

pub(crate) async fn forward(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(node) = st.service.store().and_then(|s| s.node_id()) else {
        return next.run(req).await;
    };
    let mut r = if forwardable(&req) {
        forward_misdirected(&st, req, next, &node).await
    } else {
        next.run(req).await
    };
    if !r.headers().contains_key(NODE) {
        if let Ok(v) = HeaderValue::from_str(&node) {
            r.headers_mut().insert(NODE, v);
        }
    }
    r
}

async fn forward_misdirected(st: &AppState, req: Request, next: Next, node: &str) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, st.config.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                json!({"error": "Payload too large", "message": format!("the body is over {} bytes (--max-body-bytes)", st.config.max_body_bytes)}),
            )
        }
    };
    let method = parts.method.clone();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_string(), |p| p.as_str().to_string());
    let headers = parts.headers.clone();
    let here = next
        .run(Request::from_parts(parts, Body::from(bytes.clone())))
        .await;
    // A REST 421, or a JSON answer of /mcp (an SSE stream is relayed as it is).
    let json_answer = here
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let misdirected = here.status() == StatusCode::MISDIRECTED_REQUEST
        || (path.starts_with("/mcp") && here.status() == StatusCode::OK && json_answer);
    if !misdirected {
        return here;
    }
    let (rparts, rbody) = here.into_parts();
    let Ok(answer) = axum::body::to_bytes(rbody, MAX_ANSWER as usize).await else {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": "Answer too large", "message": "this node's answer could not be read back"}),
        );
    };
    let Some(owner_url) = owner_of(rparts.status, &answer) else {
        return Response::from_parts(rparts, Body::from(answer));
    };
    let key = st.config.api_key.clone();
    let timeout = st.config.request_timeout;
    let node = node.to_string();
    let target = format!("{}{path}", owner_url.trim_end_matches('/'));
    let request_body = bytes.clone();
    let sent = tokio::task::spawn_blocking(move || {
        send(
            &method,
            &target,
            &headers,
            bytes.to_vec(),
            key,
            &node,
            timeout,
        )
    })
    .await;
    match sent {
        Ok(Ok(r)) => {
            st.metrics.forwarded(true);
            r
        }
        failed => {
            let why = match failed {
                Ok(Err(why)) => why,
                Err(e) => e.to_string(),
                Ok(Ok(_)) => String::new(),
            };
            st.metrics.forwarded(false);
            let message = format!("the model's owner at {owner_url} did not answer ({why}); once its lease runs out the next request takes the model over: retry in a second");
            // Over MCP a tool call gets a tool error an agent can read and act on (retry),
            // not an HTTP error its client turns into an exception.
            if path.starts_with("/mcp") {
                if let Some(r) = mcp_tool_error(&request_body, &message) {
                    return r;
                }
            }
            let mut r = error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"error": "Owner unreachable", "message": message, "ownerUrl": owner_url}),
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
    }
}

/// A legacy MCP session's `tools/call` about a model (`arguments.id`) that another node of the
/// fleet owns: the session lives here, the model there, so the call goes to the owner as a
/// request of the modern era (no session: any node answers one alone), with the call's own
/// `_meta` (an idempotency key among it) and this node's API key, and the owner's answer is
/// this session's (without the modern era's `resultType`). `None`: not such a call (a model
/// this node holds or may claim, another method, not a fleet's node), so it runs here.
pub(crate) async fn legacy_call_elsewhere(
    st: &AppState,
    msg: &serde_json::Value,
) -> Option<serde_json::Value> {
    use serde_json::Value as Json;
    let store = st.service.store()?;
    let node = store.node_id()?;
    if msg.get("method")?.as_str()? != "tools/call" {
        return None;
    }
    let id = msg
        .get("id")
        .filter(|i| i.is_string() || i.is_number())?
        .clone();
    let params = msg.get("params")?;
    let tool = params.get("name")?.as_str()?.to_string();
    let model = params.pointer("/arguments/id")?.as_str()?;
    if store.holds(model) {
        return None;
    }
    let owner_url = match st.service.info(&valem_service::ModelId::from(model)).await {
        Err(valem_service::ServiceError::Elsewhere { url, .. }) => url,
        _ => return None,
    };
    let mut meta = params
        .get("_meta")
        .and_then(Json::as_object)
        .cloned()
        .unwrap_or_default();
    meta.remove("progressToken");
    meta.insert(
        "io.modelcontextprotocol/protocolVersion".into(),
        json!(MODERN_VERSION),
    );
    meta.insert(
        "io.modelcontextprotocol/clientInfo".into(),
        json!({"name": format!("valem node {node}"), "version": env!("CARGO_PKG_VERSION")}),
    );
    meta.insert(
        "io.modelcontextprotocol/clientCapabilities".into(),
        json!({}),
    );
    let mut call_params = params.clone();
    call_params["_meta"] = Json::Object(meta);
    let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": call_params});
    let mut headers = HeaderMap::new();
    for (k, v) in [
        ("content-type", "application/json".to_string()),
        ("accept", "application/json".to_string()),
        ("mcp-protocol-version", MODERN_VERSION.to_string()),
        ("mcp-method", "tools/call".to_string()),
        ("mcp-name", tool),
    ] {
        if let Ok(v) = HeaderValue::from_str(&v) {
            headers.insert(header::HeaderName::from_static(k), v);
        }
    }
    let key = st.config.api_key.clone();
    let timeout = st.config.request_timeout;
    let target = format!("{}/mcp", owner_url.trim_end_matches('/'));
    let bytes = body.to_string().into_bytes();
    let sent = tokio::task::spawn_blocking(move || {
        send(&Method::POST, &target, &headers, bytes, key, &node, timeout)
    })
    .await;
    // The owner's JSON-RPC answer, whatever its HTTP status (the modern era answers some
    // errors with a 4xx).
    let (answer, why) = match sent {
        Ok(Ok(r)) => {
            let status = r.status();
            let body = axum::body::to_bytes(r.into_body(), MAX_ANSWER as usize).await;
            let rpc = body
                .ok()
                .and_then(|b| serde_json::from_slice::<Json>(&b).ok())
                .filter(|v| v.get("jsonrpc").is_some());
            (rpc, format!("HTTP {status} without a JSON-RPC answer"))
        }
        Ok(Err(e)) => (None, e),
        Err(e) => (None, e.to_string()),
    };
    st.metrics.forwarded(answer.is_some());
    let Some(mut answer) = answer else {
        let message = format!("the model's owner at {owner_url} did not answer ({why}); once its lease runs out the next request takes the model over: retry in a second");
        return Some(json!({"jsonrpc": "2.0", "id": id, "result": {
            "content": [{"type": "text", "text": message}], "isError": true}}));
    };
    if let Some(r) = answer.get_mut("result").and_then(Json::as_object_mut) {
        r.remove("resultType");
    }
    answer["id"] = id;
    Some(answer)
}

/// The revision a node speaks to another for a legacy session's call.
const MODERN_VERSION: &str = "2026-07-28";

/// The JSON-RPC answer to the `tools/call` in `request` that is a tool error saying `message`
/// (`None`: not a tool call).
fn mcp_tool_error(request: &[u8], message: &str) -> Option<Response> {
    let req: serde_json::Value = serde_json::from_slice(request).ok()?;
    if req["method"] != json!("tools/call") {
        return None;
    }
    let body = json!({
        "jsonrpc": "2.0",
        "id": req.get("id").cloned().unwrap_or(serde_json::Value::Null),
        "result": {
            "content": [{"type": "text", "text": message}],
            "isError": true,
        },
    });
    Some((StatusCode::OK, axum::Json(body)).into_response())
}

fn send(
    method: &Method,
    url: &str,
    headers: &HeaderMap,
    body: Vec<u8>,
    key: Option<String>,
    node: &str,
    timeout: std::time::Duration,
) -> Result<Response, String> {
    // One agent per daemon: its pool keeps the connections to the other nodes open.
    static AGENT: std::sync::OnceLock<ureq::Agent> = std::sync::OnceLock::new();
    let agent = AGENT.get_or_init(|| {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .proxy(None)
            .timeout_global(Some(timeout))
            .max_idle_connections_per_host(64)
            .build()
            .new_agent()
    });
    let mut b = ureq::http::Request::builder()
        .method(method.as_str())
        .uri(url)
        .header(FORWARDED, node);
    // End-to-end headers as the client sent them (MCP's era checks its own against the body);
    // not the connection's, the host's, the length (ureq sets them) or the credentials.
    for (name, v) in headers {
        let hop = matches!(
            name.as_str(),
            "host"
                | "connection"
                | "keep-alive"
                | "transfer-encoding"
                | "te"
                | "trailer"
                | "upgrade"
                | "proxy-authorization"
                | "proxy-connection"
                | "content-length"
                | "authorization"
                | "cookie"
                | FORWARDED
        );
        if !hop {
            b = b.header(name.as_str(), v.as_bytes());
        }
    }
    match key {
        Some(k) => b = b.header(header::AUTHORIZATION.as_str(), format!("Bearer {k}")),
        None => {
            if let Some(v) = headers.get(header::AUTHORIZATION) {
                b = b.header(header::AUTHORIZATION.as_str(), v.as_bytes());
            }
        }
    }
    let request = b.body(body).map_err(|e| e.to_string())?;
    let res = agent.run(request).map_err(|e| e.to_string())?;
    let status = StatusCode::from_u16(res.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut out_headers = HeaderMap::new();
    for name in [
        header::CONTENT_TYPE,
        header::LOCATION,
        header::RETRY_AFTER,
        header::CACHE_CONTROL,
        header::ETAG,
        header::HeaderName::from_static(NODE),
        header::HeaderName::from_static("idempotent-replayed"),
    ] {
        if let Some(v) = res
            .headers()
            .get(name.as_str())
            .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok())
        {
            out_headers.insert(name, v);
        }
    }
    let bytes = res
        .into_body()
        .with_config()
        .limit(MAX_ANSWER)
        .read_to_vec()
        .map_err(|e| format!("reading its answer: {e}"))?;
    let mut r = (status, bytes).into_response();
    r.headers_mut().extend(out_headers);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_is_read_from_a_421_or_an_mcp_tool_error() {
        let rest = br#"{"error":"Owned by another node","ownerUrl":"http://n1:8080"}"#;
        assert_eq!(
            owner_of(StatusCode::MISDIRECTED_REQUEST, rest).as_deref(),
            Some("http://n1:8080")
        );
        let mcp = br#"{"jsonrpc":"2.0","id":1,"result":{"isError":true,
            "structuredContent":{"ownerUrl":"http://n2:8080"}}}"#;
        assert_eq!(
            owner_of(StatusCode::OK, mcp).as_deref(),
            Some("http://n2:8080")
        );
        // Only http(s) URLs, and only from those two shapes.
        let odd = br#"{"ownerUrl":"file:///etc/passwd"}"#;
        assert_eq!(owner_of(StatusCode::MISDIRECTED_REQUEST, odd), None);
        assert_eq!(owner_of(StatusCode::OK, rest), None);
    }
}
