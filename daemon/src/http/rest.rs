//! The REST API of the reference (`/models…`, `/blobs…`): thin handlers over the
//! [`ModelService`](crate::service::ModelService), with the reference's status codes and JSON
//! error bodies carrying the same structured shapes as the MCP errors.

use axum::http::StatusCode;
use axum::response::Response;
use axum::Router;
use serde_json::json;

use super::{error_response, AppState};
use crate::service::ServiceError;

pub fn routes() -> Router<AppState> {
    Router::new()
}

/// The status and body of a service failure, and its metrics kind.
pub fn service_error(e: &ServiceError) -> (StatusCode, &'static str, Response) {
    let (status, kind) = match e {
        ServiceError::NotFound(_)
        | ServiceError::HistoryNotFound(_)
        | ServiceError::BlobNotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
        ServiceError::Duplicate(_) => (StatusCode::CONFLICT, "duplicate"),
        ServiceError::TooManyModels(_) => (StatusCode::TOO_MANY_REQUESTS, "too_many_models"),
        ServiceError::InvalidSpec(_)
        | ServiceError::EvolutionInvalid(_)
        | ServiceError::Stranded(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_spec"),
        ServiceError::Mutation(crate::engine::MutationError::Constraint { .. }) => {
            (StatusCode::CONFLICT, "constraint_violation")
        }
        ServiceError::Mutation(crate::engine::MutationError::Schema(_)) => {
            (StatusCode::UNPROCESSABLE_ENTITY, "schema_violation")
        }
        ServiceError::Mutation(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_mutation"),
        ServiceError::VersionConflict { .. } => (StatusCode::CONFLICT, "version_conflict"),
        ServiceError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
        ServiceError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
        ServiceError::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
    };
    let body = json!({"error": e.to_string()});
    (status, kind, error_response(status, body))
}
