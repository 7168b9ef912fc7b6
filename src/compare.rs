//! Numeric comparison of a computed tensor with a reference, llm.c-checker style.

use candle_core::{DType, Result, Tensor};
use serde::Serialize;

/// How far `got` is from `reference`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Closeness {
    /// `max |got - ref| / max |ref|`: the normwise relative error the parity targets use.
    pub max_rel: f64,
    pub max_abs: f64,
    /// Flat index of the worst element, with both values there.
    pub worst_index: usize,
    pub worst_got: f32,
    pub worst_ref: f32,
    /// NaN or Inf in `got` (counted apart, never averaged in).
    pub non_finite: usize,
}

pub fn closeness(got: &Tensor, reference: &Tensor) -> Result<Closeness> {
    if got.dims() != reference.dims() {
        candle_core::bail!("shape {:?} vs reference {:?}", got.dims(), reference.dims());
    }
    let a = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let r = reference
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let mut out = Closeness {
        max_rel: 0.0,
        max_abs: 0.0,
        worst_index: 0,
        worst_got: 0.0,
        worst_ref: 0.0,
        non_finite: 0,
    };
    let mut ref_max = 0f64;
    for (i, (&x, &y)) in a.iter().zip(&r).enumerate() {
        if !x.is_finite() {
            out.non_finite += 1;
            continue;
        }
        ref_max = ref_max.max((y as f64).abs());
        let d = (x as f64 - y as f64).abs();
        if d > out.max_abs {
            out.max_abs = d;
            out.worst_index = i;
            out.worst_got = x;
            out.worst_ref = y;
        }
    }
    out.max_rel = if ref_max > 0.0 {
        out.max_abs / ref_max
    } else {
        out.max_abs
    };
    Ok(out)
}
