//! Where a forward's device time goes: named phases, timed one of two ways. Off by default,
//! when a mark costs one relaxed atomic load.
//!
//! - Closed (`set_enabled`): each mark synchronises the device, so the time between two marks
//!   is the device time of the work queued between them, plus one synchronisation. The GPU
//!   bench turns it on for one extra run after its timed ones (`EAGLE_CHECK_PHASES=1`), so the
//!   figures it reports as timings never carry the synchronisations. Nothing queued before a
//!   phase overlaps it, so a phase that would run beside queued work reads as all exposed.
//! - Timeline (`set_timeline`): each mark records a timed event on the device's stream (on a
//!   GPU) and the host's clock, and synchronises nothing, so the device runs as it would.
//!   [`take_timeline`] then gives each phase's device time (from the event before to its own:
//!   its work, and any time the device sat waiting for the host to queue it), the host's time,
//!   and how far the device lagged the host at its marks (zero: the device had caught up, and
//!   whatever the host did next left it idle). `EAGLE_CHECK_PHASES=timeline` in the GPU bench.

use candle_core::Device;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

const OFF: u8 = 0;
const CLOSED: u8 = 1;
const TIMELINE: u8 = 2;

static MODE: AtomicU8 = AtomicU8::new(OFF);

/// The mode is global: tests that set it take turns with it.
#[cfg(test)]
pub(crate) static TEST_TURN: Mutex<()> = Mutex::new(());

/// Phase name, total milliseconds, how many marks closed it.
pub type PhaseTotal = (&'static str, f64, usize);

/// One phase of a timeline, over every mark that ended it.
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineTotal {
    pub name: &'static str,
    /// The device's time from each previous mark to this one's, summed.
    pub device_ms: f64,
    /// The host's time from each previous mark to this one's, summed.
    pub host_ms: f64,
    /// How far the device's clock lagged the host's at this phase's marks, summed: the device
    /// work queued and not yet done when the host marked it.
    pub lag_ms: f64,
    /// Of `device_ms`, at most this much was the device waiting for the host: the part of each
    /// interval after the device reached the previous mark and before the host had queued
    /// this one's work (an upper bound: a read-back inside the interval counts whole, as the
    /// host records the mark only after the device is done).
    pub host_bound_ms: f64,
    pub marks: usize,
}

/// A timeline mark: the phase it ends, when the host recorded it, and where the device's
/// queue stood then (`None` on the CPU, whose work is done when the host marks it).
struct Stamp {
    name: &'static str,
    /// The thread that marked it: its phases are the intervals between its own stamps.
    thread: std::thread::ThreadId,
    host: Instant,
    device: Option<Event>,
}

#[cfg(feature = "cuda")]
type Event = cudarc::driver::CudaEvent;
#[cfg(not(feature = "cuda"))]
type Event = std::convert::Infallible;

struct Clock {
    last: Option<Instant>,
    totals: Vec<PhaseTotal>,
    stamps: Vec<Stamp>,
}

static CLOCK: Mutex<Clock> = Mutex::new(Clock {
    last: None,
    totals: Vec::new(),
    stamps: Vec::new(),
});

fn clock() -> std::sync::MutexGuard<'static, Clock> {
    CLOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn set_mode(mode: u8) {
    MODE.store(mode, Ordering::Relaxed);
    let mut c = clock();
    c.last = None;
    c.totals.clear();
    c.stamps.clear();
}

/// Turns the closed marks on or off and clears what was recorded.
pub fn set_enabled(on: bool) {
    set_mode(if on { CLOSED } else { OFF });
}

/// Turns the timeline on or off and clears what was recorded.
pub fn set_timeline(on: bool) {
    set_mode(if on { TIMELINE } else { OFF });
}

/// Closes the phase `name`: closed, the device's queued work finishes, and the time since the
/// previous mark (or since [`set_enabled`]) is added to `name`'s total; on a timeline, the
/// device's queue and the host's clock are stamped. A failed synchronisation or event is left
/// to the next real operation to report.
pub fn mark(name: &'static str, device: &Device) {
    match MODE.load(Ordering::Relaxed) {
        CLOSED => close(name, device),
        TIMELINE => stamp(name, device),
        _ => {}
    }
}

fn close(name: &'static str, device: &Device) {
    let _ = device.synchronize();
    let now = Instant::now();
    let mut c = clock();
    if let Some(last) = c.last {
        let ms = (now - last).as_secs_f64() * 1e3;
        match c.totals.iter_mut().find(|t| t.0 == name) {
            Some(t) => {
                t.1 += ms;
                t.2 += 1;
            }
            None => c.totals.push((name, ms, 1)),
        }
    }
    c.last = Some(now);
}

fn stamp(name: &'static str, device: &Device) {
    let mut c = clock();
    // The first stamp starts from an idle device, so that the device's clock and the host's
    // start together.
    if c.stamps.is_empty() {
        let _ = device.synchronize();
    }
    let Ok(event) = device_event(device) else {
        return;
    };
    c.stamps.push(Stamp {
        name,
        thread: std::thread::current().id(),
        host: Instant::now(),
        device: event,
    });
}

#[cfg(feature = "cuda")]
fn device_event(device: &Device) -> candle_core::Result<Option<Event>> {
    match device {
        Device::Cuda(dev) => crate::kernels::cuda::timed_event(dev).map(Some),
        _ => Ok(None),
    }
}

#[cfg(not(feature = "cuda"))]
fn device_event(_: &Device) -> candle_core::Result<Option<Event>> {
    Ok(None)
}

/// Milliseconds from `a` to `b` on the device, where both were recorded there.
#[cfg(feature = "cuda")]
fn device_ms(a: &Event, b: &Event) -> Option<f64> {
    a.elapsed_ms(b).ok().map(f64::from)
}

#[cfg(not(feature = "cuda"))]
fn device_ms(a: &Event, _: &Event) -> Option<f64> {
    match *a {}
}

/// The totals recorded since the last call, in the order the phases first closed.
pub fn take() -> Vec<PhaseTotal> {
    let mut c = clock();
    c.last = None;
    std::mem::take(&mut c.totals)
}

/// The timeline recorded since the last call, per phase in the order the phases first ended,
/// after waiting for `device` to finish its work. Empty without two stamps.
pub fn take_timeline(device: &Device) -> Vec<TimelineTotal> {
    let _ = device.synchronize();
    let stamps = std::mem::take(&mut clock().stamps);
    let Some(first) = stamps.first() else {
        return Vec::new();
    };
    // Each stamp's time on both clocks, in milliseconds from the first.
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    let times: Vec<(f64, f64)> = stamps
        .iter()
        .map(|s| {
            let host = ms(first.host, s.host);
            let device = match (&first.device, &s.device) {
                (Some(a), Some(b)) => device_ms(a, b).unwrap_or(host),
                _ => host,
            };
            // The device cannot pass a stamp before the host records it.
            (host, device.max(host))
        })
        .collect();
    let named: Vec<_> = stamps
        .iter()
        .zip(times)
        .map(|(s, (h, g))| (s.thread, s.name, h, g))
        .collect();
    timeline_totals(&named)
}

/// Per phase, from each stamp's thread, name and times on the host's clock and the device's
/// (in milliseconds from the first stamp): see [`TimelineTotal`]. A phase is the interval
/// from the same thread's stamp before (other threads' work, a streamed target's loader say,
/// is queued beside it, not in it).
fn timeline_totals<T: Copy + PartialEq>(
    stamps: &[(T, &'static str, f64, f64)],
) -> Vec<TimelineTotal> {
    let mut totals: Vec<TimelineTotal> = Vec::new();
    // Each thread's stamp before.
    let mut last: Vec<(T, f64, f64)> = Vec::new();
    for &(thread, name, h1, g1) in stamps {
        let before = match last.iter_mut().find(|l| l.0 == thread) {
            Some(l) => std::mem::replace(l, (thread, h1, g1)),
            None => {
                last.push((thread, h1, g1));
                continue;
            }
        };
        let (_, h0, g0) = before;
        let device_ms = g1 - g0;
        let at = match totals.iter().position(|t| t.name == name) {
            Some(at) => at,
            None => {
                totals.push(TimelineTotal {
                    name,
                    device_ms: 0.0,
                    host_ms: 0.0,
                    lag_ms: 0.0,
                    host_bound_ms: 0.0,
                    marks: 0,
                });
                totals.len() - 1
            }
        };
        let t = &mut totals[at];
        t.device_ms += device_ms;
        t.host_ms += h1 - h0;
        t.lag_ms += g1 - h1;
        t.host_bound_ms += (h1 - g0).clamp(0.0, device_ms);
        t.marks += 1;
    }
    totals
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_add_up_per_name_only_when_enabled() {
        let _turn = TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
        let dev = Device::Cpu;
        set_enabled(false);
        mark("a", &dev);
        mark("a", &dev);
        assert!(take().is_empty());
        set_enabled(true);
        mark("start", &dev); // opens the clock: nothing before it to time
        std::thread::sleep(std::time::Duration::from_millis(2));
        mark("a", &dev);
        mark("b", &dev);
        mark("a", &dev);
        let t = take();
        set_enabled(false);
        // Other tests' forwards may mark their own phases meanwhile: only ours are counted.
        let ours: Vec<_> = t.iter().filter(|x| x.0 == "a" || x.0 == "b").collect();
        assert_eq!(
            ours.iter().map(|x| (x.0, x.2)).collect::<Vec<_>>(),
            [("a", 2), ("b", 1)]
        );
        assert!(ours[0].1 > 0.0, "{t:?}");
    }

    #[test]
    fn a_timeline_on_the_cpu_times_each_phase_by_the_host_and_synchronises_nothing() {
        let _turn = TEST_TURN.lock().unwrap_or_else(|p| p.into_inner());
        let dev = Device::Cpu;
        set_timeline(true);
        mark("start", &dev);
        std::thread::sleep(std::time::Duration::from_millis(2));
        mark("a", &dev);
        mark("b", &dev);
        mark("a", &dev);
        // Closed marks' totals stay empty on a timeline.
        assert!(take().is_empty());
        let t = take_timeline(&dev);
        set_timeline(false);
        let ours: Vec<_> = t
            .iter()
            .filter(|x| x.name == "a" || x.name == "b")
            .collect();
        assert_eq!(
            ours.iter().map(|x| (x.name, x.marks)).collect::<Vec<_>>(),
            [("a", 2), ("b", 1)]
        );
        // Other tests' forwards may stamp their own phases meanwhile, on their own threads:
        // ours are the intervals between our stamps. On the CPU every phase's device time is
        // its host time.
        assert!(ours[0].host_ms >= 2.0, "{t:?}");
        for x in &t {
            assert_eq!((x.device_ms, x.lag_ms), (x.host_ms, 0.0), "{t:?}");
        }
        assert!(take_timeline(&dev).is_empty());
    }

    #[test]
    fn the_timeline_splits_device_time_by_how_far_the_device_lagged_the_host() {
        // The host queues "layers" fast and the device follows 4 ms behind; then the host
        // waits for a read-back (its mark lands as the device finishes); then the host decides
        // for 3 ms while the device has nothing queued.
        // Another thread's stamps between them are its own phases.
        let stamps = [
            (0, "start", 0.0, 0.0),
            (1, "other", 0.5, 0.5),
            (0, "layers", 1.0, 5.0),
            (1, "other", 1.5, 9.0),
            (0, "read-back", 6.0, 6.0),
            (0, "deciding", 9.0, 9.5),
        ];
        let t = timeline_totals(&stamps);
        let by = |n: &str| t.iter().find(|x| x.name == n).unwrap().clone();
        let layers = by("layers");
        assert_eq!(
            (
                layers.device_ms,
                layers.host_ms,
                layers.lag_ms,
                layers.host_bound_ms
            ),
            (5.0, 1.0, 4.0, 1.0)
        );
        let read = by("read-back");
        assert_eq!(
            (read.device_ms, read.lag_ms, read.host_bound_ms),
            (1.0, 0.0, 1.0)
        );
        // The device reached "read-back" at 6 and the host queued the next work by 9: all
        // but the last 0.5 ms could have been the device waiting.
        let deciding = by("deciding");
        assert_eq!(
            (deciding.device_ms, deciding.lag_ms, deciding.host_bound_ms),
            (3.5, 0.5, 3.0)
        );
        let other = by("other");
        assert_eq!((other.device_ms, other.host_ms, other.marks), (8.5, 1.0, 1));
        assert_eq!(t.iter().map(|x| x.marks).sum::<usize>(), 4);
    }
}
