//! The compiled model's types: nodes and their expressions, dependents, effect plans, default
//! rules, the library's exports, compile errors and `CompiledModel` with its accessors.

use super::*;

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
    pub(super) fn whole() -> Box<Projection> {
        Box::new(Projection {
            whole: true,
            children: Vec::new(),
        })
    }

    pub(super) fn shrink(&mut self) {
        self.children.shrink_to_fit();
        for (_, c) in &mut self.children {
            c.shrink();
        }
    }

    pub(super) fn add(&mut self, fields: &[Key]) {
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

/// A node's interpreter form. Its text is in the trace table with its key
/// ([`CompiledModel::expression`], [`CompiledModel::key`]): the spec's own when written
/// canonically, so a node holds neither. An arithmetic derivation lets the compiled form go
/// once the spec is compiled (the JIT tier computes it from its lowering); an evaluation that
/// needs the interpreter compiles the text again, and the most recent such forms are kept
/// (`CompiledModel::interpreted`).
pub struct NodeExpr {
    /// A `Cell` (taken and put back to read): 8 bytes where a `RefCell` takes 16.
    pub(super) compiled: Cell<Option<Rc<Compiled>>>,
}

impl std::fmt::Debug for NodeExpr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeExpr")
            .field("held", &self.held().is_some())
            .finish()
    }
}

/// A node's expression while it is drafted: its text (which goes to the trace table) and its
/// compiled form, if made.
pub(super) struct ExprDraft {
    pub(super) text: arcstr::ArcStr,
    pub(super) compiled: Option<Rc<Compiled>>,
}

impl ExprDraft {
    pub(super) fn new(c: Rc<Compiled>) -> ExprDraft {
        ExprDraft {
            text: c.text.clone(),
            compiled: Some(c),
        }
    }

    /// The text alone (the interpreted form is compiled when needed).
    pub(super) fn text(text: arcstr::ArcStr) -> ExprDraft {
        ExprDraft {
            text,
            compiled: None,
        }
    }
}

impl NodeExpr {
    pub(super) fn new(compiled: Option<Rc<Compiled>>) -> NodeExpr {
        NodeExpr {
            compiled: Cell::new(compiled),
        }
    }

    /// The compiled form, if it is held.
    pub fn held(&self) -> Option<Rc<Compiled>> {
        let c = self.compiled.take();
        self.compiled.set(c.clone());
        c
    }
}

/// The bit of an end in `CompiledModel::target_readers` that says the node has a list.
pub(super) const KNOWN: u32 = 1 << 31;

/// Interpreter forms of arithmetic derivations compiled again for a fallback, kept at most.
pub(super) const FALLBACK_FORMS: usize = 1024;

/// Per node, the nodes that read what it writes, packed end to end (one allocation for the
/// graph instead of one list per node: a 100k-node model's lists are mostly empty).
#[derive(Debug, Default)]
pub struct Dependents {
    /// Where each node's list starts in `ids` (one more than there are nodes).
    pub(super) starts: Vec<u32>,
    pub(super) ids: Vec<NodeId>,
}

impl Dependents {
    /// Empty lists, to be given one node's at a time ([`Dependents::push_list`]).
    pub(super) fn with_capacity(nodes: usize) -> Dependents {
        let mut starts = Vec::with_capacity(nodes + 1);
        starts.push(0);
        Dependents {
            starts,
            ids: Vec::new(),
        }
    }

    /// The next node's list.
    pub(super) fn push_list(&mut self, list: &[NodeId]) {
        self.ids.extend_from_slice(list);
        self.starts.push(self.ids.len() as u32);
    }

    /// The lists of the nodes after these (made apart, from [`Dependents::with_capacity`]).
    pub(super) fn append(&mut self, more: &Dependents) {
        let base = self.ids.len() as u32;
        self.ids.extend_from_slice(&more.ids);
        self.starts
            .extend(more.starts.iter().skip(1).map(|&e| e + base));
    }

    /// How many nodes have a list.
    pub(super) fn len(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// The reverse: per node, the nodes whose lists name it, in increasing order.
    pub(super) fn reverse(&self) -> Dependents {
        let n = self.len();
        let mut starts = vec![0u32; n + 1];
        for &p in &self.ids {
            starts[p as usize + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut fill: Vec<u32> = starts[..n].to_vec();
        let mut ids = vec![0; starts[n] as usize];
        for (id, ds) in self.iter().enumerate() {
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
// The fields a mutation's mark and evaluation read come first (the spec's texts, messages and
// interpreted forms come after). 144 bytes: a 1M-derivation model holds 1M nodes, so what is
// rare (aggregates, projections of interpreted nodes) is kept beside the node or boxed, and
// the node is not padded to whole cache lines.
#[repr(C)]
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
    /// `NO_CELL` when it has none (see [`Node::cell`]).
    pub cell: u32,
    /// Runs of its lowering counted until it asks for compiled code (see
    /// [`crate::jit::JitCell::get`]).
    pub runs: std::cell::Cell<u32>,
    /// The concrete target of a derivation without `[*]`.
    pub concrete: Concrete,
    /// The JIT tier of a derivation (`engine/jit.rs`).
    pub jit: crate::jit::JitCell,
    /// Derivation with `[*]`, meta: the target pattern. Scoped constraint: its paths.
    /// Otherwise empty: a concrete derivation's target is `concrete` (a large model's nodes
    /// are almost all such; while it compiles, their patterns are kept beside the nodes).
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
const _: () = assert!(std::mem::size_of::<Node>() == 144 && std::mem::size_of::<Concrete>() == 24);

/// A derivation's concrete target: one segment in place (a large model's derivations mostly
/// write one top-level member each, and a boxed one was an allocation a node), longer ones
/// boxed.
#[derive(Clone, Debug, Default)]
pub enum Concrete {
    /// A derivation with `[*]`, or another kind of node.
    #[default]
    None,
    One(valem_core::value::Seg),
    Many(Box<[valem_core::value::Seg]>),
}

impl Concrete {
    /// The concrete target of `address` ([`Concrete::None`] with a `[*]`): one segment made
    /// in place, without a list of it.
    pub fn of(address: &Address) -> Concrete {
        use valem_core::expr::path::PathSeg;
        use valem_core::value::Seg;
        match &address.segs[..] {
            [PathSeg::Field(k)] => Concrete::One(Seg::Field(k.clone())),
            [PathSeg::Index(i)] => Concrete::One(Seg::Index(*i)),
            _ => address.concrete().map_or(Concrete::None, Concrete::new),
        }
    }

    pub fn new(segs: Vec<valem_core::value::Seg>) -> Concrete {
        if segs.len() == 1 {
            segs.into_iter()
                .next()
                .map_or(Concrete::None, Concrete::One)
        } else {
            Concrete::Many(segs.into_boxed_slice())
        }
    }

    #[inline]
    pub fn as_deref(&self) -> Option<&[valem_core::value::Seg]> {
        match self {
            Concrete::None => None,
            Concrete::One(s) => Some(std::slice::from_ref(s)),
            Concrete::Many(b) => Some(b),
        }
    }

    pub fn is_some(&self) -> bool {
        !matches!(self, Concrete::None)
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Concrete::None)
    }
}

/// [`Node::cell`] of a node without a cell.
pub const NO_CELL: u32 = u32::MAX;

impl Node {
    /// The cell holding a derivation's value, when its target is one top-level member.
    #[inline]
    pub fn cell(&self) -> Option<u32> {
        (self.cell != NO_CELL).then_some(self.cell)
    }

    /// Its lowering while the arithmetic tier is on, counting this run (see
    /// [`crate::jit::JitCell::get`]).
    #[inline]
    pub fn jit(
        &self,
        cfg: crate::JitConfig,
    ) -> Option<(&crate::jit::NodeJit, Option<&crate::jit::Code>)> {
        self.jit.get(&self.runs, cfg)
    }

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
    pub(super) fn new(section: Section, index: usize) -> Location {
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
    pub(super) aggregates: HashMap<NodeId, Aggregate>,
    /// Derivation nodes in evaluation order: by topological level, then by id.
    pub by_level: Vec<NodeId>,
    /// Per node, the nodes that read what it writes (derivations only write).
    pub dependents: Dependents,
    pub readers: Trie,
    /// What a write of a concrete derivation's target dirties (its readers in the index, all
    /// of every instance: the target has no array index), as ranges of `target_reader_ids`:
    /// node `i`'s ends at `target_readers[i + 1]` and starts where node `i - 1`'s ended (4
    /// bytes a node). [`KNOWN`] is set for the nodes that have such a list; the others' writes
    /// look the index up.
    pub(super) target_readers: Vec<u32>,
    pub(super) target_reader_ids: Vec<NodeId>,
    /// Per node, its key and what its traces share.
    pub trace_table: Arc<crate::TraceTable>,
    /// The top-level members whose derived values live in cells.
    pub cells: Arc<crate::merged::CellLayout>,
    /// Every derivation writes a cell: the merged document's tree is the base document.
    pub merged_is_base: bool,
    /// Where derivations write (read-only check, compile-time edges). Left empty for a flat
    /// model: `cell_producers` answers then.
    pub producers: Trie,
    /// A flat model's (each derivation writes its own top-level member, so each has a cell)
    /// derivation of each cell: a write's producers are its member's cell (a 1M-derivation
    /// flat model's producer index was ~72 MB).
    pub(super) cell_producers: Option<Box<[NodeId]>>,
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
    pub(super) fallback_forms: RefCell<VecDeque<NodeId>>,
    /// The projections of those nodes whose projection was deferred.
    pub(super) fallback_projections: RefCell<HashMap<NodeId, Rc<Projection>>>,
    /// The cycles' per-node bookkeeping, reused (`cycle.rs`).
    pub(crate) scratch: RefCell<crate::cycle::Scratch>,
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

impl CompiledModel {
    /// Node `id`'s graph key: `$.total`, `$.email#relevant`, `$constraint:id`, `$effect:id`.
    pub fn key(&self, id: NodeId) -> &arcstr::ArcStr {
        self.trace_table.key(id)
    }

    /// Node `id`'s expression text.
    pub fn expression(&self, id: NodeId) -> &arcstr::ArcStr {
        self.trace_table.expression(id)
    }

    /// The interpreter's form of `node`'s expression: compiled again when it was let go, and
    /// then kept among the most recent [`FALLBACK_FORMS`].
    pub fn interpreted(&self, node: &Node) -> Result<Rc<Compiled>, ExprError> {
        if let Some(c) = node.expr.held() {
            return Ok(c);
        }
        let c = Rc::new(Compiled::compile(self.expression(node.id), &self.limits)?);
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
        if let Some(by_cell) = &self.cell_producers {
            return match w.first() {
                Some(valem_core::value::Seg::Field(k)) => self
                    .cells
                    .find(k)
                    .and_then(|c| by_cell.get(c as usize).copied()),
                _ => None,
            };
        }
        self.producers.above(w)
    }

    /// The derivation targets strictly below the concrete path `w`, as [`Trie::below`].
    pub fn produced_below(&self, w: &[valem_core::value::Seg], out: &mut Vec<crate::trie::Hit>) {
        if self.unproduced(w) {
            return;
        }
        match &self.cell_producers {
            // Every target is one top-level member: only the root has targets below it.
            Some(by_cell) if w.is_empty() => out.extend(by_cell.iter().map(|&id| (id, Vec::new()))),
            Some(_) => {}
            None => self.producers.below(w, out),
        }
    }

    /// `w` is in a member that something reads and no derivation writes (or writes above).
    pub(super) fn unproduced(&self, w: &[valem_core::value::Seg]) -> bool {
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
            crate::prefetch(p);
            crate::prefetch(p.cast::<u8>().wrapping_add(64));
        }
        if let Some(t) = self.target_readers.get(id as usize + 1) {
            crate::prefetch(t);
        }
    }

    /// The readers a write of `node`'s target dirties (whole), when known at compile time.
    #[inline]
    pub fn target_readers(&self, node: NodeId) -> Option<&[NodeId]> {
        let i = node as usize;
        let end = *self.target_readers.get(i + 1)?;
        if end & KNOWN == 0 {
            return None;
        }
        let start = self.target_readers.get(i)? & !KNOWN;
        self.target_reader_ids
            .get(start as usize..(end & !KNOWN) as usize)
    }
}
