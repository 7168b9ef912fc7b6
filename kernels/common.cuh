// Shared by every kernels/*.cu: conversions between the storage types (float, __half,
// __nv_bfloat16) and f32, 16-byte vector helpers and deterministic warp/block reductions.
// Nothing here is an entry point; each .cu file includes it and instantiates its own kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round-to-nearest-even from f32, as `half::{f16,bf16}::from_f32` do on the CPU.
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Rounds an f32 to T and back: the value a T store followed by a load would give.
template <typename T> __device__ __forceinline__ float round_to(float x) {
    return to_f32(from_f32<T>(x));
}

// SwiGLU's gate: silu(g) * u with silu(g) = g / (1 + exp(-g)), in f32 with CUDA's accurate expf
// (silu_mul.cu, and moe_gemm_sm90.cu's gate/up epilogue).
__device__ __forceinline__ float silu_times(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// Elements of T in one 16-byte vector.
template <typename T> struct Vec16 {
    static constexpr int N = 16 / sizeof(T);
    union {
        uint4 raw;
        T v[16 / sizeof(T)];
    };
};

__device__ __forceinline__ bool aligned16(const void *p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Butterfly sum over the warp: every lane gets the same value, in the same order on every run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets
// the result. `scratch` holds 32 values. Deterministic: a fixed tree for a fixed block size.
template <typename F> __device__ __forceinline__ F block_sum(F v, F *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : F(0);
    return warp_sum(v);
}

// The three element types every kernel is instantiated for, with the suffix of its entry point.
#define EAGLE_FOR_EACH_FLOAT(X) X(float, f32) X(__half, f16) X(__nv_bfloat16, bf16)
