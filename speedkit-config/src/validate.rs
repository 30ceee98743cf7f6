//! The rules a parsed config must follow beyond its types.

use crate::error::{ConfigError, Problem};
use crate::types::{AutoBool, Precision};
use crate::SpeedConfig;

/// Every broken rule of `config`, in key order (empty when the config is valid).
pub(crate) fn problems(config: &SpeedConfig) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut report = |path: &str, message: String| {
        problems.push(Problem {
            path: path.to_owned(),
            message,
        });
    };

    if config.deterministic && config.cudnn.benchmark == AutoBool::On {
        report(
            "cudnn.benchmark",
            "is true while `deterministic` is true, but benchmark mode picks convolution \
             algorithms by timing them, which is not deterministic; set `cudnn.benchmark: false` \
             (or `auto`), or `deterministic: false`"
                .to_owned(),
        );
    }

    let compile = &config.compile;
    if compile.max_graphs == 0 {
        report(
            "compile.max_graphs",
            "is 0, so no captured graph could be kept; set it to at least 1 (default 4)".to_owned(),
        );
    }
    if compile.warmup_steps == 0 {
        report(
            "compile.warmup_steps",
            "is 0, but capture needs at least one eager warm-up step; set it to at least 1 \
             (default 3)"
                .to_owned(),
        );
    }

    let sdp = &config.sdp_backend;
    if !(sdp.flash || sdp.mem_efficient || sdp.math || sdp.cudnn) {
        report(
            "sdp_backend",
            "no attention backend left: enable at least one of \
             sdp_backend.flash/mem_efficient/math/cudnn (`math` works everywhere)"
                .to_owned(),
        );
    }

    let fp8 = &config.fp8;
    if !(1..=1024).contains(&fp8.amax_history) {
        report(
            "fp8.amax_history",
            format!(
                "is {}, but the delayed recipe keeps 1 to 1024 steps of amax history (default 16)",
                fp8.amax_history
            ),
        );
    }
    if fp8.enabled == AutoBool::On && config.precision == Precision::Fp32 {
        report(
            "fp8.enabled",
            "is true while `precision` is fp32, but FP8 layers return the autocast dtype; set \
             `precision: bf16` (or auto), or `fp8.enabled: auto` (or false)"
                .to_owned(),
        );
    }

    if config.overrides == AutoBool::On && config.kernels == AutoBool::Off {
        report(
            "overrides",
            "is true while `kernels` is false, but the overrides run speedkit's kernels; set \
             `kernels: auto` (or true), or `overrides: auto` (or false)"
                .to_owned(),
        );
    }

    let scaler = &config.grad_scaler;
    if scaler.enabled == AutoBool::On && config.precision == Precision::Fp32 {
        report(
            "grad_scaler.enabled",
            "is true while `precision` is fp32, but a scaler has nothing to scale in fp32; set \
             `precision: fp16`, or `grad_scaler.enabled: auto` (or false)"
                .to_owned(),
        );
    }
    if !(scaler.init_scale.is_finite() && scaler.init_scale > 0.0) {
        report(
            "grad_scaler.init_scale",
            format!(
                "is {:?}, but it must be a finite number > 0 (default 65536.0 = 2^16)",
                scaler.init_scale
            ),
        );
    }
    if !(scaler.growth_factor.is_finite() && scaler.growth_factor > 1.0) {
        report(
            "grad_scaler.growth_factor",
            format!(
                "is {:?}, but it must be a finite number > 1 so that the scale can grow \
                 (default 2.0)",
                scaler.growth_factor
            ),
        );
    }
    if !(scaler.backoff_factor > 0.0 && scaler.backoff_factor < 1.0) {
        report(
            "grad_scaler.backoff_factor",
            format!(
                "is {:?}, but it must be strictly between 0 and 1 so that the scale shrinks \
                 after an overflow (default 0.5)",
                scaler.backoff_factor
            ),
        );
    }
    if scaler.growth_interval == 0 {
        report(
            "grad_scaler.growth_interval",
            "is 0; set it to at least 1 step (default 2000)".to_owned(),
        );
    }

    if config.bench.steps == 0 {
        report(
            "bench.steps",
            "is 0, so nothing would be timed; set it to at least 1 (default 50)".to_owned(),
        );
    }

    let distributed = &config.distributed;
    if distributed.bucket_mb == 0 || distributed.first_bucket_mb == 0 {
        report(
            "distributed.bucket_mb",
            "bucket sizes must be at least 1 MiB (defaults: bucket_mb 25, first_bucket_mb 1)"
                .to_owned(),
        );
    }
    if distributed.timeout_s == 0 {
        report(
            "distributed.timeout_s",
            "is 0, so every collective would time out at once; set it to at least 1 second \
             (default 300)"
                .to_owned(),
        );
    }

    problems
}

/// `Ok` when there are no problems, else one `Invalid` error listing them all.
pub(crate) fn validate(config: &SpeedConfig) -> Result<(), ConfigError> {
    let problems = problems(config);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid { problems })
    }
}
