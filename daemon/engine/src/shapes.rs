//! Expression shapes: a large spec is mostly one formula written over different names
//! (`price_7 * qty_7`, `price_8 * qty_8`, …). Each derivation's text is scanned into its
//! *skeleton* — the text with every plain member name replaced by a placeholder numbered in
//! order of first use (`#0 * #1`) — and the first text of a skeleton is compiled in full
//! (parsed by jsonata-core, its reads found, lowered to the JIT's IR). Its analysis is kept
//! with the names abstracted, and every later text of the same skeleton is analysed by putting
//! its own names back in: no parse tree is built for it at all.
//!
//! Why that is sound: two texts with one skeleton differ only in the spelling of plain names,
//! so jsonata-core tokenizes them alike and builds the same tree with different names at the
//! same places; the reads and the lowering look at a name only to carry it along (the one
//! exception, `$const.name`, which the lowering resolves to a number, and every name after a
//! `$variable.`, stay literal in the skeleton). The scanner gives up — the text is then
//! compiled in full, as before — on anything it does not follow exactly: string literals,
//! comments, backquoted names, non-ASCII text. Only texts whose full analysis is an arithmetic
//! lowering with plain reads are reused; the differential test compares the two paths.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use valem_jit::ir::{Base, InputRef, Ir, Program, Ty};

use smallvec::SmallVec;
use valem_core::expr::deps::{Reads, Root};

use valem_core::value::{intern, Key};

/// The names of an instance of a shape.
pub(crate) type Keys = SmallVec<[Key; 4]>;

/// Keywords and literals that look like names: kept literal in a skeleton.
const WORDS: &[&str] = &["and", "or", "in", "true", "false", "null", "function"];

/// A name in an analysis: the text's `i`-th distinct plain name, or one kept literal.
#[derive(Clone, Debug)]
enum Name {
    Nth(usize),
    Lit(Key),
}

/// What a full compile of a skeleton's first text found, with its names abstracted.
#[derive(Debug)]
pub(crate) struct Shape {
    ir: Ir,
    ty: Ty,
    key: String,
    inputs: Vec<(Base, Vec<Name>)>,
    reads: Vec<(Root, Vec<Name>)>,
}

/// A text's skeleton and its distinct plain names in order of first use.
#[derive(Debug, PartialEq)]
pub(crate) struct Skeleton<'a> {
    pub text: String,
    pub names: Vec<&'a str>,
    /// Names kept literal (keywords excepted).
    literal: Vec<&'a str>,
}

fn is_name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}

fn is_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The skeleton of `text`, or `None` when it holds anything the scanner does not follow.
pub(crate) fn skeleton(text: &str) -> Option<Skeleton<'_>> {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut names: Vec<&str> = Vec::new();
    let mut literal: Vec<&str> = Vec::new();
    // Inside `$var.a.b`: names after the dots stay literal.
    let mut chain = false;
    let mut after_dot = false;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            out.push(c as char);
            i += 1;
            continue;
        }
        if c == b'$' {
            let start = i;
            i += 1;
            while i < b.len() && is_name_char(b[i]) {
                i += 1;
            }
            out.push_str(&text[start..i]);
            chain = true;
            after_dot = false;
            continue;
        }
        if is_name_start(c) {
            let start = i;
            while i < b.len() && is_name_char(b[i]) {
                i += 1;
            }
            let name = &text[start..i];
            if WORDS.contains(&name) {
                out.push_str(name);
                chain = false;
            } else if chain && after_dot {
                out.push_str(name);
                literal.push(name);
            } else {
                let n = match names.iter().position(|x| *x == name) {
                    Some(n) => n,
                    None => {
                        names.push(name);
                        names.len() - 1
                    }
                };
                let _ = write!(out, "#{n}");
                chain = false;
            }
            after_dot = false;
            continue;
        }
        if c.is_ascii_digit() {
            // Numbers are kept as written (the lowering bakes them into the code).
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                // `1e-5`: the sign after an exponent belongs to the number.
                if (b[i] == b'e' || b[i] == b'E')
                    && i + 1 < b.len()
                    && (b[i + 1] == b'-' || b[i + 1] == b'+')
                {
                    i += 1;
                }
                i += 1;
            }
            out.push_str(&text[start..i]);
            chain = false;
            after_dot = false;
            continue;
        }
        match c {
            b'/' if b.get(i + 1) == Some(&b'*') => return None,
            b'.' => {
                after_dot = true;
                out.push('.');
            }
            b'+' | b'-' | b'*' | b'/' | b'%' | b'(' | b')' | b'<' | b'>' | b'=' | b'!' | b'?'
            | b':' | b',' | b'&' | b'[' | b']' | b'{' | b'}' | b';' => {
                out.push(c as char);
                chain = false;
                after_dot = false;
            }
            _ => return None,
        }
        i += 1;
    }
    // A name both literal and plain: its uses cannot be told apart in the analysis.
    if literal.iter().any(|l| names.contains(l)) {
        return None;
    }
    Some(Skeleton {
        text: out,
        names,
        literal,
    })
}

impl Shape {
    /// Abstract a full analysis of `sk`'s text; `None` when it is not one this module reuses
    /// (no lowering, a whole-document or dynamic read, a name it cannot place).
    pub(crate) fn of(
        sk: &Skeleton<'_>,
        program: &Program,
        key: &str,
        reads: &Reads,
    ) -> Option<Shape> {
        if reads.whole_doc || reads.dynamic {
            return None;
        }
        let place = |f: &str| -> Option<Name> {
            if let Some(n) = sk.names.iter().position(|x| *x == f) {
                Some(Name::Nth(n))
            } else if sk.literal.contains(&f) {
                Some(Name::Lit(intern(f)))
            } else {
                None
            }
        };
        let fields = |fs: &mut dyn Iterator<Item = &str>| fs.map(place).collect::<Option<Vec<_>>>();
        let inputs = program
            .inputs
            .iter()
            .map(|r| {
                Some((
                    r.base.clone(),
                    fields(&mut r.fields.iter().map(|f| f.as_str()))?,
                ))
            })
            .collect::<Option<Vec<_>>>()?;
        let reads = reads
            .paths
            .iter()
            .map(|r| Some((r.root.clone(), fields(&mut r.fields.iter().map(|f| &**f))?)))
            .collect::<Option<Vec<_>>>()?;
        Some(Shape {
            ir: program.ir.clone(),
            ty: program.ty,
            key: key.to_string(),
            inputs,
            reads,
        })
    }

    /// The names of a text of this shape whose plain names are `names`, interned: what an
    /// instance is made from.
    pub(crate) fn keys(names: &[&str]) -> Keys {
        names.iter().map(|n| intern(n)).collect()
    }

    fn name_ref<'a>(keys: &'a [Key], n: &'a Name) -> &'a Key {
        match n {
            Name::Nth(i) => &keys[*i],
            Name::Lit(k) => k,
        }
    }

    fn name(keys: &[Key], n: &Name) -> Key {
        match n {
            Name::Nth(i) => keys[*i].clone(),
            Name::Lit(k) => k.clone(),
        }
    }

    /// The key of the shape's lowering (the same for every instance).
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// The reads of the instance of `keys`, given to `f` one by one in the order a [`Reads`]
    /// set would give them (no set is built, and a read of one name, the usual one, is given
    /// the instance's own key: this is done for every derivation).
    pub(crate) fn for_each_read(&self, keys: &[Key], mut f: impl FnMut(&Root, &[Key])) {
        let names = |i: usize| self.reads[i].1.iter().map(|n| &**Shape::name_ref(keys, n));
        let cmp = |&a: &usize, &b: &usize| {
            let root = |i: usize| &self.reads[i].0;
            root(a).cmp(root(b)).then_with(|| names(a).cmp(names(b)))
        };
        let mut order: SmallVec<[usize; 8]> = (0..self.reads.len()).collect();
        order.sort_unstable_by(cmp);
        order.dedup_by(|a, b| cmp(a, b).is_eq());
        for i in order {
            let (root, fields) = &self.reads[i];
            match &fields[..] {
                [one] => f(root, std::slice::from_ref(Shape::name_ref(keys, one))),
                more => {
                    let fields: Keys = more.iter().map(|n| Shape::name(keys, n)).collect();
                    f(root, &fields);
                }
            }
        }
    }

    /// The lowering of the instance of `keys`.
    pub(crate) fn program(&self, keys: &[Key]) -> Program {
        Program {
            ir: self.ir.clone(),
            ty: self.ty,
            inputs: self
                .inputs
                .iter()
                .map(|(base, fields)| InputRef {
                    base: base.clone(),
                    fields: fields
                        .iter()
                        .map(|f| Shape::name(keys, f).to_string())
                        .collect(),
                })
                .collect(),
        }
    }

    /// Where the slots of the instance of `keys` read: what [`super::jit::NodeJit::new`]
    /// gives for its program, without making the program.
    pub(crate) fn slot_inputs(&self, keys: &[Key]) -> SmallVec<[super::jit::SlotInput; 2]> {
        self.inputs
            .iter()
            .map(|(base, fields)| match (base, &fields[..]) {
                // The common read, one member of the input: no path made and dropped.
                (Base::Input, [one]) => super::jit::member_input(Shape::name(keys, one)),
                _ => {
                    let path = fields
                        .iter()
                        .map(|f| valem_core::value::Seg::Field(Shape::name(keys, f)))
                        .collect();
                    super::jit::slot_input(base, path)
                }
            })
            .collect()
    }
}

/// Shapes met so far in one compile (one per thread of it): skeleton → its shape, or `None`
/// for a skeleton whose first text was not reusable.
#[derive(Default)]
pub(crate) struct Shapes {
    by_skeleton: HashMap<String, Option<Arc<Shape>>>,
}

impl Shapes {
    pub(crate) fn get(&self, sk: &Skeleton<'_>) -> Option<Option<Arc<Shape>>> {
        self.by_skeleton.get(&sk.text).cloned()
    }

    pub(crate) fn put(&mut self, sk: Skeleton<'_>, shape: Option<Shape>) {
        self.by_skeleton.insert(sk.text, shape.map(Arc::new));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skeletons_number_names_and_keep_the_rest() {
        let s = skeleton("price_7 * qty_7 + price_7").unwrap();
        assert_eq!(s.text, "#0 * #1 + #0");
        assert_eq!(s.names, vec!["price_7", "qty_7"]);
        let s = skeleton("$round(a.b * $const.rate, 2) > 1e-5 and x").unwrap();
        assert_eq!(s.text, "$round(#0.#1 * $const.rate, 2) > 1e-5 and #2");
        assert_eq!(s.names, vec!["a", "b", "x"]);
        let s = skeleton("$parent.price * $parent.qty").unwrap();
        assert_eq!(s.text, "$parent.price * $parent.qty");
        assert!(s.names.is_empty());
        for give_up in [
            "a & \"x\"",
            "`a b` * 2",
            "a /* c */ * 2",
            "prix_€ * 2",
            "a # $i",
            "$parent.a * a",
        ] {
            assert_eq!(skeleton(give_up), None, "{give_up}");
        }
    }
}
