//! Memory budgets of evaluations: a counting global allocator and the per-thread watch that
//! stops an evaluation (through its JSONata cancel token) once it holds more than its budget.
//! Owns no allocator of its own: the binary chooses what `Counting` wraps.

// The global allocator counts, per thread, the bytes taken minus the bytes given
// back; an evaluation watched with `watch` is stopped (through its JSONata cancel token, which the
// evaluator checks at every node and every element a higher-order function hands its callback)
// once its thread holds more than its budget above what it held when it started. This binds what
// no per-function check can see: a string doubled in a loop, a mapping that builds a million
// objects, a range of ten million numbers.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::{Cell, RefCell};

use jsonata_core::evaluator::CancelToken;

/// A global allocator that forwards to `A`, counting each thread's bytes (see above). The count
/// is two thread-local additions and a comparison per call. The binary wraps mimalloc
/// (`static GLOBAL: Counting<MiMalloc> = Counting(MiMalloc)`); a process whose global
/// allocator is not a `Counting` enforces no memory budget.
pub struct Counting<A>(pub A);

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

// SAFETY: every call is passed to `A` unchanged; the counting around it touches only
// const-initialised thread-locals without destructors (no allocation, no re-entry), and never
// unwinds.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as the caller gave it.
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            took(layout.size());
        }
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as the caller gave it.
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            took(layout.size());
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        gave(layout.size());
        // SAFETY: forwarded as the caller gave it.
        unsafe { self.0.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as the caller gave it.
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
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
