//! A template tool plugin. It adds one MCP tool, `example_tool__increment`: read a number from a
//! model (through the host's `get_field`), add to it, and write it back (through `mutate`), so
//! the change runs a reactive cycle like any other. See README.md.

use valem_sdk::serde_json::{json, Value};
use valem_sdk::{Error, Host, ToolDef, ToolPlugin};

struct Increment;

impl ToolPlugin for Increment {
    fn tools(&self) -> Vec<ToolDef> {
        vec![ToolDef {
            name: "increment".into(),
            title: Some("Add to a numeric field".into()),
            description: "Add `by` (default 1) to the number at `path` of model `id`; returns the \
                          old and new values and the mutation's result."
                .into(),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "id": {"type": "string", "description": "the model id"},
                    "path": {"type": "string", "description": "a writable numeric field, e.g. $.qty"},
                    "by": {"type": "number", "description": "the amount to add (default 1)"}
                },
                "required": ["id", "path"],
                "additionalProperties": false
            }),
            output_schema: None,
            read_only: false,
        }]
    }

    fn call(&self, host: &Host, name: &str, args: Value) -> Result<Value, Error> {
        if name != "increment" {
            return Err(Error::not_found(format!("no tool `{name}`")));
        }
        let id = args["id"]
            .as_str()
            .ok_or_else(|| Error::invalid("`id` must be a string"))?;
        let path = args["path"]
            .as_str()
            .ok_or_else(|| Error::invalid("`path` must be a string"))?;
        let by = match &args["by"] {
            Value::Null => 1.0,
            v => v
                .as_f64()
                .ok_or_else(|| Error::invalid("`by` must be a number"))?,
        };
        // get_field answers the value itself.
        let value = host.call("get_field", json!({"id": id, "path": path}))?;
        let old = value
            .as_f64()
            .ok_or_else(|| Error::invalid(format!("{path} holds {value}, not a number")))?;
        let new = old + by;
        let result = host.call("mutate", json!({"id": id, "mutations": {path: new}}))?;
        Ok(json!({"path": path, "old": old, "new": new, "mutation": result}))
    }
}

valem_sdk::export_plugin!(tool, "example-tool", |_host: &Host| Ok(Increment));
