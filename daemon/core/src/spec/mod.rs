//! ModelSpec and SpecEvolution: the serde types of the reference format, their parsing with
//! precise error locations, and the validator behind `validate_spec`. Owns no runtime state and
//! never evaluates a model (the validator compiles expressions only to check them).

pub mod evolve;
pub mod schema;
pub mod template;

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value as Json};

/// One finding of the validator or of an evolution's parse: where, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord, JsonSchema)]
pub struct Finding {
    /// Where in the spec: `derivations[0].expr`, `schema`, `line 3, column 7`, ...
    pub location: String,
    pub message: String,
}

/// A complete model specification, as the reference defines it. Unknown top-level keys are kept
/// in `extra` (so a spec round-trips verbatim) and reported as validator warnings.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Model identifier: `[namespace/]name`, each segment starting with a letter (then
    /// letters, digits, `-`, `_`).
    pub id: String,
    /// Semantic version `MAJOR.MINOR.PATCH`; absent or blank means `1.0.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Branch this model from another model's spec (flattened into this one at creation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<TemplateRef>,
    /// The ancestor chain of a branch, written by the materializer; leave it out when authoring.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lineage: Vec<LineageEntry>,
    /// JSON Schema (draft 2020-12, `$defs`/`$ref` allowed) of the base document the caller
    /// writes; derived fields may be declared in it too.
    #[schemars(schema_with = "schema::json_schema_value")]
    pub schema: Json,
    /// Named immutable values (any JSON), read as `$const.name` in every expression.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub constants: Map<String, Json>,
    /// Named JSONata functions/values callable as `$name(...)` from every expression; they see
    /// only their arguments and `$const`, never the document.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub library: Option<LibrarySpec>,
    /// Rules that fill fields of a newly created container (`$` seeds the document).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub default_values: Vec<DefaultValueSpec>,
    /// Computed read-only fields, re-evaluated when what they read changes.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "exact"
    )]
    #[schemars(with = "Vec<DerivationSpec>")]
    pub derivations: Vec<DerivationSpec>,
    /// Live per-field metadata (required, bounds, readOnly, relevant, ...) computed by
    /// expressions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub meta_derivations: Vec<MetaDerivationSpec>,
    /// Boolean invariants checked after every mutation, with a rollback or flag policy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<ConstraintSpec>,
    /// Side effects requested when a trigger becomes true, run by a shell (caller, server,
    /// llm, timer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub effects: Vec<EffectSpec>,
    /// Embedded test cases: mutations to apply (`given`) and values to expect.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tests: Vec<TestCase>,
    /// Declarative UI: `{views: [...], defaultView}` of components bound to fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub view_definition: Option<Json>,
    /// Removed in the reference; a non-empty value is rejected by the validator. Not in the
    /// JSON Schema (it only advertises what a spec should contain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(skip)]
    pub initial_state: Option<Json>,
    /// Removed in the reference; a non-empty value is rejected by the validator. Not in the
    /// JSON Schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(skip)]
    pub actions: Option<Json>,
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: Map<String, Json>,
}

/// The default version when a spec gives none.
pub const DEFAULT_VERSION: &str = "1.0.0";

impl ModelSpec {
    pub fn version_or_default(&self) -> &str {
        match self.version.as_deref() {
            Some(v) if !v.trim().is_empty() => v,
            _ => DEFAULT_VERSION,
        }
    }

    /// The library layers in binding order (inherited first, own last).
    pub fn library_layers(&self) -> Vec<LibraryLayer> {
        match &self.library {
            None => Vec::new(),
            Some(l) => l.layers(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct TemplateRef {
    /// Coordinate of the template model (`[namespace/]name`).
    #[serde(rename = "ref")]
    pub reference: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LineageEntry {
    /// Coordinate of the ancestor model.
    #[serde(rename = "ref")]
    pub reference: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// `library`: a bare definition string, one layer object, or the stored `{layers: [...]}` form.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(untagged)]
pub enum LibrarySpec {
    /// Shorthand for `{"define": ...}`.
    Define(String),
    /// The stored form: layers in binding order (inherited first, own last).
    Layered {
        layers: Vec<LibraryLayer>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
    },
    Layer(LibraryLayer),
}

impl LibrarySpec {
    pub fn layers(&self) -> Vec<LibraryLayer> {
        match self {
            LibrarySpec::Define(d) => vec![LibraryLayer {
                define: d.clone(),
                ..LibraryLayer::default()
            }],
            LibrarySpec::Layer(l) => vec![l.clone()],
            LibrarySpec::Layered { layers, .. } => layers.clone(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LibraryLayer {
    /// A JSONata block that binds functions/values and returns the array of names it exports,
    /// e.g. `( $money := function($n){ $round($n, 2) }; ["money"] )`.
    pub define: String,
    /// Export name → declared signature (documentation for agents).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub signatures: Map<String, Json>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Layers this one builds on: one name or an array of names.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "one_or_many"
    )]
    #[schemars(schema_with = "schema::one_or_many_strings")]
    pub extends: Vec<String>,
    /// Which model contributed the layer (written when a branch inherits it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DefaultValueSpec {
    /// The container the rule fills: `$` (the document, at creation), an object (`$.customer`)
    /// or array elements (`$.items[*]`), in canonical JSON Path.
    pub path: String,
    /// JSONata returning an object whose fields fill the new container where the caller gave
    /// none (`$parent` and `$self` are bound).
    pub expr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// A derivation: its target and expression, each one shared 8-byte pointer (the compiled
/// node takes them as its key and text), and its rarely given settings behind one more (a
/// large spec holds a million of these: 24 bytes each). Its JSON form has `path`, `expr`,
/// and optionally `evaluation` and `description`.
#[derive(Clone, Debug, PartialEq)]
pub struct DerivationSpec {
    /// The computed field, in canonical JSON Path.
    pub path: arcstr::ArcStr,
    /// JSONata over the merged document.
    pub expr: arcstr::ArcStr,
    extra: Option<Box<DerivationExtra>>,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<DerivationSpec>() == 24);

/// What a derivation seldom has.
#[derive(Clone, Debug, PartialEq)]
struct DerivationExtra {
    evaluation: Option<arcstr::ArcStr>,
    description: Option<arcstr::ArcStr>,
}

// A derivation as a spec writes it (a `//` comment: the published schema has no description
// here).
#[derive(Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "DerivationSpec")]
struct DerivationWire<S> {
    /// The computed field, in canonical JSON Path (`$.total`, `$.items[*].lineTotal` for one
    /// value per element, with `$parent` bound to the element). Shared with the compiled
    /// node as its key when it is written canonically.
    #[schemars(with = "String")]
    path: S,
    /// JSONata over the merged document (no `$.` prefix: `price * qty`). Shared with the
    /// compiled node (a large spec's texts are held once).
    #[schemars(with = "String")]
    expr: S,
    /// `"eager"` (default: computed in every mutation) or `"lazy"` (computed when read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["eager", "lazy", null]), with = "Option<String>")]
    evaluation: Option<S>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    description: Option<S>,
}

impl DerivationSpec {
    /// An eager derivation of `path` computing `expr`, with no description.
    pub fn new(path: impl Into<arcstr::ArcStr>, expr: impl Into<arcstr::ArcStr>) -> Self {
        DerivationSpec {
            path: path.into(),
            expr: expr.into(),
            extra: None,
        }
    }

    /// `"eager"`, `"lazy"` (or what else the spec says, which the validator reports), when
    /// given.
    pub fn evaluation(&self) -> Option<&str> {
        self.extra.as_ref()?.evaluation.as_deref()
    }

    pub fn description(&self) -> Option<&str> {
        self.extra.as_ref()?.description.as_deref()
    }

    pub fn is_lazy(&self) -> bool {
        self.evaluation()
            .is_some_and(|e| e.eq_ignore_ascii_case("lazy"))
    }
}

impl Serialize for DerivationSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        DerivationWire::<&str> {
            path: &self.path,
            expr: &self.expr,
            evaluation: self.evaluation(),
            description: self.description(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for DerivationSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = DerivationWire::<arcstr::ArcStr>::deserialize(d)?;
        let extra = (w.evaluation.is_some() || w.description.is_some()).then(|| {
            Box::new(DerivationExtra {
                evaluation: w.evaluation,
                description: w.description,
            })
        });
        Ok(DerivationSpec {
            path: w.path,
            expr: w.expr,
            extra,
        })
    }
}

impl JsonSchema for DerivationSpec {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        DerivationWire::<String>::schema_name()
    }

    fn schema_id() -> std::borrow::Cow<'static, str> {
        DerivationWire::<String>::schema_id()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        DerivationWire::<String>::json_schema(g)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetaDerivationSpec {
    /// The field the metadata is about, in canonical JSON Path.
    pub path: String,
    /// The metadata property computed.
    #[schemars(extend("enum" = ["required", "minimum", "maximum", "multipleOf", "minLength", "maxLength", "pattern", "enum", "readOnly", "relevant"]))]
    pub property: String,
    /// JSONata computing the property's value over the merged document. Any JSON token is
    /// accepted: a non-string is used as its JSON text (`100` is the expression `"100"`).
    #[serde(deserialize_with = "stringified")]
    #[schemars(schema_with = "schema::any_token")]
    pub expr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema::require_policy)]
pub struct ConstraintSpec {
    /// Unique constraint id.
    pub id: String,
    /// Absent: global; a string: one field (or per element with `[*]`); an array: several fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<ConstraintPath>,
    /// JSONata boolean over the merged document; `false` is a violation.
    pub expr: String,
    /// What the caller is told when the constraint fails.
    #[serde(default)]
    pub message: String,
    /// `"rollback"`: a violating mutation is undone and fails; `"flag"`: it commits and the
    /// violation is reported in `flaggedConstraints`. Required (the validator rejects a missing
    /// policy; other letter cases are accepted with a warning).
    #[serde(default)]
    #[schemars(extend("enum" = ["rollback", "flag"]))]
    pub policy: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(untagged)]
pub enum ConstraintPath {
    /// One field, in canonical JSON Path (`$.items[*]` checks each element).
    One(String),
    /// Several fields.
    Many(Vec<String>),
}

impl ConstraintPath {
    pub fn paths(&self) -> Vec<&str> {
        match self {
            ConstraintPath::One(p) => vec![p.as_str()],
            ConstraintPath::Many(ps) => ps.iter().map(String::as_str).collect(),
        }
    }
}

/// What a failed constraint does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    Rollback,
    Flag,
}

impl Policy {
    /// Policies are lowercase in the reference; other cases are accepted (the docs show
    /// `ROLLBACK`), anything else is `None`.
    pub fn parse(s: &str) -> Option<Policy> {
        match s.to_ascii_lowercase().as_str() {
            "rollback" => Some(Policy::Rollback),
            "flag" => Some(Policy::Flag),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Rollback => "rollback",
            Policy::Flag => "flag",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EffectSpec {
    /// Unique effect id.
    pub id: String,
    /// Who runs the effect: `caller` (returned to the mutating caller), `server` (HTTP or a
    /// model link, the default), `llm` or `timer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<String>,
    /// JSONata boolean over the merged document; the effect is requested when it is true after
    /// a mutation.
    pub trigger: String,
    /// JSONata edge key: the effect fires again only when this value changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedupe_key: Option<String>,
    /// Canonical address where the runtime keeps the effect's `{phase, key, at, error}` status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_path: Option<String>,
    /// Caller effects: the event name returned to the caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emit: Option<String>,
    /// Payload field → JSONata over the merged document.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Map<String, Json>>,
    /// Server effects: `{method, url, headers, body}`; `{ expr }` segments of url and headers
    /// interpolate JSONata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<Json>,
    /// Server effects: JSONata producing an array of request descriptors (fan-out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<String>,
    /// Server effects: a link to another model, `{ref, path}` (write, with `body`) or
    /// `{ref, read}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<Json>,
    /// With a write-link `target`: JSONata producing the value written at `target.path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// Server effects: a transport binding, `{transport, ...}` (`transport` is required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binding: Option<Json>,
    /// Execution policy: `{timeoutMs, retries, backoff, egressProfile}`; for llm effects
    /// `{model, temperature}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<Json>,
    /// Llm effects: JSONata producing the prompt text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Llm effects: JSON Schema of the structured completion (bound as `$response`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_schema: Option<Json>,
    /// Timer effects: JSONata producing the fire time (epoch ms or ISO-8601).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    /// Timer effects: the delay in milliseconds, as JSONata (a number is accepted too).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "opt_stringified"
    )]
    #[schemars(schema_with = "schema::any_token")]
    pub after_ms: Option<String>,
    /// How the executor's result folds back into the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<EffectResponse>,
    /// Where an inherited effect came from (written when a branch inherits it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Json>,
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: Map<String, Json>,
}

impl EffectSpec {
    pub fn executor(&self) -> &str {
        self.executor.as_deref().unwrap_or("server")
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default, JsonSchema)]
pub struct EffectResponse {
    /// Canonical address → JSONata (`$response` is the executor's result), applied as one
    /// ordinary mutation.
    #[serde(default)]
    pub set: Map<String, Json>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TestCase {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Canonical address → value: the mutation applied to a fresh model.
    pub given: Map<String, Json>,
    /// Canonical address → expected value, or `{"$meta": {property: value}}` to assert
    /// metadata.
    pub expect: Map<String, Json>,
}

/// An incremental change to a live model's spec (`evolve_spec`). Every field is optional.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpecEvolution {
    /// The version after the change (semver).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_version: Option<String>,
    /// Apply only if the live version still equals this (optimistic concurrency).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_version: Option<String>,
    /// Replace the whole document schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::opt_json_schema_value")]
    pub new_schema: Option<Json>,
    /// Replace the whole view definition (absent keeps it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_view_definition: Option<Json>,
    /// Replace the whole `constants` map (absent keeps it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_constants: Option<Map<String, Json>>,
    /// Replace this model's own library layer: absent keeps it, explicit `null` drops it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "double_option"
    )]
    pub new_library: Option<Option<LibrarySpec>>,
    /// Replace the embedded tests wholesale (`[]` clears them; absent keeps them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_tests: Option<Vec<TestCase>>,
    /// Add derivations, or replace those with the same `path`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upsert_derivations: Vec<DerivationSpec>,
    /// Derivation paths to remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_derivations: Vec<String>,
    /// Add constraints, or replace those with the same `id`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upsert_constraints: Vec<ConstraintSpec>,
    /// Constraint ids to remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_constraints: Vec<String>,
    /// Add effects, or replace those with the same `id`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upsert_effects: Vec<EffectSpec>,
    /// Effect ids to remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_effects: Vec<String>,
    /// Add meta-derivations, or replace those with the same `path` and `property`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upsert_meta_derivations: Vec<MetaDerivationSpec>,
    /// Meta-derivations to remove, as `$.path#property` keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_meta_derivations: Vec<String>,
    /// Add default-value rules, or replace those with the same `path`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upsert_default_values: Vec<DefaultValueSpec>,
    /// Default-value rule paths to remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_default_values: Vec<String>,
    /// Schema `$defs` name → definition, replacing (or adding) each one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upsert_schema_defs: Option<Map<String, Json>>,
    /// `$defs` names to remove (rejected while still referenced).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_schema_defs: Vec<String>,
    /// Schema nodes to replace (or create) at canonical data paths.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upsert_schema_nodes: Vec<SchemaNodeUpsert>,
    /// Schema nodes to remove, by canonical data path.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_schema_nodes: Vec<String>,
    /// Set `viewDefinition.defaultView`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_default_view: Option<String>,
    /// Whole views to add, or replace by `id`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upsert_views: Vec<Json>,
    /// View ids to remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_views: Vec<String>,
    /// Components to replace in place (by id) or to place/move.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upsert_components: Vec<ComponentUpsert>,
    /// Components to remove (with their subtrees).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_components: Vec<ComponentRemove>,
    /// Constant name → value, replacing (or adding) each one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upsert_constants: Option<Map<String, Json>>,
    /// Constant names to remove (rejected while an expression reads `$const.<name>`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_constants: Vec<String>,
    /// Canonical address → value written into the live document where it lacks the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backfill: Option<Map<String, Json>>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchemaNodeUpsert {
    /// Canonical data path of the node (`$.order.items[*].qty`); may not cross a `$ref`.
    pub path: String,
    /// The node's new schema, replacing the old one wholesale.
    #[schemars(schema_with = "schema::json_schema_value")]
    pub schema: Json,
    /// `true`/`false` adds/removes the field from its parent's `required`; absent leaves it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required: Option<bool>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComponentUpsert {
    pub view_id: String,
    /// The component (with its `id`, `type` and fields).
    pub component: Json,
    /// The container to place it in (absent: the view root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<String>,
    /// The sibling to place it before (absent: append).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before_id: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComponentRemove {
    pub view_id: String,
    pub component_id: String,
}

/// A meta-derivation property, with the reference's two spellings: the camelCase property name
/// used in specs and `$meta` assertions, and the lowercased enum name used in meta keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MetaProp {
    Required,
    Minimum,
    Maximum,
    MultipleOf,
    MinLength,
    MaxLength,
    Pattern,
    Enum,
    ReadOnly,
    Relevant,
}

impl MetaProp {
    pub const ALL: [MetaProp; 10] = [
        MetaProp::Required,
        MetaProp::Minimum,
        MetaProp::Maximum,
        MetaProp::MultipleOf,
        MetaProp::MinLength,
        MetaProp::MaxLength,
        MetaProp::Pattern,
        MetaProp::Enum,
        MetaProp::ReadOnly,
        MetaProp::Relevant,
    ];

    /// From the spec's `property` (exact camelCase).
    pub fn parse(s: &str) -> Option<MetaProp> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// From either spelling (`readOnly` or `read_only`), as meta keys are written.
    pub fn parse_any(s: &str) -> Option<MetaProp> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s || p.key_name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            MetaProp::Required => "required",
            MetaProp::Minimum => "minimum",
            MetaProp::Maximum => "maximum",
            MetaProp::MultipleOf => "multipleOf",
            MetaProp::MinLength => "minLength",
            MetaProp::MaxLength => "maxLength",
            MetaProp::Pattern => "pattern",
            MetaProp::Enum => "enum",
            MetaProp::ReadOnly => "readOnly",
            MetaProp::Relevant => "relevant",
        }
    }

    /// The key suffix of the reference (`$.score#read_only`).
    pub fn key_name(self) -> &'static str {
        match self {
            MetaProp::MultipleOf => "multiple_of",
            MetaProp::MinLength => "min_length",
            MetaProp::MaxLength => "max_length",
            MetaProp::ReadOnly => "read_only",
            other => other.name(),
        }
    }
}

/// Where in a spec document parsing failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecParseError {
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Json {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("invalid spec at {location}: {message}")]
    Shape { location: String, message: String },
}

impl SpecParseError {
    /// The `{location, message}` finding `validate_spec` reports for it.
    pub fn location(&self) -> String {
        match self {
            SpecParseError::Json { line, column, .. } => format!("line {line}, column {column}"),
            SpecParseError::Shape { location, .. } => location.clone(),
        }
    }

    pub fn message(&self) -> String {
        match self {
            SpecParseError::Json { message, .. } => format!("invalid JSON: {message}"),
            SpecParseError::Shape { message, .. } => message.clone(),
        }
    }
}

/// Parse spec text, reporting bad JSON by line and column.
pub fn parse_spec_text(text: &str) -> Result<ModelSpec, SpecParseError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let json: Json = serde_json::from_str(text).map_err(|e| SpecParseError::Json {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    parse_spec(&json)
}

/// Parse a spec straight from its JSON text, when it is well formed (no intermediate JSON
/// value: the fast path for a request body); `None` when it is not, and the caller takes
/// [`parse_spec`]'s path for the located error (also for what only that path accepts, such
/// as a key given twice).
pub fn parse_spec_slice(bytes: &[u8]) -> Option<ModelSpec> {
    serde_json::from_slice(bytes).ok()
}

/// A JSON object's text that opens with an `id` member holding a string, split into that
/// string and the text after the comma that follows it (`{"id":"quote-17","schema":…}` gives
/// `quote-17` and `"schema":…}`); `None` for any other text. Two such texts with the same rest
/// are the same spec but for the id.
pub fn split_leading_id(bytes: &[u8]) -> Option<(String, &[u8])> {
    let ws = |mut i: usize| {
        while bytes
            .get(i)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            i += 1;
        }
        i
    };
    let expect = |i: usize, token: &[u8]| {
        bytes
            .get(i..i + token.len())
            .filter(|t| *t == token)
            .map(|_| i + token.len())
    };
    let i = expect(ws(0), b"{")?;
    let i = expect(ws(i), b"\"id\"")?;
    let start = ws(expect(ws(i), b":")?);
    if bytes.get(start) != Some(&b'"') {
        return None;
    }
    let mut end = start + 1;
    loop {
        match *bytes.get(end)? {
            b'"' => break,
            b'\\' => end += 2,
            _ => end += 1,
        }
    }
    let id: String = serde_json::from_slice(bytes.get(start..=end)?).ok()?;
    let rest = expect(ws(end + 1), b",")?;
    Some((id, bytes.get(rest..)?))
}

/// Parse a spec JSON value, reporting shape errors by their location (`derivations[0].expr`).
pub fn parse_spec(json: &Json) -> Result<ModelSpec, SpecParseError> {
    parse_located(json)
}

/// Parse a SpecEvolution JSON value.
pub fn parse_evolution(json: &Json) -> Result<SpecEvolution, SpecParseError> {
    parse_located(json)
}

/// [`parse_evolution`] for a live model, with its keys checked: an evolution that names no
/// change and has keys the SpecEvolution does not know (`addDerivations`) is refused, naming
/// them — it would apply nothing while its author believes it applied. Unknown keys beside a
/// change are ignored and reported as warnings; so is an evolution that changes nothing.
pub fn parse_evolution_checked(
    json: &Json,
) -> Result<(SpecEvolution, Vec<Finding>), SpecParseError> {
    let evo = parse_evolution(json)?;
    let unknown: Vec<&str> = json
        .as_object()
        .map(|m| {
            m.keys()
                .map(String::as_str)
                .filter(|k| !evolution_keys().iter().any(|known| known == k))
                .collect()
        })
        .unwrap_or_default();
    let about = |k: &str| match suggest_key(k) {
        Some(s) => format!("`{k}` is not a SpecEvolution key (did you mean {s}?)"),
        None => format!("`{k}` is not a SpecEvolution key"),
    };
    if !evo.names_a_change() && !unknown.is_empty() {
        let named: Vec<String> = unknown.iter().map(|k| about(k)).collect();
        return Err(SpecParseError::Shape {
            location: unknown[0].to_string(),
            message: format!(
                "the evolution names no change, nothing was applied: {}. The keys are: {}",
                named.join("; "),
                evolution_keys().join(", ")
            ),
        });
    }
    let mut warnings: Vec<Finding> = unknown
        .iter()
        .map(|k| Finding {
            location: k.to_string(),
            message: format!("{}; ignored", about(k)),
        })
        .collect();
    if !evo.names_a_change() {
        warnings.push(Finding {
            location: "evolution".into(),
            message: "the evolution names no change; the model was left as it was".into(),
        });
    }
    Ok((evo, warnings))
}

/// The top-level keys of a SpecEvolution, as its JSON Schema lists them.
pub fn evolution_keys() -> &'static [String] {
    static KEYS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| {
        schema::spec_evolution_schema()
            .get("properties")
            .and_then(Json::as_object)
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default()
    })
}

/// The known keys an unknown one was probably meant as: the same key spelt in another case or
/// with `_`/`-`, else one within two typos (`newVersoin`), else those about the same section
/// (`addDerivations` → `upsertDerivations` or `removeDerivations`).
fn suggest_key(unknown: &str) -> Option<String> {
    let norm = |s: &str| -> String {
        s.chars()
            .filter(|c| *c != '_' && *c != '-')
            .flat_map(char::to_lowercase)
            .collect()
    };
    let keys = evolution_keys();
    let n = norm(unknown);
    if let Some((_, k)) = keys
        .iter()
        .map(|k| (typos(&norm(k), &n), k))
        .min_by_key(|(d, _)| *d)
        .filter(|(d, _)| *d <= 2)
    {
        return Some(format!("`{k}`"));
    }
    // The section a camelCase key is about: what follows its leading verb, singular.
    let section = |s: &str| -> Option<String> {
        let i = s.find(|c: char| c.is_ascii_uppercase())?;
        Some(norm(&s[i..]).trim_end_matches('s').to_string())
    };
    let want = section(unknown)?;
    let same: Vec<String> = keys
        .iter()
        .filter(|k| section(k).as_deref() == Some(want.as_str()))
        .map(|k| format!("`{k}`"))
        .collect();
    (!same.is_empty()).then(|| same.join(" or "))
}

/// The edits (insertion, deletion, substitution, swap of neighbours) from `a` to `b`.
fn typos(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // Rows i-2, i-1 and i of the distance table.
    let mut prev2 = vec![0; b.len() + 1];
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        cur[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            cur[j] = (prev[j] + 1).min(cur[j - 1] + 1).min(prev[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                cur[j] = cur[j].min(prev2[j - 2] + 1);
            }
        }
        std::mem::swap(&mut prev2, &mut prev);
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

impl SpecEvolution {
    /// Whether it asks for any change: `expectedVersion` is a precondition, not a change.
    pub fn names_a_change(&self) -> bool {
        // Destructured so that a new field has to be counted here.
        let SpecEvolution {
            new_version,
            expected_version: _,
            new_schema,
            new_view_definition,
            new_constants,
            new_library,
            new_tests,
            upsert_derivations,
            remove_derivations,
            upsert_constraints,
            remove_constraints,
            upsert_effects,
            remove_effects,
            upsert_meta_derivations,
            remove_meta_derivations,
            upsert_default_values,
            remove_default_values,
            upsert_schema_defs,
            remove_schema_defs,
            upsert_schema_nodes,
            remove_schema_nodes,
            new_default_view,
            upsert_views,
            remove_views,
            upsert_components,
            remove_components,
            upsert_constants,
            remove_constants,
            backfill,
        } = self;
        new_version.is_some()
            || new_schema.is_some()
            || new_view_definition.is_some()
            || new_constants.is_some()
            || new_library.is_some()
            || new_tests.is_some()
            || !upsert_derivations.is_empty()
            || !remove_derivations.is_empty()
            || !upsert_constraints.is_empty()
            || !remove_constraints.is_empty()
            || !upsert_effects.is_empty()
            || !remove_effects.is_empty()
            || !upsert_meta_derivations.is_empty()
            || !remove_meta_derivations.is_empty()
            || !upsert_default_values.is_empty()
            || !remove_default_values.is_empty()
            || upsert_schema_defs.as_ref().is_some_and(|m| !m.is_empty())
            || !remove_schema_defs.is_empty()
            || !upsert_schema_nodes.is_empty()
            || !remove_schema_nodes.is_empty()
            || new_default_view.is_some()
            || !upsert_views.is_empty()
            || !remove_views.is_empty()
            || !upsert_components.is_empty()
            || !remove_components.is_empty()
            || upsert_constants.as_ref().is_some_and(|m| !m.is_empty())
            || !remove_constants.is_empty()
            || backfill.as_ref().is_some_and(|m| !m.is_empty())
    }
}

fn parse_located<T: serde::de::DeserializeOwned>(json: &Json) -> Result<T, SpecParseError> {
    if !json.is_object() {
        return Err(SpecParseError::Shape {
            location: "spec".into(),
            message: format!("expected a JSON object, found {}", kind_of(json)),
        });
    }
    serde_path_to_error::deserialize(json).map_err(|e| {
        let path = e.path().to_string();
        SpecParseError::Shape {
            location: if path == "." { "spec".into() } else { path },
            message: e.into_inner().to_string(),
        }
    })
}

/// "a string", "an object", …: a JSON value's kind for error messages.
pub fn kind_of(j: &Json) -> &'static str {
    match j {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// A list in an allocation of its own length: a list serde cannot count ahead grows by
/// doubling, and a large spec's would otherwise keep up to as much room again as it holds
/// (1.1M derivations: 2M places of 64 bytes).
fn exact<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    let mut list = Vec::<T>::deserialize(d)?;
    if list.capacity() - list.len() > list.len() / 8 {
        let mut exact = Vec::with_capacity(list.len());
        exact.append(&mut list);
        return Ok(exact);
    }
    Ok(list)
}

fn stringified<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let j = Json::deserialize(d)?;
    Ok(match j {
        Json::String(s) => s,
        other => other.to_string(),
    })
}

fn opt_stringified<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let j = Option::<Json>::deserialize(d)?;
    Ok(j.map(|j| match j {
        Json::String(s) => s,
        other => other.to_string(),
    }))
}

fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

fn double_option<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<LibrarySpec>>, D::Error> {
    Ok(Some(Option::<LibrarySpec>::deserialize(d)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec's derivations are kept in an allocation of their own length, however many
    /// there are (serde grew the list by doubling and kept the room).
    #[test]
    fn derivations_are_kept_without_spare_room() {
        for n in [0, 1, 100, 1000, 4097] {
            let derivations: Vec<Json> = (0..n)
                .map(|i| serde_json::json!({"path": format!("$.d{i}"), "expr": "x"}))
                .collect();
            let j = serde_json::json!({"id": "m", "schema": {}, "derivations": derivations});
            for spec in [
                parse_spec(&j).unwrap(),
                parse_spec_slice(j.to_string().as_bytes()).unwrap(),
            ] {
                let d = &spec.derivations;
                assert_eq!(d.len(), n);
                assert!(
                    d.capacity() <= n + n / 8,
                    "n = {n}: room for {}",
                    d.capacity()
                );
            }
        }
    }
    use serde_json::json;

    #[test]
    fn split_leading_id_takes_only_an_opening_id_string() {
        let split = |t: &str| {
            split_leading_id(t.as_bytes())
                .map(|(id, rest)| (id, String::from_utf8_lossy(rest).into_owned()))
        };
        assert_eq!(
            split(r#"{"id":"a","schema":{}}"#),
            Some(("a".into(), r#""schema":{}}"#.into()))
        );
        assert_eq!(
            split(" {\n\t\"id\" : \"a\\\"b\\u0063\" ,\"x\":1}"),
            Some(("a\"bc".into(), r#""x":1}"#.into()))
        );
        for t in [
            r#"{"schema":{},"id":"a"}"#,
            r#"{"id":"a"}"#,
            r#"{"id":7,"x":1}"#,
            r#"{"id":"a"#,
            r#"{"id":"a\"#,
            r#"{"id":"\q","x":1}"#,
            r#"["id","a",1]"#,
            r#"{"idx":"a","x":1}"#,
            "",
        ] {
            assert_eq!(split(t), None, "{t}");
        }
    }

    #[test]
    fn evolution_keys_are_checked() {
        let refused = |j: Json| match parse_evolution_checked(&j) {
            Err(e) => (e.location(), e.message()),
            Ok(r) => panic!("accepted {j}: {r:?}"),
        };
        let (at, m) = refused(json!({"addDerivations": [{"path": "$.a", "expr": "1"}]}));
        assert_eq!(at, "addDerivations");
        assert!(
            m.contains("did you mean `upsertDerivations` or `removeDerivations`?"),
            "{m}"
        );
        assert!(m.contains("upsertSchemaNodes"), "the keys are listed: {m}");
        let (_, m) = refused(json!({"expectedVersion": "1.0.0", "UpsertConstraints": []}));
        assert!(m.contains("did you mean `upsertConstraints`?"), "{m}");
        let (_, m) = refused(json!({"newVersoin": "2.0.0", "upsertDerivations": []}));
        assert!(m.contains("did you mean `newVersion`?"), "{m}");
        let (_, m) = refused(json!({"zzz": 1}));
        assert!(m.contains("`zzz` is not a SpecEvolution key. "), "{m}");

        let (evo, w) =
            parse_evolution_checked(&json!({"newVersion": "2.0.0", "bogus": 1})).unwrap();
        assert_eq!(evo.new_version.as_deref(), Some("2.0.0"));
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].location, "bogus");
        let (_, w) = parse_evolution_checked(&json!({"expectedVersion": "1.0.0"})).unwrap();
        assert_eq!(w[0].location, "evolution");
        let (_, w) = parse_evolution_checked(&json!({"newLibrary": null})).unwrap();
        assert!(w.is_empty(), "dropping the library is a change: {w:?}");
        // Every key the schema lists is known.
        assert!(evolution_keys().len() >= 29);
        assert_eq!(typos("newversion", "newversoin"), 1);
        assert_eq!(typos("abc", ""), 3);
    }

    #[test]
    fn parses_the_worked_example() {
        let s = parse_spec(&json!({"id":"demo","version":"1","schema":{},
            "derivations":[{"path":"$.total","expr":"price * qty"}],
            "constraints":[],"metaDerivations":[],"tests":[]}))
        .unwrap();
        assert_eq!(&*s.derivations[0].expr, "price * qty");
        assert_eq!(s.version_or_default(), "1");
    }

    #[test]
    fn shape_errors_name_the_location() {
        let e = parse_spec(&json!({"id":"x","schema":{},"derivations":[{"path":"$.a","expr":3}]}))
            .unwrap_err();
        assert_eq!(e.location(), "derivations[0].expr");
        let e = parse_spec_text("{\"id\": \"x\",\n \"schema\": }").unwrap_err();
        assert!(matches!(e, SpecParseError::Json { line: 2, .. }), "{e}");
    }

    #[test]
    fn meta_expr_accepts_any_token_and_library_forms() {
        let s = parse_spec(&json!({"id":"x","schema":{},
            "metaDerivations":[{"path":"$.a","property":"maximum","expr":100}],
            "library":"( $f := function($x){$x}; [\"f\"] )"}))
        .unwrap();
        assert_eq!(s.meta_derivations[0].expr, "100");
        assert_eq!(s.library_layers().len(), 1);
        let s = parse_spec(&json!({"id":"x","schema":{},
            "library":{"layers":[{"define":"a"},{"define":"b"}]}}))
        .unwrap();
        assert_eq!(s.library_layers().len(), 2);
    }

    #[test]
    fn evolution_distinguishes_null_library() {
        let e = parse_evolution(&json!({"newLibrary": null})).unwrap();
        assert_eq!(e.new_library, Some(None));
        let e = parse_evolution(&json!({})).unwrap();
        assert_eq!(e.new_library, None);
    }

    #[test]
    fn meta_prop_spellings() {
        assert_eq!(MetaProp::parse_any("read_only"), Some(MetaProp::ReadOnly));
        assert_eq!(MetaProp::parse("readOnly").unwrap().key_name(), "read_only");
        assert_eq!(MetaProp::parse("read_only"), None);
    }
}
