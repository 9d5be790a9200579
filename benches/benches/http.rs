//! Mutations over the daemon's HTTP surfaces on the contract's demo model (`$.total = price * qty`),
//! without durability:
//! - server time: the whole axum router (guard, metrics, routing, body extraction, the hop to the
//!   shard and back, the reactive cycle, the audit record, the JSON reply) driven in-process with
//!   `tower::ServiceExt::oneshot`, one request at a time — REST `POST /models/demo/mutations`,
//!   and MCP `tools/call mutate` at `/mcp` in the legacy era (a session) and in the modern era
//!   (2026-07-28: no session, `_meta` and the `MCP-Protocol-Version` / `Mcp-Method` /
//!   `Mcp-Name` headers). The three surfaces alternate in rounds, so a noisy neighbour hits
//!   all of them alike. Targets: p50 ≤ 50 µs; modern `/mcp` p50 ≤ 20 µs.
//! - end to end: the real release `valem serve` on loopback, 1 and 16 keep-alive clients (the
//!   load generator of `valem_tests::load` for REST and legacy `/mcp`, its modern-era twin
//!   `Surface::McpModern` for modern `/mcp`). Target ≥ 20,000 mutations/s with 16, the
//!   modern era no slower than the legacy one.
//!
//! Fixed runs print p50/p99/max and mutations/s first; the criterion group then tracks the
//! in-process round trips. The end-to-end part needs `target/release/valem` (or `VALEM_BIN`).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{to_bytes, Body};
use axum::http::Request;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use serde_json::json;
use tower::ServiceExt;
use valem_http::{router, AppState, Config};
use valem_mcp::{guidance::Catalog, Mode, Server};
use valem_service::{ModelService, ServiceLimits};
use valem_tests::load::{self, Surface};

// The allocator of the `valem` binary, so the in-process server time is the daemon's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The header of a legacy-era `/mcp` request (with its session's `Mcp-Session-Id`).
const LEGACY: &[(&str, &str)] = &[("mcp-protocol-version", "2025-11-25")];

/// The standard headers of a modern-era `tools/call mutate`.
const MODERN: &[(&str, &str)] = &[
    ("mcp-protocol-version", valem_benches::modern::VERSION),
    ("mcp-method", "tools/call"),
    ("mcp-name", "mutate"),
];

const DEMO: &str = r#"{"id":"demo","version":"1","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}]}"#;

fn price(i: usize) -> f64 {
    (i % 100) as f64 + 0.5
}

/// The router of a fresh in-memory daemon with the demo model, plus an MCP session id.
async fn app() -> (Router, String) {
    let service = ModelService::new(0, ServiceLimits::default());
    let server = Server::new(service.clone(), Catalog::builtin(), Mode::Daemon);
    let (state, _stop) = AppState::new(Config::default(), service, server);
    let app = router(state);
    let (status, _) = send(&app, post("/models", DEMO.to_string(), &[])).await;
    assert_eq!(status, 201);
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}});
    let res = app
        .clone()
        .oneshot(post("/mcp", init.to_string(), LEGACY))
        .await
        .expect("infallible");
    let sid = res
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("a session id")
        .to_string();
    let note = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#.to_string();
    let (status, _) = send(
        &app,
        post("/mcp", note, &[LEGACY[0], ("mcp-session-id", &sid)]),
    )
    .await;
    assert_eq!(status, 202);
    (app, sid)
}

fn post(path: &str, body: String, extra: &[(&str, &str)]) -> Request<Body> {
    let mut b = Request::post(path)
        .header("host", "127.0.0.1:8080")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    for (k, v) in extra {
        b = b.header(*k, *v);
    }
    b.body(Body::from(body)).expect("a request")
}

async fn send(app: &Router, req: Request<Body>) -> (u16, axum::body::Bytes) {
    let res = app.clone().oneshot(req).await.expect("infallible");
    let status = res.status().as_u16();
    let body = to_bytes(res.into_body(), 1 << 20).await.expect("a body");
    (status, body)
}

fn rest_request(i: usize) -> Request<Body> {
    post(
        "/models/demo/mutations",
        json!({"$.price": price(i), "$.qty": 3}).to_string(),
        &[],
    )
}

fn mcp_request(i: usize, sid: &str) -> Request<Body> {
    let call = json!({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
        "params": {"name": "mutate", "arguments": {"id": "demo", "mutations": {"$.price": price(i), "$.qty": 3}}}});
    post(
        "/mcp",
        call.to_string(),
        &[LEGACY[0], ("mcp-session-id", sid)],
    )
}

fn modern_request(i: usize) -> Request<Body> {
    let call = json!({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
        "params": {"name": "mutate", "arguments": {"id": "demo", "mutations": {"$.price": price(i), "$.qty": 3}},
            "_meta": valem_benches::modern::meta()}});
    post("/mcp", call.to_string(), MODERN)
}

/// The in-process surfaces, in the order each round runs them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum InProcess {
    Rest,
    Mcp,
    McpModern,
}

impl InProcess {
    const ALL: [InProcess; 3] = [InProcess::Rest, InProcess::Mcp, InProcess::McpModern];

    fn name(self) -> &'static str {
        match self {
            InProcess::Rest => "rest",
            InProcess::Mcp => "mcp",
            InProcess::McpModern => "mcp_modern",
        }
    }

    fn request(self, i: usize, sid: &str) -> Request<Body> {
        match self {
            InProcess::Rest => rest_request(i),
            InProcess::Mcp => mcp_request(i, sid),
            InProcess::McpModern => modern_request(i),
        }
    }
}

/// One request of each surface, its reply checked: a mutation that went through (and, in the
/// modern era, a result with its `resultType` and no session header).
async fn check(app: &Router, sid: &str) {
    for s in InProcess::ALL {
        let res = app
            .clone()
            .oneshot(s.request(0, sid))
            .await
            .expect("infallible");
        let status = res.status().as_u16();
        let session = res.headers().get("mcp-session-id").is_some();
        let body = to_bytes(res.into_body(), 1 << 20).await.expect("a body");
        let text = String::from_utf8_lossy(&body);
        assert_eq!(status, 200, "{}: {text}", s.name());
        if s != InProcess::Rest {
            let data = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .next_back()
                .unwrap_or(&text);
            let v: serde_json::Value = serde_json::from_str(data.trim()).expect("JSON");
            assert_eq!(v["result"]["isError"], json!(false), "{}: {v}", s.name());
            if s == InProcess::McpModern {
                assert_eq!(v["result"]["resultType"], "complete", "{v}");
                assert!(!session, "a modern reply opened a session");
            }
        }
    }
}

fn report(label: &str, mut us: Vec<f64>, wall: Duration) {
    us.sort_by(f64::total_cmp);
    let p = |q: f64| quantile(&us, q);
    println!(
        "{label}: {} mutations, p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs, {:.0} mutations/s",
        us.len(),
        p(0.5),
        p(0.99),
        p(1.0),
        us.len() as f64 / wall.as_secs_f64()
    );
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

fn server_time(rt: &tokio::runtime::Runtime) {
    let (app, sid) = rt.block_on(app());
    rt.block_on(check(&app, &sid));
    // Rounds of `per_round` requests per surface, the surfaces alternating.
    let (rounds, per_round) = (4, 5_000);
    let mut lat: Vec<Vec<f64>> = (0..3)
        .map(|_| Vec::with_capacity(rounds * per_round))
        .collect();
    let mut round_p50: Vec<Vec<f64>> = vec![Vec::new(); 3];
    let mut wall = [Duration::ZERO; 3];
    let mut i = 0usize;
    for _ in 0..rounds {
        for (k, s) in InProcess::ALL.into_iter().enumerate() {
            let mut round = Vec::with_capacity(per_round);
            let t0 = Instant::now();
            rt.block_on(async {
                for _ in 0..per_round {
                    i += 1;
                    let req = s.request(i, &sid);
                    let t = Instant::now();
                    let (status, body) = send(&app, req).await;
                    round.push(t.elapsed().as_secs_f64() * 1e6);
                    debug_assert_eq!(status, 200, "{body:?}");
                    black_box(body);
                }
            });
            wall[k] += t0.elapsed();
            lat[k].extend_from_slice(&round);
            round.sort_by(f64::total_cmp);
            round_p50[k].push(quantile(&round, 0.5));
        }
    }
    for (k, s) in InProcess::ALL.into_iter().enumerate() {
        let p50s = &round_p50[k];
        let (lo, hi) = p50s
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        report(
            &format!(
                "http/{}_inprocess (server time, 1 client; p50 by round {lo:.1}–{hi:.1} µs)",
                s.name()
            ),
            std::mem::take(&mut lat[k]),
            wall[k],
        );
    }
}

/// The release daemon with the demo model.
fn daemon() -> Option<valem_benches::Serve> {
    let bin = valem_benches::release_valem("http end-to-end runs")?;
    let d = valem_benches::Serve::start(&bin, &[])?;
    let mut c = load::Conn::open(&d.addr).ok()?;
    let r = c
        .request(
            "POST",
            "/models",
            &[("Content-Type", "application/json")],
            DEMO.as_bytes(),
        )
        .ok()?;
    assert_eq!(r.status, 201);
    Some(d)
}

fn end_to_end() {
    let Some(d) = daemon() else { return };
    let mutation = |_, i| json!({"$.price": price(i), "$.qty": 3});
    // The surfaces side by side for each client count, so legacy and modern `/mcp` run close
    // together in time.
    for (clients, per_client) in [(1, 20_000), (16, 2_500)] {
        for name in ["rest", "mcp", "mcp_modern"] {
            let r = match name {
                "rest" => load::run(
                    &d.addr,
                    Surface::Rest,
                    "demo",
                    clients,
                    per_client,
                    mutation,
                ),
                "mcp" => load::run(&d.addr, Surface::Mcp, "demo", clients, per_client, mutation),
                _ => load::run(
                    &d.addr,
                    Surface::McpModern,
                    "demo",
                    clients,
                    per_client,
                    mutation,
                ),
            };
            assert!(
                r.errors.is_empty(),
                "{:?}",
                &r.errors[..r.errors.len().min(3)]
            );
            println!("{}", r.summary(&format!("http/{name}_loopback")));
        }
    }
}

fn http(c: &mut Criterion) {
    valem::allocator::configure();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    server_time(&rt);
    end_to_end();

    let (app, sid) = rt.block_on(app());
    let app = Arc::new(app);
    let mut g = c.benchmark_group("http");
    g.sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let mut i = 0usize;
    g.bench_function("rest_mutate_inprocess", |b| {
        b.iter(|| {
            i += 1;
            rt.block_on(send(&app, rest_request(i)))
        })
    });
    g.bench_function("mcp_mutate_inprocess", |b| {
        b.iter(|| {
            i += 1;
            rt.block_on(send(&app, mcp_request(i, &sid)))
        })
    });
    g.bench_function("mcp_modern_mutate_inprocess", |b| {
        b.iter(|| {
            i += 1;
            rt.block_on(send(&app, modern_request(i)))
        })
    });
    g.finish();
}

criterion_group!(benches, http);
criterion_main!(benches);
