//! Session scope against the real daemon: a paired sandbox session (`X-Session-Token`) sees and
//! touches its own namespace only. Each test replays an attack found by an adversarial run —
//! a branch whose `template.ref` names another model, effect links to another model, blobs by
//! id — and checks that the daemon answers with a clear error, stays up, and leaves the
//! operator's models as they were, while an operator (API key) keeps today's behaviour.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valem_tests::{Daemon, Http, Reply};

const KEY: &str = "k3y-for-scope-tests";

fn daemon() -> Daemon {
    Daemon::start(&["--api-key", KEY, "--pairing-interval", "1"])
}

/// A paired session's token (the device flow, as an agent and the page run it).
fn pair(d: &Daemon) -> String {
    valem_tests::paired_token(d, KEY)
}

/// REST as a paired session: every request carries the token, never the API key.
struct Session {
    http: Http,
    token: String,
}

impl Session {
    fn new(d: &Daemon) -> Session {
        Session {
            http: Http::new(d),
            token: pair(d),
        }
    }

    fn get(&self, path: &str) -> Reply {
        self.http
            .get_with(path, &[("X-Session-Token", self.token.as_str())])
    }

    fn post_json(&self, path: &str, v: &Value) -> Reply {
        self.http.post(
            path,
            &[
                ("Content-Type", "application/json"),
                ("X-Session-Token", self.token.as_str()),
            ],
            v.to_string().as_bytes(),
        )
    }
}

/// Streamable HTTP MCP as a paired session.
struct McpSession<'a> {
    s: &'a Session,
    id: String,
}

impl<'a> McpSession<'a> {
    fn open(s: &'a Session) -> McpSession<'a> {
        let r = s.http.post(
            "/mcp",
            &[
                ("Content-Type", "application/json"),
                ("Accept", "application/json, text/event-stream"),
                ("X-Session-Token", s.token.as_str()),
            ],
            json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": "2025-11-25", "capabilities": {}}})
            .to_string()
            .as_bytes(),
        );
        assert_eq!(r.status, 200, "{r:?}");
        let id = r
            .header("mcp-session-id")
            .expect("Mcp-Session-Id")
            .to_string();
        let m = McpSession { s, id };
        let n = m.post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        assert_eq!(n.status, 202, "{n:?}");
        m
    }

    fn post(&self, msg: &Value) -> Reply {
        self.s.http.post(
            "/mcp",
            &[
                ("Content-Type", "application/json"),
                ("Accept", "application/json, text/event-stream"),
                ("X-Session-Token", self.s.token.as_str()),
                ("Mcp-Session-Id", self.id.as_str()),
                ("MCP-Protocol-Version", "2025-11-25"),
            ],
            msg.to_string().as_bytes(),
        )
    }

    /// `tools/call`: the result (the reply itself may come as one SSE event).
    fn tool(&self, name: &str, args: Value) -> Value {
        let r = self.post(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": name, "arguments": args}}));
        assert_eq!(r.status, 200, "{r:?}");
        let reply = if r
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream"))
        {
            r.text()
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
                .find(|m| m.get("id").is_some())
                .expect("a reply event")
        } else {
            r.json()
        };
        reply["result"].clone()
    }
}

fn text(result: &Value) -> String {
    result["content"][0]["text"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// The operator's model the attacks aim at: constants a session must never read, state it must
/// never write.
fn operator_models(keyed: &Http) -> Value {
    let secret = json!({
        "id": "secret",
        "schema": {"type": "object", "properties": {"amount": {"type": "number"}}},
        "constants": {"apiKey": "hunter2-operator-only"},
        "derivations": [{"path": "$.doubled", "expr": "amount * 2"}]
    });
    assert_eq!(keyed.post_json("/models", &secret).status, 201);
    let w = keyed.post_json("/models/secret/mutations", &json!({"$.amount": 5}));
    assert_eq!(w.status, 200, "{w:?}");
    keyed.get("/models/secret/state").json()
}

/// The operator's model is as it was, and the daemon still answers.
fn untouched(d: &Daemon, keyed: &Http, before: &Value) {
    assert_eq!(keyed.get("/healthz").status, 200);
    assert_eq!(&keyed.get("/models/secret/state").json(), before);
    let audit = keyed.get("/models/secret/audit").json();
    assert_eq!(
        audit.as_array().map(Vec::len),
        Some(1),
        "only the operator's own write: {audit}"
    );
    let _ = d;
}

#[test]
fn a_sessions_template_ref_resolves_only_inside_its_namespace() {
    let d = daemon();
    let keyed = Http::new(&d).with_key(KEY);
    let before = operator_models(&keyed);
    let s = Session::new(&d);

    // The attack: branch the operator's model to read its spec (constants included).
    let branch = |reference: &str| json!({"id": "b", "schema": {"type": "object"}, "template": {"ref": reference}});
    let leak = s.post_json("/models", &branch("secret"));
    assert_eq!(leak.status, 422, "{leak:?}");
    let missing = s.post_json("/models", &branch("no-such-model"));
    assert_eq!(missing.status, 422, "{missing:?}");
    // Exactly the error a nonexistent template gets, naming only what the session sent.
    assert_eq!(
        leak.text().replace("secret", "X"),
        missing.text().replace("no-such-model", "X"),
    );
    let message = leak.json()["message"].as_str().unwrap_or("").to_string();
    assert!(
        message.contains("template `secret` is not a model of this daemon"),
        "{message}"
    );
    assert!(!leak.text().contains("hunter2"), "{leak:?}");
    assert_eq!(s.get("/models/b").status, 404, "nothing was created");

    // The same over MCP.
    let mcp = McpSession::open(&s);
    let r = mcp.tool("create_model", json!({"spec": branch("secret")}));
    assert_eq!(r["isError"], true, "{r}");
    let t = text(&r);
    assert!(
        t.contains("template `secret` is not a model of this daemon") && !t.contains("hunter2"),
        "{t}"
    );
    let r2 = mcp.tool("create_model", json!({"spec": branch("no-such-model")}));
    assert_eq!(
        t.replace("secret", "X"),
        text(&r2).replace("no-such-model", "X")
    );

    // A session branches its own models: the reference is its own id.
    let base = json!({"id": "base", "schema": {"type": "object"}, "constants": {"rate": 3},
        "derivations": [{"path": "$.y", "expr": "x * $const.rate"}]});
    assert_eq!(s.post_json("/models", &base).status, 201);
    let own = s.post_json("/models", &branch("base"));
    assert_eq!(own.status, 201, "{own:?}");
    let spec = s.get("/models/b/spec").json();
    assert_eq!(spec["constants"]["rate"], 3, "{spec}");
    assert_eq!(spec["lineage"][0]["ref"], "base", "{spec}");
    let lineage = s.get("/models/b/lineage").json();
    assert_eq!(lineage[0]["ref"], "base", "{lineage}");
    assert!(
        !spec.to_string().contains("__"),
        "no namespace shown: {spec}"
    );

    // The operator keeps today's behaviour: any model of the daemon is a template.
    let op = keyed.post_json(
        "/models",
        &json!({"id": "opbranch", "schema": {"type": "object"}, "template": {"ref": "secret"}}),
    );
    assert_eq!(op.status, 201, "{op:?}");
    assert_eq!(
        keyed.get("/models/opbranch/spec").json()["constants"]["apiKey"],
        "hunter2-operator-only"
    );
    untouched(&d, &keyed, &before);
}

/// Poll a session's model until `ok` holds (bounded).
fn wait_state(s: &Session, id: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let st = s.get(&format!("/models/{id}/state")).json();
        if ok(&st) {
            return st;
        }
        assert!(Instant::now() < deadline, "{what}: state stayed {st}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_sessions_effect_links_reach_only_its_own_models() {
    let d = daemon();
    let keyed = Http::new(&d).with_key(KEY);
    let before = operator_models(&keyed);
    let s = Session::new(&d);
    let link = |id: &str, target: &str| {
        json!({
            "id": id,
            "schema": {"type": "object"},
            "effects": [
                {"id": "write", "executor": "server", "trigger": "go != null", "dedupeKey": "go",
                 "target": {"ref": target, "path": "$.amount"}, "body": "1000", "statusPath": "$.w"},
                {"id": "read", "executor": "server", "trigger": "go != null", "dedupeKey": "go",
                 "target": {"ref": target, "read": "$.doubled"},
                 "response": {"set": {"$.seen": "$response"}}, "statusPath": "$.r"}
            ]
        })
    };
    // The attack: a write-link and a read-link aimed at the operator's model, and the same
    // aimed at a model that does not exist.
    for (id, target) in [("attack", "secret"), ("control", "no-such-model")] {
        assert_eq!(s.post_json("/models", &link(id, target)).status, 201);
        let w = s.post_json(&format!("/models/{id}/mutations"), &json!({"$.go": 1}));
        assert_eq!(w.status, 200, "{w:?}");
    }
    let done = |st: &Value| st["w"]["phase"] == "failed" && st["r"]["phase"] == "failed";
    let attack = wait_state(&s, "attack", "links refused", done);
    let control = wait_state(&s, "control", "links refused", done);
    for at in ["w", "r"] {
        let e = attack[at]["error"].as_str().unwrap_or("");
        assert_eq!(
            e, "link target `secret` is not a model of this daemon",
            "{attack}"
        );
        assert_eq!(
            e.replace("secret", "X"),
            control[at]["error"]
                .as_str()
                .unwrap_or("")
                .replace("no-such-model", "X")
        );
    }
    assert!(attack.get("seen").is_none(), "{attack}");

    // Links between a session's own models work, by its own ids.
    let ledger = json!({"id": "secret", "schema": {"type": "object"},
        "derivations": [{"path": "$.doubled", "expr": "amount * 2"}]});
    assert_eq!(s.post_json("/models", &ledger).status, 201);
    assert_eq!(s.post_json("/models", &link("mine", "secret")).status, 201);
    let w = s.post_json("/models/mine/mutations", &json!({"$.go": 1}));
    assert_eq!(w.status, 200, "{w:?}");
    wait_state(&s, "mine", "own links applied", |st| {
        st["w"]["phase"] == "applied" && st["r"]["phase"] == "applied"
    });
    assert_eq!(s.get("/models/secret/state").json()["amount"], 1000);
    untouched(&d, &keyed, &before);
}

#[test]
fn a_session_restores_its_own_snapshot_over_rest() {
    let d = daemon();
    let s = Session::new(&d);
    let m = json!({"id": "m", "schema": {"type": "object"}});
    assert_eq!(s.post_json("/models", &m).status, 201);
    assert_eq!(
        s.post_json("/models/m/mutations", &json!({"$.a": 1}))
            .status,
        200
    );
    let snap = s.post_json("/models/m/snapshot", &json!({}));
    assert_eq!(snap.status, 200, "{snap:?}");
    let snap = snap.json();
    assert_eq!(snap["modelId"], "m", "{snap}");
    assert_eq!(
        s.post_json("/models/m/mutations", &json!({"$.a": 2}))
            .status,
        200
    );
    let r = s.post_json("/models/m/restore", &snap);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(s.get("/models/m/state").json()["a"], 1);
}

/// The operator uploads a blob over REST: its id.
fn operator_blob(keyed: &Http, data: &[u8]) -> String {
    let boundary = "valemScopeBoundary";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.bin\"\r\nContent-Type: text/plain\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(data);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let ct = format!("multipart/form-data; boundary={boundary}");
    let r = keyed.post("/blobs", &[("Content-Type", ct.as_str())], &body);
    assert_eq!(r.status, 201, "{r:?}");
    r.json()["blobId"].as_str().unwrap().to_string()
}

#[test]
fn a_session_reads_blobs_only_through_its_own_models() {
    let d = daemon();
    let keyed = Http::new(&d).with_key(KEY);
    let before = operator_models(&keyed);
    let private = operator_blob(&keyed, b"operator-only blob contents");
    let s = Session::new(&d);
    let mcp = McpSession::open(&s);

    // The attack: a blob by id, without a model (REST refuses the same to a session token).
    let rest = s.get(&format!("/blobs/{private}"));
    assert_eq!(
        rest.status, 401,
        "the token does not stand in for the key there: {rest:?}"
    );
    for args in [
        json!({"blobId": private}),
        json!({"blobId": private, "modelId": null}),
    ] {
        let r = mcp.tool("download_blob", args);
        assert_eq!(r["isError"], true, "{r}");
        assert!(text(&r).contains("needs `modelId`"), "{r}");
        assert!(
            r.get("structuredContent")
                .is_none_or(|c| c.get("data").is_none()),
            "{r}"
        );
    }
    // Through a model that is not the session's: as absent as a missing one.
    let r = mcp.tool(
        "download_blob",
        json!({"blobId": private, "modelId": "secret"}),
    );
    assert_eq!(r["isError"], true, "{r}");
    assert!(!r.to_string().contains("data\""), "{r}");
    // Uploads: the blob store is the daemon's (REST refuses a session token likewise).
    let up = mcp.tool(
        "upload_blob",
        json!({"data": "aGVsbG8=", "mediaType": "text/html"}),
    );
    assert_eq!(up["isError"], true, "{up}");
    assert!(
        text(&up).contains("not available to a sandbox session"),
        "{up}"
    );
    assert_eq!(
        s.http
            .post(
                "/blobs",
                &[
                    ("X-Session-Token", s.token.as_str()),
                    ("Content-Type", "multipart/form-data; boundary=x")
                ],
                b"--x--\r\n"
            )
            .status,
        401
    );

    // A blob the session's own model references is the session's to read.
    let m = json!({"id": "doc", "schema": {"type": "object"}});
    assert_eq!(s.post_json("/models", &m).status, 201);
    let w = s.post_json("/models/doc/mutations", &json!({"$.file": private}));
    assert_eq!(w.status, 200, "{w:?}");
    let r = mcp.tool(
        "download_blob",
        json!({"blobId": private, "modelId": "doc"}),
    );
    assert_eq!(r["isError"], false, "{r}");
    let own = s.get(&format!("/models/doc/blobs/{private}"));
    assert_eq!(own.text(), "operator-only blob contents");
    assert_eq!(keyed.get("/healthz").status, 200);
    untouched(&d, &keyed, &before);
}
