//! The `eagle-check` command line: parse, call the library, render, exit 0/1/2.

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device};
use clap::{Args, Parser, Subcommand, ValueEnum};
use eagle_check::commands::gate::gate;
use eagle_check::commands::probe::{ProbeInput, TokenSet, probe};
use eagle_check::commands::run::RunInput;
use eagle_check::commands::spec_init;
use eagle_check::config::DraftConfig;
use eagle_check::diff::dump_ref::DumpReference;
use eagle_check::diff::names::NameMap;
use eagle_check::diff::reference::{Counted, ReferenceOptions, ReferenceSource, RunnerReference};
use eagle_check::diff::{DiffInput, diff};
use eagle_check::engine::{Engine, EngineSel, markdown_table, resolve};
use eagle_check::judge::StaticInput;
use eagle_check::locate::{self, Bundle};
use eagle_check::model::TargetOptions;
use eagle_check::progress;
use eagle_check::report::Report;
use eagle_check::spec::Spec;
use eagle_check::tokenize::{self, Tokenizer, read_token_file};
use eagle_check::weights::WeightIndex;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "eagle-check",
    version,
    about = "Checks that an EAGLE-3 drafter is fed the hidden states it was trained on"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// For people: facts, slot tables, findings, verdict.
    Table,
    /// The same report for machines.
    Json,
    /// JUnit XML: a testcase per engine x fc slot (per capture file x slot for diff).
    Junit,
    /// GitHub workflow annotations on the draft config's ids line or the spec's line.
    Github,
}

/// How a report is printed.
#[derive(Args, Clone, Copy)]
struct OutputArgs {
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Print only the verdict line (the exit code says the same).
    #[arg(long, short)]
    quiet: bool,
}

/// How the target's weights are held.
#[derive(Args, Clone, Copy)]
struct MemoryArgs {
    /// Run the target one decoder layer at a time (each read from the checkpoint, run and
    /// freed, the next read meanwhile), even when it would fit: for targets larger than memory.
    /// Automatic when the weights would not fit --max-memory (else the memory available).
    #[arg(long)]
    stream_layers: bool,
    /// Memory budget: resident memory on the CPU, device memory on a GPU (4GiB, 512MiB, 64GB).
    /// Decides streaming; the report prints the peak against it.
    #[arg(long, value_name = "SIZE", value_parser = parse_max_memory)]
    max_memory: Option<u64>,
}

fn parse_max_memory(text: &str) -> std::result::Result<u64, String> {
    eagle_check::size::parse_size(text)
}

impl MemoryArgs {
    fn options(self, dtype: DType, device: &Device) -> TargetOptions {
        TargetOptions {
            stream_layers: self.stream_layers,
            max_memory: self.max_memory,
            ..TargetOptions::new(dtype, device)
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Static check, no GPU: draft config + engine rule + weight shapes against a capture spec.
    Gate {
        /// Capture spec (YAML): what the drafter's training data held.
        #[arg(long)]
        spec: PathBuf,
        /// Draft model directory or its config.json, or an HF Hub id (org/name) in the local
        /// HF cache.
        #[arg(long)]
        draft: PathBuf,
        /// Target model directory or its config.json, or an HF Hub id (else the spec's target
        /// block).
        #[arg(long)]
        target: Option<PathBuf>,
        /// Revision of the HF Hub ids given to --target and --draft (a branch, tag or commit in
        /// the local HF cache; default main). `org/name@REV` sets one id's revision.
        #[arg(long)]
        revision: Option<String>,
        /// Engine to check: NAME[:PATH][@VERSION] (sglang, vllm, trtllm, specforge, eagle,
        /// modelopt, speculators; e.g. sglang@0.5.10, vllm:v2, trtllm:two-model), or all.
        /// Default: the spec's `engine`, else all. `eagle-check engines` lists the rules.
        #[arg(long)]
        engine: Option<String>,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Run target and draft on real tokens: capture every boundary and the exact fc input.
    Run {
        /// A bundle directory holding target/, draft/ and spec.yaml (no other flag needed).
        bundle: Option<PathBuf>,
        /// Target model: HF directory, HF cache entry (models--org--name), HF Hub id (org/name,
        /// from the local HF cache) or .gguf file.
        #[arg(long)]
        target: Option<PathBuf>,
        /// Draft model directory (LlamaForCausalLMEagle3 layout) or HF Hub id.
        #[arg(long)]
        draft: Option<PathBuf>,
        /// Revision of the HF Hub ids given to --target and --draft (a branch, tag or commit in
        /// the local HF cache; default main). `org/name@REV` sets one id's revision.
        #[arg(long)]
        revision: Option<String>,
        /// Capture spec (YAML) to judge the fed layout against.
        #[arg(long)]
        spec: Option<PathBuf>,
        /// Engine whose rule assembles the fc input (default: the spec's `engine`).
        #[arg(long)]
        engine: Option<String>,
        /// Token ids, comma-separated: --tokens 1,2,3
        #[arg(long, value_delimiter = ',', conflicts_with_all = ["token_file", "prompt"])]
        tokens: Option<Vec<u32>>,
        /// A file of token ids: one per line, or a .npy of integers.
        #[arg(long, conflicts_with = "prompt")]
        token_file: Option<PathBuf>,
        /// Text, tokenized with the target's tokenizer (tokenizer.json or GGUF metadata).
        #[arg(long)]
        prompt: Option<String>,
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceArg,
        /// Compute dtype (default: bf16 on a GPU, f32 on the CPU).
        #[arg(long, value_enum)]
        dtype: Option<DtypeArg>,
        /// Write input_ids, hidden_states.{b}, final_pre_norm and fc_input to a safetensors file.
        #[arg(long)]
        dump: Option<PathBuf>,
        /// Also generate N greedy tokens after the input and show them (a sanity check).
        #[arg(long, default_value_t = 0)]
        generate: usize,
        #[command(flatten)]
        memory: MemoryArgs,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// The acceptance probe: what each layout costs in acceptance, and (--search) which layout
    /// the drafter was trained on, from its weights alone.
    Probe {
        /// A bundle directory holding target/, draft/ and spec.yaml (and tokens.txt).
        bundle: Option<PathBuf>,
        /// Target model: HF directory, HF cache entry, HF Hub id (org/name) or .gguf file.
        #[arg(long)]
        target: Option<PathBuf>,
        /// Draft model directory or HF Hub id.
        #[arg(long)]
        draft: Option<PathBuf>,
        /// Revision of the HF Hub ids given to --target and --draft (default main).
        #[arg(long)]
        revision: Option<String>,
        /// Capture spec (YAML): the layout training held, if known.
        #[arg(long)]
        spec: Option<PathBuf>,
        /// Engine(s) whose fed layout is judged: NAME[:PATH][@VERSION], or all (default: the
        /// spec's `engine`, else all).
        #[arg(long)]
        engine: Option<String>,
        /// Token ids, comma-separated.
        #[arg(long, value_delimiter = ',', conflicts_with_all = ["token_file", "prompt", "prompts"])]
        tokens: Option<Vec<u32>>,
        /// A file of token ids: one per line, or a .npy of integers.
        #[arg(long, conflicts_with_all = ["prompt", "prompts"])]
        token_file: Option<PathBuf>,
        /// Text, tokenized with the target's tokenizer.
        #[arg(long, conflicts_with = "prompts")]
        prompt: Option<String>,
        /// A JSON-lines file of prompts: {"prompt": TEXT} (or "text", or "input_ids": [..])
        /// per line, each a token set of its own.
        #[arg(long)]
        prompts: Option<PathBuf>,
        /// Draft tokens per greedy chain (the accepted length is out of this many).
        #[arg(long, default_value_t = 3)]
        steps: usize,
        /// Search every k-slot layout for the one the drafter predicts the target best from.
        #[arg(long)]
        search: bool,
        /// With --search: write the layout found as a capture spec to this file.
        #[arg(long, requires = "search")]
        write_spec: Option<PathBuf>,
        /// Seed of the bootstrap draws behind every interval.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[command(flatten)]
        memory: MemoryArgs,
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceArg,
        /// Compute dtype (default: bf16 on a GPU, f32 on the CPU).
        #[arg(long, value_enum)]
        dtype: Option<DtypeArg>,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// The engine rule table: every engine, version, capture path and architecture eagle-check
    /// knows, with the upstream file each rule was read from.
    Engines {
        /// Print the table as the README shows it.
        #[arg(long)]
        markdown: bool,
    },
    /// Print the engine invocations that dump every boundary of a set of prompts (a reference
    /// for `diff --reference`) and the three junctions of a live server, at your parallelism.
    Plan {
        /// Target model directory, its config.json, or an HF Hub id in the local HF cache (only
        /// its config is read).
        #[arg(long)]
        target: PathBuf,
        /// The target's weights as the engine loads them (a folder or an HF id on the engine's
        /// host; default: --target when it names a folder or an id).
        #[arg(long)]
        target_path: Option<String>,
        /// The serving engine: vllm or sglang (the versions whose sources the flags were read
        /// from: vllm@0.33.0, sglang@0.5.23; vllm:v1 picks the runner the junctions are for).
        #[arg(long)]
        engine: String,
        /// Tensor-parallel size.
        #[arg(long, default_value_t = 1)]
        tp: usize,
        /// Expert-parallel size.
        #[arg(long)]
        ep: Option<usize>,
        /// Prompts, one JSON object per line: {"text": "..."} or {"input_ids": [...]}.
        #[arg(long)]
        prompts: Option<PathBuf>,
        /// The draft the engine serves (directory, config.json or HF Hub id): plans the junction
        /// dumps for it.
        #[arg(long)]
        draft: Option<PathBuf>,
        /// The draft's weights as the engine loads them (default: --draft when it names a folder
        /// or an id).
        #[arg(long)]
        draft_path: Option<String>,
        /// Folder for the dumps on the engine's host.
        #[arg(long, default_value = "eagle-check-dumps")]
        out: String,
        /// Revision of the HF Hub ids (default main).
        #[arg(long)]
        revision: Option<String>,
        #[arg(long, value_enum, default_value = "text")]
        format: PlanFormat,
    },
    /// Capture specs: `spec init` writes the one a trainer's rule implies for a draft config.
    Spec {
        #[command(subcommand)]
        command: SpecCommand,
    },
    /// Identify what each slot of captured tensors (training data, engine dumps) really is.
    Diff {
        /// Capture spec (YAML): what the drafter's training data should hold.
        #[arg(long)]
        spec: PathBuf,
        /// Target model the captures came from, re-run on each sample's tokens (a directory,
        /// an HF cache entry or an HF Hub id).
        #[arg(long, required_unless_present = "reference")]
        target: Option<PathBuf>,
        /// Capture files or directories (SpecForge .ckpt/.ckpt.gz, ModelOpt .pt, vLLM
        /// hs_*.safetensors, sglang dumps, .npy/.npz/.safetensors).
        #[arg(long, required = true, num_args = 1..)]
        captures: Vec<PathBuf>,
        /// Reference boundaries from a dump of every layer (eagle-check run --dump, or a vLLM
        /// extract_hidden_states file of all layers) instead of running the target.
        #[arg(long)]
        reference: Option<PathBuf>,
        /// What the reference dump's tensor names hold, `REGEX=QUANTITY` (repeatable, or a file
        /// of such lines): QUANTITY is input (or b), output, input-part, output-part, embedding,
        /// pre-norm, post-norm, skip or b=N; layer i is the regex's first group, else the layer
        /// index in the name, else the dump's layer_id tag. Default: the built-in sglang rules.
        #[arg(long, requires = "reference")]
        reference_map: Vec<String>,
        /// Token ids of a reference dump that carries none (one per line, or a .npy).
        #[arg(long, requires = "reference")]
        reference_tokens: Option<PathBuf>,
        /// Draft directory or HF Hub id: with an engine, also compare what inference feeds
        /// (three-way).
        #[arg(long)]
        draft: Option<PathBuf>,
        /// Revision of the HF Hub ids given to --target and --draft (a branch, tag or commit in
        /// the local HF cache; default main). `org/name@REV` sets one id's revision.
        #[arg(long)]
        revision: Option<String>,
        #[arg(long)]
        engine: Option<String>,
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceArg,
        /// Compute dtype (default: bf16 on a GPU, f32 on the CPU).
        #[arg(long, value_enum)]
        dtype: Option<DtypeArg>,
        #[command(flatten)]
        memory: MemoryArgs,
        #[command(flatten)]
        output: OutputArgs,
    },
}

#[derive(Subcommand)]
enum SpecCommand {
    /// Write the spec the trainer's own rule implies for a draft config (the rule is the
    /// trainer's row of the engine table, so `gate --engine TRAINER` agrees with it).
    Init {
        /// Draft model directory or its config.json, or an HF Hub id in the local HF cache.
        #[arg(long)]
        draft: PathBuf,
        /// The trainer: specforge, eagle, modelopt or speculators (NAME[:PATH][@VERSION], e.g.
        /// specforge:online, modelopt:vllm).
        #[arg(long)]
        trainer: String,
        /// Target model directory or config.json (or HF Hub id): L, hidden size, model_type.
        #[arg(
            long,
            conflicts_with = "num_layers",
            required_unless_present = "num_layers"
        )]
        target: Option<PathBuf>,
        /// The target's decoder layer count L, when no --target is at hand.
        #[arg(long)]
        num_layers: Option<usize>,
        /// The target's hidden size (default: the draft's target_hidden_size, else its own).
        #[arg(long, conflicts_with = "target")]
        hidden_size: Option<usize>,
        /// The target's model_type (picks a trainer's per-architecture rule; e.g. deepseek_v3).
        #[arg(long, conflicts_with = "target")]
        model_type: Option<String>,
        /// The spec's name (default: the draft's directory name and the trainer).
        #[arg(long)]
        name: Option<String>,
        /// Write the spec here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Replace --out if it exists.
        #[arg(long, requires = "out")]
        force: bool,
        /// Revision of the HF Hub ids (default main).
        #[arg(long)]
        revision: Option<String>,
    },
}

/// How `plan` prints.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PlanFormat {
    /// A shell script, facts and notes as comments.
    Text,
    /// The same plan for machines.
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
    Auto,
}

#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl DtypeArg {
    fn dtype(self) -> DType {
        match self {
            DtypeArg::F32 => DType::F32,
            DtypeArg::Bf16 => DType::BF16,
            DtypeArg::F16 => DType::F16,
        }
    }
}

/// Picks the compute device: the first CUDA GPU when this build has CUDA and the machine has
/// one (`auto`), else the CPU.
fn device(arg: DeviceArg) -> Result<Device> {
    let built = candle_core::utils::cuda_is_available();
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Auto if !built => Ok(Device::Cpu),
        DeviceArg::Cuda if !built => Err(eagle_check::error::Error::Device(
            "--device cuda: this build of eagle-check has no CUDA support (build with \
             `--features cuda`, see the README); use --device cpu"
                .into(),
        )
        .into()),
        DeviceArg::Auto if !gpu_present() => Ok(Device::Cpu),
        DeviceArg::Cuda if !gpu_present() => Err(eagle_check::error::Error::Device(
            "--device cuda: no CUDA driver or device found on this machine".into(),
        )
        .into()),
        DeviceArg::Auto | DeviceArg::Cuda => cuda_device(),
    }
}

#[cfg(feature = "cuda")]
fn gpu_present() -> bool {
    eagle_check::kernels::cuda::device_available()
}

#[cfg(not(feature = "cuda"))]
fn gpu_present() -> bool {
    false
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Result<Device> {
    Ok(Device::Cuda(eagle_check::kernels::cuda::open_device(0)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<Device> {
    Ok(Device::new_cuda(0)?)
}

/// `--dtype`, else bf16 on the GPU (what engines run) and f32 on the CPU (exact parity).
fn compute_dtype(arg: Option<DtypeArg>, device: &Device) -> DType {
    match (arg, device.is_cuda()) {
        (Some(d), _) => d.dtype(),
        (None, true) => DType::BF16,
        (None, false) => DType::F32,
    }
}

/// Parses `--engine` (or the spec's `engine:`) into a selection.
/// What an engine can load of a `plan --target`/`--draft`: a folder or an HF id as given; a
/// config file is neither its weights nor (its folder) surely where they are, so None.
fn engine_path(given: &Path) -> Option<String> {
    let is_file = given.is_file() || given.extension().is_some_and(|e| e == "json");
    (!is_file).then(|| given.display().to_string())
}

fn engine_sel(name: &str) -> Result<EngineSel> {
    EngineSel::parse(name)
        .map_err(|e| eagle_check::error::Error::Usage(format!("--engine: {e}")).into())
}

/// Ids used when none are given and the bundle has no tokens.txt: a fixed, documented
/// pseudo-random sequence (LCG) over the vocabulary, so runs are reproducible.
fn default_tokens(vocab: usize) -> Vec<u32> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    (0..16)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab.max(1) as u64) as u32
        })
        .collect()
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return command_line_error(e),
    };
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            eprintln!("eagle-check: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// `--help` and `--version` as clap prints them; a command-line mistake on one line, exit 2,
/// like every other refusal (clap's own report adds the usage on further lines).
fn command_line_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if !e.use_stderr() {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    let text = e.render().to_string();
    let parts: Vec<&str> = match e.kind() {
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            vec!["no subcommand given (gate, run, probe, diff, plan, engines, spec)"]
        }
        // The `error:` paragraph (its indented lines name the arguments) and any tips.
        _ => text
            .lines()
            .map(str::trim)
            .skip_while(|l| !l.starts_with("error:"))
            .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
            .filter(|l| !l.is_empty())
            .map(|l| l.trim_start_matches("error: "))
            .collect(),
    };
    let mut line = String::new();
    for part in parts {
        if !line.is_empty() {
            line.push_str(if line.ends_with(':') { " " } else { "; " });
        }
        line.push_str(part);
    }
    eprintln!("eagle-check: {line} (see --help)");
    ExitCode::from(2)
}

fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::Gate {
            spec,
            draft,
            target,
            revision,
            engine,
            output,
        } => {
            output.check()?;
            let draft = locate::locate_model(&draft, revision.as_deref())?;
            let target = locate_opt(target, revision.as_deref())?;
            let spec = Spec::load(&spec)?;
            let engines = pick_engines(engine.as_deref(), &spec)?;
            let draft_cfg = DraftConfig::load(&draft)?;
            let target_info = target.as_deref().map(locate::target_info).transpose()?;
            let weights = model_weights(&draft)?;
            let target_weights = target.as_deref().map(model_weights).transpose()?.flatten();
            let report = gate(
                &StaticInput {
                    spec: &spec,
                    draft: Some(&draft_cfg),
                    draft_weights: weights.as_ref(),
                    target: target_info.as_ref(),
                    target_weights: target_weights.as_ref(),
                },
                &engines,
            )?;
            Ok(emit(&report, output))
        }
        Command::Spec {
            command:
                SpecCommand::Init {
                    draft,
                    trainer,
                    target,
                    num_layers,
                    hidden_size,
                    model_type,
                    name,
                    out,
                    force,
                    revision,
                },
        } => {
            let trainer = spec_init::trainer(&trainer)?;
            let draft = locate::locate_model(&draft, revision.as_deref())?;
            let target = locate_opt(target, revision.as_deref())?;
            let draft_cfg = DraftConfig::load(&draft)?;
            let (num_layers, hidden_size, model_type, target_origin) = match &target {
                Some(t) => {
                    let info = locate::target_info(t)?;
                    (
                        info.num_layers,
                        Some(info.hidden_size),
                        Some(info.family.name),
                        format!("target {}", t.display()),
                    )
                }
                None => (
                    num_layers.context("spec init needs --target DIR or --num-layers N")?,
                    hidden_size,
                    model_type,
                    "--num-layers".to_string(),
                ),
            };
            let text = spec_init::init(&spec_init::InitInput {
                draft: &draft_cfg,
                trainer,
                num_layers,
                hidden_size,
                model_type,
                name: name.unwrap_or_else(|| spec_init::default_name(&draft, &trainer)),
                target_origin,
            })?;
            match out {
                None => print!("{text}"),
                Some(path) => {
                    if path.exists() && !force {
                        bail!("{}: exists; pass --force to replace it", path.display());
                    }
                    std::fs::write(&path, &text)
                        .map_err(|e| eagle_check::error::Error::io(&path, e))?;
                    eprintln!("eagle-check: wrote {}", path.display());
                }
            }
            Ok(0)
        }
        Command::Plan {
            target,
            target_path,
            engine,
            tp,
            ep,
            prompts,
            draft,
            draft_path,
            out,
            revision,
            format,
        } => {
            let sel = engine_sel(&engine)?;
            let located = locate::locate_model(&target, revision.as_deref())?;
            let info = locate::target_info(&located)?;
            let draft_cfg = match &draft {
                Some(d) => {
                    let dir = locate::locate_model(d, revision.as_deref())?;
                    Some((DraftConfig::load(&dir)?, d))
                }
                None => None,
            };
            let plan =
                eagle_check::commands::plan::plan(&eagle_check::commands::plan::PlanInput {
                    target: &info,
                    target_arg: target.display().to_string(),
                    model: target_path.or_else(|| engine_path(&target)),
                    engine: sel,
                    tp,
                    ep,
                    prompts,
                    draft: draft_cfg.as_ref().map(|(config, arg)| {
                        eagle_check::commands::plan::DraftInput {
                            config,
                            arg: arg.display().to_string(),
                            path: draft_path.clone().or_else(|| engine_path(arg)),
                        }
                    }),
                    out,
                })?;
            match format {
                PlanFormat::Text => print!("{}", plan.to_text()),
                PlanFormat::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&plan).context("rendering the plan")?
                ),
            }
            Ok(0)
        }
        Command::Engines { markdown } => {
            if markdown {
                print!("{}", markdown_table());
            } else {
                for engine in Engine::ALL {
                    let versions: Vec<String> =
                        engine.versions().iter().map(|v| v.to_string()).collect();
                    let paths: Vec<&str> = engine
                        .paths()
                        .into_iter()
                        .filter(|p| !p.is_empty())
                        .collect();
                    println!(
                        "{engine}: versions {}{}",
                        versions.join(", "),
                        if paths.is_empty() {
                            String::new()
                        } else {
                            format!("; paths {}", paths.join(", "))
                        }
                    );
                }
                println!("\n{}", markdown_table());
            }
            Ok(0)
        }
        Command::Diff {
            spec,
            target,
            captures,
            reference,
            reference_map,
            reference_tokens,
            draft,
            revision,
            engine,
            device: device_arg,
            dtype,
            memory,
            output,
        } => {
            output.check()?;
            let target = locate_opt(target, revision.as_deref())?;
            let draft = locate_opt(draft, revision.as_deref())?;
            let spec = Spec::load(&spec)?;
            let target_shape = target.as_deref().map(locate::target_info).transpose()?;
            let mut source: Box<dyn ReferenceSource> = match (&reference, &target) {
                (Some(path), _) => {
                    let opts = ReferenceOptions {
                        map: if reference_map.is_empty() {
                            None
                        } else {
                            Some(
                                NameMap::parse(&reference_map)
                                    .map_err(eagle_check::error::Error::Usage)?,
                            )
                        },
                        tokens: reference_tokens
                            .map(|p| -> Result<_> {
                                let ids = read_token_file(&p)?;
                                Ok((ids.into_iter().map(i64::from).collect(), p))
                            })
                            .transpose()?,
                        num_layers: target_shape
                            .as_ref()
                            .map(|t| t.num_layers)
                            .or_else(|| spec.target.as_ref().and_then(|t| t.num_hidden_layers)),
                        hidden_size: target_shape
                            .as_ref()
                            .map(|t| t.hidden_size)
                            .or_else(|| spec.target.as_ref().and_then(|t| t.hidden_size)),
                    };
                    Box::new(DumpReference::open_with(path, &opts)?)
                }
                (None, Some(path)) => {
                    let dev = device(device_arg)?;
                    let opts = memory.options(compute_dtype(dtype, &dev), &dev);
                    Box::new(RunnerReference::open(path, &opts)?)
                }
                (None, None) => bail!("diff needs --target or --reference"),
            };
            let arch = target_shape
                .map(|t| t.family.name)
                .or_else(|| spec.target.as_ref().and_then(|t| t.model_type.clone()));
            let feed = match &draft {
                Some(d) => {
                    let draft_cfg = DraftConfig::load(d)?;
                    let sel = match engine.as_deref() {
                        Some(name) => engine_sel(name)?,
                        None => spec.engine.context(
                            "--draft needs an engine: --engine NAME or `engine:` in the spec",
                        )?,
                    };
                    Some(resolve(
                        &sel,
                        arch.as_deref(),
                        &draft_cfg.ids,
                        source.num_layers(),
                    ))
                }
                None => None,
            };
            let mut counted = Counted::new(source.as_mut(), "samples compared");
            let (report, _) = diff(
                &DiffInput {
                    spec: &spec,
                    captures: &captures,
                    feed: feed.as_ref(),
                    arch: arch.as_deref(),
                },
                &mut counted,
            )?;
            counted.finish();
            let mut report = report;
            report.sources.spec = Some(spec.path.clone());
            Ok(emit(&report, output))
        }
        Command::Probe {
            bundle,
            target,
            draft,
            revision,
            spec,
            engine,
            tokens,
            token_file,
            prompt,
            prompts,
            steps,
            search,
            write_spec,
            seed,
            memory,
            device: device_arg,
            dtype,
            output,
        } => {
            output.check()?;
            if steps == 0 {
                bail!("--steps must be at least 1");
            }
            let target = locate_opt(target, revision.as_deref())?;
            let draft = locate_opt(draft, revision.as_deref())?;
            let bundle = bundle.as_deref().map(Bundle::open).transpose()?;
            let target = target
                .or_else(|| bundle.as_ref().map(|b| b.target.clone()))
                .context("probe needs a bundle directory or --target")?;
            let draft = draft
                .or_else(|| bundle.as_ref().and_then(|b| b.draft.clone()))
                .context("probe needs a draft: a bundle with draft/, or --draft")?;
            let spec = spec
                .or_else(|| bundle.as_ref().and_then(|b| b.spec.clone()))
                .map(|p| Spec::load(&p))
                .transpose()?;
            let engines = match (engine.as_deref(), &spec) {
                (Some(name), Some(spec)) => pick_engines(Some(name), spec)?,
                (Some("all") | None, None) => Engine::ALL.map(EngineSel::newest).to_vec(),
                (Some(name), None) => vec![engine_sel(name)?],
                (None, Some(spec)) => pick_engines(None, spec)?,
            };
            let token_sets = match prompts {
                Some(file) => {
                    let dir = locate::resolve_model_dir(&target)?;
                    let tokenizer = Tokenizer::open(&dir).ok();
                    tokenize::read_prompts(&file, tokenizer.as_ref())?
                        .into_iter()
                        .map(|p| TokenSet {
                            origin: p.origin,
                            tokens: p.ids,
                        })
                        .collect()
                }
                None => {
                    let (tokens, origin) =
                        input_tokens(tokens, token_file, prompt, bundle.as_ref(), &target)?;
                    vec![TokenSet { origin, tokens }]
                }
            };
            let dev = device(device_arg)?;
            let report = probe(&ProbeInput {
                target,
                draft,
                spec,
                engines,
                token_sets,
                steps,
                search,
                write_spec,
                dtype: compute_dtype(dtype, &dev),
                device: dev,
                stream_layers: memory.stream_layers,
                max_memory: memory.max_memory,
                seed,
            })?;
            Ok(emit(&report, output))
        }
        Command::Run {
            bundle,
            target,
            draft,
            spec,
            engine,
            tokens,
            token_file,
            prompt,
            device: device_arg,
            dtype,
            dump,
            generate,
            revision,
            memory,
            output,
        } => {
            output.check()?;
            let target = locate_opt(target, revision.as_deref())?;
            let draft = locate_opt(draft, revision.as_deref())?;
            let bundle = bundle.as_deref().map(Bundle::open).transpose()?;
            let target = target
                .or_else(|| bundle.as_ref().map(|b| b.target.clone()))
                .context("run needs a bundle directory or --target")?;
            let draft = draft.or_else(|| bundle.as_ref().and_then(|b| b.draft.clone()));
            let spec = spec
                .or_else(|| bundle.as_ref().and_then(|b| b.spec.clone()))
                .map(|p| Spec::load(&p))
                .transpose()?;
            let engine = match engine.as_deref() {
                Some(name) => engine_sel(name)?,
                None => spec
                    .as_ref()
                    .and_then(|s| s.engine)
                    .context("name the engine that assembles the fc input: --engine NAME or `engine:` in the spec")?,
            };
            let (tokens, tokens_origin) =
                input_tokens(tokens, token_file, prompt, bundle.as_ref(), &target)?;
            let dev = device(device_arg)?;
            let report = eagle_check::commands::run::run(&RunInput {
                target,
                draft,
                spec,
                engine,
                tokens,
                tokens_origin,
                dtype: compute_dtype(dtype, &dev),
                device: dev,
                dump,
                generate,
                stream_layers: memory.stream_layers,
                max_memory: memory.max_memory,
            })?;
            Ok(emit(&report, output))
        }
    }
}

/// The token ids of `--tokens`, `--token-file` or `--prompt`, else the bundle's tokens.txt, else
/// the default sequence; with where they came from.
fn input_tokens(
    tokens: Option<Vec<u32>>,
    token_file: Option<PathBuf>,
    prompt: Option<String>,
    bundle: Option<&Bundle>,
    target: &Path,
) -> Result<(Vec<u32>, String)> {
    Ok(match (tokens, token_file, prompt) {
        (Some(t), _, _) => (t, "--tokens".to_string()),
        (None, Some(file), _) => (read_token_file(&file)?, file.display().to_string()),
        (None, None, Some(text)) => {
            let dir = locate::resolve_model_dir(target)?;
            let tokenizer = Tokenizer::open(&dir)?;
            let ids = tokenizer.encode(&text)?;
            if ids.is_empty() {
                bail!("--prompt: the text encodes to no tokens");
            }
            (ids, "--prompt".to_string())
        }
        (None, None, None) => match bundle.and_then(|b| b.tokens.clone()) {
            Some(file) => (read_token_file(&file)?, file.display().to_string()),
            None => (
                default_tokens(locate::target_config(target)?.vocab_size),
                "the default token sequence".to_string(),
            ),
        },
    })
}

/// A model argument through [`locate::locate_model`]: paths as they are, Hub ids from the cache.
fn locate_opt(arg: Option<PathBuf>, revision: Option<&str>) -> Result<Option<PathBuf>> {
    Ok(arg
        .map(|a| locate::locate_model(&a, revision))
        .transpose()?)
}

/// `--engine NAME` wins, then the spec's `engine:`, then every engine (newest versions).
fn pick_engines(flag: Option<&str>, spec: &Spec) -> Result<Vec<EngineSel>> {
    match flag {
        Some("all") => Ok(Engine::ALL.map(EngineSel::newest).to_vec()),
        Some(name) => Ok(vec![engine_sel(name)?]),
        None => Ok(spec
            .engine
            .map_or_else(|| Engine::ALL.map(EngineSel::newest).to_vec(), |e| vec![e])),
    }
}

/// A model's weight headers, if its path (a directory or its config.json) holds safetensors.
fn model_weights(draft: &Path) -> Result<Option<WeightIndex>> {
    let dir = if draft.is_dir() {
        draft.to_path_buf()
    } else {
        match draft.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    };
    let index =
        WeightIndex::open(&dir).with_context(|| format!("reading weights in {}", dir.display()))?;
    Ok((!index.is_empty()).then_some(index))
}

impl OutputArgs {
    /// `--quiet` is a table without the table; with another format it is a contradiction.
    /// Progress bars are for people reading a table on a terminal: off otherwise.
    fn check(&self) -> Result<()> {
        progress::set_enabled(self.format == Format::Table && !self.quiet);
        if self.quiet && self.format != Format::Table {
            return Err(eagle_check::error::Error::Usage(
                "--quiet prints only the verdict line; it cannot be combined with --format json, junit or github"
                    .into(),
            )
            .into());
        }
        Ok(())
    }
}

fn emit(report: &Report, output: OutputArgs) -> u8 {
    match output.format {
        Format::Table if output.quiet => println!("{}", report.verdict_line()),
        Format::Table => print!("{}", report.to_table()),
        Format::Json => println!("{}", report.to_json()),
        Format::Junit => print!("{}", eagle_check::ci::to_junit(report)),
        Format::Github => print!("{}", eagle_check::ci::to_github(report)),
    }
    report.exit_code() as u8
}
