//! Authoring: what an agent asks of a spec before it is a model (validate it, run its tests,
//! dry-run it, evaluate one expression), with this service's engine limits and clock. Nothing
//! here touches a shard, the store or a registered model.

use serde_json::{json, Map, Value as Json};

use super::time::now;
use super::ModelService;
use valem_core::spec::{ModelSpec, TestCase};

pub use valem_engine::testrun::{parse_batches, BatchesError, DryRunError, TestReport};
pub use valem_engine::validate::Report;
pub use valem_engine::CreateError;

/// One expression to evaluate, as `eval_expression` takes it.
pub struct Expression<'a> {
    /// One JSONata expression.
    pub expr: &'a str,
    /// The input document (`$`); absent means undefined input.
    pub input: Option<&'a Json>,
    /// A library to bind: a definition string, a layer object or an array of layers.
    pub library: Option<&'a Json>,
    /// Bound as `$const`.
    pub constants: Option<&'a Map<String, Json>>,
}

impl ModelService {
    /// The validator's report on a candidate spec (as JSON: nothing needs to parse first).
    pub fn validate_spec(&self, spec: &Json) -> Report {
        valem_engine::validate::validate_json(spec, &self.limits().engine)
    }

    /// Run the spec's embedded tests, or `cases` in their place, in throwaway models.
    pub fn test_spec(
        &self,
        spec: &ModelSpec,
        cases: Option<&[TestCase]>,
    ) -> Result<TestReport, CreateError> {
        valem_engine::testrun::run_tests(spec, cases, now(), &self.limits().engine)
    }

    /// Compile the spec in a throwaway model, apply `batches` in order, and return the merged
    /// state; nothing is registered.
    pub fn dry_run(
        &self,
        spec: &ModelSpec,
        batches: &[Vec<(String, Json)>],
    ) -> Result<Json, DryRunError> {
        valem_engine::testrun::dry_run(spec, batches, now(), &self.limits().engine)
    }

    /// Evaluate one expression: `{ok: true, undefined, result}` or `{ok: false, error:
    /// "compile"|"evaluation"|"library", message, code?, position?}`, with `libraryExports`
    /// when a library was given.
    pub fn eval_expression(&self, e: Expression<'_>) -> Json {
        use std::rc::Rc;
        use valem_core::expr::{json_to_jvalue, jvalue_to_json, Compiled, Env, Phase};
        let limits = &self.limits().engine.expr;
        let mut env = Env {
            now_ms: Some(now().ms()),
            ..Env::default()
        };
        if let Some(k) = e.constants {
            env.vars
                .push((Rc::from("const"), json_to_jvalue(&Json::Object(k.clone()))));
        }
        let mut exports = Vec::new();
        if let Some(lib) = e.library {
            let lib: valem_core::spec::LibrarySpec = match serde_json::from_value(lib.clone()) {
                Ok(l) => l,
                Err(e) => {
                    return json!({"ok": false, "error": "library", "message": format!("`library` is not a library definition: {e}")});
                }
            };
            for layer in lib.layers() {
                match valem_engine::compile::eval_library_layer(&layer.define, &env, limits) {
                    Ok(bound) => {
                        for (name, v) in bound {
                            exports.push(name.clone());
                            env.vars.push((Rc::from(name.as_str()), v));
                        }
                    }
                    Err(m) => return json!({"ok": false, "error": "library", "message": m}),
                }
            }
        }
        let fail = |e: valem_core::expr::ExprError| {
            let kind = if e.phase == Phase::Compile {
                "compile"
            } else {
                "evaluation"
            };
            json!({"ok": false, "error": kind, "message": e.message, "code": e.code, "position": e.position})
        };
        let compiled = match Compiled::compile(e.expr, limits) {
            Ok(c) => c,
            Err(e) => return fail(e),
        };
        let input = e
            .input
            .map_or(valem_core::expr::Value::Undefined, json_to_jvalue);
        let mut out = match compiled
            .eval(&input, &env, limits)
            .and_then(|v| v.map(|v| jvalue_to_json(&v, limits)).transpose())
        {
            Ok(Some(v)) => json!({"ok": true, "undefined": false, "result": v}),
            Ok(None) => json!({"ok": true, "undefined": true, "result": null}),
            Err(e) => return fail(e),
        };
        if e.library.is_some() {
            out["libraryExports"] = json!(exports);
        }
        out
    }
}
