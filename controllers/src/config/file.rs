//! The `--config` file's parser (its shape is [`FileConfig`], which follows from the settings
//! list).

use std::path::Path;

use reconcilers::section::ConfigError;

use super::ConfigErrors;
use super::settings::FileConfig;

/// Parses the YAML text of a configuration file. Errors name the field path.
pub fn parse_file(text: &str) -> Result<FileConfig, ConfigError> {
    let mut failed_path = None;
    let result = serde_saphyr::with_deserializer_from_str(text, |deserializer| {
        serde_path_to_error::deserialize(deserializer).map_err(|err| {
            failed_path = Some(err.path().to_string());
            err.into_inner()
        })
    });
    match result {
        Ok(file) => Ok(file),
        Err(err) => {
            let path = failed_path
                .filter(|path| path != ".")
                .unwrap_or_else(|| "(file)".to_owned());
            // The first line of serde-saphyr's message is the cause with its location; the rest
            // is a source snippet that is noise in a one-line error.
            let message = err.to_string();
            let first = message.lines().next().unwrap_or("invalid YAML").trim();
            Err(ConfigError::new(path, fix_hint_for_parse_error(first)))
        }
    }
}

pub(super) fn fix_hint_for_parse_error(message: &str) -> String {
    let message = message.strip_prefix("error: ").unwrap_or(message);
    let hint = if message.contains("unknown field") {
        " (remove it or fix its spelling; `config print` shows every field)"
    } else if message.contains("expected mapping") {
        " (expected fields here, e.g. `name: kube-system` or `interval: 1m`)"
    } else if ["invalid u16", "invalid u32", "invalid u64", "invalid i64"]
        .iter()
        .any(|kind| message.contains(kind))
    {
        " (expected a whole number, e.g. 6443)"
    } else if message.contains("invalid bool") || message.contains("invalid boolean") {
        " (expected true or false)"
    } else {
        ""
    };
    format!("{message}{hint}")
}

pub(super) fn read_file(path: &Path) -> Result<FileConfig, ConfigErrors> {
    let text = std::fs::read_to_string(path).map_err(|err| {
        ConfigError::new(
            "--config",
            format!(
                "cannot read {}: {err} (check the path, or leave --config out to use the \
                 defaults)",
                path.display()
            ),
        )
    })?;
    parse_file(&text).map_err(|err| {
        ConfigErrors(vec![ConfigError::new(
            err.field,
            format!("{} (in {})", err.message, path.display()),
        )])
    })
}
