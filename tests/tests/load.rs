//! Load: 16 concurrent clients × 5,000 mutations on one daemon, over REST and then over
//! Streamable HTTP MCP, all on one shared model per surface (the worst case: every mutation
//! serialises on one shard). Each client writes its own counter `$.c<k>` = 1, 2, …, 5000, so
//! the final state and the audit trail show whether any mutation was lost, duplicated or
//! reordered within its client. Round-trip p50/p99 are printed (`--nocapture` shows them); the
//! benchmark with release numbers is `cargo bench -p valem-benches --bench http`.

use serde_json::{json, Map, Value};
use valem_tests::load::{self, Surface};
use valem_tests::{Daemon, Http};

const CLIENTS: usize = 16;
const PER_CLIENT: usize = 5_000;

fn spec(id: &str) -> Value {
    let props: Map<String, Value> = (0..CLIENTS)
        .map(|k| (format!("c{k}"), json!({"type": "integer", "minimum": 0})))
        .collect();
    let sum = (0..CLIENTS)
        .map(|k| format!("c{k}"))
        .collect::<Vec<_>>()
        .join(" + ");
    json!({
        "id": id,
        "schema": {"type": "object", "properties": props},
        "derivations": [{"path": "$.sum", "expr": sum}]
    })
}

fn check(d: &Daemon, h: &Http, id: &str, surface: Surface) {
    // Counters at zero first, so the sum is defined from the first cycle.
    assert_eq!(h.post_json("/models", &spec(id)).status, 201);
    let zero: Map<String, Value> = (0..CLIENTS)
        .map(|k| (format!("$.c{k}"), json!(0)))
        .collect();
    assert_eq!(
        h.post_json(&format!("/models/{id}/mutations"), &Value::Object(zero))
            .status,
        200
    );

    let report = load::run(
        &d.addr,
        surface,
        id,
        CLIENTS,
        PER_CLIENT,
        |c, i| json!({ format!("$.c{c}"): i + 1 }),
    );
    eprintln!("{}", report.summary(&format!("{surface:?} (debug build)")));
    assert!(
        report.errors.is_empty(),
        "{} errors, first: {:?}",
        report.errors.len(),
        &report.errors[..report.errors.len().min(3)]
    );
    assert_eq!(report.mutations, CLIENTS * PER_CLIENT);

    // Final state: every counter at its last value, the derivation over all of them.
    let state = h.get(&format!("/models/{id}/state")).json();
    for k in 0..CLIENTS {
        assert_eq!(state[format!("c{k}")], json!(PER_CLIENT), "c{k}: {state}");
    }
    assert_eq!(state["sum"], json!(CLIENTS * PER_CLIENT));

    // Exactly one audit record per acknowledged mutation (+ the zeroing one): the newest
    // sequence is 80,000, the kept window is gap-free, and each client's values rise by one.
    let audit = h.get(&format!("/models/{id}/audit?limit=10000")).json();
    let records = audit.as_array().expect("audit records");
    assert_eq!(records.len(), 10_000, "the in-memory trail keeps 10,000");
    assert_eq!(records[0]["sequence"], json!(CLIENTS * PER_CLIENT));
    let mut last: Vec<Option<u64>> = vec![None; CLIENTS];
    for (i, r) in records.iter().rev().enumerate() {
        let seq = r["sequence"].as_u64().expect("sequence");
        assert_eq!(
            seq,
            (CLIENTS * PER_CLIENT - 9_999 + i) as u64,
            "sequence gap or duplicate"
        );
        let m = r["mutations"].as_object().expect("mutations");
        assert_eq!(m.len(), 1, "{r}");
        let (path, v) = m.iter().next().expect("one mutation");
        let k: usize = path
            .strip_prefix("$.c")
            .and_then(|s| s.parse().ok())
            .expect("a counter path");
        let v = v.as_u64().expect("a count");
        if let Some(prev) = last[k] {
            assert_eq!(
                v,
                prev + 1,
                "client {k}: {prev} then {v} (lost or duplicated)"
            );
        }
        last[k] = Some(v);
    }
    for (k, l) in last.iter().enumerate() {
        assert_eq!(*l, Some(PER_CLIENT as u64), "client {k}'s last write");
    }
    assert_eq!(
        h.get(&format!("/models/{id}/audit/verify")).json()["valid"],
        true
    );
}

#[test]
fn sixteen_clients_times_five_thousand_mutations_over_rest_and_mcp() {
    let d = Daemon::start(&[]);
    let h = Http::new(&d);
    check(&d, &h, "load-rest", Surface::Rest);
    check(&d, &h, "load-mcp", Surface::Mcp);
    check(&d, &h, "load-mcp-modern", Surface::McpModern);
    // The daemon is still healthy and serving.
    assert_eq!(h.get("/healthz").status, 200);
}
