//! One daemon, every surface at once: two agents behind their own stdio proxies
//! (`valem mcp --url`), a WebSocket subscriber and a REST client. A mutation made through any of
//! them is seen by all the others: `notifications/resources/updated` on the proxies, a change
//! frame on the WebSocket, the new value over REST.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valem_tests::{Daemon, Http, Mcp};

const URI: &str = "valem://state/demo";

fn spec() -> Value {
    json!({
        "id": "demo",
        "schema": {"type": "object", "properties": {"price": {"type": "number"}, "qty": {"type": "number"}}},
        "derivations": [{"path": "$.total", "expr": "price * qty"}]
    })
}

/// Read and drop whatever the proxy has already written (notifications of earlier rounds).
fn drain(m: &Mcp) {
    while m.quiet_for(300).is_some() {}
}

/// Wait (bounded) for `notifications/resources/updated` of the demo model on `m`.
fn wait_updated(m: &Mcp, who: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "{who}: no resources/updated for {URI}"
        );
        let n = m.recv(10);
        if n["method"] == "notifications/resources/updated" {
            assert_eq!(n["params"]["uri"], URI, "{who}: {n}");
            return;
        }
    }
}

/// The next change frame on the WebSocket (bounded by the socket's read timeout).
fn total_via(m: &mut Mcp, id: u64) -> Value {
    let f = m.tool(id, "get_field", json!({"id": "demo", "path": "$.total"}));
    assert_eq!(f["isError"], false, "{f}");
    serde_json::from_str(f["content"][0]["text"].as_str().unwrap_or("null")).unwrap_or(Value::Null)
}

#[test]
fn a_mutation_through_any_surface_is_seen_by_all_the_others() {
    let d = Daemon::start(&[]);
    let h = Http::new(&d);
    let url = d.url("");
    let mut a = Mcp::start(&["--url", &url], &[]);
    let mut b = Mcp::start(&["--url", &url], &[]);
    a.handshake("2025-11-25");
    b.handshake("2025-06-18");

    let c = a.tool(1, "create_model", json!({"spec": spec()}));
    assert_eq!(c["isError"], false, "{c}");
    for (m, who) in [(&mut a, "a"), (&mut b, "b")] {
        let s = m.call(2, "resources/subscribe", json!({"uri": URI}));
        assert!(s.get("error").is_none(), "{who}: {s}");
    }
    let mut ws = valem_tests::ws_open(&d, "/models/demo/subscribe");

    // 1. Agent a mutates through its proxy.
    drain(&b);
    let m = a.tool(
        3,
        "mutate",
        json!({"id": "demo", "mutations": {"$.price": 10, "$.qty": 3}}),
    );
    assert_eq!(m["isError"], false, "{m}");
    wait_updated(&b, "b");
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(f["kind"], "mutation", "{f}");
    assert_eq!(f["mutatedPaths"], json!(["$.price", "$.qty"]), "{f}");
    assert_eq!(f["derivedUpdated"], json!(["$.total"]), "{f}");
    assert_eq!(h.get("/models/demo/state/$.total").json(), json!(30));
    assert_eq!(total_via(&mut b, 4), json!(30));

    // 2. A REST client mutates: both agents and the WebSocket hear of it.
    drain(&a);
    drain(&b);
    let r = h.post_json("/models/demo/mutations", &json!({"$.qty": 5}));
    assert_eq!(r.status, 200, "{r:?}");
    wait_updated(&a, "a");
    wait_updated(&b, "b");
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(f["mutatedPaths"], json!(["$.qty"]), "{f}");
    assert_eq!(total_via(&mut a, 5), json!(50));

    // 3. Agent b mutates: agent a, the WebSocket and REST see it.
    drain(&a);
    let m = b.tool(
        6,
        "mutate",
        json!({"id": "demo", "mutations": {"$.price": 2}}),
    );
    assert_eq!(m["isError"], false, "{m}");
    wait_updated(&a, "a");
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(f["mutatedPaths"], json!(["$.price"]), "{f}");
    assert_eq!(h.get("/models/demo/state/$.total").json(), json!(10));
    assert_eq!(total_via(&mut a, 7), json!(10));

    // Three commits, newest first, each the mutation that was made, in the one audit chain.
    let audit = h.get("/models/demo/audit").json();
    let seen: Vec<(Value, Value)> = audit
        .as_array()
        .expect("an array of audit records")
        .iter()
        .map(|r| (r["sequence"].clone(), r["mutations"].clone()))
        .collect();
    assert_eq!(
        seen,
        vec![
            (json!(2), json!({"$.price": 2})),
            (json!(1), json!({"$.qty": 5})),
            (json!(0), json!({"$.price": 10, "$.qty": 3})),
        ]
    );
    assert_eq!(h.get("/models/demo/audit/verify").json()["valid"], true);
}
