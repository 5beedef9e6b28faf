//! GGUF import: read a llama.cpp Gemma 3 GGUF, dequantize it bit-exactly as gguf-py 0.19.0 does,
//! and write a float32 Hugging Face checkpoint (`config.json` + `model.safetensors`).
//!
//! Layers: [`reader`] parses the container (hostile-input safe), [`dequant`] turns ggml blocks
//! into f32, [`convert`] maps names, shapes, norms and metadata to HF, and [`import`] ties them
//! together and writes the files atomically.

pub mod convert;
pub mod dequant;
pub mod reader;
pub mod types;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvsnap_contract::{Error, ModelConfig, Result};
use sha2::{Digest, Sha256};

pub use reader::{GgufFile, TensorInfo, Value, ValueType};
pub use types::GgmlType;

use crate::weights::write_safetensors;

/// Version of the importer's output. Bump it whenever the bytes `import` writes for the same GGUF
/// could change, so that stamps written by older versions are recognised as stale.
pub const IMPORTER_VERSION: u32 = 2;

/// What [`import`] did.
#[derive(Clone, Debug)]
pub struct ImportReport {
    /// The `config.json` written.
    pub config_path: PathBuf,
    /// The `model.safetensors` written.
    pub weights_path: PathBuf,
    /// The model described by `config.json`.
    pub config: ModelConfig,
    /// Tensors written.
    pub tensors: usize,
    /// Values over all tensors.
    pub parameters: u64,
    /// How many GGUF tensors each ggml type stored.
    pub tensor_types: BTreeMap<GgmlType, usize>,
    /// Time spent parsing and dequantizing.
    pub dequantize_time: Duration,
    /// Time spent writing the files.
    pub write_time: Duration,
}

/// Imports the Gemma 3 GGUF at `gguf_path` into `out_dir` (created if missing) as
/// `config.json` and a float32 `model.safetensors`, reporting each stage through `progress`.
///
/// Both files are written beside their final names and renamed into place, so an interrupted
/// import never leaves a truncated file under a final name. The config is parsed back with
/// [`ModelConfig::from_json`] and every tensor is checked against it before anything is written.
pub fn import(
    gguf_path: &Path,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<ImportReport> {
    let start = Instant::now();
    let gguf = GgufFile::open(gguf_path)?;
    progress(&format!(
        "parsed {}: GGUF v{}, {} tensors, {} metadata keys",
        gguf_path.display(),
        gguf.version(),
        gguf.tensors().len(),
        gguf.metadata().len()
    ));

    let config_path = out_dir.join("config.json");
    let config_text = serde_json::to_string_pretty(&convert::hf_config(&gguf)?)
        .expect("a serde_json::Value always serializes")
        + "\n";
    let config = ModelConfig::from_json(&config_text, &config_path)?;

    let mut tensor_types = BTreeMap::new();
    for t in gguf.tensors() {
        *tensor_types.entry(t.ggml_type).or_insert(0) += 1;
    }
    let tensors = convert::hf_tensors(&gguf, &config)?;
    let parameters: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    let dequantize_time = start.elapsed();
    let types: Vec<String> = tensor_types
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    progress(&format!(
        "dequantized {} tensors ({}), {:.1} M parameters, in {:.2} s",
        tensors.len(),
        types.join(", "),
        parameters as f64 / 1e6,
        dequantize_time.as_secs_f64()
    ));

    let write_start = Instant::now();
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let weights_path = out_dir.join("model.safetensors");
    let source = gguf_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("kvsnap.source".to_string(), source),
        (
            "kvsnap.importer_version".to_string(),
            IMPORTER_VERSION.to_string(),
        ),
    ]);
    write_safetensors(&weights_path, &tensors, Some(metadata))?;
    write_atomic(&config_path, config_text.as_bytes())?;
    let write_time = write_start.elapsed();
    progress(&format!(
        "wrote {} and {} ({:.0} MB) in {:.2} s",
        config_path.display(),
        weights_path.display(),
        parameters as f64 * 4.0 / 1e6,
        write_time.as_secs_f64()
    ));

    Ok(ImportReport {
        config_path,
        weights_path,
        config,
        tensors: tensors.len(),
        parameters,
        tensor_types,
        dequantize_time,
        write_time,
    })
}

/// Writes `bytes` to `path` through a sibling `.partial` file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// The sha256 of the file at `path`, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(|e| Error::io(path, e))?;
    Ok(hex(&hasher.finalize()))
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
