//! kvsnap's pure-Rust CPU reference backend: Gemma 3 with transformers' numerics, explicit
//! KV state (global layers in full, sliding layers as rings of their window), the LM head
//! computed for the last position only.

pub mod attention;
pub mod blocks;
pub mod buffer;
pub mod gguf;
pub mod head;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod rope;
pub mod team;
pub mod tiny;
pub mod weights;

pub use buffer::LargeBuffer;
pub use kv::ReferenceKv;
pub use model::{LoadReport, ReferenceModel};
pub use weights::{write_safetensors, Tensor, TensorOut, Weights};
