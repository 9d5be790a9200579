//! Preparing derivations: parse, analyse reads and aggregates, lower arithmetic for the JIT,
//! and take each draft apart as it is pushed; from `PARALLEL_FROM` derivations on other threads,
//! in parts handed over in order.

use super::*;

pub(super) struct Interner {
    pub(super) exprs: HashMap<String, Rc<Compiled>>,
    pub(super) limits: Limits,
}

impl Interner {
    /// The compiled form of an expression already parsed (shared with an identical text).
    pub(super) fn share(&mut self, text: &str, parsed: Parsed) -> Rc<Compiled> {
        if let Some(c) = self.exprs.get(text) {
            return c.clone();
        }
        let c = Rc::new(parsed.into_compiled(arcstr::ArcStr::from(text)));
        self.exprs.insert(text.to_string(), c.clone());
        c
    }

    pub(super) fn get(&mut self, text: &str) -> Result<Rc<Compiled>, ExprError> {
        if let Some(c) = self.exprs.get(text) {
            return Ok(c.clone());
        }
        let parsed = Compiled::parse(text, &self.limits)?;
        Ok(self.share(text, parsed))
    }
}

pub(super) fn expr_error(location: &str, text: &str, e: &ExprError) -> CompileError {
    let at = e.at();
    let snippet: String = text.chars().take(80).collect();
    CompileError {
        location: location.to_string(),
        message: format!("Invalid JSONata expression `{snippet}`{at}: {}", e.message),
    }
}

pub(super) fn parse_address(
    location: impl Fn() -> String,
    text: &str,
) -> Result<Address, CompileError> {
    Address::parse(text).map_err(|e| CompileError {
        location: location(),
        message: e.message,
    })
}

/// Convert an address pattern to trie segments.
pub(super) fn tsegs(a: &Address) -> Vec<TSeg> {
    tseg_iter(a).collect()
}

pub(super) fn tseg_iter(a: &Address) -> impl Iterator<Item = TSeg> + '_ {
    tseg_refs(a).map(TSegRef::owned)
}

pub(super) fn tseg_refs(a: &Address) -> impl Iterator<Item = TSegRef<'_>> + '_ {
    a.segs.iter().map(|s| match s {
        PathSeg::Field(k) => TSegRef::Field(k),
        PathSeg::Index(i) => TSegRef::Index(*i),
        PathSeg::Wild => TSegRef::Wild,
    })
}

pub(super) fn field_tsegs(fields: &[Key]) -> impl Iterator<Item = TSeg> + '_ {
    fields.iter().map(|k| TSeg::Field(k.clone()))
}

/// A trie path rendered as an address, appended to `out`.
pub(super) fn render_tsegs_into(segs: &[TSeg], out: &mut String) {
    out.push('$');
    for s in segs {
        match s {
            TSeg::Field(k) => valem_core::expr::path::push_field(out, k),
            TSeg::Index(i) => valem_core::expr::path::push_index(out, *i),
            TSeg::Wild => out.push_str("[*]"),
        }
    }
}

/// Recognise `$agg(a.b.c)` over a plain field path.
pub(super) fn aggregate_of(ast: &AstNode) -> Option<Aggregate> {
    let AstNode::Function {
        name,
        args,
        is_builtin: true,
    } = ast
    else {
        return None;
    };
    let func = match name.as_str() {
        "sum" => AggFunc::Sum,
        "count" => AggFunc::Count,
        "average" => AggFunc::Average,
        "max" => AggFunc::Max,
        "min" => AggFunc::Min,
        _ => return None,
    };
    let [AstNode::Path { steps }] = args.as_slice() else {
        return None;
    };
    let mut path = Vec::new();
    for s in steps {
        if !s.stages.is_empty() || s.focus.is_some() || s.index_var.is_some() || s.is_tuple {
            return None;
        }
        match &s.node {
            AstNode::Name(n) => path.push(valem_core::value::intern(n)),
            _ => return None,
        }
    }
    Some(Aggregate { func, path })
}

pub(super) struct NodeDraft {
    pub(super) node: Node,
    pub(super) extra: DraftExtra,
}

/// What a node's draft holds besides the node, until the graph is built (its reads go
/// straight into [`Drafts`]).
pub(super) struct DraftExtra {
    /// An arithmetic derivation's lowering.
    pub(super) program: Option<Lowering>,
    pub(super) aggregate: Option<Aggregate>,
    /// Its graph key and expression text, for the trace table (the node keeps neither).
    pub(super) key: arcstr::ArcStr,
    pub(super) text: arcstr::ArcStr,
    /// A derivation's target pattern (its node keeps none).
    pub(super) target: Option<Address>,
}

/// How an arithmetic derivation lowers: to a program of its own (and its key), or as an
/// instance of a shape met before (its names), whose program is made only if this compile
/// has not made it yet.
#[derive(Clone, Debug)]
pub(super) enum Lowering {
    Program(Program, String),
    Shaped(Arc<Shape>, crate::shapes::Keys),
}

impl Lowering {
    /// The node's JIT tier (`batch`: the node has `[*]` instances), its slot shared through
    /// `slots` with the compile's other nodes of the same program.
    pub(super) fn into_jit(
        self,
        batch: bool,
        slots: &mut crate::jit::Slots,
    ) -> crate::jit::NodeJit {
        match self {
            Lowering::Program(program, key) => crate::jit::NodeJit::new(program, key, batch, slots),
            Lowering::Shaped(shape, keys) => crate::jit::NodeJit::shared(
                shape.key(),
                batch,
                shape.slot_inputs(&keys),
                slots,
                || shape.program(&keys),
            ),
        }
    }

    /// The program and its key (made, for an instance of a shape).
    #[cfg(test)]
    pub(super) fn program(&self) -> (Program, String) {
        match self {
            Lowering::Program(p, k) => (p.clone(), k.clone()),
            Lowering::Shaped(s, keys) => (s.program(keys), s.key().to_string()),
        }
    }
}

/// The nodes drafted so far, numbered in order, and what the graph is built from. A draft's
/// reads are packed end to end here as they are found, with their rendered addresses in the
/// trace table ([`Drafts::add_read`]); when it comes in, the node is written once where it
/// stays and its lowering and aggregate go where they are kept. Nothing per node is held back
/// to the end of the compile, and a draft allocates little of its own (a 100k-node compile
/// otherwise leaves the long-lived allocations of its nodes scattered among the holes of the
/// short-lived ones, resident for the model's life).
pub(super) struct Drafts {
    pub(super) nodes: Vec<Node>,
    /// Every node's read patterns, their segments end to end.
    pub(super) segs: Vec<TSeg>,
    /// Where each read pattern ends in `segs`.
    pub(super) read_ends: Vec<u32>,
    /// Per node, where its reads end in `read_ends`.
    pub(super) node_reads: Vec<u32>,
    pub(super) aggregates: HashMap<NodeId, Aggregate>,
    pub(super) trace_table: crate::TraceTable,
    /// One JIT slot per distinct program (and batch shape) among the nodes.
    pub(super) jit_slots: crate::jit::Slots,
    /// Per node, a derivation's target pattern: what the graph is built from. Kept here, in
    /// one list, rather than in each node: once compiled, only a `[*]` derivation's is kept
    /// (in its node), and a million patterns freed one by one from among the nodes would
    /// leave the allocator's pages full of holes.
    pub(super) targets: Vec<Option<Address>>,
}

impl Drafts {
    /// Room for `n` nodes of `spec`.
    pub(super) fn with_capacity(n: usize, spec: &Arc<ModelSpec>) -> Drafts {
        Drafts {
            nodes: Vec::with_capacity(n),
            segs: Vec::new(),
            read_ends: Vec::new(),
            node_reads: Vec::with_capacity(n),
            aggregates: HashMap::new(),
            trace_table: crate::TraceTable::for_spec(spec.clone()),
            jit_slots: HashMap::new(),
            targets: Vec::with_capacity(n),
        }
    }

    /// Room for the reads of `total` derivations, reckoned from those of the `drafted` so far
    /// (the packed reads and the trace table's addresses, copied as they double otherwise).
    pub(super) fn reserve_like(&mut self, drafted: usize, total: usize) {
        let scale = |n: usize| n.saturating_mul(total) / drafted.max(1);
        let more = |n: usize| scale(n).saturating_sub(n);
        self.segs.reserve(more(self.segs.len()));
        self.read_ends.reserve(more(self.read_ends.len()));
        let (paths, bytes) = self.trace_table.path_counts();
        self.trace_table
            .reserve(total.saturating_sub(drafted), more(paths), more(bytes));
    }

    /// Start the next node's draft: reads added for a draft that was not pushed are dropped.
    pub(super) fn begin(&mut self) {
        let reads = self.node_reads.last().map_or(0, |&e| e as usize);
        self.read_ends.truncate(reads);
        let segs = reads
            .checked_sub(1)
            .map_or(0, |i| self.read_ends[i] as usize);
        self.segs.truncate(segs);
        self.trace_table.drop_unfinished();
    }

    /// Add a read of the node being drafted: its segments, and its address for its traces.
    pub(super) fn add_read(&mut self, segs: impl Iterator<Item = TSeg>) {
        let start = self.segs.len();
        self.segs.extend(segs);
        let segs = &self.segs[start..];
        self.trace_table
            .push_path_with(|t| render_tsegs_into(segs, t));
        self.read_ends.push(self.segs.len() as u32);
    }

    pub(super) fn push(&mut self, d: NodeDraft) {
        let NodeDraft { mut node, extra } = d;
        let id = self.nodes.len() as NodeId;
        node.id = id;
        self.node_reads.push(self.read_ends.len() as u32);
        if let Some(a) = extra.aggregate {
            self.aggregates.insert(id, a);
        }
        if let Some(lowering) = extra.program {
            let batch = node.concrete.is_none();
            let nj = lowering.into_jit(batch, &mut self.jit_slots);
            node.jit = crate::jit::JitCell::new(Some(nj));
        }
        self.trace_table.push(extra.key, extra.text);
        self.targets.push(extra.target);
        self.nodes.push(node);
    }
}

/// The read patterns of node `id` in [`Drafts`]' packed reads.
pub(super) fn packed_reads<'a>(
    segs: &'a [TSeg],
    read_ends: &'a [u32],
    node_reads: &'a [u32],
    id: usize,
) -> impl Iterator<Item = &'a [TSeg]> + 'a {
    use crate::trace::span;
    span(node_reads, id).map(move |i| &segs[span(read_ends, i)])
}

/// A derivation parsed and analysed (on any thread): its target, what it reads, its native
/// aggregate, the IR it lowers to, and its parsed form unless the lowering stands in for it.
pub(super) struct Prepared<'a> {
    pub(super) target: Address,
    pub(super) parsed: Option<Parsed>,
    /// What it reads, in [`Reads`] order, and whether that is the whole document.
    pub(super) reads: Vec<ReadPath>,
    pub(super) whole_doc: bool,
    pub(super) aggregate: Option<Aggregate>,
    pub(super) program: Option<Lowering>,
    /// A text analysed from its shape: the shape and the text's names, put in on the
    /// compiling thread by [`Prepared::settle`] (the reads and program above are empty).
    pub(super) shaped: Option<(Arc<Shape>, Vec<&'a str>)>,
}

impl Prepared<'_> {
    /// Finish on the compiling thread: a shaped text's names are interned here, so the names
    /// the reader index and the JIT slots hold are the ones the state and every mutation's
    /// path are interned to (one copy each, compared by pointer), not a worker thread's
    /// copies.
    pub(super) fn settle(&mut self) {
        if let Some((shape, names)) = self.shaped.take() {
            let keys = Shape::keys(&names);
            self.program = Some(Lowering::Shaped(shape, keys));
        }
    }

    /// Its reads, one by one in [`Reads`] order (a shaped text's, once settled, made from its
    /// shape and names).
    #[cfg(test)]
    pub(super) fn for_each_read(&self, f: impl FnMut(&Root, &[Key])) {
        for_each_read(&self.program, &self.reads, f);
    }
}

/// A prepared derivation's reads, one by one in [`Reads`] order: a shaped text's (once
/// settled) made from its shape and names, another's as its analysis found them.
pub(super) fn for_each_read(
    program: &Option<Lowering>,
    reads: &[ReadPath],
    mut f: impl FnMut(&Root, &[Key]),
) {
    match program {
        Some(Lowering::Shaped(shape, keys)) => shape.for_each_read(keys, f),
        _ => reads.iter().for_each(|r| f(&r.root, &r.fields)),
    }
}

/// The member names of the targets of one part of a large spec, shared within the part. A part
/// may be prepared on another thread than the model's, whose names a target's cannot be; in
/// that thread's own name table (which grew to every target name of the spec, to be dropped
/// with the thread) they cost more than the rest of the preparation together: fan-out 1M,
/// 414 of the worker's 614 ms.
#[derive(Default)]
pub(super) struct PartNames(valem_core::hash::KeyedSet<Key>);

impl PartNames {
    fn key(&mut self, name: &str) -> Key {
        if let Some(k) = self.0.get(name) {
            return k.clone();
        }
        let k: Key = Key::from(name);
        self.0.insert(k.clone());
        k
    }
}

/// Derivations fewer than this are prepared on the calling thread alone.
pub(super) const PARALLEL_FROM: usize = 4096;

#[allow(clippy::too_many_arguments)]
pub(super) fn prepare<'a>(
    i: usize,
    d: &'a valem_core::spec::DerivationSpec,
    limits: &Limits,
    constants: &serde_json::Map<String, Json>,
    bound: &HashSet<String>,
    keep_parsed: bool,
    shapes: &mut Shapes,
    names: Option<&mut PartNames>,
) -> Result<Prepared<'a>, CompileError> {
    let location = || format!("derivations[{i}].path");
    let target = match names {
        None => parse_address(location, &d.path)?,
        Some(names) => {
            Address::parse_with(&d.path, &mut |s| names.key(s)).map_err(|e| CompileError {
                location: location(),
                message: e.message,
            })?
        }
    };
    // Its value goes that deep into the document: even a scalar there nests a level a segment.
    if target.segs.len() > MAX_DEPTH {
        return Err(CompileError {
            location: format!("derivations[{i}].path"),
            message: format!(
                "the path is {} levels deep; a document nests at most {MAX_DEPTH}",
                target.segs.len()
            ),
        });
    }
    // A text shaped like one analysed before is analysed from that one (`shapes.rs`); with
    // the JIT tier off every text keeps its parsed form, so each is parsed.
    let sk = (!keep_parsed && d.expr.len() <= limits.max_expr_len)
        .then(|| skeleton(&d.expr))
        .flatten();
    if let Some(sk) = &sk {
        if let Some(Some(shape)) = shapes.get(sk) {
            return Ok(Prepared {
                target,
                parsed: None,
                reads: Vec::new(),
                whole_doc: false,
                aggregate: None,
                program: None,
                shaped: Some((shape, sk.names.clone())),
            });
        }
    }
    let parsed = Compiled::parse(&d.expr, limits)
        .map_err(|e| expr_error(&format!("derivations[{i}].expr"), &d.expr, &e))?;
    let reads = deps::reads(parsed.ast());
    let aggregate = aggregate_of(parsed.ast());
    // A library export named like a built-in (`$abs`) shadows it: not arithmetic then.
    let eligible = aggregate.is_none() && !parsed.calls().iter().any(|c| bound.contains(c));
    let program = eligible
        .then(|| ir::lower(parsed.ast(), &|n| constants.get(n).and_then(Json::as_f64)).ok())
        .flatten()
        .map(|p| {
            let key = p.key();
            (p, key)
        });
    if let Some(sk) = sk {
        if shapes.get(&sk).is_none() {
            let shape = match (&program, &aggregate) {
                (Some((p, key)), None) => Shape::of(&sk, p, key, &reads),
                _ => None,
            };
            shapes.put(sk, shape);
        }
    }
    let parsed = (program.is_none() || keep_parsed).then_some(parsed);
    Ok(Prepared {
        target,
        parsed,
        reads: reads.paths.into_iter().collect(),
        whole_doc: reads.whole_doc,
        aggregate,
        program: program.map(|(p, key)| Lowering::Program(p, key)),
        shaped: None,
    })
}

/// Derivations a part of a large spec has: what [`prepare_all`] hands over at a time.
pub(super) const PART: usize = 1024;

/// A part's derivations, prepared (or what is wrong with each).
pub(super) type Part<'a> = Vec<Result<Prepared<'a>, CompileError>>;

/// [`prepare`] every derivation of `spec` and hand them to `consume` in order, a part at a
/// time. A large spec (from `PARALLEL_FROM`) is prepared by threads of its own — one fewer than
/// the machine's cores, up to three — taking its parts in order, while the calling thread
/// consumes (drafts) the parts already made; when the next part is not ready, the calling
/// thread prepares a part nobody has taken yet itself, and waits only when every part is taken.
/// The parse thus overlaps the drafting rather than preceding it.
pub(super) fn prepare_all<'a>(
    spec: &'a ModelSpec,
    limits: &Limits,
    bound: &HashSet<String>,
    keep_parsed: bool,
    mut consume: impl FnMut(Part<'a>),
) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Condvar, Mutex, PoisonError};
    let ds = &spec.derivations;
    let one = |i: usize, d, shapes: &mut Shapes, names: Option<&mut PartNames>| {
        prepare(
            i,
            d,
            limits,
            &spec.constants,
            bound,
            keep_parsed,
            shapes,
            names,
        )
    };
    let workers = if ds.len() < PARALLEL_FROM {
        0
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get().clamp(2, 4) - 1)
    };
    if workers == 0 {
        let mut shapes = Shapes::default();
        consume(
            ds.iter()
                .enumerate()
                .map(|(i, d)| one(i, d, &mut shapes, None))
                .collect(),
        );
        return;
    }
    let parts = ds.len().div_ceil(PART);
    let part = |p: usize, shapes: &mut Shapes| -> Part<'a> {
        let lo = p * PART;
        let hi = (lo + PART).min(ds.len());
        let mut names = PartNames::default();
        ds[lo..hi]
            .iter()
            .enumerate()
            .map(|(j, d)| one(lo + j, d, shapes, Some(&mut names)))
            .collect()
    };
    // The next part nobody has taken; the parts made and not yet consumed; whether a worker
    // stopped by panicking (its part would never come: the scope then re-raises the panic).
    let next = AtomicUsize::new(0);
    let made: Mutex<Vec<Option<Part<'a>>>> = Mutex::new((0..parts).map(|_| None).collect());
    let ready = Condvar::new();
    let failed = AtomicBool::new(false);
    /// Sets `failed` and wakes the consumer if its worker unwinds.
    struct Watch<'w>(&'w AtomicBool, &'w Condvar);
    impl Drop for Watch<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                self.0.store(true, Ordering::SeqCst);
                self.1.notify_all();
            }
        }
    }
    let put = |p: usize, v| {
        let mut m = made.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = m.get_mut(p) {
            *slot = Some(v);
        }
        ready.notify_all();
    };
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let _watch = Watch(&failed, &ready);
                let mut shapes = Shapes::default();
                loop {
                    let p = next.fetch_add(1, Ordering::Relaxed);
                    if p >= parts {
                        break;
                    }
                    put(p, part(p, &mut shapes));
                }
            });
        }
        let mut shapes = Shapes::default();
        for p in 0..parts {
            let got = loop {
                let mut m = made.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(v) = m.get_mut(p).and_then(Option::take) {
                    break Some(v);
                }
                if failed.load(Ordering::SeqCst) {
                    break None;
                }
                let q = next.fetch_add(1, Ordering::Relaxed);
                if q < parts {
                    drop(m);
                    let v = part(q, &mut shapes);
                    if q == p {
                        break Some(v);
                    }
                    put(q, v);
                    continue;
                }
                // Every part is taken and this one is being made: wait for it.
                drop(ready.wait(m).unwrap_or_else(PoisonError::into_inner));
            };
            match got {
                Some(v) => consume(v),
                None => return,
            }
        }
    });
}
