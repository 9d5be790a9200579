//! Multi round-trip requests (MCP 2026-07-28): instead of asking the client something mid-call,
//! a tool answers an `InputRequiredResult` (`inputRequests`, and an opaque `requestState`), and
//! the client retries the call with `inputResponses` and the state echoed back. The state
//! passes through the client, so it is sealed: a keyed BLAKE3 MAC over the exact text, a
//! purpose (the method, the tool and the caller's scope) and an expiry. A state that was
//! altered, is presented for another call or caller, or has lapsed is refused.

use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value as Json};

/// How long a sealed state stays valid.
pub const STATE_TTL: Duration = Duration::from_secs(15 * 60);

/// Longest `requestState` we read.
pub const MAX_STATE_CHARS: usize = 64 * 1024;

/// Why a `requestState` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error(
        "requestState integrity check failed: it was not issued by this server or was altered"
    )]
    Forged,
    #[error("requestState was issued for another request ({0})")]
    OtherPurpose(String),
    #[error("requestState expired; retry the request without it to start over")]
    Expired,
    #[error("requestState is too long ({0} characters; the limit is {MAX_STATE_CHARS})")]
    TooLong(usize),
}

/// The server's sealing key: random per process (a state outlives neither the process nor
/// [`STATE_TTL`]).
pub struct StateKey([u8; 32]);

impl StateKey {
    /// A fresh random key; `None` when the system has no randomness to give.
    pub fn random() -> Option<StateKey> {
        let mut k = [0u8; 32];
        getrandom::fill(&mut k).ok()?;
        Some(StateKey(k))
    }

    fn mac(&self, text: &str) -> String {
        let h = blake3::keyed_hash(&self.0, text.as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(h.as_bytes())
    }

    /// Seal `data` for `purpose`, valid for `ttl` from `now_ms` (milliseconds since the epoch).
    pub fn seal(&self, purpose: &str, data: &Json, now_ms: u64, ttl: Duration) -> String {
        let exp = now_ms.saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        let body = json!({"p": purpose, "exp": exp, "d": data}).to_string();
        let text = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(body.as_bytes());
        let mac = self.mac(&text);
        format!("{text}.{mac}")
    }

    /// The data of a state sealed for `purpose`, if it is intact and not expired at `now_ms`.
    pub fn open(&self, purpose: &str, state: &str, now_ms: u64) -> Result<Json, StateError> {
        if state.len() > MAX_STATE_CHARS {
            return Err(StateError::TooLong(state.len()));
        }
        let (text, mac) = state.rsplit_once('.').ok_or(StateError::Forged)?;
        let expected = self.mac(text);
        // Compared as digests: equal-length, constant-time.
        let same = blake3::Hash::from_bytes(*blake3::hash(expected.as_bytes()).as_bytes())
            == blake3::hash(mac.as_bytes());
        if !same {
            return Err(StateError::Forged);
        }
        let body = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text)
            .map_err(|_| StateError::Forged)?;
        let v: Json = serde_json::from_slice(&body).map_err(|_| StateError::Forged)?;
        let p = v.get("p").and_then(Json::as_str).unwrap_or("");
        if p != purpose {
            return Err(StateError::OtherPurpose(p.to_string()));
        }
        if v.get("exp").and_then(Json::as_u64).unwrap_or(0) < now_ms {
            return Err(StateError::Expired);
        }
        Ok(v.get("d").cloned().unwrap_or(Json::Null))
    }
}

/// An `InputRequiredResult` (no `inputRequests` when `requests` is an empty object: the client
/// retries with the state alone).
pub fn input_required(requests: Json, state: Option<String>) -> Json {
    let mut r = json!({"resultType": "input_required"});
    if requests.as_object().is_none_or(|o| !o.is_empty()) {
        r["inputRequests"] = requests;
    }
    if let Some(s) = state {
        r["requestState"] = json!(s);
    }
    r
}

/// A call's `inputResponses`: absent is none; present, it must be an object (a protocol
/// error otherwise).
pub fn responses(params: &Json) -> Result<Option<&serde_json::Map<String, Json>>, String> {
    match params.get("inputResponses") {
        None => Ok(None),
        Some(Json::Object(m)) => Ok(Some(m)),
        Some(_) => Err("`inputResponses` must be an object mapping each inputRequests key to the client's result".into()),
    }
}

/// The accepted content of an elicitation answer under `key`: `Ok(None)` when the key is not
/// answered (ask again), `Err` when the answer is not an ElicitResult.
pub fn accepted<'a>(
    responses: Option<&'a serde_json::Map<String, Json>>,
    key: &str,
) -> Result<Option<&'a Json>, String> {
    let Some(r) = responses.and_then(|m| m.get(key)) else {
        return Ok(None);
    };
    let Some(action) = r.get("action").and_then(Json::as_str) else {
        return Err(format!(
            "inputResponses.{key} is not an elicitation result (it needs an `action`)"
        ));
    };
    match (action, r.get("content")) {
        ("accept", Some(c @ Json::Object(_))) => Ok(Some(c)),
        ("accept", _) => Err(format!(
            "inputResponses.{key} accepts without a `content` object"
        )),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_state_opens_only_intact_for_its_purpose_in_time() {
        let k = StateKey::random().unwrap();
        let s = k.seal("tools/call:x", &json!({"round": 1}), 1_000, STATE_TTL);
        assert_eq!(
            k.open("tools/call:x", &s, 2_000).unwrap(),
            json!({"round": 1})
        );
        assert_eq!(
            k.open("tools/call:x", &format!("{s}-TAMPERED"), 2_000),
            Err(StateError::Forged)
        );
        // A changed payload with the old MAC.
        let (text, mac) = s.rsplit_once('.').unwrap();
        let mut t = text.to_string();
        t.replace_range(0..1, if t.starts_with('A') { "B" } else { "A" });
        assert_eq!(
            k.open("tools/call:x", &format!("{t}.{mac}"), 2_000),
            Err(StateError::Forged)
        );
        assert!(matches!(
            k.open("tools/call:y", &s, 2_000),
            Err(StateError::OtherPurpose(_))
        ));
        let late = 1_000 + STATE_TTL.as_millis() as u64 + 1;
        assert_eq!(k.open("tools/call:x", &s, late), Err(StateError::Expired));
        // Another process's key.
        let other = StateKey::random().unwrap();
        assert_eq!(
            other.open("tools/call:x", &s, 2_000),
            Err(StateError::Forged)
        );
        assert_eq!(k.open("tools/call:x", "no-dot", 0), Err(StateError::Forged));
        let huge = "a".repeat(MAX_STATE_CHARS + 1);
        assert!(matches!(k.open("p", &huge, 0), Err(StateError::TooLong(_))));
    }

    #[test]
    fn elicitation_answers_are_read_strictly() {
        let p = json!({"inputResponses": {"a": {"action": "accept", "content": {"name": "Al"}},
            "b": {"action": "decline"}, "c": 12345, "d": {"action": "accept"}}});
        let r = responses(&p).unwrap();
        assert_eq!(accepted(r, "a").unwrap().unwrap()["name"], "Al");
        assert_eq!(accepted(r, "b").unwrap(), None);
        assert!(accepted(r, "c").is_err());
        assert!(accepted(r, "d").is_err());
        assert_eq!(accepted(r, "zz").unwrap(), None);
        assert!(responses(&json!({"inputResponses": null})).is_err());
        assert_eq!(responses(&json!({})).unwrap(), None);
    }
}
