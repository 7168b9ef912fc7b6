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

/// Whether `EAGLE_CHECK_TRACE` asks for [`trace`] lines (read once).
fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("EAGLE_CHECK_TRACE").is_some_and(|v| v != "0"))
}

/// With `EAGLE_CHECK_TRACE=1`, one stderr line: seconds since the first line, the calling
/// thread's name, and `what()`. For finding where a long run's time goes (which layer loads,
/// which pass, on which thread) without a debugger; off, it costs one load of a flag.
pub fn trace(what: impl FnOnce() -> String) {
    if !tracing() {
        return;
    }
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(std::time::Instant::now);
    let thread = std::thread::current();
    eprintln!(
        "[trace {:9.3} s {}] {}",
        start.elapsed().as_secs_f64(),
        thread.name().unwrap_or("?"),
        what()
    );
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
