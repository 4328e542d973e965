//! `bootstrap-controller`: see `bootstrap-controller --help`.

use std::process::ExitCode;

use bootstrap_controller::cli::{Cli, execute};
use clap::{CommandFactory, FromArgMatches};

#[tokio::main]
async fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit());
    // Errors then name the variable a value came from, not its flag.
    cli.config.note_sources(&matches);
    execute(cli).await
}
