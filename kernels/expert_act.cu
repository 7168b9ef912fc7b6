// expert_act.cu: the per-expert biases and activations of routed experts whose rows are sorted by
// expert (moe.cu's plan), for the MoE paths that cannot fuse them into a GEMM epilogue (gpt-oss).
// The expert of row r is found on the device from `offsets` (binary search), so the host never
// reads the routing.
//
//   offsets [experts + 1] u32: expert e owns rows offsets[e]..offsets[e + 1]; rows at or past
//           offsets[experts] belong to no expert and are left alone
//
// expert_act_*: out[r, c] = act(g, u) for c < inter, from the fused gate/up GEMM output
//   gu   [rows, *] at gu[r * gu_stride + c] (gate) and gu[r * gu_stride + inter + c] (up)
//   bias [experts * 2 inter] or null: expert e's inter gate biases, then its inter up biases
//   out  [rows, *] at out[r * o_stride + c]
//   g = T(gate + bias_gate), u = T(up + bias_up) (the GEMM output rounded, then the bias added in
//   f32 and rounded: transformers' `x @ W + b` as two ops), then, by `act`:
//   0, SiLU-mul: T(silu(g) * u) in f32, rounded once (as silu_mul.cu);
//   1, gpt-oss's clamped SwiGLU (transformers 5.24 models/gpt_oss/modeling_gpt_oss.py
//      `GptOssExperts._apply_gate`), each torch op's result rounded to T as eager ops in T do:
//      gc = min(g, limit), uc = clamp(u, -limit, limit) (exact; NaN stays NaN),
//      a = T(gc * alpha), s = T(1 / (1 + exp(-a))), glu = T(gc * s), u1 = T(uc + 1),
//      out = T(u1 * glu);
//   2, Gemma-4's GELU-tanh-mul (transformers 5.24 models/gemma4/modeling_gemma4.py
//      `Gemma4TextExperts.forward`, `gelu_pytorch_tanh`): T(gelu_tanh(g) * u) in f32, rounded
//      once, gelu_tanh(g) = 0.5 g (1 + tanh(0.7978846 (g + 0.044715 g^3))) (the CPU reference's
//      `kernels::moe::gelu_tanh`).
// expert_bias_add_*: y[r, c] = T(y[r, c] + bias[e * cols + c]) in place, y [rows, *] at row
//   stride y_stride, bias [experts * cols] (gpt-oss's `down_proj_bias`, added after the down GEMM).
//
// One block per row; expf is CUDA's accurate expf and every operation is an explicitly rounded
// f32 one (no fused multiply-add), as the CPU reference computes.
//
// Checked by: src/kernels/moe.rs, `tests::device_gpt_oss_experts_match_reference` (the GPU
// expert paths with these kernels vs `moe_experts_ref`) and, on the CPU,
// `tests::gpt_oss_reference_is_the_hf_expert` (the reference vs a direct per-expert computation
// from transformers' [E, H, 2I] layout, with planted bugs).
#include "common.cuh"

// The expert owning row r: the last e with offsets[e] <= r (offsets ascending); experts when r
// is past every expert's rows.
__device__ __forceinline__ int expert_of_row(const unsigned *offsets, int experts, unsigned r) {
    if (r >= offsets[experts]) return experts;
    int lo = 0, hi = experts - 1; // invariant: offsets[lo] <= r < offsets[hi + 1]
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (offsets[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <typename T>
__device__ __forceinline__ float clamped_swiglu(float g, float u, float alpha, float limit) {
    const float gc = g > limit ? limit : g;
    const float uc = u > limit ? limit : (u < -limit ? -limit : u);
    const float a = round_to<T>(__fmul_rn(gc, alpha));
    const float s = round_to<T>(__fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-a))));
    const float glu = round_to<T>(__fmul_rn(gc, s));
    const float u1 = round_to<T>(__fadd_rn(uc, 1.0f));
    return __fmul_rn(u1, glu);
}

__device__ __forceinline__ float gelu_tanh_times(float g, float u) {
    const float inner = __fmul_rn(0.7978846f, __fadd_rn(g, __fmul_rn(__fmul_rn(0.044715f, g), __fmul_rn(g, g))));
    return __fmul_rn(__fmul_rn(0.5f, __fmul_rn(g, __fadd_rn(1.0f, tanhf(inner)))), u);
}

template <typename T>
__device__ __forceinline__ void expert_act_row(const T *gu, long gu_stride, const T *bias,
                                               const unsigned *offsets, int experts, T *out,
                                               long o_stride, int inter, int act, float alpha,
                                               float limit) {
    const unsigned r = blockIdx.x;
    const int e = expert_of_row(offsets, experts, r);
    if (e >= experts) return;
    const T *g_row = gu + (long)r * gu_stride, *u_row = g_row + inter;
    const T *bg = bias == nullptr ? nullptr : bias + (long)e * 2 * inter;
    const T *bu = bias == nullptr ? nullptr : bg + inter;
    T *o = out + (long)r * o_stride;
    for (int c = threadIdx.x; c < inter; c += blockDim.x) {
        float g = to_f32(g_row[c]), u = to_f32(u_row[c]);
        if (bg != nullptr) {
            g = round_to<T>(__fadd_rn(g, to_f32(bg[c])));
            u = round_to<T>(__fadd_rn(u, to_f32(bu[c])));
        }
        o[c] = from_f32<T>(act == 1   ? clamped_swiglu<T>(g, u, alpha, limit)
                           : act == 2 ? gelu_tanh_times(g, u)
                                      : silu_times(g, u));
    }
}

#define EXPERT_ACT(T, SUFFIX)                                                                     \
    extern "C" __global__ void expert_act_##SUFFIX(                                               \
        const T *gu, long gu_stride, const T *bias, const unsigned *offsets, int experts, T *out, \
        long o_stride, int rows, int inter, int act, float alpha, float limit) {                  \
        if ((int)blockIdx.x >= rows) return;                                                      \
        expert_act_row<T>(gu, gu_stride, bias, offsets, experts, out, o_stride, inter, act,       \
                          alpha, limit);                                                          \
    }
EAGLE_FOR_EACH_FLOAT(EXPERT_ACT)

#define EXPERT_BIAS_ADD(T, SUFFIX)                                                                \
    extern "C" __global__ void expert_bias_add_##SUFFIX(T *y, long y_stride, const T *bias,      \
                                                        const unsigned *offsets, int experts,     \
                                                        int rows, int cols) {                     \
        const unsigned r = blockIdx.x;                                                            \
        if ((int)r >= rows) return;                                                               \
        const int e = expert_of_row(offsets, experts, r);                                         \
        if (e >= experts) return;                                                                 \
        T *yr = y + (long)r * y_stride;                                                           \
        const T *b = bias + (long)e * cols;                                                       \
        for (int c = threadIdx.x; c < cols; c += blockDim.x)                                      \
            yr[c] = from_f32<T>(__fadd_rn(to_f32(yr[c]), to_f32(b[c])));                          \
    }
EAGLE_FOR_EACH_FLOAT(EXPERT_BIAS_ADD)
