//! The fusion planner: which of a step's kernels one generated kernel could run together.
//!
//! An unchanged tch model runs one ATen kernel per operator: a Llama-style decoder's RMSNorm is
//! six kernels forward (`pow`, `mean`, `add`, `rsqrt`, `mul`, `mul`) and more backward, each
//! reading and writing the whole activation. torch.compile's Inductor fuses such chains into one
//! kernel each. The planner finds the same groups in a [traced step](crate::trace): chains of
//! pointwise, layout and view operators with at most one reduction, within the forward or the
//! backward pass, where running the members as one kernel would not reorder anything outside
//! them. What is left runs ATen's (or a library's) kernel, with the reason.
//!
//! Each group's kernel is [generated](FusedGroup::kernel) as CUDA source, and a [`FusedStep`]
//! runs the step with the generated kernels in place of the groups' ATen kernels.
//!
//! ```
//! use speedkit::fusion::FusionPlan;
//! use speedkit::trace::StepTrace;
//! use tch::{Device, Kind, Tensor};
//!
//! let x = Tensor::randn([64, 32], (Kind::Float, Device::Cpu));
//! let w = Tensor::randn([32], (Kind::Float, Device::Cpu));
//! // RMSNorm as a tch user writes it: five kernels in ATen, one group here.
//! let (_, trace) = StepTrace::record(|| {
//!     let rms = (x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float) + 1e-6).rsqrt();
//!     &x * rms * &w
//! })?;
//! let plan = FusionPlan::from_trace(&trace);
//! assert_eq!(plan.groups().len(), 1);
//! assert_eq!(plan.kernels_after(), 1);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

mod codegen;
mod grouping;
mod ops;
mod recompute;
mod substitution;

pub use codegen::{GeneratedKernel, KernelArg};
pub use ops::OpKind;
pub use substitution::{
    DeclinedGroup, FusedStep, RecomputedResult, SubstitutedGroup, SOURCES_VARIABLE,
};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use serde::Serialize;

use crate::trace::{StepTrace, TracedOp};

/// Kernels of a traced step that one generated kernel could run: see the [module docs](self).
#[derive(Clone, Debug, Default, Serialize)]
pub struct FusionPlan {
    groups: Vec<FusedGroup>,
    left_to_aten: Vec<LeftToAten>,
    kernels_before: usize,
    /// Per group, the results its kernel leaves to the backward to recompute (a runnable plan's).
    #[serde(skip)]
    deferrals: Vec<Vec<recompute::Deferral>>,
}

/// One group: the operators (in the step's order) whose kernels would run as one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FusedGroup {
    /// Its operators in the order the step calls them, views included.
    pub operators: Vec<String>,
    /// How many kernels ATen runs for it (its operators but the views).
    pub aten_kernels: usize,
    /// Its reduction, if it has one.
    pub reduction: Option<String>,
    /// Whether it belongs to the backward pass.
    pub backward: bool,
    /// The operators whose results the backward recomputes instead of the forward saving them
    /// (a [runnable](FusionPlan::generatable) plan's forward groups; see
    /// [`FusedStep`]'s recompute).
    pub recomputed: Vec<String>,
    /// Its operators' calls, as traced.
    #[serde(skip)]
    calls: Vec<TracedOp>,
    /// The keys ([`TracedTensor::key`](crate::trace::TracedTensor::key)) of its results that
    /// the step reads after it, or that nothing in the step reads (the step's own results).
    #[serde(skip)]
    results: Vec<(u64, u64)>,
    /// (call id, storage) of every read of a result computed in the group.
    #[serde(skip)]
    inside: HashSet<(u64, u64)>,
}

impl FusedGroup {
    /// Its operators' calls, as traced, in step order.
    pub fn calls(&self) -> &[TracedOp] {
        &self.calls
    }

    /// The CUDA kernel that computes the group ([`GeneratedKernel`]), or why it is not generated
    /// (today: pointwise operators, the in-place `add_`, `sub_`, `mul_` and `div_` among them,
    /// views, `cat`, `slice_backward` and nearest up-sampling forward and backward, with at most
    /// one `sum`, `mean` or `amax` over the last
    /// dimension or one group norm; fp32, bf16 and fp16; dense results).
    pub fn kernel(&self) -> Result<GeneratedKernel, String> {
        let calls: Vec<&TracedOp> = self.calls.iter().collect();
        codegen::generate(&calls, &self.results, &self.inside)
    }

    /// [`kernel`](Self::kernel) as generated for a GPU of `multiprocessors` SMs, as a
    /// [`FusedStep`] on that GPU generates it: a layer norm's backward runs one wave of blocks,
    /// as many as the SMs hold at once.
    ///
    /// ```
    /// use speedkit::fusion::FusionPlan;
    /// use speedkit::trace::StepTrace;
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let leaf = |kind| Tensor::randn([4096, 768], (kind, Device::Cpu)).set_requires_grad(true);
    /// let (stream, delta) = (leaf(Kind::Float), leaf(Kind::BFloat16));
    /// let param = |v| Tensor::full([768], v, (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let (w, b) = (param(1.0), param(0.0));
    /// let (_, trace) = StepTrace::record(|| {
    ///     // A pre-LN block's norm of its residual stream, cast for the next linear.
    ///     let y = (&stream + &delta).layer_norm([768], Some(&w), Some(&b), 1e-5, false);
    ///     let y = y.to_kind(Kind::BFloat16).to_kind(Kind::Float);
    ///     ((&y * &y).mean(Kind::Float) + stream.sum(Kind::Float)).backward();
    /// })?;
    /// let plan = FusionPlan::generatable(&trace);
    /// let backward = (plan.groups().iter())
    ///     .find(|g| g.operators.iter().any(|o| o == "aten::native_layer_norm_backward"))
    ///     .unwrap();
    /// // 192 threads a block (four columns each), 8 blocks an SM: 1056 blocks on 132 SMs.
    /// assert_eq!(backward.kernel_for(132).unwrap().grid_and_block(), (1056, 192));
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn kernel_for(&self, multiprocessors: u64) -> Result<GeneratedKernel, String> {
        let _target = codegen::for_multiprocessors(multiprocessors);
        self.kernel()
    }
}

/// An operator whose kernels stay ATen's, with how many calls and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LeftToAten {
    /// The operator.
    pub operator: String,
    /// Its kernel-running calls in the step.
    pub calls: usize,
    /// Why it is not fused.
    pub reason: &'static str,
}

const LIBRARY: &str = "a library kernel (GEMM, convolution, attention, embedding, optimizer)";
const NOT_MODELLED: &str = "not modelled by the planner";
const ALONE: &str = "nothing to fuse with where it runs";

impl FusionPlan {
    /// Groups the kernels of `trace` as Inductor would: what fusion could reach.
    pub fn from_trace(trace: &StepTrace) -> FusionPlan {
        FusionPlan::grouped(trace, |_| true, false)
    }

    /// Groups the kernels of `trace` that speedkit's generator takes today
    /// ([`FusedGroup::kernel`]): an operator it does not generate yet stays out of every group,
    /// so that the rest of its chain still fuses; and a group whose result is read before its
    /// last input exists is split there, as one kernel could not run in between. What a
    /// [`FusedStep`] runs.
    pub fn generatable(trace: &StepTrace) -> FusionPlan {
        FusionPlan::grouped(trace, codegen::takes, true)
    }

    fn grouped(trace: &StepTrace, takes: impl Fn(&TracedOp) -> bool, runnable: bool) -> FusionPlan {
        let kernels = trace.kernels();
        let nodes = grouping::data_flow(&kernels);
        let (mut group_of, mut groups) = grouping::group(&nodes, takes);
        if runnable {
            (group_of, groups) = grouping::split_at_early_reads(&nodes, groups);
        }
        let launches = |i: usize| nodes[i].kind.is_none_or(OpKind::launches_kernel);
        let mut plan = FusionPlan {
            kernels_before: (0..nodes.len()).filter(|&i| launches(i)).count(),
            ..FusionPlan::default()
        };
        let mut left: BTreeMap<(&'static str, String), usize> = BTreeMap::new();
        let read_after = grouping::read_outside(&nodes, &group_of);
        let handed_to_leaves = grouping::handed_to_leaves(&nodes, &trace.leaf_gradients());
        let node_of: HashMap<u64, usize> = (nodes.iter().enumerate())
            .map(|(i, node)| (node.op.id, i))
            .collect();
        for group in &groups {
            let aten_kernels = group.members.iter().filter(|&&m| launches(m)).count();
            if aten_kernels >= 2 {
                let name = |m: &usize| nodes[*m].op.name.clone();
                let mut fused = FusedGroup {
                    calls: group.members.iter().map(|&m| nodes[m].op.clone()).collect(),
                    results: grouping::results(
                        &nodes,
                        &group.members,
                        &read_after,
                        &handed_to_leaves,
                    ),
                    inside: grouping::inside_reads(&nodes, &group.members),
                    operators: group.members.iter().map(name).collect(),
                    aten_kernels,
                    reduction: group
                        .members
                        .iter()
                        .find(|&&m| nodes[m].kind == Some(OpKind::Reduction))
                        .map(name),
                    backward: group.backward,
                    recomputed: Vec::new(),
                };
                let deferrals = match runnable {
                    true => recompute::deferrals(&fused, &nodes, &node_of),
                    false => Vec::new(),
                };
                fused.recomputed = deferrals.iter().map(|d| d.member.name.clone()).collect();
                plan.groups.push(fused);
                plan.deferrals.push(deferrals);
            }
        }
        for (i, node) in nodes.iter().enumerate() {
            let fused = group_of[i]
                .is_some_and(|g| groups[g].members.iter().filter(|&&m| launches(m)).count() >= 2);
            if fused || !launches(i) {
                continue;
            }
            let reason = match node.kind {
                Some(kind) if kind.fusable() => ALONE,
                Some(_) => LIBRARY,
                None => NOT_MODELLED,
            };
            *left.entry((reason, node.op.name.clone())).or_default() += 1;
        }
        plan.left_to_aten = left
            .into_iter()
            .map(|((reason, operator), calls)| LeftToAten {
                operator,
                calls,
                reason,
            })
            .collect();
        plan
    }

    /// The groups, in the order the step reaches them.
    pub fn groups(&self) -> &[FusedGroup] {
        &self.groups
    }

    /// The operators left to ATen, by reason and name.
    pub fn left_to_aten(&self) -> &[LeftToAten] {
        &self.left_to_aten
    }

    /// Kernels ATen runs for the step (calls that launch one: views and allocations do not).
    pub fn kernels_before(&self) -> usize {
        self.kernels_before
    }

    /// Kernels the step would run with every group fused: one per group, plus those left to ATen.
    pub fn kernels_after(&self) -> usize {
        self.groups.len() + self.left_to_aten.iter().map(|l| l.calls).sum::<usize>()
    }
}

impl fmt::Display for FusionPlan {
    /// A summary line, the operators left to ATen by reason, and the groups by how often the same
    /// operator sequence recurs (a model's layers repeat theirs).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fused: usize = self.groups.iter().map(|g| g.aten_kernels).sum();
        writeln!(
            f,
            "fusion: {} kernels in the step; {} of them in {} fused groups: {} kernels with every group fused",
            self.kernels_before,
            fused,
            self.groups.len(),
            self.kernels_after()
        )?;
        for reason in [LIBRARY, NOT_MODELLED, ALONE] {
            let rows: Vec<&LeftToAten> = self
                .left_to_aten
                .iter()
                .filter(|l| l.reason == reason)
                .collect();
            if rows.is_empty() {
                continue;
            }
            let calls: usize = rows.iter().map(|l| l.calls).sum();
            let mut rows = rows;
            rows.sort_by(|a, b| b.calls.cmp(&a.calls).then(a.operator.cmp(&b.operator)));
            let names: Vec<String> = rows
                .iter()
                .map(|l| format!("{} {}", l.operator, l.calls))
                .collect();
            writeln!(
                f,
                "  left to ATen, {reason}: {calls} ({})",
                names.join(", ")
            )?;
        }
        let mut recomputed: BTreeMap<&str, usize> = BTreeMap::new();
        for operator in self.groups.iter().flat_map(|g| &g.recomputed) {
            *recomputed.entry(operator.as_str()).or_default() += 1;
        }
        if !recomputed.is_empty() {
            let names: Vec<String> = recomputed
                .iter()
                .map(|(operator, count)| format!("{operator} {count}"))
                .collect();
            writeln!(
                f,
                "  recomputed in the backward instead of saved: {}",
                names.join(", ")
            )?;
        }
        let mut kinds: BTreeMap<(bool, &[String]), usize> = BTreeMap::new();
        for g in &self.groups {
            *kinds.entry((g.backward, &g.operators)).or_default() += 1;
        }
        let mut kinds: Vec<_> = kinds.into_iter().collect();
        // By the kernels they hold in all: the groups that matter most first.
        kinds.sort_by_key(|((_, operators), count)| std::cmp::Reverse(count * operators.len()));
        for ((backward, operators), count) in kinds {
            let pass = if backward { "backward" } else { "forward" };
            let ops: Vec<&str> = operators
                .iter()
                .map(|o| o.trim_start_matches("aten::"))
                .collect();
            writeln!(f, "  {count} x {pass}: {}", ops.join(" > "))?;
        }
        Ok(())
    }
}
