//! One reactive cycle over a working copy of the state: writes are propagated through the reader
//! index to dirty nodes (per `[*]` instance), derivations run level by level with early cutoff,
//! then meta-derivations, constraints and effects. The caller commits the working copy only when
//! the cycle succeeds, so a rollback is simply dropping it.

mod aggregates;
mod checks;
mod defaults;
mod evaluate;
mod instances;
mod journal;
mod propagate;

use aggregates::*;
use defaults::*;
use instances::*;
pub use journal::Undo;
use journal::*;

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
        // Every flag a cycle set was in `touched` (checked where it is cheap to).
        debug_assert!(
            self.flags.len() > 4096 || self.flags.iter().all(|&f| f == 0),
            "a cycle left node flags set"
        );
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
    journal: Journal,
    /// Slot values of a JIT call (reused).
    jit_slots: Vec<f64>,
    /// Whether the last `evaluate` was answered by compiled code.
    jit_hit: bool,
    /// The arithmetic tier's answer for the derivation being evaluated, made ahead
    /// ([`Cycle::answer_ahead`]), and whether compiled code gave it.
    early: Option<(jit::Answer, bool)>,
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
        debug_assert!(journal.is_clear(), "the last cycle left its journal behind");
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
            journal,
            jit_slots: Vec::new(),
            jit_hit: false,
            early: None,
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
            if let Some(c) = node.cell() {
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

    /// Record an evaluation of `node`: its value, or for a constraint whether it held.
    /// `target`: the address when it is not the node's key (`[*]` instances).
    fn trace(
        &mut self,
        node: &Node,
        target: Option<arcstr::ArcStr>,
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
        // The run's first level, when it is large, is answered ahead a chunk at a time on two
        // threads (see `Cycle::answer_ahead`): the answers of `run[ahead.0..]` are `ahead.1`.
        let first_level = match run.first() {
            Some(&Reverse((level, _))) if run.len() >= AHEAD_FROM && self.limits.jit.enabled => {
                run.partition_point(|&Reverse((l, _))| l == level)
            }
            _ => 0,
        };
        let first_level =
            if first_level >= AHEAD_FROM && valem_core::second_core() && ahead_allowed() {
                first_level
            } else {
                0
            };
        let mut ahead: (usize, Vec<Early>) = (0, Vec::new());
        loop {
            let from_run = match (run.get(next), self.pending.peek()) {
                (Some(Reverse(a)), Some(Reverse(b))) => a <= b,
                (Some(_), None) => true,
                (None, _) => false,
            };
            let id = if from_run {
                let Reverse((_, id)) = run[next];
                if next < first_level {
                    if next >= ahead.0 + ahead.1.len() {
                        let end = first_level.min(next + AHEAD_CHUNK);
                        self.answer_ahead(&run[next..end], &mut ahead.1);
                        ahead.0 = next;
                    }
                    self.early = ahead
                        .1
                        .get_mut(next - ahead.0)
                        .and_then(|e| std::mem::take(e).answer());
                }
                next += 1;
                if next + RUN_AHEAD >= first_level {
                    if let Some(&Reverse((_, ahead))) = run.get(next + RUN_AHEAD) {
                        if let Some(node) = cm.nodes.get(ahead as usize) {
                            node.jit.prefetch_inputs(self.st.merged());
                        }
                    }
                    // Two stages: the level above for the one twice as far (a large
                    // document's branches are a cache miss a level of their own, which the
                    // walk above would otherwise wait on).
                    if let Some(&Reverse((_, far))) = run.get(next + 2 * RUN_AHEAD) {
                        if let Some(node) = cm.nodes.get(far as usize) {
                            node.jit.prefetch_inputs_far(self.st.merged());
                        }
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
            self.early = None;
        }
        self.early = None;
        if !self.agg_delta.is_empty() {
            self.drop_unrun_aggregates();
        }
    }

    /// The arithmetic tier's answers for `run` (a stretch of one level of the queued
    /// derivations), made on two threads into `out`: for each concrete derivation whose slots
    /// read only the document's tree (top-level members that are not cells, paths from the
    /// root), what [`Cycle::evaluate_lowered`] would answer; `None` for the others. Nothing on
    /// one level reads what another on it writes, so the answers made before any of them is
    /// written are the ones evaluating each in turn gives. A large document's first cycle (a
    /// load, a wake) is mostly these reads, cache misses into millions of members: the two
    /// threads wait on them side by side. The runs are counted and the answers written on the
    /// cycle's thread, as they are taken.
    fn answer_ahead(&self, run: &[Reverse<(u32, NodeId)>], out: &mut Vec<Early>) {
        let lowered: Vec<Option<&jit::NodeJit>> = run
            .iter()
            .map(|&Reverse((_, id))| {
                let node = self.cm.nodes.get(id as usize)?;
                let plain = matches!(node.kind, NodeKind::Derivation { lazy: false })
                    && node.concrete.is_some()
                    && node.input == Input::Doc
                    && !node.uses_parent;
                node.jit
                    .lowering()
                    .filter(|nj| plain && nj.reads_tree_only())
            })
            .collect();
        out.clear();
        out.resize_with(run.len(), Early::default);
        let doc = self.st.merged().doc;
        let half = run.len() / 2;
        let (mine, theirs) = out.split_at_mut(half);
        let (my_nodes, their_nodes) = lowered.split_at(half);
        let (buf, their_buf) = (Vec::with_capacity(8), Vec::with_capacity(8));
        std::thread::scope(|s| {
            let helper = std::thread::Builder::new()
                .name("valem-ahead".into())
                .spawn_scoped(s, || answer_all(their_nodes, doc, theirs, their_buf));
            answer_all(my_nodes, doc, mine, buf);
            // No thread to be had: the rest are evaluated as usual, as they are taken. Its
            // buffer comes back to be freed here.
            if let Ok(Err(p)) = helper.map(|h| h.join()) {
                std::panic::resume_unwind(p);
            }
        });
        #[cfg(test)]
        ahead_tests::ANSWERED.with(|c| {
            let answered = out.iter().filter(|e| !matches!(e, Early::None)).count();
            c.set(c.get() + answered);
        });
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
        match node.concrete.as_deref() {
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
        // Interpreted (or an aggregate): it counts as a whole check's work.
        self.spend(WORK_PER_CHECK);
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
        let (nj, code) = node.jit(self.limits.jit)?;
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
        let target: Option<arcstr::ArcStr> = (!concrete).then(|| {
            render_into(inst, &mut self.render_buf);
            arcstr::ArcStr::from(self.render_buf.as_str())
        });
        let noting = self.cm.has_delta_aggregates;
        let written = if let (Some(c), true) = (node.cell(), concrete) {
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
                    arcstr::ArcStr::from(format!("$constraint:{}", v.constraint_id)),
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
}

/// A cycle's interpreter bindings: the model's, with the cycle's instant.
fn cycle_env<'e>(env: &'e std::cell::OnceCell<Env>, cm: &CompiledModel, now_ms: i64) -> &'e Env {
    env.get_or_init(|| Env {
        now_ms: Some(now_ms),
        ..cm.env.clone()
    })
}

/// From this many derivations on the first level of a run, [`Cycle::derive`] answers them ahead
/// on two threads ([`Cycle::answer_ahead`]), this many at a time: the cycle's time budget is
/// looked at as the answers are taken, so it may be overrun by one stretch (a few ms).
const AHEAD_FROM: usize = 32_768;
const AHEAD_CHUNK: usize = 1 << 16;

/// An answer of the arithmetic tier made ahead ([`Cycle::answer_ahead`]), and whether
/// compiled code gave it: 16 bytes, where the answer as evaluated is 80.
#[derive(Debug, Default)]
enum Early {
    /// None made: the derivation is evaluated as usual.
    #[default]
    None,
    Num(f64, bool),
    Bool(bool, bool),
    Undefined,
    Error(Box<ExprError>),
}

impl Early {
    fn of(answer: Option<(jit::Answer, bool)>) -> Early {
        match answer {
            None => Early::None,
            Some((Ok(Some(interp::Value::Num(x))), hit)) => Early::Num(x, hit),
            Some((Ok(Some(interp::Value::Bool(b))), hit)) => Early::Bool(b, hit),
            Some((Ok(None), _)) => Early::Undefined,
            Some((Err(e), _)) => Early::Error(Box::new(e)),
        }
    }

    fn answer(self) -> Option<(jit::Answer, bool)> {
        Some(match self {
            Early::None => return None,
            Early::Num(x, hit) => (Ok(Some(interp::Value::Num(x))), hit),
            Early::Bool(b, hit) => (Ok(Some(interp::Value::Bool(b))), hit),
            Early::Undefined => (Ok(None), false),
            Early::Error(e) => (Err(*e), false),
        })
    }
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Early>() == 16);

/// Whether [`Cycle::answer_ahead`] may be used (tests compare cycles with and without it).
fn ahead_allowed() -> bool {
    #[cfg(test)]
    return ahead_tests::ALLOWED.with(std::cell::Cell::get);
    #[cfg(not(test))]
    true
}

/// The answers of `nodes` over `doc` into `out` (see [`Cycle::answer_ahead`]), starting to load
/// the members of those ahead as [`Cycle::derive`] does. The slots' buffer is made by the
/// cycle's thread and handed back to it: the helper allocates nothing.
fn answer_all(
    nodes: &[Option<&jit::NodeJit>],
    doc: &Val,
    out: &mut [Early],
    mut slots: Vec<f64>,
) -> Vec<f64> {
    for (k, (nj, o)) in nodes.iter().zip(out).enumerate() {
        if let Some(Some(a)) = nodes.get(k + RUN_AHEAD) {
            a.prefetch_members(doc, false);
        }
        if let Some(Some(f)) = nodes.get(k + 2 * RUN_AHEAD) {
            f.prefetch_members(doc, true);
        }
        if let Some(nj) = nj {
            *o = Early::of(nj.answer_over_tree(doc, &mut slots));
        }
    }
    slots
}

/// From this many derivations queued, [`Cycle::derive`] sorts them into a run, and starts
/// loading the inputs of the one this many places ahead as it takes each (and the level above
/// them for the one twice as far).
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
    for &id in &cm.by_level {
        c.mark_all(id);
    }
    for &id in &cm.meta_nodes {
        c.mark_all(id);
    }
    c.finish()
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
    for &id in &cm.by_level {
        c.mark_all(id);
    }
    for &id in &cm.meta_nodes {
        c.mark_all(id);
    }
    // With nothing allowed, no constraint can roll back.
    c.finish().unwrap_or_default()
}

#[cfg(test)]
mod ahead_tests {
    use super::*;
    use crate::{EngineLimits, Model};
    use serde_json::{json, Value as Json};
    use std::cell::Cell;
    use valem_core::time::Timestamp;

    thread_local! {
        pub(super) static ALLOWED: Cell<bool> = const { Cell::new(true) };
        /// Derivations answered ahead on this thread.
        pub(super) static ANSWERED: Cell<usize> = const { Cell::new(0) };
    }

    /// One derivation of each kind the ahead answers must match: numbers, a type error (a
    /// string input), a comparison, an undefined input; and one reading a cell (the level
    /// above, not answered ahead).
    fn spec(n: usize) -> valem_core::spec::ModelSpec {
        let derivations: Vec<Json> = (0..n)
            .map(|i| {
                let expr = match i % 5 {
                    0 => format!("a{i} * b{i}"),
                    1 => format!("s{i} + b{i}"),
                    2 => format!("a{i} > b{i}"),
                    3 => format!("missing{i} * 2"),
                    _ => format!("d{} + a{i}", i - 1),
                };
                json!({"path": format!("$.d{i}"), "expr": expr})
            })
            .collect();
        valem_core::spec::parse_spec(
            &json!({"id": "ahead", "schema": {}, "derivations": derivations}),
        )
        .unwrap()
    }

    fn doc(n: usize, round: usize) -> Json {
        let mut o = serde_json::Map::new();
        for i in 0..n {
            o.insert(format!("a{i}"), json!((i * 7 + round) % 101));
            o.insert(format!("b{i}"), json!((i + round) % 13));
            if i % 5 == 1 {
                o.insert(format!("s{i}"), json!("text"));
            }
        }
        Json::Object(o)
    }

    /// A whole-document write to a model whose first level is large enough to be answered
    /// ahead on two threads gives exactly the results, traces and document of evaluating each
    /// derivation in turn — before the compiled code is ready and after.
    #[test]
    fn answers_made_ahead_are_the_ones_evaluated_in_turn() {
        let n = AHEAD_FROM * 5 / 4 + 4_000;
        let spec = spec(n);
        let now = Timestamp::from_ms(0);
        let limits = EngineLimits::default();
        let run = |ahead: bool, rounds: std::ops::Range<usize>, m: &mut Model| {
            ALLOWED.with(|a| a.set(ahead));
            let out: Vec<Json> = rounds
                .map(|r| {
                    let res = m.mutate(&[("$".into(), doc(n, r))], now).unwrap();
                    res.to_json(false)
                })
                .collect();
            ALLOWED.with(|a| a.set(true));
            out
        };
        let (mut with, _) = Model::create(&spec, now, limits.clone()).unwrap();
        let (mut without, _) = Model::create(&spec, now, limits.clone()).unwrap();
        ANSWERED.with(|c| c.set(0));
        let a = run(true, 0..3, &mut with);
        let answered = ANSWERED.with(Cell::get);
        let b = run(false, 0..3, &mut without);
        assert_eq!(a, b);
        assert_eq!(with.merged_json(now), without.merged_json(now));
        let merged = with.merged_json(now);
        // The last round's inputs: `a{i}` is (7i + 2) mod 101, `b{i}` (i + 2) mod 13.
        let (a, b) = (|i: usize| (i * 7 + 2) % 101, |i: usize| (i + 2) % 13);
        assert_eq!(merged["d5"], json!(a(5) * b(5)));
        assert_eq!(merged["d2"], json!(a(2) > b(2)));
        assert_eq!(merged["d3"], Json::Null);
        if valem_core::second_core() {
            // Four in five derivations are on the first level, three rounds.
            assert!(answered >= 3 * (n / 5) * 4, "answered ahead: {answered}");
        }
        // With the compiled code ready, traces included (they say which tier answered).
        assert!(jit::flush(std::time::Duration::from_secs(30)));
        ALLOWED.with(|a| a.set(true));
        let a = with.mutate(&[("$".into(), doc(n, 7))], now).unwrap();
        ALLOWED.with(|a| a.set(false));
        let b = without.mutate(&[("$".into(), doc(n, 7))], now).unwrap();
        ALLOWED.with(|a| a.set(true));
        let (a, b) = (a.to_json(true), b.to_json(true));
        assert_eq!(a, b);
        let traces = a["traces"].as_array().unwrap();
        assert!(
            traces.iter().any(|t| t["jit"] == json!(true)),
            "compiled code answered"
        );
        let error = traces
            .iter()
            .find(|t| t["targetPath"] == json!("$.d1"))
            .and_then(|t| t["errorMessage"].as_str())
            .unwrap_or_default();
        assert!(error.starts_with("T2001"), "a type error: {error}");
    }
}
