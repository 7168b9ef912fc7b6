//! The EAGLE-3 draft forward: fc over the captured target states, then one decoder layer whose
//! attention sees `cat(input_layernorm(embed), hidden_norm(fc))`. The attention is Llama's GQA
//! (`LlamaForCausalLMEagle3`; sglang `python/sglang/srt/models/llama_eagle3.py`, SpecForge
//! `specforge/modeling/draft/llama3_eagle.py`) or DeepSeek's MLA (`Eagle3DeepseekV2ForCausalLM`;
//! TorchSpec `torchspec/models/draft/deepseek_eagle.py`, sglang
//! `python/sglang/srt/models/deepseek_eagle3.py`). Layout in docs/eagle3-capture.md section 4;
//! the MLA draft's weights in fixtures/gen_mla_draft.py.

use crate::config::{DraftConfig, Rope};
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, AttnParams, RopeParams};
use crate::model::deepseek::{Mla, MlaDims, softmax_scale_for};
use crate::model::nn::{Linear, Mlp, RmsNorm, RopeTables, attention, causal_mask, softmax_last};
use crate::model::source::{SafetensorsSource, Vb, WeightSource};
use crate::model::{ComputePath, EmbedRows};
use crate::naming::{self, DraftTensor};
use candle_core::{DType, Device, Tensor};
use std::path::Path;

/// The draft layer's attention over the `[T, 2H]` input.
enum DraftAttention {
    /// Llama GQA with rotate-half rope over the whole head.
    Gqa {
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
    },
    /// DeepSeek MLA, the target's own block with 2H-wide down projections; rope on the
    /// `qk_rope_head_dim` part, interleaved when the config says so.
    Mla(Mla),
}

impl DraftAttention {
    fn load(cfg: &DraftConfig, sa: &Vb) -> Result<DraftAttention> {
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let Some(mla) = &cfg.mla else {
            return Ok(DraftAttention::Gqa {
                q: Linear::load(&sa.pp("q_proj"), nh * hd, 2 * h, false)?,
                k: Linear::load(&sa.pp("k_proj"), nkv * hd, 2 * h, false)?,
                v: Linear::load(&sa.pp("v_proj"), nkv * hd, 2 * h, false)?,
                o: Linear::load(&sa.pp("o_proj"), h, nh * hd, false)?,
            });
        };
        if mla.qk_rope_head_dim == 0 || mla.qk_rope_head_dim % 2 != 0 {
            return Err(Error::config(
                &cfg.path,
                format!(
                    "qk_rope_head_dim must be even and positive, found {}",
                    mla.qk_rope_head_dim
                ),
            ));
        }
        // No biases: TorchSpec builds every MLA projection with bias=False and sglang's fused
        // 2H-input qkv_a projection likewise.
        let dims = MlaDims {
            in_dim: 2 * h,
            hidden: h,
            heads: nh,
            eps: cfg.rms_norm_eps,
            bias: false,
            scale: softmax_scale_for(cfg.rope()?, mla),
        };
        Ok(DraftAttention::Mla(Mla::load(&dims, mla, sa)?))
    }

    /// How many dimensions of each head rope rotates.
    fn rope_dim(cfg: &DraftConfig) -> usize {
        cfg.mla
            .as_ref()
            .map_or(cfg.head_dim, |m| m.qk_rope_head_dim)
    }

    /// The kernel path (token-major, rope in place, flash attention). `x`: [T, 2H] -> [T, H]
    fn forward_kernels(
        &self,
        cfg: &DraftConfig,
        x: &Tensor,
        rope: &RopeTables,
    ) -> candle_core::Result<Tensor> {
        match self {
            DraftAttention::Gqa { q, k, v, o } => {
                let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
                let q = q.forward(x)?.contiguous()?;
                let k = k.forward(x)?.contiguous()?;
                kernels::rope_in_place(&q, &rope.cos32, &rope.sin32, &RopeParams::half(nh, hd))?;
                kernels::rope_in_place(&k, &rope.cos32, &rope.sin32, &RopeParams::half(nkv, hd))?;
                let params = AttnParams {
                    nh,
                    nkv,
                    dk: hd,
                    dv: hd,
                    scale: 1.0 / (hd as f64).sqrt(),
                    window: None,
                };
                o.forward(&kernels::flash_attention(&q, &k, &v.forward(x)?, &params)?)
            }
            DraftAttention::Mla(mla) => mla.forward_kernels(x, rope),
        }
    }

    /// `x`: [T, 2H] -> [T, H]
    fn forward(
        &self,
        cfg: &DraftConfig,
        x: &Tensor,
        rope: &RopeTables,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        match self {
            DraftAttention::Gqa { .. } => self.forward_chain(cfg, x, rope, mask, &mut Vec::new()),
            DraftAttention::Mla(mla) => mla.forward(x, rope, mask),
        }
    }

    /// GQA on the candle path as one step of a draft chain, the way EAGLE-3's training-time
    /// test runs it (SpecForge `specforge/modeling/draft/llama3_eagle.py`, `LlamaAttention`
    /// with `cache_hidden`): step j = `cache.len()` takes `rope` at positions t + j; row t
    /// attends to step 0's keys at rows 0..=t (the causal `mask`) and to the keys that steps
    /// 1..=j computed at row t itself. Step 0 is plain causal attention. This step's rotated
    /// keys and values ([kv_heads, T, hd] each) are pushed onto `cache`. `x`: [T, 2H] -> [T, H]
    fn forward_chain(
        &self,
        cfg: &DraftConfig,
        x: &Tensor,
        rope: &RopeTables,
        mask: &Tensor,
        cache: &mut Vec<(Tensor, Tensor)>,
    ) -> candle_core::Result<Tensor> {
        let DraftAttention::Gqa { q, k, v, o } = self else {
            candle_core::bail!("draft chains of more than one step need a GQA draft, not MLA")
        };
        let (t, nh, nkv, hd) = (x.dim(0)?, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let split = |y: Tensor, n: usize| y.reshape((t, n, hd))?.transpose(0, 1)?.contiguous();
        let q = rope.apply_half(&split(q.forward(x)?, nh)?)?;
        let k = rope.apply_half(&split(k.forward(x)?, nkv)?)?;
        let v = split(v.forward(x)?, nkv)?;
        let scale = 1.0 / (hd as f64).sqrt();
        cache.push((k, v));
        let out = match cache.as_slice() {
            [(k, v)] => attention(&q, k, v, mask, scale)?,
            [(k0, v0), later @ ..] => chain_attention(&q, (k0, v0), later, mask, scale)?,
            [] => unreachable!("the cache holds this step's keys"),
        };
        o.forward(&out)
    }
}

/// Attention of a later chain step: `q` [heads, T, d] against step 0's keys `k0`/`v0`
/// ([kv_heads, T, d], causal through `mask` [T, T]) and, per row, against each later step's key
/// at the same row (`later`, this step's last). Returns [T, heads * dv].
fn chain_attention(
    q: &Tensor,
    (k0, v0): (&Tensor, &Tensor),
    later: &[(Tensor, Tensor)],
    mask: &Tensor,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let (heads, t, _) = q.dims3()?;
    let expand = |x: &Tensor| -> candle_core::Result<Tensor> {
        let (kh, s, d) = x.dims3()?;
        if kh == heads {
            return Ok(x.clone());
        }
        x.unsqueeze(1)?
            .broadcast_as((kh, heads / kh, s, d))?
            .reshape((heads, s, d))
    };
    let q = q.contiguous()?;
    let (k0, v0) = (expand(k0)?, expand(v0)?);
    let mut scores = vec![
        (q.matmul(&k0.t()?.contiguous()?)? * scale)?.broadcast_add(mask)?, // [heads, T, T]
    ];
    let mut values = Vec::with_capacity(later.len());
    for (k, v) in later {
        scores.push(((&q * expand(k)?)?.sum_keepdim(2)? * scale)?); // [heads, T, 1]
        values.push(expand(v)?);
    }
    let probs = softmax_last(&Tensor::cat(&scores, 2)?)?; // [heads, T, T + later]
    let mut out = probs
        .narrow(2, 0, t)?
        .contiguous()?
        .matmul(&v0.contiguous()?)?;
    for (i, v) in values.iter().enumerate() {
        out = (out + probs.narrow(2, t + i, 1)?.broadcast_mul(v)?)?;
    }
    let dv = out.dim(2)?;
    out.transpose(0, 1)?.contiguous()?.reshape((t, heads * dv))
}

pub struct Eagle3Draft {
    pub cfg: DraftConfig,
    fc: Linear,
    hidden_norm: RmsNorm,
    input_norm: RmsNorm,
    post_norm: RmsNorm,
    attn: DraftAttention,
    mlp: Mlp,
    norm: RmsNorm,
    lm_head: Linear,
    /// draft id -> target id offset: `target = draft + d2t[draft]`.
    d2t: Vec<i64>,
    embed: Option<Tensor>,
    /// The draft layer's rope, resolved at load (a config's unknown rope type is refused there).
    rope: Rope,
    dtype: DType,
    path: ComputePath,
}

/// `t2d` must flag exactly the target ids `d2t` maps the draft vocabulary onto, and those ids
/// must lie inside the target vocabulary: a draft whose two maps disagree predicts tokens it
/// was never trained to.
fn check_vocab_map(cfg: &DraftConfig, root: &Vb, d2t: &[i64]) -> Result<()> {
    let v = cfg.vocab_size;
    let targets: Vec<i64> = d2t
        .iter()
        .enumerate()
        .map(|(d, &off)| d as i64 + off)
        .collect();
    if let Some((d, &t)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t < 0 || t as usize >= v)
    {
        return Err(Error::weights(
            root.origin(),
            format!("d2t maps draft token {d} to target id {t}, outside the vocabulary 0..{v}"),
        ));
    }
    let Some(shape) = root.shape_of("t2d") else {
        return Ok(());
    };
    if shape != [v] {
        return Err(Error::Shape {
            path: root.origin().to_path_buf(),
            name: root.path("t2d"),
            expected: vec![v],
            got: shape,
        });
    }
    let t2d: Vec<u8> = root
        .get_raw("t2d")?
        .to_dtype(DType::U8)
        .and_then(|t| t.to_vec1::<u8>())
        .ctx(|| "reading t2d".to_string())?;
    let marked = t2d.iter().filter(|&&x| x != 0).count();
    let agree = targets.iter().all(|&t| t2d[t as usize] != 0);
    if !agree || marked != targets.len() {
        return Err(Error::weights(
            root.origin(),
            format!(
                "t2d flags {marked} target ids but d2t maps the {} draft tokens onto {} of them: the two maps disagree",
                targets.len(),
                targets.iter().filter(|&&t| t2d[t as usize] != 0).count()
            ),
        ));
    }
    Ok(())
}

/// One pass of the draft layer inside a chain.
pub struct DraftStep {
    /// [T, draft_vocab]
    pub logits: Tensor,
    /// [T, H]: the layer's output before the final norm, the hidden input of the next step.
    pub hidden: Tensor,
    /// Greedy next token per row, mapped to target ids through `d2t`.
    pub next_target_ids: Vec<i64>,
}

/// What the earlier steps of a draft chain leave the later ones: each step's rotated keys and
/// values.
#[derive(Default)]
pub struct Chain {
    kv: Vec<(Tensor, Tensor)>,
}

impl Chain {
    /// How many steps ran.
    pub fn steps(&self) -> usize {
        self.kv.len()
    }
}

/// What one draft forward produced.
pub struct DraftOutput {
    /// [T, draft_vocab]
    pub logits: Tensor,
    /// Greedy next token per position, mapped to target ids through `d2t`.
    pub next_target_ids: Vec<i64>,
}

/// How many target states a draft's `fc` concatenates: its `fc.weight` columns over the target
/// hidden size. `None` when the draft holds no `fc.weight`.
pub fn fc_slots(src: &dyn WeightSource, target_hidden: usize) -> Result<Option<usize>> {
    let Some(name) = naming::find_draft(DraftTensor::Top("fc.weight"), &|n| src.shape(n).is_some())
    else {
        return Ok(None);
    };
    let shape = src.shape(&name).unwrap_or_default();
    match shape.as_slice() {
        [_, cols] if target_hidden > 0 && cols % target_hidden == 0 && *cols > 0 => {
            Ok(Some(cols / target_hidden))
        }
        _ => Err(Error::weights(
            src.origin(),
            format!(
                "{name} is {shape:?}: not [H, k x {target_hidden}] for target states of width {target_hidden}"
            ),
        )),
    }
}

/// Opens the draft in `dir` for its own number of `fc` slots: the draft and that number.
pub fn open_draft(
    cfg: &DraftConfig,
    dir: &Path,
    target_hidden: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Eagle3Draft, usize)> {
    let src = SafetensorsSource::open(dir)?;
    let k = fc_slots(&src, target_hidden)?.ok_or_else(|| Error::MissingTensor {
        path: dir.to_path_buf(),
        name: "fc.weight".into(),
    })?;
    let vb = Vb::new(&src, dtype, device);
    Ok((Eagle3Draft::load(cfg, &vb, target_hidden, k)?, k))
}

impl Eagle3Draft {
    /// `k_slots`: how many target states `fc` concatenates; `target_hidden`: their width.
    pub fn load(
        cfg: &DraftConfig,
        vb: &Vb,
        target_hidden: usize,
        k_slots: usize,
    ) -> Result<Eagle3Draft> {
        if cfg.norm_before_fc {
            return Err(Error::config(
                &cfg.path,
                "norm_before_fc drafts cannot be run yet",
            ));
        }
        let rope = cfg.rope()?.clone();
        let has = |n: &str| vb.contains(n);
        let root = vb.pp(naming::draft_root(&has).unwrap_or(""));
        let layer = root.pp(naming::draft_layer(&root.path(""), &has).unwrap_or("midlayer"));
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let dv = cfg.draft_vocab_size;
        let d2t_name = naming::DRAFT_D2T
            .into_iter()
            .find(|n| root.contains(n))
            .unwrap_or("d2t");
        let d2t = match root.shape_of(d2t_name) {
            Some(shape) if shape == [dv] => root
                .get_raw(d2t_name)?
                .to_dtype(DType::I64)
                .and_then(|t| t.to_vec1::<i64>())
                .ctx(|| format!("reading {d2t_name}"))?,
            Some(shape) => {
                return Err(Error::Shape {
                    path: vb.origin().to_path_buf(),
                    name: d2t_name.into(),
                    expected: vec![dv],
                    got: shape,
                });
            }
            // A full-vocabulary draft maps ids one to one.
            None if dv == cfg.vocab_size => vec![0; dv],
            None => {
                return Err(Error::MissingTensor {
                    path: vb.origin().to_path_buf(),
                    name: "d2t".into(),
                });
            }
        };
        check_vocab_map(cfg, &root, &d2t)?;
        let sa = layer.pp("self_attn");
        let draft = Eagle3Draft {
            fc: Linear::load(
                &root.pp("fc"),
                h,
                k_slots * target_hidden,
                root.contains("fc.bias"),
            )?,
            hidden_norm: RmsNorm::load(&layer.pp("hidden_norm"), h, eps)?,
            input_norm: RmsNorm::load(&layer.pp("input_layernorm"), h, eps)?,
            post_norm: RmsNorm::load(&layer.pp("post_attention_layernorm"), h, eps)?,
            attn: DraftAttention::load(cfg, &sa)?,
            mlp: Mlp::load(&layer.pp("mlp"), h, cfg.intermediate_size)?,
            norm: RmsNorm::load(&root.pp("norm"), h, eps)?,
            lm_head: Linear::load(&root.pp("lm_head"), dv, h, false)?,
            embed: root.get_opt("embed_tokens.weight", &[cfg.vocab_size, h])?,
            d2t,
            rope,
            cfg: cfg.clone(),
            dtype: vb.dtype,
            path: ComputePath::for_device(&vb.device),
        };
        let unread = vb.unread();
        if let Some(first) = unread.first() {
            return Err(Error::UnusedTensors {
                path: vb.origin().to_path_buf(),
                arch: cfg.architecture.clone(),
                count: unread.len(),
                first: first.clone(),
                hint: String::new(),
            });
        }
        Ok(draft)
    }

    /// The same draft on another compute path (tests run the kernel path on the CPU).
    pub fn with_path(mut self, path: ComputePath) -> Eagle3Draft {
        self.path = path;
        self
    }

    /// One draft step over a sequence. `ids`: [T] tokens whose embeddings enter (token t+1 of the
    /// target sequence pairs with the target state at t); `fc_input`: [T, k*Ht];
    /// `target_embed`: the target's embeddings, whose rows for `ids` are read when the draft has
    /// none of its own.
    pub fn forward(
        &self,
        ids: &[u32],
        fc_input: &Tensor,
        target_embed: &dyn EmbedRows,
    ) -> Result<DraftOutput> {
        let fc_out = self.fc_forward(fc_input)?;
        let step = self.step(ids, &fc_out, target_embed, None)?;
        Ok(DraftOutput {
            logits: step.logits,
            next_target_ids: step.next_target_ids,
        })
    }

    /// `fc` over the concatenated target states: [T, k*Ht] -> [T, H], in the compute dtype.
    pub fn fc_forward(&self, fc_input: &Tensor) -> Result<Tensor> {
        fc_input
            .to_dtype(self.dtype)
            .and_then(|x| self.fc.forward(&x))
            .ctx(|| "draft fc".to_string())
    }

    /// `fc`'s weight columns for slot `slot` of `k` ([H, Ht]): `fc(cat(s_0..s_k))` is the sum of
    /// `s_i W_i^T` (plus the bias), so a layout search can project every boundary through every
    /// slot once and add the parts instead of re-running `fc` per layout.
    pub fn fc_slot_weight(&self, slot: usize, k: usize) -> Result<Tensor> {
        let w = &self.fc.weight;
        let width = self.fc_in_features() / k.max(1);
        w.narrow(1, slot * width, width)
            .and_then(|c| c.contiguous())
            .ctx(|| format!("fc columns of slot {slot}"))
    }

    /// `fc`'s bias, when it has one ([H]).
    pub fn fc_bias(&self) -> Option<&Tensor> {
        self.fc.bias.as_ref()
    }

    /// One pass of the draft layer. `ids` [T]: the tokens entering; `hidden` [T, H]: the fc
    /// output at step 0, the previous step's [`DraftStep::hidden`] later in a chain. Without a
    /// chain this is the single step inference runs first (the device's compute path); with
    /// one it is step `chain.steps()` of a chain (candle attention, see
    /// `DraftAttention::forward_chain`), rope at positions t + that step.
    pub fn step(
        &self,
        ids: &[u32],
        hidden: &Tensor,
        target_embed: &dyn EmbedRows,
        chain: Option<&mut Chain>,
    ) -> Result<DraftStep> {
        let embeds = match &self.embed {
            Some(own) => own.rows(ids)?,
            None => target_embed.rows(ids)?,
        };
        let device = hidden.device();
        let t = ids.len();
        let offset = chain.as_ref().map_or(0, |c| c.kv.len());
        let rope_dim = DraftAttention::rope_dim(&self.cfg);
        let rope = RopeTables::new(&self.rope, rope_dim, t + offset, self.dtype, device)?
            .rows(offset, t)?;
        let path = if chain.is_some() {
            ComputePath::Candle
        } else {
            self.path
        };
        let mask = match path {
            ComputePath::Candle => causal_mask(t, None, self.dtype, device)?,
            ComputePath::Kernels | ComputePath::Fused => {
                Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())?
            }
        };
        let mut chain = chain;
        let mut run = || -> candle_core::Result<(Tensor, Tensor)> {
            // norm_before_residual (vLLM/speculators): the residual is taken after hidden_norm.
            let normed = self.hidden_norm.forward(hidden)?;
            let residual = if self.cfg.norm_before_residual {
                normed.clone()
            } else {
                hidden.clone()
            };
            let x = Tensor::cat(&[&self.input_norm.forward(&embeds)?, &normed], 1)?; // [T, 2H]
            let attn = match (&mut chain, path) {
                (Some(chain), _) if self.chains() || !chain.kv.is_empty() => self
                    .attn
                    .forward_chain(&self.cfg, &x, &rope, &mask, &mut chain.kv)?,
                // An MLA draft's chain is its first step alone.
                (Some(_), _) => self.attn.forward(&self.cfg, &x, &rope, &mask)?,
                (None, ComputePath::Candle) => self.attn.forward(&self.cfg, &x, &rope, &mask)?,
                (None, ComputePath::Kernels | ComputePath::Fused) => {
                    self.attn.forward_kernels(&self.cfg, &x, &rope)?
                }
            };
            let x = (residual + attn)?;
            let m = self.mlp.forward(&self.post_norm.forward(&x)?)?;
            let x = (x + m)?;
            Ok((self.lm_head.forward(&self.norm.forward(&x)?)?, x))
        };
        let (logits, hidden) = run().ctx(|| "draft forward".to_string())?;
        let argmax = logits
            .argmax(1)
            .and_then(|a| a.to_dtype(DType::I64))
            .and_then(|a| a.to_vec1::<i64>())
            .ctx(|| "draft argmax".to_string())?;
        let next_target_ids = argmax
            .iter()
            .map(|&d| d + self.d2t.get(d as usize).copied().unwrap_or(0))
            .collect();
        Ok(DraftStep {
            logits,
            hidden,
            next_target_ids,
        })
    }

    /// Target ids of the draft vocabulary, in draft order (`d2t` applied to 0..draft_vocab).
    pub fn draft_vocab_targets(&self) -> Vec<i64> {
        self.d2t
            .iter()
            .enumerate()
            .map(|(d, &off)| d as i64 + off)
            .collect()
    }

    /// Whether chains of more than one step can run (GQA drafts; MLA drafts run one step).
    pub fn chains(&self) -> bool {
        matches!(self.attn, DraftAttention::Gqa { .. })
    }

    pub fn fc_in_features(&self) -> usize {
        self.fc.weight.dim(1).unwrap_or(0)
    }
}
