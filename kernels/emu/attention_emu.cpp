// Lane-level emulation of the tensor-core attention kernels (kernels/emu/README.md): runs an
// entry point of attention.cu on the host, every block and every thread of its grid, against a
// float64 reference, with the tolerances of src/kernels/attention.rs `check`.
//
//   attention_emu TAG DTYPE TQ TK NH NKV WINDOW [SCALE RAMP SEED MODE SINKS]
//     TAG    a tensor-core tile tag (the table below repeats attention.rs TC_CONFIGS)
//     DTYPE  bf16 | f16
//     WINDOW 0 for none
//     SCALE  softmax scale; 0 (default) for dk^-0.5
//     RAMP   1: key j scaled by (1 + j / 32), so row maxima keep growing (the rescale path)
//     MODE   eager | lazy | random: when cp.async data lands (default random)
//     SINKS  1: gpt-oss attention sinks, head h's logit 3 * (h % 3) - 2 + h / 8 (default 0: none)
// Exit status 0 when every output is within tolerance, 1 when not, 2 on an emulation fault
// (out-of-bounds access, divergent collective, deadlock).
#include "attention.cu"

#include <functional>
#include <string>

alignas(128) unsigned char fa_smem[256 * 1024];

template <typename T>
using Kernel = void (*)(const T *, long, const T *, long, const T *, long, T *, long, int, int,
                        int, int, float, int, const float *);

struct Config {
    const char *tag;
    int dk, dv, mt, nw, bn, stages;
    Kernel<__nv_bfloat16> bf16;
    Kernel<__half> f16;
};

#define CFG(TAG, DK, DV, MT, NW, BN, ST)                                                          \
    Config{#TAG, DK, DV, MT, NW, BN, ST, flash_attn_tc_##TAG##_bf16, flash_attn_tc_##TAG##_f16}
static const Config CONFIGS[] = {
    CFG(d64_v64, 64, 64, 2, 4, 64, 2),
    CFG(d128_v128, 128, 128, 2, 4, 32, 2),
    CFG(d128_v128_m1, 128, 128, 1, 4, 64, 2),
    CFG(d192_v128, 192, 128, 1, 4, 64, 2),
    CFG(d128_v128_lean, 128, 128, 2, 4, 32, 2),
    CFG(d128_v128_n64, 128, 128, 2, 4, 64, 2),
    CFG(d128_v128_c64, 128, 128, 2, 4, 64, 2),
    CFG(d128_v128_s3, 128, 128, 2, 4, 32, 3),
    CFG(d128_v128_w8pipe, 128, 128, 1, 8, 32, 4),
    CFG(d128_v128_w8m1, 128, 128, 1, 8, 64, 2),
    CFG(d192_v128_lean, 192, 128, 2, 4, 32, 2),
    CFG(d192_v128_lean_m1, 192, 128, 1, 4, 64, 2),
    CFG(d192_v128_w8m1, 192, 128, 1, 8, 32, 2),
};

namespace {

emu::Thread *g_launch_thread;
std::function<void()> g_body;

void fiber_entry() {
    g_body();
    emu::M.cur->done = true;
    swapcontext(&emu::M.cur->ctx, &emu::M.sched);
}

// Runs one block: a fiber per thread, a random runnable fiber at every switch.
template <typename F> void run_block(int threads, F &&kernel) {
    using namespace emu;
    M.threads.assign(threads, Thread{});
    M.warps.assign((threads + 31) / 32, Warp{});
    M.bar_arrived = 0;
    std::memset(fa_smem, 0xff, sizeof fa_smem); // NaN in bf16 and f16
    g_body = kernel;
    for (int i = 0; i < threads; ++i) {
        Thread &t = M.threads[i];
        t.tid.x = i;
        t.lane = i % 32;
        t.warp = i / 32;
        t.stack.resize(512 * 1024);
        getcontext(&t.ctx);
        t.ctx.uc_stack.ss_sp = t.stack.data();
        t.ctx.uc_stack.ss_size = t.stack.size();
        t.ctx.uc_link = nullptr;
        makecontext(&t.ctx, fiber_entry, 0);
    }
    std::vector<int> runnable;
    while (true) {
        runnable.clear();
        bool all_done = true;
        for (int i = 0; i < threads; ++i) {
            all_done &= M.threads[i].done;
            if (!M.threads[i].done && !M.threads[i].blocked) runnable.push_back(i);
        }
        if (all_done) break;
        if (runnable.empty()) fail("deadlock: every live thread waits (barrier or collective)");
        M.cur = &M.threads[runnable[M.rng() % runnable.size()]];
        swapcontext(&M.sched, &M.cur->ctx);
    }
    for (auto &t : M.threads)
        if (!t.open.empty() || !t.groups.empty()) fail("cp.async data never waited for");
}

struct Rng { // xorshift, values in [-1, 1) with |v| >= 1/64 (as src/kernels/testing.rs)
    uint64_t s;
    float next() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        float v = 2.f * ((float)(s >> 40) / (float)(1u << 24)) - 1.f;
        if (std::fabs(v) < 1.f / 64) v = std::copysign(1.f / 64 + std::fabs(v), v);
        return v;
    }
};

template <typename T>
int run(const Config &c, Kernel<T> kernel, int tq, int tk, int nh, int nkv, int window,
        double scale, bool ramp, uint64_t seed, bool with_sinks) {
    const int dk = c.dk, dv = c.dv, width = nh * dk + nkv * dk + nkv * dv;
    // q, k, v: column windows of one fused [tk, width] QKV buffer (q: its last tq rows).
    std::vector<T> qkv((size_t)tk * width + 64); // + a guard: reads past it would fault here
    T *base = reinterpret_cast<T *>((reinterpret_cast<uintptr_t>(qkv.data()) + 15) & ~uintptr_t(15));
    Rng rng{seed * 0x9E3779B97F4A7C15ull | 1};
    for (int j = 0; j < tk; ++j)
        for (int x = 0; x < width; ++x) {
            float v = rng.next();
            if (ramp && x >= nh * dk && x < nh * dk + nkv * dk) v *= 1.f + j / 32.f;
            base[(size_t)j * width + x] = from_f32<T>(v);
        }
    const T *q = base + (size_t)(tk - tq) * width, *k = base + nh * dk, *v = base + nh * dk + nkv * dk;
    const int o_stride = nh * dv;
    std::vector<T> out((size_t)tq * o_stride + 64);
    for (auto &o : out) o.x = 0xffff; // NaN: an unwritten output fails
    const uint16_t guard = 0x1234;
    for (size_t i = (size_t)tq * o_stride; i < out.size(); ++i) out[i].x = guard;
    // Sinks below, near and above the scores' range (|q.k| scale is about 1 here).
    std::vector<float> sinks(nh);
    for (int h = 0; h < nh; ++h) sinks[h] = 3.f * (h % 3) - 2.f + h / 8.f;
    emu::M.readable = {{reinterpret_cast<const unsigned char *>(base),
                        reinterpret_cast<const unsigned char *>(base + (size_t)tk * width)},
                       {reinterpret_cast<const unsigned char *>(sinks.data()),
                        reinterpret_cast<const unsigned char *>(sinks.data() + nh)}};
    const float *sinks_arg = with_sinks ? sinks.data() : nullptr;

    const int bm = 16 * c.mt * c.nw, threads = 32 * c.nw;
    emu::M.smem_bytes = (size_t)(bm * (dk + 8) + c.stages * c.bn * (dk + dv + 16)) * sizeof(T);
    if (emu::M.smem_bytes > sizeof fa_smem) emu::fail("shared memory larger than the emulator's");
    emu::M.grid = {(unsigned)nh, (unsigned)((tq + bm - 1) / bm), 1};
    emu::M.block = {(unsigned)threads, 1, 1};
    for (unsigned by = 0; by < emu::M.grid.y; ++by)
        for (unsigned bx = 0; bx < emu::M.grid.x; ++bx) {
            emu::M.bid = {bx, by, 0};
            run_block(threads, [&] {
                kernel(q, width, k, width, v, width, out.data(), o_stride, tq, tk, nh, nkv,
                       (float)scale, window, sinks_arg);
            });
        }
    for (size_t i = (size_t)tq * o_stride; i < out.size(); ++i)
        if (out[i].x != guard) emu::fail("write past the output");

    // float64 reference on the same rounded inputs.
    const bool bf = std::is_same<T, __nv_bfloat16>::value;
    const double atol = bf ? 1.0 / 256 : 1.0 / 2048, rtol = bf ? 1.0 / 128 : 1.0 / 1024;
    double worst = 0, max_err = 0;
    long bad = 0;
    std::vector<double> s(tk), acc(dv);
    for (int h = 0; h < nh; ++h) {
        const int g = h / (nh / nkv);
        for (int i = 0; i < tq; ++i) {
            const int pos = i + tk - tq, lo = window > 0 ? std::max(0, pos - window + 1) : 0;
            double mx = -INFINITY;
            for (int j = lo; j <= pos; ++j) {
                double d = 0;
                for (int x = 0; x < dk; ++x)
                    d += (double)to_f32(q[(size_t)i * width + h * dk + x]) *
                         to_f32(k[(size_t)j * width + g * dk + x]);
                s[j] = d * (double)(float)scale;
                mx = std::max(mx, s[j]);
            }
            // The sink joins the max and the denominator (modeling_gpt_oss.py eager_attention_forward).
            if (with_sinks) mx = std::max(mx, (double)sinks[h]);
            double sum = with_sinks ? std::exp((double)sinks[h] - mx) : 0;
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int j = lo; j <= pos; ++j) {
                const double p = std::exp(s[j] - mx);
                sum += p;
                for (int x = 0; x < dv; ++x) acc[x] += p * to_f32(v[(size_t)j * width + g * dv + x]);
            }
            for (int x = 0; x < dv; ++x) {
                const double want = acc[x] / sum;
                const double got = to_f32(out[(size_t)i * o_stride + h * dv + x]);
                const double err = std::fabs(got - want);
                const double share = std::isfinite(got) ? err / (atol + rtol * std::fabs(want)) : INFINITY;
                if (share > 1) ++bad;
                worst = std::max(worst, share);
                max_err = std::max(max_err, std::isfinite(err) ? err : INFINITY);
            }
        }
    }
    std::printf("%-20s %s tq %4d tk %4d nh %3d nkv %3d window %4d ramp %d sinks %d: max |err| "
                "%.3g, %.2fx the tolerance, %ld bad, %ld warp collectives -> %s\n",
                c.tag, bf ? "bf16" : "f16", tq, tk, nh, nkv, window, ramp, with_sinks, max_err, worst, bad,
                emu::M.collectives, bad == 0 ? "ok" : "FAIL");
    return bad == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char **argv) {
    if (argc < 8) {
        std::fprintf(stderr, "usage: %s TAG DTYPE TQ TK NH NKV WINDOW [SCALE RAMP SEED MODE]\n", argv[0]);
        return 2;
    }
    const std::string tag = argv[1], dtype = argv[2];
    const int tq = std::atoi(argv[3]), tk = std::atoi(argv[4]), nh = std::atoi(argv[5]),
              nkv = std::atoi(argv[6]), window = std::atoi(argv[7]);
    double scale = argc > 8 ? std::atof(argv[8]) : 0;
    const bool ramp = argc > 9 && std::atoi(argv[9]) != 0;
    const uint64_t seed = argc > 10 ? std::strtoull(argv[10], nullptr, 10) : 1;
    const std::string mode = argc > 11 ? argv[11] : "random";
    const bool sinks = argc > 12 && std::atoi(argv[12]) != 0;
    emu::M.mode = mode == "eager" ? emu::COPY_EAGER : mode == "lazy" ? emu::COPY_LAZY : emu::COPY_RANDOM;
    emu::M.rng.seed(seed);
    for (const Config &c : CONFIGS) {
        if (tag != c.tag) continue;
        if (scale == 0) scale = 1.0 / std::sqrt((double)c.dk);
        if (dtype == "bf16") return run<__nv_bfloat16>(c, c.bf16, tq, tk, nh, nkv, window, scale, ramp, seed, sinks);
        if (dtype == "f16") return run<__half>(c, c.f16, tq, tk, nh, nkv, window, scale, ramp, seed, sinks);
        emu::fail("dtype is bf16 or f16");
    }
    emu::fail("no such tile tag");
}
