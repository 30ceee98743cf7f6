//! The `speedkit` command: `speedkit report [--config FILE] [--apply] [--restore] [--json]`.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

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
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Report {
            config,
            apply,
            restore,
            json,
        } => {
            let config = match config {
                None => Ok(SpeedConfig::auto()),
                Some(p) if p.extension().is_some_and(|e| e == "json") => SpeedConfig::from_json(&p),
                Some(p) => SpeedConfig::from_yaml(&p),
            };
            let report = config
                .map_err(speedkit::SpeedkitError::from)
                .and_then(|c| Report::build(&c, apply, restore));
            match report {
                Ok(r) if json => println!("{}", r.to_json()),
                Ok(r) => print!("{r}"),
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            }
            ExitCode::SUCCESS
        }
    }
}
