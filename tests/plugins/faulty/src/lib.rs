//! A tool plugin for the fault tests, built on the SDK: `panic` panics, `hang` never returns,
//! `fail` returns an error, `echo` answers its arguments (proof the plugin still works after the
//! others misbehaved).

use valem_sdk::serde_json::{json, Value};
use valem_sdk::{Error, Host, ToolDef, ToolPlugin};

struct Faulty;

fn def(name: &str) -> ToolDef {
    ToolDef {
        name: name.into(),
        title: None,
        description: format!("fault test: {name}"),
        input_schema: json!({"type": "object"}),
        output_schema: None,
        read_only: true,
    }
}

impl ToolPlugin for Faulty {
    fn tools(&self) -> Vec<ToolDef> {
        ["panic", "hang", "fail", "echo"].map(def).to_vec()
    }

    fn call(&self, _host: &Host, name: &str, args: Value) -> Result<Value, Error> {
        match name {
            "panic" => panic!("the faulty plugin panics on purpose"),
            "hang" => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            "fail" => Err(Error::new(
                "on_purpose",
                "the faulty plugin fails on purpose",
            )),
            _ => Ok(json!({"echo": args})),
        }
    }
}

valem_sdk::export_plugin!(tool, "faulty", |_host: &Host| Ok(Faulty));
