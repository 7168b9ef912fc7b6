#!/usr/bin/env python3
"""The HF transformers peer of `cargo bench --bench gpu --features cuda` (benches/gpu/run.sh).

Builds a random-weight target of a real model's shape in bf16 on the GPU, saves it as an HF
directory (safetensors) for eagle-check to load, then times HF's capture forward
(`output_hidden_states=True`, sdpa, batch 1) at each sequence length and keeps a few of its
boundaries so that eagle-check's can be compared with them.

    python3 benches/gpu/hf_peer.py --shape llama3.1-8b --out DIR --tokens 128,512,2048,8192

Writes DIR/model/ (config.json, model.safetensors), DIR/hf_times.json (median of --reps
timed forwards after --warmup, CUDA events around each) and DIR/hf_states.safetensors
(`t{T}.b{b}` for the boundaries listed in hf_times.json, and `t{T}.logits_argmax`).
Token ids: ids[i] = (1103515245 * i + 12345) mod 2^31 mod vocab, the bench binary's too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    DeepseekV3Config,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Llama4ForCausalLM,
    Llama4TextConfig,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

SHAPES = {
    # Llama-3.1-8B (the shape of the HF table).
    "llama3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=False,
    ),
    # DeepSeek-V3 at full width, 1 dense + 2 MoE layers (25.5B params; the anchor).
    "deepseek-v3-3l": dict(
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=129280,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    ),
    # Qwen3-30B-A3B at full size (48 layers, 128 experts, top-8; 30.5B params, 61 GB in bf16).
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        tie_word_embeddings=False,
    ),
    # gpt-oss-20b at full size (24 layers alternating 128-token windows and full attention,
    # sinks, 32 experts, top-4, YaRN; 20.9B params, bf16 experts here rather than MXFP4).
    "gpt-oss-20b": dict(
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        attention_bias=True,
        swiglu_limit=7.0,
        vocab_size=201088,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=4096,
            truncate=False,
        ),
        tie_word_embeddings=False,
    ),
    # Gemma-3-27B's text model at full width (62 layers in the real one; --layers N for fewer).
    "gemma3-27b": dict(
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168,
        sliding_window=1024,
        layer_types=None,
        vocab_size=262208,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
    ),
    # Llama-4-Scout's text model at full width (48 layers, 16 experts top-1 and a shared expert
    # on every layer, chunked attention with NoPE every 4th layer; --layers N for fewer).
    "llama4-scout": dict(
        hidden_size=5120,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=8192,
        use_qk_norm=True,
        no_rope_layers=None,
        vocab_size=202048,
        max_position_embeddings=10485760,
        rms_norm_eps=1e-5,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=16.0,
            low_freq_factor=1.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=False,
    ),
}
CLASSES = {
    "llama3.1-8b": (LlamaConfig, LlamaForCausalLM),
    "deepseek-v3-3l": (DeepseekV3Config, DeepseekV3ForCausalLM),
    "qwen3-30b-a3b": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "gpt-oss-20b": (GptOssConfig, GptOssForCausalLM),
    "gemma3-27b": (Gemma3TextConfig, Gemma3ForCausalLM),
    "llama4-scout": (Llama4TextConfig, Llama4ForCausalLM),
}
# gpt-oss has no sdpa path in transformers (`GptOssPreTrainedModel._supports_sdpa = False`).
ATTENTION = {"gpt-oss-20b": "eager"}


def token_ids(t: int, vocab: int) -> list[int]:
    return [((1103515245 * i + 12345) % (1 << 31)) % vocab for i in range(t)]


def compiled_times(model, ids, warmup: int, reps: int) -> dict:
    """The capture forward under torch.compile (inductor, static shapes: one graph per T), the
    first call's compile time apart, then the median of `reps` timed calls."""
    compiled = torch.compile(model, dynamic=False)
    run = lambda: compiled(input_ids=ids, output_hidden_states=True, use_cache=False)  # noqa: E731
    with torch.no_grad():
        t0 = time.time()
        run()
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        for _ in range(warmup):
            run()
        ms = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
    print(f"hf_peer: T = {ids.shape[1]}: compiled {statistics.median(ms):.2f} ms (compile {compile_s:.1f} s)", flush=True)
    return {"compiled_ms": statistics.median(ms), "compile_s": compile_s}


def write_captures(model, cfg, root: Path, args) -> None:
    """SpecForge's offline files (`rows_0-N/data_i.ckpt`: `input_ids`, `loss_mask`,
    `aux_hidden_state` [1, S, 3H] at b = [2, L//2, L-3] (every inner boundary below 6 layers),
    SpecForge's default `[1, L//2-1, L-4]` read OUT, and `hidden_state` [1, S, H] after the
    final norm, bf16) of the
    model's own states for `--capture-distinct` random sequences per length, hard-linked up to
    `--capture-samples` files, and the spec they follow."""
    L, vocab = cfg.num_hidden_layers, cfg.vocab_size
    # A shape of a few layers (DeepSeek-V3's 3) has no three distinct inner boundaries: it
    # captures every inner one.
    bs = [2, L // 2, L - 3] if L >= 6 else list(range(1, L))
    gen = torch.Generator().manual_seed(1234)
    for t in [int(x) for x in args.capture_tokens.split(",")]:
        d = root / f"t{t}"
        rows = d / f"rows_0-{args.capture_samples}"
        rows.mkdir(parents=True, exist_ok=True)
        for i in range(args.capture_distinct):
            ids = torch.randint(0, vocab, (1, t), generator=gen).cuda()
            with torch.no_grad():
                o = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            aux = torch.cat([o.hidden_states[b] for b in bs], dim=-1).to(torch.bfloat16).cpu()
            torch.save(
                {
                    "input_ids": ids[0].cpu(),
                    "loss_mask": torch.ones(t, dtype=torch.int64),
                    "aux_hidden_state": aux,
                    "hidden_state": o.hidden_states[L].to(torch.bfloat16).cpu(),
                },
                rows / f"data_{i}.ckpt",
            )
            del o
        for i in range(args.capture_distinct, args.capture_samples):
            (rows / f"data_{i}.ckpt").hardlink_to(rows / f"data_{i % args.capture_distinct}.ckpt")
        (d / "spec.yaml").write_text(
            f"name: bench-t{t}\ntarget: {{ num_hidden_layers: {L}, hidden_size: {cfg.hidden_size} }}\n"
            f"capture: {{ boundaries: {bs} }}\n"
        )
        print(f"hf_peer: T = {t}: {args.capture_samples} SpecForge captures in {rows}", flush=True)
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="128,512,2048,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (0: all)")
    ap.add_argument(
        "--f32-truth",
        action="store_true",
        help="after timing, run the same weights in f32 and keep those states too (f32.t{T}.b{b}): "
        "which bf16 forward is nearer the f32 one",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also time the same forward under torch.compile (inductor; compile time excluded, "
        "reported apart): the strongest peer plain Python gives",
    )
    ap.add_argument(
        "--captures",
        default="",
        help="write SpecForge-format training captures (rows_0-N/data_i.ckpt) of the model's own "
        "states under DIR/t{T}/ for each --capture-tokens length, and a spec.yaml beside them",
    )
    ap.add_argument("--capture-tokens", default="128,512,2048")
    ap.add_argument("--capture-samples", type=int, default=256)
    ap.add_argument("--capture-distinct", type=int, default=8)
    args = ap.parse_args()
    out = Path(args.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    config_cls, model_cls = CLASSES[args.shape]
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    cfg = config_cls(**shape)
    t0 = time.time()
    with torch.device("cuda"):
        model = model_cls._from_config(
            cfg, attn_implementation=ATTENTION.get(args.shape, "sdpa"), dtype=torch.bfloat16
        )
    # transformers' init; then a scale that keeps the residual stream finite over 32 layers.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.9, 1.1)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # spread the scores
                p.normal_(0.0, 0.25 / p.shape[-1] ** 0.5 * 8)
            elif name.endswith("self_attn.sinks"):
                p.normal_(0.0, 1.0)
            elif p.dim() == 3:  # stacked experts [E, in, out] or [E, out, in]: fan-in is H or I
                p.normal_(0.0, min(0.02, 0.8 / min(p.shape[1], p.shape[2]) ** 0.5))
            else:
                p.normal_(0.0, min(0.02, 0.8 / p.shape[-1] ** 0.5))
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    # Tied weights (Gemma-3's lm_head is its embedding) are saved once, under the first name,
    # as save_pretrained does: safetensors refuses two names over one storage.
    tensors, seen = {}, set()
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        tensors[k] = v.contiguous()
    save_file(tensors, str(out / "model" / "model.safetensors"))
    cfg.save_pretrained(out / "model")
    print(f"hf_peer: {args.shape}: {params / 1e9:.2f}B params, built and saved in {time.time() - t0:.1f} s", flush=True)

    L = cfg.num_hidden_layers
    keep = sorted({0, 1, L // 2, L - 1, L})
    times, states = {}, {}
    for t in [int(x) for x in args.tokens.split(",")]:
        ids = torch.tensor([token_ids(t, cfg.vocab_size)], device="cuda")
        run = lambda: model(input_ids=ids, output_hidden_states=True, use_cache=False)  # noqa: E731
        with torch.no_grad():
            for _ in range(args.warmup):
                run()
            ms = []
            for _ in range(args.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                o = run()
                end.record()
                torch.cuda.synchronize()
                ms.append(start.elapsed_time(end))
        times[str(t)] = {"median_ms": statistics.median(ms), "all_ms": ms}
        if args.compile:
            times[str(t)].update(compiled_times(model, ids, args.warmup, args.reps))
        for b in keep:
            states[f"t{t}.b{b}"] = o.hidden_states[b][0].contiguous()
        states[f"t{t}.logits_argmax"] = o.logits[0].argmax(-1).to(torch.int64).contiguous()
        print(f"hf_peer: T = {t}: {statistics.median(ms):.2f} ms (median of {args.reps})", flush=True)
        del o
        torch.cuda.empty_cache()
    bf16_vs_f32 = {}
    if args.f32_truth:
        # The same weights in f32 (bf16 values are exact in f32), eager attention as before: the
        # forward both bf16 runs approximate. How far HF's own bf16 run is from it says how far
        # eagle-check's may be.
        model.float()
        torch.cuda.empty_cache()
        for t in [int(x) for x in args.tokens.split(",")]:
            ids = torch.tensor([token_ids(t, cfg.vocab_size)], device="cuda")
            with torch.no_grad():
                o = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            worst = 0.0
            for b in keep:
                truth = o.hidden_states[b][0].contiguous()
                states[f"f32.t{t}.b{b}"] = truth
                d = (states[f"t{t}.b{b}"].double() - truth.double()).norm() / truth.double().norm()
                worst = max(worst, d.item())
            bf16_vs_f32[str(t)] = worst
            print(f"hf_peer: T = {t}: HF bf16 vs HF f32, worst normwise {worst:.3e}", flush=True)
            del o
            torch.cuda.empty_cache()
    save_file(states, str(out / "hf_states.safetensors"))
    if args.captures:
        write_captures(model, cfg, Path(args.captures), args)
    meta = {
        "shape": args.shape,
        "params": params,
        "layers": L,
        "kept_boundaries": keep,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "gpu": torch.cuda.get_device_name(0),
        "times": times,
        "hf_bf16_vs_f32": bf16_vs_f32,
    }
    (out / "hf_times.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
