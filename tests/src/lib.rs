//! Helpers for end-to-end tests: find the real `valem` binary and run it.

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
