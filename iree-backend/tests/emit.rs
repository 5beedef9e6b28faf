//! The StableHLO emitter and the Gemma 3 graphs.
//!
//! Op snapshots: each op's text is compared with a string written by hand from the StableHLO
//! spec's generic syntax (not produced by the code). Compile tests run `iree-compile` on a
//! function using every op and on the tiny model's module; they print
//! `SKIPPED: iree-compile not found` when the compiler is not installed.

use std::path::PathBuf;
use std::process::Command;

use kvsnap_contract::{LayerKind, ModelConfig};
use kvsnap_iree::compile::{Compiler, LinkedObject, Target};
use kvsnap_iree::emit::{Cmp, DotDims, ElemType, FuncBuilder, Module, Reduction, TensorType};
use kvsnap_iree::graphs::{
    self, entry_name, head_modes, span_entry_name, DType, EntryPoint, GraphOptions, HeadMode,
    Input, Role, WeightLayout, DEFAULT_CHUNKS, HEAD_FULL, HEAD_NONE, HEAD_SCREEN, PROJECTION_LANES,
    SCREEN_BLOCKS, SCREEN_WEIGHTS, TABLE_LANES,
};
use kvsnap_reference::tiny::{config, Preset};

/// The body lines a closure emits into a fresh function (arguments excluded).
fn body(
    args: &[TensorType],
    f: impl FnOnce(&mut FuncBuilder, &[kvsnap_iree::emit::Value]),
) -> String {
    let mut b = FuncBuilder::new("f");
    let vals: Vec<_> = args.iter().map(|t| b.arg(t.clone())).collect();
    f(&mut b, &vals);
    let text = b.finish(&[]);
    text.lines()
        .filter(|l| !l.contains("func.func") && !l.contains("func.return") && l.trim() != "}")
        .map(|l| l.trim())
        .collect::<Vec<_>>()
        .join("\n")
}

fn f32t(d: &[usize]) -> TensorType {
    TensorType::f32(d)
}

fn i32t(d: &[usize]) -> TensorType {
    TensorType::i32(d)
}

#[test]
fn function_text() {
    let mut b = FuncBuilder::new("add2");
    let x = b.arg(f32t(&[2]));
    let y = b.arg(f32t(&[2]));
    let z = b.add(&x, &y);
    assert_eq!(
        b.finish(&[&z]),
        "  func.func @add2(%0: tensor<2xf32>, %1: tensor<2xf32>) -> (tensor<2xf32>) {\n    %2 = \"stablehlo.add\"(%0, %1) : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>\n    \"func.return\"(%2) : (tensor<2xf32>) -> ()\n  }\n"
    );
    let mut m = Module::new("m");
    m.push("  F\n".into());
    assert_eq!(m.text(), "module @m {\n  F\n}\n");
}

#[test]
fn constants_and_iota() {
    let t = body(&[], |b, _| {
        b.const_f32(1.0, &[]);
        b.const_i32(-3, &[2, 2]);
        b.const_f32_vec(&[2.0, -0.5]);
        b.iota(&[3, 4], 1);
    });
    assert_eq!(
        t,
        "%0 = \"stablehlo.constant\"() {value = dense<0x3F800000> : tensor<f32>} : () -> tensor<f32>\n\
         %1 = \"stablehlo.constant\"() {value = dense<-3> : tensor<2x2xi32>} : () -> tensor<2x2xi32>\n\
         %2 = \"stablehlo.constant\"() {value = dense<[0x40000000, 0xBF000000]> : tensor<2xf32>} : () -> tensor<2xf32>\n\
         %3 = \"stablehlo.iota\"() {iota_dimension = 1 : i64} : () -> tensor<3x4xi32>"
    );
}

#[test]
fn shape_ops() {
    let t = body(&[f32t(&[2, 3]), f32t(&[])], |b, a| {
        b.broadcast_in_dim(&a[0], &[4, 2, 3], &[1, 2]);
        b.splat(&a[1], &[5]);
        b.reshape(&a[0], &[3, 2]);
        b.transpose(&a[0], &[1, 0]);
        b.convert(&a[0], ElemType::I32);
        b.slice(&a[0], &[0, 1], &[2, 3]);
        b.concatenate(&[&a[0], &a[0]], 1);
    });
    assert_eq!(
        t,
        "%2 = \"stablehlo.broadcast_in_dim\"(%0) {broadcast_dimensions = array<i64: 1, 2>} : (tensor<2x3xf32>) -> tensor<4x2x3xf32>\n\
         %3 = \"stablehlo.broadcast_in_dim\"(%1) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<5xf32>\n\
         %4 = \"stablehlo.reshape\"(%0) : (tensor<2x3xf32>) -> tensor<3x2xf32>\n\
         %5 = \"stablehlo.transpose\"(%0) {permutation = array<i64: 1, 0>} : (tensor<2x3xf32>) -> tensor<3x2xf32>\n\
         %6 = \"stablehlo.convert\"(%0) : (tensor<2x3xf32>) -> tensor<2x3xi32>\n\
         %7 = \"stablehlo.slice\"(%0) {start_indices = array<i64: 0, 1>, limit_indices = array<i64: 2, 3>, strides = array<i64: 1, 1>} : (tensor<2x3xf32>) -> tensor<2x2xf32>\n\
         %8 = \"stablehlo.concatenate\"(%0, %0) {dimension = 1 : i64} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x6xf32>"
    );
}

#[test]
fn elementwise_ops() {
    let t = body(&[f32t(&[2]), f32t(&[2]), i32t(&[2])], |b, a| {
        let (x, y, i) = (&a[0], &a[1], &a[2]);
        b.add(x, y);
        b.sub(x, y);
        b.mul(x, y);
        b.div(x, y);
        b.max(x, y);
        b.min(x, y);
        b.remainder(i, i);
        b.neg(x);
        b.exp(x);
        b.log(x);
        b.tanh(x);
        b.rsqrt(x);
        b.sqrt(x);
        b.cos(x);
        b.sin(x);
        b.round_nearest_even(x);
    });
    let ff = ": (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>";
    let f = ": (tensor<2xf32>) -> tensor<2xf32>";
    let want = [
        format!("%3 = \"stablehlo.add\"(%0, %1) {ff}"),
        format!("%4 = \"stablehlo.subtract\"(%0, %1) {ff}"),
        format!("%5 = \"stablehlo.multiply\"(%0, %1) {ff}"),
        format!("%6 = \"stablehlo.divide\"(%0, %1) {ff}"),
        format!("%7 = \"stablehlo.maximum\"(%0, %1) {ff}"),
        format!("%8 = \"stablehlo.minimum\"(%0, %1) {ff}"),
        "%9 = \"stablehlo.remainder\"(%2, %2) : (tensor<2xi32>, tensor<2xi32>) -> tensor<2xi32>"
            .into(),
        format!("%10 = \"stablehlo.negate\"(%0) {f}"),
        format!("%11 = \"stablehlo.exponential\"(%0) {f}"),
        format!("%12 = \"stablehlo.log\"(%0) {f}"),
        format!("%13 = \"stablehlo.tanh\"(%0) {f}"),
        format!("%14 = \"stablehlo.rsqrt\"(%0) {f}"),
        format!("%15 = \"stablehlo.sqrt\"(%0) {f}"),
        format!("%16 = \"stablehlo.cosine\"(%0) {f}"),
        format!("%17 = \"stablehlo.sine\"(%0) {f}"),
        format!("%18 = \"stablehlo.round_nearest_even\"(%0) {f}"),
    ];
    assert_eq!(t, want.join("\n"));
}

#[test]
fn compare_select_clamp_logic() {
    let t = body(&[i32t(&[3]), i32t(&[3]), i32t(&[])], |b, a| {
        let p = b.compare(Cmp::Le, &a[0], &a[1]);
        let q = b.compare(Cmp::Ne, &a[0], &a[1]);
        b.and(&p, &q);
        b.or(&p, &q);
        b.select(&p, &a[0], &a[1]);
        b.clamp(&a[2], &a[0], &a[2]);
    });
    assert_eq!(
        t,
        "%3 = \"stablehlo.compare\"(%0, %1) {comparison_direction = #stablehlo<comparison_direction LE>} : (tensor<3xi32>, tensor<3xi32>) -> tensor<3xi1>\n\
         %4 = \"stablehlo.compare\"(%0, %1) {comparison_direction = #stablehlo<comparison_direction NE>} : (tensor<3xi32>, tensor<3xi32>) -> tensor<3xi1>\n\
         %5 = \"stablehlo.and\"(%3, %4) : (tensor<3xi1>, tensor<3xi1>) -> tensor<3xi1>\n\
         %6 = \"stablehlo.or\"(%3, %4) : (tensor<3xi1>, tensor<3xi1>) -> tensor<3xi1>\n\
         %7 = \"stablehlo.select\"(%3, %0, %1) : (tensor<3xi1>, tensor<3xi32>, tensor<3xi32>) -> tensor<3xi32>\n\
         %8 = \"stablehlo.clamp\"(%2, %0, %2) : (tensor<i32>, tensor<3xi32>, tensor<i32>) -> tensor<3xi32>"
    );
}

#[test]
fn reduce_and_argmax() {
    let t = body(&[f32t(&[4, 8])], |b, a| {
        b.reduce(&a[0], Reduction::Sum, &[1]);
    });
    assert_eq!(
        t,
        "%1 = \"stablehlo.constant\"() {value = dense<0x00000000> : tensor<f32>} : () -> tensor<f32>\n\
         %2 = \"stablehlo.reduce\"(%0, %1) ({\n\
         ^bb0(%3: tensor<f32>, %4: tensor<f32>):\n\
         %5 = \"stablehlo.add\"(%3, %4) : (tensor<f32>, tensor<f32>) -> tensor<f32>\n\
         \"stablehlo.return\"(%5) : (tensor<f32>) -> ()\n\
         }) {dimensions = array<i64: 1>} : (tensor<4x8xf32>, tensor<f32>) -> tensor<4xf32>"
    );
    let t = body(&[f32t(&[4, 8]), i32t(&[4, 8])], |b, a| {
        b.argmax(&a[0], &a[1], 0);
    });
    let cmp = |d: &str| format!("{{comparison_direction = #stablehlo<comparison_direction {d}>}}");
    let want = format!(
        "%2 = \"stablehlo.constant\"() {{value = dense<0xFF800000> : tensor<f32>}} : () -> tensor<f32>\n\
         %3 = \"stablehlo.constant\"() {{value = dense<0> : tensor<i32>}} : () -> tensor<i32>\n\
         %4, %5 = \"stablehlo.reduce\"(%0, %1, %2, %3) ({{\n\
         ^bb0(%6: tensor<f32>, %7: tensor<i32>, %8: tensor<f32>, %9: tensor<i32>):\n\
         %10 = \"stablehlo.compare\"(%6, %8) {} : (tensor<f32>, tensor<f32>) -> tensor<i1>\n\
         %11 = \"stablehlo.compare\"(%6, %8) {} : (tensor<f32>, tensor<f32>) -> tensor<i1>\n\
         %12 = \"stablehlo.compare\"(%7, %9) {} : (tensor<i32>, tensor<i32>) -> tensor<i1>\n\
         %13 = \"stablehlo.and\"(%11, %12) : (tensor<i1>, tensor<i1>) -> tensor<i1>\n\
         %14 = \"stablehlo.or\"(%10, %13) : (tensor<i1>, tensor<i1>) -> tensor<i1>\n\
         %15 = \"stablehlo.select\"(%14, %6, %8) : (tensor<i1>, tensor<f32>, tensor<f32>) -> tensor<f32>\n\
         %16 = \"stablehlo.select\"(%14, %7, %9) : (tensor<i1>, tensor<i32>, tensor<i32>) -> tensor<i32>\n\
         \"stablehlo.return\"(%15, %16) : (tensor<f32>, tensor<i32>) -> ()\n\
         }}) {{dimensions = array<i64: 0>}} : (tensor<4x8xf32>, tensor<4x8xi32>, tensor<f32>, tensor<i32>) -> (tensor<8xf32>, tensor<8xi32>)",
        cmp("GT"),
        cmp("EQ"),
        cmp("LT")
    );
    assert_eq!(t, want);
}

#[test]
fn dot_general() {
    // W [out=6, in=4] . x [in=4, C=2] -> [6, 2]; and a batched q . k^T.
    let t = body(
        &[
            f32t(&[6, 4]),
            f32t(&[4, 2]),
            f32t(&[2, 3, 8, 5]),
            f32t(&[7, 2, 8]),
        ],
        |b, a| {
            b.dot_general(&a[0], &a[1], &DotDims::contract(1, 0));
            b.dot_general(&a[2], &a[3], &DotDims::batched(0, 1, 2, 2));
        },
    );
    assert_eq!(
        t,
        "%4 = \"stablehlo.dot_general\"(%0, %1) {dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [], rhs_batching_dimensions = [], lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>} : (tensor<6x4xf32>, tensor<4x2xf32>) -> tensor<6x2xf32>\n\
         %5 = \"stablehlo.dot_general\"(%2, %3) {dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [0], rhs_batching_dimensions = [1], lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [2]>} : (tensor<2x3x8x5xf32>, tensor<7x2x8xf32>) -> tensor<2x3x5x7xf32>"
    );
}

#[test]
fn dispatch_calls_an_executable_entry_with_index_constants() {
    // One constant per distinct operand value, the workload among them.
    let t = body(&[f32t(&[2, 4]), f32t(&[3])], |b, a| {
        b.dispatch("ex::@f", &[6], &[&a[0], &a[1]], &[6, 2, 6], f32t(&[5]));
    });
    assert_eq!(
        t,
        "%2 = arith.constant 6 : index\n\
         %3 = arith.constant 2 : index\n\
         %4 = flow.dispatch @ex::@f[%2](%0, %1, %2, %3, %2) : (tensor<2x4xf32>, tensor<3xf32>, index, index, index) -> tensor<5xf32>"
    );
}

#[test]
fn mmt4d_accumulates_packed_tiles_from_zero() {
    // lhs [M1=1, K1=4, M0=2, K0=1] . rhs [N1=3, K1=4, N0=16, K0=1] -> [1, 3, 2, 16].
    let t = body(&[f32t(&[1, 4, 2, 1]), f32t(&[3, 4, 16, 1])], |b, a| {
        b.mmt4d(&a[0], &a[1]);
    });
    assert_eq!(
        t,
        "%2 = \"stablehlo.constant\"() {value = dense<0x00000000> : tensor<1x3x2x16xf32>} : () -> tensor<1x3x2x16xf32>\n\
         %3 = \"linalg.mmt4d\"(%0, %1, %2) <{operandSegmentSizes = array<i32: 2, 1>}> ({\n\
         ^bb0(%4: f32, %5: f32, %6: f32):\n\
         %7 = \"arith.mulf\"(%4, %5) : (f32, f32) -> f32\n\
         %8 = \"arith.addf\"(%6, %7) : (f32, f32) -> f32\n\
         \"linalg.yield\"(%8) : (f32) -> ()\n\
         }) : (tensor<1x4x2x1xf32>, tensor<3x4x16x1xf32>, tensor<1x3x2x16xf32>) -> tensor<1x3x2x16xf32>"
    );
}

#[test]
fn indexing_ops() {
    let t = body(
        &[f32t(&[6, 2, 4]), i32t(&[]), f32t(&[3, 2, 4]), i32t(&[3, 1])],
        |b, a| {
            let (x, i, u, idx) = (&a[0], &a[1], &a[2], &a[3]);
            b.dynamic_slice(x, &[i, i, i], &[3, 2, 4]);
            b.dynamic_update_slice(x, u, &[i, i, i]);
            b.gather_rows(x, idx);
            b.scatter_rows(x, idx, u);
        },
    );
    assert_eq!(
        t,
        "%4 = \"stablehlo.dynamic_slice\"(%0, %1, %1, %1) {slice_sizes = array<i64: 3, 2, 4>} : (tensor<6x2x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<3x2x4xf32>\n\
         %5 = \"stablehlo.dynamic_update_slice\"(%0, %2, %1, %1, %1) : (tensor<6x2x4xf32>, tensor<3x2x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<6x2x4xf32>\n\
         %6 = \"stablehlo.gather\"(%0, %3) {dimension_numbers = #stablehlo.gather<offset_dims = [1, 2], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, 2, 4>, indices_are_sorted = false} : (tensor<6x2x4xf32>, tensor<3x1xi32>) -> tensor<3x2x4xf32>\n\
         %7 = \"stablehlo.scatter\"(%0, %3, %2) ({\n\
         ^bb0(%8: tensor<f32>, %9: tensor<f32>):\n\
         \"stablehlo.return\"(%9) : (tensor<f32>) -> ()\n\
         }) {scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1, 2], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = true, unique_indices = true} : (tensor<6x2x4xf32>, tensor<3x1xi32>, tensor<3x2x4xf32>) -> tensor<6x2x4xf32>"
    );
}

#[test]
fn if_else_emits_both_regions_and_names_its_results() {
    let t = body(&[TensorType::i1(&[]), f32t(&[2])], |b, a| {
        let open = b.open_region();
        let e = b.exp(&a[1]);
        let then = b.close_region(open, &[&e]);
        let open = b.open_region();
        let otherwise = b.close_region(open, &[&a[1]]);
        let r = b.if_else(&a[0], then, otherwise);
        assert_eq!(r.len(), 1);
        b.neg(&r[0]);
    });
    assert_eq!(
        t,
        "%3 = \"stablehlo.if\"(%0) ({\n\
         %2 = \"stablehlo.exponential\"(%1) : (tensor<2xf32>) -> tensor<2xf32>\n\
         \"stablehlo.return\"(%2) : (tensor<2xf32>) -> ()\n\
         }, {\n\
         \"stablehlo.return\"(%1) : (tensor<2xf32>) -> ()\n\
         }) : (tensor<i1>) -> (tensor<2xf32>)\n\
         %4 = \"stablehlo.negate\"(%3) : (tensor<2xf32>) -> tensor<2xf32>"
    );
}

#[test]
fn cumsum_is_a_reduce_window_over_everything_before() {
    let t = body(&[i32t(&[5])], |b, a| {
        b.cumsum(&a[0]);
    });
    assert_eq!(
        t,
        "%1 = \"stablehlo.constant\"() {value = dense<0> : tensor<i32>} : () -> tensor<i32>\n\
         %2 = \"stablehlo.reduce_window\"(%0, %1) ({\n\
         ^bb0(%3: tensor<i32>, %4: tensor<i32>):\n\
         %5 = \"stablehlo.add\"(%3, %4) : (tensor<i32>, tensor<i32>) -> tensor<i32>\n\
         \"stablehlo.return\"(%5) : (tensor<i32>) -> ()\n\
         }) {window_dimensions = array<i64: 5>, padding = dense<[[4, 0]]> : tensor<1x2xi64>} : (tensor<5xi32>, tensor<i32>) -> tensor<5xi32>"
    );
}

#[test]
fn gather_lanes_takes_one_lane_column_per_index() {
    let t = body(&[f32t(&[5, 3, 4]), i32t(&[2, 2])], |b, a| {
        b.gather_lanes(&a[0], &a[1]);
    });
    assert_eq!(
        t,
        "%2 = \"stablehlo.gather\"(%0, %1) {dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0, 2], start_index_map = [0, 2], index_vector_dim = 1>, slice_sizes = array<i64: 1, 3, 1>, indices_are_sorted = false} : (tensor<5x3x4xf32>, tensor<2x2xi32>) -> tensor<2x3xf32>"
    );
}

#[test]
#[should_panic(
    expected = "dot_general: lhs tensor<6x4xf32> dim 1 does not match rhs tensor<5x2xf32> dim 0"
)]
fn shape_errors_name_the_op_and_shapes() {
    let mut b = FuncBuilder::new("f");
    let w = b.arg(f32t(&[6, 4]));
    let x = b.arg(f32t(&[5, 2]));
    b.dot_general(&w, &x, &DotDims::contract(1, 0));
}

// ---- compile tests -------------------------------------------------------------------------

/// `iree-compile` as the crate finds it (`Compiler::discover`: `$KVSNAP_IREE_COMPILE`, the
/// workspace `.venv`, or `PATH`, checked to be a 3.13 compiler).
fn iree_compile() -> Option<PathBuf> {
    Compiler::discover()
        .ok()
        .map(|c| c.executable().to_path_buf())
}

/// Compiles `mlir`, linking `objects`, for `target`; `None` (and a visible SKIPPED line)
/// without a compiler.
fn compile(target: Target, mlir: &str, objects: &[LinkedObject], what: &str) -> Option<()> {
    run_compiler(target, mlir, objects, what, &[]).map(|_| ())
}

/// Runs `iree-compile` for `target` (llvm-cpu for a generic CPU, or IREE's generic SPIR-V) on
/// `mlir`, linking `objects`, with the `extra` flags and returns what it wrote; `None` (and a
/// visible SKIPPED line) without a compiler.
fn run_compiler(
    target: Target,
    mlir: &str,
    objects: &[LinkedObject],
    what: &str,
    extra: &[&str],
) -> Option<Vec<u8>> {
    let Some(exe) = iree_compile() else {
        eprintln!("SKIPPED: iree-compile not found ({what})");
        return None;
    };
    let dir = std::env::temp_dir().join(format!("kvsnap-emit-{}-{what}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("m.mlir");
    std::fs::write(&src, mlir).unwrap();
    for object in objects {
        std::fs::write(dir.join(object.name), object.bytes).unwrap();
    }
    let flags: &[&str] = match target {
        Target::LlvmCpu => &[
            "--iree-hal-target-device=local",
            "--iree-hal-local-target-device-backends=llvm-cpu",
            "--iree-llvmcpu-target-cpu=generic",
        ],
        Target::VulkanSpirv => &["--iree-hal-target-device=vulkan"],
    };
    let out = Command::new(exe)
        .arg("--iree-input-type=stablehlo")
        .args(flags)
        .args(extra)
        .arg(format!(
            "--iree-hal-executable-object-search-path={}",
            dir.display()
        ))
        .arg(&src)
        .arg("-o")
        .arg(dir.join("m.out"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "iree-compile failed on {what}:\n{stderr}"
    );
    let written = std::fs::read(dir.join("m.out")).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    Some(written)
}

#[test]
fn every_op_compiles() {
    let mut b = FuncBuilder::new("ops");
    let x = b.arg(f32t(&[6, 2, 4]));
    let i = b.arg(i32t(&[]));
    let ids = b.arg(i32t(&[3]));
    let w = b.arg(f32t(&[8, 4]));
    let bytes = b.arg(TensorType::new(&[4], ElemType::I8));
    let host = b.scalar_arg();
    let idx = b.reshape(&ids, &[3, 1]);
    let rows = b.gather_rows(&x, &idx);
    let lane_idx = b.concatenate(&[&idx, &idx], 1);
    let lanes = b.gather_lanes(&x, &lane_idx); // [3, 2]
    let lanes = b.broadcast_in_dim(&lanes, &[3, 2, 4], &[0, 1]);
    let rows = b.add(&rows, &lanes);
    let u = b.exp(&rows);
    let y = b.scatter_rows(&x, &idx, &u);
    // Indices and a predicate from host scalars.
    let three = b.scalar_i32(3);
    let row = b.scalar_rem(&host, &three);
    let row = b.scalar_add(&row, &three);
    let row = b.scalar_sub(&row, &three);
    let row_t = b.tensor_of(&row);
    let y = b.dynamic_update_slice(&y, &rows, &[&row_t, &i, &i]);
    let first = b.scalar_compare(Cmp::Ge, &host, &three);
    let first = b.tensor_of(&first);
    let open = b.open_region();
    let then = b.close_region(open, &[&y]);
    let open = b.open_region();
    let y2 = b.neg(&y);
    let otherwise = b.close_region(open, &[&y2]);
    let y = b.if_else(&first, then, otherwise).remove(0);
    let s = b.dynamic_slice(&y, &[&i, &i, &i], &[2, 2, 4]);
    let s = b.reshape(&s, &[4, 4]);
    let m = b.dot_general(&w, &s, &DotDims::contract(1, 1)); // [8, 4]
    let packed = b.reshape(&w, &[2, 4, 4, 1]);
    let lhs = b.reshape(&s, &[1, 4, 4, 1]);
    let tiles = b.mmt4d(&lhs, &packed); // [1, 2, 4, 4]
    let tiles = b.reshape(&tiles, &[8, 4]);
    let m = b.add(&m, &tiles);
    let t = b.transpose(&m, &[1, 0]);
    let c = b.const_f32(0.5, &[4, 8]);
    let t = b.mul(&t, &c);
    let t = b.tanh(&t);
    let t = b.rsqrt(&t);
    let t = b.sqrt(&t);
    let t = b.cos(&t);
    let t = b.sin(&t);
    let t = b.log(&t);
    let t = b.neg(&t);
    let t = b.round_nearest_even(&t);
    let sum = b.reduce(&t, Reduction::Sum, &[1]);
    let mx = b.reduce(&t, Reduction::Max, &[0]);
    let iota = b.iota(&[4, 8], 1);
    let (_, arg) = b.argmax(&t, &iota, 1);
    let seven = b.const_i32(7, &[4]);
    let r = b.remainder(&arg, &seven);
    let lo = b.const_i32(0, &[]);
    let r = b.clamp(&lo, &r, &i);
    let p = b.compare(Cmp::Gt, &r, &seven);
    let q = b.compare(Cmp::Eq, &r, &seven);
    let p = b.and(&p, &q);
    let p = b.or(&p, &q);
    let sum2 = b.add(&sum, &sum);
    let sum3 = b.sub(&sum2, &sum);
    let sum4 = b.div(&sum3, &sum2);
    let sum5 = b.max(&sum4, &sum);
    let sum6 = b.min(&sum5, &sum);
    let sel = b.select(&p, &sum6, &sum);
    let f = b.convert(&r, ElemType::F32);
    let cat = b.concatenate(&[&sel, &f], 0);
    let sl = b.slice(&cat, &[1], &[5]);
    let v = b.const_f32_vec(&[1.0, 2.0, 3.0, 4.0]);
    let out = b.add(&sl, &v);
    let widened = b.convert(&bytes, ElemType::F32);
    let out = b.add(&out, &widened);
    let prefix = b.cumsum(&r);
    let prefix = b.convert(&prefix, ElemType::F32);
    let out = b.add(&out, &prefix);
    let mut module = Module::new("ops");
    module.push(b.finish(&[&out, &mx]));
    compile(Target::LlvmCpu, &module.text(), &[], "ops");
}

#[test]
fn scalar_arguments_are_printed_as_i32() {
    let mut b = FuncBuilder::new("f");
    let x = b.arg(i32t(&[]));
    let n = b.scalar_arg();
    let one = b.scalar_i32(1);
    let m = b.scalar_sub(&n, &one);
    let p = b.scalar_compare(Cmp::Lt, &m, &one);
    let t = b.tensor_of(&m);
    let pt = b.tensor_of(&p);
    assert_eq!(
        (t.ty.clone(), pt.ty.clone()),
        (i32t(&[]), TensorType::i1(&[]))
    );
    let y = b.add(&x, &t);
    let text = b.finish(&[&y]);
    assert!(text.contains("@f(%0: tensor<i32>, %1: i32)"), "{text}");
    assert!(
        text.contains("\"arith.constant\"() {value = 1 : i32} : () -> i32"),
        "{text}"
    );
    assert!(
        text.contains("\"arith.subi\"(%1, %2) : (i32, i32) -> i32"),
        "{text}"
    );
    assert!(
        text.contains("\"arith.cmpi\"(%3, %2) {predicate = 2 : i64} : (i32, i32) -> i1"),
        "{text}"
    );
    assert!(
        text.contains("\"tensor.from_elements\"(%3) : (i32) -> tensor<i32>"),
        "{text}"
    );
}

/// Every public function of the tiny model's llvm-cpu module, with branches and the screened
/// head, compiled to IREE's stream dialect: none reads a value back to the host before its
/// end (`stream.resource.load`). Indices and predicates computed on the device would each
/// cost a queue round trip (0.1-0.7 ms a decode step on a 2-vCPU host, twenty-fifth pass).
#[test]
fn no_entry_point_reads_back_before_its_end() {
    let cfg = config(Preset::Tiny);
    let opts = GraphOptions {
        screen: true,
        ..GraphOptions::llvm_cpu()
    };
    let g = graphs::build(&cfg, &[1, 8], opts);
    let stream = run_compiler(
        Target::LlvmCpu,
        &g.mlir,
        &g.objects,
        "stream",
        &["--compile-to=stream"],
    );
    let Some(stream) = stream else {
        return;
    };
    let stream = String::from_utf8(stream).unwrap();
    let names: Vec<&str> = g
        .manifest
        .entry_points
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    assert!(names.len() >= 4, "{names:?}");
    for name in names {
        let start = stream
            .find(&format!("util.func public @{name}("))
            .unwrap_or_else(|| panic!("no @{name} in the stream IR"));
        let body = &stream[start..];
        let body = &body[..body.find("\n  }\n").expect("the function's end")];
        assert!(
            body.contains("stream.cmd.dispatch"),
            "{name}: no dispatch found"
        );
        assert_eq!(
            body.matches("stream.resource.load").count(),
            0,
            "{name} reads a value back to the host"
        );
    }
}

// ---- graphs --------------------------------------------------------------------------------

fn real_config() -> ModelConfig {
    config(Preset::RealShapes)
}

/// Every `tensor<...>` type in `text`, as dims.
fn tensor_types(text: &str) -> Vec<Vec<usize>> {
    text.split("tensor<")
        .skip(1)
        .map(|t| {
            let t = &t[..t.find('>').unwrap()];
            t.split('x')
                .filter_map(|d| d.parse::<usize>().ok())
                .collect()
        })
        .collect()
}

/// How many of `cfg`'s layers are global.
fn global_layers(cfg: &ModelConfig) -> usize {
    cfg.layer_kinds
        .iter()
        .filter(|&&k| k == LayerKind::Global)
        .count()
}

/// Whether `body` has the attention weights of `C` query rows over `rows` keys, `heads` being
/// `(kvh, C, g)`: `[kvh, C, g, rows]`, or (Vulkan, a few query rows) `[kvh, C, g, blocks,
/// block]` with `blocks * block = rows`.
fn attends_over(body: &str, (kvh, c, g): (usize, usize, usize), rows: usize) -> bool {
    body.contains(&format!("tensor<{kvh}x{c}x{g}x{rows}xf32>"))
        || (2..rows)
            .filter(|b| rows.is_multiple_of(*b))
            .any(|b| body.contains(&format!("tensor<{kvh}x{c}x{g}x{}x{b}xf32>", rows / b)))
}

/// The text of function `@name` in `mlir` (up to the next function).
fn function_of<'a>(mlir: &'a str, name: &str) -> &'a str {
    let start = mlir
        .find(&format!("func.func @{name}("))
        .unwrap_or_else(|| panic!("no function @{name}"));
    let rest = &mlir[start + 1..];
    let end = rest
        .find("func.func @")
        .map_or(mlir.len(), |e| start + 1 + e);
    &mlir[start..end]
}

#[test]
fn graphs_build_for_tiny_and_real_configs_with_the_head_sliced() {
    // IREE's code throughout: the rows the graph's attention reads are what is checked here
    // (the decode step's attention kernels skip the rows they cannot see instead:
    // `own_kernels_take_the_chunk_projections_and_the_screen`,
    // `vulkan_decode_steps_run_the_spirv_kernels`).
    let llvm_cpu = GraphOptions {
        own_kernels: None,
        ..GraphOptions::llvm_cpu()
    };
    let unscreened = GraphOptions {
        screen: false,
        ..llvm_cpu
    };
    let vulkan = GraphOptions {
        spirv_kernels: None,
        ..GraphOptions::vulkan()
    };
    let options = [vulkan, llvm_cpu, unscreened];
    for (cfg, opts) in [config(Preset::Tiny), real_config()]
        .into_iter()
        .flat_map(|cfg| options.map(|o| (cfg.clone(), o)))
    {
        let layout = opts.layout;
        let g = graphs::build(&cfg, &DEFAULT_CHUNKS, opts);
        assert_eq!(g.manifest.weight_layout, layout);
        assert_eq!(g.manifest.table_layout, opts.table_layout());
        assert_eq!(
            opts.table_layout(),
            if opts.screen {
                WeightLayout::Rows
            } else {
                layout
            }
        );
        let vocab = cfg.vocab_size;
        // No tensor with a vocab dim and another dim > 1 (no SEQ x vocab logits anywhere),
        // except the embedding table itself (and, with panels, the head's products of the
        // table's shape and its `[panels, 16]` sums; with the screen, the int8 table's and the
        // blocks of 16 rows it finds candidates in).
        let table = opts.table_layout().table_dims(vocab, cfg.hidden_size);
        let panels = vocab.div_ceil(TABLE_LANES);
        let screen_panels = [panels, cfg.hidden_size, TABLE_LANES];
        for dims in tensor_types(&g.mlir) {
            if dims == table {
                continue;
            }
            if dims.contains(&vocab) {
                assert!(
                    dims.iter().filter(|&&d| d != vocab).all(|&d| d == 1)
                        && dims.iter().filter(|&&d| d == vocab).count() == 1,
                    "tensor {dims:?} has a vocab ({vocab}) dim and another dim > 1"
                );
            }
            // A panels dim is the table's or the head's sums. Checked where no other dim can
            // equal it: the tiny model's 32 panels are also its head_dim.
            if layout == WeightLayout::Panels && panels > 1024 && dims.contains(&panels) {
                let screened = opts.screen
                    && (dims == screen_panels
                        || dims == [panels]
                        || dims == [SCREEN_BLOCKS, panels]);
                assert!(
                    dims == [panels, TABLE_LANES] || screened,
                    "tensor {dims:?} has a panels ({panels}) dim besides the head's"
                );
            }
        }
        // The head was built: [vocab] logits are returned.
        assert!(g.mlir.contains(&format!("tensor<{vocab}xf32>")));
        // On every target, decode steps and largest chunks of the model's input that attend
        // over the first rows of the KV buffers only, picked on the host by where the call
        // ends (no branch needed).
        let capacity = cfg.context_capacity;
        let ring = g.manifest.ring;
        let largest = *DEFAULT_CHUNKS.last().unwrap();
        let steps = opts.spans(1, capacity, ring);
        let long = opts.spans(largest, capacity, ring);
        assert!(!steps.is_empty(), "decode-step spans");
        // Twice and four times the largest chunk within the ring's modulus (the real model's
        // 640 rows; the tiny model's window of 6 leaves it 70, less than 2 x 64).
        let expected: &[usize] = match cfg.sliding_window {
            512 => &[256, 512],
            _ => &[],
        };
        assert_eq!(long, expected);
        // The model's input in every chunk size, the other in the decode step's and the
        // largest only.
        let (primary, other) = match opts.input {
            Input::Ids => (Role::Ids, Role::Embeddings),
            Input::Embeddings => (Role::Embeddings, Role::Ids),
        };
        assert_eq!(g.manifest.chunks_for(primary), DEFAULT_CHUNKS);
        assert_eq!(g.manifest.chunks_for(other), [1, largest]);
        // With the screened head, every decode step of token ids twice: screened and with
        // logits, neither branching on the head.
        let step_variants = head_modes(opts, 1).len();
        assert_eq!(step_variants, if opts.screen { 2 } else { 1 });
        // Vulkan's multi-step decode entry points: 16 steps of token ids with the full head,
        // over a quarter of the capacity and over all of it; their second result every step's
        // token, stored in the last argument.
        let multi: Vec<&EntryPoint> = g
            .manifest
            .entry_points
            .iter()
            .filter(|e| e.steps > 1)
            .collect();
        let multi_spans: Vec<usize> = multi.iter().map(|e| e.span).collect();
        let want_spans = match opts.decode_steps {
            0 => Vec::new(),
            _ => vec![capacity / 4, capacity],
        };
        assert_eq!(multi_spans, want_spans);
        for e in &multi {
            let k = opts.decode_steps;
            assert_eq!(
                (e.steps, e.chunk, e.input, e.head),
                (k, 1, Role::Ids, HeadMode::Full)
            );
            assert_eq!(
                (e.results[1].role, &e.results[1].dims),
                (Role::Tokens, &vec![k])
            );
            let last = e.args.last().unwrap();
            assert_eq!((last.role, &last.dims), (Role::TokensOut, &vec![k]));
            let body = function_of(&g.mlir, &e.name);
            assert_eq!(body.matches("stablehlo.if").count(), 0, "{}", e.name);
        }
        assert_eq!(
            g.manifest.entry_points.len(),
            DEFAULT_CHUNKS.len() + 2 + step_variants * (steps.len() + 1) - 1
                + long.len()
                + multi.len()
        );
        let (kvh, group) = (cfg.num_key_value_heads, cfg.group_size());
        let spanned = steps
            .iter()
            .map(|&s| (1, s))
            .chain(long.iter().map(|&s| (largest, s)));
        for (c, span) in spanned {
            let name = span_entry_name(opts.input, c, span);
            let e = g.manifest.entry(&name).expect("span entry in manifest");
            assert_eq!((e.chunk, e.input, e.span), (c, primary, span));
            let body = function_of(&g.mlir, &name);
            // The global layers attend over `span` rows, the sliding layers over as many of the
            // ring's as lie within its modulus, a decode step over the modulus at most (the
            // weights `[kvh, C, g, rows]`, or on Vulkan `[kvh, C, g, blocks, block]` for a few
            // query rows).
            let attends = |body: &str, rows: usize| attends_over(body, (kvh, c, group), rows);
            assert!(attends(body, span), "{name}: global scores");
            let sliding = ring.rows_seen(c, Some(span));
            let within = if span <= ring.modulus {
                span
            } else {
                ring.rows
            };
            assert_eq!(
                sliding,
                if c == 1 {
                    within.min(ring.modulus)
                } else {
                    within
                }
            );
            assert!(attends(body, sliding), "{name}: sliding scores");
            if sliding < ring.rows {
                assert!(!attends(body, ring.rows), "{name}: the whole ring");
            }
            // No branch picks a global span, nor a decode step's head.
            let ifs = body.matches("stablehlo.if").count();
            let base = function_of(&g.mlir, &entry_name(opts.input, c));
            let base_ifs = base.matches("stablehlo.if").count();
            if c == 1 || !opts.branches {
                assert_eq!(ifs, 0, "{name}");
            } else {
                let globals = global_layers(&cfg);
                assert!(
                    ifs < base_ifs,
                    "{name}: {ifs} branches, {base_ifs} without a span"
                );
                assert_eq!((base_ifs - ifs) % globals, 0, "{name}");
            }
            for head in [HEAD_NONE, HEAD_SCREEN, HEAD_FULL] {
                let chosen = g.manifest.entry_for(primary, c, span, head).unwrap();
                // The screened step where logits are not asked for; its `_logits` twin where
                // they are.
                if c == 1 && opts.screen && head == HEAD_FULL {
                    assert_eq!(chosen.name, format!("{name}_logits"));
                    assert_eq!(chosen.head, HeadMode::Full);
                    let twin = function_of(&g.mlir, &chosen.name);
                    assert!(attends(twin, span), "{name}_logits: global scores");
                    assert!(!twin.contains("stablehlo.if"), "{name}_logits");
                } else {
                    assert_eq!(chosen.name, name, "head {head}");
                }
            }
        }
        let whole = g
            .manifest
            .entry_for(Role::Ids, 1, capacity, HEAD_SCREEN)
            .unwrap();
        assert_eq!(whole.name, entry_name(Input::Ids, 1));
        // Every decode step's sliding layers attend over the ring's modulus, not its rows past
        // it (the host folds a chunk's rows there back to `p % modulus`).
        let body = function_of(&g.mlir, &whole.name);
        let heads = (kvh, 1, group);
        assert!(
            attends_over(body, heads, ring.modulus),
            "the step's sliding scores"
        );
        assert!(
            !attends_over(body, heads, ring.rows),
            "the step over the whole ring"
        );
        let first = g.manifest.entry_for(primary, 1, 1, HEAD_SCREEN).unwrap();
        assert_eq!(first.span, steps[0]);
        // The other input's entry points attend over the whole capacity.
        let other_step = g.manifest.entry_for(other, 1, 1, HEAD_SCREEN).unwrap();
        assert_eq!(other_step.span, capacity);
        let first = g
            .manifest
            .entry_for(primary, largest, largest, HEAD_NONE)
            .unwrap();
        assert_eq!(first.span, long.first().copied().unwrap_or(capacity));
        let past = (ring.modulus + 1).min(capacity);
        let past = g
            .manifest
            .entry_for(primary, largest, past, HEAD_FULL)
            .unwrap();
        assert_eq!(past.name, entry_name(opts.input, largest));
        assert_eq!(
            g.manifest.entry_for(Role::Ids, 1, capacity + 1, HEAD_FULL),
            None
        );
        for &c in &DEFAULT_CHUNKS {
            for input in Input::ALL {
                let name = entry_name(input, c);
                if input != opts.input && c != 1 && c != largest {
                    assert!(g.manifest.entry(&name).is_none(), "{name}");
                    assert!(!g.mlir.contains(&format!("@{name}(")), "{name}");
                    continue;
                }
                let e = g.manifest.entry(&name).expect("entry point in manifest");
                // Branches where asked for, in chunks of more than one row only: a decode
                // step reads no predicate back to the host, but for the one that picks the
                // screened head.
                let body = function_of(&g.mlir, &name);
                let ifs = body.matches("stablehlo.if").count();
                if c == 1 {
                    // The embeddings' step picks its head by a branch; the ids' comes twice.
                    let branch = opts.screen && input == Input::Embeddings;
                    assert_eq!(ifs, usize::from(branch), "{name}");
                    assert_eq!(
                        e.head == HeadMode::Argument,
                        !opts.screen || branch,
                        "{name}"
                    );
                } else {
                    assert_eq!(ifs > 0, opts.branches || opts.screen, "{name}");
                }
                assert_eq!(e.weights().count(), 2 + 10 * cfg.num_layers());
                assert_eq!(e.screen().count(), if opts.screen { 3 } else { 0 });
                assert_eq!(e.kv().count(), 2 * cfg.num_layers() + 1);
                assert_eq!(e.results[0].role, Role::Next);
                assert_eq!(e.results[1].dims, [vocab]);
                assert_eq!(e.args[1].role, Role::Pos0);
                assert_eq!(e.args[2].role, Role::Valid);
                assert_eq!(e.args[3].role, Role::Head);
            }
        }
    }
}

#[test]
fn manifest_lists_weights_by_hf_name_in_call_order() {
    let cfg = config(Preset::Tiny);
    let g = graphs::build(&cfg, &[1], GraphOptions::vulkan());
    let e = g.manifest.entry("chunk_ids_c1").unwrap();
    let names: Vec<&str> = e.weights().map(|w| w.name.as_str()).collect();
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(names[1], "model.layers.0.input_layernorm.weight");
    assert_eq!(names[2], "model.layers.0.self_attn.qkv_proj.weight");
    assert_eq!(
        names[10],
        "model.layers.0.post_feedforward_layernorm.weight"
    );
    assert_eq!(*names.last().unwrap(), "model.norm.weight");
    // q, k and v stacked along their output rows, gate and up likewise; the parts by HF name.
    let qkv = e.weights().nth(2).unwrap();
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    assert_eq!(
        qkv.dims,
        [
            cfg.num_attention_heads * cfg.head_dim + 2 * kv,
            cfg.hidden_size
        ]
    );
    assert_eq!(
        qkv.parts,
        ["q_proj", "k_proj", "v_proj"].map(|p| format!("model.layers.0.self_attn.{p}.weight"))
    );
    let gate_up = e.weights().nth(8).unwrap();
    assert_eq!(gate_up.name, "model.layers.0.mlp.gate_up_proj.weight");
    assert_eq!(gate_up.dims, [2 * cfg.intermediate_size, cfg.hidden_size]);
    assert_eq!(
        gate_up.parts,
        ["gate_proj", "up_proj"].map(|p| format!("model.layers.0.mlp.{p}.weight"))
    );
    assert!(e
        .weights()
        .filter(|w| !w.name.contains("qkv_proj") && !w.name.contains("gate_up_proj"))
        .all(|w| w.parts.is_empty()));
    // Sliding layer 0 has a ring of the window; global layer 2 the full capacity.
    let kv: Vec<_> = e.kv().collect();
    assert_eq!(kv[0].name, "layers.0.k");
    // Largest chunk 1: rows are written at pos0 % (window + 1), with one row of slack.
    let ring = g.manifest.ring;
    assert_eq!(
        (ring.modulus, ring.rows),
        (cfg.sliding_window + 1, cfg.sliding_window + 2)
    );
    assert_eq!(
        kv[0].dims,
        [ring.rows, cfg.num_key_value_heads, cfg.head_dim]
    );
    assert_eq!(kv[5].name, "layers.2.v");
    assert_eq!(kv[5].dims[0], cfg.context_capacity);
    assert_eq!(kv[12].name, graphs::SLIDING_POSITIONS);
    assert_eq!(kv[12].dims, [ring.rows]);
    // The function signature lists the arguments in manifest order.
    let sig = g
        .mlir
        .lines()
        .find(|l| l.contains("@chunk_ids_c1("))
        .unwrap();
    // head, pos0 and valid by value after pos0 and valid as tensors: the host program
    // computes indices and branches with them.
    assert!(sig.contains(
        "(%0: tensor<1xi32>, %1: tensor<i32>, %2: tensor<i32>, %3: i32, %4: i32, %5: i32, %6: tensor<512x64xf32>"
    ));
    let roles: Vec<(Role, DType)> = e.args[1..6].iter().map(|a| (a.role, a.dtype)).collect();
    assert_eq!(
        roles,
        [
            (Role::Pos0, DType::I32),
            (Role::Valid, DType::I32),
            (Role::Head, DType::HostI32),
            (Role::Pos0Host, DType::HostI32),
            (Role::ValidHost, DType::HostI32)
        ]
    );
    // The token's storage comes last, the storage of result 0 (`next`).
    let last = e.args.last().unwrap();
    assert_eq!((last.role, last.dtype), (Role::NextOut, DType::I32));
    assert!(last.dims.is_empty());
    assert_eq!(e.results[0].role, Role::Next);
    let n = e.args.len() - 1;
    assert!(sig.contains(&format!(
        ", %{n}: tensor<i32> {{iree.abi.output = 0 : index}}) -> (tensor<i32>, "
    )));
    let json = serde_json::to_string(&g.manifest).unwrap();
    let back: graphs::Manifest = serde_json::from_str(&json).unwrap();
    assert_eq!(back, g.manifest);

    assert_eq!(e.screen().count(), 0);

    // With panels the table is `[vocab / 16, hidden, 16]` (in rows with the screened head),
    // every projection `[rows / 32, cols, 32]`; the norms stay as they are.
    for screen in [false, true] {
        let opts = GraphOptions {
            screen,
            ..GraphOptions::llvm_cpu()
        };
        let p = graphs::build(&cfg, &[1], opts);
        assert_eq!(p.manifest.weight_layout, WeightLayout::Panels);
        let pe = p.manifest.entry("chunk_ids_c1").unwrap();
        assert_eq!(pe.weights().count(), e.weights().count());
        for (panels, rows) in pe.weights().zip(e.weights()) {
            assert_eq!(panels.name, rows.name);
            assert_eq!(panels.parts, rows.parts);
            let lanes = if rows.name == "model.embed_tokens.weight" {
                if screen {
                    assert_eq!(panels.dims, rows.dims);
                    continue;
                }
                TABLE_LANES
            } else {
                PROJECTION_LANES
            };
            match rows.dims[..] {
                [r, c] => assert_eq!(panels.dims, [r.div_ceil(lanes), c, lanes], "{}", rows.name),
                _ => assert_eq!(panels.dims, rows.dims, "{}", rows.name),
            }
        }
        // The screened head's tensors follow the weights, before the KV buffers.
        let screen_args: Vec<_> = pe.screen().collect();
        if screen {
            let names: Vec<&str> = screen_args.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(names, SCREEN_WEIGHTS);
            let (v, h) = (cfg.vocab_size, cfg.hidden_size);
            assert_eq!(
                screen_args[0].dims,
                [v.div_ceil(TABLE_LANES), h, TABLE_LANES]
            );
            assert_eq!(screen_args[0].dtype, DType::I8);
            assert_eq!(
                (&screen_args[1].dims, screen_args[1].dtype),
                (&vec![v], DType::F32)
            );
            assert_eq!(
                (&screen_args[2].dims, screen_args[2].dtype),
                (&vec![v], DType::F32)
            );
            let first_kv = pe.args.iter().position(|a| a.role == Role::Kv).unwrap();
            let last_screen = pe
                .args
                .iter()
                .rposition(|a| a.role == Role::Screen)
                .unwrap();
            assert_eq!(last_screen + 1, first_kv);
        } else {
            assert!(screen_args.is_empty());
            let table = pe.weights().next().unwrap();
            assert_eq!(table.dims, [cfg.vocab_size / 16, cfg.hidden_size, 16]);
        }
    }
}

#[test]
fn tiny_module_compiles() {
    let targets = [
        (Target::VulkanSpirv, GraphOptions::vulkan()),
        (Target::LlvmCpu, GraphOptions::llvm_cpu()),
    ];
    for (target, opts) in targets {
        let g = graphs::build(&config(Preset::Tiny), &DEFAULT_CHUNKS, opts);
        compile(target, &g.mlir, &g.objects, target.name());
    }
}

#[test]
fn prefill_products_deeper_than_640_are_split_into_blocks() {
    // Per layer of a chunk function: q and k together (their heads are normed and rotated
    // together), v, gate and up (640 deep) one `mmt4d` each (the stacked arguments one per
    // part), o (1024) two, down (2048) four; a one-row chunk has none (its products are
    // matvecs, one per stack).
    let cfg = real_config();
    let iree_products = GraphOptions {
        own_kernels: None,
        ..GraphOptions::llvm_cpu()
    };
    let g = graphs::build(&cfg, &[1, 64], iree_products);
    let count = g.mlir.matches("\"linalg.mmt4d\"").count();
    // The 64-row chunk's two inputs and its three spans (128, 256, 512).
    let chunks = g
        .manifest
        .entry_points
        .iter()
        .filter(|e| e.chunk == 64)
        .count();
    assert_eq!(chunks, 2 + 3);
    assert_eq!(count, chunks * cfg.num_layers() * (4 + 2 + 4));
    // Each part's `mmt4d` reads its panels of the stack: q's and k's 40, v's 8.
    for panels in [40, 8] {
        assert!(
            g.mlir.contains(&format!("tensor<{panels}x640x32x1xf32>")),
            "{panels} panels"
        );
    }
    assert!(
        g.mlir.contains("tensor<8x512x8x1xf32>"),
        "a 512-deep block of 8-row tiles"
    );
    let rows = graphs::build(&cfg, &[1, 64], GraphOptions::vulkan());
    assert_eq!(rows.mlir.matches("\"linalg.mmt4d\"").count(), 0);
}

/// With kvsnap's kernels (`GraphOptions::own_kernels`) each projection of a chunk of a
/// multiple of 8 rows is one dispatch to the panel product over the whole stack and depth (q,
/// k and v; o; gate and up; down: four a layer), a chunk of rows in tiles of 4 keeps IREE's
/// `mmt4d`s (split by depth), every screen's scores are one dispatch to the screen kernel over
/// the whole int8 table (which is then never widened to f32) and its candidate rows one to
/// the gather kernel, every decode step's and every chunk's attention is one dispatch a layer
/// to an attention kernel over the layer's whole buffers, and the module's executable names the
/// object.
#[test]
fn own_kernels_take_the_chunk_projections_and_the_screen() {
    let cfg = real_config();
    let object = LinkedObject {
        name: "kvsnap_test_object.o",
        bytes: b"",
    };
    let opts = GraphOptions {
        own_kernels: Some(object),
        ..GraphOptions::llvm_cpu()
    };
    let g = graphs::build(&cfg, &[1, 12, 64], opts);
    assert_eq!(g.objects, [object]);
    assert!(g
        .mlir
        .contains(r#"#hal.executable.object<{path = "kvsnap_test_object.o"}>"#));
    let entry_points = |c: usize| {
        g.manifest
            .entry_points
            .iter()
            .filter(|e| e.chunk == c)
            .count()
    };
    let layers = cfg.num_layers();
    let dispatches = g
        .mlir
        .matches("flow.dispatch @kvsnap_kernels::@mmt4d_8x32[")
        .count();
    assert_eq!(dispatches, entry_points(64) * layers * 4);
    let mmt4ds = g.mlir.matches("\"linalg.mmt4d\"").count();
    assert_eq!(mmt4ds, entry_points(12) * layers * (4 + 2 + 4));
    // A 64-row chunk's q, k and v: 8 tiles of 8 rows against 48 panels, 16 workgroups; its
    // down product over the whole 2048-deep panels.
    assert!(g.mlir.contains(
        "(tensor<8x640x8x1xf32>, tensor<48x640x32xf32>, index, index, index, index) -> \
         tensor<8x48x8x32xf32>"
    ));
    assert!(g
        .mlir
        .contains("(tensor<8x2048x8x1xf32>, tensor<20x2048x32xf32>, index, index, index, index)"));
    // The screen: 16,384 panels of 16 int8 lanes in 256 runs of 64, in every entry point but
    // the decode steps' full-head twins (the chunks' under their head branch).
    let screened = g
        .manifest
        .entry_points
        .iter()
        .filter(|e| e.head != HeadMode::Full)
        .count();
    assert!(screened > 0);
    let screens = g
        .mlir
        .matches("flow.dispatch @kvsnap_kernels::@screen_16[")
        .count();
    assert_eq!(screens, screened);
    // Its candidate rows: 32 blocks of 16 rows of the f32 table, one dispatch each screen.
    let gathers = g
        .mlir
        .matches(
            "(tensor<262144x640xf32>, tensor<32xi32>, index, index, index) -> \
             tensor<512x640xf32>",
        )
        .count();
    assert_eq!(gathers, screened);
    assert!(g.mlir.contains(
        "(tensor<16384x640x16xi8>, tensor<640xf32>, index, index, index) -> tensor<16384x16xf32>"
    ));
    assert!(!g
        .mlir
        .contains("(tensor<16384x640x16xi8>) -> tensor<16384x640x16xf32>"));
    // The decode steps' attention: one kernel dispatch a layer, 8 splits, over the sliding
    // layers' whole ring with its positions and the global layers' whole buffers; no scores
    // tensor of one query row.
    let attends = g
        .mlir
        .matches("flow.dispatch @kvsnap_kernels::@attend_1[")
        .count();
    assert_eq!(attends, entry_points(1) * layers);
    let ring = g.manifest.ring.rows;
    let attend = |rows: usize| {
        format!(
            "(tensor<1x1x4x256xf32>, tensor<{rows}x1x256xf32>, tensor<{rows}x1x256xf32>, \
             tensor<{ring}xi32>, tensor<2xi32>, index, index, index, index, index, index, index, \
             index, index) -> tensor<8x1x4x258xf32>"
        )
    };
    let globals = global_layers(&cfg);
    assert_eq!(
        g.mlir.matches(&attend(ring)).count(),
        entry_points(1) * (layers - globals)
    );
    let capacity = cfg.context_capacity;
    assert_eq!(
        g.mlir.matches(&attend(capacity)).count(),
        entry_points(1) * globals
    );
    let modulus = g.manifest.ring.modulus;
    for e in g.manifest.entry_points.iter().filter(|e| e.chunk == 1) {
        let body = function_of(&g.mlir, &e.name);
        for rows in [modulus, ring, e.span] {
            let scores = format!("tensor<1x1x4x{rows}xf32>");
            assert!(!body.contains(&scores), "{}: scores {scores}", e.name);
        }
    }
    // The chunks' attention: one kernel dispatch a layer, a workgroup for every 16 of a key/value
    // head's (row, query head) pairs (12 x 4 pairs: 3), normalised; no scores tensor.
    let chunk_attends = g
        .mlir
        .matches("flow.dispatch @kvsnap_kernels::@attend_c[")
        .count();
    assert_eq!(
        chunk_attends,
        (entry_points(12) + entry_points(64)) * layers
    );
    let attend_12 = |rows: usize| {
        format!(
            "(tensor<12x1x4x256xf32>, tensor<{rows}x1x256xf32>, tensor<{rows}x1x256xf32>, \
             tensor<{ring}xi32>, tensor<2xi32>, index, index, index, index, index, index, index, \
             index, index, index) -> tensor<1x12x4x256xf32>"
        )
    };
    assert_eq!(
        g.mlir.matches(&attend_12(ring)).count(),
        entry_points(12) * (layers - globals)
    );
    assert_eq!(
        g.mlir.matches(&attend_12(capacity)).count(),
        entry_points(12) * globals
    );
    for e in g.manifest.entry_points.iter().filter(|e| e.chunk > 1) {
        let body = function_of(&g.mlir, &e.name);
        // (A 256-row span's scores would have the attention's output shape.)
        let spans = [ring, e.span].into_iter().filter(|&r| r != cfg.head_dim);
        for rows in spans {
            let scores = format!("tensor<1x{}x4x{rows}xf32>", e.chunk);
            assert!(!body.contains(&scores), "{}: scores {scores}", e.name);
        }
    }
    let without = GraphOptions {
        own_kernels: None,
        ..GraphOptions::llvm_cpu()
    };
    let iree_code = graphs::build(&cfg, &[1, 64], without);
    assert!(iree_code
        .mlir
        .contains("(tensor<16384x640x16xi8>) -> tensor<16384x640x16xf32>"));
    // (There, a chunk's attention is the graph's, with its scores tensor over the ring.)
    assert!(iree_code
        .mlir
        .contains(&format!("tensor<1x64x4x{ring}xf32>")));
    assert!(!iree_code.mlir.contains("@kvsnap_kernels::@attend_c["));
    // Vulkan links its own SPIR-V objects only (where this build compiled them).
    let vulkan = graphs::build(&cfg, &[1, 64], GraphOptions::vulkan());
    let spirv: Vec<LinkedObject> =
        kvsnap_iree::kernels::spirv_kernels().map_or(vec![], |k| k.objects().to_vec());
    assert_eq!(vulkan.objects, spirv);
    assert!(!vulkan.mlir.contains("flow.dispatch"));
}

/// Vulkan's decode step and its chunks of up to 24 rows attend with the keys as the scores'
/// output rows (`[kvh, rows, C, g]`), their weights `[kvh, C, g, blocks, 32]` and the weighted
/// values' partial sums `[kvh, blocks, C, g, hd]`; its 32-row chunk (128 query rows a KV head)
/// and llvm-cpu's graphs take each product whole.
#[test]
fn vulkan_attends_few_query_rows_in_blocks_of_keys() {
    let cfg = real_config();
    let (g, kvh, hd) = (cfg.group_size(), cfg.num_key_value_heads, cfg.head_dim);
    let capacity = cfg.context_capacity;
    let scores = |c: usize, rows: usize| format!("tensor<{kvh}x{rows}x{c}x{g}xf32>");
    let blocked = |c: usize, rows: usize| format!("tensor<{kvh}x{c}x{g}x{}x32xf32>", rows / 32);
    let parts = |c: usize, rows: usize| format!("tensor<{kvh}x{}x{c}x{g}x{hd}xf32>", rows / 32);
    let whole = |c: usize, rows: usize| format!("tensor<{kvh}x{c}x{g}x{rows}xf32>");
    let chunks = [1, 8, 24, 32];
    // IREE's code (the decode step's attention runs in kvsnap's kernels where this build has
    // them: `vulkan_decode_steps_run_the_spirv_kernels`).
    let iree_vulkan = GraphOptions {
        spirv_kernels: None,
        ..GraphOptions::vulkan()
    };
    let vulkan = graphs::build(&cfg, &chunks, iree_vulkan);
    let modulus = vulkan.manifest.ring.modulus;
    let llvm_cpu = GraphOptions {
        own_kernels: None,
        ..GraphOptions::llvm_cpu()
    };
    let iree_code = graphs::build(&cfg, &chunks, llvm_cpu);
    for c in chunks {
        let step = function_of(&vulkan.mlir, &entry_name(Input::Embeddings, c));
        // The global layers over the whole capacity; a decode step's sliding layers over the
        // ring's modulus.
        let rows: &[usize] = match c {
            1 => &[capacity, modulus],
            8 | 24 => &[capacity],
            _ => &[],
        };
        for &rows in rows {
            assert!(
                step.contains(&scores(c, rows)),
                "c{c}: scores of {rows} keys, keys first"
            );
            assert!(
                step.contains(&blocked(c, rows)),
                "c{c}: softmax of {rows} keys in blocks"
            );
            assert!(
                step.contains(&parts(c, rows)),
                "c{c}: weighted values of {rows} keys in blocks"
            );
        }
        if c == 32 {
            assert!(step.contains(&whole(c, capacity)), "c32: whole");
            assert!(!step.contains(&scores(c, capacity)), "c32: keys first");
            assert!(!step.contains(&blocked(c, capacity)), "c32: blocks");
        }
        let cpu = function_of(&iree_code.mlir, &entry_name(Input::Ids, c));
        assert!(cpu.contains(&whole(c, capacity)), "llvm-cpu c{c}: whole");
        assert!(
            !cpu.contains(&scores(c, capacity)) && !cpu.contains(&blocked(c, capacity)),
            "llvm-cpu c{c}: keys first or blocks"
        );
    }
}

/// With the SPIR-V kernels ([`GraphOptions::spirv_kernels`]) every decode step's layer, in
/// the one-step and the multi-step entry points, attends in two dispatches: a split every 16
/// rows of a sliding layer's ring rows seen and of a global layer's span, which also norms
/// and rotates the step's heads and stores its K and V rows in the layer's buffers (its
/// in-place results), then the merge; no scores tensor of one query row, no rotated heads in
/// the graph (RoPE's `reverse`), and the only scatter a step's is the ring's positions'. The
/// attention's output projection, residual and the norm after it are one dispatch of
/// `matvec_norm`; the MLP's GeGLU, down product, residual and the next layer's norm one of
/// `geglu_down_norm` (the last layer's with the final norm). The q/k/v and gate/up products
/// are one dispatch each of `matvec`, no `dot_general`. The step's embedding row is scaled
/// and normed in one dispatch of `embed_norm`, and the tied head's logits and token come
/// from one of `head`, no IREE product of the table. `matvec_norm`, `geglu_down_norm` and
/// `head` count their workgroups on the module's counters (a global, loaded before and
/// stored after each dispatch, in place). A chunk's four products a layer are one dispatch
/// each of `matmul`, its residuals with their norms one each of `add_norm_rows` (the last
/// layer's with the final norm), its attention one of `attend_rows`, its embedding rows'
/// norm one of `embed_norm` and its head one of `head`; the q/k norms, RoPE and the K/V
/// rows' writes are IREE's code.
#[test]
fn vulkan_decode_steps_run_the_spirv_kernels() {
    use kvsnap_iree::kernels::{SpirvKernels, SPIRV_SPLIT_ROWS};

    let cfg = real_config();
    let object = |name| LinkedObject { name, bytes: b"" };
    let kernels = SpirvKernels {
        split: object("test_split.spv"),
        merge: object("test_merge.spv"),
        geglu_down: object("test_geglu_down.spv"),
        geglu_down_norm: object("test_geglu_down_norm.spv"),
        matvec: object("test_matvec.spv"),
        matvec_norm: object("test_matvec_norm.spv"),
        embed_norm: object("test_embed_norm.spv"),
        head: object("test_head.spv"),
        matmul: object("test_matmul.spv"),
        add_norm_rows: object("test_add_norm_rows.spv"),
        attend_rows: object("test_attend_rows.spv"),
    };
    let opts = GraphOptions {
        spirv_kernels: Some(kernels),
        ..GraphOptions::vulkan()
    };
    let g = graphs::build(&cfg, &[1, 8, 64], opts);
    let all = [
        kernels.split,
        kernels.merge,
        kernels.geglu_down,
        kernels.geglu_down_norm,
        kernels.matvec,
        kernels.matvec_norm,
        kernels.embed_norm,
        kernels.head,
        kernels.matmul,
        kernels.add_norm_rows,
        kernels.attend_rows,
    ];
    assert_eq!(g.objects, all);
    let counters = "@kvsnap_counters";
    assert_eq!(
        g.mlir
            .matches(&format!(
                "util.global private mutable {counters} = dense<0> : tensor<1xi32>"
            ))
            .count(),
        1
    );
    let (layers, capacity) = (cfg.num_layers(), cfg.context_capacity);
    let ring = g.manifest.ring;
    assert_eq!(SPIRV_SPLIT_ROWS, 16);
    // The split's operands, its parts, then the two buffers in place.
    let split = |rows: usize, buf: usize| {
        let kv = format!("tensor<{buf}x1x256xf32>");
        let operands = format!(
            "(i32, i32, i32, i32, i32, i32, i32, i32, tensor<1x5x256xf32>, tensor<1x1x256xf32>, \
             tensor<256xf32>, tensor<256xf32>, tensor<1x128xf32>, tensor<1x2x128xf32>, \
             tensor<{}xi32>, tensor<2xi32>, tensor<i32>, {kv}, {kv})",
            ring.rows
        );
        (
            operands,
            format!("tensor<{}x1x4x258xf32>", rows.div_ceil(16)),
        )
    };
    let merge = |rows: usize| {
        format!(
            "(i32, i32, i32, i32, tensor<{}x1x4x258xf32>) -> (tensor<1x4x256xf32>)",
            rows.div_ceil(16)
        )
    };
    let globals = global_layers(&cfg);
    let mut steps_seen = 0;
    for e in &g.manifest.entry_points {
        let body = function_of(&g.mlir, &e.name);
        let externs = body.matches("hal.dispatch.extern").count();
        let (h, ffn) = (cfg.hidden_size, cfg.intermediate_size);
        let qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim;
        let heads = cfg.num_attention_heads * cfg.head_dim;
        let iree_products = body
            .lines()
            .filter(|l| l.contains("stablehlo.dot_general"))
            .filter(|l| {
                [[qkv, h], [2 * ffn, h], [h, heads], [h, ffn]]
                    .iter()
                    .any(|[n, k]| l.contains(&format!("tensor<{n}x{k}xf32>")))
            })
            .count();
        assert_eq!(iree_products, 0, "{}: IREE's products", e.name);
        let vocab = cfg.vocab_size;
        let (table, groups) = (format!("tensor<{vocab}x{h}xf32>"), vocab.div_ceil(8));
        let head = format!("(i32, i32, tensor<1x{h}xf32>, {table}, tensor<1xi32>)");
        let logits = format!(
            "tensor<{vocab}xf32>, tensor<{groups}xf32>, tensor<{groups}xi32>, tensor<1xi32>"
        );
        let heads_run = in_place_externs(body, &head, &logits, 1);
        assert_eq!(heads_run, e.steps, "{}: the head", e.name);
        assert_eq!(body.matches(r#"path = "test_head.spv""#).count(), heads_run);
        let table_products = body
            .lines()
            .filter(|l| l.contains("stablehlo.dot_general") && l.contains(&table))
            .count();
        assert_eq!(table_products, 0, "{}: IREE's head", e.name);
        if e.chunk > 1 {
            // Each layer's four products in `matmul`, its two residuals with their norms in
            // `add_norm_rows`, the embedding rows' norm and the head; IREE's code the rest.
            let c = e.chunk;
            let rows = format!("tensor<{c}x{h}xf32>");
            let norm = format!("tensor<{h}xf32>");
            let residuals =
                format!("(i32, i32, {rows}, {rows}, {norm}, {norm}) -> ({rows}, {rows})\n");
            assert_eq!(
                body.matches(&residuals).count(),
                2 * layers,
                "{}: residuals",
                e.name
            );
            let embed_norm = format!("(i32, i32, i32, {rows}, {norm}) -> ({rows}, {rows})\n");
            assert_eq!(
                body.matches(&embed_norm).count(),
                1,
                "{}: embed_norm",
                e.name
            );
            let row_norms = body
                .lines()
                .filter(|l| l.contains(&format!("{{dimensions = [1]}} : ({rows}, tensor<f32>)")))
                .count();
            assert_eq!(row_norms, 0, "{}: IREE's norms of the rows", e.name);
            for (n, k) in [(qkv, h), (h, heads), (2 * ffn, h), (h, ffn)] {
                let product = format!(
                    "(i32, i32, i32, tensor<{c}x{k}xf32>, tensor<{n}x{k}xf32>) -> (tensor<{c}x{n}xf32>)\n"
                );
                assert_eq!(
                    body.matches(&product).count(),
                    layers,
                    "{}: {n}x{k}",
                    e.name
                );
            }
            assert_eq!(
                body.matches(r#"path = "test_matmul.spv""#).count(),
                4 * layers
            );
            let (kvh, g, hd) = (cfg.num_key_value_heads, cfg.group_size(), cfg.head_dim);
            let attention =
                format!("(i32, i32, i32, i32, i32, i32, i32, tensor<{c}x{kvh}x{g}x{hd}xf32>, ");
            let out = format!("-> (tensor<{kvh}x{c}x{g}x{hd}xf32>)\n");
            let attends = body
                .lines()
                .filter(|l| l.contains(&attention) && l.ends_with(&out[..out.len() - 1]))
                .count();
            assert_eq!(attends, layers, "{}: attention", e.name);
            assert_eq!(
                body.matches(r#"path = "test_attend_rows.spv""#).count(),
                layers
            );
            assert_eq!(externs, 7 * layers + 2, "{}", e.name);
            continue;
        }
        steps_seen += e.steps;
        let span = (e.span < capacity).then_some(e.span);
        let sliding = ring.rows_seen(1, span);
        let global = e.span;
        assert_eq!(externs, (6 * layers + 2) * e.steps, "{}", e.name);
        for (rows, what) in [(qkv, "q/k/v"), (2 * ffn, "gate/up")] {
            let product = format!(
                "(i32, i32, tensor<1x{h}xf32>, tensor<{rows}x{h}xf32>) -> (tensor<1x{rows}xf32>)\n"
            );
            assert_eq!(
                body.matches(&product).count(),
                layers * e.steps,
                "{}: {what}",
                e.name
            );
        }
        assert_eq!(
            body.matches(r#"path = "test_matvec.spv""#).count(),
            2 * layers * e.steps
        );
        let hidden = format!("tensor<1x{h}xf32>");
        let norm = format!("tensor<{h}xf32>");
        let results = format!("{hidden}, {hidden}, {hidden}");
        let output = format!(
            "(i32, i32, i32, tensor<1x{heads}xf32>, tensor<{h}x{heads}xf32>, {hidden}, {norm}, \
             {norm}, tensor<1xi32>)"
        );
        let projections = in_place_externs(body, &output, &results, 1);
        assert_eq!(projections, layers * e.steps, "{}: o and norms", e.name);
        assert_eq!(
            body.matches(r#"path = "test_matvec_norm.spv""#).count(),
            projections
        );
        let (gate_up, down) = (
            format!("tensor<1x{}xf32>", 2 * ffn),
            format!("tensor<{h}x{ffn}xf32>"),
        );
        let geglu = format!("(i32, i32, {gate_up}, {down}) -> ({hidden})\n");
        assert!(!body.contains(&geglu), "{}: GeGLU without its norm", e.name);
        let with_norm =
            format!("(i32, i32, i32, {gate_up}, {down}, {hidden}, {norm}, {norm}, tensor<1xi32>)");
        let fused = in_place_externs(body, &with_norm, &results, 1);
        assert_eq!(fused, layers * e.steps, "{}: GeGLU, down and norms", e.name);
        assert_eq!(
            body.matches(r#"path = "test_geglu_down_norm.spv""#).count(),
            fused
        );
        let loads = body
            .matches(&format!("util.global.load {counters} :"))
            .count();
        let stores = body
            .matches(&format!(", {counters} : tensor<1xi32>"))
            .count();
        let embed_norm = format!("(i32, i32, i32, {hidden}, {norm}) -> ({hidden}, {hidden})\n");
        assert_eq!(
            body.matches(&embed_norm).count(),
            e.steps,
            "{}: embed_norm",
            e.name
        );
        assert_eq!(
            body.matches(r#"path = "test_embed_norm.spv""#).count(),
            e.steps
        );
        let counted = projections + fused + heads_run;
        assert_eq!(
            (loads, stores),
            (counted, counted),
            "{}: the counters",
            e.name
        );
        for (rows, buf, n) in [
            (sliding, ring.rows, layers - globals),
            (global, capacity, globals),
        ] {
            let (operands, parts) = split(rows, buf);
            let calls = in_place_externs(body, &operands, &parts, 2);
            assert_eq!(calls, n * e.steps, "{}: splits of {rows} rows", e.name);
        }
        let mut merges = body.matches(&merge(sliding)).count();
        if global.div_ceil(16) != sliding.div_ceil(16) {
            merges += body.matches(&merge(global)).count();
        }
        assert_eq!(merges, layers * e.steps, "{}: merges", e.name);
        assert_eq!(
            body.matches(r#"path = "test_split.spv""#).count(),
            layers * e.steps
        );
        for rows in [ring.modulus, ring.rows, sliding, global] {
            assert!(!attends_over(body, (1, 1, 4), rows), "{}: scores", e.name);
        }
        let scatters = body.matches(r#""stablehlo.scatter"("#).count();
        assert_eq!(
            scatters, e.steps,
            "{}: the positions' scatters only",
            e.name
        );
        assert!(
            !body.contains("stablehlo.reverse"),
            "{}: heads rotated",
            e.name
        );
    }
    assert!(steps_seen > 16, "one-step and multi-step entry points");

    // For a named GPU the chunks' products and attention are IREE's code, their norms and
    // head still the kernels'; the steps are the same.
    let named = graphs::build(
        &cfg,
        &[1, 8, 64],
        GraphOptions {
            spirv_chunks: false,
            ..opts
        },
    );
    for e in &named.manifest.entry_points {
        let body = function_of(&named.mlir, &e.name);
        let externs = body.matches("hal.dispatch.extern").count();
        let expected = match e.chunk {
            1 => (6 * layers + 2) * e.steps,
            _ => 2 * layers + 2,
        };
        assert_eq!(externs, expected, "{}: named GPU", e.name);
        for kernel in ["test_matmul.spv", "test_attend_rows.spv"] {
            assert!(!body.contains(kernel), "{}: {kernel}", e.name);
        }
    }
}

/// How many `hal.dispatch.extern` calls in `body` have the operand types `operands` and
/// return `result`, then their last `tied` operands in place (`-> (result, %a, %b)`, `%a`
/// and `%b` the operands).
fn in_place_externs(body: &str, operands: &str, result: &str, tied: usize) -> usize {
    let calls = body
        .lines()
        .filter_map(|l| l.split_once(" = hal.dispatch.extern "));
    calls
        .filter(|(_, call)| {
            let Some((args, signature)) = call.split_once(") : ") else {
                return false;
            };
            let Some((_, args)) = args.split_once("](") else {
                return false;
            };
            let args: Vec<&str> = args.split(", ").collect();
            let last = args[args.len().saturating_sub(tied)..].join(", ");
            signature == format!("{operands} -> ({result}, {last})")
        })
        .count()
}

#[test]
fn vulkan_command_buffers_are_recorded_once() {
    // With the rows written and read at indices computed on the device no command buffer
    // captures a value of the call, so IREE records each entry point's once and replays it
    // with each call's buffers (`hal.device.queue.execute.indirect`); with the rows at
    // offsets from the host scalars every call records its own, one dispatch at a time.
    let cfg = config(Preset::Tiny);
    for device_rows in [true, false] {
        let opts = GraphOptions {
            device_rows,
            ..GraphOptions::vulkan()
        };
        let g = graphs::build(&cfg, &[1, 8], opts);
        let target = Target::VulkanSpirv;
        let Some(hal) = run_compiler(target, &g.mlir, &g.objects, "hal", &["--compile-to=hal"])
        else {
            return;
        };
        let hal = String::from_utf8(hal).unwrap();
        let entries = g.manifest.entry_points.len();
        let one_shot = hal.matches("mode(OneShot)").count();
        let replayed = hal.matches("hal.device.queue.execute.indirect").count();
        let expected = if device_rows {
            (0, entries)
        } else {
            (entries, 0)
        };
        assert_eq!((one_shot, replayed), expected, "device_rows {device_rows}");
    }
}

/// The llvm-cpu module's tuning spec covers every `P . V` product its chunks run (the sliding
/// ring, or its modulus in a decode step, each live span of the global layers, each span entry
/// point's span) in workgroups of whole row tiles.
#[test]
fn the_tuning_spec_tiles_each_attention_product_in_whole_row_tiles() {
    let cfg = real_config();
    let g = graphs::build(&cfg, &DEFAULT_CHUNKS, GraphOptions::llvm_cpu());
    let spec = g
        .tuning_spec
        .expect("llvm-cpu graphs come with a tuning spec");
    let (hd, heads) = (cfg.head_dim, cfg.num_attention_heads);
    let ring = g.manifest.ring.rows;
    // The matcher of `P [m, rows]`, up to its yield.
    let matcher = |m: usize, rows: usize| {
        let p = format!("%p = tensor<{m}x{rows}xf32>");
        let at = spec
            .find(&p)
            .unwrap_or_else(|| panic!("no matcher for P [{m}, {rows}]"));
        &spec[at..at + spec[at..].find("transform.yield").unwrap()]
    };
    for &c in DEFAULT_CHUNKS.iter().filter(|&&c| c > 1) {
        let m = c * heads;
        for rows in [ring, 512, 1024, 2048, cfg.context_capacity] {
            let matcher = matcher(m, rows);
            let tile: usize = matcher
                .split("distribution = [")
                .nth(1)
                .and_then(|rest| rest.split(',').next())
                .and_then(|t| t.parse().ok())
                .unwrap_or_else(|| panic!("chunk {c}: no distribution in {matcher}"));
            // A partial workgroup tile ran as scalar code: 24-row chunks' products 2.6x slower.
            assert!(
                m.is_multiple_of(tile) && tile.is_multiple_of(8),
                "chunk {c}: {tile} rows a workgroup over P [{m}, {rows}]"
            );
        }
    }
    assert!(spec.contains(&format!("%v = tensor<{ring}x{hd}xf32>")));
    // The decode step's entry points: `heads` rows over the ring's modulus and each global
    // span, one `heads` x 64 tile a workgroup.
    let modulus = g.manifest.ring.modulus;
    for rows in [modulus, 512, 1024, 2048, cfg.context_capacity] {
        let matcher = matcher(heads, rows);
        let tile =
            format!("distribution = [{heads}, 64, 0], vector_common_parallel = [{heads}, 64, 0]");
        assert!(matcher.contains(&tile), "{matcher}");
    }
}

/// Every layer norms and rotates its query and key heads together, as one `[C, heads + kvh,
/// 2, hd / 2]` tensor with one reverse (RoPE's halves swapped), on both targets in IREE's
/// code: two dispatches a layer on Vulkan where the queries and keys apart took six. (With
/// the SPIR-V kernels the decode step's attention kernel norms and rotates them:
/// `vulkan_decode_steps_run_the_spirv_kernels`.)
#[test]
fn query_and_key_heads_are_normed_and_rotated_together() {
    let cfg = real_config();
    let heads = cfg.num_attention_heads + cfg.num_key_value_heads;
    let half = cfg.head_dim / 2;
    let llvm_cpu = GraphOptions {
        own_kernels: None,
        ..GraphOptions::llvm_cpu()
    };
    let vulkan = GraphOptions {
        spirv_kernels: None,
        ..GraphOptions::vulkan()
    };
    for opts in [vulkan, llvm_cpu] {
        let g = graphs::build(&cfg, &[1, 8], opts);
        for c in [1, 8] {
            let f = function_of(&g.mlir, &entry_name(opts.input, c));
            let joint = format!("tensor<{c}x{heads}x2x{half}xf32>");
            assert!(f.contains(&joint), "c{c}: no {joint}");
            assert_eq!(
                f.matches("\"stablehlo.reverse\"").count(),
                cfg.num_layers(),
                "c{c}: one reverse a layer"
            );
        }
    }
}
