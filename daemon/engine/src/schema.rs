//! The effective schema: the static JSON Schema node at an address, overlaid with live meta
//! values (`minimum`, `maximum`, `required`, `readOnly`, …), and mutation validation against it.
//! Local `#/$defs/…` references only; compiled validators are cached per effective schema.

use std::rc::Rc;

use imbl::OrdMap;
use serde_json::{Map, Value as Json};

use super::compile::CompiledModel;
use super::MetaEntry;
use valem_core::expr::path::render;
use valem_core::spec::MetaProp;
use valem_core::value::{Seg, Val};

/// One reason a written value is refused (the contract's Schema violation item).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SchemaViolation {
    pub path: String,
    pub keyword: String,
    pub message: String,
}

/// Bound on cached validators per compiled model.
const MAX_CACHED_VALIDATORS: usize = 4096;
/// Bound on `$ref` hops while resolving one node (recursive types stay finite).
const MAX_REF_HOPS: usize = 64;

enum Lookup<'a> {
    Node(&'a Json),
    /// No schema constrains this address: the schema stops at `path[..depth]`, whose node is
    /// `parent`.
    Free {
        depth: usize,
        parent: &'a Json,
    },
    Refused(SchemaViolation),
}

/// The live meta entries of one concrete address (one range scan of the ordered meta map).
fn meta_of<'m>(
    meta: &'m OrdMap<std::sync::Arc<str>, MetaEntry>,
    rendered: &str,
) -> Vec<(MetaProp, &'m MetaEntry)> {
    if meta.is_empty() {
        return Vec::new();
    }
    let prefix = format!("{rendered}#");
    meta.range::<_, str>((
        std::ops::Bound::Included(prefix.as_str()),
        std::ops::Bound::Unbounded,
    ))
    .take_while(|(k, _)| k.starts_with(&prefix))
    .filter_map(|(k, e)| MetaProp::parse_any(&k[prefix.len()..]).map(|p| (p, e)))
    .collect()
}

/// Follow local `$ref`s from `node`.
pub fn resolve<'a>(root: &'a Json, mut node: &'a Json) -> &'a Json {
    for _ in 0..MAX_REF_HOPS {
        let Some(r) = node.get("$ref").and_then(Json::as_str) else {
            return node;
        };
        match r
            .strip_prefix("#/$defs/")
            .and_then(|name| root.get("$defs").and_then(|d| d.get(name)))
        {
            Some(target) => node = target,
            None => return node,
        }
    }
    node
}

fn types_of(node: &Json) -> Option<Vec<&str>> {
    match node.get("type")? {
        Json::String(s) => Some(vec![s.as_str()]),
        Json::Array(a) => Some(a.iter().filter_map(Json::as_str).collect()),
        _ => None,
    }
}

fn node_at<'a>(root: &'a Json, path: &[Seg]) -> Lookup<'a> {
    let mut node = resolve(root, root);
    for (i, seg) in path.iter().enumerate() {
        let here = || render(&path[..i]);
        if node.get("readOnly").and_then(Json::as_bool) == Some(true) {
            return Lookup::Refused(SchemaViolation {
                path: render(path),
                keyword: "readOnly".into(),
                message: format!(
                    "{} is inside {}, which is read-only in the schema",
                    render(path),
                    here()
                ),
            });
        }
        if let Some(types) = types_of(node) {
            let want = match seg {
                Seg::Field(_) => "object",
                Seg::Index(_) => "array",
            };
            if !types.contains(&want) {
                return Lookup::Refused(SchemaViolation {
                    path: render(path),
                    keyword: "type".into(),
                    message: format!(
                        "{} is declared as {}, so it has no {}",
                        here(),
                        types.join(" or "),
                        match seg {
                            Seg::Field(k) => format!("field `{k}`"),
                            Seg::Index(i) => format!("element [{i}]"),
                        }
                    ),
                });
            }
        }
        let next = match seg {
            Seg::Field(k) => match node.get("properties").and_then(|p| p.get(&**k)) {
                Some(n) => Some(n),
                None => match node.get("additionalProperties") {
                    Some(Json::Bool(false)) => {
                        return Lookup::Refused(SchemaViolation {
                            path: render(path),
                            keyword: "additionalProperties".into(),
                            message: format!("{} does not allow the property `{k}`", here()),
                        })
                    }
                    Some(n @ Json::Object(_)) => Some(n),
                    _ => None,
                },
            },
            Seg::Index(i) => match node.get("prefixItems").and_then(|p| p.get(*i)) {
                Some(n) => Some(n),
                None => match node.get("items") {
                    Some(Json::Bool(false)) => {
                        return Lookup::Refused(SchemaViolation {
                            path: render(path),
                            keyword: "items".into(),
                            message: format!("{} allows no element [{i}]", here()),
                        })
                    }
                    Some(n @ Json::Object(_)) => Some(n),
                    _ => None,
                },
            },
        };
        match next {
            Some(n) => node = resolve(root, n),
            None => {
                return Lookup::Free {
                    depth: i,
                    parent: node,
                }
            }
        }
    }
    Lookup::Node(node)
}

/// The static schema node at `path` overlaid with the live meta for that address; `None` when
/// the schema refuses the address. This is what `get_effective_schema` returns. An address
/// the schema does not declare is `{}` (anything is accepted there, as in the reference) with
/// a `$comment` saying so and naming the fields declared where the schema stops — a typo in
/// the path would otherwise look like a field without constraints.
pub fn effective_schema(
    cm: &CompiledModel,
    meta: &OrdMap<std::sync::Arc<str>, MetaEntry>,
    path: &[Seg],
) -> Option<Json> {
    let node = match node_at(&cm.schema, path) {
        Lookup::Node(n) => n.clone(),
        Lookup::Free { depth, parent } => {
            let mut m = Map::new();
            if meta_of(meta, &render(path)).is_empty() {
                m.insert(
                    "$comment".into(),
                    undeclared(cm, path, depth, parent).into(),
                );
            }
            Json::Object(m)
        }
        Lookup::Refused(_) => return None,
    };
    let mut node = match node {
        Json::Object(m) => m,
        Json::Bool(true) => Map::new(),
        other => return Some(other),
    };
    let rendered = render(path);
    for (prop, entry) in meta_of(meta, &rendered) {
        let v = entry.value.to_json();
        match prop {
            MetaProp::Relevant => {
                node.insert("x-valem-relevant".into(), v);
            }
            MetaProp::Required => {
                node.insert("x-valem-required".into(), v);
            }
            MetaProp::ReadOnly => {
                node.insert("readOnly".into(), v);
            }
            _ if v.is_null() => {}
            _ => {
                node.insert(prop.name().into(), v);
            }
        }
    }
    Some(Json::Object(node))
}

/// What the `$comment` of an undeclared address says.
fn undeclared(cm: &CompiledModel, path: &[Seg], depth: usize, parent: &Json) -> String {
    let at = render(path);
    if let Some(p) = cm.produced_above(path) {
        return format!(
            "{at} is not declared in the model's schema; it is computed by the derivation of {} \
             and cannot be written",
            cm.key(p)
        );
    }
    const SHOWN: usize = 20;
    let declared: Vec<&str> = parent
        .get("properties")
        .and_then(Json::as_object)
        .map(|p| p.keys().map(String::as_str).collect())
        .unwrap_or_default();
    let there = render(&path[..depth]);
    let fields = match declared.len() {
        0 => format!("{there} declares no fields"),
        n if n <= SHOWN => format!("{there} declares {}", declared.join(", ")),
        n => format!(
            "{there} declares {}, … ({n} fields)",
            declared[..SHOWN].join(", ")
        ),
    };
    format!(
        "{at} is not declared in the model's schema, so any value is accepted there; check the \
         path's spelling ({fields})"
    )
}

/// Validate one write against the effective schema.
pub fn validate_write(
    cm: &CompiledModel,
    meta: &OrdMap<std::sync::Arc<str>, MetaEntry>,
    path: &[Seg],
    value: &Json,
) -> Vec<SchemaViolation> {
    if let Some(p) = cm.produced_above(path) {
        return vec![SchemaViolation {
            path: render(path),
            keyword: "readOnly".into(),
            message: format!(
                "{} is computed by the derivation of {} and cannot be written",
                render(path),
                cm.key(p)
            ),
        }];
    }
    let node = match node_at(&cm.schema, path) {
        Lookup::Refused(v) => return vec![v],
        Lookup::Free { .. } => None,
        Lookup::Node(n) => Some(n),
    };
    if node.is_none() && meta.is_empty() {
        // No schema node and no live meta: nothing constrains this write.
        return Vec::new();
    }
    let rendered = render(path);
    let mut out = Vec::new();
    // A container made read-only by live meta protects everything inside it.
    if !meta.is_empty() {
        for k in 1..path.len() {
            let outer = render(&path[..k]);
            let locked = meta_of(meta, &outer)
                .iter()
                .any(|(p, e)| *p == MetaProp::ReadOnly && e.value == Val::Bool(true));
            if locked {
                return vec![SchemaViolation {
                    path: rendered,
                    keyword: "readOnly".into(),
                    message: format!(
                        "{} is inside {outer}, which is currently read-only",
                        render(path)
                    ),
                }];
            }
        }
    }
    if node.and_then(|n| n.get("readOnly")).and_then(Json::as_bool) == Some(true) {
        out.push(SchemaViolation {
            path: rendered.clone(),
            keyword: "readOnly".into(),
            message: format!("{rendered} is read-only in the schema"),
        });
        return out;
    }
    let mut overlay = Map::new();
    for (prop, entry) in meta_of(meta, &rendered) {
        match prop {
            MetaProp::Relevant => {}
            MetaProp::ReadOnly => {
                if entry.value == Val::Bool(true) {
                    out.push(SchemaViolation {
                        path: rendered.clone(),
                        keyword: "readOnly".into(),
                        message: format!("{rendered} is currently read-only"),
                    });
                }
            }
            MetaProp::Required => {
                if entry.value == Val::Bool(true) && value.is_null() {
                    out.push(SchemaViolation {
                        path: rendered.clone(),
                        keyword: "required".into(),
                        message: format!("{rendered} is currently required and cannot be null"),
                    });
                }
            }
            _ => {
                let v = entry.value.to_json();
                if !v.is_null() {
                    overlay.insert(prop.name().into(), v);
                }
            }
        }
    }
    if !out.is_empty() {
        return out;
    }
    let Some(node) = node else {
        if overlay.is_empty() {
            return out;
        }
        return check(cm, None, &overlay, &rendered, value);
    };
    check(cm, Some(node), &overlay, &rendered, value)
}

fn check(
    cm: &CompiledModel,
    node: Option<&Json>,
    overlay: &Map<String, Json>,
    rendered: &str,
    value: &Json,
) -> Vec<SchemaViolation> {
    let overlay_text = Json::Object(overlay.clone()).to_string();
    let key = format!(
        "{:p}|{overlay_text}",
        node.map_or(std::ptr::null(), |n| n as *const Json)
    );
    let cached = cm.validators.borrow().get(&key).cloned();
    let validator = match cached {
        Some(v) => v,
        None => {
            let mut schema = match node {
                Some(Json::Object(m)) => m.clone(),
                Some(Json::Bool(true)) | None => Map::new(),
                Some(Json::Bool(false)) => {
                    return vec![SchemaViolation {
                        path: rendered.to_string(),
                        keyword: "false".into(),
                        message: format!("the schema allows no value at {rendered}"),
                    }]
                }
                Some(_) => Map::new(),
            };
            for (k, v) in overlay {
                schema.insert(k.clone(), v.clone());
            }
            if let Some(defs) = cm.schema.get("$defs") {
                schema.entry("$defs").or_insert_with(|| defs.clone());
            }
            match jsonschema::validator_for(&Json::Object(schema)) {
                Ok(v) => {
                    let v = Rc::new(v);
                    let mut cache = cm.validators.borrow_mut();
                    if cache.len() >= MAX_CACHED_VALIDATORS {
                        cache.clear();
                    }
                    cache.insert(key, v.clone());
                    v
                }
                Err(e) => {
                    return vec![SchemaViolation {
                        path: rendered.to_string(),
                        keyword: "schema".into(),
                        message: format!(
                            "the schema at {rendered} is not a valid JSON Schema: {e}"
                        ),
                    }]
                }
            }
        }
    };
    validator
        .iter_errors(value)
        .map(|e| {
            let sub = e.instance_path().to_string();
            SchemaViolation {
                path: format!("{rendered}{}", pointer_suffix(&sub)),
                keyword: e.kind().keyword().to_string(),
                message: e.to_string(),
            }
        })
        .collect()
}

/// `/a/0/b` → `.a[0].b`.
fn pointer_suffix(p: &str) -> String {
    let mut s = String::new();
    for part in p.split('/').skip(1) {
        let part = part.replace("~1", "/").replace("~0", "~");
        if part.chars().all(|c| c.is_ascii_digit()) && !part.is_empty() {
            s.push_str(&format!("[{part}]"));
        } else if valem_core::expr::path::is_identifier(&part) {
            s.push('.');
            s.push_str(&part);
        } else {
            s.push_str(&format!("['{part}']"));
        }
    }
    s
}
