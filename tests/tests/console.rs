//! `valem console` as a script drives it: the real binary, JSON lines on stdin, one answer line
//! per command on stdout; embedded (in-process) and remote (`--url` against `valem serve`).

use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, ExitStatus};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use valem_tests::Daemon;

/// A running `valem console`.
struct Console {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Console {
    fn start(args: &[&str]) -> Console {
        Console::start_env(args, &[])
    }

    fn start_env(args: &[&str], env: &[(&str, &str)]) -> Console {
        let (child, stdin, lines) = valem_tests::spawn_lines("console", args, env);
        Console {
            child,
            stdin,
            lines,
        }
    }

    fn send_line(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin open");
        s.write_all(line.as_bytes()).expect("write");
        s.write_all(b"\n").expect("write");
        s.flush().expect("flush");
    }

    fn recv(&self) -> Value {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(30))
            .expect("valem console answered in time");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("answer is not JSON ({e}): {line}"))
    }

    /// Send a raw line; its answer.
    fn raw(&mut self, line: &str) -> Value {
        self.send_line(line);
        self.recv()
    }

    /// Send a command; its answer.
    fn cmd(&mut self, c: Value) -> Value {
        self.raw(&c.to_string())
    }

    /// A command that must succeed; its result.
    fn ok(&mut self, c: Value) -> Value {
        let a = self.cmd(c.clone());
        assert_eq!(a["ok"], json!(true), "{c} → {a}");
        assert!(a.get("error").is_none(), "{a}");
        a["result"].clone()
    }

    /// A command that must fail; its error message.
    fn err(&mut self, c: Value) -> String {
        let a = self.cmd(c.clone());
        assert_eq!(a["ok"], json!(false), "{c} → {a}");
        a["error"]
            .as_str()
            .unwrap_or_else(|| panic!("error is a string: {a}"))
            .to_string()
    }

    /// Close stdin (or not) and wait for the exit; the status and the lines not yet received.
    fn finish(mut self, close_stdin: bool) -> (ExitStatus, Vec<String>) {
        if close_stdin {
            drop(self.stdin.take());
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                let rest = self.lines.iter().collect();
                return (s, rest);
            }
            assert!(Instant::now() < deadline, "valem console did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn demo_spec() -> Value {
    json!({"id":"demo","schema":{"type":"object","properties":{"price":{"type":"number"},"qty":{"type":"number"}}},"derivations":[{"path":"$.total","expr":"price * qty"}]})
}

const ALL_COMMANDS: &[&str] = &[
    "list-models",
    "create-model",
    "get-spec",
    "get-info",
    "get-state",
    "get-field",
    "mutate",
    "patch-mutate",
    "get-history",
    "get-schema",
    "explain",
    "snapshot",
    "restore",
    "evolve-spec",
    "delete-model",
    "upload-blob",
    "get-blob",
    "get-model-blob",
    "get-view",
    "help",
    "exit",
];

/// Every command with real values asserted; the same sequence in both modes.
fn full_session(c: &mut Console, mode: &str) {
    // help: every command with its arguments, and the mode.
    let help = c.ok(json!({"cmd": "help"}));
    assert_eq!(help["mode"], json!(mode));
    let names: Vec<&str> = help["commands"]
        .as_array()
        .expect("commands")
        .iter()
        .filter_map(|x| x["cmd"].as_str())
        .collect();
    assert_eq!(names, ALL_COMMANDS);
    let mutate = help["commands"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["cmd"] == "mutate"))
        .cloned()
        .expect("mutate listed");
    assert_eq!(mutate["args"]["id"]["required"], json!(true));
    assert_eq!(mutate["args"]["mutations"]["type"], json!("object"));
    assert_eq!(mutate["rest"], json!("POST /models/{id}/mutations"));

    assert_eq!(c.ok(json!({"cmd": "list-models"})), json!([]));

    // create-model → the model info, as the MCP tool returns it.
    let info = c.ok(json!({"cmd": "create-model", "spec": demo_spec()}));
    assert_eq!(info["id"], json!("demo"));
    assert_eq!(info["derivationCount"], json!(1));
    assert_eq!(info["constraintCount"], json!(0));
    let e = c.err(json!({"cmd": "create-model", "spec": demo_spec()}));
    assert!(e.contains("already exists"), "{e}");
    assert_eq!(c.ok(json!({"cmd": "list-models"})), json!(["demo"]));
    assert_eq!(c.ok(json!({"cmd": "get-info", "id": "demo"})), info);
    let spec = c.ok(json!({"cmd": "get-spec", "id": "demo"}));
    assert_eq!(spec["id"], json!("demo"));
    assert_eq!(spec["derivations"][0]["expr"], json!("price * qty"));
    assert_eq!(spec["schema"], demo_spec()["schema"]);

    // mutate → the MutationResult; traces only on request.
    let r = c.ok(json!({"cmd": "mutate", "id": "demo", "mutations": {"$.price": 10, "$.qty": 3}}));
    assert_eq!(r["success"], json!(true));
    assert_eq!(r["mutatedPaths"], json!(["$.price", "$.qty"]));
    assert_eq!(r["derivedUpdated"], json!(["$.total"]));
    assert_eq!(r["flaggedConstraints"], json!([]));
    assert_eq!(r["dispatchedEffects"], json!([]));
    assert!(r.get("traces").is_none(), "{r}");
    assert_eq!(
        c.ok(json!({"cmd": "get-field", "id": "demo", "path": "$.total"})),
        json!(30)
    );
    let state = c.ok(json!({"cmd": "get-state", "id": "demo"}));
    assert_eq!(
        serde_json::to_string(&state).unwrap(),
        r#"{"price":10,"qty":3,"total":30}"#
    );

    let r = c.ok(
        json!({"cmd": "mutate", "id": "demo", "mutations": {"$.price": 20}, "includeTraces": true}),
    );
    let traces = r["traces"].as_array().expect("traces on request");
    assert!(
        traces
            .iter()
            .any(|t| t["targetPath"] == "$.total" && t["result"] == json!(60)),
        "{r}"
    );

    // patch-mutate: an RFC 6902 patch of the base document.
    let r = c.ok(json!({"cmd": "patch-mutate", "id": "demo",
        "patch": [{"op": "replace", "path": "/qty", "value": 4}]}));
    assert_eq!(r["success"], json!(true));
    assert_eq!(r["derivedUpdated"], json!(["$.total"]));
    assert_eq!(
        c.ok(json!({"cmd": "get-field", "id": "demo", "path": "$.total"})),
        json!(80)
    );
    let e = c.err(
        json!({"cmd": "patch-mutate", "id": "demo", "patch": [{"op": "jump", "path": "/qty"}]}),
    );
    assert!(e.to_lowercase().contains("patch"), "{e}");

    // get-history and get-state at each commit: the totals in commit order.
    let history = c.ok(json!({"cmd": "get-history", "id": "demo"}));
    let history: Vec<String> = history
        .as_array()
        .expect("history is an array")
        .iter()
        .map(|t| t.as_str().expect("ISO-8601 string").to_string())
        .collect();
    assert!(history.len() >= 3, "{history:?}");
    let totals: Vec<Value> = history
        .iter()
        .map(|at| c.ok(json!({"cmd": "get-state", "id": "demo", "at": at}))["total"].clone())
        .collect();
    assert_eq!(
        totals[totals.len() - 3..],
        [json!(30), json!(60), json!(80)]
    );
    let e = c.err(json!({"cmd": "get-state", "id": "demo", "at": "not a time"}));
    assert!(!e.is_empty());

    // get-schema and explain.
    let schema = c.ok(json!({"cmd": "get-schema", "id": "demo", "path": "$.price"}));
    assert_eq!(schema["type"], json!("number"), "{schema}");
    let explain = c.ok(json!({"cmd": "explain", "id": "demo", "path": "$.total"}));
    let last = explain
        .as_array()
        .and_then(|a| a.last())
        .cloned()
        .expect("traces");
    assert_eq!(last["targetPath"], json!("$.total"));
    assert_eq!(last["expression"], json!("price * qty"));
    assert_eq!(last["result"], json!(80));

    // snapshot, change, restore.
    let snap = c.ok(json!({"cmd": "snapshot", "id": "demo"}));
    assert_eq!(snap["modelId"], json!("demo"));
    assert_eq!(snap["baseDoc"], json!({"price": 20, "qty": 4}));
    c.ok(json!({"cmd": "mutate", "id": "demo", "mutations": {"$.price": 1}}));
    assert_eq!(
        c.ok(json!({"cmd": "get-field", "id": "demo", "path": "$.total"})),
        json!(4)
    );
    c.ok(json!({"cmd": "restore", "id": "demo", "snapshot": snap}));
    assert_eq!(
        c.ok(json!({"cmd": "get-field", "id": "demo", "path": "$.total"})),
        json!(80)
    );

    // evolve-spec: a derivation, a rollback constraint and a view.
    let evolved = c.ok(json!({"cmd": "evolve-spec", "id": "demo", "evolution": {
        "newVersion": "1.1.0",
        "upsertDerivations": [{"path": "$.double", "expr": "total * 2"}],
        "upsertConstraints": [{"id": "cap", "expr": "total <= 1000", "message": "Total over 1000", "policy": "rollback"}],
        "newViewDefinition": {"defaultView": "main", "views": [
            {"id": "main", "title": "Main", "components": [{"id": "t", "type": "numericField", "bind": "$.total", "label": "Total"}]},
            {"id": "other", "components": [{"id": "p", "type": "numericField", "bind": "$.price"}]}
        ]}
    }}));
    assert_eq!(evolved["version"], json!("1.1.0"));
    assert_eq!(evolved["derivationCount"], json!(2));
    assert_eq!(evolved["constraintCount"], json!(1));
    assert_eq!(
        c.ok(json!({"cmd": "get-field", "id": "demo", "path": "$.double"})),
        json!(160)
    );
    let e = c.err(json!({"cmd": "evolve-spec", "id": "demo",
        "evolution": {"expectedVersion": "0.9.0", "newVersion": "2.0.0"}}));
    assert!(e.contains("Version conflict"), "{e}");

    // get-view: the default and a named view.
    let view = c.ok(json!({"cmd": "get-view", "id": "demo"}));
    assert_eq!(view["viewId"], json!("main"));
    assert_eq!(view["components"][0]["id"], json!("t"));
    assert_eq!(view["components"][0]["value"], json!(80));
    let other = c.ok(json!({"cmd": "get-view", "id": "demo", "viewId": "other"}));
    assert_eq!(other["viewId"], json!("other"));
    assert_eq!(other["components"][0]["value"], json!(20));
    let e = c.err(json!({"cmd": "get-view", "id": "demo", "viewId": "nope"}));
    assert!(e.contains("nope"), "{e}");

    // Structured failures: the state is unchanged.
    let e = c.err(json!({"cmd": "mutate", "id": "demo", "mutations": {"$.price": "ten"}}));
    assert!(e.contains("Schema violation"), "{e}");
    let e = c.err(json!({"cmd": "mutate", "id": "demo", "mutations": {"$.price": 1000}}));
    assert!(
        e.contains("Constraint violation") || e.contains("Total over 1000"),
        "{e}"
    );
    assert!(e.contains("Total over 1000"), "{e}");
    assert_eq!(
        c.ok(json!({"cmd": "get-field", "id": "demo", "path": "$.price"})),
        json!(20)
    );

    // Blobs: base64 in, base64 out; a model's blob only once its state references it.
    let blob = c.ok(json!({"cmd": "upload-blob", "data": "aGVsbG8=", "mediaType": "text/plain"}));
    let blob_id = blob["blobId"].as_str().expect("blobId").to_string();
    assert_eq!(blob["bytes"], json!(5));
    assert_eq!(blob["mediaType"], json!("text/plain"));
    let got = c.ok(json!({"cmd": "get-blob", "blobId": blob_id}));
    assert_eq!(got["data"], json!("aGVsbG8="));
    assert_eq!(got["bytes"], json!(5));
    assert_eq!(got["blobId"], json!(blob_id));
    assert!(
        got["mediaType"]
            .as_str()
            .is_some_and(|m| m.starts_with("text/plain")),
        "{got}"
    );
    let e = c.err(json!({"cmd": "get-model-blob", "id": "demo", "blobId": blob_id}));
    assert!(e.contains("not found"), "{e}");
    c.ok(json!({"cmd": "mutate", "id": "demo", "mutations": {"$.attachment": blob_id}}));
    let got = c.ok(json!({"cmd": "get-model-blob", "id": "demo", "blobId": blob_id}));
    assert_eq!(got["data"], json!("aGVsbG8="));
    let e = c.err(json!({"cmd": "get-blob", "blobId": "0000"}));
    assert!(e.contains("not found"), "{e}");
    let e = c.err(json!({"cmd": "upload-blob", "data": "%%%", "mediaType": "text/plain"}));
    assert!(e.contains("base64"), "{e}");

    // Unknown model and absent field.
    let e = c.err(json!({"cmd": "get-state", "id": "nope"}));
    assert!(e.contains("nope") && e.contains("not found"), "{e}");
    let e = c.err(json!({"cmd": "mutate", "id": "nope", "mutations": {"$.a": 1}}));
    assert!(e.contains("not found"), "{e}");
    let e = c.err(json!({"cmd": "get-field", "id": "demo", "path": "$.missing"}));
    assert!(!e.is_empty());

    // delete-model.
    assert_eq!(
        c.ok(json!({"cmd": "delete-model", "id": "demo"})),
        json!({"deleted": true, "id": "demo"})
    );
    assert_eq!(c.ok(json!({"cmd": "list-models"})), json!([]));
    let e = c.err(json!({"cmd": "get-info", "id": "demo"}));
    assert!(e.contains("not found"), "{e}");
    let e = c.err(json!({"cmd": "delete-model", "id": "demo"}));
    assert!(e.contains("not found"), "{e}");

    // exit answers, then the console ends.
    assert_eq!(
        c.cmd(json!({"cmd": "exit"})),
        json!({"ok": true, "result": "bye"})
    );
}

#[test]
fn embedded_every_command() {
    let mut c = Console::start(&[]);
    full_session(&mut c, "embedded");
    let (status, rest) = c.finish(false);
    assert!(status.success());
    assert!(rest.is_empty(), "{rest:?}");
}

#[test]
fn embedded_structured_failures_are_json_text() {
    let mut c = Console::start(&[]);
    c.ok(json!({"cmd": "create-model", "spec": demo_spec()}));
    let e = c.err(json!({"cmd": "mutate", "id": "demo", "mutations": {"$.price": "ten"}}));
    let body: Value = serde_json::from_str(&e).expect("a structured failure is JSON text");
    assert_eq!(body["error"], json!("Schema violation"));
    assert_eq!(body["violations"][0]["path"], json!("$.price"));
    assert_eq!(body["violations"][0]["keyword"], json!("type"));
    let e = c.err(json!({"cmd": "create-model", "spec": {"id": "bad", "schema": {}, "derivations": [{"path": "$.x", "expr": "1 +"}]}}));
    assert!(e.contains("derivations"), "{e}");
}

#[test]
fn embedded_bad_lines_are_answered_and_the_console_keeps_going() {
    let mut c = Console::start(&[]);
    let cases: &[(&str, &[&str])] = &[
        ("{not json", &["not valid JSON"]),
        ("[1, 2]", &["must be a JSON object"]),
        (r#"{"id": "demo"}"#, &["missing `cmd`"]),
        (r#"{"cmd": 7}"#, &["`cmd` must be a string"]),
        (
            r#"{"cmd": "frobnicate"}"#,
            &["unknown command `frobnicate`"],
        ),
        (
            r#"{"cmd": "get-spec"}"#,
            &["`get-spec`", "missing argument `id`"],
        ),
        (
            r#"{"cmd": "get-field", "id": "demo"}"#,
            &["`get-field`", "missing argument `path`"],
        ),
        (
            r#"{"cmd": "get-spec", "id": 42}"#,
            &[
                "`get-spec`",
                "argument `id` must be a string",
                "not a number",
            ],
        ),
        (
            r#"{"cmd": "mutate", "id": "demo", "mutations": [1]}"#,
            &["`mutate`", "argument `mutations` must be an object"],
        ),
        (
            r#"{"cmd": "mutate", "id": "demo", "mutations": {}, "includeTraces": "yes"}"#,
            &["`includeTraces` must be a boolean"],
        ),
        (
            r#"{"cmd": "patch-mutate", "id": "demo", "patch": {}}"#,
            &["`patch-mutate`", "argument `patch` must be an array"],
        ),
        (
            r#"{"cmd": "get-spec", "id": "demo", "extra": 1}"#,
            &["`get-spec`", "unknown argument `extra`"],
        ),
        (
            r#"{"cmd": "upload-blob", "data": "aGk="}"#,
            &["`upload-blob`", "missing argument `mediaType`"],
        ),
        (
            r#"{"cmd": "get-state", "id": "nope"}"#,
            &["model `nope` not found"],
        ),
    ];
    for (line, needles) in cases {
        let a = c.raw(line);
        assert_eq!(a["ok"], json!(false), "{line} → {a}");
        let e = a["error"].as_str().unwrap_or_default();
        for n in *needles {
            assert!(e.contains(n), "{line} → {e:?} lacks {n:?}");
        }
        // Still serving.
        assert_eq!(c.ok(json!({"cmd": "list-models"})), json!([]));
    }
    // Blank lines are not commands and get no answer.
    c.send_line("");
    c.send_line("   ");
    assert_eq!(c.ok(json!({"cmd": "list-models"})), json!([]));
    // Invalid UTF-8 is a bad line too.
    {
        let s = c.stdin.as_mut().expect("stdin");
        s.write_all(b"{\"cmd\":\"\xff\"}\n").expect("write");
        s.flush().expect("flush");
    }
    assert_eq!(c.recv()["ok"], json!(false));
    assert_eq!(c.ok(json!({"cmd": "list-models"})), json!([]));
}

#[test]
fn exit_ends_the_console_and_later_lines_are_not_read() {
    let mut c = Console::start(&[]);
    c.send_line(r#"{"cmd":"list-models"}"#);
    c.send_line(r#"{"cmd":"exit"}"#);
    c.send_line(r#"{"cmd":"list-models"}"#);
    let (status, lines) = c.finish(false);
    assert!(status.success());
    assert_eq!(
        lines,
        [
            r#"{"ok":true,"result":[]}"#,
            r#"{"ok":true,"result":"bye"}"#
        ]
    );
}

#[test]
fn end_of_input_ends_the_console_after_answering() {
    let mut c = Console::start(&[]);
    c.send_line(&json!({"cmd": "create-model", "spec": demo_spec()}).to_string());
    c.send_line(r#"{"cmd":"mutate","id":"demo","mutations":{"$.price":10,"$.qty":3}}"#);
    c.send_line(r#"{"cmd":"get-field","id":"demo","path":"$.total"}"#);
    let (status, lines) = c.finish(true);
    assert!(status.success());
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[2], r#"{"ok":true,"result":30}"#);
}

#[test]
fn over_long_lines_are_refused_and_skipped() {
    let mut c = Console::start(&["--max-line-bytes", "100"]);
    let e = c.err(json!({"cmd": "get-spec", "id": "x".repeat(200)}));
    assert!(e.contains("exceeds the limit of 100 bytes"), "{e}");
    assert_eq!(c.ok(json!({"cmd": "list-models"})), json!([]));
}

#[test]
fn help_flag_explains_the_protocol_and_both_modes() {
    let o = valem_tests::run(&["console", "--help"], None);
    assert!(o.status.success());
    let text = valem_tests::stdout(&o);
    for needle in [
        r#"{"cmd""#,
        r#"{"ok":true,"result""#,
        r#"{"ok":false,"error""#,
        "embedded",
        "--url",
        "VALEM_URL",
        "--api-key",
        "VALEM_API_KEY",
        "Bearer",
        "exit",
        "help",
    ] {
        assert!(text.contains(needle), "--help lacks {needle:?}:\n{text}");
    }
}

// --- remote mode --------------------------------------------------------------------------

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

#[test]
fn remote_daemon_down_is_a_clear_error_and_the_console_keeps_going() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let mut c = Console::start(&["--url", &url]);
    for cmd in [
        json!({"cmd": "list-models"}),
        json!({"cmd": "create-model", "spec": demo_spec()}),
        json!({"cmd": "get-field", "id": "demo", "path": "$.total"}),
        json!({"cmd": "upload-blob", "data": "aGk=", "mediaType": "text/plain"}),
    ] {
        let e = c.err(cmd);
        assert!(e.contains("cannot reach the valem daemon"), "{e}");
        assert!(e.contains(&url), "{e}");
    }
    // Argument errors are found before any call.
    let e = c.err(json!({"cmd": "get-field", "id": "demo"}));
    assert!(e.contains("missing argument `path`"), "{e}");
    let help = c.ok(json!({"cmd": "help"}));
    assert_eq!(help["mode"], json!(format!("remote {url}")));
    assert_eq!(c.cmd(json!({"cmd": "exit"}))["result"], json!("bye"));
    let (status, _) = c.finish(false);
    assert!(status.success());
}

#[test]
fn remote_url_from_the_environment() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let mut c = Console::start_env(&[], &[("VALEM_URL", &url)]);
    assert_eq!(
        c.ok(json!({"cmd": "help"}))["mode"],
        json!(format!("remote {url}"))
    );
    let e = c.err(json!({"cmd": "list-models"}));
    assert!(e.contains(&url), "{e}");
}

#[test]
fn remote_url_must_be_http_or_https() {
    let o = valem_tests::run(&["console", "--url", "ftp://valem.example"], None);
    assert_eq!(o.status.code(), Some(2));
    let err = valem_tests::stderr(&o);
    assert!(err.contains("http://") && err.contains("https://"), "{err}");
    assert!(valem_tests::stdout(&o).is_empty());
    let o = valem_tests::run(&["console", "--url", "localhost:8080"], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        valem_tests::stderr(&o).contains("http://"),
        "{}",
        valem_tests::stderr(&o)
    );
}

/// One request the fake daemon received.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A canned answer: status, content type, body.
type Answer = (u16, &'static str, Vec<u8>);

/// A minimal HTTP/1.1 server on loopback that records every request and answers it with
/// `route(method, target)`; one request per connection.
fn fake_daemon(
    route: fn(&str, &str) -> Answer,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<Seen>>>) {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { break };
            let mut reader = std::io::BufReader::new(stream.try_clone().expect("clone"));
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let mut parts = request_line.split_whitespace();
            let method = parts.next().unwrap_or("").to_string();
            let target = parts.next().unwrap_or("").to_string();
            let mut headers = Vec::new();
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.trim_end().split_once(':') {
                    headers.push((k.trim().to_string(), v.trim().to_string()));
                }
            }
            let len: usize = headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(0);
            let mut body = vec![0; len];
            let _ = reader.read_exact(&mut body);
            let (status, content_type, answer) = route(&method, &target);
            log.lock().expect("log").push(Seen {
                method,
                target,
                headers,
                body,
            });
            let head = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                answer.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&answer);
        }
    });
    (url, seen)
}

fn fake_routes(method: &str, target: &str) -> Answer {
    let j = |status: u16, v: Value| (status, "application/json", v.to_string().into_bytes());
    let mutation = json!({"success": true, "mutatedPaths": ["$.qty"], "derivedUpdated": [], "metaUpdated": [],
        "flaggedConstraints": [], "dispatchedEffects": [], "traces": [{"targetPath": "$.total"}]});
    match (method, target) {
        ("GET", "/models") => j(200, json!(["a", "b"])),
        ("POST", "/models") => j(201, json!({"id": "demo", "status": "created"})),
        ("GET", "/models/demo") => j(
            200,
            json!({"id": "demo", "version": "1.0.0", "derivationCount": 1}),
        ),
        ("GET", "/models/my%20model/state/%24.items%5B0%5D.qty") => j(200, json!(7)),
        ("GET", "/models/demo/state?at=2025-01-01T00%3A00%3A00%2B02%3A00") => {
            j(200, json!({"total": 1}))
        }
        ("POST", "/models/demo/mutations") | ("POST", "/models/demo/mutations/patch") => {
            j(200, mutation)
        }
        ("GET", "/models/demo/explain/%24constraint%3Acap") => j(200, json!([])),
        ("DELETE", "/models/demo") => (204, "text/plain", Vec::new()),
        ("POST", "/blobs") => j(
            201,
            json!({"blobId": "abc", "bytes": 5, "mediaType": "text/plain"}),
        ),
        ("GET", "/blobs/abc") => (200, "text/plain", b"hello".to_vec()),
        ("GET", "/models/demo/view/other") => j(200, json!({"viewId": "other"})),
        ("GET", "/models/missing") => j(404, json!({"error": "model `missing` not found"})),
        ("POST", "/models/strict/mutations") => j(
            422,
            json!({"error": "Schema violation", "violations": [{"path": "$.n"}]}),
        ),
        ("GET", "/models/boom") => (500, "text/plain", b"boom".to_vec()),
        ("GET", "/models/garbled") => (200, "application/json", b"{nope".to_vec()),
        _ => (404, "text/plain", Vec::new()),
    }
}

#[test]
fn remote_maps_commands_to_the_reference_rest_calls() {
    let (url, seen) = fake_daemon(fake_routes);
    let mut c = Console::start(&["--url", &format!("{url}/"), "--api-key", "s3cret"]);
    let last = || {
        seen.lock()
            .expect("log")
            .last()
            .cloned()
            .expect("a request")
    };

    assert_eq!(c.ok(json!({"cmd": "list-models"})), json!(["a", "b"]));
    let r = last();
    assert_eq!((r.method.as_str(), r.target.as_str()), ("GET", "/models"));
    assert_eq!(r.header("authorization"), Some("Bearer s3cret"));

    // create-model: POST /models, then the model info (the MCP tool's result).
    let info = c.ok(json!({"cmd": "create-model", "spec": demo_spec()}));
    assert_eq!(info["version"], json!("1.0.0"));
    let log = seen.lock().expect("log").clone();
    let post = &log[log.len() - 2];
    assert_eq!(
        (post.method.as_str(), post.target.as_str()),
        ("POST", "/models")
    );
    assert_eq!(post.header("content-type"), Some("application/json"));
    assert_eq!(
        serde_json::from_slice::<Value>(&post.body).ok(),
        Some(demo_spec())
    );

    // Ids and paths are one percent-encoded segment each; `at` is a query parameter.
    assert_eq!(
        c.ok(json!({"cmd": "get-field", "id": "my model", "path": "$.items[0].qty"})),
        json!(7)
    );
    assert_eq!(
        c.ok(json!({"cmd": "get-state", "id": "demo", "at": "2025-01-01T00:00:00+02:00"})),
        json!({"total": 1})
    );
    assert_eq!(
        c.ok(json!({"cmd": "explain", "id": "demo", "path": "$constraint:cap"})),
        json!([])
    );

    // mutate: the flat map as the body; traces dropped unless asked for.
    let r = c.ok(json!({"cmd": "mutate", "id": "demo", "mutations": {"$.qty": 2}}));
    assert!(r.get("traces").is_none(), "{r}");
    assert_eq!(
        serde_json::from_slice::<Value>(&last().body).ok(),
        Some(json!({"$.qty": 2}))
    );
    let r = c.ok(
        json!({"cmd": "mutate", "id": "demo", "mutations": {"$.qty": 2}, "includeTraces": true}),
    );
    assert_eq!(r["traces"][0]["targetPath"], json!("$.total"));

    // patch-mutate: an RFC 6902 body with its media type.
    let patch = json!([{"op": "replace", "path": "/qty", "value": 4}]);
    c.ok(json!({"cmd": "patch-mutate", "id": "demo", "patch": patch}));
    let r = last();
    assert_eq!(r.target, "/models/demo/mutations/patch");
    assert_eq!(
        r.header("content-type"),
        Some("application/json-patch+json")
    );
    assert_eq!(serde_json::from_slice::<Value>(&r.body).ok(), Some(patch));

    // delete-model: 204 becomes the MCP tool's result.
    assert_eq!(
        c.ok(json!({"cmd": "delete-model", "id": "demo"})),
        json!({"deleted": true, "id": "demo"})
    );
    assert_eq!(last().method, "DELETE");

    // upload-blob: multipart with `file` and `mediaType`; get-blob: raw bytes back to base64.
    let b = c.ok(json!({"cmd": "upload-blob", "data": "aGVsbG8=", "mediaType": "text/plain"}));
    assert_eq!(b["blobId"], json!("abc"));
    let r = last();
    let ct = r.header("content-type").unwrap_or_default().to_string();
    assert!(ct.starts_with("multipart/form-data; boundary="), "{ct}");
    let body = String::from_utf8_lossy(&r.body).into_owned();
    assert!(body.contains("name=\"file\""), "{body}");
    assert!(
        body.contains("Content-Type: text/plain\r\n\r\nhello\r\n"),
        "{body}"
    );
    assert!(
        body.contains("name=\"mediaType\"\r\n\r\ntext/plain\r\n"),
        "{body}"
    );
    assert_eq!(
        c.ok(json!({"cmd": "get-blob", "blobId": "abc"})),
        json!({"blobId": "abc", "bytes": 5, "mediaType": "text/plain", "data": "aGVsbG8="})
    );
    assert_eq!(
        c.ok(json!({"cmd": "get-view", "id": "demo", "viewId": "other"})),
        json!({"viewId": "other"})
    );

    // Non-2xx answers carry the server's message; a bad body is named.
    assert_eq!(
        c.err(json!({"cmd": "get-info", "id": "missing"})),
        "model `missing` not found"
    );
    let e = c.err(json!({"cmd": "mutate", "id": "strict", "mutations": {"$.n": "x"}}));
    assert_eq!(
        serde_json::from_str::<Value>(&e).ok(),
        Some(json!({"error": "Schema violation", "violations": [{"path": "$.n"}]}))
    );
    let e = c.err(json!({"cmd": "get-info", "id": "boom"}));
    assert!(e.contains("500") && e.ends_with("boom"), "{e}");
    let e = c.err(json!({"cmd": "get-info", "id": "garbled"}));
    assert!(e.contains("not JSON"), "{e}");
    let e = c.err(json!({"cmd": "get-spec", "id": "demo"}));
    assert!(e.contains("404") && e.contains("/models/demo/spec"), "{e}");
    // Still serving.
    assert_eq!(c.ok(json!({"cmd": "list-models"})), json!(["a", "b"]));
}

#[test]

fn remote_api_key_against_the_daemon() {
    let d = Daemon::start(&["--api-key", "s3cret"]);
    let url = d.url("");
    let mut without = Console::start(&["--url", &url]);
    let e = without.err(json!({"cmd": "list-models"}));
    assert!(e.contains("API key"), "{e}");
    let mut wrong = Console::start(&["--url", &url, "--api-key", "nope"]);
    let e = wrong.err(json!({"cmd": "list-models"}));
    assert!(e.contains("API key is wrong"), "{e}");
    let mut with = Console::start_env(&["--url", &url], &[("VALEM_API_KEY", "s3cret")]);
    assert_eq!(with.ok(json!({"cmd": "list-models"})), json!([]));
}

#[test]

fn remote_every_command() {
    let d = Daemon::start(&[]);
    let url = d.url("");
    let mut c = Console::start(&["--url", &url]);
    full_session(&mut c, &format!("remote {url}"));
    let (status, rest) = c.finish(false);
    assert!(status.success());
    assert!(rest.is_empty(), "{rest:?}");
}

#[test]

fn remote_state_is_shared_between_consoles() {
    let d = Daemon::start(&["--api-key", "k"]);
    let url = d.url("");
    let mut a = Console::start(&["--url", &url, "--api-key", "k"]);
    let mut b = Console::start(&["--url", &url, "--api-key", "k"]);
    a.ok(json!({"cmd": "create-model", "spec": demo_spec()}));
    b.ok(json!({"cmd": "mutate", "id": "demo", "mutations": {"$.price": 10, "$.qty": 3}}));
    assert_eq!(
        a.ok(json!({"cmd": "get-field", "id": "demo", "path": "$.total"})),
        json!(30)
    );
    let e = b.err(json!({"cmd": "create-model", "spec": demo_spec()}));
    assert!(e.contains("already exists"), "{e}");
}
