#!/usr/bin/env python3
"""Seeds for the fuzz targets, from the repository's fixtures (stdlib only, no torch).

Writes fuzz/corpus-raw/<target>/ (ignored by git). Fuzzing grows those folders; the committed,
minimised corpus fuzz/corpus/<target>/ is what `cargo fuzz run <target> ... -merge=1` keeps of
them (see fuzz/README.md). GGUF seeds are written here by hand (the format is four fields, the
metadata and the tensor infos; see ggml's docs/gguf.md) since the tiny GGUF fixtures are made
by the Rust tests at run time.

Usage: python3 fuzz/make_seeds.py
"""

import glob
import os
import shutil
import struct
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fuzz", "corpus-raw")
READERS = os.path.join(ROOT, "fixtures", "captures", "readers")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def copy_glob(target, pattern):
    for p in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
        if p.endswith(".expected.json"):
            continue
        rel = os.path.relpath(p, ROOT).replace(os.sep, "_")
        with open(p, "rb") as f:
            put(target, rel, f.read())


def pickles():
    """Every data.pkl inside the torch fixtures, and the legacy (bare pickle) ones."""
    for p in sorted(glob.glob(os.path.join(READERS, "**", "*"), recursive=True)):
        if not os.path.isfile(p) or p.endswith(".json"):
            continue
        rel = os.path.relpath(p, READERS).replace(os.sep, "_")
        try:
            with zipfile.ZipFile(p) as z:
                for n in z.namelist():
                    if n.endswith("data.pkl"):
                        put("pickle", rel + ".pkl", z.read(n))
        except zipfile.BadZipFile:
            with open(p, "rb") as f:
                head = f.read()
            if head[:1] == b"\x80":
                put("pickle", rel, head)


# ------------------------------------------------------------------------------------ GGUF

GGUF_U32, GGUF_F32, GGUF_STRING, GGUF_ARRAY = 4, 6, 8, 9
GGML_F32 = 0


def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value):
    out = gstr(key) + struct.pack("<I", vtype)
    if vtype == GGUF_U32:
        out += struct.pack("<I", value)
    elif vtype == GGUF_F32:
        out += struct.pack("<f", value)
    elif vtype == GGUF_STRING:
        out += gstr(value)
    elif vtype == GGUF_ARRAY:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        for it in items:
            out += gstr(it) if etype == GGUF_STRING else struct.pack("<I", it)
    return out


def gguf(arch, layers, hidden, heads, vocab, ffn, extra_tensors=()):
    md = [
        kv("general.architecture", GGUF_STRING, arch),
        kv(f"{arch}.block_count", GGUF_U32, layers),
        kv(f"{arch}.embedding_length", GGUF_U32, hidden),
        kv(f"{arch}.attention.head_count", GGUF_U32, heads),
        kv(f"{arch}.attention.head_count_kv", GGUF_U32, heads),
        kv(f"{arch}.feed_forward_length", GGUF_U32, ffn),
        kv(f"{arch}.context_length", GGUF_U32, 64),
        kv(f"{arch}.attention.layer_norm_rms_epsilon", GGUF_F32, 1e-5),
        kv(f"{arch}.rope.freq_base", GGUF_F32, 10000.0),
        kv("tokenizer.ggml.model", GGUF_STRING, "gpt2"),
        kv("tokenizer.ggml.pre", GGUF_STRING, "smollm"),
        kv("tokenizer.ggml.tokens", GGUF_ARRAY, (GGUF_STRING, ["a", "b", "ab", "c"])),
        kv("tokenizer.ggml.merges", GGUF_ARRAY, (GGUF_STRING, ["a b"])),
    ]
    tensors = [("token_embd.weight", [hidden, vocab]), ("output_norm.weight", [hidden])]
    for i in range(layers):
        for name, dims in [
            ("attn_norm.weight", [hidden]),
            ("attn_q.weight", [hidden, hidden]),
            ("attn_k.weight", [hidden, hidden]),
            ("attn_v.weight", [hidden, hidden]),
            ("attn_output.weight", [hidden, hidden]),
            ("ffn_norm.weight", [hidden]),
            ("ffn_gate.weight", [hidden, ffn]),
            ("ffn_up.weight", [hidden, ffn]),
            ("ffn_down.weight", [ffn, hidden]),
        ]:
            tensors.append((f"blk.{i}.{name}", dims))
    tensors.extend(extra_tensors)
    infos, data, offset = b"", b"", 0
    for name, dims in tensors:
        n = 1
        for d in dims:
            n *= d
        infos += gstr(name) + struct.pack("<I", len(dims))
        infos += b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", GGML_F32, offset)
        blob = struct.pack(f"<{n}f", *([0.5] * n))
        blob += b"\0" * (-len(blob) % 32)
        data += blob
        offset += len(blob)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(md)) + b"".join(md) + infos
    head += b"\0" * (-len(head) % 32)
    return head + data


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    pickles()
    copy_glob("npy", "fixtures/captures/readers/**/*.npy")
    copy_glob("npz", "fixtures/captures/readers/**/*.npz")
    copy_glob("safetensors_header", "fixtures/captures/readers/**/*.safetensors")
    copy_glob("spec", "specs/*.yaml")
    copy_glob("spec", "fixtures/specs/*.yaml")
    copy_glob("spec", "fixtures/bundles/*/spec.yaml")
    copy_glob("config", "fixtures/real-configs/*.json")
    copy_glob("config", "fixtures/models/*/config.json")
    for arch in ("llama", "qwen2", "qwen3"):
        put("gguf", f"tiny-{arch}.gguf", gguf(arch, 1, 4, 2, 4, 8))
    put("gguf", "tiny-llama-2layers.gguf", gguf("llama", 2, 4, 1, 4, 4))
    for t in sorted(os.listdir(OUT)):
        print(t, len(os.listdir(os.path.join(OUT, t))))


if __name__ == "__main__":
    main()
