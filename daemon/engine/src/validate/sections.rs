//! The validator's checks of effects, embedded tests, the view (and its components) and the
//! lineage of a branch.

use super::*;

pub(super) fn check_effects(spec: &ModelSpec, v: &mut V) {
    let mut seen = HashSet::new();
    for (i, e) in spec.effects.iter().enumerate() {
        let loc = format!("effects[{i}]");
        if v.nonblank(&format!("{loc}.id"), "id", &e.id) && !seen.insert(e.id.clone()) {
            v.err(
                format!("{loc}.id"),
                format!("duplicate effect id `{}`", e.id),
            );
        }
        v.nonblank(&format!("{loc}.trigger"), "trigger", &e.trigger);
        if let Some(sp) = &e.status_path {
            v.address(&format!("{loc}.statusPath"), sp);
        }
        if let Some(r) = &e.response {
            for k in r.set.keys() {
                v.address(&format!("{loc}.response.set"), k);
            }
        }
        let exec = e.executor();
        if !KNOWN_EXECUTORS.contains(&exec) {
            v.err(
                format!("{loc}.executor"),
                format!(
                    "unknown effect executor `{exec}`; available: {}",
                    KNOWN_EXECUTORS.join(", ")
                ),
            );
            continue;
        }
        match exec {
            "caller" if e.emit.as_deref().is_none_or(|s| s.trim().is_empty()) => {
                v.err(
                    format!("{loc}.emit"),
                    "a caller effect needs `emit` (the event name returned to the caller)",
                );
            }
            "server" => {
                let url = e.request.as_ref().and_then(|r| r.get("url")).is_some();
                let locators = [url, e.requests.is_some(), e.target.is_some()]
                    .iter()
                    .filter(|x| **x)
                    .count();
                if locators != 1 {
                    v.err(
                        loc.clone(),
                        format!("a server effect needs exactly one locator (request.url, requests or target), found {locators}"),
                    );
                }
                if let Some(m) = e.request.as_ref().and_then(|r| r.get("method")) {
                    let ok = m.as_str().is_some_and(|m| {
                        ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"]
                            .contains(&m.to_ascii_uppercase().as_str())
                    });
                    if !ok {
                        v.err(
                            format!("{loc}.request.method"),
                            format!("unsupported HTTP method {m}"),
                        );
                    }
                }
                if let Some(t) = &e.target {
                    if t.get("ref").and_then(Json::as_str).is_none() {
                        v.err(
                            format!("{loc}.target.ref"),
                            "target.ref (the linked model's coordinate) is required",
                        );
                    }
                    let is_read = t.get("read").is_some();
                    if is_read && e.body.is_some() {
                        v.err(format!("{loc}.body"), "a read-link target takes no body");
                    }
                } else if e.body.is_some() {
                    v.err(
                        format!("{loc}.body"),
                        "a top-level body is only allowed with a write-link target",
                    );
                }
                if let Some(b) = e.binding.as_ref() {
                    if b.get("transport").is_none() {
                        v.err(
                            format!("{loc}.binding.transport"),
                            "binding.transport is required",
                        );
                    }
                }
            }
            "llm" if e.prompt.as_deref().is_none_or(|s| s.trim().is_empty()) => {
                v.err(
                    format!("{loc}.prompt"),
                    "an llm effect needs a `prompt` expression",
                );
            }
            "timer" if e.at.is_none() && e.after_ms.is_none() => {
                v.err(loc.clone(), "a timer effect needs `at` or `afterMs`");
            }
            _ => {}
        }
    }
}

pub(super) fn check_tests(spec: &ModelSpec, v: &mut V) {
    for (i, t) in spec.tests.iter().enumerate() {
        for k in t.given.keys() {
            v.address(&format!("tests[{i}].given"), k);
        }
        for (k, e) in &t.expect {
            v.address(&format!("tests[{i}].expect"), k);
            if let Some(m) = e.get("$meta").and_then(Json::as_object) {
                for p in m.keys() {
                    if MetaProp::parse_any(p).is_none() {
                        v.err(
                            format!("tests[{i}].expect.{k}"),
                            format!("unknown meta property `{p}` in $meta"),
                        );
                    }
                }
            }
        }
    }
}

pub(super) fn check_view(spec: &ModelSpec, v: &mut V) {
    let Some(view) = &spec.view_definition else {
        return;
    };
    let Some(obj) = view.as_object() else {
        v.err("viewDefinition", "viewDefinition must be an object");
        return;
    };
    let views = obj
        .get("views")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    let mut view_ids = HashSet::new();
    for (i, vw) in views.iter().enumerate() {
        let loc = format!("viewDefinition.views[{i}]");
        match vw.get("id").and_then(Json::as_str) {
            Some(id) => {
                if !view_ids.insert(id.to_string()) {
                    v.err(&loc, format!("duplicate view id `{id}`"));
                }
            }
            None => v.err(&loc, "a view needs an id"),
        }
    }
    if let Some(d) = obj.get("defaultView").and_then(Json::as_str) {
        if !view_ids.contains(d) {
            v.err(
                "viewDefinition.defaultView",
                format!("defaultView `{d}` names no view"),
            );
        }
    }
    for (i, vw) in views.iter().enumerate() {
        let mut ids = HashSet::new();
        if let Some(cs) = vw.get("components").and_then(Json::as_array) {
            check_components(
                cs,
                &format!("viewDefinition.views[{i}].components"),
                &mut ids,
                &view_ids,
                v,
                0,
            );
        }
    }
}

pub(super) fn check_components(
    cs: &[Json],
    loc: &str,
    ids: &mut HashSet<String>,
    views: &HashSet<String>,
    v: &mut V,
    depth: usize,
) {
    if depth > 32 {
        return;
    }
    for (j, c) in cs.iter().enumerate() {
        let loc = format!("{loc}[{j}]");
        match c.get("id").and_then(Json::as_str) {
            Some(id) => {
                if !ids.insert(id.to_string()) {
                    v.err(&loc, format!("duplicate component id `{id}`"));
                }
            }
            None => v.err(&loc, "a component needs an id"),
        }
        match c.get("type").and_then(Json::as_str) {
            None => v.err(&loc, "a component needs a type"),
            Some(t) if !COMPONENT_TYPES.contains(&t) => v.err(
                format!("{loc}.type"),
                format!("unknown component type `{t}`"),
            ),
            _ => {}
        }
        if let Some(b) = c.get("bind").and_then(Json::as_str) {
            v.address(&format!("{loc}.bind"), b);
        }
        let exprs = COMPONENT_BOOL_EXPR_FIELDS
            .iter()
            .filter_map(|f| Some((*f, c.get(*f)?.as_str()?)))
            .chain(
                COMPONENT_TEXT_EXPR_FIELDS
                    .iter()
                    .filter_map(|f| Some((*f, c.get(*f)?.as_str()?)))
                    .filter(|(_, t)| t.contains('$')),
            );
        for (field, text) in exprs {
            {
                if let Err(e) = Compiled::compile(text, &Limits::default()) {
                    let at = e.at();
                    v.err(
                        format!("{loc}.{field}"),
                        format!("Invalid JSONata expression{at}: {}", e.message),
                    );
                }
            }
        }
        if let Some(iv) = c.get("itemView").and_then(Json::as_str) {
            if !views.contains(iv) {
                v.err(
                    format!("{loc}.itemView"),
                    format!("itemView `{iv}` names no view"),
                );
            }
        }
        if let Some(sub) = c.get("components").and_then(Json::as_array) {
            check_components(sub, &format!("{loc}.components"), ids, views, v, depth + 1);
        }
    }
}

pub(super) fn check_lineage(spec: &ModelSpec, v: &mut V) {
    let mut seen = HashSet::new();
    for (i, l) in spec.lineage.iter().enumerate() {
        if !valid_coordinate(&l.reference) {
            v.err(
                format!("lineage[{i}].ref"),
                format!("`{}` is not a model coordinate", l.reference),
            );
        }
        if l.reference == spec.id || !seen.insert(l.reference.clone()) {
            v.err(
                format!("lineage[{i}]"),
                format!(
                    "lineage is cyclic: `{}` appears twice in the ancestor chain",
                    l.reference
                ),
            );
        }
    }
    if let Some(t) = &spec.template {
        if !valid_coordinate(&t.reference) {
            v.err(
                "template.ref",
                format!("`{}` is not a model coordinate", t.reference),
            );
        }
    }
}

/// The `{ expr }` segments of a URL or header template.
pub(super) fn interpolations(t: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = t;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        out.push(&rest[open + 1..open + close]);
        rest = &rest[open + close + 1..];
    }
    out
}
