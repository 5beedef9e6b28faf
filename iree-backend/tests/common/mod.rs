//! What the runtime's test binaries share: a module of one `add`, the IREE instance, the
//! compiler, the devices to run on and loading a module onto one.

use std::sync::OnceLock;

use kvsnap_contract::Error;
use kvsnap_iree::compile::{Compiler, Target};
use kvsnap_iree::runtime::{Device, Instance, Session};

/// A module of one function, `add` of two `[4]` f32 tensors.
pub const ADD: &str = r#"
func.func @add(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.add %a, %b : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"#;

/// The process's IREE instance.
pub fn instance() -> &'static Instance {
    static INSTANCE: OnceLock<Instance> = OnceLock::new();
    INSTANCE.get_or_init(|| Instance::new().expect("IREE instance"))
}

/// `iree-compile` 3.13, found once.
pub fn compiler() -> &'static Compiler {
    static COMPILER: OnceLock<Compiler> = OnceLock::new();
    COMPILER.get_or_init(|| {
        Compiler::discover().expect("iree-compile 3.13 (run scripts/setup-iree.sh)")
    })
}

/// The CPU device, plus the first Vulkan device when one exists (else a visible SKIPPED note).
pub fn devices() -> Vec<(Device, Target)> {
    let mut out = vec![(
        Device::cpu(instance()).expect("cpu device"),
        Target::LlvmCpu,
    )];
    match Device::vulkan(instance(), 0) {
        Ok(d) => out.push((d, Target::VulkanSpirv)),
        Err(Error::Unsupported { .. }) => eprintln!("SKIPPED: no Vulkan device"),
        Err(e) => panic!("opening the Vulkan device failed: {e}"),
    }
    out
}

/// `mlir` compiled for `target` and loaded onto `device`.
pub fn load(device: &Device, target: Target, mlir: &str) -> Session {
    let compiled = compiler()
        .compile(mlir, target, &mut |p| eprintln!("{p}"))
        .expect("compile");
    Session::new(device, &compiled.vmfb).expect("load module")
}
