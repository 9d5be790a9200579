//! A plugin written against the raw C ABI, misbehaving as `VALEM_TEST_RAW_MODE` says:
//! `bad_json` (default): a tool plugin whose `tools.call` answers bytes that are not JSON;
//! `abi99`: a table of ABI version 99; `small`: a table smaller than v1's; `null`: no table.

use std::ffi::c_void;
use std::sync::OnceLock;

use valem_sdk::abi::{self, Buf, HostV1, PluginV1, Str};

unsafe extern "C" fn call(_ctx: *mut c_void, req: *const u8, len: usize, out: *mut Buf) -> i32 {
    // SAFETY: the host passes `len` readable bytes.
    let req = unsafe { std::slice::from_raw_parts(req, len) };
    let answer: &[u8] = if req.windows(10).any(|w| w == b"tools.list") {
        br#"[{"name":"broken","description":"answers bytes that are not JSON","inputSchema":{"type":"object"}}]"#
    } else {
        b"{this is not json"
    };
    // SAFETY: the host passes a writable Buf.
    unsafe { out.write(Buf::from_vec(answer.to_vec())) };
    abi::OK
}

unsafe extern "C" fn free(_ctx: *mut c_void, buf: Buf) {
    // SAFETY: buffers this library filled with Buf::from_vec.
    drop(unsafe { buf.into_vec() });
}

struct Table(PluginV1);
static TABLE: OnceLock<Table> = OnceLock::new();

/// # Safety
/// Called by the host with its table.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn valem_plugin_v1(_host: *const HostV1) -> *const PluginV1 {
    let mode = std::env::var("VALEM_TEST_RAW_MODE").unwrap_or_default();
    if mode == "null" {
        return std::ptr::null();
    }
    let t = TABLE.get_or_init(|| {
        Table(PluginV1 {
            abi_version: if mode == "abi99" {
                99
            } else {
                abi::ABI_VERSION
            },
            struct_size: if mode == "small" {
                8
            } else {
                std::mem::size_of::<PluginV1>() as u32
            },
            kind: abi::KIND_TOOL,
            _reserved: 0,
            sdk_version: Str::from_static("raw"),
            rustc_version: Str::from_static("raw"),
            name: Str::from_static("raw"),
            version: Str::from_static("0.0.1"),
            init_error: Str::EMPTY,
            ctx: std::ptr::null_mut(),
            call: Some(call),
            call_bytes: None,
            free: Some(free),
            destroy: None,
        })
    });
    &t.0
}
