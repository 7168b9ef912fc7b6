// rope.cu: rotary position embedding, in place, on the rotated part of every (token, head).
//
//   x[t * row_stride + h * head_stride + rot_offset + d], d < rot_dim, t < tokens, h < heads
//   cos, sin: [tokens, rot_dim / 2] f32, contiguous (already times the rope attention factor)
// interleaved == 0 (rotate-half: Llama, Qwen), with half = rot_dim / 2 and i < half:
//   out[i]        = x[i] * cos[i] - x[i + half] * sin[i]
//   out[i + half] = x[i + half] * cos[i] + x[i] * sin[i]
// interleaved == 1 (DeepSeek, transformers' apply_rotary_pos_emb_interleave): the pairs
// (x[2i], x[2i+1]) are rotated and written de-interleaved:
//   out[i]        = x[2i] * cos[i] - x[2i+1] * sin[i]
//   out[i + half] = x[2i+1] * cos[i] + x[2i] * sin[i]
// Math in f32 without fused multiply-adds (each product and the sum rounded as the CPU
// reference rounds them), one rounding to T at the store.
//
// rope_*: one warp per (token, head), four per block: the warp copies the rotated part to shared
// memory before writing, so the in-place update has no races whichever layout is used.
// rope_half_vec_*: rotate-half only, one thread per V = 16 / sizeof(T) pairs of one (token, head):
// it reads x[i..i + V] and x[i + half..i + half + V] as two 16-byte vectors, cos and sin as
// float4s, and writes back the same two vectors (no other thread touches them). The launcher
// takes it when every row and head start is 16-byte aligned, half % V == 0 and half % 4 == 0;
// the same f32 operations, so both kernels give identical bits.
//
// Checked by: src/kernels/rope.rs, `tests::device_matches_reference` (GPU vs `rope_ref`, each
// case on the kernel the launcher picks for it, and the vector kernel seen to run) and
// `tests::reference_matches_rope_tables` (the reference vs model::nn::RopeTables::apply_half
// and apply_interleaved).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rope_impl(T *x, long row_stride, int tokens, int heads,
                                          long head_stride, int rot_offset, int rot_dim,
                                          const float *cos, const float *sin, int interleaved) {
    extern __shared__ float rope_buf[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long item = (long)blockIdx.x * (blockDim.x >> 5) + warp;
    if (item >= (long)tokens * heads) return; // uniform over the warp
    const long t = item / heads, h = item % heads;
    T *p = x + t * row_stride + h * head_stride + rot_offset;
    float *s = rope_buf + warp * rot_dim;
    for (int d = lane; d < rot_dim; d += 32) s[d] = to_f32(p[d]);
    __syncwarp();
    const int half = rot_dim / 2;
    const float *c = cos + t * half, *sn = sin + t * half;
    for (int i = lane; i < half; i += 32) {
        const float a = interleaved ? s[2 * i] : s[i];
        const float b = interleaved ? s[2 * i + 1] : s[i + half];
        p[i] = from_f32<T>(__fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, sn[i])));
        p[i + half] = from_f32<T>(__fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, sn[i])));
    }
}

#define ROPE(T, SUFFIX)                                                                           \
    extern "C" __global__ void rope_##SUFFIX(T *x, long row_stride, int tokens, int heads,        \
                                             long head_stride, int rot_offset, int rot_dim,       \
                                             const float *cos, const float *sin,                  \
                                             int interleaved) {                                   \
        rope_impl<T>(x, row_stride, tokens, heads, head_stride, rot_offset, rot_dim, cos, sin,    \
                     interleaved);                                                                \
    }
EAGLE_FOR_EACH_FLOAT(ROPE)

template <typename T>
__device__ __forceinline__ void rope_half_vec_impl(T *x, long row_stride, int tokens, int heads,
                                                   long head_stride, int rot_offset, int rot_dim,
                                                   const float *cos, const float *sin) {
    constexpr int V = Vec16<T>::N;
    const int half = rot_dim / 2, chunks = half / V;
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)tokens * heads * chunks) return;
    const int c = (int)(idx % chunks);
    const long th = idx / chunks, t = th / heads, h = th % heads;
    T *p = x + t * row_stride + h * head_stride + rot_offset + c * V;
    const float *cs = cos + t * half + c * V, *sn = sin + t * half + c * V;
    Vec16<T> a, b;
    a.raw = *reinterpret_cast<const uint4 *>(p);
    b.raw = *reinterpret_cast<const uint4 *>(p + half);
    float cv[V], sv[V];
#pragma unroll
    for (int i = 0; i < V; i += 4) {
        const float4 c4 = *reinterpret_cast<const float4 *>(cs + i);
        const float4 s4 = *reinterpret_cast<const float4 *>(sn + i);
        cv[i] = c4.x, cv[i + 1] = c4.y, cv[i + 2] = c4.z, cv[i + 3] = c4.w;
        sv[i] = s4.x, sv[i + 1] = s4.y, sv[i + 2] = s4.z, sv[i + 3] = s4.w;
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const float u = to_f32(a.v[i]), w = to_f32(b.v[i]);
        a.v[i] = from_f32<T>(__fsub_rn(__fmul_rn(u, cv[i]), __fmul_rn(w, sv[i])));
        b.v[i] = from_f32<T>(__fadd_rn(__fmul_rn(w, cv[i]), __fmul_rn(u, sv[i])));
    }
    *reinterpret_cast<uint4 *>(p) = a.raw;
    *reinterpret_cast<uint4 *>(p + half) = b.raw;
}

#define ROPE_HALF_VEC(T, SUFFIX)                                                                  \
    extern "C" __global__ void rope_half_vec_##SUFFIX(T *x, long row_stride, int tokens,          \
                                                      int heads, long head_stride,                \
                                                      int rot_offset, int rot_dim,                \
                                                      const float *cos, const float *sin) {       \
        rope_half_vec_impl<T>(x, row_stride, tokens, heads, head_stride, rot_offset, rot_dim,     \
                              cos, sin);                                                          \
    }
EAGLE_FOR_EACH_FLOAT(ROPE_HALF_VEC)
