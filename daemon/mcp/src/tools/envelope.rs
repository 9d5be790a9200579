//! The result envelope of a tool call: text and structured content, the 50 KB guard, and the
//! note that tells a client a large write committed.

use super::*;

pub(super) fn pretty(v: &Json) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
}

/// The tools whose success means a committed write: over the size guard their result is the
/// committed-write note, not a failure (an agent told it failed would send the write again).
pub(super) const COMMITTED_WRITES: &[&str] = &["mutate", "patch_model"];

/// The `tools/call` result for an outcome: a pretty text block, plus structuredContent for
/// objects; the size guard; `isError` for failures.
pub fn envelope(outcome: Outcome) -> Json {
    envelope_for("", outcome)
}

/// [`envelope`] for the tool `name`: a committed write over the size guard answers
/// `isError: false` with a note saying it committed (its counts, and what must be acted on
/// when it fits), also as structuredContent so that clients validating the output accept it;
/// any other result over the guard is withheld as an `isError` note.
pub fn envelope_for(name: &str, outcome: Outcome) -> Json {
    match outcome {
        Ok(v) => {
            let text = pretty(&v);
            let chars = text.chars().count();
            if chars > RESULT_LIMIT_CHARS {
                if COMMITTED_WRITES.contains(&name) {
                    let note = committed_note(&v, chars);
                    return json!({
                        "content": [{"type": "text", "text": pretty(&note)}],
                        "structuredContent": note,
                        "isError": false,
                    });
                }
                let note = json!({
                    "error": "Result too large",
                    "resultChars": chars,
                    "limitChars": RESULT_LIMIT_CHARS,
                    "hint": "Narrow the read: get_state with `paths` (e.g. [\"$.order\"]) and/or `depth`, \
                             get_field for one value, explain with `limit`, get_audit with `limit`/`pathPrefix`.",
                });
                return json!({
                    "content": [{"type": "text", "text": pretty(&note)}],
                    "isError": true,
                });
            }
            let mut r = json!({"content": [{"type": "text", "text": text}]});
            if v.is_object() {
                r["structuredContent"] = v;
            }
            r["isError"] = json!(false);
            r
        }
        Err(ToolError::Structured(v)) => json!({
            "content": [{"type": "text", "text": pretty(&v)}],
            "structuredContent": v,
            "isError": true,
        }),
        Err(ToolError::Message(m)) => json!({
            "content": [{"type": "text", "text": m}],
            "isError": true,
        }),
    }
}

/// What stands in for a committed write's summary `v` of `chars` characters: that it
/// committed, the length of each of its lists, and its flagged constraints and dispatched
/// effects (a caller effect is only ever announced here) as long as the note stays within the
/// guard; the paths and traces are read with the tools the hint names.
pub(super) fn committed_note(v: &Json, chars: usize) -> Json {
    let count = |k: &str| v.get(k).and_then(Json::as_array).map_or(0, Vec::len);
    let mut counts = Map::new();
    for k in [
        "mutatedPaths",
        "derivedUpdated",
        "metaUpdated",
        "flaggedConstraints",
        "dispatchedEffects",
    ] {
        counts.insert(k.into(), json!(count(k)));
    }
    if v.get("traces").is_some() {
        counts.insert("traces".into(), json!(count("traces")));
    }
    let hint = format!(
        "The write committed: {} paths written, {} derived and {} meta values updated, {} flag \
         constraints violated, {} effects dispatched. Only this summary was withheld for its \
         size; do not send the write again. Read what it changed with get_state (`paths`, \
         `depth`) or get_field, its traces with explain (`limit`), its audit record with \
         get_audit (`limit`, `pathPrefix`); leave includeTraces off for large writes.",
        count("mutatedPaths"),
        count("derivedUpdated"),
        count("metaUpdated"),
        count("flaggedConstraints"),
        count("dispatchedEffects"),
    );
    let mut note = json!({
        "error": "Result too large",
        "committed": true,
        "success": v.get("success").cloned().unwrap_or(json!(true)),
        "resultChars": chars,
        "limitChars": RESULT_LIMIT_CHARS,
        "counts": counts,
    });
    for k in ["flaggedConstraints", "dispatchedEffects"] {
        let Some(list) = v
            .get(k)
            .filter(|l| l.as_array().is_some_and(|a| !a.is_empty()))
        else {
            continue;
        };
        note[k] = list.clone();
        // Room is kept for the hint, added last.
        if pretty(&note).chars().count() + hint.len() + 16 > RESULT_LIMIT_CHARS {
            if let Json::Object(m) = &mut note {
                m.shift_remove(k);
            }
        }
    }
    note["hint"] = json!(hint);
    note
}

impl From<ServiceError> for ToolError {
    fn from(e: ServiceError) -> ToolError {
        match e.structured() {
            Some(body) => ToolError::Structured(body),
            None => ToolError::Message(e.to_string()),
        }
    }
}
