//! Durability of `valem serve` against the real binary, on both stores (`--data-dir` and
//! `--store postgres://…` on a real PostgreSQL server): models, state and the audit chain come
//! back after a clean stop and after `kill -9`, and no acknowledged mutation is lost. What only
//! one store has (SQLite's disk limit and torn WAL, PostgreSQL's server going away) is tested
//! on that one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use valem_tests::backing::Backing;
use valem_tests::load::Conn;
use valem_tests::{repo_root, Daemon, Http};

fn data_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary data directory")
}

fn start(dir: &std::path::Path) -> Daemon {
    Daemon::start(&["--data-dir", dir.to_str().expect("a UTF-8 path")])
}

valem_tests::on_both_stores!(
    a_clean_restart_brings_back_every_model_its_state_and_its_chain,
    clean_restart
);
valem_tests::on_both_stores!(
    kill_9_at_random_moments_loses_no_acknowledged_mutation,
    kill_9_at_random
);
valem_tests::on_both_stores!(
    the_embedded_mcp_server_keeps_its_models_in_the_store,
    embedded_mcp
);
valem_tests::on_both_stores!(
    a_restore_survives_kill_9_with_and_without_records_before_it,
    restore_kill_9
);
valem_tests::on_both_stores!(an_evolved_spec_and_its_state_survive_kill_9, evolve_kill_9);
valem_tests::on_both_stores!(blobs_are_kept_in_the_store, blobs_kept);
valem_tests::on_both_stores!(
    fifty_models_of_every_bundled_example_come_back,
    fifty_models
);
valem_tests::on_both_stores!(
    tampering_with_the_stored_audit_is_reported_at_the_record_it_broke,
    tampering
);

fn example(name: &str) -> Value {
    let text = std::fs::read_to_string(repo_root().join("examples").join(format!("{name}.json")))
        .expect("a bundled example");
    serde_json::from_str(&text).expect("the example is JSON")
}

fn clean_restart(b: &Backing) {
    let d = b.start(&[]);
    let http = Http::new(&d);
    let names = ["demo", "car-loan-calculator", "order-invoice", "grade-book"];
    for n in names {
        let r = http.post_json("/models", &example(n));
        assert_eq!(r.status, 201, "create {n}: {}", r.text());
    }
    let initial = http.get("/models/demo/state").json();
    for i in 0..5 {
        let r = http.post_json(
            "/models/demo/mutations",
            &json!({"$.price": 10 + i, "$.qty": 3}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let history = http.get("/models/demo/history").json();
    assert_eq!(
        history.as_array().map(Vec::len),
        Some(6),
        "creation + 5 commits: {history}"
    );
    let third = history[3].as_str().expect("an ISO instant").to_string();
    let at_third = http.get(&format!("/models/demo/state?at={third}")).json();
    assert_eq!(at_third["price"], json!(12), "{at_third}");
    let before: Vec<(Value, Value)> = names
        .iter()
        .map(|n| {
            (
                http.get(&format!("/models/{n}/state")).json(),
                http.get(&format!("/models/{n}/audit?limit=1000")).json(),
            )
        })
        .collect();
    assert!(d.terminate().success());

    let d = b.start(&[]);
    let http = Http::new(&d);
    let mut listed: Vec<String> = http
        .get("/models")
        .json()
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|m| {
            m.get("id")
                .or(Some(m))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .collect();
    listed.sort();
    let mut expected: Vec<String> = names
        .iter()
        .map(|n| example(n)["id"].as_str().unwrap_or(n).to_string())
        .collect();
    expected.sort();
    assert_eq!(listed, expected);
    for (n, (state, audit)) in names.iter().zip(before) {
        assert_eq!(
            http.get(&format!("/models/{n}/state")).json(),
            state,
            "state of {n}"
        );
        assert_eq!(
            http.get(&format!("/models/{n}/audit?limit=1000")).json(),
            audit,
            "audit of {n}"
        );
        let v = http.get(&format!("/models/{n}/audit/verify")).json();
        assert_eq!(v["valid"], json!(true), "{n}: {v}");
    }
    // Time travel reaches instants before the restart, rebuilt from the store.
    assert_eq!(http.get("/models/demo/history").json(), history);
    assert_eq!(
        http.get(&format!("/models/demo/state?at={third}")).json(),
        at_third
    );
    let created = history[0].as_str().expect("an ISO instant");
    assert_eq!(
        http.get(&format!("/models/demo/state?at={created}")).json(),
        initial
    );
    assert_eq!(
        http.get("/models/demo/state?at=2000-01-01T00:00:00Z")
            .status,
        404,
        "nothing exists before the model was created"
    );
    // The chain continues where it stopped.
    let r = http.post_json("/models/demo/mutations", &json!({"$.price": 99}));
    assert_eq!(r.status, 200, "{}", r.text());
    let newest = http.get("/models/demo/audit?limit=1").json();
    assert_eq!(newest[0]["sequence"], json!(5));
    assert_eq!(
        http.get("/models/demo/audit/verify").json()["recordsChecked"],
        json!(6)
    );
    // A deleted model stays deleted.
    assert_eq!(http.delete("/models/grade-book").status, 200);
    assert!(d.terminate().success());
    let d = b.start(&[]);
    let http = Http::new(&d);
    assert_eq!(http.get("/models/grade-book/state").status, 404);
    assert_eq!(http.get("/models/demo/state").json()["price"], json!(99));
    assert!(d.terminate().success());
}

const COUNTERS: &str = r#"{"id":"counters","version":"1","schema":{},
  "derivations":[{"path":"$.total","expr":"$sum([c0, c1, c2, c3])"}]}"#;

fn kill_9_at_random(b: &Backing) {
    let clients = 4;
    let mut acked = vec![0i64; clients];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for round in 0..20 {
        // Checkpoints every 7 records: each recovery loads one and replays what follows it.
        let d = b.start(&["--checkpoint-every", "7"]);
        let http = Http::new(&d);
        if round == 0 {
            let r = http.post(
                "/models",
                &[("Content-Type", "application/json")],
                COUNTERS.as_bytes(),
            );
            assert_eq!(r.status, 201, "{}", r.text());
        }
        let state = http.get("/models/counters/state").json();
        for (k, a) in acked.iter_mut().enumerate() {
            let v = state
                .get(format!("c{k}"))
                .and_then(Value::as_i64)
                .unwrap_or(0);
            // Everything acknowledged survived; at most the one write in flight also did.
            assert!(
                v == *a || v == *a + 1,
                "round {round}: c{k} is {v} after the crash, {a} was acknowledged"
            );
            *a = v;
        }
        let total: i64 = acked.iter().sum();
        assert_eq!(state["total"], json!(total), "round {round}: {state}");
        let v = http.get("/models/counters/audit/verify").json();
        assert_eq!(v["valid"], json!(true), "round {round}: {v}");
        assert_eq!(
            v["recordsChecked"],
            json!(total),
            "one record per committed write"
        );

        // Writers run until the kill; each remembers what was acknowledged.
        let stop = Arc::new(AtomicBool::new(false));
        let handles: Vec<_> = (0..clients)
            .map(|k| {
                let (addr, stop, from) = (d.addr.clone(), stop.clone(), acked[k]);
                std::thread::spawn(move || {
                    let mut last = from;
                    let Ok(mut c) = Conn::open(&addr) else {
                        return last;
                    };
                    while !stop.load(Ordering::Relaxed) && last < from + 400 {
                        let body = json!({ format!("$.c{k}"): last + 1 }).to_string();
                        match c.request(
                            "POST",
                            "/models/counters/mutations",
                            &[("Content-Type", "application/json")],
                            body.as_bytes(),
                        ) {
                            Ok(r) if r.status == 200 => last += 1,
                            _ => break,
                        }
                    }
                    last
                })
            })
            .collect();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(30 + rng % 250));
        d.kill9();
        stop.store(true, Ordering::Relaxed);
        for (k, h) in handles.into_iter().enumerate() {
            acked[k] = h.join().expect("a writer thread");
        }
    }
    let d = b.start(&[]);
    let http = Http::new(&d);
    let state = http.get("/models/counters/state").json();
    for (k, a) in acked.iter().enumerate() {
        let v = state[format!("c{k}")].as_i64().unwrap_or(0);
        assert!(v == *a || v == *a + 1, "c{k} is {v}, {a} was acknowledged");
    }
    assert!(
        acked.iter().sum::<i64>() > 0,
        "the writers got mutations through"
    );
    assert!(d.terminate().success());
    // The state recovered through checkpoints equals a replay of every record from scratch.
    b.sql("DELETE FROM checkpoints");
    let d = b.start(&[]);
    assert_eq!(Http::new(&d).get("/models/counters/state").json(), state);
    assert!(d.terminate().success());
}

fn embedded_mcp(b: &Backing) {
    use valem_tests::Mcp;
    let args = b.args();
    let args = b.with(&args, &[]);
    let mut m = Mcp::start(&args, &[]);
    m.handshake("2025-06-18");
    let r = m.tool(2, "create_model", json!({"spec": example("demo")}));
    assert_eq!(r["isError"], json!(false), "{r}");
    let r = m.tool(
        3,
        "mutate",
        json!({"id": "demo", "mutations": {"$.price": 4, "$.qty": 5}}),
    );
    assert_eq!(r["isError"], json!(false), "{r}");
    let (status, _) = m.close(15);
    assert!(status.success());

    let mut m = Mcp::start(&args, &[]);
    m.handshake("2025-06-18");
    let r = m.tool(2, "get_state", json!({"id": "demo"}));
    assert_eq!(r["structuredContent"]["total"], json!(20), "{r}");
    let r = m.tool(3, "verify_audit", json!({"id": "demo"}));
    assert_eq!(r["structuredContent"]["valid"], json!(true), "{r}");
    assert_eq!(r["structuredContent"]["recordsChecked"], json!(1), "{r}");
    let (status, _) = m.close(15);
    assert!(status.success());
}

fn restore_kill_9(b: &Backing) {
    let d = b.start(&[]);
    let http = Http::new(&d);
    let spec = example("demo");
    let id = spec["id"].as_str().expect("an id").to_string();
    assert_eq!(http.post_json("/models", &spec).status, 201);
    let mut other = spec.clone();
    other["id"] = json!("fresh");
    assert_eq!(http.post_json("/models", &other).status, 201);
    let r = http.post_json(
        &format!("/models/{id}/mutations"),
        &json!({"$.price": 2, "$.qty": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let snap = http
        .post_json(&format!("/models/{id}/snapshot"), &json!({}))
        .json();
    let r = http.post_json(&format!("/models/{id}/mutations"), &json!({"$.price": 9}));
    assert_eq!(r.status, 200, "{}", r.text());
    // Restore the older snapshot over a model with records, and a snapshot onto one without.
    let r = http.post_json(&format!("/models/{id}/restore"), &snap);
    assert_eq!(r.status, 200, "{}", r.text());
    let mut onto_fresh = snap.clone();
    onto_fresh["modelId"] = json!("fresh");
    let r = http.post_json("/models/fresh/restore", &onto_fresh);
    assert_eq!(r.status, 200, "{}", r.text());
    let restored = http.get(&format!("/models/{id}/state")).json();
    assert_eq!(restored["price"], json!(2), "{restored}");
    let fresh = http.get("/models/fresh/state").json();
    assert_eq!(fresh, restored);
    // A write after the restore, then the crash.
    let r = http.post_json(&format!("/models/{id}/mutations"), &json!({"$.qty": 4}));
    assert_eq!(r.status, 200, "{}", r.text());
    let expected = http.get(&format!("/models/{id}/state")).json();
    d.kill9();

    let d = b.start(&[]);
    let http = Http::new(&d);
    assert_eq!(http.get(&format!("/models/{id}/state")).json(), expected);
    assert_eq!(http.get("/models/fresh/state").json(), fresh);
    let v = http.get(&format!("/models/{id}/audit/verify")).json();
    assert_eq!(v["valid"], json!(true), "{v}");
    assert_eq!(v["recordsChecked"], json!(3), "a restore is not a record");
    assert!(d.terminate().success());
}

fn evolve_kill_9(b: &Backing) {
    let d = b.start(&[]);
    let http = Http::new(&d);
    assert_eq!(http.post_json("/models", &example("demo")).status, 201);
    let r = http.post_json(
        "/models/demo/mutations",
        &json!({"$.price": 10, "$.qty": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let before_evolve = http.get("/models/demo/history").json();
    let early = before_evolve[1].as_str().expect("an instant").to_string();
    let r = http.post_json(
        "/models/demo/spec/evolve",
        &json!({
            "expectedVersion": "1.0.0",
            "newVersion": "1.1.0",
            "upsertDerivations": [{"path": "$.withTax", "expr": "total * 1.5"}]
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = http.post_json("/models/demo/mutations", &json!({"$.qty": 4}));
    assert_eq!(r.status, 200, "{}", r.text());
    let state = http.get("/models/demo/state").json();
    assert_eq!(state["withTax"], json!(60), "{state}");
    let history = http.get("/models/demo/history").json();
    d.kill9();

    let d = b.start(&[]);
    let http = Http::new(&d);
    assert_eq!(
        http.get("/models/demo/spec").json()["version"],
        json!("1.1.0")
    );
    assert_eq!(http.get("/models/demo/state").json(), state);
    assert_eq!(http.get("/models/demo/history").json(), history);
    // The history of the old runtime is not carried (as in the reference).
    assert_eq!(
        http.get(&format!("/models/demo/state?at={early}")).status,
        404
    );
    let v = http.get("/models/demo/audit/verify").json();
    assert_eq!(v["valid"], json!(true), "{v}");
    assert_eq!(v["recordsChecked"], json!(2), "{v}");
    assert!(d.terminate().success());
}

fn blobs_kept(b: &Backing) {
    let d = b.start(&[]);
    let http = Http::new(&d);
    let boundary = "valemDurableBoundary";
    let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.bin\"\r\nContent-Type: image/png\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(&data);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let ct = format!("multipart/form-data; boundary={boundary}");
    let r = http.post("/blobs", &[("Content-Type", &ct)], &body);
    assert_eq!(r.status, 201, "{}", r.text());
    let id = r.json()["blobId"].as_str().expect("a blob id").to_string();
    d.kill9();

    let d = b.start(&[]);
    let http = Http::new(&d);
    let got = http.get(&format!("/blobs/{id}"));
    assert_eq!(got.status, 200);
    assert_eq!(got.body, data);
    assert_eq!(got.header("content-type"), Some("image/png"));
    assert_eq!(http.get(&format!("/blobs/{}", "0".repeat(64))).status, 404);
    assert!(d.terminate().success());
}

#[test]
fn a_full_disk_refuses_writes_loses_nothing_acknowledged_and_recovers_when_space_returns() {
    let dir = data_dir();
    let path = dir.path().to_str().expect("a UTF-8 path").to_string();
    let d = Daemon::start(&["--data-dir", &path, "--max-db-bytes", "1048576"]);
    let http = Http::new(&d);
    for id in ["ballast", "counter"] {
        let spec = json!({"id": id, "version": "1", "schema": {},
            "derivations": [{"path": "$.twice", "expr": "n * 2"}]});
        assert_eq!(http.post_json("/models", &spec).status, 201);
    }
    assert_eq!(
        http.post_json("/models/counter/mutations", &json!({"$.n": 1}))
            .status,
        200
    );
    let (mut ws, _) = tungstenite::connect(format!("ws://{}/models/ballast/subscribe", d.addr))
        .expect("a WebSocket subscription");
    if let tungstenite::stream::MaybeTlsStream::Plain(s) = ws.get_ref() {
        s.set_read_timeout(Some(Duration::from_millis(1500)))
            .expect("a read timeout");
    }
    let pad = "x".repeat(2000);
    let mut acked = 0;
    let refusal = loop {
        assert!(
            acked < 5000,
            "1 MiB should fill long before 5000 writes of 2 KB"
        );
        let r = http.post_json(
            "/models/ballast/mutations",
            &json!({"$.n": acked + 1, "$.pad": pad}),
        );
        if r.status != 200 {
            break r;
        }
        acked += 1;
    };
    assert_eq!(refusal.status, 503, "{}", refusal.text());
    assert!(
        refusal.text().contains("no space left"),
        "{}",
        refusal.text()
    );
    // Subscribers heard of every committed write and of nothing else.
    let mut frames = 0;
    while let Ok(m) = ws.read() {
        if let tungstenite::Message::Text(t) = m {
            let f: Value = serde_json::from_str(t.as_str()).expect("a JSON frame");
            assert_eq!(f["kind"], json!("mutation"), "{f}");
            frames += 1;
        }
    }
    assert_eq!(
        frames, acked,
        "one frame per acknowledged write, none for the refused one"
    );
    // The refused write is not visible: the model is reloaded from what the store holds.
    assert_eq!(http.get("/models/ballast/state").json()["n"], json!(acked));
    let v = http.get("/models/ballast/audit/verify").json();
    assert_eq!(v["valid"], json!(true), "{v}");
    assert_eq!(v["recordsChecked"], json!(acked));
    // Space returns when the ballast goes: the other model writes again, without a restart.
    assert_eq!(http.delete("/models/ballast").status, 200);
    let r = http.post_json("/models/counter/mutations", &json!({"$.n": 2}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(http.get("/models/counter/state").json()["twice"], json!(4));
    assert!(d.terminate().success());
    let d = start(dir.path());
    let http = Http::new(&d);
    assert_eq!(http.get("/models/counter/state").json()["n"], json!(2));
    assert_eq!(http.get("/models/ballast/state").status, 404);
    assert!(d.terminate().success());
}

fn fifty_models(b: &Backing) {
    let d = b.start(&[]);
    let http = Http::new(&d);
    let mut names: Vec<String> = std::fs::read_dir(repo_root().join("examples"))
        .expect("the examples")
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_suffix(".json")
                .map(str::to_string)
        })
        .collect();
    names.sort();
    let mut ids = Vec::new();
    for k in 0..50 {
        let mut spec = example(&names[k % names.len()]);
        let id = format!("m{k}");
        spec["id"] = json!(id);
        let r = http.post_json("/models", &spec);
        assert_eq!(
            r.status,
            201,
            "create {id} from {}: {}",
            names[k % names.len()],
            r.text()
        );
        ids.push(id);
    }
    // The demo-shaped ones get writes; every model is read back whole.
    let snapshot = |http: &Http| -> Vec<(Value, Value, Value)> {
        ids.iter()
            .map(|id| {
                (
                    http.get(&format!("/models/{id}")).json(),
                    http.get(&format!("/models/{id}/spec")).json(),
                    http.get(&format!("/models/{id}/state")).json(),
                )
            })
            .collect()
    };
    for (k, id) in ids.iter().enumerate() {
        if names[k % names.len()] == "demo" {
            let r = http.post_json(
                &format!("/models/{id}/mutations"),
                &json!({"$.price": k, "$.qty": 2}),
            );
            assert_eq!(r.status, 200, "{}", r.text());
        }
    }
    let before = snapshot(&http);
    assert!(d.terminate().success());
    let d = b.start(&[]);
    let http = Http::new(&d);
    assert_eq!(snapshot(&http), before);
    assert!(d.terminate().success());
}

fn tampering(b: &Backing) {
    let d = b.start(&[]);
    let http = Http::new(&d);
    assert_eq!(http.post_json("/models", &example("demo")).status, 201);
    for i in 0..6 {
        let r = http.post_json(
            "/models/demo/mutations",
            &json!({"$.price": 10 + i, "$.qty": 1}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert!(d.terminate().success());
    let verify = |edit: &str| -> Value {
        b.sql(edit);
        let d = b.start(&[]);
        let v = Http::new(&d).get("/models/demo/audit/verify").json();
        assert!(d.terminate().success());
        v
    };
    // One altered value in record 3.
    let v = verify(
        "UPDATE audit SET record = replace(record, '\"$.price\":13', '\"$.price\":99')
         WHERE model_id = 'demo' AND sequence = 3",
    );
    assert_eq!(v["valid"], json!(false), "{v}");
    assert_eq!(v["firstBrokenSequence"], json!(3), "{v}");
    assert!(
        v["detail"].as_str().is_some_and(|d| d.contains("alter")),
        "{v}"
    );
    // Record 1 deleted as well: the chain now breaks there first.
    let v = verify("DELETE FROM audit WHERE model_id = 'demo' AND sequence = 1");
    assert_eq!(v["valid"], json!(false), "{v}");
    assert_eq!(v["firstBrokenSequence"], json!(1), "{v}");
}

/// Copy a data directory (not the WAL index, which SQLite rebuilds), with the WAL cut to `len`.
fn copy_with_wal_cut(from: &std::path::Path, to: &std::path::Path, len: u64) {
    for e in std::fs::read_dir(from)
        .expect("the data directory")
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_file() && !name.ends_with("-shm") {
            std::fs::copy(e.path(), to.join(&name)).expect("copy");
        }
    }
    let wal = to.join("valem.db-wal");
    if wal.exists() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&wal)
            .expect("open the WAL copy");
        f.set_len(len.min(f.metadata().map(|m| m.len()).unwrap_or(0)))
            .expect("cut the WAL");
    }
}

#[test]
fn a_torn_wal_after_kill_9_leaves_a_store_that_opens_and_verifies_a_prefix() {
    let dir = data_dir();
    let d = start(dir.path());
    let http = Http::new(&d);
    let spec = json!({"id": "counter", "version": "1", "schema": {},
        "derivations": [{"path": "$.twice", "expr": "n * 2"}]});
    assert_eq!(http.post_json("/models", &spec).status, 201);
    let mut acked = 0;
    for _ in 0..300 {
        let r = http.post_json("/models/counter/mutations", &json!({"$.n": acked + 1}));
        assert_eq!(r.status, 200, "{}", r.text());
        acked += 1;
    }
    d.kill9();
    let wal_len = std::fs::metadata(dir.path().join("valem.db-wal")).map_or(0, |m| m.len());
    assert!(
        wal_len > 32 + 4120,
        "the writes live in the WAL ({wal_len} bytes)"
    );
    // Cuts: nothing, the header, inside the first frame, and a spread through the rest.
    let mut cuts = vec![0, 16, 32 + 100];
    cuts.extend((1..8).map(|k| wal_len * k / 8 + 7));
    cuts.push(wal_len);
    let mut last = -1;
    for cut in cuts {
        let copy = data_dir();
        copy_with_wal_cut(dir.path(), copy.path(), cut);
        let d = start(copy.path());
        let http = Http::new(&d);
        let r = http.get("/models/counter/state");
        // A cut before the model's own commit loses the model, which is then simply absent.
        let n = if r.status == 404 {
            0
        } else {
            r.json()["n"].as_i64().unwrap_or(0)
        };
        assert!(n <= acked, "cut {cut}: n is {n}, only {acked} were written");
        assert!(
            n >= last,
            "cut {cut}: a longer WAL kept less ({n} < {last})"
        );
        last = n;
        if r.status == 200 {
            assert_eq!(r.json()["twice"], json!(n * 2), "cut {cut}");
            let v = http.get("/models/counter/audit/verify").json();
            assert_eq!(v["valid"], json!(true), "cut {cut}: {v}");
            assert_eq!(
                v["recordsChecked"],
                json!(n),
                "cut {cut}: one record per surviving write"
            );
        }
        assert!(d.terminate().success());
    }
    assert_eq!(last, acked, "the whole WAL keeps every write");
}

#[test]
fn postgres_going_away_answers_503_commits_nothing_half_and_writes_work_when_it_returns() {
    let mut b = Backing::postgres();
    let d = b.start(&[]);
    let http = Http::new(&d);
    let r = http.post(
        "/models",
        &[("Content-Type", "application/json")],
        COUNTERS.as_bytes(),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    for v in 1..=5 {
        let r = http.post_json("/models/counters/mutations", &json!({"$.c0": v}));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    b.server().expect("a server").stop();
    let r = http.post_json("/models/counters/mutations", &json!({"$.c0": 6}));
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(
        r.text().contains("cannot be reached"),
        "the error says the database is gone: {}",
        r.text()
    );
    b.server()
        .expect("a server")
        .restart()
        .expect("the server is back");
    // The refused write was not committed: the same value goes in as the next record.
    let r = http.post_json("/models/counters/mutations", &json!({"$.c0": 6}));
    assert_eq!(r.status, 200, "{}", r.text());
    let state = http.get("/models/counters/state").json();
    assert_eq!(
        (state["c0"].clone(), state["total"].clone()),
        (json!(6), json!(6))
    );
    let v = http.get("/models/counters/audit/verify").json();
    assert_eq!(v["valid"], json!(true), "{v}");
    assert_eq!(
        v["recordsChecked"],
        json!(6),
        "one record per acknowledged write: {v}"
    );
    d.kill9();
    let d = b.start(&[]);
    assert_eq!(Http::new(&d).get("/models/counters/state").json(), state);
    assert!(d.terminate().success());
}

#[test]
fn postgres_down_at_start_is_waited_for_and_a_newer_schema_is_refused() {
    let mut b = Backing::postgres();
    let args = b.args();
    let server = b.server().expect("a server");
    server.stop();
    // Given up after the timeout, naming the database and not its password.
    let url = args[1].replace("valem@", "valem:pw@");
    let out = valem_tests::run(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            &url,
            "--store-connect-timeout",
            "0.5",
        ],
        None,
    );
    let err = valem_tests::stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot be reached") && err.contains(&args[1]),
        "{err}"
    );
    assert!(!err.contains(":pw@"), "the password is not shown: {err}");
    // Waited for while it comes back.
    let d = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(1500));
            server.restart().expect("the server comes back");
        });
        let all: Vec<&str> = args.iter().map(String::as_str).collect();
        Daemon::start(&all)
    });
    let err = d.stderr_with("trying again");
    assert!(err.contains("trying again"), "{err}");
    assert_eq!(Http::new(&d).get("/models").status, 200);
    assert!(d.terminate().success());
    // A schema written by a newer valem is refused with both versions named.
    b.sql("UPDATE schema_version SET version = 99");
    let all: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = vec!["serve", "--listen", "127.0.0.1:0"];
    cmd.extend(all);
    let out = valem_tests::run(&cmd, None);
    let err = valem_tests::stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("schema version 99")
            && err.contains(&format!(
                "supports up to {}",
                valem_store::pg::SCHEMA_VERSION
            )),
        "{err}"
    );
}
