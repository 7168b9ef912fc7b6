//! Which draft architectures and config formats each serving engine version loads as an
//! EAGLE-3 drafter (FACTS.md section 8). A draft an engine cannot load fails at start-up
//! whatever its layer ids say.

use super::{Engine, EngineSel, Version, select};
use crate::config::{DraftConfig, DraftKind};

/// sglang's EAGLE-3 draft classes, by the first version that registers them:
/// `srt/models/llama_eagle3.py` `EntryClass = [LlamaForCausalLMEagle3]` (0.5.10 on) and
/// `srt/models/kimi_k25_eagle3.py` `EntryClass = [Eagle3DeepseekV2ForCausalLM]` (0.5.14 on).
/// No version rewrites a draft's `architectures` for EAGLE-3 (`configs/model_config.py` renames
/// only NextN/MTP drafts), so a `LlamaForCausalLM` draft loads as the target class.
const SGLANG_DRAFTS: &[(&str, Version)] = &[
    ("LlamaForCausalLMEagle3", Version([0, 5, 10])),
    ("Eagle3DeepseekV2ForCausalLM", Version([0, 5, 14])),
];

/// vLLM 0.33.0 `model_executor/models/registry.py` `_SPECULATIVE_DECODING_MODELS`: the names
/// that load an EAGLE-3 drafter, after `transformers_utils/configs/eagle.py`
/// `EAGLEConfig.__init__` prefixes `Eagle3` to every architecture that neither starts nor ends
/// with it.
const VLLM_DRAFTS: &[&str] = &[
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLMEagle3",
    "Eagle3MiniMaxM2ForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM",
    "Eagle3Qwen3vlForCausalLM",
    "Eagle3Qwen3ForCausalLM",
    "Eagle3DeepseekV2ForCausalLM",
    "Eagle3DeepseekV3ForCausalLM",
];

/// vLLM 0.33.0 `transformers_utils/configs/speculators/algos.py` `update_eagle3`: the inner
/// `model_type`s a speculators-format EAGLE-3 config may have (anything else raises ValueError).
const VLLM_SPECULATORS_TYPES: &[&str] = &["llama", "qwen3"];

/// Why `sel` cannot load `draft` as its EAGLE-3 drafter, with what to change; `None` when it can
/// (or when the engine loads no drafter, or was not audited for this).
pub fn draft_unsupported(sel: &EngineSel, draft: &DraftConfig) -> Option<(String, String)> {
    let rule = select(sel, None).rule;
    match sel.engine {
        Engine::Sglang => {
            if draft.kind == DraftKind::Speculators {
                return Some((
                    format!(
                        "sglang {} has no loader for speculators-format draft configs (no code in \
                         the wheel reads speculators_config)",
                        rule.since
                    ),
                    "serve it with vllm, which reads the format, or write the draft as a \
                     LlamaForCausalLMEagle3 config"
                        .into(),
                ));
            }
            let known = SGLANG_DRAFTS
                .iter()
                .any(|&(a, since)| a == draft.architecture && rule.since >= since);
            (!known).then(|| {
                let names: Vec<&str> = SGLANG_DRAFTS
                    .iter()
                    .filter(|&&(_, since)| rule.since >= since)
                    .map(|&(a, _)| a)
                    .collect();
                (
                    format!(
                        "sglang {} registers no EAGLE-3 draft class `{}` (its draft classes: {}); \
                         the server fails loading the draft",
                        rule.since,
                        draft.architecture,
                        names.join(", ")
                    ),
                    format!(
                        "set the draft config's architectures to [\"{}\"]",
                        if draft.kind == DraftKind::Eagle3Mla {
                            "Eagle3DeepseekV2ForCausalLM"
                        } else {
                            "LlamaForCausalLMEagle3"
                        }
                    ),
                )
            })
        }
        // extract_hidden_states stores the target's states and loads no drafter.
        Engine::Vllm if rule.path == "extract" => None,
        Engine::Vllm => {
            if draft.kind == DraftKind::Speculators {
                let inner = draft.model_type.as_deref().unwrap_or("llama");
                return (!VLLM_SPECULATORS_TYPES.contains(&inner)).then(|| {
                    (
                        format!(
                            "vllm {} reads speculators EAGLE-3 configs only for model_type {} \
                             (configs/speculators/algos.py), not `{inner}`",
                            rule.since,
                            VLLM_SPECULATORS_TYPES.join(" or ")
                        ),
                        "write the draft's transformer_layer_config as a llama model".into(),
                    )
                });
            }
            let arch = &draft.architecture;
            let name = if arch.starts_with("Eagle3") || arch.ends_with("Eagle3") {
                arch.clone()
            } else {
                format!("Eagle3{arch}")
            };
            (!VLLM_DRAFTS.contains(&name.as_str())).then(|| {
                (
                    format!(
                        "vllm {} registers no EAGLE-3 draft `{name}` (from architectures \
                         [\"{arch}\"]); the server fails loading the draft",
                        rule.since
                    ),
                    "set the draft config's architectures to [\"LlamaForCausalLMEagle3\"] when \
                     its layer is a Llama layer"
                        .into(),
                )
            })
        }
        _ => None,
    }
}
