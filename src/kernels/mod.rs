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
pub mod mxfp4;
pub mod rmsnorm;
pub mod rope;
pub mod score;
pub mod silu_mul;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod dispatch;
#[cfg(feature = "cuda")]
pub mod gemm;

#[cfg(test)]
pub(crate) mod testing;

pub use attention::{AttnParams, flash_attention, flash_attention_with_sinks};
pub use fp8::fp8_dequant;
pub use gather::gather_rows;
pub use moe::{ExpertAct, stack_gpt_oss_experts};
pub use moe::{
    ExpertsPath, MoePlan, MoeRouting, RouteParams, StackedExperts, moe_combine, moe_experts,
    moe_plan, moe_route,
};
pub use mxfp4::mxfp4_dequant;
pub use rmsnorm::{add_rms_norm, rms_norm};
pub use rope::{RopeParams, rope, rope_in_place};
pub use score::{PairSums, score_slots};
pub use silu_mul::silu_mul;

use candle_core::{DType, Device, Layout, Result, Tensor};
use half::{bf16, f16};

/// Elements one candle cast launch converts when [`to_dtype`] splits a cast on the GPU.
pub const CAST_CHUNK: usize = 1 << 30;

/// `t` in `dtype`, converted as `Tensor::to_dtype` converts it. candle's CUDA cast kernels
/// count elements in `unsigned int` and its launch takes the count as a `u32`
/// (candle-kernels 0.11.1 src/cast.cu, candle-core 0.11.1 cuda_backend `to_dtype`), so on a
/// GPU one cast of more than `u32::MAX` elements never ends: such a tensor is converted
/// [`CAST_CHUNK`] elements at a time into one buffer.
pub fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if t.dtype() != dtype && cast_needs_chunks(t.device().is_cuda(), t.elem_count()) {
        return cuda::to_dtype_in_chunks(t, dtype, CAST_CHUNK);
    }
    t.to_dtype(dtype)
}

/// `t` copied to `device`. From the host to a GPU through pinned staging buffers
/// ([`cuda::upload`]: several times a pageable copy's rate, the copy to the device asynchronous),
/// unless `EAGLE_CHECK_PAGEABLE=1` (the benches' comparison: candle's pageable copy); anything
/// else as candle copies it. The same bits either way.
pub fn to_device(t: &Tensor, device: &Device) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device
        && t.device().is_cpu()
        && staged_copies()
        && let Some(on_device) = cuda::upload(t, dev)?
    {
        return Ok(on_device);
    }
    t.to_device(device)
}

/// A host tensor kept to be copied to a device again and again (a streamed layer kept in host
/// memory between forwards). On a GPU its memory is page-locked where the driver allows it
/// ([`cuda::Locked`]), so that each copy goes from it to the device at the copy engines' rate
/// (53 GB/s on an H100 machine, against 8-11 GB/s through the pinned staging: BENCHMARKS.md,
/// run 66); elsewhere, or where locking failed, it is copied as [`to_device`] copies. The same
/// bits either way.
pub struct KeptHost {
    // Dropped before the tensor: unlocked (after the device's queued copies) while its memory
    // is still there.
    #[cfg(feature = "cuda")]
    locked: Option<cuda::Locked>,
    t: Tensor,
}

impl KeptHost {
    /// `t` (a host tensor) kept for copies to `device`, locked there if it is a GPU.
    pub fn new(t: Tensor, device: &Device) -> Result<KeptHost> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device
            && staged_copies()
        {
            let locked = cuda::Locked::of(&t, dev)?;
            return Ok(KeptHost { locked, t });
        }
        let _ = device;
        Ok(KeptHost {
            #[cfg(feature = "cuda")]
            locked: None,
            t,
        })
    }

    /// The bytes it holds.
    pub fn bytes(&self) -> u64 {
        (self.t.elem_count() * self.t.dtype().size_in_bytes()) as u64
    }

    /// Whether copies go from it to the device directly (its memory page-locked).
    pub fn locked(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.locked.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// A copy of it on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(dev), Some(locked)) = (device, &self.locked) {
            return locked.upload(&self.t, dev);
        }
        to_device(&self.t, device)
    }

    /// The host tensor, its memory unlocked without waiting for the device, once `copied` (a
    /// [`Mark`] made after the last copy from it was queued) has passed; `Err(self)` until then.
    pub fn release(self, copied: &Mark) -> std::result::Result<Tensor, KeptHost> {
        if !copied.passed() {
            return Err(self);
        }
        #[cfg(feature = "cuda")]
        if let Some(locked) = self.locked {
            // SAFETY: the mark passed, so the copies queued before it, every copy from this
            // memory, are over.
            unsafe { locked.unlock_copied() };
        }
        Ok(self.t)
    }
}

/// A second queue of a GPU for copies from kept host memory ([`KeptHost`]), so that the next
/// streamed layer's copies run while the device's stream computes the one before (each copy
/// otherwise waits for that compute, and that compute for nothing: BENCHMARKS.md runs 67-69,
/// where the copies and the forwards of a pass ran one after the other). Elsewhere none.
pub struct Aside {
    #[cfg(feature = "cuda")]
    stream: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
}

/// The end of copies queued on an [`Aside`]: on a GPU, the event after them that the device's
/// stream waits for before it reads them ([`Copies::ready`]).
pub struct Copies {
    #[cfg(feature = "cuda")]
    copied: Option<cudarc::driver::CudaEvent>,
}

/// Tensors copied on an [`Aside`], each beside its index among those asked for.
pub type Copied = Vec<(usize, Tensor)>;

impl Aside {
    /// A queue beside `device`'s stream where it is a GPU; none elsewhere ([`Aside::copy`]
    /// then copies nothing).
    pub fn new(device: &Device) -> Result<Aside> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device
            && staged_copies()
        {
            let ctx = dev.cuda_stream().context().clone();
            let stream = ctx.new_stream().map_err(candle_core::Error::wrap)?;
            return Ok(Aside {
                stream: Some(stream),
            });
        }
        let _ = device;
        Ok(Aside::none())
    }

    /// No queue: [`Aside::copy`] copies nothing.
    pub fn none() -> Aside {
        Aside {
            #[cfg(feature = "cuda")]
            stream: None,
        }
    }

    /// Whether it copies anything.
    pub fn active(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.stream.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Copies of the locked ones of `kept` on `device`, each beside its index in `kept`, queued
    /// on this queue behind the work queued on the device's stream so far; `None` where it
    /// copies nothing or none of them is locked (they are copied as [`KeptHost::to_device`]
    /// copies).
    pub fn copy(&self, kept: &[&KeptHost], device: &Device) -> Result<Option<(Copied, Copies)>> {
        #[cfg(feature = "cuda")]
        if let (Some(stream), Device::Cuda(dev)) = (&self.stream, device) {
            let (which, items): (Vec<usize>, Vec<_>) = kept
                .iter()
                .enumerate()
                .filter_map(|(i, k)| Some((i, (k.locked.as_ref()?, &k.t))))
                .unzip();
            if items.is_empty() {
                return Ok(None);
            }
            let (tensors, copied) = cuda::upload_aside(&items, dev, stream)?;
            let copies = Copies {
                copied: Some(copied),
            };
            return Ok(Some((which.into_iter().zip(tensors).collect(), copies)));
        }
        let _ = (kept, device);
        Ok(None)
    }
}

impl Copies {
    /// Makes `device`'s stream wait for the copies before the work queued on it next (the host
    /// does not wait).
    pub fn ready(&self, device: &Device) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let (Some(copied), Device::Cuda(dev)) = (&self.copied, device) {
            dev.cuda_stream()
                .wait(copied)
                .map_err(candle_core::Error::wrap)?;
        }
        let _ = device;
        Ok(())
    }
}

/// A point in a device's queued work: on a GPU an event recorded on the device's stream,
/// passed once the work queued before it is done; elsewhere passed when made.
pub struct Mark {
    #[cfg(feature = "cuda")]
    event: Option<cudarc::driver::CudaEvent>,
}

impl Mark {
    /// The work queued on `device` so far.
    pub fn now(device: &Device) -> Result<Mark> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            let event = dev.cuda_stream().record_event(None);
            let event = event.map_err(candle_core::Error::wrap)?;
            return Ok(Mark { event: Some(event) });
        }
        let _ = device;
        Ok(Mark {
            #[cfg(feature = "cuda")]
            event: None,
        })
    }

    /// Whether that work is done (without waiting for it).
    pub fn passed(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(event) = &self.event {
            return event.is_complete();
        }
        true
    }
}

/// The tensor of `shape` and `dtype` whose little-endian bytes are `bytes`, on `device`: on a
/// GPU copied through the pinned staging as [`to_device`] copies, else as candle reads a raw
/// buffer. The same bits either way.
pub fn bytes_to_device(
    bytes: &[u8],
    dtype: DType,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device
        && staged_copies()
        && let Some(on_device) = cuda::upload_bytes(bytes, dtype, shape.into(), dev)?
    {
        return Ok(on_device);
    }
    Tensor::from_raw_buffer(bytes, dtype, shape, device)
}

/// The bytes of a slice of numbers (every candle element type is a plain number: no padding,
/// every byte initialised).
pub(crate) fn values_as_bytes<T: candle_core::WithDType>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is an integer or float type of candle's (no padding); u8 has alignment 1 and
    // the byte slice covers exactly the slice's memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// `src` copied into `dst` (of the same length) by several threads, in pieces of 8 MiB: the
/// host's share of a copy to the device through the pinned staging. The threads are a pool of
/// their own, not rayon's global one: during a diff the capture reader keeps the global pool
/// busy with long jobs (a file's parsing and widening), and work queued behind them waits for
/// them, holding up the thread that queues the device's work (the pass set-up did: 29 ms a
/// pass at T = 2,048 on the H100, BENCHMARKS.md runs 57 and 59). Where the pool cannot be
/// made, one thread copies.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn copy_in_parallel(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    const PIECE: usize = 8 << 20;
    assert_eq!(dst.len(), src.len(), "copy_in_parallel: lengths differ");
    match copy_pool() {
        Some(pool) if src.len() > PIECE => pool.install(|| {
            dst.par_chunks_mut(PIECE)
                .zip(src.par_chunks(PIECE))
                .for_each(|(d, s)| d.copy_from_slice(s))
        }),
        _ => dst.copy_from_slice(src),
    }
}

/// The threads of [`copy_in_parallel`]: up to eight (a copy is bound by the memory's rate
/// well before that), made at the first use.
fn copy_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ec-copy-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// A tensor of `dtype` and `shape` on `device` whose values [`copy_aside`] brings later,
/// beside the device's work ([`cuda::reserve_aside`]): on a GPU with pinned staging; `None`
/// elsewhere (the caller copies as it otherwise would).
pub fn reserve_aside(device: &Device, dtype: DType, shape: &[usize]) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device
        && staged_copies()
    {
        return cuda::reserve_aside(dev, dtype, shape.into());
    }
    let _ = (device, dtype, shape);
    Ok(None)
}

/// Host bytes a copy aside takes with it, kept until it is made.
pub trait HostBytes: Send + 'static {
    fn bytes(&self) -> &[u8];
}

impl HostBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// `src` (the little-endian values of `dst`) into `dst`, a tensor of [`reserve_aside`], by a
/// thread of its own while this one goes on ([`cuda::copy_aside`]); the device's work reads
/// `dst` after a [`join_aside`] with the ticket this returns, or a later one.
pub fn copy_aside(src: Box<dyn HostBytes>, dst: &Tensor) -> Result<u64> {
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() {
        return cuda::copy_aside(src, dst);
    }
    let _ = src;
    candle_core::bail!(
        "copy_aside: a destination on {:?}, not one of reserve_aside",
        dst.device().location()
    )
}

/// The device's work from here on (this thread's) waits for this thread's [`copy_aside`]
/// copies up to `ticket` (on the device; the host waits only for their host share); nothing
/// to do off a GPU.
pub fn join_aside(device: &Device, ticket: u64) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return cuda::join_aside(dev, ticket);
    }
    let _ = (device, ticket);
    Ok(())
}

/// Whether host-to-GPU copies go through the pinned staging: unless `EAGLE_CHECK_PAGEABLE=1`.
#[cfg(feature = "cuda")]
fn staged_copies() -> bool {
    std::env::var("EAGLE_CHECK_PAGEABLE").map_or(true, |v| v.trim() != "1")
}

/// Whether one cast of `elements` would overrun candle's 32-bit element count: on a GPU, past
/// `u32::MAX` elements.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn cast_needs_chunks(on_gpu: bool, elements: usize) -> bool {
    on_gpu && elements > u32::MAX as usize
}

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

    #[test]
    fn casts_past_a_32_bit_count_are_chunked_on_the_gpu_only() {
        let last = u32::MAX as usize; // the largest count candle's cast loop reaches
        assert!(cast_needs_chunks(true, last + 1));
        assert!(!cast_needs_chunks(true, last));
        assert!(!cast_needs_chunks(false, last + 1));
    }

    /// The staging's host copies never wait for rayon's global pool: with every thread of it
    /// held by a job that ends only after the copy (as the capture reader's file jobs hold it
    /// during a diff), a copy of several pieces still ends, and copies every byte. Copying on
    /// the global pool would wait for those jobs: the test would fail after its 60 s.
    #[test]
    fn parallel_copies_do_not_wait_for_the_global_pool() {
        use crate::kernels::testing::{hold_the_global_pool, within};
        let held = hold_the_global_pool();
        let src: Vec<u8> = (0..(40usize << 20) + 13)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let outcome = within(std::time::Duration::from_secs(60), move || {
            let mut dst = vec![0u8; src.len()];
            copy_in_parallel(&mut dst, &src);
            dst == src
        });
        drop(held);
        assert_eq!(
            outcome,
            Some(true),
            "the copy waited for the global pool, or copied other bytes"
        );
    }

    /// A host tensor copied to the GPU through the pinned staging buffers holds the bits
    /// candle's own copy gives: f32, bf16, f16 and u32, sizes below one buffer, across several
    /// with a ragged last piece, and past all of them (each buffer reused once its copy is
    /// over), a view that starts inside its storage, the same values given as bytes
    /// ([`bytes_to_device`]); a dtype it does not take (u8) falls back to candle's copy.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_staged_copies_are_candles_copies() {
        let gpu = crate::kernels::testing::gpu();
        let Device::Cuda(dev) = &gpu else {
            unreachable!("testing::gpu is a CUDA device")
        };
        let buffer = 64usize << 20;
        for (n, dtype) in [
            (1, DType::F32),
            (1000, DType::BF16),
            (buffer / 4 * 2 + 3, DType::F32),
            (buffer / 2 * 5 + 1, DType::BF16),
            (buffer / 2 + 7, DType::F16),
            (4099, DType::U32),
            (100, DType::U8),
        ] {
            let values: Vec<f32> = (0..n + 5)
                .map(|i| ((i * 7919) % 100_003) as f32 - 5e4)
                .collect();
            let host = Tensor::from_vec(values, n + 5, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            for t in [host.narrow(0, 0, n).unwrap(), host.narrow(0, 5, n).unwrap()] {
                let staged = cuda::upload(&t, dev).unwrap();
                assert_eq!(
                    staged.is_some(),
                    dtype != DType::U8,
                    "{dtype:?}: staged or not"
                );
                let got = to_device(&t, &gpu).unwrap();
                let want = t.to_device(&gpu).unwrap();
                let bits = |x: &Tensor| {
                    x.to_device(&Device::Cpu)
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap()
                };
                assert_eq!(
                    (got.dtype(), got.dims()),
                    (dtype, t.dims()),
                    "{n} {dtype:?}"
                );
                assert!(
                    bits(&got) == bits(&want),
                    "{n} {dtype:?}: staged copy differs"
                );
                if let Some(staged) = staged {
                    assert!(
                        bits(&staged) == bits(&want),
                        "{n} {dtype:?}: upload differs"
                    );
                }
                // The same values given as their bytes (a capture's slots as read).
                fn le<T: candle_core::WithDType, const N: usize>(
                    t: &Tensor,
                    f: fn(T) -> [u8; N],
                ) -> Vec<u8> {
                    t.to_vec1::<T>().unwrap().into_iter().flat_map(f).collect()
                }
                let bytes = match dtype {
                    DType::F32 => Some(le(&t, f32::to_le_bytes)),
                    DType::BF16 => Some(le(&t, bf16::to_le_bytes)),
                    DType::F16 => Some(le(&t, f16::to_le_bytes)),
                    DType::U32 => Some(le(&t, u32::to_le_bytes)),
                    _ => None,
                };
                if let Some(bytes) = bytes {
                    let from_bytes = bytes_to_device(&bytes, dtype, t.dims(), &gpu).unwrap();
                    assert!(
                        bits(&from_bytes) == bits(&want),
                        "{n} {dtype:?}: bytes differ"
                    );
                }
            }
        }
    }

    /// `got` (anywhere) holds `want`'s values exactly, as f32 on the host.
    #[cfg(feature = "cuda")]
    fn assert_same_values(got: &Tensor, want: &Tensor) {
        let f32s = |t: &Tensor| {
            t.to_device(&Device::Cpu)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .unwrap()
        };
        assert!(
            f32s(got) == f32s(want),
            "{:?}: the values differ",
            want.dtype()
        );
    }

    /// A kept host tensor is locked on a GPU, and every copy of it (asked for twice, each read
    /// on the device right after) holds its bits; a slice of a tensor (a start offset) too. Its
    /// memory is unlocked when it is dropped, so it can be locked again.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_kept_host_tensors_copy_their_own_bits() {
        let dev = testing::gpu();
        let n = (96usize << 20) / 2 + 3;
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 100_003) as f32 - 5e4)
            .collect();
        let host = Tensor::from_vec(values, n, &Device::Cpu).unwrap();
        for dtype in [DType::BF16, DType::F32] {
            let t = host.to_dtype(dtype).unwrap();
            for _ in 0..2 {
                let kept = KeptHost::new(t.clone(), &dev).unwrap();
                assert!(kept.locked(), "{dtype:?}: not locked");
                assert_eq!(kept.bytes(), (n * dtype.size_in_bytes()) as u64);
                let copies: Vec<Tensor> = (0..2).map(|_| kept.to_device(&dev).unwrap()).collect();
                // Let go (unlocked without waiting) once the copies are over, its values intact.
                let copied = Mark::now(&dev).unwrap();
                let mut kept = kept;
                let back = loop {
                    match kept.release(&copied) {
                        Ok(back) => break back,
                        Err(again) => kept = again,
                    }
                    std::thread::yield_now();
                };
                assert_same_values(&back, &t);
                for c in copies {
                    assert_same_values(&c, &t);
                }
            }
        }
        let part = host.narrow(0, 5, 1000).unwrap();
        let kept = KeptHost::new(part.clone(), &dev).unwrap();
        assert_same_values(&kept.to_device(&dev).unwrap(), &part);
    }

    /// Values copied aside ([`reserve_aside`], [`copy_aside`], [`join_aside`]) are there for the
    /// device's work queued after the join, read at once: past every staging buffer with a
    /// ragged piece, in bf16 and f32, two tensors copied before one join (with the second's
    /// ticket, which covers the first).
    #[cfg(feature = "cuda")]
    #[test]
    fn device_copies_aside_arrive_before_the_work_after_the_join() {
        let gpu = testing::gpu();
        let n = (64usize << 20) / 2 * 5 + 1;
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 100_003) as f32 - 5e4)
            .collect();
        let host = Tensor::from_vec(values, n, &Device::Cpu).unwrap();
        let (mut copies, mut last) = (Vec::new(), 0);
        for dtype in [DType::BF16, DType::F32] {
            let t = host.to_dtype(dtype).unwrap();
            let bytes = match dtype {
                DType::BF16 => values_as_bytes(&t.to_vec1::<bf16>().unwrap()).to_vec(),
                _ => values_as_bytes(&t.to_vec1::<f32>().unwrap()).to_vec(),
            };
            let dst = reserve_aside(&gpu, dtype, &[n])
                .unwrap()
                .expect("pinned staging");
            last = copy_aside(Box::new(bytes), &dst).unwrap();
            copies.push((t, dst));
        }
        join_aside(&gpu, last).unwrap();
        // Queued right after the join, on the device's stream.
        let sums: Vec<Tensor> = copies
            .iter()
            .map(|(_, d)| d.to_dtype(DType::F64).unwrap().sum_all().unwrap())
            .collect();
        for ((t, d), sum) in copies.iter().zip(sums) {
            let want = t.to_dtype(DType::F64).unwrap().sum_all().unwrap();
            assert_eq!(
                sum.to_scalar::<f64>().unwrap(),
                want.to_scalar::<f64>().unwrap(),
                "{:?}",
                t.dtype()
            );
            assert_same_values(d, t);
        }
        // Off a GPU nothing is reserved, and a copy aside is refused.
        assert!(
            reserve_aside(&Device::Cpu, DType::F32, &[4])
                .unwrap()
                .is_none()
        );
        assert!(
            copy_aside(
                Box::new(vec![0u8; 16]),
                &Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()
            )
            .is_err()
        );
    }

    /// A copy aside is made by the copier's thread: the thread that asks for it goes on at
    /// once, even while the copier is held inside the copy's host share (the source's bytes),
    /// and a join then waits for the copy. Were the copy made on the asking thread, the ask
    /// would wait for the source, which only that thread opens: the test fails after 60 s.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_a_copy_aside_leaves_the_asking_thread_free() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Condvar, Mutex};
        type Gate = Arc<(Mutex<bool>, Condvar)>;
        /// Bytes whose reads after the first (the ask's length check) wait for the gate.
        struct Held {
            bytes: Vec<u8>,
            reads: AtomicUsize,
            gate: Gate,
        }
        impl HostBytes for Held {
            fn bytes(&self) -> &[u8] {
                if self.reads.fetch_add(1, Ordering::SeqCst) > 0 {
                    let (open, changed) = &*self.gate;
                    let mut open = open.lock().unwrap();
                    while !*open {
                        open = changed.wait(open).unwrap();
                    }
                }
                &self.bytes
            }
        }
        let checked = testing::within(std::time::Duration::from_secs(60), || {
            let gpu = testing::gpu();
            let n = (96usize << 20) / 4 + 3;
            let values: Vec<f32> = (0..n).map(|i| (i % 1_000_003) as f32).collect();
            let dst = reserve_aside(&gpu, DType::F32, &[n])
                .unwrap()
                .expect("pinned staging");
            let gate: Gate = Arc::new((Mutex::new(false), Condvar::new()));
            let src = Held {
                bytes: values_as_bytes(&values).to_vec(),
                reads: AtomicUsize::new(0),
                gate: gate.clone(),
            };
            let ticket = copy_aside(Box::new(src), &dst).unwrap();
            *gate.0.lock().unwrap() = true;
            gate.1.notify_all();
            join_aside(&gpu, ticket).unwrap();
            dst.to_vec1::<f32>().unwrap() == values
        });
        assert_eq!(checked, Some(true), "None: the ask waited for its own copy");
    }

    /// The chunked cast gives candle's cast bit for bit: ragged tails, one chunk, chunks of a
    /// few elements, every dtype pair the loader converts.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_chunked_casts_match_candle() {
        let gpu = testing::gpu();
        let bits = |t: &Tensor| -> Vec<u32> {
            let t = t
                .to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        };
        let cases: [(&[usize], usize); 4] = [
            (&[7, 129], 64),
            (&[3, 5, 1001], 1000),
            (&[4096], 4096),
            (&[10], 3),
        ];
        for (shape, chunk) in cases {
            for (from, to) in [
                (DType::F32, DType::BF16),
                (DType::BF16, DType::F32),
                (DType::F16, DType::BF16),
                (DType::F32, DType::F16),
            ] {
                let t = Tensor::randn(0f32, 3.0, shape, &gpu)
                    .unwrap()
                    .to_dtype(from)
                    .unwrap();
                let got = cuda::to_dtype_in_chunks(&t, to, chunk).unwrap();
                assert_eq!((got.dims(), got.dtype()), (shape, to));
                let (got, want) = (bits(&got), bits(&t.to_dtype(to).unwrap()));
                if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                    panic!(
                        "{shape:?} {from:?} -> {to:?} in chunks of {chunk}: element {i}: got {} \
                         want {}",
                        f32::from_bits(got[i]),
                        f32::from_bits(want[i])
                    );
                }
            }
        }
    }

    /// A tensor of more than 2^32 elements converts (one candle cast of it never ends), and
    /// every chunk's first and last elements, and the tail, land where they belong.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_casts_past_a_32_bit_count() {
        let gpu = testing::gpu();
        let Device::Cuda(dev) = &gpu else {
            unreachable!("cuda_device gives a CUDA device")
        };
        let n = u32::MAX as usize + 1 + 77;
        // The source: one random block repeated (filling it through candle would itself run
        // elementwise kernels over n elements); its length shares no factor with the chunk's.
        let period = (1 << 20) + 7;
        let block = Tensor::randn(0f32, 1.0, period, &gpu).unwrap();
        let src = cuda::tensor(cuda::alloc(dev, DType::F32, n).unwrap(), n);
        let (dst, from) = (
            cuda::tensor_ptr(&src).unwrap(),
            cuda::tensor_ptr(&block).unwrap(),
        );
        for start in (0..n).step_by(period) {
            let len = period.min(n - start);
            cuda::copy_raw(dev, dst + 4 * start as u64, from, 4 * len).unwrap();
        }
        let got = to_dtype(&src, DType::BF16).unwrap();
        assert_eq!((got.elem_count(), got.dtype()), (n, DType::BF16));
        let want = block
            .to_dtype(DType::BF16)
            .unwrap()
            .to_vec1::<bf16>()
            .unwrap();
        let mut at: Vec<usize> = (0..=n / CAST_CHUNK)
            .flat_map(|c| {
                [
                    c * CAST_CHUNK,
                    c * CAST_CHUNK + 1,
                    (c * CAST_CHUNK).max(2) - 2,
                ]
            })
            .chain([n - 2, n - 1, period * 1000 + 3])
            .filter(|&i| i < n)
            .collect();
        at.sort_unstable();
        at.dedup();
        for i in at {
            let v = got
                .narrow(0, i, 2.min(n - i))
                .unwrap()
                .to_vec1::<bf16>()
                .unwrap();
            for (j, g) in v.iter().enumerate() {
                let w = want[(i + j) % period];
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "element {}: got {g} want {w}",
                    i + j
                );
            }
        }
    }

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
