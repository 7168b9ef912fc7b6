#!/usr/bin/env python3
"""Loading at the disk's rate on the GPU (issue 30): the step `load` of scripts/gpu-run.sh.

On the GPU machine, from the repository root, with scripts/cuda-build.sh's binaries in bins/:

    python3 benches/gpu/load.py OUT_DIR        (T=2048 by default; --tokens N)

1. benches/gpu/hf_peer.py writes the Llama-3.1-8B-shape random bf16 checkpoint (16.06 GB, one
   safetensors file) to OUT_DIR/model, as the capture bench does.
2. Page cache warm (the file read once first), each measured in this run, in turn:
   - `dd if=FILE of=/dev/null bs=16M`: the peer every load is a ratio to;
   - eagle-check's resident bf16 load onto the GPU alone (`bins/gpu-bench load`, as `run`
     loads it: the default readers), twice, and once with one read at a time
     (`EAGLE_CHECK_READERS=0`: the reader before issue 30), and once with candle's pageable
     copies in place of the pinned staging (`EAGLE_CHECK_PAGEABLE=1`);
   - transformers' `from_pretrained(dir, dtype=bfloat16, device_map="cuda")`, synchronised,
     twice (a fresh Python process each; its imports timed apart);
   - whole processes at T tokens: `eagle-check run --device cuda` (load + capture forward +
     the engine's fc input) against a Python script doing the same with transformers
     (imports, `from_pretrained`, one `output_hidden_states=True` forward), wall time of each.
3. Page cache cold, where the kernel lets this process drop it (`/proc/sys/vm/drop_caches`,
   else `posix_fadvise(DONTNEED)` on the file): dd, our load, transformers' load, and
   `run --stream-layers --max-memory 4GiB` (its weight rate against dd's).
4. Prints one table (seconds, GB/s, ratio to dd and to transformers) and writes
   OUT_DIR/load.json; the 16 GB checkpoint is deleted at the end.

Also the HF side of itself: `load.py --hf-load DIR` and `load.py --hf-run DIR T` (one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def hf_load(model_dir: str) -> dict:
    """transformers' load onto the GPU, synchronised; imports timed apart."""
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM

    torch.cuda.init()
    t1 = time.perf_counter()
    how = 'device_map="cuda"'
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    except (ImportError, ValueError):
        # No accelerate: loaded on the host, then moved (said in the table).
        how = ".to(cuda)"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"import_s": t1 - t0, "load_s": t2 - t1, "how": how, "model": model}


def hf_run(model_dir: str, t: int) -> dict:
    """What `eagle-check run` does, with transformers: load, then one capture forward."""
    import torch

    sys.path.insert(0, str(HERE))
    from hf_peer import token_ids

    out = hf_load(model_dir)
    model = out.pop("model")
    ids = torch.tensor([token_ids(t, model.config.vocab_size)], device="cuda")
    t0 = time.perf_counter()
    with torch.no_grad():
        o = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    torch.cuda.synchronize()
    out["forward_s"] = time.perf_counter() - t0
    out["boundaries"] = len(o.hidden_states)
    return out


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    """Wall time and stdout of a whole process (`run` exits 1 for a finding, not a failure)."""
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    secs = time.perf_counter() - start
    if p.returncode not in (0, 1) or not p.stdout.strip():
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return secs, p.stdout


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def dd(files: list[Path]) -> float:
    start = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "status=none"], check=True)
    return time.perf_counter() - start


def drop_cache(files: list[Path]) -> str:
    """Drops the files from the page cache; says how (or that it could not)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--tokens", type=int, default=int(os.environ.get("T", "2048")))
    ap.add_argument("--bins", default="bins")
    ap.add_argument("--hf-load")
    ap.add_argument("--hf-run", nargs=2)
    args = ap.parse_args()
    if args.hf_load:
        r = hf_load(args.hf_load)
        r.pop("model")
        print(json.dumps(r))
        return
    if args.hf_run:
        print(json.dumps(hf_run(args.hf_run[0], int(args.hf_run[1]))))
        return

    out = Path(args.out or os.environ.get("TMPDIR", "/tmp") + "/eagle-check-gpu-load")
    out.mkdir(parents=True, exist_ok=True)
    bins, t = Path(args.bins), args.tokens
    subprocess.run(
        [sys.executable, str(HERE / "hf_peer.py"), "--shape", "llama3.1-8b", "--out", str(out),
         "--tokens", "128", "--reps", "1", "--warmup", "0"],
        check=True,
    )
    model = out / "model"
    files = sorted(model.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    sys.path.insert(0, str(HERE))
    from hf_peer import token_ids

    (out / "tokens.txt").write_text("\n".join(map(str, token_ids(t, 128256))) + "\n")
    ours_load = [str(bins / "gpu-bench"), "load", str(model)]
    hf_load_cmd = [sys.executable, __file__, "--hf-load", str(model)]
    run_cmd = [str(bins / "eagle-check"), "run", "--target", str(model), "--engine", "vllm",
               "--token-file", str(out / "tokens.txt"), "--device", "cuda", "--format", "json"]
    rows: list[dict] = []

    def row(what: str, cache: str, secs: float, **extra) -> None:
        r = {"what": what, "cache": cache, "seconds": secs, "gb_per_s": size / secs / 1e9, **extra}
        rows.append(r)
        print(json.dumps(r), flush=True)

    # Warm: every file read once, then each measurement in turn.
    dd(files)
    row("dd bs=16M", "warm", dd(files))
    for _ in range(2):
        _, o = timed(ours_load)
        j = last_json(o)
        row(f"eagle-check load ({j['readers']} readers)", "warm", j["seconds"], cuda_init_s=j["cuda_init_seconds"])
    _, o = timed(ours_load, {"EAGLE_CHECK_READERS": "0"})
    row("eagle-check load (one read at a time)", "warm", last_json(o)["seconds"])
    _, o = timed(ours_load, {"EAGLE_CHECK_PAGEABLE": "1"})
    row("eagle-check load (pageable copies, no pinned staging)", "warm", last_json(o)["seconds"])
    for _ in range(2):
        _, o = timed(hf_load_cmd)
        j = last_json(o)
        row(f"transformers from_pretrained ({j['how']})", "warm", j["load_s"], import_s=j["import_s"])
    secs, o = timed(run_cmd)
    row(f"eagle-check run, T = {t} (whole process)", "warm", secs, weights=json.loads(o)["subject"].get("weights"))
    secs, o = timed([sys.executable, __file__, "--hf-run", str(model), str(t)])
    j = last_json(o)
    row(f"transformers load + forward, T = {t} (whole process)", "warm", secs,
        import_s=j["import_s"], load_s=j["load_s"], forward_s=j["forward_s"])

    # Cold, where the cache can be dropped.
    how = drop_cache(files)
    row("dd bs=16M", f"cold ({how})", dd(files))
    drop_cache(files)
    _, o = timed(ours_load)
    j = last_json(o)
    row(f"eagle-check load ({j['readers']} readers)", f"cold ({how})", j["seconds"])
    drop_cache(files)
    _, o = timed(hf_load_cmd)
    j = last_json(o)
    row(f"transformers from_pretrained ({j['how']})", f"cold ({how})", j["load_s"])
    drop_cache(files)
    secs, o = timed(run_cmd + ["--stream-layers", "--max-memory", "4GiB"])
    subject = json.loads(o)["subject"]
    row(f"eagle-check run --stream-layers --max-memory 4GiB, T = {t} (whole process)", f"cold ({how})",
        secs, streaming=subject.get("streaming"), peak=subject.get("peak_memory"))

    # The table: each row against dd and transformers' load of the same cache state.
    def ref(what: str, cache: str) -> float | None:
        return next((r["seconds"] for r in rows if r["what"].startswith(what) and r["cache"] == cache), None)

    print(f"\nload: {size / 1e9:.2f} GB bf16 in {len(files)} file(s), {model}")
    print("| what | cache | s | GB/s | / dd | / transformers |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        d, hf = ref("dd", r["cache"]), ref("transformers from_pretrained", r["cache"])
        if r["what"].startswith("eagle-check run, T"):
            hf = ref("transformers load + forward", r["cache"])
        ratio = lambda x: f"{r['seconds'] / x:.2f}x" if x else "-"  # noqa: E731
        print(f"| {r['what']} | {r['cache']} | {r['seconds']:.2f} | {r['gb_per_s']:.2f} | {ratio(d)} | {ratio(hf)} |")
    (out / "load.json").write_text(json.dumps({"bytes": size, "rows": rows}, indent=1))
    shutil.rmtree(model, ignore_errors=True)
    for f in out.glob("*.safetensors"):
        f.unlink()


if __name__ == "__main__":
    main()
