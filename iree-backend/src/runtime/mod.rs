//! A thin safe layer over IREE's C runtime (the `eerie-sys` bindings), mirroring IREE's own
//! layering: [`Instance`] (VM instance + driver registry) -> [`Device`] (a HAL device and its
//! allocator) -> [`Session`] (one compiled module in a VM context) -> [`Session::call`] on
//! [`BufferView`]s (and `i32`s by value, [`Session::call_args`]).
//!
//! Every `_create`/`_release` pair is RAII; every `iree_status_t` becomes
//! [`kvsnap_contract::Error::Backend`] with `backend` `iree-cpu` or `iree-vulkan` (`iree-runtime`
//! before a device exists), the operation, and IREE's formatted status text; the status is freed.
//!
//! Thread safety: `Instance`, `Device` and `BufferView` are `Send + Sync` (IREE synchronises its
//! instance, devices, allocators and queues). `Session` is `Send` but not `Sync`: a VM context must
//! not run two calls at once, so concurrent callers share it behind a `Mutex`.
//!
//! State stays on the device: results are buffer views, [`BufferView::device_copy`] copies on the
//! device queue, and only [`BufferView::read_bytes`] and friends bring data to the host.

mod buffer;
mod device;
mod ffi;
mod instance;
mod session;
mod status;
mod wait;

pub(crate) use buffer::as_bytes;
pub use buffer::{BufferView, ElementType, Transfer, HOST_IMPORT_ALIGNMENT};
pub use device::{
    AllocatorStats, Device, DeviceKind, ImportMode, ImportStats, InputStats, ReadStats,
};
pub use instance::Instance;
pub use session::{Arg, Pending, Session};
