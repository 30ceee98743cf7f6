//! The launch environment: a bad one is a clear error, none means a single process.

use std::time::Duration;

use crate::processes::{free_port, rank_env, scratch, spawn_rank, text, wait_bounded};
use speedkit::dist::LaunchEnv;

#[test]
fn rank_beyond_world_size_is_refused_before_anything_starts() {
    let out = scratch("bad-env");
    let mut vars = rank_env(0, free_port());
    vars[0].1 = "2".into();
    let output = wait_bounded(spawn_rank("train", &out, &vars), Duration::from_secs(60));
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(log.contains("RANK is 2 but WORLD_SIZE is 2"), "{log}");
    assert!(log.contains("flags restored"), "{log}");
}

#[test]
fn world_size_without_master_addr_is_a_clear_error() {
    let vars = [("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")];
    let err = LaunchEnv::from_lookup(|k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    })
    .unwrap_err();
    assert!(err.to_string().contains("MASTER_ADDR is not set"), "{err}");
}

#[test]
fn rank_without_world_size_is_a_clear_error() {
    let err = LaunchEnv::from_lookup(|k| (k == "RANK").then(|| "0".to_string())).unwrap_err();
    assert!(
        err.to_string()
            .contains("RANK is set but WORLD_SIZE is not"),
        "{err}"
    );
}

#[test]
fn non_numeric_rank_is_a_clear_error() {
    let vars = [("WORLD_SIZE", "2"), ("RANK", "one")];
    let err = LaunchEnv::from_lookup(|k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    })
    .unwrap_err();
    assert!(err.to_string().contains("RANK is `one`"), "{err}");
}

#[test]
fn no_launch_environment_means_a_single_process() {
    assert_eq!(LaunchEnv::from_lookup(|_| None).unwrap(), None);
}
