//! Synthesises safetensors directories whose headers declare real tensor shapes while the data
//! is a sparse hole: a 671B DeepSeek-V3 checkpoint layout costs a few MB of headers on disk.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

pub struct Tensor {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
}

fn t(name: String, dtype: &'static str, shape: &[usize]) -> Tensor {
    Tensor {
        name,
        dtype,
        shape: shape.to_vec(),
    }
}

fn elem_size(dtype: &str) -> usize {
    match dtype {
        "F32" | "I32" => 4,
        "BF16" | "F16" => 2,
        "I64" => 8,
        _ => 1,
    }
}

/// An FP8 linear weight `[out, inp]` with its 128x128 block scales, as DeepSeek-V3 ships them.
fn fp8_linear(out: &mut Vec<Tensor>, name: &str, rows: usize, cols: usize) {
    out.push(t(format!("{name}.weight"), "F8_E4M3", &[rows, cols]));
    out.push(t(
        format!("{name}.weight_scale_inv"),
        "F32",
        &[rows.div_ceil(128), cols.div_ceil(128)],
    ));
}

/// The tensors of DeepSeek-V3 (config in fixtures/real-configs), layer by layer.
pub fn deepseek_v3_tensors() -> Vec<Vec<Tensor>> {
    let (h, v, layers, dense) = (7168usize, 129280usize, 61usize, 3usize);
    let (q_lora, kv_lora, nope, rope, vdim, heads) =
        (1536usize, 512usize, 128usize, 64usize, 128usize, 128usize);
    let (inter, moe_inter, experts) = (18432usize, 2048usize, 256usize);
    let mut groups = vec![vec![t("model.embed_tokens.weight".into(), "BF16", &[v, h])]];
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        let mut g = Vec::new();
        g.push(t(format!("{p}.input_layernorm.weight"), "BF16", &[h]));
        g.push(t(
            format!("{p}.post_attention_layernorm.weight"),
            "BF16",
            &[h],
        ));
        fp8_linear(&mut g, &format!("{p}.self_attn.q_a_proj"), q_lora, h);
        g.push(t(
            format!("{p}.self_attn.q_a_layernorm.weight"),
            "BF16",
            &[q_lora],
        ));
        fp8_linear(
            &mut g,
            &format!("{p}.self_attn.q_b_proj"),
            heads * (nope + rope),
            q_lora,
        );
        fp8_linear(
            &mut g,
            &format!("{p}.self_attn.kv_a_proj_with_mqa"),
            kv_lora + rope,
            h,
        );
        g.push(t(
            format!("{p}.self_attn.kv_a_layernorm.weight"),
            "BF16",
            &[kv_lora],
        ));
        fp8_linear(
            &mut g,
            &format!("{p}.self_attn.kv_b_proj"),
            heads * (nope + vdim),
            kv_lora,
        );
        fp8_linear(&mut g, &format!("{p}.self_attn.o_proj"), h, heads * vdim);
        if i < dense {
            fp8_linear(&mut g, &format!("{p}.mlp.gate_proj"), inter, h);
            fp8_linear(&mut g, &format!("{p}.mlp.up_proj"), inter, h);
            fp8_linear(&mut g, &format!("{p}.mlp.down_proj"), h, inter);
        } else {
            g.push(t(format!("{p}.mlp.gate.weight"), "BF16", &[experts, h]));
            g.push(t(
                format!("{p}.mlp.gate.e_score_correction_bias"),
                "F32",
                &[experts],
            ));
            for e in 0..experts {
                fp8_linear(
                    &mut g,
                    &format!("{p}.mlp.experts.{e}.gate_proj"),
                    moe_inter,
                    h,
                );
                fp8_linear(
                    &mut g,
                    &format!("{p}.mlp.experts.{e}.up_proj"),
                    moe_inter,
                    h,
                );
                fp8_linear(
                    &mut g,
                    &format!("{p}.mlp.experts.{e}.down_proj"),
                    h,
                    moe_inter,
                );
            }
            fp8_linear(
                &mut g,
                &format!("{p}.mlp.shared_experts.gate_proj"),
                moe_inter,
                h,
            );
            fp8_linear(
                &mut g,
                &format!("{p}.mlp.shared_experts.up_proj"),
                moe_inter,
                h,
            );
            fp8_linear(
                &mut g,
                &format!("{p}.mlp.shared_experts.down_proj"),
                h,
                moe_inter,
            );
        }
        groups.push(g);
    }
    groups.push(vec![
        t("model.norm.weight".into(), "BF16", &[h]),
        t("lm_head.weight".into(), "BF16", &[v, h]),
    ]);
    groups
}

/// Writes one safetensors file whose data section is a sparse hole of the right length.
pub fn write_sparse(path: &Path, tensors: &[Tensor]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for tensor in tensors {
        let bytes = tensor.shape.iter().product::<usize>() * elem_size(tensor.dtype);
        header.insert(
            tensor.name.clone(),
            serde_json::json!({"dtype": tensor.dtype, "shape": tensor.shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut text = serde_json::to_string(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut f = File::create(path).unwrap();
    f.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.set_len((8 + text.len() + offset) as u64).unwrap();
}

/// A DeepSeek-V3-sized target directory: the real config, `shards` sparse shard files and
/// `model.safetensors.index.json`. Returns the directory.
pub fn deepseek_v3_dir(dir: &Path, config: &Path, shards: usize) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(config, dir.join("config.json")).unwrap();
    let all: Vec<Tensor> = deepseek_v3_tensors().into_iter().flatten().collect();
    let per = all.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in all.chunks(per).enumerate() {
        let name = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        write_sparse(&dir.join(&name), chunk);
        for tensor in chunk {
            weight_map.insert(tensor.name.clone(), serde_json::Value::String(name.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    dir.to_path_buf()
}

/// Copies a draft config into `dir` and reads it back.
fn draft_config(dir: &Path, config: &Path) -> serde_json::Value {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(config, dir.join("config.json")).unwrap();
    serde_json::from_slice(&std::fs::read(config).unwrap()).unwrap()
}

/// Writes a draft's weights: fc, the layer's norms and MLP, the head and the vocab maps
/// common to every EAGLE-3 draft, plus the given attention tensors (`midlayer.self_attn.*`).
fn write_draft(
    dir: &Path,
    cfg: &serde_json::Value,
    fc_in: usize,
    attention: Vec<(&str, Vec<usize>)>,
) -> PathBuf {
    let get = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (h, inter, v, dv) = (
        get("hidden_size"),
        get("intermediate_size"),
        get("vocab_size"),
        get("draft_vocab_size"),
    );
    let mut tensors = vec![
        t("fc.weight".into(), "BF16", &[h, fc_in]),
        t("midlayer.hidden_norm.weight".into(), "BF16", &[h]),
        t("midlayer.input_layernorm.weight".into(), "BF16", &[h]),
        t(
            "midlayer.post_attention_layernorm.weight".into(),
            "BF16",
            &[h],
        ),
        t("midlayer.mlp.gate_proj.weight".into(), "BF16", &[inter, h]),
        t("midlayer.mlp.up_proj.weight".into(), "BF16", &[inter, h]),
        t("midlayer.mlp.down_proj.weight".into(), "BF16", &[h, inter]),
        t("norm.weight".into(), "BF16", &[h]),
        t("lm_head.weight".into(), "BF16", &[dv, h]),
        t("d2t".into(), "I64", &[dv]),
        t("t2d".into(), "BOOL", &[v]),
    ];
    for (name, shape) in attention {
        tensors.push(t(
            format!("midlayer.self_attn.{name}.weight"),
            "BF16",
            &shape,
        ));
    }
    write_sparse(&dir.join("model.safetensors"), &tensors);
    dir.to_path_buf()
}

/// A draft directory with the real config and sparse weights of the given fc input width.
pub fn draft_dir(dir: &Path, config: &Path, fc_in: usize) -> PathBuf {
    draft_dir_with(dir, config, fc_in, |_| {})
}

/// [`draft_dir`] with the tensor list edited before it is written (`(name, dtype, shape)`).
pub fn draft_dir_with(
    dir: &Path,
    config: &Path,
    fc_in: usize,
    edit: impl Fn(&mut Vec<(String, &'static str, Vec<usize>)>),
) -> PathBuf {
    let cfg = draft_config(dir, config);
    let get = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (h, heads, kv) = (
        get("hidden_size"),
        get("num_attention_heads"),
        get("num_key_value_heads"),
    );
    let hd = h / heads;
    let attention = vec![
        ("q_proj", vec![heads * hd, 2 * h]),
        ("k_proj", vec![kv * hd, 2 * h]),
        ("v_proj", vec![kv * hd, 2 * h]),
        ("o_proj", vec![h, heads * hd]),
    ];
    let path = write_draft(dir, &cfg, fc_in, attention);
    let mut listed: Vec<(String, &'static str, Vec<usize>)> =
        read_listing(&dir.join("model.safetensors"));
    edit(&mut listed);
    let tensors: Vec<Tensor> = listed
        .iter()
        .map(|(name, dtype, shape)| t(name.clone(), dtype, shape))
        .collect();
    write_sparse(&dir.join("model.safetensors"), &tensors);
    path
}

/// The (name, dtype, shape) of every tensor of a safetensors file, in data order.
fn read_listing(path: &Path) -> Vec<(String, &'static str, Vec<usize>)> {
    // The header only: the data section is a multi-gigabyte sparse hole.
    let mut f = File::open(path).unwrap();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).unwrap();
    let mut text = vec![0u8; u64::from_le_bytes(len) as usize];
    f.read_exact(&mut text).unwrap();
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&text).unwrap();
    let mut out: Vec<(usize, String, &'static str, Vec<usize>)> = header
        .into_iter()
        .map(|(name, v)| {
            let dtype = match v["dtype"].as_str().unwrap() {
                "BF16" => "BF16",
                "I64" => "I64",
                "BOOL" => "BOOL",
                other => panic!("unexpected dtype {other}"),
            };
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (
                v["data_offsets"][0].as_u64().unwrap() as usize,
                name,
                dtype,
                shape,
            )
        })
        .collect();
    out.sort();
    out.into_iter().map(|(_, n, d, s)| (n, d, s)).collect()
}

/// An MLA draft directory (`Eagle3DeepseekV2ForCausalLM`, TorchSpec `midlayer.` names) with the
/// real config and sparse weights; `q_in` / `kv_in` are the input widths of `q_a_proj` and
/// `kv_a_proj_with_mqa` (2H in a well-formed draft).
pub fn mla_draft_dir(
    dir: &Path,
    config: &Path,
    fc_in: usize,
    q_in: usize,
    kv_in: usize,
) -> PathBuf {
    let cfg = draft_config(dir, config);
    let get = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (h, heads) = (get("hidden_size"), get("num_attention_heads"));
    let (q_rank, kv_rank, nope, rope, vdim) = (
        get("q_lora_rank"),
        get("kv_lora_rank"),
        get("qk_nope_head_dim"),
        get("qk_rope_head_dim"),
        get("v_head_dim"),
    );
    let attention = vec![
        ("q_a_proj", vec![q_rank, q_in]),
        ("q_a_layernorm", vec![q_rank]),
        ("q_b_proj", vec![heads * (nope + rope), q_rank]),
        ("kv_a_proj_with_mqa", vec![kv_rank + rope, kv_in]),
        ("kv_a_layernorm", vec![kv_rank]),
        ("kv_b_proj", vec![heads * (nope + vdim), kv_rank]),
        ("o_proj", vec![h, heads * vdim]),
    ];
    write_draft(dir, &cfg, fc_in, attention)
}
