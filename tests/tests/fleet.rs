//! Daemons sharing one PostgreSQL database as a fleet (`--store … --node-id … --advertise …`),
//! against real processes and a real server: one owner per model, a request for a model
//! another live node owns forwarded to that node, a dead node's models claimed by
//! the next request once their lease ran out (nothing acknowledged lost, the chain continued),
//! and an owner paused past its lease (SIGSTOP) committing nothing more once another node took
//! the model. A REST request reaching a node that does not own its model is forwarded to the
//! owner (`X-Valem-Node` names the node that answered); a keyed write sent again after its
//! owner died is answered by the new owner from its key, not applied twice. And the whole: three nodes behind
//! HAProxy, 16 clients writing 50 models while nodes are killed with -9 and restarted five
//! times, every write sent again under its idempotency key until answered: nothing
//! acknowledged lost or doubled, every chain valid without gap, no write waiting longer than the
//! lease plus 3 s.

use std::time::Duration;

use serde_json::{json, Value};
use valem_tests::backing::Backing;
use valem_tests::{Daemon, Http};

const LEASE_MS: u64 = 1000;

const COUNTERS: &str = r#"{"id":"counters","version":"1","schema":{},
  "derivations":[{"path":"$.total","expr":"$sum([c0, c1])"}]}"#;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Node `id` of the fleet on `b`'s database, listening on `port`.
fn node(b: &Backing, id: &str, port: u16) -> Daemon {
    node_with(b, id, port, &[])
}

/// [`node`] with `extra` flags.
fn node_with(b: &Backing, id: &str, port: u16, extra: &[&str]) -> Daemon {
    let listen = format!("127.0.0.1:{port}");
    let url = format!("http://{listen}");
    let lease = LEASE_MS.to_string();
    let store = b.args();
    let mut flags = vec!["--node-id", id, "--advertise", &url, "--lease-ms", &lease];
    flags.extend_from_slice(extra);
    let args = b.with(&store, &flags);
    Daemon::start_on(&listen, &args)
}

/// Nodes `a` and `b` on `b`'s database: a's port, a, a's client, b, b's client.
fn two_nodes(b: &Backing) -> (u16, Daemon, Http, Daemon, Http) {
    let (pa, pb) = (free_port(), free_port());
    let a = node(b, "a", pa);
    let nb = node(b, "b", pb);
    let (ha, hb) = (Http::new(&a), Http::new(&nb));
    (pa, a, ha, nb, hb)
}

/// `r` is a 200 that node `node` gave.
fn answered_by(r: &valem_tests::Reply, node: &str) {
    assert_eq!(
        (r.status, r.header("x-valem-node")),
        (200, Some(node)),
        "{}",
        r.text()
    );
}

fn counters(id: &str) -> Value {
    let mut v: Value = serde_json::from_str(COUNTERS).expect("spec");
    v["id"] = json!(id);
    v
}

fn signal(d: &Daemon, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &d.pid().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig}");
}

/// A tools/call in MCP's modern era (no session): the JSON-RPC answer and the node that gave it.
fn modern_call(http: &Http, id: u64, tool: &str, args: Value) -> (Value, Option<String>) {
    let r = valem_tests::modern_tool_call(http, id, tool, args);
    assert_eq!(r.status, 200, "{r:?}");
    (r.json(), r.header("x-valem-node").map(str::to_string))
}

/// `a` takes model m over from `paused` (stopped past its lease, then resumed): `write` is
/// committed by `a` meanwhile.
fn take_over_while_paused(paused: &Daemon, ha: &Http, write: Value) {
    signal(paused, "-STOP");
    past_the_lease();
    let r = ha.post_json("/models/m/mutations", &write);
    answered_by(&r, "a");
    signal(paused, "-CONT");
}

fn past_the_lease() {
    std::thread::sleep(Duration::from_millis(LEASE_MS + 400));
}

#[test]
fn one_owner_per_model_failover_after_kill_9_and_a_paused_owner_is_fenced() {
    let b = Backing::postgres();
    let (pa, a, ha, nb, hb) = two_nodes(&b);

    // Created on a, a owns it: b forwards to a, reads and writes alike.
    assert_eq!(ha.post_json("/models", &counters("m")).status, 201);
    for v in 1..=3 {
        let h = if v == 2 { &hb } else { &ha };
        let r = h.post_json("/models/m/mutations", &json!({"$.c0": v}));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-valem-node"), Some("a"), "answered by the owner");
    }
    let r = hb.get("/models/m/state");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["c0"], json!(3));
    assert_eq!(r.header("x-valem-node"), Some("a"));
    let r = hb.post_json("/models", &counters("m"));
    assert_eq!(
        r.status,
        409,
        "a create of an id owned elsewhere: {}",
        r.text()
    );
    // MCP in the modern era too: a tool call on b about a's model is answered by a.
    let (v, by) = modern_call(
        &hb,
        7,
        "mutate",
        json!({"id": "m", "mutations": {"$.c1": 5}}),
    );
    assert_eq!(
        (v["result"]["isError"].clone(), by.as_deref()),
        (json!(false), Some("a")),
        "{v}"
    );
    let (v, by) = modern_call(&hb, 8, "get_state", json!({"id": "m"}));
    assert_eq!(v["result"]["structuredContent"]["total"], json!(8), "{v}");
    assert_eq!(by.as_deref(), Some("a"));
    let forwarded = valem_tests::metric(&hb, "valem_forwards_total{outcome=\"answered\"}");
    assert!(forwarded.unwrap_or(0.0) >= 5.0, "{forwarded:?}");
    let owner = hb.get("/cluster/owner/m").json();
    assert_eq!(
        (owner["owner"].clone(), owner["epoch"].clone()),
        (json!("a"), json!(1))
    );
    let cluster = hb.get("/cluster").json();
    assert_eq!(cluster["fleet"], json!(true), "{cluster}");
    let nodes = cluster["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 2, "{cluster}");
    assert!(nodes.iter().all(|n| n["alive"] == json!(true)), "{cluster}");
    assert_eq!(
        hb.get("/models").json(),
        json!(["m"]),
        "every node lists the fleet's models"
    );

    // A keyed write (through b, applied by a) whose answer the client will say it lost.
    let keyed = |h: &Http| {
        h.post(
            "/models/m/mutations",
            &[
                ("Content-Type", "application/json"),
                ("Idempotency-Key", "retry-1"),
            ],
            br#"{"$.c1": 6}"#,
        )
    };
    let first = keyed(&hb);
    answered_by(&first, "a");

    // a dies: after its lease, the next request on b claims m and recovers it whole.
    a.kill9();
    past_the_lease();
    let state = hb.get("/models/m/state");
    assert_eq!(state.status, 200, "{}", state.text());
    assert_eq!(
        (state.json()["c0"].clone(), state.json()["c1"].clone()),
        (json!(3), json!(6)),
        "every acknowledged write is there"
    );
    assert_eq!(state.header("x-valem-node"), Some("b"));
    // The keyed write sent again reaches the new owner: answered as before, not applied twice.
    let again = keyed(&hb);
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("x-valem-node"), Some("b"));
    assert_eq!(
        again.json()["derivedUpdated"],
        first.json()["derivedUpdated"]
    );
    let r = hb.post_json("/models/m/mutations", &json!({"$.c0": 4}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = hb.get("/models/m/audit/verify").json();
    assert_eq!(
        (v["valid"].clone(), v["recordsChecked"].clone()),
        (json!(true), json!(6)),
        "{v}"
    );
    let owner = hb.get("/cluster/owner/m").json();
    assert_eq!(
        (owner["owner"].clone(), owner["epoch"].clone()),
        (json!("b"), json!(2))
    );
    // b counts it: one failover, and the claims it was refused while a lived.
    let metric = |h: &Http, name: &str| valem_tests::metric(h, name).unwrap_or(-1.0);
    assert_eq!(
        metric(&hb, "valem_fleet_claims_total{kind=\"failover\"}"),
        1.0
    );
    assert!(metric(&hb, "valem_fleet_claims_refused_total") >= 1.0);
    assert_eq!(metric(&hb, "valem_fleet_claims_total{kind=\"new\"}"), 0.0);

    // a comes back; b owns m now, and a forwards to it.
    let a = node(&b, "a", pa);
    let ha = Http::new(&a);
    let r = ha.get("/models/m/state");
    answered_by(&r, "b");

    // b is paused past its lease: a takes m over; b, resumed, commits nothing more on it.
    signal(&nb, "-STOP");
    past_the_lease();
    let r = ha.post_json("/models/m/mutations", &json!({"$.c1": 10}));
    assert_eq!(r.status, 200, "{}", r.text());
    signal(&nb, "-CONT");
    // b's first write either hits its fence (it still thought it owned m: refused, nothing
    // committed) or, once b noticed the loss, is forwarded to a and committed there.
    let r = hb.post_json("/models/m/mutations", &json!({"$.c0": 99}));
    let accepted = r.status == 200;
    if accepted {
        assert_eq!(
            r.header("x-valem-node"),
            Some("a"),
            "b committed after losing m"
        );
    } else {
        assert_eq!(r.status, 503, "{}", r.text());
    }
    let state = ha.get("/models/m/state").json();
    let c0 = if accepted { 99 } else { 4 };
    assert_eq!(
        (state["c0"].clone(), state["c1"].clone()),
        (json!(c0), json!(10)),
        "{state}"
    );
    let v = ha.get("/models/m/audit/verify").json();
    let records = if accepted { 8 } else { 7 };
    assert_eq!(
        (v["valid"].clone(), v["recordsChecked"].clone()),
        (json!(true), json!(records)),
        "{v}"
    );
    // b knows it lost m: what it is asked now, a answers.
    std::thread::sleep(Duration::from_millis(LEASE_MS / 2));
    assert_eq!(metric(&hb, "valem_fleet_models_lost_total"), 1.0);
    assert_eq!(
        metric(&ha, "valem_fleet_claims_total{kind=\"failover\"}"),
        1.0
    );
    let r = hb.get("/models/m/state");
    answered_by(&r, "a");
    // The owner gone, its lease still running: 503 with Retry-After, then b takes over.
    a.kill9();
    let r = hb.get("/models/m/state");
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    // Over MCP, a tool error the agent can read.
    let (v, _) = modern_call(&hb, 9, "get_state", json!({"id": "m"}));
    assert_eq!(v["result"]["isError"], json!(true), "{v}");
    let text = v["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(text.contains("did not answer"), "{v}");
    past_the_lease();
    let r = hb.get("/models/m/state");
    answered_by(&r, "b");
    assert!(nb.terminate().success());
}

/// A write of `$.c0 = v` through `h`, heard on `ws` as the next frame.
fn hears(ws: &mut tungstenite::WebSocket<std::net::TcpStream>, h: &Http, v: i64) {
    let r = h.post_json("/models/m/mutations", &json!({"$.c0": v}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(valem_tests::ws_frame(ws)["mutatedPaths"], json!(["$.c0"]));
}

/// The close frame that ends `ws` next (text frames before it are skipped): its code.
fn closed_with(ws: &mut tungstenite::WebSocket<std::net::TcpStream>) -> (u16, String) {
    loop {
        match ws.read() {
            Ok(tungstenite::Message::Close(Some(f))) => {
                return (u16::from(f.code), f.reason.to_string())
            }
            Ok(tungstenite::Message::Close(None)) => return (1005, String::new()),
            Ok(_) => {}
            Err(e) => panic!("no close frame: {e}"),
        }
    }
}

#[test]
fn a_subscription_on_any_node_hears_the_owner_and_follows_the_model() {
    let b = Backing::postgres();
    let (pa, a, ha, nb, hb) = two_nodes(&b);
    assert_eq!(ha.post_json("/models", &counters("m")).status, 201);

    // Subscribed on b, which does not own m: the owner's frames, whoever wrote.
    let mut ws = valem_tests::ws_open(&nb, "/models/m/subscribe?paths=$.c0");
    for (h, v) in [(&ha, 1), (&hb, 2)] {
        let r = h.post_json("/models/m/mutations", &json!({"$.c0": v, "$.c1": v}));
        assert_eq!(r.status, 200, "{}", r.text());
        let f = valem_tests::ws_frame(&mut ws);
        assert_eq!(
            (
                f["kind"].clone(),
                f["modelId"].clone(),
                f["mutatedPaths"].clone()
            ),
            (json!("mutation"), json!("m"), json!(["$.c0", "$.c1"])),
            "{f}"
        );
    }
    // Filtered by the owner as asked: a write outside `$.c0` sends nothing.
    assert_eq!(
        ha.post_json("/models/m/mutations", &json!({"$.c1": 7}))
            .status,
        200
    );

    // The owner dies: the relayed socket ends with 1012 ("subscribe again").
    a.kill9();
    let (code, reason) = closed_with(&mut ws);
    assert_eq!(code, 1012, "{reason}");
    assert!(reason.contains("subscribe again"), "{reason}");
    // After the lease, subscribing again on b claims m there and hears its writes.
    past_the_lease();
    let mut ws = valem_tests::ws_open(&nb, "/models/m/subscribe");
    let r = hb.post_json("/models/m/mutations", &json!({"$.c0": 3}));
    answered_by(&r, "b");
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(f["mutatedPaths"], json!(["$.c0"]), "{f}");

    // a comes back and takes m over while b is paused past its lease: b, resumed, notices
    // the loss at its next use of m and ends its subscribers with 1012.
    let a = node(&b, "a", pa);
    let ha = Http::new(&a);
    take_over_while_paused(&nb, &ha, json!({"$.c0": 4}));
    let r = hb.get("/models/m/state");
    assert_eq!(r.status, 200, "{}", r.text());
    let (code, reason) = closed_with(&mut ws);
    assert_eq!(code, 1012, "{reason}");
    assert!(reason.contains("moved to another node"), "{reason}");
    // Subscribed on b again: relayed from a.
    let mut ws = valem_tests::ws_open(&nb, "/models/m/subscribe");
    hears(&mut ws, &ha, 5);
    drop(ws);
    assert!(a.terminate().success());
    assert!(nb.terminate().success());
}

const ACCEPT: (&str, &str) = ("Accept", "application/json, text/event-stream");

/// A legacy MCP session (the initialize handshake) on `h`'s node: its id.
fn legacy_session(h: &Http) -> String {
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "valem-tests", "version": "1"}}});
    let r = h.post(
        "/mcp",
        &[("Content-Type", "application/json"), ACCEPT],
        init.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let sid = r
        .header("mcp-session-id")
        .expect("a session id")
        .to_string();
    let done = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let r = h.post(
        "/mcp",
        &[
            ("Content-Type", "application/json"),
            ACCEPT,
            ("Mcp-Session-Id", &sid),
            ("MCP-Protocol-Version", "2025-11-25"),
        ],
        done.to_string().as_bytes(),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    sid
}

/// A `tools/call` in legacy session `sid`: its result.
fn legacy_call(h: &Http, sid: &str, id: u64, tool: &str, args: Value, meta: Value) -> Value {
    let msg = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": tool, "arguments": args, "_meta": meta}});
    let r = h.post(
        "/mcp",
        &[
            ("Content-Type", "application/json"),
            ACCEPT,
            ("Mcp-Session-Id", sid),
            ("MCP-Protocol-Version", "2025-11-25"),
        ],
        msg.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["id"], json!(id), "{v}");
    assert!(v["result"].get("resultType").is_none(), "{v}");
    v["result"].clone()
}

#[test]
fn a_legacy_mcp_session_reaches_models_other_nodes_own() {
    let b = Backing::postgres();
    let (_pa, a, ha, nb, hb) = two_nodes(&b);
    assert_eq!(ha.post_json("/models", &counters("m")).status, 201);

    // A session on b: its calls about a's model are answered by a.
    let sid = legacy_session(&hb);
    let key = json!({"io.valem/idempotencyKey": "legacy-1"});
    let w = legacy_call(
        &hb,
        &sid,
        2,
        "mutate",
        json!({"id": "m", "mutations": {"$.c0": 4}}),
        key.clone(),
    );
    assert_eq!(w["isError"], json!(false), "{w}");
    // Sent again with its key: answered, not applied again.
    let again = legacy_call(
        &hb,
        &sid,
        3,
        "mutate",
        json!({"id": "m", "mutations": {"$.c0": 4}}),
        key,
    );
    assert_eq!(
        again["structuredContent"], w["structuredContent"],
        "{again}"
    );
    let s = legacy_call(&hb, &sid, 4, "get_state", json!({"id": "m"}), json!({}));
    assert_eq!(s["structuredContent"]["total"], json!(4), "{s}");
    let v = ha.get("/models/m/audit/verify").json();
    assert_eq!(v["recordsChecked"], json!(1), "{v}");
    let forwarded = valem_tests::metric(&hb, "valem_forwards_total{outcome=\"answered\"}");
    assert!(forwarded.unwrap_or(0.0) >= 3.0, "{forwarded:?}");
    // What is not about a model runs in the session here.
    let l = legacy_call(&hb, &sid, 5, "list_models", json!({}), json!({}));
    assert_eq!(l["isError"], json!(false), "{l}");
    // An unknown model is this node's to say.
    let u = legacy_call(&hb, &sid, 6, "get_state", json!({"id": "nope"}), json!({}));
    assert_eq!(u["isError"], json!(true), "{u}");

    // The owner gone, past its lease: the session's next call claims the model on b.
    a.kill9();
    past_the_lease();
    let s = legacy_call(&hb, &sid, 7, "get_state", json!({"id": "m"}), json!({}));
    assert_eq!(s["structuredContent"]["c0"], json!(4), "{s}");
    assert_eq!(hb.get("/cluster/owner/m").json()["owner"], json!("b"));
    assert!(nb.terminate().success());
}

/// The GET stream of legacy session `sid` on `addr`: its messages, as they come.
fn session_stream(addr: &str, sid: &str) -> std::sync::mpsc::Receiver<Value> {
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent();
    let res = agent
        .get(format!("http://{addr}/mcp"))
        .header("Accept", "text/event-stream")
        .header("Mcp-Session-Id", sid)
        .header("MCP-Protocol-Version", "2025-11-25")
        .call()
        .expect("GET /mcp");
    assert_eq!(res.status().as_u16(), 200);
    sse_messages(res)
}

/// The next `notifications/resources/updated` on `rx` (within 10 s): its URI.
fn updated(rx: &std::sync::mpsc::Receiver<Value>) -> String {
    loop {
        let m = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a resources/updated notification within 10 s");
        if m["method"] == json!("notifications/resources/updated") {
            return m["params"]["uri"].as_str().unwrap_or_default().to_string();
        }
    }
}

#[test]
fn mcp_subscriptions_on_any_node_hear_the_owners_commits() {
    let b = Backing::postgres();
    let (pa, a, ha, nb, hb) = two_nodes(&b);
    assert_eq!(ha.post_json("/models", &counters("m")).status, 201);
    let sid = legacy_session(&hb);
    let r = hb.post(
        "/mcp",
        &[
            ("Content-Type", "application/json"),
            ACCEPT,
            ("Mcp-Session-Id", &sid),
            ("MCP-Protocol-Version", "2025-11-25"),
        ],
        json!({"jsonrpc": "2.0", "id": 2, "method": "resources/subscribe",
            "params": {"uri": "valem://state/m"}})
        .to_string()
        .as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let rx = session_stream(&nb.addr, &sid);
    // The relay subscribes on a: writes there (and through b) are heard in b's session.
    let mut heard = false;
    for v in 1..=20 {
        assert_eq!(
            ha.post_json("/models/m/mutations", &json!({"$.c0": v}))
                .status,
            200
        );
        if rx.recv_timeout(Duration::from_millis(250)).is_ok_and(|m| {
            m["method"] == json!("notifications/resources/updated")
                && m["params"]["uri"] == json!("valem://state/m")
        }) {
            heard = true;
            break;
        }
    }
    assert!(heard, "b's session heard none of a's commits");
    assert_eq!(
        hb.post_json("/models/m/mutations", &json!({"$.c1": 1}))
            .status,
        200
    );
    assert_eq!(updated(&rx), "valem://state/m");
    // A modern-era `subscriptions/listen` stream on b naming m: relayed the same way.
    let listen = listen_stream(&nb.addr, "valem://state/m");
    let ack = listen
        .recv_timeout(Duration::from_secs(10))
        .expect("the acknowledgement");
    assert_eq!(
        ack["method"],
        json!("notifications/subscriptions/acknowledged"),
        "{ack}"
    );
    assert!(
        heard_while_writing(&ha, "$.c1", 1..=20, &listen),
        "b's listen stream heard none of a's commits"
    );

    // The owner dies; once b owns m, its own commits are heard (the relays stand down).
    a.kill9();
    past_the_lease();
    let r = hb.post_json("/models/m/mutations", &json!({"$.c1": 2}));
    answered_by(&r, "b");
    assert_eq!(updated(&rx), "valem://state/m");
    assert_eq!(updated(&listen), "valem://state/m");

    // a comes back and takes m while b is paused past its lease: b's session hears a again
    // (the relay finds the new owner; at once when b notices the loss, else within seconds).
    let a = node(&b, "a", pa);
    let ha = Http::new(&a);
    take_over_while_paused(&nb, &ha, json!({"$.c0": 100}));
    while rx.try_recv().is_ok() {}
    assert!(
        heard_while_writing(&ha, "$.c0", 101..=140, &rx),
        "b's session heard none of a's commits after a took m back"
    );
    assert!(a.terminate().success());
    assert!(nb.terminate().success());
}

/// Write each of `values` to `field` of m through `h` until `rx` hears m's state updated
/// within 250 ms of a write; whether it did.
fn heard_while_writing(
    h: &Http,
    field: &str,
    values: std::ops::RangeInclusive<i64>,
    rx: &std::sync::mpsc::Receiver<Value>,
) -> bool {
    for v in values {
        assert_eq!(
            h.post_json("/models/m/mutations", &json!({ field: v }))
                .status,
            200
        );
        let heard = rx.recv_timeout(Duration::from_millis(250)).is_ok_and(|m| {
            m["method"] == json!("notifications/resources/updated")
                && m["params"]["uri"] == json!("valem://state/m")
        });
        if heard {
            return true;
        }
    }
    false
}

/// A modern-era `subscriptions/listen` stream on `addr` for one state URI: its messages.
fn listen_stream(addr: &str, uri: &str) -> std::sync::mpsc::Receiver<Value> {
    let body = json!({"jsonrpc": "2.0", "id": 70, "method": "subscriptions/listen", "params": {
        "notifications": {"resourceSubscriptions": [uri]},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "valem-tests", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}}});
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent();
    let res = agent
        .post(format!("http://{addr}/mcp"))
        .header("Content-Type", "application/json")
        .header("Accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", "2026-07-28")
        .header("Mcp-Method", "subscriptions/listen")
        .send(body.to_string().as_bytes())
        .expect("POST subscriptions/listen");
    assert_eq!(res.status().as_u16(), 200);
    sse_messages(res)
}

/// The JSON messages of an SSE answer, as they come, on a thread of their own.
fn sse_messages(res: ureq::http::Response<ureq::Body>) -> std::sync::mpsc::Receiver<Value> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let reader = std::io::BufReader::new(res.into_body().into_reader());
        for line in reader.lines() {
            let Ok(line) = line else { break };
            if let Some(m) = line
                .strip_prefix("data:")
                .and_then(|d| serde_json::from_str::<Value>(d.trim()).ok())
            {
                if tx.send(m).is_err() {
                    break;
                }
            }
        }
    });
    rx
}

#[test]
fn nodes_with_an_api_key_call_each_other_with_it() {
    const KEY: &str = "fleet-key-0123456789abcdef";
    let b = Backing::postgres();
    let (pa, pb) = (free_port(), free_port());
    let a = node_with(&b, "a", pa, &["--api-key", KEY]);
    let nb = node_with(&b, "b", pb, &["--api-key", KEY]);
    let (ha, hb) = (Http::new(&a).with_key(KEY), Http::new(&nb).with_key(KEY));
    assert_eq!(ha.post_json("/models", &counters("m")).status, 201);
    // Without the key, b refuses before anything else; with it, b forwards to a with its own.
    assert_eq!(Http::new(&nb).get("/models/m/state").status, 401);
    let r = hb.post_json("/models/m/mutations", &json!({"$.c0": 2}));
    answered_by(&r, "a");
    let (v, by) = modern_call(&hb, 1, "get_state", json!({"id": "m"}));
    assert_eq!(
        (
            v["result"]["structuredContent"]["c0"].clone(),
            by.as_deref()
        ),
        (json!(2), Some("a")),
        "{v}"
    );
    // The WebSocket, keyed by `?token=` as browsers send it, relayed from a with b's key.
    let mut ws = valem_tests::ws_open(&nb, &format!("/models/m/subscribe?token={KEY}"));
    hears(&mut ws, &ha, 3);
    drop(ws);
    assert!(a.terminate().success());
    assert!(nb.terminate().success());
}

#[test]
fn a_fleet_node_needs_the_database_a_sound_id_and_an_url() {
    let cases: [(&[&str], &str); 3] = [
        (
            &[
                "--data-dir",
                "/nonexistent-valem",
                "--node-id",
                "a",
                "--advertise",
                "http://h:1",
            ],
            "--node-id needs --store",
        ),
        (
            &[
                "--store",
                "postgres://v@127.0.0.1:1/x",
                "--node-id",
                "a b",
                "--advertise",
                "http://h:1",
            ],
            "--node-id must be 1 to 128 characters",
        ),
        (
            &[
                "--store",
                "postgres://v@127.0.0.1:1/x",
                "--node-id",
                "a",
                "--advertise",
                "h:1",
            ],
            "--advertise must be the http:// or https:// URL",
        ),
    ];
    for (args, says) in cases {
        let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let out = valem_tests::run(&all, None);
        let err = valem_tests::stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// HAProxy (Debian's `haproxy`, which scripts/test installs) round-robin over `ports` on
/// `port`, health-checked on /healthz every 200 ms; a request that cannot connect is sent to
/// another node.
struct Proxy {
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Proxy {
    fn start(port: u16, ports: &[u16]) -> Proxy {
        let dir = tempfile::tempdir().expect("a directory for the proxy");
        let servers: String = ports
            .iter()
            .enumerate()
            .map(|(i, p)| {
                format!("    server n{i} 127.0.0.1:{p} check inter 200ms fall 1 rise 1\n")
            })
            .collect();
        let cfg = format!(
            "global\n    maxconn 512\ndefaults\n    mode http\n    timeout connect 1s\n    timeout client 30s\n    timeout server 30s\n    option redispatch\n    retries 3\nfrontend f\n    bind 127.0.0.1:{port}\n    default_backend b\nbackend b\n    balance roundrobin\n    option httpchk GET /healthz\n{servers}"
        );
        let path = dir.path().join("haproxy.cfg");
        std::fs::write(&path, cfg).expect("write the config");
        let bin = ["/usr/sbin/haproxy", "/usr/local/sbin/haproxy"]
            .into_iter()
            .find(|b| std::path::Path::new(b).exists())
            .expect("haproxy is installed (scripts/test installs Debian's haproxy)");
        let child = std::process::Command::new(bin)
            .arg("-f")
            .arg(&path)
            .arg("-db")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start haproxy");
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Proxy { child, _dir: dir }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One client's write of `$.n = value` to `model` through the proxy, sent as it is (same
/// idempotency key) until an answer is 200: a write whose answer was lost, or that a dying
/// node refused, is simply sent again, and its key makes sure it is applied once. Returns how
/// long it took.
fn write_until_known(proxy: &str, model: &str, value: i64) -> Duration {
    use valem_tests::load::Conn;
    let started = std::time::Instant::now();
    let body = json!({"$.n": value}).to_string();
    let key = format!("{model}-{value}");
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{model}: write {value} not done in 30 s"
        );
        if let Ok(mut c) = Conn::open(proxy) {
            let sent = c.request(
                "POST",
                &format!("/models/{model}/mutations"),
                &[
                    ("Content-Type", "application/json"),
                    ("Idempotency-Key", &key),
                ],
                body.as_bytes(),
            );
            if matches!(&sent, Ok(r) if r.status == 200) {
                return started.elapsed();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sixteen_clients_through_haproxy_lose_nothing_while_nodes_are_killed_and_restarted() {
    const MODELS: usize = 50;
    const CLIENTS: usize = 16;
    let b = Backing::postgres();
    let ports = [free_port(), free_port(), free_port()];
    let ids = ["n0", "n1", "n2"];
    let nodes: Vec<Daemon> = ids
        .iter()
        .zip(ports)
        .map(|(id, p)| node(&b, id, p))
        .collect();
    let nodes = std::sync::Mutex::new(nodes.into_iter().map(Some).collect::<Vec<_>>());
    let proxy_port = free_port();
    let _proxy = Proxy::start(proxy_port, &ports);
    let proxy = format!("127.0.0.1:{proxy_port}");
    let hp = Http::new_addr(&proxy);
    for m in 0..MODELS {
        let spec = json!({"id": format!("m{m}"), "version": "1", "schema": {},
            "derivations": [{"path": "$.twice", "expr": "n * 2"}]});
        let r = hp.post_json("/models", &spec);
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (acked, slowest) = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|k| {
                let (proxy, stop) = (proxy.clone(), &stop);
                s.spawn(move || {
                    // Client k alone writes models k, k+16, k+32, k+48: n counts its writes.
                    let mine: Vec<usize> = (k..MODELS).step_by(CLIENTS).collect();
                    let mut acked = vec![0i64; mine.len()];
                    let mut slowest = Duration::ZERO;
                    let mut i = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let j = i % mine.len();
                        let took =
                            write_until_known(&proxy, &format!("m{}", mine[j]), acked[j] + 1);
                        slowest = slowest.max(took);
                        acked[j] += 1;
                        i += 1;
                    }
                    (mine.into_iter().zip(acked).collect::<Vec<_>>(), slowest)
                })
            })
            .collect();
        // Five times: a node killed with -9, restarted under its id half a second later.
        for round in 0..5 {
            std::thread::sleep(Duration::from_millis(1500));
            let victim = round % ports.len();
            let d = nodes.lock().expect("nodes")[victim]
                .take()
                .expect("running");
            d.kill9();
            std::thread::sleep(Duration::from_millis(500));
            let back = node(&b, ids[victim], ports[victim]);
            nodes.lock().expect("nodes")[victim] = Some(back);
        }
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut acked = Vec::new();
        let mut slowest = Duration::ZERO;
        for c in clients {
            let (a, w) = c.join().expect("a client");
            acked.extend(a);
            slowest = slowest.max(w);
        }
        (acked, slowest)
    });
    let total: i64 = acked.iter().map(|(_, n)| n).sum();
    eprintln!("fleet under kills: {total} acknowledged writes, the slowest took {slowest:?}");
    assert!(total > 200, "the clients got writes through: {total}");
    // Every acknowledged write is there, once; every chain verifies without gap or fork.
    for (m, n) in acked {
        let state = hp.get(&format!("/models/m{m}/state")).json();
        assert_eq!(state["n"], json!(n), "m{m}: {state}");
        assert_eq!(state["twice"], json!(2 * n), "m{m}: {state}");
        let v = hp.get(&format!("/models/m{m}/audit/verify")).json();
        assert_eq!(v["valid"], json!(true), "m{m}: {v}");
        assert_eq!(
            v["recordsChecked"],
            json!(n),
            "m{m}: one record per write: {v}"
        );
    }
    // No write waited longer than the lease plus 3 s.
    assert!(
        slowest < Duration::from_millis(LEASE_MS + 3000),
        "a write waited {slowest:?}"
    );
    for d in nodes.into_inner().expect("nodes").into_iter().flatten() {
        assert!(d.terminate().success());
    }
}
