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

    /// Drops this process's resident pages of a mapped tensor (`madvise(MADV_DONTNEED)` on its
    /// range); the file's pages stay in the page cache and a later read maps them in again. For
    /// a loader that copied the tensor elsewhere (a GPU): its RSS then stops counting the
    /// upload. Advice only: an error changes nothing; an owned tensor has nothing to drop.
    pub fn release_resident_pages(&self) -> std::io::Result<()> {
        self.release_resident_range(0..self.len())
    }

    /// [`Tensor::release_resident_pages`] for the elements `elems` only (the pages they touch,
    /// so possibly a neighbour's first or last elements too: they fault in again when read).
    /// A loader that copies a large tensor piece by piece keeps its RSS down this way.
    ///
    /// An out-of-range `elems` is an `InvalidInput` error and changes nothing.
    pub fn release_resident_range(&self, elems: std::ops::Range<usize>) -> std::io::Result<()> {
        if elems.start > elems.end || elems.end > self.len() {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        match &self.storage {
            Storage::Mapped { mmap, offset, .. } => {
                let f32s = std::mem::size_of::<f32>();
                // SAFETY: the mapping is a read-only shared file mapping: after DONTNEED a read
                // faults the same file bytes in again, so every view of it stays valid and
                // unchanged.
                unsafe {
                    mmap.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        offset + elems.start * f32s,
                        elems.len() * f32s,
                    )
                }
            }
            Storage::Owned(_) => Ok(()),
        }
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
                && offset.is_multiple_of(4)
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

/// Alignment of the data section (and, since every tensor's byte size is a multiple of it for
/// the models kvsnap writes, of each tensor): IREE imports host memory without a copy only at
/// 64-byte aligned addresses on the CPU device.
pub const DATA_ALIGNMENT: usize = 64;

/// Writes `tensors` as a float32 safetensors file with `metadata`, tensors in name order.
///
/// The header is padded with spaces (which the format allows) so that the data section starts
/// at a multiple of [`DATA_ALIGNMENT`] bytes, making the tensors of a memory-mapped file directly
/// importable by IREE. The file is written beside `path` and renamed into place, so an
/// interrupted write never leaves a truncated checkpoint under the final name.
pub fn write_safetensors(
    path: &Path,
    tensors: &[TensorOut],
    metadata: Option<BTreeMap<String, String>>,
) -> Result<()> {
    use std::io::Write;

    let mut order: Vec<&TensorOut> = tensors.iter().collect();
    order.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = serde_json::Map::new();
    if let Some(metadata) = metadata {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0usize;
    for t in &order {
        let want: usize = t.shape.iter().product();
        if want != t.data.len() {
            return Err(Error::ShapeMismatch {
                op: "write_safetensors",
                what: "tensor data",
                expected: t.shape.clone(),
                got: vec![t.data.len()],
            });
        }
        if header.contains_key(&t.name) {
            return Err(Error::Format {
                path: path.to_path_buf(),
                format: "safetensors",
                problem: format!("tensor `{}` given twice", t.name),
            });
        }
        let end = offset + 4 * t.data.len();
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": "F32", "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::to_string(&header).expect("a JSON map always serialises");
    let padded = (8 + header.len()).next_multiple_of(DATA_ALIGNMENT) - 8;
    header.extend(std::iter::repeat_n(' ', padded - header.len()));

    let tmp = path.with_extension("safetensors.partial");
    let write = || -> std::io::Result<()> {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(header.as_bytes())?;
        for t in &order {
            out.write_all(le_bytes(&t.data))?;
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(&tmp, e));
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// The little-endian bytes of `data`, without a copy.
#[cfg(target_endian = "little")]
fn le_bytes(data: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding, u8 has alignment 1, and the length covers exactly the same
    // memory; on a little-endian target the in-memory bytes are the little-endian encoding.
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_files_read_back_with_an_aligned_data_section() {
        let dir = std::env::temp_dir().join(format!("kvsnap-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let tensors = vec![
            TensorOut {
                name: "b".into(),
                shape: vec![2, 16],
                data: (0..32).map(|i| i as f32).collect(),
            },
            TensorOut {
                name: "a".into(),
                shape: vec![16],
                data: vec![-1.5; 16],
            },
        ];
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        write_safetensors(&path, &tensors, Some(meta)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!((8 + header_len) % DATA_ALIGNMENT, 0);

        let w = Weights::open(&path).unwrap();
        let b = w.tensor("b", &[2, 16]).unwrap();
        assert!(b.is_mapped());
        assert_eq!(b[31], 31.0);
        assert_eq!(&*w.tensor("a", &[16]).unwrap(), &[-1.5; 16]);
        let e = w.tensor("a", &[4, 4]).err().unwrap();
        assert!(e.to_string().contains("shape [16], expected [4, 4]"), "{e}");
        assert!(matches!(
            w.tensor("c", &[1]),
            Err(Error::WeightsMismatch { .. })
        ));
        // Dropping the resident pages keeps every view valid: reads map the same bytes again.
        b.release_resident_pages().unwrap();
        assert_eq!(&b[..], &(0..32).map(|i| i as f32).collect::<Vec<_>>()[..]);
        b.release_resident_range(8..24).unwrap();
        assert_eq!(&b[..], &(0..32).map(|i| i as f32).collect::<Vec<_>>()[..]);
        assert!(b.release_resident_range(8..33).is_err());
        Tensor::owned(vec![1.0], vec![1])
            .release_resident_pages()
            .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
