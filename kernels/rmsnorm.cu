// rmsnorm.cu: residual add fused with RMSNorm, as HF LlamaRMSNorm computes it.
//
//   resid  = delta ? T(x + delta) : x            (the add rounded to T, as HF adds in the compute dtype)
//   normed = T( T(resid * 1/sqrt(mean(resid^2) + eps)) * w )   (normalise in f32, cast, times weight)
//
// Arguments (row-major, strides in elements, so inputs may be column windows of wider matrices):
//   x          [rows, cols] at x[r * x_stride + c]
//   delta      [rows, cols] at delta[r * delta_stride + c], or null (plain RMSNorm)
//   w          [cols], contiguous
//   resid_out  [rows, cols] at resid_out[r * resid_stride + c], or null (not written)
//   normed_out [rows, cols] at normed_out[r * normed_stride + c]
// resid_out may alias x or delta (an in-place residual add); normed_out may alias x when
// resid_out is null. Pass 2 reads the residual back from resid_out for that reason.
//
// One block per row (32..1024 threads, chosen by the launcher from cols: a single warp for small
// rows), 16-byte vector loads when every row pointer is aligned and cols is a multiple of the
// vector width, scalar otherwise. Sum of squares in f32, reduced in a fixed order.
//
// Checked by: src/kernels/rmsnorm.rs, `tests::device_matches_reference` (GPU vs the CPU
// reference `add_rms_norm_ref`) and `tests::reference_matches_candle` (the reference vs
// model::nn::RmsNorm on candle ops).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void add_rmsnorm_row(const T *x, const T *delta, const T *w, T *resid,
                                                T *normed, int cols, float eps) {
    __shared__ float scratch[32];
    constexpr int V = Vec16<T>::N;
    const bool vec = cols % V == 0 && aligned16(x) && (!delta || aligned16(delta)) &&
                     aligned16(w) && (!resid || aligned16(resid)) && aligned16(normed);
    float ss = 0.f;
    if (vec) {
        for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V) {
            Vec16<T> xv, dv;
            xv.raw = *reinterpret_cast<const uint4 *>(x + c);
            if (delta) dv.raw = *reinterpret_cast<const uint4 *>(delta + c);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                float r = to_f32(xv.v[i]);
                if (delta) r = round_to<T>(__fadd_rn(r, to_f32(dv.v[i])));
                xv.v[i] = from_f32<T>(r);
                ss += r * r;
            }
            if (resid) *reinterpret_cast<uint4 *>(resid + c) = xv.raw;
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float r = to_f32(x[c]);
            if (delta) r = round_to<T>(__fadd_rn(r, to_f32(delta[c])));
            if (resid) resid[c] = from_f32<T>(r);
            ss += r * r;
        }
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    // The residual as pass 1 left it: read back from resid_out when written (it may alias x).
    const T *src = resid ? resid : x;
    const T *add = resid ? nullptr : delta;
    if (vec) {
        for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V) {
            Vec16<T> rv, dv, wv;
            rv.raw = *reinterpret_cast<const uint4 *>(src + c);
            if (add) dv.raw = *reinterpret_cast<const uint4 *>(add + c);
            wv.raw = *reinterpret_cast<const uint4 *>(w + c);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                float r = to_f32(rv.v[i]);
                if (add) r = round_to<T>(__fadd_rn(r, to_f32(dv.v[i])));
                rv.v[i] = from_f32<T>(__fmul_rn(round_to<T>(__fmul_rn(r, inv)), to_f32(wv.v[i])));
            }
            *reinterpret_cast<uint4 *>(normed + c) = rv.raw;
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float r = to_f32(src[c]);
            if (add) r = round_to<T>(__fadd_rn(r, to_f32(add[c])));
            normed[c] = from_f32<T>(__fmul_rn(round_to<T>(__fmul_rn(r, inv)), to_f32(w[c])));
        }
    }
}

#define ADD_RMSNORM(T, SUFFIX)                                                                    \
    extern "C" __global__ void add_rmsnorm_##SUFFIX(                                              \
        const T *x, long x_stride, const T *delta, long delta_stride, const T *w, T *resid_out,   \
        long resid_stride, T *normed_out, long normed_stride, int rows, int cols, float eps) {    \
        const long r = blockIdx.x;                                                                \
        if (r >= rows) return;                                                                    \
        add_rmsnorm_row<T>(x + r * x_stride, delta ? delta + r * delta_stride : nullptr, w,       \
                           resid_out ? resid_out + r * resid_stride : nullptr,                    \
                           normed_out + r * normed_stride, cols, eps);                            \
    }
EAGLE_FOR_EACH_FLOAT(ADD_RMSNORM)
