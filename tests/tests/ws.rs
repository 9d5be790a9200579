//! End-to-end tests of the WebSocket `/models/{id}/subscribe` of `valem serve`: a real
//! tungstenite client on a loopback socket, changes made over REST, every read bounded by a
//! socket timeout.

use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};
use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::{Message, WebSocket};
use valem_tests::{Daemon, Http};

type Ws = WebSocket<TcpStream>;

fn spec() -> Value {
    json!({
        "id": "demo",
        "schema": {"type": "object", "properties": {
            "price": {"type": "number"}, "qty": {"type": "number"}, "note": {"type": "string"}
        }},
        "derivations": [{"path": "$.total", "expr": "price * qty"}],
        "constraints": [
            {"id": "cap", "expr": "total = null or total <= 10000", "message": "Too much", "policy": "rollback"},
            {"id": "big", "expr": "total = null or total <= 100", "message": "Large order", "policy": "flag"}
        ],
        "effects": [{"id": "notify", "trigger": "total > 1000", "executor": "caller", "emit": "order.huge"}]
    })
}

fn start(extra: &[&str]) -> (Daemon, Http) {
    let d = Daemon::start(extra);
    let h = Http::new(&d);
    assert_eq!(h.post_json("/models", &spec()).status, 201);
    (d, h)
}

/// Open `path` (with extra handshake headers); on refusal, the HTTP status and body.
fn connect(d: &Daemon, path: &str, headers: &[(&str, &str)]) -> Result<Ws, (u16, String)> {
    let mut req = format!("ws://{}{path}", d.addr)
        .into_client_request()
        .expect("a WebSocket request");
    for (k, v) in headers {
        let name = tungstenite::http::HeaderName::from_bytes(k.as_bytes()).expect("a header name");
        req.headers_mut()
            .insert(name, v.parse().expect("a header value"));
    }
    let stream = TcpStream::connect(&d.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    match tungstenite::client(req, stream) {
        Ok((ws, resp)) => {
            assert_eq!(resp.status().as_u16(), 101);
            Ok(ws)
        }
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
            let body = resp
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            Err((resp.status().as_u16(), body))
        }
        Err(e) => panic!("handshake failed: {e}"),
    }
}

/// The close frame's code and reason.
fn next_close(ws: &mut Ws) -> (u16, String) {
    loop {
        match ws.read() {
            Ok(Message::Close(Some(f))) => return (u16::from(f.code), f.reason.to_string()),
            Ok(Message::Close(None)) => return (0, String::new()),
            Ok(Message::Text(t)) => panic!("expected a close, got {t}"),
            Ok(_) => {}
            Err(e) => panic!("expected a close frame, got {e}"),
        }
    }
}

fn mutate(h: &Http, m: Value) -> u16 {
    h.post_json("/models/demo/mutations", &m).status
}

#[test]
fn frames_follow_rest_mutations_evolve_and_delete() {
    let (d, h) = start(&[]);
    let mut ws = connect(&d, "/models/demo/subscribe", &[]).expect("upgrade");

    assert_eq!(mutate(&h, json!({"$.price": 10, "$.qty": 3})), 200);
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(
        f,
        json!({
            "kind": "mutation",
            "modelId": "demo",
            "mutatedPaths": ["$.price", "$.qty"],
            "derivedUpdated": ["$.total"],
            "flaggedConstraints": [],
            "dispatchedEffects": []
        })
    );
    assert_eq!(h.get("/models/demo/state/$.total").json(), json!(30));

    // A refused cycle commits nothing and sends nothing: the next frame is the next commit.
    assert_eq!(mutate(&h, json!({"$.qty": 100_000})), 409);
    assert_eq!(mutate(&h, json!({"$.price": "x"})), 422);
    assert_eq!(mutate(&h, json!({"$.qty": 4})), 200);
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(f["mutatedPaths"], json!(["$.qty"]), "{f}");

    // Patches are commits too.
    let r = h.post(
        "/models/demo/mutations/patch",
        &[("Content-Type", "application/json-patch+json")],
        br#"[{"op":"add","path":"/note","value":"hi"}]"#,
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        valem_tests::ws_frame(&mut ws)["mutatedPaths"],
        json!(["$.note"])
    );

    // Pings are answered.
    ws.send(Message::Ping(b"are you there".to_vec().into()))
        .expect("send a ping");
    match ws.read().expect("a pong") {
        Message::Pong(p) => assert_eq!(&p[..], b"are you there"),
        other => panic!("expected a pong, got {other:?}"),
    }

    let r = h.post_json(
        "/models/demo/spec/evolve",
        &json!({"newVersion": "1.1.0", "upsertDerivations": [{"path": "$.double", "expr": "total * 2"}]}),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        valem_tests::ws_frame(&mut ws),
        json!({"kind": "spec-evolved", "modelId": "demo", "version": "1.1.0"})
    );

    // Another model's changes are not this socket's.
    let mut other = spec();
    other["id"] = json!("other");
    assert_eq!(h.post_json("/models", &other).status, 201);
    assert_eq!(
        h.post_json("/models/other/mutations", &json!({"$.qty": 1}))
            .status,
        200
    );

    assert_eq!(h.delete("/models/demo").status, 200);
    let (code, reason) = next_close(&mut ws);
    assert_eq!(code, 1000);
    assert!(reason.contains("deleted"), "{reason}");
}

#[test]
fn paths_filter_keeps_matching_frames_and_always_flags_and_effects() {
    let (d, h) = start(&[]);
    let mut ws = connect(&d, "/models/demo/subscribe?paths=$.qty,$.note", &[]).expect("upgrade");

    assert_eq!(mutate(&h, json!({"$.qty": 1})), 200);
    assert_eq!(
        valem_tests::ws_frame(&mut ws)["mutatedPaths"],
        json!(["$.qty"])
    );
    // Neither the write nor the derived update is under $.qty or $.note: filtered out.
    assert_eq!(mutate(&h, json!({"$.price": 5})), 200);
    assert_eq!(mutate(&h, json!({"$.note": "x"})), 200);
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(f["mutatedPaths"], json!(["$.note"]), "{f}");

    // A flagged constraint passes the filter.
    assert_eq!(mutate(&h, json!({"$.price": 500})), 200);
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(f["mutatedPaths"], json!(["$.price"]), "{f}");
    assert_eq!(f["flaggedConstraints"][0]["constraintId"], "big");
    assert_eq!(f["dispatchedEffects"], json!([]));
    // So does a dispatched effect (and its flag).
    assert_eq!(mutate(&h, json!({"$.price": 5000})), 200);
    let f = valem_tests::ws_frame(&mut ws);
    assert_eq!(f["dispatchedEffects"][0]["effectId"], "notify", "{f}");
    assert_eq!(f["dispatchedEffects"][0]["emit"], "order.huge");
    // And spec-evolved frames.
    let r = h.post_json("/models/demo/spec/evolve", &json!({"newVersion": "2.0.0"}));
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(valem_tests::ws_frame(&mut ws)["kind"], "spec-evolved");

    // A second subscriber with another filter sees its own selection.
    let mut price = connect(&d, "/models/demo/subscribe?paths=$.total", &[]).expect("upgrade");
    assert_eq!(mutate(&h, json!({"$.note": "y"})), 200);
    assert_eq!(mutate(&h, json!({"$.price": 6})), 200);
    let f = valem_tests::ws_frame(&mut price);
    assert_eq!(f["derivedUpdated"], json!(["$.total"]), "{f}");
    assert_eq!(
        valem_tests::ws_frame(&mut ws)["mutatedPaths"],
        json!(["$.note"])
    );
}

#[test]
fn bad_or_too_many_filter_paths_are_400_before_the_upgrade() {
    let (d, h) = start(&[]);
    let before = h.get("/models/demo/state").json();
    // The attack: paths that are not addresses, and a filter of thousands of paths that every
    // frame would be compared against.
    let many = vec!["$.qty"; 5000].join(",");
    for (query, names) in [
        ("paths=$.qty,items.0.x".to_string(), "`items.0.x`"),
        ("paths=$.qty,$.items%5B%2A%5D".to_string(), "`$.items[*]`"),
        ("paths=$%5B".to_string(), "`$[`"),
        (
            format!("paths={}", vec!["$.qty"; 65].join(",")),
            "at most 64",
        ),
        (format!("paths={many}"), "at most 64"),
    ] {
        let (status, body) = connect(&d, &format!("/models/demo/subscribe?{query}"), &[])
            .expect_err("refused before the upgrade");
        assert_eq!(status, 400, "{query}: {body}");
        let b: Value = serde_json::from_str(&body).expect("a JSON body");
        assert_eq!(b["error"], "Bad request", "{b}");
        assert!(b["message"].as_str().unwrap_or("").contains(names), "{b}");
    }
    // The daemon stays up, the model is untouched, and a good filter (in any canonical
    // spelling) still subscribes.
    assert_eq!(h.get("/healthz").status, 200);
    assert_eq!(h.get("/models/demo/state").json(), before);
    let mut ws = connect(&d, "/models/demo/subscribe?paths=$%5B'qty'%5D", &[]).expect("upgrade");
    assert_eq!(mutate(&h, json!({"$.note": "skip"})), 200);
    assert_eq!(mutate(&h, json!({"$.qty": 3})), 200);
    assert_eq!(
        valem_tests::ws_frame(&mut ws)["mutatedPaths"],
        json!(["$.qty"])
    );
}

#[test]
fn unknown_model_is_404_before_the_upgrade() {
    let (d, _h) = start(&[]);
    let (status, body) = connect(&d, "/models/nope/subscribe", &[]).expect_err("refused");
    assert_eq!(status, 404);
    let b: Value = serde_json::from_str(&body).expect("a JSON body");
    assert_eq!(b["error"], "Not found");
    assert!(b["message"].as_str().unwrap().contains("nope"));
}

#[test]
fn token_is_required_with_an_api_key() {
    let d = Daemon::start(&["--api-key", "k3y"]);
    let h = Http::new(&d).with_key("k3y");
    assert_eq!(h.post_json("/models", &spec()).status, 201);

    let (status, body) = connect(&d, "/models/demo/subscribe", &[]).expect_err("refused");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("\"error\":\"Unauthorized\""), "{body}");
    let (status, _) = connect(&d, "/models/demo/subscribe?token=wrong", &[]).expect_err("refused");
    assert_eq!(status, 401);

    let mut ws = connect(&d, "/models/demo/subscribe?paths=$.qty&token=k3y", &[]).expect("upgrade");
    assert_eq!(
        h.post_json("/models/demo/mutations", &json!({"$.qty": 2}))
            .status,
        200
    );
    assert_eq!(
        valem_tests::ws_frame(&mut ws)["mutatedPaths"],
        json!(["$.qty"])
    );
}

#[test]
fn the_query_key_opens_only_the_websocket_and_is_never_logged() {
    const KEY: &str = "query-key-b7e1c9d4f2a6";
    // Everything the daemon and its libraries can log, to find the key nowhere in it.
    let d = Daemon::start_env(&["--api-key", KEY], &[("RUST_LOG", "trace")]);
    let h = Http::new(&d).with_key(KEY);
    assert_eq!(h.post_json("/models", &spec()).status, 201);
    let anon = Http::new(&d);
    let q = format!("token={KEY}");
    // The attack: the key in the query of any route.
    for path in [
        format!("/models?{q}"),
        format!("/models/demo/state?{q}"),
        format!("/metrics?{q}"),
        format!("/models/demo/subscribe/x?{q}"),
    ] {
        let r = anon.get(&path);
        assert_eq!(r.status, 401, "{path}: {r:?}");
        let m = r.json()["message"].as_str().unwrap_or("").to_string();
        assert!(
            m.contains("WebSocket handshake") && m.contains("Bearer"),
            "{m}"
        );
        assert!(!r.text().contains(KEY), "{r:?}");
    }
    let created = anon.post_json(
        &format!("/models?{q}"),
        &json!({"id": "sneaky", "schema": {}}),
    );
    assert_eq!(created.status, 401, "{created:?}");
    assert_eq!(h.get("/models/sneaky").status, 404, "nothing was created");
    // With the header, a stray query key changes nothing.
    assert_eq!(h.get(&format!("/models/demo?{q}")).status, 200);

    // The handshake still takes it (browsers cannot set headers there).
    let mut ws = connect(&d, &format!("/models/demo/subscribe?paths=$.qty&{q}"), &[])
        .expect("upgrade with the query key");
    assert_eq!(mutate(&h, json!({"$.qty": 2})), 200);
    assert_eq!(
        valem_tests::ws_frame(&mut ws)["mutatedPaths"],
        json!(["$.qty"])
    );
    drop(ws);
    let (status, body) = connect(
        &d,
        "/models/nope/subscribe?token=wrong-key-for-the-log",
        &[],
    )
    .expect_err("refused");
    assert_eq!(status, 401, "{body}");

    // Nothing logged it: the daemon's requests were traced (so the log is not just empty).
    let log = d.stderr_with("/models/demo/subscribe");
    assert!(
        log.contains("/models/demo/subscribe"),
        "requests are traced: {log}"
    );
    assert!(!log.contains(KEY), "the key reached the log");
    assert!(
        !log.contains("wrong-key-for-the-log"),
        "a query key reached the log"
    );
}

#[test]
fn disallowed_origin_is_403() {
    let (d, h) = start(&[]);
    let (status, body) = connect(
        &d,
        "/models/demo/subscribe",
        &[("Origin", "https://evil.example")],
    )
    .expect_err("refused");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("\"error\":\"Forbidden\""), "{body}");

    let mut ws = connect(
        &d,
        "/models/demo/subscribe",
        &[("Origin", "http://localhost:5173")],
    )
    .expect("a loopback origin is allowed");
    assert_eq!(mutate(&h, json!({"$.price": 1})), 200);
    assert_eq!(valem_tests::ws_frame(&mut ws)["modelId"], "demo");
}

#[test]
fn shutdown_closes_the_socket() {
    let (d, h) = start(&[]);
    let mut ws = connect(&d, "/models/demo/subscribe", &[]).expect("upgrade");
    assert_eq!(mutate(&h, json!({"$.price": 1})), 200);
    assert_eq!(valem_tests::ws_frame(&mut ws)["kind"], "mutation");
    let status = d.terminate();
    assert!(status.success(), "{status:?}");
    let (code, reason) = next_close(&mut ws);
    assert_eq!(code, u16::from(CloseCode::Away), "{reason}");
    assert!(reason.contains("shutting down"), "{reason}");
}
