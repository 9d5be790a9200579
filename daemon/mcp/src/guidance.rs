//! The domain-guidance catalog behind `get_domain_guidance`: the topics of the guidance plugins
//! in load order (first the built-in `valem-guidance`, our own texts, unless it is switched off),
//! a later topic replacing an earlier one of the same id, then an operator's topics file
//! (`VALEM_DOMAIN_GUIDANCE_TOPICS_FILE`) on top.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value as Json};

use valem_service::plugins::{Kind, Plugin, Plugins};

/// One topic.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topic {
    pub id: String,
    #[serde(default)]
    pub title: Option<String>,
    pub description: String,
    /// Empty when the plugin lists topics without their text: asked for on use.
    #[serde(default)]
    pub instructions: String,
    /// The plugin the topic came from (None: the topics file).
    #[serde(skip)]
    pub plugin: Option<Arc<Plugin>>,
}

impl PartialEq for Topic {
    fn eq(&self, o: &Topic) -> bool {
        self.id == o.id
            && self.title == o.title
            && self.description == o.description
            && self.instructions == o.instructions
    }
}

/// The environment variable naming an extra topics file.
pub const TOPICS_FILE_ENV: &str = "VALEM_DOMAIN_GUIDANCE_TOPICS_FILE";

#[derive(Clone, Debug, Default)]
pub struct Catalog {
    topics: Vec<Topic>,
}

/// Topics that could not be added, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuidanceError {
    #[error("cannot read topics file {path}: {error}")]
    Read { path: String, error: String },
    #[error("{origin}: not a topics file ({error}); expected a JSON array of {{\"id\", \"description\", \"instructions\", \"title\"?}}")]
    NotTopics { origin: String, error: String },
    #[error(
        "{origin}: topic #{index} has id `{id}`; ids are lowercase letters, digits, `_` or `-`"
    )]
    BadId {
        origin: String,
        index: usize,
        id: String,
    },
    /// The plugin's `topics.list` call failed.
    #[error("{0}")]
    Plugin(String),
    #[error("plugin `{plugin}` listed topics this daemon cannot read: {error}")]
    Unreadable { plugin: String, error: String },
}

fn parse(text: &str, origin: &str) -> Result<Vec<Topic>, GuidanceError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum File {
        List(Vec<Topic>),
        Wrapped { topics: Vec<Topic> },
    }
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let f: File = serde_json::from_str(text).map_err(|e| GuidanceError::NotTopics {
        origin: origin.to_string(),
        error: e.to_string(),
    })?;
    let topics = match f {
        File::List(t) | File::Wrapped { topics: t } => t,
    };
    check_ids(&topics, origin)?;
    Ok(topics)
}

fn check_ids(topics: &[Topic], origin: &str) -> Result<(), GuidanceError> {
    for (i, t) in topics.iter().enumerate() {
        let ok = !t.id.is_empty()
            && t.id
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
        if !ok {
            return Err(GuidanceError::BadId {
                origin: origin.to_string(),
                index: i,
                id: t.id.clone(),
            });
        }
    }
    Ok(())
}

impl Catalog {
    /// The built-in topics, read from the built-in plugin's crate directly (no ABI).
    pub fn builtin() -> Catalog {
        Catalog {
            topics: valem_plugin_guidance::topics()
                .unwrap_or_default()
                .into_iter()
                .map(|t| Topic {
                    id: t.id,
                    title: t.title,
                    description: t.description,
                    instructions: t.instructions,
                    plugin: None,
                })
                .collect(),
        }
    }

    fn add(&mut self, t: Topic) {
        match self.topics.iter_mut().find(|x| x.id == t.id) {
            Some(slot) => *slot = t,
            None => self.topics.push(t),
        }
    }

    /// Add the topics of a file: a topic with a known id replaces it, new ids are appended.
    pub fn extend_from_file(&mut self, path: &std::path::Path) -> Result<usize, GuidanceError> {
        let text = std::fs::read_to_string(path).map_err(|e| GuidanceError::Read {
            path: path.display().to_string(),
            error: e.to_string(),
        })?;
        let added = parse(&text, &path.display().to_string())?;
        let n = added.len();
        for t in added {
            self.add(t);
        }
        Ok(n)
    }

    /// Add the topics of a guidance plugin (`topics.list`).
    pub fn extend_from_plugin(&mut self, p: &Arc<Plugin>) -> Result<usize, GuidanceError> {
        let list = p
            .call("topics.list", json!({}))
            .map_err(|e| GuidanceError::Plugin(e.to_string()))?;
        let mut topics: Vec<Topic> =
            serde_json::from_value(list).map_err(|e| GuidanceError::Unreadable {
                plugin: p.name.clone(),
                error: e.to_string(),
            })?;
        check_ids(&topics, &format!("plugin `{}`", p.name))?;
        let n = topics.len();
        for mut t in topics.drain(..) {
            t.plugin = Some(p.clone());
            self.add(t);
        }
        Ok(n)
    }

    /// The topics of every guidance plugin, in load order, then the file named by the
    /// environment. A plugin whose list fails is logged and skipped; a bad file is an error.
    pub fn from_plugins(plugins: &Plugins) -> Result<Catalog, GuidanceError> {
        let mut c = Catalog::default();
        for p in plugins.of_kind(Kind::Guidance) {
            if let Err(e) = c.extend_from_plugin(p) {
                tracing::error!(plugin = %p.name, "guidance topics not loaded: {e}");
            }
        }
        if let Some(p) = std::env::var_os(TOPICS_FILE_ENV).filter(|p| !p.is_empty()) {
            c.extend_from_file(std::path::Path::new(&p))?;
        }
        Ok(c)
    }

    pub fn ids(&self) -> Vec<String> {
        self.topics.iter().map(|t| t.id.clone()).collect()
    }

    pub fn topics(&self) -> &[Topic] {
        &self.topics
    }

    /// "id (description); …" for the tool's schema.
    pub fn menu(&self) -> String {
        self.topics
            .iter()
            .map(|t| format!("{} ({})", t.id, t.description))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The tool result for the requested topic ids.
    pub fn guidance(&self, ids: &[String]) -> Json {
        let mut found = Vec::new();
        let mut unknown = Vec::new();
        for id in ids {
            match self.topics.iter().find(|t| &t.id == id) {
                Some(t) if !found.iter().any(|f: &&Topic| f.id == t.id) => found.push(t),
                Some(_) => {}
                None => unknown.push(id.clone()),
            }
        }
        let mut text = String::new();
        for t in &found {
            text.push_str(&format!(
                "## {}\n{}\n\n",
                t.title.as_deref().unwrap_or(&t.id),
                instructions(t).trim_end()
            ));
        }
        if found.is_empty() {
            text.push_str("No topic matched. Available topics: ");
            text.push_str(&self.menu());
        }
        json!({
            "guidance": text.trim_end(),
            "topics": found.iter().map(|t| json!({
                "id": t.id,
                "title": t.title.as_deref().unwrap_or(&t.id),
                "description": t.description,
            })).collect::<Vec<_>>(),
            "unknownTopics": unknown,
            "available": self.ids(),
        })
    }
}

/// A topic's text: held, or asked of its plugin (`topics.get`); a failure is told in its place.
fn instructions(t: &Topic) -> String {
    if !t.instructions.is_empty() {
        return t.instructions.clone();
    }
    let Some(p) = &t.plugin else {
        return String::new();
    };
    match p.call("topics.get", json!({"id": t.id})) {
        Ok(v) => v["instructions"].as_str().unwrap_or_default().to_string(),
        Err(e) => format!("(this topic's text is unavailable: {e})"),
    }
}
