//! Blob upload (multipart) and download (raw bytes with the blob's media type).

use axum::body::Bytes;
use axum::extract::{Multipart, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::extract::{check_declared_length, media_type, P};
use super::{call, ApiError};
use crate::AppState;
use valem_service::BlobRef;

fn multipart_error(status: StatusCode, text: String) -> ApiError {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(status, "too_large", "Payload too large", text)
    } else {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "malformed_body",
            "Malformed or unreadable request body",
            text,
        )
    }
}

/// `POST /blobs`: multipart field `file` (the content), optional field `mediaType` (else the
/// part's own content type, else `application/octet-stream`). 201 with the BlobRef.
pub(super) async fn upload(
    State(st): State<AppState>,
    headers: HeaderMap,
    mp: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<Response, ApiError> {
    if media_type(&headers).as_deref() != Some("multipart/form-data") {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Unsupported media type",
            "a blob is uploaded as `multipart/form-data` with the content in field `file`",
        ));
    }
    let limit = st
        .service
        .limits()
        .blob_max_bytes
        .saturating_add(super::MULTIPART_OVERHEAD);
    check_declared_length(&headers, limit, "--max-blob-bytes")?;
    let mut mp = mp.map_err(|r| multipart_error(r.status(), r.body_text()))?;
    let mut file: Option<(Bytes, Option<String>)> = None;
    let mut declared: Option<String> = None;
    while let Some(field) = mp
        .next_field()
        .await
        .map_err(|e| multipart_error(e.status(), e.body_text()))?
    {
        match field.name() {
            Some("file") => {
                let part_type = field.content_type().map(String::from);
                let data = field
                    .bytes()
                    .await
                    .map_err(|e| multipart_error(e.status(), e.body_text()))?;
                file = Some((data, part_type));
            }
            Some("mediaType") => {
                let t = field
                    .text()
                    .await
                    .map_err(|e| multipart_error(e.status(), e.body_text()))?;
                declared = Some(t.trim().to_string());
            }
            _ => {}
        }
    }
    let Some((data, part_type)) = file else {
        return Err(ApiError::bad_request(
            "no multipart field `file`: send the content in a part named `file`",
        ));
    };
    let media = declared.filter(|m| !m.is_empty()).or(part_type);
    if let Some(m) = &media {
        if !m.contains('/') || HeaderValue::from_str(m).is_err() {
            return Err(ApiError::bad_request(format!(
                "`mediaType` `{m}` is not a media type (e.g. image/png)"
            )));
        }
    }
    let r = call(&st, move |svc| svc.upload_blob(data.to_vec(), media)).await?;
    let mut res = (StatusCode::CREATED, axum::Json(&r)).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("/blobs/{}", r.blob_id)) {
        res.headers_mut().insert(header::LOCATION, v);
    }
    Ok(res)
}

/// The bytes with the blob's media type; a stored blob is never rendered as a page of ours.
fn raw(r: &BlobRef, bytes: std::sync::Arc<[u8]>) -> Response {
    let ct = HeaderValue::from_str(&r.media_type)
        .unwrap_or_else(|_| HeaderValue::from_static("application/octet-stream"));
    let mut res = Bytes::from_owner(bytes).into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, ct);
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("sandbox"),
    );
    res
}

pub(super) async fn download(
    State(st): State<AppState>,
    P(blob_id): P<String>,
) -> Result<Response, ApiError> {
    let (r, bytes) = call(&st, move |svc| svc.download_blob(&blob_id, None)).await?;
    Ok(raw(&r, bytes))
}

/// A blob, only when the model's current state references it.
pub(super) async fn model_blob(
    State(st): State<AppState>,
    P((id, blob_id)): P<(String, String)>,
) -> Result<Response, ApiError> {
    let (r, bytes) = call(&st, move |svc| svc.download_blob(&blob_id, Some(&id))).await?;
    Ok(raw(&r, bytes))
}
