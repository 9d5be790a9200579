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
    pub input_paths: InputPaths,
}

/// A node's input addresses, packed: their text end to end and where each ends (two
/// allocations, where a list of strings takes one per address and one for the list). Every
/// node of a compiled model has one; it is read when traces are.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InputPaths {
    text: Box<str>,
    ends: Box<[u32]>,
}

impl InputPaths {
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        spans(&self.ends).map(|r| self.text.get(r).unwrap_or(""))
    }
}

/// The ranges of items packed end to end, from where each ends.
pub(crate) fn spans(ends: &[u32]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let starts = std::iter::once(0).chain(ends.iter().copied());
    starts
        .zip(ends.iter().copied())
        .map(|(a, b)| a as usize..b as usize)
}

/// An [`InputPaths`] being built, one address after another.
#[derive(Clone, Debug, Default)]
pub struct InputPathsBuilder {
    text: String,
    ends: Vec<u32>,
}

impl InputPathsBuilder {
    /// Append the address `write` writes (into the shared text, without a string of its own).
    pub fn push_with(&mut self, write: impl FnOnce(&mut String)) {
        write(&mut self.text);
        self.ends
            .push(u32::try_from(self.text.len()).unwrap_or(u32::MAX));
    }

    pub fn push(&mut self, path: &str) {
        self.push_with(|t| t.push_str(path));
    }

    pub fn build(self) -> InputPaths {
        InputPaths {
            text: self.text.into_boxed_str(),
            ends: self.ends.into_boxed_slice(),
        }
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
    target: Option<Arc<str>>,
    error: Option<Box<str>>,
}

/// A cycle's traces, in evaluation order.
#[derive(Clone, Debug, Default)]
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
        target: Option<Arc<str>>,
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
        let extra = match r.bits >> 3 {
            0 => None,
            k => self.extra.get(k as usize - 1),
        };
        let target = extra.and_then(|e| e.target.clone());
        let (target, source) = if r.node == NO_NODE {
            (
                target.unwrap_or_else(|| Arc::from("")),
                Arc::new(TraceSource {
                    expression: Arc::from(""),
                    input_paths: InputPaths::default(),
                }),
            )
        } else {
            (
                target.unwrap_or_else(|| self.table.key(r.node).clone()),
                self.table.source(r.node).clone(),
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
#[derive(Clone, Debug, Default)]
pub struct Paths {
    table: Arc<TraceTable>,
    items: Vec<u32>,
    strs: Vec<Arc<str>>,
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

    pub fn push(&mut self, path: Arc<str>) {
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

impl From<Vec<Arc<str>>> for Paths {
    fn from(v: Vec<Arc<str>>) -> Paths {
        let mut p = Paths::default();
        for s in v {
            p.push(s);
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
        let mut b = InputPathsBuilder::default();
        for p in paths {
            b.push(p);
        }
        b.push_with(|t| t.push_str("$.x"));
        let packed = b.build();
        let mut want = paths.to_vec();
        want.push("$.x");
        assert_eq!(packed.iter().collect::<Vec<_>>(), want);
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
