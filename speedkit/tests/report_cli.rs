//! `speedkit report` as a user runs it: both output formats and its answers to bad input.

use std::process::{Command, Output};

fn speedkit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_speedkit"))
        .args(args)
        .output()
        .expect("run the speedkit binary")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn report_apply_restore_reads_well_for_a_person() {
    let out = speedkit(&["report", "--apply", "--restore"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for section in [
        "== hardware",
        "== resolved settings",
        "== flags",
        "torch.backends.cuda.matmul.allow_tf32",
        "restored",
    ] {
        assert!(
            stdout.contains(section),
            "missing {section:?} in:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("restored: every flag reads back as before"),
        "{stdout}"
    );
}

#[test]
fn a_reason_shared_by_several_flags_is_printed_once() {
    let out = speedkit(&["report", "--apply", "--restore"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let override_rows: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            l.trim_start_matches([' ', '|'])
                .starts_with("speedkit.overrides.")
        })
        .collect();
    let groups = speedkit::overrides::Override::ALL.len();
    assert_eq!(override_rows.len(), groups, "{stdout}");
    let pointers = override_rows
        .iter()
        .filter(|row| row.contains("as for speedkit.overrides.layer_norm"))
        .count();
    assert_eq!(pointers, groups - 1, "{stdout}");
}

#[test]
fn report_json_parses_and_lists_every_flag() {
    let out = speedkit(&["report", "--apply", "--restore", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(
        json["flags"].as_array().map(Vec::len),
        Some(speedkit::flags::Flag::all().len())
    );
    assert_eq!(json["restored_equals_before"], true);
    assert!(json["plan"]["decisions"]
        .as_array()
        .is_some_and(|d| d.iter().all(|x| x["reason"].is_string())));
    assert!(json["hardware"]["libtorch"]
        .as_str()
        .is_some_and(|v| v.starts_with("2.11")));
}

#[test]
fn report_without_apply_is_a_dry_run() {
    let out = speedkit(&["report", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(json["applied"], false);
    assert!(json["flags"][0]["applied"].is_null());
}

#[test]
fn report_rejects_a_config_typo_with_line_column_and_suggestion() {
    let dir = std::env::temp_dir().join(format!("speedkit-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("typo.yaml");
    std::fs::write(&path, "precision: bf16\ncudnn:\n  benchmrk: true\n").unwrap();
    let out = speedkit(&["report", "--config", path.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("cudnn.benchmrk")
            && stderr.contains("line 3")
            && stderr.contains("benchmark"),
        "{stderr}"
    );
}

#[test]
fn report_names_a_missing_config_file() {
    let out = speedkit(&["report", "--config", "/nonexistent/speed.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("/nonexistent/speed.yaml"));
}

#[test]
fn restore_without_apply_is_refused() {
    let out = speedkit(&["report", "--restore"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--apply"));
}

#[test]
fn report_audits_a_model_checkpoint() {
    let dir = std::env::temp_dir().join(format!("speedkit-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.ot");
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _layer = tch::nn::linear(vs.root() / "head", 64, 1001, Default::default());
    vs.save(&path).unwrap();
    let out = speedkit(&["report", "--model", path.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).ok();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("== model") && stdout.contains("1001 is not a multiple of 8"),
        "{stdout}"
    );
}

#[test]
fn report_applies_and_restores_medium_matmul_precision() {
    let dir = std::env::temp_dir().join(format!("speedkit-report-medium-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("medium.yaml");
    std::fs::write(&config, "device: cpu\ntf32_matmul_precision: medium\n").unwrap();
    let config = config.to_string_lossy().into_owned();
    let out = speedkit(&[
        "report",
        "--apply",
        "--restore",
        "--json",
        "--config",
        &config,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(json["restored_equals_before"], true);
    let precision = json["flags"]
        .as_array()
        .and_then(|flags| {
            flags
                .iter()
                .find(|f| f["flag"] == "torch.get_float32_matmul_precision()")
        })
        .expect("the matmul precision row");
    assert_eq!(precision["applied"], "medium", "{precision}");
    std::fs::remove_dir_all(&dir).ok();
}
