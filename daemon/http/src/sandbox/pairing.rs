//! Device-flow pairing: single-use user codes, device secrets, approval and denial, token
//! polls, sessions, and the mint limits per client address and in all.

use super::*;

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
pub(super) const MAX_CLIENTS: usize = 4096;
/// Pairings kept in all, ended ones included (the oldest ended ones go first beyond this).
pub(super) const MAX_PAIRINGS: usize = 1024;
/// An expired pairing is remembered this long, to answer `expired_token` rather than
/// "no such pairing".
pub(super) const EXPIRED_GRACE: Duration = Duration::from_secs(60);
/// Live sandbox sessions (the oldest is dropped beyond this).
pub(super) const MAX_SESSIONS: usize = 1024;

/// The user-code alphabet: consonants only (no vowels, so no words; no 0/O, 1/I confusion).
pub(super) const USER_ALPHABET: &[u8] = b"BCDFGHJKLMNPQRSTVWXZ";

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PairState {
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

pub(super) struct Pairing {
    pub(super) user_code: String,
    pub(super) device_secret: String,
    /// Who minted it.
    pub(super) client: ClientKey,
    pub(super) created: Instant,
    pub(super) expires: Instant,
    pub(super) state: PairState,
    pub(super) wrong: u32,
    pub(super) last_poll: Option<Instant>,
}

/// One paired browser session.
pub(super) struct SandboxSession {
    pub(super) ns: String,
    pub(super) created: Instant,
    pub(super) last_used: Instant,
}

/// A sandbox session unused this long ends (its models stay; pair again to reach them).
pub(super) const SESSION_IDLE: Duration = Duration::from_secs(24 * 3600);

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
pub(super) struct Inner {
    pub(super) pairs: HashMap<String, Pairing>,
    pub(super) sessions: HashMap<String, SandboxSession>,
    /// Per client, the theoretical arrival time of its next mint (GCRA: the bucket is full
    /// once it is in the past).
    pub(super) next_mint: HashMap<ClientKey, Instant>,
}

/// Counters of refused and dropped mints, for `/metrics`.
#[derive(Default)]
pub(super) struct MintCounters {
    pub(super) rate_limited: AtomicU64,
    pub(super) capacity: AtomicU64,
    pub(super) evicted: AtomicU64,
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
    pub(super) inner: Mutex<Inner>,
    pub(super) ttl: Duration,
    pub(super) interval: Duration,
    pub(super) limits: MintLimits,
    pub(super) counters: MintCounters,
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
pub(super) fn retry_secs(d: Duration) -> u64 {
    (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1)
}

impl PairError {
    pub(super) fn response(&self, p: &Pairings) -> Response {
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

pub(super) fn random_hex(bytes: usize) -> Option<String> {
    let mut b = vec![0u8; bytes];
    getrandom::fill(&mut b).ok()?;
    Some(b.iter().map(|x| format!("{x:02x}")).collect())
}

pub(super) fn random_user_code() -> Option<String> {
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
pub(super) fn normalize_code(c: &str) -> String {
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

    pub(super) fn stats_at(&self, now: Instant) -> PairingStats {
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

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new pairing for `client`, within [`MintLimits`].
    pub fn mint(&self, client: ClientKey) -> Result<Minted, PairError> {
        self.mint_at(client, Instant::now())
    }

    pub(super) fn mint_at(&self, client: ClientKey, now: Instant) -> Result<Minted, PairError> {
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
    pub(super) fn sweep(inner: &mut Inner, now: Instant) {
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

    pub(super) fn peek_at(
        &self,
        pair_code: &str,
        now: Instant,
    ) -> Result<(&'static str, u64), PairError> {
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

    pub(super) fn wrong(p: &mut Pairing) -> PairError {
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
