//! GPU capture bench (`benches/gpu/run.sh` runs it after the HF peer, on the GPU machine):
//! eagle-check's capture forward (every boundary, the pre-norm final state and the logits) on
//! the model directory the peer wrote, at each sequence length, timed after warm-up as the
//! median of several runs (device synchronised before each host clock read), then compared with
//! the peer's boundaries and greedy tokens. Prints one JSON object per length.
//!
//!     gpu MODEL_DIR HF_STATES.safetensors T,T,... REPS
//!     gpu moe-gemm T,T,... REPS [E]    (the MoE experts alone, both paths; see `moe_gemm`)
//!     gpu score REPS                   (the diff's scoring kernels alone; see `score`)
//!     gpu gemm T,T,... REPS            (the Llama projections: cuBLAS against cublasLt's
//!                                       algorithms; see `gemm`)
//!     gpu load MODEL_DIR               (the resident load alone, as `run` loads it; see
//!                                       `load`; benches/gpu/load.py drives it)
//!
//! With `EAGLE_CHECK_PHASES=1` each length also gets one forward timed phase by phase
//! (`eagle_check::model::phases`), reported under "phases"; with `EAGLE_CHECK_PHASES=timeline`
//! the same run on the phases' timeline (nothing synchronised, device and host times apart).
//!
//! The roofline floor (METHOD.md): the larger of the weight bytes over 4.3 TB/s (the copy rate
//! measured on these H200s, KINDS.md) and the FLOPs over 790 TFLOP/s (the bf16 matrix rate
//! measured there): 2 x parameters x T for the projections, plus the causal attention's
//! 2 x T^2 x heads x head_dim x layers (QK^T and PV over the lower triangle).

#[cfg(feature = "cuda")]
fn main() {
    gpu::main()
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("skipped: the gpu bench needs `--features cuda`");
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::{DType, Device, Tensor};
    use eagle_check::compare::closeness;
    use eagle_check::kernels::{cuda, dispatch};
    use eagle_check::model::{CaptureRequest, Progress, open_target, phases};
    use std::path::Path;
    use std::time::Instant;

    const COPY_BYTES_PER_S: f64 = 4.3e12;
    const BF16_FLOPS: f64 = 790e12;
    /// bf16 boundaries of two implementations (reasons in `eagle_check::tolerance`).
    const BF16_NORMWISE_TOL: f64 = eagle_check::tolerance::PARITY_BF16;

    /// Parameter counts of a target, from its config: all of them (the bytes a forward reads
    /// when every expert is touched) and those one token uses (its FLOPs), plus the attention's
    /// per-layer shape for the T^2 term.
    struct Counts {
        total: f64,
        active: f64,
        /// `heads * (dk + dv) * layers`: causal attention costs `T^2` times this in FLOPs
        /// (QK^T and PV, each `2 * T^2 / 2 * heads * d`).
        attn: f64,
    }

    impl Counts {
        fn of(cfg: &eagle_check::config::ModelConfig) -> Counts {
            let (h, l, v) = (
                cfg.hidden_size as f64,
                cfg.num_layers as f64,
                cfg.vocab_size as f64,
            );
            let nh = cfg.num_heads as f64;
            let (attn_params, dk, dv) = match &cfg.mla {
                Some(m) => {
                    let qk = (m.qk_nope_head_dim + m.qk_rope_head_dim) as f64;
                    let q = match m.q_lora_rank {
                        Some(r) => h * r as f64 + r as f64 + r as f64 * nh * qk,
                        None => h * nh * qk,
                    };
                    let kvr = m.kv_lora_rank as f64;
                    let kv = h * (kvr + m.qk_rope_head_dim as f64)
                        + kvr
                        + kvr * nh * (m.qk_nope_head_dim + m.v_head_dim) as f64;
                    (
                        q + kv + nh * m.v_head_dim as f64 * h,
                        qk,
                        m.v_head_dim as f64,
                    )
                }
                None => {
                    let (nkv, hd) = (cfg.num_kv_heads as f64, cfg.head_dim as f64);
                    (h * (nh + 2.0 * nkv) * hd + nh * hd * h, hd, hd)
                }
            };
            let dense = 3.0 * h * cfg.intermediate_size as f64;
            // The embedding is a gather: its bytes count, its "FLOPs" do not. (The Llama
            // table counted all 8.03B in `2 x params x T`, a 7% higher floor at T >= 512; its
            // DeepSeek anchors did not.)
            let (mut total, mut active) = (2.0 * v * h + h, v * h + h);
            for layer in 0..cfg.num_layers {
                let base = attn_params + 2.0 * h;
                match &cfg.moe {
                    Some(m) if m.is_moe_layer(layer) => {
                        let expert = 3.0 * h * m.moe_intermediate_size as f64;
                        let router = m.n_routed_experts as f64 * (h + 1.0);
                        let shared = 3.0 * h * m.shared_intermediate as f64;
                        total += base + router + shared + expert * m.n_routed_experts as f64;
                        active += base + router + shared + expert * m.k() as f64;
                    }
                    _ => {
                        total += base + dense;
                        active += base + dense;
                    }
                }
            }
            Counts {
                total,
                active,
                attn: nh * (dk + dv) * l,
            }
        }

        /// Every weight read once (bf16) over the copy rate, or the FLOPs over the matrix rate.
        fn floor_ms(&self, t: usize) -> f64 {
            let t = t as f64;
            let bytes = self.total * 2.0;
            let flops = 2.0 * self.active * t + t * t * self.attn;
            (bytes / COPY_BYTES_PER_S).max(flops / BF16_FLOPS) * 1e3
        }
    }

    fn token_ids(t: usize, vocab: usize) -> Vec<u32> {
        (0..t as u64)
            .map(|i| (((1103515245 * i + 12345) % (1 << 31)) % vocab as u64) as u32)
            .collect()
    }

    /// `||a - b|| / ||b||` in f64.
    fn normwise(a: &Tensor, b: &Tensor) -> f64 {
        let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
        let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
        let d = (&a - &b).unwrap().sqr().unwrap().sum_all().unwrap();
        let n = b.sqr().unwrap().sum_all().unwrap();
        (d.to_scalar::<f64>().unwrap() / n.to_scalar::<f64>().unwrap()).sqrt()
    }

    /// `gpu moe-gemm T,T,... REPS [EXPERTS]`: the routed experts of one DeepSeek-V3 MoE layer
    /// (256 experts, or Kimi-K2's 384 with EXPERTS = 384; 8 per token, H 7168, I 2048, bf16)
    /// on T x 8 sorted rows, spread evenly and as random routing spreads them (8 distinct
    /// experts a token, uniform, seeded), both ways `eagle_check::kernels::moe_experts` runs
    /// them: kernels/moe_gemm_sm90.cu (two launches, the offsets read on the device) and cuBLAS
    /// grouped GEMMs (the host reads the counts; gate and up, SiLU-mul, down). Prints ms and the
    /// touched experts' weight bytes over the time, for the whole experts step and for each
    /// Hopper launch.
    fn moe_gemm(ts: &[usize], reps: usize, e: usize) {
        use eagle_check::kernels::cuda::tensor_ptr;
        use eagle_check::kernels::moe::launch::{MoeGemmArgs, MoeGemmKind, moe_gemm_wg};
        use eagle_check::kernels::{KernelDType, StackedExperts, moe_experts};
        let dev = cuda::open_device(0).unwrap();
        let device = Device::Cuda(dev.clone());
        let (k_per_tok, h, inter) = (8usize, 7168usize, 2048usize);
        let randn = |shape: &[usize]| {
            Tensor::randn(0f32, 0.02, shape, &device)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        // The stacked weights hold more than 2^32 elements, past what candle's elementwise
        // kernels index (their loops count in `unsigned int`): fill them by copies of one
        // random block instead.
        let block = randn(&[1 << 26]);
        let filled = |rows: usize, cols: usize| -> Tensor {
            let n = rows * cols;
            let t = cuda::tensor(cuda::alloc(&dev, DType::BF16, n).unwrap(), (rows, cols));
            let (dst, src) = (tensor_ptr(&t).unwrap(), tensor_ptr(&block).unwrap());
            for start in (0..n).step_by(1 << 26) {
                let len = (n - start).min(1 << 26);
                cuda::copy_raw(&dev, dst + 2 * start as u64, src, 2 * len).unwrap();
            }
            t
        };
        let w = StackedExperts::new(e, filled(e * 2 * inter, h), filled(e * h, inter));
        let time = |f: &dyn Fn()| {
            for _ in 0..2 {
                f();
            }
            device.synchronize().unwrap();
            let mut ms: Vec<f64> = (0..reps)
                .map(|_| {
                    let s = Instant::now();
                    f();
                    device.synchronize().unwrap();
                    s.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            ms.sort_by(f64::total_cmp);
            ms[ms.len() / 2]
        };
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for &t in ts {
            let rows = t * k_per_tok;
            let even: Vec<u32> = (0..e)
                .map(|x| (rows / e + usize::from(x < rows % e)) as u32)
                .collect();
            let mut routed = vec![0u32; e];
            for _ in 0..t {
                let mut picked = Vec::with_capacity(k_per_tok);
                while picked.len() < k_per_tok {
                    let x = (next() % e as u64) as usize;
                    if !picked.contains(&x) {
                        picked.push(x);
                    }
                }
                for x in picked {
                    routed[x] += 1;
                }
            }
            let x = randn(&[rows, h]);
            for (spread, counts) in [("even", even), ("routed", routed)] {
                let mut offsets = vec![0u32];
                for c in &counts {
                    offsets.push(offsets.last().unwrap() + c);
                }
                let offsets = Tensor::new(offsets.as_slice(), &device).unwrap();
                let touched = counts.iter().filter(|&&c| c > 0).count();
                let bytes_gu = (touched * 2 * inter * h) as f64 * 2.0;
                let bytes_d = (touched * h * inter) as f64 * 2.0;
                let run = |grouped: bool| {
                    dispatch::prefer_grouped_experts(grouped);
                    let ms = time(&|| drop(moe_experts(&x, &offsets, &w).unwrap()));
                    dispatch::prefer_grouped_experts(false);
                    ms
                };
                let grouped_ms = run(true);
                let hopper_ms = run(false);
                let act = Tensor::zeros((rows, inter), DType::BF16, &device).unwrap();
                let out = Tensor::zeros((rows, h), DType::BF16, &device).unwrap();
                let ptr = |t: &Tensor| tensor_ptr(t).unwrap();
                let launch = |kind, a: &Tensor, k, w: &Tensor, o: &Tensor, n_out| {
                    let args = MoeGemmArgs {
                        kind,
                        x: ptr(a),
                        rows,
                        k,
                        offsets: ptr(&offsets),
                        experts: e,
                        w: ptr(w),
                        out: ptr(o),
                        o_stride: n_out,
                        n_out,
                    };
                    time(&|| moe_gemm_wg(&dev, KernelDType::BF16, &args).unwrap())
                };
                let gu_ms = launch(MoeGemmKind::GateUp, &x, h, &w.gate_up, &act, inter);
                let down_ms = launch(MoeGemmKind::Down, &act, inter, &w.down, &out, h);
                let max_rows = counts.iter().max().copied().unwrap_or(0);
                println!(
                    "{}",
                    serde_json::json!({
                        "moe_experts": spread, "experts": e, "T": t, "rows": rows,
                        "experts_touched": touched,
                        "max_rows": max_rows, "weight_gb": (bytes_gu + bytes_d) / 1e9,
                        "grouped_ms": grouped_ms,
                        "grouped_tb_s": (bytes_gu + bytes_d) / grouped_ms / 1e9,
                        "hopper_ms": hopper_ms,
                        "hopper_tb_s": (bytes_gu + bytes_d) / hopper_ms / 1e9,
                        "hopper_gate_up_ms": gu_ms, "hopper_gate_up_tb_s": bytes_gu / gu_ms / 1e9,
                        "hopper_down_ms": down_ms, "hopper_down_tb_s": bytes_d / down_ms / 1e9,
                    })
                );
            }
        }
    }

    /// `gpu score REPS`: the diff engine's scoring kernels (kernels/score.cu) alone, both
    /// partial-sums variants, on the candidate lists `diff` builds for an L-layer target (L + 1
    /// boundaries and the pre-norm state at shifts 0, +1, -1, and L no-residual states at 0: 2L + 2
    /// states, 4L + 6 candidates) against k = 3 captured slots, f32. The floor is every input
    /// byte read once (the slots and the states) over 4.3 TB/s; `hbm_fraction` is that floor over
    /// the kernel's time (the finish pass included), timed over 20 back-to-back launches.
    fn score(reps: usize) {
        use eagle_check::kernels::cuda::{self, tensor_ptr};
        use eagle_check::kernels::score::launch::{self, Table, score_workspace_len};
        use eagle_check::kernels::score::{Job, Precision, ScoreKernel};
        let dev = cuda::open_device(0).unwrap();
        let device = Device::Cuda(dev.clone());
        let k = 3usize;
        for (t, h, l) in [
            (512usize, 1024usize, 3usize),
            (512, 4096, 32),
            (2048, 4096, 32),
        ] {
            let n_states = 2 * l + 2;
            let mut cands: Vec<(usize, isize)> = Vec::new();
            for q in 0..l + 2 {
                cands.extend([(q, 0), (q, 1), (q, -1)]);
            }
            cands.extend((l + 2..n_states).map(|q| (q, 0)));
            let x = Tensor::randn(0f32, 1.0, (t, k * h), &device).unwrap();
            let refs = Tensor::randn(0f32, 1.0, (n_states, t, h), &device).unwrap();
            let states: Vec<Tensor> = (0..n_states).map(|q| refs.get(q).unwrap()).collect();
            let job = Job::new(&x, states.iter().collect(), cands);
            let table = Table::of(std::slice::from_ref(&job), k, h).unwrap();
            let n = table.n_cand;
            let uploaded = Tensor::new(table.values.as_slice(), &device).unwrap();
            let ws = Tensor::zeros(score_workspace_len(t, k, n, 0), DType::F64, &device).unwrap();
            let out = Tensor::zeros(k * n * 4, DType::F64, &device).unwrap();
            let args = table.args(
                tensor_ptr(&uploaded).unwrap(),
                k,
                h,
                0,
                tensor_ptr(&ws).unwrap(),
                tensor_ptr(&out).unwrap(),
            );
            let bytes = ((t * k * h) + n_states * t * h) as f64 * 4.0;
            let floor_ms = bytes / COPY_BYTES_PER_S * 1e3;
            let mut line = serde_json::json!({
                "score": "kernels/score.cu", "T": t, "H": h, "layers": l, "slots": k,
                "states": n_states, "candidates": n, "input_gb": bytes / 1e9, "floor_ms": floor_ms,
            });
            for (name, kernel) in [
                ("per_slot", ScoreKernel::PerSlot),
                ("vec4", ScoreKernel::Vec4),
            ] {
                let ran = launch::score(&dev, &args, Precision::F32, kernel).unwrap();
                assert_eq!(ran, kernel, "{name}: another kernel ran");
                let launches = 20;
                let time = || {
                    device.synchronize().unwrap();
                    let s = Instant::now();
                    for _ in 0..launches {
                        launch::score(&dev, &args, Precision::F32, kernel).unwrap();
                    }
                    device.synchronize().unwrap();
                    s.elapsed().as_secs_f64() * 1e3 / launches as f64
                };
                time();
                let mut ms: Vec<f64> = (0..reps).map(|_| time()).collect();
                ms.sort_by(f64::total_cmp);
                let m = ms[ms.len() / 2];
                line[format!("{name}_ms")] = serde_json::json!(m);
                line[format!("{name}_hbm_fraction")] = serde_json::json!(floor_ms / m);
                line[format!("{name}_tb_s")] = serde_json::json!(bytes / m / 1e9);
            }
            println!("{line}");
        }
        flush_shape(&device, reps);
    }

    /// The scoring as a batched diff's flush asks for it on the 8B shape (H = 4096): 64 samples,
    /// each its four bf16 slots (`[T, 4 * H]`, as a stored capture uploads) against one boundary
    /// (shifts 0, +1, -1) and one no-residual state (shift 0), bf16 as the forward makes them,
    /// every row's sums and the interior's (rows 3..T - 3, the bound's). `two_jobs`: the
    /// interior a second job per sample (its rows narrowed, its shifts moved), as the diff asked
    /// before `score_jobs_split`; `split`: one job per sample, both sums in one pass. Each call
    /// is timed whole (the tables' upload, the launch, the read-back), median of `reps` timings
    /// of 10 calls; the floor is the slots and the states read once.
    fn flush_shape(device: &Device, reps: usize) {
        use eagle_check::kernels::score::{Job, Precision, score_jobs, score_jobs_split};
        let (h, k, samples, edge) = (4096usize, 4usize, 64usize, 3usize);
        for t in [512usize, 2048] {
            let xs: Vec<Tensor> = (0..samples)
                .map(|_| {
                    Tensor::randn(0f32, 1.0, (t, k * h), device)
                        .and_then(|x| x.to_dtype(DType::BF16))
                        .unwrap()
                })
                .collect();
            let states: Vec<Vec<Tensor>> = (0..samples)
                .map(|_| {
                    (0..2)
                        .map(|_| {
                            Tensor::randn(0f32, 1.0, (t, h), device)
                                .and_then(|x| x.to_dtype(DType::BF16))
                                .unwrap()
                        })
                        .collect()
                })
                .collect();
            let cands = vec![(0, 0), (0, 1), (0, -1), (1, 0)];
            let inner: Vec<Tensor> = xs
                .iter()
                .map(|x| x.narrow(0, edge, t - 2 * edge).unwrap())
                .collect();
            let mut jobs = Vec::new();
            let mut two = Vec::new();
            for ((x, xi), st) in xs.iter().zip(&inner).zip(&states) {
                jobs.push(Job::new(x, st.iter().collect(), cands.clone()));
                two.push(Job::new(x, st.iter().collect(), cands.clone()));
                two.push(Job::new(
                    xi,
                    st.iter().collect(),
                    cands.iter().map(|&(q, d)| (q, d + edge as isize)).collect(),
                ));
            }
            let bytes = (samples * (t * k * h + 2 * t * h)) as f64 * 2.0;
            let floor_ms = bytes / COPY_BYTES_PER_S * 1e3;
            let mut line = serde_json::json!({
                "score": "flush", "T": t, "H": h, "slots": k, "samples": samples,
                "candidates": cands.len(), "input_gb": bytes / 1e9, "floor_ms": floor_ms,
            });
            let timed = |f: &dyn Fn()| {
                f();
                let mut ms: Vec<f64> = (0..reps)
                    .map(|_| {
                        device.synchronize().unwrap();
                        let s = Instant::now();
                        for _ in 0..10 {
                            f();
                        }
                        s.elapsed().as_secs_f64() * 1e3 / 10.0
                    })
                    .collect();
                ms.sort_by(f64::total_cmp);
                ms[ms.len() / 2]
            };
            let two_ms = timed(&|| {
                score_jobs(&two, k, h, Precision::F32).unwrap();
            });
            let split_ms = timed(&|| {
                score_jobs_split(&jobs, k, h, Precision::F32, edge).unwrap();
            });
            for (name, ms) in [("two_jobs", two_ms), ("split", split_ms)] {
                line[format!("{name}_ms")] = serde_json::json!(ms);
                line[format!("{name}_hbm_fraction")] = serde_json::json!(floor_ms / ms);
            }
            line["split_speedup"] = serde_json::json!(two_ms / split_ms);
            println!("{line}");
        }
    }

    /// `gpu gemm T,T,... REPS`: every projection of a Llama-3.1-8B-shape forward at each T
    /// (bf16, random data): `cublasGemmEx` (what `gemm_raw` calls) against each algorithm
    /// cublasLt's heuristic offers (`gemm_lt_times`), the o and down projections with the
    /// residual `c` of the fused forward. ms per GEMM (median of REPS between CUDA events) and
    /// TFLOP/s; the index of cublasLt's fastest algorithm (0 is its heuristic's first choice).
    fn gemm(ts: &[usize], reps: usize) {
        use eagle_check::kernels::KernelDType;
        use eagle_check::kernels::cuda::tensor_ptr;
        use eagle_check::kernels::gemm::{GemmArgs, gemm_lt_times, gemm_raw};
        let dev = cuda::open_device(0).unwrap();
        let device = Device::Cuda(dev.clone());
        let randn = |shape: &[usize]| {
            Tensor::randn(0f32, 0.02, shape, &device)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let stream = dev.cuda_stream();
        for &t in ts {
            for (name, n, k, residual) in [
                ("qkv", 6144usize, 4096usize, false),
                ("o", 4096, 4096, true),
                ("gate_up", 28672, 4096, false),
                ("down", 4096, 14336, true),
                ("lm_head", 128256, 4096, false),
            ] {
                let (a, w, out, c) = (
                    randn(&[t, k]),
                    randn(&[n, k]),
                    randn(&[t, n]),
                    randn(&[t, n]),
                );
                let g = GemmArgs {
                    out: tensor_ptr(&out).unwrap(),
                    out_stride: n,
                    a: tensor_ptr(&a).unwrap(),
                    a_stride: k,
                    w: tensor_ptr(&w).unwrap(),
                    w_stride: k,
                    m: t,
                    n,
                    k,
                    accumulate: false,
                };
                let event = || {
                    stream
                        .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                        .unwrap()
                };
                gemm_raw(&dev, KernelDType::BF16, &g).unwrap();
                let mut ex: Vec<f64> = (0..reps)
                    .map(|_| {
                        let s = event();
                        gemm_raw(&dev, KernelDType::BF16, &g).unwrap();
                        let e = event();
                        f64::from(s.elapsed_ms(&e).unwrap())
                    })
                    .collect();
                ex.sort_by(f64::total_cmp);
                let ex = ex[ex.len() / 2];
                let c_arg = residual.then(|| (tensor_ptr(&c).unwrap(), n));
                let lt = gemm_lt_times(&dev, KernelDType::BF16, &g, c_arg, reps).unwrap();
                let best = lt
                    .iter()
                    .enumerate()
                    .filter_map(|(i, x)| x.map(|x| (i, x)))
                    .min_by(|a, b| a.1.total_cmp(&b.1));
                let tflops = |ms: f64| 2.0 * (t * n * k) as f64 / ms / 1e9;
                println!(
                    "{}",
                    serde_json::json!({
                        "gemm": name, "T": t, "n": n, "k": k, "residual": residual,
                        "gemm_ex_ms": ex, "gemm_ex_tflops": tflops(ex),
                        "lt_ms": lt, "lt_first_tflops": lt[0].map(tflops),
                        "lt_best": best.map(|b| b.0), "lt_best_tflops": best.map(|b| tflops(b.1)),
                    })
                );
            }
        }
    }

    /// The projections of a Llama-family forward and nothing else: per layer the q|k|v, o,
    /// gate|up and down GEMMs (`cublasGemmEx`, one layer's random weights reused by every
    /// layer: at any T the weights of a layer, 436 MB for Llama-3.1-8B, are far beyond the L2,
    /// so the reads are those of distinct layers), then the output head. Timed as the capture
    /// forward is, in the same process: what any forward built on these GEMMs costs at least on
    /// this machine as it runs (its clocks under load included), the same-run peer of the
    /// roofline floor.
    struct Projections {
        /// (weight, n, k, input buffer index, output buffer index)
        layer: Vec<(Tensor, usize, usize, usize, usize)>,
        head: Tensor,
        layers: usize,
        bufs: Vec<Tensor>,
        logits: Tensor,
    }

    impl Projections {
        fn new(cfg: &eagle_check::config::ModelConfig, t: usize, device: &Device) -> Projections {
            let randn = |shape: &[usize]| {
                Tensor::randn(0f32, 0.02, shape, device)
                    .unwrap()
                    .to_dtype(DType::BF16)
                    .unwrap()
            };
            let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
            let (q, kv) = (
                cfg.num_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
            );
            // Buffers: 0 normed [T, h], 1 q|k|v [T, q + 2 kv], 2 attention out [T, q],
            // 3 o / down out [T, h], 4 gate|up [T, 2i], 5 act [T, i].
            let bufs = vec![
                randn(&[t, h]),
                randn(&[t, q + 2 * kv]),
                randn(&[t, q]),
                randn(&[t, h]),
                randn(&[t, 2 * i]),
                randn(&[t, i]),
            ];
            let layer = vec![
                (randn(&[q + 2 * kv, h]), q + 2 * kv, h, 0, 1),
                (randn(&[h, q]), h, q, 2, 3),
                (randn(&[2 * i, h]), 2 * i, h, 0, 4),
                (randn(&[h, i]), h, i, 5, 3),
            ];
            Projections {
                layer,
                head: randn(&[cfg.vocab_size, h]),
                layers: cfg.num_layers,
                logits: randn(&[t, cfg.vocab_size]),
                bufs,
            }
        }

        fn run(&self, dev: &candle_core::cuda_backend::CudaDevice, t: usize) {
            use eagle_check::kernels::KernelDType;
            use eagle_check::kernels::cuda::tensor_ptr;
            use eagle_check::kernels::gemm::{GemmArgs, gemm_raw};
            let gemm = |w: &Tensor, n: usize, k: usize, a: &Tensor, out: &Tensor| {
                let g = GemmArgs {
                    out: tensor_ptr(out).unwrap(),
                    out_stride: n,
                    a: tensor_ptr(a).unwrap(),
                    a_stride: k,
                    w: tensor_ptr(w).unwrap(),
                    w_stride: k,
                    m: t,
                    n,
                    k,
                    accumulate: false,
                };
                gemm_raw(dev, KernelDType::BF16, &g).unwrap();
            };
            for _ in 0..self.layers {
                for (w, n, k, a, out) in &self.layer {
                    gemm(w, *n, *k, &self.bufs[*a], &self.bufs[*out]);
                }
            }
            let (v, h) = (self.head.dim(0).unwrap(), self.head.dim(1).unwrap());
            gemm(&self.head, v, h, &self.bufs[0], &self.logits);
        }
    }

    /// The resident bf16 load of `dir` onto the GPU, as `eagle-check run` loads it
    /// (`open_target`: the default readers, `EAGLE_CHECK_READERS` to change them), timed from
    /// the call to the device synchronised after it, the device opened before the clock starts.
    /// Prints one JSON object: the seconds, the bytes of the weight files, the rate.
    fn load(dir: &Path) {
        let start = Instant::now();
        let dev = cuda::open_device(0).unwrap();
        let device = Device::Cuda(dev);
        device.synchronize().unwrap();
        let init_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let target = open_target(dir, DType::BF16, &device).unwrap();
        device.synchronize().unwrap();
        let load_s = start.elapsed().as_secs_f64();
        let bytes: u64 = eagle_check::weights::shard_files(dir)
            .unwrap()
            .iter()
            .map(|f| f.metadata().unwrap().len())
            .sum();
        println!(
            "{}",
            serde_json::json!({
                "what": "load",
                "readers": eagle_check::model::io::ReadOptions::default().readers,
                "seconds": load_s,
                "cuda_init_seconds": init_s,
                "bytes": bytes,
                "gb_per_s": bytes as f64 / load_s / 1e9,
                "weights": target.memory.describe(),
            })
        );
    }

    /// With `EAGLE_CHECK_PHASES` set: `run` once more with every phase closed by a
    /// synchronisation, and each phase's total (milliseconds, marks) as JSON; with
    /// `EAGLE_CHECK_PHASES=timeline`, nothing synchronised: each phase's device and host
    /// milliseconds, how far the device lagged the host at its marks, and the most of its
    /// device time that can have been spent waiting for the host (`phases::TimelineTotal`).
    fn phases_of(device: &Device, run: impl FnOnce()) -> Option<Vec<serde_json::Value>> {
        let mode = std::env::var("EAGLE_CHECK_PHASES").ok()?;
        if mode == "timeline" {
            phases::set_timeline(true);
            let start = Instant::now();
            run();
            let totals = phases::take_timeline(device);
            let wall_ms = start.elapsed().as_secs_f64() * 1e3;
            phases::set_timeline(false);
            let mut out = vec![serde_json::json!({"timeline_wall_ms": wall_ms})];
            out.extend(totals.into_iter().map(|t| {
                serde_json::json!({
                    "phase": t.name, "device_ms": t.device_ms, "host_ms": t.host_ms,
                    "lag_ms": t.lag_ms, "host_bound_ms": t.host_bound_ms, "marks": t.marks,
                })
            }));
            return Some(out);
        }
        phases::set_enabled(true);
        run();
        let totals = phases::take();
        phases::set_enabled(false);
        Some(
            totals
                .into_iter()
                .map(|(name, ms, n)| serde_json::json!({"phase": name, "ms": ms, "marks": n}))
                .collect(),
        )
    }

    /// `gpu diff MODEL_DIR CAPTURES T,T,...` (issue 30): `diff` over the SpecForge captures the
    /// peer wrote under `CAPTURES/t{T}` (its own states, so every slot is identified), on the
    /// target resident in bf16, three ways at each T: batched (the default: samples packed into
    /// forwards of `GPU_PACK_TOKENS`, scored on the device as each state is made), one forward
    /// per sample (`Batching::per_sample`), and the forwards alone (`forward_many` with a sink
    /// that drops every state, the same packing). Against the capture forward of one sample
    /// timed as the capture bench times it (median of 5 after 2 warm-ups): tokens per second
    /// each way (the per-sample diff over the first `EAGLE_CHECK_BENCH_ALONE` samples when
    /// set; with `EAGLE_CHECK_PHASES`, the batched diff's phases). Prints one JSON object per T.
    fn diff_bench(dir: &Path, captures: &Path, ts: &[usize]) {
        use eagle_check::diff::reference::RunnerReference;
        use eagle_check::diff::{Batching, DiffInput, diff};
        use eagle_check::model::{ManyOptions, Produced};
        use eagle_check::readers::read_capture_path;
        use eagle_check::spec::Spec;
        let dev = cuda::open_device(0).unwrap();
        let device = Device::Cuda(dev.clone());
        let start = Instant::now();
        let target = open_target(dir, DType::BF16, &device).unwrap();
        device.synchronize().unwrap();
        let load_s = start.elapsed().as_secs_f64();
        let mut reference = RunnerReference {
            target,
            path: dir.to_path_buf(),
            forward_seconds: 0.0,
        };
        for &t in ts {
            let root = captures.join(format!("t{t}"));
            let spec = Spec::load(&root.join("spec.yaml")).unwrap();
            let files: Vec<std::path::PathBuf> = {
                let rows = std::fs::read_dir(&root)
                    .unwrap()
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .find(|p| p.is_dir())
                    .unwrap();
                let mut f: Vec<_> = std::fs::read_dir(rows)
                    .unwrap()
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .collect();
                f.sort();
                f
            };
            let samples = files.len();
            let tokens: Vec<Vec<u32>> = files
                .iter()
                .map(|f| {
                    read_capture_path(f).unwrap()[0]
                        .token_ids
                        .as_ref()
                        .unwrap()
                        .iter()
                        .map(|&x| x as u32)
                        .collect()
                })
                .collect();
            let model = &reference.target.model;
            // One sample's capture forward, as the capture bench times it.
            let want = CaptureRequest::all();
            for _ in 0..2 {
                model
                    .forward(&tokens[0], &want, &mut Progress::hidden())
                    .unwrap();
            }
            let mut ms: Vec<f64> = (0..5)
                .map(|_| {
                    device.synchronize().unwrap();
                    let s = Instant::now();
                    drop(
                        model
                            .forward(&tokens[0], &want, &mut Progress::hidden())
                            .unwrap(),
                    );
                    device.synchronize().unwrap();
                    s.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            ms.sort_by(f64::total_cmp);
            let forward_ms = ms[2];
            // The forwards diff runs, packed, every state dropped as it comes.
            let ids: Vec<&[u32]> = tokens.iter().map(Vec::as_slice).collect();
            let reference_want = CaptureRequest {
                boundaries: None,
                final_pre_norm: true,
                logits: false,
                layer_outputs: true,
            };
            let packed = ManyOptions::for_device(&device);
            device.synchronize().unwrap();
            let s = Instant::now();
            model
                .forward_many(&ids, &reference_want, &packed, &mut |_, _: Produced, _| {
                    Ok(())
                })
                .unwrap();
            device.synchronize().unwrap();
            let forwards_s = s.elapsed().as_secs_f64();
            // The one-sample-at-a-time diff over the first EAGLE_CHECK_BENCH_ALONE samples
            // (default all), hard-linked into their own folder: its rate is per token, so a
            // subset measures it in a fraction of the time at long T.
            let alone_n = std::env::var("EAGLE_CHECK_BENCH_ALONE")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .map_or(samples, |n| n.clamp(1, samples));
            let alone_root = captures.join(format!("t{t}-alone{alone_n}"));
            if alone_n < samples && !alone_root.exists() {
                let rows = alone_root.join("rows");
                std::fs::create_dir_all(&rows).unwrap();
                std::fs::copy(root.join("spec.yaml"), alone_root.join("spec.yaml")).unwrap();
                for f in &files[..alone_n] {
                    std::fs::hard_link(f, rows.join(f.file_name().unwrap())).unwrap();
                }
            }
            let alone_root = if alone_n < samples {
                alone_root
            } else {
                root.clone()
            };
            let mut time_diff = |per_sample: bool| {
                let root = if per_sample { &alone_root } else { &root };
                let samples = if per_sample { alone_n } else { samples };
                device.synchronize().unwrap();
                let s = Instant::now();
                let (report, stats) = diff(
                    &DiffInput {
                        spec: &spec,
                        captures: std::slice::from_ref(root),
                        feed: None,
                        arch: None,
                        batching: Batching {
                            per_sample,
                            budget: None,
                        },
                    },
                    &mut reference,
                )
                .unwrap();
                device.synchronize().unwrap();
                let wall = s.elapsed().as_secs_f64();
                assert_eq!(stats.samples, samples);
                (wall, report.exit_code(), stats)
            };
            let (batched_s, batched_exit, b) = time_diff(false);
            let (alone_s, alone_exit, a) = time_diff(true);
            // One more batched diff with every phase closed by a synchronisation: where its
            // time goes (not part of the timings above).
            let diff_phases = phases_of(&device, || {
                time_diff(false);
            });
            let tok = (samples * t) as f64;
            println!(
                "{}",
                serde_json::json!({
                    "diff": "SpecForge captures", "T": t, "samples": samples,
                    "load_s": load_s,
                    "forward_ms": forward_ms, "forward_tok_s": t as f64 / forward_ms * 1e3,
                    "packed_forwards_s": forwards_s, "packed_forwards_tok_s": tok / forwards_s,
                    "batched_s": batched_s, "batched_tok_s": tok / batched_s,
                    "batched_exit": batched_exit, "batched_passes": b.passes, "batched_rerun": b.rerun,
                    "batched_read_s": b.read_seconds, "batched_reference_s": b.reference_seconds,
                    "batched_scoring_s": b.scoring_seconds,
                    "per_sample_samples": alone_n,
                    "per_sample_s": alone_s, "per_sample_tok_s": (alone_n * t) as f64 / alone_s,
                    "per_sample_exit": alone_exit, "per_sample_read_s": a.read_seconds,
                    "per_sample_reference_s": a.reference_seconds,
                    "per_sample_scoring_s": a.scoring_seconds,
                    "batched_vs_forward": (tok / batched_s) / (t as f64 / forward_ms * 1e3),
                    "batched_speedup": (tok / batched_s) / ((alone_n * t) as f64 / alone_s),
                    "batched_phases": diff_phases,
                })
            );
        }
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().collect();
        if args.get(1).map(String::as_str) == Some("load") && args.len() >= 3 {
            load(Path::new(&args[2]));
            return;
        }
        if args.get(1).map(String::as_str) == Some("score") && args.len() >= 3 {
            score(args[2].parse().unwrap());
            return;
        }
        if args.get(1).map(String::as_str) == Some("gemm") && args.len() >= 4 {
            let ts: Vec<usize> = args[2].split(',').map(|t| t.parse().unwrap()).collect();
            gemm(&ts, args[3].parse().unwrap());
            return;
        }
        if args.get(1).map(String::as_str) == Some("moe-gemm") && args.len() >= 4 {
            let ts: Vec<usize> = args[2].split(',').map(|t| t.parse().unwrap()).collect();
            let experts = args.get(4).map_or(256, |e| e.parse().unwrap());
            moe_gemm(&ts, args[3].parse().unwrap(), experts);
            return;
        }
        if args.get(1).map(String::as_str) == Some("diff") && args.len() >= 5 {
            let ts: Vec<usize> = args[4].split(',').map(|t| t.parse().unwrap()).collect();
            diff_bench(Path::new(&args[2]), Path::new(&args[3]), &ts);
            return;
        }
        if args.len() < 5 {
            eprintln!("usage: gpu MODEL_DIR HF_STATES T,T,... REPS");
            std::process::exit(2);
        }
        let (dir, states, ts, reps) = (
            Path::new(&args[1]),
            Path::new(&args[2]),
            args[3]
                .split(',')
                .map(|t| t.parse::<usize>().unwrap())
                .collect::<Vec<_>>(),
            args[4].parse::<usize>().unwrap(),
        );
        let dev = cuda::open_device(0).unwrap();
        let device = Device::Cuda(dev.clone());
        let start = Instant::now();
        let target = open_target(dir, DType::BF16, &device).unwrap();
        device.synchronize().unwrap();
        let cfg = target.cfg.clone();
        let load_s = start.elapsed().as_secs_f64();
        let hf = candle_core::safetensors::load(states, &device).unwrap();
        let (l, v) = (cfg.num_layers, cfg.vocab_size);
        let counts = Counts::of(&cfg);
        eprintln!(
            "gpu bench: {} loaded in {load_s:.1} s, {:.2}B params ({:.2}B active per token)",
            dir.display(),
            counts.total / 1e9,
            counts.active / 1e9
        );
        for &t in &ts {
            let ids = token_ids(t, v);
            let want = CaptureRequest::all();
            let run = || {
                let c = target
                    .model
                    .forward(&ids, &want, &mut Progress::hidden())
                    .unwrap();
                device.synchronize().unwrap();
                c
            };
            for _ in 0..2 {
                run();
            }
            let timed = || {
                let mut ms: Vec<f64> = (0..reps)
                    .map(|_| {
                        device.synchronize().unwrap();
                        let s = Instant::now();
                        let c = run();
                        let e = s.elapsed().as_secs_f64() * 1e3;
                        drop(c);
                        e
                    })
                    .collect();
                ms.sort_by(f64::total_cmp);
                ms
            };
            // The same forwards with the mma.sync attention kernels (the default before the
            // Hopper kernels; the same as the default on a GPU that is not sm_90).
            dispatch::prefer_mma_attention(true);
            run();
            let ms_mma = timed();
            dispatch::prefer_mma_attention(false);
            // MoE targets: the same forwards with the routed experts as cuBLAS grouped GEMMs
            // (the default before kernels/moe_gemm_sm90.cu, and off sm_90).
            let ms_grouped = cfg.moe.is_some().then(|| {
                dispatch::prefer_grouped_experts(true);
                run();
                let ms = timed();
                dispatch::prefer_grouped_experts(false);
                ms[ms.len() / 2]
            });
            run();
            let ms = timed();
            let median = ms[ms.len() / 2];
            let cap = run();
            let mut worst = 0f64;
            let mut errors = serde_json::Map::new();
            for b in 0..=l {
                if let Some(r) = hf.get(&format!("t{t}.b{b}")) {
                    let e = normwise(&cap.hidden[&b], r);
                    let c = closeness(&cap.hidden[&b], r).unwrap();
                    assert_eq!(c.non_finite, 0, "T = {t} b = {b}: non-finite values");
                    worst = worst.max(e);
                    errors.insert(format!("b{b}"), serde_json::json!(e));
                }
            }
            // Against the peer's f32 run of the same weights, where it kept one (F32_TRUTH=1).
            let worst_vs_f32 = (0..=l)
                .filter_map(|b| {
                    let r = hf.get(&format!("f32.t{t}.b{b}"))?;
                    Some(normwise(&cap.hidden[&b], r))
                })
                .reduce(f64::max);
            let greedy_agree = hf.get(&format!("t{t}.logits_argmax")).map(|r| {
                let ours: Vec<u32> = cap
                    .logits
                    .as_ref()
                    .unwrap()
                    .argmax(1)
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let theirs: Vec<i64> = r.to_vec1().unwrap();
                ours.iter()
                    .zip(&theirs)
                    .filter(|(a, b)| **a as i64 == **b)
                    .count() as f64
                    / t as f64
            });
            // MoE targets: how the routing spread each layer's rows over the experts, against
            // an even spread of as many rows (the Hopper expert kernel takes an expert's rows
            // in chunks of MOE_GEMM_CHUNK, each chunk one more pass over its weight tiles).
            let routing = cfg.moe.as_ref().map(|m| {
                let chunk = eagle_check::kernels::moe::launch::MOE_GEMM_CHUNK;
                let e = m.n_routed_experts;
                let chunks =
                    |counts: &[usize]| counts.iter().map(|c| c.div_ceil(chunk)).sum::<usize>();
                cap.extras
                    .iter()
                    .filter(|(k, _)| k.ends_with(".topk_idx"))
                    .map(|(k, idx)| {
                        let mut counts = vec![0usize; e];
                        // i64 expert ids (the capture keeps HF's dtype).
                        for x in idx.flatten_all().unwrap().to_vec1::<i64>().unwrap() {
                            counts[x as usize] += 1;
                        }
                        let rows: usize = counts.iter().sum();
                        let even: Vec<usize> = (0..e)
                            .map(|x| rows / e + usize::from(x < rows % e))
                            .collect();
                        serde_json::json!({
                            "layer": k, "rows": rows,
                            "max_rows": counts.iter().max(),
                            "experts_touched": counts.iter().filter(|&&c| c > 0).count(),
                            "chunks": chunks(&counts), "chunks_even": chunks(&even),
                        })
                    })
                    .collect::<Vec<_>>()
            });
            // One more forward with every phase closed by a synchronisation: where the time
            // goes (not part of the timings above).
            let phases = phases_of(&device, || drop(run()));
            // The same-run peer: the forward's GEMMs alone, timed the same way (Llama family).
            let projections_ms = (cfg.mla.is_none() && cfg.moe.is_none()).then(|| {
                let p = Projections::new(&cfg, t, &device);
                let once = || {
                    device.synchronize().unwrap();
                    let s = Instant::now();
                    p.run(&dev, t);
                    device.synchronize().unwrap();
                    s.elapsed().as_secs_f64() * 1e3
                };
                for _ in 0..2 {
                    once();
                }
                let mut ms: Vec<f64> = (0..reps).map(|_| once()).collect();
                ms.sort_by(f64::total_cmp);
                ms[ms.len() / 2]
            });
            let floor_ms = counts.floor_ms(t);
            let line = serde_json::json!({
                "T": t,
                "ms": median,
                "all_ms": ms,
                "ms_mma_attention": ms_mma[ms_mma.len() / 2],
                "ms_grouped_experts": ms_grouped,
                "projections_only_ms": projections_ms,
                "floor_ms": floor_ms,
                "ratio_to_floor": median / floor_ms,
                "normwise_err": errors,
                "worst_normwise_err": worst,
                "worst_normwise_err_vs_hf_f32": worst_vs_f32,
                "tolerance": BF16_NORMWISE_TOL,
                "within_tolerance": worst <= BF16_NORMWISE_TOL,
                "greedy_agreement": greedy_agree,
                "phases": phases,
                "routing": routing,
            });
            println!("{line}");
        }
    }
}
