//! Starting the launcher and ranks as processes of this executable, and reading what they left.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tch::Tensor;

pub fn worker_args() -> [&'static str; 5] {
    [
        "--exact",
        "dist_worker",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]
}

/// This executable's arguments that run its `dist_launcher`.
const LAUNCHER_ARGS: [&str; 5] = [
    "--exact",
    "dist_launcher",
    "--ignored",
    "--nocapture",
    "--test-threads=1",
];

pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("speedkit-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the launcher of two ranks for `scenario`; fails the test instead of hanging if it never
/// ends.
pub fn run_launcher(scenario: &str, out: &Path) -> Output {
    run_launcher_of(scenario, out, None)
}

/// [`run_launcher`] with `ranks` ranks.
pub fn run_launcher_of_ranks(scenario: &str, out: &Path, ranks: usize) -> Output {
    let child = launcher_command(scenario, out)
        .env("SK_TEST_NPROC", ranks.to_string())
        .spawn()
        .unwrap();
    wait_bounded(child, Duration::from_secs(120))
}

/// [`run_launcher`], of `command` instead of this executable's `dist_worker` when given.
pub fn run_launcher_of(scenario: &str, out: &Path, command: Option<&[String]>) -> Output {
    let mut launcher = launcher_command(scenario, out);
    if let Some(command) = command {
        launcher.env("SK_TEST_COMMAND", command.join("\n"));
    }
    wait_bounded(launcher.spawn().unwrap(), Duration::from_secs(120))
}

/// This executable's `dist_launcher` for `scenario`, its output piped.
fn launcher_command(scenario: &str, out: &Path) -> Command {
    let mut launcher = Command::new(std::env::current_exe().unwrap());
    launcher
        .args(LAUNCHER_ARGS)
        .env("SK_TEST_SCENARIO", scenario)
        .env("SK_TEST_OUT", out)
        .env_remove("MASTER_PORT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    launcher
}

/// `nodes` launchers of one rank each, as on `nodes` machines (`speedkit launch --nnodes N
/// --node-rank R --master-port P`), meeting at rank 0's store on the loopback, each with `env` and
/// `node_env(node)` set; their outputs in node order.
pub fn run_node_launchers(
    scenario: &str,
    out: &Path,
    nodes: usize,
    env: &[(&str, &str)],
    node_env: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<Output> {
    let port = free_port();
    let launchers: Vec<Child> = (0..nodes)
        .map(|node| {
            launcher_command(scenario, out)
                .envs(env.iter().copied())
                .envs(node_env(node))
                .env("SK_TEST_NNODES", nodes.to_string())
                .env("SK_TEST_NODE_RANK", node.to_string())
                .env("SK_TEST_MASTER_PORT", port.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    launchers
        .into_iter()
        .map(|child| wait_bounded(child, Duration::from_secs(120)))
        .collect()
}

/// A rank started directly (no launcher) with an explicit environment.
pub fn spawn_rank(scenario: &str, out: &Path, vars: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut command = Command::new(exe);
    command
        .args(worker_args())
        .env("SK_TEST_SCENARIO", scenario)
        .env("SK_TEST_OUT", out)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in vars {
        command.env(k, v);
    }
    command.spawn().unwrap()
}

pub fn rank_env(rank: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", "2".into()),
        ("LOCAL_RANK", rank.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
    ]
}

pub fn free_port() -> u16 {
    speedkit::launcher::free_master_port().unwrap()
}

/// Waits for `child` at most `limit` (a guard against hangs, far above the configured collective
/// timeout; not a speed measurement), killing it and failing the test past that.
pub fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "process still running after {limit:?} (a hang):\n{}\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

pub fn load(path: &Path) -> Vec<(String, Tensor)> {
    let mut named = Tensor::load_multi(path).unwrap();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}
