//! Backend selection shared by the subcommands.
//!
//! `KvModel` has an associated KV type, so a backend is chosen by instantiating a generic
//! function per backend: [`with_model!`] loads the chosen backend and runs one body on it.

use std::fmt;
use std::str::FromStr;

/// The backends a command can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The pure-Rust CPU reference (`kvsnap-reference`).
    Reference,
    /// IREE on the CPU (llvm-cpu target, local-task device).
    IreeCpu,
    /// IREE on a Vulkan device (vulkan-spirv target); the device ordinal comes from
    /// `KVSNAP_VULKAN_DEVICE` (default 0).
    IreeVulkan,
}

/// Every backend, in CLI order.
pub const ALL: [Backend; 3] = [Backend::Reference, Backend::IreeCpu, Backend::IreeVulkan];

impl Backend {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Reference => "reference",
            Backend::IreeCpu => "iree-cpu",
            Backend::IreeVulkan => "iree-vulkan",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        ALL.into_iter().find(|b| b.name() == s).ok_or_else(|| {
            let known: Vec<&str> = ALL.iter().map(|b| b.name()).collect();
            format!("unknown backend `{s}` (known: {})", known.join(", "))
        })
    }
}

/// Says on stderr when the reference runs its portable kernels
/// ([`kvsnap_reference::kernels::PORTABLE_KERNELS_ENV`]), before it loads.
pub fn note_reference_kernels() {
    if kvsnap_reference::kernels::portable_kernels() {
        eprintln!(
            "reference: the portable kernels ({} is set; no AVX-512 or AVX2)",
            kvsnap_reference::kernels::PORTABLE_KERNELS_ENV
        );
    }
}

/// IREE load options for `backend` (compile progress on stderr; the compiled module from
/// `KVSNAP_MODULE_DIR`, a `kvsnap export` directory, when set).
pub fn iree_options(backend: Backend) -> anyhow::Result<kvsnap_iree::IreeOptions> {
    let mut opts = match backend {
        Backend::IreeVulkan => kvsnap_iree::IreeOptions::vulkan(),
        _ => kvsnap_iree::IreeOptions::cpu(),
    };
    opts.verbose = true;
    if let Some(dir) = std::env::var_os("KVSNAP_MODULE_DIR") {
        opts.module_dir = Some(dir.into());
    }
    if backend == Backend::IreeVulkan {
        if let Ok(ordinal) = std::env::var("KVSNAP_VULKAN_DEVICE") {
            opts.device = ordinal.parse().map_err(|_| {
                anyhow::anyhow!("KVSNAP_VULKAN_DEVICE must be a device ordinal, got `{ordinal}`")
            })?;
        }
    }
    Ok(opts)
}

/// The GPU the `iree-vulkan` module is compiled for, as loading picks it: the `vulkan_target`
/// recorded in the `KVSNAP_MODULE_DIR` module, else `$KVSNAP_VULKAN_TARGET`. `None`: IREE's
/// generic SPIR-V.
pub fn vulkan_target() -> anyhow::Result<Option<String>> {
    use kvsnap_iree::compile::{vulkan_target_from_env, Target};
    if let Some(dir) = std::env::var_os("KVSNAP_MODULE_DIR") {
        return Ok(kvsnap_iree::module::info(dir.as_ref(), Target::VulkanSpirv)?.vulkan_target);
    }
    Ok(vulkan_target_from_env()?)
}

/// Loads `$backend` from model dir `$dir` and evaluates `$body` with `$m` bound to `&model`.
///
/// ```ignore
/// with_model!(args.backend, &args.model, |m| serve(m, &case))
/// ```
macro_rules! with_model {
    ($backend:expr, $dir:expr, |$m:ident| $body:expr) => {{
        let backend = $backend;
        match backend {
            $crate::commands::backend::Backend::Reference => {
                $crate::commands::backend::note_reference_kernels();
                let model = kvsnap_reference::ReferenceModel::load($dir)?;
                let $m = &model;
                $body
            }
            $crate::commands::backend::Backend::IreeCpu
            | $crate::commands::backend::Backend::IreeVulkan => {
                let opts = $crate::commands::backend::iree_options(backend)?;
                let model = kvsnap_iree::IreeModel::load($dir, &opts)?;
                let $m = &model;
                $body
            }
        }
    }};
}
pub(crate) use with_model;
