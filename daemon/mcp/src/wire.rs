//! JSON-RPC messages to and from their wire text, with ids echoed exactly as sent: a JSON value
//! holds a number as an `i64`, `u64` or `f64`, so an id such as `1180591620717411303424` (2^70)
//! or `1e2` would come back as `1.1805916207174113e21` or `100.0`. Such a number (as a request
//! `id`, a cancellation's `requestId` or a `progressToken`) is replaced on the way in by a marker
//! string holding its text, which the session uses like any id; on the way out every marker is
//! written back as that text. Never interprets a message otherwise.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use serde_json::value::RawValue;
use serde_json::Value as Json;

/// Where a marked number may be: the request id, and the ids a message refers to.
const PLACES: &[&str] = &["/id", "/params/requestId", "/params/_meta/progressToken"];

/// The marker's prefix, unique to this process so that no client's string id is taken for one.
fn prefix() -> &'static str {
    static PREFIX: OnceLock<String> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let nonce = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        format!("\u{0}valem-number-{nonce:016x}:")
    })
}

/// The prefix as it appears in serialized text (the NUL escaped).
fn escaped_prefix() -> &'static str {
    static ESCAPED: OnceLock<String> = OnceLock::new();
    ESCAPED.get_or_init(|| {
        let quoted = serde_json::to_string(prefix()).unwrap_or_default();
        quoted
            .strip_prefix('"')
            .and_then(|q| q.strip_suffix('"'))
            .unwrap_or_default()
            .to_string()
    })
}

/// A number whose JSON value does not print back as `raw`.
fn inexact(v: &Json, raw: &str) -> bool {
    matches!(v, Json::Number(n) if n.is_f64() && n.to_string() != raw)
}

/// Parse one message (or batch), marking the numbers at [`PLACES`] that a JSON value cannot
/// carry exactly.
pub fn parse(text: &[u8]) -> serde_json::Result<Json> {
    let mut msg: Json = serde_json::from_slice(text)?;
    let lossy = |m: &Json| {
        PLACES
            .iter()
            .any(|p| matches!(m.pointer(p), Some(Json::Number(n)) if n.is_f64()))
    };
    let any = match &msg {
        Json::Array(items) => items.iter().any(lossy),
        m => lossy(m),
    };
    if !any {
        return Ok(msg);
    }
    // Rare: read the numbers' own text and mark those that would change.
    let raw: &RawValue = serde_json::from_slice(text)?;
    match &mut msg {
        Json::Array(items) => {
            let raws: Vec<&RawValue> = serde_json::from_str(raw.get()).unwrap_or_default();
            for (item, r) in items.iter_mut().zip(raws) {
                mark(item, r);
            }
        }
        m => mark(m, raw),
    }
    Ok(msg)
}

fn mark(msg: &mut Json, raw: &RawValue) {
    for place in PLACES {
        let Some(text) = raw_at(raw, place) else {
            continue;
        };
        if let Some(v) = msg.pointer_mut(place) {
            if inexact(v, &text) {
                *v = Json::String(format!("{}{text}", prefix()));
            }
        }
    }
}

/// The text of the value at a JSON Pointer made of object members.
fn raw_at(raw: &RawValue, pointer: &str) -> Option<String> {
    let mut cur: Box<RawValue> = raw.to_owned();
    for member in pointer.split('/').skip(1) {
        let mut members: std::collections::HashMap<String, Box<RawValue>> =
            serde_json::from_str(cur.get()).ok()?;
        cur = members.remove(member)?;
    }
    Some(cur.get().trim().to_string())
}

/// A message's wire text, marked numbers written back as sent.
pub fn to_string(msg: &Json) -> String {
    let text = msg.to_string();
    let esc = escaped_prefix();
    if !text.contains(esc) {
        return text;
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    // Each marker is `"<escaped prefix><number text>"`; the number has no quote in it.
    while let Some(at) = rest.find(esc) {
        let open = at.saturating_sub(1);
        let after = &rest[at + esc.len()..];
        match after.find('"') {
            Some(close) if rest[open..].starts_with('"') => {
                out.push_str(&rest[..open]);
                out.push_str(&after[..close]);
                rest = &after[close + 1..];
            }
            _ => {
                out.push_str(&rest[..at + esc.len()]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// [`to_string`] as bytes.
pub fn to_vec(msg: &Json) -> Vec<u8> {
    to_string(msg).into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ids_are_echoed_as_sent() {
        for raw in [
            "1180591620717411303424",
            "1e2",
            "1.50",
            "-1E+2",
            "12345678901234567890123",
        ] {
            let text = format!(r#"{{"jsonrpc":"2.0","id":{raw},"method":"ping"}}"#);
            let msg = parse(text.as_bytes()).unwrap();
            assert!(msg["id"].is_string(), "{raw} is marked");
            let reply = json!({"jsonrpc": "2.0", "id": msg["id"].clone(), "result": {}});
            assert_eq!(
                to_string(&reply),
                format!(r#"{{"jsonrpc":"2.0","id":{raw},"result":{{}}}}"#)
            );
        }
        // Exact ids are left alone: integers, strings (even one that looks like a marker).
        for id in [
            json!(7),
            json!(-3),
            json!(u64::MAX),
            json!(1.5),
            json!("x"),
            json!("\u{0}valem-number-0:1"),
        ] {
            let text = json!({"jsonrpc": "2.0", "id": id, "method": "ping"}).to_string();
            let msg = parse(text.as_bytes()).unwrap();
            assert_eq!(msg["id"], id);
            assert_eq!(to_string(&msg), text);
        }
    }

    #[test]
    fn cancellations_progress_tokens_and_batches_are_marked_alike() {
        let big = "1180591620717411303424";
        let cancel = parse(
            format!(r#"{{"jsonrpc":"2.0","method":"notifications/cancelled","params":{{"requestId":{big}}}}}"#)
                .as_bytes(),
        )
        .unwrap();
        let req = parse(format!(r#"{{"jsonrpc":"2.0","id":{big},"method":"x","params":{{"_meta":{{"progressToken":{big}}}}}}}"#).as_bytes()).unwrap();
        assert_eq!(cancel["params"]["requestId"], req["id"]);
        assert_eq!(req["params"]["_meta"]["progressToken"], req["id"]);
        let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": req["id"].clone(), "progress": 1}});
        assert!(to_string(&progress).contains(&format!(r#""progressToken":{big},"#)));
        let batch = parse(format!(r#"[{{"jsonrpc":"2.0","id":1,"method":"a"}},{{"jsonrpc":"2.0","id":{big},"method":"b"}}]"#).as_bytes()).unwrap();
        assert_eq!(batch[0]["id"], 1);
        assert!(batch[1]["id"].is_string());
        assert!(parse(b"{").is_err());
    }
}
