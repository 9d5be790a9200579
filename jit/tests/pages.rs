#![cfg(feature = "cranelift")]
//! Compiled code is unmapped when its `CodeSet` is dropped: the executable anonymous mappings
//! of this process grow while sets are alive and shrink back once they are gone. (Alone in its
//! test binary, so no other test maps code meanwhile.)

use valem_jit::codegen::{CodeSet, Shapes};
use valem_jit::ir;

/// Bytes of anonymous executable mappings of this process, from /proc/self/maps.
fn exec_anon_bytes() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            let path = f.nth(3);
            (perms.starts_with("r-x") && path.is_none()).then_some(range)
        })
        .filter_map(|r| {
            let (a, b) = r.split_once('-')?;
            Some(usize::from_str_radix(b, 16).ok()? - usize::from_str_radix(a, 16).ok()?)
        })
        .sum()
}

#[test]
fn code_pages_are_unmapped_when_the_set_is_dropped() {
    let programs: Vec<ir::Program> = (0..200)
        .map(|i| {
            let text = format!("x * {i} + $round(y, 2) % 7");
            let ast = jsonata_core::parser::parse(&text).expect("parses");
            ir::lower(&ast, &|_| None).expect("in the subset")
        })
        .collect();
    let before = exec_anon_bytes();
    let sets: Vec<CodeSet> = programs
        .iter()
        .map(|p| CodeSet::compile(&[(p, Shapes::BOTH)]).expect("compiles"))
        .collect();
    let slots = [3.0, 2.555];
    assert_eq!(sets[5].call(0, &slots), Some(15.0 + (2.56f64 % 7.0)));
    let alive = exec_anon_bytes();
    assert!(
        alive >= before + 200 * 4096,
        "each set maps at least a page of code: {before} -> {alive}"
    );
    drop(sets);
    let after = exec_anon_bytes();
    assert!(
        after <= before + 4096,
        "the pages are unmapped with their sets: {before} -> {alive} -> {after}"
    );
}
