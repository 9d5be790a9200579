//! The `valem` binary: a thin shell over `valem::cli`.

// The daemon allocates per request from several threads (reactor, shards); mimalloc is
// measurably cheaper there than glibc malloc (see the http bench in ARCHITECTURE.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    valem::allocator::configure();
    std::process::exit(valem::cli::main());
}
