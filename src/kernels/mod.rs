//! Fused kernels for the GPU runner (`kernels/*.cu`) and the CPU references they are checked
//! against.
//!
//! Every op comes in three layers, one file per op:
//! - a CPU reference over plain slices: f32 math, storage f32/f16/bf16 (via `half`), exactly
//!   the semantics the `.cu` file's opening comment states;
//! - a candle op (`CustomOp*` / `InplaceOp*`, or a function dispatching on the device for ops
//!   with several outputs) whose CPU path runs the reference and whose CUDA path launches the
//!   kernel on the device's stream, honouring the input layouts (start offset, row stride);
//! - a public function on [`Tensor`]s that model code calls.
//!
//! With the `cuda` feature, [`cuda`] loads the PTX and launches kernels from raw device
//! pointers (so a runner with preallocated workspaces can call them without candle allocating
//! anything), and [`gemm`] wraps cuBLAS for the projections and the MoE experts.

pub mod attention;
pub mod fp8;
pub mod gather;
pub mod moe;
pub mod rmsnorm;
pub mod rope;
pub mod score;
pub mod silu_mul;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod gemm;

#[cfg(test)]
pub(crate) mod testing;

pub use attention::{AttnParams, flash_attention};
pub use fp8::fp8_dequant;
pub use gather::gather_rows;
pub use moe::{
    ExpertsPath, MoePlan, MoeRouting, RouteParams, StackedExperts, moe_combine, moe_experts,
    moe_plan, moe_route,
};
pub use rmsnorm::{add_rms_norm, rms_norm};
pub use rope::{RopeParams, rope, rope_in_place};
pub use score::{PairSums, score_slots};
pub use silu_mul::silu_mul;

use candle_core::{DType, Layout, Result};
use half::{bf16, f16};

/// The storage types every kernel is instantiated for; the entry point's suffix names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelDType {
    F32,
    F16,
    BF16,
}

impl KernelDType {
    pub fn of(dtype: DType) -> Result<KernelDType> {
        match dtype {
            DType::F32 => Ok(KernelDType::F32),
            DType::F16 => Ok(KernelDType::F16),
            DType::BF16 => Ok(KernelDType::BF16),
            other => candle_core::bail!("kernels take f32, f16 or bf16 tensors, found {other:?}"),
        }
    }

    /// The suffix of the entry points instantiated for this type (`add_rmsnorm_bf16`).
    pub fn suffix(self) -> &'static str {
        match self {
            KernelDType::F32 => "f32",
            KernelDType::F16 => "f16",
            KernelDType::BF16 => "bf16",
        }
    }

    pub fn size(self) -> usize {
        match self {
            KernelDType::F32 => 4,
            KernelDType::F16 | KernelDType::BF16 => 2,
        }
    }
}

/// A float storage type of the CPU references: values are read into f32, computed in f32 and
/// rounded once (to nearest even) when stored, as the kernels do.
pub trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Elem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl Elem for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> f16 {
        f16::from_f32(v)
    }
}

impl Elem for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

/// `v` rounded to `T` and read back: what a store and a load of `T` give.
pub(crate) fn round_to<T: Elem>(v: f32) -> f32 {
    T::from_f32(v).to_f32()
}

/// Runs `$body` with `$T` bound to the Rust type of a float `DType` (f32, f16, bf16).
macro_rules! with_float_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            other => candle_core::bail!("kernels take f32, f16 or bf16 tensors, found {other:?}"),
        }
    };
}
pub(crate) use with_float_type;

/// A row-major matrix inside a tensor's storage: element (r, c) at `offset + r * stride + c`.
/// Column windows of wider matrices (q inside a fused QKV output) are matrices with a row
/// stride wider than their columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matrix {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl Matrix {
    /// The matrix a rank-2 layout describes (a rank-1 layout is one row). Refuses a last
    /// dimension whose stride is not 1 (a transposed view): the kernels read rows as
    /// contiguous runs.
    pub fn of(layout: &Layout, what: &str) -> Result<Matrix> {
        let (dims, strides) = (layout.dims(), layout.stride());
        let offset = layout.start_offset();
        match (dims, strides) {
            ([cols], [s]) if *s == 1 || *cols <= 1 => Ok(Matrix {
                offset,
                rows: 1,
                cols: *cols,
                stride: *cols,
            }),
            ([rows, cols], [rs, cs]) if *cs == 1 || *cols <= 1 => Ok(Matrix {
                offset,
                rows: *rows,
                cols: *cols,
                // A single row has no meaningful row stride (candle may report 0 after a broadcast).
                stride: if *rows <= 1 { (*rs).max(*cols) } else { *rs },
            }),
            ([_] | [_, _], _) => candle_core::bail!(
                "{what}: the last dimension must have unit stride, found strides {strides:?} \
                 for shape {dims:?}; call .contiguous() first"
            ),
            _ => candle_core::bail!(
                "{what}: expected a rank-1 or rank-2 tensor, found shape {dims:?}"
            ),
        }
    }

    /// Like [`Matrix::of`], requiring `cols` columns.
    pub fn with_cols(layout: &Layout, cols: usize, what: &str) -> Result<Matrix> {
        let m = Matrix::of(layout, what)?;
        if m.cols != cols {
            candle_core::bail!("{what}: expected {cols} columns, found {}", m.cols);
        }
        Ok(m)
    }

    /// Refuses rows that overlap (a row stride below the row length); a zero stride is a
    /// broadcast and fine for inputs.
    pub fn check_rows_disjoint(&self, what: &str) -> Result<()> {
        if self.rows > 1 && self.stride < self.cols {
            candle_core::bail!(
                "{what}: rows overlap (row stride {} < {} columns)",
                self.stride,
                self.cols
            );
        }
        Ok(())
    }

    /// Storage elements the matrix spans from its offset: the slice a reference needs.
    pub fn span(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.stride + self.cols
        }
    }

    /// The matrix's elements of `data` (the whole storage), from its offset.
    pub fn slice<'a, T>(&self, data: &'a [T], what: &str) -> Result<&'a [T]> {
        data.get(self.offset..self.offset + self.span())
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "{what}: layout reaches element {} of a storage of {}",
                    self.offset + self.span(),
                    data.len()
                ))
            })
    }
}

/// `n` as the `int` a kernel takes.
#[cfg(feature = "cuda")]
pub(crate) fn to_i32(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{what} = {n} exceeds i32")))
}

/// `n` as the `long` a kernel takes.
#[cfg(feature = "cuda")]
pub(crate) fn to_i64(n: usize, what: &str) -> Result<i64> {
    i64::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{what} = {n} exceeds i64")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn matrix_of_column_window() {
        let t = Tensor::zeros((5, 12), DType::F32, &Device::Cpu).unwrap();
        let w = t.narrow(1, 4, 3).unwrap();
        let m = Matrix::of(w.layout(), "w").unwrap();
        assert_eq!(
            m,
            Matrix {
                offset: 4,
                rows: 5,
                cols: 3,
                stride: 12
            }
        );
        assert_eq!(m.span(), 4 * 12 + 3);
        let err = Matrix::of(t.t().unwrap().layout(), "xt").unwrap_err();
        assert!(err.to_string().contains("unit stride"), "{err}");
    }
}
