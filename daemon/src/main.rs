//! The `valem` binary: a thin shell over `valem::cli`.

fn main() {
    std::process::exit(valem::cli::main());
}
