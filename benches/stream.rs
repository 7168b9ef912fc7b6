//! `cargo bench --bench stream`: loading and streaming against the disk, as ratios to `dd` of
//! the same files in the same run (issue 30), and a target larger than memory captured on the
//! CPU by streaming its layers (`run --stream-layers --max-memory 4GiB`, the real binary);
//! streaming against the resident run on a model that fits, bit for bit.
//!
//! 1. Writes (once; reused when present) a random Llama-3.1-8B-shape checkpoint, bf16, sharded
//!    safetensors under target/bench-scratch/ (32 layers, H 4096, 32/8 heads, FFN 14336, vocab
//!    128256: 16.06 GB). In f32, the CPU's compute dtype, it is 32 GB: more than this machine's
//!    24 GiB could ever hold resident.
//! 2. The disk: `dd if=SHARD of=/dev/null bs=16M` over every shard, the shards dropped from the
//!    page cache first (`fsync`, then `posix_fadvise(POSIX_FADV_DONTNEED)`): the cold rate a
//!    streamed run can at best consume weights at.
//! 3. The 8B capture, T = 32 tokens, cold (the shards dropped from the cache again first) and
//!    then warm (whatever the page cache kept), with the default readers and, cold, with one
//!    read at a time (`EAGLE_CHECK_READERS=0`, the reader before issue 30): wall time, weight
//!    bytes read per second (every layer, the head and the 32 embedding rows, from the headers)
//!    against the disk rate, the peak resident set the report prints (VmHWM).
//! 4. Loading at the disk's rate, on a random Llama that fits (8 layers, H 2048, 16/4 heads,
//!    FFN 5632, vocab 32000; 1.0 GB bf16, 2.0 GB resident in f32), in process, page cache cold
//!    (dropped before each) and warm (read just before): `dd` of its shards; the resident load
//!    in f32 (bf16 widened as read) and in bf16, as `eagle-check run` loads it
//!    (`open_target_with`: the default readers) and with the source read alone (one read at a
//!    time); the streamed forward (T = 32, f32, open + one forward) with the default readers
//!    and with none, against the larger of `dd` and the resident forward of the same tokens
//!    with the weights held. Median of 3 each.
//! 5. The same Llama: `run --dump` resident and streamed, every dumped tensor compared bit for
//!    bit, wall time and peak of each; and in-process, the logits of both (the streamed head
//!    runs in row chunks) compared bit for bit.
//!
//! `EAGLE_CHECK_BENCH_SKIP_8B=1` runs only steps 4 and 5; `EAGLE_CHECK_BENCH_WRITE_ONLY=1` only
//! step 1 (and prints the checkpoint's folder, for `EAGLE_CHECK_BENCH_STREAM` of the diff bench).

use candle_core::{DType, Device, Tensor};
use eagle_check::config::ModelConfig;
use eagle_check::model::io::ReadOptions;
use eagle_check::model::source::SafetensorsSource;
use eagle_check::model::stream::StreamOptions;
use eagle_check::model::{
    CaptureRequest, Progress, TargetOptions, load_streamed, load_target, open_target_with,
};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
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

/// Seconds `dd if=FILE of=/dev/null bs=16M` takes over every file in turn (the peer every
/// load is measured against: one sequential reader, 16 MiB reads, nothing converted).
fn dd(files: &[PathBuf]) -> f64 {
    let start = Instant::now();
    for f in files {
        let status = Command::new("dd")
            .arg(format!("if={}", f.display()))
            .args(["of=/dev/null", "bs=16M", "status=none"])
            .status()
            .unwrap();
        assert!(status.success(), "dd of {}", f.display());
    }
    start.elapsed().as_secs_f64()
}

/// Brings `files` into the page cache (`dd` reads them once).
fn warm_up(files: &[PathBuf]) {
    dd(files);
}

/// The median of three timings of `f`, each after `before` (dropping or warming the cache).
fn median3(before: &dyn Fn(), mut f: impl FnMut() -> f64) -> f64 {
    let mut t: Vec<f64> = (0..3)
        .map(|_| {
            before();
            f()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[1]
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
    run_with(dir, vocab, extra, &[])
}

/// [`run`] with environment variables set for the process.
fn run_with(dir: &Path, vocab: usize, extra: &[&str], env: &[(&str, &str)]) -> RunOut {
    let ids: Vec<String> = tokens(vocab).iter().map(|t| t.to_string()).collect();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_eagle-check"));
    cmd.envs(env.iter().copied());
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

/// Step 4: the resident load and the streamed forward of the small Llama against `dd` of its
/// shards, cold and warm, with the default readers and with the source read alone.
fn load_at_disk_rate(scratch: &Path) {
    let dir = scratch.join(LLAMA_SMALL.name);
    let files = write_checkpoint(&LLAMA_SMALL, &dir);
    let bytes: u64 = files.iter().map(|f| f.metadata().unwrap().len()).sum();
    let cfg = ModelConfig::load(&dir).unwrap();
    let ids = tokens(LLAMA_SMALL.vocab);
    let want = CaptureRequest {
        boundaries: Some(Vec::new()),
        final_pre_norm: false,
        logits: true,
        layer_outputs: false,
    };
    let forward = |model: &dyn eagle_check::model::Target| {
        model.forward(&ids, &want, &mut Progress::hidden()).unwrap();
    };
    let timed = |f: &dyn Fn()| {
        let start = Instant::now();
        f();
        start.elapsed().as_secs_f64()
    };
    let readers = ReadOptions::default().readers;
    // The resident forward with the weights held: what a streamed forward cannot beat.
    let resident_forward = {
        let model = load_target(
            &cfg,
            &SafetensorsSource::open(&dir).unwrap(),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        forward(model.as_ref());
        median3(&|| {}, || timed(&|| forward(model.as_ref())))
    };
    println!(
        "load: small Llama, {:.2} GB bf16 in {} shards; {readers} readers (ReadOptions::default); \
         resident forward with the weights held, T = {T}, f32: {resident_forward:.2} s",
        gb(bytes),
        files.len()
    );
    for cache in ["cold", "warm"] {
        let before = || {
            if cache == "cold" {
                drop_from_cache(&files);
            } else {
                warm_up(&files);
            }
        };
        let dd_s = median3(&before, || dd(&files));
        println!(
            "load, {cache}: dd {dd_s:.2} s = {:.0} MB/s",
            bytes as f64 / dd_s / 1e6
        );
        for dtype in [DType::F32, DType::BF16] {
            // Timed up to the loaded target, not its freeing.
            let ours = median3(&before, || {
                let start = Instant::now();
                let target = open_target_with(&dir, &TargetOptions::new(dtype, &Device::Cpu));
                let secs = start.elapsed().as_secs_f64();
                drop(target.unwrap());
                secs
            });
            let alone = median3(&before, || {
                let start = Instant::now();
                let src = SafetensorsSource::open(&dir).unwrap();
                let target = load_target(&cfg, &src, dtype, &Device::Cpu);
                let secs = start.elapsed().as_secs_f64();
                drop(target.unwrap());
                secs
            });
            println!(
                "load, {cache}: resident in {dtype:?}: {ours:.2} s = {:.2}x dd ({readers} \
                 readers); {alone:.2} s = {:.2}x dd (one read at a time)",
                ours / dd_s,
                alone / dd_s
            );
        }
        for (label, readers) in [("default readers", readers), ("one read at a time", 0)] {
            let opts = StreamOptions {
                reads: ReadOptions {
                    readers,
                    ..ReadOptions::default()
                },
                ..StreamOptions::default()
            };
            let secs = median3(&before, || {
                timed(&|| {
                    let src = Box::new(SafetensorsSource::open(&dir).unwrap());
                    let model = load_streamed(&cfg, src, DType::F32, &Device::Cpu, opts).unwrap();
                    forward(model.as_ref());
                })
            });
            let floor = dd_s.max(resident_forward);
            println!(
                "load, {cache}: streamed forward, T = {T}, f32, {label}: {secs:.2} s = {:.2}x \
                 max(dd, resident forward) = {floor:.2} s",
                secs / floor
            );
        }
    }
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

    let dir_8b = scratch.join(LLAMA_8B.name);
    if std::env::var_os("EAGLE_CHECK_BENCH_WRITE_ONLY").is_some() {
        write_checkpoint(&LLAMA_8B, &dir_8b);
        println!("{}", dir_8b.display());
        return;
    }
    if std::env::var_os("EAGLE_CHECK_BENCH_SKIP_8B").is_none() {
        let dir = &dir_8b;
        let files = write_checkpoint(&LLAMA_8B, dir);
        let on_disk: u64 = files.iter().map(|f| f.metadata().unwrap().len()).sum();
        drop_from_cache(&files);
        let secs = dd(&files);
        let disk = on_disk as f64 / secs;
        println!(
            "disk, cold: dd of the {} shards, {:.2} GB in {secs:.1} s = {:.0} MB/s",
            files.len(),
            gb(on_disk),
            disk / 1e6
        );
        let weights = weight_bytes_read(&LLAMA_8B);
        let flags = ["--stream-layers", "--max-memory", "4GiB"];
        for (label, env) in [
            (
                "cold, one read at a time",
                &[("EAGLE_CHECK_READERS", "0")][..],
            ),
            ("cold", &[][..]),
            ("warm", &[][..]),
        ] {
            if label.starts_with("cold") {
                drop_from_cache(&files);
            }
            let r = run_with(dir, LLAMA_8B.vocab, &flags, env);
            let rate = weights as f64 / r.seconds;
            println!(
                "8B-shape bf16 ({:.2} GB on disk; f32 resident estimate: {}), T = {T}, {label}: \
                 {:.1} s wall, {:.2} GB of weights read = {:.0} MB/s = {:.2}x the cold dd \
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

    load_at_disk_rate(&scratch);

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
