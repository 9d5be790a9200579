//! The JIT tier: arithmetic derivations run as native code once they are hot.
//!
//! At model compile, every derivation whose expression lowers to the numeric IR
//! ([`valem_jit::ir`]) gets a [`NodeJit`]: the input paths its slots read and a shared
//! [`Slot`], one per distinct program (same IR, same slot layout: `a + b` and `x + y` share one).
//! Until its code is ready the reference interpreter of the IR ([`valem_jit::interp`]) computes
//! the node; after it has run [`tier_after`] times it asks for code: one compiler thread per
//! process compiles what is queued into one [`CodeSet`] and publishes it in the slot, so the
//! shard never waits for cranelift. Whenever an input is not a JSON number or a value is not
//! finite, the JSONata interpreter answers (the node's expression is compiled for it then): the
//! JIT never changes an answer. One case is answered here instead, as the interpreter would:
//! a single `+ - * / %` between inputs and constants with an input that is null, a boolean or a
//! string is JSONata's T2001/T2002 error ([`type_error`]; a chain created over an empty
//! document is 100k of them).
//!
//! Code is freed when the last node using it goes away: nodes hold their slot, slots hold their
//! code set, and the registry holds slots weakly.
//!
//! Whether the tier runs and when a node asks for its code are the caller's settings
//! ([`crate::JitConfig`], in the engine limits), read per evaluation, so a bench can compare
//! both in one process.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use valem_jit::codegen::{CodeSet, Shapes};
use valem_jit::ir::{Arith, Base, Ir, Program, Ty};

use smallvec::SmallVec;

use super::merged::{CellLayout, Merged};
use valem_core::value::{intern, Key, Seg, Val};

/// Compiled code of one program: its set and its index there.
#[derive(Debug)]
pub struct Code {
    pub set: Arc<CodeSet>,
    pub index: usize,
    pub ty: Ty,
}

/// One distinct program, shared by every node that lowers to it.
#[derive(Debug)]
pub struct Slot {
    program: Program,
    shapes: Shapes,
    requested: AtomicBool,
    /// `None` inside: code generation failed; the interpreter keeps the node.
    code: OnceLock<Option<Code>>,
}

impl Slot {
    pub fn code(&self) -> Option<&Code> {
        self.code.get().and_then(Option::as_ref)
    }
}

/// Where one slot reads its number. The common reads (one top-level member, a cell or not)
/// are 16 bytes and allocate nothing beyond the shared interned key.
#[derive(Debug)]
pub enum SlotInput {
    /// A top-level member that is a cell (`merged.rs`).
    Cell(u32, Key),
    /// A top-level member of the document that is not a cell, with its
    /// [`valem_core::value::member_hash`] (the slot reads it without reading the name).
    Member(u32, Key),
    /// A cell member, then the rest of the path.
    CellPath(Box<(u32, Key, Box<[Seg]>)>),
    /// A path from the document root through the tree (boxed twice, as the next: one
    /// pointer, so that the common reads above are 16 bytes, not 24).
    Doc(Box<Box<[Seg]>>),
    /// A path from the target's parent (`$parent`).
    Parent(Box<Box<[Seg]>>),
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<SlotInput>() == 16);

/// A lowered derivation: its slots' inputs and its shared program. Up to two inputs are kept
/// in the node itself: reading them is no extra cache miss, and no allocation per derivation.
#[derive(Debug)]
pub struct NodeJit {
    pub inputs: SmallVec<[SlotInput; 2]>,
    pub slot: Arc<Slot>,
}

/// The slots of one compile: per program key, the slot without and with a batched entry.
pub type Slots = HashMap<String, [Option<Arc<Slot>>; 2]>;

impl NodeJit {
    /// A node's tier over `program` (whose key is `key`). `batch`: the node has `[*]`
    /// instances (a batched entry is compiled too). `slots` shares one [`Slot`] per distinct
    /// program among the nodes of one compile.
    ///
    /// Its slots read top-level members by name until [`NodeJit::resolve_cells`] points
    /// those that are cells at their cells (the cells are laid out once every node is known).
    pub fn new(program: Program, key: String, batch: bool, slots: &mut Slots) -> NodeJit {
        let inputs: SmallVec<_> = slot_inputs(&program).into_iter().collect();
        let slot = slot_for(program, key, batch, slots);
        NodeJit { inputs, slot }
    }

    /// A node reading `inputs` (as [`NodeJit::new`] gives them) whose program, of key `key`,
    /// `make` gives: it is made only when no node of this compile had that program yet (a
    /// spec of 100k formulas of one shape makes it once).
    pub fn shared(
        key: &str,
        batch: bool,
        inputs: SmallVec<[SlotInput; 2]>,
        slots: &mut Slots,
        make: impl FnOnce() -> Program,
    ) -> NodeJit {
        let slot = match slots.get(key).and_then(|s| s[usize::from(batch)].clone()) {
            Some(s) => s,
            None => slot_for(make(), key.to_string(), batch, slots),
        };
        NodeJit { inputs, slot }
    }

    /// Read the top-level members that are cells from their cells (the slots are made reading
    /// every top-level member by name, before the cells are laid out).
    pub fn resolve_cells(&mut self, cells: &CellLayout) {
        for input in &mut self.inputs {
            if let Some(cell) = as_cell(input, cells) {
                *input = cell;
            }
        }
    }

    /// The program (the same for every node of its shape).
    pub fn program(&self) -> &Program {
        &self.slot.program
    }
}

fn slot_for(program: Program, key: String, batch: bool, slots: &mut Slots) -> Arc<Slot> {
    let at = slots.entry(key).or_default();
    match &at[usize::from(batch)] {
        Some(s) => s.clone(),
        None => {
            let shapes = if batch { Shapes::BOTH } else { Shapes::SCALAR };
            let s = registry().slot(program, shapes);
            at[usize::from(batch)] = Some(s.clone());
            s
        }
    }
}

/// Where a slot reading `path` from `base` reads, by name ([`NodeJit::resolve_cells`] points
/// the members that are cells at their cells).
pub fn slot_input(base: &Base, path: Box<[Seg]>) -> SlotInput {
    match (base, &*path) {
        (Base::Parent, _) => SlotInput::Parent(Box::new(path)),
        (Base::Input, [Seg::Field(k)]) => member_input(k.clone()),
        (Base::Input, _) => SlotInput::Doc(Box::new(path)),
    }
}

/// [`slot_input`] for top-level member `k` of the input, made without a path.
pub fn member_input(k: Key) -> SlotInput {
    SlotInput::Member(valem_core::value::member_hash(&k), k)
}

/// What a slot reading `input` by name reads once its top-level member is found to be a cell
/// (`None`: it is not one, or the slot reads no member by name).
fn as_cell(input: &SlotInput, cells: &CellLayout) -> Option<SlotInput> {
    match input {
        SlotInput::Member(_, k) => cell_input(k, &[], cells),
        SlotInput::Doc(path) => match &***path {
            [Seg::Field(k), rest @ ..] => cell_input(k, rest, cells),
            _ => None,
        },
        SlotInput::Cell(..) | SlotInput::CellPath(_) | SlotInput::Parent(_) => None,
    }
}

/// A slot reading top-level member `k`, then `rest`, when `k` is a cell.
fn cell_input(k: &Key, rest: &[Seg], cells: &CellLayout) -> Option<SlotInput> {
    let c = cells.find(k)?;
    Some(match rest {
        [] => SlotInput::Cell(c, k.clone()),
        rest => SlotInput::CellPath(Box::new((c, k.clone(), rest.into()))),
    })
}

/// Where each slot of `program` reads (see [`slot_input`]).
pub fn slot_inputs(program: &Program) -> Vec<SlotInput> {
    program
        .inputs
        .iter()
        .map(|r| {
            let path: Box<[Seg]> = r.fields.iter().map(|f| Seg::Field(intern(f))).collect();
            slot_input(&r.base, path)
        })
        .collect()
}

/// A node's tier state: its lowering (made when the spec is compiled: an arithmetic
/// derivation never keeps the interpreter's AST). Its runs, counted until it asks for
/// compiled code, are kept in the node ([`JitCell::get`]), where its first 32 bytes had room.
#[derive(Debug, Default)]
pub struct JitCell {
    lowered: Option<NodeJit>,
}

impl JitCell {
    pub fn new(lowered: Option<NodeJit>) -> JitCell {
        JitCell { lowered }
    }

    /// See [`NodeJit::resolve_cells`].
    pub fn resolve_cells(&mut self, cells: &CellLayout) {
        if let Some(nj) = &mut self.lowered {
            nj.resolve_cells(cells);
        }
    }

    /// Whether [`JitCell::resolve_cells`] would point a slot at a cell.
    pub fn reads_cells(&self, cells: &CellLayout) -> bool {
        self.lowered
            .as_ref()
            .is_some_and(|nj| nj.inputs.iter().any(|i| as_cell(i, cells).is_some()))
    }

    /// Start loading the top-level members and cells its slots read (see
    /// [`super::prefetch`]).
    #[inline]
    pub fn prefetch_inputs(&self, m: Merged<'_>) {
        if let Some(nj) = &self.lowered {
            nj.prefetch_inputs(m);
        }
    }

    /// The first stage of [`JitCell::prefetch_inputs`], some nodes before it: the level above
    /// the one that prefetches of the members it reads (`ObjMap::prefetch_hashed_far`).
    pub fn prefetch_inputs_far(&self, m: Merged<'_>) {
        if let Some(nj) = &self.lowered {
            nj.prefetch_members(m.doc, true);
        }
    }

    /// The node's lowering, whether the tier is on or not.
    pub fn lowering(&self) -> Option<&NodeJit> {
        self.lowered.as_ref()
    }

    /// Whether the expression is in the arithmetic subset.
    pub fn lowered(&self) -> bool {
        self.lowered.is_some()
    }

    /// The node's lowering while the tier is on, with its compiled code once ready; counts
    /// this run in `runs` (the node's) and asks for the code once the node is hot.
    #[inline]
    pub fn get(
        &self,
        runs: &Cell<u32>,
        cfg: crate::JitConfig,
    ) -> Option<(&NodeJit, Option<&Code>)> {
        let nj = self.lowered.as_ref()?;
        if !cfg.enabled {
            return None;
        }
        if let Some(code) = nj.slot.code() {
            return Some((nj, Some(code)));
        }
        let ran = runs.get();
        runs.set(ran.saturating_add(1));
        if ran >= cfg.tier_after && !nj.slot.requested.swap(true, Ordering::AcqRel) {
            registry().request(nj.slot.clone());
        }
        Some((nj, nj.slot.code()))
    }
}

/// What [`read_slots`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// Every slot holds a JSON number.
    Numbers,
    /// Some paths end at a member that is not there (*undefined*; their slots hold NaN), the
    /// others at numbers.
    Undefined,
    /// The slots of the set bits (slot `i`: bit `i`) end at null, a boolean or a string (their
    /// slots hold NaN); the others at numbers or nothing. See [`type_error`].
    NotNumbers(u64),
    /// Something else: the interpreter answers.
    Other,
}

/// What a slot's path ends at.
enum Walked {
    Num(f64),
    /// A member on the way is not there.
    Missing,
    /// Null, a boolean or a string: not a number, and JSONata's arithmetic says so.
    NotNumber,
    /// Anything else (an array, an object, a path through something not an object).
    Other,
}

/// A single arithmetic operation between slots and constants, with the slots of
/// `not_numbers` ([`Read::NotNumbers`]) holding null, a boolean or a string: the error the
/// JSONata interpreter gives, the left side checked first (T2001, else T2002 for the right;
/// an undefined side is not checked). `None` for any other program: the interpreter answers.
pub fn type_error(p: &Program, not_numbers: u64) -> Option<valem_core::expr::ExprError> {
    let Ir::Arith(op, a, b) = &p.ir else {
        return None;
    };
    let not_number = |x: &Ir| match x {
        Ir::Slot(s) => Some(*s < 64 && (not_numbers >> s) & 1 == 1),
        Ir::Const(_) => Some(false),
        _ => None,
    };
    let (left, right) = (not_number(a)?, not_number(b)?);
    if !(left || right) {
        return None;
    }
    arith_error(*op, left)
}

/// The interpreter's own error for `op` with a non-number on the left (or right) side: made
/// once per operation and side by evaluating `a OP b` over such an input, so the wording is
/// the interpreter's whatever it is.
fn arith_error(op: Arith, left: bool) -> Option<valem_core::expr::ExprError> {
    thread_local! {
        static MADE: std::cell::RefCell<HashMap<(Arith, bool), Option<valem_core::expr::ExprError>>> =
            std::cell::RefCell::new(HashMap::new());
    }
    MADE.with(|m| {
        m.borrow_mut()
            .entry((op, left))
            .or_insert_with(|| {
                let sym = match op {
                    Arith::Add => "+",
                    Arith::Sub => "-",
                    Arith::Mul => "*",
                    Arith::Div => "/",
                    Arith::Rem => "%",
                };
                let input = if left {
                    serde_json::json!({"a": null, "b": 1})
                } else {
                    serde_json::json!({"a": 1, "b": null})
                };
                let text = format!("a {sym} b");
                let limits = valem_core::expr::Limits::default();
                let want = if left { "T2001" } else { "T2002" };
                match valem_core::expr::eval_once(&text, Some(&input), &Default::default(), &limits)
                {
                    Err(e) if e.code.as_deref() == Some(want) => Some(e),
                    _ => None,
                }
            })
            .clone()
    })
}

/// A member path walked through objects only, and what it ends at.
#[inline]
fn walk(mut v: &Val, path: &[Seg]) -> Walked {
    for seg in path {
        let (Seg::Field(k), Val::Obj(m)) = (seg, v) else {
            return Walked::Other;
        };
        match m.get(k) {
            Some(x) => v = x,
            None => return Walked::Missing,
        }
    }
    match v {
        Val::Num(n) => Walked::Num(*n),
        Val::Null | Val::Bool(_) | Val::Str(_) => Walked::NotNumber,
        _ => Walked::Other,
    }
}

/// Read slot values from the merged document (`parent`: the address of the target's parent,
/// for `$parent` reads).
#[inline]
pub fn read_slots(
    inputs: &[SlotInput],
    m: Merged<'_>,
    parent: Option<&[Seg]>,
    out: &mut Vec<f64>,
) -> Read {
    read_slots_in(inputs, m.doc, Some(m), parent, out)
}

/// [`read_slots`] over the document's tree `doc`, and over the cells when `m` is given (its
/// tree is `doc`); without them, a slot that reads a cell or `$parent` is [`Read::Other`].
#[inline]
fn read_slots_in(
    inputs: &[SlotInput],
    doc: &Val,
    m: Option<Merged<'_>>,
    parent: Option<&[Seg]>,
    out: &mut Vec<f64>,
) -> Read {
    let root_is_obj = matches!(doc, Val::Obj(_));
    out.clear();
    let mut undefined = false;
    let mut not_numbers = 0u64;
    let mut parent_val: Option<Option<&Val>> = None;
    for input in inputs {
        // A top-level member (when it is there), then the rest of the path.
        let below = |v: Option<&Val>, rest: &[Seg]| match v {
            Some(v) => walk(v, rest),
            None => Walked::Missing,
        };
        let x = match input {
            SlotInput::Cell(..) | SlotInput::CellPath(_) | SlotInput::Member(..)
                if !root_is_obj =>
            {
                return Read::Other
            }
            SlotInput::Cell(..) | SlotInput::CellPath(_) | SlotInput::Parent(_) if m.is_none() => {
                return Read::Other
            }
            SlotInput::Cell(c, k) => below(m.and_then(|m| m.cell_or_member(*c, k)), &[]),
            SlotInput::CellPath(b) => {
                let (c, k, rest) = &**b;
                below(m.and_then(|m| m.cell_or_member(*c, k)), rest)
            }
            SlotInput::Member(h, k) => below(doc.as_obj().and_then(|o| o.get_hashed(*h, k)), &[]),
            SlotInput::Doc(path) if path.is_empty() => Walked::Other,
            SlotInput::Doc(path) => walk(doc, path),
            SlotInput::Parent(path) => match (parent, path.split_first(), m) {
                // A top-level target's parent is the root.
                (Some([]), Some((Seg::Field(k), rest)), Some(m)) if root_is_obj => {
                    below(m.root_get(k), rest)
                }
                (Some(p), Some(_), Some(m)) if !p.is_empty() => {
                    // Found once per call: the slots of `$parent.a * $parent.b` share it.
                    let v = *parent_val.get_or_insert_with(|| m.get_path(p));
                    v.map_or(Walked::Other, |v| walk(v, path))
                }
                _ => Walked::Other,
            },
        };
        match x {
            Walked::Num(x) => out.push(x),
            Walked::Missing => {
                undefined = true;
                out.push(f64::NAN);
            }
            Walked::NotNumber if out.len() < 64 => {
                not_numbers |= 1 << out.len();
                out.push(f64::NAN);
            }
            Walked::NotNumber | Walked::Other => return Read::Other,
        }
    }
    if not_numbers != 0 {
        Read::NotNumbers(not_numbers)
    } else if undefined {
        Read::Undefined
    } else {
        Read::Numbers
    }
}

/// [`read_slots`] over a plain document (no cells, no parent): for tests and tools.
pub fn read_doc_slots(inputs: &[SlotInput], doc: &Val, out: &mut Vec<f64>) -> Read {
    // No cells: one empty set per thread, made once (a fresh one per call would allocate its
    // layout).
    thread_local! {
        static EMPTY: super::merged::Cells = super::merged::Cells::default();
    }
    EMPTY.with(|cells| read_slots(inputs, Merged { doc, cells }, None, out))
}

/// What the arithmetic tier answers (see `Cycle::evaluate_lowered`).
pub type Answer = Result<Option<valem_jit::interp::Value>, valem_core::expr::ExprError>;

/// The tier's answer for slots read as `read` (their values in `slots`), and whether compiled
/// code gave it; `None` when the interpreter must answer.
#[inline]
pub fn answer(
    nj: &NodeJit,
    code: Option<&Code>,
    read: Read,
    slots: &[f64],
) -> Option<(Answer, bool)> {
    Some(match read {
        Read::Other => return None,
        Read::NotNumbers(not_numbers) => (Err(type_error(nj.program(), not_numbers)?), false),
        Read::Undefined => (
            Ok(valem_jit::interp::eval_undefined(nj.program(), slots)?),
            false,
        ),
        Read::Numbers => match code {
            Some(code) => {
                let x = code.set.call(code.index, slots)?;
                (
                    Ok(Some(valem_jit::interp::Value::from_f64(code.ty, x))),
                    true,
                )
            }
            None => (
                Ok(Some(valem_jit::interp::eval(nj.program(), slots)?)),
                false,
            ),
        },
    })
}

impl NodeJit {
    /// Whether every slot reads the document's tree (top-level members that are not cells,
    /// paths from the root): [`NodeJit::answer_over_tree`] can answer on any thread.
    pub fn reads_tree_only(&self) -> bool {
        self.inputs
            .iter()
            .all(|i| matches!(i, SlotInput::Member(..) | SlotInput::Doc(_)))
    }

    /// The tier's answer over the document's tree `doc` (`None` unless
    /// [`NodeJit::reads_tree_only`]), with the compiled code as far as it is ready; counts no
    /// run (see [`JitCell::get`]). It needs nothing of the cycle's thread: any thread can answer.
    pub fn answer_over_tree(&self, doc: &Val, slots: &mut Vec<f64>) -> Option<(Answer, bool)> {
        let read = read_slots_in(&self.inputs, doc, None, None, slots);
        answer(self, self.slot.code(), read, slots)
    }

    /// Start loading the top-level members of `doc` its slots read (see
    /// [`JitCell::prefetch_inputs`]).
    #[inline]
    pub fn prefetch_members(&self, doc: &Val, far: bool) {
        if let Val::Obj(o) = doc {
            for input in &self.inputs {
                if let SlotInput::Member(h, _) = input {
                    if far {
                        o.prefetch_hashed_far(*h);
                    } else {
                        o.prefetch_hashed(*h);
                    }
                }
            }
        }
    }

    /// See [`JitCell::prefetch_inputs`].
    #[inline]
    pub fn prefetch_inputs(&self, m: Merged<'_>) {
        for input in &self.inputs {
            match input {
                SlotInput::Member(h, _) => {
                    if let Val::Obj(o) = m.doc {
                        o.prefetch_hashed(*h);
                    }
                }
                SlotInput::Cell(c, _) => m.cells.prefetch(*c),
                _ => {}
            }
        }
    }
}

/// Wait (at most `timeout`) until every requested program has been compiled. For tests and
/// benches; the engine never waits.
pub fn flush(timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    while registry().pending.load(Ordering::Acquire) > 0 {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

/// Programs compiled so far and bytes of machine code generated (for benches and `/metrics`).
pub fn stats() -> (usize, usize) {
    let r = registry();
    (
        r.compiled.load(Ordering::Relaxed),
        r.code_bytes.load(Ordering::Relaxed),
    )
}

// --- the registry and the compiler thread --------------------------------------------------------

struct Registry {
    slots: Mutex<HashMap<(String, bool), Weak<Slot>>>,
    tx: Mutex<Option<Sender<Arc<Slot>>>>,
    pending: AtomicUsize,
    compiled: AtomicUsize,
    code_bytes: AtomicUsize,
}

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| Registry {
        slots: Mutex::new(HashMap::new()),
        tx: Mutex::new(None),
        pending: AtomicUsize::new(0),
        compiled: AtomicUsize::new(0),
        code_bytes: AtomicUsize::new(0),
    })
}

/// The most programs compiled into one code set (one module, its pages shared).
const BATCH: usize = 256;

impl Registry {
    fn slot(&self, program: Program, shapes: Shapes) -> Arc<Slot> {
        let key = (program.key(), shapes.batch);
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = slots.get(&key).and_then(Weak::upgrade) {
            return s;
        }
        if slots.len() > 1024 && slots.len().is_power_of_two() {
            slots.retain(|_, w| w.strong_count() > 0);
        }
        let s = Arc::new(Slot {
            program,
            shapes,
            requested: AtomicBool::new(false),
            code: OnceLock::new(),
        });
        slots.insert(key, Arc::downgrade(&s));
        s
    }

    fn request(&self, slot: Arc<Slot>) {
        self.pending.fetch_add(1, Ordering::AcqRel);
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let sender = tx.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel();
            let spawned = std::thread::Builder::new()
                .name("valem-jit".into())
                .spawn(move || compiler(rx));
            if let Err(e) = spawned {
                tracing::warn!("the JIT compiler thread did not start: {e}");
            }
            tx
        });
        if let Err(mpsc::SendError(slot)) = sender.send(slot) {
            // No compiler: the node stays interpreted.
            let _ = slot.code.set(None);
            self.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn compiler(rx: Receiver<Arc<Slot>>) {
    let r = registry();
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(s) => batch.push(s),
                Err(_) => break,
            }
        }
        let n = batch.len();
        let programs: Vec<(&Program, Shapes)> =
            batch.iter().map(|s| (&s.program, s.shapes)).collect();
        match CodeSet::compile(&programs) {
            Ok(set) => {
                r.code_bytes.fetch_add(set.code_bytes(), Ordering::Relaxed);
                r.compiled.fetch_add(n, Ordering::Relaxed);
                let set = Arc::new(set);
                for (index, s) in batch.iter().enumerate() {
                    let _ = s.code.set(Some(Code {
                        set: set.clone(),
                        index,
                        ty: s.program.ty,
                    }));
                }
            }
            Err(e) => {
                tracing::warn!("{e}; {n} derivation(s) stay interpreted");
                for s in &batch {
                    let _ = s.code.set(None);
                }
            }
        }
        drop(programs);
        drop(batch);
        r.pending.fetch_sub(n, Ordering::AcqRel);
    }
}
