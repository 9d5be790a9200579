//! The domain-guidance catalog behind `get_domain_guidance`: the built-in topics (our own
//! texts, `assets/domain-guidance-topics.json`) extended or overridden by an operator's topics
//! file (`VALEM_DOMAIN_GUIDANCE_TOPICS_FILE`).

use serde::Deserialize;
use serde_json::{json, Value as Json};

/// One topic.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Topic {
    pub id: String,
    #[serde(default)]
    pub title: Option<String>,
    pub description: String,
    pub instructions: String,
}

/// The environment variable naming an extra topics file.
pub const TOPICS_FILE_ENV: &str = "VALEM_DOMAIN_GUIDANCE_TOPICS_FILE";

const BUILTIN: &str = include_str!("../../assets/domain-guidance-topics.json");

#[derive(Clone, Debug, Default)]
pub struct Catalog {
    topics: Vec<Topic>,
}

fn parse(text: &str, origin: &str) -> Result<Vec<Topic>, String> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum File {
        List(Vec<Topic>),
        Wrapped { topics: Vec<Topic> },
    }
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let f: File = serde_json::from_str(text).map_err(|e| {
        format!(
            "{origin}: not a topics file ({e}); expected a JSON array of {{\"id\", \"description\", \"instructions\", \"title\"?}}"
        )
    })?;
    let topics = match f {
        File::List(t) | File::Wrapped { topics: t } => t,
    };
    for (i, t) in topics.iter().enumerate() {
        let ok = !t.id.is_empty()
            && t.id
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
        if !ok {
            return Err(format!(
                "{origin}: topic #{i} has id `{}`; ids are lowercase letters, digits, `_` or `-`",
                t.id
            ));
        }
    }
    Ok(topics)
}

impl Catalog {
    /// The built-in topics.
    pub fn builtin() -> Catalog {
        Catalog {
            topics: parse(BUILTIN, "built-in topics").unwrap_or_default(),
        }
    }

    /// Add the topics of a file: a topic with a known id replaces it, new ids are appended.
    pub fn extend_from_file(&mut self, path: &std::path::Path) -> Result<usize, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read topics file {}: {e}", path.display()))?;
        let added = parse(&text, &path.display().to_string())?;
        let n = added.len();
        for t in added {
            match self.topics.iter_mut().find(|x| x.id == t.id) {
                Some(slot) => *slot = t,
                None => self.topics.push(t),
            }
        }
        Ok(n)
    }

    /// The built-in topics plus the file named by the environment, if any.
    pub fn from_env() -> Result<Catalog, String> {
        let mut c = Catalog::builtin();
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
                t.instructions.trim_end()
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
