//! FunctionGemma tool calls against a cached catalog prefix.
//!
//! A [`Catalog`] of function declarations is rendered into FunctionGemma's prompt syntax
//! ([`render`]), tokenized ([`Tokenizer`]), and its prefix prefilled once into a
//! [`PrefixCache`]. Each utterance then costs a snapshot of the cached KV state, one `extend`
//! by the user turn and a few `step`s until a [`StopRules`] rule fires ([`run_turn`]); the
//! decoded output is parsed into a typed [`FunctionCall`] ([`parse_call`]).
//!
//! [`ToolCaller`] ties these together for one model and tokenizer.

mod cache;
mod call;
mod catalog;
mod error;
pub mod render;
mod stop;
mod tokenizer;
mod tool_caller;
mod turn;

pub use cache::{CacheStats, Checkout, Lookup, PrefillProgress, PrefixCache, DEFAULT_CHUNK};
pub use call::{parse_call, parse_calls, CallError, FunctionCall, Value};
pub use catalog::{Catalog, CatalogProblem, Function, ParamType, Parameter};
pub use error::{Error, Result};
pub use stop::{StopReason, StopRules, END_FUNCTION_CALL, END_OF_TURN};
pub use tokenizer::Tokenizer;
pub use tool_caller::{CallOutcome, ToolCaller};
pub use turn::{run_turn, stateless_estimate_s, Turn, TurnTimings};
