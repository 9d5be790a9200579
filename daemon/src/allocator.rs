//! The process allocator's settings: mimalloc is the binary's global allocator (`main.rs`).

/// mimalloc's `mi_option_allow_thp` (its value in mimalloc v3's `mi_option_e`, which
/// `libmimalloc-sys` does not name); `MIMALLOC_ALLOW_THP` in the environment sets it.
const ALLOW_THP: libmimalloc_sys::mi_option_t = 43;

/// Whether mimalloc may ask the kernel for transparent huge pages: yes unless
/// `MIMALLOC_ALLOW_THP=0`. With them a mutation of a large model is ~6–15% faster (fewer TLB
/// misses); without them its build faults in ~5× less memory (4 KB pages rather than 2 MB
/// ones, each zeroed by the kernel when first touched), which shows where the kernel hands out
/// pages another process just freed (fan-out 100k build 0.38–0.44 s with them, 0.29 s
/// without, measured right after a process freed 1.5 GB), and ~6 MB less stays resident.
pub fn huge_pages() -> bool {
    // SAFETY: reads one of mimalloc's global options.
    unsafe { libmimalloc_sys::mi_option_is_enabled(ALLOW_THP) }
}
