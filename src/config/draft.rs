//! EAGLE-3 draft configs: SpecForge/sglang `LlamaForCausalLMEagle3`, the EAGLE reference's
//! `LlamaForCausalLM` draft, speculators-format `eagle3`, and the MLA draft
//! `Eagle3DeepseekV2ForCausalLM` (TorchSpec `configs/draft_models/kimi_k25_eagle3_mla.json`).

use super::{ConfigFile, MAX_LAYERS, MlaConfig, Rope, read_config_file, resolve_rope, within};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// `eagle_config` as SpecForge, sglang and TorchSpec write it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct EagleConfigFile {
    pub eagle_aux_hidden_state_layer_ids: Option<Vec<i64>>,
    pub use_aux_hidden_state: Option<bool>,
    pub use_input_layernorm_in_first_layer: Option<bool>,
    pub use_last_layernorm: Option<bool>,
    pub use_mtp_layernorm: Option<bool>,
}

/// Mirror of a draft `config.json`: an HF model config plus the EAGLE-3 keys.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct DraftConfigFile {
    #[serde(flatten)]
    pub model: ConfigFile,
    pub eagle_config: Option<EagleConfigFile>,
    pub eagle_aux_hidden_state_layer_ids: Option<Vec<i64>>,
    pub draft_vocab_size: Option<usize>,
    pub target_hidden_size: Option<usize>,
    pub num_aux_hidden_states: Option<usize>,
    pub norm_before_fc: Option<bool>,
    pub norm_before_residual: Option<bool>,
    pub bias: Option<bool>,
    /// The target's `model_type`, as SpecForge's draft configs record it.
    pub target_model_type: Option<String>,
    // speculators format
    pub speculators_model_type: Option<String>,
    pub transformer_layer_config: Option<ConfigFile>,
}

/// Which draft family a config describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DraftKind {
    /// `LlamaForCausalLMEagle3` (SpecForge, sglang, vLLM).
    Eagle3Llama,
    /// The EAGLE reference's `LlamaForCausalLM` draft config (vLLM loads it as
    /// `Eagle3LlamaForCausalLM`; sglang, which does not rename it, as a plain target).
    EagleReference,
    /// speculators `eagle3` format (`transformer_layer_config` nested).
    Speculators,
    /// `Eagle3DeepseekV2ForCausalLM`: MLA attention in the draft layer.
    Eagle3Mla,
}

/// The ids a draft config holds, by where they are written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftIds {
    /// Top-level `eagle_aux_hidden_state_layer_ids`.
    pub top: Option<Vec<i64>>,
    /// `eagle_config.eagle_aux_hidden_state_layer_ids`.
    pub nested: Option<Vec<i64>>,
}

impl DraftIds {
    pub fn nested(ids: &[i64]) -> DraftIds {
        DraftIds {
            top: None,
            nested: Some(ids.to_vec()),
        }
    }

    pub fn any(&self) -> Option<&[i64]> {
        self.nested.as_deref().or(self.top.as_deref())
    }
}

/// A resolved draft config.
#[derive(Debug, Clone)]
pub struct DraftConfig {
    pub path: PathBuf,
    pub kind: DraftKind,
    pub architecture: String,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub draft_vocab_size: usize,
    pub rms_norm_eps: f64,
    /// The draft layer's rope, or why the runner cannot build it: the static checks never need
    /// it, so a rope type the runner does not know is refused only when the draft is run.
    pub rope: std::result::Result<Rope, String>,
    /// The target's hidden size as the draft declares it; `None` means "same as the draft's".
    pub target_hidden_size: Option<usize>,
    /// The layer ids as written: top level and under `eagle_config` (engines read different
    /// ones: see `engine::rules::IdsFrom`).
    pub ids: DraftIds,
    pub num_aux_hidden_states: Option<usize>,
    pub norm_before_fc: bool,
    pub norm_before_residual: bool,
    pub mla: Option<MlaConfig>,
    /// The target's `model_type` the draft config says it was trained for, if it says.
    pub target_model_type: Option<String>,
    /// The draft layer's own `model_type` (a speculators config's `transformer_layer_config`).
    pub model_type: Option<String>,
}

impl DraftConfig {
    /// Loads and resolves a draft config (a directory or a `config.json`).
    pub fn load(path: &Path) -> Result<DraftConfig> {
        let (file, _) = read_config_file(path)?;
        let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
        let raw: DraftConfigFile = serde_json::from_str(&text).map_err(|error| Error::Json {
            path: file.clone(),
            error,
        })?;
        DraftConfig::resolve(&raw, &file)
    }

    pub fn resolve(raw: &DraftConfigFile, path: &Path) -> Result<DraftConfig> {
        raw.model.check_sizes(path)?;
        if let Some(inner) = &raw.transformer_layer_config {
            inner.check_sizes(path)?;
        }
        for (key, value) in [
            ("draft_vocab_size", raw.draft_vocab_size),
            ("target_hidden_size", raw.target_hidden_size),
            ("num_aux_hidden_states", raw.num_aux_hidden_states),
        ] {
            if let Some(v) = value {
                within(v, path, key)?;
            }
        }
        let nested = raw
            .eagle_config
            .as_ref()
            .and_then(|e| e.eagle_aux_hidden_state_layer_ids.as_ref());
        for ids in [raw.eagle_aux_hidden_state_layer_ids.as_ref(), nested]
            .into_iter()
            .flatten()
        {
            // Ids past the target are findings (engines drop or refuse them); ids past any
            // real model are refused here, before the rules add or subtract one.
            if let Some(bad) = ids.iter().find(|&&k| k.unsigned_abs() > MAX_LAYERS as u64) {
                return Err(Error::config(
                    path,
                    format!(
                        "eagle_aux_hidden_state_layer_ids holds {bad}, past any model's layers \
                         (eagle-check accepts ids within +-{MAX_LAYERS})"
                    ),
                ));
            }
            if ids.len() > MAX_LAYERS {
                return Err(Error::config(
                    path,
                    format!(
                        "eagle_aux_hidden_state_layer_ids holds {} ids (at most {MAX_LAYERS})",
                        ids.len()
                    ),
                ));
            }
        }
        let speculators = raw.speculators_model_type.as_deref();
        let (kind, model) = match speculators {
            Some("eagle3") => {
                let inner = raw.transformer_layer_config.as_ref().ok_or_else(|| {
                    Error::config(
                        path,
                        "speculators eagle3 config without `transformer_layer_config`",
                    )
                })?;
                (DraftKind::Speculators, inner)
            }
            Some(other) => {
                return Err(Error::config(
                    path,
                    format!("speculators model type `{other}` is not an EAGLE-3 draft"),
                ));
            }
            None => (draft_kind(raw, path)?, &raw.model),
        };
        let architecture = raw
            .model
            .architectures
            .first()
            .cloned()
            .unwrap_or_else(|| format!("speculators-{}", speculators.unwrap_or("?")));
        let need = |v: Option<usize>, key: &str| -> Result<usize> {
            match v {
                Some(0) => Err(Error::config(
                    path,
                    format!("`{key}` must be positive, found 0"),
                )),
                Some(x) => Ok(x),
                None => Err(Error::config(path, format!("missing required key `{key}`"))),
            }
        };
        let hidden_size = need(model.hidden_size, "hidden_size")?;
        let num_heads = need(model.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = need(
            model.num_key_value_heads.or(Some(num_heads)),
            "num_key_value_heads",
        )?;
        let vocab_size = need(model.vocab_size, "vocab_size")?;
        let ids = DraftIds {
            top: raw.eagle_aux_hidden_state_layer_ids.clone(),
            nested: raw
                .eagle_config
                .as_ref()
                .and_then(|e| e.eagle_aux_hidden_state_layer_ids.clone()),
        };
        let mla = match (kind, model.kv_lora_rank) {
            (DraftKind::Eagle3Mla, Some(kv_lora_rank)) => Some(MlaConfig {
                q_lora_rank: model.q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim: need(model.qk_nope_head_dim, "qk_nope_head_dim")?,
                qk_rope_head_dim: need(model.qk_rope_head_dim, "qk_rope_head_dim")?,
                v_head_dim: need(model.v_head_dim, "v_head_dim")?,
                rope_interleave: model.rope_interleave.unwrap_or(true),
            }),
            (DraftKind::Eagle3Mla, None) => {
                return Err(Error::config(path, "MLA draft without `kv_lora_rank`"));
            }
            _ => None,
        };
        Ok(DraftConfig {
            path: path.to_path_buf(),
            kind,
            architecture,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim: model.head_dim.unwrap_or(hidden_size / num_heads),
            intermediate_size: model.intermediate_size.unwrap_or(0),
            vocab_size,
            draft_vocab_size: need(
                raw.draft_vocab_size.or(Some(vocab_size)),
                "draft_vocab_size",
            )?,
            rms_norm_eps: model.rms_norm_eps.unwrap_or(1e-6),
            rope: resolve_rope(model, path).map_err(|e| e.to_string()),
            target_hidden_size: raw.target_hidden_size,
            ids,
            num_aux_hidden_states: raw.num_aux_hidden_states,
            norm_before_fc: raw.norm_before_fc.unwrap_or(false),
            norm_before_residual: raw.norm_before_residual.unwrap_or(false),
            mla,
            target_model_type: raw.target_model_type.clone(),
            model_type: model.model_type.clone(),
        })
    }

    /// The draft layer's rope; a rope type the runner does not know is refused here, naming the
    /// config.
    pub fn rope(&self) -> Result<&Rope> {
        self.rope.as_ref().map_err(|message| Error::Config {
            path: self.path.clone(),
            message: message
                .strip_prefix(&format!("{}: ", self.path.display()))
                .unwrap_or(message)
                .to_string(),
        })
    }

    /// The target hidden size `fc` expects per slot, given the target's actual one.
    pub fn target_hidden(&self, target_hidden: Option<usize>) -> usize {
        self.target_hidden_size
            .or(target_hidden)
            .unwrap_or(self.hidden_size)
    }
}

fn draft_kind(raw: &DraftConfigFile, path: &Path) -> Result<DraftKind> {
    let archs = &raw.model.architectures;
    if archs.iter().any(|a| a == "Eagle3DeepseekV2ForCausalLM") {
        return Ok(DraftKind::Eagle3Mla);
    }
    if archs.iter().any(|a| a.contains("Eagle3")) {
        return Ok(DraftKind::Eagle3Llama);
    }
    // The EAGLE reference's draft config says `LlamaForCausalLM` and adds `draft_vocab_size`.
    if archs.iter().any(|a| a == "LlamaForCausalLM") && raw.draft_vocab_size.is_some() {
        return Ok(DraftKind::EagleReference);
    }
    Err(Error::config(
        path,
        format!(
            "not an EAGLE-3 draft config: architectures {archs:?} (expected LlamaForCausalLMEagle3, \
             Eagle3DeepseekV2ForCausalLM, a LlamaForCausalLM with draft_vocab_size, or speculators eagle3)"
        ),
    ))
}
