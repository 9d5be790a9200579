//! `subscriptions/listen` (modern era): one long-lived stream of the change notifications a
//! client opted in to — `notifications/resources/updated` for the `valem://state/{modelId}`
//! URIs it names, and `notifications/resources/list_changed` when models come and go — each
//! tagged with the subscription's id (the id of the listen request). The transport owns the
//! stream: HTTP answers the request with an SSE stream, stdio writes to its one channel. What
//! is shared is here: reading the filter, the messages, and attaching to the service's events.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::{json, Value as Json};

use super::modern::key;
use super::resources::STATE_PREFIX;
use valem_service::{Event, EventFilter, ModelService};

/// Most resource URIs one subscription may name.
pub const MAX_URIS: usize = 1000;

/// What a subscription delivers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    /// Model ids whose state URIs were named.
    models: HashSet<String>,
    /// The state URIs, as named (what the acknowledgement repeats).
    uris: Vec<String>,
    /// `notifications/resources/list_changed` when a model is created or deleted.
    resources_list: bool,
    /// A sandbox session's subscription sees only its own namespace's models (`<ns>__`).
    within: Option<String>,
    /// Tasks whose status changes to deliver (`notifications/tasks`, the tasks extension).
    task_ids: Vec<String>,
}

/// A change to deliver on a subscription.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// The state of this model changed (`valem://state/{id}`).
    Updated(String),
    /// The list of resources changed (a model was created or deleted).
    ListChanged,
    /// A watched task changed: its detail.
    Task(Json),
}

impl Filter {
    /// The filter of a `subscriptions/listen` request's `params.notifications`; an error names
    /// the offending member. URIs that are not a model's state are not subscribable here: they
    /// are left out of the acknowledgement (the client learns that from it).
    /// The models whose state URIs it names.
    pub fn models(&self) -> impl Iterator<Item = &str> + '_ {
        self.models.iter().map(String::as_str)
    }

    pub fn parse(params: &Json) -> Result<Filter, String> {
        let n = match params.get("notifications") {
            Some(n @ Json::Object(_)) => n,
            None | Some(Json::Null) => {
                return Err(
                    "subscriptions/listen needs `notifications`: the change notifications to \
                     receive (toolsListChanged, promptsListChanged, resourcesListChanged, \
                     resourceSubscriptions)"
                        .into(),
                )
            }
            Some(_) => return Err("`notifications` must be an object".into()),
        };
        let flag = |k: &str| match n.get(k) {
            None | Some(Json::Null) => Ok(false),
            Some(Json::Bool(b)) => Ok(*b),
            Some(_) => Err(format!("`notifications.{k}` must be a boolean")),
        };
        // Checked for their type; never honoured (see `within`).
        flag("toolsListChanged")?;
        flag("promptsListChanged")?;
        let mut f = Filter {
            resources_list: flag("resourcesListChanged")?,
            ..Filter::default()
        };
        match n.get("resourceSubscriptions") {
            None | Some(Json::Null) => {}
            Some(Json::Array(uris)) => {
                if uris.len() > MAX_URIS {
                    return Err(format!(
                        "`notifications.resourceSubscriptions` names {} URIs; the limit is {MAX_URIS}",
                        uris.len()
                    ));
                }
                for (i, u) in uris.iter().enumerate() {
                    let Some(u) = u.as_str() else {
                        return Err(format!(
                            "`notifications.resourceSubscriptions[{i}]` must be a string"
                        ));
                    };
                    if let Some(id) = u.strip_prefix(STATE_PREFIX).filter(|id| !id.is_empty()) {
                        if f.models.insert(id.to_string()) {
                            f.uris.push(u.to_string());
                        }
                    }
                }
            }
            Some(_) => {
                return Err("`notifications.resourceSubscriptions` must be an array of URIs".into())
            }
        }
        match n.get("taskIds") {
            None | Some(Json::Null) => {}
            Some(Json::Array(ids)) if ids.len() <= MAX_URIS => {
                for (i, t) in ids.iter().enumerate() {
                    let Some(t) = t.as_str() else {
                        return Err(format!("`notifications.taskIds[{i}]` must be a string"));
                    };
                    if !f.task_ids.iter().any(|x| x == t) {
                        f.task_ids.push(t.to_string());
                    }
                }
            }
            Some(Json::Array(ids)) => {
                return Err(format!(
                    "`notifications.taskIds` names {} tasks; the limit is {MAX_URIS}",
                    ids.len()
                ))
            }
            Some(_) => return Err("`notifications.taskIds` must be an array of task ids".into()),
        }
        Ok(f)
    }

    /// Restrict the subscription to the models whose ids start with `prefix` (a sandbox
    /// session's namespace): other models' changes, creations and deletions never reach it.
    ///
    /// Tool and prompt list changes are not offered (the lists never change while the server
    /// runs, and discover says `listChanged: false`): they are left out of the acknowledgement.
    pub fn within(mut self, prefix: String) -> Filter {
        self.models.retain(|m| m.starts_with(&prefix));
        self.uris.retain(|u| {
            u.strip_prefix(STATE_PREFIX)
                .is_some_and(|m| m.starts_with(&prefix))
        });
        self.within = Some(prefix);
        self
    }

    fn sees(&self, id: &str) -> bool {
        self.within.as_deref().is_none_or(|p| id.starts_with(p))
    }

    /// What the server agreed to honour, as the acknowledgement states it.
    pub fn acknowledged(&self) -> Json {
        let mut a = json!({});
        if self.resources_list {
            a["resourcesListChanged"] = json!(true);
        }
        if !self.uris.is_empty() {
            a["resourceSubscriptions"] = json!(self.uris);
        }
        if !self.task_ids.is_empty() {
            a["taskIds"] = json!(self.task_ids);
        }
        a
    }

    /// The tasks whose status changes it asked for.
    pub fn task_ids(&self) -> &[String] {
        &self.task_ids
    }

    /// The notice an event means for this subscription, if any.
    pub fn notice(&self, ev: &Event) -> Option<Notice> {
        let id = ev.model_id();
        if !self.sees(id) {
            return None;
        }
        match ev {
            Event::Created { .. } | Event::Deleted { .. } if self.resources_list => {
                Some(Notice::ListChanged)
            }
            // Neither changes the model's state (a move is a fleet's business).
            Event::Created { .. } | Event::Moved { .. } => None,
            _ if self.models.contains(id) => Some(Notice::Updated(id.to_string())),
            _ => None,
        }
    }

    fn wants(&self, ev: &Event) -> bool {
        if !self.sees(ev.model_id()) {
            return false;
        }
        match ev {
            Event::Created { .. } | Event::Deleted { .. } if self.resources_list => true,
            Event::Created { .. } | Event::Moved { .. } => false,
            _ => self.models.contains(ev.model_id()),
        }
    }
}

/// `notifications/subscriptions/acknowledged`: the first message of subscription `sub`.
pub fn acknowledgement(sub: &Json, f: &Filter) -> Json {
    json!({"jsonrpc": "2.0", "method": "notifications/subscriptions/acknowledged", "params": {
        "_meta": {key::SUBSCRIPTION_ID: sub},
        "notifications": f.acknowledged(),
    }})
}

/// The notification a notice becomes on subscription `sub`.
pub fn notification(sub: &Json, n: &Notice) -> Json {
    match n {
        Notice::Updated(id) => {
            json!({"jsonrpc": "2.0", "method": "notifications/resources/updated",
            "params": {"_meta": {key::SUBSCRIPTION_ID: sub}, "uri": format!("{STATE_PREFIX}{id}")}})
        }
        Notice::ListChanged => {
            json!({"jsonrpc": "2.0", "method": "notifications/resources/list_changed",
            "params": {"_meta": {key::SUBSCRIPTION_ID: sub}}})
        }
        Notice::Task(detail) => super::tasks::notification(sub, detail),
    }
}

/// The graceful end of subscription `sub` (the response to its listen request).
pub fn closed(sub: &Json) -> Json {
    json!({"jsonrpc": "2.0", "id": sub, "result": super::modern::finish(
        json!({"_meta": {key::SUBSCRIPTION_ID: sub}}), None)})
}

/// The end of a subscription whose reader fell too far behind: an error response naming why.
pub fn overflowed(sub: &Json, queued: usize) -> Json {
    json!({"jsonrpc": "2.0", "id": sub, "error": {
        "code": super::code::INTERNAL_ERROR,
        "message": format!(
            "the subscription was closed: its reader fell {queued} notifications behind; open \
             a new subscriptions/listen and re-read the resources it names"
        ),
        "data": {key::SUBSCRIPTION_ID: sub},
    }})
}

/// Where a subscription's notices go; false once it is gone (it must not block: a transport
/// hands the notice to a bounded queue and gives up when that is full).
pub type Sink = Arc<dyn Fn(Notice) -> bool + Send + Sync>;

/// Deliver the service's committed changes that `filter` wants to `sink`, on the shard thread
/// that committed them, and the status changes of the tasks it names (of `owner`), until
/// `sink` returns false.
///
/// Once `closed` is set the subscription is dropped at the next commit of any model (its sink
/// is asked, and says it is gone), so a stream closed on a quiet model leaves nothing behind.
pub fn attach(
    service: &ModelService,
    tasks: &super::tasks::Tasks,
    owner: &str,
    filter: Arc<Filter>,
    sink: Sink,
    closed: Arc<std::sync::atomic::AtomicBool>,
) {
    if !filter.task_ids.is_empty() {
        let to = sink.clone();
        tasks.watch(
            owner,
            filter.task_ids.clone(),
            Box::new(move |_, detail| to(Notice::Task(detail.clone()))),
        );
    }
    if filter.models.is_empty() && !filter.resources_list {
        return;
    }
    let wants = filter.clone();
    let is_closed = closed.clone();
    let events: EventFilter = Arc::new(move |ev: &Event| {
        closed.load(std::sync::atomic::Ordering::SeqCst) || wants.wants(ev)
    });
    service.subscribe_with(
        events,
        Box::new(move |ev: &Event| {
            if is_closed.load(std::sync::atomic::Ordering::SeqCst) {
                return false;
            }
            match filter.notice(ev) {
                Some(n) => sink(n),
                None => true,
            }
        }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(n: Json) -> Result<Filter, String> {
        Filter::parse(&json!({"notifications": n}))
    }

    #[test]
    fn the_filter_keeps_what_we_honour() {
        let f = filter(json!({"toolsListChanged": true, "promptsListChanged": true,
            "resourcesListChanged": true,
            "resourceSubscriptions": ["valem://state/a", "valem://state/a", "valem://guide/x",
                "file:///etc/passwd", "valem://state/"]}))
        .unwrap();
        assert_eq!(
            f.acknowledged(),
            json!({"resourcesListChanged": true, "resourceSubscriptions": ["valem://state/a"]})
        );
        assert_eq!(filter(json!({})).unwrap().acknowledged(), json!({}));
    }

    #[test]
    fn bad_filters_name_the_member() {
        for (n, needle) in [
            (json!(null), "needs `notifications`"),
            (json!({"toolsListChanged": "yes"}), "toolsListChanged"),
            (json!({"resourceSubscriptions": "valem://state/a"}), "array"),
            (
                json!({"resourceSubscriptions": [1]}),
                "resourceSubscriptions[0]",
            ),
        ] {
            let e = filter(n).unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
        let many: Vec<String> = (0..=MAX_URIS)
            .map(|i| format!("valem://state/m{i}"))
            .collect();
        assert!(filter(json!({"resourceSubscriptions": many}))
            .unwrap_err()
            .contains("limit"));
    }

    #[test]
    fn events_become_notices() {
        let f = filter(json!({"resourcesListChanged": true,
            "resourceSubscriptions": ["valem://state/a"]}))
        .unwrap();
        let deleted = Event::Deleted {
            model_id: "b".into(),
        };
        let created = Event::Created {
            model_id: "a".into(),
        };
        let restored = Event::Restored {
            model_id: "a".into(),
        };
        let other = Event::Restored {
            model_id: "b".into(),
        };
        assert_eq!(f.notice(&deleted), Some(Notice::ListChanged));
        assert_eq!(f.notice(&created), Some(Notice::ListChanged));
        assert_eq!(f.notice(&restored), Some(Notice::Updated("a".into())));
        assert_eq!(f.notice(&other), None);
        assert!(!f.wants(&other));
        // A session's subscription sees its namespace only.
        let scoped = filter(json!({"resourcesListChanged": true,
            "resourceSubscriptions": ["valem://state/s1__a", "valem://state/b"]}))
        .unwrap()
        .within("s1__".into());
        assert_eq!(
            scoped.acknowledged()["resourceSubscriptions"],
            json!(["valem://state/s1__a"])
        );
        assert_eq!(scoped.notice(&created), None);
        assert_eq!(
            scoped.notice(&Event::Created {
                model_id: "s1__x".into()
            }),
            Some(Notice::ListChanged)
        );
        let quiet = filter(json!({"resourceSubscriptions": ["valem://state/a"]})).unwrap();
        assert_eq!(quiet.notice(&created), None);
        let sub = json!(7);
        let n = notification(&sub, &Notice::Updated("a".into()));
        assert_eq!(n["params"]["uri"], "valem://state/a");
        assert_eq!(n["params"]["_meta"][key::SUBSCRIPTION_ID], 7);
        assert_eq!(
            acknowledgement(&sub, &quiet)["params"]["notifications"],
            json!({"resourceSubscriptions": ["valem://state/a"]})
        );
        assert_eq!(closed(&sub)["result"]["_meta"][key::SUBSCRIPTION_ID], 7);
    }
}
