//! Backend selection shared by the subcommands.
//!
//! `KvModel` has an associated KV type, so a backend is chosen by instantiating a generic
//! function per backend: [`with_model!`] loads the chosen backend and runs one body on it.

use std::fmt;
use std::str::FromStr;

use kvsnap_iree::IreeModel;
use kvsnap_reference::ReferenceModel;
use serde_json::{json, Value};

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

/// Says on stderr what the loaded reference runs on ([`kvsnap_reference::LoadReport`]), and
/// warns where its layers did not get the packed layout their kernels want.
pub fn note_reference_load(model: &ReferenceModel) {
    let r = model.load_report();
    let why = if kvsnap_reference::kernels::portable_kernels() {
        format!(
            " ({} is set)",
            kvsnap_reference::kernels::PORTABLE_KERNELS_ENV
        )
    } else {
        String::new()
    };
    let layers = r.packed_layers + r.row_major_layers;
    let huge = r.huge_page_bytes.map_or(String::new(), |b| {
        format!(", {:.0} MB of them on huge pages", b as f64 / 1e6)
    });
    eprintln!(
        "reference: {} kernels{why} on {} threads; {} of {layers} linear layers packed; a \
         decode step streams {:.0} MB{huge}",
        r.kernels.name(),
        r.threads,
        r.packed_layers,
        r.streamed_bytes as f64 / 1e6,
    );
    if !r.layers_as_intended() {
        eprintln!(
            "warning: {} of {layers} linear layers run row-major: the OS could not map their \
             packed copy (slower, the same results)",
            r.row_major_layers
        );
    }
}

/// What loading a backend's model found, recorded beside the benchmarks' figures.
pub trait LoadFacts {
    /// The facts as a JSON object.
    fn load_facts(&self) -> Value;

    /// How the calls so far passed their small inputs to the device, where the backend has a
    /// device: `{"mapped": n, "uploaded": m}` ([`kvsnap_iree::runtime::InputStats`]).
    fn input_facts(&self) -> Option<Value> {
        None
    }

    /// How the calls' results came back to the host so far, where the backend has a device:
    /// `{"mapped": n, "transferred": m}` ([`kvsnap_iree::runtime::ReadStats`]).
    fn read_facts(&self) -> Option<Value> {
        None
    }
}

impl LoadFacts for ReferenceModel {
    fn load_facts(&self) -> Value {
        reference_facts(&self.load_report())
    }
}

/// The reference's load report as a benchmark's facts.
fn reference_facts(r: &kvsnap_reference::LoadReport) -> Value {
    json!({
        "kernels": r.kernels.name(),
        "threads": r.threads,
        "packed_layers": r.packed_layers,
        "row_major_layers": r.row_major_layers,
        "streamed_bytes": r.streamed_bytes,
        "huge_page_bytes": r.huge_page_bytes,
    })
}

impl LoadFacts for IreeModel {
    fn load_facts(&self) -> Value {
        let r = self.load_report();
        json!({
            "mlir_bytes": r.mlir_bytes,
            "compile_s": r.compile.as_secs_f64(),
            "cache_hit": r.cache_hit,
            "zero_copy_imports": r.imports.zero_copy,
            "zero_copy_bytes": r.imports.zero_copy_bytes,
            "copied_imports": r.imports.copied,
            "copied_bytes": r.imports.copied_bytes,
            "objects": r.objects,
        })
    }

    fn input_facts(&self) -> Option<Value> {
        let s = self.device().input_stats();
        Some(json!({ "mapped": s.mapped, "uploaded": s.uploaded }))
    }

    fn read_facts(&self) -> Option<Value> {
        let s = self.device().read_stats();
        Some(json!({ "mapped": s.mapped, "transferred": s.transferred }))
    }
}

/// IREE load options for `backend` (compile progress on stderr; the compiled module from
/// `KVSNAP_MODULE_DIR`, a `kvsnap export` directory, when set; IREE's own code for every
/// product with `KVSNAP_OWN_KERNELS=0`).
pub fn iree_options(backend: Backend) -> anyhow::Result<kvsnap_iree::IreeOptions> {
    let mut opts = match backend {
        Backend::IreeVulkan => kvsnap_iree::IreeOptions::vulkan(),
        _ => kvsnap_iree::IreeOptions::cpu(),
    };
    opts.verbose = true;
    if let Some(dir) = std::env::var_os("KVSNAP_MODULE_DIR") {
        opts.module_dir = Some(dir.into());
    }
    match std::env::var("KVSNAP_OWN_KERNELS").as_deref() {
        Err(_) | Ok("1") => {}
        Ok("0") => opts.own_kernels = false,
        Ok(other) => anyhow::bail!("KVSNAP_OWN_KERNELS must be 0 or 1, got `{other}`"),
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
                let model = kvsnap_reference::ReferenceModel::load($dir)?;
                $crate::commands::backend::note_reference_load(&model);
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvsnap_reference::tiny::{write_model, Preset, DEFAULT_SEED};

    /// The reference's facts in a benchmark's JSON are its load report, key by key.
    #[test]
    fn reference_load_facts_are_its_load_report() {
        let dir = std::env::temp_dir().join(format!("kvsnap-load-facts-{}", std::process::id()));
        write_model(&dir, Preset::Tiny, DEFAULT_SEED).unwrap();
        let model = ReferenceModel::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        // One report: its huge pages are read when it is made, and the kernel may move pages
        // onto huge ones between two reports.
        let r = model.load_report();
        let facts = reference_facts(&r);
        assert_eq!(facts["kernels"], r.kernels.name());
        assert_eq!(facts["threads"], r.threads);
        assert_eq!(facts["packed_layers"], r.packed_layers);
        assert_eq!(facts["row_major_layers"], r.row_major_layers);
        assert_eq!(facts["streamed_bytes"], r.streamed_bytes);
        assert_eq!(facts["huge_page_bytes"], json!(r.huge_page_bytes));
        let layers = kvsnap_contract::KvModel::config(&model).num_layers();
        assert_eq!(r.packed_layers + r.row_major_layers, 4 * layers);
    }
}
