//! Size checks in front of the JSONata built-ins whose one call can make far more than its
//! arguments hold: `$pad` (a width), `$join` (n separators), `$split` (one piece per
//! character), `$replace` (a replacement per match) and `$string` (a value that shares its parts
//! serialised whole). Each is checked before the built-in runs, then the built-in itself does
//! the work, so answers and errors are jsonata-core's own. What grows step by step (a string
//! doubled in a loop, a mapping) is bound by the evaluation's memory budget instead
//! (`allocator::watch`).
//!
//! How calls reach the checks: at parse, a call `$pad(a, b)` of the built-in (the name not bound
//! by the expression itself) is rewritten to `$__valem_pad($, a, b)`, which hands the check the
//! call's context as well (a built-in called as `name.$pad(5)` pads the context); the check then
//! evaluates `$pad($a0, $a1)` against that context, in an evaluator of its own. The right side
//! of `~>` (which hands the call its first argument) and a reference to the function as a value
//! (`$map(xs, $string)`) go to the same check without the context, the latter through a binding
//! of the name. `$eval` is checked the same way: its text is parsed and evaluated by our own
//! wrapper ([`super::Compiled`]), so its calls are rewritten too; it sees the expression's
//! bindings (`$const`, the library, `$parent`) but not variables the calling expression bound
//! with `:=` (jsonata-js evaluates it in the caller's scope).

use std::collections::HashMap;
use std::rc::Rc;

use jsonata_core::ast::AstNode;
use jsonata_core::evaluator::{Context, Evaluator, EvaluatorError};
use jsonata_core::functions::string::{build_regex, RegexMatches};
use jsonata_core::parser;
use jsonata_core::value::JValue;

use super::Limits;

/// The built-ins checked.
pub const GUARDED: [&str; 6] = ["pad", "join", "split", "replace", "string", "eval"];

/// What the checks need of [`Limits`] (the closures the evaluator keeps must own it).
#[derive(Clone, Copy, Debug)]
pub struct Caps {
    /// Longest string one call may make, in bytes.
    pub string_bytes: usize,
    /// Memory one call may allocate for the pieces of an array it makes, in bytes.
    pub memory_bytes: usize,
}

impl Caps {
    pub fn of(limits: &Limits) -> Caps {
        Caps {
            string_bytes: limits.max_string_bytes,
            memory_bytes: limits.memory_bytes,
        }
    }
}

/// The host function a rewritten call goes to (its first argument the call's context).
pub fn call_name(builtin: &str) -> String {
    format!("__valem_{builtin}")
}

/// The host function a bound name (a reference, a call in `$eval`) goes to.
pub fn value_name(builtin: &str) -> String {
    format!("__valem_{builtin}_v")
}

/// The built-in a node calls, when it is a checked one the expression does not bind itself.
fn checked_call<'n>(
    node: &'n mut AstNode,
    bound: &std::collections::BTreeSet<String>,
) -> Option<(&'static str, &'n mut String, &'n mut Vec<AstNode>)> {
    let AstNode::Function {
        name,
        args,
        is_builtin: true,
    } = node
    else {
        return None;
    };
    let &g = GUARDED.iter().find(|g| **g == name.as_str())?;
    (!bound.contains(g)).then_some((g, name, args))
}

/// Rewrite every call of a checked built-in in `node` (see the module doc); `bound` are names
/// the expression binds itself (a `$string := function…` is its own). Returns the names whose
/// calls were rewritten, and whether a call went to a value form (`~>`).
pub fn rewrite_calls(
    node: &mut AstNode,
    bound: &std::collections::BTreeSet<String>,
) -> (std::collections::BTreeSet<&'static str>, bool) {
    let mut rewritten = std::collections::BTreeSet::new();
    let mut piped = false;
    super::deps::visit_mut(node, &mut |n| {
        if let AstNode::Binary {
            op: jsonata_core::ast::BinaryOp::ChainPipe,
            rhs,
            ..
        } = n
        {
            // `x ~> $join(", ")` hands the call `x` as its first argument: no context.
            if let Some((g, name, _)) = checked_call(rhs, bound) {
                *name = value_name(g);
                rewritten.insert(g);
                piped = true;
            }
        } else if let Some((g, name, args)) = checked_call(n, bound) {
            *name = call_name(g);
            args.insert(0, AstNode::Variable(String::new()));
            rewritten.insert(g);
        }
    });
    (rewritten, piped)
}

/// What a check needs to make the call: the limits, and for `$eval` the bindings.
#[derive(Clone)]
pub struct Scope {
    pub env: super::Env,
    pub limits: Limits,
}

/// Register the checked functions on `ev`: the call forms when `calls`, the value forms when
/// `values` (see [`bind_values`] for the names).
pub fn install(ev: &mut Evaluator, scope: &Rc<Scope>, calls: bool, values: bool) {
    for name in GUARDED {
        if calls {
            let scope = scope.clone();
            let _ = ev.register_fn(call_name(name), move |args: &[JValue]| {
                let (focus, rest) = args.split_first().unwrap_or((&JValue::Undefined, &[]));
                checked(name, focus, rest, &scope)
            });
        }
        if values {
            let scope = scope.clone();
            let _ = ev.register_fn(value_name(name), move |args: &[JValue]| {
                checked(name, &JValue::Undefined, callback_args(name, args), &scope)
            });
        }
    }
}

/// The arguments a built-in passed as a function value takes of those it is handed: a
/// higher-order function hands its callback the value, the index and the array (`$map`), or the
/// value and the key (`$each`), and jsonata-js cuts them to the parameters its function
/// declares (`$string`'s one, where a direct call may add `prettify`). A direct call never
/// hands more than the signature allows, so more than that, or a `$string` second argument
/// that is no boolean, is a callback's.
fn callback_args<'a>(name: &str, args: &'a [JValue]) -> &'a [JValue] {
    let (most, declared) = match name {
        "pad" => (3, 3),
        "join" => (2, 2),
        "split" => (3, 3),
        "replace" => (4, 4),
        "string" => (2, 1),
        _ => return args,
    };
    let callback = args.len() > most
        || (name == "string" && args.get(1).is_some_and(|p| !matches!(p, JValue::Bool(_))));
    if callback {
        &args[..declared.min(args.len())]
    } else {
        args
    }
}

/// Bind the built-ins' names to their checked value forms (see [`install`]), but those `env`
/// binds (a library export is itself).
pub fn bind_values(ctx: &mut Context, env: &super::Env) {
    for name in GUARDED.into_iter().filter(|g| !env.binds(g)) {
        ctx.bind(
            name.to_string(),
            JValue::Builtin {
                name: Rc::from(value_name(name).as_str()),
            },
        );
    }
}

/// Check a call of `name` with `args` in context `focus`, then make it.
fn checked(
    name: &str,
    focus: &JValue,
    args: &[JValue],
    scope: &Scope,
) -> Result<JValue, EvaluatorError> {
    if name == "eval" {
        return eval_text(focus, args, scope);
    }
    let caps = Caps::of(&scope.limits);
    // The arguments the built-in will see: the context first when the call leaves out its
    // first argument (the built-ins' `-` signatures), for the size check only.
    let with_focus;
    let seen: &[JValue] = match (name, args.first()) {
        ("pad" | "split" | "replace", Some(JValue::String(_))) | ("join" | "string", _) => args,
        _ if matches!(focus, JValue::Undefined) => args,
        _ => {
            with_focus = std::iter::once(focus.clone())
                .chain(args.iter().cloned())
                .collect::<Vec<_>>();
            &with_focus
        }
    };
    let seen = if name == "string" && args.is_empty() {
        std::slice::from_ref(focus)
    } else {
        seen
    };
    if let Some(why) = too_big(name, seen, caps) {
        return Err(EvaluatorError::EvaluationError(why));
    }
    delegate(name, focus, args)
}

/// `$eval(text[, context])` through our own wrapper (see the module doc), with jsonata-core's
/// error codes: D3120 for a text that does not parse, D3121 for an unknown function in it.
fn eval_text(focus: &JValue, args: &[JValue], scope: &Scope) -> Result<JValue, EvaluatorError> {
    let text = match args.first() {
        None | Some(JValue::Undefined) => return Ok(JValue::Undefined),
        Some(JValue::String(s)) => s.clone(),
        Some(_) => {
            return Err(EvaluatorError::EvaluationError(
                "T0410: Argument 1 of function $eval must be a string".to_string(),
            ))
        }
    };
    let compiled = super::Compiled::compile(&text, &scope.limits).map_err(|e| {
        EvaluatorError::EvaluationError(format!(
            "D3120: The expression passed to $eval cannot be parsed: {}",
            e.message
        ))
    })?;
    let input = match args.get(1) {
        Some(c) if !c.is_undefined() => c.clone().into_outer_wrapper(),
        _ => focus.clone(),
    };
    match compiled.eval(&input, &scope.env, &scope.limits) {
        Ok(v) => Ok(v.unwrap_or(JValue::Undefined)),
        Err(e) => {
            let m = e.message;
            let unknown = m.starts_with("D3121") || m.contains("T1005") || m.contains("T1006");
            Err(EvaluatorError::EvaluationError(if unknown {
                format!("D3121: {m}")
            } else {
                m
            }))
        }
    }
}

/// Why the call would make too much, if it would.
fn too_big(name: &str, args: &[JValue], caps: Caps) -> Option<String> {
    let limit = caps.string_bytes;
    let over = |what: String| {
        Some(format!(
            "${name}: {what}, more than the limit of {limit} bytes"
        ))
    };
    match name {
        "pad" => {
            let (JValue::Number(width), fill) = (args.get(1)?, args.get(2)) else {
                return None;
            };
            let char_bytes = match fill {
                Some(JValue::String(f)) => f.chars().map(char::len_utf8).max().unwrap_or(1),
                _ => 1,
            };
            let bytes = width.abs() * char_bytes as f64;
            (bytes > limit as f64)
                .then(|| format!("padding to {width} characters"))
                .and_then(over)
        }
        "join" => {
            let sep = match args.get(1) {
                Some(JValue::String(s)) => s.len(),
                _ => 0,
            };
            let JValue::Array(items) = args.first()? else {
                return None;
            };
            let mut total = sep.saturating_mul(items.len().saturating_sub(1));
            for it in items.iter() {
                if let JValue::String(s) = it {
                    total = total.saturating_add(s.len());
                }
            }
            (total > limit)
                .then(|| format!("joining into {total} bytes"))
                .and_then(over)
        }
        "split" => {
            let JValue::String(s) = args.first()? else {
                return None;
            };
            let mut pieces = match args.get(1)? {
                JValue::String(sep) if sep.is_empty() => s.chars().count(),
                JValue::String(sep) => s.matches(&**sep).count() + 1,
                _ => s.chars().count() + 1,
            };
            if let Some(JValue::Number(n)) = args.get(2) {
                if *n >= 0.0 && *n < pieces as f64 {
                    pieces = *n as usize;
                }
            }
            // Each piece is a value and a string of its own: about 64 bytes at least.
            let bytes = pieces.saturating_mul(64);
            (bytes > caps.memory_bytes).then(|| {
                format!(
                    "$split: {pieces} pieces, more than one evaluation may hold ({} bytes)",
                    caps.memory_bytes
                )
            })
        }
        "replace" => {
            let JValue::String(s) = args.first()? else {
                return None;
            };
            let JValue::String(rep) = args.get(2)? else {
                // A function makes each replacement: the memory budget binds it.
                return None;
            };
            let limit_n = match args.get(3) {
                Some(JValue::Number(n)) if *n >= 0.0 => Some(*n as usize),
                _ => None,
            };
            let bytes = replaced_bytes(s, args.get(1)?, rep, limit_n, limit)?;
            (bytes > limit)
                .then(|| format!("replacing into {bytes} bytes or more"))
                .and_then(over)
        }
        "string" => {
            let prettify = matches!(args.get(1), Some(JValue::Bool(true)));
            let v = args.first()?;
            matches!(v, JValue::Array(_) | JValue::Object(_))
                .then(|| serialised_over(v, prettify, limit))
                .flatten()
                .map(|n| format!("serialising {n} bytes or more"))
                .and_then(over)
        }
        _ => None,
    }
}

/// An upper bound of `$replace(s, pattern, rep, limit)`'s length, or `None` when the call is
/// malformed (the built-in reports it). A regex's matches are counted only when the cheap bound
/// (every character a match) exceeds `cap`.
fn replaced_bytes(
    s: &str,
    pattern: &JValue,
    rep: &str,
    limit: Option<usize>,
    cap: usize,
) -> Option<usize> {
    let cap_at = |n: usize| limit.map_or(n, |l| n.min(l));
    if let JValue::String(pat) = pattern {
        if pat.is_empty() {
            return None;
        }
        let count = cap_at(s.matches(&**pat).count());
        return Some(s.len().saturating_add(count.saturating_mul(rep.len())));
    }
    // A regex: `$0`, `$1`… in the replacement copy the match or a group of it (at most the
    // match's length each).
    let refs = rep.matches('$').count();
    let per_match = |len: usize| rep.len().saturating_add(refs.saturating_mul(len));
    let rough = s
        .len()
        .saturating_add(cap_at(s.chars().count() + 1).saturating_mul(per_match(s.len())));
    if rough <= cap {
        return Some(rough);
    }
    let JValue::Regex { pattern, flags } = pattern else {
        return None;
    };
    let re = build_regex(pattern, flags).ok()?;
    let mut matches = RegexMatches::new(&re, s);
    let mut total = s.len();
    let mut count = 0;
    while let Ok(Some(m)) = matches.next_match() {
        if limit.is_some_and(|l| count >= l) {
            break;
        }
        count += 1;
        total = total.saturating_add(per_match(m.text.len()));
        if total > cap {
            break;
        }
    }
    Some(total)
}

/// Whether serialising `v` (following shared parts every time they occur) passes `cap` bytes:
/// the size reached when it does, walked with a stack of its own and stopped there.
fn serialised_over(v: &JValue, prettify: bool, cap: usize) -> Option<usize> {
    let mut total = 0usize;
    let mut stack: Vec<(&JValue, usize)> = vec![(v, 0)];
    while let Some((v, depth)) = stack.pop() {
        let indent = if prettify { 2 * depth + 1 } else { 0 };
        total = total.saturating_add(indent + 1);
        match v {
            JValue::String(s) => total = total.saturating_add(s.len() + 2),
            JValue::Number(_) => total = total.saturating_add(8),
            JValue::Array(a) => stack.extend(a.iter().map(|x| (x, depth + 1))),
            JValue::Object(o) => {
                for (k, x) in o.iter() {
                    total = total.saturating_add(k.len() + 3);
                    stack.push((x, depth + 1));
                }
            }
            _ => total = total.saturating_add(4),
        }
        if total > cap {
            return Some(total);
        }
    }
    None
}

thread_local! {
    /// `$name($a0, …)` parsed once per built-in and argument count.
    static CALLS: std::cell::RefCell<HashMap<(&'static str, usize), Rc<AstNode>>> =
        std::cell::RefCell::new(HashMap::new());
}

/// Make the call of the built-in `name` with `args`, in context `focus`, in an evaluator of its
/// own (where the name means the built-in).
fn delegate(name: &str, focus: &JValue, args: &[JValue]) -> Result<JValue, EvaluatorError> {
    let Some(&name) = GUARDED.iter().find(|g| **g == name && **g != "eval") else {
        return Err(EvaluatorError::EvaluationError(format!(
            "${name} is not a checked function"
        )));
    };
    let ast = CALLS.with(|c| -> Result<Rc<AstNode>, EvaluatorError> {
        if let Some(a) = c.borrow().get(&(name, args.len())) {
            return Ok(a.clone());
        }
        let params: Vec<String> = (0..args.len()).map(|i| format!("$a{i}")).collect();
        let text = format!("${name}({})", params.join(", "));
        let ast = Rc::new(
            parser::parse(&text).map_err(|e| EvaluatorError::EvaluationError(e.to_string()))?,
        );
        c.borrow_mut().insert((name, args.len()), ast.clone());
        Ok(ast)
    })?;
    let mut ctx = Context::new();
    for (i, a) in args.iter().enumerate() {
        ctx.bind(format!("a{i}"), a.clone());
    }
    Evaluator::with_context(ctx).evaluate(&ast, focus)
}
