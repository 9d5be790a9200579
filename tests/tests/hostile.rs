//! Hostile input against the real binary: values nested past the depth limit (built by a
//! derivation, doubled by JSON Patch copies, returned by `eval_expression`, sent by a client,
//! carried by a model link), memory and time bombs in expressions, expressions nested or broken
//! to crash the compiler, and a store holding a value it cannot read. Each attack gets a clear
//! error; the daemon stays up, the other models are untouched, and a restart (clean and after
//! `kill -9`) recovers everything that was acknowledged.

use serde_json::{json, Value};
use valem_tests::{Daemon, Http, Mcp};

/// The depth limit of a kept value (`valem_core::value::MAX_DEPTH`), counting its address.
const MAX_DEPTH: usize = 100;

/// `{"x": {"x": … 0}}` holding `levels` objects within one another (0: the number itself).
fn nest(levels: usize) -> Value {
    let mut v = json!(0);
    for _ in 0..levels {
        v = json!({ "x": v });
    }
    v
}

/// The levels of arrays and objects within one another in `v` (walked without recursion).
fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    deepest
}

fn durable(dir: &std::path::Path, extra: &[&str]) -> Daemon {
    let mut args = vec!["--data-dir", dir.to_str().expect("a UTF-8 path")];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

fn create(http: &Http, spec: Value) {
    let r = http.post_json("/models", &spec);
    assert_eq!(r.status, 201, "{}", r.text());
}

/// A model the attacks must leave alone: created, written, and checked by [`bystander_ok`].
fn bystander(http: &Http) {
    create(
        http,
        json!({"id": "bystander", "schema": {},
               "derivations": [{"path": "$.total", "expr": "price * qty"}]}),
    );
    let r = http.post_json(
        "/models/bystander/mutations",
        &json!({"$.price": 7, "$.qty": 6}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

fn bystander_ok(http: &Http) {
    assert_eq!(http.get("/healthz").status, 200);
    let s = http.get("/models/bystander/state").json();
    assert_eq!(s, json!({"price": 7, "qty": 6, "total": 42}));
}

/// The trace of `target` in a mutation result.
fn trace<'a>(result: &'a Value, target: &str) -> &'a Value {
    result["traces"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["targetPath"] == target))
        .unwrap_or_else(|| panic!("no trace of {target} in {result}"))
}

#[test]
fn deep_values_are_refused_where_they_are_made_and_the_deepest_accepted_reads_back() {
    let dir = tempfile::tempdir().expect("a data directory");
    let d = durable(dir.path(), &["--checkpoint-every", "2"]);
    let http = Http::new(&d);
    bystander(&http);
    create(
        &http,
        json!({"id": "deep", "schema": {}, "derivations": [{"path": "$.built",
            "expr": "$reduce([1..n], function($a, $i){ {'x': $a} }, 0)"}]}),
    );
    // Twenty thousand levels overflowed a shard's stack and aborted the process.
    let r = http.post_json("/models/deep/mutations", &json!({"$.n": 20000}));
    assert_eq!(r.status, 200, "{}", r.text());
    let t = trace(&r.json(), "$.built").clone();
    assert_eq!(t["result"], Value::Null, "{t}");
    let msg = t["errorMessage"].as_str().unwrap_or_default();
    assert!(msg.contains("more than 100 levels deep"), "{msg}");
    bystander_ok(&http);
    // At `$.built` (one level) a derived value may hold 99 more, not 100.
    let r = http.post_json("/models/deep/mutations", &json!({"$.n": MAX_DEPTH}));
    assert!(trace(&r.json(), "$.built")["errorMessage"].is_string());
    let r = http.post_json("/models/deep/mutations", &json!({"$.n": MAX_DEPTH - 1}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(trace(&r.json(), "$.built")["errorMessage"], Value::Null);
    // A client's write: the same limit, its address counted, named in the error.
    let r = http.post_json("/models/deep/mutations", &json!({"$.w": nest(MAX_DEPTH)}));
    assert_eq!(r.status, 422, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(msg.contains("$.w") && msg.contains("100 levels"), "{msg}");
    let r = http.post_json(
        "/models/deep/mutations",
        &json!({"$.w": nest(MAX_DEPTH - 1), "$.a[0].b": nest(MAX_DEPTH - 3)}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let want = http.get("/models/deep/state").json();
    assert_eq!(depth(&want), MAX_DEPTH, "{want}");
    bystander_ok(&http);

    // What was accepted reads back from the store, after a clean stop and after kill -9.
    assert!(d.terminate().success());
    let d = durable(dir.path(), &[]);
    let http = Http::new(&d);
    assert_eq!(http.get("/models/deep/state").json(), want);
    bystander_ok(&http);
    let r = http.post_json("/models/deep/mutations", &json!({"$.after": 1}));
    assert_eq!(r.status, 200, "{}", r.text());
    d.kill9();
    let d = durable(dir.path(), &[]);
    let http = Http::new(&d);
    let got = http.get("/models/deep/state").json();
    assert_eq!(got["w"], want["w"]);
    assert_eq!(got["after"], json!(1));
    bystander_ok(&http);
    let v = http.get("/models/deep/audit/verify").json();
    assert_eq!(v["valid"], json!(true), "{v}");
}

#[test]
fn json_patch_copies_that_would_double_the_depth_are_refused_whole() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    bystander(&http);
    create(&http, json!({"id": "p", "schema": {}}));
    let r = http.post_json("/models/p/mutations", &json!({"$.a": nest(60)}));
    assert_eq!(r.status, 200, "{}", r.text());
    let before = http.get("/models/p/state").json();
    // A valid operation, then a copy of `/a` (61 levels) under a 60-level path of itself.
    let long_path = format!("/a{}", "/x".repeat(59));
    let patch = json!([
        {"op": "add", "path": "/ok", "value": 1},
        {"op": "copy", "from": "/a", "path": format!("{long_path}/copy")},
    ]);
    let patch_type = [("Content-Type", "application/json-patch+json")];
    let r = http.post(
        "/models/p/mutations/patch",
        &patch_type,
        patch.to_string().as_bytes(),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.contains("operation '/1'") && msg.contains("100 levels"),
        "{msg}"
    );
    assert_eq!(http.get("/models/p/state").json(), before);
    // Within the limit a copy applies.
    let within = json!([{"op": "copy", "from": "/a/x/x", "path": "/b"}]);
    let r = http.post(
        "/models/p/mutations/patch",
        &patch_type,
        within.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(depth(&http.get("/models/p/state").json()["b"]), 58);
    bystander_ok(&http);
}

#[test]
fn eval_expression_refuses_deep_and_huge_results_and_valem_mcp_goes_on() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-06-18");
    let eval = |m: &mut Mcp, id: u64, expr: &str| {
        let r = m.tool(id, "eval_expression", json!({"expr": expr}));
        r["structuredContent"].clone()
    };
    let out = eval(
        &mut m,
        2,
        "$reduce([1..20000], function($a, $i){ {'x': $a} }, 0)",
    );
    assert_eq!(out["ok"], json!(false), "{out}");
    let msg = out["message"].as_str().unwrap_or_default();
    assert!(msg.contains("levels deep"), "{out}");
    let out = eval(&mut m, 3, "$pad('', 2000000000)");
    assert_eq!(out["ok"], json!(false), "{out}");
    assert!(
        out["message"].as_str().unwrap_or_default().contains("$pad"),
        "{out}"
    );
    let out = eval(
        &mut m,
        4,
        "$reduce([1..40], function($a, $i){ {'l': $a, 'r': $a} }, 1)",
    );
    assert_eq!(out["ok"], json!(false), "{out}");
    assert!(
        out["message"]
            .as_str()
            .unwrap_or_default()
            .contains("more than"),
        "{out}"
    );
    let out = eval(
        &mut m,
        5,
        &format!("{}1{}", "(".repeat(150), ")".repeat(150)),
    );
    assert_eq!(out["ok"], json!(false), "{out}");
    assert_eq!(out["error"], json!("compile"), "{out}");
    let out = eval(&mut m, 6, "1 + 1");
    assert_eq!(out["result"], json!(2), "{out}");
    let (status, _) = m.close(15);
    assert!(status.success());
}

#[test]
fn a_model_link_carries_only_what_fits_and_the_audit_verifies_after_a_restart() {
    let dir = tempfile::tempdir().expect("a data directory");
    let d = durable(dir.path(), &[]);
    let http = Http::new(&d);
    create(&http, json!({"id": "dst", "schema": {}}));
    create(
        &http,
        json!({"id": "src", "schema": {}, "effects": [
            {"id": "copy", "executor": "server", "trigger": "v != null", "dedupeKey": "k",
             "target": {"ref": "dst", "path": "$.a.b"}, "body": "v", "statusPath": "$.io"}]}),
    );
    // 98 levels under `$.a.b` make 100: linked. 99 would make 101: the link fails.
    let r = http.post_json("/models/src/mutations", &json!({"$.v": nest(98), "$.k": 1}));
    assert_eq!(r.status, 200, "{}", r.text());
    let phase = |http: &Http| http.get("/models/src/state").json()["io"]["phase"].clone();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while phase(&http) != json!("applied") {
        assert!(
            std::time::Instant::now() < deadline,
            "the link never applied"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(depth(&http.get("/models/dst/state").json()), MAX_DEPTH);
    let r = http.post_json("/models/src/mutations", &json!({"$.v": nest(99), "$.k": 2}));
    assert_eq!(r.status, 200, "{}", r.text());
    while phase(&http) != json!("failed") {
        assert!(
            std::time::Instant::now() < deadline,
            "the deeper link never failed"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let s = http.get("/models/src/state").json();
    assert!(
        s["io"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("100 levels"),
        "{s}"
    );
    for id in ["src", "dst"] {
        let v = http.get(&format!("/models/{id}/audit/verify")).json();
        assert_eq!(v["valid"], json!(true), "{id}: {v}");
    }
    assert!(d.terminate().success());
    let d = durable(dir.path(), &[]);
    let http = Http::new(&d);
    assert_eq!(depth(&http.get("/models/dst/state").json()), MAX_DEPTH);
    for id in ["src", "dst"] {
        let v = http.get(&format!("/models/{id}/audit/verify")).json();
        assert_eq!(v["valid"], json!(true), "{id}: {v}");
    }
}

/// The peak resident memory of process `pid` (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[test]
fn memory_bombs_stop_at_their_budgets_and_the_daemon_stays_small() {
    let d = Daemon::start(&["--max-instances", "1000"]);
    let http = Http::new(&d);
    bystander(&http);
    create(
        &http,
        json!({"id": "bombs", "schema": {}, "derivations": [
            {"path": "$.pad", "expr": "go ? $pad('', 2000000000)"},
            {"path": "$.doubled", "expr": "go ? $length($reduce([1..40], function($a, $i){ $a & $a }, 'x'))"},
            {"path": "$.mapped", "expr": "go ? $count([1..10000000].('x' & $))"},
            {"path": "$.joined", "expr": "go ? $join([1..100000].('x'), $pad('', 1000))"},
            {"path": "$.split", "expr": "go ? $count($split($pad('', 30000000, 'a'), ''))"},
            {"path": "$.items[*].b", "expr": "a * 2"}
        ]}),
    );
    let r = http.post_json("/models/bombs/mutations", &json!({"$.go": true}));
    assert_eq!(r.status, 200, "{}", r.text());
    let result = r.json();
    for (target, says) in [
        ("$.pad", "$pad"),
        ("$.doubled", "MiB of memory"),
        ("$.mapped", "MiB of memory"),
        ("$.joined", "$join"),
        ("$.split", "$split"),
    ] {
        let t = trace(&result, target);
        assert_eq!(t["result"], Value::Null, "{t}");
        let msg = t["errorMessage"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{target}: {msg}");
    }
    // A fan-out wider than the limit is refused before it runs; within it, it runs.
    let items: Vec<Value> = (0..1500).map(|i| json!({"a": i})).collect();
    let r = http.post_json("/models/bombs/mutations", &json!({"$.items": items}));
    assert_eq!(r.status, 422, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.contains("1500 instances") && msg.contains("1000"),
        "{msg}"
    );
    let items: Vec<Value> = (0..900).map(|i| json!({"a": i})).collect();
    let r = http.post_json("/models/bombs/mutations", &json!({"$.items": items}));
    assert_eq!(r.status, 200, "{}", r.text());
    bystander_ok(&http);
    // $pad alone took 5.7 GB and string doubling 4 GB: the whole run stays far below either.
    let peak = peak_rss(d.pid());
    assert!(
        peak > 0 && peak < (2 << 30),
        "peak resident memory {peak} bytes"
    );
}

#[test]
fn a_cycle_past_its_time_budget_rolls_back_and_the_shard_goes_on() {
    let d = Daemon::start(&["--cycle-budget-ms", "1500", "--shards", "1"]);
    let http = Http::new(&d);
    bystander(&http);
    // A tail-recursive countdown: no memory, only time.
    let derivations: Vec<Value> = (0..8)
        .map(|i| {
            json!({"path": format!("$.d{i}"),
                   "expr": format!("($f := function($k){{ $k > 0 ? $f($k - 1) : {i} }}; $f(n))")})
        })
        .collect();
    create(
        &http,
        json!({"id": "slow", "schema": {}, "derivations": derivations}),
    );
    let r = http.post_json("/models/slow/mutations", &json!({"$.n": 8}));
    assert_eq!(r.status, 200, "{}", r.text());
    let before = http.get("/models/slow/state").json();
    // Each evaluation runs into its 2 s timeout: eight of them held the shard 16 s.
    let r = http.post_json("/models/slow/mutations", &json!({"$.n": 1_000_000_000}));
    assert_eq!(r.status, 422, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.contains("time budget of 1500 ms") && msg.contains("rolled back"),
        "{msg}"
    );
    assert_eq!(http.get("/models/slow/state").json(), before);
    let r = http.post_json("/models/slow/mutations", &json!({"$.n": 16}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(http.get("/models/slow/state").json()["d7"], json!(7));
    bystander_ok(&http);
}

#[test]
fn expressions_built_to_crash_the_compiler_get_clear_errors() {
    let d = Daemon::start(&[]);
    let http = Http::new(&d);
    bystander(&http);
    let n = 990;
    let attacks = [
        ("parens", format!("{}x{}", "(".repeat(n), ")".repeat(n))),
        ("arrays", format!("{}x{}", "[".repeat(n), "]".repeat(n))),
        (
            "objects",
            format!("{}x{}", "{\"a\":".repeat(n), "}".repeat(n)),
        ),
        ("calls", format!("{}x{}", "$abs(".repeat(n), ")".repeat(n))),
        (
            "predicates",
            format!("{}1{}", "x[".repeat(n), "]".repeat(n)),
        ),
        ("sorts", format!("{}y{}", "x^(".repeat(n), ")".repeat(n))),
        ("sums", vec!["x"; n].join("+")),
        ("negations", format!("{}x", "-".repeat(n))),
        (
            "conditions",
            format!("{}1{}", "x ? ".repeat(n / 2), " : 2".repeat(n / 2)),
        ),
        // Invalid at its end, 100 KB long: positions were found by re-parsing every prefix.
        ("invalid", format!("{}b c", "a + ".repeat(24_990))),
    ];
    for (name, expr) in attacks {
        let spec =
            json!({"id": name, "schema": {}, "derivations": [{"path": "$.y", "expr": expr}]});
        let r = http.post_json("/models", &spec);
        match r.status {
            422 => {
                let e = r.json();
                let msg = e["message"].as_str().unwrap_or_default();
                assert!(msg.contains("derivations[0].expr"), "{name}: {msg}");
            }
            201 => {
                let r = http.post_json(&format!("/models/{name}/mutations"), &json!({"$.x": 1}));
                assert_eq!(r.status, 200, "{name}: {}", r.text());
            }
            s => panic!("{name}: {s} {}", r.text()),
        }
        bystander_ok(&http);
    }
    let r = http.post_json(
        "/models",
        &json!({"id": "brackets", "schema": {},
                "derivations": [{"path": "$.y", "expr": format!("{}1{}", "(".repeat(101), ")".repeat(101))}]}),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(msg.contains("brackets nest more than 100"), "{msg}");
}

#[test]
fn a_stored_value_that_cannot_be_read_keeps_only_its_model_aside() {
    let dir = tempfile::tempdir().expect("a data directory");
    let d = durable(dir.path(), &[]);
    let http = Http::new(&d);
    bystander(&http);
    create(&http, json!({"id": "legacy", "schema": {}}));
    let r = http.post_json("/models/legacy/mutations", &json!({"$.v": 1}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(d.terminate().success());
    // What an older valem wrote: a value past serde_json's 128 levels, in a record that
    // recovery must replay (no checkpoint of the model after it).
    let deep = serde_json::to_string(&nest(200)).expect("json");
    let c = rusqlite::Connection::open(dir.path().join("valem.db")).expect("the database");
    let n = c
        .execute(
            "UPDATE audit SET record = replace(record, '\"$.v\":1', ?1) WHERE model_id = 'legacy'",
            [format!("\"$.v\":{deep}")],
        )
        .expect("edit");
    assert_eq!(n, 1);
    c.execute("DELETE FROM checkpoints WHERE model_id = 'legacy'", [])
        .expect("drop its checkpoints");
    drop(c);
    let d = durable(dir.path(), &[]);
    let http = Http::new(&d);
    bystander_ok(&http);
    let r = http.get("/models/legacy/state");
    assert_eq!(r.status, 503, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.contains("legacy") && msg.contains("could not be recovered"),
        "{msg}"
    );
    assert_eq!(http.get("/healthz").json()["unrecovered"], json!(1));
    // Deleting it drops what is stored; the id is free again.
    assert_eq!(http.delete("/models/legacy").status, 200);
    create(&http, json!({"id": "legacy", "schema": {}}));
    assert!(http.get("/healthz").json().get("unrecovered").is_none());
}
