//! Differential tests of the JIT tier against the interpreter: random expressions of the
//! arithmetic subset, written as JSONata source, over random inputs (0, -0, huge, tiny,
//! missing, non-numbers). What the engine would store must be the same bit for bit whether the
//! compiled code answered (scalar or batched) or, after a guard failure or a non-finite value,
//! the interpreter did; and the IR interpreter must agree with the compiled code exactly.

use std::sync::atomic::{AtomicUsize, Ordering};
use valem_engine::Timestamp;

use proptest::prelude::*;
use serde_json::{json, Map, Value as Json};
use valem_core::expr::{from_jvalue, to_jvalue, Compiled, Env, Limits, Value as JValue};
use valem_core::value::Val;
use valem_engine::jit::{read_doc_slots, slot_inputs, type_error, Read};
use valem_jit::codegen::{CodeSet, Shapes};
use valem_jit::interp;
use valem_jit::ir::{self, Ty};

const VARS: [&str; 4] = ["a", "b", "c", "d"];

fn constants() -> Map<String, Json> {
    let Json::Object(m) = json!({"k": 1.5, "big": 1e300, "name": "x"}) else {
        unreachable!()
    };
    m
}

fn num_literal() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("1".to_string()),
        Just("2".to_string()),
        Just("0.5".to_string()),
        Just("2.675".to_string()),
        Just("1e308".to_string()),
        Just("1e-300".to_string()),
        Just("3".to_string()),
        Just("$const.k".to_string()),
        Just("$const.big".to_string()),
        (-1000i32..1000).prop_map(|n| format!("{}", f64::from(n) / 8.0)),
    ]
}

fn num_expr() -> BoxedStrategy<String> {
    let leaf = prop_oneof![
        3 => prop::sample::select(VARS.to_vec()).prop_map(str::to_string),
        1 => Just("$.a".to_string()),
        2 => num_literal(),
    ];
    leaf.prop_recursive(5, 40, 4, |inner| {
        let boolean = bool_of(inner.clone());
        prop_oneof![
            (
                inner.clone(),
                prop::sample::select(vec!["+", "-", "*", "/", "%"]),
                inner.clone()
            )
                .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
            inner.clone().prop_map(|a| format!("-({a})")),
            (
                prop::sample::select(vec!["abs", "floor", "ceil", "sqrt"]),
                inner.clone()
            )
                .prop_map(|(f, a)| format!("${f}({a})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("$power({a}, {b})")),
            (inner.clone(), -3i32..6).prop_map(|(a, p)| format!("$round({a}, {p})")),
            inner.clone().prop_map(|a| format!("$round({a})")),
            (
                prop::sample::select(vec!["max", "min"]),
                prop::collection::vec(inner.clone(), 1..4)
            )
                .prop_map(|(f, v)| format!("${f}([{}])", v.join(", "))),
            (boolean, inner.clone(), inner.clone())
                .prop_map(|(c, a, b)| format!("({c} ? {a} : {b})")),
        ]
    })
    .boxed()
}

fn bool_of(num: impl Strategy<Value = String> + Clone + 'static) -> impl Strategy<Value = String> {
    let cmp = (
        num.clone(),
        prop::sample::select(vec!["=", "!=", "<", "<=", ">", ">="]),
        num,
    )
        .prop_map(|(a, op, b)| format!("({a} {op} {b})"));
    cmp.prop_recursive(2, 8, 2, |inner| {
        (
            inner.clone(),
            prop::sample::select(vec!["and", "or"]),
            inner,
        )
            .prop_map(|(a, op, b)| format!("({a} {op} {b})"))
    })
}

fn expr() -> impl Strategy<Value = String> {
    prop_oneof![4 => num_expr(), 1 => bool_of(num_expr())]
}

/// One input value: mostly numbers (including the awkward ones), sometimes missing or not a
/// number.
fn input() -> impl Strategy<Value = Option<Json>> {
    prop_oneof![
        6 => prop_oneof![
            Just(0.0),
            Just(-0.0),
            Just(1.0),
            Just(-1.0),
            Just(0.5),
            Just(2.5),
            Just(1e308),
            Just(-1e308),
            Just(5e-324),
            Just(2.675),
            (-1e6f64..1e6),
            prop::num::f64::NORMAL,
        ]
        .prop_map(|x| Some(json!(x))),
        1 => Just(None),
        1 => prop_oneof![
            Just(json!("7")),
            Just(Json::Null),
            Just(json!(true)),
            Just(json!([1])),
            Just(json!({"x": 1})),
        ]
        .prop_map(Some),
    ]
}

fn doc(values: &[Option<Json>]) -> Json {
    let mut m = Map::new();
    for (k, v) in VARS.iter().zip(values) {
        if let Some(v) = v {
            m.insert((*k).to_string(), v.clone());
        }
    }
    Json::Object(m)
}

/// What the engine stores for an interpreted evaluation: the value, or `null` for undefined
/// and errors. Numbers keep their bits here (before `Val::num` normalises -0), so the
/// comparison is strict.
#[derive(Debug, Clone, PartialEq)]
enum Out {
    Bits(u64),
    Other(Val),
    /// JSONata's undefined (stored as null).
    Undefined,
    /// An evaluation error (stored as null, its message in the trace).
    Error(String),
}

fn interpreted(c: &Compiled, env: &Env, d: &Json) -> Out {
    match c.eval(&to_jvalue(&Val::from_json(d)), env, &Limits::default()) {
        Ok(Some(JValue::Number(n))) if n.is_finite() => Out::Bits(n.to_bits()),
        Ok(Some(v)) => Out::Other(
            from_jvalue(&v, valem_core::value::MAX_DEPTH, &Limits::default())
                .expect("a small result"),
        ),
        Ok(None) => Out::Undefined,
        Err(e) => Out::Error(e.message),
    }
}

fn compiled_out(ty: Ty, x: f64) -> Out {
    match ty {
        Ty::Num => Out::Bits(x.to_bits()),
        Ty::Bool => Out::Other(Val::Bool(x != 0.0)),
    }
}

static JIT_ANSWERS: AtomicUsize = AtomicUsize::new(0);
static FALLBACKS: AtomicUsize = AtomicUsize::new(0);
static UNDEFINED: AtomicUsize = AtomicUsize::new(0);
static TYPE_ERRORS: AtomicUsize = AtomicUsize::new(0);

fn check(text: &str, rows: &[Vec<Option<Json>>]) -> Result<(), TestCaseError> {
    let limits = Limits::default();
    let c = Compiled::compile(text, &limits).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
    let consts = constants();
    let env = Env {
        vars: vec![(
            "const".into(),
            to_jvalue(&Val::from_json(&Json::Object(consts.clone()))),
        )],
        now_ms: None,
    };
    let p = ir::lower(c.ast(), &|n| consts.get(n).and_then(Json::as_f64))
        .map_err(|r| TestCaseError::fail(format!("{text}: not lowered: {r}")))?;
    let code = CodeSet::compile(&[(&p, Shapes::BOTH)])
        .map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
    let inputs = slot_inputs(&p);

    let mut cols: Vec<Vec<f64>> = vec![Vec::new(); inputs.len()];
    let mut guarded: Vec<(usize, Out)> = Vec::new();
    let mut slots = Vec::new();
    for (r, values) in rows.iter().enumerate() {
        let d = doc(values);
        let want = interpreted(&c, &env, &d);
        let v = Val::from_json(&d);
        // What the tier answers without the compiled code (`None` inside: the interpreter
        // answers, the same by construction).
        let without_code = match read_doc_slots(&inputs, &v, &mut slots) {
            Read::Numbers => None,
            Read::Other => Some(None),
            // Null, a boolean or a string: one operation's type error, as the interpreter
            // words it.
            Read::NotNumbers(not_numbers) => Some(type_error(&p, not_numbers).map(|e| {
                TYPE_ERRORS.fetch_add(1, Ordering::Relaxed);
                Out::Error(e.message)
            })),
            // A missing input: undefined where only arithmetic lies between it and the
            // result.
            Read::Undefined => Some(match interp::eval_undefined(&p, &slots) {
                Some(None) => {
                    UNDEFINED.fetch_add(1, Ordering::Relaxed);
                    Some(Out::Undefined)
                }
                Some(Some(x)) => Some(compiled_out(p.ty, x.to_f64())),
                None => None,
            }),
        };
        if let Some(answer) = without_code {
            match answer {
                Some(got) => prop_assert_eq!(&got, &want, "{}: inputs {:?}", text, values),
                None => {
                    FALLBACKS.fetch_add(1, Ordering::Relaxed);
                }
            }
            continue;
        }
        let reference = interp::eval(&p, &slots).map(|x| x.to_f64());
        let jit = code.call(0, &slots);
        prop_assert_eq!(
            jit.map(f64::to_bits),
            reference.map(f64::to_bits),
            "{}: JIT and IR interpreter differ on {:?}",
            text,
            slots
        );
        let got = match jit {
            Some(x) => {
                JIT_ANSWERS.fetch_add(1, Ordering::Relaxed);
                compiled_out(p.ty, x)
            }
            None => {
                FALLBACKS.fetch_add(1, Ordering::Relaxed);
                want.clone()
            }
        };
        prop_assert_eq!(&got, &want, "{}: inputs {:?}", text, values);
        for (s, col) in cols.iter_mut().enumerate() {
            col.push(slots[s]);
        }
        guarded.push((r, want));
    }
    // The same rows through the batched entry.
    let n = guarded.len();
    let mut out = vec![0.0; n];
    let mut ok = vec![0u8; n];
    let views: Vec<&[f64]> = cols.iter().map(Vec::as_slice).collect();
    code.call_batch(0, &views, &mut out, &mut ok)
        .ok_or_else(|| TestCaseError::fail("no batched entry"))?;
    for (i, (r, want)) in guarded.iter().enumerate() {
        if ok[i] == 1 {
            prop_assert_eq!(
                &compiled_out(p.ty, out[i]),
                want,
                "{}: batched row {}",
                text,
                r
            );
        } else {
            let scalar = code.call(0, &views.iter().map(|c| c[i]).collect::<Vec<_>>());
            prop_assert!(
                scalar.is_none(),
                "{}: batch fell back where scalar did not",
                text
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn jit_plus_fallback_equals_the_interpreter(
        text in expr(),
        rows in prop::collection::vec(prop::collection::vec(input(), 4), 1..8),
    ) {
        check(&text, &rows)?;
    }
}

#[test]
fn the_differential_test_is_not_vacuous() {
    // Fixed cases, so the counters below say something whatever proptest drew.
    let rows: Vec<Vec<Option<Json>>> = vec![
        vec![
            Some(json!(2)),
            Some(json!(3)),
            Some(json!(0)),
            Some(json!(-0.0)),
        ],
        vec![
            Some(json!(1e308)),
            Some(json!(10)),
            Some(json!(5e-324)),
            Some(json!(2.675)),
        ],
        vec![None, Some(json!(1)), Some(json!("x")), Some(json!(1))],
        vec![None, Some(json!(2)), Some(json!(4)), Some(json!(0.5))],
        vec![Some(json!(3)), None, Some(json!(1)), None],
    ];
    for text in [
        "a * b",
        "(a - b) / c",
        "$round(d, 2)",
        "c = 0 ? 0 : a / c",
        "$max([a, b, c]) + $min([d, -d])",
        "$power(a, b) % 7",
        "a > b and c <= d",
        "$sqrt(a - b)",
        "-(c)",
    ] {
        check(text, &rows).unwrap_or_else(|e| panic!("{text}: {e}"));
    }
    assert!(JIT_ANSWERS.load(Ordering::Relaxed) > 10);
    assert!(FALLBACKS.load(Ordering::Relaxed) > 5);
    assert!(UNDEFINED.load(Ordering::Relaxed) > 5);
}

/// One operation over a null, a boolean or a string is JSONata's T2001 (left side) or T2002
/// (right side) error without the interpreter, in the interpreter's words, the left side
/// checked first and an undefined side not at all; anything more is left to the interpreter.
#[test]
fn one_operation_over_a_non_number_is_the_interpreters_type_error() {
    let non_numbers = [json!(null), json!(true), json!("7")];
    let mut rows: Vec<Vec<Option<Json>>> = Vec::new();
    for x in &non_numbers {
        for other in [Some(json!(2)), None, Some(json!(false))] {
            rows.push(vec![Some(x.clone()), other.clone(), None, None]);
            rows.push(vec![other.clone(), Some(x.clone()), None, None]);
        }
    }
    let before = TYPE_ERRORS.load(Ordering::Relaxed);
    for op in ["+", "-", "*", "/", "%"] {
        for text in [
            format!("a {op} b"),
            format!("a {op} 2"),
            format!("3 {op} b"),
            format!("$const.k {op} a"),
        ] {
            check(&text, &rows).unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }
    // 5 operations × (a OP b: 18 rows, each with a non-number on a side; a OP 2 and 3 OP b and
    // k OP a: the 9 rows with one in `a`, resp. `b`, `a`).
    assert!(
        TYPE_ERRORS.load(Ordering::Relaxed) - before >= 5 * (18 + 9 + 9 + 9),
        "{}",
        TYPE_ERRORS.load(Ordering::Relaxed) - before
    );
    // Nested operations are the interpreter's (which operation fails first is its business).
    assert_eq!(type_error(&lowered("(a + b) * c"), 0b001), None);
    // The left side first: both sides not numbers is T2001.
    let p = lowered("a - b");
    let e = type_error(&p, 0b11).expect("an error");
    assert_eq!(e.code.as_deref(), Some("T2001"), "{e:?}");
    let e = type_error(&p, 0b10).expect("an error");
    assert_eq!(e.code.as_deref(), Some("T2002"), "{e:?}");
    assert!(e.message.contains("right side of the - operator"), "{e:?}");
}

#[test]
fn the_traps_of_the_issue() {
    let c = |text: &str, d: Json| -> (Option<f64>, Out) {
        let limits = Limits::default();
        let comp = Compiled::compile(text, &limits).unwrap();
        let p = ir::lower(comp.ast(), &|_| None).unwrap();
        let code = CodeSet::compile(&[(&p, Shapes::SCALAR)]).unwrap();
        let inputs = slot_inputs(&p);
        let v = Val::from_json(&d);
        let mut slots = Vec::new();
        let jit = match read_doc_slots(&inputs, &v, &mut slots) {
            Read::Numbers => code.call(0, &slots),
            _ => None,
        };
        (jit, interpreted(&comp, &Env::default(), &d))
    };
    // $round is half-to-even on the decimal representation, compiled and interpreted.
    assert_eq!(
        c("$round(x, 2)", json!({"x": 2.675})),
        (Some(2.68), Out::Bits(2.68f64.to_bits()))
    );
    assert_eq!(
        c("$round(x, 2)", json!({"x": 0.125})),
        (Some(0.12), Out::Bits(0.12f64.to_bits()))
    );
    // 1/0 alone is Infinity, stored as null: the JIT declines and the interpreter answers.
    assert_eq!(
        c("x / y", json!({"x": 1, "y": 0})),
        (None, Out::Other(Val::Null))
    );
    // Infinity as an operand is D1001 (null stored); the JIT declines.
    assert_eq!(c("x * 1e308 * 10 - 1", json!({"x": 10})).0, None);
    // $power to a non-finite value (D3061) and $sqrt of a negative (D3060): declined.
    let (j, i) = c("$power(x, 1000)", json!({"x": 10}));
    assert!(
        j.is_none() && matches!(&i, Out::Error(m) if m.contains("D3061")),
        "{i:?}"
    );
    let (j, i) = c("$sqrt(x)", json!({"x": -1}));
    assert!(
        j.is_none() && matches!(&i, Out::Error(m) if m.contains("D3060")),
        "{i:?}"
    );
    // A missing input is undefined (null stored), not 0, computed so without the
    // interpreter; a string is not a number.
    assert_eq!(c("x + 1", json!({})), (None, Out::Undefined));
    let missing = |text: &str, d: Json| {
        let p = lowered(text);
        let mut slots = Vec::new();
        let inputs = slot_inputs(&p);
        assert_eq!(
            read_doc_slots(&inputs, &Val::from_json(&d), &mut slots),
            Read::Undefined
        );
        interp::eval_undefined(&p, &slots)
    };
    assert_eq!(
        missing("-(x * y) / 0 + $round(z, 2)", json!({"y": 2, "z": 1})),
        Some(None)
    );
    // Infinity beside undefined is D1001 (the interpreter's), a comparison is not undefined.
    assert_eq!(missing("y / 0 * x", json!({"y": 2})), None);
    assert_eq!(missing("x > 1 ? 1 : 2", json!({})), None);
    assert_eq!(c("x + 1", json!({"x": "1"})).0, None);
    // -0 is stored as 0 either way; max(-0, +0) follows the interpreter's scan.
    let (j, i) = c("-x", json!({"x": 0}));
    assert_eq!(
        (j.map(f64::to_bits), i),
        (Some((-0.0f64).to_bits()), Out::Bits((-0.0f64).to_bits()))
    );
    assert_eq!(Val::num(-0.0), Val::num(0.0));
    let (j, i) = c("$max([-x, x])", json!({"x": 0}));
    assert_eq!(j.map(|x| Out::Bits(x.to_bits())), Some(i));
}

/// A model of `spec`, created at time 0 with the default limits.
/// The IR of `text` (no constants).
fn lowered(text: &str) -> ir::Program {
    ir::lower(
        Compiled::compile(text, &Limits::default()).unwrap().ast(),
        &|_| None,
    )
    .unwrap()
}

fn model(spec: Json) -> valem_engine::Model {
    let spec = valem_core::spec::parse_spec(&spec).expect("spec");
    let (m, _) = valem_engine::Model::create(
        &spec,
        Timestamp::default(),
        valem_engine::EngineLimits::default(),
    )
    .expect("creates");
    m
}

/// The tier in the engine: after the first run the code is requested, and once it is ready
/// the traces say the values came from it: scalar derivations, and `[*]` derivations through
/// the batched entry; a non-number input goes back to the interpreter for that instance only.
#[test]
fn the_engine_answers_from_compiled_code_once_it_is_hot() {
    let mut m = model(json!({
        "id": "jit-engine",
        "schema": {"type": "object"},
        "derivations": [
            {"path": "$.total", "expr": "$round(price * qty * 1.075, 2)"},
            {"path": "$.big", "expr": "total > 30"},
            {"path": "$.items[*].line", "expr": "$parent.price * $parent.qty"},
        ]
    }));
    // Code is requested from the first run.
    m.limits.jit.tier_after = 0;
    let items: Vec<Json> = (0..40).map(|i| json!({"price": i, "qty": 2})).collect();
    m.mutate(
        &[
            ("$.price".to_string(), json!(10)),
            ("$.qty".to_string(), json!(3)),
            ("$.items".to_string(), json!(items)),
        ],
        Timestamp::default(),
    )
    .expect("initial values");
    let items_write: Vec<(String, Json)> = (0..40)
        .map(|i| (format!("$.items[{i}].qty"), json!(3)))
        .collect();
    m.mutate(&[("$.price".to_string(), json!(11))], Timestamp::default())
        .expect("mutates");
    m.mutate(&items_write, Timestamp::default())
        .expect("mutates");
    assert!(valem_engine::jit::flush(std::time::Duration::from_secs(10)));
    let mut writes = items_write.clone();
    for w in &mut writes {
        w.1 = json!(4);
    }
    writes[5].1 = json!("four"); // this instance: the interpreter (T2002 → null)
    writes.push(("$.price".to_string(), json!(12)));
    let r = m.mutate(&writes, Timestamp::default()).expect("mutates");
    let trace = |path: &str| {
        r.traces
            .iter()
            .find(|t| &*t.target_path == path)
            .unwrap_or_else(|| panic!("no trace of {path}"))
    };
    assert!(trace("$.total").jit, "{:?}", trace("$.total"));
    assert!(trace("$.big").jit);
    assert!(trace("$.items[0].line").jit);
    assert!(!trace("$.items[5].line").jit);
    let doc = m.merged_json(Timestamp::default());
    assert_eq!(doc["total"], json!(38.7)); // 12 * 3 * 1.075 = 38.7
    assert_eq!(doc["big"], json!(true));
    assert_eq!(doc["items"][7]["line"], json!(28));
    assert_eq!(doc["items"][5]["line"], Json::Null);
    // With the tier off, the same answers from the interpreter.
    m.limits.jit.enabled = false;
    let r = m
        .mutate(&[("$.qty".to_string(), json!(4))], Timestamp::default())
        .expect("mutates");
    assert!(r.traces.iter().all(|t| !t.jit));
    assert_eq!(m.merged_json(Timestamp::default())["total"], json!(51.6));
}

/// An arithmetic derivation whose input is not a number goes to the interpreter, which must
/// see the inputs the expression reads (its projection is made only then): `"abc" * 2 + 1` is
/// JSONata's T2001, where an input it did not see would be undefined and no error at all. The
/// same holds after the code is ready, and for a shaped twin of the derivation. (`"abc" * 2`
/// alone is the same error, answered by the tier without the interpreter.)
#[test]
fn a_fallback_sees_what_the_expression_reads() {
    let mut m = model(json!({
        "id": "fallback-input",
        "schema": {"type": "object"},
        "derivations": [
            {"path": "$.total", "expr": "price * qty"},
            {"path": "$.total_b", "expr": "price_b * qty_b"},
            {"path": "$.total_c", "expr": "price * qty + 1"},
            {"path": "$.total_d", "expr": "price_b * qty_b + 1"},
        ]
    }));
    for round in 0..3 {
        let r = m
            .mutate(
                &[
                    ("$.price".to_string(), json!("abc")),
                    ("$.qty".to_string(), json!(2 + round)),
                    ("$.price_b".to_string(), json!("abc")),
                    ("$.qty_b".to_string(), json!(2 + round)),
                ],
                Timestamp::default(),
            )
            .expect("mutates");
        for target in ["$.total", "$.total_b", "$.total_c", "$.total_d"] {
            let t = r
                .traces
                .iter()
                .find(|t| &*t.target_path == target)
                .unwrap_or_else(|| panic!("no trace of {target}"));
            let err = t.error_message.as_deref().unwrap_or("");
            assert!(err.contains("T2001"), "round {round} {target}: {t:?}");
        }
        valem_engine::jit::flush(std::time::Duration::from_secs(10));
    }
}

/// A chain created over an empty document: `f_0 = seed + 1` is undefined (stored as null), so
/// every `f_i = f_{i-1} + 1` after it is T2001, which the tier answers itself; a string and a
/// boolean input are T2001 and T2002. Every trace (value and error message) and the document
/// are what the interpreter alone gives, at creation and after the seed is written.
#[test]
fn a_chain_over_an_empty_document_errs_as_the_interpreter_does() {
    let mut derivations = vec![json!({"path": "$.f_0", "expr": "seed + 1"})];
    for i in 1..300 {
        derivations.push(json!({"path": format!("$.f_{i}"), "expr": format!("f_{} + 1", i - 1)}));
    }
    derivations.push(json!({"path": "$.g", "expr": "name - 1"}));
    derivations.push(json!({"path": "$.h", "expr": "3 / flag"}));
    let spec = valem_core::spec::parse_spec(&json!({
        "id": "chain-errors",
        "schema": {"type": "object"},
        "derivations": derivations,
    }))
    .expect("spec");
    type Seen = Vec<(String, Json, Option<String>)>;
    let seen = |r: &valem_engine::MutationResult| -> Seen {
        let mut v: Seen = r
            .traces
            .iter()
            .map(|t| {
                (
                    t.target_path.to_string(),
                    t.result.to_json(),
                    t.error_message,
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let run = |tier: bool| {
        let limits = valem_engine::EngineLimits {
            jit: valem_engine::JitConfig {
                enabled: tier,
                ..Default::default()
            },
            ..Default::default()
        };
        let (mut m, created) =
            valem_engine::Model::create(&spec, Timestamp::default(), limits).expect("creates");
        let written = m
            .mutate(
                &[
                    ("$.name".to_string(), json!("x")),
                    ("$.flag".to_string(), json!(true)),
                ],
                Timestamp::default(),
            )
            .expect("mutates");
        let seeded = m
            .mutate(&[("$.seed".to_string(), json!(1))], Timestamp::default())
            .expect("mutates");
        (
            seen(&created),
            seen(&written),
            seen(&seeded),
            m.merged_json(Timestamp::default()),
        )
    };
    let (tier, interpreter) = (run(true), run(false));
    assert_eq!(tier, interpreter);
    let errors = |s: &Seen, code: &str| {
        s.iter()
            .filter(|t| t.2.as_deref().is_some_and(|e| e.contains(code)))
            .count()
    };
    // Created: f_1 .. f_299 over a null (f_0 and the others are undefined, not errors).
    assert_eq!(errors(&tier.0, "T2001"), 299, "{:?}", &tier.0[..3]);
    // A string on the left, a boolean on the right.
    assert_eq!((errors(&tier.1, "T2001"), errors(&tier.1, "T2002")), (1, 1));
    assert_eq!(tier.3["f_299"], json!(301));
}
