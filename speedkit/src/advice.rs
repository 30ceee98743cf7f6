//! Advice that acts on the user's model: shapes that keep Tensor Cores from running at full rate,
//! parameters left where they cost time, and sizes under which reduced precision cannot pay off.
//!
//! ```
//! use tch::{nn, Device};
//! let vs = nn::VarStore::new(Device::Cpu);
//! let _layer = nn::linear(vs.root() / "proj", 1000, 513, Default::default());
//! let advice = speedkit::audit(&vs);
//! assert!(advice.warnings.iter().any(|w| w.problem.contains("513")));
//! println!("{advice}");
//! ```

use serde::Serialize;
use std::fmt;
use tch::{nn::VarStore, Device, Kind, Tensor};

use crate::autograd::{self, AutogradSummary};
use crate::error::Result;

/// One finding, with what to do about it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Advice {
    /// The parameter (or `model`) concerned.
    pub subject: String,
    /// What is wrong.
    pub problem: String,
    /// How to fix it.
    pub fix: String,
}

/// The result of [`audit`].
#[derive(Clone, Debug, Default, Serialize)]
pub struct ModelAudit {
    /// Number of parameter tensors.
    pub tensors: usize,
    /// Number of scalar parameters.
    pub parameters: i64,
    /// Findings.
    pub warnings: Vec<Advice>,
    /// The backward graph of a loss of the model, when [`with_backward`](ModelAudit::with_backward)
    /// added it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backward: Option<AutogradSummary>,
    /// Each [`crate::nn::Linear`] (known by its `fp8_amax_history`): whether its weight's shape lets
    /// its GEMMs run in FP8, and why.
    pub fp8: Vec<Fp8Eligibility>,
}

/// Whether a [`crate::nn::Linear`]'s GEMMs can run in FP8, as far as its weight tells.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fp8Eligibility {
    /// The layer's path, e.g. `block0.fc1`.
    pub layer: String,
    /// Whether FP8 is possible for its weight's shape.
    pub possible: bool,
    /// Why, and what else decides at run time.
    pub reason: String,
}

/// FP8 GEMMs (`_scaled_mm`) need every dimension a multiple of 16.
const FP8_MULTIPLE: i64 = 16;

/// The FP8 verdict of every speedkit `Linear` among `named` (sorted by name).
fn fp8_eligibility(named: &[(String, Tensor)]) -> Vec<Fp8Eligibility> {
    named
        .iter()
        .filter_map(|(name, _)| name.strip_suffix(".fp8_amax_history"))
        .filter_map(|layer| {
            let weight = named.iter().find(|(n, _)| *n == format!("{layer}.weight"))?;
            let size = weight.1.size();
            let (possible, reason) = if size.len() == 2 && size.iter().all(|d| d % FP8_MULTIPLE == 0) {
                (
                    true,
                    format!(
                        "weight {size:?}: FP8 where the plan has it, the tokens are a multiple of 16 and, \
                         under fp8.enabled: auto, tokens × {} × {} reaches fp8.min_gemm_size",
                        size[1], size[0]
                    ),
                )
            } else {
                (
                    false,
                    format!("weight {size:?}: FP8 GEMMs need every dimension a multiple of 16"),
                )
            };
            Some(Fp8Eligibility {
                layer: layer.to_owned(),
                possible,
                reason,
            })
        })
        .collect()
}

/// Dimensions of matmul operands should be multiples of 8 for fp16/bf16 Tensor Cores (cuBLAS pads or
/// falls back otherwise); 64 is better still for the large ones.
const TENSOR_CORE_MULTIPLE: i64 = 8;
/// Under this many scalar parameters a step is dominated by kernel launches, not arithmetic.
const SMALL_MODEL: i64 = 1_000_000;
/// Matmuls narrower than this keep Tensor Cores mostly idle.
const NARROW: i64 = 256;

/// Audits every trainable variable of `vs`.
pub fn audit(vs: &VarStore) -> ModelAudit {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    audit_tensors(&named, tch::Cuda::is_available())
}

/// Audits named parameter tensors (e.g. read from a checkpoint); `gpu_available` says whether
/// parameters on the CPU are a finding.
pub fn audit_tensors(named: &[(String, Tensor)], gpu_available: bool) -> ModelAudit {
    let mut audit = ModelAudit {
        tensors: named.len(),
        fp8: fp8_eligibility(named),
        ..Default::default()
    };
    let mut on_cpu = 0i64;
    let mut widest = 0i64;
    for (name, t) in named {
        let numel = t.numel() as i64;
        audit.parameters += numel;
        if t.device() == Device::Cpu && matches!(t.kind(), Kind::Float | Kind::Double) {
            on_cpu += numel;
        }
        let size = t.size();
        // 2-d weights are matmul operands (Linear, Embedding); 4-d conv weights use their channels.
        let dims: Vec<i64> = match size.len() {
            2 => size.clone(),
            4 => size[..2].to_vec(),
            _ => Vec::new(),
        };
        widest = widest.max(dims.iter().copied().max().unwrap_or(0));
        for d in dims {
            if d % TENSOR_CORE_MULTIPLE != 0 && d > TENSOR_CORE_MULTIPLE {
                let padded =
                    (d + TENSOR_CORE_MULTIPLE - 1) / TENSOR_CORE_MULTIPLE * TENSOR_CORE_MULTIPLE;
                audit.warnings.push(Advice {
                    subject: name.clone(),
                    problem: format!(
                        "shape {size:?}: {d} is not a multiple of {TENSOR_CORE_MULTIPLE}, so fp16/bf16 Tensor Core GEMMs run padded or on slower kernels"
                    ),
                    fix: format!("pad the dimension to {padded} (a multiple of 8; 64 for large layers), e.g. round the vocabulary or hidden size up"),
                });
            }
        }
    }
    if gpu_available && on_cpu > 0 {
        audit.warnings.push(Advice {
            subject: "model".into(),
            problem: format!("{on_cpu} fp32 parameters are on the CPU while a CUDA device is available"),
            fix: "let `apply_speedups(&mut vs, &config)` move them, or call `vs.set_device(Device::Cuda(0))`".into(),
        });
    }
    if audit.parameters > 0 && audit.parameters < SMALL_MODEL {
        audit.warnings.push(Advice {
            subject: "model".into(),
            problem: format!(
                "{} parameters: a step is dominated by kernel launches, so bf16/TF32 change little",
                audit.parameters
            ),
            fix: "expect gains from graph capture (`compile: auto`) and larger batches, not from precision".into(),
        });
    } else if widest > 0 && widest < NARROW {
        audit.warnings.push(Advice {
            subject: "model".into(),
            problem: format!("the widest layer has {widest} features: Tensor Cores stay mostly idle below {NARROW}"),
            fix: "batch more rows per step (tokens × batch ≥ a few thousand) before expecting reduced-precision speed-ups".into(),
        });
    }
    audit
}

impl ModelAudit {
    /// Adds the backward graph of `loss` (see [`crate::autograd`]): node types, the fused
    /// attention backward, autocast's casts, and the trainable parameters of `vs` that get no
    /// gradient, which also become a finding.
    ///
    /// ```
    /// use tch::{nn, nn::Module, Device, Kind, Tensor};
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let layer = nn::linear(vs.root() / "used", 8, 8, Default::default());
    /// let _idle = nn::linear(vs.root() / "idle", 8, 8, Default::default());
    /// let loss = layer.forward(&Tensor::randn([4, 8], (Kind::Float, Device::Cpu))).sum(None);
    /// let audit = speedkit::audit(&vs).with_backward(&loss, &vs)?;
    /// assert!(audit.warnings.iter().any(|w| w.subject == "gradients"));
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn with_backward(mut self, loss: &Tensor, vs: &VarStore) -> Result<Self> {
        let summary = autograd::summary(loss)?.with_parameters(vs)?;
        if let Some(names) = summary
            .parameters_without_gradient
            .as_ref()
            .filter(|n| !n.is_empty())
        {
            self.warnings.push(Advice {
                subject: "gradients".into(),
                problem: format!(
                    "{} trainable parameter(s) receive no gradient from the loss: {}",
                    names.len(),
                    names.join(", ")
                ),
                fix: "freeze them (`requires_grad = false`) or leave them out of the optimizer, or check why the forward pass skips them".into(),
            });
        }
        self.backward = Some(summary);
        Ok(self)
    }

    /// Adds the batch-size check: with fewer than `rows` rows per matmul (batch × sequence), a
    /// reduced-precision speed-up is not to be expected.
    pub fn with_batch_rows(mut self, rows: i64) -> Self {
        if rows < 1024 {
            self.warnings.push(Advice {
                subject: "batch".into(),
                problem: format!("{rows} rows per matmul: too few to fill a GPU's Tensor Cores"),
                fix: "raise the batch (or sequence length) to at least ~1024 rows per step, or accumulate gradients over micro-batches".into(),
            });
        }
        self
    }
}

impl fmt::Display for ModelAudit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "model: {} tensors, {} parameters",
            self.tensors, self.parameters
        )?;
        if self.warnings.is_empty() {
            writeln!(f, "  no findings")?;
        }
        for w in &self.warnings {
            writeln!(
                f,
                "  warning [{}]: {}\n    fix: {}",
                w.subject, w.problem, w.fix
            )?;
        }
        for layer in &self.fp8 {
            let verdict = if layer.possible {
                "can run in FP8"
            } else {
                "stays in the autocast dtype"
            };
            writeln!(f, "  fp8: {} {verdict}: {}", layer.layer, layer.reason)?;
        }
        if let Some(backward) = &self.backward {
            write!(f, "{backward}")?;
        }
        Ok(())
    }
}
