//! JSONata behind our own wrapper: compile once, evaluate with limits and Valem's bindings
//! (`$const`, `$parent`, `$self`, library exports, `$now`/`$millis` pinned per cycle), classify
//! errors by JSONata code and position. The rest of the code never names the engine crate.
//! Never does I/O; the only clock read is the engine's own evaluation-timeout guard.

pub mod deps;
pub mod guard;
pub mod path;

use std::collections::BTreeSet;
use std::ops::ControlFlow;
use std::rc::Rc;
use std::sync::Arc;

use indexmap::IndexMap;
use jsonata_core::ast::AstNode;
use jsonata_core::evaluator::{CancelToken, Context, Evaluator, EvaluatorError, EvaluatorOptions};
use jsonata_core::parser::{self, ParserError};
use jsonata_core::value::{JArray, JValue};
use serde_json::Value as Json;

use crate::value::{num_to_json, ObjMap, TooDeep, Val, MAX_DEPTH};

pub use jsonata_core::value::JValue as Value;

/// Limits applied to every evaluation (the reference's `expression-timeout-ms` is 2000).
#[derive(Clone, Debug)]
pub struct Limits {
    pub timeout_ms: Option<u64>,
    pub max_depth: Option<usize>,
    pub max_sequence: Option<usize>,
    /// Longest expression text accepted, in bytes.
    pub max_expr_len: usize,
    /// Longest string an evaluation may make in one step (`$pad`, `$join`, `$replace`,
    /// `$string`, …, checked before the string is made) or return, in bytes.
    pub max_string_bytes: usize,
    /// Most values (each scalar, array and object) a result may hold once converted: an
    /// engine value shares its parts, so a small one can stand for a huge document.
    pub max_output_values: usize,
    /// Memory one evaluation may hold beyond what its thread held when it started, in bytes:
    /// past it the evaluation is stopped (counted by the binary's allocator,
    /// [`crate::budget::Counting`]; not enforced where that is not the global allocator).
    pub memory_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout_ms: Some(2000),
            max_depth: None,
            max_sequence: Some(10_000_000),
            max_expr_len: 100_000,
            max_string_bytes: 32 << 20,
            max_output_values: 4_000_000,
            memory_bytes: 256 << 20,
        }
    }
}

impl Limits {
    fn options(&self, cancel: CancelToken) -> EvaluatorOptions {
        EvaluatorOptions {
            timeout_ms: self.timeout_ms,
            cancel: Some(cancel),
            max_stack_depth: self.max_depth,
            max_sequence_length: self.max_sequence,
        }
    }
}

/// Which phase failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Compile,
    Evaluate,
}

/// A compile or evaluation error with its JSONata code (`S0201`, `T2001`, …) when it has one,
/// and, for compile errors, the 0-based character offset of the offending token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ExprError {
    pub phase: Phase,
    pub code: Option<String>,
    pub message: String,
    pub position: Option<usize>,
}

impl ExprError {
    fn compile(text: &str, e: &ParserError) -> ExprError {
        let message = e.to_string();
        let message = message
            .strip_prefix("Invalid syntax: ")
            .unwrap_or(&message)
            .to_string();
        // The engine's unclosed-comment error carries no code; JSONata's is S0106.
        let code = find_code(&message)
            .or_else(|| matches!(e, ParserError::UnclosedComment).then(|| "S0106".to_string()));
        ExprError {
            phase: Phase::Compile,
            code,
            position: Some(error_position(text, e)),
            message,
        }
    }

    fn evaluate(e: &EvaluatorError) -> ExprError {
        let message = e.message().to_string();
        ExprError {
            phase: Phase::Evaluate,
            code: find_code(&message),
            message,
            position: None,
        }
    }

    /// An evaluation stopped by one of [`Limits`]' caps.
    pub fn limit(message: String) -> ExprError {
        ExprError {
            phase: Phase::Evaluate,
            code: None,
            message,
            position: None,
        }
    }

    /// `" at position N"` when the error has a position, else empty (for messages).
    pub fn at(&self) -> String {
        self.position
            .map(|p| format!(" at position {p}"))
            .unwrap_or_default()
    }

    /// The machine shape used by `valem eval --json` and `eval_expression`.
    pub fn to_json(&self) -> Json {
        let mut m = serde_json::Map::new();
        m.insert(
            "code".into(),
            self.code.clone().map_or(Json::Null, Json::String),
        );
        m.insert("message".into(), Json::String(self.message.clone()));
        if let Some(p) = self.position {
            m.insert("position".into(), Json::from(p));
        }
        Json::Object(m)
    }
}

/// The first JSONata error code (`[STDU]dddd`) anywhere in a message.
pub fn find_code(message: &str) -> Option<String> {
    let b = message.as_bytes();
    (0..b.len().saturating_sub(4)).find_map(|i| {
        let ok = matches!(b[i], b'S' | b'T' | b'D' | b'U')
            && b[i + 1..i + 5].iter().all(u8::is_ascii_digit)
            && (i == 0 || !b[i - 1].is_ascii_alphanumeric())
            && b.get(i + 5).is_none_or(|c| !c.is_ascii_alphanumeric());
        ok.then(|| message[i..i + 5].to_string())
    })
}

/// A compiled expression. The AST is parsed once; evaluation picks the bytecode VM when no
/// binding is needed and the tree-walker otherwise (bindings need it).
pub struct Compiled {
    pub text: arcstr::ArcStr,
    expression: jsonata_core::Expression,
    /// Free `$variables` the expression reads (without `$`).
    pub vars: BTreeSet<String>,
    /// Function names it calls as `$name(...)`.
    pub calls: BTreeSet<String>,
    /// Its `$round(...)` calls go to [`JS_ROUND`] (see [`js_round`]).
    js_round: bool,
    /// What [`guard`] changed: see [`Guards`].
    guards: Guards,
}

/// The checked built-ins of an expression ([`guard`]).
#[derive(Clone, Debug, Default)]
struct Guards {
    /// The built-ins whose calls were rewritten to their checks.
    calls: BTreeSet<&'static str>,
    /// Some of those calls go to the checks' value forms (the right side of `~>`).
    piped: bool,
    /// The tree as parsed, kept when calls were rewritten: evaluated instead where the
    /// environment binds one of those names (a library export named `pad` is not `$pad`).
    unguarded: Option<Box<AstNode>>,
    /// It refers to a checked built-in as a value (`$map(xs, $string)`) or calls `$eval`: the
    /// names are bound to their checks while it runs.
    values: bool,
}

/// The name `$round(...)` calls are renamed to: jsonata-core's own `$round` scales by a power of
/// ten and treats anything within 1e-10 of .5 as a tie, where jsonata-js (the reference) rounds
/// half to even on the decimal string; and the JIT must compute what the interpreter does. Both
/// use `valem_jit::helpers::round`.
const JS_ROUND: &str = valem_jit::helpers::ROUND_FN;

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled")
            .field("text", &self.text)
            .finish()
    }
}

/// Names Valem binds itself; a library may not export them.
pub const RESERVED: [&str; 6] = ["const", "parent", "self", "response", "now", "status"];

/// Impure built-ins whose value the engine pins per cycle.
const CLOCK_FNS: [&str; 2] = ["now", "millis"];

/// A parsed expression not yet made a [`Compiled`]: `Send`, so a spec's expressions can be
/// parsed on several threads.
pub struct Parsed {
    ast: AstNode,
    vars: BTreeSet<String>,
    calls: BTreeSet<String>,
    js_round: bool,
    guards: Guards,
}

impl Parsed {
    /// The tree as written (what the expression reads and calls), before the calls of
    /// checked built-ins were rewritten ([`guard`]).
    pub fn ast(&self) -> &AstNode {
        self.guards.unguarded.as_deref().unwrap_or(&self.ast)
    }

    /// Function names it calls as `$name(...)`.
    pub fn calls(&self) -> &BTreeSet<String> {
        &self.calls
    }

    pub fn into_compiled(self, text: arcstr::ArcStr) -> Compiled {
        Compiled {
            text,
            expression: jsonata_core::Expression::from_ast(self.ast),
            vars: self.vars,
            calls: self.calls,
            js_round: self.js_round,
            guards: self.guards,
        }
    }
}

impl Compiled {
    pub fn compile(text: &str, limits: &Limits) -> Result<Compiled, ExprError> {
        Ok(Compiled::parse(text, limits)?.into_compiled(arcstr::ArcStr::from(text)))
    }

    /// Parse `text` (its length checked against the limit, `$round` calls renamed).
    pub fn parse(text: &str, limits: &Limits) -> Result<Parsed, ExprError> {
        if text.len() > limits.max_expr_len {
            return Err(ExprError {
                phase: Phase::Compile,
                code: None,
                message: format!(
                    "expression is {} bytes, longer than the limit of {}",
                    text.len(),
                    limits.max_expr_len
                ),
                // In characters, as every position is: where the limit falls in the text.
                position: Some(
                    text.char_indices()
                        .take_while(|&(at, _)| at < limits.max_expr_len)
                        .count(),
                ),
            });
        }
        let deepest = bracket_scan(text, MAX_BRACKET_NESTING).map_err(|at| ExprError {
            phase: Phase::Compile,
            code: None,
            message: format!(
                "brackets nest more than {MAX_BRACKET_NESTING} levels deep (the limit)"
            ),
            position: Some(at),
        })?;
        let mut ast = parse_nested(text, deepest).map_err(|e| ExprError::compile(text, &e))?;
        let (vars, calls) = deps::free_names(&ast);
        let assigned = deps::assigned_names(&ast);
        let js_round = calls.contains("round") && !assigned.contains("round");
        if js_round {
            deps::rename_calls(&mut ast, "round", JS_ROUND);
        }
        let mut guards = Guards {
            values: guard::GUARDED.iter().any(|g| vars.contains(*g)),
            ..Guards::default()
        };
        if guard::GUARDED.iter().any(|g| calls.contains(*g)) {
            let original = ast.clone();
            (guards.calls, guards.piped) = guard::rewrite_calls(&mut ast, &assigned);
            if !guards.calls.is_empty() {
                guards.unguarded = Some(Box::new(original));
            }
        }
        Ok(Parsed {
            ast,
            vars,
            calls,
            js_round,
            guards,
        })
    }

    /// The tree as written (what the expression reads and calls), before the calls of
    /// checked built-ins were rewritten ([`guard`]).
    pub fn ast(&self) -> &AstNode {
        self.guards
            .unguarded
            .as_deref()
            .unwrap_or_else(|| self.expression.ast())
    }

    /// The tree evaluated: [`Compiled::ast`] with the calls of checked built-ins rewritten.
    pub fn evaluated_ast(&self) -> &AstNode {
        self.expression.ast()
    }

    /// Whether evaluation must bind anything from `env` (and so use the tree-walker).
    fn needs_env(&self, env: &Env) -> bool {
        self.js_round
            || !self.guards.calls.is_empty()
            || self.guards.values
            || self
                .calls
                .iter()
                .any(|c| CLOCK_FNS.contains(&c.as_str()) && env.now_ms.is_some())
            || self.vars.iter().any(|v| env.binds(v))
            || self.calls.iter().any(|c| env.binds(c))
    }

    /// Evaluate against `input`. `Ok(None)` is JSONata's *undefined*. The evaluation runs
    /// under `limits`: its timeout, sequence length, output caps, the checks of [`guard`] and
    /// its memory budget; a panic inside the engine is an error of this evaluation.
    pub fn eval(
        &self,
        input: &JValue,
        env: &Env,
        limits: &Limits,
    ) -> Result<Option<JValue>, ExprError> {
        let (watch, token) = crate::budget::watch(limits.memory_bytes);
        let options = limits.options(token);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.evaluate(input, env, limits, options)
        }));
        let over = watch.tripped();
        drop(watch);
        let result = match result {
            Ok(r) => r,
            Err(panic) => {
                return Err(ExprError::limit(format!(
                    "the expression engine failed on this expression: {}",
                    valem_sdk::shim::panic_message(&*panic)
                )))
            }
        };
        if over {
            return Err(ExprError::limit(format!(
                "the evaluation held more than {} MiB of memory (the limit) and was stopped",
                limits.memory_bytes >> 20
            )));
        }
        match result {
            Ok(JValue::Undefined) => Ok(None),
            Ok(v) => Ok(Some(v)),
            Err(e) => Err(ExprError::evaluate(&e)),
        }
    }

    fn evaluate(
        &self,
        input: &JValue,
        env: &Env,
        limits: &Limits,
        options: EvaluatorOptions,
    ) -> Result<JValue, EvaluatorError> {
        if !self.needs_env(env) {
            return self.expression.evaluate_with_options(input, options);
        }
        let mut ctx = Context::new();
        for name in self.vars.iter().chain(self.calls.iter()) {
            if let Some(v) = env.lookup(name) {
                ctx.bind(name.clone(), v);
            }
        }
        // A library export named like a checked built-in is that export, not the built-in.
        let shadowed = self.guards.calls.iter().any(|g| env.binds(g));
        let ast = match (&self.guards.unguarded, shadowed) {
            (Some(original), true) => original,
            _ => self.evaluated_ast(),
        };
        if self.guards.values {
            guard::bind_values(&mut ctx, env);
        }
        let mut ev = Evaluator::with_options(ctx, options);
        // Always: a bound library lambda may call `$round` (renamed in its own body).
        let _ = ev.register_fn(JS_ROUND, js_round);
        // A library lambda's body calls the checks of what it uses.
        let library = self.calls.iter().any(|c| env.binds(c));
        if library || !self.guards.calls.is_empty() || self.guards.values {
            let scope = Rc::new(guard::Scope {
                env: env.clone(),
                limits: limits.clone(),
            });
            guard::install(
                &mut ev,
                &scope,
                true,
                library || self.guards.piped || self.guards.values,
            );
        }
        if let Some(now) = env.now_ms {
            if self.calls.contains("millis") {
                let _ = ev.register_fn_override("millis", move |_: &[JValue]| {
                    Ok(JValue::Number(now as f64))
                });
            }
            if self.calls.contains("now") {
                let _ = ev.register_fn_override("now", move |args: &[JValue]| now_fn(now, args));
            }
        }
        ev.evaluate(ast, input)
    }
}

/// Evaluate a syntax tree made from [`Compiled`] trees (a library definition's block) with
/// every binding of `env`, under `limits` as [`Compiled::eval`] does: the memory budget, the
/// checks of [`guard`] for the calls its parts had rewritten, a panic made an error.
pub fn eval_tree(
    ast: &AstNode,
    input: &JValue,
    env: &Env,
    limits: &Limits,
) -> Result<JValue, ExprError> {
    let (watch, token) = crate::budget::watch(limits.memory_bytes);
    let options = limits.options(token);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut ctx = Context::new();
        for (n, v) in &env.vars {
            ctx.bind(n.to_string(), v.clone());
        }
        let mut ev = Evaluator::with_options(ctx, options);
        let _ = ev.register_fn(JS_ROUND, js_round);
        let scope = Rc::new(guard::Scope {
            env: env.clone(),
            limits: limits.clone(),
        });
        guard::install(&mut ev, &scope, true, true);
        ev.evaluate(ast, input)
    }));
    let over = watch.tripped();
    drop(watch);
    match result {
        Err(panic) => Err(ExprError::limit(format!(
            "the expression engine failed on this expression: {}",
            valem_sdk::shim::panic_message(&*panic)
        ))),
        Ok(_) if over => Err(ExprError::limit(format!(
            "the evaluation held more than {} MiB of memory (the limit) and was stopped",
            limits.memory_bytes >> 20
        ))),
        Ok(r) => r.map_err(|e| ExprError::evaluate(&e)),
    }
}

/// `$round(x[, precision])` as jsonata-js computes it, for a number and an integer precision;
/// any other arguments go to jsonata-core's `$round`, whose errors (and undefined) then apply.
fn js_round(args: &[JValue]) -> Result<JValue, EvaluatorError> {
    match args {
        [JValue::Undefined, ..] => return Ok(JValue::Undefined),
        [JValue::Number(x)] => return Ok(JValue::Number(valem_jit::helpers::round(*x, 0))),
        [JValue::Number(x), JValue::Number(p)]
            if p.fract() == 0.0 && p.abs() <= f64::from(i32::MAX) =>
        {
            return Ok(JValue::Number(valem_jit::helpers::round(*x, *p as i32)))
        }
        _ => {}
    }
    let mut call = String::from("$round(");
    let mut ctx = Context::new();
    for (i, a) in args.iter().enumerate() {
        ctx.bind(format!("a{i}"), a.clone());
        call.push_str(&format!("{}$a{i}", if i > 0 { ", " } else { "" }));
    }
    call.push(')');
    let ast = parser::parse(&call).map_err(|e| EvaluatorError::EvaluationError(e.to_string()))?;
    Evaluator::with_context(ctx).evaluate(&ast, &JValue::Null)
}

/// `$now()` pinned to the cycle's instant; with a picture it formats like `$fromMillis`.
fn now_fn(now: i64, args: &[JValue]) -> Result<JValue, EvaluatorError> {
    if args.is_empty() {
        return Ok(JValue::string(iso_millis(now)));
    }
    let mut call = String::from("$fromMillis($ms");
    let mut ctx = Context::new();
    ctx.bind("ms".into(), JValue::Number(now as f64));
    for (i, a) in args.iter().enumerate() {
        ctx.bind(format!("a{i}"), a.clone());
        call.push_str(&format!(", $a{i}"));
    }
    call.push(')');
    let ast = parser::parse(&call).map_err(|e| EvaluatorError::EvaluationError(e.to_string()))?;
    Evaluator::with_context(ctx).evaluate(&ast, &JValue::Null)
}

/// ISO-8601 UTC with milliseconds, as JSONata's `$now()` prints it.
pub fn iso_millis(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let milli = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{milli:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Values an evaluation may bind. Built per evaluation site; cheap to clone (`Rc`s).
#[derive(Clone, Default)]
pub struct Env {
    /// Bound names (without `$`): `const`, `parent`, `self`, library exports, …
    pub vars: Vec<(Rc<str>, JValue)>,
    /// The cycle's instant in epoch milliseconds; pins `$now()` and `$millis()`.
    pub now_ms: Option<i64>,
}

impl Env {
    pub fn binds(&self, name: &str) -> bool {
        self.vars.iter().any(|(n, _)| &**n == name)
    }

    pub fn lookup(&self, name: &str) -> Option<JValue> {
        self.vars
            .iter()
            .rev()
            .find(|(n, _)| &**n == name)
            .map(|(_, v)| v.clone())
    }

    pub fn with(&self, name: &str, value: JValue) -> Env {
        let mut e = self.clone();
        e.vars.push((Rc::from(name), value));
        e
    }
}

/// An engine array from state elements, flagged flat when no element is an array (as the
/// engine's own JSON reader does).
pub fn jarray<'a>(
    items: impl Iterator<Item = &'a Val>,
    mut convert: impl FnMut(&Val) -> JValue,
) -> JValue {
    let mut flat = true;
    let items: Vec<JValue> = items
        .map(|x| {
            flat &= !matches!(x, Val::Arr(_));
            convert(x)
        })
        .collect();
    JValue::Array(JArray::new_flat(items, flat))
}

/// Convert a state value to the engine's value type.
pub fn to_jvalue(v: &Val) -> JValue {
    match v {
        Val::Null => JValue::Null,
        Val::Bool(b) => JValue::Bool(*b),
        Val::Num(n) => JValue::Number(*n),
        Val::Str(s) => JValue::string(&**s),
        Val::Arr(a) => jarray(a.iter(), to_jvalue),
        Val::Obj(m) => {
            let mut o = IndexMap::with_capacity(m.len());
            for (k, x) in m.iter() {
                o.insert(k.to_string(), to_jvalue(x));
            }
            JValue::object(o)
        }
    }
}

/// What a result may hold once converted: an engine value shares its parts (`{"l": $a, "r":
/// $a}` twice over is a value of 2^n parts in n steps), so the conversion counts what it makes.
struct Output<'l> {
    limits: &'l Limits,
    values: usize,
    string_bytes: usize,
}

impl Output<'_> {
    fn count(&mut self, v: &JValue) -> Result<(), ExprError> {
        self.values += 1;
        if let JValue::String(s) = v {
            self.string_bytes += s.len();
        }
        if self.values > self.limits.max_output_values {
            return Err(ExprError::limit(format!(
                "the result holds more than {} values (the limit)",
                self.limits.max_output_values
            )));
        }
        if self.string_bytes > self.limits.max_string_bytes {
            return Err(ExprError::limit(format!(
                "the result holds more than {} bytes of strings (the limit)",
                self.limits.max_string_bytes
            )));
        }
        Ok(())
    }

    /// The state value of `v`, which may nest `levels` arrays and objects.
    fn val(&mut self, v: &JValue, levels: usize) -> Result<Val, ExprError> {
        self.count(v)?;
        Ok(match v {
            JValue::Null | JValue::Undefined => Val::Null,
            JValue::Bool(b) => Val::Bool(*b),
            JValue::Number(n) => Val::num(*n),
            JValue::String(s) => Val::Str(Arc::from(&**s)),
            JValue::Array(_) | JValue::Object(_) if levels == 0 => {
                return Err(ExprError::limit(format!("the result {}", TooDeep)))
            }
            JValue::Array(a) => {
                let mut out = imbl::Vector::new();
                for x in a.iter().filter(|x| !x.is_undefined()) {
                    out.push_back(self.val(x, levels - 1)?);
                }
                Val::Arr(Arc::new(out))
            }
            JValue::Object(o) => {
                let mut m = ObjMap::new();
                for (k, x) in o.iter() {
                    if !x.is_undefined() {
                        m.insert(crate::value::intern(k), self.val(x, levels - 1)?);
                    }
                }
                Val::Obj(m)
            }
            _ => Val::Null,
        })
    }
}

/// Convert an engine result to a state value that may nest `levels` arrays and objects (the
/// room [`crate::value::MAX_DEPTH`] leaves below where it goes), within `limits`' output caps.
/// Functions and regexes have no JSON form and become `null`; *undefined* inside an array is
/// dropped and inside an object omits the key.
#[inline]
pub fn from_jvalue(v: &JValue, levels: usize, limits: &Limits) -> Result<Val, ExprError> {
    // The common results, a number or a short string, need no counting.
    match v {
        JValue::Number(n) => return Ok(Val::num(*n)),
        JValue::Null | JValue::Undefined => return Ok(Val::Null),
        JValue::Bool(b) => return Ok(Val::Bool(*b)),
        JValue::String(s) if s.len() <= limits.max_string_bytes => {
            return Ok(Val::Str(Arc::from(&**s)))
        }
        _ => {}
    }
    Output {
        limits,
        values: 0,
        string_bytes: 0,
    }
    .val(v, levels)
}

/// Convert an engine result straight to `serde_json` (for `eval`), as deep as a document may
/// be and within `limits`' output caps.
pub fn jvalue_to_json(v: &JValue, limits: &Limits) -> Result<Json, ExprError> {
    Ok(match v {
        JValue::Number(n) => num_to_json(*n),
        JValue::Lambda(_) | JValue::Builtin { .. } => Json::String(String::new()),
        other => from_jvalue(other, MAX_DEPTH, limits)?.to_json(),
    })
}

pub fn json_to_jvalue(j: &Json) -> JValue {
    JValue::from(j.clone())
}

/// Evaluate one expression text against a JSON input (`None`: *undefined* input), as
/// `valem eval` and `eval_expression` do. Bindings are `name` or `$name` → value.
pub fn eval_once(
    text: &str,
    input: Option<&Json>,
    bindings: &serde_json::Map<String, Json>,
    limits: &Limits,
) -> Result<Option<Json>, ExprError> {
    let compiled = Compiled::compile(text, limits)?;
    let mut env = Env::default();
    for (k, v) in bindings {
        let name = k.strip_prefix('$').unwrap_or(k);
        env.vars.push((Rc::from(name), json_to_jvalue(v)));
    }
    let input = input.map_or(JValue::Undefined, json_to_jvalue);
    let out = compiled.eval(&input, &env, limits)?;
    out.as_ref().map(|v| jvalue_to_json(v, limits)).transpose()
}

// ---------------------------------------------------------------------------------------------
// Error positions. The parser's errors carry no offsets, so we re-lex the text into tokens and
// find the first token boundary at which parsing fails for a reason other than "input ended".

fn error_position(text: &str, e: &ParserError) -> usize {
    let len = text.chars().count();
    if incomplete(e, text) {
        return len;
    }
    let tokens = token_starts(text);
    let chars: Vec<char> = text.chars().collect();
    // Whether the text up to the end of token `i` fails for a reason other than ending early.
    // Once a prefix fails so, every longer one does (the parser stops at the same token), so
    // the first failing token is found by doubling and then halving the prefix: O(log n)
    // parses, where trying every prefix took O(n) of them (a 100 KB text, minutes).
    let fails = |i: usize| {
        let end = tokens.get(i + 1).copied().unwrap_or(len);
        let prefix: String = chars[..end].iter().collect();
        matches!(parse_guarded(&prefix), Err(e) if !incomplete(&e, &prefix))
    };
    let Some(last) = tokens.len().checked_sub(1) else {
        return len;
    };
    // `ok` is a token whose prefix parses (or -1 as none), `bad` one whose prefix fails.
    let (mut ok, mut bad): (Option<usize>, usize) = (None, last);
    let mut step = 1;
    loop {
        let probe = ok.map_or(0, |o| o + step);
        if probe >= last {
            break;
        }
        if fails(probe) {
            bad = probe;
            break;
        }
        ok = Some(probe);
        step *= 2;
    }
    if bad == last && !fails(last) {
        return len;
    }
    while ok.map_or(0, |o| o + 1) < bad {
        let lo = ok.map_or(0, |o| o + 1);
        let mid = lo + (bad - lo) / 2;
        if fails(mid) {
            bad = mid;
        } else {
            ok = Some(mid);
        }
    }
    tokens[bad]
}

/// Most brackets (`(`, `[`, `{`) an expression may open within one another. The parser allows
/// 1,000 levels of nesting, but a text that fails near that depth frees the tree it had built
/// recursively in whatever stack segment the parser was in (a debug build overflows it); no
/// real expression comes close to this.
pub const MAX_BRACKET_NESTING: usize = 100;

/// From this bracket nesting on, a text is parsed on a stack segment of its own (a few µs of
/// mapping) rather than on what is left of the thread's stack.
const DEEP_BRACKETS: usize = 24;

/// The deepest bracket nesting of `text`, or `Err(offset)` of the first bracket past `limit`.
fn bracket_scan(text: &str, limit: usize) -> Result<usize, usize> {
    let mut depth = 0usize;
    let mut deepest = 0;
    let mut beyond = None;
    lex(text, |at, token| {
        match token {
            Token::Open => {
                depth += 1;
                if depth > limit {
                    beyond = Some(at);
                    return ControlFlow::Break(());
                }
                deepest = deepest.max(depth);
            }
            Token::Close => depth = depth.saturating_sub(1),
            Token::Other => {}
        }
        ControlFlow::Continue(())
    });
    beyond.map_or(Ok(deepest), Err)
}

/// Parse `text` (see [`parse_nested`]).
fn parse_guarded(text: &str) -> Result<AstNode, ParserError> {
    parse_nested(
        text,
        bracket_scan(text, MAX_BRACKET_NESTING).unwrap_or(usize::MAX),
    )
}

/// Parse `text`, whose brackets nest `deepest` levels; one with deeply nested brackets on a
/// fresh 64 MiB stack segment (mapped, touched only as far as the parse goes), so that the
/// parser's own recursion, and its freeing of a deep tree when it fails, never runs short of
/// stack.
fn parse_nested(text: &str, deepest: usize) -> Result<AstNode, ParserError> {
    PARSES.with(|n| n.set(n.get() + 1));
    if deepest < DEEP_BRACKETS {
        parser::parse(text)
    } else {
        stacker::grow(64 << 20, || parser::parse(text))
    }
}

thread_local! {
    static PARSES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Expression texts (and prefixes of them, looking for an error's position) parsed on this
/// thread so far: tests bound the work a compile does with it, without timing it.
pub fn parses_on_this_thread() -> u64 {
    PARSES.with(std::cell::Cell::get)
}

/// Errors of `text` that only say it ended too early: what the parser found was the end
/// (`function(` expects a parameter: S0208 found the end), or `#`/`@` ends it (S0214 says
/// only that no variable follows).
fn incomplete(e: &ParserError, text: &str) -> bool {
    match e {
        ParserError::UnexpectedEnd
        | ParserError::UnclosedString
        | ParserError::UnclosedComment
        | ParserError::UnclosedBacktick => true,
        ParserError::UnexpectedToken(t) => t == "Eof",
        ParserError::Expected { found, .. } => found == "Eof",
        ParserError::Coded { code: "S0214", .. } => text.trim_end().ends_with(['#', '@']),
        other => {
            let m = other.to_string();
            m.contains("end of expression") || m.contains("Eof")
        }
    }
}

/// Character offsets where tokens start.
fn token_starts(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    lex(text, |at, _| {
        out.push(at);
        ControlFlow::Continue(())
    });
    out
}

/// What [`lex`] tells of a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Token {
    /// `(`, `[` or `{`.
    Open,
    /// `)`, `]` or `}`.
    Close,
    Other,
}

/// Operators of two characters (one token each).
const TWO_CHAR_OPS: [&str; 9] = [":=", "!=", "<=", ">=", "**", "..", "~>", "??", "?:"];

/// Operators after which jsonata-core's lexer reads a `/` as the start of a regular
/// expression (a value may follow them), not as a division.
const BEFORE_A_VALUE: [&str; 20] = [
    ",", ";", ":", "=", "!=", "<", "<=", ">", ">=", "+", "-", "&", "?", "~>", ":=", "??", "?:",
    "and", "or", "in",
];

/// Tokenise `text` as jsonata-core's lexer does, as far as where each token starts and ends:
/// strings with their escapes, names in backquotes (which have none), numbers as
/// `(0|[1-9][0-9]*)(\.[0-9]+)?([Ee][-+]?[0-9]+)?` reads them, a `/` where a value may start as
/// a regular expression (with its escapes and flags), elsewhere as a division; comments are
/// skipped. `token` hears each token's character offset and kind, and may stop the scan.
fn lex(text: &str, mut token: impl FnMut(usize, Token) -> ControlFlow<()>) {
    let c: Vec<char> = text.chars().collect();
    let digit = |i: usize| c.get(i).is_some_and(char::is_ascii_digit);
    let mut i = 0;
    // Whether a value may start here: at the start, after an opening bracket or an operator.
    let mut value_next = true;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
            continue;
        }
        if ch == '/' && c.get(i + 1) == Some(&'*') {
            i += 2;
            while i < c.len() && !(c[i] == '*' && c.get(i + 1) == Some(&'/')) {
                i += 1;
            }
            i += 2;
            continue;
        }
        let start = i;
        let mut kind = Token::Other;
        value_next = match ch {
            '"' | '\'' => {
                i += 1;
                while i < c.len() && c[i] != ch {
                    i += if c[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
                false
            }
            '`' => {
                i += 1;
                while i < c.len() && c[i] != '`' {
                    i += 1;
                }
                i += 1;
                false
            }
            '/' if value_next => {
                i += 1;
                while i < c.len() && c[i] != '/' {
                    i += if c[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
                while c.get(i).is_some_and(|f| f.is_alphabetic()) {
                    i += 1;
                }
                false
            }
            '0'..='9' => {
                i += 1;
                if ch != '0' {
                    while digit(i) {
                        i += 1;
                    }
                }
                if c.get(i) == Some(&'.') && digit(i + 1) {
                    i += 1;
                    while digit(i) {
                        i += 1;
                    }
                }
                if matches!(c.get(i), Some('e' | 'E')) {
                    let sign = usize::from(matches!(c.get(i + 1), Some('+' | '-')));
                    if digit(i + 1 + sign) {
                        i += 1 + sign;
                        while digit(i) {
                            i += 1;
                        }
                    }
                }
                false
            }
            '(' | '[' | '{' => {
                i += 1;
                kind = Token::Open;
                true
            }
            ')' | ']' | '}' => {
                i += 1;
                kind = Token::Close;
                false
            }
            c0 if c0.is_alphanumeric() || c0 == '_' || c0 == '$' => {
                i += 1;
                while c
                    .get(i)
                    .is_some_and(|&n| n.is_alphanumeric() || n == '_' || n == '$')
                {
                    i += 1;
                }
                let word: String = c[start..i].iter().collect();
                BEFORE_A_VALUE.contains(&word.as_str())
            }
            _ => {
                let two: String = c[i..(i + 2).min(c.len())].iter().collect();
                let op = if TWO_CHAR_OPS.contains(&two.as_str()) {
                    two
                } else {
                    ch.to_string()
                };
                i += op.chars().count();
                BEFORE_A_VALUE.contains(&op.as_str())
            }
        };
        if token(start, kind).is_break() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(text: &str, input: Json) -> Result<Option<Json>, ExprError> {
        eval_once(
            text,
            Some(&input),
            &serde_json::Map::new(),
            &Limits::default(),
        )
    }

    #[test]
    fn evaluates_arithmetic_and_undefined() {
        assert_eq!(
            ev("price * qty", json!({"price": 10, "qty": 3})).unwrap(),
            Some(json!(30))
        );
        assert_eq!(ev("missing", json!({})).unwrap(), None);
    }

    #[test]
    fn compile_errors_carry_code_and_position() {
        let e = ev("1 + + 2", json!({})).unwrap_err();
        assert_eq!(e.phase, Phase::Compile);
        assert!(e.code.is_some(), "{e:?}");
        assert_eq!(e.position, Some(4));
        let e = ev("(1 + 2", json!({})).unwrap_err();
        assert_eq!(e.position, Some(6));
        let e = ev("a b", json!({})).unwrap_err();
        assert_eq!(e.code.as_deref(), Some("S0201"));
        assert_eq!(e.position, Some(2));
    }

    /// A text over the length limit is refused where the limit falls, counted in characters
    /// like every position (it was the limit in bytes: beyond the end of a text of multi-byte
    /// characters).
    #[test]
    fn a_text_over_the_length_limit_is_refused_at_a_character_offset() {
        let limits = Limits {
            max_expr_len: 10,
            ..Limits::default()
        };
        let e = Compiled::compile(&"€".repeat(4), &limits).unwrap_err();
        assert_eq!(e.position, Some(4));
        let e = Compiled::compile("ab€€€€", &limits).unwrap_err();
        assert_eq!(e.position, Some(5));
        let e = Compiled::compile(&"1".repeat(11), &limits).unwrap_err();
        assert_eq!(e.position, Some(10));
    }

    /// Tokens are read as jsonata-core reads them, and prefixes that end early are told from
    /// wrong ones. Numbers with a signed exponent are one
    /// token (`1.5e+3` was cut at the `+`, and its prefix `1.5e` failed: an error after it was
    /// placed at 0); names in backquotes have no escapes (`` `a\` `` hid every bracket up to
    /// the next backquote from the nesting limit); brackets in a regular expression are not
    /// brackets (`(/\)/ and …` nested without counting), a `/` after a value divides.
    #[test]
    fn positions_and_bracket_nesting_follow_the_engine_lexer() {
        let at = |t: &str| {
            Compiled::compile(t, &Limits::default())
                .unwrap_err()
                .position
        };
        assert_eq!(at("1.5e+3 )"), Some(7));
        // `01` is two numbers, as the engine reads it: the second is the error.
        assert_eq!(at("2E-2 + 01 )"), Some(8));
        assert_eq!(at("`a\\` )"), Some(5));
        assert_eq!(at("$x$y )"), Some(5));
        // Prefixes ending in a lambda's parameters, or after `#`, are cut short, not wrong.
        assert_eq!(
            at("($f := function($a, $b) { $a + $b }; $f(1, 2)) )"),
            Some(47)
        );
        assert_eq!(at("items#$i.x )"), Some(11));
        assert_eq!(at("items#1"), Some(6));
        assert_eq!(at("items#"), Some(6));
        assert_eq!(bracket_scan("(a / 2) / ((b) / 2)", 100), Ok(2));
        assert_eq!(bracket_scan("$match(s, /[(]/) + (1)", 100), Ok(1));
        assert_eq!(bracket_scan("a and /(((/", 100), Ok(0));
        assert_eq!(bracket_scan("`x\\` + ((`y`))", 100), Ok(2));
        assert_eq!(bracket_scan("'a\\'(' + [\"]\"]", 100), Ok(1));
        assert_eq!(bracket_scan("/* ( */ (1)", 100), Ok(1));

        let levels = MAX_BRACKET_NESTING + 1;
        let nest =
            |open: &str, close: &str| format!("{}1{}", open.repeat(levels), close.repeat(levels));
        for text in [
            format!("`a\\` + {}", nest("(", ")")),
            nest("(/\\)/ and ", ")"),
            nest("[/\\]/ ~> $f(), ", "]"),
        ] {
            let e = Compiled::compile(&text, &Limits::default()).unwrap_err();
            assert!(e.message.contains("brackets nest"), "{text}: {e}");
        }
        // A regular expression's brackets do not count against the limit either.
        let inside = format!(
            "$match('', /[(]/) + {}",
            "(".repeat(MAX_BRACKET_NESTING) + "1" + &")".repeat(MAX_BRACKET_NESTING)
        );
        assert!(Compiled::compile(&inside, &Limits::default()).is_ok());
    }

    #[test]
    fn evaluation_errors_carry_code() {
        let e = ev("'a' + 1", json!({})).unwrap_err();
        assert_eq!(e.phase, Phase::Evaluate);
        assert_eq!(e.code.as_deref(), Some("T2001"));
    }

    #[test]
    fn bindings_and_pinned_clock() {
        let limits = Limits::default();
        let c = Compiled::compile("$const.rate * x & '@' & $now()", &limits).unwrap();
        let env = Env {
            vars: vec![(Rc::from("const"), json_to_jvalue(&json!({"rate": 2})))],
            now_ms: Some(0),
        };
        let out = c
            .eval(&json_to_jvalue(&json!({"x": 3})), &env, &limits)
            .unwrap()
            .unwrap();
        assert_eq!(
            jvalue_to_json(&out, &limits).unwrap(),
            json!("6@1970-01-01T00:00:00.000Z")
        );
        let m = Compiled::compile("$millis()", &limits).unwrap();
        let out = m.eval(&JValue::Null, &env, &limits).unwrap().unwrap();
        assert_eq!(jvalue_to_json(&out, &limits).unwrap(), json!(0));
    }

    #[test]
    fn finds_codes_anywhere() {
        assert_eq!(
            find_code("Invalid syntax: T1006: x").as_deref(),
            Some("T1006")
        );
        assert_eq!(find_code("no code here"), None);
    }

    #[test]
    fn iso_dates() {
        assert_eq!(iso_millis(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    }
}
