//! valem-core: the values and texts every layer shares. The persistent state value
//! (`value`), keyed hashing of client-chosen names (`hash`), model ids (`id`) and instants
//! (`time`), the JSONata wrapper and address dialect (`expr`), the ModelSpec / SpecEvolution
//! types with their JSON Schemas and the evolution's application (`spec`), evaluation memory
//! budgets (`budget`) and the bundled example specs (`examples`). Never does I/O, never reads the environment or the clock, and
//! knows nothing of the engine, the store or any surface.

// What is not part of the crate's API is pub(crate): the compiler keeps it so.
#![warn(unreachable_pub)]

pub mod budget;
pub mod examples;
pub mod expr;
pub mod hash;
pub mod id;
pub mod spec;
pub mod time;
pub mod value;

/// Start loading the cache line holding `p` without waiting for it (a hint: nothing happens
/// on targets without one). A cycle calls it when it learns an address it will read after
/// some other cache misses, so those misses overlap instead of following one another.
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults, whatever `p` is.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

// The unit tests count their allocations, so that memory budgets are enforced there too.
#[cfg(test)]
#[global_allocator]
static GLOBAL: budget::Counting<std::alloc::System> = budget::Counting(std::alloc::System);
