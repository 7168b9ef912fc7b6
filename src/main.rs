//! The `eagle-check` command line: parse, call the library, render, exit 0/1/2.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use eagle_check::config::{DraftConfig, ModelConfig};
use eagle_check::engine::Engine;
use eagle_check::gate::{GateInput, gate};
use eagle_check::report::Report;
use eagle_check::spec::{Spec, engine_names};
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

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Static check, no GPU: draft config + engine rule + weight shapes against a capture spec.
    Gate {
        /// Capture spec (YAML): what the drafter's training data held.
        #[arg(long)]
        spec: PathBuf,
        /// Draft model directory or its config.json.
        #[arg(long)]
        draft: PathBuf,
        /// Target model directory or its config.json (else the spec's target block).
        #[arg(long)]
        target: Option<PathBuf>,
        /// Engine to check (sglang, sglang-legacy, vllm, trtllm, specforge, eagle, modelopt,
        /// speculators, or all). Default: the spec's `engine`, else all.
        #[arg(long)]
        engine: Option<String>,
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            eprintln!("eagle-check: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::Gate {
            spec,
            draft,
            target,
            engine,
            format,
        } => {
            let spec = Spec::load(&spec)?;
            let engines = pick_engines(engine.as_deref(), &spec)?;
            let draft_cfg = DraftConfig::load(&draft)?;
            let target_cfg = target.as_deref().map(ModelConfig::load).transpose()?;
            let weights = model_weights(&draft)?;
            let target_weights = target.as_deref().map(model_weights).transpose()?.flatten();
            let report = gate(&GateInput {
                spec: &spec,
                draft: &draft_cfg,
                draft_weights: weights.as_ref(),
                target: target_cfg.as_ref(),
                target_weights: target_weights.as_ref(),
                engines: &engines,
            })?;
            Ok(emit(&report, format))
        }
    }
}

/// `--engine NAME` wins, then the spec's `engine:`, then every engine.
fn pick_engines(flag: Option<&str>, spec: &Spec) -> Result<Vec<Engine>> {
    match flag {
        Some("all") => Ok(Engine::ALL.to_vec()),
        Some(name) => match Engine::from_name(name) {
            Some(e) => Ok(vec![e]),
            None => bail!(
                "--engine: unknown engine `{name}` (known: {}, all)",
                engine_names()
            ),
        },
        None => Ok(spec
            .engine
            .map_or_else(|| Engine::ALL.to_vec(), |e| vec![e])),
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

fn emit(report: &Report, format: Format) -> u8 {
    match format {
        Format::Table => print!("{}", report.to_table()),
        Format::Json => println!("{}", report.to_json()),
    }
    report.exit_code() as u8
}
