//! Effect executors against the real daemon, with a local HTTP server as the `server`
//! destination: one call per dedupe key (also across a `kill -9` while the call is in flight),
//! the status lifecycle at `statusPath`, retries of a failing destination, the egress guard
//! (allow-list, private addresses and their IPv6 spellings), a timer scheduled before a restart
//! firing after it, `llm` reported as not executable, and fold-backs audited as
//! `source: "foldback"`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valem_tests::{Daemon, Http};

/// A destination that records each request (path and Idempotency-Key) and answers by path:
/// `/slow…` after 3 s, `/fail` with 500, anything else 200 `{"multiplier": 1.25}`.
struct Destination {
    port: u16,
    hits: Arc<Mutex<Vec<(String, String)>>>,
}

impl Destination {
    fn start() -> Destination {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let hits: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let h = hits.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let h = h.clone();
                std::thread::spawn(move || serve(conn, &h));
            }
        });
        Destination { port, hits }
    }

    fn count(&self, prefix: &str) -> usize {
        self.hits
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p.starts_with(prefix))
            .count()
    }

    fn keys(&self) -> Vec<String> {
        self.hits
            .lock()
            .unwrap()
            .iter()
            .map(|(_, k)| k.clone())
            .collect()
    }
}

fn serve(conn: TcpStream, hits: &Mutex<Vec<(String, String)>>) {
    let mut r = BufReader::new(conn.try_clone().expect("clone"));
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut key = String::new();
    let mut body_len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("idempotency-key") {
                key = v.trim().to_string();
            }
            if k.eq_ignore_ascii_case("content-length") {
                body_len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    // Read the body too: closing a socket with unread input resets the connection, and the
    // client may then see the reset instead of the answer.
    let mut body = vec![0u8; body_len];
    if r.read_exact(&mut body).is_err() {
        return;
    }
    hits.lock().unwrap().push((path.clone(), key));
    if path.starts_with("/slow") {
        std::thread::sleep(Duration::from_secs(3));
    }
    let (status, body) = if path.starts_with("/fail") {
        (
            "500 Internal Server Error",
            "{\"error\":\"down\"}".to_string(),
        )
    } else {
        ("200 OK", "{\"multiplier\":1.25}".to_string())
    };
    let mut c = conn;
    let _ = write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn spec(port: u16, path: &str, retries: u32) -> Value {
    json!({
        "id": "quote",
        "schema": {"type": "object"},
        "effects": [{
            "id": "rate",
            "executor": "server",
            "trigger": "region != null",
            "dedupeKey": "region",
            "request": {"method": "GET", "url": format!("http://127.0.0.1:{port}{path}?region={{ region }}")},
            "response": {"set": {"$.multiplier": "$response.multiplier"}},
            "statusPath": "$.io",
            "policy": {"retries": retries, "backoff": 50, "timeoutMs": 10000}
        }]
    })
}

fn daemon(dir: &std::path::Path, extra: &[&str]) -> Daemon {
    let mut args = vec!["--data-dir", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    Daemon::start(&args)
}

const LOCAL: &[&str] = &[
    "--effects-allowed-hosts",
    "127.0.0.1",
    "--effects-allow-private-ips",
];

fn state(http: &Http, id: &str) -> Value {
    http.get(&format!("/models/{id}/state")).json()
}

/// Poll the state until `ok` holds (bounded).
fn wait_for(http: &Http, id: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let s = state(http, id);
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: state stayed {s}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn mutate(http: &Http, id: &str, m: Value) {
    let r = http.post_json(&format!("/models/{id}/mutations"), &m);
    assert_eq!(r.status, 200, "{r:?}");
}

/// A durable daemon with `extra` flags in a fresh directory, and a client of it.
fn started(extra: &[&str]) -> (tempfile::TempDir, Daemon, Http) {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), extra);
    let http = Http::new(&d);
    (dir, d, http)
}

/// A durable daemon with `extra` flags and the quote model calling `path` on `dest`.
fn quote(
    dest: &Destination,
    path: &str,
    retries: u32,
    extra: &[&str],
) -> (tempfile::TempDir, Daemon, Http) {
    let (dir, d, http) = started(extra);
    let r = http.post_json("/models", &spec(dest.port, path, retries));
    assert_eq!(r.status, 201, "{r:?}");
    (dir, d, http)
}

fn phase(s: &Value, at: &str) -> String {
    s[at]["phase"].as_str().unwrap_or("").to_string()
}

#[test]
fn a_server_effect_fires_once_per_key_and_folds_back() {
    let dest = Destination::start();
    let (_dir, _d, http) = quote(&dest, "/rate", 0, LOCAL);
    mutate(&http, "quote", json!({"$.region": "north"}));
    let s = wait_for(&http, "quote", "applied", |s| phase(s, "io") == "applied");
    assert_eq!(s["multiplier"], 1.25, "{s}");
    assert_eq!(s["io"]["key"], "north", "{s}");
    assert_eq!(dest.count("/rate"), 1);
    assert_eq!(dest.keys(), vec!["quote/rate/\"north\"".to_string()]);
    // Other writes, and the same key again: no new call.
    mutate(&http, "quote", json!({"$.note": "x"}));
    mutate(&http, "quote", json!({"$.region": "north"}));
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(dest.count("/rate"), 1);
    // A new key: one more call.
    mutate(&http, "quote", json!({"$.region": "south"}));
    wait_for(&http, "quote", "second key", |s| {
        s["io"]["key"] == "south" && phase(s, "io") == "applied"
    });
    assert_eq!(dest.count("/rate"), 2);
    // The fold-backs are audited as such.
    let audit = http.get("/models/quote/audit?limit=50").json();
    let sources: Vec<&str> = audit
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["source"].as_str())
        .collect();
    assert!(
        sources.contains(&"foldback") && sources.contains(&"client"),
        "{sources:?}"
    );
}

#[test]
fn an_in_flight_call_is_not_repeated_after_kill_9() {
    let dest = Destination::start();
    let (dir, d, http) = quote(&dest, "/slow", 0, LOCAL);
    mutate(&http, "quote", json!({"$.region": "west"}));
    // The call is out (the destination holds it for 3 s) and recorded in flight.
    let deadline = Instant::now() + Duration::from_secs(10);
    while dest.count("/slow") == 0 {
        assert!(
            Instant::now() < deadline,
            "the call never reached the destination"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(phase(&state(&http, "quote"), "io"), "in_flight");
    d.kill9();
    let d = daemon(dir.path(), LOCAL);
    let http = Http::new(&d);
    let s = wait_for(&http, "quote", "failed after the restart", |s| {
        phase(s, "io") == "failed"
    });
    assert!(
        s["io"]["error"]
            .as_str()
            .unwrap_or("")
            .contains("interrupted"),
        "{s}"
    );
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(dest.count("/slow"), 1, "the key fired twice");
    // The model works on: a new key fires.
    mutate(&http, "quote", json!({"$.region": "east"}));
    wait_for(&http, "quote", "new key after restart", |s| {
        s["io"]["key"] == "east" && s["io"]["phase"] == "in_flight"
    });
}

#[test]
fn a_failing_destination_is_retried_then_failed() {
    let dest = Destination::start();
    let (_dir, _d, http) = quote(&dest, "/fail", 2, LOCAL);
    mutate(&http, "quote", json!({"$.region": "north"}));
    let s = wait_for(&http, "quote", "failed", |s| phase(s, "io") == "failed");
    assert_eq!(s["io"]["attempts"], 3, "{s}");
    assert!(
        s["io"]["error"].as_str().unwrap_or("").contains("HTTP 500"),
        "{s}"
    );
    assert!(s.get("multiplier").is_none(), "{s}");
    assert_eq!(dest.count("/fail"), 3);
}

#[test]
fn the_egress_guard_refuses_unlisted_hosts_and_private_addresses() {
    let dest = Destination::start();
    // Nothing is allowed by default.
    let (_dir, d, http) = quote(&dest, "/rate", 3, &[]);
    mutate(&http, "quote", json!({"$.region": "north"}));
    let s = wait_for(&http, "quote", "refused", |s| phase(s, "io") == "failed");
    assert!(
        s["io"]["error"].as_str().unwrap().contains("allow-list"),
        "{s}"
    );
    // Listed, but loopback without --effects-allow-private-ips.
    drop(d);
    let (_dir2, _d, http) = quote(&dest, "/rate", 3, &["--effects-allowed-hosts", "127.0.0.1"]);
    mutate(&http, "quote", json!({"$.region": "north"}));
    let s = wait_for(&http, "quote", "refused", |s| phase(s, "io") == "failed");
    assert!(
        s["io"]["error"]
            .as_str()
            .unwrap()
            .contains("non-public address"),
        "{s}"
    );
    assert_eq!(s["io"]["attempts"], 1, "a refusal is not retried: {s}");
    assert_eq!(dest.count("/"), 0, "nothing reached the destination");
}

#[test]
fn ipv6_spellings_of_private_addresses_are_refused_too() {
    let dest = Destination::start();
    let port = dest.port;
    // The attack: loopback and private IPv4 addresses spelled as IPv6 addresses that embed
    // them (the mapped form was already refused; these went on to connect).
    let targets = [
        format!("http://[::127.0.0.1]:{port}/rate"),
        format!("http://[64:ff9b::127.0.0.1]:{port}/rate"),
        format!("http://[64:ff9b:1::7f00:1]:{port}/rate"),
        format!("http://[2002:7f00:1::]:{port}/rate"),
        format!("http://[2001:0:a00:1::80ff:fffe]:{port}/rate"),
        format!("http://[::ffff:0:10.0.0.1]:{port}/rate"),
        format!("http://[::ffff:127.0.0.1]:{port}/rate"),
    ];
    let effects: Vec<Value> = targets
        .iter()
        .enumerate()
        .map(|(i, url)| {
            json!({"id": format!("e{i}"), "executor": "server", "trigger": "go != null",
                "dedupeKey": "go", "request": {"method": "GET", "url": url},
                "statusPath": format!("$.s{i}"),
                "policy": {"retries": 2, "backoff": 50, "timeoutMs": 2000}})
        })
        .collect();
    let (_dir, _d, http) = started(&["--effects-allowed-hosts", "*"]);
    let spec = json!({"id": "probe", "schema": {"type": "object"}, "effects": effects});
    assert_eq!(http.post_json("/models", &spec).status, 201);
    let other = json!({"id": "bystander", "schema": {"type": "object"}});
    assert_eq!(http.post_json("/models", &other).status, 201);
    mutate(&http, "probe", json!({"$.go": 1}));
    let n = targets.len();
    let s = wait_for(&http, "probe", "every call refused", |s| {
        (0..n).all(|i| phase(s, &format!("s{i}")) == "failed")
    });
    for (i, url) in targets.iter().enumerate() {
        let st = &s[format!("s{i}")];
        let e = st["error"].as_str().unwrap_or("");
        assert!(
            e.contains("non-public address") && e.contains("--effects-allow-private-ips"),
            "{url}: {st}"
        );
        assert_eq!(st["attempts"], 1, "{url}: a refusal is not retried: {st}");
    }
    assert_eq!(dest.count("/"), 0, "nothing reached the destination");
    // The daemon stays up and the other model is untouched.
    assert_eq!(http.get("/healthz").status, 200);
    assert_eq!(state(&http, "bystander"), json!({}));
}

#[test]
fn a_timer_scheduled_before_a_restart_fires_after_it_and_llm_is_reported() {
    let (dir, d, http) = started(&[]);
    let spec = json!({
        "id": "t",
        "schema": {"type": "object"},
        "effects": [
            {"id": "expire", "executor": "timer", "trigger": "armed = true", "dedupeKey": "armed",
             "afterMs": "1500", "response": {"set": {"$.expired": "true"}}, "statusPath": "$.timer"},
            {"id": "ask", "executor": "llm", "trigger": "armed = true", "dedupeKey": "armed",
             "prompt": "'hello'", "response": {"set": {"$.answer": "$response"}}, "statusPath": "$.llm"}
        ]
    });
    let r = http.post_json("/models", &spec);
    assert_eq!(r.status, 201, "{r:?}");
    mutate(&http, "t", json!({"$.armed": true}));
    let s = wait_for(&http, "t", "pending timer", |s| {
        phase(s, "timer") == "pending"
    });
    let fire_at = s["timer"]["fireAt"].as_i64().expect("fireAt");
    let s = wait_for(&http, "t", "llm reported", |s| phase(s, "llm") == "failed");
    assert!(
        s["llm"]["error"]
            .as_str()
            .unwrap()
            .contains("not executable"),
        "{s}"
    );
    d.kill9();
    let d = daemon(dir.path(), &[]);
    let http = Http::new(&d);
    let s = wait_for(&http, "t", "the timer fired after the restart", |s| {
        s["expired"] == true
    });
    assert_eq!(phase(&s, "timer"), "applied", "{s}");
    let now = chrono_now_ms();
    assert!(now >= fire_at, "fired before its time ({now} < {fire_at})");
}

fn chrono_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[test]
fn a_timer_whose_trigger_no_longer_holds_is_cancelled() {
    let (_dir, _d, http) = started(&[]);
    let spec = json!({
        "id": "c",
        "schema": {"type": "object"},
        "effects": [{"id": "expire", "executor": "timer", "trigger": "armed = true",
            "dedupeKey": "armed", "afterMs": 300, "response": {"set": {"$.expired": "true"}},
            "statusPath": "$.timer"}]
    });
    assert_eq!(http.post_json("/models", &spec).status, 201);
    mutate(&http, "c", json!({"$.armed": true}));
    mutate(&http, "c", json!({"$.armed": "later"}));
    // The trigger no longer holds when the timer comes due (its key did not fire again).
    let s = wait_for(&http, "c", "cancelled", |s| {
        phase(s, "timer") == "cancelled"
    });
    assert!(s.get("expired").is_none(), "{s}");
}

#[test]
fn effects_requested_by_the_seeding_cycle_run_too() {
    let (_dir, _d, http) = started(&[]);
    let spec = json!({
        "id": "seeded",
        "schema": {"type": "object"},
        "defaultValues": [{"path": "$", "expr": "{\"armed\": true}"}],
        "effects": [{"id": "soon", "executor": "timer", "trigger": "armed = true",
            "dedupeKey": "armed", "afterMs": 100, "response": {"set": {"$.fired": "true"}},
            "statusPath": "$.timer"}]
    });
    let r = http.post_json("/models", &spec);
    assert_eq!(r.status, 201, "{r:?}");
    let s = wait_for(&http, "seeded", "fired", |s| s["fired"] == true);
    assert_eq!(phase(&s, "timer"), "applied", "{s}");
}

/// A TLS destination with a certificate made for 127.0.0.1; the PEM file of that certificate.
fn tls_destination(hits: Arc<Mutex<Vec<(String, String)>>>) -> (u16, tempfile::NamedTempFile) {
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).expect("cert");
    let mut pem = tempfile::NamedTempFile::new().expect("temp");
    pem.write_all(ck.cert.pem().as_bytes()).expect("write pem");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![ck.cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(ck.signing_key.serialize_der().into()),
        )
        .expect("server config");
    let config = Arc::new(config);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let (config, hits) = (config.clone(), hits.clone());
            std::thread::spawn(move || {
                let Ok(conn) = rustls::ServerConnection::new(config) else {
                    return;
                };
                let mut tls = rustls::StreamOwned::new(conn, tcp);
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).to_string();
                let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                hits.lock().unwrap().push((path, String::new()));
                let body = "{\"multiplier\":2}";
                let _ = write!(
                    tls,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.flush();
                tls.conn.send_close_notify();
                let _ = tls.flush();
            });
        }
    });
    (port, pem)
}

#[test]
fn an_https_destination_is_called_with_the_operators_ca() {
    let hits: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let (port, pem) = tls_destination(hits.clone());
    let dir = tempfile::tempdir().unwrap();
    let ca = pem.path().to_str().unwrap().to_string();
    let mut args = LOCAL.to_vec();
    args.extend_from_slice(&["--effects-ca-file", &ca]);
    let d = daemon(dir.path(), &args);
    let http = Http::new(&d);
    let mut s = spec(port, "/rate", 0);
    s["effects"][0]["request"]["url"] =
        json!(format!("https://127.0.0.1:{port}/rate?region={{ region }}"));
    assert_eq!(http.post_json("/models", &s).status, 201);
    mutate(&http, "quote", json!({"$.region": "north"}));
    let st = wait_for(&http, "quote", "applied over https", |s| {
        matches!(phase(s, "io").as_str(), "applied" | "failed")
    });
    assert_eq!(phase(&st, "io"), "applied", "{st}");
    assert_eq!(st["multiplier"], 2, "{st}");
    assert_eq!(hits.lock().unwrap().len(), 1);

    // Without the operator's CA the certificate is not trusted: failed, and said why.
    let dir2 = tempfile::tempdir().unwrap();
    let d2 = daemon(dir2.path(), LOCAL);
    let http2 = Http::new(&d2);
    assert_eq!(http2.post_json("/models", &s).status, 201);
    mutate(&http2, "quote", json!({"$.region": "north"}));
    let st = wait_for(&http2, "quote", "refused certificate", |s| {
        phase(s, "io") == "failed"
    });
    let err = st["io"]["error"].as_str().unwrap_or("").to_lowercase();
    assert!(
        err.contains("cert") || err.contains("tls") || err.contains("issuer"),
        "{st}"
    );
}

#[test]
fn model_links_write_and_read_another_model() {
    let (_dir, _d, http) = started(&[]);
    let ledger = json!({"id": "ledger", "schema": {"type": "object"},
        "derivations": [{"path": "$.doubled", "expr": "amount * 2"}]});
    assert_eq!(http.post_json("/models", &ledger).status, 201);
    let orders = json!({
        "id": "orders",
        "schema": {"type": "object"},
        "effects": [
            {"id": "post", "executor": "server", "trigger": "amount != null", "dedupeKey": "amount",
             "target": {"ref": "ledger", "path": "$.amount"}, "body": "amount",
             "response": {"set": {"$.posted": "$response.success"}}, "statusPath": "$.io"},
            {"id": "peek", "executor": "server", "trigger": "posted = true", "dedupeKey": "amount",
             "target": {"ref": "ledger", "read": "$.doubled"},
             "response": {"set": {"$.seen": "$response"}}, "statusPath": "$.io2"},
            {"id": "nowhere", "executor": "server", "trigger": "amount != null", "dedupeKey": "amount",
             "target": {"ref": "missing-model", "path": "$.x"}, "body": "1", "statusPath": "$.io3"}
        ]
    });
    let r = http.post_json("/models", &orders);
    assert_eq!(r.status, 201, "{r:?}");
    mutate(&http, "orders", json!({"$.amount": 21}));
    let s = wait_for(&http, "orders", "linked write and read", |s| {
        s["seen"] == 42
    });
    assert_eq!(s["posted"], true, "{s}");
    assert_eq!(phase(&s, "io"), "applied");
    let s = wait_for(&http, "orders", "missing target", |s| {
        phase(s, "io3") == "failed"
    });
    assert!(
        s["io3"]["error"]
            .as_str()
            .unwrap()
            .contains("missing-model"),
        "{s}"
    );
    assert_eq!(state(&http, "ledger")["doubled"], 42);
    let audit = http.get("/models/ledger/audit").json();
    assert!(
        audit
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["source"] == "link"),
        "{audit}"
    );
}

#[test]
fn a_requests_fan_out_sends_each_descriptor_and_folds_back_all_responses() {
    let dest = Destination::start();
    let (_dir, _d, http) = started(LOCAL);
    let base = format!("http://127.0.0.1:{}", dest.port);
    let spec = json!({
        "id": "fan",
        "schema": {"type": "object"},
        "effects": [{
            "id": "rates", "executor": "server", "trigger": "$count(regions) > 0",
            "dedupeKey": "$join(regions, ',')",
            "requests": format!("regions.{{ \"url\": \"{base}/rate?region=\" & $, \"method\": \"POST\", \"body\": {{\"region\": $}} }}"),
            "response": {"set": {"$.multipliers": "$response.multiplier"}},
            "statusPath": "$.io"
        }]
    });
    let r = http.post_json("/models", &spec);
    assert_eq!(r.status, 201, "{r:?}");
    mutate(&http, "fan", json!({"$.regions": ["north", "south"]}));
    let s = wait_for(&http, "fan", "fan-out applied", |s| {
        phase(s, "io") == "applied"
    });
    assert_eq!(s["multipliers"], json!([1.25, 1.25]), "{s}");
    assert_eq!(dest.count("/rate?region=north"), 1);
    assert_eq!(dest.count("/rate?region=south"), 1);
    let keys = dest.keys();
    assert!(
        keys.iter().any(|k| k.ends_with("/0")) && keys.iter().any(|k| k.ends_with("/1")),
        "{keys:?}"
    );
}
