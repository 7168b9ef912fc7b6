//! The rule table: how each engine, at each audited version, on each target architecture, turns
//! a draft's layer ids into captured boundaries. One row per (engine, capture path, version
//! band, architectures); every row names the upstream file it was read from. The facts, with
//! line numbers and commits, are in `fixtures/engines/FACTS.md` (audited 2026-12-01);
//! `fixtures/engines/drift.py` re-reads the upstream functions and fails when one changed. The
//! README's engine table is generated from these rows (`eagle-check engines --markdown`), and a
//! test fails when the two differ.

use super::{Engine, Version};
use crate::boundary::FinalNorm;

/// How explicit ids become boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offset {
    /// `b = id + 1`: the id names a layer's output (OUT).
    PlusOne,
    /// `b = id`: the id names a layer's input (IN).
    Raw,
    /// sglang PR 25454 (`deepseek_v2.py`, `glm4_moe_lite.py`): `+1` for every id when the first
    /// id is 1, else raw.
    PlusOneIfFirstIsOne,
    /// sglang 0.5.23 `gpt_oss.py`: raw when the largest id equals L (ids written as boundaries,
    /// the last one the pre-norm final state), else `+1`.
    RawIfMaxIsL,
    /// The engine ignores ids and captures its default.
    Ignored,
}

/// What happens to a slot that lands at an edge of the residual stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Captured (at b = L: on this side of the final norm).
    Captured(Option<FinalNorm>),
    /// Never matched by the capture loop: the slot silently disappears.
    Dropped(&'static str),
    /// The engine raises or crashes.
    Crash(&'static str),
    /// Python indexing into the layer list: a negative b counts from the end (b + L), one past
    /// the end raises (sglang's qwen MoE setter tags `self.layers[b]`).
    PythonIndex,
}

/// What the id -1 means, before any offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MinusOne {
    /// Nothing special: the offset maps it (`+1` makes it b = 0, raw leaves it negative).
    ByOffset,
    /// The model's output after the final norm (TensorRT-LLM).
    FinalPostNorm,
}

/// The order of the concatenation `fc` receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The layer loop's order: ascending boundaries.
    Ascending,
    /// Sorted by id: TensorRT-LLM's one-model path, where -1 sorts into slot 0.
    SortedIds,
    /// Sorted by id, then a leading -1 moved to the last slot (TensorRT-LLM's two-model path).
    SortedIdsMinusOneLast,
}

/// Where the engine reads the ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdsFrom {
    /// `eagle_config.eagle_aux_hidden_state_layer_ids` only.
    Nested,
    /// The top-level `eagle_aux_hidden_state_layer_ids`, then the nested one.
    TopThenNested,
    /// The top-level key only: a nested-only config silently gets the default.
    Top,
    /// A run override, then the nested key (SpecForge).
    OverrideThenNested(&'static str),
    /// The engine's own setting or flag; the draft config's ids are not read.
    Setting(&'static str),
    /// Nowhere: the layers are hard-coded.
    Nowhere,
}

/// Checks an engine or trainer applies to the ids before using them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdCheck {
    None,
    /// Exactly three distinct ids with `0 <= id < L` (SpecForge offline capture).
    ThreeDistinctBelowL,
    /// Exactly three distinct ids `>= 0`, no upper bound (SpecForge online capture).
    ThreeDistinct,
    /// Every id in `0..L` (Model-Optimizer).
    BelowL,
    /// Distinct ids in `0..=L` (speculators' trainer).
    DistinctUpToL,
    /// Three distinct layers (SafeAILab's trainer indexes the first three captured states).
    ThreeDistinctLayers,
}

/// The list used when no ids are given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultList {
    /// The boundaries `[2, L//2, L-3]` (the inputs of those layers).
    InputsOf,
    /// The ids `[1, L//2-1, L-4]` through the row's offset (the outputs of those layers).
    OutputsOf,
    /// Model-Optimizer: `sorted({1, max(0, L//2-1), max(0, L-4)})` as OUT ids.
    ModeloptClamped,
    /// No default: the engine raises without ids.
    Refused(&'static str),
}

/// What the capture loop of a row's model file appends for a slot past b = 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture {
    /// The full residual stream (`hidden_states + residual`, or a layer that returns the sum):
    /// what HF's `output_hidden_states` holds and what every trainer captured.
    Residual,
    /// A layer's branch output without the residual it should be added to (an engine bug: the
    /// fused add-norm keeps the residual apart and the capture reads the other half).
    Branch(&'static str),
}

/// When a caveat applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Whenever explicit ids are used.
    ExplicitIds,
    /// When an id is -1.
    MinusOne,
    /// Whatever the ids (a deployment setting the rule cannot see, such as the parallelism).
    Always,
}

/// One audited rule.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub engine: Engine,
    /// The capture path (`""` for an engine with one).
    pub path: &'static str,
    /// The rule applies from this version until the next band's.
    pub since: Version,
    /// What was read: a version or a commit.
    pub read: &'static str,
    /// Target `model_type`s this row covers; empty: every other architecture (the engine's
    /// generic rule).
    pub archs: &'static [&'static str],
    /// Upstream file and function the row was read from.
    pub source: &'static str,
    /// The engine does not run EAGLE-3 on these targets at all: how it fails, in its own terms
    /// (the missing method or interface, the exception, where it is raised).
    pub refuses: Option<&'static str>,
    /// What a slot past b = 0 holds.
    pub captures: Capture,
    pub offset: Offset,
    pub minus_one: MinusOne,
    /// A slot that maps to b = 0.
    pub embedding: Reach,
    /// A slot that maps to b = L.
    pub last: Reach,
    /// A slot that maps below 0 or past L.
    pub outside: Reach,
    pub order: Order,
    /// Repeated positions are captured once.
    pub dedup: bool,
    /// The engine raises unless it captured exactly one state per id (sglang 0.5.23's
    /// `AuxHiddenStatePacker.finalize`): a dropped or collapsed id is a crash, not a silent
    /// narrower `fc` input.
    pub strict_count: bool,
    pub default: DefaultList,
    /// The engine raises on its own default for targets this small.
    pub default_raises_up_to: Option<usize>,
    pub ids_from: IdsFrom,
    pub check: IdCheck,
    /// The check applies to the default list too.
    pub check_default: bool,
    /// L (pre-norm) is appended to the ids, the capture sorted, and the last slot stored as the
    /// training target rather than fed to `fc` (speculators, Model-Optimizer's vLLM dump).
    pub final_target: bool,
    /// Known hazards of this row that the source shows but a static rule cannot settle.
    pub caveats: &'static [(When, &'static str)],
}

impl Rule {
    /// Whether two rows turn every id list into the same feed (they may differ in where the
    /// ids are read or in their sources).
    pub fn same_mapping(&self, other: &Rule) -> bool {
        self.refuses == other.refuses
            && self.captures == other.captures
            && self.offset == other.offset
            && self.minus_one == other.minus_one
            && self.embedding == other.embedding
            && self.last == other.last
            && self.outside == other.outside
            && self.order == other.order
            && self.dedup == other.dedup
            && self.strict_count == other.strict_count
            && self.default == other.default
            && self.default_raises_up_to == other.default_raises_up_to
            && self.check == other.check
            && self.final_target == other.final_target
    }
}

const fn v(major: u32, minor: u32, patch: u32) -> Version {
    Version([major, minor, patch])
}

// ---------------------------------------------------------------------------------------------
// sglang (FACTS.md section 1). Every setter tests `i in layers_to_capture` in the layer loop:
// ascending order, duplicates collapse, b = L never reached, ids read from `eagle_config` only.

/// sglang 0.5.23: the llama family's setter (`llama.py` and the classes deriving or delegating
/// to it) with 0.5.23's layer-boundary capture (b = 0 works); gemma3 has a row of its own.
const LLAMA_FAMILY: &[&str] = &[
    "llama",
    "mistral",
    "llama4",
    "phi3",
    "internlm3",
    "glm4_moe",
    "minimax_m2",
    "qwen3_next",
];
/// The model-level `hidden_states + residual` capture at the top of each layer, where the
/// residual is None before layer 0 (b = 0 crashes): 0.5.14 (FACTS.md section 1.3 and round 2).
const SG_MODEL_SUM_0_5_14: &[&str] = &["llama", "mistral", "llama4", "phi3", "internlm3"];
/// 0.5.10 adds MiniMax-M2 (`MiniMaxM2Model.forward` sums at the model level there; 0.5.14 moved
/// it to the communicator capture).
const SG_MODEL_SUM_0_5_10: &[&str] = &[
    "llama",
    "mistral",
    "llama4",
    "phi3",
    "internlm3",
    "minimax_m2",
];
/// `layers/communicator.py` `prepare_attn_and_capture_last_layer_outputs`: the residual after
/// the layer's first add, which is the input at layer 0 (b = 0 works). Qwen3-Next in 0.5.10 and
/// 0.5.14, MiniMax-M2 in 0.5.14.
const SG_COMMUNICATOR_0_5_10: &[&str] = &["qwen3_next"];
const SG_COMMUNICATOR_0_5_14: &[&str] = &["qwen3_next", "minimax_m2"];
/// Gemma-3 (0.5.14) and Gemma-4 (0.5.14, 0.5.23): `Gemma3TextModel.forward` /
/// `Gemma4TextModel.forward` append the layer input at the top of each layer, the layer returns
/// the whole stream (so b = 0 is the scaled embedding), and after the loop the stream before
/// the final norm is appended when L is asked for.
const SG_GEMMA_LAST: Reach = Reach::Captured(Some(FinalNorm::Pre));

/// sglang 0.5.10 / 0.5.14 turn FlashInfer all-reduce fusion on by default with TP > 1 on
/// SM90/SM100 for these architectures (`server_args.py`; `LayerCommunicator.
/// should_fuse_mlp_allreduce_with_next_layer`): FACTS.md round 2, static reading.
const SG_TP_FUSION: &[(When, &str)] = &[(
    When::Always,
    "at tensor parallelism above 1 on SM90/SM100 this sglang version fuses each layer's MLP \
     all-reduce into the next layer's norm by default, so its model-level capture \
     (hidden_states + residual) may hold one rank's partial sum (static reading, not run): \
     diff an engine dump taken at your TP before trusting it",
)];
/// 0.5.10's rows keep its CUDA-graph caveat beside the fusion one.
const SG_TP_FUSION_0_5_10: &[(When, &str)] = &[SG_CUDA_GRAPH_0_5_10, SG_TP_FUSION[0]];
/// GLM-4.5/4.6: `Glm4MoeModel.forward` sums at the model level (b = 0 crashes) in 0.5.10 and
/// 0.5.14, with the fusion above.
const SG_GLM4_MOE: &[&str] = &["glm4_moe"];

/// sglang 0.5.23 `gemma3_causal.py` (FACTS.md section 1.5).
const SG_GEMMA3_BRANCH: Capture = Capture::Branch(
    "Gemma3TextModel.forward appends hidden_states at the top of each layer, but \
     Gemma3DecoderLayer.forward now returns (hidden_states, residual) apart (the add fused into \
     the next norm): every slot past b = 0 holds the previous layer's post-feed-forward branch, \
     not the residual stream (sglang 0.5.14's layer returned the sum)",
);

// Targets an sglang version cannot serve EAGLE-3 on (FACTS.md section 1.5). The target class
// has no `set_eagle3_layers_to_capture`, which every version calls when the server starts:
// 0.5.10 `model_runner.py` `ModelRunner.initialize` (l. 667-670) and 0.5.14
// `ModelRunner.init_aux_hidden_state_capture` (l. 1008-1011) call it unguarded
// (AttributeError); 0.5.23 `attention_backend_setup.py` `configure_aux_hidden_state_capture`
// (l. 54-61) checks and raises ValueError.
const SG_NO_SETTER_0_5_10: &str = "the target class has no set_eagle3_layers_to_capture, and \
     model_runner.py ModelRunner.initialize calls it unguarded: AttributeError at start-up";
const SG_NO_SETTER_0_5_14: &str = "the target class has no set_eagle3_layers_to_capture, and \
     model_runner.py ModelRunner.init_aux_hidden_state_capture calls it unguarded: AttributeError \
     at start-up";
const SG_NO_SETTER_0_5_23: &str = "the target class has no set_eagle3_layers_to_capture: \
     attention_backend_setup.py configure_aux_hidden_state_capture raises ValueError at start-up";
/// Families without a setter in every audited sglang version: `mistral3.py`
/// (`Mistral3ForConditionalGeneration` forwards to a Llava class without one), `exaone.py`,
/// `exaone4.py`, `mimo.py`, `minicpmv.py`, `glm4.py` (dense GLM-4).
const SG_NEVER: &[&str] = &["mistral3", "exaone", "exaone4", "mimo", "minicpmv", "glm4"];
/// 0.5.10 adds Gemma-3 (`gemma3_causal.py`, `gemma3_mm.py`), Qwen3-VL (`qwen3_vl.py`,
/// `qwen3_vl_moe.py`) and Qwen3.5 (`qwen3_5.py`): none has a setter yet.
const SG_0_5_10_NONE: &[&str] = &[
    "mistral3",
    "exaone",
    "exaone4",
    "mimo",
    "minicpmv",
    "glm4",
    "gemma3",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
];
/// sglang 0.5.14's Qwen3.5 (FACTS.md section 1.5): the classes inherit the Qwen3-VL setter,
/// which only records a layer list, while `Qwen3_5ForCausalLM.forward` captures only layers
/// flagged by the DFlash setter; nothing is captured and `Qwen3VLForConditionalGeneration.forward`
/// splits a bare tensor.
const SG_QWEN3_5_0_5_14: &str = "qwen3_5.py Qwen3_5ForCausalLM.forward captures only layers the \
     DFlash setter flags, so the inherited Qwen3-VL setter captures nothing and qwen3_vl.py \
     Qwen3VLForConditionalGeneration.forward fails splitting the bare output (ValueError; with \
     exactly two tokens, silently wrong data); fixed in 0.5.23";
/// qwen2/qwen3 guard a `None` residual at layer 0, so b = 0 works in every version.
const QWEN_DENSE: &[&str] = &["qwen2", "qwen3"];
/// `Qwen2MoeModel.set_eagle3_layers_to_capture` tags `self.layers[b]`.
const QWEN_MOE: &[&str] = &["qwen2_moe", "qwen3_moe"];
/// `DeepseekV2ForCausalLM` and every class inheriting it (Kimi-K2.5 through `kimi_k25.py`).
const DEEPSEEK_FAMILY: &[&str] = &[
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k2",
    "kimi_k25",
    "glm_moe_dsa",
];

/// `hidden_states + residual` at the top of layer 0, where the residual is still `None`.
const SG_EMBED_CRASH: Reach =
    Reach::Crash("b = 0: the residual is None before layer 0 and stock sglang crashes");
const SG_LOOP_END: Reach = Reach::Dropped(
    "the capture loop only sees the inputs of layers 0..L-1 (b = L is never reached)",
);
const SG_OUTSIDE: Reach = Reach::Dropped("no layer of the capture loop has this index");

const SGLANG_0_5_23: Rule = Rule {
    engine: Engine::Sglang,
    path: "",
    since: v(0, 5, 23),
    read: "0.5.23",
    archs: &[],
    source: "sglang/srt/models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture",
    refuses: None,
    captures: Capture::Residual,
    offset: Offset::PlusOne,
    minus_one: MinusOne::ByOffset,
    embedding: Reach::Captured(None),
    last: SG_LOOP_END,
    outside: SG_OUTSIDE,
    order: Order::Ascending,
    dedup: true,
    strict_count: false,
    default: DefaultList::InputsOf,
    default_raises_up_to: None,
    ids_from: IdsFrom::Nested,
    check: IdCheck::None,
    check_default: false,
    final_target: false,
    caveats: &[],
};

const SGLANG_0_5_14: Rule = Rule {
    since: v(0, 5, 14),
    read: "0.5.14",
    embedding: SG_EMBED_CRASH,
    ..SGLANG_0_5_23
};

/// sglang 0.5.10's CUDA graphs (FACTS.md section 1.1).
const SG_CUDA_GRAPH_0_5_10: (When, &str) = (
    When::ExplicitIds,
    "sglang 0.5.10 records its decode/verify CUDA graphs after setting the default layers and \
     before the explicit ids (cuda_graph_runner.py CudaGraphRunner.__init__, model_runner.py \
     initialize; inferred from the source, not run): decode steps may capture b = [2, L//2, L-3]",
);

const SGLANG_0_5_10: Rule = Rule {
    since: v(0, 5, 10),
    read: "0.5.10",
    embedding: SG_EMBED_CRASH,
    caveats: &[SG_CUDA_GRAPH_0_5_10],
    ..SGLANG_0_5_23
};

const QWEN_MOE_LAST: Reach = Reach::Crash(
    "b = L: Qwen2MoeModel.set_eagle3_layers_to_capture indexes self.layers[L] (IndexError at start-up)",
);

// ---------------------------------------------------------------------------------------------
// vLLM 0.33.0 (FACTS.md section 2): raw ids, embedding as index 0, the pre-norm final state as
// index L, sorted and de-duplicated. The V2 runner is the default.

const VLLM: Rule = Rule {
    engine: Engine::Vllm,
    path: "v2",
    since: v(0, 33, 0),
    read: "0.33.0",
    archs: &[],
    source: "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config; models/llama.py LlamaModel.forward",
    refuses: None,
    captures: Capture::Residual,
    offset: Offset::Raw,
    minus_one: MinusOne::ByOffset,
    embedding: Reach::Captured(None),
    last: Reach::Captured(Some(FinalNorm::Pre)),
    outside: Reach::Dropped("no index of the capture matches it"),
    order: Order::Ascending,
    dedup: true,
    strict_count: false,
    default: DefaultList::InputsOf,
    default_raises_up_to: None,
    ids_from: IdsFrom::Top,
    check: IdCheck::None,
    check_default: false,
    final_target: false,
    caveats: &[],
};

const VLLM_DEEPSEEK: &[&str] = &["deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25"];
const VLLM_DEEPSEEK_EMBED: Reach =
    Reach::Crash("id 0 on vLLM's deepseek backbone: the residual is None before layer 0");

/// Target classes of vLLM 0.33.0 and 0.34.0 without `SupportsEagle3` (FACTS.md sections 2.1, 2.2):
/// `gemma2.py`, `gemma3.py`, `gemma3_mm.py`, `gemma3n.py`, `gemma3n_mm.py`,
/// `glm4.py`, `glm4_moe.py`, `glm4_moe_lite.py`, `glm4_1v.py`, `glm4v_moe` (Glm4vMoe),
/// `qwen2_moe.py`, `qwen2_vl.py`, `bailing_moe.py` (V1 and V2), `longcat_flash.py`,
/// `exaone.py`, `exaone4.py`, `exaone_moe.py`.
const VLLM_NO_EAGLE3: &[&str] = &[
    "gemma2",
    "gemma3",
    "gemma3n",
    "glm4",
    "glm4_moe",
    "glm4_moe_lite",
    "glm4v",
    "glm4v_moe",
    "qwen2_moe",
    "qwen2_vl",
    "bailing_moe",
    "bailing_moe_v2",
    "longcat_flash",
    "exaone",
    "exaone4",
    "exaone_moe",
];
/// vLLM 0.33.0's `gemma.py` (Gemma 1) had no `SupportsEagle3` either; 0.34.0 deleted the file
/// and serves the class on the Transformers backend ([`vllm_transformers_gemma`]).
const VLLM_NO_EAGLE3_GEMMA_0_33: &[&str] = &["gemma"];
const VLLM_NO_EAGLE3_WHY: &str = "the target class does not implement SupportsEagle3: \
     eagle3_utils.py set_eagle3_aux_hidden_state_layers raises RuntimeError when the model loads \
     (0.33.0's V1 runner likewise, gpu_model_runner.py _setup_eagle3_aux_hidden_state_outputs)";
/// `mimo.py` `MiMoForCausalLM` declares `SupportsEagle3` but its forward returns a bare tensor.
const VLLM_MIMO_WHY: &str = "mimo.py MiMoForCausalLM declares SupportsEagle3 but its forward \
     never captures: the first forward fails where the runner unpacks (hidden, aux) \
     (gpu/model_runner.py AssertionError on V2, a tuple-unpack error on V1)";
/// DeepSeek-V3.2 and GLM-5 (`GlmMoeDsaForCausalLM` maps to it on CUDA) run
/// `models/deepseek_v32/nvidia/model.py` `DeepseekV32Model.forward`.
const VLLM_DSV32: &[&str] = &["deepseek_v32", "glm_moe_dsa"];
const VLLM_DSV32_TP: &str = "vLLM's deepseek_v32 backbone leaves each layer's MLP output \
     un-reduced and folds the all-reduce into the next norm: at tensor parallelism above 1 each \
     rank captures its own partial branch plus the residual, not the residual stream \
     (models/deepseek_v32/nvidia/model.py DeepseekV32Model.forward; static reading, not run)";

const VLLM_V1: Rule = Rule {
    path: "v1",
    source: "vllm/v1/worker/gpu_model_runner.py GPUModelRunner._get_eagle3_aux_layers_from_config",
    ids_from: IdsFrom::TopThenNested,
    ..VLLM
};

const VLLM_EXTRACT: Rule = Rule {
    path: "extract",
    source: "vllm/v1/spec_decode/extract_hidden_states.py ExtractHiddenStatesProposer.__init__",
    default: DefaultList::Refused(
        "extract_hidden_states requires the top-level eagle_aux_hidden_state_layer_ids",
    ),
    ..VLLM
};

// vLLM 0.34.0 (FACTS.md section 2.2): the V2 runner's functions are unchanged
// (`eagle3_utils.py` `get_eagle3_aux_layers_from_config`, `set_eagle3_aux_hidden_state_layers`
// fingerprint as in 0.33.0); the V1 runner was deleted.

const VLLM_0_34: Rule = Rule {
    since: v(0, 34, 0),
    read: "0.34.0",
    ..VLLM
};

const VLLM_EXTRACT_0_34: Rule = Rule {
    since: v(0, 34, 0),
    read: "0.34.0",
    source: "vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py ExtractHiddenStatesSpeculator.__init__",
    ..VLLM_EXTRACT
};

/// A generic row that refuses is a path the version no longer has: `select` takes the newest
/// band that still has it when no version is named.
const VLLM_V1_REMOVED: Rule = Rule {
    since: v(0, 34, 0),
    read: "0.34.0",
    source: "vllm/platforms/interface.py Platform.validate_environ; v1/worker/gpu_worker.py Worker._make_model_runner",
    refuses: Some(
        "vLLM 0.34.0 removed the V1 model runner (v1/worker/gpu_model_runner.py is gone; \
         platforms/interface.py Platform.validate_environ raises ValueError when \
         VLLM_USE_V2_MODEL_RUNNER is set to anything but 1): the V2 runner (vllm:v2) serves EAGLE-3",
    ),
    ..VLLM_V1
};

// The target class decides these rows, not the runner: every capture path has them.

const fn vllm_no_eagle3(path: Rule, archs: &'static [&'static str]) -> Rule {
    Rule {
        archs,
        source: "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py set_eagle3_aux_hidden_state_layers; model_executor/models/interfaces.py SupportsEagle3",
        refuses: Some(VLLM_NO_EAGLE3_WHY),
        ..path
    }
}

/// vLLM 0.34.0 deleted `gemma.py`: `registry.py` maps `GemmaForCausalLM` to the Transformers
/// backend, which implements `SupportsEagle3` by recording HF's decoder-layer outputs (b = id for
/// 1..L) and has no state before layer 0 (`transformers/base.py`: id 0 raises KeyError).
const fn vllm_transformers_gemma(path: Rule) -> Rule {
    Rule {
        archs: &["gemma"],
        source: "vllm/model_executor/models/transformers/base.py (registry.py: GemmaForCausalLM on the Transformers backend)",
        embedding: Reach::Crash(
            "the Transformers backend records decoder-layer outputs only: id 0 raises KeyError at start-up",
        ),
        ..path
    }
}

const fn vllm_mimo(path: Rule) -> Rule {
    Rule {
        archs: &["mimo"],
        source: "vllm/model_executor/models/mimo.py MiMoModel.forward",
        refuses: Some(VLLM_MIMO_WHY),
        ..path
    }
}

const fn vllm_deepseek_v32(path: Rule) -> Rule {
    Rule {
        archs: VLLM_DSV32,
        source: "vllm/models/deepseek_v32/nvidia/model.py DeepseekV32Model.forward",
        last: Reach::Dropped(
            "DeepseekV32Model.forward has no end_layer capture: b = L is never captured",
        ),
        caveats: &[(When::Always, VLLM_DSV32_TP)],
        ..path
    }
}

const fn vllm_deepseek(path: Rule) -> Rule {
    Rule {
        archs: VLLM_DEEPSEEK,
        source: "vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward (end_layer capture)",
        embedding: VLLM_DEEPSEEK_EMBED,
        ..path
    }
}

// ---------------------------------------------------------------------------------------------
// TensorRT-LLM at f933a608 (FACTS.md section 3).

const TRTLLM: Rule = Rule {
    engine: Engine::Trtllm,
    path: "one-model",
    since: v(0, 0, 0),
    read: "f933a608",
    archs: &[],
    source: "tensorrt_llm/_torch/speculative/eagle3.py Eagle3OneModelSpecMetadata.__post_init__",
    refuses: None,
    captures: Capture::Residual,
    offset: Offset::PlusOne,
    minus_one: MinusOne::FinalPostNorm,
    embedding: Reach::Captured(None),
    last: Reach::Captured(Some(FinalNorm::Pre)),
    outside: Reach::Dropped("no decoder layer has this index"),
    order: Order::SortedIds,
    dedup: true,
    strict_count: false,
    default: DefaultList::OutputsOf,
    default_raises_up_to: Some(5),
    ids_from: IdsFrom::Setting("EagleDecodingConfig.eagle3_layers_to_capture"),
    check: IdCheck::None,
    check_default: false,
    final_target: false,
    caveats: &[(
        When::MinusOne,
        "TensorRT-LLM documents -1 as the post-norm final state (speculative/save_hidden_state.py), \
         but its capture site was not found at f933a608",
    )],
};

// ---------------------------------------------------------------------------------------------
// SpecForge (FACTS.md section 4): ids through sglang 0.5.14's per-model setter.

const SPECFORGE: Rule = Rule {
    engine: Engine::Specforge,
    path: "offline",
    since: v(0, 0, 0),
    read: "a6b6b023 (wheel 0.2.0; sglang 0.5.14)",
    archs: &[],
    source: "specforge/application/composition.py resolve_offline_capture; algorithms/model_providers.py resolve_eagle_capture_layers",
    check: IdCheck::ThreeDistinctBelowL,
    check_default: true,
    default: DefaultList::OutputsOf,
    ids_from: IdsFrom::OverrideThenNested("model.aux_hidden_state_layer_ids"),
    caveats: &[],
    ..SGLANG_0_5_14
};

// ---------------------------------------------------------------------------------------------
// NVIDIA Model-Optimizer at a2fbac7b (FACTS.md section 5).

const MODELOPT: Rule = Rule {
    engine: Engine::Modelopt,
    path: "hf",
    since: v(0, 0, 0),
    read: "a2fbac7b (wheel 0.47.0)",
    archs: &[],
    source: "examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py (common.py resolve_aux_layers)",
    refuses: None,
    captures: Capture::Residual,
    offset: Offset::PlusOne,
    minus_one: MinusOne::ByOffset,
    embedding: Reach::Captured(None),
    last: Reach::Captured(Some(FinalNorm::Post)),
    outside: Reach::Crash("--aux-layers ids must lie in 0..L"),
    order: Order::Ascending,
    dedup: true,
    strict_count: false,
    default: DefaultList::ModeloptClamped,
    default_raises_up_to: None,
    ids_from: IdsFrom::Setting("--aux-layers"),
    check: IdCheck::BelowL,
    check_default: false,
    final_target: false,
    caveats: &[],
};

/// Every audited row. Within an engine and path, newest band first.
pub const RULES: &[Rule] = &[
    // sglang 0.5.23 (the newest on PyPI).
    Rule {
        archs: LLAMA_FAMILY,
        ..SGLANG_0_5_23
    },
    Rule {
        archs: &["gemma3"],
        source: "sglang/srt/models/gemma3_causal.py Gemma3TextModel.forward; Gemma3DecoderLayer.forward",
        captures: SG_GEMMA3_BRANCH,
        last: SG_GEMMA_LAST,
        ..SGLANG_0_5_23
    },
    Rule {
        archs: &["gemma4"],
        source: "sglang/srt/models/gemma4_causal.py Gemma4TextModel.forward",
        last: SG_GEMMA_LAST,
        ..SGLANG_0_5_23
    },
    Rule {
        archs: SG_NEVER,
        source: "sglang/srt/model_executor/model_runner_components/attention_backend_setup.py configure_aux_hidden_state_capture",
        refuses: Some(SG_NO_SETTER_0_5_23),
        ..SGLANG_0_5_23
    },
    Rule {
        archs: QWEN_DENSE,
        source: "sglang/srt/models/qwen2.py Qwen2ForCausalLM.set_eagle3_layers_to_capture (qwen3.py alike)",
        ..SGLANG_0_5_23
    },
    Rule {
        archs: QWEN_MOE,
        source: "sglang/srt/models/qwen2_moe.py Qwen2MoeModel.set_eagle3_layers_to_capture (qwen3_moe.py)",
        last: QWEN_MOE_LAST,
        outside: Reach::PythonIndex,
        ..SGLANG_0_5_23
    },
    Rule {
        archs: DEEPSEEK_FAMILY,
        source: "sglang/srt/models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture; layers/aux_hidden_states.py AuxHiddenStatePacker.finalize",
        offset: Offset::PlusOneIfFirstIsOne,
        last: Reach::Crash(
            "b = L is never captured and AuxHiddenStatePacker raises (captured k of n)",
        ),
        outside: Reach::Crash(
            "no layer captures it and AuxHiddenStatePacker raises (captured k of n)",
        ),
        strict_count: true,
        ..SGLANG_0_5_23
    },
    Rule {
        archs: &["glm4_moe_lite"],
        source: "sglang/srt/models/glm4_moe_lite.py Glm4MoeLiteForCausalLM.set_eagle3_layers_to_capture",
        offset: Offset::PlusOneIfFirstIsOne,
        ..SGLANG_0_5_23
    },
    Rule {
        archs: &["gpt_oss"],
        source: "sglang/srt/models/gpt_oss.py GptOssForCausalLM.set_eagle3_layers_to_capture",
        offset: Offset::RawIfMaxIsL,
        last: Reach::Captured(Some(FinalNorm::Pre)),
        ..SGLANG_0_5_23
    },
    Rule {
        archs: &["deepseek_v4"],
        source: "sglang/srt/model_executor/model_runner_components/attention_backend_setup.py configure_aux_hidden_state_capture",
        refuses: Some(
            "deepseek_v4.py has no set_eagle3_layers_to_capture: sglang raises ValueError for EAGLE-3",
        ),
        ..SGLANG_0_5_23
    },
    SGLANG_0_5_23,
    // sglang 0.5.14 (SpecForge's pin).
    Rule {
        archs: SG_MODEL_SUM_0_5_14,
        source: "sglang/srt/models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture",
        ..SGLANG_0_5_14
    },
    Rule {
        archs: SG_COMMUNICATOR_0_5_14,
        source: "sglang/srt/layers/communicator.py LayerCommunicator.prepare_attn_and_capture_last_layer_outputs",
        embedding: Reach::Captured(None),
        ..SGLANG_0_5_14
    },
    Rule {
        archs: &["gemma3", "gemma4"],
        source: "sglang/srt/models/gemma3_causal.py Gemma3TextModel.forward (gemma4_causal.py alike)",
        embedding: Reach::Captured(None),
        last: SG_GEMMA_LAST,
        ..SGLANG_0_5_14
    },
    Rule {
        archs: QWEN_DENSE,
        source: "sglang/srt/models/qwen2.py Qwen2Model.forward (None residual falls back to the input)",
        embedding: Reach::Captured(None),
        ..SGLANG_0_5_14
    },
    Rule {
        archs: QWEN_MOE,
        source: "sglang/srt/models/qwen2_moe.py Qwen2MoeModel.set_eagle3_layers_to_capture",
        embedding: Reach::Captured(None),
        last: QWEN_MOE_LAST,
        outside: Reach::PythonIndex,
        ..SGLANG_0_5_14
    },
    Rule {
        archs: DEEPSEEK_FAMILY,
        source: "sglang/srt/models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture",
        offset: Offset::PlusOneIfFirstIsOne,
        embedding: Reach::Captured(None),
        ..SGLANG_0_5_14
    },
    Rule {
        archs: &["glm4_moe_lite"],
        source: "sglang/srt/models/glm4_moe_lite.py Glm4MoeLiteForCausalLM.set_eagle3_layers_to_capture",
        offset: Offset::PlusOneIfFirstIsOne,
        caveats: SG_TP_FUSION,
        ..SGLANG_0_5_14
    },
    Rule {
        archs: SG_GLM4_MOE,
        source: "sglang/srt/models/glm4_moe.py Glm4MoeModel.forward",
        caveats: SG_TP_FUSION,
        ..SGLANG_0_5_14
    },
    Rule {
        archs: &["qwen3_vl_moe"],
        source: "sglang/srt/models/qwen3_vl_moe.py Qwen3MoeLLMModel.forward",
        embedding: Reach::Captured(None),
        caveats: SG_TP_FUSION,
        ..SGLANG_0_5_14
    },
    Rule {
        archs: &["deepseek_v4"],
        source: "sglang/srt/models/deepseek_v4.py (DFlash/DSpark capture only)",
        refuses: Some("deepseek_v4.py implements no EAGLE-3 capture in sglang 0.5.14"),
        ..SGLANG_0_5_14
    },
    Rule {
        archs: SG_NEVER,
        source: "sglang/srt/model_executor/model_runner.py ModelRunner.init_aux_hidden_state_capture",
        refuses: Some(SG_NO_SETTER_0_5_14),
        ..SGLANG_0_5_14
    },
    Rule {
        archs: &["qwen3_5", "qwen3_5_moe"],
        source: "sglang/srt/models/qwen3_5.py Qwen3_5ForCausalLM.forward; qwen3_vl.py Qwen3VLForConditionalGeneration.set_eagle3_layers_to_capture",
        refuses: Some(SG_QWEN3_5_0_5_14),
        ..SGLANG_0_5_14
    },
    Rule {
        archs: &["gpt_oss"],
        source: "sglang/srt/models/gpt_oss.py GptOssForCausalLM.set_eagle3_layers_to_capture",
        caveats: SG_TP_FUSION,
        ..SGLANG_0_5_14
    },
    SGLANG_0_5_14,
    // sglang 0.5.10: +1 on every id, every model (before PR 25454).
    Rule {
        archs: SG_MODEL_SUM_0_5_10,
        source: "sglang/srt/models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture",
        ..SGLANG_0_5_10
    },
    Rule {
        archs: SG_COMMUNICATOR_0_5_10,
        source: "sglang/srt/layers/communicator.py LayerCommunicator.prepare_attn_and_capture_last_layer_outputs",
        embedding: Reach::Captured(None),
        ..SGLANG_0_5_10
    },
    Rule {
        archs: QWEN_DENSE,
        source: "sglang/srt/models/qwen2.py Qwen2Model.forward (None residual falls back to the input)",
        embedding: Reach::Captured(None),
        ..SGLANG_0_5_10
    },
    Rule {
        archs: QWEN_MOE,
        source: "sglang/srt/models/qwen2_moe.py Qwen2MoeModel.set_eagle3_layers_to_capture",
        embedding: Reach::Captured(None),
        last: QWEN_MOE_LAST,
        outside: Reach::PythonIndex,
        ..SGLANG_0_5_10
    },
    Rule {
        archs: &[
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "kimi_k2",
            "kimi_k25",
            "glm_moe_dsa",
            "glm4_moe_lite",
        ],
        source: "sglang/srt/models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture (before PR 25454)",
        caveats: SG_TP_FUSION_0_5_10,
        ..SGLANG_0_5_10
    },
    Rule {
        archs: &["gpt_oss"],
        source: "sglang/srt/models/gpt_oss.py GptOssForCausalLM.set_eagle3_layers_to_capture",
        caveats: SG_TP_FUSION_0_5_10,
        ..SGLANG_0_5_10
    },
    Rule {
        archs: SG_GLM4_MOE,
        source: "sglang/srt/models/glm4_moe.py Glm4MoeModel.forward",
        caveats: SG_TP_FUSION_0_5_10,
        ..SGLANG_0_5_10
    },
    Rule {
        archs: SG_0_5_10_NONE,
        source: "sglang/srt/model_executor/model_runner.py ModelRunner.initialize",
        refuses: Some(SG_NO_SETTER_0_5_10),
        ..SGLANG_0_5_10
    },
    Rule {
        archs: &["gemma4"],
        source: "sglang/srt/models/ (0.5.10 has no gemma4*.py)",
        refuses: Some("sglang 0.5.10 has no Gemma-4 model file: the target does not load"),
        ..SGLANG_0_5_10
    },
    SGLANG_0_5_10,
    // vLLM 0.34.0 (V2 runner and extract_hidden_states; the V1 runner is gone) and 0.33.0 (V2,
    // V1, extract_hidden_states). Newest band first within each path.
    vllm_no_eagle3(VLLM_0_34, VLLM_NO_EAGLE3),
    vllm_transformers_gemma(VLLM_0_34),
    vllm_mimo(VLLM_0_34),
    vllm_deepseek_v32(VLLM_0_34),
    vllm_deepseek(VLLM_0_34),
    VLLM_0_34,
    vllm_no_eagle3(VLLM, VLLM_NO_EAGLE3),
    vllm_no_eagle3(VLLM, VLLM_NO_EAGLE3_GEMMA_0_33),
    vllm_mimo(VLLM),
    vllm_deepseek_v32(VLLM),
    vllm_deepseek(VLLM),
    VLLM,
    VLLM_V1_REMOVED,
    vllm_no_eagle3(VLLM_V1, VLLM_NO_EAGLE3),
    vllm_no_eagle3(VLLM_V1, VLLM_NO_EAGLE3_GEMMA_0_33),
    vllm_mimo(VLLM_V1),
    vllm_deepseek_v32(VLLM_V1),
    vllm_deepseek(VLLM_V1),
    VLLM_V1,
    vllm_no_eagle3(VLLM_EXTRACT_0_34, VLLM_NO_EAGLE3),
    vllm_transformers_gemma(VLLM_EXTRACT_0_34),
    vllm_mimo(VLLM_EXTRACT_0_34),
    vllm_deepseek_v32(VLLM_EXTRACT_0_34),
    vllm_deepseek(VLLM_EXTRACT_0_34),
    VLLM_EXTRACT_0_34,
    vllm_no_eagle3(VLLM_EXTRACT, VLLM_NO_EAGLE3),
    vllm_no_eagle3(VLLM_EXTRACT, VLLM_NO_EAGLE3_GEMMA_0_33),
    vllm_mimo(VLLM_EXTRACT),
    vllm_deepseek_v32(VLLM_EXTRACT),
    vllm_deepseek(VLLM_EXTRACT),
    VLLM_EXTRACT,
    // TensorRT-LLM: one-model (default) sorts; two-model sorts and moves -1 last.
    TRTLLM,
    Rule {
        path: "two-model",
        source: "tensorrt_llm/_torch/speculative/eagle3.py Eagle3SpecMetadata.__post_init__",
        order: Order::SortedIdsMinusOneLast,
        ..TRTLLM
    },
    // SpecForge: sglang 0.5.14's per-model setter behind SpecForge's own checks.
    Rule {
        archs: DEEPSEEK_FAMILY,
        source: "specforge/application/composition.py resolve_offline_capture; sglang 0.5.14 deepseek_v2.py",
        offset: Offset::PlusOneIfFirstIsOne,
        embedding: Reach::Captured(None),
        ..SPECFORGE
    },
    Rule {
        archs: &["glm4_moe_lite"],
        source: "specforge/application/composition.py resolve_offline_capture; sglang 0.5.14 glm4_moe_lite.py",
        offset: Offset::PlusOneIfFirstIsOne,
        ..SPECFORGE
    },
    SPECFORGE,
    Rule {
        path: "online",
        archs: DEEPSEEK_FAMILY,
        source: "specforge/training/capture_contract.py resolve_server_capture_contract; sglang 0.5.14 deepseek_v2.py",
        offset: Offset::PlusOneIfFirstIsOne,
        embedding: Reach::Captured(None),
        check: IdCheck::ThreeDistinct,
        ..SPECFORGE
    },
    Rule {
        path: "online",
        source: "specforge/training/capture_contract.py resolve_server_capture_contract",
        check: IdCheck::ThreeDistinct,
        ..SPECFORGE
    },
    // SafeAILab EAGLE: the inputs of layers {2, L//2, L-3}, whatever the config says.
    Rule {
        engine: Engine::Eagle,
        path: "",
        since: v(0, 0, 0),
        read: "cb7e0841",
        archs: &[],
        source: "eagle/traineagle3/modeling_llama_kv.py LlamaModel.forward; traineagle3/cnets.py Model.dataprepare",
        refuses: None,
        captures: Capture::Residual,
        offset: Offset::Ignored,
        minus_one: MinusOne::ByOffset,
        embedding: Reach::Captured(None),
        last: SG_LOOP_END,
        outside: SG_OUTSIDE,
        order: Order::Ascending,
        dedup: true,
        strict_count: false,
        default: DefaultList::InputsOf,
        default_raises_up_to: None,
        ids_from: IdsFrom::Nowhere,
        check: IdCheck::ThreeDistinctLayers,
        check_default: true,
        final_target: false,
        caveats: &[],
    },
    // NVIDIA Model-Optimizer: the HF dump (default) and the vLLM dump.
    MODELOPT,
    Rule {
        path: "vllm",
        source: "examples/speculative_decoding/collect_hidden_states/compute_hidden_states_vllm.py",
        offset: Offset::Raw,
        last: Reach::Captured(Some(FinalNorm::Pre)),
        default: DefaultList::Refused(
            "the vLLM dump has no default: --aux-layers eagle raises there",
        ),
        final_target: true,
        ..MODELOPT
    },
    // speculators: data through vLLM's extract_hidden_states, L appended as the target.
    Rule {
        engine: Engine::Speculators,
        path: "",
        since: v(0, 9, 0),
        read: "0.9.0 (scripts/launch_vllm.py at c05b95b3)",
        archs: &[],
        source: "scripts/launch_vllm.py main; speculators/models/utils.py resolve_target_layer_ids",
        ids_from: IdsFrom::Setting("--target-layer-ids"),
        check: IdCheck::DistinctUpToL,
        final_target: true,
        ..VLLM
    },
];
