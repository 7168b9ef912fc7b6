//! The GGUF header (llama.cpp's format): the file mapped, its header parsed with candle's
//! reader, every tensor's extent checked, before anything is read. The GGUF target
//! ([`crate::model::gguf`]) and the tokenizer read it through here.

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::Content;
use memmap2::Mmap;
use std::io::Cursor;
use std::path::Path;

/// The smallest GGUF: magic, version, two counts.
const MIN_FILE_LEN: u64 = 4 + 4 + 8 + 8;

/// Maps the file and parses the header with candle's reader (the tokenizer reads its
/// metadata through here too).
pub fn read_header(path: &Path) -> Result<(Mmap, Content)> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len < MIN_FILE_LEN {
        return Err(too_short(path, len));
    }
    // SAFETY: mapped read-only; eagle-check never writes model files, and every read below is
    // bounds-checked against the mapping's length.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let content = parse_content(path, &mmap)?;
    Ok((mmap, content))
}

fn too_short(path: &Path, len: u64) -> Error {
    Error::weights(
        path,
        format!("{len} bytes is too short for a GGUF file (header alone is {MIN_FILE_LEN})"),
    )
}

/// Parses the header of a GGUF file held in `bytes` with candle's reader.
pub fn parse_content(path: &Path, bytes: &[u8]) -> Result<Content> {
    if (bytes.len() as u64) < MIN_FILE_LEN {
        return Err(too_short(path, bytes.len() as u64));
    }
    // candle's reader bounds every count and string by the file size, but divides by the
    // file's `general.alignment` unchecked; catch that (and any other panic on hostile input)
    // and report it as a bad file instead of aborting the run.
    let parsed = catch_quietly(|| Content::read(&mut Cursor::new(bytes)));
    let content = match parsed {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            return Err(Error::weights(
                path,
                format!(
                    "not a readable GGUF file: {}",
                    crate::error::candle_line(&e)
                ),
            ));
        }
        Err(_) => {
            return Err(Error::weights(
                path,
                "not a readable GGUF file: the header reader gave up (a zero general.alignment, or malformed counts)",
            ));
        }
    };
    Ok(content)
}

/// Every tensor's element count, byte size and extent, in checked arithmetic, before any read.
pub fn validate_tensor_extents(path: &Path, content: &Content, file_len: usize) -> Result<()> {
    for (name, info) in &content.tensor_infos {
        let dims = info.shape.dims();
        let bad = |msg: String| Error::weights(path, format!("GGUF tensor `{name}`: {msg}"));
        let elems = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
        let block = info.ggml_dtype.block_size();
        // ggml quantises along rows (the last HF dimension), one block never spans two rows.
        let row = dims.last().copied().unwrap_or(1);
        if block == 0 || row % block != 0 {
            return Err(bad(format!(
                "rows of {row} elements do not divide into {:?} blocks of {block}",
                info.ggml_dtype
            )));
        }
        let bytes = (elems / block)
            .checked_mul(info.ggml_dtype.type_size())
            .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
        let end = content
            .tensor_data_offset
            .checked_add(info.offset)
            .and_then(|start| start.checked_add(bytes as u64))
            .ok_or_else(|| bad(format!("offset {} overflows", info.offset)))?;
        if end > file_len as u64 {
            return Err(bad(format!(
                "data ends at byte {end}, past the end of the file ({file_len} bytes)"
            )));
        }
    }
    Ok(())
}

/// `catch_unwind` without the default hook's message on stderr: a hostile file must give one
/// line naming it, not a panic report. The hook is process-wide, so it is restored right after.
fn catch_quietly<R>(f: impl FnOnce() -> R + std::panic::UnwindSafe) -> std::thread::Result<R> {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(f);
    std::panic::set_hook(previous);
    result
}
