//! Compiled module directories: a module compiled once (`kvsnap export`) and loaded later
//! without the IREE compiler, as on a phone or a GPU machine without Python.
//!
//! A directory holds, per target, `kvsnap.<target>.mlir`, `kvsnap.<target>.vmfb` and
//! `kvsnap.<target>.json` (format, target, sha256 of the MLIR, compiler version, the GPU a Vulkan
//! module was compiled for, if one), and
//! `kvsnap.<target>.tuning.mlir` when the module was compiled with a tuning spec (to repeat the
//! compile by hand: `--iree-codegen-tuning-spec-path`), and the objects it links under the
//! names its MLIR gives them (`kvsnap_avx512_<hash>.o`, [`crate::kernels`]; by hand:
//! `--iree-hal-executable-object-search-path=DIR`). Loading checks
//! that the module was compiled from exactly the MLIR this model's config produces, so a module
//! built for another config (vocab, layers, capacity, chunk sizes) is a typed error, not a crash
//! inside IREE.

use std::path::{Path, PathBuf};

use kvsnap_contract::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::compile::Target;

/// Format name written into a module's JSON.
pub const FORMAT: &str = "kvsnap-iree-module";

/// What a module's JSON records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModuleInfo {
    /// Always [`FORMAT`].
    pub format: String,
    /// The target name (`llvm-cpu`, `vulkan-spirv`).
    pub target: String,
    /// sha256 (hex) of the MLIR the vmfb was compiled from.
    pub mlir_sha256: String,
    /// `iree-compile --version` of the compiler that made it.
    pub compiler: String,
    /// The GPU a Vulkan module was compiled for (`--iree-vulkan-target`); absent: IREE's
    /// default SPIR-V environment, or a CPU module.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vulkan_target: Option<String>,
}

/// Paths of the three files of `target` in `dir`.
pub fn paths(dir: &Path, target: Target) -> (PathBuf, PathBuf, PathBuf) {
    let file = |ext: &str| dir.join(format!("kvsnap.{}.{ext}", target.name()));
    (file("mlir"), file("vmfb"), file("json"))
}

/// sha256 (hex) of `mlir`.
pub fn mlir_sha256(mlir: &str) -> String {
    crate::compile::hex(&Sha256::digest(mlir.as_bytes()))
}

/// Writes the module of `target` into `dir` (created if missing), made by the compiler of
/// version `compiler` for the Vulkan target `vulkan_target` (recorded for Vulkan modules only).
pub fn write(
    dir: &Path,
    target: Target,
    mlir: &str,
    vmfb: &[u8],
    compiler: &str,
    vulkan_target: Option<&str>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let (mlir_path, vmfb_path, json_path) = paths(dir, target);
    let info = ModuleInfo {
        format: FORMAT.into(),
        target: target.name().into(),
        mlir_sha256: mlir_sha256(mlir),
        compiler: compiler.into(),
        vulkan_target: match target {
            Target::VulkanSpirv => vulkan_target.map(str::to_string),
            Target::LlvmCpu => None,
        },
    };
    let json = serde_json::to_string_pretty(&info).expect("ModuleInfo serialises");
    for (path, bytes) in [
        (&mlir_path, mlir.as_bytes()),
        (&vmfb_path, vmfb),
        (&json_path, json.as_bytes()),
    ] {
        std::fs::write(path, bytes).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// Builds the module `IreeModel::load` would run for `cfg` on `target` (default chunk sizes),
/// compiles it through the compile cache (`progress` sees the compiler's progress) and writes it
/// into `dir`: what `kvsnap export` does. Returns the graphs and the compiled module.
pub fn export(
    dir: &Path,
    cfg: &kvsnap_contract::ModelConfig,
    target: Target,
    progress: &mut dyn FnMut(&crate::compile::CompileProgress),
) -> Result<(crate::graphs::Graphs, crate::compile::Compiled)> {
    let compiler = crate::compile::Compiler::discover()?;
    let opts = crate::IreeOptions {
        target,
        ..crate::IreeOptions::cpu()
    };
    export_with(&compiler, dir, cfg, &opts, progress)
}

/// [`export`] with `compiler` (its cache, its Vulkan target) of the module `IreeModel::load`
/// would run with `opts` (its target, chunk sizes, input and own kernels).
pub fn export_with(
    compiler: &crate::compile::Compiler,
    dir: &Path,
    cfg: &kvsnap_contract::ModelConfig,
    opts: &crate::IreeOptions,
    progress: &mut dyn FnMut(&crate::compile::CompileProgress),
) -> Result<(crate::graphs::Graphs, crate::compile::Compiled)> {
    let target = opts.target;
    let graphs = crate::model_graphs(cfg, opts);
    let compiled = compiler.compile_tuned(
        &graphs.mlir,
        graphs.tuning_spec.as_deref(),
        &graphs.objects,
        target,
        progress,
    )?;
    write(
        dir,
        target,
        &graphs.mlir,
        &compiled.vmfb,
        compiler.version(),
        compiler.vulkan_target(),
    )?;
    let spec_path = dir.join(format!("kvsnap.{}.tuning.mlir", target.name()));
    match &graphs.tuning_spec {
        Some(spec) => std::fs::write(&spec_path, spec).map_err(|e| Error::io(&spec_path, e))?,
        None => match std::fs::remove_file(&spec_path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&spec_path, e)),
        },
    }
    // The objects the MLIR links, by the names it gives them: with the spec, enough to repeat
    // the compile by hand (`--iree-hal-executable-object-search-path=DIR`).
    for object in &graphs.objects {
        let path = dir.join(object.name);
        std::fs::write(&path, object.bytes).map_err(|e| Error::io(&path, e))?;
    }
    Ok((graphs, compiled))
}

/// The typed error for a module description at `json_path` that is not what it must be.
fn bad_module(json_path: &Path, problem: String) -> Error {
    Error::Format {
        path: json_path.to_path_buf(),
        format: "kvsnap IREE module",
        problem,
    }
}

/// The description of the module of `target` in `dir`, checked to be one (format and target).
pub fn info(dir: &Path, target: Target) -> Result<ModuleInfo> {
    let json_path = paths(dir, target).2;
    let bad = |problem: String| bad_module(&json_path, problem);
    let text = std::fs::read_to_string(&json_path).map_err(|e| Error::io(&json_path, e))?;
    let info: ModuleInfo =
        serde_json::from_str(&text).map_err(|e| bad(format!("not a module description: {e}")))?;
    if info.format != FORMAT || info.target != target.name() {
        return Err(bad(format!(
            "format `{}` for target `{}`, expected `{FORMAT}` for `{}`",
            info.format,
            info.target,
            target.name()
        )));
    }
    Ok(info)
}

/// Reads the vmfb of `target` from `dir`, checking it was compiled from `mlir`.
pub fn read(dir: &Path, target: Target, mlir: &str) -> Result<Vec<u8>> {
    let (_, vmfb_path, json_path) = paths(dir, target);
    let info = info(dir, target)?;
    let want = mlir_sha256(mlir);
    if info.mlir_sha256 != want {
        return Err(bad_module(
            &json_path,
            format!(
                "compiled for another model config, or on another kind of host (MLIR sha256 \
                 {}, this model's graphs here are {want}; an llvm-cpu module is compiled for \
                 its host's CPU and links kvsnap's own kernels where that CPU has AVX-512): \
                 re-run `kvsnap export` for this model on this kind of host",
                info.mlir_sha256
            ),
        ));
    }
    std::fs::read(&vmfb_path).map_err(|e| Error::io(&vmfb_path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_mismatch() {
        let dir = std::env::temp_dir().join(format!("kvsnap-module-{}", std::process::id()));
        write(
            &dir,
            Target::LlvmCpu,
            "module {}",
            b"vmfb",
            "test",
            Some("ampere"),
        )
        .unwrap();
        assert_eq!(read(&dir, Target::LlvmCpu, "module {}").unwrap(), b"vmfb");
        // A Vulkan target is recorded for Vulkan modules only.
        let recorded = |target| -> ModuleInfo {
            let text = std::fs::read_to_string(paths(&dir, target).2).unwrap();
            serde_json::from_str(&text).unwrap()
        };
        assert_eq!(recorded(Target::LlvmCpu).vulkan_target, None);
        assert_eq!(
            info(&dir, Target::LlvmCpu).unwrap(),
            recorded(Target::LlvmCpu)
        );
        write(
            &dir,
            Target::VulkanSpirv,
            "module {}",
            b"spv",
            "test",
            Some("ampere"),
        )
        .unwrap();
        assert_eq!(
            recorded(Target::VulkanSpirv).vulkan_target.as_deref(),
            Some("ampere")
        );
        assert_eq!(
            read(&dir, Target::VulkanSpirv, "module {}").unwrap(),
            b"spv"
        );
        std::fs::remove_file(paths(&dir, Target::VulkanSpirv).2).unwrap();
        let e = read(&dir, Target::LlvmCpu, "module { other }").unwrap_err();
        assert!(
            e.to_string().contains("compiled for another model config"),
            "{e}"
        );
        let e = read(&dir, Target::VulkanSpirv, "module {}").unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
