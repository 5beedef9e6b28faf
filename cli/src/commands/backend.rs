//! Backend selection shared by the subcommands.
//!
//! `KvModel` has an associated KV type, so a backend is chosen by instantiating a generic
//! function per backend: [`with_model!`] loads the chosen backend and runs one body on it.

use std::fmt;
use std::str::FromStr;

/// The backends a command can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The pure-Rust CPU reference (`kvsnap-reference`).
    Reference,
}

/// Backends that are designed but not built into this version.
const PLANNED: [&str; 2] = ["iree-cpu", "iree-vulkan"];

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Reference => f.write_str("reference"),
        }
    }
}

impl FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reference" => Ok(Backend::Reference),
            planned if PLANNED.contains(&planned) => Err(format!(
                "backend `{planned}` is not built in this version (built: reference)"
            )),
            other => Err(format!(
                "unknown backend `{other}` (known: reference; {}: not built in this version)",
                PLANNED.join(", ")
            )),
        }
    }
}

/// Loads `$backend` from model dir `$dir` and evaluates `$body` with `$m` bound to `&model`.
///
/// ```ignore
/// with_model!(args.backend, &args.model, |m| serve(m, &case))
/// ```
macro_rules! with_model {
    ($backend:expr, $dir:expr, |$m:ident| $body:expr) => {{
        match $backend {
            $crate::commands::backend::Backend::Reference => {
                let model = kvsnap_reference::ReferenceModel::load($dir)?;
                let $m = &model;
                $body
            }
        }
    }};
}
pub(crate) use with_model;
