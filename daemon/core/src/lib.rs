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

/// Whether the machine has a second core: a large load or cycle then does part of its work on a
/// scoped helper thread (a wide object's member order, a large level's arithmetic).
pub fn second_core() -> bool {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get())) > 1
}

/// `s` as one URI path segment (or query component): every byte but RFC 3986's unreserved
/// ones percent-encoded, so `$.a[0]` is `%24.a%5B0%5D` and `ns/id x` is `ns%2Fid%20x`. What a
/// node forwarding to another, the console's remote client and an effect's URL template put
/// in a URL.
pub fn path_segment(s: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_path_segment_keeps_only_unreserved_bytes() {
        use super::path_segment;
        assert_eq!(path_segment("m-1.a_b~c"), "m-1.a_b~c");
        assert_eq!(path_segment("ns/id x"), "ns%2Fid%20x");
        assert_eq!(path_segment("é"), "%C3%A9");
        assert_eq!(path_segment(""), "");
        assert_eq!(path_segment("$.a[0].b"), "%24.a%5B0%5D.b");
        assert_eq!(path_segment("$constraint:id"), "%24constraint%3Aid");
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }
}

// The unit tests count their allocations, so that memory budgets are enforced there too.
#[cfg(test)]
#[global_allocator]
static GLOBAL: budget::Counting<std::alloc::System> = budget::Counting(std::alloc::System);
