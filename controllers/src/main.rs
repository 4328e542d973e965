//! `bootstrap-controller`: see `bootstrap-controller --help`.

use std::process::ExitCode;

use bootstrap_controller::cli::{Cli, execute};
use clap::Parser;

/// What a paused or removed tenant held goes back to the system: mimalloc returns freed pages
/// within milliseconds, where glibc's malloc keeps much of a burst resident in its arenas.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    execute(Cli::parse()).await
}
