//! The raw C ABI, version 1. Everything here is `#[repr(C)]` and stays as it is for as long as
//! v1 is supported: a new field or a changed signature is a new version (`valem_plugin_v2`,
//! `PluginV2`), which a host can load beside v1.
//!
//! ## Protocol
//! - A plugin library exports `valem_plugin_v1` ([`EntryV1`]). The host calls it once, with its
//!   [`HostV1`] table, and gets the plugin's [`PluginV1`] table; both stay valid until the process
//!   exits (the host never unloads a library).
//! - The host reads `abi_version` and `struct_size` before any other field, and refuses a table
//!   whose version it does not support or that is smaller than the [`PluginV1`] it knows.
//! - A call sends a UTF-8 JSON request `{"method": "...", "params": {...}}` and receives a status
//!   and a buffer in `out`: with [`OK`] the JSON result (or, for [`CallBytesFn`] reads, raw bytes);
//!   with [`ERROR`] a JSON `{"code": "...", "message": "..."}`; with [`PANIC`] the panic message as
//!   UTF-8 text. The receiver copies the buffer and hands it back to the side that allocated it
//!   (`PluginV1::free` for plugin buffers, `HostV1::free` for host buffers).
//! - Calls may come from several host threads at once: a plugin is `Send + Sync`.

use std::ffi::c_void;

/// The ABI version of this module.
pub const ABI_VERSION: u32 = 1;

/// The exported entry point's name (NUL-terminated, for `dlsym`).
pub const ENTRY_V1: &[u8] = b"valem_plugin_v1\0";

/// Call status: the result is in `out`.
pub const OK: i32 = 0;
/// Call status: `out` holds `{"code", "message"}`.
pub const ERROR: i32 = 1;
/// Call status: the plugin panicked; `out` holds the message (the panic was caught by the shim).
pub const PANIC: i32 = 2;

/// Plugin kind: adds MCP tools (`tools.list`, `tools.call`).
pub const KIND_TOOL: u32 = 1;
/// Plugin kind: domain-guidance topics (`topics.list`, `topics.get`).
pub const KIND_GUIDANCE: u32 = 2;
/// Plugin kind: a blob store (`blob.put`, `blob.get`, `blob.delete` through `call_bytes`).
pub const KIND_BLOB_STORE: u32 = 3;
/// Plugin kind: an audit store (`audit.append`, `audit.query`, `audit.verify`, `audit.delete`).
pub const KIND_AUDIT_STORE: u32 = 4;

/// Borrowed UTF-8 bytes (not NUL-terminated). In a table, valid as long as the table.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Str {
    pub ptr: *const u8,
    pub len: usize,
}

impl Str {
    pub const EMPTY: Str = Str {
        ptr: std::ptr::null(),
        len: 0,
    };

    /// A `Str` over a `'static` string.
    pub const fn from_static(s: &'static str) -> Str {
        Str {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    /// The bytes, or `None` for a null pointer with a non-zero length.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable bytes that outlive `'a`.
    pub unsafe fn bytes<'a>(&self) -> Option<&'a [u8]> {
        if self.len == 0 {
            return Some(&[]);
        }
        if self.ptr.is_null() {
            return None;
        }
        // SAFETY: the caller's contract.
        Some(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }
}

/// An owned buffer, filled by one side and released by that side's `free`.
#[repr(C)]
#[derive(Debug)]
pub struct Buf {
    pub ptr: *mut u8,
    pub len: usize,
    pub cap: usize,
}

impl Buf {
    pub const EMPTY: Buf = Buf {
        ptr: std::ptr::null_mut(),
        len: 0,
        cap: 0,
    };

    /// Give up a vector's allocation to the other side (release it with [`Buf::into_vec`], on
    /// this side, through this side's `free`).
    pub fn from_vec(v: Vec<u8>) -> Buf {
        let mut v = std::mem::ManuallyDrop::new(v);
        Buf {
            ptr: v.as_mut_ptr(),
            len: v.len(),
            cap: v.capacity(),
        }
    }

    /// Fill `out` (when it is not null) with `bytes`, given up to the other side.
    ///
    /// # Safety
    /// `out` must be null or point to a writable `Buf`.
    pub unsafe fn write_to(out: *mut Buf, bytes: Vec<u8>) {
        if !out.is_null() {
            // SAFETY: the caller's contract.
            unsafe { out.write(Buf::from_vec(bytes)) };
        }
    }

    /// The bytes of a buffer the other side filled, borrowed until it is freed; `None` when it is
    /// inconsistent (null with a length, or longer than its capacity).
    ///
    /// # Safety
    /// A non-null `ptr` must point to `len` initialised bytes (the filler's contract), which stay
    /// valid while the returned slice lives.
    pub unsafe fn bytes(&self) -> Option<&[u8]> {
        if !self.ptr.is_null() && self.len > self.cap {
            return None;
        }
        // SAFETY: the caller's contract.
        unsafe {
            Str {
                ptr: self.ptr,
                len: self.len,
            }
            .bytes()
        }
    }

    /// A copy of the bytes of a buffer the other side filled; `None` when it is inconsistent.
    ///
    /// # Safety
    /// As [`bytes`](Self::bytes).
    pub unsafe fn copy(&self) -> Option<Vec<u8>> {
        // SAFETY: the caller's contract.
        unsafe { self.bytes() }.map(<[u8]>::to_vec)
    }

    /// Take back an allocation made by [`Buf::from_vec`] on this side.
    ///
    /// # Safety
    /// `self` must come from [`Buf::from_vec`] in the same library (same allocator), unchanged.
    pub unsafe fn into_vec(self) -> Vec<u8> {
        if self.ptr.is_null() || self.cap == 0 {
            return Vec::new();
        }
        // SAFETY: the caller's contract: ptr/len/cap are a Vec's parts from this allocator.
        unsafe { Vec::from_raw_parts(self.ptr, self.len, self.cap) }
    }
}

/// A [`FreeFn`] for buffers made with [`Buf::from_vec`]: each side uses its own copy of this
/// function, so a buffer goes back to the allocator of the library that filled it.
///
/// # Safety
/// `buf` must come from [`Buf::from_vec`] in the library whose copy of this function is called.
pub unsafe extern "C" fn free_vec(_ctx: *mut c_void, buf: Buf) {
    // SAFETY: the caller's contract.
    let _ = std::panic::catch_unwind(|| drop(unsafe { buf.into_vec() }));
}

/// `call(ctx, request, request_len, out) -> status`: one JSON request, one answer in `out`.
pub type CallFn =
    unsafe extern "C" fn(ctx: *mut c_void, req: *const u8, req_len: usize, out: *mut Buf) -> i32;

/// `call_bytes(ctx, request, request_len, data, data_len, out) -> status`: a JSON request with raw
/// bytes beside it (blob writes), or whose answer is raw bytes (blob reads); no base64 on the way.
pub type CallBytesFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    req: *const u8,
    req_len: usize,
    data: *const u8,
    data_len: usize,
    out: *mut Buf,
) -> i32;

/// Release a buffer this side filled.
pub type FreeFn = unsafe extern "C" fn(ctx: *mut c_void, buf: Buf);

/// Drop the plugin's state (the host calls it at most once, when it shuts down cleanly).
pub type DestroyFn = unsafe extern "C" fn(ctx: *mut c_void);

/// `log(ctx, level, message, len)`: levels 1 error, 2 warn, 3 info, 4 debug.
pub type LogFn = unsafe extern "C" fn(ctx: *mut c_void, level: u32, msg: *const u8, len: usize);

/// What a plugin gives the host.
#[repr(C)]
pub struct PluginV1 {
    /// [`ABI_VERSION`] of the SDK that built the table. Read first.
    pub abi_version: u32,
    /// `size_of::<PluginV1>()` as built. Read second; later fields exist only if it is large enough.
    pub struct_size: u32,
    /// One of the `KIND_*` constants.
    pub kind: u32,
    pub _reserved: u32,
    /// Version of `valem-sdk` that built the plugin.
    pub sdk_version: Str,
    /// `rustc --version` of the compiler that built it.
    pub rustc_version: Str,
    /// The plugin's name: lowercase letters, digits, `-` and `_`; namespaces its tools.
    pub name: Str,
    /// The plugin's own version.
    pub version: Str,
    /// Non-empty when initialisation failed: the host reports it and makes no call.
    pub init_error: Str,
    /// The plugin's state, passed back to every function below.
    pub ctx: *mut c_void,
    pub call: Option<CallFn>,
    pub call_bytes: Option<CallBytesFn>,
    pub free: Option<FreeFn>,
    pub destroy: Option<DestroyFn>,
}

/// What the host gives a plugin at initialisation.
#[repr(C)]
pub struct HostV1 {
    pub abi_version: u32,
    pub struct_size: u32,
    /// Version of the daemon.
    pub host_version: Str,
    /// A directory for the plugin's own files (created by the host), or empty when the daemon
    /// keeps nothing on disk.
    pub data_dir: Str,
    /// JSON configuration for this plugin (`{}` when none was given).
    pub config: Str,
    pub ctx: *mut c_void,
    /// Call a service operation: request `{"method": "<tool name>", "params": {<arguments>}}`,
    /// the tool's structured result on [`OK`]. Host buffers go back through `free`.
    pub call: Option<CallFn>,
    pub free: Option<FreeFn>,
    pub log: Option<LogFn>,
}

/// The exported entry point: `valem_plugin_v1(host) -> table` (null only if the shim itself
/// could not allocate).
pub type EntryV1 = unsafe extern "C" fn(host: *const HostV1) -> *const PluginV1;

// The tables travel between threads of the host; the ABI requires thread-safe plugins.
unsafe impl Send for PluginV1 {}
unsafe impl Sync for PluginV1 {}
unsafe impl Send for HostV1 {}
unsafe impl Sync for HostV1 {}
