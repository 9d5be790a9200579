//! The reference interpreter of the IR: what compiled code must compute, operation for
//! operation. `None` is a fallback: some value on the way was not finite (an operand that is
//! Infinity or NaN is a JSONata error, a non-finite result is `null`), and the JSONata
//! interpreter must answer instead.

use crate::helpers;
use crate::ir::{Arith, Cmp, Ir, Math, Program, Ty};

/// A value of the IR.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    Num(f64),
    Bool(bool),
}

impl Value {
    /// The encoding compiled code uses for its result: booleans as 1.0 / 0.0.
    pub fn to_f64(self) -> f64 {
        match self {
            Value::Num(n) => n,
            Value::Bool(b) => f64::from(u8::from(b)),
        }
    }

    /// Decode a compiled result of type `ty`.
    pub fn from_f64(ty: Ty, x: f64) -> Value {
        match ty {
            Ty::Num => Value::Num(x),
            Ty::Bool => Value::Bool(x != 0.0),
        }
    }
}

/// Evaluate `p` over `slots` (one f64 per input, already guarded to be JSON numbers).
pub fn eval(p: &Program, slots: &[f64]) -> Option<Value> {
    match p.ty {
        Ty::Num => num(&p.ir, slots).map(Value::Num),
        Ty::Bool => boolean(&p.ir, slots).map(Value::Bool),
    }
}

/// `eval` where some inputs are *undefined* (a member that is not there): their slots hold
/// NaN, which no JSON number is. JSONata's arithmetic on an undefined operand is undefined, so
/// where only `+ - * / %`, unary minus, `$abs $floor $ceil $sqrt` and `$round` lie between an
/// undefined input and the result, the result is undefined: `Some(None)`. An undefined value
/// reaching anything else (a comparison, a condition, `$power`, `$min`/`$max`), and any
/// non-finite value on the way, is left to the JSONata interpreter: `None`.
pub fn eval_undefined(p: &Program, slots: &[f64]) -> Option<Option<Value>> {
    match p.ty {
        Ty::Num => und(&p.ir, slots).map(|x| x.map(Value::Num)),
        Ty::Bool => boolean(&p.ir, slots).map(|b| Some(Value::Bool(b))),
    }
}

/// A number, undefined (`Some(None)`), or a fallback (`None`).
fn und(ir: &Ir, s: &[f64]) -> Option<Option<f64>> {
    match ir {
        Ir::Slot(i) => {
            let x = s.get(*i as usize).copied()?;
            if x.is_nan() {
                Some(None)
            } else {
                finite(x).map(Some)
            }
        }
        Ir::Neg(a) => Some(und(a, s)?.map(|x| -x)),
        Ir::Arith(op, a, b) => {
            // Both operands are evaluated (an error on either side is the interpreter's).
            let (a, b) = (und(a, s)?, und(b, s)?);
            let (Some(a), Some(b)) = (a, b) else {
                return Some(None);
            };
            finite(arith(*op, a, b)).map(Some)
        }
        Ir::Math(f, a) => match und(a, s)? {
            None => Some(None),
            Some(a) => finite(math(*f, a)).map(Some),
        },
        Ir::Round(a, p) => match und(a, s)? {
            None => Some(None),
            Some(a) => finite(helpers::round(a, *p)).map(Some),
        },
        // An undefined slot below any of these is NaN to `num`: a fallback.
        other => num(other, s).map(Some),
    }
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

fn arith(op: Arith, a: f64, b: f64) -> f64 {
    match op {
        Arith::Add => a + b,
        Arith::Sub => a - b,
        Arith::Mul => a * b,
        Arith::Div => a / b,
        Arith::Rem => helpers::rem(a, b),
    }
}

fn math(f: Math, a: f64) -> f64 {
    match f {
        Math::Abs => a.abs(),
        Math::Floor => a.floor(),
        Math::Ceil => a.ceil(),
        Math::Sqrt => a.sqrt(),
    }
}

fn num(ir: &Ir, s: &[f64]) -> Option<f64> {
    match ir {
        Ir::Const(c) => Some(*c),
        Ir::Slot(i) => s.get(*i as usize).copied().and_then(finite),
        Ir::Neg(a) => Some(-num(a, s)?),
        Ir::Arith(op, a, b) => {
            let (a, b) = (num(a, s)?, num(b, s)?);
            finite(arith(*op, a, b))
        }
        Ir::Cond(c, t, e) => {
            if boolean(c, s)? {
                num(t, s)
            } else {
                num(e, s)
            }
        }
        Ir::Math(f, a) => finite(math(*f, num(a, s)?)),
        Ir::Pow(b, e) => finite(helpers::power(num(b, s)?, num(e, s)?)),
        Ir::Round(a, p) => finite(helpers::round(num(a, s)?, *p)),
        // jsonata-core's scan: start from ∓∞, take a value only when strictly better.
        Ir::Max(v) => {
            let mut m = f64::NEG_INFINITY;
            for x in v {
                let x = num(x, s)?;
                if x > m {
                    m = x;
                }
            }
            Some(m)
        }
        Ir::Min(v) => {
            let mut m = f64::INFINITY;
            for x in v {
                let x = num(x, s)?;
                if x < m {
                    m = x;
                }
            }
            Some(m)
        }
        Ir::Cmp(..) | Ir::And(..) | Ir::Or(..) => None,
    }
}

fn boolean(ir: &Ir, s: &[f64]) -> Option<bool> {
    match ir {
        Ir::Cmp(op, a, b) => {
            let (a, b) = (num(a, s)?, num(b, s)?);
            Some(match op {
                Cmp::Eq => a == b,
                Cmp::Ne => a != b,
                Cmp::Lt => a < b,
                Cmp::Le => a <= b,
                Cmp::Gt => a > b,
                Cmp::Ge => a >= b,
            })
        }
        // Both sides evaluated (compiled code does the same); a bad right side falls back
        // even where JSONata would have short-circuited, which only costs time.
        Ir::And(a, b) => {
            let (a, b) = (boolean(a, s)?, boolean(b, s)?);
            Some(a && b)
        }
        Ir::Or(a, b) => {
            let (a, b) = (boolean(a, s)?, boolean(b, s)?);
            Some(a || b)
        }
        Ir::Cond(c, t, e) => {
            if boolean(c, s)? {
                boolean(t, s)
            } else {
                boolean(e, s)
            }
        }
        _ => None,
    }
}
