//! Helpers of view evaluation: paths into the document and the schema, the reference's
//! truthiness, failures and option lists.

use super::*;

pub(super) fn seg_eq(p: &PathSeg, s: &Seg) -> bool {
    match (p, s) {
        (PathSeg::Field(a), Seg::Field(b)) => a == b,
        (PathSeg::Index(a), Seg::Index(b)) => a == b,
        _ => false,
    }
}

/// The value at a concrete path of a JSON document.
pub(super) fn lookup<'j>(doc: &'j Json, segs: &[Seg]) -> Option<&'j Json> {
    let mut cur = doc;
    for s in segs {
        cur = match (s, cur) {
            (Seg::Field(k), Json::Object(m)) => m.get(&**k)?,
            (Seg::Index(i), Json::Array(a)) => a.get(*i)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// Every value matching a `[*]` pattern, in document order.
pub(super) fn collect(doc: &Json, segs: &[PathSeg], out: &mut Vec<Json>) {
    let Some((first, rest)) = segs.split_first() else {
        out.push(doc.clone());
        return;
    };
    match (first, doc) {
        (PathSeg::Field(k), Json::Object(m)) => {
            if let Some(v) = m.get(&**k) {
                collect(v, rest, out);
            }
        }
        (PathSeg::Index(i), Json::Array(a)) => {
            if let Some(v) = a.get(*i) {
                collect(v, rest, out);
            }
        }
        (PathSeg::Wild, Json::Array(a)) => {
            for v in a {
                collect(v, rest, out);
            }
        }
        _ => {}
    }
}

/// The schema node at a concrete path (local `$ref`s followed) and whether it or an ancestor is
/// `readOnly: true`.
pub(super) fn schema_at<'s>(root: &'s Json, segs: &[Seg]) -> (Option<&'s Json>, bool) {
    let mut node = resolve(root, root);
    let mut ro = false;
    for s in segs {
        ro |= node.get("readOnly").and_then(Json::as_bool) == Some(true);
        let next = match s {
            Seg::Field(k) => node
                .get("properties")
                .and_then(|p| p.get(&**k))
                .or_else(|| node.get("additionalProperties").filter(|n| n.is_object())),
            Seg::Index(i) => node
                .get("prefixItems")
                .and_then(|p| p.get(*i))
                .or_else(|| node.get("items").filter(|n| n.is_object())),
        };
        match next {
            Some(n) => node = resolve(root, n),
            None => return (None, ro),
        }
    }
    ro |= node.get("readOnly").and_then(Json::as_bool) == Some(true);
    (Some(node), ro)
}

/// JSONata's `$boolean` of a defined value.
pub(super) fn truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => a.iter().any(truthy),
        Json::Object(m) => !m.is_empty(),
    }
}

/// An effect status (a string, or an object with a `status`/`phase`/`state` member) that says
/// `failed`.
pub(super) fn is_failed(v: &Json) -> bool {
    match v {
        Json::String(s) => s == "failed",
        Json::Object(m) => ["status", "phase", "state"]
            .iter()
            .any(|k| m.get(*k).and_then(Json::as_str) == Some("failed")),
        _ => false,
    }
}

/// Options as `[{value, label}]`: objects kept, scalars become `{value, label}` with the label
/// the scalar's text. *Undefined* is an empty list; a single object a one-item list.
pub(super) fn normalize_options(v: Option<Json>) -> Json {
    let items = match v {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(a)) => a,
        Some(other) => vec![other],
    };
    Json::Array(
        items
            .into_iter()
            .map(|x| match x {
                Json::Object(_) => x,
                Json::String(s) => json!({"value": s, "label": s}),
                other => json!({"value": other, "label": other.to_string()}),
            })
            .collect(),
    )
}
