//! `/models…` handlers: translate the request into one ModelService call (on the blocking
//! pool) and its result into the reference's response.

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value as Json};

use super::extract::{wrong_shape, JsonBody, Params, PatchBody, SpecBody, P};
use super::{call, ok, ApiError};
use crate::AppState;
use valem_core::spec::{parse_evolution_checked, parse_spec, SpecParseError};
use valem_service::Finding;
use valem_service::MutationError;
use valem_service::{
    mutation_list, AuditQuery, Change, IdempotencyKey, ModelId, ServiceError, Viewed,
};

/// The header naming the view whose evaluated components a mutation response carries.
const VIEW_HEADER: &str = "x-view";
const IDEMPOTENCY_HEADER: &str = "idempotency-key";
/// On the answer to a write sent again under its idempotency key (the IETF draft's name, as
/// Stripe and others answer).
const REPLAYED_HEADER: &str = "idempotent-replayed";

fn parse_finding(e: &SpecParseError) -> Finding {
    Finding {
        location: e.location(),
        message: e.message(),
    }
}

pub(super) async fn list(State(st): State<AppState>) -> Result<Response, ApiError> {
    Ok(ok(call(&st, |svc| svc.list()).await?))
}

pub(super) async fn create(State(st): State<AppState>, body: SpecBody) -> Response {
    let (parsed, key) = match body {
        SpecBody::Copy { id, of } => {
            return created(st.service.create_copy(id, of).await.map_err(ApiError::from))
        }
        SpecBody::Spec(spec, key) => (Ok(*spec), key),
        SpecBody::Json(json) => (parse_spec(&json), None),
    };
    let spec = match parsed {
        Ok(s) => s,
        Err(e) => {
            let f = parse_finding(&e);
            let message = format!("invalid spec at {}: {}", f.location, f.message);
            return ApiError::findings("Invalid spec", message, &[f]).into_response();
        }
    };
    // A spec to materialize over its template reads the template's spec first (on a thread);
    // any other is queued on its shard straight away, and its answer awaited.
    created(if spec.template.is_some() && spec.lineage.is_empty() {
        call(&st, move |svc| svc.create(spec)).await
    } else {
        st.service
            .create_queued(spec, key)
            .await
            .map_err(ApiError::from)
    })
}

/// The response to a creation.
fn created(created: Result<valem_service::ModelInfo, ApiError>) -> Response {
    match created {
        Ok(info) => {
            let mut r = (
                StatusCode::CREATED,
                axum::Json(json!({"id": info.id, "status": "created"})),
            )
                .into_response();
            // Ids are `[namespace/]name`: the namespace separator is the only character to escape.
            let location = format!("/models/{}", info.id.replace('/', "%2F"));
            if let Ok(v) = HeaderValue::from_str(&location) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
        Err(e) => e.into_response(),
    }
}

pub(super) async fn info(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    Ok(ok(st.service.info(&id).await?))
}

pub(super) async fn delete(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    let owned = id.clone();
    call(&st, move |svc| svc.delete(&owned)).await?;
    Ok(ok(json!({"deleted": true, "id": id})))
}

pub(super) async fn spec(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    let spec = st.service.spec(&id).await?;
    Ok(ok(&*spec))
}

pub(super) async fn library(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    match st.service.library(&id).await? {
        Some(lib) => Ok(ok(lib)),
        None => Err(ApiError::not_found(format!("model `{id}` has no library"))),
    }
}

/// The pinned ancestor chain of a branch; `[]` for a model that is not one.
pub(super) async fn lineage(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    let spec = st.service.spec(&id).await?;
    Ok(ok(&spec.lineage))
}

/// The `Idempotency-Key` header, when sent: the write is applied once however often it is
/// sent with this key.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, ApiError> {
    let what = "the Idempotency-Key header";
    match headers.get(IDEMPOTENCY_HEADER) {
        None => Ok(None),
        Some(v) => {
            let text = v
                .to_str()
                .map_err(|_| ApiError::bad_request(format!("{what} must be printable ASCII")))?;
            Ok(Some(IdempotencyKey::parse(text, what)?))
        }
    }
}

/// The `X-View` header, when sent.
fn view_header(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    match headers.get(VIEW_HEADER) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim().to_string()))
            .map_err(|_| ApiError::bad_request("the X-View header is not valid text")),
    }
}

/// Every component of an evaluated view keyed by its id, nested ones included (the
/// reference's `Map<String, EvaluatedComponent>`).
fn components_by_id(view: &Json) -> Map<String, Json> {
    fn walk(list: Option<&Json>, out: &mut Map<String, Json>) {
        for c in list.and_then(Json::as_array).into_iter().flatten() {
            if let Some(id) = c.get("id").and_then(Json::as_str) {
                out.insert(id.to_string(), c.clone());
            }
            walk(c.get("components"), out);
        }
    }
    let mut out = Map::new();
    walk(view.get("components"), &mut out);
    out
}

/// Answer a committed write: the MutationResponse, with `viewDelta` when a view was asked for
/// (or `viewError` when it did not evaluate: the write stays committed).
fn mutation_response(out: Viewed) -> Response {
    let mut body = out.result.to_json(true);
    match out.view {
        None => {}
        Some(Ok(v)) => body["viewDelta"] = Json::Object(components_by_id(&v)),
        Some(Err(e)) => body["viewError"] = json!(e.to_string()),
    }
    let mut r = ok(body);
    if out.replayed {
        r.headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    r
}

/// A write and, with `X-View`, that view of the state it committed: one shard job, awaited
/// (the worker serves other connections meanwhile).
async fn write(
    st: &AppState,
    id: &ModelId,
    headers: &HeaderMap,
    change: Change,
) -> Result<Response, ApiError> {
    let view = view_header(headers)?;
    let key = idempotency_key(headers)?;
    let out = st.service.write_once(id, change, view, key).await?;
    Ok(mutation_response(out))
}

pub(super) async fn mutate(
    State(st): State<AppState>,
    P(id): P<ModelId>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let Json::Object(m) = body else {
        return Err(wrong_shape(
            "a flat JSON object of `\"$.path\": value` mutations",
        ));
    };
    write(&st, &id, &headers, Change::Mutations(mutation_list(&m))).await
}

pub(super) async fn patch(
    State(st): State<AppState>,
    P(id): P<ModelId>,
    headers: HeaderMap,
    PatchBody(body): PatchBody,
) -> Result<Response, ApiError> {
    let patch = valem_service::parse_patch(body).map_err(|e| {
        ApiError::from(ServiceError::Mutation(MutationError::Invalid(
            e.to_string(),
        )))
    })?;
    write(&st, &id, &headers, Change::Patch(patch)).await
}

pub(super) async fn state(
    State(st): State<AppState>,
    P(id): P<ModelId>,
    q: Params,
) -> Result<Response, ApiError> {
    let at = q.instant("at")?;
    Ok(ok(st.service.state(&id, at).await?))
}

pub(super) async fn field(
    State(st): State<AppState>,
    P((id, path)): P<(ModelId, String)>,
) -> Result<Response, ApiError> {
    let (i, p) = (id.clone(), path.clone());
    match st.service.field(&i, &p).await? {
        Some(v) => Ok(ok(v)),
        None => Err(ApiError::not_found(format!(
            "`{path}` has no value in model `{id}`"
        ))),
    }
}

pub(super) async fn history(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    Ok(ok(st.service.history(&id).await?))
}

pub(super) async fn schema(
    State(st): State<AppState>,
    P((id, path)): P<(ModelId, String)>,
) -> Result<Response, ApiError> {
    Ok(ok(st.service.effective_schema(&id, &path).await?))
}

pub(super) async fn explain(
    State(st): State<AppState>,
    P((id, path)): P<(ModelId, String)>,
    q: Params,
) -> Result<Response, ApiError> {
    let limit = q.positive("limit")?;
    Ok(ok(st.service.explain(&id, &path, limit).await?))
}

pub(super) async fn graph(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    Ok(ok(st.service.graph(&id).await?))
}

pub(super) async fn verification(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    let report = st.service.verification(&id).await?;
    Ok(ok(&*report))
}

pub(super) async fn audit(
    State(st): State<AppState>,
    P(id): P<ModelId>,
    q: Params,
) -> Result<Response, ApiError> {
    let query = AuditQuery {
        path_prefix: q.get("path").map(String::from),
        from: q.instant("from")?,
        to: q.instant("to")?,
        limit: q.positive("limit")?,
    };
    Ok(ok(call(&st, move |svc| svc.audit(&id, query)).await?))
}

pub(super) async fn verify_audit(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    Ok(ok(call(&st, move |svc| svc.verify_audit(&id)).await?))
}

pub(super) async fn snapshot(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    Ok(ok(st.service.snapshot(&id).await?))
}

pub(super) async fn restore(
    State(st): State<AppState>,
    P(id): P<ModelId>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    if !body.is_object() {
        return Err(wrong_shape(
            "a Snapshot object, as POST /snapshot returned it",
        ));
    }
    Ok(ok(st.service.restore(&id, body).await?))
}

pub(super) async fn evolve(
    State(st): State<AppState>,
    P(id): P<ModelId>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let (evo, warnings) = parse_evolution_checked(&body).map_err(|e| {
        let f = parse_finding(&e);
        let message = format!("invalid evolution at {}: {}", f.location, f.message);
        ApiError::findings("Invalid evolution", message, &[f])
    })?;
    let info = st.service.evolve(&id, evo).await?;
    if warnings.is_empty() {
        return Ok(ok(info));
    }
    let mut body = serde_json::json!(info);
    body["warnings"] = serde_json::json!(warnings);
    Ok(ok(body))
}

pub(super) async fn view(
    State(st): State<AppState>,
    P(id): P<ModelId>,
) -> Result<Response, ApiError> {
    Ok(ok(st.service.view(&id, None).await?))
}

pub(super) async fn named_view(
    State(st): State<AppState>,
    P((id, view_id)): P<(ModelId, String)>,
) -> Result<Response, ApiError> {
    Ok(ok(st.service.view(&id, Some(&view_id)).await?))
}
