//! The guide's "Use speedkit in your crate" (docs/guide/your-own-crate.md), followed to the
//! letter: a crate of one's own, outside this workspace, made of exactly the files that section
//! shows (the `file=PATH` code blocks, with `/path/to/speedkit` replaced by this checkout), built
//! against the same libtorch, then run the three ways the section ends with: the binary (an
//! `#[accelerate]` training loop, started directly, without `LD_LIBRARY_PATH`), its workload under
//! the runner, and its workload under `cargo test`.
//!
//! The crate lives in the system temp directory (inside this workspace cargo would take it for an
//! undeclared member) and is rewritten only where the guide changed. It resolves its dependencies
//! offline, from this workspace's `Cargo.lock` and the local registry cache, so to the versions the
//! suite is built with. Its executables go to `<build-dir>/tmp/user-crate`, kept between runs, and
//! its intermediate artifacts to the suite's own build dir (`CARGO_BUILD_BUILD_DIR`: outside the
//! checkout the crate does not see `.cargo/config.toml`), with the suite's profile, so the suite's
//! build of tch, torch-sys (with its C++) and the other registry dependencies serves it as built,
//! and so does the suite's compiled C++ shim (speedkit's build script caches it in the build dir,
//! for any feature set). What it compiles is its own: speedkit's Rust (twice, without and with the
//! `runner` feature that the guide's `[dev-dependencies]` turn on for the bench and the test),
//! the macros and the crate; later runs only what changed.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The guide page and its section the crate is made from.
const GUIDE_PAGE: &str = "docs/guide/your-own-crate.md";
/// The section of the guide page.
const SECTION: &str = "## Use speedkit in your crate";
/// What the guide writes for the checkout's root in paths.
const CHECKOUT_PLACEHOLDER: &str = "/path/to/speedkit";
/// The package name of the guide's crate, and so its binary's name.
const PACKAGE: &str = "my-trainer";
/// The workload its `src/lib.rs` registers.
const WORKLOAD: &str = "classifier_step";

fn checkout() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// libtorch's `lib` directory, as speedkit's build script found it for this package.
fn libtorch_lib() -> &'static Path {
    Path::new(env!("SPEEDKIT_LIBTORCH_LIB"))
}

/// The `file=PATH` code blocks of the guide's section, as (path, content).
fn readme_files() -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(checkout().join(GUIDE_PAGE)).expect(GUIDE_PAGE);
    let start = readme
        .find(SECTION)
        .unwrap_or_else(|| panic!("{GUIDE_PAGE} has no section {SECTION:?}"));
    let section = &readme[start..];
    let section = &section[..section[SECTION.len()..]
        .find("\n## ")
        .map_or(section.len(), |end| end + SECTION.len())];
    let mut files = Vec::new();
    let mut lines = section.lines();
    while let Some(line) = lines.next() {
        let Some(path) = line.strip_prefix("```").and_then(|info| {
            info.split_whitespace()
                .find_map(|w| w.strip_prefix("file="))
        }) else {
            continue;
        };
        let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        files.push((path.to_owned(), body.join("\n") + "\n"));
    }
    files
}

/// The guide's crate, written out and built once for all tests of this file.
struct UserCrate {
    dir: PathBuf,
    target: PathBuf,
    build_dir: PathBuf,
}

fn user_crate() -> &'static UserCrate {
    static CRATE: OnceLock<UserCrate> = OnceLock::new();
    CRATE.get_or_init(|| {
        let user_crate = UserCrate::write();
        let build = user_crate.cargo(&["build", "--offline"]);
        assert_success("cargo build of the guide's crate", &build);
        user_crate
    })
}

impl UserCrate {
    fn write() -> UserCrate {
        let mut hasher = DefaultHasher::new();
        checkout().hash(&mut hasher);
        let dir =
            std::env::temp_dir().join(format!("speedkit-user-crate-{:016x}", hasher.finish()));
        let files = readme_files();
        let names: Vec<&str> = files.iter().map(|(path, _)| path.as_str()).collect();
        for expected in ["Cargo.toml", "build.rs", "src/lib.rs", "src/main.rs"] {
            assert!(
                names.contains(&expected),
                "the guide's crate has no {expected}: {names:?}"
            );
        }
        let root = checkout().to_str().expect("checkout path is UTF-8");
        for (path, content) in &files {
            write_if_changed(
                &dir.join(path),
                &content.replace(CHECKOUT_PLACEHOLDER, root),
            );
        }
        // The workspace's lock file pins every dependency to what this checkout is tested with.
        let lock = std::fs::read_to_string(checkout().join("Cargo.lock")).expect("Cargo.lock");
        write_if_changed(&dir.join("Cargo.lock"), &lock);
        // cargo makes `<build-dir>/tmp` this test's CARGO_TARGET_TMPDIR.
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let build_dir = tmp.parent().expect("CARGO_TARGET_TMPDIR has a parent");
        UserCrate {
            dir,
            target: tmp.join("user-crate"),
            build_dir: build_dir.to_owned(),
        }
    }

    /// Runs cargo in the crate as the guide's user would: `LIBTORCH` names the libtorch this
    /// package was built against, and nothing sets `LD_LIBRARY_PATH`. Two settings are the suite's
    /// rather than the guide's, and only so that the suite's build serves this one: the build dir,
    /// and the dev profile's `debug = "line-tables-only"` (the suite's Cargo.toml; the guide's
    /// profile has the same opt-levels but leaves `debug` at its default, and a dependency built
    /// with other debug info is a build of its own).
    fn cargo(&self, args: &[&str]) -> Output {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let libtorch = libtorch_lib()
            .parent()
            .expect("libtorch lib dir has a parent");
        Command::new(cargo)
            .args(args)
            .current_dir(&self.dir)
            .env("CARGO_TARGET_DIR", &self.target)
            .env("CARGO_BUILD_BUILD_DIR", &self.build_dir)
            .env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only")
            .env("LIBTORCH", libtorch)
            .env_remove("LIBTORCH_USE_PYTORCH")
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .expect("cargo runs")
    }

    fn executable(&self, name: &str) -> PathBuf {
        self.target.join("debug").join(name)
    }
}

fn write_if_changed(path: &Path, content: &str) {
    // Rewriting an unchanged file would make cargo rebuild the crate on every run.
    if std::fs::read_to_string(path).is_ok_and(|old| old == content) {
        return;
    }
    std::fs::create_dir_all(path.parent().expect("file in a directory")).expect("create dir");
    std::fs::write(path, content).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn assert_success(what: &str, output: &Output) {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}",
        output.status,
        text(output)
    );
}

#[test]
fn readme_crate_trains_under_accelerate_and_runs_without_ld_library_path() {
    let user_crate = user_crate();
    let output = Command::new(user_crate.executable(PACKAGE))
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("the guide crate's binary starts");
    assert_success("the guide crate's binary", &output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let losses = stdout
        .lines()
        .find_map(|line| line.strip_prefix("loss "))
        .unwrap_or_else(|| panic!("no `loss A -> B` line in:\n{stdout}"));
    let (first, last) = losses.split_once(" -> ").expect("`A -> B`");
    let first: f64 = first.parse().expect("first loss");
    let last: f64 = last.parse().expect("last loss");
    assert!(
        last < first / 2.0,
        "training did not learn the batch: loss {first} -> {last}"
    );
}

#[test]
fn readme_crate_workload_runs_under_the_runner() {
    let user_crate = user_crate();
    let json = user_crate.target.join("runner.json");
    let json_arg = json.to_str().expect("UTF-8 path");
    // `--profile dev`: the build of the tests, instead of a second, release build of everything.
    let output = user_crate.cargo(&[
        "bench",
        "--offline",
        "--profile",
        "dev",
        "--bench",
        "workloads",
        "--",
        "--size",
        "tiny",
        "--config",
        "fp32_strict",
        "--warmup",
        "1",
        "--steps",
        "3",
        "--json",
        json_arg,
    ]);
    assert_success("cargo bench --bench workloads", &output);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("runner wrote --json"))
            .expect("runner JSON parses");
    let rows = report["rows"].as_array().expect("rows");
    let names: Vec<&str> = rows.iter().filter_map(|r| r["workload"].as_str()).collect();
    assert_eq!(
        names,
        [WORKLOAD],
        "the runner ran other workloads than the guide's"
    );
    let median = rows[0]["measurement"]["median_ms"].as_f64();
    assert!(
        median.is_some_and(|ms| ms.is_finite() && ms > 0.0),
        "no measurement: {}",
        rows[0]
    );
}

#[test]
fn readme_crate_workload_runs_under_cargo_test() {
    let user_crate = user_crate();
    let output = user_crate.cargo(&["test", "--offline", "--test", "workloads"]);
    assert_success("cargo test --test workloads", &output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    for config in ["cpu", "cpu_bf16"] {
        let name = format!("workload::{WORKLOAD}::{config} ");
        assert!(
            stdout
                .lines()
                .any(|line| line.contains(&name) && line.ends_with("... ok")),
            "no passing test {name} in:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("test result: ok. 2 passed"),
        "expected exactly the guide workload's two tests, passing:\n{stdout}"
    );
}
