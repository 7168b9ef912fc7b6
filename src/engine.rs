//! Engine resolvers: which boundaries each serving or training stack feeds to the draft's `fc`.
//!
//! Each engine turns the draft config's layer ids (or their absence) into boundaries by its own
//! rule. The rules below were read from the engines' code; each carries its source. Everything
//! leaves this module as canonical boundaries ([`Boundary`]); no other module knows about "+1".

use crate::boundary::{Boundary, Convention, FinalNorm, default_boundaries};
use serde::Serialize;
use std::fmt;

/// The engines eagle-check knows, by their CLI names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// sglang after PR 25454 (merged 2026-05).
    Sglang,
    /// sglang before PR 25454.
    SglangLegacy,
    Vllm,
    Trtllm,
    Specforge,
    /// SafeAILab EAGLE (training and inference share the code).
    Eagle,
    /// NVIDIA Model-Optimizer's HF hidden-state dump.
    Modelopt,
    /// speculators (vLLM-based data generation).
    Speculators,
}

impl Engine {
    pub const ALL: [Engine; 8] = [
        Engine::Sglang,
        Engine::SglangLegacy,
        Engine::Vllm,
        Engine::Trtllm,
        Engine::Specforge,
        Engine::Eagle,
        Engine::Modelopt,
        Engine::Speculators,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Engine::Sglang => "sglang",
            Engine::SglangLegacy => "sglang-legacy",
            Engine::Vllm => "vllm",
            Engine::Trtllm => "trtllm",
            Engine::Specforge => "specforge",
            Engine::Eagle => "eagle",
            Engine::Modelopt => "modelopt",
            Engine::Speculators => "speculators",
        }
    }

    pub fn from_name(name: &str) -> Option<Engine> {
        Engine::ALL.into_iter().find(|e| e.name() == name)
    }

    /// Which side of the final norm this engine's `b = L` capture sits on.
    pub fn final_norm(self) -> FinalNorm {
        match self {
            // HF `output_hidden_states[-1]` is post-norm.
            Engine::Specforge | Engine::Modelopt | Engine::Eagle => FinalNorm::Post,
            // vLLM, sglang (PR 32334), TensorRT-LLM and speculators (vLLM) capture before it.
            _ => FinalNorm::Pre,
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How an engine arrived at its boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    /// Explicit ids, read as "output of layer k" (`b = k + 1`).
    ExplicitOut,
    /// Explicit ids used raw (`b = k`).
    ExplicitRaw,
    /// No ids in the config: the engine's default list.
    DefaultFallback,
    /// The engine ignores configs and hard-codes its layers.
    HardCoded,
    /// The engine refuses the ids outright.
    Refused,
}

impl Rule {
    pub fn describe(self) -> &'static str {
        match self {
            Rule::ExplicitOut => "explicit ids, +1 rule (b = id + 1)",
            Rule::ExplicitRaw => "explicit ids, used raw (b = id)",
            Rule::DefaultFallback => "no ids in the config: engine default",
            Rule::HardCoded => "hard-coded layers (config ids ignored)",
            Rule::Refused => "ids refused by the engine",
        }
    }
}

/// One `fc` slot as an engine fills it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FedSlot {
    /// The config id that selected this slot (`None` for defaults and hard-coded layers).
    pub id: Option<i64>,
    pub boundary: Boundary,
}

/// Something wrong with the ids themselves, found while resolving.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum IdProblem {
    /// The id names no boundary this engine can capture; it is dropped from the feed.
    OutOfRange { id: i64, reason: String },
    /// The same id twice.
    Duplicate { id: i64, collapsed: bool },
    /// Ids not ascending: engines that sort and trainers that keep list order disagree.
    Unsorted { ids: Vec<i64> },
    /// The engine raises on these ids.
    Refused { reason: String },
    /// The embedding output is fed (id maps to b = 0); stock engines crash or never do this.
    Embedding { id: i64 },
}

/// What an engine feeds to `fc`, in order, and how it decided.
#[derive(Debug, Clone, Serialize)]
pub struct Feed {
    pub engine: Engine,
    pub rule: Rule,
    pub slots: Vec<FedSlot>,
    pub problems: Vec<IdProblem>,
}

impl Feed {
    pub fn boundaries(&self) -> Vec<Boundary> {
        self.slots.iter().map(|s| s.boundary).collect()
    }
}

/// How one engine maps an explicit id to a boundary, or why it cannot.
fn map_id(engine: Engine, rule: Rule, id: i64, num_layers: usize) -> Result<Boundary, String> {
    let l = num_layers as i64;
    match engine {
        // TensorRT-LLM: -1 names the final state (tensorrt_llm/_torch/models, inferred).
        Engine::Trtllm if id == -1 => Ok(Boundary(num_layers)),
        // ModelOpt indexes `hidden_states[id + 1]` in Python, so negative indices wrap
        // (examples/speculative_decoding/collect_hidden_states).
        Engine::Modelopt => {
            let mut idx = id.checked_add(1).ok_or("id overflows")?;
            if idx < 0 {
                idx += l + 1;
            }
            if (0..=l).contains(&idx) {
                Ok(Boundary(idx as usize))
            } else {
                Err(format!(
                    "hidden_states[{}] does not exist (L + 1 = {} states)",
                    id + 1,
                    l + 1
                ))
            }
        }
        _ => {
            let convention = if rule == Rule::ExplicitRaw {
                Convention::In
            } else {
                Convention::Out
            };
            let b = convention
                .to_boundary(id, num_layers)
                .ok_or_else(|| match convention {
                    Convention::Out => {
                        format!("b = id + 1 = {} is outside 0..={l}", id.saturating_add(1))
                    }
                    Convention::In => format!("b = id = {id} is outside 0..={l}"),
                })?;
            // sglang before PR 25454 captures inside the layer loop (`for i in range(L):
            // if i in layers_to_capture`), so b = L is never reached
            // (python/sglang/srt/models/llama.py).
            if engine == Engine::SglangLegacy && b.0 == num_layers {
                return Err(format!(
                    "b = {l} is never captured: the capture loop only sees layer inputs 0..{l}"
                ));
            }
            Ok(b)
        }
    }
}

/// Engines that capture by membership in the layer loop (`if i in layers_to_capture`) capture a
/// repeated boundary once; list-indexing pipelines feed it twice.
fn collapses_duplicates(engine: Engine) -> bool {
    matches!(
        engine,
        Engine::Sglang | Engine::SglangLegacy | Engine::Vllm | Engine::Speculators
    )
}

/// Resolves what `engine` feeds to `fc` for a draft with `ids` on a target of `num_layers`.
pub fn resolve(engine: Engine, ids: Option<&[i64]>, num_layers: usize) -> Feed {
    let defaults = || -> Vec<FedSlot> {
        default_boundaries(num_layers)
            .into_iter()
            .map(|boundary| FedSlot { id: None, boundary })
            .collect()
    };
    let mut problems = Vec::new();

    // SafeAILab EAGLE: `if idx in {2, L//2, L-3}` on the input of layer idx, config ignored
    // (eagle/model/modeling_llama_kv.py, traineagle3/modeling_llama_kv.py).
    if engine == Engine::Eagle {
        return Feed {
            engine,
            rule: Rule::HardCoded,
            slots: defaults(),
            problems,
        };
    }
    let Some(ids) = ids else {
        // Every engine's default names the same boundaries: OUT [1, L//2-1, L-4] (SpecForge,
        // TensorRT-LLM, ModelOpt) = IN [2, L//2, L-3] (sglang, vLLM, speculators).
        // On small targets the defaults collide (L = 5: [2, 2, 2]); layer-loop engines then
        // capture the boundary once.
        let mut slots = defaults();
        if collapses_duplicates(engine) {
            slots.dedup_by_key(|s| s.boundary);
        }
        return Feed {
            engine,
            rule: Rule::DefaultFallback,
            slots,
            problems,
        };
    };

    let rule = match engine {
        // sglang before PR 25454: `layers_to_capture = [val + 1 for val in layer_ids]`
        // (python/sglang/srt/models/llama.py, deepseek_v2.py `set_eagle3_layers_to_capture`).
        Engine::SglangLegacy => Rule::ExplicitOut,
        // sglang after PR 25454: +1 only when the first id is 1, raw otherwise.
        Engine::Sglang if ids.first() == Some(&1) => Rule::ExplicitOut,
        Engine::Sglang => Rule::ExplicitRaw,
        // vLLM uses ids raw (vllm/model_executor/models/llama.py `aux_hidden_state_layers`);
        // speculators generates its data through vLLM.
        Engine::Vllm | Engine::Speculators => Rule::ExplicitRaw,
        // SpecForge `resolve_eagle_capture_layers`, TensorRT-LLM, ModelOpt: output of layer k.
        Engine::Specforge | Engine::Trtllm | Engine::Modelopt => Rule::ExplicitOut,
        Engine::Eagle => Rule::HardCoded,
    };

    // SpecForge requires exactly 3 non-negative unique ids
    // (specforge/algorithms/model_providers.py `resolve_eagle_capture_layers`).
    if engine == Engine::Specforge {
        let mut unique = ids.to_vec();
        unique.sort_unstable();
        unique.dedup();
        if ids.len() != 3 || ids.iter().any(|&k| k < 0) || unique.len() != ids.len() {
            problems.push(IdProblem::Refused {
                reason: format!(
                    "SpecForge requires exactly 3 non-negative unique ids, got {ids:?}"
                ),
            });
            return Feed {
                engine,
                rule: Rule::Refused,
                slots: Vec::new(),
                problems,
            };
        }
    }

    if ids.windows(2).any(|w| w[0] > w[1]) {
        problems.push(IdProblem::Unsorted { ids: ids.to_vec() });
    }
    let collapses = collapses_duplicates(engine);
    let mut seen = Vec::new();
    let mut slots = Vec::new();
    for &id in ids {
        if seen.contains(&id) {
            problems.push(IdProblem::Duplicate {
                id,
                collapsed: collapses,
            });
            if collapses {
                continue;
            }
        }
        seen.push(id);
        match map_id(engine, rule, id, num_layers) {
            Ok(boundary) => {
                if boundary.is_embedding() {
                    problems.push(IdProblem::Embedding { id });
                }
                slots.push(FedSlot {
                    id: Some(id),
                    boundary,
                });
            }
            Err(reason) => problems.push(IdProblem::OutOfRange { id, reason }),
        }
    }

    match engine {
        // Layer-loop capture concatenates in ascending layer order.
        Engine::Sglang | Engine::SglangLegacy | Engine::Vllm | Engine::Speculators => {
            slots.sort_by_key(|s| s.boundary);
        }
        // TensorRT-LLM sorts the ids and moves -1 (the final state) last.
        Engine::Trtllm => slots.sort_by_key(|s| (s.id == Some(-1), s.id)),
        // SpecForge's HF hook backend and ModelOpt index in list order.
        Engine::Specforge | Engine::Modelopt | Engine::Eagle => {}
    }
    Feed {
        engine,
        rule,
        slots,
        problems,
    }
}

/// The ids to write in the draft config so that `engine` feeds exactly `want`, in order.
/// `None` when no id list can (hard-coded engines, orders an engine never produces, ...).
pub fn ids_for(engine: Engine, want: &[Boundary], num_layers: usize) -> Option<Vec<i64>> {
    let out: Vec<i64> = want.iter().map(|&b| Convention::Out.to_id(b)).collect();
    let raw: Vec<i64> = want.iter().map(|&b| Convention::In.to_id(b)).collect();
    let mut candidates = vec![out.clone(), raw];
    if engine == Engine::Trtllm {
        // The final state is spelled -1 there.
        let final_as_minus_one: Vec<i64> = want
            .iter()
            .map(|&b| {
                if b.0 == num_layers {
                    -1
                } else {
                    Convention::Out.to_id(b)
                }
            })
            .collect();
        candidates.push(final_as_minus_one);
    }
    candidates.into_iter().find(|ids| {
        let feed = resolve(engine, Some(ids), num_layers);
        feed.rule != Rule::HardCoded
            && feed.boundaries() == want
            && !feed
                .problems
                .iter()
                .any(|p| matches!(p, IdProblem::OutOfRange { .. } | IdProblem::Refused { .. }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(v: &[usize]) -> Vec<Boundary> {
        v.iter().map(|&b| Boundary(b)).collect()
    }

    #[test]
    fn each_engine_reads_specforge_deepseek_ids() {
        // SpecForge's DeepSeek-V3 draft writes OUT [1, 29, 57] for a 61-layer target.
        let ids = [1i64, 29, 57];
        let expect = [
            (Engine::Sglang, vec![2, 30, 58]),
            (Engine::SglangLegacy, vec![2, 30, 58]),
            (Engine::Trtllm, vec![2, 30, 58]),
            (Engine::Specforge, vec![2, 30, 58]),
            (Engine::Modelopt, vec![2, 30, 58]),
            (Engine::Vllm, vec![1, 29, 57]),
            (Engine::Speculators, vec![1, 29, 57]),
            (Engine::Eagle, vec![2, 30, 58]),
        ];
        for (engine, b) in expect {
            assert_eq!(
                resolve(engine, Some(&ids), 61).boundaries(),
                bs(&b),
                "{engine}"
            );
        }
    }

    #[test]
    fn sglang_pr_25454_adds_one_only_when_first_id_is_one() {
        assert_eq!(
            resolve(Engine::Sglang, Some(&[2, 30, 58]), 61).boundaries(),
            bs(&[2, 30, 58])
        );
        assert_eq!(
            resolve(Engine::Sglang, Some(&[1, 29, 57]), 61).rule,
            Rule::ExplicitOut
        );
        assert_eq!(
            resolve(Engine::SglangLegacy, Some(&[2, 30, 58]), 61).boundaries(),
            bs(&[3, 31, 59])
        );
    }

    #[test]
    fn minus_one_means_different_things() {
        // The seed incident: patched sglang fed [embedding, 3, 31] for ids [-1, 2, 30].
        let legacy = resolve(Engine::SglangLegacy, Some(&[-1, 2, 30]), 61);
        assert_eq!(legacy.boundaries(), bs(&[0, 3, 31]));
        assert!(legacy.problems.contains(&IdProblem::Embedding { id: -1 }));
        // TensorRT-LLM: -1 is the final state, moved last.
        let trt = resolve(Engine::Trtllm, Some(&[-1, 2, 30]), 61);
        assert_eq!(trt.boundaries(), bs(&[3, 31, 61]));
        // vLLM gives it no meaning.
        let vllm = resolve(Engine::Vllm, Some(&[-1, 2, 30]), 61);
        assert_eq!(vllm.boundaries(), bs(&[2, 30]));
        assert!(matches!(
            vllm.problems[0],
            IdProblem::OutOfRange { id: -1, .. }
        ));
    }

    #[test]
    fn ordering_and_duplicates_follow_each_engine() {
        let sg = resolve(Engine::SglangLegacy, Some(&[29, 1, 57]), 61);
        assert_eq!(sg.boundaries(), bs(&[2, 30, 58]));
        assert!(matches!(sg.problems[0], IdProblem::Unsorted { .. }));
        let mo = resolve(Engine::Modelopt, Some(&[29, 1, 57]), 61);
        assert_eq!(mo.boundaries(), bs(&[30, 2, 58]));
        let vl = resolve(Engine::Vllm, Some(&[2, 2, 30]), 61);
        assert_eq!(vl.boundaries(), bs(&[2, 30]));
        let sf = resolve(Engine::Specforge, Some(&[2, 2, 30]), 61);
        assert_eq!(sf.rule, Rule::Refused);
    }

    #[test]
    fn defaults_and_hard_coded() {
        for engine in Engine::ALL {
            assert_eq!(
                resolve(engine, None, 32).boundaries(),
                bs(&[2, 16, 29]),
                "{engine}"
            );
        }
        assert_eq!(
            resolve(Engine::Eagle, Some(&[5, 6, 7]), 32).rule,
            Rule::HardCoded
        );
        // L = 5: the defaults collide; layer-loop engines capture b = 2 once.
        assert_eq!(resolve(Engine::Vllm, None, 5).boundaries(), bs(&[2]));
        assert_eq!(
            resolve(Engine::Modelopt, None, 5).boundaries(),
            bs(&[2, 2, 2])
        );
    }

    #[test]
    fn fixes_round_trip() {
        let want = bs(&[2, 30, 58]);
        assert_eq!(ids_for(Engine::Vllm, &want, 61), Some(vec![2, 30, 58]));
        assert_eq!(
            ids_for(Engine::SglangLegacy, &want, 61),
            Some(vec![1, 29, 57])
        );
        assert_eq!(ids_for(Engine::Sglang, &want, 61), Some(vec![1, 29, 57]));
        assert_eq!(ids_for(Engine::Eagle, &want, 61), None);
        // No engine that sorts can feed a descending order.
        assert_eq!(ids_for(Engine::Vllm, &bs(&[30, 2, 58]), 61), None);
        assert_eq!(
            ids_for(Engine::Modelopt, &bs(&[30, 2, 58]), 61),
            Some(vec![29, 1, 57])
        );
        assert_eq!(
            ids_for(Engine::Trtllm, &bs(&[2, 30, 61]), 61),
            Some(vec![1, 29, 60])
        );
    }
}
