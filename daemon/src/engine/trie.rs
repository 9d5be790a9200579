//! Path tries over address segments: the reader index (written path → nodes that read it, its
//! ancestors or its descendants, with the `[*]` indices the match binds) and the producer index
//! (where derivations write). Arrays are mapped implicitly, as JSONata navigation does: a read of
//! `$.items.total` matches a write of `$.items[3].total`.

use rustc_hash::FxHashMap as HashMap;

use crate::value::{Key, Seg};

/// One segment of an indexed pattern.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TSeg {
    Field(Key),
    Index(usize),
    /// `[*]`: in a reader path it binds the node's wildcard of the same ordinal.
    Wild,
}

#[derive(Default, Debug)]
struct TNode {
    fields: HashMap<Key, u32>,
    indices: HashMap<usize, u32>,
    wild: Option<u32>,
    entries: Vec<u32>,
}

/// A trie whose entries are node ids.
#[derive(Debug)]
pub struct Trie {
    nodes: Vec<TNode>,
}

impl Default for Trie {
    fn default() -> Self {
        Trie {
            nodes: vec![TNode::default()],
        }
    }
}

/// A node reached by a write, with the array indices bound to its first wildcards (fewer than
/// its wildcard count means "every instance below this prefix").
pub type Hit = (u32, Vec<usize>);

impl Trie {
    pub fn insert(&mut self, path: &[TSeg], entry: u32) {
        let mut t = 0usize;
        for seg in path {
            let next = match seg {
                TSeg::Field(k) => self.nodes[t].fields.get(k).copied(),
                TSeg::Index(i) => self.nodes[t].indices.get(i).copied(),
                TSeg::Wild => self.nodes[t].wild,
            };
            t = match next {
                Some(n) => n as usize,
                None => {
                    let n = self.nodes.len() as u32;
                    self.nodes.push(TNode::default());
                    match seg {
                        TSeg::Field(k) => {
                            self.nodes[t].fields.insert(k.clone(), n);
                        }
                        TSeg::Index(i) => {
                            self.nodes[t].indices.insert(*i, n);
                        }
                        TSeg::Wild => self.nodes[t].wild = Some(n),
                    }
                    n as usize
                }
            };
        }
        if !self.nodes[t].entries.contains(&entry) {
            self.nodes[t].entries.push(entry);
        }
    }

    /// Readers affected by a write at the concrete path `w`: those reading `w`, an ancestor of
    /// it, or something below it.
    pub fn hits(&self, w: &[Seg], out: &mut Vec<Hit>) {
        let mut bind = Vec::new();
        self.walk(0, w, &mut bind, false, out);
    }

    fn walk(&self, t: usize, w: &[Seg], bind: &mut Vec<usize>, skipped: bool, out: &mut Vec<Hit>) {
        let node = &self.nodes[t];
        if !skipped {
            for &e in &node.entries {
                out.push((e, bind.clone()));
            }
        }
        match w.split_first() {
            None => self.subtree(t, bind, skipped, out),
            Some((Seg::Field(k), rest)) => {
                if let Some(&c) = node.fields.get(k) {
                    self.walk(c as usize, rest, bind, false, out);
                }
            }
            Some((Seg::Index(i), rest)) => {
                if let Some(c) = node.wild {
                    bind.push(*i);
                    self.walk(c as usize, rest, bind, false, out);
                    bind.pop();
                }
                if let Some(&c) = node.indices.get(i) {
                    self.walk(c as usize, rest, bind, false, out);
                }
                // Implicit mapping: field reads below this node see through the index.
                self.walk(t, rest, bind, true, out);
            }
        }
    }

    /// Everything indexed strictly below `t`. After an implicitly skipped index, array children
    /// were already visited with their binding and are left out.
    fn subtree(&self, t: usize, bind: &[usize], skip_arrays: bool, out: &mut Vec<Hit>) {
        let node = &self.nodes[t];
        for &c in node.fields.values() {
            self.all(c as usize, bind, out);
        }
        if !skip_arrays {
            if let Some(c) = node.wild {
                self.all(c as usize, bind, out);
            }
            for &c in node.indices.values() {
                self.all(c as usize, bind, out);
            }
        }
    }

    fn all(&self, t: usize, bind: &[usize], out: &mut Vec<Hit>) {
        for &e in &self.nodes[t].entries {
            out.push((e, bind.to_vec()));
        }
        self.subtree(t, bind, false, out);
    }

    /// Entries whose pattern overlaps the pattern `r` (compile-time edges): at or above `r`,
    /// or below it; a field segment of `r` also passes through array levels of the index.
    pub fn overlapping(&self, r: &[TSeg], out: &mut Vec<u32>) {
        self.overlap(0, r, out, 0);
    }

    fn overlap(&self, t: usize, r: &[TSeg], out: &mut Vec<u32>, depth: usize) {
        if depth > 512 {
            return;
        }
        let node = &self.nodes[t];
        out.extend_from_slice(&node.entries);
        match r.split_first() {
            None => {
                let mut hits = Vec::new();
                self.subtree(t, &[], false, &mut hits);
                out.extend(hits.into_iter().map(|(e, _)| e));
            }
            Some((TSeg::Field(k), rest)) => {
                if let Some(&c) = node.fields.get(k) {
                    self.overlap(c as usize, rest, out, depth + 1);
                }
                if let Some(c) = node.wild {
                    self.overlap(c as usize, r, out, depth + 1);
                }
                for &c in node.indices.values() {
                    self.overlap(c as usize, r, out, depth + 1);
                }
            }
            Some((TSeg::Wild, rest)) => {
                if let Some(c) = node.wild {
                    self.overlap(c as usize, rest, out, depth + 1);
                }
                for &c in node.indices.values() {
                    self.overlap(c as usize, rest, out, depth + 1);
                }
            }
            Some((TSeg::Index(i), rest)) => {
                if let Some(c) = node.wild {
                    self.overlap(c as usize, rest, out, depth + 1);
                }
                if let Some(&c) = node.indices.get(i) {
                    self.overlap(c as usize, rest, out, depth + 1);
                }
            }
        }
    }

    /// Entries whose pattern is at or above the concrete path `w` (is `w` inside a value they
    /// own?), and, separately, entries strictly below it.
    pub fn around(&self, w: &[Seg], above: &mut Vec<u32>, below: &mut Vec<Hit>) {
        let mut t = 0usize;
        let mut bind = Vec::new();
        self.around_walk(&mut t, w, &mut bind, above, below);
    }

    fn around_walk(
        &self,
        t: &mut usize,
        w: &[Seg],
        bind: &mut Vec<usize>,
        above: &mut Vec<u32>,
        below: &mut Vec<Hit>,
    ) {
        let node = &self.nodes[*t];
        match w.split_first() {
            None => {
                above.extend_from_slice(&node.entries);
                self.subtree(*t, bind, false, below);
            }
            Some((seg, rest)) => {
                above.extend_from_slice(&node.entries);
                match seg {
                    Seg::Field(k) => {
                        if let Some(&c) = node.fields.get(k) {
                            let mut c = c as usize;
                            self.around_walk(&mut c, rest, bind, above, below);
                        }
                    }
                    Seg::Index(i) => {
                        if let Some(c) = node.wild {
                            let mut c = c as usize;
                            bind.push(*i);
                            self.around_walk(&mut c, rest, bind, above, below);
                            bind.pop();
                        }
                        if let Some(&c) = node.indices.get(i) {
                            let mut c = c as usize;
                            self.around_walk(&mut c, rest, bind, above, below);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn f(k: &str) -> TSeg {
        TSeg::Field(Arc::from(k))
    }
    fn sf(k: &str) -> Seg {
        Seg::Field(Arc::from(k))
    }

    #[test]
    fn implicit_mapping_and_bindings() {
        let mut t = Trie::default();
        t.insert(&[f("items"), f("total")], 1); // $sum(items.total)
        t.insert(&[f("items"), TSeg::Wild, f("price")], 2); // $parent.price
        t.insert(&[f("other")], 3);
        let mut out = Vec::new();
        t.hits(&[sf("items"), Seg::Index(3), sf("price")], &mut out);
        assert_eq!(out, vec![(2, vec![3])]);
        out.clear();
        t.hits(&[sf("items"), Seg::Index(3), sf("total")], &mut out);
        assert_eq!(out, vec![(1, vec![])]);
        out.clear();
        t.hits(&[sf("items"), Seg::Index(3)], &mut out);
        out.sort();
        assert_eq!(out, vec![(1, vec![]), (2, vec![3])]);
        out.clear();
        t.hits(&[sf("items")], &mut out);
        out.sort();
        assert_eq!(out, vec![(1, vec![]), (2, vec![])]);
    }

    #[test]
    fn overlap_passes_through_arrays() {
        let mut p = Trie::default();
        p.insert(&[f("items"), TSeg::Wild, f("total")], 7);
        p.insert(&[f("sum")], 8);
        let mut out = Vec::new();
        p.overlapping(&[f("items"), f("total")], &mut out);
        assert_eq!(out, vec![7]);
        out.clear();
        p.overlapping(&[f("items")], &mut out);
        assert_eq!(out, vec![7]);
        out.clear();
        p.overlapping(&[f("sum"), f("x")], &mut out);
        assert_eq!(out, vec![8]);
    }
}
