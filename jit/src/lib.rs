//! The fast path for arithmetic derivations.
//!
//! Most derivations are arithmetic over numeric fields (`price * qty`,
//! `subtotal * (1 - discount) + tax`, `$round(...)`). This crate lowers such an expression's
//! JSONata AST to a small typed numeric IR ([`ir`]), interprets that IR ([`interp`], the
//! reference), and compiles it to native code with cranelift ([`codegen`], feature
//! `cranelift`, on by default).
//!
//! The contract with the JSONata interpreter is *never change an answer*: inputs are guarded
//! by the caller (each slot must hold a JSON number), and any intermediate or result that is
//! not finite makes the call answer `None`, so the caller asks the interpreter instead. The
//! helpers both sides call (`$round`, `%`, `$power`) are [`helpers`].
//!
//! ```
//! use valem_jit::{ir, interp};
//! let ast = jsonata_core::parser::parse("$round(price * qty * (1 + $const.vat), 2)").unwrap();
//! let p = ir::lower(&ast, &|name| (name == "vat").then_some(0.2)).unwrap();
//! assert_eq!(p.inputs.len(), 2);
//! assert_eq!(interp::eval(&p, &[2.675, 1.0]), Some(interp::Value::Num(3.21)));
//! # #[cfg(feature = "cranelift")] {
//! use valem_jit::codegen::{CodeSet, Shapes};
//! let code = CodeSet::compile(&[(&p, Shapes::SCALAR)]).unwrap();
//! assert_eq!(code.call(0, &[2.675, 1.0]), Some(3.21));
//! # }
//! ```

#[cfg(feature = "cranelift")]
pub mod codegen;
pub mod helpers;
pub mod interp;
pub mod ir;
