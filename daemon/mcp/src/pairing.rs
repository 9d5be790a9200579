//! `pair_browser` of `valem mcp --url … --browser`: the agent's half of the sandbox's device
//! flow (`POST /sandbox/pair`, then `POST /sandbox/pair/token` until the developer approves in
//! the browser). It runs on its own thread, off the stdio read loop: it reports
//! `notifications/progress` while it waits (when the call carried a progressToken), stops at
//! `notifications/cancelled`, and, when the client declared URL-mode elicitation, hands the
//! developer the link with `elicitation/create` (and `notifications/elicitation/complete` once
//! paired) instead of through the model. One call waits at most [`POLL_BUDGET`]; a call after
//! `"pending"` resumes the same pairing. Once paired, every upstream request carries the
//! session's `X-Session-Token`, so the daemon scopes the model tools to the paired session.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};

use super::modern::Meta;
use super::mrtr::{self, StateKey};
use super::Session;

/// Longest one `pair_browser` call waits for the approval.
pub const POLL_BUDGET: Duration = Duration::from_secs(60);

/// The tool's definition (only listed in `--browser` mode).
pub fn tool_json() -> Json {
    json!({
        "name": "pair_browser",
        "title": "Pair with a browser tab",
        "description": "Pair this agent with the developer's browser sandbox so both drive one shared, live session. Returns a verification link and confirmation code for the developer to open and approve (or sends the link to the client directly), on a later call waits up to 60 s for the approval (at once when the client takes URL-mode elicitation): {status: \"paired\"|\"pending\"|\"already_paired\", verificationUri?, verificationUriComplete?, userCode?, expiresInSec?, namespaceId?}. On \"pending\" call it again: it resumes the same pairing. Once paired, model ids are scoped to the session and list_models shows its models only.",
        "inputSchema": {"type": "object", "properties": {}, "additionalProperties": false},
        "annotations": {"readOnlyHint": false, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false},
    })
}

#[derive(Clone)]
struct Minted {
    pair_code: String,
    device_secret: String,
    user_code: String,
    uri: String,
    complete: String,
    expires: Instant,
    interval: Duration,
    /// The elicitation that showed the developer the link, if any.
    elicitation: Option<String>,
}

#[derive(Default)]
enum State {
    #[default]
    None,
    Minted(Minted),
    Paired {
        namespace: String,
    },
}

/// The pairing of one proxy process.
#[derive(Default)]
pub struct Pairing {
    state: Mutex<State>,
    /// The session token once paired (read by every upstream request).
    pub token: Arc<Mutex<Option<String>>>,
    /// One wait at a time.
    busy: AtomicBool,
}

/// What the waiting loop needs from the proxy.
pub struct Env<'a> {
    pub base: &'a str,
    pub agent: &'a ureq::Agent,
    pub api_key: Option<&'a str>,
    pub local: &'a Arc<Session>,
    pub cancelled: &'a AtomicBool,
    pub progress_token: Option<Json>,
}

/// A successful `pair_browser` result, in the tools' envelope.
fn ok_result(v: Json) -> Json {
    super::tools::envelope(Ok(v))
}

fn error_result(message: String) -> Json {
    let body = json!({"error": "Pairing failed", "message": message});
    let text = serde_json::to_string_pretty(&body).unwrap_or_default();
    json!({"content": [{"type": "text", "text": text}], "isError": true})
}

impl Env<'_> {
    fn post(&self, path: &str, body: Json) -> Result<(u16, Json), String> {
        let r = self
            .agent
            .post(&format!("{}{path}", self.base))
            .header("Content-Type", "application/json");
        let res = super::proxy::authorize(r, self.api_key, None)
            .send(body.to_string().as_bytes())
            .map_err(|e| format!("the daemon at {} could not be reached: {e}", self.base))?;
        let status = res.status().as_u16();
        let text = res
            .into_body()
            .with_config()
            .limit(1 << 20)
            .read_to_string()
            .map_err(|e| e.to_string())?;
        let v = serde_json::from_str(&text).unwrap_or(Json::Null);
        Ok((status, v))
    }

    fn progress(&self, n: u64, message: &str) {
        if let Some(t) = &self.progress_token {
            self.local.notify(
                None,
                &json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": {
                    "progressToken": t, "progress": n, "message": message,
                }}),
            );
        }
    }

    /// Sleep `d` unless cancelled first; true when cancelled.
    fn wait(&self, d: Duration) -> bool {
        let end = Instant::now() + d;
        while Instant::now() < end {
            if self.cancelled.load(Ordering::SeqCst) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50).min(end - Instant::now()));
        }
        self.cancelled.load(Ordering::SeqCst)
    }
}

/// What the developer is asked to do with the link (URL-mode elicitation, both eras).
fn link_message(user_code: &str) -> String {
    format!(
        "Open this link to pair your browser with the agent; check that it shows the code \
         {user_code} and approve."
    )
}

/// The answer while the developer has not approved yet.
fn pending(m: &Minted, elicited: bool) -> Json {
    let left = m.expires.saturating_duration_since(Instant::now());
    let mut v = json!({
        "status": "pending",
        "expiresInSec": left.as_secs(),
        "message": if elicited {
            "The developer was sent the verification link; once they approve, call pair_browser again."
        } else {
            "Show the developer the verification link (verificationUriComplete) and check they see the same userCode; then call pair_browser again: it waits for the approval (up to 60 s per call) and resumes this same pairing."
        },
    });
    if !elicited {
        v["verificationUri"] = json!(m.uri);
        v["verificationUriComplete"] = json!(m.complete);
        v["userCode"] = json!(m.user_code);
    }
    v
}

/// Did the client declare URL-mode elicitation (2025-11-25)?
fn url_elicitation(local: &Session) -> bool {
    local
        .client_capability("elicitation")
        .is_some_and(|e| e.get("url").is_some())
}

impl Pairing {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The paired session is gone (the daemon refused its token): the next `pair_browser`
    /// starts a new pairing. True when there was one to forget.
    pub fn forget(&self) -> bool {
        let had = self.token.lock().ok().and_then(|mut t| t.take()).is_some();
        if had {
            *self.lock() = State::None;
        }
        had
    }

    /// One `pair_browser` call; `None` when it was cancelled (no reply is owed).
    pub fn call(&self, env: &Env) -> Option<Json> {
        if self.busy.swap(true, Ordering::SeqCst) {
            return Some(error_result(
                "another pair_browser call is already waiting; wait for it or cancel it".into(),
            ));
        }
        let r = self.run(env);
        self.busy.store(false, Ordering::SeqCst);
        r
    }

    fn run(&self, env: &Env) -> Option<Json> {
        let minted = {
            let st = self.lock();
            match &*st {
                State::Paired { namespace } => {
                    return Some(ok_result(
                        json!({"status": "already_paired", "namespaceId": namespace}),
                    ))
                }
                State::Minted(m) if m.expires > Instant::now() => Some(m.clone()),
                _ => None,
            }
        };
        let fresh = minted.is_none();
        let m = match minted {
            Some(m) => m,
            None => match self.mint(env) {
                Ok(m) => m,
                Err(e) => return Some(error_result(e)),
            },
        };
        let elicited = m.elicitation.is_some();
        if fresh && !elicited {
            // Nobody can approve before the developer has the link: hand it over at once; the
            // next call waits for the approval.
            return Some(ok_result(pending(&m, false)));
        }
        self.poll(env, m, elicited)
    }

    /// Wait (at most [`POLL_BUDGET`]) for the developer's approval of pairing `m`: the paired
    /// result, a failure, or `pending` when the budget ran out; `None` when cancelled.
    fn poll(&self, env: &Env, mut m: Minted, elicited: bool) -> Option<Json> {
        let started = Instant::now();
        let mut polls = 0u64;
        loop {
            if env.cancelled.load(Ordering::SeqCst) {
                return None;
            }
            polls += 1;
            let (status, body) = match env.post(
                "/sandbox/pair/token",
                json!({"pairCode": m.pair_code, "deviceSecret": m.device_secret}),
            ) {
                Ok(x) => x,
                Err(e) => return Some(error_result(e)),
            };
            let error = body.get("error").and_then(|e| e.as_str()).unwrap_or("");
            match (status, error) {
                (200, _) => {
                    let token = body.get("sessionToken").and_then(|t| t.as_str());
                    let ns = body.get("namespaceId").and_then(|t| t.as_str());
                    let (Some(token), Some(ns)) = (token, ns) else {
                        return Some(error_result(format!(
                            "the daemon's token answer is malformed: {body}"
                        )));
                    };
                    if let Ok(mut t) = self.token.lock() {
                        *t = Some(token.to_string());
                    }
                    *self.lock() = State::Paired {
                        namespace: ns.to_string(),
                    };
                    if let Some(eid) = &m.elicitation {
                        env.local.notify(
                            None,
                            &json!({"jsonrpc": "2.0", "method": "notifications/elicitation/complete",
                                "params": {"elicitationId": eid}}),
                        );
                    }
                    env.progress(polls, "paired");
                    return Some(ok_result(json!({"status": "paired", "namespaceId": ns})));
                }
                (_, "authorization_pending") => {}
                (_, "slow_down") => m.interval += Duration::from_secs(1),
                _ => {
                    // Denied, expired, burned or unknown: this pairing is over.
                    *self.lock() = State::None;
                    let msg = body
                        .get("message")
                        .and_then(|x| x.as_str())
                        .unwrap_or("the pairing failed");
                    let why = if error.is_empty() {
                        "pairing_failed"
                    } else {
                        error
                    };
                    return Some(error_result(format!(
                        "{why}: {msg}; call pair_browser again for a new link"
                    )));
                }
            }
            if let State::Minted(s) = &mut *self.lock() {
                s.interval = m.interval;
            }
            let left = m.expires.saturating_duration_since(Instant::now());
            if started.elapsed() + m.interval > POLL_BUDGET || left.is_zero() {
                return Some(ok_result(pending(&m, elicited)));
            }
            env.progress(
                polls,
                "waiting for the developer to approve the pairing in the browser",
            );
            if env.wait(m.interval) {
                return None;
            }
        }
    }

    /// `pair_browser` in a modern request (MCP 2026-07-28), for a client that takes URL-mode
    /// elicitation: the first call answers an `InputRequiredResult` whose elicitation carries
    /// the link (and the code to check), with a sealed `requestState` naming the pairing; the
    /// client's retry (its state echoed) waits for the approval. Still pending after
    /// [`POLL_BUDGET`], the answer is another `InputRequiredResult` with the state only (the
    /// client retries). A client without URL-mode elicitation gets the link in the result, as
    /// in the legacy era. `Err`: a refused `requestState` (altered, foreign or expired), a
    /// protocol error; `Ok(None)`: cancelled.
    pub fn call_modern(
        &self,
        env: &Env,
        params: &Json,
        meta: &Meta,
        key: &StateKey,
    ) -> Result<Option<Json>, String> {
        const PURPOSE: &str = "tools/call:pair_browser";
        let now_ms = || u64::try_from(valem_service::time::now().ms()).unwrap_or(0);
        let state = match params.get("requestState") {
            None => None,
            Some(Json::String(s)) => {
                Some(key.open(PURPOSE, s, now_ms()).map_err(|e| e.to_string())?)
            }
            Some(_) => return Err("`requestState` must be the string the server gave".into()),
        };
        let url_mode = meta
            .can("elicitation")
            .is_some_and(|e| e.get("url").is_some());
        if state.is_none() && !url_mode {
            return Ok(self.call(env));
        }
        if self.busy.swap(true, Ordering::SeqCst) {
            return Ok(Some(error_result(
                "another pair_browser call is already waiting; wait for it or cancel it".into(),
            )));
        }
        let r = self.modern_round(env, params, state, key, PURPOSE, now_ms());
        self.busy.store(false, Ordering::SeqCst);
        r
    }

    fn modern_round(
        &self,
        env: &Env,
        params: &Json,
        state: Option<Json>,
        key: &StateKey,
        purpose: &str,
        now_ms: u64,
    ) -> Result<Option<Json>, String> {
        let current = {
            let st = self.lock();
            match &*st {
                State::Paired { namespace } => {
                    return Ok(Some(ok_result(
                        json!({"status": "already_paired", "namespaceId": namespace}),
                    )))
                }
                State::Minted(m) if m.expires > Instant::now() => Some(m.clone()),
                _ => None,
            }
        };
        let seal = |m: &Minted| {
            key.seal(
                purpose,
                &json!({"pairCode": m.pair_code}),
                now_ms,
                mrtr::STATE_TTL,
            )
        };
        let Some(state) = state else {
            // First round: a pairing (the current one, or a new one) and its link to open.
            let m = match current {
                Some(m) => m,
                None => match self.mint_plain(env) {
                    Ok(m) => m,
                    Err(e) => return Ok(Some(error_result(e))),
                },
            };
            let request = json!({"method": "elicitation/create", "params": {
                "mode": "url",
                "url": m.complete,
                "message": link_message(&m.user_code),
            }});
            return Ok(Some(mrtr::input_required(
                json!({"pair": request}),
                Some(seal(&m)),
            )));
        };
        let named = state.get("pairCode").and_then(Json::as_str).unwrap_or("");
        let Some(m) = current.filter(|m| m.pair_code == named) else {
            return Ok(Some(error_result(
                "the pairing this requestState names is over (expired, denied or replaced); call \
                 pair_browser again without it for a new link"
                    .into(),
            )));
        };
        let responses = mrtr::responses(params)?;
        if let Some(answer) = responses.and_then(|r| r.get("pair")) {
            match answer.get("action").and_then(Json::as_str) {
                Some("accept") => {}
                Some(a @ ("decline" | "cancel")) => {
                    *self.lock() = State::None;
                    return Ok(Some(error_result(format!(
                        "the developer did not open the link ({a}); call pair_browser again for a new one"
                    ))));
                }
                _ => return Err("inputResponses.pair is not an elicitation result".into()),
            }
        }
        let Some(r) = self.poll(env, m.clone(), true) else {
            return Ok(None);
        };
        if r.pointer("/structuredContent/status")
            .and_then(Json::as_str)
            == Some("pending")
        {
            // Not approved yet: the client retries with the state alone.
            return Ok(Some(mrtr::input_required(json!({}), Some(seal(&m)))));
        }
        Ok(Some(r))
    }

    /// A new pairing without elicitation (the modern era hands the link over in its result).
    fn mint_plain(&self, env: &Env) -> Result<Minted, String> {
        let mut m = self.mint_raw(env)?;
        m.elicitation = Some("mrtr".into());
        *self.lock() = State::Minted(m.clone());
        Ok(m)
    }

    fn mint(&self, env: &Env) -> Result<Minted, String> {
        let mut m = self.mint_raw(env)?;
        if url_elicitation(env.local) {
            let eid = format!("pair-{}", &m.pair_code[..8.min(m.pair_code.len())]);
            m.elicitation = Some(eid.clone());
            let params = json!({
                "mode": "url",
                "elicitationId": eid,
                "url": m.complete,
                "message": link_message(&m.user_code),
            });
            // The client answers when the developer consented (or not); the wait goes on meanwhile.
            let local = env.local.clone();
            let _ = std::thread::Builder::new()
                .name("valem-elicit".into())
                .spawn(move || {
                    let _ = local.ask(None, "elicitation/create", params, Duration::from_secs(600));
                });
        }
        *self.lock() = State::Minted(m.clone());
        Ok(m)
    }

    fn mint_raw(&self, env: &Env) -> Result<Minted, String> {
        let (status, body) = env.post("/sandbox/pair", json!({}))?;
        if status != 200 {
            return Err(format!(
                "the daemon refused to mint a pairing (HTTP {status}): {}",
                body.get("message").and_then(|m| m.as_str()).unwrap_or("")
            ));
        }
        let s = |k: &str| {
            body.get(k)
                .and_then(|v| v.as_str())
                .map(str::to_string)
                .ok_or_else(|| format!("the daemon's pairing lacks `{k}`: {body}"))
        };
        let n = |k: &str, d: u64| body.get(k).and_then(|v| v.as_u64()).unwrap_or(d);
        let m = Minted {
            pair_code: s("pairCode")?,
            device_secret: s("deviceSecret")?,
            user_code: s("userCode")?,
            uri: s("verificationUri")?,
            complete: s("verificationUriComplete")?,
            expires: Instant::now() + Duration::from_secs(n("expiresInSec", 600)),
            interval: Duration::from_secs(n("intervalSec", 3).max(1)),
            elicitation: None,
        };
        Ok(m)
    }
}
