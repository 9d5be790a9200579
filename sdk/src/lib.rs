//! # valem-sdk: plugins for the valem daemon
//!
//! A plugin is a dynamic library (`crate-type = ["cdylib"]`) that the daemon loads at start with
//! `valem serve --plugin PATH` (or every library in `VALEM_PLUGIN_DIR`). It is one of four kinds:
//!
//! | kind | trait | what it does |
//! |---|---|---|
//! | `tool` | [`ToolPlugin`] | adds MCP tools (named `<plugin>__<tool>`), which may call the daemon's own tools through [`Host`] |
//! | `guidance` | [`GuidancePlugin`] | adds or replaces `get_domain_guidance` topics |
//! | `blob_store` | [`BlobStorePlugin`] | keeps blob bytes (content-addressed) |
//! | `audit_store` | [`AuditStorePlugin`] | receives every committed audit record, answers `get_audit` |
//!
//! The library exports one C function, `valem_plugin_v1`, returning a table of C functions
//! ([`abi::PluginV1`]); JSON goes in and out. You never write that by hand: implement the trait of
//! your kind and call [`export_plugin!`]. Every entry point the macro generates catches panics,
//! so a bug in a plugin becomes an error of that one call and the daemon keeps running (build
//! with the default `panic = "unwind"`).
//!
//! ## Example: a guidance plugin
//! ```no_run
//! use valem_sdk::{GuidancePlugin, Host, Topic};
//!
//! struct Lending;
//!
//! impl GuidancePlugin for Lending {
//!     fn topics(&self) -> Vec<Topic> {
//!         vec![Topic {
//!             id: "loan_amortization".into(),
//!             title: Some("Loan amortisation".into()),
//!             description: "payment schedules with $power".into(),
//!             instructions: "Model the rate per period as `rate / 12` ...".into(),
//!         }]
//!     }
//! }
//!
//! valem_sdk::export_plugin!(guidance, "lending-guidance", |_host: &Host| Ok(Lending));
//! ```
//! Build it with `cargo build --release` and start the daemon with
//! `valem serve --plugin target/release/liblending_guidance.so`.
//!
//! ## Versions
//! The ABI is versioned by the entry point's name and the table's `abi_version`; this crate
//! builds v1 ([`abi::ABI_VERSION`]). A future v2 gets a new entry point (`valem_plugin_v2`), so a
//! daemon can load v1 and v2 plugins side by side.

pub mod abi;
#[doc(hidden)]
pub mod shim;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
pub use serde_json;
use serde_json::Value as Json;

/// The version of this SDK (a plugin reports it; the host lists it).
pub const SDK_VERSION: &str = env!("CARGO_PKG_VERSION");
/// `rustc --version` of the compiler that built this SDK (and so the plugin).
pub const RUSTC_VERSION: &str = env!("VALEM_SDK_RUSTC");

/// A failure a plugin reports: a short machine-readable `code` and a message for people.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Error {
    pub code: String,
    pub message: String,
}

impl Error {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Error {
        Error {
            code: code.into(),
            message: message.into(),
        }
    }

    /// `invalid_params`: the arguments were wrong.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new("invalid_params", message)
    }

    /// `not_found`.
    pub fn not_found(message: impl Into<String>) -> Error {
        Error::new("not_found", message)
    }

    /// `failed`: anything else.
    pub fn failed(message: impl Into<String>) -> Error {
        Error::new("failed", message)
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for Error {}

/// One domain-guidance topic. Ids are lowercase letters, digits, `_` and `-`; a topic whose id
/// is already known (built in, or from an earlier plugin) replaces it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topic {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// One line: shown in the tool's topic menu.
    pub description: String,
    /// The guidance text itself (markdown).
    #[serde(default)]
    pub instructions: String,
}

/// One MCP tool of a tool plugin. The daemon advertises it as `<plugin>__<name>` (plugin names
/// with `-` become `_`), so tools of different plugins never collide with each other or with
/// the daemon's own.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolDef {
    /// Letters, digits, `_` and `-`.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    pub description: String,
    /// A JSON Schema of the arguments (an object schema).
    pub input_schema: Json,
    /// A JSON Schema of the result, if it has a fixed shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<Json>,
    /// Does the tool change anything? (MCP's `readOnlyHint`.)
    #[serde(default)]
    pub read_only: bool,
}

/// The filters of an audit query, as `get_audit` takes them (times in microseconds since the
/// Unix epoch, inclusive).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditQuery {
    pub model_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_us: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_us: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// At most this many records, the newest ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
}

/// One committed audit record as an audit store receives it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEntry {
    pub model_id: String,
    pub sequence: u64,
    /// Commit time, microseconds since the Unix epoch.
    pub at_us: i64,
    /// Paths the record touched (mutations, derived updates, trace targets): for `pathPrefix`.
    pub paths: Vec<String>,
    /// The record itself (the reference's AuditRecord fields, `prevHash` and `hash` included).
    /// Store it unchanged: the daemon verifies the chain over the records you return.
    pub record: Json,
}

/// The daemon, as a plugin sees it.
pub struct Host {
    raw: *const abi::HostV1,
    name: &'static str,
}

// SAFETY: the host table is immutable and its functions are thread-safe (the ABI's contract).
unsafe impl Send for Host {}
unsafe impl Sync for Host {}

impl Host {
    /// # Safety
    /// `raw` must be null or a host table valid for the life of the process.
    #[doc(hidden)]
    pub unsafe fn from_raw(raw: *const abi::HostV1, plugin_name: &'static str) -> Host {
        Host {
            raw,
            name: plugin_name,
        }
    }

    fn table(&self) -> Option<&abi::HostV1> {
        // SAFETY: from_raw's contract; the size check keeps us inside the host's table.
        let t = unsafe { self.raw.as_ref() }?;
        (t.abi_version == abi::ABI_VERSION
            && t.struct_size as usize >= std::mem::size_of::<abi::HostV1>())
        .then_some(t)
    }

    fn str_field(&self, f: impl Fn(&abi::HostV1) -> abi::Str) -> Option<String> {
        let t = self.table()?;
        // SAFETY: host strings live as long as the table.
        let b = unsafe { f(t).bytes() }?;
        String::from_utf8(b.to_vec()).ok()
    }

    /// The daemon's version.
    pub fn version(&self) -> String {
        self.str_field(|t| t.host_version).unwrap_or_default()
    }

    /// This plugin's own directory, `<data-dir>/plugins/<name>/` (created on first use), or
    /// `None` when the daemon keeps nothing on disk (no `--data-dir`).
    pub fn data_dir(&self) -> Result<Option<PathBuf>, Error> {
        let Some(root) = self.str_field(|t| t.data_dir).filter(|s| !s.is_empty()) else {
            return Ok(None);
        };
        let dir = PathBuf::from(root).join(self.name);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::failed(format!("cannot create {}: {e}", dir.display())))?;
        Ok(Some(dir))
    }

    /// The configuration the operator gave this plugin (`--plugin-config NAME=JSON`), `{}` if none.
    pub fn config(&self) -> Json {
        self.str_field(|t| t.config)
            .and_then(|s| serde_json::from_str::<Json>(&s).ok())
            .and_then(|all| all.get(self.name).cloned())
            .unwrap_or_else(|| Json::Object(Default::default()))
    }

    /// Call one of the daemon's MCP tools (`get_state`, `mutate`, `list_models`, …; not other
    /// plugins' tools) with its arguments; the tool's structured result, or its error.
    pub fn call(&self, tool: &str, arguments: Json) -> Result<Json, Error> {
        let t = self
            .table()
            .ok_or_else(|| Error::failed("the host table is missing or of another ABI version"))?;
        let (Some(call), Some(free)) = (t.call, t.free) else {
            return Err(Error::failed("the host offers no calls"));
        };
        let req = serde_json::to_vec(&serde_json::json!({"method": tool, "params": arguments}))
            .map_err(|e| Error::failed(e.to_string()))?;
        let mut out = abi::Buf::EMPTY;
        // SAFETY: the host's contract: `out` is filled with a host buffer, released with `free`.
        let status = unsafe { call(t.ctx, req.as_ptr(), req.len(), &mut out) };
        // SAFETY: the host filled `out` per the ABI.
        let bytes = unsafe { out.copy() };
        // SAFETY: the buffer came from the host's call.
        unsafe { free(t.ctx, out) };
        let bytes = bytes.ok_or_else(|| Error::failed("the host returned a bad buffer"))?;
        match status {
            abi::OK => serde_json::from_slice(&bytes)
                .map_err(|e| Error::failed(format!("the host returned invalid JSON: {e}"))),
            _ => Err(serde_json::from_slice::<Error>(&bytes)
                .unwrap_or_else(|_| Error::failed(String::from_utf8_lossy(&bytes).into_owned()))),
        }
    }

    /// Write a line to the daemon's log.
    pub fn log(&self, level: LogLevel, message: &str) {
        if let Some(t) = self.table() {
            if let Some(log) = t.log {
                // SAFETY: the host copies the message during the call.
                unsafe { log(t.ctx, level as u32, message.as_ptr(), message.len()) };
            }
        }
    }
}

/// Levels of [`Host::log`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum LogLevel {
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

/// A `guidance` plugin: domain-guidance topics for `get_domain_guidance`.
pub trait GuidancePlugin: Send + Sync + 'static {
    /// Every topic, with its instructions. The daemon reads the list once, at start (it builds
    /// the tool's topic enum from it), and asks for the text of a topic when an agent does.
    fn topics(&self) -> Vec<Topic>;

    /// One topic by id; the default looks it up in [`topics`](Self::topics).
    fn topic(&self, id: &str) -> Option<Topic> {
        self.topics().into_iter().find(|t| t.id == id)
    }
}

/// A `tool` plugin: extra MCP tools.
pub trait ToolPlugin: Send + Sync + 'static {
    /// The tools, read once at start.
    fn tools(&self) -> Vec<ToolDef>;

    /// Run tool `name` (as declared, without the namespace) with `arguments` (validated by
    /// nobody but you: check them). The result is the tool's structured content.
    fn call(&self, host: &Host, name: &str, arguments: Json) -> Result<Json, Error>;
}

/// A `blob_store` plugin: blob bytes by content id (the blake3 hex of the bytes). Bytes travel
/// raw, not as JSON.
pub trait BlobStorePlugin: Send + Sync + 'static {
    /// Keep `bytes` under `id` (the same id always has the same bytes: storing twice is fine).
    /// Return only when the bytes are as durable as the store promises.
    fn put(&self, id: &str, bytes: &[u8]) -> Result<(), Error>;
    /// The bytes of `id`, or `None`.
    fn get(&self, id: &str) -> Result<Option<Vec<u8>>, Error>;
    /// Forget `id`; whether it was there.
    fn delete(&self, id: &str) -> Result<bool, Error>;
}

/// An `audit_store` plugin: a copy of the audit log in your system. It receives every record the
/// daemon commits, in order per model, and answers `get_audit` and `verify_audit` for the models
/// it holds (the daemon checks the hash chain over what it returns).
pub trait AuditStorePlugin: Send + Sync + 'static {
    /// Store one committed record.
    fn append(&self, entry: AuditEntry) -> Result<(), Error>;
    /// The records matching `q`, oldest first (the newest `limit` ones when limited).
    fn query(&self, q: AuditQuery) -> Result<Vec<AuditEntry>, Error>;
    /// Drop everything of a deleted model.
    fn delete_model(&self, model_id: &str) -> Result<(), Error>;
}

/// Define this crate's plugin table builder, `pub extern "C" fn plugin_v1(host) -> table`, without
/// exporting the C entry point. For plugins that are also linked statically into a program (the
/// daemon's defaults); a separate `cdylib` crate then calls [`export_entry!`] on it.
///
/// `kind` is one of `guidance`, `tool`, `blob_store`, `audit_store`; `name` the plugin's name;
/// `init` a closure `|host: &Host| -> Result<YourPlugin, valem_sdk::Error>`.
#[macro_export]
macro_rules! declare_plugin {
    ($kind:ident, $name:expr, $init:expr) => {
        /// This crate's valem plugin table (the C entry point's body).
        pub extern "C" fn plugin_v1(
            host: *const $crate::abi::HostV1,
        ) -> *const $crate::abi::PluginV1 {
            $crate::shim::$kind($name, env!("CARGO_PKG_VERSION"), host, $init)
        }
    };
}

/// Export `path::to::plugin_v1` (from [`declare_plugin!`]) as this library's C entry point.
#[macro_export]
macro_rules! export_entry {
    ($builder:path) => {
        /// The valem plugin entry point (ABI v1).
        #[unsafe(no_mangle)]
        pub extern "C" fn valem_plugin_v1(
            host: *const $crate::abi::HostV1,
        ) -> *const $crate::abi::PluginV1 {
            $builder(host)
        }
    };
}

/// Make this `cdylib` a valem plugin: `export_plugin!(kind, "name", |host: &Host| Ok(MyPlugin))`,
/// `kind` one of `guidance`, `tool`, `blob_store`, `audit_store`. See the crate docs.
#[macro_export]
macro_rules! export_plugin {
    ($kind:ident, $name:expr, $init:expr) => {
        $crate::declare_plugin!($kind, $name, $init);
        $crate::export_entry!(plugin_v1);
    };
}
