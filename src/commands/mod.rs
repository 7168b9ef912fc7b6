//! The commands: each takes its typed options, reads what it needs, calls the judge and returns
//! what the CLI renders (a [`Report`](crate::report::Report), or a plan, a spec, a table). None
//! parses a command line and none imports another; what several share is here: which engines
//! to judge (one chooser), the models a flag or a bundle names, the tokens to run, the device.

pub mod diff;
pub mod engines;
pub mod gate;
pub mod plan;
pub mod probe;
pub mod run;
pub mod spec_init;

use crate::config::{ModelConfig, TargetInfo};
use crate::engine::{Engine, EngineSel};
use crate::error::{Error, Result, candle_line};
use crate::locate::{self, Bundle, is_gguf, resolve_model_dir};
use crate::spec::Spec;
use crate::tokenize::{Tokenizer, read_token_file};
use crate::weights::WeightIndex;
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

/// `--engine` (or `--trainer`-like text) as a selection; a mistake in it is a command-line one.
pub fn engine_sel(name: &str) -> Result<EngineSel> {
    EngineSel::parse(name).map_err(|e| Error::Usage(format!("--engine: {e}")))
}

/// How many engines a command judges.
#[derive(Clone, Copy)]
pub enum Wanted<'a> {
    /// Several (gate, probe): with none named, every engine at its newest version.
    Several,
    /// Exactly one (run, diff's three-way table): with none named, refuse with this message.
    One { missing: &'a str },
}

/// The one engine chooser: `--engine NAME` wins (`all`, where several are wanted, names every
/// engine), then the spec's `engine:`, then every engine or the refusal of [`Wanted::One`].
pub fn choose_engines(
    flag: Option<&str>,
    spec: Option<&Spec>,
    wanted: Wanted,
) -> Result<Vec<EngineSel>> {
    let every = || Engine::ALL.map(EngineSel::newest).to_vec();
    match (flag, wanted) {
        (Some("all"), Wanted::Several) => Ok(every()),
        (Some(name), _) => Ok(vec![engine_sel(name)?]),
        (None, wanted) => match (spec.and_then(|s| s.engine), wanted) {
            (Some(engine), _) => Ok(vec![engine]),
            (None, Wanted::Several) => Ok(every()),
            (None, Wanted::One { missing }) => Err(Error::Usage(missing.to_string())),
        },
    }
}

/// [`choose_engines`] for a command that judges exactly one engine.
pub fn choose_engine(flag: Option<&str>, spec: Option<&Spec>, missing: &str) -> Result<EngineSel> {
    let mut chosen = choose_engines(flag, spec, Wanted::One { missing })?;
    Ok(chosen.remove(0))
}

/// A model argument through [`locate::locate_model`]: paths as they are, Hub ids from the cache.
pub fn locate_opt(arg: Option<&Path>, revision: Option<&str>) -> Result<Option<PathBuf>> {
    arg.map(|a| locate::locate_model(a, revision)).transpose()
}

/// The model flags of `run` and `probe`: each names a part, else the bundle's part stands in.
#[derive(Clone, Default)]
pub struct ModelArgs {
    pub bundle: Option<PathBuf>,
    pub target: Option<PathBuf>,
    pub draft: Option<PathBuf>,
    pub spec: Option<PathBuf>,
    /// Revision of the HF Hub ids given to target and draft.
    pub revision: Option<String>,
}

/// The models a command runs: its flags, else its bundle's parts.
pub struct Models {
    pub target: PathBuf,
    pub draft: Option<PathBuf>,
    pub spec: Option<Spec>,
    pub bundle: Option<Bundle>,
}

impl Models {
    /// `command` names the command in the refusal when no target is named; `draft_needed`,
    /// when given, is the refusal when no draft is.
    pub fn resolve(args: &ModelArgs, command: &str, draft_needed: Option<&str>) -> Result<Models> {
        let revision = args.revision.as_deref();
        let target = locate_opt(args.target.as_deref(), revision)?;
        let draft = locate_opt(args.draft.as_deref(), revision)?;
        let bundle = args.bundle.as_deref().map(Bundle::open).transpose()?;
        let target = target
            .or_else(|| bundle.as_ref().map(|b| b.target.clone()))
            .ok_or_else(|| {
                Error::Usage(format!("{command} needs a bundle directory or --target"))
            })?;
        let draft = draft.or_else(|| bundle.as_ref().and_then(|b| b.draft.clone()));
        if let (None, Some(message)) = (&draft, draft_needed) {
            return Err(Error::Usage(message.to_string()));
        }
        let spec = args
            .spec
            .clone()
            .or_else(|| bundle.as_ref().and_then(|b| b.spec.clone()))
            .map(|p| Spec::load(&p))
            .transpose()?;
        Ok(Models {
            target,
            draft,
            spec,
            bundle,
        })
    }
}

/// The token flags of `run` and `probe` (at most one is given).
#[derive(Clone, Default)]
pub struct TokenArgs {
    /// `--tokens`: ids.
    pub tokens: Option<Vec<u32>>,
    /// `--token-file`: one id per line, or a .npy of integers.
    pub token_file: Option<PathBuf>,
    /// `--prompt`: text for the target's tokenizer.
    pub prompt: Option<String>,
}

/// The token ids of `--tokens`, `--token-file` or `--prompt`, else the bundle's tokens.txt, else
/// the default sequence; with where they came from.
pub fn input_tokens(
    args: &TokenArgs,
    bundle: Option<&Bundle>,
    target: &Path,
) -> Result<(Vec<u32>, String)> {
    Ok(match (&args.tokens, &args.token_file, &args.prompt) {
        (Some(t), _, _) => (t.clone(), "--tokens".to_string()),
        (None, Some(file), _) => (read_token_file(file)?, file.display().to_string()),
        (None, None, Some(text)) => {
            let dir = resolve_model_dir(target)?;
            let tokenizer = Tokenizer::open(&dir)?;
            let ids = tokenizer.encode(text)?;
            if ids.is_empty() {
                return Err(Error::Tokens {
                    origin: "--prompt".into(),
                    message: "the text encodes to no tokens".into(),
                });
            }
            (ids, "--prompt".to_string())
        }
        (None, None, None) => match bundle.and_then(|b| b.tokens.clone()) {
            Some(file) => (read_token_file(&file)?, file.display().to_string()),
            None => (
                default_tokens(target_config(target)?.vocab_size),
                "the default token sequence".to_string(),
            ),
        },
    })
}

/// Ids used when none are given and the bundle has no tokens.txt: a fixed, documented
/// pseudo-random sequence (LCG) over the vocabulary, so runs are reproducible.
fn default_tokens(vocab: usize) -> Vec<u32> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    (0..16)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab.max(1) as u64) as u32
        })
        .collect()
}

/// `--device`.
#[derive(Clone, Copy)]
pub enum DeviceChoice {
    Cpu,
    Cuda,
    /// The first CUDA GPU when this build has CUDA and the machine has one, else the CPU.
    Auto,
}

/// Opens the compute device `choice` names.
pub fn open_device(choice: DeviceChoice) -> Result<Device> {
    let built = candle_core::utils::cuda_is_available();
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto if !built => Ok(Device::Cpu),
        DeviceChoice::Cuda if !built => Err(Error::Device(
            "--device cuda: this build of eagle-check has no CUDA support (build with \
             `--features cuda`, see the README); use --device cpu"
                .into(),
        )),
        DeviceChoice::Auto if !gpu_present() => Ok(Device::Cpu),
        DeviceChoice::Cuda if !gpu_present() => Err(Error::Device(
            "--device cuda: no CUDA driver or device found on this machine".into(),
        )),
        DeviceChoice::Auto | DeviceChoice::Cuda => cuda_device(),
    }
}

#[cfg(feature = "cuda")]
fn gpu_present() -> bool {
    crate::kernels::cuda::device_available()
}

#[cfg(not(feature = "cuda"))]
fn gpu_present() -> bool {
    false
}

/// CUDA device 0; a driver's refusal says what the driver said, on one line.
#[cfg(feature = "cuda")]
fn cuda_device() -> Result<Device> {
    let dev = crate::kernels::cuda::open_device(0).map_err(|e| Error::Device(candle_line(&e)))?;
    Ok(Device::Cuda(dev))
}

/// CUDA device 0; a driver's refusal says what the driver said, on one line.
#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<Device> {
    Device::new_cuda(0).map_err(|e| Error::Device(candle_line(&e)))
}

/// `--dtype`, else bf16 on the GPU (what engines run) and f32 on the CPU (exact parity).
pub fn compute_dtype(dtype: Option<DType>, device: &Device) -> DType {
    match (dtype, device.is_cuda()) {
        (Some(d), _) => d,
        (None, true) => DType::BF16,
        (None, false) => DType::F32,
    }
}

/// The target's config, from `config.json` or from GGUF metadata.
pub fn target_config(path: &Path) -> Result<ModelConfig> {
    let dir = resolve_model_dir(path)?;
    if is_gguf(&dir) {
        Ok(crate::model::gguf::open_gguf(&dir)?.0)
    } else {
        ModelConfig::load(&dir)
    }
}

/// What the static checks need of a target, for any architecture (GGUF metadata included).
pub fn target_info(path: &Path) -> Result<TargetInfo> {
    let dir = resolve_model_dir(path)?;
    if is_gguf(&dir) {
        Ok(TargetInfo::from(&target_config(&dir)?))
    } else {
        TargetInfo::load(&dir)
    }
}

/// The target's tokenizer, when the model ships one (tokenizer.json or GGUF metadata).
pub fn tokenizer_for(target: &Path) -> Option<Tokenizer> {
    let dir = resolve_model_dir(target).ok()?;
    Tokenizer::open(&dir).ok()
}

/// A model's weight headers, if its path (a directory or its config.json) holds safetensors.
pub fn model_weights(model: &Path) -> Result<Option<WeightIndex>> {
    let dir = if model.is_dir() {
        model.to_path_buf()
    } else {
        match model.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    };
    let index = WeightIndex::open(&dir).map_err(|error| Error::Context {
        context: format!("reading weights in {}", dir.display()),
        error: Box::new(error),
    })?;
    Ok((!index.is_empty()).then_some(index))
}

/// A draft's name for a spec: its directory (or its config file's stem).
pub(crate) fn stem(draft: &Path) -> String {
    let stem = if draft.file_name().is_some_and(|n| n == "config.json") {
        draft.parent().and_then(|p| p.file_name())
    } else if draft.is_dir() {
        draft.file_name()
    } else {
        draft.file_stem()
    };
    stem.map_or("drafter".into(), |s| s.to_string_lossy().into_owned())
}
