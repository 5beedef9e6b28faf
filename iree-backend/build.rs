//! Compiles kvsnap's kernels (`kvsnap_iree::kernels`):
//!
//! - the AVX-512 kernels (`kernels/avx512.c`: the chunks' panel products, the screened head's
//!   scores and candidate rows, the decode step's and the chunks' attention) into the object
//!   that llvm-cpu modules link on hosts with AVX-512. Only for x86-64 targets, with the C
//!   compiler `cc` finds (gcc or clang);
//! - the decode step's embedding norm, products, attention, residual norms, GeGLU and head
//!   for Vulkan (`kernels/*.comp`, GLSL) into the SPIR-V that Vulkan modules dispatch, with
//!   `glslangValidator` (Debian's `glslang-tools`; `$GLSLANG_VALIDATOR` names another).
//!
//! Where a compiler is missing or fails, a warning says so and the modules keep IREE's own
//! code for that work.

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "kernels/avx512.c";
/// The shaders: each `(name, source, defines)` compiles `kernels/{source}.comp` with the
/// preprocessor's `defines` to `OUT_DIR/{name}.spv`; and what they include.
const SHADERS: [(&str, &str, &[&str]); 11] = [
    ("attend_split", "attend_split", &[]),
    ("attend_merge", "attend_merge", &[]),
    ("geglu_down", "matvec", &["GEGLU"]),
    ("geglu_down_norm", "matvec", &["GEGLU", "ADD_NORM"]),
    ("matvec", "matvec", &[]),
    ("matvec_norm", "matvec", &["ADD_NORM"]),
    ("embed_norm", "embed_norm", &[]),
    ("head", "matvec", &["ARGMAX"]),
    ("matmul", "matmul", &[]),
    ("add_norm_rows", "add_norm_rows", &[]),
    ("attend_rows", "attend_rows", &[]),
];
const SHADER_INCLUDES: [&str; 3] = [
    "kernels/exp.glsl",
    "kernels/norm.glsl",
    "kernels/add_norm.glsl",
];

fn main() {
    shaders();
    println!("cargo::rerun-if-changed={SOURCE}");
    println!("cargo::rustc-check-cfg=cfg(kvsnap_kernel_object)");
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("x86_64") {
        return;
    }
    let out = out_dir().join("avx512.o");
    let compiler = cc::Build::new().get_compiler();
    // An embedded-ELF object for IREE's linker: position-independent, freestanding, nothing
    // it would have to resolve (no stack protector, no PLT, no calls to memset or memcpy).
    let mut cmd: Command = compiler.to_command();
    cmd.args([
        "-std=c11",
        "-O3",
        "-mavx512f",
        "-mfma",
        "-ffreestanding",
        "-fPIC",
        "-fno-stack-protector",
        "-fno-plt",
        "-fno-asynchronous-unwind-tables",
        "-fno-tree-loop-distribute-patterns",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-c",
        SOURCE,
        "-o",
    ])
    .arg(&out);
    match cmd.output() {
        Ok(o) if o.status.success() => println!("cargo::rustc-cfg=kvsnap_kernel_object"),
        Ok(o) => println!(
            "cargo::warning={SOURCE} did not compile ({}); llvm-cpu modules use IREE's own \
             code: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).replace('\n', " ")
        ),
        Err(e) => println!(
            "cargo::warning=no C compiler for {SOURCE} ({e}); llvm-cpu modules use IREE's own \
             code"
        ),
    }
}

fn out_dir() -> PathBuf {
    PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
}

/// The Vulkan shaders, for SPIR-V 1.3 (Vulkan 1.1); sets the cfg `kvsnap_spirv_kernels`
/// when all compiled.
fn shaders() {
    println!("cargo::rustc-check-cfg=cfg(kvsnap_spirv_kernels)");
    println!("cargo::rerun-if-env-changed=GLSLANG_VALIDATOR");
    for include in SHADER_INCLUDES {
        println!("cargo::rerun-if-changed={include}");
    }
    let tool = std::env::var("GLSLANG_VALIDATOR").unwrap_or_else(|_| "glslangValidator".into());
    for (name, source, defines) in SHADERS {
        let source = format!("kernels/{source}.comp");
        println!("cargo::rerun-if-changed={source}");
        let out = out_dir().join(format!("{name}.spv"));
        let result = Command::new(&tool)
            .args(["-V", "--target-env", "vulkan1.1"])
            .args(defines.iter().map(|d| format!("-D{d}")))
            .arg("-o")
            .arg(&out)
            .arg(&source)
            .output();
        let why = match result {
            Ok(o) if o.status.success() => continue,
            Ok(o) => format!(
                "{source} did not compile ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stdout).replace('\n', " ")
            ),
            Err(e) => format!("no {tool} for {source} ({e}; apt-get install glslang-tools)"),
        };
        println!(
            "cargo::warning={why}; Vulkan modules use IREE's own code for the decode step's layers"
        );
        return;
    }
    println!("cargo::rustc-cfg=kvsnap_spirv_kernels");
}
