//! The daemon's HTTP server (`valem serve`): axum on hyper + tokio. Every surface — REST
//! (`rest.rs`), the WebSocket (`ws.rs`), Streamable HTTP MCP (`mcp.rs`), `/healthz`, `/metrics` —
//! calls the one [`ModelService`]; none re-implements behaviour.
//!
//! One guard runs before every route but `/healthz`: the `Host` must be a loopback name or
//! listed (DNS rebinding), an `Origin`, when present, must be loopback or listed, and with an
//! API key configured the request must carry it (`Authorization: Bearer`, or `?token=` on the
//! WebSocket handshake only; the guard removes it from the URI, so nothing after it logs it). Service calls block on a shard, so handlers run them under
//! `block_in_place` (the worker hands its other tasks to another thread first), never as plain
//! code on a reactor thread.

// What is not part of the crate's API is pub(crate): the compiler keeps it so.
#![warn(unreachable_pub)]
// `Result<_, Response>` is axum's idiom for early exits; the error is built once per request.
#![allow(clippy::result_large_err)]

mod cluster;
mod forward;
pub mod guard;
pub mod mcp;
mod mcp_modern;
pub mod metrics;
pub mod relay;
pub mod rest;
pub mod sandbox;
pub mod ws;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use serde_json::{json, Value as Json};
use tokio::sync::watch;

use valem_service::ModelService;

/// What `valem serve` was told.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub api_key: Option<String>,
    /// Browser origins allowed besides loopback ones (`*` allows any).
    pub allowed_origins: Vec<String>,
    /// `Host` names allowed besides loopback ones (`*` allows any).
    pub allowed_hosts: Vec<String>,
    /// Largest accepted request body (blob uploads have their own limit).
    pub max_body_bytes: usize,
    /// Time allowed to send a request's headers (slow clients are cut off).
    pub header_timeout: Duration,
    /// Time allowed for a whole request, body included (not for SSE / WebSocket streams,
    /// which live past their handler).
    pub request_timeout: Duration,
    /// Most open connections; further ones wait in the kernel's backlog.
    pub max_connections: usize,
    /// Most live MCP sessions.
    pub max_mcp_sessions: usize,
    /// Most open WebSocket subscriptions.
    pub max_subscriptions: usize,
    /// An MCP session unused this long (and with no open stream) is dropped.
    pub mcp_session_idle: Duration,
    /// Serve the conformance suite's fixture tools, resources and prompts (tests only).
    pub conformance_fixtures: bool,
    /// How long a sandbox pairing waits for the developer's approval.
    pub pairing_ttl: Duration,
    /// How often the agent is told to poll for the pairing's token.
    pub pairing_interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            api_key: None,
            allowed_origins: Vec::new(),
            allowed_hosts: Vec::new(),
            max_body_bytes: 16 << 20,
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            max_connections: 1024,
            max_mcp_sessions: 10_000,
            max_subscriptions: 4096,
            mcp_session_idle: Duration::from_secs(3600),
            conformance_fixtures: false,
            pairing_ttl: Duration::from_secs(600),
            pairing_interval: Duration::from_secs(3),
        }
    }
}

/// The peer address of the connection a request came on (inserted by the accept loop; absent
/// when the router is driven in-process).
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub SocketAddr);

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub service: Arc<ModelService>,
    pub mcp: Arc<valem_mcp::Server>,
    pub config: Arc<Config>,
    pub metrics: Arc<metrics::Metrics>,
    pub sessions: Arc<mcp::Sessions>,
    /// Open WebSocket subscriptions.
    pub subscriptions: Arc<AtomicUsize>,
    /// Sandbox pairings and the browser sessions they opened.
    pub pairings: Arc<sandbox::Pairings>,
    /// Flips to true when the daemon starts shutting down: long-lived streams end.
    pub shutdown: watch::Receiver<bool>,
    /// The models of other nodes of a fleet whose events are relayed here.
    pub relays: Arc<relay::Relays>,
}

impl AppState {
    /// The shared state of one daemon (benchmarks build it to drive the router in-process);
    /// sending `true` on the returned sender starts the shutdown of long-lived streams.
    pub fn new(
        config: Config,
        service: Arc<ModelService>,
        mcp: Arc<valem_mcp::Server>,
    ) -> (AppState, watch::Sender<bool>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let sessions = Arc::new(mcp::Sessions::new(
            config.max_mcp_sessions,
            config.mcp_session_idle,
        ));
        let pairings = Arc::new(sandbox::Pairings::new(
            config.pairing_ttl,
            config.pairing_interval,
        ));
        let state = AppState {
            pairings,
            service,
            mcp,
            config: Arc::new(config),
            metrics: Arc::new(metrics::Metrics::new()),
            sessions,
            subscriptions: Arc::default(),
            shutdown: stop_rx,
            relays: Arc::default(),
        };
        (state, stop_tx)
    }

    /// Run a blocking service call off the reactor.
    pub async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&ModelService) -> R + Send + 'static,
    ) -> Result<R, Response> {
        // On the multi-threaded runtime the call runs in place (the worker hands its other
        // tasks to a fresh thread): a service call is short, and a hop to the blocking pool
        // costs two thread wake-ups on every request's critical path.
        if tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread
        {
            let svc = &self.service;
            return std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tokio::task::block_in_place(|| f(svc))
            }))
            .map_err(|_| {
                error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    json!({"error": "Internal error", "message": "the request's worker failed"}),
                )
            });
        }
        let svc = self.service.clone();
        tokio::task::spawn_blocking(move || f(&svc))
            .await
            .map_err(|_| {
                error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    json!({"error": "Internal error", "message": "the request's worker failed"}),
                )
            })
    }
}

/// A JSON error body with a status.
pub fn error_response(status: StatusCode, body: Json) -> Response {
    let mut r = (status, axum::Json(body)).into_response();
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// The whole application: routes, guard, limits.
pub fn router(state: AppState) -> Router {
    // The guard wraps every route and the fallback (an unknown path answers 401/403 like a
    // known one: no probing without the key); it lets `/healthz` through itself. Sandbox
    // scoping rewrites a session's model ids before routing, so it wraps the routed app.
    let routed = Router::new()
        .route("/healthz", get(healthz))
        .merge(rest::routes(&state))
        .merge(ws::routes(&state))
        .merge(mcp::routes(&state))
        .merge(sandbox::routes())
        .route("/metrics", get(metrics::serve))
        .route("/plugins", get(plugins))
        .route("/cluster", get(cluster::cluster))
        .route("/cluster/owner/{id}", get(cluster::owner))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            forward::forward,
        ))
        .with_state(state.clone());
    Router::new()
        .fallback_service(routed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            sandbox::scope,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), guard::guard))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            request_limits,
        ))
        .with_state(state)
}

async fn healthz(State(st): State<AppState>) -> Response {
    let models = st.service.model_count();
    let mut body = json!({"status": "ok", "models": models});
    let unrecovered = st.service.checkpoint_metrics().unrecovered_count();
    if unrecovered > 0 {
        body["unrecovered"] = json!(unrecovered);
    }
    axum::Json(body).into_response()
}

/// The loaded plugins (name, kind, version, SDK/rustc versions, path) and the libraries that
/// did not load, with why.
async fn plugins(State(st): State<AppState>) -> Response {
    axum::Json(st.mcp.plugins.info()).into_response()
}

async fn not_found(req: Request) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        json!({"error": "Not found", "message": format!("no route for {} {}", req.method(), req.uri().path())}),
    )
}

/// Request timeout (slow bodies) and counting; streams outlive this (their body is polled
/// after the handler returned).
///
/// A response to a request whose body was not read to its end (refused on its headers, timed
/// out, over the limit) says `Connection: close`: hyper closes such a connection after
/// answering, since the rest of the body is still on the wire, and a client that was not told
/// would send its next request down a socket about to close ("server disconnected without
/// sending a response"; under load the close lands after the client has reused it).
async fn request_limits(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let start = std::time::Instant::now();
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let (req, read) = TrackedBody::wrap(req);
    let mut res = match tokio::time::timeout(st.config.request_timeout, next.run(req)).await {
        Ok(r) => r,
        Err(_) => error_response(
            StatusCode::REQUEST_TIMEOUT,
            json!({"error": "Request timeout", "message": format!("the request was not completed within {} s", st.config.request_timeout.as_secs_f64())}),
        ),
    };
    if read.is_some_and(|r| !r.load(Ordering::Acquire)) {
        res.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    st.metrics.request(res.status().as_u16());
    tracing::debug!(%method, %path, status = res.status().as_u16(), micros = start.elapsed().as_micros() as u64, "request");
    res
}

/// A request body that records when it has been read to its end.
struct TrackedBody {
    inner: axum::body::Body,
    read: Arc<AtomicBool>,
}

impl TrackedBody {
    /// The request with its body tracked, and the flag; `None` for a request without a body.
    fn wrap(req: Request) -> (Request, Option<Arc<AtomicBool>>) {
        use hyper::body::Body as _;
        if req.body().is_end_stream() {
            return (req, None);
        }
        let read = Arc::new(AtomicBool::new(false));
        let (parts, inner) = req.into_parts();
        let body = axum::body::Body::new(TrackedBody {
            inner,
            read: read.clone(),
        });
        (Request::from_parts(parts, body), Some(read))
    }
}

impl hyper::body::Body for TrackedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, std::task::Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, Ordering::Release);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Run the daemon until SIGINT/SIGTERM. `ready` receives the bound address (the port may have
/// been 0).
pub fn serve(
    config: Config,
    service: Arc<ModelService>,
    mcp: Arc<valem_mcp::Server>,
    ready: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("valem-http")
        .build()?;
    rt.block_on(run(config, service, mcp, ready))
}

/// Counts open connections and tells the service whether its async callers may poll for an
/// answer: only while every connection can have a reactor thread to itself. With more, a
/// polling worker would be starving connections that have requests ready.
struct ConnGauge {
    open: Arc<AtomicUsize>,
    service: Arc<ModelService>,
    workers: usize,
}

impl ConnGauge {
    fn open(open: &Arc<AtomicUsize>, service: &Arc<ModelService>, workers: usize) -> ConnGauge {
        let n = open.fetch_add(1, Ordering::Relaxed) + 1;
        service.set_async_polling(n <= workers);
        ConnGauge {
            open: open.clone(),
            service: service.clone(),
            workers,
        }
    }
}

impl Drop for ConnGauge {
    fn drop(&mut self) {
        let n = self.open.fetch_sub(1, Ordering::Relaxed) - 1;
        self.service.set_async_polling(n <= self.workers);
    }
}

async fn run(
    config: Config,
    service: Arc<ModelService>,
    mcp_server: Arc<valem_mcp::Server>,
    ready: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    let (state, stop_tx) = AppState::new(config, service.clone(), mcp_server);
    let config = state.config.clone();
    let stop_rx = state.shutdown.clone();
    mcp::spawn_reaper(state.sessions.clone(), stop_rx.clone());
    let app = router(state);
    // The handlers are installed before the address is announced: a SIGTERM sent as soon as
    // the listening line appears must stop the daemon gracefully, not by the default action.
    let mut signal = std::pin::pin!(shutdown_signal()?);
    ready(addr);
    tracing::info!(%addr, "listening");

    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_timeout)
        .max_buf_size(64 << 10);
    let builder = builder.http1_only();
    let slots = Arc::new(tokio::sync::Semaphore::new(config.max_connections.max(1)));
    let open_conns = Arc::new(AtomicUsize::new(0));
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = &mut signal => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut signal => break,
        };
        let _ = stream.set_nodelay(true);
        let gauge = ConnGauge::open(&open_conns, &service, workers);
        let svc = TowerToHyperService::new(tower::ServiceExt::map_request(
            app.clone(),
            move |mut req: Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ClientAddr(peer));
                req
            },
        ));
        let builder = builder.clone();
        let mut stop = stop_rx.clone();
        let first_byte = config.header_timeout;
        tokio::spawn(async move {
            // hyper's header timer starts at a request's first byte: a connection that never
            // sends anything would hold its slot forever, so it gets the same time to start.
            let mut probe = [0u8; 1];
            let started = tokio::select! {
                r = tokio::time::timeout(first_byte, stream.peek(&mut probe)) => matches!(r, Ok(Ok(n)) if n > 0),
                _ = stop.changed() => false,
            };
            if !started {
                tracing::debug!(%peer, "connection closed: nothing sent within the header timeout");
                drop(permit);
                return;
            }
            let conn = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                .into_owned();
            let mut conn = std::pin::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => Some(r),
                _ = stop.changed() => None,
            };
            let r = match ended {
                Some(r) => r,
                None => {
                    // Finish the request in flight, then close (keep-alive ends).
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(gauge);
            drop(permit);
        });
    }
    tracing::info!("shutting down: finishing in-flight requests");
    drop(listener);
    let _ = stop_tx.send(true);
    let all = u32::try_from(config.max_connections.max(1)).unwrap_or(u32::MAX);
    if tokio::time::timeout(Duration::from_secs(10), slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!("connections still open after 10 s; closing them");
    }
    // Finish in-flight cycles: every shard drains its queue before the service stops.
    let svc = service.clone();
    let _ = tokio::task::spawn_blocking(move || svc.drain()).await;
    tracing::info!("stopped");
    Ok(())
}

/// SIGINT or SIGTERM, whichever comes first. The handlers are registered here, not when the
/// future is first polled.
#[cfg(unix)]
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {},
            _ = term.recv() => {},
        }
    })
}

#[cfg(not(unix))]
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}

// The unit tests count their allocations, so that memory budgets are enforced there too.
#[cfg(test)]
#[global_allocator]
static GLOBAL: valem_core::budget::Counting<std::alloc::System> =
    valem_core::budget::Counting(std::alloc::System);
