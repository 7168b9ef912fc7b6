//! The MLA-attention EAGLE-3 draft (`Eagle3DeepseekV2ForCausalLM`, issue 5 item 3) against
//! fixtures/gen_mla_draft.py's PyTorch forward (itself cross-checked against transformers'
//! `DeepseekV3Attention` with 2H-wide down projections), and through `eagle-check run`.

use crate::support::{eagle_check, fixture, p, scratch};
use candle_core::{DType, Device, Tensor};
use eagle_check::compare::closeness;
use eagle_check::config::{DraftConfig, DraftKind, ModelConfig};
use eagle_check::model::draft::{DraftOutput, Eagle3Draft};
use eagle_check::model::load_target;
use eagle_check::model::source::{SafetensorsSource, Vb};
use std::collections::HashMap;
use std::path::Path;

/// The f32 parity bound, with its reason: `eagle_check::tolerance::PARITY_F32`.
const F32_TOL: f64 = eagle_check::tolerance::PARITY_F32;

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        fixture("models/mla-draft/draft_reference.safetensors"),
        &Device::Cpu,
    )
    .expect("reference file")
}

/// Runs the draft in `ddir` on the reference inputs with the deepseek_v3 target's embeddings.
fn run_draft(ddir: &Path, r: &HashMap<String, Tensor>) -> DraftOutput {
    let tdir = fixture("models/deepseek_v3");
    let tcfg = ModelConfig::load(&tdir).unwrap();
    let tsrc = SafetensorsSource::open(&tdir).unwrap();
    let target = load_target(&tcfg, &tsrc, DType::F32, &Device::Cpu).unwrap();
    let dcfg = DraftConfig::load(ddir).unwrap();
    assert_eq!(dcfg.kind, DraftKind::Eagle3Mla);
    let dsrc = SafetensorsSource::open(ddir).unwrap();
    let vb = Vb::new(&dsrc, DType::F32, &Device::Cpu);
    let draft = Eagle3Draft::load(&dcfg, &vb, tcfg.hidden_size, 3).unwrap();
    let ids: Vec<u32> = r["draft_input_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect();
    draft
        .forward(&ids, &r["draft_fc_input"], target.embeddings())
        .unwrap()
}

fn check_parity(ddir: &Path) {
    let r = reference();
    let out = run_draft(ddir, &r);
    let c = closeness(&out.logits, &r["draft_logits"]).unwrap();
    eprintln!("mla-draft logits: max rel {:.2e}", c.max_rel);
    assert_eq!(c.non_finite, 0);
    assert!(c.max_rel <= F32_TOL, "max rel {:.3e}", c.max_rel);
    let want: Vec<i64> = r["draft_next_target_ids"].to_vec1::<i64>().unwrap();
    assert_eq!(out.next_target_ids, want, "greedy draft tokens through d2t");
}

#[test]
fn mla_draft_logits_match_the_pytorch_reference() {
    check_parity(&fixture("models/mla-draft"));
}

/// vLLM and ModelOpt's `KIMIK2_EAGLE_SINGLE_LAYER` export write `layers.0.` where TorchSpec
/// writes `midlayer.`: the same weights under the other prefix give the same logits.
#[test]
fn mla_draft_loads_under_the_vllm_layer_prefix() {
    let src = fixture("models/mla-draft");
    let dir = scratch("mla-draft-layers0");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    // Rename in the header only (candle cannot load the BOOL `t2d`); data offsets are relative
    // to the data section, so the bytes after the header are copied as they are.
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let renamed: serde_json::Map<String, serde_json::Value> = header
        .into_iter()
        .map(|(k, v)| (k.replace("midlayer.", "layers.0."), v))
        .collect();
    assert!(renamed.contains_key("layers.0.self_attn.kv_a_proj_with_mqa.weight"));
    let mut text = serde_json::to_string(&renamed).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    check_parity(&dir);
}

/// `eagle-check run` on the MLA draft: the engine's fc input goes through the MLA draft layer and
/// the report carries its greedy agreement with the target. The random-weight draft agrees with
/// the target at none of the 11 positions, so "0/11" alone would also pass for a draft that
/// never ran right: the dumped draft logits and tokens must be the PyTorch reference's. The
/// reference fed b = [1, 2, 3] (ids [0, 1, 2], OUT); sglang 0.5.10 adds 1 to every id on DeepSeek
/// targets (newer sglang reads a first id of 0 raw, PR 25454), so it feeds the same boundaries.
#[test]
fn run_executes_the_mla_draft() {
    let dump = scratch("mla-run").join("dump.safetensors");
    let tokens: Vec<String> = reference()["input_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    let out = eagle_check([
        "run",
        "--target",
        &p(&fixture("models/deepseek_v3")),
        "--draft",
        &p(&fixture("models/mla-draft")),
        "--engine",
        "sglang@0.5.10",
        "--tokens",
        &tokens.join(","),
        "--dump",
        &p(&dump),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let json = out.json();
    assert_eq!(json["subject"]["fed_b"], "[1, 2, 3]", "{json}");
    let dumped = candle_core::safetensors::load(&dump, &Device::Cpu).unwrap();
    let r = reference();
    let c = closeness(&dumped["draft_logits"], &r["draft_logits"]).unwrap();
    assert!(
        c.max_rel <= F32_TOL,
        "run's draft logits: max rel {:.3e}",
        c.max_rel
    );
    assert_eq!(
        dumped["draft_next_target_ids"].to_vec1::<i64>().unwrap(),
        r["draft_next_target_ids"].to_vec1::<i64>().unwrap(),
        "run's greedy draft tokens"
    );
    // The reference draft tokens (row t: feature t, embedding of token t + 1) against the
    // target's greedy token at t + 1, from the two reference files.
    let next = r["draft_next_target_ids"].to_vec1::<i64>().unwrap();
    let target = candle_core::safetensors::load(
        fixture("models/deepseek_v3/reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let greedy: Vec<i64> = target["logits"]
        .argmax(1)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec1()
        .unwrap();
    let agree = next
        .iter()
        .zip(&greedy[1..])
        .filter(|(a, b)| a == b)
        .count();
    assert_eq!(
        json["subject"]["draft_top1"],
        format!("{agree}/11 positions agree with the target's greedy token"),
        "{json}"
    );
}
