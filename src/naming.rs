//! Checkpoint naming rules, said once: where a target's decoder and head live, and how EAGLE-3
//! drafts name their tensors. The gate (headers only) and every loader ask here, so a naming
//! scheme added for one is known to all.
//!
//! Each rule takes `has`, a question "does the checkpoint hold this tensor name?", so it works
//! the same over a header index and over a weight source.

/// Where a target's decoder sits: plain HF causal LMs (`model.`), and the text model of a
/// multimodal wrapper (transformers 5 `model.language_model.`; older wrappers
/// `language_model.model.`, e.g. LLaVA-style checkpoints).
pub const DECODER_PREFIXES: [&str; 3] = ["model", "model.language_model", "language_model.model"];

/// The output head, for the same wrappers.
pub const LM_HEAD_NAMES: [&str; 2] = ["lm_head.weight", "language_model.lm_head.weight"];

/// The decoder prefix whose `embed_tokens.weight` the checkpoint holds.
pub fn decoder_prefix(has: &dyn Fn(&str) -> bool) -> Option<&'static str> {
    DECODER_PREFIXES
        .into_iter()
        .find(|p| has(&format!("{p}.embed_tokens.weight")))
}

/// The output head's name, when the checkpoint has one.
pub fn lm_head_name(has: &dyn Fn(&str) -> bool) -> Option<&'static str> {
    LM_HEAD_NAMES.into_iter().find(|n| has(n))
}

/// The decoder layer a tensor belongs to (`model.layers.3.mlp.up_proj.weight` -> 3), under any
/// of the [`DECODER_PREFIXES`].
pub fn layer_of(name: &str) -> Option<usize> {
    DECODER_PREFIXES.iter().find_map(|p| {
        name.strip_prefix(p)
            .and_then(|rest| rest.strip_prefix(".layers."))
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
    })
}

/// Decoder layers past `num_layers` that a checkpoint may carry without the target using them:
/// DeepSeek-V3 ships its multi-token-prediction module as `model.layers.61`
/// (`num_nextn_predict_layers`), which the target forward never runs.
/// Qwen3.5 ships its own as `mtp.*` (`Qwen3_5MoeForCausalLM._keys_to_ignore_on_load_unexpected`).
pub fn is_extra_layer(name: &str, num_layers: usize) -> bool {
    name.starts_with("mtp.") || layer_of(name).is_some_and(|i| i >= num_layers)
}

/// The towers of a multimodal checkpoint that are not its text model (Gemma-3's SigLIP
/// `vision_tower` and `multi_modal_projector`, Gemma-4's vision and audio towers and their
/// embedders, Qwen2.5-VL's / Qwen3-VL's `visual`; under
/// `model.` in transformers 5, at the top level in older exports): a text-only target never
/// reads them.
pub fn is_other_tower(name: &str) -> bool {
    const TOWERS: [&str; 7] = [
        "vision_tower.",
        "multi_modal_projector.",
        "visual.",
        // Llama-4's (`Llama4ForConditionalGeneration.vision_model`).
        "vision_model.",
        // Gemma-4's (`Gemma4Model`: `embed_vision`, `audio_tower`, `embed_audio`).
        "embed_vision.",
        "audio_tower.",
        "embed_audio.",
    ];
    let rest = name.strip_prefix("model.").unwrap_or(name);
    TOWERS.iter().any(|t| rest.starts_with(t))
}

/// Non-parameter buffers older exports save beside the weights (transformers 4 wrote
/// `rotary_emb.inv_freq` into some checkpoints); no loader reads them.
pub fn is_ignored_buffer(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// A checkpoint tensor no target loader reads: layers past `num_layers`, saved buffers, other
/// towers, and with `tied` embeddings a stored copy of the head (transformers ties the head to
/// the embeddings and ignores it).
pub fn is_never_loaded(name: &str, num_layers: usize, tied: bool) -> bool {
    is_extra_layer(name, num_layers)
        || is_ignored_buffer(name)
        || is_other_tower(name)
        || (tied && LM_HEAD_NAMES.contains(&name))
}

/// Where an EAGLE-3 draft's tensors sit: SpecForge saves them at the top level, some exports
/// under `model.`.
pub const DRAFT_ROOTS: [&str; 2] = ["", "model"];

/// The draft's one decoder layer: SpecForge and sglang call it `midlayer`, vLLM renames it
/// `layers.0` (vllm/model_executor/models/llama_eagle3.py).
pub const DRAFT_LAYERS: [&str; 2] = ["midlayer", "layers.0"];

/// `d2t` (SpecForge, sglang) or vLLM's `draft_id_to_target_id`.
pub const DRAFT_D2T: [&str; 2] = ["d2t", "draft_id_to_target_id"];

/// A draft tensor's name under one root: `join("model", "fc.weight")` = `model.fc.weight`.
pub fn join(root: &str, name: &str) -> String {
    if root.is_empty() {
        name.to_string()
    } else {
        format!("{root}.{name}")
    }
}

/// The draft root that holds `fc.weight`.
pub fn draft_root(has: &dyn Fn(&str) -> bool) -> Option<&'static str> {
    DRAFT_ROOTS.into_iter().find(|r| has(&join(r, "fc.weight")))
}

/// The draft layer's prefix under `root`, told by its `hidden_norm` (every EAGLE-3 draft layer
/// has one).
pub fn draft_layer(root: &str, has: &dyn Fn(&str) -> bool) -> Option<&'static str> {
    DRAFT_LAYERS
        .into_iter()
        .find(|l| has(&join(root, &format!("{l}.hidden_norm.weight"))))
}

/// What a draft tensor is: `Top(name)` under the root (`fc.weight`, `lm_head.weight`, `d2t`),
/// `Layer(name)` inside the draft layer (`self_attn.q_proj.weight`).
#[derive(Debug, Clone, Copy)]
pub enum DraftTensor<'a> {
    Top(&'a str),
    Layer(&'a str),
}

/// Every full name a draft tensor may carry, in the order the loaders try them.
pub fn draft_names(tensor: DraftTensor) -> Vec<String> {
    let mut names = Vec::new();
    for root in DRAFT_ROOTS {
        match tensor {
            DraftTensor::Top(name) => names.push(join(root, name)),
            DraftTensor::Layer(name) => {
                for layer in DRAFT_LAYERS {
                    names.push(join(root, &format!("{layer}.{name}")));
                }
            }
        }
    }
    names
}

/// The first name of `tensor` the checkpoint holds.
pub fn find_draft(tensor: DraftTensor, has: &dyn Fn(&str) -> bool) -> Option<String> {
    draft_names(tensor).into_iter().find(|n| has(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holds<'a>(names: &'a [&'a str]) -> impl Fn(&str) -> bool + 'a {
        move |n| names.contains(&n)
    }

    #[test]
    fn decoder_prefixes_cover_multimodal_wrappers() {
        for (name, want) in [
            ("model.embed_tokens.weight", "model"),
            (
                "model.language_model.embed_tokens.weight",
                "model.language_model",
            ),
            (
                "language_model.model.embed_tokens.weight",
                "language_model.model",
            ),
        ] {
            assert_eq!(decoder_prefix(&holds(&[name])), Some(want));
        }
        assert_eq!(decoder_prefix(&holds(&["embed_tokens.weight"])), None);
        assert_eq!(
            lm_head_name(&holds(&["language_model.lm_head.weight"])),
            Some("language_model.lm_head.weight")
        );
    }

    #[test]
    fn extra_layers_are_those_past_the_config() {
        assert!(is_extra_layer("model.layers.61.eh_proj.weight", 61));
        assert!(!is_extra_layer("model.layers.60.mlp.gate.weight", 61));
        assert!(is_extra_layer(
            "model.language_model.layers.4.mlp.up_proj.weight",
            4
        ));
        assert!(!is_extra_layer("model.norm.weight", 4));
    }

    #[test]
    fn draft_names_follow_specforge_and_vllm() {
        let vllm = ["model.fc.weight", "model.layers.0.hidden_norm.weight"];
        let has = holds(&vllm);
        assert_eq!(draft_root(&has), Some("model"));
        assert_eq!(draft_layer("model", &has), Some("layers.0"));
        let specforge = ["fc.weight", "midlayer.hidden_norm.weight"];
        let has = holds(&specforge);
        assert_eq!(draft_root(&has), Some(""));
        assert_eq!(draft_layer("", &has), Some("midlayer"));
        assert_eq!(
            find_draft(
                DraftTensor::Layer("hidden_norm.weight"),
                &holds(&["model.midlayer.hidden_norm.weight"])
            )
            .as_deref(),
            Some("model.midlayer.hidden_norm.weight")
        );
    }
}
