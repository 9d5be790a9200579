//! valem: the `valem` binary's crate. The command line (`cli`), the console (`console`),
//! `valem bench` (`bench`) and the process allocator (`allocator`), over the layer crates:
//! valem-core → valem-engine → valem-store → valem-service → valem-mcp → valem-http. See
//! ARCHITECTURE.md for the code map and invariants.

pub mod allocator;
pub mod bench;
pub mod bench_models;
pub mod cli;
pub mod console;

// The unit tests run on the binary's allocator, so that memory budgets are enforced there too.
#[cfg(test)]
#[global_allocator]
static GLOBAL: valem_core::budget::Counting<mimalloc::MiMalloc> =
    valem_core::budget::Counting(mimalloc::MiMalloc);
