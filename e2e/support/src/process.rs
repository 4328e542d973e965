//! Running a workspace binary the way a test wants it: without the developer's environment.

use std::ffi::OsStr;
use std::process::{Command, Output};

/// A command for `program` (a `CARGO_BIN_EXE_*` path) with the developer's `BOOTSTRAP_*`
/// variables and `KUBECONFIG` removed, so nothing from outside the test reaches it, and
/// `RUST_LOG=error`, so its stderr holds the messages the tests look for.
pub fn clean_command(program: impl AsRef<OsStr>) -> Command {
    let mut command = Command::new(program);
    for (key, _) in std::env::vars() {
        if key.starts_with("BOOTSTRAP_") || key == "KUBECONFIG" {
            command.env_remove(key);
        }
    }
    command.env("RUST_LOG", "error");
    command
}

/// Runs `command` to its end: its exit code (-1 when killed by a signal), stdout and stderr.
///
/// # Panics
/// When the program cannot be started: the test cannot go on.
pub fn run(command: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = command
        .output()
        .unwrap_or_else(|err| panic!("running {command:?}: {err}"));
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}
