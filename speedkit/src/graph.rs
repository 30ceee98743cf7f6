//! Graph mode: capture a whole training step — forward, backward, GradScaler and optimizer — as one
//! CUDA graph and replay it, which removes the per-kernel launch cost (what `torch.compile`'s
//! `reduce-overhead` mode does for forward/backward only).
//!
//! A [`GraphedStep`] runs its closure eagerly for the first `compile.warmup_steps` calls of each input
//! signature (on a side stream, so cuDNN/cuBLAS autotuning and lazy allocations happen outside the
//! capture), captures the next call into a CUDA graph in a memory pool shared by all of its graphs,
//! and replays that graph afterwards. Every call is exactly one training step, eager or replayed.
//!
//! Inputs are copied into static buffers before each replay; the returned tensor (the loss) is a
//! static output of the graph, valid until the next call. A new input shape, dtype or device is a new
//! signature: captured anew, up to `compile.max_graphs` graphs (the least recently used is evicted).
//! Anything the capture cannot take (a host synchronisation such as `.item()`, a CPU tensor, data-
//! dependent control flow) makes the step fall back to eager for good, with the reason in the audit;
//! never a wrong result. Change the parameter set (a new optimizer, frozen layers)? Call
//! [`GraphedStep::invalidate`].
//!
//! # Gradients
//!
//! [`AdamWOptimizer::zero_grad`](crate::optim::AdamWOptimizer::zero_grad) drops gradients (PyTorch's
//! `set_to_none`), which spares a fill and an add over every parameter per step, also in a graph:
//! the captured backward then allocates the gradients in the graph's memory pool and replays write
//! them there. Each graph keeps the gradient tensors its optimizer step saw and points the
//! parameters back at them before every replay, so with several graphs cached (one per input
//! shape) `param.grad()` after a step is always that step's gradient, and no graph's gradients are
//! freed for another to reuse. The cost: one set of gradients per cached graph.
//!
//! A step that drops its gradients at its start (`zero_grad` before `backward`, as
//! [`SpeedContext::backward_step`](crate::SpeedContext::backward_step) and tch's own loop do) still
//! holds the last step's through its forward pass. Where its previous step's
//! [`AdamWOptimizer`](crate::optim::AdamWOptimizer) dropped its gradients at `zero_grad` and then
//! stepped, a [`GraphedStep`] drops the gradients that step read before its next eager warm-up
//! step and before the capture (their `zero_grad` would drop them anyway), so that no forward pass,
//! and no captured one, holds them beside its activations, as PyTorch's loop with
//! `zero_grad(set_to_none=True)` before the forward. `param.grad()` after a step is still that
//! step's gradient.
//!
//! Capture-safe building blocks in speedkit: [`AdamWOptimizer`](crate::optim::AdamWOptimizer) (step
//! count and lr on the device), the [`GradScaler`](crate::amp::GradScaler) with the fused optimizer
//! (device-side inf check, skip and scale update), autocast. Optimizers that decide on the host (tch's
//! `nn::Optimizer` under a GradScaler) synchronise and therefore fall back.

use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::error::{Result, SpeedkitError};
use crate::ffi::{
    self,
    device::SideStream,
    graphs::{CudaGraph, GraphPool},
};
use crate::fusion::FusedStep;
use crate::memory::{self, MemoryUse};
use crate::nvtx::NvtxRange;
use crate::offload::{self, Parked, ParkedActivations};

/// Saved tensors smaller than this stay on the device during warm-up: a copy each way costs more
/// than their memory is worth.
const WARMUP_OFFLOAD_MIN_BYTES: u64 = 1 << 20;

type Signature = Vec<(Vec<i64>, Kind, Device)>;

thread_local! {
    // CUDA captures per stream, and speedkit captures on the thread that runs the step: a
    // thread-local flag answers "is this code being recorded?" without a CUDA call.
    static CAPTURING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    // (parameter, gradient) pairs that optimizers saw during the capture in progress.
    static CAPTURED_GRADIENTS: std::cell::RefCell<(Vec<Tensor>, Vec<Tensor>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    // While a GraphedStep runs an eager step: what its optimizers did with their gradients.
    static DROPPED_NEXT_STEP: std::cell::RefCell<Option<DroppedGradients>> = const { std::cell::RefCell::new(None) };
    // How the last step run through a GraphedStep on this thread ran, for the step profiler.
    static LAST_STEP_KIND: std::cell::Cell<Option<StepKind>> = const { std::cell::Cell::new(None) };
}

/// How one call of a [`GraphedStep`] ran its step: what a profile of that step shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// Plain eager execution (graphs off, or fallen back).
    Eager,
    /// One of the eager warm-up steps before the capture (on a side stream).
    GraphWarmup,
    /// The capture, followed by the first replay.
    GraphCapture,
    /// A replay of the captured graph.
    GraphReplay,
}

impl std::fmt::Display for StepKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StepKind::Eager => "eager",
            StepKind::GraphWarmup => "eager warm-up before graph capture",
            StepKind::GraphCapture => "graph capture + first replay",
            StepKind::GraphReplay => "graph replay",
        })
    }
}

fn note_step_kind(kind: StepKind) {
    LAST_STEP_KIND.with(|k| k.set(Some(kind)));
}

/// How the last [`GraphedStep`] call on this thread ran, clearing the record (`None`: no graphed
/// step ran since the last call).
pub(crate) fn take_last_step_kind() -> Option<StepKind> {
    LAST_STEP_KIND.with(|k| k.take())
}

/// Called by an optimizer step: during a capture, remembers which gradient tensor each parameter
/// had, so every replay of that graph can point the parameters at them again (see
/// [`GraphedStep`]'s "Gradients"). Does nothing outside a capture.
pub(crate) fn record_gradients<'a>(params: impl Iterator<Item = &'a Tensor>) {
    if !is_capturing() {
        return;
    }
    CAPTURED_GRADIENTS.with(|cell| {
        let (ps, gs) = &mut *cell.borrow_mut();
        for p in params {
            let g = p.grad();
            if g.defined() {
                ps.push(p.shallow_clone());
                gs.push(g);
            }
        }
    });
}

/// What the optimizers of one eager step of a [`GraphedStep`] did with their gradients.
#[derive(Default)]
struct DroppedGradients {
    /// The optimizers (by id) whose `zero_grad` dropped their gradients in the step.
    dropped: std::collections::HashSet<u64>,
    /// The parameters whose gradients an optimizer's step read, with its id.
    stepped: Vec<(u64, Tensor)>,
}

/// Called by an optimizer's `zero_grad` that drops the gradients (AdamW's default; `optimizer`:
/// its id): see [`note_gradients_stepped`].
pub(crate) fn note_gradients_dropped(optimizer: u64) {
    DROPPED_NEXT_STEP.with(|cell| {
        if let Some(noted) = cell.borrow_mut().as_mut() {
            noted.dropped.insert(optimizer);
        }
    });
}

/// Called by an optimizer's step with the parameters whose gradients it read. In an eager step of
/// a [`GraphedStep`] whose optimizer also dropped its gradients at `zero_grad` (a loop that drops
/// them every step), the step drops those gradients before its next eager run or capture, whose
/// `zero_grad` would drop them anyway (see "Gradients").
pub(crate) fn note_gradients_stepped<'a>(optimizer: u64, params: impl Iterator<Item = &'a Tensor>) {
    DROPPED_NEXT_STEP.with(|cell| {
        if let Some(noted) = cell.borrow_mut().as_mut() {
            noted.stepped.extend(
                params
                    .filter(|p| p.grad().defined())
                    .map(|p| (optimizer, p.shallow_clone())),
            );
        }
    });
}

/// Notes what the optimizers of one eager step say while it lives, and nothing once it is gone,
/// also after a panic.
struct NotingDroppedGradients;

impl NotingDroppedGradients {
    fn start() -> Self {
        DROPPED_NEXT_STEP.with(|cell| *cell.borrow_mut() = Some(DroppedGradients::default()));
        NotingDroppedGradients
    }

    /// The parameters whose gradients the next step of the same loop drops at its `zero_grad`.
    fn finish(self) -> Vec<Tensor> {
        let noted = DROPPED_NEXT_STEP.with(|cell| cell.borrow_mut().take().unwrap_or_default());
        noted
            .stepped
            .into_iter()
            .filter(|(optimizer, _)| noted.dropped.contains(optimizer))
            .map(|(_, p)| p)
            .collect()
    }
}

impl Drop for NotingDroppedGradients {
    fn drop(&mut self) {
        DROPPED_NEXT_STEP.with(|cell| *cell.borrow_mut() = None);
    }
}

fn take_recorded_gradients() -> (Vec<Tensor>, Vec<Tensor>) {
    CAPTURED_GRADIENTS.with(|cell| std::mem::take(&mut *cell.borrow_mut()))
}

/// Whether the calling thread is inside a speedkit graph capture (a [`GraphedStep`] recording its
/// step), so code that must not be recorded (a host read such as `.item()`, a print of a tensor)
/// can refuse up front with a clear error, which ends the capture cleanly and makes the step fall
/// back to eager. A host read that fails inside the capture instead invalidates it.
///
/// ```
/// assert!(!speedkit::graph::is_capturing());
/// ```
pub fn is_capturing() -> bool {
    CAPTURING.with(std::cell::Cell::get)
}

/// Marks the thread as capturing until dropped, also when the step panics.
struct CapturingMark;

impl CapturingMark {
    fn set() -> Self {
        take_recorded_gradients();
        CAPTURING.with(|c| c.set(true));
        Self
    }
}

impl Drop for CapturingMark {
    fn drop(&mut self) {
        CAPTURING.with(|c| c.set(false));
    }
}

struct Entry {
    signature: Signature,
    eager_runs: usize,
    graph: Option<CudaGraph>,
    static_inputs: Vec<Tensor>,
    output: Option<Tensor>,
    /// Parameters and the gradient tensors their graph writes (allocated in the capture).
    gradients: (Vec<Tensor>, Vec<Tensor>),
    /// The step's fused groups, traced in the last warm-up step, for the capture to run.
    fused: Option<FusedStep>,
    last_used: u64,
    /// When its first warm-up step began: the audit gives the time to the first replay.
    first_warmup: Option<Instant>,
}

/// Runs the last warm-up step traced for fusion: its result, and the fused program unless one
/// could not be made (the audit says why). The step runs once whatever happens.
fn traced_for_fusion(
    host: &dyn GraphHost,
    device_index: usize,
    step: impl FnOnce() -> Result<Option<Tensor>>,
) -> Result<(Result<Option<Tensor>>, Option<FusedStep>)> {
    let mut step = Some(step);
    let prepared = FusedStep::prepare(Device::Cuda(device_index), || {
        (step.take().expect("runs once"))()
    });
    match prepared {
        Ok((out, Ok(fused))) => {
            host.note(format!("fusion: {}", fused.summary()));
            Ok((out, Some(fused)))
        }
        Ok((out, Err(e))) => {
            host.note(format!("fusion off: the step could not be prepared ({e})"));
            Ok((out, None))
        }
        Err(e) => {
            host.note(format!("fusion off: the step could not be traced ({e})"));
            let step = step.take().ok_or(e)?;
            Ok((step(), None))
        }
    }
}

/// What a [`GraphedStep`] needs from whoever runs it: the plan's graph settings, and the hooks
/// around a replay. [`SpeedContext`](crate::SpeedContext) is the one implementation, so graph mode
/// follows the context's plan without this module knowing the context.
pub trait GraphHost {
    /// The plan's settings for graph mode.
    fn graph_settings(&self) -> GraphSettings;
    /// Records `text` in the audit.
    fn note(&self, text: String);
    /// Runs after every replay (and the capture's first): what the step's graph cannot do itself,
    /// such as data parallelism's bookkeeping.
    fn after_graph_replay(&self) -> Result<()>;
    /// Forgets the state a failed capture's step left half-made (the GradScaler's inf check).
    fn discard_step(&self);
}

/// The plan's settings for graph mode, as a [`GraphHost`] gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphSettings {
    /// The CUDA device to capture on; `None` when graphs are off (by the plan, or on the CPU).
    pub device_index: Option<usize>,
    /// Eager steps of each input signature before its capture (`compile.warmup_steps`).
    pub warmup_steps: usize,
    /// Graphs kept at once, one per input signature (`compile.max_graphs`).
    pub max_graphs: usize,
    /// Whether the capture runs generated kernels for the step's pointwise chains
    /// (`compile.fusion`), traced during the last warm-up step.
    pub fusion: bool,
    /// Whether the eager warm-up steps keep their saved activations in host memory until the
    /// backward reads them (`compile.warmup_offload`, [`crate::offload`]).
    pub warmup_offload: bool,
    /// Whether steps are marked with NVTX ranges (`profile.nvtx`).
    pub nvtx: bool,
}

/// The device's memory at the end of one phase of a [`GraphedStep`] (the last eager warm-up step,
/// the capture with its first replay): where a graph's memory goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PhaseMemory {
    /// The phase.
    pub phase: StepKind,
    /// The device's memory right after it (peaks since the allocator's last reset).
    pub memory: MemoryUse,
}

/// A training step run as a replayed CUDA graph when the plan enables graphs (see the
/// [module docs](self)); a plain call otherwise.
pub struct GraphedStep<'c, F> {
    host: &'c dyn GraphHost,
    step: F,
    enabled: bool,
    pool: Option<GraphPool>,
    entries: Vec<Entry>,
    clock: u64,
    fallback: Option<String>,
    phases: Vec<PhaseMemory>,
    /// Parameters whose gradients the last eager step's optimizer will drop at its next
    /// `zero_grad` (see "Gradients").
    dropped_next_step: Vec<Tensor>,
}

impl<'c, F> GraphedStep<'c, F>
where
    F: FnMut(&[Tensor]) -> Result<Option<Tensor>>,
{
    /// Wraps `step`, which receives the (static) input tensors and returns the loss; `host` is the
    /// [`SpeedContext`](crate::SpeedContext) whose plan it follows.
    pub fn new(host: &'c dyn GraphHost, step: F) -> Self {
        let enabled = host.graph_settings().device_index.is_some();
        Self {
            host,
            step,
            enabled,
            pool: None,
            entries: Vec::new(),
            clock: 0,
            fallback: None,
            phases: Vec::new(),
            dropped_next_step: Vec::new(),
        }
    }

    /// The device's memory after each phase so far: the last eager warm-up step and the capture
    /// (with its first replay) of each input signature.
    pub fn memory_phases(&self) -> &[PhaseMemory] {
        &self.phases
    }

    fn note_phase(&mut self, phase: StepKind, device_index: usize) {
        // Where memory goes is a diagnosis, never a reason to fail a step.
        if let Ok(memory) = MemoryUse::now(Device::Cuda(device_index)) {
            self.phases.push(PhaseMemory { phase, memory });
        }
    }

    /// Whether the last call replayed a graph.
    pub fn is_graphed(&self) -> bool {
        self.fallback.is_none() && self.entries.iter().any(|e| e.graph.is_some())
    }

    /// Why graphs are off for this step, if they fell back.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Drops every captured graph: the next calls warm up and capture again.
    pub fn invalidate(&mut self) {
        self.entries.clear();
    }

    /// Runs one step on `inputs`.
    pub fn run(&mut self, inputs: &[&Tensor]) -> Result<Option<Tensor>> {
        let Some(device_index) = self
            .host
            .graph_settings()
            .device_index
            .filter(|_| self.enabled && self.fallback.is_none())
        else {
            note_step_kind(StepKind::Eager);
            return self.eager_step(inputs);
        };
        let signature: Signature = inputs
            .iter()
            .map(|t| (t.size(), t.kind(), t.device()))
            .collect();
        if let Some((i, d)) = inputs
            .iter()
            .enumerate()
            .find(|(_, t)| t.device() != Device::Cuda(device_index))
        {
            let reason = format!(
                "input {i} is on {:?}, not cuda:{device_index}: graphs need device-resident inputs",
                d.device()
            );
            return self.fall_back(reason, inputs);
        }
        self.clock += 1;
        let index = match self.entries.iter().position(|e| e.signature == signature) {
            Some(i) => i,
            None => self.insert(signature),
        };
        let warmup = self.host.graph_settings().warmup_steps;
        let entry = &mut self.entries[index];
        entry.last_used = self.clock;

        let nvtx = self.host.graph_settings().nvtx;
        if let Some(graph) = &entry.graph {
            note_step_kind(StepKind::GraphReplay);
            let _range = NvtxRange::push(nvtx, c"speedkit/graph replay");
            for (dst, src) in entry.static_inputs.iter_mut().zip(inputs) {
                dst.f_copy_(src)?;
            }
            // Another graph or an eager step may have given the parameters other gradients.
            ffi::optim::set_grads(&entry.gradients.0, &entry.gradients.1)?;
            let output = entry.output.as_ref().map(Tensor::shallow_clone);
            graph
                .replay()
                .map_err(|e| self.out_of_memory(StepKind::GraphReplay, device_index, e))?;
            self.host.after_graph_replay()?;
            return Ok(output);
        }
        if entry.eager_runs < warmup {
            note_step_kind(StepKind::GraphWarmup);
            let _range = NvtxRange::push(nvtx, c"speedkit/graph warm-up (eager)");
            entry.eager_runs += 1;
            entry.first_warmup.get_or_insert_with(Instant::now);
            let last_warmup = entry.eager_runs == warmup;
            let side = SideStream::enter(device_index)?;
            // The forward's and the backward's cuBLAS handles share one workspace on the side
            // stream, as they will in the capture; not while a live graph replays with its own.
            if CudaGraph::live() == 0 {
                ffi::device::share_blas_workspace(device_index, false)?;
            }
            let owned: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
            self.drop_gradients_before_step()?;
            let noting = NotingDroppedGradients::start();
            let parking = self.park_warmup_activations();
            let out = if last_warmup && self.host.graph_settings().fusion {
                let (out, fused) =
                    traced_for_fusion(self.host, device_index, || (self.step)(&owned))?;
                self.entries[index].fused = fused;
                out
            } else {
                (self.step)(&owned)
            };
            let parked = parking.map(ParkedActivations::finish).transpose()?;
            side.exit()?;
            if let (true, Some(parked)) = (last_warmup, parked) {
                self.note_parked(parked);
            }
            self.dropped_next_step = noting.finish();
            let out =
                out.map_err(|e| self.out_of_memory(StepKind::GraphWarmup, device_index, e))?;
            if last_warmup {
                self.note_phase(StepKind::GraphWarmup, device_index);
            }
            return Ok(out);
        }
        note_step_kind(StepKind::GraphCapture);
        let _range = NvtxRange::push(nvtx, c"speedkit/graph capture");
        self.drop_gradients_before_step()?;
        let out = self.capture(index, device_index, inputs)?;
        self.note_phase(StepKind::GraphCapture, device_index);
        Ok(out)
    }

    /// An out-of-memory error of `phase` as [`SpeedkitError::OutOfMemory`], naming the phase, the
    /// device's memory and what to try, after giving back what the failed step left cached; any
    /// other error as it is.
    fn out_of_memory(
        &self,
        phase: StepKind,
        device_index: usize,
        error: SpeedkitError,
    ) -> SpeedkitError {
        if !memory::is_out_of_memory(&error) {
            return error;
        }
        let advice = match phase {
            StepKind::GraphCapture => {
                "the capture holds the step's activations in the graph's own pool beside what the \
                 warm-up cached: `compile: false` runs the step without a graph; or a smaller \
                 batch, or activation checkpointing of the model's blocks (SpeedContext::checkpoint)"
            }
            _ => {
                "a smaller batch; activation checkpointing of the model's blocks \
                 (SpeedContext::checkpoint); `compile: false` if the graph's pool is what fills \
                 the device"
            }
        };
        memory::out_of_memory(
            Device::Cuda(device_index),
            &phase.to_string(),
            &error,
            advice,
        )
    }

    /// Parks the warm-up step's saved activations in host memory where the plan says so. Where
    /// autograd's engine cannot give them hooks (a Python process's), the step runs without.
    fn park_warmup_activations(&self) -> Option<ParkedActivations> {
        if !self.host.graph_settings().warmup_offload {
            return None;
        }
        ParkedActivations::start(WARMUP_OFFLOAD_MIN_BYTES)
            .map_err(|e| self.host.note(format!("warm-up offload off: {e}")))
            .ok()
    }

    /// Says in the audit what the last warm-up step parked, and gives back the pinned host memory
    /// that held it (the captured step parks nothing).
    fn note_parked(&self, parked: Parked) {
        self.host.note(format!(
            "eager warm-up: {} saved activation storage(s), {}, kept in host memory until the \
             backward read them (compile.warmup_offload)",
            parked.storages,
            memory::gib(parked.bytes)
        ));
        if let Err(e) = offload::release_host_cache() {
            self.host
                .note(format!("pinned host memory kept cached: {e}"));
        }
    }

    /// Drops the gradients the last eager step's optimizer will drop at this step's `zero_grad`:
    /// this step's forward pass need not hold them (see "Gradients").
    fn drop_gradients_before_step(&mut self) -> Result<()> {
        let params = std::mem::take(&mut self.dropped_next_step);
        let with_grads: Vec<Tensor> = params.into_iter().filter(|p| p.grad().defined()).collect();
        ffi::optim::clear_grads(&with_grads)
    }

    fn insert(&mut self, signature: Signature) -> usize {
        let max = self.host.graph_settings().max_graphs.max(1);
        if self.entries.len() >= max {
            if let Some((lru, _)) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
            {
                let evicted = self.entries.remove(lru);
                self.host.note(format!(
                    "graph cache full (compile.max_graphs = {max}): evicted the graph for input shapes {:?}",
                    evicted.signature.iter().map(|s| &s.0).collect::<Vec<_>>()
                ));
            }
        }
        self.entries.push(Entry {
            signature,
            eager_runs: 0,
            graph: None,
            static_inputs: Vec::new(),
            gradients: (Vec::new(), Vec::new()),
            output: None,
            fused: None,
            first_warmup: None,
            last_used: self.clock,
        });
        self.entries.len() - 1
    }

    fn capture(
        &mut self,
        index: usize,
        device_index: usize,
        inputs: &[&Tensor],
    ) -> Result<Option<Tensor>> {
        let pool = match self.pool {
            Some(p) => p,
            None => *self.pool.insert(GraphPool::new()?),
        };
        // Static buffers are allocated outside the capture, so they outlive every replay.
        let static_inputs: Vec<Tensor> = inputs.iter().map(|t| t.copy()).collect();
        ffi::device::cuda_synchronize(device_index)?;
        let capture_start = Instant::now();
        // The warm-up ran on a side stream, whose freed blocks the allocator keeps for that stream
        // alone; the capture allocates into the graph's private pool. Handing those blocks back to
        // the driver first (as torch.cuda.graph does) keeps the process from holding both. So
        // with cuBLAS's workspaces, which it keeps per stream for the process: those of eager work
        // go, and, where no other graph may replay with it, the side stream's too, so that the
        // capture makes its own in the graph's pool (Inductor's CUDA graphs clear them likewise).
        ffi::device::release_blas_workspaces(device_index, ffi::graphs::CudaGraph::live() == 0)?;
        ffi::device::cuda_empty_cache()?;
        let mut graph = CudaGraph::new()?;
        let side = SideStream::enter(device_index)?;
        let mut gradients = (Vec::new(), Vec::new());
        // Used by this capture alone: the graph holds what it launched.
        let fused = self.entries[index].fused.take();
        let captured = graph.capture_begin(pool).and_then(|()| {
            let mark = CapturingMark::set();
            // The forward's and the backward's threads each have a cuBLAS handle: one workspace
            // for both, in the graph's pool, where each would make its own.
            let out =
                ffi::device::share_blas_workspace(device_index, true).and_then(|_| match &fused {
                    Some(fused) => fused.run(|| (self.step)(&static_inputs))?,
                    None => (self.step)(&static_inputs),
                });
            drop(mark);
            gradients = take_recorded_gradients();
            // capture_end must run whatever the step did, to leave capture mode.
            let end = graph.capture_end();
            let out = out?;
            end.map(|()| out)
        });
        side.exit()?;
        match captured {
            Ok(output) => {
                let shapes: Vec<_> = static_inputs.iter().map(|t| t.size()).collect();
                let entry = &mut self.entries[index];
                entry.static_inputs = static_inputs;
                // Detached: the same memory, which every replay rewrites, without the autograd
                // graph of the capture. Kept alive, that graph would pin the gradient accumulators
                // to the capture's stream, and later backward passes would wait on that stream.
                entry.output = output.map(|t| t.f_detach()).transpose()?;
                entry.gradients = gradients;
                graph.replay()?;
                entry.graph = Some(graph);
                self.host.after_graph_replay()?;
                let warmup = (entry.first_warmup)
                    .map(|t| capture_start.duration_since(t).as_secs_f64())
                    .unwrap_or(0.0);
                self.host.note(format!(
                    "training step captured as a CUDA graph (input shapes {shapes:?}) after {} eager \
                     warm-up step(s): {warmup:.2} s of warm-up (tracing and compiling included), \
                     {:.2} s to capture and replay it once",
                    entry.eager_runs,
                    capture_start.elapsed().as_secs_f64()
                ));
                Ok(entry.output.as_ref().map(Tensor::shallow_clone))
            }
            Err(e) => {
                drop(graph);
                // Whatever the partial capture recorded never ran.
                ffi::device::cuda_synchronize(device_index)?;
                self.host.discard_step();
                if memory::is_out_of_memory(&e) {
                    // Eager would need the same activations again: say so instead of retrying.
                    self.entries.remove(index);
                    return Err(self.out_of_memory(StepKind::GraphCapture, device_index, e));
                }
                if fused.is_some() {
                    // Nothing of the capture ran: the same step is captured again with ATen's
                    // kernels alone. A pool whose last graph is gone cannot take another capture
                    // (the allocator has begun freeing it): a fresh one does.
                    self.host.note(format!(
                        "fusion off: the fused capture failed ({e}); captured without it"
                    ));
                    if self.entries.iter().all(|e| e.graph.is_none()) {
                        self.pool = None;
                    }
                    return self.capture(index, device_index, inputs);
                }
                let reason =
                    format!("the step cannot be captured ({e}); running eagerly from now on");
                self.fall_back(reason, inputs)
            }
        }
    }

    fn fall_back(&mut self, reason: String, inputs: &[&Tensor]) -> Result<Option<Tensor>> {
        self.host.note(format!("graphs off: {reason}"));
        self.fallback = Some(reason);
        self.entries.clear();
        note_step_kind(StepKind::Eager);
        self.eager_step(inputs)
    }

    /// The step run eagerly, after dropping the gradients the last one's optimizer would drop
    /// (see "Gradients").
    fn eager_step(&mut self, inputs: &[&Tensor]) -> Result<Option<Tensor>> {
        self.drop_gradients_before_step()?;
        let noting = NotingDroppedGradients::start();
        let owned: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
        let out = (self.step)(&owned);
        self.dropped_next_step = noting.finish();
        out
    }
}

/// A boxed step closure: what [`CompiledStep`] stores, so its type names no closure.
type DynStep<'c> = Box<dyn FnMut(&[Tensor]) -> Result<Option<Tensor>> + 'c>;

/// A [`GraphedStep`] without inputs: the step closes over its (already static) data.
pub struct CompiledStep<'c> {
    inner: GraphedStep<'c, DynStep<'c>>,
}

impl<'c> CompiledStep<'c> {
    /// Wraps `step`.
    pub fn new(
        host: &'c dyn GraphHost,
        mut step: impl FnMut() -> Result<Option<Tensor>> + 'c,
    ) -> Self {
        let boxed: DynStep<'c> = Box::new(move |_: &[Tensor]| step());
        Self {
            inner: GraphedStep::new(host, boxed),
        }
    }

    /// Runs one step.
    pub fn run(&mut self) -> Result<Option<Tensor>> {
        self.inner.run(&[])
    }

    /// Whether steps replay a captured graph.
    pub fn is_graphed(&self) -> bool {
        self.inner.is_graphed()
    }

    /// Why graphs fell back, if they did.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.inner.fallback_reason()
    }

    /// The device's memory after each phase so far (see [`GraphedStep::memory_phases`]).
    pub fn memory_phases(&self) -> &[PhaseMemory] {
        self.inner.memory_phases()
    }
}
