//! Hibernation (`--max-resident-models`) against the real binary: models beyond the bound are
//! evicted to the store and woken by their next request, on every surface, with nothing lost or
//! changed — state, audit chain, timers, WebSocket subscribers — and `kill -9` in the middle of
//! evictions loses no acknowledged write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valem_tests::backing::Backing;
use valem_tests::load::Conn;
use valem_tests::{Daemon, Http};

/// A small model: `total = price * qty`, and `n` a counter the tests write.
fn small(id: &str) -> Value {
    json!({
        "id": id, "version": "1.0.0",
        "schema": {"type": "object", "properties": {
            "price": {"type": "number"}, "qty": {"type": "number"}, "n": {"type": "integer"}
        }},
        "derivations": [{"path": "$.total", "expr": "price * qty"}]
    })
}

fn start(b: &Backing, extra: &[&str]) -> Daemon {
    b.start(extra)
}

valem_tests::on_both_stores!(
    five_thousand_models_with_five_hundred_resident_stay_readable_and_writable,
    five_thousand
);
valem_tests::on_both_stores!(
    a_model_evicted_between_two_writes_keeps_its_audit_chain,
    evicted_between_writes
);
valem_tests::on_both_stores!(a_timer_on_a_hibernated_model_fires, timer_fires);
valem_tests::on_both_stores!(
    a_websocket_subscriber_of_an_evicted_model_keeps_getting_its_events,
    websocket_subscriber
);
valem_tests::on_both_stores!(
    kill_9_during_evictions_loses_no_acknowledged_write,
    kill_9_evictions
);
valem_tests::on_both_stores!(
    mcp_tools_wake_hibernated_models_over_http_and_stdio,
    mcp_tools_wake
);

/// One REST request on a keep-alive connection: its status and JSON body.
fn send(c: &mut Conn, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let bytes = body.map(Value::to_string).unwrap_or_default();
    let r = c
        .request(
            method,
            path,
            &[("Content-Type", "application/json")],
            bytes.as_bytes(),
        )
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (r.status, r.json().unwrap_or(Value::Null))
}

/// The value of an unlabelled metric.
fn metric(http: &Http, name: &str) -> f64 {
    valem_tests::metric(http, name).unwrap_or_else(|| panic!("no metric {name}"))
}

fn five_thousand(store: &Backing) {
    let b = store;
    let args = ["--max-resident-models", "500", "--max-models", "10000"];
    let d = start(b, &args);
    let http = Http::new(&d);
    let mut c = Conn::open(&d.addr).expect("connect");
    let n = 5000;
    for i in 0..n {
        let (s, r) = send(&mut c, "POST", "/models", Some(&small(&format!("m{i}"))));
        assert_eq!(s, 201, "create m{i}: {r}");
    }
    assert!(metric(&http, "valem_models_resident") <= 500.0);
    assert!(metric(&http, "valem_models_hibernated") >= 4500.0);
    assert_eq!(metric(&http, "valem_models"), n as f64);
    // Every model written once, in an order that wakes most of them.
    for i in (0..n).rev() {
        let m = json!({"$.price": i, "$.qty": 2, "$.n": i});
        let (s, r) = send(&mut c, "POST", &format!("/models/m{i}/mutations"), Some(&m));
        assert_eq!(s, 200, "write m{i}: {r}");
    }
    for i in 0..n {
        let (s, st) = send(&mut c, "GET", &format!("/models/m{i}/state"), None);
        assert_eq!(s, 200, "read m{i}: {st}");
        assert_eq!(
            (st["n"].as_i64(), st["total"].as_i64()),
            (Some(i), Some(2 * i)),
            "m{i}: {st}"
        );
    }
    let (s, list) = send(&mut c, "GET", "/models", None);
    assert_eq!(s, 200);
    assert_eq!(
        list.as_array().map(Vec::len),
        Some(n as usize),
        "the list holds every model"
    );
    assert!(metric(&http, "valem_models_resident") <= 500.0);
    assert!(metric(&http, "valem_models_evicted_total") >= 4500.0);
    assert!(metric(&http, "valem_model_wake_seconds_count") >= 4500.0);
    assert_eq!(metric(&http, "valem_model_wake_failures_total"), 0.0);
    // A duplicate of a hibernated model is refused as for a resident one.
    let (s, _) = send(&mut c, "POST", "/models", Some(&small("m0")));
    assert_eq!(s, 409);
    // A hibernated model can be deleted.
    let (s, r) = send(&mut c, "DELETE", "/models/m1", None);
    assert_eq!(s, 200, "{r}");
    let (s, _) = send(&mut c, "GET", "/models/m1/state", None);
    assert_eq!(s, 404);
    drop(c);
    assert!(d.terminate().success());

    // A restart loads nothing up front and serves every model as before.
    let d = start(b, &args);
    let http = Http::new(&d);
    assert_eq!(metric(&http, "valem_models_resident"), 0.0);
    assert_eq!(metric(&http, "valem_models_hibernated"), (n - 1) as f64);
    let mut c = Conn::open(&d.addr).expect("connect");
    for i in (0..n).step_by(7).filter(|i| *i != 1) {
        let (s, st) = send(&mut c, "GET", &format!("/models/m{i}/state"), None);
        assert_eq!((s, st["total"].as_i64()), (200, Some(2 * i)), "m{i}: {st}");
    }
    drop(c);
    assert!(d.terminate().success());
}

/// Touch model `other` so that, with one resident model per shard, `id` is evicted.
fn evict_by_touching(http: &Http, other: &str) {
    let r = http.get(&format!("/models/{other}/state"));
    assert_eq!(r.status, 200, "{}", r.text());
}

fn evicted_between_writes(b: &Backing) {
    let d = start(b, &["--shards", "1", "--max-resident-models", "1"]);
    let http = Http::new(&d);
    for id in ["a", "b"] {
        assert_eq!(http.post_json("/models", &small(id)).status, 201);
    }
    let evicted = metric(&http, "valem_models_evicted_total");
    for k in 1..=4 {
        let r = http.post_json(
            "/models/a/mutations",
            &json!({"$.n": k, "$.price": k, "$.qty": 1}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        evict_by_touching(&http, "b");
    }
    // Each touch of `b` evicted `a`, and each write woke it.
    assert!(metric(&http, "valem_models_evicted_total") >= evicted + 4.0);
    let v = http.get("/models/a/audit/verify").json();
    assert_eq!(v["valid"], json!(true), "{v}");
    assert_eq!(v["recordsChecked"], json!(4), "{v}");
    let audit = http.get("/models/a/audit?limit=100").json();
    let seqs: Vec<i64> = audit
        .as_array()
        .expect("records")
        .iter()
        .filter_map(|r| r["sequence"].as_i64())
        .collect();
    assert_eq!(
        seqs,
        vec![3, 2, 1, 0],
        "one record per write, no gap: {audit}"
    );
    assert_eq!(http.get("/models/a/state").json()["total"], json!(4));
    assert!(d.terminate().success());
}

fn timer_fires(b: &Backing) {
    let d = start(b, &["--shards", "1", "--max-resident-models", "1"]);
    let http = Http::new(&d);
    let spec = json!({
        "id": "t", "version": "1.0.0",
        "schema": {"type": "object", "properties": {
            "armed": {"type": "boolean"}, "expired": {"type": "boolean"}
        }},
        "effects": [{"id": "expire", "executor": "timer", "trigger": "armed = true",
            "dedupeKey": "armed", "afterMs": "1200",
            "response": {"set": {"$.expired": "true"}}, "statusPath": "$.timer"}]
    });
    assert_eq!(http.post_json("/models", &spec).status, 201);
    assert_eq!(http.post_json("/models", &small("other")).status, 201);
    let r = http.post_json("/models/t/mutations", &json!({"$.armed": true}));
    assert_eq!(r.status, 200, "{}", r.text());
    // Wait for the pending status to be written, then put the model to sleep.
    let deadline = Instant::now() + Duration::from_secs(10);
    while http.get("/models/t/state").json()["timer"]["phase"] != json!("pending") {
        assert!(Instant::now() < deadline, "the timer never went pending");
        std::thread::sleep(Duration::from_millis(20));
    }
    let wakes = metric(&http, "valem_model_wake_seconds_count");
    // A model whose status write is still on its way to the store is spared: touch the other
    // until the timer's model has gone to sleep.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        evict_by_touching(&http, "other");
        if metric(&http, "valem_models_hibernated") == 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the timer's model was never evicted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Nothing reads `t` until the timer has had time to fire: its fold-back wakes it.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        metric(&http, "valem_model_wake_seconds_count") > wakes,
        "the timer woke its model"
    );
    let s = http.get("/models/t/state").json();
    assert_eq!(s["expired"], json!(true), "{s}");
    assert_eq!(s["timer"]["phase"], json!("applied"), "{s}");
    assert!(d.terminate().success());
}

fn websocket_subscriber(b: &Backing) {
    let d = start(b, &["--shards", "1", "--max-resident-models", "1"]);
    let http = Http::new(&d);
    for id in ["a", "b"] {
        assert_eq!(http.post_json("/models", &small(id)).status, 201);
    }
    let mut ws = valem_tests::ws_open(&d, "/models/a/subscribe");
    for k in 1..=3 {
        evict_by_touching(&http, "b");
        let r = http.post_json("/models/a/mutations", &json!({"$.price": k, "$.qty": 10}));
        assert_eq!(r.status, 200, "{}", r.text());
        let frame = valem_tests::ws_frame(&mut ws);
        assert_eq!(
            (&frame["kind"], &frame["modelId"], &frame["mutatedPaths"]),
            (
                &json!("mutation"),
                &json!("a"),
                &json!(["$.price", "$.qty"])
            ),
            "write {k}: {frame}"
        );
        assert_eq!(http.get("/models/a/state").json()["total"], json!(k * 10));
    }
    assert!(metric(&http, "valem_models_evicted_total") >= 3.0);
    assert!(d.terminate().success());
}

fn kill_9_evictions(b: &Backing) {
    let models = 40usize;
    let args = [
        "--shards",
        "1",
        "--max-resident-models",
        "4",
        "--checkpoint-every",
        "5",
    ];
    let mut acked = vec![0i64; models];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..6 {
        let d = start(b, &args);
        let http = Http::new(&d);
        if round == 0 {
            for m in 0..models {
                assert_eq!(
                    http.post_json("/models", &small(&format!("k{m}"))).status,
                    201
                );
            }
        }
        // Everything acknowledged survived (at most the write in flight too), and every chain
        // verifies with one record per write.
        for (m, a) in acked.iter_mut().enumerate() {
            let st = http.get(&format!("/models/k{m}/state")).json();
            let v = st["n"].as_i64().unwrap_or(0);
            assert!(
                v == *a || v == *a + 1,
                "round {round}: k{m} is {v}, {a} was acknowledged"
            );
            *a = v;
            let ver = http.get(&format!("/models/k{m}/audit/verify")).json();
            assert_eq!(ver["valid"], json!(true), "round {round}, k{m}: {ver}");
            assert_eq!(
                ver["recordsChecked"],
                json!(v),
                "round {round}, k{m}: {ver}"
            );
        }
        // Two writers walk the models in turn (each write wakes one and evicts others) until
        // the kill; each remembers what was acknowledged.
        let stop = Arc::new(AtomicBool::new(false));
        let from = acked.clone();
        let handles: Vec<_> = (0..2)
            .map(|w| {
                let (addr, stop, from) = (d.addr.clone(), stop.clone(), from.clone());
                std::thread::spawn(move || {
                    let mut last = from;
                    let Ok(mut c) = Conn::open(&addr) else {
                        return (w, last);
                    };
                    let mine: Vec<usize> = (w..models).step_by(2).collect();
                    'writing: for _ in 0..50 {
                        for &m in &mine {
                            if stop.load(Ordering::Relaxed) {
                                break 'writing;
                            }
                            let body = json!({"$.n": last[m] + 1}).to_string();
                            match c.request(
                                "POST",
                                &format!("/models/k{m}/mutations"),
                                &[("Content-Type", "application/json")],
                                body.as_bytes(),
                            ) {
                                Ok(r) if r.status == 200 => last[m] += 1,
                                _ => break 'writing,
                            }
                        }
                    }
                    (w, last)
                })
            })
            .collect();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(100 + rng % 400));
        d.kill9();
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            let (w, last) = h.join().expect("a writer thread");
            for m in (w..models).step_by(2) {
                acked[m] = last[m];
            }
        }
    }
    assert!(
        acked.iter().sum::<i64>() > 0,
        "the writers got writes through"
    );
}

/// A modern-era (2026-07-28) `tools/call` on `/mcp`: no session, its `_meta` and headers.
fn modern_call(http: &Http, id: u64, tool: &str, args: Value) -> Value {
    let r = valem_tests::modern_tool_call(http, id, tool, args);
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert_eq!(v["result"]["isError"], json!(false), "{tool}: {v}");
    v["result"]["structuredContent"].clone()
}

fn mcp_tools_wake(b: &Backing) {
    let d = start(b, &["--shards", "1", "--max-resident-models", "1"]);
    let http = Http::new(&d);
    for id in ["a", "b"] {
        assert_eq!(http.post_json("/models", &small(id)).status, 201);
    }
    for k in 1..=3 {
        evict_by_touching(&http, "b");
        let m = modern_call(
            &http,
            10 + k,
            "mutate",
            json!({"id": "a",
            "mutations": {"$.price": k, "$.qty": 5}}),
        );
        assert_eq!(m["success"], json!(true), "{m}");
        evict_by_touching(&http, "b");
        let s = modern_call(&http, 20 + k, "get_state", json!({"id": "a"}));
        assert_eq!(s["total"], json!(5 * k), "{s}");
    }
    assert!(metric(&http, "valem_models_evicted_total") >= 6.0);
    assert!(d.terminate().success());

    // The embedded engine over stdio, on the same store, with the same bound.
    let store = b.args();
    let mut mcp = valem_tests::Mcp::start(
        &b.with(&store, &["--shards", "1", "--max-resident-models", "1"]),
        &[],
    );
    mcp.handshake("2025-11-25");
    for (i, id) in ["a", "b", "a", "b"].iter().enumerate() {
        let r = mcp.tool(100 + i as u64, "get_state", json!({"id": id}));
        assert_eq!(r["isError"], json!(false), "{r}");
    }
    let r = mcp.tool(200, "mutate", json!({"id": "a", "mutations": {"$.qty": 7}}));
    assert_eq!(r["isError"], json!(false), "{r}");
    let r = mcp.tool(201, "get_state", json!({"id": "b"}));
    assert_eq!(r["isError"], json!(false), "{r}");
    let r = mcp.tool(202, "get_state", json!({"id": "a"}));
    assert_eq!(r["structuredContent"]["total"], json!(21), "{r}");
    let (status, _) = mcp.close(10);
    assert!(status.success());
}

#[test]
fn the_residency_bound_needs_a_data_directory() {
    for cmd in ["serve", "mcp"] {
        let o = valem_tests::run(&[cmd, "--max-resident-models", "10"], None);
        assert_eq!(o.status.code(), Some(2), "valem {cmd}");
        let err = valem_tests::stderr(&o);
        assert!(
            err.contains("--max-resident-models 10 needs a store (--data-dir or --store)"),
            "valem {cmd}: {err}"
        );
    }
    let o = valem_tests::run(&["serve", "--max-resident-models", "0"], None);
    assert_eq!(o.status.code(), Some(2));
}
