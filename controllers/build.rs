//! The build's identity for `--version` and `bootstrap_build_info`: the commit (from git, when
//! the sources are a git checkout with git installed) and the build date (`SOURCE_DATE_EPOCH`,
//! else the commit's date, so two builds of one commit agree). Without git either is `unknown`.
//!
//! The script reruns only when `SOURCE_DATE_EPOCH` or what HEAD names changes (HEAD itself, the
//! branch's ref file, `packed-refs`): not on every build, nor on a change to the index or the
//! work tree.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}

/// A file of the git directory, as git resolves it (a worktree's HEAD is its own, its refs the
/// main repository's).
fn git_path(name: &str) -> Option<PathBuf> {
    git(&["rev-parse", "--git-path", name]).map(PathBuf::from)
}

fn date(epoch: i64) -> Option<String> {
    let at = jiff::Timestamp::from_second(epoch).ok()?;
    Some(at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
}

fn main() {
    println!("cargo::rerun-if-env-changed=SOURCE_DATE_EPOCH");
    let mut watched = vec![git_path("HEAD"), git_path("packed-refs")];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git_path(&branch));
    }
    // A path that does not exist would rerun the script on every build.
    for path in watched.into_iter().flatten().filter(|path| path.exists()) {
        println!("cargo::rerun-if-changed={}", path.display());
    }

    let commit = git(&["rev-parse", "--short=12", "HEAD"]);
    let epoch = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|text| text.trim().parse::<i64>().ok())
        .or_else(|| git(&["log", "-1", "--format=%ct", "HEAD"])?.parse().ok());
    let unknown = || "unknown".to_owned();
    println!(
        "cargo::rustc-env=BOOTSTRAP_BUILD_COMMIT={}",
        commit.unwrap_or_else(unknown)
    );
    println!(
        "cargo::rustc-env=BOOTSTRAP_BUILD_DATE={}",
        epoch.and_then(date).unwrap_or_else(unknown)
    );
}
