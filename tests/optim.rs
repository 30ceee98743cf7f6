//! speedkit's AdamW (fused and foreach) against the textbook update and tch's `nn::AdamW`.

mod common;

use speedkit::optim::{AdamW, AdamWOptimizer, ParamGroup};
use tch::nn::OptimizerConfig;
use tch::{nn, Device, Kind, Tensor};

const STEPS: usize = 5;

/// Fixed gradients for every step, so all implementations see the same sequence.
fn gradient_sequence(shape: &[i64]) -> Vec<Tensor> {
    tch::manual_seed(7);
    (0..STEPS)
        .map(|_| Tensor::randn(shape, (Kind::Float, Device::Cpu)))
        .collect()
}

/// AdamW as in Loshchilov & Hutter / torch.optim.AdamW, in f64.
fn textbook(p0: &Tensor, grads: &[Tensor], c: &AdamW) -> Tensor {
    let mut p = p0.to_kind(Kind::Double);
    let mut m = p.zeros_like();
    let mut v = p.zeros_like();
    for (t, g) in grads.iter().enumerate() {
        let t = (t + 1) as i32;
        let g = g.to_kind(Kind::Double);
        p = &p * (1.0 - c.lr * c.wd);
        m = &m * c.beta1 + &g * (1.0 - c.beta1);
        v = &v * c.beta2 + &g * &g * (1.0 - c.beta2);
        let m_hat = &m / (1.0 - c.beta1.powi(t));
        let v_hat = &v / (1.0 - c.beta2.powi(t));
        p = &p - m_hat * c.lr / (v_hat.sqrt() + c.eps);
    }
    p
}

fn run_speedkit(p0: &Tensor, grads: &[Tensor], c: &AdamW, fused: bool) -> Tensor {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut p = vs.root().zeros("p", &p0.size());
    tch::no_grad(|| p.copy_(p0));
    let mut opt = AdamWOptimizer::new(&vs, c.clone(), fused).unwrap();
    for g in grads {
        opt.zero_grad().unwrap();
        (&p * g).sum(None).backward();
        opt.step().unwrap();
    }
    assert_eq!(opt.steps_taken().unwrap(), STEPS as i64);
    p.detach()
}

fn config() -> AdamW {
    AdamW {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        wd: 0.1,
        exclude_from_decay: false,
    }
}

#[test]
fn foreach_adamw_matches_the_textbook_update() {
    let p0 = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
    let grads = gradient_sequence(&[16, 8]);
    let err = common::rel_err(
        &run_speedkit(&p0, &grads, &config(), false),
        &textbook(&p0, &grads, &config()),
    );
    assert!(err < 1e-6, "relative error {err:e}");
}

#[test]
fn fused_adamw_matches_the_textbook_update() {
    let p0 = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
    let grads = gradient_sequence(&[16, 8]);
    let err = common::rel_err(
        &run_speedkit(&p0, &grads, &config(), true),
        &textbook(&p0, &grads, &config()),
    );
    assert!(err < 1e-6, "relative error {err:e}");
}

#[test]
fn adamw_matches_tch_nn_adamw() {
    let p0 = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
    let grads = gradient_sequence(&[16, 8]);
    let c = config();
    let vs = nn::VarStore::new(Device::Cpu);
    let mut p = vs.root().zeros("p", &[16, 8]);
    tch::no_grad(|| p.copy_(&p0));
    let mut opt = nn::AdamW {
        beta1: c.beta1,
        beta2: c.beta2,
        wd: c.wd,
        eps: c.eps,
        amsgrad: false,
    }
    .build(&vs, c.lr)
    .unwrap();
    for g in &grads {
        opt.zero_grad();
        (&p * g).sum(None).backward();
        opt.step();
    }
    for fused in [false, true] {
        let err = common::rel_err(&run_speedkit(&p0, &grads, &c, fused), &p);
        assert!(err < 1e-6, "fused={fused}: relative error {err:e}");
    }
}

#[test]
fn decay_exclusion_leaves_biases_and_norms_undecayed() {
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().ones("w", &[4, 4]);
    let b = vs.root().ones("b", &[4]);
    let mut opt = AdamWOptimizer::new(
        &vs,
        AdamW {
            lr: 0.1,
            wd: 0.5,
            exclude_from_decay: true,
            ..Default::default()
        },
        false,
    )
    .unwrap();
    // Zero gradients: only weight decay moves parameters.
    ((&w * 0.0).sum(None) + (&b * 0.0).sum(None)).backward();
    opt.step().unwrap();
    assert!(
        (w.double_value(&[0, 0]) - 0.95).abs() < 1e-6,
        "weights decay by lr * wd"
    );
    assert_eq!(b.double_value(&[0]), 1.0, "biases do not decay");
}

#[test]
fn parameters_without_gradients_are_skipped() {
    let vs = nn::VarStore::new(Device::Cpu);
    let used = vs.root().ones("used", &[3]);
    let unused = vs.root().ones("unused", &[3]);
    let mut opt = AdamWOptimizer::new(
        &vs,
        AdamW {
            wd: 0.5,
            ..Default::default()
        },
        false,
    )
    .unwrap();
    used.sum(None).backward();
    opt.step().unwrap();
    assert_ne!(used, Tensor::ones([3], (Kind::Float, Device::Cpu)));
    assert_eq!(unused, Tensor::ones([3], (Kind::Float, Device::Cpu)));
}

#[test]
fn set_lr_changes_the_device_side_learning_rate() {
    let vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root().zeros("p", &[2]);
    let mut opt = AdamWOptimizer::new(
        &vs,
        AdamW {
            lr: 1.0,
            wd: 0.0,
            ..Default::default()
        },
        false,
    )
    .unwrap();
    opt.set_lr(0.25).unwrap();
    p.sum(None).backward();
    opt.step().unwrap();
    // First Adam step moves each coordinate by lr (m̂/√v̂ = 1 for a constant gradient).
    // float32 bias corrections round at ~1e-6 relative.
    assert!(
        (p.double_value(&[0]) + 0.25).abs() < 1e-5,
        "{}",
        p.double_value(&[0])
    );
    assert_eq!(opt.lrs(), [0.25]);
}

#[test]
fn parameter_groups_take_their_own_learning_rates() {
    let vs = nn::VarStore::new(Device::Cpu);
    let a = vs.root().zeros("a", &[2]);
    let b = vs.root().zeros("b", &[2]);
    let groups = vec![
        ParamGroup {
            params: vec![a.shallow_clone()],
            lr: 0.1,
            weight_decay: 0.0,
        },
        ParamGroup {
            params: vec![b.shallow_clone()],
            lr: 0.01,
            weight_decay: 0.0,
        },
    ];
    let mut opt = AdamWOptimizer::with_groups(groups, &AdamW::default(), false).unwrap();
    (a.sum(None) + b.sum(None)).backward();
    opt.step().unwrap();
    assert!((a.double_value(&[0]) + 0.1).abs() < 1e-6);
    assert!((b.double_value(&[0]) + 0.01).abs() < 1e-6);
}

#[test]
fn optimizer_state_saves_and_loads() {
    let dir = std::env::temp_dir().join(format!("speedkit-optim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("adamw.pt");
    let vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root().randn("p", &[5], 0.0, 1.0);
    let mut opt = AdamWOptimizer::new(&vs, AdamW::default(), false).unwrap();
    for _ in 0..3 {
        opt.zero_grad().unwrap();
        p.square().sum(None).backward();
        opt.step().unwrap();
    }
    opt.save(&path).unwrap();
    let mut fresh = AdamWOptimizer::new(&vs, AdamW::default(), false).unwrap();
    fresh.load(&path).unwrap();
    assert_eq!(fresh.steps_taken().unwrap(), 3);
    let names = |o: &AdamWOptimizer| {
        o.state_tensors()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.copy()))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&fresh), names(&opt));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_betas_are_rejected() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _p = vs.root().zeros("p", &[1]);
    assert!(AdamWOptimizer::new(
        &vs,
        AdamW {
            beta1: 1.0,
            ..Default::default()
        },
        false
    )
    .is_err());
}

#[test]
fn zero_grad_drops_gradients_by_default() {
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().ones("w", &[4]);
    let mut opt = AdamWOptimizer::new(&vs, config(), false).unwrap();
    (&w * 3.0).sum(None).backward();
    assert!(w.grad().defined());
    opt.zero_grad().unwrap();
    assert!(!w.grad().defined());
}

#[test]
fn zero_grads_in_place_keeps_the_same_gradient_tensor_filled_with_zeros() {
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().ones("w", &[4]);
    let mut opt = AdamWOptimizer::new(&vs, config(), false).unwrap();
    opt.zero_grads_in_place(true);
    (&w * 3.0).sum(None).backward();
    let before = w.grad().data_ptr();
    opt.zero_grad().unwrap();
    assert_eq!(w.grad().data_ptr(), before);
    assert_eq!(w.grad(), Tensor::zeros([4], (Kind::Float, Device::Cpu)));
}

#[test]
fn dropped_and_zeroed_gradients_give_the_same_training() {
    let p0 = Tensor::randn([6], (Kind::Float, Device::Cpu));
    let grads = gradient_sequence(&[6]);
    let run = |in_place: bool| {
        let vs = nn::VarStore::new(Device::Cpu);
        let mut p = vs.root().zeros("p", &[6]);
        tch::no_grad(|| p.copy_(&p0));
        let mut opt = AdamWOptimizer::new(&vs, config(), false).unwrap();
        opt.zero_grads_in_place(in_place);
        for g in &grads {
            opt.zero_grad().unwrap();
            (&p * g).sum(None).backward();
            opt.step().unwrap();
        }
        p.detach()
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn adamw_makes_its_state_at_its_first_step() {
    let vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root().randn("p", &[64], 0.0, 1.0);
    let mut opt = AdamWOptimizer::new(&vs, AdamW::default(), false).unwrap();
    // The learning rate alone: the forward and backward of the first step run without the state.
    assert_eq!(opt.memory().state, 4);
    assert_eq!(opt.steps_taken().unwrap(), 0);
    p.square().sum(None).backward();
    opt.step().unwrap();
    // Two fp32 moments of 64 values, a step count, the learning rate.
    assert_eq!(opt.memory().state, 2 * 64 * 4 + 4 + 4);
    assert_eq!(opt.steps_taken().unwrap(), 1);
}

#[test]
fn state_saved_before_the_first_step_is_what_that_step_starts_from() {
    let dir = std::env::temp_dir().join(format!("speedkit-optim-fresh-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("adamw.pt");
    let vs = nn::VarStore::new(Device::Cpu);
    let _p = vs.root().randn("p", &[5], 0.0, 1.0);
    let fresh = AdamWOptimizer::new(&vs, AdamW::default(), false).unwrap();
    fresh.save(&path).unwrap();
    let mut trained = AdamWOptimizer::new(&vs, AdamW::default(), false).unwrap();
    trained.load(&path).unwrap();
    for (name, t) in trained.state_tensors().unwrap() {
        let expected = if name.ends_with(".lr") {
            f64::from(1e-3f32)
        } else {
            0.0
        };
        assert_eq!(t.abs().max().double_value(&[]), expected, "{name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Three parameters with gradients, `c` in the first part, `a` in the second, `b` in none.
fn three_parameters_with_gradients() -> (nn::VarStore, [Tensor; 3]) {
    let vs = nn::VarStore::new(Device::Cpu);
    let params = ["a", "b", "c"].map(|name| vs.root().ones(name, &[4]));
    for (i, p) in params.iter().enumerate() {
        (p * (i as f64 + 1.0)).sum(None).backward();
    }
    (vs, params)
}

#[test]
fn stepping_in_parts_reads_each_part_only_after_it_is_ready_and_equals_one_step() {
    use speedkit::amp::ScaledOptimizer;
    for fused in [false, true] {
        let (whole_vs, whole) = three_parameters_with_gradients();
        let mut opt = AdamWOptimizer::new(&whole_vs, config(), fused).unwrap();
        opt.step().unwrap();

        let (vs, [a, b, c]) = three_parameters_with_gradients();
        let mut opt = AdamWOptimizer::new(&vs, config(), fused).unwrap();
        let parts = [vec![c.shallow_clone()], vec![a.shallow_clone()]];
        let one = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let mut updated_when_ready = Vec::new();
        opt.step_in_parts(&parts, &mut |k| {
            updated_when_ready.push((k, [&a, &b, &c].map(|p| *p != one)));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            updated_when_ready,
            [(0, [false, false, false]), (1, [false, false, true])],
            "fused {fused}: a part is updated after its ready, not before"
        );
        for (name, (got, want)) in ["a", "b", "c"].iter().zip([&a, &b, &c].iter().zip(&whole)) {
            assert!(
                got.equal(want),
                "fused {fused}: {name} differs from one step"
            );
        }
    }
}
