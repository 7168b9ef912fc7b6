//! The EAGLE-3 draft forward: fc over the captured target states, then one decoder layer whose
//! attention sees `cat(input_layernorm(embed), hidden_norm(fc))`. The attention is Llama's GQA
//! (`LlamaForCausalLMEagle3`; sglang `python/sglang/srt/models/llama_eagle3.py`, SpecForge
//! `specforge/modeling/draft/llama3_eagle.py`) or DeepSeek's MLA (`Eagle3DeepseekV2ForCausalLM`;
//! TorchSpec `torchspec/models/draft/deepseek_eagle.py`, sglang
//! `python/sglang/srt/models/deepseek_eagle3.py`). Layout in docs/eagle3-capture.md section 4;
//! the MLA draft's weights in fixtures/gen_mla_draft.py.

use crate::config::DraftConfig;
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, AttnParams, RopeParams};
use crate::model::deepseek::{Mla, MlaDims, softmax_scale_for};
use crate::model::nn::{Linear, Mlp, RmsNorm, RopeTables, attention, causal_mask};
use crate::model::source::Vb;
use crate::model::{ComputePath, EmbedRows};
use crate::naming;
use candle_core::{DType, Tensor};

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
            scale: softmax_scale_for(&cfg.rope, mla),
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
            DraftAttention::Gqa { q, k, v, o } => {
                let (t, nh, nkv, hd) = (x.dim(0)?, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
                let split =
                    |y: Tensor, n: usize| y.reshape((t, n, hd))?.transpose(0, 1)?.contiguous();
                let q = rope.apply_half(&split(q.forward(x)?, nh)?)?;
                let k = rope.apply_half(&split(k.forward(x)?, nkv)?)?;
                let v = split(v.forward(x)?, nkv)?;
                o.forward(&attention(&q, &k, &v, mask, 1.0 / (hd as f64).sqrt())?)
            }
            DraftAttention::Mla(mla) => mla.forward(x, rope, mask),
        }
    }
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

/// What one draft forward produced.
pub struct DraftOutput {
    /// [T, draft_vocab]
    pub logits: Tensor,
    /// Greedy next token per position, mapped to target ids through `d2t`.
    pub next_target_ids: Vec<i64>,
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
        let embeds = match &self.embed {
            Some(own) => own.rows(ids)?,
            None => target_embed.rows(ids)?,
        };
        let device = fc_input.device();
        let t = ids.len();
        let rope_dim = DraftAttention::rope_dim(&self.cfg);
        let rope = RopeTables::new(&self.cfg.rope, rope_dim, t, self.dtype, device)?;
        let mask = match self.path {
            ComputePath::Candle => causal_mask(t, None, self.dtype, device)?,
            ComputePath::Kernels | ComputePath::Fused => {
                Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())?
            }
        };
        let run = || -> candle_core::Result<Tensor> {
            let fc_out = self.fc.forward(&fc_input.to_dtype(self.dtype)?)?;
            // norm_before_residual (vLLM/speculators): the residual is taken after hidden_norm.
            let hidden = self.hidden_norm.forward(&fc_out)?;
            let residual = if self.cfg.norm_before_residual {
                hidden.clone()
            } else {
                fc_out
            };
            let x = Tensor::cat(&[&self.input_norm.forward(&embeds)?, &hidden], 1)?; // [T, 2H]
            let attn = match self.path {
                ComputePath::Candle => self.attn.forward(&self.cfg, &x, &rope, &mask)?,
                ComputePath::Kernels | ComputePath::Fused => {
                    self.attn.forward_kernels(&self.cfg, &x, &rope)?
                }
            };
            let x = (residual + attn)?;
            let m = self.mlp.forward(&self.post_norm.forward(&x)?)?;
            let x = (x + m)?;
            self.lm_head.forward(&self.norm.forward(&x)?)
        };
        let logits = run().ctx(|| "draft forward".to_string())?;
        let argmax = logits
            .argmax(1)
            .and_then(|a| a.to_dtype(DType::I64))
            .and_then(|a| a.to_vec1::<i64>())
            .ctx(|| "draft argmax".to_string())?;
        let next_target_ids = argmax
            .iter()
            .map(|&d| d + self.d2t.get(d as usize).copied().unwrap_or(0))
            .collect();
        Ok(DraftOutput {
            logits,
            next_target_ids,
        })
    }

    pub fn fc_in_features(&self) -> usize {
        self.fc.weight.dim(1).unwrap_or(0)
    }
}
