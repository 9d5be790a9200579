//! Streamable HTTP MCP at `/mcp` of the real daemon, driven with a real HTTP client (ureq), and
//! the stdio proxy (`valem mcp --url`) in front of it.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};
use valem_tests::{Daemon, Mcp};

const DEMO: &str = r#"{"id":"demo","schema":{"type":"object","properties":{"price":{"type":"number"},"qty":{"type":"number"}}},"derivations":[{"path":"$.total","expr":"price * qty"}]}"#;

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .new_agent()
}

struct Http {
    agent: ureq::Agent,
    url: String,
    session: Option<String>,
    key: Option<String>,
}

struct Reply {
    status: u16,
    session: Option<String>,
    content_type: String,
    body: Json,
    /// The body as sent (for SSE, the event data).
    text: String,
}

impl Http {
    fn new(d: &Daemon) -> Http {
        Http {
            agent: agent(),
            url: d.url("/mcp"),
            session: None,
            key: None,
        }
    }

    fn post_with(&self, body: &str, headers: &[(&str, &str)]) -> Reply {
        let mut r = self.agent.post(&self.url);
        let mut has_accept = false;
        let mut has_ct = false;
        for (k, v) in headers {
            has_accept |= k.eq_ignore_ascii_case("accept");
            has_ct |= k.eq_ignore_ascii_case("content-type");
            r = r.header(*k, *v);
        }
        if !has_accept {
            r = r.header("Accept", "application/json, text/event-stream");
        }
        if !has_ct {
            r = r.header("Content-Type", "application/json");
        }
        if let Some(s) = &self.session {
            r = r.header("Mcp-Session-Id", s);
        }
        if let Some(k) = &self.key {
            r = r.header("Authorization", &format!("Bearer {k}"));
        }
        let res = r.send(body.as_bytes()).expect("POST /mcp");
        reply(res)
    }

    fn post(&self, msg: &Json) -> Reply {
        self.post_with(&msg.to_string(), &[])
    }

    fn initialize(&mut self) -> Json {
        let r = self.post(&json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}}}));
        assert_eq!(r.status, 200, "{}", r.body);
        self.session = Some(r.session.clone().expect("Mcp-Session-Id on initialize"));
        let n = self.post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        assert_eq!(n.status, 202);
        r.body["result"].clone()
    }

    fn call(&self, id: u64, method: &str, params: Json) -> Json {
        let r = self.post(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        assert_eq!(r.status, 200, "{method}: {}", r.body);
        assert_eq!(r.body["id"], json!(id));
        r.body
    }

    fn tool(&self, id: u64, name: &str, args: Json) -> Json {
        self.call(id, "tools/call", json!({"name": name, "arguments": args}))["result"].clone()
    }
}

fn reply(res: ureq::http::Response<ureq::Body>) -> Reply {
    let status = res.status().as_u16();
    let session = res
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let content_type = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut text = res.into_body().read_to_string().unwrap_or_default();
    if content_type.starts_with("text/event-stream") {
        text = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim)
            .collect();
    }
    let body = serde_json::from_str(&text).unwrap_or(Json::Null);
    Reply {
        status,
        session,
        content_type,
        body,
        text,
    }
}

/// A GET stream's messages, read on a thread.
fn open_stream(h: &Http) -> std::sync::mpsc::Receiver<Json> {
    let mut r = agent_no_timeout()
        .get(&h.url)
        .header("Accept", "text/event-stream");
    if let Some(s) = &h.session {
        r = r.header("Mcp-Session-Id", s);
    }
    let res = r.call().expect("GET /mcp");
    assert_eq!(res.status().as_u16(), 200);
    assert!(res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .starts_with("text/event-stream"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let reader = BufReader::new(res.into_body().into_reader());
        for line in reader.lines() {
            let Ok(line) = line else { break };
            if let Some(d) = line.strip_prefix("data:") {
                if let Ok(m) = serde_json::from_str::<Json>(d.trim()) {
                    if tx.send(m).is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

fn agent_no_timeout() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent()
}

fn text_of(result: &Json) -> String {
    result["content"][0]["text"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[test]
fn session_lifecycle_and_tools() {
    let d = Daemon::start(&[]);
    let mut h = Http::new(&d);
    let init = h.initialize();
    assert_eq!(init["protocolVersion"], "2025-11-25");
    assert_eq!(init["serverInfo"]["name"], "valem");
    let tools = h.call(1, "tools/list", json!({}));
    assert_eq!(tools["result"]["tools"].as_array().map(Vec::len), Some(26));

    let created = h.tool(
        2,
        "create_model",
        json!({"spec": serde_json::from_str::<Json>(DEMO).unwrap()}),
    );
    assert_eq!(created["isError"], false, "{created}");
    let m = h.tool(
        3,
        "mutate",
        json!({"id": "demo", "mutations": {"$.price": 10, "$.qty": 3}}),
    );
    assert_eq!(m["isError"], false, "{m}");
    let f = h.tool(4, "get_field", json!({"id": "demo", "path": "$.total"}));
    assert_eq!(f["content"][0]["text"], "30", "{f}");

    // A structured failure keeps its shape over HTTP.
    let bad = h.tool(
        5,
        "mutate",
        json!({"id": "demo", "mutations": {"$.price": "ten"}}),
    );
    assert_eq!(bad["isError"], true);
    assert_eq!(bad["structuredContent"]["error"], "Schema violation");

    // DELETE ends the session; it is then unknown (404).
    let mut del = h.agent.delete(&h.url);
    del = del.header("Mcp-Session-Id", h.session.as_deref().unwrap());
    assert_eq!(del.call().expect("DELETE").status().as_u16(), 200);
    let after = h.post(&json!({"jsonrpc": "2.0", "id": 6, "method": "ping"}));
    assert_eq!(after.status, 404);
    assert!(after.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Session not found"));

    // The models belong to the daemon, not the session.
    let mut h2 = Http::new(&d);
    h2.initialize();
    let f = h2.tool(1, "get_field", json!({"id": "demo", "path": "$.total"}));
    assert_eq!(f["content"][0]["text"], "30");
}

#[test]
fn committed_writes_over_the_result_guard_say_so_over_http() {
    let d = Daemon::start(&[]);
    let mut h = Http::new(&d);
    h.initialize();
    let spec = json!({"id": "rows", "schema": {},
        "defaultValues": [{"path": "$", "expr": "{\"tags\": {}}"}],
        "derivations": [{"path": "$.n", "expr": "$count(rows)"},
                        {"path": "$.t", "expr": "$count($keys(tags))"}]});
    assert_eq!(
        h.tool(1, "create_model", json!({"spec": spec}))["isError"],
        false
    );
    // mutate (awaited on the shard, not run on a thread): 3,000 rows, one address each.
    let rows: serde_json::Map<String, Json> = (0..3000)
        .map(|i| {
            (
                format!("$.rows[{i}]"),
                json!({"i": i, "label": format!("row {i}")}),
            )
        })
        .collect();
    let r = h.tool(2, "mutate", json!({"id": "rows", "mutations": rows}));
    assert_eq!(r["isError"], false, "{r}");
    let note = &r["structuredContent"];
    assert_eq!(note["committed"], true, "{note}");
    assert_eq!(note["counts"]["mutatedPaths"], 3000);
    assert_eq!(note["counts"]["derivedUpdated"], 1);
    assert!(text_of(&r).contains("The write committed: 3000 paths written"));
    // patch_model: 3,000 new members, each its own write.
    let patch: Vec<Json> = (0..3000)
        .map(|i| json!({"op": "add", "path": format!("/tags/t{i}"), "value": i}))
        .collect();
    let r = h.tool(3, "patch_model", json!({"id": "rows", "patch": patch}));
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(r["structuredContent"]["committed"], true, "{r}");
    assert_eq!(r["structuredContent"]["counts"]["mutatedPaths"], 3000);
    assert_eq!(r["structuredContent"]["counts"]["derivedUpdated"], 1);
    // Each committed once.
    let f = h.tool(4, "get_field", json!({"id": "rows", "path": "$.n"}));
    assert_eq!(f["content"][0]["text"], "3000", "{f}");
    let f = h.tool(5, "get_field", json!({"id": "rows", "path": "$.t"}));
    assert_eq!(f["content"][0]["text"], "3000", "{f}");
}

#[test]
fn protocol_errors_are_clean() {
    let d = Daemon::start(&[]);
    let mut h = Http::new(&d);
    // No session yet: only initialize opens one.
    let r = h.post(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
    assert_eq!(r.status, 400);
    assert_eq!(r.body["error"]["code"], -32600);
    // A 2026-07-28 request without its `_meta` gets a 400 naming what it lacks (the modern
    // era itself: tests/tests/mcp_modern.rs).
    let r = h.post_with(
        r#"{"jsonrpc":"2.0","id":1,"method":"server/discover","params":{}}"#,
        &[("MCP-Protocol-Version", "2026-07-28")],
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.body["error"]["code"], -32602);
    assert_eq!(r.body["id"], 1);
    assert!(r.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("2026-07-28"));

    h.initialize();
    let unknown = Http {
        session: Some("0123456789abcdef0123456789abcdef".into()),
        ..Http::new(&d)
    };
    assert_eq!(
        unknown
            .post(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}))
            .status,
        404
    );

    let r = h.post_with("{not json", &[]);
    assert_eq!(r.status, 400);
    assert_eq!(r.body["error"]["code"], -32700);
    let r = h.post_with(
        r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
        &[("Content-Type", "text/plain")],
    );
    assert_eq!(r.status, 415);
    let r = h.post_with(
        r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
        &[("Accept", "text/html")],
    );
    assert_eq!(r.status, 406);
    let r = h.post_with(
        r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
        &[("MCP-Protocol-Version", "1999-01-01")],
    );
    assert_eq!(r.status, 400);
    // Only SSE accepted: the reply comes as one event.
    let r = h.post_with(
        r#"{"jsonrpc":"2.0","id":7,"method":"ping"}"#,
        &[("Accept", "text/event-stream")],
    );
    assert_eq!(r.status, 200);
    assert!(r.content_type.starts_with("text/event-stream"));
    assert_eq!(r.body, json!({"jsonrpc": "2.0", "id": 7, "result": {}}));

    // DNS rebinding and foreign pages are refused before any handler.
    let r = h.post_with(
        r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
        &[("Origin", "https://evil.example")],
    );
    assert_eq!(r.status, 403);
    let r = h.post_with(
        r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
        &[("Host", "evil.example:8080")],
    );
    assert_eq!(r.status, 403);
    let r = h.post_with(
        r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
        &[("Origin", "http://localhost:5173")],
    );
    assert_eq!(r.status, 200);
}

#[test]
fn allowed_origins_and_api_key() {
    let d = Daemon::start(&[
        "--api-key",
        "k-123",
        "--allowed-origins",
        "https://app.example",
    ]);
    let mut h = Http::new(&d);
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}}});
    assert_eq!(h.post(&init).status, 401);
    h.key = Some("wrong".into());
    assert_eq!(h.post(&init).status, 401);
    h.key = Some("k-123".into());
    let r = h.post_with(&init.to_string(), &[("Origin", "https://app.example")]);
    assert_eq!(r.status, 200);
    let r = h.post_with(&init.to_string(), &[("Origin", "https://other.example")]);
    assert_eq!(r.status, 403);
    // Health stays open.
    let res = agent().get(&d.url("/healthz")).call().expect("healthz");
    assert_eq!(res.status().as_u16(), 200);
}

#[test]
fn subscriptions_arrive_on_the_get_stream() {
    let d = Daemon::start(&[]);
    let mut a = Http::new(&d);
    a.initialize();
    a.tool(
        1,
        "create_model",
        json!({"spec": serde_json::from_str::<Json>(DEMO).unwrap()}),
    );
    let mut b = Http::new(&d);
    b.initialize();
    let events = open_stream(&b);
    let s = b.call(
        1,
        "resources/subscribe",
        json!({"uri": "valem://state/demo"}),
    );
    assert!(s.get("error").is_none(), "{s}");
    a.tool(
        2,
        "mutate",
        json!({"id": "demo", "mutations": {"$.price": 2}}),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let m = events
            .recv_timeout(left)
            .expect("resources/updated on the GET stream");
        if m["method"] == "notifications/resources/updated" {
            assert_eq!(m["params"]["uri"], "valem://state/demo");
            break;
        }
    }
    let read = b.call(2, "resources/read", json!({"uri": "valem://state/demo"}));
    let text = read["result"]["contents"][0]["text"].as_str().unwrap();
    assert_eq!(serde_json::from_str::<Json>(text).unwrap()["price"], 2);
}

#[test]
fn sigterm_stops_cleanly_with_open_streams() {
    let d = Daemon::start(&[]);
    let mut h = Http::new(&d);
    h.initialize();
    let _events = open_stream(&h);
    let status = d.terminate();
    assert!(status.success(), "exit status {status:?}");
}

#[test]
fn sigterm_as_soon_as_the_address_is_announced_still_stops_gracefully() {
    // The handlers are installed before the listening line; a service manager that stops
    // the daemon right after starting it gets the graceful path, not the default action.
    for _ in 0..5 {
        let d = Daemon::start(&[]);
        let status = d.terminate();
        assert!(status.success(), "exit status {status:?}");
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
fn json_rpc_edges_over_http_and_the_proxy() {
    let d = Daemon::start(&[]);
    let mut h = Http::new(&d);
    h.initialize();
    // Neither request, notification nor response: -32600, with the id when there is one.
    for (body, id) in [
        ("{}", Json::Null),
        (r#"{"jsonrpc":"2.0","id":"v4"}"#, json!("v4")),
        (r#"{"method":"ping","id":3}"#, json!(3)),
    ] {
        let r = h.post_with(body, &[]);
        assert_eq!(r.status, 200, "{body}: {}", r.text);
        assert_eq!(r.body["error"]["code"], -32600, "{body}: {}", r.text);
        assert_eq!(r.body["id"], id, "{body}");
    }
    // A response and a notification are accepted with no reply.
    assert_eq!(
        h.post_with(r#"{"jsonrpc":"2.0","id":99,"result":{}}"#, &[])
            .status,
        202
    );
    assert_eq!(
        h.post_with(
            r#"{"jsonrpc":"2.0","method":"notifications/roots/list_changed"}"#,
            &[]
        )
        .status,
        202
    );
    // Ids come back as sent, in JSON and in an SSE event, from a tool call (awaited on the
    // shard) and from an error.
    let big = "1180591620717411303424";
    for (accept, body) in [
        (
            "application/json",
            format!(r#"{{"jsonrpc":"2.0","id":{big},"method":"ping"}}"#),
        ),
        (
            "text/event-stream",
            format!(r#"{{"jsonrpc":"2.0","id":{big},"method":"ping"}}"#),
        ),
        (
            "application/json",
            r#"{"jsonrpc":"2.0","id":1e2,"method":"tools/call","params":{"name":"list_models","arguments":{}}}"#
                .to_string(),
        ),
        (
            "application/json",
            format!(r#"{{"jsonrpc":"2.0","id":{big},"method":"nope"}}"#),
        ),
    ] {
        let r = h.post_with(&body, &[("Accept", accept)]);
        assert_eq!(r.status, 200, "{}", r.text);
        let id = if body.contains("1e2") { "1e2" } else { big };
        assert!(
            r.text
                .starts_with(&format!(r#"{{"jsonrpc":"2.0","id":{id},"#)),
            "{accept}: {}",
            r.text
        );
    }
    let spec: Json = serde_json::from_str(DEMO).unwrap();
    assert_eq!(
        h.tool(5, "create_model", json!({"spec": spec}))["isError"],
        false
    );
    let r = h.post_with(
        &format!(r#"{{"jsonrpc":"2.0","id":{big},"method":"tools/call","params":{{"name":"mutate","arguments":{{"id":"demo","mutations":{{"$.price":1}}}}}}}}"#),
        &[],
    );
    assert!(
        r.text
            .starts_with(&format!(r#"{{"jsonrpc":"2.0","id":{big},"result""#)),
        "{}",
        r.text
    );

    // Through the stdio proxy: local and forwarded requests alike.
    let mut p = Mcp::start(&["--url", &d.url("")], &[]);
    p.handshake("2025-11-25");
    p.send_raw(b"{}\n");
    let r = p.recv_reply();
    assert_eq!(
        (r["id"].clone(), r["error"]["code"].clone()),
        (Json::Null, json!(-32600))
    );
    p.send_raw(b"{\"jsonrpc\":\"2.0\",\"id\":\"v4\"}\n");
    assert_eq!(p.recv_reply()["id"], "v4");
    for body in [
        format!(r#"{{"jsonrpc":"2.0","id":{big},"method":"ping"}}"#),
        format!(
            r#"{{"jsonrpc":"2.0","id":{big},"method":"tools/call","params":{{"name":"get_field","arguments":{{"id":"demo","path":"$.price"}}}}}}"#
        ),
    ] {
        p.send_raw(format!("{body}\n").as_bytes());
        let line = loop {
            let l = p.recv_line(10);
            if !l.contains("\"method\"") {
                break l;
            }
        };
        assert!(
            line.starts_with(&format!(r#"{{"jsonrpc":"2.0","id":{big},"result""#)),
            "{line}"
        );
    }
}

#[test]
fn two_proxies_share_a_daemon() {
    let d = Daemon::start(&[]);
    let url = d.url("");
    let mut a = Mcp::start(&["--url", &url], &[]);
    let mut b = Mcp::start(&["--url", &url], &[]);
    a.handshake("2025-06-18");
    b.handshake("2025-11-25");
    // The same catalog as embedded mode.
    let tools = a.call(1, "tools/list", json!({}));
    assert_eq!(tools["result"]["tools"].as_array().map(Vec::len), Some(26));

    let c = a.tool(
        2,
        "create_model",
        json!({"spec": serde_json::from_str::<Json>(DEMO).unwrap()}),
    );
    assert_eq!(c["isError"], false, "{c}");
    let s = b.call(
        2,
        "resources/subscribe",
        json!({"uri": "valem://state/demo"}),
    );
    assert!(s.get("error").is_none(), "{s}");
    let m = a.tool(
        3,
        "mutate",
        json!({"id": "demo", "mutations": {"$.price": 10, "$.qty": 3}}),
    );
    assert_eq!(m["isError"], false, "{m}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "no resources/updated relayed to proxy b"
        );
        let n = b.recv(10);
        if n["method"] == "notifications/resources/updated" {
            assert_eq!(n["params"]["uri"], "valem://state/demo");
            break;
        }
    }
    let f = b.tool(4, "get_field", json!({"id": "demo", "path": "$.total"}));
    assert_eq!(f["content"][0]["text"], "30", "{f}");
    // list_models and resources/list come from the daemon.
    let l = b.tool(5, "list_models", json!({}));
    assert!(text_of(&l).contains("demo"), "{l}");
    let r = b.call(6, "resources/list", json!({}));
    assert!(r["result"]["resources"]
        .to_string()
        .contains("valem://state/demo"));
}

#[test]
fn proxy_reports_a_down_daemon_and_reconnects() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let url = format!("http://{listen}");
    let mut p = Mcp::start(&["--url", &url], &[]);
    p.handshake("2025-11-25");
    // Authoring tools run locally: no daemon needed.
    let v = p.tool(
        1,
        "validate_spec",
        json!({"spec": serde_json::from_str::<Json>(DEMO).unwrap()}),
    );
    assert_eq!(v["isError"], false, "{v}");
    assert_eq!(v["structuredContent"]["valid"], true);
    // A model tool with the daemon down: a clear tool error, and the proxy keeps serving.
    let down = p.tool(2, "list_models", json!({}));
    assert_eq!(down["isError"], true);
    let t = text_of(&down);
    assert!(
        t.contains(&url) && t.contains("could not be reached"),
        "{t}"
    );

    let d = Daemon::start_on(&listen, &[]);
    let c = p.tool(
        3,
        "create_model",
        json!({"spec": serde_json::from_str::<Json>(DEMO).unwrap()}),
    );
    assert_eq!(c["isError"], false, "{c}");
    let s = p.call(
        4,
        "resources/subscribe",
        json!({"uri": "valem://state/demo"}),
    );
    assert!(s.get("error").is_none(), "{s}");
    assert!(d.terminate().success());

    // Restarted (empty, in-memory) daemon: the next call reconnects with a new session.
    let d2 = Daemon::start_on(&listen, &[]);
    let l = p.tool(5, "list_models", json!({}));
    assert_eq!(l["isError"], false, "{l}");
    let c = p.tool(
        6,
        "create_model",
        json!({"spec": serde_json::from_str::<Json>(DEMO).unwrap()}),
    );
    assert_eq!(c["isError"], false, "{c}");
    // The subscription was re-made on the new session: a change by another client arrives.
    let mut other = Http::new(&d2);
    other.initialize();
    other.tool(
        1,
        "mutate",
        json!({"id": "demo", "mutations": {"$.qty": 4}}),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "no resources/updated after reconnect"
        );
        let n = p.recv(10);
        if n["method"] == "notifications/resources/updated" {
            break;
        }
    }
}

#[test]
fn bodies_past_max_body_bytes_are_413_and_the_session_keeps_working() {
    let d = Daemon::start(&["--max-body-bytes", "4096"]);
    let mut h = Http::new(&d);
    h.initialize();
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"validate_spec","arguments":{{"spec":{{"id":"{}"}}}}}}}}"#,
        "x".repeat(10_000)
    );
    let r = h.post_with(&big, &[]);
    assert_eq!(r.status, 413, "{:?}", r.body);
    assert_eq!(r.body["error"]["code"], -32600);
    let msg = r.body["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("4096") && msg.contains("--max-body-bytes"),
        "{msg}"
    );

    // Without Content-Length (chunked), the limit holds as the body streams in.
    let sid = h.session.clone().unwrap_or_default();
    let chunk = format!("{:x}\r\n{big}\r\n0\r\n\r\n", big.len());
    let (status, text) = valem_tests::raw_http(
        &d.addr,
        &format!(
            "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Accept: application/json, text/event-stream\r\nMcp-Session-Id: {sid}\r\n\
             MCP-Protocol-Version: 2025-11-25\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{chunk}"
        ),
    );
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("--max-body-bytes"), "{text}");

    let r = h.post(&json!({"jsonrpc": "2.0", "id": 2, "method": "ping"}));
    assert_eq!(r.status, 200);
    assert_eq!(r.body["result"], json!({}));
}

/// Open a connection, send `prefix` (perhaps nothing), then wait: the daemon must close it
/// within `within`. Returns how long it took.
fn closed_after(addr: &str, prefix: &[u8], within: Duration) -> Duration {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(within)).expect("read timeout");
    let t0 = Instant::now();
    s.write_all(prefix).expect("write");
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return t0.elapsed(),
            Ok(_) => {} // a 408 or similar before the close is fine
            Err(e) => panic!("connection still open after {within:?} ({e}); sent {prefix:?}"),
        }
    }
}

#[test]
fn idle_and_slowloris_connections_are_cut_and_the_daemon_keeps_serving() {
    let d = Daemon::start(&["--header-timeout", "0.5"]);
    let limit = Duration::from_secs(5);
    // Connected, silent.
    let t = closed_after(&d.addr, b"", limit);
    assert!(t >= Duration::from_millis(400), "closed too early: {t:?}");
    // Half a request line, then nothing; headers trickling in without an end.
    closed_after(&d.addr, b"POST /mcp HT", limit);
    closed_after(
        &d.addr,
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1\r\n",
        limit,
    );
    // A keep-alive connection that goes idle after its first response.
    closed_after(
        &d.addr,
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        limit,
    );
    // Twenty silent connections at once do not stop a real client.
    let idle: Vec<_> = (0..20)
        .map(|_| std::net::TcpStream::connect(&d.addr).expect("connect"))
        .collect();
    let mut h = Http::new(&d);
    h.initialize();
    let r = h.post(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}));
    assert_eq!(r.status, 200);
    drop(idle);
    let (status, _) = valem_tests::raw_http(
        &d.addr,
        "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, 200);
}

/// A request refused before its body arrived leaves unread bytes on the wire, so the daemon
/// closes that connection after answering: the answer must say so (`Connection: close`), or a
/// client pooling the connection sends its next request into a closing socket. A refusal after
/// the body was read (the SDK's `server/discover` probe at a version we do not speak) keeps the
/// connection, and the handshake that follows goes down the same one.
#[test]
fn refusals_say_when_the_connection_closes_and_keep_it_when_the_body_was_read() {
    use std::io::{Read, Write};
    let d = Daemon::start(&[]);

    // Headers only: the body (20 bytes, declared) is never sent. REST refuses the media type.
    let mut s = std::net::TcpStream::connect(&d.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    s.write_all(
        b"POST /models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n\
          Content-Length: 20\r\n\r\n",
    )
    .expect("write");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out); // the daemon closes: read_to_end ends
    let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 415"), "{text}");
    assert!(text.contains("\r\nconnection: close\r\n"), "{text}");

    // The probe, body and all, at a protocol version this server does not speak.
    let mut c = valem_tests::load::Conn::open(&d.addr).expect("connect");
    let mcp = [
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
    ];
    let mut probe = mcp.to_vec();
    probe.push(("MCP-Protocol-Version", "2099-01-01"));
    let r = c
        .request(
            "POST",
            "/mcp",
            &probe,
            br#"{"jsonrpc":"2.0","id":1,"method":"server/discover","params":{}}"#,
        )
        .expect("probe answered");
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("connection"), None);
    let init = json!({"jsonrpc": "2.0", "id": 2, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}});
    let r = c
        .request("POST", "/mcp", &mcp, init.to_string().as_bytes())
        .expect("the same connection answers the handshake");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.header("mcp-session-id").is_some());
}
