//! Cranelift code generation for [`Program`]s.
//!
//! Each program becomes, on request, a **scalar** function over an array of input slots and a
//! **batched** function over columns (one f64 column per slot, for the instances of a `[*]`
//! derivation):
//!
//! ```text
//! scalar(slots: *const f64, out: *mut f64) -> u8                   // 1: *out is the answer
//! batch(cols: *const *const f64, rows: usize, out: *mut f64, ok: *mut u8) -> usize  // rows ok
//! ```
//!
//! The generated code computes exactly what [`crate::interp`] does. Every intermediate that can
//! stop being finite adds `x - x` (0, or NaN) to an accumulator; the answer is good only when the
//! accumulator is not NaN, and otherwise the caller falls back to the interpreter. Only the
//! taken branch of `?:` runs. `%`, `$power` and `$round` call the shared helpers.
//!
//! A [`CodeSet`] owns the pages of every function compiled into it (through its own memory
//! provider, [`Pages`]) and unmaps them when dropped; the cranelift module itself is dropped as
//! soon as the code is final, so a set costs its pages and its entry table, nothing more.

use std::sync::{Arc, Mutex, OnceLock};

use cranelift_codegen::ir::condcodes::FloatCC;
use cranelift_codegen::ir::{types, AbiParam, InstBuilder, MemFlagsData, SigRef, Signature, Value};
use cranelift_codegen::isa::OwnedTargetIsa;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext, Variable};
use cranelift_jit::{BranchProtection, JITBuilder, JITMemoryKind, JITMemoryProvider, JITModule};
use cranelift_module::{default_libcall_names, FuncId, Linkage, Module};

use crate::helpers;
use crate::ir::{Arith, Cmp, Ir, Math, Program, Ty};

type ScalarFn = unsafe extern "C" fn(*const f64, *mut f64) -> u8;
type BatchFn = unsafe extern "C" fn(*const *const f64, usize, *mut f64, *mut u8) -> usize;

/// Which entry points to generate for a program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shapes {
    pub scalar: bool,
    pub batch: bool,
}

impl Shapes {
    pub const SCALAR: Shapes = Shapes {
        scalar: true,
        batch: false,
    };
    pub const BATCH: Shapes = Shapes {
        scalar: false,
        batch: true,
    };
    pub const BOTH: Shapes = Shapes {
        scalar: true,
        batch: true,
    };
}

/// A code generation failure (the host ISA is unsupported, or cranelift refused the function).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodegenError(pub String);

impl std::fmt::Display for CodegenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JIT code generation failed: {}", self.0)
    }
}

impl std::error::Error for CodegenError {}

fn err(e: impl std::fmt::Display) -> CodegenError {
    CodegenError(e.to_string())
}

/// The host ISA, built once per process.
fn isa() -> Result<OwnedTargetIsa, CodegenError> {
    static ISA: OnceLock<Result<OwnedTargetIsa, CodegenError>> = OnceLock::new();
    ISA.get_or_init(|| {
        let mut flags = settings::builder();
        flags.set("opt_level", "speed").map_err(err)?;
        flags.set("use_colocated_libcalls", "false").map_err(err)?;
        flags.set("is_pic", "false").map_err(err)?;
        let builder = cranelift_native::builder().map_err(err)?;
        builder.finish(settings::Flags::new(flags)).map_err(err)
    })
    .clone()
}

/// One compiled program's entry points.
#[derive(Clone, Copy, Debug)]
struct Entry {
    inputs: usize,
    ty: Ty,
    scalar: Option<ScalarFn>,
    batch: Option<BatchFn>,
}

/// Compiled code for a set of programs, freed on drop. `Send`: compile on one thread, run on
/// another.
pub struct CodeSet {
    /// Kept for its pages: dropping it unmaps them.
    _pages: Pages,
    entries: Vec<Entry>,
    code_bytes: usize,
}

// SAFETY: the entries are plain function pointers into `_pages`, which are immutable once
// finalised and live as long as the set.
unsafe impl Send for CodeSet {}
unsafe impl Sync for CodeSet {}

/// One bump region of pages for one kind of memory.
#[derive(Default)]
struct Region {
    /// Finalised maps (code made executable, read-only data made read-only).
    done: Vec<memmap2::Mmap>,
    /// Maps still writable: the current one last.
    open: Vec<memmap2::MmapMut>,
    /// Bytes used in the last open map.
    used: usize,
}

impl Region {
    fn allocate(&mut self, size: usize, align: usize) -> std::io::Result<*mut u8> {
        if let Some(map) = self.open.last_mut() {
            let at = self.used.next_multiple_of(align.max(1));
            if at + size <= map.len() {
                self.used = at + size;
                // SAFETY: `at + size` is within the map.
                return Ok(unsafe { map.as_mut_ptr().add(at) });
            }
        }
        // Whole pages (the kernel rounds up further where pages are larger).
        let mut map = memmap2::MmapMut::map_anon(size.max(1).next_multiple_of(4096))?;
        let ptr = map.as_mut_ptr();
        self.open.push(map);
        self.used = size;
        Ok(ptr)
    }
}

#[derive(Default)]
struct PagesInner {
    code: Region,
    readonly: Region,
    writable: Region,
}

/// The memory provider of one [`CodeSet`]: the module allocates through it while compiling,
/// and the set keeps the pages once the module is dropped (a module's own provider would leak
/// them unless freed through the module, which would have to be kept alive for that).
#[derive(Clone, Default)]
struct Pages(Arc<Mutex<PagesInner>>);

impl Pages {
    fn with<R>(&self, f: impl FnOnce(&mut PagesInner) -> R) -> R {
        let mut g = match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g)
    }
}

impl JITMemoryProvider for Pages {
    fn allocate(
        &mut self,
        size: usize,
        align: u64,
        kind: JITMemoryKind,
    ) -> std::io::Result<*mut u8> {
        let align = usize::try_from(align).map_err(std::io::Error::other)?;
        self.with(|p| match kind {
            JITMemoryKind::Executable => p.code.allocate(size, align),
            JITMemoryKind::ReadOnly => p.readonly.allocate(size, align),
            JITMemoryKind::Writable => p.writable.allocate(size, align),
        })
    }

    unsafe fn free_memory(&mut self) {
        // The pages go when the CodeSet holding them is dropped.
    }

    fn finalize(&mut self, _: BranchProtection) -> cranelift_module::ModuleResult<()> {
        self.with(|p| -> std::io::Result<()> {
            for map in p.readonly.open.drain(..) {
                p.readonly.done.push(map.make_read_only()?);
            }
            p.readonly.used = 0;
            for map in p.code.open.drain(..) {
                // SAFETY: the range is a live map this provider owns.
                unsafe {
                    wasmtime_internal_jit_icache_coherence::clear_cache(
                        map.as_ptr().cast(),
                        map.len(),
                    )
                }?;
                p.code.done.push(map.make_exec()?);
            }
            p.code.used = 0;
            wasmtime_internal_jit_icache_coherence::pipeline_flush_mt()
        })
        .map_err(|e| cranelift_module::ModuleError::Backend(e.into()))
    }
}

impl std::fmt::Debug for CodeSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodeSet")
            .field("programs", &self.entries.len())
            .field("code_bytes", &self.code_bytes)
            .finish()
    }
}

impl CodeSet {
    /// Compile `programs` into one module.
    pub fn compile(programs: &[(&Program, Shapes)]) -> Result<CodeSet, CodegenError> {
        let pages = Pages::default();
        let mut builder = JITBuilder::with_isa(isa()?, default_libcall_names());
        builder.memory_provider(Box::new(pages.clone()));
        let mut module = JITModule::new(builder);
        let mut ctx = module.make_context();
        let mut fctx = FunctionBuilderContext::new();
        let ptr = module.target_config().pointer_type();
        let mut ids: Vec<(Option<FuncId>, Option<FuncId>)> = Vec::with_capacity(programs.len());
        let mut code_bytes = 0;
        for (n, (p, shapes)) in programs.iter().enumerate() {
            let mut pair = (None, None);
            for batch in [false, true] {
                if !(if batch { shapes.batch } else { shapes.scalar }) {
                    continue;
                }
                let mut sig = module.make_signature();
                if batch {
                    for _ in 0..4 {
                        sig.params.push(AbiParam::new(ptr));
                    }
                    sig.returns.push(AbiParam::new(ptr));
                } else {
                    sig.params.push(AbiParam::new(ptr));
                    sig.params.push(AbiParam::new(ptr));
                    sig.returns.push(AbiParam::new(types::I8));
                }
                let name = format!("p{n}{}", if batch { "b" } else { "s" });
                let id = module
                    .declare_function(&name, Linkage::Local, &sig)
                    .map_err(err)?;
                ctx.func.signature = sig;
                {
                    let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
                    let helpers = Helpers::import(&mut b, &module);
                    if batch {
                        build_batch(&mut b, p, ptr, &helpers);
                    } else {
                        build_scalar(&mut b, p, ptr, &helpers);
                    }
                    b.seal_all_blocks();
                    b.finalize(module.target_config());
                }
                module.define_function(id, &mut ctx).map_err(err)?;
                code_bytes += ctx.compiled_code().map_or(0, |c| c.code_buffer().len());
                module.clear_context(&mut ctx);
                if batch {
                    pair.1 = Some(id);
                } else {
                    pair.0 = Some(id);
                }
            }
            ids.push(pair);
        }
        module.finalize_definitions().map_err(err)?;
        let entries = programs
            .iter()
            .zip(ids)
            .map(|((p, _), (s, b))| Entry {
                inputs: p.inputs.len(),
                ty: p.ty,
                // SAFETY: each id was defined with exactly this signature above.
                scalar: s.map(|id| unsafe {
                    std::mem::transmute::<*const u8, ScalarFn>(module.get_finalized_function(id))
                }),
                batch: b.map(|id| unsafe {
                    std::mem::transmute::<*const u8, BatchFn>(module.get_finalized_function(id))
                }),
            })
            .collect();
        // The code is final and relocated: the module's bookkeeping can go; the pages stay.
        drop(module);
        Ok(CodeSet {
            _pages: pages,
            entries,
            code_bytes,
        })
    }

    /// How many programs this set holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of machine code generated (the pages holding them are rounded up).
    pub fn code_bytes(&self) -> usize {
        self.code_bytes
    }

    /// Program `i`'s result type.
    pub fn ty(&self, i: usize) -> Option<Ty> {
        self.entries.get(i).map(|e| e.ty)
    }

    /// Run program `i` over `slots`; `None` means "ask the interpreter" (a non-finite value,
    /// or no scalar entry / wrong slot count).
    #[inline]
    pub fn call(&self, i: usize, slots: &[f64]) -> Option<f64> {
        let e = self.entries.get(i)?;
        let f = e.scalar?;
        if slots.len() != e.inputs {
            return None;
        }
        let mut out = 0.0;
        // SAFETY: `slots` has the program's slot count; `out` is writable; the code lives as
        // long as `self`.
        let ok = unsafe { f(slots.as_ptr(), &mut out) };
        (ok != 0).then_some(out)
    }

    /// Run program `i` over `rows` rows of columns (`cols[s][r]` is slot `s` of row `r`),
    /// writing `out[r]` and `ok[r]` (1: good, 0: ask the interpreter). Returns the good rows;
    /// `None` when there is no batched entry or a length does not match.
    pub fn call_batch(
        &self,
        i: usize,
        cols: &[&[f64]],
        out: &mut [f64],
        ok: &mut [u8],
    ) -> Option<usize> {
        let e = self.entries.get(i)?;
        let f = e.batch?;
        let rows = out.len();
        if cols.len() != e.inputs || ok.len() != rows || cols.iter().any(|c| c.len() != rows) {
            return None;
        }
        let ptrs: Vec<*const f64> = cols.iter().map(|c| c.as_ptr()).collect();
        // SAFETY: every column has `rows` values, `out` and `ok` have `rows` slots.
        Some(unsafe { f(ptrs.as_ptr(), rows, out.as_mut_ptr(), ok.as_mut_ptr()) })
    }
}

/// The helper signatures, imported into the function being built.
struct Helpers {
    f2: SigRef,
    round: SigRef,
}

impl Helpers {
    fn import(b: &mut FunctionBuilder, module: &JITModule) -> Helpers {
        let cc = module.target_config().default_call_conv;
        let mut f2 = Signature::new(cc);
        f2.params.push(AbiParam::new(types::F64));
        f2.params.push(AbiParam::new(types::F64));
        f2.returns.push(AbiParam::new(types::F64));
        let mut round = Signature::new(cc);
        round.params.push(AbiParam::new(types::F64));
        round.params.push(AbiParam::new(types::I32));
        round.returns.push(AbiParam::new(types::F64));
        Helpers {
            f2: b.import_signature(f2),
            round: b.import_signature(round),
        }
    }
}

/// Emission state of one function body.
struct Body<'h> {
    slots: Vec<Value>,
    acc: Variable,
    ptr: types::Type,
    helpers: &'h Helpers,
}

fn build_scalar(b: &mut FunctionBuilder, p: &Program, ptr: types::Type, h: &Helpers) {
    let entry = b.create_block();
    b.append_block_params_for_function_params(entry);
    b.switch_to_block(entry);
    let (slots_ptr, out_ptr) = (b.block_params(entry)[0], b.block_params(entry)[1]);
    let flags = MemFlagsData::trusted();
    let slots = (0..p.inputs.len())
        .map(|i| b.ins().load(types::F64, flags, slots_ptr, (i * 8) as i32))
        .collect();
    let acc = b.declare_var(types::F64);
    let zero = b.ins().f64const(0.0);
    b.def_var(acc, zero);
    let mut body = Body {
        slots,
        acc,
        ptr,
        helpers: h,
    };
    let (x, ok) = body.result(b, p);
    b.ins().store(flags, x, out_ptr, 0);
    b.ins().return_(&[ok]);
}

fn build_batch(b: &mut FunctionBuilder, p: &Program, ptr: types::Type, h: &Helpers) {
    let flags = MemFlagsData::trusted();
    let entry = b.create_block();
    let head = b.create_block();
    let row = b.create_block();
    let exit = b.create_block();
    b.append_block_params_for_function_params(entry);
    b.switch_to_block(entry);
    let [cols, rows, out, okp] = [0, 1, 2, 3].map(|i| b.block_params(entry)[i]);
    let columns: Vec<Value> = (0..p.inputs.len())
        .map(|i| b.ins().load(ptr, flags, cols, (i * 8) as i32))
        .collect();
    let i = b.declare_var(ptr);
    let good = b.declare_var(ptr);
    let acc = b.declare_var(types::F64);
    let z = b.ins().iconst(ptr, 0);
    b.def_var(i, z);
    b.def_var(good, z);
    b.ins().jump(head, &[]);

    b.switch_to_block(head);
    let iv = b.use_var(i);
    let more = b.ins().icmp(
        cranelift_codegen::ir::condcodes::IntCC::UnsignedLessThan,
        iv,
        rows,
    );
    b.ins().brif(more, row, &[], exit, &[]);

    b.switch_to_block(row);
    let iv = b.use_var(i);
    let off = b.ins().ishl_imm_u(iv, 3);
    let slots = columns
        .iter()
        .map(|c| {
            let a = b.ins().iadd(*c, off);
            b.ins().load(types::F64, flags, a, 0)
        })
        .collect();
    let zero = b.ins().f64const(0.0);
    b.def_var(acc, zero);
    let mut body = Body {
        slots,
        acc,
        ptr,
        helpers: h,
    };
    let (x, ok) = body.result(b, p);
    let iv = b.use_var(i);
    let off = b.ins().ishl_imm_u(iv, 3);
    let oa = b.ins().iadd(out, off);
    b.ins().store(flags, x, oa, 0);
    let ka = b.ins().iadd(okp, iv);
    b.ins().store(flags, ok, ka, 0);
    let okw = b.ins().uextend(ptr, ok);
    let g = b.use_var(good);
    let g = b.ins().iadd(g, okw);
    b.def_var(good, g);
    let next = b.ins().iadd_imm_u(iv, 1);
    b.def_var(i, next);
    b.ins().jump(head, &[]);

    b.switch_to_block(exit);
    let g = b.use_var(good);
    b.ins().return_(&[g]);
}

impl Body<'_> {
    /// The program's value as an f64 (booleans 1.0/0.0) and the i8 "good" flag.
    fn result(&mut self, b: &mut FunctionBuilder, p: &Program) -> (Value, Value) {
        let x = match p.ty {
            Ty::Num => {
                let x = self.num(b, &p.ir);
                self.check(b, x);
                x
            }
            Ty::Bool => {
                let c = self.boolean(b, &p.ir);
                let one = b.ins().f64const(1.0);
                let zero = b.ins().f64const(0.0);
                b.ins().select(c, one, zero)
            }
        };
        let acc = b.use_var(self.acc);
        let ok = b.ins().fcmp(FloatCC::Equal, acc, acc);
        (x, ok)
    }

    /// Fold `x - x` (0 when finite, NaN otherwise) into the accumulator.
    fn check(&mut self, b: &mut FunctionBuilder, x: Value) {
        let d = b.ins().fsub(x, x);
        let a = b.use_var(self.acc);
        let a = b.ins().fadd(a, d);
        b.def_var(self.acc, a);
    }

    fn call2(&mut self, b: &mut FunctionBuilder, f: usize, x: Value, y: Value) -> Value {
        let callee = b.ins().iconst(self.ptr, f as i64);
        let call = b.ins().call_indirect(self.helpers.f2, callee, &[x, y]);
        b.inst_results(call)[0]
    }

    fn num(&mut self, b: &mut FunctionBuilder, ir: &Ir) -> Value {
        match ir {
            Ir::Const(c) => b.ins().f64const(*c),
            Ir::Slot(s) => self.slots[*s as usize],
            Ir::Neg(a) => {
                let a = self.num(b, a);
                b.ins().fneg(a)
            }
            Ir::Arith(op, x, y) => {
                let (x, y) = (self.num(b, x), self.num(b, y));
                let r = match op {
                    Arith::Add => b.ins().fadd(x, y),
                    Arith::Sub => b.ins().fsub(x, y),
                    Arith::Mul => b.ins().fmul(x, y),
                    Arith::Div => b.ins().fdiv(x, y),
                    Arith::Rem => self.call2(b, helpers::rem_c as *const () as usize, x, y),
                };
                self.check(b, r);
                r
            }
            Ir::Math(f, a) => {
                let a = self.num(b, a);
                match f {
                    Math::Abs => b.ins().fabs(a),
                    Math::Floor => b.ins().floor(a),
                    Math::Ceil => b.ins().ceil(a),
                    Math::Sqrt => {
                        let r = b.ins().sqrt(a);
                        self.check(b, r);
                        r
                    }
                }
            }
            Ir::Pow(x, y) => {
                let (x, y) = (self.num(b, x), self.num(b, y));
                let r = self.call2(b, helpers::power_c as *const () as usize, x, y);
                self.check(b, r);
                r
            }
            Ir::Round(x, p) => {
                let x = self.num(b, x);
                let p = b.ins().iconst(types::I32, i64::from(*p));
                let callee = b
                    .ins()
                    .iconst(self.ptr, helpers::round_c as *const () as usize as i64);
                let call = b.ins().call_indirect(self.helpers.round, callee, &[x, p]);
                let r = b.inst_results(call)[0];
                self.check(b, r);
                r
            }
            Ir::Max(v) | Ir::Min(v) => {
                let cc = if matches!(ir, Ir::Max(_)) {
                    FloatCC::GreaterThan
                } else {
                    FloatCC::LessThan
                };
                let mut m = self.num(b, &v[0]);
                for x in &v[1..] {
                    let x = self.num(b, x);
                    let better = b.ins().fcmp(cc, x, m);
                    m = b.ins().select(better, x, m);
                }
                m
            }
            Ir::Cond(c, t, e) => self.cond(b, c, t, e, types::F64),
            // Lowering types every operand; a boolean here is a lowering bug: NaN falls back.
            Ir::Cmp(..) | Ir::And(..) | Ir::Or(..) => {
                let nan = b.ins().f64const(f64::NAN);
                self.check(b, nan);
                nan
            }
        }
    }

    fn boolean(&mut self, b: &mut FunctionBuilder, ir: &Ir) -> Value {
        match ir {
            Ir::Cmp(op, x, y) => {
                let (x, y) = (self.num(b, x), self.num(b, y));
                let cc = match op {
                    Cmp::Eq => FloatCC::Equal,
                    Cmp::Ne => FloatCC::NotEqual,
                    Cmp::Lt => FloatCC::LessThan,
                    Cmp::Le => FloatCC::LessThanOrEqual,
                    Cmp::Gt => FloatCC::GreaterThan,
                    Cmp::Ge => FloatCC::GreaterThanOrEqual,
                };
                b.ins().fcmp(cc, x, y)
            }
            Ir::And(x, y) => {
                let (x, y) = (self.boolean(b, x), self.boolean(b, y));
                b.ins().band(x, y)
            }
            Ir::Or(x, y) => {
                let (x, y) = (self.boolean(b, x), self.boolean(b, y));
                b.ins().bor(x, y)
            }
            Ir::Cond(c, t, e) => self.cond(b, c, t, e, types::I8),
            _ => {
                let nan = b.ins().f64const(f64::NAN);
                self.check(b, nan);
                b.ins().iconst(types::I8, 0)
            }
        }
    }

    /// `c ? t : e` with real branches: the untaken side never runs (nor adds to the check).
    fn cond(&mut self, b: &mut FunctionBuilder, c: &Ir, t: &Ir, e: &Ir, ty: types::Type) -> Value {
        let c = self.boolean(b, c);
        let (then_b, else_b, join) = (b.create_block(), b.create_block(), b.create_block());
        let var = b.declare_var(ty);
        b.ins().brif(c, then_b, &[], else_b, &[]);
        for (block, arm) in [(then_b, t), (else_b, e)] {
            b.switch_to_block(block);
            let v = if ty == types::I8 {
                self.boolean(b, arm)
            } else {
                self.num(b, arm)
            };
            b.def_var(var, v);
            b.ins().jump(join, &[]);
        }
        b.switch_to_block(join);
        b.use_var(var)
    }
}
