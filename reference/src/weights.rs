//! Reading and writing Hugging Face safetensors checkpoints as float32 tensors.

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvsnap_contract::{Error, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

/// A memory-mapped safetensors file whose tensors are read by HF name.
///
/// F32 tensors are served straight from the mapping; BF16 and F16 are widened to f32 on read.
pub struct Weights {
    path: PathBuf,
    // Field order matters: `tensors` borrows from `mmap` (see `open`), so it must drop first.
    tensors: SafeTensors<'static>,
    mmap: Arc<Mmap>,
}

/// A read-only f32 tensor: a zero-copy view into the memory-mapped weights file when the file
/// stores f32 at an aligned offset, an owned buffer otherwise (BF16/F16 widened on load).
pub struct Tensor {
    storage: Storage,
    shape: Vec<usize>,
}

enum Storage {
    Mapped {
        mmap: Arc<Mmap>,
        offset: usize,
        len: usize,
    },
    Owned(Vec<f32>),
}

impl Tensor {
    /// An owned tensor; `data.len()` must equal the product of `shape`.
    pub fn owned(data: Vec<f32>, shape: Vec<usize>) -> Self {
        debug_assert_eq!(data.len(), shape.iter().product::<usize>());
        Tensor {
            storage: Storage::Owned(data),
            shape,
        }
    }

    /// The tensor's shape (HF layout, row-major).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Whether the data is served straight from the memory-mapped file.
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }
}

impl Deref for Tensor {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.storage {
            Storage::Mapped { mmap, offset, len } => {
                // SAFETY: `offset` is 4-byte aligned and `offset + 4 * len` lies inside the
                // mapping (checked when the tensor was created); the mapping is read-only and
                // lives as long as `self` through the Arc. f32 has no invalid bit patterns.
                unsafe {
                    std::slice::from_raw_parts(mmap.as_ptr().add(*offset) as *const f32, *len)
                }
            }
            Storage::Owned(v) => v,
        }
    }
}

impl Weights {
    /// Maps `path` and parses its header.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only; kvsnap never writes a weights file it has open, and
        // a file truncated underneath us is the same hazard as for any mmap-based loader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        // SAFETY: the slice points into `mmap`, which lives as long as `self` and is dropped
        // after `tensors` (field order).
        let bytes: &'static [u8] = unsafe { std::slice::from_raw_parts(mmap.as_ptr(), mmap.len()) };
        let tensors = SafeTensors::deserialize(bytes).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            format: "safetensors",
            problem: e.to_string(),
        })?;
        Ok(Weights {
            path: path.to_path_buf(),
            tensors,
            mmap: Arc::new(mmap),
        })
    }

    /// The file these weights come from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Names of all tensors in the file.
    pub fn names(&self) -> Vec<String> {
        self.tensors.names().into_iter().map(String::from).collect()
    }

    /// Shape of tensor `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.tensor(name).ok().map(|t| t.shape().to_vec())
    }

    /// Tensor `name` as f32, checked to have `shape`; zero-copy for aligned little-endian f32
    /// data.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if let Ok(view) = self.tensors.tensor(name) {
            let data = view.data();
            let offset = data.as_ptr() as usize - self.mmap.as_ptr() as usize;
            if view.dtype() == Dtype::F32
                && view.shape() == shape
                && offset % 4 == 0
                && cfg!(target_endian = "little")
            {
                return Ok(Tensor {
                    storage: Storage::Mapped {
                        mmap: self.mmap.clone(),
                        offset,
                        len: data.len() / 4,
                    },
                    shape: shape.to_vec(),
                });
            }
        }
        Ok(Tensor::owned(self.f32(name, shape)?, shape.to_vec()))
    }

    /// Reads tensor `name` into an owned f32 vector, checking it has `shape`.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let mismatch = |problem: String| Error::WeightsMismatch {
            path: self.path.clone(),
            tensor: name.to_string(),
            problem,
        };
        let view = self
            .tensors
            .tensor(name)
            .map_err(|_| mismatch("missing".into()))?;
        if view.shape() != shape {
            return Err(mismatch(format!(
                "shape {:?}, expected {shape:?}",
                view.shape()
            )));
        }
        let data = view.data();
        let out = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(mismatch(format!(
                    "dtype {other:?} is not supported (F32, BF16 or F16)"
                )))
            }
        };
        Ok(out)
    }
}

/// One tensor to write: HF name, shape, row-major f32 data.
pub struct TensorOut {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Writes `tensors` as a float32 safetensors file with `metadata`.
///
/// The file is written beside `path` and renamed into place, so an interrupted write never leaves
/// a truncated checkpoint under the final name.
pub fn write_safetensors(
    path: &Path,
    tensors: &[TensorOut],
    metadata: Option<BTreeMap<String, String>>,
) -> Result<()> {
    for t in tensors {
        let want: usize = t.shape.iter().product();
        if want != t.data.len() {
            return Err(Error::ShapeMismatch {
                op: "write_safetensors",
                what: "tensor data",
                expected: t.shape.clone(),
                got: vec![t.data.len()],
            });
        }
    }
    let views = tensors
        .iter()
        .map(|t| {
            safetensors::tensor::TensorView::new(Dtype::F32, t.shape.clone(), le_bytes(&t.data))
                .map(|v| (t.name.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Format {
            path: path.to_path_buf(),
            format: "safetensors",
            problem: e.to_string(),
        })?;
    let tmp = path.with_extension("safetensors.partial");
    let metadata = metadata.map(|m| m.into_iter().collect());
    safetensors::serialize_to_file(views, metadata, &tmp).map_err(|e| Error::Format {
        path: tmp.clone(),
        format: "safetensors",
        problem: e.to_string(),
    })?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// The little-endian bytes of `data`, without a copy.
#[cfg(target_endian = "little")]
fn le_bytes(data: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding, u8 has alignment 1, and the length covers exactly the same
    // memory; on a little-endian target the in-memory bytes are the little-endian encoding.
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) }
}
