//! Memory budgets: what the machine says about memory (the process's peak resident set, the
//! memory still available, on a GPU the device memory in use), so that a run can say how much
//! it held against its budget.

use crate::report::{Finding, FindingName, Report};
use crate::size::format_bytes;
use candle_core::Device;
use std::sync::atomic::{AtomicU64, Ordering};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn linux_reports_a_peak_and_available_memory() {
        let peak = peak_rss().unwrap_or(0);
        assert!(peak > 1 << 20, "VmHWM {peak}");
        assert!(mem_available().unwrap_or(0) > 0);
    }
}
