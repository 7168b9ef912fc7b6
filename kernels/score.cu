// score.cu: the diff engine's scoring, captured slots against candidate reference states in one
// pass (the GPU form of diff::score::score_all), for many jobs at once: a job is one set of
// slots (one sample's, or one reference state read as a slot) against its own states, so one
// launch scores every sample of a batch.
//
//   cand       [3, n_cand] int64: state, shift and job of candidate j. Candidate j pairs the
//              job's captured row t with row t + shift of state `state`, for the t < rows with
//              0 <= t + shift < ref_rows. Every four candidates 4g..4g+3 belong to one job (the
//              launcher pads with state -1).
//   jobs       [7, n_jobs] int64: x (the device address of the job's row 0), x_stride,
//              rows, ref_rows, ref_stride (elements), slot0, slots. Slot s of a job is columns
//              s*cols .. (s+1)*cols of its x rows where slot0 < 0; else slot s's rows start at
//              state_ptr[slot0 + s], x_stride apart (states read as slots: the separations).
//              A job scores its own `slots` (at most the launch's k): the blocks of its higher
//              slots return at once, and score_finish gives those pairs NaN sums and no rows,
//              so jobs of several slot counts share one launch.
//   state_ptr  [n_states] int64: the device address of each state's row 0 (rows ref_stride
//              apart).
//   edge       0, or e > 0: the sums are taken twice in the same pass, over every row and over
//              the interior rows e .. rows - e alone (the diff's bound pairs those), each with
//              its own row count; see `chunk_span`.
// The values are f32 or bf16, one pair of types a launch (the entry points' suffix, below):
// a bf16 value is widened to f32 as it is read, exactly, so the sums are those of the widened
// tensors; a forward's bf16 states are scored as it made them, without a widened copy.
// For every (slot, candidate): xx = sum x*x, xc = sum x*c, cc = sum c*c over those rows and the
// columns c < cols, skipping non-finite x values (a non-finite reference value is kept: it
// poisons the sums, as on the CPU). A candidate whose state is outside 0..n_states or whose job
// is not its group's gets NaN sums.
//
// score_partials (Acc = float), score_partials_f64 (Acc = double: products and sums in f64, the
//   exact rescoring of a best candidate): grid (chunks, k, ceil(n_cand / 4)), 256 threads. Block
//   (chunk, s, group) accumulates the chunk's rows for slot s and four candidates in Acc per
//   thread, then reduces the block in double in a fixed order into
//   partials [k, n_cand, chunks, 3] (double).
// score_partials_vec: the f32 sums and partials with fewer, wider reads and fewer operations
//   (cols, every stride a multiple of 4, every address a multiple of four values; the launcher
//   checks). Grid (ceil(n_cand / 4), chunks, ceil(k / 4)), 128 threads: block (group, chunk,
//   slot batch) reads four values at a time, each reference value once for up to four slots,
//   and the chunk is the slowest grid index, so the blocks in flight share their chunk's
//   captured rows in L2 (and a state's shifted candidates share rows in L1). What does not
//   depend on the candidate is summed once: a row's x*x once per slot (added to each candidate
//   that pairs the row), c*c once per candidate for the slots together where the values read
//   are all finite (a thread's four columns of every slot: the sum of their squares is
//   finite); elsewhere every value on its own, a non-finite one selecting zeros as above.
//   All of an iteration's reads are issued before any is used (`Raw4`), so a thread waits for
//   one memory latency an iteration, not one per candidate; the rarely touched sums sit in
//   shared memory, and the kernel fits 128 registers (four blocks a multiprocessor). On an H100
//   this took the flush bench's split pass from 0.34 to 0.56 of the HBM floor at T = 2,048
//   (BENCHMARKS.md, run 53).
// score_finish: one thread per (slot, candidate) sums its chunks in order into
//   out [k, n_cand, 4] (double: xx, xc, cc and the pair's row count), so that one read-back
//   brings every sum of a launch; with an edge, out [k, n_cand, 8]: those, then the same four
//   over the interior rows.
// A chunk past a job's rows adds nothing.
//
// Checked by: src/kernels/score.rs, `tests::reference_matches_score_all` (the reference vs
// diff::score::score_all), `tests::jobs_match_each_job_alone`, `tests::device_matches_reference`
// (with and without an edge), `tests::device_bf16_values_score_as_their_widening` and
// `tests::device_jobs_of_their_own_slot_counts_score_as_each_alone` (bit for bit).
#include "common.cuh"

#define SCORE_THREADS 256
#define SCORE_GROUP 4

#define JOB_X 0
#define JOB_X_STRIDE 1
#define JOB_ROWS 2
#define JOB_REF_ROWS 3
#define JOB_REF_STRIDE 4
#define JOB_SLOT0 5
#define JOB_SLOTS 6

template <typename X> struct Job {
    const X *x;
    long x_stride, rows, ref_rows, ref_stride, slot0, slots;
};

template <typename X>
__device__ __forceinline__ Job<X> job_at(const long long *jobs, int n_jobs, long long j) {
    Job<X> r;
    r.x = reinterpret_cast<const X *>(jobs[JOB_X * n_jobs + j]);
    r.x_stride = jobs[JOB_X_STRIDE * n_jobs + j];
    r.rows = jobs[JOB_ROWS * n_jobs + j];
    r.ref_rows = jobs[JOB_REF_ROWS * n_jobs + j];
    r.ref_stride = jobs[JOB_REF_STRIDE * n_jobs + j];
    r.slot0 = jobs[JOB_SLOT0 * n_jobs + j];
    r.slots = jobs[JOB_SLOTS * n_jobs + j];
    return r;
}

// Row 0 of slot s of a job: x's columns from s * cols, or a state's row 0 (see `jobs`).
template <typename X>
__device__ __forceinline__ const X *slot_row0(const Job<X> &job, const long long *state_ptr, int s,
                                              int cols) {
    return job.slot0 < 0 ? job.x + (long)s * cols
                         : reinterpret_cast<const X *>(state_ptr[job.slot0 + s]);
}

// Rows lo .. hi of a job of `rows` captured rows that chunk `chunk` sums. Without an edge, chunk
// c is rows c * rows_per_chunk ..; with edge e, chunk 0 is the head rows 0 .. e, chunk 1 the
// tail rows - e .. rows, and chunk 2 + c the interior's rows e + c * rows_per_chunk .., so that
// the interior's sums are those of chunks 2.. and every row's those of all.
__device__ __forceinline__ void chunk_span(int chunk, long rows, int edge, int rows_per_chunk,
                                           long &lo, long &hi) {
    if (edge == 0) {
        lo = (long)chunk * rows_per_chunk;
        hi = min(rows, lo + rows_per_chunk);
        return;
    }
    const long head = min((long)edge, rows), tail = max(head, rows - edge);
    if (chunk < 2) {
        lo = chunk == 0 ? 0 : tail;
        hi = chunk == 0 ? head : rows;
        return;
    }
    lo = head + (long)(chunk - 2) * rows_per_chunk;
    hi = min(tail, lo + rows_per_chunk);
}

// The job of candidate group starting at j0 (its first candidate's), and per candidate of the
// group whether it is scored, its state's row 0 and its shift.
template <typename C> struct Group4 {
    long long job;
    bool use[SCORE_GROUP];
    const C *row0[SCORE_GROUP];
    long shift[SCORE_GROUP];
};

template <typename C>
__device__ __forceinline__ Group4<C> group_at(const long long *cand, int n_cand,
                                              const long long *state_ptr, int n_states, int n_jobs,
                                              int j0) {
    Group4<C> g;
    g.job = cand[2 * n_cand + j0];
    const bool job_ok = g.job >= 0 && g.job < n_jobs;
#pragma unroll
    for (int i = 0; i < SCORE_GROUP; ++i) {
        const int j = j0 + i;
        const bool live = j < n_cand;
        const long long q = live ? cand[j] : 0;
        g.use[i] = live && job_ok && q >= 0 && q < n_states && cand[2 * n_cand + j] == g.job;
        g.shift[i] = live ? (long)cand[n_cand + j] : 0;
        g.row0[i] = reinterpret_cast<const C *>(g.use[i] ? state_ptr[q] : 0);
    }
    if (!job_ok) g.job = 0;
    return g;
}

template <typename X, typename C, typename Acc>
__device__ __forceinline__ void score_partials_impl(const long long *cand, int n_cand,
                                                    const long long *jobs, int n_jobs,
                                                    const long long *state_ptr, int n_states,
                                                    int cols, int k, int rows_per_chunk, int edge,
                                                    double *partials) {
    __shared__ double scratch[SCORE_THREADS / 32][3 * SCORE_GROUP];
    const int chunk = blockIdx.x, slot = blockIdx.y, j0 = blockIdx.z * SCORE_GROUP;
    if (slot >= k) return; // uniform over the block
    const int chunks = gridDim.x;
    const Group4<C> g = group_at<C>(cand, n_cand, state_ptr, n_states, n_jobs, j0);
    const Job<X> job = job_at<X>(jobs, n_jobs, g.job);
    if (slot >= job.slots) return; // uniform over the block; score_finish writes NaN
    Acc acc[SCORE_GROUP][3] = {};
    long lo, hi;
    chunk_span(chunk, job.rows, edge, rows_per_chunk, lo, hi);
    const X *x0 = slot_row0(job, state_ptr, slot, cols);
    for (long t = lo; t < hi; ++t) {
        const X *xr = x0 + t * job.x_stride;
        for (int c = threadIdx.x; c < cols; c += SCORE_THREADS) {
            const float xv = to_f32(xr[c]);
            if (!isfinite(xv)) continue;
#pragma unroll
            for (int i = 0; i < SCORE_GROUP; ++i) {
                const long rt = t + g.shift[i];
                if (!g.use[i] || rt < 0 || rt >= job.ref_rows) continue;
                const Acc cv = (Acc)to_f32(g.row0[i][rt * job.ref_stride + c]), x = (Acc)xv;
                acc[i][0] += x * x;
                acc[i][1] += x * cv;
                acc[i][2] += cv * cv;
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < SCORE_GROUP; ++i)
#pragma unroll
        for (int m = 0; m < 3; ++m) {
            const double v = warp_sum((double)acc[i][m]);
            if (lane == 0) scratch[warp][i * 3 + m] = v;
        }
    __syncthreads();
    if (threadIdx.x < 3 * SCORE_GROUP) {
        const int i = threadIdx.x / 3, m = threadIdx.x % 3, j = j0 + i;
        if (j < n_cand) {
            double v = 0.0;
            for (int w = 0; w < SCORE_THREADS / 32; ++w) v += scratch[w][threadIdx.x];
            if (!g.use[i]) v = __longlong_as_double(0x7ff8000000000000ll);
            partials[(((long)slot * n_cand + j) * chunks + chunk) * 3 + m] = v;
        }
    }
}

#define SCORE_SLOTS 4
#define SCORE_VEC_THREADS 128

// The raw bits of four consecutive values: loaded first, widened later, so that all of an
// iteration's reads are in flight before any is used. Through the read-only path (`__ldg`):
// nothing writes the slots or the states while a launch reads them.
template <typename T> struct Raw4;
template <> struct Raw4<float> {
    float4 v;
    __device__ __forceinline__ void load(const float *p) {
        v = __ldg(reinterpret_cast<const float4 *>(p));
    }
    __device__ __forceinline__ void zero() { v = make_float4(0.f, 0.f, 0.f, 0.f); }
    __device__ __forceinline__ void widen(float out[4]) const {
        out[0] = v.x;
        out[1] = v.y;
        out[2] = v.z;
        out[3] = v.w;
    }
};
template <> struct Raw4<__nv_bfloat16> {
    uint2 v;
    __device__ __forceinline__ void load(const __nv_bfloat16 *p) {
        v = __ldg(reinterpret_cast<const uint2 *>(p));
    }
    __device__ __forceinline__ void zero() { v = make_uint2(0u, 0u); }
    __device__ __forceinline__ void widen(float out[4]) const {
        // bf16 is the high half of an f32: widening is a shift, exact.
        out[0] = __uint_as_float(v.x << 16);
        out[1] = __uint_as_float(v.x & 0xffff0000u);
        out[2] = __uint_as_float(v.y << 16);
        out[3] = __uint_as_float(v.y & 0xffff0000u);
    }
};

// The vector kernel (see score_partials_vec above): every read of an iteration (the slots' and
// the four candidates' four values) issued before any value is used, and no branch around a
// candidate's read or arithmetic: a candidate that does not pair the row reads zeros (a zero
// adds nothing to its sums). What a thread sums rarely sits in shared memory, one column per
// thread, so the registers hold the common sums only: a row's x*x for the candidates where not
// all of the group pair it (an edge row), and the c*c beside a non-finite captured value.
// Every sum is added in one fixed order.
template <typename X, typename C>
__device__ __forceinline__ void score_partials_vec_impl(const long long *cand, int n_cand,
                                                        const long long *jobs, int n_jobs,
                                                        const long long *state_ptr, int n_states,
                                                        int cols, int k, int rows_per_chunk,
                                                        int edge, double *partials) {
    constexpr int NS = SCORE_SLOTS, NG = SCORE_GROUP, NT = SCORE_VEC_THREADS;
    __shared__ double scratch[NT / 32][3 * NG * NS];
    __shared__ float rare_xx[NS * NG][NT], rare_cc[NS * NG][NT];
    const int j0 = blockIdx.x * NG, chunk = blockIdx.y, s0 = blockIdx.z * NS;
    const Group4<C> g = group_at<C>(cand, n_cand, state_ptr, n_states, n_jobs, j0);
    const Job<X> job = job_at<X>(jobs, n_jobs, g.job);
    const int chunks = gridDim.y, ns = (int)min((long)NS, job.slots - s0), cols4 = cols / 4,
              tid = threadIdx.x;
    if (ns <= 0) return; // uniform over the block; score_finish writes NaN
#pragma unroll
    for (int o = 0; o < NS * NG; ++o) rare_xx[o][tid] = rare_cc[o][tid] = 0.f;
    // xc per (slot, candidate); xx per slot over the rows every scored candidate pairs; c*c
    // per candidate where the captured values are all finite.
    float xc[NS][NG] = {}, xx[NS] = {}, cc[NG] = {};
    const X *x0[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) x0[s] = s < ns ? slot_row0(job, state_ptr, s0 + s, cols) : job.x;
    long lo, hi;
    chunk_span(chunk, job.rows, edge, rows_per_chunk, lo, hi);
    for (long t = lo; t < hi; ++t) {
        const C *cr[NG];
        bool in[NG], all_in = true;
#pragma unroll
        for (int i = 0; i < NG; ++i) {
            const long rt = t + g.shift[i];
            in[i] = g.use[i] && rt >= 0 && rt < job.ref_rows;
            all_in &= in[i] || !g.use[i];
            cr[i] = g.row0[i] + (in[i] ? rt : 0) * job.ref_stride;
        }
        const X *xr[NS];
#pragma unroll
        for (int s = 0; s < NS; ++s) xr[s] = x0[s] + t * job.x_stride;
        float row_xx[NS] = {};
        for (int c = tid; c < cols4; c += NT) {
            Raw4<X> xraw[NS];
            Raw4<C> craw[NG];
#pragma unroll
            for (int s = 0; s < NS; ++s) {
                if (s < ns)
                    xraw[s].load(xr[s] + 4 * c);
                else
                    xraw[s].zero();
            }
#pragma unroll
            for (int i = 0; i < NG; ++i) {
                if (in[i])
                    craw[i].load(cr[i] + 4 * c);
                else
                    craw[i].zero();
            }
            float xv[NS][4], cv[NG][4], sq[NS];
#pragma unroll
            for (int s = 0; s < NS; ++s) {
                xraw[s].widen(xv[s]);
                sq[s] = xv[s][0] * xv[s][0];
#pragma unroll
                for (int e = 1; e < 4; ++e) sq[s] = fmaf(xv[s][e], xv[s][e], sq[s]);
            }
#pragma unroll
            for (int i = 0; i < NG; ++i) craw[i].widen(cv[i]);
            if (isfinite((sq[0] + sq[1]) + (sq[2] + sq[3]))) {
                // Every value finite (squares of non-negative terms: a non-finite value, or
                // one whose square overflows, makes the sum infinite or NaN).
#pragma unroll
                for (int s = 0; s < NS; ++s) row_xx[s] += sq[s];
#pragma unroll
                for (int i = 0; i < NG; ++i) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) cc[i] = fmaf(cv[i][e], cv[i][e], cc[i]);
#pragma unroll
                    for (int s = 0; s < NS; ++s) {
                        if (s >= ns) continue;
#pragma unroll
                        for (int e = 0; e < 4; ++e) xc[s][i] = fmaf(xv[s][e], cv[i][e], xc[s][i]);
                    }
                }
                continue;
            }
            // Some value is not finite: each on its own, a non-finite one selecting zeros.
#pragma unroll
            for (int s = 0; s < NS; ++s) {
                bool ok[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    ok[e] = isfinite(xv[s][e]);
                    xv[s][e] = ok[e] ? xv[s][e] : 0.f;
                    row_xx[s] += xv[s][e] * xv[s][e];
                }
                if (s >= ns) continue;
#pragma unroll
                for (int i = 0; i < NG; ++i) {
                    float own = rare_cc[s * NG + i][tid];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float cs = ok[e] ? cv[i][e] : 0.f;
                        xc[s][i] += xv[s][e] * cs;
                        own += cs * cs;
                    }
                    rare_cc[s * NG + i][tid] = own;
                }
            }
        }
        if (all_in) {
#pragma unroll
            for (int s = 0; s < NS; ++s) xx[s] += row_xx[s];
        } else {
#pragma unroll
            for (int s = 0; s < NS; ++s)
#pragma unroll
                for (int i = 0; i < NG; ++i)
                    if (in[i]) rare_xx[s * NG + i][tid] += row_xx[s];
        }
    }
    const int lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int s = 0; s < NS; ++s)
#pragma unroll
        for (int i = 0; i < NG; ++i) {
            if (s >= ns) continue;
            const float sums[3] = {xx[s] + rare_xx[s * NG + i][tid], xc[s][i],
                                   cc[i] + rare_cc[s * NG + i][tid]};
#pragma unroll
            for (int m = 0; m < 3; ++m) {
                const double v = warp_sum((double)sums[m]);
                if (lane == 0) scratch[warp][(s * NG + i) * 3 + m] = v;
            }
        }
    __syncthreads();
    const int n_out = ns * NG * 3;
    for (int o = tid; o < n_out; o += NT) {
        const int s = o / (3 * NG), i = (o / 3) % NG, m = o % 3, j = j0 + i;
        if (j >= n_cand) continue;
        double v = 0.0;
        for (int w = 0; w < NT / 32; ++w) v += scratch[w][o];
        if (!g.use[i]) v = __longlong_as_double(0x7ff8000000000000ll);
        partials[(((long)(s0 + s) * n_cand + j) * chunks + chunk) * 3 + m] = v;
    }
}

// The entry points, by the element types of the captured rows and of the states: f32 and f32
// (no suffix), f32 slots against bf16 states (_fb: a forward's states as it made them), bf16
// against bf16 (_bb: a state read as a slot).
#define SCORE_ARGS                                                                                 \
    const long long *cand, int n_cand, const long long *jobs, int n_jobs,                         \
        const long long *state_ptr, int n_states, int cols, int k, int rows_per_chunk, int edge,   \
        double *partials
#define SCORE_PASS                                                                                 \
    cand, n_cand, jobs, n_jobs, state_ptr, n_states, cols, k, rows_per_chunk, edge, partials
#define SCORE_ENTRIES(suffix, X, C)                                                                \
    extern "C" __global__ void score_partials##suffix(SCORE_ARGS) {                               \
        score_partials_impl<X, C, float>(SCORE_PASS);                                              \
    }                                                                                              \
    extern "C" __global__ void score_partials_f64##suffix(SCORE_ARGS) {                           \
        score_partials_impl<X, C, double>(SCORE_PASS);                                             \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(SCORE_VEC_THREADS, 4)                            \
        score_partials_vec##suffix(SCORE_ARGS) {                                                  \
        score_partials_vec_impl<X, C>(SCORE_PASS);                                                 \
    }

SCORE_ENTRIES(, float, float)
SCORE_ENTRIES(_fb, float, __nv_bfloat16)
SCORE_ENTRIES(_bb, __nv_bfloat16, __nv_bfloat16)

extern "C" __global__ void score_finish(const double *partials, int chunks, int k, int n_cand,
                                        const long long *cand, const long long *jobs, int n_jobs,
                                        int edge, double *out) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x; // (slot, candidate)
    if (i >= (long)k * n_cand) return;
    const int width = edge > 0 ? 8 : 4;
    const double *p = partials + i * chunks * 3;
    double s[3] = {0.0, 0.0, 0.0}, inner[3] = {0.0, 0.0, 0.0};
    for (int c = 0; c < chunks; ++c)
        for (int m = 0; m < 3; ++m) {
            s[m] += p[c * 3 + m];
            if (edge > 0 && c >= 2) inner[m] += p[c * 3 + m];
        }
    double *o = out + i * width;
    for (int m = 0; m < 3; ++m) {
        o[m] = s[m];
        if (edge > 0) o[4 + m] = inner[m];
    }
    const int j = (int)(i % n_cand), slot = (int)(i / n_cand);
    const long long job = cand[2 * n_cand + j];
    o[3] = 0.0;
    if (edge > 0) o[7] = 0.0;
    if (job < 0 || job >= n_jobs) return;
    if (slot >= jobs[JOB_SLOTS * n_jobs + job]) {
        // A slot past the job's own: no block summed it.
        for (int m = 0; m < 3; ++m) {
            o[m] = __longlong_as_double(0x7ff8000000000000ll);
            if (edge > 0) o[4 + m] = o[m];
        }
        return;
    }
    const long shift = (long)cand[n_cand + j];
    const long rows = (long)jobs[JOB_ROWS * n_jobs + job];
    const long ref_rows = (long)jobs[JOB_REF_ROWS * n_jobs + job];
    // The rows t in lo .. hi with 0 <= t + shift < ref_rows.
    const auto paired = [&](long lo, long hi) {
        return (double)max(0l, min(hi, ref_rows - shift) - max(lo, -shift));
    };
    o[3] = paired(0, rows);
    if (edge > 0) {
        const long head = min((long)edge, rows), tail = max(head, rows - edge);
        o[7] = paired(head, tail);
    }
}

// gather_blocks: n blocks of `bytes` bytes each (a multiple of 16, every address 16-byte
// aligned; the launcher checks), block b from src[b] to dst + b * bytes: the edge rows of every
// state a flush scores, each state's head and tail rows one block each, in one launch. Grid
// (x, n), 256 threads; each block of the grid strides over its copy 16 bytes a thread.
extern "C" __global__ void gather_blocks(const long long *src, long long bytes, uint4 *dst) {
    const long long n16 = bytes / 16;
    const uint4 *from = reinterpret_cast<const uint4 *>(src[blockIdx.y]);
    uint4 *to = dst + (long long)blockIdx.y * n16;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16;
         i += (long long)gridDim.x * blockDim.x)
        to[i] = from[i];
}
