//! The MCP conformance suite's fixture tools, resources and prompts
//! (`valem serve --conformance-fixtures`, tests only). They exercise protocol features our own
//! tools do not use — image/audio/embedded-resource content, progress and log notifications on
//! the request's stream, sampling and elicitation requests to the client, prompts and
//! completion — so the whole suite runs against the same transport and core as real clients.

use std::time::Duration;

use serde_json::{json, Value as Json};

use super::modern::Meta;
use super::{Modern, Outbox, Session};

/// A 1×1 PNG.
const IMAGE: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==";
/// A 44-byte WAV.
const AUDIO: &str = "UklGRiYAAABXQVZFZm10IBAAAAABAAEAQB8AAAB9AAACABAAZGF0YQIAAAA=";

const ASK_TIMEOUT: Duration = Duration::from_secs(30);

fn tool(name: &str, description: &str, input: Json) -> Json {
    json!({"name": name, "description": description, "inputSchema": input})
}

fn no_args() -> Json {
    json!({"type": "object", "properties": {}})
}

fn one_string(name: &str, description: &str) -> Json {
    json!({"type": "object", "properties": {name: {"type": "string", "description": description}}, "required": [name]})
}

/// Add the fixture tools to `tools/list` (those of MCP 2026-07-28 in a `modern` request).
pub fn add_tools(list: &mut Json, modern: bool) {
    let fixtures = [
        tool(
            "test_simple_text",
            "Fixture: returns a simple text block.",
            no_args(),
        ),
        tool(
            "test_image_content",
            "Fixture: returns an image block.",
            no_args(),
        ),
        tool(
            "test_audio_content",
            "Fixture: returns an audio block.",
            no_args(),
        ),
        tool(
            "test_embedded_resource",
            "Fixture: returns an embedded resource.",
            no_args(),
        ),
        tool(
            "test_multiple_content_types",
            "Fixture: returns text, image and resource blocks.",
            no_args(),
        ),
        tool(
            "test_tool_with_logging",
            "Fixture: sends three log messages while it runs.",
            no_args(),
        ),
        tool(
            "test_error_handling",
            "Fixture: always fails with an isError result.",
            no_args(),
        ),
        tool(
            "test_tool_with_progress",
            "Fixture: reports progress 0, 50, 100.",
            no_args(),
        ),
        tool(
            "test_sampling",
            "Fixture: asks the client's LLM (sampling/createMessage).",
            one_string("prompt", "The prompt to send to the LLM"),
        ),
        tool(
            "test_elicitation",
            "Fixture: asks the user for input (elicitation/create).",
            one_string("message", "The message to show the user"),
        ),
        tool(
            "test_elicitation_sep1034_defaults",
            "Fixture: elicitation with default values.",
            no_args(),
        ),
        tool(
            "test_elicitation_sep1330_enums",
            "Fixture: elicitation with enum schemas.",
            no_args(),
        ),
        json!({"name": "json_schema_2020_12_tool", "description": "Tool with JSON Schema 2020-12 features",
            "inputSchema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                "$defs": {"address": {"$anchor": "addressDef", "type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}}}},
                "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"},
                    "contactMethod": {"type": "string", "enum": ["phone", "email"]},
                    "phone": {"type": "string"}, "email": {"type": "string"}},
                "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
                "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
                "then": {"required": ["phone"]}, "else": {"required": ["email"]},
                "additionalProperties": false}}),
    ];
    if let Some(t) = list.get_mut("tools").and_then(|t| t.as_array_mut()) {
        t.extend(fixtures);
        if modern {
            t.extend(super::fixtures2026::tools());
        }
    }
}

fn text(t: &str) -> Json {
    json!({"content": [{"type": "text", "text": t}]})
}

fn log(session: &Session, io: Option<&Outbox>, meta: Option<&Meta>, message: &str) {
    // A modern request logs only at the level it named; a legacy session at its floor.
    let on = meta.map_or_else(|| session.log_enabled("info"), |m| m.logs("info"));
    if on {
        session.notify(
            io,
            &json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "logger": "fixtures", "data": message}}),
        );
    }
}

fn elicit(session: &Session, io: Option<&Outbox>, message: &str, schema: Json) -> Json {
    if !session.client_can("elicitation") {
        return json!({"content": [{"type": "text", "text": "the client does not support elicitation"}], "isError": true});
    }
    let params = json!({"mode": "form", "message": message, "requestedSchema": schema});
    match session.ask(io, "elicitation/create", params, ASK_TIMEOUT) {
        Ok(r) => text(&format!(
            "User response: action={}, content={}",
            r.get("action").and_then(|a| a.as_str()).unwrap_or("?"),
            r.get("content").cloned().unwrap_or(Json::Null)
        )),
        Err(e) => json!({"content": [{"type": "text", "text": e}], "isError": true}),
    }
}

/// Run a fixture tool; `None` when `name` is not one. `Err` is an error response whose id the
/// caller fills in.
pub fn call_tool(
    session: &Session,
    name: &str,
    params: &Json,
    io: Option<&Outbox>,
    cx: Option<&Modern>,
) -> Option<Result<Json, Json>> {
    if let Some(cx) = cx {
        if let Some(r) = super::fixtures2026::call_tool(session, name, params, cx) {
            return Some(r);
        }
    }
    legacy_tool(session, name, params, io, cx.map(|c| &c.meta)).map(Ok)
}

fn legacy_tool(
    session: &Session,
    name: &str,
    params: &Json,
    io: Option<&Outbox>,
    meta: Option<&Meta>,
) -> Option<Json> {
    let args = params
        .get("arguments")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let arg = |k: &str| {
        args.get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let pause = || std::thread::sleep(Duration::from_millis(50));
    Some(match name {
        "test_simple_text" => text("This is a simple text response for testing."),
        "test_image_content" => {
            json!({"content": [{"type": "image", "data": IMAGE, "mimeType": "image/png"}]})
        }
        "test_audio_content" => {
            json!({"content": [{"type": "audio", "data": AUDIO, "mimeType": "audio/wav"}]})
        }
        "test_embedded_resource" => json!({"content": [{"type": "resource", "resource": {
            "uri": "test://embedded-resource", "mimeType": "text/plain", "text": "This is an embedded resource content."}}]}),
        "test_multiple_content_types" => json!({"content": [
            {"type": "text", "text": "Multiple content types test:"},
            {"type": "image", "data": IMAGE, "mimeType": "image/png"},
            {"type": "resource", "resource": {"uri": "test://mixed-content-resource", "mimeType": "application/json", "text": "{\"test\":\"data\",\"value\":123}"}},
        ]}),
        "test_tool_with_logging" => {
            log(session, io, meta, "Tool execution started");
            pause();
            log(session, io, meta, "Tool processing data");
            pause();
            log(session, io, meta, "Tool execution completed");
            text("Tool with logging executed successfully")
        }
        "test_error_handling" => {
            json!({"isError": true, "content": [{"type": "text", "text": "This tool intentionally returns an error for testing"}]})
        }
        "test_tool_with_progress" => {
            let token = params.pointer("/_meta/progressToken").cloned();
            for (i, p) in [0, 50, 100].into_iter().enumerate() {
                if i > 0 {
                    pause();
                }
                if let Some(t) = &token {
                    session.notify(
                        io,
                        &json!({"jsonrpc": "2.0", "method": "notifications/progress",
                        "params": {"progressToken": t, "progress": p, "total": 100}}),
                    );
                }
            }
            text(&format!(
                "Progress completed (token {})",
                token.unwrap_or(Json::Null)
            ))
        }
        "test_sampling" => {
            if !session.client_can("sampling") {
                return Some(
                    json!({"content": [{"type": "text", "text": "the client does not support sampling"}], "isError": true}),
                );
            }
            let req = json!({"messages": [{"role": "user", "content": {"type": "text", "text": arg("prompt")}}], "maxTokens": 100});
            match session.ask(io, "sampling/createMessage", req, ASK_TIMEOUT) {
                Ok(r) => text(&format!(
                    "LLM response: {}",
                    r.pointer("/content/text")
                        .and_then(|t| t.as_str())
                        .unwrap_or("")
                )),
                Err(e) => json!({"content": [{"type": "text", "text": e}], "isError": true}),
            }
        }
        "test_elicitation" => elicit(
            session,
            io,
            &arg("message"),
            json!({"type": "object", "properties": {
            "username": {"type": "string", "description": "User's response"},
            "email": {"type": "string", "description": "User's email address"}},
            "required": ["username", "email"]}),
        ),
        "test_elicitation_sep1034_defaults" => elicit(
            session,
            io,
            "Please review and update the form fields with defaults",
            json!({"type": "object", "properties": {
            "name": {"type": "string", "description": "User name", "default": "John Doe"},
            "age": {"type": "integer", "description": "User age", "default": 30},
            "score": {"type": "number", "description": "User score", "default": 95.5},
            "status": {"type": "string", "description": "User status", "enum": ["active", "inactive", "pending"], "default": "active"},
            "verified": {"type": "boolean", "description": "Verification status", "default": true}},
            "required": []}),
        ),
        "test_elicitation_sep1330_enums" => elicit(
            session,
            io,
            "Please choose options",
            json!({"type": "object", "properties": {
            "untitledSingle": {"type": "string", "description": "Select one option", "enum": ["option1", "option2", "option3"]},
            "titledSingle": {"type": "string", "description": "Select one option with titles", "oneOf": [
                {"const": "value1", "title": "First Option"}, {"const": "value2", "title": "Second Option"}, {"const": "value3", "title": "Third Option"}]},
            "legacyEnum": {"type": "string", "description": "Select one option (legacy)", "enum": ["opt1", "opt2", "opt3"], "enumNames": ["Option One", "Option Two", "Option Three"]},
            "untitledMulti": {"type": "array", "description": "Select multiple options", "minItems": 1, "maxItems": 3, "items": {"type": "string", "enum": ["option1", "option2", "option3"]}},
            "titledMulti": {"type": "array", "description": "Select multiple options with titles", "minItems": 1, "maxItems": 3, "items": {"anyOf": [
                {"const": "value1", "title": "First Choice"}, {"const": "value2", "title": "Second Choice"}, {"const": "value3", "title": "Third Choice"}]}}},
            "required": []}),
        ),
        "json_schema_2020_12_tool" => text(&format!("received {}", args)),
        _ => return None,
    })
}

pub fn add_resources(list: &mut Json) {
    if let Some(r) = list.get_mut("resources").and_then(|r| r.as_array_mut()) {
        r.extend([
            json!({"uri": "test://static-text", "name": "static-text", "description": "A static text resource", "mimeType": "text/plain"}),
            json!({"uri": "test://static-binary", "name": "static-binary", "description": "A static binary resource", "mimeType": "image/png"}),
            json!({"uri": "test://watched-resource", "name": "watched-resource", "description": "A resource to subscribe to", "mimeType": "text/plain"}),
        ]);
    }
}

pub fn add_templates(list: &mut Json) {
    if let Some(r) = list
        .get_mut("resourceTemplates")
        .and_then(|r| r.as_array_mut())
    {
        r.push(json!({"uriTemplate": "test://template/{id}/data", "name": "template", "description": "A templated resource", "mimeType": "application/json"}));
    }
}

pub fn read_resource(uri: &str) -> Option<Json> {
    let item = match uri {
        "test://static-text" => {
            json!({"uri": uri, "mimeType": "text/plain", "text": "This is the content of the static text resource."})
        }
        "test://static-binary" => json!({"uri": uri, "mimeType": "image/png", "blob": IMAGE}),
        "test://watched-resource" => {
            json!({"uri": uri, "mimeType": "text/plain", "text": "Watched resource content."})
        }
        _ => {
            let id = uri
                .strip_prefix("test://template/")?
                .strip_suffix("/data")?;
            let body =
                json!({"id": id, "templateTest": true, "data": format!("Data for ID: {id}")});
            json!({"uri": uri, "mimeType": "application/json", "text": body.to_string()})
        }
    };
    Some(json!({"contents": [item]}))
}

/// `prompts/list`, `prompts/get`, `completion/complete`.
pub fn prompts(
    _session: &Session,
    method: &str,
    params: &Json,
    cx: Option<&Modern>,
) -> Result<Json, String> {
    let meta = cx.map(|c| &c.meta);
    if method == "prompts/get" {
        if let Some(r) = super::fixtures2026::prompt(params, meta) {
            return r;
        }
    }
    match method {
        "prompts/list" => {
            let mut list = legacy_prompts();
            if meta.is_some() {
                if let Some(p) = list.get_mut("prompts").and_then(Json::as_array_mut) {
                    p.push(json!({"name": "test_input_required_result_prompt",
                        "description": "Fixture (MRTR): asks for context before rendering."}));
                }
            }
            Ok(list)
        }
        _ => prompt_or_completion(method, params),
    }
}

fn legacy_prompts() -> Json {
    json!({"prompts": [
            {"name": "test_simple_prompt", "description": "Fixture: a prompt without arguments."},
            {"name": "test_prompt_with_arguments", "description": "Fixture: a prompt with two arguments.", "arguments": [
                {"name": "arg1", "description": "First test argument", "required": true},
                {"name": "arg2", "description": "Second test argument", "required": true}]},
            {"name": "test_prompt_with_embedded_resource", "description": "Fixture: a prompt embedding a resource.", "arguments": [
                {"name": "resourceUri", "description": "URI of the resource to embed", "required": true}]},
            {"name": "test_prompt_with_image", "description": "Fixture: a prompt with an image."},
    ]})
}

fn prompt_or_completion(method: &str, params: &Json) -> Result<Json, String> {
    match method {
        "prompts/get" => {
            let name = params.get("name").and_then(|n| n.as_str()).unwrap_or("");
            let arg = |k: &str| {
                params
                    .pointer(&format!("/arguments/{k}"))
                    .and_then(|v| v.as_str())
                    .unwrap_or("")
                    .to_string()
            };
            let user = |content: Json| json!({"role": "user", "content": content});
            let messages = match name {
                "test_simple_prompt" => vec![user(
                    json!({"type": "text", "text": "This is a simple prompt for testing."}),
                )],
                "test_prompt_with_arguments" => vec![user(
                    json!({"type": "text", "text": format!("Prompt with arguments: arg1='{}', arg2='{}'", arg("arg1"), arg("arg2"))}),
                )],
                "test_prompt_with_embedded_resource" => vec![
                    user(
                        json!({"type": "resource", "resource": {"uri": arg("resourceUri"), "mimeType": "text/plain", "text": "Embedded resource content for testing."}}),
                    ),
                    user(
                        json!({"type": "text", "text": "Please process the embedded resource above."}),
                    ),
                ],
                "test_prompt_with_image" => vec![
                    user(json!({"type": "image", "data": IMAGE, "mimeType": "image/png"})),
                    user(json!({"type": "text", "text": "Please analyze the image above."})),
                ],
                other => return Err(format!("unknown prompt `{other}`")),
            };
            Ok(json!({"messages": messages}))
        }
        _ => Ok(json!({"completion": {"values": [], "total": 0, "hasMore": false}})),
    }
}
