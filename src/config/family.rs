//! The family a target config belongs to: the name the engines' model files are keyed on, one
//! mapping for the rule table, the gate and the runner.
//!
//! A config names its architecture several ways: `model_type` (`gemma3_text` for the text
//! model alone, `gemma3` for the multimodal wrapper around the same text model),
//! `architectures[0]` (the class an engine instantiates: `Gemma3ForCausalLM`,
//! `Gemma3ForConditionalGeneration`) and a nested `text_config.model_type`. The engines serve
//! both spellings from one model file (sglang `gemma3_causal.py` / `gemma3_mm.py` share the text
//! model; vLLM `gemma3.py` / `gemma3_mm.py` likewise), and every audited verdict is the same for
//! a family's text class and its wrapper (`fixtures/engines/FACTS.md` round 2), so the rules are
//! keyed on the family. The class is kept for reports and for a rule that one day differs.

use super::ConfigFile;

/// A target's family and the class its config names.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Family {
    /// The family's name: a `model_type` with the text-model suffix dropped (`gemma3`,
    /// `llama4`, `qwen3_5_moe`, `qwen2_5_vl`, `deepseek_v3`, ...).
    pub name: String,
    /// `architectures[0]` as written (`Gemma3ForCausalLM`), when the config has one.
    pub class: Option<String>,
}

/// transformers names a multimodal model's text half `<family>_text`
/// (`Gemma3TextConfig.model_type = "gemma3_text"`, `Llama4TextConfig`, `Qwen3_5MoeTextConfig`,
/// `Qwen2_5_VLTextConfig`, ...): the same family as its wrapper.
const TEXT_SUFFIX: &str = "_text";

/// Classes whose family their config may not say (a config without `model_type`, or with a
/// `model_type` of another family's text model), from the engines' registries: sglang
/// `srt/models/*.py` `EntryClass`, vLLM `model_executor/models/registry.py` (0.5.23 / 0.33.0).
const CLASSES: &[(&str, &str)] = &[
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("Qwen2MoeForCausalLM", "qwen2_moe"),
    ("Qwen3MoeForCausalLM", "qwen3_moe"),
    ("Qwen3NextForCausalLM", "qwen3_next"),
    ("Qwen3_5ForCausalLM", "qwen3_5"),
    ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
    ("Qwen3_5MoeForCausalLM", "qwen3_5_moe"),
    ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
    ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
    ("Qwen3VLForConditionalGeneration", "qwen3_vl"),
    ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
    ("Gemma3ForCausalLM", "gemma3"),
    ("Gemma3ForConditionalGeneration", "gemma3"),
    ("Gemma4ForCausalLM", "gemma4"),
    ("Gemma4ForConditionalGeneration", "gemma4"),
    ("Llama4ForCausalLM", "llama4"),
    ("Llama4ForConditionalGeneration", "llama4"),
    ("Phi3ForCausalLM", "phi3"),
    ("GptOssForCausalLM", "gpt_oss"),
    ("Glm4MoeForCausalLM", "glm4_moe"),
    ("Glm4MoeLiteForCausalLM", "glm4_moe_lite"),
    ("MiniMaxM2ForCausalLM", "minimax_m2"),
    ("DeepseekV2ForCausalLM", "deepseek_v2"),
    ("DeepseekV3ForCausalLM", "deepseek_v3"),
    ("DeepseekV32ForCausalLM", "deepseek_v32"),
    ("KimiK25ForConditionalGeneration", "kimi_k25"),
    ("BailingMoeV2ForCausalLM", "bailing_moe_v2"),
    ("LongcatFlashForCausalLM", "longcat_flash"),
];

/// The family a bare `model_type` names (`gemma3_text` -> `gemma3`).
pub fn family_name(model_type: &str) -> String {
    model_type
        .strip_suffix(TEXT_SUFFIX)
        .filter(|s| !s.is_empty())
        .unwrap_or(model_type)
        .to_string()
}

/// The family of a class name, when the registries list it.
pub fn family_of_class(class: &str) -> Option<&'static str> {
    CLASSES.iter().find(|(c, _)| *c == class).map(|&(_, f)| f)
}

impl Family {
    /// The family of a `config.json`: the top level's `model_type` (the wrapper's, which is the
    /// family of the text model it wraps), else the text model's, else the class's.
    pub fn of(raw: &ConfigFile) -> Option<Family> {
        let class = raw.architectures.first().cloned();
        let inner = raw
            .text_config
            .as_ref()
            .and_then(|t| t.model_type.as_deref());
        let name = raw
            .model_type
            .as_deref()
            .or(inner)
            .map(family_name)
            .or_else(|| {
                class
                    .as_deref()
                    .and_then(family_of_class)
                    .map(str::to_string)
            })?;
        Some(Family { name, class })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: &str) -> ConfigFile {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn text_models_and_their_wrappers_are_one_family() {
        for (json, want) in [
            (r#"{"model_type": "gemma3_text"}"#, "gemma3"),
            (
                r#"{"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}"#,
                "gemma3",
            ),
            (r#"{"model_type": "gemma4_text"}"#, "gemma4"),
            (
                r#"{"model_type": "llama4", "text_config": {"model_type": "llama4_text"}}"#,
                "llama4",
            ),
            (r#"{"model_type": "qwen3_5_moe_text"}"#, "qwen3_5_moe"),
            (r#"{"model_type": "qwen2_5_vl"}"#, "qwen2_5_vl"),
            (
                r#"{"text_config": {"model_type": "llama4_text"}}"#,
                "llama4",
            ),
            (r#"{"architectures": ["Gemma3ForCausalLM"]}"#, "gemma3"),
            (r#"{"model_type": "llama"}"#, "llama"),
            (
                r#"{"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}}"#,
                "kimi_k25",
            ),
        ] {
            assert_eq!(Family::of(&cfg(json)).unwrap().name, want, "{json}");
        }
        assert_eq!(Family::of(&cfg("{}")), None);
        assert_eq!(family_name("_text"), "_text");
        let wrapped = Family::of(&cfg(
            r#"{"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}"#,
        ))
        .unwrap();
        assert_eq!(
            wrapped.class.as_deref(),
            Some("Gemma3ForConditionalGeneration")
        );
    }
}
