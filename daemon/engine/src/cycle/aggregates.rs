//! Aggregates: native `$sum/$count/$average/$max/$min` over a field path, and the delta
//! aggregates that apply noted leaf changes instead of rescanning.

use super::*;

/// Native `$sum/$count/$average/$max/$min` over a field path. `None` means "let JSONata
/// decide" (anything but plain numbers under plain objects, so errors and odd shapes keep
/// JSONata's exact behaviour).
pub(super) fn aggregate(doc: Merged<'_>, agg: &Aggregate) -> Option<Option<JValue>> {
    let mut leaves: Vec<&Val> = Vec::new();
    if !collect_root(doc, &agg.path, &mut leaves) {
        return None;
    }
    if agg.func == AggFunc::Count {
        return Some(Some(JValue::Number(leaves.len() as f64)));
    }
    let mut nums = Vec::with_capacity(leaves.len());
    for l in leaves {
        match l {
            Val::Num(n) => nums.push(*n),
            _ => return None,
        }
    }
    Some(match agg.func {
        AggFunc::Sum => Some(JValue::Number(nums.iter().sum())),
        AggFunc::Average if nums.is_empty() => None,
        AggFunc::Average => Some(JValue::Number(nums.iter().sum::<f64>() / nums.len() as f64)),
        AggFunc::Max => nums.iter().copied().reduce(f64::max).map(JValue::Number),
        AggFunc::Min => nums.iter().copied().reduce(f64::min).map(JValue::Number),
        AggFunc::Count => unreachable!("handled above"),
    })
}

/// 2^53: integers up to this magnitude, and their sums up to it, are exact in an f64.
pub(super) const EXACT: f64 = 9_007_199_254_740_992.0;

/// A memo's totals after the noted leaf changes; `None` when a change would make it inexact
/// (a non-integer, or magnitudes past 2^53): then the caller rescans.
pub(super) fn apply_changes(mut m: AggMemo, changes: &[LeafChange]) -> Option<AggMemo> {
    for &(_, old, new) in changes {
        if let Some(o) = old {
            m.sum -= o;
            m.abs_sum -= o.abs();
            m.count = m.count.checked_sub(1)?;
        }
        if let Some(n) = new {
            if n.fract() != 0.0 || m.abs_sum + n.abs() > EXACT {
                return None;
            }
            m.sum += n;
            m.abs_sum += n.abs();
            m.count += 1;
        }
    }
    Some(m)
}

/// An aggregate's memo from a full scan (the same left-to-right sum `aggregate` computes);
/// `None` when a leaf is not a number or the shape is left to JSONata.
pub(super) fn scan_memo(doc: Merged<'_>, agg: &Aggregate) -> Option<AggMemo> {
    let mut leaves: Vec<&Val> = Vec::new();
    if !collect_root(doc, &agg.path, &mut leaves) {
        return None;
    }
    let mut m = AggMemo {
        sum: 0.0,
        abs_sum: 0.0,
        count: leaves.len(),
        exact: true,
        leaves: None,
    };
    for l in &leaves {
        let Val::Num(x) = l else { return None };
        m.abs_sum += x.abs();
        m.exact &= x.fract() == 0.0;
    }
    // All numbers (checked above): the same left-to-right `sum` as `aggregate`'s.
    m.sum = leaves
        .iter()
        .filter_map(|l| match l {
            Val::Num(x) => Some(*x),
            _ => None,
        })
        .sum();
    m.exact &= m.abs_sum <= EXACT;
    // Inexact over an array whose every element has its number: keep the numbers, so a change
    // of one is not a walk of the whole array.
    let whole = match (agg.path.len(), doc.root_get(&agg.path[0])) {
        (2, Some(Val::Arr(a))) => a.len() == leaves.len(),
        _ => false,
    };
    if !m.exact && whole {
        let mut nums = Vec::with_capacity(leaves.len());
        nums.extend(leaves.iter().filter_map(|l| match l {
            Val::Num(x) => Some(*x),
            _ => None,
        }));
        m.leaves = Some(Arc::new(nums));
    }
    Some(m)
}

/// `collect` from the merged document's root.
pub(super) fn collect_root<'v>(
    m: Merged<'v>,
    path: &[valem_core::value::Key],
    out: &mut Vec<&'v Val>,
) -> bool {
    match path.split_first() {
        Some((k, rest)) if m.root_is_obj() => member(m.root_get(k), rest, out),
        _ => collect(m.doc, path, out),
    }
}

/// Navigate like a JSONata path over plain data; false on shapes we leave to JSONata.
pub(super) fn collect<'v>(
    v: &'v Val,
    path: &[valem_core::value::Key],
    out: &mut Vec<&'v Val>,
) -> bool {
    let Some((k, rest)) = path.split_first() else {
        match v {
            Val::Arr(_) => return false,
            other => out.push(other),
        }
        return true;
    };
    match v {
        Val::Obj(m) => member(m.get(k), rest, out),
        Val::Null => false,
        _ => true,
    }
}

/// `collect` past an object's member (`None`: absent).
pub(super) fn member<'v>(
    v: Option<&'v Val>,
    rest: &[valem_core::value::Key],
    out: &mut Vec<&'v Val>,
) -> bool {
    match v {
        Some(Val::Arr(a)) if !rest.is_empty() => a.iter().all(|x| match x {
            Val::Arr(_) => false,
            x => collect(x, rest, out),
        }),
        Some(Val::Arr(a)) => {
            for x in a.iter() {
                match x {
                    Val::Arr(_) => return false,
                    x => out.push(x),
                }
            }
            true
        }
        Some(Val::Null) => false,
        Some(x) => collect(x, rest, out),
        None => true,
    }
}

impl<'a> Cycle<'a> {
    /// A delta aggregate's value: its memo updated by the leaf changes noted since it last ran
    /// (by their deltas when the memo is exact, in its kept leaves when it has them), else a
    /// rescan that refreshes the memo. `None` when the leaves are not all numbers (the caller
    /// leaves it to `aggregate` and JSONata).
    pub(super) fn delta_aggregate(&mut self, agg: &Aggregate) -> Option<Option<JValue>> {
        let id = self.evaluating?;
        let delta = self.agg_delta.remove(&id);
        let memo = self.st.aggregates.get(&id);
        let exact = memo.is_some_and(|m| m.exact);
        let updated = match (memo, delta) {
            (Some(m), Some(Some(changes))) if exact => apply_changes(m.clone(), &changes)
                .and_then(|next| self.replace_memo(id, Some(next))),
            (Some(_), Some(Some(changes))) => self.update_leaves(id, &changes),
            _ => None,
        };
        let (sum, count) = match updated {
            Some(totals) => totals,
            None => {
                let next = scan_memo(self.st.merged(), agg);
                self.replace_memo(id, next)?
            }
        };
        Some(match agg.func {
            AggFunc::Count => Some(JValue::Number(count as f64)),
            AggFunc::Average if count == 0 => None,
            AggFunc::Average => Some(JValue::Number(sum / count as f64)),
            _ => Some(JValue::Number(sum)),
        })
    }

    /// Put `next` in place of aggregate `id`'s memo (journaled when it differs); its sum and
    /// count.
    pub(super) fn replace_memo(
        &mut self,
        id: NodeId,
        next: Option<AggMemo>,
    ) -> Option<(f64, usize)> {
        let totals = next.as_ref().map(|m| (m.sum, m.count));
        let memo = self.st.aggregates.get(&id);
        if next.as_ref() != memo {
            let old = match next {
                Some(m) => self.st.aggregates.insert(id, m),
                None => self.st.aggregates.remove(&id),
            };
            self.journal.aggregates.push(AggUndo::Memo(id, old));
        }
        totals
    }

    /// Apply leaf changes to an inexact memo's [`AggMemo::leaves`] in place and sum them again;
    /// `None` (the memo untouched) when a change is not the replacement of a number it holds.
    pub(super) fn update_leaves(
        &mut self,
        id: NodeId,
        changes: &[LeafChange],
    ) -> Option<(f64, usize)> {
        let m = self.st.aggregates.get(&id)?;
        let leaves = m.leaves.as_ref()?;
        let fits = changes
            .iter()
            .all(|&(k, old, new)| new.is_some() && old.is_some() && leaves.get(k).copied() == old);
        if !fits {
            return None;
        }
        // Taken out of the map so the leaves are changed in place (a state kept elsewhere
        // that shares them gets its own copy first).
        let mut m = self.st.aggregates.remove(&id)?;
        let Some(leaves) = m.leaves.as_mut() else {
            // Checked above; put it back as it was all the same.
            self.st.aggregates.insert(id, m);
            return None;
        };
        let v = Arc::make_mut(leaves);
        let mut changed = Vec::with_capacity(changes.len());
        for &(k, _, new) in changes {
            if let (Some(x), Some(n)) = (v.get_mut(k), new) {
                changed.push((k as u32, *x));
                *x = n;
            }
        }
        let before = m.sum;
        m.sum = v.iter().sum();
        let totals = (m.sum, m.count);
        self.st.aggregates.insert(id, m);
        self.journal.aggregates.push(AggUndo::Leaves {
            id,
            sum: before,
            changed,
        });
        Some(totals)
    }

    /// Forget the memo of an aggregate that saw changes it did not run for.
    pub(super) fn drop_unrun_aggregates(&mut self) {
        for (id, _) in std::mem::take(&mut self.agg_delta) {
            if let Some(old) = self.st.aggregates.remove(&id) {
                self.journal.aggregates.push(AggUndo::Memo(id, Some(old)));
            }
        }
    }
}
