//! Idempotency keys against the real binary: a write sent again with the `Idempotency-Key`
//! header (REST) or `_meta["io.valem/idempotencyKey"]` (MCP) is applied once and answered as
//! the first time, in memory, after `kill -9` and a restart, and after eviction, on both
//! stores; the same key with another request is refused and changes nothing.

use serde_json::{json, Value};
use valem_tests::backing::Backing;
use valem_tests::{Daemon, Http, Reply};

fn counter(id: &str) -> Value {
    json!({
        "id": id, "version": "1.0.0",
        "schema": {"type": "object", "properties": {
            "price": {"type": "number"}, "qty": {"type": "number"}, "n": {"type": "integer"},
            "items": {"type": "array"}
        }},
        "derivations": [{"path": "$.total", "expr": "price * qty"}]
    })
}

fn keyed(http: &Http, path: &str, key: &str, body: &Value) -> Reply {
    http.post(
        path,
        &[
            ("Content-Type", "application/json"),
            ("Idempotency-Key", key),
        ],
        body.to_string().as_bytes(),
    )
}

/// The answer without its traces (a replayed answer carries none).
fn untraced(r: &Reply) -> Value {
    let mut v = r.json();
    if let Some(m) = v.as_object_mut() {
        m.remove("traces");
    }
    v
}

fn records(http: &Http, id: &str) -> usize {
    let a = http.get(&format!("/models/{id}/audit?limit=1000")).json();
    a.as_array().map_or(0, Vec::len)
}

fn replays(http: &Http) -> f64 {
    valem_tests::metric(http, "valem_idempotent_replays_total").expect("the replay counter")
}

/// A modern-era `tools/call` of `mutate` with an idempotency key in its `_meta`.
fn mcp_mutate(http: &Http, id: u64, key: &str, args: Value) -> Value {
    let msg = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": "mutate", "arguments": args,
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "valem-tests", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.valem/idempotencyKey": key}}});
    let r = http.post(
        "/mcp",
        &[
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
            ("MCP-Protocol-Version", "2026-07-28"),
            ("Mcp-Method", "tools/call"),
            ("Mcp-Name", "mutate"),
        ],
        msg.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["result"].clone()
}

#[test]
fn a_keyed_write_is_applied_once_and_answered_again_in_memory() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    assert_eq!(http.post_json("/models", &counter("m")).status, 201);
    let body = json!({"$.price": 3, "$.qty": 4});
    let first = keyed(&http, "/models/m/mutations", "order-1", &body);
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("idempotent-replayed"), None);
    for _ in 0..3 {
        let again = keyed(&http, "/models/m/mutations", "order-1", &body);
        assert_eq!(again.status, 200, "{}", again.text());
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(untraced(&again), untraced(&first));
    }
    assert_eq!(records(&http, "m"), 1, "applied once");
    assert_eq!(replays(&http), 3.0);

    // The same key with another request: refused, nothing applied.
    let other = keyed(
        &http,
        "/models/m/mutations",
        "order-1",
        &json!({"$.qty": 9}),
    );
    assert_eq!(other.status, 422, "{}", other.text());
    assert_eq!(
        other.json()["error"],
        json!("Idempotency key reused"),
        "{}",
        other.text()
    );
    assert!(other.text().contains("order-1"), "{}", other.text());
    assert_eq!(http.get("/models/m/state").json()["total"], json!(12));

    // A key is per model, and a write without a key is applied every time.
    assert_eq!(http.post_json("/models", &counter("other")).status, 201);
    assert_eq!(
        keyed(&http, "/models/other/mutations", "order-1", &body).header("idempotent-replayed"),
        None
    );
    for _ in 0..2 {
        assert_eq!(http.post_json("/models/m/mutations", &body).status, 200);
    }
    assert_eq!(records(&http, "m"), 3);

    // JSON Patch too.
    let patch = json!([{"op": "add", "path": "/items", "value": [1]}]);
    let send_patch = || {
        http.post(
            "/models/m/mutations/patch",
            &[
                ("Content-Type", "application/json-patch+json"),
                ("Idempotency-Key", "p-1"),
            ],
            patch.to_string().as_bytes(),
        )
    };
    let p1 = send_patch();
    assert_eq!(p1.status, 200, "{}", p1.text());
    let p2 = send_patch();
    assert_eq!(p2.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        http.get("/models/m/state").json()["items"],
        json!([1]),
        "appended once"
    );

    // Keys that are not keys.
    for bad in ["x".repeat(256), "caf\u{e9}".to_string()] {
        let r = keyed(&http, "/models/m/mutations", &bad, &body);
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert!(r.text().contains("Idempotency-Key"), "{}", r.text());
    }
    assert_eq!(records(&http, "m"), 4);

    // MCP: the key in the call's `_meta`.
    let args = json!({"id": "m", "mutations": {"$.n": 7}});
    let a = mcp_mutate(&http, 1, "mcp-1", args.clone());
    let b = mcp_mutate(&http, 2, "mcp-1", args);
    assert_eq!(a["isError"], json!(false), "{a}");
    assert_eq!(b["structuredContent"], a["structuredContent"]);
    let c = mcp_mutate(
        &http,
        3,
        "mcp-1",
        json!({"id": "m", "mutations": {"$.n": 8}}),
    );
    assert_eq!(c["isError"], json!(true), "{c}");
    assert!(c.to_string().contains("another request"), "{c}");
    let bad = mcp_mutate(&http, 4, "", json!({"id": "m", "mutations": {"$.n": 9}}));
    assert_eq!(bad["isError"], json!(true), "{bad}");
    assert_eq!(records(&http, "m"), 5);
    assert_eq!(http.get("/models/m/state").json()["n"], json!(7));
    assert!(d.terminate().success());
}

valem_tests::on_both_stores!(
    a_keyed_write_is_answered_again_after_kill_9_and_eviction,
    after_kill_and_eviction
);

fn after_kill_and_eviction(b: &Backing) {
    let d = b.start(&["--shards", "1"]);
    let http = Http::new(&d);
    for id in ["a", "b"] {
        assert_eq!(http.post_json("/models", &counter(id)).status, 201);
    }
    let body = json!({"$.price": 2, "$.qty": 5});
    let first = keyed(&http, "/models/a/mutations", "k-1", &body);
    assert_eq!(first.status, 200, "{}", first.text());
    d.kill9();

    // The answer was acknowledged: the key is in the store with its record.
    let d = b.start(&["--shards", "1", "--max-resident-models", "1"]);
    let http = Http::new(&d);
    let again = keyed(&http, "/models/a/mutations", "k-1", &body);
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(untraced(&again), untraced(&first));
    let other = keyed(&http, "/models/a/mutations", "k-1", &json!({"$.qty": 1}));
    assert_eq!(other.status, 422, "{}", other.text());

    // Evicted (touching `b`) and woken: still known; a new key is applied.
    let second = keyed(&http, "/models/a/mutations", "k-2", &json!({"$.qty": 6}));
    assert_eq!(second.header("idempotent-replayed"), None);
    assert_eq!(http.get("/models/b/state").status, 200);
    for key in ["k-1", "k-2"] {
        let body = if key == "k-1" {
            body.clone()
        } else {
            json!({"$.qty": 6})
        };
        let r = keyed(&http, "/models/a/mutations", key, &body);
        assert_eq!(
            r.header("idempotent-replayed"),
            Some("true"),
            "{key}: {}",
            r.text()
        );
        assert_eq!(http.get("/models/b/state").status, 200);
    }
    assert_eq!(records(&http, "a"), 2, "each key applied once");
    assert_eq!(http.get("/models/a/state").json()["total"], json!(12));
    let v = http.get("/models/a/audit/verify").json();
    assert_eq!(v["valid"], json!(true), "{v}");
    assert!(d.terminate().success());
}
