//! The Llama-family capture forward on a CUDA device, launch by launch on raw device pointers:
//! every boundary is written once, straight into the capture buffer, and nothing is allocated
//! per op (candle allocates and frees a tensor per op, which costs more than the op itself at
//! short sequences on this hardware: ../shared/docs/cuda-build.md measured ~188 us a candle op).
//!
//! Per layer, nine launches: the residual stream `caps[i]` ([T, H], the boundary b = i) goes
//! through `q|k|v = normed @ Wqkv^T` (one cuBLAS GEMM over the fused weights; three when the
//! model normalises q and k per head), rope on q and k in place, flash attention,
//! `mid = caps[i] + attn @ Wo^T` (the residual add in the GEMM's epilogue, cublasLt), the
//! post-attention norm, `@ Wgate|up^T`, SiLU-mul, `caps[i + 1] = mid + act @ Wdown^T` (again in
//! the epilogue), and the next layer's input norm. A projection with a bias, or a down
//! projection whose output is captured on its own, is written apart and added by the norm
//! kernel instead. After the last layer the next norm is the final norm: `caps[L]` is the
//! pre-norm state engines capture and the normed output is b = L as HF returns it. The same math
//! as the kernel path of [`super::llama`] (tested against transformers on the CPU through the
//! kernels' references) up to the epilogue's single rounding of each residual sum; the device
//! tests compare the two on the GPU.

use super::Resident;
use super::llama::LlamaDecoder;
use super::nn::Linear;
use super::{Capture, CaptureRequest, EmbedRows, ManyOptions, Progress, Sink, Target, phases};
use crate::config::ModelConfig;
use crate::error::{CandleContext, Result};
use crate::kernels::KernelDType;
use crate::kernels::attention::launch::{FlashArgs, flash_attn};
use crate::kernels::cuda::{self, DevPtr, tensor_ptr};
use crate::kernels::gather::launch::{GatherArgs, gather_rows};
use crate::kernels::gemm::{GemmArgs, gemm_add_raw, gemm_raw};
use crate::kernels::rmsnorm::launch::{RmsNormArgs, add_rmsnorm};
use crate::kernels::rope::launch::{RopeArgs, rope};
use crate::kernels::silu_mul::launch::{SiluMulArgs, silu_mul};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};

/// A weight matrix `[n, k]` with its optional bias `[n]`, both on the device.
struct Proj {
    w: Tensor,
    b: Option<Tensor>,
    n: usize,
}

impl Proj {
    /// `out[T, n] (row stride out.1) = a[T, k] @ w^T`, accumulating onto `out` when there is a
    /// bias (the caller writes the bias rows first).
    fn args(
        &self,
        a: (DevPtr, usize),
        out: (DevPtr, usize),
        t: usize,
        k: usize,
    ) -> Result<GemmArgs> {
        Ok(GemmArgs {
            out: out.0,
            out_stride: out.1,
            a: a.0,
            a_stride: a.1,
            w: ptr(&self.w)?,
            w_stride: k,
            m: t,
            n: self.n,
            k,
            accumulate: self.b.is_some(),
        })
    }

    /// Several projections of the same input stacked into one (`q|k|v`, `gate|up`); one
    /// projection is taken as it is (no copy).
    fn fused(parts: &[&Linear]) -> candle_core::Result<Proj> {
        if let [one] = parts {
            return Ok(Proj {
                n: one.weight.dim(0)?,
                w: one.weight.contiguous()?,
                b: one.bias.clone(),
            });
        }
        let ws: Vec<&Tensor> = parts.iter().map(|l| &l.weight).collect();
        let w = Tensor::cat(&ws, 0)?.contiguous()?;
        let b = if parts.iter().any(|l| l.bias.is_some()) {
            let bs = parts
                .iter()
                .map(|l| match &l.bias {
                    Some(b) => Ok(b.clone()),
                    None => Tensor::zeros(l.weight.dim(0)?, l.weight.dtype(), l.weight.device()),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Some(Tensor::cat(&bs, 0)?.contiguous()?)
        } else {
            None
        };
        Ok(Proj { n: w.dim(0)?, w, b })
    }
}

struct FastLayer {
    in_norm: Tensor,
    post_norm: Tensor,
    /// `q|k|v` fused, or three projections when q and k are normalised per head.
    qkv: Vec<Proj>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    o: Proj,
    gate_up: Proj,
    down: Proj,
}

/// A Llama-family target on a CUDA device, with the fused launch sequence above.
pub struct FastLlama {
    inner: Resident<LlamaDecoder>,
    dev: CudaDevice,
    kd: KernelDType,
    layers: Vec<FastLayer>,
    /// f32 cos/sin tables kept across forwards: computing them on the host costs milliseconds
    /// at T = 8192, and a packed forward's are rows of them.
    rope: super::llama::RopeCache,
}

/// The scratch of one forward: `[T, *]` buffers, reused layer after layer.
struct Scratch {
    normed: Tensor,
    qkv: Tensor,
    attn: Tensor,
    proj: Tensor,
    mid: Tensor,
    gate_up: Tensor,
    act: Tensor,
    zeros: Tensor,
}

fn ptr(t: &Tensor) -> Result<DevPtr> {
    tensor_ptr(t).ctx(|| "device pointer".to_string())
}

impl FastLlama {
    /// Takes a loaded Llama-family target on a CUDA device and fuses its projections (the
    /// unfused copies are dropped).
    pub(crate) fn new(mut inner: Resident<LlamaDecoder>) -> Result<FastLlama> {
        let dev = match inner.embed.device() {
            Device::Cuda(d) => d.clone(),
            _ => {
                return Err(crate::error::Error::Device(
                    "the fused GPU forward needs a CUDA device".into(),
                ));
            }
        };
        let kd = KernelDType::of(inner.dec.dtype).ctx(|| "compute dtype".to_string())?;
        let layers = inner
            .layers
            .iter()
            .map(|l| -> candle_core::Result<FastLayer> {
                let a = &l.attn;
                let qkv = if a.q_norm.is_some() {
                    vec![
                        Proj::fused(&[&a.q])?,
                        Proj::fused(&[&a.k])?,
                        Proj::fused(&[&a.v])?,
                    ]
                } else {
                    vec![Proj::fused(&[&a.q, &a.k, &a.v])?]
                };
                Ok(FastLayer {
                    in_norm: l.input_norm.weight.clone(),
                    post_norm: l.post_norm.weight.clone(),
                    qkv,
                    q_norm: a.q_norm.as_ref().map(|n| n.weight.clone()),
                    k_norm: a.k_norm.as_ref().map(|n| n.weight.clone()),
                    o: Proj::fused(&[&a.o])?,
                    gate_up: Proj::fused(&[&l.mlp.gate, &l.mlp.up])?,
                    down: Proj::fused(&[&l.mlp.down])?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()
            .ctx(|| "fusing the projections".to_string())?;
        inner.layers.clear();
        Ok(FastLlama {
            inner,
            dev,
            kd,
            layers,
            rope: Default::default(),
        })
    }

    fn cfg(&self) -> &ModelConfig {
        &self.inner.dec.cfg
    }

    /// `out[T, n] (row stride out_stride) = a[T, k] @ p.w^T (+ bias)`.
    fn gemm(
        &self,
        p: &Proj,
        a: (DevPtr, usize),
        out: (DevPtr, usize),
        t: usize,
        k: usize,
        zeros: &Tensor,
    ) -> Result<()> {
        if let Some(b) = &p.b {
            // Every row of `out` starts as the bias (row 0 of a one-row matrix, gathered T
            // times), then the GEMM accumulates onto it.
            gather_rows(
                &self.dev,
                self.kd,
                &GatherArgs {
                    src: ptr(b)?,
                    src_stride: p.n,
                    src_rows: 1,
                    idx: ptr(zeros)?,
                    dst: out.0,
                    dst_stride: out.1,
                    rows: t,
                    cols: p.n,
                },
            )
            .ctx(|| "bias".to_string())?;
        }
        gemm_raw(&self.dev, self.kd, &p.args(a, out, t, k)?).ctx(|| "projection".to_string())
    }

    /// `out[T, n] = a[T, k] @ p.w^T + c[T, n]` (row stride `n` for c): the residual add in the
    /// GEMM's epilogue, for projections without a bias.
    fn gemm_add(
        &self,
        p: &Proj,
        a: (DevPtr, usize),
        out: DevPtr,
        t: usize,
        k: usize,
        c: DevPtr,
    ) -> Result<()> {
        let g = p.args(a, (out, p.n), t, k)?;
        gemm_add_raw(&self.dev, self.kd, &g, c, p.n).ctx(|| "projection + residual".to_string())
    }

    /// An uninitialised `[rows, cols]` buffer in the compute dtype: every buffer of the
    /// forward is written in full before it is read, so nothing is zero-filled.
    fn buffer(&self, rows: usize, cols: usize) -> candle_core::Result<Tensor> {
        let n = rows * cols;
        Ok(cuda::tensor(
            cuda::alloc(&self.dev, self.inner.dec.dtype, n)?,
            (rows, cols),
        ))
    }

    fn scratch(&self, t: usize) -> candle_core::Result<Scratch> {
        let cfg = self.cfg();
        let h = cfg.hidden_size;
        let qkv_cols = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim;
        let inter = cfg.intermediate_size;
        Ok(Scratch {
            normed: self.buffer(t, h)?,
            qkv: self.buffer(t, qkv_cols)?,
            attn: self.buffer(t, cfg.num_heads * cfg.head_dim)?,
            proj: self.buffer(t, h)?,
            mid: self.buffer(t, h)?,
            gate_up: self.buffer(t, 2 * inter)?,
            act: self.buffer(t, inter)?,
            zeros: Tensor::zeros(t, DType::U32, self.inner.embed.device())?,
        })
    }

    /// One forward over `ids`, sequences of `lens` tokens packed one after another (`[T]` for
    /// one sequence): every launch sees all rows but rope (each sequence's positions from 0)
    /// and attention (one launch per sequence, on its rows).
    fn forward_fast(&self, ids: &[u32], lens: &[usize], want: &CaptureRequest) -> Result<Capture> {
        let cfg = self.cfg();
        let (t, h, l) = (ids.len(), cfg.hidden_size, cfg.num_layers);
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let inter = cfg.intermediate_size;
        let qkv_cols = (nh + 2 * nkv) * hd;
        let device = self.inner.embed.device().clone();
        let eps = cfg.rms_norm_eps as f32;
        let alloc = |layers: usize| -> Result<Tensor> {
            self.buffer(layers * t, h)
                .and_then(|b| b.reshape((layers, t, h)))
                .ctx(|| "capture buffers".to_string())
        };
        // caps[b] = boundary b for b < L, caps[L] = the pre-norm final state.
        let caps = alloc(l + 1)?;
        let post = self.buffer(t, h).ctx(|| "capture buffers".to_string())?;
        let mlp_out = if want.layer_outputs {
            Some(alloc(l)?)
        } else {
            None
        };
        let s = self.scratch(t).ctx(|| "scratch buffers".to_string())?;
        let ids_t = Tensor::new(ids, &device).ctx(|| "token ids".to_string())?;
        let (cos_t, sin_t) = {
            let r = self.rope.packed(&cfg.rope, hd, lens, DType::F32, &device)?;
            (r.cos32, r.sin32)
        };
        let row = |base: DevPtr, i: usize| base + (i * t * h * self.kd.size()) as u64;
        let caps_p = ptr(&caps)?;
        let (normed_p, qkv_p, attn_p, proj_p, mid_p, gu_p, act_p) = (
            ptr(&s.normed)?,
            ptr(&s.qkv)?,
            ptr(&s.attn)?,
            ptr(&s.proj)?,
            ptr(&s.mid)?,
            ptr(&s.gate_up)?,
            ptr(&s.act)?,
        );
        let el = self.kd.size() as u64;
        let launch = |what: &str, r: candle_core::Result<()>| r.ctx(|| what.to_string());

        phases::mark("start", &device);
        launch(
            "embedding",
            gather_rows(
                &self.dev,
                self.kd,
                &GatherArgs {
                    src: ptr(&self.inner.embed)?,
                    src_stride: h,
                    src_rows: cfg.vocab_size,
                    idx: ptr(&ids_t)?,
                    dst: caps_p,
                    dst_stride: h,
                    rows: t,
                    cols: h,
                },
            ),
        )?;
        launch(
            "input norm",
            add_rmsnorm(
                &self.dev,
                self.kd,
                &RmsNormArgs {
                    x: caps_p,
                    x_stride: h,
                    delta: None,
                    w: ptr(&self.layers[0].in_norm)?,
                    resid: None,
                    normed: normed_p,
                    normed_stride: h,
                    rows: t,
                    cols: h,
                    eps,
                },
            ),
        )?;
        phases::mark("embedding + input norm", &device);
        let (cos, sin) = (ptr(&cos_t)?, ptr(&sin_t)?);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = row(caps_p, i);
            // q, k, v: one fused GEMM ([T, qkv_cols], heads q|k|v per row), or three into
            // blocks [T, nh*hd] | [T, nkv*hd] | [T, nkv*hd] when q and k are normed per head.
            let (q, k, v, qs, ks, vs) = if layer.qkv.len() == 1 {
                self.gemm(
                    &layer.qkv[0],
                    (normed_p, h),
                    (qkv_p, qkv_cols),
                    t,
                    h,
                    &s.zeros,
                )?;
                (
                    qkv_p,
                    qkv_p + (nh * hd) as u64 * el,
                    qkv_p + ((nh + nkv) * hd) as u64 * el,
                    qkv_cols,
                    qkv_cols,
                    qkv_cols,
                )
            } else {
                let q = qkv_p;
                let k = q + (t * nh * hd) as u64 * el;
                let v = k + (t * nkv * hd) as u64 * el;
                for (p, out, n) in [
                    (&layer.qkv[0], q, nh),
                    (&layer.qkv[1], k, nkv),
                    (&layer.qkv[2], v, nkv),
                ] {
                    self.gemm(p, (normed_p, h), (out, n * hd), t, h, &s.zeros)?;
                }
                for (w, base, n) in [(&layer.q_norm, q, nh), (&layer.k_norm, k, nkv)] {
                    if let Some(w) = w {
                        launch(
                            "q/k norm",
                            add_rmsnorm(
                                &self.dev,
                                self.kd,
                                &RmsNormArgs {
                                    x: base,
                                    x_stride: hd,
                                    delta: None,
                                    w: ptr(w)?,
                                    resid: None,
                                    normed: base,
                                    normed_stride: hd,
                                    rows: t * n,
                                    cols: hd,
                                    eps,
                                },
                            ),
                        )?;
                    }
                }
                (q, k, v, nh * hd, nkv * hd, nkv * hd)
            };
            phases::mark("qkv gemm", &device);
            let rope_on = |base: DevPtr, stride: usize, heads: usize| {
                rope(
                    &self.dev,
                    self.kd,
                    &RopeArgs {
                        x: base,
                        row_stride: stride,
                        tokens: t,
                        heads,
                        head_stride: hd,
                        rot_offset: 0,
                        rot_dim: hd,
                        cos,
                        sin,
                        interleaved: false,
                    },
                )
                .map(|_| ())
            };
            if layer.qkv.len() == 1 {
                // q and k heads sit side by side in each row: one launch rotates both.
                launch("rope", rope_on(q, qs, nh + nkv))?;
            } else {
                launch("rope q", rope_on(q, qs, nh))?;
                launch("rope k", rope_on(k, ks, nkv))?;
            }
            phases::mark("rope", &device);
            // One launch per packed sequence, on its rows: no token attends across the end of
            // one.
            let mut at = 0u64;
            for &len in lens {
                launch(
                    "attention",
                    flash_attn(
                        &self.dev,
                        self.kd,
                        &FlashArgs {
                            q: q + at * (qs as u64) * el,
                            q_stride: qs,
                            k: k + at * (ks as u64) * el,
                            k_stride: ks,
                            v: v + at * (vs as u64) * el,
                            v_stride: vs,
                            out: attn_p + at * ((nh * hd) as u64) * el,
                            o_stride: nh * hd,
                            tq: len,
                            tk: len,
                            nh,
                            nkv,
                            dk: hd,
                            dv: hd,
                            scale: 1.0 / (hd as f32).sqrt(),
                            window: cfg.sliding_window.unwrap_or(0),
                        },
                    )
                    .map(|_| ()),
                )?;
                at += len as u64;
            }
            phases::mark("attention", &device);
            // mid = x + attn @ Wo^T: in the GEMM's epilogue when o has no bias (one rounding of
            // the f32 sum where HF rounds the projection and then the sum), else added by the norm.
            let folded = layer.o.b.is_none();
            if folded {
                self.gemm_add(&layer.o, (attn_p, nh * hd), mid_p, t, nh * hd, x)?;
            } else {
                self.gemm(
                    &layer.o,
                    (attn_p, nh * hd),
                    (proj_p, h),
                    t,
                    nh * hd,
                    &s.zeros,
                )?;
            }
            phases::mark("o gemm", &device);
            launch(
                "post-attention norm",
                add_rmsnorm(
                    &self.dev,
                    self.kd,
                    &RmsNormArgs {
                        x: if folded { mid_p } else { x },
                        x_stride: h,
                        delta: (!folded).then_some((proj_p, h)),
                        w: ptr(&layer.post_norm)?,
                        resid: (!folded).then_some((mid_p, h)),
                        normed: normed_p,
                        normed_stride: h,
                        rows: t,
                        cols: h,
                        eps,
                    },
                ),
            )?;
            phases::mark("add + norm", &device);
            self.gemm(
                &layer.gate_up,
                (normed_p, h),
                (gu_p, 2 * inter),
                t,
                h,
                &s.zeros,
            )?;
            phases::mark("gate_up gemm", &device);
            launch(
                "silu-mul",
                silu_mul(
                    &self.dev,
                    self.kd,
                    &SiluMulArgs {
                        gate: gu_p,
                        g_stride: 2 * inter,
                        up: gu_p + inter as u64 * el,
                        u_stride: 2 * inter,
                        out: act_p,
                        o_stride: inter,
                        rows: t,
                        cols: inter,
                    },
                )
                .map(|_| ()),
            )?;
            phases::mark("silu-mul", &device);
            let (next_w, normed_out) = match self.layers.get(i + 1) {
                Some(next) => (ptr(&next.in_norm)?, normed_p),
                None => (ptr(&self.inner.norm.weight)?, ptr(&post)?),
            };
            let next_x = row(caps_p, i + 1);
            // caps[i + 1] = mid + act @ Wdown^T, in the epilogue unless the MLP's output is
            // captured on its own (or down has a bias).
            let folded = mlp_out.is_none() && layer.down.b.is_none();
            let down_out = match &mlp_out {
                Some(m) => row(ptr(m)?, i),
                None => proj_p,
            };
            if folded {
                self.gemm_add(&layer.down, (act_p, inter), next_x, t, inter, mid_p)?;
            } else {
                self.gemm(
                    &layer.down,
                    (act_p, inter),
                    (down_out, h),
                    t,
                    inter,
                    &s.zeros,
                )?;
            }
            phases::mark("down gemm", &device);
            launch(
                "residual add + norm",
                add_rmsnorm(
                    &self.dev,
                    self.kd,
                    &RmsNormArgs {
                        x: if folded { next_x } else { mid_p },
                        x_stride: h,
                        delta: (!folded).then_some((down_out, h)),
                        w: next_w,
                        resid: (!folded).then_some((next_x, h)),
                        normed: normed_out,
                        normed_stride: h,
                        rows: t,
                        cols: h,
                        eps,
                    },
                ),
            )?;
            phases::mark("add + norm", &device);
        }

        let mut capture = Capture::default();
        for b in 0..l {
            if want.wants(b) {
                capture
                    .hidden
                    .insert(b, caps.get(b).ctx(|| "capture view".to_string())?);
            }
        }
        if want.final_pre_norm {
            capture.final_pre_norm = Some(caps.get(l).ctx(|| "capture view".to_string())?);
        }
        if want.logits {
            let v = cfg.vocab_size;
            let logits = self.buffer(t, v).ctx(|| "logits".to_string())?;
            let head = Proj {
                w: self.inner.lm_head.clone(),
                b: None,
                n: v,
            };
            self.gemm(&head, (ptr(&post)?, h), (ptr(&logits)?, v), t, h, &s.zeros)?;
            capture.logits = Some(logits);
            phases::mark("lm_head", &device);
        }
        if want.wants(l) {
            capture.hidden.insert(l, post);
        }
        if let Some(m) = mlp_out {
            for i in 0..l {
                capture.extras.insert(
                    format!("mlp_out.{i}"),
                    m.get(i).ctx(|| "capture view".to_string())?,
                );
            }
        }
        Ok(capture)
    }
}

impl Target for FastLlama {
    fn config(&self) -> &ModelConfig {
        self.cfg()
    }

    fn device(&self) -> &Device {
        self.inner.embed.device()
    }

    fn embeddings(&self) -> &dyn EmbedRows {
        &self.inner.embed
    }

    fn forward(
        &self,
        ids: &[u32],
        want: &CaptureRequest,
        progress: &mut Progress,
    ) -> Result<Capture> {
        let capture = self.forward_fast(ids, &[ids.len()], want)?;
        progress.finish();
        Ok(capture)
    }

    /// Consecutive samples packed into forwards of up to `opts.pack_tokens` tokens: short
    /// samples share every weight read and every launch.
    fn forward_many(
        &self,
        samples: &[&[u32]],
        want: &CaptureRequest,
        opts: &ManyOptions,
        sink: &mut Sink,
    ) -> Result<()> {
        let l = self.cfg().num_layers;
        for pack in super::packs(samples, opts.pack_tokens) {
            let ids: Vec<u32> = pack
                .iter()
                .flat_map(|&s| samples[s].iter().copied())
                .collect();
            let lens: Vec<usize> = pack.iter().map(|&s| samples[s].len()).collect();
            let capture = self.forward_fast(&ids, &lens, want)?;
            let mut at = 0;
            for (&s, &len) in pack.iter().zip(&lens) {
                let rows = |t: &Tensor| {
                    t.narrow(0, at, len)
                        .ctx(|| format!("sample {s} of a packed forward"))
                };
                let mut own = Capture::default();
                for (b, t) in &capture.hidden {
                    own.hidden.insert(*b, rows(t)?);
                }
                for (k, t) in &capture.extras {
                    own.extras.insert(k.clone(), rows(t)?);
                }
                own.final_pre_norm = capture.final_pre_norm.as_ref().map(rows).transpose()?;
                own.logits = capture.logits.as_ref().map(rows).transpose()?;
                super::emit_capture(s, own, l, sink)?;
                at += len;
            }
        }
        Ok(())
    }
}
