#!/usr/bin/env python3
"""Joins the HF peer's timings (hf_times.json) and eagle-check's (ours.jsonl) into the
BENCHMARKS.md table: ms for both, eagle-check / HF, eagle-check / roofline floor, the same
forward with the mma.sync attention kernels (the default off sm_90), with the routed experts as
cuBLAS grouped GEMMs (MoE targets; the default off sm_90), and the worst normwise
difference of the compared boundaries."""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
hf = json.loads((out / "hf_times.json").read_text())
ours = [json.loads(line) for line in (out / "ours.jsonl").read_text().splitlines() if line.strip()]
print(f"{hf['shape']}, {hf['params'] / 1e9:.2f}B params, {hf['gpu']}, torch {hf['torch']}, transformers {hf['transformers']}")
print("| T | HF ms | eagle-check ms | eagle-check / HF | floor ms | eagle-check / floor | HF / floor | with mma.sync attention ms | with grouped cuBLAS experts ms | projections only ms (/ floor) | eagle-check / projections only | worst normwise diff | greedy agreement |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
def proj(o):
    p = o.get("projections_only_ms")
    if p is None:
        return "- | -"
    return f"{p:.2f} ({p / o['floor_ms']:.2f}) | {o['ms'] / p:.2f}"


def grouped(o):
    g = o.get("ms_grouped_experts")
    return "-" if g is None else f"{g:.2f}"


for o in ours:
    h = hf["times"][str(o["T"])]["median_ms"]
    c = hf["times"][str(o["T"])].get("compiled_ms")
    print(
        f"| {o['T']} | {h:.2f} | {o['ms']:.2f} | {o['ms'] / h:.2f} | {o['floor_ms']:.2f} | "
        f"{o['ratio_to_floor']:.2f} | {h / o['floor_ms']:.2f} | {o.get('ms_mma_attention', float('nan')):.2f} | "
        f"{grouped(o)} | "
        f"{proj(o)} | "
        f"{o['worst_normwise_err']:.2e} | "
        f"{o['greedy_agreement']:.3f} |"
    )
# With the peer's --compile: HF under torch.compile (inductor), compile time apart.
if any("compiled_ms" in v for v in hf["times"].values()):
    print()
    print("| T | HF eager ms | HF torch.compile ms (compile s) | eagle-check ms | eagle-check / HF eager | eagle-check / HF compiled |")
    print("|---|---|---|---|---|---|")
    for o in ours:
        t = hf["times"][str(o["T"])]
        if "compiled_ms" in t:
            print(
                f"| {o['T']} | {t['median_ms']:.2f} | {t['compiled_ms']:.2f} ({t['compile_s']:.0f}) | {o['ms']:.2f} | "
                f"{o['ms'] / t['median_ms']:.2f} | {o['ms'] / t['compiled_ms']:.2f} |"
            )
# Where the time goes, when the bench ran with EAGLE_CHECK_PHASES=1 (one extra forward, each
# phase closed by a device synchronisation, so the sum exceeds the timed median a little), or
# with EAGLE_CHECK_PHASES=timeline (nothing synchronised: each phase's device and host time).
for o in ours:
    phases = [p for p in o.get("phases") or [] if "phase" in p]
    if phases and "ms" in phases[0]:
        total = sum(p["ms"] for p in phases)
        parts = ", ".join(f"{p['phase']} {p['ms']:.2f} ({p['marks']}x)" for p in phases)
        print(f"T = {o['T']} phases, {total:.2f} ms in all: {parts}")
    elif phases:
        total = sum(p["device_ms"] for p in phases)
        parts = ", ".join(
            f"{p['phase']} {p['device_ms']:.2f} (host {p['host_ms']:.2f}, {p['marks']}x)" for p in phases
        )
        print(f"T = {o['T']} timeline, {total:.2f} ms of device time: {parts}")
# With F32_TRUTH=1: both bf16 forwards against the peer's f32 forward of the same weights.
for o in ours:
    f = o.get("worst_normwise_err_vs_hf_f32")
    h = hf.get("hf_bf16_vs_f32", {}).get(str(o["T"]))
    if f is not None and h is not None:
        print(f"T = {o['T']} against HF f32: eagle-check bf16 {f:.2e}, HF bf16 {h:.2e}")
