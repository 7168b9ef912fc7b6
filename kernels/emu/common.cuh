// Host stand-in for kernels/common.cuh, for the lane-level emulation of attention.cu
// (kernels/emu/README.md). Compiles the CUDA source as C++: every CUDA thread is a fiber
// (ucontext), warp collectives (shuffles, votes, ldmatrix, mma.sync) meet all 32 lanes of the
// warp before any lane goes on, __syncthreads meets the whole block, and the scheduler picks the
// next runnable fiber at random, so a missing barrier shows as a wrong or NaN result.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <ucontext.h>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

using std::max;
using std::min;

// ------------------------------------------------------------------ storage types

struct __half {
    uint16_t x;
};
struct __nv_bfloat16 {
    uint16_t x;
};

inline float bits_to_f32(uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
inline uint32_t f32_to_bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}
inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }
inline uint16_t f32_to_bf16(float f) { // round to nearest even, NaN stays NaN
    const uint32_t b = f32_to_bits(f);
    if (std::isnan(f)) return 0x7fc0;
    return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
inline uint16_t f32_to_f16(float f) {
    _Float16 v = (_Float16)f; // round to nearest even
    uint16_t h;
    std::memcpy(&h, &v, 2);
    return h;
}

inline float to_f32(float x) { return x; }
inline float to_f32(__half x) { return f16_to_f32(x.x); }
inline float to_f32(__nv_bfloat16 x) { return bf16_to_f32(x.x); }
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline __half from_f32<__half>(float x) { return __half{f32_to_f16(x)}; }
template <> inline __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __nv_bfloat16{f32_to_bf16(x)};
}
template <typename T> inline float round_to(float x) { return to_f32(from_f32<T>(x)); }

#define EAGLE_FOR_EACH_FLOAT(X) X(float, f32) X(__half, f16) X(__nv_bfloat16, bf16)

// ------------------------------------------------------------------ the emulated machine

namespace emu {

[[noreturn]] inline void fail(const char *what) {
    std::fprintf(stderr, "EMULATION FAILURE: %s\n", what);
    std::exit(2);
}

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};

struct Copy {
    uint32_t dst;
    const unsigned char *src;
    int bytes;
};

struct Thread {
    ucontext_t ctx;
    std::vector<char> stack;
    Dim3 tid;
    int lane = 0, warp = 0;
    bool done = false, blocked = false;
    std::vector<Copy> open;                 // issued, not yet committed
    std::vector<std::vector<Copy>> groups; // committed, not yet landed
};

enum Op { OP_SHFL = 1, OP_ANY, OP_LDSM, OP_LDSM_T, OP_MMA_BF16, OP_MMA_F16 };

struct LaneIn {
    uint32_t a[4];
    uint32_t b[2];
    float c[4];
    float f;
    int i;
    uint32_t addr;
};
struct LaneOut {
    float d[4];
    uint32_t r[4];
    float f;
    int i;
};
struct Warp {
    int arrived = 0;
    int op = 0;
    LaneIn in[32];
    LaneOut out[32];
};

// How cp.async data lands: at issue, at the wait that retires its group, or either at random.
enum CopyMode { COPY_EAGER, COPY_LAZY, COPY_RANDOM };

struct Range {
    const unsigned char *lo, *hi;
};

struct Machine {
    Dim3 bid, grid, block;
    std::vector<Thread> threads;
    std::vector<Warp> warps;
    int bar_arrived = 0;
    size_t smem_bytes = 0;
    Thread *cur = nullptr;
    ucontext_t sched;
    std::mt19937_64 rng{1};
    CopyMode mode = COPY_RANDOM;
    std::vector<Range> readable; // global memory cp.async may read
    long collectives = 0;
};
inline Machine M;

} // namespace emu

extern unsigned char fa_smem[];

#define threadIdx (emu::M.cur->tid)
#define blockIdx (emu::M.bid)
#define gridDim (emu::M.grid)
#define blockDim (emu::M.block)

namespace emu {

inline void yield() { swapcontext(&M.cur->ctx, &M.sched); }

inline void smem_check(uint32_t addr, uint32_t bytes, uint32_t align, const char *what) {
    if (addr % align != 0 || (size_t)addr + bytes > M.smem_bytes) {
        std::fprintf(stderr, "%s: shared address %u (+%u) misaligned or past %zu bytes\n", what,
                     addr, bytes, M.smem_bytes);
        fail("shared memory access");
    }
}

inline void land(const Copy &c) {
    std::memset(fa_smem + c.dst, 0, 16);
    if (c.bytes > 0) std::memcpy(fa_smem + c.dst, c.src, c.bytes);
}

inline void compute(Warp &w) {
    switch (w.op) {
    case OP_SHFL:
        for (int l = 0; l < 32; ++l) w.out[l].f = w.in[l ^ w.in[l].i].f;
        break;
    case OP_ANY: {
        int any = 0;
        for (int l = 0; l < 32; ++l) any |= w.in[l].i != 0;
        for (int l = 0; l < 32; ++l) w.out[l].i = any;
        break;
    }
    case OP_LDSM:
    case OP_LDSM_T:
        for (int l = 0; l < 32; ++l) smem_check(w.in[l].addr, 16, 16, "ldmatrix row");
        for (int l = 0; l < 32; ++l)
            for (int i = 0; i < 4; ++i) {
                const LaneIn *rows = &w.in[8 * i]; // matrix i: row j at lane 8i + j
                uint16_t lo, hi;
                if (w.op == OP_LDSM) {
                    const unsigned char *p = fa_smem + rows[l / 4].addr + (l % 4) * 4;
                    std::memcpy(&lo, p, 2);
                    std::memcpy(&hi, p + 2, 2);
                } else {
                    std::memcpy(&lo, fa_smem + rows[2 * (l % 4)].addr + (l / 4) * 2, 2);
                    std::memcpy(&hi, fa_smem + rows[2 * (l % 4) + 1].addr + (l / 4) * 2, 2);
                }
                w.out[l].r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
            }
        break;
    case OP_MMA_BF16:
    case OP_MMA_F16: {
        auto dec = [&](uint32_t v, int half) {
            const uint16_t h = (uint16_t)(half ? v >> 16 : v & 0xffff);
            return (double)(w.op == OP_MMA_BF16 ? bf16_to_f32(h) : f16_to_f32(h));
        };
        double A[16][16], B[16][8];
        for (int l = 0; l < 32; ++l) {
            const int g = l / 4, t = l % 4;
            for (int hf = 0; hf < 2; ++hf) {
                A[g][2 * t + hf] = dec(w.in[l].a[0], hf);
                A[g + 8][2 * t + hf] = dec(w.in[l].a[1], hf);
                A[g][2 * t + 8 + hf] = dec(w.in[l].a[2], hf);
                A[g + 8][2 * t + 8 + hf] = dec(w.in[l].a[3], hf);
                B[2 * t + hf][g] = dec(w.in[l].b[0], hf);
                B[2 * t + 8 + hf][g] = dec(w.in[l].b[1], hf);
            }
        }
        for (int l = 0; l < 32; ++l) {
            const int g = l / 4, t = l % 4;
            for (int e = 0; e < 4; ++e) {
                const int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
                double acc = w.in[l].c[e];
                for (int kk = 0; kk < 16; ++kk) acc += A[row][kk] * B[kk][col];
                w.out[l].d[e] = (float)acc;
            }
        }
        break;
    }
    default:
        fail("unknown collective");
    }
}

inline LaneOut collective(Op op, const LaneIn &x) {
    Thread *t = M.cur;
    Warp &w = M.warps[t->warp];
    if (w.arrived == 0)
        w.op = op;
    else if (w.op != op)
        fail("the lanes of a warp reached different collectives (divergence)");
    w.in[t->lane] = x;
    if (++w.arrived == 32) {
        compute(w);
        w.arrived = 0;
        ++M.collectives;
        for (auto &u : M.threads)
            if (u.warp == t->warp) u.blocked = false;
    } else {
        t->blocked = true;
        yield();
    }
    return w.out[t->lane];
}

} // namespace emu

inline void __syncthreads() {
    using namespace emu;
    Thread *t = M.cur;
    if (++M.bar_arrived == (int)M.threads.size()) {
        M.bar_arrived = 0;
        for (auto &u : M.threads) u.blocked = false;
    } else {
        t->blocked = true;
        emu::yield();
    }
}

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
    if (mask != 0xffffffffu) emu::fail("partial shuffle mask");
    emu::LaneIn x{};
    x.f = v;
    x.i = lane_mask;
    return emu::collective(emu::OP_SHFL, x).f;
}

inline int __any_sync(unsigned mask, int pred) {
    if (mask != 0xffffffffu) emu::fail("partial vote mask");
    emu::LaneIn x{};
    x.i = pred;
    return emu::collective(emu::OP_ANY, x).i;
}

inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
