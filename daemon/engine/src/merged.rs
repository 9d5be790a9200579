//! The merged document (base values plus derived values) as the engine stores and reads it.
//!
//! Derivations whose target is one top-level member (`$.total`) — nearly all of them in large
//! models — keep their values in **cells**: a persistent dense vector indexed by a number fixed
//! at compile time ([`CellLayout`]), so writing or reading one costs an index, not a walk of a
//! 100k-entry hash trie. Everything else (base values, derived values below the root) lives in
//! the *tree*; when no derivation writes into the tree, the tree is the base document itself and
//! base values are stored once. [`Merged`] reads the two as one document: a cell that holds a
//! value shadows the tree's member of the same name.

use std::rc::Rc;
use std::sync::Arc;

use indexmap::IndexMap;
use serde_json::{Map, Value as Json};

use valem_core::expr::path::render;
use valem_core::expr::{to_jvalue, Value as JValue};
use valem_core::value::{Key, Seg, Val};

/// Which top-level members are cells, fixed when a spec is compiled.
#[derive(Debug, Default)]
pub struct CellLayout {
    /// The cells by name: each entry is a cell number, hashed by its key (4 bytes an entry,
    /// where a map from key to number takes 24: a 100k-derivation model has 100k cells).
    by_name: hashbrown::HashTable<u32>,
    /// Numbered in the order their values are first computed (topological level, then spec
    /// order): the order derived members follow the base members in output.
    keys: Vec<Key>,
}

/// Keyed ([`valem_core::hash`]): the names are a spec's.
fn name_hash(name: &str) -> u64 {
    valem_core::hash::str_hash(name)
}

impl CellLayout {
    /// `cells` in evaluation order: each cell's member name (the cell's number is its position).
    pub fn new(cells: Vec<Key>) -> CellLayout {
        let mut by_name = hashbrown::HashTable::with_capacity(cells.len());
        for (i, k) in cells.iter().enumerate() {
            by_name.insert_unique(name_hash(k), i as u32, |&c: &u32| {
                name_hash(&cells[c as usize])
            });
        }
        CellLayout {
            by_name,
            keys: cells,
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The cell of a top-level member.
    #[inline]
    pub fn find(&self, name: &str) -> Option<u32> {
        if self.keys.is_empty() {
            return None;
        }
        self.by_name
            .find(name_hash(name), |&c| {
                valem_core::value::key_eq(&self.keys[c as usize], name)
            })
            .copied()
    }

    pub fn key(&self, cell: u32) -> &Key {
        &self.keys[cell as usize]
    }
}

/// The values of a state's cells (`None`: not computed, or wiped). Cloning is O(1).
#[derive(Clone, Debug, Default)]
pub struct Cells {
    layout: Arc<CellLayout>,
    vals: CellVec,
}

impl Cells {
    pub fn new(layout: Arc<CellLayout>) -> Cells {
        let vals = CellVec::new(layout.len());
        Cells { layout, vals }
    }

    pub fn layout(&self) -> &Arc<CellLayout> {
        &self.layout
    }

    #[inline]
    pub fn get(&self, cell: u32) -> Option<&Val> {
        self.vals.get(cell as usize)
    }

    /// Start loading cell `cell`'s value (see [`super::prefetch`]).
    #[inline]
    pub fn prefetch(&self, cell: u32) {
        self.vals.prefetch(cell as usize);
    }

    /// Set a cell; returns what it held.
    #[inline]
    pub fn set(&mut self, cell: u32, v: Option<Val>) -> Option<Val> {
        self.vals.set(cell as usize, v)
    }

    /// Wipe every cell (the root was replaced).
    pub fn clear(&mut self) {
        *self = Cells::new(self.layout.clone());
    }

    fn any(&self) -> bool {
        self.vals.some > 0
    }
}

/// Branching of [`CellVec`]: 64 slots a node, so 100k cells are three levels deep.
const BITS: u32 = 6;
const WIDTH: usize = 1 << BITS;
const MASK: usize = WIDTH - 1;

/// A fixed-length persistent vector of optional values: a radix tree of 64-slot nodes, copied
/// on write along one path (≤ 2.5 KB at 100k cells) when a clone shares it. A new vector shares
/// one empty node per level, so making one is O(depth). Nodes are counted with `Rc`, not
/// `Arc`: a model's state never leaves its shard's thread, and copying a path of a shared tree
/// (every commit, while the history ring holds the previous states) clones 64 children a
/// level — with atomic counts that was ~1.5 µs of a 100k fan-out commit.
#[derive(Clone, Debug)]
struct CellVec {
    len: usize,
    /// Values that are not `None`.
    some: usize,
    /// Bit shift of the root's index digit (0: the root is a leaf).
    shift: u32,
    root: Tree,
}

#[derive(Clone, Debug)]
enum Tree {
    Leaf(Rc<[Option<Val>; WIDTH]>),
    Branch(Rc<[Tree; WIDTH]>),
}

impl Default for CellVec {
    fn default() -> Self {
        CellVec::new(0)
    }
}

impl CellVec {
    fn new(len: usize) -> CellVec {
        let mut root = Tree::Leaf(Rc::new(std::array::from_fn(|_| None)));
        let mut shift = 0;
        let mut span = WIDTH;
        while span < len {
            let child = root;
            root = Tree::Branch(Rc::new(std::array::from_fn(|_| child.clone())));
            shift += BITS;
            span <<= BITS;
        }
        CellVec {
            len,
            some: 0,
            shift,
            root,
        }
    }

    #[inline]
    fn get(&self, i: usize) -> Option<&Val> {
        self.slot(i)?.as_ref()
    }

    /// Walk to the leaf holding `i` (its branches are few and stay in cache) and start
    /// loading `i`'s value there.
    #[inline]
    fn prefetch(&self, i: usize) {
        if let Some(slot) = self.slot(i) {
            super::prefetch(slot);
        }
    }

    /// Where value `i` is kept (found through the branches; the slot itself is not read).
    #[inline]
    fn slot(&self, i: usize) -> Option<&Option<Val>> {
        if i >= self.len {
            return None;
        }
        let mut t = &self.root;
        let mut shift = self.shift;
        loop {
            match t {
                Tree::Branch(b) => {
                    t = &b[(i >> shift) & MASK];
                    shift = shift.saturating_sub(BITS);
                }
                Tree::Leaf(l) => return Some(&l[i & MASK]),
            }
        }
    }

    #[inline]
    fn set(&mut self, i: usize, v: Option<Val>) -> Option<Val> {
        if i >= self.len {
            return None;
        }
        let is_some = v.is_some();
        let mut t = &mut self.root;
        let mut shift = self.shift;
        let old = loop {
            match t {
                Tree::Branch(b) => {
                    t = &mut Rc::make_mut(b)[(i >> shift) & MASK];
                    shift = shift.saturating_sub(BITS);
                }
                Tree::Leaf(l) => break std::mem::replace(&mut Rc::make_mut(l)[i & MASK], v),
            }
        };
        self.some = self.some + usize::from(is_some) - usize::from(old.is_some());
        old
    }

    /// Every value that is there, in index order.
    fn for_each<'a>(&'a self, f: &mut dyn FnMut(usize, &'a Val)) {
        fn walk<'a>(
            t: &'a Tree,
            base: usize,
            shift: u32,
            len: usize,
            f: &mut dyn FnMut(usize, &'a Val),
        ) {
            match t {
                Tree::Leaf(l) => {
                    for (k, v) in l.iter().enumerate() {
                        if let (Some(v), true) = (v, base + k < len) {
                            f(base + k, v);
                        }
                    }
                }
                Tree::Branch(b) => {
                    for (k, c) in b.iter().enumerate() {
                        let at = base + (k << shift);
                        if at >= len {
                            break;
                        }
                        walk(c, at, shift.saturating_sub(BITS), len, f);
                    }
                }
            }
        }
        if self.some > 0 {
            walk(&self.root, 0, self.shift, self.len, f);
        }
    }
}

/// The merged document: `doc` (the tree) with the cells over its root. Cheap to copy.
#[derive(Clone, Copy)]
pub struct Merged<'a> {
    pub doc: &'a Val,
    pub cells: &'a Cells,
}

impl<'a> Merged<'a> {
    /// The value of a top-level member. Cells count only over an object root (a derived member
    /// of a scalar root does not exist, as in the tree).
    #[inline]
    pub fn root_get(&self, k: &str) -> Option<&'a Val> {
        let Val::Obj(m) = self.doc else { return None };
        if let Some(c) = self.cells.layout.find(k) {
            if let Some(v) = self.cells.get(c) {
                return Some(v);
            }
        }
        m.get(k)
    }

    /// The value of the top-level member `k` whose cell is `cell` (known at compile time).
    #[inline]
    pub fn cell_or_member(&self, cell: u32, k: &str) -> Option<&'a Val> {
        let Val::Obj(m) = self.doc else { return None };
        self.cells.get(cell).or_else(|| m.get(k))
    }

    /// The value at a concrete, non-empty address (`None` for the root: see [`Merged::root`]).
    #[inline]
    pub fn get_path(&self, path: &[Seg]) -> Option<&'a Val> {
        match path.split_first() {
            Some((Seg::Field(k), rest)) => self.root_get(k)?.get_path(rest),
            Some(_) => self.doc.get_path(path),
            None if self.cells.any() => None,
            None => Some(self.doc),
        }
    }

    /// The value at `prefix` followed by `path`.
    #[inline]
    pub fn get_at(&self, prefix: &[Seg], path: &[Seg]) -> Option<&'a Val> {
        if prefix.is_empty() {
            self.get_path(path)
        } else {
            self.get_path(prefix)?.get_path(path)
        }
    }

    /// The value at an address as a JSONata value (the root included); `Null` when absent.
    pub fn jvalue_at(&self, path: &[Seg]) -> JValue {
        if path.is_empty() {
            return self.to_jvalue();
        }
        self.get_path(path).map_or(JValue::Null, to_jvalue)
    }

    /// Whether the root is an object.
    pub fn root_is_obj(&self) -> bool {
        matches!(self.doc, Val::Obj(_))
    }

    /// The root's members in document order: the tree's (a cell shadowing its namesake in
    /// place), then the cells the tree does not have, in evaluation order.
    pub fn members(&self) -> Vec<(&'a Key, &'a Val)> {
        let Val::Obj(m) = self.doc else {
            return Vec::new();
        };
        let layout = &self.cells.layout;
        let mut out: Vec<(&Key, &Val)> = m
            .iter()
            .map(|(k, v)| {
                let v = layout.find(k).and_then(|c| self.cells.get(c)).unwrap_or(v);
                (k, v)
            })
            .collect();
        self.cells.vals.for_each(&mut |c, v| {
            let k = layout.key(c as u32);
            if m.get(k).is_none() {
                out.push((k, v));
            }
        });
        out
    }

    /// The whole merged document as one value (O(size); for whole-document readers).
    pub fn root(&self) -> Val {
        if !self.cells.any() || !self.root_is_obj() {
            return self.doc.clone();
        }
        let mut m = valem_core::value::ObjMap::new();
        for (k, v) in self.members() {
            m.insert(k.clone(), v.clone());
        }
        Val::Obj(m)
    }

    /// The whole merged document as a JSONata value.
    pub fn to_jvalue(&self) -> JValue {
        if !self.cells.any() || !self.root_is_obj() {
            return to_jvalue(self.doc);
        }
        let members = self.members();
        let mut o = IndexMap::with_capacity(members.len());
        for (k, v) in members {
            o.insert(k.to_string(), to_jvalue(v));
        }
        JValue::object(o)
    }

    /// The whole merged document as JSON, in its own order.
    pub fn to_json(&self) -> Json {
        if !self.cells.any() || !self.root_is_obj() {
            return self.doc.to_json();
        }
        Json::Object(
            self.members()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_json()))
                .collect(),
        )
    }

    /// The merged document as the reference prints it: in every object the base fields first,
    /// in their order, then the derived fields in the order they were first computed.
    pub fn ordered_json(&self, base: &Val) -> Json {
        match (base, self.doc) {
            (Val::Obj(b), Val::Obj(_)) => {
                let members = self.members();
                let mut o = Map::with_capacity(members.len());
                for (k, bv) in b.iter() {
                    if let Some(mv) = self.root_get(k) {
                        o.insert(k.to_string(), ordered_json(Some(bv), mv));
                    }
                }
                for (k, mv) in members {
                    if !o.contains_key(&**k) {
                        o.insert(k.to_string(), ordered_json(None, mv));
                    }
                }
                Json::Object(o)
            }
            _ => ordered_json(Some(base), self.doc),
        }
    }

    /// Derived values: every address whose merged value is not (or not wholly) the base
    /// value, keyed by canonical address.
    pub fn derived_diff(&self, base: &Val, out: &mut Map<String, Json>) {
        let mut at = Vec::new();
        match (base, self.doc) {
            (Val::Obj(b), Val::Obj(_)) => {
                for (k, mv) in self.members() {
                    at.push(Seg::Field(k.clone()));
                    derived_diff(b.get(k), mv, &mut at, out);
                    at.pop();
                }
            }
            _ => derived_diff(Some(base), self.doc, &mut at, out),
        }
    }
}

fn derived_diff(base: Option<&Val>, merged: &Val, at: &mut Vec<Seg>, out: &mut Map<String, Json>) {
    match (base, merged) {
        (Some(Val::Obj(b)), Val::Obj(m)) => {
            for (k, mv) in m.iter() {
                at.push(Seg::Field(k.clone()));
                derived_diff(b.get(k), mv, at, out);
                at.pop();
            }
        }
        (Some(Val::Arr(b)), Val::Arr(m)) => {
            for (i, mv) in m.iter().enumerate() {
                at.push(Seg::Index(i));
                derived_diff(b.get(i), mv, at, out);
                at.pop();
            }
        }
        (Some(b), m) if b == m => {}
        (_, m) => {
            out.insert(render(at), m.to_json());
        }
    }
}

/// `base` and a merged value below the root printed in the reference's order (base fields
/// first, then derived ones).
pub fn ordered_json(base: Option<&Val>, merged: &Val) -> Json {
    match (base, merged) {
        (Some(Val::Obj(b)), Val::Obj(m)) => {
            let mut o = Map::with_capacity(m.len());
            for (k, bv) in b.iter() {
                if let Some(mv) = m.get(k) {
                    o.insert(k.to_string(), ordered_json(Some(bv), mv));
                }
            }
            for (k, mv) in m.iter() {
                if !o.contains_key(&**k) {
                    o.insert(k.to_string(), ordered_json(None, mv));
                }
            }
            Json::Object(o)
        }
        (Some(Val::Arr(b)), Val::Arr(m)) => Json::Array(
            m.iter()
                .enumerate()
                .map(|(i, mv)| ordered_json(b.get(i), mv))
                .collect(),
        ),
        (_, m) => m.to_json(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_vec_matches_a_vector_and_clones_stay_apart() {
        for len in [0usize, 1, 63, 64, 65, 4095, 4096, 4097, 100_003] {
            let mut v = CellVec::new(len);
            let mut reference: Vec<Option<f64>> = vec![None; len];
            let mut x: u64 = 11;
            let mut snapshot = None;
            for step in 0..3000u64 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                if len == 0 {
                    assert_eq!(v.set(0, Some(Val::num(1.0))), None);
                    break;
                }
                let i = (x >> 33) as usize % len;
                let new = !(x >> 20).is_multiple_of(4);
                let val = new.then(|| Val::num(step as f64));
                let old = v.set(i, val.clone());
                assert_eq!(old.and_then(|o| o.as_f64()), reference[i]);
                reference[i] = new.then_some(step as f64);
                if step == 1500 {
                    snapshot = Some((v.clone(), reference.clone()));
                }
            }
            let mut seen = Vec::new();
            v.for_each(&mut |i, val| seen.push((i, val.as_f64())));
            let want: Vec<(usize, Option<f64>)> = reference
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.map(|r| (i, Some(r))))
                .collect();
            assert_eq!(seen, want, "len {len}");
            assert_eq!(v.some, want.len());
            for (i, r) in reference.iter().enumerate() {
                assert_eq!(v.get(i).and_then(Val::as_f64), *r);
            }
            assert_eq!(v.get(len), None);
            if let Some((snap, r)) = snapshot {
                for (i, want) in r.iter().enumerate() {
                    assert_eq!(snap.get(i).and_then(Val::as_f64), *want, "snapshot changed");
                }
            }
        }
    }
}
