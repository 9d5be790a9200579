//! The spec validator behind `validate_spec` and `valem spec validate`: structural rules of the
//! reference (ids, versions, canonical addresses, duplicates, policies, `$ref` forms, library
//! rules, effects, views, lineage), then a full compile for expression errors (with positions),
//! unresolvable `$function` calls and dependency cycles. Never evaluates a model.

mod sections;

use sections::*;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value as Json};

use crate::compile::{self, BUILTINS};
use crate::EngineLimits;
use valem_core::expr::deps;
use valem_core::expr::path::Address;
use valem_core::expr::{Compiled, Limits, RESERVED};
use valem_core::spec::{parse_spec, MetaProp, ModelSpec, Policy};

pub use valem_core::spec::Finding;

/// The `validate_spec` result.
#[derive(Clone, Debug, PartialEq, Serialize, Default, JsonSchema)]
pub struct Report {
    /// No errors (warnings do not make a spec invalid).
    pub valid: bool,
    pub errors: Vec<Finding>,
    pub warnings: Vec<Finding>,
}

/// Library limits of the reference (`library-max-chars`, `library-max-exports`, `-max-layers`).
pub const LIBRARY_MAX_CHARS: usize = 20_000;
pub const LIBRARY_MAX_EXPORTS: usize = 64;
pub const LIBRARY_MAX_LAYERS: usize = 8;

/// Component types of the view catalog.
pub const COMPONENT_TYPES: &[&str] = &[
    "textField",
    "textAreaField",
    "numericField",
    "passwordField",
    "emailField",
    "checkboxField",
    "toggleField",
    "selectField",
    "radioField",
    "multiSelectField",
    "dateField",
    "dateTimeField",
    "timeField",
    "sliderField",
    "fileUploadField",
    "countrySelector",
    "countryRegionSelector",
    "phoneNumberField",
    "currencyField",
    "percentField",
    "richTextField",
    "autocompleteField",
    "comboBox",
    "tagsField",
    "dateRangeField",
    "ratingField",
    "numericStepper",
    "label",
    "staticText",
    "badge",
    "separatorLine",
    "progressBar",
    "dataTable",
    "dataChart",
    "alert",
    "callout",
    "spacer",
    "image",
    "link",
    "sparkline",
    "gauge",
    "keyValueList",
    "summaryList",
    "statTile",
    "metric",
    "jsonViewer",
    "explainPanel",
    "auditTimeline",
    "validationSummary",
    "effectStatus",
    "group",
    "fieldSet",
    "sectionList",
    "sectionItem",
    "card",
    "toolbar",
    "buttonGroup",
    "tabs",
    "tabItem",
    "collapsible",
    "accordion",
    "button",
    "menu",
    "stepper",
    "breadcrumb",
    "chart",
    "tracePanel",
    "slider",
];

/// Component fields always evaluated as JSONata when they are strings.
const COMPONENT_BOOL_EXPR_FIELDS: [&str; 4] = ["visible", "enabled", "readOnly", "required"];
/// Display fields evaluated as JSONata only when the string contains a `$` (else literal text).
const COMPONENT_TEXT_EXPR_FIELDS: [&str; 5] = ["text", "value", "delta", "caption", "trend"];

const KNOWN_EXECUTORS: [&str; 4] = ["caller", "server", "llm", "timer"];
const TOP_LEVEL: [&str; 16] = [
    "id",
    "version",
    "template",
    "lineage",
    "schema",
    "constants",
    "library",
    "defaultValues",
    "derivations",
    "metaDerivations",
    "constraints",
    "effects",
    "tests",
    "viewDefinition",
    "initialState",
    "actions",
];

struct V {
    errors: Vec<Finding>,
    warnings: Vec<Finding>,
}

impl V {
    fn err(&mut self, location: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Finding {
            location: location.into(),
            message: message.into(),
        });
    }
    fn warn(&mut self, location: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Finding {
            location: location.into(),
            message: message.into(),
        });
    }

    fn address(&mut self, location: &str, text: &str) -> Option<Address> {
        match Address::parse(text) {
            Ok(a) => Some(a),
            Err(e) => {
                self.err(location, e.message);
                None
            }
        }
    }

    fn nonblank(&mut self, location: &str, field: &str, value: &str) -> bool {
        if value.trim().is_empty() {
            self.err(location, format!("{field} is required"));
            false
        } else {
            true
        }
    }
}

/// Validate a spec given as JSON (the form `validate_spec` receives).
pub fn validate_json(json: &Json, limits: &EngineLimits) -> Report {
    let mut v = V {
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    if let Some(obj) = json.as_object() {
        for k in obj.keys() {
            if !TOP_LEVEL.contains(&k.as_str()) {
                v.warn(k.clone(), format!("unknown field `{k}` is ignored"));
            }
        }
    }
    match parse_spec(json) {
        Ok(spec) => check(&spec, &mut v, limits),
        Err(e) => v.err(e.location(), e.message()),
    }
    finish(v)
}

/// Validate a parsed spec.
pub fn validate(spec: &ModelSpec, limits: &EngineLimits) -> Report {
    validate_hashed(spec, None, limits)
}

/// [`validate`], with the spec's [`content_hash`](crate::content_hash) when already known.
pub fn validate_hashed(spec: &ModelSpec, hash: Option<[u8; 32]>, limits: &EngineLimits) -> Report {
    let mut v = V {
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    // Only the identity checks (and lineage, which names ids: not cached) read the id, so a
    // spec whose content was found valid before needs only those (creating many models of one
    // spec then compiles it once, not once per model).
    let key = spec
        .lineage
        .is_empty()
        .then(|| valid_key(spec, hash, limits));
    if let Some(known) = key.as_ref().and_then(known_valid) {
        check_identity(spec, &mut v);
        v.warnings.extend(known.warnings);
        return finish(v);
    }
    check(spec, &mut v, limits);
    let report = finish(v);
    if let (Some(k), true) = (key, report.valid) {
        remember_valid(k, &report);
    }
    report
}

/// Reports of valid spec contents, by [`valid_key`]: bounded, emptied when full.
static VALID: std::sync::Mutex<Option<HashMap<[u8; 32], Report>>> = std::sync::Mutex::new(None);
const VALID_CACHE_SIZE: usize = 1024;

/// A spec's content (its id aside) and the limits it is validated under.
fn valid_key(spec: &ModelSpec, hash: Option<[u8; 32]>, limits: &EngineLimits) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&hash.unwrap_or_else(|| crate::content_hash(spec, limits.jit.enabled)));
    h.update(format!("{limits:?}").as_bytes());
    *h.finalize().as_bytes()
}

fn known_valid(key: &[u8; 32]) -> Option<Report> {
    let cache = VALID.lock().ok()?;
    cache.as_ref()?.get(key).cloned()
}

fn remember_valid(key: [u8; 32], report: &Report) {
    if let Ok(mut cache) = VALID.lock() {
        let map = cache.get_or_insert_with(HashMap::new);
        if map.len() >= VALID_CACHE_SIZE {
            map.clear();
        }
        map.insert(key, report.clone());
    }
}

fn finish(mut v: V) -> Report {
    dedupe(&mut v.errors);
    dedupe(&mut v.warnings);
    Report {
        valid: v.errors.is_empty(),
        errors: v.errors,
        warnings: v.warnings,
    }
}

fn dedupe(f: &mut Vec<Finding>) {
    let mut seen = HashSet::new();
    f.retain(|x| seen.insert(x.clone()));
}

/// `[namespace/]name`, each segment a letter then letters, digits, `-`, `_`.
pub fn valid_coordinate(id: &str) -> bool {
    let segs: Vec<&str> = id.split('/').collect();
    segs.len() <= 2
        && segs.iter().all(|s| {
            let mut c = s.chars();
            matches!(c.next(), Some(f) if f.is_ascii_alphabetic())
                && c.all(|x| x.is_ascii_alphanumeric() || x == '-' || x == '_')
        })
}

/// `MAJOR.MINOR.PATCH` with optional `-pre` and `+build`.
pub fn valid_semver(v: &str) -> bool {
    let core = v.split(['+', '-']).next().unwrap_or("");
    let rest_ok = v[core.len()..]
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '+');
    let parts: Vec<&str> = core.split('.').collect();
    rest_ok
        && parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.chars().all(|c| c.is_ascii_digit())
                && (p.len() == 1 || !p.starts_with('0'))
        })
}

fn check(spec: &ModelSpec, v: &mut V, limits: &EngineLimits) {
    check_identity(spec, v);
    check_schema(spec, v);
    check_constants(spec, v);
    let exports = check_library(spec, v, &limits.expr);
    check_derivations(spec, v);
    check_meta(spec, v);
    check_constraints(spec, v);
    check_default_values(spec, v);
    check_effects(spec, v);
    check_tests(spec, v);
    check_view(spec, v);
    check_lineage(spec, v);

    // Expressions: names, dynamic lookups, then the full compile (errors with positions, cycles).
    check_names(spec, &exports, v, &limits.expr);
    if v.errors.is_empty() {
        if let Err(errs) = compile::compile(Arc::new(spec.clone()), limits) {
            for e in errs {
                v.err(e.location, e.message);
            }
        }
    }
}

/// The spec's identity and its removed fields (`initialState`, `actions`).
/// What is wrong with `id` as a model's id, if anything: the one check of a spec that reads
/// its id (so a copy of a valid spec under another id needs only this one).
pub fn check_id(id: &str) -> Option<Finding> {
    let message = if id.trim().is_empty() {
        "id is required".to_string()
    } else if id.contains('@') || !valid_coordinate(id) {
        format!("id `{id}` is not a model coordinate: `[namespace/]name`, each part starting with a letter, then letters, digits, `-` or `_`")
    } else {
        return None;
    };
    Some(Finding {
        location: "id".into(),
        message,
    })
}

fn check_identity(spec: &ModelSpec, v: &mut V) {
    if let Some(f) = check_id(&spec.id) {
        v.errors.push(f);
    }
    if let Some(ver) = &spec.version {
        // A warning, not an error: the MCP contract's worked example creates a model with
        // version "1" and must succeed (the reference's validator refuses it).
        if !ver.trim().is_empty() && !valid_semver(ver) {
            v.warn(
                "version",
                format!("version `{ver}` is not semver (MAJOR.MINOR.PATCH, e.g. `1.0.0`); evolutions and comparisons treat it as an opaque string"),
            );
        }
    }
    if spec.initial_state.as_ref().is_some_and(non_empty) {
        v.err(
            "initialState",
            "initialState has been removed; declare a defaultValues rule with path \"$\" whose expr returns the seed object",
        );
    }
    if spec.actions.as_ref().is_some_and(non_empty) {
        v.err(
            "actions",
            "actions has been removed; declare an effect with executor \"caller\" (emit + payload) instead",
        );
    }
}

/// Derivations: a path and an expression each, no duplicate or root target, a known evaluation mode.
fn check_derivations(spec: &ModelSpec, v: &mut V) {
    let mut seen = HashSet::new();
    for (i, d) in spec.derivations.iter().enumerate() {
        let loc = format!("derivations[{i}]");
        if v.nonblank(&format!("{loc}.path"), "path", &d.path) {
            if let Some(a) = v.address(&format!("{loc}.path"), &d.path) {
                if a.is_root() {
                    v.err(
                        format!("{loc}.path"),
                        "a derivation cannot target the root `$`",
                    );
                }
                if !seen.insert(a.to_string()) {
                    v.err(
                        format!("{loc}.path"),
                        format!("duplicate derivation path `{a}`"),
                    );
                }
            }
        }
        v.nonblank(&format!("{loc}.expr"), "expr", &d.expr);
        if let Some(e) = d.evaluation() {
            if !matches!(e, "eager" | "lazy") {
                v.err(
                    format!("{loc}.evaluation"),
                    format!("evaluation must be \"eager\" or \"lazy\", found `{e}`"),
                );
            }
        }
    }
}

/// Meta-derivations: an expression, a known property, a path, no duplicate (path, property).
fn check_meta(spec: &ModelSpec, v: &mut V) {
    let mut seen = HashSet::new();
    for (i, m) in spec.meta_derivations.iter().enumerate() {
        let loc = format!("metaDerivations[{i}]");
        v.nonblank(&format!("{loc}.expr"), "expr", &m.expr);
        let prop = if v.nonblank(&format!("{loc}.property"), "property", &m.property) {
            let p = MetaProp::parse(&m.property);
            if p.is_none() {
                v.err(
                    format!("{loc}.property"),
                    format!(
                        "unknown meta property `{}`; expected one of: {}",
                        m.property,
                        MetaProp::ALL.map(MetaProp::name).join(", ")
                    ),
                );
            }
            p
        } else {
            None
        };
        if !v.nonblank(&format!("{loc}.path"), "path", &m.path) {
            continue;
        }
        let Some(a) = v.address(&format!("{loc}.path"), &m.path) else {
            continue;
        };
        if let Some(p) = prop {
            let key = format!("{a}#{}", p.key_name());
            if !seen.insert(key.clone()) {
                v.err(loc.clone(), format!("duplicate meta-derivation `{key}`"));
            }
            check_meta_type(spec, &a, p, &loc, v);
        }
    }
}

/// Constraints: a unique id, an expression and a policy (`rollback` or `flag`) each.
fn check_constraints(spec: &ModelSpec, v: &mut V) {
    let mut seen = HashSet::new();
    for (i, c) in spec.constraints.iter().enumerate() {
        let loc = format!("constraints[{i}]");
        if v.nonblank(&format!("{loc}.id"), "id", &c.id) && !seen.insert(c.id.clone()) {
            v.err(
                format!("{loc}.id"),
                format!("duplicate constraint id `{}`", c.id),
            );
        }
        v.nonblank(&format!("{loc}.expr"), "expr", &c.expr);
        if c.policy.trim().is_empty() {
            v.err(
                format!("{loc}.policy"),
                "policy is required (rollback | flag)",
            );
        } else if Policy::parse(&c.policy).is_none() {
            v.err(
                format!("{loc}.policy"),
                format!(
                    "policy must be \"rollback\" or \"flag\", found `{}`",
                    c.policy
                ),
            );
        } else if c.policy != c.policy.to_ascii_lowercase() {
            v.warn(
                format!("{loc}.policy"),
                format!(
                    "policy `{}` is accepted, but the canonical spelling is lowercase",
                    c.policy
                ),
            );
        }
        if c.message.trim().is_empty() {
            v.warn(
                format!("{loc}.message"),
                "constraint has an empty message; agents see it when the constraint fails",
            );
        }
        if let Some(p) = &c.path {
            for (j, t) in p.paths().into_iter().enumerate() {
                v.address(&format!("{loc}.path[{j}]"), t);
            }
        }
    }
}

/// `defaultValues`: a path and an expression each, no duplicate path.
fn check_default_values(spec: &ModelSpec, v: &mut V) {
    let mut seen = HashSet::new();
    for (i, d) in spec.default_values.iter().enumerate() {
        let loc = format!("defaultValues[{i}]");
        v.nonblank(&format!("{loc}.expr"), "expr", &d.expr);
        if v.nonblank(&format!("{loc}.path"), "path", &d.path) {
            if let Some(a) = v.address(&format!("{loc}.path"), &d.path) {
                if !seen.insert(a.to_string()) {
                    v.err(
                        format!("{loc}.path"),
                        format!("duplicate defaultValues path `{a}`"),
                    );
                }
            }
        }
    }
}

fn non_empty(j: &Json) -> bool {
    match j {
        Json::Null => false,
        Json::Object(m) => !m.is_empty(),
        Json::Array(a) => !a.is_empty(),
        _ => true,
    }
}

fn check_schema(spec: &ModelSpec, v: &mut V) {
    let schema = &spec.schema;
    if !schema.is_object() && !schema.is_boolean() {
        v.err("schema", "schema must be a JSON Schema object");
        return;
    }
    let defs: BTreeSet<String> = schema
        .get("$defs")
        .and_then(Json::as_object)
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let mut used = BTreeSet::new();
    walk_refs(schema, "schema", &defs, &mut used, v, 0);
    for d in defs.difference(&used) {
        v.warn(
            format!("schema.$defs.{d}"),
            format!("definition `{d}` is not referenced by any $ref"),
        );
    }
    if v.errors.iter().all(|e| !e.location.starts_with("schema")) {
        if let Err(e) = jsonschema::validator_for(schema) {
            v.err("schema", format!("schema is not a valid JSON Schema: {e}"));
        }
    }
}

fn walk_refs(
    node: &Json,
    loc: &str,
    defs: &BTreeSet<String>,
    used: &mut BTreeSet<String>,
    v: &mut V,
    depth: usize,
) {
    if depth > 64 {
        return;
    }
    match node {
        Json::Object(m) => {
            if let Some(r) = m.get("$ref") {
                match r.as_str().and_then(|s| s.strip_prefix("#/$defs/")) {
                    Some(name) if defs.contains(name) => {
                        used.insert(name.to_string());
                    }
                    Some(name) => v.err(format!("{loc}.$ref"), format!("$ref `#/$defs/{name}` points at no definition")),
                    None => v.err(
                        format!("{loc}.$ref"),
                        format!("$ref {r} is not supported: only local references of the form `#/$defs/<Name>`"),
                    ),
                }
                let others: Vec<&String> =
                    m.keys().filter(|k| *k != "$ref" && *k != "$defs").collect();
                if !others.is_empty() {
                    v.warn(
                        loc.to_string(),
                        format!(
                            "keywords beside $ref are ignored: {}",
                            others
                                .iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    );
                }
            }
            for (k, x) in m {
                walk_refs(x, &format!("{loc}.{k}"), defs, used, v, depth + 1);
            }
        }
        Json::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                walk_refs(x, &format!("{loc}[{i}]"), defs, used, v, depth + 1);
            }
        }
        _ => {}
    }
}

fn check_constants(spec: &ModelSpec, v: &mut V) {
    for k in spec.constants.keys() {
        if !is_plain_identifier(k) {
            v.warn(
                format!("constants.{k}"),
                format!("constant name `{k}` is not a simple identifier; reference it as $const.\"{k}\""),
            );
        }
    }
}

fn is_plain_identifier(k: &str) -> bool {
    let mut c = k.chars();
    matches!(c.next(), Some(f) if f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

/// Library rules; returns the names it exports (for call resolution).
fn check_library(spec: &ModelSpec, v: &mut V, limits: &Limits) -> BTreeSet<String> {
    let layers = spec.library_layers();
    let mut exports = BTreeSet::new();
    if layers.len() > LIBRARY_MAX_LAYERS {
        v.err(
            "library",
            format!(
                "{} library layers; the limit is {LIBRARY_MAX_LAYERS}",
                layers.len()
            ),
        );
    }
    for (i, layer) in layers.iter().enumerate() {
        let loc = if layers.len() == 1 {
            "library.define".to_string()
        } else {
            format!("library.layers[{i}].define")
        };
        if layer.define.trim().is_empty() {
            v.err(loc, "library define is required");
            continue;
        }
        if layer.define.chars().count() > LIBRARY_MAX_CHARS {
            v.err(
                &loc,
                format!("library definition is longer than {LIBRARY_MAX_CHARS} characters"),
            );
            continue;
        }
        let compiled = match Compiled::compile(&layer.define, limits) {
            Ok(c) => c,
            Err(e) => {
                let at = e.at();
                v.err(
                    &loc,
                    format!("library definition does not compile{at}: {}", e.message),
                );
                continue;
            }
        };
        if deps::touches_document(compiled.ast()) {
            v.err(
                &loc,
                "library definition reads the model document (a field name, `$`, `$$`, `*` or `**`); library functions compute only from their arguments and $const — pass document values in at the call site",
            );
        }
        for f in ["now", "millis", "random"] {
            if compiled.calls.contains(f) {
                v.err(&loc, format!("library definition calls ${f}(): it runs once at compile time, so the value would be frozen"));
            }
        }
        let env = valem_core::expr::Env {
            vars: vec![(
                std::rc::Rc::from("const"),
                valem_core::expr::json_to_jvalue(&Json::Object(spec.constants.clone())),
            )],
            now_ms: None,
        };
        match compile::eval_library_layer(&layer.define, &env, limits) {
            Ok(bound) => {
                if bound.len() > LIBRARY_MAX_EXPORTS {
                    v.warn(&loc, format!("{} exports; more than {LIBRARY_MAX_EXPORTS} make a library hard to use", bound.len()));
                }
                for (name, _) in bound {
                    if !is_plain_identifier(&name) {
                        v.err(&loc, format!("export `{name}` is not a simple identifier"));
                    } else if BUILTINS.contains(&name.as_str()) {
                        v.err(&loc, format!("export `{name}` shadows the JSONata built-in ${name}, which would always win"));
                    } else if RESERVED.contains(&name.as_str()) {
                        v.err(
                            &loc,
                            format!(
                                "export `{name}` collides with ${name}, which Valem binds itself"
                            ),
                        );
                    }
                    exports.insert(name);
                }
            }
            Err(m) => v.err(&loc, m),
        }
    }
    exports
}

fn check_meta_type(spec: &ModelSpec, a: &Address, p: MetaProp, loc: &str, v: &mut V) {
    let Some(segs) = schema_node(&spec.schema, a) else {
        return;
    };
    let Some(ty) = segs.get("type").and_then(Json::as_str) else {
        return;
    };
    let ok = match p {
        MetaProp::Minimum | MetaProp::Maximum | MetaProp::MultipleOf => {
            matches!(ty, "number" | "integer")
        }
        MetaProp::MinLength | MetaProp::MaxLength | MetaProp::Pattern => ty == "string",
        MetaProp::Enum => matches!(ty, "number" | "integer" | "string" | "boolean"),
        _ => true,
    };
    if !ok {
        v.err(
            format!("{loc}.property"),
            format!(
                "meta property `{}` does not apply to {a}, whose schema type is `{ty}`",
                p.name()
            ),
        );
    }
}

/// The schema node for an address pattern (following properties/items and local $refs).
fn schema_node<'a>(root: &'a Json, a: &Address) -> Option<&'a Map<String, Json>> {
    use valem_core::expr::path::PathSeg;
    let mut node = crate::schema::resolve(root, root);
    for s in &a.segs {
        node = match s {
            PathSeg::Field(k) => node.get("properties")?.get(&**k)?,
            PathSeg::Index(_) | PathSeg::Wild => node.get("items")?,
        };
        node = crate::schema::resolve(root, node);
    }
    node.as_object()
}

/// Every `$name(...)` call must resolve; an unbound `$name` value is a warning.
fn check_names(spec: &ModelSpec, exports: &BTreeSet<String>, v: &mut V, limits: &Limits) {
    let mut exprs: Vec<(String, &str)> = Vec::new();
    for (i, d) in spec.derivations.iter().enumerate() {
        exprs.push((format!("derivations[{i}].expr"), &d.expr));
    }
    for (i, m) in spec.meta_derivations.iter().enumerate() {
        exprs.push((format!("metaDerivations[{i}].expr"), &m.expr));
    }
    for (i, c) in spec.constraints.iter().enumerate() {
        exprs.push((format!("constraints[{i}].expr"), &c.expr));
    }
    for (i, d) in spec.default_values.iter().enumerate() {
        exprs.push((format!("defaultValues[{i}].expr"), &d.expr));
    }
    for (i, e) in spec.effects.iter().enumerate() {
        exprs.push((format!("effects[{i}].trigger"), &e.trigger));
        for (f, t) in [
            ("dedupeKey", &e.dedupe_key),
            ("at", &e.at),
            ("afterMs", &e.after_ms),
            ("requests", &e.requests),
            ("prompt", &e.prompt),
            ("body", &e.body),
        ] {
            if let Some(t) = t {
                exprs.push((format!("effects[{i}].{f}"), t));
            }
        }
        if let Some(p) = &e.payload {
            for (k, x) in p {
                if let Some(s) = x.as_str() {
                    exprs.push((format!("effects[{i}].payload.{k}"), s));
                }
            }
        }
        if let Some(r) = &e.response {
            for (k, x) in &r.set {
                if let Some(s) = x.as_str() {
                    exprs.push((format!("effects[{i}].response.set.{k}"), s));
                }
            }
        }
        if let Some(req) = &e.request {
            if let Some(b) = req.get("body").and_then(Json::as_str) {
                exprs.push((format!("effects[{i}].request.body"), b));
            }
            let mut templates: Vec<(String, &str)> = Vec::new();
            if let Some(u) = req.get("url").and_then(Json::as_str) {
                templates.push((format!("effects[{i}].request.url"), u));
            }
            if let Some(h) = req.get("headers").and_then(Json::as_object) {
                for (k, x) in h {
                    if let Some(t) = x.as_str() {
                        templates.push((format!("effects[{i}].request.headers.{k}"), t));
                    }
                }
            }
            for (loc, t) in templates {
                for seg in interpolations(t) {
                    exprs.push((loc.clone(), seg));
                }
            }
        }
    }
    for (loc, text) in exprs {
        if text.trim().is_empty() {
            continue;
        }
        let c = match Compiled::compile(text, limits) {
            Ok(c) => c,
            Err(e) => {
                let at = e.at();
                v.err(
                    &loc,
                    format!("Invalid JSONata expression{at}: {}", e.message),
                );
                continue;
            }
        };
        for call in &c.calls {
            if !BUILTINS.contains(&call.as_str())
                && !exports.contains(call)
                && !RESERVED.contains(&call.as_str())
            {
                v.err(
                    &loc,
                    format!("${call}(...) is not a JSONata built-in or a library export"),
                );
            }
        }
        for var in &c.vars {
            if !exports.contains(var)
                && !RESERVED.contains(&var.as_str())
                && !BUILTINS.contains(&var.as_str())
            {
                v.warn(
                    &loc,
                    format!("${var} is not bound here and evaluates to nothing"),
                );
            }
        }
        let r = deps::reads(c.ast());
        if r.dynamic {
            v.warn(&loc, "$eval()/$lookup() defeat dependency tracking: the value may go stale when what it reads changes");
        }
        if r.whole_doc && loc.starts_with("derivations") {
            v.warn(&loc, "this expression depends on the whole document, so it is recomputed after every mutation");
        }
        let t = text.trim();
        if t.len() > 1
            && ((t.starts_with('"') && t.ends_with('"'))
                || (t.starts_with('\'') && t.ends_with('\'')))
            && !loc.contains("payload")
        {
            v.warn(&loc, "the whole expression is a quoted string literal; did you mean the expression inside the quotes?");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(j: Json) -> Report {
        validate_json(&j, &EngineLimits::default())
    }

    fn has(f: &[Finding], loc: &str, needle: &str) -> bool {
        f.iter()
            .any(|x| x.location.starts_with(loc) && x.message.contains(needle))
    }

    #[test]
    fn accepts_the_worked_example() {
        let r = run(
            json!({"id":"demo","version":"1.0.0","schema":{},"derivations":[{"path":"$.total","expr":"price * qty"}]}),
        );
        assert!(r.valid, "{r:?}");
    }

    #[test]
    fn reports_reference_rules() {
        let r = run(json!({
            "id": "9bad@id", "version": "1", "schema": {"properties": {"a": {"$ref": "#/definitions/X"}, "s": {"type": "string"}}},
            "initialState": {"$.a": 1},
            "derivations": [{"path": "$.items.0.x", "expr": "1"}, {"path": "$.t", "expr": "1 +"}, {"path": "$.u", "expr": "$nope(1) + $ghost"}],
            "metaDerivations": [{"path": "$.s", "property": "maximum", "expr": "3"}, {"path": "$.s", "property": "colour", "expr": "1"}],
            "constraints": [{"id": "c", "expr": "true", "message": "", "policy": "warn"}, {"id": "c", "expr": "true", "message": "m", "policy": "flag"}],
            "effects": [{"id": "e", "executor": "caller", "trigger": "true"}, {"id": "f", "executor": "carrier-pigeon", "trigger": "true"}]
        }));
        assert!(!r.valid);
        let e = &r.errors;
        assert!(has(e, "id", "coordinate"), "{e:#?}");
        assert!(has(&r.warnings, "version", "semver"), "{:#?}", r.warnings);
        assert!(has(e, "initialState", "removed"));
        assert!(has(e, "schema.properties.a.$ref", "only local"));
        assert!(has(e, "derivations[0].path", "$.items[0].x"));
        assert!(has(e, "derivations[2].expr", "$nope"));
        assert!(has(e, "metaDerivations[0].property", "does not apply"));
        assert!(has(
            e,
            "metaDerivations[1].property",
            "unknown meta property"
        ));
        assert!(has(e, "constraints[0].policy", "rollback"));
        assert!(has(e, "constraints[1].id", "duplicate"));
        assert!(has(e, "effects[0].emit", "emit"));
        assert!(has(e, "effects[1].executor", "unknown"));
        assert!(has(&r.warnings, "constraints[0].message", "empty"));
        assert!(has(&r.warnings, "derivations[2].expr", "$ghost"));
    }

    #[test]
    fn compile_errors_and_cycles_after_structure() {
        let r = run(json!({"id":"m","schema":{},"derivations":[{"path":"$.t","expr":"(1 + 2"}]}));
        assert!(
            has(&r.errors, "derivations[0].expr", "position 6"),
            "{:?}",
            r.errors
        );
        let r = run(
            json!({"id":"m","schema":{},"derivations":[{"path":"$.a","expr":"b"},{"path":"$.b","expr":"a"}]}),
        );
        assert!(
            has(
                &r.errors,
                "derivations",
                "cyclic dependency: $.a → $.b → $.a"
            ) || has(
                &r.errors,
                "derivations",
                "cyclic dependency: $.b → $.a → $.b"
            ),
            "{:?}",
            r.errors
        );
    }

    #[test]
    fn library_rules() {
        let r = run(
            json!({"id":"m","schema":{},"library":"( $sum := function($x) { $x }; $bad := function() { order.total }; $const := 1; [\"sum\", \"bad\", \"const\"] )"}),
        );
        assert!(
            has(&r.errors, "library", "reads the model document"),
            "{:?}",
            r.errors
        );
        assert!(has(&r.errors, "library", "shadows"));
        assert!(has(&r.errors, "library", "collides"));
    }

    #[test]
    fn effect_templates_and_fold_backs_are_compiled() {
        let r = run(
            json!({"id":"m","schema":{},"effects":[{"id":"e","executor":"server","trigger":"true",
            "request":{"url":"https://x.test/r?q={ region ( }","headers":{"X-Id":"{id}"}},
            "response":{"set":{"$.rate":"$response.rate +"}}}]}),
        );
        assert!(
            has(&r.errors, "effects[0].request.url", "Invalid JSONata"),
            "{:?}",
            r.errors
        );
        assert!(
            has(
                &r.errors,
                "effects[0].response.set.$.rate",
                "Invalid JSONata"
            ),
            "{:?}",
            r.errors
        );
        assert!(
            !has(&r.errors, "effects[0].request.headers", ""),
            "{:?}",
            r.errors
        );
    }

    #[test]
    fn semver_and_coordinates() {
        assert!(valid_semver("1.0.0") && valid_semver("10.2.3-rc.1+b5"));
        assert!(!valid_semver("1.0") && !valid_semver("01.0.0") && !valid_semver("v1.0.0"));
        assert!(
            valid_coordinate("acme/loan-calc_2")
                && !valid_coordinate("a/b/c")
                && !valid_coordinate("-x")
        );
    }
}
