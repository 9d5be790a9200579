//! Shared builders for the benchmark shapes (fan-out, chain, items).
