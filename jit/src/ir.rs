//! The typed numeric IR and its lowering from the JSONata AST.
//!
//! The subset: numbers (literals, `$const` numbers, field paths read as *input slots*),
//! `+ - * / %`, unary minus, comparisons (`= != < <= > >=`), `and`/`or`, `c ? a : b`,
//! `$abs $floor $ceil $sqrt`, `$power(x, y)`, `$round(x)` / `$round(x, integer literal)`,
//! `$min`/`$max` over an array literal. Everything else is rejected with the reason, and the
//! expression stays with the interpreter.
//!
//! Slots are numbered in order of first appearance, so `a + b` and `x + y` lower to the same
//! IR: one compiled function serves both (see [`Program::key`]).

use std::fmt::Write as _;

use jsonata_core::ast::{AstNode, BinaryOp, PathStep, UnaryOp};

/// An f64 operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arith {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
}

/// A comparison (its result is a boolean).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// A one-argument math function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Math {
    Abs,
    Floor,
    Ceil,
    Sqrt,
}

/// The type of an IR value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    Num,
    Bool,
}

/// One IR expression.
#[derive(Clone, Debug, PartialEq)]
pub enum Ir {
    Const(f64),
    Slot(u32),
    Neg(Box<Ir>),
    Arith(Arith, Box<Ir>, Box<Ir>),
    Cmp(Cmp, Box<Ir>, Box<Ir>),
    And(Box<Ir>, Box<Ir>),
    Or(Box<Ir>, Box<Ir>),
    /// `c ? t : e`; only the taken branch runs.
    Cond(Box<Ir>, Box<Ir>, Box<Ir>),
    Math(Math, Box<Ir>),
    Pow(Box<Ir>, Box<Ir>),
    Round(Box<Ir>, i32),
    Max(Vec<Ir>),
    Min(Vec<Ir>),
}

impl Ir {
    /// The type of this expression (lowering has checked the operands).
    pub fn ty(&self) -> Ty {
        match self {
            Ir::Cmp(..) | Ir::And(..) | Ir::Or(..) => Ty::Bool,
            Ir::Cond(_, t, _) => t.ty(),
            _ => Ty::Num,
        }
    }

    /// Count of IR nodes (compile-size guard).
    pub fn size(&self) -> usize {
        1 + match self {
            Ir::Const(_) | Ir::Slot(_) => 0,
            Ir::Neg(a) | Ir::Math(_, a) | Ir::Round(a, _) => a.size(),
            Ir::Arith(_, a, b)
            | Ir::Cmp(_, a, b)
            | Ir::And(a, b)
            | Ir::Or(a, b)
            | Ir::Pow(a, b) => a.size() + b.size(),
            Ir::Cond(c, t, e) => c.size() + t.size() + e.size(),
            Ir::Max(v) | Ir::Min(v) => v.iter().map(Ir::size).sum(),
        }
    }

    fn write_key(&self, out: &mut String) {
        match self {
            // Bits, so 0 and -0 differ and every constant has one spelling.
            Ir::Const(c) => {
                let _ = write!(out, "#{:x}", c.to_bits());
            }
            Ir::Slot(s) => {
                let _ = write!(out, "s{s}");
            }
            Ir::Neg(a) => {
                out.push_str("(neg ");
                a.write_key(out);
                out.push(')');
            }
            Ir::Arith(op, a, b) => {
                let _ = write!(out, "({op:?} ");
                a.write_key(out);
                out.push(' ');
                b.write_key(out);
                out.push(')');
            }
            Ir::Cmp(op, a, b) => {
                let _ = write!(out, "({op:?} ");
                a.write_key(out);
                out.push(' ');
                b.write_key(out);
                out.push(')');
            }
            Ir::And(a, b) | Ir::Or(a, b) | Ir::Pow(a, b) => {
                out.push_str(match self {
                    Ir::And(..) => "(and ",
                    Ir::Or(..) => "(or ",
                    _ => "(pow ",
                });
                a.write_key(out);
                out.push(' ');
                b.write_key(out);
                out.push(')');
            }
            Ir::Cond(c, t, e) => {
                out.push_str("(if ");
                c.write_key(out);
                out.push(' ');
                t.write_key(out);
                out.push(' ');
                e.write_key(out);
                out.push(')');
            }
            Ir::Math(f, a) => {
                let _ = write!(out, "({f:?} ");
                a.write_key(out);
                out.push(')');
            }
            Ir::Round(a, p) => {
                out.push_str("(round ");
                a.write_key(out);
                let _ = write!(out, " {p})");
            }
            Ir::Max(v) | Ir::Min(v) => {
                out.push_str(if matches!(self, Ir::Max(_)) {
                    "(max"
                } else {
                    "(min"
                });
                for x in v {
                    out.push(' ');
                    x.write_key(out);
                }
                out.push(')');
            }
        }
    }
}

/// Where an input slot's value comes from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Base {
    /// The evaluation's input (`$`): the document, or the element of a `[*]` scope.
    Input,
    /// `$parent`: the object holding a `[*]` derivation's element.
    Parent,
}

/// The field path an input slot reads: `base.f1.f2…`. It must resolve, through objects
/// only, to a JSON number, or the evaluation falls back to the interpreter.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InputRef {
    pub base: Base,
    pub fields: Vec<String>,
}

/// A lowered expression.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    pub ir: Ir,
    pub ty: Ty,
    /// Slot `i` reads `inputs[i]`.
    pub inputs: Vec<InputRef>,
}

impl Program {
    /// The identity of the compiled code: IR with slots numbered, constants by bits. Two
    /// programs with one key share one compiled function.
    pub fn key(&self) -> String {
        let mut s = String::with_capacity(64);
        let _ = write!(s, "{}:", self.inputs.len());
        self.ir.write_key(&mut s);
        s
    }
}

/// Why an expression is not in the subset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected(pub String);

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The biggest expression the JIT takes (IR nodes); bigger ones stay interpreted.
pub const MAX_NODES: usize = 512;
/// The most input slots a program may read.
pub const MAX_SLOTS: usize = 64;

/// Lower a parsed expression. `constant` resolves `$const.name` to a number (anything else
/// under `$const` is rejected).
pub fn lower(ast: &AstNode, constant: &dyn Fn(&str) -> Option<f64>) -> Result<Program, Rejected> {
    let mut l = Lowering {
        inputs: Vec::new(),
        constant,
        depth: 0,
    };
    let ir = l.expr(ast)?;
    if ir.size() > MAX_NODES {
        return Err(reject(format!(
            "more than {MAX_NODES} operations; left to the interpreter"
        )));
    }
    if l.inputs.len() > MAX_SLOTS {
        return Err(reject(format!("more than {MAX_SLOTS} inputs")));
    }
    Ok(Program {
        ty: ir.ty(),
        ir,
        inputs: l.inputs,
    })
}

fn reject(why: impl Into<String>) -> Rejected {
    Rejected(why.into())
}

struct Lowering<'a> {
    inputs: Vec<InputRef>,
    constant: &'a dyn Fn(&str) -> Option<f64>,
    /// Levels of `expr` now open: lowering, the IR's interpreter and its code generation all
    /// recurse over the tree, so its depth is bounded ([`MAX_DEPTH`]).
    depth: usize,
}

/// The deepest expression the JIT takes (nested operations); deeper ones stay interpreted
/// (the parser allows 1,000 levels, too many for every recursion over the IR on a thread's
/// stack).
pub const MAX_DEPTH: usize = 64;

impl Lowering<'_> {
    fn num(&mut self, node: &AstNode) -> Result<Ir, Rejected> {
        let ir = self.expr(node)?;
        match ir.ty() {
            Ty::Num => Ok(ir),
            Ty::Bool => Err(reject("a boolean where a number is needed")),
        }
    }

    /// A condition: a boolean, or a number (truthy when ≠ 0).
    fn cond(&mut self, node: &AstNode) -> Result<Ir, Rejected> {
        let ir = self.expr(node)?;
        Ok(match ir.ty() {
            Ty::Bool => ir,
            Ty::Num => Ir::Cmp(Cmp::Ne, Box::new(ir), Box::new(Ir::Const(0.0))),
        })
    }

    fn expr(&mut self, node: &AstNode) -> Result<Ir, Rejected> {
        if self.depth >= MAX_DEPTH {
            return Err(reject(format!(
                "nested more than {MAX_DEPTH} levels; left to the interpreter"
            )));
        }
        self.depth += 1;
        let ir = self.expr_at(node);
        self.depth -= 1;
        ir
    }

    fn expr_at(&mut self, node: &AstNode) -> Result<Ir, Rejected> {
        match node {
            AstNode::Number(n) if n.is_finite() => Ok(Ir::Const(*n)),
            AstNode::Block(items) if items.len() == 1 => self.expr(&items[0]),
            AstNode::Path { steps } => self.path(steps),
            AstNode::Name(n) => Ok(self.slot(Base::Input, vec![n.clone()])),
            AstNode::Unary {
                op: UnaryOp::Negate,
                operand,
            } => Ok(Ir::Neg(Box::new(self.num(operand)?))),
            AstNode::Binary { op, lhs, rhs } => self.binary(*op, lhs, rhs),
            AstNode::Conditional {
                condition,
                then_branch,
                else_branch: Some(else_branch),
            } => {
                let c = self.cond(condition)?;
                let t = self.expr(then_branch)?;
                let e = self.expr(else_branch)?;
                if t.ty() != e.ty() {
                    return Err(reject("the branches of `?:` have different types"));
                }
                Ok(Ir::Cond(Box::new(c), Box::new(t), Box::new(e)))
            }
            AstNode::Conditional { .. } => Err(reject("`?` without `:` can be undefined")),
            AstNode::Function {
                name,
                args,
                is_builtin: true,
            } => self.function(name, args),
            other => Err(reject(format!("{} is not arithmetic", describe(other)))),
        }
    }

    fn binary(&mut self, op: BinaryOp, lhs: &AstNode, rhs: &AstNode) -> Result<Ir, Rejected> {
        let arith = |op| -> Option<Arith> {
            Some(match op {
                BinaryOp::Add => Arith::Add,
                BinaryOp::Subtract => Arith::Sub,
                BinaryOp::Multiply => Arith::Mul,
                BinaryOp::Divide => Arith::Div,
                BinaryOp::Modulo => Arith::Rem,
                _ => return None,
            })
        };
        let cmp = |op| -> Option<Cmp> {
            Some(match op {
                BinaryOp::Equal => Cmp::Eq,
                BinaryOp::NotEqual => Cmp::Ne,
                BinaryOp::LessThan => Cmp::Lt,
                BinaryOp::LessThanOrEqual => Cmp::Le,
                BinaryOp::GreaterThan => Cmp::Gt,
                BinaryOp::GreaterThanOrEqual => Cmp::Ge,
                _ => return None,
            })
        };
        if let Some(a) = arith(op) {
            let (l, r) = (self.num(lhs)?, self.num(rhs)?);
            return Ok(Ir::Arith(a, Box::new(l), Box::new(r)));
        }
        if let Some(c) = cmp(op) {
            let (l, r) = (self.num(lhs)?, self.num(rhs)?);
            return Ok(Ir::Cmp(c, Box::new(l), Box::new(r)));
        }
        match op {
            BinaryOp::And | BinaryOp::Or => {
                let (l, r) = (self.cond(lhs)?, self.cond(rhs)?);
                Ok(if op == BinaryOp::And {
                    Ir::And(Box::new(l), Box::new(r))
                } else {
                    Ir::Or(Box::new(l), Box::new(r))
                })
            }
            other => Err(reject(format!("operator {other:?} is not arithmetic"))),
        }
    }

    fn function(&mut self, name: &str, args: &[AstNode]) -> Result<Ir, Rejected> {
        let one = |l: &mut Self, f: Math| -> Result<Ir, Rejected> {
            match args {
                [a] => Ok(Ir::Math(f, Box::new(l.num(a)?))),
                _ => Err(reject(format!("${name} takes one argument here"))),
            }
        };
        match name {
            "abs" => one(self, Math::Abs),
            "floor" => one(self, Math::Floor),
            "ceil" => one(self, Math::Ceil),
            "sqrt" => one(self, Math::Sqrt),
            "power" => match args {
                [b, e] => Ok(Ir::Pow(Box::new(self.num(b)?), Box::new(self.num(e)?))),
                _ => Err(reject("$power takes two arguments")),
            },
            "round" | crate::helpers::ROUND_FN => match args {
                [x] => Ok(Ir::Round(Box::new(self.num(x)?), 0)),
                [x, p] => {
                    let p = literal(p)
                        .filter(|p| p.fract() == 0.0 && p.abs() <= 300.0)
                        .ok_or_else(|| {
                            reject("$round's precision must be an integer literal (|p| ≤ 300)")
                        })?;
                    Ok(Ir::Round(Box::new(self.num(x)?), p as i32))
                }
                _ => Err(reject("$round takes one or two arguments")),
            },
            "max" | "min" => match args {
                [AstNode::Array(items)] if !items.is_empty() => {
                    let v = items
                        .iter()
                        .map(|x| self.num(x))
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok(if name == "max" {
                        Ir::Max(v)
                    } else {
                        Ir::Min(v)
                    })
                }
                _ => Err(reject(format!(
                    "${name} is compiled over a non-empty array literal only"
                ))),
            },
            other => Err(reject(format!("${other} is not in the arithmetic subset"))),
        }
    }

    fn path(&mut self, steps: &[PathStep]) -> Result<Ir, Rejected> {
        let plain = |s: &PathStep| {
            s.stages.is_empty()
                && s.focus.is_none()
                && s.index_var.is_none()
                && s.ancestor_label.is_none()
                && !s.is_tuple
        };
        if !steps.iter().all(plain) {
            return Err(reject("a path with predicates or bindings"));
        }
        let (base, rest) = match steps.split_first() {
            Some((first, rest)) => match &first.node {
                AstNode::Variable(v) if v.is_empty() => (Some(Base::Input), rest),
                AstNode::Variable(v) if v == "parent" => (Some(Base::Parent), rest),
                AstNode::Variable(v) if v == "const" => {
                    return match rest {
                        [PathStep {
                            node: AstNode::Name(n),
                            ..
                        }] => (self.constant)(n)
                            .filter(|c| c.is_finite())
                            .map(Ir::Const)
                            .ok_or_else(|| reject(format!("$const.{n} is not a number"))),
                        _ => Err(reject("a $const path deeper than one field")),
                    };
                }
                AstNode::Variable(v) => return Err(reject(format!("the variable ${v}"))),
                _ => (None, steps),
            },
            None => return Err(reject("an empty path")),
        };
        let mut fields = Vec::with_capacity(rest.len());
        for s in rest {
            match &s.node {
                AstNode::Name(n) => fields.push(n.clone()),
                other => return Err(reject(format!("{} in a path", describe(other)))),
            }
        }
        if fields.is_empty() {
            return Err(reject("a bare `$` or `$parent` is not a number input"));
        }
        Ok(self.slot(base.unwrap_or(Base::Input), fields))
    }

    fn slot(&mut self, base: Base, fields: Vec<String>) -> Ir {
        let r = InputRef { base, fields };
        let i = match self.inputs.iter().position(|x| *x == r) {
            Some(i) => i,
            None => {
                self.inputs.push(r);
                self.inputs.len() - 1
            }
        };
        Ir::Slot(i as u32)
    }
}

/// A numeric literal, with unary minus folded (`-2`).
fn literal(node: &AstNode) -> Option<f64> {
    match node {
        AstNode::Number(n) => Some(*n),
        AstNode::Unary {
            op: UnaryOp::Negate,
            operand,
        } => literal(operand).map(|n| -n),
        AstNode::Block(items) if items.len() == 1 => literal(&items[0]),
        _ => None,
    }
}

fn describe(node: &AstNode) -> &'static str {
    match node {
        AstNode::String(_) => "a string",
        AstNode::Boolean(_) => "a boolean literal",
        AstNode::Null => "null",
        AstNode::Number(_) => "a non-finite number",
        AstNode::Function { .. } => "a function call",
        AstNode::Lambda { .. } => "a lambda",
        AstNode::Array(_) => "an array",
        AstNode::Object(_) | AstNode::ObjectTransform { .. } => "an object",
        AstNode::Block(_) => "a block",
        AstNode::Variable(_) | AstNode::ParentVariable(_) => "a variable",
        AstNode::Wildcard | AstNode::Descendant => "a wildcard",
        _ => "this construct",
    }
}
