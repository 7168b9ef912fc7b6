//! Parity helpers shared by the model tests: HF reference files, their token ids, and the worst
//! relative error of a capture against them.

use candle_core::{Device, Tensor};
use eagle_check::compare::closeness;
use eagle_check::config::ModelConfig;
use eagle_check::model::Capture;
use std::collections::HashMap;

/// A reference file under `fixtures/` (a `reference.safetensors` of the generators).
pub fn reference(rel: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(super::fixture(rel), &Device::Cpu).expect("reference file")
}

/// The reference's `input_ids` as the runner takes them.
pub fn ids(r: &HashMap<String, Tensor>) -> Vec<u32> {
    r["input_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

/// Worst relative error over every boundary, the pre-norm final state and the logits.
pub fn worst_error(
    name: &str,
    cfg: &ModelConfig,
    cap: &Capture,
    r: &HashMap<String, Tensor>,
) -> f64 {
    let mut worst = 0f64;
    let mut check = |label: String, got: &Tensor, key: &str| {
        let c = closeness(got, &r[key]).unwrap();
        assert_eq!(c.non_finite, 0, "{name} {label}");
        eprintln!(
            "{name} {label}: max rel {:.2e} (max abs {:.2e})",
            c.max_rel, c.max_abs
        );
        worst = worst.max(c.max_rel);
    };
    for b in 0..=cfg.num_layers {
        check(
            format!("b={b}"),
            &cap.hidden[&b],
            &format!("hidden_states.{b}"),
        );
    }
    check(
        "final_pre_norm".into(),
        cap.final_pre_norm.as_ref().unwrap(),
        "final_pre_norm",
    );
    check("logits".into(), cap.logits.as_ref().unwrap(), "logits");
    worst
}
