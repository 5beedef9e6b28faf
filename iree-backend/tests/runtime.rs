//! The IREE runtime layer end to end: hand-written StableHLO compiled by `iree-compile` 3.13 and
//! run through `kvsnap_iree::runtime` on the CPU (local-task) and, when one exists, on a Vulkan
//! device (lavapipe in CI). Also records how IREE treats cache arguments (in place or not): the
//! findings are written up in docs/IREE.md.

mod common;

use std::sync::Arc;

use common::{compiler, devices, instance, load, ADD};
use kvsnap_contract::Error;
use kvsnap_iree::compile::{Compiler, Target};
use kvsnap_iree::runtime::{
    Arg, BufferView, Device, DeviceKind, ElementType, ImportMode, Instance, Session, Transfer,
    HOST_IMPORT_ALIGNMENT,
};

/// Cache rows R, width W. A dynamic_update_slice of one row at a runtime position.
const DUS: &str = r#"
func.func @update(%cache: tensor<16x8xf32>, %row: tensor<1x8xf32>, %pos: tensor<i32>) -> tensor<16x8xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %0 = stablehlo.dynamic_update_slice %cache, %row, %pos, %c0 : (tensor<16x8xf32>, tensor<1x8xf32>, tensor<i32>, tensor<i32>) -> tensor<16x8xf32>
  return %0 : tensor<16x8xf32>
}
"#;

/// The same update at a row passed by value (`i32`, not a tensor), taken modulo 16 by the
/// module's host program.
const DUS_AT: &str = r#"
func.func @update_at(%cache: tensor<16x8xf32>, %row: tensor<1x8xf32>, %at: i32) -> tensor<16x8xf32> {
  %c16 = arith.constant 16 : i32
  %r = arith.remsi %at, %c16 : i32
  %pos = tensor.from_elements %r : tensor<i32>
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %0 = stablehlo.dynamic_update_slice %cache, %row, %pos, %c0 : (tensor<16x8xf32>, tensor<1x8xf32>, tensor<i32>, tensor<i32>) -> tensor<16x8xf32>
  return %0 : tensor<16x8xf32>
}
"#;

/// Scatter of 3 rows at rows base, base+1, base+2 (indices computed on the device).
const SCATTER: &str = r#"
func.func @scatter(%cache: tensor<16x8xf32>, %rows: tensor<3x8xf32>, %base: tensor<i32>) -> tensor<16x8xf32> {
  %iota = stablehlo.iota dim = 0 : tensor<3xi32>
  %b = stablehlo.broadcast_in_dim %base, dims = [] : (tensor<i32>) -> tensor<3xi32>
  %idx = stablehlo.add %iota, %b : tensor<3xi32>
  %idx2 = stablehlo.reshape %idx : (tensor<3xi32>) -> tensor<3x1xi32>
  %0 = "stablehlo.scatter"(%cache, %idx2, %rows) ({
    ^bb0(%old: tensor<f32>, %new: tensor<f32>):
      stablehlo.return %new : tensor<f32>
  }) {
    scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>,
    indices_are_sorted = true, unique_indices = true
  } : (tensor<16x8xf32>, tensor<3x1xi32>, tensor<3x8xf32>) -> tensor<16x8xf32>
  return %0 : tensor<16x8xf32>
}
"#;

/// The index of the largest of 4 values, written to storage the caller passes
/// (`iree.abi.output`), as the model's entry points return their token.
const ARGMAX_INTO: &str = r#"
func.func @argmax(%x: tensor<4xf32>, %out: tensor<i32> {iree.abi.output = 0 : index}) -> tensor<i32> {
  %iota = stablehlo.iota dim = 0 : tensor<4xi32>
  %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>
  %zero = stablehlo.constant dense<0> : tensor<i32>
  %r:2 = stablehlo.reduce(%x init: %ninf), (%iota init: %zero) across dimensions = [0] : (tensor<4xf32>, tensor<4xi32>, tensor<f32>, tensor<i32>) -> (tensor<f32>, tensor<i32>)
    reducer(%a: tensor<f32>, %b: tensor<f32>) (%i: tensor<i32>, %j: tensor<i32>) {
      %gt = stablehlo.compare GT, %b, %a : (tensor<f32>, tensor<f32>) -> tensor<i1>
      %m = stablehlo.select %gt, %b, %a : tensor<i1>, tensor<f32>
      %k = stablehlo.select %gt, %j, %i : tensor<i1>, tensor<i32>
      stablehlo.return %m, %k : tensor<f32>, tensor<i32>
    }
  return %r#1 : tensor<i32>
}
"#;

const ROWS: usize = 16;
const WIDTH: usize = 8;

/// Cache contents where element (r, c) is r * 100 + c.
fn cache_values() -> Vec<f32> {
    (0..ROWS * WIDTH)
        .map(|i| ((i / WIDTH) * 100 + i % WIDTH) as f32)
        .collect()
}

fn row_values(tag: f32, n: usize) -> Vec<f32> {
    (0..n * WIDTH).map(|i| -(tag + i as f32)).collect()
}

/// The expected cache after writing `rows` (row-major, WIDTH wide) at `start`, dropping rows past
/// the end.
fn expected_after(start: usize, rows: &[f32]) -> Vec<f32> {
    let mut want = cache_values();
    for (k, row) in rows.chunks(WIDTH).enumerate() {
        let r = start + k;
        if r < ROWS {
            want[r * WIDTH..(r + 1) * WIDTH].copy_from_slice(row);
        }
    }
    want
}

#[test]
fn add_two_tensors() {
    for (device, target) in devices() {
        let session = load(&device, target, ADD);
        assert!(session.functions().iter().any(|f| f == "add"));
        let a = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let b = BufferView::from_f32(&device, &[4], &[10.0, 20.0, 30.0, 40.5]).unwrap();
        let out = session.call("add", &[&a, &b]).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].shape(), vec![4]);
        assert_eq!(out[0].element_type(), Some(ElementType::F32));
        assert_eq!(out[0].byte_length(), 16);
        assert_eq!(
            out[0].to_f32_vec().unwrap(),
            vec![11.0, 22.0, 33.0, 44.5],
            "{target:?}"
        );
    }
}

/// A call's inputs written through a host mapping (`BufferView::input`, host memory on
/// Vulkan; uploaded on the CPU device) are what a dispatch reads, call after call in new
/// buffers; a length that does not fit the shape is a typed error.
#[test]
fn inputs_written_through_a_mapping_feed_a_call() {
    for (device, target) in devices() {
        let before = device.input_stats();
        let session = load(&device, target, ADD);
        for k in 0..20 {
            let x = k as f32;
            let a = BufferView::input_f32(&device, &[4], &[x, 2.0, 3.0, 4.0]).unwrap();
            let b = BufferView::input_f32(&device, &[4], &[10.0, 20.0, 30.0, x]).unwrap();
            assert_eq!(a.shape(), vec![4]);
            let out = session.call("add", &[&a, &b]).unwrap();
            assert_eq!(
                out[0].to_f32_vec().unwrap(),
                vec![x + 10.0, 22.0, 33.0, 4.0 + x],
                "{target:?}, call {k}"
            );
        }
        let ids = BufferView::input_i32(&device, &[3], &[5, -1, 7]).unwrap();
        assert_eq!(ids.to_i32_vec().unwrap(), vec![5, -1, 7], "{target:?}");
        let scalar = BufferView::input_i32(&device, &[], &[860]).unwrap();
        assert_eq!(scalar.to_i32_vec().unwrap(), vec![860], "{target:?}");
        assert!(matches!(
            BufferView::input_f32(&device, &[2, 3], &[1.0; 5]),
            Err(Error::ShapeMismatch { .. })
        ));
        // 42 inputs, all mapped where the driver offers the host memory (lavapipe in CI does).
        let after = device.input_stats();
        let (mapped, uploaded) = (
            after.mapped - before.mapped,
            after.uploaded - before.uploaded,
        );
        match target {
            Target::VulkanSpirv => assert_eq!((mapped, uploaded), (42, 0), "{target:?}"),
            Target::LlvmCpu => assert_eq!((mapped, uploaded), (0, 42), "{target:?}"),
        }
    }
}

/// A result written into storage the caller passes (`iree.abi.output`) comes back in that
/// storage, call after call; where it is host memory (`BufferView::host_result`: lavapipe's
/// and the CPU device's) the host reads it through a mapping, with no transfer.
#[test]
fn a_result_written_into_host_storage_is_read_without_a_transfer() {
    for (device, target) in devices() {
        let session = load(&device, target, ARGMAX_INTO);
        let out = BufferView::host_result(&device, &[], ElementType::I32).unwrap();
        assert!(out.host_readable(), "{target:?}");
        let before = device.read_stats();
        for k in 0..12 {
            let mut x = [0.5f32, -1.0, 0.25, 0.0];
            x[k % 4] = 2.0 + k as f32;
            let x = BufferView::input_f32(&device, &[4], &x).unwrap();
            let result = session.call("argmax", &[&x, &out]).unwrap();
            assert!(result[0].shares_storage_with(&out), "{target:?}, call {k}");
            assert_eq!(
                out.to_i32_vec().unwrap(),
                vec![(k % 4) as i32],
                "{target:?}, call {k}"
            );
        }
        let after = device.read_stats();
        assert_eq!(
            (
                after.mapped - before.mapped,
                after.transferred - before.transferred
            ),
            (12, 0),
            "{target:?}"
        );
        // Device memory is read by a transfer on Vulkan; the CPU device maps all its memory.
        let local = BufferView::from_i32(&device, &[2], &[7, -7]).unwrap();
        assert_eq!(local.to_i32_vec().unwrap(), vec![7, -7], "{target:?}");
        let last = device.read_stats();
        let transferred = last.transferred - after.transferred;
        match target {
            Target::VulkanSpirv => assert!(!local.host_readable() && transferred == 1),
            Target::LlvmCpu => assert!(local.host_readable() && transferred == 0),
        }
    }
}

#[test]
fn entry_points_take_fences_and_a_synchronous_module_still_runs() {
    for (device, target) in devices() {
        let fenced = load(&device, target, ADD);
        assert!(fenced.takes_fences("add").unwrap(), "{target:?}");
        // The execution model IREE compiles by default: each entry point waits inside IREE.
        let compiled = Compiler::discover()
            .unwrap()
            .with_extra_flags(["--iree-execution-model=async-internal"])
            .compile(ADD, target, &mut |p| eprintln!("{p}"))
            .expect("compile");
        let plain = Session::new(&device, &compiled.vmfb).unwrap();
        assert!(!plain.takes_fences("add").unwrap(), "{target:?}");
        let a = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let b = BufferView::from_f32(&device, &[4], &[0.5, 0.25, -3.0, 8.0]).unwrap();
        for session in [&fenced, &plain] {
            // Back to back, so a later call can never read an earlier one's unfinished result.
            for round in 0..50 {
                let out = session.call("add", &[&a, &b]).unwrap();
                assert_eq!(
                    out[0].to_f32_vec().unwrap(),
                    vec![1.5, 2.25, 0.0, 12.0],
                    "{target:?}, round {round}"
                );
            }
        }
        assert!(matches!(
            fenced.takes_fences("nope"),
            Err(Error::Backend { .. })
        ));
    }
}

/// How IREE treated the cache argument of one call.
#[derive(Debug)]
struct InPlace {
    input_updated: bool,
    output_shares_input: bool,
}

fn run_cache_update(
    session: &Session,
    device: &Device,
    function: &str,
    new_rows: &[f32],
    position: i32,
) -> (InPlace, Vec<f32>) {
    let cache = BufferView::from_f32(device, &[ROWS, WIDTH], &cache_values()).unwrap();
    let rows = BufferView::from_f32(device, &[new_rows.len() / WIDTH, WIDTH], new_rows).unwrap();
    let pos = BufferView::from_i32(device, &[], &[position]).unwrap();
    let out = session.call(function, &[&cache, &rows, &pos]).unwrap();
    assert_eq!(out.len(), 1);
    let result = out[0].to_f32_vec().unwrap();
    let input_after = cache.to_f32_vec().unwrap();
    let input_updated = input_after != cache_values();
    if input_updated {
        assert_eq!(
            input_after, result,
            "an in-place update must leave the result"
        );
    }
    (
        InPlace {
            input_updated,
            output_shares_input: out[0].shares_storage_with(&cache),
        },
        result,
    )
}

#[test]
fn dynamic_update_slice_on_a_cache_argument() {
    for (device, target) in devices() {
        let session = load(&device, target, DUS);
        let row = row_values(1000.0, 1);
        for pos in [0, 5, 15] {
            let (in_place, result) = run_cache_update(&session, &device, "update", &row, pos);
            assert_eq!(
                result,
                expected_after(pos as usize, &row),
                "{target:?} pos {pos}"
            );
            eprintln!(
                "FINDING {}: dynamic_update_slice at {pos}: {in_place:?}",
                target.name()
            );
            // Recorded in docs/IREE.md: IREE 3.13 writes the update into the caller's buffer and
            // returns that same buffer. If this changes, update the doc (snapshots stay correct
            // either way: they are device copies).
            assert!(
                in_place.input_updated && in_place.output_shares_input,
                "{target:?}"
            );
        }
    }
}

#[test]
fn scatter_into_a_cache_argument() {
    for (device, target) in devices() {
        let session = load(&device, target, SCATTER);
        let rows = row_values(2000.0, 3);
        // Rows 3, 4, 5: all in range.
        let (in_place, result) = run_cache_update(&session, &device, "scatter", &rows, 3);
        assert_eq!(result, expected_after(3, &rows), "{target:?}");
        eprintln!("FINDING {}: scatter at 3: {in_place:?}", target.name());
        // Recorded in docs/IREE.md, as for dynamic_update_slice.
        assert!(
            in_place.input_updated && in_place.output_shares_input,
            "{target:?}"
        );

        // Out-of-bounds rows (14, 15, 16 and 100, 101, 102): StableHLO/XLA semantics drop them.
        // Vulkan does; IREE 3.13's llvm-cpu scatter does NOT bounds-check and writes past the end
        // of the buffer (heap corruption, a crash for far indices: docs/IREE.md), so the CPU case
        // is not run. Graphs must keep scatter indices in range.
        if device.kind() == DeviceKind::Cpu {
            eprintln!("SKIPPED on llvm-cpu: out-of-bounds scatter corrupts memory (docs/IREE.md)");
            continue;
        }
        for base in [14, 100] {
            let neighbour =
                BufferView::from_f32(&device, &[ROWS, WIDTH], &[7.0; ROWS * WIDTH]).unwrap();
            let (_, result) = run_cache_update(&session, &device, "scatter", &rows, base);
            assert_eq!(
                result,
                expected_after(base as usize, &rows),
                "{target:?} {base}"
            );
            assert_eq!(neighbour.to_f32_vec().unwrap(), vec![7.0; ROWS * WIDTH]);
        }
    }
}

#[test]
fn device_copy_is_an_independent_snapshot() {
    for (device, target) in devices() {
        let session = load(&device, target, DUS);
        let cache = BufferView::from_f32(&device, &[ROWS, WIDTH], &cache_values()).unwrap();
        let snapshot = cache.device_copy().unwrap();
        assert!(!snapshot.shares_storage_with(&cache));
        assert_eq!(snapshot.shape(), vec![ROWS, WIDTH]);

        // Update the original: the snapshot keeps the old contents.
        let row = row_values(3000.0, 1);
        let pos = BufferView::from_i32(&device, &[], &[7]).unwrap();
        let r = BufferView::from_f32(&device, &[1, WIDTH], &row).unwrap();
        let out = session.call("update", &[&cache, &r, &pos]).unwrap();
        assert_eq!(out[0].to_f32_vec().unwrap(), expected_after(7, &row));
        assert_eq!(snapshot.to_f32_vec().unwrap(), cache_values(), "{target:?}");

        // Update the snapshot: the original's current contents stay.
        let before = cache.to_f32_vec().unwrap();
        let row2 = row_values(4000.0, 1);
        let r2 = BufferView::from_f32(&device, &[1, WIDTH], &row2).unwrap();
        let out2 = session.call("update", &[&snapshot, &r2, &pos]).unwrap();
        assert_eq!(out2[0].to_f32_vec().unwrap(), expected_after(7, &row2));
        assert_eq!(cache.to_f32_vec().unwrap(), before, "{target:?}");
    }
}

#[test]
fn scalar_arguments_pass_by_value() {
    for (device, target) in devices() {
        let session = load(&device, target, DUS_AT);
        let cache = BufferView::from_f32(&device, &[ROWS, WIDTH], &cache_values()).unwrap();
        let row = row_values(5000.0, 1);
        let r = BufferView::from_f32(&device, &[1, WIDTH], &row).unwrap();
        // Row 21 % 16 = 5.
        let args = [Arg::View(&cache), Arg::View(&r), Arg::I32(21)];
        let out = session.call_args("update_at", &args).unwrap();
        assert_eq!(
            out[0].to_f32_vec().unwrap(),
            expected_after(5, &row),
            "{target:?}"
        );

        // A scalar for a tensor argument, or a tensor for the scalar: IREE's error, and the
        // session still works.
        let pos = BufferView::from_i32(&device, &[], &[3]).unwrap();
        let wrong = [Arg::View(&cache), Arg::View(&r), Arg::View(&pos)];
        let (op, status) = backend_text(session.call_args("update_at", &wrong).unwrap_err());
        eprintln!("IREE on a tensor for an i32: {op}: {status}");
        assert!(op.contains("update_at"), "{op}");
        assert!(status.contains("not a value type"), "{status}");
        let wrong = [Arg::View(&cache), Arg::I32(1), Arg::I32(3)];
        let (_, status) = backend_text(session.call_args("update_at", &wrong).unwrap_err());
        eprintln!("IREE on an i32 for a tensor: {status}");
        assert!(status.contains("FAILED_PRECONDITION"), "{status}");
        let out = session.call_args("update_at", &args).unwrap();
        assert_eq!(
            out[0].to_f32_vec().unwrap(),
            expected_after(5, &row),
            "{target:?}"
        );
    }
}

fn backend_text(e: Error) -> (String, String) {
    match e {
        Error::Backend { op, status, .. } => (op, status),
        other => panic!("expected a backend error, got {other:?}"),
    }
}

#[test]
fn errors_are_typed_and_carry_iree_text() {
    for (device, target) in devices() {
        // Missing vmfb file: an I/O error naming the path.
        let missing = std::env::temp_dir().join("kvsnap-no-such-module.vmfb");
        match Session::from_file(&device, &missing) {
            Err(Error::Io { path, .. }) => assert_eq!(path, missing),
            other => panic!("expected Io, got {other:?}"),
        }
        // Not a vmfb: IREE's loader rejects it.
        let (op, status) = backend_text(Session::new(&device, b"not a vmfb at all").unwrap_err());
        assert!(op.contains("bytecode module"), "{op}");
        assert!(!status.is_empty());

        let session = load(&device, target, ADD);
        let a = BufferView::from_f32(&device, &[4], &[1.0; 4]).unwrap();

        // Missing function: named, with the exports listed.
        let (op, status) = backend_text(session.call("nope", &[&a, &a]).unwrap_err());
        assert!(op.contains("module.nope"), "{op}");
        assert!(
            status.contains("no function `nope`") && status.contains("add"),
            "{status}"
        );
        assert!(
            status.contains("NOT_FOUND"),
            "IREE's text is kept: {status}"
        );

        // Wrong input count.
        let (_, status) = backend_text(session.call("add", &[&a]).unwrap_err());
        eprintln!("IREE on a wrong input count: {status}");
        assert!(status.contains("INVALID_ARGUMENT"), "{status}");

        // Wrong shape.
        let short = BufferView::from_f32(&device, &[3], &[1.0; 3]).unwrap();
        let (_, status) = backend_text(session.call("add", &[&a, &short]).unwrap_err());
        eprintln!("IREE on a wrong shape: {status}");
        assert!(status.contains("mismatch"), "{status}");

        // Wrong element type.
        let ints = BufferView::from_i32(&device, &[4], &[1; 4]).unwrap();
        let (_, status) = backend_text(session.call("add", &[&a, &ints]).unwrap_err());
        assert!(status.contains("element type mismatch"), "{status}");

        // The session still works after the errors.
        let out = session.call("add", &[&a, &a]).unwrap();
        assert_eq!(out[0].to_f32_vec().unwrap(), vec![2.0; 4]);
    }
}

#[test]
fn vmfb_for_another_target_is_rejected_with_iree_text() {
    let cpu = Device::cpu(instance()).unwrap();
    let vulkan_vmfb = compiler()
        .compile(ADD, Target::VulkanSpirv, &mut |_| {})
        .unwrap();
    let err = Session::new(&cpu, &vulkan_vmfb.vmfb)
        .and_then(|s| {
            let a = BufferView::from_f32(&cpu, &[4], &[1.0; 4])?;
            s.call("add", &[&a, &a]).map(|_| s)
        })
        .unwrap_err();
    let (op, status) = backend_text(err);
    eprintln!("IREE on a vulkan vmfb on the CPU: {op}: {status}");
    assert!(!status.is_empty());
}

/// Host bytes at `offset` inside an owned allocation, so the test controls alignment.
struct OffsetBytes {
    buf: Vec<u8>,
    offset: usize,
    len: usize,
}

impl OffsetBytes {
    fn new(values: &[f32], misalign: usize) -> Self {
        let len = values.len() * 4;
        let mut buf = vec![0u8; len + 2 * HOST_IMPORT_ALIGNMENT];
        let base = buf.as_ptr() as usize;
        let offset = (HOST_IMPORT_ALIGNMENT - base % HOST_IMPORT_ALIGNMENT) % HOST_IMPORT_ALIGNMENT
            + misalign;
        for (i, v) in values.iter().enumerate() {
            buf[offset + 4 * i..offset + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        OffsetBytes { buf, offset, len }
    }
}

impl AsRef<[u8]> for OffsetBytes {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.offset..self.offset + self.len]
    }
}

/// A region of a shared read-only memory map.
struct MapRegion {
    map: Arc<memmap2::Mmap>,
    offset: usize,
    len: usize,
}

impl AsRef<[u8]> for MapRegion {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.offset..self.offset + self.len]
    }
}

#[test]
fn host_import_is_zero_copy_on_cpu_for_aligned_read_only_memory() {
    for (device, target) in devices() {
        let session = load(&device, target, ADD);
        let a = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();

        // An mmap'd read-only file region at a 64-byte aligned offset (like a padded safetensors
        // data section): zero-copy on the CPU.
        let path = std::env::temp_dir().join(format!("kvsnap-import-{}.bin", std::process::id()));
        let mut file_bytes = vec![0u8; 128];
        for (i, v) in [10.0f32, 20.0, 30.0, 40.0].iter().enumerate() {
            file_bytes[64 + 4 * i..68 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        std::fs::write(&path, &file_bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the test owns the file and nothing modifies it while mapped.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&file) }.unwrap());
        let region = MapRegion {
            map: map.clone(),
            offset: 64,
            len: 16,
        };
        let (b, mode) = BufferView::import_host(&device, region, &[4], ElementType::F32).unwrap();
        eprintln!(
            "FINDING {}: aligned read-only mmap import: {mode:?}",
            target.name()
        );
        if device.kind() == DeviceKind::Cpu {
            assert_eq!(mode, ImportMode::ZeroCopy);
            assert_eq!(Arc::strong_count(&map), 2, "the buffer keeps the map alive");
        }
        let out = session.call("add", &[&a, &b]).unwrap();
        assert_eq!(out[0].to_f32_vec().unwrap(), vec![11.0, 22.0, 33.0, 44.0]);
        assert_eq!(b.to_f32_vec().unwrap(), vec![10.0, 20.0, 30.0, 40.0]);
        drop((b, out));
        // The call returns when its work has signalled; the worker that ran it releases the
        // submission's hold on `b` just after. So the owner goes once that is done: soon,
        // whatever the scheduling, and never while the buffer may still be read.
        let start = std::time::Instant::now();
        while Arc::strong_count(&map) > 1 && start.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            Arc::strong_count(&map),
            1,
            "releasing the buffer drops the owner once the call's work has retired"
        );
        drop(map);
        std::fs::remove_file(&path).unwrap();

        // A whole page-aligned page of a read-only map (Vulkan's host-pointer import wants 4096).
        let page_values: Vec<f32> = (0..1024).map(|i| i as f32).collect();
        let page_bytes: Vec<u8> = page_values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&path, &page_bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the test owns the file and nothing modifies it while mapped.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&file) }.unwrap());
        let region = MapRegion {
            map,
            offset: 0,
            len: 4096,
        };
        let (page, mode) =
            BufferView::import_host(&device, region, &[1024], ElementType::F32).unwrap();
        eprintln!(
            "FINDING {}: page-aligned read-only mmap import: {mode:?}",
            target.name()
        );
        assert_eq!(page.to_f32_vec().unwrap(), page_values);
        drop(page);
        std::fs::remove_file(&path).unwrap();

        // Misaligned memory falls back to a copy, and says why.
        let owner = OffsetBytes::new(&[5.0, 6.0, 7.0, 8.0], 4);
        let (c, mode) = BufferView::import_host(&device, owner, &[4], ElementType::F32).unwrap();
        match &mode {
            ImportMode::Copied { reason } => assert!(reason.contains("aligned"), "{reason}"),
            ImportMode::ZeroCopy => panic!("misaligned memory cannot be imported"),
        }
        let out = session.call("add", &[&a, &c]).unwrap();
        assert_eq!(out[0].to_f32_vec().unwrap(), vec![6.0, 8.0, 10.0, 12.0]);

        // A size that does not match the shape is a shape error, not a silent truncation.
        let owner = OffsetBytes::new(&[1.0; 3], 0);
        match BufferView::import_host(&device, owner, &[4], ElementType::F32) {
            Err(Error::ShapeMismatch { .. }) => {}
            other => panic!("expected ShapeMismatch, got {other:?}"),
        }
        let stats = device.import_stats();
        eprintln!("{}: import stats {stats:?}", target.name());
        assert_eq!(stats.zero_copy + stats.copied, 3);
    }
}

#[test]
fn zeros_and_write_bytes() {
    for (device, _) in devices() {
        let z = BufferView::zeros(&device, &[3, 5], ElementType::F32).unwrap();
        assert_eq!(z.to_f32_vec().unwrap(), vec![0.0; 15]);
        let v: Vec<f32> = (0..15).map(|i| i as f32).collect();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        z.write_bytes(&bytes).unwrap();
        assert_eq!(z.to_f32_vec().unwrap(), v);
        assert!(matches!(
            z.write_bytes(&bytes[..8]),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(z.to_i32_vec().is_err(), "reading f32 as i32 is refused");
    }
}

/// What `kvsnap_iree::kv` relies on to start a state in a new buffer set without zeroing it:
/// the CPU device's allocator hands out zeroed memory, also where freed buffers held data (its
/// heap allocator takes storage from `iree_allocator_malloc`, a `calloc`).
#[test]
fn new_cpu_buffers_are_zero_even_over_freed_data() {
    let device = Device::cpu(instance()).unwrap();
    // Small ones come from the allocator's free lists, large ones from fresh mappings.
    for len in [4usize << 10, 64 << 10, 8 << 20] {
        for _ in 0..3 {
            let dirty = BufferView::allocate(&device, &[len], ElementType::I8).unwrap();
            dirty.write_bytes(&vec![0xAB; len]).unwrap();
            drop(dirty);
            let new = BufferView::allocate(&device, &[len], ElementType::I8).unwrap();
            let first = new.read_bytes().unwrap().iter().position(|&b| b != 0);
            assert_eq!(
                first, None,
                "a new {len}-byte buffer holds data at this byte"
            );
        }
    }
}

#[test]
fn ranged_transfers_copy_and_zero_exactly_their_bytes() {
    for (device, target) in devices() {
        let v: Vec<f32> = (1..=15).map(|i| i as f32).collect();
        let src = BufferView::from_f32(&device, &[3, 5], &v).unwrap();
        let dst = BufferView::from_f32(&device, &[3, 5], &[9.0; 15]).unwrap();
        // Floats 2..6 copied, 9..12 zeroed, the rest left as they were.
        BufferView::transfer(
            &device,
            &[
                Transfer::Copy {
                    src: &src,
                    dst: &dst,
                    offset: 8,
                    len: 16,
                },
                Transfer::Zero {
                    dst: &dst,
                    offset: 36,
                    len: 12,
                },
                Transfer::Zero {
                    dst: &dst,
                    offset: 0,
                    len: 0,
                },
            ],
        )
        .unwrap();
        let mut want = vec![9.0; 15];
        want[2..6].copy_from_slice(&v[2..6]);
        want[9..12].fill(0.0);
        assert_eq!(dst.to_f32_vec().unwrap(), want, "{target:?}");

        // Bad ranges are typed errors that name the problem, and nothing is written.
        let past = Transfer::Copy {
            src: &src,
            dst: &dst,
            offset: 56,
            len: 8,
        };
        let e = BufferView::transfer(&device, &[past]).unwrap_err();
        assert!(
            e.to_string().contains("past the end of a 60-byte buffer"),
            "{e}"
        );
        let ragged = Transfer::Zero {
            dst: &dst,
            offset: 2,
            len: 4,
        };
        let e = BufferView::transfer(&device, &[ragged]).unwrap_err();
        assert!(e.to_string().contains("whole words"), "{e}");
        assert_eq!(dst.to_f32_vec().unwrap(), want, "{target:?}: unchanged");

        // Within one buffer: floats 10..13 to 1..4; overlapping ranges or a range past the end
        // are refused before anything moves.
        let within = |from, to, len| Transfer::Within {
            buf: &dst,
            from,
            to,
            len,
        };
        BufferView::transfer(&device, &[within(40, 4, 12)]).unwrap();
        let moved = want.clone();
        want[1..4].copy_from_slice(&moved[10..13]);
        assert_eq!(dst.to_f32_vec().unwrap(), want, "{target:?}: within");
        let e = BufferView::transfer(&device, &[within(8, 4, 8)]).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let e = BufferView::transfer(&device, &[within(0, 52, 12)]).unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
        assert_eq!(dst.to_f32_vec().unwrap(), want, "{target:?}: unchanged");
    }
}

#[test]
fn thread_safety_contract() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Instance>();
    send_sync::<Device>();
    send_sync::<BufferView>();
    send::<Session>();

    // A session shared behind a Mutex serves calls from several threads; buffer views move freely.
    let device = Device::cpu(instance()).unwrap();
    let session = std::sync::Mutex::new(load(&device, Target::LlvmCpu, ADD));
    std::thread::scope(|s| {
        for t in 0..2 {
            let (session, device) = (&session, &device);
            s.spawn(move || {
                for i in 0..20 {
                    let x = (t * 100 + i) as f32;
                    let a = BufferView::from_f32(device, &[4], &[x; 4]).unwrap();
                    let out = session.lock().unwrap().call("add", &[&a, &a]).unwrap();
                    assert_eq!(out[0].to_f32_vec().unwrap(), vec![2.0 * x; 4]);
                }
            });
        }
    });
}

#[test]
fn compile_errors_carry_the_compiler_text_and_versions_are_checked() {
    let dir = std::env::temp_dir().join(format!("kvsnap-compile-test-{}", std::process::id()));
    let c = compiler().clone().with_cache_dir(&dir);

    // Invalid MLIR: the error names the target and carries iree-compile's diagnostic.
    let bad =
        "func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> {\n  %0 = stablehlo.nonsense %a\n}\n";
    let (op, status) = backend_text(c.compile(bad, Target::LlvmCpu, &mut |_| {}).unwrap_err());
    assert!(op.contains("llvm-cpu"), "{op}");
    assert!(status.contains("error"), "{status}");
    eprintln!("iree-compile on bad MLIR: {status}");

    // A second compile of the same text is a cache hit with identical bytes.
    let mut events = Vec::new();
    let first = c
        .compile(ADD, Target::LlvmCpu, &mut |p| events.push(p.to_string()))
        .unwrap();
    let second = c
        .compile(ADD, Target::LlvmCpu, &mut |p| events.push(p.to_string()))
        .unwrap();
    assert!(!first.cache_hit && second.cache_hit);
    assert_eq!(first.vmfb, second.vmfb);
    assert!(
        events[0].starts_with("compiling 1 KB of MLIR for llvm-cpu"),
        "{events:?}"
    );
    assert_ne!(
        c.cache_key(ADD, Target::LlvmCpu),
        c.cache_key(ADD, Target::VulkanSpirv)
    );

    // A compiler of another version is refused with a message saying what to install.
    #[cfg(unix)]
    {
        let fake = executable_script(
            &dir.join("iree-compile-3.11"),
            "#!/bin/sh\necho 'IREE (https://iree.dev):'\necho '  IREE compiler version 3.11.0 @ abc'\n",
        );
        let status = backend_text(Compiler::with_executable(&fake).unwrap_err()).1;
        assert!(
            status.contains("3.11.0") && status.contains("iree-base-compiler==3.13.0"),
            "{status}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_vulkan_target_is_a_flag_of_vulkan_compiles_and_part_of_their_cache_key() {
    let dir = std::env::temp_dir().join(format!("kvsnap-vk-target-{}", std::process::id()));
    let generic = compiler().clone().with_cache_dir(&dir);
    let ampere = generic.clone().with_vulkan_target(Some("ampere")).unwrap();
    let target_flags = |c: &Compiler, t: Target| -> Vec<String> {
        c.flags(t)
            .into_iter()
            .filter(|f| f.starts_with("--iree-vulkan-target"))
            .collect()
    };
    assert_eq!(ampere.vulkan_target(), Some("ampere"));
    assert_eq!(
        target_flags(&ampere, Target::VulkanSpirv),
        ["--iree-vulkan-target=ampere"]
    );
    assert!(target_flags(&generic, Target::VulkanSpirv).is_empty());
    // CPU compiles do not see it: same flags, same cache entry.
    assert_eq!(
        ampere.flags(Target::LlvmCpu),
        generic.flags(Target::LlvmCpu)
    );
    assert_eq!(
        ampere.cache_key(ADD, Target::LlvmCpu),
        generic.cache_key(ADD, Target::LlvmCpu)
    );
    assert_ne!(
        ampere.cache_key(ADD, Target::VulkanSpirv),
        generic.cache_key(ADD, Target::VulkanSpirv)
    );
    // An empty name is no target.
    let empty = generic.clone().with_vulkan_target(Some(" ")).unwrap();
    assert_eq!(empty.vulkan_target(), None);

    // A name that could smuggle other flags is refused before any compile, and named.
    let (op, status) = backend_text(
        generic
            .clone()
            .with_vulkan_target(Some("ampere --iree-opt-level=O0"))
            .unwrap_err(),
    );
    assert!(op.contains("Vulkan target"), "{op}");
    assert!(
        status.contains("`ampere --iree-opt-level=O0` is not a Vulkan target name"),
        "{status}"
    );

    // A name IREE does not know fails the compile with IREE's own message.
    let unknown = generic
        .clone()
        .with_vulkan_target(Some("no_such_gpu"))
        .unwrap();
    let (op, status) = backend_text(
        unknown
            .compile(ADD, Target::VulkanSpirv, &mut |_| {})
            .unwrap_err(),
    );
    assert!(op.contains("vulkan-spirv"), "{op}");
    assert!(
        status.contains("Unknown Vulkan target 'no_such_gpu'"),
        "{status}"
    );

    // A known one compiles, into SPIR-V of its own.
    let for_ampere = ampere
        .compile(ADD, Target::VulkanSpirv, &mut |_| {})
        .unwrap();
    let for_any = generic
        .compile(ADD, Target::VulkanSpirv, &mut |_| {})
        .unwrap();
    assert!(!for_ampere.cache_hit && !for_any.cache_hit);
    assert_ne!(for_ampere.vmfb, for_any.vmfb);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Makes `path` an executable script of `text`, and returns it. The script is written by `cp`,
/// never opened for writing in this process: a child another test thread forks meanwhile
/// (before that child's exec, which is slow on a loaded machine) would hold the descriptor, and
/// every exec of the script would fail with "Text file busy" until it let go.
#[cfg(unix)]
fn executable_script(path: &std::path::Path, text: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let source = path.with_extension("txt");
    std::fs::write(&source, text).unwrap();
    let copied = std::process::Command::new("cp")
        .arg(&source)
        .arg(path)
        .status()
        .unwrap();
    assert!(
        copied.success(),
        "cp {} {}",
        source.display(),
        path.display()
    );
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_path_buf()
}

/// A fake `iree-compile` 3.13 that hangs without using CPU on its first `hangs` runs (a child
/// `sleep`, as the real compiler's threads all waiting on futexes) and then writes a vmfb. The
/// sleep's argument ([`hung_sleep`]) is this test process's own, so that no other `sleep` on
/// the machine is taken for it.
#[cfg(target_os = "linux")]
fn hanging_compiler(dir: &std::path::Path, hangs: usize) -> std::path::PathBuf {
    let script = dir.join(format!("iree-compile-hangs-{hangs}"));
    let runs = dir.join(format!("runs-{hangs}"));
    executable_script(
        &script,
        &format!(
            "#!/bin/sh\n\
             case \"$1\" in --version) echo 'IREE (https://iree.dev):'; \
             echo '  IREE compiler version 3.13.0 @ fake'; exit 0;; esac\n\
             out=''; prev=''\n\
             for a in \"$@\"; do [ \"$prev\" = -o ] && out=\"$a\"; prev=\"$a\"; done\n\
             echo run >> '{runs}'\n\
             if [ \"$(wc -l < '{runs}')\" -le {hangs} ]; then sleep {secs}; fi\n\
             printf fake-vmfb > \"$out\"\n",
            runs = runs.display(),
            secs = hung_sleep(),
        ),
    )
}

/// The seconds the fake compiler's hung runs sleep: 600 and a fraction naming this process.
#[cfg(target_os = "linux")]
fn hung_sleep() -> String {
    format!("600.{}", std::process::id())
}

/// How many processes run the fake compiler's hung `sleep`, after waiting up to 5 s for them
/// to go (a kill is delivered asynchronously; one that survived it sleeps for 600 s).
#[cfg(target_os = "linux")]
fn hung_sleeps_left() -> usize {
    let cmdline = format!("sleep\0{}\0", hung_sleep()).into_bytes();
    let count = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|p| std::fs::read(p.path().join("cmdline")).ok().as_ref() == Some(&cmdline))
            .count()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while count() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    count()
}

#[cfg(target_os = "linux")]
#[test]
fn a_compiler_that_stops_using_cpu_is_killed_and_started_again_once() {
    let dir = std::env::temp_dir().join(format!("kvsnap-stall-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let limit = std::time::Duration::from_secs(2);
    let with = |hangs: usize| {
        Compiler::with_executable(hanging_compiler(&dir, hangs))
            .unwrap_or_else(|e| panic!("the fake compiler should report 3.13: {e}"))
            .with_cache_dir(dir.join(format!("cache-{hangs}")))
            .with_stall_limit(limit)
    };

    // Hangs once: killed after the stall limit, started again, and the second run's vmfb kept.
    let mut events = Vec::new();
    let compiled = with(1)
        .compile(ADD, Target::LlvmCpu, &mut |p| events.push(p.to_string()))
        .unwrap();
    assert_eq!(compiled.vmfb, b"fake-vmfb");
    let restarts = events
        .iter()
        .filter(|e| e.contains("killed, compiling again"));
    assert_eq!(restarts.count(), 1, "{events:?}");
    // The hung run's `sleep` was killed with its group, not left behind.
    assert_eq!(hung_sleeps_left(), 0, "a hung run's child survived");

    // Hangs every time: a typed error that says so, after one restart.
    let (op, status) = backend_text(
        with(2)
            .compile(ADD, Target::LlvmCpu, &mut |_| {})
            .unwrap_err(),
    );
    assert!(op.contains("llvm-cpu"), "{op}");
    assert!(
        status.contains("used no CPU") && status.contains("2 times in a row"),
        "{status}"
    );
    assert_eq!(hung_sleeps_left(), 0, "a hung run's child survived");
    std::fs::remove_dir_all(&dir).unwrap();
}
