//! Open models behind `long` handles, and the backend choice.

use std::path::Path;
use std::sync::{Arc, LazyLock};

use kvsnap_contract::handles::reason;
use kvsnap_contract::{DynModel, Error, HandleTable, Result, Session};
#[cfg(feature = "iree")]
use kvsnap_iree::compile::Target;
#[cfg(feature = "iree")]
use kvsnap_iree::{IreeModel, IreeOptions};
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
        #[cfg(feature = "iree")]
        "iree-cpu" | "iree-vulkan" => {
            let model = Arc::new(IreeModel::load(opts.model_dir, &iree_options(opts)?)?);
            let gather = Arc::clone(&model);
            Ok(OpenModel {
                session: Box::new(Session::from_arc(model)),
                embedding_rows: Some(Box::new(move |ids| gather.embedding_rows(ids))),
            })
        }
        #[cfg(not(feature = "iree"))]
        backend @ ("iree-cpu" | "iree-vulkan") => Err(BridgeError::BadArgument {
            op,
            problem: format!(
                "backend `{backend}` is not built into this library (kvsnap-jni was built \
                 without its `iree` feature; built: reference)"
            ),
        }),
        other => Err(BridgeError::BadArgument {
            op,
            problem: format!("unknown backend `{other}` (known: {})", BACKENDS.join(", ")),
        }),
    }
}

/// The IREE options of `opts`: its module dir, and the Vulkan device ordinal (`device` is a
/// non-negative integer; the CPU takes none, or `cpu`).
#[cfg(feature = "iree")]
fn iree_options(opts: OpenOptions<'_>) -> BridgeResult<IreeOptions> {
    let op = "open";
    let (base, target) = match opts.backend {
        "iree-vulkan" => (IreeOptions::vulkan(), Target::VulkanSpirv),
        _ => (IreeOptions::cpu(), Target::LlvmCpu),
    };
    let device = match (target, opts.device) {
        (_, None) => 0,
        (Target::LlvmCpu, Some("cpu")) => 0,
        (Target::LlvmCpu, Some(other)) => {
            return Err(BridgeError::BadArgument {
                op,
                problem: format!("the iree-cpu backend runs on `cpu`, not `{other}`"),
            })
        }
        (Target::VulkanSpirv, Some(ordinal)) => {
            ordinal
                .trim()
                .parse::<usize>()
                .map_err(|e| BridgeError::BadArgument {
                    op,
                    problem: format!(
                        "iree-vulkan device `{ordinal}` is not a Vulkan device ordinal \
                         (0, 1, ...): {e}"
                    ),
                })?
        }
    };
    Ok(IreeOptions {
        device,
        module_dir: opts.module_dir.map(Path::to_path_buf),
        ..base
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvsnap_contract::Logits;
    use kvsnap_reference::tiny::{self, Preset, DEFAULT_SEED};
    use std::path::PathBuf;

    fn tiny_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvsnap-jni-models-{}", std::process::id()));
        tiny::write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("tiny model written");
        dir
    }

    fn reference(dir: &Path) -> OpenOptions<'_> {
        OpenOptions {
            backend: "reference",
            model_dir: dir,
            module_dir: None,
            device: None,
        }
    }

    #[test]
    fn a_closed_model_reports_closed_not_a_stale_handle() {
        let dir = tiny_dir();
        let h = insert(open(reference(&dir)).unwrap()).unwrap();
        let m = get("prefill", h).unwrap();
        let (kv, _) = m.session.prefill(&[2, 3], Logits::Skip).unwrap();
        drop(m);
        close(h).unwrap();
        for r in [get("prefill", h).map(|_| ()), close(h)] {
            assert!(
                matches!(r, Err(BridgeError::Kv(Error::Closed { .. }))),
                "{r:?}"
            );
        }
        // A handle that never named a model is still a stale handle.
        assert!(matches!(
            get("step", kv),
            Err(BridgeError::Kv(Error::StaleHandle {
                reason: reason::FOREIGN,
                ..
            }))
        ));
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn backend_choice_and_its_options_are_checked() {
        let dir = Path::new("/nonexistent");
        let err = |opts| open(opts).err().expect("open must fail").to_string();
        assert!(err(OpenOptions {
            backend: "cuda",
            ..reference(dir)
        })
        .contains("unknown backend `cuda` (known: reference, iree-cpu, iree-vulkan)"));
        assert!(err(OpenOptions {
            module_dir: Some(Path::new("/m")),
            ..reference(dir)
        })
        .contains("takes no module dir"));
        assert!(matches!(
            open(reference(dir)),
            Err(BridgeError::Kv(Error::Io { .. }))
        ));
    }

    /// Without the `iree` feature, the IREE backends are refused by name, as arguments.
    #[cfg(not(feature = "iree"))]
    #[test]
    fn iree_backends_not_built_are_refused_by_name() {
        let dir = Path::new("/nonexistent");
        for backend in ["iree-cpu", "iree-vulkan"] {
            let e = open(OpenOptions {
                backend,
                ..reference(dir)
            })
            .err()
            .expect("a backend not built must fail");
            assert!(matches!(e, BridgeError::BadArgument { .. }), "{e:?}");
            assert!(
                e.to_string().contains(&format!(
                    "backend `{backend}` is not built into this library"
                )),
                "{e}"
            );
        }
    }

    #[cfg(feature = "iree")]
    #[test]
    fn iree_backend_options_are_checked() {
        let dir = Path::new("/nonexistent");
        let err = |opts| open(opts).err().expect("open must fail").to_string();
        for device in ["-1", "gpu0", "1.5"] {
            let e = open(OpenOptions {
                backend: "iree-vulkan",
                device: Some(device),
                ..reference(dir)
            })
            .err()
            .expect("a bad ordinal must fail");
            assert!(matches!(e, BridgeError::BadArgument { .. }), "{e:?}");
            assert!(
                e.to_string().contains(&format!(
                    "iree-vulkan device `{device}` is not a Vulkan device ordinal"
                )),
                "{e}"
            );
        }
        assert!(err(OpenOptions {
            backend: "iree-cpu",
            device: Some("0"),
            ..reference(dir)
        })
        .contains("the iree-cpu backend runs on `cpu`, not `0`"));
    }
}
