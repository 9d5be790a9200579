//! The process allocator's settings: mimalloc is the binary's global allocator (`main.rs`).

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
/// first thing in `main`.
pub fn configure() {
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

// ---------------------------------------------------------------------------------------------
// Memory budgets. The global allocator counts, per thread, the bytes taken minus the bytes given
// back; an evaluation watched with `watch` is stopped (through its JSONata cancel token, which the
// evaluator checks at every node and every element a higher-order function hands its callback)
// once its thread holds more than its budget above what it held when it started. This binds what
// no per-function check can see: a string doubled in a loop, a mapping that builds a million
// objects, a range of ten million numbers.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::{Cell, RefCell};

use jsonata_core::evaluator::CancelToken;

/// The binary's global allocator: mimalloc, counting each thread's bytes (see above). The count
/// is two thread-local additions and a comparison per call.
pub struct Counting;

thread_local! {
    /// Bytes this thread has allocated minus bytes it has freed (memory freed on another thread
    /// than the one that allocated it counts there).
    static HELD: Cell<isize> = const { Cell::new(0) };
    /// What `HELD` may reach before the watched evaluation is stopped; `isize::MAX` unwatched.
    static CEILING: Cell<isize> = const { Cell::new(isize::MAX) };
    /// The watched evaluation's token, cancelled when `HELD` passes `CEILING`; null unwatched.
    static STOP: Cell<*const CancelToken> = const { Cell::new(std::ptr::null()) };
    /// Whether the watched evaluation went over its budget.
    static TRIPPED: Cell<bool> = const { Cell::new(false) };
    /// This thread's evaluation token (a cancelled one is replaced when the next watch starts);
    /// kept here so that its address, which `STOP` holds, stays put while a watch is on.
    static TOKEN: RefCell<CancelToken> = RefCell::new(CancelToken::new());
}

#[inline]
fn took(bytes: usize) {
    let _ = HELD.try_with(|held| {
        let now = held.get().wrapping_add(bytes as isize);
        held.set(now);
        if now > CEILING.try_with(Cell::get).unwrap_or(isize::MAX) {
            trip();
        }
    });
}

#[inline]
fn gave(bytes: usize) {
    let _ = HELD.try_with(|held| held.set(held.get().wrapping_sub(bytes as isize)));
}

/// The watched evaluation went over its budget: stop it, once.
#[cold]
fn trip() {
    let _ = CEILING.try_with(|c| c.set(isize::MAX));
    let _ = TRIPPED.try_with(|t| t.set(true));
    if let Ok(stop) = STOP.try_with(Cell::get) {
        if !stop.is_null() {
            // SAFETY: `STOP` is non-null only while a `Watch` is alive on this thread, and
            // points into this thread's `TOKEN`, which is not replaced while it is;
            // `CancelToken::cancel` is one atomic store and allocates nothing.
            unsafe { (*stop).cancel() };
        }
    }
}

// SAFETY: every call is passed to mimalloc unchanged; the counting around it touches only
// const-initialised thread-locals without destructors (no allocation, no re-entry), and never
// unwinds.
unsafe impl GlobalAlloc for Counting {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as the caller gave it.
        let p = unsafe { mimalloc::MiMalloc.alloc(layout) };
        if !p.is_null() {
            took(layout.size());
        }
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as the caller gave it.
        let p = unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) };
        if !p.is_null() {
            took(layout.size());
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        gave(layout.size());
        // SAFETY: forwarded as the caller gave it.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as the caller gave it.
        let p = unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            gave(layout.size());
            took(new_size);
        }
        p
    }
}

/// A watched evaluation (see [`watch`]); ends when dropped.
pub struct Watch {
    /// Whether this watch installed itself (an evaluation inside a watched one is counted
    /// in the outer one's budget).
    outer: bool,
}

/// Watch the evaluation about to run on this thread: it may hold `budget` bytes more than the
/// thread holds now. Returns the guard and the token to give the evaluator. Under a watch
/// already on (an evaluation made by a host function of another), the outer one goes on.
pub fn watch(budget: usize) -> (Watch, CancelToken) {
    let outer = STOP.with(Cell::get).is_null();
    let token = TOKEN.with(|t| {
        if outer && t.borrow().is_cancelled() {
            *t.borrow_mut() = CancelToken::new();
        }
        let token = t.borrow().clone();
        if outer {
            STOP.with(|s| s.set(t.as_ptr()));
        }
        token
    });
    if outer {
        TRIPPED.with(|t| t.set(false));
        let held = HELD.with(Cell::get);
        let budget = isize::try_from(budget).unwrap_or(isize::MAX);
        CEILING.with(|c| c.set(held.saturating_add(budget)));
    }
    (Watch { outer }, token)
}

impl Watch {
    /// Whether the evaluation went over its budget (so far).
    pub fn tripped(&self) -> bool {
        TRIPPED.with(Cell::get)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if self.outer {
            CEILING.with(|c| c.set(isize::MAX));
            STOP.with(|s| s.set(std::ptr::null()));
        }
    }
}

/// Bytes this thread holds by the count of [`Counting`] (allocated minus freed here); always
/// 0 in a process whose global allocator is not `Counting`.
pub fn held() -> isize {
    HELD.with(Cell::get)
}
