// mxfp4.cu: MXFP4 dequantisation (gpt-oss checkpoints' `*_blocks` / `*_scales` expert weights):
// out = T(FP4[nibble] * 2^(scale - 127)), the product in f32 and rounded once to T.
//
//   blocks [groups, 16] bytes, contiguous: group g's 32 FP4 (e2m1) values, two per byte
//   scales [groups] bytes: group g's shared exponent, biased by 127 (E8M0)
//   out    [groups, 32] contiguous: out[g * 32 + 2 * b] from the low nibble of blocks[g, b],
//          out[g * 32 + 2 * b + 1] from its high nibble
// FP4 e2m1 values by nibble: 0 0.5 1 1.5 2 3 4 6, then the same negated for 8..15 (8 is -0).
// As transformers 5.24 integrations/mxfp4.py `_convert_moe_packed_tensors` (which
// `convert_moe_packed_tensors` calls): lut[blk & 0x0F] into the even columns, lut[blk >> 4]
// into the odd ones, then torch.ldexp(sub, scale - 127), which multiplies by
// torch.pow(2.0, exp) in f32; the final transpose(1, 2) of the result is the caller's. The
// f32 factor 2^(s - 127) is built from its bits: a subnormal 2^-127 for s = 0, +inf for
// s = 255 (2^128 overflows f32, as torch's pow does), so s = 255 gives +-inf and 0 * inf = NaN.
// Every finite product is exact in f32 (a 2-bit mantissa times a power of two, denormals kept:
// __fmul_rn, no flush to zero); rounding to T is the only rounding.
//
// One thread per group (a 16-byte load, 32 stores), a grid-stride loop.
//
// Checked by: src/kernels/mxfp4.rs, `tests::device_matches_reference` (GPU vs
// `mxfp4_dequant_ref`, bit for bit, every nibble and scale byte) and
// `tests::reference_matches_hand_computed_values`.
#include "common.cuh"

// The e2m1 nibble as f32, from its bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa
// (bit 0); exponent 0 is the subnormal 0.5 * mantissa.
__device__ __forceinline__ float fp4_e2m1(unsigned n) {
    const unsigned e = (n >> 1) & 3u, m = n & 1u;
    const unsigned mag = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3f000000u : 0u);
    return __uint_as_float(mag | ((n & 8u) << 28));
}

// 2^(s - 127) in f32: a subnormal for s = 0, +inf for s = 255.
__device__ __forceinline__ float mxfp4_scale(unsigned char s) {
    return __uint_as_float(s == 0 ? 0x00400000u : (unsigned)s << 23);
}

template <typename T>
__device__ __forceinline__ void mxfp4_dequant_impl(const unsigned char *blocks,
                                                   const unsigned char *scales, T *out,
                                                   long groups) {
    const long stride = (long)gridDim.x * blockDim.x;
    for (long g = (long)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
        const float sc = mxfp4_scale(scales[g]);
        const unsigned char *b = blocks + g * 16;
        T *o = out + g * 32;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const unsigned byte = b[i];
            o[2 * i] = from_f32<T>(__fmul_rn(fp4_e2m1(byte & 15u), sc));
            o[2 * i + 1] = from_f32<T>(__fmul_rn(fp4_e2m1(byte >> 4), sc));
        }
    }
}

#define MXFP4_DEQUANT(T, SUFFIX)                                                                  \
    extern "C" __global__ void mxfp4_dequant_##SUFFIX(const unsigned char *blocks,                \
                                                      const unsigned char *scales, T *out,        \
                                                      long groups) {                              \
        mxfp4_dequant_impl<T>(blocks, scales, out, groups);                                       \
    }
EAGLE_FOR_EACH_FLOAT(MXFP4_DEQUANT)
