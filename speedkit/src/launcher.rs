//! `speedkit launch`: start one process per device for data-parallel training, as `torchrun` does
//! on one machine. Each rank gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR` and `MASTER_PORT`; each line it prints comes out prefixed with `[rank N]`;
//! SIGINT and SIGTERM are passed on to every rank; when one rank fails, the others are stopped
//! (SIGTERM, then SIGKILL after a grace period) and the launcher exits with the failed rank's
//! status, so a crashed or killed rank never leaves the others waiting on a collective.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{Result, SpeedkitError};

/// What to start, and where the ranks meet.
///
/// ```no_run
/// use speedkit::launcher::{self, LaunchOptions};
/// let options = LaunchOptions::new(2, vec!["./train".into(), "--epochs".into(), "3".into()]);
/// let status = launcher::run(&options)?;   // 0 when every rank succeeded, else the failed rank's
/// std::process::exit(status);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Processes on this machine (one per GPU).
    pub nproc_per_node: usize,
    /// Machines in the run.
    pub nnodes: usize,
    /// This machine's index, `0..nnodes`.
    pub node_rank: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Its port; `None`: `MASTER_PORT` from the environment, else a free port on a single machine.
    pub master_port: Option<u16>,
    /// How long stopped ranks get to exit after SIGTERM before SIGKILL.
    pub grace: Duration,
    /// The program and its arguments.
    pub command: Vec<String>,
}

impl LaunchOptions {
    /// `nproc_per_node` ranks of `command` on this one machine.
    pub fn new(nproc_per_node: usize, command: Vec<String>) -> Self {
        Self {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            grace: Duration::from_secs(10),
            command,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(SpeedkitError::Misuse(format!("speedkit launch: {m}")));
        if self.nproc_per_node == 0 {
            return bad("--nproc-per-node must be at least 1".into());
        }
        if self.nnodes == 0 || self.node_rank >= self.nnodes {
            return bad(format!(
                "--node-rank {} must be below --nnodes {}",
                self.node_rank, self.nnodes
            ));
        }
        if self.command.is_empty() {
            return bad("no command given; put it after `--`".into());
        }
        if self.nnodes > 1 && self.master_port.is_none() && std::env::var("MASTER_PORT").is_err() {
            return bad("several machines need an agreed --master-port (or MASTER_PORT)".into());
        }
        Ok(())
    }
}

// The signal a handler received (0: none yet); the monitor loop passes it on to every rank.
static RECEIVED_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn remember_signal(signal: libc::c_int) {
    RECEIVED_SIGNAL.store(signal, Ordering::SeqCst);
}

fn install_signal_forwarding() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores into an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(
                signal,
                remember_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

/// Runs `options.command` as `nproc_per_node` ranks and waits for them; returns the exit status
/// for the launcher: 0 when every rank exited 0, else the first failed rank's code (128 + the
/// signal for a rank killed by one).
pub fn run(options: &LaunchOptions) -> Result<i32> {
    options.validate()?;
    let port = match options.master_port {
        Some(p) => p,
        None => match std::env::var("MASTER_PORT") {
            Ok(p) => p.trim().parse().map_err(|_| {
                SpeedkitError::Misuse(format!("speedkit launch: MASTER_PORT is `{p}`, not a port"))
            })?,
            Err(_) => free_master_port()?,
        },
    };
    install_signal_forwarding();
    let mut ranks = Vec::with_capacity(options.nproc_per_node);
    for local_rank in 0..options.nproc_per_node {
        match spawn_rank(options, local_rank, port) {
            Ok(child) => ranks.push(child),
            Err(e) => {
                stop_all(&mut ranks, options.grace);
                return Err(e);
            }
        }
    }
    Ok(supervise(&mut ranks, options))
}

/// A port for rank 0's rendezvous store (`MASTER_PORT`) that nothing listens on now, taken below
/// the range the kernel hands out as connections' source ports: what the launcher uses where no
/// port is given. A port from that range (what binding port 0 gives) can be taken before rank 0's
/// store listens on it: a rank that connects first may be given the store's own port as its
/// source and connect to itself, and the store's bind then fails with "address already in use"
/// (seen when launches follow each other on one host).
///
/// ```
/// let port = speedkit::launcher::free_master_port()?;
/// assert_ne!(port, 0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn free_master_port() -> Result<u16> {
    let io = |source| SpeedkitError::Io {
        path: "0.0.0.0".into(),
        source,
    };
    let (first_source_port, _) = source_ports();
    const LOWEST: u32 = 10_000;
    if first_source_port > LOWEST + 1_000 {
        let span = first_source_port - LOWEST;
        let seed = std::process::id()
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
        for attempt in 0..64u32 {
            let port = LOWEST + seed.wrapping_add(attempt.wrapping_mul(7_919)) % span;
            let port = u16::try_from(port).unwrap_or(u16::MAX);
            if TcpListener::bind(("0.0.0.0", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    // No room below the source ports (or all taken): one the OS picks.
    let listener = TcpListener::bind("0.0.0.0:0").map_err(io)?;
    Ok(listener.local_addr().map_err(io)?.port())
}

/// The kernel's range of connections' source ports (Linux's default where it cannot be read).
fn source_ports() -> (u32, u32) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut ends = text.split_whitespace().map(str::parse::<u32>);
            Some((ends.next()?.ok()?, ends.next()?.ok()?))
        })
        .unwrap_or((32_768, 60_999))
}

struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    forwarders: Vec<thread::JoinHandle<()>>,
}

fn spawn_rank(options: &LaunchOptions, local_rank: usize, port: u16) -> Result<Rank> {
    use std::os::unix::process::CommandExt;
    let rank = options.node_rank * options.nproc_per_node + local_rank;
    let world = options.nnodes * options.nproc_per_node;
    let mut command = Command::new(&options.command[0]);
    command
        .args(&options.command[1..])
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", local_rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", options.nproc_per_node.to_string())
        .env("GROUP_RANK", options.node_rank.to_string())
        .env("MASTER_ADDR", &options.master_addr)
        .env("MASTER_PORT", port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Own process group: a terminal's Ctrl-C reaches the launcher only, which passes it on
        // once, instead of every rank receiving it twice.
        .process_group(0);
    let mut child = command.spawn().map_err(|source| SpeedkitError::Io {
        path: options.command[0].clone().into(),
        source,
    })?;
    let mut forwarders = Vec::new();
    if let Some(out) = child.stdout.take() {
        forwarders.push(forward_lines(out, rank, false));
    }
    if let Some(err) = child.stderr.take() {
        forwarders.push(forward_lines(err, rank, true));
    }
    Ok(Rank {
        rank,
        child,
        status: None,
        forwarders,
    })
}

/// Copies `stream` line by line to the launcher's stdout or stderr, each line prefixed with its
/// rank (whole lines under the lock, so ranks never interleave within a line).
fn forward_lines(
    stream: impl Read + Send + 'static,
    rank: usize,
    to_stderr: bool,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_end_matches(['\n', '\r']);
                    // A closed launcher output (e.g. `| head`) must not kill the forwarding.
                    let _ = if to_stderr {
                        writeln!(std::io::stderr().lock(), "[rank {rank}] {text}")
                    } else {
                        writeln!(std::io::stdout().lock(), "[rank {rank}] {text}")
                    };
                }
            }
        }
    })
}

/// Waits for the ranks, passing signals on; on the first failure stops the others.
fn supervise(ranks: &mut [Rank], options: &LaunchOptions) -> i32 {
    let mut failure: Option<(usize, i32)> = None;
    loop {
        let signal = RECEIVED_SIGNAL.swap(0, Ordering::SeqCst);
        if signal != 0 {
            signal_all(ranks, signal);
        }
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.status = Some(status);
                let code = exit_code(status);
                if code != 0 && failure.is_none() {
                    eprintln!(
                        "[launch] rank {} exited with status {code}; stopping the other ranks",
                        r.rank
                    );
                    failure = Some((r.rank, code));
                }
            }
        }
        if failure.is_some() {
            stop_all(ranks, options.grace);
            break;
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    for r in ranks.iter_mut() {
        for f in r.forwarders.drain(..) {
            let _ = f.join();
        }
    }
    failure.map_or(0, |(_, code)| code)
}

fn signal_all(ranks: &[Rank], signal: i32) {
    for r in ranks.iter().filter(|r| r.status.is_none()) {
        // SAFETY: kill(2) on the pid of a child we have not reaped yet.
        unsafe {
            libc::kill(r.child.id() as libc::pid_t, signal);
        }
    }
}

/// SIGTERM to every rank still running, SIGKILL to those still running after `grace`.
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    signal_all(ranks, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.status = Some(status);
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        let _ = r.child.kill();
        r.status = r.child.wait().ok();
    }
}

/// The shell's convention: the exit code, or 128 + the signal that ended the process.
fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_port_is_free_and_below_the_kernels_source_ports() {
        let port = free_master_port().unwrap();
        let (first_source_port, _) = source_ports();
        assert!(
            u32::from(port) < first_source_port,
            "{port} is a source port"
        );
        assert!(
            TcpListener::bind(("0.0.0.0", port)).is_ok(),
            "{port} is taken"
        );
    }
}
