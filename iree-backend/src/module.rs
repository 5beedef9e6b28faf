//! Compiled module directories: a module compiled once (`kvsnap export`) and loaded later
//! without the IREE compiler, as on a phone or a GPU machine without Python.
//!
//! A directory holds, per target, `kvsnap.<target>.mlir`, `kvsnap.<target>.vmfb` and
//! `kvsnap.<target>.json` (format, target, sha256 of the MLIR, compiler version, the GPU a Vulkan
//! module was compiled for, if one, and the options it was exported with: [`ExportOptions`]),
//! and
//! `kvsnap.<target>.tuning.mlir` when the module was compiled with a tuning spec (to repeat the
//! compile by hand: `--iree-codegen-tuning-spec-path`), and the objects it links under the
//! names its MLIR gives them (`kvsnap_avx512_<hash>.o`, [`crate::kernels`]; by hand:
//! `--iree-hal-executable-object-search-path=DIR`).
//!
//! Loading takes the capacity, chunk sizes, input and kernels from the module's description
//! ([`load_options`]), so a loader that sets none of them (the JNI's `moduleDir`) loads a module
//! exported with any, and then checks that the module was compiled from exactly the MLIR this
//! model's config and those options produce: a module built for another config (vocab, layers,
//! window) or on another kind of host is a typed error, not a crash inside IREE.

use std::path::{Path, PathBuf};

use kvsnap_contract::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::compile::Target;
use crate::graphs::Input;
use crate::IreeOptions;

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
    /// The options it was exported with; absent from the descriptions of modules exported
    /// before kvsnap recorded them, which load with the caller's options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exported_with: Option<ExportOptions>,
}

/// What a module's graphs depend on beyond the model's config: the [`IreeOptions`] it was
/// exported with, as loading rebuilds the graphs from them ([`load_options`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportOptions {
    /// The context capacity in tokens (rows of the global layers' KV buffers).
    pub capacity: usize,
    /// The chunk sizes asked for ([`IreeOptions::chunks`]; the decode step's 1 is always
    /// added).
    pub chunks: Vec<usize>,
    /// The input `prefill`/`extend`/`step` go through ([`IreeOptions::chosen_input`]).
    pub input: Input,
    /// Whether the module links kvsnap's own kernels ([`IreeOptions::own_kernels`]: asked for,
    /// and the build and host had them).
    pub own_kernels: bool,
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
/// version `compiler` for the Vulkan target `vulkan_target` (recorded for Vulkan modules only)
/// with the options `exported_with`.
pub fn write(
    dir: &Path,
    target: Target,
    (mlir, vmfb): (&str, &[u8]),
    compiler: &str,
    vulkan_target: Option<&str>,
    exported_with: &ExportOptions,
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
        exported_with: Some(exported_with.clone()),
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
    let graphs = crate::model_graphs(cfg, opts, compiler.vulkan_target());
    let compiled = compiler.compile_tuned(
        &graphs.mlir,
        graphs.tuning_spec.as_deref(),
        &graphs.objects,
        target,
        progress,
    )?;
    let exported_with = ExportOptions {
        capacity: cfg.context_capacity,
        chunks: opts.chunks.clone(),
        input: opts.chosen_input(),
        own_kernels: !graphs.objects.is_empty(),
    };
    write(
        dir,
        target,
        (&graphs.mlir, &compiled.vmfb),
        compiler.version(),
        compiler.vulkan_target(),
        &exported_with,
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

/// `opts` as loading the module of `opts.module_dir` needs them: with the capacity, chunk
/// sizes, input and kernels the module was exported with, so that a loader that sets none of
/// them (the JNI's) loads a module exported with any. `capacity` is the context capacity the
/// caller asks for, if any.
///
/// # Errors
/// [`Error::Format`] naming the module's description where the caller asks for what the module
/// was not exported with: another capacity, another input ([`IreeOptions::input`]), or IREE's
/// code throughout (`own_kernels` false) from a module that links kvsnap's kernels; or where
/// the description is not one, or records a chunk size of 0. [`Error::Io`] where it cannot be
/// read. Without a module dir, or for a module exported before kvsnap recorded its options,
/// `opts` as they are.
pub fn load_options(opts: &IreeOptions, capacity: Option<usize>) -> Result<IreeOptions> {
    let Some(dir) = &opts.module_dir else {
        return Ok(opts.clone());
    };
    let Some(exported) = info(dir, opts.target)?.exported_with else {
        return Ok(opts.clone());
    };
    let json_path = paths(dir, opts.target).2;
    let refuse = |problem: String| Err(bad_module(&json_path, problem));
    if let Some(asked) = capacity.filter(|&c| c != exported.capacity) {
        return refuse(format!(
            "exported for a context capacity of {} tokens, this load asks for {asked}: export \
             it again with `kvsnap export --capacity {asked}`, or load it without a capacity",
            exported.capacity
        ));
    }
    if let Some(asked) = opts.input.filter(|&i| i != exported.input) {
        return refuse(format!(
            "exported for the `{}` input, this load asks for `{}`: export it again with that \
             input, or load it without one",
            exported.input.name(),
            asked.name()
        ));
    }
    if exported.own_kernels && !opts.own_kernels {
        return refuse(
            "links kvsnap's own kernels, this load asks for IREE's code throughout (own kernels \
             off, KVSNAP_OWN_KERNELS=0): export it again with KVSNAP_OWN_KERNELS=0, or load it \
             with them"
                .into(),
        );
    }
    if exported.chunks.contains(&0) {
        return refuse(format!("chunk sizes {:?} hold 0", exported.chunks));
    }
    Ok(IreeOptions {
        capacity: Some(exported.capacity),
        chunks: exported.chunks,
        input: Some(exported.input),
        own_kernels: exported.own_kernels,
        ..opts.clone()
    })
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

    /// A fresh directory under the system's temp dir for the test `name`.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvsnap-module-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn exported(capacity: usize, own_kernels: bool) -> ExportOptions {
        ExportOptions {
            capacity,
            chunks: vec![8, 24],
            input: Input::Embeddings,
            own_kernels,
        }
    }

    #[test]
    fn round_trip_and_mismatch() {
        let dir = scratch("round-trip");
        let options = exported(96, true);
        let write_module = |target, vmfb: &[u8]| {
            write(
                &dir,
                target,
                ("module {}", vmfb),
                "test",
                Some("ampere"),
                &options,
            )
            .unwrap()
        };
        write_module(Target::LlvmCpu, b"vmfb");
        assert_eq!(read(&dir, Target::LlvmCpu, "module {}").unwrap(), b"vmfb");
        // A Vulkan target is recorded for Vulkan modules only; the options for both.
        let recorded = |target| -> ModuleInfo {
            let text = std::fs::read_to_string(paths(&dir, target).2).unwrap();
            serde_json::from_str(&text).unwrap()
        };
        assert_eq!(recorded(Target::LlvmCpu).vulkan_target, None);
        assert_eq!(
            recorded(Target::LlvmCpu).exported_with.as_ref(),
            Some(&options)
        );
        assert_eq!(
            info(&dir, Target::LlvmCpu).unwrap(),
            recorded(Target::LlvmCpu)
        );
        write_module(Target::VulkanSpirv, b"spv");
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

    /// The description's fields as written by hand: the input by name, the options absent from
    /// a module exported before kvsnap recorded them.
    #[test]
    fn description_fields() {
        let text = r#"{"format": "kvsnap-iree-module", "target": "llvm-cpu",
            "mlir_sha256": "00", "compiler": "test",
            "exported_with": {"capacity": 64, "chunks": [8], "input": "ids", "own_kernels": false}}"#;
        let info: ModuleInfo = serde_json::from_str(text).unwrap();
        assert_eq!(
            info.exported_with,
            Some(ExportOptions {
                capacity: 64,
                chunks: vec![8],
                input: Input::Ids,
                own_kernels: false
            })
        );
        let old = r#"{"format": "kvsnap-iree-module", "target": "llvm-cpu",
            "mlir_sha256": "00", "compiler": "test"}"#;
        let info: ModuleInfo = serde_json::from_str(old).unwrap();
        assert_eq!(info.exported_with, None);
    }

    /// Loading takes the module's options where the caller gives none or the defaults, and
    /// refuses, naming the description, what the module was not exported with.
    #[test]
    fn load_options_follow_the_module() {
        let dir = scratch("load-options");
        let json_path = paths(&dir, Target::LlvmCpu).2;
        let export_as = |options: &ExportOptions| {
            write(
                &dir,
                Target::LlvmCpu,
                ("module {}", b"vmfb"),
                "test",
                None,
                options,
            )
            .unwrap()
        };
        let from_dir = IreeOptions {
            module_dir: Some(dir.clone()),
            ..IreeOptions::cpu()
        };
        let refused = |opts: &IreeOptions, capacity, words: &[&str]| {
            let e = load_options(opts, capacity).unwrap_err();
            assert!(
                matches!(&e, Error::Format { path, .. } if *path == json_path),
                "{e:?}"
            );
            for word in words {
                assert!(e.to_string().contains(word), "`{word}` not in: {e}");
            }
        };

        export_as(&exported(96, true));
        let got = load_options(&from_dir, None).unwrap();
        assert_eq!(
            (got.capacity, got.chunks, got.input, got.own_kernels),
            (Some(96), vec![8, 24], Some(Input::Embeddings), true)
        );
        assert_eq!(got.module_dir.as_deref(), Some(dir.as_path()));
        assert_eq!(
            load_options(&from_dir, Some(96)).unwrap().capacity,
            Some(96)
        );
        refused(
            &from_dir,
            Some(128),
            &["capacity of 96 tokens", "asks for 128"],
        );
        let ids = IreeOptions {
            input: Some(Input::Ids),
            ..from_dir.clone()
        };
        refused(&ids, None, &["`embeddings` input", "asks for `ids`"]);
        let without = IreeOptions {
            own_kernels: false,
            ..from_dir.clone()
        };
        refused(&without, None, &["links kvsnap's own kernels"]);

        // A module without kvsnap's kernels loads as such, whatever the caller's default.
        export_as(&exported(96, false));
        assert!(!load_options(&from_dir, None).unwrap().own_kernels);
        assert!(!load_options(&without, None).unwrap().own_kernels);

        export_as(&ExportOptions {
            chunks: vec![0, 8],
            ..exported(96, false)
        });
        refused(&from_dir, None, &["chunk sizes [0, 8] hold 0"]);

        // A description without options, or no module dir: the caller's options.
        let mut info = info(&dir, Target::LlvmCpu).unwrap();
        info.exported_with = None;
        std::fs::write(&json_path, serde_json::to_string(&info).unwrap()).unwrap();
        let got = load_options(&from_dir, None).unwrap();
        assert_eq!((got.capacity, got.input), (None, None));
        assert_eq!(got.chunks, IreeOptions::cpu().chunks);
        let got = load_options(&IreeOptions::cpu(), Some(64)).unwrap();
        assert_eq!((got.capacity, got.module_dir), (None, None));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
