//! The C shims [`export_plugin!`](crate::export_plugin) builds a table from: one per kind, each
//! entry point wrapped in `catch_unwind` so that a panic is answered as [`abi::PANIC`] instead of
//! unwinding into the host (undefined behaviour) or aborting it.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value as Json};

use crate::abi::{self, Buf, CallBytesFn, CallFn, HostV1, PluginV1, Str};
use crate::{
    AuditEntry, AuditQuery, AuditStorePlugin, BlobStorePlugin, Error, GuidancePlugin, Host,
    ToolPlugin,
};

struct State<T> {
    plugin: T,
    host: Host,
}

fn leak(s: String) -> Str {
    let s: &'static str = Box::leak(s.into_boxed_str());
    Str::from_static(s)
}

/// The message of a caught panic.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

#[allow(clippy::too_many_arguments)]
fn build<T: Send + Sync + 'static>(
    kind: u32,
    name: &'static str,
    version: &'static str,
    host: *const HostV1,
    init: impl FnOnce(&Host) -> Result<T, Error>,
    call: CallFn,
    call_bytes: Option<CallBytesFn>,
) -> *const PluginV1 {
    let made = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the host passes its table, valid for the life of the process (or null).
        let h = unsafe { Host::from_raw(host, name) };
        init(&h).map(|p| (p, h))
    }));
    let (ctx, init_error) = match made {
        Ok(Ok((plugin, host))) => (
            Box::into_raw(Box::new(State { plugin, host })).cast::<c_void>(),
            Str::EMPTY,
        ),
        Ok(Err(e)) => (std::ptr::null_mut(), leak(e.to_string())),
        Err(p) => (
            std::ptr::null_mut(),
            leak(format!(
                "panicked while initialising: {}",
                panic_message(&*p)
            )),
        ),
    };
    let table = PluginV1 {
        abi_version: abi::ABI_VERSION,
        struct_size: std::mem::size_of::<PluginV1>() as u32,
        kind,
        _reserved: 0,
        sdk_version: Str::from_static(crate::SDK_VERSION),
        rustc_version: Str::from_static(crate::RUSTC_VERSION),
        name: Str::from_static(name),
        version: Str::from_static(version),
        init_error,
        ctx,
        call: Some(call),
        call_bytes,
        free: Some(abi::free_vec),
        destroy: Some(destroy::<T>),
    };
    Box::leak(Box::new(table))
}

unsafe extern "C" fn destroy<T>(ctx: *mut c_void) {
    if ctx.is_null() {
        return;
    }
    // SAFETY: ctx is the Box<State<T>> made by `build`, destroyed at most once (host contract).
    let _ = catch_unwind(AssertUnwindSafe(|| {
        drop(unsafe { Box::from_raw(ctx.cast::<State<T>>()) })
    }));
}

/// Run `f` with panics caught and write its answer to `out`.
fn answer(out: *mut Buf, f: impl FnOnce() -> Result<Vec<u8>, Error>) -> i32 {
    let (status, bytes) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(b)) => (abi::OK, b),
        Ok(Err(e)) => (
            abi::ERROR,
            serde_json::to_vec(&e).unwrap_or_else(|_| e.message.into_bytes()),
        ),
        Err(p) => (abi::PANIC, panic_message(&*p).into_bytes()),
    };
    // SAFETY: the host passes a writable Buf (or null).
    unsafe { Buf::write_to(out, bytes) };
    status
}

/// Answer one call: the plugin state, the request parsed into its method's type `R`, then `f`.
fn serve<T, R: DeserializeOwned>(
    ctx: *mut c_void,
    req: *const u8,
    len: usize,
    out: *mut Buf,
    f: impl FnOnce(&State<T>, R) -> Result<Vec<u8>, Error>,
) -> i32 {
    answer(out, || f(state::<T>(ctx)?, typed::<R>(req, len)?))
}

/// The plugin state behind `ctx`.
fn state<'a, T>(ctx: *mut c_void) -> Result<&'a State<T>, Error> {
    // SAFETY: a non-null ctx is the State<T> of this table (made by `build`, alive until destroy).
    unsafe { ctx.cast::<State<T>>().as_ref() }
        .ok_or_else(|| Error::failed("the plugin did not initialise"))
}

/// A request parsed into its method's type; an unknown method is `unknown_method`.
fn typed<R: DeserializeOwned>(req: *const u8, len: usize) -> Result<R, Error> {
    // SAFETY: the host passes `len` readable bytes.
    let bytes =
        unsafe { Str { ptr: req, len }.bytes() }.ok_or_else(|| Error::invalid("null request"))?;
    serde_json::from_slice(bytes).map_err(|e| {
        let m = e.to_string();
        if m.contains("unknown variant") {
            Error::new(
                "unknown_method",
                format!("this plugin has no such method: {m}"),
            )
        } else {
            Error::invalid(format!("bad request: {m}"))
        }
    })
}

fn to_json(v: impl serde::Serialize) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(&v).map_err(|e| Error::failed(format!("cannot encode the result: {e}")))
}

#[derive(Deserialize)]
struct IdParams {
    id: String,
}

// --- guidance ---------------------------------------------------------------------------------

pub fn guidance<T: GuidancePlugin>(
    name: &'static str,
    version: &'static str,
    host: *const HostV1,
    init: impl FnOnce(&Host) -> Result<T, Error>,
) -> *const PluginV1 {
    build(
        abi::KIND_GUIDANCE,
        name,
        version,
        host,
        init,
        call_guidance::<T>,
        None,
    )
}

#[derive(Deserialize)]
#[serde(tag = "method", content = "params")]
enum GuidanceRequest {
    #[serde(rename = "topics.list")]
    List {},
    #[serde(rename = "topics.get")]
    Get(IdParams),
}

unsafe extern "C" fn call_guidance<T: GuidancePlugin>(
    ctx: *mut c_void,
    req: *const u8,
    len: usize,
    out: *mut Buf,
) -> i32 {
    serve(ctx, req, len, out, |s: &State<T>, r| match r {
        GuidanceRequest::List {} => to_json(s.plugin.topics()),
        GuidanceRequest::Get(p) => match s.plugin.topic(&p.id) {
            Some(t) => to_json(t),
            None => Err(Error::not_found(format!("no topic `{}`", p.id))),
        },
    })
}

// --- tools ------------------------------------------------------------------------------------

pub fn tool<T: ToolPlugin>(
    name: &'static str,
    version: &'static str,
    host: *const HostV1,
    init: impl FnOnce(&Host) -> Result<T, Error>,
) -> *const PluginV1 {
    build(
        abi::KIND_TOOL,
        name,
        version,
        host,
        init,
        call_tool::<T>,
        None,
    )
}

#[derive(Deserialize)]
#[serde(tag = "method", content = "params")]
enum ToolRequest {
    #[serde(rename = "tools.list")]
    List {},
    #[serde(rename = "tools.call")]
    Call(ToolCall),
}

#[derive(Deserialize)]
struct ToolCall {
    name: String,
    #[serde(default)]
    arguments: Json,
}

unsafe extern "C" fn call_tool<T: ToolPlugin>(
    ctx: *mut c_void,
    req: *const u8,
    len: usize,
    out: *mut Buf,
) -> i32 {
    serve(ctx, req, len, out, |s: &State<T>, r| match r {
        ToolRequest::List {} => to_json(s.plugin.tools()),
        ToolRequest::Call(c) => {
            let args = match c.arguments {
                Json::Null => json!({}),
                a => a,
            };
            to_json(s.plugin.call(&s.host, &c.name, args)?)
        }
    })
}

// --- blob stores ------------------------------------------------------------------------------

pub fn blob_store<T: BlobStorePlugin>(
    name: &'static str,
    version: &'static str,
    host: *const HostV1,
    init: impl FnOnce(&Host) -> Result<T, Error>,
) -> *const PluginV1 {
    build(
        abi::KIND_BLOB_STORE,
        name,
        version,
        host,
        init,
        call_blob::<T>,
        Some(call_blob_bytes::<T>),
    )
}

#[derive(Deserialize)]
#[serde(tag = "method", content = "params")]
enum BlobRequest {
    #[serde(rename = "blob.delete")]
    Delete(IdParams),
}

#[derive(Deserialize)]
#[serde(tag = "method", content = "params")]
enum BlobBytesRequest {
    #[serde(rename = "blob.put")]
    Put(IdParams),
    #[serde(rename = "blob.get")]
    Get(IdParams),
}

unsafe extern "C" fn call_blob<T: BlobStorePlugin>(
    ctx: *mut c_void,
    req: *const u8,
    len: usize,
    out: *mut Buf,
) -> i32 {
    serve(ctx, req, len, out, |s: &State<T>, r| match r {
        BlobRequest::Delete(p) => to_json(json!({"deleted": s.plugin.delete(&p.id)?})),
    })
}

unsafe extern "C" fn call_blob_bytes<T: BlobStorePlugin>(
    ctx: *mut c_void,
    req: *const u8,
    len: usize,
    data: *const u8,
    data_len: usize,
    out: *mut Buf,
) -> i32 {
    serve(ctx, req, len, out, |s: &State<T>, r| match r {
        BlobBytesRequest::Put(p) => {
            // SAFETY: the host passes `data_len` readable bytes.
            let bytes = unsafe {
                Str {
                    ptr: data,
                    len: data_len,
                }
                .bytes()
            }
            .ok_or_else(|| Error::invalid("null data"))?;
            s.plugin.put(&p.id, bytes)?;
            to_json(json!({}))
        }
        BlobBytesRequest::Get(p) => s
            .plugin
            .get(&p.id)?
            .ok_or_else(|| Error::not_found(format!("no blob `{}`", p.id))),
    })
}

// --- audit stores -----------------------------------------------------------------------------

pub fn audit_store<T: AuditStorePlugin>(
    name: &'static str,
    version: &'static str,
    host: *const HostV1,
    init: impl FnOnce(&Host) -> Result<T, Error>,
) -> *const PluginV1 {
    build(
        abi::KIND_AUDIT_STORE,
        name,
        version,
        host,
        init,
        call_audit::<T>,
        None,
    )
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ModelParams {
    model_id: String,
}

#[derive(Deserialize)]
#[serde(tag = "method", content = "params")]
enum AuditRequest {
    #[serde(rename = "audit.append")]
    Append(AuditEntry),
    #[serde(rename = "audit.query")]
    Query(AuditQuery),
    #[serde(rename = "audit.delete")]
    Delete(ModelParams),
}

unsafe extern "C" fn call_audit<T: AuditStorePlugin>(
    ctx: *mut c_void,
    req: *const u8,
    len: usize,
    out: *mut Buf,
) -> i32 {
    serve(ctx, req, len, out, |s: &State<T>, r| match r {
        AuditRequest::Append(e) => {
            s.plugin.append(e)?;
            to_json(json!({}))
        }
        AuditRequest::Query(q) => to_json(s.plugin.query(q)?),
        AuditRequest::Delete(p) => {
            s.plugin.delete_model(&p.model_id)?;
            to_json(json!({}))
        }
    })
}
