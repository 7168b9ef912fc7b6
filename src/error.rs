//! Library errors: typed, each naming the file or field and what was wrong.

use std::path::PathBuf;

/// Everything the library can refuse. The CLI maps every variant to exit code 2.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
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
    /// A device the build or the machine cannot provide.
    #[error("{0}")]
    Device(String),
    #[error("{context}: {source}")]
    Candle {
        context: String,
        #[source]
        source: candle_core::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
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
        self.map_err(|source| Error::Candle {
            context: context(),
            source,
        })
    }
}
