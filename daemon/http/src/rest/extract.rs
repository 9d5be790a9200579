//! Extractors whose rejections are [`ApiError`]s (JSON bodies), replacing axum's plain-text
//! ones: path and query parameters, and JSON bodies with a required media type.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{json, Value as Json};

use super::ApiError;
use crate::AppState;
use valem_service::time::parse_iso;

/// Path parameters (percent-decoded).
pub(crate) struct P<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for P<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(t)| P(t))
            .map_err(|r| ApiError::bad_request(r.body_text()))
    }
}

/// Query parameters as a map (unknown ones are ignored by the handlers).
pub(crate) struct Params(pub HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for Params {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| Params(q))
            .map_err(|r| ApiError::bad_request(r.body_text()))
    }
}

impl Params {
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// A positive integer parameter.
    pub(crate) fn positive(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(Some(n)),
                _ => Err(ApiError::bad_request(format!(
                    "`{name}` must be a positive integer, got `{v}`"
                ))),
            },
        }
    }

    /// An ISO-8601 instant parameter (400 when unparseable).
    pub(crate) fn instant(&self, name: &str) -> Result<Option<valem_service::Timestamp>, ApiError> {
        self.get(name)
            .map(|v| parse_iso(v).map_err(|m| ApiError::bad_request(format!("`{name}`: {m}"))))
            .transpose()
    }
}

/// A JSON request body (`Content-Type: application/json`).
pub(crate) struct JsonBody(pub Json);

/// A ModelSpec body (`Content-Type: application/json`): a copy under another id of a spec
/// created before (see [`valem_service::PreparedSpec`]), the spec when it parses straight from
/// the bytes (with the key of its members after a leading `id`, to be remembered by), else the
/// JSON value (for the located error of `parse_spec`).
pub(crate) enum SpecBody {
    Copy {
        id: String,
        of: std::sync::Arc<valem_service::PreparedSpec>,
    },
    Spec(Box<valem_core::spec::ModelSpec>, Option<[u8; 32]>),
    Json(Json),
}

/// The largest body whose spec is remembered for copies.
const REMEMBERED_BODY_BYTES: usize = 1 << 20;

impl FromRequest<AppState> for SpecBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        check_media(req.headers(), "application/json")?;
        let bytes = body_bytes(req, state).await?;
        let leading = (bytes.len() <= REMEMBERED_BODY_BYTES)
            .then(|| valem_core::spec::split_leading_id(&bytes))
            .flatten()
            .map(|(id, rest)| (id, *blake3::hash(rest).as_bytes()));
        if let Some((id, key)) = &leading {
            if let Some(of) = state.service.prepared(key) {
                return Ok(SpecBody::Copy { id: id.clone(), of });
            }
        }
        if let Some(spec) = valem_core::spec::parse_spec_slice(&bytes) {
            // Remembered only when the id it was keyed by is the spec's.
            let key = leading.filter(|(id, _)| *id == spec.id).map(|(_, k)| k);
            return Ok(SpecBody::Spec(Box::new(spec), key));
        }
        serde_json::from_slice(&bytes)
            .map(SpecBody::Json)
            .map_err(|e| malformed(&e))
    }
}

/// An RFC 6902 JSON Patch body (`Content-Type: application/json-patch+json`).
pub(crate) struct PatchBody(pub Json);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        json_body(req, state, "application/json")
            .await
            .map(JsonBody)
    }
}

impl FromRequest<AppState> for PatchBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        json_body(req, state, "application/json-patch+json")
            .await
            .map(PatchBody)
    }
}

/// The media type of a request (`type/subtype`, lowercase, parameters dropped).
pub(crate) fn media_type(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    Some(v.split(';').next()?.trim().to_ascii_lowercase())
}

/// 415 unless the request's media type is `media`.
fn check_media(headers: &HeaderMap, media: &'static str) -> Result<(), ApiError> {
    match media_type(headers) {
        Some(m) if m == media => Ok(()),
        got => Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Unsupported media type",
            format!(
                "the body must be sent as `Content-Type: {media}` (got {})",
                got.map_or("no Content-Type".to_string(), |g| format!("`{g}`"))
            ),
        )),
    }
}

async fn json_body(req: Request, state: &AppState, media: &'static str) -> Result<Json, ApiError> {
    check_media(req.headers(), media)?;
    let bytes = body_bytes(req, state).await?;
    serde_json::from_slice(&bytes).map_err(|e| malformed(&e))
}

fn too_large(limit: usize, flag: &str) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "too_large",
        "Payload too large",
        format!("the request body exceeds the server's limit of {limit} bytes ({flag})"),
    )
}

/// Whether the request declares a `Content-Length` over `limit` (refused before a byte of the
/// body is read; the limit on the body stream catches undeclared lengths).
pub(crate) fn declares_over(headers: &HeaderMap, limit: usize) -> bool {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > limit as u64)
}

/// 413 for a body whose declared `Content-Length` is over `limit`.
pub(crate) fn check_declared_length(
    headers: &HeaderMap,
    limit: usize,
    flag: &str,
) -> Result<(), ApiError> {
    if declares_over(headers, limit) {
        Err(too_large(limit, flag))
    } else {
        Ok(())
    }
}

/// The request body, within `--max-body-bytes` (413 past it).
async fn body_bytes(req: Request, state: &AppState) -> Result<Bytes, ApiError> {
    let limit = state.config.max_body_bytes;
    check_declared_length(req.headers(), limit, "--max-body-bytes")?;
    Bytes::from_request(req, state).await.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            too_large(limit, "--max-body-bytes")
        } else {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "malformed_body",
                "Malformed or unreadable request body",
                r.body_text(),
            )
        }
    })
}

/// 400 for a body that is not JSON, with the parser's position.
fn malformed(e: &serde_json::Error) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "malformed_body",
        body: json!({
            "error": "Malformed or unreadable request body",
            "message": e.to_string(),
            "line": e.line(),
            "column": e.column(),
        }),
    }
}

/// 400 for a JSON body of the wrong shape (`expected` names what was wanted).
pub(crate) fn wrong_shape(expected: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "malformed_body",
        "Malformed or unreadable request body",
        format!("the body must be {expected}"),
    )
}
