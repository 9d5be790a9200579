//! MCP resources: the authoring guides, the two spec JSON Schemas, the bundled examples and the
//! live state of each model (subscribable).

use serde_json::{json, Value as Json};

use super::{code, Server};

/// (uri, name, title, description, mimeType, text)
const GUIDES: &[(&str, &str, &str, &str)] = &[
    (
        "model-spec-format",
        "ModelSpec authoring guide",
        "Every ModelSpec section, the path notation, how expressions address the document, the reactive cycle and common validator findings.",
        include_str!("../../assets/guides/model-spec-format.md"),
    ),
    (
        "jsonata-gotchas",
        "JSONata gotchas",
        "Pitfalls: bindings, singleton sequences, missing vs null, the address dialect.",
        include_str!("../../assets/guides/jsonata-gotchas.md"),
    ),
    (
        "spec-evolution",
        "Authoring a SpecEvolution",
        "Targeted upserts vs wholesale replacement, expectedVersion, backfill, the strand check.",
        include_str!("../../assets/guides/spec-evolution.md"),
    ),
    (
        "view-system",
        "The view system",
        "View definitions, components, bind, and what get_view returns.",
        include_str!("../../assets/guides/view-system.md"),
    ),
];

fn resource(uri: String, name: &str, title: &str, description: &str, mime: &str) -> Json {
    json!({"uri": uri, "name": name, "title": title, "description": description, "mimeType": mime})
}

pub fn list(server: &Server) -> Json {
    let mut out = Vec::new();
    for (id, title, desc, _) in GUIDES {
        out.push(resource(
            format!("valem://guide/{id}"),
            id,
            title,
            desc,
            "text/markdown",
        ));
    }
    out.push(resource(
        "valem://schema/model-spec".into(),
        "model-spec",
        "ModelSpec JSON Schema",
        "The full JSON Schema of a ModelSpec (what create_model accepts).",
        "application/json",
    ));
    out.push(resource(
        "valem://schema/spec-evolution".into(),
        "spec-evolution",
        "SpecEvolution JSON Schema",
        "The JSON Schema of a SpecEvolution (what evolve_spec accepts).",
        "application/json",
    ));
    for (name, _) in valem_core::examples::ALL {
        out.push(resource(
            format!("valem://examples/{name}"),
            name,
            &format!("Example spec: {name}"),
            "A bundled, working ModelSpec with embedded tests.",
            "application/json",
        ));
    }
    if let Ok(ids) = server.service.list() {
        for id in ids {
            out.push(resource(
                format!("valem://state/{id}"),
                &id,
                &format!("State of {id}"),
                "The live merged state of this model (subscribe for change notifications).",
                "application/json",
            ));
        }
    }
    json!({"resources": out})
}

pub fn templates() -> Json {
    json!({"resourceTemplates": [
        {
            "uriTemplate": "valem://examples/{name}",
            "name": "example",
            "title": "Bundled example spec",
            "description": format!("A bundled example ModelSpec; names: {}", valem_core::examples::ALL.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")),
            "mimeType": "application/json",
        },
        {
            "uriTemplate": "valem://state/{modelId}",
            "name": "state",
            "title": "Live model state",
            "description": "A model's merged state; subscribable (notifications/resources/updated on every committed change).",
            "mimeType": "application/json",
        },
    ]})
}

/// The URI prefix of a model's live state resource.
pub const STATE_PREFIX: &str = "valem://state/";

/// Can `uri` be subscribed to? Our state resources can; our other `valem://` resources never
/// change, so a subscription to them is refused (-32002) as a likely mistake. A URI of another
/// scheme is not ours to judge: the subscription is accepted and never fires (MCP leaves this
/// open; the conformance suite's generic scenarios subscribe to such a URI).
pub fn subscribable(uri: &str) -> bool {
    match uri.strip_prefix("valem://") {
        Some(_) => uri
            .strip_prefix(STATE_PREFIX)
            .is_some_and(|id| !id.is_empty()),
        None => !uri.is_empty(),
    }
}

fn contents(uri: &str, mime: &str, text: String) -> Json {
    json!({"contents": [{"uri": uri, "mimeType": mime, "text": text}]})
}

fn not_found(uri: &str, why: String) -> Json {
    json!({"code": code::RESOURCE_NOT_FOUND, "message": why, "data": {"uri": uri}})
}

/// `resources/read`: the contents, or the JSON-RPC error object.
pub fn read(server: &Server, uri: &str) -> Result<Json, Json> {
    if let Some(g) = uri.strip_prefix("valem://guide/") {
        if let Some((_, _, _, text)) = GUIDES.iter().find(|(id, ..)| *id == g) {
            return Ok(contents(uri, "text/markdown", text.to_string()));
        }
    }
    let pretty = |v: &Json| serde_json::to_string_pretty(v).unwrap_or_default();
    match uri {
        "valem://schema/model-spec" => {
            return Ok(contents(
                uri,
                "application/json",
                pretty(&valem_core::spec::schema::model_spec_schema()),
            ))
        }
        "valem://schema/spec-evolution" => {
            return Ok(contents(
                uri,
                "application/json",
                pretty(&valem_core::spec::schema::spec_evolution_schema()),
            ))
        }
        _ => {}
    }
    if let Some(name) = uri.strip_prefix("valem://examples/") {
        if let Some(text) = valem_core::examples::get(name) {
            return Ok(contents(uri, "application/json", text.to_string()));
        }
    }
    if let Some(id) = uri.strip_prefix("valem://state/") {
        return match server.service.state(&id.into(), None).wait() {
            Ok(s) => Ok(contents(uri, "application/json", pretty(&s))),
            Err(e) => Err(not_found(uri, format!("Resource not found: {uri} ({e})"))),
        };
    }
    Err(not_found(
        uri,
        format!("Resource not found: {uri}; resources/list and resources/templates/list show what exists"),
    ))
}
