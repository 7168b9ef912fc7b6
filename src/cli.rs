//! The command line as clap parses it, and what each command's flags become: the typed
//! options of its command in [`eagle_check::commands`]. Parsing only: no file is read here.

use candle_core::DType;
use clap::{Args, Parser, Subcommand, ValueEnum};
use eagle_check::commands::diff::DiffOptions;
use eagle_check::commands::gate::GateOptions;
use eagle_check::commands::plan::PlanOptions;
use eagle_check::commands::probe::ProbeOptions;
use eagle_check::commands::run::RunOptions;
use eagle_check::commands::spec_init::SpecInitOptions;
use eagle_check::commands::{DeviceChoice, ModelArgs, TokenArgs};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "eagle-check",
    version,
    about = "Checks that an EAGLE-3 drafter is fed the hidden states it was trained on"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
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
pub(crate) struct OutputArgs {
    #[arg(long, value_enum, default_value = "table")]
    pub(crate) format: Format,
    /// Print only the verdict line (the exit code says the same).
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

/// How the target's weights are held.
#[derive(Args, Clone, Copy)]
pub(crate) struct MemoryArgs {
    /// Run the target one decoder layer at a time (each read from the checkpoint, run and
    /// freed, the next read meanwhile), even when it would fit: for targets larger than memory.
    /// Automatic when the weights would not fit --max-memory (else the memory available).
    #[arg(long)]
    pub(crate) stream_layers: bool,
    /// Memory budget: resident memory on the CPU, device memory on a GPU (4GiB, 512MiB, 64GB).
    /// Decides streaming; the report prints the peak against it.
    #[arg(long, value_name = "SIZE", value_parser = parse_max_memory)]
    pub(crate) max_memory: Option<u64>,
}

pub(crate) fn parse_max_memory(text: &str) -> std::result::Result<u64, String> {
    eagle_check::size::parse_size(text)
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
pub(crate) enum SpecCommand {
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
pub(crate) enum PlanFormat {
    /// A shell script, facts and notes as comments.
    Text,
    /// The same plan for machines.
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum DeviceArg {
    Cpu,
    Cuda,
    Auto,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl DtypeArg {
    pub(crate) fn dtype(self) -> DType {
        match self {
            DtypeArg::F32 => DType::F32,
            DtypeArg::Bf16 => DType::BF16,
            DtypeArg::F16 => DType::F16,
        }
    }
}

impl DeviceArg {
    pub(crate) fn choice(self) -> DeviceChoice {
        match self {
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Cuda => DeviceChoice::Cuda,
            DeviceArg::Auto => DeviceChoice::Auto,
        }
    }
}

/// A command that returns a report (rendered by `--format`).
pub(crate) enum Reported {
    Gate(GateOptions),
    Run(RunOptions),
    Probe(ProbeOptions),
    Diff(DiffOptions),
}

/// A parsed command line: the command's typed options and how its result is rendered.
pub(crate) enum Invocation {
    Report(Reported, OutputArgs),
    SpecInit {
        opts: SpecInitOptions,
        out: Option<PathBuf>,
        force: bool,
    },
    Plan(PlanOptions, PlanFormat),
    Engines {
        markdown: bool,
    },
}

impl Command {
    /// The flags as the command's typed options.
    pub(crate) fn invocation(self) -> Invocation {
        match self {
            Command::Gate {
                spec,
                draft,
                target,
                revision,
                engine,
                output,
            } => {
                let opts = GateOptions {
                    spec,
                    draft,
                    target,
                    revision,
                    engine,
                };
                Invocation::Report(Reported::Gate(opts), output)
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
            } => Invocation::SpecInit {
                opts: SpecInitOptions {
                    draft,
                    trainer,
                    target,
                    num_layers,
                    hidden_size,
                    model_type,
                    name,
                    revision,
                },
                out,
                force,
            },
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
                let opts = PlanOptions {
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
                };
                Invocation::Plan(opts, format)
            }
            Command::Engines { markdown } => Invocation::Engines { markdown },
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
                device,
                dtype,
                memory,
                output,
            } => {
                let opts = DiffOptions {
                    spec,
                    target,
                    captures,
                    reference,
                    reference_map,
                    reference_tokens,
                    draft,
                    revision,
                    engine,
                    device: device.choice(),
                    dtype: dtype.map(DtypeArg::dtype),
                    stream_layers: memory.stream_layers,
                    max_memory: memory.max_memory,
                };
                Invocation::Report(Reported::Diff(opts), output)
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
                device,
                dtype,
                output,
            } => {
                let opts = ProbeOptions {
                    models: ModelArgs {
                        bundle,
                        target,
                        draft,
                        spec,
                        revision,
                    },
                    engine,
                    tokens: TokenArgs {
                        tokens,
                        token_file,
                        prompt,
                    },
                    prompts,
                    steps,
                    search,
                    write_spec,
                    seed,
                    stream_layers: memory.stream_layers,
                    max_memory: memory.max_memory,
                    device: device.choice(),
                    dtype: dtype.map(DtypeArg::dtype),
                };
                Invocation::Report(Reported::Probe(opts), output)
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
                device,
                dtype,
                dump,
                generate,
                revision,
                memory,
                output,
            } => {
                let opts = RunOptions {
                    models: ModelArgs {
                        bundle,
                        target,
                        draft,
                        spec,
                        revision,
                    },
                    engine,
                    tokens: TokenArgs {
                        tokens,
                        token_file,
                        prompt,
                    },
                    device: device.choice(),
                    dtype: dtype.map(DtypeArg::dtype),
                    dump,
                    generate,
                    stream_layers: memory.stream_layers,
                    max_memory: memory.max_memory,
                };
                Invocation::Report(Reported::Run(opts), output)
            }
        }
    }
}
