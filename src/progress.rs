//! Progress on stderr for the long steps (loading weights, the target forward, the diff over
//! samples), drawn by indicatif. Shown only to people: when stderr is a terminal and the
//! command prints a table (the CLI turns it off for `--format json|junit|github` and
//! `--quiet`). Hidden bars cost nothing and draw nothing.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns progress off (or back on) for the whole process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether a bar made now is drawn: enabled, and stderr is a terminal.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed) && std::io::stderr().is_terminal()
}

/// A spinner with `label` and the time spent, for a step whose length is unknown (drawn only
/// when [`enabled`]).
pub fn spinner(label: &str) -> ProgressBar {
    if !enabled() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
        bar.set_style(style);
    }
    bar.set_message(label.to_string());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// Turns `bar` into a bar of `total` steps (once; later calls only update the length).
pub fn to_bar(bar: &ProgressBar, total: u64) {
    if bar.length() == Some(total) {
        return;
    }
    if bar.length().is_none()
        && let Ok(style) =
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} [{elapsed} < {eta}]")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_length(total);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_means_hidden_and_a_tick_makes_a_bar() {
        set_enabled(false);
        let bar = spinner("loading");
        assert!(bar.is_hidden());
        assert_eq!(bar.length(), None);
        to_bar(&bar, 5);
        bar.set_position(3);
        assert_eq!((bar.length(), bar.position()), (Some(5), 3));
        let mut p = crate::model::Progress::new("forward");
        p.tick(1, 4);
        p.finish();
        set_enabled(true);
    }
}
