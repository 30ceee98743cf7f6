//! Procedural macros of [speedkit](https://example.invalid/speedkit): `#[speedkit::accelerate]`,
//! `#[speedkit::forward]` and `#[speedkit::bench]`.
//!
//! Use them through the `speedkit` crate, which re-exports them; the generated code names only
//! `::speedkit::__private::…`, `::speedkit::bench::…`, `::core::…` and `::std::…`, and every
//! identifier it introduces is hygienic (`Span::mixed_site`), so it cannot collide with yours.
//!
//! Every misuse is a compile error spanned at the offending tokens, and all of them are reported
//! together; the speed config itself is parsed and validated at compile time by
//! `speedkit-config`, the same code the runtime uses.

mod accelerate;
mod bench;
mod ctxt;
#[cfg(test)]
mod test_util;

use proc_macro::TokenStream;

/// Applies PyTorch's speed flags for the duration of a function, and restores them on exit.
///
/// ```ignore
/// use speedkit::{accelerate, forward};
///
/// #[accelerate(config = "speed.yaml", ctx = ctx)]
/// fn train(data: &Dataset, epochs: usize) -> anyhow::Result<f64> {
///     let vs = tch::nn::VarStore::new(ctx.device());
///     let model = Net::new(&vs.root());
///     let mut opt = ctx.adamw(&vs, 1e-3)?;
///     let mut last = 0.0;
///     for _ in 0..epochs {
///         for (x, y) in data.batches() {
///             #[forward]
///             let loss = model.forward(&x).cross_entropy_for_logits(&y);
///             opt.backward_step(&loss); // routed through the GradScaler when fp16
///             last = loss.double_value(&[]);
///         }
///     }
///     println!("{}", ctx.audit());
///     Ok(last)
/// }
/// ```
///
/// # Arguments
///
/// * `config = "speed.yaml"` — a speed config file, relative to the directory of the `Cargo.toml`
///   of the crate being compiled. It is read and validated **at compile time** (`.json` files as
///   JSON, anything else as YAML): a missing file, an unknown key (with its line, column and the
///   closest valid key) or a bad value is a compile error at the string literal. The text is
///   embedded with `include_str!`, so cargo rebuilds when the file changes.
/// * Inline keys instead of a file — `precision = "bf16"`, `tf32_matmul_precision = "high"`,
///   `device = "cuda"`, `deterministic = true`, and groups such as
///   `cudnn(benchmark = true, allow_tf32 = "auto")`, `grad_scaler(enabled = true, init_scale = 1024.0)`,
///   `compile(enabled = false)`, `sdp_backend(math = false)`, `optimizer(fused = true)`. Values
///   are string, boolean or number literals. They are validated at compile time like a file,
///   every problem reported at its own key. `config` and inline keys cannot be combined.
/// * No config argument: the defaults (`auto` everywhere: the runtime decides from the hardware).
/// * `ctx = name` — binds the `SpeedContext` to `name` so the body can use it (`ctx.adamw(..)`,
///   `ctx.audit()`). Without it the context lives in a hidden binding.
///
/// An unknown argument is an error that lists the valid ones and suggests the closest.
///
/// # What the function becomes
///
/// One statement is prepended to the body; nothing else of the signature or body changes
/// (attributes, visibility, generics, `where` clauses, `impl Trait`, `self` receivers, `unsafe`,
/// `extern "C"` are kept):
///
/// ```ignore
/// // fn returning `Result<..>` (by the last path segment: `Result`, `anyhow::Result`, `io::Result`):
/// let ctx = ::speedkit::__private::enter(SOURCE, "train")?;
/// // any other fn:
/// let ctx = ::speedkit::__private::enter_or_panic(SOURCE, "train");
/// ```
///
/// The context holds the guard that restores every flag when it drops, i.e. at function exit:
/// `return`, `?`, the end of the body and panic unwinding alike. The body is not wrapped in a
/// closure, so `?`, `return` and borrows mean what they meant. The error of `enter` is converted
/// by `?` with `From` (as `anyhow::Error` and `Box<dyn Error>` do).
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
#[proc_macro_attribute]
pub fn accelerate(args: TokenStream, item: TokenStream) -> TokenStream {
    accelerate::expand(args.into(), item.into()).into()
}

/// Runs one statement of an `#[speedkit::accelerate]` function under autocast.
///
/// ```ignore
/// #[speedkit::accelerate(precision = "bf16")]
/// fn step(model: &Net, opt: &mut tch::nn::Optimizer, x: &Tensor, y: &Tensor) {
///     #[speedkit::forward]
///     let loss = model.forward(x).mse_loss(y, tch::Reduction::Mean);
///     opt.backward_step(&loss);
///
///     #[speedkit::forward]
///     {
///         let logits = model.forward(x);
///         report(&logits);
///     }
/// }
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
#[proc_macro_attribute]
pub fn forward(_args: TokenStream, item: TokenStream) -> TokenStream {
    accelerate::body::forward_outside_accelerate(item.into()).into()
}

/// Registers a benchmark workload with speedkit's runner (`speedkit::bench_main!(my_crate)`,
/// `speedkit::bench_tests!(my_crate)`, naming the crate or module that holds it).
///
/// ```ignore
/// use speedkit::bench::Bencher;
///
/// #[speedkit::bench]
/// fn matmul(b: &mut Bencher) -> anyhow::Result<()> {
///     // ...
/// }
///
/// #[speedkit::bench(name = "linear3", tags = ["matmul", "seed"], sizes = ["tiny"], cuda_only)]
/// fn linear(b: &mut Bencher) {
///     // ...
/// }
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
/// The function is kept as written, and next to it:
///
/// ```ignore
/// const _: () = {
///     fn __sk_run(b: &mut ::speedkit::bench::Bencher)
///         -> ::core::result::Result<(), ::speedkit::bench::BenchError> {
///         ::speedkit::__private::into_bench_result(linear(b))
///     }
///     ::speedkit::__private::inventory::submit! {
///         ::speedkit::bench::Workload {
///             name: "linear3", tags: &["matmul", "seed"], sizes: &[::speedkit::bench::Size::Tiny],
///             cuda_only: true, file: ::core::file!(), line: ::core::line!(), run: __sk_run,
///         }
///     }
/// };
/// ```
#[proc_macro_attribute]
pub fn bench(args: TokenStream, item: TokenStream) -> TokenStream {
    bench::expand(args.into(), item.into()).into()
}
