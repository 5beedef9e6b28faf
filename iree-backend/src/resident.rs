//! Devices and loaded modules that stay resident for the life of the process, shared by every
//! [`crate::IreeModel`] that runs on them.
//!
//! Opening a device and loading a module are the costly part of a model load that does not depend
//! on the weights: a Vulkan device starts the driver's queues and threads, and a module load
//! creates one compute pipeline per dispatch (Mesa's lavapipe JIT-compiles each with LLVM). A
//! process that reopens a model (an Android app per request, the reliability tests' 1,000
//! open/close cycles) would pay both every time, and on lavapipe each such cycle kept about 6 KiB
//! of RSS (glibc arenas of the driver's threads and the JIT's memory; see docs/RELIABILITY.md).
//! So a model takes both from here:
//!
//! - a device is opened once per (driver, ordinal) and kept: one [`Instance`] for the process;
//! - a module is loaded once per (device, vmfb bytes) and shared by every model using it, whatever
//!   their weights (the graphs take the weights as arguments, so a module holds no model state);
//!   when no model uses it any more (its last [`Lease`] is dropped) it stays resident for the
//!   next load, up to [`MAX_IDLE_MODULES`] idle modules, the least recently used leaving first;
//!   [`release_idle_modules`] drops the idle ones now (an app under memory pressure).
//!
//! Loads that need a new device or module run one at a time (the registry's lock is held while
//! IREE creates them), so two threads never load the same module twice.
//!
//! # At process exit
//! Rust never drops a static, so a resident device would outlive `main`: a Vulkan device's
//! queue-completion threads then still wait in the driver while `exit` tears the driver down.
//! On an NVIDIA H200 (driver 580) every `kvsnap bench` run on iree-vulkan ended in a
//! segmentation fault in those threads, after its work and output were complete
//! (docs/BENCHMARKS.md, twenty-second pass). So each newly opened device registers
//! [`release_unused`] with `atexit`: handlers run in the reverse order of registration, so it
//! runs before the teardown of any driver that was loaded before the device opened. Devices
//! that a model still holds at exit stay open.

use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use kvsnap_contract::Result;
use sha2::{Digest, Sha256};

use crate::runtime::{Device, DeviceKind, Instance, Session};

/// Idle modules (no model uses them) kept resident for the next load.
pub const MAX_IDLE_MODULES: usize = 4;

/// A loaded module shared by the models that run it: a VM context runs one call at a time, so
/// callers lock it for the duration of a call.
type SharedSession = Arc<Mutex<Session>>;

/// A model's use of a resident module. Dropping the last lease of a module makes it idle, and
/// the idle modules beyond [`MAX_IDLE_MODULES`] leave then, the least recently used first.
pub struct Lease {
    session: Option<SharedSession>,
}

impl Lease {
    /// The module's session; lock it for one call.
    pub fn session(&self) -> &Mutex<Session> {
        self.session
            .as_ref()
            .expect("a lease holds its session until it is dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        drop(self.session.take());
        trim_idle(&mut registry(), MAX_IDLE_MODULES);
    }
}

/// What is resident now (for tests and diagnostics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resident {
    /// Open devices.
    pub devices: usize,
    /// Loaded modules, in use or idle.
    pub modules: usize,
    /// Loaded modules no model uses.
    pub idle_modules: usize,
    /// Open devices no model, module or buffer uses.
    pub idle_devices: usize,
}

/// Which device: its driver and ordinal (0 on the CPU).
type DeviceKey = (DeviceKind, usize);

struct Module {
    /// The device it was loaded on (held, so the identity compared below stays unique).
    device: Device,
    vmfb_sha256: [u8; 32],
    session: SharedSession,
    /// Registry clock at the last load that used it (least recently used leaves first).
    last_used: u64,
}

impl Module {
    fn idle(&self) -> bool {
        Arc::strong_count(&self.session) == 1
    }
}

struct Registry {
    instance: Option<Instance>,
    devices: Vec<(DeviceKey, Device)>,
    modules: Vec<Module>,
    clock: u64,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    instance: None,
    devices: Vec::new(),
    modules: Vec::new(),
    clock: 0,
});

/// The registry; a panic while it was held cannot leave it inconsistent (every change is one
/// push or retain), so a poisoned lock is taken over.
fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// The resident device `kind` number `ordinal` (ignored on the CPU), opened on first use. A device
/// that fails to open is not remembered: the next call tries again and reports its own error.
pub fn device(kind: DeviceKind, ordinal: usize) -> Result<Device> {
    let ordinal = match kind {
        DeviceKind::Cpu => 0,
        DeviceKind::Vulkan => ordinal,
    };
    let mut reg = registry();
    if let Some((_, device)) = reg.devices.iter().find(|(k, _)| *k == (kind, ordinal)) {
        return Ok(device.clone());
    }
    let instance = match &reg.instance {
        Some(instance) => instance.clone(),
        None => reg.instance.insert(Instance::new()?).clone(),
    };
    let device = match kind {
        DeviceKind::Cpu => Device::cpu(&instance)?,
        DeviceKind::Vulkan => Device::vulkan(&instance, ordinal)?,
    };
    reg.devices.push(((kind, ordinal), device.clone()));
    // After the device: its driver's own exit handlers are registered by now, and so run later.
    release_at_exit();
    Ok(device)
}

/// Registers [`release_unused`] to run at process exit, once for each newly opened device (a
/// device opened later may bring a driver whose exit handlers come after an earlier
/// registration).
fn release_at_exit() {
    extern "C" {
        fn atexit(f: extern "C" fn()) -> std::os::raw::c_int;
    }
    extern "C" fn on_exit() {
        // No unwinding into C. A registry held by another thread (a load under way as the
        // process exits) is left as it is.
        let _ = std::panic::catch_unwind(|| {
            let mut reg = match REGISTRY.try_lock() {
                Ok(reg) => reg,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => return,
            };
            release_unused_in(&mut reg);
        });
    }
    // Whether it registered or not changes nothing but the exit: ignore the result.
    // SAFETY: `on_exit` is a plain C-ABI function that neither unwinds nor returns a value.
    let _ = unsafe { atexit(on_exit) };
}

/// A lease of the module `vmfb` loaded on `device` (one from [`device`]): the resident one when
/// these exact bytes were loaded on that device before, else a new one.
pub fn session(device: &Device, vmfb: &[u8]) -> Result<Lease> {
    let sha: [u8; 32] = Sha256::digest(vmfb).into();
    let mut reg = registry();
    reg.clock += 1;
    let now = reg.clock;
    if let Some(m) = reg
        .modules
        .iter_mut()
        .find(|m| Arc::ptr_eq(&m.device.inner, &device.inner) && m.vmfb_sha256 == sha)
    {
        m.last_used = now;
        return Ok(Lease {
            session: Some(Arc::clone(&m.session)),
        });
    }
    let session = Arc::new(Mutex::new(Session::new(device, vmfb)?));
    reg.modules.push(Module {
        device: device.clone(),
        vmfb_sha256: sha,
        session: Arc::clone(&session),
        last_used: now,
    });
    Ok(Lease {
        session: Some(session),
    })
}

/// Drops every idle module now; returns how many were dropped. Modules in use stay, and so do the
/// devices (cheap to keep, costly to reopen).
pub fn release_idle_modules() -> usize {
    let mut reg = registry();
    let before = reg.modules.len();
    trim_idle(&mut reg, 0);
    before - reg.modules.len()
}

/// Drops everything only the registry holds: the idle modules, then the devices that no model,
/// module or buffer uses, then the instance once no device is left. Returns what stays
/// resident. Runs at process exit (module documentation); an app may call it to close a GPU
/// device it no longer needs.
pub fn release_unused() -> Resident {
    let mut reg = registry();
    release_unused_in(&mut reg);
    resident_in(&reg)
}

fn release_unused_in(reg: &mut Registry) {
    trim_idle(reg, 0);
    reg.devices.retain(|(_, device)| !device_idle(device));
    if reg.devices.is_empty() {
        reg.instance = None;
    }
}

/// Whether only the registry holds `device` (its entry in `devices`).
fn device_idle(device: &Device) -> bool {
    Arc::strong_count(&device.inner) == 1
}

/// What is resident now.
pub fn resident() -> Resident {
    resident_in(&registry())
}

fn resident_in(reg: &Registry) -> Resident {
    Resident {
        devices: reg.devices.len(),
        modules: reg.modules.len(),
        idle_modules: reg.modules.iter().filter(|m| m.idle()).count(),
        idle_devices: reg.devices.iter().filter(|(_, d)| device_idle(d)).count(),
    }
}

/// Drops the least recently used idle modules until at most `keep` are idle.
fn trim_idle(reg: &mut Registry, keep: usize) {
    let mut idle: Vec<u64> = reg
        .modules
        .iter()
        .filter(|m| m.idle())
        .map(|m| m.last_used)
        .collect();
    if idle.len() <= keep {
        return;
    }
    idle.sort_unstable();
    let cutoff = idle[idle.len() - keep - 1];
    reg.modules.retain(|m| !(m.idle() && m.last_used <= cutoff));
}
