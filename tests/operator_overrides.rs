//! Your own kernel as an ATen operator's implementation (`speedkit::overrides::OperatorOverride`):
//! which calls reach it, what a declined call, an error, a panic and a call from inside the kernel
//! do, what the registration refuses, and that the dispatcher is as it was after the registration
//! or the context holding it drops, also by a panic. Everything here runs on the CPU keys, so in
//! CI; the CUDA keys take the same path (`gpu_overrides.rs` runs speedkit's own override built on
//! it).

use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use speedkit::overrides::{dispatcher_table, DispatchKey, OperatorOverride, Reply, Value};
use speedkit::{SpeedConfig, SpeedContext};
use tch::{Device, Kind, Tensor};

/// The dispatcher is process-wide and tests run on threads of one process: one override at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where this file's registrations say they come from in the dispatcher's table.
const HERE: &str = "operator_overrides.rs";

fn registered_here(operator: &str) -> bool {
    dispatcher_table(operator).unwrap().contains(HERE)
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

/// ReLU that adds 100, so its results are told apart from ATen's.
fn relu_plus_100() -> OperatorOverride {
    OperatorOverride::new("aten::relu", DispatchKey::Cpu, |call| {
        let x = call.tensor("self")?;
        Ok(Reply::Ran(vec![x.clamp_min(0.0) + 100.0]))
    })
}

fn cpu_context() -> SpeedContext {
    SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu").unwrap()).unwrap()
}

#[test]
fn every_call_of_the_operator_under_its_key_runs_the_kernel() {
    let _serial = serial();
    let registration = relu_plus_100().register().unwrap();
    let x = Tensor::from_slice(&[-1.0f32, 2.0]);
    assert_eq!(values(&x.relu()), [100.0, 102.0]);
    assert_eq!(values(&x.f_relu().unwrap()), [100.0, 102.0]);
    assert_eq!(registration.stats().ran, 2);
}

#[test]
fn dropping_the_registration_brings_back_atens_kernel() {
    let _serial = serial();
    let registration = relu_plus_100().register().unwrap();
    assert!(registered_here("aten::relu"));
    drop(registration);
    assert!(!registered_here("aten::relu"));
    assert_eq!(
        values(&Tensor::from_slice(&[-1.0f32, 2.0]).relu()),
        [0.0, 2.0]
    );
}

#[test]
fn the_dispatcher_table_shows_the_key_and_where_the_override_was_made() {
    let _serial = serial();
    let registration = relu_plus_100().register().unwrap();
    let table = dispatcher_table("aten::relu").unwrap();
    let line = table
        .lines()
        .find(|l| l.contains(HERE))
        .expect("registered here");
    assert!(line.starts_with("CPU"), "{line}");
    assert!(registration.location().contains(HERE));
}

#[test]
fn a_declined_call_runs_the_kernel_it_replaced_and_is_counted_with_its_reason() {
    let _serial = serial();
    let registration = OperatorOverride::new("aten::relu", DispatchKey::Cpu, |call| {
        let x = call.tensor("self")?;
        if x.kind() == Kind::Double {
            return Ok(Reply::Declined("fp64".into()));
        }
        Ok(Reply::Ran(vec![x.clamp_min(0.0) + 100.0]))
    })
    .register()
    .unwrap();
    let y = Tensor::from_slice(&[-1.0f64, 2.0]).relu();
    assert_eq!(Vec::<f64>::try_from(&y).unwrap(), [0.0, 2.0]);
    let stats = registration.stats();
    assert_eq!((stats.ran, stats.declined), (0, 1));
    assert_eq!(stats.last_declined.as_deref(), Some("fp64"));
}

#[test]
fn the_operator_called_inside_its_own_kernel_runs_the_kernel_it_replaced() {
    let _serial = serial();
    let _registration = OperatorOverride::new("aten::relu", DispatchKey::Cpu, |call| {
        Ok(Reply::Ran(vec![call.tensor("self")?.relu() + 1.0]))
    })
    .register()
    .unwrap();
    assert_eq!(
        values(&Tensor::from_slice(&[-1.0f32, 2.0]).relu()),
        [1.0, 3.0]
    );
}

#[test]
fn a_kernel_error_reaches_the_operators_caller_as_an_error() {
    let _serial = serial();
    let _registration = OperatorOverride::new("aten::relu", DispatchKey::Cpu, |call| {
        call.int("self")?; // `self` is a tensor: a Misuse error
        unreachable!()
    })
    .register()
    .unwrap();
    let err = Tensor::from_slice(&[1.0f32]).f_relu().unwrap_err();
    assert!(err.to_string().contains("not an integer"), "{err}");
}

#[test]
fn a_kernel_panic_reaches_the_operators_caller_as_an_error_and_the_next_call_works() {
    let _serial = serial();
    let calls = Arc::new(Mutex::new(0));
    let seen = Arc::clone(&calls);
    let registration = OperatorOverride::new("aten::relu", DispatchKey::Cpu, move |call| {
        let mut n = seen.lock().unwrap_or_else(PoisonError::into_inner);
        *n += 1;
        if *n == 1 {
            panic!("first call");
        }
        Ok(Reply::Ran(vec![call.tensor("self")?.clamp_min(0.0)]))
    })
    .register()
    .unwrap();
    let x = Tensor::from_slice(&[-1.0f32]);
    let err = x.f_relu().unwrap_err();
    assert!(err.to_string().contains("panicked: first call"), "{err}");
    assert_eq!(values(&x.f_relu().unwrap()), [0.0]);
    assert_eq!(
        (registration.stats().failed, registration.stats().ran),
        (1, 1)
    );
}

#[test]
fn autograd_records_the_operators_own_formula_around_a_backend_kernel() {
    let _serial = serial();
    let registration = OperatorOverride::new("aten::relu", DispatchKey::Cpu, |call| {
        Ok(Reply::Ran(vec![call.tensor("self")?.clamp_min(0.0)]))
    })
    .register()
    .unwrap();
    let x = Tensor::from_slice(&[-1.0f32, 2.0, 3.0]).set_requires_grad(true);
    x.relu().sum(Kind::Float).backward();
    assert_eq!(values(&x.grad()), [0.0, 1.0, 1.0]);
    assert_eq!(registration.stats().ran, 1);
}

#[test]
fn arguments_arrive_by_their_schema_names_and_types() {
    let _serial = serial();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let _registration =
        OperatorOverride::new("aten::sum.dim_IntList", DispatchKey::Cpu, move |call| {
            let described: Vec<String> = call
                .arguments()
                .map(|(name, value)| match value {
                    Value::Tensor(t) => format!("{name}: tensor {:?}", t.size()),
                    other => format!("{name}: {other:?}"),
                })
                .collect();
            *record.lock().unwrap() = described;
            assert_eq!(call.kind("dtype")?, None);
            Ok(Reply::Declined("only looking".into()))
        })
        .register()
        .unwrap();
    let total = Tensor::ones([2, 3], (Kind::Float, Device::Cpu)).sum_dim_intlist(1, true, None);
    assert_eq!(values(&total), [3.0, 3.0]);
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "self: tensor [2, 3]",
            "dim: Ints([1])",
            "keepdim: Bool(true)",
            "dtype: None"
        ]
    );
}

#[test]
fn scalars_and_strings_arrive_as_floats_and_text() {
    let _serial = serial();
    let _registration = OperatorOverride::new("aten::gelu", DispatchKey::Cpu, |call| {
        assert_eq!(call.str("approximate")?, "tanh");
        Ok(Reply::Declined("only looking".into()))
    })
    .register()
    .unwrap();
    let _leaky = OperatorOverride::new("aten::leaky_relu", DispatchKey::Cpu, |call| {
        assert_eq!(call.double("negative_slope")?, 0.01);
        Ok(Reply::Declined("only looking".into()))
    })
    .register()
    .unwrap();
    let x = Tensor::from_slice(&[1.0f32]);
    let _ = x.f_gelu("tanh").unwrap();
    let _ = x.f_leaky_relu().unwrap(); // tch passes PyTorch's default slope
}

#[test]
fn a_result_count_other_than_the_schemas_is_an_error() {
    let _serial = serial();
    let _registration = OperatorOverride::new("aten::relu", DispatchKey::Cpu, |call| {
        let x = call.tensor("self")?;
        Ok(Reply::Ran(vec![x.shallow_clone(), x.shallow_clone()]))
    })
    .register()
    .unwrap();
    let err = Tensor::from_slice(&[1.0f32]).f_relu().unwrap_err();
    assert!(
        err.to_string()
            .contains("handed back 2 tensors; the operator returns 1"),
        "{err}"
    );
}

fn refusal(operator: &str, key: DispatchKey) -> String {
    let ok = |_: &speedkit::overrides::OverrideCall<'_>| Ok(Reply::Declined(String::new()));
    OperatorOverride::new(operator, key, ok)
        .register()
        .unwrap_err()
        .to_string()
}

#[test]
fn an_in_place_operator_is_refused() {
    let _serial = serial();
    let err = refusal("aten::relu_", DispatchKey::Cpu);
    assert!(err.contains("in-place or out="), "{err}");
    assert!(!registered_here("aten::relu_"));
}

#[test]
fn an_operator_returning_other_than_tensors_is_refused() {
    let _serial = serial();
    let err = refusal("aten::size.int", DispatchKey::Cpu);
    assert!(err.contains("returns int"), "{err}");
}

#[test]
fn a_composite_operator_is_refused_under_a_backend_key_and_taken_under_autocast() {
    let _serial = serial();
    let err = refusal("aten::log_softmax.int", DispatchKey::Cpu);
    assert!(err.contains("composite"), "{err}");
    assert!(!registered_here("aten::log_softmax.int"));
    let ok = |_: &speedkit::overrides::OverrideCall<'_>| Ok(Reply::Declined(String::new()));
    let registration =
        OperatorOverride::new("aten::log_softmax.int", DispatchKey::AutocastCuda, ok)
            .register()
            .unwrap();
    assert!(registered_here("aten::log_softmax.int"));
    drop(registration);
    assert!(!registered_here("aten::log_softmax.int"));
}

#[test]
fn an_unknown_operator_is_an_error_naming_it() {
    let _serial = serial();
    let err = refusal("aten::no_such_op", DispatchKey::Cpu);
    assert!(err.contains("no operator aten::no_such_op"), "{err}");
}

#[test]
fn an_unqualified_operator_name_is_an_error() {
    let _serial = serial();
    let err = refusal("relu", DispatchKey::Cpu);
    assert!(err.contains("not a qualified operator name"), "{err}");
}

#[test]
fn an_autocast_kernel_runs_with_autocast_off_for_the_operators_it_calls() {
    let _serial = serial();
    let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    let under_autocast =
        || speedkit::amp::autocast(Device::Cpu, Kind::BFloat16, || a.mm(&a)).unwrap();
    assert_eq!(
        under_autocast().kind(),
        Kind::BFloat16,
        "CPU autocast runs mm in bf16"
    );
    let registration = OperatorOverride::new("aten::mm", DispatchKey::AutocastCpu, |call| {
        Ok(Reply::Ran(vec![call
            .tensor("self")?
            .mm(call.tensor("mat2")?)]))
    })
    .register()
    .unwrap();
    assert_eq!(under_autocast().kind(), Kind::Float);
    assert_eq!(registration.stats().ran, 1);
    drop(registration);
    assert_eq!(under_autocast().kind(), Kind::BFloat16);
}

#[test]
fn a_declined_autocast_call_keeps_autocasts_own_rule() {
    let _serial = serial();
    let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    let _registration = OperatorOverride::new("aten::mm", DispatchKey::AutocastCpu, |_| {
        Ok(Reply::Declined("not this one".into()))
    })
    .register()
    .unwrap();
    let y = speedkit::amp::autocast(Device::Cpu, Kind::BFloat16, || a.mm(&a)).unwrap();
    assert_eq!(y.kind(), Kind::BFloat16);
}

#[test]
fn a_context_lists_its_overrides_in_the_audit_with_reason_and_calls() {
    let _serial = serial();
    let ctx = cpu_context();
    ctx.override_operator(relu_plus_100(), "a test's reason")
        .unwrap();
    let _ = Tensor::from_slice(&[1.0f32]).relu();
    let audit = ctx.audit();
    let record = &audit.operator_overrides[0];
    assert_eq!(
        (record.operator.as_str(), record.key, record.reason.as_str()),
        ("aten::relu", DispatchKey::Cpu, "a test's reason")
    );
    assert_eq!(record.stats.ran, 1);
    let text = audit.to_string();
    assert!(text.contains("aten::relu @ CPU"), "{text}");
    assert!(audit.to_json().contains("\"operator_overrides\""));
}

#[test]
fn a_context_removes_its_overrides_when_it_drops() {
    let _serial = serial();
    let ctx = cpu_context();
    ctx.override_operator(relu_plus_100(), "test").unwrap();
    assert!(registered_here("aten::relu"));
    drop(ctx);
    assert!(!registered_here("aten::relu"));
}

#[test]
fn a_panic_removes_the_overrides_of_the_context_it_unwinds() {
    let _serial = serial();
    let unwound = panic::catch_unwind(AssertUnwindSafe(|| {
        let ctx = cpu_context();
        ctx.override_operator(relu_plus_100(), "test").unwrap();
        assert!(registered_here("aten::relu"));
        panic!("the training loop failed");
    }));
    assert!(unwound.is_err());
    assert!(!registered_here("aten::relu"));
    assert_eq!(values(&Tensor::from_slice(&[-1.0f32]).relu()), [0.0]);
}

#[test]
fn a_registration_that_fails_leaves_the_dispatcher_as_it_was() {
    let _serial = serial();
    // A registration counts as a flag write, so a failing one is injected like any flag's.
    speedkit::flags::inject_write_fault(1);
    let result = relu_plus_100().register();
    speedkit::flags::inject_write_fault(0);
    assert!(result.is_err());
    assert!(!registered_here("aten::relu"));
}
