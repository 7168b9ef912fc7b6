//! What an engine dump's tensor holds, from its name: the layer index in the name (or the
//! dumper's `layer_id` tag) and which quantity it is, turned into the boundary index once, here.
//!
//! The built-in rules name what sglang 0.5.23 (and 0.5.14) actually records (sources read from
//! the wheels; see [`builtin`]); `--reference-map 'REGEX=QUANTITY'` replaces them for names the
//! user chose. Either way the report says which rules read which names.

use regex::Regex;
use serde::Serialize;

/// What a rule says a tensor is, before the layer count is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Quantity {
    /// The residual stream entering layer i: b = i.
    Input,
    /// The residual stream leaving layer i: b = i + 1 (the pre-norm state after the last one).
    Output,
    /// One of the tensors whose sum is the input of layer i.
    InputPart,
    /// One of the tensors whose sum is the output of layer i (a fused-residual decoder layer's
    /// `(hidden_states, residual)`).
    OutputPart,
    /// This boundary, whatever the name says.
    Fixed(usize),
    /// The embedding output, b = 0.
    Embedding,
    /// The state after the last layer, before the final norm.
    PreNorm,
    /// After the final norm (HF's b = L).
    PostNorm,
    /// Not a reference state.
    Skip,
}

impl Quantity {
    fn needs_layer(self) -> bool {
        matches!(
            self,
            Quantity::Input | Quantity::Output | Quantity::InputPart | Quantity::OutputPart
        )
    }

    fn parse(text: &str) -> Option<Quantity> {
        Some(match text.trim() {
            "input" | "b" => Quantity::Input,
            "output" => Quantity::Output,
            "input-part" => Quantity::InputPart,
            "output-part" => Quantity::OutputPart,
            "embedding" => Quantity::Embedding,
            "pre-norm" => Quantity::PreNorm,
            "post-norm" => Quantity::PostNorm,
            "skip" => Quantity::Skip,
            other => Quantity::Fixed(other.strip_prefix("b=")?.trim().parse().ok()?),
        })
    }

    /// In words, for the report.
    pub fn describe(self) -> String {
        match self {
            Quantity::Input => "the input of layer i (b = i)".into(),
            Quantity::Output => "the output of layer i (b = i + 1)".into(),
            Quantity::InputPart => "a summand of the input of layer i (b = i)".into(),
            Quantity::OutputPart => "a summand of the output of layer i (b = i + 1)".into(),
            Quantity::Fixed(b) => format!("b = {b}"),
            Quantity::Embedding => "the embedding output (b = 0)".into(),
            Quantity::PreNorm => "the last layer's output before the final norm".into(),
            Quantity::PostNorm => "the final norm's output (b = L)".into(),
            Quantity::Skip => "not a reference state".into(),
        }
    }
}

/// What a tensor holds once the layer count L is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holds {
    /// The full residual stream at b (0..L-1, or L after the final norm).
    Boundary(usize),
    /// A summand of the residual stream at b; every summand of b must be there.
    Part(usize),
    /// The state after the last layer, before the final norm.
    PreNorm,
}

/// One naming rule.
#[derive(Debug, Clone)]
pub struct NameRule {
    pattern: Regex,
    pub quantity: Quantity,
    /// The rule as written (`REGEX=QUANTITY`).
    pub text: String,
    /// Where the rule's meaning was read (built-in rules), or `--reference-map`.
    pub why: String,
}

/// Where the rules came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MapSource {
    /// eagle-check's rules for the names sglang writes.
    BuiltIn,
    /// `--reference-map`.
    Flag,
}

/// An ordered list of rules: the first whose pattern matches decides.
#[derive(Debug, Clone)]
pub struct NameMap {
    pub rules: Vec<NameRule>,
    pub source: MapSource,
}

/// A name read through a map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classified {
    /// The rule that matched.
    pub rule: usize,
    pub quantity: Quantity,
    /// The layer index the name (or its tag) gave, for rules that need one.
    pub layer: Option<usize>,
}

/// A layer index anywhere in a name: `model.layers.12`, `layers.12.mlp`, `layer_12`, `layer12`,
/// `h.12` is not one (too generic to guess).
fn layer_in_name(name: &str) -> Option<usize> {
    static PATTERN: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let re = PATTERN.get_or_init(|| {
        Regex::new(r"(?:^|[._/])layers?[._]?(\d+)(?:$|[._/])").expect("a valid regex")
    });
    re.captures(name)?.get(1)?.as_str().parse().ok()
}

impl NameMap {
    /// Rules for what sglang writes, each with the source it was read from (sglang 0.5.23
    /// wheel unless said).
    pub fn builtin() -> NameMap {
        let rule = |pattern: &str, quantity, why: &str| NameRule {
            pattern: Regex::new(pattern).expect("a valid built-in regex"),
            quantity,
            text: format!("{pattern}={}", quantity_word(quantity)),
            why: why.to_string(),
        };
        let rules = vec![
            // The plan's source patch dumps each capture as the engine makes it; the capture
            // runs inside layer i's forward, so the non-intrusive dumper's ctx tags it
            // layer_id=i, and it is the residual stream entering layer i (embedding at i = 0).
            rule(
                r"^eagle_aux_capture$",
                Quantity::Input,
                "eagle-check plan's dump of each EAGLE-3 capture (layers/aux_hidden_states.py \
                 AuxHiddenStateList.capture / AuxHiddenStatePacker.append): the residual stream \
                 entering layer layer_id (layers/layer_boundary/stage.py \
                 StageBoundary._prepare_attention)",
            ),
            // Junction dumps are captures to identify (`diff --captures`), not references.
            rule(
                r"^(?:eagle_aux_hidden_states|eagle_fc_input)$|\.fc\.inputs\.0$",
                Quantity::Skip,
                "a junction dump (what fc is fed): pass it to --captures",
            ),
            rule(
                r"(?:^|\.)embed_tokens(?:\.output)?$",
                Quantity::Embedding,
                "VocabParallelEmbedding's output, all-reduced over TP \
                 (layers/vocab_parallel_embedding.py VocabParallelEmbedding.forward)",
            ),
            // A fused add + RMSNorm returns (normed, residual sum): input_layernorm of layer
            // i >= 1 hands back the residual stream entering layer i.
            rule(
                r"(?:^|\.)layers\.(\d+)\.input_layernorm(?:\.output)?\.1$",
                Quantity::Input,
                "input_layernorm(hidden_states, residual) returns (normed, hidden_states + \
                 residual) (layers/layer_boundary/residual/add_norm.py; \
                 layers/layernorm.py RMSNorm.forward_with_residual)",
            ),
            rule(
                r"(?:^|\.)layers\.\d+\.(?:input_layernorm|post_attention_layernorm|self_attn|mlp)(?:$|\.)",
                Quantity::Skip,
                "a sublayer's output (normed input, attention or MLP contribution)",
            ),
            rule(
                r"(?:^|\.)norm(?:\.output)?\.1$",
                Quantity::PreNorm,
                "the final norm(hidden_states, residual) returns (normed, residual sum) \
                 (layers/layer_boundary/residual/access.py final_norm_pair)",
            ),
            rule(
                r"(?:^|\.)norm(?:\.output)?(?:\.0)?$",
                Quantity::PostNorm,
                "the final norm's normed output (layers/layer_boundary/residual/access.py \
                 final_norm_pair)",
            ),
            // sglang 0.5.14 LlamaDecoderLayer.forward returns (hidden_states, residual): the
            // residual stream leaving the layer is their sum (models/llama.py, 0.5.14 wheel).
            rule(
                r"(?:^|\.)layers\.(\d+)(?:\.output)?\.[01]$",
                Quantity::OutputPart,
                "sglang 0.5.14 LlamaDecoderLayer.forward returns (hidden_states, residual), \
                 whose sum leaves the layer (models/llama.py)",
            ),
            // sglang 0.5.23 decoder layers hand back only their contribution; the residual
            // lives in forward_batch.residual_stream.
            rule(
                r"(?:^|\.)layers\.\d+(?:\.output)?$",
                Quantity::Skip,
                "sglang 0.5.23 decoder layers return their contribution without the residual \
                 stream (layers/layer_boundary/stage.py StageBoundary.finish): not a boundary",
            ),
            rule(
                r"(?:^|\.)(?:lm_head|logits_processor|rotary_emb)(?:$|\.)",
                Quantity::Skip,
                "not a residual-stream state",
            ),
        ];
        NameMap {
            rules,
            source: MapSource::BuiltIn,
        }
    }

    /// Parses `--reference-map` values: each `REGEX=QUANTITY`, or the path of a file holding
    /// one such rule per line (`#` starts a comment). QUANTITY is `input` (or `b`), `output`,
    /// `input-part`, `output-part`, `embedding`, `pre-norm`, `post-norm`, `skip` or `b=N`; the
    /// layer i of the layer quantities is the pattern's first capture group, else the layer
    /// index in the name, else the dumper's `layer_id` tag.
    pub fn parse(values: &[String]) -> Result<NameMap, String> {
        let mut rules = Vec::new();
        for value in values {
            let path = std::path::Path::new(value);
            if !value.contains('=') && path.is_file() {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
                for (n, line) in text.lines().enumerate() {
                    let line = line.split('#').next().unwrap_or("").trim();
                    if !line.is_empty() {
                        rules.push(
                            parse_rule(line)
                                .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?,
                        );
                    }
                }
            } else {
                rules.push(parse_rule(value)?);
            }
        }
        if rules.is_empty() {
            return Err("--reference-map: no rules given".into());
        }
        Ok(NameMap {
            rules,
            source: MapSource::Flag,
        })
    }

    /// Reads a name (with the dumper's `layer_id` tag, when it has one). `None`: no rule
    /// matched.
    pub fn classify(&self, name: &str, layer_tag: Option<i64>) -> Option<Classified> {
        for (index, rule) in self.rules.iter().enumerate() {
            let Some(caps) = rule.pattern.captures(name) else {
                continue;
            };
            let layer = caps
                .get(1)
                .and_then(|m| m.as_str().parse().ok())
                .or_else(|| layer_in_name(name))
                .or_else(|| layer_tag.and_then(|t| usize::try_from(t).ok()));
            if rule.quantity.needs_layer() && layer.is_none() {
                continue;
            }
            return Some(Classified {
                rule: index,
                quantity: rule.quantity,
                layer,
            });
        }
        None
    }
}

fn quantity_word(q: Quantity) -> String {
    match q {
        Quantity::Input => "input".into(),
        Quantity::Output => "output".into(),
        Quantity::InputPart => "input-part".into(),
        Quantity::OutputPart => "output-part".into(),
        Quantity::Fixed(b) => format!("b={b}"),
        Quantity::Embedding => "embedding".into(),
        Quantity::PreNorm => "pre-norm".into(),
        Quantity::PostNorm => "post-norm".into(),
        Quantity::Skip => "skip".into(),
    }
}

fn parse_rule(text: &str) -> Result<NameRule, String> {
    // The quantity never holds '=' except `b=N`, so split at the last '=' that leaves one.
    let (pattern, quantity) = match text.rsplit_once('=') {
        Some((head, n)) if head.ends_with("=b") => {
            let head = head.strip_suffix('b').unwrap_or(head);
            let head = head.trim_end().strip_suffix('=').unwrap_or(head);
            (head, format!("b={n}"))
        }
        Some((head, q)) => (head, q.to_string()),
        None => {
            return Err(format!(
                "--reference-map {text:?}: expected REGEX=QUANTITY (input, output, input-part, \
                 output-part, embedding, pre-norm, post-norm, skip or b=N)"
            ));
        }
    };
    let quantity = Quantity::parse(&quantity).ok_or_else(|| {
        format!(
            "--reference-map {text:?}: unknown quantity {quantity:?} (input, output, input-part, \
             output-part, embedding, pre-norm, post-norm, skip or b=N)"
        )
    })?;
    let regex = Regex::new(pattern)
        .map_err(|e| format!("--reference-map {text:?}: bad regex: {}", one_line(&e)))?;
    Ok(NameRule {
        pattern: regex,
        quantity,
        text: text.to_string(),
        why: "--reference-map".into(),
    })
}

fn one_line(e: &regex::Error) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a classified tensor holds for a target of `num_layers` layers (`None`: skip).
pub fn holds(c: &Classified, num_layers: usize) -> Option<Holds> {
    let l = num_layers;
    let layer = c.layer.unwrap_or(0);
    let at = |b: usize| {
        if b == l {
            // The residual stream after the last layer is the pre-norm state.
            Holds::PreNorm
        } else {
            Holds::Boundary(b)
        }
    };
    Some(match c.quantity {
        Quantity::Input => at(layer),
        Quantity::Output => at(layer + 1),
        Quantity::InputPart => Holds::Part(layer),
        Quantity::OutputPart => Holds::Part(layer + 1),
        Quantity::Fixed(b) => Holds::Boundary(b),
        Quantity::Embedding => Holds::Boundary(0),
        Quantity::PreNorm => Holds::PreNorm,
        Quantity::PostNorm => Holds::Boundary(l),
        Quantity::Skip => return None,
    })
}

/// The largest layer count a classified name implies (layer i exists, so L > i).
pub fn implied_layers(c: &Classified) -> Option<usize> {
    match c.quantity {
        Quantity::Input | Quantity::InputPart => c.layer.map(|i| i + 1),
        Quantity::Output | Quantity::OutputPart => c.layer.map(|i| i + 1),
        Quantity::Fixed(b) => Some(b),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(map: &NameMap, name: &str, tag: Option<i64>, l: usize) -> Option<Holds> {
        map.classify(name, tag).and_then(|c| holds(&c, l))
    }

    #[test]
    fn builtin_rules_read_what_sglang_writes() {
        let m = NameMap::builtin();
        let l = 5;
        // debug tensor dump (module names, tuples flattened as .0/.1)
        assert_eq!(
            read(&m, "model.embed_tokens", None, l),
            Some(Holds::Boundary(0))
        );
        assert_eq!(
            read(&m, "model.layers.3.input_layernorm.1", None, l),
            Some(Holds::Boundary(3))
        );
        assert_eq!(read(&m, "model.layers.3.input_layernorm.0", None, l), None);
        assert_eq!(read(&m, "model.layers.0.input_layernorm", None, l), None);
        assert_eq!(read(&m, "model.layers.2.mlp.down_proj", None, l), None);
        assert_eq!(read(&m, "model.norm.0", None, l), Some(Holds::Boundary(5)));
        assert_eq!(read(&m, "model.norm.1", None, l), Some(Holds::PreNorm));
        assert_eq!(read(&m, "model.norm", None, l), Some(Holds::Boundary(5)));
        // dumper, non-intrusive mode
        assert_eq!(
            read(
                &m,
                "non_intrusive__model.layers.4.input_layernorm.output.1",
                Some(4),
                l
            ),
            Some(Holds::Boundary(4))
        );
        assert_eq!(
            read(&m, "non_intrusive__model.embed_tokens.output", None, l),
            Some(Holds::Boundary(0))
        );
        assert_eq!(
            read(&m, "non_intrusive__model.layers.1.output.0", Some(1), l),
            Some(Holds::Part(2))
        );
        assert_eq!(
            read(&m, "non_intrusive__model.layers.1.output", Some(1), l),
            None
        );
        // the last layer's output pair is the pre-norm state's summands... as b = L parts
        assert_eq!(
            read(&m, "non_intrusive__model.layers.4.output.1", Some(4), l),
            Some(Holds::Part(5))
        );
        // the plan's capture dumps carry the layer in their tag
        assert_eq!(
            read(&m, "eagle_aux_capture", Some(0), l),
            Some(Holds::Boundary(0))
        );
        assert_eq!(
            read(&m, "eagle_aux_capture", Some(3), l),
            Some(Holds::Boundary(3))
        );
        assert_eq!(m.classify("eagle_aux_capture", None), None);
        assert_eq!(read(&m, "eagle_aux_hidden_states", None, l), None);
        assert_eq!(read(&m, "non_intrusive__model.fc.inputs.0", None, l), None);
    }

    #[test]
    fn reference_map_rules() {
        let m = NameMap::parse(&[
            r"^resid_(\d+)$=input".to_string(),
            r"^out_layer(\d+)$=output".to_string(),
            r"^emb$=b=0".to_string(),
            r"^final$=pre-norm".to_string(),
        ])
        .unwrap();
        assert_eq!(read(&m, "resid_7", None, 10), Some(Holds::Boundary(7)));
        assert_eq!(read(&m, "out_layer7", None, 10), Some(Holds::Boundary(8)));
        assert_eq!(read(&m, "out_layer9", None, 10), Some(Holds::PreNorm));
        assert_eq!(read(&m, "emb", None, 10), Some(Holds::Boundary(0)));
        assert_eq!(read(&m, "final", None, 10), Some(Holds::PreNorm));
        assert_eq!(m.classify("other", None), None);
        // A layer quantity without a number anywhere takes the layer_id tag.
        let m = NameMap::parse(&["^h$=input".to_string()]).unwrap();
        assert_eq!(read(&m, "h", Some(2), 4), Some(Holds::Boundary(2)));
        assert!(NameMap::parse(&["x=nonsense".to_string()]).is_err());
        assert!(NameMap::parse(&["(=input".to_string()]).is_err());
        assert!(NameMap::parse(&["no-equals".to_string()]).is_err());
    }

    #[test]
    fn layer_index_in_names() {
        assert_eq!(layer_in_name("model.layers.12"), Some(12));
        assert_eq!(layer_in_name("layers.12.mlp"), Some(12));
        assert_eq!(layer_in_name("layer_12"), Some(12));
        assert_eq!(layer_in_name("hidden_layer12_out"), Some(12));
        assert_eq!(layer_in_name("decoder/layer12/out"), Some(12));
        assert_eq!(layer_in_name("players.3"), None);
    }
}
