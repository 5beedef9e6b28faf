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

/// A `module @name { ... }` of globals, executables and functions.
#[derive(Debug, Default)]
pub struct Module {
    name: String,
    globals: Vec<String>,
    executables: Vec<String>,
    funcs: Vec<String>,
}

impl Module {
    /// An empty module `@name`.
    pub fn new(name: &str) -> Self {
        Module {
            name: name.to_string(),
            globals: Vec::new(),
            executables: Vec::new(),
            funcs: Vec::new(),
        }
    }

    /// Declares the module's mutable global `@name` of type `ty`, all zeros when the module
    /// loads, which functions read and write with [`FuncBuilder::global_load`] and
    /// [`FuncBuilder::global_store`] (IREE keeps it in one device buffer, updated in place).
    pub fn push_global(&mut self, name: &str, ty: &TensorType) {
        self.globals.push(format!(
            "  util.global private mutable @{name} = dense<0> : {ty}\n"
        ));
    }

    /// Adds the text of an executable the functions dispatch to
    /// ([`FuncBuilder::dispatch`]); executables come before the functions.
    pub fn push_executable(&mut self, executable: String) {
        self.executables.push(executable);
    }

    /// Adds a function's text (from [`FuncBuilder::finish`]).
    pub fn push(&mut self, func: String) {
        self.funcs.push(func);
    }

    /// The module's MLIR text.
    pub fn text(&self) -> String {
        let mut out = format!("module @{} {{\n", self.name);
        for text in self
            .globals
            .iter()
            .chain(&self.executables)
            .chain(&self.funcs)
        {
            out.push_str(text);
        }
        out.push_str("}\n");
        out
    }
}
