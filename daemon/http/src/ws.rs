//! The WebSocket `/models/{id}/subscribe` of the reference: server→client text frames, one per
//! committed change of the model — `{kind:"mutation", modelId, mutatedPaths, derivedUpdated,
//! flaggedConstraints, dispatchedEffects}` and `{kind:"spec-evolved", modelId, version}`.
//!
//! - `?paths=$.a,$.b` keeps the mutation frames whose written or derived paths lie under (or
//!   above) one of the prefixes, segment-wise (`$.a` covers `$.a.b` and `$.a[0]`, not `$.ab`);
//!   frames with flagged constraints or dispatched effects and spec-evolved frames always pass.
//!   Each path must be a canonical address without `[*]` (compared in its canonical spelling),
//!   at most [`MAX_PATHS`] of them: otherwise 400 before the upgrade, naming the path.
//! - An unknown model is 404 before the upgrade. Deleting the model closes the socket (1000),
//!   so does the daemon's shutdown (1001). A client that does not keep up — its queue of
//!   [`QUEUE`] frames overflows, or one frame cannot be written for [`SEND_TIMEOUT`] — is
//!   disconnected with 1008. Client frames are read only to answer pings and see the close.
//!
//! - In a fleet, a subscription to a model another node owns is relayed from that node (see
//!   [`relay`]); one whose model leaves this node ends with 1012, saying to subscribe again.
//!
//! The guard (Host, Origin, API key as `?token=`) runs before the handler. Events reach the
//! socket task through a bounded channel fed by a non-blocking send on the shard thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{close_code, CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use super::rest::extract::{Params, P};
use super::rest::{count_errors, ApiError};
use super::AppState;
use valem_core::expr::path::Address;
use valem_service::MutationResult;
use valem_service::{Event, EventFilter, EventSink, ServiceError};

/// Frames queued for one subscriber before it counts as too slow.
const QUEUE: usize = 1024;
/// Longest wait for one frame to be written.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest client frame read (clients have nothing to say beyond pings and close).
const MAX_CLIENT_MESSAGE: usize = 64 << 10;
/// Most paths one subscription's `?paths=` may list.
pub const MAX_PATHS: usize = 64;

pub fn routes(st: &AppState) -> Router<AppState> {
    Router::new()
        .route("/models/{id}/subscribe", get(subscribe))
        .layer(middleware::from_fn_with_state(st.clone(), count_errors))
}

/// An open subscription, counted against `max_subscriptions` until dropped.
struct Slot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn subscribe(
    State(st): State<AppState>,
    P(id): P<String>,
    q: Params,
    scoped: Option<axum::Extension<super::sandbox::Scoped>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let paths = filter_paths(q.get("paths").unwrap_or(""))?;
    let ws = ws.map_err(|r| {
        ApiError::new(
            r.status(),
            "bad_request",
            "WebSocket upgrade required",
            r.body_text(),
        )
    })?;
    let max = st.config.max_subscriptions;
    if st
        .subscriptions
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < max).then_some(n + 1)
        })
        .is_err()
    {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_subscriptions",
            "Too many subscriptions",
            format!("{max} WebSocket subscriptions are open; close one first"),
        ));
    }
    let slot = Slot(st.subscriptions.clone());

    // Subscribe before checking that the model exists: a delete in between is then an event,
    // not a socket left open on nothing. A refused subscriber's channel is closed, and its
    // filter asks for the next event of any model so that the sink sees it and is dropped.
    let (filter, sink, rx, overflow) = subscriber(&id, QUEUE);
    st.service.subscribe_with(filter, sink);
    match st.service.info(&valem_service::ModelId::from(&id)).await {
        Ok(_) => {}
        // Another node of the fleet owns the model: the subscription is relayed from there.
        Err(ServiceError::Elsewhere { url, .. })
            if scoped.is_none() && !headers.contains_key(crate::forward::FORWARDED) =>
        {
            drop(rx);
            let target = uri
                .path_and_query()
                .map_or_else(|| uri.path().to_string(), |p| p.as_str().to_string());
            return relay(&st, ws, &url, &target, slot).await;
        }
        Err(e) => return Err(e.into()),
    }

    let stop = st.shutdown.clone();
    // A sandbox session's frames name the model by the session's own id.
    let shown = match scoped {
        Some(axum::Extension(s)) => id.strip_prefix(&s.prefix()).unwrap_or(&id).to_string(),
        None => id,
    };
    Ok(ws
        .max_message_size(MAX_CLIENT_MESSAGE)
        .on_upgrade(move |socket| async move {
            run(socket, shown, rx, overflow, paths, stop).await;
            drop(slot);
        })
        .into_response())
}

/// Relay a subscription to model's owner at `owner` (a fleet's node): the socket to the owner
/// is opened first (an owner that does not answer is a 503 before the upgrade, like a forwarded
/// request), then every frame of the owner's goes to the client as it is, its close included.
/// The owner going away closes the client's socket with 1012: subscribing again reaches the
/// model's next owner.
async fn relay(
    st: &AppState,
    ws: WebSocketUpgrade,
    owner: &str,
    target: &str,
    slot: Slot,
) -> Result<Response, ApiError> {
    let unreachable = |why: String| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "owner_unreachable",
            "Owner unreachable",
            format!(
                "the model's owner at {owner} did not take the subscription ({why}); once its \
                 lease runs out the next request takes the model over: retry in a second"
            ),
        )
    };
    let (upstream, answer) = match connect_owner(st, owner, target).await {
        Ok(c) => c,
        Err(why) => {
            st.metrics.forwarded(false);
            return Err(unreachable(why));
        }
    };
    st.metrics.forwarded(true);
    let by = answer.headers().get(crate::forward::NODE).cloned();
    let stop = st.shutdown.clone();
    let mut r = ws
        .max_message_size(MAX_CLIENT_MESSAGE)
        .on_upgrade(move |socket| async move {
            pipe(socket, upstream, stop).await;
            drop(slot);
        })
        .into_response();
    if let Some(v) = by {
        r.headers_mut().insert(crate::forward::NODE, v);
    }
    Ok(r)
}

/// A socket to model's owner at `owner` (a fleet's node, `http://…`) on `target` (path and
/// query), as this node: marked forwarded, with this daemon's API key.
pub(crate) async fn connect_owner(
    st: &AppState,
    owner: &str,
    target: &str,
) -> Result<
    (
        Upstream,
        tokio_tungstenite::tungstenite::handshake::client::Response,
    ),
    String,
> {
    let base = owner.trim_end_matches('/');
    let Some(rest) = base.strip_prefix("http://") else {
        return Err("only http:// owners are relayed".into());
    };
    let mut request = format!("ws://{rest}{target}")
        .into_client_request()
        .map_err(|e| e.to_string())?;
    let node = st
        .service
        .store()
        .and_then(|s| s.node_id())
        .unwrap_or_default();
    if let Ok(v) = HeaderValue::from_str(&node) {
        request.headers_mut().insert(crate::forward::FORWARDED, v);
    }
    if let Some(k) = &st.config.api_key {
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {k}")) {
            request
                .headers_mut()
                .insert(axum::http::header::AUTHORIZATION, v);
        }
    }
    let connect = async {
        let host = rest.split('/').next().unwrap_or(rest);
        let addr = if host.contains(':') {
            host.to_string()
        } else {
            format!("{host}:80")
        };
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        tokio_tungstenite::client_async(request, tcp)
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(SEND_TIMEOUT, connect).await {
        Ok(c) => c,
        Err(_) => Err("timed out".into()),
    }
}

/// A socket to another node.
pub(crate) type Upstream = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Carry the owner's frames to the client until either side closes.
async fn pipe(mut socket: WebSocket, mut upstream: Upstream, mut stop: watch::Receiver<bool>) {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message as Up;
    loop {
        tokio::select! {
            m = upstream.next() => match m {
                Some(Ok(Up::Text(t))) => {
                    let sent = tokio::time::timeout(
                        SEND_TIMEOUT,
                        socket.send(Message::Text(t.as_str().into())),
                    )
                    .await;
                    if !matches!(sent, Ok(Ok(()))) {
                        let _ = upstream.close(None).await;
                        return;
                    }
                }
                Some(Ok(Up::Close(f))) => {
                    let (code, reason) = f.map_or((close_code::NORMAL, String::new()), |f| {
                        (u16::from(f.code), f.reason.as_str().to_string())
                    });
                    close(&mut socket, code, reason).await;
                    return;
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => {
                    close(
                        &mut socket,
                        close_code::RESTART,
                        "the model's owner went away: subscribe again (the model's next owner \
                         takes it)"
                            .into(),
                    )
                    .await;
                    return;
                }
            },
            msg = socket.recv() => match msg {
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => {
                    let _ = upstream.close(None).await;
                    return;
                }
                Some(Ok(_)) => {}
            },
            _ = stop.changed() => {
                close(&mut socket, close_code::AWAY, "the daemon is shutting down".into()).await;
                let _ = upstream.close(None).await;
                return;
            }
        }
    }
}

/// The `?paths=` filter, comma-separated: each a canonical address without `[*]`, in its
/// canonical spelling (the one of `mutatedPaths`), at most [`MAX_PATHS`]; a 400 naming the
/// first that is not.
fn filter_paths(raw: &str) -> Result<Vec<String>, ApiError> {
    let listed: Vec<&str> = raw
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    if listed.len() > MAX_PATHS {
        return Err(ApiError::bad_request(format!(
            "`paths` lists {} paths; a subscription filters on at most {MAX_PATHS}",
            listed.len()
        )));
    }
    listed
        .into_iter()
        .map(|p| {
            let shown: String = if p.chars().count() > 120 {
                p.chars().take(120).chain(['…']).collect()
            } else {
                p.to_string()
            };
            let a = Address::parse_transient(p).map_err(|e| {
                ApiError::bad_request(format!("`paths`: `{shown}` is not a canonical path: {e}"))
            })?;
            if a.has_wildcard() {
                return Err(ApiError::bad_request(format!(
                    "`paths`: `{shown}` has a `[*]`; filter on the array itself (`$.items` covers every element)"
                )));
            }
            Ok(a.to_string())
        })
        .collect()
}

/// A subscriber of `model_id`'s events: the filter and sink the service calls on the shard
/// thread, the receiving end of their bounded queue, and the flag the sink raises (and then
/// drops itself) when the queue is full.
fn subscriber(
    model_id: &str,
    queue: usize,
) -> (
    EventFilter,
    EventSink,
    mpsc::Receiver<Event>,
    Arc<AtomicBool>,
) {
    let (tx, rx) = mpsc::channel::<Event>(queue);
    let overflow = Arc::new(AtomicBool::new(false));
    let (watch_tx, wanted) = (tx.clone(), model_id.to_string());
    let filter: EventFilter =
        Arc::new(move |e: &Event| e.model_id() == wanted || watch_tx.is_closed());
    let flag = overflow.clone();
    let sink: EventSink = Box::new(move |e: &Event| match tx.try_send(e.clone()) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            flag.store(true, Ordering::SeqCst);
            false
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    });
    (filter, sink, rx, overflow)
}

/// What one event means for the socket.
enum Out {
    Send(String),
    Skip,
    Close(u16, String),
}

fn frame(model_id: &str, e: &Event, paths: &[String]) -> Out {
    match e {
        Event::Mutation { result, .. } => {
            let always =
                !result.flagged_constraints.is_empty() || !result.dispatched_effects.is_empty();
            if !always && !paths.is_empty() && !touches(result, paths) {
                return Out::Skip;
            }
            Out::Send(
                json!({
                    "kind": "mutation",
                    "modelId": model_id,
                    "mutatedPaths": result.mutated_paths,
                    "derivedUpdated": result.derived_updated,
                    "flaggedConstraints": result.flagged_constraints,
                    "dispatchedEffects": result.dispatched_effects,
                })
                .to_string(),
            )
        }
        Event::SpecEvolved { version, .. } => Out::Send(
            json!({"kind": "spec-evolved", "modelId": model_id, "version": version}).to_string(),
        ),
        Event::Deleted { .. } => Out::Close(
            close_code::NORMAL,
            format!("model `{model_id}` was deleted"),
        ),
        Event::Moved { .. } => Out::Close(
            close_code::RESTART,
            format!(
                "model `{model_id}` moved to another node of the fleet: subscribe again (any node \
                 forwards the subscription to its owner)"
            ),
        ),
        // The reference has no frame for a restore; clients re-read on their next event.
        Event::Restored { .. } => Out::Skip,
        // A socket is opened on a model that exists; its creation is not news to it.
        Event::Created { .. } => Out::Skip,
    }
}

/// `path` is `prefix` or lies below it (`$.a` → `$.a.b`, `$.a[0]`; not `$.ab`).
fn within(path: &str, prefix: &str) -> bool {
    path == prefix
        || (path.starts_with(prefix)
            && matches!(path.as_bytes().get(prefix.len()), Some(b'.' | b'[')))
}

fn touches(r: &MutationResult, prefixes: &[String]) -> bool {
    r.mutated_paths
        .iter()
        .chain(r.derived_updated.iter())
        .any(|p| prefixes.iter().any(|x| within(p, x) || within(x, p)))
}

async fn close(socket: &mut WebSocket, code: u16, reason: String) {
    let msg = Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }));
    let _ = tokio::time::timeout(SEND_TIMEOUT, socket.send(msg)).await;
}

async fn run(
    mut socket: WebSocket,
    model_id: String,
    mut rx: mpsc::Receiver<Event>,
    overflow: Arc<AtomicBool>,
    paths: Vec<String>,
    mut stop: watch::Receiver<bool>,
) {
    let too_slow = || {
        (
            close_code::POLICY,
            format!("the client did not keep up: more than {QUEUE} frames queued"),
        )
    };
    if *stop.borrow() {
        close(
            &mut socket,
            close_code::AWAY,
            "the daemon is shutting down".into(),
        )
        .await;
        return;
    }
    loop {
        tokio::select! {
            ev = rx.recv() => {
                if overflow.load(Ordering::SeqCst) {
                    let (code, reason) = too_slow();
                    close(&mut socket, code, reason).await;
                    return;
                }
                let Some(ev) = ev else {
                    // The sink was dropped without an overflow: the service is stopping.
                    close(&mut socket, close_code::AWAY, "the daemon is shutting down".into()).await;
                    return;
                };
                match frame(&model_id, &ev, &paths) {
                    Out::Skip => {}
                    Out::Send(text) => {
                        match tokio::time::timeout(SEND_TIMEOUT, socket.send(Message::Text(text.into()))).await {
                            Ok(Ok(())) => {}
                            Ok(Err(_)) => return,
                            Err(_) => {
                                let (code, reason) = too_slow();
                                close(&mut socket, code, reason).await;
                                return;
                            }
                        }
                    }
                    Out::Close(code, reason) => {
                        close(&mut socket, code, reason).await;
                        return;
                    }
                }
            }
            msg = socket.recv() => match msg {
                // Pings are answered by the protocol layer as they are read.
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return,
                Some(Ok(_)) => {}
            },
            _ = stop.changed() => {
                close(&mut socket, close_code::AWAY, "the daemon is shutting down".into()).await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evolved(id: &str) -> Event {
        Event::SpecEvolved {
            model_id: id.into(),
            version: "1.0.0".into(),
        }
    }

    #[test]
    fn a_full_queue_raises_overflow_and_drops_the_sink() {
        let (filter, sink, mut rx, overflow) = subscriber("m", 2);
        assert!(filter(&evolved("m")));
        assert!(!filter(&evolved("other")));
        assert!(sink(&evolved("m")));
        assert!(sink(&evolved("m")));
        assert!(!overflow.load(Ordering::SeqCst));
        assert!(!sink(&evolved("m")), "the third does not fit");
        assert!(overflow.load(Ordering::SeqCst));
        assert!(rx.try_recv().is_ok());
        // A subscriber whose socket is gone asks for every event, so that its sink is dropped.
        let (filter, sink, rx, _) = subscriber("m", 2);
        drop(rx);
        assert!(filter(&evolved("other")));
        assert!(!sink(&evolved("other")));
    }

    #[test]
    fn filter_paths_are_canonical_addresses() {
        assert_eq!(
            filter_paths(" $.a , $['b'],$.c[0] ,,").unwrap(),
            vec!["$.a", "$.b", "$.c[0]"]
        );
        assert_eq!(filter_paths("").unwrap(), Vec::<String>::new());
        for bad in ["items.0.x", "$.a.0", "$[", "$.a[*].b", "a"] {
            let e = filter_paths(&format!("$.ok,{bad}")).expect_err(bad);
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            let m = e.body["message"].as_str().unwrap_or("");
            assert!(m.contains(&format!("`{bad}`")), "{m}");
        }
        let many = vec!["$.a"; MAX_PATHS + 1].join(",");
        let e = filter_paths(&many).expect_err("too many");
        assert!(e.body["message"]
            .as_str()
            .unwrap_or("")
            .contains("at most 64"));
        assert_eq!(
            filter_paths(&vec!["$.a"; MAX_PATHS].join(","))
                .map(|p| p.len())
                .ok(),
            Some(MAX_PATHS)
        );
    }

    #[test]
    fn prefixes_match_segment_wise() {
        assert!(within("$.a.b", "$.a"));
        assert!(within("$.a[0]", "$.a"));
        assert!(within("$.a", "$.a"));
        assert!(within("$.a", "$"));
        assert!(!within("$.ab", "$.a"));
        let r = MutationResult {
            mutated_paths: ["$.order"].into_iter().collect(),
            derived_updated: ["$.total"].into_iter().collect(),
            ..Default::default()
        };
        assert!(touches(&r, &["$.order.qty".into()]), "an ancestor write");
        assert!(touches(&r, &["$.total".into()]));
        assert!(!touches(&r, &["$.orders".into(), "$.tot".into()]));
    }
}
