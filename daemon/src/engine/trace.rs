//! What a cycle reports of its evaluations: [`Traces`] (every evaluation) and [`Paths`] (the
//! derived addresses that changed). A cycle over 100k derivations makes 100k of each, so they
//! are recorded compactly — a node number and the value — against the compiled model's
//! [`TraceTable`], and expanded into [`Trace`]s or address strings only when they are read.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::ser::{SerializeSeq, Serializer};
use serde::Serialize;

use crate::value::Val;

/// One evaluation, as `explain` and `includeTraces` report it.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Trace {
    /// What was computed: a field address, a meta key (`$.path#prop`) or a constraint/effect id.
    pub target_path: Arc<str>,
    /// The expression and what it reads: one per node, shared by all its traces.
    #[serde(flatten)]
    pub source: Arc<TraceSource>,
    /// The value computed (any JSON).
    #[serde(serialize_with = "serialize_val")]
    #[schemars(schema_with = "crate::spec::schema::any_token")]
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
    pub expression: Arc<str>,
    /// The addresses the expression read.
    pub input_paths: Arc<[String]>,
}

fn serialize_val<S: Serializer>(v: &Val, s: S) -> Result<S::Ok, S::Error> {
    v.to_json().serialize(s)
}

/// Per graph node of a compiled model: its key and what its traces share. Shared by every
/// result the model's cycles produce.
#[derive(Debug, Default)]
pub struct TraceTable {
    keys: Vec<Arc<str>>,
    sources: Vec<Arc<TraceSource>>,
}

impl TraceTable {
    pub fn push(&mut self, key: Arc<str>, source: Arc<TraceSource>) {
        self.keys.push(key);
        self.sources.push(source);
    }

    pub fn key(&self, node: u32) -> &Arc<str> {
        &self.keys[node as usize]
    }

    pub fn source(&self, node: u32) -> &Arc<TraceSource> {
        &self.sources[node as usize]
    }
}

/// No node: a trace made outside the table (a refused cycle's constraint summary).
const NO_NODE: u32 = u32::MAX;

#[derive(Clone, Debug, PartialEq)]
struct TraceRec {
    node: u32,
    /// The address when it is not the node's key (`[*]` instances, meta keys).
    target: Option<Arc<str>>,
    result: Val,
    passed: Option<bool>,
    jit: bool,
    error: Option<Box<str>>,
}

/// A cycle's traces, in evaluation order.
#[derive(Clone, Debug, Default)]
pub struct Traces {
    table: Arc<TraceTable>,
    recs: Vec<TraceRec>,
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
        }
    }

    /// Record one evaluation of `node`; `target` when it is not the node's key.
    #[inline]
    pub fn push(
        &mut self,
        node: u32,
        target: Option<Arc<str>>,
        result: Val,
        passed: Option<bool>,
        jit: bool,
        error: Option<String>,
    ) {
        self.recs.push(TraceRec {
            node,
            target,
            result,
            passed,
            jit,
            error: error.map(String::into_boxed_str),
        });
    }

    /// Record a trace that belongs to no node: `target` with an empty source.
    pub fn push_detached(&mut self, target: Arc<str>, passed: Option<bool>) {
        self.push(NO_NODE, Some(target), Val::Null, passed, false, None);
    }

    pub fn len(&self) -> usize {
        self.recs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    fn expand(&self, r: &TraceRec) -> Trace {
        let (target, source) = if r.node == NO_NODE {
            (
                r.target.clone().unwrap_or_else(|| Arc::from("")),
                Arc::new(TraceSource {
                    expression: Arc::from(""),
                    input_paths: Arc::from(Vec::new()),
                }),
            )
        } else {
            (
                r.target
                    .clone()
                    .unwrap_or_else(|| self.table.key(r.node).clone()),
                self.table.source(r.node).clone(),
            )
        };
        Trace {
            target_path: target,
            source,
            result: r.result.clone(),
            constraint_passed: r.passed,
            error_message: r.error.as_deref().map(str::to_string),
            jit: r.jit,
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

#[derive(Clone, Debug)]
enum PathRef {
    Node(u32),
    Path(Arc<str>),
}

/// Addresses (the derived ones a cycle changed), in order.
#[derive(Clone, Debug, Default)]
pub struct Paths {
    table: Arc<TraceTable>,
    items: Vec<PathRef>,
}

impl Paths {
    pub fn new(table: Arc<TraceTable>) -> Paths {
        Paths {
            table,
            items: Vec::new(),
        }
    }

    /// The key of `node`.
    #[inline]
    pub fn push_node(&mut self, node: u32) {
        self.items.push(PathRef::Node(node));
    }

    pub fn push(&mut self, path: Arc<str>) {
        self.items.push(PathRef::Path(path));
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        self.items.iter().map(|p| match p {
            PathRef::Node(n) => &**self.table.key(*n),
            PathRef::Path(p) => &**p,
        })
    }

    /// Whether `node`'s key is listed.
    pub fn contains_node(&self, node: u32) -> bool {
        let key = self.table.key(node);
        self.items.iter().any(|p| match p {
            PathRef::Node(n) => *n == node,
            PathRef::Path(p) => p == key,
        })
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

impl From<Vec<Arc<str>>> for Paths {
    fn from(v: Vec<Arc<str>>) -> Paths {
        Paths {
            table: Arc::default(),
            items: v.into_iter().map(PathRef::Path).collect(),
        }
    }
}

impl Serialize for Paths {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.len()))?;
        for p in self.iter() {
            seq.serialize_element(p)?;
        }
        seq.end()
    }
}
