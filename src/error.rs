//! Library errors: typed, each naming the file or field and what was wrong.

use std::path::PathBuf;

/// Everything the library can refuse. The CLI maps every variant to exit code 2.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // The underlying errors are fields, not `#[source]`s: the message already holds them, and
    // the CLI prints the whole chain (`{err:#}`), which would say them twice.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: not valid JSON: {error}")]
    Json {
        path: PathBuf,
        error: serde_json::Error,
    },
    #[error("{path}: {message}")]
    Spec { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Weights { path: PathBuf, message: String },
    /// A safetensors header the one header parser refused.
    /// (`error` is not marked `#[source]`: the message already holds it, once.)
    #[error("{path}: {error}")]
    Header {
        path: PathBuf,
        error: Box<crate::readers::safetensors_header::HeaderError>,
    },
    #[error("{path}: tensor {name}: expected shape {expected:?}, found {got:?}")]
    Shape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("{path}: tensor {name} is missing")]
    MissingTensor { path: PathBuf, name: String },
    /// Tensors the checkpoint holds that the architecture, as configured, never reads: running
    /// without them would silently compute another model.
    #[error(
        "{path}: {count} tensor(s) in the checkpoint are never read by a {arch} model as configured \
         (first: {first}){hint}"
    )]
    UnusedTensors {
        path: PathBuf,
        arch: String,
        count: usize,
        first: String,
        hint: String,
    },
    /// A memory budget smaller than the one decoder layer that must be resident to run at all.
    #[error(
        "{budget} is smaller than one decoder layer of {path} (layer {layer}: {} in {dtype}): \
         even streaming the layers one at a time needs that much",
        crate::size::format_bytes(*.need)
    )]
    MemoryBudget {
        path: PathBuf,
        /// The budget and where it came from (`--max-memory 1.00 KiB`, `MemAvailable ...`).
        budget: String,
        layer: usize,
        need: u64,
        dtype: String,
    },
    /// A capture or reference file that decoded but cannot be checked as it is.
    #[error("{path}: {message}")]
    Capture { path: PathBuf, message: String },
    /// Token ids that do not fit the target.
    #[error("{origin}: {message}")]
    Tokens { origin: String, message: String },
    /// A capture file the readers refused (its message names the file).
    #[error(transparent)]
    Read(Box<crate::readers::ReadError>),
    /// A command-line mistake.
    #[error("{0}")]
    Usage(String),
    /// An HF Hub id (`org/name`) the local HF cache cannot resolve; eagle-check never downloads.
    #[error("{id}: {message}")]
    Hub { id: String, message: String },
    /// The probe cannot tell layouts apart: the drafter predicts no better from any layout
    /// than from features of the wrong positions (random weights, or not an EAGLE-3 drafter
    /// of this target).
    #[error("{path}: {message}")]
    NoSignal { path: PathBuf, message: String },
    /// A device the build or the machine cannot provide.
    #[error("{0}")]
    Device(String),
    /// An error and what was being done when it happened (`reading weights in DIR`).
    #[error("{context}: {error}")]
    Context { context: String, error: Box<Error> },
    #[error("{context}: {}", candle_line(.error))]
    Candle {
        context: String,
        error: candle_core::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }

    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Config {
            path: path.into(),
            message: message.into(),
        }
    }

    pub fn weights(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Weights {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl From<crate::readers::ReadError> for Error {
    fn from(e: crate::readers::ReadError) -> Self {
        Error::Read(Box::new(e))
    }
}

/// Adds context to candle errors so that a failing op names what it was computing.
pub trait CandleContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> CandleContext<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|error| Error::Candle {
            context: context(),
            error,
        })
    }
}

/// A candle error on one line: without the backtrace candle appends to its message when
/// `RUST_BACKTRACE` is set (`candle_core::Error::bt`), which would break "one line on stderr".
pub fn candle_line(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_line(inner),
        other => other
            .to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
    }
}
