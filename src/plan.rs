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

use crate::boundary::{Boundary, FinalNorm};
use crate::config::{DraftConfig, TargetInfo};
use crate::engine::rules::Reach;
use crate::engine::{Engine, EngineSel, Version, ids_for, resolve, rule_words, select};
use crate::error::{Error, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The engine versions whose sources the printed flags were read from.
pub const SGLANG: Version = Version([0, 5, 23]);
pub const VLLM: Version = Version([0, 33, 0]);

/// What `plan` needs.
pub struct PlanInput<'a> {
    pub target: &'a TargetInfo,
    /// The target as the engine should be told (the user's path or HF id).
    pub model: String,
    pub engine: EngineSel,
    pub tp: usize,
    pub ep: Option<usize>,
    /// A JSONL of prompts (`{"text": ...}` or `{"input_ids": [...]}` per line), checked.
    pub prompts: Option<PathBuf>,
    pub draft: Option<(&'a DraftConfig, String)>,
    /// Where the dumps go (a folder on the engine's host).
    pub out: String,
}

/// A file the plan asks the user to write (the printed script writes it with a heredoc).
#[derive(Debug, Clone, Serialize)]
pub struct PlanFile {
    pub path: String,
    pub content: String,
}

/// One step: files, shell commands, where its dumps land, and what to know.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub title: String,
    pub files: Vec<PlanFile>,
    pub commands: Vec<String>,
    /// The folder the step's dumps land in, and their layout.
    pub output: String,
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
    pub model: String,
    pub model_type: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub tensor_parallel: usize,
    pub expert_parallel: Option<usize>,
    pub prompts: Option<String>,
    pub coverage: Coverage,
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

/// Checks a prompts file: every line `{"text": "..."}` or `{"input_ids": [ints]}`.
pub fn check_prompts(path: &Path) -> Result<usize> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut n = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| Error::Tokens {
            origin: format!("{}:{}", path.display(), i + 1),
            message: format!(
                "{what}; each line must be {{\"text\": \"...\"}} or {{\"input_ids\": [1, 2, ...]}}"
            ),
        };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|_| bad("not JSON"))?;
        let ok = match (v.get("text"), v.get("input_ids")) {
            (Some(t), None) => t.is_string(),
            (None, Some(ids)) => ids
                .as_array()
                .is_some_and(|a| !a.is_empty() && a.iter().all(|x| x.as_u64().is_some())),
            _ => false,
        };
        if !ok {
            return Err(bad("neither a text nor a non-empty list of token ids"));
        }
        n += 1;
    }
    if n == 0 {
        return Err(Error::Tokens {
            origin: path.display().to_string(),
            message: "no prompts".into(),
        });
    }
    Ok(n)
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
    let prompts_count = input.prompts.as_deref().map(check_prompts).transpose()?;
    let mut plan = match sel.engine {
        Engine::Sglang => sglang_plan(input)?,
        _ => vllm_plan(input)?,
    };
    plan.prompts = input
        .prompts
        .as_ref()
        .map(|p| format!("{} ({} prompts)", p.display(), prompts_count.unwrap_or(0)));
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

/// A value for a shell command line, single-quoted when it needs to be.
fn sh(value: &str) -> String {
    if !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=:@+,".contains(c))
    {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

/// The prompt sender: stdlib Python, one request at a time, one new token each (the dumps are
/// of the prefill; a decode step is not a whole sequence).
fn sender(engine: Engine, model: &str) -> PlanFile {
    // sglang: POST /generate (srt/entrypoints/http_server.py) with `text` or `input_ids` and
    // `sampling_params` (srt/managers/io_struct.py GenerateReqInput; max_new_tokens,
    // temperature: srt/sampling/sampling_params.py), default port 30000
    // (srt/arg_groups/fields/serving.py). vLLM: POST /v1/completions
    // (entrypoints/openai/completion/api_router.py), `model`, `prompt` (text or token ids),
    // `max_tokens`, `temperature` (entrypoints/openai/completion/protocol.py
    // CompletionRequest), default port 8000 (entrypoints/common/cli_args.py).
    let (url, body) = match engine {
        Engine::Sglang => (
            "http://127.0.0.1:30000/generate",
            r#"dict(req, sampling_params={"max_new_tokens": 1, "temperature": 0})"#.to_string(),
        ),
        _ => (
            "http://127.0.0.1:8000/v1/completions",
            format!(
                r#"{{"model": {model:?}, "prompt": req.get("text", req.get("input_ids")), "max_tokens": 1, "temperature": 0}}"#
            ),
        ),
    };
    PlanFile {
        path: "send_prompts.py".into(),
        content: format!(
            "# Posts each line of a prompts JSONL ({{\"text\": ...}} or {{\"input_ids\": [...]}}) to the engine, one at a time.\n\
             import json, sys, urllib.request\n\
             for line in open(sys.argv[1]):\n\
             \x20   if not line.strip():\n\
             \x20       continue\n\
             \x20   req = json.loads(line)\n\
             \x20   body = json.dumps({body}).encode()\n\
             \x20   r = urllib.request.Request({url:?}, data=body, headers={{\"Content-Type\": \"application/json\"}})\n\
             \x20   urllib.request.urlopen(r).read()\n"
        ),
    }
}

fn prompts_arg(input: &PlanInput) -> String {
    input
        .prompts
        .as_ref()
        .map_or("PROMPTS.jsonl".to_string(), |p| {
            sh(&p.display().to_string())
        })
}

// ------------------------------------------------------------------------------------- sglang

/// The source patch that dumps junctions 1 and 2 through sglang's dumper
/// (`DUMPER_SOURCE_PATCHER_CONFIG`, srt/debug_utils/source_patcher/types.py PatchConfig:
/// `patches: [{target, edits: [{match, prepend|append}]}]`; the dumper injects its own import,
/// dumper.py `apply_source_patches`). The matched lines are sglang 0.5.23's:
/// srt/layers/aux_hidden_states.py (`AuxHiddenStateList.capture`, the list path of Llama-family
/// models; `AuxHiddenStatePacker.append`, the packed path of DeepSeek-V2/V3 and Kimi) and
/// srt/layers/logits_processor.py `LogitsProcessor._get_hidden_states_to_store`.
pub const SGLANG_PATCH: &str = "\
# eagle-check plan: dump every EAGLE-3 aux capture (junction 1, tagged with the layer it is captured in)
# and the concatenation the logits processor stores (junction 2). sglang 0.5.23.
patches:
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
fn dumper_env(dir: &str, exp: &str, names: &[&str]) -> Vec<String> {
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
        "DUMPER_ENABLE=1".into(),
        format!("DUMPER_DIR={}", sh(dir)),
        format!("DUMPER_EXP_NAME={exp}"),
        // `all`: every module's inputs and outputs pass the filter (the fc input, the embedding,
        // the final norm); the layer_id tag comes from the ctx hooks of `*.layers.N` modules
        // (dumper.py _NonIntrusiveDumper).
        "DUMPER_NON_INTRUSIVE_MODE=all".into(),
        format!(
            "DUMPER_SOURCE_PATCHER_CONFIG={}",
            sh(&format!("{dir}/sglang-patch.yaml"))
        ),
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

fn sglang_plan(input: &PlanInput) -> Result<Plan> {
    let t = input.target;
    let l = t.num_layers;
    let sel = EngineSel {
        engine: Engine::Sglang,
        path: None,
        version: Some(SGLANG),
    };
    let cov = coverage(&sel, &t.model_type, l, true)?;
    let par = sglang_parallel(input)?;
    let patch = PlanFile {
        path: format!("{}/sglang-patch.yaml", input.out),
        content: SGLANG_PATCH.to_string(),
    };
    let reference_dir = format!("{}/sglang-reference", input.out);
    let junction_dir = format!("{}/sglang-junctions", input.out);
    let model = sh(&input.model);

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
    let mut args = vec![
        "python -m sglang.launch_server".to_string(),
        format!("--model-path {model}"),
    ];
    args.extend(par.flags.iter().cloned());
    args.push("--enable-return-aux-hidden-states --speculative-algorithm EAGLE3".into());
    args.push(format!(
        "--return-aux-hidden-state-layer-ids {}",
        join_ids(&cov.ids, " ")
    ));
    args.push(SGLANG_WHOLE.into());
    let reference = Step {
        title: format!(
            "Reference: every boundary of the prompts, from sglang {SGLANG} at this parallelism"
        ),
        files: vec![patch.clone(), sender(Engine::Sglang, &input.model)],
        commands: vec![
            format!("mkdir -p {}", sh(&reference_dir)),
            format!("cp {} {}/", sh(&patch.path), sh(&reference_dir)),
            format!(
                "{} &",
                launch(&dumper_env(&reference_dir, "reference", &names), &args)
            ),
            "# wait until the server answers, then:".into(),
            format!("python3 send_prompts.py {}", prompts_arg(input)),
            "kill %1".into(),
        ],
        output: format!(
            "{reference_dir}/reference/step=S___rank=R___dump_index=I___name=NAME___...pt: one file per \
             tensor and forward pass (srt/debug_utils/dumper.py _Dumper._dump_single)"
        ),
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
        Some((draft, draft_arg)) => {
            let feed = resolve(&sel, Some(&t.model_type), &draft.ids, l);
            let mut args = vec![
                "python -m sglang.launch_server".to_string(),
                format!("--model-path {model}"),
                // srt/arg_groups/fields/spec.py speculative_algorithm,
                // speculative_draft_model_path.
                "--speculative-algorithm EAGLE3".into(),
                format!("--speculative-draft-model-path {}", sh(draft_arg)),
            ];
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
            if draft.norm_before_fc {
                notes.push(
                    "the draft sets norm_before_fc: fc's input is RMSNorm(junction 2) \
                     (models/llama_eagle3.py LlamaModel.forward), so diff reads junction 3 as rescaled \
                     states; junction 2 is the one to judge"
                        .into(),
                );
            }
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
            Step {
                title: format!(
                    "Junctions: what the serving engine captures, stores and feeds fc (sglang {SGLANG}, the draft served)"
                ),
                files: Vec::new(),
                commands: vec![
                    format!("mkdir -p {}", sh(&junction_dir)),
                    format!("cp {} {}/", sh(&patch.path), sh(&junction_dir)),
                    format!(
                        "{} &",
                        launch(&dumper_env(&junction_dir, "junctions", &names), &args)
                    ),
                    "# wait until the server answers, then:".into(),
                    format!("python3 send_prompts.py {}", prompts_arg(input)),
                    "kill %1".into(),
                ],
                output: format!(
                    "{junction_dir}/junctions/: eagle_aux_capture (junction 1, one per capture, tagged \
                     layer_id), eagle_aux_hidden_states (junction 2), non_intrusive__model.fc.inputs.0 \
                     (junction 3, the draft's pass)"
                ),
                notes,
            }
        }
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
        coverage: cov,
        steps: vec![
            reference,
            junctions,
            diff_step(
                input,
                &reference_dir,
                &format!("{junction_dir}/junctions"),
                "sglang",
            ),
        ],
    })
}

fn no_draft_step() -> Step {
    Step {
        title:
            "Junctions: pass --draft DIR to plan them (they depend on the draft the engine serves)"
                .into(),
        files: Vec::new(),
        commands: Vec::new(),
        output: String::new(),
        notes: Vec::new(),
    }
}

fn diff_step(input: &PlanInput, reference: &str, junctions: &str, engine: &str) -> Step {
    let reference = if engine == "sglang" {
        format!("{reference}/reference")
    } else {
        reference.to_string()
    };
    let mut cmd = format!(
        "eagle-check diff --spec SPEC.yaml --target {} --reference {}",
        sh(&input.model),
        sh(&reference)
    );
    if input.draft.is_some() {
        let _ = write!(cmd, " --captures {}", sh(junctions));
        if let Some((_, d)) = &input.draft {
            let _ = write!(cmd, " --draft {} --engine {engine}", sh(d));
        }
    } else {
        cmd.push_str(" --captures TRAINING_CAPTURES");
    }
    Step {
        title: "Diff: identify every junction slot against the reference (on any machine, no GPU)"
            .into(),
        files: Vec::new(),
        commands: vec![cmd],
        output: String::new(),
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

fn vllm_plan(input: &PlanInput) -> Result<Plan> {
    let t = input.target;
    let l = t.num_layers;
    let extract = EngineSel {
        engine: Engine::Vllm,
        path: Some("extract"),
        version: Some(VLLM),
    };
    let cov = coverage(&extract, &t.model_type, l, false)?;
    let par = vllm_parallel(input)?;
    let reference_dir = format!("{}/vllm-reference", input.out);
    let junction_dir = format!("{}/vllm-junctions", input.out);
    let model = sh(&input.model);
    let serve = |ids: &[i64], dir: &str| -> String {
        let mut args = vec![format!("vllm serve {model}")];
        args.extend(par.flags.iter().cloned());
        // vllm/engine/arg_utils.py `--enable-prefix-caching` (BooleanOptionalAction): a cached
        // prefix would be served from blocks written by an earlier request.
        args.push("--no-enable-prefix-caching".into());
        args.extend(vllm_extract(ids, dir));
        format!("{} &", args.join(" \\\n  "))
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
    ref_notes.extend(par.notes.iter().cloned());
    let reference = Step {
        title: format!(
            "Reference: every boundary of the prompts, from vLLM {VLLM} at this parallelism"
        ),
        files: vec![sender(Engine::Vllm, &input.model)],
        commands: vec![
            format!("mkdir -p {}", sh(&reference_dir)),
            serve(&cov.ids, &reference_dir),
            "# wait until the server answers, then:".into(),
            format!("python3 send_prompts.py {}", prompts_arg(input)),
            "kill %1".into(),
        ],
        output: format!(
            "{reference_dir}/{{request id}}.safetensors: token_ids [T], hidden_states [T, {}, H] \
             (example_hidden_states_connector.py)",
            cov.ids.len()
        ),
        notes: ref_notes,
    };
    let junctions = match &input.draft {
        Some((draft, _)) => {
            let serving = EngineSel {
                engine: Engine::Vllm,
                path: input.engine.path.filter(|p| *p != "extract"),
                version: Some(VLLM),
            };
            let feed = resolve(&serving, Some(&t.model_type), &draft.ids, l);
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
                if draft.norm_before_fc {
                    " after an RMSNorm (this draft sets norm_before_fc)"
                } else {
                    " as is (this draft sets no norm_before_fc)"
                }
            ));
            if feed.refused() || fed.is_empty() {
                notes.push("the serving engine refuses these ids: nothing to dump".into());
            }
            Step {
                title: format!("Junctions: what vLLM {VLLM} captures for the served draft"),
                files: Vec::new(),
                commands: if fed.is_empty() {
                    Vec::new()
                } else {
                    vec![
                        format!("mkdir -p {}", sh(&junction_dir)),
                        serve(&fed, &junction_dir),
                        "# wait until the server answers, then:".into(),
                        format!("python3 send_prompts.py {}", prompts_arg(input)),
                        "kill %1".into(),
                    ]
                },
                output: format!(
                    "{junction_dir}/{{request id}}.safetensors: hidden_states [T, {}, H]",
                    fed.len()
                ),
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
        coverage: cov,
        steps: vec![
            reference,
            junctions,
            diff_step(input, &reference_dir, &junction_dir, "vllm"),
        ],
    })
}

impl Plan {
    /// The plan as a shell script: facts and notes as comments, files as heredocs.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "#!/bin/sh");
        let _ = writeln!(
            out,
            "# eagle-check plan: {} serving {} ({}, L = {}, H = {}), TP {}{}",
            self.engine,
            self.model,
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
                "PROMPTS.jsonl (not given: one {\"text\": ...} or {\"input_ids\": [...]} per line)"
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
        for (i, step) in self.steps.iter().enumerate() {
            let _ = writeln!(out, "\n# --- {}. {}", i + 1, step.title);
            for note in &step.notes {
                let _ = writeln!(out, "# note: {note}");
            }
            if !step.output.is_empty() {
                let _ = writeln!(out, "# dumps: {}", step.output);
            }
            for f in &step.files {
                let _ = writeln!(out, "cat > {} <<'EOF'\n{}EOF", sh(&f.path), f.content);
            }
            for c in &step.commands {
                let _ = writeln!(out, "{c}");
            }
        }
        out
    }
}
