//! `cargo bench --bench diff`: the diff engine over many samples of T = 512, H = 1024, k = 3 on
//! the CPU, with the time split between the target forward (the peer every sample pays) and the
//! identification scoring. A random 3-layer Llama (H 1024, GQA 8/2, MLP 1024) stands in for the
//! target; captures hold its true boundaries [1, 2, 3], so every slot is identified in full.
//! Samples: EAGLE_CHECK_BENCH_SAMPLES (default 1000); 10 distinct sequences, hard-linked.
//! EAGLE_CHECK_BENCH_DEVICES (default `cpu`; `cpu,cuda` in a `cuda` build) runs the same diff
//! once per device, each with that device's default dtype (f32 on the CPU, bf16 on the GPU), so
//! the GPU's samples/s is read against the CPU's in one run. EAGLE_CHECK_BENCH_DIR moves the
//! scratch directory (default `target/bench-scratch/diff` in the checkout).
//! EAGLE_CHECK_BENCH_PREPARE=N: only the host preparation of N (default 16) samples' slots for a
//! GPU pass (see `prepare_bench`).

use candle_core::{DType, Device, Tensor};
use eagle_check::diff::reference::{ReferenceSource, RunnerReference};
use eagle_check::diff::{DiffInput, diff};
use eagle_check::model::open_target;
use eagle_check::model::{CaptureRequest, Progress};
use eagle_check::spec::Spec;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

const H: usize = 1024;
const T: usize = 512;
const L: usize = 3;
const VOCAB: usize = 512;

/// A small deterministic generator, so the bench needs no extra crate.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    fn tensor(&mut self, shape: &[usize], scale: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.next() * scale).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }
}

fn write_target(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let (heads, kv, hd, inter) = (8usize, 2usize, 128usize, 1024usize);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
        "num_hidden_layers": L, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hd, "intermediate_size": inter, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut rng = Lcg(7);
    let mut w: HashMap<String, Tensor> = HashMap::new();
    w.insert(
        "model.embed_tokens.weight".into(),
        rng.tensor(&[VOCAB, H], 2.0),
    );
    w.insert(
        "model.norm.weight".into(),
        Tensor::ones(H, DType::F32, &Device::Cpu).unwrap(),
    );
    let s = 2.0 / (H as f32).sqrt();
    for i in 0..L {
        let p = format!("model.layers.{i}");
        for (name, shape) in [
            ("self_attn.q_proj", [heads * hd, H]),
            ("self_attn.k_proj", [kv * hd, H]),
            ("self_attn.v_proj", [kv * hd, H]),
            ("self_attn.o_proj", [H, heads * hd]),
            ("mlp.gate_proj", [inter, H]),
            ("mlp.up_proj", [inter, H]),
            ("mlp.down_proj", [H, inter]),
        ] {
            w.insert(format!("{p}.{name}.weight"), rng.tensor(&shape, s));
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            w.insert(
                format!("{p}.{norm}.weight"),
                Tensor::ones(H, DType::F32, &Device::Cpu).unwrap(),
            );
        }
    }
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
}

/// `distinct` random sequences of `t` tokens (seeded by `seed`) with `target`'s own boundaries
/// `bs` as their aux states, written to `dir` as safetensors captures and hard-linked up to
/// `samples` files; returns the sequences.
fn write_captures(
    target: &eagle_check::model::LoadedTarget,
    dir: &Path,
    bs: &[usize],
    t: usize,
    distinct: usize,
    samples: usize,
    seed: u64,
) -> Vec<Vec<u32>> {
    std::fs::create_dir_all(dir).unwrap();
    let vocab = target.cfg.vocab_size;
    let mut rng = Lcg(seed);
    let mut sets = Vec::with_capacity(distinct);
    for d in 0..distinct {
        let ids: Vec<u32> = (0..t)
            .map(|_| ((rng.next() + 0.5) * vocab as f32) as u32 % vocab as u32)
            .collect();
        let want = CaptureRequest {
            boundaries: Some(bs.to_vec()),
            final_pre_norm: false,
            logits: false,
            layer_outputs: false,
        };
        let cap = target
            .model
            .forward(&ids, &want, &mut Progress::hidden())
            .unwrap();
        let parts: Vec<&Tensor> = bs.iter().map(|b| &cap.hidden[b]).collect();
        let aux = Tensor::cat(&parts, 1).unwrap();
        let ids64: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
        let mut out: HashMap<String, Tensor> = HashMap::new();
        out.insert(
            "input_ids".into(),
            Tensor::new(ids64.as_slice(), &Device::Cpu).unwrap(),
        );
        out.insert("aux_hidden_states".into(), aux);
        candle_core::safetensors::save(&out, dir.join(format!("s{d:04}.safetensors"))).unwrap();
        sets.push(ids);
    }
    for i in distinct..samples {
        std::fs::hard_link(
            dir.join(format!("s{:04}.safetensors", i % distinct)),
            dir.join(format!("s{i:04}.safetensors")),
        )
        .unwrap();
    }
    sets
}

fn main() {
    if let Some(n) = std::env::var_os("EAGLE_CHECK_BENCH_PREPARE") {
        prepare_bench(n.to_str().and_then(|n| n.parse().ok()).unwrap_or(16));
        return;
    }
    if let Some(model) = std::env::var_os("EAGLE_CHECK_BENCH_STREAM") {
        stream_bench(Path::new(&model));
        return;
    }
    let samples: usize = std::env::var("EAGLE_CHECK_BENCH_SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let root = std::env::var_os("EAGLE_CHECK_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-scratch/diff")
        });
    let devices = std::env::var("EAGLE_CHECK_BENCH_DEVICES").unwrap_or_else(|_| "cpu".into());
    let _ = std::fs::remove_dir_all(&root);
    let target = root.join("target");
    write_target(&target);
    let loaded = open_target(&target, DType::F32, &Device::Cpu).unwrap();

    // 10 distinct sequences with their true boundaries [1, 2, 3] as aux states.
    let captures = root.join("captures");
    write_captures(
        &loaded,
        &captures,
        &[1, 2, 3],
        T,
        10.min(samples),
        samples,
        11,
    );
    let spec_path = root.join("spec.yaml");
    std::fs::write(&spec_path, format!("name: bench\ntarget: {{ num_hidden_layers: {L}, hidden_size: {H} }}\ncapture: {{ boundaries: [1, 2, 3] }}\n")).unwrap();
    let spec = Spec::load(&spec_path).unwrap();

    for name in devices.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let (device, dtype) = match name {
            "cpu" => (Device::Cpu, DType::F32),
            "cuda" => (cuda_device(), DType::BF16),
            other => panic!("EAGLE_CHECK_BENCH_DEVICES: unknown device {other:?} (cpu, cuda)"),
        };
        bench_on(&spec, &captures, &target, samples, name, &device, dtype);
    }
}

/// One timed diff of every capture against the target run on `device`.
fn bench_on(
    spec: &Spec,
    captures: &Path,
    target: &Path,
    samples: usize,
    name: &str,
    device: &Device,
    dtype: DType,
) {
    let mut reference = RunnerReference {
        target: open_target(target, dtype, device).unwrap(),
        path: target.to_path_buf(),
        forward_seconds: 0.0,
    };
    let start = Instant::now();
    let (report, stats) = diff(
        &DiffInput {
            spec,
            captures: &[captures.to_path_buf()],
            feed: None,
            arch: None,
            batching: Default::default(),
        },
        &mut reference,
    )
    .unwrap();
    let wall = start.elapsed().as_secs_f64();
    assert_eq!(
        report.exit_code(),
        0,
        "bench captures must be consistent on {name}"
    );
    assert_eq!(stats.samples, samples);
    let _ = reference.num_layers();
    println!(
        "diff: {samples} samples, T = {T}, H = {H}, k = 3, target L = {L} ({name}, {dtype:?}, {} CPU threads)",
        candle_core::utils::get_num_threads()
    );
    println!(
        "  wall:                {wall:>8.1} s   ({:.2} samples/s)",
        samples as f64 / wall
    );
    println!(
        "  target forward:      {:>8.1} s   ({:.0}% of wall)",
        stats.reference_seconds,
        100.0 * stats.reference_seconds / wall
    );
    println!(
        "  scoring:             {:>8.1} s   ({:.0}% of wall)",
        stats.scoring_seconds,
        100.0 * stats.scoring_seconds / wall
    );
    println!(
        "  reading captures:    {:>8.1} s   ({:.0}% of wall)",
        stats.read_seconds,
        100.0 * stats.read_seconds / wall
    );
    println!(
        "  scoring / forward:   {:>8.3}",
        stats.scoring_seconds / stats.reference_seconds
    );
}

/// The GPU as `eagle-check` opens it (one stream, freed memory kept in the pool).
#[cfg(feature = "cuda")]
fn cuda_device() -> Device {
    Device::Cuda(eagle_check::kernels::cuda::open_device(0).unwrap())
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Device {
    Device::new_cuda(0).unwrap()
}

/// `EAGLE_CHECK_BENCH_STREAM=MODEL cargo bench --bench diff` (issue 30): `diff` of
/// EAGLE_CHECK_BENCH_SAMPLES (default 64) samples of EAGLE_CHECK_BENCH_T (default 512) tokens
/// on the target at MODEL (an HF directory or a GGUF file) streamed on the CPU in f32, batched
/// (the default: one pass, each layer read once) and one forward per sample, against the
/// larger of the checkpoint read at the disk's rate (`dd` of the same files in the same run)
/// and the resident forwards of the same samples. The captures hold the target's own states
/// at b = [2, L/2, L-3] (EAGLE_CHECK_BENCH_DISTINCT distinct sequences, default 8,
/// hard-linked). EAGLE_CHECK_BENCH_RESIDENT=0: the target is never held whole (its captures
/// are written streamed; the floor is then the disk alone).
fn stream_bench(model: &Path) {
    use eagle_check::diff::Batching;
    use eagle_check::model::{ManyOptions, Produced, TargetOptions};
    let env = |k: &str| -> Option<usize> { std::env::var(k).ok().and_then(|s| s.parse().ok()) };
    let (samples, t) = (
        env("EAGLE_CHECK_BENCH_SAMPLES").unwrap_or(64),
        env("EAGLE_CHECK_BENCH_T").unwrap_or(512),
    );
    let root = std::env::var_os("EAGLE_CHECK_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-scratch/diff-stream")
        });
    let _ = std::fs::remove_dir_all(&root);
    let captures = root.join("captures");
    // A target too large to hold (EAGLE_CHECK_BENCH_RESIDENT=0: the 8B shape in f32 on a
    // 24 GiB machine) writes its captures streamed and has no resident forwards to compare.
    let fits = env("EAGLE_CHECK_BENCH_RESIDENT") != Some(0);
    // EAGLE_CHECK_BENCH_MAX_MEMORY_GIB: the CLI's --max-memory (the streamed layers and,
    // half of it, a pass's samples).
    let max_memory = env("EAGLE_CHECK_BENCH_MAX_MEMORY_GIB").map(|g| (g as u64) << 30);
    let streamed = TargetOptions {
        stream_layers: true,
        max_memory,
        ..TargetOptions::new(DType::F32, &Device::Cpu)
    };
    let resident = if fits {
        open_target(model, DType::F32, &Device::Cpu).unwrap()
    } else {
        eagle_check::model::open_target_with(model, &streamed).unwrap()
    };
    let (l, h) = (resident.cfg.num_layers, resident.cfg.hidden_size);
    let bs = [2, l / 2, l - 3];
    let distinct = env("EAGLE_CHECK_BENCH_DISTINCT").unwrap_or(8).min(samples);
    let sets = write_captures(&resident, &captures, &bs, t, distinct, samples, 13);
    let spec_path = root.join("spec.yaml");
    std::fs::write(
        &spec_path,
        format!(
            "name: bench\ntarget: {{ num_hidden_layers: {l}, hidden_size: {h} }}\ncapture: {{ boundaries: {bs:?} }}\n"
        ),
    )
    .unwrap();
    let spec = Spec::load(&spec_path).unwrap();
    // The resident forwards of the same samples (the compute a streamed diff cannot avoid).
    let all: Vec<&[u32]> = (0..samples)
        .map(|i| sets[i % distinct].as_slice())
        .collect();
    let forwards_s = if fits {
        let start = Instant::now();
        resident
            .model
            .forward_many(
                &all,
                &CaptureRequest::all(),
                &ManyOptions::UNPACKED,
                &mut |_, _: Produced, _| Ok(()),
            )
            .unwrap();
        start.elapsed().as_secs_f64()
    } else {
        0.0
    };
    drop(resident);
    // The disk: every weight file read once, as dd reads it.
    let files: Vec<PathBuf> = if model.is_file() {
        vec![model.to_path_buf()]
    } else {
        std::fs::read_dir(model)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect()
    };
    let bytes: u64 = files.iter().map(|f| f.metadata().unwrap().len()).sum();
    let start = Instant::now();
    for f in &files {
        let ok = std::process::Command::new("dd")
            .arg(format!("if={}", f.display()))
            .args(["of=/dev/null", "bs=16M", "status=none"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "dd of {}", f.display());
    }
    let dd_s = start.elapsed().as_secs_f64();
    println!(
        "diff streamed on the CPU: {samples} samples of T = {t}, {} (L {l}, H {h}), f32, {} CPU threads",
        model.display(),
        candle_core::utils::get_num_threads()
    );
    println!(
        "  dd of the weights:        {dd_s:>8.2} s   ({:.2} GB, {:.2} GB/s)",
        bytes as f64 / 1e9,
        bytes as f64 / dd_s / 1e9
    );
    if fits {
        println!("  resident forwards:        {forwards_s:>8.2} s");
    } else {
        println!("  resident forwards:        (the target does not fit: the floor is dd alone)");
    }
    for per_sample in [false, true] {
        let mut reference = RunnerReference::open(model, &streamed).unwrap();
        let start = Instant::now();
        let (report, stats) = diff(
            &DiffInput {
                spec: &spec,
                captures: std::slice::from_ref(&captures),
                feed: None,
                arch: None,
                batching: Batching {
                    per_sample,
                    budget: max_memory.map(|b| b / 2),
                },
            },
            &mut reference,
        )
        .unwrap();
        let wall = start.elapsed().as_secs_f64();
        assert_eq!(report.exit_code(), 0, "bench captures must be consistent");
        assert_eq!(stats.samples, samples);
        let cost = reference.target.model.stream_stats().unwrap();
        let floor = (bytes as f64 / (bytes as f64 / dd_s)).max(forwards_s);
        println!(
            "  {:<25} {wall:>8.2} s   wall / max(dd, resident forwards) = {:.2} (forwards {:.2} s, scoring {:.2} s, reading {:.2} s; {} passes, {} re-run alone); {} layers loaded, {:.2} GB read ({:.2}x the weights)",
            if per_sample {
                "one sample at a time:"
            } else {
                "batched (one pass):"
            },
            wall / floor,
            stats.reference_seconds,
            stats.scoring_seconds,
            stats.read_seconds,
            stats.passes,
            stats.rerun,
            cost.layers_loaded,
            cost.bytes_read as f64 / 1e9,
            cost.bytes_read as f64 / bytes as f64
        );
    }
}

/// `EAGLE_CHECK_BENCH_PREPARE=N cargo bench --bench diff`: the host work of readying `n`
/// SpecForge-shaped bf16 samples for a GPU pass (T = 2,048, the 8B shape's H = 4,096, three aux
/// slots and the training target), the way a diff does it since the captured slots go up as
/// stored (`OnlineSample::group_stored`: a check that every value is finite) against the way
/// before (every value widened to f32, then narrowed back to bf16 for the upload:
/// `OnlineSample::group` of the widened values), in the same run, alternating, each sample's
/// buffers freed inside its timing. Run on the CPU through the tensor path, which prepares as
/// a GPU does; nothing is uploaded. `free_capture_ms`: dropping a sample's captured tensors as
/// read (what a pass leaves to free once its samples are judged).
fn prepare_bench(n: usize) {
    use eagle_check::diff::online::OnlineSample;
    use eagle_check::readers::{DType as Stored, HostTensor};
    use eagle_check::tolerance::CaptureTolerance;
    use std::sync::Arc;
    let (t, h, k) = (2048usize, 4096usize, 3usize);
    let mut rng = Lcg(3);
    let tensor = |cols: usize, rng: &mut Lcg| {
        let bytes: Vec<u8> = (0..t * cols)
            .flat_map(|_| half::bf16::from_f32(rng.next()).to_le_bytes())
            .collect();
        HostTensor::from_le_bytes(Stored::BF16, vec![1, t, cols], bytes).unwrap()
    };
    let tol = CaptureTolerance::for_dtype(Stored::BF16);
    let fresh = || OnlineSample::new(32, h, t, tol, &Device::Cpu).scored_through_tensors();
    let (mut stored_s, mut widened_s, mut free_s) = (0.0, 0.0, 0.0);
    for i in 0..n {
        let (aux, target) = (tensor(k * h, &mut rng), tensor(h, &mut rng));
        let freed = |(aux, target): (HostTensor, HostTensor), free_s: &mut f64| {
            let start = Instant::now();
            drop((aux, target));
            *free_s += start.elapsed().as_secs_f64();
        };
        for stored in [i % 2 == 0, i % 2 != 0] {
            let start = Instant::now();
            let mut online = fresh();
            if stored {
                online.group_stored(&aux, t, k * h, h, k).unwrap();
                online.group_stored(&target, t, h, h, 1).unwrap();
            } else {
                online
                    .group(Arc::new(aux.to_f32_vec()), t, k * h, h, k)
                    .unwrap();
                online
                    .group(Arc::new(target.to_f32_vec()), t, h, h, 1)
                    .unwrap();
            }
            drop(online);
            let s = start.elapsed().as_secs_f64();
            if stored {
                stored_s += s;
            } else {
                widened_s += s;
            }
        }
        freed((aux, target), &mut free_s);
    }
    let ms = |s: f64| 1000.0 * s / n as f64;
    println!(
        "{{\"bench\": \"prepare\", \"samples\": {n}, \"T\": {t}, \"H\": {h}, \"slots\": {}, \"stored_ms\": {:.2}, \"widened_ms\": {:.2}, \"widened_over_stored\": {:.1}, \"free_capture_ms\": {:.2}}}",
        k + 1,
        ms(stored_s),
        ms(widened_s),
        widened_s / stored_s,
        ms(free_s)
    );
}
