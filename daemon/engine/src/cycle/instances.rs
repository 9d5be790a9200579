//! Concrete instances of `[*]` patterns: expanding a pattern over the merged document, within
//! the cycle's instance limit.

use super::*;

/// Concrete instances of a pattern, their segments one after another (one allocation for
/// all of them, not one per instance).
#[derive(Debug, Default)]
pub(super) struct Insts {
    pub(super) segs: Vec<Seg>,
    pub(super) ends: Vec<u32>,
}

impl Insts {
    pub(super) fn one(inst: Vec<Seg>) -> Insts {
        Insts {
            ends: vec![inst.len() as u32],
            segs: inst,
        }
    }

    pub(super) fn push(&mut self, inst: &[Seg]) {
        self.segs.extend_from_slice(inst);
        self.ends.push(self.segs.len() as u32);
    }

    pub(super) fn len(&self) -> usize {
        self.ends.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &[Seg]> + '_ {
        crate::trace::spans(&self.ends).map(|r| &self.segs[r])
    }

    pub(super) fn extend(&mut self, other: &Insts) {
        for inst in other.iter() {
            self.push(inst);
        }
    }

    /// Sorted, without duplicates.
    pub(super) fn sort_dedup(self) -> Insts {
        let mut all: Vec<&[Seg]> = self.iter().collect();
        all.sort_unstable();
        all.dedup();
        let mut out = Insts::default();
        for inst in all {
            out.push(inst);
        }
        out
    }
}

/// Does the concrete path `c` match the pattern (wildcards match any index)?
pub(super) fn matches_pattern(pattern: &Address, c: &[Seg]) -> bool {
    pattern.segs.len() == c.len()
        && pattern.segs.iter().zip(c).all(|(p, s)| match (p, s) {
            (PathSeg::Wild, Seg::Index(_)) => true,
            (PathSeg::Index(i), Seg::Index(j)) => i == j,
            (PathSeg::Field(a), Seg::Field(b)) => a == b,
            _ => false,
        })
}

/// The instance's prefix through the pattern's last `[*]`.
pub(super) fn element_prefix<'s>(pattern: &Address, inst: &'s [Seg]) -> &'s [Seg] {
    let n = pattern
        .segs
        .iter()
        .rposition(|s| matches!(s, PathSeg::Wild))
        .map_or(0, |p| p + 1);
    &inst[..n.min(inst.len())]
}

/// Concrete instances of a pattern in the merged document, optionally restricted to bound
/// leading wildcards.
pub(super) fn expand_root(
    segs: &[PathSeg],
    m: Merged<'_>,
    bind: Option<&[usize]>,
    out: &mut Insts,
) {
    match segs.split_first() {
        None => out.push(&[]),
        Some((PathSeg::Field(k), rest)) if m.root_is_obj() => {
            let next = m.root_get(k);
            if next.is_none() && rest.iter().any(|s| matches!(s, PathSeg::Wild)) {
                return;
            }
            let mut cur = vec![Seg::Field(k.clone())];
            expand(rest, next, bind, 0, &mut cur, out);
        }
        Some(_) => expand(segs, Some(m.doc), bind, 0, &mut Vec::new(), out),
    }
}

/// Concrete instances of a pattern in `v`, optionally restricted to bound leading wildcards.
pub(super) fn expand(
    segs: &[PathSeg],
    v: Option<&Val>,
    bind: Option<&[usize]>,
    wi: usize,
    cur: &mut Vec<Seg>,
    out: &mut Insts,
) {
    let Some((first, rest)) = segs.split_first() else {
        out.push(cur);
        return;
    };
    match first {
        PathSeg::Field(k) => {
            let next = match v {
                Some(Val::Obj(m)) => m.get(k),
                _ => None,
            };
            if next.is_none() && rest.iter().any(|s| matches!(s, PathSeg::Wild)) {
                return;
            }
            cur.push(Seg::Field(k.clone()));
            expand(rest, next, bind, wi, cur, out);
            cur.pop();
        }
        PathSeg::Index(i) => {
            let next = match v {
                Some(Val::Arr(a)) => a.get(*i),
                _ => None,
            };
            if next.is_none() && rest.iter().any(|s| matches!(s, PathSeg::Wild)) {
                return;
            }
            cur.push(Seg::Index(*i));
            expand(rest, next, bind, wi, cur, out);
            cur.pop();
        }
        PathSeg::Wild => {
            let Some(Val::Arr(a)) = v else { return };
            match bind.and_then(|b| b.get(wi)) {
                Some(&i) => {
                    if let Some(x) = a.get(i) {
                        cur.push(Seg::Index(i));
                        expand(rest, Some(x), bind, wi + 1, cur, out);
                        cur.pop();
                    }
                }
                None => {
                    for (i, x) in a.iter().enumerate() {
                        cur.push(Seg::Index(i));
                        expand(rest, Some(x), bind, wi + 1, cur, out);
                        cur.pop();
                    }
                }
            }
        }
    }
}

impl<'a> Cycle<'a> {
    /// The instances of `pattern` to evaluate for node `id`; none, and the cycle stopped, when
    /// they are more than [`EngineLimits::max_instances`].
    pub(super) fn instances(&mut self, id: NodeId, pattern: &Address) -> Insts {
        let insts = self.expand_instances(id, pattern);
        if insts.len() > self.limits.max_instances {
            self.stop(MutationError::Invalid(format!(
                "{pattern} spans {} instances, more than the limit of {}; nothing was written",
                insts.len(),
                self.limits.max_instances
            )));
            return Insts::default();
        }
        insts
    }

    pub(super) fn expand_instances(&self, id: NodeId, pattern: &Address) -> Insts {
        if let Some(c) = pattern.concrete() {
            return Insts::one(c);
        }
        // One expansion yields distinct instances in ascending order already; several bound
        // prefixes may overlap, so their union is sorted and de-duplicated.
        let mut out = Insts::default();
        match self.sc.bound(id) {
            None => expand_root(&pattern.segs, self.st.merged(), None, &mut out),
            Some(prefixes) => {
                for p in prefixes {
                    expand_root(&pattern.segs, self.st.merged(), Some(p), &mut out);
                }
                if prefixes.len() > 1 {
                    out = out.sort_dedup();
                }
            }
        }
        out
    }
}
