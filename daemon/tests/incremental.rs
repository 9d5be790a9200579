//! Differential property test: after every step of a random mutation sequence, the
//! incrementally maintained state (merged document and meta) equals a from-scratch recompute of
//! the same base document; a refused mutation leaves the state byte-identical.

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use valem_core::spec::parse_spec;
use valem_engine::Timestamp;
use valem_engine::{EngineLimits, JitConfig, Model, MutationError, State, Undo};

/// A result's derived paths as plain strings, for comparisons.
fn strs(v: &valem_engine::Paths) -> Vec<&str> {
    v.iter().collect()
}

/// Building blocks a generated spec picks from: derivations, meta and constraints over fan-out
/// fields, chains, `[*]` items with aggregates (kept by delta or rescanned), nested objects, a
/// whole-document reader and lazy derivations.
fn derivation_pool() -> Vec<Value> {
    vec![
        json!({"path": "$.d0", "expr": "a0 * 2 + a1"}),
        json!({"path": "$.d1", "expr": "a1 * a2"}),
        json!({"path": "$.d2", "expr": "a3 - a4"}),
        json!({"path": "$.c0", "expr": "a0 + 1"}),
        json!({"path": "$.c1", "expr": "c0 * 2"}),
        json!({"path": "$.c2", "expr": "c1 + a1"}),
        json!({"path": "$.items[*].total", "expr": "$parent.price * $parent.qty"}),
        json!({"path": "$.items[*].big", "expr": "$parent.price > a2"}),
        json!({"path": "$.items[*].share", "expr": "$parent.price / ($sum(items.price) + 1)"}),
        json!({"path": "$.sum", "expr": "$sum(items.total)"}),
        json!({"path": "$.cnt", "expr": "$count(items)"}),
        json!({"path": "$.maxp", "expr": "$max(items.price)"}),
        json!({"path": "$.bigCount", "expr": "$count(items[big])"}),
        json!({"path": "$.order.net", "expr": "sum - a3"}),
        json!({"path": "$.order.gross", "expr": "order.net * (1 + $const.vat)"}),
        json!({"path": "$.keys", "expr": "$count($keys($))"}),
        json!({"path": "$.lz", "expr": "sum * 10", "evaluation": "lazy"}),
        json!({"path": "$.lz2", "expr": "lz + a0", "evaluation": "lazy"}),
        json!({"path": "$.label", "expr": "a0 > 5 ? 'high' : 'low'"}),
        json!({"path": "$.sumq", "expr": "$sum(items.qty)"}),
        json!({"path": "$.avgp", "expr": "$average(items.price)"}),
    ]
}

fn meta_pool() -> Vec<Value> {
    vec![
        json!({"path": "$.a1", "property": "maximum", "expr": "a2 + 100"}),
        json!({"path": "$.a3", "property": "relevant", "expr": "a0 > 3"}),
        json!({"path": "$.items[*].qty", "property": "relevant", "expr": "price > 5"}),
        json!({"path": "$.items[*].price", "property": "minimum", "expr": "qty"}),
    ]
}

fn constraint_pool() -> Vec<Value> {
    vec![
        json!({"id": "flag-sum", "expr": "$sum(items.price) < 50", "message": "big order", "policy": "flag"}),
        json!({"id": "no-13", "path": "$.a4", "expr": "$ != 13", "message": "13 is refused", "policy": "rollback"}),
        json!({"id": "qty-pos", "path": "$.items[*]", "expr": "qty >= 0", "message": "negative qty", "policy": "rollback"}),
        json!({"id": "pair", "path": ["$.a0", "$.a1"], "expr": "$ != 99", "message": "99", "policy": "flag"}),
    ]
}

fn spec_for(mask: u32, meta_mask: u8, constraint_mask: u8) -> Value {
    let pool = derivation_pool();
    let mut ds: Vec<Value> = pool
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, d)| d.clone())
        .collect();
    // Keep the chain and the lazy/nested readers meaningful: include what they read.
    let paths: Vec<String> = ds
        .iter()
        .map(|d| d["path"].as_str().unwrap().to_string())
        .collect();
    let need = |p: &str| paths.iter().any(|x| x == p);
    for (reader, dep) in [
        ("$.c1", "$.c0"),
        ("$.c2", "$.c1"),
        ("$.order.net", "$.sum"),
        ("$.order.gross", "$.order.net"),
        ("$.lz", "$.sum"),
        ("$.lz2", "$.lz"),
        ("$.sum", "$.items[*].total"),
        ("$.bigCount", "$.items[*].big"),
    ] {
        if need(reader) && !need(dep) {
            ds.push(pool.iter().find(|d| d["path"] == dep).unwrap().clone());
        }
    }
    let metas: Vec<Value> = meta_pool()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| meta_mask & (1 << i) != 0)
        .map(|(_, m)| m)
        .collect();
    let cs: Vec<Value> = constraint_pool()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| constraint_mask & (1 << i) != 0)
        .map(|(_, c)| c)
        .collect();
    json!({
        "id": "generated",
        "schema": {"type": "object"},
        "constants": {"vat": 0.2},
        "derivations": ds,
        "metaDerivations": metas,
        "constraints": cs,
    })
}

#[derive(Debug, Clone)]
enum Step {
    Field(usize, i64),
    ItemField(usize, &'static str, i64),
    Append(i64, i64),
    ReplaceItems(Vec<(i64, i64)>),
    NullField(usize),
    Pair(usize, i64, usize, i64),
    /// A non-integer item value: delta aggregates must fall back to a rescan.
    ItemDecimal(usize, &'static str, i64),
    /// A string where a number was: aggregates leave it to JSONata.
    ItemText(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0usize..5, -3i64..20).prop_map(|(i, v)| Step::Field(i, v)),
        (
            0usize..6,
            prop_oneof![Just("price"), Just("qty")],
            -2i64..15
        )
            .prop_map(|(i, f, v)| Step::ItemField(i, f, v)),
        (0i64..12, 0i64..5).prop_map(|(p, q)| Step::Append(p, q)),
        proptest::collection::vec((0i64..12, -1i64..5), 0..5).prop_map(Step::ReplaceItems),
        (0usize..5).prop_map(Step::NullField),
        (0usize..5, 0i64..15, 0usize..5, 0i64..15).prop_map(|(a, x, b, y)| Step::Pair(a, x, b, y)),
        (
            0usize..6,
            prop_oneof![Just("price"), Just("qty")],
            -20i64..150
        )
            .prop_map(|(i, f, v)| Step::ItemDecimal(i, f, v)),
        (0usize..6).prop_map(Step::ItemText),
    ]
}

fn mutation(step: &Step, model: &Model) -> Vec<(String, Value)> {
    let n = model
        .state()
        .base
        .to_json()
        .get("items")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    match step {
        Step::Field(i, v) => vec![(format!("$.a{i}"), json!(v))],
        Step::ItemField(i, f, v) => vec![(format!("$.items[{}].{f}", i % (n + 1)), json!(v))],
        Step::Append(p, q) => vec![(format!("$.items[{n}]"), json!({"price": p, "qty": q}))],
        Step::ReplaceItems(items) => vec![(
            "$.items".into(),
            Value::Array(
                items
                    .iter()
                    .map(|(p, q)| json!({"price": p, "qty": q}))
                    .collect(),
            ),
        )],
        Step::NullField(i) => vec![(format!("$.a{i}"), Value::Null)],
        Step::Pair(a, x, b, y) => {
            vec![(format!("$.a{a}"), json!(x)), (format!("$.a{b}"), json!(y))]
        }
        Step::ItemDecimal(i, f, v) => {
            vec![(
                format!("$.items[{}].{f}", i % (n + 1)),
                json!(*v as f64 * 0.1),
            )]
        }
        Step::ItemText(i) => vec![(format!("$.items[{}].qty", i % (n + 1)), json!("x"))],
    }
}

const NOW: Timestamp = Timestamp::from_ms(1_700_000_000_000);

/// The live model's limits: the JIT tier on, compiling from the first run.
fn limits() -> EngineLimits {
    limits_with(JitConfig {
        enabled: true,
        tier_after: 0,
    })
}

fn limits_with(jit: JitConfig) -> EngineLimits {
    EngineLimits {
        max_array_index: 64,
        jit,
        ..EngineLimits::default()
    }
}

/// The state a fresh model computes for `base` in one cycle, by the interpreter alone (the
/// live model runs with the JIT tier on, compiling from the first run).
fn scratch(spec: &valem_core::spec::ModelSpec, base: &Value) -> (Value, Map<String, Value>) {
    let off = limits_with(JitConfig {
        enabled: false,
        ..JitConfig::default()
    });
    let (mut m, _) = Model::create(spec, NOW, off).expect("spec compiles");
    let writes: Vec<(String, Value)> = base
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (format!("$.{k}"), v.clone()))
        .collect();
    if !writes.is_empty() {
        // Rollback constraints hold for every committed base, so this cannot be refused.
        m.mutate(&writes, NOW).expect("a committed base recomputes");
    }
    (m.merged_json(NOW), m.state().meta_json())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn incremental_equals_recompute(
        mask in 0u32..(1 << 21),
        meta_mask in 0u8..16,
        constraint_mask in 0u8..16,
        steps in proptest::collection::vec(step(), 1..16),
    ) {
        let spec = parse_spec(&spec_for(mask, meta_mask, constraint_mask)).unwrap();
        let (mut model, _) = Model::create(&spec, NOW, limits()).unwrap();
        for s in &steps {
            let muts = mutation(s, &model);
            let before = model.state().fingerprint();
            match model.mutate(&muts, NOW) {
                Ok(_) => {}
                Err(MutationError::Constraint { .. }) | Err(MutationError::Schema(_)) => {
                    prop_assert_eq!(&before, &model.state().fingerprint(), "refused mutation changed state: {:?}", s);
                    continue;
                }
                Err(e) => {
                    prop_assert_eq!(&before, &model.state().fingerprint());
                    prop_assert!(matches!(e, MutationError::Invalid(_)), "{e:?}");
                    continue;
                }
            }
            let live = model.merged_json(NOW);
            let live_meta = model.state().meta_json();
            let base = model.state().base.to_json();
            let (fresh, fresh_meta) = scratch(&spec, &base);
            prop_assert_eq!(&live, &fresh, "after {:?}\nspec mask {}", s, mask);
            prop_assert_eq!(&live_meta, &fresh_meta, "meta after {:?}", s);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The daemon's history ring keeps what each commit changed, not the state it left: after
    /// any run of commits, refusals and reads (a read materialises lazy values, a change of its
    /// own), undoing the logged changes from the current state gives back exactly the state
    /// each commit left, aggregates' running totals included.
    #[test]
    fn undoing_the_log_gives_back_every_committed_state(
        mask in 0u32..(1 << 21),
        meta_mask in 0u8..16,
        constraint_mask in 0u8..16,
        steps in proptest::collection::vec((step(), any::<bool>()), 1..16),
    ) {
        let spec = parse_spec(&spec_for(mask, meta_mask, constraint_mask)).unwrap();
        let (mut model, _) = Model::create(&spec, NOW, limits()).unwrap();
        model.record_undo(true);
        // Per commit: the state it left, and what was logged after it.
        let mut commits: Vec<(State, Vec<Undo>)> = vec![(model.state().clone(), Vec::new())];
        for (s, read_first) in &steps {
            if *read_first {
                model.merged_json(NOW);
                let logged = model.take_undo();
                commits.last_mut().unwrap().1.extend(logged);
            }
            let muts = mutation(s, &model);
            if model.mutate(&muts, NOW).is_ok() {
                let logged = model.take_undo();
                commits.last_mut().unwrap().1.extend(logged);
                commits.push((model.state().clone(), Vec::new()));
            } else {
                prop_assert!(model.take_undo().is_empty(), "a refused cycle logged a change");
            }
        }
        model.merged_json(NOW);
        let logged = model.take_undo();
        commits.last_mut().unwrap().1.extend(logged);
        for k in 0..commits.len() {
            let later = commits[k..].iter().rev().flat_map(|(_, u)| u.iter().rev());
            let rebuilt = model.state_before(later);
            let kept = &commits[k].0;
            prop_assert_eq!(rebuilt.fingerprint(), kept.fingerprint(), "commit {} of {}", k, commits.len());
            prop_assert_eq!(&rebuilt.aggregates, &kept.aggregates, "commit {}", k);
        }
    }
}

#[test]
fn one_item_write_recomputes_only_that_item_and_the_aggregate() {
    let spec = parse_spec(&spec_for(1 << 6 | 1 << 9, 0, 0)).unwrap();
    let (mut m, _) = Model::create(&spec, NOW, limits()).unwrap();
    let items: Vec<Value> = (0..20).map(|i| json!({"price": i, "qty": 1})).collect();
    m.mutate(&[("$.items".into(), Value::Array(items))], NOW)
        .unwrap();
    let r = m
        .mutate(&[("$.items[7].qty".into(), json!(3))], NOW)
        .unwrap();
    assert_eq!(strs(&r.derived_updated), vec!["$.items[7].total", "$.sum"]);
    let evaluated: Vec<String> = r.traces.iter().map(|t| t.target_path.to_string()).collect();
    assert_eq!(evaluated, vec!["$.items[7].total", "$.sum"]);
}

#[test]
fn early_cutoff_stops_at_unchanged_values() {
    let spec = parse_spec(&json!({"id": "cut", "schema": {},
    "derivations": [
        {"path": "$.sign", "expr": "a > 0 ? 1 : -1"},
        {"path": "$.next", "expr": "sign * 10"}
    ]}))
    .unwrap();
    let (mut m, _) = Model::create(&spec, NOW, limits()).unwrap();
    m.mutate(&[("$.a".into(), json!(5))], NOW).unwrap();
    let r = m.mutate(&[("$.a".into(), json!(6))], NOW).unwrap();
    let evaluated: Vec<String> = r.traces.iter().map(|t| t.target_path.to_string()).collect();
    assert_eq!(
        evaluated,
        vec!["$.sign"],
        "next must not be recomputed when sign is unchanged"
    );
    assert!(r.derived_updated.is_empty());
}

/// A `$sum` over `[*]` values keeps its running totals in the state: one changed item updates
/// them by its delta (exact while every value is an integer), and a non-integer value turns
/// them inexact, after which the sum is rescanned (and still equals a recompute).
#[test]
fn a_sum_over_items_is_kept_by_delta_while_exact() {
    let spec = parse_spec(&json!({
        "id": "agg",
        "schema": {"type": "object"},
        "derivations": [
            {"path": "$.items[*].total", "expr": "$parent.price * $parent.qty"},
            {"path": "$.sum", "expr": "$sum(items.total)"},
            {"path": "$.n", "expr": "$count(items.total)"}
        ]
    }))
    .unwrap();
    let (mut m, _) = Model::create(&spec, NOW, limits()).unwrap();
    let items: Vec<Value> = (0..50).map(|i| json!({"price": i, "qty": 2})).collect();
    m.mutate(&[("$.items".into(), Value::Array(items))], NOW)
        .unwrap();
    let memo = |m: &Model| {
        let mut v: Vec<_> = m.state().aggregates.values().cloned().collect();
        v.sort_by(|a, b| a.sum.total_cmp(&b.sum));
        v
    };
    let want: f64 = (0..50).map(|i| (i * 2) as f64).sum();
    assert!(
        memo(&m).iter().all(|a| a.exact && a.count == 50),
        "{:?}",
        memo(&m)
    );
    assert!(memo(&m).iter().any(|a| a.sum == want));
    let r = m
        .mutate(&[("$.items[7].qty".into(), json!(5))], NOW)
        .unwrap();
    assert_eq!(strs(&r.derived_updated), vec!["$.items[7].total", "$.sum"]);
    assert_eq!(
        m.get(&seg("$.sum"), NOW).and_then(|v| v.as_f64()),
        Some(want + 21.0)
    );
    assert!(memo(&m).iter().any(|a| a.exact && a.sum == want + 21.0));
    // A decimal: the totals are no longer exact; the sum is the left-to-right scan's.
    m.mutate(&[("$.items[3].price".into(), json!(0.1))], NOW)
        .unwrap();
    assert!(memo(&m).iter().any(|a| !a.exact));
    let (fresh, _) = scratch(&spec, &m.state().base.to_json());
    assert_eq!(m.merged_json(NOW), fresh);
    // Inexact, the memo keeps every total in order: a changed item replaces its one and the
    // sum is taken again over them, to the bit the left-to-right scan's.
    let leaves = |m: &Model| {
        memo(m)
            .into_iter()
            .find_map(|a| a.leaves.map(|l| l.to_vec()))
            .unwrap_or_default()
    };
    assert_eq!(leaves(&m).len(), 50);
    let kept = |m: &Model| {
        memo(m)
            .into_iter()
            .find_map(|a| a.leaves.map(|l| Arc::as_ptr(&l)))
    };
    for (k, price) in [(9, 0.7), (9, 1.3), (40, 2.9)] {
        let before = kept(&m);
        let r = m
            .mutate(&[(format!("$.items[{k}].price"), json!(price))], NOW)
            .unwrap();
        assert_eq!(
            strs(&r.derived_updated),
            vec![format!("$.items[{k}].total").as_str(), "$.sum"]
        );
        assert_eq!(leaves(&m)[k], price * 2.0);
        // Changed where they are, not gathered again by a walk of the items.
        assert_eq!(kept(&m), before);
        let (fresh, _) = scratch(&spec, &m.state().base.to_json());
        assert_eq!(m.merged_json(NOW), fresh);
    }
    // A rolled-back or refused cycle leaves the totals as they were (they are state).
    let before = memo(&m);
    let _ = m.mutate(&[("$.items[*].qty".into(), json!(1))], NOW);
    assert_eq!(memo(&m), before);
}

fn seg(a: &str) -> Vec<valem_core::value::Seg> {
    valem_core::expr::path::Address::parse(a)
        .unwrap()
        .concrete()
        .unwrap()
}

/// A cycle that queues hundreds of derivations takes them from a sorted run merged with what
/// their evaluation queues (`Cycle::derive`): the order is still level by level, each level in
/// spec order, and the values are those a recompute gives. Here 400 derivations of level 0,
/// 300 of level 1 and one of level 2, listed out of order: loaded as one document (all queued
/// at once), then with 401 separate writes (the level-0 ones and the level-2 one queued, the
/// level-1 ones queued as the level-0 ones change: taken before the level-2 one of the run).
#[test]
fn a_cycle_queuing_hundreds_evaluates_them_level_by_level_in_spec_order() {
    let mut derivations = Vec::new();
    let mut level = Vec::new();
    for i in 0..400 {
        if i < 300 {
            derivations
                .push(json!({"path": format!("$.b_{i}"), "expr": format!("a_{i} + a_{}", i + 1)}));
            level.push(1);
        }
        if i == 150 {
            derivations.push(json!({"path": "$.c", "expr": "b_0 + b_299 + y"}));
            level.push(2);
        }
        derivations.push(json!({"path": format!("$.a_{i}"), "expr": format!("x_{i} * 2")}));
        level.push(0);
    }
    let spec =
        parse_spec(&json!({"id": "many", "schema": {}, "derivations": derivations})).unwrap();
    let order: Vec<String> = {
        let mut by_level: Vec<(u32, usize)> = level.iter().copied().zip(0..).collect();
        by_level.sort();
        by_level
            .iter()
            .map(|&(_, i)| spec.derivations[i].path.to_string())
            .collect()
    };
    let (mut m, _) = Model::create(&spec, NOW, EngineLimits::default()).unwrap();
    for round in 0..2i64 {
        let x = |i: i64| i * 3 + round;
        let r = if round == 0 {
            let mut doc: Map<String, Value> =
                (0..400).map(|i| (format!("x_{i}"), json!(x(i)))).collect();
            doc.insert("y".into(), json!(round));
            m.mutate(&[("$".into(), Value::Object(doc))], NOW).unwrap()
        } else {
            let mut writes: Vec<(String, Value)> = (0..400)
                .map(|i| (format!("$.x_{i}"), json!(x(i))))
                .collect();
            writes.push(("$.y".into(), json!(round)));
            m.mutate(&writes, NOW).unwrap()
        };
        let evaluated: Vec<String> = r.traces.iter().map(|t| t.target_path.to_string()).collect();
        assert_eq!(evaluated, order, "round {round}");
        let state = m.merged_json(NOW);
        let a = |i: i64| x(i) * 2;
        for i in 0..300 {
            assert_eq!(
                state[format!("b_{i}")],
                json!(a(i) + a(i + 1)),
                "round {round}"
            );
        }
        let c = a(0) + a(1) + a(299) + a(300) + round;
        assert_eq!(state["c"], json!(c), "round {round}");
    }
}

/// A spec of thousands of derivations is prepared on several threads and its reader index
/// built on a thread of its own while the graph is: writes still reach exactly their readers.
#[test]
fn a_large_spec_indexed_on_threads_recomputes_what_a_write_reaches() {
    let n = 6000;
    let mut derivations: Vec<Value> = (0..n)
        .map(|i| json!({"path": format!("$.total_{i}"), "expr": format!("price_{i} * qty_{i}")}))
        .collect();
    derivations.push(json!({"path": "$.head", "expr": "total_0 + total_1 + total_5999"}));
    let spec =
        parse_spec(&json!({"id": "large", "schema": {}, "derivations": derivations})).unwrap();
    let (mut m, _) = Model::create(&spec, NOW, EngineLimits::default()).unwrap();
    let mut doc = Map::new();
    for i in 0..n {
        doc.insert(format!("price_{i}"), json!(i));
        doc.insert(format!("qty_{i}"), json!(2));
    }
    let r = m.mutate(&[("$".into(), Value::Object(doc))], NOW).unwrap();
    assert_eq!(r.derived_updated.len(), n + 1);
    let r = m
        .mutate(&[("$.price_4007".into(), json!(10))], NOW)
        .unwrap();
    assert_eq!(strs(&r.derived_updated), vec!["$.total_4007"]);
    let r = m.mutate(&[("$.qty_5999".into(), json!(3))], NOW).unwrap();
    assert_eq!(strs(&r.derived_updated), vec!["$.total_5999", "$.head"]);
    let state = m.merged_json(NOW);
    assert_eq!(state["total_4007"], json!(20));
    assert_eq!(state["head"], json!(2 + 5999 * 3));
}
