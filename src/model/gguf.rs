//! GGUF targets (llama.cpp files of the `llama`, `qwen2`, `qwen3`, `qwen3moe`, `gpt-oss`,
//! `gemma3`, `llama4` and `phi3` architectures),
//! dequantised to f32 on load, served under HF tensor names, with a [`ModelConfig`] resolved from
//! the metadata. A `qwen3moe` file keeps each layer's experts stacked (`ffn_gate_exps` [E, I, H],
//! `ffn_up_exps`, `ffn_down_exps` [E, H, I]) with the router as `ffn_gate_inp`; they are served
//! as `mlp.experts.{gate,up,down}_proj` and `mlp.gate.weight`. A `gpt-oss` file holds the same
//! stacked experts with biases (`ffn_*_exps.bias`), its router as `ffn_gate_inp` (weight and
//! bias, served as `mlp.router.*`), its sinks as `attn_sinks`, and the experts' weights as MXFP4
//! (ggml type 39, which candle's reader does not know: [`crate::weights::gguf`] parses the
//! header, [`GgufSource`] decodes the blocks). A `llama4` file stacks its experts the same way
//! (`Llama4Model.modify_tensors` splits `gate_up_proj` and transposes both into output-by-input
//! rows), served under `feed_forward.experts.*` beside `feed_forward.router` and the shared
//! expert (`ffn_*_shexp`). A `phi3` file keeps the fused `attn_qkv` (q | k | v) and `ffn_up`
//! (gate | up) rows as `qkv_proj` / `gate_up_proj`, which the model splits as transformers does.
//!
//! Four things differ from an HF checkpoint, and each is undone here, once, at the edge:
//! - **Names.** `token_embd` -> `model.embed_tokens`, `blk.{i}.attn_q` -> `model.layers.{i}.self_attn.q_proj`,
//!   ... (the table is [`hf_name`]), following llama.cpp's `gguf-py/gguf/tensor_mapping.py`.
//! - **Shapes.** GGUF lists dimensions innermost first (`ne[0]` is the row length); candle's
//!   reader already reverses them, so a `[out, in]` linear reads as `[out, in]`, as in HF.
//! - **Q/K rows, llama architecture only.** `convert_hf_to_gguf.py` (`LlamaModel.permute`) reorders
//!   the rows of `q_proj` / `k_proj` (weights and biases) within each head from HF's
//!   "rotate half" layout `[x_0..x_{d/2}, y_0..y_{d/2}]` to llama.cpp's interleaved pairs
//!   `[x_0, y_0, x_1, y_1, ...]`. We invert it (transformers' `reverse_permute_weights` in
//!   `integrations/ggml.py` does the same), so the shared rotate-half rope applies unchanged.
//!   qwen2 / qwen3 / gemma3 / phi3 files are written unpermuted (their converters skip
//!   `LlamaModel.permute`), and so are llama4's (`Llama4Model.undo_permute = False`: Llama-4
//!   already rotates interleaved pairs).
//! - **Gemma's norms.** `Gemma3Model.modify_tensors` stores every `*norm.weight` with 1 added
//!   (`Gemma3RMSNorm` computes `x * (1 + w)`, llama.cpp's norm `x * w`); we take it off
//!   ([`Undo::NormPlusOne`]) and [`crate::model::gemma`] adds it back, as for a checkpoint.
//!
//! What a family's GGUF does not store, because llama.cpp fixes it, is filled in as llama.cpp
//! fixes it (Gemma-3's layer pattern and attention scale, Llama-4's NoPE layers, chunks and
//! temperature: [`gemma3_config`], [`llama4_config`]); a key that would make llama.cpp and the
//! checkpoint disagree is refused, naming the file and the key.
//!
//! The file is untrusted: every size comes from checked arithmetic, every tensor's bytes must lie
//! inside the file, unknown tensors are refused rather than silently ignored, and the metadata
//! goes through the same [`ModelConfig::resolve`] as a `config.json`.

use crate::config::{ConfigFile, ModelConfig, Rope, RopeScaling};
use crate::error::{CandleContext, Error, Result};
use crate::model::nn::inv_freq;
use crate::model::source::WeightSource;
use crate::weights::gguf::{
    Header, MXFP4_BLOCK, MXFP4_BLOCK_BYTES, Mxfp4Info, parse_header, read_header, unsigned,
    validate_tensor_extents,
};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// `general.architecture` values this loader maps to HF names, with the HF `model_type` each becomes.
const ARCHS: &[(&str, &str)] = &[
    ("llama", "llama"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("qwen3moe", "qwen3_moe"),
    ("gpt-oss", "gpt_oss"),
    ("gemma3", "gemma3_text"),
    ("llama4", "llama4_text"),
    ("phi3", "phi3"),
];

/// Tensors that hold rope scaling, read into the config: Llama 3's divisors
/// (`LlamaModel.generate_extra_tensors`, also Llama-4's), Phi-3's LongRoPE factors
/// (`Phi3MiniModel.generate_extra_tensors`).
const ROPE_TENSORS: &[(&str, &str)] = &[
    ("llama", "rope_freqs.weight"),
    ("llama4", "rope_freqs.weight"),
    ("phi3", "rope_factors_long.weight"),
    ("phi3", "rope_factors_short.weight"),
];

/// One GGUF tensor as served under its HF name.
#[derive(Debug, Clone)]
struct Entry {
    gguf_name: String,
    /// HF order (`[out, in]` for a linear).
    shape: Vec<usize>,
    /// What the converter did to the tensor, undone on load.
    undo: Undo,
}

/// A converter's change to one tensor, undone on load.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Undo {
    Nothing,
    /// llama.cpp's Q/K row interleave (`LlamaModel.permute`), over this many heads.
    QkRows(usize),
    /// Gemma's `1 + w` norms are stored as `1 + w` (`Gemma3Model.modify_tensors`); the model
    /// adds the 1 itself ([`crate::model::gemma`]), so 1 is taken off.
    NormPlusOne,
}

/// A GGUF file opened for weight loading: the header parsed and validated. Tensors are read
/// with positioned reads one at a time (never through a mapping that would keep every page
/// touched in the resident set), so a target streamed layer by layer holds one layer's blocks.
pub struct GgufSource {
    path: PathBuf,
    file: File,
    len: u64,
    bytes_read: AtomicU64,
    content: Content,
    /// The MXFP4 tensors (gpt-oss's experts), by GGUF name.
    mxfp4: HashMap<String, Mxfp4Info>,
    arch: String,
    /// HF name -> GGUF tensor.
    tensors: BTreeMap<String, Entry>,
}

/// Opens a GGUF target: validates the header, resolves the config from the metadata, and maps
/// every tensor to its HF name.
pub fn open_gguf(path: &Path) -> Result<(ModelConfig, GgufSource)> {
    let (mmap, header) = read_header(path)?;
    let (cfg, arch, tensors) = resolve(path, &header, &mmap)?;
    let len = mmap.len() as u64;
    drop(mmap);
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    Ok((
        cfg,
        GgufSource {
            path: path.to_path_buf(),
            file,
            len,
            bytes_read: AtomicU64::new(0),
            content: header.content,
            mxfp4: header.mxfp4,
            arch,
            tensors,
        },
    ))
}

/// Everything [`open_gguf`] checks, on a file held in memory: the header, every tensor's extent,
/// the config the metadata stands for and the HF name of every tensor. The fuzz target and the
/// corpus replay test call this.
pub fn check_gguf_bytes(path: &Path, bytes: &[u8]) -> Result<ModelConfig> {
    let header = parse_header(path, bytes)?;
    Ok(resolve(path, &header, bytes)?.0)
}

type Resolved = (ModelConfig, String, BTreeMap<String, Entry>);

fn resolve(path: &Path, header: &Header, data: &[u8]) -> Result<Resolved> {
    let content = &header.content;
    let arch = match content.metadata.get("general.architecture") {
        Some(Value::String(a)) => a.clone(),
        Some(_) => return Err(meta_err(path, "general.architecture", "is not a string")),
        None => return Err(meta_err(path, "general.architecture", "is missing")),
    };
    let Some(&(_, model_type)) = ARCHS.iter().find(|(a, _)| *a == arch) else {
        let known: Vec<&str> = ARCHS.iter().map(|(a, _)| *a).collect();
        return Err(Error::config(
            path,
            format!(
                "GGUF architecture `{arch}` is not supported (supported: {})",
                known.join(", ")
            ),
        ));
    };
    validate_tensor_extents(path, header, data.len())?;
    let meta = Meta {
        path,
        arch: &arch,
        md: &content.metadata,
    };
    let raw = config_file(&meta, model_type, content, data)?;
    let cfg = ModelConfig::resolve(&raw, path)?;
    if let Some(rot) = meta.usize_opt("rope.dimension_count")?
        && cfg.rotary_dim != rot
    {
        return Err(meta_err(
            path,
            &meta.key("rope.dimension_count"),
            &format!(
                "is {rot}, which does not rotate a whole even part of {}-dim heads",
                cfg.head_dim
            ),
        ));
    }
    let mut tensors = BTreeMap::new();
    let shapes = content
        .tensor_infos
        .iter()
        .map(|(name, info)| (name, info.shape.dims()))
        .chain(
            header
                .mxfp4
                .iter()
                .map(|(name, info)| (name, info.shape.as_slice())),
        );
    for (gguf_name, shape) in shapes {
        if ROPE_TENSORS.contains(&(arch.as_str(), gguf_name.as_str())) {
            // Folded into the config's rope scaling above.
            continue;
        }
        let Some(hf) = hf_name(gguf_name, &arch, cfg.num_layers, cfg.moe.is_some()) else {
            return Err(Error::weights(
                path,
                format!(
                    "GGUF tensor `{gguf_name}` has no HF counterpart in a {arch} model \
                     (vision and other extra tensors are not supported)"
                ),
            ));
        };
        let undo = match (arch.as_str(), hf.rsplit('.').nth(1)) {
            ("llama", Some("q_proj")) => Undo::QkRows(cfg.num_heads),
            ("llama", Some("k_proj")) => Undo::QkRows(cfg.num_kv_heads),
            ("gemma3", _) if hf.ends_with("norm.weight") => Undo::NormPlusOne,
            _ => Undo::Nothing,
        };
        tensors.insert(
            hf,
            Entry {
                gguf_name: gguf_name.clone(),
                shape: shape.to_vec(),
                undo,
            },
        );
    }
    Ok((cfg, arch, tensors))
}

impl GgufSource {
    /// `general.architecture` (`llama`, `qwen2`, `gemma3`, ...).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The raw metadata (the tokenizer reads `tokenizer.ggml.*` from it).
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// The HF names this file serves, sorted.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// The GGUF name behind an HF name.
    pub fn gguf_name(&self, hf_name: &str) -> Option<&str> {
        self.tensors.get(hf_name).map(|e| e.gguf_name.as_str())
    }
}

impl WeightSource for GgufSource {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|e| e.shape.clone())
    }

    /// Dequantises to f32 (on the CPU, then moves to `device`), rows un-permuted where needed.
    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        let entry = self.entry(name)?;
        let what = || self.what(entry, name);
        let mut reader = At {
            file: &self.file,
            pos: 0,
            len: self.len,
            read: &self.bytes_read,
        };
        let t = match self.mxfp4.get(&entry.gguf_name) {
            Some(info) => self.mxfp4_tensor(info).ctx(what)?,
            None => self
                .content
                .tensor(&mut reader, &entry.gguf_name, &Device::Cpu)
                .and_then(|q| q.dequantize(&Device::Cpu))
                .ctx(what)?,
        };
        let t = match entry.undo {
            Undo::QkRows(heads) => unpermute_rows(&self.path, name, &t, heads)?,
            // Exact in f32: the stored 1 + w lies in [0.5, 2] for any |w| <= 0.5 (Sterbenz), and
            // the model's own `w + 1` then gives back the stored value bit for bit (for an f32
            // checkpoint, the f32 `1 + w` that transformers' `Gemma3RMSNorm` multiplies by).
            Undo::NormPlusOne => (t - 1.0).ctx(what)?,
            Undo::Nothing => t,
        };
        t.to_device(device).ctx(what)
    }

    /// Only the rows asked for are read and dequantised: ggml blocks run along rows and never
    /// span two, so a row's blocks decode alone, to the same values as in the whole tensor.
    fn load_rows(&self, name: &str, ids: &[u32], device: &Device) -> Result<Tensor> {
        let rows: Vec<usize> = ids.iter().map(|&r| r as usize).collect();
        self.rows(name, &rows, device)
    }

    fn load_row_range(
        &self,
        name: &str,
        start: usize,
        len: usize,
        device: &Device,
    ) -> Result<Tensor> {
        let rows: Vec<usize> = (start..start + len).collect();
        self.rows(name, &rows, device)
    }

    fn origin(&self) -> &Path {
        &self.path
    }

    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }
}

impl GgufSource {
    fn entry(&self, name: &str) -> Result<&Entry> {
        self.tensors.get(name).ok_or_else(|| Error::MissingTensor {
            path: self.path.clone(),
            name: name.to_string(),
        })
    }

    fn what(&self, entry: &Entry, name: &str) -> String {
        format!(
            "{}: GGUF tensor {} ({name})",
            self.path.display(),
            entry.gguf_name
        )
    }

    /// `rows` of a 2-D tensor whose rows are not permuted, read and dequantised alone.
    fn rows(&self, name: &str, rows: &[usize], device: &Device) -> Result<Tensor> {
        let entry = self.entry(name)?;
        let what = || self.what(entry, name);
        let info = self.content.tensor_infos.get(&entry.gguf_name);
        let dims = info.map_or(&[][..], |i| i.shape.dims());
        let (n_rows, cols, info) = match (dims, info) {
            ([r, c], Some(info)) if entry.undo == Undo::Nothing => (*r, *c, info),
            _ => {
                let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                let ids = Tensor::new(ids.as_slice(), device).ctx(what)?;
                return self.load(name, device)?.index_select(&ids, 0).ctx(what);
            }
        };
        if let Some(&bad) = rows.iter().find(|&&r| r >= n_rows) {
            return Err(Error::weights(
                &self.path,
                format!("{}: row {bad} asked for, it has {n_rows}", entry.gguf_name),
            ));
        }
        // Whole blocks per row: validate_tensor_extents checked that rows divide into blocks.
        let row_bytes = cols / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        let base = self.content.tensor_data_offset + info.offset;
        let mut bytes = vec![0u8; rows.len() * row_bytes];
        for (chunk, &r) in bytes.chunks_mut(row_bytes.max(1)).zip(rows) {
            self.file
                .read_exact_at(chunk, base + (r * row_bytes) as u64)
                .map_err(|e| Error::io(&self.path, e))?;
        }
        self.bytes_read
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        qtensor_from_ggml(
            info.ggml_dtype,
            &bytes,
            vec![rows.len(), cols],
            &Device::Cpu,
        )
        .and_then(|q| q.dequantize(&Device::Cpu))
        .and_then(|t| t.to_device(device))
        .ctx(what)
    }
}

impl GgufSource {
    /// An MXFP4 tensor (ggml type 39) read whole and dequantised to f32 on the CPU.
    ///
    /// ggml's block (`block_mxfp4` in ggml-common.h; gguf-py 0.19 quants.py `MXFP4`) is one E8M0
    /// exponent byte, then 16 bytes whose low nibbles are values 0..16 of the block and whose
    /// high nibbles are values 16..32. transformers' layout (the `*_blocks` / `*_scales` of a
    /// gpt-oss checkpoint, [`crate::kernels::mxfp4`]) holds values 2b and 2b + 1 in byte b, with
    /// the exponents apart. Both decode a nibble as the same e2m1 value times 2^(e - 127)
    /// (gguf-py's doubled `kvalues` times `e8m0_to_fp32_half` is that product), so the blocks
    /// are regrouped into transformers' layout and decoded by the one dequantiser the safetensors
    /// checkpoints use.
    fn mxfp4_tensor(&self, info: &Mxfp4Info) -> candle_core::Result<Tensor> {
        let elems: usize = info.shape.iter().product();
        let blocks = elems / MXFP4_BLOCK;
        let mut raw = vec![0u8; blocks * MXFP4_BLOCK_BYTES];
        self.file
            .read_exact_at(&mut raw, self.content.tensor_data_offset + info.offset)?;
        self.bytes_read
            .fetch_add(raw.len() as u64, Ordering::Relaxed);
        let (packed, scales) = mxfp4_ggml_to_hf(&raw);
        let mut group_dims = info.shape.clone();
        *group_dims.last_mut().unwrap_or(&mut 0) /= MXFP4_BLOCK;
        let scales = Tensor::from_vec(scales, group_dims.as_slice(), &Device::Cpu)?;
        group_dims.push(16);
        let packed = Tensor::from_vec(packed, group_dims.as_slice(), &Device::Cpu)?;
        crate::kernels::mxfp4_dequant(&packed, &scales, DType::F32)?.reshape(info.shape.as_slice())
    }
}

/// ggml MXFP4 blocks (17 bytes each: the exponent, then values j and j + 16 in byte j's low and
/// high nibble) as transformers' `*_blocks` (16 bytes a block, values 2b and 2b + 1 in byte b's
/// low and high nibble) and `*_scales` (one exponent a block).
fn mxfp4_ggml_to_hf(raw: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let n = raw.len() / MXFP4_BLOCK_BYTES;
    let (mut packed, mut scales) = (Vec::with_capacity(n * 16), Vec::with_capacity(n));
    for block in raw.chunks_exact(MXFP4_BLOCK_BYTES) {
        scales.push(block[0]);
        let qs = &block[1..];
        let value = |j: usize| {
            if j < 16 {
                qs[j] & 0x0f
            } else {
                qs[j - 16] >> 4
            }
        };
        packed.extend((0..16).map(|b| value(2 * b) | (value(2 * b + 1) << 4)));
    }
    (packed, scales)
}

/// `Read + Seek` over a shared file by positioned reads, for candle's GGUF tensor reader (a
/// shared `File`'s own cursor would race between the layer loader and the calling thread).
struct At<'a> {
    file: &'a File,
    pos: u64,
    len: u64,
    read: &'a AtomicU64,
}

impl Read for At<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

impl Seek for At<'_> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = pos.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}

/// A tensor of a GGUF file held in memory (the header's `rope_freqs.weight`, read while the
/// config is resolved, also on the fuzzers' bytes).
fn dequantize(content: &Content, data: &[u8], gguf_name: &str) -> candle_core::Result<Tensor> {
    let q = content.tensor(&mut Cursor::new(data), gguf_name, &Device::Cpu)?;
    q.dequantize(&Device::Cpu)
}

/// Inverts `LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py:
/// `w.reshape(n_head, 2, rows / n_head / 2, *rest).swapaxes(1, 2).reshape(w.shape)`.
/// `t`: [rows, cols] or [rows] (a bias), rows = heads * head_dim.
fn unpermute_rows(path: &Path, name: &str, t: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if heads == 0 || rows % (2 * heads) != 0 {
        return Err(Error::weights(
            path,
            format!("{name}: {rows} rows do not split into {heads} heads of even size"),
        ));
    }
    let half = rows / heads / 2;
    let rest: usize = dims[1..].iter().product();
    let undo = || -> candle_core::Result<Tensor> {
        t.reshape((heads, half, 2, rest))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape(dims.as_slice())
    };
    undo().ctx(|| format!("{}: un-permuting {name}", path.display()))
}

/// HF name for a GGUF tensor name of an `arch` file; `None` for names outside the decoder.
fn hf_name(gguf: &str, arch: &str, num_layers: usize, moe: bool) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    // A canonical decimal index (no sign, no leading zeros) below the block count.
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if layer.len() > 1 && layer.starts_with('0') {
        return None;
    }
    let i: usize = layer.parse().ok()?;
    if i >= num_layers {
        return None;
    }
    let hf = match rest {
        // Gemma-3's sandwich norms (tensor_mapping.py: `pre_feedforward_layernorm` is FFN_NORM,
        // `post_attention_layernorm` ATTN_POST_NORM, `post_feedforward_layernorm` FFN_POST_NORM).
        "post_attention_norm.weight" if arch == "gemma3" => "post_attention_layernorm.weight",
        "ffn_norm.weight" if arch == "gemma3" => "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight" if arch == "gemma3" => "post_feedforward_layernorm.weight",
        // Phi-3 keeps its fused projections (rows q | k | v, and gate | up); llama.cpp splits them
        // as `Phi3Attention` and `Phi3MLP` do. Its converter never writes attn_q / attn_k / attn_v.
        "attn_qkv.weight" if arch == "phi3" => "self_attn.qkv_proj.weight",
        "ffn_up.weight" if arch == "phi3" => "mlp.gate_up_proj.weight",
        "attn_q.weight" | "attn_k.weight" | "attn_v.weight" if arch == "phi3" => return None,
        // Llama-4's feed-forward (`feed_forward.*`): dense, or the router, the stacked experts
        // (split and transposed by `Llama4Model.modify_tensors`) and the shared expert.
        "ffn_gate.weight" if arch == "llama4" => "feed_forward.gate_proj.weight",
        "ffn_up.weight" if arch == "llama4" => "feed_forward.up_proj.weight",
        "ffn_down.weight" if arch == "llama4" => "feed_forward.down_proj.weight",
        "ffn_gate_inp.weight" if arch == "llama4" => "feed_forward.router.weight",
        "ffn_gate_exps.weight" if arch == "llama4" => "feed_forward.experts.gate_proj",
        "ffn_up_exps.weight" if arch == "llama4" => "feed_forward.experts.up_proj",
        "ffn_down_exps.weight" if arch == "llama4" => "feed_forward.experts.down_proj",
        "ffn_gate_shexp.weight" if arch == "llama4" => {
            "feed_forward.shared_expert.gate_proj.weight"
        }
        "ffn_up_shexp.weight" if arch == "llama4" => "feed_forward.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight" if arch == "llama4" => {
            "feed_forward.shared_expert.down_proj.weight"
        }
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q_norm.weight" => "self_attn.q_norm.weight",
        "attn_k_norm.weight" => "self_attn.k_norm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        // gpt-oss (gguf-py tensor_mapping.py: `post_attention_layernorm` is ATTN_POST_NORM for an
        // architecture without FFN_NORM; `self_attn.sinks` is ATTN_SINKS, "openai-moe").
        "attn_output.bias" if arch == "gpt-oss" => "self_attn.o_proj.bias",
        "post_attention_norm.weight" if arch == "gpt-oss" => "post_attention_layernorm.weight",
        "attn_sinks.weight" if arch == "gpt-oss" => "self_attn.sinks",
        "ffn_gate_inp.weight" if arch == "gpt-oss" => "mlp.router.weight",
        "ffn_gate_inp.bias" if arch == "gpt-oss" => "mlp.router.bias",
        "ffn_gate_exps.bias" if arch == "gpt-oss" => "mlp.experts.gate_proj_bias",
        "ffn_up_exps.bias" if arch == "gpt-oss" => "mlp.experts.up_proj_bias",
        "ffn_down_exps.bias" if arch == "gpt-oss" => "mlp.experts.down_proj_bias",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        // MoE layers (qwen3moe): the router and the stacked experts.
        "ffn_gate_inp.weight" if moe => "mlp.gate.weight",
        "ffn_gate_exps.weight" if moe => "mlp.experts.gate_proj",
        "ffn_up_exps.weight" if moe => "mlp.experts.up_proj",
        "ffn_down_exps.weight" if moe => "mlp.experts.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{i}.{hf}"))
}

/// Typed access to `{arch}.*` metadata, with errors that name the file and the key.
struct Meta<'a> {
    path: &'a Path,
    arch: &'a str,
    md: &'a HashMap<String, Value>,
}

fn meta_err(path: &Path, key: &str, what: &str) -> Error {
    Error::config(path, format!("GGUF metadata `{key}` {what}"))
}

fn value_f64(v: &Value) -> Option<f64> {
    match *v {
        Value::F32(x) => Some(x.into()),
        Value::F64(x) => Some(x),
        _ => unsigned(v).map(|x| x as f64),
    }
}

impl Meta<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn usize_opt(&self, suffix: &str) -> Result<Option<usize>> {
        let key = self.key(suffix);
        match self.md.get(&key) {
            None => Ok(None),
            Some(v) => unsigned(v)
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    meta_err(
                        self.path,
                        &key,
                        &format!("is not a non-negative integer: {v:?}"),
                    )
                }),
        }
    }

    fn usize(&self, suffix: &str) -> Result<usize> {
        self.usize_opt(suffix)?
            .ok_or_else(|| meta_err(self.path, &self.key(suffix), "is missing"))
    }

    fn f64_opt(&self, suffix: &str) -> Result<Option<f64>> {
        let key = self.key(suffix);
        match self.md.get(&key) {
            None => Ok(None),
            Some(v) => match value_f64(v) {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(meta_err(
                    self.path,
                    &key,
                    &format!("is not a finite number: {v:?}"),
                )),
            },
        }
    }

    fn str_opt(&self, suffix: &str) -> Result<Option<&str>> {
        let key = self.key(suffix);
        match self.md.get(&key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(meta_err(
                self.path,
                &key,
                &format!("is not a string: {v:?}"),
            )),
        }
    }
}

/// The `config.json` the GGUF metadata stands for.
fn config_file(
    meta: &Meta,
    model_type: &str,
    content: &Content,
    data: &[u8],
) -> Result<ConfigFile> {
    let path = meta.path;
    let experts = meta.usize_opt("expert_count")?.unwrap_or(0);
    let gpt_oss = model_type == "gpt_oss";
    let moe = model_type == "qwen3_moe";
    if experts > 0 && !moe && !gpt_oss && model_type != "llama4_text" {
        return Err(Error::config(
            path,
            format!(
                "GGUF metadata `{}` > 0: MoE GGUF targets of `{}` are not supported (qwen3moe, gpt-oss and llama4 are)",
                meta.key("expert_count"),
                meta.arch
            ),
        ));
    }
    let hidden = meta.usize("embedding_length")?;
    let blocks = meta.usize("block_count")?;
    let heads = meta.usize("attention.head_count")?;
    let kv_heads = meta.usize_opt("attention.head_count_kv")?;
    let key_len = meta.usize_opt("attention.key_length")?;
    let value_len = meta.usize_opt("attention.value_length")?;
    if let (Some(k), Some(v)) = (key_len, value_len)
        && k != v
    {
        return Err(Error::config(
            path,
            format!(
                "GGUF attention.key_length {k} differs from attention.value_length {v}; not supported"
            ),
        ));
    }
    let head_dim = key_len.or(value_len);
    let effective_head_dim = head_dim.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
    // Phi-3 rotates part of each head ([`phi3_config`] reads it).
    if let Some(rot) = meta.usize_opt("rope.dimension_count")?
        && rot != effective_head_dim
        && model_type != "phi3"
    {
        return Err(Error::config(
            path,
            format!(
                "GGUF {} {rot} differs from the head dimension {effective_head_dim}: \
                 partial rotary embeddings are not supported",
                meta.key("rope.dimension_count")
            ),
        ));
    }

    // The embedding table fixes the vocabulary; the tokenizer may list fewer tokens (padding
    // rows), never more.
    let embd = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| Error::weights(path, "GGUF tensor `token_embd.weight` is missing"))?;
    let vocab = match embd.shape.dims() {
        [v, h] if *h == hidden => *v,
        dims => {
            return Err(Error::weights(
                path,
                format!(
                    "GGUF tensor `token_embd.weight` has shape {dims:?}, expected [vocab, {hidden}] \
                     ({} = {hidden})",
                    meta.key("embedding_length")
                ),
            ));
        }
    };
    if let Some(v) = meta.usize_opt("vocab_size")?
        && v != vocab
    {
        return Err(Error::config(
            path,
            format!(
                "GGUF {} {v} differs from token_embd.weight's {vocab} rows",
                meta.key("vocab_size")
            ),
        ));
    }
    if let Some(Value::Array(tokens)) = meta.md.get("tokenizer.ggml.tokens")
        && tokens.len() > vocab
    {
        return Err(Error::config(
            path,
            format!(
                "GGUF tokenizer.ggml.tokens lists {} tokens but token_embd.weight has only {vocab} rows",
                tokens.len()
            ),
        ));
    }

    let theta = meta.f64_opt("rope.freq_base")?;
    // Phi-3's LongRoPE is factor tensors and no scaling key ([`phi3_config`]).
    let mut rope_scaling = match model_type {
        "phi3" => None,
        _ => rope_scaling_from_meta(meta)?,
    };
    if content.tensor_infos.contains_key("rope_freqs.weight")
        && ROPE_TENSORS.contains(&(meta.arch, "rope_freqs.weight"))
    {
        if rope_scaling.is_some() {
            return Err(Error::config(
                path,
                "GGUF has both rope scaling metadata and a rope_freqs.weight tensor; not supported",
            ));
        }
        let factors = dequantize(content, data, "rope_freqs.weight")
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .ctx(|| format!("{}: GGUF tensor rope_freqs.weight", path.display()))?;
        rope_scaling = llama3_from_rope_freqs(
            path,
            &factors,
            theta.unwrap_or(10000.0),
            effective_head_dim,
            meta.usize_opt("rope.scaling.original_context_length")?,
        )?;
    }

    if gpt_oss && let Some(p) = rope_scaling.as_mut() {
        // GGUF has no key for it; gpt-oss's YaRN does not round its correction range
        // (`GptOssConfig` writes `truncate: False`, transformers 5.24 configuration_gpt_oss.py).
        // llama.cpp's own rope rounds it (ggml.c `ggml_rope_yarn_corr_dims`: floorf/ceilf);
        // we follow the model's definition, as for its safetensors checkpoints.
        p["truncate"] = serde_json::json!(false);
    }
    let base = ConfigFile {
        model_type: Some(model_type.to_string()),
        hidden_size: Some(hidden),
        num_hidden_layers: Some(blocks),
        num_attention_heads: Some(heads),
        // llama.cpp's defaults: as many KV heads as heads, head_dim = n_embd / n_head (Gemma's
        // config.json defaults, 4 and 256, do not apply to a GGUF).
        num_key_value_heads: Some(kv_heads.unwrap_or(heads)),
        head_dim: Some(effective_head_dim),
        // A qwen3moe file may leave it out (no dense block).
        intermediate_size: if moe {
            meta.usize_opt("feed_forward_length")?
        } else {
            Some(meta.usize("feed_forward_length")?)
        },
        vocab_size: Some(vocab),
        rms_norm_eps: Some(
            meta.f64_opt("attention.layer_norm_rms_epsilon")?
                .ok_or_else(|| {
                    meta_err(
                        path,
                        &meta.key("attention.layer_norm_rms_epsilon"),
                        "is missing",
                    )
                })?,
        ),
        rope_theta: theta,
        rope_scaling,
        // llama.cpp ties by leaving `output.weight` out (convert_hf_to_gguf.py skips a tied lm_head).
        tie_word_embeddings: Some(!content.tensor_infos.contains_key("output.weight")),
        attention_bias: Some(content.tensor_infos.contains_key("blk.0.attn_q.bias")),
        max_position_embeddings: meta.usize_opt("context_length")?,
        // qwen3moe: llama.cpp's `build_moe_ffn` renormalises the picked weights (norm_w true in
        // src/models/qwen3moe.cpp; transformers' GGUF loader sets `norm_topk_prob` true for the
        // same reason, integrations/ggml.py `GGUF_CONFIG_DEFAULTS_MAPPING`).
        num_experts: moe.then_some(experts),
        num_experts_per_tok: if moe {
            Some(meta.usize("expert_used_count")?)
        } else {
            None
        },
        moe_intermediate_size: if moe {
            Some(meta.usize("expert_feed_forward_length")?)
        } else {
            None
        },
        norm_topk_prob: moe.then_some(true),
        // A block without a router holds a dense MLP (`ffn_gate`, `ffn_up`, `ffn_down`).
        mlp_only_layers: moe.then(|| {
            (0..blocks)
                .filter(|i| {
                    !content
                        .tensor_infos
                        .contains_key(&format!("blk.{i}.ffn_gate_inp.weight"))
                })
                .collect()
        }),
        ..ConfigFile::default()
    };
    match model_type {
        "gpt_oss" => gpt_oss_config(meta, base),
        "gemma3_text" => gemma3_config(meta, base),
        "llama4_text" => llama4_config(meta, content, base),
        "phi3" => phi3_config(meta, content, data, base),
        _ => Ok(base),
    }
}

/// gpt-oss (convert_hf_to_gguf.py `GptOssModel.set_gguf_parameters`): every block holds
/// experts of `feed_forward_length` (= `expert_feed_forward_length`), the window is
/// `attention.sliding_window` and llama.cpp alternates it from block 0
/// (llama-model.cpp `LLM_ARCH_OPENAI_MOE`: `set_swa_pattern(2)`), which is `GptOssConfig`'s
/// default `layer_types`; q/k/v/o are biased. The clamped SwiGLU's alpha 1.702 and limit 7.0
/// are not stored (llama.cpp hard-codes both), so the config's defaults apply.
fn gpt_oss_config(meta: &Meta, base: ConfigFile) -> Result<ConfigFile> {
    Ok(ConfigFile {
        intermediate_size: Some(
            meta.usize_opt("expert_feed_forward_length")?
                .map_or_else(|| meta.usize("feed_forward_length"), Ok)?,
        ),
        num_local_experts: Some(meta.usize("expert_count")?),
        num_experts_per_tok: Some(meta.usize("expert_used_count")?),
        sliding_window: Some(meta.usize("attention.sliding_window")?),
        attention_bias: Some(true),
        ..base
    })
}

/// Gemma-3 (`Gemma3Model.set_gguf_parameters` after `TextModel`'s; llama-model.cpp
/// `LLM_ARCH_GEMMA3`). Stored: the full layers' rope (`rope.freq_base`, linear
/// `rope.scaling.*`), the sliding layers' base (`rope.freq_base_swa`, newer converters),
/// `attention.sliding_window`, `final_logit_softcapping`. Fixed by llama.cpp, never stored: with
/// a window, every 6th layer is full and the others slide (`set_swa_pattern(6)`), without one
/// every layer is full; the sliding layers' rope is base 1e4 unscaled; the softmax scale is
/// 1/sqrt(head_dim), 1/sqrt(n_embd / n_head) for the 62-layer 27B (`f_attention_scale`, from
/// gemma_pytorch's config), which is `query_pre_attn_scalar`; the activation is tanh GELU.
fn gemma3_config(meta: &Meta, base: ConfigFile) -> Result<ConfigFile> {
    let (layers, hidden, heads) = (
        base.num_hidden_layers.unwrap_or(0),
        base.hidden_size.unwrap_or(0),
        base.num_attention_heads.unwrap_or(1).max(1),
    );
    if let Some(cap) = meta.f64_opt("attn_logit_softcapping")?
        && cap != 0.0
    {
        return Err(meta_err(
            meta.path,
            &meta.key("attn_logit_softcapping"),
            &format!("is {cap}: attention softcapping is not supported (Gemma-3 has none)"),
        ));
    }
    let window = meta
        .usize_opt("attention.sliding_window")?
        .filter(|&w| w > 0);
    let sliding: Vec<bool> = (0..layers)
        .map(|i| window.is_some() && (i + 1) % 6 != 0)
        .collect();
    check_swa_pattern(meta, &sliding)?;
    let layer_types = sliding
        .iter()
        .map(|&s| {
            if s {
                "sliding_attention"
            } else {
                "full_attention"
            }
            .to_string()
        })
        .collect();
    let mut full = base
        .rope_scaling
        .clone()
        .unwrap_or_else(|| serde_json::json!({"rope_type": "default"}));
    // llama.cpp's default base when the key is missing (`rope_freq_base_train`).
    full["rope_theta"] = serde_json::json!(base.rope_theta.unwrap_or(10000.0));
    let local_theta = meta.f64_opt("rope.freq_base_swa")?.unwrap_or(10000.0);
    let head_dim = base.head_dim.unwrap_or(0);
    Ok(ConfigFile {
        rope_theta: None,
        rope_scaling: None,
        rope_parameters: Some(serde_json::json!({
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        })),
        sliding_window: window,
        layer_types: Some(layer_types),
        query_pre_attn_scalar: Some(if layers == 62 {
            (hidden / heads) as f64
        } else {
            head_dim as f64
        }),
        // 0 is llama.cpp's "none".
        final_logit_softcapping: meta
            .f64_opt("final_logit_softcapping")?
            .filter(|&c| c != 0.0),
        hidden_activation: Some("gelu_pytorch_tanh".into()),
        ..base
    })
}

/// `attention.sliding_window_pattern` (gguf-py's `add_sliding_window_pattern`: a period, or one
/// bool per layer, true for a sliding one), which llama.cpp's gemma3 does not read: accepted
/// only where it says what llama.cpp does anyway.
fn check_swa_pattern(meta: &Meta, sliding: &[bool]) -> Result<()> {
    let key = meta.key("attention.sliding_window_pattern");
    let Some(v) = meta.md.get(&key) else {
        return Ok(());
    };
    let agrees = match v {
        Value::Array(items) => {
            items.len() == sliding.len()
                && items
                    .iter()
                    .zip(sliding)
                    .all(|(x, &s)| matches!(x, Value::Bool(b) if *b == s))
        }
        other => unsigned(other) == Some(6) && sliding.iter().any(|&s| s),
    };
    if agrees {
        return Ok(());
    }
    Err(meta_err(
        meta.path,
        &key,
        &format!(
            "is {v:?}, but llama.cpp's gemma3 ignores it and slides {} of the layers \
             (every 6th full): not supported",
            if sliding.iter().any(|&s| s) {
                "all but every 6th"
            } else {
                "none"
            }
        ),
    ))
}

/// Llama-4 (`Llama4Model.set_gguf_parameters` after `LlamaModel`'s; llama-model.cpp
/// `LLM_ARCH_LLAMA4`). Stored: the dense layers' width (`feed_forward_length`, the checkpoint's
/// `intermediate_size_mlp`), the experts' (`expert_feed_forward_length`), their count and top-k,
/// `interleave_moe_layer_step` (layer i is MoE when (i + 1) % step == 0, as
/// `Llama4TextConfig.moe_layers` defaults). Fixed by llama.cpp, never stored: unless
/// `attention.sliding_window` is 0, 3 of every 4 layers rotate and attend within chunks of 8192,
/// every 4th is a NoPE layer over everything with the attention temperature (floor 8192, scale
/// 0.1); with 0 (MobileLLM), every layer rotates over everything, no temperature. q/k are
/// L2-normalised unless there are 128 experts (Maverick: `use_kq_norm`). The router scores with
/// a sigmoid and weighs each expert's input, as `Llama4TextMoe` ([`crate::config::moe`]).
fn llama4_config(meta: &Meta, content: &Content, base: ConfigFile) -> Result<ConfigFile> {
    let layers = base.num_hidden_layers.unwrap_or(0);
    let experts = meta.usize("expert_count")?;
    if experts == 0 {
        return Err(meta_err(
            meta.path,
            &meta.key("expert_count"),
            "is 0: Llama-4 GGUF targets without experts are not supported",
        ));
    }
    let step_key = meta.key("interleave_moe_layer_step");
    let step = meta.usize("interleave_moe_layer_step")?;
    if step == 0 {
        return Err(meta_err(meta.path, &step_key, "is 0"));
    }
    // The MoE layers the step names must be the ones holding a router, and only those.
    for i in 0..layers {
        let routed = content
            .tensor_infos
            .contains_key(&format!("blk.{i}.ffn_gate_inp.weight"));
        if routed != ((i + 1) % step == 0) {
            return Err(meta_err(
                meta.path,
                &step_key,
                &format!(
                    "is {step}, which makes layer {i} {}, but blk.{i} {} ffn_gate_inp",
                    if routed { "dense" } else { "MoE" },
                    if routed { "holds" } else { "holds no" }
                ),
            ));
        }
    }
    let window_key = meta.key("attention.sliding_window");
    let chunked = match meta.usize_opt("attention.sliding_window")? {
        None | Some(LLAMA4_CHUNK) => true,
        Some(0) => false,
        Some(w) => {
            return Err(meta_err(
                meta.path,
                &window_key,
                &format!(
                    "is {w}: llama.cpp reads it only as 0 (no chunks) or not 0 (chunks of \
                     {LLAMA4_CHUNK}); not supported"
                ),
            ));
        }
    };
    Ok(ConfigFile {
        intermediate_size: Some(meta.usize("expert_feed_forward_length")?),
        intermediate_size_mlp: Some(meta.usize("feed_forward_length")?),
        num_local_experts: Some(experts),
        num_experts_per_tok: Some(meta.usize("expert_used_count")?),
        interleave_moe_layer_step: Some(step),
        moe_layers: None,
        // 1: the layer rotates (`Llama4TextConfig.no_rope_layers`); llama.cpp's
        // `n_no_rope_layer_step` is 4 (llama-hparams.h), the layer count without chunks.
        no_rope_layers: Some(
            (0..layers)
                .map(|i| u8::from(!chunked || (i + 1) % 4 != 0))
                .collect(),
        ),
        attention_chunk_size: Some(chunked.then_some(LLAMA4_CHUNK)),
        layer_types: None,
        attn_temperature_tuning: Some(chunked),
        floor_scale: Some(LLAMA4_CHUNK as f64),
        attn_scale: Some(0.1),
        use_qk_norm: Some(experts != 128),
        ..base
    })
}

/// llama.cpp's Llama-4 chunk (`n_swa`) and temperature floor (`n_attn_temp_floor_scale`).
const LLAMA4_CHUNK: usize = 8192;

/// Phi-3 (`Phi3MiniModel.set_gguf_parameters` and `generate_extra_tensors`; llama-model.cpp
/// `LLM_ARCH_PHI3`): `rope.dimension_count` of each head rotated (Phi-4-mini 0.75), `context_length`
/// the checkpoint's `max_position_embeddings`, `attention.sliding_window` (0: none), and LongRoPE
/// as the tensors `rope_factors_long` / `rope_factors_short` with
/// `rope.scaling.original_context_length` and `rope.scaling.attn_factor`. transformers picks the
/// long factors for a sequence longer than the original context (`longrope_frequency_update`),
/// llama.cpp for a context longer than it; we run the model as transformers does.
fn phi3_config(
    meta: &Meta,
    content: &Content,
    data: &[u8],
    base: ConfigFile,
) -> Result<ConfigFile> {
    let path = meta.path;
    let head_dim = base.head_dim.unwrap_or(0);
    let rot = meta.usize_opt("rope.dimension_count")?.unwrap_or(head_dim);
    if rot == 0 || rot > head_dim || !rot.is_multiple_of(2) {
        return Err(meta_err(
            path,
            &meta.key("rope.dimension_count"),
            &format!("is {rot}: rope must rotate an even part of the {head_dim}-dim heads"),
        ));
    }
    if let Some(kind) = meta.str_opt("rope.scaling.type")?
        && !matches!(kind, "none" | "longrope")
    {
        return Err(meta_err(
            path,
            &meta.key("rope.scaling.type"),
            &format!("is `{kind}`: Phi-3 GGUF targets take LongRoPE factor tensors or none"),
        ));
    }
    let theta = base.rope_theta.unwrap_or(10000.0);
    let factors = |name: &str| -> Result<Option<Vec<f64>>> {
        if !content.tensor_infos.contains_key(name) {
            return Ok(None);
        }
        let list = dequantize(content, data, name)
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .ctx(|| format!("{}: GGUF tensor {name}", path.display()))?;
        if list.len() != rot / 2 || list.iter().any(|f| !f.is_finite() || *f <= 0.0) {
            return Err(Error::weights(
                path,
                format!(
                    "GGUF tensor {name}: expected {} positive finite factors ({} {rot} / 2), found {}",
                    rot / 2,
                    meta.key("rope.dimension_count"),
                    list.len()
                ),
            ));
        }
        Ok(Some(list.into_iter().map(f64::from).collect()))
    };
    let (long, short) = (
        factors("rope_factors_long.weight")?,
        factors("rope_factors_short.weight")?,
    );
    let orig_key = meta.key("rope.scaling.original_context_length");
    let orig = meta.usize_opt("rope.scaling.original_context_length")?;
    let rope_parameters = match (long, short) {
        (None, None) => serde_json::json!({"rope_type": "default", "rope_theta": theta}),
        (Some(long), Some(short)) => {
            let orig =
                orig.ok_or_else(|| meta_err(path, &orig_key, "is missing (LongRoPE needs it)"))?;
            let mut p = serde_json::json!({
                "rope_type": "longrope",
                "rope_theta": theta,
                "long_factor": long,
                "short_factor": short,
                "original_max_position_embeddings": orig,
            });
            if let Some(f) = meta.f64_opt("rope.scaling.attn_factor")? {
                p["attention_factor"] = serde_json::json!(f);
            }
            p
        }
        (long, _) => {
            let missing = if long.is_none() { "long" } else { "short" };
            return Err(Error::weights(
                path,
                format!(
                    "GGUF tensor `rope_factors_{missing}.weight` is missing (LongRoPE needs both factor tensors)"
                ),
            ));
        }
    };
    Ok(ConfigFile {
        rope_theta: None,
        rope_scaling: None,
        rope_parameters: Some(rope_parameters),
        partial_rotary_factor: Some(rot as f64 / head_dim.max(1) as f64),
        original_max_position_embeddings: orig,
        sliding_window: meta
            .usize_opt("attention.sliding_window")?
            .filter(|&w| w > 0),
        ..base
    })
}

/// `{arch}.rope.scaling.*` (or the older `rope.scale_linear`) as an HF `rope_scaling` object.
fn rope_scaling_from_meta(meta: &Meta) -> Result<Option<serde_json::Value>> {
    let factor = meta.f64_opt("rope.scaling.factor")?;
    let kind = meta.str_opt("rope.scaling.type")?;
    let orig = meta.usize_opt("rope.scaling.original_context_length")?;
    let need_factor = || {
        factor.ok_or_else(|| meta_err(meta.path, &meta.key("rope.scaling.factor"), "is missing"))
    };
    Ok(match kind {
        None | Some("none") => match meta.f64_opt("rope.scale_linear")? {
            Some(f) if f != 1.0 => Some(serde_json::json!({"rope_type": "linear", "factor": f})),
            _ => None,
        },
        Some("linear") => {
            Some(serde_json::json!({"rope_type": "linear", "factor": need_factor()?}))
        }
        Some("yarn") => {
            let mut p = serde_json::json!({
                "rope_type": "yarn",
                "factor": need_factor()?,
                "original_max_position_embeddings": orig.ok_or_else(|| meta_err(
                    meta.path,
                    &meta.key("rope.scaling.original_context_length"),
                    "is missing (needed by yarn)",
                ))?,
            });
            for (gguf_key, hf_key) in [
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ] {
                if let Some(x) = meta.f64_opt(gguf_key)? {
                    p[hf_key] = serde_json::json!(x);
                }
            }
            Some(p)
        }
        Some(other) => {
            return Err(Error::config(
                meta.path,
                format!(
                    "GGUF {} `{other}` is not supported (none, linear, yarn)",
                    meta.key("rope.scaling.type")
                ),
            ));
        }
    })
}

/// Recovers Llama 3.x rope scaling from the `rope_freqs.weight` llama.cpp writes instead of
/// metadata (`LlamaModel.generate_extra_tensors`: one divisor per rotary frequency). The
/// parameters are not stored, so we take `factor` = the largest divisor and Llama 3's
/// `low_freq_factor` 1 / `high_freq_factor` 4 (then Llama-4's 1 / 1), try each plausible original
/// context length, and accept one only if it reproduces every stored divisor.
fn llama3_from_rope_freqs(
    path: &Path,
    factors: &[f32],
    theta: f64,
    head_dim: usize,
    meta_orig: Option<usize>,
) -> Result<Option<serde_json::Value>> {
    if factors.len() != head_dim / 2 || factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
        return Err(Error::weights(
            path,
            format!(
                "GGUF tensor rope_freqs.weight: expected {} positive finite factors (head_dim {head_dim} / 2), found {}",
                head_dim / 2,
                factors.len()
            ),
        ));
    }
    // f32 storage of values computed in Python floats.
    const TOL: f64 = 1e-5;
    if factors.iter().all(|&f| (f as f64 - 1.0).abs() <= TOL) {
        return Ok(None);
    }
    let factor = factors.iter().fold(0f64, |m, &f| m.max(f as f64));
    let wavelen = |i: usize| {
        let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
        2.0 * std::f64::consts::PI / freq
    };
    // Llama 3.1's low 1 / high 4; then Llama-4's low = high = 1, which has no smooth band (each
    // frequency is divided by 1 or by `factor`).
    for (low, high) in [(1.0, 4.0), (1.0, 1.0)] {
        let mut candidates: Vec<f64> = meta_orig.map(|o| o as f64).into_iter().collect();
        candidates.push(8192.0);
        for (i, &f) in factors.iter().enumerate() {
            let f = f as f64;
            if high > low && f > 1.0 + TOL && f < factor - TOL {
                // In the smooth band: 1/f = (1 - s)/factor + s, s = (orig/wavelen - low)/(high - low).
                let s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor);
                let orig = wavelen(i) * (low + s * (high - low));
                candidates.push(if (orig - orig.round()).abs() < 1e-3 * orig {
                    orig.round()
                } else {
                    orig
                });
            }
        }
        // The divisors a candidate implies, computed by the runner's own llama3 rope (nn::inv_freq).
        let divisors = |orig: f64| -> Vec<f64> {
            let rope = |scaling| Rope { theta, scaling };
            let (base, _) = inv_freq(&rope(RopeScaling::None), head_dim);
            let (scaled, _) = inv_freq(
                &rope(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: orig,
                }),
                head_dim,
            );
            base.iter().zip(&scaled).map(|(b, s)| b / s).collect()
        };
        for orig in candidates {
            let fits = factors
                .iter()
                .zip(divisors(orig))
                .all(|(&f, d)| (d - f as f64).abs() <= TOL * factor);
            if fits {
                return Ok(Some(serde_json::json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": orig,
                })));
            }
        }
    }
    Err(Error::weights(
        path,
        format!(
            "GGUF tensor rope_freqs.weight does not match Llama 3 rope scaling (factor {factor}, \
             low_freq_factor 1, high_freq_factor 4 or 1) for any original context length; not supported"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf_and_refuse_what_they_do_not_know() {
        assert_eq!(
            hf_name("blk.3.attn_q.weight", "qwen3moe", 4, false).as_deref(),
            Some("model.layers.3.self_attn.q_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight", "qwen3moe", 1, false).as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(
            hf_name("output.weight", "qwen3moe", 1, false).as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(
            hf_name("blk.4.attn_q.weight", "qwen3moe", 4, false),
            None,
            "layer past block_count"
        );
        assert_eq!(
            hf_name("blk.01.attn_q.weight", "qwen3moe", 4, false),
            None,
            "non-canonical index"
        );
        assert_eq!(hf_name("blk.+1.attn_q.weight", "qwen3moe", 4, false), None);
        assert_eq!(
            hf_name("blk.0.ffn_gate_exps.weight", "qwen3moe", 4, false),
            None
        );
        assert_eq!(
            hf_name("blk.0.ffn_gate_exps.weight", "qwen3moe", 4, true).as_deref(),
            Some("model.layers.0.mlp.experts.gate_proj")
        );
        assert_eq!(
            hf_name("blk.0.attn_output.bias", "qwen3moe", 4, false),
            None
        );
    }

    /// The same GGUF name is another HF tensor in another architecture: Gemma-3's `ffn_norm` is
    /// the norm before its MLP (Llama's is after attention), Phi-3's `ffn_up` holds gate and up,
    /// Llama-4's feed-forward lives under `feed_forward`.
    #[test]
    fn family_names_follow_their_architecture() {
        let name = |g: &str, arch: &str| hf_name(g, arch, 4, arch == "llama4");
        assert_eq!(
            name("blk.1.ffn_norm.weight", "gemma3").as_deref(),
            Some("model.layers.1.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            name("blk.1.ffn_norm.weight", "llama4").as_deref(),
            Some("model.layers.1.post_attention_layernorm.weight")
        );
        assert_eq!(
            name("blk.1.post_attention_norm.weight", "gemma3").as_deref(),
            Some("model.layers.1.post_attention_layernorm.weight")
        );
        assert_eq!(name("blk.1.post_ffw_norm.weight", "phi3"), None);
        assert_eq!(
            name("blk.0.ffn_up.weight", "phi3").as_deref(),
            Some("model.layers.0.mlp.gate_up_proj.weight")
        );
        assert_eq!(
            name("blk.0.attn_qkv.weight", "phi3").as_deref(),
            Some("model.layers.0.self_attn.qkv_proj.weight")
        );
        assert_eq!(name("blk.0.attn_q.weight", "phi3"), None);
        assert_eq!(name("blk.0.attn_qkv.weight", "llama"), None);
        assert_eq!(
            name("blk.3.ffn_gate_inp.weight", "llama4").as_deref(),
            Some("model.layers.3.feed_forward.router.weight")
        );
        assert_eq!(
            name("blk.3.ffn_down_exps.weight", "llama4").as_deref(),
            Some("model.layers.3.feed_forward.experts.down_proj")
        );
        assert_eq!(
            name("blk.3.ffn_gate_shexp.weight", "llama4").as_deref(),
            Some("model.layers.3.feed_forward.shared_expert.gate_proj.weight")
        );
        assert_eq!(name("blk.3.ffn_gate_shexp.weight", "qwen3moe"), None);
    }

    /// Llama-4 Scout's rope (factor 16, low = high = 1, original 8192): each frequency divided by
    /// 1 or 16, no smooth band; recovered as such, not as Llama 3.1's low 1 / high 4.
    #[test]
    fn llama4_scaling_is_recovered_from_rope_freqs() {
        let (theta, dim) = (500000.0f64, 128usize);
        let factors: Vec<f32> = (0..dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf((2 * i) as f64 / dim as f64);
                if 2.0 * std::f64::consts::PI / freq < 8192.0 {
                    1.0
                } else {
                    16.0
                }
            })
            .collect();
        let got = llama3_from_rope_freqs(Path::new("x.gguf"), &factors, theta, dim, None)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_default();
        assert_eq!(
            (got["factor"].as_f64(), got["low_freq_factor"].as_f64()),
            (Some(16.0), Some(1.0))
        );
        assert_eq!(got["high_freq_factor"].as_f64(), Some(1.0));
        assert_eq!(
            got["original_max_position_embeddings"].as_f64(),
            Some(8192.0)
        );
    }

    /// The inverse of llama.cpp's `LlamaModel.permute`, applied to its output, is the identity.
    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let (heads, hd, cols) = (3usize, 8usize, 5usize);
        let rows = heads * hd;
        let w = Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu)
            .and_then(|t| t.reshape((rows, cols)))
            .unwrap_or_else(|e| panic!("{e}"));
        // permute: reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(rows, cols)
        let permuted = w
            .reshape((heads, 2, hd / 2, cols))
            .and_then(|t| t.transpose(1, 2))
            .and_then(|t| t.contiguous())
            .and_then(|t| t.reshape((rows, cols)))
            .unwrap_or_else(|e| panic!("{e}"));
        // Row 1 of a permuted head is HF row hd/2 (the first "y" of the rotate-half pair).
        let row1: Vec<f32> = permuted
            .get(1)
            .and_then(|r| r.to_vec1())
            .unwrap_or_default();
        assert_eq!(row1[0], ((hd / 2) * cols) as f32);
        let back = unpermute_rows(Path::new("x.gguf"), "q", &permuted, heads)
            .unwrap_or_else(|e| panic!("{e}"));
        let diff: f32 = (back - &w)
            .and_then(|d| d.abs()?.sum_all()?.to_scalar())
            .unwrap_or(f32::NAN);
        assert_eq!(diff, 0.0);
        let bias =
            Tensor::arange(0f32, rows as f32, &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
        assert!(unpermute_rows(Path::new("x.gguf"), "q", &bias, heads).is_ok());
        assert!(unpermute_rows(Path::new("x.gguf"), "q", &bias, 5).is_err());
    }

    #[test]
    fn llama3_scaling_is_recovered_from_rope_freqs() {
        // What convert_hf_to_gguf.py writes for Llama 3.1 (theta 5e5, head_dim 128, factor 8).
        let (theta, dim, orig) = (500000.0f64, 128usize, 8192.0f64);
        let factors: Vec<f32> = (0..dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf((2 * i) as f64 / dim as f64);
                let wl = 2.0 * std::f64::consts::PI / freq;
                if wl < orig / 4.0 {
                    1.0
                } else if wl > orig {
                    8.0
                } else {
                    let s = (orig / wl - 1.0) / 3.0;
                    (1.0 / ((1.0 - s) / 8.0 + s)) as f32
                }
            })
            .collect();
        let got = llama3_from_rope_freqs(Path::new("x.gguf"), &factors, theta, dim, None)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_default();
        assert_eq!(got["rope_type"], "llama3");
        assert_eq!(got["factor"], 8.0);
        assert_eq!(got["original_max_position_embeddings"], 8192.0);
        let ones = vec![1.0f32; dim / 2];
        assert!(matches!(
            llama3_from_rope_freqs(Path::new("x.gguf"), &ones, theta, dim, None),
            Ok(None)
        ));
        let mut odd = factors.clone();
        odd[0] = 3.0;
        let err = llama3_from_rope_freqs(Path::new("x.gguf"), &odd, theta, dim, None);
        assert!(err.is_err());
    }
}
