//! `FuncBuilder`: one `func.func` of typed StableHLO ops, in MLIR's generic op syntax.
//!
//! Every op is printed in the generic form `%3 = "stablehlo.add"(%1, %2) : (T, T) -> T`, the
//! form the StableHLO spec's examples use and every parser accepts, so no pretty-printer quirks
//! of a particular StableHLO version matter.
//!
//! # Panics
//! Each op checks its operand shapes and panics with the op name and the offending shapes when
//! they do not fit: graphs are built from a validated `ModelConfig`, so a mismatch is a bug in
//! the graph code, found by the first test that builds it.

use std::fmt::Write;

use super::types::{ElemType, Scalar, TensorType, Value};

/// Comparison direction of `stablehlo.compare`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    /// `EQ`
    Eq,
    /// `NE`
    Ne,
    /// `LT`
    Lt,
    /// `LE`
    Le,
    /// `GT`
    Gt,
    /// `GE`
    Ge,
}

impl Cmp {
    /// The `arith.cmpi` predicate (signed): `eq` 0, `ne` 1, `slt` 2, `sle` 3, `sgt` 4, `sge` 5.
    fn arith_predicate(self) -> u32 {
        match self {
            Cmp::Eq => 0,
            Cmp::Ne => 1,
            Cmp::Lt => 2,
            Cmp::Le => 3,
            Cmp::Gt => 4,
            Cmp::Ge => 5,
        }
    }

    fn mlir(self) -> &'static str {
        match self {
            Cmp::Eq => "EQ",
            Cmp::Ne => "NE",
            Cmp::Lt => "LT",
            Cmp::Le => "LE",
            Cmp::Gt => "GT",
            Cmp::Ge => "GE",
        }
    }
}

/// The combiner of a single-operand `stablehlo.reduce`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// `stablehlo.add`, initial value 0.
    Sum,
    /// `stablehlo.maximum`, initial value -inf (f32) or `i32::MIN`.
    Max,
    /// `stablehlo.minimum`, initial value +inf (f32) or `i32::MAX`.
    Min,
}

/// Dimension numbers of `stablehlo.dot_general`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DotDims {
    /// Batch dims of the left operand (paired in order with `rhs_batch`).
    pub lhs_batch: Vec<usize>,
    /// Batch dims of the right operand.
    pub rhs_batch: Vec<usize>,
    /// Contracting dims of the left operand (paired in order with `rhs_contract`).
    pub lhs_contract: Vec<usize>,
    /// Contracting dims of the right operand.
    pub rhs_contract: Vec<usize>,
}

impl DotDims {
    /// A plain contraction of `lhs[lc]` with `rhs[rc]`, no batch dims.
    pub fn contract(lc: usize, rc: usize) -> Self {
        DotDims {
            lhs_contract: vec![lc],
            rhs_contract: vec![rc],
            ..Default::default()
        }
    }

    /// One batch dim (`lb`, `rb`) and one contracting dim (`lc`, `rc`).
    pub fn batched(lb: usize, rb: usize, lc: usize, rc: usize) -> Self {
        DotDims {
            lhs_batch: vec![lb],
            rhs_batch: vec![rb],
            lhs_contract: vec![lc],
            rhs_contract: vec![rc],
        }
    }
}

/// The ops and results of one branch of a [`FuncBuilder::if_else`], built between
/// [`FuncBuilder::open_region`] and [`FuncBuilder::close_region`].
#[derive(Debug)]
pub struct Region {
    body: String,
    results: Vec<Value>,
}

/// Where [`FuncBuilder::open_region`] left the enclosing body; give it back to
/// [`FuncBuilder::close_region`].
#[derive(Debug)]
#[must_use = "close the region with close_region"]
pub struct OpenRegion {
    outer: String,
}

/// Builds one `func.func` from typed ops; [`FuncBuilder::finish`] returns its text.
#[derive(Debug)]
pub struct FuncBuilder {
    name: String,
    /// `%id: type` of each argument, in order.
    args: Vec<String>,
    body: String,
    next_id: usize,
}

fn list(xs: &[usize]) -> String {
    xs.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `array<i64: 1, 2>`, or `array<i64>` when empty.
fn i64_array(xs: &[usize]) -> String {
    if xs.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", list(xs))
    }
}

fn operands(xs: &[&Value]) -> String {
    xs.iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn types(xs: &[&Value]) -> String {
    xs.iter()
        .map(|v| v.ty.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `f32` bits in MLIR's hexadecimal float syntax: exact, whatever the value.
fn f32_hex(x: f32) -> String {
    format!("0x{:08X}", x.to_bits())
}

impl FuncBuilder {
    /// An empty function `@name`; add its arguments with [`FuncBuilder::arg`].
    pub fn new(name: &str) -> Self {
        FuncBuilder {
            name: name.to_string(),
            args: Vec::new(),
            body: String::new(),
            next_id: 0,
        }
    }

    /// The function's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn fresh(&mut self, ty: TensorType) -> Value {
        let v = Value {
            id: self.next_id,
            ty,
        };
        self.next_id += 1;
        v
    }

    fn fresh_scalar(&mut self, elem: ElemType) -> Scalar {
        let s = Scalar {
            id: self.next_id,
            elem,
        };
        self.next_id += 1;
        s
    }

    /// A fresh SSA name for a scalar inside a region (`%12`).
    fn fresh_name(&mut self) -> String {
        let name = format!("%{}", self.next_id);
        self.next_id += 1;
        name
    }

    /// Appends a function argument of type `ty`.
    pub fn arg(&mut self, ty: TensorType) -> Value {
        let v = self.fresh(ty);
        self.args.push(format!("{v}: {}", v.ty));
        v
    }

    /// Appends a function argument of type `ty` that is the storage of result `result`
    /// (`iree.abi.output`): the caller passes the buffer the result is written to, and the
    /// function returns it. The body does not read it.
    pub fn output_arg(&mut self, ty: TensorType, result: usize) -> Value {
        let v = self.fresh(ty);
        self.args.push(format!(
            "{v}: {} {{iree.abi.output = {result} : index}}",
            v.ty
        ));
        v
    }

    /// Appends an `i32` function argument passed by value, a host scalar.
    pub fn scalar_arg(&mut self) -> Scalar {
        let s = self.fresh_scalar(ElemType::I32);
        self.args.push(format!("{s}: i32"));
        s
    }

    /// The text of the function returning `results`.
    pub fn finish(self, results: &[&Value]) -> String {
        let args = self.args.join(", ");
        format!(
            "  func.func @{}({args}) -> ({}) {{\n{}    \"func.return\"({}) : ({}) -> ()\n  }}\n",
            self.name,
            types(results),
            self.body,
            operands(results),
            types(results),
        )
    }

    /// Appends `%r = "stablehlo.{op}"(operands) {attrs} : (types) -> result`.
    fn op(&mut self, op: &str, args: &[&Value], attrs: &str, result: TensorType) -> Value {
        let r = self.fresh(result);
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(" {{{attrs}}}")
        };
        writeln!(
            self.body,
            "    {r} = \"stablehlo.{op}\"({}){attrs} : ({}) -> {}",
            operands(args),
            types(args),
            r.ty
        )
        .expect("writing to a String");
        r
    }

    // ---- constants and index tensors -------------------------------------------------------

    /// Emits `stablehlo.constant`: `value` splatted to an f32 tensor of `dims`.
    pub fn const_f32(&mut self, value: f32, dims: &[usize]) -> Value {
        let ty = TensorType::f32(dims);
        self.op(
            "constant",
            &[],
            &format!("value = dense<{}> : {ty}", f32_hex(value)),
            ty,
        )
    }

    /// Emits `stablehlo.constant`: `value` splatted to an i32 tensor of `dims`.
    pub fn const_i32(&mut self, value: i32, dims: &[usize]) -> Value {
        let ty = TensorType::i32(dims);
        self.op(
            "constant",
            &[],
            &format!("value = dense<{value}> : {ty}"),
            ty,
        )
    }

    /// Emits `stablehlo.constant`: a rank-1 f32 tensor holding `values` exactly.
    pub fn const_f32_vec(&mut self, values: &[f32]) -> Value {
        let ty = TensorType::f32(&[values.len()]);
        let elems = values
            .iter()
            .map(|&x| f32_hex(x))
            .collect::<Vec<_>>()
            .join(", ");
        self.op(
            "constant",
            &[],
            &format!("value = dense<[{elems}]> : {ty}"),
            ty,
        )
    }

    /// Emits `stablehlo.iota`: an i32 tensor of `dims` counting along `dim`.
    pub fn iota(&mut self, dims: &[usize], dim: usize) -> Value {
        assert!(
            dim < dims.len(),
            "iota: dim {dim} out of range for {dims:?}"
        );
        self.op(
            "iota",
            &[],
            &format!("iota_dimension = {dim} : i64"),
            TensorType::i32(dims),
        )
    }

    // ---- host scalars -----------------------------------------------------------------------

    /// Appends `%r = "arith.{op}"(operands) {attrs} : (types) -> elem` on host scalars.
    fn arith(&mut self, op: &str, args: &[&Scalar], attrs: &str, elem: ElemType) -> Scalar {
        let r = self.fresh_scalar(elem);
        let names = args
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let tys = args
            .iter()
            .map(|a| a.elem.mlir())
            .collect::<Vec<_>>()
            .join(", ");
        writeln!(
            self.body,
            "    {r} = \"arith.{op}\"({names}){attrs} : ({tys}) -> {}",
            elem.mlir()
        )
        .expect("writing to a String");
        r
    }

    /// [`FuncBuilder::arith`] of two i32 host scalars, checked.
    fn arith_i32(
        &mut self,
        op: &str,
        (a, b): (&Scalar, &Scalar),
        attrs: &str,
        elem: ElemType,
    ) -> Scalar {
        assert!(
            a.elem == ElemType::I32 && b.elem == ElemType::I32,
            "arith.{op}: operands must be i32 scalars"
        );
        self.arith(op, &[a, b], attrs, elem)
    }

    /// Emits `arith.constant`: an i32 host scalar.
    pub fn scalar_i32(&mut self, value: i32) -> Scalar {
        self.arith(
            "constant",
            &[],
            &format!(" {{value = {value} : i32}}"),
            ElemType::I32,
        )
    }

    /// Emits `arith.addi` of two i32 host scalars.
    pub fn scalar_add(&mut self, a: &Scalar, b: &Scalar) -> Scalar {
        self.arith_i32("addi", (a, b), "", ElemType::I32)
    }

    /// Emits `arith.subi` of two i32 host scalars.
    pub fn scalar_sub(&mut self, a: &Scalar, b: &Scalar) -> Scalar {
        self.arith_i32("subi", (a, b), "", ElemType::I32)
    }

    /// Emits `arith.remsi`: the signed remainder of two i32 host scalars (the sign of `a`).
    pub fn scalar_rem(&mut self, a: &Scalar, b: &Scalar) -> Scalar {
        self.arith_i32("remsi", (a, b), "", ElemType::I32)
    }

    /// Emits `arith.cmpi` (signed): an i1 host scalar.
    pub fn scalar_compare(&mut self, dir: Cmp, a: &Scalar, b: &Scalar) -> Scalar {
        let attrs = format!(" {{predicate = {} : i64}}", dir.arith_predicate());
        self.arith_i32("cmpi", (a, b), &attrs, ElemType::I1)
    }

    /// Emits `tensor.from_elements`: the host scalar `s` as a rank-0 tensor of its type. Where
    /// the tensor is an index of a dynamic slice or a branch's predicate, IREE folds it back to
    /// the scalar; elsewhere the scalar reaches the dispatch as a constant.
    pub fn tensor_of(&mut self, s: &Scalar) -> Value {
        let r = self.fresh(TensorType::new(&[], s.elem));
        writeln!(
            self.body,
            "    {r} = \"tensor.from_elements\"({s}) : ({}) -> {}",
            s.elem.mlir(),
            r.ty
        )
        .expect("writing to a String");
        r
    }

    // ---- shape ops --------------------------------------------------------------------------

    /// Emits `stablehlo.broadcast_in_dim`: operand dim `i` becomes result dim `mapping[i]`.
    pub fn broadcast_in_dim(&mut self, x: &Value, dims: &[usize], mapping: &[usize]) -> Value {
        assert_eq!(
            mapping.len(),
            x.ty.rank(),
            "broadcast_in_dim: mapping {mapping:?} for operand {}",
            x.ty
        );
        for (i, &m) in mapping.iter().enumerate() {
            assert!(
                m < dims.len() && (x.dims()[i] == dims[m] || x.dims()[i] == 1),
                "broadcast_in_dim: operand {} dim {i} cannot go to dim {m} of {dims:?}",
                x.ty
            );
            assert!(
                i == 0 || mapping[i - 1] < m,
                "broadcast_in_dim: mapping {mapping:?} must be increasing"
            );
        }
        self.op(
            "broadcast_in_dim",
            &[x],
            &format!("broadcast_dimensions = {}", i64_array(mapping)),
            x.ty.elem_dims(dims),
        )
    }

    /// Emits `stablehlo.broadcast_in_dim` of a scalar (rank-0) value to `dims`.
    pub fn splat(&mut self, x: &Value, dims: &[usize]) -> Value {
        assert_eq!(x.ty.rank(), 0, "splat: operand {} is not a scalar", x.ty);
        self.broadcast_in_dim(x, dims, &[])
    }

    /// Emits `stablehlo.reshape` to `dims` (same element count).
    pub fn reshape(&mut self, x: &Value, dims: &[usize]) -> Value {
        let to = x.ty.elem_dims(dims);
        assert_eq!(
            x.ty.elements(),
            to.elements(),
            "reshape: {} -> {to} changes the element count",
            x.ty
        );
        self.op("reshape", &[x], "", to)
    }

    /// Emits `stablehlo.transpose`: result dim `i` is operand dim `perm[i]`.
    pub fn transpose(&mut self, x: &Value, perm: &[usize]) -> Value {
        let mut seen = vec![false; x.ty.rank()];
        assert_eq!(perm.len(), x.ty.rank(), "transpose: {perm:?} for {}", x.ty);
        for &p in perm {
            assert!(
                p < seen.len() && !seen[p],
                "transpose: {perm:?} is not a permutation"
            );
            seen[p] = true;
        }
        let dims: Vec<usize> = perm.iter().map(|&p| x.dims()[p]).collect();
        self.op(
            "transpose",
            &[x],
            &format!("permutation = {}", i64_array(perm)),
            x.ty.elem_dims(&dims),
        )
    }

    /// Emits `stablehlo.reverse` of `x` along `dims`.
    pub fn reverse(&mut self, x: &Value, dims: &[usize]) -> Value {
        assert!(
            dims.iter().all(|&d| d < x.ty.rank()),
            "reverse: dims {dims:?} for {}",
            x.ty
        );
        self.op(
            "reverse",
            &[x],
            &format!("dimensions = {}", i64_array(dims)),
            x.ty.clone(),
        )
    }

    /// Emits `stablehlo.convert` to element type `elem`.
    pub fn convert(&mut self, x: &Value, elem: ElemType) -> Value {
        self.op("convert", &[x], "", x.ty.with_elem(elem))
    }

    /// Emits `stablehlo.slice` of `[start, limit)` with unit strides.
    pub fn slice(&mut self, x: &Value, start: &[usize], limit: &[usize]) -> Value {
        assert!(
            start.len() == x.ty.rank() && limit.len() == x.ty.rank(),
            "slice: {start:?}..{limit:?} for {}",
            x.ty
        );
        let dims: Vec<usize> = (0..x.ty.rank())
            .map(|i| {
                assert!(
                    start[i] <= limit[i] && limit[i] <= x.dims()[i],
                    "slice: {start:?}..{limit:?} out of {}",
                    x.ty
                );
                limit[i] - start[i]
            })
            .collect();
        self.op(
            "slice",
            &[x],
            &format!(
                "start_indices = {}, limit_indices = {}, strides = {}",
                i64_array(start),
                i64_array(limit),
                i64_array(&vec![1; start.len()])
            ),
            x.ty.elem_dims(&dims),
        )
    }

    /// Emits `stablehlo.concatenate` of `xs` along `dim`.
    pub fn concatenate(&mut self, xs: &[&Value], dim: usize) -> Value {
        assert!(!xs.is_empty(), "concatenate: no operands");
        let first = &xs[0].ty;
        assert!(dim < first.rank(), "concatenate: dim {dim} of {first}");
        let mut dims = first.dims.clone();
        dims[dim] = 0;
        for x in xs {
            let same = x.ty.rank() == first.rank()
                && x.ty.elem == first.elem
                && (0..first.rank()).all(|i| i == dim || x.dims()[i] == first.dims[i]);
            assert!(
                same,
                "concatenate: {} does not fit {first} on dim {dim}",
                x.ty
            );
            dims[dim] += x.dims()[dim];
        }
        self.op(
            "concatenate",
            xs,
            &format!("dimension = {dim} : i64"),
            first.elem_dims(&dims),
        )
    }

    // ---- element-wise ops ---------------------------------------------------------------

    fn binary(&mut self, op: &str, a: &Value, b: &Value) -> Value {
        assert_eq!(a.ty, b.ty, "{op}: operand types differ");
        self.op(op, &[a, b], "", a.ty.clone())
    }

    fn unary(&mut self, op: &str, x: &Value) -> Value {
        self.op(op, &[x], "", x.ty.clone())
    }

    /// Emits `stablehlo.add`.
    pub fn add(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("add", a, b)
    }

    /// Emits `stablehlo.subtract`.
    pub fn sub(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("subtract", a, b)
    }

    /// Emits `stablehlo.multiply`.
    pub fn mul(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("multiply", a, b)
    }

    /// Emits `stablehlo.divide`.
    pub fn div(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("divide", a, b)
    }

    /// Emits `stablehlo.maximum`.
    pub fn max(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("maximum", a, b)
    }

    /// Emits `stablehlo.minimum`.
    pub fn min(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("minimum", a, b)
    }

    /// Emits `stablehlo.remainder` (truncated: the sign follows `a`).
    pub fn remainder(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("remainder", a, b)
    }

    /// Emits `stablehlo.and` (logical on i1, bitwise on integers).
    pub fn and(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("and", a, b)
    }

    /// Emits `stablehlo.or` (logical on i1, bitwise on integers).
    pub fn or(&mut self, a: &Value, b: &Value) -> Value {
        self.binary("or", a, b)
    }

    /// Emits `stablehlo.negate`.
    pub fn neg(&mut self, x: &Value) -> Value {
        self.unary("negate", x)
    }

    /// Emits `stablehlo.exponential`.
    pub fn exp(&mut self, x: &Value) -> Value {
        self.unary("exponential", x)
    }

    /// Emits `stablehlo.log`.
    pub fn log(&mut self, x: &Value) -> Value {
        self.unary("log", x)
    }

    /// Emits `stablehlo.tanh`.
    pub fn tanh(&mut self, x: &Value) -> Value {
        self.unary("tanh", x)
    }

    /// Emits `stablehlo.rsqrt`.
    pub fn rsqrt(&mut self, x: &Value) -> Value {
        self.unary("rsqrt", x)
    }

    /// Emits `stablehlo.sqrt`.
    pub fn sqrt(&mut self, x: &Value) -> Value {
        self.unary("sqrt", x)
    }

    /// Emits `stablehlo.cosine`.
    pub fn cos(&mut self, x: &Value) -> Value {
        self.unary("cosine", x)
    }

    /// Emits `stablehlo.sine`.
    pub fn sin(&mut self, x: &Value) -> Value {
        self.unary("sine", x)
    }

    /// Emits `stablehlo.round_nearest_even`.
    pub fn round_nearest_even(&mut self, x: &Value) -> Value {
        self.unary("round_nearest_even", x)
    }

    /// Emits `stablehlo.compare` with direction `dir` (signed for integers, the default).
    pub fn compare(&mut self, dir: Cmp, a: &Value, b: &Value) -> Value {
        assert_eq!(a.ty, b.ty, "compare: operand types differ");
        self.op(
            "compare",
            &[a, b],
            &format!(
                "comparison_direction = #stablehlo<comparison_direction {}>",
                dir.mlir()
            ),
            a.ty.with_elem(ElemType::I1),
        )
    }

    /// Emits `stablehlo.select`: `pred ? on_true : on_false`, element-wise.
    pub fn select(&mut self, pred: &Value, on_true: &Value, on_false: &Value) -> Value {
        assert_eq!(on_true.ty, on_false.ty, "select: branch types differ");
        assert!(
            pred.ty == on_true.ty.with_elem(ElemType::I1),
            "select: predicate {} for {}",
            pred.ty,
            on_true.ty
        );
        self.op("select", &[pred, on_true, on_false], "", on_true.ty.clone())
    }

    /// Emits `stablehlo.clamp`: `min(max(x, lo), hi)` with scalar or same-shaped bounds.
    pub fn clamp(&mut self, lo: &Value, x: &Value, hi: &Value) -> Value {
        for b in [lo, hi] {
            assert!(
                b.ty == x.ty || b.ty == x.ty.elem_dims(&[]),
                "clamp: bound {} for {}",
                b.ty,
                x.ty
            );
        }
        self.op("clamp", &[lo, x, hi], "", x.ty.clone())
    }

    // ---- reductions and contractions ----------------------------------------------------

    /// Emits `stablehlo.reduce` of `x` over `dims` with `kind`'s combiner.
    pub fn reduce(&mut self, x: &Value, kind: Reduction, dims: &[usize]) -> Value {
        let scalar = x.ty.elem_dims(&[]);
        let init = match (kind, x.elem()) {
            (Reduction::Sum, ElemType::F32) => self.const_f32(0.0, &[]),
            (Reduction::Max, ElemType::F32) => self.const_f32(f32::NEG_INFINITY, &[]),
            (Reduction::Sum, ElemType::I32) => self.const_i32(0, &[]),
            (Reduction::Max, ElemType::I32) => self.const_i32(i32::MIN, &[]),
            (Reduction::Min, ElemType::F32) => self.const_f32(f32::INFINITY, &[]),
            (Reduction::Min, ElemType::I32) => self.const_i32(i32::MAX, &[]),
            (_, ElemType::I1 | ElemType::I8) => {
                panic!("reduce: {} operands are not supported", x.ty)
            }
        };
        let out = x.ty.elem_dims(&self.reduced_dims(x, dims));
        let r = self.fresh(out);
        let (lhs, rhs) = (self.fresh(scalar.clone()), self.fresh(scalar.clone()));
        let combined = self.fresh(scalar.clone());
        let combiner = match kind {
            Reduction::Sum => "add",
            Reduction::Max => "maximum",
            Reduction::Min => "minimum",
        };
        writeln!(
            self.body,
            "    {r} = \"stablehlo.reduce\"({x}, {init}) ({{\n    ^bb0({lhs}: {scalar}, {rhs}: {scalar}):\n      {combined} = \"stablehlo.{combiner}\"({lhs}, {rhs}) : ({scalar}, {scalar}) -> {scalar}\n      \"stablehlo.return\"({combined}) : ({scalar}) -> ()\n    }}) {{dimensions = {}}} : ({}, {scalar}) -> {}",
            i64_array(dims),
            x.ty,
            r.ty
        )
        .expect("writing to a String");
        r
    }

    /// Emits `stablehlo.reduce_window` summing each element with all before it: the inclusive
    /// prefix sum of a vector (IREE lowers it to one `iree_linalg_ext.scan`).
    ///
    /// # Shapes
    /// `x`: `[n]` i32 or f32; returns `[n]`.
    pub fn cumsum(&mut self, x: &Value) -> Value {
        assert!(
            x.ty.rank() == 1 && matches!(x.elem(), ElemType::I32 | ElemType::F32),
            "cumsum: operand {} must be a vector of i32 or f32",
            x.ty
        );
        let n = x.dims()[0];
        let scalar = x.ty.elem_dims(&[]);
        let init = match x.elem() {
            ElemType::F32 => self.const_f32(0.0, &[]),
            _ => self.const_i32(0, &[]),
        };
        let r = self.fresh(x.ty.clone());
        let (lhs, rhs) = (self.fresh(scalar.clone()), self.fresh(scalar.clone()));
        let combined = self.fresh(scalar.clone());
        writeln!(
            self.body,
            "    {r} = \"stablehlo.reduce_window\"({x}, {init}) ({{\n    ^bb0({lhs}: {scalar}, {rhs}: {scalar}):\n      {combined} = \"stablehlo.add\"({lhs}, {rhs}) : ({scalar}, {scalar}) -> {scalar}\n      \"stablehlo.return\"({combined}) : ({scalar}) -> ()\n    }}) {{window_dimensions = {}, padding = dense<[[{}, 0]]> : tensor<1x2xi64>}} : ({}, {scalar}) -> {}",
            i64_array(&[n]),
            n - 1,
            x.ty,
            r.ty
        )
        .expect("writing to a String");
        r
    }

    fn reduced_dims(&self, x: &Value, dims: &[usize]) -> Vec<usize> {
        for (i, &d) in dims.iter().enumerate() {
            assert!(
                d < x.ty.rank() && (i == 0 || dims[i - 1] < d),
                "reduce: dims {dims:?} for {}",
                x.ty
            );
        }
        (0..x.ty.rank())
            .filter(|d| !dims.contains(d))
            .map(|d| x.dims()[d])
            .collect()
    }

    /// Emits a two-operand `stablehlo.reduce` computing the (value, index) argmax of `values`
    /// along `dim`: the largest value wins and, between equal values, the lowest index.
    ///
    /// `indices` (i32, same dims) carries each element's index; NaN values must be mapped to
    /// `-inf` beforehand (a NaN never compares greater).
    pub fn argmax(&mut self, values: &Value, indices: &Value, dim: usize) -> (Value, Value) {
        assert_eq!(values.elem(), ElemType::F32, "argmax: values {}", values.ty);
        assert!(
            indices.ty == values.ty.with_elem(ElemType::I32),
            "argmax: indices {} for values {}",
            indices.ty,
            values.ty
        );
        let (fs, is) = (TensorType::f32(&[]), TensorType::i32(&[]));
        let init_v = self.const_f32(f32::NEG_INFINITY, &[]);
        let init_i = self.const_i32(0, &[]);
        let kept = self.reduced_dims(values, &[dim]);
        let rv = self.fresh(TensorType::f32(&kept));
        let ri = self.fresh(TensorType::i32(&kept));
        let [av, ai, bv, bi] = [
            self.fresh(fs.clone()),
            self.fresh(is.clone()),
            self.fresh(fs.clone()),
            self.fresh(is.clone()),
        ];
        let [gt, eq, lt, tie, pick, v, i] = [
            self.fresh(TensorType::i1(&[])),
            self.fresh(TensorType::i1(&[])),
            self.fresh(TensorType::i1(&[])),
            self.fresh(TensorType::i1(&[])),
            self.fresh(TensorType::i1(&[])),
            self.fresh(fs.clone()),
            self.fresh(is.clone()),
        ];
        let b = TensorType::i1(&[]);
        let cmp =
            |d: &str| format!("{{comparison_direction = #stablehlo<comparison_direction {d}>}}");
        writeln!(
            self.body,
            "    {rv}, {ri} = \"stablehlo.reduce\"({values}, {indices}, {init_v}, {init_i}) ({{\n    ^bb0({av}: {fs}, {ai}: {is}, {bv}: {fs}, {bi}: {is}):\n      {gt} = \"stablehlo.compare\"({av}, {bv}) {} : ({fs}, {fs}) -> {b}\n      {eq} = \"stablehlo.compare\"({av}, {bv}) {} : ({fs}, {fs}) -> {b}\n      {lt} = \"stablehlo.compare\"({ai}, {bi}) {} : ({is}, {is}) -> {b}\n      {tie} = \"stablehlo.and\"({eq}, {lt}) : ({b}, {b}) -> {b}\n      {pick} = \"stablehlo.or\"({gt}, {tie}) : ({b}, {b}) -> {b}\n      {v} = \"stablehlo.select\"({pick}, {av}, {bv}) : ({b}, {fs}, {fs}) -> {fs}\n      {i} = \"stablehlo.select\"({pick}, {ai}, {bi}) : ({b}, {is}, {is}) -> {is}\n      \"stablehlo.return\"({v}, {i}) : ({fs}, {is}) -> ()\n    }}) {{dimensions = array<i64: {dim}>}} : ({}, {}, {fs}, {is}) -> ({}, {})",
            cmp("GT"),
            cmp("EQ"),
            cmp("LT"),
            values.ty,
            indices.ty,
            rv.ty,
            ri.ty
        )
        .expect("writing to a String");
        (rv, ri)
    }

    /// Emits `stablehlo.dot_general`. The result has the batch dims (in `lhs_batch` order), then
    /// the free dims of `lhs`, then the free dims of `rhs`.
    pub fn dot_general(&mut self, lhs: &Value, rhs: &Value, d: &DotDims) -> Value {
        assert_eq!(lhs.elem(), rhs.elem(), "dot_general: element types differ");
        assert!(
            d.lhs_batch.len() == d.rhs_batch.len() && d.lhs_contract.len() == d.rhs_contract.len(),
            "dot_general: {d:?}"
        );
        let pairs = d
            .lhs_batch
            .iter()
            .zip(&d.rhs_batch)
            .chain(d.lhs_contract.iter().zip(&d.rhs_contract));
        for (&l, &r) in pairs {
            assert!(
                l < lhs.ty.rank() && r < rhs.ty.rank() && lhs.dims()[l] == rhs.dims()[r],
                "dot_general: lhs {} dim {l} does not match rhs {} dim {r}",
                lhs.ty,
                rhs.ty
            );
        }
        let free = |v: &Value, batch: &[usize], contract: &[usize]| -> Vec<usize> {
            (0..v.ty.rank())
                .filter(|i| !batch.contains(i) && !contract.contains(i))
                .map(|i| v.dims()[i])
                .collect()
        };
        let mut dims: Vec<usize> = d.lhs_batch.iter().map(|&i| lhs.dims()[i]).collect();
        dims.extend(free(lhs, &d.lhs_batch, &d.lhs_contract));
        dims.extend(free(rhs, &d.rhs_batch, &d.rhs_contract));
        self.op(
            "dot_general",
            &[lhs, rhs],
            &format!(
                "dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [{}], rhs_batching_dimensions = [{}], lhs_contracting_dimensions = [{}], rhs_contracting_dimensions = [{}]>",
                list(&d.lhs_batch),
                list(&d.rhs_batch),
                list(&d.lhs_contract),
                list(&d.rhs_contract)
            ),
            lhs.ty.elem_dims(&dims),
        )
    }

    /// Emits `linalg.mmt4d` (the one non-StableHLO op, which IREE's input conversion passes
    /// through): `acc + lhs . rhs^T` over packed tiles, `lhs [M1, K1, M0, K0]`,
    /// `rhs [N1, K1, N0, K0]`, result `[M1, N1, M0, N0]`, with
    /// `out[m1, n1, m0, n0] = sum over k1, k0 of lhs[m1, k1, m0, k0] * rhs[n1, k1, n0, k0]`
    /// accumulated in f32 from zero.
    pub fn mmt4d(&mut self, lhs: &Value, rhs: &Value) -> Value {
        let (l, r) = (lhs.dims(), rhs.dims());
        assert!(
            lhs.elem() == ElemType::F32
                && rhs.elem() == ElemType::F32
                && l.len() == 4
                && r.len() == 4
                && l[1] == r[1]
                && l[3] == r[3],
            "mmt4d: lhs {} and rhs {} are not packed tiles over one K",
            lhs.ty,
            rhs.ty
        );
        let acc = self.const_f32(0.0, &[l[0], r[0], l[2], r[2]]);
        let r = self.fresh(acc.ty.clone());
        let (a, b, c) = (self.fresh_name(), self.fresh_name(), self.fresh_name());
        let (p, s) = (self.fresh_name(), self.fresh_name());
        writeln!(
            self.body,
            "    {r} = \"linalg.mmt4d\"({lhs}, {rhs}, {acc}) <{{operandSegmentSizes = array<i32: 2, 1>}}> ({{\n    ^bb0({a}: f32, {b}: f32, {c}: f32):\n      {p} = \"arith.mulf\"({a}, {b}) : (f32, f32) -> f32\n      {s} = \"arith.addf\"({c}, {p}) : (f32, f32) -> f32\n      \"linalg.yield\"({s}) : (f32) -> ()\n    }}) : ({}, {}, {}) -> {}",
            lhs.ty,
            rhs.ty,
            acc.ty,
            r.ty
        )
        .expect("writing to a String");
        r
    }

    /// Emits `flow.dispatch @{entry}[workload](args..., operands...)`: a call of an entry point
    /// of one of the module's executables ([`super::Module::push_executable`]) with the tensors
    /// `args` as its input bindings, then the `index` constants `operands`, returning a new
    /// tensor of type `result`. `workload` (values of `operands`) goes to the entry point's
    /// workgroup count.
    pub fn dispatch(
        &mut self,
        entry: &str,
        workload: &[usize],
        args: &[&Value],
        operands: &[usize],
        result: TensorType,
    ) -> Value {
        assert!(
            workload.iter().all(|w| operands.contains(w)),
            "dispatch {entry}: workload {workload:?} not among operands {operands:?}"
        );
        let mut names: Vec<(usize, String)> = Vec::new();
        for &x in operands {
            if !names.iter().any(|(v, _)| *v == x) {
                let name = self.fresh_name();
                writeln!(self.body, "    {name} = arith.constant {x} : index")
                    .expect("writing to a String");
                names.push((x, name));
            }
        }
        let name_of = |x: &usize| {
            names
                .iter()
                .find(|(v, _)| v == x)
                .map(|(_, n)| n.clone())
                .expect("every operand has a constant")
        };
        let workload: Vec<String> = workload.iter().map(name_of).collect();
        let mut all: Vec<String> = args.iter().map(|v| v.to_string()).collect();
        all.extend(operands.iter().map(name_of));
        let mut tys: Vec<String> = args.iter().map(|v| v.ty.to_string()).collect();
        tys.extend(operands.iter().map(|_| "index".to_string()));
        let r = self.fresh(result);
        writeln!(
            self.body,
            "    {r} = flow.dispatch @{entry}[{}]({}) : ({}) -> {}",
            workload.join(", "),
            all.join(", "),
            tys.join(", "),
            r.ty
        )
        .expect("writing to a String");
        r
    }

    /// Emits `hal.dispatch.extern` of the SPIR-V object `object` (its entry point `main`, a
    /// file name the compiler finds on its object search path): `groups` workgroups, the
    /// `u32` push constants `constants`, the tensors `args` as storage buffers (bindings 0,
    /// 1, ... in order), then the results, of types `results`, as the last bindings. The
    /// args at the indices `in_place` are read-write bindings the kernel also writes, and
    /// results too, in their operands' storage; the others are read-only. Returns the
    /// results, then the in-place ones in `in_place`'s order. The object is the whole
    /// executable, so the shader's own declarations must match.
    pub fn dispatch_spirv(
        &mut self,
        object: &str,
        groups: [usize; 3],
        constants: &[u32],
        (args, in_place): (&[&Value], &[usize]),
        results: &[TensorType],
    ) -> Vec<Value> {
        assert!(
            in_place.iter().all(|&i| i < args.len()),
            "dispatch_spirv: in-place operands {in_place:?} of {} args",
            args.len()
        );
        let mut names = Vec::new();
        for g in groups {
            let name = self.fresh_name();
            writeln!(self.body, "    {name} = arith.constant {g} : index")
                .expect("writing to a String");
            names.push(name);
        }
        let mut operands = Vec::new();
        for &c in constants {
            let name = self.fresh_name();
            // Two's complement: IREE passes the constant's 32 bits through unchanged.
            writeln!(self.body, "    {name} = arith.constant {} : i32", c as i32)
                .expect("writing to a String");
            operands.push(name);
        }
        operands.extend(args.iter().map(|v| v.to_string()));
        let mut tys = vec!["i32".to_string(); constants.len()];
        tys.extend(args.iter().map(|v| v.ty.to_string()));
        let bindings: Vec<&str> = (0..args.len())
            .map(|i| match in_place.contains(&i) {
                true => "#hal.pipeline.binding<storage_buffer>",
                false => "#hal.pipeline.binding<storage_buffer, ReadOnly>",
            })
            .chain(
                results
                    .iter()
                    .map(|_| "#hal.pipeline.binding<storage_buffer>"),
            )
            .collect();
        let (d, x, y, z) = (
            self.fresh_name(),
            self.fresh_name(),
            self.fresh_name(),
            self.fresh_name(),
        );
        let mut outs: Vec<Value> = results.iter().map(|ty| self.fresh(ty.clone())).collect();
        let mut result_tys: Vec<String> = results.iter().map(|ty| ty.to_string()).collect();
        for &i in in_place {
            outs.push(self.fresh(args[i].ty.clone()));
            result_tys.push(args[i].to_string());
        }
        let names_out: Vec<String> = outs.iter().map(|r| r.to_string()).collect();
        writeln!(
            self.body,
            "    {} = hal.dispatch.extern \"main\"[{}]({}) : ({}) -> ({})\n      count({d}: !hal.device, {x}: index, {y}: index, {z}: index) -> (index, index, index) {{\n        hal.return {x}, {y}, {z} : index, index, index\n      }}\n      layout(#hal.pipeline.layout<constants = {}, bindings = [{}]>)\n      objects({{#hal.executable.target<\"vulkan-spirv\", \"vulkan-spirv-fb\"> ordinal(0) = [#hal.executable.object<{{path = \"{object}\"}}>]}})",
            names_out.join(", "),
            names.join(", "),
            operands.join(", "),
            tys.join(", "),
            result_tys.join(", "),
            constants.len(),
            bindings.join(", "),
        )
        .expect("writing to a String");
        outs
    }

    /// Emits `util.global.load`: the value of the module's mutable global `@name`
    /// ([`crate::emit::Module::push_global`]), of type `ty`.
    pub fn global_load(&mut self, name: &str, ty: &TensorType) -> Value {
        let r = self.fresh(ty.clone());
        writeln!(self.body, "    {r} = util.global.load @{name} : {ty}")
            .expect("writing to a String");
        r
    }

    /// Emits `util.global.store`: `value` becomes the module's mutable global `@name`.
    pub fn global_store(&mut self, value: &Value, name: &str) {
        writeln!(
            self.body,
            "    util.global.store {value}, @{name} : {}",
            value.ty
        )
        .expect("writing to a String");
    }

    // ---- indexing -----------------------------------------------------------------------

    fn check_starts(&self, op: &str, x: &Value, starts: &[&Value]) {
        assert_eq!(
            starts.len(),
            x.ty.rank(),
            "{op}: one start per dim of {}",
            x.ty
        );
        for s in starts {
            assert!(
                s.ty == TensorType::i32(&[]),
                "{op}: start index {} is not tensor<i32>",
                s.ty
            );
        }
    }

    /// Emits `stablehlo.dynamic_slice`: a `sizes` block of `x` at scalar i32 `starts` (clamped
    /// into range by the op's semantics).
    pub fn dynamic_slice(&mut self, x: &Value, starts: &[&Value], sizes: &[usize]) -> Value {
        self.check_starts("dynamic_slice", x, starts);
        assert!(
            sizes.len() == x.ty.rank() && sizes.iter().zip(x.dims()).all(|(s, d)| s <= d),
            "dynamic_slice: sizes {sizes:?} for {}",
            x.ty
        );
        let mut args = vec![x];
        args.extend_from_slice(starts);
        self.op(
            "dynamic_slice",
            &args,
            &format!("slice_sizes = {}", i64_array(sizes)),
            x.ty.elem_dims(sizes),
        )
    }

    /// Emits `stablehlo.dynamic_update_slice`: `x` with `update` written at scalar i32 `starts`
    /// (clamped so that the update fits).
    pub fn dynamic_update_slice(&mut self, x: &Value, update: &Value, starts: &[&Value]) -> Value {
        self.check_starts("dynamic_update_slice", x, starts);
        assert!(
            update.elem() == x.elem()
                && update.ty.rank() == x.ty.rank()
                && update.dims().iter().zip(x.dims()).all(|(u, d)| u <= d),
            "dynamic_update_slice: update {} for {}",
            update.ty,
            x.ty
        );
        let mut args = vec![x, update];
        args.extend_from_slice(starts);
        self.op("dynamic_update_slice", &args, "", x.ty.clone())
    }

    /// Emits `stablehlo.gather` of whole rows: `table[indices[i], ...]` for each `i`.
    ///
    /// # Shapes
    /// `table`: `[n, d...]`, `indices`: `[c, 1]` i32; returns `[c, d...]`.
    pub fn gather_rows(&mut self, table: &Value, indices: &Value) -> Value {
        let rank = table.ty.rank();
        assert!(rank >= 1, "gather_rows: table {} has no rows", table.ty);
        assert!(
            indices.elem() == ElemType::I32 && indices.ty.rank() == 2 && indices.dims()[1] == 1,
            "gather_rows: indices {} must be [c, 1] i32",
            indices.ty
        );
        let mut sizes = table.dims().to_vec();
        sizes[0] = 1;
        let mut dims = vec![indices.dims()[0]];
        dims.extend_from_slice(&table.dims()[1..]);
        let offset: Vec<usize> = (1..rank).collect();
        self.op(
            "gather",
            &[table, indices],
            &format!(
                "dimension_numbers = #stablehlo.gather<offset_dims = [{}], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = {}, indices_are_sorted = false",
                list(&offset),
                i64_array(&sizes)
            ),
            table.ty.elem_dims(&dims),
        )
    }

    /// Emits `stablehlo.gather` of one lane-column per index from a panel table: row `i` of
    /// the result is `table[indices[i, 0], :, indices[i, 1]]`.
    ///
    /// # Shapes
    /// `table`: `[panels, d, lanes]`, `indices`: `[c, 2]` i32 (panel, lane); returns `[c, d]`.
    pub fn gather_lanes(&mut self, table: &Value, indices: &Value) -> Value {
        assert!(
            table.ty.rank() == 3,
            "gather_lanes: table {} must be [panels, d, lanes]",
            table.ty
        );
        assert!(
            indices.elem() == ElemType::I32 && indices.ty.rank() == 2 && indices.dims()[1] == 2,
            "gather_lanes: indices {} must be [c, 2] i32",
            indices.ty
        );
        let d = table.dims()[1];
        self.op(
            "gather",
            &[table, indices],
            &format!(
                "dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0, 2], start_index_map = [0, 2], index_vector_dim = 1>, slice_sizes = {}, indices_are_sorted = false",
                i64_array(&[1, d, 1])
            ),
            table.ty.elem_dims(&[indices.dims()[0], d]),
        )
    }

    /// Starts a branch region: the ops emitted until [`FuncBuilder::close_region`] go into it
    /// (they may use values defined before it).
    pub fn open_region(&mut self) -> OpenRegion {
        OpenRegion {
            outer: std::mem::take(&mut self.body),
        }
    }

    /// Ends the region `open` started, returning `results` from it, and goes back to emitting
    /// into the enclosing body.
    pub fn close_region(&mut self, open: OpenRegion, results: &[&Value]) -> Region {
        let body = std::mem::replace(&mut self.body, open.outer);
        Region {
            body,
            results: results.iter().map(|&v| v.clone()).collect(),
        }
    }

    /// Emits `stablehlo.if`: the results of `then` where `pred` (`[]` i1) holds, else those of
    /// `otherwise`; only the taken branch runs.
    ///
    /// # Panics
    /// If `pred` is not an i1 scalar or the branches return different types.
    pub fn if_else(&mut self, pred: &Value, then: Region, otherwise: Region) -> Vec<Value> {
        assert!(
            pred.ty == TensorType::i1(&[]),
            "if_else: predicate {} must be tensor<i1>",
            pred.ty
        );
        let types_of = |r: &Region| r.results.iter().map(|v| v.ty.clone()).collect::<Vec<_>>();
        assert_eq!(
            types_of(&then),
            types_of(&otherwise),
            "if_else: branches return different types"
        );
        let results: Vec<Value> = then
            .results
            .iter()
            .map(|v| self.fresh(v.ty.clone()))
            .collect();
        let region = |r: &Region| {
            let refs: Vec<&Value> = r.results.iter().collect();
            format!(
                "{}    \"stablehlo.return\"({}) : ({}) -> ()\n",
                r.body,
                operands(&refs),
                types(&refs)
            )
        };
        let refs: Vec<&Value> = results.iter().collect();
        writeln!(
            self.body,
            "    {} = \"stablehlo.if\"({pred}) ({{\n{}    }}, {{\n{}    }}) : ({}) -> ({})",
            operands(&refs),
            region(&then),
            region(&otherwise),
            pred.ty,
            types(&refs)
        )
        .expect("writing to a String");
        results
    }

    /// Emits `stablehlo.scatter` of whole rows that replaces `x[indices[i], ...]` with
    /// `updates[i, ...]`. The indices must be increasing (so distinct) and within `x`: the
    /// scatter is declared sorted and unique, without which IREE's SPIR-V code runs it in a
    /// single thread that also copies all of `x`, and IREE's llvm-cpu code does not check
    /// the bounds.
    ///
    /// # Shapes
    /// `x`: `[n, d...]`, `indices`: `[c, 1]` i32, `updates`: `[c, d...]`; returns `[n, d...]`.
    pub fn scatter_rows(&mut self, x: &Value, indices: &Value, updates: &Value) -> Value {
        let rank = x.ty.rank();
        assert!(
            indices.elem() == ElemType::I32 && indices.ty.rank() == 2 && indices.dims()[1] == 1,
            "scatter_rows: indices {} must be [c, 1] i32",
            indices.ty
        );
        assert!(
            rank >= 1
                && updates.elem() == x.elem()
                && updates.ty.rank() == rank
                && updates.dims()[0] == indices.dims()[0]
                && updates.dims()[1..] == x.dims()[1..],
            "scatter_rows: updates {} for {} at indices {}",
            updates.ty,
            x.ty,
            indices.ty
        );
        let scalar = x.ty.elem_dims(&[]);
        let r = self.fresh(x.ty.clone());
        let (old, new) = (self.fresh(scalar.clone()), self.fresh(scalar.clone()));
        let window: Vec<usize> = (1..rank).collect();
        writeln!(
            self.body,
            "    {r} = \"stablehlo.scatter\"({x}, {indices}, {updates}) ({{\n    ^bb0({old}: {scalar}, {new}: {scalar}):\n      \"stablehlo.return\"({new}) : ({scalar}) -> ()\n    }}) {{scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [{}], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = true, unique_indices = true}} : ({}, {}, {}) -> {}",
            list(&window),
            x.ty,
            indices.ty,
            updates.ty,
            r.ty
        )
        .expect("writing to a String");
        r
    }
}
