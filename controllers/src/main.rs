//! `bootstrap-controller`: see `bootstrap-controller --help`.

use std::process::ExitCode;

use bootstrap_controller::cli::{Cli, EXIT_CONFIG, env_value_error, execute};
use clap::{CommandFactory, FromArgMatches};

/// The static build's allocator (the image's): see `tikv-jemallocator` in the workspace's
/// Cargo.toml. glibc builds keep glibc's.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let matches = match Cli::command().try_get_matches() {
        Ok(matches) => matches,
        Err(err) => match env_value_error(&err, std::env::args_os()) {
            Some(message) => {
                eprint!("{message}");
                return ExitCode::from(EXIT_CONFIG);
            }
            None => err.exit(),
        },
    };
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit());
    // Errors then name the variable a value came from, not its flag.
    cli.config.note_sources(&matches);
    execute(cli).await
}
