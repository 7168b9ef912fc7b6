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
//   sinks [nh] f32 or null: gpt-oss's attention sinks, one learned logit per query head that
// joins every softmax row's denominator and carries no value: out = sum_j e^(s_j) v_j /
// (sum_j e^(s_j) + e^(sinks[h])), with s_j = scale * q.k_j and the sink not scaled
// (transformers 5.24 models/gpt_oss/modeling_gpt_oss.py `eager_attention_forward`: the sink
// column concatenated to the masked scores, the row max taken with it, softmax, the column
// dropped). Every path adds it once, at the end (`sink_factor`), so windows work as without.
//
// Two paths, chosen by the launcher (src/kernels/attention.rs):
// * flash_attn_tc_{TAG}_{bf16,f16}: tensor cores (mma.sync.m16n8k16, f32 accumulators),
//   FA2-style. A block owns BM = 16 * MT * NW query rows of one head (MT 16-row tiles per warp,
//   NW warps); the Q tile and ring-buffered K and V tiles of BN keys live in shared memory,
//   filled with cp.async (16-byte chunks, rows padded by 16 bytes so ldmatrix is conflict-free);
//   S = Q K^T and O += P V run from registers, P rounded to T for the second product (as FA2).
//   Key tiles fully outside the causal/window band are skipped; only tiles that cross its edge
//   are masked. Blocks with the most keys start first. Two kernels: flash_tc (the first tiles,
//   measured on the H200) and flash_tc2 (fewer instructions per MMA; see its section). For
//   (dk, dv) in {(64, 64), (128, 128), (192, 128)}, 16-byte aligned pointers and strides
//   multiple of 8.
// * flash_attn_generic_{f32,f16,bf16}: one warp per (query, head), any dk, dv <= 256, any
//   alignment; used for f32, the tiny test models and whatever the tensor-core path refuses.
//
// Checked by: src/kernels/attention.rs, `tests::reference_matches_candle` (the CPU reference
// `flash_attention_ref` vs model::nn::attention on candle ops, with the same masks) and
// `tests::device_*` (both GPU paths vs the reference, from tiny ragged shapes to Llama-3.1-8B
// and DeepSeek MLA shapes at T = 2048; `device_throughput` reports TFLOP/s); before any GPU run
// by the lane-level host emulation of the tensor-core kernels (kernels/emu/,
// scripts/attention-emu.sh). The inline PTX is in mma.cuh, which the emulation replaces.
#include "common.cuh"
#include "mma.cuh"

// The factor that normalises a row's accumulated O: 1 / l without a sink; with one,
// 1 / (l + 2^(sink log2 e - mu)) computed relative to max(mu, sink) so that neither term
// overflows. `l` is the row's sum of 2^(score - mu) (log2 units, mu finite or -inf for a row
// with no key), `sl` the head's sink in log2 units (`sink_log2`), read once before the
// epilogue so that the sinks pointer is not live across it.
__device__ __forceinline__ float sink_factor(float l, float mu, bool has_sink, float sl) {
    if (!has_sink) return l > 0.f ? 1.f / l : 0.f;
    const float top = fmaxf(mu, sl);
    if (top == -INFINITY) return 0.f; // no key and a sink of -inf: nothing to normalise
    const float c = exp2f(mu - top); // 0 for mu = -inf
    const float den = l * c + exp2f(sl - top);
    return den > 0.f ? c / den : 0.f;
}

// Head h's sink logit in log2 units (-inf, unused, without sinks).
__device__ __forceinline__ float sink_log2(const float *sinks, int h) {
    return sinks == nullptr ? -INFINITY : sinks[h] * 1.4426950408889634f;
}

// ---------------------------------------------------------------- generic path

#define GEN_MAX_D 256
#define GEN_WARPS 4

template <typename T>
__device__ __forceinline__ void flash_generic(const T *q, long q_stride, const T *k, long k_stride,
                                              const T *v, long v_stride, T *out, long o_stride,
                                              int tq, int tk, int nh, int nkv, int dk, int dv,
                                              float scale, int window, const float *sinks) {
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
    // m is in natural-log units here: o and l are relative to e^m = 2^(m log2 e).
    const float inv = sink_factor(l, m * 1.4426950408889634f, sinks != nullptr, sink_log2(sinks, h));
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int d = lane + 32 * r;
        if (d < dv) op[d] = from_f32<T>(sinks == nullptr ? o[r] / l : o[r] * inv);
    }
}

#define FLASH_GENERIC(T, SUFFIX)                                                                  \
    extern "C" __global__ void __launch_bounds__(GEN_WARPS * 32) flash_attn_generic_##SUFFIX(     \
        const T *q, long q_stride, const T *k, long k_stride, const T *v, long v_stride, T *out,  \
        long o_stride, int tq, int tk, int nh, int nkv, int dk, int dv, float scale, int window,   \
        const float *sinks) {                                                                     \
        flash_generic<T>(q, q_stride, k, k_stride, v, v_stride, out, o_stride, tq, tk, nh, nkv,   \
                         dk, dv, scale, window, sinks);                                           \
    }
EAGLE_FOR_EACH_FLOAT(FLASH_GENERIC)

// ---------------------------------------------------------------- tensor-core path

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
                                         int nh, int nkv, float scale, int window,
                                         const float *sinks) {
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

    const bool has_sink = sinks != nullptr;
    const float sl = sink_log2(sinks, h);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = row_sum[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            // row_max is a raw score; the exponents subtracted mu = row_max * scale_log2.
            const float rm = row_max[mt][hf];
            const float inv = sink_factor(l, rm == -INFINITY ? 0.f : rm * scale_log2, has_sink, sl);
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

// ---------------------------------------------------------------- tensor-core path, v2
//
// flash_tc2: the same FA2 arithmetic as flash_tc (S = Q K^T and O += P V on mma.sync, P rounded
// to T), written for fewer instructions per MMA, since at 250 registers a block of flash_tc
// issues about 10 instructions per HMMA and the SM has two warps per scheduler to hide that:
// * exp2 as one MUFU.EX2 (ex2.approx.ftz; exp2f adds a range check and two FMULs around it),
//   scores kept in log2 units (scale * log2(e) folded into one FFMA per score);
// * lazy rescaling: a row's reference max m moves only when a new score exceeds it by more than
//   TAU = 8 (log2 units), decided per warp (__any_sync), so the O *= alpha pass (MT * DV / 2
//   FMULs per thread) runs a few times per row instead of once per key tile. Until then
//   P = 2^(s - m) <= 2^8: exact in f32, and P's relative rounding to T is unchanged;
// * K/V in ST-stage ring buffers (a stage is BN keys of K and of V) filled by cp.async with
//   compile-time chunk offsets (each thread copies the same chunks of every tile, one pointer
//   per operand), zero-filling only for the last, partial tile; one barrier per key tile;
// * a K/V tile of BN keys is consumed in chunks of BC keys (S held for BC keys only), so a
//   large tile halves the barriers and waits without the registers of a large S;
// * causal/window skipping per warp as well as per block: a warp skips the chunks that none of
//   its rows sees (the diagonal tiles of a 128-row block cost the early warps nothing), and
//   masks only the chunks that cross its band's edge;
// * PIPE: S of key tile t + 1 is computed while tile t goes through exp and P V (FA3's
//   intra-warp overlap, on mma.sync: the two run in one basic block, so the HMMAs of one
//   interleave with the FFMA/MUFU of the other); needs ST >= 4 (tile t + 3 loads while t and
//   t + 1 are read) and BC == BN.

__host__ __device__ constexpr int const_gcd(int a, int b) { return b == 0 ? a : const_gcd(b, a % b); }

// ROWS rows of D elements from `src` (row stride in elements) into the padded tile at shared
// address `dst`. Thread x copies chunks (row r0 + i * RSTEP, 16-byte chunk c0 + j * CC) with
// CC = gcd(D / 8, NT): the same offsets for every tile. Rows at or past `avail` are zero-filled
// (cp.async with 0 source bytes, its address clamped to row 0).
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_rows(uint32_t dst, const T *src, long stride, int avail) {
    constexpr int C = D / 8, CC = const_gcd(C, NT), RSTEP = NT / CC;
    constexpr int SD = Padded<D>::STRIDE * (int)sizeof(T);
    static_assert(ROWS % RSTEP == 0, "tile rows must be a multiple of the rows copied per pass");
    const int r0 = threadIdx.x / CC, c0 = threadIdx.x % CC;
    const T *p = src + (long)r0 * stride + c0 * 8;
    const uint32_t d = dst + r0 * SD + c0 * 16;
    if (avail >= ROWS) {
#pragma unroll
        for (int i = 0; i < ROWS / RSTEP; ++i)
#pragma unroll
            for (int j = 0; j < C / CC; ++j)
                cp_async16_full(d + i * RSTEP * SD + j * CC * 16, p + i * RSTEP * stride + j * CC * 8);
    } else {
#pragma unroll
        for (int i = 0; i < ROWS / RSTEP; ++i) {
            const bool ok = r0 + i * RSTEP < avail;
#pragma unroll
            for (int j = 0; j < C / CC; ++j)
                cp_async16(d + i * RSTEP * SD + j * CC * 16,
                           ok ? p + i * RSTEP * stride + j * CC * 8 : src + c0 * 8 + j * CC * 8,
                           ok ? 16 : 0);
        }
    }
}

// The per-warp pieces of flash_tc2. Fragment layouts as in flash_tc: S[mt][nt] is the m16n8 tile
// of rows mt * 16.. and keys nt * 8..; lane holds rows lane / 4 (+ 8 for e >= 2) and keys
// 2 * (lane % 4) + (e & 1).
template <typename T, int DK, int DV, int MT, int BC> struct Tc2Warp {
    static constexpr int SK = Padded<DK>::STRIDE, SV = Padded<DV>::STRIDE;
    static constexpr int E = (int)sizeof(T);
    static constexpr float TAU = 8.f;
    using TC = TensorCore<T>;

    // S = Q K^T for the BC keys whose first K row is at shared address `kst` + this lane's
    // offset (`k_frag` already added); Q fragments at `q_frag`.
    static __device__ __forceinline__ void qk(float (&s)[MT][BC / 8][4], uint32_t q_frag,
                                              uint32_t kst) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], q_frag + (mt * 16 * SK + kk * 16) * E);
#pragma unroll
            for (int nn = 0; nn < BC / 16; ++nn) {
                uint32_t b[4];
                ldsm_x4(b, kst + (nn * 16 * SK + kk * 16) * E);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    TC::mma(s[mt][2 * nn], a[mt], b[0], b[1]);
                    TC::mma(s[mt][2 * nn + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }

    // Scores outside the band -> -inf. `pos0`: position of this lane's first row (mt 0, e < 2).
    static __device__ __forceinline__ void mask(float (&s)[MT][BC / 8][4], int key0, int pos0,
                                                int window) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int pos = pos0 + mt * 16 + (e >> 1) * 8;
                    const int j = key0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                    if (j > pos || (window > 0 && pos - j >= window)) s[mt][nt][e] = -INFINITY;
                }
    }

    // Online-softmax bookkeeping for one chunk of scores (raw, masked): moves the reference max
    // m (log2 units; -inf while a row has seen no key) of every row of the warp when any row's
    // chunk max exceeds its m by more than TAU, rescaling that row's O and sum.
    static __device__ __forceinline__ void rescale(const float (&s)[MT][BC / 8][4],
                                                   float (&m)[MT][2], float (&l)[MT][2],
                                                   float (&o)[MT][DV / 8][4], float scale_log2) {
        float mx[MT][2];
        bool grow = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float x = fmaxf(s[mt][0][2 * hf], s[mt][0][2 * hf + 1]);
#pragma unroll
                for (int nt = 1; nt < BC / 8; ++nt)
                    x = fmaxf(x, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
                mx[mt][hf] = x * scale_log2;
                grow |= mx[mt][hf] > m[mt][hf] + TAU; // false for NaN-free -inf vs -inf
            }
        if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float m_new = fmaxf(m[mt][hf], mx[mt][hf]);
                    // exp2(-inf) = 0 drops the empty O of a row's first keys; a row still without
                    // keys keeps alpha 1 instead of exp2(-inf + inf) = NaN.
                    const float alpha = m_new == -INFINITY ? 1.f : fast_exp2(m[mt][hf] - m_new);
                    m[mt][hf] = m_new;
                    l[mt][hf] *= alpha;
#pragma unroll
                    for (int dt = 0; dt < DV / 8; ++dt) {
                        o[mt][dt][2 * hf] *= alpha;
                        o[mt][dt][2 * hf + 1] *= alpha;
                    }
                }
        }
    }

    // P = 2^(s * scale_log2 - m) into s, its sum into l, then O += P V for the BC keys whose
    // first V row is at `vst` + this lane's offset (`v_frag` already added).
    static __device__ __forceinline__ void exp_pv(float (&s)[MT][BC / 8][4], const float (&m)[MT][2],
                                                  float (&l)[MT][2], float (&o)[MT][DV / 8][4],
                                                  float scale_log2, uint32_t vst) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float mu = m[mt][hf] == -INFINITY ? 0.f : m[mt][hf];
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                    for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
                        const float p = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -mu));
                        s[mt][nt][e] = p;
                        sum += p;
                    }
                l[mt][hf] += sum;
            }
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
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
                ldsm_x4_trans(b, vst + (kk * 16 * SV + dd * 16) * E);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    TC::mma(o[mt][2 * dd], a[mt], b[0], b[1]);
                    TC::mma(o[mt][2 * dd + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
};

template <typename T, int DK, int DV, int MT, int NW, int BN, int BC, int ST, bool PIPE>
__device__ __forceinline__ void flash_tc2(const T *__restrict__ q, long q_stride,
                                          const T *__restrict__ k, long k_stride,
                                          const T *__restrict__ v, long v_stride,
                                          T *__restrict__ out, long o_stride, int tq, int tk,
                                          int nh, int nkv, float scale, int window,
                                          const float *sinks) {
    constexpr int BM = 16 * MT * NW, NT = 32 * NW, E = (int)sizeof(T);
    constexpr int SK = Padded<DK>::STRIDE, SV = Padded<DV>::STRIDE;
    constexpr int STAGE = BN * (SK + SV) * E; // bytes of one K + V stage
    static_assert(DK % 16 == 0 && DV % 16 == 0 && BC % 16 == 0 && BN % BC == 0, "tile shape");
    static_assert(ST >= 2 && (!PIPE || (ST >= 4 && BC == BN)), "stages");
    using W = Tc2Warp<T, DK, DV, MT, BC>;
    using TC = TensorCore<T>;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    const uint32_t q_smem = smem_addr(fa_smem), kv_smem = q_smem + BM * SK * E;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.x, g = h / (nh / nkv);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM; // the longest rows first
    const int off = tk - tq;
    // The block's key tiles: every key some row of the block sees.
    const int pos_lo = q0 + off, pos_hi = min(q0 + BM, tq) - 1 + off;
    const int t_lo = (window > 0 ? max(0, pos_lo - window + 1) : 0) / BN;
    const int t_hi = min(pos_hi, tk - 1) / BN;
    // This warp's rows and the keys they see (a warp past tq sees none).
    const int wrow = warp * 16 * MT, w_first = q0 + wrow;
    const bool w_active = w_first < tq;
    const int w_pos_lo = w_first + off, w_pos_hi = min(w_first + 16 * MT, tq) - 1 + off;
    const int w_j_lo = window > 0 ? max(0, w_pos_lo - window + 1) : 0;
    // Chunk [key0, key0 + BC) has a key some row of the warp sees / a key some row must not.
    auto visible = [&](int key0) { return w_active && key0 <= w_pos_hi && key0 + BC - 1 >= w_j_lo; };
    auto edge = [&](int key0) {
        return key0 + BC - 1 > w_pos_lo || (window > 0 && key0 < w_pos_hi - window + 1);
    };
    const int pos0 = w_pos_lo + (lane >> 2); // this lane's first row

    const T *kb = k + (long)g * DK, *vb = v + (long)g * DV;
    auto load_kv = [&](int tile, int stage) {
        const uint32_t dst = kv_smem + stage * STAGE;
        load_rows<T, DK, BN, NT>(dst, kb + (long)tile * BN * k_stride, k_stride, tk - tile * BN);
        load_rows<T, DV, BN, NT>(dst + BN * SK * E, vb + (long)tile * BN * v_stride, v_stride,
                                 tk - tile * BN);
    };
    // Prologue: Q with the first tile, then tiles t_lo + 1 .. t_lo + ST - 2, one group each.
    load_rows<T, DK, BM, NT>(q_smem, q + (long)q0 * q_stride + (long)h * DK, q_stride, tq - q0);
#pragma unroll
    for (int i = 0; i < ST - 1; ++i) {
        if (t_lo + i <= t_hi) load_kv(t_lo + i, i);
        cp_async_commit();
    }

    float o[MT][DV / 8][4];
    float m[MT][2], l[MT][2]; // reference max (log2 units), this thread's share of the sum
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DV / 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }
    const float scale_log2 = scale * 1.4426950408889634f;
    // Per-lane ldmatrix addresses (layouts as in flash_tc); K and V ones are stage offsets.
    const uint32_t q_frag = q_smem + ((wrow + (lane & 15)) * SK + (lane >> 4) * 8) * E;
    const uint32_t k_frag =
        kv_smem + ((((lane >> 4) << 3) + (lane & 7)) * SK + ((lane >> 3) & 1) * 8) * E;
    const uint32_t v_frag = kv_smem + BN * SK * E + ((lane & 15) * SV + (lane >> 4) * 8) * E;

    if constexpr (!PIPE) {
        int stage = 0; // of tile t
        for (int t = t_lo; t <= t_hi; ++t) {
            cp_async_wait<ST - 2>(); // tile t (and Q) landed for this thread ...
            __syncthreads();         // ... and for all; every warp is done with tile t - 1
            const int ld = stage == 0 ? ST - 1 : stage - 1; // the stage tile t - 1 used
            if (t + ST - 1 <= t_hi) load_kv(t + ST - 1, ld);
            cp_async_commit();
#pragma unroll
            for (int c = 0; c < BN / BC; ++c) {
                const int key0 = t * BN + c * BC;
                if (visible(key0)) {
                    float s[MT][BC / 8][4];
                    W::qk(s, q_frag, k_frag + stage * STAGE + c * BC * SK * E);
                    if (edge(key0)) W::mask(s, key0, pos0, window);
                    W::rescale(s, m, l, o, scale_log2);
                    W::exp_pv(s, m, l, o, scale_log2, v_frag + stage * STAGE + c * BC * SV * E);
                }
            }
            stage = stage == ST - 1 ? 0 : stage + 1;
        }
    } else {
        // Step t: S(t + 1) = Q K(t + 1)^T alongside exp and P V of tile t, whose S came from
        // step t - 1. Tile t + 3 loads into the stage of tile t - 1 at the end of step t.
        float sa[MT][BN / 8][4], sb[MT][BN / 8][4];
        cp_async_wait<ST - 2>();
        __syncthreads();
        bool ca = visible(t_lo * BN), cb = false;
        if (ca) W::qk(sa, q_frag, k_frag);
        int stage = 0, t = t_lo;
        auto step = [&](float (&cur)[MT][BN / 8][4], bool ccur, float (&nxt)[MT][BN / 8][4],
                        bool &cnxt) {
            const int key0 = t * BN;
            if (ccur) {
                if (edge(key0)) W::mask(cur, key0, pos0, window);
                W::rescale(cur, m, l, o, scale_log2);
            }
            cp_async_wait<ST - 3>(); // tile t + 1 landed
            __syncthreads();
            const int nstage = stage == ST - 1 ? 0 : stage + 1;
            cnxt = t < t_hi && visible(key0 + BN);
            if (ccur && cnxt) {
                W::qk(nxt, q_frag, k_frag + nstage * STAGE);
                W::exp_pv(cur, m, l, o, scale_log2, v_frag + stage * STAGE);
            } else if (cnxt) {
                W::qk(nxt, q_frag, k_frag + nstage * STAGE);
            } else if (ccur) {
                W::exp_pv(cur, m, l, o, scale_log2, v_frag + stage * STAGE);
            }
            const int ld = stage == 0 ? ST - 1 : stage - 1;
            if (t + ST - 1 <= t_hi) load_kv(t + ST - 1, ld);
            cp_async_commit();
            stage = nstage;
            ++t;
        };
        while (true) {
            step(sa, ca, sb, cb);
            if (t > t_hi) break;
            step(sb, cb, sa, ca);
            if (t > t_hi) break;
        }
    }
    cp_async_wait<0>();

    const bool has_sink = sinks != nullptr;
    const float sl = sink_log2(sinks, h);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float sum = l[mt][hf];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            // m is the reference max in log2 units (-inf: the exponents subtracted 0).
            const float mu = m[mt][hf] == -INFINITY ? 0.f : m[mt][hf];
            const float inv = sink_factor(sum, mu, has_sink, sl);
            const int row = w_first + mt * 16 + (lane >> 2) + hf * 8;
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
        long o_stride, int tq, int tk, int nh, int nkv, float scale, int window,                  \
        const float *sinks) {                                                                     \
        flash_tc<T, DK, DV, MT, NW, BN>(q, q_stride, k, k_stride, v, v_stride, out, o_stride, tq, \
                                        tk, nh, nkv, scale, window, sinks);                       \
    }
#define FLASH_TC_TYPES(TAG, DK, DV, MT, NW, BN)                                                   \
    FLASH_TC(__nv_bfloat16, bf16, TAG, DK, DV, MT, NW, BN)                                        \
    FLASH_TC(__half, f16, TAG, DK, DV, MT, NW, BN)
FLASH_TC_TYPES(d64_v64, 64, 64, 2, 4, 64)
FLASH_TC_TYPES(d128_v128, 128, 128, 2, 4, 32)
FLASH_TC_TYPES(d128_v128_m1, 128, 128, 1, 4, 64)
FLASH_TC_TYPES(d192_v128, 192, 128, 1, 4, 64)

// flash_tc2 entry points: flash_attn_tc_{TAG}_{bf16,f16} with (DK, DV, MT, NW, BN, BC, ST, PIPE)
// repeated in attention.rs `TC_CONFIGS`; MINB is __launch_bounds__' blocks per SM (2 caps an 8-warp
// block at 128 registers, so that two blocks fit).
#define FLASH_TC2(T, SUFFIX, TAG, DK, DV, MT, NW, BN, BC, ST, PIPE, MINB)                         \
    extern "C" __global__ void __launch_bounds__(NW * 32, MINB) flash_attn_tc_##TAG##_##SUFFIX(   \
        const T *q, long q_stride, const T *k, long k_stride, const T *v, long v_stride, T *out,  \
        long o_stride, int tq, int tk, int nh, int nkv, float scale, int window,                  \
        const float *sinks) {                                                                     \
        flash_tc2<T, DK, DV, MT, NW, BN, BC, ST, PIPE>(q, q_stride, k, k_stride, v, v_stride,     \
                                                       out, o_stride, tq, tk, nh, nkv, scale,     \
                                                       window, sinks);                            \
    }
#define FLASH_TC2_TYPES(TAG, DK, DV, MT, NW, BN, BC, ST, PIPE, MINB)                              \
    FLASH_TC2(__nv_bfloat16, bf16, TAG, DK, DV, MT, NW, BN, BC, ST, PIPE, MINB)                   \
    FLASH_TC2(__half, f16, TAG, DK, DV, MT, NW, BN, BC, ST, PIPE, MINB)
FLASH_TC2_TYPES(d128_v128_lean, 128, 128, 2, 4, 32, 32, 2, false, 1)
FLASH_TC2_TYPES(d128_v128_n64, 128, 128, 2, 4, 64, 32, 2, false, 1)
FLASH_TC2_TYPES(d128_v128_c64, 128, 128, 2, 4, 64, 64, 2, false, 1)
FLASH_TC2_TYPES(d128_v128_s3, 128, 128, 2, 4, 32, 32, 3, false, 1)
FLASH_TC2_TYPES(d128_v128_w8pipe, 128, 128, 1, 8, 32, 32, 4, true, 1)
FLASH_TC2_TYPES(d128_v128_w8m1, 128, 128, 1, 8, 64, 64, 2, false, 2)
FLASH_TC2_TYPES(d192_v128_lean, 192, 128, 2, 4, 32, 32, 2, false, 1)
FLASH_TC2_TYPES(d192_v128_lean_m1, 192, 128, 1, 4, 64, 64, 2, false, 1)
FLASH_TC2_TYPES(d192_v128_w8m1, 192, 128, 1, 8, 32, 32, 2, false, 2)
