//! Dependency extraction from the JSONata AST: which document paths an expression reads, relative
//! to the root or to `$parent`, and which free names it uses. Sound by construction: anything we
//! cannot resolve statically (`$` as a value at the root, `**`, `%`, tuple bindings, `$eval`)
//! makes the expression depend on the whole document. Never evaluates anything.

use std::collections::BTreeSet;

use jsonata_core::ast::{AstNode, BinaryOp, PathStep, Stage};

use crate::value::Key;

/// What a read path is relative to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Root {
    /// The evaluation's input (the merged document for derivations).
    Doc,
    /// `$parent`: the current array element of a `[*]` derivation.
    Parent,
}

/// A read of everything at and below `fields` (member names; arrays are mapped implicitly,
/// as JSONata navigation does).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReadPath {
    pub root: Root,
    pub fields: Vec<Key>,
}

/// Everything an expression reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reads {
    pub paths: BTreeSet<ReadPath>,
    /// The expression may read anything in its input.
    pub whole_doc: bool,
    /// It uses a construct that defeats static tracking (`$eval`, `$lookup`), reported as a
    /// validator warning.
    pub dynamic: bool,
}

type Prefix = Option<(Root, Vec<Key>)>;

/// Run one level of a recursion over a syntax tree, on a stack segment of its own when less
/// than 64 KiB of this thread's stack is left: the parser lets expressions 1,000 levels deep
/// through, more than a 2 MiB thread stack holds for these walks in a debug build.
pub(crate) fn grow<R>(f: impl FnOnce() -> R) -> R {
    stacker::maybe_grow(64 * 1024, 1024 * 1024, f)
}

/// Extract the reads of an expression whose input is the document root.
pub fn reads(ast: &AstNode) -> Reads {
    let mut r = Reads::default();
    let mut w = Walker { out: &mut r };
    w.value(ast, &Some((Root::Doc, Vec::new())));
    r
}

struct Walker<'a> {
    out: &'a mut Reads,
}

impl Walker<'_> {
    fn record(&mut self, p: &Prefix) {
        match p {
            Some((Root::Doc, f)) if f.is_empty() => self.out.whole_doc = true,
            Some((root, f)) => {
                self.out.paths.insert(ReadPath {
                    root: root.clone(),
                    fields: f.clone(),
                });
            }
            None => {}
        }
    }

    /// Walk a node evaluated for its value in context `ctx`; records what it reads.
    fn value(&mut self, node: &AstNode, ctx: &Prefix) {
        grow(|| self.value_at(node, ctx))
    }

    fn value_at(&mut self, node: &AstNode, ctx: &Prefix) {
        match node {
            AstNode::Path { steps } => {
                let end = self.path(steps, ctx);
                self.record(&end);
            }
            AstNode::Name(n) => {
                let p = ctx.as_ref().map(|(r, f)| (r.clone(), extend(f, n)));
                self.record(&p);
            }
            AstNode::Variable(v) => match v.as_str() {
                "" => self.record(ctx),
                "parent" => self.record(&Some((Root::Parent, Vec::new()))),
                _ => {}
            },
            AstNode::ParentVariable(_) => self.out.whole_doc = true,
            AstNode::Wildcard | AstNode::Descendant => self.record(ctx),
            AstNode::Parent(_) => self.out.whole_doc = true,
            AstNode::Binary { op, lhs, rhs } => {
                if *op == BinaryOp::ColonEqual {
                    self.value(rhs, ctx);
                } else {
                    self.value(lhs, ctx);
                    self.value(rhs, ctx);
                }
            }
            AstNode::Unary { operand, .. } => self.value(operand, ctx),
            AstNode::Function { name, args, .. } => {
                if name == "eval" {
                    self.out.dynamic = true;
                    self.record(ctx);
                }
                if name == "lookup" {
                    self.out.dynamic = true;
                }
                for a in args {
                    self.value(a, ctx);
                }
            }
            AstNode::Call { procedure, args } => {
                self.value(procedure, ctx);
                for a in args {
                    self.value(a, ctx);
                }
            }
            AstNode::Lambda { body, .. } => self.value(body, ctx),
            AstNode::Array(items) | AstNode::Block(items) | AstNode::ArrayGroup(items) => {
                for i in items {
                    self.value(i, ctx);
                }
            }
            AstNode::Object(pairs) => {
                for (k, v) in pairs {
                    self.value(k, ctx);
                    self.value(v, ctx);
                }
            }
            AstNode::ObjectTransform { input, pattern } => {
                let elem = self.target(input, ctx);
                self.record(&elem);
                for (k, v) in pattern {
                    self.value(k, &elem);
                    self.value(v, &elem);
                }
            }
            AstNode::Conditional {
                condition,
                then_branch,
                else_branch,
            } => {
                self.value(condition, ctx);
                self.value(then_branch, ctx);
                if let Some(e) = else_branch {
                    self.value(e, ctx);
                }
            }
            AstNode::FunctionApplication(inner) => self.value(inner, ctx),
            AstNode::Sort { input, terms } => {
                let elem = self.target(input, ctx);
                self.record(&elem);
                for (t, _) in terms {
                    self.value(t, &elem);
                }
            }
            AstNode::Transform {
                location,
                update,
                delete,
            } => {
                // A transform is a function applied to an unknown input later: its location and
                // update expressions read that input, not the document. Their own document reads
                // (e.g. through `$$`) are still recorded.
                self.value(location, &None);
                self.value(update, &None);
                if let Some(d) = delete {
                    self.value(d, &None);
                }
            }
            AstNode::String(_)
            | AstNode::Number(_)
            | AstNode::Boolean(_)
            | AstNode::Null
            | AstNode::Undefined
            | AstNode::Placeholder
            | AstNode::Regex { .. } => {}
        }
    }

    /// The static location a node navigates to when used as a path start, walking whatever it
    /// evaluates along the way. `None` when the location is computed.
    fn target(&mut self, node: &AstNode, ctx: &Prefix) -> Prefix {
        grow(|| self.target_at(node, ctx))
    }

    fn target_at(&mut self, node: &AstNode, ctx: &Prefix) -> Prefix {
        match node {
            AstNode::Path { steps } => self.path(steps, ctx),
            AstNode::Name(n) => ctx.as_ref().map(|(r, f)| (r.clone(), extend(f, n))),
            AstNode::Variable(v) if v.is_empty() => ctx.clone(),
            AstNode::Variable(v) if v == "parent" => Some((Root::Parent, Vec::new())),
            AstNode::Variable(_) => None,
            AstNode::ParentVariable(_) => Some((Root::Doc, Vec::new())),
            other => {
                self.value(other, ctx);
                None
            }
        }
    }

    /// Walk path steps starting in `ctx`; returns where the path ends (if static).
    fn path(&mut self, steps: &[PathStep], ctx: &Prefix) -> Prefix {
        if steps
            .iter()
            .any(|s| s.is_tuple || s.focus.is_some() || s.index_var.is_some())
        {
            // Tuple-stream paths (`@$v`, `#$i`, `%`) change what each step navigates from.
            self.out.whole_doc = true;
            for s in steps {
                self.value(&s.node, ctx);
            }
            return None;
        }
        let mut cur: Prefix = None;
        for (i, step) in steps.iter().enumerate() {
            let here = if i == 0 { ctx.clone() } else { cur.clone() };
            cur = match &step.node {
                AstNode::Name(n) => here.as_ref().map(|(r, f)| (r.clone(), extend(f, n))),
                AstNode::String(s) if i > 0 => {
                    here.as_ref().map(|(r, f)| (r.clone(), extend(f, s)))
                }
                AstNode::Variable(v) if i == 0 => match v.as_str() {
                    "" => ctx.clone(),
                    "parent" => Some((Root::Parent, Vec::new())),
                    _ => None,
                },
                AstNode::ParentVariable(_) if i == 0 => Some((Root::Doc, Vec::new())),
                AstNode::Wildcard | AstNode::Descendant => {
                    // Everything below `here` may be read.
                    self.record(&here);
                    None
                }
                AstNode::Parent(_) => {
                    self.out.whole_doc = true;
                    None
                }
                other => {
                    // An opaque step (block, `.(…)`, constructor, call): evaluated per element
                    // of `here`; navigation after it reads its computed result, not the document.
                    // Whatever of `here` it returns is read through `$`, which is recorded.
                    self.value(other, &here);
                    None
                }
            };
            for stage in &step.stages {
                if let Stage::Filter(pred) = stage {
                    match &**pred {
                        AstNode::Number(_) => {}
                        p => self.value(p, &cur),
                    }
                }
            }
            if cur.is_none() && i > 0 {
                // Navigation from a computed value reads nothing more from the document, but
                // later steps may still contain expressions (e.g. `$f().(a)`): walk them.
                for later in &steps[i + 1..] {
                    self.value_in_unknown(later);
                }
                return None;
            }
        }
        cur
    }

    fn value_in_unknown(&mut self, step: &PathStep) {
        match &step.node {
            AstNode::Name(_) | AstNode::String(_) | AstNode::Wildcard | AstNode::Descendant => {}
            other => self.value(other, &None),
        }
        for stage in &step.stages {
            if let Stage::Filter(p) = stage {
                self.value(p, &None);
            }
        }
    }
}

fn extend(f: &[Key], n: &str) -> Vec<Key> {
    let mut v = f.to_vec();
    v.push(crate::value::intern(n));
    v
}

/// Free `$variables` read and `$functions` called, minus names bound inside the expression
/// (`:=`, lambda parameters, `@$`/`#$` bindings). Scope-insensitive: a name bound anywhere in
/// the expression counts as bound everywhere in it.
pub fn free_names(ast: &AstNode) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut vars = BTreeSet::new();
    let mut calls = BTreeSet::new();
    let mut bound = BTreeSet::new();
    names(ast, &mut vars, &mut calls, &mut bound);
    vars.retain(|v| !bound.contains(v));
    calls.retain(|c| !bound.contains(c));
    (vars, calls)
}

/// Point every built-in call `$from(...)` at `$to(...)` instead, at any depth.
pub fn rename_calls(node: &mut AstNode, from: &str, to: &str) {
    visit_mut(node, &mut |n| {
        if let AstNode::Function {
            name, is_builtin, ..
        } = n
        {
            if *is_builtin && name == from {
                *name = to.to_string();
            }
        }
    });
}

/// Call `f` on `node` and then on every node below it, parents before their children.
pub fn visit_mut(node: &mut AstNode, f: &mut impl FnMut(&mut AstNode)) {
    grow(|| visit_mut_at(node, f))
}

fn visit_mut_at(node: &mut AstNode, f: &mut impl FnMut(&mut AstNode)) {
    f(node);
    let mut rec = |n: &mut AstNode| visit_mut(n, f);
    match node {
        AstNode::Function { args, .. } => args.iter_mut().for_each(rec),
        AstNode::Path { steps } => {
            for s in steps {
                for st in &mut s.stages {
                    if let Stage::Filter(p) = st {
                        rec(p);
                    }
                }
                rec(&mut s.node);
            }
        }
        AstNode::Binary { lhs, rhs, .. } => {
            rec(lhs);
            rec(rhs);
        }
        AstNode::Unary { operand, .. } => rec(operand),
        AstNode::Call { procedure, args } => {
            rec(procedure);
            args.iter_mut().for_each(rec);
        }
        AstNode::Lambda { body, .. } => rec(body),
        AstNode::Array(items) | AstNode::Block(items) | AstNode::ArrayGroup(items) => {
            items.iter_mut().for_each(rec)
        }
        AstNode::Object(pairs) => {
            for (k, v) in pairs {
                rec(k);
                rec(v);
            }
        }
        AstNode::ObjectTransform { input, pattern } => {
            rec(input);
            for (k, v) in pattern {
                rec(k);
                rec(v);
            }
        }
        AstNode::Conditional {
            condition,
            then_branch,
            else_branch,
        } => {
            rec(condition);
            rec(then_branch);
            if let Some(e) = else_branch {
                rec(e);
            }
        }
        AstNode::FunctionApplication(inner) => rec(inner),
        AstNode::Sort { input, terms } => {
            rec(input);
            for (t, _) in terms {
                rec(t);
            }
        }
        AstNode::Transform {
            location,
            update,
            delete,
        } => {
            rec(location);
            rec(update);
            if let Some(d) = delete {
                rec(d);
            }
        }
        _ => {}
    }
}

/// Names a library definition binds with `:=` at any depth.
pub fn assigned_names(ast: &AstNode) -> BTreeSet<String> {
    let mut vars = BTreeSet::new();
    let mut calls = BTreeSet::new();
    let mut bound = BTreeSet::new();
    names(ast, &mut vars, &mut calls, &mut bound);
    bound
}

fn names(
    node: &AstNode,
    vars: &mut BTreeSet<String>,
    calls: &mut BTreeSet<String>,
    bound: &mut BTreeSet<String>,
) {
    grow(|| names_at(node, vars, calls, bound))
}

fn names_at(
    node: &AstNode,
    vars: &mut BTreeSet<String>,
    calls: &mut BTreeSet<String>,
    bound: &mut BTreeSet<String>,
) {
    let rec = |n: &AstNode,
               vars: &mut BTreeSet<String>,
               calls: &mut BTreeSet<String>,
               bound: &mut BTreeSet<String>| { names(n, vars, calls, bound) };
    match node {
        AstNode::Variable(v) if !v.is_empty() => {
            vars.insert(v.clone());
        }
        AstNode::Path { steps } => {
            for s in steps {
                if let Some(f) = &s.focus {
                    bound.insert(f.clone());
                }
                if let Some(i) = &s.index_var {
                    bound.insert(i.clone());
                }
                for st in &s.stages {
                    match st {
                        Stage::Filter(p) => rec(p, vars, calls, bound),
                        Stage::Index(v) => {
                            bound.insert(v.clone());
                        }
                        Stage::KeepArray => {}
                    }
                }
                rec(&s.node, vars, calls, bound);
            }
        }
        AstNode::Binary { op, lhs, rhs } => {
            if *op == BinaryOp::ColonEqual {
                if let AstNode::Variable(v) = &**lhs {
                    bound.insert(v.clone());
                }
            }
            rec(lhs, vars, calls, bound);
            rec(rhs, vars, calls, bound);
        }
        AstNode::Unary { operand, .. } => rec(operand, vars, calls, bound),
        AstNode::Function {
            name,
            args,
            is_builtin,
        } => {
            if *is_builtin {
                calls.insert(name.clone());
            }
            for a in args {
                rec(a, vars, calls, bound);
            }
        }
        AstNode::Call { procedure, args } => {
            rec(procedure, vars, calls, bound);
            for a in args {
                rec(a, vars, calls, bound);
            }
        }
        AstNode::Lambda { params, body, .. } => {
            for p in params {
                bound.insert(p.clone());
            }
            rec(body, vars, calls, bound);
        }
        AstNode::Array(items) | AstNode::Block(items) | AstNode::ArrayGroup(items) => {
            for i in items {
                rec(i, vars, calls, bound);
            }
        }
        AstNode::Object(pairs) => {
            for (k, v) in pairs {
                rec(k, vars, calls, bound);
                rec(v, vars, calls, bound);
            }
        }
        AstNode::ObjectTransform { input, pattern } => {
            rec(input, vars, calls, bound);
            for (k, v) in pattern {
                rec(k, vars, calls, bound);
                rec(v, vars, calls, bound);
            }
        }
        AstNode::Conditional {
            condition,
            then_branch,
            else_branch,
        } => {
            rec(condition, vars, calls, bound);
            rec(then_branch, vars, calls, bound);
            if let Some(e) = else_branch {
                rec(e, vars, calls, bound);
            }
        }
        AstNode::FunctionApplication(inner) => rec(inner, vars, calls, bound),
        AstNode::Sort { input, terms } => {
            rec(input, vars, calls, bound);
            for (t, _) in terms {
                rec(t, vars, calls, bound);
            }
        }
        AstNode::Transform {
            location,
            update,
            delete,
        } => {
            rec(location, vars, calls, bound);
            rec(update, vars, calls, bound);
            if let Some(d) = delete {
                rec(d, vars, calls, bound);
            }
        }
        _ => {}
    }
}

/// Whether the expression reads any document field at all (a library may not).
pub fn touches_document(ast: &AstNode) -> bool {
    let r = reads(ast);
    r.whole_doc || r.paths.iter().any(|p| p.root == Root::Doc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonata_core::parser::parse;

    fn paths(e: &str) -> (Vec<String>, bool) {
        let r = reads(&parse(e).unwrap());
        let ps = r
            .paths
            .iter()
            .map(|p| {
                let head = match p.root {
                    Root::Doc => "$",
                    Root::Parent => "$parent",
                };
                let tail: Vec<&str> = p.fields.iter().map(|k| &**k).collect();
                if tail.is_empty() {
                    head.to_string()
                } else {
                    format!("{head}.{}", tail.join("."))
                }
            })
            .collect();
        (ps, r.whole_doc)
    }

    #[test]
    fn simple_fields() {
        assert_eq!(
            paths("price * qty"),
            (vec!["$.price".into(), "$.qty".into()], false)
        );
        assert_eq!(
            paths("$sum(items.total)"),
            (vec!["$.items.total".into()], false)
        );
        assert_eq!(
            paths("$.a.b + $$.c"),
            (vec!["$.a.b".into(), "$.c".into()], false)
        );
    }

    #[test]
    fn parent_and_const() {
        assert_eq!(
            paths("$parent.price * $parent.qty * $const.rate"),
            (vec!["$parent.price".into(), "$parent.qty".into()], false)
        );
    }

    #[test]
    fn predicates_are_element_relative() {
        assert_eq!(
            paths("$sum(items[qty > 0].price)"),
            (vec!["$.items.price".into(), "$.items.qty".into()], false)
        );
        assert_eq!(
            paths("items[0].price"),
            (vec!["$.items.price".into()], false)
        );
    }

    #[test]
    fn blocks_and_wildcards() {
        assert_eq!(
            paths("order.(a + b)"),
            (vec!["$.order.a".into(), "$.order.b".into()], false)
        );
        assert_eq!(paths("order.*"), (vec!["$.order".into()], false));
        assert!(paths("$").1);
        assert!(paths("**.x").1);
        assert!(paths("$keys($)").1);
    }

    #[test]
    fn local_variables_and_lambdas() {
        let (p, whole) = paths("($x := order; $map(items, function($i) { $i.p * $x.rate }))");
        assert_eq!(p, vec!["$.items".to_string(), "$.order".to_string()]);
        assert!(!whole);
        let (vars, calls) = free_names(&parse("($x := 1; $money($x) + $const.a)").unwrap());
        assert_eq!(vars.into_iter().collect::<Vec<_>>(), vec!["const"]);
        assert_eq!(calls.into_iter().collect::<Vec<_>>(), vec!["money"]);
    }
}
