// silu_mul.cu: the SwiGLU gate, out = T(silu(gate) * up) with silu(g) = g / (1 + exp(-g)),
// all in f32 and rounded once.
//
//   gate [rows, cols] at gate[r * g_stride + c]
//   up   [rows, cols] at up[r * u_stride + c]
//   out  [rows, cols] at out[r * o_stride + c]
// gate and up may be the two halves of one fused gate_up GEMM output (column windows); out may
// alias gate or up (each element is read before it is written, by the same thread).
//
// silu_mul_*: one block per row, 16-byte vectors when the three row pointers are aligned and
// cols is a multiple of the vector width. silu_mul_vec_*: one thread per 16-byte vector of the
// whole [rows, cols] matrix (a flat grid of 256-thread blocks, so no thread idles at a row's
// end), for the launcher to take when every row is aligned and cols % V == 0: the shape of the
// MLP at every length. expf is CUDA's accurate expf (max 2 ulp), not __expf; both kernels do the
// same f32 operations.
//
// Checked by: src/kernels/silu_mul.rs, `tests::device_matches_reference` (GPU vs
// `silu_mul_ref`, both kernels seen to run) and `tests::reference_matches_candle` (the reference vs candle's silu * up).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void silu_mul_row(const T *g, const T *u, T *o, int cols) {
    constexpr int V = Vec16<T>::N;
    if (cols % V == 0 && aligned16(g) && aligned16(u) && aligned16(o)) {
        for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V) {
            Vec16<T> gv, uv;
            gv.raw = *reinterpret_cast<const uint4 *>(g + c);
            uv.raw = *reinterpret_cast<const uint4 *>(u + c);
#pragma unroll
            for (int i = 0; i < V; ++i)
                gv.v[i] = from_f32<T>(silu_times(to_f32(gv.v[i]), to_f32(uv.v[i])));
            *reinterpret_cast<uint4 *>(o + c) = gv.raw;
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            o[c] = from_f32<T>(silu_times(to_f32(g[c]), to_f32(u[c])));
    }
}

#define SILU_MUL(T, SUFFIX)                                                                       \
    extern "C" __global__ void silu_mul_##SUFFIX(const T *gate, long g_stride, const T *up,       \
                                                 long u_stride, T *out, long o_stride, int rows,  \
                                                 int cols) {                                      \
        const long r = blockIdx.x;                                                                \
        if (r >= rows) return;                                                                    \
        silu_mul_row<T>(gate + r * g_stride, up + r * u_stride, out + r * o_stride, cols);        \
    }
EAGLE_FOR_EACH_FLOAT(SILU_MUL)

template <typename T>
__device__ __forceinline__ void silu_mul_vec_impl(const T *gate, long g_stride, const T *up,
                                                  long u_stride, T *out, long o_stride, int rows,
                                                  int cols) {
    constexpr int V = Vec16<T>::N;
    const int per_row = cols / V;
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)rows * per_row) return;
    const long r = idx / per_row;
    const int c = (int)(idx % per_row) * V;
    Vec16<T> gv, uv;
    gv.raw = *reinterpret_cast<const uint4 *>(gate + r * g_stride + c);
    uv.raw = *reinterpret_cast<const uint4 *>(up + r * u_stride + c);
#pragma unroll
    for (int i = 0; i < V; ++i) gv.v[i] = from_f32<T>(silu_times(to_f32(gv.v[i]), to_f32(uv.v[i])));
    *reinterpret_cast<uint4 *>(out + r * o_stride + c) = gv.raw;
}

#define SILU_MUL_VEC(T, SUFFIX)                                                                   \
    extern "C" __global__ void silu_mul_vec_##SUFFIX(const T *gate, long g_stride, const T *up,   \
                                                     long u_stride, T *out, long o_stride,        \
                                                     int rows, int cols) {                        \
        silu_mul_vec_impl<T>(gate, g_stride, up, u_stride, out, o_stride, rows, cols);            \
    }
EAGLE_FOR_EACH_FLOAT(SILU_MUL_VEC)
