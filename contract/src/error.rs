//! The one error type of the contract. Every backend maps its failures onto these variants, so a
//! caller (Rust, JNI, the CLI) can react to the kind of failure without parsing text.

use std::path::PathBuf;

/// Result alias used throughout kvsnap.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong behind the [`crate::KvModel`] contract.
///
/// Variants are structured (operation, expected vs got) so that messages name the problem and
/// FFI layers can map each kind to a specific exception.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A token id is outside `0..vocab`.
    #[error("{op}: token id {token} at input index {index} is out of range (vocab size {vocab})")]
    TokenOutOfRange {
        op: &'static str,
        token: i64,
        index: usize,
        vocab: usize,
    },

    /// An operation that needs at least one token got none.
    #[error("{op}: empty input (at least one token is required)")]
    EmptyInput { op: &'static str },

    /// The KV state would grow past the model's context capacity.
    #[error("{op}: context overflow: {have} tokens cached + {adding} new > capacity {capacity}")]
    ContextOverflow {
        op: &'static str,
        have: usize,
        adding: usize,
        capacity: usize,
    },

    /// An input buffer does not have the shape the operation needs.
    #[error("{op}: {what} has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        op: &'static str,
        what: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    /// An input value that must be finite (an embedding) is NaN or infinite. Rejected before
    /// anything changes: a NaN row would turn every later logit of its sequence into NaN.
    #[error("{op}: {what} holds a non-finite value {value} at row {row}, column {column}")]
    NonFinite {
        op: &'static str,
        what: &'static str,
        row: usize,
        column: usize,
        value: f32,
    },

    /// A handle that was released, never issued, or belongs to another model.
    #[error("{op}: stale handle {handle:#x} ({reason})")]
    StaleHandle {
        op: &'static str,
        handle: u64,
        reason: &'static str,
    },

    /// The model (or its handles) was closed.
    #[error("{op}: the model is closed")]
    Closed { op: &'static str },

    /// A KV state was poisoned by an earlier failure midway through an operation.
    #[error("{op}: this KV state is poisoned by an earlier failure: {cause}")]
    Poisoned { op: &'static str, cause: String },

    /// The weights do not match the config (missing tensor, wrong shape or dtype).
    #[error("weights {path}: tensor `{tensor}`: {problem}")]
    WeightsMismatch {
        path: PathBuf,
        tensor: String,
        problem: String,
    },

    /// A config file is invalid or describes a model kvsnap cannot run.
    #[error("config {path}: {problem}")]
    Config { path: PathBuf, problem: String },

    /// A file is not in the format it claims (safetensors, GGUF, goldens, compiled module).
    #[error("{path}: invalid {format}: {problem}")]
    Format {
        path: PathBuf,
        format: &'static str,
        problem: String,
    },

    /// An I/O error on a named file. The cause is part of the message (not chained as a
    /// `source`), so that `{:#}` printers do not repeat it.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },

    /// The total KV budget would be exceeded.
    #[error("{op}: KV budget exceeded: {live} bytes live + {adding} new > cap {cap} bytes")]
    KvBudget {
        op: &'static str,
        live: u64,
        adding: u64,
        cap: u64,
    },

    /// A failure reported by a device runtime, with its own status text.
    #[error("{backend}: {op} failed: {status}")]
    Backend {
        backend: &'static str,
        op: String,
        status: String,
    },

    /// An optional capability the backend does not provide.
    #[error("{backend} does not support {op}")]
    Unsupported {
        backend: &'static str,
        op: &'static str,
    },
}

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            cause,
        }
    }

    /// A short stable name of the variant, for logs, FFI mapping and tests.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::TokenOutOfRange { .. } => "token_out_of_range",
            Error::EmptyInput { .. } => "empty_input",
            Error::ContextOverflow { .. } => "context_overflow",
            Error::ShapeMismatch { .. } => "shape_mismatch",
            Error::NonFinite { .. } => "non_finite",
            Error::StaleHandle { .. } => "stale_handle",
            Error::Closed { .. } => "closed",
            Error::Poisoned { .. } => "poisoned",
            Error::WeightsMismatch { .. } => "weights_mismatch",
            Error::Config { .. } => "config",
            Error::Format { .. } => "format",
            Error::Io { .. } => "io",
            Error::KvBudget { .. } => "kv_budget",
            Error::Backend { .. } => "backend",
            Error::Unsupported { .. } => "unsupported",
        }
    }
}
