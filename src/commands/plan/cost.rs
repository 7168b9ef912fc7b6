//! What a plan costs before it runs: the tokens of the prompts, the bytes each token's stored
//! states take, the dumps they add up to, the device memory the engine holds for them, and the
//! `--max-model-len` a vLLM plan sets (vLLM reserves its stored states for that many tokens).

use crate::error::{Error, Result};
use serde::Serialize;
use std::path::Path;

/// Bytes of one stored element: the engines' activation dtype (bf16, also for FP8 checkpoints,
/// whose activations are bf16).
pub const STATE_BYTES: u64 = 2;

/// vLLM's `--max-model-len` is rounded up to this many tokens: a round number costs at most 255
/// tokens of stored states more than needed.
const MAX_LEN_STEP: u64 = 256;

/// vLLM's `--max-model-len` when no prompts were given.
pub const DEFAULT_MAX_LEN: u64 = 4096;

/// The prompts of a plan, counted.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptStats {
    pub count: usize,
    /// Tokens of the longest prompt.
    pub longest: u64,
    /// Tokens of all prompts.
    pub total: u64,
    /// false when a text prompt was counted as an upper bound (one token per UTF-8 byte plus 2
    /// for BOS and a leading-space piece; no tokenizer is read).
    pub exact: bool,
}

/// Checks a prompts file (every line `{"text": "..."}` or `{"input_ids": [ints]}`) and counts
/// its tokens.
pub fn check_prompts(path: &Path) -> Result<PromptStats> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut stats = PromptStats {
        count: 0,
        longest: 0,
        total: 0,
        exact: true,
    };
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| Error::Tokens {
            origin: format!("{}:{}", path.display(), i + 1),
            message: format!(
                "{what}; each line must be {{\"text\": \"...\"}} or {{\"input_ids\": [1, 2, ...]}}"
            ),
        };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|_| bad("not JSON"))?;
        let tokens = match (v.get("text"), v.get("input_ids")) {
            (Some(t), None) => t.as_str().map(|t| {
                stats.exact = false;
                t.len() as u64 + 2
            }),
            (None, Some(ids)) => ids
                .as_array()
                .filter(|a| !a.is_empty() && a.iter().all(|x| x.as_u64().is_some()))
                .map(|a| a.len() as u64),
            _ => None,
        };
        let tokens =
            tokens.ok_or_else(|| bad("neither a text nor a non-empty list of token ids"))?;
        stats.count += 1;
        stats.longest = stats.longest.max(tokens);
        stats.total += tokens;
    }
    if stats.count == 0 {
        return Err(Error::Tokens {
            origin: path.display().to_string(),
            message: "no prompts".into(),
        });
    }
    Ok(stats)
}

/// vLLM's `--max-model-len` for these prompts: the longest prompt and the one token each
/// request generates, rounded up to a multiple of 256; 4096 without prompts.
pub fn max_model_len(prompts: Option<&PromptStats>) -> u64 {
    prompts.map_or(DEFAULT_MAX_LEN, |p| {
        (p.longest + 1).div_ceil(MAX_LEN_STEP) * MAX_LEN_STEP
    })
}

/// Where the engine keeps the stored states on the device.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Held {
    /// Reserved at start-up for `max_model_len` tokens on every GPU (vLLM's cache-only layer).
    Reserved { max_model_len: u64 },
    /// Held during one prefill, for the longest prompt (sglang's aux captures).
    PerForward,
}

/// The cost of one engine step of a plan.
#[derive(Debug, Clone, Serialize)]
pub struct Cost {
    /// States stored for each token.
    pub states: usize,
    /// Bytes one token's stored states take in one dump copy: states x H x 2 and the integer
    /// side tensors (token ids, positions).
    pub bytes_per_token: u64,
    /// Copies the engine writes: sglang's dumper writes on every TP rank, vLLM's connector once.
    pub copies: usize,
    /// Bytes of dumps for the prompts, all copies (None without prompts).
    pub dump_bytes: Option<u64>,
    pub held: Held,
    /// Device memory for the stored states on each GPU (None: per forward, without prompts).
    pub device_bytes_per_gpu: Option<u64>,
}

/// What one engine step stores.
pub struct Stored {
    pub states: usize,
    pub hidden: usize,
    /// Bytes of integer side tensors per token (int64 ids, positions).
    pub side_bytes: u64,
    pub copies: usize,
    pub held: Held,
}

fn overflow(what: &str) -> Error {
    Error::Usage(format!("plan: the {what} do not fit in 64 bits"))
}

fn mul(factors: &[u64], what: &str) -> Result<u64> {
    factors
        .iter()
        .try_fold(1u64, |a, &b| a.checked_mul(b))
        .ok_or_else(|| overflow(what))
}

impl Cost {
    pub fn of(stored: &Stored, prompts: Option<&PromptStats>) -> Result<Cost> {
        let state_bytes = mul(
            &[stored.states as u64, stored.hidden as u64, STATE_BYTES],
            "bytes per token",
        )?;
        let bytes_per_token = state_bytes
            .checked_add(stored.side_bytes)
            .ok_or_else(|| overflow("bytes per token"))?;
        let dump_bytes = prompts
            .map(|p| {
                mul(
                    &[p.total, bytes_per_token, stored.copies as u64],
                    "dump bytes",
                )
            })
            .transpose()?;
        let device_bytes_per_gpu = match stored.held {
            Held::Reserved { max_model_len } => {
                Some(mul(&[state_bytes, max_model_len], "device bytes")?)
            }
            Held::PerForward => prompts
                .map(|p| mul(&[state_bytes, p.longest], "device bytes"))
                .transpose()?,
        };
        Ok(Cost {
            states: stored.states,
            bytes_per_token,
            copies: stored.copies,
            dump_bytes,
            held: stored.held,
            device_bytes_per_gpu,
        })
    }

    /// The cost as comment lines of the script.
    pub fn lines(&self, hidden: usize, tp: usize, prompts: Option<&PromptStats>) -> Vec<String> {
        let mut out = vec![format!(
            "{} state{} of {hidden} x {STATE_BYTES} bytes, and the integer ids: {} per token{}",
            self.states,
            if self.states == 1 { "" } else { "s" },
            human(self.bytes_per_token),
            if self.copies > 1 {
                format!(", written by each of the {} TP ranks", self.copies)
            } else {
                String::new()
            }
        )];
        out.push(match (self.dump_bytes, prompts) {
            (Some(b), Some(p)) => format!(
                "dumps for the {} prompts ({} tokens{}): {}",
                p.count,
                p.total,
                if p.exact {
                    ""
                } else {
                    ", at most: text counted as one token per byte"
                },
                human(b)
            ),
            _ => {
                "dumps: that per token of your prompts (pass --prompts to have it added up)".into()
            }
        });
        out.push(match (self.held, self.device_bytes_per_gpu) {
            (Held::Reserved { max_model_len }, Some(b)) => format!(
                "device memory: {} on each of the {tp} GPUs, reserved at start-up for --max-model-len \
                 {max_model_len} (the cache-only layer that stores them is not split across TP ranks, \
                 vllm/model_executor/models/extract_hidden_states.py l. 349)",
                human(b)
            ),
            (Held::PerForward, Some(b)) => format!(
                "device memory: {} on each GPU while the longest prompt's prefill runs (the captures \
                 live for one forward pass; nothing is reserved)",
                human(b)
            ),
            _ => "device memory: that per token of the longest prompt, on each GPU during its prefill"
                .into(),
        });
        out
    }
}

/// Bytes for people: `874,496 bytes (854.0 KiB)`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut grouped = String::new();
    for (i, c) in bytes.to_string().chars().enumerate() {
        if i > 0 && (bytes.to_string().len() - i).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(c);
    }
    if bytes < 1024 {
        return format!("{grouped} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{grouped} bytes ({value:.1} {})", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(longest: u64, total: u64) -> PromptStats {
        PromptStats {
            count: 2,
            longest,
            total,
            exact: true,
        }
    }

    /// The figure: vLLM's DeepSeek-V3 reference stores 61 states of 7168 per token, and at
    /// the default max length (163,840) that is about 133 GiB on every GPU.
    #[test]
    fn plan_cost_vllm_deepseek_default_length_is_133_gib_per_gpu() {
        let stored = Stored {
            states: 61,
            hidden: 7168,
            side_bytes: 8,
            copies: 1,
            held: Held::Reserved {
                max_model_len: 163_840,
            },
        };
        let cost = Cost::of(&stored, None).unwrap();
        assert_eq!(cost.bytes_per_token, 61 * 7168 * 2 + 8);
        let gib = cost.device_bytes_per_gpu.unwrap() as f64 / (1u64 << 30) as f64;
        assert!((gib - 133.4).abs() < 0.1, "{gib}");
        assert_eq!(cost.dump_bytes, None);
    }

    #[test]
    fn plan_cost_adds_up_the_prompts_and_every_rank_copy() {
        let stored = Stored {
            states: 7,
            hidden: 64,
            side_bytes: 16,
            copies: 2,
            held: Held::PerForward,
        };
        let cost = Cost::of(&stored, Some(&stats(10, 15))).unwrap();
        assert_eq!(cost.bytes_per_token, 7 * 64 * 2 + 16);
        assert_eq!(cost.dump_bytes, Some(15 * (7 * 64 * 2 + 16) * 2));
        assert_eq!(cost.device_bytes_per_gpu, Some(10 * 7 * 64 * 2));
    }

    #[test]
    fn plan_max_model_len_covers_the_longest_prompt_and_one_token() {
        assert_eq!(max_model_len(None), DEFAULT_MAX_LEN);
        assert_eq!(max_model_len(Some(&stats(255, 300))), 256);
        assert_eq!(max_model_len(Some(&stats(256, 300))), 512);
        assert_eq!(max_model_len(Some(&stats(3, 3))), 256);
    }

    #[test]
    fn plan_cost_refuses_sizes_past_64_bits() {
        let stored = Stored {
            states: usize::MAX,
            hidden: 7168,
            side_bytes: 0,
            copies: 1,
            held: Held::PerForward,
        };
        assert!(Cost::of(&stored, None).is_err());
    }

    /// Text is counted without a tokenizer: at most one token per UTF-8 byte, plus 2.
    #[test]
    fn plan_prompts_count_ids_exactly_and_text_as_a_bound() {
        let dir = std::env::temp_dir().join(format!("eagle-check-prompts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.jsonl");
        std::fs::write(
            &path,
            "{\"input_ids\": [1, 2, 3]}\n\n{\"text\": \"Paris\"}\n",
        )
        .unwrap();
        let stats = check_prompts(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!((stats.count, stats.longest, stats.total), (2, 7, 10));
        assert!(!stats.exact);
    }

    #[test]
    fn plan_human_sizes() {
        assert_eq!(human(1000), "1,000 bytes");
        assert_eq!(human(874_496), "874,496 bytes (854.0 KiB)");
        assert_eq!(human(3 << 30), "3,221,225,472 bytes (3.0 GiB)");
    }
}
