// gather.cu: row gather, dst[r] = src[idx[r]] (embedding lookup, MoE token gather).
//
//   src [src_rows, cols] at src[i * src_stride + c]
//   idx [rows] 32-bit indices (int or unsigned: read as unsigned, so a negative int is out of range)
//   dst [rows, cols] at dst[r * dst_stride + c]
// An index >= src_rows cannot be reported from a kernel: its row is written as NaN, where a
// memory fault would be the alternative. (The CPU reference refuses it with an error.)
// `src_rows` is an addition to the signature in the design note for exactly this check.
//
// One block per output row; 16-byte copies when both row pointers are aligned and the row is
// a whole number of vectors.
//
// Checked by: src/kernels/gather.rs, `tests::device_matches_reference` (GPU vs
// `gather_rows_ref`, which equals candle's index_select: `tests::reference_matches_candle`).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void gather_row(const T *src, long src_stride, int src_rows,
                                           unsigned i, T *dst, int cols) {
    if (i >= (unsigned)src_rows) {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = from_f32<T>(__int_as_float(0x7fc00000));
        return;
    }
    const T *s = src + (long)i * src_stride;
    constexpr int V = Vec16<T>::N;
    if (cols % V == 0 && aligned16(s) && aligned16(dst)) {
        for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V)
            *reinterpret_cast<uint4 *>(dst + c) = *reinterpret_cast<const uint4 *>(s + c);
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = s[c];
    }
}

#define GATHER(T, SUFFIX)                                                                         \
    extern "C" __global__ void gather_rows_##SUFFIX(const T *src, long src_stride,                \
                                                    const unsigned *idx, T *dst, long dst_stride, \
                                                    int rows, int cols, int src_rows) {           \
        const long r = blockIdx.x;                                                                \
        if (r >= rows) return;                                                                    \
        gather_row<T>(src, src_stride, src_rows, idx[r], dst + r * dst_stride, cols);             \
    }
EAGLE_FOR_EACH_FLOAT(GATHER)
