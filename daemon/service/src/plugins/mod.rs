//! The plugin host: loads plugin libraries (`--plugin PATH`, `VALEM_PLUGIN_DIR`) and the
//! statically linked defaults through the C ABI of `valem-sdk`, checks each table's ABI version
//! and size before reading anything else, and calls plugins on their own small thread pool with
//! a timeout, so a plugin that panics, answers garbage or never returns costs one error and
//! nothing else. Libraries are never unloaded while the daemon runs.
//!
//! The kinds are used elsewhere: guidance topics by `mcp::guidance`, tools by `mcp::tools`,
//! blob and audit stores by `service`. A tool plugin calls the daemon's own tools back through
//! the host table ([`Plugins::set_dispatcher`]).

mod pool;

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::{json, Value as Json};
use valem_sdk::abi::{self, Buf, EntryV1, HostV1, PluginV1, Str};

pub use pool::PluginError;

/// The environment variable naming a directory whose libraries are all loaded.
pub const DIR_ENV: &str = "VALEM_PLUGIN_DIR";

/// Default time a plugin call may take.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a plugin is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Tool,
    Guidance,
    BlobStore,
    AuditStore,
}

impl Kind {
    fn from_abi(k: u32) -> Option<Kind> {
        match k {
            abi::KIND_TOOL => Some(Kind::Tool),
            abi::KIND_GUIDANCE => Some(Kind::Guidance),
            abi::KIND_BLOB_STORE => Some(Kind::BlobStore),
            abi::KIND_AUDIT_STORE => Some(Kind::AuditStore),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Tool => "tool",
            Kind::Guidance => "guidance",
            Kind::BlobStore => "blob_store",
            Kind::AuditStore => "audit_store",
        }
    }
}

/// How to load plugins.
#[derive(Clone, Debug)]
pub struct Options {
    /// Libraries named by the operator, in order.
    pub paths: Vec<PathBuf>,
    /// A directory whose libraries (`*.so`, `*.dylib`, `*.dll`) are loaded after `paths`.
    pub dir: Option<PathBuf>,
    /// Load the built-in guidance plugin (`valem-guidance`) first.
    pub builtin_guidance: bool,
    // (With `data_dir` and no blob-store library, the built-in blob store `valem-blobs`, over
    // `<data_dir>/blobs/`, is loaded last.)
    /// Longest a plugin call may take.
    pub timeout: Duration,
    /// The daemon's data directory: plugins get `<data_dir>/plugins/<name>/`.
    pub data_dir: Option<PathBuf>,
    /// Configuration per plugin name (`--plugin-config NAME=JSON`).
    pub config: BTreeMap<String, Json>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            paths: Vec::new(),
            dir: None,
            builtin_guidance: true,
            timeout: DEFAULT_TIMEOUT,
            data_dir: None,
            config: BTreeMap::new(),
        }
    }
}

/// Where a plugin came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    BuiltIn,
    Library(PathBuf),
}

/// One loaded plugin.
pub struct Plugin {
    pub name: String,
    pub version: String,
    pub kind: Kind,
    pub sdk_version: String,
    pub rustc_version: String,
    pub origin: Origin,
    table: Table,
    pool: pool::Pool,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Plugin({} {} {})",
            self.kind.as_str(),
            self.name,
            self.version
        )
    }
}

/// A plugin's table, valid for the life of the process (the library is never unloaded).
#[derive(Clone, Copy)]
struct Table(&'static PluginV1);

impl Plugin {
    /// `{name, kind, version, sdkVersion, rustcVersion, path}` for listings.
    pub fn info(&self) -> Json {
        json!({
            "name": self.name,
            "kind": self.kind.as_str(),
            "version": self.version,
            "sdkVersion": self.sdk_version,
            "rustcVersion": self.rustc_version,
            "path": match &self.origin {
                Origin::BuiltIn => Json::Null,
                Origin::Library(p) => json!(p.display().to_string()),
            },
            "builtIn": self.origin == Origin::BuiltIn,
        })
    }

    /// Call `method` with JSON `params` on the plugin's pool; its JSON result.
    pub fn call(&self, method: &str, params: impl Borrow<Json>) -> Result<Json, PluginError> {
        let req = request(method, params.borrow());
        let t = self.table;
        let (name, m) = (self.name.clone(), method.to_string());
        self.pool.run(
            move || invoke(t, &name, &m, &req, None, |b| parse_json(&name, &m, b)),
            &self.name,
            method,
        )
    }

    /// Call `method` with raw `data` beside the request; the raw answer (`call_bytes`).
    pub fn call_bytes(
        &self,
        method: &str,
        params: impl Borrow<Json>,
        data: Arc<[u8]>,
    ) -> Result<Vec<u8>, PluginError> {
        let req = request(method, params.borrow());
        let t = self.table;
        let (name, m) = (self.name.clone(), method.to_string());
        self.pool.run(
            move || invoke(t, &name, &m, &req, Some(&data), |b| Ok(b.to_vec())),
            &self.name,
            method,
        )
    }

    /// [`call`](Self::call) on the calling thread: no pool, no timeout. For benchmarks of the
    /// ABI itself.
    pub fn call_direct(
        &self,
        method: &str,
        params: impl Borrow<Json>,
    ) -> Result<Json, PluginError> {
        invoke(
            self.table,
            &self.name,
            method,
            &request(method, params.borrow()),
            None,
            |b| parse_json(&self.name, method, b),
        )
    }
}

/// `{"method": …, "params": …}`, written straight into bytes (no intermediate Value).
fn request(method: &str, params: &Json) -> Vec<u8> {
    let mut v = Vec::with_capacity(256);
    v.extend_from_slice(b"{\"method\":");
    let _ = serde_json::to_writer(&mut v, method);
    v.extend_from_slice(b",\"params\":");
    let _ = serde_json::to_writer(&mut v, params);
    v.push(b'}');
    v
}

fn parse_json(plugin: &str, method: &str, bytes: &[u8]) -> Result<Json, PluginError> {
    serde_json::from_slice(bytes).map_err(|e| PluginError::BadAnswer {
        plugin: plugin.to_string(),
        method: method.to_string(),
        detail: format!(
            "not JSON ({e}); it began {:?}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(40)])
        ),
    })
}

/// One call through the table, on this thread; `ok` reads a successful answer in place, before
/// the plugin frees it.
fn invoke<R>(
    t: Table,
    plugin: &str,
    method: &str,
    req: &[u8],
    data: Option<&[u8]>,
    ok: impl FnOnce(&[u8]) -> Result<R, PluginError>,
) -> Result<R, PluginError> {
    let table = t.0;
    let bad = |detail: &str| PluginError::BadAnswer {
        plugin: plugin.to_string(),
        method: method.to_string(),
        detail: detail.to_string(),
    };
    let mut out = Buf::EMPTY;
    let status = match data {
        None => {
            let call = table.call.ok_or_else(|| bad("the plugin has no `call`"))?;
            // SAFETY: the ABI: `req` is readable for the call, `out` is written by the plugin.
            unsafe { call(table.ctx, req.as_ptr(), req.len(), &mut out) }
        }
        Some(d) => {
            let call = table
                .call_bytes
                .ok_or_else(|| bad("the plugin has no `call_bytes`"))?;
            // SAFETY: as above, with `d` readable for the call.
            unsafe {
                call(
                    table.ctx,
                    req.as_ptr(),
                    req.len(),
                    d.as_ptr(),
                    d.len(),
                    &mut out,
                )
            }
        }
    };
    // SAFETY: the plugin filled `out` per the ABI; the bytes live until `free` below.
    let Some(bytes) = (unsafe { out.bytes() }) else {
        // Not a buffer we can hand back safely: leak it rather than free garbage.
        return Err(bad(
            "its answer buffer is inconsistent (null with a length, or len > cap)",
        ));
    };
    let answer = match status {
        abi::OK => ok(bytes),
        abi::ERROR => {
            let (code, message) = match serde_json::from_slice::<valem_sdk::Error>(bytes) {
                Ok(e) => (e.code, e.message),
                Err(_) => ("failed".into(), String::from_utf8_lossy(bytes).into_owned()),
            };
            Err(PluginError::Failed {
                plugin: plugin.to_string(),
                method: method.to_string(),
                code,
                message,
            })
        }
        abi::PANIC => Err(PluginError::Panicked {
            plugin: plugin.to_string(),
            method: method.to_string(),
            message: String::from_utf8_lossy(bytes).into_owned(),
        }),
        s => Err(bad(&format!("unknown status {s}"))),
    };
    if !out.ptr.is_null() {
        if let Some(free) = table.free {
            // SAFETY: the buffer came from this plugin's call and is released once, after its
            // last use above.
            unsafe { free(table.ctx, out) };
        }
    }
    answer
}

/// A plugin that could not be loaded, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadFailure {
    pub path: PathBuf,
    pub error: String,
}

/// A host-side tool call: `(tool, arguments) -> structured result`, or `(code, message)`.
pub type Dispatcher = Box<dyn Fn(&str, Json) -> Result<Json, (String, String)> + Send + Sync>;

/// What the host table's functions reach.
struct HostShared {
    dispatcher: OnceLock<Dispatcher>,
}

/// The host side: leaked once, shared by every plugin.
struct HostBox {
    table: HostV1,
    _strings: Vec<String>,
}

/// Every plugin of the process.
pub struct Plugins {
    loaded: Vec<Arc<Plugin>>,
    failed: Vec<LoadFailure>,
    host: &'static HostShared,
}

impl std::fmt::Debug for Plugins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugins")
            .field("loaded", &self.loaded)
            .field("failed", &self.failed)
            .finish()
    }
}

impl Plugins {
    /// No plugins at all (not even the built-in guidance).
    pub fn none() -> Plugins {
        Plugins {
            loaded: Vec::new(),
            failed: Vec::new(),
            host: Box::leak(Box::new(HostShared {
                dispatcher: OnceLock::new(),
            })),
        }
    }

    /// Load the built-ins and every configured library. Failures are collected, not fatal:
    /// the daemon runs with the plugins that loaded (see [`failures`](Self::failures)).
    pub fn load(opts: &Options) -> Plugins {
        let shared: &'static HostShared = Box::leak(Box::new(HostShared {
            dispatcher: OnceLock::new(),
        }));
        let host = host_table(shared, opts);
        let mut p = Plugins {
            loaded: Vec::new(),
            failed: Vec::new(),
            host: shared,
        };
        if opts.builtin_guidance {
            p.admit(
                Origin::BuiltIn,
                PathBuf::from("(built in)"),
                opts.timeout,
                || Ok(valem_plugin_guidance::plugin_v1(host)),
            );
        }
        let mut paths = opts.paths.clone();
        if let Some(dir) = &opts.dir {
            match libraries_in(dir) {
                Ok(found) => paths.extend(found),
                Err(e) => p.failed.push(LoadFailure {
                    path: dir.clone(),
                    error: e,
                }),
            }
        }
        for path in paths {
            let at = path.clone();
            p.admit(
                Origin::Library(path.clone()),
                path,
                opts.timeout,
                move || open_library(&at, host),
            );
        }
        // With a data directory and no blob store loaded, blob bytes go to the built-in one.
        if opts.data_dir.is_some() && p.of_kind(Kind::BlobStore).next().is_none() {
            p.admit(
                Origin::BuiltIn,
                PathBuf::from("(built in)"),
                opts.timeout,
                || Ok(valem_plugin_blob_fs::builtin_v1(host)),
            );
        }
        p
    }

    /// Run `entry` (off this thread, bounded by `timeout`), check its table, keep the plugin.
    fn admit(
        &mut self,
        origin: Origin,
        path: PathBuf,
        timeout: Duration,
        entry: impl FnOnce() -> Result<*const PluginV1, String> + Send + 'static,
    ) {
        let got = pool::once(timeout, move || entry().map(|t| t as usize))
            .map_err(|e| match e {
                pool::OnceError::Timeout => format!(
                    "did not finish initialising within {:.1} s",
                    timeout.as_secs_f64()
                ),
                pool::OnceError::Panicked(m) => format!("panicked while loading: {m}"),
            })
            .and_then(|r| r)
            .and_then(|t| check_table(t as *const PluginV1));
        let r = got.and_then(|(table, info)| {
            if let Some(other) = self.loaded.iter().find(|p| p.name == info.name) {
                return Err(format!(
                    "a plugin named `{}` is already loaded ({})",
                    info.name,
                    match &other.origin {
                        Origin::BuiltIn => "built in".to_string(),
                        Origin::Library(p) => p.display().to_string(),
                    }
                ));
            }
            Ok(Plugin {
                name: info.name,
                version: info.version,
                kind: info.kind,
                sdk_version: info.sdk_version,
                rustc_version: info.rustc_version,
                origin: origin.clone(),
                table,
                pool: pool::Pool::new(timeout),
            })
        });
        match r {
            Ok(plugin) => {
                tracing::info!(
                    plugin = %plugin.name,
                    kind = plugin.kind.as_str(),
                    version = %plugin.version,
                    path = %path.display(),
                    "plugin loaded"
                );
                self.loaded.push(Arc::new(plugin));
            }
            Err(error) => {
                tracing::error!(path = %path.display(), "plugin not loaded: {error}");
                self.failed.push(LoadFailure { path, error });
            }
        }
    }

    /// The loaded plugins, in load order.
    pub fn loaded(&self) -> &[Arc<Plugin>] {
        &self.loaded
    }

    /// The plugins of one kind, in load order.
    pub fn of_kind(&self, kind: Kind) -> impl Iterator<Item = &Arc<Plugin>> {
        self.loaded.iter().filter(move |p| p.kind == kind)
    }

    /// The libraries that did not load.
    pub fn failures(&self) -> &[LoadFailure] {
        &self.failed
    }

    /// Where a tool plugin's host calls go (set once, when the MCP server exists).
    pub fn set_dispatcher(&self, d: Dispatcher) {
        let _ = self.host.dispatcher.set(d);
    }

    /// `{loaded: [...], failed: [{path, error}]}`.
    pub fn info(&self) -> Json {
        json!({
            "loaded": self.loaded.iter().map(|p| p.info()).collect::<Vec<_>>(),
            "failed": self.failed.iter().map(|f| json!({
                "path": f.path.display().to_string(),
                "error": f.error,
            })).collect::<Vec<_>>(),
        })
    }
}

/// The library files of `dir`, sorted.
fn libraries_in(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let rd = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read the plugin directory {}: {e}", dir.display()))?;
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("so" | "dylib" | "dll")
                )
        })
        .collect();
    v.sort();
    Ok(v)
}

/// dlopen `path` and run its `valem_plugin_v1`.
fn open_library(path: &Path, host: *const HostV1) -> Result<*const PluginV1, String> {
    match std::fs::metadata(path) {
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        Ok(m) if !m.is_file() => return Err(format!("{} is not a file", path.display())),
        Ok(_) => {}
    }
    // SAFETY: loading a library runs its initialisers; only operator-configured paths get here.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| {
        let why = std::error::Error::source(&e)
            .map(|s| s.to_string())
            .unwrap_or_else(|| e.to_string());
        format!("not a loadable library: {why}")
    })?;
    // SAFETY: the symbol's type is the ABI's entry point type.
    let entry = match unsafe { lib.get::<EntryV1>(abi::ENTRY_V1) } {
        Ok(f) => *f,
        Err(_) => {
            let newer = [b"valem_plugin_v2\0".as_slice(), b"valem_plugin_v3\0"]
                .iter()
                // SAFETY: only probing for the symbol's presence; it is not called.
                .any(|s| unsafe { lib.get::<*const c_void>(*s) }.is_ok());
            return Err(if newer {
                "it exports a newer plugin ABI than v1, the one this daemon loads; upgrade valem"
                    .into()
            } else {
                "a library, but not a valem plugin: it exports no `valem_plugin_v1`".into()
            });
        }
    };
    // Never unloaded: the table and its code must outlive every call.
    std::mem::forget(lib);
    // SAFETY: the ABI's entry point, given the host table (valid for the life of the process).
    Ok(unsafe { entry(host) })
}

struct TableInfo {
    name: String,
    version: String,
    kind: Kind,
    sdk_version: String,
    rustc_version: String,
}

/// Read a table the way the ABI says: version and size first, then the rest.
fn check_table(t: *const PluginV1) -> Result<(Table, TableInfo), String> {
    if t.is_null() {
        return Err("its valem_plugin_v1 returned no table".into());
    }
    // SAFETY: every table starts with abi_version: u32, struct_size: u32.
    let (version, size) = unsafe {
        let p = t.cast::<u32>();
        (p.read_unaligned(), p.add(1).read_unaligned())
    };
    if version != abi::ABI_VERSION {
        return Err(format!(
            "plugin ABI version {version}; this daemon loads version {} (rebuild it against valem-sdk {})",
            abi::ABI_VERSION,
            valem_sdk::SDK_VERSION
        ));
    }
    if (size as usize) < std::mem::size_of::<PluginV1>() {
        return Err(format!(
            "its table is {size} bytes; ABI v1 tables are at least {} (a corrupt or foreign table)",
            std::mem::size_of::<PluginV1>()
        ));
    }
    // SAFETY: version and size checked: a whole v1 table, valid for the life of the process.
    let table: &'static PluginV1 = unsafe { &*t };
    let text = |s: Str, what: &str| -> Result<String, String> {
        // SAFETY: table strings live as long as the table.
        let b = unsafe { s.bytes() }.ok_or_else(|| format!("its {what} is a null pointer"))?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("its {what} is not UTF-8"))
    };
    let init_error = text(table.init_error, "init error")?;
    if !init_error.is_empty() {
        return Err(format!("failed to initialise: {init_error}"));
    }
    let name = text(table.name, "name")?;
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
    {
        return Err(format!(
            "its name {name:?} is not lowercase letters, digits, `-` and `_`"
        ));
    }
    let kind = Kind::from_abi(table.kind)
        .ok_or_else(|| format!("plugin `{name}` has unknown kind {}", table.kind))?;
    if table.call.is_none() || table.free.is_none() {
        return Err(format!("plugin `{name}` has no `call` or no `free`"));
    }
    if kind == Kind::BlobStore && table.call_bytes.is_none() {
        return Err(format!("blob store `{name}` has no `call_bytes`"));
    }
    let info = TableInfo {
        version: text(table.version, "version")?,
        sdk_version: text(table.sdk_version, "SDK version")?,
        rustc_version: text(table.rustc_version, "rustc version")?,
        name,
        kind,
    };
    Ok((Table(table), info))
}

// --- the host table -----------------------------------------------------------------------

fn host_table(shared: &'static HostShared, opts: &Options) -> &'static HostV1 {
    let version = env!("CARGO_PKG_VERSION").to_string();
    let data_dir = opts
        .data_dir
        .as_ref()
        .map(|d| d.join("plugins").display().to_string())
        .unwrap_or_default();
    let mut config = opts.config.clone();
    if let Some(d) = &opts.data_dir {
        // The built-in blob store keeps the store's own blob directory.
        config
            .entry(valem_plugin_blob_fs::BUILTIN_NAME.to_string())
            .or_insert_with(|| json!({"dir": d.join("blobs").display().to_string()}));
    }
    let config = serde_json::to_string(&config).unwrap_or_else(|_| "{}".into());
    let strings = vec![version, data_dir, config];
    let s = |i: usize| Str {
        ptr: strings[i].as_ptr(),
        len: strings[i].len(),
    };
    let table = HostV1 {
        abi_version: abi::ABI_VERSION,
        struct_size: std::mem::size_of::<HostV1>() as u32,
        host_version: s(0),
        data_dir: s(1),
        config: s(2),
        ctx: (shared as *const HostShared).cast_mut().cast::<c_void>(),
        call: Some(host_call),
        free: Some(abi::free_vec),
        log: Some(host_log),
    };
    // The strings' heap buffers do not move when the Vec moves into the box.
    &Box::leak(Box::new(HostBox {
        table,
        _strings: strings,
    }))
    .table
}

unsafe extern "C" fn host_call(ctx: *mut c_void, req: *const u8, len: usize, out: *mut Buf) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: ctx is the leaked HostShared of this table.
        let shared = unsafe { &*ctx.cast::<HostShared>() };
        // SAFETY: the plugin passes `len` readable bytes.
        let bytes = unsafe { Str { ptr: req, len }.bytes() }
            .ok_or_else(|| ("invalid_params".to_string(), "null request".to_string()))?;
        let v: Json = serde_json::from_slice(bytes)
            .map_err(|e| ("invalid_params".to_string(), format!("bad request: {e}")))?;
        let method = v["method"]
            .as_str()
            .ok_or_else(|| ("invalid_params".to_string(), "no `method`".to_string()))?;
        let d = shared.dispatcher.get().ok_or_else(|| {
            (
                "unavailable".to_string(),
                "the daemon's tools are not ready yet".to_string(),
            )
        })?;
        d(method, v.get("params").cloned().unwrap_or(json!({})))
    }));
    let (status, body) = match r {
        Ok(Ok(v)) => (abi::OK, serde_json::to_vec(&v).unwrap_or_default()),
        Ok(Err((code, message))) => (
            abi::ERROR,
            serde_json::to_vec(&json!({"code": code, "message": message})).unwrap_or_default(),
        ),
        Err(_) => (
            abi::ERROR,
            br#"{"code":"failed","message":"the host panicked serving this call"}"#.to_vec(),
        ),
    };
    // SAFETY: the plugin passes a writable Buf (or null).
    unsafe { Buf::write_to(out, body) };
    status
}

unsafe extern "C" fn host_log(_ctx: *mut c_void, level: u32, msg: *const u8, len: usize) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the plugin passes `len` readable bytes.
        let Some(b) = (unsafe { Str { ptr: msg, len }.bytes() }) else {
            return;
        };
        let m = String::from_utf8_lossy(b);
        match level {
            1 => tracing::error!(target: "valem::plugin", "{m}"),
            2 => tracing::warn!(target: "valem::plugin", "{m}"),
            3 => tracing::info!(target: "valem::plugin", "{m}"),
            _ => tracing::debug!(target: "valem::plugin", "{m}"),
        }
    }));
}

#[cfg(test)]
mod tests;
