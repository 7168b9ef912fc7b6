// score.cu: the diff engine's scoring, every captured slot against every candidate reference
// state in one pass (the GPU form of diff::score::score_all).
//
//   x          [rows, x_stride] f32: slot s is columns s*cols .. (s+1)*cols
//   refs       [n_states, ref_rows, ref_stride] f32: state q, row r at refs + (q*ref_rows + r)*ref_stride
//   cand_state, cand_shift [n_cand] int: candidate j pairs captured row t with row t + shift of
//              state cand_state[j], for the t < rows with 0 <= t + shift < ref_rows
// For every (slot, candidate): xx = sum x*x, xc = sum x*c, cc = sum c*c over those rows and the
// columns c < cols, skipping non-finite x values (a non-finite reference value is kept: it
// poisons the sums, as on the CPU).
//
// score_partials: grid (chunks, k, ceil(n_cand / 4)), 256 threads (both kernels take the same
//   arguments). Block (chunk, s, group)
//   accumulates rows chunk*rows_per_chunk .. for slot s and four candidates, f32 per thread,
//   then reduces the block in double in a fixed order into
//   partials [k, n_cand, chunks, 3] (double).
// score_partials_vec: the same sums and partials with fewer, wider reads, for 16-byte aligned
//   rows (cols, x_stride, ref_stride multiples of 4; the launcher checks). Grid
//   (ceil(n_cand / 4), chunks, ceil(k / 4)), 128 threads: block (group, chunk, slot batch)
//   reads float4s, each reference value once for up to four slots (score_partials reads it
//   once per slot), and the chunk is the slowest grid index, so the blocks in flight share
//   their chunk's captured rows in L2 (and a state's shifted candidates share rows in L1).
//   A non-finite captured value contributes nothing, as above, by selecting zeros for it.
// score_finish: one thread per (slot, candidate) sums its chunks in order into
//   out [k, n_cand, 3] (double: xx, xc, cc) and writes the pair's row count to rows_out [k, n_cand].
// A candidate naming a state outside 0..n_states gets NaN sums (the launcher refuses it first).
//
// Checked by: src/kernels/score.rs, `tests::reference_matches_score_all` (the reference vs
// diff::score::score_all) and `tests::device_matches_reference`.
#include "common.cuh"

#define SCORE_THREADS 256
#define SCORE_GROUP 4

extern "C" __global__ void score_partials(const float *x, long x_stride, int rows, int cols,
                                          int k, const float *refs, int n_states, int ref_rows,
                                          long ref_stride, const int *cand_state,
                                          const int *cand_shift, int n_cand, int rows_per_chunk,
                                          double *partials) {
    __shared__ double scratch[SCORE_THREADS / 32][3 * SCORE_GROUP];
    const int chunk = blockIdx.x, slot = blockIdx.y, j0 = blockIdx.z * SCORE_GROUP;
    if (slot >= k) return; // uniform over the block
    const int chunks = gridDim.x;
    const float *ref_row0[SCORE_GROUP];
    int shift[SCORE_GROUP];
    bool live[SCORE_GROUP], bad[SCORE_GROUP];
#pragma unroll
    for (int g = 0; g < SCORE_GROUP; ++g) {
        const int j = j0 + g;
        live[g] = j < n_cand;
        const int q = live[g] ? cand_state[j] : 0;
        bad[g] = live[g] && (q < 0 || q >= n_states);
        shift[g] = live[g] ? cand_shift[j] : 0;
        ref_row0[g] = refs + (long)(bad[g] ? 0 : q) * ref_rows * ref_stride;
    }
    float acc[SCORE_GROUP][3] = {};
    const int t_end = min(rows, (chunk + 1) * rows_per_chunk);
    for (int t = chunk * rows_per_chunk; t < t_end; ++t) {
        const float *xr = x + (long)t * x_stride + (long)slot * cols;
        for (int c = threadIdx.x; c < cols; c += SCORE_THREADS) {
            const float xv = xr[c];
            if (!isfinite(xv)) continue;
#pragma unroll
            for (int g = 0; g < SCORE_GROUP; ++g) {
                const long rt = (long)t + shift[g];
                if (!live[g] || bad[g] || rt < 0 || rt >= ref_rows) continue;
                const float cv = ref_row0[g][rt * ref_stride + c];
                acc[g][0] += xv * xv;
                acc[g][1] += xv * cv;
                acc[g][2] += cv * cv;
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < SCORE_GROUP; ++g)
#pragma unroll
        for (int m = 0; m < 3; ++m) {
            const double v = warp_sum((double)acc[g][m]);
            if (lane == 0) scratch[warp][g * 3 + m] = v;
        }
    __syncthreads();
    if (threadIdx.x < 3 * SCORE_GROUP) {
        const int g = threadIdx.x / 3, m = threadIdx.x % 3, j = j0 + g;
        if (j < n_cand) {
            double v = 0.0;
            for (int w = 0; w < SCORE_THREADS / 32; ++w) v += scratch[w][threadIdx.x];
            const int q = cand_state[j];
            if (q < 0 || q >= n_states) v = __longlong_as_double(0x7ff8000000000000ll);
            partials[(((long)slot * n_cand + j) * chunks + chunk) * 3 + m] = v;
        }
    }
}

#define SCORE_SLOTS 4
#define SCORE_VEC_THREADS 128

extern "C" __global__ void score_partials_vec(const float *x, long x_stride, int rows, int cols,
                                              int k, const float *refs, int n_states,
                                              int ref_rows, long ref_stride,
                                              const int *cand_state, const int *cand_shift,
                                              int n_cand, int rows_per_chunk, double *partials) {
    __shared__ double scratch[SCORE_VEC_THREADS / 32][3 * SCORE_GROUP * SCORE_SLOTS];
    const int j0 = blockIdx.x * SCORE_GROUP, chunk = blockIdx.y, s0 = blockIdx.z * SCORE_SLOTS;
    const int chunks = gridDim.y, ns = min(SCORE_SLOTS, k - s0), cols4 = cols / 4;
    const float *ref_row0[SCORE_GROUP];
    int shift[SCORE_GROUP];
    bool use[SCORE_GROUP];
#pragma unroll
    for (int g = 0; g < SCORE_GROUP; ++g) {
        const int j = j0 + g;
        const bool live = j < n_cand;
        const int q = live ? cand_state[j] : 0;
        use[g] = live && q >= 0 && q < n_states;
        shift[g] = live ? cand_shift[j] : 0;
        ref_row0[g] = refs + (long)(use[g] ? q : 0) * ref_rows * ref_stride;
    }
    float acc[SCORE_SLOTS][SCORE_GROUP][3] = {};
    const int t_end = min(rows, (chunk + 1) * rows_per_chunk);
    for (int t = chunk * rows_per_chunk; t < t_end; ++t) {
        const float4 *xr = reinterpret_cast<const float4 *>(x + (long)t * x_stride + (long)s0 * cols);
        const float4 *cr[SCORE_GROUP];
        bool in[SCORE_GROUP];
#pragma unroll
        for (int g = 0; g < SCORE_GROUP; ++g) {
            const long rt = (long)t + shift[g];
            in[g] = use[g] && rt >= 0 && rt < ref_rows;
            cr[g] = reinterpret_cast<const float4 *>(ref_row0[g] + (in[g] ? rt : 0) * ref_stride);
        }
        for (int c = threadIdx.x; c < cols4; c += SCORE_VEC_THREADS) {
            float xv[SCORE_SLOTS][4];
            bool ok[SCORE_SLOTS][4];
#pragma unroll
            for (int s = 0; s < SCORE_SLOTS; ++s) {
                const float4 v = s < ns ? xr[s * cols4 + c] : make_float4(0.f, 0.f, 0.f, 0.f);
                const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    ok[s][i] = isfinite(e[i]);
                    xv[s][i] = ok[s][i] ? e[i] : 0.f;
                }
            }
#pragma unroll
            for (int g = 0; g < SCORE_GROUP; ++g) {
                if (!in[g]) continue;
                const float4 v = cr[g][c];
                const float cv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int s = 0; s < SCORE_SLOTS; ++s) {
                    if (s >= ns) continue;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float cs = ok[s][i] ? cv[i] : 0.f;
                        acc[s][g][0] += xv[s][i] * xv[s][i];
                        acc[s][g][1] += xv[s][i] * cs;
                        acc[s][g][2] += cs * cs;
                    }
                }
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int s = 0; s < SCORE_SLOTS; ++s)
#pragma unroll
        for (int g = 0; g < SCORE_GROUP; ++g)
#pragma unroll
            for (int m = 0; m < 3; ++m) {
                if (s >= ns) continue;
                const double v = warp_sum((double)acc[s][g][m]);
                if (lane == 0) scratch[warp][(s * SCORE_GROUP + g) * 3 + m] = v;
            }
    __syncthreads();
    const int n_out = ns * SCORE_GROUP * 3;
    for (int i = threadIdx.x; i < n_out; i += SCORE_VEC_THREADS) {
        const int s = i / (3 * SCORE_GROUP), g = (i / 3) % SCORE_GROUP, m = i % 3, j = j0 + g;
        if (j >= n_cand) continue;
        double v = 0.0;
        for (int w = 0; w < SCORE_VEC_THREADS / 32; ++w) v += scratch[w][i];
        const int q = cand_state[j];
        if (q < 0 || q >= n_states) v = __longlong_as_double(0x7ff8000000000000ll);
        partials[(((long)(s0 + s) * n_cand + j) * chunks + chunk) * 3 + m] = v;
    }
}

extern "C" __global__ void score_finish(const double *partials, int chunks, int k, int n_cand,
                                        int rows, int ref_rows, const int *cand_shift,
                                        double *out, int *rows_out) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x; // (slot, candidate)
    if (i >= (long)k * n_cand) return;
    const double *p = partials + i * chunks * 3;
    double s[3] = {0.0, 0.0, 0.0};
    for (int c = 0; c < chunks; ++c)
        for (int m = 0; m < 3; ++m) s[m] += p[c * 3 + m];
    for (int m = 0; m < 3; ++m) out[i * 3 + m] = s[m];
    const long shift = cand_shift[i % n_cand];
    const long lo = max(0l, -shift), hi = min((long)rows, (long)ref_rows - shift);
    rows_out[i] = (int)max(0l, hi - lo);
}
