//! Where weights come from: memory-mapped safetensors shards (HF directories, HF cache
//! snapshots) or a dequantised GGUF file, behind one trait, named by HF tensor names.

use crate::error::{CandleContext, Error, Result};
use crate::weights::{WeightIndex, shard_files};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A store of named tensors.
pub trait WeightSource: Send + Sync {
    /// The shape the store declares for `name`, without loading it.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// The tensor in its stored dtype.
    fn load(&self, name: &str, device: &Device) -> Result<Tensor>;
    /// The file or directory the weights came from, for error messages.
    fn origin(&self) -> &Path;
    /// Every tensor name the store holds (to report the ones no loader read).
    fn names(&self) -> Vec<String>;
}

/// safetensors shards, headers validated by [`WeightIndex`] before anything is mapped.
pub struct SafetensorsSource {
    dir: PathBuf,
    index: WeightIndex,
    mmap: MmapedSafetensors,
}

impl SafetensorsSource {
    pub fn open(dir: &Path) -> Result<SafetensorsSource> {
        let index = WeightIndex::open(dir)?;
        if index.is_empty() {
            return Err(Error::weights(dir, "no .safetensors weights found"));
        }
        let files = shard_files(dir)?;
        // SAFETY: the files are mapped read-only; eagle-check never writes them, and the headers
        // were validated against the file lengths above.
        let mmap = unsafe { MmapedSafetensors::multi(&files) }
            .ctx(|| format!("mapping {}", dir.display()))?;
        Ok(SafetensorsSource {
            dir: dir.to_path_buf(),
            index,
            mmap,
        })
    }
}

impl WeightSource for SafetensorsSource {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.index.get(name).map(|t| t.shape.clone())
    }

    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        let Some(info) = self.index.get(name) else {
            return Err(Error::MissingTensor {
                path: self.dir.clone(),
                name: name.to_string(),
            });
        };
        // candle has no bool dtype; a BOOL tensor (a draft's `t2d`) loads as u8 0/1.
        if info.dtype == "BOOL" {
            let what = || format!("{}: loading {name}", self.dir.display());
            let view = self.mmap.get(name).ctx(what)?;
            return Tensor::from_vec(view.data().to_vec(), info.shape.clone(), device).ctx(what);
        }
        self.mmap
            .load(name, device)
            .ctx(|| format!("{}: loading {name}", self.dir.display()))
    }

    fn origin(&self) -> &Path {
        &self.dir
    }

    fn names(&self) -> Vec<String> {
        self.index.tensors.keys().cloned().collect()
    }
}

/// HF-style access to a weight source: a name prefix, a compute dtype and a device.
#[derive(Clone)]
pub struct Vb<'a> {
    src: &'a dyn WeightSource,
    prefix: String,
    pub dtype: DType,
    pub device: Device,
    /// The checkpoint's declared FP8 block (`quantization_config.weight_block_size`); when
    /// absent the block is inferred from the weight and scale shapes.
    pub fp8_block: Option<[usize; 2]>,
    /// Every full name loaded through this builder or its children.
    loaded: Arc<Mutex<BTreeSet<String>>>,
}

impl<'a> Vb<'a> {
    pub fn new(src: &'a dyn WeightSource, dtype: DType, device: &Device) -> Vb<'a> {
        Vb {
            src,
            prefix: String::new(),
            dtype,
            device: device.clone(),
            fp8_block: None,
            loaded: Arc::default(),
        }
    }

    fn mark(&self, full: &str) {
        if let Ok(mut set) = self.loaded.lock() {
            set.insert(full.to_string());
        }
    }

    /// The store's tensors that nothing loaded through this builder (or its children).
    pub fn unread(&self) -> Vec<String> {
        let loaded = self.loaded.lock().map(|s| s.clone()).unwrap_or_default();
        let mut out: Vec<String> = self
            .src
            .names()
            .into_iter()
            .filter(|n| !loaded.contains(n))
            .collect();
        out.sort();
        out
    }

    /// A builder one level down: `vb.pp("model").pp("layers.3")`.
    pub fn pp(&self, part: impl AsRef<str>) -> Vb<'a> {
        let part = part.as_ref();
        let prefix = if self.prefix.is_empty() {
            part.to_string()
        } else {
            format!("{}.{part}", self.prefix)
        };
        Vb {
            prefix,
            ..self.clone()
        }
    }

    pub fn path(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.src.shape(&self.path(name)).is_some()
    }

    pub fn origin(&self) -> &Path {
        self.src.origin()
    }

    /// The tensor `name` with exactly `shape`, in the compute dtype. FP8 block-quantised weights
    /// (a `weight_scale_inv` beside them) are dequantised here.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let full = self.path(name);
        let found = self.src.shape(&full).ok_or_else(|| Error::MissingTensor {
            path: self.src.origin().to_path_buf(),
            name: full.clone(),
        })?;
        if found != shape {
            return Err(Error::Shape {
                path: self.src.origin().to_path_buf(),
                name: full,
                expected: shape.to_vec(),
                got: found,
            });
        }
        let raw = self.src.load(&full, &self.device)?;
        self.mark(&full);
        let scale_name = format!("{full}_scale_inv");
        let t = if raw.dtype() == DType::F8E4M3 && self.src.shape(&scale_name).is_some() {
            let scale = self.src.load(&scale_name, &self.device)?;
            self.mark(&scale_name);
            let dequant = || -> candle_core::Result<Tensor> {
                let block = match self.fp8_block {
                    Some(block) => block,
                    None => crate::model::fp8::infer_block(raw.dims2()?, scale.dims2()?)?,
                };
                if raw.device().is_cuda() {
                    // On the device, one kernel pass straight into the compute dtype.
                    crate::kernels::fp8_dequant(&raw, &scale, block, self.dtype)
                } else {
                    crate::model::fp8::dequantize_blocks_with(&raw, &scale, block)
                }
            };
            dequant().ctx(|| format!("dequantising {full}"))?
        } else {
            raw
        };
        t.to_dtype(self.dtype).ctx(|| format!("converting {full}"))
    }

    /// Like [`Vb::get`] when the tensor may be absent.
    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A tensor of any shape (index tensors such as `d2t`), in its stored dtype.
    pub fn get_raw(&self, name: &str) -> Result<Tensor> {
        let full = self.path(name);
        let t = self.src.load(&full, &self.device)?;
        self.mark(&full);
        Ok(t)
    }

    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.src.shape(&self.path(name))
    }
}
