// attention.cu: causal flash attention forward (never materialises T x T), grouped KV heads,
// optional sliding window.
//
//   q   [tq, *] at q[i * q_stride + h * dk + d]    h < nh, d < dk
//   k   [tk, *] at k[j * k_stride + g * dk + d]    g = h / (nh / nkv)
//   v   [tk, *] at v[j * v_stride + g * dv + d]
//   out [tq, *] at out[i * o_stride + h * dv + d]
// (strides in elements: q, k, v may be column windows of one fused QKV GEMM output).
// Query i sits at position p = i + (tk - tq) and sees key j when j <= p and
// (window == 0 || p - j < window). Softmax of scale * q.k in f32 with a running max and sum
// (online softmax), output rounded to T once. Needs tq <= tk and nh % nkv == 0.
//
// Two paths, chosen by the launcher (src/kernels/attention.rs):
// * flash_attn_tc_d{DK}_v{DV}_{bf16,f16}: tensor cores (mma.sync.m16n8k16, f32 accumulators),
//   FA2-style. A block owns BM = 16 * MT * NW query rows of one head (MT 16-row tiles per warp,
//   NW warps); the Q tile and double-buffered K and V tiles of BN keys live in shared memory,
//   filled with cp.async (16-byte chunks, XOR-swizzled rows so ldmatrix is conflict-free);
//   S = Q K^T and O += P V run from registers, P rounded to T for the second product (as FA2).
//   Key tiles fully outside the causal/window band are skipped; only tiles that cross its edge
//   are masked. Blocks with the most keys start first. For (dk, dv) in
//   {(64, 64), (128, 128), (192, 128)}, 16-byte aligned pointers and strides multiple of 8.
// * flash_attn_generic_{f32,f16,bf16}: one warp per (query, head), any dk, dv <= 256, any
//   alignment; used for f32, the tiny test models and whatever the tensor-core path refuses.
//
// Checked by: src/kernels/attention.rs, `tests::reference_matches_candle` (the CPU reference
// `flash_attention_ref` vs model::nn::attention on candle ops, with the same masks) and
// `tests::device_*` (both GPU paths vs the reference, from tiny ragged shapes to Llama-3.1-8B
// and DeepSeek MLA shapes at T = 2048; `device_throughput` reports TFLOP/s).
#include "common.cuh"

// ---------------------------------------------------------------- generic path

#define GEN_MAX_D 256
#define GEN_WARPS 4

template <typename T>
__device__ __forceinline__ void flash_generic(const T *q, long q_stride, const T *k, long k_stride,
                                              const T *v, long v_stride, T *out, long o_stride,
                                              int tq, int tk, int nh, int nkv, int dk, int dv,
                                              float scale, int window) {
    constexpr int R = GEN_MAX_D / 32;
    const int lane = threadIdx.x & 31;
    // Consecutive warps take the heads of one query: a block's warps share KV rows in cache.
    const long item = (long)blockIdx.x * GEN_WARPS + (threadIdx.x >> 5);
    if (item >= (long)tq * nh) return; // uniform over the warp
    const long i = item / nh;
    const int h = (int)(item % nh), g = h / (nh / nkv);
    const T *qp = q + i * q_stride + (long)h * dk;
    float qr[R], o[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int d = lane + 32 * r;
        qr[r] = d < dk ? to_f32(qp[d]) : 0.f;
        o[r] = 0.f;
    }
    const long pos = i + (tk - tq);
    const long j_lo = window > 0 ? max(0l, pos - window + 1) : 0l;
    const long j_hi = min(pos, (long)tk - 1);
    float m = -INFINITY, l = 0.f;
    for (long j = j_lo; j <= j_hi; ++j) {
        const T *kp = k + j * k_stride + (long)g * dk;
        float s = 0.f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int d = lane + 32 * r;
            if (d < dk) s += qr[r] * to_f32(kp[d]);
        }
        s = warp_sum(s) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new); // 0 on the first key (m = -inf)
        const float p = expf(s - m_new);
        l = l * corr + p;
        m = m_new;
        const T *vp = v + j * v_stride + (long)g * dv;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int d = lane + 32 * r;
            if (d < dv) o[r] = o[r] * corr + p * to_f32(vp[d]);
        }
    }
    T *op = out + i * o_stride + (long)h * dv;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int d = lane + 32 * r;
        if (d < dv) op[d] = from_f32<T>(o[r] / l);
    }
}

#define FLASH_GENERIC(T, SUFFIX)                                                                  \
    extern "C" __global__ void __launch_bounds__(GEN_WARPS * 32) flash_attn_generic_##SUFFIX(     \
        const T *q, long q_stride, const T *k, long k_stride, const T *v, long v_stride, T *out,  \
        long o_stride, int tq, int tk, int nh, int nkv, int dk, int dv, float scale,              \
        int window) {                                                                             \
        flash_generic<T>(q, q_stride, k, k_stride, v, v_stride, out, o_stride, tq, tk, nh, nkv,   \
                         dk, dv, scale, window);                                                  \
    }
EAGLE_FOR_EACH_FLOAT(FLASH_GENERIC)

// ---------------------------------------------------------------- tensor-core path

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, bypassing L1; `bytes` = 0 zero-fills (rows past the end).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <typename T> struct TensorCore;

template <> struct TensorCore<__nv_bfloat16> {
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two f32 as one register of T pairs, `lo` in the low half (the lower column).
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

template <> struct TensorCore<__half> {
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

// Shared-memory tiles keep rows of D elements at a stride of D + 8: the 16 bytes of padding
// shift each row by four banks, so the 8 rows one ldmatrix reads at the same column hit 32
// different banks, and every fragment address is one per-lane base plus a compile-time offset.
template <int D> struct Padded {
    static constexpr int STRIDE = D + 8;
};

// ROWS rows of D elements from `src` (row stride in elements) into a padded tile; rows at or
// past `avail` are zero-filled (their source address is clamped to a valid row).
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile(T *dst, const T *src, long stride, int avail) {
    constexpr int C = D / 8; // 16-byte chunks per row
#pragma unroll
    for (int idx = threadIdx.x; idx < ROWS * C; idx += NT) {
        const int r = idx / C, c = idx % C;
        const T *p = src + (long)min(r, avail - 1) * stride + c * 8;
        cp_async16(smem_addr(dst + r * Padded<D>::STRIDE + c * 8), p, r < avail ? 16 : 0);
    }
}

template <typename T, int DK, int DV, int MT, int NW, int BN>
__device__ __forceinline__ void flash_tc(const T *__restrict__ q, long q_stride,
                                         const T *__restrict__ k, long k_stride,
                                         const T *__restrict__ v, long v_stride,
                                         T *__restrict__ out, long o_stride, int tq, int tk,
                                         int nh, int nkv, float scale, int window) {
    constexpr int BM = 16 * MT * NW, NT = 32 * NW;
    constexpr int SK = Padded<DK>::STRIDE, SV = Padded<DV>::STRIDE;
    static_assert(DK % 16 == 0 && DV % 16 == 0 && BN % 16 == 0, "tile shape");
    using TC = TensorCore<T>;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    T *qs = reinterpret_cast<T *>(fa_smem);
    T *ks = qs + BM * SK;     // two K tiles
    T *vs = ks + 2 * BN * SK; // two V tiles

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.x, g = h / (nh / nkv);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM; // the longest rows first
    const int off = tk - tq;
    const int pos_lo = q0 + off, pos_hi = min(q0 + BM, tq) - 1 + off;
    const int j_lo = window > 0 ? max(0, pos_lo - window + 1) : 0;
    const int j_hi = min(pos_hi, tk - 1);
    const int t_lo = j_lo / BN, t_hi = j_hi / BN;
    const T *kb = k + (long)g * DK, *vb = v + (long)g * DV;

    load_tile<T, DK, BM, NT>(qs, q + (long)q0 * q_stride + (long)h * DK, q_stride, tq - q0);
    load_tile<T, DK, BN, NT>(ks, kb + (long)t_lo * BN * k_stride, k_stride, tk - t_lo * BN);
    cp_async_commit();
    load_tile<T, DV, BN, NT>(vs, vb + (long)t_lo * BN * v_stride, v_stride, tk - t_lo * BN);
    cp_async_commit();

    float o[MT][DV / 8][4];
    float row_max[MT][2], row_sum[MT][2]; // raw-score max; this thread's share of the sum
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DV / 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
    const float scale_log2 = scale * 1.4426950408889634f;
    const int wrow = warp * 16 * MT; // this warp's first row in the tile
    // Per-lane ldmatrix row addresses; fragments add compile-time offsets to these.
    // Q (A operand): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15), lane -> row lane % 16.
    const uint32_t q_frag = smem_addr(qs + (wrow + (lane & 15)) * SK + (lane >> 4) * 8);
    // K (B operand of Q K^T, two 8-key tiles): (keys 0-7, d 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15).
    const uint32_t k_frag = smem_addr(ks + (((lane >> 4) << 3) + (lane & 7)) * SK + ((lane >> 3) & 1) * 8);
    // V (B operand of P V, transposed; two 8-wide d tiles): (keys 0-7 | 8-15) x (d 0-7 | 8-15).
    const uint32_t v_frag = smem_addr(vs + (lane & 15) * SV + (lane >> 4) * 8);

    for (int t = t_lo; t <= t_hi; ++t) {
        const int buf = (t - t_lo) & 1;
        cp_async_wait<1>(); // Q and K(t) have landed (V(t) may still be in flight)
        __syncthreads();

        float s[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(a[mt], q_frag + (mt * 16 * SK + kk * 16) * (int)sizeof(T));
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                uint32_t b[4];
                ldsm_x4(b, k_frag + (buf * BN * SK + nn * 16 * SK + kk * 16) * (int)sizeof(T));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    TC::mma(s[mt][2 * nn], a[mt], b[0], b[1]);
                    TC::mma(s[mt][2 * nn + 1], a[mt], b[2], b[3]);
                }
            }
        }
        // K(t + 1) into the other buffer: every warp finished K(t - 1) before the barrier above.
        if (t < t_hi)
            load_tile<T, DK, BN, NT>(ks + (buf ^ 1) * BN * SK, kb + (long)(t + 1) * BN * k_stride,
                                     k_stride, tk - (t + 1) * BN);
        cp_async_commit();

        const int key0 = t * BN;
        const bool edge = key0 + BN - 1 > pos_lo || key0 + BN > tk ||
                          (window > 0 && key0 <= pos_hi - window);
        if (edge) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int pos = q0 + wrow + mt * 16 + (lane >> 2) + (e >> 1) * 8 + off;
                        const int j = key0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                        if (j > pos || j >= tk || (window > 0 && pos - j >= window))
                            s[mt][nt][e] = -INFINITY;
                    }
        }

#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float mx = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
                    mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(row_max[mt][hf], mx);
                // A row with no visible key yet keeps exp2(-inf) = 0 everywhere, not NaN.
                const float mu = m_new == -INFINITY ? 0.f : m_new * scale_log2;
                const float alpha = exp2f(row_max[mt][hf] * scale_log2 - mu);
                row_max[mt][hf] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                    for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
                        const float p = exp2f(fmaf(s[mt][nt][e], scale_log2, -mu));
                        s[mt][nt][e] = p;
                        sum += p;
                    }
                row_sum[mt][hf] = row_sum[mt][hf] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < DV / 8; ++dt) {
                    o[mt][dt][2 * hf] *= alpha;
                    o[mt][dt][2 * hf + 1] *= alpha;
                }
            }

        cp_async_wait<1>(); // V(t) has landed (K(t + 1) may still be in flight)
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            // The S accumulators of key tiles 2kk and 2kk+1 are exactly the A fragment of P.
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = TC::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = TC::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = TC::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = TC::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dd = 0; dd < DV / 16; ++dd) {
                uint32_t b[4];
                ldsm_x4_trans(b, v_frag + (buf * BN * SV + kk * 16 * SV + dd * 16) * (int)sizeof(T));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    TC::mma(o[mt][2 * dd], a[mt], b[0], b[1]);
                    TC::mma(o[mt][2 * dd + 1], a[mt], b[2], b[3]);
                }
            }
        }
        // V(t + 1) into the other buffer: every warp finished V(t - 1) before both barriers above.
        if (t < t_hi)
            load_tile<T, DV, BN, NT>(vs + (buf ^ 1) * BN * SV, vb + (long)(t + 1) * BN * v_stride,
                                     v_stride, tk - (t + 1) * BN);
        cp_async_commit();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = row_sum[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int row = q0 + wrow + mt * 16 + (lane >> 2) + hf * 8;
            if (row < tq) {
                T *op = out + (long)row * o_stride + (long)h * DV + (lane & 3) * 2;
#pragma unroll
                for (int dt = 0; dt < DV / 8; ++dt)
                    *reinterpret_cast<uint32_t *>(op + dt * 8) =
                        TC::pack(o[mt][dt][2 * hf] * inv, o[mt][dt][2 * hf + 1] * inv);
            }
        }
}

// Entry points: flash_attn_tc_{TAG}_{bf16,f16}, one per tile configuration. The configuration
// (DK, DV, MT, NW, BN) is repeated in src/kernels/attention.rs (`TC_CONFIGS`), which sizes the
// grid and shared memory from it; the device tests run every entry. Register use (ptxas, sm_90)
// decided the shapes: d128 with MT 2 and BN 64 spills, with BN 32 it takes 250 registers.
#define FLASH_TC(T, SUFFIX, TAG, DK, DV, MT, NW, BN)                                              \
    extern "C" __global__ void __launch_bounds__(NW * 32) flash_attn_tc_##TAG##_##SUFFIX(         \
        const T *q, long q_stride, const T *k, long k_stride, const T *v, long v_stride, T *out,  \
        long o_stride, int tq, int tk, int nh, int nkv, float scale, int window) {                \
        flash_tc<T, DK, DV, MT, NW, BN>(q, q_stride, k, k_stride, v, v_stride, out, o_stride, tq, \
                                        tk, nh, nkv, scale, window);                              \
    }
#define FLASH_TC_TYPES(TAG, DK, DV, MT, NW, BN)                                                   \
    FLASH_TC(__nv_bfloat16, bf16, TAG, DK, DV, MT, NW, BN)                                        \
    FLASH_TC(__half, f16, TAG, DK, DV, MT, NW, BN)
FLASH_TC_TYPES(d64_v64, 64, 64, 2, 4, 64)
FLASH_TC_TYPES(d128_v128, 128, 128, 2, 4, 32)
FLASH_TC_TYPES(d128_v128_m1, 128, 128, 1, 4, 64)
FLASH_TC_TYPES(d192_v128, 192, 128, 1, 4, 64)
