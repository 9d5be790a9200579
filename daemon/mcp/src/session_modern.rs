//! The modern era's side of a [`Session`] (MCP 2026-07-28): a request checked and served
//! without session state (`server/discover`, `subscriptions/listen` on a channel of its own,
//! the tasks extension's methods, long tools as tasks) and its reply shaped for the era.

use std::sync::Arc;

use serde_json::{json, Value as Json};

use super::{code, error, id_key, listen, modern, resources, result, tasks, tools};
use super::{Modern, Outbox, Session, LISTEN_QUEUE, MAX_LISTENS_PER_CHANNEL};

impl Session {
    /// A modern-era request: its `_meta` read and checked, then served without any session
    /// state; the result shaped as the revision wants ([`modern::finish`]). `None` when the
    /// request stays open (a `subscriptions/listen` on stdio).
    pub(super) fn modern_request(
        &self,
        method: &str,
        params: Json,
        id: Json,
        io: Option<&Outbox>,
        principal: &str,
    ) -> Option<Json> {
        let meta = match modern::read_meta(method, &params, &id) {
            Ok(m) => m,
            Err(e) => return Some(e),
        };
        let cx = Modern { meta, principal };
        let meta = &cx.meta;
        let span = tracing::debug_span!(
            "mcp_request",
            method,
            traceparent = meta.traceparent.as_deref().unwrap_or("")
        );
        let _entered = span.enter();
        let reply = match method {
            "server/discover" => result(id, self.discover()),
            "subscriptions/listen" => return self.listen(&params, id),
            "initialize"
            | "ping"
            | "logging/setLevel"
            | "resources/subscribe"
            | "resources/unsubscribe" => error(
                id,
                code::METHOD_NOT_FOUND,
                format!(
                    "method not found: {method} is not part of MCP {} (use it after an \
                     `initialize` handshake of an older revision{})",
                    meta.version,
                    match method {
                        "logging/setLevel" =>
                            "; per request, name a level in `_meta[\"io.modelcontextprotocol/logLevel\"]`",
                        "resources/subscribe" | "resources/unsubscribe" =>
                            "; subscriptions/listen with `resourceSubscriptions` replaces it",
                        _ => "",
                    }
                ),
            ),
            "tasks/get" | "tasks/update" | "tasks/cancel" => self.task_method(method, &params, id, &cx),
            "tasks/result" | "tasks/list" => error(
                id,
                code::METHOD_NOT_FOUND,
                format!(
                    "method not found: {method} is not part of the tasks extension (poll with \
                     tasks/get)"
                ),
            ),
            _ => self.common(method, params.clone(), id, io, Some(&cx)),
        };
        let reply = modern_response(reply, method, &params);
        // One event per request, inside its span (with the caller's trace context).
        match reply.pointer("/error/code").and_then(Json::as_i64) {
            Some(code) => tracing::debug!(code, "mcp request refused"),
            None => tracing::debug!("mcp request served"),
        }
        Some(reply)
    }

    /// `subscriptions/listen` on a channel of its own (stdio): acknowledged at once, then the
    /// notifications it asked for go to the outbox until `notifications/cancelled` names it or
    /// the channel ends. No reply now (`None`); a malformed filter is answered with an error.
    fn listen(&self, params: &Json, id: Json) -> Option<Json> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let filter = match listen::Filter::parse(params) {
            Ok(f) => Arc::new(f),
            Err(why) => return Some(error(id, code::INVALID_PARAMS, why)),
        };
        let key = id_key(&id);
        let stop = Arc::new(AtomicBool::new(false));
        {
            let Ok(mut l) = self.listens.lock() else {
                return Some(error(
                    id,
                    code::INTERNAL_ERROR,
                    "the listen registry failed",
                ));
            };
            l.retain(|_, s| !s.load(Ordering::SeqCst));
            if l.contains_key(&key) {
                return Some(error(
                    id,
                    code::INVALID_REQUEST,
                    "a subscriptions/listen with this request id is already open",
                ));
            }
            if l.len() >= MAX_LISTENS_PER_CHANNEL {
                return Some(error(
                    id,
                    code::INVALID_REQUEST,
                    format!(
                        "too many open subscriptions on this channel (limit \
                         {MAX_LISTENS_PER_CHANNEL}); cancel one first"
                    ),
                ));
            }
            l.insert(key, stop.clone());
        }
        (self.out)(&listen::acknowledgement(&id, &filter));
        let (tx, rx) = std::sync::mpsc::sync_channel::<listen::Notice>(LISTEN_QUEUE);
        let full = Arc::new(AtomicBool::new(false));
        let (sink_stop, sink_full) = (stop.clone(), full.clone());
        let sink: listen::Sink = Arc::new(move |n| {
            if sink_stop.load(Ordering::SeqCst) {
                return false;
            }
            match tx.try_send(n) {
                Ok(()) => true,
                Err(std::sync::mpsc::TrySendError::Full(_)) => {
                    sink_full.store(true, Ordering::SeqCst);
                    false
                }
                Err(_) => false,
            }
        });
        listen::attach(
            &self.server.service,
            &self.server.tasks,
            "",
            filter,
            sink,
            stop.clone(),
        );
        let out = self.out.clone();
        let listens = self.me.clone();
        let spawned = std::thread::Builder::new()
            .name("valem-mcp-listen".into())
            .spawn(move || loop {
                match rx.recv_timeout(std::time::Duration::from_millis(250)) {
                    Ok(n) if !stop.load(Ordering::SeqCst) => out(&listen::notification(&id, &n)),
                    Ok(_) => break,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                        if !stop.load(Ordering::SeqCst) => {}
                    Err(_) => {
                        if full.load(Ordering::SeqCst) && !stop.load(Ordering::SeqCst) {
                            out(&listen::overflowed(&id, LISTEN_QUEUE));
                        }
                        break;
                    }
                }
            });
        if spawned.is_err() {
            if let Some(me) = listens.upgrade() {
                if let Ok(mut l) = me.listens.lock() {
                    l.clear();
                }
            }
            return Some(error(
                json!(null),
                code::INTERNAL_ERROR,
                "could not start the subscription's thread",
            ));
        }
        None
    }

    /// `server/discover`: the revisions, capabilities, identity and instructions.
    fn discover(&self) -> Json {
        let mut capabilities = json!({
            "tools": {"listChanged": false},
            "resources": {"subscribe": true, "listChanged": true},
            "logging": {},
            "extensions": {modern::key::TASKS: {}},
        });
        if self.server.fixtures() {
            capabilities["prompts"] = json!({"listChanged": false});
            capabilities["completions"] = json!({});
        }
        modern::finish(
            json!({
                "supportedVersions": modern::MODERN_VERSIONS,
                "capabilities": capabilities,
                "instructions": self.server.instructions(),
            }),
            Some(modern::LONG),
        )
    }

    /// A modern call of a long tool (one of [`tools::TASKS`]) from a client that declared the
    /// tasks extension runs as a task: the answer is its handle. `None`: run it in place.
    pub(super) fn call_as_task(
        &self,
        tool: &tools::Tool,
        args: Json,
        id: &Json,
        cx: &Modern,
    ) -> Option<Json> {
        if !cx.meta.has_extension(modern::key::TASKS) || !tools::TASKS.contains(&tool.name) {
            return None;
        }
        let server = self.server.clone();
        let name = tool.name;
        let spawned = self.server.tasks.spawn(cx.principal, move |_| {
            let Some(tool) = server.tools.get(name) else {
                return Err(tasks::task_error(code::INTERNAL_ERROR, "the tool is gone"));
            };
            let ctx = tools::Ctx::new(&server);
            Ok(modern::finish(
                tools::envelope_for(name, tool.call(&ctx, args)),
                None,
            ))
        });
        Some(match spawned {
            Ok(t) => result(id.clone(), t.created_result()),
            Err(e) => error(id.clone(), code::INTERNAL_ERROR, e.to_string()),
        })
    }

    /// `tasks/get`, `tasks/update`, `tasks/cancel` (the tasks extension, declared per request).
    fn task_method(&self, method: &str, params: &Json, id: Json, cx: &Modern) -> Json {
        if !cx.meta.has_extension(modern::key::TASKS) {
            return tasks::missing_extension(id);
        }
        let Some(task_id) = params.get("taskId").and_then(Json::as_str) else {
            return error(
                id,
                code::INVALID_PARAMS,
                format!("{method} needs a `taskId` string"),
            );
        };
        let Some(task) = self.server.tasks.get(cx.principal, task_id) else {
            return error(
                id,
                code::INVALID_PARAMS,
                format!("unknown task `{task_id}` (it never existed, expired, or is not yours)"),
            );
        };
        match method {
            "tasks/get" => result(id, task.detail()),
            "tasks/update" => match params.get("inputResponses") {
                Some(Json::Object(r)) => {
                    self.server.tasks.update(&task, r);
                    result(id, json!({}))
                }
                _ => error(
                    id,
                    code::INVALID_PARAMS,
                    "tasks/update needs `inputResponses`: an object of answers by inputRequests key",
                ),
            },
            _ => {
                self.server.tasks.cancel(&task);
                result(id, json!({}))
            }
        }
    }
}

/// The input schemas in a `tools/list` result that carry `x-mcp-header`, by tool name.
pub(super) fn mirrored_schemas(list: &Json) -> std::collections::HashMap<String, Json> {
    let tools = list.get("tools").and_then(Json::as_array);
    tools
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let schema = t.get("inputSchema")?;
            let name = t.get("name")?.as_str()?;
            schema
                .to_string()
                .contains("\"x-mcp-header\"")
                .then(|| (name.to_string(), schema.clone()))
        })
        .collect()
}

/// An error response carrying `id` (a helper built it without one).
#[cfg(feature = "fixtures")]
pub(super) fn with_id(mut e: Json, id: Json) -> Json {
    e["id"] = id;
    e
}

/// A modern reply: its result shaped by [`modern::finish`] with the caching hints of `method`
/// (a model's state and the model list are private and short; the rest public and long); a
/// missing resource is `-32602` (the legacy era's `-32002`).
pub(super) fn modern_response(mut reply: Json, method: &str, params: &Json) -> Json {
    if let Some(r) = reply.get_mut("result") {
        let cache = match method {
            "tools/list" | "prompts/list" | "resources/templates/list" => Some(modern::LONG),
            "resources/list" => Some(modern::SHORT),
            "resources/read" => Some(match params.get("uri").and_then(Json::as_str) {
                Some(u) if u.starts_with(resources::STATE_PREFIX) => modern::SHORT,
                _ => modern::LONG,
            }),
            _ => None,
        };
        *r = modern::finish(std::mem::take(r), cache);
    } else if let Some(e) = reply.get_mut("error") {
        if e.get("code").and_then(Json::as_i64) == Some(code::RESOURCE_NOT_FOUND) {
            e["code"] = json!(code::INVALID_PARAMS);
        }
    }
    reply
}
