//! Deferred tensors (`speedkit::deferred`): sizes, type and device from the start, memory and
//! values at the first operator that reads them (or a view of them), written once, never written
//! where they die unread; the operator observer lives exactly while one is pending. On the CPU, in
//! CI; the GPU use (the log_softmax override's log-probabilities) is tested in gpu_overrides.rs.
//! Every test holds the serial lock: the count of pending tensors is the process's.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use speedkit::deferred;
use tch::{Device, Kind, Tensor};

fn cpu() -> (Kind, Device) {
    (Kind::Float, Device::Cpu)
}

/// A deferred [2, 3] tensor holding 0..6 once written, exempting `exempt`; the writer's count of
/// runs.
fn counted(exempt: &[&str]) -> (Tensor, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&runs);
    let t = deferred::tensor(&[2, 3], Kind::Float, Device::Cpu, exempt, move |t| {
        seen.fetch_add(1, Ordering::SeqCst);
        t.shallow_clone()
            .f_copy_(&Tensor::arange(6, cpu()).view([2, 3]))?;
        Ok(())
    })
    .unwrap();
    (t, runs)
}

#[test]
fn a_deferred_tensor_has_its_shape_type_and_device_before_any_memory() {
    let _serial = common::serial();
    let (t, runs) = counted(&[]);
    assert_eq!(
        (t.size(), t.kind(), t.device()),
        (vec![2, 3], Kind::Float, Device::Cpu)
    );
    assert!(t.is_contiguous());
    assert!(deferred::is_pending(&t).unwrap());
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[test]
fn the_first_operator_that_reads_it_writes_it_once() {
    let _serial = common::serial();
    let (t, runs) = counted(&[]);
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 15.0);
    assert_eq!(t.max().double_value(&[]), 5.0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(!deferred::is_pending(&t).unwrap());
}

#[test]
fn a_view_is_pending_with_it_and_its_read_writes_the_whole_tensor() {
    let _serial = common::serial();
    let (t, runs) = counted(&["aten::view"]);
    let row = t.view([6]);
    assert!(deferred::is_pending(&row).unwrap());
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the exempt view read nothing"
    );
    assert_eq!(row.narrow(0, 3, 3).sum(Kind::Float).double_value(&[]), 12.0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(!deferred::is_pending(&t).unwrap());
    assert!(t.equal(&Tensor::arange(6, cpu()).view([2, 3])));
}

#[test]
fn every_exempt_operator_passes_it_unread_and_the_first_other_writes_it() {
    let _serial = common::serial();
    let other = Tensor::zeros([2, 3], cpu());
    let (t, runs) = counted(&["aten::is_same_size", "aten::is_set_to"]);
    assert!(t.is_same_size(&other) && !t.is_set_to(&other));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the exempt operators read nothing"
    );
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 15.0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Without the exemption the same call writes it.
    let (u, runs) = counted(&[]);
    assert!(u.is_same_size(&other));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn operators_that_only_make_views_leave_it_pending() {
    let _serial = common::serial();
    let (t, runs) = counted(&[]);
    let viewed = t.permute([1, 0]).unsqueeze(0).narrow(2, 1, 1).detach();
    assert!(deferred::is_pending(&viewed).unwrap());
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(viewed.sum(Kind::Float).double_value(&[]), 12.0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn a_composite_operator_reads_nothing_itself_and_the_operators_it_calls_are_observed() {
    let _serial = common::serial();
    // `movedim` runs no kernel: it calls `permute`, which makes a view.
    let (t, runs) = counted(&[]);
    let moved = t.movedim([0], [1]);
    assert!(deferred::is_pending(&t).unwrap());
    // `linear` runs none either; the matrix product it calls reads the tensor, and writes it.
    let w = Tensor::ones([4, 2], cpu());
    let y = moved.linear::<Tensor>(&w, None);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(y.sum(Kind::Float).double_value(&[]), 4.0 * 15.0);
}

#[test]
fn an_exempt_operator_name_with_a_comma_is_refused() {
    let _serial = common::serial();
    let refused = deferred::tensor(
        &[2],
        Kind::Float,
        Device::Cpu,
        &["aten::view,aten::t"],
        |_| Ok(()),
    );
    assert!(refused.unwrap_err().to_string().contains("comma"));
    assert_eq!(deferred::pending().unwrap(), (0, false));
}

#[test]
fn a_tag_names_a_pending_tensor_and_its_views_until_it_is_written() {
    let _serial = common::serial();
    let t = deferred::tagged(&[2, 3], Kind::Float, Device::Cpu, &["aten::view"], 7, |t| {
        let _ = t.shallow_clone().f_fill_(1.0)?;
        Ok(())
    })
    .unwrap();
    let row = t.view([6]);
    assert_eq!(deferred::tag(&t).unwrap(), Some(7));
    assert_eq!(deferred::tag(&row).unwrap(), Some(7));
    assert_eq!(row.sum(Kind::Float).double_value(&[]), 6.0);
    assert_eq!(deferred::tag(&t).unwrap(), None);
    assert_eq!(deferred::tag(&Tensor::ones([2], cpu())).unwrap(), None);
}

#[test]
fn a_read_on_another_thread_writes_it() {
    let _serial = common::serial();
    let (t, runs) = counted(&[]);
    let total = std::thread::spawn(move || t.sum(Kind::Float).double_value(&[]))
        .join()
        .unwrap();
    assert_eq!(total, 15.0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn a_tensor_that_dies_unread_is_never_written_and_its_writer_is_freed() {
    let _serial = common::serial();
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let freed = Arc::new(AtomicBool::new(false));
    let flag = Flag(Arc::clone(&freed));
    let written = Arc::new(AtomicBool::new(false));
    let wrote = Arc::clone(&written);
    let t = deferred::tensor(&[1 << 20], Kind::Float, Device::Cpu, &[], move |_| {
        let _keep = &flag;
        wrote.store(true, Ordering::SeqCst);
        Ok(())
    })
    .unwrap();
    drop(t);
    assert!(freed.load(Ordering::SeqCst));
    assert!(!written.load(Ordering::SeqCst));
}

#[test]
fn the_operator_observer_lives_exactly_while_a_tensor_is_pending() {
    let _serial = common::serial();
    let (before, _) = deferred::pending().unwrap();
    let (t, _) = counted(&[]);
    let (during, observing) = deferred::pending().unwrap();
    assert_eq!(during, before + 1);
    assert!(observing);
    let _ = t.sum(Kind::Float);
    assert_eq!(deferred::pending().unwrap().0, before);
    let (u, _) = counted(&[]);
    drop(u);
    assert_eq!(deferred::pending().unwrap().0, before);
    if before == 0 {
        assert_eq!(deferred::pending().unwrap(), (0, false));
    }
}

#[test]
fn a_writer_that_fails_leaves_nan_for_the_reader() {
    let _serial = common::serial();
    let t = deferred::tensor(&[4], Kind::Float, Device::Cpu, &[], |_| {
        Err(speedkit::SpeedkitError::Misuse("no values today".into()))
    })
    .unwrap();
    assert!(t.sum(Kind::Float).double_value(&[]).is_nan());
}

#[test]
fn materialize_writes_it_for_a_raw_read_and_only_once() {
    let _serial = common::serial();
    let (t, runs) = counted(&[]);
    assert!(deferred::materialize(&t).unwrap());
    assert!(!deferred::materialize(&t).unwrap());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let values = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, 6) };
    assert_eq!(values, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
}

/// A deferred [3] tensor of twice `x`'s values at its write, declared computed from `x`.
fn doubled(x: &Tensor) -> Tensor {
    let source = x.shallow_clone();
    let t = deferred::tensor(&[3], Kind::Float, Device::Cpu, &[], move |t| {
        t.shallow_clone().f_copy_(&(&source * 2.0))?;
        Ok(())
    })
    .unwrap();
    deferred::computed_from(&t, &[x]).unwrap();
    t
}

#[test]
fn an_in_place_write_to_a_source_writes_it_first_from_the_values_before() {
    let _serial = common::serial();
    let x = Tensor::ones([3], cpu());
    let t = doubled(&x);
    let _ = x.shallow_clone().g_add_scalar_(4.0);
    assert!(!deferred::is_pending(&t).unwrap());
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 6.0);
}

#[test]
fn an_out_argument_that_is_a_source_writes_it_first() {
    let _serial = common::serial();
    let x = Tensor::ones([3], cpu());
    let t = doubled(&x);
    let _ = Tensor::ones([3], cpu()).mul_out(&x, &Tensor::full([3], 3.0, cpu()));
    assert_eq!(x.sum(Kind::Float).double_value(&[]), 9.0);
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 6.0);
}

#[test]
fn a_write_to_a_view_of_a_source_writes_it_first() {
    let _serial = common::serial();
    let x = Tensor::ones([3], cpu());
    let t = doubled(&x);
    let _ = x.narrow(0, 0, 1).fill_(10.0);
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 6.0);
}

#[test]
fn a_write_to_other_memory_leaves_it_pending() {
    let _serial = common::serial();
    let x = Tensor::ones([3], cpu());
    let t = doubled(&x);
    let _ = Tensor::ones([3], cpu()).g_add_scalar_(1.0);
    assert!(deferred::is_pending(&t).unwrap());
    assert_eq!(t.sum(Kind::Float).double_value(&[]), 6.0);
}

#[test]
fn sources_are_declared_once_and_only_for_a_pending_tensor() {
    let _serial = common::serial();
    let x = Tensor::ones([3], cpu());
    let t = doubled(&x);
    assert!(deferred::computed_from(&t, &[&x]).is_err());
    let _ = t.sum(Kind::Float);
    assert!(deferred::computed_from(&t, &[&x]).is_err());
}

#[test]
fn a_deferred_tensor_computed_from_a_pending_one_frees_both_when_it_dies() {
    let _serial = common::serial();
    let before = deferred::pending().unwrap().0;
    let (inner, runs) = counted(&[]);
    let source = inner.shallow_clone();
    let outer = deferred::tensor(&[2, 3], Kind::Float, Device::Cpu, &[], move |t| {
        t.shallow_clone().f_copy_(&source)?;
        Ok(())
    })
    .unwrap();
    deferred::computed_from(&outer, &[&inner]).unwrap();
    drop(inner);
    // The outer tensor's release drops the last hold on the inner one, pending still.
    drop(outer);
    assert_eq!(deferred::pending().unwrap().0, before);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[test]
fn a_pending_source_written_at_its_read_leaves_its_dependents_its_values() {
    let _serial = common::serial();
    let (inner, _) = counted(&[]);
    let source = inner.shallow_clone();
    let outer = deferred::tensor(&[2, 3], Kind::Float, Device::Cpu, &[], move |t| {
        t.shallow_clone().f_copy_(&(&source * 2.0))?;
        Ok(())
    })
    .unwrap();
    deferred::computed_from(&outer, &[&inner]).unwrap();
    // The inner tensor's writer writes it in place: that is its value, not a change of it.
    assert_eq!(inner.sum(Kind::Float).double_value(&[]), 15.0);
    assert!(deferred::is_pending(&outer).unwrap());
    assert_eq!(outer.sum(Kind::Float).double_value(&[]), 30.0);
}
