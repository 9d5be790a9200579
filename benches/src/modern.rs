//! MCP's modern era (revision 2026-07-28) from a client's side, for the end-to-end benches: the
//! `_meta` and the standard headers a sessionless request carries, and a load run of
//! `tools/call mutate` over `/mcp` shaped exactly like `valem_tests::load::run` for the legacy
//! era (the same keep-alive client [`Conn`], one thread per client, all released by one barrier,
//! the same per-request JSON building and the same verdict), so the two eras differ only in
//! what the daemon does with the request.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use serde_json::{json, Value};
use valem_tests::load::{ClientRun, Conn, LoadReport};

/// The modern revision.
pub const VERSION: &str = "2026-07-28";

/// The `_meta` every modern request carries: its version and (no) client capabilities.
pub fn meta() -> Value {
    json!({"io.modelcontextprotocol/protocolVersion": VERSION,
        "io.modelcontextprotocol/clientCapabilities": {}})
}

/// A modern JSON-RPC request: `params` with [`meta`] added.
pub fn request(id: u64, method: &str, mut params: Value) -> Value {
    params["_meta"] = meta();
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
}

/// `tools/call` of `tool` with `arguments`.
pub fn tools_call(id: u64, tool: &str, arguments: Value) -> Value {
    request(
        id,
        "tools/call",
        json!({"name": tool, "arguments": arguments}),
    )
}

/// `subscriptions/listen` for `notifications/resources/updated` of these resource URIs.
pub fn listen(id: u64, uris: &[&str]) -> Value {
    request(
        id,
        "subscriptions/listen",
        json!({"notifications": {"resourceSubscriptions": uris}}),
    )
}

/// The headers of a modern POST to `/mcp`: the content types, `MCP-Protocol-Version`,
/// `Mcp-Method` and, for `tools/call`, `Mcp-Name` (the tool).
pub fn headers<'a>(method: &'a str, name: Option<&'a str>) -> Vec<(&'static str, &'a str)> {
    let mut h = vec![
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
        ("MCP-Protocol-Version", VERSION),
        ("Mcp-Method", method),
    ];
    if let Some(n) = name {
        h.push(("Mcp-Name", n));
    }
    h
}

/// Is this reply a successful modern `tools/call` (HTTP 200, `resultType`, `isError: false`)?
pub fn check_call(r: &valem_tests::load::RawReply) -> Result<(), String> {
    if r.status != 200 {
        return Err(format!(
            "HTTP {}: {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        ));
    }
    match r.json() {
        Ok(v)
            if v["result"]["isError"] == json!(false) && v["result"]["resultType"].is_string() =>
        {
            Ok(())
        }
        Ok(v) => Err(format!("not a complete tool result: {v}")),
        Err(e) => Err(e.to_string()),
    }
}

/// The modern-era twin of `valem_tests::load::run` with `Surface::Mcp`: `clients` threads, each
/// on its own keep-alive connection (no session: no `initialize`), sending `per_client`
/// `tools/call mutate` requests made from `mutation(client, i)` to model `model`.
pub fn run(
    addr: &str,
    model: &str,
    clients: usize,
    per_client: usize,
    mutation: impl Fn(usize, usize) -> Value + Send + Sync + 'static,
) -> LoadReport {
    let mutation = Arc::new(mutation);
    let barrier = Arc::new(Barrier::new(clients + 1));
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (addr, model) = (addr.to_string(), model.to_string());
            let (mutation, barrier) = (mutation.clone(), barrier.clone());
            std::thread::spawn(move || client(&addr, &model, c, per_client, &*mutation, &barrier))
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    let runs: Vec<ClientRun> = threads
        .into_iter()
        .map(|t| {
            t.join().unwrap_or_else(|_| ClientRun {
                latencies_us: Vec::new(),
                errors: vec!["a client thread panicked".into()],
            })
        })
        .collect();
    let wall = start.elapsed();
    let mut sorted_us: Vec<f64> = runs.iter().flat_map(|r| r.latencies_us.clone()).collect();
    sorted_us.sort_by(f64::total_cmp);
    LoadReport {
        clients,
        mutations: sorted_us.len(),
        errors: runs.into_iter().flat_map(|r| r.errors).collect(),
        wall,
        sorted_us,
    }
}

fn client(
    addr: &str,
    model: &str,
    c: usize,
    n: usize,
    mutation: &(dyn Fn(usize, usize) -> Value + Send + Sync),
    barrier: &Barrier,
) -> ClientRun {
    let mut out = ClientRun {
        latencies_us: Vec::with_capacity(n),
        errors: Vec::new(),
    };
    let conn = Conn::open(addr);
    barrier.wait();
    let mut conn = match conn {
        Ok(c) => c,
        Err(e) => {
            out.errors.push(format!("client {c}: connect: {e}"));
            return out;
        }
    };
    let headers = headers("tools/call", Some("mutate"));
    for i in 0..n {
        let m = mutation(c, i);
        let t0 = Instant::now();
        let call = tools_call(i as u64 + 1, "mutate", json!({"id": model, "mutations": m}));
        let r = conn.request("POST", "/mcp", &headers, call.to_string().as_bytes());
        let dt = t0.elapsed().as_secs_f64() * 1e6;
        let verdict = match &r {
            Err(e) => Err(format!("{e}")),
            Ok(r) => check_call(r),
        };
        match verdict {
            Ok(()) => out.latencies_us.push(dt),
            Err(e) => {
                out.errors.push(format!("client {c} mutation {i}: {e}"));
                if r.is_err() {
                    // The connection is gone: reconnecting would hide the failure; stop.
                    break;
                }
            }
        }
    }
    out
}
