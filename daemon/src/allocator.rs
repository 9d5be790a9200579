//! The process allocator's settings: mimalloc is the binary's global allocator (`main.rs`),
//! wrapped in [`valem_core::budget::Counting`] for the memory budgets of evaluations.

/// mimalloc's `mi_option_allow_thp` (its value in mimalloc v3's `mi_option_e`, which
/// `libmimalloc-sys` does not name); `MIMALLOC_ALLOW_THP` in the environment sets it.
const ALLOW_THP: libmimalloc_sys::mi_option_t = 43;

/// Transparent huge pages off unless the environment asks for them (`MIMALLOC_ALLOW_THP=1`).
/// With them on, mimalloc's memory is mapped in 2 MB pages, each zeroed by the kernel when first
/// touched: building a 100k-derivation model then faults ~250 MB in rather than ~50 MB, which
/// costs 0.1–0.2 s where the kernel hands out pages another process just freed (right after a
/// `cargo build`, fan-out 100k: build 0.25–0.42 s, three runs in four over 0.3 s, against
/// 0.26–0.30 s without), and ~6 MB more stays resident; what they give back is a mutation
/// ~5–15% faster. mimalloc reads its option when it starts, before `main`, and has asked for
/// huge pages for its first arena by then: so the process turns them off in the kernel
/// (`PR_SET_THP_DISABLE`, what mimalloc itself does when the option is off from the start;
/// inherited by child processes) and the option off for what mimalloc maps later. Called
/// first thing in `main`. Also tells the model service how to give memory back
/// ([`release`]).
pub fn configure() {
    valem_service::set_memory_release(release);
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
        return;
    }
    // SAFETY: sets one of mimalloc's global options; it is read when mimalloc next maps
    // memory from the OS and changes nothing already allocated.
    unsafe { libmimalloc_sys::mi_option_set(ALLOW_THP, 0) };
    #[cfg(target_os = "linux")]
    // SAFETY: prctl with PR_SET_THP_DISABLE takes no pointers; it sets a flag of this process
    // that the kernel reads when it backs a page fault.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

/// Give the memory mimalloc holds free back to the OS now: what the model service calls when a
/// large model leaves memory (`valem_service::set_memory_release`), so an evicted or deleted
/// model's memory is returned at once rather than when its shard next purges.
pub fn release() {
    // SAFETY: `mi_collect` takes no pointers; it only frees what mimalloc holds unused.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

/// Whether this process may get transparent huge pages from mimalloc.
pub fn huge_pages() -> bool {
    // SAFETY: reads one of mimalloc's global options.
    let allowed = unsafe { libmimalloc_sys::mi_option_is_enabled(ALLOW_THP) };
    #[cfg(target_os = "linux")]
    // SAFETY: prctl with PR_GET_THP_DISABLE takes no pointers and only reads a flag.
    let disabled = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) } == 1;
    #[cfg(not(target_os = "linux"))]
    let disabled = false;
    allowed && !disabled
}
