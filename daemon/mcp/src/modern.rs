//! The modern era of MCP (revision 2026-07-28): no handshake; every request carries its
//! protocol version, the client's capabilities and, optionally, a log level in `_meta`. This
//! module reads that metadata, answers `server/discover`, and shapes every modern result
//! (`resultType`, the server's identity in `_meta`, the caching hints of list and read results).
//! The legacy era (an `initialize` handshake, revisions up to 2025-11-25) is served by the
//! session as before; a request selects the modern era by carrying the version in `_meta`.

use serde_json::{json, Value as Json};

use super::{code, level_rank, PROTOCOL_VERSIONS};

/// The modern revisions we speak (newest first).
pub const MODERN_VERSIONS: &[&str] = &["2026-07-28"];

/// `_meta` keys of the modern era.
pub mod key {
    pub const PROTOCOL_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
    pub const CLIENT_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";
    pub const CLIENT_INFO: &str = "io.modelcontextprotocol/clientInfo";
    pub const LOG_LEVEL: &str = "io.modelcontextprotocol/logLevel";
    pub const SERVER_INFO: &str = "io.modelcontextprotocol/serverInfo";
    pub const SUBSCRIPTION_ID: &str = "io.modelcontextprotocol/subscriptionId";
    /// The tasks extension's identifier (a capability under `extensions`).
    pub const TASKS: &str = "io.modelcontextprotocol/tasks";
}

/// Error codes the modern era adds (the range the MCP specification reserves).
pub mod codes {
    pub const HEADER_MISMATCH: i64 = -32020;
    pub const MISSING_REQUIRED_CLIENT_CAPABILITY: i64 = -32021;
    pub const UNSUPPORTED_PROTOCOL_VERSION: i64 = -32022;
}

/// What a modern request declares about itself in `_meta`.
#[derive(Clone, Debug, Default)]
pub struct Meta {
    /// The revision it speaks (one of [`MODERN_VERSIONS`]).
    pub version: &'static str,
    /// The client's capabilities for this request (`{}` when it declared none).
    pub capabilities: Json,
    /// The least severe log level the client wants for this request; no logs without one.
    pub log_floor: Option<usize>,
    /// W3C trace context (`traceparent`), carried into the daemon's tracing spans.
    pub traceparent: Option<String>,
}

impl Meta {
    /// Did the client declare this capability (`elicitation`, `sampling`, `roots`) on this request?
    pub fn can(&self, capability: &str) -> Option<&Json> {
        self.capabilities.get(capability)
    }

    /// Did the client declare this extension (`io.modelcontextprotocol/tasks`)?
    pub fn has_extension(&self, id: &str) -> bool {
        self.capabilities
            .get("extensions")
            .and_then(|e| e.get(id))
            .is_some()
    }

    /// Does the request's log floor admit `level`?
    pub fn logs(&self, level: &str) -> bool {
        self.log_floor
            .is_some_and(|f| level_rank(level).unwrap_or(1) >= f)
    }
}

/// Does this request select the modern era? It does when it names a protocol version in its
/// `_meta`, and `server/discover` always does (it exists only in the modern era).
pub fn selects_modern(method: &str, params: &Json) -> bool {
    method == "server/discover"
        || params
            .pointer("/_meta")
            .and_then(|m| m.get(key::PROTOCOL_VERSION))
            .is_some()
}

/// `UnsupportedProtocolVersionError` for `requested`.
pub fn unsupported_version(id: Json, requested: &str, why: &str) -> Json {
    json!({"jsonrpc": "2.0", "id": id, "error": {
        "code": codes::UNSUPPORTED_PROTOCOL_VERSION,
        "message": format!("Unsupported protocol version: {why}"),
        "data": {"supported": MODERN_VERSIONS, "requested": requested},
    }})
}

/// Read a modern request's `_meta`: it must name the version (one we speak per request) and
/// the client's capabilities (an object); a log level, when named, must be one of MCP's. The
/// error response otherwise: `-32602` for a missing or malformed field, and
/// `UnsupportedProtocolVersionError` for a version we do not speak this way.
pub fn read_meta(_method: &str, params: &Json, id: &Json) -> Result<Meta, Json> {
    let invalid = |m: String| json!({"jsonrpc": "2.0", "id": id, "error": {"code": code::INVALID_PARAMS, "message": m}});
    let meta = match params.get("_meta") {
        None | Some(Json::Null) => {
            return Err(invalid(format!(
                "Invalid params: the request has no `params._meta`; MCP {} requests carry \
                 `{}` and `{}` there",
                MODERN_VERSIONS[0],
                key::PROTOCOL_VERSION,
                key::CLIENT_CAPABILITIES
            )))
        }
        Some(Json::Object(m)) => m,
        Some(_) => {
            return Err(invalid(
                "Invalid params: `params._meta` must be an object".into(),
            ))
        }
    };
    let version = match meta.get(key::PROTOCOL_VERSION) {
        None | Some(Json::Null) => {
            return Err(invalid(format!(
                "Invalid params: `_meta` names no `{}`",
                key::PROTOCOL_VERSION
            )))
        }
        Some(Json::String(v)) => match MODERN_VERSIONS.iter().find(|m| **m == v) {
            Some(m) => m,
            None if PROTOCOL_VERSIONS.contains(&v.as_str()) => {
                return Err(unsupported_version(
                    id.clone(),
                    v,
                    &format!(
                        "{v} is a handshake revision: send `initialize` first to speak it, or \
                         use {} per request",
                        MODERN_VERSIONS[0]
                    ),
                ))
            }
            None => {
                return Err(unsupported_version(
                    id.clone(),
                    v,
                    &format!("this server does not speak {v}"),
                ))
            }
        },
        Some(_) => {
            return Err(invalid(format!(
                "Invalid params: `_meta[\"{}\"]` must be a string",
                key::PROTOCOL_VERSION
            )))
        }
    };
    let capabilities = match meta.get(key::CLIENT_CAPABILITIES) {
        Some(c @ Json::Object(_)) => c.clone(),
        None | Some(Json::Null) => {
            return Err(invalid(format!(
                "Invalid params: `_meta` names no `{}` (an empty object declares none)",
                key::CLIENT_CAPABILITIES
            )))
        }
        Some(_) => {
            return Err(invalid(format!(
                "Invalid params: `_meta[\"{}\"]` must be an object",
                key::CLIENT_CAPABILITIES
            )))
        }
    };
    let log_floor = match meta.get(key::LOG_LEVEL) {
        None | Some(Json::Null) => None,
        Some(Json::String(l)) => match level_rank(l) {
            Some(r) => Some(r),
            None => {
                return Err(invalid(format!(
                    "unknown log level `{l}` in `_meta[\"{}\"]`; use one of {}",
                    key::LOG_LEVEL,
                    super::LEVELS.join(", ")
                )))
            }
        },
        Some(_) => {
            return Err(invalid(format!(
                "`_meta[\"{}\"]` must be a string",
                key::LOG_LEVEL
            )))
        }
    };
    let traceparent = meta
        .get("traceparent")
        .and_then(Json::as_str)
        .filter(|t| t.len() <= 128)
        .map(str::to_string);
    Ok(Meta {
        version,
        capabilities,
        log_floor,
        traceparent,
    })
}

/// The server's identity, as results carry it in `_meta`.
pub fn server_info() -> Json {
    json!({
        "name": "valem",
        "title": "valem — reactive JSON models",
        "version": env!("CARGO_PKG_VERSION"),
    })
}

/// How long, and for whom, a client or an intermediary may keep a result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cache {
    /// The same for every caller and stable while the server runs (tools, guides, schemas).
    Public { ttl_ms: u64 },
    /// Depends on the caller or changes with every write (model lists and states).
    Private { ttl_ms: u64 },
}

/// Tool, prompt and template lists, guides, schemas and examples: an hour.
pub const LONG: Cache = Cache::Public { ttl_ms: 3_600_000 };
/// A model's state or the list of models: it changes with every write.
pub const SHORT: Cache = Cache::Private { ttl_ms: 0 };

/// A modern result: `resultType` (`complete` unless the result names another), the server's
/// identity in `_meta`, and the caching hints when the method is cacheable.
pub fn finish(mut result: Json, cache: Option<Cache>) -> Json {
    let Json::Object(r) = &mut result else {
        return result;
    };
    r.entry("resultType").or_insert_with(|| json!("complete"));
    let meta = r.entry("_meta").or_insert_with(|| json!({}));
    if let Json::Object(m) = meta {
        m.entry(key::SERVER_INFO).or_insert_with(server_info);
    }
    if let Some(c) = cache {
        let (ttl, scope) = match c {
            Cache::Public { ttl_ms } => (ttl_ms, "public"),
            Cache::Private { ttl_ms } => (ttl_ms, "private"),
        };
        r.entry("ttlMs").or_insert_with(|| json!(ttl));
        r.entry("cacheScope").or_insert_with(|| json!(scope));
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(meta: Json) -> Json {
        json!({"_meta": meta})
    }

    #[test]
    fn the_version_in_meta_selects_the_era() {
        assert!(selects_modern("server/discover", &json!({})));
        assert!(selects_modern(
            "tools/list",
            &params(json!({key::PROTOCOL_VERSION: "2026-07-28"}))
        ));
        assert!(!selects_modern(
            "tools/list",
            &params(json!({"progressToken": 1}))
        ));
        assert!(!selects_modern("tools/list", &json!({})));
    }

    #[test]
    fn meta_is_read_and_checked() {
        let id = json!(1);
        let m = read_meta(
            "tools/call",
            &params(json!({key::PROTOCOL_VERSION: "2026-07-28",
                key::CLIENT_CAPABILITIES: {"elicitation": {"url": {}}, "extensions": {key::TASKS: {}}},
                key::LOG_LEVEL: "warning", "traceparent": "00-abc-def-01"})),
            &id,
        )
        .unwrap();
        assert_eq!(m.version, "2026-07-28");
        assert!(m.can("elicitation").is_some() && m.can("sampling").is_none());
        assert!(m.has_extension(key::TASKS));
        assert!(m.logs("error") && !m.logs("info"));
        assert_eq!(m.traceparent.as_deref(), Some("00-abc-def-01"));

        // No log level: no logs at all.
        let quiet = read_meta(
            "tools/list",
            &params(json!({key::PROTOCOL_VERSION: "2026-07-28", key::CLIENT_CAPABILITIES: {}})),
            &id,
        )
        .unwrap();
        assert!(!quiet.logs("emergency"));

        for (version, requested) in [
            (json!("1900-01-01"), "1900-01-01"),
            (json!("2025-11-25"), "2025-11-25"),
        ] {
            let e = read_meta(
                "tools/list",
                &params(json!({key::PROTOCOL_VERSION: version, key::CLIENT_CAPABILITIES: {}})),
                &id,
            )
            .unwrap_err();
            assert_eq!(e["error"]["code"], codes::UNSUPPORTED_PROTOCOL_VERSION);
            assert_eq!(e["error"]["data"]["requested"], requested);
            assert_eq!(e["error"]["data"]["supported"], json!(MODERN_VERSIONS));
        }
        let bad_level = read_meta(
            "tools/list",
            &params(
                json!({key::PROTOCOL_VERSION: "2026-07-28", key::CLIENT_CAPABILITIES: {},
                key::LOG_LEVEL: "loud"}),
            ),
            &id,
        )
        .unwrap_err();
        assert_eq!(bad_level["error"]["code"], code::INVALID_PARAMS);
        assert!(bad_level["error"]["message"]
            .as_str()
            .unwrap()
            .contains("loud"));
        // Missing or malformed fields are invalid params, naming the field.
        for (p, needle) in [
            (json!({}), "no `params._meta`"),
            (
                params(json!({key::CLIENT_CAPABILITIES: {}})),
                key::PROTOCOL_VERSION,
            ),
            (
                params(json!({key::PROTOCOL_VERSION: "2026-07-28"})),
                key::CLIENT_CAPABILITIES,
            ),
            (
                params(json!({key::PROTOCOL_VERSION: 20260728, key::CLIENT_CAPABILITIES: {}})),
                "string",
            ),
        ] {
            let e = read_meta("server/discover", &p, &id).unwrap_err();
            assert_eq!(e["error"]["code"], code::INVALID_PARAMS, "{p}");
            assert!(
                e["error"]["message"].as_str().unwrap().contains(needle),
                "{e}"
            );
        }
    }

    #[test]
    fn results_carry_their_type_identity_and_cache_hints() {
        let r = finish(json!({"tools": []}), Some(LONG));
        assert_eq!(r["resultType"], "complete");
        assert_eq!(r["_meta"][key::SERVER_INFO]["name"], "valem");
        assert_eq!(r["ttlMs"], 3_600_000);
        assert_eq!(r["cacheScope"], "public");
        let s = finish(json!({"contents": []}), Some(SHORT));
        assert_eq!(
            (s["ttlMs"].clone(), s["cacheScope"].clone()),
            (json!(0), json!("private"))
        );
        // A result that names its own type keeps it.
        let i = finish(json!({"resultType": "input_required"}), None);
        assert_eq!(i["resultType"], "input_required");
        assert!(i.get("ttlMs").is_none());
    }
}
