// fp8_dequant.cu: FP8 (E4M3, the "fn" variant) block dequantisation, as DeepSeek-V3 checkpoints
// need it: out = T(e4m3_to_float(w) * scale_inv[r / br, c / bc]), the product in f32.
//
//   w         [R, C] bytes, contiguous, E4M3fn: bias 7, no infinities, NaN = 0x7f / 0xff
//   scale_inv [ceil(R / br), ceil(C / bc)] f32, contiguous (edge blocks partial)
//   out       [R, C] contiguous
//
// One block per row. The E4M3 decode builds the f32 bit pattern directly (every E4M3 value is
// exact in f32), so the result equals the CPU's `to_dtype(F32) * scale` bit for bit in f32.
//
// Checked by: src/kernels/fp8.rs, `tests::device_matches_reference` (GPU vs `fp8_dequant_ref`)
// and `tests::reference_matches_model_fp8` (the reference vs model::fp8::dequantize_blocks_with).
#include "common.cuh"

__device__ __forceinline__ float e4m3_to_f32(unsigned char b) {
    const unsigned sign = (unsigned)(b & 0x80) << 24, e = (b >> 3) & 0xf, m = b & 7;
    if (e == 15 && m == 7) return __int_as_float(0x7fc00000 | sign);
    if (e == 0) { // subnormal: m * 2^-9, exact
        const float v = (float)m * 0.001953125f;
        return sign ? -v : v;
    }
    return __int_as_float(sign | ((e + 120) << 23) | (m << 20));
}

template <typename T>
__device__ __forceinline__ void fp8_dequant_row(const unsigned char *w, const float *scale_inv,
                                                T *out, int r, int C, int br, int bc) {
    const unsigned char *wr = w + (long)r * C;
    const float *sr = scale_inv + (long)(r / br) * ((C + bc - 1) / bc);
    T *o = out + (long)r * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        o[c] = from_f32<T>(__fmul_rn(e4m3_to_f32(wr[c]), sr[c / bc]));
}

#define FP8_DEQUANT(T, SUFFIX)                                                                    \
    extern "C" __global__ void fp8_dequant_##SUFFIX(const unsigned char *w,                       \
                                                    const float *scale_inv, T *out, int R, int C, \
                                                    int br, int bc) {                             \
        if ((int)blockIdx.x >= R) return;                                                         \
        fp8_dequant_row<T>(w, scale_inv, out, blockIdx.x, C, br, bc);                             \
    }
EAGLE_FOR_EACH_FLOAT(FP8_DEQUANT)
