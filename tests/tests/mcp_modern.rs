//! MCP 2026-07-28 (the modern era) against the real daemon, `valem mcp` and the stdio proxy:
//! requests without a handshake, `server/discover`, bad input answered with the era's errors
//! (and the daemon serving on), `subscriptions/listen` reached by another agent's and a REST
//! client's writes, tasks created, polled, cancelled and surviving a `kill -9` in their final
//! state, and `pair_browser` as a multi round-trip request through the proxy with a tampered
//! `requestState` refused.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valem_tests::{Daemon, Http, Mcp, Reply};

const V: &str = "2026-07-28";
const TASKS: &str = "io.modelcontextprotocol/tasks";

fn meta(caps: Value) -> Value {
    json!({"io.modelcontextprotocol/protocolVersion": V,
        "io.modelcontextprotocol/clientInfo": {"name": "valem-tests", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": caps})
}

fn with_meta(mut params: Value, caps: Value) -> Value {
    params["_meta"] = meta(caps);
    params
}

/// The standard headers of a modern POST for `msg`.
fn headers_for(msg: &Value) -> Vec<(String, String)> {
    let method = msg["method"].as_str().unwrap_or("").to_string();
    let mut h = vec![
        ("Content-Type".into(), "application/json".into()),
        (
            "Accept".into(),
            "application/json, text/event-stream".into(),
        ),
        ("MCP-Protocol-Version".into(), V.into()),
        ("Mcp-Method".into(), method.clone()),
    ];
    let name = match method.as_str() {
        "tools/call" | "prompts/get" => msg["params"]["name"].as_str(),
        "resources/read" => msg["params"]["uri"].as_str(),
        "tasks/get" | "tasks/update" | "tasks/cancel" => msg["params"]["taskId"].as_str(),
        _ => None,
    };
    if let Some(n) = name {
        h.push(("Mcp-Name".into(), n.into()));
    }
    h
}

fn post(http: &Http, msg: &Value, extra: &[(&str, &str)]) -> Reply {
    let owned = headers_for(msg);
    let mut h: Vec<(&str, &str)> = owned
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    for (k, v) in extra {
        h.retain(|(x, _)| !x.eq_ignore_ascii_case(k));
        h.push((k, v));
    }
    http.post("/mcp", &h, msg.to_string().as_bytes())
}

fn rpc(id: u64, method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
}

fn call(id: u64, tool: &str, args: Value, caps: Value) -> Value {
    rpc(
        id,
        "tools/call",
        with_meta(json!({"name": tool, "arguments": args}), caps),
    )
}

fn ok(r: &Reply) -> Value {
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert!(v.get("error").is_none(), "{v}");
    v["result"].clone()
}

fn demo(id: &str) -> Value {
    json!({"id": id, "schema": {}, "derivations": [{"path": "$.total", "expr": "price * qty"}]})
}

/// An SSE stream read off a raw socket (so that a test can also leave it unread).
struct Stream {
    reader: BufReader<TcpStream>,
}

impl Stream {
    fn open(d: &Daemon, msg: &Value) -> Stream {
        Stream::open_with(d, msg, &[])
    }

    fn open_with(d: &Daemon, msg: &Value, extra: &[(&str, &str)]) -> Stream {
        let mut s = TcpStream::connect(&d.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let body = msg.to_string();
        let mut req = format!("POST /mcp HTTP/1.1\r\nHost: {}\r\n", d.addr);
        for (k, v) in headers_for(msg) {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        for (k, v) in extra {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
        s.write_all(req.as_bytes()).expect("send");
        Stream {
            reader: BufReader::new(s),
        }
    }

    /// No message arrives within `ms` milliseconds.
    fn quiet(&mut self, ms: u64) -> bool {
        self.reader
            .get_ref()
            .set_read_timeout(Some(Duration::from_millis(ms)))
            .expect("timeout");
        let mut line = String::new();
        let quiet = loop {
            line.clear();
            match self.reader.read_line(&mut line) {
                Err(_) => break true,
                Ok(0) => break false,
                Ok(_) if line.starts_with("data:") => break false,
                Ok(_) => {}
            }
        };
        self.reader
            .get_ref()
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        quiet
    }

    /// The next JSON message of the stream (skipping headers, chunk sizes and comments).
    fn next(&mut self) -> Value {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.reader.read_line(&mut line).expect("read the stream");
            assert!(n > 0, "the stream ended");
            if let Some(d) = line.trim_end().strip_prefix("data:") {
                return serde_json::from_str(d.trim()).expect("an SSE data line is JSON");
            }
        }
    }
}

#[test]
fn modern_requests_need_no_handshake_and_bad_ones_get_the_eras_errors() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    // server/discover: versions, capabilities (the tasks extension), identity, caching hints.
    let disc = post(
        &http,
        &rpc(1, "server/discover", json!({"_meta": meta(json!({}))})),
        &[],
    );
    let r = ok(&disc);
    assert_eq!(r["supportedVersions"], json!([V]));
    assert_eq!(r["resultType"], "complete");
    assert!(r["capabilities"]["extensions"][TASKS].is_object(), "{r}");
    assert_eq!(
        r["_meta"]["io.modelcontextprotocol/serverInfo"]["name"],
        "valem"
    );
    assert!(r["ttlMs"].is_u64() && r["cacheScope"] == "public", "{r}");
    assert!(disc.header("mcp-session-id").is_none());
    // A tool call and a read without any session.
    ok(&post(
        &http,
        &call(2, "create_model", json!({"spec": demo("m")}), json!({})),
        &[],
    ));
    let m = ok(&post(
        &http,
        &call(
            3,
            "mutate",
            json!({"id": "m", "mutations": {"$.price": 2, "$.qty": 4}}),
            json!({}),
        ),
        &[],
    ));
    assert_eq!(m["structuredContent"]["success"], true, "{m}");
    let read = rpc(
        4,
        "resources/read",
        with_meta(json!({"uri": "valem://state/m"}), json!({})),
    );
    let r = ok(&post(&http, &read, &[]));
    assert_eq!(r["cacheScope"], "private");
    assert!(
        r["contents"][0]["text"]
            .as_str()
            .unwrap()
            .contains("\"total\": 8"),
        "{r}"
    );

    // Bad input, each with its error, its id echoed, and the right status.
    // (request, headers replaced, HTTP status, JSON-RPC code, what the message names)
    type Case<'a> = (Value, Vec<(&'a str, &'a str)>, u16, i64, &'a str);
    let cases: Vec<Case> = vec![
        // No _meta at all.
        (
            rpc(10, "server/discover", json!({})),
            vec![],
            400,
            -32602,
            "_meta",
        ),
        // _meta without clientCapabilities.
        (
            rpc(
                11,
                "tools/list",
                json!({"_meta": {"io.modelcontextprotocol/protocolVersion": V}}),
            ),
            vec![],
            400,
            -32602,
            "clientCapabilities",
        ),
        // A version we do not speak.
        (
            rpc(
                12,
                "tools/list",
                json!({"_meta": {"io.modelcontextprotocol/protocolVersion": "1900-01-01",
                "io.modelcontextprotocol/clientCapabilities": {}}}),
            ),
            vec![("MCP-Protocol-Version", "1900-01-01")],
            400,
            -32022,
            "1900-01-01",
        ),
        // A header that contradicts the body's version.
        (
            rpc(13, "tools/list", with_meta(json!({}), json!({}))),
            vec![("MCP-Protocol-Version", "2025-11-25")],
            400,
            -32020,
            "MCP-Protocol-Version",
        ),
        // Mcp-Method and Mcp-Name that disagree with the body.
        (
            rpc(14, "tools/list", with_meta(json!({}), json!({}))),
            vec![("Mcp-Method", "prompts/list")],
            400,
            -32020,
            "Mcp-Method",
        ),
        (
            call(15, "list_models", json!({}), json!({})),
            vec![("Mcp-Name", "delete_model")],
            400,
            -32020,
            "Mcp-Name",
        ),
        // Methods the era removed, and an unknown one.
        (
            rpc(16, "ping", with_meta(json!({}), json!({}))),
            vec![],
            404,
            -32601,
            "ping",
        ),
        (
            rpc(
                17,
                "logging/setLevel",
                with_meta(json!({"level": "info"}), json!({})),
            ),
            vec![],
            404,
            -32601,
            "logLevel",
        ),
        // Tasks without the extension, and an unknown task.
        (
            rpc(
                18,
                "tasks/get",
                with_meta(json!({"taskId": "nope"}), json!({})),
            ),
            vec![],
            400,
            -32021,
            TASKS,
        ),
        (
            rpc(
                19,
                "tasks/get",
                with_meta(
                    json!({"taskId": "nope"}),
                    json!({"extensions": {TASKS: {}}}),
                ),
            ),
            vec![],
            200,
            -32602,
            "unknown task",
        ),
        // A missing resource is -32602 in this era.
        (
            rpc(
                20,
                "resources/read",
                with_meta(json!({"uri": "valem://state/nope"}), json!({})),
            ),
            vec![],
            200,
            -32602,
            "nope",
        ),
    ];
    for (msg, extra, status, code, needle) in cases {
        let r = post(&http, &msg, &extra);
        assert_eq!(r.status, status, "{msg}: {r:?}");
        let v = r.json();
        assert_eq!(v["error"]["code"], code, "{msg}: {v}");
        assert_eq!(v["id"], msg["id"], "the id is echoed: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains(needle),
            "{msg}: the message names `{needle}`: {v}"
        );
    }
    let e = post(
        &http,
        &rpc(
            12,
            "tools/list",
            json!({"_meta": {"io.modelcontextprotocol/protocolVersion": "1900-01-01",
        "io.modelcontextprotocol/clientCapabilities": {}}}),
        ),
        &[("MCP-Protocol-Version", "1900-01-01")],
    )
    .json();
    assert_eq!(
        e["error"]["data"],
        json!({"supported": [V], "requested": "1900-01-01"})
    );
    let e = post(
        &http,
        &rpc(
            18,
            "tasks/get",
            with_meta(json!({"taskId": "x"}), json!({})),
        ),
        &[],
    )
    .json();
    assert_eq!(
        e["error"]["data"]["requiredCapabilities"]["extensions"][TASKS],
        json!({})
    );
    // GET and DELETE are not part of the era.
    let g = http.get_with(
        "/mcp",
        &[("Accept", "text/event-stream"), ("MCP-Protocol-Version", V)],
    );
    assert_eq!(g.status, 405, "{g:?}");
    // The legacy era still works beside it, and the daemon serves on.
    let init = http.post_json(
        "/mcp",
        &json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}),
    );
    assert_eq!(init.status, 200, "{init:?}");
    assert!(init.header("mcp-session-id").is_some());
    ok(&post(
        &http,
        &call(30, "get_state", json!({"id": "m"}), json!({})),
        &[],
    ));
}

#[test]
fn a_listen_stream_gets_another_agents_and_a_rest_clients_writes() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    ok(&post(
        &http,
        &call(
            1,
            "create_model",
            json!({"spec": demo("shared")}),
            json!({}),
        ),
        &[],
    ));
    let listen = rpc(
        7,
        "subscriptions/listen",
        with_meta(
            json!({"notifications": {"resourceSubscriptions": ["valem://state/shared", "file:///x"],
                "resourcesListChanged": true}}),
            json!({}),
        ),
    );
    let mut a = Stream::open(&d, &listen);
    let ack = a.next();
    assert_eq!(
        ack["method"], "notifications/subscriptions/acknowledged",
        "{ack}"
    );
    assert_eq!(
        ack["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"],
        7
    );
    // Only what we honour is acknowledged (a file URI is not ours).
    assert_eq!(
        ack["params"]["notifications"],
        json!({"resourcesListChanged": true, "resourceSubscriptions": ["valem://state/shared"]})
    );
    // Agent B (its own requests, no shared session) mutates; then a REST client does.
    ok(&post(
        &http,
        &call(
            2,
            "mutate",
            json!({"id": "shared", "mutations": {"$.price": 1, "$.qty": 1}}),
            json!({}),
        ),
        &[],
    ));
    let u = a.next();
    assert_eq!(u["method"], "notifications/resources/updated", "{u}");
    assert_eq!(u["params"]["uri"], "valem://state/shared");
    assert_eq!(
        u["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"],
        7
    );
    let rest = http.post_json("/models/shared/mutations", &json!({"$.qty": 5}));
    assert_eq!(rest.status, 200, "{rest:?}");
    assert_eq!(a.next()["params"]["uri"], "valem://state/shared");
    // A new model changes the resource list.
    ok(&post(
        &http,
        &call(3, "create_model", json!({"spec": demo("other")}), json!({})),
        &[],
    ));
    assert_eq!(a.next()["method"], "notifications/resources/list_changed");
    // Writes to a model it did not name never reach it.
    ok(&post(
        &http,
        &call(
            4,
            "mutate",
            json!({"id": "other", "mutations": {"$.qty": 1}}),
            json!({}),
        ),
        &[],
    ));
    ok(&post(
        &http,
        &call(
            5,
            "mutate",
            json!({"id": "shared", "mutations": {"$.qty": 6}}),
            json!({}),
        ),
        &[],
    ));
    assert_eq!(a.next()["params"]["uri"], "valem://state/shared");
    // A malformed filter is refused with a clear error.
    let bad = post(
        &http,
        &rpc(
            8,
            "subscriptions/listen",
            with_meta(
                json!({"notifications": {"resourceSubscriptions": "x"}}),
                json!({}),
            ),
        ),
        &[],
    );
    assert_eq!(bad.json()["error"]["code"], -32602, "{bad:?}");
    let metrics = http.get("/metrics").text();
    assert!(metrics.contains("valem_mcp_listens 1"), "{metrics}");
}

#[test]
fn unread_listen_streams_do_not_stop_the_daemon() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    let gauge = |name: &str| -> f64 {
        let m = http.get("/metrics").text();
        let line = m
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_default();
        line.rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1.0)
    };
    let baseline = gauge("valem_event_subscribers");
    assert!(baseline >= 0.0);
    ok(&post(
        &http,
        &call(1, "create_model", json!({"spec": demo("busy")}), json!({})),
        &[],
    ));
    let listen = rpc(
        9,
        "subscriptions/listen",
        with_meta(
            json!({"notifications": {"resourceSubscriptions": ["valem://state/busy"]}}),
            json!({}),
        ),
    );
    // Twenty streams nobody reads, then a stream of writes: every write is answered.
    let idle: Vec<Stream> = (0..20).map(|_| Stream::open(&d, &listen)).collect();
    let start = Instant::now();
    for i in 0..300 {
        let r = http.post_json("/models/busy/mutations", &json!({"$.price": i, "$.qty": 2}));
        assert_eq!(r.status, 200, "write {i}: {r:?}");
    }
    assert!(start.elapsed() < Duration::from_secs(60));
    // A reader that does read still sees the newest writes.
    let mut live = Stream::open(&d, &listen);
    live.next();
    http.post_json("/models/busy/mutations", &json!({"$.qty": 3}));
    assert_eq!(live.next()["method"], "notifications/resources/updated");
    drop(idle);
    drop(live);
    ok(&post(
        &http,
        &call(2, "get_state", json!({"id": "busy"}), json!({})),
        &[],
    ));
    // Closed streams leave nothing behind: no listen is counted open, and after the next
    // commit (of any model) none of their subscribers is left.
    ok(&post(
        &http,
        &call(3, "create_model", json!({"spec": demo("other")}), json!({})),
        &[],
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    while gauge("valem_mcp_listens") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the closed streams were counted open"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = http.post_json("/models/other/mutations", &json!({"$.qty": 1}));
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        gauge("valem_event_subscribers"),
        baseline,
        "the 21 closed streams' subscribers are gone"
    );
}

/// A spec of `n` derivations and `tests` embedded tests (slow enough to watch as a task).
fn big_spec(n: usize, tests: usize) -> Value {
    let derivations: Vec<Value> = (0..n)
        .map(|i| json!({"path": format!("$.d{i}"), "expr": format!("a + {i}")}))
        .collect();
    let cases: Vec<Value> = (0..tests)
        .map(|t| json!({"description": format!("t{t}"), "given": {"$.a": t}, "expect": {"$.d1": t + 1}}))
        .collect();
    json!({"id": "big", "schema": {}, "derivations": derivations, "tests": cases})
}

fn task_status(http: &Http, id: u64, task: &str) -> Value {
    let caps = json!({"extensions": {TASKS: {}}});
    ok(&post(
        http,
        &rpc(id, "tasks/get", with_meta(json!({"taskId": task}), caps)),
        &[],
    ))
}

/// Poll task `task` until it completed (at most 30 s); its detail then.
fn completed(http: &Http, id: u64, task: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let t = task_status(http, id, task);
        if t["status"] == "completed" {
            return t;
        }
        assert!(Instant::now() < deadline, "{t}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn test_spec_runs_as_a_task_polled_and_cancelled() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    let caps = json!({"extensions": {TASKS: {}}});
    // Without the extension the same call answers in place.
    let small = json!({"spec": {"id": "s", "schema": {}, "derivations": [{"path": "$.t", "expr": "a*2"}],
        "tests": [{"given": {"$.a": 2}, "expect": {"$.t": 4}}]}});
    let inline = ok(&post(
        &http,
        &call(1, "test_spec", small.clone(), json!({})),
        &[],
    ));
    assert_eq!(inline["resultType"], "complete");
    // With it: a task handle, polled to completion.
    let h = ok(&post(
        &http,
        &call(2, "test_spec", small, caps.clone()),
        &[],
    ));
    assert_eq!(h["resultType"], "task", "{h}");
    for absent in ["result", "error", "inputRequests", "requestState"] {
        assert!(h.get(absent).is_none(), "{h}");
    }
    let id = h["taskId"].as_str().unwrap().to_string();
    let done = completed(&http, 3, &id);
    assert_eq!(done["result"]["structuredContent"]["passed"], 1, "{done}");
    // A big one: created, seen working, cancelled (terminal at once, and it stays so).
    let h = ok(&post(
        &http,
        &call(
            4,
            "test_spec",
            json!({"spec": big_spec(10_000, 40)}),
            caps.clone(),
        ),
        &[],
    ));
    let id = h["taskId"].as_str().unwrap().to_string();
    assert_eq!(task_status(&http, 5, &id)["status"], "working");
    // Its status changes reach a listen stream that names it.
    let listen = rpc(
        50,
        "subscriptions/listen",
        with_meta(json!({"notifications": {"taskIds": [id]}}), caps.clone()),
    );
    let mut watch = Stream::open(&d, &listen);
    let ack = watch.next();
    assert_eq!(
        ack["params"]["notifications"]["taskIds"],
        json!([id]),
        "{ack}"
    );
    let c = ok(&post(
        &http,
        &rpc(
            6,
            "tasks/cancel",
            with_meta(json!({"taskId": id}), caps.clone()),
        ),
        &[],
    ));
    assert_eq!(
        c,
        json!({"resultType": "complete", "_meta": c["_meta"].clone()})
    );
    assert_eq!(task_status(&http, 7, &id)["status"], "cancelled");
    let n = watch.next();
    assert_eq!(n["method"], "notifications/tasks", "{n}");
    assert_eq!(
        (
            n["params"]["taskId"].as_str(),
            n["params"]["status"].as_str()
        ),
        (Some(id.as_str()), Some("cancelled"))
    );
    assert_eq!(
        n["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"],
        50
    );
    std::thread::sleep(Duration::from_millis(300));
    let t = task_status(&http, 8, &id);
    assert_eq!(t["status"], "cancelled");
    assert!(t.get("result").is_none(), "{t}");
    let metrics = http.get("/metrics").text();
    assert!(
        metrics.contains("valem_mcp_tasks{state=\"kept\"} 2"),
        "{metrics}"
    );
    // Another caller scope cannot see it: a sandbox session's token is refused without pairing,
    // and an unknown id is -32602 (see the errors test).
}

#[test]
fn a_task_running_when_the_daemon_is_killed_reads_failed_after_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().to_str().unwrap().to_string();
    let d = Daemon::start(&["--data-dir", &data]);
    let http = Http::new(&d);
    let caps = json!({"extensions": {TASKS: {}}});
    let h = ok(&post(
        &http,
        &call(
            1,
            "test_spec",
            json!({"spec": big_spec(10_000, 400)}),
            caps.clone(),
        ),
        &[],
    ));
    let id = h["taskId"].as_str().unwrap().to_string();
    assert_eq!(task_status(&http, 2, &id)["status"], "working");
    let addr = d.addr.clone();
    d.kill9();
    let d = Daemon::start_on(&addr, &["--data-dir", &data]);
    let http = Http::new(&d);
    let t = task_status(&http, 3, &id);
    assert_eq!(t["status"], "failed", "{t}");
    assert!(
        t["error"]["message"].as_str().unwrap().contains("stopped"),
        "{t}"
    );
    // A finished task keeps its final state across a clean restart too.
    let small = json!({"spec": {"id": "s", "schema": {}, "tests": []}});
    let h = ok(&post(
        &http,
        &call(4, "test_spec", small, caps.clone()),
        &[],
    ));
    let done_id = h["taskId"].as_str().unwrap().to_string();
    completed(&http, 5, &done_id);
    d.terminate();
    let d = Daemon::start_on(&addr, &["--data-dir", &data]);
    let http = Http::new(&d);
    assert_eq!(task_status(&http, 6, &done_id)["status"], "completed");
    assert_eq!(task_status(&http, 7, &id)["status"], "failed");
}

#[test]
fn stdio_speaks_both_eras_and_listens_until_cancelled() {
    let mut m = Mcp::start(&[], &[]);
    // Modern first: no handshake.
    let disc = m.call(1, "server/discover", json!({"_meta": meta(json!({}))}));
    assert_eq!(disc["result"]["supportedVersions"], json!([V]), "{disc}");
    let c = m.call(
        2,
        "tools/call",
        with_meta(
            json!({"name": "create_model", "arguments": {"spec": demo("s")}}),
            json!({}),
        ),
    );
    assert_eq!(c["result"]["resultType"], "complete", "{c}");
    m.send(&rpc(
        3,
        "subscriptions/listen",
        with_meta(
            json!({"notifications": {"resourceSubscriptions": ["valem://state/s"]}}),
            json!({}),
        ),
    ));
    let ack = m.recv(10);
    assert_eq!(
        ack["method"], "notifications/subscriptions/acknowledged",
        "{ack}"
    );
    m.send(&rpc(4, "tools/call", with_meta(
        json!({"name": "mutate", "arguments": {"id": "s", "mutations": {"$.price": 1, "$.qty": 2}}}), json!({}))));
    let mut got_update = false;
    let mut got_reply = false;
    for _ in 0..2 {
        let msg = m.recv(10);
        if msg["method"] == "notifications/resources/updated" {
            assert_eq!(
                msg["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"],
                3
            );
            got_update = true;
        } else {
            assert_eq!(msg["id"], 4, "{msg}");
            got_reply = true;
        }
    }
    assert!(got_update && got_reply);
    // Cancelled: no more notifications for it.
    m.send(
        &json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 3}}),
    );
    std::thread::sleep(Duration::from_millis(400));
    let r = m.call(
        5,
        "tools/call",
        with_meta(
            json!({"name": "mutate", "arguments": {"id": "s", "mutations": {"$.qty": 3}}}),
            json!({}),
        ),
    );
    assert!(r.get("result").is_some(), "{r}");
    assert_eq!(m.quiet_for(500), None, "no notification after the cancel");
    // A handshake of a legacy revision on the same channel still works.
    let init = m.handshake("2025-11-25");
    assert_eq!(init["protocolVersion"], "2025-11-25");
    let p = m.call(6, "ping", json!({}));
    assert_eq!(p["result"], json!({}));
}

/// `pairCode` and `code` from a verification link's fragment.
fn link_codes(link: &str) -> (String, String) {
    let frag = link.split_once('#').map(|x| x.1).unwrap_or("");
    let get = |k: &str| {
        frag.split('&')
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .to_string()
    };
    (get("pair"), get("code"))
}

#[test]
fn pair_browser_is_a_multi_round_trip_request_through_the_proxy() {
    const KEY: &str = "k3y-for-modern-pairing";
    let d = Daemon::start(&["--api-key", KEY, "--pairing-interval", "1"]);
    let mut p = Mcp::start(&["--url", &d.url(""), "--api-key", KEY, "--browser"], &[]);
    let caps = json!({"elicitation": {"url": {}}});
    let tools = p.call(1, "tools/list", with_meta(json!({}), caps.clone()));
    assert!(
        tools["result"]["tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "pair_browser"),
        "{tools}"
    );
    // Round 1: the link as a URL-mode elicitation, and a sealed state.
    let r1 = p.call(
        2,
        "tools/call",
        with_meta(
            json!({"name": "pair_browser", "arguments": {}}),
            caps.clone(),
        ),
    );
    let r1 = &r1["result"];
    assert_eq!(r1["resultType"], "input_required", "{r1}");
    let ask = &r1["inputRequests"]["pair"];
    assert_eq!(ask["method"], "elicitation/create", "{r1}");
    assert_eq!(ask["params"]["mode"], "url");
    let link = ask["params"]["url"].as_str().unwrap().to_string();
    assert!(link.starts_with(&d.url("/sandbox/#pair=")), "{link}");
    let (pair, code) = link_codes(&link);
    assert!(ask["params"]["message"].as_str().unwrap().contains(&code));
    let state = r1["requestState"].as_str().unwrap().to_string();
    // A tampered state is refused, whatever the change.
    for bad in [
        format!("{state}-TAMPERED"),
        format!("x{state}"),
        "a.b".to_string(),
    ] {
        let r = p.call(
            3,
            "tools/call",
            with_meta(
                json!({"name": "pair_browser", "arguments": {},
            "inputResponses": {"pair": {"action": "accept"}}, "requestState": bad}),
                caps.clone(),
            ),
        );
        assert_eq!(r["error"]["code"], -32602, "{r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("requestState"),
            "{r}"
        );
    }
    // The developer approves in the browser; the retry completes.
    let ok = Http::new(&d).post_json(
        "/sandbox/pair/approve",
        &json!({"pairCode": pair, "userCode": code}),
    );
    assert_eq!(ok.status, 200, "{ok:?}");
    let r2 = p.call(
        4,
        "tools/call",
        with_meta(
            json!({"name": "pair_browser", "arguments": {},
        "inputResponses": {"pair": {"action": "accept"}}, "requestState": state}),
            caps.clone(),
        ),
    );
    let sc = &r2["result"]["structuredContent"];
    assert_eq!(sc["status"], "paired", "{r2}");
    assert_eq!(r2["result"]["resultType"], "complete");
    // From now on the proxy's modern requests are scoped to the paired session.
    let c = p.call(
        5,
        "tools/call",
        with_meta(
            json!({"name": "create_model", "arguments": {"spec": demo("mine")}}),
            json!({}),
        ),
    );
    assert_eq!(c["result"]["isError"], false, "{c}");
    let keyed = Http::new(&d).with_key(KEY);
    let ids: Vec<String> = serde_json::from_value(keyed.get("/models").json()).unwrap();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert!(
        ids[0].ends_with("__mine") && ids[0] != "mine",
        "the session's namespace: {ids:?}"
    );
    let l = p.call(
        6,
        "tools/call",
        with_meta(json!({"name": "list_models", "arguments": {}}), json!({})),
    );
    assert!(
        l["result"]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("mine"),
        "{l}"
    );
}

#[test]
fn a_sessions_modern_requests_see_its_own_models_and_tasks_only() {
    const KEY: &str = "k3y-for-modern-scope";
    let d = Daemon::start(&["--api-key", KEY, "--pairing-interval", "1"]);
    let keyed = Http::new(&d).with_key(KEY);
    let auth = format!("Bearer {KEY}");
    let op = [("Authorization", auth.as_str())];
    assert_eq!(keyed.post_json("/models", &demo("shared")).status, 201);
    let token = valem_tests::paired_token(&d, KEY);
    let me = [("X-Session-Token", token.as_str())];
    let http = Http::new(&d);
    // The session's own `shared` (namespaced by the daemon, `shared` to the session).
    ok(&post(
        &http,
        &call(
            1,
            "create_model",
            json!({"spec": demo("shared")}),
            json!({}),
        ),
        &me,
    ));
    let listen = rpc(
        2,
        "subscriptions/listen",
        with_meta(
            json!({"notifications": {"resourceSubscriptions": ["valem://state/shared"],
                "resourcesListChanged": true}}),
            json!({}),
        ),
    );
    let mut s = Stream::open_with(&d, &listen, &me);
    let ack = s.next();
    assert_eq!(
        ack["params"]["notifications"]["resourceSubscriptions"],
        json!(["valem://state/shared"]),
        "{ack}"
    );
    // The operator's writes and creations never reach the session's stream.
    assert_eq!(
        keyed
            .post_json("/models/shared/mutations", &json!({"$.qty": 9}))
            .status,
        200
    );
    assert_eq!(keyed.post_json("/models", &demo("elsewhere")).status, 201);
    // The session's own write does, under the session's name.
    ok(&post(
        &http,
        &call(
            3,
            "mutate",
            json!({"id": "shared", "mutations": {"$.qty": 1}}),
            json!({}),
        ),
        &me,
    ));
    let u = s.next();
    assert_eq!(
        u["method"], "notifications/resources/updated",
        "the operator's events were skipped: {u}"
    );
    assert_eq!(u["params"]["uri"], "valem://state/shared");
    assert!(
        s.quiet(500),
        "one update only: the operator's write was not the session's"
    );
    // A task belongs to the scope that made it.
    let caps = json!({"extensions": {TASKS: {}}});
    let spec = json!({"spec": {"id": "t", "schema": {}, "tests": []}});
    let h = ok(&post(&http, &call(4, "test_spec", spec, caps.clone()), &me));
    let id = h["taskId"].as_str().unwrap();
    let get = rpc(5, "tasks/get", with_meta(json!({"taskId": id}), caps));
    assert!(ok(&post(&http, &get, &me))["status"].is_string());
    let theirs = post(&http, &get, &op).json();
    assert_eq!(
        theirs["error"]["code"], -32602,
        "the operator does not see the session's task: {theirs}"
    );
}

#[test]
fn a_requests_traceparent_is_in_the_daemons_log() {
    let d = Daemon::start_env(&[], &[("RUST_LOG", "valem_mcp=debug")]);
    let http = Http::new(&d);
    let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut params = with_meta(json!({}), json!({}));
    params["_meta"]["traceparent"] = json!(trace);
    ok(&post(&http, &rpc(1, "tools/list", params), &[]));
    let log = d.stderr_with(trace);
    let line = log.lines().find(|l| l.contains(trace)).unwrap_or_default();
    assert!(
        line.contains("tools/list") && line.contains("mcp request served"),
        "the request's event carries its trace context: {log}"
    );
}
