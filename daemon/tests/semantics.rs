//! The reference semantics the engine must keep, one behaviour per test: defaults, lazy
//! derivations, evaluation contexts of meta and scoped constraints, library, pinned clock,
//! undefined and error results, effects.

use serde_json::{json, Value};
use valem_core::expr::path::Address;
use valem_core::spec::{parse_spec, MetaProp};
use valem_engine::Timestamp;
use valem_engine::{EngineLimits, Model, MutationError};

const NOW: Timestamp = Timestamp::from_ms(1_700_000_000_000);

/// A result's derived paths as plain strings, for comparisons.
fn strs(v: &valem_engine::Paths) -> Vec<&str> {
    v.iter().collect()
}

fn model(spec: Value) -> Model {
    let spec = parse_spec(&spec).unwrap();
    Model::create(&spec, NOW, EngineLimits::default())
        .unwrap()
        .0
}

fn set(m: &mut Model, pairs: &[(&str, Value)]) -> valem_engine::MutationResult {
    let muts: Vec<(String, Value)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    m.mutate(&muts, NOW).unwrap()
}

fn get(m: &mut Model, path: &str) -> Value {
    let segs = Address::parse(path).unwrap().concrete().unwrap();
    m.get(&segs, NOW).unwrap_or(Value::Null)
}

#[test]
fn defaults_fill_new_elements_and_seed_the_root() {
    let mut m = model(json!({
        "id": "d",
        "schema": {"type": "object", "properties": {"currency": {"type": "string", "default": "EUR"}}},
        "defaultValues": [
            {"path": "$", "expr": "{\"items\": [], \"discount\": 0}"},
            {"path": "$.items[*]", "expr": "{\"status\": \"pending\", \"qty\": 1, \"lineNo\": $count($parent), \"label\": $self.name & '!'}"}
        ]
    }));
    assert_eq!(
        m.merged_json(NOW),
        json!({"items": [], "discount": 0, "currency": "EUR"})
    );
    let r = set(
        &mut m,
        &[
            ("$.items[0].name", json!("bolt")),
            ("$.items[0].qty", json!(5)),
        ],
    );
    assert_eq!(
        get(&mut m, "$.items[0]"),
        json!({"name": "bolt", "qty": 5, "status": "pending", "lineNo": 1, "label": "bolt!"})
    );
    assert!(
        r.mutated_paths.contains("$.items[0].status"),
        "{:?}",
        r.mutated_paths
    );
    // Whole-container replacement does not fire per-child rules.
    set(&mut m, &[("$.items", json!([{"name": "nut"}]))]);
    assert_eq!(get(&mut m, "$.items[0]"), json!({"name": "nut"}));
}

/// The shape of a reference spec: a `$` rule seeds part of `q`, and a rollback constraint reads
/// a field of `q` the seed leaves absent (`undefined = null` is false in JSONata).
fn partial_seed_spec() -> Value {
    json!({
        "id": "seed",
        "schema": {"type": "object"},
        "defaultValues": [{"path": "$", "expr": "{\"q\": {\"other\": 1}}"}],
        "derivations": [{"path": "$.d", "expr": "q.other + 1"}],
        "constraints": [{"id": "c-pos", "expr": "q.c = null or q.c > 0",
                         "message": "c must be positive", "policy": "rollback"}],
        "tests": [
            {"description": "seeded", "given": {}, "expect": {"$.q": {"other": 1}, "$.d": 2}},
            {"description": "c written", "given": {"$.q.c": 3}, "expect": {"$.q.c": 3, "$.d": 2}}
        ]
    })
}

#[test]
fn creation_marks_only_the_addresses_the_defaults_filled() {
    // As the reference's default applier: the seed is written leaf by leaf and propagation
    // starts from those leaves, so the constraint over the absent `q.c` is not evaluated.
    let spec = parse_spec(&partial_seed_spec()).unwrap();
    let (mut m, r) = Model::create(&spec, NOW, EngineLimits::default()).unwrap();
    assert_eq!(
        r.mutated_paths.iter().collect::<Vec<_>>(),
        vec!["$.q.other"]
    );
    assert!(
        r.traces
            .iter()
            .all(|t| t.target_path.to_string() != "$constraint:c-pos"),
        "{:?}",
        r.traces
    );
    assert_eq!(m.merged_json(NOW), json!({"q": {"other": 1}, "d": 2}));
    // The same rule as an ordinary write of a sibling: no check.
    set(&mut m, &[("$.q.other", json!(5))]);
    // Writing the field runs it.
    let e = m.mutate(&[("$.q.c".into(), json!(-1))], NOW).unwrap_err();
    assert!(matches!(e, MutationError::Constraint { .. }), "{e:?}");
    set(&mut m, &[("$.q.c", json!(2))]);
    // Its embedded tests pass (each case creates the model first).
    let report =
        valem_engine::testrun::run_tests(&spec, None, NOW, &EngineLimits::default()).unwrap();
    assert_eq!(
        (report.passed, report.failed),
        (2, 0),
        "{:?}",
        report.results
    );
}

#[test]
fn defaults_write_leaves_skip_nulls_and_fill_nulls() {
    let mut m = model(json!({
        "id": "leaves",
        "schema": {"type": "object"},
        "defaultValues": [
            {"path": "$", "expr": "{\"a\": null, \"b\": {\"c\": null}, \"e\": {}, \"list\": [1, 2]}"},
            {"path": "$.items[*]", "expr": "{\"qty\": 1, \"dims\": {\"w\": 2, \"h\": 3}, \"note\": null}"}
        ],
        "constraints": [{"id": "depth", "expr": "items.dims.d > 0",
                         "message": "depth must be positive", "policy": "rollback"}]
    }));
    // Nulls are no default (nothing written), an empty object and an array are leaves.
    assert_eq!(m.merged_json(NOW), json!({"e": {}, "list": [1, 2]}));
    // A new element: its defaults are leaves too, so the constraint over the absent
    // `dims.d` is not reached; a field the caller left null is filled.
    let r = set(
        &mut m,
        &[
            ("$.items[0].name", json!("bolt")),
            ("$.items[0].qty", Value::Null),
        ],
    );
    assert_eq!(
        r.mutated_paths.iter().collect::<Vec<_>>(),
        vec![
            "$.items[0].name",
            "$.items[0].qty",
            "$.items[0].qty",
            "$.items[0].dims.w",
            "$.items[0].dims.h"
        ]
    );
    assert_eq!(
        get(&mut m, "$.items[0]"),
        json!({"name": "bolt", "qty": 1, "dims": {"w": 2, "h": 3}})
    );
    let e = m
        .mutate(&[("$.items[0].dims.d".into(), json!(0))], NOW)
        .unwrap_err();
    assert!(matches!(e, MutationError::Constraint { .. }), "{e:?}");
}

#[test]
fn schema_defaults_fill_nested_fields_as_the_reference_does() {
    let mut m = model(json!({
        "id": "sd",
        "schema": {"type": "object", "properties": {
            "rate": {"type": "number", "default": 0.2},
            "none": {"type": "number", "default": null},
            "opts": {"type": "object", "properties": {
                "deep": {"type": "object", "properties": {"flag": {"type": "boolean", "default": true}}}
            }},
            "own": {"type": "object", "default": {"x": 1}, "properties": {"y": {"default": 2}}},
            "total": {"type": "number", "default": 7},
            "kept": {"type": "string", "default": "schema"}
        }},
        "defaultValues": [{"path": "$", "expr": "{\"kept\": \"rule\"}"}],
        "derivations": [{"path": "$.total", "expr": "rate * 10"}],
        "constraints": [{"id": "other", "expr": "opts.deep.other = null or opts.deep.other > 0",
                         "message": "other must be positive", "policy": "rollback"}]
    }));
    // The objects on the way to a nested default are created; a property with its own default
    // is not descended into; a null default and a derivation's target are not seeded; the `$`
    // rule goes first and wins.
    assert_eq!(
        m.merged_json(NOW),
        json!({"kept": "rule", "rate": 0.2, "opts": {"deep": {"flag": true}}, "own": {"x": 1}, "total": 2})
    );
    assert_eq!(get(&mut m, "$.none"), Value::Null);
}

#[test]
fn a_created_container_does_not_check_scoped_constraints_on_absent_fields() {
    let mut m = model(json!({"id": "scoped", "schema": {},
        "constraints": [{"id": "c-pos", "path": "$.q.c", "expr": "$ > 0",
                         "message": "c must be positive", "policy": "rollback"}]}));
    // Writing `$.q.other` creates `$.q` but writes nothing the constraint reads.
    set(&mut m, &[("$.q.other", json!(1))]);
    let e = m.mutate(&[("$.q.c".into(), json!(0))], NOW).unwrap_err();
    assert!(matches!(e, MutationError::Constraint { .. }), "{e:?}");
    // Replacing the container reaches it (its field is now absent).
    let e = m
        .mutate(&[("$.q".into(), json!({"other": 2}))], NOW)
        .unwrap_err();
    assert!(matches!(e, MutationError::Constraint { .. }), "{e:?}");
    set(&mut m, &[("$.q", json!({"c": 4}))]);
}

#[test]
fn creation_checks_no_constraint_nothing_seeded_reaches() {
    // The reference computes every eager derivation at creation but checks only the
    // constraints downstream of what was seeded: here nothing is.
    let mut m = model(json!({"id": "k", "schema": {},
        "derivations": [{"path": "$.k", "expr": "5"}],
        "constraints": [{"id": "big", "expr": "k > 10", "message": "k too small", "policy": "rollback"}]}));
    assert_eq!(get(&mut m, "$.k"), json!(5));
}

#[test]
fn lazy_derivations_run_on_read_only() {
    let mut m = model(json!({"id": "l", "schema": {},
    "derivations": [
        {"path": "$.double", "expr": "n * 2"},
        {"path": "$.report", "expr": "'n is ' & $string(double)", "evaluation": "lazy"}
    ]}));
    let r = set(&mut m, &[("$.n", json!(4))]);
    let evaluated: Vec<String> = r.traces.iter().map(|t| t.target_path.to_string()).collect();
    assert_eq!(evaluated, vec!["$.double"]);
    assert!(!m.state().lazy_stale.is_empty());
    assert_eq!(get(&mut m, "$.report"), json!("n is 8"));
    assert!(m.state().lazy_stale.is_empty());
}

#[test]
fn lazy_read_by_a_constraint_is_evaluated_in_the_cycle() {
    let mut m = model(json!({"id": "l2", "schema": {},
        "derivations": [{"path": "$.total", "expr": "n * 10", "evaluation": "lazy"}],
        "constraints": [{"id": "cap", "expr": "total < 100", "message": "too big", "policy": "rollback"}]}));
    set(&mut m, &[("$.n", json!(5))]);
    let e = m.mutate(&[("$.n".into(), json!(50))], NOW).unwrap_err();
    assert!(matches!(e, MutationError::Constraint { .. }), "{e:?}");
    assert_eq!(get(&mut m, "$.total"), json!(50));
}

#[test]
fn element_meta_and_scoped_constraints_see_the_value_as_context() {
    let mut m = model(json!({"id": "c", "schema": {},
    "metaDerivations": [
        {"path": "$.items[*].discount", "property": "maximum", "expr": "price * 0.5"},
        {"path": "$.items[*].note", "property": "relevant", "expr": "$parent.price > 100"}
    ],
    "constraints": [
        {"id": "pos", "path": "$.price", "expr": "$ > 0", "message": "price must be positive", "policy": "rollback"},
        {"id": "line", "path": "$.items[*]", "expr": "qty >= 1", "message": "each line needs a quantity", "policy": "flag"},
        {"id": "both", "path": ["$.a", "$.b"], "expr": "$ != 0", "message": "a and b are non-zero", "policy": "flag"}
    ]}));
    set(
        &mut m,
        &[(
            "$.items",
            json!([{"price": 40, "qty": 1}, {"price": 300, "qty": 0}]),
        )],
    );
    let seg = |p: &str| Address::parse(p).unwrap().concrete().unwrap();
    assert_eq!(
        m.meta_value(&seg("$.items[1].discount"), MetaProp::Maximum),
        Some(json!(150))
    );
    assert_eq!(
        m.meta_value(&seg("$.items[0].note"), MetaProp::Relevant),
        Some(json!(false))
    );
    assert_eq!(
        m.meta_value(&seg("$.items[1].note"), MetaProp::Relevant),
        Some(json!(true))
    );
    let r = set(
        &mut m,
        &[
            ("$.items[1].qty", json!(0)),
            ("$.a", json!(1)),
            ("$.b", json!(0)),
        ],
    );
    let flagged: Vec<&str> = r
        .flagged_constraints
        .iter()
        .map(|f| f.constraint_id.as_str())
        .collect();
    assert_eq!(flagged, vec!["line", "both"]);
    let e = m.mutate(&[("$.price".into(), json!(-1))], NOW).unwrap_err();
    let MutationError::Constraint { violations, .. } = e else {
        panic!()
    };
    assert_eq!(violations[0].message, "price must be positive");
    // The live meta maximum is enforced on the next write to that element.
    let e = m
        .mutate(&[("$.items[0].discount".into(), json!(25))], NOW)
        .unwrap_err();
    assert!(
        matches!(e, MutationError::Schema(ref v) if v[0].keyword == "maximum"),
        "{e:?}"
    );
    // Removing elements removes their meta.
    set(&mut m, &[("$.items", json!([{"price": 10, "qty": 1}]))]);
    assert_eq!(
        m.meta_value(&seg("$.items[1].discount"), MetaProp::Maximum),
        None
    );
}

#[test]
fn library_constants_and_pinned_clock() {
    let mut m = model(json!({"id": "lib", "schema": {},
    "constants": {"vat": 0.25},
    "library": {"define": "( $money := function($n) { $round($n, 2) }; $gross := function($net) { $money($net * (1 + $const.vat)) }; [\"money\", \"gross\"] )"},
    "derivations": [
        {"path": "$.gross", "expr": "$gross(net)"},
        {"path": "$.stamp", "expr": "$now()"},
        {"path": "$.ms", "expr": "$millis() + net * 0"}
    ]}));
    set(&mut m, &[("$.net", json!(10.01))]);
    assert_eq!(get(&mut m, "$.gross"), json!(12.51));
    assert_eq!(get(&mut m, "$.stamp"), json!("2023-11-14T22:13:20.000Z"));
    assert_eq!(get(&mut m, "$.ms"), json!(NOW.ms()));
}

#[test]
fn undefined_and_errors_store_null_with_a_trace() {
    let mut m = model(json!({"id": "u", "schema": {},
    "derivations": [
        {"path": "$.missing", "expr": "nothing.here"},
        {"path": "$.bad", "expr": "name + 1"}
    ]}));
    let r = set(&mut m, &[("$.name", json!("x"))]);
    assert_eq!(get(&mut m, "$.missing"), Value::Null);
    assert_eq!(get(&mut m, "$.bad"), Value::Null);
    let t = r
        .traces
        .iter()
        .find(|t| &*t.target_path == "$.bad")
        .unwrap();
    assert!(
        t.error_message.as_deref().unwrap().contains("T2001"),
        "{t:?}"
    );
}

#[test]
fn derived_fields_and_read_only_schema_fields_refuse_writes() {
    let mut m = model(json!({"id": "ro",
        "schema": {"type": "object", "properties": {"fixed": {"type": "number", "readOnly": true}}},
        "derivations": [{"path": "$.items[*].total", "expr": "$parent.p * 2"}]}));
    set(&mut m, &[("$.items", json!([{"p": 1}]))]);
    for path in ["$.items[0].total", "$.fixed"] {
        let e = m.mutate(&[(path.into(), json!(1))], NOW).unwrap_err();
        let MutationError::Schema(v) = e else {
            panic!("{path}")
        };
        assert_eq!(
            (v[0].path.as_str(), v[0].keyword.as_str()),
            (path, "readOnly")
        );
    }
}

#[test]
fn levels_see_prior_levels_and_chains_settle_in_one_cycle() {
    let mut m = model(json!({"id": "lv", "schema": {},
    "derivations": [
        {"path": "$.monthlyPayment", "expr": "loanAmount * monthlyRate * factor / (factor - 1)"},
        {"path": "$.factor", "expr": "$power(1 + monthlyRate, termMonths)"},
        {"path": "$.monthlyRate", "expr": "annualRatePercent / 1200"}
    ]}));
    let r = set(
        &mut m,
        &[
            ("$.loanAmount", json!(20000)),
            ("$.annualRatePercent", json!(6)),
            ("$.termMonths", json!(60)),
        ],
    );
    let p = get(&mut m, "$.monthlyPayment").as_f64().unwrap();
    assert!((p - 386.656).abs() < 0.01, "{p}");
    assert_eq!(
        strs(&r.derived_updated),
        vec!["$.monthlyRate", "$.factor", "$.monthlyPayment"]
    );
}

#[test]
fn effects_fire_on_edges_with_payloads() {
    let mut m = model(json!({"id": "fx", "schema": {},
    "derivations": [{"path": "$.priority", "expr": "score > 80"}],
    "effects": [
        {"id": "alert", "executor": "caller", "trigger": "priority = true", "dedupeKey": "ticket", "emit": "priority-alert", "payload": {"score": "$string(score)", "ticket": "ticket"}},
        {"id": "expire", "executor": "timer", "trigger": "priority", "afterMs": "900000", "response": {"set": {"$.state": "'expired'"}}}
    ]}));
    let r = set(
        &mut m,
        &[("$.score", json!(90)), ("$.ticket", json!("T-1"))],
    );
    let ids: Vec<&str> = r
        .dispatched_effects
        .iter()
        .map(|e| e.effect_id.as_str())
        .collect();
    assert_eq!(ids, vec!["alert", "expire"]);
    assert_eq!(
        r.dispatched_effects[0].emit.as_deref(),
        Some("priority-alert")
    );
    assert_eq!(
        r.dispatched_effects[0].payload.as_ref().unwrap()["score"],
        json!("90")
    );
    assert_eq!(r.dispatched_effects[1].after_ms, Some(json!(900000)));
    // Same dedupe key: the caller effect does not fire again.
    let r = set(&mut m, &[("$.score", json!(95))]);
    assert!(r.dispatched_effects.iter().all(|e| e.effect_id != "alert"));
    let r = set(&mut m, &[("$.ticket", json!("T-2"))]);
    assert!(r.dispatched_effects.iter().any(|e| e.effect_id == "alert"));
}

#[test]
fn initial_state_and_actions_are_rejected_with_a_pointer() {
    let report = valem_engine::validate::validate_json(
        &json!({"id": "old", "schema": {}, "initialState": {"$.a": 1}, "actions": [{"id": "x"}]}),
        &EngineLimits::default(),
    );
    assert!(!report.valid);
    assert!(report
        .errors
        .iter()
        .any(|e| e.location == "initialState" && e.message.contains("defaultValues")));
    assert!(report
        .errors
        .iter()
        .any(|e| e.location == "actions" && e.message.contains("caller")));
}

#[test]
fn whole_element_reads_are_not_cycles_and_read_only_containers_protect_children() {
    let mut m = model(json!({"id": "pe",
        "schema": {"type": "object", "properties": {"locked": {"type": "object", "readOnly": true}}},
        "library": "( $double := function($e) { $e.a * 2 }; [\"double\"] )",
        "derivations": [{"path": "$.items[*].d", "expr": "$double($parent)"}],
        "metaDerivations": [{"path": "$.items", "property": "readOnly", "expr": "frozen = true"}]}));
    set(&mut m, &[("$.items", json!([{"a": 1}, {"a": 4}]))]);
    assert_eq!(
        get(&mut m, "$.items"),
        json!([{"a": 1, "d": 2}, {"a": 4, "d": 8}])
    );
    let r = set(&mut m, &[("$.items[1].a", json!(5))]);
    assert_eq!(strs(&r.derived_updated), vec!["$.items[1].d"]);
    set(&mut m, &[("$.frozen", json!(true))]);
    for path in ["$.items[0].a", "$.locked.x"] {
        let e = m.mutate(&[(path.into(), json!(1))], NOW).unwrap_err();
        assert!(
            matches!(&e, MutationError::Schema(v) if v[0].keyword == "readOnly"),
            "{path}: {e:?}"
        );
    }
    // A true self-reference is still a cycle.
    let spec = parse_spec(&json!({"id": "self", "schema": {},
        "derivations": [{"path": "$.items[*].d", "expr": "$parent.d + 1"}]}))
    .unwrap();
    assert!(Model::create(&spec, NOW, EngineLimits::default()).is_err());
}
