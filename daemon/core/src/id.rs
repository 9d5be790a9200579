//! `ModelId`: a model's id, as a spec's `id` names it and every surface addresses it, typed
//! where it crosses a crate's API so that it is not confused with the other strings beside it
//! (paths, view ids, effect ids, blob ids). Cheap to clone (shared text).

use std::sync::Arc;

/// A model's id. Serialised as its text (its JSON Schema is a string's).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct ModelId(Arc<str>);

impl schemars::JsonSchema for ModelId {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ModelId".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        String::json_schema(generator)
    }
}

impl ModelId {
    /// The id with this text (a spec's `id`; the validator checks its form at creation).
    pub fn new(id: impl Into<Arc<str>>) -> ModelId {
        ModelId(id.into())
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for ModelId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for ModelId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for ModelId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for ModelId {
    fn from(s: &str) -> ModelId {
        ModelId(Arc::from(s))
    }
}

impl From<&String> for ModelId {
    fn from(s: &String) -> ModelId {
        ModelId(Arc::from(s.as_str()))
    }
}

impl From<String> for ModelId {
    fn from(s: String) -> ModelId {
        ModelId(Arc::from(s))
    }
}

impl std::fmt::Display for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Debug for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl PartialEq<str> for ModelId {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for ModelId {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_its_text_everywhere_it_shows() {
        let id = ModelId::from("orders");
        assert_eq!(id, "orders");
        assert_eq!(id.to_string(), "orders");
        assert_eq!(format!("{id:?}"), "\"orders\"");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"orders\"");
        let back: ModelId = serde_json::from_str("\"orders\"").unwrap();
        assert_eq!(back, id);
        let set: std::collections::HashSet<ModelId> = [id.clone()].into();
        assert!(set.contains("orders"));
    }
}
