//! `valem console`: the reference's console JSON protocol on stdin/stdout. One command object
//! per line in, `{"ok":true,"result":…}` or `{"ok":false,"error":"…"}` per line out (nothing
//! else is written to stdout). Commands are parsed once ([`command`]) and run by a [`Backend`]:
//! an in-process [`ModelService`](valem_service::ModelService) ([`embedded`]) or a daemon's
//! REST API ([`remote`]). A bad line is answered with an error and the console keeps reading;
//! it ends at `exit` or end of input. Never holds model state of its own.

pub mod command;
pub mod embedded;
pub mod remote;

use std::io::{BufRead, Write};

use serde_json::{json, Value as Json};

pub use command::Command;
use valem_mcp::stdio::{Line, LineReader};

/// Default largest accepted line: a 50 MiB blob, base64-encoded, plus its command.
pub const DEFAULT_MAX_LINE_BYTES: usize = 96 << 20;

/// Runs parsed commands (never `help` or `exit`, which the loop answers).
pub trait Backend {
    /// How this backend runs, for `help` and the start-up line ("embedded", "remote <url>").
    fn mode(&self) -> String;

    /// Run one command: its result, or the error message.
    fn execute(&mut self, cmd: &Command) -> Result<Json, String>;
}

/// Serve commands from `input` until `exit` or end of input.
pub fn serve(
    backend: &mut dyn Backend,
    input: impl BufRead,
    mut output: impl Write,
    max_line_bytes: usize,
) -> std::io::Result<()> {
    let mut reader = LineReader::new(input, max_line_bytes);
    let mut first = true;
    loop {
        let line = match reader.next_line()? {
            Some(Line::Text(l)) => l,
            Some(Line::TooLong(n)) => {
                let e = format!(
                    "line of {n}+ bytes exceeds the limit of {max_line_bytes} bytes (--max-line-bytes); it was skipped"
                );
                reply(&mut output, Err(e))?;
                continue;
            }
            None => break,
        };
        let mut text: &[u8] = &line;
        if first {
            first = false;
            text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
        }
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let outcome = match serde_json::from_slice::<Json>(text) {
            Err(e) => Err(format!("the line is not valid JSON: {e}")),
            Ok(v) => match command::parse(v) {
                Err(e) => Err(e),
                Ok(Command::Exit) => {
                    reply(&mut output, Ok(json!("bye")))?;
                    return Ok(());
                }
                Ok(Command::Help) => Ok(command::help(&backend.mode())),
                Ok(cmd) => backend.execute(&cmd),
            },
        };
        reply(&mut output, outcome)?;
    }
    output.flush()
}

/// Write one answer line and flush it (a script waits for each answer).
fn reply(out: &mut impl Write, outcome: Result<Json, String>) -> std::io::Result<()> {
    let v = match outcome {
        Ok(result) => json!({"ok": true, "result": result}),
        Err(error) => json!({"ok": false, "error": error}),
    };
    let mut line = serde_json::to_vec(&v).unwrap_or_else(|_| {
        br#"{"ok":false,"error":"the answer could not be serialized"}"#.to_vec()
    });
    line.push(b'\n');
    out.write_all(&line)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Echoes the command's debug text; fails `get-spec`.
    struct Echo;

    impl Backend for Echo {
        fn mode(&self) -> String {
            "echo".into()
        }
        fn execute(&mut self, cmd: &Command) -> Result<Json, String> {
            match cmd {
                Command::GetSpec { id } => Err(format!("no spec for {id}")),
                other => Ok(json!(format!("{other:?}"))),
            }
        }
    }

    fn run(input: &str, max: usize) -> Vec<Json> {
        let mut out = Vec::new();
        let r = serve(&mut Echo, input.as_bytes(), &mut out, max);
        assert!(r.is_ok());
        String::from_utf8_lossy(&out)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or(Json::Null))
            .collect()
    }

    #[test]
    fn one_answer_per_command_line() {
        let out = run(
            "\u{feff}{\"cmd\":\"list-models\"}\n\n  \r\n{bad\n{\"cmd\":\"get-spec\",\"id\":\"x\"}\r\n{\"cmd\":\"help\"}\n{\"cmd\":\"exit\"}\n{\"cmd\":\"list-models\"}\n",
            1 << 20,
        );
        assert_eq!(out.len(), 5, "{out:?}");
        assert_eq!(out[0], json!({"ok": true, "result": "ListModels"}));
        assert_eq!(out[1]["ok"], json!(false));
        assert!(out[1]["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("the line is not valid JSON")));
        assert_eq!(out[2], json!({"ok": false, "error": "no spec for x"}));
        assert_eq!(out[3]["result"]["mode"], json!("echo"));
        assert_eq!(out[4], json!({"ok": true, "result": "bye"}));
    }

    #[test]
    fn long_lines_are_refused_and_skipped() {
        let long = format!("{{\"cmd\":\"get-spec\",\"id\":\"{}\"}}\n", "x".repeat(100));
        let out = run(&format!("{long}{{\"cmd\":\"list-models\"}}"), 64);
        assert_eq!(out.len(), 2);
        assert!(out[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("exceeds the limit of 64 bytes")));
        assert_eq!(out[1]["result"], json!("ListModels"));
    }
}
