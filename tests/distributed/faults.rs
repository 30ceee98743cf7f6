//! A killed rank, different configs and a drifted replica end every rank with a clear error.

use std::io::{BufRead, BufReader};
use std::time::Duration;

use crate::processes::{free_port, rank_env, scratch, spawn_rank, text, wait_bounded};

#[test]
fn killed_rank_makes_the_other_fail_with_a_clear_error() {
    let out = scratch("killed");
    let port = free_port();
    let rank0 = spawn_rank("train_until_killed", &out, &rank_env(0, port));
    let mut rank1 = spawn_rank("train_until_killed", &out, &rank_env(1, port));
    // Kill rank 1 once training is under way.
    let lines = BufReader::new(rank1.stdout.take().unwrap());
    for line in lines.lines() {
        if line.unwrap().starts_with("step 3 done") {
            break;
        }
    }
    rank1.kill().unwrap();
    let _ = rank1.wait();
    let output = wait_bounded(rank0, Duration::from_secs(90));
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(log.contains("error: distributed:"), "{log}");
    assert!(log.contains("rank 0 of 2"), "{log}");
    assert!(log.contains("flags restored"), "{log}");
}

#[test]
fn ranks_with_different_configs_are_refused_on_every_rank() {
    let out = scratch("mismatch");
    let port = free_port();
    let ranks = [0, 1].map(|r| spawn_rank("mismatched_config", &out, &rank_env(r, port)));
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = wait_bounded(child, Duration::from_secs(90));
        let log = text(&output);
        assert_eq!(output.status.code(), Some(1), "rank {rank}: {log}");
        assert!(
            log.contains("rank(s) [1] run a different speed config than rank 0"),
            "{log}"
        );
        assert!(log.contains("flags restored"), "{log}");
    }
}

#[test]
fn a_replica_edited_outside_the_step_is_named_on_every_rank() {
    let out = scratch("drift");
    let port = free_port();
    let ranks = [0, 1].map(|r| spawn_rank("drift", &out, &rank_env(r, port)));
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = wait_bounded(child, Duration::from_secs(90));
        let log = text(&output);
        assert_eq!(output.status.code(), Some(1), "rank {rank}: {log}");
        assert!(log.contains("step 2 done"), "rank {rank}: {log}");
        assert!(
            log.contains(
                "replicas diverged after 4 optimizer step(s): rank(s) [1] hold other parameter \
                 values than rank 0 (rank 1: 1 of 4 tensors, first `l2.bias`"
            ),
            "rank {rank}: {log}"
        );
        assert!(log.contains("flags restored"), "rank {rank}: {log}");
    }
}
