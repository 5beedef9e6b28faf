//! `Session`: one compiled module (vmfb) loaded into a VM context on one device, with the HAL
//! module in front of it, and `call` by function name. Mirrors `iree_runtime_session_t`, built
//! directly on the VM API because eerie-sys does not bind `iree/runtime/api.h`.

use std::path::Path;

use kvsnap_contract::{Error, Result};
use kvsnap_reference::LargeBuffer;

use super::buffer::BufferView;
use super::device::Device;
use super::ffi::{self, sys};
use super::status::{backend_error, check, consume_to_string};
use super::wait::Semaphore;

/// One argument of [`Session::call_args`]: a buffer view, or an `i32` passed by value (a
/// function argument of MLIR type `i32`, which the module's host program reads directly).
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    /// A tensor argument.
    View(&'a BufferView),
    /// A scalar argument.
    I32(i32),
}

/// A loaded module ready to call.
///
/// Thread safety: an IREE VM context must not run two invocations at once, so a `Session` is `Send`
/// (it may move between threads) but not `Sync`; share one behind a `Mutex` for concurrent callers.
pub struct Session {
    // Field order is drop order: the context goes first, then the modules it referenced, then the
    // vmfb bytes the bytecode module points into, then the device.
    context: *mut sys::iree_vm_context_t,
    module: *mut sys::iree_vm_module_t,
    hal_module: *mut sys::iree_vm_module_t,
    _vmfb: LargeBuffer<u8>,
    module_name: String,
    functions: Vec<String>,
    device: Device,
    _not_sync: std::marker::PhantomData<std::cell::Cell<()>>,
}

// SAFETY: the VM context and modules have no thread affinity; the only requirement is that they
// are not used by two threads at once, which `!Sync` guarantees (every method takes `&self` on a
// value only one thread can reach).
unsafe impl Send for Session {}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: each handle was created in `Session::new` and is released exactly once, the
        // context (which retains the modules) first.
        unsafe {
            sys::iree_vm_context_release(self.context);
            sys::iree_vm_module_release(self.module);
            sys::iree_vm_module_release(self.hal_module);
        }
    }
}

/// Releases VM objects on early returns while a session is being built.
struct Cleanup {
    hal_module: *mut sys::iree_vm_module_t,
    module: *mut sys::iree_vm_module_t,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        // SAFETY: each non-null pointer holds one reference owned by this guard.
        unsafe {
            if !self.hal_module.is_null() {
                sys::iree_vm_module_release(self.hal_module);
            }
            if !self.module.is_null() {
                sys::iree_vm_module_release(self.module);
            }
        }
    }
}

impl Session {
    /// Loads a compiled module (vmfb bytes, copied) on `device`.
    pub fn new(device: &Device, vmfb: &[u8]) -> Result<Session> {
        let backend = device.backend();
        let vm = device.inner.instance.inner.vm;
        let alloc = ffi::system_allocator();
        // Page-aligned, as the vmfb's 64-byte-aligned archive segments need.
        let vmfb = LargeBuffer::copy_of(vmfb)
            .map_err(|e| backend_error(backend, "load module", e.to_string()))?;
        let mut guard = Cleanup {
            hal_module: std::ptr::null_mut(),
            module: std::ptr::null_mut(),
        };

        // The bytecode module first: a vmfb from another IREE version fails here with a clear
        // status, before any device state is set up.
        // SAFETY: the span points into `vmfb`, which the session keeps alive longer than the
        // module; the null archive allocator tells IREE not to free it.
        let status = unsafe {
            sys::iree_vm_bytecode_module_create(
                vm,
                sys::iree_vm_bytecode_module_flags_e_IREE_VM_BYTECODE_MODULE_FLAG_NONE as _,
                sys::iree_const_byte_span_t {
                    data: vmfb.as_ref().as_ptr(),
                    data_length: vmfb.as_ref().len(),
                },
                ffi::null_allocator(),
                alloc,
                &mut guard.module,
            )
        };
        check(backend, || "load bytecode module (vmfb)".into(), status)?;

        // The HAL module over the device's one-device group, as in
        // iree_runtime_session_create_with_device.
        // SAFETY: the VM instance and group are live; the module retains the group.
        let status = unsafe {
            sys::iree_hal_module_create(
                vm,
                sys::iree_hal_module_device_policy_default(),
                device.inner.group,
                sys::iree_hal_module_flag_bits_t_IREE_HAL_MODULE_FLAG_NONE as _,
                sys::iree_hal_module_debug_sink_null(),
                alloc,
                &mut guard.hal_module,
            )
        };
        check(backend, || "create HAL module".into(), status)?;

        let mut modules = [guard.hal_module, guard.module];
        let mut context: *mut sys::iree_vm_context_t = std::ptr::null_mut();
        // SAFETY: both modules are live; the context retains them; out-pointer to a local.
        let status = unsafe {
            sys::iree_vm_context_create_with_modules(
                vm,
                sys::iree_vm_context_flag_bits_t_IREE_VM_CONTEXT_FLAG_NONE as _,
                modules.len(),
                modules.as_mut_ptr(),
                alloc,
                &mut context,
            )
        };
        check(
            backend,
            || "create VM context (resolve module imports)".into(),
            status,
        )?;

        // SAFETY: the module is live; its name view points into the module and is copied at once.
        let module_name = unsafe { ffi::string_from_view(sys::iree_vm_module_name(guard.module)) };
        // SAFETY: the module is live.
        let functions = unsafe { exported_functions(guard.module) };
        let session = Session {
            context,
            module: std::mem::replace(&mut guard.module, std::ptr::null_mut()),
            hal_module: std::mem::replace(&mut guard.hal_module, std::ptr::null_mut()),
            _vmfb: vmfb,
            module_name,
            functions,
            device: device.clone(),
            _not_sync: std::marker::PhantomData,
        };
        Ok(session)
    }

    /// Loads a compiled module from a vmfb file.
    pub fn from_file(device: &Device, path: impl AsRef<Path>) -> Result<Session> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::new(device, &bytes).map_err(|e| match e {
            Error::Backend {
                backend,
                op,
                status,
            } => Error::Backend {
                backend,
                op: format!("{op} from {}", path.display()),
                status,
            },
            other => other,
        })
    }

    /// The module's name (`module` unless the MLIR names it).
    pub fn module_name(&self) -> &str {
        &self.module_name
    }

    /// The names of the module's exported functions.
    pub fn functions(&self) -> &[String] {
        &self.functions
    }

    /// The device the session runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether `function` takes IREE's coarse-fences ABI, as kvsnap compiles every entry point
    /// (`--iree-execution-model=async-external`): [`Session::call`] then passes it a signal
    /// fence and waits for it on the calling thread, parked. A function compiled synchronously
    /// (a module built with another execution model) is called as it is and waits inside IREE.
    ///
    /// Errors: a function the module does not export.
    pub fn takes_fences(&self, function: &str) -> Result<bool> {
        Ok(self.resolve(function)?.1)
    }

    /// Calls the exported function `function` with buffer-view arguments and returns its results.
    /// Synchronous: when it returns, the results (and any argument IREE updated in place) hold
    /// their final values.
    ///
    /// Errors: a function the module does not export (the message lists the exports), inputs
    /// from another device, and anything IREE rejects (argument count, shapes, element types,
    /// execution failures) with IREE's status text.
    pub fn call(&self, function: &str, inputs: &[&BufferView]) -> Result<Vec<BufferView>> {
        let args: Vec<Arg> = inputs.iter().map(|&v| Arg::View(v)).collect();
        self.call_args(function, &args)
    }

    /// [`Session::call`] with scalar arguments among the buffer views: each [`Arg::I32`] goes to
    /// a function argument of type `i32`. IREE rejects a buffer view for an `i32` argument
    /// ("variant at index 2 is not a value type") and an `i32` for a tensor one, both as
    /// `FAILED_PRECONDITION` errors, and the session stays usable.
    pub fn call_args(&self, function: &str, inputs: &[Arg]) -> Result<Vec<BufferView>> {
        Ok(self.invoke(function, inputs, None, true)?.0)
    }

    /// [`Session::call_args`] without the wait: queues the call, on the device after
    /// `after`'s work (a device-side wait on its signal, not the host's), and returns its
    /// results and its [`Pending`] as soon as it is queued. The results hold their values
    /// once the call is done ([`Pending::wait`], or a later call queued after it that was
    /// waited for); until then nothing may read them on the host.
    ///
    /// Errors: as [`Session::call_args`], and a function that does not take the
    /// coarse-fences ABI ([`Session::takes_fences`]), which cannot be queued.
    pub fn call_queued(
        &self,
        function: &str,
        inputs: &[Arg],
        after: Option<&Pending>,
    ) -> Result<(Vec<BufferView>, Pending)> {
        let op = format!("call {}.{function}", self.module_name);
        let (outs, signal) = self.invoke(function, inputs, after, false)?;
        let signal = signal.ok_or_else(|| {
            backend_error(
                self.device.backend(),
                op.clone(),
                "the call came back without its signal",
            )
        })?;
        let backend = self.device.backend();
        Ok((
            outs,
            Pending {
                signal,
                backend,
                op,
            },
        ))
    }

    /// Calls `function`: after `after`'s work where given, waiting for its own where `wait`.
    /// Returns the results and, for a coarse-fences function, its signal. A call that is not
    /// to wait must be a coarse-fences one (else it is refused before it runs).
    fn invoke(
        &self,
        function: &str,
        inputs: &[Arg],
        after: Option<&Pending>,
        wait: bool,
    ) -> Result<(Vec<BufferView>, Option<Signal>)> {
        let backend = self.device.backend();
        let op = || format!("call {}.{function}", self.module_name);
        let (resolved, fenced) = self.resolve(function)?;
        if !fenced && (!wait || after.is_some()) {
            return Err(backend_error(
                backend,
                op(),
                "the function waits for its work inside IREE (not compiled with coarse fences), so it cannot be queued",
            ));
        }
        let foreign = inputs.iter().enumerate().find_map(|(i, a)| match a {
            Arg::View(b) if !b.device().same_device(&self.device) => Some((i, b)),
            _ => None,
        });
        if let Some((i, view)) = foreign {
            return Err(backend_error(
                backend,
                op(),
                format!(
                    "input {i} lives on another device ({}), not on {}",
                    view.device().name(),
                    self.device.name()
                ),
            ));
        }

        let alloc = ffi::system_allocator();
        let input_list = VmList::new(inputs.len(), backend)?;
        for arg in inputs {
            let status = match arg {
                // SAFETY: the list and the view are live.
                Arg::View(view) => unsafe {
                    push_ref(
                        &input_list,
                        sys::iree_hal_buffer_view_retain_ref(view.raw()),
                    )
                },
                Arg::I32(x) => {
                    let value = sys::iree_vm_value_t {
                        type_: sys::iree_vm_value_type_e_IREE_VM_VALUE_TYPE_I32 as _,
                        __bindgen_anon_1: sys::iree_vm_value_t__bindgen_ty_1 { i32_: *x },
                    };
                    // SAFETY: the list is live; the value is copied into it.
                    unsafe { sys::iree_vm_list_push_value(input_list.0, &value) }
                }
            };
            check(backend, || format!("{}: pass inputs", op()), status)?;
        }
        // A coarse-fences function returns once its work is queued: no wait fence (its inputs
        // are ready), and a signal fence at 1 on a fresh semaphore that this thread waits on.
        let signal = if fenced {
            let signal = Signal::new(&self.device)?;
            let fences = || format!("{}: pass fences", op());
            // SAFETY: the list is live; a null ref is the absent wait fence, else `after`'s
            // live signal fence.
            let status = unsafe {
                let wait_fence = after.map_or_else(sys::iree_vm_ref_t::default, |p| {
                    sys::iree_hal_fence_retain_ref(p.signal.fence)
                });
                push_ref(&input_list, wait_fence)
            };
            check(backend, fences, status)?;
            // SAFETY: the list and the signal's fence are live.
            let status =
                unsafe { push_ref(&input_list, sys::iree_hal_fence_retain_ref(signal.fence)) };
            check(backend, fences, status)?;
            Some(signal)
        } else {
            None
        };
        let output_list = VmList::new(4, backend)?;
        // SAFETY: context, function and lists are live; `self` is not shared between threads
        // (`!Sync`), so the context runs one invocation at a time.
        let status = unsafe {
            sys::iree_vm_invoke(
                self.context,
                resolved,
                sys::iree_vm_invocation_flag_bits_t_IREE_VM_INVOCATION_FLAG_NONE as _,
                std::ptr::null(),
                input_list.0,
                output_list.0,
                alloc,
            )
        };
        check(backend, op, status)?;
        if let Some(signal) = signal.as_ref().filter(|_| wait) {
            signal.semaphore.wait(1, backend, op)?;
        }

        // SAFETY: the output list is live.
        let count = unsafe { sys::iree_vm_list_size(output_list.0) };
        let mut outputs = Vec::with_capacity(count);
        for i in 0..count {
            let mut r = sys::iree_vm_ref_t::default();
            // SAFETY: `i` is in range; on success `r` holds one reference we own.
            let status = unsafe { sys::iree_vm_list_get_ref_retain(output_list.0, i, &mut r) };
            check(backend, || format!("{}: result {i}", op()), status)?;
            let mut view: *mut sys::iree_hal_buffer_view_t = std::ptr::null_mut();
            // SAFETY: `r` is a valid ref; check_deref only inspects its type tag.
            let status = unsafe { sys::iree_hal_buffer_view_check_deref(r, &mut view) };
            if !status.is_null() {
                // SAFETY: we own `r`'s reference.
                unsafe { sys::iree_vm_ref_release(&mut r) };
                return Err(backend_error(
                    backend,
                    op(),
                    format!(
                        "result {i} is not a buffer view (kvsnap functions return tensors): {}",
                        consume_to_string(status)
                    ),
                ));
            }
            // SAFETY: `r`'s reference is handed to the BufferView (which releases it on drop);
            // results of a call on this session live on its device.
            outputs.push(unsafe { BufferView::from_raw(view, &self.device) });
        }
        Ok((outputs, signal))
    }

    /// The exported function `function`, and whether it takes the coarse-fences ABI (a wait
    /// and a signal fence after its arguments, returning once its work is queued).
    fn resolve(&self, function: &str) -> Result<(sys::iree_vm_function_t, bool)> {
        let full_name = format!("{}.{function}", self.module_name);
        let mut resolved = sys::iree_vm_function_t {
            module: std::ptr::null_mut(),
            linkage: 0,
            ordinal: 0,
        };
        // SAFETY: the context is live; the name view borrows `full_name` for the call.
        let status = unsafe {
            sys::iree_vm_context_resolve_function(
                self.context,
                ffi::string_view(&full_name),
                &mut resolved,
            )
        };
        if status.is_null() {
            // SAFETY: `resolved` was filled in; the attribute view points into the module.
            let model = unsafe {
                ffi::string_from_view(sys::iree_vm_function_lookup_attr_by_name(
                    &resolved,
                    ffi::string_view("iree.abi.model"),
                ))
            };
            return Ok((resolved, model == "coarse-fences"));
        }
        let text = consume_to_string(status);
        Err(backend_error(
            self.device.backend(),
            format!("call {full_name}"),
            format!(
                "the module has no function `{function}` (exports: {}): {text}",
                self.functions.join(", ")
            ),
        ))
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("module", &self.module_name)
            .field("functions", &self.functions)
            .field("device", &self.device)
            .finish()
    }
}

/// A call [`Session::call_queued`] queued: its work may still be running on the device.
/// Dropping it does not wait (the device keeps what queued work uses alive until it is done).
pub struct Pending {
    signal: Signal,
    backend: &'static str,
    /// `call MODULE.FUNCTION`, for errors.
    op: String,
}

impl Pending {
    /// Blocks the calling thread, parked, until the call's work (and so the work of every
    /// call it was queued after) is done.
    ///
    /// Errors: the work's failure, with IREE's status text.
    pub fn wait(&self) -> Result<()> {
        self.signal
            .semaphore
            .wait(1, self.backend, || self.op.clone())
    }
}

/// A call's signal: a fresh semaphore and the fence that has it reach 1, both released on drop.
struct Signal {
    semaphore: Semaphore,
    fence: *mut sys::iree_hal_fence_t,
}

impl Signal {
    fn new(device: &Device) -> Result<Signal> {
        let semaphore = Semaphore::new(device, 0, || "create a call's semaphore".into())?;
        let mut fence = std::ptr::null_mut();
        // SAFETY: the semaphore is live; the fence retains it; out-pointer to a local.
        let status = unsafe {
            sys::iree_hal_fence_create_at(
                semaphore.raw(),
                1,
                sys::iree_hal_device_host_allocator(device.inner.raw),
                &mut fence,
            )
        };
        check(
            device.backend(),
            || "create a call's signal fence".into(),
            status,
        )?;
        Ok(Signal { semaphore, fence })
    }
}

impl Drop for Signal {
    fn drop(&mut self) {
        // SAFETY: the one reference `new` created.
        unsafe { sys::iree_hal_fence_release(self.fence) };
    }
}

/// Pushes `r`, a reference of ours, onto `list`: the list takes it over, or it is released
/// if the push fails. Returns the push's status.
///
/// # Safety
/// `list` is live and `r` a valid (or null) reference that the caller gives up.
unsafe fn push_ref(list: &VmList, mut r: sys::iree_vm_ref_t) -> sys::iree_status_t {
    // SAFETY: the caller's contract.
    unsafe {
        let status = sys::iree_vm_list_push_ref_move(list.0, &mut r);
        if !status.is_null() {
            sys::iree_vm_ref_release(&mut r);
        }
        status
    }
}

/// A VM variant list released on drop.
struct VmList(*mut sys::iree_vm_list_t);

impl VmList {
    fn new(capacity: usize, backend: &'static str) -> Result<VmList> {
        let mut list: *mut sys::iree_vm_list_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        let status = unsafe {
            sys::iree_vm_list_create(
                ffi::undefined_type_def(),
                capacity,
                ffi::system_allocator(),
                &mut list,
            )
        };
        check(backend, || "create VM list".into(), status)?;
        Ok(VmList(list))
    }
}

impl Drop for VmList {
    fn drop(&mut self) {
        // SAFETY: the list was created by `VmList::new` and is released once.
        unsafe { sys::iree_vm_list_release(self.0) };
    }
}

/// Names of a module's exported functions (internal `$async` variants included as IREE lists them).
///
/// # Safety
/// `module` must be a live VM module.
unsafe fn exported_functions(module: *mut sys::iree_vm_module_t) -> Vec<String> {
    // SAFETY: the caller guarantees `module` is live.
    let signature = unsafe { sys::iree_vm_module_signature(module) };
    let mut names = Vec::with_capacity(signature.export_function_count);
    for ordinal in 0..signature.export_function_count {
        let mut f = sys::iree_vm_function_t {
            module: std::ptr::null_mut(),
            linkage: 0,
            ordinal: 0,
        };
        // SAFETY: `ordinal` is below the export count; out-pointer to a local.
        let status = unsafe {
            sys::iree_vm_module_lookup_function_by_ordinal(
                module,
                sys::iree_vm_function_linkage_e_IREE_VM_FUNCTION_LINKAGE_EXPORT as _,
                ordinal,
                &mut f,
            )
        };
        if status.is_null() {
            // SAFETY: `f` was filled in; its name points into the module.
            names.push(unsafe { ffi::string_from_view(sys::iree_vm_function_name(&f)) });
        } else {
            consume_to_string(status);
        }
    }
    names
}
