//! Helpers for end-to-end tests: find the real `valem` binary and run it.

pub mod backing;
pub mod flood;
pub mod load;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The `valem` binary: `$VALEM_BIN`, else the one built beside these tests
/// (`target/<profile>/valem`).
pub fn valem_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("VALEM_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps");
    let bin = dir.join("valem");
    assert!(
        bin.exists(),
        "{} does not exist: build it first (`cargo build -p valem`, which scripts/test does)",
        bin.display()
    );
    bin
}

/// The repository root (for bundled examples).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Run `valem ARGS` with optional standard input.
pub fn run(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(valem_bin())
        .args(args)
        .current_dir(repo_root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn valem");
    {
        let mut input = child.stdin.take().expect("stdin");
        if let Some(s) = stdin {
            input.write_all(s.as_bytes()).expect("write stdin");
        }
    }
    child.wait_with_output().expect("valem output")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Start `valem SUBCOMMAND ARGS` (VALEM_URL / VALEM_API_KEY removed, `env` added) with piped
/// stdin and its stdout lines arriving on a channel (read on a thread).
pub fn spawn_lines(
    subcommand: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (
    std::process::Child,
    Option<std::process::ChildStdin>,
    std::sync::mpsc::Receiver<String>,
) {
    use std::io::BufRead;
    let mut cmd = Command::new(valem_bin());
    cmd.arg(subcommand)
        .args(args)
        .current_dir(repo_root())
        .env_remove("VALEM_URL")
        .env_remove("VALEM_API_KEY")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn valem {subcommand}: {e}"));
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, stdin, rx)
}

/// A running `valem mcp` driven over raw newline-delimited JSON-RPC.
pub struct Mcp {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Mcp {
    /// Start `valem mcp ARGS` with `env` added to its environment.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Mcp {
        let (child, stdin, lines) = spawn_lines("mcp", args, env);
        Mcp {
            child,
            stdin,
            lines,
        }
    }

    /// Write raw bytes (no newline added).
    pub fn send_raw(&mut self, bytes: &[u8]) {
        let s = self.stdin.as_mut().expect("stdin open");
        s.write_all(bytes).expect("write to valem mcp");
        s.flush().expect("flush");
    }

    /// Write one message as a line.
    pub fn send(&mut self, msg: &serde_json::Value) {
        let mut line = serde_json::to_vec(msg).expect("json");
        line.push(b'\n');
        self.send_raw(&line);
    }

    /// The next line of stdout, parsed; panics after `secs` seconds.
    pub fn recv(&self, secs: u64) -> serde_json::Value {
        let line = self
            .lines
            .recv_timeout(std::time::Duration::from_secs(secs))
            .expect("valem mcp answered in time");
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {line}"))
    }

    /// The next line of stdout as written (to compare bytes); panics after `secs` seconds.
    pub fn recv_line(&self, secs: u64) -> String {
        self.lines
            .recv_timeout(std::time::Duration::from_secs(secs))
            .expect("valem mcp answered in time")
    }

    /// The next message that is not a notification.
    pub fn recv_reply(&self) -> serde_json::Value {
        loop {
            let m = self.recv(10);
            if m.get("method").is_none() {
                return m;
            }
        }
    }

    /// Nothing more arrives within `ms` milliseconds.
    pub fn quiet_for(&self, ms: u64) -> Option<String> {
        self.lines
            .recv_timeout(std::time::Duration::from_millis(ms))
            .ok()
    }

    /// Send a request and wait for its reply (skipping notifications).
    pub fn call(&mut self, id: u64, method: &str, params: serde_json::Value) -> serde_json::Value {
        self.send(
            &serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
        );
        let r = self.recv_reply();
        assert_eq!(r["id"], serde_json::json!(id), "reply to request {id}: {r}");
        r
    }

    /// `initialize` at `version` and `notifications/initialized`; returns the initialize result.
    pub fn handshake(&mut self, version: &str) -> serde_json::Value {
        let r = self.call(
            0,
            "initialize",
            serde_json::json!({"protocolVersion": version, "capabilities": {}}),
        );
        self.send(&serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        r["result"].clone()
    }

    /// `tools/call`; returns the result object.
    pub fn tool(&mut self, id: u64, name: &str, args: serde_json::Value) -> serde_json::Value {
        let r = self.call(
            id,
            "tools/call",
            serde_json::json!({"name": name, "arguments": args}),
        );
        r["result"].clone()
    }

    /// Close stdin and wait for the process to exit (panics after `secs`); returns its status
    /// and the stdout lines not yet received.
    pub fn close(mut self, secs: u64) -> (std::process::ExitStatus, Vec<String>) {
        drop(self.stdin.take());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                let mut rest = Vec::new();
                // The reader thread ends at stdout's EOF, closing the channel.
                while let Ok(l) = self
                    .lines
                    .recv_timeout(std::time::Duration::from_secs(secs))
                {
                    rest.push(l);
                }
                return (s, rest);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "valem mcp did not exit within {secs}s of stdin closing"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `valem serve` on a free loopback port; SIGTERM (then kill) on drop.
pub struct Daemon {
    child: std::process::Child,
    /// `127.0.0.1:PORT`
    pub addr: String,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Daemon {
    /// Start `valem serve --listen 127.0.0.1:0 EXTRA…` and wait until it listens.
    pub fn start(extra: &[&str]) -> Daemon {
        Daemon::start_env(extra, &[])
    }

    /// Start on a given address (to restart a daemon where clients expect it).
    pub fn start_on(listen: &str, extra: &[&str]) -> Daemon {
        Daemon::spawn(listen, extra, &[])
    }

    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        Daemon::spawn("127.0.0.1:0", extra, env)
    }

    fn spawn(listen: &str, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        use std::io::{BufRead, BufReader, Read};
        let mut cmd = Command::new(valem_bin());
        cmd.args(["serve", "--listen", listen])
            .args(extra)
            .current_dir(repo_root())
            .env_remove("VALEM_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn valem serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the listening line");
        let addr = line
            .trim()
            .rsplit("http://")
            .next()
            .unwrap_or("")
            .to_string();
        let err_buf = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = err_buf.clone();
        let mut err = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        assert!(
            addr.starts_with("127.0.0.1:"),
            "valem serve did not report its address (stdout: {line:?})"
        );
        Daemon {
            child,
            addr,
            stderr: err_buf,
        }
    }

    /// `http://127.0.0.1:PORT` + `path`
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// What the daemon wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// What the daemon wrote to stderr once it contains `needle`, or after 10 s what it wrote
    /// by then (stderr is read on a thread of its own, so a line written before the daemon
    /// listened may still be on its way).
    pub fn stderr_with(&self, needle: &str) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let s = self.stderr();
            if s.contains(needle) || std::time::Instant::now() > deadline {
                return s;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Send SIGTERM and wait (at most 15 s) for the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                if !s.success() {
                    // The caller asserts on the status; this says why.
                    eprintln!(
                        "valem serve exited with {s} after SIGTERM; its stderr:\n{}",
                        self.stderr()
                    );
                }
                return s;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("valem serve did not stop within 15 s of SIGTERM");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// SIGKILL: the process gets no chance to flush or clean up.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A blocking HTTP client of a running daemon: every status is a value (never an error), the
/// proxy environment is ignored (loopback only), each request is bounded in time.
pub struct Http {
    agent: ureq::Agent,
    base: String,
    key: Option<String>,
}

/// An HTTP answer.
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    /// The body parsed as JSON (panics with the body when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body is not JSON ({e}): {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A header's value (names compare case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.text())
    }
}

impl Http {
    pub fn new(d: &Daemon) -> Http {
        Http::new_addr(&d.addr)
    }

    /// A client of whatever listens on `addr` (`127.0.0.1:PORT`: a proxy in front of daemons).
    pub fn new_addr(addr: &str) -> Http {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .timeout_global(Some(std::time::Duration::from_secs(30)))
            .build();
        Http {
            agent: config.into(),
            base: format!("http://{addr}"),
            key: None,
        }
    }

    /// Send `Authorization: Bearer <key>` on every request.
    pub fn with_key(mut self, key: &str) -> Http {
        self.key = Some(key.to_string());
        self
    }

    fn reply(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Reply {
        let r = r.expect("the daemon answered");
        let status = r.status().as_u16();
        let headers = r
            .headers()
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
            .collect();
        let body = r
            .into_body()
            .with_config()
            .limit(256 << 20)
            .read_to_vec()
            .expect("read the body");
        Reply {
            status,
            headers,
            body,
        }
    }

    fn auth<B>(
        &self,
        mut rb: ureq::RequestBuilder<B>,
        headers: &[(&str, &str)],
    ) -> ureq::RequestBuilder<B> {
        if let Some(k) = &self.key {
            rb = rb.header("Authorization", &format!("Bearer {k}"));
        }
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        rb
    }

    pub fn get(&self, path: &str) -> Reply {
        self.get_with(path, &[])
    }

    pub fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let rb = self.agent.get(format!("{}{path}", self.base));
        Http::reply(self.auth(rb, headers).call())
    }

    pub fn delete(&self, path: &str) -> Reply {
        let rb = self.agent.delete(format!("{}{path}", self.base));
        Http::reply(self.auth(rb, &[]).call())
    }

    /// POST `body` with `headers` (give the Content-Type there, or none).
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let rb = self.agent.post(format!("{}{path}", self.base));
        Http::reply(self.auth(rb, headers).send(body))
    }

    /// POST a JSON value as `application/json`.
    pub fn post_json(&self, path: &str, v: &serde_json::Value) -> Reply {
        self.post(
            path,
            &[("Content-Type", "application/json")],
            v.to_string().as_bytes(),
        )
    }
}

/// A paired sandbox session's token, over the device flow as an agent and the page run it:
/// mint (with the daemon's API key `key`), approve (as the page, without it), redeem.
pub fn paired_token(d: &Daemon, key: &str) -> String {
    use serde_json::json;
    let keyed = Http::new(d).with_key(key);
    let m = keyed.post_json("/sandbox/pair", &json!({}));
    assert_eq!(m.status, 200, "{m:?}");
    let m = m.json();
    let ok = Http::new(d).post_json(
        "/sandbox/pair/approve",
        &json!({"pairCode": m["pairCode"], "userCode": m["userCode"]}),
    );
    assert_eq!(ok.status, 200, "{ok:?}");
    let t = keyed.post_json(
        "/sandbox/pair/token",
        &json!({"pairCode": m["pairCode"], "deviceSecret": m["deviceSecret"]}),
    );
    assert_eq!(t.status, 200, "{t:?}");
    t.json()["sessionToken"]
        .as_str()
        .expect("a session token")
        .to_string()
}

/// Percent-encode one path segment (`$.items[0]` → `$.items%5B0%5D`, `a/b` → `a%2Fb`).
pub fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~$".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Send `request` verbatim over a fresh loopback connection (for headers an HTTP client will
/// not let a caller forge, such as `Host`); returns the status and the whole response.
pub fn raw_http(addr: &str, request: &str) -> (u16, String) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(request.as_bytes()).expect("write the request");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// One sample of the daemon's `/metrics`, by its full name (labels included).
pub fn metric(http: &Http, name: &str) -> Option<f64> {
    let text = http.get("/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A WebSocket on the daemon's `path` (with its query), reads bounded by 10 s; panics when the
/// upgrade is refused.
pub fn ws_open(d: &Daemon, path: &str) -> tungstenite::WebSocket<std::net::TcpStream> {
    use tungstenite::client::IntoClientRequest;
    let req = format!("ws://{}{path}", d.addr)
        .into_client_request()
        .expect("a WebSocket request");
    let stream = std::net::TcpStream::connect(&d.addr).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("a read timeout");
    tungstenite::client(req, stream)
        .expect("the WebSocket upgrade")
        .0
}

/// The next text frame of `ws` as JSON, pings and pongs skipped (panics on anything else or
/// after the read timeout).
pub fn ws_frame<S: std::io::Read + std::io::Write>(
    ws: &mut tungstenite::WebSocket<S>,
) -> serde_json::Value {
    loop {
        match ws.read().expect("a frame within the timeout") {
            tungstenite::Message::Text(t) => {
                return serde_json::from_str(t.as_str()).expect("a JSON frame")
            }
            tungstenite::Message::Ping(_) | tungstenite::Message::Pong(_) => {}
            other => panic!("expected a text frame, got {other:?}"),
        }
    }
}

/// A `tools/call` of `tool` in MCP's modern era (no session, the era's headers and `_meta`):
/// the HTTP reply as it came.
pub fn modern_tool_call(http: &Http, id: u64, tool: &str, args: serde_json::Value) -> Reply {
    let msg = serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": tool, "arguments": args,
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "valem-tests", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}}});
    http.post(
        "/mcp",
        &[
            ("Content-Type", "application/json"),
            ("Accept", "application/json, text/event-stream"),
            ("MCP-Protocol-Version", "2026-07-28"),
            ("Mcp-Method", "tools/call"),
            ("Mcp-Name", tool),
        ],
        msg.to_string().as_bytes(),
    )
}
