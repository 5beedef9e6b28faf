//! Compiles kvsnap's AVX-512 kernels (`kernels/avx512.c`: the chunks' panel products, the
//! screened head's scores and candidate rows, the decode step's and the chunks' attention)
//! into the object that llvm-cpu modules link on hosts with AVX-512 (`kvsnap_iree::kernels`).
//! Only for x86-64 targets, with the C compiler `cc` finds (gcc or clang); where there is none
//! or it fails, a warning says so and the modules keep IREE's own code for that work.

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "kernels/avx512.c";

fn main() {
    println!("cargo::rerun-if-changed={SOURCE}");
    println!("cargo::rustc-check-cfg=cfg(kvsnap_kernel_object)");
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("x86_64") {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("avx512.o");
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
