//! Inputs that must be rejected, and what the errors say.

use speedkit_config::{ConfigError, Format, Location, SpeedConfig};

fn yaml_err(text: &str) -> ConfigError {
    match SpeedConfig::from_yaml_str(text) {
        Ok(cfg) => panic!("{text:?} was accepted as {cfg:?}"),
        Err(err) => err,
    }
}

fn json_err(text: &str) -> ConfigError {
    match SpeedConfig::from_json_str(text) {
        Ok(cfg) => panic!("{text:?} was accepted as {cfg:?}"),
        Err(err) => err,
    }
}

const TOP_LEVEL_KEYS: &str = "device, precision, tf32_matmul_precision, \
    reduced_precision_reduction, channels_last, deterministic, cudnn, compile, optimizer, \
    sdp_backend, grad_scaler, fp8, kernels, overrides, bench, profile, distributed";

#[test]
fn top_level_typo_names_key_place_and_suggestion() {
    let err = yaml_err("device: cpu\nprecison: bf16\n");
    assert_eq!(
        err.to_string(),
        format!(
            "unknown key `precison` at line 2, column 1; did you mean `precision`? \
             (valid keys here: {TOP_LEVEL_KEYS})"
        )
    );
}

#[test]
fn nested_typo_names_dotted_path_place_and_suggestion() {
    let err = yaml_err("device: auto\nprecision: auto\ncudnn:\n  benchmrk: true\n");
    assert_eq!(
        err.to_string(),
        "unknown key `cudnn.benchmrk` at line 4, column 3; did you mean `benchmark`? \
         (valid keys here: enabled, benchmark, allow_tf32, deterministic)"
    );
}

#[test]
fn unknown_key_carries_its_data() {
    let err = yaml_err("sdp_backend:\n    mth: false\n");
    let ConfigError::UnknownKey {
        key,
        path,
        location,
        suggestion,
        expected,
    } = err
    else {
        panic!("not UnknownKey: {err:?}");
    };
    assert_eq!(key, "mth");
    assert_eq!(path, "sdp_backend.mth");
    assert_eq!(location, Some(Location { line: 2, column: 5 }));
    assert_eq!(suggestion.as_deref(), Some("math"));
    assert_eq!(expected, ["flash", "mem_efficient", "math", "cudnn"]);
}

#[test]
fn unrelated_unknown_key_gets_no_suggestion() {
    let err = yaml_err("learning_rate: 0.001\n");
    assert!(
        matches!(
            &err,
            ConfigError::UnknownKey {
                suggestion: None,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn bad_enum_value_lists_allowed_values() {
    let err = yaml_err("device: auto\nprecision: bf61\n");
    assert_eq!(
        err.to_string(),
        "bad value `bf61` for `precision` at line 2, column 12; \
         expected one of: auto, bf16, fp16, fp32; did you mean `bf16`?"
    );
}

#[test]
fn bad_value_carries_its_data() {
    let err = yaml_err("compile:\n  enabled: maybe\n");
    let ConfigError::BadValue {
        path,
        value,
        expected,
        location,
        ..
    } = err
    else {
        panic!("not BadValue: {err:?}");
    };
    assert_eq!(
        (path.as_str(), value.as_str()),
        ("compile.enabled", "maybe")
    );
    assert_eq!(expected, ["auto", "true", "false"]);
    assert_eq!(
        location,
        Some(Location {
            line: 2,
            column: 12
        })
    );
}

#[test]
fn bad_device_lists_the_forms() {
    let err = yaml_err("device: gpu:0\n");
    assert!(
        err.to_string()
            .contains("expected one of: auto, cpu, cuda, cuda:N"),
        "{err}"
    );
}

#[test]
fn bad_nested_enum_value_names_dotted_path() {
    let err = yaml_err("optimizer:\n  name: adam\n");
    assert!(
        matches!(&err, ConfigError::BadValue { path, .. } if path == "optimizer.name"),
        "{err:?}"
    );
}

#[test]
fn wrong_type_names_what_was_found_and_expected() {
    let err = yaml_err("cudnn:\n  enabled: yes\n");
    assert_eq!(
        err.to_string(),
        "wrong type for `cudnn.enabled` at line 2, column 12: found string \"yes\", \
         expected a boolean (true or false)"
    );
}

#[test]
fn quoted_boolean_for_auto_switch_is_wrong_type() {
    let err = yaml_err("channels_last: \"true\"\n");
    assert!(
        matches!(&err, ConfigError::WrongType { path, .. } if path == "channels_last"),
        "{err:?}"
    );
}

#[test]
fn text_for_number_is_wrong_type() {
    let err = yaml_err("bench:\n  steps: many\n");
    assert!(
        matches!(&err, ConfigError::WrongType { path, .. } if path == "bench.steps"),
        "{err:?}"
    );
}

#[test]
fn number_too_large_for_u32_is_bad_value() {
    let err = yaml_err("bench:\n  steps: 99999999999\n");
    assert!(
        matches!(&err, ConfigError::BadValue { path, value, .. }
            if path == "bench.steps" && value == "99999999999"),
        "{err:?}"
    );
}

#[test]
fn list_for_section_is_wrong_type() {
    let err = json_err(r#"{"sdp_backend": [true, true, true, true]}"#);
    assert!(
        matches!(&err, ConfigError::WrongType { path, .. } if path == "sdp_backend"),
        "{err:?}"
    );
}

#[test]
fn top_level_list_is_wrong_type() {
    let err = yaml_err("- precision: bf16\n");
    assert!(
        matches!(&err, ConfigError::WrongType { path, .. } if path.is_empty()),
        "{err:?}"
    );
}

#[test]
fn malformed_yaml_is_syntax_error_with_location() {
    let err = yaml_err("cudnn:\n  benchmark: true\n deterministic: true\n");
    assert!(
        matches!(
            &err,
            ConfigError::Syntax {
                format: Format::Yaml,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.location(), Some(Location { line: 3, column: 2 }));
}

#[test]
fn malformed_yaml_message_leads_with_format_and_place() {
    let err = yaml_err("device: \"cpu\nprecision: bf16\n");
    assert!(
        err.to_string().starts_with("malformed YAML at line "),
        "{err}"
    );
}

#[test]
fn malformed_json_is_syntax_error_with_location() {
    let err = json_err("{\n  \"precision\": \"bf16\",\n}");
    assert!(
        matches!(
            &err,
            ConfigError::Syntax {
                format: Format::Json,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.location(), Some(Location { line: 3, column: 1 }));
}

#[test]
fn trailing_json_text_is_syntax_error() {
    let err = json_err("{} {}");
    assert!(
        matches!(
            &err,
            ConfigError::Syntax {
                format: Format::Json,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn empty_json_is_syntax_error() {
    assert!(matches!(json_err(""), ConfigError::Syntax { .. }));
}

#[test]
fn json_typo_names_dotted_path_and_line() {
    let err = json_err("{\n  \"cudnn\": {\"benchmrk\": true}\n}");
    assert!(
        matches!(&err, ConfigError::UnknownKey { path, suggestion: Some(s), .. }
            if path == "cudnn.benchmrk" && s == "benchmark"),
        "{err:?}"
    );
    assert_eq!(err.location().map(|l| l.line), Some(2));
}

#[test]
fn json_bad_value_lists_allowed_values() {
    let err = json_err(r#"{"tf32_matmul_precision": "low"}"#);
    let ConfigError::BadValue { expected, .. } = &err else {
        panic!("not BadValue: {err:?}");
    };
    assert_eq!(expected, &["auto", "highest", "high", "medium"]);
}

#[test]
fn duplicate_key_is_rejected() {
    let err = yaml_err("precision: bf16\nprecision: fp16\n");
    assert!(
        err.to_string().contains("duplicate key `precision`"),
        "{err}"
    );
}

#[test]
fn missing_yaml_file_error_names_the_path() {
    let err = SpeedConfig::from_yaml("/nonexistent/speedkit/speed.yaml").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cannot read speed config `/nonexistent/speedkit/speed.yaml`: "),
        "{err}"
    );
}

#[test]
fn missing_json_file_is_io_not_found() {
    let err = SpeedConfig::from_json("/nonexistent/speedkit/speed.json").unwrap_err();
    assert!(
        matches!(&err, ConfigError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{err:?}"
    );
}

#[test]
fn validation_errors_have_no_location() {
    let err = yaml_err("bench:\n  steps: 0\n");
    assert_eq!(err.location(), None);
}

#[test]
fn unknown_preset_suggests_closest_and_lists_all() {
    let err = SpeedConfig::preset("fp32strict").unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown preset `fp32strict`; did you mean `fp32_strict`? (presets: fp32_strict, tf32, auto, auto_fp8, fp8)"
    );
}

#[test]
fn odd_inputs_are_errors_or_defaults_never_panics() {
    let deep_list = "[".repeat(10_000);
    let deep_map = "a: {".repeat(2_000);
    let odd = [
        "-",
        "- - -",
        "42",
        "\"just a string\"",
        "a: {b: {c: [1, {d: e}]}}",
        "? [a, b]\n: c",
        "&x a: *x",
        "x: *undefined",
        "---\nprecision: bf16\n---\nprecision: fp16",
        "\t\tprecision: bf16",
        "precision: !!binary AAAA",
        "{{{{{{{{{{}}}}",
        "cudnn: {benchmark: [true]}",
        "grad_scaler: {init_scale: .inf}",
        deep_list.as_str(),
        deep_map.as_str(),
    ];
    for text in odd {
        let _ = SpeedConfig::from_yaml_str(text)
            .map(|_| ())
            .map_err(|e| e.to_string());
        let _ = SpeedConfig::from_json_str(text)
            .map(|_| ())
            .map_err(|e| e.to_string());
    }
}

#[test]
fn list_for_enum_value_lists_allowed_values() {
    let err = yaml_err("precision: [bf16]\n");
    assert_eq!(
        err.to_string(),
        "wrong type for `precision` at line 1, column 12: found sequence, \
         expected one of `auto`, `bf16`, `fp16`, `fp32`"
    );
}

#[test]
fn duplicate_key_is_reported_at_the_duplicate() {
    let err = yaml_err("device: cpu\nprecision: bf16\nprecision: fp16\n");
    assert_eq!(
        err.to_string(),
        "malformed YAML at line 3, column 1: duplicate key `precision`: each key may appear only \
         once"
    );
}

#[test]
fn duplicate_nested_key_is_reported_at_the_duplicate() {
    let err = yaml_err("cudnn:\n  enabled: true\n  benchmark: true\n  enabled: false\n");
    assert_eq!(err.location(), Some(Location { line: 4, column: 3 }));
}

#[test]
fn json_duplicate_key_is_reported_on_its_line() {
    let err =
        json_err("{\"device\": \"cpu\",\n \"precision\": \"bf16\",\n \"precision\": \"fp16\"}");
    assert_eq!(err.location().map(|l| l.line), Some(3));
}

/// Ten million characters, as when a whole file ends up in one value.
fn huge() -> String {
    "x".repeat(10_000_000)
}

#[test]
fn huge_value_is_shown_cut_short_with_its_length() {
    let err = yaml_err(&format!("precision: {}\n", huge()));
    assert_eq!(
        err.to_string(),
        format!(
            "bad value `{}… (10000000 characters)` for `precision` at line 1, column 12; expected \
             one of: auto, bf16, fp16, fp32",
            "x".repeat(60)
        )
    );
}

#[test]
fn huge_key_is_shown_cut_short_with_its_length() {
    let err = json_err(&format!("{{\"{}\": 1}}", huge()));
    let ConfigError::UnknownKey { key, path, .. } = &err else {
        panic!("not UnknownKey: {err:?}");
    };
    let shown = format!("{}… (10000000 characters)", "x".repeat(60));
    assert_eq!((key, path), (&shown, &shown));
}

#[test]
fn huge_string_of_wrong_type_is_shown_cut_short() {
    let err = yaml_err(&format!("deterministic: \"{}\"\n", huge()));
    let ConfigError::WrongType { found, .. } = &err else {
        panic!("not WrongType: {err:?}");
    };
    assert_eq!(
        found,
        &format!("string \"{}… (10000000 characters)\"", "x".repeat(60))
    );
}

#[test]
fn value_of_sixty_characters_is_shown_whole() {
    let value = "y".repeat(60);
    let err = yaml_err(&format!("precision: {value}\n"));
    assert!(
        matches!(&err, ConfigError::BadValue { value: shown, .. } if *shown == value),
        "{err:?}"
    );
}

#[test]
fn nesting_past_the_limit_is_refused_with_the_limit_and_place() {
    let err = yaml_err(&format!("bench: {}", "a: {".repeat(100_000)));
    assert_eq!(
        err.to_string(),
        "YAML nested too deeply at line 1, column 139: more than 32 levels of brackets, while a \
         speed config needs two (a section and its keys)"
    );
    assert!(matches!(
        err,
        ConfigError::TooDeep {
            format: Format::Yaml,
            limit: 32,
            ..
        }
    ));
}

#[test]
fn json_nesting_past_the_limit_is_refused_at_its_line() {
    let err = json_err(&format!("{{\n\"bench\":\n{}", "[".repeat(100_000)));
    assert_eq!(
        err.location(),
        Some(Location {
            line: 3,
            column: 32
        })
    );
}

#[test]
fn nesting_at_the_limit_gets_the_usual_errors() {
    let text = format!("{}{}", "[".repeat(32), "]".repeat(32));
    assert!(
        matches!(yaml_err(&text), ConfigError::WrongType { .. }),
        "{text}"
    );
}

#[test]
fn brackets_in_comments_do_not_count_towards_the_limit() {
    let text = format!(
        "# {}\nprecision: bf16 # {}\n",
        "[".repeat(40),
        "{".repeat(40)
    );
    assert!(SpeedConfig::from_yaml_str(&text).is_ok());
}

#[test]
fn brackets_in_quoted_values_do_not_count_towards_the_limit() {
    let err = yaml_err(&format!("precision: '{}'\n", "[".repeat(40)));
    assert!(matches!(err, ConfigError::BadValue { .. }), "{err:?}");
}

#[test]
fn distributed_timeout_of_zero_is_refused_with_its_key() {
    let err = yaml_err("distributed: {timeout_s: 0}\n");
    assert!(err.to_string().contains("distributed.timeout_s"), "{err}");
}

#[test]
fn distributed_backend_typo_lists_the_backends() {
    let err = yaml_err("distributed: {backend: ncll}\n");
    assert!(err.to_string().contains("nccl"), "{err}");
}
