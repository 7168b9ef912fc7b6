//! Mixture-of-experts routing: one description every MoE family fills in ([`Routing`]), and the
//! per-token decision ([`route_token`]) that the model's CPU forward runs and the routing kernel
//! (kernels/moe.cu `moe_route`) is checked against. It depends on nothing else of ours, so the
//! model and the kernels both import it.
//!
//! What each family fills in (transformers 5.24):
//! - Qwen3-MoE / Qwen2-MoE: softmax over every expert, top k, renormalised over the picks when
//!   `norm_topk_prob` (`models/qwen3_moe/modeling_qwen3_moe.py` `Qwen3MoeTopKRouter.forward`;
//!   `models/qwen2_moe/modeling_qwen2_moe.py` `Qwen2MoeTopKRouter.forward`).
//! - gpt-oss: top k of the biased logits, then a softmax over the k picked logits
//!   (`models/gpt_oss/modeling_gpt_oss.py` `GptOssTopKRouter.forward`): the same decision as a
//!   softmax over every expert renormalised over the picks, so it is `Softmax` with
//!   `norm_topk`; the router's own bias is added to the logits before routing.
//! - MiniMax-M2: sigmoid scores, the top k of `score + e_score_correction_bias`, weights the
//!   unbiased scores renormalised (`models/minimax_m2/modeling_minimax_m2.py`
//!   `MiniMaxM2TopKRouter.forward`): `Sigmoid`, one group, `norm_topk`, scaling 1.
//! - DeepSeek-V3, Kimi-K2, GLM-4.5 (`noaux_tc`): sigmoid scores, groups ranked by the sum of
//!   their two best biased scores, the best `topk_group` groups kept, the top k biased scores
//!   among their experts, weights the unbiased scores renormalised (+1e-20) when
//!   `norm_topk_prob`, times `routed_scaling_factor`
//!   (`models/deepseek_v3/modeling_deepseek_v3.py` `DeepseekV3TopkRouter.forward`,
//!   `models/glm4_moe/modeling_glm4_moe.py` `Glm4MoeTopkRouter.forward`).

/// How a router turns its logits into per-expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// `softmax(logits)` over every expert, in f32 (transformers `softmax(dtype=torch.float)`).
    Softmax,
    /// `sigmoid(logits)` per expert.
    Sigmoid,
}

impl Scoring {
    pub fn name(self) -> &'static str {
        match self {
            Scoring::Softmax => "softmax",
            Scoring::Sigmoid => "sigmoid",
        }
    }
}

/// One MoE layer's routing: what a family's router computes from its logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routing {
    pub scoring: Scoring,
    /// Experts per token (`num_experts_per_tok`).
    pub k: usize,
    /// Expert groups (`n_group`; 1: no group limit).
    pub n_group: usize,
    /// Groups kept per token (`topk_group`; equal to `n_group`: no limit).
    pub topk_group: usize,
    /// Renormalise the picked scores to sum to one (`norm_topk_prob`).
    pub norm_topk: bool,
    /// Multiplies every weight after normalisation (`routed_scaling_factor`; applied in f32).
    pub scaling: f64,
}

impl Routing {
    /// Plain top-k (one group), scale 1.
    pub fn top_k(scoring: Scoring, k: usize, norm_topk: bool) -> Routing {
        Routing {
            scoring,
            k,
            n_group: 1,
            topk_group: 1,
            norm_topk,
            scaling: 1.0,
        }
    }

    /// Why `experts` experts cannot be routed this way, if they cannot.
    pub fn problem(&self, experts: usize) -> Option<String> {
        let g = self.n_group;
        if experts == 0 || g == 0 || !experts.is_multiple_of(g) {
            return Some(format!("{experts} experts do not split into {g} groups"));
        }
        if self.topk_group == 0
            || self.topk_group > g
            || self.k == 0
            || self.k > self.topk_group * (experts / g)
        {
            return Some(format!(
                "top {} experts from {} of {g} groups of {}",
                self.k,
                self.topk_group,
                experts / g
            ));
        }
        None
    }
}

/// One token's routing decision: experts in ascending order, their weights in the same order.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// The router's sigmoid: `1 / (1 + exp(-x))` with the exponential taken in f64 and rounded
/// once to f32. CUDA's f32 `expf` and the C library's differ by an ulp at times; their f64
/// `exp`s round to the same f32 (barring a 2^-29-wide window around a rounding boundary), so
/// this definition lets the GPU route bit for bit like the CPU.
pub fn router_sigmoid(x: f32) -> f32 {
    let e = (-f64::from(x)).exp() as f32;
    1.0 / (1.0 + e)
}

/// The router's softmax over one token's logits: `exp(x - max)` and their sum in f64, in
/// expert order, each probability rounded once to f32 (the routing kernel computes the same
/// sequence, so CPU and GPU agree bit for bit).
pub fn router_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f64> = logits
        .iter()
        .map(|&x| (f64::from(x) - f64::from(max)).exp())
        .collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|&e| (e / sum) as f32).collect()
}

/// Per-expert scores of one token's logits.
pub fn scores(logits: &[f32], scoring: Scoring) -> Vec<f32> {
    match scoring {
        Scoring::Softmax => router_softmax(logits),
        Scoring::Sigmoid => logits.iter().map(|&x| router_sigmoid(x)).collect(),
    }
}

/// `n` indices of the largest `values` (ties: the lower index first), in descending order.
fn top_n(values: &[f32], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(n);
    order
}

/// One token's routing from its per-expert `scores` ([`scores`]) and the selection-only
/// `bias` (`e_score_correction_bias`; zeros where a family has none).
///
/// The bias only steers the selection: groups are ranked by the sum of their two best biased
/// scores (a group of one: its score), the best `topk_group` groups are kept, and the top `k`
/// biased scores among their experts win (ties: the lower index). The weights are the
/// *unbiased* scores of the winners, normalised over the picks (+1e-20) when `norm_topk`, times
/// `scaling`. With one group and no bias this is plain top-k of the scores.
pub fn route_token(scores: &[f32], bias: &[f32], r: &Routing) -> Routed {
    let n = scores.len();
    let group_size = n / r.n_group.max(1);
    let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let kept: Vec<usize> = if r.topk_group >= r.n_group {
        (0..r.n_group).collect()
    } else {
        let group_scores: Vec<f32> = choice
            .chunks(group_size)
            .map(|g| top_n(g, 2).iter().map(|&i| g[i]).sum())
            .collect();
        top_n(&group_scores, r.topk_group)
    };
    let masked: Vec<f32> = choice
        .iter()
        .enumerate()
        .map(|(e, &c)| {
            if kept.contains(&(e / group_size)) {
                c
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let mut experts = top_n(&masked, r.k);
    experts.sort_unstable();
    let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
    if r.norm_topk {
        let denominator = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= denominator);
    }
    let factor = r.scaling as f32;
    weights.iter_mut().for_each(|w| *w *= factor);
    Routed { experts, weights }
}

/// [`route_token`] over every token of `logits` `[tokens, experts]`: the experts
/// `[tokens, k]` (ascending per token) and their weights `[tokens, k]`.
pub fn route_all(logits: &[f32], bias: &[f32], experts: usize, r: &Routing) -> Vec<Routed> {
    logits
        .chunks(experts.max(1))
        .map(|row| route_token(&scores(row, r.scoring), bias, r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grouped(n_group: usize, topk_group: usize) -> Routing {
        Routing {
            scoring: Scoring::Sigmoid,
            k: 2,
            n_group,
            topk_group,
            norm_topk: true,
            scaling: 2.0,
        }
    }

    #[test]
    fn group_limit_overrides_the_two_best_scores() {
        // Groups of two: {0,1} {2,3} {4,5} {6,7}. Experts 0 and 2 are the two best, but their
        // groups' partners are weak; group {6,7} has the best pair sum, then {4,5}.
        let scores = [0.95, 0.0, 0.9, 0.0, 0.6, 0.6, 0.7, 0.7];
        let bias = [0.0; 8];
        assert_eq!(route_token(&scores, &bias, &grouped(4, 2)).experts, [6, 7]);
        assert_eq!(route_token(&scores, &bias, &grouped(1, 1)).experts, [0, 2]);
        // Every group kept is no limit at all.
        assert_eq!(route_token(&scores, &bias, &grouped(4, 4)).experts, [0, 2]);
    }

    #[test]
    fn bias_selects_but_does_not_weigh() {
        let scores = [0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1];
        let mut bias = [0.0; 8];
        bias[3] = 1.0; // lifts expert 3 into the picks, not into the weights
        let r = route_token(&scores, &bias, &grouped(1, 1));
        assert_eq!(r.experts, [0, 3]);
        let (w0, w3) = (0.5 / 0.7 * 2.0, 0.2 / 0.7 * 2.0);
        assert!((r.weights[0] - w0).abs() < 1e-6 && (r.weights[1] - w3).abs() < 1e-6);
    }

    #[test]
    fn softmax_top_k_with_and_without_renormalising() {
        // Qwen3-MoE with norm_topk_prob: the picked probabilities sum to one; Qwen2-MoE without
        // it: they stay the full softmax's probabilities.
        let logits = [2.0f32, -1.0, 0.5, 3.0, 0.0, -2.0];
        let p = router_softmax(&logits);
        let total: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        for (pi, &x) in p.iter().zip(&logits) {
            assert!((f64::from(*pi) - f64::from(x).exp() / total).abs() < 1e-7);
        }
        let norm = route_token(&p, &[0.0; 6], &Routing::top_k(Scoring::Softmax, 2, true));
        assert_eq!(norm.experts, [0, 3]);
        assert!((norm.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // gpt-oss: a softmax over the two picked logits is the same decision.
        let e = (2.0f64 - 3.0).exp();
        assert!((f64::from(norm.weights[0]) - e / (1.0 + e)).abs() < 1e-6);
        let raw = route_token(&p, &[0.0; 6], &Routing::top_k(Scoring::Softmax, 2, false));
        assert_eq!(raw.weights, [p[0], p[3]]);
    }

    #[test]
    fn sigmoid_is_the_f64_one_rounded() {
        for x in [-30.0f32, -1.5, 0.0, 0.3, 7.0] {
            let want = (1.0 / (1.0 + (-f64::from(x)).exp())) as f32;
            assert!((router_sigmoid(x) - want).abs() <= f32::EPSILON * want);
        }
    }

    #[test]
    fn problems_are_named() {
        assert!(grouped(3, 1).problem(8).is_some());
        assert!(grouped(4, 5).problem(8).is_some());
        assert!(
            Routing::top_k(Scoring::Softmax, 9, true)
                .problem(8)
                .is_some()
        );
        assert!(grouped(4, 2).problem(8).is_none());
    }
}
