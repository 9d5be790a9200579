//! Bad input never panics and never changes a model: property tests of the spec parser and
//! validator, the address parser and mutation input, plus the rollback guarantee.

use proptest::prelude::*;
use serde_json::{json, Value};
use valem_core::expr::path::Address;
use valem_core::spec::{parse_spec, parse_spec_text};
use valem_engine::validate::validate_json;
use valem_engine::Timestamp;
use valem_engine::{EngineLimits, Model, MutationError};

const NOW: Timestamp = Timestamp::from_ms(1_700_000_000_000);

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i32>().prop_map(|i| json!(i)),
        (-1e6f64..1e6).prop_map(|f| json!(f)),
        "[a-z$.\\[\\]*0-9 ()+'\"{}:,-]{0,24}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("id".to_string()),
                    Just("schema".to_string()),
                    Just("derivations".to_string()),
                    Just("path".to_string()),
                    Just("expr".to_string()),
                    Just("constraints".to_string()),
                    Just("policy".to_string()),
                    Just("library".to_string()),
                    Just("effects".to_string()),
                    Just("trigger".to_string()),
                    "[a-z]{1,6}".prop_map(|s| s),
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A valid spec with one random part spliced in.
fn spliced_spec() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            Just("derivations"),
            Just("metaDerivations"),
            Just("constraints"),
            Just("effects"),
            Just("library"),
            Just("schema"),
            Just("defaultValues"),
            Just("tests"),
            Just("viewDefinition"),
            Just("constants"),
        ],
        arb_json(),
    )
        .prop_map(|(k, v)| {
            let mut s = json!({"id": "fuzz", "schema": {"type": "object"},
                "derivations": [{"path": "$.t", "expr": "a * b"}]});
            s[k] = v;
            s
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn spec_text_never_panics(text in "\\PC{0,200}") {
        let _ = parse_spec_text(&text);
    }

    #[test]
    fn validator_and_creation_never_panic(spec in spliced_spec()) {
        let report = validate_json(&spec, &EngineLimits::default());
        if let Ok(parsed) = parse_spec(&spec) {
            let created = Model::create(&parsed, NOW, EngineLimits::default());
            // A spec the validator accepts must also compile and create.
            if report.valid {
                prop_assert!(created.is_ok(), "valid spec failed to create: {:?}", created.err());
            }
        }
    }

    #[test]
    fn addresses_never_panic_and_round_trip(text in "[$a-z0-9.\\[\\]*'\" _-]{0,30}") {
        if let Ok(a) = Address::parse(&text) {
            let again = Address::parse(&a.to_string()).expect("canonical form re-parses");
            prop_assert_eq!(a, again);
        }
    }

    #[test]
    fn bad_mutations_are_refused_cleanly(
        key in "[$a-z0-9.\\[\\]*]{0,16}",
        value in arb_json(),
    ) {
        let spec = parse_spec(&json!({
            "id": "m",
            "schema": {"type": "object", "properties": {
                "n": {"type": "number", "maximum": 100},
                "items": {"type": "array", "items": {"type": "object", "properties": {"q": {"type": "integer"}}}},
                "total": {"type": "number", "readOnly": true}
            }},
            "derivations": [
                {"path": "$.total", "expr": "n * 2"},
                {"path": "$.items[*].d", "expr": "$parent.q + 1"}
            ],
            "constraints": [{"id": "small", "expr": "$count(items) < 5", "message": "too many", "policy": "rollback"}]
        }))
        .unwrap();
        let limits = EngineLimits { max_array_index: 1000, ..EngineLimits::default() };
        let (mut m, _) = Model::create(&spec, NOW, limits).unwrap();
        m.mutate(&[("$.n".into(), json!(1))], NOW).unwrap();
        let before = m.state().fingerprint();
        match m.mutate(&[(key, value)], NOW) {
            Ok(_) => {}
            Err(_) => prop_assert_eq!(before, m.state().fingerprint()),
        }
    }
}

#[test]
fn rollback_leaves_state_meta_and_views_byte_identical() {
    let spec = parse_spec(&json!({
        "id": "rb",
        "schema": {"type": "object"},
        "derivations": [
            {"path": "$.items[*].total", "expr": "$parent.price * $parent.qty"},
            {"path": "$.sum", "expr": "$sum(items.total)"},
            {"path": "$.lazy", "expr": "sum * 2", "evaluation": "lazy"}
        ],
        "metaDerivations": [{"path": "$.note", "property": "relevant", "expr": "sum > 10"}],
        "constraints": [
            {"id": "cap", "expr": "sum <= 100", "message": "order too large", "policy": "rollback"},
            {"id": "warn", "expr": "sum < 50", "message": "large order", "policy": "flag"}
        ],
        "effects": [{"id": "big", "executor": "caller", "trigger": "sum > 20", "dedupeKey": "sum", "emit": "big-order", "payload": {"sum": "sum"}}]
    }))
    .unwrap();
    let (mut m, _) = Model::create(&spec, NOW, EngineLimits::default()).unwrap();
    let ok = m
        .mutate(
            &[(
                "$.items".into(),
                json!([{"price": 5, "qty": 2}, {"price": 7, "qty": 3}]),
            )],
            NOW,
        )
        .unwrap();
    assert_eq!(ok.dispatched_effects.len(), 1, "{ok:?}");
    let printed = m.merged_json(NOW).to_string();
    // A subscriber's view: the committed state as a cheap persistent clone.
    let view = m.state().clone();
    let fingerprint = m.state().fingerprint();

    let err = m
        .mutate(
            &[
                ("$.items[1].qty".into(), json!(30)),
                ("$.note".into(), json!("x")),
            ],
            NOW,
        )
        .unwrap_err();
    match &err {
        MutationError::Constraint { violations, traces } => {
            assert_eq!(violations.len(), 1);
            assert_eq!(violations[0].constraint_id, "cap");
            assert_eq!(violations[0].policy, "rollback");
            assert!(traces.iter().any(
                |t| &*t.target_path == "$constraint:cap" && t.constraint_passed == Some(false)
            ));
        }
        other => panic!("expected a constraint violation, got {other:?}"),
    }
    assert_eq!(err.to_json()["error"], "Constraint violation");
    assert_eq!(m.state().fingerprint(), fingerprint);
    assert_eq!(
        view.fingerprint(),
        fingerprint,
        "a held view must not see the rolled-back cycle"
    );
    assert_eq!(m.merged_json(NOW).to_string(), printed);

    // Flag commits and reports; the effect re-fires only when its dedupe key changes.
    let flagged = m
        .mutate(&[("$.items[1].qty".into(), json!(6))], NOW)
        .unwrap();
    assert_eq!(flagged.flagged_constraints.len(), 1);
    assert_eq!(flagged.flagged_constraints[0].constraint_id, "warn");
    assert_eq!(
        flagged.dispatched_effects[0].payload.as_ref().unwrap()["sum"],
        json!(52)
    );
    let same = m
        .mutate(&[("$.note".into(), json!("unchanged sum"))], NOW)
        .unwrap();
    assert!(same.dispatched_effects.is_empty());
}

#[test]
fn schema_violations_are_structured_and_complete() {
    let spec = parse_spec(&json!({
        "id": "sv",
        "schema": {"type": "object", "properties": {
            "age": {"type": "integer", "minimum": 0},
            "name": {"type": "string"},
            "total": {"type": "number", "readOnly": true},
            "addr": {"$ref": "#/$defs/Address"}
        }, "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
        "derivations": [{"path": "$.total", "expr": "age * 2"}],
        "metaDerivations": [{"path": "$.age", "property": "maximum", "expr": "120"}]
    }))
    .unwrap();
    let (mut m, _) = Model::create(&spec, NOW, EngineLimits::default()).unwrap();
    let before = m.state().fingerprint();
    let err = m
        .mutate(
            &[
                ("$.age".into(), json!(-1)),
                ("$.name".into(), json!(3)),
                ("$.total".into(), json!(1)),
                ("$.addr.zip".into(), json!("abc")),
            ],
            NOW,
        )
        .unwrap_err();
    let MutationError::Schema(v) = &err else {
        panic!("{err:?}")
    };
    let got: Vec<(&str, &str)> = v
        .iter()
        .map(|x| (x.path.as_str(), x.keyword.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("$.age", "minimum"),
            ("$.name", "type"),
            ("$.total", "readOnly"),
            ("$.addr.zip", "pattern")
        ]
    );
    assert_eq!(m.state().fingerprint(), before);
    // The live meta maximum (120) is enforced on the next mutation.
    let err = m.mutate(&[("$.age".into(), json!(121))], NOW).unwrap_err();
    let MutationError::Schema(v) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(v[0].keyword, "maximum");
    assert_eq!(err.to_json()["error"], "Schema violation");
}

#[test]
fn in_place_undo_restores_wide_documents_exactly() {
    let derivations: Vec<Value> = (0..60)
        .map(|i| json!({"path": format!("$.t{i}"), "expr": format!("a{i} * 2")}))
        .collect();
    let spec = parse_spec(&json!({"id": "wide", "schema": {"type": "object"},
        "derivations": derivations,
        "constraints": [{"id": "cap", "expr": "$not(t5 > 100)", "message": "t5 too big", "policy": "rollback"}]}))
    .unwrap();
    let limits = EngineLimits {
        max_array_index: 10,
        ..EngineLimits::default()
    };
    let (mut m, _) = Model::create(&spec, NOW, limits).unwrap();
    let seed: Vec<(String, Value)> = (0..60).map(|i| (format!("$.a{i}"), json!(i))).collect();
    m.mutate(&seed, NOW).unwrap();
    let printed = m.merged_json(NOW).to_string();
    let fingerprint = m.state().fingerprint();
    // Refused by a constraint after many writes, new keys and a new array.
    let e = m.mutate(
        &[
            ("$.a1".into(), json!(7)),
            ("$.fresh".into(), json!(1)),
            ("$.list[2]".into(), json!("x")),
            ("$.a5".into(), json!(99)),
        ],
        NOW,
    );
    assert!(matches!(e, Err(MutationError::Constraint { .. })), "{e:?}");
    assert_eq!(m.state().fingerprint(), fingerprint);
    assert_eq!(
        m.merged_json(NOW).to_string(),
        printed,
        "values and key order restored"
    );
    // Refused half-way through applying the writes (index beyond the limit).
    let e = m.mutate(
        &[
            ("$.a2".into(), json!(8)),
            ("$.new".into(), json!(2)),
            ("$.list[50]".into(), json!(1)),
        ],
        NOW,
    );
    assert!(matches!(e, Err(MutationError::Invalid(_))), "{e:?}");
    assert_eq!(m.state().fingerprint(), fingerprint);
    assert_eq!(m.merged_json(NOW).to_string(), printed);
    // And the model still works afterwards, appending new keys after the old ones.
    m.mutate(&[("$.zz".into(), json!(1))], NOW).unwrap();
    let keys: Vec<String> = m
        .merged_json(NOW)
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(keys.first().map(String::as_str), Some("a0"));
    assert!(keys.iter().position(|k| k == "zz") > keys.iter().position(|k| k == "a59"));
}

/// An address and the value written there nest at most `MAX_DEPTH` levels together: a scalar
/// at an address of more segments than that is refused too, before the schema is asked (it was
/// accepted, and the document
/// nested as deep as the address, past what a stored checkpoint parses back), and a value far
/// deeper than the limit is refused before schema validation walks it (a recursive schema
/// recursed as deep as the value went and overflowed the thread's stack).
#[test]
fn writes_nest_at_most_max_depth_levels_with_their_address() {
    use valem_core::value::{json_deeper_than, MAX_DEPTH};
    let spec = parse_spec(&json!({
        "id": "deep", "schema": {
            "type": "object",
            "properties": {"t": {"$ref": "#/$defs/node"}},
            "$defs": {"node": {"type": "object", "properties": {"c": {"$ref": "#/$defs/node"}}}}
        }
    }))
    .unwrap();
    let (mut m, _) = Model::create(&spec, NOW, EngineLimits::default()).unwrap();
    let at = |segments: usize| format!("$.t{}", ".c".repeat(segments - 1));
    let before = m.state().fingerprint();
    for (segments, value) in [(MAX_DEPTH + 1, json!(1)), (MAX_DEPTH, json!({}))] {
        let e = m.mutate(&[(at(segments), value)], NOW);
        assert!(matches!(e, Err(MutationError::Invalid(_))), "{e:?}");
        assert_eq!(m.state().fingerprint(), before);
    }
    m.mutate(&[(at(MAX_DEPTH - 1), json!({}))], NOW).unwrap();
    m.mutate(&[(at(MAX_DEPTH - 2), json!({"c": {}}))], NOW)
        .unwrap();
    assert!(!json_deeper_than(&m.merged_json(NOW), MAX_DEPTH));

    // 5,000 levels, on a thread of the daemon's stack size; the value is taken apart
    // iteratively afterwards (serde_json's own drop recurses).
    let refused = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            let (mut m, _) = Model::create(&spec, NOW, EngineLimits::default()).unwrap();
            let mut v = json!(1);
            for _ in 0..5_000 {
                let mut o = serde_json::Map::new();
                o.insert("c".into(), v);
                v = Value::Object(o);
            }
            let writes = vec![("$.t".to_string(), v)];
            let before = m.state().fingerprint();
            let e = m.mutate(&writes, NOW);
            let refused =
                matches!(e, Err(MutationError::Invalid(_))) && m.state().fingerprint() == before;
            let mut stack: Vec<Value> = writes.into_iter().map(|(_, v)| v).collect();
            while let Some(v) = stack.pop() {
                if let Value::Object(o) = v {
                    stack.extend(o.into_iter().map(|(_, x)| x));
                }
            }
            refused
        })
        .unwrap()
        .join()
        .unwrap();
    assert!(refused);
}

/// The document is an object whatever the schema: a write of anything else at `$`, or of an
/// element of the root, is refused (with a schema of `{}` both were accepted, the model's state
/// became `5` or `[1]`, its derived members were gone and its own snapshot could not be
/// restored).
#[test]
fn the_document_stays_an_object_under_a_schema_that_allows_anything() {
    let spec = parse_spec(&json!({"id": "root", "schema": {},
        "derivations": [{"path": "$.d", "expr": "a + 1"}]}))
    .unwrap();
    let (mut m, _) = Model::create(&spec, NOW, EngineLimits::default()).unwrap();
    m.mutate(&[("$".into(), json!({"a": 1}))], NOW).unwrap();
    let before = m.state().fingerprint();
    for (at, value) in [
        ("$", json!(5)),
        ("$", json!([1, 2])),
        ("$", Value::Null),
        ("$[0]", json!(1)),
        ("$[0].a", json!(1)),
    ] {
        let e = m.mutate(&[(at.into(), value)], NOW);
        assert!(
            matches!(&e, Err(MutationError::Invalid(m)) if m.contains("object")),
            "{at}: {e:?}"
        );
        assert_eq!(m.state().fingerprint(), before);
    }
    assert_eq!(m.merged_json(NOW), json!({"a": 1, "d": 2}));
}
