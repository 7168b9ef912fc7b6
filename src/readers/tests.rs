//! Fixture tests for the readers: every good file under fixtures/captures/readers decodes to
//! the values its generator wrote beside it (`<file>.expected.json`), and every evil or corrupt
//! file fails with the right error, without panicking and without running its payload.

use std::path::{Path, PathBuf};

use serde_json::Value as J;

use super::safetensors_header::HeaderError;
use super::*;

fn fixtures() -> PathBuf {
    std::env::var_os("EAGLE_CHECK_ROOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf())
        .join("fixtures/captures/readers")
}

fn fixture(rel: &str) -> PathBuf {
    fixtures().join(rel)
}

/// The file the evil pickles would create if anything executed them.
const PWNED: &str = "/tmp/eagle_check_pwned";

fn check_tensor(ctx: &str, t: &HostTensor, want: &J) {
    assert_eq!(
        t.dtype.name(),
        want["dtype"].as_str().unwrap(),
        "{ctx}: dtype"
    );
    let shape: Vec<usize> = want["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(t.dims(), shape.as_slice(), "{ctx}: shape");
    let values = want["values"].as_array().unwrap();
    assert_eq!(t.numel(), values.len(), "{ctx}: numel");
    if t.dtype.is_float() {
        let got = t.to_f64_vec();
        for (i, (g, w)) in got.iter().zip(values).enumerate() {
            // Exact: the generator only writes values every dtype holds exactly.
            assert_eq!(*g, w.as_f64().unwrap(), "{ctx}: value {i}");
        }
    } else {
        let got = t.to_i64_vec().unwrap();
        for (i, (g, w)) in got.iter().zip(values).enumerate() {
            let w = w.as_i64().or_else(|| w.as_bool().map(i64::from)).unwrap();
            assert_eq!(*g, w, "{ctx}: value {i}");
        }
    }
}

fn check_opt_tensor(ctx: &str, got: &Option<HostTensor>, want: &J) {
    match (got, want) {
        (None, J::Null) => {}
        (Some(t), w) if !w.is_null() => check_tensor(ctx, t, w),
        (g, w) => panic!("{ctx}: got {g:?}, want {w}"),
    }
}

fn check_ids(ctx: &str, got: &Option<Vec<i64>>, want: &J) {
    let want: Option<Vec<i64>> = want
        .as_array()
        .map(|a| a.iter().map(|x| x.as_i64().unwrap()).collect());
    assert_eq!(got, &want, "{ctx}");
}

fn check_file_against_expected(path: &Path, expected: &J) {
    let ctx = path.display().to_string();
    let samples = read_capture_path(path).unwrap_or_else(|e| panic!("{e}"));
    let want = expected["samples"].as_array().unwrap();
    assert_eq!(samples.len(), want.len(), "{ctx}: sample count");
    for (s, w) in samples.iter().zip(want) {
        let ctx = format!("{ctx}#{}", s.index);
        assert_eq!(s.file, path);
        assert_eq!(
            s.format.name(),
            expected["format"].as_str().unwrap(),
            "{ctx}"
        );
        assert_eq!(s.index as u64, w["index"].as_u64().unwrap(), "{ctx}: index");
        check_ids(&format!("{ctx}: token_ids"), &s.token_ids, &w["token_ids"]);
        check_ids(&format!("{ctx}: loss_mask"), &s.loss_mask, &w["loss_mask"]);
        check_opt_tensor(&format!("{ctx}: aux"), &s.aux, &w["aux"]);
        check_opt_tensor(&format!("{ctx}: layers"), &s.layers, &w["layers"]);
        check_opt_tensor(
            &format!("{ctx}: final_hidden"),
            &s.final_hidden,
            &w["final_hidden"],
        );
        let named = w["named"].as_array().unwrap();
        let got_names: Vec<&str> = s.named.iter().map(|(n, _)| n.as_str()).collect();
        let want_names: Vec<&str> = named.iter().map(|p| p[0].as_str().unwrap()).collect();
        assert_eq!(got_names, want_names, "{ctx}: named");
        for ((n, t), p) in s.named.iter().zip(named) {
            check_tensor(&format!("{ctx}: named {n}"), t, &p[1]);
        }
        let meta: serde_json::Map<String, J> = s
            .meta
            .iter()
            .map(|(k, v)| (k.clone(), v.to_json()))
            .collect();
        assert_eq!(J::Object(meta), w["meta"], "{ctx}: meta");
    }
}

fn expected_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            expected_files(&p, out);
        } else if p.to_string_lossy().ends_with(".expected.json") {
            out.push(p);
        }
    }
}

#[test]
fn every_good_fixture_decodes_to_its_expected_values() {
    let mut files = Vec::new();
    expected_files(&fixtures(), &mut files);
    files.sort();
    // 17 good files today; fewer means the generator or the walk lost some.
    assert!(
        files.len() >= 17,
        "only {} expected.json files",
        files.len()
    );
    for exp in files {
        let data = PathBuf::from(
            exp.to_string_lossy()
                .strip_suffix(".expected.json")
                .unwrap(),
        );
        let expected: J = serde_json::from_slice(&std::fs::read(&exp).unwrap()).unwrap();
        check_file_against_expected(&data, &expected);
    }
}

#[test]
fn torch_views_keep_storage_offset_and_strides() {
    // base = arange(24).reshape(4, 6) / 4 - 2, checked here without the JSON.
    let v = read_torch(&fixture("torch/tensors.pt"), &Limits::default()).unwrap();
    let base: Vec<f32> = (0..24).map(|i| i as f32 / 4.0 - 2.0).collect();
    let at = |r: usize, c: usize| base[r * 6 + c];
    let get = |k: &str| v.get(k).and_then(Value::as_tensor).unwrap().clone();
    assert_eq!(get("base").to_f32_vec(), base);
    assert_eq!(get("rows_1_on").dims(), &[3, 6]);
    assert_eq!(get("rows_1_on").to_f32_vec(), base[6..].to_vec());
    let t = get("transposed");
    assert_eq!(t.dims(), &[6, 4]);
    let want: Vec<f32> = (0..6)
        .flat_map(|c| (0..4).map(move |r| (r, c)))
        .map(|(r, c)| at(r, c))
        .collect();
    assert_eq!(t.to_f32_vec(), want);
    let t = get("every_other_col");
    let want: Vec<f32> = (0..4)
        .flat_map(|r| [0, 2, 4].map(|c| (r, c)))
        .map(|(r, c)| at(r, c))
        .collect();
    assert_eq!(t.to_f32_vec(), want);
    // base[1:, 2:].t(): [4, 3], element (i, j) = base[1 + j][2 + i].
    let t = get("offset_transposed");
    assert_eq!(t.dims(), &[4, 3]);
    let want: Vec<f32> = (0..4)
        .flat_map(|i| (0..3).map(move |j| (1 + j, 2 + i)))
        .map(|(r, c)| at(r, c))
        .collect();
    assert_eq!(t.to_f32_vec(), want);
    assert_eq!(get("scalar").dims(), &[] as &[usize]);
    assert_eq!(get("scalar").to_f32_vec(), vec![3.5]);
    assert_eq!(get("empty").dims(), &[0, 3]);
    assert_eq!(
        get("i64").to_i64_vec().unwrap(),
        vec![0, -1, 1 << 40, -(1 << 40), 7]
    );
    assert_eq!(get("bool").to_i64_vec().unwrap(), vec![1, 0, 1, 1]);
    assert_eq!(v.get("big"), Some(&Value::Int(1 << 62)));
    assert_eq!(
        v.get("ids"),
        Some(&Value::Tuple(vec![
            Value::Int(1),
            Value::Int(2),
            Value::Int(3)
        ]))
    );
}

#[test]
fn protocol_4_pickles_decode_like_protocol_2() {
    let a = read_torch(&fixture("torch/tensors.pt"), &Limits::default()).unwrap();
    let b = read_torch(&fixture("torch/tensors_proto4.pt"), &Limits::default()).unwrap();
    assert_eq!(a, b);
}

#[test]
fn specforge_files_squeeze_the_batch_axis_and_split_batches() {
    for f in ["data_0.ckpt", "data_1.ckpt.gz"] {
        let s = read_capture_path(&fixture(&format!("specforge/rows_0-2/{f}"))).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].format, Format::SpecForge);
        assert_eq!(s[0].aux.as_ref().unwrap().dims(), &[6, 12]);
        assert_eq!(s[0].final_hidden.as_ref().unwrap().dims(), &[6, 4]);
        assert_eq!(s[0].token_ids.as_ref().unwrap().len(), 6);
    }
    let s = read_capture_path(&fixture("specforge/rows_0-2/data_2.ckpt")).unwrap();
    assert_eq!(s.len(), 2);
    assert_eq!((s[0].index, s[1].index), (0, 1));
    assert_eq!(s[1].aux.as_ref().unwrap().dims(), &[3, 6]);
}

#[test]
fn npy_void2_is_bf16_with_a_note_unless_disabled() {
    let p = fixture("plain/aux_bf16.npy");
    let s = read_capture_path(&p).unwrap();
    assert_eq!(s[0].aux.as_ref().unwrap().dtype, DType::BF16);
    assert!(
        s[0].notes.iter().any(|n| n.contains("bfloat16")),
        "{:?}",
        s[0].notes
    );
    let strict = Limits {
        npy_void2_as_bf16: false,
        ..Limits::default()
    };
    let e = read_capture_path_with(&p, &strict).unwrap_err();
    assert!(matches!(e, ReadError::UnsupportedDtype { .. }), "{e}");
}

#[test]
fn capture_files_lists_recognised_files_in_natural_order() {
    let files = capture_files(&fixture("specforge")).unwrap();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["data_0.ckpt", "data_1.ckpt.gz", "data_2.ckpt"]);
    let all = capture_files(&fixtures()).unwrap();
    assert!(all.iter().all(|p| kind_of_is_known(p)));
    assert!(!all.iter().any(|p| p.to_string_lossy().ends_with(".json")));
    let mut sorted = all.clone();
    sorted.sort_by(|a, b| layout::natural_cmp(&a.to_string_lossy(), &b.to_string_lossy()));
    assert_eq!(all, sorted);
    // A single file is returned as is; an unknown extension is refused.
    let one = fixture("plain/aux_f32.npy");
    assert_eq!(capture_files(&one).unwrap(), vec![one]);
    let e = capture_files(&fixture("versions.json")).unwrap_err();
    assert!(matches!(e, ReadError::UnknownExtension { .. }), "{e}");
}

fn kind_of_is_known(p: &Path) -> bool {
    let n = p.to_string_lossy();
    [".pt", ".ckpt", ".ckpt.gz", ".safetensors", ".npy", ".npz"]
        .iter()
        .any(|e| n.ends_with(e))
}

/// Reads an evil fixture and returns its error; the payload file must never appear.
fn evil(rel: &str) -> ReadError {
    let _ = std::fs::remove_file(PWNED);
    let p = fixture(rel);
    let r = read_capture_path(&p);
    assert!(!Path::new(PWNED).exists(), "{rel}: the payload ran");
    let e = match r {
        Ok(s) => panic!("{rel}: read {} samples instead of failing", s.len()),
        Err(e) => e,
    };
    assert_eq!(e.path(), p.as_path(), "{rel}: error names another file");
    let msg = e.to_string();
    assert!(msg.starts_with(&p.display().to_string()), "{rel}: {msg}");
    assert!(!msg.contains('\n'), "{rel}: message is not one line: {msg}");
    e
}

#[test]
fn pickles_calling_os_system_or_eval_are_refused_by_name() {
    for (rel, global) in [
        ("evil/os_system.pt", "posix.system"),
        ("evil/os_system_toplevel.ckpt", "posix.system"),
        ("evil/os_system_in_hooks.pt", "posix.system"),
        // protocol 2 spells builtins `__builtin__`.
        ("evil/builtins_eval.pt", "__builtin__.eval"),
        ("evil/subprocess_stack_global.pt", "subprocess.check_output"),
    ] {
        match evil(rel) {
            ReadError::PickleGlobal { global: g, .. } => assert_eq!(g, global, "{rel}"),
            e => panic!("{rel}: {e}"),
        }
    }
    let msg = evil("evil/os_system.pt").to_string();
    assert!(
        msg.contains("os_system.pt: pickle global posix.system (at byte ")
            && msg.ends_with(") is not allowed (only tensor-dict globals are)"),
        "{msg}"
    );
}

#[test]
fn forbidden_opcodes_are_refused_by_name() {
    for (rel, op) in [
        ("evil/inst_opcode.pt", "INST"),
        ("evil/ext1_opcode.pt", "EXT1"),
    ] {
        match evil(rel) {
            ReadError::PickleOpcode { opcode, .. } => {
                assert!(opcode.starts_with(op), "{rel}: {opcode}")
            }
            e => panic!("{rel}: {e}"),
        }
    }
}

#[test]
fn corrupt_and_hostile_files_give_the_right_error() {
    type Check = fn(&ReadError) -> bool;
    let cases: &[(&str, Check, &str)] = &[
        (
            "evil/legacy.pt",
            |e| matches!(e, ReadError::LegacyTorch { .. }),
            "unsupported legacy torch format",
        ),
        (
            "evil/truncated.pt",
            |e| matches!(e, ReadError::Format { .. }),
            "broken zip archive",
        ),
        (
            "evil/truncated.ckpt.gz",
            |e| matches!(e, ReadError::Format { .. }),
            "broken gzip stream",
        ),
        (
            "evil/huge_shape.pt",
            |e| {
                matches!(
                    e,
                    ReadError::Tensor {
                        error: TensorError::SizeOverflow { .. },
                        ..
                    }
                )
            },
            "overflows",
        ),
        (
            "evil/view_out_of_bounds.pt",
            |e| {
                matches!(
                    e,
                    ReadError::Tensor {
                        error: TensorError::ViewOutOfBounds { .. },
                        ..
                    }
                )
            },
            "reaches element 9999 of a storage of 12",
        ),
        (
            "evil/storage_too_short.pt",
            |e| {
                matches!(
                    e,
                    ReadError::SizeMismatch {
                        expected: 4_194_304,
                        got: 48,
                        ..
                    }
                )
            },
            "storage 0 declares 1048576 f32 (4 MiB) but the archive entry holds 48 bytes of data",
        ),
        (
            "evil/storage_missing.pt",
            |e| matches!(e, ReadError::Format { .. }),
            "no entry archive/data/7",
        ),
        (
            "evil/deep_nesting.pt",
            |e| {
                matches!(
                    e,
                    ReadError::PickleLimit {
                        what: "levels of nesting",
                        ..
                    }
                )
            },
            "200 levels of nesting",
        ),
        (
            "evil/cycle.pt",
            |e| {
                matches!(
                    e,
                    ReadError::PickleLimit {
                        what: "levels of nesting",
                        ..
                    }
                )
            },
            "levels of nesting",
        ),
        (
            "evil/billion_laughs.pt",
            |e| {
                matches!(
                    e,
                    ReadError::PickleLimit {
                        what: "values after expanding shared references",
                        ..
                    }
                )
            },
            "values after expanding shared references",
        ),
        (
            "evil/bad_memo.pt",
            |e| matches!(e, ReadError::Pickle { .. }),
            "memo entry 5 read before it was written",
        ),
        (
            "evil/stack_underflow.pt",
            |e| matches!(e, ReadError::Pickle { .. }),
            "SETITEM on an empty stack",
        ),
        (
            "evil/no_stop.pt",
            |e| matches!(e, ReadError::Pickle { .. }),
            "ends without STOP",
        ),
        (
            "evil/lying_header.npy",
            |e| matches!(e, ReadError::SizeMismatch { got: 1200, .. }),
            "lying_header.npy: header declares 4096x4096 f32 (64 MiB) but the file holds 1200 bytes of data",
        ),
        (
            "evil/overflow_shape.npy",
            |e| matches!(e, ReadError::ShapeOverflow { .. }),
            "overflows",
        ),
        (
            "evil/object_dtype.npy",
            |e| matches!(e, ReadError::UnsupportedDtype { .. }),
            "object arrays need pickle",
        ),
        (
            "evil/huge_shape.safetensors",
            |e| {
                matches!(
                    e,
                    ReadError::Header {
                        error: HeaderError::Overflow { .. },
                        ..
                    }
                )
            },
            "tensor x declares shape",
        ),
        (
            "evil/offsets_past_end.safetensors",
            |e| {
                matches!(
                    e,
                    ReadError::Header {
                        error: HeaderError::Outside { .. },
                        ..
                    }
                )
            },
            "data_offsets [0, 4096] lie outside the 16 bytes of data",
        ),
        (
            "evil/header_past_end.safetensors",
            |e| {
                matches!(
                    e,
                    ReadError::Header {
                        error: HeaderError::TooLarge { .. },
                        ..
                    }
                )
            },
            "safetensors header",
        ),
        (
            "evil/pickle_member.npz",
            |e| matches!(e, ReadError::Format { .. }),
            "member x.npy header: not an .npy",
        ),
    ];
    for (rel, check, text) in cases {
        let e = evil(rel);
        assert!(check(&e), "{rel}: wrong kind: {e:?}");
        assert!(e.to_string().contains(text), "{rel}: {e}");
    }
}

#[test]
fn limits_bound_gzip_and_pickle_sizes() {
    let small_gz = Limits {
        max_gzip_bytes: 100,
        ..Limits::default()
    };
    let e = read_capture_path_with(&fixture("specforge/rows_0-2/data_1.ckpt.gz"), &small_gz)
        .unwrap_err();
    assert!(matches!(e, ReadError::TooLarge { limit: 100, .. }), "{e}");
    let small_memo = Limits {
        max_pickle_memo: 4,
        ..Limits::default()
    };
    let e = read_capture_path_with(&fixture("torch/tensors.pt"), &small_memo).unwrap_err();
    assert!(
        matches!(
            e,
            ReadError::PickleLimit {
                what: "memo entries",
                ..
            }
        ),
        "{e}"
    );
    let no_copy = Limits {
        max_view_copy_bytes: 0,
        ..Limits::default()
    };
    let e = read_capture_path_with(&fixture("torch/tensors.pt"), &no_copy).unwrap_err();
    assert!(
        matches!(
            e,
            ReadError::Tensor {
                error: TensorError::CopyBudget { .. },
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn unknown_extension_and_missing_file() {
    let e = read_capture_path(&fixture("versions.json")).unwrap_err();
    assert!(matches!(e, ReadError::UnknownExtension { .. }), "{e}");
    let e = read_capture_path(&fixture("nope/data_0.ckpt")).unwrap_err();
    assert!(matches!(e, ReadError::Io { .. }), "{e}");
}

/// Truncates and corrupts good files at many places: every read must return, never panic.
#[test]
fn mutated_files_never_panic() {
    let dir = std::env::temp_dir().join(format!("eagle_check_readers_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut reads = 0;
    for rel in [
        "torch/tensors.pt",
        "specforge/rows_0-2/data_1.ckpt.gz",
        "plain/capture.safetensors",
        "plain/aux_f32.npy",
        "plain/fortran.npy",
        "plain/capture_deflated.npz",
    ] {
        let good = std::fs::read(fixture(rel)).unwrap();
        let name = Path::new(rel).file_name().unwrap();
        let out = dir.join(name);
        let step = (good.len() / 400).max(1);
        let mut variants: Vec<Vec<u8>> = (0..good.len())
            .step_by(step)
            .map(|n| good[..n].to_vec())
            .collect();
        for i in (0..good.len()).step_by(step) {
            for b in [0x00u8, 0xff, 0x80, b'K'] {
                let mut v = good.clone();
                v[i] = b;
                variants.push(v);
            }
        }
        for v in variants {
            std::fs::write(&out, &v).unwrap();
            let _ = read_capture_path(&out);
            reads += 1;
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(reads > 2000, "{reads}");
}

/// Gzip and deflate bombs: a few KB that inflate to far more than the ratio allows are refused
/// once the ratio is passed, whether the size is declared (zip) or only found (gzip).
#[test]
fn inflate_ratio_refuses_gzip_and_zip_bombs() {
    use std::io::Write;
    let dir = std::env::temp_dir().join(format!("eagle_check_bombs_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let zeros = vec![0u8; 16 << 20];
    let limits = Limits {
        inflate_floor_bytes: 1 << 20,
        ..Limits::default()
    };

    let gz = dir.join("bomb.ckpt.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    enc.write_all(&zeros).unwrap();
    let packed = enc.finish().unwrap();
    assert!(packed.len() < 100 << 10, "{}", packed.len());
    std::fs::write(&gz, &packed).unwrap();
    let e = read_capture_path_with(&gz, &limits).unwrap_err();
    match &e {
        ReadError::TooLarge { limit, .. } => assert_eq!(*limit, 100 * packed.len(), "{e}"),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("at most 100:1"), "{e}");

    let npz = dir.join("bomb.npz");
    let mut w = zip::ZipWriter::new(std::fs::File::create(&npz).unwrap());
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    w.start_file("x.npy", opts).unwrap();
    w.write_all(&zeros).unwrap();
    w.finish().unwrap();
    let e = read_capture_path_with(&npz, &limits).unwrap_err();
    assert!(matches!(e, ReadError::TooLarge { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("zip member x.npy of 16777216 bytes (deflated from"),
        "{e}"
    );
    // The same bytes stored (not deflated) are no bomb: the member is read, then refused as
    // what it is, not an .npy.
    let stored = dir.join("stored.npz");
    let mut w = zip::ZipWriter::new(std::fs::File::create(&stored).unwrap());
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    w.start_file("x.npy", opts).unwrap();
    w.write_all(&zeros).unwrap();
    w.finish().unwrap();
    let e = read_capture_path_with(&stored, &limits).unwrap_err();
    assert!(e.to_string().contains("not an .npy"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
