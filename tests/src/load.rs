//! A load generator for `valem serve`: N client threads, each on its own keep-alive HTTP/1.1
//! connection, sending mutations over REST or Streamable HTTP MCP and timing every round trip.
//!
//! The client speaks just enough HTTP/1.1 (request line, headers, `Content-Length` or chunked
//! bodies) to cost next to nothing itself: on a 2-core machine the generator shares the CPU with
//! the daemon, and a general-purpose client would measure mostly itself. Used by the load test
//! (`tests/tests/load.rs`) and the HTTP benchmark (`benches/benches/http.rs`).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// One response.
#[derive(Debug)]
pub struct RawReply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawReply {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON; an SSE body yields its last `data:` event.
    pub fn json(&self) -> io::Result<Value> {
        let text = String::from_utf8_lossy(&self.body);
        let payload = if self
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"))
        {
            text.lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .next_back()
                .unwrap_or("")
                .trim()
                .to_string()
        } else {
            text.into_owned()
        };
        serde_json::from_str(&payload).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not JSON ({e}): {payload}"),
            )
        })
    }
}

/// A keep-alive HTTP/1.1 connection.
pub struct Conn {
    host: String,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    buf: Vec<u8>,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl Conn {
    /// Connect to `addr` (`127.0.0.1:PORT`); every read and write is bounded by 30 s.
    pub fn open(addr: &str) -> io::Result<Conn> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        s.set_write_timeout(Some(Duration::from_secs(30)))?;
        Ok(Conn {
            host: addr.to_string(),
            reader: BufReader::new(s.try_clone()?),
            writer: s,
            buf: Vec::with_capacity(1024),
        })
    }

    /// Send one request and read its whole response.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<RawReply> {
        self.buf.clear();
        write!(
            self.buf,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n",
            self.host,
            body.len()
        )?;
        for (k, v) in headers {
            write!(self.buf, "{k}: {v}\r\n")?;
        }
        self.buf.extend_from_slice(b"\r\n");
        self.buf.extend_from_slice(body);
        self.writer.write_all(&self.buf)?;
        self.read_reply()
    }

    fn line(&mut self) -> io::Result<String> {
        let mut l = String::new();
        if self.reader.read_line(&mut l)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the daemon closed the connection",
            ));
        }
        Ok(l.trim_end_matches(['\r', '\n']).to_string())
    }

    fn read_reply(&mut self) -> io::Result<RawReply> {
        let status_line = self.line()?;
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| bad(format!("bad status line {status_line:?}")))?;
        let mut headers = Vec::new();
        loop {
            let l = self.line()?;
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        let find = |name: &str| {
            headers
                .iter()
                .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        let mut body = Vec::new();
        if find("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
            loop {
                let size = self.line()?;
                let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
                    .map_err(|_| bad(format!("bad chunk size {size:?}")))?;
                if n == 0 {
                    // Trailers, then the blank line.
                    while !self.line()?.is_empty() {}
                    break;
                }
                let start = body.len();
                body.resize(start + n, 0);
                self.reader.read_exact(&mut body[start..])?;
                self.line()?;
            }
        } else {
            let n: usize = find("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            body.resize(n, 0);
            self.reader.read_exact(&mut body)?;
        }
        Ok(RawReply {
            status,
            headers,
            body,
        })
    }
}

/// How the clients mutate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// `POST /models/{id}/mutations`
    Rest,
    /// `tools/call mutate` over Streamable HTTP at `/mcp`, one session per client.
    Mcp,
    /// `tools/call mutate` at `/mcp` in MCP's modern era (2026-07-28): no session, the version
    /// and capabilities in each request's `_meta`, the standard headers.
    McpModern,
}

/// What one client thread saw.
pub struct ClientRun {
    /// Round-trip time of every mutation, in order, µs.
    pub latencies_us: Vec<f64>,
    /// Requests that did not answer 200 / `isError: false`, with the reason.
    pub errors: Vec<String>,
}

/// The totals of a run.
pub struct LoadReport {
    pub clients: usize,
    pub mutations: usize,
    pub errors: Vec<String>,
    pub wall: Duration,
    /// Sorted round-trip times, µs.
    pub sorted_us: Vec<f64>,
}

impl LoadReport {
    /// The `q` quantile (0..=1) of round-trip time, µs.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.sorted_us.is_empty() {
            return f64::NAN;
        }
        self.sorted_us[((self.sorted_us.len() as f64 - 1.0) * q).round() as usize]
    }

    pub fn per_second(&self) -> f64 {
        self.mutations as f64 / self.wall.as_secs_f64()
    }

    /// One line: mutations, errors, mutations/s, p50/p99/max.
    pub fn summary(&self, label: &str) -> String {
        format!(
            "{label}: {} clients, {} mutations, {} errors, {:.0} mutations/s, p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
            self.clients,
            self.mutations,
            self.errors.len(),
            self.per_second(),
            self.quantile(0.5),
            self.quantile(0.99),
            self.quantile(1.0)
        )
    }
}

/// An MCP session over `conn`: initialize + initialized; returns the session id.
pub fn mcp_session(conn: &mut Conn, auth: &[(&str, &str)]) -> io::Result<String> {
    let mut h = vec![
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
    ];
    h.extend_from_slice(auth);
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "valem-load", "version": "1"}}});
    let r = conn.request("POST", "/mcp", &h, init.to_string().as_bytes())?;
    if r.status != 200 {
        return Err(bad(format!("initialize: HTTP {}", r.status)));
    }
    let sid = r
        .header("mcp-session-id")
        .ok_or_else(|| bad("initialize: no Mcp-Session-Id"))?
        .to_string();
    h.push(("Mcp-Session-Id", &sid));
    h.push(("MCP-Protocol-Version", "2025-11-25"));
    let note = br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
    let r = conn.request("POST", "/mcp", &h, note)?;
    if r.status != 202 {
        return Err(bad(format!("notifications/initialized: HTTP {}", r.status)));
    }
    Ok(sid)
}

/// Run `clients` threads against `addr`, each sending `per_client` mutations made by
/// `mutation(client, i)` (a flat map of path → value) to model `model` over `surface`. All
/// threads start together (a barrier); the wall time runs from the start to the last reply.
pub fn run(
    addr: &str,
    surface: Surface,
    model: &str,
    clients: usize,
    per_client: usize,
    mutation: impl Fn(usize, usize) -> Value + Send + Sync + 'static,
) -> LoadReport {
    let mutation = Arc::new(mutation);
    let barrier = Arc::new(Barrier::new(clients + 1));
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (addr, model) = (addr.to_string(), model.to_string());
            let (mutation, barrier) = (mutation.clone(), barrier.clone());
            std::thread::spawn(move || {
                client(&addr, surface, &model, c, per_client, &*mutation, &barrier)
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    let runs: Vec<ClientRun> = threads
        .into_iter()
        .map(|t| {
            t.join().unwrap_or_else(|_| ClientRun {
                latencies_us: Vec::new(),
                errors: vec!["a client thread panicked".into()],
            })
        })
        .collect();
    let wall = start.elapsed();
    let mut sorted_us: Vec<f64> = runs.iter().flat_map(|r| r.latencies_us.clone()).collect();
    sorted_us.sort_by(f64::total_cmp);
    LoadReport {
        clients,
        mutations: sorted_us.len(),
        errors: runs.into_iter().flat_map(|r| r.errors).collect(),
        wall,
        sorted_us,
    }
}

fn client(
    addr: &str,
    surface: Surface,
    model: &str,
    c: usize,
    n: usize,
    mutation: &(dyn Fn(usize, usize) -> Value + Send + Sync),
    barrier: &Barrier,
) -> ClientRun {
    let mut out = ClientRun {
        latencies_us: Vec::with_capacity(n),
        errors: Vec::new(),
    };
    let setup = Conn::open(addr).and_then(|mut conn| {
        let sid = match surface {
            Surface::Mcp => Some(mcp_session(&mut conn, &[])?),
            Surface::Rest | Surface::McpModern => None,
        };
        Ok((conn, sid))
    });
    barrier.wait();
    let (mut conn, sid) = match setup {
        Ok(x) => x,
        Err(e) => {
            out.errors.push(format!("client {c}: setup: {e}"));
            return out;
        }
    };
    let rest_path = format!("/models/{model}/mutations");
    let sid = sid.unwrap_or_default();
    let mcp_headers = [
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
        ("Mcp-Session-Id", sid.as_str()),
        ("MCP-Protocol-Version", "2025-11-25"),
    ];
    let modern_headers = [
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
        ("MCP-Protocol-Version", "2026-07-28"),
        ("Mcp-Method", "tools/call"),
        ("Mcp-Name", "mutate"),
    ];
    for i in 0..n {
        let m = mutation(c, i);
        let t0 = Instant::now();
        let r = match surface {
            Surface::Rest => conn.request(
                "POST",
                &rest_path,
                &[("Content-Type", "application/json")],
                m.to_string().as_bytes(),
            ),
            Surface::Mcp => {
                let call = json!({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                    "params": {"name": "mutate", "arguments": {"id": model, "mutations": m}}});
                conn.request("POST", "/mcp", &mcp_headers, call.to_string().as_bytes())
            }
            Surface::McpModern => {
                let call = json!({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                    "params": {"name": "mutate", "arguments": {"id": model, "mutations": m},
                        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                            "io.modelcontextprotocol/clientCapabilities": {}}}});
                conn.request("POST", "/mcp", &modern_headers, call.to_string().as_bytes())
            }
        };
        let dt = t0.elapsed().as_secs_f64() * 1e6;
        let verdict = match (&r, surface) {
            (Err(e), _) => Err(format!("{e}")),
            (Ok(r), _) if r.status != 200 => Err(format!(
                "HTTP {}: {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            )),
            (Ok(r), Surface::Mcp) => match r.json() {
                Ok(v) if v["result"]["isError"] == json!(false) => Ok(()),
                Ok(v) => Err(format!("tool error: {v}")),
                Err(e) => Err(e.to_string()),
            },
            (Ok(r), Surface::McpModern) => match r.json() {
                Ok(v)
                    if v["result"]["isError"] == json!(false)
                        && v["result"]["resultType"] == json!("complete") =>
                {
                    Ok(())
                }
                Ok(v) => Err(format!("not a complete tool result: {v}")),
                Err(e) => Err(e.to_string()),
            },
            (Ok(_), Surface::Rest) => Ok(()),
        };
        match verdict {
            Ok(()) => out.latencies_us.push(dt),
            Err(e) => {
                out.errors.push(format!("client {c} mutation {i}: {e}"));
                if r.is_err() {
                    // The connection is gone: reconnecting would hide the failure; stop.
                    break;
                }
            }
        }
    }
    out
}
