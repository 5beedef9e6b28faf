//! A small typed StableHLO text emitter.
//!
//! [`FuncBuilder`] appends one op per method call ("Emits `stablehlo.add`"), each checking its
//! operand shapes and returning a typed [`Value`] (or, for the `arith` ops on host scalars, a
//! [`Scalar`]); [`Module`] collects functions into the text that `iree-compile
//! --iree-input-type=stablehlo` reads.

mod builder;
mod types;

pub use builder::{Cmp, DotDims, FuncBuilder, OpenRegion, Reduction, Region};
pub use types::{ElemType, Scalar, TensorType, Value};

/// A `module @name { ... }` of functions.
#[derive(Debug, Default)]
pub struct Module {
    name: String,
    funcs: Vec<String>,
}

impl Module {
    /// An empty module `@name`.
    pub fn new(name: &str) -> Self {
        Module {
            name: name.to_string(),
            funcs: Vec::new(),
        }
    }

    /// Adds a function's text (from [`FuncBuilder::finish`]).
    pub fn push(&mut self, func: String) {
        self.funcs.push(func);
    }

    /// The module's MLIR text.
    pub fn text(&self) -> String {
        let mut out = format!("module @{} {{\n", self.name);
        for f in &self.funcs {
            out.push_str(f);
        }
        out.push_str("}\n");
        out
    }
}
