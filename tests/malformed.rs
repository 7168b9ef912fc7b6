//! The reliability campaign (issue 13 item 2): malformed inputs on every surface eagle-check
//! reads, driven through the real binary. Each must be refused as "could not check": exit 2,
//! nothing on stdout, one line on stderr that names the file and the problem. Never a panic
//! (which prints `panicked`), never a payload run, never an allocation of what a header
//! declares before it is checked against the file.
//!
//! Every file is generated here, in a scratch folder under target/, from a few bytes or from a
//! shipped fixture; nothing malformed is committed. `MARKER`-style payloads try to create a file
//! that must not exist afterwards.

use crate::support::{Output, eagle_check, fixture, p, root, scratch};
use std::io::Write;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// Running and judging.

/// Asserts a refusal; the case name is printed first so that a failure says which case broke.
fn refused(case: &str, out: &Output, needles: &[&str]) {
    eprintln!("case: {case}\n  -> {}", out.stderr.trim_end());
    assert!(
        !out.stderr.contains("panicked"),
        "{case}: panicked\n{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("RUST_BACKTRACE"),
        "{case}: {}",
        out.stderr
    );
    out.assert_could_not_check(needles);
}

/// The file name, as the refusal must spell it.
fn name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

const GATE_SPEC: &str = "fixtures/bundles/tiny-llama/spec.yaml";
const DRAFT_CONFIG: &str = "bundles/tiny-llama/draft/config.json";
const DIFF_SPEC: &str = "fixtures/captures/corpus/llama/spec.yaml";

fn gate(spec: &Path, draft: &Path, target: Option<&Path>) -> Output {
    let mut args = vec![
        "gate".to_string(),
        "--spec".into(),
        p(spec),
        "--draft".into(),
        p(draft),
        "--engine".into(),
        "sglang".into(),
    ];
    if let Some(t) = target {
        args.extend(["--target".to_string(), p(t)]);
    }
    eagle_check(args)
}

/// `gate` on the shipped spec with the draft at `draft`.
fn gate_draft(draft: &Path) -> Output {
    gate(&root().join(GATE_SPEC), draft, None)
}

/// `diff` of `captures` against the tiny Llama target.
fn diff(captures: &Path) -> Output {
    eagle_check([
        "diff".to_string(),
        "--spec".into(),
        p(&root().join(DIFF_SPEC)),
        "--target".into(),
        p(&fixture("models/llama")),
        "--captures".into(),
        p(captures),
    ])
}

/// `run` on the shipped bundle with `args` added.
fn run_bundle(args: &[&str]) -> Output {
    let mut all = vec![
        "run".to_string(),
        p(&fixture("bundles/tiny-llama")),
        "--device".into(),
        "cpu".into(),
    ];
    all.extend(args.iter().map(|a| a.to_string()));
    eagle_check(all)
}

// ---------------------------------------------------------------------------------------------
// Writers.

/// A safetensors file from a header text and `data` zero bytes.
fn st(header: &str, data: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.resize(b.len() + data, 0);
    b
}

/// A one-entry safetensors header.
fn st1(dtype: &str, shape: &str, begin: u64, end: u64) -> String {
    format!(r#"{{"w":{{"dtype":"{dtype}","shape":{shape},"data_offsets":[{begin},{end}]}}}}"#)
}

/// A draft directory: the tiny bundle's draft config and `weights` as model.safetensors.
fn draft_with_weights(dir: &Path, weights: &[u8]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(fixture(DRAFT_CONFIG), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("model.safetensors"), weights).unwrap();
    dir.to_path_buf()
}

/// A capture safetensors file from named f32/i64 tensors (shape, dtype); data zeroed.
fn capture_st(tensors: &[(&str, &str, &[usize])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape) in tensors {
        let size = match *dtype {
            "I64" | "F64" => 8,
            "F32" | "I32" => 4,
            _ => 2,
        };
        let n = shape.iter().product::<usize>() * size;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    st(&serde_json::Value::Object(header).to_string(), offset)
}

/// A `.npy` (format 1.0) from a header dict literal and raw data.
fn npy(dict: &str, data: &[u8]) -> Vec<u8> {
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    let mut h = dict.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    b.extend_from_slice(&(h.len() as u16).to_le_bytes());
    b.extend_from_slice(h.as_bytes());
    b.extend_from_slice(data);
    b
}

/// A zip archive of (name, bytes, deflated?) members.
fn zip_of(members: &[(&str, &[u8], bool)]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (member, bytes, deflate) in members {
        let method = if *deflate {
            zip::CompressionMethod::Deflated
        } else {
            zip::CompressionMethod::Stored
        };
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(method)
            .large_file(bytes.len() >= u32::MAX as usize);
        w.start_file(*member, opts).unwrap();
        w.write_all(bytes).unwrap();
    }
    w.finish().unwrap().into_inner()
}

/// A torch.save zip: `archive/data.pkl`, `archive/byteorder`, `archive/data/<key>`.
fn torch_zip(pkl: &[u8], storages: &[(&str, &[u8])]) -> Vec<u8> {
    let mut members: Vec<(String, &[u8], bool)> = vec![
        ("archive/data.pkl".into(), pkl, false),
        ("archive/byteorder".into(), b"little", false),
    ];
    for (key, bytes) in storages {
        members.push((format!("archive/data/{key}"), bytes, false));
    }
    let refs: Vec<(&str, &[u8], bool)> = members
        .iter()
        .map(|(n, b, d)| (n.as_str(), *b, *d))
        .collect();
    zip_of(&refs)
}

/// Pickle opcodes (protocol 2), enough for tensor dicts and for hostile streams.
#[derive(Default)]
struct Pickle(Vec<u8>);

impl Pickle {
    fn new() -> Pickle {
        Pickle(b"\x80\x02".to_vec())
    }
    fn op(mut self, bytes: &[u8]) -> Pickle {
        self.0.extend_from_slice(bytes);
        self
    }
    fn str(self, s: &str) -> Pickle {
        let mut b = vec![b'X'];
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
        self.op(&b)
    }
    fn int(self, i: i64) -> Pickle {
        if (0..256).contains(&i) {
            self.op(&[b'K', i as u8])
        } else if i32::try_from(i).is_ok() {
            let mut b = vec![b'J'];
            b.extend_from_slice(&(i as i32).to_le_bytes());
            self.op(&b)
        } else {
            let mut b = vec![0x8a, 8];
            b.extend_from_slice(&i.to_le_bytes());
            self.op(&b)
        }
    }
    fn global(self, module: &str, name: &str) -> Pickle {
        self.op(format!("c{module}\n{name}\n").as_bytes())
    }
    fn ints(self, xs: &[i64]) -> Pickle {
        let mut s = self.op(b"(");
        for &x in xs {
            s = s.int(x);
        }
        s.op(b"t")
    }
    /// `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())`.
    fn tensor(self, storage: &str, key: &str, numel: i64, size: &[i64], stride: &[i64]) -> Pickle {
        self.global("torch._utils", "_rebuild_tensor_v2")
            .op(b"((")
            .str("storage")
            .global("torch", storage)
            .str(key)
            .str("cpu")
            .int(numel)
            .op(b"tQ")
            .int(0)
            .ints(size)
            .ints(stride)
            .op(b"\x89")
            .global("collections", "OrderedDict")
            .op(b")Rt")
            .op(b"R")
    }
    fn done(self) -> Vec<u8> {
        let mut b = self.0;
        b.push(b'.');
        b
    }
}

/// A dict of tensors as a torch zip: (key, storage type, elements, shape), each on its own
/// zero-filled storage of exactly the right size.
fn torch_dict(entries: &[(&str, &str, &[i64])]) -> Vec<u8> {
    let mut pk = Pickle::new().op(b"}(");
    let mut storages: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, (key, storage, shape)) in entries.iter().enumerate() {
        let numel: i64 = shape.iter().product();
        let mut stride = vec![1i64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            stride[d] = stride[d + 1] * shape[d + 1];
        }
        let size = if *storage == "LongStorage" { 8 } else { 4 };
        pk = pk
            .str(key)
            .tensor(storage, &i.to_string(), numel, shape, &stride);
        storages.push((i.to_string(), vec![0u8; numel as usize * size]));
    }
    let pkl = pk.op(b"u").done();
    let refs: Vec<(&str, &[u8])> = storages
        .iter()
        .map(|(k, b)| (k.as_str(), b.as_slice()))
        .collect();
    torch_zip(&pkl, &refs)
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

// GGUF, by hand (ggml docs/gguf.md): magic, version, tensor count, metadata count, metadata,
// tensor infos, padding to the alignment, data.
const GGUF_U32: u32 = 4;
const GGUF_F32: u32 = 6;
const GGUF_STRING: u32 = 8;

fn gstr(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

fn gkv(key: &str, vtype: u32, value: &[u8]) -> Vec<u8> {
    let mut b = gstr(key);
    b.extend_from_slice(&vtype.to_le_bytes());
    b.extend_from_slice(value);
    b
}

/// A tiny valid llama GGUF (1 layer, hidden 4, vocab 4, f32), with `edit` applied to its
/// metadata list and tensor list before writing.
fn gguf_with(edit: impl FnOnce(&mut Vec<Vec<u8>>, &mut Vec<(String, Vec<u64>, u32)>)) -> Vec<u8> {
    let u32v = |x: u32| x.to_le_bytes().to_vec();
    let mut md = vec![
        gkv("general.architecture", GGUF_STRING, &gstr("llama")),
        gkv("llama.block_count", GGUF_U32, &u32v(1)),
        gkv("llama.embedding_length", GGUF_U32, &u32v(4)),
        gkv("llama.attention.head_count", GGUF_U32, &u32v(2)),
        gkv("llama.feed_forward_length", GGUF_U32, &u32v(8)),
        gkv(
            "llama.attention.layer_norm_rms_epsilon",
            GGUF_F32,
            &1e-5f32.to_le_bytes(),
        ),
    ];
    let mut tensors: Vec<(String, Vec<u64>, u32)> = vec![
        ("token_embd.weight".into(), vec![4, 4], 0),
        ("output_norm.weight".into(), vec![4], 0),
    ];
    for (n, dims) in [
        ("attn_norm.weight", vec![4]),
        ("attn_q.weight", vec![4, 4]),
        ("attn_k.weight", vec![4, 4]),
        ("attn_v.weight", vec![4, 4]),
        ("attn_output.weight", vec![4, 4]),
        ("ffn_norm.weight", vec![4]),
        ("ffn_gate.weight", vec![4, 8]),
        ("ffn_up.weight", vec![4, 8]),
        ("ffn_down.weight", vec![8, 4]),
    ] {
        tensors.push((format!("blk.0.{n}"), dims, 0));
    }
    edit(&mut md, &mut tensors);
    gguf_raw(3, tensors.len() as u64, &md, &tensors)
}

fn gguf_raw(
    version: u32,
    n_tensors: u64,
    md: &[Vec<u8>],
    tensors: &[(String, Vec<u64>, u32)],
) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&(md.len() as u64).to_le_bytes());
    for kv in md {
        b.extend_from_slice(kv);
    }
    let mut offset = 0u64;
    let mut data = 0u64;
    for (name, dims, dtype) in tensors {
        b.extend_from_slice(&gstr(name));
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&dtype.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
        let n = dims
            .iter()
            .fold(4u64, |a, &d| a.saturating_mul(d))
            .min(1 << 20);
        let padded = n.div_ceil(32) * 32;
        offset = offset.saturating_add(padded);
        data += padded;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.resize(b.len() + data as usize, 0);
    b
}

// ---------------------------------------------------------------------------------------------
// safetensors: one file.

#[test]
fn safetensors_weights_that_lie_are_refused_naming_the_file() {
    let dir = scratch("malformed-st");
    let huge_shape = format!("[{},{}]", 1u64 << 40, 1u64 << 40);
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        ("empty", Vec::new(), &["too short"]),
        ("shorter than the length", vec![1, 0, 0], &["too short"]),
        (
            "header length past every limit",
            u64::MAX.to_le_bytes().to_vec(),
            &["exceeds the limit"],
        ),
        (
            "header length past the end",
            {
                let mut b = 4096u64.to_le_bytes().to_vec();
                b.extend_from_slice(b"{}");
                b
            },
            &["runs past the end of the file"],
        ),
        (
            "header not JSON",
            st("{\"w\": nope", 0),
            &["not a JSON object"],
        ),
        (
            "header a JSON list",
            st("[1, 2]", 0),
            &["not a JSON object"],
        ),
        (
            "header not UTF-8",
            {
                let mut b = 4u64.to_le_bytes().to_vec();
                b.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
                b
            },
            &["not a JSON object"],
        ),
        (
            "shape lie",
            st(&st1("F32", "[4096,4096]", 0, 16), 16),
            &["declares 4096x4096 F32 (67108864 bytes)", "hold 16 bytes"],
        ),
        (
            "dtype lie",
            st(&st1("F33", "[4]", 0, 16), 16),
            &["dtype \"F33\"", "not a safetensors dtype"],
        ),
        (
            "dtype not a string",
            st(r#"{"w":{"dtype":4,"shape":[4],"data_offsets":[0,16]}}"#, 16),
            &["tensor w: malformed header entry"],
        ),
        (
            "offsets past the end",
            st(&st1("F32", "[4]", 1 << 30, (1 << 30) + 16), 16),
            &["lie outside the 16 bytes of data"],
        ),
        (
            "offsets reversed",
            st(&st1("F32", "[0]", 16, 0), 16),
            &["lie outside"],
        ),
        (
            "shape overflows",
            st(&st1("F32", &huge_shape, 0, 16), 16),
            &["whose size overflows"],
        ),
        (
            "negative dim",
            st(&st1("F32", "[-4]", 0, 16), 16),
            &["tensor w: malformed header entry"],
        ),
        (
            "three offsets",
            st(
                r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,8,16]}}"#,
                16,
            ),
            &["malformed header entry"],
        ),
        (
            "overlapping offsets",
            st(
                r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#,
                24,
            ),
            &["tensors a [0, 16] and b [8, 24] overlap"],
        ),
        (
            "one region under two names",
            st(
                r#"{"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
                16,
            ),
            &["overlap in the data section"],
        ),
        (
            "duplicate key",
            st(
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
                16,
            ),
            &["names tensor w twice"],
        ),
        (
            "metadata not strings",
            st(r#"{"__metadata__":{"format":1}}"#, 0),
            &["__metadata__ entry format is 1, not a string"],
        ),
    ];
    for (i, (case, bytes, needles)) in cases.into_iter().enumerate() {
        let draft = draft_with_weights(&dir.join(format!("d{i}")), &bytes);
        let file = draft.join("model.safetensors");
        let mut all = vec!["model.safetensors"];
        all.extend_from_slice(needles);
        refused(case, &gate_draft(&draft), &all);
        assert!(file.exists());
    }
}

// ---------------------------------------------------------------------------------------------
// safetensors: sharded directories.

#[test]
fn sharded_indexes_that_point_nowhere_or_outside_are_refused() {
    let dir = scratch("malformed-shards");
    let good = st(&st1("F32", "[4]", 0, 16), 16);
    let index = |map: &str| format!(r#"{{"metadata":{{}},"weight_map":{map}}}"#);
    type Shards = Vec<(&'static str, Vec<u8>)>;
    let cases: Vec<(&str, String, Shards, &[&str])> = vec![
        (
            "missing shard",
            index(r#"{"w":"model-00001-of-00002.safetensors"}"#),
            vec![],
            &[
                "model.safetensors.index.json",
                "names shard model-00001-of-00002.safetensors, which does not exist",
            ],
        ),
        (
            "shard outside the directory",
            index(r#"{"w":"../outside.safetensors"}"#),
            vec![],
            &[
                "model.safetensors.index.json",
                "shard name `../outside.safetensors` leaves the model directory",
            ],
        ),
        (
            "absolute shard path",
            index(r#"{"w":"/etc/passwd"}"#),
            vec![],
            &["model.safetensors.index.json", "leaves the model directory"],
        ),
        (
            "index not JSON",
            "{\"weight_map\": ".to_string(),
            vec![],
            &["model.safetensors.index.json", "not valid JSON"],
        ),
        (
            "weight_map of numbers",
            index(r#"{"w":3}"#),
            vec![],
            &["model.safetensors.index.json", "not valid JSON"],
        ),
        (
            "one tensor in two shards",
            index(r#"{"w":"a.safetensors","v":"b.safetensors"}"#),
            vec![
                ("a.safetensors", good.clone()),
                ("b.safetensors", good.clone()),
            ],
            &["b.safetensors", "tensor w also appears in", "a.safetensors"],
        ),
        (
            "a truncated shard",
            index(r#"{"w":"a.safetensors"}"#),
            vec![("a.safetensors", good[..20].to_vec())],
            &["a.safetensors", "runs past the end of the file"],
        ),
    ];
    for (i, (case, index_text, shards, needles)) in cases.into_iter().enumerate() {
        let d = draft_with_weights(&dir.join(format!("d{i}")), &[]);
        std::fs::remove_file(d.join("model.safetensors")).unwrap();
        std::fs::write(d.join("model.safetensors.index.json"), index_text).unwrap();
        for (shard, bytes) in shards {
            std::fs::write(d.join(shard), bytes).unwrap();
        }
        refused(case, &gate_draft(&d), needles);
    }
}

// ---------------------------------------------------------------------------------------------
// config.json, draft and target.

/// The tiny draft config with `edit` applied to its JSON.
fn draft_config(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let text = std::fs::read_to_string(fixture(DRAFT_CONFIG)).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut v);
    v.to_string()
}

fn target_config(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let text = std::fs::read_to_string(fixture("models/llama/config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut v);
    v.to_string()
}

#[test]
fn draft_configs_with_missing_zero_absurd_or_mistyped_dims_are_refused() {
    use serde_json::json;
    let dir = scratch("malformed-draft-config");
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "missing hidden_size",
            draft_config(|v| {
                v.as_object_mut().unwrap().remove("hidden_size");
            }),
            &["missing required key `hidden_size`"],
        ),
        (
            "zero hidden_size",
            draft_config(|v| v["hidden_size"] = json!(0)),
            &["`hidden_size` must be positive, found 0"],
        ),
        (
            "zero heads",
            draft_config(|v| v["num_attention_heads"] = json!(0)),
            &["`num_attention_heads` must be positive, found 0"],
        ),
        (
            "absurd hidden_size",
            draft_config(|v| v["hidden_size"] = json!(1u64 << 62)),
            &["`hidden_size` is 4611686018427387904, more than eagle-check accepts (16777216)"],
        ),
        (
            "absurd vocabulary",
            draft_config(|v| v["draft_vocab_size"] = json!(u64::MAX)),
            &["`draft_vocab_size` is 18446744073709551615, more than eagle-check accepts"],
        ),
        (
            "hidden_size past u64",
            draft_config(|v| v["hidden_size"] = json!(1e30)),
            &["not valid JSON", "floating point `1e+30`, expected usize"],
        ),
        (
            "hidden_size a string",
            draft_config(|v| v["hidden_size"] = json!("64")),
            &["not valid JSON", "invalid type: string"],
        ),
        (
            "hidden_size negative",
            draft_config(|v| v["hidden_size"] = json!(-64)),
            &["not valid JSON", "invalid value"],
        ),
        (
            "ids past any model",
            draft_config(|v| {
                v["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = json!([1, i64::MAX, 3])
            }),
            &["eagle_aux_hidden_state_layer_ids holds 9223372036854775807"],
        ),
        (
            "ids hugely negative",
            draft_config(|v| {
                v["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = json!([i64::MIN, 2, 3])
            }),
            &["eagle_aux_hidden_state_layer_ids holds -9223372036854775808"],
        ),
        (
            "ids not a list",
            draft_config(|v| {
                v["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = json!("1,2,3")
            }),
            &["not valid JSON"],
        ),
        (
            "architectures of another model",
            draft_config(|v| v["architectures"] = json!(["BertModel"])),
            &["not an EAGLE-3 draft config"],
        ),
        (
            "not JSON",
            "{\"hidden_size\": 64,".to_string(),
            &["not valid JSON"],
        ),
        ("a JSON list", "[1, 2, 3]".to_string(), &["not valid JSON"]),
        (
            "nested past serde's recursion limit",
            format!("{}1{}", "{\"x\":".repeat(100_000), "}".repeat(100_000)),
            &["not valid JSON", "recursion limit"],
        ),
    ];
    for (i, (case, text, needles)) in cases.into_iter().enumerate() {
        let d = dir.join(format!("d{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let cfg = d.join("config.json");
        std::fs::write(&cfg, text).unwrap();
        let mut all = vec!["config.json"];
        all.extend_from_slice(needles);
        refused(case, &gate_draft(&cfg), &all);
    }
}

#[test]
fn target_configs_with_missing_zero_absurd_or_mistyped_dims_are_refused() {
    use serde_json::json;
    let dir = scratch("malformed-target-config");
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "missing layer count",
            target_config(|v| {
                v.as_object_mut().unwrap().remove("num_hidden_layers");
            }),
            &["missing required key `num_hidden_layers`"],
        ),
        (
            "zero layers",
            target_config(|v| v["num_hidden_layers"] = json!(0)),
            &["`num_hidden_layers` must be positive, found 0"],
        ),
        (
            "a trillion layers",
            target_config(|v| v["num_hidden_layers"] = json!(1u64 << 40)),
            &["`num_hidden_layers` is 1099511627776, more than eagle-check accepts (65536)"],
        ),
        (
            "absurd hidden size in text_config",
            target_config(|v| v["text_config"] = json!({"hidden_size": 1u64 << 50})),
            &["`hidden_size` is 1125899906842624, more than eagle-check accepts"],
        ),
        (
            "layers a float",
            target_config(|v| v["num_hidden_layers"] = json!(5.5)),
            &["not valid JSON", "invalid type: floating point"],
        ),
        (
            "model_type a number",
            target_config(|v| v["model_type"] = json!(7)),
            &["not valid JSON"],
        ),
        ("empty file", String::new(), &["not valid JSON", "EOF"]),
    ];
    for (i, (case, text, needles)) in cases.into_iter().enumerate() {
        let d = dir.join(format!("t{i}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), text).unwrap();
        let mut all = vec!["config.json"];
        all.extend_from_slice(needles);
        let out = gate(&root().join(GATE_SPEC), &fixture(DRAFT_CONFIG), Some(&d));
        refused(case, &out, &all);
    }
    // A target directory with no config.json at all.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = gate(
        &root().join(GATE_SPEC),
        &fixture(DRAFT_CONFIG),
        Some(&empty),
    );
    refused("no config.json", &out, &["config.json", "No such file"]);
}

// ---------------------------------------------------------------------------------------------
// Capture specs.

#[test]
fn specs_that_are_not_yaml_or_hold_impossible_boundaries_are_refused() {
    let dir = scratch("malformed-spec");
    let cases: &[(&str, &[u8], &[&str])] = &[
        ("unclosed flow", b"name: a\ncapture: { boundaries: [2, 3\n", &["line"]),
        ("tab indentation", b"name: a\ncapture:\n\tboundaries: [2]\n", &["line 3"]),
        (
            "unknown key",
            b"name: a\ncapture: { boundaries: [2] }\nfcc: 3\n",
            &["unknown field `fcc`"],
        ),
        (
            "unknown capture key",
            b"name: a\ncapture: { boundary: [2] }\n",
            &["unknown field `boundary`"],
        ),
        (
            "negative boundary",
            b"name: a\ncapture: { boundaries: [2, -3] }\n",
            &["line 2", "boundary -3 is negative"],
        ),
        (
            "huge boundary",
            b"name: a\ncapture: { boundaries: [2, 9223372036854775807] }\n",
            &["boundary 9223372036854775807 is past any model's layers"],
        ),
        (
            "boundary past i64",
            b"name: a\ncapture: { boundaries: [2, 99999999999999999999999] }\n",
            &["line 2"],
        ),
        (
            "huge layer id, out convention",
            b"name: a\ncapture: { layers: [9223372036854775807], convention: out }\n",
            &["past any model's layers"],
        ),
        (
            "absurd target",
            b"name: a\ntarget: { num_hidden_layers: 100000000000 }\ncapture: { boundaries: [2] }\n",
            &["line 2", "target.num_hidden_layers is 100000000000"],
        ),
        (
            "negative fc",
            b"name: a\ncapture: { boundaries: [2] }\nfc: { in_features: -192 }\n",
            &["in_features"],
        ),
        ("empty", b"", &["missing field"]),
        ("not UTF-8", b"name: \xff\xfe\ncapture: {}\n", &["valid UTF-8"]),
        (
            "alias bomb",
            b"a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\ng: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]\nname: a\ncapture: { boundaries: [2] }\n",
            &["line"],
        ),
        (
            "nested past the recursion limit",
            &[b'['; 100_000],
            &["line"],
        ),
    ];
    for (i, (case, text, needles)) in cases.iter().enumerate() {
        let spec = dir.join(format!("s{i}.yaml"));
        std::fs::write(&spec, text).unwrap();
        let n = name(&spec);
        let mut all = vec![n.as_str()];
        all.extend_from_slice(needles);
        refused(case, &gate(&spec, &fixture(DRAFT_CONFIG), None), &all);
    }
}

// ---------------------------------------------------------------------------------------------
// GGUF targets.

#[test]
fn gguf_files_that_are_truncated_or_declare_too_much_are_refused() {
    let dir = scratch("malformed-gguf");
    let good = gguf_with(|_, _| {});
    let u64b = |x: u64| x.to_le_bytes().to_vec();
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        (
            "ten bytes",
            good[..10].to_vec(),
            &["too short for a GGUF file"],
        ),
        (
            "truncated in the tensor infos",
            good[..good.len() / 3].to_vec(),
            &["not a readable GGUF file"],
        ),
        (
            "truncated in the data",
            good[..good.len() - 40].to_vec(),
            &["past the end of the file"],
        ),
        (
            "bad magic",
            {
                let mut b = good.clone();
                b[..4].copy_from_slice(b"GGUX");
                b
            },
            &["not a readable GGUF file", "magic"],
        ),
        (
            "unknown version",
            {
                let mut b = good.clone();
                b[4..8].copy_from_slice(&99u32.to_le_bytes());
                b
            },
            &["not a readable GGUF file"],
        ),
        (
            "2^60 tensors",
            {
                let mut b = good.clone();
                b[8..16].copy_from_slice(&u64b(1 << 60));
                b
            },
            &["not a readable GGUF file", "tensor_count"],
        ),
        (
            "2^40 metadata entries",
            {
                let mut b = good.clone();
                b[16..24].copy_from_slice(&u64b(1 << 40));
                b
            },
            &["not a readable GGUF file", "metadata"],
        ),
        (
            "a key of 2^62 bytes",
            {
                let mut b = good.clone();
                b[24..32].copy_from_slice(&u64b(1 << 62));
                b
            },
            &["not a readable GGUF file", "string length"],
        ),
        (
            "an array of 2^40 strings",
            gguf_with(|md, _| {
                let mut v = 8u32.to_le_bytes().to_vec();
                v.extend_from_slice(&u64b(1 << 40));
                md.push(gkv("tokenizer.ggml.tokens", 9, &v));
            }),
            &["not a readable GGUF file", "array"],
        ),
        (
            "dims that overflow",
            gguf_with(|_, t| t[0].1 = vec![1 << 40, 1 << 40]),
            &["token_embd.weight", "overflows"],
        ),
        (
            "a terabyte tensor",
            gguf_with(|_, t| t[0].1 = vec![1 << 20, 1 << 20]),
            &["token_embd.weight", "past the end of the file"],
        ),
        (
            "five dims",
            gguf_with(|_, t| t[1].1 = vec![1, 1, 1, 1, 4]),
            &["not a readable GGUF file", "dimensions"],
        ),
        (
            "unknown ggml dtype",
            gguf_with(|_, t| t[1].2 = 999),
            &["not a readable GGUF file"],
        ),
        (
            "alignment 0",
            gguf_with(|md, _| md.push(gkv("general.alignment", GGUF_U32, &0u32.to_le_bytes()))),
            &["not a readable GGUF file"],
        ),
        (
            "unsupported architecture",
            gguf_with(|md, _| md[0] = gkv("general.architecture", GGUF_STRING, &gstr("gpt2"))),
            &["architecture `gpt2` is not supported"],
        ),
        (
            "a trillion blocks",
            gguf_with(|md, _| md[1] = gkv("llama.block_count", GGUF_U32, &u32::MAX.to_le_bytes())),
            &["`num_hidden_layers` is 4294967295, more than eagle-check accepts"],
        ),
        (
            "architecture a number",
            gguf_with(|md, _| md[0] = gkv("general.architecture", GGUF_U32, &7u32.to_le_bytes())),
            &["general.architecture` is not a string"],
        ),
    ];
    for (i, (case, bytes, needles)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("g{i}.gguf"));
        std::fs::write(&path, &bytes).unwrap();
        let n = name(&path);
        let mut all = vec![n.as_str()];
        all.extend_from_slice(needles);
        let out = gate(&root().join(GATE_SPEC), &fixture(DRAFT_CONFIG), Some(&path));
        refused(case, &out, &all);
    }
    // The same bytes, well formed, are read: the harness writes real GGUF files.
    let ok = dir.join("good.gguf");
    std::fs::write(&ok, &good).unwrap();
    let out = gate(&root().join(GATE_SPEC), &fixture(DRAFT_CONFIG), Some(&ok));
    assert_ne!(out.code, 2, "{}", out.stderr);
}

// ---------------------------------------------------------------------------------------------
// torch.save archives and pickles: nothing in them may run.

#[test]
fn evil_pickles_are_refused_and_their_payload_never_runs() {
    let dir = scratch("malformed-pickle");
    let marker = dir.join("PWNED");
    let touch = format!("touch {}", p(&marker));
    let py = format!("__import__('os').system('{touch}')");
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        (
            "os.system via GLOBAL + REDUCE",
            Pickle::new()
                .global("os", "system")
                .str(&touch)
                .op(b"\x85R")
                .done(),
            &["pickle global os.system", "is not allowed"],
        ),
        (
            "posix.system, as pickle spells it on Linux",
            Pickle::new()
                .global("posix", "system")
                .str(&touch)
                .op(b"\x85R")
                .done(),
            &["pickle global posix.system"],
        ),
        (
            "builtins.eval",
            Pickle::new()
                .global("builtins", "eval")
                .str(&py)
                .op(b"\x85R")
                .done(),
            &["pickle global builtins.eval"],
        ),
        (
            "builtins.exec",
            Pickle::new()
                .global("builtins", "exec")
                .str(&py)
                .op(b"\x85R")
                .done(),
            &["pickle global builtins.exec"],
        ),
        (
            "builtins.getattr chain",
            Pickle::new().global("builtins", "getattr").done(),
            &["pickle global builtins.getattr"],
        ),
        (
            "subprocess via STACK_GLOBAL (protocol 4)",
            {
                let mut b = b"\x80\x04".to_vec();
                for s in ["subprocess", "call"] {
                    b.push(0x8c);
                    b.push(s.len() as u8);
                    b.extend_from_slice(s.as_bytes());
                }
                b.push(0x93);
                Pickle(b).str(&touch).op(b"\x85R").done()
            },
            &["pickle global subprocess.call"],
        ),
        (
            "INST opcode",
            Pickle::new()
                .op(b"(")
                .str(&touch)
                .op(b"ios\nsystem\n")
                .done(),
            &["pickle opcode INST"],
        ),
        (
            "OBJ opcode",
            Pickle::new()
                .op(b"(")
                .global("os", "system")
                .str(&touch)
                .op(b"o")
                .done(),
            &["pickle global os.system"],
        ),
        (
            "OBJ opcode on an allowed global",
            Pickle::new()
                .op(b"(")
                .global("collections", "OrderedDict")
                .op(b"o")
                .done(),
            &["pickle opcode OBJ"],
        ),
        (
            "NEWOBJ",
            Pickle::new()
                .global("collections", "OrderedDict")
                .op(b")\x81")
                .done(),
            &["pickle opcode NEWOBJ"],
        ),
        (
            "BUILD with a state",
            Pickle::new()
                .global("collections", "OrderedDict")
                .op(b")R}")
                .str("__setstate__")
                .str(&touch)
                .op(b"sb")
                .done(),
            &["BUILD with a non-empty state"],
        ),
        (
            "REDUCE on a storage type",
            Pickle::new()
                .global("torch", "FloatStorage")
                .op(b")R")
                .done(),
            &["storage type is called directly"],
        ),
        (
            "tensor hooks that call os.system",
            Pickle::new()
                .global("torch._utils", "_rebuild_tensor_v2")
                .op(b"(")
                .global("os", "system")
                .op(b"t")
                .op(b"R")
                .done(),
            &["pickle global os.system"],
        ),
        (
            "EXT1 registry lookup",
            Pickle::new().op(b"\x82\x01").done(),
            &["pickle opcode EXT1"],
        ),
        (
            "PERSID text opcode",
            Pickle::new().op(b"P0\n").done(),
            &["pickle opcode PERSID"],
        ),
    ];
    for (i, (case, pkl, needles)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("evil{i}.pt"));
        std::fs::write(&path, torch_zip(&pkl, &[])).unwrap();
        let n = name(&path);
        let mut all = vec![n.as_str()];
        all.extend_from_slice(needles);
        refused(case, &diff(&path), &all);
        assert!(!marker.exists(), "{case}: the payload ran");
    }
    // A legacy (pre-1.6, bare pickle stream) torch file holding the same payload.
    let legacy = dir.join("legacy.pt");
    std::fs::write(
        &legacy,
        Pickle::new()
            .global("posix", "system")
            .str(&touch)
            .op(b"\x85R")
            .done(),
    )
    .unwrap();
    refused(
        "legacy pickle",
        &diff(&legacy),
        &["legacy.pt", "unsupported legacy torch format"],
    );
    // The payload inside a .ckpt.gz and inside an .npz member.
    let pkl = Pickle::new()
        .global("posix", "system")
        .str(&touch)
        .op(b"\x85R")
        .done();
    let gz = dir.join("data_0.ckpt.gz");
    std::fs::write(&gz, gzip(&torch_zip(&pkl, &[]))).unwrap();
    refused(
        "gzipped",
        &diff(&gz),
        &["data_0.ckpt.gz", "pickle global posix.system"],
    );
    let npz = dir.join("pickled.npz");
    std::fs::write(&npz, zip_of(&[("x.npy", &pkl, false)])).unwrap();
    refused("npz member", &diff(&npz), &["pickled.npz", "not an .npy"]);
    assert!(!marker.exists(), "the payload ran");
}

#[test]
fn torch_archives_that_lie_about_their_tensors_are_refused() {
    let dir = scratch("malformed-torch");
    let one = |shape: &[i64], stride: &[i64], numel: i64| {
        Pickle::new()
            .op(b"}")
            .str("aux_hidden_states")
            .tensor("FloatStorage", "0", numel, shape, stride)
            .op(b"s")
            .done()
    };
    let sixteen = vec![0u8; 64];
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        (
            "a terabyte storage declared in a few bytes",
            torch_zip(
                &one(&[1 << 18, 1 << 20], &[1 << 20, 1], 1 << 38),
                &[("0", &sixteen)],
            ),
            &[
                "storage 0 declares 274877906944 f32",
                "the archive entry holds 64 bytes",
            ],
        ),
        (
            "view past its storage",
            torch_zip(&one(&[100, 100], &[100, 1], 16), &[("0", &sixteen)]),
            &["view 100x100", "reaches element 9999 of a storage of 16"],
        ),
        (
            "zero-stride view of a gigabyte",
            torch_zip(&one(&[1 << 15, 1 << 15], &[0, 0], 16), &[("0", &sixteen)]),
            &["copying this strided view would exceed the copy budget"],
        ),
        (
            "negative stride",
            torch_zip(&one(&[4, 4], &[-4, 1], 16), &[("0", &sixteen)]),
            &["negative stride -4"],
        ),
        (
            "missing storage entry",
            torch_zip(&one(&[4, 4], &[4, 1], 16), &[]),
            &["the archive has no entry archive/data/0"],
        ),
        (
            "big-endian archive",
            {
                let pkl = one(&[4, 4], &[4, 1], 16);
                zip_of(&[
                    ("archive/data.pkl", &pkl, false),
                    ("archive/byteorder", b"big", false),
                    ("archive/data/0", &sixteen, false),
                ])
            },
            &["only little-endian archives are read"],
        ),
        (
            "no data.pkl",
            zip_of(&[("archive/other.pkl", b"x", false)]),
            &["has no data.pkl"],
        ),
        (
            "truncated zip",
            torch_dict(&[("aux_hidden_states", "FloatStorage", &[2, 192])])[..300].to_vec(),
            &["broken zip archive"],
        ),
        (
            "not a zip at all",
            b"hello world, not torch".to_vec(),
            &["not a torch.save zip archive"],
        ),
        (
            "pickle without STOP",
            torch_zip(b"\x80\x02}", &[]),
            &["pickle ends without STOP"],
        ),
        (
            "pickle nested 100000 deep",
            torch_zip(
                &Pickle::new()
                    .op(&b"]".repeat(100_000))
                    .op(&b"a".repeat(99_999))
                    .done(),
                &[],
            ),
            &["levels of nesting"],
        ),
    ];
    for (i, (case, bytes, needles)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("t{i}.pt"));
        std::fs::write(&path, &bytes).unwrap();
        let n = name(&path);
        let mut all = vec![n.as_str()];
        all.extend_from_slice(needles);
        refused(case, &diff(&path), &all);
    }
}

// ---------------------------------------------------------------------------------------------
// gzip: truncated streams and bombs.

#[test]
fn truncated_gzip_and_gzip_or_zip_bombs_are_refused() {
    let dir = scratch("malformed-gzip");
    let good = gzip(&torch_dict(&[(
        "aux_hidden_states",
        "FloatStorage",
        &[2, 192],
    )]));
    let truncated = dir.join("data_0.ckpt.gz");
    std::fs::write(&truncated, &good[..good.len() / 2]).unwrap();
    refused(
        "truncated gzip",
        &diff(&truncated),
        &["data_0.ckpt.gz", "broken gzip stream"],
    );
    let not_gzip = dir.join("data_1.ckpt.gz");
    std::fs::write(&not_gzip, [0x1f, 0x8b, 8, 0, 0xff, 0xff]).unwrap();
    refused(
        "gzip header only",
        &diff(&not_gzip),
        &["data_1.ckpt.gz", "gzip"],
    );

    // 256 MiB of zeros: ~250 KB gzipped, refused once 64 MiB (the floor) are out.
    let bomb = dir.join("data_2.ckpt.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&bomb).unwrap(),
        flate2::Compression::best(),
    );
    let chunk = vec![0u8; 1 << 20];
    for _ in 0..256 {
        enc.write_all(&chunk).unwrap();
    }
    enc.finish().unwrap();
    refused(
        "gzip bomb",
        &diff(&bomb),
        &[
            "data_2.ckpt.gz",
            "decompressed",
            "exceeds the limit of 64 MiB",
        ],
    );

    // An npz member declaring 256 MiB deflated from a few hundred KB: refused on the
    // declaration, before inflating.
    let npz = dir.join("bomb.npz");
    let zeros = vec![0u8; 256 << 20];
    std::fs::write(&npz, zip_of(&[("x.npy", &zeros, true)])).unwrap();
    refused(
        "zip bomb (declared)",
        &diff(&npz),
        &[
            "bomb.npz",
            "zip member x.npy of 268435456 bytes (deflated from",
        ],
    );
    // A torch storage entry of 256 MiB deflated: the pickle agrees with the entry, the ratio
    // does not.
    let pkl = Pickle::new()
        .op(b"}")
        .str("aux_hidden_states")
        .tensor("FloatStorage", "0", 1 << 26, &[1 << 20, 64], &[64, 1])
        .op(b"s")
        .done();
    let pt = dir.join("bomb.pt");
    std::fs::write(
        &pt,
        zip_of(&[
            ("archive/data.pkl", &pkl, false),
            ("archive/data/0", &zeros, true),
        ]),
    )
    .unwrap();
    refused(
        "zip bomb (torch storage)",
        &diff(&pt),
        &[
            "bomb.pt",
            "zip member archive/data/0 of 268435456 bytes (deflated from",
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// .npy and .npz.

#[test]
fn npy_and_npz_that_lie_are_refused() {
    let dir = scratch("malformed-npy");
    let f32s = vec![0u8; 4 * 2 * 192];
    let dict = |descr: &str, fortran: &str, shape: &str| {
        format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}")
    };
    let cases: Vec<(&str, &str, Vec<u8>, &[&str])> = vec![
        (
            "descr lie (f8 over f4 data)",
            "a.npy",
            npy(&dict("<f8", "False", "(2, 192)"), &f32s),
            &["header declares 2x192 f64 (3072 bytes) but the file holds 1536 bytes of data"],
        ),
        (
            "shape lie",
            "b.npy",
            npy(&dict("<f4", "False", "(4096, 4096)"), &f32s),
            &["header declares 4096x4096 f32 (64 MiB) but the file holds 1536 bytes"],
        ),
        (
            "a terabyte declared",
            "c.npy",
            npy(&dict("<f4", "False", "(1048576, 262144)"), &f32s),
            &["header declares 1048576x262144 f32 (1024 GiB)"],
        ),
        (
            "dims that overflow",
            "d.npy",
            npy(&dict("<f4", "False", "(18446744073709551615, 4)"), &f32s),
            &["whose size overflows"],
        ),
        (
            "fortran order with a shape lie",
            "e.npy",
            npy(&dict("<f4", "True", "(192, 4096)"), &f32s),
            &["header declares 192x4096 f32"],
        ),
        (
            "big-endian",
            "f.npy",
            npy(&dict(">f4", "False", "(2, 192)"), &f32s),
            &["dtype \">f4\" (big-endian)"],
        ),
        (
            "object array",
            "g.npy",
            npy(&dict("|O", "False", "(2,)"), &[0u8; 16]),
            &["object arrays need pickle"],
        ),
        (
            "structured dtype",
            "h.npy",
            npy(
                "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
                &[0u8; 8],
            ),
            &["structured dtypes"],
        ),
        (
            "header past the end",
            "i.npy",
            {
                let mut b = b"\x93NUMPY\x02\x00".to_vec();
                b.extend_from_slice(&u32::MAX.to_le_bytes());
                b.extend_from_slice(b"{'descr'");
                b
            },
            &["exceeds the limit"],
        ),
        (
            "unknown version",
            "j.npy",
            b"\x93NUMPY\x09\x00\x10\x00{}".to_vec(),
            &["unknown .npy format version 9.0"],
        ),
        (
            "evaluated header",
            "k.npy",
            npy(
                "{'descr': __import__('os').system('true'), 'fortran_order': False, 'shape': (1,)}",
                &[0u8; 4],
            ),
            &["cannot parse"],
        ),
        (
            "not npy",
            "l.npy",
            b"PK\x03\x04 not numpy".to_vec(),
            &["not an .npy"],
        ),
        (
            "npz not a zip",
            "m.npz",
            b"\x93NUMPY".to_vec(),
            &["broken zip archive"],
        ),
        (
            "npz member lies",
            "n.npz",
            zip_of(&[(
                "aux.npy",
                &npy(&dict("<f4", "False", "(4096, 4096)"), &f32s),
                true,
            )]),
            &["member aux.npy header declares 4096x4096 f32"],
        ),
        (
            "npz truncated",
            "o.npz",
            zip_of(&[(
                "aux.npy",
                &npy(&dict("<f4", "False", "(2, 192)"), &f32s),
                false,
            )])[..100]
                .to_vec(),
            &["broken zip archive"],
        ),
    ];
    for (case, file, bytes, needles) in cases {
        let path = dir.join(file);
        std::fs::write(&path, &bytes).unwrap();
        let mut all = vec![file];
        all.extend_from_slice(needles);
        refused(case, &diff(&path), &all);
    }
}

// ---------------------------------------------------------------------------------------------
// Producer layouts whose tensors do not fit their names.

#[test]
fn vllm_sglang_modelopt_and_specforge_layouts_with_wrong_shapes_are_refused() {
    let dir = scratch("malformed-layouts");
    let st_cases: Vec<(&str, &str, Vec<u8>, &[&str])> = vec![
        (
            "vLLM hidden_states of rank 4",
            "hs_0.safetensors",
            capture_st(&[
                ("token_ids", "I64", &[4]),
                ("hidden_states", "F32", &[4, 3, 64, 1]),
            ]),
            &["hidden_states has shape 4x3x64x1; expected [S, H], [B, S, H] or [T, n, H]"],
        ),
        (
            "vLLM token ids of rank 3",
            "hs_1.safetensors",
            capture_st(&[
                ("token_ids", "I64", &[1, 1, 4]),
                ("hidden_states", "F32", &[4, 3, 64]),
            ]),
            &["token_ids has shape 1x1x4; expected [S] or [B, S]"],
        ),
        (
            "vLLM token ids as floats",
            "hs_2.safetensors",
            capture_st(&[
                ("token_ids", "F32", &[4]),
                ("hidden_states", "F32", &[4, 3, 64]),
            ]),
            &["token_ids has dtype f32; expected integers"],
        ),
        (
            "aux states of rank 4",
            "x.safetensors",
            capture_st(&[
                ("input_ids", "I64", &[4]),
                ("aux_hidden_states", "F32", &[1, 1, 4, 192]),
            ]),
            &["aux_hidden_states has shape 1x1x4x192; expected [S, k*H] or [B, S, k*H]"],
        ),
        (
            "batch rows that disagree",
            "y.safetensors",
            capture_st(&[
                ("input_ids", "I64", &[2, 4]),
                ("aux_hidden_states", "F32", &[3, 4, 192]),
            ]),
            &["input_ids has a batch of 2 but aux_hidden_states has 3"],
        ),
        (
            "a batch of zero",
            "z.safetensors",
            capture_st(&[
                ("input_ids", "I64", &[0, 4]),
                ("aux_hidden_states", "F32", &[0, 4, 192]),
            ]),
            &["holds a batch of 0 sequences"],
        ),
        (
            "no tokens",
            "v.safetensors",
            capture_st(&[
                ("input_ids", "I64", &[0]),
                ("aux_hidden_states", "F32", &[0, 192]),
            ]),
            &["input_ids has shape 0: it holds no tokens"],
        ),
        (
            "no hidden states",
            "w.safetensors",
            capture_st(&[("input_ids", "I64", &[4])]),
            &["no captured hidden states"],
        ),
    ];
    for (case, file, bytes, needles) in st_cases {
        let path = dir.join(file);
        std::fs::write(&path, &bytes).unwrap();
        let mut all = vec![file];
        all.extend_from_slice(needles);
        refused(case, &diff(&path), &all);
    }
    let torch_cases: Vec<(&str, &str, Vec<u8>, &[&str])> = vec![
        (
            "ModelOpt aux states of rank 1",
            "17.pt",
            torch_dict(&[
                ("input_ids", "LongStorage", &[4]),
                ("hidden_states", "FloatStorage", &[4, 64]),
                ("aux_hidden_states", "FloatStorage", &[768]),
            ]),
            &["aux_hidden_states has shape 768; expected [S, k*H] or [B, S, k*H]"],
        ),
        (
            "SpecForge batch rows that disagree",
            "data_0.ckpt",
            torch_dict(&[
                ("input_ids", "LongStorage", &[2, 4]),
                ("loss_mask", "LongStorage", &[3, 4]),
                ("aux_hidden_state", "FloatStorage", &[2, 4, 192]),
            ]),
            &["input_ids has a batch of 2 but loss_mask has 3"],
        ),
        (
            "SpecForge hidden state of rank 1",
            "data_1.ckpt",
            torch_dict(&[
                ("input_ids", "LongStorage", &[4]),
                ("aux_hidden_state", "FloatStorage", &[4, 192]),
                ("hidden_state", "FloatStorage", &[64]),
            ]),
            &["hidden_state has shape 64; expected [S, H], [B, S, H] or [T, n, H]"],
        ),
        (
            "sglang dumper value that is not a tensor",
            "step=0___rank=0___dump_index=1___name=layer_start__hidden_states___layer_id=2.pt",
            {
                let pkl = Pickle::new()
                    .op(b"}")
                    .str("value")
                    .str("not a tensor")
                    .op(b"s")
                    .str("meta")
                    .op(b"}s")
                    .done();
                torch_zip(&pkl, &[])
            },
            &["no captured hidden states"],
        ),
        (
            "a list at the top",
            "data_2.ckpt",
            torch_zip(&Pickle::new().op(b"]").done(), &[]),
            &["holds a list at the top level, not a dict of tensors"],
        ),
    ];
    for (case, file, bytes, needles) in torch_cases {
        let sub = dir.join(format!("t-{}", file.len()));
        std::fs::create_dir_all(&sub).unwrap();
        let path = sub.join(file);
        std::fs::write(&path, &bytes).unwrap();
        let mut all = vec![file];
        all.extend_from_slice(needles);
        refused(case, &diff(&path), &all);
    }
}

// ---------------------------------------------------------------------------------------------
// Token files.

#[test]
fn token_files_that_are_not_token_ids_are_refused() {
    let dir = scratch("malformed-tokens");
    let ids = |vals: &[i64], descr: &str, shape: &str| {
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        npy(
            &format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"),
            &data,
        )
    };
    let cases: Vec<(&str, &str, Vec<u8>, &[&str])> = vec![
        (
            "a word",
            "a.txt",
            b"1\n2\nthree\n".to_vec(),
            &["line 3: `three` is not a token id"],
        ),
        (
            "negative",
            "b.txt",
            b"1\n-2\n".to_vec(),
            &["line 2: `-2` is not a token id"],
        ),
        (
            "past u32",
            "c.txt",
            b"1\n99999999999\n".to_vec(),
            &["line 2: `99999999999` is not a token id"],
        ),
        (
            "a float",
            "d.txt",
            b"1.5\n".to_vec(),
            &["line 1: `1.5` is not a token id"],
        ),
        (
            "past the vocabulary",
            "e.txt",
            b"1\n4294967295\n".to_vec(),
            &["4294967295"],
        ),
        ("empty", "f.txt", Vec::new(), &["token file holds no ids"]),
        (
            "not UTF-8",
            "g.txt",
            vec![0xff, 0xfe, b'1'],
            &["neither .npy nor UTF-8 text"],
        ),
        (
            "npy of floats",
            "h.npy",
            ids(&[0, 0], "<f8", "(2,)"),
            &["npy: dtype f64 is not an integer type"],
        ),
        (
            "npy of rank 2",
            "i.npy",
            ids(&[1, 2, 3, 4], "<i8", "(2, 2)"),
            &["is not 1-D"],
        ),
        (
            "npy negative",
            "j.npy",
            ids(&[1, -7], "<i8", "(2,)"),
            &["element 1 = -7 is not a token id"],
        ),
        (
            "npy declaring a terabyte",
            "k.npy",
            ids(&[1, 2], "<i8", "(137438953472,)"),
            &["header declares 137438953472 i64 (1024 GiB)"],
        ),
    ];
    for (case, file, bytes, needles) in cases {
        let path = dir.join(file);
        std::fs::write(&path, &bytes).unwrap();
        let mut all = vec![file];
        all.extend_from_slice(needles);
        refused(case, &run_bundle(&["--token-file", &p(&path)]), &all);
    }
    refused(
        "a directory",
        &run_bundle(&["--token-file", &p(&dir)]),
        &["malformed-tokens"],
    );
}

// ---------------------------------------------------------------------------------------------
// File names that are not UTF-8, and symlink loops.

#[test]
fn non_utf8_file_names_are_named_lossily_and_refused() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let dir = scratch("malformed-names");
    let caps = dir.join(OsStr::from_bytes(b"caps-\xff"));
    std::fs::create_dir_all(&caps).unwrap();
    let bad = caps.join(OsStr::from_bytes(b"hs_\xfe\xff.safetensors"));
    std::fs::write(&bad, st(&st1("F32", "[4096]", 0, 16), 16)).unwrap();
    let out = eagle_check([
        OsStr::new("diff"),
        OsStr::new("--spec"),
        root().join(DIFF_SPEC).as_os_str(),
        OsStr::new("--target"),
        fixture("models/llama").as_os_str(),
        OsStr::new("--captures"),
        caps.as_os_str(),
    ]);
    refused(
        "capture named in bytes",
        &out,
        &[
            "caps-\u{fffd}",
            "hs_\u{fffd}\u{fffd}.safetensors",
            "declares 4096 F32",
        ],
    );
    let spec = dir.join(OsStr::from_bytes(b"spec-\xff.yaml"));
    let out = eagle_check([
        OsStr::new("gate"),
        OsStr::new("--spec"),
        spec.as_os_str(),
        OsStr::new("--draft"),
        fixture(DRAFT_CONFIG).as_os_str(),
    ]);
    refused(
        "missing spec named in bytes",
        &out,
        &["spec-\u{fffd}.yaml", "No such file"],
    );
    std::fs::write(&spec, b"name: [\n").unwrap();
    let out = eagle_check([
        OsStr::new("gate"),
        OsStr::new("--spec"),
        spec.as_os_str(),
        OsStr::new("--draft"),
        fixture(DRAFT_CONFIG).as_os_str(),
    ]);
    refused(
        "bad spec named in bytes",
        &out,
        &["spec-\u{fffd}.yaml", "line"],
    );
}

#[test]
fn symlink_loops_in_model_and_capture_directories_are_refused() {
    use std::os::unix::fs::symlink;
    let dir = scratch("malformed-symlinks");
    // A draft directory that is a link to itself.
    let looped = dir.join("draft-loop");
    symlink(&looped, &looped).unwrap();
    refused(
        "draft dir loops",
        &gate_draft(&looped),
        &["draft-loop", "symbolic links"],
    );
    // Two links pointing at each other.
    let (a, b) = (dir.join("a"), dir.join("b"));
    symlink(&b, &a).unwrap();
    symlink(&a, &b).unwrap();
    refused("a <-> b", &gate_draft(&a), &["symbolic links"]);
    // A real draft directory whose model.safetensors links to itself.
    let d = draft_with_weights(&dir.join("draft"), &[]);
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    symlink(d.join("model.safetensors"), d.join("model.safetensors")).unwrap();
    refused(
        "weights loop",
        &gate_draft(&d),
        &["model.safetensors", "symbolic links"],
    );
    // A target given as an HF cache entry whose snapshot loops.
    let cache = dir.join("models--org--loop");
    std::fs::create_dir_all(cache.join("snapshots")).unwrap();
    std::fs::create_dir_all(cache.join("refs")).unwrap();
    std::fs::write(cache.join("refs/main"), "rev").unwrap();
    symlink(cache.join("snapshots/rev"), cache.join("snapshots/rev")).unwrap();
    let out = gate(
        &root().join(GATE_SPEC),
        &fixture(DRAFT_CONFIG),
        Some(&cache),
    );
    refused(
        "cache snapshot loops",
        &out,
        &["models--org--loop/snapshots/rev", "symbolic links"],
    );
    // A capture directory holding only a link back to itself and a looping file link: the
    // walk does not follow them and says so.
    let caps = dir.join("caps");
    std::fs::create_dir_all(&caps).unwrap();
    symlink(&caps, caps.join("again")).unwrap();
    symlink(caps.join("x.npy"), caps.join("x.npy")).unwrap();
    refused(
        "capture dir loops",
        &diff(&caps),
        &["caps", "no capture files found"],
    );
}

// ---------------------------------------------------------------------------------------------
// The command line.

#[test]
fn bad_command_lines_are_refused_on_one_line() {
    let spec = p(&root().join(GATE_SPEC));
    let draft = p(&fixture(DRAFT_CONFIG));
    let bundle = p(&fixture("bundles/tiny-llama"));
    let cases: Vec<(&str, Vec<&str>, &[&str])> = vec![
        ("no subcommand", vec![], &["subcommand"]),
        (
            "unknown subcommand",
            vec!["check"],
            &["unrecognized subcommand 'check'"],
        ),
        ("unknown flag", vec!["gate", "--spce", &spec], &["--spce"]),
        (
            "missing required flag",
            vec!["gate", "--spec", &spec],
            &["--draft"],
        ),
        (
            "bad format",
            vec![
                "gate", "--spec", &spec, "--draft", &draft, "--format", "xml",
            ],
            &["xml", "--format", "possible values: table, json"],
        ),
        (
            "unknown engine",
            vec![
                "gate", "--spec", &spec, "--draft", &draft, "--engine", "tgi",
            ],
            &["--engine", "unknown engine `tgi`"],
        ),
        (
            "engine version not a version",
            vec![
                "gate",
                "--spec",
                &spec,
                "--draft",
                &draft,
                "--engine",
                "sglang@abc",
            ],
            &["--engine", "`abc` is not a version"],
        ),
        (
            "unknown capture path",
            vec![
                "gate", "--spec", &spec, "--draft", &draft, "--engine", "vllm:v9",
            ],
            &["--engine", "no capture path `v9`"],
        ),
        (
            "tokens not numbers",
            vec!["run", &bundle, "--tokens", "1,x,3"],
            &["--tokens", "x"],
        ),
        (
            "negative token",
            vec!["run", &bundle, "--tokens", "1,-3"],
            &["-3"],
        ),
        (
            "negative generate",
            vec!["run", &bundle, "--generate", "-1"],
            &["-1"],
        ),
        (
            "conflicting inputs",
            vec!["run", &bundle, "--tokens", "1", "--prompt", "hi"],
            &["--prompt"],
        ),
        (
            "cuda without a GPU",
            vec!["run", &bundle, "--device", "cuda"],
            &["--device cuda"],
        ),
        ("not a bundle", vec!["run", &spec], &["not a bundle"]),
        (
            "diff without a target",
            vec!["diff", "--spec", &spec, "--captures", &draft],
            &["--target"],
        ),
        (
            "missing spec file",
            vec!["gate", "--spec", "no/such/spec.yaml", "--draft", &draft],
            &["no/such/spec.yaml", "No such file"],
        ),
    ];
    for (case, args, needles) in cases {
        refused(case, &eagle_check(&args), needles);
    }
}

// ---------------------------------------------------------------------------------------------
// Memory: what a header declares is never allocated before it is checked against the file.

/// Address space the binary may use in the test below (RLIMIT_AS, KiB). A `diff` that loads the
/// tiny target and reads a capture fits in well under this; any reader that reserved what a
/// header declares (a terabyte, or even a gigabyte) would hit it and abort instead of exiting 2.
const AS_LIMIT_KIB: u64 = 1 << 20;

/// Runs eagle-check under `ulimit -v` (the shell's RLIMIT_AS), in a child process.
fn eagle_check_limited(args: &[String]) -> Output {
    let script = format!("ulimit -v {AS_LIMIT_KIB} && exec \"$0\" \"$@\"");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(crate::support::bin())
        .args(args)
        .current_dir(root())
        .output()
        .expect("sh runs");
    crate::support::output(out)
}

#[test]
fn headers_declaring_a_terabyte_are_refused_within_a_1_gib_address_space() {
    let dir = scratch("malformed-memory");
    let diff_args = |capture: &Path| {
        vec![
            "diff".to_string(),
            "--spec".into(),
            p(&root().join(DIFF_SPEC)),
            "--target".into(),
            p(&fixture("models/llama")),
            "--captures".into(),
            p(capture),
        ]
    };
    // The limit leaves room for a real run: a clean capture is read and judged under it.
    let clean = fixture("captures/corpus/llama/clean-f32/vllm/hs_0.safetensors");
    let out = eagle_check_limited(&diff_args(&clean));
    assert_eq!(
        out.code, 0,
        "a clean diff fails under the limit: {}",
        out.stderr
    );

    let tb = 1u64 << 40;
    let four = vec![0u8; 16];
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "tb.safetensors",
            st(&st1("U8", &format!("[{tb}]"), 0, tb), 16),
            "lie outside the 16 bytes of data",
        ),
        (
            "tb.npy",
            npy(
                "{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776,), }",
                &four,
            ),
            "declares 1099511627776 u8 (1024 GiB)",
        ),
        (
            "tb-fortran.npy",
            npy(
                "{'descr': '|u1', 'fortran_order': True, 'shape': (1048576, 1048576), }",
                &four,
            ),
            "declares 1048576x1048576 u8 (1024 GiB)",
        ),
        (
            "tb.pt",
            torch_zip(
                &Pickle::new()
                    .op(b"}")
                    .str("aux_hidden_states")
                    .tensor(
                        "ByteStorage",
                        "0",
                        tb as i64,
                        &[1 << 20, 1 << 20],
                        &[1 << 20, 1],
                    )
                    .op(b"s")
                    .done(),
                &[("0", &four)],
            ),
            "storage 0 declares 1099511627776 u8",
        ),
        (
            "tb-view.pt",
            torch_zip(
                &Pickle::new()
                    .op(b"}")
                    .str("aux_hidden_states")
                    .tensor("ByteStorage", "0", 16, &[1 << 20, 1 << 20], &[0, 0])
                    .op(b"s")
                    .done(),
                &[("0", &four)],
            ),
            "copy budget",
        ),
    ];
    for (file, bytes, needle) in cases {
        let path = dir.join(file);
        std::fs::write(&path, &bytes).unwrap();
        refused(
            file,
            &eagle_check_limited(&diff_args(&path)),
            &[file, needle],
        );
    }
    // The gate reads safetensors headers and GGUF headers under the same limit.
    let d = draft_with_weights(
        &dir.join("draft"),
        &st(&st1("U8", &format!("[{tb}]"), 0, tb), 16),
    );
    let gate_args = |draft: &Path, target: Option<&Path>| {
        let mut a = vec![
            "gate".to_string(),
            "--spec".into(),
            p(&root().join(GATE_SPEC)),
            "--draft".into(),
            p(draft),
        ];
        if let Some(t) = target {
            a.extend(["--target".to_string(), p(t)]);
        }
        a
    };
    refused(
        "terabyte draft weight",
        &eagle_check_limited(&gate_args(&d, None)),
        &["model.safetensors", "lie outside"],
    );
    let gguf = dir.join("tb.gguf");
    std::fs::write(&gguf, gguf_with(|_, t| t[0].1 = vec![1 << 20, 1 << 18])).unwrap();
    refused(
        "terabyte GGUF tensor",
        &eagle_check_limited(&gate_args(&fixture(DRAFT_CONFIG), Some(&gguf))),
        &["tb.gguf", "past the end of the file"],
    );
}

// ---------------------------------------------------------------------------------------------
// Reference dumps (`diff --reference`).

#[test]
fn reference_dumps_that_lie_are_refused() {
    let dir = scratch("malformed-reference");
    // SpecForge aux captures: their width is divided by the reference's hidden size.
    let capture = fixture("captures/corpus/llama/clean-f32/specforge/rows_0-2/data_0.ckpt");
    let cases: Vec<(&str, &str, Vec<u8>, &[&str])> = vec![
        (
            "truncated",
            "dump.safetensors",
            capture_st(&[
                ("input_ids", "I64", &[4]),
                ("hidden_states.0", "F32", &[4, 64]),
            ])[..40]
                .to_vec(),
            &["runs past the end of the file"],
        ),
        (
            "no token ids",
            "noids.safetensors",
            capture_st(&[
                ("hidden_states.0", "F32", &[4, 64]),
                ("hidden_states.1", "F32", &[4, 64]),
            ]),
            &["reference dump without token ids"],
        ),
        (
            "zero tokens",
            "empty.safetensors",
            capture_st(&[
                ("input_ids", "I64", &[0]),
                ("hidden_states.0", "F32", &[0, 64]),
                ("hidden_states.1", "F32", &[0, 64]),
            ]),
            &["input_ids has shape 0: it holds no tokens"],
        ),
        (
            "vLLM rows zero wide",
            "hs_0.safetensors",
            capture_st(&[
                ("token_ids", "I64", &[4]),
                ("hidden_states", "F32", &[4, 6, 0]),
            ]),
            &["reference states are 0 wide (hidden size 0)"],
        ),
        (
            "dump rows zero wide",
            "zero.safetensors",
            capture_st(&[
                ("input_ids", "I64", &[4]),
                ("hidden_states.0", "F32", &[4, 0]),
                ("hidden_states.1", "F32", &[4, 0]),
            ]),
            &["reference states disagree on [T, H] (T = 4)"],
        ),
        (
            "vLLM rows for other tokens",
            "hs_1.safetensors",
            capture_st(&[
                ("token_ids", "I64", &[4]),
                ("hidden_states", "F32", &[5, 6, 64]),
            ]),
            &["does not match 4 tokens"],
        ),
        (
            "one boundary",
            "one.safetensors",
            capture_st(&[
                ("input_ids", "I64", &[4]),
                ("hidden_states.0", "F32", &[4, 64]),
            ]),
            &["not a reference dump"],
        ),
    ];
    for (case, file, bytes, needles) in cases {
        let sub = dir.join(case.replace(' ', "-"));
        std::fs::create_dir_all(&sub).unwrap();
        let path = sub.join(file);
        std::fs::write(&path, &bytes).unwrap();
        let out = eagle_check([
            "diff".to_string(),
            "--spec".into(),
            p(&root().join(DIFF_SPEC)),
            "--reference".into(),
            p(&path),
            "--captures".into(),
            p(&capture),
        ]);
        let mut all = vec![file];
        all.extend_from_slice(needles);
        refused(case, &out, &all);
    }
}

/// `--prompt` reads the target's tokenizer.json: a broken one is refused by name.
#[test]
fn tokenizer_files_that_are_broken_are_refused() {
    let dir = scratch("malformed-tokenizer");
    let cases: &[(&str, &str, &[&str])] = &[
        ("not JSON", "[", &["not a usable tokenizer.json"]),
        (
            "id past u32",
            r#"{"model": {"type": "BPE", "vocab": {"a": 99999999999}, "merges": []}}"#,
            &["not a usable tokenizer.json", "99999999999"],
        ),
        (
            "negative added token",
            r#"{"added_tokens":[{"id":-1}]}"#,
            &["not a usable tokenizer.json", "-1"],
        ),
        (
            "unknown token missing",
            r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{},"unk_token":"x"}}"#,
            &["tokenizing", "Missing [UNK] token"],
        ),
    ];
    for (i, (case, text, needles)) in cases.iter().enumerate() {
        let bundle = dir.join(format!("b{i}"));
        for part in ["target", "draft"] {
            let to = bundle.join(part);
            std::fs::create_dir_all(&to).unwrap();
            for f in ["config.json", "model.safetensors"] {
                let from = fixture(&format!("bundles/tiny-llama/{part}/{f}"));
                std::fs::copy(from, to.join(f)).unwrap();
            }
        }
        std::fs::copy(
            fixture("bundles/tiny-llama/spec.yaml"),
            bundle.join("spec.yaml"),
        )
        .unwrap();
        std::fs::write(bundle.join("target/tokenizer.json"), text).unwrap();
        let out = eagle_check([
            "run".to_string(),
            p(&bundle),
            "--device".into(),
            "cpu".into(),
            "--prompt".into(),
            "hello".into(),
        ]);
        let mut all = vec!["tokenizer.json"];
        all.extend_from_slice(needles);
        refused(case, &out, &all);
    }
}

/// Capture files are read several at a time (`diff::read_units`): among good files, the first
/// broken one in file order is the one named, whichever of them a thread reached first, and
/// nothing is reported on stdout.
#[test]
fn the_first_broken_capture_in_order_is_named_when_files_are_read_together() {
    let dir = scratch("broken-among-good");
    let good = fixture("captures/corpus/llama/clean-f32/specforge/rows_0-2/data_0.ckpt");
    for i in 0..6 {
        std::fs::copy(&good, dir.join(format!("data_{i}.ckpt"))).unwrap();
    }
    // Third and fourth in file order: read together (chunks of 2 on two threads, of 8 on
    // more).
    std::fs::write(dir.join("data_1a.ckpt"), b"not a zip").unwrap();
    std::fs::write(dir.join("data_1b.ckpt"), b"not a zip either").unwrap();
    let out = diff(&dir);
    refused(
        "two broken files among six good ones",
        &out,
        &["data_1a.ckpt"],
    );
    assert!(!out.stderr.contains("data_1b.ckpt"), "{}", out.stderr);
}
