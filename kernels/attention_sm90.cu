// attention_sm90.cu: causal flash attention forward for Hopper (sm_90a only): the same function
// as attention.cu's kernels (grouped KV heads, optional sliding window, queries at the last tq
// positions), computed with warpgroup MMAs (wgmma) on tiles that the tensor memory accelerator
// (TMA) copies into shared memory.
//
//   q   [tq, *] at q[i * q_stride + h * DK + d]    h < nh, d < DK     (read through q_map)
//   k   [tk, *] at k[j * k_stride + g * DK + d]    g = h / (nh / nkv) (read through k_map)
//   v   [tk, *] at v[j * v_stride + g * DV + d]                       (read through v_map)
//   out [tq, *] at out[i * o_stride + h * DV + d]
// Query i sits at position p = i + (tk - tq) and sees key j when j <= p and
// (window == 0 || p - j < window). Softmax of scale * q.k in f32 (running max and sum), P
// rounded to T for P V (as FA2/FA3 and attention.cu's tensor-core path), output rounded once.
// (DK, DV) in {(128, 128), (192, 128)}: DK and DV multiples of 64.
//   sinks [nh] f32 or null: gpt-oss's attention sinks as in attention.cu (one logit per query
// head in every row's softmax denominator, no value; transformers 5.24
// models/gpt_oss/modeling_gpt_oss.py `eager_attention_forward`), added once in the epilogue.
//
// The maps (cuda.rs `tensor_map`) describe q, k and v as 2-D tensors of T (inner dimension: the
// columns of the heads, nh * DK or nkv * DK or nkv * DV; outer: the rows, with the caller's row
// stride), boxes of 64 columns (128 bytes) x BOX rows, 128-byte swizzle, zero fill outside.
//
// A block owns BM = 128 query rows of one head and has three warpgroups: warpgroup 0 is the
// producer (one thread issues every TMA copy: the Q tile once, then K and V tiles of BN keys into
// an ST-stage ring, each stage reused once both consumers have released it), warpgroups 1 and
// 2 are consumers owning 64 query rows each. A consumer computes S = Q K^T (wgmma, both operands
// in shared memory, K-major) and O += P V (wgmma, P from registers, V in shared memory,
// N-major), overlapping the softmax of key tile t + 1 with P V of tile t (FA3's intra-warpgroup
// pipelining): S(t + 1) is issued before P V(t), and O is rescaled once P V(t) has completed.
// Rescaling is lazy (as attention.cu's flash_tc2): a row's reference maximum moves only when a
// score exceeds it by more than TAU (log2 units), decided per warp. setmaxnreg moves registers
// from the producer (24) to the consumers (240). (FA3's inter-warpgroup ping-pong, the consumers
// issuing their MMAs in turns through two named barriers, was measured on the H200 and made no
// difference here: 355 / 467 / 522 against 357 / 470 / 520 TFLOP/s at T = 2048 / 4096 / 8192,
// BENCHMARKS.md run 14; it is not kept.)
//
// Shared-memory layouts (each 64-column slab of a tile is rows x 128 bytes, 1024-byte aligned,
// chunk c of row r at (c ^ (r % 8)) * 16: the 128-byte swizzle TMA writes and wgmma reads):
//   Q: [2 consumers][DK / 64 slabs][64 rows][64], K: [DK / 64 slabs][BN keys][64],
//   V: [DV / 64 slabs][BN keys][64].
// wgmma descriptors: K-major (Q, K) start + 32 bytes per 16 columns, stride byte offset 1024 (8
// rows); N-major (V, trans-b = 1) leading byte offset BN * 128 (the next 64 columns of dv), stride
// byte offset 1024 (the next 8 keys), start + 2048 bytes per 16 keys.
//
// Checked by: src/kernels/attention.rs, `tests::device::device_hopper_matches_reference` (GPU vs
// the CPU reference `flash_attention_ref`, ragged and realistic shapes, windows, growing row
// maxima) and `device_wgmma_tile_matches_reference` (wg_tile_check_bf16 below: one S = Q K^T and
// one O = P V tile through the same descriptors, against f32 products on the CPU). Skipped (and
// said so) on a GPU that is not sm_90.
#include "mma.cuh"
#include "sm90.cuh"

namespace sm90 {

constexpr int BM = 128;      // query rows per block (two consumer warpgroups of 64)
constexpr int BN = 128;      // keys per K/V tile
constexpr int SLAB = 64;     // columns per 128-byte swizzled slab
constexpr float TAU = 8.f;   // lazy rescaling threshold, log2 units

// 1 / l, or with a sink 1 / (l + 2^(sink log2 e - mu)) taken relative to max(mu, sink):
// attention.cu's `sink_factor` (l: the row's sum of 2^(score - mu), mu and the sink sl in
// log2 units).
__device__ __forceinline__ float sink_factor(float l, float mu, bool has_sink, float sl) {
    if (!has_sink) return l > 0.f ? 1.f / l : 0.f;
    const float top = fmaxf(mu, sl);
    if (top == -INFINITY) return 0.f;
    const float c = exp2f(mu - top);
    const float den = l * c + exp2f(sl - top);
    return den > 0.f ? c / den : 0.f;
}

#define EAGLE_ACC4(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3])
#define EAGLE_ACC16(b) EAGLE_ACC4(b), EAGLE_ACC4(b + 4), EAGLE_ACC4(b + 8), EAGLE_ACC4(b + 12)
#define EAGLE_ACC64 EAGLE_ACC16(0), EAGLE_ACC16(16), EAGLE_ACC16(32), EAGLE_ACC16(48)
#define EAGLE_D64                                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
    "%56, %57, %58, %59, %60, %61, %62, %63}"

template <typename T> struct Wg;

// d[64] (+)= A (64 x 16, shared memory, K-major) x B (16 x 128, shared memory, K-major), and
// d[64] += A (registers) x B (16 x 128, shared memory, N-major). `accumulate` = 0 overwrites d.
#define EAGLE_WG_TYPE(T, PTX)                                                                     \
    template <> struct Wg<T> {                                                                    \
        static __device__ __forceinline__ void ss(float (&d)[64], uint64_t a, uint64_t b,         \
                                                  int accumulate) {                               \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                             \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " " EAGLE_D64 \
                         ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                        \
                         : EAGLE_ACC64                                                            \
                         : "l"(a), "l"(b), "r"(accumulate));                                      \
        }                                                                                         \
        static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4],         \
                                                  uint64_t b) {                                   \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                             \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " " EAGLE_D64 \
                         ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                        \
                         : EAGLE_ACC64                                                            \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));           \
        }                                                                                         \
    };

EAGLE_WG_TYPE(__nv_bfloat16, "bf16")
EAGLE_WG_TYPE(__half, "f16")

// S (64 rows of this warpgroup x BN keys) = Q K^T over DK: Q slabs at `q` (64 rows each, 8 KiB
// apart), K slabs at `k` (BN rows each).
template <typename T, int DK>
__device__ __forceinline__ void qk(float (&s)[64], uint32_t q, uint32_t k) {
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
        const uint32_t slab = kk / 4, col = (kk % 4) * 32;
        Wg<T>::ss(s, desc_sw128(q + slab * 64 * 128 + col, 16, 1024),
                  desc_sw128(k + slab * BN * 128 + col, 16, 1024), kk > 0);
    }
}

// O (64 x DV) += P (64 x BN, A fragments) V (BN keys x DV at `v`); DV = 128: one N = 128 MMA per
// 16 keys, the two 64-column slabs of V BN * 128 bytes apart.
template <typename T>
__device__ __forceinline__ void pv(float (&o)[64], const uint32_t (&p)[BN / 16][4], uint32_t v) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        Wg<T>::rs(o, p[kk], desc_sw128(v + kk * 16 * 128, BN * 128, 1024));
}

// Accumulator layout of m64nNk16 (per warp of the warpgroup, as mma.sync's m16n8 tiles): index
// i = 4 * n8 + e holds row (warp % 4) * 16 + lane / 4 + 8 * (e / 2), column 8 * n8 + 2 * (lane % 4)
// + (e % 2).

// Scores outside the band -> -inf. `pos0`: position of this lane's first row.
__device__ __forceinline__ void mask(float (&s)[64], int key0, int pos0, int window) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const int pos = pos0 + ((i >> 1) & 1) * 8;
        const int j = key0 + (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
        if (j > pos || (window > 0 && pos - j >= window)) s[i] = -INFINITY;
    }
}

// The softmax step for one tile of raw, masked scores, in place: moves each row's reference
// maximum m (log2 units) when the warp sees a score above its m + TAU (alpha: the factor for O
// and l, 1 when m stayed), replaces the scores by P = 2^(s * scale_log2 - m) and adds them to the
// row sums l.
__device__ __forceinline__ void softmax(float (&s)[64], float (&m)[2], float (&l)[2],
                                        float (&alpha)[2], float scale_log2) {
    float mx[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float x = -INFINITY;
#pragma unroll
        for (int n8 = 0; n8 < BN / 8; ++n8)
            x = fmaxf(x, fmaxf(s[4 * n8 + 2 * hf], s[4 * n8 + 2 * hf + 1]));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
        mx[hf] = x * scale_log2;
    }
    const bool grow = mx[0] > m[0] + TAU || mx[1] > m[1] + TAU;
    alpha[0] = alpha[1] = 1.f;
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const float m_new = fmaxf(m[hf], mx[hf]);
            // exp2(-inf) = 0 drops a row's empty start; a row still without keys keeps 1.
            alpha[hf] = m_new == -INFINITY ? 1.f : exp2f(m[hf] - m_new);
            m[hf] = m_new;
            l[hf] *= alpha[hf];
        }
    }
    const float mu[2] = {m[0] == -INFINITY ? 0.f : m[0], m[1] == -INFINITY ? 0.f : m[1]};
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const float x = fast_exp2(fmaf(s[i], scale_log2, -mu[(i >> 1) & 1]));
        s[i] = x;
        l[(i >> 1) & 1] += x;
    }
}

// P (f32, accumulator layout) -> the A fragments of P V, rounded to T. The fence keeps the
// packing ahead of the next wgmma stage (ptxas serialises a stage whose A registers are
// written inside it).
template <typename T>
__device__ __forceinline__ void pack_p(const float (&s)[64], uint32_t (&p)[BN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[kk][e] = TensorCore<T>::pack(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
            reg_fence(p[kk][e]);
        }
    }
}

template <int DK, int DV, int ST> struct Smem {
    static constexpr int Q = 2 * DK * 64 * 2;    // bytes of the Q tile (two consumers)
    static constexpr int K = DK * BN * 2;        // one K stage
    static constexpr int V = DV * BN * 2;        // one V stage
    static constexpr int TOTAL = Q + ST * (K + V) + 1024; // + alignment slack
};

template <typename T, int DK, int DV, int ST>
__device__ __forceinline__ void flash_wg(const CUtensorMap *q_map, const CUtensorMap *k_map,
                                         const CUtensorMap *v_map, T *__restrict__ out,
                                         long o_stride, int tq, int tk, int nh, int nkv,
                                         float scale, int window, const float *sinks) {
#ifdef EAGLE_SM90A
    static_assert(DK % 64 == 0 && DV == 128, "head dims");
    using S = Smem<DK, DV, ST>;
    extern __shared__ unsigned char wg_smem_raw[];
    __shared__ __align__(8) uint64_t bars[1 + 3 * ST];
    const uint32_t base = (smem_addr(wg_smem_raw) + 1023) & ~1023u;
    const uint32_t q_s = base, kv_s = base + S::Q;
    auto k_s = [&](int st) { return kv_s + st * (S::K + S::V); };
    auto v_s = [&](int st) { return kv_s + st * (S::K + S::V) + S::K; };
    const uint32_t q_full = smem_addr(&bars[0]);
    auto k_full = [&](int st) { return smem_addr(&bars[1 + st]); };
    auto v_full = [&](int st) { return smem_addr(&bars[1 + ST + st]); };
    auto empty = [&](int st) { return smem_addr(&bars[1 + 2 * ST + st]); };

    const int h = blockIdx.x, g = h / (nh / nkv);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM; // the longest rows first
    const int off = tk - tq;
    const int pos_lo = q0 + off, pos_hi = min(q0 + BM, tq) - 1 + off;
    const int t_lo = (window > 0 ? max(0, pos_lo - window + 1) : 0) / BN;
    const int t_hi = min(pos_hi, tk - 1) / BN;
    const int tiles = t_hi - t_lo + 1;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int st = 0; st < ST; ++st) {
            mbar_init(k_full(st), 1);
            mbar_init(v_full(st), 1);
            mbar_init(empty(st), 256); // every consumer thread releases the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x == 0) {
            mbar_expect_tx(q_full, S::Q);
            for (int c = 0; c < 2; ++c)
                for (int a = 0; a < DK / SLAB; ++a)
                    tma_load(q_s + (c * (DK / SLAB) + a) * 64 * 128, q_map, h * DK + a * SLAB,
                             q0 + c * 64, q_full);
            for (int i = 0; i < tiles; ++i) {
                const int st = i % ST, key0 = (t_lo + i) * BN;
                if (i >= ST) mbar_wait(empty(st), ((i / ST) + 1) & 1);
                mbar_expect_tx(k_full(st), S::K);
                for (int a = 0; a < DK / SLAB; ++a)
                    tma_load(k_s(st) + a * BN * 128, k_map, g * DK + a * SLAB, key0, k_full(st));
                mbar_expect_tx(v_full(st), S::V);
                for (int a = 0; a < DV / SLAB; ++a)
                    tma_load(v_s(st) + a * BN * 128, v_map, g * DV + a * SLAB, key0, v_full(st));
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
        const int c = wg - 1, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
        const uint32_t q_c = q_s + c * (DK / SLAB) * 64 * 128;
        // This warpgroup's rows and the keys they see.
        const int c_first = q0 + c * 64;
        const int c_pos_lo = c_first + off, c_pos_hi = min(c_first + 64, tq) - 1 + off;
        auto edge = [&](int key0) {
            return key0 + BN - 1 > c_pos_lo || (window > 0 && key0 < c_pos_hi - window + 1);
        };
        const int pos0 = c_pos_lo + warp * 16 + (lane >> 2); // this lane's first row
        const float scale_log2 = scale * 1.4426950408889634f;

        float o[64], s[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] = 0.f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];
        uint32_t p[BN / 16][4];

        mbar_wait(q_full, 0);
        mbar_wait(k_full(0), 0);
        wg_fence();
        qk<T, DK>(s, q_c, k_s(0));
        wg_commit();
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < 64; ++i) reg_fence(s[i]);
        if (edge(t_lo * BN)) mask(s, t_lo * BN, pos0, window);
        softmax(s, m, l, alpha, scale_log2);
        pack_p<T>(s, p);

        // Steady state (FA3's intra-warpgroup overlap): S(i + 1) is issued before P V(i), and its
        // softmax runs while P V(i) does; O is rescaled and P(i + 1) packed once P V(i) is done.
        for (int i = 0; i + 1 < tiles; ++i) {
            const int st = i % ST, ns = (i + 1) % ST;
            mbar_wait(k_full(ns), ((i + 1) / ST) & 1);
            wg_fence();
            qk<T, DK>(s, q_c, k_s(ns));
            wg_commit();
            mbar_wait(v_full(st), (i / ST) & 1);
            wg_fence();
            pv<T>(o, p, v_s(st));
            wg_commit();
            wg_wait<1>(); // S(i + 1) is ready; P V(i) may still run
#pragma unroll
            for (int j = 0; j < 64; ++j) reg_fence(s[j]);
            const int key0 = (t_lo + i + 1) * BN;
            if (edge(key0)) mask(s, key0, pos0, window);
            softmax(s, m, l, alpha, scale_log2);
            wg_wait<0>();
#pragma unroll
            for (int j = 0; j < 64; ++j) reg_fence(o[j]);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) reg_fence(p[kk][e]);
            mbar_arrive(empty(st));
            if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
                for (int j = 0; j < 64; ++j) o[j] *= alpha[(j >> 1) & 1];
            }
            pack_p<T>(s, p);
        }
        {
            const int i = tiles - 1, st = i % ST;
            mbar_wait(v_full(st), (i / ST) & 1);
            wg_fence();
            pv<T>(o, p, v_s(st));
            wg_commit();
            wg_wait<0>();
#pragma unroll
            for (int j = 0; j < 64; ++j) reg_fence(o[j]);
            mbar_arrive(empty(st));
        }

        const bool has_sink = sinks != nullptr;
        const float sl = has_sink ? sinks[h] * 1.4426950408889634f : -INFINITY;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float sum = l[hf];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = sink_factor(sum, m[hf] == -INFINITY ? 0.f : m[hf], has_sink, sl);
            const int row = c_first + warp * 16 + (lane >> 2) + hf * 8;
            if (row < tq) {
                T *op = out + (long)row * o_stride + (long)h * DV + (lane & 3) * 2;
#pragma unroll
                for (int n8 = 0; n8 < DV / 8; ++n8)
                    *reinterpret_cast<uint32_t *>(op + n8 * 8) =
                        TensorCore<T>::pack(o[4 * n8 + 2 * hf] * inv, o[4 * n8 + 2 * hf + 1] * inv);
            }
        }
    }
#endif
}

// One warpgroup, one tile of each product through the attention kernel's loads and descriptors:
// s_out[64, 128] = Q K^T (Q [64, 128] and K [128, 128] through q_map and k_map at (0, 0)) and
// o_out[64, 128] = P V (P [64, 128] row-major in global memory, V [128, 128] through v_map),
// both f32. For the device test of the building blocks.
template <typename T>
__device__ __forceinline__ void tile_check(const CUtensorMap *q_map, const CUtensorMap *k_map,
                                           const CUtensorMap *v_map, const T *pm, float *s_out,
                                           float *o_out) {
#ifdef EAGLE_SM90A
    extern __shared__ unsigned char wg_smem_raw[];
    __shared__ __align__(8) uint64_t bar;
    const uint32_t base = (smem_addr(wg_smem_raw) + 1023) & ~1023u;
    const uint32_t q_s = base, k_s = base + 2 * 64 * 128, v_s = k_s + 2 * BN * 128;
    const uint32_t b = smem_addr(&bar);
    if (threadIdx.x == 0) {
        mbar_init(b, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_expect_tx(b, 2 * 64 * 128 + 4 * BN * 128);
        for (int a = 0; a < 2; ++a) {
            tma_load(q_s + a * 64 * 128, q_map, a * SLAB, 0, b);
            tma_load(k_s + a * BN * 128, k_map, a * SLAB, 0, b);
            tma_load(v_s + a * BN * 128, v_map, a * SLAB, 0, b);
        }
    }
    mbar_wait(b, 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = warp * 16 + (lane >> 2);
    float s[64], o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    uint32_t p[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = r0 + (e & 1) * 8, col = kk * 16 + (e >> 1) * 8 + (lane & 3) * 2;
            const T *x = pm + row * 128 + col;
            p[kk][e] = TensorCore<T>::pack(to_f32(x[0]), to_f32(x[1]));
        }
    wg_fence();
    qk<T, 128>(s, q_s, k_s);
    pv<T>(o, p, v_s);
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        reg_fence(s[i]);
        reg_fence(o[i]);
        const int row = r0 + ((i >> 1) & 1) * 8, col = (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
        s_out[row * 128 + col] = s[i];
        o_out[row * 128 + col] = o[i];
    }
#endif
}

} // namespace sm90

// Entry points: flash_attn_wg_d{DK}_{bf16,f16} (attention.rs `WG_CONFIGS` repeats DK, DV, ST and
// sizes the launch: grid (nh, ceil(tq / 128)), 384 threads, `Smem::TOTAL` bytes).
#define FLASH_WG(T, SUFFIX, TAG, DK, DV, ST)                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1) flash_attn_wg_##TAG##_##SUFFIX(          \
        const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,     \
        const __grid_constant__ CUtensorMap v_map, T *out, long o_stride, int tq, int tk,         \
        int nh, int nkv, float scale, int window, const float *sinks) {                           \
        sm90::flash_wg<T, DK, DV, ST>(&q_map, &k_map, &v_map, out, o_stride, tq, tk, nh, nkv,     \
                                      scale, window, sinks);                                      \
    }
#define FLASH_WG_TYPES(TAG, DK, DV, ST)                                                           \
    FLASH_WG(__nv_bfloat16, bf16, TAG, DK, DV, ST)                                                \
    FLASH_WG(__half, f16, TAG, DK, DV, ST)
FLASH_WG_TYPES(d128, 128, 128, 2)
FLASH_WG_TYPES(d192, 192, 128, 2)

extern "C" __global__ void __launch_bounds__(128, 1)
    wg_tile_check_bf16(const __grid_constant__ CUtensorMap q_map,
                       const __grid_constant__ CUtensorMap k_map,
                       const __grid_constant__ CUtensorMap v_map, const __nv_bfloat16 *pm,
                       float *s_out, float *o_out) {
    sm90::tile_check<__nv_bfloat16>(&q_map, &k_map, &v_map, pm, s_out, o_out);
}
