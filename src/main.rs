//! The `eagle-check` command line: parse ([`cli`]), dispatch to the command, render, exit 0/1/2.

mod cli;

use anyhow::{Context, Result};
use clap::Parser;
use cli::{Cli, Format, Invocation, OutputArgs, PlanFormat, Reported};
use eagle_check::commands::{self, spec_init};
use eagle_check::progress;
use eagle_check::report::Report;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Named threads: a stalled run's stall report (and `EAGLE_CHECK_TRACE`) says which pool
    // burns the time. The pool is otherwise rayon's default; were one built already, it stays.
    let _ = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("ec-rayon-{i}"))
        .build_global();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return command_line_error(e),
    };
    // The trace's clock starts here, so that its last line is the whole command's time.
    progress::trace(|| "command line read".into());
    let code = match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            eprintln!("eagle-check: {err:#}");
            ExitCode::from(2)
        }
    };
    progress::trace(|| "done: everything dropped".into());
    code
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

/// Dispatches a parsed command line to its command and renders what it returns.
fn run(cli: Cli) -> Result<u8> {
    match cli.command.invocation() {
        Invocation::Report(command, output) => {
            output.check()?;
            let report = match command {
                Reported::Gate(opts) => commands::gate::execute(&opts)?,
                Reported::Run(opts) => commands::run::execute(&opts)?,
                Reported::Probe(opts) => commands::probe::execute(&opts)?,
                Reported::Diff(opts) => commands::diff::execute(&opts)?,
            };
            Ok(emit(&report, output))
        }
        Invocation::SpecInit { opts, out, force } => {
            let text = spec_init::execute(&opts)?;
            match out {
                None => print!("{text}"),
                Some(path) => {
                    spec_init::write_spec(&path, &text, force)?;
                    eprintln!("eagle-check: wrote {}", path.display());
                }
            }
            Ok(0)
        }
        Invocation::Plan(opts, format) => {
            let plan = commands::plan::execute(&opts)?;
            match format {
                PlanFormat::Text => print!("{}", plan.to_text()),
                PlanFormat::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&plan).context("rendering the plan")?
                ),
            }
            Ok(0)
        }
        Invocation::Engines { markdown } => {
            print!("{}", commands::engines::listing(markdown));
            Ok(0)
        }
    }
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
