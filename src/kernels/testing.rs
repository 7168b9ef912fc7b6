//! Helpers for the kernel tests: seeded random inputs (never zero), the llm.c-style comparison
//! (`|got - want| <= atol + rtol * |want|`, reporting the worst element), the CUDA device
//! the device tests run on, or a visible skip; and, for any test, rayon's global pool held as
//! the capture reader holds it ([`hold_the_global_pool`]).

use candle_core::{DType, Device, Tensor};

/// A seeded xorshift stream of values in [-1, 1) with |v| >= 1/64: zeros would hide a kernel
/// that forgets to read an input, and tiny values make relative errors meaningless.
pub fn random_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let v = 2.0 * u - 1.0;
            if v.abs() < 1.0 / 64.0 {
                v.signum() * (1.0 / 64.0 + v.abs())
            } else {
                v
            }
        })
        .collect()
}

/// A `[rows, cols]`-shaped (or any shape) tensor of [`random_vec`] values in `dtype`.
pub fn random(shape: &[usize], dtype: DType, seed: u64, device: &Device) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(random_vec(n, seed), shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(device))
        .expect("random tensor")
}

/// Every element of `t` as f32, row-major.
pub fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("tensor values")
}

/// Fails unless every `|got - want| <= atol + rtol * |want|`; NaN or Inf in `got` where `want`
/// is finite always fails. The message names the worst element, both values and the share of
/// the tolerance it used.
#[track_caller]
pub fn assert_close(got: &[f32], want: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0usize, 0f32); // (index, share of tolerance used)
    let mut non_finite = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() && g.is_nan() {
            continue;
        }
        if !g.is_finite() && w.is_finite() {
            non_finite += 1;
            if non_finite == 1 {
                worst = (i, f32::INFINITY);
            }
            continue;
        }
        let diff = (g - w).abs();
        let share = if diff == 0.0 {
            0.0
        } else {
            diff / (atol + rtol * w.abs())
        };
        if share.is_nan() || share > worst.1 {
            worst = (i, share);
        }
    }
    let (i, share) = worst;
    assert!(
        share <= 1.0 && non_finite == 0,
        "{what}: element {i}: got {} want {} ({share:.2}x the tolerance atol {atol} rtol {rtol}); \
         {non_finite} non-finite where finite was expected",
        got[i],
        want[i]
    );
}

/// The CUDA device the device tests run on. The device tests are compiled only with
/// `--features cuda` (CI's `cargo test` never builds them, so its count holds none of them);
/// a CUDA test binary run where there is no device fails them, naming why, rather than
/// counting them as passed.
#[cfg(feature = "cuda")]
pub fn gpu() -> Device {
    assert!(
        crate::kernels::cuda::device_available(),
        "needs a CUDA device: this --features cuda test found no driver or no device"
    );
    Device::new_cuda(0).expect("CUDA device 0")
}

/// [`gpu`] in the form the device tests of `attention.rs` and `moe.rs` still take (never
/// `None`: without a device it fails as [`gpu`] does).
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Option<Device> {
    Some(gpu())
}

#[test]
fn random_values_are_never_small() {
    let v = random_vec(10_000, 7);
    assert!(
        v.iter()
            .all(|x| x.abs() >= 1.0 / 64.0 && x.abs() < 1.0 + 1.0 / 64.0)
    );
    assert_ne!(random_vec(4, 1), random_vec(4, 2));
}

#[test]
#[should_panic(expected = "element 1")]
fn assert_close_names_the_worst_element() {
    assert_close(&[1.0, 2.5, 3.0], &[1.0, 2.0, 3.01], 0.0, 0.01, "planted");
}

/// Every thread of rayon's global pool held by a job that ends when the returned guard drops:
/// the global pool as the capture reader's long file jobs hold it during a diff. Work queued
/// there meanwhile waits for the guard.
pub fn hold_the_global_pool() -> PoolHold {
    use std::sync::{Arc, Condvar, Mutex};
    // One hold at a time: two tests holding it together would each wait for threads the
    // other's jobs have.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let threads = rayon::current_num_threads();
    // (jobs started, released)
    let gate = Arc::new((Mutex::new((0usize, false)), Condvar::new()));
    for _ in 0..threads {
        let gate = gate.clone();
        rayon::spawn(move || {
            let (state, changed) = &*gate;
            let mut s = state.lock().unwrap();
            s.0 += 1;
            changed.notify_all();
            while !s.1 {
                s = changed.wait(s).unwrap();
            }
        });
    }
    {
        let (state, changed) = &*gate;
        let mut s = state.lock().unwrap();
        while s.0 < threads {
            s = changed.wait(s).unwrap();
        }
    }
    PoolHold { gate, _turn: turn }
}

/// See [`hold_the_global_pool`].
pub struct PoolHold {
    gate: std::sync::Arc<(std::sync::Mutex<(usize, bool)>, std::sync::Condvar)>,
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl Drop for PoolHold {
    fn drop(&mut self) {
        let (state, changed) = &*self.gate;
        state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        changed.notify_all();
    }
}

/// `f` on a thread of its own: its result, or `None` if it takes longer than `limit` (the
/// thread is then left to end when it can).
pub fn within<T: Send + 'static>(
    limit: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (done, result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    result.recv_timeout(limit).ok()
}
