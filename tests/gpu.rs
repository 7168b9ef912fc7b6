//! The GPU runner against the same references as the CPU: every fixture target and draft on a
//! CUDA device (both compute paths there), DeepSeek's routing, and the verdicts of `run` and
//! `diff` on the shipped bundles and the capture corpus, device against device. Built only with
//! `--features cuda`; without a device each test fails, saying "needs a CUDA device".

use crate::support::{eagle_check, fixture, p};
use candle_core::{DType, Device, Tensor};
use eagle_check::compare::closeness;
use eagle_check::config::{DraftConfig, ModelConfig};
use eagle_check::model::draft::Eagle3Draft;
use eagle_check::model::source::{SafetensorsSource, Vb};
use eagle_check::model::{Capture, CaptureRequest, ComputePath, Progress, load_target_on};
use std::collections::HashMap;

/// f32 on the GPU: the same math as the CPU (cuBLAS in f32, no TF32; f32 kernels), a different
/// summation order: the CPU's parity target holds (reasons in `eagle_check::tolerance`).
const F32_TOL: f64 = eagle_check::tolerance::PARITY_F32;
const BF16_TOL: f64 = eagle_check::tolerance::PARITY_BF16;

/// The device every test here runs on: without one, each fails, naming why (these tests are
/// built only with `--features cuda`, for a GPU machine), rather than passing unrun.
fn gpu() -> Device {
    assert!(
        eagle_check::kernels::cuda::device_available(),
        "needs a CUDA device: this --features cuda test found no driver or no device"
    );
    Device::new_cuda(0).expect("CUDA device 0")
}

fn reference(path: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(path), &Device::Cpu).unwrap()
}

fn ids(r: &HashMap<String, Tensor>, key: &str) -> Vec<u32> {
    r[key]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

fn capture(name: &str, dtype: DType, path: ComputePath, dev: &Device) -> (ModelConfig, Capture) {
    let dir = fixture(&format!("models/{name}"));
    let cfg = ModelConfig::load(&dir).unwrap();
    let src = SafetensorsSource::open(&dir).unwrap();
    let model = load_target_on(&cfg, &src, dtype, dev, path).unwrap();
    let r = reference(&format!("models/{name}/reference.safetensors"));
    let cap = model
        .forward(
            &ids(&r, "input_ids"),
            &CaptureRequest::all(),
            &mut Progress::hidden(),
        )
        .unwrap();
    (cfg, cap)
}

fn worst(name: &str, cfg: &ModelConfig, cap: &Capture) -> f64 {
    let r = reference(&format!("models/{name}/reference.safetensors"));
    let mut worst = 0f64;
    let mut check = |got: &Tensor, key: &str| {
        let c = closeness(got, &r[key]).unwrap();
        assert_eq!(c.non_finite, 0, "{name} {key}");
        worst = worst.max(c.max_rel);
    };
    for b in 0..=cfg.num_layers {
        check(&cap.hidden[&b], &format!("hidden_states.{b}"));
    }
    check(cap.final_pre_norm.as_ref().unwrap(), "final_pre_norm");
    check(cap.logits.as_ref().unwrap(), "logits");
    worst
}

const TARGETS: [&str; 28] = [
    "llama",
    "llama_linear_bias",
    "mistral",
    "qwen2",
    "qwen3",
    "deepseek_v3",
    "deepseek_v3_noq",
    "qwen3_moe",
    "qwen2_moe",
    "minimax_m2",
    "glm4_moe",
    "glm4_moe_noqk",
    "glm4_moe_lite",
    "gpt_oss",
    "gpt_oss_mxfp4",
    "llama4",
    "phi3",
    "phi3_window",
    "gemma3_text",
    "gemma3",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5_moe",
    "gemma4_text",
    "gemma4_moe",
    "gemma4",
    "qwen3_next",
    "qwen3_vl_moe",
];

/// The MoE fixtures whose routing the GPU must reproduce.
const MOE_TARGETS: [&str; 15] = [
    "deepseek_v3",
    "deepseek_v3_noq",
    "qwen3_moe",
    "qwen2_moe",
    "minimax_m2",
    "glm4_moe",
    "glm4_moe_noqk",
    "glm4_moe_lite",
    "gpt_oss",
    "gpt_oss_mxfp4",
    "llama4",
    "qwen3_5_moe",
    "qwen3_next",
    "qwen3_vl_moe",
    "gemma4_moe",
];

#[test]
fn gpu_captures_match_transformers_for_every_fixture_target() {
    let dev = gpu();
    for name in TARGETS {
        for path in [ComputePath::Fused, ComputePath::Kernels] {
            let (cfg, cap) = capture(name, DType::F32, path, &dev);
            let w = worst(name, &cfg, &cap);
            eprintln!("gpu {name} {path:?} f32: worst {w:.2e}");
            assert!(w <= F32_TOL, "{name} {path:?} f32: {w:.3e}");
            let (cfg, cap) = capture(name, DType::BF16, path, &dev);
            // Gemma-4's bound has its own reason (tolerance.rs), for its dense and MoE targets.
            let bound = match cfg.arch {
                eagle_check::config::Arch::Gemma4 => eagle_check::tolerance::PARITY_BF16_GEMMA4,
                _ => BF16_TOL,
            };
            if let Some(moe) = &cfg.moe {
                // In bf16 a router may pick another expert at a near-tie (deepseek_v3_noq: one
                // token of layer 2, on the CPU too), which moves that token by O(1): the GPU is
                // held to the CPU's bf16 run of the same kernels instead of to f32, up to the
                // first layer whose picks differ between the two (a near-tie the bf16 GEMMs'
                // accumulation order decides; named, and at most one layer in four).
                let (_, cpu) = capture(name, DType::BF16, ComputePath::Kernels, &Device::Cpu);
                let picks = |c: &Capture, l: usize| {
                    c.extras[&format!("router.{l}.topk_idx")]
                        .to_dtype(DType::I64)
                        .unwrap()
                        .to_vec2::<i64>()
                        .unwrap()
                };
                let first_flip = (0..cfg.num_layers)
                    .filter(|&l| moe.is_moe_layer(l))
                    .find(|&l| picks(&cap, l) != picks(&cpu, l));
                if let Some(l) = first_flip {
                    eprintln!("gpu {name} {path:?} bf16: a near-tie routes layer {l} apart");
                    assert!(
                        l >= cfg.num_layers / 4,
                        "{name} {path:?}: layer {l} already"
                    );
                }
                for b in 0..=first_flip.unwrap_or(cfg.num_layers) {
                    let c = closeness(&cap.hidden[&b], &cpu.hidden[&b]).unwrap();
                    assert!(
                        c.max_rel <= bound,
                        "{name} {path:?} bf16 b={b} vs CPU: {:.3e}",
                        c.max_rel
                    );
                }
                continue;
            }
            let w = worst(name, &cfg, &cap);
            eprintln!("gpu {name} {path:?} bf16: worst {w:.2e}");
            assert!(w <= bound, "{name} {path:?} bf16: {w:.3e}");
        }
    }
}

/// Every MoE family's routing on the GPU (routing kernel: DeepSeek's and GLM's group-limited
/// sigmoid, MiniMax's biased sigmoid, Qwen's and gpt-oss's softmax) chooses transformers'
/// experts for every token of every MoE layer.
#[test]
fn gpu_moe_routing_matches_transformers() {
    let dev = gpu();
    for name in MOE_TARGETS {
        let (cfg, cap) = capture(name, DType::F32, ComputePath::Kernels, &dev);
        let r = reference(&format!("models/{name}/reference.safetensors"));
        let moe = cfg.moe.as_ref().unwrap();
        for l in (0..cfg.num_layers).filter(|&l| moe.is_moe_layer(l)) {
            let want = r[&format!("router.{l}.topk_idx")].to_vec2::<i64>().unwrap();
            let got = cap.extras[&format!("router.{l}.topk_idx")]
                .to_dtype(DType::I64)
                .unwrap()
                .to_vec2::<i64>()
                .unwrap();
            assert_eq!(got, want, "{name} layer {l}");
        }
    }
}

#[test]
fn gpu_drafts_match_the_pytorch_references() {
    let dev = gpu();
    for (target, draft) in [
        ("llama", "llama-draft"),
        ("qwen3", "qwen3-draft"),
        ("deepseek_v3", "mla-draft"),
    ] {
        let tdir = fixture(&format!("models/{target}"));
        let tcfg = ModelConfig::load(&tdir).unwrap();
        let tsrc = SafetensorsSource::open(&tdir).unwrap();
        let model = load_target_on(&tcfg, &tsrc, DType::F32, &dev, ComputePath::Kernels).unwrap();
        let ddir = fixture(&format!("models/{draft}"));
        let dcfg = DraftConfig::load(&ddir).unwrap();
        let dsrc = SafetensorsSource::open(&ddir).unwrap();
        let vb = Vb::new(&dsrc, DType::F32, &dev);
        let d = Eagle3Draft::load(&dcfg, &vb, tcfg.hidden_size, 3).unwrap();
        let r = reference(&format!("models/{draft}/draft_reference.safetensors"));
        let out = d
            .forward(
                &ids(&r, "draft_input_ids"),
                &r["draft_fc_input"].to_device(&dev).unwrap(),
                model.embeddings(),
            )
            .unwrap();
        let c = closeness(&out.logits, &r["draft_logits"]).unwrap();
        eprintln!("gpu {draft}: max rel {:.2e}", c.max_rel);
        assert!(c.max_rel <= F32_TOL, "{draft}: {:.3e}", c.max_rel);
    }
}

/// The fused path and the kernel path on a longer sequence in bf16: two launch sequences of
/// the same kernels, so they agree to bf16 rounding.
#[test]
fn gpu_fused_and_kernel_paths_agree_on_a_long_sequence() {
    let dev = gpu();
    let ids: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % 256).collect();
    for name in ["llama", "qwen3", "mistral"] {
        let dir = fixture(&format!("models/{name}"));
        let cfg = ModelConfig::load(&dir).unwrap();
        let src = SafetensorsSource::open(&dir).unwrap();
        let caps: Vec<Capture> = [ComputePath::Fused, ComputePath::Kernels]
            .into_iter()
            .map(|path| {
                load_target_on(&cfg, &src, DType::BF16, &dev, path)
                    .unwrap()
                    .forward(&ids, &CaptureRequest::all(), &mut Progress::hidden())
                    .unwrap()
            })
            .collect();
        for b in 0..=cfg.num_layers {
            let c = closeness(&caps[0].hidden[&b], &caps[1].hidden[&b]).unwrap();
            assert!(c.max_rel <= BF16_TOL, "{name} b={b}: {:.3e}", c.max_rel);
        }
    }
}

/// `run` on every shipped bundle and `diff` on every corpus entry: the GPU gives the CPU's
/// verdict, findings and fed layout.
#[test]
fn gpu_verdicts_equal_cpu_verdicts() {
    gpu();
    let summary = |out: &crate::support::Output| {
        let j = out.json();
        (
            out.code,
            j["verdict"].clone(),
            out.finding_names(),
            j["subject"]["fed_b"].clone(),
        )
    };
    for bundle in [
        "tiny-llama",
        "tiny-llama-vllm-offbyone",
        "tiny-deepseek",
        "tiny-deepseek-seed",
    ] {
        let b = p(&fixture(&format!("bundles/{bundle}")));
        let on = |device: &str| eagle_check(["run", &b, "--device", device, "--format", "json"]);
        let (cpu, gpu) = (on("cpu"), on("cuda"));
        assert_eq!(summary(&gpu), summary(&cpu), "{bundle}: {}", gpu.stderr);
    }
    for entry in crate::support::corpus() {
        let target = p(&fixture(&format!(
            "models/{}",
            entry["arch"].as_str().unwrap()
        )));
        let on = |device: &str| {
            eagle_check([
                "diff",
                "--spec",
                entry["spec"].as_str().unwrap(),
                "--target",
                &target,
                "--captures",
                entry["path"].as_str().unwrap(),
                "--device",
                device,
                "--dtype",
                "f32",
                "--format",
                "json",
            ])
        };
        let (cpu, gpu) = (on("cpu"), on("cuda"));
        assert_eq!(
            (gpu.code, gpu.finding_names()),
            (cpu.code, cpu.finding_names()),
            "{}: {}",
            entry["path"],
            gpu.stderr
        );
    }
}

/// The acceptance probe on the trained pair (f32 on both devices): the same rows (layouts and
/// labels, in the same order), the same findings and exit code, and acceptance figures that
/// differ by at most two positions of 255 (f32 sums in another order can flip a top-1 near-tie).
#[test]
fn gpu_probe_gives_the_cpu_probe() {
    gpu();
    let bundle = p(&fixture("bundles/trained-llama"));
    let on = |device: &str| {
        eagle_check([
            "probe", &bundle, "--device", device, "--dtype", "f32", "--format", "json",
        ])
    };
    let (cpu, gpu) = (on("cpu"), on("cuda"));
    assert_eq!(cpu.code, 0, "{}", cpu.stderr);
    assert_eq!(
        (gpu.code, gpu.finding_names()),
        (cpu.code, cpu.finding_names()),
        "{}",
        gpu.stderr
    );
    let rows = |out: &crate::support::Output| out.json()["probe"].as_array().cloned().unwrap();
    let (a, b) = (rows(&cpu), rows(&gpu));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["boundaries"], y["boundaries"]);
        assert_eq!(x["labels"], y["labels"]);
        let acc = |r: &serde_json::Value| r["acceptance"]["value"].as_f64().unwrap();
        assert!(
            (acc(x) - acc(y)).abs() <= 2.0 / 255.0 + 1e-9,
            "{}: cpu {} gpu {}",
            x["labels"],
            acc(x),
            acc(y)
        );
    }
}

/// `--stream-layers` on the GPU (each layer uploaded, run and dropped) dumps what the resident
/// GPU run dumps, within f32 parity (the resident run may take the fused path, the streamed one
/// the generic layers), and gives the same verdict.
#[test]
fn gpu_streamed_run_dumps_what_the_resident_gpu_run_dumps() {
    gpu();
    let dir = crate::support::scratch("gpu-stream");
    for bundle in ["bundles/tiny-llama", "bundles/tiny-deepseek"] {
        let run = |path: &std::path::Path, stream: bool| {
            let mut args = vec![
                "run".to_string(),
                p(&fixture(bundle)),
                "--device".into(),
                "cuda".into(),
                "--dtype".into(),
                "f32".into(),
                "--dump".into(),
                p(path),
                "--format".into(),
                "json".into(),
            ];
            if stream {
                args.push("--stream-layers".into());
            }
            let out = eagle_check(&args);
            let dump = candle_core::safetensors::load(path, &Device::Cpu)
                .unwrap_or_else(|e| panic!("{bundle}: {e}: {}", out.stderr));
            (out, dump)
        };
        let (resident, a) = run(&dir.join("resident.safetensors"), false);
        let (streamed, b) = run(&dir.join("streamed.safetensors"), true);
        assert_eq!(
            (streamed.code, streamed.finding_names()),
            (resident.code, resident.finding_names()),
            "{bundle}: {}",
            streamed.stderr
        );
        let weights = streamed.json()["subject"]["weights"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(weights.starts_with("streamed"), "{bundle}: {weights}");
        let mut keys: Vec<&String> = a.keys().collect();
        keys.sort();
        assert_eq!(keys.len(), b.len(), "{bundle}");
        for k in keys {
            if a[k].dtype().is_int() {
                // The tokens match exactly; the draft's argmax ids follow its logits, checked
                // below, and may flip at a near-tie.
                if k == "input_ids" {
                    assert_eq!(ids(&a, k), ids(&b, k), "{bundle}");
                }
                continue;
            }
            let c = closeness(&b[k], &a[k]).unwrap();
            assert!(c.max_rel <= F32_TOL, "{bundle} {k}: {:.3e}", c.max_rel);
        }
    }
}

/// A streamed target on the GPU keeps its layers in host memory after the first forward
/// (locked: the copies go from there straight to the device): the forwards after it read less
/// from the checkpoint and capture what the first forward captured, in bf16 and f32, on a
/// dense and an MoE fixture.
#[test]
fn gpu_layers_kept_in_host_memory_give_the_first_forwards_bits() {
    use eagle_check::model::load_streamed;
    use eagle_check::model::stream::StreamOptions;
    let dev = gpu();
    for name in ["llama", "deepseek_v3"] {
        let dir = fixture(&format!("models/{name}"));
        let cfg = ModelConfig::load(&dir).unwrap();
        let r = reference(&format!("models/{name}/reference.safetensors"));
        let tokens = ids(&r, "input_ids");
        for (dtype, copy_ahead) in [
            (DType::BF16, false),
            (DType::BF16, true),
            (DType::F32, true),
        ] {
            let opts = StreamOptions {
                host_keep: u64::MAX,
                copy_ahead,
                ..StreamOptions::default()
            };
            let src = Box::new(SafetensorsSource::open(&dir).unwrap());
            let streamed = load_streamed(&cfg, src, dtype, &dev, opts).unwrap();
            streamed.keep_for_later(true);
            let forward = || {
                let before = streamed.stream_stats().unwrap().bytes_read;
                let cap = streamed
                    .forward(&tokens, &CaptureRequest::all(), &mut Progress::hidden())
                    .unwrap();
                (cap, streamed.stream_stats().unwrap().bytes_read - before)
            };
            let (first, read_first) = forward();
            for i in 0..3 {
                // The second of these is the last that wants the kept layers: it lets them
                // go, unlocked as their copies end, and the third reads them again.
                streamed.keep_for_later(i == 0);
                let (again, read) = forward();
                let held = streamed.stream_stats().unwrap().bytes_held;
                if i < 2 {
                    assert!(
                        read < read_first,
                        "{name} {dtype:?}: {read} of {read_first} read again"
                    );
                } else {
                    assert_eq!(read, read_first, "{name} {dtype:?}");
                }
                // After the second some may still wait for their copies; they are let go as
                // the third starts (the comparisons below have waited for the device by then).
                if i != 1 {
                    assert_eq!(held > 0, i == 0, "{name} {dtype:?}: {held} bytes held");
                }
                // The same kernels on the same weights: within parity (an MoE combine may sum
                // in another order), where a wrong or stale weight is off by its whole size.
                let tol = if dtype == DType::F32 {
                    F32_TOL
                } else {
                    BF16_TOL
                };
                assert_eq!(first.hidden.len(), again.hidden.len(), "{name} {dtype:?}");
                for (b, t) in &first.hidden {
                    let c = closeness(&again.hidden[b], t).unwrap();
                    assert!(
                        c.max_rel <= tol,
                        "{name} {dtype:?} b={b}: {:.3e}",
                        c.max_rel
                    );
                }
            }
            let stats = streamed.stream_stats().unwrap();
            assert_eq!(
                stats.layers_from_host,
                2 * cfg.num_layers,
                "{name} {dtype:?}"
            );
            // Every layer from host memory but the first of each forward was copied aside
            // while the one before computed, where asked.
            let ahead = if copy_ahead {
                2 * (cfg.num_layers - 1)
            } else {
                0
            };
            assert_eq!(stats.layers_copied_ahead, ahead, "{name} {dtype:?}");
            assert!(
                stats.max_resident_layers <= 1 + copy_ahead as usize,
                "{stats:?}"
            );
            assert!(
                stats.describe().contains("from host memory"),
                "{}",
                stats.describe()
            );
        }
    }
}

/// `run`, `diff` and `probe` through the binary on every MoE family's tiny checkpoint on the
/// GPU (f32): the expectations of the CPU test hold (`moe_families`), and every command's exit
/// code, findings and probed layouts equal the CPU's.
#[test]
fn gpu_cli_on_every_moe_family_gives_the_cpu_verdicts() {
    gpu();
    let cpu = crate::moe_families::run_diff_and_probe_on_every_family(&["--device", "cpu"]);
    let gpu = crate::moe_families::run_diff_and_probe_on_every_family(&[
        "--device", "cuda", "--dtype", "f32",
    ]);
    assert_eq!(gpu, cpu);
}

/// The same on every dense family's tiny checkpoint (Phi-3, Gemma-3, the Qwen-VL text towers):
/// the GPU's exit codes, findings and probed layouts equal the CPU's.
#[test]
fn gpu_cli_on_every_dense_family_gives_the_cpu_verdicts() {
    gpu();
    let cpu = crate::dense_families::run_diff_and_probe_on_every_family(&["--device", "cpu"]);
    let gpu = crate::dense_families::run_diff_and_probe_on_every_family(&[
        "--device", "cuda", "--dtype", "f32",
    ]);
    assert_eq!(gpu, cpu);
}

/// Issue 30: samples packed into one forward on the GPU (FastLlama for the Llama family, the
/// kernel path for the MoE and MLA families) give each sample its own forward's boundaries,
/// within the device's parity tolerances (cuBLAS picks its algorithm by the row count, so the
/// packed GEMMs may sum in another order).
#[test]
fn gpu_packed_forwards_equal_each_samples_own() {
    use eagle_check::model::{ManyOptions, Produced};
    let dev = gpu();
    let packed = ManyOptions {
        pack_tokens: 1 << 20,
    };
    for (name, path) in [
        ("llama", ComputePath::Fused),
        ("mistral", ComputePath::Fused),
        ("qwen3", ComputePath::Fused),
        ("qwen2", ComputePath::Kernels),
        ("deepseek_v3", ComputePath::Kernels),
        ("qwen3_moe", ComputePath::Kernels),
        ("gpt_oss", ComputePath::Kernels),
    ] {
        let dir = fixture(&format!("models/{name}"));
        let cfg = ModelConfig::load(&dir).unwrap();
        let r = reference(&format!("models/{name}/reference.safetensors"));
        let all = ids(&r, "input_ids");
        let sets: Vec<Vec<u32>> = vec![
            all.clone(),
            all[..all.len().div_ceil(2)].to_vec(),
            all.iter().rev().copied().collect(),
        ];
        let sets: Vec<&[u32]> = sets.iter().map(Vec::as_slice).collect();
        for (dtype, tol) in [(DType::F32, F32_TOL), (DType::BF16, BF16_TOL)] {
            let src = SafetensorsSource::open(&dir).unwrap();
            let model = load_target_on(&cfg, &src, dtype, &dev, path).unwrap();
            let want = CaptureRequest {
                layer_outputs: true,
                ..CaptureRequest::all()
            };
            let mut got: Vec<HashMap<String, Tensor>> = vec![HashMap::new(); sets.len()];
            model
                .forward_many(&sets, &want, &packed, &mut |s, what, t| {
                    let key = match what {
                        Produced::Boundary(b) => format!("b{b}"),
                        Produced::LayerOutput(i) => format!("mlp_out.{i}"),
                        Produced::FinalPreNorm => "pre".into(),
                        Produced::Logits => "logits".into(),
                    };
                    got[s].insert(key, t.clone());
                    Ok(())
                })
                .unwrap();
            for (k, set) in sets.iter().enumerate() {
                let single = model.forward(set, &want, &mut Progress::hidden()).unwrap();
                let check = |key: &str, t: &Tensor| {
                    let c = closeness(&got[k][key], t).unwrap();
                    assert!(
                        c.max_rel <= tol,
                        "{name} {dtype:?} sample {k} {key}: {:.3e}",
                        c.max_rel
                    );
                };
                for (b, t) in &single.hidden {
                    check(&format!("b{b}"), t);
                }
                check("pre", single.final_pre_norm.as_ref().unwrap());
                for i in 0..cfg.num_layers {
                    check(
                        &format!("mlp_out.{i}"),
                        &single.extras[&format!("mlp_out.{i}")],
                    );
                }
            }
        }
    }
}

/// Issue 30: `diff` on the GPU, batched (one pass, samples packed, scored on the device as
/// the states are made) and one forward per sample, finds the same faults in the same slots
/// on every corpus entry.
#[test]
fn gpu_batched_diff_equals_the_per_sample_diff() {
    use eagle_check::model::TargetOptions;
    let dev = gpu();
    for entry in crate::support::corpus() {
        let run = |per_sample: bool| {
            let opts = TargetOptions::new(DType::F32, &dev);
            let (report, _, _) = crate::support::diff_entry(&entry, &opts, per_sample, None);
            let findings: Vec<(String, Option<usize>)> = report
                .findings
                .iter()
                .map(|f| (f.name.as_str().to_string(), f.slot))
                .collect();
            let found: Vec<Vec<Option<usize>>> = report
                .captures
                .iter()
                .map(|c| c.slots.iter().map(|s| s.found_boundary).collect())
                .collect();
            (findings, found)
        };
        assert_eq!(run(false), run(true), "{}", entry["path"]);
    }
}
