//! Open models behind `long` handles, and the backend choice.

use std::path::Path;
use std::sync::{Arc, LazyLock};

use kvsnap_contract::handles::reason;
use kvsnap_contract::{DynModel, Error, HandleTable, Result, Session};
use kvsnap_reference::ReferenceModel;

use crate::bridge::{BridgeError, BridgeResult};

/// Backends this library knows, built or not.
pub const BACKENDS: [&str; 3] = ["reference", "iree-cpu", "iree-vulkan"];

/// Gathers the raw embedding rows of ids on the host, where a backend can.
type EmbeddingRows = Box<dyn Fn(&[u32]) -> Result<Vec<f32>> + Send + Sync>;

/// An open model: the contract over handles, plus the backend's host-side embedding gather.
pub struct OpenModel {
    /// The model and its KV states.
    pub session: Box<dyn DynModel>,
    embedding_rows: Option<EmbeddingRows>,
}

impl OpenModel {
    /// Raw embedding rows `[ids.len(), hidden]` of `ids`, as `prefill_embeddings` takes them.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for backends that do not gather on the host.
    pub fn embedding_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        match &self.embedding_rows {
            Some(rows) => rows(ids),
            None => Err(Error::Unsupported {
                backend: self.session.backend(),
                op: "embedding_rows",
            }),
        }
    }
}

/// What to open: the arguments of Java's `KvModel.open`.
#[derive(Clone, Copy, Debug)]
pub struct OpenOptions<'a> {
    /// One of [`BACKENDS`].
    pub backend: &'a str,
    /// Hugging Face checkpoint directory (`config.json`, `model.safetensors`).
    pub model_dir: &'a Path,
    /// Directory of the compiled module (IREE backends only).
    pub module_dir: Option<&'a Path>,
    /// Device name (IREE backends only; e.g. a Vulkan device index).
    pub device: Option<&'a str>,
}

/// Loads the model `opts` describes.
pub fn open(opts: OpenOptions<'_>) -> BridgeResult<OpenModel> {
    let op = "open";
    match opts.backend {
        "reference" => {
            if let Some(dir) = opts.module_dir {
                return Err(BridgeError::BadArgument {
                    op,
                    problem: format!(
                        "the reference backend takes no module dir (got {})",
                        dir.display()
                    ),
                });
            }
            if let Some(device) = opts.device.filter(|d| *d != "cpu") {
                return Err(BridgeError::BadArgument {
                    op,
                    problem: format!("the reference backend runs on `cpu`, not `{device}`"),
                });
            }
            let model = Arc::new(ReferenceModel::load(opts.model_dir)?);
            let gather = Arc::clone(&model);
            Ok(OpenModel {
                session: Box::new(Session::from_arc(model)),
                embedding_rows: Some(Box::new(move |ids| gather.embedding_rows(ids))),
            })
        }
        // IREE BACKENDS GO HERE: when kvsnap-iree's `IreeModel` implements `KvModel`, load it
        // from (model_dir, module_dir, device) and return
        // `OpenModel { session: Box::new(Session::new(model)), embedding_rows: None }`
        // (or a host gather from the model's embedding table, for the Vulkan default).
        "iree-cpu" => Err(not_built("iree-cpu")),
        "iree-vulkan" => Err(not_built("iree-vulkan")),
        other => Err(BridgeError::BadArgument {
            op,
            problem: format!("unknown backend `{other}` (known: {})", BACKENDS.join(", ")),
        }),
    }
}

fn not_built(backend: &'static str) -> BridgeError {
    BridgeError::Kv(Error::Unsupported {
        backend,
        op: "open (this backend is not built into this library yet)",
    })
}

/// The open models. A model handle is a handle of this table; its KV handles are handles of
/// the model's own table, so the two kinds cannot be mixed up.
static MODELS: LazyLock<HandleTable<Arc<OpenModel>>> = LazyLock::new(HandleTable::new);

/// Opens a model and returns its handle.
pub fn insert(model: OpenModel) -> BridgeResult<u64> {
    Ok(MODELS.insert("open", Arc::new(model))?)
}

/// The model of `handle`, shared: calls on it run outside the models table's locks.
///
/// A handle that was closed reports [`Error::Closed`] rather than a stale handle.
pub fn get(op: &'static str, handle: u64) -> BridgeResult<Arc<OpenModel>> {
    MODELS
        .with_ref(op, handle, |m| Ok(Arc::clone(m)))
        .map_err(|e| closed_if_released(op, e).into())
}

/// Closes the model of `handle`: frees all its KV states; calls in progress finish first, and
/// every later call on the model or its states fails.
pub fn close(handle: u64) -> BridgeResult<()> {
    let op = "close";
    let model = MODELS
        .remove(op, handle)
        .map_err(|e| closed_if_released(op, e))?;
    Ok(model.session.close()?)
}

fn closed_if_released(op: &'static str, e: Error) -> Error {
    match e {
        Error::StaleHandle {
            reason: reason::RELEASED | reason::RELEASED_WHILE_WAITING,
            ..
        } => Error::Closed { op },
        e => e,
    }
}
