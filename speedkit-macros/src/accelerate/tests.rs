//! Expansion snapshots and error tests of `#[speedkit::accelerate]`.
//!
//! Snapshots are the pretty-printed expansion of `quote!`-built inputs; the expected texts are
//! what `cargo expand` shows a user (modulo hygiene, which printing does not show).

use std::path::{Path, PathBuf};

use proc_macro2::TokenStream;
use quote::quote;

use super::{try_expand, with_errors};
use crate::test_util::{error_messages, pretty};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The pretty-printed expansion, with the fixtures directory shown as `$FIXTURES`.
fn expand_ok(args: TokenStream, item: TokenStream) -> String {
    let (tokens, result) = try_expand(args, item, Some(&fixtures()));
    if let Err(err) = result {
        let messages: Vec<String> = err.into_iter().map(|e| e.to_string()).collect();
        panic!("unexpected errors: {messages:#?}");
    }
    // Replaced before printing, so that line breaks do not depend on where the repository is.
    let fixtures = fixtures();
    let fixtures = fixtures.to_str().expect("UTF-8 fixtures path");
    let tokens = tokens.to_string().replace(fixtures, "$FIXTURES");
    pretty(tokens.parse().expect("tokens print and parse back"))
}

fn expand_err(args: TokenStream, item: TokenStream) -> Vec<String> {
    let (_, result) = try_expand(args, item, Some(&fixtures()));
    error_messages(result)
}

#[track_caller]
fn assert_snapshot(actual: &str, expected: &str) {
    assert!(
        actual == expected,
        "expansion differs from the snapshot\n--- actual ---\n{actual}\n--- expected ---\n{expected}"
    );
}

#[test]
fn plain_fn_keeps_attributes_and_gets_panicking_entry() {
    let out = expand_ok(
        quote!(),
        quote! {
            /// Trains.
            #[inline(never)]
            pub(crate) unsafe extern "C" fn train(epochs: usize) {
                #![allow(unused)]
                for _ in 0..epochs {}
            }
        },
    );
    assert_snapshot(
        &out,
        r#"/// Trains.
#[inline(never)]
pub(crate) unsafe extern "C" fn train(epochs: usize) {
    #![allow(unused)]
    let __sk_ctx = ::speedkit::__private::enter_or_panic(
        ::speedkit::__private::ConfigSource::Default,
        "train",
    );
    for _ in 0..epochs {}
}
"#,
    );
}

#[test]
fn result_fn_uses_question_mark_and_config_file() {
    let out = expand_ok(
        quote!(config = "speed.yaml"),
        quote! {
            fn train(data: &[f32]) -> anyhow::Result<f32> {
                let first = data.first().ok_or_else(|| anyhow::anyhow!("empty"))?;
                Ok(*first)
            }
        },
    );
    assert_snapshot(
        &out,
        r#"fn train(data: &[f32]) -> anyhow::Result<f32> {
    let __sk_ctx = ::speedkit::__private::enter(
        ::speedkit::__private::ConfigSource::Yaml {
            path: r"$FIXTURES/speed.yaml",
            text: ::core::include_str!(r"$FIXTURES/speed.yaml"),
        },
        "train",
    )?;
    let first = data.first().ok_or_else(|| anyhow::anyhow!("empty"))?;
    Ok(*first)
}
"#,
    );
}

#[test]
fn json_config_file_is_embedded_like_yaml() {
    let out = expand_ok(
        quote!(config = "speed.json"),
        quote!(
            fn f() {}
        ),
    );
    assert!(out.contains(r#"path: r"$FIXTURES/speed.json","#), "{out}");
}

#[test]
fn generic_fn_with_where_clause_and_impl_trait() {
    let out = expand_ok(
        quote!(),
        quote! {
            fn process<'a, T, I>(model: &'a T, batches: impl IntoIterator<Item = I>) -> Option<&'a T>
            where
                T: Module + ?Sized,
                I: Into<Tensor>,
            {
                Some(model)
            }
        },
    );
    assert_snapshot(
        &out,
        r#"fn process<'a, T, I>(model: &'a T, batches: impl IntoIterator<Item = I>) -> Option<&'a T>
where
    T: Module + ?Sized,
    I: Into<Tensor>,
{
    let __sk_ctx = ::speedkit::__private::enter_or_panic(
        ::speedkit::__private::ConfigSource::Default,
        "process",
    );
    Some(model)
}
"#,
    );
}

#[test]
fn method_with_named_ctx_inline_config_and_backward_step() {
    let out = expand_ok(
        quote!(ctx = ctx, precision = "bf16"),
        quote! {
            pub fn step(&mut self, x: &Tensor) -> Result<f64, Box<dyn std::error::Error>> {
                #[speedkit::forward]
                let loss = self.model.forward(x).mean(None);
                self.opt.backward_step(&loss);
                println!("{}", ctx.audit());
                Ok(loss.double_value(&[]))
            }
        },
    );
    assert_snapshot(
        &out,
        r##"pub fn step(&mut self, x: &Tensor) -> Result<f64, Box<dyn std::error::Error>> {
    let ctx = ::speedkit::__private::enter(
        ::speedkit::__private::ConfigSource::Json(r#"{"precision":"bf16"}"#),
        "step",
    )?;
    let loss = {
        let __sk_autocast = ::speedkit::__private::autocast_scope(&ctx);
        self.model.forward(x).mean(None)
    };
    ::speedkit::__private::backward_step(&ctx, &mut self.opt, &loss);
    println!("{}", ctx.audit());
    Ok(loss.double_value(&[]))
}
"##,
    );
}

#[test]
fn backward_step_receivers_and_shadowing() {
    let out = expand_ok(
        quote!(ctx = ctx),
        quote! {
            fn train(model: &Net, opt: &mut Optimizer, mut other: Optimizer, x: &Tensor) {
                #[forward]
                let mut loss = model.forward(x);
                opt.backward_step(&loss);
                other.backward_step(loss);
                (&mut other).backward_step(&loss);
                make_opt().backward_step(&loss);
                opt.backward_step(&other_loss);
                let loss = 1.0;
                opt.backward_step(&loss);
            }
        },
    );
    assert_snapshot(
        &out,
        r#"fn train(model: &Net, opt: &mut Optimizer, mut other: Optimizer, x: &Tensor) {
    let ctx = ::speedkit::__private::enter_or_panic(
        ::speedkit::__private::ConfigSource::Default,
        "train",
    );
    #[allow(unused_imports)]
    use forward as _;
    let mut loss = {
        let __sk_autocast = ::speedkit::__private::autocast_scope(&ctx);
        model.forward(x)
    };
    ::speedkit::__private::backward_step(&ctx, &mut *opt, &loss);
    ::speedkit::__private::backward_step(&ctx, &mut other, &loss);
    ::speedkit::__private::backward_step(&ctx, &mut other, &loss);
    ::speedkit::__private::backward_step(&ctx, &mut make_opt(), &loss);
    opt.backward_step(&other_loss);
    let loss = 1.0;
    opt.backward_step(&loss);
}
"#,
    );
}

#[test]
fn forward_on_block_let_else_and_in_closures_inside_a_loop() {
    let out = expand_ok(
        quote!(),
        quote! {
            fn train(model: &Net, x: &Tensor, y: &Tensor) {
                #[speedkit::forward]
                {
                    let logits = model.forward(x);
                    report(&logits);
                }
                #[speedkit::forward]
                unsafe { raw_forward(x) }
                'outer: for epoch in 0..3 {
                    #[speedkit::forward]
                    let Some(loss) = model.loss(x, y) else { continue 'outer };
                    let losses: Vec<_> = (0..2).map(|i| {
                        #[speedkit::forward]
                        let l = model.forward(x) * i;
                        l.backward();
                        l
                    }).collect();
                    let results = batches.iter().map(move |b| {
                        #[forward]
                        let out = model.forward(b)?;
                        Ok(out)
                    });
                }
            }
        },
    );
    assert_snapshot(
        &out,
        r#"fn train(model: &Net, x: &Tensor, y: &Tensor) {
    let __sk_ctx = ::speedkit::__private::enter_or_panic(
        ::speedkit::__private::ConfigSource::Default,
        "train",
    );
    {
        let __sk_autocast = ::speedkit::__private::autocast_scope(&__sk_ctx);
        let logits = model.forward(x);
        report(&logits);
    }
    unsafe {
        let __sk_autocast = ::speedkit::__private::autocast_scope(&__sk_ctx);
        raw_forward(x)
    }
    'outer: for epoch in 0..3 {
        let Some(loss) = ({
            let __sk_autocast = ::speedkit::__private::autocast_scope(&__sk_ctx);
            model.loss(x, y)
        }) else { continue 'outer };
        let losses: Vec<_> = (0..2)
            .map(|i| {
                let l = {
                    let __sk_autocast = ::speedkit::__private::autocast_scope(&__sk_ctx);
                    model.forward(x) * i
                };
                ::speedkit::__private::backward(&__sk_ctx, &l);
                l
            })
            .collect();
        let results = batches
            .iter()
            .map({
                let __sk_ctx = &__sk_ctx;
                move |b| {
                    #[allow(unused_imports)]
                    use forward as _;
                    let out = {
                        let __sk_autocast = ::speedkit::__private::autocast_scope(
                            &__sk_ctx,
                        );
                        model.forward(b)?
                    };
                    Ok(out)
                }
            });
    }
}
"#,
    );
}

#[test]
fn backward_then_step_in_the_same_block() {
    let out = expand_ok(
        quote!(),
        quote! {
            fn train(model: &Net, opt: &mut Optimizer, sched: &mut Sched, x: &Tensor) {
                let mut local = adam();
                opt.step();
                #[speedkit::forward]
                let loss = model.forward(x);
                loss.backward();
                opt.step();
                local.step();
                if accumulate() {
                    opt.step();
                }
                self.opt.step();
                opt.step_by(2);
                Sched::step(sched);
                {
                    let loss = 3;
                    loss.backward();
                }
                for loss in losses {
                    loss.backward();
                }
            }
        },
    );
    assert_snapshot(
        &out,
        r#"fn train(model: &Net, opt: &mut Optimizer, sched: &mut Sched, x: &Tensor) {
    let __sk_ctx = ::speedkit::__private::enter_or_panic(
        ::speedkit::__private::ConfigSource::Default,
        "train",
    );
    let mut local = adam();
    opt.step();
    let loss = {
        let __sk_autocast = ::speedkit::__private::autocast_scope(&__sk_ctx);
        model.forward(x)
    };
    ::speedkit::__private::backward(&__sk_ctx, &loss);
    ::speedkit::__private::step(&__sk_ctx, &mut *opt);
    ::speedkit::__private::step(&__sk_ctx, &mut local);
    if accumulate() {
        ::speedkit::__private::step(&__sk_ctx, &mut *opt);
    }
    self.opt.step();
    opt.step_by(2);
    Sched::step(sched);
    {
        let loss = 3;
        loss.backward();
    }
    for loss in losses {
        loss.backward();
    }
}
"#,
    );
}

#[test]
fn step_is_not_rewritten_without_a_backward_statement_in_scope() {
    let out = expand_ok(
        quote!(),
        quote! {
            fn train(model: &Net, opt: &mut Optimizer, x: &Tensor) {
                {
                    #[speedkit::forward]
                    let loss = model.forward(x);
                    loss.backward();
                }
                opt.step();
                let _ = untracked.backward();
            }
        },
    );
    assert!(out.contains("\n    opt.step();\n"), "{out}");
    assert!(out.contains("untracked.backward()"), "{out}");
}

#[test]
fn inline_keys_become_json() {
    let out = expand_ok(
        quote!(
            precision = "fp16",
            tf32_matmul_precision = "high",
            device = "cuda",
            deterministic = false,
            cudnn(benchmark = true, allow_tf32 = "auto"),
            grad_scaler(enabled = true, init_scale = 1024.0),
            compile(enabled = false),
            sdp_backend(math = false),
            optimizer(fused = true),
        ),
        quote! {
            fn train() -> std::io::Result<()> { Ok(()) }
        },
    );
    assert_snapshot(
        &out,
        r##"fn train() -> std::io::Result<()> {
    let __sk_ctx = ::speedkit::__private::enter(
        ::speedkit::__private::ConfigSource::Json(
            r#"{"precision":"fp16","tf32_matmul_precision":"high","device":"cuda","deterministic":false,"cudnn":{"benchmark":true,"allow_tf32":"auto"},"grad_scaler":{"enabled":true,"init_scale":1024.0},"compile":{"enabled":false},"sdp_backend":{"math":false},"optimizer":{"fused":true}}"#,
        ),
        "train",
    )?;
    Ok(())
}
"##,
    );
}

#[test]
fn nested_accelerated_fn_is_left_to_its_own_expansion() {
    let out = expand_ok(
        quote!(),
        quote! {
            fn outer() {
                #[speedkit::accelerate]
                fn inner(x: &Tensor) {
                    #[speedkit::forward]
                    let y = x * 2;
                }
                inner(&t);
            }
        },
    );
    assert!(
        out.contains("#[speedkit::forward]\n        let y = x * 2;"),
        "{out}"
    );
}

#[test]
fn async_fn_is_rejected_at_async() {
    let errors = expand_err(
        quote!(),
        quote!(
            async fn train() {}
        ),
    );
    assert_eq!(
        errors,
        [
            "#[speedkit::accelerate] does not support `async fn`: PyTorch's speed flags are \
          process-global and the guard that restores them must not be held across `.await`; \
          accelerate a synchronous function and call it (e.g. from `spawn_blocking`)"
        ]
    );
}

#[test]
fn const_fn_is_rejected_and_kept_as_is() {
    let item = quote!(
        const fn f() {}
    );
    let (tokens, result) = try_expand(quote!(), item.clone(), None);
    assert_eq!(
        error_messages(result),
        [
            "#[speedkit::accelerate] cannot go on a `const fn`: it sets PyTorch flags when the \
          function runs, which cannot happen at compile time; remove `const`"
        ]
    );
    assert_eq!(tokens.to_string(), item.to_string());
}

#[test]
fn not_a_function() {
    assert_eq!(
        expand_err(
            quote!(),
            quote!(
                struct S;
            )
        ),
        ["#[speedkit::accelerate] goes on a function with a body (a free function or a method)"]
    );
}

const PLACEMENT: &str =
    "#[speedkit::forward] goes on a `let` statement with an initializer or on a block `{ ... }`";

#[test]
fn forward_misuses_are_all_reported_together() {
    let errors = expand_err(
        quote!(),
        quote! {
            fn train(x: &Tensor) {
                #[speedkit::forward]
                #[forward]
                let a = x * 2;
                #[speedkit::forward(bf16)]
                let b = x * 3;
                #[speedkit::forward]
                let c;
                #[speedkit::forward]
                fn helper() {}
                #[speedkit::forward]
                println!("{}", x);
                #[speedkit::forward]
                x.print();
                let d = #[speedkit::forward] { x * 4 };
                fn nested(x: &Tensor) {
                    #[speedkit::forward]
                    let y = x * 5;
                }
                let fut = async move {
                    #[speedkit::forward]
                    let z = x * 6;
                };
            }
        },
    );
    assert_eq!(
        errors,
        [
            "#[speedkit::forward] is given twice on this statement; remove one".to_owned(),
            "#[speedkit::forward] takes no arguments: the autocast dtype comes from the speed \
             config of the enclosing #[speedkit::accelerate]"
                .to_owned(),
            format!(
                "{PLACEMENT}: this `let` has no initializer; write `#[speedkit::forward] let x = ...;`"
            ),
            format!(
                "{PLACEMENT}: an item (`fn`, `struct`, `use`, ...) runs no tensor code where it is \
                 declared"
            ),
            format!(
                "{PLACEMENT}: a macro statement cannot be wrapped; put it in a block, \
                 `#[speedkit::forward] {{ mac!(...); }}`"
            ),
            format!(
                "{PLACEMENT}: wrap the expression in a block, `#[speedkit::forward] {{ ... }}`, or \
                 bind its value with `#[speedkit::forward] let x = ...;`"
            ),
            format!(
                "{PLACEMENT}, as a statement of its own, not on an expression inside another \
                 statement"
            ),
            "#[speedkit::forward] inside a nested fn: that fn is not accelerated; mark it \
             #[speedkit::accelerate] itself"
                .to_owned(),
            "#[speedkit::forward] inside an `async` block or closure: the autocast scope must not \
             be held across `.await`; run the forward pass in synchronous code"
                .to_owned(),
        ]
    );
}

#[test]
fn argument_body_and_signature_errors_are_reported_together() {
    let errors = expand_err(
        quote!(precison = "bf16", cudnn(benchmrk = true)),
        quote! {
            async fn train(x: &Tensor) {
                #[speedkit::forward(x)]
                let y = x * 2;
            }
        },
    );
    assert_eq!(errors.len(), 4, "{errors:#?}");
    assert!(errors[0].starts_with("#[speedkit::accelerate] does not support `async fn`"));
    assert!(errors[1].starts_with(
        "unknown argument `precison` for #[speedkit::accelerate]; did you mean `precision`?"
    ));
    assert!(errors[2].starts_with("unknown key `cudnn.benchmrk`; did you mean `benchmark`?"));
    assert!(errors[3].starts_with("#[speedkit::forward] takes no arguments"));
}

#[test]
fn config_errors_point_at_the_literal() {
    let errors = expand_err(
        quote!(config = "bad_key.yaml"),
        quote!(
            fn f() {}
        ),
    );
    let path = fixtures().join("bad_key.yaml");
    assert_eq!(
        errors,
        [format!(
            "invalid speed config `{}`: unknown key `cudnn.benchmrk` at line 3, column 3; did you \
             mean `benchmark`? (valid keys here: enabled, benchmark, allow_tf32, deterministic)",
            path.display()
        )]
    );
}

#[test]
fn errors_keep_a_compiling_best_effort_expansion() {
    // The misplaced attribute is gone and the named context is still bound (default config), so
    // the only errors the user sees are the real ones.
    let out = with_errors(try_expand(
        quote!(ctx = ctx, precison = "bf16"),
        quote! {
            fn train(x: &Tensor) {
                #[speedkit::forward]
                x.print();
                ctx.audit();
            }
        },
        Some(&fixtures()),
    ));
    let text = out.to_string();
    assert_eq!(text.matches("compile_error").count(), 2, "{text}");
    assert!(!text.contains("# [speedkit :: forward]"), "{text}");
    assert!(text.contains("let ctx = :: speedkit :: __private :: enter_or_panic (:: speedkit :: __private :: ConfigSource :: Default"), "{text}");
}

#[test]
fn missing_manifest_dir_is_an_error_at_the_path() {
    let (_, result) = try_expand(
        quote!(config = "speed.yaml"),
        quote!(
            fn f() {}
        ),
        None,
    );
    assert_eq!(
        error_messages(result),
        ["cannot resolve the config path: CARGO_MANIFEST_DIR is not set (build with cargo)"]
    );
}

#[test]
fn var_store_arguments_give_the_plan_their_model_then_join_data_parallel() {
    let out = expand_ok(
        quote!(),
        quote! {
            fn train(vs: &nn::VarStore, head: &mut VarStore, x: &Tensor) -> speedkit::Result<()> {
                Ok(())
            }
        },
    );
    assert_snapshot(
        &out,
        r#"fn train(vs: &nn::VarStore, head: &mut VarStore, x: &Tensor) -> speedkit::Result<()> {
    let __sk_ctx = ::speedkit::__private::enter_for_models(
        ::speedkit::__private::ConfigSource::Default,
        "train",
        &[::speedkit::__private::var_store(&vs), ::speedkit::__private::var_store(&head)],
    )?;
    ::speedkit::__private::data_parallel(&__sk_ctx, &vs)?;
    ::speedkit::__private::data_parallel(&__sk_ctx, &head)?;
    Ok(())
}
"#,
    );
}
