//! # speedkit
//!
//! Run tch-rs (libtorch) training at the speed the GPU allows, without rewriting the training code.
//!
//! speedkit finds the fast paths a GPU offers — TF32, bf16/fp16 autocast with a GradScaler, fused
//! AdamW, the SDPA attention backends, cuDNN autotuning, CUDA graph capture — and applies them
//! **auditably** (every global flag change is recorded with its before/after value and reason) and
//! **reversibly** (restored when the context drops, also during a panic).
//!
//! ```
//! use speedkit::{apply_speedups, optim::AdamW, SpeedConfig};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//!
//! let mut vs = nn::VarStore::new(Device::Cpu);
//! let model = nn::linear(vs.root(), 32, 8, Default::default());
//! let config = SpeedConfig::auto();                      // or SpeedConfig::from_yaml("speed.yaml")?
//! let ctx = apply_speedups(&mut vs, &config)?;           // detect, plan, apply flags
//! let mut opt = ctx.adamw(&vs, AdamW { lr: 3e-4, wd: 0.1, ..Default::default() })?;
//! let (x, y) = (Tensor::randn([64, 32], (Kind::Float, ctx.device())), Tensor::zeros([64], (Kind::Int64, ctx.device())));
//! let loss = ctx.autocast(|| model.forward(&x).cross_entropy_for_logits(&y));
//! ctx.backward_step(&loss, &mut opt)?;                   // scale → backward → unscale/inf-check → step → update
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```
//!
//! Modules by concept: [`hardware`] (what the machine offers), [`config`] (the `SpeedConfig`),
//! [`plan`] (config × hardware → settings with reasons), [`flags`] (the global flag registry and the
//! restoring guard), [`amp`] (autocast, GradScaler), [`optim`] (AdamW), [`nn`] (attention),
//! [`graph`] (CUDA graph capture of a whole step), [`dist`] (data parallelism over several
//! processes), [`kernels`] (speedkit's own fused CUDA kernels), [`bench`](mod@bench) (workloads
//! and the runner), [`report`] (audit and report), [`profile`] (where a step's time goes),
//! [`memory`] (where device memory goes), [`autograd`] (the backward graph), [`function`]
//! (autograd functions written in Rust), [`cuda`] (your own CUDA kernels on tensors),
//! [`checkpoint`] (activation checkpointing).
//!
//! Cargo feature `runner` (off by default): the benchmark runner, that is [`bench_main!`] and
//! [`bench_tests!`], `bench::{runner, baseline, peer, testing}` and the `speedkit` binary
//! (`report`, `launch`), with their dependencies clap, indicatif and libtest-mimic. Registering
//! workloads with [`#[speedkit::bench]`](macro@bench) and training need no feature; this
//! workspace's suite (examples, benches, tests) turns `runner` on.

#![warn(missing_docs)]
// The crate's docs link the runner's macros and modules; they resolve in docs built with `runner`
// (`cargo doc --workspace`, `cargo doc -p speedkit --features runner`), which checks every link.
#![cfg_attr(not(feature = "runner"), allow(rustdoc::broken_intra_doc_links))]

mod advice;
pub mod amp;
pub mod autograd;
pub mod bench;
mod channels_last;
pub mod checkpoint;
mod context;
pub mod cuda;
pub mod deferred;
pub mod dist;
pub mod error;
mod ffi;
pub mod flags;
pub mod function;
pub mod fusion;
pub mod graph;
pub mod hardware;
pub mod kernels;
pub mod launcher;
#[cfg(test)]
mod layering;
pub mod memory;
pub mod nn;
mod nvtx;
pub mod offload;
pub mod optim;
pub mod overrides;
pub mod plan;
pub mod profile;
pub mod report;
pub mod trace;

/// The speed configuration (re-exported from `speedkit-config`, which the macros also use to check
/// configs at compile time).
pub mod config {
    pub use speedkit_config::*;
}

pub use advice::{audit, audit_tensors, Advice, ModelAudit};
pub use config::SpeedConfig;
pub use context::{apply_speedups, ForwardScope, SpeedContext};
pub use error::{Result, SpeedkitError};

// The macros are documented here rather than in `speedkit-macros`, so that their examples compile
// and run against this runtime (the macros crate cannot depend on it).

/// Applies PyTorch's speed flags for the duration of a function, and restores them on exit.
///
/// ```
/// use speedkit::flags::FlagState;
/// use speedkit::forward;
/// use speedkit::optim::AdamW;
/// use tch::nn::{self, Module};
/// use tch::{Kind, Tensor};
///
/// #[speedkit::accelerate(cudnn(benchmark = true), ctx = ctx)]
/// fn train(batches: &[(Tensor, Tensor)], epochs: usize) -> Result<f64, Box<dyn std::error::Error>> {
///     let vs = nn::VarStore::new(ctx.device());
///     let model = nn::linear(vs.root(), 8, 2, Default::default());
///     let mut opt = ctx.adamw(&vs, AdamW { lr: 1e-2, ..Default::default() })?;
///     let mut last = f64::NAN;
///     for _ in 0..epochs {
///         for (x, y) in batches {
///             let (x, y) = (x.to_device(ctx.device()), y.to_device(ctx.device()));
///             #[forward]
///             let loss = model.forward(&x).cross_entropy_for_logits(&y);
///             opt.backward_step(&loss); // routed through the GradScaler when fp16
///             last = loss.double_value(&[]);
///         }
///     }
///     println!("{}", ctx.audit());
///     Ok(last)
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let batches: Vec<(Tensor, Tensor)> = (0..4)
///     .map(|_| (Tensor::randn([16, 8], (Kind::Float, tch::Device::Cpu)), Tensor::zeros([16], (Kind::Int64, tch::Device::Cpu))))
///     .collect();
/// let before = FlagState::capture()?;
/// let loss = train(&batches, 2)?;
/// assert!(loss.is_finite());
/// assert_eq!(FlagState::capture()?, before); // every flag is back
/// # Ok(())
/// # }
/// ```
///
/// # Arguments
///
/// * `config = "speed.yaml"` — a speed config file, relative to the directory of the `Cargo.toml`
///   of the crate being compiled (`examples/configs/speed.yaml` documents every key). It is read
///   and validated **at compile time** (`.json` files as JSON, anything else as YAML): a missing
///   file, an unknown key (with its line, column and the closest valid key) or a bad value is a
///   compile error at the string literal. The text is embedded with `include_str!`, so cargo
///   rebuilds when the file changes.
/// * Inline keys instead of a file — `precision = "bf16"`, `tf32_matmul_precision = "high"`,
///   `device = "cuda"`, `deterministic = true`, and groups such as
///   `cudnn(benchmark = true, allow_tf32 = "auto")`, `grad_scaler(enabled = true, init_scale = 1024.0)`,
///   `compile(enabled = false)`, `sdp_backend(math = false)`, `optimizer(fused = true)`. Values
///   are string, boolean or number literals. They are validated at compile time like a file,
///   every problem reported at its own key. `config` and inline keys cannot be combined.
/// * No config argument: the defaults (`auto` everywhere: the runtime decides from the hardware).
/// * `ctx = name` — binds the [`SpeedContext`] to `name` so the body can use it (`ctx.adamw(..)`,
///   `ctx.audit()`). Without it the context lives in a hidden binding.
///
/// An unknown argument is an error that lists the valid ones and suggests the closest.
///
/// # What the function becomes
///
/// One statement is prepended to the body; nothing else of the signature or body changes
/// (attributes, visibility, generics, `where` clauses, `impl Trait`, `self` receivers, `unsafe`,
/// `extern "C"` are kept). For a function returning a `Result` (by the last path segment:
/// `Result`, `anyhow::Result`, `io::Result`) entering can fail with `?`; any other function
/// panics instead. With `ctx = ctx` and no config, these two
///
/// ```
/// #[speedkit::accelerate(ctx = ctx)]
/// fn train() -> speedkit::Result<()> {
///     println!("training on {:?}", ctx.device());
///     Ok(())
/// }
///
/// #[speedkit::accelerate(ctx = ctx)]
/// fn evaluate() {
///     println!("evaluating on {:?}", ctx.device());
/// }
/// # train().unwrap();
/// # evaluate();
/// ```
///
/// become (a config file is passed as `ConfigSource::Yaml { path, text: include_str!(..) }`,
/// inline keys as `ConfigSource::Json("..")`)
///
/// ```
/// fn train() -> speedkit::Result<()> {
///     let ctx = ::speedkit::__private::enter(::speedkit::__private::ConfigSource::Default, "train")?;
///     println!("training on {:?}", ctx.device());
///     Ok(())
/// }
///
/// fn evaluate() {
///     let ctx =
///         ::speedkit::__private::enter_or_panic(::speedkit::__private::ConfigSource::Default, "evaluate");
///     println!("evaluating on {:?}", ctx.device());
/// }
/// # train().unwrap();
/// # evaluate();
/// ```
///
/// The context holds the guard that restores every flag when it drops, i.e. at function exit:
/// `return`, `?`, the end of the body and panic unwinding alike. The body is not wrapped in a
/// closure, so `?`, `return` and borrows mean what they meant. The error of `enter` is converted
/// by `?` with `From` (as `anyhow::Error` and `Box<dyn Error>` do).
///
/// A function with `VarStore` arguments (`&VarStore`, `&mut VarStore` or `VarStore`, by type name)
/// enters through `enter_for_models(source, name, &[var_store(&vs), ..])` instead, which gives the
/// plan the model's size (`distributed.shard_parameters: auto` decides from it), and then calls
/// `data_parallel(&ctx, &vs)` for each, which under a launcher takes rank 0's parameters and
/// averages the gradients.
///
/// # Rewrite rules
///
/// Only the following is rewritten; code that is neither annotated nor matched by these rules is
/// left exactly as written. Matching is syntactic and lexical (by name, in source order), and
/// code inside macro invocations (`vec![..]`, `println!(..)`) is not looked into.
///
/// 1. **`#[speedkit::forward]`** (or `#[forward]` after `use speedkit::forward`) on
///    * `let PAT = EXPR;` → `let PAT = { let guard = autocast_scope(&ctx); EXPR };` — the
///      autocast scope covers exactly `EXPR`; `?` and `return` inside it keep working.
///      `let PAT = EXPR else { .. };` works too.
///    * a block statement `{ ... }` (also `unsafe { ... }` and labeled blocks) →
///      `{ let guard = autocast_scope(&ctx); ... }`.
///
///    It is found in nested blocks, loops and closures of the body. Anywhere else (an item, a
///    `let` without initializer, a macro statement, an expression that is not a block, an
///    expression inside another statement) it is an error, as are arguments (`#[forward(x)]`)
///    and giving it twice. Functions nested in the body are not accelerated: `#[forward]` in
///    them is an error, unless they are `#[speedkit::accelerate]` themselves. So is `#[forward]`
///    in an `async` block or closure (the scope must not live across `.await`).
///
///    The bare `#[forward]` needs `use speedkit::forward;` in scope, like any attribute. Since the
///    attribute itself is removed, the expansion adds `#[allow(unused_imports)] use forward as _;`
///    to that block, which keeps the import used (no warning under `deny(warnings)`).
/// 2. **Losses**: a name bound by a `#[forward] let` whose pattern is a plain identifier
///    (`let loss = ..`, `let mut loss = ..`, `let loss: Tensor = ..`) is *tracked* from that
///    statement to the end of its block, nested blocks and closures included. (`let`s inside a
///    `#[forward] { ... }` block are not tracked.) It stops being tracked where a later `let`, a
///    closure parameter or a `for`/`match`/`if let`/`while let` pattern binds the same name
///    (shadowing, lexically). For a tracked `loss`:
///    * `RECV.backward_step(&loss)` or `RECV.backward_step(loss)`, anywhere →
///      `::speedkit::__private::backward_step(&ctx, &mut RECV, &loss)` (zero_grad, scaled
///      backward, unscaled step, scale update). `&mut RECV` is written the way method-call
///      autoref would borrow: `RECV` itself when it is already `&mut x`, `&mut *x` when `x` is a
///      parameter `x: &mut T`, `self` of `&mut self`, or bound by `let x = &mut ..`.
///    * `loss.backward()`, anywhere → `::speedkit::__private::backward(&ctx, &loss)` (scaled
///      when the plan uses a GradScaler).
///    * After a **statement** `loss.backward();`, every later statement of exactly the form
///      `IDENT.step()` / `IDENT.step();` in the same block — including in blocks, loops and
///      closures nested in those later statements, for gradient accumulation
///      (`if i % k == 0 { opt.step(); }`) — becomes
///      `::speedkit::__private::step(&ctx, &mut IDENT)` (unscale, skip on inf/NaN, update the
///      scale).
///
///    Not rewritten: a `step()` before the backward or in an enclosing block, a `step()` on
///    anything but an identifier (`self.opt.step()`), `backward()` of a loss not bound by a
///    `#[forward] let`. Use the context's own methods there (`ctx.backward(&loss)?`,
///    `ctx.step(&mut opt)?`, with `ctx = ctx`). Conversely, a `x.step()` statement after the
///    backward is rewritten even if `x` is not an optimizer (it then fails to type-check, naming
///    `ScaledOptimizer`): write it as `Scheduler::step(&mut x)` to keep it out of the rule.
///
/// A `move` closure that contains rewritten code gets the context by reference
/// (`{ let ctx = &ctx; move || .. }`), so it does not take the context away from the function.
///
/// # Errors
///
/// `async fn` is rejected (the flags are process-global and the guard must not be held across
/// `.await`: accelerate a synchronous function and call it, e.g. from `spawn_blocking`), as is
/// `const fn`. All errors are reported together; the function is still emitted (with the default
/// config and misplaced attributes removed) so that no follow-up errors hide the real ones.
pub use speedkit_macros::accelerate;

/// Runs one statement of an `#[speedkit::accelerate]` function under autocast.
///
/// ```
/// use speedkit::forward;
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tch::{Kind, Reduction, Tensor};
///
/// #[speedkit::accelerate(precision = "bf16")]
/// fn step(model: &nn::Linear, opt: &mut nn::Optimizer, x: &Tensor, y: &Tensor) -> f64 {
///     #[forward]
///     let loss = model.forward(x).mse_loss(y, Reduction::Mean);
///     opt.backward_step(&loss);
///
///     #[forward]
///     {
///         let prediction = model.forward(x);
///         println!("mean prediction: {}", prediction.mean(Kind::Float).double_value(&[]));
///     }
///     loss.double_value(&[])
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let model = nn::linear(vs.root(), 4, 1, Default::default());
/// let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
/// let (x, y) = (Tensor::randn([8, 4], (Kind::Float, tch::Device::Cpu)), Tensor::zeros([8, 1], (Kind::Float, tch::Device::Cpu)));
/// assert!(step(&model, &mut opt, &x, &y).is_finite());
/// # Ok(())
/// # }
/// ```
///
/// It goes on a `let` statement with an initializer (the initializer runs under autocast, and a
/// plain-identifier binding becomes a tracked loss) or on a block statement; it takes no
/// arguments, since the dtype comes from the speed config. See [`macro@accelerate`] for the exact
/// rewrite rules.
///
/// `#[speedkit::accelerate]` removes the attribute before the compiler sees it; used anywhere
/// else — on an item, or in a function that is not accelerated — this attribute is an error
/// telling you to mark the enclosing function `#[speedkit::accelerate]`. (On a statement of a
/// non-accelerated function, stable rustc also reports its own E0658 "custom attributes cannot
/// be applied to statements" before that error.)
pub use speedkit_macros::forward;

/// Registers a benchmark workload with speedkit's runner ([`bench_main!`], [`bench_tests!`]).
///
/// ```
/// use speedkit::bench::{Bencher, Protocol, Size, Workload};
/// use speedkit::config::{DeviceChoice, SpeedConfig};
/// use speedkit::SpeedContext;
/// use tch::nn::{self, Module};
/// use tch::{Kind, Tensor};
///
/// type BoxError = Box<dyn std::error::Error + Send + Sync>;
///
/// #[speedkit::bench]
/// fn matmul(b: &mut Bencher) -> Result<(), BoxError> {
///     let n = b.size().pick(64, 4096);
///     let x = Tensor::f_randn([n, n], (Kind::Float, b.device()))?;
///     b.set_flops_per_step(2.0 * (n as f64).powi(3));
///     b.run(|| x.f_mm(&x))?;
///     Ok(())
/// }
///
/// #[speedkit::bench(name = "linear3", tags = ["matmul", "seed"], sizes = ["tiny"], cuda_only)]
/// fn linear(b: &mut Bencher) -> Result<(), BoxError> {
///     let vs = nn::VarStore::new(b.device());
///     let model = nn::seq()
///         .add(nn::linear(vs.root() / "0", 32, 32, Default::default()))
///         .add(nn::linear(vs.root() / "1", 32, 32, Default::default()))
///         .add(nn::linear(vs.root() / "2", 32, 32, Default::default()));
///     let x = Tensor::randn([8, 32], (Kind::Float, b.device()));
///     b.run(|| tch::no_grad(|| model.forward(&x)))?;
///     Ok(())
/// }
///
/// # fn main() -> Result<(), BoxError> {
/// // What the runner does with each registered workload, here at the tiny size on the CPU:
/// let workload = Workload::named("matmul").ok_or("`matmul` is not registered")?;
/// let cpu = SpeedConfig { device: DeviceChoice::Cpu, ..SpeedConfig::auto() };
/// let ctx = SpeedContext::new(&cpu)?;
/// let mut b = Bencher::new(Size::Tiny, &ctx, Protocol { warmup: 1, steps: 3, paranoid_sync: true });
/// (workload.run)(&mut b)?;
/// assert_eq!(b.measurement().map(|m| m.times_ms.len()), Some(3));
///
/// let linear3 = Workload::named("linear3").ok_or("`linear3` is not registered")?;
/// assert!(linear3.cuda_only && linear3.sizes == [Size::Tiny]);
/// # Ok(())
/// # }
/// ```
///
/// The function must be a free, non-`async`, non-generic (lifetimes are fine), safe function
/// with exactly one parameter, `&mut speedkit::bench::Bencher`, returning `()` or a
/// `Result<(), E>` with `E: Into<Box<dyn Error + Send + Sync>>`.
///
/// # Arguments (all optional)
///
/// * `name = "..."` — the workload name; defaults to the function name.
/// * `tags = ["..", ..]` — free-form tags for filtering.
/// * `sizes = ["tiny", "bench"]` — the problem sizes the workload supports (default: both);
///   checked at compile time: only `tiny` and `bench`, no repeats, not empty.
/// * `cuda_only` — skip (with a printed reason) when no GPU is present.
///
/// A single string is accepted for `tags`/`sizes` as a one-element list. Unknown or repeated
/// arguments and non-literal values are errors.
///
/// # Expansion
///
/// The function is kept as written, and next to it a shim and the registration; for `linear`
/// above:
///
/// ```
/// # fn linear(b: &mut speedkit::bench::Bencher) -> Result<(), speedkit::bench::BenchError> {
/// #     Ok(())
/// # }
/// const _: () = {
///     fn __sk_run(
///         b: &mut ::speedkit::bench::Bencher,
///     ) -> ::core::result::Result<(), ::speedkit::bench::BenchError> {
///         ::speedkit::__private::into_bench_result(linear(b))
///     }
///     ::speedkit::__private::inventory::submit! {
///         ::speedkit::bench::Workload {
///             name: "linear3", tags: &["matmul", "seed"], sizes: &[::speedkit::bench::Size::Tiny],
///             cuda_only: true, file: ::core::file!(), line: ::core::line!(), run: __sk_run,
///         }
///     }
/// };
/// # assert!(speedkit::bench::Workload::named("linear3").is_some());
/// ```
pub use speedkit_macros::bench;

/// Support for macro expansions. Not a public API: no stability promise.
#[doc(hidden)]
pub mod __private;

/// The guide's examples (docs/guide/), compiled and run as doc tests
/// (`cargo test -p speedkit --doc guide`). Pages without Rust examples are not listed.
#[cfg(doctest)]
pub mod guide {
    #[doc = include_str!("../../docs/guide/training-loop.md")]
    pub struct TrainingLoop;
    #[doc = include_str!("../../docs/guide/configuration.md")]
    pub struct Configuration;
    #[doc = include_str!("../../docs/guide/graph-mode.md")]
    pub struct GraphMode;
    #[doc = include_str!("../../docs/guide/fp8.md")]
    pub struct Fp8;
    #[doc = include_str!("../../docs/guide/kernels-and-overrides.md")]
    pub struct KernelsAndOverrides;
    #[doc = include_str!("../../docs/guide/memory.md")]
    pub struct Memory;
    #[doc = include_str!("../../docs/guide/data-parallel.md")]
    pub struct DataParallel;
    #[doc = include_str!("../../docs/guide/your-own-ops.md")]
    pub struct YourOwnOps;
    #[doc = include_str!("../../docs/guide/benchmarks-runner.md")]
    pub struct BenchmarksRunner;
}
