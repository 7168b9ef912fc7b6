//! Integration tests: one binary, one module per capability (ripgrep's layout).

mod support;

mod deepseek;
mod deepseek_cli;
mod diff;
mod gate;
mod gguf;
mod incidents;
mod mla_draft;
mod run_cli;
mod runner;
