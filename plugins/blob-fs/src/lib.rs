//! `blob-fs`: a `blob_store` plugin that keeps each blob as a file named by its content id,
//! `<dir>/<first 2 hex>/<other 62 hex>`. As a loaded library (`libvalem_blob_fs.so`, plugin
//! `blob-fs`) `<dir>` is `<data-dir>/plugins/blob-fs/` or `dir` from
//! `--plugin-config blob-fs={"dir": "/path"}`; linked into the daemon it is the built-in blob
//! store of `--data-dir` (plugin `valem-blobs`, `<data-dir>/blobs/`). Writes go to a temporary
//! file, are fsynced and renamed into place (and the directory fsynced), so a crash leaves
//! either the whole blob or none of it.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use valem_sdk::{BlobStorePlugin, Error, Host};

struct BlobFs {
    dir: PathBuf,
}

fn io(what: &str, p: &Path, e: std::io::Error) -> Error {
    Error::failed(format!("{what} {}: {e}", p.display()))
}

impl BlobFs {
    /// The file of `id`; ids are the daemon's blake3 hex digests, anything else is refused.
    fn path(&self, id: &str) -> Result<PathBuf, Error> {
        if id.len() != 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::invalid(format!("`{id}` is not a blob content id")));
        }
        Ok(self.dir.join(&id[..2]).join(&id[2..]))
    }
}

impl BlobStorePlugin for BlobFs {
    fn put(&self, id: &str, bytes: &[u8]) -> Result<(), Error> {
        let path = self.path(id)?;
        if fs::metadata(&path).is_ok_and(|m| m.len() == bytes.len() as u64) {
            return Ok(()); // content-addressed: the same id has the same bytes
        }
        let sub = path.parent().unwrap_or(&self.dir).to_path_buf();
        if !sub.exists() {
            fs::create_dir_all(&sub).map_err(|e| io("cannot create", &sub, e))?;
            fs::File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io("cannot sync", &self.dir, e))?;
        }
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let tmp = sub.join(format!(
            ".tmp-{id}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let mut f = fs::File::create(&tmp).map_err(|e| io("cannot create", &tmp, e))?;
        let written = f
            .write_all(bytes)
            .and_then(|()| f.sync_all())
            .map_err(|e| io("cannot write", &tmp, e));
        drop(f);
        if let Err(e) = written
            .and_then(|()| fs::rename(&tmp, &path).map_err(|e| io("cannot rename into", &path, e)))
        {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        fs::File::open(&sub)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("cannot sync", &sub, e))
    }

    fn get(&self, id: &str) -> Result<Option<Vec<u8>>, Error> {
        let path = self.path(id)?;
        match fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("cannot read", &path, e)),
        }
    }

    fn delete(&self, id: &str) -> Result<bool, Error> {
        let path = self.path(id)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io("cannot delete", &path, e)),
        }
    }
}

fn open(host: &Host) -> Result<BlobFs, Error> {
    let dir = match host.config()["dir"].as_str() {
        Some(d) => PathBuf::from(d),
        None => host.data_dir()?.ok_or_else(|| {
            Error::invalid(
                "no directory for the blobs: run the daemon with --data-dir, or give one with \
                 --plugin-config blob-fs={\"dir\": \"/path\"}",
            )
        })?,
    };
    fs::create_dir_all(&dir).map_err(|e| io("cannot create", &dir, e))?;
    Ok(BlobFs { dir })
}

valem_sdk::declare_plugin!(blob_store, "blob-fs", open);

/// The name of the built-in instance (the daemon's `--data-dir` blob store).
pub const BUILTIN_NAME: &str = "valem-blobs";

/// The built-in instance's table: plugin `valem-blobs`, its directory from its config `dir`.
pub extern "C" fn builtin_v1(
    host: *const valem_sdk::abi::HostV1,
) -> *const valem_sdk::abi::PluginV1 {
    valem_sdk::shim::blob_store(BUILTIN_NAME, env!("CARGO_PKG_VERSION"), host, open)
}
