//! `audit-jsonl`: an `audit_store` plugin. Each committed audit record is appended (and fsynced)
//! as one JSON line to `<dir>/<model>.jsonl`, where `<dir>` is `<data-dir>/plugins/audit-jsonl/`
//! or `dir` from `--plugin-config audit-jsonl={"dir": "/path"}`, and `<model>` is the model id
//! in hex (any id is a safe file name). It answers `get_audit` / `verify_audit` from those files:
//! a template for shipping the audit log to another system.

use std::fs::{self, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::sync::Mutex;

use valem_sdk::serde_json;
use valem_sdk::{AuditEntry, AuditQuery, AuditStorePlugin, Error, Host};

struct Jsonl {
    dir: PathBuf,
    /// One writer at a time (the daemon feeds records from one thread; queries read).
    lock: Mutex<()>,
}

impl Jsonl {
    fn file(&self, model_id: &str) -> PathBuf {
        let hex: String = model_id.bytes().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("{hex}.jsonl"))
    }
}

fn failed(e: impl std::fmt::Display) -> Error {
    Error::failed(e.to_string())
}

impl AuditStorePlugin for Jsonl {
    fn append(&self, entry: AuditEntry) -> Result<(), Error> {
        let _g = self.lock.lock().map_err(failed)?;
        let path = self.file(&entry.model_id);
        let mut line = serde_json::to_vec(&entry).map_err(failed)?;
        line.push(b'\n');
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| failed(format!("{}: {e}", path.display())))?;
        f.write_all(&line)
            .and_then(|()| f.sync_data())
            .map_err(|e| failed(format!("{}: {e}", path.display())))
    }

    fn query(&self, q: AuditQuery) -> Result<Vec<AuditEntry>, Error> {
        let _g = self.lock.lock().map_err(failed)?;
        let path = self.file(&q.model_id);
        let f = match fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(failed(format!("{}: {e}", path.display()))),
        };
        let mut out = Vec::new();
        for (i, line) in BufReader::new(f).lines().enumerate() {
            let line = line.map_err(failed)?;
            if line.trim().is_empty() {
                continue;
            }
            let e: AuditEntry = serde_json::from_str(&line)
                .map_err(|e| failed(format!("{} line {}: {e}", path.display(), i + 1)))?;
            let keep = q.from_us.is_none_or(|f| e.at_us >= f)
                && q.to_us.is_none_or(|t| e.at_us <= t)
                && q.path_prefix
                    .as_deref()
                    .is_none_or(|p| e.paths.iter().any(|x| x.starts_with(p)));
            if keep {
                out.push(e);
            }
        }
        if let Some(n) = q.limit {
            let skip = out.len().saturating_sub(n);
            out.drain(..skip);
        }
        Ok(out)
    }

    fn delete_model(&self, model_id: &str) -> Result<(), Error> {
        let _g = self.lock.lock().map_err(failed)?;
        match fs::remove_file(self.file(model_id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(failed(e)),
            _ => Ok(()),
        }
    }
}

fn open(host: &Host) -> Result<Jsonl, Error> {
    let dir = match host.config()["dir"].as_str() {
        Some(d) => PathBuf::from(d),
        None => host.data_dir()?.ok_or_else(|| {
            Error::invalid(
                "no directory for the audit files: run the daemon with --data-dir, or give one \
                 with --plugin-config audit-jsonl={\"dir\": \"/path\"}",
            )
        })?,
    };
    fs::create_dir_all(&dir).map_err(|e| failed(format!("{}: {e}", dir.display())))?;
    Ok(Jsonl {
        dir,
        lock: Mutex::new(()),
    })
}

valem_sdk::export_plugin!(audit_store, "audit-jsonl", open);
