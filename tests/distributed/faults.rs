//! A killed rank, different configs and a drifted replica end every rank with a clear error.

use std::io::{BufRead, BufReader};
use std::process::Output;
use std::time::Duration;

use crate::processes::{free_port, rank_env, scratch, spawn_rank, text, wait_bounded};

/// Two ranks of `scenario`; rank 1 killed (SIGKILL) once it printed `step {step} done`; rank 0's
/// output (bounded by `limit`, against a hang) and the seconds from the kill to its exit.
fn kill_rank_one_after(scenario: &str, step: usize, limit: Duration) -> (Output, f64) {
    let out = scratch(scenario);
    let port = free_port();
    let rank0 = spawn_rank(scenario, &out, &rank_env(0, port));
    let mut rank1 = spawn_rank(scenario, &out, &rank_env(1, port));
    let done = format!("step {step} done");
    let lines = BufReader::new(rank1.stdout.take().unwrap());
    for line in lines.lines() {
        if line.unwrap().contains(&done) {
            break;
        }
    }
    let killed_at = std::time::Instant::now();
    rank1.kill().unwrap();
    let _ = rank1.wait();
    let output = wait_bounded(rank0, limit);
    (output, killed_at.elapsed().as_secs_f64())
}

#[test]
fn a_killed_rank_makes_the_other_fail_with_an_error_naming_it() {
    // Rank 1 killed once training is under way.
    let (output, _) = kill_rank_one_after("train_until_killed", 3, Duration::from_secs(90));
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(log.contains("error: distributed:"), "{log}");
    assert!(log.contains("rank 0 of 2"), "{log}");
    assert!(
        log.contains("rank(s) [1] lost: no heartbeat in the rendezvous store"),
        "{log}"
    );
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

#[test]
fn a_rank_killed_while_the_step_is_replayed_is_named_by_the_other_which_exits() {
    if crate::training::nccl_ranks() < 2 {
        eprintln!(
            "skipped a_rank_killed_while_the_step_is_replayed_is_named_by_the_other_which_exits: \
             needs two CUDA devices (NCCL)"
        );
        return;
    }
    // Steps 0-2 warm up, 3 is captured: from step 5 on, both ranks replay the graph. The
    // configured timeout is 10 s; the bound is only against a hang.
    let (output, seconds) = kill_rank_one_after("nccl_until_killed", 5, Duration::from_secs(120));
    let log = text(&output);
    println!("rank 0 exited {seconds:.1} s after rank 1 was killed");
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(log.contains("rank 0 of 2"), "{log}");
    assert!(log.contains("within the 10 s timeout"), "{log}");
    assert!(
        log.contains("rank(s) [1] lost: no heartbeat in the rendezvous store"),
        "{log}"
    );
}
