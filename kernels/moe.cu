// moe.cu: MoE routing (DeepSeek-V3 `noaux_tc` and plain softmax / sigmoid top-k), the dispatch
// plan that sorts assignments by expert,
// and the weighted combine of the expert outputs. The expert GEMMs between the gather
// (gather.cu) and the combine are cuBLAS grouped GEMMs issued from Rust (src/kernels/gemm.rs).
//
// moe_route(logits [T, E] f32, bias [E] f32, topk_idx [T, K] int out, topk_w [T, K] f32 out,
//           T, E, n_group, topk_group, K, norm_topk, scaling, softmax)
//   score = sigmoid(logit) = 1 / (1 + exp(-logit)), exp in double rounded to f32 (so the CPU
//   reference, which does the same, agrees bit for bit; f32 expf would differ by an ulp);
//   with softmax set, score = exp(logit - max) / sum over the token's experts, the exps and
//   their sum in double, summed in expert order by one lane, each score rounded once to f32
//   (src/routing.rs `router_softmax` is the same sequence);
//   choice = score + bias; a group's score is the sum of its two best choices; the best
//   topk_group groups are kept (ties: lower index); the top K choices among kept experts win
//   (ties: lower index; "best" is f32 total order, as Rust's total_cmp); weights are the
//   unbiased scores of the winners, normalised over the picks (+1e-20) when norm_topk, times
//   scaling; output sorted by expert id ascending. One warp per token. Needs E % n_group == 0,
//   E <= 1024, n_group <= 64, K <= 32 (checked by the launcher).
//
// moe_plan_count / moe_plan_scan / moe_plan_place (three launches, one plan):
//   topk_idx [T, K] -> counts [E], offsets [E + 1], perm_token [T * K], row_of [T * K]
//   assignments sorted by expert ascending, within an expert by token ascending (a stable
//   counting sort, deterministic); perm_token[r] is the token of sorted row r and
//   row_of[t * K + k] the sorted row of token t's k-th pick. An expert id outside 0..E is left
//   out of the plan and its row_of is -1. Workspace: [ceil(T / 256), E] ints.
//
// moe_combine(ys [T*K, H] in sorted-row order, row_of [T*K], topk_w [T, K] f32,
//             shared [T, H] or null, out [T, H], T, K, H)
//   out[t] = T( sum_k w[t,k] * ys[row_of[t*K+k]] (f32, k ascending, no fused multiply-add)
//               + shared[t] ); a row_of of -1 contributes nothing. All contiguous.
//
// Checked by: src/kernels/moe.rs, `tests::route_matches_route_token` (the reference is
// routing::route_token itself), `tests::device_route_is_bit_exact`,
// `tests::device_plan_matches_reference`, `tests::device_combine_matches_reference`.
#include "common.cuh"

// Rust's f32::total_cmp order as a signed integer key.
__device__ __forceinline__ int total_key(float v) {
    const int b = __float_as_int(v);
    return b ^ (int)(((unsigned)(b >> 31)) >> 1);
}

// True when (ka, ia) ranks before (kb, ib): larger key first, then lower index.
__device__ __forceinline__ bool ranks_before(int ka, int ia, int kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

__device__ __forceinline__ float router_sigmoid(float x) {
    const float e = (float)exp(-(double)x);
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, e));
}

#define ROUTE_WARPS 4
#define ROUTE_MAX_GROUPS 64

extern "C" __global__ void moe_route(const float *logits, const float *bias, int *topk_idx,
                                     float *topk_w, int T, int E, int n_group, int topk_group,
                                     int K, int norm_topk, float scaling, int softmax) {
    extern __shared__ float route_smem[]; // per warp: scores[E], choice[E], group[64]
    __shared__ int picks_all[ROUTE_WARPS][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long t = (long)blockIdx.x * ROUTE_WARPS + warp;
    if (t >= T) return; // uniform over the warp
    float *score = route_smem + warp * (2 * E + ROUTE_MAX_GROUPS);
    float *choice = score + E;
    float *group = choice + E;
    int *picks = picks_all[warp];
    const float *lg = logits + t * E;
    if (softmax) {
        // The row max by a warp reduction (exact), then one lane sums the exps in expert order.
        float m = -INFINITY;
        for (int e = lane; e < E; e += 32) m = fmaxf(m, lg[e]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) {
            double sum = 0.0;
            for (int e = 0; e < E; ++e) sum += exp((double)lg[e] - (double)m);
            for (int e = 0; e < E; ++e) {
                const float s = (float)(exp((double)lg[e] - (double)m) / sum);
                score[e] = s;
                choice[e] = __fadd_rn(s, bias[e]);
            }
        }
    } else {
        for (int e = lane; e < E; e += 32) {
            const float s = router_sigmoid(lg[e]);
            score[e] = s;
            choice[e] = __fadd_rn(s, bias[e]);
        }
    }
    __syncwarp();
    const int gsize = E / n_group;
    // A group's score: the sum of its two best choices (its only choice when it has one).
    for (int g = lane; g < n_group; g += 32) {
        int b1 = -1, b2 = -1;
        for (int e = g * gsize; e < (g + 1) * gsize; ++e) {
            const int k = total_key(choice[e]);
            if (b1 < 0 || ranks_before(k, e, total_key(choice[b1]), b1)) {
                b2 = b1;
                b1 = e;
            } else if (b2 < 0 || ranks_before(k, e, total_key(choice[b2]), b2)) {
                b2 = e;
            }
        }
        group[g] = b2 < 0 ? choice[b1] : __fadd_rn(choice[b1], choice[b2]);
    }
    __syncwarp();
    // Kept groups: the topk_group best group scores. Each lane ranks the groups it owns.
    unsigned long long kept = 0; // bit g set when group g is kept (n_group <= 64)
    for (int g = 0; g < n_group; ++g) {
        int rank = 0;
        const int kg = total_key(group[g]);
        for (int o = lane; o < n_group; o += 32)
            rank += ranks_before(total_key(group[o]), o, kg, g) ? 1 : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
        if (rank < topk_group) kept |= 1ull << g;
    }
    // K rounds of a warp-wide argmax over the masked choices; lane l owns experts l, l+32, ...
    const int neg_inf = total_key(-INFINITY);
    unsigned taken = 0; // bit j: expert lane + 32 j already picked
    for (int r = 0; r < K; ++r) {
        int best_k = 0, best_e = -1;
        for (int j = 0, e = lane; e < E; ++j, e += 32) {
            if (taken >> j & 1u) continue;
            const int k = (kept >> (e / gsize) & 1ull) ? total_key(choice[e]) : neg_inf;
            if (best_e < 0 || ranks_before(k, e, best_k, best_e)) {
                best_k = k;
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const int ok = __shfl_xor_sync(0xffffffffu, best_k, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (oe >= 0 && (best_e < 0 || ranks_before(ok, oe, best_k, best_e))) {
                best_k = ok;
                best_e = oe;
            }
        }
        if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
        if (lane == 0) picks[r] = best_e;
    }
    __syncwarp();
    if (lane == 0) {
        for (int i = 1; i < K; ++i) { // insertion sort, K <= 32
            const int v = picks[i];
            int j = i - 1;
            for (; j >= 0 && picks[j] > v; --j) picks[j + 1] = picks[j];
            picks[j + 1] = v;
        }
        float denom = 0.f;
        if (norm_topk) {
            for (int i = 0; i < K; ++i) denom = __fadd_rn(denom, score[picks[i]]);
            denom = __fadd_rn(denom, 1e-20f);
        }
        for (int i = 0; i < K; ++i) {
            float w = score[picks[i]];
            if (norm_topk) w = __fdiv_rn(w, denom);
            topk_idx[t * K + i] = picks[i];
            topk_w[t * K + i] = __fmul_rn(w, scaling);
        }
    }
}

#define PLAN_CHUNK 256

// Per chunk of 256 tokens: how many of its assignments go to each expert.
// grid: ceil(T / 256) blocks of 256 threads; dynamic smem E ints.
extern "C" __global__ void moe_plan_count(const int *topk_idx, int T, int K, int E,
                                          int *chunk_counts /* [chunks, E] */) {
    extern __shared__ int plan_counts[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) plan_counts[e] = 0;
    __syncthreads();
    const long t = (long)blockIdx.x * PLAN_CHUNK + threadIdx.x;
    if (t < T)
        for (int k = 0; k < K; ++k) {
            const unsigned e = (unsigned)topk_idx[t * K + k];
            if (e < (unsigned)E) atomicAdd(&plan_counts[e], 1);
        }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        chunk_counts[(long)blockIdx.x * E + e] = plan_counts[e];
}

// One block of blockDim >= E threads: counts, offsets, and (in place) each chunk's first row
// per expert. Thread e walks the chunks in order; the scan over experts is sequential in
// thread 0 (E <= 1024: a few microseconds, and exact).
extern "C" __global__ void moe_plan_scan(int *chunk_counts /* in: counts, out: bases */,
                                         int chunks, int E, int *counts, int *offsets) {
    extern __shared__ int plan_totals[];
    const int e = threadIdx.x;
    if (e < E) {
        int total = 0;
        for (int c = 0; c < chunks; ++c) total += chunk_counts[(long)c * E + e];
        plan_totals[e] = total;
        counts[e] = total;
    }
    __syncthreads();
    if (e == 0) {
        int acc = 0;
        for (int i = 0; i < E; ++i) {
            const int n = plan_totals[i];
            plan_totals[i] = acc;
            offsets[i] = acc;
            acc += n;
        }
        offsets[E] = acc;
    }
    __syncthreads();
    if (e < E) {
        int base = plan_totals[e];
        for (int c = 0; c < chunks; ++c) {
            const int n = chunk_counts[(long)c * E + e];
            chunk_counts[(long)c * E + e] = base;
            base += n;
        }
    }
}

// Per chunk: each assignment's rank among the chunk's earlier tokens routed to the same expert
// (a bitmap of tokens per expert, popcounts below the token's bit), plus the chunk's base row.
// grid: ceil(T / 256) blocks of 256 threads; dynamic smem E * 8 words.
extern "C" __global__ void moe_plan_place(const int *topk_idx, int T, int K, int E,
                                          const int *chunk_base, int *perm_token, int *row_of) {
    extern __shared__ unsigned plan_bits[]; // [E][PLAN_CHUNK / 32]
    constexpr int W = PLAN_CHUNK / 32;
    for (int i = threadIdx.x; i < E * W; i += blockDim.x) plan_bits[i] = 0;
    __syncthreads();
    const int local = threadIdx.x;
    const long t = (long)blockIdx.x * PLAN_CHUNK + local;
    if (t < T)
        for (int k = 0; k < K; ++k) {
            const unsigned e = (unsigned)topk_idx[t * K + k];
            if (e < (unsigned)E) atomicOr(&plan_bits[e * W + local / 32], 1u << (local % 32));
        }
    __syncthreads();
    if (t >= T) return;
    for (int k = 0; k < K; ++k) {
        const unsigned e = (unsigned)topk_idx[t * K + k];
        if (e >= (unsigned)E) {
            row_of[t * K + k] = -1;
            continue;
        }
        const unsigned *bits = plan_bits + e * W;
        int rank = __popc(bits[local / 32] & ((1u << (local % 32)) - 1u));
        for (int w = 0; w < local / 32; ++w) rank += __popc(bits[w]);
        const int row = chunk_base[(long)blockIdx.x * E + e] + rank;
        perm_token[row] = (int)t;
        row_of[t * K + k] = row;
    }
}

template <typename T>
__device__ __forceinline__ void moe_combine_row(const T *ys, const int *row_of, const float *w,
                                                const T *shared, T *out, int K, int H) {
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k) {
            const int row = row_of[k];
            if (row >= 0) acc = __fadd_rn(acc, __fmul_rn(w[k], to_f32(ys[(long)row * H + h])));
        }
        if (shared) acc = __fadd_rn(acc, to_f32(shared[h]));
        out[h] = from_f32<T>(acc);
    }
}

#define MOE_COMBINE(T, SUFFIX)                                                                    \
    extern "C" __global__ void moe_combine_##SUFFIX(const T *ys, const int *row_of,               \
                                                    const float *topk_w, const T *shared, T *out, \
                                                    int T_, int K, int H) {                       \
        const long t = blockIdx.x;                                                                \
        if (t >= T_) return;                                                                      \
        moe_combine_row<T>(ys, row_of + t * K, topk_w + t * K, shared ? shared + t * H : nullptr, \
                           out + t * H, K, H);                                                    \
    }
EAGLE_FOR_EACH_FLOAT(MOE_COMBINE)
