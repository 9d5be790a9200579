//! MCP round trips of `mutate` on the contract's demo model (`$.total = price * qty`):
//! - `mcp/session_mutate`: server time — one `tools/call` through the in-process session
//!   (JSON-RPC dispatch, argument parsing, shard hop, reactive cycle, audit record, result
//!   envelope and pretty text), no transport. Target p50 ≤ 100 µs.
//! - `mcp/stdio_mutate`: the real `valem mcp` binary over pipes with a minimal Rust client
//!   (one request in flight), i.e. what a client sees end to end.
//!
//! Before the criterion groups, a fixed run of calls through each prints p50/p99/calls-per-s.

use std::hint::black_box;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use serde_json::{json, Value};
use valem_mcp::{guidance::Catalog, Mode, Server, Session};
use valem_service::{ModelService, ServiceLimits};

// The daemon's allocator with its settings (`valem::allocator::configure`, called first), so
// the engine costs here what it costs in the daemon.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const DEMO: &str = r#"{"id":"demo","version":"1","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}]}"#;

fn mutate_request(id: u64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": "mutate", "arguments": {"id": "demo", "mutations": {"$.price": (id % 100) as f64 + 0.5, "$.qty": 3}}}})
}

fn session() -> Arc<Session> {
    let service = ModelService::new(0, ServiceLimits::default());
    let server = Server::new(service, Catalog::builtin(), Mode::Embedded);
    let s = Session::new(server, Arc::new(|_: &Value| {}));
    s.handle(json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": "2025-11-25", "capabilities": {}}}));
    let spec: Value = serde_json::from_str(DEMO).expect("demo spec");
    let r = s
        .handle(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "create_model", "arguments": {"spec": spec}}}))
        .expect("reply");
    assert_eq!(r["result"]["isError"], false, "{r}");
    s
}

fn percentiles(label: &str, mut us: Vec<f64>, wall: Duration) {
    us.sort_by(|a, b| a.total_cmp(b));
    let p = |q: f64| us[((us.len() as f64 - 1.0) * q) as usize];
    println!(
        "{label}: {} calls, p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs, {:.0} calls/s",
        us.len(),
        p(0.5),
        p(0.99),
        p(1.0),
        us.len() as f64 / wall.as_secs_f64()
    );
}

/// A `valem mcp` child with a line client.
struct Child {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: BufReader<std::process::ChildStdout>,
    line: String,
}

impl Child {
    fn start() -> Option<Child> {
        let bin = valem_benches::release_valem("mcp/stdio_mutate")?;
        let mut child = Command::new(bin)
            .arg("mcp")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let stdin = child.stdin.take()?;
        let stdout = BufReader::new(child.stdout.take()?);
        let mut s = Child {
            child,
            stdin,
            stdout,
            line: String::new(),
        };
        s.call(&json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": "2025-11-25", "capabilities": {}}}));
        let spec: Value = serde_json::from_str(DEMO).ok()?;
        s.call(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "create_model", "arguments": {"spec": spec}}}));
        Some(s)
    }

    fn call(&mut self, req: &Value) -> usize {
        let mut bytes = serde_json::to_vec(req).expect("json");
        bytes.push(b'\n');
        self.stdin.write_all(&bytes).expect("write");
        self.stdin.flush().expect("flush");
        loop {
            self.line.clear();
            self.stdout.read_line(&mut self.line).expect("read");
            // Skip notifications (the readiness log is not sent: no notifications/initialized).
            if self.line.contains("\"id\"") {
                return self.line.len();
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn mcp(c: &mut Criterion) {
    valem::allocator::configure();
    let s = session();
    let n = 20_000u64;
    let mut lat = Vec::with_capacity(n as usize);
    let t0 = Instant::now();
    for i in 0..n {
        let req = mutate_request(i + 10);
        let t = Instant::now();
        let r = s.handle(req).expect("reply");
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        debug_assert_eq!(r["result"]["isError"], false);
        black_box(r);
    }
    percentiles("mcp/session_mutate (server time)", lat, t0.elapsed());

    let mut g = c.benchmark_group("mcp");
    g.sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let mut i = 100_000u64;
    g.bench_function("session_mutate", |b| {
        b.iter(|| {
            i += 1;
            black_box(s.handle(mutate_request(i)))
        })
    });
    if let Some(mut p) = Child::start() {
        let mut lat = Vec::with_capacity(n as usize);
        let t0 = Instant::now();
        for i in 0..n {
            let req = mutate_request(i + 10);
            let t = Instant::now();
            black_box(p.call(&req));
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        percentiles("mcp/stdio_mutate (client round trip)", lat, t0.elapsed());
        let mut i = 200_000u64;
        g.bench_function("stdio_mutate", |b| {
            b.iter(|| {
                i += 1;
                black_box(p.call(&mutate_request(i)))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, mcp);
criterion_main!(benches);
