//! The REST API of the reference (`/models…`, `/blobs…`): thin handlers over the
//! [`ModelService`](valem_service::ModelService) with the reference's status codes. Every
//! failure is a JSON body `{"error": <title>, "message"?: <detail>, …structured fields}` — the
//! contract's structured shapes (schema violation, constraint violation, version conflict) are
//! the very bodies the MCP tools return — never HTML, plain text or empty: axum's extractor
//! rejections are replaced by [`ApiError`]s (`extract.rs`).
//!
//! Bodies: JSON endpoints require `Content-Type: application/json` (415 otherwise); a body
//! that is not JSON is 400 "Malformed or unreadable request body" with the parser's line and
//! column; a body over `--max-body-bytes` is 413 (blob uploads: the service's blob limit). A
//! ModelSpec or SpecEvolution that is JSON but not of the right shape is a 422 with located
//! findings, as `validate_spec` reports them.

mod blobs;
pub(crate) mod extract;
mod models;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value as Json};

use super::{error_response, AppState};
use valem_service::Finding;
use valem_service::MutationError;
use valem_service::{ModelService, ServiceError};

/// Multipart framing allowed on top of the largest blob (boundaries, part headers, `mediaType`).
const MULTIPART_OVERHEAD: usize = 64 << 10;

pub fn routes(st: &AppState) -> Router<AppState> {
    let blob_body = st
        .service
        .limits()
        .blob_max_bytes
        .saturating_add(MULTIPART_OVERHEAD);
    // The body limits also bound the stream when no Content-Length was declared.
    Router::new()
        .route("/models", get(models::list).post(models::create))
        .route("/models/{id}", get(models::info).delete(models::delete))
        .route("/models/{id}/spec", get(models::spec))
        .route("/models/{id}/library", get(models::library))
        .route("/models/{id}/lineage", get(models::lineage))
        .route("/models/{id}/mutations", post(models::mutate))
        .route("/models/{id}/mutations/patch", post(models::patch))
        .route("/models/{id}/state", get(models::state))
        .route("/models/{id}/state/{path}", get(models::field))
        .route("/models/{id}/history", get(models::history))
        .route("/models/{id}/schema/{path}", get(models::schema))
        .route("/models/{id}/explain/{path}", get(models::explain))
        .route("/models/{id}/graph", get(models::graph))
        .route("/models/{id}/verification", get(models::verification))
        .route("/models/{id}/audit", get(models::audit))
        .route("/models/{id}/audit/verify", get(models::verify_audit))
        .route("/models/{id}/snapshot", post(models::snapshot))
        .route("/models/{id}/restore", post(models::restore))
        .route("/models/{id}/spec/evolve", post(models::evolve))
        .route("/models/{id}/view", get(models::view))
        .route("/models/{id}/view/{view_id}", get(models::named_view))
        .route("/models/{id}/blobs/{blob_id}", get(blobs::model_blob))
        .route(
            "/blobs",
            post(blobs::upload).layer(DefaultBodyLimit::max(blob_body)),
        )
        .route("/blobs/{blob_id}", get(blobs::download))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(st.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(st.clone(), count_errors))
}

/// The metrics kind of a failed request, carried on its response for [`count_errors`].
#[derive(Clone, Copy)]
struct ErrorKind(&'static str);

pub(super) async fn count_errors(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    if let Some(ErrorKind(kind)) = res.extensions().get::<ErrorKind>() {
        st.metrics.error(kind);
    }
    res
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "Method not allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// A failed request: status, metrics kind and JSON body.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub body: Json,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        error: &str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            kind,
            body: json!({"error": error, "message": message.into()}),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "Bad request",
            message,
        )
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", "Not found", message)
    }

    /// 422 with located findings (`{location, message, severity}`), as the reference reports
    /// an invalid spec.
    pub fn findings(error: &str, message: String, findings: &[Finding]) -> ApiError {
        let errors: Vec<Json> = findings
            .iter()
            .map(|f| json!({"location": f.location, "message": f.message, "severity": "error"}))
            .collect();
        ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            kind: "invalid_spec",
            body: json!({"error": error, "message": message, "errors": errors}),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = error_response(self.status, self.body);
        r.extensions_mut().insert(ErrorKind(self.kind));
        r
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> ApiError {
        service_error(&e)
    }
}

/// The status, metrics kind and body of a service failure.
pub fn service_error(e: &ServiceError) -> ApiError {
    let message = e.to_string();
    let plain = |status, kind, error: &str| ApiError::new(status, kind, error, message.clone());
    match e {
        ServiceError::NotFound(_)
        | ServiceError::HistoryNotFound(_)
        | ServiceError::BlobNotFound(_)
        | ServiceError::ViewNotFound(_) => ApiError::not_found(message),
        ServiceError::Duplicate(id) => {
            let mut r = plain(StatusCode::CONFLICT, "duplicate", "Duplicate model");
            r.body["id"] = json!(id);
            r
        }
        ServiceError::TooManyModels(limit) => {
            let mut r = plain(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_models",
                "Too many models",
            );
            r.body["limit"] = json!(limit);
            r
        }
        ServiceError::InvalidSpec(f) => ApiError::findings("Invalid spec", message, f),
        ServiceError::EvolutionInvalid(f) => ApiError::findings("Invalid evolution", message, f),
        ServiceError::Stranded(inc) => ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            kind: "stranded",
            body: json!({"error": "Stranded state", "message": message, "incompatibilities": inc}),
        },
        ServiceError::Mutation(m) => {
            let (status, kind) = match m {
                MutationError::Schema(_) => (StatusCode::UNPROCESSABLE_ENTITY, "schema_violation"),
                MutationError::Constraint { .. } => (StatusCode::CONFLICT, "constraint_violation"),
                MutationError::Invalid(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_mutation"),
            };
            ApiError {
                status,
                kind,
                body: m.to_json(),
            }
        }
        ServiceError::VersionConflict { .. } => ApiError {
            status: StatusCode::CONFLICT,
            kind: "version_conflict",
            body: e
                .structured()
                .unwrap_or_else(|| json!({"error": "Version conflict", "message": message})),
        },
        ServiceError::TooLarge(_) => plain(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            "Payload too large",
        ),
        ServiceError::BadRequest(_) => ApiError::bad_request(message),
        ServiceError::Unavailable => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Service unavailable",
        ),
        ServiceError::Storage(_) => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage",
            "Storage failure",
        ),
        ServiceError::Elsewhere { node, url, .. } => {
            let mut r = plain(
                StatusCode::MISDIRECTED_REQUEST,
                "elsewhere",
                "Owned by another node",
            );
            r.body["owner"] = json!(node);
            r.body["ownerUrl"] = json!(url);
            r
        }
        ServiceError::Unrecovered { .. } => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "unrecovered",
            "Model not recovered",
        ),
        ServiceError::Superseded(_) => plain(StatusCode::CONFLICT, "superseded", "Superseded"),
        ServiceError::KeyReused { .. } => plain(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            "Idempotency key reused",
        ),
        ServiceError::Busy(queued) => {
            let mut r = plain(StatusCode::SERVICE_UNAVAILABLE, "busy", "Overloaded");
            r.body["queued"] = json!(queued);
            r
        }
    }
}

/// Run a service call on the blocking pool; its failure becomes the API error.
pub(super) async fn call<R: Send + 'static>(
    st: &AppState,
    f: impl FnOnce(&ModelService) -> Result<R, ServiceError> + Send + 'static,
) -> Result<R, ApiError> {
    match st.blocking(f).await {
        Ok(r) => r.map_err(ApiError::from),
        Err(_) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            "the request's worker failed",
        )),
    }
}

/// A JSON 200 response.
fn ok(v: impl serde::Serialize) -> Response {
    axum::Json(v).into_response()
}
