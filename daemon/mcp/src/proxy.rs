//! `valem mcp --url`: a stdio MCP server in front of a daemon's Streamable HTTP `/mcp`.
//!
//! The handshake, `tools/list`, logging and the authoring tools are served here by a local
//! session (they never touch a registry); model tools and resources go to the daemon over one
//! upstream MCP session, opened on first use. The daemon's server messages (resource updates)
//! arrive on its GET stream and are relayed to stdout. When the daemon is down a call gets a
//! clear error; the next call reconnects (a new upstream session, subscriptions re-made).

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value as Json};

use super::pairing::{self, Pairing};
use super::{code, modern, tools, Handler, Outbox, Server, Session, PROTOCOL_VERSIONS};

/// The upstream revision we ask the daemon for.
const UPSTREAM_VERSION: &str = "2025-11-25";

pub struct Proxy {
    local: Arc<Session>,
    up: Arc<Upstream>,
    /// `--browser`: `pair_browser` is offered.
    browser: bool,
    pairing: Arc<Pairing>,
    /// Running `pair_browser` calls by request id: set to cancel.
    waits: Arc<Mutex<HashMap<String, Arc<AtomicBool>>>>,
}

impl Proxy {
    pub fn new(
        server: Arc<Server>,
        url: &str,
        api_key: Option<String>,
        out: Outbox,
        browser: bool,
    ) -> Arc<Proxy> {
        let pairing = Arc::new(Pairing::default());
        let mut up = Upstream::new(url, api_key, out.clone());
        up.session_token = pairing.token.clone();
        Arc::new(Proxy {
            local: Session::new(server, out),
            up: Arc::new(up),
            browser,
            pairing,
            waits: Arc::default(),
        })
    }

    fn is_pair_call(&self, msg: &Json) -> bool {
        self.browser
            && msg.get("method").and_then(|m| m.as_str()) == Some("tools/call")
            && msg.pointer("/params/name").and_then(|n| n.as_str()) == Some("pair_browser")
    }

    /// `pair_browser` on its own thread; its reply is written when it is done (none if the
    /// client cancelled it).
    fn start_pairing(&self, msg: Json) {
        let Some(id) = msg.get("id").cloned() else {
            return;
        };
        let key = id.to_string();
        let flag = Arc::new(AtomicBool::new(false));
        if let Ok(mut w) = self.waits.lock() {
            w.insert(key.clone(), flag.clone());
        }
        let progress_token = msg.pointer("/params/_meta/progressToken").cloned();
        let params = msg.get("params").cloned().unwrap_or(Json::Null);
        // A modern call pairs by a multi round-trip request.
        let meta = Proxy::is_modern(&msg)
            .then(|| modern::read_meta("tools/call", &params, &id).ok())
            .flatten();
        let local = self.local.clone();
        let up = self.up.clone();
        let pairing = self.pairing.clone();
        let waits = self.waits.clone();
        let spawned = std::thread::Builder::new()
            .name("valem-pair".into())
            .spawn(move || {
                let env = pairing::Env {
                    base: &up.base,
                    agent: &up.agent,
                    api_key: up.api_key.as_deref(),
                    local: &local,
                    cancelled: &flag,
                    progress_token,
                };
                let reply = match (&meta, &local.server.state_key) {
                    (Some(m), Some(k)) => pairing.call_modern(&env, &params, m, k),
                    (Some(_), None) => Err("no key to seal a requestState with".into()),
                    (None, _) => Ok(pairing.call(&env)),
                };
                if let Ok(mut w) = waits.lock() {
                    w.remove(&key);
                }
                let paired = reply
                    .as_ref()
                    .ok()
                    .and_then(|r| r.as_ref())
                    .and_then(|r| r.pointer("/structuredContent/status"))
                    .and_then(|s| s.as_str())
                    == Some("paired");
                if paired {
                    // The next upstream request opens a session scoped to the paired one.
                    up.reset();
                }
                match reply {
                    Ok(Some(r)) => {
                        let r = if meta.is_some() {
                            modern::finish(r, None)
                        } else {
                            r
                        };
                        local.notify(None, &json!({"jsonrpc": "2.0", "id": id, "result": r}));
                    }
                    Ok(None) => {}
                    Err(e) => local.notify(
                        None,
                        &json!({"jsonrpc": "2.0", "id": id, "error": {
                            "code": code::INVALID_PARAMS, "message": e}}),
                    ),
                }
            });
        if spawned.is_err() {
            self.local.notify(
                None,
                &json!({"jsonrpc": "2.0", "id": msg.get("id"), "error": {
                    "code": code::INTERNAL_ERROR, "message": "could not start the pairing thread"}}),
            );
        }
    }

    /// Does this request go to the daemon?
    fn remote(msg: &Json) -> bool {
        let method = msg.get("method").and_then(|m| m.as_str()).unwrap_or("");
        match method {
            "tools/call" => msg
                .get("params")
                .and_then(|p| p.get("name"))
                .and_then(|n| n.as_str())
                .is_some_and(|n| !tools::AUTHORING.contains(&n)),
            "resources/list"
            | "resources/read"
            | "resources/templates/list"
            | "resources/subscribe"
            | "resources/unsubscribe" => true,
            _ => false,
        }
    }

    fn forward(&self, msg: Json) -> Option<Json> {
        let id = msg.get("id").cloned()?;
        let method = msg
            .get("method")
            .and_then(|m| m.as_str())
            .unwrap_or("")
            .to_string();
        let params = msg.get("params").cloned().unwrap_or_else(|| json!({}));
        match self.up.call(&method, params.clone()) {
            Ok(reply) => {
                if reply.get("error").is_none() {
                    self.up.note_subscription(&method, &params);
                }
                let mut reply = reply;
                reply["id"] = id;
                Some(reply)
            }
            Err(why) => Some(self.unreachable(id, &why, method == "tools/call")),
        }
    }

    /// Is this a modern-era request (its version named in `_meta`)?
    fn is_modern(msg: &Json) -> bool {
        msg.get("method")
            .and_then(Json::as_str)
            .is_some_and(|m| modern::selects_modern(m, msg.get("params").unwrap_or(&Json::Null)))
    }

    /// A modern-era request (MCP 2026-07-28): model tools, resources and the daemon's tasks go
    /// to the daemon as modern requests (no upstream session); `subscriptions/listen` is
    /// relayed from a listen stream of the daemon; the rest is served here.
    fn handle_modern(&self, msg: Json) -> Option<Json> {
        let id = msg.get("id").cloned()?;
        let method = msg
            .get("method")
            .and_then(Json::as_str)
            .unwrap_or("")
            .to_string();
        let params = msg.get("params").cloned().unwrap_or(Json::Null);
        // The local session checks `_meta` (and answers what is wrong with it).
        if let Err(e) = modern::read_meta(&method, &params, &id) {
            return Some(e);
        }
        match method.as_str() {
            "subscriptions/listen" => {
                self.relay_listen(msg);
                None
            }
            "tools/call" if self.is_pair_call(&msg) => {
                self.start_pairing(msg);
                None
            }
            "tools/list" => {
                let mut reply = self.local.handle(msg)?;
                if let Ok(up) = self.up.call_modern(&json!({"jsonrpc": "2.0", "id": 0,
                    "method": "tools/list", "params": {"_meta": params.get("_meta")}}))
                {
                    merge_tools(&mut reply, &up);
                }
                if self.browser {
                    if let Some(t) = reply
                        .pointer_mut("/result/tools")
                        .and_then(Json::as_array_mut)
                    {
                        t.push(pairing::tool_json());
                    }
                }
                Some(reply)
            }
            "tasks/get" | "tasks/update" | "tasks/cancel" => {
                let local = params
                    .get("taskId")
                    .and_then(Json::as_str)
                    .is_some_and(|t| self.local.server.tasks.get("", t).is_some());
                if local {
                    self.local.handle(msg)
                } else {
                    self.forward_modern(msg)
                }
            }
            _ if Proxy::remote(&msg) => self.forward_modern(msg),
            _ => self.local.handle(msg),
        }
    }

    /// A modern request sent on to the daemon; its reply (an error reply when unreachable).
    fn forward_modern(&self, msg: Json) -> Option<Json> {
        let id = msg.get("id").cloned()?;
        let tool_call = msg.get("method").and_then(Json::as_str) == Some("tools/call");
        match self.up.call_modern(&msg) {
            Ok(mut reply) => {
                reply["id"] = id;
                Some(reply)
            }
            Err(why) => Some(self.unreachable(id, &why, tool_call)),
        }
    }

    /// Relay `subscriptions/listen` from the daemon: its notifications (tagged with the
    /// client's request id) go to stdout until `notifications/cancelled` names it or the daemon
    /// ends it.
    fn relay_listen(&self, msg: Json) {
        let Some(id) = msg.get("id").cloned() else {
            return;
        };
        let flag = Arc::new(AtomicBool::new(false));
        if let Ok(mut w) = self.waits.lock() {
            w.insert(id.to_string(), flag.clone());
        }
        let up = self.up.clone();
        let local = self.local.clone();
        let waits = self.waits.clone();
        let first_id = id.clone();
        let spawned = std::thread::Builder::new()
            .name("valem-proxy-listen".into())
            .spawn(move || {
                let end = up.listen_modern(&msg, &id, &flag);
                if let Ok(mut w) = waits.lock() {
                    w.remove(&id.to_string());
                }
                if let Some(reply) = end {
                    local.notify(None, &reply);
                }
            });
        if spawned.is_err() {
            self.local.notify(None, &json!({"jsonrpc": "2.0", "id": first_id, "error": {
                "code": code::INTERNAL_ERROR, "message": "could not start the subscription's thread"}}));
        }
    }

    /// The answer to a request the daemon could not take.
    fn unreachable(&self, id: Json, why: &str, tool_call: bool) -> Json {
        let text = if why.starts_with("HTTP 401") && self.pairing.forget() {
            self.up.reset();
            format!("the paired browser session ended ({why}); call pair_browser to pair again")
        } else {
            format!(
                "the valem daemon at {} could not be reached: {why}. Start it with `valem serve` \
                 (or check --url); the next call reconnects.",
                self.up.base
            )
        };
        if tool_call {
            json!({"jsonrpc": "2.0", "id": id, "result": {
                "content": [{"type": "text", "text": text}],
                "isError": true,
            }})
        } else {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": code::INTERNAL_ERROR, "message": text}})
        }
    }

    fn handle_one(&self, msg: Json) -> Option<Json> {
        if Proxy::is_modern(&msg) {
            return self.handle_modern(msg);
        }
        let initialized = self.local.protocol_version().is_some();
        if initialized && msg.get("id").is_some() && self.is_pair_call(&msg) {
            self.start_pairing(msg);
            None
        } else if initialized && msg.get("id").is_some() && Proxy::remote(&msg) {
            self.forward(msg)
        } else if initialized && msg.get("method").and_then(|m| m.as_str()) == Some("tools/list") {
            let mut reply = self.local.handle(msg)?;
            self.add_daemon_tools(&mut reply);
            if self.browser {
                if let Some(t) = reply
                    .pointer_mut("/result/tools")
                    .and_then(|t| t.as_array_mut())
                {
                    t.push(pairing::tool_json());
                }
            }
            Some(reply)
        } else {
            self.local.handle(msg)
        }
    }

    /// The daemon's own extra tools (its tool plugins') join the local list; when the daemon
    /// cannot be reached the list is the local one (calls then say the daemon is down).
    fn add_daemon_tools(&self, reply: &mut Json) {
        if let Ok(up) = self.up.call("tools/list", json!({})) {
            merge_tools(reply, &up);
        }
    }
}

/// The tools of the daemon's `tools/list` reply `up` that the local reply lacks, appended.
fn merge_tools(reply: &mut Json, up: &Json) {
    {
        let Some(local) = reply
            .get_mut("result")
            .and_then(|r| r.get_mut("tools"))
            .and_then(|t| t.as_array_mut())
        else {
            return;
        };
        let Some(remote) = up
            .get("result")
            .and_then(|r| r.get("tools"))
            .and_then(|t| t.as_array())
        else {
            return;
        };
        for t in remote {
            let name = t.get("name").and_then(|n| n.as_str());
            if !local
                .iter()
                .any(|l| l.get("name").and_then(|n| n.as_str()) == name)
            {
                local.push(t.clone());
            }
        }
    }
}

impl Handler for Proxy {
    fn intercept(&self, msg: &Json) -> bool {
        if msg.get("method").and_then(|m| m.as_str()) == Some("notifications/cancelled") {
            if let Some(rid) = msg.pointer("/params/requestId") {
                if let Some(flag) = self
                    .waits
                    .lock()
                    .ok()
                    .and_then(|w| w.get(&rid.to_string()).cloned())
                {
                    flag.store(true, Ordering::SeqCst);
                }
            }
        }
        self.local.intercept(msg)
    }

    fn handle(&self, msg: Json) -> Option<Json> {
        match msg {
            Json::Array(items) if items.iter().any(Proxy::remote) => {
                // Route each member; the local session still checks the revision allows batches.
                if !matches!(
                    self.local.protocol_version(),
                    Some("2024-11-05" | "2025-03-26")
                ) {
                    return self.local.handle(Json::Array(items));
                }
                let replies: Vec<Json> = items
                    .into_iter()
                    .filter_map(|m| {
                        if self.local.intercept(&m) {
                            None
                        } else {
                            self.handle_one(m)
                        }
                    })
                    .collect();
                (!replies.is_empty()).then_some(Json::Array(replies))
            }
            other => self.handle_one(other),
        }
    }
}

struct UpState {
    session: Option<String>,
    version: String,
    /// `valem://state/…` URIs the client subscribed to (re-made on reconnect).
    subscriptions: BTreeSet<String>,
}

struct Upstream {
    /// The daemon's base URL as given.
    base: String,
    /// `…/mcp`
    endpoint: String,
    api_key: Option<String>,
    /// The paired sandbox session's token (`--browser`, once paired): sent on every request.
    session_token: Arc<Mutex<Option<String>>>,
    agent: ureq::Agent,
    stream_agent: ureq::Agent,
    state: Mutex<UpState>,
    next_id: AtomicU64,
    out: Outbox,
    /// Bumped for each upstream session: a stream reader of an older one stops.
    generation: Arc<AtomicU64>,
}

fn endpoint_of(url: &str) -> String {
    let u = url.trim_end_matches('/');
    if u.ends_with("/mcp") {
        u.to_string()
    } else {
        format!("{u}/mcp")
    }
}

impl Upstream {
    fn new(url: &str, api_key: Option<String>, out: Outbox) -> Upstream {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(5)))
            .timeout_global(Some(Duration::from_secs(300)))
            .build()
            .new_agent();
        let stream_agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(5)))
            .build()
            .new_agent();
        Upstream {
            base: url.trim_end_matches('/').to_string(),
            endpoint: endpoint_of(url),
            api_key,
            session_token: Arc::default(),
            agent,
            stream_agent,
            state: Mutex::new(UpState {
                session: None,
                version: UPSTREAM_VERSION.to_string(),
                subscriptions: BTreeSet::new(),
            }),
            next_id: AtomicU64::new(1),
            out,
            generation: Arc::new(AtomicU64::new(0)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, UpState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn note_subscription(&self, method: &str, params: &Json) {
        let Some(uri) = params.get("uri").and_then(|u| u.as_str()) else {
            return;
        };
        let mut st = self.lock();
        match method {
            "resources/subscribe" => {
                st.subscriptions.insert(uri.to_string());
            }
            "resources/unsubscribe" => {
                st.subscriptions.remove(uri);
            }
            _ => {}
        }
    }

    /// One request to the daemon; its JSON-RPC reply. Reconnects once when the upstream
    /// session is gone (daemon restarted).
    fn call(&self, method: &str, params: Json) -> Result<Json, String> {
        for attempt in 0..2 {
            let (sid, version) = self.ensure_session()?;
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let msg = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
            match self.post(&msg, Some(&sid), &version) {
                Ok(Posted::Reply(r)) => return Ok(r),
                Ok(Posted::SessionGone) if attempt == 0 => {
                    self.drop_session(&sid);
                    continue;
                }
                Ok(Posted::SessionGone) => return Err("the daemon dropped the session".into()),
                Ok(Posted::Accepted) => return Err("the daemon sent no reply".into()),
                Err(e) => {
                    // The daemon may be down or restarting: start afresh on the next call.
                    self.drop_session(&sid);
                    return Err(e);
                }
            }
        }
        Err("the daemon dropped the session twice".into())
    }

    fn token(&self) -> Option<String> {
        self.session_token.lock().ok().and_then(|t| t.clone())
    }

    /// Forget the upstream session (the next call opens a new one, with the current token).
    fn reset(&self) {
        let mut st = self.lock();
        if st.session.take().is_some() {
            self.generation.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn drop_session(&self, sid: &str) {
        let mut st = self.lock();
        if st.session.as_deref() == Some(sid) {
            st.session = None;
            self.generation.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn ensure_session(&self) -> Result<(String, String), String> {
        {
            let st = self.lock();
            if let Some(s) = &st.session {
                return Ok((s.clone(), st.version.clone()));
            }
        }
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": UPSTREAM_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "valem-mcp-proxy", "version": env!("CARGO_PKG_VERSION")},
        }});
        let (reply, sid) = self.post_initialize(&init)?;
        if let Some(e) = reply.get("error") {
            return Err(format!("the daemon refused initialize: {e}"));
        }
        let version = reply
            .pointer("/result/protocolVersion")
            .and_then(|v| v.as_str())
            .filter(|v| PROTOCOL_VERSIONS.contains(v))
            .unwrap_or(UPSTREAM_VERSION)
            .to_string();
        let _ = self.post(
            &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            Some(&sid),
            &version,
        )?;
        let subs: Vec<String> = {
            let mut st = self.lock();
            st.session = Some(sid.clone());
            st.version = version.clone();
            st.subscriptions.iter().cloned().collect()
        };
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.start_stream(sid.clone(), version.clone(), generation);
        for uri in subs {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let _ = self.post(
                &json!({"jsonrpc": "2.0", "id": id, "method": "resources/subscribe", "params": {"uri": uri}}),
                Some(&sid),
                &version,
            );
        }
        Ok((sid, version))
    }

    fn post_builder(&self) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        self.post_with(&self.agent)
    }

    /// A POST to the endpoint on `agent`, with the content types and the credentials.
    fn post_with(&self, agent: &ureq::Agent) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        let r = agent
            .post(&self.endpoint)
            .header("Content-Type", "application/json")
            .header("Accept", "application/json, text/event-stream");
        authorize(r, self.api_key.as_deref(), self.token().as_deref())
    }

    fn post_initialize(&self, msg: &Json) -> Result<(Json, String), String> {
        let res = self
            .post_builder()
            .send(msg.to_string().as_bytes())
            .map_err(describe)?;
        let status = res.status().as_u16();
        let sid = res
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let reply = read_reply(res, msg.get("id"))?;
        if status >= 400 {
            return Err(status_error(status, &reply));
        }
        let sid = sid.ok_or("the daemon's initialize reply carried no Mcp-Session-Id")?;
        Ok((reply, sid))
    }

    fn post(&self, msg: &Json, sid: Option<&str>, version: &str) -> Result<Posted, String> {
        let mut r = self.post_builder().header("MCP-Protocol-Version", version);
        if let Some(s) = sid {
            r = r.header("Mcp-Session-Id", s);
        }
        let res = r.send(msg.to_string().as_bytes()).map_err(describe)?;
        let status = res.status().as_u16();
        if status == 202 {
            return Ok(Posted::Accepted);
        }
        if status == 404 && sid.is_some() {
            return Ok(Posted::SessionGone);
        }
        let reply = read_reply(res, msg.get("id"))?;
        if status >= 400 {
            return Err(status_error(status, &reply));
        }
        Ok(Posted::Reply(reply))
    }

    /// A modern request's POST on `agent`: the standard headers mirrored from the body, the
    /// credentials.
    fn modern_post(
        &self,
        agent: &ureq::Agent,
        msg: &Json,
    ) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        let method = msg.get("method").and_then(Json::as_str).unwrap_or("");
        let version = msg
            .pointer("/params/_meta")
            .and_then(|m| m.get(modern::key::PROTOCOL_VERSION))
            .and_then(Json::as_str)
            .unwrap_or(modern::MODERN_VERSIONS[0]);
        let mut r = self
            .post_with(agent)
            .header("MCP-Protocol-Version", version)
            .header("Mcp-Method", method);
        let name = match method {
            "tools/call" | "prompts/get" => msg.pointer("/params/name"),
            "resources/read" => msg.pointer("/params/uri"),
            "tasks/get" | "tasks/update" | "tasks/cancel" => msg.pointer("/params/taskId"),
            _ => None,
        };
        if let Some(n) = name.and_then(Json::as_str) {
            r = r.header("Mcp-Name", &header_value(n));
        }
        r
    }

    /// One modern request to the daemon (no session); its JSON-RPC reply. A refusal the daemon
    /// explains (a 4xx with a JSON-RPC error) is a reply too.
    fn call_modern(&self, msg: &Json) -> Result<Json, String> {
        let mut msg = msg.clone();
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        msg["id"] = json!(format!("proxy-{n}"));
        let res = self
            .modern_post(&self.agent, &msg)
            .send(msg.to_string().as_bytes())
            .map_err(describe)?;
        let status = res.status().as_u16();
        let reply = read_reply(res, msg.get("id"))?;
        if status >= 500 || (status >= 400 && reply.get("error").is_none()) {
            return Err(status_error(status, &reply));
        }
        if status == 401 {
            return Err(status_error(status, &reply));
        }
        Ok(reply)
    }

    /// A modern `subscriptions/listen` on the daemon, relayed to stdout with the client's
    /// subscription id until `stop` is set (checked at each event and keep-alive) or the
    /// stream ends; what to answer the client then (the daemon's closing reply, or an error
    /// when it could not be reached).
    fn listen_modern(&self, msg: &Json, client_id: &Json, stop: &AtomicBool) -> Option<Json> {
        let mut up = msg.clone();
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let up_id = json!(format!("proxy-listen-{n}"));
        up["id"] = up_id.clone();
        // No global timeout: the stream lives as long as the subscription.
        let r = self.modern_post(&self.stream_agent, &up);
        let res = match r.send(up.to_string().as_bytes()) {
            Ok(res) => res,
            Err(e) => {
                return Some(
                    json!({"jsonrpc": "2.0", "id": client_id, "error": {"code": code::INTERNAL_ERROR,
                    "message": format!("the valem daemon at {} could not be reached: {}", self.base, describe(e))}}),
                )
            }
        };
        let sse = res
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.starts_with("text/event-stream"));
        if !sse {
            let mut reply = read_reply(res, Some(&up_id)).unwrap_or_else(|e| {
                json!({"jsonrpc": "2.0", "error": {"code": code::INTERNAL_ERROR, "message": e}})
            });
            reply["id"] = client_id.clone();
            return Some(reply);
        }
        let reader = BufReader::new(res.into_body().into_reader());
        let mut end = None;
        for_each_event_or_comment(reader, stop, |mut m| {
            if let Some(meta) = m.pointer_mut("/params/_meta").and_then(Json::as_object_mut) {
                if meta.contains_key(modern::key::SUBSCRIPTION_ID) {
                    meta.insert(modern::key::SUBSCRIPTION_ID.into(), client_id.clone());
                }
            }
            if m.get("method").is_some() {
                self.out.as_ref()(&m);
                return true;
            }
            // The daemon's reply to the listen request ends it.
            m["id"] = client_id.clone();
            if let Some(meta) = m.pointer_mut("/result/_meta").and_then(Json::as_object_mut) {
                meta.insert(modern::key::SUBSCRIPTION_ID.into(), client_id.clone());
            }
            end = Some(m);
            false
        });
        end
    }

    /// Relay the daemon's server messages for session `sid` until it is replaced.
    fn start_stream(&self, sid: String, version: String, generation: u64) {
        let agent = self.stream_agent.clone();
        let endpoint = self.endpoint.clone();
        let key = self.api_key.clone();
        let token = self.token();
        let out = self.out.clone();
        let current = self.generation.clone();
        let _ = std::thread::Builder::new()
            .name("valem-proxy-events".into())
            .spawn(move || {
                let mut backoff = Duration::from_millis(200);
                while current.load(Ordering::SeqCst) == generation {
                    let r = agent
                        .get(&endpoint)
                        .header("Accept", "text/event-stream")
                        .header("Mcp-Session-Id", &sid)
                        .header("MCP-Protocol-Version", &version);
                    match authorize(r, key.as_deref(), token.as_deref()).call() {
                        Ok(res) if res.status().as_u16() == 200 => {
                            backoff = Duration::from_millis(200);
                            let reader = BufReader::new(res.into_body().into_reader());
                            relay_events(reader, &out, &current, generation);
                        }
                        // The session is gone (daemon restarted): the next call reconnects.
                        Ok(res) if res.status().as_u16() == 404 => break,
                        _ => {}
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            });
    }
}

/// The daemon's credentials on a request: the API key, and the paired session's token.
pub(super) fn authorize<B>(
    mut r: ureq::RequestBuilder<B>,
    api_key: Option<&str>,
    session_token: Option<&str>,
) -> ureq::RequestBuilder<B> {
    if let Some(k) = api_key {
        r = r.header("Authorization", &format!("Bearer {k}"));
    }
    if let Some(t) = session_token {
        r = r.header("X-Session-Token", t);
    }
    r
}

enum Posted {
    Reply(Json),
    Accepted,
    SessionGone,
}

fn describe(e: ureq::Error) -> String {
    match e {
        ureq::Error::Io(io) => io.to_string(),
        ureq::Error::ConnectionFailed => "connection failed".into(),
        ureq::Error::HostNotFound => "host not found".into(),
        ureq::Error::Timeout(t) => format!("timed out ({t})"),
        other => other.to_string(),
    }
}

fn status_error(status: u16, reply: &Json) -> String {
    let msg = reply
        .pointer("/error/message")
        .or_else(|| reply.get("message"))
        .and_then(|m| m.as_str())
        .map_or_else(|| reply.to_string(), str::to_string);
    format!("HTTP {status}: {msg}")
}

/// The JSON-RPC reply in a response: a JSON body, or the matching message of an SSE body.
fn read_reply(res: ureq::http::Response<ureq::Body>, id: Option<&Json>) -> Result<Json, String> {
    let sse = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("text/event-stream"));
    let mut body = res.into_body();
    let reader = body.with_config().limit(256 << 20).reader();
    if !sse {
        let mut text = Vec::new();
        let mut r = reader;
        r.read_to_end(&mut text).map_err(|e| e.to_string())?;
        if text.is_empty() {
            return Ok(json!({}));
        }
        return serde_json::from_slice(&text)
            .map_err(|e| format!("the daemon's reply is not JSON: {e}"));
    }
    let mut found = None;
    for_each_event(BufReader::new(reader), |m| {
        if id.is_some() && m.get("id") == id && m.get("method").is_none() {
            found = Some(m);
            return false;
        }
        true
    });
    found.ok_or_else(|| "the daemon's event stream ended without a reply".to_string())
}

fn relay_events(reader: impl BufRead, out: &Outbox, current: &AtomicU64, generation: u64) {
    for_each_event(reader, |m| {
        if current.load(Ordering::SeqCst) != generation {
            return false;
        }
        if m.get("method").is_some() && m.get("id").is_none() {
            out(&m);
        }
        true
    });
}

/// A header value as is when it is plain visible ASCII without edge spaces, else in the
/// `=?base64?…?=` form.
fn header_value(v: &str) -> String {
    use base64::Engine;
    let visible = v.bytes().all(|b| (0x20..0x7f).contains(&b));
    let edges = v.starts_with(' ') || v.ends_with(' ');
    let sentinel = v.starts_with("=?base64?") && v.ends_with("?=");
    let plain = visible && !edges && !sentinel;
    if plain {
        v.to_string()
    } else {
        format!(
            "=?base64?{}?=",
            base64::engine::general_purpose::STANDARD.encode(v.as_bytes())
        )
    }
}

/// [`for_each_event`] that also stops once `stop` is set, checked at every line (events and
/// keep-alive comments alike).
fn for_each_event_or_comment(
    mut reader: impl BufRead,
    stop: &AtomicBool,
    mut f: impl FnMut(Json) -> bool,
) {
    let mut data = String::new();
    let mut line = String::new();
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            if !data.is_empty() {
                if let Ok(m) = serde_json::from_str::<Json>(&data) {
                    if stop.load(Ordering::SeqCst) || !f(m) {
                        return;
                    }
                }
                data.clear();
            }
            continue;
        }
        if let Some(d) = l.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(d.strip_prefix(' ').unwrap_or(d));
        }
    }
}

/// Parse `text/event-stream` frames; `f` gets each `data` payload that is JSON and returns
/// false to stop.
fn for_each_event(reader: impl BufRead, f: impl FnMut(Json) -> bool) {
    for_each_event_or_comment(reader, &AtomicBool::new(false), f);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint() {
        assert_eq!(
            endpoint_of("http://127.0.0.1:8080"),
            "http://127.0.0.1:8080/mcp"
        );
        assert_eq!(endpoint_of("http://h:1/"), "http://h:1/mcp");
        assert_eq!(endpoint_of("http://h:1/mcp"), "http://h:1/mcp");
    }

    #[test]
    fn sse_parsing() {
        let text = "event: message\ndata: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":\ndata: 2}\n\ndata: not json\n\n";
        let mut got = Vec::new();
        for_each_event(text.as_bytes(), |m| {
            got.push(m);
            true
        });
        assert_eq!(got, vec![json!({"a": 1}), json!({"b": 2})]);
    }

    #[test]
    fn header_values_are_encoded_when_not_plain() {
        assert_eq!(header_value("mutate"), "mutate");
        assert_eq!(header_value("valem://state/a b"), "valem://state/a b");
        assert_eq!(
            header_value("Hello, 世界"),
            "=?base64?SGVsbG8sIOS4lueVjA==?="
        );
        assert_eq!(header_value(" padded "), "=?base64?IHBhZGRlZCA=?=");
        assert_eq!(
            header_value("=?base64?literal?="),
            "=?base64?PT9iYXNlNjQ/bGl0ZXJhbD89?="
        );
    }

    #[test]
    fn routing() {
        let call = |n: &str| json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": n}});
        assert!(Proxy::remote(&call("mutate")));
        assert!(!Proxy::remote(&call("validate_spec")));
        assert!(Proxy::remote(&json!({"method": "resources/read"})));
        assert!(!Proxy::remote(&json!({"method": "tools/list"})));
    }
}
