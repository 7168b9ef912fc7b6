//! `cargo bench --bench stream`: a target larger than memory, captured on the CPU by streaming
//! its layers (`run --stream-layers --max-memory 4GiB`, the real binary), against the disk's
//! read bandwidth measured in the same run; and streaming against the resident run on a model
//! that fits, bit for bit.
//!
//! 1. Writes (once; reused when present) a random Llama-3.1-8B-shape checkpoint, bf16, sharded
//!    safetensors under target/bench-scratch/ (32 layers, H 4096, 32/8 heads, FFN 14336, vocab
//!    128256: 16.06 GB). In f32, the CPU's compute dtype, it is 32 GB: more than this machine's
//!    24 GiB could ever hold resident.
//! 2. Disk bandwidth: the shard files are dropped from the page cache (`fsync`, then
//!    `posix_fadvise(POSIX_FADV_DONTNEED)`), and the first 4 GiB of them read sequentially in
//!    16 MiB reads: the cold read rate a streamed run can at best consume weights at.
//! 3. The 8B capture, T = 32 tokens, cold (the shards dropped from the cache again first) and
//!    then warm (whatever the page cache kept): wall time, weight bytes read per second (every
//!    layer, the head and the 32 embedding rows, from the headers) against the disk rate, the
//!    peak resident set the report prints (VmHWM).
//! 4. A random Llama that fits (8 layers, H 2048, 16/4 heads, FFN 5632, vocab 32000; 1.0 GB
//!    bf16, 2.0 GB resident in f32): `run --dump` resident and streamed, every dumped tensor
//!    compared bit for bit, wall time and peak of each; and in-process, the logits of both
//!    (the streamed head runs in row chunks) compared bit for bit.
//!
//! `EAGLE_CHECK_BENCH_SKIP_8B=1` runs only step 4.

use candle_core::{DType, Device, Tensor};
use eagle_check::config::ModelConfig;
use eagle_check::model::source::SafetensorsSource;
use eagle_check::model::stream::StreamOptions;
use eagle_check::model::{CaptureRequest, Progress, load_streamed, load_target};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const T: usize = 32;

/// A Llama-family shape.
struct Shape {
    name: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    vocab: usize,
    /// Layers per shard file.
    per_shard: usize,
}

const LLAMA_8B: Shape = Shape {
    name: "llama-3.1-8b-shape-bf16",
    layers: 32,
    hidden: 4096,
    heads: 32,
    kv_heads: 8,
    ffn: 14336,
    vocab: 128256,
    per_shard: 4,
};

const LLAMA_SMALL: Shape = Shape {
    name: "llama-small-bf16",
    layers: 8,
    hidden: 2048,
    heads: 16,
    kv_heads: 4,
    ffn: 5632,
    vocab: 32000,
    per_shard: 4,
};

impl Shape {
    fn config(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "vocab_size": self.vocab,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "max_position_embeddings": 131072,
            "tie_word_embeddings": false,
            "attention_bias": false,
            "mlp_bias": false,
            "torch_dtype": "bfloat16"
        })
    }

    /// Shards of (name, shape, init scale; 0 = ones), in file order.
    fn shards(&self) -> Vec<Vec<(String, Vec<usize>, f32)>> {
        let (h, hd) = (self.hidden, self.hidden / self.heads);
        let lin = |rows: usize, cols: usize| (vec![rows, cols], 1.0 / (cols as f32).sqrt());
        let mut shards = vec![vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab, h],
            0.02,
        )]];
        for first in (0..self.layers).step_by(self.per_shard) {
            let mut shard = Vec::new();
            for i in first..(first + self.per_shard).min(self.layers) {
                let p = format!("model.layers.{i}");
                for (name, (shape, scale)) in [
                    ("self_attn.q_proj", lin(self.heads * hd, h)),
                    ("self_attn.k_proj", lin(self.kv_heads * hd, h)),
                    ("self_attn.v_proj", lin(self.kv_heads * hd, h)),
                    ("self_attn.o_proj", lin(h, self.heads * hd)),
                    ("mlp.gate_proj", lin(self.ffn, h)),
                    ("mlp.up_proj", lin(self.ffn, h)),
                    ("mlp.down_proj", lin(h, self.ffn)),
                ] {
                    shard.push((format!("{p}.{name}.weight"), shape, scale));
                }
                for norm in ["input_layernorm", "post_attention_layernorm"] {
                    shard.push((format!("{p}.{norm}.weight"), vec![h], 0.0));
                }
            }
            shards.push(shard);
        }
        shards.push(vec![
            ("model.norm.weight".to_string(), vec![h], 0.0),
            (
                "lm_head.weight".to_string(),
                vec![self.vocab, h],
                1.0 / (h as f32).sqrt(),
            ),
        ]);
        shards
    }
}

/// Writes `shape` as bf16 safetensors shards with an index under `dir`, unless a complete copy
/// is there. Weights are uniform in [-scale, scale] from a fixed xorshift stream; norms are 1.
fn write_checkpoint(shape: &Shape, dir: &Path) -> Vec<PathBuf> {
    let shards = shape.shards();
    let n = shards.len();
    let names: Vec<String> = (0..n)
        .map(|k| format!("model-{:05}-of-{n:05}.safetensors", k + 1))
        .collect();
    let files: Vec<PathBuf> = names.iter().map(|f| dir.join(f)).collect();
    let done = dir.join("complete");
    if done.is_file() {
        eprintln!("reusing {}", dir.display());
        return files;
    }
    std::fs::create_dir_all(dir).unwrap();
    let start = Instant::now();
    let mut weight_map = BTreeMap::new();
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
    for (shard, file) in shards.iter().zip(&files) {
        let mut header = serde_json::Map::new();
        let mut offset = 0usize;
        for (name, dims, _) in shard {
            let bytes = dims.iter().product::<usize>() * 2;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
            weight_map.insert(
                name.clone(),
                file.file_name().unwrap().to_string_lossy().into_owned(),
            );
        }
        let mut text = serde_json::Value::Object(header).to_string();
        while !text.len().is_multiple_of(8) {
            text.push(' ');
        }
        let mut w = BufWriter::with_capacity(16 << 20, File::create(file).unwrap());
        w.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
        w.write_all(text.as_bytes()).unwrap();
        let mut buf: Vec<u8> = Vec::with_capacity(2 << 20);
        for (_, dims, scale) in shard {
            let mut left: usize = dims.iter().product();
            while left > 0 {
                let k = left.min(1 << 20);
                buf.clear();
                for _ in 0..k {
                    let bits: u16 = if *scale == 0.0 {
                        0x3F80 // bf16 1.0
                    } else {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let u = (rng >> 40) as f32 / (1u64 << 24) as f32;
                        ((u * 2.0 - 1.0) * scale).to_bits().wrapping_shr(16) as u16
                    };
                    buf.extend_from_slice(&bits.to_le_bytes());
                }
                w.write_all(&buf).unwrap();
                left -= k;
            }
        }
        let f = w.into_inner().unwrap();
        f.sync_all().unwrap();
        eprintln!("wrote {}", file.display());
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    std::fs::write(dir.join("config.json"), shape.config().to_string()).unwrap();
    std::fs::write(&done, "").unwrap();
    eprintln!(
        "wrote {} in {:.0} s",
        dir.display(),
        start.elapsed().as_secs_f64()
    );
    files
}

unsafe extern "C" {
    fn posix_fadvise(fd: i32, offset: i64, len: i64, advice: i32) -> i32;
}

/// Linux `POSIX_FADV_DONTNEED`.
const FADV_DONTNEED: i32 = 4;

/// Drops `files` from the page cache (their pages are clean: written and synced).
fn drop_from_cache(files: &[PathBuf]) {
    for path in files {
        let f = File::open(path).unwrap();
        f.sync_all().unwrap();
        // SAFETY: a valid open descriptor; the call only advises the kernel.
        let rc = unsafe { posix_fadvise(f.as_raw_fd(), 0, 0, FADV_DONTNEED) };
        assert_eq!(rc, 0, "posix_fadvise on {}", path.display());
    }
}

/// Cold sequential read rate: the first `limit` bytes of `files`, dropped from the cache
/// first, in 16 MiB reads. (bytes, seconds)
fn cold_read(files: &[PathBuf], limit: u64) -> (u64, f64) {
    drop_from_cache(files);
    let mut buf = vec![0u8; 16 << 20];
    let (mut total, start) = (0u64, Instant::now());
    'files: for path in files {
        let mut f = File::open(path).unwrap();
        loop {
            let n = f.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            total += n as u64;
            if total >= limit {
                break 'files;
            }
        }
    }
    (total, start.elapsed().as_secs_f64())
}

/// What a streamed capture reads from the checkpoint: every tensor but the embedding table,
/// plus T rows of it.
fn weight_bytes_read(shape: &Shape) -> u64 {
    let all: u64 = shape
        .shards()
        .iter()
        .flatten()
        .map(|(_, d, _)| d.iter().product::<usize>() as u64 * 2)
        .sum();
    all - (shape.vocab * shape.hidden * 2) as u64 + (T * shape.hidden * 2) as u64
}

fn tokens(vocab: usize) -> Vec<u32> {
    (0..T).map(|i| ((i * 7919 + 17) % vocab) as u32).collect()
}

struct RunOut {
    seconds: f64,
    report: serde_json::Value,
}

impl RunOut {
    fn fact(&self, key: &str) -> String {
        self.report["subject"][key]
            .as_str()
            .unwrap_or("-")
            .to_string()
    }
}

/// `eagle-check run` on `dir` with `extra` flags, through the real binary.
fn run(dir: &Path, vocab: usize, extra: &[&str]) -> RunOut {
    let ids: Vec<String> = tokens(vocab).iter().map(|t| t.to_string()).collect();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_eagle-check"));
    cmd.arg("run")
        .arg("--target")
        .arg(dir)
        .args(["--engine", "sglang", "--format", "json", "--tokens"])
        .arg(ids.join(","))
        .args(extra);
    let start = Instant::now();
    let out = cmd.output().unwrap();
    let seconds = start.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(0),
        "eagle-check run {extra:?} failed: {stderr}"
    );
    if !stderr.trim().is_empty() {
        eprintln!("{}", stderr.trim());
    }
    RunOut {
        seconds,
        report: serde_json::from_slice(&out.stdout).unwrap(),
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// The number of tensors in two dumps and how many differ in any bit.
fn compare_dumps(a: &Path, b: &Path) -> (usize, usize) {
    let a = candle_core::safetensors::load(a, &Device::Cpu).unwrap();
    let b = candle_core::safetensors::load(b, &Device::Cpu).unwrap();
    assert_eq!(a.len(), b.len());
    let differ = a.iter().filter(|(k, t)| bits(t) != bits(&b[*k])).count();
    (a.len(), differ)
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let scratch = root.join("target/bench-scratch");
    let threads = candle_core::utils::get_num_threads();
    println!(
        "stream bench: {} threads, {}",
        threads,
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(
                |c| c.lines().find(|l| l.starts_with("model name")).map(|l| l
                    .split(':')
                    .nth(1)
                    .unwrap_or("")
                    .trim()
                    .to_string())
            )
            .unwrap_or_default()
    );

    if std::env::var_os("EAGLE_CHECK_BENCH_SKIP_8B").is_none() {
        let dir = scratch.join(LLAMA_8B.name);
        let files = write_checkpoint(&LLAMA_8B, &dir);
        let on_disk: u64 = files.iter().map(|f| f.metadata().unwrap().len()).sum();
        let (read, secs) = cold_read(&files, 4 << 30);
        let disk = read as f64 / secs;
        println!(
            "disk, cold sequential read: {:.2} GB in {secs:.1} s = {:.0} MB/s",
            gb(read),
            disk / 1e6
        );
        let weights = weight_bytes_read(&LLAMA_8B);
        let flags = ["--stream-layers", "--max-memory", "4GiB"];
        for label in ["cold", "warm"] {
            if label == "cold" {
                drop_from_cache(&files);
            }
            let r = run(&dir, LLAMA_8B.vocab, &flags);
            let rate = weights as f64 / r.seconds;
            println!(
                "8B-shape bf16 ({:.2} GB on disk; f32 resident estimate: {}), T = {T}, {label}: \
                 {:.1} s wall, {:.2} GB of weights read = {:.0} MB/s = {:.2}x the cold disk \
                 rate; peak {}; {}; {}",
                gb(on_disk),
                r.fact("weights"),
                r.seconds,
                gb(weights),
                rate / 1e6,
                rate / disk,
                r.fact("peak_memory"),
                r.fact("streaming"),
                r.fact("fed_b"),
            );
        }
    }

    // A model that fits: resident against streamed, bit for bit.
    let dir = scratch.join(LLAMA_SMALL.name);
    write_checkpoint(&LLAMA_SMALL, &dir);
    let (resident_dump, streamed_dump) = (dir.join("resident.dump"), dir.join("streamed.dump"));
    let resident = run(
        &dir,
        LLAMA_SMALL.vocab,
        &["--dump", resident_dump.to_str().unwrap()],
    );
    let streamed = run(
        &dir,
        LLAMA_SMALL.vocab,
        &["--stream-layers", "--dump", streamed_dump.to_str().unwrap()],
    );
    let (n, differ) = compare_dumps(&resident_dump, &streamed_dump);
    for (label, r) in [("resident", &resident), ("streamed", &streamed)] {
        println!(
            "small Llama, T = {T}, {label}: {:.1} s wall, peak {}; {}",
            r.seconds,
            r.fact("peak_memory"),
            r.fact("weights")
        );
    }
    println!(
        "small Llama dumps (hidden_states.0..=L, final_pre_norm, fc_input): {n} tensors, {differ} \
         differ in any bit; streamed / resident wall = {:.2}",
        streamed.seconds / resident.seconds
    );

    // The logits, in process: the streamed head runs in row chunks.
    let cfg = ModelConfig::load(&dir).unwrap();
    let ids = tokens(LLAMA_SMALL.vocab);
    let logits = |model: &dyn eagle_check::model::Target| {
        let want = CaptureRequest {
            boundaries: Some(Vec::new()),
            final_pre_norm: false,
            logits: true,
            layer_outputs: false,
        };
        let start = Instant::now();
        let cap = model.forward(&ids, &want, &mut Progress::hidden()).unwrap();
        (
            bits(cap.logits.as_ref().unwrap()),
            start.elapsed().as_secs_f64(),
        )
    };
    let (a, ta) = {
        let src = SafetensorsSource::open(&dir).unwrap();
        let model = load_target(&cfg, &src, DType::F32, &Device::Cpu).unwrap();
        logits(model.as_ref())
    };
    let src = Box::new(SafetensorsSource::open(&dir).unwrap());
    let model = load_streamed(
        &cfg,
        src,
        DType::F32,
        &Device::Cpu,
        StreamOptions::default(),
    )
    .unwrap();
    let (b, tb) = logits(model.as_ref());
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    println!(
        "small Llama logits [{T}, {}]: {same} of {} equal in every bit (forward {ta:.2} s resident \
         with weights held, {tb:.2} s streamed including reads)",
        LLAMA_SMALL.vocab,
        a.len()
    );
}
