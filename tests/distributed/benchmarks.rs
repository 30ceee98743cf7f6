//! The benchmark runner and the `toy_transformer` example under the launcher: per rank and total.

use std::path::PathBuf;

use crate::processes::{run_launcher, run_launcher_of, scratch, text};
use crate::ranks::{write_bench_configs, write_nccl_bench_config};

#[test]
fn benchmark_runner_under_the_launcher_reports_every_rank_and_the_total() {
    let out = scratch("runner");
    write_bench_configs(&out);
    let output = run_launcher("bench_runner", &out);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", text(&output));
    // One table, from rank 0; the data-parallel table names the world size.
    assert_eq!(
        stdout.matches("speedkit benchmarks — size tiny").count(),
        1,
        "{stdout}"
    );
    assert!(!stdout
        .lines()
        .any(|l| l.starts_with("[rank 1] speedkit benchmarks")));
    assert!(
        stdout.contains("[rank 0] data parallel over 2 ranks (gloo)"),
        "{stdout}"
    );
    assert!(stdout.contains("ranks       2 processes"), "{stdout}");

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["world_size"], 2);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "transformer and linear3 under two configs");
    for row in rows {
        let name = format!("{} / {}", row["workload"], row["config"]);
        assert!(row["error"].is_null(), "{name}: {}", row["error"]);
        let dp = &row["data_parallel"];
        assert_eq!(dp["world_size"], 2, "{name}");
        let medians: Vec<f64> = serde_json::from_value(dp["median_ms_per_rank"].clone()).unwrap();
        assert_eq!(medians.len(), 2, "{name}");
        assert!(
            medians.iter().all(|ms| ms.is_finite() && *ms > 0.0),
            "{name}"
        );
        assert_eq!(
            medians[0],
            row["measurement"]["median_ms"].as_f64().unwrap()
        );
        // Collectives are timed from CUDA kernels: a Gloo row on the CPU has no figure (null).
        for column in ["collectives_ms_per_rank", "exposed_ms_per_rank"] {
            assert_eq!(
                dp[column],
                serde_json::json!([null, null]),
                "{name}: {column}"
            );
        }
        let items = row["measurement"]["items_per_step"][0].as_f64().unwrap();
        let t = &dp["throughput"];
        let per_rank: Vec<f64> = serde_json::from_value(t["per_rank"].clone()).unwrap();
        for (rate, ms) in per_rank.iter().zip(&medians) {
            assert!((rate - items / (ms * 1e-3)).abs() <= 1e-9 * rate, "{name}");
        }
        let total = t["total"].as_f64().unwrap();
        assert!(
            (total - per_rank.iter().sum::<f64>()).abs() <= 1e-9 * total,
            "{name}"
        );
        assert!((t["per_gpu"].as_f64().unwrap() - total / 2.0).abs() <= 1e-9 * total);
        let unit = if row["workload"] == "transformer" {
            "tokens"
        } else {
            "samples"
        };
        assert_eq!(t["unit"], unit, "{name}");
        // The text's data-parallel table gives the same total.
        let line = stdout
            .lines()
            .find(|l| {
                l.contains(&format!("{total:.0} {unit}/s"))
                    && l.split_whitespace().any(|c| row["workload"] == c)
            })
            .unwrap_or_else(|| panic!("{name}: no line with the total {total:.0}\n{stdout}"));
        assert!(line.starts_with("[rank 0]"), "{line}");
    }
}

#[test]
fn nccl_runner_rows_report_each_ranks_collectives_and_their_exposed_part() {
    if tch::Cuda::device_count() < 2 {
        eprintln!(
            "skipped nccl_runner_rows_report_each_ranks_collectives_and_their_exposed_part: needs \
             2 CUDA devices"
        );
        return;
    }
    let out = scratch("runner-nccl");
    write_nccl_bench_config(&out);
    let output = run_launcher("bench_runner", &out);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        stdout.contains("data parallel over 2 ranks (nccl)"),
        "{stdout}"
    );
    assert!(stdout.contains("exposed ms"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "transformer and linear3");
    for row in rows {
        let name = row["workload"].to_string();
        assert!(row["error"].is_null(), "{name}: {}", row["error"]);
        let per_rank = |column: &str| -> Vec<f64> {
            serde_json::from_value(row["data_parallel"][column].clone())
                .unwrap_or_else(|e| panic!("{name}: {column}: {e}"))
        };
        let (collectives, exposed) = (
            per_rank("collectives_ms_per_rank"),
            per_rank("exposed_ms_per_rank"),
        );
        assert_eq!(collectives.len(), 2, "{name}");
        for (c, e) in collectives.iter().zip(&exposed) {
            // Every step all-reduces its gradients; what shows of it is at most all of it.
            assert!(*c > 0.0, "{name}: collectives {collectives:?}");
            assert!(
                *e >= 0.0 && *e <= c + 1e-9,
                "{name}: exposed {exposed:?} of {collectives:?}"
            );
        }
        let mine = &row["measurement"]["communication"];
        assert_eq!(mine["busy_ms"].as_f64(), Some(collectives[0]), "{name}");
    }
}

/// The example binary `name`, built next to this test executable's directory by `cargo test`
/// (which builds every example); `None` when only this test target was built.
fn example_binary(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join(name);
    path.exists().then_some(path)
}

#[test]
fn toy_transformer_under_the_launcher_reports_tokens_per_gpu_and_in_total() {
    let Some(example) = example_binary("toy_transformer") else {
        eprintln!(
            "skipped toy_transformer_under_the_launcher_reports_tokens_per_gpu_and_in_total: the \
             example is not built (`cargo test` builds it; `cargo test --test distributed` alone \
             does not: run `cargo build --example toy_transformer` first)"
        );
        return;
    };
    let out = scratch("toy");
    let [cpu, _] = write_bench_configs(&out);
    let command: Vec<String> = [
        example.to_str().unwrap(),
        "--config",
        cpu.to_str().unwrap(),
        "--size",
        "tiny",
        "--steps",
        "6",
        "--log-every",
        "2",
    ]
    .map(str::to_string)
    .to_vec();
    let output = run_launcher_of("toy", &out, Some(&command));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", text(&output));
    // Rank 0 alone prints the header, the log, the summary and the audit.
    for line in stdout.lines().filter(|l| l.starts_with("[rank ")) {
        assert!(
            line.starts_with("[rank 0]"),
            "a line not from rank 0: {line}\n{stdout}"
        );
    }
    assert_eq!(
        stdout.matches("toy transformer (tiny size)").count(),
        1,
        "{stdout}"
    );
    assert!(
        stdout.contains("data parallel: rank 0 of 2 over gloo"),
        "{stdout}"
    );
    let summary = stdout
        .lines()
        .find(|l| l.contains("[rank 0] data parallel: ") && l.contains("in total over 2 ranks"))
        .unwrap_or_else(|| panic!("no data-parallel summary\n{stdout}"));
    let number = |before: &str| -> f64 {
        let head = &summary[..summary.find(before).unwrap()];
        head.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let (total, per_gpu) = (number(" tokens/s in total"), number(" tokens/s per GPU"));
    assert!(
        total > 0.0 && (per_gpu - total / 2.0).abs() <= 1.0,
        "{summary}"
    );
}

#[test]
fn the_single_process_pytorch_peer_is_refused_under_the_launcher_with_its_replacement() {
    let out = scratch("runner-peer");
    write_bench_configs(&out);
    let output = run_launcher("bench_runner_peer", &out);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(
        log.contains("--peer pytorch times single-process PyTorch, not a data-parallel run"),
        "{log}"
    );
    assert!(log.contains("pytorch_reference.py --ddp"), "{log}");
    assert!(
        !out.join("report.json").exists(),
        "nothing is measured or written"
    );
}
