//! The stdio transport: one JSON-RPC message per line on stdin, replies and notifications one
//! per line on stdout (nothing else is ever written there). A leading UTF-8 BOM is dropped; a
//! line that is not JSON gets `-32700`; a line over the size limit gets `-32600` and is skipped.
//! Requests are served in order on a worker thread, so `notifications/cancelled` is seen while a
//! request runs. At end of input the owed replies are written and the call returns.

use std::io::{BufRead, Write};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value as Json};

use super::{code, Handler, Outbox, Server, Session};

/// Default largest accepted message, in bytes.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Requests queued for the worker before the reader waits.
const QUEUE: usize = 256;

/// Serve one session until `input` ends.
pub fn serve(
    server: Arc<Server>,
    input: impl BufRead,
    output: impl Write + Send + 'static,
    max_message_bytes: usize,
) -> std::io::Result<()> {
    serve_with(
        move |outbox| -> Arc<dyn Handler> { Session::new(server, outbox) },
        input,
        output,
        max_message_bytes,
    )
}

/// Serve one session of the handler `make` builds (given where its notifications go).
pub fn serve_with(
    make: impl FnOnce(Outbox) -> Arc<dyn Handler>,
    input: impl BufRead,
    output: impl Write + Send + 'static,
    max_message_bytes: usize,
) -> std::io::Result<()> {
    let output: Arc<Mutex<Box<dyn Write + Send>>> = Arc::new(Mutex::new(Box::new(output)));
    let out_for_box = output.clone();
    let outbox: Outbox = Arc::new(move |msg: &Json| write_line(&out_for_box, msg));
    let session = make(outbox.clone());
    let (tx, rx) = mpsc::sync_channel::<Json>(QUEUE);
    let worker_session = session.clone();
    let worker_out = outbox.clone();
    let worker = std::thread::Builder::new()
        .name("valem-mcp-worker".into())
        .spawn(move || {
            while let Ok(msg) = rx.recv() {
                if let Some(reply) = worker_session.handle(msg) {
                    worker_out(&reply);
                }
            }
        })?;
    let mut reader = LineReader::new(input, max_message_bytes);
    let mut first = true;
    loop {
        let line = match reader.next_line() {
            Ok(Some(Line::Text(l))) => l,
            Ok(Some(Line::TooLong(n))) => {
                outbox(&json!({"jsonrpc": "2.0", "id": null, "error": {
                    "code": code::INVALID_REQUEST,
                    "message": format!("message of {n}+ bytes exceeds the limit of {max_message_bytes} bytes; it was skipped"),
                }}));
                continue;
            }
            Ok(None) => break,
            Err(e) => {
                eprintln!("valem mcp: reading stdin failed: {e}");
                break;
            }
        };
        let mut text: &[u8] = &line;
        if first {
            first = false;
            text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
        }
        if text.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        let msg: Json = match super::wire::parse(text) {
            Ok(m) => m,
            Err(e) => {
                outbox(&json!({"jsonrpc": "2.0", "id": null, "error": {
                    "code": code::PARSE_ERROR,
                    "message": format!("Parse error: {e}"),
                }}));
                continue;
            }
        };
        if session.intercept(&msg) {
            continue;
        }
        if tx.send(msg).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = worker.join();
    if let Ok(mut o) = output.lock() {
        o.flush()?;
    }
    Ok(())
}

fn write_line(out: &Mutex<Box<dyn Write + Send>>, msg: &Json) {
    let mut text = super::wire::to_vec(msg);
    text.push(b'\n');
    if let Ok(mut o) = out.lock() {
        // A closed stdout means the client is gone; the read loop ends at its EOF.
        let _ = o.write_all(&text).and_then(|_| o.flush());
    }
}

pub enum Line {
    Text(Vec<u8>),
    /// A line longer than the limit (skipped; at least this many bytes).
    TooLong(usize),
}

/// Newline-delimited reading with a bound on line length (a huge line never buffers whole);
/// shared with the console.
pub struct LineReader<R> {
    inner: R,
    max: usize,
}

impl<R: BufRead> LineReader<R> {
    pub fn new(inner: R, max: usize) -> Self {
        LineReader { inner, max }
    }

    /// The next line without its `\n` (and `\r`); `None` at end of input.
    pub fn next_line(&mut self) -> std::io::Result<Option<Line>> {
        let mut buf = Vec::new();
        let mut overflow = 0usize;
        loop {
            let chunk = self.inner.fill_buf()?;
            if chunk.is_empty() {
                if buf.is_empty() && overflow == 0 {
                    return Ok(None);
                }
                break;
            }
            let (part, done) = match chunk.iter().position(|&b| b == b'\n') {
                Some(i) => (&chunk[..i], Some(i + 1)),
                None => (chunk, None),
            };
            if overflow > 0 || buf.len() + part.len() > self.max {
                overflow += buf.len() + part.len();
                buf.clear();
            } else {
                buf.extend_from_slice(part);
            }
            let used = done.unwrap_or(chunk.len());
            self.inner.consume(used);
            if done.is_some() {
                break;
            }
        }
        if overflow > 0 {
            return Ok(Some(Line::TooLong(overflow)));
        }
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        Ok(Some(Line::Text(buf)))
    }
}
