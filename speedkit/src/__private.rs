//! What `#[speedkit::accelerate]` and `#[speedkit::bench]` expansions call. Hidden, no stability
//! promise; see docs/DESIGN.md for the contract with `speedkit-macros`.

pub use ::inventory;
pub use ::tch;

use crate::amp::ScaledOptimizer;
use crate::bench::{BenchError, IntoBenchResult};
use crate::config::SpeedConfig;
use crate::error::{Result, SpeedkitError};
use crate::SpeedContext;

/// Where an `#[accelerate]` config comes from; `text` was embedded with `include_str!` and validated
/// at compile time by the same parser.
pub enum ConfigSource {
    /// A YAML (or `.json`) file.
    Yaml {
        /// Absolute path, for messages.
        path: &'static str,
        /// The file's contents.
        text: &'static str,
    },
    /// Inline attribute keys, as JSON.
    Json(&'static str),
    /// No config: `SpeedConfig::auto()`.
    Default,
}

impl ConfigSource {
    fn load(&self) -> Result<SpeedConfig> {
        match self {
            ConfigSource::Yaml { path, text } if path.ends_with(".json") => {
                Ok(SpeedConfig::from_json_str(text)?)
            }
            ConfigSource::Yaml { text, .. } => Ok(SpeedConfig::from_yaml_str(text)?),
            ConfigSource::Json(text) => Ok(SpeedConfig::from_json_str(text)?),
            ConfigSource::Default => Ok(SpeedConfig::auto()),
        }
    }
}

/// Entry of an `#[accelerate]` function.
pub fn enter(source: ConfigSource, function: &'static str) -> Result<SpeedContext> {
    enter_planned(source, function, None)
}

/// Entry of an `#[accelerate]` function that does not return `Result`.
#[track_caller]
pub fn enter_or_panic(source: ConfigSource, function: &'static str) -> SpeedContext {
    match enter(source, function) {
        Ok(ctx) => ctx,
        Err(e) => panic!("speedkit: cannot accelerate `{function}`: {e}"),
    }
}

/// Entry of an `#[accelerate]` function with `VarStore` arguments (`models`): the plan knows the
/// model they hold (`distributed.shard_parameters: auto` decides from its size).
pub fn enter_for_models(
    source: ConfigSource,
    function: &'static str,
    models: &[&tch::nn::VarStore],
) -> Result<SpeedContext> {
    let parameters = crate::context::trainable_parameters(models);
    enter_planned(source, function, Some(parameters))
}

/// The same, for functions that do not return `Result`.
#[track_caller]
pub fn enter_for_models_or_panic(
    source: ConfigSource,
    function: &'static str,
    models: &[&tch::nn::VarStore],
) -> SpeedContext {
    match enter_for_models(source, function, models) {
        Ok(ctx) => ctx,
        Err(e) => panic!("speedkit: cannot accelerate `{function}`: {e}"),
    }
}

/// A `VarStore` argument (the store, a reference or a mutable one) as `&VarStore`.
pub fn var_store<V: std::borrow::Borrow<tch::nn::VarStore>>(vs: &V) -> &tch::nn::VarStore {
    vs.borrow()
}

fn enter_planned(
    source: ConfigSource,
    function: &'static str,
    parameters: Option<u64>,
) -> Result<SpeedContext> {
    let config = source.load()?;
    SpeedContext::planned(&config, crate::hardware::Hardware::detect()?, parameters).map_err(|e| {
        match e {
            SpeedkitError::Unsupported(m) => {
                SpeedkitError::Unsupported(format!("#[speedkit::accelerate] on `{function}`: {m}"))
            }
            other => other,
        }
    })
}

/// After `enter`, for each `VarStore` argument of an `#[accelerate]` function: under a
/// data-parallel launcher, rank 0's parameters and gradient averaging (see
/// [`SpeedContext::data_parallel`]); nothing in a single process.
pub fn data_parallel<V: std::borrow::Borrow<tch::nn::VarStore>>(
    ctx: &SpeedContext,
    vs: &V,
) -> Result<()> {
    ctx.data_parallel(vs.borrow())
}

/// The same, for functions that do not return `Result`.
#[track_caller]
pub fn data_parallel_or_panic<V: std::borrow::Borrow<tch::nn::VarStore>>(
    ctx: &SpeedContext,
    vs: &V,
) {
    if let Err(e) = data_parallel(ctx, vs) {
        panic!("speedkit: cannot start data-parallel training: {e}");
    }
}

/// Scope of a `#[speedkit::forward]` statement.
pub fn autocast_scope(ctx: &SpeedContext) -> crate::context::ForwardScope<'_> {
    ctx.autocast_scope()
}

/// `loss.backward()` of a forward-bound loss.
#[track_caller]
pub fn backward(ctx: &SpeedContext, loss: &tch::Tensor) {
    if let Err(e) = ctx.backward(loss) {
        panic!("speedkit: backward failed: {e}");
    }
}

/// `opt.step()` after such a backward.
#[track_caller]
pub fn step<O: ScaledOptimizer + ?Sized>(ctx: &SpeedContext, opt: &mut O) {
    if let Err(e) = ctx.step(opt) {
        panic!("speedkit: optimizer step failed: {e}");
    }
}

/// `opt.backward_step(&loss)` of a forward-bound loss.
#[track_caller]
pub fn backward_step<O: ScaledOptimizer + ?Sized>(
    ctx: &SpeedContext,
    opt: &mut O,
    loss: &tch::Tensor,
) {
    if let Err(e) = ctx.backward_step(loss, opt) {
        panic!("speedkit: backward_step failed: {e}");
    }
}

/// Lets a workload return `()` or any `Result<(), E>` with a boxable error.
pub fn into_bench_result<R: IntoBenchResult>(r: R) -> std::result::Result<(), BenchError> {
    r.into_bench_result()
}
