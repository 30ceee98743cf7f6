//! The `speedkit` command: `speedkit report [--config FILE] [--apply] [--restore] [--json]`, and
//! `speedkit launch --nproc-per-node N -- <command>` (one process per device, data parallel).

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

use speedkit::launcher::{self, LaunchOptions};
use speedkit::report::Report;
use speedkit::SpeedConfig;

#[derive(Parser)]
#[command(
    name = "speedkit",
    version,
    about = "Inspect and apply speedkit's speed settings"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Hardware, the resolved settings with their reasons, and every flag before / applied / restored.
    Report {
        /// Speed config (YAML or JSON); default: `precision: auto` everywhere.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Apply the plan's flags (through a restoring guard) and show the state they produce.
        #[arg(long)]
        apply: bool,
        /// With --apply: restore afterwards and check that every flag reads back as before.
        #[arg(long, requires = "apply")]
        restore: bool,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Also audit a model's parameters (a `.safetensors` file, or libtorch's `.ot`/`.pt` from
        /// `VarStore::save`): Tensor Core alignment, sizes, placement.
        #[arg(long, value_name = "FILE")]
        model: Option<PathBuf>,
    },
    /// Start one process per device for data-parallel training (as torchrun does): sets RANK,
    /// LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; prefixes each output line with its rank;
    /// passes SIGINT/SIGTERM on; stops every rank when one fails and exits with its status.
    Launch {
        /// Processes on this machine (one per GPU).
        #[arg(long, value_name = "N")]
        nproc_per_node: usize,
        /// Machines in the run.
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This machine's index.
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Host of rank 0's rendezvous store.
        #[arg(long, default_value = "127.0.0.1")]
        master_addr: String,
        /// Port of rank 0's rendezvous store (default: MASTER_PORT, else a free port).
        #[arg(long)]
        master_port: Option<u16>,
        /// Seconds stopped ranks get after SIGTERM before SIGKILL.
        #[arg(long, default_value_t = 10)]
        grace_s: u64,
        /// The program and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Launch {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            grace_s,
            command,
        } => {
            let options = LaunchOptions {
                nproc_per_node,
                nnodes,
                node_rank,
                master_addr,
                master_port,
                grace: std::time::Duration::from_secs(grace_s),
                command,
            };
            match launcher::run(&options) {
                Ok(status) => ExitCode::from(u8::try_from(status).unwrap_or(1)),
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Report {
            config,
            apply,
            restore,
            json,
            model,
        } => {
            let model_audit = match model.as_deref().map(audit_model_file).transpose() {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            let config = match config {
                None => Ok(SpeedConfig::auto()),
                Some(p) if p.extension().is_some_and(|e| e == "json") => SpeedConfig::from_json(&p),
                Some(p) => SpeedConfig::from_yaml(&p),
            };
            let report = config
                .map_err(speedkit::SpeedkitError::from)
                .and_then(|c| Report::build(&c, apply, restore));
            match report {
                Ok(r) if json => {
                    let mut value = serde_json::to_value(&r).unwrap_or_default();
                    if let Some(a) = &model_audit {
                        value["model"] = serde_json::to_value(a).unwrap_or_default();
                    }
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&value).unwrap_or_default()
                    );
                }
                Ok(r) => {
                    print!("{r}");
                    if let Some(a) = &model_audit {
                        print!("\n== model\n{a}");
                    }
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            }
            ExitCode::SUCCESS
        }
    }
}

/// Reads named parameter tensors from a checkpoint and audits them.
fn audit_model_file(path: &std::path::Path) -> Result<speedkit::ModelAudit, String> {
    let named = if path.extension().is_some_and(|e| e == "safetensors") {
        tch::Tensor::read_safetensors(path)
    } else {
        tch::Tensor::load_multi(path)
    }
    .map_err(|e| format!("cannot read model parameters from {}: {e}", path.display()))?;
    Ok(speedkit::audit_tensors(&named, tch::Cuda::is_available()))
}
