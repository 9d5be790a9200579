//! Outbound calls of `server` effects: one request or a `requests` fan-out, prepared from the
//! payload, sent through the egress guard with retries and backoff, and `target` links to
//! another model.

use super::*;

/// Most requests one `requests` fan-out may produce.
pub(super) const MAX_FAN_OUT: usize = 64;

/// One HTTP request ready to go.
pub(super) struct Prepared {
    pub(super) method: String,
    pub(super) url: String,
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: Option<Json>,
}

/// A request descriptor made ready. In `request` (`templates`), url and header values
/// interpolate `{ expr }` and `body` is JSONata; in a `requests` descriptor they are values.
pub(super) fn prepare(
    d: &Map<String, Json>,
    input: &JValue,
    env: &Env,
    limits: &Limits,
    templates: bool,
) -> Result<Prepared, Failure> {
    let method = d
        .get("method")
        .and_then(|m| m.as_str())
        .unwrap_or("GET")
        .to_ascii_uppercase();
    let url_t = d
        .get("url")
        .and_then(|u| u.as_str())
        .ok_or_else(|| Failure::Refused("request.url is missing".into()))?;
    let url = if templates {
        interpolate(url_t, input, env, limits, true).map_err(Failure::Refused)?
    } else {
        url_t.to_string()
    };
    let mut headers = Vec::new();
    if let Some(h) = d.get("headers").and_then(|h| h.as_object()) {
        for (k, v) in h {
            let t = v.as_str().map_or_else(|| v.to_string(), str::to_string);
            let value = if templates {
                interpolate(&t, input, env, limits, false).map_err(Failure::Refused)?
            } else {
                t
            };
            headers.push((k.clone(), value));
        }
    }
    let body = match d.get("body") {
        Some(Json::String(ex)) if templates => eval(ex, input, env, limits)
            .map_err(|m| Failure::Refused(format!("request.body: {m}")))?,
        Some(Json::Null) | None => None,
        Some(other) => Some(other.clone()),
    };
    Ok(Prepared {
        method,
        url,
        headers,
        body,
    })
}

impl Failure {
    /// The same failure, said of one part (`requests[2]`).
    pub(super) fn at(self, what: &str) -> Failure {
        match self {
            Failure::Refused(m) => Failure::Refused(format!("{what}: {m}")),
            Failure::Failed(m) => Failure::Failed(format!("{what}: {m}")),
        }
    }
}

pub(super) struct Target {
    pub(super) tls: bool,
    pub(super) addr: SocketAddr,
    pub(super) host_header: String,
    pub(super) path_and_query: String,
}

pub(super) enum Failure {
    /// Not attempted (guard, bad request): no retry.
    Refused(String),
    /// Attempted and failed: retried per the policy.
    Failed(String),
}

pub(super) struct Policy {
    pub(super) timeout: Duration,
    pub(super) retries: u32,
    pub(super) delay: Duration,
    pub(super) factor: f64,
}

impl Policy {
    pub(super) fn of(e: &EffectSpec, cfg: &EffectsConfig) -> Policy {
        let p = e.policy.as_ref();
        let num = |k: &str| p.and_then(|p| p.get(k)).and_then(|v| v.as_f64());
        let timeout = num("timeoutMs")
            .filter(|t| *t > 0.0)
            .map_or(cfg.default_timeout, |t| Duration::from_millis(t as u64))
            .min(cfg.max_timeout);
        let retries = num("retries").map_or(0, |r| r.clamp(0.0, 10.0) as u32);
        let (delay, factor) = match p.and_then(|p| p.get("backoff")) {
            Some(Json::Number(n)) => (n.as_f64().unwrap_or(500.0), 2.0),
            Some(Json::Object(b)) => (
                b.get("delayMs").and_then(|v| v.as_f64()).unwrap_or(500.0),
                b.get("factor").and_then(|v| v.as_f64()).unwrap_or(2.0),
            ),
            _ => (500.0, 2.0),
        };
        Policy {
            timeout,
            retries,
            delay: Duration::from_millis(delay.clamp(0.0, 60_000.0) as u64),
            factor: factor.clamp(1.0, 10.0),
        }
    }

    /// The wait before the attempt after `attempt`.
    pub(super) fn backoff(&self, attempt: u32) -> Duration {
        let f = self.factor.powi(attempt.saturating_sub(1).min(16) as i32);
        self.delay.mul_f64(f).min(Duration::from_secs(300))
    }
}

impl From<ServiceError> for Failure {
    /// A library that does not evaluate is not worth retrying; anything else may pass.
    fn from(e: ServiceError) -> Failure {
        match e {
            ServiceError::BadRequest(m) => Failure::Refused(m),
            other => Failure::Failed(other.to_string()),
        }
    }
}

impl Runner {
    /// The effect's HTTP call(s): one `request`, or each descriptor a `requests` fan-out
    /// produced, in order (`$response` is then the array of their responses).
    pub(super) fn http(&self, job: &Job, policy: &Policy) -> Result<Json, Failure> {
        let Job {
            svc,
            model,
            spec,
            effect: e,
            req,
        } = *job;
        if let Some(target) = &e.target {
            return self.link(job, target);
        }
        let limits = &svc.limits().engine.expr;
        let (input, env) = model_input(svc, model, spec).map_err(Failure::from)?;
        let key = req
            .dedupe_key
            .as_ref()
            .map_or_else(String::new, |k| k.to_string());
        if let Some(request) = e.request.as_ref().and_then(|r| r.as_object()) {
            let one = prepare(request, &input, &env, limits, true)?;
            return self.send(&one, policy, &format!("{model}/{}/{key}", req.effect_id));
        }
        let Some(fan) = &e.requests else {
            return Err(Failure::Refused(
                "a server effect needs request, requests or target".into(),
            ));
        };
        let list = match eval(fan, &input, &env, limits)
            .map_err(|m| Failure::Refused(format!("requests: {m}")))?
        {
            Some(Json::Array(a)) => a,
            Some(one @ Json::Object(_)) => vec![one],
            None => Vec::new(),
            Some(other) => {
                return Err(Failure::Refused(format!(
                    "requests must produce an array of request descriptors, not {other}"
                )))
            }
        };
        if list.len() > MAX_FAN_OUT {
            return Err(Failure::Refused(format!(
                "requests produced {} descriptors; at most {MAX_FAN_OUT} run per effect",
                list.len()
            )));
        }
        // Descriptors are values already (their strings are not templates).
        let prepared = list
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let d = d.as_object().ok_or_else(|| {
                    Failure::Refused(format!("requests[{i}] is not an object: {d}"))
                })?;
                prepare(d, &input, &env, limits, false).map_err(|f| f.at(&format!("requests[{i}]")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = Vec::with_capacity(prepared.len());
        for (i, p) in prepared.iter().enumerate() {
            let idem = format!("{model}/{}/{key}/{i}", req.effect_id);
            out.push(
                self.send(p, policy, &idem)
                    .map_err(|f| f.at(&format!("requests[{i}]")))?,
            );
        }
        Ok(Json::Array(out))
    }

    /// One prepared request through the egress guard; its parsed response.
    pub(super) fn send(&self, p: &Prepared, policy: &Policy, idem: &str) -> Result<Json, Failure> {
        let Prepared {
            method,
            url,
            headers,
            body,
        } = p;
        let target = self.guard(url).map_err(Failure::Refused)?;
        let mut config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .proxy(None)
            .timeout_global(Some(policy.timeout));
        if let Some(certs) = &self.cfg.ca_certs {
            config = config.tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::new_with_certs(certs))
                    .build(),
            );
        }
        let agent = config.build().new_agent();
        // Plain http connects to the address the guard checked; https must name the host for
        // its certificate, so it is re-resolved (and was re-checked just above).
        let pinned = if target.tls {
            url.clone()
        } else {
            format!("http://{}{}", target.addr, target.path_and_query)
        };
        let result = {
            let mut b = ureq::http::Request::builder()
                .method(method.as_str())
                .uri(&pinned)
                .header("Host", &target.host_header)
                .header("Idempotency-Key", idem)
                .header("User-Agent", concat!("valem/", env!("CARGO_PKG_VERSION")));
            for (k, v) in headers {
                b = b.header(k.as_str(), v.as_str());
            }
            let bytes = match body {
                Some(v) => {
                    b = b.header("Content-Type", "application/json");
                    v.to_string().into_bytes()
                }
                None => Vec::new(),
            };
            let request = b
                .body(bytes)
                .map_err(|e| Failure::Refused(format!("the request is malformed: {e}")))?;
            agent.run(request)
        };
        let res = result.map_err(|e| Failure::Failed(format!("{method} {url}: {e}")))?;
        let status = res.status().as_u16();
        let max = self.cfg.max_response_bytes;
        let text = res
            .into_body()
            .with_config()
            .limit(max as u64 + 1)
            .read_to_vec()
            .map_err(|e| Failure::Failed(format!("reading the response of {url}: {e}")))?;
        if text.len() > max {
            return Err(Failure::Failed(format!(
                "the response of {url} is over {max} bytes (--effects-max-response-bytes)"
            )));
        }
        if !(200..300).contains(&status) {
            return Err(Failure::Failed(format!("{method} {url}: HTTP {status}")));
        }
        Ok(serde_json::from_slice(&text)
            .unwrap_or_else(|_| Json::String(String::from_utf8_lossy(&text).into_owned())))
    }

    /// A link to another model of this daemon: a write-link (`{ref, path}` + `body`) mutates it
    /// and `$response` is its mutation result; a read-link (`{ref, read}`) reads a field and
    /// `$response` is the value. A model of a sandbox session links within its session.
    pub(super) fn link(&self, job: &Job, target: &Json) -> Result<Json, Failure> {
        let Job {
            svc,
            model,
            spec,
            effect: e,
            ..
        } = *job;
        let reference = target
            .get("ref")
            .and_then(|r| r.as_str())
            .ok_or_else(|| Failure::Refused("target.ref is missing".into()))?;
        let linked = crate::scope::resolve(model, reference);
        if linked == model {
            return Err(Failure::Refused("a model cannot link to itself".into()));
        }
        let missing = |err: ServiceError| match err {
            ServiceError::NotFound(_) => Failure::Refused(format!(
                "link target `{reference}` is not a model of this daemon"
            )),
            ServiceError::Mutation(m) => {
                Failure::Refused(format!("link target `{reference}` refused the write: {m}"))
            }
            other => Failure::Failed(format!("link target `{reference}`: {other}")),
        };
        if let Some(read) = target.get("read").and_then(|r| r.as_str()) {
            return svc
                .field(&crate::ModelId::from(&linked), read)
                .wait()
                .map(|v| v.unwrap_or(Json::Null))
                .map_err(missing);
        }
        let path = target
            .get("path")
            .and_then(|p| p.as_str())
            .ok_or_else(|| Failure::Refused("a target needs `path` (write) or `read`".into()))?;
        let limits = &svc.limits().engine.expr;
        let (input, env) = model_input(svc, model, spec).map_err(Failure::from)?;
        let body = match &e.body {
            Some(ex) => eval(ex, &input, &env, limits)
                .map_err(|m| Failure::Refused(format!("body: {m}")))?
                .unwrap_or(Json::Null),
            None => Json::Null,
        };
        let r = svc
            .mutate_linked(
                &crate::ModelId::from(&linked),
                vec![(path.to_string(), body)],
            )
            .wait()
            .map_err(missing)?;
        let mut out = r.to_json(false);
        if let Some(p) = crate::scope::session_prefix(model) {
            crate::scope::strip(&mut out, p);
        }
        Ok(out)
    }

    /// The egress guard: where `url` may be sent, or why not.
    pub(super) fn guard(&self, url: &str) -> Result<Target, String> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(format!("`{url}` is not an http:// or https:// URL"));
        };
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.contains('@') {
            return Err(format!("`{url}`: credentials in the URL are refused"));
        }
        let host = crate::egress::host_name(authority)
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        let port: u16 = authority
            .strip_prefix(&format!("[{host}]"))
            .or_else(|| authority.strip_prefix(host.as_str()))
            .and_then(|p| p.strip_prefix(':'))
            .map_or(Ok(if tls { 443 } else { 80 }), |p| p.parse())
            .map_err(|_| format!("`{url}`: the port is not a number"))?;
        let listed = self
            .cfg
            .allowed_hosts
            .iter()
            .any(|a| a == "*" || a.eq_ignore_ascii_case(&host));
        if !listed {
            return Err(format!(
                "host `{host}` is not on the effects allow-list (--effects-allowed-hosts / VALEM_EFFECTS_ALLOWED_HOSTS; none are allowed by default)"
            ));
        }
        let addrs: Vec<SocketAddr> = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| format!("host `{host}` does not resolve: {e}"))?
            .collect();
        if addrs.is_empty() {
            return Err(format!("host `{host}` does not resolve"));
        }
        if !self.cfg.allow_private_ips {
            if let Some(bad) = addrs.iter().find(|a| !crate::egress::is_public(a.ip())) {
                return Err(format!(
                    "host `{host}` resolves to the non-public address {} (allow with --effects-allow-private-ips / VALEM_EFFECTS_ALLOW_PRIVATE_IPS)",
                    bad.ip()
                ));
            }
        }
        Ok(Target {
            tls,
            addr: addrs[0],
            host_header: authority.to_string(),
            path_and_query: path.to_string(),
        })
    }
}
