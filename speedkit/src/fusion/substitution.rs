//! Running a step with its fused groups' generated kernels in place of ATen's.
//!
//! [`FusedStep::prepare`] runs the step once as it is, recording it twice over: PyTorch's
//! execution trace (the operator graph the [plan](super::FusionPlan) groups) and speedkit's
//! interposer, which sees the same calls where they reach the kernels, below autograd. Each group
//! the generator takes becomes part of a program: its calls return their outputs without running
//! ATen's kernels, and its generated kernel runs once the last of its inputs exists. A group is
//! left to ATen, with the reason, where that would change what the step computes: a result read
//! by another call before the group could run, an input written in place in between, a call the
//! interposer does not see.
//!
//! [`FusedStep::run`] runs the step under the program. The step must call the same operators in
//! the same order as the recorded one (a CUDA graph's step does); where it departs, every call from
//! there runs ATen's kernel and `run` returns the departure as an error, after which the step's
//! results are not to be used. speedkit runs the program only while it captures the step as a
//! CUDA graph, where nothing runs before the capture ends, so a departure costs nothing but the
//! capture: it is made again without the program.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use super::codegen::{self, kind_of};
use super::{grouping, recompute, FusedGroup, FusionPlan, GeneratedKernel, KernelArg, OpKind};
use crate::cuda::{Arg, CudaKernel, CudaModule};
use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::ffi::interposer::{Program, RecordedCall, Session};
use crate::ffi::random::{dropout_draw, PhiloxDraw};
use crate::kernels::{self, Arch, CompiledAhead};
use crate::trace::{StepTrace, TracedOp, TracedTensor, TracedValue};

/// A step's fused groups as a program for the interposer; see [`crate::fusion`].
pub struct FusedStep {
    program: Program,
    substituted: Vec<SubstitutedGroup>,
    declined: Vec<DeclinedGroup>,
    recomputed: Vec<RecomputedResult>,
    /// The recorded calls that the step's weights' kept copies serve ([`weight_casts`]).
    kept_copies: Vec<usize>,
    plan: FusionPlan,
    /// The generated kernels compiled before the groups were placed, where the step runs on CUDA.
    compiled_ahead: Option<CompiledAhead>,
}

/// A forward group's result that the backward recomputes instead of the forward saving it: one
/// that only backward calls read, contiguous, of at least 1 MiB, in a group whose recomputed
/// results free more memory than their kernels hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecomputedResult {
    /// The operator that computes it.
    pub operator: String,
    /// The operators its kernel runs, in step order.
    pub operators: Vec<String>,
    /// Its size: the memory not held from the forward to the backward.
    pub bytes: u64,
    /// Whether the backward kernels that read it compute it where they read it (else a kernel of
    /// its own writes it at its first read).
    pub where_read: bool,
}

/// A deferred result's kernel and where it sits in the recorded calls.
struct Recompute {
    /// The recorded call whose result `output` it writes.
    call: usize,
    output: usize,
    /// (recorded call, whether a result of it, position, element of a list) per input of its
    /// kernel: a call's argument, or a result it stored (a group norm's statistics).
    inputs: Vec<(usize, bool, usize, Option<usize>)>,
}

/// A group whose generated kernel runs in place of its ATen kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubstitutedGroup {
    /// Its operators, in step order.
    pub operators: Vec<String>,
    /// The generated kernel's entry point.
    pub kernel: String,
    /// Whether it belongs to the backward pass.
    pub backward: bool,
}

/// A group of the plan whose operators keep ATen's kernels, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeclinedGroup {
    /// Its operators, in step order.
    pub operators: Vec<String>,
    /// Why it is not substituted.
    pub reason: String,
}

/// A group ready to run: its kernel and what its arguments must look like.
struct Launch {
    kernel: Arc<CudaKernel>,
    /// Its second entry point ([`GeneratedKernel::finish`]), launched after it.
    finish: Option<Arc<CudaKernel>>,
    generated: GeneratedKernel,
}

/// A member of a group among the recorded calls.
struct PlacedMember {
    call: usize,
    /// Its position among the trace's kernels.
    at: usize,
    /// For a member the kernel computes (not a view), its results as traced: the layouts the
    /// interposer allocates for it.
    computed: Option<Vec<TracedTensor>>,
}

/// Where one group sits in the recorded calls.
struct Placement {
    /// Its members the interposer sees.
    members: Vec<PlacedMember>,
    /// The recorded call after which the kernel launches.
    launch: usize,
    /// (recorded call, is an output, position, element of a list) per kernel argument.
    args: Vec<(usize, bool, usize, Option<usize>)>,
}

impl FusedStep {
    /// Runs `step` once as it is, recording it, and prepares its program for `device`: the plan,
    /// each group's kernel generated and compiled (NVRTC, through the kernel cache). The outer
    /// error says the step did not run (the recording could not start); once it ran, its result
    /// comes back with the program or why there is none.
    ///
    /// ```no_run
    /// use speedkit::fusion::FusedStep;
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let device = Device::Cuda(0);
    /// let x = Tensor::randn([4096, 1024], (Kind::BFloat16, device));
    /// let w = Tensor::ones([1024], (Kind::BFloat16, device));
    /// let rms_norm = || {
    ///     let rms = (x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::BFloat16) + 1e-6).rsqrt();
    ///     &x * rms * &w
    /// };
    /// let (expected, fused) = FusedStep::prepare(device, rms_norm)?;
    /// let fused = fused?;
    /// let y = fused.run(rms_norm)?; // one generated kernel for ATen's six
    /// assert_eq!(fused.substituted().len(), 1);
    /// assert!(f64::try_from((y - expected).abs().max())? < 1e-2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn prepare<R>(device: Device, step: impl FnOnce() -> R) -> Result<(R, Result<FusedStep>)> {
        let mut ran = None;
        let mut calls = Vec::new();
        let mut recording = None;
        let recorded = StepTrace::record(|| -> Result<()> {
            let mut session = Session::record()?;
            ran = Some(step());
            session.end()?;
            calls = session.recorded()?;
            recording = Some(session);
            Ok(())
        });
        let fused = recorded.and_then(|(session, trace)| {
            session?;
            let fused = FusedStep::from_recording(device, &trace, &calls)?;
            // Made from the weights as the recorded step's optimizer left them: current.
            if let Some(recording) = &recording {
                recording.keep_copies(&fused.kept_copies)?;
            }
            Ok(fused)
        });
        match (ran, fused) {
            (Some(out), fused) => Ok((out, fused)),
            (None, Err(e)) => Err(e),
            (None, Ok(_)) => Err(SpeedkitError::Misuse(
                "the recorded step did not run".into(),
            )),
        }
    }

    fn from_recording(device: Device, trace: &StepTrace, calls: &[RecordedCall]) -> Result<Self> {
        if trace.unmatched_parked_reads() > 0 {
            return Err(SpeedkitError::Unsupported(format!(
                "{} of the backward's reads of saved tensors parked in host memory could not be \
                 matched to the forward's tensors (`compile.warmup_offload: false` traces without \
                 parking)",
                trace.unmatched_parked_reads()
            )));
        }
        // Every kernel below is generated for this GPU: a row kernel's blocks fill its SMs.
        let _target = match device {
            Device::Cuda(index) => Some(codegen::for_multiprocessors(
                ffi::device::cuda_device_props(index)?
                    .multiprocessors
                    .max(1) as u64,
            )),
            _ => None,
        };
        let plan = FusionPlan::generatable(trace);
        let kernels = trace.kernels();
        let recorded = recorded_calls(trace, calls);
        let position: HashMap<u64, usize> = kernels
            .iter()
            .enumerate()
            .map(|(i, op)| (op.id, i))
            .collect();
        let nodes = grouping::data_flow(&kernels);
        let grouped: HashSet<usize> = (plan.groups.iter())
            .flat_map(|g| {
                g.calls()
                    .iter()
                    .filter_map(|op| position.get(&op.id).copied())
            })
            .collect();
        // Only a head start: what it could not do, the loop does one kernel at a time.
        let compiled_ahead = compile_ahead(&plan, &nodes, &position, device)
            .ok()
            .flatten();
        let mut placer = Placer {
            kernels: &kernels,
            position: &position,
            recorded: &recorded,
            grouped: &grouped,
            device,
            compiled: HashMap::new(),
        };
        let (mut launches, mut placements) = (Vec::new(), Vec::new());
        let (mut substituted, mut declined) = (Vec::new(), Vec::new());
        let (mut recomputes, mut recompute_launches, mut recomputed) =
            (Vec::new(), Vec::new(), Vec::new());
        let (mut deferred_before, mut recomputed_keys) = (Vec::new(), Vec::new());
        for (group, deferrals) in plan.groups.iter().zip(&plan.deferrals) {
            match placer.prepare(group, deferrals, &deferred_before, &nodes) {
                Ok(prepared) => {
                    substituted.push(SubstitutedGroup {
                        operators: group.operators.clone(),
                        kernel: prepared.launch.generated.name.clone(),
                        backward: group.backward,
                    });
                    launches.push(prepared.launch);
                    placements.push(prepared.placement);
                    for ((recompute, launch), d) in prepared.deferred.into_iter().zip(deferrals) {
                        recomputes.push(recompute);
                        recompute_launches.push(launch);
                        recomputed.push(RecomputedResult {
                            operator: d.member.name.clone(),
                            operators: d.calls.iter().map(|c| c.name.clone()).collect(),
                            bytes: d.bytes,
                            where_read: false,
                        });
                        recomputed_keys.push(d.result);
                    }
                    for key in prepared.inlined {
                        if let Some(i) = recomputed_keys.iter().position(|&k| k == key) {
                            recomputed[i].where_read = true;
                        }
                    }
                    deferred_before.extend(deferrals);
                }
                Err(reason) => declined.push(DeclinedGroup {
                    operators: group.operators.clone(),
                    reason,
                }),
            }
        }
        launches.extend(recompute_launches);
        let unwritten = unwritten_results(&kernels, &position, &placements, &launches);
        let kept_copies = weight_casts(&kernels, &nodes, &grouped, &recorded);
        let mut program = program(
            device,
            calls,
            &placements,
            &recomputes,
            launches,
            &unwritten,
        )?;
        for &call in &kept_copies {
            program.keep_copy(call)?;
        }
        Ok(FusedStep {
            program,
            substituted,
            declined,
            recomputed,
            kept_copies,
            plan,
            compiled_ahead,
        })
    }

    /// Runs `step` with the generated kernels in place of the substituted groups' ATen kernels.
    /// An error says where the step departed from the recorded one (its results are then not to
    /// be used), or why a kernel could not launch.
    pub fn run<R>(&self, step: impl FnOnce() -> R) -> Result<R> {
        let mut session = Session::run(&self.program)?;
        let out = step();
        session.end()?;
        match session.failure()? {
            None => Ok(out),
            Some(why) => Err(SpeedkitError::Misuse(format!(
                "the fused step departed from the traced one: {why}"
            ))),
        }
    }

    /// Whether a fused step is being prepared or run in this process: while it is, speedkit's
    /// fallback is registered in PyTorch's dispatcher (for the calling thread's operators only).
    ///
    /// ```
    /// assert!(!speedkit::fusion::FusedStep::is_running()?);
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn is_running() -> Result<bool> {
        crate::ffi::interposer::active()
    }

    /// The groups whose generated kernels run, in step order.
    pub fn substituted(&self) -> &[SubstitutedGroup] {
        &self.substituted
    }

    /// The groups left to ATen, with the reasons.
    pub fn declined(&self) -> &[DeclinedGroup] {
        &self.declined
    }

    /// The forward groups' results the backward recomputes instead of the forward saving them.
    pub fn recomputed(&self) -> &[RecomputedResult] {
        &self.recomputed
    }

    /// How many of the step's casts of its weights to a 16-bit type the weights' kept copies
    /// serve (where the weight is a parameter whose copy the optimizer keeps current: then the
    /// cast runs no kernel).
    pub fn kept_copies(&self) -> usize {
        self.kept_copies.len()
    }

    /// One line for the audit: the groups that run generated kernels, how many kernels, and the
    /// groups left to ATen by reason, the commonest first.
    pub fn summary(&self) -> String {
        let kernels: HashSet<&str> = self.substituted.iter().map(|g| g.kernel.as_str()).collect();
        // Per reason, how many groups, and the first one's operators.
        let mut reasons: HashMap<&str, (usize, &[String])> = HashMap::new();
        for declined in &self.declined {
            let entry = (reasons.entry(declined.reason.as_str()))
                .or_insert((0, declined.operators.as_slice()));
            entry.0 += 1;
        }
        let mut reasons: Vec<(&str, (usize, &[String]))> = reasons.into_iter().collect();
        reasons.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(b.0)));
        let reasons: Vec<String> = reasons
            .iter()
            .map(|(why, (count, operators))| {
                let operators: Vec<&str> = (operators.iter())
                    .map(|o| o.trim_start_matches("aten::"))
                    .collect();
                format!("{count} × {why}, as in {}", operators.join(" > "))
            })
            .collect();
        let mut line = format!(
            "{} of the step's {} fused groups run as {} generated kernel(s); {} left to ATen",
            self.substituted.len(),
            self.plan.groups().len(),
            kernels.len(),
            self.declined.len()
        );
        if !reasons.is_empty() {
            line.push_str(&format!(" ({})", reasons.join("; ")));
        }
        if !self.recomputed.is_empty() {
            let bytes: u64 = self.recomputed.iter().map(|r| r.bytes).sum();
            let mut operators: BTreeMap<&str, usize> = BTreeMap::new();
            for r in &self.recomputed {
                *operators.entry(r.operator.as_str()).or_default() += 1;
            }
            let operators: Vec<String> = operators
                .iter()
                .map(|(operator, count)| format!("{count} × {operator}"))
                .collect();
            let where_read = self.recomputed.iter().filter(|r| r.where_read).count();
            line.push_str(&format!(
                "; {} forward result(s) recomputed in the backward instead of saved ({}; {:.0} MiB), \
                 {where_read} of them by the kernels that read them",
                self.recomputed.len(),
                operators.join(", "),
                bytes as f64 / (1u64 << 20) as f64
            ));
        }
        if !self.kept_copies.is_empty() {
            line.push_str(&format!(
                "; {} cast(s) of weights to 16 bits served from their kept copies",
                self.kept_copies.len()
            ));
        }
        if let Some(compiled) = &self.compiled_ahead {
            line.push_str(&format!("; {compiled}"));
        }
        line
    }

    /// The plan the program was made from.
    pub fn plan(&self) -> &FusionPlan {
        &self.plan
    }
}

/// Each traced call's RecordFunction handle → the recorded call below autograd that it is.
fn recorded_calls(trace: &StepTrace, calls: &[RecordedCall]) -> HashMap<u64, usize> {
    let mut recorded: HashMap<u64, usize> = calls
        .iter()
        .enumerate()
        .filter(|(_, c)| c.rf_id != 0)
        .map(|(i, c)| (c.rf_id, i))
        .collect();
    for (outer, inner) in redispatched(trace) {
        if let Some(&call) = recorded.get(&inner) {
            recorded.entry(outer).or_insert(call);
        }
    }
    recorded
}

/// What placing a group takes: the traced step, its recorded calls, the kernels compiled so far.
struct Placer<'a> {
    kernels: &'a [&'a TracedOp],
    position: &'a HashMap<u64, usize>,
    recorded: &'a HashMap<u64, usize>,
    /// The positions of every group's members.
    grouped: &'a HashSet<usize>,
    device: Device,
    compiled: HashMap<String, Arc<CudaKernel>>,
}

/// A group ready to substitute: its kernel, where it sits, its deferred results' kernels, and the
/// keys of earlier groups' deferred results it computes where it reads them.
struct Prepared {
    launch: Launch,
    placement: Placement,
    deferred: Vec<(Recompute, Launch)>,
    inlined: Vec<(u64, u64)>,
}

impl Placer<'_> {
    /// `group`'s kernel placed and compiled, with the kernels of its `deferrals`; a backward group
    /// computes the results of `deferred_before` it reads where it reads them.
    fn prepare(
        &mut self,
        group: &FusedGroup,
        deferrals: &[recompute::Deferral],
        deferred_before: &[&recompute::Deferral],
        nodes: &[grouping::Node],
    ) -> std::result::Result<Prepared, String> {
        let inlined = recompute::inlined_kernel(group, deferred_before, nodes, self.position);
        let generated = match &inlined {
            Some(inlined) => inlined.kernel.clone(),
            None => group_kernel(group, deferrals)?,
        };
        let placement = place(
            group,
            &generated,
            inlined.as_ref().map_or(&[], |i| &i.calls),
            self,
            nodes,
        )?;
        let launch = compile(generated, self.device, &mut self.compiled)?;
        let mut deferred = Vec::with_capacity(deferrals.len());
        for d in deferrals {
            let launch = compile(d.kernel.clone(), self.device, &mut self.compiled)?;
            deferred.push((recompute_inputs(d, self.recorded)?, launch));
        }
        Ok(Prepared {
            launch,
            placement,
            deferred,
            inlined: inlined.map_or(Vec::new(), |i| i.results),
        })
    }
}

/// The kernels the placing loop will load where every group is placed (each group's kernel, the
/// variant computing earlier groups' deferred results where it reads them, and its deferrals'),
/// registered and compiled ahead on several threads ([`kernels::compile_ahead`]), so that a cold
/// start waits for the longest compile rather than their sum. A group declined on the way changes
/// what later groups generate; those few compile as they load.
fn compile_ahead(
    plan: &FusionPlan,
    nodes: &[grouping::Node],
    position: &HashMap<u64, usize>,
    device: Device,
) -> Result<Option<CompiledAhead>> {
    let Device::Cuda(index) = device else {
        return Ok(None);
    };
    let mut modules = Vec::new();
    let mut deferred_before: Vec<&recompute::Deferral> = Vec::new();
    for (group, deferrals) in plan.groups.iter().zip(&plan.deferrals) {
        let generated = match recompute::inlined_kernel(group, &deferred_before, nodes, position) {
            Some(inlined) => Ok(inlined.kernel),
            None => group_kernel(group, deferrals),
        };
        // As the loop: a group that cannot be generated is declined, its deferrals with it.
        let Ok(generated) = generated else {
            continue;
        };
        for kernel in std::iter::once(&generated).chain(deferrals.iter().map(|d| &d.kernel)) {
            modules.push(CudaModule::new(
                &format!("{}.cu", kernel.name),
                &kernel.source,
            )?);
        }
        deferred_before.extend(deferrals);
    }
    let props = ffi::device::cuda_device_props(index)?;
    let arch = Arch {
        major: props.major.max(0) as u32,
        minor: props.minor.max(0) as u32,
    };
    kernels::compile_ahead(&modules, arch).map(Some)
}

/// `group`'s kernel, storing its results but the `deferrals`.
fn group_kernel(
    group: &FusedGroup,
    deferrals: &[recompute::Deferral],
) -> std::result::Result<GeneratedKernel, String> {
    let generated = group.kernel()?;
    if deferrals.is_empty() {
        return Ok(generated);
    }
    let stored: Vec<(u64, u64)> = (group.results.iter().copied())
        .filter(|key| deferrals.iter().all(|d| d.result != *key))
        .collect();
    let calls: Vec<&TracedOp> = group.calls.iter().collect();
    codegen::generate(&calls, &stored, &group.inside)
}

/// (outer, inner) RecordFunction handles of calls the interposer sees as one of the calls they
/// make: one that takes the same tensors at the same positions and returns the same results.
/// Autocast's wrapper of an operator it runs in fp32 (`pow`, `rsqrt`, `sum`, ...) on inputs already
/// of that type calls its own operator again; a composite that autograd decomposes (`square` into
/// `pow`, `where` with a number into `where` of a tensor) calls the one that runs. The trace's
/// kernel-level call is the outer one; the interposer, below autocast and autograd, sees the inner
/// one. Where the two differ in what they take (autocast cast an input first; `rsub` swaps its
/// operands), the outer call stays unmatched. Innermost first, so that a chain of such calls maps
/// to the one that runs.
fn redispatched(trace: &StepTrace) -> Vec<(u64, u64)> {
    let mut children: HashMap<u64, Vec<&TracedOp>> = HashMap::new();
    for op in trace.ops() {
        if let Some(parent) = op.parent {
            children.entry(parent).or_default().push(op);
        }
    }
    let mut pairs: Vec<(u64, u64, u64)> = (trace.ops().iter())
        .filter(|outer| outer.rf_id != 0)
        .filter_map(|outer| {
            let made = children.get(&outer.id)?;
            let [inner] = (made.iter())
                .filter(|inner| same_results(outer, inner))
                .collect::<Vec<_>>()[..]
            else {
                return None;
            };
            takes_the_same_tensors(outer, inner).then_some((outer.id, outer.rf_id, inner.rf_id))
        })
        .collect();
    pairs.sort_unstable_by_key(|&(id, _, _)| std::cmp::Reverse(id));
    pairs
        .into_iter()
        .map(|(_, outer, inner)| (outer, inner))
        .collect()
}

/// Whether `inner` returns the tensors `outer` returns (at least one), in order.
fn same_results(outer: &TracedOp, inner: &TracedOp) -> bool {
    let keys = |op: &TracedOp| op.output_tensors().map(|t| t.key()).collect::<Vec<_>>();
    let outer_keys = keys(outer);
    !outer_keys.is_empty() && outer_keys == keys(inner)
}

/// Whether every tensor argument of `outer` is `inner`'s at the same position (lists element by
/// element): a kernel argument found by position in one is found in the other.
fn takes_the_same_tensors(outer: &TracedOp, inner: &TracedOp) -> bool {
    outer.inputs.iter().enumerate().all(|(i, value)| {
        let theirs = value.tensors();
        theirs.is_empty()
            || inner.inputs.get(i).is_some_and(|v| {
                let ours = v.tensors();
                ours.len() == theirs.len()
                    && ours.iter().zip(theirs).all(|(a, b)| a.key() == b.key())
            })
    })
}

/// The environment variable naming a directory where each generated kernel's source is written
/// as it is compiled (`<entry point>.cu`, the name the profiler shows), to read what a fused group
/// runs.
///
/// ```
/// // SPEEDKIT_FUSION_SOURCES=target/fused cargo run --release --example ...
/// assert_eq!(speedkit::fusion::SOURCES_VARIABLE, "SPEEDKIT_FUSION_SOURCES");
/// ```
pub const SOURCES_VARIABLE: &str = "SPEEDKIT_FUSION_SOURCES";

/// The launch of `generated`: its entry points compiled with NVRTC, each once (its source written
/// to [`SOURCES_VARIABLE`]'s directory where that is set).
fn compile(
    generated: GeneratedKernel,
    device: Device,
    compiled: &mut HashMap<String, Arc<CudaKernel>>,
) -> std::result::Result<Launch, String> {
    let mut entry = |name: &str| -> std::result::Result<Arc<CudaKernel>, String> {
        if let Some(kernel) = compiled.get(name) {
            return Ok(kernel.clone());
        }
        if let Some(dir) = std::env::var_os(SOURCES_VARIABLE) {
            let path = std::path::Path::new(&dir).join(format!("{}.cu", generated.name));
            std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(&path, &generated.source))
                .map_err(|e| format!("cannot write its source to {}: {e}", path.display()))?;
        }
        let kernel = CudaModule::new(&format!("{}.cu", generated.name), &generated.source)
            .and_then(|m| m.kernel(name, &generated.params(), device))
            .map_err(|e| format!("its kernel does not compile: {e}"))?;
        let kernel = Arc::new(kernel);
        compiled.insert(name.to_string(), kernel.clone());
        Ok(kernel)
    };
    let kernel = entry(&generated.name)?;
    let finish = generated
        .finish
        .as_ref()
        .map(|f| entry(&f.name))
        .transpose()?;
    Ok(Launch {
        kernel,
        finish,
        generated,
    })
}

/// Where `group` sits in the recorded calls, or why it cannot run as one kernel there.
fn place(
    group: &FusedGroup,
    generated: &GeneratedKernel,
    inlined: &[TracedOp],
    placer: &Placer,
    nodes: &[grouping::Node],
) -> std::result::Result<Placement, String> {
    let (kernels, position, recorded) = (placer.kernels, placer.position, placer.recorded);
    let members = group.calls();
    // A view the interposer does not see (a composite `to` that handed back its input) runs
    // as it is; it only matters where a kernel argument is taken from it.
    let mut placed = Vec::with_capacity(members.len());
    for op in members {
        let view = OpKind::of(&op.name) == Some(OpKind::View);
        match recorded.get(&op.rf_id).filter(|_| op.rf_id != 0) {
            Some(&call) => placed.push(Some(PlacedMember {
                call,
                at: position[&op.id],
                computed: (!view).then(|| op.output_tensors().cloned().collect()),
            })),
            None if view => placed.push(None),
            None => return Err(format!("{} is not seen below autograd", op.name)),
        }
    }
    // Each argument where the generator read it (inputs) or computed it (results).
    let member_of: HashMap<u64, usize> = members
        .iter()
        .enumerate()
        .map(|(m, op)| (op.id, m))
        .collect();
    let inlined: HashMap<u64, &TracedOp> = inlined.iter().map(|op| (op.id, op)).collect();
    let mut args = Vec::with_capacity(generated.args.len());
    let mut last_input = 0;
    for (source, arg) in generated.sources.iter().zip(&generated.args) {
        // An input (or a stored statistic) of a forward call whose result the kernel computes
        // again: seen long before.
        if let Some(op) = inlined.get(&source.call) {
            let call = (recorded.get(&op.rf_id))
                .filter(|_| op.rf_id != 0)
                .ok_or_else(|| format!("{} is not seen below autograd", op.name))?;
            args.push((*call, source.output, source.position, source.element));
            continue;
        }
        let member = *member_of
            .get(&source.call)
            .ok_or("an argument of its kernel no member takes or makes")?;
        if let (false, KernelArg::Input(tensor)) = (source.output, arg) {
            let reader = position[&members[member].id];
            match held_before(placer, nodes, reader, tensor, position[&members[0].id]) {
                Some(held) => {
                    args.push(held);
                    continue;
                }
                None => last_input = last_input.max(member),
            }
        }
        let placed_member = placed[member]
            .as_ref()
            .ok_or_else(|| format!("{} is not seen below autograd", members[member].name))?;
        args.push((
            placed_member.call,
            source.output,
            source.position,
            source.element,
        ));
    }
    // An in-place member's result is its argument, which the kernel writes: it launches once
    // that argument is seen.
    if let Some(last_in_place) = members.iter().rposition(codegen::writes_in_place) {
        last_input = last_input.max(last_in_place);
    }
    let member_at: HashSet<usize> = members
        .iter()
        .filter_map(|op| position.get(&op.id))
        .copied()
        .collect();
    let (first, launch_at) = (position[&members[0].id], position[&members[last_input].id]);
    check_nothing_between(generated, kernels, &member_at, first, launch_at)?;
    let launch = match &placed[last_input] {
        Some(member) => member.call,
        None => {
            return Err(format!(
                "{} is not seen below autograd",
                members[last_input].name
            ))
        }
    };
    Ok(Placement {
        launch,
        members: placed.into_iter().flatten().collect(),
        args,
    })
}

/// Where a recorded call before the group's first member (`first`) takes `tensor`, which the
/// member at `reader` reads ([`grouping::earlier_holder`]), as an argument: (recorded call, is an
/// output (no), position, element of a list). The interposer keeps it from that call, with its
/// version, which the launch checks.
fn held_before(
    placer: &Placer,
    nodes: &[grouping::Node],
    reader: usize,
    tensor: &TracedTensor,
    first: usize,
) -> Option<(usize, bool, usize, Option<usize>)> {
    let q = grouping::earlier_holder(nodes, placer.grouped, reader, tensor, first)?;
    let op = placer.kernels[q];
    let call = *placer.recorded.get(&op.rf_id).filter(|_| op.rf_id != 0)?;
    let same = |t: &TracedTensor| grouping::same_elements(t, tensor);
    op.inputs
        .iter()
        .enumerate()
        .find_map(|(position, value)| match value {
            TracedValue::Tensor(t) if same(t) => Some((call, false, position, None)),
            TracedValue::Tensors(ts) => {
                (ts.iter().position(same)).map(|element| (call, false, position, Some(element)))
            }
            _ => None,
        })
}

/// Between the group's first member and its launch, no other call may read what the group
/// writes (it would read it unwritten) or write what the group reads (the kernel would read the
/// new values where ATen's kernels read the old).
///
/// The trace names memory by address, which the allocator reuses: a tensor counts as the group's
/// from the member that reads or makes it until a call makes new memory at that address (the
/// tensor was freed; the interposer holds the group's own until the launch, so there they do not
/// meet).
fn check_nothing_between(
    generated: &GeneratedKernel,
    kernels: &[&TracedOp],
    member_at: &HashSet<usize>,
    first: usize,
    launch_at: usize,
) -> std::result::Result<(), String> {
    let mut written: HashSet<u64> = HashSet::new();
    let mut read: HashSet<u64> = HashSet::new();
    for arg in &generated.args {
        match arg {
            KernelArg::Output(t) => written.insert(t.storage),
            KernelArg::Input(t) | KernelArg::Scalar(t) => read.insert(t.storage),
        };
    }
    first_conflict(kernels, member_at, first, launch_at, &read, &written).map_or(Ok(()), Err)
}

/// The first call of `kernels[first..=launch_at]` outside the group (`member_at`) that reads what
/// the group writes (storages `written`) or writes in place what it reads (`read`), as
/// [`check_nothing_between`] says; `None` where there is none.
fn first_conflict(
    kernels: &[&TracedOp],
    member_at: &HashSet<usize>,
    first: usize,
    launch_at: usize,
    read: &HashSet<u64>,
    written: &HashSet<u64>,
) -> Option<String> {
    // The memory that holds the group's inputs and results at this point of the trace.
    let (mut inputs_held, mut results_held): (HashSet<u64>, HashSet<u64>) = Default::default();
    for (q, op) in kernels.iter().enumerate().take(launch_at + 1).skip(first) {
        if member_at.contains(&q) {
            inputs_held.extend(
                op.input_tensors()
                    .map(|t| t.storage)
                    .filter(|s| read.contains(s)),
            );
            results_held.extend(
                op.output_tensors()
                    .map(|t| t.storage)
                    .filter(|s| written.contains(s)),
            );
            continue;
        }
        if op
            .input_tensors()
            .any(|t| results_held.contains(&t.storage))
        {
            return Some(format!(
                "{} reads a result before the group's last input exists",
                op.name
            ));
        }
        let inputs: HashSet<(u64, u64)> = op.input_tensors().map(|t| t.key()).collect();
        if op
            .output_tensors()
            .any(|t| inputs.contains(&t.key()) && inputs_held.contains(&t.storage))
        {
            return Some(format!(
                "{} writes an input of the group in place before it runs",
                op.name
            ));
        }
        // New memory: whatever the group read or made at that address was freed in the trace.
        let storages: HashSet<u64> = op.input_tensors().map(|t| t.storage).collect();
        for t in op
            .output_tensors()
            .filter(|t| !storages.contains(&t.storage))
        {
            inputs_held.remove(&t.storage);
            results_held.remove(&t.storage);
        }
    }
    None
}

/// Where `deferral`'s kernel finds its inputs among the recorded calls, and the call whose result
/// it writes.
fn recompute_inputs(
    deferral: &recompute::Deferral,
    recorded: &HashMap<u64, usize>,
) -> std::result::Result<Recompute, String> {
    let call_of = |op: &TracedOp| {
        recorded
            .get(&op.rf_id)
            .filter(|_| op.rf_id != 0)
            .copied()
            .ok_or_else(|| format!("{} is not seen below autograd", op.name))
    };
    let by_id: HashMap<u64, &TracedOp> = deferral.calls.iter().map(|op| (op.id, op)).collect();
    let mut inputs = Vec::new();
    let reads = (deferral.kernel.args.iter())
        .zip(&deferral.kernel.sources)
        .filter(|(arg, _)| !matches!(arg, KernelArg::Output(_)));
    for (_, source) in reads {
        let op = by_id
            .get(&source.call)
            .ok_or("an argument of its kernel no member takes")?;
        inputs.push((call_of(op)?, source.output, source.position, source.element));
    }
    let output = (deferral.member.outputs.iter())
        .position(|v| matches!(v, TracedValue::Tensor(t) if t.key() == deferral.result))
        .ok_or("a deferred result its call does not make")?;
    Ok(Recompute {
        call: call_of(&deferral.member)?,
        output,
        inputs,
    })
}

/// The computed members' results whose memory no kernel writes or reads, by (recorded call, output):
/// intermediates of their groups, which only the group's later members take (themselves
/// substituted), so that the interposer hands them out without memory. Memory counts by
/// allocation, not by storage id, which the trace reuses with freed addresses.
fn unwritten_results(
    kernels: &[&TracedOp],
    position: &HashMap<u64, usize>,
    placements: &[Placement],
    launches: &[Launch],
) -> HashSet<(usize, usize)> {
    let allocations = grouping::Allocations::of(kernels);
    let mut touched = HashSet::new();
    for launch in launches {
        let generated = &launch.generated;
        for (source, arg) in generated.sources.iter().zip(&generated.args) {
            let storage = arg.tensor().storage;
            match position.get(&source.call) {
                Some(&at) => {
                    touched.insert(allocations.holding(storage, at));
                }
                // A source outside the trace's kernels: every allocation at its address counts.
                None => touched.extend(allocations.all(storage)),
            }
        }
    }
    let mut unwritten = HashSet::new();
    for member in placements.iter().flat_map(|p| &p.members) {
        for (k, t) in member.computed.iter().flatten().enumerate() {
            if !touched.contains(&allocations.holding(t.storage, member.at)) {
                unwritten.insert((member.call, k));
            }
        }
    }
    unwritten
}

/// The interposer's program: every recorded call, the substituted groups' members among them, and
/// the recomputed results' kernels (groups numbered after the substituted ones).
fn program(
    device: Device,
    calls: &[RecordedCall],
    placements: &[Placement],
    recomputes: &[Recompute],
    launches: Vec<Launch>,
    unwritten: &HashSet<(usize, usize)>,
) -> Result<Program> {
    let mut role: HashMap<usize, (usize, &PlacedMember, bool)> = HashMap::new();
    for (g, placement) in placements.iter().enumerate() {
        for member in &placement.members {
            role.insert(member.call, (g, member, member.call == placement.launch));
        }
    }
    let mut draws = HashMap::new();
    let mut program = Program::new(device, move |g, tensors| {
        launch(&launches[g], tensors, &mut draws)
    })?;
    for (i, call) in calls.iter().enumerate() {
        let (group, computed, launch) = match role.get(&i) {
            Some(&(g, member, launch)) => (Some(g), member.computed.as_deref(), launch),
            None => (None, None, false),
        };
        program.add_call(&call.op, group, computed.is_some(), launch, call.span)?;
        if let Some(outputs) = computed {
            for (k, t) in outputs.iter().enumerate() {
                let kind = kind_of(&t.dtype).ok_or_else(|| {
                    SpeedkitError::Misuse(format!("a fused result of type {}", t.dtype))
                })?;
                let unwritten = unwritten.contains(&(i, k));
                program.add_output(i, kind, &t.shape, &t.strides, unwritten)?;
            }
        }
    }
    for (g, placement) in placements.iter().enumerate() {
        for &(call, output, index, element) in &placement.args {
            program.add_arg(g, call, output, index, element)?;
        }
    }
    for (r, recompute) in recomputes.iter().enumerate() {
        let g = placements.len() + r;
        for &(call, output, index, element) in &recompute.inputs {
            program.add_arg(g, call, output, index, element)?;
        }
        program.defer(recompute.call, recompute.output, g)?;
    }
    Ok(program)
}

/// The recorded calls of casts to a 16-bit type, left to ATen, of tensors the step does not
/// compute (its weights, before the optimizer writes them): under autocast, one small kernel per
/// weight and bias each step (and again in the backward where a layer saved the fp32 weight
/// instead of its cast, as speedkit's convolution does). The interposer serves each from the
/// weight's copy that speedkit's AdamW keeps current (`shim/weight_casts.cpp`) where the tensor is
/// a parameter, and lets ATen cast any other.
///
/// Only the casts of weights the step already holds in 16 bits through its peak: one of whose
/// forward casts the backward reads (saved by autograd, as ATen's convolution and matmul save
/// theirs). A kept copy of any other weight would add its size to the peak, where the layer keeps
/// no cast (speedkit's convolution: `resnet`'s 21 MiB of copies took its whole run's peak from
/// 0.75 to 0.77 GiB, against reduce-overhead's 0.75, for 3% of its step).
fn weight_casts(
    kernels: &[&TracedOp],
    nodes: &[grouping::Node],
    grouped: &HashSet<usize>,
    recorded: &HashMap<u64, usize>,
) -> Vec<usize> {
    let mut computed: HashSet<u64> = HashSet::new();
    // (kernel, the weight's storage) per cast a kept copy could serve.
    let mut casts = Vec::new();
    for (i, op) in kernels.iter().enumerate() {
        let input = match op.inputs.first() {
            Some(TracedValue::Tensor(t)) => Some(t),
            _ => None,
        };
        let weight = input
            .filter(|t| kind_of(&t.dtype) == Some(Kind::Float) && !computed.contains(&t.storage));
        let to_16_bits = matches!(op.outputs.as_slice(), [TracedValue::Tensor(out)]
            if matches!(kind_of(&out.dtype), Some(Kind::BFloat16 | Kind::Half)));
        if let Some(weight) =
            weight.filter(|_| op.name == "aten::_to_copy" && to_16_bits && !grouped.contains(&i))
        {
            casts.push((i, weight.storage));
        }
        computed.extend(op.output_tensors().map(|t| t.storage));
    }
    let read_in_backward =
        |i: usize| (nodes.iter()).any(|n| n.op.backward && n.reads.iter().any(|&(d, _)| d == i));
    let held: HashSet<u64> = (casts.iter())
        .filter(|&&(i, _)| !kernels[i].backward && read_in_backward(i))
        .map(|&(_, weight)| weight)
        .collect();
    (casts.into_iter())
        .filter(|(_, weight)| held.contains(weight))
        .filter_map(|(i, _)| {
            recorded
                .get(&kernels[i].rf_id)
                .filter(|_| kernels[i].rf_id != 0)
        })
        .copied()
        .collect()
}

/// Launches one group's kernel on its arguments' tensors, each checked against its traced layout
/// (the kernel's index arithmetic assumes it). `draws`: the stretch of the CUDA generator each
/// dropout's forward kernel reserved, by its traced call, which a kernel computing its mask again
/// in the backward draws once more.
fn launch(launch: &Launch, tensors: &[Tensor], draws: &mut HashMap<u64, PhiloxDraw>) -> Result<()> {
    let generated = &launch.generated;
    if tensors.len() != generated.args.len() {
        return Err(SpeedkitError::Misuse(format!(
            "{} takes {} arguments, the step gave {}",
            generated.name,
            generated.args.len(),
            tensors.len()
        )));
    }
    let mut args: Vec<Arg> = Vec::with_capacity(tensors.len() + 1);
    for ((t, arg), &alignment) in tensors
        .iter()
        .zip(&generated.args)
        .zip(&generated.alignment)
    {
        let traced = arg.tensor();
        if let KernelArg::Scalar(_) = arg {
            args.push(Arg::F64(t.f_double_value(&[])?));
            continue;
        }
        if t.size() != traced.shape || t.stride() != traced.strides {
            return Err(SpeedkitError::Misuse(format!(
                "{}: an argument of sizes {:?} and strides {:?} where the trace had {:?} and {:?}",
                generated.name,
                t.size(),
                t.stride(),
                traced.shape,
                traced.strides
            )));
        }
        if alignment > 0 && t.data_ptr() as usize % alignment != 0 {
            return Err(SpeedkitError::Misuse(format!(
                "{}: an argument at an address not aligned to the {alignment} bytes its \
                 vectorised loads assume",
                generated.name
            )));
        }
        args.push(Arg::Strided(t));
    }
    // Allocated here, on the current stream, so that a captured step's replays each start from
    // zeros where the kernel counts in it (the memset is captured with the kernel).
    let workspace = match (generated.workspace, tensors.first()) {
        (0, _) | (_, None) => None,
        (floats, Some(t)) if generated.zeroed_workspace => {
            Some(Tensor::f_zeros([floats as i64], (Kind::Float, t.device()))?)
        }
        (floats, Some(t)) => Some(Tensor::f_empty([floats as i64], (Kind::Float, t.device()))?),
    };
    for state in drawn(generated, draws)? {
        args.extend([
            Arg::I64(state.seed as i64),
            Arg::I64(state.offset as i64),
            Arg::I64(state.intragraph as i64),
            Arg::U32(state.threads),
            Arg::I32(state.captured),
        ]);
    }
    if let Some(workspace) = &workspace {
        args.push(Arg::Strided(workspace));
    }
    args.push(Arg::I64(generated.numel as i64));
    let (grid, block) = generated.grid_and_block();
    launch.kernel.launch(grid, block, 0, &args)?;
    match (&launch.finish, &generated.finish) {
        (Some(kernel), Some(finish)) => {
            let (grid, block) = finish.grid_and_block();
            kernel.launch(grid, block, 0, &args)
        }
        _ => Ok(()),
    }
}

/// The stretch of the CUDA generator each of `generated`'s dropouts draws from, in its order:
/// reserved as ATen's call would reserve it (and kept in `draws` by its traced call), or, for a
/// mask drawn again in the backward, the one its forward kernel reserved.
fn drawn(
    generated: &GeneratedKernel,
    draws: &mut HashMap<u64, PhiloxDraw>,
) -> Result<Vec<PhiloxDraw>> {
    let mut states = Vec::with_capacity(generated.draws.len());
    for draw in &generated.draws {
        let state = match draw.replays {
            false => {
                let state = dropout_draw(draw.numel)?;
                draws.insert(draw.call, state);
                state
            }
            true => *draws.get(&draw.call).ok_or_else(|| {
                SpeedkitError::Misuse(format!(
                    "{}: a dropout's mask computed again before its forward kernel drew it",
                    generated.name
                ))
            })?,
        };
        states.push(state);
    }
    Ok(states)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::testing::{call, tensor};

    /// Calls 0 and 3 are the group's: `mul` reads input storage 10 and writes result storage 20,
    /// `exp` reads the result; `between` are calls 1 and 2, outside it.
    fn conflict_with(between: [TracedOp; 2]) -> Option<String> {
        let [one, two] = between;
        let ops = [
            call(
                0,
                "aten::mul",
                vec![tensor(1, 10), tensor(1, 10)],
                vec![tensor(2, 20)],
            ),
            one,
            two,
            call(3, "aten::exp", vec![tensor(2, 20)], vec![tensor(4, 40)]),
        ];
        let kernels: Vec<&TracedOp> = ops.iter().collect();
        let members = HashSet::from([0, 3]);
        let (read, written) = (HashSet::from([10]), HashSet::from([20, 40]));
        first_conflict(&kernels, &members, 0, 3, &read, &written)
    }

    #[test]
    fn an_in_place_write_to_an_input_the_group_still_holds_is_a_conflict() {
        let why = conflict_with([
            call(
                1,
                "aten::add_",
                vec![tensor(1, 10), tensor(5, 50)],
                vec![tensor(1, 10)],
            ),
            call(2, "aten::relu", vec![tensor(5, 50)], vec![tensor(6, 60)]),
        ]);
        assert!(why.is_some_and(|w| w.contains("aten::add_ writes an input")));
    }

    #[test]
    fn an_in_place_write_to_new_memory_at_a_freed_inputs_address_is_no_conflict() {
        // The input was freed: `empty` made new memory at its address, which `add_` writes.
        let why = conflict_with([
            call(1, "aten::empty", vec![], vec![tensor(7, 10)]),
            call(
                2,
                "aten::add_",
                vec![tensor(7, 10), tensor(5, 50)],
                vec![tensor(7, 10)],
            ),
        ]);
        assert_eq!(why, None);
    }

    #[test]
    fn a_read_of_a_result_before_the_launch_is_a_conflict() {
        let why = conflict_with([
            call(1, "aten::sum", vec![tensor(2, 20)], vec![tensor(8, 80)]),
            call(2, "aten::relu", vec![tensor(5, 50)], vec![tensor(6, 60)]),
        ]);
        assert!(why.is_some_and(|w| w.contains("aten::sum reads a result")));
    }

    #[test]
    fn a_read_of_other_memory_at_a_freed_results_address_is_no_conflict() {
        let why = conflict_with([
            call(1, "aten::zeros", vec![], vec![tensor(9, 20)]),
            call(2, "aten::sum", vec![tensor(9, 20)], vec![tensor(8, 80)]),
        ]);
        assert_eq!(why, None);
    }
}
