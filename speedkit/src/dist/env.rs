//! The launch environment: who this process is among the processes of one training run, as
//! torchrun, `speedkit launch` and SLURM-with-torchrun-conventions describe it (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`).

use serde::Serialize;

use crate::error::{Result, SpeedkitError};

/// This process's place in a multi-process run.
///
/// ```
/// use speedkit::dist::LaunchEnv;
/// let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"),
///             ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
/// let env = LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))?
///     .expect("a launch environment");
/// assert_eq!((env.rank, env.world_size, env.local_rank), (1, 2, 1));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LaunchEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the run.
    pub world_size: usize,
    /// Rank on this machine: the CUDA device index this process uses.
    pub local_rank: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
}

impl LaunchEnv {
    /// Reads the process environment; `Ok(None)` when `WORLD_SIZE` is unset (a single process).
    ///
    /// ```
    /// let env = speedkit::dist::LaunchEnv::from_env()?;
    /// println!("{}", env.map_or("single process".to_string(), |e| format!("rank {}", e.rank)));
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// Reads the variables through `var` (the environment, or a table in tests). Every
    /// inconsistency is an error naming the variable and what to set.
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let Some(world_size) = var("WORLD_SIZE") else {
            if var("RANK").is_some() {
                return Err(bad(
                    "RANK is set but WORLD_SIZE is not; set both (or neither)",
                ));
            }
            return Ok(None);
        };
        let world_size: usize = parse("WORLD_SIZE", &world_size)?;
        if world_size == 0 {
            return Err(bad(
                "WORLD_SIZE is 0; it counts the processes, so at least 1",
            ));
        }
        let rank: usize = match var("RANK") {
            Some(r) => parse("RANK", &r)?,
            None if world_size == 1 => 0,
            None => {
                return Err(bad(&format!(
                    "WORLD_SIZE is {world_size} but RANK is not set"
                )))
            }
        };
        if rank >= world_size {
            return Err(bad(&format!(
                "RANK is {rank} but WORLD_SIZE is {world_size}; ranks run from 0 to {}",
                world_size - 1
            )));
        }
        let local_rank = match var("LOCAL_RANK") {
            Some(r) => parse("LOCAL_RANK", &r)?,
            None if world_size == 1 => 0,
            None => {
                return Err(bad(
                    "LOCAL_RANK is not set (the device index of this process on its machine)",
                ))
            }
        };
        let master_addr = match var("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_owned(),
            _ if world_size == 1 => "127.0.0.1".to_owned(),
            _ => {
                return Err(bad(&format!(
                    "WORLD_SIZE is {world_size} but MASTER_ADDR is not set: every rank must know \
                     where rank 0's rendezvous store listens (e.g. MASTER_ADDR=127.0.0.1 on one \
                     machine)"
                )))
            }
        };
        let master_port = match var("MASTER_PORT") {
            Some(p) => match parse::<u16>("MASTER_PORT", &p)? {
                0 => return Err(bad("MASTER_PORT is 0; give the port rank 0 listens on")),
                port => port,
            },
            None if world_size == 1 => 29500,
            None => {
                return Err(bad(&format!(
                    "WORLD_SIZE is {world_size} but MASTER_PORT is not set (e.g. MASTER_PORT=29500)"
                )))
            }
        };
        Ok(Some(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        }))
    }

    /// Rank 0, the process that prints and saves.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| {
        bad(&format!(
            "{name} is `{value}`, which is not a non-negative integer"
        ))
    })
}

fn bad(message: &str) -> SpeedkitError {
    SpeedkitError::Distributed(format!("launch environment: {message}"))
}
