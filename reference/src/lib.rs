//! kvsnap's pure-Rust CPU reference backend.

pub mod weights;

pub use weights::{write_safetensors, TensorOut, Weights};
