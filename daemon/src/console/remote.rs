//! The remote backend: each command is one call to a daemon's REST API (the reference's paths,
//! `Authorization: Bearer` when an API key is given), over plain HTTP with a blocking `ureq`
//! agent. Results are reshaped where the REST answer differs from the MCP tool's result (delete,
//! blobs, traces), so both backends answer alike. A non-2xx answer becomes the server's error
//! message; an unreachable daemon is an error naming the URL, and the console keeps reading.

use std::time::Duration;

use serde_json::{json, Map, Value as Json};

use super::{Backend, Command};
use valem_core::path_segment;
use valem_mcp::ops::blob_json;

/// Time to open the connection to the daemon.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time for one whole call (a large evolve or restore can take a while).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest answer read: a 50 MiB blob, or a large state, with room to spare.
const MAX_RESPONSE_BYTES: u64 = 256 << 20;
/// Error bodies that are not JSON are quoted up to this many characters.
const MAX_ERROR_TEXT_CHARS: usize = 2000;

/// Why the remote backend could not start or a call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RemoteError {
    #[error(
        "--url must be an http:// or https:// base URL such as http://127.0.0.1:8080, not `{0}`"
    )]
    BadUrl(String),
    #[error("cannot reach the valem daemon at {url}: {detail} (is `valem serve` running there?)")]
    Unreachable { url: String, detail: String },
    #[error("the daemon at {url} did not answer within {secs} s")]
    Timeout { url: String, secs: u64 },
    #[error("the answer from {url} exceeds {MAX_RESPONSE_BYTES} bytes")]
    TooLarge { url: String },
    #[error("{method} {url} failed: {detail}")]
    Failed {
        method: &'static str,
        url: String,
        detail: String,
    },
    #[error("{method} {url} answered with a body that is not JSON: {detail}")]
    NotJson {
        method: &'static str,
        url: String,
        detail: String,
    },
    /// A non-2xx answer: the server's message.
    #[error("{0}")]
    Server(String),
    /// An argument the console checks before calling.
    #[error("{0}")]
    Argument(String),
}

/// Commands against a daemon's REST API.
pub struct Remote {
    agent: ureq::Agent,
    /// Without a trailing slash.
    base: String,
    authorization: Option<String>,
}

/// A request body.
pub(crate) enum Body {
    None,
    Json(Json),
    Raw {
        content_type: String,
        bytes: Vec<u8>,
    },
}

/// A 2xx answer.
pub(crate) struct Reply {
    content_type: Option<String>,
    pub(crate) bytes: Vec<u8>,
}

impl Remote {
    /// A backend for the daemon at `url` (e.g. `http://127.0.0.1:8080`, optionally with a
    /// path prefix).
    pub fn new(url: &str, api_key: Option<String>) -> Result<Remote, RemoteError> {
        let base = check_base_url(url)?;
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            // The daemon is reached directly; a proxy from the environment would intercept
            // loopback calls.
            .proxy(None)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .timeout_global(Some(CALL_TIMEOUT))
            .user_agent(concat!("valem-console/", env!("CARGO_PKG_VERSION")))
            .build()
            .new_agent();
        Ok(Remote {
            agent,
            base,
            authorization: api_key
                .filter(|k| !k.is_empty())
                .map(|k| format!("Bearer {k}")),
        })
    }

    /// The base URL, without a trailing slash.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// One call; the 2xx answer, else the server's message.
    pub(crate) fn call(
        &self,
        method: &'static str,
        path: &str,
        query: Option<(&str, &str)>,
        body: Body,
    ) -> Result<Reply, RemoteError> {
        let url = format!("{}{path}", self.base);
        let sent = match method {
            "GET" | "DELETE" => {
                let mut r = if method == "GET" {
                    self.agent.get(&url)
                } else {
                    self.agent.delete(&url)
                };
                if let Some((k, v)) = query {
                    // Our own encoding: `+` (an ISO-8601 offset) must not read as a space.
                    r = r.query_raw(path_segment(k), path_segment(v));
                }
                if let Some(a) = &self.authorization {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            _ => {
                let mut r = self.agent.post(&url);
                if let Some(a) = &self.authorization {
                    r = r.header("Authorization", a);
                }
                match body {
                    Body::None => r.send_empty(),
                    Body::Json(v) => r
                        .header("Content-Type", "application/json")
                        .send(serde_json::to_vec(&v).unwrap_or_default()),
                    Body::Raw {
                        content_type,
                        bytes,
                    } => r.header("Content-Type", &content_type).send(bytes),
                }
            }
        };
        let mut resp = sent.map_err(|e| self.transport_error(method, &url, e))?;
        let status = resp.status();
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_vec()
            .map_err(|e| self.transport_error(method, &url, e))?;
        if !status.is_success() {
            return Err(RemoteError::Server(server_message(
                method,
                &url,
                status.as_u16(),
                &bytes,
            )));
        }
        Ok(Reply {
            content_type,
            bytes,
        })
    }

    fn transport_error(&self, method: &'static str, url: &str, e: ureq::Error) -> RemoteError {
        match e {
            ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => RemoteError::Unreachable {
                url: self.base.clone(),
                detail: e.to_string(),
            },
            ureq::Error::Io(ref io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionRefused
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::NotConnected
                        | std::io::ErrorKind::AddrNotAvailable
                        | std::io::ErrorKind::HostUnreachable
                        | std::io::ErrorKind::NetworkUnreachable
                ) =>
            {
                RemoteError::Unreachable {
                    url: self.base.clone(),
                    detail: io.to_string(),
                }
            }
            ureq::Error::Timeout(_) => RemoteError::Timeout {
                url: self.base.clone(),
                secs: CALL_TIMEOUT.as_secs(),
            },
            ureq::Error::BodyExceedsLimit(_) => RemoteError::TooLarge {
                url: url.to_string(),
            },
            other => RemoteError::Failed {
                method,
                url: url.to_string(),
                detail: other.to_string(),
            },
        }
    }

    /// A call whose 2xx answer is JSON (an empty body is `null`).
    fn json(
        &self,
        method: &'static str,
        path: &str,
        query: Option<(&str, &str)>,
        body: Body,
    ) -> Result<Json, RemoteError> {
        let reply = self.call(method, path, query, body)?;
        if reply.bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Json::Null);
        }
        serde_json::from_slice(&reply.bytes).map_err(|e| RemoteError::NotJson {
            method,
            url: format!("{}{path}", self.base),
            detail: e.to_string(),
        })
    }

    fn get(&self, path: &str) -> Result<Json, RemoteError> {
        self.json("GET", path, None, Body::None)
    }

    fn post(&self, path: &str, body: Json) -> Result<Json, RemoteError> {
        self.json("POST", path, None, Body::Json(body))
    }

    /// A blob's bytes, in the download shape of the MCP tool.
    fn blob(&self, path: &str, blob_id: &str) -> Result<Json, RemoteError> {
        let reply = self.call("GET", path, None, Body::None)?;
        let media_type = reply
            .content_type
            .as_deref()
            .unwrap_or("application/octet-stream");
        Ok(blob_json(blob_id, media_type, &reply.bytes))
    }

    fn run(&self, cmd: &Command) -> Result<Json, RemoteError> {
        let m = |id: &str| format!("/models/{}", path_segment(id));
        match cmd {
            Command::ListModels => self.get("/models"),
            Command::CreateModel { spec } => {
                let created = self.post("/models", Json::Object(spec.clone()))?;
                // The reference answers {id, status: "created"}; the console's result is the
                // model info, as the MCP tool's.
                if created.get("version").is_some() {
                    return Ok(created);
                }
                let id = created
                    .get("id")
                    .and_then(Json::as_str)
                    .or_else(|| spec.get("id").and_then(Json::as_str))
                    .unwrap_or_default();
                self.get(&m(id))
            }
            Command::GetSpec { id } => self.get(&format!("{}/spec", m(id))),
            Command::GetInfo { id } => self.get(&m(id)),
            Command::GetState { id, at } => self.json(
                "GET",
                &format!("{}/state", m(id)),
                at.as_deref().map(|a| ("at", a)),
                Body::None,
            ),
            Command::GetField { id, path } => {
                self.get(&format!("{}/state/{}", m(id), path_segment(path)))
            }
            Command::Mutate {
                id,
                mutations,
                include_traces,
            } => {
                let r = self.post(
                    &format!("{}/mutations", m(id)),
                    Json::Object(mutations.clone()),
                )?;
                Ok(traces_on_request(r, *include_traces))
            }
            Command::PatchMutate {
                id,
                patch,
                include_traces,
            } => {
                let body = Body::Raw {
                    content_type: "application/json-patch+json".into(),
                    bytes: serde_json::to_vec(patch).unwrap_or_default(),
                };
                let r = self.json("POST", &format!("{}/mutations/patch", m(id)), None, body)?;
                Ok(traces_on_request(r, *include_traces))
            }
            Command::GetHistory { id } => self.get(&format!("{}/history", m(id))),
            Command::GetSchema { id, path } => {
                self.get(&format!("{}/schema/{}", m(id), path_segment(path)))
            }
            Command::Explain { id, path } => {
                self.get(&format!("{}/explain/{}", m(id), path_segment(path)))
            }
            Command::Snapshot { id } => {
                self.json("POST", &format!("{}/snapshot", m(id)), None, Body::None)
            }
            Command::Restore { id, snapshot } => self.post(
                &format!("{}/restore", m(id)),
                Json::Object(snapshot.clone()),
            ),
            Command::EvolveSpec { id, evolution } => self.post(
                &format!("{}/spec/evolve", m(id)),
                Json::Object(evolution.clone()),
            ),
            Command::DeleteModel { id } => {
                self.call("DELETE", &m(id), None, Body::None)?;
                Ok(json!({"deleted": true, "id": id}))
            }
            Command::UploadBlob { data, media_type } => {
                use base64::Engine;
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(data.trim())
                    .map_err(|e| {
                        RemoteError::Argument(format!("`data` is not valid base64: {e}"))
                    })?;
                let (content_type, body) = multipart(&bytes, media_type);
                self.json(
                    "POST",
                    "/blobs",
                    None,
                    Body::Raw {
                        content_type,
                        bytes: body,
                    },
                )
            }
            Command::GetBlob { blob_id } => {
                self.blob(&format!("/blobs/{}", path_segment(blob_id)), blob_id)
            }
            Command::GetModelBlob { id, blob_id } => self.blob(
                &format!("{}/blobs/{}", m(id), path_segment(blob_id)),
                blob_id,
            ),
            Command::GetView { id, view_id } => match view_id {
                None => self.get(&format!("{}/view", m(id))),
                Some(v) => self.get(&format!("{}/view/{}", m(id), path_segment(v))),
            },
            Command::Help | Command::Exit => Ok(Json::Object(Map::new())),
        }
    }
}

impl Backend for Remote {
    fn mode(&self) -> String {
        format!("remote {}", self.base)
    }

    fn execute(&mut self, cmd: &Command) -> Result<Json, String> {
        self.run(cmd).map_err(|e| e.to_string())
    }
}

/// The base URL without its trailing slash; `http://` or `https://` with a host.
fn check_base_url(url: &str) -> Result<String, RemoteError> {
    let trimmed = url.trim();
    let lower = trimmed.to_ascii_lowercase();
    let bad = || RemoteError::BadUrl(trimmed.to_string());
    if !(lower.starts_with("http://") || lower.starts_with("https://"))
        || trimmed.contains(['?', '#'])
    {
        return Err(bad());
    }
    let uri: ureq::http::Uri = trimmed.parse().map_err(|_| bad())?;
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad());
    }
    Ok(trimmed.trim_end_matches('/').to_string())
}

/// Drop `traces` unless asked for: the MCP tool's default shape.
fn traces_on_request(mut r: Json, include_traces: bool) -> Json {
    if !include_traces {
        if let Json::Object(m) = &mut r {
            m.shift_remove("traces");
        }
    }
    r
}

/// A `multipart/form-data` body with the parts `file` (the bytes) and `mediaType`; returns the
/// content type (with its boundary) and the body.
fn multipart(data: &[u8], media_type: &str) -> (String, Vec<u8>) {
    // A boundary derived from the content's hash cannot occur in the content (short of a
    // blake3 preimage) and keeps the body deterministic.
    let hash = blake3::hash(data).to_hex();
    let boundary = format!("valem-{}", &hash.as_str()[..32]);
    let mut body = Vec::with_capacity(data.len() + 512);
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"blob\"\r\nContent-Type: {media_type}\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(data);
    body.extend_from_slice(
        format!(
            "\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"mediaType\"\r\n\r\n{media_type}\r\n--{boundary}--\r\n"
        )
        .as_bytes(),
    );
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// The message of a non-2xx answer: the `error` string of a `{"error": …}` body (`error:
/// message` for `{"error", "message"}`), the `detail` of an RFC 7807 problem, a structured
/// failure as its compact JSON text (as the embedded backend gives it), or the quoted text of
/// any other body.
fn server_message(method: &str, url: &str, status: u16, body: &[u8]) -> String {
    if let Ok(Json::Object(m)) = serde_json::from_slice::<Json>(body) {
        let only = |k: &str| m.len() == 1 && m.get(k).is_some_and(Json::is_string);
        if only("error") || only("message") {
            if let Some(s) = m.values().next().and_then(Json::as_str) {
                return s.to_string();
            }
        }
        if m.len() == 2 {
            if let (Some(e), Some(msg)) = (
                m.get("error").and_then(Json::as_str),
                m.get("message").and_then(Json::as_str),
            ) {
                return format!("{e}: {msg}");
            }
        }
        if m.contains_key("title") || m.contains_key("status") {
            if let Some(d) = m
                .get("detail")
                .or_else(|| m.get("title"))
                .and_then(Json::as_str)
            {
                return d.to_string();
            }
        }
        return Json::Object(m).to_string();
    }
    let reason = ureq::http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        format!("{method} {url} answered {status} {reason} with an empty body")
    } else {
        let quoted: String = text.chars().take(MAX_ERROR_TEXT_CHARS).collect();
        format!("{method} {url} answered {status} {reason}: {quoted}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        assert_eq!(
            check_base_url("http://127.0.0.1:8080/"),
            Ok("http://127.0.0.1:8080".into())
        );
        assert_eq!(
            check_base_url("http://h/valem"),
            Ok("http://h/valem".into())
        );
        assert_eq!(check_base_url("https://h/"), Ok("https://h".into()));
        for bad in ["ftp://h", "127.0.0.1:8080", "http://", "http://h/?q", ""] {
            assert!(
                matches!(check_base_url(bad), Err(RemoteError::BadUrl(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn server_messages() {
        let msg = |b: &str| server_message("GET", "http://h/x", 404, b.as_bytes());
        assert_eq!(
            msg(r#"{"error":"model `m` not found"}"#),
            "model `m` not found"
        );
        assert_eq!(
            msg(
                r#"{"type":"about:blank","title":"Not Found","status":404,"detail":"Model not found: m"}"#
            ),
            "Model not found: m"
        );
        assert_eq!(
            msg(r#"{"error":"Schema violation","violations":[{"path":"$.n"}]}"#),
            r#"{"error":"Schema violation","violations":[{"path":"$.n"}]}"#
        );
        assert_eq!(
            msg(r#"{"error":"Not found","message":"no route for GET /x"}"#),
            "Not found: no route for GET /x"
        );
        assert_eq!(
            msg(""),
            "GET http://h/x answered 404 Not Found with an empty body"
        );
        assert_eq!(msg("nope"), "GET http://h/x answered 404 Not Found: nope");
    }

    #[test]
    fn multipart_body() {
        let (ct, body) = multipart(b"hello", "text/plain");
        let boundary = ct.trim_start_matches("multipart/form-data; boundary=");
        let text = String::from_utf8_lossy(&body);
        assert!(text.starts_with(&format!("--{boundary}\r\n")));
        assert!(text.contains(
            "name=\"file\"; filename=\"blob\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n"
        ));
        assert!(text.contains("name=\"mediaType\"\r\n\r\ntext/plain\r\n"));
        assert!(text.ends_with(&format!("--{boundary}--\r\n")));
    }

    #[test]
    fn unreachable_daemon_is_named() {
        // Port 1 on loopback: nothing listens there.
        let r = Remote::new("http://127.0.0.1:1", None).map(|r| r.run(&Command::ListModels));
        match r {
            Ok(Err(RemoteError::Unreachable { url, .. })) => {
                assert_eq!(url, "http://127.0.0.1:1")
            }
            other => panic!("expected Unreachable, got {other:?}"),
        }
    }
}
