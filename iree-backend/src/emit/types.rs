//! The types of the emitter: element types, ranked tensor types and SSA values.

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    /// 32-bit float.
    F32,
    /// 32-bit signless integer (compared as signed).
    I32,
    /// Boolean (comparison results, masks).
    I1,
    /// 8-bit signless integer (int8 weights, converted as signed).
    I8,
}

impl ElemType {
    /// The MLIR spelling: `f32`, `i32`, `i1`, `i8`.
    pub fn mlir(self) -> &'static str {
        match self {
            ElemType::F32 => "f32",
            ElemType::I32 => "i32",
            ElemType::I1 => "i1",
            ElemType::I8 => "i8",
        }
    }
}

/// A statically shaped tensor type, `tensor<2x3xf32>`; no dims is a scalar `tensor<f32>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Static dims, outermost first.
    pub dims: Vec<usize>,
    /// Element type.
    pub elem: ElemType,
}

impl TensorType {
    /// A tensor of `dims` with element type `elem`.
    pub fn new(dims: &[usize], elem: ElemType) -> Self {
        TensorType {
            dims: dims.to_vec(),
            elem,
        }
    }

    /// `tensor<dims x f32>`.
    pub fn f32(dims: &[usize]) -> Self {
        Self::new(dims, ElemType::F32)
    }

    /// `tensor<dims x i32>`.
    pub fn i32(dims: &[usize]) -> Self {
        Self::new(dims, ElemType::I32)
    }

    /// `tensor<dims x i1>`.
    pub fn i1(dims: &[usize]) -> Self {
        Self::new(dims, ElemType::I1)
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// A tensor of `dims` with this type's element type.
    pub fn elem_dims(&self, dims: &[usize]) -> TensorType {
        TensorType::new(dims, self.elem)
    }

    /// The same dims with another element type.
    pub fn with_elem(&self, elem: ElemType) -> Self {
        Self::new(&self.dims, elem)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tensor<")?;
        for d in &self.dims {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", self.elem.mlir())
    }
}

/// A typed SSA value of the function being built, printed `%{id}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Value {
    /// SSA number, unique within its function.
    pub id: usize,
    /// The value's type.
    pub ty: TensorType,
}

impl Value {
    /// The dims of the value's type.
    pub fn dims(&self) -> &[usize] {
        &self.ty.dims
    }

    /// The element type of the value.
    pub fn elem(&self) -> ElemType {
        self.ty.elem
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.id)
    }
}

/// A host scalar of the function being built, printed `%{id}`: an `i32` or `i1` outside any
/// tensor. IREE runs arithmetic on scalars in the module's host program, so an index or a
/// branch predicate computed as a scalar needs no dispatch and no read-back; computed as a
/// `tensor<i32>`, it would be a dispatch whose result the host waits for between two queue
/// submissions (docs/BENCHMARKS.md, twenty-fifth pass).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scalar {
    /// SSA number, unique within its function.
    pub id: usize,
    /// [`ElemType::I32`] or [`ElemType::I1`].
    pub elem: ElemType,
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.id)
    }
}
