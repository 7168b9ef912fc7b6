#!/usr/bin/env python3
"""benches/gpu/stream.sh's comparison: the streamed GPU dump against the resident one (every
key; bitwise where the same kernels ran, else normwise) and both against transformers'
boundaries (hf_states.safetensors), with each run's subject lines (weights, streaming, peak)."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

out, t = Path(sys.argv[1]), int(sys.argv[2])
resident = load_file(str(out / "resident.safetensors"))
streamed = load_file(str(out / "streamed.safetensors"))
hf = load_file(str(out / "hf_states.safetensors"))


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


worst_pair, bitwise = 0.0, True
for k in sorted(resident):
    a, b = resident[k], streamed[k]
    same = a.shape == b.shape and torch.equal(a, b)
    bitwise &= same
    if a.is_floating_point():
        worst_pair = max(worst_pair, normwise(b, a))
print(f"streamed vs resident: {len(resident)} keys, bitwise equal: {bitwise}, worst normwise {worst_pair:.2e}")
for name, d in (("resident", resident), ("streamed", streamed)):
    errs = {}
    for key, ref in hf.items():
        if key.startswith(f"t{t}.b"):
            b = key.split(".b")[1]
            errs[b] = normwise(d[f"hidden_states.{b}"].float(), ref.float())
    print(f"{name} vs transformers (normwise, b: err): " + ", ".join(f"{b}: {e:.2e}" for b, e in sorted(errs.items(), key=lambda x: int(x[0]))))
    subject = json.loads((out / f"{name}.json").read_text())["subject"]
    for key in ("device", "weights", "streaming", "peak_memory"):
        if key in subject:
            print(f"  {name} {key}: {subject[key]}")
