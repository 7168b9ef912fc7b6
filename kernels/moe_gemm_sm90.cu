// moe_gemm_sm90.cu: the routed experts of a MoE layer as two grouped GEMMs for Hopper (sm_90a
// only), every touched expert's weights streamed once by the tensor memory accelerator (TMA)
// and multiplied with warpgroup MMAs (wgmma); the rows each expert owns are read on the device,
// so the host never waits for the routing.
//
//   x       [rows, k] at x[r * k + c]           rows sorted by expert (moe.cu's plan; read
//                                               through x_map)
//   offsets [experts + 1] u32                   expert e owns rows offsets[e]..offsets[e + 1]
//   w       [experts * rpe, k] at w[(e * rpe + j) * k + c]  (read through w_map)
//   out     [rows, n_out] at out[r * o_stride + j]
// moe_gemm_wg_gate_up_*: w holds each expert's gate rows then its up rows (rpe = 2 n_out,
//   transformers' `experts.gate_up_proj` [E, 2I, H]); out[r, j] = T(silu(g) * u) with
//   g = T(x_r . w[e, j]) and u = T(x_r . w[e, n_out + j]) rounded as GEMM outputs are and
//   silu(g) * u in f32 rounded once (common.cuh's silu_times): the unfused path's values.
// moe_gemm_wg_down_*: rpe = n_out; out[r, j] = T(x_r . w[e, j]).
// Products in f32 over k; k a multiple of 8 (16-byte TMA rows), experts <= MAX_EXPERTS.
//
// The weight is the stationary operand ("swap AB"): wgmma's M side (64 rows a warpgroup) is
// weight rows and its N side (16 to 96, in steps of 16) is the expert's token rows, so an
// expert with 48 tokens costs an N = 48 MMA, not a 128-row tile, and each weight byte is read
// once however the tokens spread. A tile is (expert e, block of weight rows, chunk of at most
// CHUNK = 96 of its rows): gate_up takes ROWS = 128 gate rows and the 128 up rows at the same
// output columns (two A boxes, SiLU-mul in the epilogue); down takes 2 x 128 consecutive rows.
// Tiles are numbered expert by expert, an expert's chunks of one weight block next to each
// other (they run side by side, so the second chunk reads the weights from L2, and the tiles
// that follow reuse the token chunks from L2), and a persistent grid of one block per SM walks
// them with a stride of gridDim.x. Each block first scans the experts' tile counts into shared
// memory (one warp) and finds a tile's expert by binary search.
//
// A block has three warpgroups: warpgroup 0 is the producer (one thread issues every TMA copy
// into an ST-stage ring: per stage two A boxes of 128 rows x 64 columns and the token chunk in
// boxes of 16 rows x 64 columns, zero-filled past the end; the ring runs on across tiles, so
// the next tile's loads start while the consumers store), warpgroups 1 and 2 consume 64 of the
// 128 rows of each A box and give a stage back as soon as their MMAs on it complete (one
// arrival per warp): the weight stream bounds the kernel, so every stage of the ring should be
// loading (BENCHMARKS.md runs 17-18). setmaxnreg moves registers from the producer (24) to the
// consumers (240). Shared memory per stage: A0, A1 (16 KiB each, [128 rows][64], 128-byte
// swizzle) and B ([96 rows][64]); wgmma descriptors as attention_sm90.cu's K-major operands
// (start + 32 bytes per 16 columns, stride byte offset 1024).
//
// Checked by: src/kernels/moe.rs, `tests::device_experts_match_reference` (GPU vs the CPU
// reference `moe_experts_ref`: ragged expert sizes with empty experts, an expert past one
// chunk, k and n_out that are not multiples of the tiles, bf16 and f16; the test also checks
// that this kernel ran, and the grouped cuBLAS path against the same reference). On a GPU that
// is not sm_90 the test says so and checks the cuBLAS path only.
#include "sm90.cuh"
#include "mma.cuh"

namespace moe90 {
using namespace sm90;

constexpr int ROWS = 128;     // weight rows per A box (two consumer warpgroups of 64)
constexpr int CHUNK = 96;     // token rows per tile at most
constexpr int TOK_BOX = 16;   // token rows per TMA box (the N step)
constexpr int KB = 64;        // k columns per stage: one 128-byte swizzled slab
constexpr int ST = 5;         // stages in the ring
constexpr int MATS = 2;       // A boxes per stage
constexpr int MAX_EXPERTS = 512;

constexpr int A_BYTES = ROWS * KB * 2;                  // one A box
constexpr int B_BYTES = CHUNK * KB * 2;                 // the token chunk
constexpr int STAGE_BYTES = MATS * A_BYTES + B_BYTES;   // 44 KiB
constexpr int SMEM_BYTES = ST * STAGE_BYTES + 1024;     // + alignment slack (moe/launch.rs repeats)
static_assert(SMEM_BYTES + (MAX_EXPERTS + 1) * 4 + 2 * ST * 8 <= 227 * 1024, "shared memory");

// d (+)= A (64 x 16, shared memory, K-major) x B (16 x N, shared memory, K-major):
// wgmma.m64nNk16 for N = 16, 32, ..., 128; `accumulate` = 0 overwrites d.
template <typename T, int N> struct Mma;

#define MG_C0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define MG_C1 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define MG_C2 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define MG_C3 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define MG_C4 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define MG_C5 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define MG_C6 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define MG_C7 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define MG_R8(b)                                                                                  \
    "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]),   \
        "+f"(d[b + 6]), "+f"(d[b + 7])
#define MG_R16 MG_R8(0)
#define MG_R32 MG_R16, MG_R8(8)
#define MG_R48 MG_R32, MG_R8(16)
#define MG_R64 MG_R48, MG_R8(24)
#define MG_R80 MG_R64, MG_R8(32)
#define MG_R96 MG_R80, MG_R8(40)
#define MG_R112 MG_R96, MG_R8(48)
#define MG_R128 MG_R112, MG_R8(56)
#define MG_D16 "{" MG_C0 "}"
#define MG_D32 "{" MG_C0 MG_C1 "}"
#define MG_D48 "{" MG_C0 MG_C1 MG_C2 "}"
#define MG_D64 "{" MG_C0 MG_C1 MG_C2 MG_C3 "}"
#define MG_D80 "{" MG_C0 MG_C1 MG_C2 MG_C3 MG_C4 "}"
#define MG_D96 "{" MG_C0 MG_C1 MG_C2 MG_C3 MG_C4 MG_C5 "}"
#define MG_D112 "{" MG_C0 MG_C1 MG_C2 MG_C3 MG_C4 MG_C5 MG_C6 "}"
#define MG_D128 "{" MG_C0 MG_C1 MG_C2 MG_C3 MG_C4 MG_C5 MG_C6 MG_C7 "}"

// A, B and the predicate are the operands right after the N / 2 accumulators.
#define MG_MMA(T, PTX, N, A, B, P)                                                                \
    template <> struct Mma<T, N> {                                                                \
        static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t a, uint64_t b,      \
                                                  int accumulate) {                               \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                           \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " "        \
                         MG_D##N ", " A ", " B ", p, 1, 1, 0, 0;\n}\n"                             \
                         : MG_R##N                                                                \
                         : "l"(a), "l"(b), "r"(accumulate));                                      \
        }                                                                                         \
    };
#define MG_MMA_TYPE(T, PTX)                                                                       \
    MG_MMA(T, PTX, 16, "%8", "%9", "%10")                                                         \
    MG_MMA(T, PTX, 32, "%16", "%17", "%18")                                                       \
    MG_MMA(T, PTX, 48, "%24", "%25", "%26")                                                       \
    MG_MMA(T, PTX, 64, "%32", "%33", "%34")                                                       \
    MG_MMA(T, PTX, 80, "%40", "%41", "%42")                                                       \
    MG_MMA(T, PTX, 96, "%48", "%49", "%50")                                                       \
    MG_MMA(T, PTX, 112, "%56", "%57", "%58")                                                      \
    MG_MMA(T, PTX, 128, "%64", "%65", "%66")
MG_MMA_TYPE(__nv_bfloat16, "bf16")
MG_MMA_TYPE(__half, "f16")

// Where a block's ring and barriers live.
struct Ring {
    uint32_t base; // 1024-aligned shared address of stage 0
    uint32_t bars; // ST "full" barriers, then ST "empty" barriers (8 bytes each)
    __device__ __forceinline__ uint32_t a(int st, int mat) const {
        return base + st * STAGE_BYTES + mat * A_BYTES;
    }
    __device__ __forceinline__ uint32_t b(int st) const {
        return base + st * STAGE_BYTES + MATS * A_BYTES;
    }
    __device__ __forceinline__ uint32_t full(int st) const { return bars + st * 8; }
    __device__ __forceinline__ uint32_t empty(int st) const { return bars + (ST + st) * 8; }
};

// One tile: which expert, its rows, which chunk of them and which block of weight rows.
struct Tile {
    int e, row0, rows, chunk, rb;
};

// The tile numbered `tile`: its expert is the last e with prefix[e] <= tile (experts without
// tiles share their prefix with the next one, so the last is the one that owns the tile).
__device__ __forceinline__ Tile decode(int tile, const int *prefix, const uint32_t *offsets,
                                       int experts, int row_blocks) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (prefix[mid] <= tile) lo = mid;
        else hi = mid - 1;
    }
    Tile t;
    t.e = lo;
    t.row0 = (int)offsets[lo];
    t.rows = (int)offsets[lo + 1] - t.row0;
    const int chunks = (t.rows + CHUNK - 1) / CHUNK, local = tile - prefix[lo];
    t.rb = local / chunks;
    t.chunk = local % chunks;
    return t;
}

// One consumer warpgroup's share of a tile with N (a multiple of 16 >= the chunk's rows) token
// columns: the k loop over the ring (`it` counts stages across tiles), then the stores.
// `acc` is the caller's, one array for every N (the first N / 2 of each row used): with an
// array per N, ptxas ran out of registers and serialised the MMAs.
template <typename T, int N, bool GATE_UP>
__device__ __forceinline__ void consume(float (&acc_all)[MATS][CHUNK / 2], const Ring &ring,
                                        int &it, int k_steps, const Tile &t, T *__restrict__ out,
                                        long o_stride, int n_out) {
#ifdef EAGLE_SM90A
    const int c = threadIdx.x / 128 - 1, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    // Accumulator `mat` is the first N / 2 of row `mat`, the same registers for every N.
    auto acc = [&](int mat) -> float(&)[N / 2] {
        return *reinterpret_cast<float(*)[N / 2]>(&acc_all[mat][0]);
    };
    for (int kt = 0; kt < k_steps; ++kt, ++it) {
        const int st = it % ST;
        mbar_wait(ring.full(st), (it / ST) & 1);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KB / 16; ++kk) {
            const uint64_t b = desc_sw128(ring.b(st) + kk * 32, 16, 1024);
#pragma unroll
            for (int mat = 0; mat < MATS; ++mat)
                Mma<T, N>::ss(acc(mat), desc_sw128(ring.a(st, mat) + c * 64 * 128 + kk * 32, 16, 1024),
                              b, kt > 0 || kk > 0);
        }
        wg_commit();
        // Release the stage as soon as its MMAs are done (one arrival per warp): the stream of
        // weights, not the MMAs, bounds the kernel, so every stage goes back to the producer at
        // once rather than after the next stage's MMAs are issued.
        wg_wait<0>();
        if (lane == 0) mbar_arrive(ring.empty(st));
    }
#pragma unroll
    for (int mat = 0; mat < MATS; ++mat)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) reg_fence(acc(mat)[i]);

    // Accumulator element i = 4 * n8 + q: weight row warp * 16 + lane / 4 + 8 * (q / 2) of this
    // warpgroup's 64, token 8 * n8 + 2 * (lane % 4) + q % 2 of the chunk.
    const int first = t.chunk * CHUNK, valid = min(CHUNK, t.rows - first);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        const int r = warp * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
        const int tok = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
        if (tok >= valid) continue;
        T *o = out + (long)(t.row0 + first + tok) * o_stride;
        if (GATE_UP) {
            const int j = t.rb * ROWS + c * 64 + r;
            if (j < n_out)
                o[j] = from_f32<T>(silu_times(round_to<T>(acc(0)[i]), round_to<T>(acc(1)[i])));
        } else {
#pragma unroll
            for (int mat = 0; mat < MATS; ++mat) {
                const int j = t.rb * MATS * ROWS + mat * ROWS + c * 64 + r;
                if (j < n_out) o[j] = from_f32<T>(acc(mat)[i]);
            }
        }
    }
#endif
}

template <typename T, bool GATE_UP>
__device__ __forceinline__ void moe_gemm(const CUtensorMap *w_map, const CUtensorMap *x_map,
                                         const uint32_t *__restrict__ offsets, T *__restrict__ out,
                                         long o_stride, int experts, int rpe, int n_out, int k) {
#ifdef EAGLE_SM90A
    extern __shared__ unsigned char mg_smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * ST];
    __shared__ int prefix[MAX_EXPERTS + 1];
    const Ring ring{(smem_addr(mg_smem_raw) + 1023) & ~1023u, smem_addr(&bars[0])};
    // gate_up: 128 output columns a tile (its gate and up rows); down: 2 x 128.
    const int tile_cols = GATE_UP ? ROWS : MATS * ROWS;
    const int row_blocks = (n_out + tile_cols - 1) / tile_cols;
    const int k_steps = (k + KB - 1) / KB;

    if (threadIdx.x < 32) {
        // prefix[e] = tiles of experts 0..e-1: each lane sums a run of experts, then a warp scan.
        const int lane = threadIdx.x, per = (experts + 31) / 32;
        const int lo = min(lane * per, experts), hi = min(lo + per, experts);
        auto tiles = [&](int e) {
            const int rows = (int)(offsets[e + 1] - offsets[e]);
            return (rows + CHUNK - 1) / CHUNK * row_blocks;
        };
        int sum = 0;
        for (int e = lo; e < hi; ++e) sum += tiles(e);
        int incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        int run = incl - sum;
        for (int e = lo; e < hi; ++e) {
            prefix[e] = run;
            run += tiles(e);
        }
        if (lane == 31) prefix[experts] = incl;
        if (lane == 0) {
            for (int st = 0; st < ST; ++st) {
                mbar_init(ring.full(st), 1);
                mbar_init(ring.empty(st), 8); // every consumer warp releases the stage
            }
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
    }
    __syncthreads();
    const int total = prefix[experts];

    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x == 0) {
            int it = 0;
            for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
                const Tile t = decode(tile, prefix, offsets, experts, row_blocks);
                const int first = t.chunk * CHUNK;
                const int boxes = (min(CHUNK, t.rows - first) + TOK_BOX - 1) / TOK_BOX;
                // The two A boxes: gate rows and the up rows n_out further, or 2 x 128 rows.
                const int w_row = t.e * rpe + t.rb * tile_cols;
                const int w_step = GATE_UP ? n_out : ROWS;
                const uint32_t bytes = MATS * A_BYTES + boxes * TOK_BOX * KB * 2;
                for (int kt = 0; kt < k_steps; ++kt, ++it) {
                    const int st = it % ST;
                    if (it >= ST) mbar_wait(ring.empty(st), ((it / ST) + 1) & 1);
                    mbar_expect_tx(ring.full(st), bytes);
                    for (int mat = 0; mat < MATS; ++mat)
                        tma_load(ring.a(st, mat), w_map, kt * KB, w_row + mat * w_step,
                                 ring.full(st));
                    for (int b = 0; b < boxes; ++b)
                        tma_load(ring.b(st) + b * TOK_BOX * 128, x_map, kt * KB,
                                 t.row0 + first + b * TOK_BOX, ring.full(st));
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
        int it = 0;
        float acc[MATS][CHUNK / 2];
        for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
            const Tile t = decode(tile, prefix, offsets, experts, row_blocks);
            const int boxes = (min(CHUNK, t.rows - t.chunk * CHUNK) + TOK_BOX - 1) / TOK_BOX;
            switch (boxes) {
            case 1: consume<T, 16, GATE_UP>(acc, ring, it, k_steps, t, out, o_stride, n_out); break;
            case 2: consume<T, 32, GATE_UP>(acc, ring, it, k_steps, t, out, o_stride, n_out); break;
            case 3: consume<T, 48, GATE_UP>(acc, ring, it, k_steps, t, out, o_stride, n_out); break;
            case 4: consume<T, 64, GATE_UP>(acc, ring, it, k_steps, t, out, o_stride, n_out); break;
            case 5: consume<T, 80, GATE_UP>(acc, ring, it, k_steps, t, out, o_stride, n_out); break;
            default: consume<T, 96, GATE_UP>(acc, ring, it, k_steps, t, out, o_stride, n_out); break;
            }
        }
    }
#endif
}

} // namespace moe90

// Entry points: moe_gemm_wg_{gate_up,down}_{bf16,f16} (moe/launch.rs `moe_gemm_wg` sizes the launch:
// min(SMs, an upper bound on the tiles) blocks of 384 threads, SMEM_BYTES of shared memory).
#define MOE_GEMM_WG(T, SUFFIX, TAG, GATE_UP)                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1) moe_gemm_wg_##TAG##_##SUFFIX(            \
        const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,     \
        const uint32_t *offsets, T *out, long o_stride, int experts, int rpe, int n_out, int k) { \
        moe90::moe_gemm<T, GATE_UP>(&w_map, &x_map, offsets, out, o_stride, experts, rpe, n_out,  \
                                    k);                                                           \
    }
MOE_GEMM_WG(__nv_bfloat16, bf16, gate_up, true)
MOE_GEMM_WG(__half, f16, gate_up, true)
MOE_GEMM_WG(__nv_bfloat16, bf16, down, false)
MOE_GEMM_WG(__half, f16, down, false)
