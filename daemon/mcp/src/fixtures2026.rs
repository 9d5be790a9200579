//! The conformance suite's fixtures of MCP 2026-07-28 (tests only, with
//! `--conformance-fixtures`): multi round-trip tools and prompt (`test_input_required_result_*`),
//! the tasks extension's tools (`greet`, `slow_compute`, `failing_job`, …), and the stateless
//! diagnostics (`test_missing_capability`, `test_streaming_elicitation`, `test_logging_tool`,
//! `test_custom_header`). Every decision is made from the request alone: a multi round-trip
//! fixture keeps what it learnt in a sealed `requestState`.

use std::time::Duration;

use serde_json::{json, Map, Value as Json};

use super::modern::{codes, key, Meta};
use super::mrtr::{self, accepted, input_required};
use super::tasks::{self, Running};
use super::{code, Modern, Session};

fn tool(name: &str, description: &str, input: Json) -> Json {
    json!({"name": name, "description": description, "inputSchema": input})
}

fn empty() -> Json {
    json!({"type": "object", "properties": {}})
}

/// The fixtures' tool definitions (appended to `tools/list`).
pub(crate) fn tools() -> Vec<Json> {
    let string =
        |n: &str| json!({"type": "object", "properties": {n: {"type": "string"}}, "required": [n]});
    vec![
        tool(
            "test_input_required_result_elicitation",
            "Fixture (MRTR): asks the user's name.",
            empty(),
        ),
        tool(
            "test_input_required_result_sampling",
            "Fixture (MRTR): asks the client's LLM.",
            empty(),
        ),
        tool(
            "test_input_required_result_list_roots",
            "Fixture (MRTR): asks the client's roots.",
            empty(),
        ),
        tool(
            "test_input_required_result_request_state",
            "Fixture (MRTR): a confirmation carried in requestState.",
            empty(),
        ),
        tool(
            "test_input_required_result_multiple_inputs",
            "Fixture (MRTR): three input requests at once.",
            empty(),
        ),
        tool(
            "test_input_required_result_multi_round",
            "Fixture (MRTR): two rounds of input.",
            empty(),
        ),
        tool(
            "test_input_required_result_tampered_state",
            "Fixture (MRTR): refuses an altered requestState.",
            empty(),
        ),
        tool(
            "test_input_required_result_capabilities",
            "Fixture (MRTR): asks only what the client declared.",
            empty(),
        ),
        tool(
            "test_missing_capability",
            "Fixture: needs the client's sampling capability.",
            empty(),
        ),
        tool(
            "test_streaming_elicitation",
            "Fixture: elicitation without a server-to-client request.",
            empty(),
        ),
        tool(
            "test_logging_tool",
            "Fixture: logs only at the request's log level.",
            empty(),
        ),
        tool(
            "test_custom_header",
            "Fixture: a parameter mirrored into the Mcp-Param-Region header.",
            json!({"type": "object", "properties": {"region": {"type": "string", "x-mcp-header": "Region"}}, "required": ["region"]}),
        ),
        tool(
            "greet",
            "Fixture (tasks): greets at once, never a task.",
            string("name"),
        ),
        tool(
            "slow_compute",
            "Fixture (tasks): sleeps `seconds`; a task when the client takes tasks.",
            json!({"type": "object", "properties": {"seconds": {"type": "number"}, "label": {"type": "string"}}}),
        ),
        tool(
            "failing_job",
            "Fixture (tasks): a task that ends with a tool error; needs tasks.",
            empty(),
        ),
        tool(
            "protocol_error_job",
            "Fixture (tasks): a task that fails; needs tasks.",
            empty(),
        ),
        tool(
            "confirm_delete",
            "Fixture (tasks): a task that asks for confirmation.",
            json!({"type": "object", "properties": {"filename": {"type": "string"}}}),
        ),
        tool(
            "multi_input",
            "Fixture (tasks): a task that asks two things at once.",
            empty(),
        ),
        tool(
            "test_tool_with_task",
            "Fixture: a multi round-trip request, then a task.",
            empty(),
        ),
    ]
}

fn text(t: &str) -> Json {
    json!({"resultType": "complete", "content": [{"type": "text", "text": t}]})
}

fn invalid(m: impl Into<String>) -> Json {
    json!({"jsonrpc": "2.0", "id": null, "error": {"code": code::INVALID_PARAMS, "message": m.into()}})
}

fn missing_capability(what: &str) -> Json {
    json!({"jsonrpc": "2.0", "id": null, "error": {
        "code": codes::MISSING_REQUIRED_CLIENT_CAPABILITY,
        "message": format!("Missing required client capability: {what}"),
        "data": {"requiredCapabilities": {what: {}}},
    }})
}

fn elicit(message: &str, field: &str, ty: &str) -> Json {
    json!({"method": "elicitation/create", "params": {"mode": "form", "message": message,
        "requestedSchema": {"type": "object", "properties": {field: {"type": ty}}, "required": [field]}}})
}

fn sample(prompt: &str, max: u64) -> Json {
    json!({"method": "sampling/createMessage", "params": {
        "messages": [{"role": "user", "content": {"type": "text", "text": prompt}}], "maxTokens": max}})
}

fn roots() -> Json {
    json!({"method": "roots/list", "params": {}})
}

fn asks(pairs: &[(&str, Json)]) -> Json {
    Json::Object(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    )
}

/// What a retry carries: its answers and its state, opened (or the error to answer).
struct Retry<'a> {
    responses: Option<&'a Map<String, Json>>,
    state: Option<Json>,
}

fn now_ms() -> u64 {
    u64::try_from(valem_service::time::now().ms()).unwrap_or(0)
}

fn retry<'a>(
    session: &Session,
    name: &str,
    params: &'a Json,
    cx: &Modern,
) -> Result<Retry<'a>, Json> {
    let responses = mrtr::responses(params).map_err(invalid)?;
    let state = match params.get("requestState") {
        None => None,
        Some(Json::String(s)) => {
            let key = session
                .server
                .state_key
                .as_ref()
                .ok_or_else(|| invalid("no sealing key"))?;
            Some(
                key.open(&purpose(name, cx), s, now_ms())
                    .map_err(|e| invalid(e.to_string()))?,
            )
        }
        Some(_) => return Err(invalid("`requestState` must be the string the server gave")),
    };
    Ok(Retry { responses, state })
}

fn purpose(name: &str, cx: &Modern) -> String {
    format!("tools/call:{name}:{}", cx.principal)
}

fn seal(session: &Session, name: &str, cx: &Modern, data: Json) -> Option<String> {
    session
        .server
        .state_key
        .as_ref()
        .map(|k| k.seal(&purpose(name, cx), &data, now_ms(), mrtr::STATE_TTL))
}

fn content<'a>(r: &Retry<'a>, k: &str) -> Result<Option<&'a Json>, Json> {
    accepted(r.responses, k).map_err(invalid)
}

/// Run a 2026 fixture tool; `None` when `name` is not one. `Err` is an error response whose
/// id the caller fills in.
pub(crate) fn call_tool(
    session: &Session,
    name: &str,
    params: &Json,
    cx: &Modern,
) -> Option<Result<Json, Json>> {
    let meta = &cx.meta;
    let run = || -> Result<Json, Json> {
        let r = retry(session, name, params, cx)?;
        Ok(match name {
            "test_input_required_result_elicitation" => match content(&r, "user_name")? {
                Some(c) => text(&format!(
                    "Hello, {}!",
                    c.get("name").and_then(Json::as_str).unwrap_or("?")
                )),
                None => input_required(
                    asks(&[("user_name", elicit("What is your name?", "name", "string"))]),
                    None,
                ),
            },
            "test_input_required_result_sampling" => {
                match r.responses.and_then(|m| m.get("capital_question")) {
                    Some(a) => text(&format!(
                        "Sampling result: {}",
                        a.pointer("/content/text")
                            .and_then(Json::as_str)
                            .unwrap_or("")
                    )),
                    None => input_required(
                        asks(&[(
                            "capital_question",
                            sample("What is the capital of France?", 100),
                        )]),
                        None,
                    ),
                }
            }
            "test_input_required_result_list_roots" => match r
                .responses
                .and_then(|m| m.get("client_roots"))
                .and_then(|a| a.get("roots"))
                .and_then(Json::as_array)
            {
                Some(roots) => text(&format!("Found {} root(s)", roots.len())),
                None => input_required(asks(&[("client_roots", roots())]), None),
            },
            "test_input_required_result_request_state"
            | "test_input_required_result_tampered_state" => {
                match (&r.state, content(&r, "confirm")?) {
                    (Some(_), Some(c)) => text(&format!(
                        "state-ok: confirmed={}",
                        c.get("ok").cloned().unwrap_or(Json::Null)
                    )),
                    _ => input_required(
                        asks(&[("confirm", elicit("Please confirm", "ok", "boolean"))]),
                        seal(session, name, cx, json!({"step": "confirm"})),
                    ),
                }
            }
            "test_input_required_result_multiple_inputs" => {
                let name_ = content(&r, "user_name")?;
                let greeting = r
                    .responses
                    .and_then(|m| m.get("greeting"))
                    .and_then(|g| g.pointer("/content/text"))
                    .and_then(Json::as_str);
                let rts = r
                    .responses
                    .and_then(|m| m.get("client_roots"))
                    .and_then(|a| a.get("roots"))
                    .and_then(Json::as_array);
                match (r.state.is_some(), name_, greeting, rts) {
                    (true, Some(n), Some(g), Some(rs)) => text(&format!(
                        "Name: {}; Greeting: {g}; Roots: {}",
                        n.get("name").and_then(Json::as_str).unwrap_or("?"),
                        rs.len()
                    )),
                    _ => input_required(
                        asks(&[
                            ("user_name", elicit("What is your name?", "name", "string")),
                            ("greeting", sample("Generate a greeting", 50)),
                            ("client_roots", roots()),
                        ]),
                        seal(session, name, cx, json!({"step": "all"})),
                    ),
                }
            }
            "test_input_required_result_multi_round" => {
                let round = r
                    .state
                    .as_ref()
                    .and_then(|s| s.get("round"))
                    .and_then(Json::as_u64);
                match (round, content(&r, "step1")?, content(&r, "step2")?) {
                    (Some(1), Some(c), _) => {
                        let who = c
                            .get("name")
                            .and_then(Json::as_str)
                            .unwrap_or("?")
                            .to_string();
                        input_required(
                            asks(&[(
                                "step2",
                                elicit("Step 2: What is your favorite color?", "color", "string"),
                            )]),
                            seal(session, name, cx, json!({"round": 2, "name": who})),
                        )
                    }
                    (Some(2), _, Some(c)) => text(&format!(
                        "Multi-round complete for {} who likes {}",
                        r.state
                            .as_ref()
                            .and_then(|s| s.get("name"))
                            .and_then(Json::as_str)
                            .unwrap_or("?"),
                        c.get("color").and_then(Json::as_str).unwrap_or("?")
                    )),
                    _ => input_required(
                        asks(&[(
                            "step1",
                            elicit("Step 1: What is your name?", "name", "string"),
                        )]),
                        seal(session, name, cx, json!({"round": 1})),
                    ),
                }
            }
            "test_input_required_result_capabilities" => {
                if r.responses.is_some_and(|m| !m.is_empty()) {
                    return Ok(text("capabilities-ok: answered"));
                }
                let mut a = Vec::new();
                if meta.can("elicitation").is_some() {
                    a.push(("elicit_input", elicit("Provide a value", "value", "string")));
                }
                if meta.can("sampling").is_some() {
                    a.push(("sample_input", sample("Sample request", 50)));
                }
                if meta.can("roots").is_some() {
                    a.push(("roots_input", roots()));
                }
                if a.is_empty() {
                    text("capabilities-ok: the client declared nothing to ask through")
                } else {
                    input_required(asks(&a), None)
                }
            }
            "test_missing_capability" => {
                if meta.can("sampling").is_none() {
                    return Err(missing_capability("sampling"));
                }
                text("sampling declared")
            }
            "test_streaming_elicitation" => match content(&r, "answer")? {
                Some(c) => text(&format!("answer: {c}")),
                None if meta.can("elicitation").is_some() => input_required(
                    asks(&[("answer", elicit("Anything to add?", "answer", "string"))]),
                    None,
                ),
                None => text("no elicitation declared"),
            },
            "test_logging_tool" => text(&format!(
                "logged: {}",
                if meta.logs("info") {
                    "yes"
                } else {
                    "no (no log level in _meta)"
                }
            )),
            "test_custom_header" => text(&format!(
                "region: {}",
                params
                    .pointer("/arguments/region")
                    .and_then(Json::as_str)
                    .unwrap_or("")
            )),
            "greet" => text(&format!(
                "Hello, {}!",
                params
                    .pointer("/arguments/name")
                    .and_then(Json::as_str)
                    .unwrap_or("")
            )),
            _ => return task_fixture(session, name, params, cx, &r),
        })
    };
    let known = tools().iter().any(|t| t["name"] == name);
    known.then(run)
}

/// The tasks extension's fixtures.
fn task_fixture(
    session: &Session,
    name: &str,
    params: &Json,
    cx: &Modern,
    r: &Retry,
) -> Result<Json, Json> {
    let ext = cx.meta.has_extension(key::TASKS);
    let seconds = params
        .pointer("/arguments/seconds")
        .and_then(Json::as_f64)
        .unwrap_or(0.0)
        .clamp(0.0, 120.0);
    if name == "test_tool_with_task" {
        let Some(c) = content(r, "user_name")? else {
            return Ok(input_required(
                asks(&[("user_name", elicit("What is your name?", "name", "string"))]),
                None,
            ));
        };
        if !ext {
            return Err(missing_tasks());
        }
        let who = c
            .get("name")
            .and_then(Json::as_str)
            .unwrap_or("?")
            .to_string();
        return spawn(session, cx, move |_| {
            std::thread::sleep(Duration::from_millis(300));
            Ok(text(&format!("Hello, {who}!")))
        });
    }
    if !ext {
        return match name {
            "slow_compute" => {
                std::thread::sleep(Duration::from_secs_f64(seconds.min(5.0)));
                Ok(text("computed"))
            }
            _ => Err(missing_tasks()),
        };
    }
    let filename = params
        .pointer("/arguments/filename")
        .and_then(Json::as_str)
        .unwrap_or("file")
        .to_string();
    match name {
        "slow_compute" => spawn(session, cx, move |run| {
            let end = std::time::Instant::now() + Duration::from_secs_f64(seconds);
            while std::time::Instant::now() < end {
                if run.cancelled() {
                    return Err(tasks::task_error(code::INTERNAL_ERROR, "cancelled"));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(text(&format!("computed after {seconds} s")))
        }),
        "failing_job" => spawn(session, cx, |_| {
            std::thread::sleep(Duration::from_millis(500));
            Ok(
                json!({"resultType": "complete", "content": [{"type": "text", "text": "the job failed"}], "isError": true}),
            )
        }),
        "protocol_error_job" => spawn(session, cx, |run| {
            run.say("about to fail");
            std::thread::sleep(Duration::from_millis(200));
            Err(tasks::task_error(
                code::INTERNAL_ERROR,
                "the job hit an internal error",
            ))
        }),
        "confirm_delete" => spawn(session, cx, move |run| {
            let key = format!("confirm-{}", &run.id()[..8]);
            let mut ask = Map::new();
            ask.insert(
                key,
                elicit(&format!("Delete {filename}?"), "confirm", "boolean"),
            );
            match run.ask(ask) {
                Some(_) => Ok(text(&format!("deleted {filename}"))),
                None => Err(tasks::task_error(code::INTERNAL_ERROR, "cancelled")),
            }
        }),
        "multi_input" => spawn(session, cx, |run| {
            let mut ask = Map::new();
            ask.insert("first".into(), elicit("First name?", "name", "string"));
            ask.insert("second".into(), elicit("Second name?", "name", "string"));
            match run.ask(ask) {
                Some(a) => Ok(text(&format!("got {} answers", a.len()))),
                None => Err(tasks::task_error(code::INTERNAL_ERROR, "cancelled")),
            }
        }),
        _ => Err(invalid(format!("unknown fixture `{name}`"))),
    }
}

fn missing_tasks() -> Json {
    let mut e = tasks::missing_extension(Json::Null);
    e["id"] = Json::Null;
    e
}

fn spawn(
    session: &Session,
    cx: &Modern,
    work: impl FnOnce(&Running) -> Result<Json, Json> + Send + 'static,
) -> Result<Json, Json> {
    session
        .server
        .tasks
        .spawn(cx.principal, work)
        .map(|t| t.created_result())
        .map_err(|e| json!({"jsonrpc": "2.0", "id": null, "error": {"code": code::INTERNAL_ERROR, "message": e.to_string()}}))
}

/// `prompts/get test_input_required_result_prompt` (modern only); `None` for other prompts.
pub(crate) fn prompt(params: &Json, meta: Option<&Meta>) -> Option<Result<Json, String>> {
    if params.get("name").and_then(Json::as_str) != Some("test_input_required_result_prompt") {
        return None;
    }
    meta?;
    let responses = match mrtr::responses(params) {
        Ok(r) => r,
        Err(e) => return Some(Err(e)),
    };
    Some(match accepted(responses, "user_context") {
        Err(e) => Err(e),
        Ok(Some(c)) => Ok(
            json!({"messages": [{"role": "user", "content": {"type": "text",
            "text": format!("Prompt with context: {}", c.get("context").and_then(Json::as_str).unwrap_or(""))}}]}),
        ),
        Ok(None) => Ok(input_required(
            asks(&[(
                "user_context",
                elicit("What context should the prompt use?", "context", "string"),
            )]),
            None,
        )),
    })
}
