//! The backward graph behind a loss: how many autograd nodes of each type, which fused attention
//! backward (if any) will run, how many casts autocast inserted, and which trainable parameters
//! receive no gradient at all.
//!
//! ```
//! use speedkit::autograd;
//! use tch::{nn, Device, Kind, Tensor};
//! let vs = nn::VarStore::new(Device::Cpu);
//! let w = vs.root().randn("w", &[4, 4], 0.0, 1.0);
//! let _unused = vs.root().randn("unused", &[4], 0.0, 1.0);
//! let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
//! let loss = x.matmul(&w).sum(None);
//! let summary = autograd::summary(&loss)?.with_parameters(&vs)?;
//! assert_eq!(summary.count("MmBackward0"), 1);
//! assert_eq!(summary.parameters_without_gradient, Some(vec!["unused".to_string()]));
//! println!("{summary}");
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use tch::nn::VarStore;
use tch::Tensor;

use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::report::table;

/// The fused scaled-dot-product-attention backward in a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SdpaBackward {
    /// FlashAttention (`ScaledDotProductFlashAttentionBackward…`).
    Flash,
    /// Memory-efficient attention (`ScaledDotProductEfficientAttentionBackward…`).
    Efficient,
    /// cuDNN attention (`ScaledDotProductCudnnAttentionBackward…`).
    Cudnn,
    /// FlashAttention for CPU (`ScaledDotProductFlashAttentionForCpuBackward…`).
    FlashCpu,
}

impl SdpaBackward {
    fn of(node: &str) -> Option<Self> {
        // Checked before `Flash`, whose node name is a prefix of this one.
        if node.starts_with("ScaledDotProductFlashAttentionForCpuBackward") {
            Some(Self::FlashCpu)
        } else if node.starts_with("ScaledDotProductFlashAttentionBackward") {
            Some(Self::Flash)
        } else if node.starts_with("ScaledDotProductEfficientAttentionBackward") {
            Some(Self::Efficient)
        } else if node.starts_with("ScaledDotProductCudnnAttentionBackward") {
            Some(Self::Cudnn)
        } else {
            None
        }
    }
}

impl fmt::Display for SdpaBackward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Flash => "flash",
            Self::Efficient => "memory-efficient",
            Self::Cudnn => "cuDNN",
            Self::FlashCpu => "flash (CPU)",
        })
    }
}

/// What a loss's backward graph holds; see the [module docs](self).
#[derive(Clone, Debug, Serialize)]
pub struct AutogradSummary {
    /// Distinct autograd nodes reachable from the loss.
    pub nodes: usize,
    /// Nodes by type (`AddmmBackward0`, `AccumulateGrad`, …).
    pub node_types: BTreeMap<String, usize>,
    /// The fused attention backward kernels the graph will run, each with its node count; empty
    /// when attention (if any) runs on the math path, as separate matmul and softmax nodes.
    pub attention_backward: Vec<(SdpaBackward, usize)>,
    /// Dtype casts in the graph (`ToCopyBackward0`): under autocast, mostly the casts it inserted.
    pub casts: usize,
    /// Leaf tensors that receive a gradient (`AccumulateGrad` nodes).
    pub leaves_with_gradient: usize,
    /// Trainable parameters of the VarStore passed to
    /// [`with_parameters`](Self::with_parameters) that receive no gradient from this loss.
    pub parameters_without_gradient: Option<Vec<String>>,
    #[serde(skip)]
    leaf_ids: HashSet<u64>,
}

/// Walks the backward graph of `loss` (see the [module docs](self)). Fails when `loss` has no
/// graph (it does not require grad, or it is a leaf).
pub fn summary(loss: &Tensor) -> Result<AutogradSummary> {
    let (names, leaf_ids) = ffi::autograd::graph(loss)?;
    let mut node_types: BTreeMap<String, usize> = BTreeMap::new();
    for name in &names {
        // C++ node classes come namespaced (`torch::autograd::AccumulateGrad`).
        let short = name.rsplit("::").next().unwrap_or(name);
        *node_types.entry(short.to_string()).or_default() += 1;
    }
    let mut attention: BTreeMap<String, (SdpaBackward, usize)> = BTreeMap::new();
    for (name, &count) in &node_types {
        if let Some(kind) = SdpaBackward::of(name) {
            attention.insert(name.clone(), (kind, count));
        }
    }
    Ok(AutogradSummary {
        nodes: names.len(),
        casts: node_types.get("ToCopyBackward0").copied().unwrap_or(0),
        attention_backward: attention.into_values().collect(),
        node_types,
        leaves_with_gradient: leaf_ids.len(),
        parameters_without_gradient: None,
        leaf_ids: leaf_ids.into_iter().collect(),
    })
}

impl AutogradSummary {
    /// Nodes of type `name` (e.g. `"AddmmBackward0"`); 0 when there are none.
    pub fn count(&self, name: &str) -> usize {
        self.node_types.get(name).copied().unwrap_or(0)
    }

    /// Fills [`parameters_without_gradient`](Self::parameters_without_gradient): the trainable
    /// variables of `vs` (by name, sorted) that no `AccumulateGrad` node of this graph writes.
    pub fn with_parameters(mut self, vs: &VarStore) -> Result<Self> {
        let mut missing = Vec::new();
        for (name, tensor) in vs.variables() {
            if tensor.requires_grad()
                && !self
                    .leaf_ids
                    .contains(&ffi::autograd::tensor_identity(&tensor)?)
            {
                missing.push(name);
            }
        }
        missing.sort();
        self.parameters_without_gradient = Some(missing);
        Ok(self)
    }
}

impl fmt::Display for AutogradSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "backward graph: {} nodes, {} leaves receive gradients",
            self.nodes, self.leaves_with_gradient
        )?;
        if self.attention_backward.is_empty() {
            writeln!(
                f,
                "  attention backward: no fused SDPA node (math path, or no attention)"
            )?;
        }
        for (kind, count) in &self.attention_backward {
            writeln!(f, "  attention backward: {kind} ({count} node(s))")?;
        }
        writeln!(f, "  dtype casts (ToCopyBackward0): {}", self.casts)?;
        match &self.parameters_without_gradient {
            Some(none) if none.is_empty() => {
                writeln!(f, "  every trainable parameter receives a gradient")?
            }
            Some(names) => writeln!(
                f,
                "  trainable parameters without a gradient ({}): {}",
                names.len(),
                names.join(", ")
            )?,
            None => {}
        }
        let mut by_count: Vec<(&String, &usize)> = self.node_types.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let rows: Vec<Vec<String>> = by_count
            .into_iter()
            .map(|(name, count)| vec![name.clone(), count.to_string()])
            .collect();
        f.write_str(&table(&["node type", "count"], &rows))
    }
}

/// Back-propagates from `outputs` with `grad_outputs` as their gradients, adding to the gradients
/// of the leaves they depend on: `torch.autograd.backward(outputs, grad_outputs)`, which tch's
/// `backward` (scalar losses only) does not offer.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let y = &x * 3.0;
/// speedkit::autograd::backward(&[y], &[Tensor::from_slice(&[1.0f32, 2.0, 3.0])])?;
/// assert_eq!(Vec::<f32>::try_from(x.grad())?, [3.0, 6.0, 9.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn backward(outputs: &[Tensor], grad_outputs: &[Tensor]) -> Result<()> {
    if outputs.len() != grad_outputs.len() {
        return Err(SpeedkitError::Misuse(format!(
            "backward: {} outputs but {} gradients",
            outputs.len(),
            grad_outputs.len()
        )));
    }
    ffi::autograd::backward(outputs, grad_outputs)
}

/// The gradients of `inputs` from `outputs` with `grad_outputs` as their gradients, added to no
/// tensor's `grad` (`torch.autograd.grad`); `None` for an input the outputs do not depend on.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
/// let y = &x * &x;
/// let dx = speedkit::autograd::grad(&[y], &[Tensor::ones([2], (Kind::Float, Device::Cpu))], &[&x])?;
/// assert_eq!(Vec::<f32>::try_from(dx[0].as_ref().unwrap())?, [2.0, 2.0]);
/// assert!(!x.grad().defined());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn grad(
    outputs: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[&Tensor],
) -> Result<Vec<Option<Tensor>>> {
    if outputs.len() != grad_outputs.len() {
        return Err(SpeedkitError::Misuse(format!(
            "grad: {} outputs but {} gradients",
            outputs.len(),
            grad_outputs.len()
        )));
    }
    let inputs: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
    ffi::autograd::grad(outputs, grad_outputs, &inputs)
}
