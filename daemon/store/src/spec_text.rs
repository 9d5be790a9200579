//! A model's spec text as the store keeps it: its content once per distinct content, apart from
//! its id (models that differ only by their id share one row of `spec_texts`).

/// What follows `{"id":<id>` in `text` (the id as JSON), when the text starts so; `None` keeps
/// the text whole.
pub(crate) fn split<'a>(id: &str, text: &'a str) -> Option<&'a str> {
    let quoted = serde_json::to_string(id).ok()?;
    let body = text
        .strip_prefix(r#"{"id":"#)?
        .strip_prefix(quoted.as_str())?;
    // The id member must end there: `,` before the next member or `}` closing the object.
    matches!(body.as_bytes().first(), Some(b',' | b'}')).then_some(body)
}

/// The text [`split`] took apart.
pub(crate) fn join(id: &str, body: &str) -> String {
    let quoted = serde_json::to_string(id).unwrap_or_else(|_| format!("{id:?}"));
    format!(r#"{{"id":{quoted}{body}"#)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_splits_at_its_id_and_joins_back() {
        let text = r#"{"id":"quote-7","version":"1.0.0","schema":{}}"#;
        let body = split("quote-7", text).expect("starts with its id");
        assert_eq!(body, r#","version":"1.0.0","schema":{}}"#);
        assert_eq!(join("quote-7", body), text);
        // Another model of the same content shares the body.
        let other = r#"{"id":"quote-8","version":"1.0.0","schema":{}}"#;
        assert_eq!(split("quote-8", other), Some(body));
        assert_eq!(split("x", r#"{"id":"x"}"#), Some("}"));
        let escaped = "{\"id\":\"a\\\"b\",\"v\":1}";
        assert_eq!(
            join("a\"b", split("a\"b", escaped).expect("split")),
            escaped
        );
    }

    #[test]
    fn a_text_that_does_not_start_with_its_id_stays_whole() {
        assert_eq!(split("a", r#"{"version":"1","id":"a"}"#), None);
        assert_eq!(split("a", r#"{"id":"ab","v":1}"#), None);
        assert_eq!(split("a", r#"{"id":"b","v":1}"#), None);
    }
}
