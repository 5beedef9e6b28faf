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

use std::sync::{Arc, Mutex, MutexGuard};

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
    Ok(device)
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

/// What is resident now.
pub fn resident() -> Resident {
    let reg = registry();
    Resident {
        devices: reg.devices.len(),
        modules: reg.modules.len(),
        idle_modules: reg.modules.iter().filter(|m| m.idle()).count(),
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
