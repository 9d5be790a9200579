//! A fleet's view (`valem serve --store postgres://… --node-id …`): `GET /cluster` lists the
//! nodes sharing the database, `GET /cluster/owner/{modelId}` names a model's owner. A daemon
//! outside a fleet answers with no nodes, and 404 for every owner.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::{error_response, AppState};

fn storage(e: impl std::fmt::Display) -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({"error": "Storage failure", "message": e.to_string()}),
    )
}

/// `GET /cluster`: `{"fleet": bool, "nodes": [{"id", "url", "alive", "models"}]}`.
pub(crate) async fn cluster(State(st): State<AppState>) -> Response {
    let Some(store) = st.service.store().cloned() else {
        return axum::Json(json!({"fleet": false, "nodes": []})).into_response();
    };
    let fleet = store.is_fleet();
    match tokio::task::spawn_blocking(move || store.nodes()).await {
        Ok(Ok(nodes)) => {
            let nodes: Vec<_> = nodes
                .into_iter()
                .map(|n| json!({"id": n.id, "url": n.url, "alive": n.alive, "models": n.models}))
                .collect();
            axum::Json(json!({"fleet": fleet, "nodes": nodes})).into_response()
        }
        Ok(Err(e)) => storage(e),
        Err(e) => storage(e),
    }
}

/// `GET /cluster/owner/{modelId}`: `{"model", "owner", "url", "epoch", "leaseUntil"}` (the
/// last owner, whose lease may have run out), 404 when no node ever claimed the model.
pub(crate) async fn owner(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    let not_found = || {
        error_response(
            StatusCode::NOT_FOUND,
            json!({"error": "Not found", "message": format!("no node has claimed model `{id}`")}),
        )
    };
    let Some(store) = st.service.store().cloned() else {
        return not_found();
    };
    let model = id.clone();
    match tokio::task::spawn_blocking(move || store.owner(&model)).await {
        Ok(Ok(Some(o))) => axum::Json(json!({
            "model": o.model_id,
            "owner": o.node,
            "url": o.url,
            "epoch": o.epoch,
            "leaseUntil": valem_service::time::iso(o.lease_until),
        }))
        .into_response(),
        Ok(Ok(None)) => not_found(),
        Ok(Err(e)) => storage(e),
        Err(e) => storage(e),
    }
}
