//! FP8 block dequantisation as DeepSeek-V3 checkpoints need it: `w = fp8 * scale_inv`, one
//! scale per 128x128 block (`quantization_config.weight_block_size`), edge blocks partial.
//! Reference: DeepSeek-V3 `inference/fp8_cast_bf16.py` / `kernel.py` `weight_dequant`.

use candle_core::{DType, Result, Tensor};

/// `weight`: [rows, cols] (F8E4M3 or any float); `scale_inv`: [ceil(rows/br), ceil(cols/bc)].
/// The block size is implied by the two shapes. Returns f32 [rows, cols].
pub fn dequantize_blocks(weight: &Tensor, scale_inv: &Tensor) -> Result<Tensor> {
    let (rows, cols) = weight.dims2()?;
    let (sr, sc) = scale_inv.dims2()?;
    if sr == 0 || sc == 0 {
        candle_core::bail!("empty scale_inv {sr}x{sc}");
    }
    let br = rows.div_ceil(sr);
    let bc = cols.div_ceil(sc);
    if rows.div_ceil(br) != sr || cols.div_ceil(bc) != sc {
        candle_core::bail!("scale_inv {sr}x{sc} does not tile a {rows}x{cols} weight");
    }
    let w = weight.to_dtype(DType::F32)?;
    let s = scale_inv.to_dtype(DType::F32)?;
    // Expand every scale over its block, then crop the partial edge blocks.
    let s = s
        .unsqueeze(1)?
        .unsqueeze(3)?
        .broadcast_as((sr, br, sc, bc))?
        .reshape((sr * br, sc * bc))?
        .narrow(0, 0, rows)?
        .narrow(1, 0, cols)?;
    w.mul(&s)
}
