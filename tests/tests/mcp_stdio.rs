//! `valem mcp` over raw newline-delimited JSON-RPC, as a client's transport sees it: the
//! contract's worked example byte for byte, the handshake, version negotiation, and every kind of
//! bad input answered with the right error while the server keeps serving.

use serde_json::{json, Value};
use valem_tests::Mcp;

fn text_json(result: &Value) -> Value {
    let text = result["content"][0]["text"].as_str().expect("text block");
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

#[test]
fn worked_example_reproduces() {
    let mut m = Mcp::start(&[], &[]);
    m.send_raw(br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{}}}
"#);
    let r = m.recv_reply();
    assert_eq!(r["id"], 1);
    assert_eq!(r["result"]["protocolVersion"], "2025-06-18");
    assert!(r["result"]["capabilities"]["tools"].is_object());
    assert_eq!(r["result"]["serverInfo"]["name"], "valem");
    assert!(r["result"]["instructions"].as_str().unwrap().len() > 100);
    m.send_raw(br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"create_model","arguments":{"spec":{"id":"demo","version":"1","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}],"constraints":[],"metaDerivations":[],"tests":[]}}}}
"#);
    let r = m.recv_reply();
    assert_eq!(r["result"]["isError"], false, "{r}");
    let info = &r["result"]["structuredContent"];
    assert_eq!(info["id"], "demo");
    assert_eq!(info["version"], "1");
    assert_eq!(info["derivationCount"], 1);
    assert_eq!(text_json(&r["result"]), *info);
    m.send_raw(br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"mutate","arguments":{"id":"demo","mutations":{"$.price":10,"$.qty":3}}}}
"#);
    let r = m.recv_reply();
    let s = &r["result"]["structuredContent"];
    assert_eq!(r["result"]["isError"], false);
    assert_eq!(s["success"], true);
    assert_eq!(s["derivedUpdated"], json!(["$.total"]));
    assert!(s.get("traces").is_none(), "traces only on request");
    assert_eq!(text_json(&r["result"]), *s);
    m.send_raw(br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"get_state","arguments":{"id":"demo"}}}
"#);
    let r = m.recv_reply();
    assert_eq!(r["result"]["isError"], false);
    assert_eq!(
        r["result"]["structuredContent"],
        json!({"price": 10, "qty": 3, "total": 30})
    );
    assert_eq!(
        r["result"]["content"][0]["text"],
        "{\n  \"price\": 10,\n  \"qty\": 3,\n  \"total\": 30\n}"
    );
    let (status, rest) = m.close(10);
    assert!(status.success());
    assert!(rest.is_empty(), "nothing after the last reply: {rest:?}");
}

#[test]
fn version_negotiation_echoes_known_revisions_else_the_newest() {
    for (asked, got) in [
        ("2024-11-05", "2024-11-05"),
        ("2025-03-26", "2025-03-26"),
        ("2025-06-18", "2025-06-18"),
        ("2025-11-25", "2025-11-25"),
        ("2099-01-01", "2025-11-25"),
        ("", "2025-11-25"),
    ] {
        let mut m = Mcp::start(&[], &[]);
        let r = m.handshake(asked);
        assert_eq!(r["protocolVersion"], got, "asked {asked}");
        assert_eq!(r["capabilities"]["resources"]["subscribe"], true);
        assert!(r["capabilities"]["logging"].is_object());
        assert!(r["capabilities"].get("prompts").is_none());
    }
}

#[test]
fn readiness_log_follows_initialized_and_respects_the_level() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let log = m.recv(10);
    assert_eq!(log["method"], "notifications/message");
    assert_eq!(log["params"]["level"], "info");
    assert!(log["params"]["data"].as_str().unwrap().contains("ready"));
    // Below-floor messages are suppressed: a second session raises the floor first.
    let mut m = Mcp::start(&[], &[]);
    m.call(
        1,
        "initialize",
        json!({"protocolVersion": "2025-11-25", "capabilities": {}}),
    );
    let r = m.call(2, "logging/setLevel", json!({"level": "warning"}));
    assert_eq!(r["result"], json!({}));
    m.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    let r = m.call(3, "ping", json!({}));
    assert_eq!(r["result"], json!({}));
    assert!(m.quiet_for(200).is_none());
    let r = m.call(4, "logging/setLevel", json!({"level": "loud"}));
    assert_eq!(r["error"]["code"], -32602);
}

#[test]
fn bad_input_gets_the_right_error_and_the_server_keeps_serving() {
    let mut m = Mcp::start(&[], &[]);
    // A leading BOM is tolerated.
    m.send_raw(b"\xEF\xBB\xBF{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n");
    assert_eq!(m.recv_reply()["result"], json!({}));
    // A request before initialize: an error, not an exit.
    let r = m.call(2, "tools/list", json!({}));
    assert_eq!(r["error"]["code"], -32600);
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("initialize"));
    // server/discover without its `_meta` (a malformed 2026-07-28 request): -32602 naming it.
    let r = m.call(3, "server/discover", json!({}));
    assert_eq!(r["error"]["code"], -32602);
    assert!(r["error"]["message"].as_str().unwrap().contains("_meta"));
    m.handshake("2025-11-25");
    let _ready = m.recv(10);
    // Not JSON.
    m.send_raw(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\"\n");
    let r = m.recv_reply();
    assert_eq!(r["error"]["code"], -32700);
    assert_eq!(r["id"], Value::Null);
    m.send_raw(b"hello\n\n   \n");
    assert_eq!(m.recv_reply()["error"]["code"], -32700);
    // Not a request object.
    m.send_raw(b"42\n");
    assert_eq!(m.recv_reply()["error"]["code"], -32600);
    m.send(&json!({"jsonrpc": "1.0", "id": 5, "method": "ping"}));
    assert_eq!(m.recv_reply()["error"]["code"], -32600);
    // Unknown method, unknown tool, missing name, wrong argument types.
    assert_eq!(
        m.call(6, "tools/frobnicate", json!({}))["error"]["code"],
        -32601
    );
    assert_eq!(
        m.call(7, "prompts/list", json!({}))["error"]["code"],
        -32601
    );
    let r = m.call(
        8,
        "tools/call",
        json!({"name": "no_such_tool", "arguments": {}}),
    );
    assert_eq!(r["error"]["code"], -32602);
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no_such_tool"));
    assert_eq!(
        m.call(9, "tools/call", json!({"arguments": {}}))["error"]["code"],
        -32602
    );
    let r = m.tool(10, "mutate", json!({"id": "x", "mutations": "not a map"}));
    assert_eq!(r["isError"], true);
    let msg = r["content"][0]["text"].as_str().unwrap();
    assert!(msg.contains("mutations"), "{msg}");
    let r = m.tool(11, "get_state", json!({"id": 7}));
    assert_eq!(r["isError"], true);
    assert!(r["content"][0]["text"].as_str().unwrap().contains("id"));
    let r = m.tool(12, "get_state", json!({"id": "x", "typo": 1}));
    assert!(r["content"][0]["text"].as_str().unwrap().contains("typo"));
    // An unknown resource.
    let r = m.call(13, "resources/read", json!({"uri": "valem://nope"}));
    assert_eq!(r["error"]["code"], -32002);
    // Still serving.
    assert_eq!(m.call(14, "ping", json!({}))["result"], json!({}));
}

/// The JSON-RPC edges: messages that are neither request, notification nor response get
/// `-32600` (with their id when they have one); responses get nothing; ids come back exactly.
fn json_rpc_edges(m: &mut Mcp) {
    m.send_raw(b"{}\n");
    let r = m.recv_reply();
    assert_eq!(r["error"]["code"], -32600, "{r}");
    assert_eq!(r["id"], Value::Null);
    assert!(
        r.as_object().unwrap().contains_key("id"),
        "id: null is sent"
    );
    m.send_raw(b"{\"jsonrpc\":\"2.0\",\"id\":\"v4\"}\n");
    let r = m.recv_reply();
    assert_eq!(
        (r["id"].clone(), r["error"]["code"].clone()),
        (json!("v4"), json!(-32600)),
        "{r}"
    );
    m.send_raw(b"{\"method\":\"notifications/initialized\"}\n");
    let r = m.recv_reply();
    assert_eq!(
        (r["id"].clone(), r["error"]["code"].clone()),
        (Value::Null, json!(-32600))
    );
    // A response nobody asked for, and a notification: no reply.
    m.send_raw(b"{\"jsonrpc\":\"2.0\",\"id\":99,\"result\":{}}\n");
    m.send_raw(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/roots/list_changed\"}\n");
    // Ids as sent, byte for byte: 2^70, an exponent, a trailing zero; integers and strings.
    for id in [
        "1180591620717411303424",
        "1e2",
        "2.50",
        "-7",
        "\"s\"",
        "18446744073709551615",
    ] {
        m.send_raw(format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"method\":\"ping\"}}\n").as_bytes());
        let line = m.recv_line(10);
        assert_eq!(
            line,
            format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{}}}}")
        );
    }
    // An error reply echoes it too.
    m.send_raw(b"{\"jsonrpc\":\"2.0\",\"id\":1180591620717411303424,\"method\":\"nope\"}\n");
    let line = m.recv_line(10);
    assert!(
        line.starts_with("{\"jsonrpc\":\"2.0\",\"id\":1180591620717411303424,\"error\":"),
        "{line}"
    );
}

#[test]
fn json_rpc_edges_on_stdio() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let _ready = m.recv(10);
    json_rpc_edges(&mut m);
    assert_eq!(m.call(101, "ping", json!({}))["result"], json!({}));
}

#[test]
fn oversized_messages_are_refused_and_skipped() {
    let mut m = Mcp::start(&["--max-message-bytes", "1000"], &[]);
    m.handshake("2025-11-25");
    let _ready = m.recv(10);
    let big = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{{\"name\":\"eval_expression\",\"arguments\":{{\"expr\":\"{}\"}}}}}}\n",
        "1+".repeat(5000) + "1"
    );
    m.send_raw(big.as_bytes());
    let r = m.recv_reply();
    assert_eq!(r["error"]["code"], -32600);
    assert!(r["error"]["message"].as_str().unwrap().contains("limit"));
    assert_eq!(m.call(2, "ping", json!({}))["result"], json!({}));
}

#[test]
fn huge_arguments_within_the_limit_are_served() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let spec = json!({"id": "wide", "schema": {}, "derivations": [{"path": "$.n", "expr": "$count(items)"}]});
    assert_eq!(
        m.tool(1, "create_model", json!({"spec": spec}))["isError"],
        false
    );
    let items: Vec<Value> = (0..20_000).map(|i| json!({"k": i})).collect();
    let r = m.tool(
        2,
        "mutate",
        json!({"id": "wide", "mutations": {"$.items": items}}),
    );
    assert_eq!(r["isError"], false, "{r}");
    let r = m.tool(3, "get_field", json!({"id": "wide", "path": "$.n"}));
    assert_eq!(r["content"][0]["text"], "20000");
    assert!(
        r.get("structuredContent").is_none(),
        "scalars are text only"
    );
    // The whole state is far over the result guard.
    let r = m.tool(4, "get_state", json!({"id": "wide"}));
    assert_eq!(r["isError"], true);
    let note = text_json(&r);
    assert_eq!(note["error"], "Result too large");
    assert_eq!(note["limitChars"], 50_000);
    assert!(note["hint"].as_str().unwrap().contains("paths"));
    let r = m.tool(5, "get_state", json!({"id": "wide", "depth": 0}));
    assert_eq!(
        r["structuredContent"],
        json!({"items": "<array: 20000 items>", "n": 20000})
    );
}

/// A spec for writes whose summaries pass the result guard: a count, a flag constraint and a
/// caller effect, so the note has something to carry.
fn rows_spec() -> Value {
    json!({"id": "rows", "schema": {},
        "derivations": [{"path": "$.n", "expr": "$count(rows)"}],
        "constraints": [{"id": "few", "expr": "$count(rows) < 10", "message": "many rows", "policy": "flag"}],
        "effects": [{"id": "grown", "executor": "caller", "trigger": "$count(rows) > 100",
                     "emit": "rows.grown", "payload": {"n": "$count(rows)"}}]})
}

/// 3,000 rows, each its own address: the summary lists 3,000 paths (~90 KB pretty).
fn rows_mutation(from: usize) -> Value {
    let m: serde_json::Map<String, Value> = (from..from + 3000)
        .map(|i| {
            (
                format!("$.rows[{i}]"),
                json!({"i": i, "label": format!("row {i}")}),
            )
        })
        .collect();
    Value::Object(m)
}

#[test]
fn a_committed_write_over_the_result_guard_says_it_committed() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let r = m.tool(1, "create_model", json!({"spec": rows_spec()}));
    assert_eq!(r["isError"], false, "{r}");
    let r = m.tool(
        2,
        "mutate",
        json!({"id": "rows", "mutations": rows_mutation(0)}),
    );
    // Not an error: the write committed, and an agent must not send it again.
    assert_eq!(r["isError"], false, "{r}");
    let note = &r["structuredContent"];
    assert_eq!(text_json(&r), *note);
    assert_eq!(note["error"], "Result too large");
    assert_eq!(note["committed"], true);
    assert_eq!(note["success"], true);
    assert!(note["resultChars"].as_u64().unwrap() > 50_000, "{note}");
    assert_eq!(
        note["counts"],
        json!({"mutatedPaths": 3000, "derivedUpdated": 1, "metaUpdated": 0,
               "flaggedConstraints": 1, "dispatchedEffects": 1})
    );
    // What the agent must act on comes whole.
    assert_eq!(note["flaggedConstraints"][0]["constraintId"], "few");
    assert_eq!(note["dispatchedEffects"][0]["emit"], "rows.grown");
    let hint = note["hint"].as_str().unwrap();
    assert!(
        hint.contains("The write committed: 3000 paths written") && hint.contains("do not send"),
        "{hint}"
    );
    assert!(
        hint.contains("get_state") && hint.contains("explain"),
        "{hint}"
    );
    assert!(text_of(&r).len() < 50_000);
    // It committed once.
    let r = m.tool(3, "get_field", json!({"id": "rows", "path": "$.n"}));
    assert_eq!(r["content"][0]["text"], "3000");
    // A large write with traces: counted too.
    let r = m.tool(
        4,
        "mutate",
        json!({"id": "rows", "mutations": rows_mutation(3000), "includeTraces": true}),
    );
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(r["structuredContent"]["counts"]["mutatedPaths"], 3000);
    assert!(r["structuredContent"]["counts"]["traces"].as_u64().unwrap() >= 2);
    // A read over the guard is still withheld as an error: nothing was done.
    let r = m.tool(6, "get_state", json!({"id": "rows"}));
    assert_eq!(r["isError"], true);
    assert!(r.get("structuredContent").is_none());
}

#[test]
fn evolve_spec_refuses_an_evolution_that_names_no_change() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let spec = json!({"id": "e", "schema": {}, "derivations": [{"path": "$.t", "expr": "a * 2"}]});
    assert_eq!(
        m.tool(1, "create_model", json!({"spec": spec}))["isError"],
        false
    );
    m.tool(2, "mutate", json!({"id": "e", "mutations": {"$.a": 2}}));
    let history = |m: &mut Mcp, id| text_json(&m.tool(id, "get_history", json!({"id": "e"})));
    let before = history(&mut m, 3);
    assert_eq!(before.as_array().map(Vec::len), Some(2), "{before}");

    let r = m.tool(
        4,
        "evolve_spec",
        json!({"id": "e", "evolution": {"addDerivations": [{"path": "$.u", "expr": "t + 1"}]}}),
    );
    assert_eq!(r["isError"], true, "{r}");
    let text = text_of(&r);
    assert!(
        text.contains("addDerivations")
            && text.contains("names no change")
            && text.contains("did you mean `upsertDerivations`"),
        "{text}"
    );
    assert_eq!(
        history(&mut m, 5),
        before,
        "a refused evolution leaves the history"
    );

    // Nothing to change: answered with a warning, the history kept.
    let r = m.tool(6, "evolve_spec", json!({"id": "e", "evolution": {}}));
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(
        r["structuredContent"]["warnings"][0]["location"],
        "evolution"
    );
    assert_eq!(history(&mut m, 7), before);

    // Unknown keys beside a change: applied, reported.
    let r = m.tool(
        8,
        "evolve_spec",
        json!({"id": "e", "evolution": {"upsertDerivations": [{"path": "$.u", "expr": "t + 1"}],
                                        "newVersoin": "2.0.0"}}),
    );
    assert_eq!(r["isError"], false, "{r}");
    let info = &r["structuredContent"];
    assert_eq!(info["derivationCount"], 2);
    assert_eq!(info["version"], "1.0.0");
    assert_eq!(info["warnings"][0]["location"], "newVersoin", "{info}");
    assert!(info["warnings"][0]["message"]
        .as_str()
        .unwrap()
        .contains("`newVersion`"));
    let r = m.tool(9, "get_field", json!({"id": "e", "path": "$.u"}));
    assert_eq!(r["content"][0]["text"], "5");
}

#[test]
fn get_effective_schema_says_when_an_address_is_not_declared() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let spec = json!({"id": "s", "schema": {"type": "object", "properties": {
        "order": {"type": "object", "properties": {"price": {"type": "number"}, "qty": {"type": "integer"}}}}},
        "metaDerivations": [{"path": "$.order.cap", "property": "maximum", "expr": "10"}]});
    assert_eq!(
        m.tool(1, "create_model", json!({"spec": spec}))["isError"],
        false
    );
    let r = m.tool(
        2,
        "get_effective_schema",
        json!({"id": "s", "path": "$.order.pirce"}),
    );
    assert_eq!(r["isError"], false, "{r}");
    let c = r["structuredContent"]["$comment"]
        .as_str()
        .unwrap_or_default();
    assert!(
        c.contains("$.order.pirce is not declared")
            && c.contains("any value is accepted")
            && c.contains("$.order declares price, qty"),
        "{r}"
    );
    // Declared: the schema itself; targeted by a meta-derivation: its meta, no comment.
    let r = m.tool(
        3,
        "get_effective_schema",
        json!({"id": "s", "path": "$.order.price"}),
    );
    assert_eq!(r["structuredContent"], json!({"type": "number"}));
    let r = m.tool(
        4,
        "get_effective_schema",
        json!({"id": "s", "path": "$.order.cap"}),
    );
    assert_eq!(r["structuredContent"], json!({"maximum": 10}));
}

fn text_of(result: &Value) -> String {
    result["content"][0]["text"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[test]
fn batches_follow_the_negotiated_revision() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-03-26");
    let _ready = m.recv(10);
    m.send(&json!([
        {"jsonrpc": "2.0", "id": 1, "method": "ping"},
        {"jsonrpc": "2.0", "method": "notifications/roots/list_changed"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "list_models", "arguments": {}}},
    ]));
    let r = m.recv(10);
    let arr = r.as_array().expect("a batch answer is an array");
    assert_eq!(arr.len(), 2);
    assert_eq!(arr[0]["id"], 1);
    assert_eq!(arr[1]["id"], 2);
    assert_eq!(arr[1]["result"]["content"][0]["text"], "[]");
    // Batches left MCP in 2025-06-18.
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-06-18");
    let _ready = m.recv(10);
    m.send(&json!([{"jsonrpc": "2.0", "id": 1, "method": "ping"}]));
    let r = m.recv_reply();
    assert_eq!(r["error"]["code"], -32600);
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("2025-06-18"));
}

#[test]
fn a_cancelled_request_gets_no_reply() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let _ready = m.recv(10);
    // Cancel arrives on the read loop, ahead of the queued request it names.
    m.send_raw(
        b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/cancelled\",\"params\":{\"requestId\":7,\"reason\":\"user\"}}\n{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"tools/call\",\"params\":{\"name\":\"list_models\",\"arguments\":{}}}\n{\"jsonrpc\":\"2.0\",\"id\":8,\"method\":\"ping\"}\n",
    );
    let r = m.recv_reply();
    assert_eq!(r["id"], 8, "request 7 was cancelled: {r}");
}

#[test]
fn exits_promptly_at_end_of_input_after_answering_what_is_owed() {
    let mut m = Mcp::start(&[], &[]);
    let mut burst = String::new();
    burst.push_str("{\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"initialize\",\"params\":{\"protocolVersion\":\"2025-11-25\",\"capabilities\":{}}}\n");
    for i in 1..=200 {
        burst.push_str(&format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":{i},\"method\":\"tools/call\",\"params\":{{\"name\":\"eval_expression\",\"arguments\":{{\"expr\":\"{i} * 2\"}}}}}}\n"
        ));
    }
    m.send_raw(burst.as_bytes());
    let (status, rest) = m.close(10);
    assert!(status.success());
    let replies: Vec<Value> = rest
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(replies.len(), 201, "every request answered before exit");
    assert_eq!(replies[200]["result"]["structuredContent"]["result"], 400);
}

#[test]
fn subscribe_then_mutate_notifies_until_unsubscribed() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let _ready = m.recv(10);
    let spec = json!({"id": "s", "schema": {}, "derivations": [{"path": "$.d", "expr": "a * 2"}]});
    m.tool(1, "create_model", json!({"spec": spec}));
    let r = m.call(2, "resources/subscribe", json!({"uri": "valem://state/s"}));
    assert_eq!(r["result"], json!({}));
    m.send(&json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "mutate", "arguments": {"id": "s", "mutations": {"$.a": 2}}}}));
    let mut got_note = false;
    let mut got_reply = false;
    while !(got_note && got_reply) {
        let msg = m.recv(10);
        if msg["method"] == "notifications/resources/updated" {
            assert_eq!(msg["params"]["uri"], "valem://state/s");
            got_note = true;
        } else {
            assert_eq!(msg["id"], 3);
            got_reply = true;
        }
    }
    let r = m.call(4, "resources/read", json!({"uri": "valem://state/s"}));
    let c = &r["result"]["contents"][0];
    assert_eq!(c["mimeType"], "application/json");
    let state: Value = serde_json::from_str(c["text"].as_str().unwrap()).unwrap();
    assert_eq!(state, json!({"a": 2, "d": 4}));
    m.call(
        5,
        "resources/unsubscribe",
        json!({"uri": "valem://state/s"}),
    );
    m.tool(6, "mutate", json!({"id": "s", "mutations": {"$.a": 3}}));
    assert_eq!(m.call(7, "ping", json!({}))["id"], 7);
    assert!(
        m.quiet_for(200).is_none(),
        "no notification after unsubscribe"
    );
    let r = m.call(
        8,
        "resources/subscribe",
        json!({"uri": "valem://guide/jsonata-gotchas"}),
    );
    assert_eq!(r["error"]["code"], -32002);
}

#[test]
fn guidance_topics_extend_from_the_operators_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("topics.json");
    std::fs::write(
        &file,
        json!([
            {"id": "vat_returns", "title": "VAT returns", "description": "Quarterly VAT boxes", "instructions": "Derive box 1 as $round(sales * rate, 2)."},
            {"id": "percentage", "description": "Overridden", "instructions": "Our house rule for percentages."}
        ])
        .to_string(),
    )
    .unwrap();
    let f = file.to_string_lossy().into_owned();
    let mut m = Mcp::start(&[], &[("VALEM_DOMAIN_GUIDANCE_TOPICS_FILE", &f)]);
    m.handshake("2025-11-25");
    let tools = m.call(1, "tools/list", json!({}));
    let g = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "get_domain_guidance")
        .unwrap()
        .clone();
    let ids = g["inputSchema"]["properties"]["topics"]["items"]["enum"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(ids.len(), 15, "14 built-in topics plus one new: {ids:?}");
    assert!(ids.contains(&json!("vat_returns")));
    assert!(ids.contains(&json!("amortization_schedule")));
    let r = m.tool(
        2,
        "get_domain_guidance",
        json!({"topics": ["vat_returns", "percentage", "nope"]}),
    );
    let s = &r["structuredContent"];
    assert!(s["guidance"].as_str().unwrap().contains("box 1"));
    assert!(s["guidance"].as_str().unwrap().contains("house rule"));
    assert_eq!(s["unknownTopics"], json!(["nope"]));
    // A broken topics file stops the server at start with a message naming the file.
    std::fs::write(&file, "[{\"id\": \"Bad Id\"}]").unwrap();
    let o = std::process::Command::new(valem_tests::valem_bin())
        .arg("mcp")
        .env("VALEM_DOMAIN_GUIDANCE_TOPICS_FILE", &f)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("topics.json"), "{err}");
    assert!(o.stdout.is_empty(), "nothing on stdout but protocol");
}

#[test]
fn builtin_guidance_has_the_fourteen_reference_topics() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let all = [
        "amortization_schedule",
        "group_by",
        "date_math",
        "classification",
        "currency_conversion",
        "status_field",
        "rank_percentile",
        "regulated_charge",
        "percentage",
        "unit_conversion",
        "compound_growth",
        "weighted_average",
        "eligibility",
        "proration",
    ];
    let r = m.tool(1, "get_domain_guidance", json!({"topics": all}));
    let topics = r["structuredContent"]["topics"].as_array().unwrap();
    assert_eq!(topics.len(), 14);
    let guidance = r["structuredContent"]["guidance"].as_str().unwrap();
    for t in topics {
        let title = t["title"].as_str().unwrap();
        let section = guidance
            .split(&format!("## {title}\n"))
            .nth(1)
            .unwrap_or_else(|| panic!("no section for {title}"));
        let body = section.split("\n## ").next().unwrap();
        assert!(body.lines().count() >= 5, "{title}: {body}");
    }
    assert_eq!(r["structuredContent"]["unknownTopics"], json!([]));
}

/// An agent's authoring-and-operating session, end to end, through one server.
#[test]
fn an_agents_session_from_draft_to_verified_audit() {
    let mut m = Mcp::start(&[], &[]);
    m.handshake("2025-11-25");
    let mut id = 100;
    let mut tool = |m: &mut Mcp, name: &str, args: Value| {
        id += 1;
        m.tool(id, name, args)
    };
    // Draft with a mistake: a non-canonical address and an unknown function.
    let mut spec = json!({
        "id": "quote",
        "version": "1.0.0",
        "schema": {"type": "object", "properties": {
            "qty": {"type": "integer", "minimum": 0},
            "unitPrice": {"type": "number", "minimum": 0}
        }},
        "derivations": [{"path": "$.items[0].net", "expr": "$nosuch(qty)"}],
        "constraints": [{"id": "max-order", "expr": "qty <= 100", "message": "at most 100 units", "policy": "rollback"}],
        "tests": [{"given": {"$.qty": 2, "$.unitPrice": 5}, "expect": {"$.net": 10}}]
    });
    let r = tool(&mut m, "validate_spec", json!({"spec": spec}));
    let report = &r["structuredContent"];
    assert_eq!(report["valid"], false);
    let errors = report["errors"].as_array().unwrap();
    assert!(errors.iter().any(|e| e["location"]
        .as_str()
        .unwrap()
        .starts_with("derivations[0]")));
    // Fix and re-validate.
    spec["derivations"] = json!([{"path": "$.net", "expr": "qty * unitPrice"}]);
    let r = tool(&mut m, "validate_spec", json!({"spec": spec}));
    assert_eq!(r["structuredContent"]["valid"], true, "{r}");
    let r = tool(&mut m, "test_spec", json!({"spec": spec}));
    assert_eq!(r["structuredContent"]["failed"], 0, "{r}");
    let r = tool(
        &mut m,
        "dry_run",
        json!({"spec": spec, "mutations": {"$.qty": 3, "$.unitPrice": 2.5}}),
    );
    assert_eq!(r["structuredContent"]["net"], 7.5);
    let r = tool(&mut m, "list_models", json!({}));
    assert_eq!(
        r["content"][0]["text"], "[]",
        "authoring tools register nothing"
    );
    // Create and operate.
    let r = tool(&mut m, "create_model", json!({"spec": spec}));
    assert_eq!(r["structuredContent"]["version"], "1.0.0");
    let r = tool(
        &mut m,
        "mutate",
        json!({"id": "quote", "mutations": {"$.qty": 4, "$.unitPrice": 10}}),
    );
    assert_eq!(r["structuredContent"]["derivedUpdated"], json!(["$.net"]));
    let r = tool(
        &mut m,
        "mutate",
        json!({"id": "quote", "mutations": {"$.qty": 500}}),
    );
    assert_eq!(r["isError"], true);
    assert_eq!(r["structuredContent"]["error"], "Constraint violation");
    assert_eq!(
        r["structuredContent"]["violations"][0]["constraintId"],
        "max-order"
    );
    let r = tool(
        &mut m,
        "mutate",
        json!({"id": "quote", "mutations": {"$.qty": -1}}),
    );
    assert_eq!(r["structuredContent"]["error"], "Schema violation");
    assert_eq!(r["structuredContent"]["violations"][0]["path"], "$.qty");
    let r = tool(&mut m, "get_field", json!({"id": "quote", "path": "$.qty"}));
    assert_eq!(
        r["content"][0]["text"], "4",
        "refused writes changed nothing"
    );
    let r = tool(
        &mut m,
        "explain",
        json!({"id": "quote", "path": "$.net", "limit": 1}),
    );
    let traces = text_json(&r);
    assert_eq!(traces.as_array().unwrap().len(), 1);
    assert_eq!(traces[0]["expression"], "qty * unitPrice");
    assert_eq!(traces[0]["result"], 40);
    let snap = tool(&mut m, "snapshot", json!({"id": "quote"}))["structuredContent"].clone();
    assert_eq!(snap["baseDoc"], json!({"qty": 4, "unitPrice": 10}));
    // Evolve: a stale expectedVersion first.
    let evo = json!({"expectedVersion": "0.9.0", "newVersion": "1.1.0",
        "upsertDerivations": [{"path": "$.gross", "expr": "net * 1.2"}]});
    let r = tool(
        &mut m,
        "evolve_spec",
        json!({"id": "quote", "evolution": evo}),
    );
    assert_eq!(r["isError"], true);
    assert_eq!(r["structuredContent"]["error"], "Version conflict");
    assert_eq!(r["structuredContent"]["expected"], "0.9.0");
    assert_eq!(r["structuredContent"]["actual"], "1.0.0");
    let mut evo = evo;
    evo["expectedVersion"] = json!("1.0.0");
    let r = tool(
        &mut m,
        "evolve_spec",
        json!({"id": "quote", "evolution": evo}),
    );
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(r["structuredContent"]["version"], "1.1.0");
    assert_eq!(r["structuredContent"]["derivationCount"], 2);
    let r = tool(&mut m, "get_state", json!({"id": "quote"}));
    assert_eq!(
        r["structuredContent"],
        json!({"qty": 4, "unitPrice": 10, "net": 40, "gross": 48})
    );
    tool(
        &mut m,
        "mutate",
        json!({"id": "quote", "mutations": {"$.qty": 1}}),
    );
    // Roll the state back to the snapshot; derived values follow the current spec.
    let r = tool(&mut m, "restore", json!({"id": "quote", "snapshot": snap}));
    assert_eq!(r["isError"], false, "{r}");
    let r = tool(&mut m, "get_state", json!({"id": "quote"}));
    assert_eq!(
        r["structuredContent"],
        json!({"qty": 4, "unitPrice": 10, "net": 40, "gross": 48})
    );
    let r = tool(&mut m, "get_audit", json!({"id": "quote"}));
    let records = text_json(&r);
    assert_eq!(records.as_array().unwrap().len(), 2, "two committed cycles");
    assert_eq!(records[0]["modelVersion"], "1.1.0", "newest first");
    let r = tool(&mut m, "verify_audit", json!({"id": "quote"}));
    assert_eq!(
        r["structuredContent"],
        json!({"valid": true, "recordsChecked": 2, "firstBrokenSequence": null, "detail": "ok"})
    );
}
