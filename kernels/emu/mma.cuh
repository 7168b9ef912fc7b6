// Host stand-in for kernels/mma.cuh: lane-level models of the inline-PTX primitives, on the
// emulated machine of kernels/emu/common.cuh. Fragment layouts follow the PTX ISA
// (ldmatrix m8n8.x4 with and without .trans; mma.m16n8k16.row.col, f32 accumulators).
#pragma once

#include "common.cuh"

inline uint32_t smem_addr(const void *p) {
    const unsigned char *c = static_cast<const unsigned char *>(p);
    if (c < fa_smem || (size_t)(c - fa_smem) > emu::M.smem_bytes)
        emu::fail("smem_addr of a pointer outside the dynamic shared memory");
    return (uint32_t)(c - fa_smem);
}

inline void cp_async16(uint32_t dst, const void *src, int bytes) {
    using namespace emu;
    smem_check(dst, 16, 16, "cp.async destination");
    const unsigned char *s = static_cast<const unsigned char *>(src);
    if (bytes != 0 && bytes != 16) fail("cp.async source size other than 0 or 16");
    if (reinterpret_cast<uintptr_t>(s) % 16 != 0) fail("cp.async source not 16-byte aligned");
    if (bytes > 0) {
        bool ok = false;
        for (const Range &r : M.readable) ok |= s >= r.lo && s + bytes <= r.hi;
        if (!ok) fail("cp.async reads outside the inputs");
    }
    const Copy c{dst, s, bytes};
    const bool eager = M.mode == COPY_EAGER || (M.mode == COPY_RANDOM && (M.rng() & 1));
    if (eager)
        land(c);
    else
        M.cur->open.push_back(c);
}
inline void cp_async16_full(uint32_t dst, const void *src) { cp_async16(dst, src, 16); }
inline void cp_async_commit() {
    emu::Thread *t = emu::M.cur;
    t->groups.push_back(std::move(t->open));
    t->open.clear();
}
template <int N> inline void cp_async_wait() {
    emu::Thread *t = emu::M.cur;
    while ((int)t->groups.size() > N) {
        for (const emu::Copy &c : t->groups.front()) emu::land(c);
        t->groups.erase(t->groups.begin());
    }
}

inline void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    emu::LaneIn x{};
    x.addr = addr;
    const emu::LaneOut o = emu::collective(emu::OP_LDSM, x);
    for (int i = 0; i < 4; ++i) r[i] = o.r[i];
}
inline void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    emu::LaneIn x{};
    x.addr = addr;
    const emu::LaneOut o = emu::collective(emu::OP_LDSM_T, x);
    for (int i = 0; i < 4; ++i) r[i] = o.r[i];
}

template <typename T> struct TensorCore {
    static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        emu::LaneIn x{};
        for (int i = 0; i < 4; ++i) {
            x.a[i] = a[i];
            x.c[i] = d[i];
        }
        x.b[0] = b0;
        x.b[1] = b1;
        const emu::LaneOut o = emu::collective(
            sizeof(T) == 2 && std::is_same<T, __nv_bfloat16>::value ? emu::OP_MMA_BF16
                                                                   : emu::OP_MMA_F16,
            x);
        for (int i = 0; i < 4; ++i) d[i] = o.d[i];
    }
    static uint32_t pack(float lo, float hi) {
        return (uint32_t)from_f32<T>(lo).x | ((uint32_t)from_f32<T>(hi).x << 16);
    }
};

// ex2.approx.ftz.f32: denormal inputs and results flush to zero (the approximation's own
// error, 2 ulp, is below what the tests resolve).
inline float fast_exp2(float x) {
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}
