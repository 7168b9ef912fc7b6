//! The one safetensors header parser: model weights ([`crate::weights::read_header`]) and
//! capture files ([`super::read_safetensors`]) both go through [`header_len`] and
//! [`parse_header`], so a file refused on one path is refused on the other, for the same reason.
//!
//! Layout: an 8-byte little-endian header length N, N bytes of JSON
//! `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}`, then the
//! data section. The checks are those of the safetensors crate's `Metadata::validate`
//! (safetensors/src/tensor.rs: header size limit, checked sizes, offsets inside the data,
//! `end - begin` equal to the byte count, known dtypes), plus two it does not make in the same
//! words: a name given twice is refused (serde_json would keep the last one silently) and no two
//! tensors may share bytes. Unlike the crate, holes between tensors are allowed (writers that pad
//! for alignment exist; a hole hides no tensor).

use std::collections::HashSet;
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::tensor::fmt_shape;

/// The safetensors crate's `MAX_HEADER_SIZE`: the default header limit.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Every dtype the safetensors format defines that eagle-check can size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StDtype {
    F64,
    F32,
    F16,
    BF16,
    F8E4M3,
    F8E5M2,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    Bool,
}

impl StDtype {
    const ALL: [StDtype; 15] = [
        StDtype::F64,
        StDtype::F32,
        StDtype::F16,
        StDtype::BF16,
        StDtype::F8E4M3,
        StDtype::F8E5M2,
        StDtype::I64,
        StDtype::I32,
        StDtype::I16,
        StDtype::I8,
        StDtype::U64,
        StDtype::U32,
        StDtype::U16,
        StDtype::U8,
        StDtype::Bool,
    ];

    /// The dtype as the header spells it (`F32`, `BF16`, `F8_E4M3`, `BOOL`, ...).
    pub fn name(self) -> &'static str {
        match self {
            StDtype::F64 => "F64",
            StDtype::F32 => "F32",
            StDtype::F16 => "F16",
            StDtype::BF16 => "BF16",
            StDtype::F8E4M3 => "F8_E4M3",
            StDtype::F8E5M2 => "F8_E5M2",
            StDtype::I64 => "I64",
            StDtype::I32 => "I32",
            StDtype::I16 => "I16",
            StDtype::I8 => "I8",
            StDtype::U64 => "U64",
            StDtype::U32 => "U32",
            StDtype::U16 => "U16",
            StDtype::U8 => "U8",
            StDtype::Bool => "BOOL",
        }
    }

    /// Parses a header's dtype string; `None` for one we do not know.
    pub fn parse(s: &str) -> Option<StDtype> {
        StDtype::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            StDtype::F64 | StDtype::I64 | StDtype::U64 => 8,
            StDtype::F32 | StDtype::I32 | StDtype::U32 => 4,
            StDtype::F16 | StDtype::BF16 | StDtype::I16 | StDtype::U16 => 2,
            StDtype::F8E4M3 | StDtype::F8E5M2 | StDtype::I8 | StDtype::U8 | StDtype::Bool => 1,
        }
    }
}

impl fmt::Display for StDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor of a validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    pub name: String,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    /// Byte range `[begin, end)` inside the data section; `end - begin` is the tensor's size.
    pub begin: usize,
    pub end: usize,
}

/// A validated header: tensors in data order (then by name), and `__metadata__` in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Header {
    pub entries: Vec<HeaderEntry>,
    pub metadata: Vec<(String, String)>,
}

/// Why a safetensors header was refused. The caller adds the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error(
        "{len} bytes is too short for a safetensors file (it starts with an 8-byte header length)"
    )]
    TooShort { len: u64 },
    #[error("safetensors header of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge { len: u64, limit: u64 },
    #[error("safetensors header of {len} bytes runs past the end of the file ({file_len} bytes)")]
    PastEnd { len: u64, file_len: u64 },
    #[error("safetensors header is not a JSON object: {detail}")]
    NotJson { detail: String },
    #[error("safetensors header names tensor {name} twice (JSON readers would keep the last)")]
    Duplicate { name: String },
    #[error("safetensors __metadata__ {detail}")]
    Metadata { detail: String },
    #[error("tensor {name}: malformed header entry: {detail}")]
    Entry { name: String, detail: String },
    #[error("tensor {name} has dtype {dtype:?}, which is not a safetensors dtype")]
    UnknownDtype { name: String, dtype: String },
    #[error("tensor {name} declares shape {shape:?}, whose size overflows")]
    Overflow { name: String, shape: Vec<u64> },
    #[error(
        "tensor {name}: data_offsets [{begin}, {end}] lie outside the {data_len} bytes of data"
    )]
    Outside {
        name: String,
        begin: u64,
        end: u64,
        data_len: u64,
    },
    #[error(
        "tensor {name} declares {} {dtype} ({expected} bytes) but its data_offsets [{begin}, {end}] hold {} bytes",
        fmt_shape(.shape), .end - .begin
    )]
    SizeMismatch {
        name: String,
        dtype: StDtype,
        shape: Vec<usize>,
        expected: u64,
        begin: u64,
        end: u64,
    },
    #[error(
        "tensors {first} [{}, {}] and {second} [{}, {}] overlap in the data section",
        .first_range.0, .first_range.1, .second_range.0, .second_range.1
    )]
    Overlap {
        first: String,
        first_range: (u64, u64),
        second: String,
        second_range: (u64, u64),
    },
}

/// The header length from the first bytes of a file of `file_len` bytes, checked against
/// `limit` and against the file before anything is allocated for it.
pub fn header_len(prefix: &[u8], file_len: u64, limit: u64) -> Result<usize, HeaderError> {
    let Some(b) = prefix.get(..8) else {
        return Err(HeaderError::TooShort { len: file_len });
    };
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    let len = u64::from_le_bytes(a);
    if len > limit {
        return Err(HeaderError::TooLarge { len, limit });
    }
    if len > file_len.saturating_sub(8) {
        return Err(HeaderError::PastEnd { len, file_len });
    }
    usize::try_from(len).map_err(|_| HeaderError::TooLarge { len, limit })
}

/// The raw entries of the header object, in file order, duplicates refused. Values stay raw
/// until looked at: parsing 94k entries through `serde_json::Value` costs 5x more.
struct RawEntries<'a>(Vec<(String, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for RawEntries<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawEntries<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                // The size hint comes from the input: cap it.
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0).min(4096));
                while let Some(key) = map.next_key::<String>()? {
                    let value: &'de RawValue = map.next_value()?;
                    out.push((key, value));
                }
                Ok(RawEntries(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Parses and validates header bytes against a data section of `data_len` bytes.
pub fn parse_header(header: &[u8], data_len: u64) -> Result<Header, HeaderError> {
    let raw: RawEntries = serde_json::from_slice(header).map_err(|e| HeaderError::NotJson {
        detail: e.to_string(),
    })?;
    let mut seen: HashSet<&str> = HashSet::with_capacity(raw.0.len());
    for (name, _) in &raw.0 {
        if !seen.insert(name.as_str()) {
            return Err(HeaderError::Duplicate { name: name.clone() });
        }
    }
    drop(seen);
    let mut out = Header::default();
    out.entries.reserve(raw.0.len());
    for (name, value) in raw.0 {
        if name == "__metadata__" {
            out.metadata = parse_metadata(value)?;
            continue;
        }
        out.entries.push(parse_entry(name, value, data_len)?);
    }
    out.entries
        .sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    // Sorted by start: a non-empty range overlaps an earlier one exactly when it starts before
    // the furthest end seen so far. Empty ranges hold no bytes and overlap nothing.
    let mut reach: Option<&HeaderEntry> = None;
    for e in out.entries.iter().filter(|e| e.end > e.begin) {
        if let Some(prev) = reach
            && e.begin < prev.end
        {
            return Err(HeaderError::Overlap {
                first: prev.name.clone(),
                first_range: (prev.begin as u64, prev.end as u64),
                second: e.name.clone(),
                second_range: (e.begin as u64, e.end as u64),
            });
        }
        if reach.is_none_or(|p| e.end > p.end) {
            reach = Some(e);
        }
    }
    Ok(out)
}

fn parse_metadata(value: &RawValue) -> Result<Vec<(String, String)>, HeaderError> {
    let bad = |detail: String| HeaderError::Metadata { detail };
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(value.get()).map_err(|e| bad(format!("is not a JSON object: {e}")))?;
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            other => Err(bad(format!("entry {k} is {other}, not a string"))),
        })
        .collect()
}

fn parse_entry(name: String, value: &RawValue, data_len: u64) -> Result<HeaderEntry, HeaderError> {
    let raw: RawEntry = match serde_json::from_str(value.get()) {
        Ok(r) => r,
        Err(e) => {
            return Err(HeaderError::Entry {
                name,
                detail: e.to_string(),
            });
        }
    };
    let Some(dtype) = StDtype::parse(&raw.dtype) else {
        return Err(HeaderError::UnknownDtype {
            name,
            dtype: raw.dtype,
        });
    };
    let expected = raw
        .shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| usize::try_from(n).is_ok());
    let Some(expected) = expected else {
        return Err(HeaderError::Overflow {
            name,
            shape: raw.shape,
        });
    };
    let (begin, end) = raw.data_offsets;
    if begin > end || end > data_len {
        return Err(HeaderError::Outside {
            name,
            begin,
            end,
            data_len,
        });
    }
    let Some(shape) = raw
        .shape
        .iter()
        .map(|&d| usize::try_from(d).ok())
        .collect::<Option<Vec<usize>>>()
    else {
        return Err(HeaderError::Overflow {
            name,
            shape: raw.shape,
        });
    };
    if end - begin != expected {
        return Err(HeaderError::SizeMismatch {
            name,
            dtype,
            shape,
            expected,
            begin,
            end,
        });
    }
    // Both are at most data_len, which is a length the caller holds in memory or on disk.
    let (Ok(begin), Ok(end)) = (usize::try_from(begin), usize::try_from(end)) else {
        return Err(HeaderError::Outside {
            name,
            begin,
            end,
            data_len,
        });
    };
    Ok(HeaderEntry {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(h: &str, data: u64) -> Result<Header, HeaderError> {
        parse_header(h.as_bytes(), data)
    }

    #[test]
    fn entries_come_back_in_data_order_with_metadata() {
        let h = parse(
            r#"{"b":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"a":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[8,12]},"__metadata__":{"format":"pt"}}"#,
            12,
        )
        .unwrap();
        let names: Vec<_> = h.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        assert_eq!(h.entries[1].dtype, StDtype::F8E4M3);
        assert_eq!(h.entries[1].shape, vec![2, 2]);
        assert_eq!(h.metadata, vec![("format".into(), "pt".into())]);
    }

    #[test]
    fn duplicate_names_are_refused() {
        let e = parse(
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
        )
        .unwrap_err();
        assert_eq!(e, HeaderError::Duplicate { name: "w".into() });
        // A key spelled with an escape is the same key.
        let e = parse(
            r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"\u0077":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
            2,
        )
        .unwrap_err();
        assert!(matches!(e, HeaderError::Duplicate { .. }), "{e}");
    }

    #[test]
    fn overlapping_ranges_are_refused_and_empty_or_holed_ones_are_not() {
        let e = parse(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            12,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensors a [0, 8] and b [4, 12] overlap in the data section"
        );
        // One range inside a longer one that started earlier.
        let e = parse(
            r#"{"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},"c":{"dtype":"U8","shape":[1],"data_offsets":[5,6]}}"#,
            10,
        )
        .unwrap_err();
        assert!(matches!(e, HeaderError::Overlap { .. }), "{e}");
        // The same bytes twice under two names.
        let e = parse(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            4,
        )
        .unwrap_err();
        assert!(matches!(e, HeaderError::Overlap { .. }), "{e}");
        parse(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"e":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}}"#,
            8,
        )
        .unwrap();
    }

    #[test]
    fn every_other_lie_is_refused_with_its_own_error() {
        type Check = fn(&HeaderError) -> bool;
        let cases: &[(&str, Check)] = &[
            ("", |e| matches!(e, HeaderError::NotJson { .. })),
            ("[]", |e| matches!(e, HeaderError::NotJson { .. })),
            ("{", |e| matches!(e, HeaderError::NotJson { .. })),
            (r#"{"__metadata__":{"k":1}}"#, |e| {
                matches!(e, HeaderError::Metadata { .. })
            }),
            (r#"{"__metadata__":[]}"#, |e| {
                matches!(e, HeaderError::Metadata { .. })
            }),
            (
                r#"{"x":{"dtype":"F7","shape":[1],"data_offsets":[0,4]}}"#,
                |e| matches!(e, HeaderError::UnknownDtype { .. }),
            ),
            (
                r#"{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
                |e| matches!(e, HeaderError::Entry { .. }),
            ),
            (r#"{"x":{"dtype":"F32","shape":[1]}}"#, |e| {
                matches!(e, HeaderError::Entry { .. })
            }),
            (
                r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#,
                |e| matches!(e, HeaderError::Entry { .. }),
            ),
            (r#"{"x":3}"#, |e| matches!(e, HeaderError::Entry { .. })),
            (
                r#"{"x":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}}"#,
                |e| matches!(e, HeaderError::Overflow { .. }),
            ),
            (
                r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
                |e| matches!(e, HeaderError::Outside { .. }),
            ),
            (
                r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
                |e| matches!(e, HeaderError::Outside { .. }),
            ),
            (
                r#"{"x":{"dtype":"F32","shape":[4096,4096],"data_offsets":[0,8]}}"#,
                |e| {
                    matches!(
                        e,
                        HeaderError::SizeMismatch {
                            expected: 67108864,
                            ..
                        }
                    )
                },
            ),
        ];
        for (h, check) in cases {
            let e = parse(h, 8).unwrap_err();
            assert!(check(&e), "{h}: {e:?}");
            assert!(!e.to_string().contains('\n'), "{e}");
        }
    }

    #[test]
    fn the_length_prefix_is_checked_before_anything_is_allocated() {
        assert_eq!(
            header_len(&[1, 0, 0], 3, MAX_HEADER_BYTES),
            Err(HeaderError::TooShort { len: 3 })
        );
        let huge = u64::MAX.to_le_bytes();
        assert!(matches!(
            header_len(&huge, 8, MAX_HEADER_BYTES),
            Err(HeaderError::TooLarge { .. })
        ));
        let past = 100u64.to_le_bytes();
        assert_eq!(
            header_len(&past, 50, MAX_HEADER_BYTES),
            Err(HeaderError::PastEnd {
                len: 100,
                file_len: 50
            })
        );
        assert_eq!(header_len(&past, 108, MAX_HEADER_BYTES), Ok(100));
    }
}
