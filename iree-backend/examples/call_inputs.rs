//! What a decode step's three small inputs cost before its call, on each device: uploaded
//! (`BufferView::from_f32` / `from_i32`: a queue submission and a wait each) or written through
//! a host mapping (`BufferView::input_f32` / `input_i32`, what the model uses); and what its
//! token costs after it: read from device memory (a transfer: a submission and a wait) or
//! through a mapping of the host memory the call wrote it to (`BufferView::host_result`, what
//! the model passes).
//!
//! ```text
//! cargo run --release -p kvsnap-iree --example call_inputs
//! ```

use std::time::Instant;

use kvsnap_iree::runtime::{BufferView, Device, ElementType, Instance};

/// Rounds of the three inputs per timing.
const ROUNDS: u32 = 500;

fn main() -> kvsnap_contract::Result<()> {
    let instance = Instance::new()?;
    let mut devices = vec![("iree-cpu", Device::cpu(&instance)?)];
    match Device::vulkan(&instance, 0) {
        Ok(device) => devices.push(("iree-vulkan", device)),
        Err(e) => eprintln!("no Vulkan device: {e}"),
    }
    let row = vec![0.5f32; 640]; // one embedding row of Gemma 3 270M
    for (name, device) in &devices {
        for round in 1..=2 {
            let time = |f: &dyn Fn() -> kvsnap_contract::Result<()>| {
                let start = Instant::now();
                for _ in 0..ROUNDS {
                    f()?;
                }
                Ok::<_, kvsnap_contract::Error>(start.elapsed().as_secs_f64() * 1e6 / ROUNDS as f64)
            };
            let uploaded = time(&|| {
                BufferView::from_f32(device, &[1, 640], &row)?;
                BufferView::from_i32(device, &[], &[860])?;
                BufferView::from_i32(device, &[], &[1]).map(drop)
            })?;
            let mapped = time(&|| {
                BufferView::input_f32(device, &[1, 640], &row)?;
                BufferView::input_i32(device, &[], &[860])?;
                BufferView::input_i32(device, &[], &[1]).map(drop)
            })?;
            println!("{name} (round {round}): the step's three inputs uploaded {uploaded:.1} us, written through a mapping {mapped:.1} us");
            let local = BufferView::from_i32(device, &[], &[7])?;
            let host = BufferView::host_result(device, &[], ElementType::I32)?;
            host.write_bytes(&7i32.to_le_bytes())?;
            let transferred = time(&|| local.to_i32_vec().map(drop))?;
            let read = time(&|| host.to_i32_vec().map(drop))?;
            println!("{name} (round {round}): the step's token read from device memory {transferred:.1} us, through a mapping {read:.1} us");
        }
    }
    Ok(())
}
