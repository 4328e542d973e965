//! `bootstrap-controller`: see `bootstrap-controller --help`.

use std::process::ExitCode;

use bootstrap_controller::cli::{Cli, execute};
use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    execute(Cli::parse()).await
}
