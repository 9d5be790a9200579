//! A template guidance plugin: topics for one domain (small-business lending), added to the
//! daemon's `get_domain_guidance`. Copy this crate, change the topics, build, load with
//! `valem serve --plugin target/release/libexample_guidance.so`. See README.md.

use valem_sdk::{GuidancePlugin, Host, Topic};

struct Lending;

fn topic(id: &str, title: &str, description: &str, instructions: &str) -> Topic {
    Topic {
        id: id.into(),
        title: Some(title.into()),
        description: description.into(),
        instructions: instructions.into(),
    }
}

impl GuidancePlugin for Lending {
    fn topics(&self) -> Vec<Topic> {
        vec![
            topic(
                "loan_amortization",
                "Loan amortisation schedules",
                "monthly payment, interest and balance of an amortising loan",
                "Keep the inputs writable: `principal`, `annualRate` (a fraction, 0.06 for 6%) and \
                 `months`. Derive `monthlyRate` = `annualRate / 12`, then `payment` = \
                 `principal * monthlyRate / (1 - $power(1 + monthlyRate, -months))`, and guard \
                 the zero-rate case with `monthlyRate = 0 ? principal / months : ...`. Round money \
                 only for display (`$round(payment, 2)` in a separate field), never inside the \
                 chain. Add a constraint `months > 0` with severity error.",
            ),
            topic(
                "credit_limits",
                "Credit limits and covenants",
                "debt-service coverage, loan-to-value and limit checks as constraints",
                "Model each covenant as a derivation plus a constraint: `dscr` = \
                 `netOperatingIncome / annualDebtService`, constraint `dscr >= 1.25` (flag, not \
                 rollback, so an analyst can see the breach); `ltv` = `loanAmount / \
                 collateralValue` with `ltv <= 0.8`. Give every constraint a message naming the \
                 covenant and the threshold.",
            ),
        ]
    }
}

valem_sdk::export_plugin!(guidance, "example-guidance", |_host: &Host| Ok(Lending));
