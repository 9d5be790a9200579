//! MCP's modern era (revision 2026-07-28) from a client's side, for the benches: the `_meta` and
//! the standard headers a sessionless request carries. (The end-to-end load run of modern
//! `tools/call mutate` is `valem_tests::load::run` with `Surface::McpModern`.)

use serde_json::{json, Value};

/// The modern revision.
pub const VERSION: &str = "2026-07-28";

/// The `_meta` every modern request carries: its version and (no) client capabilities.
pub fn meta() -> Value {
    json!({"io.modelcontextprotocol/protocolVersion": VERSION,
        "io.modelcontextprotocol/clientCapabilities": {}})
}

/// A modern JSON-RPC request: `params` with [`meta`] added.
pub fn request(id: u64, method: &str, mut params: Value) -> Value {
    params["_meta"] = meta();
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
}

/// `tools/call` of `tool` with `arguments`.
pub fn tools_call(id: u64, tool: &str, arguments: Value) -> Value {
    request(
        id,
        "tools/call",
        json!({"name": tool, "arguments": arguments}),
    )
}

/// `subscriptions/listen` for `notifications/resources/updated` of these resource URIs.
pub fn listen(id: u64, uris: &[&str]) -> Value {
    request(
        id,
        "subscriptions/listen",
        json!({"notifications": {"resourceSubscriptions": uris}}),
    )
}

/// The headers of a modern POST to `/mcp`: the content types, `MCP-Protocol-Version`,
/// `Mcp-Method` and, for `tools/call`, `Mcp-Name` (the tool).
pub fn headers<'a>(method: &'a str, name: Option<&'a str>) -> Vec<(&'static str, &'a str)> {
    let mut h = vec![
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
        ("MCP-Protocol-Version", VERSION),
        ("Mcp-Method", method),
    ];
    if let Some(n) = name {
        h.push(("Mcp-Name", n));
    }
    h
}
