//! The bundled example specs, embedded in the binary (served as `valem://examples/<name>` and
//! by `valem examples`). The files live in the repository's `examples/` folder.

/// Every bundled example: (name, spec JSON text).
pub const ALL: &[(&str, &str)] = &[("demo", include_str!("../../examples/demo.json"))];

/// The spec text of a bundled example.
pub fn get(name: &str) -> Option<&'static str> {
    ALL.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}
