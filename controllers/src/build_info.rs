//! This build: the package version, the commit and the build date, from `build.rs`.

/// The package version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit built, abbreviated to 12 digits; `unknown` when built without git.
pub const COMMIT: &str = env!("BOOTSTRAP_BUILD_COMMIT");
/// When it was built, RFC 3339 in UTC: `SOURCE_DATE_EPOCH`, else the commit's date; `unknown`
/// without either.
pub const DATE: &str = env!("BOOTSTRAP_BUILD_DATE");
/// What `--version` prints after the program's name.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("BOOTSTRAP_BUILD_COMMIT"),
    ", built ",
    env!("BOOTSTRAP_BUILD_DATE"),
    ")"
);
