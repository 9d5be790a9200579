//! The browser sandbox (`/sandbox/`) and device-flow pairing (RFC 8628's shape) that lets an
//! agent and a browser tab share one live session.
//!
//! - `POST /sandbox/pair` (the agent; the API key when one is configured) mints a pairing:
//!   `{pairCode (128 bits), deviceSecret (256 bits), userCode ("BCDF-GHJK"), verificationUri,
//!   verificationUriComplete, expiresInSec, intervalSec}`. The links point at the page with the
//!   pair code (and, complete, the user code) in the URL fragment, which browsers never send.
//!   Mints are limited per client and in all ([`MintLimits`]): 429 with `Retry-After`.
//! - `GET /sandbox/pair/{pairCode}` (the page): `{status, expiresInSec}` only — never the code.
//! - `POST /sandbox/pair/approve {pairCode, userCode}` (the page, after a human clicked
//!   Approve): `{sessionToken, namespaceId}`; a wrong code is 403 with the attempts left, and
//!   after [`MAX_ATTEMPTS`] wrong codes or secrets the pairing is burned. `…/deny` refuses it.
//! - `POST /sandbox/pair/token {pairCode, deviceSecret}` (the agent polls): 200
//!   `{sessionToken, namespaceId}` once, after approval; 409 `authorization_pending` or
//!   `slow_down` (polled again within half the interval); 403 `access_denied`; 410
//!   `expired_token`; 400 `invalid_grant` for a wrong secret, an unknown code or a token already
//!   collected. Secrets and codes compare in constant time.
//! - `GET /sandbox/session` (`X-Session-Token`): the session's namespace and model ids.
//!
//! A request carrying `X-Session-Token` (the WebSocket handshake: `?session=`) is scoped to
//! its session by [`scope`], which runs before routing: model ids are namespaced
//! `<namespaceId>__<id>` on the way in and the prefix is stripped on the way out, `GET /models`
//! lists the session's models only, and the token replaces the API key for `/models…`, `/mcp`
//! and `/sandbox/session` (and nothing else). An unknown token is 401, never a fall-back to the
//! unscoped API. Over `/mcp`, a session reads a blob only with the `modelId` of a model of its
//! own that references it, and uploads none ([`Scoped::refused_call`]), as over REST.

mod pairing;
mod scope;

pub use pairing::*;
pub use scope::*;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value as Json};

use super::guard::constant_time_eq;
use super::{error_response, AppState};

pub use valem_service::scope::NS_SEP;

const INDEX_HTML: &str = include_str!("index.html");
const APP_JS: &str = include_str!("app.js");
const APP_CSS: &str = include_str!("app.css");

pub fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/sandbox",
            get(|| async { axum::response::Redirect::permanent("/sandbox/") }),
        )
        .route("/sandbox/", get(index))
        .route("/sandbox/assets/app.js", get(app_js))
        .route("/sandbox/assets/app.css", get(app_css))
        .route("/sandbox/pair", post(mint))
        .route("/sandbox/pair/approve", post(approve))
        .route("/sandbox/pair/deny", post(deny))
        .route("/sandbox/pair/token", post(token))
        .route("/sandbox/pair/{code}", get(peek))
        .route("/sandbox/session", get(session))
}

fn static_asset(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

async fn index() -> Response {
    static_asset(INDEX_HTML, "text/html; charset=utf-8")
}

async fn app_js() -> Response {
    static_asset(APP_JS, "text/javascript; charset=utf-8")
}

async fn app_css() -> Response {
    static_asset(APP_CSS, "text/css; charset=utf-8")
}

/// The base URL the agent reached us at (the links it hands the developer point there).
fn base_url(headers: &HeaderMap) -> String {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    format!("http://{host}")
}

async fn mint(
    State(st): State<AppState>,
    client: Option<axum::Extension<super::ClientAddr>>,
    headers: HeaderMap,
) -> Response {
    let client = ClientKey::of(client.map(|axum::Extension(c)| c.0));
    match st.pairings.mint(client) {
        Ok(m) => {
            let base = base_url(&headers);
            let uri = format!("{base}/sandbox/#pair={}", m.pair_code);
            let complete = format!("{uri}&code={}", m.user_code);
            no_store(json!({
                "pairCode": m.pair_code,
                "deviceSecret": m.device_secret,
                "userCode": m.user_code,
                "verificationUri": uri,
                "verificationUriComplete": complete,
                "expiresInSec": st.pairings.ttl().as_secs(),
                "intervalSec": st.pairings.interval().as_secs(),
            }))
        }
        Err(e) => e.response(&st.pairings),
    }
}

async fn peek(State(st): State<AppState>, Path(code): Path<String>) -> Response {
    match st.pairings.peek(&code) {
        Ok((status, left)) => {
            axum::Json(json!({"status": status, "expiresInSec": left})).into_response()
        }
        Err(e) => e.response(&st.pairings),
    }
}

/// The string fields `names` of a JSON body, or a 400 naming the first one missing.
fn fields<const N: usize>(body: &Bytes, names: [&str; N]) -> Result<[String; N], Response> {
    let v: Json = serde_json::from_slice(body).map_err(|e| {
        error_response(
            StatusCode::BAD_REQUEST,
            json!({"error": "Bad request", "message": format!("the body is not JSON: {e}")}),
        )
    })?;
    let mut out: [String; N] = std::array::from_fn(|_| String::new());
    for (slot, name) in out.iter_mut().zip(names) {
        *slot = v
            .get(name)
            .and_then(|x| x.as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                error_response(
                    StatusCode::BAD_REQUEST,
                    json!({"error": "Bad request", "message": format!("the body needs a `{name}` string")}),
                )
            })?;
    }
    Ok(out)
}

/// A JSON answer that must not be cached (it carries secrets).
fn no_store(v: Json) -> Response {
    let mut r = axum::Json(v).into_response();
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

async fn approve(State(st): State<AppState>, body: Bytes) -> Response {
    let [code, user] = match fields(&body, ["pairCode", "userCode"]) {
        Ok(f) => f,
        Err(r) => return r,
    };
    match st.pairings.approve(&code, &user) {
        Ok((token, ns)) => {
            tracing::info!(namespace = %ns, "sandbox pairing approved");
            no_store(json!({"sessionToken": token, "namespaceId": ns}))
        }
        Err(e) => e.response(&st.pairings),
    }
}

async fn deny(State(st): State<AppState>, body: Bytes) -> Response {
    let [code] = match fields(&body, ["pairCode"]) {
        Ok(f) => f,
        Err(r) => return r,
    };
    match st.pairings.deny(&code) {
        Ok(()) => axum::Json(json!({"status": "denied"})).into_response(),
        Err(e) => e.response(&st.pairings),
    }
}

async fn token(State(st): State<AppState>, body: Bytes) -> Response {
    let [code, secret] = match fields(&body, ["pairCode", "deviceSecret"]) {
        Ok(f) => f,
        Err(r) => return r,
    };
    match st.pairings.token(&code, &secret) {
        Ok((token, ns)) => no_store(json!({"sessionToken": token, "namespaceId": ns})),
        Err(e) => e.response(&st.pairings),
    }
}

async fn session(State(st): State<AppState>, scoped: Option<axum::Extension<Scoped>>) -> Response {
    let Some(axum::Extension(scoped)) = scoped else {
        return unauthorized("send the session's token in X-Session-Token (pair first)");
    };
    let prefix = scoped.prefix();
    let all = match st.blocking(|svc| svc.list()).await {
        Ok(Ok(all)) => all,
        Ok(Err(e)) => return super::rest::service_error(&e).into_response(),
        Err(r) => return r,
    };
    let models: Vec<String> = all
        .into_iter()
        .filter_map(|id| id.strip_prefix(&prefix).map(str::to_string))
        .collect();
    axum::Json(json!({"namespaceId": scoped.ns, "models": models})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairings() -> Pairings {
        Pairings::new(Duration::from_secs(600), Duration::from_secs(2))
    }

    #[test]
    fn flow_and_single_use() {
        let p = pairings();
        let m = p.mint(ClientKey::Loopback).unwrap();
        assert_eq!(m.pair_code.len(), 32);
        assert_eq!(m.user_code.len(), 9);
        assert_eq!(
            p.token(&m.pair_code, &m.device_secret),
            Err(PairError::Pending)
        );
        // Polled again at once: slow down.
        assert_eq!(
            p.token(&m.pair_code, &m.device_secret),
            Err(PairError::SlowDown)
        );
        let typed = m.user_code.to_lowercase().replace('-', " ");
        let (tok, ns) = p.approve(&m.pair_code, &typed).unwrap();
        assert_eq!(p.approve(&m.pair_code, &m.user_code), Err(PairError::Used));
        assert_eq!(
            p.token(&m.pair_code, &m.device_secret),
            Ok((tok.clone(), ns.clone()))
        );
        assert_eq!(
            p.token(&m.pair_code, &m.device_secret),
            Err(PairError::Used)
        );
        assert_eq!(p.session(&tok), Some(ns));
        assert_eq!(p.session("nope"), None);
    }

    #[test]
    fn wrong_codes_burn_the_pairing() {
        let p = pairings();
        let m = p.mint(ClientKey::Loopback).unwrap();
        for left in (1..MAX_ATTEMPTS).rev() {
            assert_eq!(
                p.approve(&m.pair_code, "ZZZZ-ZZZZ-X"),
                Err(PairError::Wrong(left))
            );
        }
        assert_eq!(
            p.approve(&m.pair_code, "ZZZZ-ZZZZ-X"),
            Err(PairError::Denied)
        );
        // Even the right code is refused now.
        assert_eq!(
            p.approve(&m.pair_code, &m.user_code),
            Err(PairError::Denied)
        );
        assert_eq!(
            p.token(&m.pair_code, &m.device_secret),
            Err(PairError::Denied)
        );
    }

    #[test]
    fn wrong_secret_and_expiry() {
        let p = Pairings::new(Duration::from_millis(30), Duration::from_secs(1));
        let m = p.mint(ClientKey::Loopback).unwrap();
        assert_eq!(p.token(&m.pair_code, "wrong"), Err(PairError::Unknown));
        assert_eq!(
            p.token("unknown", &m.device_secret),
            Err(PairError::Unknown)
        );
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(
            p.token(&m.pair_code, &m.device_secret),
            Err(PairError::Expired)
        );
        assert_eq!(
            p.approve(&m.pair_code, &m.user_code),
            Err(PairError::Expired)
        );
    }

    fn limited(limits: MintLimits) -> Pairings {
        Pairings::with_limits(Duration::from_secs(600), Duration::from_secs(2), limits)
    }

    #[test]
    fn a_client_mints_a_burst_then_at_its_rate() {
        let p = limited(MintLimits::default());
        let t0 = Instant::now();
        let me = ClientKey::Loopback;
        for _ in 0..8 {
            p.mint_at(me, t0).unwrap();
        }
        let Err(PairError::RateLimited(after)) = p.mint_at(me, t0) else {
            panic!("the ninth mint at once is rate limited");
        };
        assert_eq!(after, Duration::from_secs(6));
        assert_eq!(retry_secs(after), 6);
        // Another client is not held back by this one.
        p.mint_at(ClientKey::V4([192, 0, 2, 7].into()), t0).unwrap();
        // One more every 6 s.
        assert!(p.mint_at(me, t0 + Duration::from_secs(5)).is_err());
        p.mint_at(me, t0 + Duration::from_secs(6)).unwrap();
        assert!(p.mint_at(me, t0 + Duration::from_secs(7)).is_err());
        let s = p.stats();
        assert_eq!((s.pending, s.refused_rate_limited), (10, 3), "{s:?}");
    }

    #[test]
    fn a_client_crowds_out_only_itself_and_the_daemon_has_a_cap() {
        let p = limited(MintLimits {
            burst: 100,
            every: Duration::from_millis(1),
            per_client: 3,
            pending: 5,
        });
        let t0 = Instant::now();
        let flood = ClientKey::V6Prefix(0x2001_0db8_0000_0001);
        let first = p.mint_at(flood, t0).unwrap();
        for i in 1..10 {
            p.mint_at(flood, t0 + Duration::from_millis(i)).unwrap();
        }
        // Its oldest went, the others' room is intact.
        assert_eq!(
            p.token(&first.pair_code, &first.device_secret),
            Err(PairError::Unknown)
        );
        let s = p.stats();
        assert_eq!((s.pending, s.evicted), (3, 7), "{s:?}");
        let a = ClientKey::V4([198, 51, 100, 1].into());
        let b = ClientKey::V4([198, 51, 100, 2].into());
        p.mint_at(a, t0).unwrap();
        p.mint_at(b, t0).unwrap();
        // Full: a clear refusal until the oldest waiting pairing expires.
        let c = ClientKey::V4([198, 51, 100, 3].into());
        let Err(PairError::TooMany(after)) = p.mint_at(c, t0 + Duration::from_secs(10)) else {
            panic!("the daemon is full");
        };
        assert!(after <= Duration::from_secs(590) && after > Duration::from_secs(580));
        assert_eq!(p.stats().refused_capacity, 1);
        // Once they expire, there is room again (and they are swept).
        p.mint_at(c, t0 + Duration::from_secs(601)).unwrap();
        assert_eq!(p.stats_at(t0 + Duration::from_secs(601)).pending, 1);
    }

    #[test]
    fn an_expired_pairing_still_answers_expired_for_a_while() {
        let p = Pairings::new(Duration::from_secs(1), Duration::from_secs(1));
        let t0 = Instant::now();
        let m = p.mint_at(ClientKey::Unknown, t0).unwrap();
        // Another mint after the expiry sweeps, but keeps it to say so.
        let later = t0 + Duration::from_secs(2);
        p.mint_at(ClientKey::Unknown, later).unwrap();
        assert_eq!(p.peek_at(&m.pair_code, later), Err(PairError::Expired));
        let much_later = t0 + Duration::from_secs(62);
        p.mint_at(ClientKey::Unknown, much_later).unwrap();
        assert_eq!(p.peek_at(&m.pair_code, much_later), Err(PairError::Unknown));
    }

    #[test]
    fn client_keys_group_loopback_and_ipv6_prefixes() {
        let k = |a: &str| ClientKey::of(Some(a.parse().unwrap()));
        assert_eq!(k("127.0.0.1:1"), ClientKey::Loopback);
        assert_eq!(k("127.9.9.9:2"), ClientKey::Loopback);
        assert_eq!(k("[::1]:3"), ClientKey::Loopback);
        assert_eq!(k("[::ffff:127.0.0.2]:3"), ClientKey::Loopback);
        assert_eq!(k("[::ffff:192.0.2.1]:4"), k("192.0.2.1:5"));
        assert_eq!(k("[2001:db8:0:1::a]:1"), k("[2001:db8:0:1::b]:2"));
        assert_ne!(k("[2001:db8:0:1::a]:1"), k("[2001:db8:0:2::a]:1"));
        assert_eq!(ClientKey::of(None), ClientKey::Unknown);
    }

    #[test]
    fn a_session_reaches_blobs_only_through_its_models() {
        let s = Scoped { ns: "sabc".into() };
        let call = |name: &str, args: Json| {
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": name, "arguments": args}})
        };
        for refused in [
            call("download_blob", json!({"blobId": "b"})),
            call("download_blob", json!({"blobId": "b", "modelId": null})),
            call("upload_blob", json!({"data": "AA=="})),
        ] {
            assert!(s.refused_call(&refused).is_some(), "{refused}");
        }
        for allowed in [
            call("download_blob", json!({"blobId": "b", "modelId": "m"})),
            call("get_state", json!({"id": "m"})),
            json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
        ] {
            assert_eq!(s.refused_call(&allowed), None, "{allowed}");
        }
    }

    #[test]
    fn scoping_rewrites_and_strips() {
        let s = Scoped { ns: "sabc".into() };
        let mut call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "create_model", "arguments": {"spec": {"id": "loan"}}}});
        s.inbound_rpc(&mut call);
        assert_eq!(
            call.pointer("/params/arguments/spec/id"),
            Some(&json!("sabc__loan"))
        );
        let mut read =
            json!({"method": "resources/subscribe", "params": {"uri": "valem://state/loan"}});
        s.inbound_rpc(&mut read);
        assert_eq!(
            read.pointer("/params/uri"),
            Some(&json!("valem://state/sabc__loan"))
        );
        let list = json!({"method": "tools/call", "params": {"name": "list_models"}});
        let text =
            serde_json::to_string_pretty(&json!([{"id": "sabc__loan"}, {"id": "other"}])).unwrap();
        let mut reply = json!({"result": {"content": [{"type": "text", "text": text}]}});
        s.outbound_rpc(&list, &mut reply);
        let t: Json = serde_json::from_str(
            reply
                .pointer("/result/content/0/text")
                .unwrap()
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(t, json!([{"id": "loan"}]));
        let mut keyed = json!({"sabc__loan": {"modelId": "sabc__loan"}});
        s.strip(&mut keyed);
        assert_eq!(keyed, json!({"loan": {"modelId": "loan"}}));
    }
}
