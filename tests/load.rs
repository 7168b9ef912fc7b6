//! Loading at the disk's rate (issue 30): a target's weights read by several readers at once,
//! in pieces, ahead of the loader ([`eagle_check::model::io`]) are bit for bit what the source
//! read alone gives, on every weight format (sharded safetensors, FP8 blocks, MXFP4 in
//! safetensors and in GGUF, Q8_0 GGUF), weight by weight and as whole loaded targets; and the
//! weight estimate the memory plan is made from counts what the loaded layers hold once
//! dequantised, not what the files hold.

use crate::support::{fixture, scratch};
use candle_core::{DType, Device, Tensor};
use eagle_check::config::ModelConfig;
use eagle_check::model::gguf::open_gguf;
use eagle_check::model::io::{ReadOptions, read_ahead, resident_order};
use eagle_check::model::source::{SafetensorsSource, Vb, WeightSource};
use eagle_check::model::stream::WeightEstimate;
use eagle_check::model::{CaptureRequest, Progress, load_target};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A fixture's single `model.safetensors` split into three shards with an index, so that one
/// load reads several files at once.
fn sharded(rel: &str) -> PathBuf {
    let src = fixture(rel);
    let tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let dir = scratch(&format!("load-sharded-{}", rel.replace('/', "-")));
    let mut weight_map = serde_json::Map::new();
    let per = names.len().div_ceil(3);
    for (k, chunk) in names.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-00003.safetensors", k + 1);
        let part: HashMap<String, Tensor> = chunk
            .iter()
            .map(|n| ((*n).clone(), tensors[*n].clone()))
            .collect();
        candle_core::safetensors::save(&part, dir.join(&file)).unwrap();
        for n in chunk {
            weight_map.insert((*n).clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    dir
}

/// Every weight format: (label, config, a fresh source).
type Opener = Box<dyn Fn() -> Box<dyn WeightSource>>;

/// The checkpoints, written once for every test here: (label, path, GGUF).
fn checkpoints() -> &'static [(String, PathBuf, bool)] {
    static ONCE: OnceLock<Vec<(String, PathBuf, bool)>> = OnceLock::new();
    ONCE.get_or_init(|| {
        let mut out = Vec::new();
        for (label, dir) in [
            ("sharded llama", sharded("models/llama")),
            ("sharded llama bf16", sharded("models/llama_bf16")),
            ("sharded deepseek_v3", sharded("models/deepseek_v3")),
            ("deepseek_v3 fp8", crate::stream::fp8_target("load-fp8")),
            ("gpt_oss mxfp4", fixture("models/gpt_oss_mxfp4")),
        ] {
            out.push((label.to_string(), dir, false));
        }
        for path in [
            crate::gguf::write_q8_0("llama", "load"),
            crate::gguf::write_q8_0("qwen2", "load"),
            fixture("gguf/gpt_oss_mxfp4.gguf"),
        ] {
            let label = path.file_name().unwrap().to_string_lossy().into_owned();
            out.push((label, path, true));
        }
        out
    })
}

fn sources() -> Vec<(String, ModelConfig, Opener)> {
    checkpoints()
        .iter()
        .map(|(label, path, gguf)| {
            let path = path.clone();
            let (cfg, open): (ModelConfig, Opener) = if *gguf {
                let cfg = open_gguf(&path).unwrap().0;
                (cfg, Box::new(move || Box::new(open_gguf(&path).unwrap().1)))
            } else {
                let cfg = ModelConfig::load(&path).unwrap();
                (
                    cfg,
                    Box::new(move || Box::new(SafetensorsSource::open(&path).unwrap())),
                )
            };
            (label.clone(), cfg, open)
        })
        .collect()
}

/// Small pieces (a tensor of a few KiB is read by several readers), a small window (readers
/// wait for the loader; a tensor the loader wants first is read out of turn).
fn small_reads() -> ReadOptions {
    ReadOptions {
        readers: 4,
        piece_bytes: 1024,
        window: 32 << 10,
    }
}

/// Every element's bits, as stored.
fn bits(t: &Tensor) -> (Vec<usize>, DType, Vec<u64>) {
    use candle_core::CpuStorage as C;
    let flat = t.flatten_all().unwrap();
    let (storage, layout) = flat.storage_and_layout();
    let candle_core::Storage::Cpu(c) = &*storage else {
        panic!("a CPU tensor")
    };
    let r = layout.start_offset()..layout.start_offset() + flat.elem_count();
    let v: Vec<u64> = match c {
        C::U8(v) => v[r].iter().map(|&x| x as u64).collect(),
        C::U32(v) => v[r].iter().map(|&x| x as u64).collect(),
        C::I64(v) => v[r].iter().map(|&x| x as u64).collect(),
        C::BF16(v) => v[r].iter().map(|x| x.to_bits() as u64).collect(),
        C::F16(v) => v[r].iter().map(|x| x.to_bits() as u64).collect(),
        C::F32(v) => v[r].iter().map(|x| x.to_bits() as u64).collect(),
        C::F64(v) => v[r].iter().map(|x| x.to_bits()).collect(),
        C::F8E4M3(v) => v[r].iter().map(|x| x.to_bits() as u64).collect(),
        _ => panic!("no test of {:?}", t.dtype()),
    };
    (t.dims().to_vec(), t.dtype(), v)
}

/// Weight by weight: `Vb::get` (dequantised, in the compute dtype) and `Vb::get_raw` (as
/// stored) through the readers equal the source read alone, in f32 and bf16, the names asked
/// for in the order a resident load asks them.
#[test]
fn weights_read_ahead_equal_the_source_read_alone_on_every_format() {
    let dev = Device::Cpu;
    for (label, cfg, open) in sources() {
        let src = open();
        let order = resident_order(src.as_ref(), cfg.num_layers, cfg.tie_word_embeddings);
        assert!(!order.is_empty(), "{label}");
        for dtype in [DType::F32, DType::BF16] {
            let mut alone = Vb::new(src.as_ref(), dtype, &dev);
            alone.fp8_block = cfg.fp8_block;
            let fresh = open();
            read_ahead(fresh.as_ref(), &order, dtype, &dev, &small_reads(), |s| {
                let mut vb = Vb::new(s, dtype, &dev);
                vb.fp8_block = cfg.fp8_block;
                for name in order.iter().filter(|n| !n.ends_with("_scale_inv")) {
                    let what = format!("{label}: {name} in {dtype:?}");
                    let shape = src.shape(name).unwrap();
                    let want = alone.get(name, &shape).unwrap();
                    assert_eq!(bits(&vb.get(name, &shape).unwrap()), bits(&want), "{what}");
                    let want = alone.get_raw(name).unwrap();
                    assert_eq!(bits(&vb.get_raw(name).unwrap()), bits(&want), "{what}, raw");
                }
                Ok(())
            })
            .unwrap();
        }
    }
}

/// Whole targets, in the decoders' own order: a target loaded through the readers computes
/// what the one loaded by the source alone computes, bit for bit (every boundary, the logits).
#[test]
fn targets_loaded_through_the_readers_equal_the_sequential_load() {
    let dev = Device::Cpu;
    for (label, cfg, open) in sources() {
        let ids: Vec<u32> = (0..9)
            .map(|i| ((i * 37 + 3) % cfg.vocab_size) as u32)
            .collect();
        for dtype in [DType::F32, DType::BF16] {
            let forward = |model: &dyn eagle_check::model::Target| {
                model
                    .forward(&ids, &CaptureRequest::all(), &mut Progress::hidden())
                    .unwrap()
            };
            let want = forward(
                load_target(&cfg, open().as_ref(), dtype, &dev)
                    .unwrap()
                    .as_ref(),
            );
            let src = open();
            let order = resident_order(src.as_ref(), cfg.num_layers, cfg.tie_word_embeddings);
            let model = read_ahead(src.as_ref(), &order, dtype, &dev, &small_reads(), |s| {
                load_target(&cfg, s, dtype, &dev)
            })
            .unwrap();
            let got = forward(model.as_ref());
            let what = format!("{label} in {dtype:?}");
            assert_eq!(want.hidden.len(), got.hidden.len(), "{what}");
            for (b, t) in &want.hidden {
                assert_eq!(bits(t), bits(&got.hidden[b]), "{what}: b = {b}");
            }
            let logits = |c: &eagle_check::model::Capture| bits(c.logits.as_ref().unwrap());
            assert_eq!(logits(&want), logits(&got), "{what}: logits");
        }
    }
}

/// The bytes a layer's tensors hold once loaded, in `dtype`, tensor by tensor: dequantised
/// (FP8 weights with their scales; MXFP4 blocks with theirs, two values a byte), scales not
/// kept.
fn loaded_bytes(cfg: &ModelConfig, src: &dyn WeightSource, dtype: DType) -> Vec<u64> {
    let dev = Device::Cpu;
    let mut vb = Vb::new(src, dtype, &dev);
    vb.fp8_block = cfg.fp8_block;
    let names = src.names();
    let mut layers = vec![0u64; cfg.num_layers];
    for name in &names {
        let Some(i) = eagle_check::naming::layer_of(name).filter(|&i| i < cfg.num_layers) else {
            continue;
        };
        if name.ends_with("_scale_inv") {
            continue;
        }
        let t = if let Some(stem) = name.strip_suffix("_scales")
            && names.contains(&format!("{stem}_blocks"))
        {
            continue;
        } else if let Some(stem) = name.strip_suffix("_blocks")
            && names.contains(&format!("{stem}_scales"))
        {
            let (b, s) = (
                vb.get_raw(name).unwrap(),
                vb.get_raw(&format!("{stem}_scales")).unwrap(),
            );
            eagle_check::kernels::mxfp4_dequant(&b, &s, dtype).unwrap()
        } else {
            vb.get(name, &src.shape(name).unwrap()).unwrap()
        };
        layers[i] += (t.elem_count() * dtype.size_in_bytes()) as u64;
    }
    layers
}

/// The estimate the budget is planned with (which layer fits, whether two do, what is left for
/// reads ahead) is what each loaded layer holds in the compute dtype: MXFP4 blocks expand to
/// two values a byte, FP8 and MXFP4 scales are not kept, GGUF blocks count as their elements.
#[test]
fn the_weight_estimate_counts_each_layer_as_loaded_not_as_stored() {
    for (label, cfg, open) in sources() {
        let src = open();
        for dtype in [DType::F32, DType::BF16] {
            let estimate = WeightEstimate::of(&cfg, src.as_ref(), dtype);
            let loaded = loaded_bytes(&cfg, src.as_ref(), dtype);
            assert_eq!(estimate.layers, loaded, "{label} in {dtype:?}: per layer");
        }
    }
}
