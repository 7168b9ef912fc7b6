//! Host tensors read from capture files: a dtype, a shape and little-endian bytes, row-major.
//!
//! Every size is computed with checked arithmetic and every byte range is checked against the
//! buffer it points into (the safetensors crate's `try_fold(1usize, usize::checked_mul)`), so
//! a hostile header can make a reader fail but never overflow, panic or over-allocate.

use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};

/// Element types the readers decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Short lower-case name (`f32`, `bf16`, `i64`, `bool`, ...), as used in messages and in
    /// the fixtures' expected JSON.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a tensor could not be built from a header and a buffer. The readers wrap it in a
/// [`super::ReadError`] that names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    #[error("shape {} of {dtype} overflows the address space", fmt_shape(.shape))]
    SizeOverflow { dtype: DType, shape: Vec<usize> },
    #[error(
        "shape {} of {dtype} needs {} but {} are there",
        fmt_shape(.shape), fmt_bytes(*.expected), fmt_bytes(*.got)
    )]
    ByteCount {
        dtype: DType,
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },
    /// `view` spells the shape, strides and offset, e.g. `100x100 (strides [100, 1], offset 0)`.
    #[error("view {view} reaches element {needed} of a storage of {storage_numel}")]
    ViewOutOfBounds {
        view: String,
        needed: u64,
        storage_numel: usize,
    },
    #[error("view has {rank} dims but {strides} strides")]
    StrideRank { rank: usize, strides: usize },
    #[error("negative stride {stride} (views with negative strides are not supported)")]
    NegativeStride { stride: i64 },
    #[error("copying this strided view would exceed the copy budget of {}", fmt_bytes(*.budget))]
    CopyBudget { budget: usize },
}

/// `4096x4096`; `[]` for a scalar.
pub fn fmt_shape(shape: &[usize]) -> String {
    if shape.is_empty() {
        return "[] (scalar)".to_string();
    }
    shape
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("x")
}

/// `1200 bytes`, `64 MiB`, `1.5 GiB` (exact bytes below 10 KiB).
pub fn fmt_bytes(n: usize) -> String {
    const KIB: f64 = 1024.0;
    let x = n as f64;
    if n < 10 * 1024 {
        format!("{n} bytes")
    } else if x < KIB * KIB {
        trim_unit(x / KIB, "KiB")
    } else if x < KIB * KIB * KIB {
        trim_unit(x / (KIB * KIB), "MiB")
    } else {
        trim_unit(x / (KIB * KIB * KIB), "GiB")
    }
}

fn trim_unit(v: f64, unit: &str) -> String {
    if (v - v.round()).abs() < 0.05 {
        format!("{} {unit}", v.round())
    } else {
        format!("{v:.1} {unit}")
    }
}

/// Number of elements of `shape`, `None` on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Bytes of `shape` elements of `dtype`, `None` on overflow.
pub fn checked_nbytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    checked_numel(shape)?.checked_mul(dtype.size())
}

/// A tensor on the host: row-major, little-endian, contiguous.
///
/// The bytes are shared (`Arc`) with the buffer they were read from, so views of one storage
/// and slices along the first dimension cost no copy.
#[derive(Clone, PartialEq)]
pub struct HostTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    data: Arc<Vec<u8>>,
    /// Byte offset of element 0 in `data`; `start + numel * dtype.size() <= data.len()`.
    start: usize,
}

impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostTensor({} {})", self.dtype, fmt_shape(&self.shape))
    }
}

impl HostTensor {
    /// A tensor over `data[start..start + nbytes]`; checks that the range is inside `data`.
    pub(crate) fn from_shared(
        dtype: DType,
        shape: Vec<usize>,
        data: Arc<Vec<u8>>,
        start: usize,
    ) -> Result<Self, TensorError> {
        let nbytes = checked_nbytes(dtype, &shape).ok_or_else(|| TensorError::SizeOverflow {
            dtype,
            shape: shape.clone(),
        })?;
        let avail = data.len().saturating_sub(start);
        if start > data.len() || nbytes > avail {
            return Err(TensorError::ByteCount {
                dtype,
                shape,
                expected: nbytes,
                got: avail,
            });
        }
        Ok(Self {
            dtype,
            shape,
            data,
            start,
        })
    }

    /// A tensor owning `bytes` (little-endian, row-major); the length must be exactly
    /// `numel * dtype.size()`.
    pub fn from_le_bytes(
        dtype: DType,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Result<Self, TensorError> {
        let nbytes = checked_nbytes(dtype, &shape).ok_or_else(|| TensorError::SizeOverflow {
            dtype,
            shape: shape.clone(),
        })?;
        if nbytes != bytes.len() {
            return Err(TensorError::ByteCount {
                dtype,
                shape,
                expected: nbytes,
                got: bytes.len(),
            });
        }
        Self::from_shared(dtype, shape, Arc::new(bytes), 0)
    }

    /// An f32 tensor from values (handy in tests).
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self, TensorError> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_le_bytes(DType::F32, shape, bytes)
    }

    /// An i64 tensor from values (handy in tests).
    pub fn from_i64(shape: Vec<usize>, values: &[i64]) -> Result<Self, TensorError> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_le_bytes(DType::I64, shape, bytes)
    }

    /// The dims, `[]` for a scalar.
    pub fn dims(&self) -> &[usize] {
        &self.shape
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (checked when the tensor was built, so this cannot overflow).
    pub fn numel(&self) -> usize {
        checked_numel(&self.shape).unwrap_or(0)
    }

    /// The tensor's bytes: little-endian, row-major, `numel * dtype.size()` long.
    pub fn bytes(&self) -> &[u8] {
        let n = self.numel().saturating_mul(self.dtype.size());
        self.data
            .get(self.start..self.start.saturating_add(n))
            .unwrap_or(&[])
    }

    /// Every element as f32: floats decoded (f16/bf16 through `half`, f64 narrowed), integers
    /// converted (large i64 lose precision), bools as 0.0/1.0.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let b = self.bytes();
        match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F64 => b
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(le8(c)) as f32)
                .collect(),
            _ => self
                .to_i64_vec()
                .unwrap_or_default()
                .into_iter()
                .map(|v| v as f32)
                .collect(),
        }
    }

    /// Every element as f64 (exact for every dtype but i64 beyond 2^53).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self.dtype {
            DType::F64 => self
                .bytes()
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(le8(c)))
                .collect(),
            d if d.is_float() => self.to_f32_vec().into_iter().map(f64::from).collect(),
            _ => self
                .to_i64_vec()
                .unwrap_or_default()
                .into_iter()
                .map(|v| v as f64)
                .collect(),
        }
    }

    /// Every element as i64 for integer and bool tensors; `None` for floating-point ones.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        let b = self.bytes();
        Some(match self.dtype {
            DType::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(le8(c)))
                .collect(),
            DType::I32 => b
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            DType::I16 => b
                .chunks_exact(2)
                .map(|c| i64::from(i16::from_le_bytes([c[0], c[1]])))
                .collect(),
            DType::I8 => b.iter().map(|&x| i64::from(x as i8)).collect(),
            DType::U8 => b.iter().map(|&x| i64::from(x)).collect(),
            DType::Bool => b.iter().map(|&x| i64::from(x != 0)).collect(),
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 => return None,
        })
    }

    /// The same bytes under another shape with the same number of elements.
    pub fn reshape(&self, shape: Vec<usize>) -> Option<HostTensor> {
        if checked_numel(&shape)? != self.numel() {
            return None;
        }
        Some(HostTensor {
            dtype: self.dtype,
            shape,
            data: Arc::clone(&self.data),
            start: self.start,
        })
    }

    /// Row `i` along the first dimension (no copy); `None` for a scalar or `i` out of range.
    pub fn select0(&self, i: usize) -> Option<HostTensor> {
        let (&n, rest) = self.shape.split_first()?;
        if i >= n {
            return None;
        }
        let row_bytes = checked_nbytes(self.dtype, rest)?;
        Some(HostTensor {
            dtype: self.dtype,
            shape: rest.to_vec(),
            data: Arc::clone(&self.data),
            start: self.start.checked_add(row_bytes.checked_mul(i)?)?,
        })
    }

    /// Drops a leading dimension of size 1 (`[1, S, H]` -> `[S, H]`); `None` otherwise.
    pub fn squeeze0(&self) -> Option<HostTensor> {
        match self.shape.first() {
            Some(1) => self.select0(0),
            _ => None,
        }
    }
}

fn le8(c: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(&c[..8]);
    a
}

/// Builds the row-major tensor that a strided view of a storage describes (torch's
/// `as_strided(size, stride, storage_offset)`), all in elements.
///
/// A contiguous view (row-major strides; dims of size 1 may carry any stride) shares the
/// storage's bytes; any other view is gathered into a fresh buffer, which counts against
/// `copy_budget` (bytes still allowed to be copied; decreased on success).
pub fn strided_view(
    dtype: DType,
    storage: &Arc<Vec<u8>>,
    storage_offset: usize,
    shape: &[usize],
    strides: &[i64],
    copy_budget: &mut usize,
) -> Result<HostTensor, TensorError> {
    if shape.len() != strides.len() {
        return Err(TensorError::StrideRank {
            rank: shape.len(),
            strides: strides.len(),
        });
    }
    let esize = dtype.size();
    let storage_numel = storage.len() / esize;
    let numel = checked_numel(shape).ok_or_else(|| TensorError::SizeOverflow {
        dtype,
        shape: shape.to_vec(),
    })?;
    let nbytes = numel
        .checked_mul(esize)
        .ok_or_else(|| TensorError::SizeOverflow {
            dtype,
            shape: shape.to_vec(),
        })?;
    let mut ustrides = Vec::with_capacity(strides.len());
    for &s in strides {
        if s < 0 {
            return Err(TensorError::NegativeStride { stride: s });
        }
        ustrides.push(s as u128);
    }
    if numel == 0 {
        return HostTensor::from_le_bytes(dtype, shape.to_vec(), Vec::new());
    }
    // Highest element index the view touches, in u128 so no header can overflow it.
    let last: u128 = shape
        .iter()
        .zip(&ustrides)
        .map(|(&d, &s)| (d as u128 - 1) * s)
        .fold(storage_offset as u128, |a, b| a.saturating_add(b));
    if last >= storage_numel as u128 {
        return Err(TensorError::ViewOutOfBounds {
            view: format!(
                "{} (strides {strides:?}, offset {storage_offset})",
                fmt_shape(shape)
            ),
            needed: u64::try_from(last).unwrap_or(u64::MAX),
            storage_numel,
        });
    }
    // From here every index is < storage_numel, so usize arithmetic is safe.
    let mut expected = 1usize;
    let mut contiguous = true;
    for (&d, &s) in shape.iter().zip(&ustrides).rev() {
        if d != 1 && s != expected as u128 {
            contiguous = false;
            break;
        }
        expected = expected.saturating_mul(d);
    }
    if contiguous {
        return HostTensor::from_shared(
            dtype,
            shape.to_vec(),
            Arc::clone(storage),
            storage_offset * esize,
        );
    }
    if nbytes > *copy_budget {
        return Err(TensorError::CopyBudget {
            budget: *copy_budget,
        });
    }
    *copy_budget -= nbytes;
    let ustrides: Vec<usize> = ustrides.iter().map(|&s| s as usize).collect();
    let mut out = Vec::with_capacity(nbytes);
    let mut idx = vec![0usize; shape.len()];
    let mut pos = storage_offset;
    for _ in 0..numel {
        let b = pos * esize;
        out.extend_from_slice(storage.get(b..b + esize).unwrap_or(&[]));
        // Odometer increment over the multi-index, last dim fastest.
        for ax in (0..shape.len()).rev() {
            // Wrapping: a size-1 dim may carry any stride; the sum comes back in range.
            idx[ax] += 1;
            pos = pos.wrapping_add(ustrides[ax]);
            if idx[ax] < shape[ax] {
                break;
            }
            pos = pos.wrapping_sub(ustrides[ax].wrapping_mul(shape[ax]));
            idx[ax] = 0;
        }
    }
    HostTensor::from_le_bytes(dtype, shape.to_vec(), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage(n: usize) -> Arc<Vec<u8>> {
        Arc::new(
            (0..n as u32)
                .flat_map(|v| (v as f32).to_le_bytes())
                .collect(),
        )
    }

    #[test]
    fn contiguous_view_with_offset_shares_bytes() {
        let s = storage(12);
        let mut budget = 0;
        let t = strided_view(DType::F32, &s, 4, &[2, 4], &[4, 1], &mut budget).unwrap();
        assert_eq!(t.to_f32_vec(), vec![4., 5., 6., 7., 8., 9., 10., 11.]);
    }

    #[test]
    fn transposed_view_is_gathered() {
        let s = storage(6);
        let mut budget = 1 << 20;
        // [2,3] row-major, viewed as its transpose [3,2] with strides (1,3).
        let t = strided_view(DType::F32, &s, 0, &[3, 2], &[1, 3], &mut budget).unwrap();
        assert_eq!(t.to_f32_vec(), vec![0., 3., 1., 4., 2., 5.]);
        assert_eq!(budget, (1 << 20) - 24);
    }

    #[test]
    fn view_past_the_storage_is_refused() {
        let s = storage(12);
        let mut budget = 1 << 20;
        let e = strided_view(DType::F32, &s, 0, &[100, 100], &[100, 1], &mut budget).unwrap_err();
        assert!(matches!(e, TensorError::ViewOutOfBounds { .. }), "{e}");
        let e =
            strided_view(DType::F32, &s, 0, &[1 << 40, 1 << 40], &[1, 1], &mut budget).unwrap_err();
        assert!(matches!(e, TensorError::SizeOverflow { .. }), "{e}");
    }

    #[test]
    fn from_le_bytes_checks_the_byte_count() {
        let e = HostTensor::from_le_bytes(DType::F32, vec![2, 2], vec![0; 12]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "shape 2x2 of f32 needs 16 bytes but 12 bytes are there"
        );
    }

    #[test]
    fn select_and_squeeze() {
        let t = HostTensor::from_i64(vec![1, 2, 3], &[1, 2, 3, 4, 5, 6]).unwrap();
        let s = t.squeeze0().unwrap();
        assert_eq!(s.dims(), &[2, 3]);
        assert_eq!(s.select0(1).unwrap().to_i64_vec().unwrap(), vec![4, 5, 6]);
        assert!(s.select0(2).is_none());
    }

    #[test]
    fn fmt_bytes_reads_well() {
        assert_eq!(fmt_bytes(1200), "1200 bytes");
        assert_eq!(fmt_bytes(64 << 20), "64 MiB");
        assert_eq!(fmt_bytes(15 << 10), "15 KiB");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
    }
}
