//! The undo journal of a cycle: what it changed, saved before the change, and replayed
//! backwards when the cycle fails (or by `?at=` reads).

use super::*;

/// What a cycle changed, to undo it exactly if the cycle fails. The cycle mutates the committed
/// state in place (no copy when nobody else holds it); a top-level member of the base and
/// merged documents is saved once, before its first change (an O(1) persistent clone), except
/// that a derived value written deeper is journaled by its address alone (`TreeUndo::Path`).
#[derive(Clone, Debug, Default)]
pub(super) struct Journal {
    pub(super) base: Vec<TreeUndo>,
    pub(super) merged: Vec<TreeUndo>,
    pub(super) base_seen: KeyedSet<valem_core::value::Key>,
    pub(super) merged_seen: KeyedSet<valem_core::value::Key>,
    pub(super) base_root: bool,
    pub(super) merged_root: bool,
    pub(super) meta: Vec<(Arc<str>, Option<MetaEntry>)>,
    pub(super) stale: Vec<(NodeId, bool)>,
    pub(super) effect_keys: Vec<(Arc<str>, Option<Val>)>,
    pub(super) aggregates: Vec<AggUndo>,
    /// Cells written: each one's previous value.
    pub(super) cells: Vec<(u32, Option<Val>)>,
    /// The addresses of `TreeUndo::Path` entries, one after another.
    pub(super) path_segs: Vec<Seg>,
}

/// What one committed cycle (or one materialisation of lazy derivations) changed: undone on a
/// copy of a later state, it gives the state from before it ([`crate::Model::record_undo`]).
/// This is how the daemon keeps its recent history without holding a snapshot per commit
/// (holding one makes the next commit copy every branch on the paths it writes).
#[derive(Debug)]
pub struct Undo(pub(super) Journal);

impl Undo {
    /// Put `st` back to how it was before this change (`st` is that change's result or a
    /// state reached from it by undoing later changes).
    pub(crate) fn apply(&self, st: &mut State) {
        undo_journal(st, self.0.clone());
    }
}

/// Undo everything `j` records in `st`, newest change first.
pub(super) fn undo_journal(st: &mut State, j: Journal) {
    undo(&mut st.base, j.base, &[]);
    if let Some(tree) = &mut st.tree {
        undo(tree, j.merged, &j.path_segs);
    }
    for (c, old) in j.cells.into_iter().rev() {
        st.cells.set(c, old);
    }
    restore(&mut st.meta, j.meta);
    for (id, was) in j.stale.into_iter().rev() {
        if was {
            st.lazy_stale.insert(id);
        } else {
            st.lazy_stale.remove(&id);
        }
    }
    restore(&mut st.effect_keys, j.effect_keys);
    for undo in j.aggregates.into_iter().rev() {
        match undo {
            AggUndo::Memo(id, Some(m)) => {
                st.aggregates.insert(id, m);
            }
            AggUndo::Memo(id, None) => {
                st.aggregates.remove(&id);
            }
            AggUndo::Leaves { id, sum, changed } => {
                if let Some(mut m) = st.aggregates.remove(&id) {
                    if let Some(leaves) = &mut m.leaves {
                        let v = Arc::make_mut(leaves);
                        for &(k, old) in changed.iter().rev() {
                            if let Some(x) = v.get_mut(k as usize) {
                                *x = old;
                            }
                        }
                    }
                    m.sum = sum;
                    st.aggregates.insert(id, m);
                }
            }
        }
    }
}

/// What a cycle changed of a delta aggregate's memo.
#[derive(Clone, Debug)]
pub(super) enum AggUndo {
    /// The memo it replaced (`None`: there was none).
    Memo(NodeId, Option<AggMemo>),
    /// Leaves replaced in place ([`AggMemo::leaves`]): each one's index and old number, in the
    /// order they changed, and the sum before.
    Leaves {
        id: NodeId,
        sum: f64,
        changed: Vec<(u32, f64)>,
    },
}

/// Buffers up to this many entries are always kept for the next cycle.
pub(super) const KEEP_ENTRIES: usize = 4096;

/// Empty `v` for reuse, but let a large buffer go when the cycle that just used it needed far
/// less (a one-off bulk cycle — initial data — does not pin its peak for the model's life,
/// while a model whose every cycle is large keeps reusing it).
pub(super) fn recycle<T>(v: &mut Vec<T>) {
    if oversized(v.capacity(), v.len()) {
        *v = Vec::new();
    } else {
        v.clear();
    }
}

pub(super) fn recycle_set<T, S: Default>(s: &mut std::collections::HashSet<T, S>) {
    if oversized(s.capacity(), s.len()) {
        *s = Default::default();
    } else {
        s.clear();
    }
}

/// A buffer worth letting go (see [`recycle`]).
pub(super) fn oversized(capacity: usize, used: usize) -> bool {
    capacity > KEEP_ENTRIES && capacity > 4 * used
}

impl Journal {
    /// Nothing recorded (a journal parked between cycles must be).
    pub(super) fn is_clear(&self) -> bool {
        self.base.is_empty()
            && self.merged.is_empty()
            && self.base_seen.is_empty()
            && self.merged_seen.is_empty()
            && !self.base_root
            && !self.merged_root
            && self.meta.is_empty()
            && self.stale.is_empty()
            && self.effect_keys.is_empty()
            && self.aggregates.is_empty()
            && self.cells.is_empty()
            && self.path_segs.is_empty()
    }

    /// Empty it, keeping its buffers (see [`recycle`]).
    pub(super) fn clear(&mut self) {
        recycle(&mut self.base);
        recycle(&mut self.merged);
        recycle_set(&mut self.base_seen);
        recycle_set(&mut self.merged_seen);
        self.base_root = false;
        self.merged_root = false;
        recycle(&mut self.meta);
        recycle(&mut self.stale);
        recycle(&mut self.effect_keys);
        recycle(&mut self.aggregates);
        recycle(&mut self.cells);
        recycle(&mut self.path_segs);
    }
}

/// Save the top-level member of `doc` that a write at `path` changes (or the whole root).
pub(super) fn save(
    doc: &Val,
    path: &[Seg],
    log: &mut Vec<TreeUndo>,
    seen: &mut KeyedSet<valem_core::value::Key>,
    root_saved: &mut bool,
) {
    match (path.first(), doc) {
        (Some(Seg::Field(k)), Val::Obj(m)) => {
            if seen.insert(k.clone()) {
                log.push(TreeUndo::Member(Some(k.clone()), m.get(k).cloned()));
            }
        }
        _ => {
            if !*root_saved {
                *root_saved = true;
                log.push(TreeUndo::Member(None, Some(doc.clone())));
            }
        }
    }
}

/// One entry of a document's undo log.
#[derive(Clone, Debug)]
pub(super) enum TreeUndo {
    /// A top-level member (`None`: the whole root) and what it held before.
    Member(Option<valem_core::value::Key>, Option<Val>),
    /// A nested address (`Journal::path_segs[start..end]`) and what it held (`None`:
    /// nothing; the address is the shallowest one the write created). Written derived values
    /// are journaled this way, so the document is changed in place instead of its top-level
    /// member being kept whole for undo (which would make every written element a copy).
    Path(u32, u32, Option<Val>),
}

/// Undo a document's changes, newest first.
pub(super) fn undo(doc: &mut Val, log: Vec<TreeUndo>, segs: &[Seg]) {
    for entry in log.into_iter().rev() {
        match entry {
            TreeUndo::Member(None, Some(v)) => *doc = v,
            TreeUndo::Member(None, None) => {}
            TreeUndo::Member(Some(k), Some(v)) => {
                if let Val::Obj(m) = doc {
                    m.insert(k, v);
                }
            }
            TreeUndo::Member(Some(k), None) => {
                if let Val::Obj(m) = doc {
                    m.remove(&k);
                }
            }
            TreeUndo::Path(start, end, old) => {
                let path = &segs[start as usize..end as usize];
                match old {
                    Some(v) => {
                        doc.splice_existing(path, v);
                    }
                    None => {
                        doc.remove_path(path);
                    }
                }
            }
        }
    }
}

/// The undo entry for writing at the nested address `path` of `doc`: its current value, or
/// the shallowest address on it that does not exist yet (what the write creates). The address
/// goes to `segs`.
pub(super) fn path_undo(doc: &Val, path: &[Seg], segs: &mut Vec<Seg>) -> TreeUndo {
    let start = segs.len() as u32;
    let mut cur = Some(doc);
    let mut len = 0;
    while let (Some(v), Some(seg)) = (cur, path.get(len)) {
        len += 1;
        cur = match (seg, v) {
            (Seg::Field(k), Val::Obj(m)) => m.get(k),
            (Seg::Index(j), Val::Arr(a)) => a.get(*j),
            _ => None,
        };
    }
    segs.extend_from_slice(&path[..len]);
    TreeUndo::Path(start, segs.len() as u32, cur.cloned())
}

/// Put back the previous values of a keyed map, newest change first.
pub(super) fn restore<V: Clone>(
    map: &mut imbl::OrdMap<Arc<str>, V>,
    log: Vec<(Arc<str>, Option<V>)>,
) {
    for (k, old) in log.into_iter().rev() {
        match old {
            Some(v) => {
                map.insert(k, v);
            }
            None => {
                map.remove(&k);
            }
        }
    }
}
