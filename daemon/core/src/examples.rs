//! The bundled example specs, embedded in the binary (served as `valem://examples/<name>` and
//! by `valem examples`). The files live in the repository's `examples/` folder.

/// Every bundled example: (name, spec JSON text).
pub const ALL: &[(&str, &str)] = &[
    ("demo", include_str!("../../../examples/demo.json")),
    (
        "car-loan-calculator",
        include_str!("../../../examples/car-loan-calculator.json"),
    ),
    (
        "customer-survey",
        include_str!("../../../examples/customer-survey.json"),
    ),
    (
        "event-registration",
        include_str!("../../../examples/event-registration.json"),
    ),
    (
        "grade-book",
        include_str!("../../../examples/grade-book.json"),
    ),
    (
        "insurance-quote",
        include_str!("../../../examples/insurance-quote.json"),
    ),
    (
        "inventory-reorder",
        include_str!("../../../examples/inventory-reorder.json"),
    ),
    (
        "order-invoice",
        include_str!("../../../examples/order-invoice.json"),
    ),
    (
        "payroll-paycheck",
        include_str!("../../../examples/payroll-paycheck.json"),
    ),
    (
        "project-budget",
        include_str!("../../../examples/project-budget.json"),
    ),
    (
        "subscription-proration",
        include_str!("../../../examples/subscription-proration.json"),
    ),
    (
        "unit-converter",
        include_str!("../../../examples/unit-converter.json"),
    ),
];

/// The spec text of a bundled example.
pub fn get(name: &str) -> Option<&'static str> {
    ALL.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}
