//! The launcher's output (prefixed lines, rank 0's audit) and its exit when a rank fails.

use crate::processes::{run_launcher, scratch, text};

#[test]
fn launcher_prefixes_lines_and_rank_zero_alone_prints_the_audit() {
    let out = scratch("prefix");
    let output = run_launcher("train", &out);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        stdout.contains("[rank 0] ") && stdout.contains("data parallel: rank 0 of 2 over gloo")
    );
    assert!(!stdout.contains("data parallel: rank 1 of 2"), "{stdout}");
    let step_lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("step 0 done"))
        .collect();
    assert_eq!(step_lines.len(), 2, "{stdout}");
    assert!(
        step_lines.iter().all(|l| l.starts_with("[rank ")),
        "{stdout}"
    );
}

#[test]
fn launcher_stops_all_ranks_and_exits_with_the_failed_ranks_status() {
    let out = scratch("fail");
    let output = run_launcher("fail_before_joining", &out);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(3), "{log}");
    assert!(
        log.contains("[launch] rank 1 exited with status 3; stopping the other ranks"),
        "{log}"
    );
}
