//! Fuzz targets (issue 30): proptest with generated deep and wide inputs for the value
//! conversion (`value.rs`), RFC 8785 canonical JSON (`store/chain.rs`), the mutation path
//! (`Model::mutate`, JSON Patch through the service) and the expression compiler (`expr/`).
//! Each target asserts properties of what it gets back, not only that nothing panicked.
//!
//! Bounded: every target has a fixed case count (the set runs in about half a minute in a
//! debug build on two cores), a per-case timeout, a shrink time limit and a time budget past
//! which it tries no new case ([`out_of_time`]). The cases run in a forked child (what the
//! timeout needs), so a case that aborts the process — a stack overflow — is reported with its
//! input like any failure, and lands in `fuzz.proptest-regressions` to be tried first next
//! time. `VALEM_FUZZ_CASES=N` runs N cases of every target instead, for a longer local run.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use valem_engine::Timestamp;

use indexmap::IndexMap;
use proptest::prelude::*;
use serde_json::{json, Map, Number, Value};
use valem_core::expr::{self, Compiled, Limits, Phase};
use valem_core::spec::parse_spec;
use valem_core::value::{json_deeper_than, member_hash, ObjMap, Seg, Val, MAX_DEPTH};
use valem_engine::{parse_writes, EngineLimits, Model};
use valem_service::{ModelService, ServiceLimits};
use valem_store::{canonical, record_hash};

// ---------------------------------------------------------------------------------------------
// Bounds and helpers

/// A target's configuration: `cases` unless `VALEM_FUZZ_CASES` says otherwise; each case in a
/// forked child with a timeout, shrinking bounded.
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("VALEM_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        // A case takes well under a second; a minute means it hangs.
        timeout: 60_000,
        max_shrink_time: 60_000,
        ..ProptestConfig::default()
    }
}

/// Whether this target has run out of time: a safety net for a slow machine (the case counts
/// end every target in seconds). A target's cases run in one forked child, so the clock starts
/// with its first case. `VALEM_FUZZ_SECS` sets the budget (default 120 s; none when
/// `VALEM_FUZZ_CASES` asks for a longer run).
fn out_of_time() -> bool {
    static BUDGET: OnceLock<(Instant, Option<Duration>)> = OnceLock::new();
    let (start, budget) = BUDGET.get_or_init(|| {
        let secs = std::env::var("VALEM_FUZZ_SECS")
            .ok()
            .and_then(|v| v.parse().ok());
        let unbounded = std::env::var_os("VALEM_FUZZ_CASES").is_some();
        let budget = match (secs, unbounded) {
            (Some(s), _) => Some(s),
            (None, true) => None,
            (None, false) => Some(120),
        };
        (Instant::now(), budget.map(Duration::from_secs))
    });
    budget.is_some_and(|b| start.elapsed() > b)
}

/// The daemon's threads run on the default 2 MiB stack.
const DAEMON_STACK: usize = 2 << 20;

/// Run `f` on a thread of its own with `stack` bytes of stack; a panic there is re-raised.
fn on_thread<R: Send + 'static>(stack: usize, f: impl FnOnce() -> R + Send + 'static) -> R {
    std::thread::Builder::new()
        .stack_size(stack)
        .spawn(f)
        .expect("a test thread starts")
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// Levels of arrays and objects within one another (a scalar is 0), without recursion.
fn depth(j: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(j, 0usize)];
    while let Some((v, d)) = stack.pop() {
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
        deepest = deepest.max(d + usize::from(v.is_array() || v.is_object()));
    }
    deepest
}

/// Drop a value of any depth without recursing (serde_json's own drop recurses).
fn dismantle(j: Value) {
    let mut stack = vec![j];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(a) => stack.extend(a),
            Value::Object(o) => stack.extend(o.into_iter().map(|(_, x)| x)),
            _ => {}
        }
    }
}

/// `levels` containers around `inner`: objects under `key`, arrays holding it at the end, or
/// alternating, with `siblings` scalars beside it at every level.
fn nest(inner: Value, levels: usize, kind: u8, key: &str, siblings: usize) -> Value {
    let mut v = inner;
    for level in 0..levels {
        let array = match kind % 3 {
            0 => false,
            1 => true,
            _ => level % 2 == 0,
        };
        v = if array {
            let mut a: Vec<Value> = (0..siblings).map(|i| json!(i)).collect();
            a.push(v);
            Value::Array(a)
        } else {
            let mut m = Map::new();
            for i in 0..siblings {
                m.insert(format!("s{i}"), json!(i));
            }
            m.insert(key.to_string(), v);
            Value::Object(m)
        };
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Generated JSON: numbers at the edges, keys of every kind, deep and wide values

fn edge_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => prop_oneof![
            Just(json!(0)),
            Just(json!(-0.0)),
            Just(json!(0.0)),
            Just(json!(1e308)),
            Just(json!(-1e308)),
            Just(json!(f64::MAX)),
            Just(json!(f64::MIN_POSITIVE)),
            Just(json!(5e-324)),
            Just(json!(9_007_199_254_740_991u64)),
            Just(json!(9_007_199_254_740_992u64)),
            Just(json!(9_007_199_254_740_993u64)),
            Just(json!(-9_007_199_254_740_993i64)),
            Just(json!(9_007_199_254_740_992.0)),
            Just(json!(-9_007_199_254_740_991.0)),
            Just(json!(u64::MAX)),
            Just(json!(i64::MIN)),
            Just(json!(1e21)),
            Just(json!(1e-7)),
            Just(json!(333_333_333.333_333_3)),
            Just(json!(0.1)),
            Just(json!(-1.5)),
        ],
        1 => any::<i64>().prop_map(|i| json!(i)),
        1 => any::<u64>().prop_map(|u| json!(u)),
        2 => any::<f64>().prop_filter_map("finite", |f| f.is_finite().then(|| json!(f))),
        1 => (-1000i64..1000).prop_map(|i| json!(i as f64)),
        1 => (-30i32..30, 1u32..1000).prop_map(|(e, m)| json!(f64::from(m) * 10f64.powi(e))),
    ]
}

/// Member names: empty, duplicates but for case, any script, JSON escapes and characters
/// whose UTF-16 order differs from their UTF-8 order, longer than the intern table keeps.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => Just(String::new()),
        4 => "[a-cA-C]{1,2}",
        4 => "[a-z_][a-z0-9_]{0,10}",
        2 => "\\PC{0,6}",
        2 => "[\"\\\\/\\x{0}-\\x{1f}\\x{7f}\\x{80}\\x{2028}\\x{fffd}\\x{ff61}\\x{1F600}\\x{FB33}e\\x{e9}]{1,4}",
        1 => "[a-z]{60,80}",
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z ]{0,12}",
        2 => key(),
        1 => "\\PC{0,40}",
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        4 => edge_number(),
        3 => text().prop_map(Value::String),
    ]
}

/// Small values of every shape, a few levels deep.
fn shallow() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(5, 96, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            proptest::collection::vec((key(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Objects of up to thousands of members (small ones stay vectors, more than 32 make the
/// wide trie).
fn wide() -> impl Strategy<Value = Value> {
    prop_oneof![
        proptest::collection::vec((key(), leaf()), 20..48),
        proptest::collection::vec((key(), leaf()), 0..2500),
    ]
    .prop_map(|kv| Value::Object(kv.into_iter().collect()))
}

/// A value nested around `MAX_DEPTH` levels (and well under, and beyond), built in code.
fn deep() -> impl Strategy<Value = Value> {
    (
        prop_oneof![0usize..20, 85usize..115, 115usize..150],
        0u8..3,
        key(),
        0usize..3,
        shallow(),
    )
        .prop_map(|(levels, kind, k, siblings, inner)| nest(inner, levels, kind, &k, siblings))
}

fn any_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => shallow(),
        2 => deep(),
        1 => wide(),
        1 => (wide(), deep()).prop_map(|(mut w, d)| {
            if let Value::Object(m) = &mut w {
                m.insert("deep".into(), d);
            }
            w
        }),
    ]
}

/// `out` is how a state value prints the number `inp`: the same double (−0 as 0), as an
/// integer when integral within 2^53, as a float otherwise.
fn number_form(inp: &Number, out: &Value) -> Result<(), String> {
    let f = inp.as_f64().ok_or("a number without a double")?;
    let Value::Number(o) = out else {
        return Err(format!("{inp} came back as {out}"));
    };
    let integral = f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0;
    let as_integer = o.is_i64() || o.is_u64();
    if o.as_f64() != Some(f) || integral != as_integer {
        return Err(format!("{inp} came back as {o} (integral: {integral})"));
    }
    Ok(())
}

/// `out` is `inp` as a state value gives it back: the same structure, members in the same
/// order, strings byte for byte, numbers in [`number_form`].
fn same_json(inp: &Value, out: &Value) -> Result<(), String> {
    match (inp, out) {
        (Value::Number(n), o) => number_form(n, o),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            a.iter().zip(b).try_for_each(|(x, y)| same_json(x, y))
        }
        (Value::Object(a), Value::Object(b)) if a.len() == b.len() => {
            a.iter().zip(b).try_for_each(|((ka, x), (kb, y))| {
                if ka != kb {
                    return Err(format!("member {ka:?} came back as {kb:?}"));
                }
                same_json(x, y)
            })
        }
        (a, b) if a == b && !a.is_array() && !a.is_object() => Ok(()),
        (a, b) => Err(format!(
            "{} came back as {}",
            short(&a.to_string()),
            short(&b.to_string())
        )),
    }
}

fn short(s: &str) -> String {
    s.chars().take(120).collect()
}

// ---------------------------------------------------------------------------------------------
// 1. The value parser and conversion (value.rs)

proptest! {
    #![proptest_config(config(96))]

    /// Conversion within a depth accepts exactly the values `json_deeper_than` says fit; a
    /// converted value prints back as it came (numbers in their JSON form) and prints the same
    /// again; equal values compare equal whatever their member order, and a changed one not.
    #[test]
    fn values_convert_within_their_depth_and_round_trip(
        j in any_json(),
        levels in prop_oneof![Just(MAX_DEPTH), 0usize..160],
    ) {
        if out_of_time() {
            return Ok(());
        }
        let d = depth(&j);
        prop_assert_eq!(json_deeper_than(&j, levels), d > levels, "depth {}", d);
        prop_assert_eq!(json_deeper_than(&j, MAX_DEPTH), d > MAX_DEPTH);
        let within = Val::from_json_within(&j, levels);
        prop_assert_eq!(within.is_ok(), !json_deeper_than(&j, levels), "depth {} levels {}", d, levels);
        let at_limit = Val::from_json_within(&j, MAX_DEPTH);
        prop_assert_eq!(at_limit.is_ok(), d <= MAX_DEPTH);

        let v = Val::from_json(&j);
        if let Ok(w) = &within {
            prop_assert!(*w == v);
        }
        let out = v.to_json();
        if let Err(e) = same_json(&j, &out) {
            return Err(TestCaseError::fail(e));
        }
        prop_assert_eq!(depth(&out), d);
        // The printed form is a fixed point.
        let again = Val::from_json(&out);
        prop_assert_eq!(again.to_json().to_string(), out.to_string());
        prop_assert!(again == v);
        // Members in another order: an equal value; one scalar changed: not.
        let reversed = reverse_members(&j);
        prop_assert!(Val::from_json(&reversed) == v);
        if let Some(changed) = change_a_leaf(&j) {
            prop_assert!(Val::from_json(&changed) != v, "{}", short(&changed.to_string()));
        }
    }
}

/// `j` with the members of every object in reverse order.
fn reverse_members(j: &Value) -> Value {
    match j {
        Value::Array(a) => Value::Array(a.iter().map(reverse_members).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .rev()
                .map(|(k, v)| (k.clone(), reverse_members(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// `j` with its first scalar (depth first) replaced by a value no input holds.
fn change_a_leaf(j: &Value) -> Option<Value> {
    fn change(v: &mut Value) -> bool {
        match v {
            Value::Array(a) => a.first_mut().is_some_and(change),
            Value::Object(o) => o.values_mut().next().is_some_and(change),
            leaf => {
                *leaf = json!("a value no generator makes \u{1}");
                true
            }
        }
    }
    let mut out = j.clone();
    change(&mut out).then_some(out)
}

proptest! {
    #![proptest_config(config(24))]

    /// Values thousands of levels deep, built in code (a parser would stop at 128): the depth
    /// test answers on a 256 KiB stack (it does not recurse), and a conversion within
    /// `MAX_DEPTH` refuses them on the daemon's stack (its recursion stops at the limit; 100
    /// levels of it need more than 256 KiB in a debug build).
    #[test]
    fn very_deep_values_are_measured_without_recursion(
        levels in 1_000usize..20_000,
        kind in 0u8..3,
        siblings in 0usize..3,
        extra in 0usize..4,
    ) {
        if out_of_time() {
            return Ok(());
        }
        let (measured, j) = on_thread(256 << 10, move || {
            let j = nest(json!([1, {"x": null}]), levels, kind, "k", siblings);
            let d = levels + 2;
            let measured = (
                json_deeper_than(&j, MAX_DEPTH),
                json_deeper_than(&j, d),
                json_deeper_than(&j, d - 1),
                json_deeper_than(&j, d + extra),
            );
            (measured, j)
        });
        let converted = on_thread(DAEMON_STACK, move || {
            let converted = (
                Val::from_json_within(&j, MAX_DEPTH).is_ok(),
                Val::from_json_within(&j, 0).is_ok(),
            );
            dismantle(j);
            converted
        });
        prop_assert_eq!(measured, (true, false, true, false));
        prop_assert_eq!(converted, (false, false));
    }
}

#[derive(Clone, Debug)]
enum MapOp {
    /// Insert (or replace) the key at this index of the pool.
    Insert(usize, i64),
    Remove(usize),
    /// Keep a clone of the map and of the model as they are now.
    Snapshot,
}

fn map_op() -> impl Strategy<Value = MapOp> {
    prop_oneof![
        // Integers a double holds exactly: the map prints them back as integers.
        30 => (any::<usize>(), -(1i64 << 53)..(1i64 << 53)).prop_map(|(k, v)| MapOp::Insert(k, v)),
        15 => any::<usize>().prop_map(MapOp::Remove),
        1 => Just(MapOp::Snapshot),
    ]
}

/// The model's members as a JSON object, in its order.
fn model_json(m: &IndexMap<String, i64>) -> Value {
    Value::Object(m.iter().map(|(k, v)| (k.clone(), json!(v))).collect())
}

/// `m` holds exactly `model`'s members, in its order, found by name and by hash.
fn check_map(m: &ObjMap, model: &IndexMap<String, i64>) -> Result<(), TestCaseError> {
    prop_assert_eq!(m.len(), model.len());
    let keys: Vec<(String, Option<f64>)> =
        m.iter().map(|(k, v)| (k.to_string(), v.as_f64())).collect();
    let want: Vec<(String, Option<f64>)> = model
        .iter()
        .map(|(k, v)| (k.clone(), Some(*v as f64)))
        .collect();
    prop_assert_eq!(keys, want);
    for (k, v) in model {
        let want = Val::num(*v as f64);
        prop_assert_eq!(m.get(k), Some(&want), "{:?}", k);
        prop_assert_eq!(m.get_hashed(member_hash(k), k), Some(&want), "{:?}", k);
        prop_assert_eq!(m.rank(k).is_some(), true);
    }
    let as_val = Val::Obj(m.clone());
    let built = Val::from_json(&model_json(model));
    prop_assert!(as_val == built);
    prop_assert_eq!(as_val.to_json().to_string(), model_json(model).to_string());
    Ok(())
}

proptest! {
    #![proptest_config(config(24))]

    /// Wide and small objects under inserts, replacements and removals behave as an
    /// insertion-ordered map (a replaced member keeps its place, a removed one re-inserted
    /// goes last), and a clone taken on the way never sees a later change.
    #[test]
    fn object_maps_match_an_ordered_map_and_clones_stay_independent(
        pool in proptest::collection::vec(key(), 1..2500),
        prefill in 0usize..2500,
        built_at_once in any::<bool>(),
        ops in proptest::collection::vec(map_op(), 0..200),
    ) {
        if out_of_time() {
            return Ok(());
        }
        let mut model: IndexMap<String, i64> = IndexMap::new();
        for (i, k) in pool.iter().take(prefill).enumerate() {
            model.entry(k.clone()).or_insert(i as i64);
        }
        let mut m = if built_at_once {
            match Val::from_json(&model_json(&model)) {
                Val::Obj(m) => m,
                other => return Err(TestCaseError::fail(format!("not an object: {other:?}"))),
            }
        } else {
            let mut m = ObjMap::new();
            for (k, v) in &model {
                m.insert(valem_core::value::Key::from(k.as_str()), Val::num(*v as f64));
            }
            m
        };
        check_map(&m, &model)?;
        let mut snapshots = Vec::new();
        for op in &ops {
            match op {
                MapOp::Insert(i, v) => {
                    let k = &pool[i % pool.len()];
                    let old = m.insert(valem_core::value::Key::from(k.as_str()), Val::num(*v as f64));
                    let want = model.insert(k.clone(), *v).map(|o| Val::num(o as f64));
                    prop_assert_eq!(old, want);
                }
                MapOp::Remove(i) => {
                    let k = &pool[i % pool.len()];
                    let old = m.remove(k);
                    let want = model.shift_remove(k).map(|o| Val::num(o as f64));
                    prop_assert_eq!(old, want);
                }
                MapOp::Snapshot => snapshots.push((m.clone(), model.clone())),
            }
        }
        check_map(&m, &model)?;
        for (snap, model) in &snapshots {
            check_map(snap, model)?;
        }
        for absent in ["\u{0}absent", "", "A"] {
            if !model.contains_key(absent) {
                prop_assert!(m.get(absent).is_none());
                prop_assert!(m.get_hashed(member_hash(absent), absent).is_none());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Canonical JSON (store/chain.rs)

/// What ECMAScript's `Number.prototype.toString` prints for `n`'s double.
fn ecmascript(n: &Number) -> String {
    let f = n.as_f64().unwrap_or(f64::NAN);
    ryu_js::Buffer::new().format_finite(f).to_string()
}

/// Every number in `j`.
fn numbers<'a>(j: &'a Value, out: &mut Vec<&'a Number>) {
    match j {
        Value::Number(n) => out.push(n),
        Value::Array(a) => a.iter().for_each(|x| numbers(x, out)),
        Value::Object(o) => o.values().for_each(|x| numbers(x, out)),
        _ => {}
    }
}

/// Whether `a` and `b` are the same JSON value: objects as unordered maps, numbers as doubles.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_value(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, p)| y.get(k).is_some_and(|q| same_value(p, q)))
        }
        (x, y) => x == y,
    }
}

/// Every object's keys in `j` (parsed from canonical text, so in its order) rise strictly by
/// their UTF-16 code units.
fn keys_sorted(j: &Value) -> Result<(), String> {
    match j {
        Value::Array(a) => a.iter().try_for_each(keys_sorted),
        Value::Object(o) => {
            let keys: Vec<&String> = o.keys().collect();
            for w in keys.windows(2) {
                if w[0].encode_utf16().cmp(w[1].encode_utf16()) != std::cmp::Ordering::Less {
                    return Err(format!("{:?} before {:?}", w[0], w[1]));
                }
            }
            o.values().try_for_each(keys_sorted)
        }
        _ => Ok(()),
    }
}

/// `j` with the members of every object in an order drawn from `seed`.
fn shuffled(j: &Value, seed: &mut u64) -> Value {
    match j {
        Value::Array(a) => Value::Array(a.iter().map(|x| shuffled(x, seed)).collect()),
        Value::Object(o) => {
            let mut entries: Vec<(&String, &Value)> = o.iter().collect();
            for i in (1..entries.len()).rev() {
                *seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                entries.swap(i, (*seed >> 33) as usize % (i + 1));
            }
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), shuffled(v, seed)))
                    .collect(),
            )
        }
        other => other.clone(),
    }
}

fn canonical_input() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => shallow(),
        1 => wide(),
        1 => (0usize..100, shallow()).prop_map(|(n, inner)| nest(inner, n, 2, "k", 1)),
        2 => proptest::collection::vec(edge_number(), 0..40).prop_map(Value::Array),
    ]
}

proptest! {
    #![proptest_config(config(128))]

    /// RFC 8785: the canonical text parses back to the same value, every object's keys in
    /// UTF-16 order, every number as ECMAScript prints its double, strings escaped as
    /// `JSON.stringify` escapes them; canonicalising again changes nothing; the record hash
    /// does not depend on member order or on a top-level `hash` member.
    #[test]
    fn canonical_json_is_rfc8785(
        j in canonical_input(),
        seed in any::<u64>(),
        prev in "[0-9a-f]{64}",
    ) {
        if out_of_time() {
            return Ok(());
        }
        let c = canonical(&j);
        let back: Value = match serde_json::from_str(&c) {
            Ok(v) => v,
            Err(e) => return Err(TestCaseError::fail(format!("{e}: {}", short(&c)))),
        };
        prop_assert!(same_value(&back, &j), "{}", short(&c));
        if let Err(e) = keys_sorted(&back) {
            return Err(TestCaseError::fail(e));
        }
        let mut ns = Vec::new();
        numbers(&j, &mut ns);
        for n in ns {
            prop_assert_eq!(canonical(&Value::Number(n.clone())), ecmascript(n), "{}", n);
        }
        if let Value::String(s) = &j {
            prop_assert_eq!(&c, &serde_json::to_string(s).unwrap());
        }
        prop_assert!(!c.contains(['\n', '\r', '\t']));
        prop_assert_eq!(canonical(&back), c.clone(), "not idempotent");

        let mut seed = seed;
        let reordered = shuffled(&j, &mut seed);
        prop_assert_eq!(canonical(&reordered), c.clone());
        let record = json!({"sequence": 7, "prevHash": prev, "body": j});
        let h = record_hash(&prev, &record);
        prop_assert_eq!(record_hash(&prev, &shuffled(&record, &mut seed)), h.clone());
        let mut with_hash = record.clone();
        with_hash["hash"] = json!("anything");
        prop_assert_eq!(record_hash(&prev, &with_hash), h.clone());
        prop_assert_ne!(record_hash(&"0".repeat(64), &record), h);
    }
}

/// RFC 8785 Appendix B's number samples (IEEE-754 bits → text), and §3.2.2.3's examples.
#[test]
fn canonical_numbers_match_rfc8785_appendix_b() {
    let samples: [(u64, &str); 23] = [
        (0x0000_0000_0000_0000, "0"),
        (0x8000_0000_0000_0000, "0"),
        (0x0000_0000_0000_0001, "5e-324"),
        (0x8000_0000_0000_0001, "-5e-324"),
        (0x7fef_ffff_ffff_ffff, "1.7976931348623157e+308"),
        (0xffef_ffff_ffff_ffff, "-1.7976931348623157e+308"),
        (0x4340_0000_0000_0000, "9007199254740992"),
        (0xc340_0000_0000_0000, "-9007199254740992"),
        (0x4430_0000_0000_0000, "295147905179352830000"),
        (0x44b5_2d02_c7e1_4af5, "9.999999999999997e+22"),
        (0x44b5_2d02_c7e1_4af6, "1e+23"),
        (0x44b5_2d02_c7e1_4af7, "1.0000000000000001e+23"),
        (0x444b_1ae4_d6e2_ef4e, "999999999999999700000"),
        (0x444b_1ae4_d6e2_ef4f, "999999999999999900000"),
        (0x444b_1ae4_d6e2_ef50, "1e+21"),
        (0x3eb0_c6f7_a0b5_ed8c, "9.999999999999997e-7"),
        (0x3eb0_c6f7_a0b5_ed8d, "0.000001"),
        (0x41b3_de43_5555_5553, "333333333.3333332"),
        (0x41b3_de43_5555_5554, "333333333.33333325"),
        (0x41b3_de43_5555_5555, "333333333.3333333"),
        (0x41b3_de43_5555_5556, "333333333.3333334"),
        (0x41b3_de43_5555_5557, "333333333.33333343"),
        (0xbecb_f647_612f_3696, "-0.0000033333333333333333"),
    ];
    for (bits, want) in samples {
        let f = f64::from_bits(bits);
        assert_eq!(canonical(&json!(f)), want, "{bits:#018x}");
    }
    assert_eq!(
        canonical(&json!(1_424_953_923_781_206.2)),
        "1424953923781206.2"
    );
    assert_eq!(canonical(&json!(1e21)), "1e+21");
    assert_eq!(canonical(&json!(1e-7)), "1e-7");
    assert_eq!(canonical(&json!(-0.0)), "0");
    // The text the RFC's example holds, parsed as written.
    let parsed: Value = serde_json::from_str("333333333.33333329").unwrap();
    assert_eq!(canonical(&parsed), "333333333.3333333");
    // Integers beyond 2^53 print as their nearest double does.
    assert_eq!(
        canonical(&json!(9_007_199_254_740_993u64)),
        "9007199254740992"
    );
    assert_eq!(
        canonical(&json!(-9_007_199_254_740_993i64)),
        "-9007199254740992"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. The mutation path: Model::mutate and JSON Patch through the service

const NOW: Timestamp = Timestamp::from_ms(1_700_000_000_000);

/// Names only derivations write (a write at or below them is refused as read-only, or may be).
const DERIVED: [&str; 9] = [
    "d_sum", "d_obj", "w", "total", "n_items", "names", "snap", "label", "deep",
];

/// Derivations a generated spec picks from: over plain fields, copies of whole subtrees (one
/// and two levels deeper than what they copy), `[*]` items, a whole-document reader that nests
/// its own last value one level deeper every cycle, and a target three levels down.
fn derivation_pool() -> Vec<Value> {
    vec![
        json!({"path": "$.d_sum", "expr": "f0 + f1"}),
        json!({"path": "$.d_obj", "expr": "obj"}),
        json!({"path": "$.w.wrap", "expr": "{\"in\": obj}"}),
        json!({"path": "$.items[*].total", "expr": "$parent.price * $parent.qty"}),
        json!({"path": "$.n_items", "expr": "$count(items)"}),
        json!({"path": "$.names", "expr": "$keys(obj)"}),
        json!({"path": "$.snap", "expr": "$"}),
        json!({"path": "$.label", "expr": "f0 > 5 ? 'high' : 'low'"}),
        json!({"path": "$.deep.a.b.c", "expr": "t"}),
    ]
}

/// A spec of the derivations in `mask`, over a schema that constrains nothing or one that
/// recurses into a `t` tree (so validation walks a written value as deep as it goes).
fn mutation_spec(id: &str, mask: u16, recursive_schema: bool) -> Value {
    let ds: Vec<Value> = derivation_pool()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, d)| d)
        .collect();
    let schema = if recursive_schema {
        json!({
            "type": "object",
            "properties": {"t": {"$ref": "#/$defs/node"}, "f0": {"type": ["number", "null", "string", "boolean", "object", "array"]}},
            "$defs": {"node": {
                "type": ["object", "array", "number", "string", "boolean", "null"],
                "properties": {"c": {"$ref": "#/$defs/node"}},
                "items": {"$ref": "#/$defs/node"}
            }}
        })
    } else {
        json!({"type": "object"})
    };
    json!({"id": id, "schema": schema, "derivations": ds})
}

const FIELDS: [&str; 16] = [
    "f0", "f1", "obj", "items", "t", "c", "price", "qty", "x", "", "a b", "\u{e9}", "d_sum",
    "total", "snap", "deep",
];

#[derive(Clone, Debug)]
enum ASeg {
    Field(usize),
    Index(usize),
    /// An index no `usize` holds.
    Huge,
    Wild,
}

/// A segment below a member of the root: mostly fields and small indices.
fn aseg() -> impl Strategy<Value = ASeg> {
    prop_oneof![
        12 => (0..FIELDS.len()).prop_map(ASeg::Field),
        6 => (0usize..4).prop_map(ASeg::Index),
        1 => (999usize..1002).prop_map(ASeg::Index),
        1 => Just(ASeg::Huge),
        1 => Just(ASeg::Wild),
    ]
}

fn render_addr(segs: &[ASeg]) -> String {
    let mut s = String::from("$");
    for seg in segs {
        match seg {
            ASeg::Field(i) => {
                let name = FIELDS[*i];
                if name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                {
                    s.push('.');
                    s.push_str(name);
                } else {
                    s.push_str(&format!("['{name}']"));
                }
            }
            ASeg::Index(i) => s.push_str(&format!("[{i}]")),
            ASeg::Huge => s.push_str("[99999999999999999999999]"),
            ASeg::Wild => s.push_str("[*]"),
        }
    }
    s
}

/// Where a written value goes: mostly below a member the spec does not derive (so that many
/// writes are accepted), then anywhere (derived members, the root, root indices, wildcards),
/// around `MAX_DEPTH` segments and beyond the parser's 256, and texts that are no address.
fn address() -> impl Strategy<Value = String> {
    let base_field = (0..FIELDS.len()).prop_filter("a member no derivation writes", |i| {
        !DERIVED.contains(&FIELDS[*i])
    });
    prop_oneof![
        16 => (base_field, proptest::collection::vec(aseg(), 0..3)).prop_map(|(f, mut rest)| {
            rest.insert(0, ASeg::Field(f));
            render_addr(&rest)
        }),
        4 => proptest::collection::vec(aseg(), 0..4).prop_map(|s| render_addr(&s)),
        3 => (proptest::collection::vec(aseg(), 1..3), 94usize..106, any::<bool>())
            .prop_map(|(tail, n, arrays)| deep_addr(n, arrays, &tail)),
        1 => (200usize..270).prop_map(|n| deep_addr(n, false, &[])),
        1 => prop_oneof![
            Just(String::new()),
            Just("f0".to_string()),
            Just("$..f0".to_string()),
            Just("$[".to_string()),
            Just("$.0".to_string()),
            Just("$.items[*".to_string()),
            Just("$['x]".to_string()),
            Just("  $.f0  ".to_string()),
            Just("$.items.0.price".to_string()),
            "\\PC{0,12}",
        ],
    ]
}

/// An address of `n` segments under `$.t`: `.c` members (or `[0]` indices), then `tail`.
fn deep_addr(n: usize, arrays: bool, tail: &[ASeg]) -> String {
    let step = if arrays { "[0]" } else { ".c" };
    let head = n.saturating_sub(1 + tail.len());
    format!("$.t{}{}", step.repeat(head), &render_addr(tail)[1..])
}

fn written_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => leaf(),
        2 => shallow(),
        1 => proptest::collection::vec((key(), leaf()), 0..1000)
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        2 => (prop_oneof![0usize..8, 90usize..104, 104usize..130], 0u8..3, 0usize..2, leaf())
            .prop_map(|(n, kind, s, inner)| nest(inner, n, kind, "c", s)),
        1 => (1usize..200).prop_map(|n| {
            Value::Array((0..n).map(|i| json!({"price": i, "qty": 2})).collect())
        }),
    ]
}

/// Whether the write `(addr, value)` must be accepted on its own: a concrete address below a
/// member of the root, within the limits, whose value fits below it, and no derived name on
/// the way.
fn acceptable(segs: &[Seg], value: &Value, limits: &EngineLimits) -> bool {
    matches!(segs.first(), Some(Seg::Field(_)))
        && segs.len() + depth(value) <= MAX_DEPTH
        && segs.iter().all(|s| match s {
            Seg::Field(k) => !DERIVED.contains(&&**k),
            Seg::Index(i) => *i <= limits.max_array_index,
        })
}

fn engine_limits() -> EngineLimits {
    EngineLimits {
        max_array_index: 1000,
        ..EngineLimits::default()
    }
}

proptest! {
    #![proptest_config(config(40))]

    /// Generated writes through `Model::mutate` never panic; a refused mutation leaves the
    /// state byte-identical; a write whose value is deeper than `MAX_DEPTH` leaves below its
    /// address is refused, and one that fits (at a concrete address, within the index limit,
    /// touching no derived name) is accepted and reads back; the base and merged documents
    /// never nest deeper than `MAX_DEPTH`.
    #[test]
    fn mutations_keep_the_state_within_the_depth_limit(
        mask in 0u16..(1 << 9),
        recursive_schema in any::<bool>(),
        steps in proptest::collection::vec(
            prop_oneof![
                3 => proptest::collection::vec((address(), written_value()), 1..2),
                1 => proptest::collection::vec((address(), written_value()), 2..4),
            ],
            1..10,
        ),
    ) {
        if out_of_time() {
            return Ok(());
        }
        on_thread(DAEMON_STACK, move || -> Result<(), TestCaseError> {
            let spec = parse_spec(&mutation_spec("fuzz", mask, recursive_schema)).unwrap();
            let limits = engine_limits();
            let (mut model, _) = Model::create(&spec, NOW, limits.clone()).unwrap();
            for writes in steps {
                let before = model.state().fingerprint();
                let merged_before = model.merged_json(NOW).to_string();
                let parsed = parse_writes(writes.iter().map(|(k, v)| (k, v)), limits.max_mutations);
                let too_deep = parsed.as_ref().is_ok_and(|p| {
                    p.iter().any(|(segs, v)| segs.len() + depth(v) > MAX_DEPTH)
                });
                let must_accept = parsed.as_ref().is_ok_and(|p| {
                    p.iter().all(|(segs, v)| acceptable(segs, v, &limits))
                });
                let described: Vec<String> = writes
                    .iter()
                    .map(|(k, v)| format!("{} = depth {} {}", short(k), depth(v), short(&v.to_string())))
                    .collect();
                match model.mutate(&writes, NOW) {
                    Ok(_) => {
                        prop_assert!(!too_deep, "a too deep write was accepted: {:?}", described);
                        if let (Ok(p), [_]) = (&parsed, writes.as_slice()) {
                            let (segs, v) = &p[0];
                            prop_assert!(
                                model.state().base.get_path(segs) == Some(&Val::from_json(v)),
                                "the write does not read back: {:?}", described
                            );
                        }
                    }
                    Err(e) => {
                        prop_assert!(!must_accept, "refused {:?}: {}", described, short(&e.to_string()));
                        prop_assert_eq!(&model.state().fingerprint(), &before, "a refused mutation changed the state");
                        prop_assert_eq!(model.merged_json(NOW).to_string(), merged_before);
                    }
                }
                let base = model.state().base.to_json();
                prop_assert!(base.is_object(), "the document became {}", short(&base.to_string()));
                prop_assert!(!json_deeper_than(&base, MAX_DEPTH), "base depth {}", depth(&base));
                let merged = model.merged_json(NOW);
                prop_assert!(!json_deeper_than(&merged, MAX_DEPTH), "merged depth {}", depth(&merged));
                prop_assert!(!json_deeper_than(&Value::Object(model.state().meta_json()), MAX_DEPTH));
            }
            Ok(())
        })?;
    }
}

/// One JSON Patch operation, resolved against the document it applies to.
#[derive(Clone, Debug)]
struct POp {
    /// 0 add, 1 remove, 2 replace, 3 move, 4 copy, 5 test, 6 copy into its own deepest
    /// container (doubling the depth below it).
    kind: u8,
    path: usize,
    from: usize,
    tail: PTail,
    value: Value,
}

/// Where an operation goes relative to the pointer it picked, by what is there.
#[derive(Clone, Debug)]
enum PTail {
    /// The pointer itself.
    At,
    /// Below it: a member of an object (new or not, one of [`FIELDS`] by this index), an
    /// element of an array (this index modulo one past its end: an insertion), or the end of
    /// the array (`-`) when the index is past even that; nothing below a scalar.
    Below(usize),
}

fn pop() -> impl Strategy<Value = POp> {
    (
        prop_oneof![
            3 => Just(0u8),
            1 => Just(1u8),
            2 => Just(2u8),
            1 => Just(3u8),
            2 => Just(4u8),
            1 => Just(5u8),
            2 => Just(6u8),
        ],
        any::<usize>(),
        any::<usize>(),
        prop_oneof![1 => Just(PTail::At), 2 => any::<usize>().prop_map(PTail::Below)],
        written_value(),
    )
        .prop_map(|(kind, path, from, tail, value)| POp {
            kind,
            path,
            from,
            tail,
            value,
        })
}

fn escape_token(t: &str) -> String {
    t.replace('~', "~0").replace('/', "~1")
}

/// The pointers of `doc`'s containers and members, breadth first (at most a few hundred).
fn pointers(doc: &Value) -> Vec<(String, &Value)> {
    let mut out = vec![(String::new(), doc)];
    let mut i = 0;
    while i < out.len() && out.len() < 400 {
        let (p, v) = (out[i].0.clone(), out[i].1);
        match v {
            Value::Array(a) => {
                out.extend(a.iter().enumerate().map(|(k, x)| (format!("{p}/{k}"), x)));
            }
            Value::Object(o) => {
                out.extend(
                    o.iter()
                        .map(|(k, x)| (format!("{p}/{}", escape_token(k)), x)),
                );
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The pointer of the deepest container at or below `p` (first found), `p` itself when none.
fn deepest_below(doc: &Value, p: &str) -> String {
    let Some(start) = doc.pointer(p) else {
        return p.to_string();
    };
    let mut best = (0usize, p.to_string());
    let mut stack = vec![(start, p.to_string(), 0usize)];
    while let Some((v, at, d)) = stack.pop() {
        if (v.is_object() || v.is_array()) && d >= best.0 {
            best = (d, at.clone());
        }
        match v {
            Value::Array(a) => stack.extend(
                a.iter()
                    .enumerate()
                    .map(|(k, x)| (x, format!("{at}/{k}"), d + 1)),
            ),
            Value::Object(o) => stack.extend(
                o.iter()
                    .map(|(k, x)| (x, format!("{at}/{}", escape_token(k)), d + 1)),
            ),
            _ => {}
        }
    }
    best.1
}

/// `op` as an RFC 6902 operation against `doc`.
fn resolve(op: &POp, doc: &Value) -> Value {
    let ps = pointers(doc);
    let (base, _) = &ps[op.path % ps.len()];
    let (from, _) = &ps[op.from % ps.len()];
    let member = |p: &str| match (&op.tail, doc.pointer(p)) {
        (PTail::Below(i), Some(Value::Object(_))) => {
            format!("{p}/{}", escape_token(FIELDS[i % FIELDS.len()]))
        }
        (PTail::Below(i), Some(Value::Array(a))) if i % (a.len() + 2) <= a.len() => {
            format!("{p}/{}", i % (a.len() + 2))
        }
        (PTail::Below(_), Some(Value::Array(_))) => format!("{p}/-"),
        _ => p.to_string(),
    };
    let path = member(base);
    match op.kind {
        0 => json!({"op": "add", "path": path, "value": op.value}),
        1 => json!({"op": "remove", "path": path}),
        2 => json!({"op": "replace", "path": path, "value": op.value}),
        3 => json!({"op": "move", "from": from, "path": path}),
        4 => json!({"op": "copy", "from": from, "path": path}),
        5 => {
            let value = doc.pointer(&path).cloned().unwrap_or(op.value.clone());
            json!({"op": "test", "path": path, "value": value})
        }
        _ => {
            let into = deepest_below(doc, from);
            let into = if doc.pointer(&into).is_some_and(Value::is_array) {
                format!("{into}/-")
            } else {
                format!("{into}/copy")
            };
            json!({"op": "copy", "from": from, "path": into})
        }
    }
}

/// What the service must do with `ops` on `doc`: the patched document when every operation
/// applies and leaves the document an object within `MAX_DEPTH`, else `None` (refused).
fn patch_oracle(doc: &Value, ops: &[Value]) -> Option<Value> {
    let mut d = doc.clone();
    for op in ops {
        let patch: json_patch::Patch = serde_json::from_value(json!([op])).ok()?;
        json_patch::patch(&mut d, &patch).ok()?;
        if json_deeper_than(&d, MAX_DEPTH) {
            return None;
        }
    }
    d.is_object().then_some(d)
}

/// Whether an operation names a derived member (the service may refuse it as read-only).
fn touches_derived(op: &Value) -> bool {
    ["path", "from"].iter().any(|f| {
        op[*f]
            .as_str()
            .is_some_and(|p| p.split('/').any(|t| DERIVED.contains(&t)))
    })
}

fn service() -> &'static Arc<ModelService> {
    static SVC: OnceLock<Arc<ModelService>> = OnceLock::new();
    SVC.get_or_init(|| {
        let mut limits = ServiceLimits::default();
        limits.engine.max_array_index = 1000;
        ModelService::new(1, limits)
    })
}

proptest! {
    #![proptest_config(config(32))]

    /// JSON Patch through the service, operation by operation, copies into themselves
    /// included: a patch is applied exactly as RFC 6902 says when every step stays within
    /// `MAX_DEPTH`, and refused with the model unchanged otherwise.
    #[test]
    fn patches_apply_as_rfc6902_within_the_depth_limit(
        mask in 0u16..(1 << 9),
        seed_doc in proptest::collection::vec((0..FIELDS.len(), written_value()), 0..5),
        patches in proptest::collection::vec(proptest::collection::vec(pop(), 1..4), 1..8),
    ) {
        if out_of_time() {
            return Ok(());
        }
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let svc = service();
        let id = valem_service::ModelId::from(format!("fuzz-patch-{}", NEXT.fetch_add(1, Ordering::Relaxed)));
        let spec = parse_spec(&mutation_spec(&id, mask & !(1 << 6), false)).unwrap();
        svc.create(spec).unwrap();
        let seed: Vec<(String, Value)> = seed_doc
            .into_iter()
            .filter(|(i, v)| !DERIVED.contains(&FIELDS[*i]) && depth(v) < MAX_DEPTH)
            .map(|(i, v)| (render_addr(&[ASeg::Field(i)]), v))
            .collect();
        if !seed.is_empty() {
            svc.mutate(&id, seed).wait().unwrap();
        }
        let result = (|| -> Result<(), TestCaseError> {
            for ops in &patches {
                let base = svc.snapshot(&id).wait().unwrap()["baseDoc"].clone();
                let state = svc.state(&id, None).wait().unwrap();
                let mut doc = base.clone();
                let mut resolved = Vec::new();
                for op in ops {
                    let r = resolve(op, &doc);
                    if let Ok(p) = serde_json::from_value::<json_patch::Patch>(json!([r])) {
                        let _ = json_patch::patch(&mut doc, &p);
                    }
                    resolved.push(r);
                }
                let want = patch_oracle(&base, &resolved);
                let derived = resolved.iter().any(touches_derived);
                let patch: json_patch::Patch = serde_json::from_value(Value::Array(resolved.clone())).unwrap();
                let ops_text = short(&Value::Array(resolved.clone()).to_string());
                match svc.patch(&id, patch).wait() {
                    Ok(_) => {
                        let after = svc.snapshot(&id).wait().unwrap()["baseDoc"].clone();
                        prop_assert!(!json_deeper_than(&after, MAX_DEPTH));
                        prop_assert!(!json_deeper_than(&svc.state(&id, None).wait().unwrap(), MAX_DEPTH));
                        match &want {
                            Some(w) => prop_assert!(same_value(&after, w), "{} gave {}", ops_text, short(&after.to_string())),
                            None => return Err(TestCaseError::fail(format!("applied a patch RFC 6902 or the depth limit refuses: {ops_text}"))),
                        }
                    }
                    Err(e) => {
                        prop_assert!(want.is_none() || derived, "refused {}: {}", ops_text, short(&e.to_string()));
                        prop_assert_eq!(&svc.snapshot(&id).wait().unwrap()["baseDoc"], &base, "a refused patch changed the base");
                        prop_assert_eq!(&svc.state(&id, None).wait().unwrap(), &state, "a refused patch changed the state");
                    }
                }
            }
            Ok(())
        })();
        svc.delete(&id).unwrap();
        result?;
    }
}

// ---------------------------------------------------------------------------------------------
// 4. The expression compiler (expr/)

/// Tokens of JSONata, and some that are not.
const TOKENS: [&str; 78] = [
    "a",
    "b",
    "price",
    "items",
    "$",
    "$$",
    "$x",
    "$f",
    "$sum",
    "$map",
    "$string",
    "function",
    "\u{3bb}",
    "0",
    "1",
    "1.5",
    "2e3",
    "1.5e+3",
    "-",
    "'a'",
    "\"b\\\"\"",
    "'",
    "\"",
    "+",
    "*",
    "/",
    "%",
    "&",
    "=",
    "!=",
    "<",
    "<=",
    ">",
    ">=",
    "and",
    "or",
    "in",
    "~>",
    ":=",
    "?:",
    "??",
    "?",
    ":",
    ".",
    "..",
    ",",
    ";",
    "@",
    "#",
    "^",
    "|",
    "**",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "/a(/i",
    "`x y`",
    "`a\\`",
    "/* c */",
    "/*",
    " ",
    "\n",
    "\u{e9}",
    "\u{1F600}",
    "true",
    "null",
    "undefined",
    "$not",
    "$count",
    "$keys",
    "$lookup",
    "$eval",
    "$now()",
    "$$.a",
    "%.b",
];

/// Valid expressions, from typical derivations to every construct.
const VALID: [&str; 36] = [
    "price * qty",
    "a0 * 2 + a1",
    "$sum(items.(price * qty))",
    "items[price > 5].qty",
    "$map(xs, function($v) { $v * 2 })",
    "{\"a\": 1, \"b\": [1, 2, 3]}",
    "a ? b : c",
    "($x := 3; $x * 2)",
    "$string(a) & \"x\"",
    "items^(price)",
    "$.a",
    "**.b",
    "1.5e+3 + 2E-2",
    "x#$i[$i > 0]",
    "a.`b c`.d",
    "/* note */ a + 1",
    "$match(s, /a(b)c/i)",
    "[1..3]",
    "a != b and c <= d or e in [1, 2]",
    "a ?? b",
    "a ?: b",
    "$count(items[big])",
    "\"it's \\\"quoted\\\"\" & 'x'",
    "-a - -1",
    "items{price: qty}",
    "($f := function($a, $b) { $a + $b }; $f(1, 2))",
    "a ~> $string()",
    "$lookup($, 'x')",
    "$$.a",
    "items@$i.price",
    "(a; b)",
    "$parent.price * $parent.qty",
    "$round(a, 2)",
    "a[0][1]",
    "$now()",
    "\u{3bb}($x){$x}(2)",
];

/// `text` split where its tokens start (by whitespace and by character class: enough for
/// mutating valid expressions).
fn split_tokens(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut cur = String::new();
    let class = |c: char| {
        if c.is_alphanumeric() || c == '_' || c == '$' {
            0
        } else if c.is_whitespace() {
            1
        } else {
            2
        }
    };
    for c in text.chars() {
        let boundary = cur
            .chars()
            .last()
            .is_some_and(|l| class(l) != class(c) || class(c) == 2);
        if boundary {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[derive(Clone, Debug)]
enum Edit {
    Delete(usize),
    Duplicate(usize),
    Swap(usize, usize),
    Insert(usize, usize),
}

fn mutated_valid() -> impl Strategy<Value = String> {
    (
        0..VALID.len(),
        proptest::collection::vec(
            prop_oneof![
                any::<usize>().prop_map(Edit::Delete),
                any::<usize>().prop_map(Edit::Duplicate),
                (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Edit::Swap(a, b)),
                (any::<usize>(), 0..TOKENS.len()).prop_map(|(a, t)| Edit::Insert(a, t)),
            ],
            0..4,
        ),
    )
        .prop_map(|(i, edits)| {
            let mut t = split_tokens(VALID[i]);
            for e in edits {
                if t.is_empty() {
                    break;
                }
                let n = t.len();
                match e {
                    Edit::Delete(k) => {
                        t.remove(k % n);
                    }
                    Edit::Duplicate(k) => {
                        let x = t[k % n].clone();
                        t.insert(k % n, x);
                    }
                    Edit::Swap(a, b) => t.swap(a % n, b % n),
                    Edit::Insert(k, tok) => t.insert(k % (n + 1), TOKENS[tok].to_string()),
                }
            }
            t.concat()
        })
}

fn token_soup() -> impl Strategy<Value = String> {
    (
        proptest::collection::vec(0..TOKENS.len(), 0..40),
        any::<bool>(),
    )
        .prop_map(|(ts, spaced)| {
            let parts: Vec<&str> = ts.iter().map(|&i| TOKENS[i]).collect();
            parts.join(if spaced { " " } else { "" })
        })
}

/// One level of a nesting construct: what opens it, what closes it, and whether it is a
/// bracket (counted against the bracket limit).
const NESTINGS: [(&str, &str, bool); 14] = [
    ("(", ")", true),
    // Brackets in a regular expression are none.
    ("(/\\)/ and ", ")", true),
    ("[/[(]/, ", "]", true),
    ("[", "]", true),
    ("{\"a\": ", "}", true),
    ("$f(", ")", true),
    ("-", "", false),
    ("a ? ", " : 1", false),
    ("a and ", "", false),
    ("a.", "", false),
    ("x[", "]", true),
    ("function($a){", "}", true),
    ("1 + ", "", false),
    ("(1 + ", ")", true),
];

/// Prefixes that hide what follows from a naive bracket count (a backquoted name ending in a
/// backslash, regular expressions holding brackets).
const HIDERS: [&str; 4] = ["", "`a\\` + ", "/\\)/ ~> $f() + ", "$match('', /[(]/) + "];

#[derive(Clone, Debug)]
struct Nested {
    kinds: Vec<usize>,
    levels: usize,
    hider: usize,
    tail: u8,
}

impl Nested {
    fn text(&self) -> String {
        let mut open = String::from(HIDERS[self.hider]);
        let mut close = String::new();
        for l in 0..self.levels {
            let (o, c, _) = NESTINGS[self.kinds[l % self.kinds.len()]];
            open.push_str(o);
            close.insert_str(0, c);
        }
        let mut t = open + "1" + &close;
        match self.tail {
            1 => t.push(')'),
            2 => {
                t.pop();
            }
            3 => t.push_str(" +"),
            4 => t.push_str(" 'x"),
            5 => t.insert(t.len() / 2, '@'),
            _ => {}
        }
        t
    }

    /// How deep its brackets really nest.
    fn brackets(&self) -> usize {
        (0..self.levels)
            .filter(|l| NESTINGS[self.kinds[l % self.kinds.len()]].2)
            .count()
    }
}

fn nested() -> impl Strategy<Value = Nested> {
    (
        proptest::collection::vec(0..NESTINGS.len(), 1..3),
        prop_oneof![
            1 => 1usize..24,
            1 => 24usize..99,
            2 => 99usize..103,
            1 => 103usize..990,
            1 => 990usize..1010,
            1 => 1010usize..1500,
        ],
        prop_oneof![3 => Just(0usize), 1 => 1usize..HIDERS.len()],
        prop_oneof![3 => Just(0u8), 2 => 1u8..6],
    )
        .prop_map(|(kinds, levels, hider, tail)| Nested {
            kinds,
            levels,
            hider,
            tail,
        })
}

fn eval_limits() -> Limits {
    Limits {
        timeout_ms: Some(200),
        max_sequence: Some(100_000),
        max_string_bytes: 1 << 20,
        max_output_values: 100_000,
        ..Limits::default()
    }
}

/// Most parses an error-position search may take for a text of `chars` characters: the
/// prefix doubles then halves, so about two logarithms of the number of tokens.
fn parse_bound(chars: usize) -> u64 {
    let log = usize::BITS - chars.max(1).leading_zeros();
    2 * u64::from(log) + 4
}

/// What compiling and evaluating `text` on the daemon's stack gives: the compile error's
/// position (if any) and the parses its search took, or where a property failed.
fn compile_and_run(text: String, with_model: bool) -> Result<Option<usize>, String> {
    on_thread(DAEMON_STACK, move || {
        let chars = text.chars().count();
        let before = expr::parses_on_this_thread();
        let compiled = Compiled::compile(&text, &Limits::default());
        let parses = expr::parses_on_this_thread() - before;
        if parses > parse_bound(chars) {
            return Err(format!("{parses} parses for {chars} characters"));
        }
        let c = match compiled {
            Err(e) => {
                if e.phase != Phase::Compile {
                    return Err(format!("a compile error in phase {:?}", e.phase));
                }
                return match e.position {
                    Some(p) if p <= chars => Ok(Some(p)),
                    other => Err(format!("position {other:?} of {chars} characters: {e}")),
                };
            }
            Ok(c) => c,
        };
        let _ = expr::deps::reads(c.ast());
        let _ = expr::deps::free_names(c.ast());
        let input = json!({"a": 1, "b": [1, 2], "price": 2, "qty": 3,
                           "items": [{"price": 1, "qty": 2, "big": true}, {"price": 7}],
                           "xs": [1, 2, 3], "s": "abc", "x": {"y": 1}});
        match expr::eval_once(&text, Some(&input), &Map::new(), &eval_limits()) {
            Ok(Some(v)) if json_deeper_than(&v, MAX_DEPTH) => {
                return Err(format!("a result {} levels deep", depth(&v)))
            }
            Ok(_) => {}
            Err(e) if e.phase == Phase::Evaluate => {}
            Err(e) => return Err(format!("compiled, then failed to compile: {e}")),
        }
        if with_model {
            let spec = json!({"id": "fuzz-expr", "schema": {},
                              "derivations": [{"path": "$.r", "expr": text}]});
            if let Ok(spec) = parse_spec(&spec) {
                if let Ok((mut m, _)) = Model::create(&spec, NOW, EngineLimits::default()) {
                    let _ = m.mutate(
                        &[("$.a".into(), json!(2)), ("$.price".into(), json!(3))],
                        NOW,
                    );
                    if json_deeper_than(&m.merged_json(NOW), MAX_DEPTH) {
                        return Err("the merged document went deeper than the limit".into());
                    }
                }
            }
        }
        Ok(None)
    })
}

proptest! {
    #![proptest_config(config(1024))]

    /// Token soups and edited valid expressions: compiling never panics or aborts on the
    /// daemon's stack, an error's position lies within the text, its search takes a
    /// logarithmic number of parses, and what compiles evaluates to a value within the limits.
    #[test]
    fn expression_texts_compile_or_fail_with_a_position(
        text in prop_oneof![token_soup(), mutated_valid()],
        with_model in proptest::bool::weighted(0.15),
    ) {
        if out_of_time() {
            return Ok(());
        }
        if let Err(e) = compile_and_run(text, with_model) {
            return Err(TestCaseError::fail(e));
        }
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Every construct nested up to and past the bracket limit (100) and the parser's (1,000),
    /// behind prefixes that hide brackets from a naive count, cut or extended at the end:
    /// nothing aborts, and a text whose brackets nest deeper than the limit never compiles.
    #[test]
    fn deep_nestings_respect_the_limits(n in nested(), with_model in proptest::bool::weighted(0.2)) {
        if out_of_time() {
            return Ok(());
        }
        let text = n.text();
        let compiled = compile_and_run(text.clone(), with_model);
        match compiled {
            Err(e) => return Err(TestCaseError::fail(e)),
            Ok(None) => prop_assert!(
                n.brackets() <= expr::MAX_BRACKET_NESTING,
                "brackets nest {} levels and it compiled", n.brackets()
            ),
            Ok(Some(_)) => {}
        }
    }
}

proptest! {
    #![proptest_config(config(96))]

    /// A valid expression followed by a token that cannot continue it: the error is at that
    /// token, not somewhere inside the valid part (the position search re-lexes the text).
    #[test]
    fn an_error_after_a_valid_expression_is_placed_there(
        i in 0..VALID.len(),
        junk in prop_oneof![Just(")"), Just("]"), Just("}"), Just(","), Just(":"), Just("a")],
        gap in prop_oneof![Just(" "), Just("  "), Just("\n"), Just(" /* c */ ")],
    ) {
        if out_of_time() {
            return Ok(());
        }
        let valid = VALID[i];
        prop_assert!(Compiled::compile(valid, &Limits::default()).is_ok(), "{}", valid);
        let text = format!("{valid}{gap}{junk}");
        let at = valid.chars().count() + gap.chars().count();
        match compile_and_run(text.clone(), false) {
            Ok(Some(p)) => prop_assert_eq!(p, at, "{:?}", text),
            Ok(None) => return Err(TestCaseError::fail(format!("{text:?} compiled"))),
            Err(e) => return Err(TestCaseError::fail(e)),
        }
    }
}

proptest! {
    #![proptest_config(config(6))]

    /// Texts near the 100 KB length limit with one error somewhere: refused, the error where
    /// it was put, found in a logarithmic number of parses.
    #[test]
    fn a_long_invalid_text_is_refused_in_few_parses(
        items in 8_000usize..14_000,
        bad in any::<usize>(),
        shape in 0u8..3,
    ) {
        if out_of_time() {
            return Ok(());
        }
        // Where the error goes, among the items there is room for.
        let bad = bad % 6_000;
        let mut text = String::from(match shape {
            0 => "[",
            1 => "{",
            _ => "(",
        });
        let mut at = 0;
        for k in 0..items {
            if text.len() > 95_000 {
                break;
            }
            if k > 0 {
                text.push_str(if shape == 2 { "; " } else { ", " });
            }
            if k == bad {
                at = text.chars().count() + 3;
                text.push_str(if shape == 2 { "a1 ] " } else { "a1 ) " });
            }
            match shape {
                0 => text.push_str(&format!("{k}")),
                1 => text.push_str(&format!("\"k{k}\": {k}")),
                _ => text.push_str(&format!("a{k}")),
            }
        }
        text.push(match shape {
            0 => ']',
            1 => '}',
            _ => ')',
        });
        prop_assert!(text.len() <= Limits::default().max_expr_len, "{} bytes", text.len());
        match compile_and_run(text, false) {
            Ok(Some(p)) => prop_assert_eq!(p, at),
            Ok(None) => return Err(TestCaseError::fail("compiled".to_string())),
            Err(e) => return Err(TestCaseError::fail(e)),
        }
    }
}
