//! What the user probably meant: the nearest known key of a mistyped one, and the environment
//! variables with the settings' prefix that name no setting.

use reconcilers::section::ConfigError;

use super::ENV_PREFIX;
use super::settings::SETTINGS;

/// The variables with the prefix that are no setting's but this binary's own.
const OTHER_VARIABLES: &[&str] = &[
    "BOOTSTRAP_CONFIG",
    "BOOTSTRAP_CHECK_TIMEOUT",
    "BOOTSTRAP_CHECK_OUTPUT",
];

/// The candidate nearest to `typed`: one differing only in case, else one within a few edits
/// (a third of its length, at least two), the closest first. `None` when nothing is close: a
/// suggestion far off misleads more than none.
pub fn nearest<'a>(typed: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lower = typed.to_lowercase();
    let mut best: Option<(usize, &str)> = None;
    for candidate in candidates {
        let distance = if candidate.to_lowercase() == lower {
            0
        } else {
            strsim::damerau_levenshtein(&lower, &candidate.to_lowercase())
        };
        let limit = (candidate.chars().count() / 3).max(2);
        if distance <= limit && best.is_none_or(|(d, _)| distance < d) {
            best = Some((distance, candidate));
        }
    }
    best.map(|(_, candidate)| candidate)
}

/// What an unknown field's message should say: the near miss, when there is one, in place of
/// serde's list of every field.
pub fn unknown_field_hint(message: &str) -> Option<String> {
    let (_, rest) = message.split_once("unknown field `")?;
    let (typed, rest) = rest.split_once('`')?;
    let expected = rest.split_once("expected ")?.1;
    let expected = expected.strip_prefix("one of ").unwrap_or(expected);
    let fields: Vec<&str> = expected
        .split([',', ' '])
        .map(|field| field.trim().trim_matches('`'))
        .filter(|field| !field.is_empty() && *field != "or")
        .collect();
    let near = nearest(typed, fields.iter().copied())?;
    Some(format!("unknown field `{typed}`: did you mean `{near}`?"))
}

/// Every variable of `vars` with the settings' prefix (in any case) that names no setting. One
/// near a setting's variable is an error naming it (surely meant: `BOOTSTRAP_ADVERTISE_ADRESS`);
/// one near none is only worth a warning, as other tools may share the prefix.
pub fn unknown_variables(
    vars: impl IntoIterator<Item = String>,
) -> (Vec<ConfigError>, Vec<String>) {
    let known: Vec<&str> = SETTINGS
        .iter()
        .map(|setting| setting.env)
        .chain(OTHER_VARIABLES.iter().copied())
        .collect();
    let (mut errors, mut warnings) = (Vec::new(), Vec::new());
    for name in vars {
        let prefixed = name
            .get(..ENV_PREFIX.len())
            .is_some_and(|prefix| prefix.eq_ignore_ascii_case(ENV_PREFIX));
        if !prefixed || known.contains(&name.as_str()) {
            continue;
        }
        // Compared without the prefix every one of them shares.
        let typed = name.get(ENV_PREFIX.len()..).unwrap_or_default();
        let meant = nearest(
            typed,
            known
                .iter()
                .map(|known| known.strip_prefix(ENV_PREFIX).unwrap_or(known)),
        )
        .map(|suffix| format!("{ENV_PREFIX}{suffix}"));
        match meant {
            Some(meant) => errors.push(ConfigError::new(
                name.clone(),
                format!("is no setting's variable: did you mean {meant}? (unset it, or rename it)"),
            )),
            None => warnings.push(format!(
                "{name} names no setting and is ignored (the settings' variables: \
                 `bootstrap-controller --help`)"
            )),
        }
    }
    (errors, warnings)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn near_misses_and_case_only_typos_are_suggested() {
        let fields = ["dryRun", "timerOnly", "securePort", "adminAddr"];
        assert_eq!(nearest("dryrun", fields), Some("dryRun"));
        assert_eq!(nearest("DryRun", fields), Some("dryRun"));
        assert_eq!(nearest("dry_run", fields), Some("dryRun"));
        assert_eq!(nearest("securPort", fields), Some("securePort"));
        assert_eq!(nearest("leaseName", fields), None);
        assert_eq!(
            unknown_field_hint(
                "unknown field `intervall`, expected one of enabled, interval, namespaces"
            )
            .as_deref(),
            Some("unknown field `intervall`: did you mean `interval`?")
        );
        assert_eq!(
            unknown_field_hint("unknown field `dryrun`, expected `dryRun` or `timerOnly`")
                .as_deref(),
            Some("unknown field `dryrun`: did you mean `dryRun`?")
        );
        assert_eq!(
            unknown_field_hint("unknown field `zzz`, expected one of a, b"),
            None
        );
    }

    #[test]
    fn a_mistyped_variable_is_an_error_naming_the_real_one() {
        let (errors, warnings) = unknown_variables(
            [
                "BOOTSTRAP_ADVERTISE_ADRESS",
                "bootstrap_dry_run",
                "BOOTSTRAP_DRY_RUN",
                "BOOTSTRAP_CONFIG",
                "BOOTSTRAP_E2E_KUBECONFIG",
                "HOME",
            ]
            .map(str::to_owned),
        );
        let said: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(
            said[0].starts_with("BOOTSTRAP_ADVERTISE_ADRESS: ")
                && said[0].contains("did you mean BOOTSTRAP_ADVERTISE_ADDRESS?"),
            "{said:?}"
        );
        assert!(
            said[1].contains("did you mean BOOTSTRAP_DRY_RUN?"),
            "{said:?}"
        );
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with("BOOTSTRAP_E2E_KUBECONFIG "),
            "{warnings:?}"
        );
    }
}
