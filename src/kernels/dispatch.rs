//! Which path a GPU op takes where the device or the environment decides: the Hopper kernels
//! (`kernels/*_sm90.cu`) on an sm_90 device, unless a switch (a process-wide preference or an
//! environment variable) keeps the portable ones. The ops' own choices that depend only on
//! their arguments (a tile, a vector width) stay in their rooms.

use candle_core::cuda_backend::CudaDevice;

/// Set by [`prefer_mma_attention`].
static MMA_ATTENTION: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`flash_path`](crate::kernels::attention::launch::flash_path) take the mma.sync
/// kernels on every device (the GPU bench times both in one process);
/// `EAGLE_CHECK_ATTENTION=mma` does the same for a whole run.
pub fn prefer_mma_attention(on: bool) {
    MMA_ATTENTION.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the device runs sm_90a code (the Hopper kernels' PTX targets exactly that), unless
/// the mma.sync kernels are preferred ([`prefer_mma_attention`], `EAGLE_CHECK_ATTENTION=mma`).
pub fn hopper(dev: &CudaDevice) -> bool {
    if MMA_ATTENTION.load(std::sync::atomic::Ordering::Relaxed)
        || std::env::var("EAGLE_CHECK_ATTENTION").is_ok_and(|v| v == "mma")
    {
        return false;
    }
    hopper_device(dev)
}

/// Whether the device is sm_90 (what the `*_sm90.cu` kernels' compute_90a PTX loads on).
pub fn hopper_device(dev: &CudaDevice) -> bool {
    dev.cuda_stream()
        .context()
        .compute_capability()
        .is_ok_and(|cc| cc == (9, 0))
}

/// Set by [`prefer_grouped_experts`].
static GROUPED_EXPERTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`hopper_experts`] say no on every device, so the routed experts run as cuBLAS
/// grouped GEMMs (the GPU bench times both in one process); `EAGLE_CHECK_MOE=cublas` does the
/// same for a whole run.
pub fn prefer_grouped_experts(on: bool) {
    GROUPED_EXPERTS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the routed experts run on kernels/moe_gemm_sm90.cu: an sm_90 device, unless the
/// grouped cuBLAS path is preferred ([`prefer_grouped_experts`], `EAGLE_CHECK_MOE=cublas`).
pub fn hopper_experts(dev: &CudaDevice) -> bool {
    !(GROUPED_EXPERTS.load(std::sync::atomic::Ordering::Relaxed)
        || std::env::var("EAGLE_CHECK_MOE").is_ok_and(|v| v == "cublas"))
        && hopper_device(dev)
}
