//! kvsnap's contract: a small language model with stateful KV.
//!
//! Prefill a long prompt prefix once, [`KvModel::snapshot`] its KV state, and per request
//! restore it, [`KvModel::extend`] with the new tokens and [`KvModel::step`] a few times.
//! Backends (the pure-Rust reference, IREE on CPU and Vulkan) implement [`KvModel`]; the
//! parity tests prove that they agree within a [`Tolerance`].

mod config;
mod dynamic;
mod error;
pub mod handles;
mod model;
mod tolerance;

pub use config::{LayerKind, ModelConfig, DEFAULT_CONTEXT_CAPACITY, MAX_LAYERS};
pub use dynamic::{DynModel, Session};
pub use error::{Error, Result};
pub use handles::HandleTable;
pub use model::{argmax, check, decode_by_steps, KvModel, Logits, Next};
pub use tolerance::Tolerance;
