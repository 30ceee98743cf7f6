//! speedkit's error type.

use crate::config::ConfigError;

/// Everything that can go wrong in speedkit, each with a message that says what to do.
///
/// ```
/// use speedkit::SpeedkitError;
/// let e = SpeedkitError::Unsupported("fp8 needs SM >= 8.9".into());
/// assert!(e.to_string().contains("SM >= 8.9"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpeedkitError {
    /// The speed config could not be read or is invalid (boxed: config errors carry locations and
    /// suggestions, and every `Result` in speedkit should stay small).
    #[error(transparent)]
    Config(Box<ConfigError>),
    /// libtorch raised an error (the first line of its message).
    #[error("libtorch: {0}")]
    Torch(String),
    /// The config asks for something this machine cannot do.
    #[error("{0}")]
    Unsupported(String),
    /// An API was used in a way that cannot work (e.g. `unscale` twice in one step).
    #[error("{0}")]
    Misuse(String),
    /// Another thread's speedkit settings are in force and this would change PyTorch's
    /// process-wide flags under it.
    #[error("{0}")]
    ThreadConflict(String),
    /// Flags could not be put back as they were.
    #[error("flags not restored: {0}")]
    Restore(String),
    /// Data-parallel training could not start or a collective failed (bad launch environment,
    /// ranks that disagree, a rank that died or timed out).
    #[error("distributed: {0}")]
    Distributed(String),
    /// A graph could not be captured or replayed.
    #[error("graph capture: {0}")]
    Graph(String),
    /// The device ran out of memory: the phase of the step it happened in, what was allocated, and
    /// what to try. Nothing of the failed step stays allocated and every flag is restored when the
    /// context drops, so the same process can go on with a smaller model or batch.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl From<ConfigError> for SpeedkitError {
    fn from(e: ConfigError) -> Self {
        SpeedkitError::Config(Box::new(e))
    }
}

impl From<tch::TchError> for SpeedkitError {
    fn from(e: tch::TchError) -> Self {
        let text = e.to_string();
        // tch appends libtorch's C++ backtrace; the first lines say what went wrong.
        let first = text
            .split("\nException raised from")
            .next()
            .unwrap_or(&text);
        SpeedkitError::Torch(first.trim().to_owned())
    }
}

/// `Result` with [`SpeedkitError`].
pub type Result<T, E = SpeedkitError> = std::result::Result<T, E>;
