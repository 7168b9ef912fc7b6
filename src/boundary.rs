//! The one canonical index for a captured hidden state: the boundary `b`.
//!
//! `b` is the index into HF transformers' `output_hidden_states`: `b = 0` is the embedding
//! output, `b = k` (0 < k < L) the residual stream after decoder layer `k - 1`, and `b = L`
//! the state after the last layer. At `b = L` HF returns the state *after* the final norm while
//! vLLM, sglang (PR 32334) and TorchSpec capture it *before*; [`FinalNorm`] keeps the two apart.
//! Every other way of naming a layer converts to `b` here, at the edge, once.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A residual-stream boundary, `0..=num_layers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Boundary(pub usize);

impl Boundary {
    pub const EMBEDDING: Boundary = Boundary(0);

    pub fn index(self) -> usize {
        self.0
    }

    pub fn is_embedding(self) -> bool {
        self.0 == 0
    }

    /// True for the state after the last decoder layer, where pre- and post-norm differ.
    pub fn is_final(self, num_layers: usize) -> bool {
        self.0 == num_layers
    }
}

impl fmt::Display for Boundary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Which side of the target's final norm a `b = L` capture sits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FinalNorm {
    /// Before `model.norm`: what vLLM, sglang and TorchSpec capture.
    #[serde(alias = "pre-norm")]
    Pre,
    /// After `model.norm`: what HF `output_hidden_states[-1]` returns (SpecForge, ModelOpt).
    #[serde(alias = "post-norm")]
    Post,
}

impl FinalNorm {
    /// The word a capture spec's `final_norm` takes (`pre`, `post`); reports say `pre-norm`.
    pub fn spec_word(self) -> &'static str {
        match self {
            FinalNorm::Pre => "pre",
            FinalNorm::Post => "post",
        }
    }
}

impl fmt::Display for FinalNorm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FinalNorm::Pre => "pre-norm",
            FinalNorm::Post => "post-norm",
        })
    }
}

/// The two ways of writing a layer id, one apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Convention {
    /// "Output of layer k": `b = k + 1` (SpecForge, TensorRT-LLM, ModelOpt, sglang's explicit ids).
    Out,
    /// "Input of layer k": `b = k` (EAGLE reference code, vLLM).
    In,
}

impl Convention {
    /// The boundary a layer id names, or `None` when it falls outside `0..=num_layers`.
    pub fn to_boundary(self, id: i64, num_layers: usize) -> Option<Boundary> {
        let b = match self {
            Convention::Out => id.checked_add(1)?,
            Convention::In => id,
        };
        let b = usize::try_from(b).ok()?;
        (b <= num_layers).then_some(Boundary(b))
    }

    /// The layer id that names boundary `b` in this convention.
    pub fn to_id(self, b: Boundary) -> i64 {
        let b = b.0 as i64;
        match self {
            Convention::Out => b - 1,
            Convention::In => b,
        }
    }
}

/// The boundaries both EAGLE defaults select: OUT `[1, L/2-1, L-4]` = IN `[2, L/2, L-3]`.
pub fn default_boundaries(num_layers: usize) -> Vec<Boundary> {
    vec![
        Boundary(2),
        Boundary(num_layers / 2),
        Boundary(num_layers.saturating_sub(3)),
    ]
}

/// Formats boundaries as `[2, 30, 58]`.
pub fn format_list(bs: &[Boundary]) -> String {
    let parts: Vec<String> = bs.iter().map(|b| b.0.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_agree_in_both_spellings() {
        // The brief's table: OUT [1, L//2-1, L-4] and IN [2, L//2, L-3] are the same tensors.
        for l in [32usize, 61, 6] {
            let out: Vec<Boundary> = [1, (l / 2) as i64 - 1, l as i64 - 4]
                .iter()
                .map(|&k| Convention::Out.to_boundary(k, l).unwrap())
                .collect();
            assert_eq!(out, default_boundaries(l));
        }
        assert_eq!(
            default_boundaries(61),
            vec![Boundary(2), Boundary(30), Boundary(58)]
        );
        assert_eq!(
            default_boundaries(32),
            vec![Boundary(2), Boundary(16), Boundary(29)]
        );
    }

    #[test]
    fn conventions_are_one_apart_and_bounded() {
        assert_eq!(Convention::Out.to_boundary(-1, 61), Some(Boundary(0)));
        assert_eq!(Convention::In.to_boundary(-1, 61), None);
        assert_eq!(Convention::In.to_boundary(61, 61), Some(Boundary(61)));
        assert_eq!(Convention::Out.to_boundary(61, 61), None);
        assert_eq!(Convention::Out.to_id(Boundary(30)), 29);
        assert_eq!(Convention::In.to_id(Boundary(30)), 30);
        assert_eq!(Convention::Out.to_boundary(i64::MAX, 61), None);
    }
}
