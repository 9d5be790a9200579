//! The ModelSpec compiler: expressions compiled once (identical text interned), dependencies
//! extracted into the reader and producer tries, the derivation DAG levelled topologically (a
//! cycle is an error naming it), the library bound, projections and native aggregates planned.
//! Pure: no I/O, no clock.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;

use jsonata_core::ast::AstNode;
use serde_json::Value as Json;

use super::shapes::{skeleton, Shape, Shapes};
use super::trie::{TSeg, TSegRef, Trie};
use std::collections::HashSet;
use valem_core::expr::deps::{self, ReadPath, Reads, Root};
use valem_core::expr::path::{Address, PathSeg};
use valem_core::expr::{json_to_jvalue, Compiled, Env, ExprError, Limits, Parsed, Value as JValue};
use valem_core::spec::{MetaProp, ModelSpec, Policy};
use valem_core::value::{Key, MAX_DEPTH};
use valem_jit::ir::{self, Program};

pub type NodeId = u32;

/// What a graph node computes.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeKind {
    Derivation { lazy: bool },
    Meta(MetaProp),
    Constraint { index: u32, policy: Policy },
    Effect { index: u32 },
}

/// What an expression sees as its input (`$`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// The merged document (derivations, global constraints, effects, non-`[*]` meta).
    Doc,
    /// The array element of a `[*]` meta-derivation or constraint (the reference's rule).
    Element,
    /// The value at a scoped constraint's path.
    Field,
}

/// A natively evaluated aggregate: `$sum/$count/$average/$max/$min(a.b.c)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Aggregate {
    pub func: AggFunc,
    pub path: Vec<Key>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AggFunc {
    Sum,
    Count,
    Average,
    Max,
    Min,
}

/// The document paths one evaluation needs, as a trie of field names; `whole` takes the
/// subtree entire.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Projection {
    pub whole: bool,
    pub children: Vec<(Key, Projection)>,
}

impl Projection {
    /// The whole input, as a node holds it.
    fn whole() -> Box<Projection> {
        Box::new(Projection {
            whole: true,
            children: Vec::new(),
        })
    }

    fn shrink(&mut self) {
        self.children.shrink_to_fit();
        for (_, c) in &mut self.children {
            c.shrink();
        }
    }

    fn add(&mut self, fields: &[Key]) {
        if self.whole {
            return;
        }
        match fields.split_first() {
            None => {
                self.whole = true;
                self.children.clear();
            }
            Some((k, rest)) => {
                if let Some((_, c)) = self.children.iter_mut().find(|(n, _)| n == k) {
                    c.add(rest);
                } else {
                    let mut c = Projection::default();
                    c.add(rest);
                    self.children.push((k.clone(), c));
                }
            }
        }
    }
}

/// A node's expression: its text, and the interpreter's compiled form. An arithmetic
/// derivation lets the compiled form go once the spec is compiled (the JIT tier computes it from
/// its lowering); an evaluation that needs the interpreter compiles the text again, and the most
/// recent such forms are kept (`CompiledModel::interpreted`).
pub struct NodeExpr {
    pub text: Arc<str>,
    /// A `Cell` (taken and put back to read): 8 bytes where a `RefCell` takes 16.
    compiled: Cell<Option<Rc<Compiled>>>,
}

impl std::fmt::Debug for NodeExpr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeExpr")
            .field("text", &self.text)
            .field("held", &self.held().is_some())
            .finish()
    }
}

impl NodeExpr {
    fn new(c: Rc<Compiled>) -> NodeExpr {
        NodeExpr {
            text: c.text.clone(),
            compiled: Cell::new(Some(c)),
        }
    }

    /// The text alone (the interpreted form is compiled when needed).
    fn text(text: Arc<str>) -> NodeExpr {
        NodeExpr {
            text,
            compiled: Cell::new(None),
        }
    }

    /// The compiled form, if it is held.
    pub fn held(&self) -> Option<Rc<Compiled>> {
        let c = self.compiled.take();
        self.compiled.set(c.clone());
        c
    }
}

/// Interpreter forms of arithmetic derivations compiled again for a fallback, kept at most.
const FALLBACK_FORMS: usize = 1024;

/// Per node, the nodes that read what it writes, packed end to end (one allocation for the
/// graph instead of one list per node: a 100k-node model's lists are mostly empty).
#[derive(Debug, Default)]
pub struct Dependents {
    /// Where each node's list starts in `ids` (one more than there are nodes).
    starts: Vec<u32>,
    ids: Vec<NodeId>,
}

impl Dependents {
    /// The reverse of `deps_of` (per node, what it depends on).
    fn new(deps_of: &[BTreeSet<NodeId>]) -> Dependents {
        let mut starts = vec![0u32; deps_of.len() + 1];
        for ds in deps_of {
            for &p in ds {
                starts[p as usize + 1] += 1;
            }
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut fill: Vec<u32> = starts[..deps_of.len()].to_vec();
        let mut ids = vec![0; starts[deps_of.len()] as usize];
        for (id, ds) in deps_of.iter().enumerate() {
            for &p in ds {
                let at = &mut fill[p as usize];
                ids[*at as usize] = id as NodeId;
                *at += 1;
            }
        }
        Dependents { starts, ids }
    }

    /// The nodes that read what `id` writes, in increasing order.
    pub fn of(&self, id: NodeId) -> &[NodeId] {
        let i = id as usize;
        match (self.starts.get(i), self.starts.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.ids[a as usize..b as usize],
            _ => &[],
        }
    }

    /// Each node's dependents, by node.
    pub fn iter(&self) -> impl Iterator<Item = &[NodeId]> + '_ {
        self.starts
            .windows(2)
            .map(|w| &self.ids[w[0] as usize..w[1] as usize])
    }
}

/// One node of the dependency graph.
#[derive(Debug)]
// The fields a mutation's mark and evaluation read come first and the node starts a cache line:
// they span two lines (the spec's texts, messages and interpreted forms come after). Three lines
// in all: a 100k-derivation model holds 100k nodes, so what is rare (aggregates, projections of
// interpreted nodes) is kept beside the node or boxed.
#[repr(C, align(64))]
pub struct Node {
    pub kind: NodeKind,
    /// Its number (its index in `CompiledModel::nodes`).
    pub id: NodeId,
    pub level: u32,
    /// `[*]`s in the first target.
    pub wild: u32,
    pub input: Input,
    pub projection_deferred: bool,
    pub whole_doc: bool,
    /// Reads relative to `$parent` (derivations) are served by binding `$parent`.
    pub uses_parent: bool,
    /// The cell holding a derivation's value when its target is one top-level member
    /// (`engine/merged.rs`).
    pub cell: Option<u32>,
    /// The concrete target of a derivation without `[*]`.
    pub concrete: Option<Box<[valem_core::value::Seg]>>,
    /// The JIT tier of a derivation (`engine/jit.rs`).
    pub jit: super::jit::JitCell,
    /// Graph key: `$.total`, `$.email#relevant`, `$constraint:id`, `$effect:id`.
    pub key: Arc<str>,
    /// Derivation/meta: the target pattern. Scoped constraint: its paths. Otherwise empty.
    pub targets: Box<[Address]>,
    pub expr: NodeExpr,
    /// What of the document an interpreted evaluation is given. An arithmetic derivation's
    /// is made only when it first falls back to the interpreter
    /// ([`CompiledModel::fallback_projection`]): its code reads its slots, not this.
    pub projection: Option<Box<Projection>>,
    /// Where in the spec the node comes from (`derivations[3]`), for messages.
    pub location: Location,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Node>() == 192);

impl Node {
    /// The `[*]`s of its (first) target.
    #[inline]
    pub fn wildcards(&self) -> usize {
        self.wild as usize
    }

    /// What of the document an interpreted evaluation is given.
    pub fn projection(&self) -> &Projection {
        static NOTHING: Projection = Projection {
            whole: false,
            children: Vec::new(),
        };
        self.projection.as_deref().unwrap_or(&NOTHING)
    }

    /// Whether the cycle keeps `agg`, this node's aggregate, up to date by delta instead of
    /// rescanning: `$sum`, `$count` or `$average` of `array.field` in a concrete derivation.
    pub fn keeps_by_delta(&self, agg: &Aggregate) -> bool {
        matches!(self.kind, NodeKind::Derivation { lazy: false })
            && self.concrete.is_some()
            && self.input == Input::Doc
            && agg.path.len() == 2
            && matches!(agg.func, AggFunc::Sum | AggFunc::Count | AggFunc::Average)
    }
}

/// The extra expressions of an effect besides its trigger.
#[derive(Debug, Default)]
pub struct EffectPlan {
    pub dedupe: Option<Rc<Compiled>>,
    pub payload: Vec<(String, Rc<Compiled>)>,
    pub at: Option<Rc<Compiled>>,
    pub after_ms: Option<Rc<Compiled>>,
}

/// A compiled `defaultValues` rule.
#[derive(Debug)]
pub struct DefaultRule {
    pub path: Address,
    pub expr: Rc<Compiled>,
}

/// One export of the bound library.
#[derive(Clone, Debug)]
pub struct LibraryExport {
    pub name: String,
    pub is_function: bool,
    pub layer: usize,
    pub signature: Option<String>,
    pub arity: Option<usize>,
}

/// Where in the spec a node comes from (`derivations[3]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub section: Section,
    pub index: u32,
}

/// A section of the spec that holds nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    Derivations,
    MetaDerivations,
    Constraints,
    Effects,
}

impl Location {
    fn new(section: Section, index: usize) -> Location {
        Location {
            section,
            index: index as u32,
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.section {
            Section::Derivations => "derivations",
            Section::MetaDerivations => "metaDerivations",
            Section::Constraints => "constraints",
            Section::Effects => "effects",
        };
        write!(f, "{name}[{}]", self.index)
    }
}

/// A compile finding with its location in the spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileError {
    pub location: String,
    pub message: String,
}

/// A spec compiled for execution. Not `Send`: compiled expressions and bound library closures
/// belong to the thread that built them (a shard).
pub struct CompiledModel {
    pub spec: Arc<ModelSpec>,
    pub nodes: Vec<Node>,
    /// Some derivation is an aggregate kept by delta ([`CompiledModel::delta_aggregate`]):
    /// writes note their old and new values for it.
    pub has_delta_aggregates: bool,
    /// The nodes evaluated as a native aggregate, and how (few nodes are: kept beside the
    /// nodes rather than a field of each).
    aggregates: HashMap<NodeId, Aggregate>,
    /// Derivation nodes grouped by topological level.
    pub levels: Vec<Vec<NodeId>>,
    /// Per node, the nodes that read what it writes (derivations only write).
    pub dependents: Dependents,
    pub readers: Trie,
    /// What a write of a concrete derivation's target dirties (its readers in the index, all
    /// of every instance: the target has no array index), as ranges of `target_reader_ids`;
    /// `None` for other nodes (their writes look the index up).
    target_readers: Vec<Option<(u32, u32)>>,
    target_reader_ids: Vec<NodeId>,
    /// Per node, its key and what its traces share.
    pub trace_table: Arc<super::TraceTable>,
    /// The top-level members whose derived values live in cells.
    pub cells: Arc<super::merged::CellLayout>,
    /// Every derivation writes a cell: the merged document's tree is the base document.
    pub merged_is_base: bool,
    /// Where derivations write (read-only check, compile-time edges).
    pub producers: Trie,
    /// The target patterns of meta-derivations and scoped constraints (derivations are in
    /// `producers`): a new or replaced container dirties the instances below it.
    pub instances: Trie,
    /// Nodes that depend on the whole document: dirtied by every write.
    pub whole_doc_nodes: Vec<NodeId>,
    pub meta_nodes: Vec<NodeId>,
    pub constraint_nodes: Vec<NodeId>,
    pub effect_nodes: Vec<NodeId>,
    pub effect_plans: Vec<EffectPlan>,
    pub defaults: Vec<DefaultRule>,
    pub env: Env,
    pub exports: Vec<LibraryExport>,
    pub limits: Limits,
    pub schema: Json,
    /// Compiled JSON Schema validators by effective-schema text (bounded).
    pub validators: RefCell<HashMap<String, Rc<jsonschema::Validator>>>,
    /// Nodes holding an interpreter form compiled again for a fallback, oldest first.
    fallback_forms: RefCell<VecDeque<NodeId>>,
    /// The projections of those nodes whose projection was deferred.
    fallback_projections: RefCell<HashMap<NodeId, Rc<Projection>>>,
    /// The cycles' per-node bookkeeping, reused (`cycle.rs`).
    pub(crate) scratch: RefCell<super::cycle::Scratch>,
}

impl std::fmt::Debug for CompiledModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledModel")
            .field("id", &self.spec.id)
            .field("nodes", &self.nodes.len())
            .finish()
    }
}

/// Builtin function names of JSONata (a library export may not shadow them).
pub const BUILTINS: &[&str] = &[
    "string",
    "length",
    "substring",
    "substringBefore",
    "substringAfter",
    "uppercase",
    "lowercase",
    "trim",
    "pad",
    "contains",
    "split",
    "join",
    "match",
    "replace",
    "eval",
    "base64encode",
    "base64decode",
    "encodeUrlComponent",
    "encodeUrl",
    "decodeUrlComponent",
    "decodeUrl",
    "number",
    "abs",
    "floor",
    "ceil",
    "round",
    "power",
    "sqrt",
    "random",
    "formatNumber",
    "formatBase",
    "formatInteger",
    "parseInteger",
    "sum",
    "max",
    "min",
    "average",
    "boolean",
    "not",
    "exists",
    "count",
    "append",
    "sort",
    "reverse",
    "shuffle",
    "distinct",
    "zip",
    "keys",
    "lookup",
    "spread",
    "merge",
    "sift",
    "each",
    "error",
    "assert",
    "type",
    "map",
    "filter",
    "reduce",
    "single",
    "now",
    "millis",
    "fromMillis",
    "toMillis",
    "clone",
];

struct Interner {
    exprs: HashMap<String, Rc<Compiled>>,
    limits: Limits,
}

impl Interner {
    /// The compiled form of an expression already parsed (shared with an identical text).
    fn share(&mut self, text: &str, parsed: Parsed) -> Rc<Compiled> {
        if let Some(c) = self.exprs.get(text) {
            return c.clone();
        }
        let c = Rc::new(parsed.into_compiled(Arc::from(text)));
        self.exprs.insert(text.to_string(), c.clone());
        c
    }

    fn get(&mut self, text: &str) -> Result<Rc<Compiled>, ExprError> {
        if let Some(c) = self.exprs.get(text) {
            return Ok(c.clone());
        }
        let parsed = Compiled::parse(text, &self.limits)?;
        Ok(self.share(text, parsed))
    }
}

fn expr_error(location: &str, text: &str, e: &ExprError) -> CompileError {
    let at = e.at();
    let snippet: String = text.chars().take(80).collect();
    CompileError {
        location: location.to_string(),
        message: format!("Invalid JSONata expression `{snippet}`{at}: {}", e.message),
    }
}

fn parse_address(location: impl Fn() -> String, text: &str) -> Result<Address, CompileError> {
    Address::parse(text).map_err(|e| CompileError {
        location: location(),
        message: e.message,
    })
}

/// Convert an address pattern to trie segments.
pub fn tsegs(a: &Address) -> Vec<TSeg> {
    tseg_iter(a).collect()
}

fn tseg_iter(a: &Address) -> impl Iterator<Item = TSeg> + '_ {
    tseg_refs(a).map(TSegRef::owned)
}

fn tseg_refs(a: &Address) -> impl Iterator<Item = TSegRef<'_>> + '_ {
    a.segs.iter().map(|s| match s {
        PathSeg::Field(k) => TSegRef::Field(k),
        PathSeg::Index(i) => TSegRef::Index(*i),
        PathSeg::Wild => TSegRef::Wild,
    })
}

fn field_tsegs(fields: &[Key]) -> impl Iterator<Item = TSeg> + '_ {
    fields.iter().map(|k| TSeg::Field(k.clone()))
}

/// A trie path rendered as an address, appended to `out`.
fn render_tsegs_into(segs: &[TSeg], out: &mut String) {
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
fn aggregate_of(ast: &AstNode) -> Option<Aggregate> {
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

struct NodeDraft {
    node: Node,
    extra: DraftExtra,
}

/// What a node's draft holds besides the node, until the graph is built (its reads go
/// straight into [`Drafts`]).
struct DraftExtra {
    /// An arithmetic derivation's lowering.
    program: Option<Lowering>,
    aggregate: Option<Aggregate>,
}

/// How an arithmetic derivation lowers: to a program of its own (and its key), or as an
/// instance of a shape met before (its names), whose program is made only if this compile
/// has not made it yet.
#[derive(Clone, Debug)]
enum Lowering {
    Program(Program, String),
    Shaped(Arc<Shape>, super::shapes::Keys),
}

impl Lowering {
    /// The node's JIT tier (`batch`: the node has `[*]` instances), its slot shared through
    /// `slots` with the compile's other nodes of the same program.
    fn into_jit(self, batch: bool, slots: &mut super::jit::Slots) -> super::jit::NodeJit {
        match self {
            Lowering::Program(program, key) => super::jit::NodeJit::new(program, key, batch, slots),
            Lowering::Shaped(shape, keys) => super::jit::NodeJit::shared(
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
    fn program(&self) -> (Program, String) {
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
struct Drafts {
    nodes: Vec<Node>,
    /// Every node's read patterns, their segments end to end.
    segs: Vec<TSeg>,
    /// Where each read pattern ends in `segs`.
    read_ends: Vec<u32>,
    /// Per node, where its reads end in `read_ends`.
    node_reads: Vec<u32>,
    aggregates: HashMap<NodeId, Aggregate>,
    trace_table: super::TraceTable,
    /// One JIT slot per distinct program (and batch shape) among the nodes.
    jit_slots: super::jit::Slots,
}

impl Drafts {
    fn with_capacity(n: usize) -> Drafts {
        Drafts {
            nodes: Vec::with_capacity(n),
            segs: Vec::new(),
            read_ends: Vec::new(),
            node_reads: Vec::with_capacity(n),
            aggregates: HashMap::new(),
            trace_table: super::TraceTable::default(),
            jit_slots: HashMap::new(),
        }
    }

    /// Start the next node's draft: reads added for a draft that was not pushed are dropped.
    fn begin(&mut self) {
        let reads = self.node_reads.last().map_or(0, |&e| e as usize);
        self.read_ends.truncate(reads);
        let segs = reads
            .checked_sub(1)
            .map_or(0, |i| self.read_ends[i] as usize);
        self.segs.truncate(segs);
        self.trace_table.drop_unfinished();
    }

    /// Add a read of the node being drafted: its segments, and its address for its traces.
    fn add_read(&mut self, segs: impl Iterator<Item = TSeg>) {
        let start = self.segs.len();
        self.segs.extend(segs);
        let segs = &self.segs[start..];
        self.trace_table
            .push_path_with(|t| render_tsegs_into(segs, t));
        self.read_ends.push(self.segs.len() as u32);
    }

    fn push(&mut self, d: NodeDraft) {
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
            node.jit = super::jit::JitCell::new(batch, Some(nj));
        }
        self.trace_table
            .push(node.key.clone(), node.expr.text.clone());
        self.nodes.push(node);
    }
}

/// The read patterns of node `id` in [`Drafts`]' packed reads.
fn packed_reads<'a>(
    segs: &'a [TSeg],
    read_ends: &'a [u32],
    node_reads: &'a [u32],
    id: usize,
) -> impl Iterator<Item = &'a [TSeg]> + 'a {
    use super::trace::span;
    span(node_reads, id).map(move |i| &segs[span(read_ends, i)])
}

/// A derivation parsed and analysed (on any thread): its target, what it reads, its native
/// aggregate, the IR it lowers to, and its parsed form unless the lowering stands in for it.
struct Prepared<'a> {
    target: Address,
    parsed: Option<Parsed>,
    /// What it reads, in [`Reads`] order, and whether that is the whole document.
    reads: Vec<ReadPath>,
    whole_doc: bool,
    aggregate: Option<Aggregate>,
    program: Option<Lowering>,
    /// A text analysed from its shape: the shape and the text's names, put in on the
    /// compiling thread by [`Prepared::settle`] (the reads and program above are empty).
    shaped: Option<(Arc<Shape>, Vec<&'a str>)>,
}

impl Prepared<'_> {
    /// Finish on the compiling thread: a shaped text's names are interned here, so the names
    /// the reader index and the JIT slots hold are the ones the state and every mutation's
    /// path are interned to (one copy each, compared by pointer), not a worker thread's
    /// copies.
    fn settle(&mut self) {
        if let Some((shape, names)) = self.shaped.take() {
            let keys = Shape::keys(&names);
            self.program = Some(Lowering::Shaped(shape, keys));
        }
    }

    /// Its reads, one by one in [`Reads`] order (a shaped text's, once settled, made from its
    /// shape and names).
    #[cfg(test)]
    fn for_each_read(&self, f: impl FnMut(&Root, &[Key])) {
        for_each_read(&self.program, &self.reads, f);
    }
}

/// A prepared derivation's reads, one by one in [`Reads`] order: a shaped text's (once
/// settled) made from its shape and names, another's as its analysis found them.
fn for_each_read(program: &Option<Lowering>, reads: &[ReadPath], mut f: impl FnMut(&Root, &[Key])) {
    match program {
        Some(Lowering::Shaped(shape, keys)) => shape.for_each_read(keys, f),
        _ => reads.iter().for_each(|r| f(&r.root, &r.fields)),
    }
}

/// Derivations fewer than this are prepared on the calling thread alone.
const PARALLEL_FROM: usize = 4096;

fn prepare<'a>(
    i: usize,
    d: &'a valem_core::spec::DerivationSpec,
    limits: &Limits,
    constants: &serde_json::Map<String, Json>,
    bound: &HashSet<String>,
    keep_parsed: bool,
    shapes: &mut Shapes,
) -> Result<Prepared<'a>, CompileError> {
    let target = parse_address(|| format!("derivations[{i}].path"), &d.path)?;
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
const PART: usize = 1024;

/// A part's derivations, prepared (or what is wrong with each).
type Part<'a> = Vec<Result<Prepared<'a>, CompileError>>;

/// [`prepare`] every derivation of `spec` and hand them to `consume` in order, a part at a
/// time. A large spec (from `PARALLEL_FROM`) is prepared by threads of its own — one fewer than
/// the machine's cores, up to three — taking its parts in order, while the calling thread
/// consumes (drafts) the parts already made; when the next part is not ready, the calling
/// thread prepares a part nobody has taken yet itself, and waits only when every part is taken.
/// The parse thus overlaps the drafting rather than preceding it.
fn prepare_all<'a>(
    spec: &'a ModelSpec,
    limits: &Limits,
    bound: &HashSet<String>,
    keep_parsed: bool,
    mut consume: impl FnMut(Part<'a>),
) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Condvar, Mutex, PoisonError};
    let ds = &spec.derivations;
    let one = |i: usize, d, shapes: &mut Shapes| {
        prepare(i, d, limits, &spec.constants, bound, keep_parsed, shapes)
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
                .map(|(i, d)| one(i, d, &mut shapes))
                .collect(),
        );
        return;
    }
    let parts = ds.len().div_ceil(PART);
    let part = |p: usize, shapes: &mut Shapes| -> Part<'a> {
        let lo = p * PART;
        let hi = (lo + PART).min(ds.len());
        ds[lo..hi]
            .iter()
            .enumerate()
            .map(|(j, d)| one(lo + j, d, shapes))
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

/// Compile a spec. All findings are collected, not just the first.
pub fn compile(
    spec: Arc<ModelSpec>,
    engine: &crate::EngineLimits,
) -> Result<CompiledModel, Vec<CompileError>> {
    let limits = &engine.expr;
    // The names interned from here on are held by the compiled model.
    let _names = valem_core::value::holding_names();
    let mut errors = Vec::new();
    let mut interner = Interner {
        exprs: HashMap::new(),
        limits: limits.clone(),
    };
    let mut drafts = Drafts::with_capacity(
        spec.derivations.len()
            + spec.meta_derivations.len()
            + spec.constraints.len()
            + spec.effects.len(),
    );

    // Constants and library first: every expression may bind them.
    let constants = json_to_jvalue(&Json::Object(spec.constants.clone()));
    let mut env = Env::default();
    env.vars.push((Rc::from("const"), constants));
    let exports = match bind_library(&spec, &mut env, limits) {
        Ok(x) => x,
        Err(mut e) => {
            errors.append(&mut e);
            Vec::new()
        }
    };

    let bound: HashSet<String> = env.vars.iter().map(|(n, _)| n.to_string()).collect();
    // With the JIT tier off, arithmetic derivations keep their interpreted form too.
    let keep_parsed = !engine.jit.enabled;
    let mut key_buf = String::new();
    let mut done = 0;
    prepare_all(&spec, limits, &bound, keep_parsed, |part| {
        if done == 0 {
            // Room for the names of all the shaped derivations, reckoned from the first part.
            let names: usize = part
                .iter()
                .flatten()
                .filter_map(|p| p.shaped.as_ref())
                .map(|s| s.1.len())
                .sum();
            let total = spec.derivations.len();
            valem_core::value::reserve_names(names.saturating_mul(total) / part.len().max(1));
        }
        let first = done;
        done += part.len();
        for (k, p) in part.into_iter().enumerate() {
            let i = first + k;
            let Some(d) = spec.derivations.get(i) else {
                break;
            };
            let mut p = match p {
                Ok(p) => p,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            p.settle();
            let expr = match p.parsed.take() {
                Some(parsed) => NodeExpr::new(interner.share(&d.expr, parsed)),
                None => NodeExpr::text(d.expr.clone()),
            };
            let parent = p.target.parent();
            // The key is the canonical address: the spec's own text when written that way.
            key_buf.clear();
            p.target.render_into(&mut key_buf);
            let key = if *key_buf == *d.path {
                d.path.clone()
            } else {
                Arc::from(key_buf.as_str())
            };
            let mut dr = draft_empty(
                &mut drafts,
                NodeKind::Derivation { lazy: d.is_lazy() },
                key,
                vec![p.target],
                expr,
                Input::Doc,
                Location::new(Section::Derivations, i),
                p.aggregate,
            );
            // An arithmetic derivation's projection waits for a fallback that may never come.
            dr.node.projection_deferred = p.program.is_some() && !p.whole_doc;
            add_whole_doc(&mut dr, &mut drafts, p.whole_doc, None);
            for_each_read(&p.program, &p.reads, |root, fields| {
                add_read(&mut dr, &mut drafts, root, fields, Some(&parent), None);
            });
            end_reads(&mut dr);
            dr.extra.program = p.program;
            drafts.push(dr);
        }
    });

    for (i, m) in spec.meta_derivations.iter().enumerate() {
        let loc = format!("metaDerivations[{i}]");
        let Some(prop) = MetaProp::parse(&m.property) else {
            errors.push(CompileError {
                location: format!("{loc}.property"),
                message: format!(
                    "unknown meta property `{}`; expected one of: {}",
                    m.property,
                    MetaProp::ALL.map(|p| p.name()).join(", ")
                ),
            });
            continue;
        };
        let target = match parse_address(|| format!("{loc}.path"), &m.path) {
            Ok(a) => a,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        let expr = match interner.get(&m.expr) {
            Ok(c) => c,
            Err(e) => {
                errors.push(expr_error(&format!("{loc}.expr"), &m.expr, &e));
                continue;
            }
        };
        let key = format!("{}#{}", target, prop.key_name());
        // `[*]` meta sees the element as `$` (the reference's rule) and as `$parent`.
        let element = target.element_pattern();
        let input = if element.is_some() {
            Input::Element
        } else {
            Input::Doc
        };
        let reads = deps::reads(expr.ast());
        let aggregate = aggregate_of(expr.ast());
        let mut d = draft_empty(
            &mut drafts,
            NodeKind::Meta(prop),
            key.into(),
            vec![target],
            NodeExpr::new(expr),
            input,
            Location::new(Section::MetaDerivations, i),
            aggregate,
        );
        add_reads(
            &mut d,
            &mut drafts,
            &reads,
            element.as_ref(),
            element.as_ref(),
        );
        if element.is_some() {
            d.node.projection = Some(Projection::whole());
        }
        drafts.push(d);
    }

    for (i, c) in spec.constraints.iter().enumerate() {
        let loc = format!("constraints[{i}]");
        let Some(policy) = Policy::parse(&c.policy) else {
            errors.push(CompileError {
                location: format!("{loc}.policy"),
                message: format!("policy is required (rollback | flag), found `{}`", c.policy),
            });
            continue;
        };
        let expr = match interner.get(&c.expr) {
            Ok(e) => e,
            Err(e) => {
                errors.push(expr_error(&format!("{loc}.expr"), &c.expr, &e));
                continue;
            }
        };
        let mut targets = Vec::new();
        let mut bad = false;
        if let Some(p) = &c.path {
            for (j, t) in p.paths().into_iter().enumerate() {
                match parse_address(|| format!("{loc}.path[{j}]"), t) {
                    Ok(a) => targets.push(a),
                    Err(e) => {
                        errors.push(e);
                        bad = true;
                    }
                }
            }
        }
        if bad {
            continue;
        }
        let kind = NodeKind::Constraint {
            index: i as u32,
            policy,
        };
        let key = format!("$constraint:{}", c.id);
        if targets.is_empty() {
            let at = Location::new(Section::Constraints, i);
            let d = draft(
                &mut drafts,
                kind,
                key.into(),
                targets,
                expr,
                Input::Doc,
                None,
                at,
            );
            drafts.push(d);
        } else {
            // Scoped: `$` is the field value (the element for `[*]`) and the node reads the
            // scope paths whole, which covers every reference relative to it; `$parent` is the
            // `[*]` element.
            let element = targets.iter().find_map(Address::element_pattern);
            let reads = deps::reads(expr.ast());
            let at = Location::new(Section::Constraints, i);
            let expr = NodeExpr::new(expr);
            let (field, key) = (Input::Field, key.into());
            let mut d = draft_empty(&mut drafts, kind, key, targets, expr, field, at, None);
            for t in &d.node.targets {
                drafts.add_read(tseg_iter(t));
            }
            let parent_only = Reads {
                paths: reads
                    .paths
                    .iter()
                    .filter(|p| p.root == Root::Parent)
                    .cloned()
                    .collect(),
                ..Reads::default()
            };
            add_reads(&mut d, &mut drafts, &parent_only, element.as_ref(), None);
            d.node.projection = Some(Projection::whole());
            d.extra.aggregate = None;
            drafts.push(d);
        }
    }

    let mut effect_plans = Vec::new();
    for (i, e) in spec.effects.iter().enumerate() {
        let loc = format!("effects[{i}]");
        let trigger = match interner.get(&e.trigger) {
            Ok(c) => c,
            Err(err) => {
                errors.push(expr_error(&format!("{loc}.trigger"), &e.trigger, &err));
                effect_plans.push(EffectPlan::default());
                continue;
            }
        };
        let mut plan = EffectPlan::default();
        let mut extra_reads = Reads::default();
        let mut opt = |field: &str,
                       text: &Option<String>,
                       errors: &mut Vec<CompileError>|
         -> Option<Rc<Compiled>> {
            let t = text.as_ref()?;
            match interner.get(t) {
                Ok(c) => Some(c),
                Err(err) => {
                    errors.push(expr_error(&format!("{loc}.{field}"), t, &err));
                    None
                }
            }
        };
        plan.dedupe = opt("dedupeKey", &e.dedupe_key, &mut errors);
        plan.at = opt("at", &e.at, &mut errors);
        plan.after_ms = opt("afterMs", &e.after_ms, &mut errors);
        let requests = opt("requests", &e.requests, &mut errors);
        let prompt = opt("prompt", &e.prompt, &mut errors);
        for c in [&plan.dedupe, &plan.at, &plan.after_ms, &requests, &prompt]
            .into_iter()
            .flatten()
        {
            merge_reads(&mut extra_reads, &deps::reads(c.ast()));
        }
        if let Some(payload) = &e.payload {
            for (k, v) in payload {
                let text = match v {
                    Json::String(s) => s.clone(),
                    other => other.to_string(),
                };
                match interner.get(&text) {
                    Ok(c) => plan.payload.push((k.clone(), c)),
                    Err(err) => errors.push(expr_error(&format!("{loc}.payload.{k}"), &text, &err)),
                }
            }
        }
        let mut d = draft(
            &mut drafts,
            NodeKind::Effect { index: i as u32 },
            format!("$effect:{}", e.id).into(),
            Vec::new(),
            trigger,
            Input::Doc,
            None,
            Location::new(Section::Effects, i),
        );
        add_reads(&mut d, &mut drafts, &extra_reads, None, None);
        drafts.push(d);
        effect_plans.push(plan);
    }

    let mut defaults = Vec::new();
    for (i, dv) in spec.default_values.iter().enumerate() {
        let loc = format!("defaultValues[{i}]");
        let path = match parse_address(|| format!("{loc}.path"), &dv.path) {
            Ok(a) => a,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        match interner.get(&dv.expr) {
            Ok(expr) => defaults.push(DefaultRule { path, expr }),
            Err(e) => errors.push(expr_error(&format!("{loc}.expr"), &dv.expr, &e)),
        }
    }

    if !errors.is_empty() {
        return Err(errors);
    }

    let mut nodes = std::mem::take(&mut drafts.nodes);
    let nodes_len = nodes.len();
    let (segs, read_ends, node_reads) = (
        &drafts.segs[..],
        &drafts.read_ends[..],
        &drafts.node_reads[..],
    );
    let reads = move |id| packed_reads(segs, read_ends, node_reads, id);
    // The reader index is needed only at the end: a large spec's is built on a thread of its
    // own while the graph is (at most one top-level member per read).
    let index_readers = move || {
        let mut readers = Trie::default();
        readers.reserve_members(read_ends.len());
        for id in 0..nodes_len {
            for r in reads(id) {
                readers.insert(r, id as u32);
            }
        }
        readers.shrink();
        readers
    };
    std::thread::scope(|s| {
        let helper = (nodes_len >= PARALLEL_FROM).then(|| s.spawn(index_readers));
        let derivation_ids: Vec<NodeId> = (0..nodes_len as u32)
            .filter(|&i| matches!(nodes[i as usize].kind, NodeKind::Derivation { .. }))
            .collect();
        let mut producers = Trie::default();
        let mut instances = Trie::default();
        // At most one top-level member per derivation.
        producers.reserve_members(derivation_ids.len());
        for (id, n) in nodes.iter().enumerate() {
            if matches!(n.kind, NodeKind::Derivation { .. }) {
                producers.insert_refs(tseg_refs(&n.targets[0]), id as u32);
            } else {
                for t in &n.targets {
                    instances.insert_refs(tseg_refs(t), id as u32);
                }
            }
        }

        producers.shrink();
        instances.shrink();

        // Edges producer → reader.
        let whole_doc_nodes: Vec<NodeId> = (0..nodes_len as u32)
            .filter(|&i| nodes[i as usize].whole_doc)
            .collect();
        let mut deps_of: Vec<BTreeSet<NodeId>> = vec![BTreeSet::new(); nodes_len];
        let mut buf = Vec::new();
        for (id, n) in nodes.iter().enumerate() {
            if n.whole_doc {
                for &p in &derivation_ids {
                    if !nodes[p as usize].whole_doc && p as usize != id {
                        deps_of[id].insert(p);
                    }
                }
                continue;
            }
            for r in reads(id) {
                buf.clear();
                producers.overlapping(r, &mut buf);
                for &p in &buf {
                    // A `[*]` derivation reading its whole element (`$fn($parent)`) also reads its
                    // own previous output; that is not a dependency (the reference has no such
                    // edge). A read at or below its own target still is: a real cycle.
                    if p as usize == id && reads_strict_ancestor(r, &n.targets[0]) {
                        continue;
                    }
                    deps_of[id].insert(p);
                }
            }
        }
        let dependents = Dependents::new(&deps_of);

        // Kahn's algorithm; levels = longest path from a source.
        let mut indeg: Vec<usize> = deps_of.iter().map(BTreeSet::len).collect();
        let mut level = vec![0u32; nodes_len];
        let mut queue: VecDeque<usize> = (0..nodes_len).filter(|&i| indeg[i] == 0).collect();
        let mut done = 0;
        while let Some(n) = queue.pop_front() {
            done += 1;
            for &m in dependents.of(n as NodeId) {
                let m = m as usize;
                level[m] = level[m].max(level[n] + 1);
                indeg[m] -= 1;
                if indeg[m] == 0 {
                    queue.push_back(m);
                }
            }
        }
        if done < nodes_len {
            let stuck: Vec<usize> = (0..nodes_len).filter(|&i| indeg[i] > 0).collect();
            let cycle = find_cycle(&stuck, &deps_of, &indeg);
            let names: Vec<&str> = cycle.iter().map(|&i| &*nodes[i].key).collect();
            let location = nodes[cycle[0]].location.to_string();
            return Err(vec![CompileError {
                location,
                message: format!("cyclic dependency: {}", names.join(" → ")),
            }]);
        }

        let (aggregates, mut trace_table) = (drafts.aggregates, drafts.trace_table);
        for (n, &l) in nodes.iter_mut().zip(&level) {
            n.level = l;
        }
        let max_level = derivation_ids
            .iter()
            .map(|&i| level[i as usize])
            .max()
            .unwrap_or(0);
        let level_count = if derivation_ids.is_empty() {
            0
        } else {
            max_level as usize + 1
        };
        let mut levels = vec![Vec::new(); level_count];
        for &i in &derivation_ids {
            levels[level[i as usize] as usize].push(i);
        }
        let by_kind = |f: fn(&NodeKind) -> bool| -> Vec<NodeId> {
            (0..nodes.len() as u32)
                .filter(|&i| f(&nodes[i as usize].kind))
                .collect()
        };
        let meta_nodes = by_kind(|k| matches!(k, NodeKind::Meta(_)));
        let constraint_nodes = by_kind(|k| matches!(k, NodeKind::Constraint { .. }));
        let effect_nodes = by_kind(|k| matches!(k, NodeKind::Effect { .. }));

        let cells = assign_cells(&mut nodes, &levels, &producers);
        for n in &mut nodes {
            n.jit.resolve_cells(&cells);
        }
        let merged_is_base = derivation_ids
            .iter()
            .all(|&i| nodes[i as usize].cell.is_some());
        trace_table.shrink();
        let has_delta_aggregates = aggregates
            .iter()
            .any(|(&id, a)| nodes[id as usize].keeps_by_delta(a));
        let mut readers = match helper {
            Some(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            None => index_readers(),
        };
        // A read member is marked when a derivation writes the whole document, the member or
        // something in it: an unmarked one is writable without asking the producer index.
        if producers.has_root_entries() {
            readers.mark_all_members();
        } else {
            for k in producers.members() {
                readers.mark_member(k);
            }
        }
        let (target_readers, target_reader_ids) = target_readers(&nodes, &readers);
        Ok(CompiledModel {
            target_readers,
            target_reader_ids,
            trace_table: Arc::new(trace_table),
            cells: Arc::new(cells),
            merged_is_base,
            schema: spec.schema.clone(),
            spec,
            has_delta_aggregates,
            aggregates,
            nodes,
            levels,
            dependents,
            readers,
            producers,
            instances,
            whole_doc_nodes,
            meta_nodes,
            constraint_nodes,
            effect_nodes,
            effect_plans,
            defaults,
            env,
            exports,
            limits: limits.clone(),
            validators: RefCell::new(HashMap::new()),
            scratch: RefCell::default(),
            fallback_forms: RefCell::default(),
            fallback_projections: RefCell::default(),
        })
    })
}

/// The readers of each concrete derivation target without array indices (a write there binds
/// no `[*]`, so each reader is dirtied whole), looked up in the index once.
#[allow(clippy::type_complexity)]
fn target_readers(nodes: &[Node], readers: &Trie) -> (Vec<Option<(u32, u32)>>, Vec<NodeId>) {
    let mut ranges = Vec::with_capacity(nodes.len());
    let mut ids = Vec::new();
    let mut hits = Vec::new();
    for n in nodes {
        let range = match (&n.kind, &n.concrete) {
            (NodeKind::Derivation { .. }, Some(t))
                if t.iter()
                    .all(|s| matches!(s, valem_core::value::Seg::Field(_))) =>
            {
                hits.clear();
                readers.hits(t, &mut hits);
                let start = ids.len() as u32;
                ids.extend(hits.iter().map(|(id, _)| *id));
                Some((start, ids.len() as u32))
            }
            _ => None,
        };
        ranges.push(range);
    }
    ids.shrink_to_fit();
    (ranges, ids)
}

impl CompiledModel {
    /// The interpreter's form of `node`'s expression: compiled again when it was let go, and
    /// then kept among the most recent [`FALLBACK_FORMS`].
    pub fn interpreted(&self, node: &Node) -> Result<Rc<Compiled>, ExprError> {
        if let Some(c) = node.expr.held() {
            return Ok(c);
        }
        let c = Rc::new(Compiled::compile(&node.expr.text, &self.limits)?);
        node.expr.compiled.set(Some(c.clone()));
        let mut kept = self.fallback_forms.borrow_mut();
        kept.push_back(node.id);
        if kept.len() > FALLBACK_FORMS {
            if let Some(old) = kept.pop_front() {
                if let Some(n) = self.nodes.get(old as usize) {
                    n.expr.compiled.take();
                }
                self.fallback_projections.borrow_mut().remove(&old);
            }
        }
        Ok(c)
    }

    /// The projection of a node whose projection was deferred, made from its interpreter form
    /// (which [`CompiledModel::interpreted`] compiles first) and kept while that form is.
    pub fn fallback_projection(&self, node: &Node) -> Rc<Projection> {
        if let Some(p) = self.fallback_projections.borrow().get(&node.id) {
            return p.clone();
        }
        let mut p = Projection::default();
        match self.interpreted(node) {
            Ok(c) => {
                let reads = deps::reads(c.ast());
                if reads.whole_doc {
                    p.whole = true;
                }
                for r in reads.paths.iter().filter(|r| r.root == Root::Doc) {
                    p.add(&r.fields);
                }
            }
            // Not reached (the text compiled before); the whole document is always right.
            Err(_) => p.whole = true,
        }
        p.shrink();
        let p = Rc::new(p);
        self.fallback_projections
            .borrow_mut()
            .insert(node.id, p.clone());
        p
    }

    /// The native aggregate `node` is evaluated as, if any.
    #[inline]
    pub fn aggregate(&self, node: &Node) -> Option<&Aggregate> {
        if self.aggregates.is_empty() {
            return None;
        }
        self.aggregates.get(&node.id)
    }

    /// The aggregate of `node` when the cycle keeps it up to date by delta instead of
    /// rescanning (see [`Node::keeps_by_delta`]).
    #[inline]
    pub fn delta_aggregate(&self, node: &Node) -> Option<&Aggregate> {
        self.aggregate(node).filter(|a| node.keeps_by_delta(a))
    }

    /// The derivation whose target is at or above the concrete path `w` (a write there is
    /// refused: the value is computed). A member something reads says whether any target is
    /// at, in or above it, so most writes are answered without the producer index.
    pub fn produced_above(&self, w: &[valem_core::value::Seg]) -> Option<u32> {
        if self.unproduced(w) {
            return None;
        }
        self.producers.above(w)
    }

    /// The derivation targets strictly below the concrete path `w`, as [`Trie::below`].
    pub fn produced_below(&self, w: &[valem_core::value::Seg], out: &mut Vec<super::trie::Hit>) {
        if !self.unproduced(w) {
            self.producers.below(w, out);
        }
    }

    /// `w` is in a member that something reads and no derivation writes (or writes above).
    fn unproduced(&self, w: &[valem_core::value::Seg]) -> bool {
        match w.first() {
            Some(valem_core::value::Seg::Field(k)) => {
                self.readers.member(k).is_some_and(|(_, m)| !m.marked())
            }
            _ => false,
        }
    }

    /// Start loading what marking and evaluating node `id` reads first: the node's first two
    /// cache lines and its entry in the target readers.
    #[inline]
    pub fn prefetch_node(&self, id: NodeId) {
        if let Some(n) = self.nodes.get(id as usize) {
            let p: *const Node = n;
            super::prefetch(p);
            super::prefetch(p.cast::<u8>().wrapping_add(64));
        }
        if let Some(t) = self.target_readers.get(id as usize) {
            super::prefetch(t);
        }
    }

    /// The readers a write of `node`'s target dirties (whole), when known at compile time.
    #[inline]
    pub fn target_readers(&self, node: NodeId) -> Option<&[NodeId]> {
        let (a, b) = self.target_readers.get(node as usize).copied().flatten()?;
        Some(&self.target_reader_ids[a as usize..b as usize])
    }
}

/// Give a cell to every derivation whose target is one top-level member that no other
/// derivation writes at or below; cells are numbered in evaluation order (level, then id).
fn assign_cells(
    nodes: &mut [Node],
    levels: &[Vec<NodeId>],
    producers: &Trie,
) -> super::merged::CellLayout {
    let mut keys = Vec::new();
    let mut below = Vec::new();
    for level in levels {
        for &id in level {
            let n = &nodes[id as usize];
            let Some([valem_core::value::Seg::Field(k)]) = n.concrete.as_deref() else {
                continue;
            };
            below.clear();
            let at = [valem_core::value::Seg::Field(k.clone())];
            producers.below(&at, &mut below);
            let alone = below.is_empty()
                && producers
                    .at(&at)
                    .is_some_and(|mut e| e.next() == Some(id) && e.next().is_none());
            if alone {
                let k = k.clone();
                nodes[id as usize].cell = Some(keys.len() as u32);
                keys.push(k);
            }
        }
    }
    super::merged::CellLayout::new(keys)
}

/// Whether the read pattern `r` is a strict ancestor of `target` (wildcards match indices).
fn reads_strict_ancestor(r: &[TSeg], target: &Address) -> bool {
    let t = tsegs(target);
    r.len() < t.len()
        && r.iter().zip(&t).all(|(a, b)| match (a, b) {
            (TSeg::Wild, TSeg::Index(_)) | (TSeg::Index(_), TSeg::Wild) => true,
            _ => a == b,
        })
}

/// Name one cycle among the stuck nodes (each has an unprocessed dependency).
fn find_cycle(stuck: &[usize], deps_of: &[BTreeSet<NodeId>], indeg: &[usize]) -> Vec<usize> {
    let start = stuck[0];
    let mut path = vec![start];
    let mut seen: HashMap<usize, usize> = HashMap::from([(start, 0)]);
    let mut cur = start;
    loop {
        let next = deps_of[cur]
            .iter()
            .map(|&d| d as usize)
            .find(|&d| indeg[d] > 0)
            .unwrap_or(cur);
        if let Some(&pos) = seen.get(&next) {
            let mut cycle: Vec<usize> = path[pos..].to_vec();
            cycle.reverse();
            cycle.push(cycle[0]);
            return cycle;
        }
        seen.insert(next, path.len());
        path.push(next);
        cur = next;
    }
}

fn merge_reads(into: &mut Reads, r: &Reads) {
    into.whole_doc |= r.whole_doc;
    into.dynamic |= r.dynamic;
    into.paths.extend(r.paths.iter().cloned());
}

#[allow(clippy::too_many_arguments)]
fn draft_empty(
    drafts: &mut Drafts,
    kind: NodeKind,
    key: Arc<str>,
    targets: Vec<Address>,
    expr: NodeExpr,
    input: Input,
    location: Location,
    aggregate: Option<Aggregate>,
) -> NodeDraft {
    drafts.begin();
    let concrete = match kind {
        NodeKind::Derivation { .. } => targets
            .first()
            .and_then(Address::concrete)
            .map(Vec::into_boxed_slice),
        _ => None,
    };
    let concrete_none = concrete.is_none();
    NodeDraft {
        node: Node {
            id: 0,
            kind,
            wild: targets.first().map_or(0, Address::wildcard_count) as u32,
            concrete,
            cell: None,
            key,
            targets: targets.into_boxed_slice(),
            expr,
            input,
            projection: None,
            projection_deferred: false,
            whole_doc: false,
            uses_parent: false,
            level: 0,
            location,
            jit: super::jit::JitCell::new(concrete_none, None),
        },
        extra: DraftExtra {
            program: None,
            aggregate,
        },
    }
}

#[allow(clippy::too_many_arguments)]
fn draft(
    drafts: &mut Drafts,
    kind: NodeKind,
    key: Arc<str>,
    targets: Vec<Address>,
    expr: Rc<Compiled>,
    input: Input,
    parent: Option<&Address>,
    location: Location,
) -> NodeDraft {
    let reads = deps::reads(expr.ast());
    let aggregate = aggregate_of(expr.ast());
    let mut d = draft_empty(
        drafts,
        kind,
        key,
        targets,
        NodeExpr::new(expr),
        input,
        location,
        aggregate,
    );
    add_reads(&mut d, drafts, &reads, parent, None);
    d
}

/// Add an expression's reads to a node. Document reads go to the projection and the reader
/// index — under `doc_base` when the input is an element rather than the root; `$parent` reads
/// are indexed under the parent pattern with bound wildcards.
fn add_reads(
    d: &mut NodeDraft,
    drafts: &mut Drafts,
    reads: &Reads,
    parent: Option<&Address>,
    doc_base: Option<&Address>,
) {
    let paths = reads.paths.iter().map(|r| (&r.root, &r.fields[..]));
    add_read_paths(d, drafts, reads.whole_doc, paths, parent, doc_base);
}

/// [`add_reads`] for reads given one by one (in the order a [`Reads`] set iterates them).
fn add_read_paths<'r>(
    d: &mut NodeDraft,
    drafts: &mut Drafts,
    whole_doc: bool,
    reads: impl Iterator<Item = (&'r Root, &'r [Key])>,
    parent: Option<&Address>,
    doc_base: Option<&Address>,
) {
    add_whole_doc(d, drafts, whole_doc, doc_base);
    for (root, fields) in reads {
        add_read(d, drafts, root, fields, parent, doc_base);
    }
    end_reads(d);
}

/// The first of a node's reads: its whole input, when it reads that.
fn add_whole_doc(
    d: &mut NodeDraft,
    drafts: &mut Drafts,
    whole_doc: bool,
    doc_base: Option<&Address>,
) {
    if !whole_doc {
        return;
    }
    match doc_base {
        None => {
            d.node.whole_doc = true;
            d.node.projection = Some(Projection::whole());
            drafts.trace_table.push_path_with(|t| t.push('$'));
        }
        Some(b) => drafts.add_read(tseg_iter(b)),
    }
}

/// One read of a node (see [`add_reads`]).
fn add_read(
    d: &mut NodeDraft,
    drafts: &mut Drafts,
    root: &Root,
    fields: &[Key],
    parent: Option<&Address>,
    doc_base: Option<&Address>,
) {
    match (root, doc_base) {
        (Root::Doc, None) => {
            if !d.node.projection_deferred {
                d.node.projection.get_or_insert_default().add(fields);
            }
            drafts.add_read(field_tsegs(fields));
        }
        (Root::Doc, Some(b)) => drafts.add_read(tseg_iter(b).chain(field_tsegs(fields))),
        (Root::Parent, _) => {
            d.node.uses_parent = true;
            // `$parent` where nothing binds it reads nothing.
            if let Some(p) = parent {
                drafts.add_read(tseg_iter(p).chain(field_tsegs(fields)));
            }
        }
    }
}

/// After a node's last read.
fn end_reads(d: &mut NodeDraft) {
    if let Some(p) = &mut d.node.projection {
        p.shrink();
    }
}

/// Evaluate the library layers in order and bind their exports into `env`.
pub fn bind_library(
    spec: &ModelSpec,
    env: &mut Env,
    limits: &Limits,
) -> Result<Vec<LibraryExport>, Vec<CompileError>> {
    let mut exports: Vec<LibraryExport> = Vec::new();
    let mut errors = Vec::new();
    for (li, layer) in spec.library_layers().iter().enumerate() {
        let loc = if spec.library_layers().len() == 1 {
            "library.define".to_string()
        } else {
            format!("library.layers[{li}].define")
        };
        match eval_library_layer(&layer.define, env, limits) {
            Ok(bound) => {
                for (name, value) in bound {
                    let is_function = value.is_function();
                    let arity = match &value {
                        JValue::Lambda(l) => Some(l.params.len()),
                        _ => None,
                    };
                    let signature = layer
                        .signatures
                        .get(&name)
                        .and_then(|s| s.as_str())
                        .map(str::to_string);
                    exports.retain(|e| e.name != name);
                    exports.push(LibraryExport {
                        name: name.clone(),
                        is_function,
                        layer: li,
                        signature,
                        arity,
                    });
                    env.vars.push((Rc::from(name.as_str()), value));
                }
            }
            Err(message) => errors.push(CompileError {
                location: loc,
                message,
            }),
        }
    }
    if errors.is_empty() {
        Ok(exports)
    } else {
        Err(errors)
    }
}

/// Evaluate one library definition: a block whose last expression is the array of exported
/// names. Returns each export with its value (a function, or a value computed once).
pub fn eval_library_layer(
    define: &str,
    env: &Env,
    limits: &Limits,
) -> Result<Vec<(String, JValue)>, String> {
    let compiled = Compiled::compile(define, limits).map_err(|e| {
        let at = e.at();
        format!("library definition does not compile{at}: {}", e.message)
    })?;
    let names_val = compiled
        .eval(&JValue::Null, env, limits)
        .map_err(|e| format!("library definition failed to evaluate: {}", e.message))?;
    let names: Vec<String> = match names_val {
        Some(JValue::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or("library definition must return an array of export names (strings)")?,
        Some(JValue::String(s)) => vec![s.to_string()],
        _ => return Err("library definition must return the array of export names, e.g. `( $f := function($x) { $x }; [\"f\"] )`".into()),
    };
    if names.is_empty() {
        return Err("library definition exports no names".into());
    }
    // Re-evaluate with the export list replaced by an object of the exported bindings, so the
    // closures keep their shared scope (mutual recursion between exports works).
    let AstNode::Block(items) = compiled.evaluated_ast() else {
        return Err("library definition must be a block `( $name := ...; [\"name\"] )`".into());
    };
    let mut items = items.clone();
    items.pop();
    items.push(AstNode::Object(
        names
            .iter()
            .map(|n| (AstNode::String(n.clone()), AstNode::Variable(n.clone())))
            .collect(),
    ));
    let block = AstNode::Block(items);
    let obj = valem_core::expr::eval_tree(&block, &JValue::Null, env, limits)
        .map_err(|e| format!("library definition failed to evaluate: {}", e.message))?;
    let mut out = Vec::new();
    for n in names {
        let v = obj.get(&n).cloned().unwrap_or(JValue::Undefined);
        if v.is_undefined() {
            return Err(format!("library exports `{n}` but never binds `${n}`"));
        }
        out.push((n, v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use valem_core::spec::parse_spec;

    fn c(j: Json) -> Result<CompiledModel, Vec<CompileError>> {
        compile(
            Arc::new(parse_spec(&j).unwrap()),
            &crate::EngineLimits::default(),
        )
    }

    /// A derivation's value nests as deep as its path before it holds anything: a path of
    /// more segments than `MAX_DEPTH` does not compile (it did, and its null made the merged
    /// document that deep), one of `MAX_DEPTH` does.
    #[test]
    fn a_derivation_path_deeper_than_a_document_may_be_does_not_compile() {
        let spec = |segments: usize| {
            json!({"id": "deep", "schema": {}, "derivations": [
                {"path": "$.ok", "expr": "1"},
                {"path": format!("${}", ".a".repeat(segments)), "expr": "x + 1"}
            ]})
        };
        let errs = c(spec(MAX_DEPTH + 1)).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].location, "derivations[1].path");
        assert!(
            errs[0].message.contains("101 levels deep"),
            "{}",
            errs[0].message
        );
        assert!(c(spec(MAX_DEPTH)).is_ok());
        let shaped = json!({"id": "deep", "schema": {}, "derivations": [
            {"path": "$.a", "expr": "x_1 + y_1"},
            {"path": format!("$.b{}", "[*]".repeat(MAX_DEPTH)), "expr": "x_2 + y_2"}
        ]});
        assert_eq!(c(shaped).unwrap_err()[0].location, "derivations[1].path");
    }

    /// A large spec is prepared in parts by other threads while this one drafts: every node
    /// comes out in spec order and every finding is reported, in order, as for a small spec.
    #[test]
    fn a_large_spec_prepared_in_parts_keeps_its_order_and_findings() {
        let n = PARALLEL_FROM + PART + 17;
        let bad = [10, PART, 2 * PART + 5, PARALLEL_FROM, n - 1];
        let derivations: Vec<Json> = (0..n)
            .map(|i| {
                let expr = if bad.contains(&i) {
                    format!("a_{i} *")
                } else if i % 3 == 0 {
                    format!("$sum(items.v_{i})")
                } else {
                    format!("a_{i} * b_{i}")
                };
                json!({"path": format!("$.t_{i}"), "expr": expr})
            })
            .collect();
        let errs = c(json!({"id": "big", "schema": {}, "derivations": derivations})).unwrap_err();
        let at: Vec<String> = errs.iter().map(|e| e.location.clone()).collect();
        let want: Vec<String> = bad
            .iter()
            .map(|i| format!("derivations[{i}].expr"))
            .collect();
        assert_eq!(at, want);
        let good: Vec<Json> = (0..n)
            .map(|i| json!({"path": format!("$.t_{i}"), "expr": format!("a_{i} * b_{i}")}))
            .collect();
        let m = c(json!({"id": "big", "schema": {}, "derivations": good})).unwrap();
        assert_eq!(m.nodes.len(), n);
        for (i, node) in m.nodes.iter().enumerate() {
            assert_eq!(&*node.key, format!("$.t_{i}"));
            assert_eq!(&*node.expr.text, format!("a_{i} * b_{i}"));
            assert_eq!(node.location.to_string(), format!("derivations[{i}]"));
            let reads: Vec<String> = m
                .trace_table
                .input_paths(i as u32)
                .map(String::from)
                .collect();
            assert_eq!(reads, [format!("$.a_{i}"), format!("$.b_{i}")]);
        }
    }

    /// A text analysed from the shape of one seen before gives what its own full analysis
    /// gives: the same lowering (code key and inputs), reads and aggregate, for formulas in
    /// and out of the arithmetic subset and names that collide with keywords, constants and
    /// each other.
    #[test]
    fn shaped_analysis_equals_full_analysis() {
        let families = [
            "A * B",
            "A * B + A - (A / 4)",
            "(A - B) / (A + 1) % 3",
            "$round(A * B * (1 + $const.rate), 2)",
            "A > B ? A : (B <= 1 ? -A : 2.5e-3)",
            "A.x * B.y + A.B",
            "$abs(A) + $sqrt(B) * $const.rate",
            "$power(A, 2) + $floor(B) - $ceil(C)",
            "A = 1 and B != 2 ? C : 0",
            "$parent.price * A",
            "$sum(A.B)",
            "$count(A)",
            "A & B",
            "A[0] * 2",
            "$max([A, B])",
            "A in [1, 2] ? B : C",
            "true ? A : B",
            "A * * B",
            "$undefinedfn(A)",
        ];
        let names = [
            ["price_1", "qty_1", "z"],
            ["price_2", "qty_2", "w"],
            ["rate", "x", "y"],
            ["and_x", "or_y", "in_z"],
            ["x", "x", "y"],
            ["price", "qty", "c"],
            ["a", "b", "c"],
        ];
        let limits = Limits::default();
        let mut constants = serde_json::Map::new();
        constants.insert("rate".into(), json!(0.5));
        let bound = HashSet::new();
        let mut shaped = 0;
        for f in families {
            let mut shapes = Shapes::default();
            for ns in names {
                let text = f
                    .replace('A', ns[0])
                    .replace('B', ns[1])
                    .replace('C', ns[2]);
                let d = valem_core::spec::DerivationSpec {
                    path: "$.t".into(),
                    expr: text.as_str().into(),
                    evaluation: None,
                    description: None,
                };
                let seen =
                    skeleton(&text).is_some_and(|sk| matches!(shapes.get(&sk), Some(Some(_))));
                let fast = prepare(0, &d, &limits, &constants, &bound, false, &mut shapes);
                let full = prepare(
                    0,
                    &d,
                    &limits,
                    &constants,
                    &bound,
                    false,
                    &mut Shapes::default(),
                );
                match (fast, full) {
                    (Ok(mut a), Ok(mut b)) => {
                        a.settle();
                        b.settle();
                        let reads = |p: &Prepared| {
                            let mut out = Vec::new();
                            p.for_each_read(|root, fields| {
                                out.push((root.clone(), fields.to_vec()))
                            });
                            out
                        };
                        let (reads_a, reads_b) = (reads(&a), reads(&b));
                        shaped += usize::from(seen);
                        let program = |p: &Prepared| p.program.as_ref().map(Lowering::program);
                        assert_eq!(program(&a), program(&b), "{text}");
                        // The slots an instance reads are those its program's slots read.
                        let inputs = |p: &Prepared| {
                            let mut slots = crate::jit::Slots::new();
                            p.program
                                .clone()
                                .map(|l| format!("{:?}", l.into_jit(false, &mut slots).inputs))
                        };
                        assert_eq!(inputs(&a), inputs(&b), "{text}");
                        assert_eq!(reads_a, reads_b, "{text}");
                        assert_eq!(a.whole_doc, b.whole_doc, "{text}");
                        assert_eq!(a.aggregate, b.aggregate, "{text}");
                        assert_eq!(a.target, b.target, "{text}");
                        assert_eq!(a.parsed.is_some(), b.parsed.is_some(), "{text}");
                    }
                    (Err(a), Err(b)) => assert_eq!(a.message, b.message, "{text}"),
                    (a, b) => panic!("{text}: {:?} vs {:?}", a.is_ok(), b.is_ok()),
                }
            }
        }
        // The arithmetic families were analysed from their shapes after their first text.
        assert!(shaped >= 30, "only {shaped} texts were shaped");
    }

    #[test]
    fn levels_follow_dependencies() {
        let m = c(json!({"id":"m","schema":{},"derivations":[
            {"path":"$.c","expr":"b + 1"},
            {"path":"$.b","expr":"a + 1"},
            {"path":"$.items[*].t","expr":"$parent.p * 2"},
            {"path":"$.sum","expr":"$sum(items.t)"}
        ]}))
        .unwrap();
        let lvl = |k: &str| m.nodes.iter().find(|n| &*n.key == k).unwrap().level;
        assert_eq!(lvl("$.b"), 0);
        assert_eq!(lvl("$.c"), 1);
        assert_eq!(lvl("$.items[*].t"), 0);
        assert_eq!(lvl("$.sum"), 1);
        let sum = m.nodes.iter().find(|n| &*n.key == "$.sum").unwrap();
        assert!(m.delta_aggregate(sum).is_some());
        let b = m.nodes.iter().find(|n| &*n.key == "$.b").unwrap();
        assert!(m.aggregate(b).is_none());
    }

    /// The producer questions answered from the reader index's marks give what the producer
    /// index gives, for members read and not, written at, in and around derived targets.
    #[test]
    fn marked_members_answer_as_the_producer_index() {
        let m = c(json!({"id":"m","schema":{},"derivations":[
            {"path":"$.a.b","expr":"x + a.c"},
            {"path":"$.t","expr":"x * 2"},
            {"path":"$.items[*].v","expr":"$parent.p + y"}
        ]}))
        .unwrap();
        let f = |s: &str| valem_core::value::Seg::Field(Arc::from(s));
        let paths: Vec<Vec<valem_core::value::Seg>> = vec![
            vec![f("x")],
            vec![f("y")],
            vec![f("a")],
            vec![f("a"), f("b")],
            vec![f("a"), f("c")],
            vec![f("a"), f("b"), f("z")],
            vec![f("t")],
            vec![f("items")],
            vec![f("items"), valem_core::value::Seg::Index(2), f("v")],
            vec![f("items"), valem_core::value::Seg::Index(2), f("p")],
            vec![f("unread")],
            vec![],
        ];
        let mut unproduced = 0;
        for w in &paths {
            assert_eq!(m.produced_above(w), m.producers.above(w), "{w:?}");
            let (mut a, mut b) = (Vec::new(), Vec::new());
            m.produced_below(w, &mut a);
            m.producers.below(w, &mut b);
            assert_eq!(a, b, "{w:?}");
            unproduced += usize::from(m.unproduced(w));
        }
        // `x` and `y` are read and nothing writes them: answered from the mark.
        assert_eq!(unproduced, 2);
    }

    #[test]
    fn cycles_are_named() {
        let e = c(json!({"id":"m","schema":{},"derivations":[
            {"path":"$.a","expr":"b + 1"},
            {"path":"$.b","expr":"c + 1"},
            {"path":"$.c","expr":"a + 1"}
        ]}))
        .unwrap_err();
        assert!(e[0].message.contains("cyclic dependency"), "{:?}", e);
        for k in ["$.a", "$.b", "$.c"] {
            assert!(e[0].message.contains(k), "{}", e[0].message);
        }
    }

    #[test]
    fn library_exports_functions_and_values() {
        let m = c(json!({"id":"m","schema":{},"constants":{"r":2},
            "library":"( $money := function($n) { $round($n, 2) }; $twice := function($x) { $x * $const.r }; $k := 5; [\"money\", \"twice\", \"k\"] )",
            "derivations":[{"path":"$.t","expr":"$money($twice(a)) + $k"}]}))
        .unwrap();
        assert_eq!(m.exports.len(), 3);
        assert!(m.exports[0].is_function);
        assert!(!m.exports[2].is_function);
    }

    #[test]
    fn compile_errors_are_located() {
        let e = c(json!({"id":"m","schema":{},"derivations":[{"path":"$.a","expr":"1 +"}]}))
            .unwrap_err();
        assert_eq!(e[0].location, "derivations[0].expr");
        assert!(e[0].message.contains("position 3"), "{}", e[0].message);
    }
}
