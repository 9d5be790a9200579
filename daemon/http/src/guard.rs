//! The request guard: DNS-rebinding protection (`Host`, `Origin`) and the API key.
//!
//! - `Host` must name a loopback host (`localhost`, `127.0.0.1`, `[::1]`, any port) or one of
//!   `--allowed-hosts`; otherwise 403. A page served from another name that resolves to us
//!   (DNS rebinding) is refused before it reaches a handler.
//! - `Origin`, when present, must be a loopback origin or one of `--allowed-origins`; otherwise
//!   403. Requests without `Origin` (non-browser clients) pass.
//! - With an API key configured every request must carry `Authorization: Bearer <key>`;
//!   otherwise 401. Compared in constant time. Only the WebSocket handshake
//!   (`GET /models/{id}/subscribe`), which browsers cannot give headers, may pass it as
//!   `?token=`; anywhere else a query key is refused (401 saying so), since URLs end up in
//!   logs, histories and `Referer`s. An accepted query key is removed from the request's URI
//!   before anything after the guard (handlers, logs, traces) sees it.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use serde_json::json;
use valem_service::egress::host_name;

use super::{error_response, AppState, Config};

pub async fn guard(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if req.uri().path() == "/healthz" {
        return next.run(req).await;
    }
    // A live session token is looked up once, here; the request carries its scope on for
    // [`super::sandbox::scope`]. The sandbox page and the browser's half of pairing need no
    // API key, and the token stands in for it on the paths it opens.
    let scoped = super::sandbox::session_token(&req)
        .and_then(|t| st.pairings.session(&t))
        .map(|ns| super::sandbox::Scoped { ns });
    let path = req.uri().path();
    let keyless = super::sandbox::is_public(req.method(), path)
        || (scoped.is_some() && super::sandbox::session_may_use(path));
    if let Err(r) = check(&st.config, req.method(), req.headers(), req.uri(), keyless) {
        st.metrics.rejected(r.status().as_u16());
        return r;
    }
    let mut req = req;
    if let Some(uri) = without_param(req.uri(), "token") {
        *req.uri_mut() = uri;
    }
    if let Some(s) = scoped {
        req.extensions_mut().insert(s);
    }
    next.run(req).await
}

fn check(
    cfg: &Config,
    method: &Method,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    keyless: bool,
) -> Result<(), Response> {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()));
    match host {
        Some(h) if host_allowed(cfg, h) => {}
        Some(h) => {
            return Err(forbidden(format!(
                "Host `{h}` is not allowed (DNS-rebinding protection); use a loopback address or start the daemon with --allowed-hosts {}",
                host_name(h)
            )))
        }
        None => return Err(forbidden("a Host header is required".to_string())),
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let o = origin.to_str().unwrap_or("");
        if !origin_allowed(cfg, o) {
            return Err(forbidden(format!(
                "Origin `{o}` is not allowed; start the daemon with --allowed-origins {o} to admit it"
            )));
        }
    }
    if let Some(key) = cfg.api_key.as_ref().filter(|_| !keyless) {
        let query = query_token(uri);
        let presented = bearer(headers).or(query.filter(|_| is_ws_handshake(method, uri)));
        match presented {
            Some(p) if constant_time_eq(p.as_bytes(), key.as_bytes()) => {}
            Some(_) => return Err(unauthorized("the API key is wrong")),
            None if query.is_some() => {
                return Err(unauthorized(
                    "`?token=` is accepted on the WebSocket handshake (GET /models/{id}/subscribe) only: send `Authorization: Bearer <key>`",
                ))
            }
            None => {
                return Err(unauthorized(
                    "an API key is required: send `Authorization: Bearer <key>`",
                ))
            }
        }
    }
    Ok(())
}

fn forbidden(message: String) -> Response {
    error_response(
        StatusCode::FORBIDDEN,
        json!({"error": "Forbidden", "message": message}),
    )
}

fn unauthorized(message: &str) -> Response {
    let mut r = error_response(
        StatusCode::UNAUTHORIZED,
        json!({"error": "Unauthorized", "message": message}),
    );
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Bearer"),
    );
    r
}

fn is_loopback_name(name: &str) -> bool {
    let n = name.trim_end_matches('.').to_ascii_lowercase();
    n == "localhost"
        || n.ends_with(".localhost")
        || n == "[::1]"
        || n.parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn host_allowed(cfg: &Config, h: &str) -> bool {
    let name = host_name(h);
    is_loopback_name(name)
        || cfg
            .allowed_hosts
            .iter()
            .any(|a| a == "*" || a.eq_ignore_ascii_case(name) || a.eq_ignore_ascii_case(h))
}

fn origin_allowed(cfg: &Config, o: &str) -> bool {
    if cfg
        .allowed_origins
        .iter()
        .any(|a| a == "*" || a.trim_end_matches('/').eq_ignore_ascii_case(o))
    {
        return true;
    }
    // A loopback origin: http(s)://<loopback name>[:port], nothing after.
    let Some(rest) = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"))
    else {
        return false;
    };
    !rest.contains('/') && is_loopback_name(host_name(rest))
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// `?token=` of the WebSocket handshake (browsers cannot set headers on it).
fn query_token(uri: &axum::http::Uri) -> Option<&str> {
    query_param(uri, "token")
}

/// The WebSocket handshake, the one request that may carry the key in its query.
fn is_ws_handshake(method: &Method, uri: &axum::http::Uri) -> bool {
    let path = uri.path();
    method == Method::GET
        && path
            .strip_prefix("/models/")
            .and_then(|rest| rest.strip_suffix("/subscribe"))
            .is_some_and(|id| !id.is_empty() && !id.contains('/'))
}

/// `uri` without any `name=` query parameter, or `None` when it has none.
fn without_param(uri: &axum::http::Uri, name: &str) -> Option<axum::http::Uri> {
    let q = uri.query()?;
    let named = |kv: &&str| kv.split_once('=').map_or(*kv, |(k, _)| k) == name;
    if !q.split('&').any(|kv| named(&kv)) {
        return None;
    }
    let kept: Vec<&str> = q.split('&').filter(|kv| !named(kv)).collect();
    let pq = if kept.is_empty() {
        uri.path().to_string()
    } else {
        format!("{}?{}", uri.path(), kept.join("&"))
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(pq.parse().ok()?);
    axum::http::Uri::from_parts(parts).ok()
}

pub(super) fn query_param<'a>(uri: &'a axum::http::Uri, name: &str) -> Option<&'a str> {
    uri.query()?.split('&').find_map(|kv| {
        kv.split_once('=')
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| v)
    })
}

pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config {
            allowed_origins: vec!["https://app.example".into()],
            allowed_hosts: vec!["valem.internal".into()],
            ..Config::default()
        }
    }

    #[test]
    fn hosts() {
        let c = cfg();
        for ok in [
            "localhost",
            "localhost:8080",
            "127.0.0.1:1",
            "127.5.6.7",
            "[::1]:8080",
            "valem.internal:8080",
            "LOCALHOST",
        ] {
            assert!(host_allowed(&c, ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "10.0.0.1:8080",
            "127.0.0.1.evil.example",
            "[::2]:80",
        ] {
            assert!(!host_allowed(&c, bad), "{bad}");
        }
    }

    #[test]
    fn origins() {
        let c = cfg();
        for ok in [
            "http://localhost:3000",
            "http://127.0.0.1",
            "https://[::1]:8443",
            "https://app.example",
        ] {
            assert!(origin_allowed(&c, ok), "{ok}");
        }
        for bad in [
            "https://evil.example",
            "null",
            "http://localhost.evil.example",
            "http://localhost:3000/x",
            "ftp://localhost",
            "https://app.example.evil",
        ] {
            assert!(!origin_allowed(&c, bad), "{bad}");
        }
    }

    #[test]
    fn tokens() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert_eq!(bearer(&h), Some("s3cret"));
        let uri: axum::http::Uri = "/models/a/subscribe?paths=$.a&token=k".parse().unwrap();
        assert_eq!(query_token(&uri), Some("k"));
        assert!(is_ws_handshake(&Method::GET, &uri));
        assert_eq!(
            without_param(&uri, "token").map(|u| u.to_string()),
            Some("/models/a/subscribe?paths=$.a".into())
        );
        let only: axum::http::Uri = "/models/a/subscribe?token=k".parse().unwrap();
        assert_eq!(
            without_param(&only, "token").map(|u| u.to_string()),
            Some("/models/a/subscribe".into())
        );
        assert_eq!(without_param(&only, "paths"), None);
        for not_ws in [
            "/models/a/state?token=k",
            "/models/a/x/subscribe?token=k",
            "/models//subscribe?token=k",
            "/mcp?token=k",
        ] {
            let u: axum::http::Uri = not_ws.parse().unwrap();
            assert!(!is_ws_handshake(&Method::GET, &u), "{not_ws}");
        }
        assert!(!is_ws_handshake(&Method::POST, &uri));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
