//! Parsing GGUF (versions 2 and 3): header, metadata, tensor infos, tensor data.
//!
//! The file is memory-mapped and treated as hostile: every length, count and offset is checked
//! against the bytes that are actually there before it is used, so a truncated or corrupted file is
//! an [`Error::Format`] naming what is wrong and where, never a panic or a huge allocation.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use kvsnap_contract::{Error, Result};
use memmap2::Mmap;

use super::dequant;
use super::types::GgmlType;

/// Tensor data is aligned to this many bytes unless `general.alignment` says otherwise.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// ggml tensors have at most this many dimensions.
pub const MAX_DIMS: usize = 4;

/// Arrays may hold arrays; deeper nesting than this is treated as corruption.
const MAX_ARRAY_DEPTH: usize = 8;

/// One metadata value.
#[allow(missing_docs)]
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// The element type is kept so that an empty array still says what it holds.
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// The type tag of a metadata value (gguf-py `GGUFValueType`).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type occupies (a string is at least its length field,
    /// an array its type and count), used to reject counts the file cannot hold.
    fn min_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(x) => Some(x.into()),
            Value::U16(x) => Some(x.into()),
            Value::U32(x) => Some(x.into()),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a float of either width.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(x) => Some(x.into()),
            Value::F64(x) => Some(x),
            _ => None,
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, items) => Some(items),
            _ => None,
        }
    }
}

/// Where one tensor is and what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// The GGUF tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGUF order: `dims[0]` (ggml `ne0`) varies fastest, so the row-major shape is
    /// the reverse (see [`TensorInfo::row_major_shape`]).
    pub dims: Vec<u64>,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Start of the data, relative to the start of the data section.
    pub offset: u64,
    /// Bytes of data (whole blocks of `ggml_type`).
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of values.
    pub fn n_elements(&self) -> u64 {
        // Checked when the file was parsed.
        self.dims.iter().product()
    }

    /// The shape in row-major order (slowest dimension first), as Hugging Face and NumPy write it.
    pub fn row_major_shape(&self) -> Vec<usize> {
        // Every dim fits in usize: the product was checked against the file size when parsed.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file: metadata and tensor infos, with tensor data served from the mapping.
pub struct GgufFile {
    path: PathBuf,
    storage: Storage,
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_start: u64,
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        // The smallest header is magic + version + two counts; checking first also avoids mapping
        // an empty file, which some platforms refuse.
        if len < 24 {
            return Err(format_error(
                path,
                format!("file is {len} bytes, too short for a GGUF header (24 bytes)"),
            ));
        }
        // SAFETY: the mapping is read-only and kvsnap never writes a GGUF it has open; a file
        // truncated underneath us is the same hazard as for any mmap-based loader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path.to_path_buf(), Storage::Mapped(mmap))
    }

    /// Parses a GGUF image held in memory; `path` is only used in error messages.
    pub fn from_bytes(bytes: Vec<u8>, path: impl Into<PathBuf>) -> Result<Self> {
        Self::parse(path.into(), Storage::Owned(bytes))
    }

    fn parse(path: PathBuf, storage: Storage) -> Result<Self> {
        let parsed = Parsed::read(storage.bytes()).map_err(|p| format_error(&path, p))?;
        Ok(GgufFile {
            path,
            storage,
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_start: parsed.data_start,
        })
    }

    /// The file these tensors come from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The metadata value under `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (still quantized) bytes of `tensor`.
    pub fn tensor_bytes(&self, tensor: &TensorInfo) -> &[u8] {
        // In range: checked against the file length when parsed.
        let start = (self.data_start + tensor.offset) as usize;
        &self.storage.bytes()[start..start + tensor.n_bytes as usize]
    }

    /// Dequantizes `tensor` to f32 values in GGUF order (`dims[0]` fastest), bit-exactly as
    /// gguf-py 0.19.0 does.
    pub fn dequantize(&self, tensor: &TensorInfo) -> Result<Vec<f32>> {
        if !tensor.ggml_type.can_dequantize() {
            return Err(Error::WeightsMismatch {
                path: self.path.clone(),
                tensor: tensor.name.clone(),
                problem: format!(
                    "ggml type {} cannot be dequantized (supported: F32, F16, BF16, Q8_0, Q5_0, \
                     Q4_K, Q6_K)",
                    tensor.ggml_type
                ),
            });
        }
        let mut out = vec![0.0f32; tensor.n_elements() as usize];
        dequant::dequantize(tensor.ggml_type, self.tensor_bytes(tensor), &mut out)?;
        Ok(out)
    }
}

fn format_error(path: &Path, problem: String) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        format: "gguf",
        problem,
    }
}

/// Parse problems are plain messages until [`GgufFile::parse`] attaches the path.
type Parse<T> = std::result::Result<T, String>;

/// Everything read from the header region.
struct Parsed {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_start: u64,
}

impl Parsed {
    fn read(bytes: &[u8]) -> Parse<Self> {
        let mut c = Cursor { bytes, pos: 0 };
        let magic = c.take(4, "the magic")?;
        if magic != b"GGUF" {
            return Err(format!(
                "bad magic {magic:02x?} (expected \"GGUF\" = [47, 47, 55, 46])"
            ));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            let hint = if version.swap_bytes() <= 3 {
                " (a big-endian GGUF, which is not supported)"
            } else {
                ""
            };
            return Err(format!("version {version} is not supported (2 or 3){hint}"));
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;

        // Each entry is at least a key length, a type tag and one byte.
        let n_kv = c.bounded_count(n_kv, 8 + 4 + 1, "metadata entries")?;
        let mut metadata = Vec::with_capacity(n_kv);
        let mut keys = HashSet::with_capacity(n_kv);
        for i in 0..n_kv {
            let key = c
                .string()
                .map_err(|e| format!("metadata entry #{i}: key: {e}"))?;
            let value = c
                .tagged_value(0)
                .map_err(|e| format!("metadata `{key}`: {e}"))?;
            if !keys.insert(key.clone()) {
                return Err(format!("metadata key `{key}` appears twice"));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(format!(
                        "general.alignment is {v:?}, expected a power of two"
                    ))
                }
            },
        };

        // Each info is at least a name length, n_dims, one dim, a type and an offset.
        let n_tensors = c.bounded_count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensor infos")?;
        let mut tensors = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let t = c
                .tensor_info()
                .map_err(|e| format!("tensor info #{i}: {e}"))?;
            tensors.push(t);
        }

        let file_len = bytes.len() as u64;
        let header_end = c.pos as u64;
        let data_start = header_end.div_ceil(alignment) * alignment;
        if !tensors.is_empty() && data_start > file_len {
            return Err(format!(
                "data section would start at byte {data_start}, past the end of the \
                 {file_len}-byte file"
            ));
        }
        for t in &mut tensors {
            check_tensor(t, alignment, data_start, file_len)
                .map_err(|e| format!("tensor `{}`: {e}", t.name))?;
        }
        let mut names = HashSet::with_capacity(tensors.len());
        if let Some(t) = tensors.iter().find(|t| !names.insert(t.name.as_str())) {
            return Err(format!("tensor `{}` appears twice", t.name));
        }
        Ok(Parsed {
            version,
            metadata,
            tensors,
            alignment,
            data_start,
        })
    }
}

/// Checks a tensor's geometry and that its data lies inside the file; fills in `n_bytes`.
fn check_tensor(t: &mut TensorInfo, alignment: u64, data_start: u64, file_len: u64) -> Parse<()> {
    let (block, block_bytes) = t.ggml_type.block_geometry();
    let n = t
        .dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| format!("dims {:?} overflow", t.dims))?;
    if !t.dims[0].is_multiple_of(block as u64) {
        return Err(format!(
            "dims {:?}: ne0 {} is not a multiple of the {} block size {block}",
            t.dims, t.dims[0], t.ggml_type
        ));
    }
    let n_bytes = (n / block as u64)
        .checked_mul(block_bytes as u64)
        .ok_or_else(|| format!("dims {:?} overflow", t.dims))?;
    if !t.offset.is_multiple_of(alignment) {
        return Err(format!(
            "data offset {} is not a multiple of the alignment {alignment}",
            t.offset
        ));
    }
    let end = data_start
        .checked_add(t.offset)
        .and_then(|s| s.checked_add(n_bytes));
    match end {
        Some(end) if end <= file_len && usize::try_from(end).is_ok() => {}
        _ => {
            return Err(format!(
                "{} {} bytes at data offset {} (file offset {}) run past the end of the \
                 {file_len}-byte file",
                t.ggml_type,
                n_bytes,
                t.offset,
                data_start.saturating_add(t.offset)
            ))
        }
    }
    t.n_bytes = n_bytes;
    Ok(())
}

/// A bounds-checked little-endian reader over the header bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Parse<&'a [u8]> {
        if n > self.left() {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {}, the file has {} left",
                self.pos,
                self.left()
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Parse<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Parse<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Parse<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// `count` items of at least `min_size` bytes each must fit in what is left of the file;
    /// this bounds every allocation by the file size.
    fn bounded_count(&self, count: u64, min_size: usize, what: &str) -> Parse<usize> {
        let fits = (self.left() / min_size) as u64;
        if count > fits {
            return Err(format!(
                "{count} {what} claimed at offset {}, but the {} bytes left hold at most {fits}",
                self.pos,
                self.left()
            ));
        }
        Ok(count as usize)
    }

    fn string(&mut self) -> Parse<String> {
        let at = self.pos;
        let len = self.u64("a string length")?;
        if len > self.left() as u64 {
            return Err(format!(
                "string at offset {at} claims {len} bytes, the file has {} left",
                self.left()
            ));
        }
        let raw = self.take(len as usize, "a string")?;
        String::from_utf8(raw.to_vec())
            .map_err(|e| format!("string at offset {at} is not UTF-8: {e}"))
    }

    fn value_type(&mut self) -> Parse<ValueType> {
        let at = self.pos;
        let id = self.u32("a value type")?;
        ValueType::from_id(id).ok_or_else(|| format!("unknown value type {id} at offset {at}"))
    }

    fn tagged_value(&mut self, depth: usize) -> Parse<Value> {
        let ty = self.value_type()?;
        self.value(ty, depth)
    }

    fn value(&mut self, ty: ValueType, depth: usize) -> Parse<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>("a u8")?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array("an i8")?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("a u16")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("an i16")?)),
            ValueType::U32 => Value::U32(self.u32("a u32")?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("an i32")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("an f32")?)),
            ValueType::U64 => Value::U64(self.u64("a u64")?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("an i64")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("an f64")?)),
            ValueType::Bool => {
                let at = self.pos;
                match self.array::<1>("a bool")?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(format!("bool at offset {at} is {b}, expected 0 or 1")),
                }
            }
            ValueType::String => Value::String(self.string()?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!(
                        "arrays nested deeper than {MAX_ARRAY_DEPTH} at offset {}",
                        self.pos
                    ));
                }
                let elem = self.value_type()?;
                let count = self.u64("an array length")?;
                let count = self.bounded_count(count, elem.min_size(), "array elements")?;
                let mut items = Vec::with_capacity(count);
                for i in 0..count {
                    let v = self
                        .value(elem, depth + 1)
                        .map_err(|e| format!("array element #{i}: {e}"))?;
                    items.push(v);
                }
                Value::Array(elem, items)
            }
        })
    }

    fn tensor_info(&mut self) -> Parse<TensorInfo> {
        let name = self.string().map_err(|e| format!("name: {e}"))?;
        let named = |e: String| format!("`{name}`: {e}");
        let n_dims = self.u32("n_dims").map_err(named)? as usize;
        if !(1..=MAX_DIMS).contains(&n_dims) {
            return Err(named(format!(
                "n_dims is {n_dims}, expected 1..={MAX_DIMS}"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(self.u64("a dimension").map_err(named)?);
        }
        let type_id = self.u32("the tensor type").map_err(named)?;
        let ggml_type = GgmlType::from_id(type_id)
            .ok_or_else(|| named(format!("unknown ggml type id {type_id}")))?;
        let offset = self.u64("the data offset").map_err(named)?;
        Ok(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_bytes: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_accessors_convert_only_what_fits() {
        assert_eq!(Value::I32(-1).as_u64(), None);
        assert_eq!(Value::I64(7).as_u64(), Some(7));
        assert_eq!(Value::U8(3).as_u64(), Some(3));
        assert_eq!(Value::F32(0.5).as_f64(), Some(0.5));
        assert_eq!(Value::U32(1).as_f64(), None);
        assert_eq!(Value::String("x".into()).as_str(), Some("x"));
    }

    #[test]
    fn short_header_is_a_format_error() {
        for len in 0..24 {
            let mut bytes = b"GGUF\x03\0\0\0".to_vec();
            bytes.resize(24, 0);
            bytes.truncate(len);
            let err = GgufFile::from_bytes(bytes, "x.gguf")
                .err()
                .expect("must fail");
            assert!(matches!(err, Error::Format { format: "gguf", .. }), "{err}");
        }
    }
}
