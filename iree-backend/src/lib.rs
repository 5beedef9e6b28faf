//! IREE backend of kvsnap: [`IreeModel`] runs the Gemma 3 graphs that [`graphs`] emits (through
//! the StableHLO builder of [`emit`]), compiled by [`compile`] and executed on the [`runtime`]
//! layer over eerie-sys, with the KV state in device buffers updated in place.

pub mod compile;
pub mod emit;
pub mod graphs;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod module;
pub mod resident;
pub mod runtime;

pub use model::{compile_graphs, model_graphs, IreeKv, IreeModel, IreeOptions, LoadReport};
