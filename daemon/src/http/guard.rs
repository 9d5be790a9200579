//! The request guard: DNS-rebinding protection (`Host`, `Origin`) and the API key.
//!
//! - `Host` must name a loopback host (`localhost`, `127.0.0.1`, `[::1]`, any port) or one of
//!   `--allowed-hosts`; otherwise 403. A page served from another name that resolves to us
//!   (DNS rebinding) is refused before it reaches a handler.
//! - `Origin`, when present, must be a loopback origin or one of `--allowed-origins`; otherwise
//!   403. Requests without `Origin` (non-browser clients) pass.
//! - With an API key configured every request must carry `Authorization: Bearer <key>` (the
//!   WebSocket handshake may pass it as `?token=`); otherwise 401. Compared in constant time.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use serde_json::json;

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
    if let Err(r) = check(&st.config, req.headers(), req.uri(), keyless) {
        st.metrics.rejected(r.status().as_u16());
        return r;
    }
    let mut req = req;
    if let Some(s) = scoped {
        req.extensions_mut().insert(s);
    }
    next.run(req).await
}

fn check(
    cfg: &Config,
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
        let presented = bearer(headers).or_else(|| query_token(uri));
        match presented {
            Some(p) if constant_time_eq(p.as_bytes(), key.as_bytes()) => {}
            Some(_) => return Err(unauthorized("the API key is wrong")),
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

/// The host part of a `Host` value (`[::1]:8080` → `[::1]`, `localhost:80` → `localhost`).
pub fn host_name(h: &str) -> &str {
    if let Some(rest) = h.strip_prefix('[') {
        return match rest.find(']') {
            Some(i) => &h[..i + 2],
            None => h,
        };
    }
    h.rsplit_once(':').map_or(h, |(name, _)| name)
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
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
