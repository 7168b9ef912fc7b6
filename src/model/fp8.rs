//! FP8 block dequantisation as DeepSeek-V3 checkpoints need it: `w = fp8 * scale_inv`, one
//! scale per 128x128 block (`quantization_config.weight_block_size`), edge blocks partial.
//! Reference: DeepSeek-V3 `inference/kernel.py` `weight_dequant` (used by `fp8_cast_bf16.py`):
//! block (i, j) covers rows `i*B..(i+1)*B` and columns `j*B..(j+1)*B`, cropped at the edges.
//! Checked against PyTorch by `tests/deepseek.rs` on `fixtures/fp8/` (made by `gen_fp8.py`).

use candle_core::{DType, Result, Tensor};

/// DeepSeek-V3/R1 and Kimi-K2 all ship `weight_block_size: [128, 128]`.
pub const DEFAULT_BLOCK: usize = 128;

/// The block edge along one axis of `len` elements split into `blocks` scales.
///
/// The scale grid alone does not fix the block: 300 rows in 3 blocks are tiled by any block
/// of 100..=149 rows, and each puts the block edges elsewhere. So 128 is taken whenever it fits
/// (every known checkpoint), a single block covers the whole axis, and otherwise the size is
/// inferred only when exactly one fits; anything else is refused rather than guessed.
fn axis_block(len: usize, blocks: usize, axis: &str) -> Result<usize> {
    if blocks == 0 {
        candle_core::bail!("fp8 scale grid has no {axis} blocks");
    }
    if len.div_ceil(DEFAULT_BLOCK) == blocks {
        return Ok(DEFAULT_BLOCK);
    }
    if blocks == 1 {
        return Ok(len.max(1));
    }
    // b tiles `len` in `blocks` blocks iff (blocks - 1) * b < len <= blocks * b.
    let min = len.div_ceil(blocks);
    let max = len.saturating_sub(1) / (blocks - 1);
    match min.cmp(&max) {
        std::cmp::Ordering::Equal => Ok(min),
        std::cmp::Ordering::Greater => {
            candle_core::bail!("{blocks} {axis} scales cannot tile {len} {axis}")
        }
        std::cmp::Ordering::Less => candle_core::bail!(
            "fp8 block size is ambiguous: {blocks} {axis} scales over {len} {axis} fit any \
             block of {min}..={max}, and not {DEFAULT_BLOCK}; pass weight_block_size explicitly"
        ),
    }
}

/// The `[rows, cols]` block size a scale grid implies (see [`axis_block`]).
pub fn infer_block(weight: (usize, usize), scale_inv: (usize, usize)) -> Result<[usize; 2]> {
    Ok([
        axis_block(weight.0, scale_inv.0, "rows")?,
        axis_block(weight.1, scale_inv.1, "columns")?,
    ])
}

/// `weight`: [rows, cols] (F8E4M3 or any float); `scale_inv`: [ceil(rows/128), ceil(cols/128)].
/// The block size is inferred by [`infer_block`]. Returns f32 [rows, cols].
pub fn dequantize_blocks(weight: &Tensor, scale_inv: &Tensor) -> Result<Tensor> {
    let block = infer_block(weight.dims2()?, scale_inv.dims2()?)?;
    dequantize_blocks_with(weight, scale_inv, block)
}

/// Like [`dequantize_blocks`] with the block size given (`weight_block_size`, [rows, cols]).
pub fn dequantize_blocks_with(
    weight: &Tensor,
    scale_inv: &Tensor,
    block: [usize; 2],
) -> Result<Tensor> {
    let (rows, cols) = weight.dims2()?;
    let (sr, sc) = scale_inv.dims2()?;
    let [br, bc] = block;
    if br == 0 || bc == 0 {
        candle_core::bail!("fp8 block size {br}x{bc} must be positive");
    }
    if rows.div_ceil(br) != sr || cols.div_ceil(bc) != sc {
        candle_core::bail!(
            "scale_inv {sr}x{sc} does not tile a {rows}x{cols} weight in {br}x{bc} blocks \
             (expected {}x{})",
            rows.div_ceil(br),
            cols.div_ceil(bc)
        );
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn block_inference() {
        // DeepSeek-V3 kv_a_proj_with_mqa [576, 7168] -> scales [5, 56].
        assert_eq!(infer_block((576, 7168), (5, 56)).unwrap(), [128, 128]);
        // 300 rows in 3 blocks: 128, not ceil(300 / 3) = 100.
        assert_eq!(infer_block((300, 200), (3, 2)).unwrap(), [128, 128]);
        // One block per axis covers everything.
        assert_eq!(infer_block((64, 96), (1, 1)).unwrap(), [128, 128]);
        // 7 rows in 4 blocks: only 2 fits (and 128 does not).
        assert_eq!(infer_block((7, 8), (4, 1)).unwrap(), [2, 128]);
        assert!(infer_block((256, 64), (4, 1)).is_err()); // 64..=85 all fit
        assert!(infer_block((10, 64), (11, 1)).is_err()); // more scales than rows
    }

    #[test]
    fn edge_blocks_take_their_own_scale() {
        let w = Tensor::ones((130, 2), DType::F32, &Device::Cpu).unwrap();
        let s = Tensor::new(&[[2f32], [3f32]], &Device::Cpu).unwrap();
        let d = dequantize_blocks(&w, &s).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(d[127], vec![2.0, 2.0]);
        assert_eq!(d[128], vec![3.0, 3.0]);
        assert_eq!(d[129], vec![3.0, 3.0]);
    }
}
