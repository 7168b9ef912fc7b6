//! Memory budgets: `--max-memory SIZE` parsed, byte counts written for people, and what the
//! machine says about memory (the process's peak resident set, the memory still available, on a
//! GPU the device memory in use), so that a run can say how much it held against its budget.

use crate::report::{Finding, FindingName, Report};
use candle_core::Device;
use std::sync::atomic::{AtomicU64, Ordering};

/// Parses a size: a number (fractions allowed) and a unit. Binary units (`B`, `KiB`, `MiB`,
/// `GiB`, `TiB`, and the short `K`, `M`, `G`, `T` that `free -g`, Docker and Slurm read as
/// binary too), decimal ones (`KB`, `MB`, `GB`, `TB`), case-insensitive; a bare number is
/// bytes. `4GiB`, `512MiB`, `1.5G`, `64gb`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size (e.g. 4GiB, 512MiB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "`{text}`: unknown unit `{other}` (B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)"
            ));
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("`{text}` is too large"));
    }
    Ok(bytes.round() as u64)
}

/// `1536` -> `1.5 KiB`; three significant digits, binary units.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let digits = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.digits$} {}", UNITS[unit])
}

/// A `kB` field of a `/proc` file (`VmHWM:   123456 kB`), in bytes.
fn proc_kb(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// The process's peak resident set so far (`VmHWM` in /proc/self/status; Linux only).
pub fn peak_rss() -> Option<u64> {
    proc_kb("/proc/self/status", "VmHWM:")
}

/// The memory the kernel says can be taken without swapping (`MemAvailable` in /proc/meminfo;
/// Linux only).
pub fn mem_available() -> Option<u64> {
    proc_kb("/proc/meminfo", "MemAvailable:")
}

/// Where a budget came from, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetOrigin {
    /// `--max-memory`.
    Flag,
    /// What the machine had free when the target was opened (MemAvailable, or free device
    /// memory on a GPU).
    Available,
}

/// A memory budget in bytes: resident memory on the CPU, device memory on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    pub origin: BudgetOrigin,
    pub on_gpu: bool,
}

impl Budget {
    /// `--max-memory`, else what the device has available now (`None` when it cannot say).
    pub fn resolve(max_memory: Option<u64>, device: &Device) -> Option<Budget> {
        let on_gpu = device.is_cuda();
        if let Some(bytes) = max_memory {
            return Some(Budget {
                bytes,
                origin: BudgetOrigin::Flag,
                on_gpu,
            });
        }
        let available = if on_gpu {
            device_free(device)
        } else {
            mem_available()
        };
        available.map(|bytes| Budget {
            bytes,
            origin: BudgetOrigin::Available,
            on_gpu,
        })
    }

    /// `--max-memory 4.00 GiB`, `MemAvailable 12.3 GiB`, `free device memory 80.0 GiB`.
    pub fn describe(&self) -> String {
        let size = format_bytes(self.bytes);
        match (self.origin, self.on_gpu) {
            (BudgetOrigin::Flag, _) => format!("--max-memory {size}"),
            (BudgetOrigin::Available, false) => format!("MemAvailable {size}"),
            (BudgetOrigin::Available, true) => format!("free device memory {size}"),
        }
    }
}

/// The largest device memory in use seen by [`note_device_use`] (bytes; GPU only).
static DEVICE_PEAK: AtomicU64 = AtomicU64::new(0);

/// Samples the device memory in use (total - free) and keeps the largest: the GPU has no
/// high-water mark to read, so the streamed forward samples it after every layer.
pub fn note_device_use(device: &Device) {
    if let Some((free, total)) = device_info(device) {
        DEVICE_PEAK.fetch_max(total.saturating_sub(free), Ordering::Relaxed);
    }
}

/// Free device memory on a GPU.
fn device_free(device: &Device) -> Option<u64> {
    device_info(device).map(|(free, _)| free)
}

#[cfg(feature = "cuda")]
fn device_info(device: &Device) -> Option<(u64, u64)> {
    let Device::Cuda(dev) = device else {
        return None;
    };
    dev.cuda_stream().context().bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    Some((free as u64, total as u64))
}

#[cfg(not(feature = "cuda"))]
fn device_info(_device: &Device) -> Option<(u64, u64)> {
    None
}

/// The peak memory of this process on `device` and how it was measured.
pub fn peak(device: &Device) -> Option<(u64, &'static str)> {
    if device.is_cuda() {
        note_device_use(device);
        let p = DEVICE_PEAK.load(Ordering::Relaxed);
        (p > 0).then_some((p, "device memory in use, sampled per layer"))
    } else {
        peak_rss().map(|p| (p, "resident, VmHWM"))
    }
}

/// Adds the peak to a report and, when it passed the budget, a `memory-budget` warning: the
/// captures are still what the target computed, so this is no layout mismatch (exit 1) and no
/// failure to check (exit 2), but the promise of `--max-memory` was broken and the report says
/// by how much.
pub fn report_peak(report: &mut Report, device: &Device, budget: Option<Budget>) {
    let Some((peak, how)) = peak(device) else {
        report.fact("peak_memory", "unknown on this platform");
        return;
    };
    let mut line = format!("{} ({how})", format_bytes(peak));
    if let Some(b) = budget {
        let verdict = if peak <= b.bytes { "within" } else { "OVER" };
        line.push_str(&format!(", budget {}: {verdict}", b.describe()));
        if peak > b.bytes && b.origin == BudgetOrigin::Flag {
            report.findings.push(Finding::warning(
                FindingName::MemoryBudget,
                format!(
                    "peak memory {} passed the budget {} by {}",
                    format_bytes(peak),
                    b.describe(),
                    format_bytes(peak - b.bytes)
                ),
            ));
        }
    }
    report.fact("peak_memory", line);
}

/// The memory facts of a run on `target`, once its forwards are done: how its weights were
/// held, what streaming cost, and the peak against the budget ([`report_peak`]).
pub fn report_target(report: &mut Report, target: &crate::model::LoadedTarget) {
    report.fact("weights", target.memory.describe());
    if let Some(stats) = target.model.stream_stats() {
        report.fact("streaming", stats.describe());
    }
    report_peak(report, target.model.device(), target.memory.budget);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size("8 KiB"), Ok(8192));
        assert!(parse_size("GiB").is_err());
        assert!(
            parse_size("4 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_size("-4GiB").is_err());
        assert!(parse_size("1e30TiB").is_err());
    }

    #[test]
    fn bytes_format_with_three_digits() {
        assert_eq!(format_bytes(100), "100 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(4 << 30), "4.00 GiB");
        assert_eq!(format_bytes(300 << 20), "300 MiB");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn linux_reports_a_peak_and_available_memory() {
        let peak = peak_rss().unwrap_or(0);
        assert!(peak > 1 << 20, "VmHWM {peak}");
        assert!(mem_available().unwrap_or(0) > 0);
    }
}
