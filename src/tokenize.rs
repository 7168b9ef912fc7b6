//! Text <-> token ids for the prompts eagle-check runs through a target: an HF `tokenizer.json`,
//! or the tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata; plus token-id files
//! (one id per line, or a 1-D integer `.npy`).
//!
//! Special tokens: [`Tokenizer::encode`] does what the model's own tokenizer does for
//! `tokenizer(text)` in transformers: a `tokenizer.json`'s post-processor decides (Llama 3 adds
//! `<|begin_of_text|>`, Qwen and SmolLM2 add nothing); a GGUF adds BOS / EOS exactly when
//! `tokenizer.ggml.add_bos_token` / `add_eos_token` say so. Captures are compared with engines
//! that tokenise the same way, so inventing a BOS the model does not use would shift every
//! position. [`Tokenizer::encode_plain`] never adds any.

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// A loaded tokenizer and where it came from.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    origin: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

fn tok_err(path: &Path, message: impl Into<String>) -> Error {
    Error::config(path, message)
}

impl Tokenizer {
    /// A `tokenizer.json`, a directory holding one, or a `.gguf` file.
    pub fn open(path: &Path) -> Result<Tokenizer> {
        if path.is_dir() {
            Tokenizer::from_json_file(&path.join("tokenizer.json"))
        } else if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            Tokenizer::from_gguf_file(path)
        } else {
            Tokenizer::from_json_file(path)
        }
    }

    /// An HF `tokenizer.json`.
    pub fn from_json_file(path: &Path) -> Result<Tokenizer> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| tok_err(path, format!("not a usable tokenizer.json: {e}")))?;
        Ok(Tokenizer {
            inner,
            origin: path.to_path_buf(),
        })
    }

    /// The tokenizer inside a GGUF file (reads the header only).
    pub fn from_gguf_file(path: &Path) -> Result<Tokenizer> {
        let (_, header) = crate::weights::gguf::read_header(path)?;
        Tokenizer::from_gguf_metadata(&header.content.metadata, path)
    }

    /// Builds the tokenizer from `tokenizer.ggml.*` metadata (e.g. [`crate::model::gguf::GgufSource::metadata`]).
    ///
    /// Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with the pre-tokenizers
    /// `gpt2`, `smollm`, `qwen2` and `llama-bpe` (llama.cpp's names; the regexes are those of
    /// `llama-vocab.cpp`, written as the `tokenizer.json` pre-tokenizers the HF models ship).
    /// Anything else is refused: a wrong pre-tokenizer gives plausible but different ids.
    pub fn from_gguf_metadata(md: &HashMap<String, Value>, origin: &Path) -> Result<Tokenizer> {
        let model = gguf_str(md, origin, "tokenizer.ggml.model")?
            .ok_or_else(|| tok_err(origin, "GGUF metadata `tokenizer.ggml.model` is missing"))?;
        if model != "gpt2" {
            return Err(tok_err(
                origin,
                format!(
                    "GGUF tokenizer.ggml.model `{model}` is not supported (only `gpt2`, byte-level \
                     BPE); give the token ids with a token file, or point at the HF tokenizer.json"
                ),
            ));
        }
        let tokens = gguf_strings(md, origin, "tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            return Err(tok_err(origin, "GGUF tokenizer.ggml.tokens is empty"));
        }
        let mut vocab = ahash_map(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            let id = u32::try_from(id).map_err(|_| {
                tok_err(
                    origin,
                    "GGUF tokenizer.ggml.tokens has more than 2^32 entries",
                )
            })?;
            if let Some(first) = vocab.insert(t.clone(), id) {
                return Err(tok_err(
                    origin,
                    format!("GGUF tokenizer.ggml.tokens lists `{t}` twice (ids {first} and {id})"),
                ));
            }
        }
        let merges = gguf_strings(md, origin, "tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(i, m)| match m.split(' ').collect::<Vec<_>>().as_slice() {
                [a, b] if !a.is_empty() && !b.is_empty() => Ok((a.to_string(), b.to_string())),
                _ => Err(tok_err(
                    origin,
                    format!("GGUF tokenizer.ggml.merges[{i}] `{m}` is not two tokens separated by one space"),
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| tok_err(origin, format!("GGUF tokenizer: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);

        let pre = gguf_str(md, origin, "tokenizer.ggml.pre")?.ok_or_else(|| {
            tok_err(
                origin,
                "GGUF metadata `tokenizer.ggml.pre` is missing (files converted before mid-2024); \
                 the pre-tokenizer cannot be known, give token ids instead",
            )
        })?;
        let split = |regex: &str| -> Result<PreTokenizerWrapper> {
            Split::new(
                SplitPattern::Regex(regex.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map(Into::into)
            .map_err(|e| tok_err(origin, format!("pre-tokenizer regex: {e}")))
        };
        // Regexes from llama.cpp src/llama-vocab.cpp (`llm_tokenizer_bpe`); ByteLevel with
        // use_regex = true applies GPT-2's own pattern.
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            "gpt2" | "gpt-2" => ByteLevel::new(false, true, true).into(),
            // SmolLM2's tokenizer.json: Digits(individual) then ByteLevel (GPT-2 regex).
            "smollm" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            "qwen2" => {
                inner
                    .with_normalizer(Some(NFC))
                    .map_err(|e| tok_err(origin, format!("GGUF tokenizer: {e}")))?;
                Sequence::new(vec![
                    split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")?,
                    ByteLevel::new(false, false, false).into(),
                ])
                .into()
            }
            "llama-bpe" | "llama3" => Sequence::new(vec![
                split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")?,
                ByteLevel::new(false, true, false).into(),
            ])
            .into(),
            other => {
                return Err(tok_err(
                    origin,
                    format!(
                        "GGUF tokenizer.ggml.pre `{other}` is not supported \
                         (gpt2, smollm, qwen2, llama-bpe); give token ids instead"
                    ),
                ));
            }
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        // llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
        // 6 byte. Control and user-defined tokens are matched whole in the text (llama.cpp's
        // `parse_special`, HF's added tokens), control ones as special.
        if let Some(types) = md.get("tokenizer.ggml.token_type") {
            let Value::Array(types) = types else {
                return Err(tok_err(
                    origin,
                    "GGUF tokenizer.ggml.token_type is not an array",
                ));
            };
            if types.len() != tokens.len() {
                return Err(tok_err(
                    origin,
                    format!(
                        "GGUF tokenizer.ggml.token_type has {} entries for {} tokens",
                        types.len(),
                        tokens.len()
                    ),
                ));
            }
            let mut added = Vec::new();
            for (t, ty) in tokens.iter().zip(types) {
                match int_value(ty) {
                    Some(3) => added.push(AddedToken::from(t.clone(), true)),
                    Some(4) => added.push(AddedToken::from(t.clone(), false)),
                    Some(_) => {}
                    None => {
                        return Err(tok_err(
                            origin,
                            format!("GGUF tokenizer.ggml.token_type holds a non-integer: {ty:?}"),
                        ));
                    }
                }
            }
            inner
                .add_tokens(added)
                .map_err(|e| tok_err(origin, format!("GGUF tokenizer added tokens: {e}")))?;
        }

        let special = |flag: &str, id_key: &str| -> Result<Option<(String, u32)>> {
            let on = match md.get(flag) {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(tok_err(
                        origin,
                        format!("GGUF `{flag}` is not a bool: {v:?}"),
                    ));
                }
            };
            if !on {
                return Ok(None);
            }
            let id = md
                .get(id_key)
                .and_then(int_value)
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| {
                    tok_err(
                        origin,
                        format!("GGUF `{flag}` is set but `{id_key}` is missing or invalid"),
                    )
                })?;
            let token = tokens.get(id as usize).ok_or_else(|| {
                tok_err(
                    origin,
                    format!(
                        "GGUF `{id_key}` {id} is outside the {} tokens",
                        tokens.len()
                    ),
                )
            })?;
            Ok(Some((token.clone(), id)))
        };
        let bos = special(
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.bos_token_id",
        )?;
        let eos = special(
            "tokenizer.ggml.add_eos_token",
            "tokenizer.ggml.eos_token_id",
        )?;
        if bos.is_some() || eos.is_some() {
            let mut single = Vec::new();
            let mut specials = Vec::new();
            if let Some((t, id)) = &bos {
                single.push(t.clone());
                specials.push((t.clone(), *id));
            }
            single.push("$A".to_string());
            if let Some((t, id)) = &eos {
                single.push(t.clone());
                specials.push((t.clone(), *id));
            }
            let template = TemplateProcessing::builder()
                .try_single(single)
                .map_err(|e| tok_err(origin, format!("GGUF tokenizer template: {e}")))?
                .special_tokens(specials)
                .build()
                .map_err(|e| tok_err(origin, format!("GGUF tokenizer template: {e}")))?;
            inner.with_post_processor(Some(template));
        }
        Ok(Tokenizer {
            inner,
            origin: origin.to_path_buf(),
        })
    }

    /// Token ids for `text`, with the special tokens the model's tokenizer adds by default
    /// (see the module docs).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// Token ids for `text` and nothing else (no BOS/EOS).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| tok_err(&self.origin, format!("tokenizing: {e}")))
    }

    /// Text for `ids`, special tokens included (what the model saw, verbatim).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let n = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= n) {
            return Err(tok_err(
                &self.origin,
                format!("token id {bad} is outside the vocabulary (0..{n})"),
            ));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| tok_err(&self.origin, format!("decoding: {e}")))
    }

    /// The chunks the pre-tokenizer cuts `text` into before BPE, as byte-level symbols (`Ġ` is
    /// a space, `Ċ` a newline): what decides which merges can apply.
    pub fn pre_tokenize(&self, text: &str) -> Result<Vec<String>> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _};
        let Some(pre) = self.inner.get_pre_tokenizer() else {
            return Ok(vec![text.to_string()]);
        };
        let mut split = PreTokenizedString::from(text);
        pre.pre_tokenize(&mut split)
            .map_err(|e| tok_err(&self.origin, format!("pre-tokenizing: {e}")))?;
        Ok(split
            .get_splits(OffsetReferential::Original, OffsetType::Char)
            .into_iter()
            .map(|(s, _, _)| s.to_string())
            .collect())
    }

    /// Tokens the tokenizer knows, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn origin(&self) -> &Path {
        &self.origin
    }
}

fn ahash_map(capacity: usize) -> tokenizers::models::bpe::Vocab {
    let mut m = tokenizers::models::bpe::Vocab::default();
    m.reserve(capacity);
    m
}

fn int_value(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::I8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::U64(x) => i64::try_from(x).ok(),
        Value::I64(x) => Some(x),
        _ => None,
    }
}

fn gguf_str<'a>(
    md: &'a HashMap<String, Value>,
    origin: &Path,
    key: &str,
) -> Result<Option<&'a str>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(tok_err(
            origin,
            format!("GGUF metadata `{key}` is not a string: {v:?}"),
        )),
    }
}

fn gguf_strings(md: &HashMap<String, Value>, origin: &Path, key: &str) -> Result<Vec<String>> {
    let Some(v) = md.get(key) else {
        return Err(tok_err(origin, format!("GGUF metadata `{key}` is missing")));
    };
    let Value::Array(items) = v else {
        return Err(tok_err(
            origin,
            format!("GGUF metadata `{key}` is not an array"),
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(s) => Ok(s.clone()),
            other => Err(tok_err(
                origin,
                format!("GGUF metadata `{key}`[{i}] is not a string: {other:?}"),
            )),
        })
        .collect()
}

/// Token ids from a file: a `.npy` holding a 1-D integer array (read by
/// [`crate::readers::read_npy`]: `<i8`, `<i4`, `<i2`, `|i1`, `|u1`), or text with one decimal id
/// per line (blank lines ignored).
pub fn read_token_file(path: &Path) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    if bytes.starts_with(b"\x93NUMPY") {
        return npy_ids(path);
    }
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| tok_err(path, "token file is neither .npy nor UTF-8 text"))?;
    let mut ids = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let id = line.parse::<u32>().map_err(|_| {
            tok_err(
                path,
                format!(
                    "line {}: `{line}` is not a token id (one non-negative integer per line)",
                    n + 1
                ),
            )
        })?;
        ids.push(id);
    }
    if ids.is_empty() {
        return Err(tok_err(path, "token file holds no ids"));
    }
    Ok(ids)
}

/// One prompt of a prompts file: where it is, and its token ids.
pub struct Prompt {
    /// `FILE line N`
    pub origin: String,
    pub ids: Vec<u32>,
}

/// Prompts from a JSON-lines file: one object per line with the text under `prompt` or `text`
/// (tokenized with `tokenizer`), or the ids under `input_ids` or `tokens`. Blank lines are
/// skipped; any other line is an error naming the file and the line.
pub fn read_prompts(path: &Path, tokenizer: Option<&Tokenizer>) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = |m: String| tok_err(path, format!("line {}: {m}", n + 1));
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(format!("not a JSON object: {e}")))?;
        let text = ["prompt", "text"]
            .iter()
            .find_map(|k| value.get(k).and_then(serde_json::Value::as_str));
        let ids_field = ["input_ids", "tokens"].iter().find_map(|k| value.get(k));
        let ids = match (text, ids_field) {
            (Some(text), _) => {
                let tok = tokenizer.ok_or_else(|| {
                    at("holds text, but the target has no tokenizer (give input_ids)".into())
                })?;
                tok.encode(text)?
            }
            (None, Some(serde_json::Value::Array(items))) => items
                .iter()
                .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| at("input_ids must be non-negative integers".into()))?,
            _ => {
                return Err(at(
                    "needs a \"prompt\" or \"text\" string or an \"input_ids\" list".into(),
                ));
            }
        };
        if ids.is_empty() {
            return Err(at("encodes to no tokens".into()));
        }
        out.push(Prompt {
            origin: format!("{} line {}", path.display(), n + 1),
            ids,
        });
    }
    if out.is_empty() {
        return Err(tok_err(path, "holds no prompts"));
    }
    Ok(out)
}

fn npy_ids(path: &Path) -> Result<Vec<u32>> {
    let t = crate::readers::read_npy(path, &crate::readers::Limits::default()).map_err(|e| {
        // ReadError's message already starts with the file; keep one copy of it.
        let msg = e.to_string();
        let prefix = format!("{}: ", path.display());
        tok_err(path, msg.strip_prefix(&prefix).unwrap_or(&msg))
    })?;
    let bad = |m: String| tok_err(path, format!("npy: {m}"));
    if t.dtype.is_float() || t.dtype == crate::readers::DType::Bool {
        return Err(bad(format!("dtype {} is not an integer type", t.dtype)));
    }
    if t.rank() != 1 {
        return Err(bad(format!(
            "shape {:?} is not 1-D (token ids are one sequence)",
            t.shape
        )));
    }
    let values = t
        .to_i64_vec()
        .ok_or_else(|| bad(format!("dtype {} is not an integer type", t.dtype)))?;
    if values.is_empty() {
        return Err(bad("the array is empty".into()));
    }
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            u32::try_from(v)
                .map_err(|_| bad(format!("element {i} = {v} is not a token id (0..2^32)")))
        })
        .collect()
}
