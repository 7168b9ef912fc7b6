//! The CUDA machinery of [`crate::kernels`]: the modules of `kernels/*.cu` (fatbins compiled by
//! build.rs: machine code for the GPUs the build targets, PTX for any other) loaded once per
//! device context ([`Module`], one registration line per file), the `launch!` macro and the
//! launch-configuration helpers every op's launch uses, device buffers (allocation, raw
//! pointers, copies), TMA tensor maps for the Hopper kernels, and device set-up. Each op's
//! arguments and launch live in its own room (`kernels::X::launch`, e.g.
//! [`crate::kernels::rmsnorm::launch`]); which path an op takes on which device is
//! [`crate::kernels::dispatch`].
//!
//! Every launch runs on the device's candle stream, so it is ordered with candle's own ops.
//! Sizes are checked (i32/i64 range, grid limits) before anything is launched, and every
//! launch's result is checked. Pointers are the caller's responsibility: each `*Args` field
//! says the shape its buffer must have.

use super::{KernelDType, to_i32};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::{DType, Result};
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, DevicePtr, LaunchConfig};
use cudarc::nvrtc::Ptx;
use std::sync::{Arc, Mutex};

/// A raw device address (`CUdeviceptr`).
pub type DevPtr = u64;

/// Declares [`Module`], one module per `.cu` file, from one line per file: the variant and the
/// file's stem; its images are build.rs's `{stem}.fatbin` and `{stem}.ptx`.
macro_rules! modules {
    ($($module:ident => $stem:literal,)*) => {
        /// One module per `.cu` file.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Module {
            $($module,)*
        }

        impl Module {
            /// Every module, in registration order.
            #[cfg_attr(not(test), allow(dead_code))]
            const ALL: &[Module] = &[$(Module::$module,)*];

            /// The `.cu` file's stem, for messages.
            fn stem(self) -> &'static str {
                match self {
                    $(Module::$module => $stem,)*
                }
            }

            /// nvcc's fatbin of the file ([`fatbin_entries`] reads what it holds).
            fn image(self) -> &'static [u8] {
                match self {
                    $(Module::$module => {
                        include_bytes!(concat!(env!("OUT_DIR"), "/", $stem, ".fatbin"))
                    })*
                }
            }

            /// The file's PTX alone, loaded where the driver refuses [`Module::image`].
            fn ptx(self) -> &'static str {
                match self {
                    $(Module::$module => {
                        include_str!(concat!(env!("OUT_DIR"), "/", $stem, ".ptx"))
                    })*
                }
            }
        }
    };
}

// A new kernel file registers here, in one line; its launch lives in its room.
modules! {
    Attention => "attention",
    AttentionSm90 => "attention_sm90",
    ExpertAct => "expert_act",
    Fp8 => "fp8_dequant",
    MoeGemmSm90 => "moe_gemm_sm90",
    Mxfp4 => "mxfp4",
    Gather => "gather",
    Moe => "moe",
    Rmsnorm => "rmsnorm",
    Rope => "rope",
    Score => "score",
    SiluMul => "silu_mul",
}

/// The modules loaded so far, per device context (its handle): candle's own cache of custom
/// modules takes PTX text only, and a fatbin is bytes.
type Loaded = Vec<(usize, Module, Arc<CudaModule>)>;
static LOADED: Mutex<Loaded> = Mutex::new(Vec::new());

/// The function `name` of `module`, loading the module on first use in this device's context.
/// The driver takes the fatbin's machine code for the device where it holds some, and compiles
/// its PTX otherwise (said once per module under `EAGLE_CHECK_TRACE`).
pub(crate) fn function(dev: &CudaDevice, module: Module, name: &str) -> Result<CudaFunction> {
    let loaded = loaded_module(dev, module)?;
    loaded.load_function(name).map_err(|e| {
        candle_core::Error::Msg(format!("kernel {name} of {}.cu: {e:?}", module.stem()))
    })
}

fn loaded_module(dev: &CudaDevice, module: Module) -> Result<Arc<CudaModule>> {
    let stream = dev.cuda_stream();
    let context = stream.context();
    // The context's handle, not the `Arc`'s address: every `CudaDevice` of one ordinal shares
    // its primary context, so they share its modules (the cached module keeps it retained).
    let key = context.cu_ctx() as usize;
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, _, m)) = loaded.iter().find(|(k, m, _)| *k == key && *m == module) {
        return Ok(m.clone());
    }
    let (major, minor) = context
        .compute_capability()
        .map_err(candle_core::Error::wrap)?;
    let arch = u32::try_from(10 * major + minor).unwrap_or(0);
    let machine_code = fatbin_entries(module.image()).is_some_and(|e| {
        e.iter()
            .any(|e| e.kind == EntryKind::MachineCode && e.arch == arch)
    });
    if !machine_code {
        crate::progress::trace(|| {
            format!(
                "kernels: {}.cu has no machine code for sm_{arch}; the driver compiles its PTX",
                module.stem()
            )
        });
    }
    let m = load_either(module, |image| match image {
        // The driver reads the fatbin in place: give it a heap copy (malloc's alignment; the
        // embedded bytes are aligned to 1).
        Image::Fatbin(bytes) => context.load_module(Ptx::from_binary(bytes.to_vec())),
        Image::Ptx(text) => context.load_module(Ptx::from_src(text)),
    })?;
    loaded.push((key, module, m.clone()));
    Ok(m)
}

/// The two forms of a module build.rs writes.
#[derive(Debug, Clone, Copy)]
enum Image {
    Fatbin(&'static [u8]),
    Ptx(&'static str),
}

/// `load` of the module's fatbin, else of its PTX (a driver that refuses the fatbin still
/// compiles the PTX, as every process did before the fatbins); the error names both refusals.
fn load_either<T, E: std::fmt::Debug>(
    module: Module,
    mut load: impl FnMut(Image) -> std::result::Result<T, E>,
) -> Result<T> {
    let refused = match load(Image::Fatbin(module.image())) {
        Ok(loaded) => return Ok(loaded),
        Err(e) => e,
    };
    crate::progress::trace(|| {
        format!(
            "kernels: the driver refused {}.cu's fatbin ({refused:?}); loading its PTX",
            module.stem()
        )
    });
    load(Image::Ptx(module.ptx())).map_err(|e| {
        candle_core::Error::Msg(format!(
            "loading kernels/{}.cu: the fatbin: {refused:?}; the PTX: {e:?}",
            module.stem()
        ))
    })
}

/// What an entry of a fatbin holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryKind {
    Ptx,
    MachineCode,
    Other(u16),
}

/// One entry of a fatbin: its kind and the architecture it is for (`10 * major + minor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FatbinEntry {
    kind: EntryKind,
    arch: u32,
}

/// The entries of an nvcc fatbin, `None` where `image` is not one. The layout, as nvcc 13.0
/// writes it (`nvcc -fatbin`, read back with `cuobjdump -lelf -lptx`): a 16-byte header (magic
/// `0xBA55ED50` as u32, version u16, header size u16, payload size u64), then the entries, each
/// a header (kind u16: 1 PTX, 2 ELF machine code; its header size u32 at byte 4; its payload
/// size u64 at byte 8; the architecture u32 at byte 28) followed by its payload. All
/// little-endian.
fn fatbin_entries(image: &[u8]) -> Option<Vec<FatbinEntry>> {
    let u16_at = |at: usize| Some(u16::from_le_bytes(image.get(at..at + 2)?.try_into().ok()?));
    let u32_at = |at: usize| Some(u32::from_le_bytes(image.get(at..at + 4)?.try_into().ok()?));
    let u64_at = |at: usize| Some(u64::from_le_bytes(image.get(at..at + 8)?.try_into().ok()?));
    if u32_at(0)? != 0xBA55_ED50 {
        return None;
    }
    let header = usize::from(u16_at(6)?);
    let end = header.checked_add(usize::try_from(u64_at(8)?).ok()?)?;
    if end > image.len() {
        return None;
    }
    let mut entries = Vec::new();
    let mut at = header;
    while at < end {
        let kind = match u16_at(at)? {
            1 => EntryKind::Ptx,
            2 => EntryKind::MachineCode,
            k => EntryKind::Other(k),
        };
        let entry_header = usize::try_from(u32_at(at + 4)?).ok()?;
        let payload = usize::try_from(u64_at(at + 8)?).ok()?;
        entries.push(FatbinEntry {
            kind,
            arch: u32_at(at + 28)?,
        });
        let next = at.checked_add(entry_header)?.checked_add(payload)?;
        if next <= at || next > end {
            return None;
        }
        at = next;
    }
    Some(entries)
}

/// Pushes each argument (by reference; each lives until the end of the enclosing block) and
/// launches `$func` on the device's stream.
macro_rules! launch {
    ($dev:expr, $func:expr, $name:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        use cudarc::driver::PushKernelArg;
        let stream = $dev.cuda_stream();
        let mut builder = stream.launch_builder(&$func);
        $(
            let arg = $arg;
            builder.arg(&arg);
        )*
        // SAFETY: the argument list matches the kernel's signature (kernels/*.cu, checked by the
        // device tests); buffer sizes are the caller's contract, documented on each `*Args`.
        unsafe { builder.launch($cfg) }
            .map_err(|e| candle_core::Error::Msg(format!("launching {}: {e:?}", $name)))?;
    }};
}
pub(crate) use launch;

pub(crate) fn grid_dim(n: usize, what: &str) -> Result<u32> {
    if n == 0 || n > i32::MAX as usize {
        candle_core::bail!("{what}: grid of {n} blocks is outside 1..=2^31-1");
    }
    Ok(n as u32)
}

pub(crate) fn grid_dim_yz(n: usize, what: &str) -> Result<u32> {
    if n == 0 || n > 65_535 {
        candle_core::bail!("{what}: grid dimension {n} is outside 1..=65535");
    }
    Ok(n as u32)
}

pub(crate) fn cfg(grid: (u32, u32, u32), threads: u32, smem: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: u32::try_from(smem)
            .map_err(|_| candle_core::Error::Msg(format!("{smem} bytes of shared memory")))?,
    })
}

/// Threads for a block that walks one row of `cols` elements in 16-byte vectors: one warp for
/// short rows, up to 1024.
pub(crate) fn row_threads(cols: usize, elem_size: usize) -> u32 {
    let vectors = cols.div_ceil(16 / elem_size);
    (vectors.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Raises a function's dynamic shared-memory limit when a launch needs more than the default
/// 48 KiB.
pub(crate) fn allow_shared_memory(func: &CudaFunction, bytes: usize, name: &str) -> Result<()> {
    if bytes <= 48 * 1024 {
        return Ok(());
    }
    let bytes = to_i32(bytes, "shared memory bytes")?;
    // SAFETY: a valid function handle, and an attribute the driver range-checks.
    unsafe {
        cudarc::driver::result::function::set_function_attribute(
            func.cu_function(),
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes,
        )
    }
    .map_err(|e| candle_core::Error::Msg(format!("{name}: {bytes} bytes of shared memory: {e:?}")))
}

/// Copies `bytes` from `src` to `dst` on the device's stream (ordered with the kernels).
pub fn copy_raw(dev: &CudaDevice, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
    // SAFETY: the caller passes two device ranges of `bytes` each, live until the copy is done
    // (frees are ordered after it on the same stream).
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, dev.cuda_stream().cu_stream())
    }
    .map_err(|e| candle_core::Error::Msg(format!("device copy of {bytes} bytes: {e:?}")))
}

/// `t` converted to `dtype` by candle's cast, `chunk` elements a launch, into one buffer of
/// `t`'s shape ([`super::to_dtype`] says why). `t` must be contiguous, as loaded weights are.
pub fn to_dtype_in_chunks(
    t: &candle_core::Tensor,
    dtype: DType,
    chunk: usize,
) -> Result<candle_core::Tensor> {
    let candle_core::Device::Cuda(dev) = t.device() else {
        candle_core::bail!(
            "a chunked cast takes a CUDA tensor, not one on {:?}",
            t.device()
        );
    };
    if !t.is_contiguous() || chunk == 0 {
        candle_core::bail!("a chunked cast takes a contiguous tensor and chunks of at least one");
    }
    let n = t.elem_count();
    let flat = t.flatten_all()?;
    let out = tensor(alloc(dev, dtype, n)?, n);
    let (dst, size) = (tensor_ptr(&out)?, dtype.size_in_bytes());
    for start in (0..n).step_by(chunk) {
        let len = chunk.min(n - start);
        let part = flat.narrow(0, start, len)?.to_dtype(dtype)?;
        copy_raw(
            dev,
            dst + (start * size) as u64,
            tensor_ptr(&part)?,
            len * size,
        )?;
    }
    out.reshape(t.shape())
}

/// The device address of element `offset` of a storage (its start plus `offset` elements).
pub fn storage_ptr(s: &CudaStorage, offset: usize) -> Result<DevPtr> {
    let stream = s.device.cuda_stream();
    let (base, size) = match &s.slice {
        CudaStorageSlice::U8(x) => (x.device_ptr(&stream).0, 1),
        CudaStorageSlice::F8E4M3(x) => (x.device_ptr(&stream).0, 1),
        CudaStorageSlice::U32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::I32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::I64(x) => (x.device_ptr(&stream).0, 8),
        CudaStorageSlice::BF16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::F16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::F32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::F64(x) => (x.device_ptr(&stream).0, 8),
        other => candle_core::bail!("no kernel takes a {other:?} storage"),
    };
    let bytes = offset
        .checked_mul(size)
        .ok_or_else(|| candle_core::Error::Msg(format!("offset {offset} overflows")))?;
    Ok(base + bytes as u64)
}

/// An uninitialised device buffer of `n` elements of `dtype` (at least one, so that a pointer
/// exists even for empty outputs).
pub fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    let n = n.max(1);
    // SAFETY: every caller writes the elements it exposes before they are read.
    let slice = unsafe {
        match dtype {
            DType::F32 => CudaStorageSlice::F32(dev.alloc::<f32>(n)?),
            DType::F16 => CudaStorageSlice::F16(dev.alloc::<half::f16>(n)?),
            DType::BF16 => CudaStorageSlice::BF16(dev.alloc::<half::bf16>(n)?),
            DType::F64 => CudaStorageSlice::F64(dev.alloc::<f64>(n)?),
            DType::U32 => CudaStorageSlice::U32(dev.alloc::<u32>(n)?),
            DType::I32 => CudaStorageSlice::I32(dev.alloc::<i32>(n)?),
            other => candle_core::bail!("kernels allocate no {other:?} buffers"),
        }
    };
    let storage = CudaStorage {
        slice,
        device: dev.clone(),
    };
    #[cfg(test)]
    poison(&storage, n * dtype.size_in_bytes())?;
    Ok(storage)
}

/// Fills a fresh test buffer with 0xff bytes (NaN in every float type, -1 in every integer
/// type), so an output the kernel failed to write cannot pass for a result: a fresh device
/// allocation may reuse memory that still holds a previous run's correct values.
#[cfg(test)]
fn poison(s: &CudaStorage, bytes: usize) -> Result<()> {
    let ptr = storage_ptr(s, 0)?;
    let stream = s.device.cuda_stream();
    // SAFETY: `ptr` is the start of a live allocation of at least `bytes` bytes on this stream.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xff, bytes, stream.cu_stream()) }
        .map_err(|e| candle_core::Error::Msg(format!("poisoning a test buffer: {e:?}")))
}

/// A TMA tensor map (`CUtensorMap`), passed by value to the Hopper kernels.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct TensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: a plain 128-byte, 128-aligned value that the kernel takes by value
// (`const __grid_constant__ CUtensorMap`); the launch copies it from this address.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

/// The map of a `[rows, cols]` matrix of `dtype` at `base` (row stride `stride` elements) that
/// the Hopper kernels read in boxes of 64 columns (128 bytes) x `box_rows` rows with the 128-byte
/// swizzle; reads outside the matrix fill zeros.
pub fn tensor_map(
    dtype: KernelDType,
    base: DevPtr,
    cols: usize,
    rows: usize,
    stride: usize,
    box_rows: usize,
) -> Result<TensorMap> {
    use cudarc::driver::sys;
    let data_type = match dtype {
        KernelDType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        KernelDType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        KernelDType::F32 => candle_core::bail!("tensor map: the Hopper kernels take bf16 or f16"),
    };
    let row_bytes = stride
        .checked_mul(dtype.size())
        .filter(|b| b.is_multiple_of(16) && *b < 1 << 40)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!("tensor map: row stride {stride} elements"))
        })?;
    if !base.is_multiple_of(16) || cols == 0 || rows == 0 || cols > stride {
        candle_core::bail!(
            "tensor map: base {base:#x}, {rows} x {cols} at stride {stride} is not a TMA matrix"
        );
    }
    if !(1..=256).contains(&box_rows) {
        candle_core::bail!("tensor map: a box of {box_rows} rows (TMA takes 1..=256)");
    }
    let dims = [cols as u64, rows as u64];
    let strides = [row_bytes as u64];
    let boxes = [64u32, box_rows as u32];
    let element_strides = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every array has the rank's length (2, and 1 stride); the driver only encodes the
    // map (no device access) and checks the values it is given.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            2,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    status.result().map_err(|e| {
        candle_core::Error::Msg(format!(
            "tensor map of {rows} x {cols} (stride {stride}, box {box_rows}): {e:?}"
        ))
    })?;
    // SAFETY: cuTensorMapEncodeTiled succeeded, so it wrote the whole map.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// Device `ordinal` as the runner uses it: one stream, so no cross-stream events (each costs a
/// driver call per tensor access), and freed memory kept for reuse ([`keep_freed_memory`]).
pub fn open_device(ordinal: usize) -> Result<CudaDevice> {
    use candle_core::backend::BackendDevice;
    let dev = CudaDevice::new(ordinal)?;
    // SAFETY: every tensor of a runner lives and is used on this device's one stream; the one
    // exception, the copies from kept host memory on a second stream, orders itself with
    // events ([`upload_aside`]).
    unsafe { dev.disable_event_tracking() };
    keep_freed_memory(&dev, true)?;
    Ok(dev)
}

/// Whether the device's stream-ordered memory pool keeps the memory freed into it.
///
/// candle allocates with `cuMemAllocAsync` from the device's default pool, whose release
/// threshold is 0: at every synchronisation the pool hands its unused memory back to the
/// driver and the next allocations map it again. A capture synchronises between forwards (and
/// a MoE layer once, to read its expert counts), so each stretch after one maps its buffers
/// afresh; PyTorch's caching allocator keeps such memory. `keep` sets the threshold to its
/// maximum (the pool keeps what it reserved: at most the most memory ever in use at once, and
/// reuses it) or back to the driver's 0. Device memory sampled as `total - free` then reads
/// that reservation, which is at least the memory in use.
pub fn keep_freed_memory(dev: &CudaDevice, keep: bool) -> Result<()> {
    use cudarc::driver::{result, sys};
    let cu_device = dev.cuda_stream().context().cu_device();
    let mut threshold: u64 = if keep { u64::MAX } else { 0 };
    // SAFETY: `cu_device` belongs to a live context; the release threshold is a u64 attribute.
    unsafe {
        let pool =
            result::device::get_default_mem_pool(cu_device).map_err(candle_core::Error::wrap)?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .map_err(candle_core::Error::wrap)
    }
}

/// An event with timing, recorded on `dev`'s stream (this thread's): it passes when the work
/// queued there so far is done ([`crate::model::phases`]' timeline).
pub fn timed_event(dev: &CudaDevice) -> Result<cudarc::driver::CudaEvent> {
    let stream = dev.cuda_stream();
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let event = stream
        .context()
        .new_event(timed)
        .map_err(candle_core::Error::wrap)?;
    event.record(&stream).map_err(candle_core::Error::wrap)?;
    Ok(event)
}

/// True when a CUDA driver and at least one device are present (asking candle for a device
/// without a driver panics, so callers check first).
pub fn device_available() -> bool {
    cudarc::driver::result::init().is_ok()
        && cudarc::driver::result::device::get_count().is_ok_and(|n| n > 0)
}

/// The device address of `t`'s first element (its layout's start offset). The address stays
/// valid while `t` lives; the caller checks that the layout is what its kernel reads.
pub fn tensor_ptr(t: &candle_core::Tensor) -> Result<DevPtr> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cuda(s) => storage_ptr(s, layout.start_offset()),
        _ => candle_core::bail!(
            "expected a CUDA tensor, found one on {:?}",
            t.device().location()
        ),
    }
}

/// A tensor over a storage this module filled (contiguous, no gradient).
pub fn tensor(s: CudaStorage, shape: impl Into<candle_core::Shape>) -> candle_core::Tensor {
    candle_core::Tensor::from_storage(
        candle_core::Storage::Cuda(s),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    )
}

/// Bytes of each pinned staging buffer of [`upload`], and how many a thread keeps: a copy
/// fills one while the device reads the others.
const STAGING_BYTES: usize = 64 << 20;
const STAGING_BUFFERS: usize = 4;

/// Pinned host buffers a thread copies host tensors to the device through, each with the
/// event of the last copy out of it.
struct Staging {
    bufs: Vec<(
        cudarc::driver::PinnedHostSlice<u8>,
        cudarc::driver::CudaEvent,
    )>,
    next: usize,
}

type StagingSlot = Option<(std::sync::Arc<cudarc::driver::CudaContext>, Option<Staging>)>;

thread_local! {
    /// This thread's staging buffers and the context they belong to, made at its first
    /// [`upload`] (each thread that makes device calls has its own: none is shared between
    /// threads); `None` beside the context when the driver gave no pinned memory.
    static STAGING: std::cell::RefCell<StagingSlot> = const { std::cell::RefCell::new(None) };
}

/// `t` (on the host, contiguous) copied to `dev` through this thread's pinned staging buffers:
/// each piece copied into a pinned buffer (in parallel, by [`super::copy_in_parallel`]'s
/// threads: plain memory copies, no device call) and from there to the device asynchronously
/// on the device's stream, so that the thread goes on filling the next buffer while the
/// device reads this one, and a copy waits only for the work queued before it, not for the
/// host. A pageable copy (`Tensor::to_device`) goes through the driver's own small staging at
/// about 4 GB/s on the H100 machines, one buffer at a time (BENCHMARKS.md, run 42: a streamed
/// 21.4 GiB MoE layer put on the device in 5.3 s). `None` when `t` is not a host tensor of a
/// dtype the staging takes, or the driver gave this thread no pinned memory (the caller copies
/// it as candle does).
pub fn upload(t: &candle_core::Tensor, dev: &CudaDevice) -> Result<Option<candle_core::Tensor>> {
    with_host_bytes(t, |src, dtype| {
        upload_bytes(src, dtype, t.shape().clone(), dev)
    })
    .map(Option::flatten)
}

/// `f` over the bytes of `t`'s values and their type, where `t` is a contiguous host tensor of
/// a type the copies take (f32, f16, bf16, f64, u32, i32); `None` otherwise.
fn with_host_bytes<T>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[u8], DType) -> Result<T>,
) -> Result<Option<T>> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Ok(None);
    };
    if !layout.is_contiguous() {
        return Ok(None);
    }
    use super::values_as_bytes as bytes_of;
    use candle_core::CpuStorage as C;
    let (all, dtype) = match cpu {
        C::F32(v) => (bytes_of(v), DType::F32),
        C::F16(v) => (bytes_of(v), DType::F16),
        C::BF16(v) => (bytes_of(v), DType::BF16),
        C::F64(v) => (bytes_of(v), DType::F64),
        C::U32(v) => (bytes_of(v), DType::U32),
        C::I32(v) => (bytes_of(v), DType::I32),
        _ => return Ok(None),
    };
    let (n, size) = (layout.shape().elem_count(), dtype.size_in_bytes());
    let start = layout.start_offset() * size;
    let Some(src) = all.get(start..start + n * size) else {
        candle_core::bail!("a host tensor's layout past its storage");
    };
    f(src, dtype).map(Some)
}

/// A host tensor's memory page-locked for a context (`cuMemHostRegister`): copies from it to
/// the device are the copy engines' own, asynchronous, with no staging (run 66 on an H100
/// machine: locking at 18.8 GB/s, copies from locked memory at 53 GB/s, against 6.7-8.4 GB/s
/// pageable; `benches/gpu/h2d.py`, BENCHMARKS.md run 66). Unlocked when dropped, once the
/// context's work is done (a copy from it may still be queued).
pub struct Locked {
    ptr: *mut std::ffi::c_void,
    bytes: usize,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    /// Unlocked already ([`Locked::unlock_copied`]).
    unlocked: bool,
}

// SAFETY: `ptr` is a host address the driver knows as locked; nothing reads or writes through
// it here (the copies read the tensor's own storage, which the holder keeps alive and never
// writes), and unlocking it is a driver call valid from any thread with the context bound.
unsafe impl Send for Locked {}
unsafe impl Sync for Locked {}

impl Locked {
    /// `t`'s memory locked for `dev`'s context; `None` where `t` is not a host tensor of a type
    /// the copies take, is empty, or the driver would not lock it (the caller copies it
    /// through the staging instead).
    pub fn of(t: &candle_core::Tensor, dev: &CudaDevice) -> Result<Option<Locked>> {
        let ctx = dev.cuda_stream().context().clone();
        let locked = with_host_bytes(t, |src, _| {
            if src.is_empty() {
                return Ok(None);
            }
            ctx.bind_to_thread().map_err(candle_core::Error::wrap)?;
            let ptr = src.as_ptr().cast_mut().cast::<std::ffi::c_void>();
            // SAFETY: `ptr..ptr + len` is the tensor's live storage, which the caller keeps for
            // as long as the returned `Locked` (dropped first: `KeptHost` holds both).
            let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr, src.len(), 0) };
            if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                crate::progress::trace(|| {
                    format!("could not lock {} bytes of host memory ({r:?})", src.len())
                });
                return Ok(None);
            }
            Ok(Some(Locked {
                ptr,
                bytes: src.len(),
                ctx: ctx.clone(),
                unlocked: false,
            }))
        })?;
        Ok(locked.flatten())
    }

    /// Refuses `src` unless it is the memory this locks (the tensor's storage it was made for).
    fn check_covers(&self, src: &[u8]) -> Result<()> {
        if src.as_ptr() != self.ptr.cast_const().cast() || src.len() != self.bytes {
            candle_core::bail!("a locked copy of another tensor's memory");
        }
        Ok(())
    }

    /// `t` (the tensor whose memory this locks) copied to `dev` straight from it, on the
    /// device's stream: the host does not wait for the copy.
    pub fn upload(&self, t: &candle_core::Tensor, dev: &CudaDevice) -> Result<candle_core::Tensor> {
        let up = with_host_bytes(t, |src, dtype| {
            self.check_covers(src)?;
            let out = alloc(dev, dtype, t.elem_count())?;
            let stream = dev.cuda_stream();
            // SAFETY: `src` is locked host memory that outlives the copy (the holder drops
            // this `Locked`, which waits for the context's work, before the storage); the
            // destination is a fresh buffer of `src.len()` bytes.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    storage_ptr(&out, 0)?,
                    src,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| candle_core::Error::Msg(format!("copy to the device: {e:?}")))?;
            Ok(tensor(out, t.shape().clone()))
        })?;
        up.ok_or_else(|| candle_core::Error::Msg("a locked tensor is not on the host".into()))
    }
}

/// Copies of locked host tensors (`items`: each tensor and the [`Locked`] of its memory) to
/// `dev`, queued on `aside`, a second stream of the device's context, so that they run while
/// the device's stream computes. Each destination is allocated on the device's stream, where
/// the pool may hand it memory that work queued there still reads; so `aside` first waits for
/// the work queued on the device's stream so far. Returns the copies and an event recorded on
/// `aside` after them, which the device's stream must wait for before it reads them.
pub fn upload_aside(
    items: &[(&Locked, &candle_core::Tensor)],
    dev: &CudaDevice,
    aside: &Arc<CudaStream>,
) -> Result<(Vec<candle_core::Tensor>, cudarc::driver::CudaEvent)> {
    let stream = dev.cuda_stream();
    let mut outs = Vec::with_capacity(items.len());
    for (locked, t) in items {
        let out = with_host_bytes(t, |src, dtype| {
            locked.check_covers(src)?;
            alloc(dev, dtype, t.elem_count())
        })?;
        let Some(out) = out else {
            candle_core::bail!("a locked tensor is not on the host");
        };
        outs.push(out);
    }
    let wrap = candle_core::Error::wrap;
    let allocated = stream.record_event(None).map_err(wrap)?;
    aside.wait(&allocated).map_err(wrap)?;
    for (out, (locked, _)) in outs.iter().zip(items) {
        // SAFETY: `locked` covers the live storage of its tensor (checked above), which its
        // holder keeps, and unlocks, only after an event recorded behind this copy or the
        // context's work; the destination is a fresh buffer of as many bytes, free once `aside`
        // is past `allocated`.
        unsafe {
            let src =
                std::slice::from_raw_parts(locked.ptr.cast::<u8>().cast_const(), locked.bytes);
            cudarc::driver::result::memcpy_htod_async(storage_ptr(out, 0)?, src, aside.cu_stream())
        }
        .map_err(|e| candle_core::Error::Msg(format!("copy to the device: {e:?}")))?;
    }
    let copied = aside.record_event(None).map_err(wrap)?;
    let tensors = outs
        .into_iter()
        .zip(items)
        .map(|(out, (_, t))| tensor(out, t.shape().clone()))
        .collect();
    Ok((tensors, copied))
}

/// Nanoseconds spent unlocking host memory ([`Locked`]'s drop), for the trace.
static UNLOCKING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Seconds this process has spent unlocking host memory (waiting for the context's work
/// included).
pub fn unlocking_seconds() -> f64 {
    UNLOCKING.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
}

impl Locked {
    /// Unlocks the memory now, without waiting for the context's work.
    ///
    /// # Safety
    /// No copy from this memory may still be queued: the caller saw an event recorded after
    /// the last one pass ([`super::Mark`]).
    pub unsafe fn unlock_copied(mut self) {
        self.unlock(false);
    }

    fn unlock(&mut self, wait: bool) {
        if self.unlocked {
            return;
        }
        self.unlocked = true;
        let start = std::time::Instant::now();
        if self.ctx.bind_to_thread().is_ok() {
            if wait {
                let _ = self.ctx.synchronize();
            }
            // SAFETY: `ptr` was locked by `Locked::of` and is unlocked once (`unlocked`).
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr) };
        }
        let nanos = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        UNLOCKING.fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Locked {
    /// A copy from this memory may still be queued: the context's work is done first.
    fn drop(&mut self) {
        self.unlock(true);
    }
}

/// [`upload`] of `src`, the little-endian bytes of a tensor of `shape` and `dtype` (one of
/// f32, f16, bf16, f64, u32, i32) held anywhere on the host: a capture's slots as read, say.
pub fn upload_bytes(
    src: &[u8],
    dtype: DType,
    shape: candle_core::Shape,
    dev: &CudaDevice,
) -> Result<Option<candle_core::Tensor>> {
    let n = shape.elem_count();
    if src.len() != n * dtype.size_in_bytes() {
        candle_core::bail!(
            "{} bytes for {n} {dtype:?} values to copy to the device",
            src.len()
        );
    }
    let stream = dev.cuda_stream();
    with_staging(dev, |staging| {
        let out = alloc(dev, dtype, n)?;
        staged_copy(staging, src, storage_ptr(&out, 0)?, &stream)?;
        Ok(tensor(out, shape))
    })
}

/// `f` with this thread's staging buffers for `dev`'s context (made at the first call);
/// `None` where the driver gave this thread no pinned memory.
fn with_staging<T>(
    dev: &CudaDevice,
    f: impl FnOnce(&mut Staging) -> Result<T>,
) -> Result<Option<T>> {
    let stream = dev.cuda_stream();
    STAGING.with(|cell| -> Result<Option<T>> {
        let mut cell = cell.borrow_mut();
        let ctx = stream.context();
        if cell
            .as_ref()
            .is_none_or(|(c, _)| !std::sync::Arc::ptr_eq(c, ctx))
        {
            let staging = Staging::new(ctx)
                .inspect_err(|e| {
                    crate::progress::trace(|| {
                        format!(
                            "no pinned staging ({e}): copies to the device as candle makes them"
                        )
                    })
                })
                .ok();
            *cell = Some((ctx.clone(), staging));
        }
        let Some((_, Some(staging))) = cell.as_mut() else {
            return Ok(None);
        };
        f(staging).map(Some)
    })
}

/// `src` copied to the device at `dst` (a range of `src.len()` bytes) through the staging
/// buffers, each piece asynchronously on `stream`: the host waits only for the last copy out
/// of the buffer it fills next.
fn staged_copy(staging: &mut Staging, src: &[u8], dst: DevPtr, stream: &CudaStream) -> Result<()> {
    for (at, piece) in (0..src.len())
        .step_by(STAGING_BYTES)
        .map(|at| (at, &src[at..src.len().min(at + STAGING_BYTES)]))
    {
        let (buf, done) = &mut staging.bufs[staging.next];
        staging.next = (staging.next + 1) % STAGING_BUFFERS;
        // The device's last copy out of this buffer is over before it is written again.
        done.synchronize().map_err(candle_core::Error::wrap)?;
        let host = &mut buf.as_mut_slice().map_err(candle_core::Error::wrap)?[..piece.len()];
        super::copy_in_parallel(host, piece);
        // SAFETY: `host` is pinned memory that stays untouched until `done` (recorded just
        // after) has passed; `dst + at` starts a range of `piece.len()` bytes the caller owns.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst + at as u64, &*host, stream.cu_stream())
        }
        .map_err(|e| candle_core::Error::Msg(format!("staged copy to the device: {e:?}")))?;
        done.record(stream).map_err(candle_core::Error::wrap)?;
    }
    Ok(())
}

/// A device buffer of `dtype` and `shape` that [`copy_aside`] fills later, beside the device's
/// stream. Allocated on the device's stream, from its pool, which may hand out memory that work
/// still queued there last used: the copy waits for the work queued before it is asked for.
/// `None` where the context has no copier (the driver gave it no pinned staging: the caller
/// copies as it otherwise would).
pub fn reserve_aside(
    dev: &CudaDevice,
    dtype: DType,
    shape: candle_core::Shape,
) -> Result<Option<candle_core::Tensor>> {
    if Copier::of(dev.cuda_stream().context())?.is_none() {
        return Ok(None);
    }
    Ok(Some(tensor(alloc(dev, dtype, shape.elem_count())?, shape)))
}

/// `src` (the little-endian bytes of `dst`'s values) into `dst`, a tensor of
/// [`reserve_aside`], by the context's copier ([`Copier`]): this thread only queues it and
/// goes on. Its ticket, for [`join_aside`]: the device's stream reads `dst` only after a join
/// with a ticket at least this one.
pub fn copy_aside(src: Box<dyn super::HostBytes>, dst: &candle_core::Tensor) -> Result<u64> {
    let candle_core::Device::Cuda(dev) = dst.device() else {
        candle_core::bail!("copy_aside: a destination on {:?}", dst.device().location());
    };
    let bytes = dst.elem_count() * dst.dtype().size_in_bytes();
    if src.bytes().len() != bytes || !dst.is_contiguous() {
        candle_core::bail!(
            "copy_aside: {} bytes into {:?} {:?}",
            src.bytes().len(),
            dst.dtype(),
            dst.dims()
        );
    }
    let dst_ptr = tensor_ptr(dst)?;
    let stream = dev.cuda_stream();
    // Where the device's stream stands: the copy into memory its queued work may still use
    // waits for it.
    let ready = stream
        .context()
        .new_event(None)
        .map_err(candle_core::Error::wrap)?;
    ready.record(&stream).map_err(candle_core::Error::wrap)?;
    let Some(copier) = Copier::of(stream.context())? else {
        candle_core::bail!("copy_aside: no pinned staging");
    };
    let mut s = copier.lock();
    s.sent += 1;
    let ticket = s.sent;
    s.queue.push_back(CopyJob {
        ticket,
        thread: std::thread::current().id(),
        src,
        dst: dst_ptr,
        keep: dst.clone(),
        ready,
    });
    copier.changed.notify_all();
    Ok(ticket)
}

/// The device's stream (this thread's) waits, on the device, for the copies aside up to
/// `ticket` (of [`copy_aside`]); the host waits only until the copier has queued them (their
/// host share, into its pinned staging). Their destinations are released here, after the
/// wait, so that memory freed on the device's stream is not reused before a copy lands.
pub fn join_aside(dev: &CudaDevice, ticket: u64) -> Result<()> {
    let stream = dev.cuda_stream();
    // Without a copier no copy was asked for.
    let Some(copier) = Copier::of(stream.context())? else {
        return Ok(());
    };
    let (event, keep, failed) = {
        let mut s = copier.lock();
        while s.queued < ticket.min(s.sent) {
            s = copier.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        // This thread's copies up to `ticket` (another thread's are joined by its own
        // stream): the event after the last covers the others, the copier's stream running
        // them in order.
        let me = std::thread::current().id();
        let mut keep = Vec::new();
        let mut event = None;
        let mut i = 0;
        while let Some(m) = s.made.get(i).filter(|m| m.ticket <= ticket) {
            if m.thread != me {
                i += 1;
                continue;
            }
            let Some(m) = s.made.remove(i) else {
                break;
            };
            keep.push(m.keep);
            event = m.event.or(event);
        }
        (event, keep, s.failed.take())
    };
    if let Some(e) = failed {
        // The copier waited for its stream after the failure: nothing is in flight.
        drop(keep);
        candle_core::bail!("copying to the device: {e}");
    }
    if let Some(event) = event {
        stream.wait(&event).map_err(candle_core::Error::wrap)?;
    }
    drop(keep);
    Ok(())
}

/// Bytes to copy to the device and where to ([`copy_aside`]).
struct CopyJob {
    ticket: u64,
    /// The thread that asked, whose stream reads the destination.
    thread: std::thread::ThreadId,
    src: Box<dyn super::HostBytes>,
    dst: DevPtr,
    /// The destination: kept until a join has the device's stream wait for the copy, since
    /// freed before, its memory could be handed out again while the copy still writes it.
    keep: candle_core::Tensor,
    /// The device's stream's work when the copy was asked for.
    ready: cudarc::driver::CudaEvent,
}

#[derive(Default)]
struct CopierState {
    queue: std::collections::VecDeque<CopyJob>,
    /// Tickets handed out, and queued on the copier's stream.
    sent: u64,
    queued: u64,
    /// The copies queued and not yet joined.
    made: std::collections::VecDeque<Made>,
    failed: Option<String>,
}

/// A copy queued on the copier's stream: whose, the event after it (`None` where it failed),
/// its destination.
struct Made {
    ticket: u64,
    thread: std::thread::ThreadId,
    event: Option<cudarc::driver::CudaEvent>,
    keep: candle_core::Tensor,
}

/// A thread of a context's own ("ec-copier") that makes its copies aside: each piece copied
/// into its pinned staging (the host's share, a few GB/s) and from there to the device on its
/// own stream. So the thread queueing the forward queues it without stopping, and a pass's
/// captured slots, asked for as the pass starts, travel while its first layers run (at a
/// pass's first flush, on the thread queueing the forward, the device had run dry of work and
/// waited for them: 0.44 s of 3.9 at T = 512 on the H100, BENCHMARKS.md run 62). One per
/// context, living as long as the process.
struct Copier {
    ctx: Arc<cudarc::driver::CudaContext>,
    state: Mutex<CopierState>,
    changed: std::sync::Condvar,
}

impl Copier {
    /// The copier of `ctx`, started at the first ask with its stream and pinned staging;
    /// `None` where the driver gave it none (asked once per context).
    fn of(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<Option<Arc<Copier>>> {
        type Copiers = Vec<(Arc<cudarc::driver::CudaContext>, Option<Arc<Copier>>)>;
        static ALL: Mutex<Copiers> = Mutex::new(Vec::new());
        let mut all = ALL.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, c)) = all.iter().find(|(c, _)| c.cu_ctx() == ctx.cu_ctx()) {
            return Ok(c.clone());
        }
        let setup = || -> Result<(Arc<CudaStream>, Staging)> {
            let stream = ctx.new_stream().map_err(candle_core::Error::wrap)?;
            Ok((stream, Staging::new(ctx)?))
        };
        let copier = match setup() {
            Ok((stream, staging)) => {
                let copier = Arc::new(Copier {
                    ctx: ctx.clone(),
                    state: Mutex::default(),
                    changed: std::sync::Condvar::new(),
                });
                let run = copier.clone();
                std::thread::Builder::new()
                    .name("ec-copier".into())
                    .spawn(move || run.run(&stream, staging))
                    .map_err(|e| {
                        candle_core::Error::Msg(format!("could not start the copier: {e}"))
                    })?;
                Some(copier)
            }
            Err(e) => {
                crate::progress::trace(|| {
                    format!("no copier ({e}): copies to the device as candle makes them")
                });
                None
            }
        };
        all.push((ctx.clone(), copier.clone()));
        Ok(copier)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CopierState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self, stream: &CudaStream, mut staging: Staging) {
        loop {
            let job = {
                let mut s = self.lock();
                loop {
                    if let Some(job) = s.queue.pop_front() {
                        break job;
                    }
                    s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                }
            };
            // A panic here fails the copy, not the thread: a join must never wait for a
            // copier that is gone.
            let copy = std::panic::AssertUnwindSafe(|| self.copy(&job, stream, &mut staging));
            let made = match std::panic::catch_unwind(copy) {
                Ok(made) => made.map_err(|e| e.to_string()),
                Err(_) => Err("the copier panicked".to_string()),
            };
            // Nothing of this copier's stays in flight once it has failed.
            if made.is_err() {
                let _ = stream.synchronize();
            }
            let CopyJob {
                ticket,
                thread,
                keep,
                src,
                ..
            } = job;
            // The host bytes are in the staging, or on the device, by now.
            drop(src);
            let (event, failed) = match made {
                Ok(event) => (Some(event), None),
                Err(e) => (None, Some(e)),
            };
            let mut s = self.lock();
            s.queued = ticket;
            s.made.push_back(Made {
                ticket,
                thread,
                event,
                keep,
            });
            if let Some(e) = failed {
                s.failed.get_or_insert(e);
            }
            self.changed.notify_all();
        }
    }

    /// One copy queued on the copier's stream, after the work it waits for; the event after it.
    fn copy(
        &self,
        job: &CopyJob,
        stream: &CudaStream,
        staging: &mut Staging,
    ) -> Result<cudarc::driver::CudaEvent> {
        // The staging's raw copies use the thread's current context.
        self.ctx
            .bind_to_thread()
            .map_err(candle_core::Error::wrap)?;
        stream.wait(&job.ready).map_err(candle_core::Error::wrap)?;
        staged_copy(staging, job.src.bytes(), job.dst, stream)?;
        let done = self.ctx.new_event(None).map_err(candle_core::Error::wrap)?;
        done.record(stream).map_err(candle_core::Error::wrap)?;
        Ok(done)
    }
}

impl Drop for Staging {
    /// A buffer is freed only once the device's last copy out of it is over.
    fn drop(&mut self) {
        for (_, done) in &self.bufs {
            let _ = done.synchronize();
        }
    }
}

impl Staging {
    fn new(ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<Staging> {
        let blocking = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
        let bufs = (0..STAGING_BUFFERS)
            .map(|_| {
                // SAFETY: the buffer is written before any copy reads it (`upload` copies only
                // the bytes it wrote).
                let buf = unsafe { ctx.alloc_pinned::<u8>(STAGING_BYTES) }
                    .map_err(candle_core::Error::wrap)?;
                let done = ctx.new_event(blocking).map_err(candle_core::Error::wrap)?;
                Ok((buf, done))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Staging { bufs, next: 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Every module carries machine code for sm_90 (the H100 and H200) beside its PTX, so on
    /// those GPUs no module waits for the driver's compiler (seconds for attention.cu). Fails on
    /// a build made with `EAGLE_CHECK_CUDA_SASS=none`.
    #[test]
    fn every_module_holds_sm90_machine_code_and_ptx() {
        for &m in Module::ALL {
            let entries = fatbin_entries(m.image())
                .unwrap_or_else(|| panic!("{}.fatbin is not a fatbin", m.stem()));
            assert!(
                entries
                    .iter()
                    .any(|e| e.kind == EntryKind::MachineCode && e.arch == 90),
                "{}: no sm_90 machine code in {entries:?}",
                m.stem()
            );
            assert!(
                entries.iter().any(|e| e.kind == EntryKind::Ptx),
                "{}: no PTX in {entries:?}",
                m.stem()
            );
        }
    }

    /// A fatbin cut short, of another magic or with an entry running past the end reads as
    /// none, never a panic or a loop.
    #[test]
    fn a_malformed_fatbin_reads_as_none() {
        let image = Module::Gather.image();
        let entries = fatbin_entries(image).expect("gather.fatbin reads");
        assert!(entries.len() >= 2, "{entries:?}");
        assert_eq!(fatbin_entries(&image[..image.len() - 1]), None, "cut short");
        assert_eq!(fatbin_entries(&image[..40]), None, "header only");
        let mut other = image.to_vec();
        other[0] ^= 1;
        assert_eq!(fatbin_entries(&other), None, "another magic");
        // The first entry's payload size: one byte past the end, and so large that the sum
        // overflows.
        let first_size = u64::from_le_bytes(image[24..32].try_into().unwrap());
        let container = u64::from_le_bytes(image[8..16].try_into().unwrap());
        for (size, what) in [
            (container + 1, "one past the end"),
            (u64::MAX, "overflowing"),
        ] {
            assert!(size > first_size);
            let mut past = image.to_vec();
            past[24..32].copy_from_slice(&size.to_le_bytes());
            assert_eq!(fatbin_entries(&past), None, "an entry {what}");
        }
        assert_eq!(fatbin_entries(&[]), None, "empty");
    }

    /// A fatbin the driver refuses falls back to the module's PTX; where both are refused the
    /// error names both.
    #[test]
    fn a_refused_fatbin_falls_back_to_the_ptx() {
        let mut tried = Vec::new();
        let loaded = load_either(Module::Score, |image| match image {
            Image::Fatbin(_) => {
                tried.push("fatbin");
                Err("no fatbins here")
            }
            Image::Ptx(text) => {
                tried.push("ptx");
                Ok(text.len())
            }
        })
        .expect("the PTX loads");
        assert_eq!(loaded, Module::Score.ptx().len());
        assert_eq!(tried, ["fatbin", "ptx"]);
        assert!(Module::Score.ptx().contains(".entry score_finish"));
        let first = load_either(Module::Score, |image| match image {
            Image::Fatbin(bytes) => Ok(bytes.len()),
            Image::Ptx(_) => Err("not asked"),
        });
        assert_eq!(
            first.expect("the fatbin loads"),
            Module::Score.image().len()
        );
        let neither = load_either(Module::Gather, |_| Err::<(), _>("refused"))
            .expect_err("neither loads")
            .to_string();
        assert!(
            neither.contains("gather.cu") && neither.matches("refused").count() == 2,
            "{neither}"
        );
    }

    /// Every module loads on the device, once per context: a second ask, and an ask from
    /// another `CudaDevice` of the same ordinal (the same primary context), return the same
    /// module, so tests that open device after device do not load module after module.
    #[test]
    fn device_every_module_loads_once() {
        let open = || match crate::kernels::testing::gpu() {
            Device::Cuda(dev) => dev,
            _ => unreachable!("gpu() is a CUDA device"),
        };
        let (dev, other) = (open(), open());
        let sm90 = crate::kernels::dispatch::hopper_device(&dev);
        for &m in Module::ALL {
            if !sm90 && m.stem().ends_with("_sm90") {
                continue;
            }
            let first = loaded_module(&dev, m).expect("loads");
            let again = loaded_module(&dev, m).expect("loads again");
            let elsewhere = loaded_module(&other, m).expect("loads on another device handle");
            assert!(Arc::ptr_eq(&first, &again), "{} loaded twice", m.stem());
            assert!(
                Arc::ptr_eq(&first, &elsewhere),
                "{} loaded per handle",
                m.stem()
            );
        }
    }

    /// A timeline mark stamps where the device's queue stands and waits for nothing: with
    /// matrix products queued for a good part of a second, the phase's device time exceeds
    /// the host's by most of it, and the device lags the host at the mark (a mark that
    /// synchronised, as the closed marks do, would make the host's time the device's).
    #[test]
    fn device_timeline_marks_do_not_wait_for_the_device() {
        use crate::model::phases;
        let _turn = phases::TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
        let gpu = crate::kernels::testing::gpu();
        let a = candle_core::Tensor::ones((4096, 4096), DType::F32, &gpu).unwrap();
        // cuBLAS starts on its first product, and candle loads a kernel's module on its first
        // launch from a device handle (a PTX compile), both on the host: not in the timed
        // phase.
        drop((a.matmul(&a).unwrap() * (1.0 / 4096.0)).unwrap());
        gpu.synchronize().unwrap();
        phases::set_timeline(true);
        phases::mark("timeline test: start", &gpu);
        let mut x = a.clone();
        for _ in 0..40 {
            x = (x.matmul(&a).unwrap() * (1.0 / 4096.0)).unwrap();
        }
        phases::mark("timeline test: queued", &gpu);
        let t = phases::take_timeline(&gpu);
        phases::set_timeline(false);
        // Other tests' marks meanwhile are phases of their own threads.
        let queued = t
            .iter()
            .find(|p| p.name == "timeline test: queued")
            .expect("the phase");
        assert!(
            queued.device_ms > 2.0 * queued.host_ms && queued.lag_ms > 0.5 * queued.device_ms,
            "{t:?}"
        );
        // The products ran: the ones stay ones.
        let v = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|&y| (y - 1.0).abs() < 1e-3));
    }
}
