//! Mutations over the daemon's HTTP surfaces on the contract's demo model (`$.total = price * qty`),
//! without durability:
//! - server time: the whole axum router (guard, metrics, routing, body extraction, the hop to the
//!   shard and back, the reactive cycle, the audit record, the JSON reply) driven in-process with
//!   `tower::ServiceExt::oneshot`, one request at a time — REST `POST /models/demo/mutations` and
//!   MCP `tools/call mutate` at `/mcp`. Target p50 ≤ 50 µs.
//! - end to end: the real release `valem serve` on loopback, 1 and 16 keep-alive clients (the
//!   load generator of `valem_tests::load`), REST and `/mcp`. Target ≥ 20,000 mutations/s with 16.
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
        .oneshot(post("/mcp", init.to_string(), &[]))
        .await
        .expect("infallible");
    let sid = res
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("a session id")
        .to_string();
    let note = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#.to_string();
    let (status, _) = send(&app, post("/mcp", note, &[("mcp-session-id", &sid)])).await;
    assert_eq!(status, 202);
    (app, sid)
}

fn post(path: &str, body: String, extra: &[(&str, &str)]) -> Request<Body> {
    let mut b = Request::post(path)
        .header("host", "127.0.0.1:8080")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    if path == "/mcp" {
        b = b.header("mcp-protocol-version", "2025-11-25");
    }
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
    post("/mcp", call.to_string(), &[("mcp-session-id", sid)])
}

fn report(label: &str, mut us: Vec<f64>, wall: Duration) {
    us.sort_by(f64::total_cmp);
    let p = |q: f64| us[((us.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{label}: {} mutations, p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs, {:.0} mutations/s",
        us.len(),
        p(0.5),
        p(0.99),
        p(1.0),
        us.len() as f64 / wall.as_secs_f64()
    );
}

fn server_time(rt: &tokio::runtime::Runtime) {
    let (app, sid) = rt.block_on(app());
    let n = 20_000;
    for surface in ["rest", "mcp"] {
        let mut lat = Vec::with_capacity(n);
        let t0 = Instant::now();
        rt.block_on(async {
            for i in 0..n {
                let req = if surface == "rest" {
                    rest_request(i)
                } else {
                    mcp_request(i, &sid)
                };
                let t = Instant::now();
                let (status, body) = send(&app, req).await;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
                debug_assert_eq!(status, 200, "{body:?}");
                black_box(body);
            }
        });
        report(
            &format!("http/{surface}_inprocess (server time, 1 client)"),
            lat,
            t0.elapsed(),
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
    for (surface, name) in [(Surface::Rest, "rest"), (Surface::Mcp, "mcp")] {
        for (clients, per_client) in [(1, 20_000), (16, 2_500)] {
            let r = load::run(
                &d.addr,
                surface,
                "demo",
                clients,
                per_client,
                |_, i| json!({"$.price": price(i), "$.qty": 3}),
            );
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
    g.finish();
}

criterion_group!(benches, http);
criterion_main!(benches);
