//! The commands: each takes its typed options, reads what it needs, calls the judge and returns
//! what the CLI renders (a [`crate::report::Report`], or a plan, a spec, a table). None parses
//! a command line and none imports another; what several share is here.

pub mod gate;
pub mod plan;
pub mod probe;
pub mod run;
pub mod spec_init;
