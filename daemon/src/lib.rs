//! valem: reactive JSON models for AI agents. The library behind the `valem` binary: the spec
//! types and validator (`spec`), the JSONata wrapper and address dialect (`expr`), the reactive
//! engine (`engine`), the persistent state value (`value`) and the keyed hashing of client names
//! (`hash`), the model service (`service`), the durable store (`store`), the surfaces (`mcp`,
//! `http`, `console`) and the command line (`cli`). See ARCHITECTURE.md for the code map and
//! invariants.

pub mod allocator;
pub mod bench;
pub mod cli;
pub mod console;
pub mod engine;
pub mod examples;
pub mod expr;
pub mod hash;
pub mod http;
pub mod mcp;
pub mod plugins;
pub mod service;
pub mod spec;
pub mod store;
pub mod value;

// The unit tests run on the binary's allocator, so that memory budgets are enforced there too.
#[cfg(test)]
#[global_allocator]
static GLOBAL: allocator::Counting = allocator::Counting;
