//! A fleet's node hears the events of a model another node owns while something here watches
//! it (an MCP session's resource subscription): it finds the model's owner in the store (it
//! claims nothing itself), subscribes there (the WebSocket `/models/{id}/subscribe`) and
//! publishes every frame it hears on its own service's event bus, as the event it stands for,
//! so every subscriber here hears it as if the model were here. When the model moves the socket
//! ends, and the relay looks for it again: on another node (subscribe there), or here or nowhere
//! (this node's own commits are published here already: the relay waits, looking again ever less
//! often, and at once when the model leaves this node). Events between two sockets are not
//! replayed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value as Json;
use tokio::sync::watch;

use crate::AppState;
use valem_service::{Event, MutationResult};

/// How soon a relay looks again at a model's owner while it is not relaying: at first, then
/// twice as late each time up to [`RECHECK_MAX`] (a model that leaves this node says so at once:
/// see `moved_here`).
const RECHECK: Duration = Duration::from_millis(500);
const RECHECK_MAX: Duration = Duration::from_secs(5);

/// The models relayed here, each with how many watch it and what stops its relay.
#[derive(Default)]
pub struct Relays {
    map: Mutex<HashMap<String, (usize, watch::Sender<bool>)>>,
}

/// A watch of one model's events: the relay runs while one is held.
pub struct RelayGuard {
    relays: Arc<Relays>,
    model: String,
}

impl Drop for RelayGuard {
    fn drop(&mut self) {
        if let Ok(mut m) = self.relays.map.lock() {
            if let Some((n, stop)) = m.get_mut(&self.model) {
                *n -= 1;
                if *n == 0 {
                    let _ = stop.send(true);
                    m.remove(&self.model);
                }
            }
        }
    }
}

impl Relays {
    /// Watch `model` (a fleet's node only: `None` elsewhere, where every model is here).
    pub fn watch(self: &Arc<Relays>, st: &AppState, model: &str) -> Option<RelayGuard> {
        st.service.store().filter(|s| s.is_fleet())?;
        let mut m = self.map.lock().ok()?;
        match m.get_mut(model) {
            Some((n, _)) => *n += 1,
            None => {
                let (stop_tx, stop) = watch::channel(false);
                m.insert(model.to_string(), (1, stop_tx));
                tokio::spawn(run(st.clone(), model.to_string(), stop));
            }
        }
        Some(RelayGuard {
            relays: self.clone(),
            model: model.to_string(),
        })
    }

    /// How many models are relayed here.
    pub fn len(&self) -> usize {
        self.map.lock().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

async fn run(st: AppState, model: String, mut stop: watch::Receiver<bool>) {
    let mut shutdown = st.shutdown.clone();
    let moved = moved_here(&st, &model);
    let mut wait = RECHECK;
    loop {
        if *stop.borrow() || *shutdown.borrow() {
            break;
        }
        if let Some(url) = owner_elsewhere(&st, &model).await {
            let target = format!("/models/{}/subscribe", valem_core::path_segment(&model));
            if let Ok((upstream, _)) = crate::ws::connect_owner(&st, &url, &target).await {
                st.metrics.forwarded(true);
                wait = RECHECK;
                if pump(&st, &model, upstream, &mut stop).await {
                    break;
                }
            } else {
                st.metrics.forwarded(false);
            }
        }
        tokio::select! {
            _ = stop.changed() => break,
            _ = shutdown.changed() => break,
            _ = moved.0.notified() => wait = RECHECK,
            _ = tokio::time::sleep(wait) => wait = (wait * 2).min(RECHECK_MAX),
        }
    }
    moved.1.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The URL of the live node other than this one that owns `model`, read from the store (a
/// relay never claims a model: a model nobody owns is claimed by the next request for it).
async fn owner_elsewhere(st: &AppState, model: &str) -> Option<String> {
    let store = st.service.store()?.clone();
    let me = store.node_id()?;
    let m = model.to_string();
    let owner = tokio::task::spawn_blocking(move || store.owner(&m))
        .await
        .ok()?
        .ok()??;
    (owner.node != me && owner.lease_until > valem_service::time::now())
        .then_some(owner.url)
        .flatten()
}

/// Woken when `model` leaves this node (`Event::Moved` here), until the flag is raised.
fn moved_here(
    st: &AppState,
    model: &str,
) -> (Arc<tokio::sync::Notify>, Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let notify = Arc::new(tokio::sync::Notify::new());
    let done = Arc::new(AtomicBool::new(false));
    let (wanted, gone) = (model.to_string(), done.clone());
    st.service.subscribe_with(
        Arc::new(move |e: &Event| {
            gone.load(Ordering::Relaxed)
                || matches!(e, Event::Moved { model_id } if *model_id == wanted)
        }),
        {
            let (notify, done) = (notify.clone(), done.clone());
            Box::new(move |_: &Event| {
                notify.notify_one();
                !done.load(Ordering::Relaxed)
            })
        },
    );
    (notify, done)
}

/// Publish what the owner says of `model` until its socket ends (`false`: look for the owner
/// again) or the watch does (`true`).
async fn pump(
    st: &AppState,
    model: &str,
    mut upstream: crate::ws::Upstream,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    loop {
        tokio::select! {
            m = upstream.next() => match m {
                Some(Ok(Message::Text(t))) => {
                    if let Some(e) = event_of(model, t.as_str()) {
                        st.service.publish_relayed(e);
                    }
                }
                Some(Ok(Message::Close(f))) => {
                    // 1000 is the model's deletion (any other close: it moved, or its owner
                    // stopped).
                    if f.is_some_and(|f| u16::from(f.code) == 1000) {
                        st.service.publish_relayed(Event::Deleted { model_id: model.to_string() });
                    }
                    return false;
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return false,
            },
            _ = stop.changed() => {
                let _ = upstream.close(None).await;
                return true;
            }
        }
    }
}

/// The event a frame of the WebSocket stands for.
fn event_of(model: &str, text: &str) -> Option<Event> {
    let v: Json = serde_json::from_str(text).ok()?;
    let model_id = model.to_string();
    match v.get("kind")?.as_str()? {
        "mutation" => Some(Event::Mutation {
            model_id,
            result: Arc::new(MutationResult::from_json(&v)?),
        }),
        "spec-evolved" => Some(Event::SpecEvolved {
            model_id,
            version: v.get("version")?.as_str()?.to_string(),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_read_back_as_the_events_they_stand_for() {
        let frame = r#"{"kind":"mutation","modelId":"m","mutatedPaths":["$.a"],
            "derivedUpdated":["$.b"],"flaggedConstraints":[],"dispatchedEffects":[]}"#;
        match event_of("m", frame) {
            Some(Event::Mutation { model_id, result }) => {
                assert_eq!(model_id, "m");
                assert!(result.success);
                assert_eq!(result.mutated_paths.iter().collect::<Vec<_>>(), vec!["$.a"]);
                assert_eq!(
                    result.derived_updated.iter().collect::<Vec<_>>(),
                    vec!["$.b"]
                );
            }
            other => panic!("{other:?}"),
        }
        let evolved = r#"{"kind":"spec-evolved","modelId":"m","version":"2.0.0"}"#;
        assert!(
            matches!(event_of("m", evolved), Some(Event::SpecEvolved { version, .. }) if version == "2.0.0")
        );
        assert!(event_of("m", r#"{"kind":"mutation"}"#).is_none());
        assert!(event_of("m", "not json").is_none());
    }
}
