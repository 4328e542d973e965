//! The docs state what the binary does: every flag of `run` (name, value name, environment
//! variable and default, from clap) appears in CONFIG.md's flag table, which names no flag the
//! binary does not have; every metric the process registers, in either mode, has a row of
//! CONFIG.md's metrics table; and the README and guides name only flags that exist.

use std::collections::BTreeMap;

use bootstrap_controller::cli::Cli;
use clap::CommandFactory;

/// One flag as clap knows it.
#[derive(Debug)]
struct Flag {
    env: Option<String>,
    default: Option<String>,
    /// As `--help` writes the flag: `--name VALUE`, `--name[=VALUE]` or `--name`.
    usage: String,
}

/// `run`'s flags by long name, with their env var and the default their help states.
fn clap_flags() -> BTreeMap<String, Flag> {
    let command = Cli::command();
    let run = command
        .find_subcommand("run")
        .expect("a run subcommand")
        .clone();
    let mut flags = BTreeMap::new();
    for arg in command.get_arguments().chain(run.get_arguments()) {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(ToString::to_string)
            .unwrap_or_default();
        let default = arg
            .get_default_values()
            .first()
            .map(|v| v.to_string_lossy().into_owned())
            .or_else(|| {
                help.split_once("[default: ")
                    .and_then(|(_, rest)| rest.split_once(']'))
                    .map(|(default, _)| default.to_owned())
            });
        let value = arg.get_value_names().map(|names| {
            names
                .iter()
                .map(|name| name.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        });
        let optional = arg.get_num_args().is_some_and(|n| n.min_values() == 0);
        let usage = match value {
            Some(value) if optional => format!("--{long}[={value}]"),
            Some(value) => format!("--{long} {value}"),
            None => format!("--{long}"),
        };
        flags.insert(
            format!("--{long}"),
            Flag {
                env: arg.get_env().map(|e| e.to_string_lossy().into_owned()),
                default,
                usage,
            },
        );
    }
    flags
}

/// The rows of the first table after `heading` in `doc`, as cells.
fn table_after(doc: &str, heading: &str) -> Vec<Vec<String>> {
    let start = doc
        .find(heading)
        .unwrap_or_else(|| panic!("{heading} missing"));
    doc[start..]
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .skip(2)
        .map(|line| {
            // `\|` inside a cell is a literal bar.
            line.replace("\\|", "\u{0}")
                .trim_matches('|')
                .split('|')
                .map(|cell| cell.replace('\u{0}', "|").trim().to_owned())
                .collect()
        })
        .collect()
}

/// The flags a first cell documents: "`--a X`, `--b`" names `--a` and `--b`.
fn flags_in(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|code| code.split([' ', '[', '=']).next())
        .filter(|name| name.starts_with("--"))
        .map(str::to_owned)
        .collect()
}

/// A default as written in a doc cell or a help text, compared loosely: the first code span
/// if there is one, else the words.
fn normalise(text: &str) -> String {
    let text = match text.split('`').nth(1) {
        Some(code) if text.contains('`') => code.to_owned(),
        _ => text.to_owned(),
    };
    let text = text.split([';', ',', '(']).next().unwrap_or_default();
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// The rows of the flag table after `heading` in `doc`, by the flags their first cell names.
fn flag_rows(doc: &str, heading: &str) -> BTreeMap<String, Vec<String>> {
    let mut rows = BTreeMap::new();
    for row in table_after(doc, heading) {
        for name in flags_in(&row[0]) {
            rows.insert(name, row.clone());
        }
    }
    rows
}

/// Checks a flag table (`default_column` holding the default) against `run`'s flags: every
/// flag has a row stating the default its help states, and no row names a flag `run` lacks.
fn flag_table_problems(doc: &str, heading: &str, what: &str, default_column: usize) -> Vec<String> {
    let flags = clap_flags();
    let mut rows = flag_rows(doc, heading);
    let mut problems = Vec::new();
    for (name, flag) in &flags {
        let Some(row) = rows.remove(name) else {
            problems.push(format!("{name} is missing from {what}"));
            continue;
        };
        let help_default = flag.default.as_deref().map(normalise).unwrap_or_default();
        let documented = normalise(&row[default_column]);
        if help_default != documented {
            problems.push(format!(
                "{name}: default {help_default:?} in --help, {documented:?} in {what}"
            ));
        }
    }
    for name in rows.keys() {
        problems.push(format!(
            "{what} documents {name}, which `run` does not have"
        ));
    }
    problems
}

#[test]
fn config_md_documents_every_flag_with_its_env_and_default() {
    let doc = include_str!("../CONFIG.md");
    let mut problems = flag_table_problems(doc, "## Flags", "CONFIG.md", 3);
    let rows = flag_rows(doc, "## Flags");
    for (name, flag) in clap_flags() {
        let Some(row) = rows.get(&name) else { continue };
        let env = row[1].trim_matches('`');
        if flag.env.as_deref() != Some(env) {
            problems.push(format!(
                "{name}: env {:?} in --help, {env} in CONFIG.md",
                flag.env
            ));
        }
        // The value's name as `--help` shows it, so that a reader finds the one in the other.
        let documented = row[0].split('`').skip(1).step_by(2).find(|code| {
            code.strip_prefix(name.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '[']))
        });
        if documented != Some(flag.usage.as_str()) {
            problems.push(format!(
                "{name}: `{}` in --help, {documented:?} in CONFIG.md",
                flag.usage
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The README and the guides in docs/ name only settings the binary has: CONFIG.md holds the one
/// flag table (checked above), and a flag they name in passing must still exist.
#[test]
fn readme_and_guides_name_only_flags_the_binary_has() {
    let flags = clap_flags();
    let docs = [
        ("README.md", include_str!("../../README.md")),
        (
            "docs/management-mode.md",
            include_str!("../../docs/management-mode.md"),
        ),
        ("docs/security.md", include_str!("../../docs/security.md")),
    ];
    // The prefixes of this binary's flags; other tools' flags (cargo's, helm's) are left alone.
    const OURS: [&str; 14] = [
        "--tenants-",
        "--leader-elect",
        "--etcd-",
        "--service-",
        "--endpoint-",
        "--advertise-",
        "--secure-",
        "--kubernetes-",
        "--admin-",
        "--dry-run",
        "--timer-",
        "--log-format",
        "--shutdown-",
        "--apiserver-",
    ];
    let mut problems = Vec::new();
    let mut named = 0;
    for (file, text) in docs {
        for (start, _) in text.match_indices("--") {
            let name: String = text[start..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            // `--etcd-*` names a family of flags, not one.
            if name.ends_with('-') || !OURS.iter().any(|prefix| name.starts_with(prefix)) {
                continue;
            }
            named += 1;
            if !flags.contains_key(&name) {
                problems.push(format!("{file} names {name}, which `run` does not have"));
            }
        }
    }
    assert!(named >= 10, "only {named} flags found: the scan is broken");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every top-level setting of the one list (`config::SETTINGS`) has a help text stating its
/// default, and a row in CONFIG.md's flag table with its environment variable and file key; the
/// table has no row for a flag the list lacks (`--config` aside, which names the file).
#[test]
fn config_md_has_a_row_for_every_setting_of_the_list() {
    use bootstrap_controller::config::SETTINGS;
    let flags = clap_flags();
    let mut rows = flag_rows(include_str!("../CONFIG.md"), "## Flags");
    let mut problems = Vec::new();
    for setting in SETTINGS {
        let name = setting.flag;
        if flags.get(name).is_none_or(|flag| flag.default.is_none()) {
            problems.push(format!("{name}: no help text stating `[default: ...]`"));
        }
        let Some(row) = rows.remove(name) else {
            problems.push(format!("{name} has no row in CONFIG.md's flag table"));
            continue;
        };
        if row[1].trim_matches('`') != setting.env {
            problems.push(format!(
                "{name}: env {} in the list, {} in CONFIG.md",
                setting.env, row[1]
            ));
        }
        if row[2].split('`').nth(1) != Some(setting.file_key) {
            problems.push(format!(
                "{name}: file key {} in the list, {} in CONFIG.md",
                setting.file_key, row[2]
            ));
        }
    }
    rows.remove("--config");
    for name in rows.keys() {
        problems.push(format!(
            "CONFIG.md has a row for {name}, which the list lacks"
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every field of the configuration file CONFIG.md documents, as a dotted path.
fn documented_file_fields() -> Vec<String> {
    let doc = include_str!("../CONFIG.md");
    let mut fields = Vec::new();
    for row in table_after(doc, "## Flags") {
        if let Some(field) = row[2].split('`').nth(1) {
            fields.push(field.to_owned());
        }
    }
    for row in table_after(doc, "## The file: loop sections") {
        let names: Vec<&str> = row[0].split('`').skip(1).step_by(2).collect();
        let Some(first) = names.first().filter(|n| n.starts_with("loops.")) else {
            continue;
        };
        if first.matches('.').count() < 2 {
            continue; // a note about a whole section
        }
        fields.push((*first).to_owned());
        let section = first
            .rsplit_once('.')
            .map_or(*first, |(section, _)| section);
        for more in names.iter().skip(1).filter(|n| n.starts_with('.')) {
            fields.push(format!("{section}{more}"));
        }
    }
    fields
}

/// `path` = `value` as a YAML document.
fn nested(path: &str, value: &str) -> String {
    let mut yaml = String::new();
    let parts: Vec<&str> = path.split('.').collect();
    for (depth, part) in parts.iter().enumerate() {
        yaml += &"  ".repeat(depth);
        yaml += part;
        yaml += ":";
        yaml += if depth + 1 == parts.len() { " " } else { "\n" };
    }
    yaml + value + "\n"
}

fn load(yaml: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, yaml).expect("write config");
    let args = bootstrap_controller::config::ConfigArgs {
        config: Some(path),
        ..Default::default()
    };
    bootstrap_controller::config::Config::load(&args)
        .map(drop)
        .map_err(|errors| errors.to_string())
}

#[test]
fn every_documented_file_field_rejects_a_wrong_type_naming_the_field() {
    let fields = documented_file_fields();
    assert!(fields.len() >= 40, "CONFIG.md tables not found: {fields:?}");
    let mut problems = Vec::new();
    for field in &fields {
        // A mapping where a scalar or a list belongs.
        match load(&nested(field, "{wrong: [type]}")) {
            Ok(()) => problems.push(format!("{field}: a mapping was accepted")),
            Err(message) if message.contains("unknown field") => problems.push(format!(
                "{field}: CONFIG.md documents a field the file does not have: {message}"
            )),
            Err(message) if !message.contains(field.as_str()) => {
                problems.push(format!("{field}: the error does not name it: {message}"))
            }
            Err(_) => {}
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_section_rejects_an_unknown_key_naming_it_and_the_fix() {
    let mut sections: Vec<String> = documented_file_fields()
        .iter()
        .filter_map(|f| f.rsplit_once('.').map(|(section, _)| section.to_owned()))
        .collect();
    sections.push(String::new());
    sections.sort();
    sections.dedup();
    for section in sections {
        let path = if section.is_empty() {
            "unknownField".to_owned()
        } else {
            format!("{section}.unknownField")
        };
        let message = load(&nested(&path, "1")).expect_err(&path);
        assert!(
            message.contains(&path) && message.contains("remove it or fix its spelling"),
            "{path}: {message}"
        );
    }
}

/// Every metric the process registers (the runtime's, leader election's and every loop's, all
/// loops enabled) has a row in CONFIG.md's metrics table. (prometheus-client encodes a labelled
/// family only once it has a child, so the families seen here are those with none: the check
/// covers the plain counters and gauges, and whatever a future loop registers unlabelled.)
#[tokio::test]
async fn config_md_documents_every_metric() {
    use bootstrap_controller::config::{Config, ConfigArgs};
    use bootstrap_controller::leader::LeaderMetrics;
    use bootstrap_controller::metrics::{RunnerMetrics, new_registry};

    // With a range (without one the service-cidr loop is not built) and an endpoints mode
    // (without one the endpoints loops are not).
    let config = Config::load(&ConfigArgs {
        leader_elect: Some("true".to_owned()),
        service_cluster_ip_range: Some("10.96.0.0/12".to_owned()),
        endpoint_reconciler_type: Some(bootstrap_controller::config::EndpointsMode::Lease),
        advertise_address: Some("192.0.2.10".to_owned()),
        ..ConfigArgs::default()
    })
    .expect("the default configuration is valid");
    let kube_config = kube::Config::new("https://127.0.0.1:1".parse().expect("a URL"));
    let client = kube::Client::try_from(kube_config).expect("a client");
    let mut registry = new_registry();
    RunnerMetrics::register(&mut registry);
    LeaderMetrics::register(&mut registry);
    let loops = bootstrap_controller::runner::build_loops(&config, &client, &mut registry);
    assert!(loops.len() >= 7, "every loop is built");
    // Management mode's own: the tenant manager's, the pools', and (in a registry of its own, as
    // each tenant has) a tenant's limited cache budget.
    bootstrap_controller::tenants::TenantMetrics::register(&mut registry, 64 * 1024 * 1024);
    bootstrap_controller::tenants::Pools::new(1 << 20, &mut registry);
    let mut tenant = new_registry();
    reconcilers::budget::CacheBudget::new(
        reconcilers::budget::BudgetLimits {
            max_objects: 10,
            max_bytes: 1 << 20,
        },
        "a hint",
        None,
        &mut tenant,
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
    prometheus_client::encoding::text::encode(&mut text, &tenant).expect("encodes");
    let registered: std::collections::BTreeSet<String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .map(|rest| {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            // OpenMetrics names counters without `_total` in TYPE; samples and docs carry it.
            if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            }
        })
        .collect();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/CONFIG.md"))
        .expect("CONFIG.md");
    // A row may name several: "`a`, `b`".
    let documented: std::collections::BTreeSet<String> =
        table_after(&doc, "## Metrics (prefix `bootstrap_`)")
            .iter()
            .filter_map(|row| row.first())
            .flat_map(|cell| cell.split('`').skip(1).step_by(2).map(str::to_owned))
            .collect();
    assert!(
        registered.len() >= 5,
        "the encoding shows the plain metrics: {registered:?}"
    );
    let undocumented: Vec<_> = registered.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "registered but not in CONFIG.md's metrics table: {undocumented:?}"
    );
    assert!(
        documented.iter().all(|name| name.starts_with("bootstrap_")),
        "{documented:?}"
    );
}

/// Every metric of the process registry (the conventional `process_*` ones and the build's) has
/// a row in CONFIG.md: `bootstrap_build_info` in the main table, the others in the process table.
#[test]
fn config_md_documents_the_process_metrics() {
    let text = bootstrap_controller::metrics::encode_merged(
        &bootstrap_controller::metrics::new_registry(),
        &[bootstrap_controller::metrics::process_registry()],
    )
    .expect("encodes");
    let registered: std::collections::BTreeSet<String> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .map(|rest| {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            }
        })
        .collect();
    for name in [
        "bootstrap_build_info",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        assert!(registered.contains(name), "{name} not exported: {text}");
    }
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/CONFIG.md"))
        .expect("CONFIG.md");
    let documented: std::collections::BTreeSet<String> = [
        "## Metrics (prefix `bootstrap_`)",
        "### Process metrics (no prefix)",
    ]
    .iter()
    .flat_map(|heading| table_after(&doc, heading))
    .filter_map(|row| row.first().map(|cell| cell.trim_matches('`').to_owned()))
    .collect();
    let undocumented: Vec<_> = registered.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "exported but not in CONFIG.md: {undocumented:?}"
    );
}
