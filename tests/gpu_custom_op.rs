//! Users' own fused ops on the GPU: the fused SwiGLU of `examples/custom_op` against tch's composite
//! (forward and backward, fp32/bf16/fp16, odd shapes), inside a graphed step equal to eager, and the
//! argument checks of `speedkit::cuda` refusing a wrong launch before it happens. Skipped, with the
//! reason printed, without a GPU.

mod common;

#[path = "../examples/custom_op/swiglu.rs"]
#[allow(dead_code)]
mod swiglu;

use common::{cuda_or_skip, rel_err, run_steps};
use speedkit::cuda::{Arg, CudaModule, Param};
use speedkit::function::{apply, BackwardContext, ForwardContext, Function};
use speedkit::optim::AdamW;
use speedkit::{SpeedConfig, SpeedContext};
use swiglu::{swiglu, swiglu_composite};
use tch::{nn, nn::Module, Device, Kind, Tensor};

/// Forward outputs and input gradients of `op` for `x` and an output gradient `g`.
fn run(op: impl Fn(&Tensor) -> Tensor, x: &Tensor, g: &Tensor) -> (Tensor, Tensor) {
    let x = x.detach().set_requires_grad(true);
    let y = op(&x);
    let dx = speedkit::autograd::grad(&[y.shallow_clone()], &[g.shallow_clone()], &[&x])
        .unwrap()
        .remove(0)
        .unwrap();
    (y, dx)
}

#[test]
fn the_fused_swiglu_matches_the_composite_forward_and_backward() {
    // One at a time: the graphed-and-eager test reseeds the generator the others draw from.
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("the_fused_swiglu_matches_the_composite_forward_and_backward")
    else {
        return;
    };
    // Widths that take the 8-wide path (64, 136) and the scalar one (13), a 3-d input, one row.
    let shapes: [&[i64]; 4] = [&[3, 2 * 13], &[37, 2 * 64], &[5, 7, 2 * 136], &[1, 2 * 8]];
    for (kind, tolerance) in [
        (Kind::Float, 1e-5),
        (Kind::BFloat16, 2e-2),
        (Kind::Half, 3e-3),
    ] {
        for shape in shapes {
            let x = Tensor::randn(shape, (Kind::Float, device)).to_kind(kind);
            let mut out_shape = shape.to_vec();
            *out_shape.last_mut().unwrap() /= 2;
            let g = Tensor::randn(out_shape.as_slice(), (Kind::Float, device)).to_kind(kind);
            let (y, dx) = run(|x| swiglu(x).unwrap(), &x, &g);
            // The composite in fp32 is the reference for every storage type.
            let (y_ref, dx_ref) = run(
                swiglu_composite,
                &x.to_kind(Kind::Float),
                &g.to_kind(Kind::Float),
            );
            assert_eq!(y.kind(), kind);
            let (e_y, e_dx) = (rel_err(&y, &y_ref), rel_err(&dx, &dx_ref));
            assert!(
                e_y < tolerance && e_dx < tolerance,
                "{kind:?} {shape:?}: y {e_y:.2e}, dx {e_dx:.2e}"
            );
        }
    }
}

#[test]
fn a_model_with_the_fused_swiglu_trains_the_same_graphed_and_eager() {
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("a_model_with_the_fused_swiglu_trains_the_same_graphed_and_eager")
    else {
        return;
    };
    let losses = |graphed: bool| {
        let ctx = SpeedContext::new(&SpeedConfig::auto()).unwrap();
        tch::manual_seed(0);
        let vs = nn::VarStore::new(device);
        let up = nn::linear(vs.root() / "up", 64, 2 * 96, Default::default());
        let down = nn::linear(vs.root() / "down", 96, 64, Default::default());
        let mut opt = ctx
            .adamw(
                &vs,
                AdamW {
                    lr: 1e-3,
                    ..Default::default()
                },
            )
            .unwrap();
        let x = Tensor::randn([256, 64], (Kind::Float, device));
        let target = Tensor::randn([256, 64], (Kind::Float, device));
        run_steps(
            &ctx,
            |_| {
                let loss = ctx.autocast(|| -> speedkit::Result<Tensor> {
                    let h = swiglu(&up.forward(&x))?;
                    Ok((down.forward(&h) - &target).square().mean(Kind::Float))
                })?;
                ctx.backward_step(&loss, &mut opt)?;
                Ok(Some(loss))
            },
            graphed,
            8,
        )
    };
    let (eager, graphed) = (losses(false), losses(true));
    for (e, g) in eager.iter().zip(&graphed) {
        assert!(
            (e - g).abs() <= 1e-3 * e.abs(),
            "eager {eager:?} graphed {graphed:?}"
        );
    }
    assert!(graphed.last() < graphed.first(), "it learns: {graphed:?}");
}

const ADD: &str = r#"extern "C" __global__ void add(const float* a, const float* b, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}
"#;

fn add_kernel(device: Device) -> speedkit::cuda::CudaKernel {
    let t = Param::Tensor(Kind::Float);
    CudaModule::new("test_add.cu", ADD)
        .unwrap()
        .kernel("add", &[t, t, t, Param::I32], device)
        .unwrap()
}

#[test]
fn a_users_kernel_runs_on_tensors() {
    // One at a time: the graphed-and-eager test reseeds the generator the others draw from.
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("a_users_kernel_runs_on_tensors") else {
        return;
    };
    let (a, b) = (
        Tensor::randn([1000], (Kind::Float, device)),
        Tensor::randn([1000], (Kind::Float, device)),
    );
    let out = Tensor::full([1000], f64::NAN, (Kind::Float, device));
    add_kernel(device)
        .launch(
            4,
            256,
            0,
            &[(&a).into(), (&b).into(), (&out).into(), 1000i32.into()],
        )
        .unwrap();
    assert!(out.equal(&(&a + &b)));
}

#[test]
fn a_launch_with_a_wrong_argument_is_refused_before_it_runs() {
    // One at a time: the graphed-and-eager test reseeds the generator the others draw from.
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("a_launch_with_a_wrong_argument_is_refused_before_it_runs")
    else {
        return;
    };
    let kernel = add_kernel(device);
    let f = Tensor::zeros([8], (Kind::Float, device));
    let out = Tensor::full([8], 7.0, (Kind::Float, device));
    let half = Tensor::zeros([8], (Kind::Half, device));
    let cpu = Tensor::zeros([8], (Kind::Float, Device::Cpu));
    let strided = Tensor::zeros([16], (Kind::Float, device)).slice(0, 0, 16, 2);
    let cases: [(&str, Vec<Arg<'_>>); 5] = [
        (
            "Half tensor",
            vec![(&half).into(), (&f).into(), (&out).into(), 8i32.into()],
        ),
        (
            "tensor on Cpu",
            vec![(&cpu).into(), (&f).into(), (&out).into(), 8i32.into()],
        ),
        (
            "not contiguous",
            vec![(&strided).into(), (&f).into(), (&out).into(), 8i32.into()],
        ),
        (
            "takes 4 arguments, got 3",
            vec![(&f).into(), (&f).into(), (&out).into()],
        ),
        (
            "must be I32, got an i64",
            vec![(&f).into(), (&f).into(), (&out).into(), 8i64.into()],
        ),
    ];
    for (expected, args) in cases {
        let err = kernel.launch(1, 32, 0, &args).unwrap_err().to_string();
        assert!(err.contains(expected), "{expected}: {err}");
    }
    assert!(
        out.eq(7.0).all().int64_value(&[]) == 1,
        "no refused launch ran"
    );
}

#[test]
fn a_declaration_that_differs_from_the_compiled_kernel_is_refused() {
    // One at a time: the graphed-and-eager test reseeds the generator the others draw from.
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("a_declaration_that_differs_from_the_compiled_kernel_is_refused")
    else {
        return;
    };
    let t = Param::Tensor(Kind::Float);
    // The kernel takes (float*, float*, float*, int); declared with a trailing i64 instead.
    let err = CudaModule::new("test_add.cu", ADD)
        .unwrap()
        .kernel("add", &[t, t, t, Param::I64], device)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the declaration and the source differ"),
        "{err}"
    );
}

#[test]
fn autocast_inputs_reach_the_forward_in_the_cast_type_with_autocast_off() {
    // One at a time: the graphed-and-eager test reseeds the generator the others draw from.
    let _serial = common::serial();
    let Some(device) =
        cuda_or_skip("autocast_inputs_reach_the_forward_in_the_cast_type_with_autocast_off")
    else {
        return;
    };
    struct Probe;
    impl Function for Probe {
        fn autocast_inputs(&self) -> Option<Kind> {
            Some(Kind::Float)
        }
        fn forward(
            &mut self,
            _: &mut ForwardContext<'_>,
            inputs: &[Tensor],
        ) -> speedkit::Result<Vec<Tensor>> {
            // A matmul under autocast would run in bf16; with autocast off it stays fp32.
            Ok(vec![inputs[0].matmul(&inputs[0])])
        }
        fn backward(
            &mut self,
            _: &mut BackwardContext<'_>,
            g: &[Option<Tensor>],
        ) -> speedkit::Result<Vec<Option<Tensor>>> {
            Ok(vec![g[0].as_ref().map(Tensor::shallow_clone)])
        }
    }
    let x = Tensor::randn([8, 8], (Kind::BFloat16, device));
    let y = speedkit::amp::autocast(device, Kind::BFloat16, || {
        apply(Probe, &[&x]).unwrap().remove(0)
    })
    .unwrap();
    assert_eq!(y.kind(), Kind::Float);
}
