//! The `valem` binary: a thin shell over `valem::cli`.

// The daemon allocates per request from several threads (reactor, shards); mimalloc is
// measurably cheaper there than glibc malloc (see docs/performance.md). Counted
// per thread, for the memory budget of an evaluation (`valem_core::budget::watch`).
#[global_allocator]
static GLOBAL: valem_core::budget::Counting<mimalloc::MiMalloc> =
    valem_core::budget::Counting(mimalloc::MiMalloc);

fn main() {
    valem::allocator::configure();
    std::process::exit(valem::cli::main());
}
