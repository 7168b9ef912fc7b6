//! `.npy` (format versions 1.0, 2.0, 3.0) and `.npz` (a zip of `.npy`, stored or deflated).
//!
//! Format: numpy/lib/format.py. The header is a Python dict literal
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`, parsed here by a small
//! literal reader (never evaluated). Object arrays (`|O`) would need pickle and are refused.
//!
//! Why not the `npyz` crate (evaluated at 0.9.1, issue 14 item 8): it cannot keep our size
//! limits, because it allocates what a header declares before anything checks it against the
//! file. `header::read_header` does `vec![0; header_size]` with the u32 length of a v2/v3
//! header (4 GiB from a 12-byte file); `NpyHeader::from_parts` multiplies the shape unchecked
//! (`shape.iter().product()`: a panic in debug builds, a wrapped small count in release, so a
//! hostile shape passes as a tiny array); and `into_vec` collects an iterator whose exact
//! `size_hint` is that product, so a 1 TB declaration is reserved before one element is read.
//! Wrapping it would mean parsing the header ourselves first, which is all this module does.
//! It also reads `<V2` (ml_dtypes' bfloat16) only as raw bytes, parses headers as UTF-8 where
//! v1/v2 are latin-1, and its `npz` feature pulls zip 0.6 beside our zip 9. (No C builds: its
//! header parser is `py_literal` on `pest`.)

use std::io::{Read, Seek};
use std::path::Path;
use std::sync::Arc;

use super::tensor::{DType, HostTensor, checked_nbytes, strided_view};
use super::torch::{read_member, zip_error};
use super::{Limits, ReadError};

const MAGIC: &[u8] = b"\x93NUMPY";

/// Reads an `.npy` file.
pub fn read_npy(path: &Path, limits: &Limits) -> Result<HostTensor, ReadError> {
    Ok(read_npy_noted(path, limits)?.0)
}

/// Reads an `.npy` file; the strings are notes about how it was read (e.g. `<V2` as bf16).
pub(crate) fn read_npy_noted(
    path: &Path,
    limits: &Limits,
) -> Result<(HostTensor, Vec<String>), ReadError> {
    let bytes = super::read_file(path, limits.max_file_bytes)?;
    npy_from_bytes(path, "header", Arc::new(bytes), limits)
}

/// Reads every array of an `.npz`, in archive order, named without the `.npy` suffix.
pub fn read_npz(path: &Path, limits: &Limits) -> Result<Vec<(String, HostTensor)>, ReadError> {
    Ok(read_npz_noted(path, limits)?.0)
}

pub(crate) type Named = Vec<(String, HostTensor)>;

pub(crate) fn read_npz_noted(
    path: &Path,
    limits: &Limits,
) -> Result<(Named, Vec<String>), ReadError> {
    let f = std::fs::File::open(path).map_err(|error| ReadError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    let len = f
        .metadata()
        .map_err(|error| ReadError::Io {
            path: path.to_path_buf(),
            error,
        })?
        .len();
    npz_from_reader(path, std::io::BufReader::new(f), len, limits)
}

pub(crate) fn npz_from_reader<R: Read + Seek>(
    path: &Path,
    reader: R,
    archive_len: u64,
    limits: &Limits,
) -> Result<(Named, Vec<String>), ReadError> {
    let mut archive = zip::ZipArchive::new(reader).map_err(|e| zip_error(path, e))?;
    let mut out = Vec::new();
    let mut notes = Vec::new();
    for i in 0..archive.len() {
        let name = match archive.name_for_index(i) {
            Some(Ok(n)) => n.into_owned(),
            _ => {
                return Err(ReadError::Format {
                    path: path.to_path_buf(),
                    detail: format!("npz member {i} has an unreadable name"),
                });
            }
        };
        if name.ends_with('/') {
            continue;
        }
        let bytes = read_member(
            path,
            &mut archive,
            i,
            limits.max_file_bytes,
            archive_len,
            limits,
        )?;
        let what = format!("member {name} header");
        let (t, n) = npy_from_bytes(path, &what, Arc::new(bytes), limits)?;
        notes.extend(n.into_iter().map(|n| format!("{name}: {n}")));
        let key = name.strip_suffix(".npy").unwrap_or(&name).to_string();
        out.push((key, t));
    }
    Ok((out, notes))
}

/// Parses an `.npy` held in `bytes`; `what` names it in errors ("header", "member x.npy header").
pub(crate) fn npy_from_bytes(
    path: &Path,
    what: &str,
    bytes: Arc<Vec<u8>>,
    limits: &Limits,
) -> Result<(HostTensor, Vec<String>), ReadError> {
    let bad = |detail: String| ReadError::Format {
        path: path.to_path_buf(),
        detail: format!("{what}: {detail}"),
    };
    if bytes.get(..6) != Some(MAGIC) {
        return Err(bad(format!(
            "not an .npy (starts with {:02x?}, expected \\x93NUMPY)",
            bytes.get(..6.min(bytes.len())).unwrap_or(&[])
        )));
    }
    let (major, minor) = match bytes.get(6..8) {
        Some(&[a, b]) => (a, b),
        _ => return Err(bad("file ends inside the version".into())),
    };
    let (hlen, hstart) = match major {
        1 => match bytes.get(8..10) {
            Some(&[a, b]) => (usize::from(u16::from_le_bytes([a, b])), 10usize),
            _ => return Err(bad("file ends inside the header length".into())),
        },
        2 | 3 => match bytes.get(8..12) {
            Some(&[a, b, c, d]) => (u32::from_le_bytes([a, b, c, d]) as usize, 12usize),
            _ => return Err(bad("file ends inside the header length".into())),
        },
        _ => return Err(bad(format!("unknown .npy format version {major}.{minor}"))),
    };
    if hlen > limits.max_header_bytes {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            what: format!("{what} of {hlen} bytes"),
            limit: limits.max_header_bytes,
        });
    }
    let data_start = hstart + hlen;
    let header = bytes.get(hstart..data_start).ok_or_else(|| {
        bad(format!(
            "header of {hlen} bytes runs past the end of the file ({} bytes)",
            bytes.len()
        ))
    })?;
    // v1/v2 headers are latin-1, v3 UTF-8; the keys and values we accept are ASCII.
    let text: String = header.iter().map(|&b| b as char).collect();
    let h = parse_header(&text).map_err(|e| bad(format!("cannot parse {text:?}: {e}")))?;
    let mut notes = Vec::new();
    let dtype = match h.descr.as_str() {
        "<f4" => DType::F32,
        "<f2" => DType::F16,
        "<f8" => DType::F64,
        "<i8" => DType::I64,
        "<i4" => DType::I32,
        "<i2" => DType::I16,
        "|i1" | "<i1" => DType::I8,
        "|u1" | "<u1" => DType::U8,
        "|b1" | "<b1" => DType::Bool,
        "<V2" | "|V2" if limits.npy_void2_as_bf16 => {
            notes.push(format!(
                "descr {:?} (2-byte void) read as bfloat16, which is how numpy saves ml_dtypes.bfloat16",
                h.descr
            ));
            DType::BF16
        }
        other => {
            let why = if other.starts_with('>') {
                " (big-endian)"
            } else if other.contains('O') {
                " (object arrays need pickle)"
            } else {
                ""
            };
            return Err(ReadError::UnsupportedDtype {
                path: path.to_path_buf(),
                what: what.to_string(),
                dtype: format!("{other:?}{why}"),
            });
        }
    };
    let shape: Vec<usize> = match h.shape.iter().map(|&d| usize::try_from(d).ok()).collect() {
        Some(s) => s,
        None => {
            return Err(ReadError::ShapeOverflow {
                path: path.to_path_buf(),
                what: what.to_string(),
                shape: h.shape.clone(),
            });
        }
    };
    let nbytes = checked_nbytes(dtype, &shape).ok_or_else(|| ReadError::ShapeOverflow {
        path: path.to_path_buf(),
        what: what.to_string(),
        shape: h.shape.clone(),
    })?;
    let got = bytes.len() - data_start;
    if got != nbytes {
        return Err(ReadError::SizeMismatch {
            path: path.to_path_buf(),
            what: what.to_string(),
            dtype,
            shape,
            expected: nbytes,
            got,
            holder: "the file",
        });
    }
    let tensor_err = |error| ReadError::Tensor {
        path: path.to_path_buf(),
        what: what.to_string(),
        error,
    };
    let t = if h.fortran_order && shape.len() > 1 {
        // Column-major: element (i0, i1, ..) sits at i0 + d0*(i1 + d1*(..)).
        let mut strides = Vec::with_capacity(shape.len());
        let mut acc = 1i64;
        for &d in &shape {
            strides.push(acc);
            acc = acc.saturating_mul(d as i64);
        }
        let data = Arc::new(bytes.get(data_start..).unwrap_or(&[]).to_vec());
        let mut budget = limits.max_view_copy_bytes;
        strided_view(dtype, &data, 0, &shape, &strides, &mut budget).map_err(tensor_err)?
    } else {
        HostTensor::from_shared(dtype, shape, bytes, data_start).map_err(tensor_err)?
    };
    Ok((t, notes))
}

#[derive(Debug, Default, PartialEq)]
struct Header {
    descr: String,
    fortran_order: bool,
    shape: Vec<u64>,
}

/// Parses the header dict literal: string keys; values a string, `True`/`False`, or a tuple
/// of non-negative integers.
fn parse_header(s: &str) -> Result<Header, String> {
    let mut p = Lit {
        s: s.as_bytes(),
        i: 0,
    };
    let mut h = Header::default();
    let (mut has_descr, mut has_order, mut has_shape) = (false, false, false);
    p.expect(b'{')?;
    loop {
        p.ws();
        if p.eat(b'}') {
            break;
        }
        let key = p.string()?;
        p.ws();
        p.expect(b':')?;
        p.ws();
        match key.as_str() {
            "descr" => {
                if p.peek() == Some(b'[') {
                    return Err("structured dtypes (a list descr) are not supported".into());
                }
                h.descr = p.string()?;
                has_descr = true;
            }
            "fortran_order" => {
                h.fortran_order = p.boolean()?;
                has_order = true;
            }
            "shape" => {
                h.shape = p.int_tuple()?;
                has_shape = true;
            }
            other => return Err(format!("unexpected key {other:?}")),
        }
        p.ws();
        if !p.eat(b',') {
            p.ws();
            p.expect(b'}')?;
            break;
        }
    }
    if !(has_descr && has_order && has_shape) {
        return Err("missing one of 'descr', 'fortran_order', 'shape'".into());
    }
    Ok(h)
}

struct Lit<'a> {
    s: &'a [u8],
    i: usize,
}

impl Lit<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        self.ws();
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected {:?} at byte {}", c as char, self.i))
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let q = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return Err(format!("expected a quoted string at byte {}", self.i)),
        };
        self.i += 1;
        let start = self.i;
        while let Some(c) = self.peek() {
            if c == q {
                let v = String::from_utf8_lossy(self.s.get(start..self.i).unwrap_or(&[]));
                self.i += 1;
                return Ok(v.into_owned());
            }
            if c == b'\\' {
                return Err("escapes in header strings are not supported".into());
            }
            self.i += 1;
        }
        Err("unterminated string".into())
    }

    fn boolean(&mut self) -> Result<bool, String> {
        let rest = self.s.get(self.i..).unwrap_or(&[]);
        if rest.starts_with(b"True") {
            self.i += 4;
            Ok(true)
        } else if rest.starts_with(b"False") {
            self.i += 5;
            Ok(false)
        } else {
            Err(format!("expected True or False at byte {}", self.i))
        }
    }

    fn int_tuple(&mut self) -> Result<Vec<u64>, String> {
        self.expect(b'(')?;
        let mut out = Vec::new();
        loop {
            self.ws();
            if self.eat(b')') {
                return Ok(out);
            }
            let start = self.i;
            while self.peek().is_some_and(|c| c.is_ascii_digit()) {
                self.i += 1;
            }
            let digits = std::str::from_utf8(self.s.get(start..self.i).unwrap_or(&[]))
                .map_err(|e| e.to_string())?;
            if digits.is_empty() {
                return Err(format!("expected a dimension at byte {start}"));
            }
            // Python 2 headers write longs as `3L`.
            self.eat(b'L');
            out.push(
                digits
                    .parse::<u64>()
                    .map_err(|_| format!("dimension {digits} does not fit 64 bits"))?,
            );
            if out.len() > 64 {
                return Err("more than 64 dimensions".into());
            }
            self.ws();
            if !self.eat(b',') {
                self.expect(b')')?;
                return Ok(out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_numpy_headers() {
        let h = parse_header("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }   \n")
            .unwrap();
        assert_eq!(h.descr, "<f4");
        assert!(!h.fortran_order);
        assert_eq!(h.shape, vec![3, 4]);
        assert_eq!(
            parse_header("{'descr': '<i8', 'fortran_order': True, 'shape': (5,)}")
                .unwrap()
                .shape,
            vec![5]
        );
        assert_eq!(
            parse_header("{'descr':'|b1','fortran_order':False,'shape':()}")
                .unwrap()
                .shape,
            Vec::<u64>::new()
        );
        assert_eq!(
            parse_header("{'descr': '<f4', 'fortran_order': False, 'shape': (3L, 4L), }")
                .unwrap()
                .shape,
            vec![3, 4]
        );
    }

    #[test]
    fn refuses_odd_headers() {
        for h in [
            "",
            "{",
            "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,)}",
            "{'descr': '<f4', 'fortran_order': False}",
            "{'descr': '<f4', 'fortran_order': Maybe, 'shape': (1,)}",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,)}",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'extra': 1}",
            "{'descr': '<f4\\', 'fortran_order': False, 'shape': (1,)}",
        ] {
            assert!(parse_header(h).is_err(), "{h:?} should be refused");
        }
    }

    #[test]
    fn npy_in_memory_roundtrip_and_truncation() {
        let hdr = "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }";
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&[1, 0]);
        b.extend_from_slice(&(hdr.len() as u16).to_le_bytes());
        b.extend_from_slice(hdr.as_bytes());
        b.extend_from_slice(&7i32.to_le_bytes());
        b.extend_from_slice(&(-8i32).to_le_bytes());
        let lim = Limits::default();
        let p = Path::new("m.npy");
        let (t, _) = npy_from_bytes(p, "header", Arc::new(b.clone()), &lim).unwrap();
        assert_eq!(t.to_i64_vec().unwrap(), vec![7, -8]);
        for n in 0..b.len() {
            assert!(npy_from_bytes(p, "header", Arc::new(b[..n].to_vec()), &lim).is_err());
        }
    }
}
