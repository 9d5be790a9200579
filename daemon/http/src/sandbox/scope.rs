//! Session scoping: a paired session's token opens only its own namespace; the middleware that
//! maps its model ids before routing, and the JSON-RPC rewriting of `/mcp` messages.

use super::*;

/// The session a request is scoped to (set by [`scope`]).
#[derive(Clone, Debug)]
pub struct Scoped {
    pub ns: String,
}

impl Scoped {
    pub fn prefix(&self) -> String {
        format!("{}{NS_SEP}", self.ns)
    }

    /// A model id of the agent's as stored.
    pub fn inner_id(&self, id: &str) -> String {
        format!("{}{NS_SEP}{id}", self.ns)
    }

    /// Every occurrence of the session prefix removed from the strings of `v` (object keys
    /// included). The namespace is random hex, so it appears nowhere else.
    pub fn strip(&self, v: &mut Json) {
        valem_service::scope::strip(v, &self.prefix());
    }

    /// A JSON-RPC message from a scoped MCP client: its model ids and state URIs namespaced.
    pub fn inbound_rpc(&self, msg: &mut Json) {
        if let Json::Array(items) = msg {
            for m in items {
                self.inbound_rpc(m);
            }
            return;
        }
        let method = msg
            .get("method")
            .and_then(|m| m.as_str())
            .unwrap_or("")
            .to_string();
        let Some(params) = msg.get_mut("params") else {
            return;
        };
        match method.as_str() {
            "tools/call" => {
                let name = params
                    .get("name")
                    .and_then(|n| n.as_str())
                    .unwrap_or("")
                    .to_string();
                let Some(args) = params.get_mut("arguments").and_then(|a| a.as_object_mut()) else {
                    return;
                };
                for key in ["id", "modelId"] {
                    if let Some(Json::String(s)) = args.get_mut(key) {
                        *s = self.inner_id(s);
                    }
                }
                if name == "create_model" {
                    if let Some(Json::String(s)) =
                        args.get_mut("spec").and_then(|s| s.get_mut("id"))
                    {
                        *s = self.inner_id(s);
                    }
                }
                if let Some(Json::String(s)) =
                    args.get_mut("snapshot").and_then(|s| s.get_mut("modelId"))
                {
                    *s = self.inner_id(s);
                }
            }
            "subscriptions/listen" => {
                let uris = params
                    .get_mut("notifications")
                    .and_then(|n| n.get_mut("resourceSubscriptions"))
                    .and_then(|u| u.as_array_mut());
                for uri in uris.into_iter().flatten() {
                    if let Json::String(u) = uri {
                        if let Some(model) = u.strip_prefix(valem_mcp::resources::STATE_PREFIX) {
                            *u = format!(
                                "{}{}",
                                valem_mcp::resources::STATE_PREFIX,
                                self.inner_id(model)
                            );
                        }
                    }
                }
            }
            "resources/read" | "resources/subscribe" | "resources/unsubscribe" => {
                if let Some(Json::String(uri)) = params.get_mut("uri") {
                    if let Some(model) = uri.strip_prefix(valem_mcp::resources::STATE_PREFIX) {
                        *uri = format!(
                            "{}{}",
                            valem_mcp::resources::STATE_PREFIX,
                            self.inner_id(model)
                        );
                    }
                }
            }
            _ => {}
        }
    }

    /// Why a scoped client may not make this call, if it may not: the blob store is the
    /// daemon's, not the session's, so a session reads a blob through a model of its own that
    /// references it and uploads none (REST refuses `/blobs…` to a session token likewise).
    pub fn refused_call(&self, msg: &Json) -> Option<String> {
        if msg.get("method").and_then(|m| m.as_str()) != Some("tools/call") {
            return None;
        }
        let args = msg.pointer("/params/arguments");
        match msg.pointer("/params/name").and_then(|n| n.as_str())? {
            // `modelId: null` is no model id either.
            "download_blob" if args.and_then(|a| a.get("modelId")?.as_str()).is_none() => Some(
                "download_blob needs `modelId` in a sandbox session: a session reads the blobs \
                 its own models reference"
                    .into(),
            ),
            "upload_blob" => Some(
                "upload_blob is not available to a sandbox session: the blob store is shared by \
                 every client of the daemon"
                    .into(),
            ),
            _ => None,
        }
    }

    /// A reply to a scoped client's request: `list_models` keeps the session's models only,
    /// then the prefix is stripped everywhere.
    pub fn outbound_rpc(&self, request: &Json, reply: &mut Json) {
        let lists_models = request.get("method").and_then(|m| m.as_str()) == Some("tools/call")
            && request.pointer("/params/name").and_then(|n| n.as_str()) == Some("list_models");
        if request.get("method").and_then(|m| m.as_str()) == Some("resources/list") {
            // Other models' state resources are not this session's to see.
            let own = format!("{}{}", valem_mcp::resources::STATE_PREFIX, self.prefix());
            if let Some(Json::Array(list)) = reply.pointer_mut("/result/resources") {
                list.retain(|r| {
                    r.get("uri").and_then(|u| u.as_str()).is_none_or(|u| {
                        !u.starts_with(valem_mcp::resources::STATE_PREFIX) || u.starts_with(&own)
                    })
                });
            }
        }
        if lists_models {
            if let Some(Json::Array(content)) = reply.pointer_mut("/result/content") {
                for block in content {
                    if let Some(Json::String(text)) = block.get_mut("text") {
                        if let Ok(mut list) = serde_json::from_str::<Json>(text) {
                            self.keep_own(&mut list);
                            *text = serde_json::to_string_pretty(&list).unwrap_or_default();
                        }
                    }
                }
            }
        }
        self.strip(reply);
    }

    /// Keep the entries of a model list (ids, or objects with an `id`) that are this session's.
    pub fn keep_own(&self, list: &mut Json) {
        let prefix = self.prefix();
        if let Json::Array(items) = list {
            items.retain(|m| {
                m.as_str()
                    .or_else(|| m.get("id").and_then(|i| i.as_str()))
                    .is_some_and(|id| id.starts_with(&prefix))
            });
        }
    }
}

/// Paths a session token opens (everything else still needs the API key, if one is set).
pub fn session_may_use(path: &str) -> bool {
    path == "/models"
        || path.starts_with("/models/")
        || path == "/mcp"
        || path == "/sandbox/session"
}

/// Paths open without the API key: the page and what the browser needs to approve a pairing
/// (the pair code is 128 random bits, the user code a second factor, attempts capped).
pub fn is_public(method: &axum::http::Method, path: &str) -> bool {
    let page = path == "/sandbox" || path == "/sandbox/" || path.starts_with("/sandbox/assets/");
    let browser = path == "/sandbox/pair/approve"
        || path == "/sandbox/pair/deny"
        || (method == axum::http::Method::GET
            && path.starts_with("/sandbox/pair/")
            && path != "/sandbox/pair/token");
    page || browser
}

/// The session token a request presents: `X-Session-Token`, or `?session=` on a WebSocket
/// handshake (browsers cannot set headers there).
pub fn session_token(req: &Request) -> Option<String> {
    if let Some(t) = req.headers().get(SESSION_HEADER) {
        return Some(t.to_str().unwrap_or("").trim().to_string());
    }
    if req.uri().path().ends_with("/subscribe") {
        return crate::guard::query_param(req.uri(), "session").map(str::to_string);
    }
    None
}

pub(super) fn unauthorized(message: &str) -> Response {
    error_response(
        StatusCode::UNAUTHORIZED,
        json!({"error": "Unauthorized", "message": message}),
    )
}

/// Before routing: scope a request that carries a session token to its session (the guard
/// looked the token up and left the [`Scoped`] on the request).
pub async fn scope(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    if session_token(&req).is_none() {
        return next.run(req).await;
    }
    let Some(scoped) = req.extensions().get::<Scoped>().cloned() else {
        return unauthorized(
            "the session token is unknown or its session ended; pair again (pair_browser)",
        );
    };
    let path = req.uri().path().to_string();
    if !session_may_use(&path) {
        return error_response(
            StatusCode::FORBIDDEN,
            json!({"error": "Forbidden", "message": format!("a session token does not grant {path}")}),
        );
    }
    let method = req.method().clone();
    // `/models/{id}…`: the id becomes the session's.
    if let Some(rest) = path.strip_prefix("/models/") {
        let (id, tail) = rest.split_once('/').map_or((rest, ""), |(a, b)| (a, b));
        let new_path = if tail.is_empty() {
            format!("/models/{}", scoped.inner_id(id))
        } else {
            format!("/models/{}/{tail}", scoped.inner_id(id))
        };
        let pq = match req.uri().query() {
            Some(q) => format!("{new_path}?{q}"),
            None => new_path,
        };
        if let Ok(uri) = pq.parse::<Uri>() {
            *req.uri_mut() = uri;
        }
    }
    // Create: the spec's id becomes the session's; restore: so does the snapshot's model id
    // (the session was handed it stripped). Every other id a spec names (`template.ref`, an
    // effect's `target.ref`) is resolved inside the namespace by the service.
    let body_id = if method != axum::http::Method::POST {
        None
    } else if path == "/models" {
        Some("id")
    } else if path.starts_with("/models/") && path.ends_with("/restore") {
        Some("modelId")
    } else {
        None
    };
    if let Some(field) = body_id {
        let (parts, body) = req.into_parts();
        let Ok(bytes) = axum::body::to_bytes(body, st.config.max_body_bytes).await else {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                json!({"error": "Payload too large", "message": "the request body is over --max-body-bytes"}),
            );
        };
        let bytes = match serde_json::from_slice::<Json>(&bytes) {
            Ok(mut v) => {
                if let Some(Json::String(s)) = v.get_mut(field) {
                    *s = scoped.inner_id(s);
                }
                Bytes::from(v.to_string())
            }
            // Not JSON: the handler reports it as it would unscoped.
            Err(_) => bytes,
        };
        let mut parts = parts;
        parts.headers.remove(header::CONTENT_LENGTH);
        req = Request::from_parts(parts, Body::from(bytes));
    }
    let res = next.run(req).await;
    if path == "/mcp" || path.ends_with("/subscribe") {
        // The MCP transport scopes its own messages; a WebSocket is a stream.
        return res;
    }
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/json"));
    if !is_json {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": "Internal error", "message": "the response could not be read"}),
        );
    };
    let Ok(mut v) = serde_json::from_slice::<Json>(&bytes) else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    if path == "/models" && method == axum::http::Method::GET {
        scoped.keep_own(&mut v);
    }
    scoped.strip(&mut v);
    if let Some(loc) = parts
        .headers
        .get(header::LOCATION)
        .and_then(|l| l.to_str().ok())
    {
        let stripped = loc.replace(&scoped.prefix(), "");
        if let Ok(h) = HeaderValue::from_str(&stripped) {
            parts.headers.insert(header::LOCATION, h);
        }
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(v.to_string()))
}
