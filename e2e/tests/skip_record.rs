//! A skip is seen and counted: `common::skip` writes its line past libtest's capture of a
//! passing test's output, and appends it, named `<test file>::<test>`, to the file
//! `BOOTSTRAP_E2E_SKIP_LOG` names, in the form `e2e/control-plane/skips.sh` reads. The test runs
//! this binary again with the environment set for that run alone.

mod common;

use std::process::Command;

use anyhow::{Result, ensure};

const PROBE: &str = "BOOTSTRAP_E2E_SKIP_PROBE";
const TEST: &str = "a_skip_is_printed_past_the_capture_and_recorded";

#[test]
fn a_skip_is_printed_past_the_capture_and_recorded() -> Result<()> {
    if std::env::var_os(PROBE).is_some() {
        common::skip("a probe: the reason, on one line\nthough given on two");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let record = dir.path().join("record");
    // Written before: the record is appended to, never replaced.
    std::fs::write(
        &record,
        "CLUSTER other::test: runs against the given cluster\n",
    )?;
    let out = Command::new(std::env::current_exe()?)
        .args(["--exact", TEST, "--test-threads=1"])
        .env(PROBE, "1")
        .env(common::SKIP_LOG, &record)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "{out:?}");
    let line = format!(
        "SKIPPED skip_record::{TEST}: a probe: the reason, on one line though given on two"
    );
    // Without --nocapture: printed all the same, beside the test's name.
    ensure!(
        stdout.contains(&format!("test {TEST} ... {line}\n")),
        "{stdout}"
    );
    let recorded = std::fs::read_to_string(&record)?;
    ensure!(
        recorded == format!("CLUSTER other::test: runs against the given cluster\n{line}\n"),
        "{recorded}"
    );
    Ok(())
}
