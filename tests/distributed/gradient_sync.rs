//! `GradientSync`'s hooks on the parameters live exactly as long as it does.

use std::time::Duration;

use crate::fixture::model;
use crate::processes::free_port;
use speedkit::dist::LaunchEnv;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[test]
fn gradient_sync_hooks_are_removed_when_it_drops() {
    use speedkit::dist::{Backend, GradientSync, ProcessGroup};
    let env = LaunchEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: free_port(),
    };
    let group = ProcessGroup::init(&env, Backend::Gloo, Duration::from_secs(30)).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    let params = vs.trainable_variables();
    let sync = GradientSync::new(&group, &params, 1 << 20, None).unwrap();
    // While it lives, its hooks hold the parameters: a second one is refused.
    let err = GradientSync::new(&group, &params, 1 << 20, None).unwrap_err();
    assert!(
        err.to_string().contains("post-accumulate-grad hook"),
        "{err}"
    );
    drop(sync);
    // Dropped, it leaves none behind: the parameters take a new one, and train without one.
    drop(GradientSync::new(&group, &params, 1 << 20, None).unwrap());
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    net.forward(&x).sum(Kind::Float).backward();
    assert!(params.iter().all(|p| p.grad().defined()));
}
