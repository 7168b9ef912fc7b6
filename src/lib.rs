//! eagle-check: finds where an EAGLE-3 drafter's hidden-state capture disagrees with its training.
//!
//! Data flows one way: configs and spec are resolved ([`config`], [`spec`], [`engine`]) ->
//! models compute captures ([`model`]) -> the [`judge`] and the [`diff`] engine decide ->
//! [`report`] renders. The [`commands`] gather evidence and call them; none imports another.
//! The wings and what each may import: ARCHITECTURE.md (checked by `tests/architecture.rs`).

pub mod boundary;
pub mod ci;
pub mod commands;
pub mod compare;
pub mod config;
pub mod diff;
pub mod engine;
pub mod error;
pub mod fuzzing;
pub mod judge;
pub mod kernels;
pub mod locate;
pub mod memory;
pub mod model;
pub mod naming;
pub mod progress;
pub mod readers;
pub mod report;
pub mod routing;
pub mod score;
pub mod size;
pub mod spec;
pub mod stats;
pub mod tokenize;
pub mod tolerance;
pub mod weights;
