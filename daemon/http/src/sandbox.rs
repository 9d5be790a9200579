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

/// The header a paired client sends its session token in.
pub const SESSION_HEADER: &str = "x-session-token";
/// Wrong user codes or device secrets before a pairing is burned.
pub const MAX_ATTEMPTS: u32 = 5;
/// How many pairings clients may mint, and how fast: a client (an address; loopback as one,
/// IPv6 by /64) mints [`MintLimits::burst`] at once and then one every
/// [`MintLimits::every`] (429 `rate_limited` with `Retry-After` beyond); a client's pairings
/// waiting for approval past [`MintLimits::per_client`] make room by dropping its own oldest
/// (a client crowds out only itself); the daemon holds [`MintLimits::pending`] waiting
/// pairings in all (429 `too_many_pairings` with `Retry-After` until the oldest expires).
/// One address fills at most `per_client` of the `pending` places, so no single client —
/// and no local one, whatever loopback address it uses — can lock the others out.
#[derive(Clone, Copy, Debug)]
pub struct MintLimits {
    pub burst: u32,
    pub every: Duration,
    pub per_client: usize,
    pub pending: usize,
}

impl Default for MintLimits {
    fn default() -> MintLimits {
        MintLimits {
            burst: 8,
            every: Duration::from_secs(6),
            per_client: 16,
            pending: 256,
        }
    }
}

/// Clients with a mint rate being tracked (a client idle long enough to mint a full burst
/// again is forgotten); a new client beyond this is refused like a full daemon.
const MAX_CLIENTS: usize = 4096;
/// Pairings kept in all, ended ones included (the oldest ended ones go first beyond this).
const MAX_PAIRINGS: usize = 1024;
/// An expired pairing is remembered this long, to answer `expired_token` rather than
/// "no such pairing".
const EXPIRED_GRACE: Duration = Duration::from_secs(60);
/// Live sandbox sessions (the oldest is dropped beyond this).
const MAX_SESSIONS: usize = 1024;
pub use valem_service::scope::NS_SEP;
/// The user-code alphabet: consonants only (no vowels, so no words; no 0/O, 1/I confusion).
const USER_ALPHABET: &[u8] = b"BCDFGHJKLMNPQRSTVWXZ";

const INDEX_HTML: &str = include_str!("sandbox/index.html");
const APP_JS: &str = include_str!("sandbox/app.js");
const APP_CSS: &str = include_str!("sandbox/app.css");

#[derive(Debug, Clone, PartialEq, Eq)]
enum PairState {
    Pending,
    /// Approved in the browser; `collected` once the agent took the token.
    Approved {
        token: String,
        ns: String,
        collected: bool,
    },
    Denied,
    /// Too many wrong codes or secrets.
    Burned,
}

struct Pairing {
    user_code: String,
    device_secret: String,
    /// Who minted it.
    client: ClientKey,
    created: Instant,
    expires: Instant,
    state: PairState,
    wrong: u32,
    last_poll: Option<Instant>,
}

/// One paired browser session.
struct SandboxSession {
    ns: String,
    created: Instant,
    last_used: Instant,
}

/// A sandbox session unused this long ends (its models stay; pair again to reach them).
const SESSION_IDLE: Duration = Duration::from_secs(24 * 3600);

/// Who mints a pairing, for [`MintLimits`]: a client address, with every loopback address one
/// client (a local process may send from any of 127.0.0.0/8) and an IPv6 client its /64.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClientKey {
    Loopback,
    V4(std::net::Ipv4Addr),
    V6Prefix(u64),
    /// No address known (the router driven in-process).
    Unknown,
}

impl ClientKey {
    pub fn of(addr: Option<std::net::SocketAddr>) -> ClientKey {
        let Some(a) = addr else {
            return ClientKey::Unknown;
        };
        let ip = match a.ip() {
            std::net::IpAddr::V6(v6) => v6
                .to_ipv4_mapped()
                .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4),
            v4 => v4,
        };
        match ip {
            ip if ip.is_loopback() => ClientKey::Loopback,
            std::net::IpAddr::V4(v4) => ClientKey::V4(v4),
            std::net::IpAddr::V6(v6) => ClientKey::V6Prefix((u128::from(v6) >> 64) as u64),
        }
    }
}

#[derive(Default)]
struct Inner {
    pairs: HashMap<String, Pairing>,
    sessions: HashMap<String, SandboxSession>,
    /// Per client, the theoretical arrival time of its next mint (GCRA: the bucket is full
    /// once it is in the past).
    next_mint: HashMap<ClientKey, Instant>,
}

/// Counters of refused and dropped mints, for `/metrics`.
#[derive(Default)]
struct MintCounters {
    rate_limited: AtomicU64,
    capacity: AtomicU64,
    evicted: AtomicU64,
}

/// What `/metrics` reports of pairing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairingStats {
    pub pending: usize,
    pub refused_rate_limited: u64,
    pub refused_capacity: u64,
    pub evicted: u64,
}

/// The daemon's pairings and sandbox sessions (in memory: a restart ends them; the agent pairs
/// again).
pub struct Pairings {
    inner: Mutex<Inner>,
    ttl: Duration,
    interval: Duration,
    limits: MintLimits,
    counters: MintCounters,
}

/// A pairing just minted: what the agent is told.
#[derive(Debug, Clone)]
pub struct Minted {
    pub pair_code: String,
    pub device_secret: String,
    pub user_code: String,
}

/// What a token poll or an approval found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PairError {
    Unknown,
    Pending,
    SlowDown,
    Denied,
    Expired,
    /// Already approved (approve) or already collected (token).
    Used,
    /// A wrong user code or device secret; attempts left.
    Wrong(u32),
    /// The client minted too many too fast; it may mint again after this.
    RateLimited(Duration),
    /// The daemon holds as many waiting pairings as it will; one expires after this.
    TooMany(Duration),
    NoRandomness,
}

/// Whole seconds to wait, rounded up, at least one.
fn retry_secs(d: Duration) -> u64 {
    (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1)
}

impl PairError {
    fn response(&self, p: &Pairings) -> Response {
        let (interval, limits) = (p.interval, p.limits);
        let (status, error, message) = match self {
            PairError::Unknown => (
                StatusCode::BAD_REQUEST,
                "invalid_grant",
                "no such pairing: the code is wrong, or the pairing ended".to_string(),
            ),
            PairError::Pending => (
                StatusCode::CONFLICT,
                "authorization_pending",
                "the developer has not approved the pairing yet; poll again after intervalSec"
                    .to_string(),
            ),
            PairError::SlowDown => (
                StatusCode::CONFLICT,
                "slow_down",
                "polling too fast: wait intervalSec between polls".to_string(),
            ),
            PairError::Denied => (
                StatusCode::FORBIDDEN,
                "access_denied",
                "the developer denied the pairing".to_string(),
            ),
            PairError::Expired => (
                StatusCode::GONE,
                "expired_token",
                "the pairing expired before it was completed; mint a new one".to_string(),
            ),
            PairError::Used => (
                StatusCode::BAD_REQUEST,
                "invalid_grant",
                "the pairing was already used; codes are single-use".to_string(),
            ),
            PairError::Wrong(left) => (
                StatusCode::FORBIDDEN,
                "wrong_code",
                format!(
                    "the code does not match; {left} attempt(s) left before the pairing is burned"
                ),
            ),
            PairError::RateLimited(after) => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!(
                    "this client minted too many pairings: at most {} at once, then one every {} s; retry after {} s",
                    limits.burst,
                    limits.every.as_secs(),
                    retry_secs(*after)
                ),
            ),
            PairError::TooMany(after) => (
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_pairings",
                format!(
                    "the daemon holds as many pairings as it will ({} waiting for approval at most); retry after {} s",
                    limits.pending,
                    retry_secs(*after)
                ),
            ),
            PairError::NoRandomness => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "pairing_failed",
                "no randomness available".to_string(),
            ),
        };
        let mut body = json!({"error": error, "message": message});
        if matches!(self, PairError::Pending | PairError::SlowDown) {
            body["intervalSec"] = json!(interval.as_secs());
        }
        if let PairError::Wrong(left) = self {
            body["attemptsLeft"] = json!(left);
        }
        let retry = match self {
            PairError::RateLimited(d) | PairError::TooMany(d) => Some(retry_secs(*d)),
            _ => None,
        };
        if let Some(secs) = retry {
            body["retryAfterSec"] = json!(secs);
        }
        let mut r = error_response(status, body);
        if let Some(secs) = retry {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        r
    }
}

fn random_hex(bytes: usize) -> Option<String> {
    let mut b = vec![0u8; bytes];
    getrandom::fill(&mut b).ok()?;
    Some(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn random_user_code() -> Option<String> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).ok()?;
    let c: Vec<char> = b
        .iter()
        .map(|x| USER_ALPHABET[usize::from(*x) % USER_ALPHABET.len()] as char)
        .collect();
    Some(format!(
        "{}-{}",
        c[..4].iter().collect::<String>(),
        c[4..].iter().collect::<String>()
    ))
}

/// A user code as typed: case, spaces and dashes do not matter.
fn normalize_code(c: &str) -> String {
    c.chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_uppercase())
        .collect()
}

impl Pairings {
    pub fn new(ttl: Duration, interval: Duration) -> Pairings {
        Pairings::with_limits(ttl, interval, MintLimits::default())
    }

    pub fn with_limits(ttl: Duration, interval: Duration, limits: MintLimits) -> Pairings {
        Pairings {
            inner: Mutex::new(Inner::default()),
            ttl,
            interval,
            limits,
            counters: MintCounters::default(),
        }
    }

    /// Pairings waiting for approval, and mints refused or dropped so far.
    pub fn stats(&self) -> PairingStats {
        self.stats_at(Instant::now())
    }

    fn stats_at(&self, now: Instant) -> PairingStats {
        let pending = self
            .lock()
            .pairs
            .values()
            .filter(|p| p.state == PairState::Pending && p.expires > now)
            .count();
        PairingStats {
            pending,
            refused_rate_limited: self.counters.rate_limited.load(Ordering::Relaxed),
            refused_capacity: self.counters.capacity.load(Ordering::Relaxed),
            evicted: self.counters.evicted.load(Ordering::Relaxed),
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new pairing for `client`, within [`MintLimits`].
    pub fn mint(&self, client: ClientKey) -> Result<Minted, PairError> {
        self.mint_at(client, Instant::now())
    }

    fn mint_at(&self, client: ClientKey, now: Instant) -> Result<Minted, PairError> {
        let mut g = self.lock();
        let inner = &mut *g;
        Pairings::sweep(inner, now);
        let refused = |counter: &AtomicU64, e: PairError| {
            counter.fetch_add(1, Ordering::Relaxed);
            Err(e)
        };
        // The client's rate: GCRA over one instant per client.
        let every = self.limits.every;
        let tolerance = every * self.limits.burst.saturating_sub(1);
        let next = inner
            .next_mint
            .get(&client)
            .copied()
            .unwrap_or(now)
            .max(now);
        if next > now + tolerance {
            return refused(
                &self.counters.rate_limited,
                PairError::RateLimited(next - tolerance - now),
            );
        }
        if !inner.next_mint.contains_key(&client) && inner.next_mint.len() >= MAX_CLIENTS {
            return refused(&self.counters.capacity, PairError::TooMany(every));
        }
        // Room: the client's own oldest waiting pairing goes past its share; the daemon's
        // waiting pairings are capped.
        let waiting = |p: &Pairing| p.state == PairState::Pending && p.expires > now;
        let own: Vec<(&String, Instant)> = inner
            .pairs
            .iter()
            .filter(|(_, p)| p.client == client && waiting(p))
            .map(|(k, p)| (k, p.created))
            .collect();
        let evict = if own.len() >= self.limits.per_client.max(1) {
            own.iter()
                .min_by_key(|(_, c)| *c)
                .map(|(k, _)| (*k).clone())
        } else {
            let all: Vec<Instant> = inner
                .pairs
                .values()
                .filter(|p| waiting(p))
                .map(|p| p.expires)
                .collect();
            if all.len() >= self.limits.pending {
                let first = all.iter().min().copied().unwrap_or(now);
                return refused(
                    &self.counters.capacity,
                    PairError::TooMany(first.saturating_duration_since(now)),
                );
            }
            None
        };
        let pair_code = random_hex(16).ok_or(PairError::NoRandomness)?;
        let device_secret = random_hex(32).ok_or(PairError::NoRandomness)?;
        let user_code = random_user_code().ok_or(PairError::NoRandomness)?;
        if let Some(old) = evict {
            inner.pairs.remove(&old);
            self.counters.evicted.fetch_add(1, Ordering::Relaxed);
        }
        inner.next_mint.insert(client, next + every);
        inner.pairs.insert(
            pair_code.clone(),
            Pairing {
                user_code: user_code.clone(),
                device_secret: device_secret.clone(),
                client,
                created: now,
                expires: now + self.ttl,
                state: PairState::Pending,
                wrong: 0,
                last_poll: None,
            },
        );
        Ok(Minted {
            pair_code,
            device_secret,
            user_code,
        })
    }

    /// Forget what is over: pairings expired more than [`EXPIRED_GRACE`] ago (ended ones
    /// linger until then, to answer "already used" or "expired"), the oldest ended pairings
    /// beyond [`MAX_PAIRINGS`], and the rate of clients whose burst is whole again.
    fn sweep(inner: &mut Inner, now: Instant) {
        inner.pairs.retain(|_, p| p.expires + EXPIRED_GRACE > now);
        if inner.pairs.len() >= MAX_PAIRINGS {
            let mut ended: Vec<(Instant, String)> = inner
                .pairs
                .iter()
                .filter(|(_, p)| p.state != PairState::Pending || p.expires <= now)
                .map(|(k, p)| (p.expires, k.clone()))
                .collect();
            ended.sort();
            let excess = inner.pairs.len() + 1 - MAX_PAIRINGS;
            for (_, k) in ended.into_iter().take(excess) {
                inner.pairs.remove(&k);
            }
        }
        inner.next_mint.retain(|_, next| *next > now);
    }

    /// The pairing's status and seconds left, for the page.
    pub fn peek(&self, pair_code: &str) -> Result<(&'static str, u64), PairError> {
        self.peek_at(pair_code, Instant::now())
    }

    fn peek_at(&self, pair_code: &str, now: Instant) -> Result<(&'static str, u64), PairError> {
        let g = self.lock();
        let p = g.pairs.get(pair_code).ok_or(PairError::Unknown)?;
        if p.expires <= now {
            return Err(PairError::Expired);
        }
        let status = match p.state {
            PairState::Pending => "pending",
            PairState::Approved { .. } => "approved",
            PairState::Denied => "denied",
            PairState::Burned => "burned",
        };
        Ok((status, p.expires.duration_since(now).as_secs()))
    }

    fn wrong(p: &mut Pairing) -> PairError {
        p.wrong += 1;
        if p.wrong >= MAX_ATTEMPTS {
            p.state = PairState::Burned;
            PairError::Denied
        } else {
            PairError::Wrong(MAX_ATTEMPTS - p.wrong)
        }
    }

    /// The developer approved in the browser: a new session; its token and namespace.
    pub fn approve(&self, pair_code: &str, user_code: &str) -> Result<(String, String), PairError> {
        let now = Instant::now();
        let mut g = self.lock();
        let inner = &mut *g;
        let p = inner.pairs.get_mut(pair_code).ok_or(PairError::Unknown)?;
        if p.expires <= now {
            return Err(PairError::Expired);
        }
        match p.state {
            PairState::Pending => {}
            PairState::Approved { .. } => return Err(PairError::Used),
            PairState::Denied | PairState::Burned => return Err(PairError::Denied),
        }
        let want = normalize_code(&p.user_code);
        if !constant_time_eq(normalize_code(user_code).as_bytes(), want.as_bytes()) {
            return Err(Pairings::wrong(p));
        }
        let token = random_hex(32).ok_or(PairError::NoRandomness)?;
        // A namespace is a model-id segment: it starts with a letter.
        let ns = format!("s{}", random_hex(8).ok_or(PairError::NoRandomness)?);
        debug_assert!(valem_service::scope::is_namespace(&ns));
        p.state = PairState::Approved {
            token: token.clone(),
            ns: ns.clone(),
            collected: false,
        };
        if inner.sessions.len() >= MAX_SESSIONS {
            if let Some(oldest) = inner
                .sessions
                .iter()
                .min_by_key(|(_, s)| s.created)
                .map(|(k, _)| k.clone())
            {
                inner.sessions.remove(&oldest);
            }
        }
        inner.sessions.insert(
            token.clone(),
            SandboxSession {
                ns: ns.clone(),
                created: now,
                last_used: now,
            },
        );
        Ok((token, ns))
    }

    pub fn deny(&self, pair_code: &str) -> Result<(), PairError> {
        let mut g = self.lock();
        let p = g.pairs.get_mut(pair_code).ok_or(PairError::Unknown)?;
        match p.state {
            PairState::Pending => {
                p.state = PairState::Denied;
                Ok(())
            }
            PairState::Approved { .. } => Err(PairError::Used),
            PairState::Denied | PairState::Burned => Ok(()),
        }
    }

    /// The agent polls: the session token once approved (once only).
    pub fn token(&self, pair_code: &str, secret: &str) -> Result<(String, String), PairError> {
        let now = Instant::now();
        let mut g = self.lock();
        let p = g.pairs.get_mut(pair_code).ok_or(PairError::Unknown)?;
        if !constant_time_eq(secret.as_bytes(), p.device_secret.as_bytes()) {
            return Err(match Pairings::wrong(p) {
                PairError::Denied => PairError::Denied,
                _ => PairError::Unknown,
            });
        }
        if p.expires <= now {
            return Err(PairError::Expired);
        }
        let too_soon = p
            .last_poll
            .is_some_and(|t| now.duration_since(t) < self.interval / 2);
        p.last_poll = Some(now);
        match &mut p.state {
            PairState::Pending if too_soon => Err(PairError::SlowDown),
            PairState::Pending => Err(PairError::Pending),
            PairState::Denied | PairState::Burned => Err(PairError::Denied),
            PairState::Approved {
                collected: true, ..
            } => Err(PairError::Used),
            PairState::Approved {
                token,
                ns,
                collected,
            } => {
                *collected = true;
                Ok((token.clone(), ns.clone()))
            }
        }
    }

    /// The namespace of a live session token (each use keeps it alive).
    pub fn session(&self, token: &str) -> Option<String> {
        let mut g = self.lock();
        let now = Instant::now();
        let s = g.sessions.get_mut(token)?;
        if now.duration_since(s.last_used) > SESSION_IDLE {
            g.sessions.remove(token);
            return None;
        }
        s.last_used = now;
        Some(s.ns.clone())
    }
}

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
        return super::guard::query_param(req.uri(), "session").map(str::to_string);
    }
    None
}

fn unauthorized(message: &str) -> Response {
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
