//! One reactive cycle over a working copy of the state: writes are propagated through the reader
//! index to dirty nodes (per `[*]` instance), derivations run level by level with early cutoff,
//! then meta-derivations, constraints and effects. The caller commits the working copy only when
//! the cycle succeeds, so a rollback is simply dropping it.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::Arc;

use indexmap::IndexMap;

use super::compile::{
    AggFunc, Aggregate, CompiledModel, Input, Node, NodeId, NodeKind, Projection,
};
use super::{
    AggMemo, ConstraintViolation, EffectRequest, EngineLimits, MetaEntry, MutationError,
    MutationResult, Paths, State, Traces,
};
use valem_core::expr::path::{render, render_into, Address, PathSeg};
use valem_core::expr::{from_jvalue, jvalue_to_json, to_jvalue, Env, ExprError, Value as JValue};
use valem_core::hash::KeyedSet;
use valem_core::spec::Policy;
use valem_core::value::{room_below, ObjMap, Seg, Val, MAX_DEPTH};
use valem_jit::interp;
use valem_jit::ir::Ty;

use super::jit;
use super::merged::Merged;

/// A noted change of a delta aggregate's leaf: the element's index, the old and new numbers
/// (`None`: absent).
type LeafChange = (usize, Option<f64>, Option<f64>);

/// Traces past which a cycle counts as large (see `Scratch::last_traces`).
const BIG_CYCLE: usize = 4096;

/// Per-node flags of a cycle (`Scratch::flags`).
const QUEUED: u8 = 1; // in `pending` (derivations only)
const DIRTY: u8 = 2; // some instances must be recomputed…
const ALL: u8 = 4; // …all of them
const EVALUATED: u8 = 8; // evaluated already this cycle

/// Which nodes a cycle must recompute, and which instances: flags per node and, for `[*]`
/// nodes dirtied below bound indices, the bound prefixes. Kept with the compiled model between
/// cycles and left clean by each one, so a cycle allocates nothing in proportion to the model.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    flags: Vec<u8>,
    prefixes: HashMap<NodeId, Vec<Vec<usize>>>,
    /// Nodes whose flags were set (to clean them at the end).
    touched: Vec<NodeId>,
    /// The last cycle's journal, emptied: its buffers serve the next cycle.
    journal: Journal,
    /// Traces the last cycle recorded (a large cycle reserves room for as many).
    last_traces: usize,
    /// The batched JIT entry's columns and results, reused (`Cycle::evaluate_batch`).
    batch: BatchBuffers,
}

/// Buffers of one batched JIT call: slot columns, which rows' slots were all numbers, the
/// outputs and their finite flags, and the converted values handed back.
#[derive(Debug, Default)]
struct BatchBuffers {
    cols: Vec<Vec<f64>>,
    guarded: Vec<bool>,
    out: Vec<f64>,
    ok: Vec<u8>,
    vals: Vec<Option<Val>>,
}

impl Scratch {
    #[inline]
    fn set(&mut self, id: NodeId, bits: u8) {
        let f = &mut self.flags[id as usize];
        if *f == 0 {
            self.touched.push(id);
        }
        *f |= bits;
    }

    #[inline]
    fn has(&self, id: NodeId, bits: u8) -> bool {
        self.flags[id as usize] & bits != 0
    }

    /// Dirty the instances below `binding`, or all of them.
    #[inline]
    fn add(&mut self, id: NodeId, binding: Vec<usize>, every: bool) {
        if every {
            self.set(id, DIRTY | ALL);
            if !self.prefixes.is_empty() {
                self.prefixes.remove(&id);
            }
        } else if !self.has(id, ALL) {
            self.set(id, DIRTY);
            self.prefixes.entry(id).or_default().push(binding);
        }
    }

    /// Instances to recompute: `None` for all of them (or a node not dirtied at all).
    fn bound(&self, id: NodeId) -> Option<&[Vec<usize>]> {
        if !self.has(id, DIRTY) || self.has(id, ALL) {
            return None;
        }
        Some(self.prefixes.get(&id).map_or(&[], Vec::as_slice))
    }

    /// Forget that `id` is dirty (it is being recomputed).
    #[inline]
    fn clean(&mut self, id: NodeId) {
        self.flags[id as usize] &= !(QUEUED | DIRTY | ALL);
        if !self.prefixes.is_empty() {
            self.prefixes.remove(&id);
        }
    }

    fn dirty_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.touched
            .iter()
            .copied()
            .filter(|&id| self.has(id, DIRTY))
    }

    fn reset(&mut self) {
        for &id in &self.touched {
            self.flags[id as usize] = 0;
        }
        recycle(&mut self.touched);
        self.prefixes.clear();
        let b = &mut self.batch;
        for c in &mut b.cols {
            recycle(c);
        }
        recycle(&mut b.guarded);
        recycle(&mut b.out);
        recycle(&mut b.ok);
        recycle(&mut b.vals);
    }
}

/// The compiled model's scratch, or a private one when it is in use (a cycle within a cycle).
enum ScratchRef<'a> {
    Shared(std::cell::RefMut<'a, Scratch>),
    Own(Box<Scratch>),
}

impl ScratchRef<'_> {
    fn of(cm: &CompiledModel) -> ScratchRef<'_> {
        let n = cm.nodes.len();
        let mut sc = match cm.scratch.try_borrow_mut() {
            Ok(sc) => ScratchRef::Shared(sc),
            Err(_) => ScratchRef::Own(Box::default()),
        };
        if sc.flags.len() < n {
            sc.flags.resize(n, 0);
        }
        sc
    }
}

impl std::ops::Deref for ScratchRef<'_> {
    type Target = Scratch;
    fn deref(&self) -> &Scratch {
        match self {
            ScratchRef::Shared(s) => s,
            ScratchRef::Own(s) => s,
        }
    }
}

impl std::ops::DerefMut for ScratchRef<'_> {
    fn deref_mut(&mut self) -> &mut Scratch {
        match self {
            ScratchRef::Shared(s) => s,
            ScratchRef::Own(s) => s,
        }
    }
}

/// What a cycle changed, to undo it exactly if the cycle fails. The cycle mutates the committed
/// state in place (no copy when nobody else holds it); a top-level member of the base and
/// merged documents is saved once, before its first change (an O(1) persistent clone), except
/// that a derived value written deeper is journaled by its address alone (`TreeUndo::Path`).
#[derive(Clone, Debug, Default)]
struct Journal {
    base: Vec<TreeUndo>,
    merged: Vec<TreeUndo>,
    base_seen: KeyedSet<valem_core::value::Key>,
    merged_seen: KeyedSet<valem_core::value::Key>,
    base_root: bool,
    merged_root: bool,
    meta: Vec<(Arc<str>, Option<MetaEntry>)>,
    stale: Vec<(NodeId, bool)>,
    effect_keys: Vec<(Arc<str>, Option<Val>)>,
    aggregates: Vec<AggUndo>,
    /// Cells written: each one's previous value.
    cells: Vec<(u32, Option<Val>)>,
    /// The addresses of `TreeUndo::Path` entries, one after another.
    path_segs: Vec<Seg>,
}

/// What one committed cycle (or one materialisation of lazy derivations) changed: undone on a
/// copy of a later state, it gives the state from before it ([`super::Model::record_undo`]).
/// This is how the daemon keeps its recent history without holding a snapshot per commit
/// (holding one makes the next commit copy every branch on the paths it writes).
#[derive(Debug)]
pub struct Undo(Journal);

impl Undo {
    /// Put `st` back to how it was before this change (`st` is that change's result or a
    /// state reached from it by undoing later changes).
    pub(super) fn apply(&self, st: &mut State) {
        undo_journal(st, self.0.clone());
    }
}

/// Undo everything `j` records in `st`, newest change first.
fn undo_journal(st: &mut State, j: Journal) {
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
enum AggUndo {
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
const KEEP_ENTRIES: usize = 4096;

/// Empty `v` for reuse, but let a large buffer go when the cycle that just used it needed far
/// less (a one-off bulk cycle — initial data — does not pin its peak for the model's life,
/// while a model whose every cycle is large keeps reusing it).
fn recycle<T>(v: &mut Vec<T>) {
    if oversized(v.capacity(), v.len()) {
        *v = Vec::new();
    } else {
        v.clear();
    }
}

fn recycle_set<T, S: Default>(s: &mut std::collections::HashSet<T, S>) {
    if oversized(s.capacity(), s.len()) {
        *s = Default::default();
    } else {
        s.clear();
    }
}

/// A buffer worth letting go (see [`recycle`]).
fn oversized(capacity: usize, used: usize) -> bool {
    capacity > KEEP_ENTRIES && capacity > 4 * used
}

impl Journal {
    /// Empty it, keeping its buffers (see [`recycle`]).
    fn clear(&mut self) {
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
fn save(
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
enum TreeUndo {
    /// A top-level member (`None`: the whole root) and what it held before.
    Member(Option<valem_core::value::Key>, Option<Val>),
    /// A nested address (`Journal::path_segs[start..end]`) and what it held (`None`:
    /// nothing; the address is the shallowest one the write created). Written derived values
    /// are journaled this way, so the document is changed in place instead of its top-level
    /// member being kept whole for undo (which would make every written element a copy).
    Path(u32, u32, Option<Val>),
}

/// Undo a document's changes, newest first.
fn undo(doc: &mut Val, log: Vec<TreeUndo>, segs: &[Seg]) {
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
fn path_undo(doc: &Val, path: &[Seg], segs: &mut Vec<Seg>) -> TreeUndo {
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
fn restore<V: Clone>(map: &mut imbl::OrdMap<Arc<str>, V>, log: Vec<(Arc<str>, Option<V>)>) {
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

/// Concrete instances of a pattern, their segments one after another (one allocation for
/// all of them, not one per instance).
#[derive(Debug, Default)]
struct Insts {
    segs: Vec<Seg>,
    ends: Vec<u32>,
}

impl Insts {
    fn one(inst: Vec<Seg>) -> Insts {
        Insts {
            ends: vec![inst.len() as u32],
            segs: inst,
        }
    }

    fn push(&mut self, inst: &[Seg]) {
        self.segs.extend_from_slice(inst);
        self.ends.push(self.segs.len() as u32);
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn iter(&self) -> impl Iterator<Item = &[Seg]> + '_ {
        super::trace::spans(&self.ends).map(|r| &self.segs[r])
    }

    fn extend(&mut self, other: &Insts) {
        for inst in other.iter() {
            self.push(inst);
        }
    }

    /// Sorted, without duplicates.
    fn sort_dedup(self) -> Insts {
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

struct Cycle<'a> {
    cm: &'a CompiledModel,
    limits: &'a EngineLimits,
    st: &'a mut State,
    /// Constants, library exports and the pinned clock, bound where an expression uses them.
    /// The interpreter's bindings with the cycle's instant, made when an interpreted
    /// evaluation first needs them (arithmetic derivations never do).
    env: std::cell::OnceCell<Env>,
    now_ms: i64,
    /// Derivations to evaluate, lowest level first (each queued once: see `QUEUED`).
    pending: BinaryHeap<Reverse<(u32, NodeId)>>,
    sc: ScratchRef<'a>,
    meta_dirty: BTreeSet<NodeId>,
    constraint_dirty: BTreeSet<NodeId>,
    effect_dirty: BTreeSet<NodeId>,
    /// At creation only nodes downstream of the seeds check constraints and effects.
    allowed: Option<HashSet<NodeId>>,
    include_lazy: bool,
    whole_doc_marked: bool,
    /// The derivation whose instances are being written.
    evaluating: Option<NodeId>,
    /// The merged document converted once per version, for whole-document expressions.
    whole_cache: Option<(u64, JValue)>,
    version: u64,
    result: MutationResult,
    hits: Vec<(u32, Vec<usize>)>,
    journal: Journal,
    /// Slot values of a JIT call (reused).
    jit_slots: Vec<f64>,
    /// Whether the last `evaluate` was answered by compiled code.
    jit_hit: bool,
    /// Reused to render instance addresses.
    render_buf: String,
    /// The old and new value of the write being propagated, for delta aggregates.
    agg_change: Option<(Option<Val>, Val)>,
    /// Per delta aggregate dirtied this cycle: the leaf changes since it last ran, or `None`
    /// when something else reached it (then it rescans).
    agg_delta: HashMap<NodeId, Option<Vec<LeafChange>>>,
    /// The node whose change was just noted (its next `mark` comes with a delta).
    agg_noted: Option<NodeId>,
    /// The cycle writes few members: each write starts loading what its reader reads (a
    /// large batch would only evict what it loaded before it is used).
    prefetch: bool,
    /// When the cycle's time budget runs out (on the budget's clock, in milliseconds), and
    /// the evaluation work done since the clock was last read.
    deadline: Option<u64>,
    work: u32,
    /// Why the cycle stopped early (its budget, a limit): it rolls back and fails with this.
    abort: Option<MutationError>,
}

/// Evaluation work between two looks at the clock: an interpreted evaluation counts as all of
/// it (it may take up to its own timeout), a compiled or native one as one unit.
const WORK_PER_CHECK: u32 = 32;

impl Drop for Cycle<'_> {
    fn drop(&mut self) {
        self.sc.reset();
        let mut journal = std::mem::take(&mut self.journal);
        journal.clear();
        self.sc.journal = journal;
    }
}

impl<'a> Cycle<'a> {
    fn new(
        cm: &'a CompiledModel,
        limits: &'a EngineLimits,
        st: &'a mut State,
        now_ms: i64,
    ) -> Self {
        let mut sc = ScratchRef::of(cm);
        let journal = std::mem::take(&mut sc.journal);
        Cycle {
            cm,
            limits,
            st,
            env: std::cell::OnceCell::new(),
            now_ms,
            pending: BinaryHeap::new(),
            sc,
            meta_dirty: BTreeSet::new(),
            constraint_dirty: BTreeSet::new(),
            effect_dirty: BTreeSet::new(),
            allowed: None,
            include_lazy: false,
            whole_doc_marked: false,
            evaluating: None,
            whole_cache: None,
            version: 0,
            result: MutationResult {
                success: true,
                derived_updated: Paths::new(cm.trace_table.clone()),
                traces: Traces::new(cm.trace_table.clone()),
                ..MutationResult::default()
            },
            hits: Vec::new(),
            journal,
            jit_slots: Vec::new(),
            jit_hit: false,
            render_buf: String::new(),
            agg_change: None,
            agg_delta: HashMap::default(),
            agg_noted: None,
            prefetch: false,
            deadline: limits
                .cycle_budget
                .map(|b| (b.clock)().saturating_add(b.ms)),
            work: 0,
            abort: None,
        }
    }

    fn env(&self) -> &Env {
        cycle_env(&self.env, self.cm, self.now_ms)
    }

    fn mark(&mut self, id: NodeId, binding: Vec<usize>) {
        if self.evaluating == Some(id) {
            // A derivation's own write never re-dirties it (see the compile-time rule).
            return;
        }
        let node = &self.cm.nodes[id as usize];
        if self.cm.has_delta_aggregates
            && self.agg_noted.take() != Some(id)
            && self.cm.delta_aggregate(node).is_some()
        {
            // Reached by something other than a noted leaf write: rescan.
            self.agg_delta.insert(id, None);
        }
        // An empty binding, or a node without `[*]`, means every instance.
        let every = binding.is_empty() || node.wildcards() == 0;
        match node.kind {
            NodeKind::Derivation { .. } => {
                if !self.sc.has(id, QUEUED) {
                    self.sc.set(id, QUEUED);
                    self.pending.push(Reverse((node.level, id)));
                }
                self.sc.add(id, binding, every);
            }
            NodeKind::Meta(_) => {
                self.meta_dirty.insert(id);
                self.sc.add(id, binding, every);
            }
            NodeKind::Constraint { .. } => {
                // A constraint's bindings come from its scope paths, not from `targets[0]`.
                let every = binding.is_empty();
                self.constraint_dirty.insert(id);
                self.sc.add(id, binding, every);
            }
            NodeKind::Effect { .. } => {
                self.effect_dirty.insert(id);
            }
        }
    }

    fn mark_all(&mut self, id: NodeId) {
        self.mark(id, Vec::new());
    }

    /// Dirty every reader of a written path (and whole-document readers).
    fn propagate(&mut self, w: &[Seg]) {
        let readers = &self.cm.readers;
        self.propagate_hits(w, |out| readers.hits(w, out));
    }

    /// `propagate` for a write of the top-level member `w`, given its node in the reader index.
    fn propagate_member(&mut self, w: &[Seg], member: Option<super::trie::Member>) {
        let readers = &self.cm.readers;
        self.propagate_hits(w, |out| readers.member_hits(member, out));
    }

    /// Mark the readers `find` lists for the write at `w`.
    fn propagate_hits(&mut self, w: &[Seg], find: impl FnOnce(&mut Vec<super::trie::Hit>)) {
        let mut hits = std::mem::take(&mut self.hits);
        hits.clear();
        find(&mut hits);
        for (id, b) in hits.drain(..) {
            if self.cm.has_delta_aggregates {
                self.note_aggregate(id, w);
            }
            self.mark(id, b);
        }
        self.hits = hits;
        self.mark_whole_doc();
    }

    /// `propagate` for a write of a concrete derivation's own target, from its readers listed
    /// at compile time.
    fn propagate_target(&mut self, node: &Node, target: &[Seg]) {
        let cm = self.cm;
        let Some(readers) = cm.target_readers(node.id) else {
            return self.propagate(target);
        };
        for &id in readers {
            if cm.has_delta_aggregates {
                self.note_aggregate(id, target);
            }
            self.mark(id, Vec::new());
        }
        self.mark_whole_doc();
    }

    /// A write at `w` reaches node `id`: when `id` is a delta aggregate and `w` is one of its
    /// leaves (`array[k].field`) with number-or-absent old and new values, note the change;
    /// anything else makes it rescan.
    fn note_aggregate(&mut self, id: NodeId, w: &[Seg]) {
        let cm = self.cm;
        let Some(agg) = cm.delta_aggregate(&cm.nodes[id as usize]) else {
            return;
        };
        let leaf = match w {
            [Seg::Field(a), Seg::Index(k), Seg::Field(f)]
                if **a == *agg.path[0] && **f == *agg.path[1] =>
            {
                Some(*k)
            }
            _ => None,
        };
        let num = |v: Option<&Val>| match v {
            None => Some(None),
            Some(Val::Num(x)) => Some(Some(*x)),
            Some(_) => None,
        };
        let change = match (&self.agg_change, leaf) {
            (Some((old, new)), Some(k)) => num(old.as_ref())
                .zip(num(Some(new)))
                .map(|(o, n)| (k, o, n)),
            _ => None,
        };
        let e = self.agg_delta.entry(id).or_insert_with(|| Some(Vec::new()));
        match (e.as_mut(), change) {
            // Past a few dozen changes a rescan is as cheap and bounds the log.
            (Some(log), Some(c)) if log.len() < 64 => log.push(c),
            _ => *e = None,
        }
        self.agg_noted = Some(id);
    }

    fn mark_whole_doc(&mut self) {
        if !self.whole_doc_marked && !self.cm.whole_doc_nodes.is_empty() {
            self.whole_doc_marked = true;
            for i in 0..self.cm.whole_doc_nodes.len() {
                let id = self.cm.whole_doc_nodes[i];
                self.mark_all(id);
            }
        }
    }

    /// A base write replaces everything below `w`, and may create containers: every per-address
    /// value below it (derived values wiped from the merged document, meta of new elements)
    /// must be recomputed. Scoped constraints are not marked here: a constraint runs when
    /// something it reads is written (`propagate` reaches one scoped at or below a replaced
    /// value), not because a write created the container of a field still absent — the
    /// reference's rule, so `{"$.q.other": 1}` does not check a constraint on `$.q.c`.
    fn shadow(&mut self, w: &[Seg]) {
        let mut below = Vec::new();
        self.cm.produced_below(w, &mut below);
        self.cm.instances.below(w, &mut below);
        for (id, b) in below {
            if !matches!(self.cm.nodes[id as usize].kind, NodeKind::Constraint { .. }) {
                self.mark(id, b);
            }
        }
    }

    fn write_base(&mut self, segs: &[Seg], value: Val) -> Result<(), MutationError> {
        let max = self.limits.max_array_index;
        // The first container this write creates: instances below it are new.
        let created = (1..segs.len()).find(|&k| self.st.merged().get_path(&segs[..k]).is_none());
        if self.cm.has_delta_aggregates {
            self.agg_change = Some((self.st.merged().get_path(segs).cloned(), value.clone()));
        }
        if segs.is_empty() {
            // The root is replaced: every cell is wiped (its derivation runs again).
            self.clear_cells();
        }
        // A top-level member's node in the reader index, looked up once for both the write
        // and its propagation.
        let found = match segs {
            [Seg::Field(k)] => self.cm.readers.member(k),
            _ => None,
        };
        // Its reader is marked and evaluated next: load what that reads and writes while the
        // write below walks the document.
        if let Some(leaf) = found.and_then(|(_, t)| t.leaf()).filter(|_| self.prefetch) {
            let node = &self.cm.nodes[leaf as usize];
            if let Some(c) = node.cell {
                self.st.cells.prefetch(c);
            }
            node.jit.prefetch_inputs(self.st.merged());
        }
        let j = &mut self.journal;
        let mut member = None;
        match (segs, &mut self.st.base, &mut self.st.tree) {
            ([Seg::Field(k)], Val::Obj(b), tree @ (None | Some(Val::Obj(_)))) => {
                // A top-level member: replace it and journal what it replaced, one lookup per
                // tree. (Journaling the same member twice is harmless: undo replays newest
                // first.) A member something reads is stored under the index's key, which is
                // the shared one: no lookup in the intern table for a new member.
                member = Some(found.map(|(_, t)| t));
                let key = found.map_or(k, |(shared, _)| shared);
                let insert = |m: &mut ObjMap, v| match found {
                    Some(_) => m.insert_shared(key.clone(), v),
                    None => m.insert(key.clone(), v),
                };
                let old_base = insert(b, value.clone());
                j.base.push(TreeUndo::Member(Some(key.clone()), old_base));
                if let Some(Val::Obj(m)) = tree {
                    let old_merged = insert(m, value);
                    j.merged
                        .push(TreeUndo::Member(Some(key.clone()), old_merged));
                }
            }
            _ => {
                save(
                    &self.st.base,
                    segs,
                    &mut j.base,
                    &mut j.base_seen,
                    &mut j.base_root,
                );
                self.st
                    .base
                    .set_path(segs, value.clone(), max)
                    .map_err(|e| MutationError::Invalid(format!("{}: {e}", render(segs))))?;
                if let Some(tree) = &mut self.st.tree {
                    save(
                        tree,
                        segs,
                        &mut j.merged,
                        &mut j.merged_seen,
                        &mut j.merged_root,
                    );
                    tree.set_path(segs, value, max)
                        .map_err(|e| MutationError::Invalid(format!("{}: {e}", render(segs))))?;
                }
            }
        }
        self.version += 1;
        self.result
            .mutated_paths
            .push_with(|s| valem_core::expr::path::render_append(segs, s));
        match member {
            Some(m) => self.propagate_member(segs, m),
            None => self.propagate(segs),
        }
        self.agg_change = None;
        match created {
            Some(k) => self.shadow(&segs[..k]),
            None => self.shadow(segs),
        }
        Ok(())
    }

    /// Wipe every cell, journaling each value.
    fn clear_cells(&mut self) {
        for c in 0..self.cm.cells.len() as u32 {
            if let Some(old) = self.st.cells.set(c, None) {
                self.journal.cells.push((c, Some(old)));
            }
        }
    }

    // --- evaluation -------------------------------------------------------------------------

    fn whole_doc(&mut self) -> JValue {
        if let Some((v, j)) = &self.whole_cache {
            if *v == self.version {
                return j.clone();
            }
        }
        let j = self.st.merged().to_jvalue();
        self.whole_cache = Some((self.version, j.clone()));
        j
    }

    fn input(&mut self, node: &Node, inst: &[Seg]) -> JValue {
        match node.input {
            Input::Doc if node.whole_doc => self.whole_doc(),
            Input::Doc if node.projection_deferred => {
                let p = self.cm.fallback_projection(node);
                project_root(self.st.merged(), &p)
            }
            Input::Doc => project_root(self.st.merged(), node.projection()),
            Input::Element => {
                let el = element_prefix(&node.targets[0], inst);
                self.st.merged().jvalue_at(el)
            }
            Input::Field => self.st.merged().jvalue_at(inst),
        }
    }

    /// The arithmetic tier's answer (`Some(Ok(None))`: undefined): compiled code once it is
    /// ready, the IR's interpreter until then or when an input is undefined, JSONata's type
    /// error for one operation over a null, boolean or string input; `None` when the node is
    /// not arithmetic, an input is something else or a value is not finite (the JSONata
    /// interpreter answers).
    fn evaluate_lowered(
        &mut self,
        node: &Node,
        inst: &[Seg],
    ) -> Option<Result<Option<interp::Value>, ExprError>> {
        let (nj, code) = node.jit.get(self.limits.jit)?;
        // Only derivations are lowered: their input is the document. `$parent` as `evaluate`
        // binds it: the target's JSON parent.
        let parent = (node.uses_parent && !inst.is_empty()).then(|| &inst[..inst.len() - 1]);
        let v = match jit::read_slots(&nj.inputs, self.st.merged(), parent, &mut self.jit_slots) {
            jit::Read::Other => return None,
            jit::Read::NotNumbers(slots) => return jit::type_error(nj.program(), slots).map(Err),
            jit::Read::Undefined => interp::eval_undefined(nj.program(), &self.jit_slots)?,
            jit::Read::Numbers => Some(match code {
                Some(code) => {
                    let x = code.set.call(code.index, &self.jit_slots)?;
                    self.jit_hit = true;
                    interp::Value::from_f64(code.ty, x)
                }
                None => interp::eval(nj.program(), &self.jit_slots)?,
            }),
        };
        Some(Ok(v))
    }

    #[inline]
    fn evaluate(&mut self, node: &Node, inst: &[Seg]) -> Result<Option<JValue>, ExprError> {
        self.jit_hit = false;
        if node.jit.lowered() {
            if let Some(v) = self.evaluate_lowered(node, inst) {
                self.spend(1);
                return v.map(|v| {
                    v.map(|v| match v {
                        interp::Value::Num(x) => JValue::Number(x),
                        interp::Value::Bool(b) => JValue::Bool(b),
                    })
                });
            }
        }
        let out = self.evaluate_slow(node, inst);
        self.spend(if self.jit_hit { 1 } else { WORK_PER_CHECK });
        out
    }

    /// [`Cycle::evaluate`] past the compiled code: an aggregate, or the interpreter.
    fn evaluate_slow(&mut self, node: &Node, inst: &[Seg]) -> Result<Option<JValue>, ExprError> {
        if let (Some(agg), Input::Doc) = (self.cm.aggregate(node), node.input) {
            if node.keeps_by_delta(agg) {
                if let Some(v) = self.delta_aggregate(agg) {
                    return Ok(v);
                }
            }
            if let Some(v) = aggregate(self.st.merged(), agg) {
                return Ok(v);
            }
        }
        let expr = self.cm.interpreted(node)?;
        let input = self.input(node, inst);
        if node.uses_parent && !inst.is_empty() {
            // Derivations: the target's JSON parent. Meta and constraints: the `[*]` element.
            let at = match node.kind {
                NodeKind::Derivation { .. } => &inst[..inst.len() - 1],
                _ => element_prefix(&node.targets[0], inst),
            };
            let parent = self.st.merged().jvalue_at(at);
            let env = self.env().with("parent", parent);
            expr.eval(&input, &env, &self.limits.expr)
        } else {
            expr.eval(&input, self.env(), &self.limits.expr)
        }
    }

    /// A delta aggregate's value: its memo updated by the leaf changes noted since it last ran
    /// (by their deltas when the memo is exact, in its kept leaves when it has them), else a
    /// rescan that refreshes the memo. `None` when the leaves are not all numbers (the caller
    /// leaves it to `aggregate` and JSONata).
    fn delta_aggregate(&mut self, agg: &Aggregate) -> Option<Option<JValue>> {
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
    fn replace_memo(&mut self, id: NodeId, next: Option<AggMemo>) -> Option<(f64, usize)> {
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
    fn update_leaves(&mut self, id: NodeId, changes: &[LeafChange]) -> Option<(f64, usize)> {
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
    fn drop_unrun_aggregates(&mut self) {
        for (id, _) in std::mem::take(&mut self.agg_delta) {
            if let Some(old) = self.st.aggregates.remove(&id) {
                self.journal.aggregates.push(AggUndo::Memo(id, Some(old)));
            }
        }
    }

    /// Record an evaluation of `node`: its value, or for a constraint whether it held.
    /// `target`: the address when it is not the node's key (`[*]` instances).
    fn trace(
        &mut self,
        node: &Node,
        target: Option<Arc<str>>,
        result: Val,
        passed: Option<bool>,
        error: Option<String>,
    ) {
        let result = if passed.is_some() { Val::Null } else { result };
        let jit = self.jit_hit && passed.is_none();
        if self.result.traces.len() == BIG_CYCLE {
            // A large cycle: make room for as many as the last large one had at once.
            self.result.traces.reserve(self.sc.last_traces);
            self.result.derived_updated.reserve(self.sc.last_traces);
        }
        self.result
            .traces
            .push(node.id, target, result, passed, jit, error);
    }

    /// The instances of `pattern` to evaluate for node `id`; none, and the cycle stopped, when
    /// they are more than [`EngineLimits::max_instances`].
    fn instances(&mut self, id: NodeId, pattern: &Address) -> Insts {
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

    fn expand_instances(&self, id: NodeId, pattern: &Address) -> Insts {
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

    // --- phases -----------------------------------------------------------------------------

    fn has_non_lazy_dependent(&self, id: NodeId) -> bool {
        self.cm.dependents.of(id).iter().any(|&d| {
            !matches!(
                self.cm.nodes[d as usize].kind,
                NodeKind::Derivation { lazy: true }
            )
        })
    }

    /// Stop the cycle: it rolls back and fails with `why` (the first reason given stays).
    fn stop(&mut self, why: MutationError) {
        self.abort.get_or_insert(why);
    }

    /// Count evaluation work (see [`WORK_PER_CHECK`]) and stop the cycle once its time budget
    /// has run out.
    #[inline]
    fn spend(&mut self, units: u32) {
        self.work = self.work.saturating_add(units);
        if self.work >= WORK_PER_CHECK {
            self.check_clock();
        }
    }

    #[cold]
    #[inline(never)]
    fn check_clock(&mut self) {
        self.work = 0;
        if let (Some(deadline), Some(budget)) = (self.deadline, self.limits.cycle_budget) {
            if (budget.clock)() > deadline {
                self.stop(MutationError::Invalid(format!(
                    "the cycle ran past its time budget of {} ms and was rolled back; \
                     nothing was written",
                    budget.ms
                )));
            }
        }
    }

    fn derive(&mut self) {
        let cm = self.cm;
        let mut guard = 0usize;
        let bound = cm.nodes.len().saturating_mul(4) + 16;
        // Many queued at once (a load, a write everything reads): they are sorted into a run
        // and taken from it in order, merged with what their evaluation queues (of later
        // levels) — the queue's order, without a heap's pop of a cache miss per level of it —
        // and the inputs of the one `RUN_AHEAD` places on start loading as each is taken.
        let mut run = Vec::new();
        if self.pending.len() >= RUN_FROM {
            run = std::mem::take(&mut self.pending).into_vec();
            run.sort_unstable_by_key(|&Reverse(k)| k);
        }
        let mut next = 0;
        loop {
            let from_run = match (run.get(next), self.pending.peek()) {
                (Some(Reverse(a)), Some(Reverse(b))) => a <= b,
                (Some(_), None) => true,
                (None, _) => false,
            };
            let id = if from_run {
                let Reverse((_, id)) = run[next];
                next += 1;
                if let Some(&Reverse((_, ahead))) = run.get(next + RUN_AHEAD) {
                    if let Some(node) = cm.nodes.get(ahead as usize) {
                        node.jit.prefetch_inputs(self.st.merged());
                    }
                }
                id
            } else {
                match self.pending.pop() {
                    Some(Reverse((_, id))) => id,
                    None => break,
                }
            };
            if self.abort.is_some() {
                break;
            }
            guard += 1;
            if guard > bound {
                // Unreachable with an acyclic graph; a bound instead of a hang.
                return;
            }
            self.derive_node(id);
        }
        if !self.agg_delta.is_empty() {
            self.drop_unrun_aggregates();
        }
    }

    /// Evaluate a queued derivation (every dirty instance of it).
    fn derive_node(&mut self, id: NodeId) {
        let cm = self.cm;
        let node = &cm.nodes[id as usize];
        if let NodeKind::Derivation { lazy: true } = node.kind {
            if !self.include_lazy && !self.has_non_lazy_dependent(id) {
                self.sc.clean(id);
                let was = self.st.lazy_stale.insert(id).is_some();
                self.journal.stale.push((id, was));
                return;
            }
            if self.st.lazy_stale.remove(&id).is_some() {
                self.journal.stale.push((id, true));
                self.sc.clean(id);
                self.sc.set(id, DIRTY | ALL);
            }
        }
        let again = self.sc.has(id, EVALUATED);
        self.sc.set(id, EVALUATED);
        self.evaluating = Some(id);
        match &node.concrete {
            Some(target) => {
                self.sc.clean(id);
                self.derive_instance(node, target, true, again);
            }
            None => {
                let insts = self.instances(id, &node.targets[0]);
                self.sc.clean(id);
                let mut batch = self.evaluate_batch(node, &insts);
                if batch.is_some() {
                    self.spend(u32::try_from(insts.len()).unwrap_or(u32::MAX));
                }
                for (k, inst) in insts.iter().enumerate() {
                    if self.abort.is_some() {
                        break;
                    }
                    match batch.as_mut().and_then(|b| b[k].take()) {
                        Some(v) => {
                            self.jit_hit = true;
                            self.write_value(node, inst, false, again, v, None);
                        }
                        None => self.derive_instance(node, inst, false, again),
                    }
                }
                if let Some(vals) = batch {
                    self.return_batch(vals);
                }
            }
        }
        self.evaluating = None;
    }

    /// Evaluate one instance of a derivation; write and propagate it when it changed.
    fn derive_instance(&mut self, node: &Node, inst: &[Seg], concrete: bool, again: bool) {
        // The arithmetic tier's number or boolean goes straight to a `Val`: built as a
        // JSONata value and matched apart again, the result was assembled byte by byte on the
        // stack and read back whole, a store-forwarding stall per derivation (chain 10k +5%).
        self.jit_hit = false;
        if node.jit.lowered() {
            if let Some(r) = self.evaluate_lowered(node, inst) {
                self.spend(1);
                let (value, error) = match r {
                    Ok(Some(interp::Value::Num(x))) => (Val::num(x), None),
                    Ok(Some(interp::Value::Bool(b))) => (Val::Bool(b), None),
                    Ok(None) => (Val::Null, None),
                    Err(e) => (Val::Null, Some(e.message)),
                };
                return self.write_value(node, inst, concrete, again, value, error);
            }
        }
        let result = self.evaluate_slow(node, inst);
        self.spend(if self.jit_hit { 1 } else { WORK_PER_CHECK });
        self.write_derived(node, inst, concrete, again, result);
    }

    /// The JIT's answers for many instances of a `[*]` derivation at once (the batched entry
    /// over columns): per instance, the value, or `None` where the interpreter must answer.
    /// `None` overall when the node has no batched code or too few instances for it to pay.
    fn evaluate_batch(&mut self, node: &Node, insts: &Insts) -> Option<Vec<Option<Val>>> {
        const MIN_ROWS: usize = 16;
        if insts.len() < MIN_ROWS || !node.jit.lowered() || node.input != Input::Doc {
            return None;
        }
        let (nj, code) = node.jit.get(self.limits.jit)?;
        let code = code?;
        // The buffers of the last batch: no fresh (zeroed) pages per call.
        let mut b = std::mem::take(&mut self.sc.batch);
        let rows = insts.len();
        b.cols.resize_with(nj.inputs.len(), Vec::new);
        for c in &mut b.cols {
            c.clear();
            c.reserve(rows);
        }
        b.guarded.clear();
        let merged = self.st.merged();
        for inst in insts.iter() {
            let parent = (node.uses_parent && !inst.is_empty()).then(|| &inst[..inst.len() - 1]);
            let guarded = jit::read_slots(&nj.inputs, merged, parent, &mut self.jit_slots)
                == jit::Read::Numbers;
            b.guarded.push(guarded);
            for (s, col) in b.cols.iter_mut().enumerate() {
                col.push(if guarded { self.jit_slots[s] } else { 0.0 });
            }
        }
        b.out.clear();
        b.out.resize(rows, 0.0);
        b.ok.clear();
        b.ok.resize(rows, 0);
        let views: Vec<&[f64]> = b.cols.iter().map(Vec::as_slice).collect();
        let called = code
            .set
            .call_batch(code.index, &views, &mut b.out, &mut b.ok);
        drop(views);
        let mut vals = std::mem::take(&mut b.vals);
        vals.clear();
        if called.is_some() {
            vals.extend((0..rows).map(|k| {
                (b.guarded[k] && b.ok[k] == 1).then(|| match code.ty {
                    Ty::Num => Val::num(b.out[k]),
                    Ty::Bool => Val::Bool(b.out[k] != 0.0),
                })
            }));
        }
        self.sc.batch = b;
        called.map(|_| vals)
    }

    /// Hand a batch's values back for the next batch to fill (emptied then; its length until
    /// then tells the end of the cycle how much of it was used).
    fn return_batch(&mut self, vals: Vec<Option<Val>>) {
        self.sc.batch.vals = vals;
    }

    /// Write one derived value; propagate it when it changed.
    fn write_derived(
        &mut self,
        node: &Node,
        inst: &[Seg],
        concrete: bool,
        again: bool,
        result: Result<Option<JValue>, ExprError>,
    ) {
        let (value, error) = match result {
            Ok(Some(v)) => match from_jvalue(&v, room_below(inst.len()), &self.limits.expr) {
                Ok(v) => (v, None),
                Err(e) => (Val::Null, Some(e.message)),
            },
            Ok(None) => (Val::Null, None),
            Err(e) => (Val::Null, Some(e.message)),
        };
        self.write_value(node, inst, concrete, again, value, error);
    }

    /// `write_derived` of a value already converted.
    fn write_value(
        &mut self,
        node: &Node,
        inst: &[Seg],
        concrete: bool,
        again: bool,
        value: Val,
        error: Option<String>,
    ) {
        // `[*]` instances are named by their address; a concrete node by its key.
        let target: Option<Arc<str>> = (!concrete).then(|| {
            render_into(inst, &mut self.render_buf);
            Arc::from(self.render_buf.as_str())
        });
        let noting = self.cm.has_delta_aggregates;
        let written = if let (Some(c), true) = (node.cell, concrete) {
            // A cell: compared and replaced by index. (Over a scalar root a top-level member
            // does not exist, as in the tree.)
            if !self.st.merged().root_is_obj() || self.st.cells.get(c) == Some(&value) {
                false
            } else {
                let old = self.st.cells.set(c, Some(value.clone()));
                if noting {
                    self.agg_change = Some((old.clone(), value.clone()));
                }
                self.journal.cells.push((c, old));
                true
            }
        } else if let ([Seg::Field(k)], Some(Val::Obj(m))) = (inst, &mut self.st.tree) {
            // A top-level derived member: one lookup finds it, compares and replaces it.
            let old = match m.get_mut(k) {
                Some(slot) if *slot == value => None,
                Some(slot) => Some(Some(std::mem::replace(slot, value.clone()))),
                None => {
                    m.insert(k.clone(), value.clone());
                    Some(None)
                }
            };
            let written = old.is_some();
            if let Some(old) = old {
                if noting {
                    self.agg_change = Some((old.clone(), value.clone()));
                }
                self.journal
                    .merged
                    .push(TreeUndo::Member(Some(k.clone()), old));
            }
            written
        } else {
            let cur = self.st.merged().get_path(inst);
            let changed = cur != Some(&value);
            if changed && noting {
                self.agg_change = Some((cur.cloned(), value.clone()));
            }
            match &mut self.st.tree {
                Some(tree) if changed => {
                    let j = &mut self.journal;
                    match inst.first() {
                        // A nested address under a member not saved whole: journal the one
                        // address, and the write changes the document in place.
                        Some(Seg::Field(k))
                            if inst.len() > 1 && !j.merged_root && !j.merged_seen.contains(k) =>
                        {
                            j.merged.push(path_undo(tree, inst, &mut j.path_segs));
                        }
                        _ => save(
                            tree,
                            inst,
                            &mut j.merged,
                            &mut j.merged_seen,
                            &mut j.merged_root,
                        ),
                    }
                    tree.splice_existing(inst, value.clone())
                }
                // Without a tree every derivation writes a cell.
                _ => false,
            }
        };
        if written {
            self.version += 1;
            let updated = &mut self.result.derived_updated;
            match &target {
                None if !again || !updated.contains_node(node.id) => updated.push_node(node.id),
                Some(t) if !again || !updated.contains(t) => updated.push(t.clone()),
                _ => {}
            }
            if concrete {
                self.propagate_target(node, inst);
            } else {
                self.propagate(inst);
            }
            self.agg_change = None;
        }
        self.trace(node, target, value, None, error);
    }

    fn meta(&mut self) {
        if self.abort.is_some() {
            return;
        }
        let cm = self.cm;
        let ids: Vec<NodeId> = std::mem::take(&mut self.meta_dirty).into_iter().collect();
        for id in ids {
            let node = &cm.nodes[id as usize];
            let NodeKind::Meta(prop) = node.kind else {
                continue;
            };
            let pattern = &node.targets[0];
            let full = self.sc.bound(id).is_none();
            let insts = self.instances(id, pattern);
            self.sc.clean(id);
            let mut keys = KeyedSet::default();
            for inst in insts.iter() {
                if self.abort.is_some() {
                    break;
                }
                let value = match self.evaluate(node, inst) {
                    Ok(Some(v)) => {
                        from_jvalue(&v, MAX_DEPTH, &self.limits.expr).unwrap_or(Val::Null)
                    }
                    _ => Val::Null,
                };
                let key: Arc<str> = Arc::from(format!("{}#{}", render(inst), prop.key_name()));
                keys.insert(key.clone());
                let entry = MetaEntry { node: id, value };
                if self.st.meta.get(&key) != Some(&entry) {
                    self.result.meta_updated.push(key.to_string());
                    let old = self.st.meta.insert(key.clone(), entry);
                    self.journal.meta.push((key, old));
                }
            }
            if full && pattern.has_wildcard() {
                let stale: Vec<Arc<str>> = self
                    .st
                    .meta
                    .iter()
                    .filter(|(k, e)| e.node == id && !keys.contains(*k))
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in stale {
                    let old = self.st.meta.remove(&k);
                    self.journal.meta.push((k, old));
                }
            }
        }
    }

    fn allowed(&self, id: NodeId) -> bool {
        self.allowed.as_ref().is_none_or(|a| a.contains(&id))
    }

    fn constraints(&mut self) -> Vec<ConstraintViolation> {
        let cm = self.cm;
        let mut rollback = Vec::new();
        if self.abort.is_some() {
            return rollback;
        }
        let ids: Vec<NodeId> = std::mem::take(&mut self.constraint_dirty)
            .into_iter()
            .collect();
        for id in ids {
            if !self.allowed(id) {
                continue;
            }
            let node = &cm.nodes[id as usize];
            let NodeKind::Constraint { index, policy } = node.kind else {
                continue;
            };
            let spec = &cm.spec.constraints[index as usize];
            let mut insts = Insts::default();
            if node.targets.is_empty() {
                insts.push(&[]);
            } else {
                for t in &node.targets {
                    insts.extend(&self.instances(id, t));
                }
            }
            self.sc.clean(id);
            let mut failed = false;
            for inst in insts.iter() {
                if self.abort.is_some() {
                    break;
                }
                let (passed, error) = match self.evaluate(node, inst) {
                    Ok(v) => (truthy(v.as_ref()), None),
                    Err(e) => (false, Some(e.message)),
                };
                self.trace(node, None, Val::Null, Some(passed), error);
                failed |= !passed;
            }
            if failed {
                let v = ConstraintViolation {
                    constraint_id: spec.id.clone(),
                    message: spec.message.clone(),
                    policy: policy.as_str(),
                };
                match policy {
                    Policy::Rollback => rollback.push(v),
                    Policy::Flag => self.result.flagged_constraints.push(v),
                }
            }
        }
        rollback
    }

    fn effects(&mut self) {
        let cm = self.cm;
        let ids: Vec<NodeId> = std::mem::take(&mut self.effect_dirty).into_iter().collect();
        for id in ids {
            if !self.allowed(id) {
                continue;
            }
            let node = &cm.nodes[id as usize];
            let NodeKind::Effect { index } = node.kind else {
                continue;
            };
            let spec = &cm.spec.effects[index as usize];
            let plan = &cm.effect_plans[index as usize];
            let fire = matches!(self.evaluate(node, &[]), Ok(v) if truthy(v.as_ref()));
            if !fire {
                continue;
            }
            // The trigger's projection covers the dedupe key and timer expressions (they are
            // the node's reads); the payload is not tracked (reference rule), so it sees the
            // whole document, converted once per firing.
            let input = self.input(node, &[]);
            let full = if plan.payload.is_empty() {
                JValue::Null
            } else {
                self.whole_doc()
            };
            let env = cycle_env(&self.env, self.cm, self.now_ms);
            let limits = &self.limits.expr;
            let eval_on =
                |c: &valem_core::expr::Compiled, input: &JValue| -> Option<serde_json::Value> {
                    match c.eval(input, env, limits) {
                        Ok(Some(v)) => jvalue_to_json(&v, limits).ok(),
                        _ => None,
                    }
                };
            let eval = |c: &valem_core::expr::Compiled| eval_on(c, &input);
            let dedupe_key = plan
                .dedupe
                .as_ref()
                .map(|c| eval(c).unwrap_or(serde_json::Value::Null));
            if let Some(k) = &dedupe_key {
                let key = Val::from_json(k);
                let id_key: Arc<str> = Arc::from(spec.id.as_str());
                if self.st.effect_keys.get(&id_key) == Some(&key) {
                    continue;
                }
                let old = self.st.effect_keys.insert(id_key.clone(), key);
                self.journal.effect_keys.push((id_key, old));
            }
            let payload = if plan.payload.is_empty() {
                None
            } else {
                Some(
                    plan.payload
                        .iter()
                        .map(|(k, c)| {
                            (
                                k.clone(),
                                eval_on(c, &full).unwrap_or(serde_json::Value::Null),
                            )
                        })
                        .collect(),
                )
            };
            self.result.dispatched_effects.push(EffectRequest {
                effect_id: spec.id.clone(),
                executor: spec.executor().to_string(),
                emit: spec.emit.clone(),
                payload,
                dedupe_key,
                status_path: spec.status_path.clone(),
                at: plan.at.as_ref().and_then(|c| eval(c)),
                after_ms: plan.after_ms.as_ref().and_then(|c| eval(c)),
            });
        }
    }

    /// Undo everything this cycle changed in the state.
    fn rollback(&mut self) {
        undo_journal(self.st, std::mem::take(&mut self.journal));
    }

    /// The journal of a cycle that succeeded, for the model's undo log; its lookup sets (which
    /// only stop a member being saved twice) stay with the buffers for the next cycle.
    fn take_undo(&mut self) -> Undo {
        let mut j = std::mem::take(&mut self.journal);
        self.journal.base_seen = std::mem::take(&mut j.base_seen);
        self.journal.merged_seen = std::mem::take(&mut j.merged_seen);
        Undo(j)
    }

    fn finish(mut self) -> Result<MutationResult, MutationError> {
        self.finish_in_place()
    }

    fn finish_in_place(&mut self) -> Result<MutationResult, MutationError> {
        self.derive();
        self.meta();
        let rollback = self.constraints();
        if let Some(why) = self.abort.take() {
            self.rollback();
            return Err(why);
        }
        if !rollback.is_empty() {
            self.rollback();
            let mut traces = std::mem::take(&mut self.result.traces);
            for v in &rollback {
                traces.push_detached(
                    Arc::from(format!("$constraint:{}", v.constraint_id)),
                    Some(false),
                );
            }
            return Err(MutationError::Constraint {
                violations: rollback,
                traces,
            });
        }
        self.effects();
        self.sc.last_traces = self.result.traces.len();
        Ok(std::mem::take(&mut self.result))
    }

    // --- defaults ---------------------------------------------------------------------------

    /// Containers a mutation will create: absent proper prefixes of its paths (not the array
    /// itself when the next segment is an index).
    fn new_containers<J>(&self, mutations: &[(Vec<Seg>, J)]) -> Vec<Vec<Seg>> {
        let mut out: Vec<Vec<Seg>> = Vec::new();
        for (segs, _) in mutations {
            for k in 1..segs.len() {
                if matches!(segs[k], Seg::Index(_)) {
                    continue;
                }
                let prefix = &segs[..k];
                if self.st.base.get_path(prefix).is_none() && !out.iter().any(|p| p == prefix) {
                    out.push(prefix.to_vec());
                }
            }
        }
        out.sort_by_key(Vec::len);
        out
    }

    fn apply_defaults(&mut self, containers: &[Vec<Seg>]) -> Result<(), MutationError> {
        let cm = self.cm;
        for c in containers {
            for rule in &cm.defaults {
                if !matches_pattern(&rule.path, c) {
                    continue;
                }
                let input = self.whole_doc();
                let parent = if c.is_empty() {
                    JValue::Null
                } else {
                    self.st.merged().jvalue_at(&c[..c.len() - 1])
                };
                let me = self.st.base.get_path(c).map_or(JValue::Null, to_jvalue);
                let env = self.env().with("parent", parent).with("self", me);
                let Ok(Some(v)) = rule.expr.eval(&input, &env, &self.limits.expr) else {
                    continue;
                };
                let v = from_jvalue(&v, room_below(c.len()), &self.limits.expr).map_err(|e| {
                    MutationError::Invalid(format!(
                        "the defaultValues rule for {}: {}",
                        rule.path, e.message
                    ))
                })?;
                if v.as_obj().is_some() {
                    self.fill_absent(&mut c.clone(), &v)?;
                }
            }
        }
        Ok(())
    }

    /// Deep-merge `v` into the container at `at`, only where the caller left a field absent.
    /// As the reference's applier does, the object is written leaf by leaf (a non-empty object
    /// is descended into, a null is no default), so only the addresses actually filled are
    /// written and marked: a reader of a field the default leaves absent is not reached.
    fn fill_absent(&mut self, at: &mut Vec<Seg>, v: &Val) -> Result<(), MutationError> {
        let Some(obj) = v.as_obj() else { return Ok(()) };
        for (k, x) in obj.iter() {
            at.push(Seg::Field(k.clone()));
            match x {
                Val::Null => {}
                Val::Obj(o) if !o.is_empty() => self.fill_absent(at, x)?,
                _ => self.fill_leaf(at, x.clone())?,
            }
            at.pop();
        }
        Ok(())
    }

    /// Write a default at `p` when it may fill it: nothing (or null) is there, no derivation
    /// writes it, and nothing on the way is a value of another kind (fill-absent never
    /// replaces a value to make room).
    fn fill_leaf(&mut self, p: &[Seg], v: Val) -> Result<(), MutationError> {
        if self.cm.produced_above(p).is_some() {
            return Ok(());
        }
        let mut cur = Some(&self.st.base);
        for s in p {
            cur = match (cur, s) {
                (None | Some(Val::Null), _) => break,
                (Some(Val::Obj(m)), Seg::Field(k)) => m.get(k),
                (Some(Val::Arr(a)), Seg::Index(i)) => a.get(*i),
                _ => return Ok(()),
            };
        }
        if matches!(cur, None | Some(Val::Null)) {
            self.write_base(p, v)?;
        }
        Ok(())
    }
}

/// Does the concrete path `c` match the pattern (wildcards match any index)?
fn matches_pattern(pattern: &Address, c: &[Seg]) -> bool {
    pattern.segs.len() == c.len()
        && pattern.segs.iter().zip(c).all(|(p, s)| match (p, s) {
            (PathSeg::Wild, Seg::Index(_)) => true,
            (PathSeg::Index(i), Seg::Index(j)) => i == j,
            (PathSeg::Field(a), Seg::Field(b)) => a == b,
            _ => false,
        })
}

/// The instance's prefix through the pattern's last `[*]`.
fn element_prefix<'s>(pattern: &Address, inst: &'s [Seg]) -> &'s [Seg] {
    let n = pattern
        .segs
        .iter()
        .rposition(|s| matches!(s, PathSeg::Wild))
        .map_or(0, |p| p + 1);
    &inst[..n.min(inst.len())]
}

/// Concrete instances of a pattern in the merged document, optionally restricted to bound
/// leading wildcards.
fn expand_root(segs: &[PathSeg], m: Merged<'_>, bind: Option<&[usize]>, out: &mut Insts) {
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
fn expand(
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

/// The projected input of a document expression: only the paths it reads.
fn project_root(m: Merged<'_>, p: &Projection) -> JValue {
    if p.whole {
        return m.to_jvalue();
    }
    if !m.root_is_obj() {
        return project(m.doc, p);
    }
    let mut o = IndexMap::with_capacity(p.children.len());
    for (k, sub) in &p.children {
        if let Some(x) = m.root_get(k) {
            o.insert(k.to_string(), project(x, sub));
        }
    }
    JValue::object(o)
}

/// The projected input: only the paths the expression reads.
fn project(v: &Val, p: &Projection) -> JValue {
    if p.whole {
        return to_jvalue(v);
    }
    match v {
        Val::Obj(m) => {
            let mut o = IndexMap::with_capacity(p.children.len());
            for (k, sub) in &p.children {
                if let Some(x) = m.get(k) {
                    o.insert(k.to_string(), project(x, sub));
                }
            }
            JValue::object(o)
        }
        Val::Arr(a) => valem_core::expr::jarray(a.iter(), |x| project(x, p)),
        other => to_jvalue(other),
    }
}

/// Native `$sum/$count/$average/$max/$min` over a field path. `None` means "let JSONata
/// decide" (anything but plain numbers under plain objects, so errors and odd shapes keep
/// JSONata's exact behaviour).
fn aggregate(doc: Merged<'_>, agg: &Aggregate) -> Option<Option<JValue>> {
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
const EXACT: f64 = 9_007_199_254_740_992.0;

/// A memo's totals after the noted leaf changes; `None` when a change would make it inexact
/// (a non-integer, or magnitudes past 2^53): then the caller rescans.
fn apply_changes(mut m: AggMemo, changes: &[LeafChange]) -> Option<AggMemo> {
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
fn scan_memo(doc: Merged<'_>, agg: &Aggregate) -> Option<AggMemo> {
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
fn collect_root<'v>(m: Merged<'v>, path: &[Arc<str>], out: &mut Vec<&'v Val>) -> bool {
    match path.split_first() {
        Some((k, rest)) if m.root_is_obj() => member(m.root_get(k), rest, out),
        _ => collect(m.doc, path, out),
    }
}

/// Navigate like a JSONata path over plain data; false on shapes we leave to JSONata.
fn collect<'v>(v: &'v Val, path: &[Arc<str>], out: &mut Vec<&'v Val>) -> bool {
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
fn member<'v>(v: Option<&'v Val>, rest: &[Arc<str>], out: &mut Vec<&'v Val>) -> bool {
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

/// The reference's constraint truthiness: missing/null fail, booleans as is, numbers ≠ 0 and
/// non-empty strings pass, objects and arrays fail.
fn truthy(v: Option<&JValue>) -> bool {
    match v {
        None | Some(JValue::Null) | Some(JValue::Undefined) => false,
        Some(JValue::Bool(b)) => *b,
        Some(JValue::Number(n)) => *n != 0.0,
        Some(JValue::String(s)) => !s.is_empty(),
        Some(_) => false,
    }
}

/// A cycle's interpreter bindings: the model's, with the cycle's instant.
fn cycle_env<'e>(env: &'e std::cell::OnceCell<Env>, cm: &CompiledModel, now_ms: i64) -> &'e Env {
    env.get_or_init(|| Env {
        now_ms: Some(now_ms),
        ..cm.env.clone()
    })
}

/// From this many derivations queued, [`Cycle::derive`] sorts them into a run, and starts
/// loading the inputs of the one this many places ahead as it takes each.
const RUN_FROM: usize = 256;
const RUN_AHEAD: usize = 16;

/// Run a mutation cycle on the committed state `st`, in place. On error every change is undone,
/// so `st` is exactly as before; when the cycle commits, its journal goes to `undo` if given.
pub(super) fn run(
    cm: &CompiledModel,
    limits: &EngineLimits,
    st: &mut State,
    mutations: &[(Vec<Seg>, impl std::borrow::Borrow<serde_json::Value>)],
    now_ms: i64,
    undo: Option<&mut Vec<Undo>>,
) -> Result<MutationResult, MutationError> {
    let mut c = Cycle::new(cm, limits, st, now_ms);
    c.prefetch = mutations.len() <= super::PREFETCH_WRITES;
    // Each write journals one entry per tree and lists its address: room for all at once (a
    // 200k-write load would otherwise copy these as they grow).
    c.journal.base.reserve(mutations.len());
    if c.st.tree.is_some() {
        c.journal.merged.reserve(mutations.len());
    }
    c.result.mutated_paths.reserve(mutations.len());
    let containers = if cm.defaults.is_empty() {
        Vec::new()
    } else {
        c.new_containers(mutations)
    };
    let applied = mutations
        .iter()
        .try_for_each(|(segs, v)| {
            let v = Val::from_json_within(v.borrow(), room_below(segs.len())).map_err(|e| {
                MutationError::Invalid(format!("the value written at {}: {e}", render(segs)))
            })?;
            c.write_base(segs, v)
        })
        .and_then(|()| {
            if containers.is_empty() {
                Ok(())
            } else {
                c.apply_defaults(&containers)
            }
        });
    if let Err(e) = applied {
        c.rollback();
        return Err(e);
    }
    let result = c.finish_in_place()?;
    if let Some(log) = undo {
        log.push(c.take_undo());
    }
    Ok(result)
}

/// Seed and compute a new model's state.
pub(super) fn initialize(
    cm: &CompiledModel,
    limits: &EngineLimits,
    st: &mut State,
    now_ms: i64,
) -> Result<MutationResult, MutationError> {
    let mut c = Cycle::new(cm, limits, st, now_ms);
    c.apply_defaults(&[Vec::new()])?;
    let schema = cm.schema.clone();
    apply_schema_defaults(&mut c, &schema, &schema, &mut Vec::new(), 0)?;
    // Constraints and effects at creation: only those downstream of what was seeded.
    let mut allowed: HashSet<NodeId> = HashSet::default();
    let mut stack: Vec<NodeId> =
        c.sc.dirty_nodes()
            .chain(c.effect_dirty.iter().copied())
            .collect();
    while let Some(n) = stack.pop() {
        if allowed.insert(n) {
            stack.extend(cm.dependents.of(n).iter().copied());
        }
    }
    c.allowed = Some(allowed);
    for lvl in &cm.levels {
        for &id in lvl {
            c.mark_all(id);
        }
    }
    for &id in &cm.meta_nodes {
        c.mark_all(id);
    }
    c.finish()
}

/// JSON Schema `default` keywords fill absent properties at creation (after `$` rules), as the
/// reference's `SchemaDefaultApplier` does: every `properties` entry with a non-null `default`
/// is filled (the objects on the way created) and not descended into; one without is descended
/// into when it declares `properties`. Local `$ref`s are followed (the reference reads the
/// schema as written).
fn apply_schema_defaults(
    c: &mut Cycle<'_>,
    root: &serde_json::Value,
    node: &serde_json::Value,
    at: &mut Vec<Seg>,
    depth: usize,
) -> Result<(), MutationError> {
    if depth > 32 {
        return Ok(());
    }
    let node = super::schema::resolve(root, node);
    let Some(props) = node.get("properties").and_then(|p| p.as_object()) else {
        return Ok(());
    };
    for (k, sub) in props {
        at.push(Seg::Field(valem_core::value::intern(k)));
        let sub_r = super::schema::resolve(root, sub);
        match sub_r.get("default") {
            Some(d) if !d.is_null() => {
                let d = Val::from_json_within(d, room_below(at.len())).map_err(|e| {
                    MutationError::Invalid(format!("the schema default of {}: {e}", render(at)))
                })?;
                c.fill_leaf(at, d)?
            }
            _ => apply_schema_defaults(c, root, sub_r, at, depth + 1)?,
        }
        at.pop();
    }
    Ok(())
}

/// Evaluate stale lazy derivations (on read); what that changed goes to `undo` when given.
pub(super) fn materialize_lazy(
    cm: &CompiledModel,
    limits: &EngineLimits,
    st: &mut State,
    now_ms: i64,
    undo: Option<&mut Vec<Undo>>,
) {
    let stale: Vec<NodeId> = st.lazy_stale.iter().copied().collect();
    // A read materialises what it reads whole: it is not stopped part-way.
    let limits = limits.unbounded();
    let mut c = Cycle::new(cm, &limits, st, now_ms);
    c.include_lazy = true;
    for id in stale {
        c.mark_all(id);
    }
    c.derive();
    if let Some(log) = undo {
        log.push(c.take_undo());
    }
}

/// Recompute every derivation and meta-derivation of `st.base` from scratch (after a spec
/// evolution or a restore): the merged document and meta are rebuilt; no constraint or effect
/// runs, as in the reference's `recomputeAllDerivations`.
pub(super) fn recompute(
    cm: &CompiledModel,
    limits: &EngineLimits,
    st: &mut State,
    now_ms: i64,
) -> MutationResult {
    st.tree = (!cm.merged_is_base).then(|| st.base.clone());
    st.cells = super::merged::Cells::new(cm.cells.clone());
    st.meta = Default::default();
    st.aggregates = Default::default();
    st.lazy_stale = Default::default();
    // A recompute rebuilds the derived values of a committed document from scratch and has
    // nothing to roll back to: it runs to the end.
    let limits = limits.unbounded();
    let mut c = Cycle::new(cm, &limits, st, now_ms);
    c.allowed = Some(HashSet::default());
    for lvl in &cm.levels {
        for &id in lvl {
            c.mark_all(id);
        }
    }
    for &id in &cm.meta_nodes {
        c.mark_all(id);
    }
    // With nothing allowed, no constraint can roll back.
    c.finish().unwrap_or_default()
}
