//! Where a forward's device time goes: named phases, each closed by synchronising the device
//! (so the time between two marks is the device time of the work queued between them, plus
//! one synchronisation). Off by default, when a mark costs one relaxed atomic load; the GPU
//! bench turns it on for one extra forward after its timed runs (`EAGLE_CHECK_PHASES=1`), so
//! the figures it reports as timings never carry the synchronisations.

use candle_core::Device;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Phase name, total milliseconds, how many marks closed it.
pub type PhaseTotal = (&'static str, f64, usize);

struct Clock {
    last: Option<Instant>,
    totals: Vec<PhaseTotal>,
}

static CLOCK: Mutex<Clock> = Mutex::new(Clock {
    last: None,
    totals: Vec::new(),
});

/// Turns the marks on or off and clears what was recorded.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
    let mut c = CLOCK.lock().unwrap_or_else(|p| p.into_inner());
    c.last = None;
    c.totals.clear();
}

/// Closes the phase `name`: the device's queued work finishes, and the time since the previous
/// mark (or since [`set_enabled`]) is added to `name`'s total. A failed synchronisation is
/// left to the next real operation to report.
pub fn mark(name: &'static str, device: &Device) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let _ = device.synchronize();
    let now = Instant::now();
    let mut c = CLOCK.lock().unwrap_or_else(|p| p.into_inner());
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

/// The totals recorded since the last call, in the order the phases first closed.
pub fn take() -> Vec<PhaseTotal> {
    let mut c = CLOCK.lock().unwrap_or_else(|p| p.into_inner());
    c.last = None;
    std::mem::take(&mut c.totals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_add_up_per_name_only_when_enabled() {
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
}
