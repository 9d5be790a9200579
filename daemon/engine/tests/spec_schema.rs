//! The generated ModelSpec / SpecEvolution JSON Schemas against the validator, the engine and
//! every bundled example: what the schemas accept is what valem accepts.

use serde_json::json;
use serde_json::Value as Json;
use valem_core::spec::schema::{model_spec_schema, output_schema, spec_evolution_schema};
use valem_core::spec::{parse_evolution, parse_spec, parse_spec_text};
use valem_engine::testrun::{run_tests, TestReport};
use valem_engine::validate::{validate, validate_json, Report};
use valem_engine::Timestamp;
use valem_engine::{EngineLimits, Model, MutationResult};

fn validator(schema: &Json) -> jsonschema::Validator {
    jsonschema::draft202012::meta::validate(schema).expect("a valid 2020-12 schema");
    jsonschema::draft202012::new(schema).expect("the schema compiles")
}

fn assert_valid(v: &jsonschema::Validator, instance: &Json, what: &str) {
    let errors: Vec<String> = v
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{what}: {errors:#?}");
}

fn no_refs(j: &Json, at: &str) {
    match j {
        Json::Object(m) => {
            for (k, v) in m {
                assert!(
                    !matches!(k.as_str(), "$ref" | "$defs" | "definitions" | "$dynamicRef"),
                    "`{k}` at {at}"
                );
                no_refs(v, &format!("{at}/{k}"));
            }
        }
        Json::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, v)| no_refs(v, &format!("{at}/{i}"))),
        _ => {}
    }
}

fn outputs() -> Vec<(&'static str, Json)> {
    vec![
        ("MutationResult", output_schema::<MutationResult>()),
        ("TestReport", output_schema::<TestReport>()),
        ("Report", output_schema::<Report>()),
    ]
}

#[test]
fn schemas_are_valid_inlined_and_titled() {
    let all = [
        ("ModelSpec", model_spec_schema()),
        ("SpecEvolution", spec_evolution_schema()),
    ];
    for (name, s) in all.iter().chain(outputs().iter()) {
        validator(s);
        no_refs(s, name);
        assert_eq!(s["type"], "object", "{name}");
        assert_eq!(s["title"], *name);
        assert_eq!(s["$schema"], "https://json-schema.org/draft/2020-12/schema");
        assert!(
            s["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{name}"
        );
        assert!(
            !s.to_string().contains("\"format\""),
            "{name}: a Rust number format"
        );
        assert!(
            !s.to_string().contains("\\n"),
            "{name}: a wrapped description"
        );
    }
    // Cached: the same value every time.
    assert_eq!(model_spec_schema(), all[0].1);
    // Removed fields are not advertised; unknown keys are not rejected.
    let props = &all[0].1["properties"];
    assert!(props.get("initialState").is_none() && props.get("actions").is_none());
    assert!(props.get("extra").is_none());
    assert!(all[0].1.get("additionalProperties").is_none());
}

#[test]
fn every_example_validates() {
    let v = validator(&model_spec_schema());
    for (name, text) in valem_core::examples::ALL {
        let json: Json = serde_json::from_str(text).unwrap();
        assert_valid(&v, &json, name);
        // What the spec serializes back to is a valid spec too.
        let spec = parse_spec_text(text).unwrap();
        assert_valid(&v, &serde_json::to_value(&spec).unwrap(), name);
    }
}

/// Inputs the deserializer accepts are accepted by the schema.
#[test]
fn schema_accepts_what_the_deserializer_accepts() {
    let v = validator(&model_spec_schema());
    let specs = [
        json!({"id": "x", "schema": {}}),
        json!({"id": "x", "schema": true, "version": null, "library": null,
            "viewDefinition": null, "futureKey": {"kept": true}}),
        json!({"id": "x", "schema": {},
            "metaDerivations": [
                {"path": "$.a", "property": "maximum", "expr": 100},
                {"path": "$.a", "property": "readOnly", "expr": true},
                {"path": "$.a", "property": "relevant", "expr": "b > 1", "description": null}
            ],
            "constraints": [
                {"id": "c1", "expr": "a > 0", "policy": "flag"},
                {"id": "c2", "path": "$.a", "expr": "a > 0", "message": "m", "policy": "rollback"},
                {"id": "c3", "path": ["$.a", "$.b"], "expr": "a > b", "policy": "flag"},
                {"id": "c4", "path": null, "expr": "true", "policy": "flag"}
            ],
            "derivations": [{"path": "$.b", "expr": "a", "evaluation": "lazy"},
                {"path": "$.c", "expr": "a", "evaluation": null}],
            "effects": [
                {"id": "t", "executor": "timer", "trigger": "a > 1", "afterMs": 5000,
                    "response": {"set": {"$.done": "true"}}},
                {"id": "t2", "executor": "timer", "trigger": "a > 1", "afterMs": "a * 10",
                    "pluginOption": 1},
                {"id": "c", "executor": "caller", "trigger": "a > 1", "emit": "ev",
                    "payload": {"a": "a"}, "dedupeKey": "a"},
                {"id": "s", "trigger": "a > 1", "request": {"url": "https://x.test"},
                    "policy": {"timeoutMs": 100}, "response": {}}
            ],
            "tests": [{"given": {"$.a": 1}, "expect": {"$.b": 1, "$.a": {"$meta": {"relevant": true}}}}]
        }),
        json!({"id": "x", "schema": {}, "library": "( $f := function($x){$x}; [\"f\"] )"}),
        json!({"id": "x", "schema": {}, "library": {"define": "a", "extends": "base"}}),
        json!({"id": "x", "schema": {}, "library": {"define": "a", "extends": ["b", "c"],
            "signatures": {"f": "(n) -> n"}}}),
        json!({"id": "x", "schema": {}, "library": {"layers": [{"define": "a", "origin": "o"},
            {"define": "b"}], "description": "d"}}),
        json!({"id": "x", "schema": {}, "template": {"ref": "acme/base"},
            "lineage": [{"ref": "acme/base", "version": "1.0.0", "digest": "d"}],
            "constants": {"rate": 0.2}, "defaultValues": [{"path": "$", "expr": "{}"}]}),
    ];
    for (i, s) in specs.iter().enumerate() {
        parse_spec(s).unwrap_or_else(|e| panic!("spec {i}: {e}"));
        assert_valid(&v, s, &format!("spec {i}"));
    }
}

/// Shapes the deserializer rejects are rejected by the schema.
#[test]
fn schema_rejects_what_the_deserializer_rejects() {
    let v = validator(&model_spec_schema());
    let bad = [
        json!({"schema": {}}),
        json!({"id": 3, "schema": {}}),
        json!({"id": "x", "schema": {}, "derivations": "price * qty"}),
        json!({"id": "x", "schema": {}, "derivations": [{"path": "$.a"}]}),
        json!({"id": "x", "schema": {}, "derivations": [{"path": "$.a", "expr": 3}]}),
        json!({"id": "x", "schema": {}, "derivations": null}),
        json!({"id": "x", "schema": {}, "metaDerivations": [{"path": "$.a", "property": "maximum"}]}),
        json!({"id": "x", "schema": {}, "constraints": [{"id": "c", "expr": "x", "policy": "flag", "path": 3}]}),
        json!({"id": "x", "schema": {}, "constraints": [{"id": "c", "expr": "x", "policy": "flag", "message": null}]}),
        json!({"id": "x", "schema": {}, "library": 3}),
        json!({"id": "x", "schema": {}, "library": {"description": "no define"}}),
        json!({"id": "x", "schema": {}, "library": {"define": "a", "extends": null}}),
        json!({"id": "x", "schema": {}, "effects": [{"id": "e"}]}),
        json!({"id": "x", "schema": {}, "effects": [{"id": "e", "trigger": "t", "response": {"set": []}}]}),
        json!({"id": "x", "schema": {}, "tests": [{"given": {}}]}),
        json!({"id": "x", "schema": {}, "template": {}}),
    ];
    for (i, s) in bad.iter().enumerate() {
        assert!(parse_spec(s).is_err(), "bad spec {i} parses: {s}");
        assert!(!v.is_valid(s), "bad spec {i} passes the schema: {s}");
    }
    // Stricter than the deserializer, as the validator is: these parse but are errors.
    let invalid = [
        json!({"id": "x", "schema": 3}),
        json!({"id": "x", "schema": {}, "constraints": [{"id": "c", "expr": "x"}]}),
        json!({"id": "x", "schema": {}, "constraints": [{"id": "c", "expr": "x", "policy": "warn"}]}),
        json!({"id": "x", "schema": {}, "derivations": [{"path": "$.a", "expr": "1", "evaluation": "soon"}]}),
        json!({"id": "x", "schema": {}, "metaDerivations": [{"path": "$.a", "property": "colour", "expr": "1"}]}),
    ];
    let limits = EngineLimits::default();
    for (i, s) in invalid.iter().enumerate() {
        assert!(parse_spec(s).is_ok(), "invalid spec {i} does not parse");
        assert!(
            !validate_json(s, &limits).valid,
            "invalid spec {i} validates"
        );
        assert!(!v.is_valid(s), "invalid spec {i} passes the schema: {s}");
    }
}

#[test]
fn evolutions_validate() {
    let v = validator(&spec_evolution_schema());
    let good = [
        json!({}),
        json!({"newLibrary": null}),
        json!({"newVersion": "1.1.0", "expectedVersion": "1.0.0",
            "upsertDerivations": [{"path": "$.vat", "expr": "total * 0.2"}],
            "removeDerivations": ["$.old"],
            "upsertConstraints": [{"id": "c1", "expr": "qty > 0", "message": "m", "policy": "flag"}],
            "removeConstraints": ["c0"],
            "upsertEffects": [{"id": "e", "executor": "caller", "trigger": "qty > 5", "emit": "big"}],
            "removeEffects": ["e0"],
            "upsertMetaDerivations": [{"path": "$.qty", "property": "maximum", "expr": 10}],
            "removeMetaDerivations": ["$.qty#minimum"],
            "upsertDefaultValues": [{"path": "$.items[*]", "expr": "{ \"qty\": 1 }"}],
            "removeDefaultValues": ["$.customer"],
            "upsertSchemaDefs": {"money": {"type": "number"}},
            "removeSchemaDefs": ["old"],
            "upsertSchemaNodes": [{"path": "$.vat", "schema": {"type": "number"}, "required": false},
                {"path": "$.note", "schema": {"type": "string"}}],
            "removeSchemaNodes": ["$.legacy"],
            "newDefaultView": "main",
            "upsertViews": [{"id": "main", "components": []}],
            "removeViews": ["old"],
            "upsertComponents": [{"viewId": "main", "component": {"id": "c", "type": "label"},
                "parentId": "g", "beforeId": null}],
            "removeComponents": [{"viewId": "main", "componentId": "x"}],
            "upsertConstants": {"rate": 0.25},
            "removeConstants": ["oldRate"],
            "backfill": {"$.vat": 0}}),
        json!({"newVersion": "2.0.0",
            "newSchema": {"type": "object", "properties": {"a": {"type": "number"}}},
            "newViewDefinition": {"views": []},
            "newConstants": {},
            "newLibrary": {"define": "( $money := function($n){ $round($n,2) }; [\"money\"] )"},
            "newTests": [{"description": "vat", "given": {"$.total": 100}, "expect": {"$.vat": 20}}]}),
        json!({"newLibrary": "( $f := function($x){$x}; [\"f\"] )", "newTests": []}),
    ];
    for (i, e) in good.iter().enumerate() {
        parse_evolution(e).unwrap_or_else(|err| panic!("evolution {i}: {err}"));
        assert_valid(&v, e, &format!("evolution {i}"));
    }
    let bad = [
        json!({"upsertDerivations": "$.a = 1"}),
        json!({"upsertDerivations": [{"path": "$.a"}]}),
        json!({"upsertDerivations": [{"expr": "1"}]}),
        json!({"removeDerivations": "$.a"}),
        json!({"newLibrary": 3}),
        json!({"newTests": {"given": {}}}),
        json!({"upsertComponents": [{"component": {}}]}),
        json!({"removeComponents": [{"viewId": "v"}]}),
        json!({"upsertSchemaNodes": [{"path": "$.a", "schema": {}, "required": "yes"}]}),
    ];
    for (i, e) in bad.iter().enumerate() {
        assert!(parse_evolution(e).is_err(), "bad evolution {i} parses: {e}");
        assert!(!v.is_valid(e), "bad evolution {i} passes the schema: {e}");
    }
}

#[test]
fn real_results_validate_against_their_output_schemas() {
    let mutation = validator(&output_schema::<MutationResult>());
    let tests = validator(&output_schema::<TestReport>());
    let report = validator(&output_schema::<Report>());
    let limits = EngineLimits::default();
    for (name, text) in valem_core::examples::ALL {
        let spec = parse_spec_text(text).unwrap();
        let (mut model, created) =
            Model::create(&spec, Timestamp::default(), Default::default()).unwrap();
        assert_valid(&mutation, &created.to_json(true), name);
        if let Ok(r) = model.mutate(&[("$.x".into(), json!(1))], Timestamp::default()) {
            assert_valid(&mutation, &r.to_json(true), name);
            assert_valid(&mutation, &r.to_json(false), name);
        }
        let t = run_tests(&spec, None, Timestamp::default(), &limits).unwrap();
        assert_valid(&tests, &serde_json::to_value(&t).unwrap(), name);
        let rep = validate(&spec, &limits);
        assert_valid(&report, &serde_json::to_value(&rep).unwrap(), name);
    }

    // Every part populated: a flagged constraint, a dispatched effect, traces.
    let spec = parse_spec(&json!({"id": "full", "schema": {"type": "object"},
        "derivations": [{"path": "$.total", "expr": "price * qty"}],
        "metaDerivations": [{"path": "$.qty", "property": "maximum", "expr": 10}],
        "constraints": [{"id": "small", "expr": "qty < 5", "message": "big order", "policy": "flag"}],
        "effects": [{"id": "notify", "executor": "caller", "trigger": "qty > 5", "emit": "big",
            "payload": {"qty": "qty"}, "dedupeKey": "qty", "statusPath": "$.notifyStatus"},
            {"id": "later", "executor": "timer", "trigger": "qty > 5", "afterMs": 1000,
            "response": {"set": {"$.done": "true"}}}],
        "tests": [{"description": "passes", "given": {"$.price": 2, "$.qty": 3},
                "expect": {"$.total": 6, "$.qty": {"$meta": {"maximum": 10}}}},
            {"given": {"$.price": 2, "$.qty": 3}, "expect": {"$.total": 7}}]}))
    .unwrap();
    let (mut model, _) = Model::create(&spec, Timestamp::default(), Default::default()).unwrap();
    let r = model
        .mutate(
            &[("$.price".into(), json!(2)), ("$.qty".into(), json!(6))],
            Timestamp::default(),
        )
        .unwrap();
    assert!(!r.flagged_constraints.is_empty() && !r.dispatched_effects.is_empty());
    let with = r.to_json(true);
    assert!(
        with["traces"].as_array().is_some_and(|t| !t.is_empty()),
        "{with}"
    );
    assert_valid(&mutation, &with, "full, traces");
    assert_valid(&mutation, &r.to_json(false), "full");
    let t = run_tests(&spec, None, Timestamp::default(), &limits).unwrap();
    assert_eq!((t.passed, t.failed), (1, 1));
    assert_valid(&tests, &serde_json::to_value(&t).unwrap(), "full tests");
    let rep = validate_json(
        &json!({"id": "bad id!", "schema": {}, "derivations": [{"path": "x", "expr": "("}],
            "surprise": 1}),
        &limits,
    );
    assert!(
        !rep.errors.is_empty() && !rep.warnings.is_empty(),
        "{rep:?}"
    );
    assert_valid(&report, &serde_json::to_value(&rep).unwrap(), "bad report");

    // The output schemas do constrain.
    assert!(!mutation.is_valid(&json!({"success": "yes"})));
    let mut wrong = r.to_json(true);
    wrong["traces"] = json!([{"targetPath": 1}]);
    assert!(!mutation.is_valid(&wrong));
    assert!(!tests.is_valid(&json!({"total": -1, "passed": 0, "failed": 0, "results": []})));
    assert!(
        !report.is_valid(&json!({"valid": true, "errors": [{"location": "x"}], "warnings": []}))
    );
}
