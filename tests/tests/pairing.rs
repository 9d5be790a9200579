//! Sandbox pairing against the real daemon and the real stdio proxy (`valem mcp --url --browser`):
//! the device flow end to end (the test plays the browser over HTTP), session scoping of model
//! ids over MCP and REST, and the negative cases — expired, wrong, reused and denied codes, two
//! agents racing for one code, a cancelled wait, requests without (or with a bogus) session
//! token. The headless-Chromium run of the same flow is tests/browser/.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valem_tests::{metric, Daemon, Http, Mcp};

const KEY: &str = "k3y-for-pairing-tests";

fn daemon(extra: &[&str]) -> Daemon {
    let mut args = vec!["--api-key", KEY, "--pairing-interval", "1"];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

fn proxy(d: &Daemon) -> Mcp {
    Mcp::start(&["--url", &d.url(""), "--api-key", KEY, "--browser"], &[])
}

fn structured(r: &Value) -> Value {
    r["structuredContent"].clone()
}

/// `pairCode` and `code` from a verification link's fragment.
fn codes(link: &str) -> (String, String) {
    let frag = link.split_once('#').map(|x| x.1).unwrap_or("");
    let mut pair = String::new();
    let mut code = String::new();
    for kv in frag.split('&') {
        match kv.split_once('=') {
            Some(("pair", v)) => pair = v.to_string(),
            Some(("code", v)) => code = v.to_string(),
            _ => {}
        }
    }
    (pair, code)
}

/// The browser's half: approve with `code`.
fn approve(http: &Http, pair: &str, code: &str) -> valem_tests::Reply {
    http.post_json(
        "/sandbox/pair/approve",
        &json!({"pairCode": pair, "userCode": code}),
    )
}

fn mint(http: &Http) -> Value {
    let r = http.post_json("/sandbox/pair", &json!({}));
    assert_eq!(r.status, 200, "{r:?}");
    r.json()
}

fn token_poll(http: &Http, m: &Value) -> valem_tests::Reply {
    http.post_json(
        "/sandbox/pair/token",
        &json!({"pairCode": m["pairCode"], "deviceSecret": m["deviceSecret"]}),
    )
}

fn spec() -> Value {
    json!({
        "id": "demo",
        "schema": {"type": "object", "properties": {"price": {"type": "number"}, "qty": {"type": "number"}}},
        "derivations": [{"path": "$.total", "expr": "price * qty"}]
    })
}

#[test]
fn pair_browser_without_elicitation_shares_a_scoped_session() {
    let d = daemon(&[]);
    let keyed = Http::new(&d).with_key(KEY);
    let browser = Http::new(&d); // no API key: the page and approval need none
                                 // A model outside the session: the paired agent must never see it.
    assert_eq!(
        keyed
            .post_json("/models", &json!({"id": "other", "schema": {}}))
            .status,
        201
    );
    let mut m = proxy(&d);
    let init = m.handshake("2025-11-25");
    assert!(
        init["instructions"]
            .as_str()
            .unwrap_or("")
            .contains("pair_browser"),
        "{init}"
    );
    let tools = m.call(1, "tools/list", json!({}));
    assert!(
        tools["result"]["tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "pair_browser"),
        "{tools}"
    );
    // First call: the link and code at once (the developer needs them before anyone can approve).
    let first = structured(&m.tool(2, "pair_browser", json!({})));
    assert_eq!(first["status"], "pending", "{first}");
    assert_eq!(
        first["expiresInSec"].as_u64().map(|s| s > 500),
        Some(true),
        "{first}"
    );
    let link = first["verificationUriComplete"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(link.starts_with(&d.url("/sandbox/#pair=")), "{link}");
    let (pair, code) = codes(&link);
    assert_eq!(code, first["userCode"].as_str().unwrap());
    // The page's peek tells the status and expiry, never the code.
    let peek = browser.get(&format!("/sandbox/pair/{pair}"));
    assert_eq!(peek.status, 200, "{peek:?}");
    assert_eq!(peek.json()["status"], "pending");
    assert!(!peek.text().contains(&code), "{peek:?}");
    // A wrong code first: refused, attempts counted.
    let wrong = approve(&browser, &pair, "BBBB-BBBB");
    assert_eq!(wrong.status, 403, "{wrong:?}");
    assert_eq!(wrong.json()["attemptsLeft"], 4);
    // The developer approves (typed in lower case with a space: still the code).
    let ok = approve(&browser, &pair, &code.to_lowercase().replace('-', " "));
    assert_eq!(ok.status, 200, "{ok:?}");
    let browser_token = ok.json()["sessionToken"].as_str().unwrap().to_string();
    // Second call resumes the same pairing and collects the session.
    let second = structured(&m.tool(3, "pair_browser", json!({})));
    assert_eq!(second["status"], "paired", "{second}");
    let ns = second["namespaceId"].as_str().unwrap().to_string();
    assert_eq!(
        structured(&m.tool(4, "pair_browser", json!({})))["status"],
        "already_paired"
    );

    // The agent creates a model: its id stays its own.
    let created = m.tool(5, "create_model", json!({"spec": spec()}));
    assert_eq!(created["isError"], false, "{created}");
    assert_eq!(created["structuredContent"]["id"], "demo", "{created}");
    let w = m.tool(
        50,
        "mutate",
        json!({"id": "demo", "mutations": {"$.price": 2, "$.qty": 3}}),
    );
    assert_eq!(w["isError"], false, "{w}");
    // list_models: the session's models only.
    let list = m.tool(6, "list_models", json!({}));
    let ids: Value = serde_json::from_str(list["content"][0]["text"].as_str().unwrap()).unwrap();
    let text = ids.to_string();
    assert!(
        text.contains("demo") && !text.contains("other") && !text.contains(&ns),
        "{ids}"
    );
    // The operator sees the namespaced id.
    let all = keyed.get("/models").text();
    assert!(all.contains(&format!("{ns}__demo")), "{all}");
    // Resources: the session's state resource only.
    let res = m.call(60, "resources/list", json!({}));
    let uris: Vec<&str> = res["result"]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["uri"].as_str())
        .filter(|u| u.starts_with("valem://state/"))
        .collect();
    assert_eq!(uris, vec!["valem://state/demo"], "{res}");
    // The paired agent cannot reach the operator's model.
    let denied = m.tool(7, "get_model_info", json!({"id": "other"}));
    assert_eq!(denied["isError"], true, "{denied}");

    // The agent subscribes; the browser edits; the agent hears of it and reads the new value.
    let sub = m.call(
        8,
        "resources/subscribe",
        json!({"uri": "valem://state/demo"}),
    );
    assert!(sub.get("error").is_none(), "{sub}");
    let scoped = [("X-Session-Token", browser_token.as_str())];
    let listed = browser.get_with("/models", &scoped);
    assert_eq!(listed.status, 200, "{listed:?}");
    let listed = listed.text();
    assert!(
        listed.contains("\"demo\"") && !listed.contains("other"),
        "{listed}"
    );
    // The page's WebSocket: the session token on the handshake's query (no API key).
    let mut ws = valem_tests::ws_open(
        &d,
        &format!("/models/demo/subscribe?session={browser_token}"),
    );
    let edit = browser.post(
        "/models/demo/mutations",
        &[("Content-Type", "application/json"), scoped[0]],
        json!({"$.qty": 7}).to_string().as_bytes(),
    );
    assert_eq!(edit.status, 200, "{edit:?}");
    assert!(
        !edit.text().contains(&ns),
        "the prefix is stripped: {edit:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < deadline, "no resources/updated");
        let n = m.recv(10);
        if n["method"] == "notifications/resources/updated" {
            assert_eq!(n["params"]["uri"], "valem://state/demo", "{n}");
            break;
        }
    }
    let frame = loop {
        match ws.read().expect("a frame") {
            tungstenite::Message::Text(t) => {
                break serde_json::from_str::<Value>(t.as_str()).unwrap()
            }
            _ => continue,
        }
    };
    assert_eq!(frame["modelId"], "demo", "{frame}");
    let total = m.tool(9, "get_field", json!({"id": "demo", "path": "$.total"}));
    assert_eq!(
        total["content"][0]["text"].as_str().map(str::trim),
        Some("14"),
        "{total}"
    );
    // The session token opens /models… and /mcp only.
    assert_eq!(browser.get_with("/metrics", &scoped).status, 401);
    assert_eq!(browser.get_with("/models/other", &scoped).status, 404);
    let session = browser.get_with("/sandbox/session", &scoped);
    assert_eq!(session.json()["models"], json!(["demo"]), "{session:?}");
}

#[test]
fn pair_browser_with_url_elicitation_progress_and_cancel() {
    let d = daemon(&[]);
    let browser = Http::new(&d);
    let mut m = proxy(&d);
    m.call(
        0,
        "initialize",
        json!({"protocolVersion": "2025-11-25", "capabilities": {"elicitation": {"url": {}}}}),
    );
    m.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    m.send(
        &json!({"jsonrpc": "2.0", "id": 10, "method": "tools/call", "params": {
        "name": "pair_browser", "arguments": {}, "_meta": {"progressToken": "p1"}}}),
    );
    // The link comes as a URL-mode elicitation, not through the model.
    let mut link = None;
    let mut progressed = false;
    let deadline = Instant::now() + Duration::from_secs(15);
    while link.is_none() || !progressed {
        assert!(Instant::now() < deadline, "no elicitation/progress");
        let msg = m.recv(10);
        if msg["method"] == "elicitation/create" {
            assert_eq!(msg["params"]["mode"], "url", "{msg}");
            link = msg["params"]["url"].as_str().map(str::to_string);
            m.send(&json!({"jsonrpc": "2.0", "id": msg["id"], "result": {"action": "accept"}}));
        } else if msg["method"] == "notifications/progress" {
            assert_eq!(msg["params"]["progressToken"], "p1", "{msg}");
            progressed = true;
        }
    }
    // The wait runs off the read loop: another call is answered meanwhile.
    let g = m.call(
        11,
        "tools/call",
        json!({"name": "get_domain_guidance", "arguments": {"topics": []}}),
    );
    assert!(g.get("result").is_some(), "{g}");
    // Cancel the wait: no reply for it.
    m.send(&json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 10}}));
    let quiet_until = Instant::now() + Duration::from_millis(2500);
    while let Some(line) = m.quiet_for(
        quiet_until
            .saturating_duration_since(Instant::now())
            .as_millis() as u64,
    ) {
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_ne!(v["id"], 10, "a cancelled pair_browser replied: {v}");
        if Instant::now() >= quiet_until {
            break;
        }
    }
    // A new call resumes the same pairing; approving it completes the elicitation.
    let (pair, code) = codes(link.as_deref().unwrap());
    m.send(&json!({"jsonrpc": "2.0", "id": 12, "method": "tools/call", "params": {"name": "pair_browser", "arguments": {}}}));
    assert_eq!(approve(&browser, &pair, &code).status, 200);
    let mut paired = None;
    let mut completed = false;
    let deadline = Instant::now() + Duration::from_secs(15);
    while paired.is_none() || !completed {
        assert!(
            Instant::now() < deadline,
            "no paired reply / elicitation complete"
        );
        let msg = m.recv(10);
        if msg["method"] == "notifications/elicitation/complete" {
            completed = true;
        } else if msg["id"] == 12 {
            paired = Some(msg["result"]["structuredContent"].clone());
        }
    }
    assert_eq!(paired.unwrap()["status"], "paired");
}

#[test]
fn pairing_negative_cases() {
    let d = daemon(&["--pairing-ttl", "1.5"]);
    let keyed = Http::new(&d).with_key(KEY);
    let anon = Http::new(&d);

    // Minting and polling need the API key; the page and the approval do not.
    assert_eq!(anon.post_json("/sandbox/pair", &json!({})).status, 401);
    let page = anon.get("/sandbox/");
    assert_eq!(page.status, 200);
    assert!(page.text().contains("valem sandbox"));
    assert!(page.header("content-security-policy").is_some());

    // Wrong code: five wrong attempts burn the pairing, even for the right code after.
    let m1 = mint(&keyed);
    let pair1 = m1["pairCode"].as_str().unwrap();
    for left in (1..5).rev() {
        let r = approve(&anon, pair1, "ZZZZ-ZZZZ");
        assert_eq!(
            (r.status, r.json()["attemptsLeft"].clone()),
            (403, json!(left)),
            "{r:?}"
        );
    }
    assert_eq!(approve(&anon, pair1, "ZZZZ-ZZZZ").status, 403);
    let right = approve(&anon, pair1, m1["userCode"].as_str().unwrap());
    assert_eq!(right.json()["error"], "access_denied", "{right:?}");
    assert_eq!(token_poll(&keyed, &m1).json()["error"], "access_denied");

    // Pending, slow down, then reused: the token is handed out once, approval works once.
    let m2 = mint(&keyed);
    let p = token_poll(&keyed, &m2);
    assert_eq!(
        (p.status, p.json()["error"].clone()),
        (409, json!("authorization_pending")),
        "{p:?}"
    );
    assert_eq!(token_poll(&keyed, &m2).json()["error"], "slow_down");
    let pair2 = m2["pairCode"].as_str().unwrap();
    let code2 = m2["userCode"].as_str().unwrap();
    assert_eq!(approve(&anon, pair2, code2).status, 200);
    let again = approve(&anon, pair2, code2);
    assert_eq!(
        (again.status, again.json()["error"].clone()),
        (400, json!("invalid_grant")),
        "{again:?}"
    );
    // A wrong device secret gets nothing and does not consume the token.
    let bad = keyed.post_json(
        "/sandbox/pair/token",
        &json!({"pairCode": pair2, "deviceSecret": "0".repeat(64)}),
    );
    assert_eq!(bad.json()["error"], "invalid_grant", "{bad:?}");

    // Two agents race for one code: exactly one gets the session.
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| s.spawn(|| token_poll(&keyed, &m2).status))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut sorted = statuses.clone();
    sorted.sort();
    assert_eq!(sorted, vec![200, 400], "{statuses:?}");
    assert_eq!(token_poll(&keyed, &m2).json()["error"], "invalid_grant");

    // Denied.
    let m3 = mint(&keyed);
    assert_eq!(
        anon.post_json("/sandbox/pair/deny", &json!({"pairCode": m3["pairCode"]}))
            .status,
        200
    );
    assert_eq!(token_poll(&keyed, &m3).json()["error"], "access_denied");

    // Expired.
    let m4 = mint(&keyed);
    std::thread::sleep(Duration::from_millis(1700));
    let e = token_poll(&keyed, &m4);
    assert_eq!(
        (e.status, e.json()["error"].clone()),
        (410, json!("expired_token")),
        "{e:?}"
    );
    let e = approve(
        &anon,
        m4["pairCode"].as_str().unwrap(),
        m4["userCode"].as_str().unwrap(),
    );
    assert_eq!(e.status, 410, "{e:?}");
    // Unknown code.
    assert_eq!(anon.get("/sandbox/pair/00000000").status, 400);

    // Without a session token, or with a bogus one: no session, and no fall-back to the
    // unscoped API.
    assert_eq!(anon.get("/sandbox/session").status, 401);
    assert_eq!(keyed.get("/sandbox/session").status, 401);
    let bogus = [("X-Session-Token", "not-a-token")];
    assert_eq!(anon.get_with("/models", &bogus).status, 401);
    assert_eq!(keyed.get_with("/models", &bogus).status, 401);
    assert_eq!(anon.get("/models").status, 401);
}

#[test]
fn a_pairing_flood_is_refused_clearly_and_pairing_recovers() {
    let d = daemon(&[]);
    let keyed = Http::new(&d).with_key(KEY);
    let browser = Http::new(&d);
    assert_eq!(
        keyed
            .post_json("/models", &json!({"id": "other", "schema": {}}))
            .status,
        201
    );
    assert_eq!(
        keyed
            .post_json("/models/other/mutations", &json!({"$.a": 1}))
            .status,
        200
    );
    // The attack: a holder of the API key mints as fast as it can, to fill the daemon's
    // pending pairings so that nobody can pair.
    let replies: Vec<valem_tests::Reply> = (0..60)
        .map(|_| keyed.post_json("/sandbox/pair", &json!({})))
        .collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(&statuses[..8], &[200; 8], "a burst of 8: {statuses:?}");
    let refused: Vec<&valem_tests::Reply> = replies.iter().filter(|r| r.status == 429).collect();
    assert!(refused.len() >= 50, "{statuses:?}");
    let r = refused[0];
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After in seconds");
    assert!((1..=6).contains(&retry), "{retry}");
    let body = r.json();
    assert_eq!(body["error"], "rate_limited", "{body}");
    assert_eq!(body["retryAfterSec"], retry, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("retry after"),
        "{body}"
    );
    // Counted, and the daemon holds only what the burst made.
    let counted = metric(
        &keyed,
        "valem_pairings_refused_total{reason=\"rate_limited\"}",
    );
    assert_eq!(counted, Some(refused.len() as f64));
    assert_eq!(metric(&keyed, "valem_pairings_pending"), Some(8.0));
    // The daemon stays up; the operator's model is untouched.
    assert_eq!(keyed.get("/healthz").status, 200);
    assert_eq!(keyed.get("/models/other/state").json(), json!({"a": 1}));

    // Recovery: once Retry-After has passed, a pairing is minted and completes.
    let deadline = Instant::now() + Duration::from_secs(retry + 5);
    let m = loop {
        let r = keyed.post_json("/sandbox/pair", &json!({}));
        if r.status == 200 {
            break r.json();
        }
        assert_eq!(r.status, 429, "{r:?}");
        assert!(
            Instant::now() < deadline,
            "no pairing after Retry-After: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let ok = approve(
        &browser,
        m["pairCode"].as_str().unwrap(),
        m["userCode"].as_str().unwrap(),
    );
    assert_eq!(ok.status, 200, "{ok:?}");
    let t = token_poll(&keyed, &m);
    assert_eq!(t.status, 200, "{t:?}");
    let token = t.json()["sessionToken"].as_str().unwrap().to_string();
    let session = browser.get_with("/sandbox/session", &[("X-Session-Token", token.as_str())]);
    assert_eq!(session.status, 200, "{session:?}");
}

#[test]
fn a_session_lost_with_a_daemon_restart_can_be_paired_again() {
    let d = daemon(&[]);
    let addr = d.addr.clone();
    let browser = Http::new(&d);
    let mut m = proxy(&d);
    m.handshake("2025-11-25");
    let first = structured(&m.tool(1, "pair_browser", json!({})));
    let (pair, code) = codes(first["verificationUriComplete"].as_str().unwrap());
    assert_eq!(approve(&browser, &pair, &code).status, 200);
    assert_eq!(
        structured(&m.tool(2, "pair_browser", json!({})))["status"],
        "paired"
    );
    // The daemon restarts: pairings and sessions lived in its memory.
    d.terminate();
    let _d = Daemon::start_on(&addr, &["--api-key", KEY, "--pairing-interval", "1"]);
    let lost = m.tool(3, "list_models", json!({}));
    assert_eq!(lost["isError"], true, "{lost}");
    let text = lost["content"][0]["text"].as_str().unwrap_or("");
    assert!(text.contains("pair_browser"), "{text}");
    // pair_browser starts over instead of claiming the dead session.
    let again = structured(&m.tool(4, "pair_browser", json!({})));
    assert_eq!(again["status"], "pending", "{again}");
    assert_ne!(
        codes(again["verificationUriComplete"].as_str().unwrap()).0,
        pair
    );
}
