//! What a cycle reports of its evaluations: [`Traces`] (every evaluation) and [`Paths`] (the
//! derived addresses that changed). A cycle over 100k derivations makes 100k of each, so they
//! are recorded compactly — a node number and the value — against the compiled model's
//! [`TraceTable`], and expanded into [`Trace`]s or address strings only when they are read.

use std::sync::Arc;

use arcstr::ArcStr;

use schemars::JsonSchema;
use serde::ser::{SerializeSeq, Serializer};
use serde::Serialize;

use valem_core::value::Val;

/// One evaluation, as `explain` and `includeTraces` report it.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Trace {
    /// What was computed: a field address, a meta key (`$.path#prop`) or a constraint/effect id.
    #[schemars(with = "String")]
    pub target_path: ArcStr,
    /// The expression and what it reads (the node's, read from the model's trace table).
    #[serde(flatten)]
    pub source: TraceSource,
    /// The value computed (any JSON).
    #[serde(serialize_with = "serialize_val")]
    #[schemars(schema_with = "valem_core::spec::schema::any_token")]
    pub result: Val,
    /// Constraints: whether it held; `null` otherwise.
    pub constraint_passed: Option<bool>,
    /// The evaluation error, if it failed.
    pub error_message: Option<String>,
    /// `true` when compiled code computed the value (the JIT tier); absent otherwise.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub jit: bool,
}

/// The part of a trace that is the same for every evaluation of a node.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TraceSource {
    #[schemars(with = "String")]
    pub expression: ArcStr,
    /// The addresses the expression read.
    pub input_paths: InputPaths,
}

/// A node's input addresses: read from the model's [`TraceTable`], where every node's are
/// packed end to end (no allocation per node; a trace refers to them by node number).
#[derive(Clone, Debug, Default)]
pub struct InputPaths {
    /// The table and the node; none for a trace that belongs to no node.
    of: Option<(Arc<TraceTable>, u32)>,
}

impl InputPaths {
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        self.of
            .as_ref()
            .map(|(t, n)| t.input_paths(*n))
            .into_iter()
            .flatten()
    }
}

impl PartialEq for InputPaths {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

/// The range of item `i` of items packed end to end, from where each ends (empty past the
/// last).
pub(crate) fn span(ends: &[u32], i: usize) -> std::ops::Range<usize> {
    let Some(&end) = ends.get(i) else {
        return 0..0;
    };
    let start = i.checked_sub(1).map_or(0, |p| ends[p]);
    start as usize..end as usize
}

/// The ranges of items packed end to end, from where each ends.
pub(crate) fn spans(ends: &[u32]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let starts = std::iter::once(0).chain(ends.iter().copied());
    starts
        .zip(ends.iter().copied())
        .map(|(a, b)| a as usize..b as usize)
}

/// A list of addresses packed end to end: one text and where each ends, so a long list is
/// two allocations rather than one per address (a mutation of 200k writes lists 200k
/// addresses). Serializes as a JSON array of strings.
#[derive(Clone, Debug, Default)]
pub struct PathList {
    text: String,
    ends: Vec<u32>,
}

impl PathList {
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        spans(&self.ends).map(|r| self.text.get(r).unwrap_or(""))
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn contains(&self, path: &str) -> bool {
        self.iter().any(|p| p == path)
    }

    /// Address `i`.
    pub fn get(&self, i: usize) -> &str {
        self.text.get(span(&self.ends, i)).unwrap_or("")
    }

    /// Keep the first `n` addresses.
    fn truncate(&mut self, n: usize) {
        if n < self.ends.len() {
            let end = n.checked_sub(1).map_or(0, |i| self.ends[i] as usize);
            self.text.truncate(end);
            self.ends.truncate(n);
        }
    }

    fn shrink(&mut self) {
        self.text.shrink_to_fit();
        self.ends.shrink_to_fit();
    }

    /// Room for `n` more addresses (of a dozen bytes each).
    pub fn reserve(&mut self, n: usize) {
        self.ends.reserve(n);
        self.text.reserve(n.saturating_mul(12));
    }

    /// Append the address `write` writes (into the shared text, without a string of its own).
    pub fn push_with(&mut self, write: impl FnOnce(&mut String)) {
        write(&mut self.text);
        self.ends
            .push(u32::try_from(self.text.len()).unwrap_or(u32::MAX));
    }

    pub fn push(&mut self, path: &str) {
        self.push_with(|t| t.push_str(path));
    }
}

impl PartialEq for PathList {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Serialize for PathList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'a> FromIterator<&'a str> for PathList {
    fn from_iter<I: IntoIterator<Item = &'a str>>(it: I) -> PathList {
        let mut l = PathList::default();
        for p in it {
            l.push(p);
        }
        l
    }
}

impl Serialize for InputPaths {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl JsonSchema for InputPaths {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> std::borrow::Cow<'static, str> {
        "InputPaths".into()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        <Vec<String>>::json_schema(g)
    }
}

fn serialize_val<S: Serializer>(v: &Val, s: S) -> Result<S::Ok, S::Error> {
    v.to_json().serialize(s)
}

/// Per graph node of a compiled model: its key and what its traces share (its expression
/// and input addresses). Shared by every result the model's cycles produce. The input
/// addresses of all nodes are packed in one text, so a node costs a few words here and no
/// allocation of its own (a 100k-derivation model has 100k of them).
#[derive(Debug, Default)]
pub struct TraceTable {
    /// The spec whose first `shared` derivations are the first `shared` nodes, written
    /// canonically: their keys and expressions are its paths and texts, not copied here
    /// (32 bytes a node).
    spec: Option<Arc<valem_core::spec::ModelSpec>>,
    shared: u32,
    /// The keys and expressions of the nodes from `shared` on.
    keys: Vec<ArcStr>,
    expressions: Vec<ArcStr>,
    /// Every node's input addresses, one node's after another.
    paths: PathList,
    /// Per node, where its addresses end in `paths`.
    node_ends: Vec<u32>,
}

thread_local! {
    /// The table of lists made empty (a cycle hands its result on by leaving one of these in
    /// its place): shared, so making one allocates nothing.
    static NO_TABLE: Arc<TraceTable> = Arc::new(TraceTable::default());
}

fn no_table() -> Arc<TraceTable> {
    NO_TABLE.with(Arc::clone)
}

impl Default for Traces {
    fn default() -> Traces {
        Traces::new(no_table())
    }
}

impl Default for Paths {
    fn default() -> Paths {
        Paths::new(no_table())
    }
}

impl TraceTable {
    /// Add an address the next node reads (written by `write`, appended to the table's text).
    pub fn push_path_with(&mut self, write: impl FnOnce(&mut String)) {
        self.paths.push_with(write);
    }

    /// A table whose nodes may take their keys and expressions from `spec`'s derivations
    /// (see [`TraceTable::push`]).
    pub fn for_spec(spec: Arc<valem_core::spec::ModelSpec>) -> TraceTable {
        TraceTable {
            spec: Some(spec),
            ..TraceTable::default()
        }
    }

    /// Whether the next node, `id`, has derivation `id`'s path and text as its key and
    /// expression, and every node before it was shared so.
    fn can_share(&self, id: u32, key: &str, expression: &str) -> bool {
        self.keys.is_empty()
            && self.shared == id
            && self
                .spec
                .as_ref()
                .and_then(|s| s.derivations.get(id as usize))
                .is_some_and(|d| *d.path == *key && *d.expr == *expression)
    }

    /// The next node reads the addresses pushed since the node before it.
    fn end_node(&mut self) {
        self.node_ends
            .push(u32::try_from(self.paths.len()).unwrap_or(u32::MAX));
    }

    /// Add the next node: its key and its expression; it reads the addresses pushed since the
    /// node before it. The leading nodes that are the spec's derivations as written (a key
    /// that is the derivation's path, its text as the expression) keep no copy: their texts
    /// are read from the spec.
    pub fn push(&mut self, key: ArcStr, expression: ArcStr) {
        let id = u32::try_from(self.node_ends.len()).unwrap_or(u32::MAX);
        let shared = self.can_share(id, &key, &expression);
        self.end_node();
        if shared {
            self.shared += 1;
        } else {
            self.keys.push(key);
            self.expressions.push(expression);
        }
    }

    /// The nodes whose key and expression the table holds itself (not the spec's).
    #[cfg(test)]
    pub(crate) fn own_texts(&self) -> usize {
        self.keys.len()
    }

    /// Drop the addresses pushed since the last node.
    pub fn drop_unfinished(&mut self) {
        let kept = self.node_ends.last().map_or(0, |&e| e as usize);
        self.paths.truncate(kept);
    }

    /// How many addresses it holds, and their bytes in all.
    pub fn path_counts(&self) -> (usize, usize) {
        (self.paths.len(), self.paths.text.len())
    }

    /// Room for `nodes` nodes and `paths` addresses of `bytes` bytes in all, before they are
    /// pushed (a large compile's are otherwise copied as the lists double).
    pub fn reserve(&mut self, nodes: usize, paths: usize, bytes: usize) {
        self.keys.reserve(nodes);
        self.expressions.reserve(nodes);
        self.node_ends.reserve(nodes);
        self.paths.ends.reserve(paths);
        self.paths.text.reserve(bytes);
    }

    /// Release spare capacity once every node is in.
    pub fn shrink(&mut self) {
        self.keys.shrink_to_fit();
        self.expressions.shrink_to_fit();
        self.paths.shrink();
        self.node_ends.shrink_to_fit();
    }

    pub fn key(&self, node: u32) -> &ArcStr {
        match self.derivation(node) {
            Some(d) => &d.path,
            None => &self.keys[(node - self.shared) as usize],
        }
    }

    pub fn expression(&self, node: u32) -> &ArcStr {
        match self.derivation(node) {
            Some(d) => &d.expr,
            None => &self.expressions[(node - self.shared) as usize],
        }
    }

    /// The spec's derivation that node `node` is, when its texts are the spec's.
    #[inline]
    fn derivation(&self, node: u32) -> Option<&valem_core::spec::DerivationSpec> {
        if node >= self.shared {
            return None;
        }
        self.spec.as_ref()?.derivations.get(node as usize)
    }

    /// The addresses `node` reads.
    pub fn input_paths(&self, node: u32) -> impl Iterator<Item = &str> + '_ {
        span(&self.node_ends, node as usize).map(|i| self.paths.get(i))
    }

    /// What every trace of `node` shares, read from `table`.
    pub fn source(table: &Arc<TraceTable>, node: u32) -> TraceSource {
        TraceSource {
            expression: table.expression(node).clone(),
            input_paths: InputPaths {
                of: Some((table.clone(), node)),
            },
        }
    }
}

/// No node: a trace made outside the table (a refused cycle's constraint summary).
const NO_NODE: u32 = u32::MAX;

/// One evaluation in 32 bytes: what is rare (an instance address, an error) is in a side table.
#[derive(Clone, Debug)]
struct TraceRec {
    node: u32,
    /// Bits 0–1: constraint outcome (0 none, 1 failed, 2 held); bit 2: computed by the JIT;
    /// bits 3–31: 1 + the index of its `Extra`, or 0.
    bits: u32,
    result: Val,
}

#[derive(Clone, Debug)]
struct Extra {
    /// The address when it is not the node's key (`[*]` instances).
    target: Option<ArcStr>,
    error: Option<Box<str>>,
}

/// A cycle's traces, in evaluation order.
#[derive(Clone, Debug)]
pub struct Traces {
    table: Arc<TraceTable>,
    recs: Vec<TraceRec>,
    extra: Vec<Extra>,
}

impl PartialEq for Traces {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Traces {
    pub fn new(table: Arc<TraceTable>) -> Traces {
        Traces {
            table,
            recs: Vec::new(),
            extra: Vec::new(),
        }
    }

    /// Room for `n` traces.
    pub fn reserve(&mut self, n: usize) {
        self.recs.reserve(n);
    }

    /// Record one evaluation of `node`; `target` when it is not the node's key.
    #[inline]
    pub fn push(
        &mut self,
        node: u32,
        target: Option<ArcStr>,
        result: Val,
        passed: Option<bool>,
        jit: bool,
        error: Option<String>,
    ) {
        let mut bits = match passed {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        } | (u32::from(jit) << 2);
        if target.is_some() || error.is_some() {
            self.extra.push(Extra {
                target,
                error: error.map(String::into_boxed_str),
            });
            bits |= (self.extra.len() as u32) << 3;
        }
        self.recs.push(TraceRec { node, bits, result });
    }

    /// Record a trace that belongs to no node: `target` with an empty source.
    pub fn push_detached(&mut self, target: ArcStr, passed: Option<bool>) {
        self.push(NO_NODE, Some(target), Val::Null, passed, false, None);
    }

    pub fn len(&self) -> usize {
        self.recs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    fn expand(&self, r: &TraceRec) -> Trace {
        let extra = match r.bits >> 3 {
            0 => None,
            k => self.extra.get(k as usize - 1),
        };
        let target = extra.and_then(|e| e.target.clone());
        let (target, source) = if r.node == NO_NODE {
            (
                target.unwrap_or_else(ArcStr::new),
                TraceSource {
                    expression: ArcStr::new(),
                    input_paths: InputPaths::default(),
                },
            )
        } else {
            (
                target.unwrap_or_else(|| self.table.key(r.node).clone()),
                TraceTable::source(&self.table, r.node),
            )
        };
        Trace {
            target_path: target,
            source,
            result: r.result.clone(),
            constraint_passed: match r.bits & 3 {
                1 => Some(false),
                2 => Some(true),
                _ => None,
            },
            error_message: extra.and_then(|e| e.error.as_deref()).map(str::to_string),
            jit: r.bits & 4 != 0,
        }
    }

    /// The traces, expanded.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = Trace> + ExactSizeIterator + '_ {
        self.recs.iter().map(|r| self.expand(r))
    }
}

impl Serialize for Traces {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.len()))?;
        for t in self.iter() {
            seq.serialize_element(&t)?;
        }
        seq.end()
    }
}

/// An item of [`Paths`]: a node number (its key), or with the top bit set an index into
/// `Paths::strs`.
const STR: u32 = 1 << 31;

/// Addresses (the derived ones a cycle changed), in order.
#[derive(Clone, Debug)]
pub struct Paths {
    table: Arc<TraceTable>,
    items: Vec<u32>,
    strs: Vec<ArcStr>,
}

impl Paths {
    pub fn new(table: Arc<TraceTable>) -> Paths {
        Paths {
            table,
            items: Vec::new(),
            strs: Vec::new(),
        }
    }

    /// Room for `n` addresses.
    pub fn reserve(&mut self, n: usize) {
        self.items.reserve(n);
    }

    /// The key of `node`.
    #[inline]
    pub fn push_node(&mut self, node: u32) {
        self.items.push(node);
    }

    pub fn push(&mut self, path: ArcStr) {
        self.items.push(STR | self.strs.len() as u32);
        self.strs.push(path);
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        self.items.iter().map(|&p| {
            if p & STR != 0 {
                &*self.strs[(p & !STR) as usize]
            } else {
                &**self.table.key(p)
            }
        })
    }

    /// Whether `node`'s key is listed.
    pub fn contains_node(&self, node: u32) -> bool {
        self.items.contains(&node) || self.contains(self.table.key(node))
    }

    pub fn contains(&self, path: &str) -> bool {
        self.iter().any(|p| p == path)
    }
}

impl PartialEq for Paths {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl<'a> FromIterator<&'a str> for Paths {
    fn from_iter<I: IntoIterator<Item = &'a str>>(it: I) -> Paths {
        let mut p = Paths::default();
        for s in it {
            p.push(ArcStr::from(s));
        }
        p
    }
}

impl Serialize for Paths {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packed addresses read back one by one, serialize as a JSON array of strings, and
    /// describe themselves as one in the schema (as the list of strings they replace did).
    #[test]
    fn input_paths_pack_and_read_back() {
        let paths = ["$.price", "$", "$['a b'][2]", "", "$.items[*].qty"];
        let mut want = paths.to_vec();
        want.push("$.x");
        // Between two other nodes' (one reading nothing) in one table; a node begun and
        // dropped leaves nothing.
        let mut table = TraceTable::default();
        table.push_path_with(|t| t.push_str("$.a"));
        table.push(ArcStr::from("$.p"), ArcStr::from("a"));
        table.push_path_with(|t| t.push_str("$.dropped"));
        table.drop_unfinished();
        for p in paths {
            table.push_path_with(|t| t.push_str(p));
        }
        table.push_path_with(|t| t.push_str("$.x"));
        table.push(ArcStr::from("$.q"), ArcStr::from("price"));
        table.push_path_with(|t| t.push_str("$.also_dropped"));
        table.drop_unfinished();
        table.push(ArcStr::from("$.r"), ArcStr::from("1"));
        table.shrink();
        let table = Arc::new(table);
        let packed = TraceTable::source(&table, 1).input_paths;
        assert_eq!(packed.iter().collect::<Vec<_>>(), want);
        assert_eq!(table.input_paths(0).collect::<Vec<_>>(), ["$.a"]);
        assert_eq!(table.input_paths(2).count(), 0);
        assert_eq!(&*TraceTable::source(&table, 1).expression, "price");
        assert_eq!(
            serde_json::to_value(&packed).unwrap(),
            serde_json::json!(want)
        );
        assert!(InputPaths::default().iter().next().is_none());
        let schema = serde_json::to_value(schemars::schema_for!(TraceSource)).unwrap();
        assert_eq!(
            schema["properties"]["inputPaths"],
            serde_json::json!({
                "description": "The addresses the expression read.",
                "type": "array",
                "items": {"type": "string"}
            })
        );
    }
}
