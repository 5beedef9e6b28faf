//! Model directories for the rows: the tiny model, and broken copies of it (a missing tensor, a
//! wrong shape or dtype, a truncated file, a config that does not match the weights).

use std::path::{Path, PathBuf};

use kvsnap_contract::{Error, ModelConfig, Result};
use kvsnap_reference::tiny::{self, Preset, DEFAULT_SEED};
use kvsnap_reference::TensorOut;
use safetensors::Dtype;

/// Context capacity the rows load models with: small, so the overflow rows are cheap, and past
/// the tiny model's 6-token window, so the sliding rings wrap.
pub const CAPACITY: usize = 48;

/// How a broken model directory differs from the tiny model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Breakage {
    /// `model.layers.3.mlp.up_proj.weight` is not in the file.
    MissingTensor,
    /// `model.layers.1.self_attn.o_proj.weight` is stored transposed (`[128, 64]`).
    WrongShape,
    /// `model.norm.weight` is stored as I64.
    WrongDtype,
    /// `model.safetensors` is cut after this many bytes.
    Truncated(usize),
    /// `config.json` says `vocab_size` 1024 for weights of 512 rows.
    ConfigMismatch,
    /// No `config.json`.
    MissingConfig,
    /// `config.json` is not JSON.
    InvalidConfig,
}

impl Breakage {
    fn dir_name(self) -> String {
        match self {
            Breakage::Truncated(n) => format!("truncated-{n}"),
            other => format!("{other:?}").to_lowercase(),
        }
    }
}

/// Writes the tiny model (`Preset::Tiny`, [`DEFAULT_SEED`]) into `dir`.
pub fn write_tiny(dir: &Path) -> Result<ModelConfig> {
    tiny::write_model(dir, Preset::Tiny, DEFAULT_SEED)
}

/// Bytes of the tiny model's `model.safetensors`.
pub fn tiny_safetensors_len() -> usize {
    let tensors = tiny::random_weights(&tiny::config(Preset::Tiny), DEFAULT_SEED);
    let raw: Vec<RawTensor> = tensors.iter().map(RawTensor::f32).collect();
    safetensors_bytes(&raw).len()
}

/// Writes the tiny model broken by `how` into `root/<breakage>` and returns the directory.
pub fn write_broken(root: &Path, how: Breakage) -> Result<PathBuf> {
    let dir = root.join(how.dir_name());
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let mut config = tiny::config_json(Preset::Tiny);
    let tensors = tiny::random_weights(&tiny::config(Preset::Tiny), DEFAULT_SEED);
    let mut raw: Vec<RawTensor> = tensors.iter().map(RawTensor::f32).collect();
    match how {
        Breakage::MissingTensor => raw.retain(|t| t.name != "model.layers.3.mlp.up_proj.weight"),
        Breakage::WrongShape => {
            let t = find(&mut raw, "model.layers.1.self_attn.o_proj.weight");
            t.shape.reverse();
        }
        Breakage::WrongDtype => {
            let t = find(&mut raw, "model.norm.weight");
            t.dtype = Dtype::I64;
            t.bytes = (0..t.shape[0] as i64).flat_map(i64::to_le_bytes).collect();
        }
        Breakage::ConfigMismatch => {
            let mut json: serde_json::Value =
                serde_json::from_str(&config).expect("the tiny config is JSON");
            json["vocab_size"] = 1024.into();
            config = json.to_string();
        }
        Breakage::Truncated(_) | Breakage::MissingConfig | Breakage::InvalidConfig => {}
    }
    let mut bytes = safetensors_bytes(&raw);
    if let Breakage::Truncated(n) = how {
        bytes.truncate(n);
    }
    write(&dir.join("model.safetensors"), &bytes)?;
    let config_path = dir.join("config.json");
    match how {
        Breakage::MissingConfig => match std::fs::remove_file(&config_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io(&config_path, e))
            }
            _ => {}
        },
        Breakage::InvalidConfig => write(&config_path, b"{\"hidden_size\": 64,")?,
        _ => write(&config_path, config.as_bytes())?,
    }
    Ok(dir)
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
}

fn find<'a>(raw: &'a mut [RawTensor], name: &str) -> &'a mut RawTensor {
    raw.iter_mut()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("the tiny model has no `{name}`"))
}

/// A tensor to write in any dtype.
#[derive(Clone, Debug)]
pub struct RawTensor {
    /// HF name.
    pub name: String,
    /// Stored dtype.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Little-endian data.
    pub bytes: Vec<u8>,
}

impl RawTensor {
    /// The f32 tensor `t`.
    pub fn f32(t: &TensorOut) -> Self {
        RawTensor {
            name: t.name.clone(),
            dtype: Dtype::F32,
            shape: t.shape.clone(),
            bytes: t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// A safetensors image of `tensors`. Panics if a tensor's bytes do not fit its shape and dtype
/// (the fixtures build them consistently).
pub fn safetensors_bytes(tensors: &[RawTensor]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let view = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .unwrap_or_else(|e| panic!("{}: {e}", t.name));
            (t.name.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).expect("serializing consistent tensors")
}
