//! The error type of the prompt layer.

use std::path::PathBuf;

/// Result alias of the prompt layer.
pub type Result<T> = std::result::Result<T, Error>;

/// What can stop a tool call from being served.
///
/// A model output that is not a valid call is not an error of the serving path: it is reported
/// as a [`crate::CallError`] next to the output.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The catalog file is not valid JSON of the catalog shape, or breaks a rule of the syntax.
    #[error("catalog {origin}: {problem}")]
    Catalog { origin: String, problem: String },

    /// The tokenizer file could not be loaded.
    #[error("tokenizer {path}: {problem}")]
    TokenizerLoad { path: PathBuf, problem: String },

    /// Encoding or decoding failed inside the tokenizer.
    #[error("tokenizer: {op} failed: {problem}")]
    Tokenize { op: &'static str, problem: String },

    /// The tokenizer lacks a token the prompt layer needs (`<bos>`, `<end_of_turn>`).
    #[error("tokenizer {path}: no `{token}` token")]
    MissingToken { path: PathBuf, token: &'static str },

    /// An utterance holds a control marker that would break out of the user turn.
    #[error("utterance holds the control marker `{marker}`; it would end the user turn early")]
    Utterance { marker: &'static str },

    /// A prefix cache call with an empty prefix.
    #[error("prefix cache: the prefix is empty")]
    EmptyPrefix,

    /// An I/O error on a named file. The cause is part of the message (not chained as a
    /// `source`), so that `{:#}` printers do not repeat it.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },

    /// A failure of the model behind the contract.
    #[error(transparent)]
    Model(#[from] kvsnap_contract::Error),
}
