//! Effect executors: what runs the effect requests committed cycles emit. The engine only
//! *requests* effects (`dispatchedEffects`); this runner hears each committed cycle (a service
//! subscriber, so nothing runs inside a cycle), runs the durable executors on its own threads,
//! and folds their outcome back as ordinary `foldback` cycles (audited with `source: "foldback"`).
//!
//! - `caller`: returned to the mutating caller only; never run here.
//! - `server`: one HTTP request (`request: {method, url, headers, body}`; `{ expr }` segments of
//!   the url and headers interpolate JSONata over the merged document, `body` is JSONata) behind
//!   the egress guard: https (Mozilla's roots, or `--effects-ca-file`) or plain http, the host must be on
//!   `--effects-allowed-hosts` (none by default: every call refused; `*` = any host), every
//!   resolved address must be public (`egress.rs`; an IPv6 address embedding an IPv4 one is
//!   judged by it) unless `--effects-allow-private-ips`, no redirects, a
//!   response over `--effects-max-response-bytes` fails, `policy.timeoutMs` (default 5 s). A
//!   failure is retried `policy.retries` times (default 0), waiting `policy.backoff` ms (default
//!   500; or `{delayMs, factor}`) doubled per attempt. `response.set` sees the parsed body as
//!   `$response`. Every request carries `Idempotency-Key: <model>/<effect>/<key>`. Plain http
//!   connects to the very address the guard checked; https connects by name (the certificate
//!   names the host), re-resolved right after the check, so a DNS-rebinding window of
//!   microseconds remains there, as in the reference.
//! - `server` with a `target` link to another model of this daemon: a write-link (`{ref, path}`
//!   and `body`) mutates it (audited `source: "link"`), `$response` being its mutation result; a
//!   read-link (`{ref, read}`) reads a field into `$response`. A missing target fails the effect.
//! - `server` with `requests`: JSONata producing an array of descriptors `{method, url, headers,
//!   body}` (values, not templates; at most 64), sent in order; `$response` is the array of
//!   their responses, and one failure fails the attempt (a retry sends them all again, each
//!   with its own `Idempotency-Key: …/<index>`).
//! - `timer`: fires at `at` (epoch ms or ISO-8601) or `afterMs` after the dispatch; at fire time
//!   a trigger no longer true cancels it, else `response.set` is evaluated on the current state.
//! - `llm`: parsed, then reported `failed`: no LLM provider can be configured in this build.
//!
//! **Lifecycle** at `statusPath`: `{phase, key, at, error?, attempts?, fireAt?}` with phases
//! `pending → in_flight → applied | failed | cancelled`. Each phase is a committed (durable)
//! cycle before the next step: `in_flight` is stored before the request leaves. A fold-back is
//! applied only while the effect's dedupe key is still the one it ran for (checked on the
//! shard); otherwise it is superseded and dropped.
//!
//! **Restarts** (`recover`): the status and the engine's last fired keys are part of the
//! recovered state. A `pending` server effect runs; a `pending` timer is rescheduled at its
//! `fireAt` (at once when past due); an effect whose key fired but whose status never got
//! written (a crash right after the dispatch) runs as if just dispatched; an `in_flight` call
//! is marked `failed` and **not** re-sent — it may have reached the destination, and a key
//! fires at most once. Exactly-once therefore needs a `dedupeKey` and a `statusPath`; without
//! them an effect interrupted by a crash is lost.

mod calls;
mod templates;
mod timers;

use calls::*;
use templates::*;
use timers::*;

use std::net::{SocketAddr, ToSocketAddrs};
use std::rc::Rc;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use serde_json::{json, Map, Value as Json};

use super::time::{iso_millis, now, Timestamp};
use super::{Event, EventFilter, ModelService, ServiceError};
use valem_core::expr::{json_to_jvalue, jvalue_to_json, Compiled, Env, Limits, Value as JValue};
use valem_core::spec::{EffectSpec, ModelSpec};
use valem_engine::EffectRequest;

/// What the operator allowed (`valem serve --effects-…`).
#[derive(Clone, Debug)]
pub struct EffectsConfig {
    /// Hosts `server` effects may call; empty refuses every call, `*` allows any host.
    pub allowed_hosts: Vec<String>,
    /// Let `server` effects reach loopback, private, link-local and other non-public addresses.
    pub allow_private_ips: bool,
    /// Largest response body folded back.
    pub max_response_bytes: usize,
    /// Timeout of a call whose policy names none.
    pub default_timeout: Duration,
    /// Longest timeout a policy may ask for.
    pub max_timeout: Duration,
    /// Calls running at once (more wait).
    pub max_in_flight: usize,
    /// Trust only these CA certificates for https (default: Mozilla's roots).
    pub ca_certs: Option<Vec<ureq::tls::Certificate<'static>>>,
}

/// The certificates of a PEM file (`--effects-ca-file`).
pub fn load_ca_file(
    path: &std::path::Path,
) -> Result<Vec<ureq::tls::Certificate<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(&pem) {
        match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => certs.push(c),
            Ok(_) => {}
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    }
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

impl Default for EffectsConfig {
    fn default() -> Self {
        EffectsConfig {
            allowed_hosts: Vec::new(),
            allow_private_ips: false,
            max_response_bytes: 1 << 20,
            default_timeout: Duration::from_secs(5),
            max_in_flight: 16,
            max_timeout: Duration::from_secs(60),
            ca_certs: None,
        }
    }
}

/// What one execution of an effect works on.
struct Job<'a> {
    svc: &'a ModelService,
    model: &'a str,
    spec: &'a ModelSpec,
    effect: &'a EffectSpec,
    req: &'a EffectRequest,
}

/// A timer waiting to fire.
#[derive(Clone, Debug)]
struct Timer {
    fire_at: Timestamp,
    model: String,
    req: EffectRequest,
}

pub struct Runner {
    svc: Weak<ModelService>,
    cfg: EffectsConfig,
    timers: Mutex<Vec<Timer>>,
    wake: Condvar,
    slots: (Mutex<usize>, Condvar),
}

/// The status sub-document of one phase.
fn status(phase: &str, key: &Option<Json>, extra: &[(&str, Json)]) -> Json {
    let mut m = Map::new();
    m.insert("phase".into(), json!(phase));
    m.insert("key".into(), key.clone().unwrap_or(Json::Null));
    m.insert("at".into(), json!(iso_millis(now())));
    for (k, v) in extra {
        m.insert((*k).to_string(), v.clone());
    }
    Json::Object(m)
}

impl Runner {
    /// Start the runner for `svc`: recover what a previous run left, then serve new dispatches.
    pub fn start(svc: &Arc<ModelService>, cfg: EffectsConfig) -> Arc<Runner> {
        let runner = Arc::new(Runner {
            svc: Arc::downgrade(svc),
            cfg,
            timers: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            slots: (Mutex::new(0), Condvar::new()),
        });
        let filter: EventFilter = Arc::new(|e: &Event| {
            matches!(e, Event::Mutation { result, .. }
                if result.dispatched_effects.iter().any(|d| d.executor != "caller"))
        });
        let events = svc.subscribe(filter);
        runner.recover();
        let r = runner.clone();
        let _ = std::thread::Builder::new()
            .name("valem-effects".into())
            .spawn(move || {
                while let Ok(ev) = events.recv() {
                    if let Event::Mutation { model_id, result } = ev {
                        for req in &result.dispatched_effects {
                            r.dispatch(&model_id, req.clone());
                        }
                    }
                }
            });
        let r = runner.clone();
        let _ = std::thread::Builder::new()
            .name("valem-timers".into())
            .spawn(move || r.timer_loop());
        runner
    }

    fn service(&self) -> Option<Arc<ModelService>> {
        self.svc.upgrade()
    }

    /// Write `status` at the effect's status path (if it has one), under the key CAS.
    fn set_status(&self, model: &str, req: &EffectRequest, st: Json) -> Result<(), ServiceError> {
        let (Some(path), Some(svc)) = (&req.status_path, self.service()) else {
            return Ok(());
        };
        svc.foldback(
            &crate::ModelId::from(model),
            &req.effect_id,
            req.dedupe_key.clone(),
            vec![(path.clone(), st)],
        )
        .wait()
        .map(|_| ())
    }

    fn report(&self, model: &str, req: &EffectRequest, r: Result<(), ServiceError>) {
        match r {
            Ok(()) => {}
            Err(ServiceError::Superseded(_)) => {
                tracing::info!(model, effect = %req.effect_id, "effect superseded: its key changed")
            }
            Err(e) => {
                tracing::warn!(model, effect = %req.effect_id, error = %e, "effect status could not be written")
            }
        }
    }

    fn fail(&self, model: &str, req: &EffectRequest, error: String, extra: &[(&str, Json)]) {
        tracing::warn!(model, effect = %req.effect_id, %error, "effect failed");
        let mut x: Vec<(&str, Json)> = vec![("error", json!(error))];
        x.extend_from_slice(extra);
        let r = self.set_status(model, req, status("failed", &req.dedupe_key, &x));
        self.report(model, req, r);
    }

    /// A committed cycle requested `req`.
    fn dispatch(self: &Arc<Self>, model: &str, req: EffectRequest) {
        match req.executor.as_str() {
            "caller" => {}
            "server" => {
                let r = self.set_status(model, &req, status("pending", &req.dedupe_key, &[]));
                if r.is_ok() {
                    self.spawn_call(model.to_string(), req, 0);
                } else {
                    self.report(model, &req, r);
                }
            }
            "timer" => match fire_time(&req, now()) {
                Ok(at) => {
                    let r = self.set_status(
                        model,
                        &req,
                        status("pending", &req.dedupe_key, &[("fireAt", json!(at.ms()))]),
                    );
                    if r.is_ok() {
                        self.schedule(Timer {
                            fire_at: at,
                            model: model.to_string(),
                            req,
                        });
                    } else {
                        self.report(model, &req, r);
                    }
                }
                Err(e) => self.fail(model, &req, e, &[]),
            },
            "llm" => self.fail(
                model,
                &req,
                "llm effects are not executable here: no LLM provider is configured".into(),
                &[],
            ),
            other => self.fail(
                model,
                &req,
                format!("no executor for effect kind `{other}` is installed"),
                &[],
            ),
        }
    }

    // --- recovery -----------------------------------------------------------------------

    /// Resume what a previous run of the daemon left in flight (see the module doc).
    pub fn recover(self: &Arc<Self>) {
        let Some(svc) = self.service() else { return };
        // Only a model whose spec names a status path can have an effect to resume: under a
        // residency bound the others are not woken to find out.
        let Ok(ids) = svc.models_mentioning("\"statusPath\"") else {
            return;
        };
        let mut resumed = 0usize;
        for id in ids {
            let Ok(spec) = svc.spec(&crate::ModelId::from(&id)).wait() else {
                continue;
            };
            if !spec
                .effects
                .iter()
                .any(|e| e.status_path.is_some() && matches!(e.executor(), "server" | "timer"))
            {
                continue;
            }
            let keys = svc
                .effect_keys(&crate::ModelId::from(&id))
                .wait()
                .unwrap_or_default();
            for e in &spec.effects {
                let (Some(path), "server" | "timer") = (&e.status_path, e.executor()) else {
                    continue;
                };
                let key = keys.get(&e.id).cloned();
                let st = svc
                    .field(&crate::ModelId::from(&id), path)
                    .wait()
                    .ok()
                    .flatten()
                    .unwrap_or(Json::Null);
                let phase = st.get("phase").and_then(|p| p.as_str()).unwrap_or("");
                let same_key = st.get("key") == Some(key.as_ref().unwrap_or(&Json::Null));
                let req = EffectRequest {
                    effect_id: e.id.clone(),
                    executor: e.executor().to_string(),
                    emit: None,
                    payload: None,
                    dedupe_key: key.clone(),
                    status_path: Some(path.clone()),
                    at: None,
                    after_ms: None,
                };
                if same_key && phase == "pending" {
                    resumed += 1;
                    if e.executor() == "server" {
                        let attempts = st.get("attempts").and_then(|a| a.as_u64()).unwrap_or(0);
                        self.spawn_call(id.clone(), req, attempts as u32);
                    } else {
                        let at = st
                            .get("fireAt")
                            .and_then(|a| a.as_i64())
                            .map_or_else(now, Timestamp::from_ms);
                        self.schedule(Timer {
                            fire_at: at,
                            model: id.clone(),
                            req,
                        });
                    }
                } else if same_key && phase == "in_flight" {
                    resumed += 1;
                    self.fail(
                        &id,
                        &req,
                        "interrupted by a daemon restart while the call was in flight; not re-sent (it may have reached the destination)".into(),
                        &[],
                    );
                } else if key.is_some() && !same_key && !matches!(phase, "pending" | "in_flight") {
                    // The key fired but its status was never written: the daemon stopped right
                    // after the dispatch. Run it now, re-evaluating a timer's time.
                    resumed += 1;
                    let mut req = req;
                    if e.executor() == "timer" {
                        let (at, after) = self.timer_exprs(&svc, &id, &spec, e);
                        req.at = at;
                        req.after_ms = after;
                    }
                    self.dispatch(&id, req);
                }
            }
        }
        if resumed > 0 {
            tracing::info!(effects = resumed, "effects resumed after the restart");
        }
    }

    fn timer_exprs(
        &self,
        svc: &ModelService,
        id: &str,
        spec: &ModelSpec,
        e: &EffectSpec,
    ) -> (Option<Json>, Option<Json>) {
        let limits = &svc.limits().engine.expr;
        let Ok((input, env)) = model_input(svc, id, spec) else {
            return (None, None);
        };
        let ev = |t: &Option<String>| {
            t.as_deref()
                .and_then(|t| eval(t, &input, &env, limits).ok().flatten())
        };
        (ev(&e.at), ev(&e.after_ms))
    }

    // --- server calls ---------------------------------------------------------------------

    fn spawn_call(self: &Arc<Self>, model: String, req: EffectRequest, attempts: u32) {
        let r = self.clone();
        let spawned = std::thread::Builder::new()
            .name("valem-effect".into())
            .spawn(move || {
                r.acquire();
                r.call(&model, &req, attempts);
                r.release();
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "an effect thread did not start");
        }
    }

    fn acquire(&self) {
        let (m, cv) = &self.slots;
        let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
        while *n >= self.cfg.max_in_flight.max(1) {
            n = cv.wait(n).unwrap_or_else(|p| p.into_inner());
        }
        *n += 1;
    }

    fn release(&self) {
        let (m, cv) = &self.slots;
        let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        cv.notify_one();
    }

    /// Run one server effect to its end: attempts, retries, fold-back.
    fn call(&self, model: &str, req: &EffectRequest, mut attempts: u32) {
        let Some(svc) = self.service() else { return };
        let Ok(spec) = svc.spec(&crate::ModelId::from(model)).wait() else {
            return;
        };
        let Some(e) = spec.effects.iter().find(|e| e.id == req.effect_id) else {
            return;
        };
        let policy = Policy::of(e, &self.cfg);
        let job = Job {
            svc: &svc,
            model,
            spec: &spec,
            effect: e,
            req,
        };
        loop {
            attempts += 1;
            let r = self.set_status(
                model,
                req,
                status(
                    "in_flight",
                    &req.dedupe_key,
                    &[("attempts", json!(attempts))],
                ),
            );
            if r.is_err() {
                return self.report(model, req, r);
            }
            let outcome = self.http(&job, &policy);
            match outcome {
                Ok(response) => {
                    let r = self.apply(&job, Some(response), attempts);
                    return self.report(model, req, r);
                }
                Err(Failure::Refused(why)) => {
                    return self.fail(model, req, why, &[("attempts", json!(attempts))]);
                }
                Err(Failure::Failed(why)) if attempts > policy.retries => {
                    return self.fail(model, req, why, &[("attempts", json!(attempts))]);
                }
                Err(Failure::Failed(why)) => {
                    let wait = policy.backoff(attempts);
                    tracing::info!(model, effect = %req.effect_id, attempt = attempts, error = %why, wait_ms = wait.as_millis() as u64, "effect failed; retrying");
                    let r = self.set_status(
                        model,
                        req,
                        status(
                            "pending",
                            &req.dedupe_key,
                            &[("attempts", json!(attempts)), ("error", json!(why))],
                        ),
                    );
                    if r.is_err() {
                        return self.report(model, req, r);
                    }
                    std::thread::sleep(wait);
                }
            }
        }
    }

    /// `response.set` evaluated (with `$response`) on the current state, plus the `applied`
    /// status, as one fold-back cycle.
    fn apply(&self, job: &Job, response: Option<Json>, attempts: u32) -> Result<(), ServiceError> {
        let Job {
            svc,
            model,
            spec,
            effect: e,
            req,
        } = *job;
        let limits = &svc.limits().engine.expr;
        let (input, mut env) = model_input(svc, model, spec)?;
        if let Some(r) = &response {
            env.vars.push((Rc::from("response"), json_to_jvalue(r)));
        }
        let mut writes = Vec::new();
        if let Some(resp) = &e.response {
            for (target, ex) in &resp.set {
                let text = match ex {
                    Json::String(s) => s.clone(),
                    other => other.to_string(),
                };
                match eval(&text, &input, &env, limits) {
                    Ok(Some(v)) => writes.push((target.clone(), v)),
                    Ok(None) => {}
                    Err(m) => {
                        let why = format!("response.set `{target}`: {m}");
                        self.fail(model, req, why.clone(), &[]);
                        return Ok(());
                    }
                }
            }
        }
        if let Some(path) = &req.status_path {
            let mut extra = vec![];
            if attempts > 0 {
                extra.push(("attempts", json!(attempts)));
            }
            writes.push((path.clone(), status("applied", &req.dedupe_key, &extra)));
        }
        if writes.is_empty() {
            return Ok(());
        }
        match svc
            .foldback(
                &crate::ModelId::from(model),
                &req.effect_id,
                req.dedupe_key.clone(),
                writes,
            )
            .wait()
        {
            Ok(_) => Ok(()),
            Err(ServiceError::Mutation(m)) => {
                // The fold-back itself was refused (schema, constraint): say so at the status.
                self.fail(model, req, format!("the fold-back was refused: {m}"), &[]);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_times() {
        let r = |at: Option<Json>, after: Option<Json>| EffectRequest {
            effect_id: "t".into(),
            executor: "timer".into(),
            emit: None,
            payload: None,
            dedupe_key: None,
            status_path: None,
            at,
            after_ms: after,
        };
        assert_eq!(
            fire_time(&r(None, Some(json!("1500"))), Timestamp::from_ms(1000)),
            Ok(Timestamp::from_ms(2500))
        );
        assert_eq!(
            fire_time(&r(None, Some(json!(20))), Timestamp::from_ms(1000)),
            Ok(Timestamp::from_ms(1020))
        );
        assert_eq!(
            fire_time(&r(Some(json!(5000)), None), Timestamp::from_ms(1000)),
            Ok(Timestamp::from_ms(5000))
        );
        assert_eq!(
            fire_time(
                &r(Some(json!("1970-01-01T00:00:02Z")), None),
                Timestamp::from_ms(0)
            ),
            Ok(Timestamp::from_ms(2000))
        );
        assert!(fire_time(&r(None, Some(json!("soon"))), Timestamp::from_ms(0)).is_err());
        assert!(fire_time(&r(None, None), Timestamp::from_ms(0)).is_err());
    }

    #[test]
    fn backoff_doubles() {
        let p = Policy {
            timeout: Duration::from_secs(1),
            retries: 3,
            delay: Duration::from_millis(100),
            factor: 2.0,
        };
        assert_eq!(p.backoff(1), Duration::from_millis(100));
        assert_eq!(p.backoff(3), Duration::from_millis(400));
    }

    #[test]
    fn templates() {
        let limits = Limits::default();
        let env = Env::default();
        let input = json_to_jvalue(&json!({"region": "north east", "n": 3}));
        assert_eq!(
            interpolate(
                "http://h/r?region={ region }&n={n}",
                &input,
                &env,
                &limits,
                true
            )
            .unwrap(),
            "http://h/r?region=north%20east&n=3"
        );
        assert_eq!(
            interpolate("Bearer {region}", &input, &env, &limits, false).unwrap(),
            "Bearer north east"
        );
        assert!(interpolate("http://h/{region", &input, &env, &limits, true).is_err());
    }
}
