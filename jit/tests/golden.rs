//! `$round` against the reference: `golden/round.json` was produced by jsonata-js
//! (`golden/generate`, from npm). The shared helper, the IR interpreter and the compiled code
//! must all give the reference's answer, bit for bit.

use serde_json::Value;
use valem_jit::{helpers, interp, ir};

fn cases() -> Vec<(f64, i32, f64)> {
    let text = include_str!("../golden/round.json");
    let doc: Value = serde_json::from_str(text).expect("round.json is JSON");
    let cases = doc["cases"].as_array().expect("cases");
    assert!(cases.len() > 3000, "{} cases", cases.len());
    cases
        .iter()
        .map(|c| {
            let n = |i: usize| c[i].as_f64().expect("a number");
            (n(0), n(1) as i32, n(2))
        })
        .collect()
}

fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits()
}

#[test]
fn the_helper_agrees_with_jsonata_js() {
    let mut bad = Vec::new();
    for (x, p, want) in cases() {
        let got = helpers::round(x, p);
        if !same(got, want) {
            bad.push(format!(
                "$round({x:?}, {p}) = {got:?}, jsonata-js says {want:?}"
            ));
        }
    }
    assert!(bad.is_empty(), "{} differ:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn interpreted_and_compiled_ir_agree_with_jsonata_js() {
    let cases = cases();
    let mut precisions: Vec<i32> = cases.iter().map(|c| c.1).collect();
    precisions.sort_unstable();
    precisions.dedup();
    for p in precisions {
        let ast = jsonata_core::parser::parse(&format!("$round(x, {p})")).expect("parses");
        let prog = ir::lower(&ast, &|_| None).expect("in the subset");
        #[cfg(feature = "cranelift")]
        let code =
            valem_jit::codegen::CodeSet::compile(&[(&prog, valem_jit::codegen::Shapes::BOTH)])
                .expect("compiles");
        let xs: Vec<(f64, f64)> = cases
            .iter()
            .filter(|c| c.1 == p)
            .map(|c| (c.0, c.2))
            .collect();
        for &(x, want) in &xs {
            let got = interp::eval(&prog, &[x]).map(interp::Value::to_f64);
            assert!(
                got.is_some_and(|g| same(g, want)),
                "interp $round({x:?}, {p}) = {got:?}, want {want:?}"
            );
            #[cfg(feature = "cranelift")]
            {
                let got = code.call(0, &[x]);
                assert!(
                    got.is_some_and(|g| same(g, want)),
                    "jit $round({x:?}, {p}) = {got:?}, want {want:?}"
                );
            }
        }
        #[cfg(feature = "cranelift")]
        {
            let col: Vec<f64> = xs.iter().map(|c| c.0).collect();
            let mut out = vec![0.0; col.len()];
            let mut ok = vec![0u8; col.len()];
            let good = code
                .call_batch(0, &[&col], &mut out, &mut ok)
                .expect("batch entry");
            assert_eq!(good, col.len());
            for (i, &(x, want)) in xs.iter().enumerate() {
                assert!(
                    same(out[i], want),
                    "batched $round({x:?}, {p}) = {:?}, want {want:?}",
                    out[i]
                );
            }
        }
    }
}
