//! The daemon's built-in domain-guidance topics (`topics.json`, our own texts) as a `guidance`
//! plugin. The daemon links this crate and loads [`plugin_v1`] through the same C ABI as a
//! plugin library; `plugins/guidance-cdylib` builds it as one (`libvalem_guidance.so`), so the
//! defaults can be loaded, or replaced, like any other plugin.

use valem_sdk::{Error, GuidancePlugin, Host, Topic};

/// The plugin's name.
pub const NAME: &str = "valem-guidance";

const TOPICS: &str = include_str!("../topics.json");

/// The built-in topics, parsed.
pub fn topics() -> Result<Vec<Topic>, Error> {
    serde_json::from_str(TOPICS).map_err(|e| Error::failed(format!("topics.json: {e}")))
}

/// The topics, held by the plugin.
pub struct Builtin {
    topics: Vec<Topic>,
}

impl GuidancePlugin for Builtin {
    fn topics(&self) -> Vec<Topic> {
        self.topics.clone()
    }

    fn topic(&self, id: &str) -> Option<Topic> {
        self.topics.iter().find(|t| t.id == id).cloned()
    }
}

valem_sdk::declare_plugin!(guidance, NAME, |_host: &Host| Ok(Builtin {
    topics: topics()?
}));

#[cfg(test)]
mod tests {
    #[test]
    fn the_bundled_topics_parse_with_unique_ids() {
        let t = super::topics().expect("topics.json parses");
        assert!(t.len() >= 5, "{} topics", t.len());
        let mut ids: Vec<_> = t.iter().map(|t| t.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), t.len(), "duplicate topic ids");
        assert!(t.iter().all(|t| !t.instructions.is_empty()));
    }
}
