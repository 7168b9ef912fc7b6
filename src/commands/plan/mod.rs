//! `eagle-check plan`: the engine invocations that dump, on the user's own cluster and at the
//! user's parallelism, every boundary of a set of prompts (the reference for a target too large
//! to run here) and the three junctions where the founding incident was seen (each captured aux
//! state, the concatenation the logits processor stores, the draft's `fc` input).
//!
//! The ids that make an engine capture every boundary come from the rule table
//! ([`crate::engine::ids_for`]), so they differ by engine and architecture: sglang adds 1 to
//! every id on Llama-family targets and applies the first-id rule on DeepSeek; vLLM uses them
//! raw. Every flag, environment variable and JSON key printed here was read from the engines'
//! sources (sglang 0.5.23 and vLLM 0.33.0 wheels, the versions of the rule table); each carries
//! the file it was read from, and `fixtures/engines/plan_flags.py` re-extracts them for the test.
//!
//! The script runs unedited under POSIX `sh` (`script`: start, wait for and stop each server by
//! its PID) and says what it will cost before it runs (`cost`: bytes per token, the dumps, the
//! device memory, vLLM's `--max-model-len`).

mod cost;
mod script;

pub use cost::{Cost, Held, PromptStats, check_prompts, human, max_model_len};

use crate::boundary::{Boundary, FinalNorm};
use crate::config::{DraftConfig, TargetInfo};
use crate::engine::rules::Reach;
use crate::engine::{Engine, EngineSel, Version, ids_for, resolve, rule_words, select};
use crate::error::{Error, Result};
use crate::locate;
use cost::Stored;
use script::sh;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The engine versions whose sources the printed flags were read from.
pub const SGLANG: Version = Version([0, 5, 23]);
pub const VLLM: Version = Version([0, 33, 0]);

/// What `plan` needs.
pub struct PlanInput<'a> {
    pub target: &'a TargetInfo,
    /// `--target` as given: where `diff` reads the target's config.
    pub target_arg: String,
    /// The weights the engine loads (a folder or an HF id): `--target-path`, or `--target` when
    /// it names a folder or an id. None when only a config file was given: the script then
    /// asks for `EAGLE_CHECK_TARGET`.
    pub model: Option<String>,
    pub engine: EngineSel,
    pub tp: usize,
    pub ep: Option<usize>,
    /// A JSONL of prompts (`{"text": ...}` or `{"input_ids": [...]}` per line), checked.
    pub prompts: Option<PathBuf>,
    pub draft: Option<DraftInput<'a>>,
    /// Where the dumps go (a folder on the engine's host).
    pub out: String,
}

/// `plan`'s flags.
pub struct PlanOptions {
    pub target: PathBuf,
    pub target_path: Option<String>,
    pub engine: String,
    pub tp: usize,
    pub ep: Option<usize>,
    pub prompts: Option<PathBuf>,
    pub draft: Option<PathBuf>,
    pub draft_path: Option<String>,
    pub out: String,
    pub revision: Option<String>,
}

/// `eagle-check plan`: reads the target's (and the draft's) config, then [`plan`].
pub fn execute(opts: &PlanOptions) -> Result<Plan> {
    let sel = super::engine_sel(&opts.engine)?;
    let revision = opts.revision.as_deref();
    let located = locate::locate_model(&opts.target, revision)?;
    let info = super::target_info(&located)?;
    let draft_cfg = match &opts.draft {
        Some(d) => Some((DraftConfig::load(&locate::locate_model(d, revision)?)?, d)),
        None => None,
    };
    plan(&PlanInput {
        target: &info,
        target_arg: opts.target.display().to_string(),
        model: opts
            .target_path
            .clone()
            .or_else(|| engine_path(&opts.target)),
        engine: sel,
        tp: opts.tp,
        ep: opts.ep,
        prompts: opts.prompts.clone(),
        draft: draft_cfg.as_ref().map(|(config, arg)| DraftInput {
            config,
            arg: arg.display().to_string(),
            path: opts.draft_path.clone().or_else(|| engine_path(arg)),
        }),
        out: opts.out.clone(),
    })
}

/// What an engine can load of a `plan --target`/`--draft`: a folder or an HF id as given; a
/// config file is neither its weights nor (its folder) surely where they are, so None.
fn engine_path(given: &Path) -> Option<String> {
    let is_file = given.is_file() || given.extension().is_some_and(|e| e == "json");
    (!is_file).then(|| given.display().to_string())
}

/// The draft the engine serves.
pub struct DraftInput<'a> {
    pub config: &'a DraftConfig,
    /// `--draft` as given: where `diff` reads the draft's config.
    pub arg: String,
    /// The draft's weights as the engine loads them (`--draft-path`, or `--draft` when it names
    /// a folder or an id); None: the script asks for `EAGLE_CHECK_DRAFT`.
    pub path: Option<String>,
}

/// A file the plan asks the user to write (the printed script writes it with a heredoc).
#[derive(Debug, Clone, Serialize)]
pub struct PlanFile {
    pub path: String,
    pub content: String,
}

/// One step: files, shell commands, where its dumps land, what it costs, and what to know.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub title: String,
    pub files: Vec<PlanFile>,
    pub commands: Vec<String>,
    /// false: the commands run elsewhere, later (the script prints them as comments).
    pub runs_here: bool,
    /// The folder the step's dumps land in, and their layout.
    pub output: String,
    pub cost: Option<Cost>,
    pub notes: Vec<String>,
}

/// The boundaries the reference dump captures, and how.
#[derive(Debug, Clone, Serialize)]
pub struct Coverage {
    /// The ids given to the engine's capture.
    pub ids: Vec<i64>,
    /// The boundaries those ids capture (b, canonical).
    pub captured: Vec<usize>,
    /// Boundaries the capture cannot reach, each with why and where they come from instead.
    pub elsewhere: Vec<String>,
    /// The rule that maps the ids (the rule table's row and source).
    pub rule: String,
}

/// The whole plan: `to_text` renders it as a shell script, `--format json` as this value.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub engine: String,
    /// The target's weights as the engine loads them (None: the script asks for them).
    pub model: Option<String>,
    pub model_type: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub tensor_parallel: usize,
    pub expert_parallel: Option<usize>,
    pub prompts: Option<String>,
    pub prompt_stats: Option<PromptStats>,
    /// vLLM's `--max-model-len` (the longest prompt and one generated token, rounded up).
    pub max_model_len: Option<u64>,
    pub coverage: Coverage,
    /// The script's first lines: `set -eu`, its variables, the dump folder, the helpers.
    pub prelude: Vec<String>,
    pub steps: Vec<Step>,
}

/// Parallelism as each engine spells it.
struct Parallel {
    flags: Vec<String>,
    notes: Vec<String>,
}

fn usage(message: String) -> Error {
    Error::Usage(message)
}

/// The plan for `input`.
pub fn plan(input: &PlanInput) -> Result<Plan> {
    let sel = input.engine;
    let newest = match sel.engine {
        Engine::Sglang => SGLANG,
        Engine::Vllm => VLLM,
        other => {
            return Err(usage(format!(
                "plan --engine: {other} is not a serving engine plan knows (sglang, vllm)"
            )));
        }
    };
    if let Some(v) = sel.version.filter(|&v| v != newest) {
        return Err(usage(format!(
            "plan --engine {sel}: the flags plan prints were read from {} {newest}; {v} was not read",
            sel.engine
        )));
    }
    if input.tp == 0 {
        return Err(usage("plan --tp: must be at least 1".into()));
    }
    let stats = input.prompts.as_deref().map(check_prompts).transpose()?;
    let mut plan = match sel.engine {
        Engine::Sglang => sglang_plan(input, stats.as_ref())?,
        _ => vllm_plan(input, stats.as_ref())?,
    };
    plan.prompts = input
        .prompts
        .as_ref()
        .zip(stats.as_ref())
        .map(|(p, s)| format!("{} ({} prompts)", p.display(), s.count));
    plan.prompt_stats = stats;
    plan.prelude = prelude(input, sel.engine);
    Ok(plan)
}

/// Every boundary the capture path `sel` reaches on this target, and the ids that reach them
/// all at once, inverted from the rule table. `nonneg`: the ids must be >= 0 (sglang's
/// `--return-aux-hidden-state-layer-ids` refuses negative ids).
fn coverage(sel: &EngineSel, arch: &str, l: usize, nonneg: bool) -> Result<Coverage> {
    let rule = select(sel, Some(arch)).rule;
    let side = |b: usize| (b == l).then_some(FinalNorm::Pre);
    let ok = |ids: &[i64]| !nonneg || ids.iter().all(|&i| i >= 0);
    let inverse = |bs: &[usize]| {
        let want: Vec<(Boundary, Option<FinalNorm>)> =
            bs.iter().map(|&b| (Boundary(b), side(b))).collect();
        ids_for(sel, Some(arch), &want, l)
    };
    // Only the edges can be out of reach (b = 0: the embedding; b = L: past the capture loop);
    // interior boundaries always are, but a first-id rule reads each id in the context of the
    // whole list, so the list is inverted as a whole, with fewer edges until one works.
    let all: Vec<usize> = (0..=l).collect();
    let mut chosen = None;
    for drop in [&[][..], &[l], &[0], &[0, l]] {
        let bs: Vec<usize> = all.iter().copied().filter(|b| !drop.contains(b)).collect();
        if let Some((ids, _)) = inverse(&bs).filter(|(ids, _)| ok(ids)) {
            chosen = Some((bs, ids, drop.to_vec()));
            break;
        }
    }
    let (captured, ids, dropped) = chosen.ok_or_else(|| {
        Error::Usage(format!(
            "{sel} on a {arch} target: no id list captures the boundaries 1..{l} ({})",
            rule.source
        ))
    })?;
    let elsewhere = dropped
        .iter()
        .map(|&b| {
            let reach = if b == 0 { rule.embedding } else { rule.last };
            match (reach, inverse(&[b])) {
                (Reach::Crash(m) | Reach::Dropped(m), _) => format!("b = {b}: {m}"),
                (_, Some((ids, _))) if !ok(&ids) => format!(
                    "b = {b} needs id {}, which the capture-only flag refuses (non-negative ids only, \
                     validation_hook.py handle_aux_hidden_state_capture)",
                    ids[0]
                ),
                _ => format!("b = {b} is not reachable through this capture"),
            }
        })
        .collect();
    Ok(Coverage {
        ids,
        captured,
        elsewhere,
        rule: format!(
            "{}@{} on {arch}: {} ({})",
            sel.engine,
            rule.read,
            rule_words(rule),
            rule.source
        ),
    })
}

/// A list for people: `0..=60` when it counts up by one, else `[2, 30, 58]`.
fn short(values: &[i64]) -> String {
    match values {
        [first, .., last] if values.len() > 3 && values.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("{first}..={last}")
        }
        _ => format!("{values:?}"),
    }
}

fn join_ids(ids: &[i64], sep: &str) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(sep)
}

/// The script's first lines: `set -eu`; the user's target, draft and prompts as variables (one
/// plan could not know stops the script at once with what to set); the port and time-outs; the
/// dump folder, made before anything is written into it; the helpers.
fn prelude(input: &PlanInput, engine: Engine) -> Vec<String> {
    let mut lines = vec!["set -eu".to_string()];
    lines.push(script::variable(
        "TARGET",
        input.model.as_deref(),
        "set EAGLE_CHECK_TARGET to the target weights the engine loads, a folder or an HF id, \
         or re-run eagle-check plan with --target-path",
    ));
    if let Some(d) = &input.draft {
        lines.push(script::variable(
            "DRAFT",
            d.path.as_deref(),
            "set EAGLE_CHECK_DRAFT to the draft weights the engine loads, a folder or an HF id, \
             or re-run eagle-check plan with --draft-path",
        ));
    }
    let prompts = input.prompts.as_ref().map(|p| p.display().to_string());
    lines.push(script::variable(
        "PROMPTS",
        prompts.as_deref(),
        "set EAGLE_CHECK_PROMPTS to a JSONL of prompts, or re-run eagle-check plan with --prompts",
    ));
    lines.extend(script::settings(engine));
    lines.push(format!("mkdir -p {}", sh(&input.out)));
    lines.push(script::HELPERS.trim_end().to_string());
    if engine == Engine::Vllm {
        lines.push(script::WAIT_FILES.trim_end().to_string());
    }
    lines
}

/// The line that posts the prompts to `route` (vLLM's requests also name the model).
fn send(input: &PlanInput, engine: Engine, route: &str) -> String {
    let model = if engine == Engine::Vllm {
        " \"$TARGET\""
    } else {
        ""
    };
    format!(
        "python3 {} \"http://127.0.0.1:$PORT{route}\" \"$PROMPTS\"{model}",
        sh(&sender_path(input))
    )
}

fn sender_path(input: &PlanInput) -> String {
    format!("{}/send_prompts.py", input.out)
}

// ------------------------------------------------------------------------------------- sglang

/// The source patch that dumps junctions 1 and 2 through sglang's dumper
/// (`DUMPER_SOURCE_PATCHER_CONFIG`, srt/debug_utils/source_patcher/types.py PatchConfig:
/// `patches: [{target, edits: [{match, prepend|append|replacement}]}]`; the dumper injects its
/// own import, dumper.py `apply_source_patches`). The matched lines are sglang 0.5.23's:
/// srt/layers/aux_hidden_states.py (`AuxHiddenStateList.capture`, the list path of Llama-family
/// models; `AuxHiddenStatePacker.append`, the packed path of DeepSeek-V2/V3 and Kimi) and
/// srt/layers/logits_processor.py `LogitsProcessor._get_hidden_states_to_store`.
///
/// The first patch makes the file apply once per process. sglang applies it after every model
/// load (srt/model_executor/model_runner.py, `dumper.apply_source_patches()` after
/// `maybe_register_debug_tensor_dump_hook`), and with a draft that is twice in the same process:
/// the target's ModelRunner, then the draft's (srt/speculative/eagle_worker_v2.py
/// `EAGLEWorkerV2.__init__` l. 223 builds a second `TpModelWorker`). The second application
/// fails: `patch_function` (srt/debug_utils/source_patcher/code_patcher.py l. 83) re-reads
/// the patched function with `inspect.getsource`, but the first patch compiled it from a string
/// whose `def` is line 1, so `getsource` returns the first def or class block of the real file
/// (`class AuxHiddenStateList`), the edit still matches inside it, and `exec` defines the class,
/// not the function: `temp_namespace[target.__name__]` at l. 99 raises `KeyError: 'capture'`.
/// Replacing `config_path` in `_Dumper.apply_source_patches` (srt/debug_utils/dumper.py) with
/// None turns every later call into its `if not config_path: return`; the call that applies it
/// runs the old code object to the end. fixtures/engines/patch_twice.py applies this file twice
/// with the wheel's own patcher.
pub const SGLANG_PATCH: &str = "\
# eagle-check plan: dump every EAGLE-3 aux capture (junction 1, tagged with the layer it is captured in)
# and the concatenation the logits processor stores (junction 2). sglang 0.5.23.
patches:
  # Apply this file once per process: sglang applies it again for the draft's ModelRunner, and
  # a second application fails (source_patcher/code_patcher.py patch_function, KeyError).
  - target: sglang.srt.debug_utils.dumper._Dumper.apply_source_patches
    edits:
      - match: \"config_path = self._config.source_patcher_config\"
        replacement: \"config_path = None\"
  - target: sglang.srt.layers.aux_hidden_states.AuxHiddenStateList.capture
    edits:
      - match: \"self.append(hidden if owned else hidden.clone())\"
        prepend: \"dumper.dump('eagle_aux_capture', hidden)\"
  - target: sglang.srt.layers.aux_hidden_states.AuxHiddenStatePacker.append
    edits:
      - match: \"self.slot(hidden).copy_(hidden)\"
        prepend: \"dumper.dump('eagle_aux_capture', hidden)\"
  - target: sglang.srt.layers.logits_processor.LogitsProcessor._get_hidden_states_to_store
    edits:
      - match: \"hidden_states_to_store = pack_aux_hidden_states(aux_hidden_states)\"
        append: \"dumper.dump('eagle_aux_hidden_states', hidden_states_to_store)\"
";

fn sglang_parallel(input: &PlanInput) -> Result<Parallel> {
    // srt/arg_groups/fields/parallel.py: tp_size (`--tp-size`, alias `--tensor-parallel-size`),
    // ep_size (`--ep-size`, aliases `--expert-parallel-size`, `--ep`); MoE experts are split
    // over ep_size ranks of the TP group, so it must divide tp_size
    // (srt/model_executor/model_runner_components/moe_ep_setup.py: `tp_size % moe_ep_size`).
    let mut flags = vec![format!("--tp-size {}", input.tp)];
    let mut notes = Vec::new();
    if let Some(ep) = input.ep {
        if ep == 0 || !input.tp.is_multiple_of(ep) {
            return Err(usage(format!(
                "plan --ep {ep}: sglang splits experts over ep ranks of the TP group, so --ep must divide --tp ({})",
                input.tp
            )));
        }
        if ep > 1 {
            flags.push(format!("--ep-size {ep}"));
        }
    }
    notes.push(
        "leave DP attention and two-batch overlap off while dumping: DP attention gives each rank other \
         requests and scatters tokens, two-batch overlap runs layers past first_k_dense_replace outside the \
         capture loop (models/deepseek_v2.py DeepseekV2Model.forward; sglang PR 32680)"
            .into(),
    );
    Ok(Parallel { flags, notes })
}

/// sglang's dumper settings as environment variables (srt/debug_utils/dumper.py DumperConfig:
/// prefix `DUMPER_`, one per field: enable, dir, exp_name, filter, non_intrusive_mode,
/// source_patcher_config, enable_output_console).
fn dumper_env(dir: &str, exp: &str, names: &[&str], patch: &str) -> Vec<String> {
    // The filter is a Python expression over the dump's tags (dumper.py _evaluate_filter).
    let filter = format!(
        "name in ({})",
        names
            .iter()
            .map(|n| format!("'{n}'"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    vec![
        // srt/environ.py SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION (default true): /health then
        // runs a one-token generation of input_ids [0] (srt/entrypoints/http_server.py
        // health_generate), which the dumper would record as a sequence of its own.
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0".into(),
        "DUMPER_ENABLE=1".into(),
        format!("DUMPER_DIR={}", sh(dir)),
        format!("DUMPER_EXP_NAME={exp}"),
        // `all`: every module's inputs and outputs pass the filter (the fc input, the embedding,
        // the final norm); the layer_id tag comes from the ctx hooks of `*.layers.N` modules
        // (dumper.py _NonIntrusiveDumper).
        "DUMPER_NON_INTRUSIVE_MODE=all".into(),
        format!("DUMPER_SOURCE_PATCHER_CONFIG={}", sh(patch)),
        // Double quotes: the filter holds single-quoted names and nothing the shell expands.
        format!("DUMPER_FILTER=\"{filter}\""),
        "DUMPER_ENABLE_OUTPUT_CONSOLE=0".into(),
    ]
}

/// Flags that keep every prefill whole and every hook running (sglang 0.5.23):
/// srt/arg_groups/fields/memory.py `disable_radix_cache` (a cached prefix is not recomputed),
/// srt/arg_groups/fields/schedule.py `chunked_prefill_size` (-1 disables chunking),
/// srt/arg_groups/fields/exec_.py `disable_prefill_cuda_graph`, `disable_decode_cuda_graph`
/// (a graph replay runs no Python hook).
const SGLANG_WHOLE: &str = "--disable-radix-cache --chunked-prefill-size -1 --disable-prefill-cuda-graph --disable-decode-cuda-graph";

fn launch(env: &[String], args: &[String]) -> String {
    let mut out = String::new();
    for e in env {
        let _ = write!(out, "{e} \\\n  ");
    }
    out.push_str(&args.join(" \\\n  "));
    out
}

fn sglang_patch_path(input: &PlanInput) -> String {
    format!("{}/sglang-patch.yaml", input.out)
}

/// What an sglang dumper step stores per token: `states` rows of the target's width, and the
/// int64 `input_ids` and `positions`, on every TP rank, for the forward at hand.
fn sglang_dump_cost(
    states: usize,
    input: &PlanInput,
    prompts: Option<&PromptStats>,
) -> Result<Cost> {
    let stored = Stored {
        states,
        hidden: input.target.hidden_size,
        side_bytes: 16,
        copies: input.tp,
        held: Held::PerForward,
    };
    Cost::of(&stored, prompts)
}

/// An sglang dumper step's commands: a fresh folder, the server started with the dumper's
/// environment (experiment `exp`, its log beside the dumps), the prompts sent, the server
/// stopped.
fn sglang_dump_commands(
    input: &PlanInput,
    dir: &str,
    exp: &str,
    names: &[&str],
    patch: &str,
    args: &[String],
) -> Vec<String> {
    let mut commands = vec![format!("fresh_dir {}", sh(dir))];
    commands.extend(script::start(
        launch(&dumper_env(dir, exp, names, patch), args),
        &format!("{}/sglang-{exp}.log", input.out),
        "/health",
    ));
    commands.push(send(input, Engine::Sglang, "/generate"));
    commands.push("stop_server".into());
    commands
}

fn sglang_plan(input: &PlanInput, prompts: Option<&PromptStats>) -> Result<Plan> {
    let t = input.target;
    let l = t.num_layers;
    let sel = EngineSel {
        engine: Engine::Sglang,
        path: None,
        version: Some(SGLANG),
    };
    let cov = coverage(&sel, &t.family.name, l, true)?;
    let par = sglang_parallel(input)?;
    let patch = PlanFile {
        path: sglang_patch_path(input),
        content: SGLANG_PATCH.to_string(),
    };
    let reference_dir = format!("{}/sglang-reference", input.out);
    let junction_dir = format!("{}/sglang-junctions", input.out);
    // srt/arg_groups/fields/serving.py `port`, `skip_server_warmup`: without it the server posts
    // "The capital city of France is" before it answers (srt/entrypoints/http_server.py
    // _execute_server_warmup, l. 2455), and the dumper records that as a sequence.
    let serve = [
        "python3 -m sglang.launch_server".to_string(),
        "--model-path \"$TARGET\"".into(),
        "--port \"$PORT\"".into(),
        "--skip-server-warmup".into(),
    ];

    // Reference: capture-only aux capture of every reachable boundary, without a draft
    // (srt/arg_groups/fields/exec_.py enable_return_aux_hidden_states,
    // return_aux_hidden_state_layer_ids; srt/arg_groups/validation_hook.py
    // handle_aux_hidden_state_capture: --speculative-algorithm EAGLE3 names the convention,
    // ids must be non-negative and distinct, no draft path), the ids through the model's own
    // set_eagle3_layers_to_capture (the rule table's row), plus the embedding and both sides of
    // the final norm from the non-intrusive dumper.
    let mut names = vec![
        "input_ids",
        "positions",
        "eagle_aux_capture",
        "non_intrusive__model.norm.output.0",
        "non_intrusive__model.norm.output.1",
    ];
    if !cov.captured.contains(&0) {
        names.push("non_intrusive__model.embed_tokens.output");
    }
    let mut args = serve.to_vec();
    args.extend(par.flags.iter().cloned());
    args.push("--enable-return-aux-hidden-states --speculative-algorithm EAGLE3".into());
    args.push(format!(
        "--return-aux-hidden-state-layer-ids {}",
        join_ids(&cov.ids, " ")
    ));
    args.push(SGLANG_WHOLE.into());
    // Per token: the aux captures, the norm's two outputs, the embedding when the ids miss it.
    let reference_cost = sglang_dump_cost(names.len() - 3 + cov.ids.len(), input, prompts)?;
    let commands = sglang_dump_commands(
        input,
        &reference_dir,
        "reference",
        &names,
        &patch.path,
        &args,
    );
    let reference = Step {
        title: format!(
            "Reference: every boundary of the prompts, from sglang {SGLANG} at this parallelism"
        ),
        files: vec![
            patch.clone(),
            PlanFile {
                path: sender_path(input),
                content: script::sender(Engine::Sglang),
            },
        ],
        commands,
        runs_here: true,
        output: format!(
            "{reference_dir}/reference/step=S___rank=R___dump_index=I___name=NAME___...pt: one file per \
             tensor and forward pass (srt/debug_utils/dumper.py _Dumper._dump_single)"
        ),
        cost: Some(reference_cost),
        notes: {
            let mut n = vec![format!(
                "--return-aux-hidden-state-layer-ids {} -> b = {} through the model's own \
                 set_eagle3_layers_to_capture (the rule above)",
                short(&cov.ids),
                short(&cov.captured.iter().map(|&b| b as i64).collect::<Vec<_>>())
            )];
            n.extend(cov.elsewhere.iter().map(|e| {
                if e.starts_with("b = 0") {
                    format!("{e}: dumped from embed_tokens instead")
                } else {
                    format!("{e}: dumped from the final norm's (normed, residual) pair instead")
                }
            }));
            n.extend(par.notes.iter().cloned());
            n
        },
    };

    let junctions = match &input.draft {
        Some(draft) => sglang_junctions(input, draft, &sel, &serve, &par, prompts)?,
        None => no_draft_step(),
    };
    Ok(Plan {
        engine: format!("sglang@{SGLANG}"),
        model: input.model.clone(),
        model_type: t.model_type.clone(),
        num_layers: l,
        hidden_size: t.hidden_size,
        tensor_parallel: input.tp,
        expert_parallel: input.ep,
        prompts: None,
        prompt_stats: None,
        max_model_len: None,
        coverage: cov,
        prelude: Vec::new(),
        steps: vec![
            reference,
            junctions,
            diff_step(
                input,
                &format!("{reference_dir}/reference"),
                &format!("{junction_dir}/junctions"),
                "sglang",
            ),
        ],
    })
}

/// The junction dumps of the draft sglang serves: the same dumper and patch on the serving
/// command line, with the draft loaded.
fn sglang_junctions(
    input: &PlanInput,
    draft: &DraftInput,
    sel: &EngineSel,
    serve: &[String],
    par: &Parallel,
    prompts: Option<&PromptStats>,
) -> Result<Step> {
    let t = input.target;
    let l = t.num_layers;
    let junction_dir = format!("{}/sglang-junctions", input.out);
    let feed = resolve(sel, Some(&t.family.name), &draft.config.ids, l);
    let mut args = serve.to_vec();
    // srt/arg_groups/fields/spec.py speculative_algorithm, speculative_draft_model_path.
    args.push("--speculative-algorithm EAGLE3".into());
    args.push("--speculative-draft-model-path \"$DRAFT\"".into());
    args.extend(par.flags.iter().cloned());
    args.push(SGLANG_WHOLE.into());
    let names = [
        "input_ids",
        "positions",
        "eagle_aux_capture",
        "eagle_aux_hidden_states",
        "non_intrusive__model.fc.inputs.0",
    ];
    let mut notes = vec![format!(
        "sglang {SGLANG} feeds this draft b = {} ({})",
        feed.fed_words(),
        feed.describe()
    )];
    if draft.config.norm_before_fc {
        notes.push(
            "the draft sets norm_before_fc: fc's input is RMSNorm(junction 2) \
             (models/llama_eagle3.py LlamaModel.forward), so diff reads junction 3 as rescaled \
             states; junction 2 is the one to judge"
                .into(),
        );
    }
    notes.push(
        "the patch file applies once per process: sglang applies it for the target's and \
         again for the draft's ModelRunner, and its first patch makes the second a no-op \
         (see the file's first comment)"
            .into(),
    );
    let configure = serde_json::json!({
        "enable": true,
        "dir": junction_dir,
        "exp_name": "junctions",
        "filter": format!(
            "name in ({})",
            names.iter().map(|n| format!("\"{n}\"")).collect::<Vec<_>>().join(", ")
        ),
    });
    notes.push(format!(
        "on the running server instead: start it with DUMPER_SERVER_PORT=reuse, \
         DUMPER_NON_INTRUSIVE_MODE=all and DUMPER_SOURCE_PATCHER_CONFIG (patches apply at load), then \
         `curl -X POST http://127.0.0.1:30000/dumper/configure -d {}` before the prompts and \
         `-d '{{\"enable\": false}}'` after (entrypoints/http_server.py /dumper/{{method}}; \
         dumper.py _DumperHttpManager, DumperConfig fields)",
        sh(&configure.to_string())
    ));
    // Per token: each fed aux capture, their concatenation, and fc's input (the same
    // width); the draft's own passes add a few rows per request.
    let cost = sglang_dump_cost(3 * feed.fed_slots().len(), input, prompts)?;
    let commands = sglang_dump_commands(
        input,
        &junction_dir,
        "junctions",
        &names,
        &sglang_patch_path(input),
        &args,
    );
    Ok(Step {
        title: format!(
            "Junctions: what the serving engine captures, stores and feeds fc (sglang {SGLANG}, the draft served)"
        ),
        files: Vec::new(),
        commands,
        runs_here: true,
        output: format!(
            "{junction_dir}/junctions/: eagle_aux_capture (junction 1, one per capture, tagged \
             layer_id), eagle_aux_hidden_states (junction 2), non_intrusive__model.fc.inputs.0 \
             (junction 3, the draft's pass)"
        ),
        cost: Some(cost),
        notes,
    })
}

fn no_draft_step() -> Step {
    Step {
        title:
            "Junctions: pass --draft DIR to plan them (they depend on the draft the engine serves)"
                .into(),
        files: Vec::new(),
        commands: Vec::new(),
        runs_here: true,
        output: String::new(),
        cost: None,
        notes: Vec::new(),
    }
}

/// `diff` reads the dumps on any machine later: the script prints it as a comment.
fn diff_step(input: &PlanInput, reference: &str, junctions: &str, engine: &str) -> Step {
    let mut cmd = format!(
        "eagle-check diff --spec SPEC.yaml --target {} --reference {}",
        sh(&input.target_arg),
        sh(reference)
    );
    match &input.draft {
        Some(d) => {
            let _ = write!(
                cmd,
                " --captures {} --draft {} --engine {engine}",
                sh(junctions),
                sh(&d.arg)
            );
        }
        None => cmd.push_str(" --captures TRAINING_CAPTURES"),
    }
    Step {
        title: "Diff: identify every junction slot against the reference (on any machine, no GPU)"
            .into(),
        files: Vec::new(),
        commands: vec![cmd],
        runs_here: false,
        output: String::new(),
        cost: None,
        notes: vec![
            "--target needs only the target's config.json here (L, hidden size, architecture); the \
             reference replaces running it"
                .into(),
        ],
    }
}

// --------------------------------------------------------------------------------------- vLLM

fn vllm_parallel(input: &PlanInput) -> Result<Parallel> {
    // vllm/engine/arg_utils.py: `--tensor-parallel-size`, `--enable-expert-parallel`,
    // `--data-parallel-size`; with expert parallelism the EP size is TP x DP
    // (vllm/config/parallel.py), so an EP of N over TP T asks for DP N / T.
    let mut flags = vec![format!("--tensor-parallel-size {}", input.tp)];
    let mut notes = Vec::new();
    if let Some(ep) = input.ep.filter(|&ep| ep > 1) {
        if ep % input.tp != 0 {
            return Err(usage(format!(
                "plan --ep {ep}: vLLM's expert-parallel size is TP x DP, so --ep must be a multiple of --tp ({})",
                input.tp
            )));
        }
        flags.push("--enable-expert-parallel".into());
        if ep > input.tp {
            flags.push(format!("--data-parallel-size {}", ep / input.tp));
            notes.push(format!(
                "EP {ep} = TP {} x DP {}: each DP rank serves its own requests; the connector writes each \
                 request's file from its TP rank 0 (example_hidden_states_connector.py)",
                input.tp,
                ep / input.tp
            ));
        }
    }
    Ok(Parallel { flags, notes })
}

/// `--speculative-config` for extract_hidden_states with these ids at the top level of the
/// draft's hf_config, the only place it reads them (vllm/config/speculative.py
/// SpeculativeConfig: `method`, `num_speculative_tokens` (must be 1,
/// v1/spec_decode/extract_hidden_states.py), `draft_model_config.hf_config`;
/// transformers_utils/configs/extract_hidden_states.py), and `--kv-transfer-config` for the
/// connector that writes them (vllm/config/kv_transfer.py `kv_connector`, `kv_role`,
/// `kv_connector_extra_config`; distributed/kv_transfer/kv_connector/factory.py registers
/// ExampleHiddenStatesConnector; its `shared_storage_path` extra key:
/// v1/example_hidden_states_connector.py).
fn vllm_extract(ids: &[i64], dir: &str) -> [String; 2] {
    let spec = serde_json::json!({
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
    });
    let kv = serde_json::json!({
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": dir},
    });
    [
        format!("--speculative-config {}", sh(&spec.to_string())),
        format!("--kv-transfer-config {}", sh(&kv.to_string())),
    ]
}

/// A vLLM server's commands: a fresh dump folder, the server, the prompts, the files flushed,
/// the server stopped.
fn vllm_commands(input: &PlanInput, launch: String, dir: &str, log: &str) -> Vec<String> {
    let mut commands = vec![format!("fresh_dir {}", sh(dir))];
    // vllm/entrypoints/serve/instrumentator/health.py: GET /health answers 200 once the
    // engine client is up, without running a request.
    commands.extend(script::start(launch, log, "/health"));
    commands.push(send(input, Engine::Vllm, "/v1/completions"));
    commands.push(format!("wait_files {} {}", sh(dir), script::PROMPT_COUNT));
    commands.push("stop_server".into());
    commands
}

fn vllm_plan(input: &PlanInput, prompts: Option<&PromptStats>) -> Result<Plan> {
    let t = input.target;
    let l = t.num_layers;
    let extract = EngineSel {
        engine: Engine::Vllm,
        path: Some("extract"),
        version: Some(VLLM),
    };
    let cov = coverage(&extract, &t.family.name, l, false)?;
    let par = vllm_parallel(input)?;
    let reference_dir = format!("{}/vllm-reference", input.out);
    let junction_dir = format!("{}/vllm-junctions", input.out);
    let max_len = max_model_len(prompts);
    let serve = |ids: &[i64], dir: &str| -> String {
        // entrypoints/common/cli_args.py FrontendArgs `port`; vllm/engine/arg_utils.py
        // `--max-model-len`: the stored states are reserved for that many tokens on every GPU,
        // and the default (the model's, 163,840 on DeepSeek-V3) does not fit
        // (v1/core/kv_cache_planning.py l. 78).
        let mut args = vec![
            "vllm serve \"$TARGET\"".to_string(),
            "--port \"$PORT\"".into(),
            format!("--max-model-len {max_len}"),
        ];
        args.extend(par.flags.iter().cloned());
        // vllm/engine/arg_utils.py `--enable-prefix-caching` (BooleanOptionalAction): a cached
        // prefix would be served from blocks written by an earlier request.
        args.push("--no-enable-prefix-caching".into());
        args.extend(vllm_extract(ids, dir));
        args.join(" \\\n  ")
    };
    let stored = |states: usize| Stored {
        states,
        hidden: t.hidden_size,
        // token_ids, int64 (example_hidden_states_connector.py request_finished).
        side_bytes: 8,
        // Each request's file comes from one rank (TP rank 0 of its DP rank).
        copies: 1,
        held: Held::Reserved {
            max_model_len: max_len,
        },
    };
    let max_len_note = match prompts {
        Some(p) => format!(
            "--max-model-len {max_len}: the longest prompt ({} tokens{}) and the one token each \
             request generates, rounded up to a multiple of 256",
            p.longest,
            if p.exact {
                ""
            } else {
                " at most, text counted as one token per byte"
            }
        ),
        None => format!(
            "--max-model-len {max_len}: no --prompts given; a longer prompt is refused, so raise it \
             (the stored states reserved on every GPU grow with it)"
        ),
    };
    let mut ref_notes = vec![format!(
        "ids {} at the top level -> b = {}, the last one pre-norm (the rule above)",
        short(&cov.ids),
        short(&cov.captured.iter().map(|&b| b as i64).collect::<Vec<_>>())
    )];
    ref_notes.extend(
        cov.elsewhere
            .iter()
            .map(|e| format!("{e}: not in the reference")),
    );
    ref_notes.push(
        "b = L after the final norm is not captured by vLLM; diff compares the last layer's state pre-norm".into(),
    );
    ref_notes.push(max_len_note.clone());
    ref_notes.push(
        "vLLM sends no warm-up request through the connector: every file is one of the prompts"
            .into(),
    );
    ref_notes.extend(par.notes.iter().cloned());
    let reference = Step {
        title: format!(
            "Reference: every boundary of the prompts, from vLLM {VLLM} at this parallelism"
        ),
        files: vec![PlanFile {
            path: sender_path(input),
            content: script::sender(Engine::Vllm),
        }],
        commands: vllm_commands(
            input,
            serve(&cov.ids, &reference_dir),
            &reference_dir,
            &format!("{}/vllm-reference.log", input.out),
        ),
        runs_here: true,
        output: format!(
            "{reference_dir}/{{request id}}.safetensors: token_ids [T], hidden_states [T, {}, H] \
             (example_hidden_states_connector.py)",
            cov.ids.len()
        ),
        cost: Some(Cost::of(&stored(cov.ids.len()), prompts)?),
        notes: ref_notes,
    };
    let junctions = match &input.draft {
        Some(draft) => {
            let serving = EngineSel {
                engine: Engine::Vllm,
                path: input.engine.path.filter(|p| *p != "extract"),
                version: Some(VLLM),
            };
            let feed = resolve(&serving, Some(&t.family.name), &draft.config.ids, l);
            let fed: Vec<i64> = feed
                .fed_slots()
                .iter()
                .map(|s| s.boundary.0 as i64)
                .collect();
            let mut notes = vec![format!(
                "vLLM {VLLM} ({}) feeds this draft b = {} ({}); the same ids, raw, at the top level",
                feed.engine_label(),
                feed.fed_words(),
                feed.describe()
            )];
            notes.push(
                "vLLM has no runtime tensor dumper (VLLM_DEBUG_DUMP_PATH dumps compile artefacts, \
                 vllm/envs.py): junctions 1 and 2 come from a server with the same target, parallelism and \
                 ids whose extract_hidden_states stores [T, k, H], slot j = captured aux state j, in the \
                 order the EAGLE-3 runner concatenates them (ids sorted, deduplicated: \
                 model_executor/models/interfaces.py)"
                    .into(),
            );
            notes.push(format!(
                "junction 3: models/llama_eagle3.py Eagle3LlamaForCausalLM.combine_hidden_states feeds fc \
                 that concatenation{}",
                if draft.config.norm_before_fc {
                    " after an RMSNorm (this draft sets norm_before_fc)"
                } else {
                    " as is (this draft sets no norm_before_fc)"
                }
            ));
            notes.push(max_len_note);
            if feed.refused() || fed.is_empty() {
                notes.push("the serving engine refuses these ids: nothing to dump".into());
            }
            Step {
                title: format!("Junctions: what vLLM {VLLM} captures for the served draft"),
                files: Vec::new(),
                commands: if fed.is_empty() {
                    Vec::new()
                } else {
                    vllm_commands(
                        input,
                        serve(&fed, &junction_dir),
                        &junction_dir,
                        &format!("{}/vllm-junctions.log", input.out),
                    )
                },
                runs_here: true,
                output: format!(
                    "{junction_dir}/{{request id}}.safetensors: hidden_states [T, {}, H]",
                    fed.len()
                ),
                cost: (!fed.is_empty())
                    .then(|| Cost::of(&stored(fed.len()), prompts))
                    .transpose()?,
                notes,
            }
        }
        None => no_draft_step(),
    };
    Ok(Plan {
        engine: format!("vllm@{VLLM}"),
        model: input.model.clone(),
        model_type: t.model_type.clone(),
        num_layers: l,
        hidden_size: t.hidden_size,
        tensor_parallel: input.tp,
        expert_parallel: input.ep,
        prompts: None,
        prompt_stats: None,
        max_model_len: Some(max_len),
        coverage: cov,
        prelude: Vec::new(),
        steps: vec![
            reference,
            junctions,
            diff_step(input, &reference_dir, &junction_dir, "vllm"),
        ],
    })
}

impl Plan {
    /// The plan as a POSIX shell script: facts, notes and costs as comments, files as heredocs,
    /// the commands that run elsewhere commented out.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "#!/bin/sh");
        let _ = writeln!(
            out,
            "# eagle-check plan: {} serving {} ({}, L = {}, H = {}), TP {}{}",
            self.engine,
            self.model.as_deref().unwrap_or("$EAGLE_CHECK_TARGET"),
            self.model_type,
            self.num_layers,
            self.hidden_size,
            self.tensor_parallel,
            self.expert_parallel
                .map(|e| format!(", EP {e}"))
                .unwrap_or_default()
        );
        let _ = writeln!(
            out,
            "# prompts: {}",
            self.prompts.as_deref().unwrap_or(
                "$EAGLE_CHECK_PROMPTS (not given: one {\"text\": ...} or {\"input_ids\": [...]} per line)"
            )
        );
        let captured: Vec<i64> = self.coverage.captured.iter().map(|&b| b as i64).collect();
        let _ = writeln!(
            out,
            "# capture ids: {} -> b = {}",
            short(&self.coverage.ids),
            short(&captured)
        );
        let _ = writeln!(out, "# rule: {}", self.coverage.rule);
        if let Some(n) = self.max_model_len {
            let _ = writeln!(out, "# --max-model-len: {n}");
        }
        let _ = writeln!(
            out,
            "# run it with sh (dash or any POSIX shell) on the engine's host"
        );
        out.push('\n');
        for line in &self.prelude {
            let _ = writeln!(out, "{line}");
        }
        for (i, step) in self.steps.iter().enumerate() {
            let _ = writeln!(out, "\n# --- {}. {}", i + 1, step.title);
            for note in &step.notes {
                let _ = writeln!(out, "# note: {note}");
            }
            if let Some(cost) = &step.cost {
                let stats = self.prompt_stats.as_ref();
                for line in cost.lines(self.hidden_size, self.tensor_parallel, stats) {
                    let _ = writeln!(out, "# cost: {line}");
                }
            }
            if !step.output.is_empty() {
                let _ = writeln!(out, "# dumps: {}", step.output);
            }
            for f in &step.files {
                let _ = writeln!(out, "cat > {} <<'EOF'\n{}EOF", sh(&f.path), f.content);
            }
            for c in &step.commands {
                if step.runs_here {
                    let _ = writeln!(out, "{c}");
                } else {
                    for line in c.lines() {
                        let _ = writeln!(out, "# {line}");
                    }
                }
            }
        }
        out
    }
}
