//! The `--config` file's parser (its shape is [`FileConfig`], which follows from the settings
//! list).
//!
//! A file is checked whole: after each problem the parser finds, the lines of the offending key
//! (with everything indented under it) are blanked and the text parsed again, so one run reports
//! every problem, each with the line of the key the user wrote, and line numbers never shift.

use std::path::Path;

use reconcilers::section::ConfigError;

use super::ConfigErrors;
use super::settings::FileConfig;
use super::suggest::unknown_field_hint;

/// Parses the YAML text of a configuration file; the error is its first problem, naming the
/// field path. [`parse_file_all`] finds every one.
pub fn parse_file(text: &str) -> Result<FileConfig, ConfigError> {
    parse_once(text).map_err(|failure| failure.error)
}

/// Every problem of a configuration file, with the file as parsed once the offending keys are
/// left out (`None` when a problem could not be isolated, so nothing after it can be trusted).
pub fn parse_file_all(text: &str) -> (Option<FileConfig>, Vec<ConfigError>) {
    // More problems than this in one file is a file of another kind: enough has been said.
    const MOST: usize = 50;
    let original: Vec<&str> = text.split('\n').collect();
    let mut lines: Vec<String> = original.iter().map(|line| (*line).to_owned()).collect();
    let mut errors: Vec<ConfigError> = Vec::new();
    while errors.len() < MOST {
        let current = lines.join("\n");
        let failure = match parse_once(&current) {
            Ok(file) => return (Some(file), errors),
            Err(failure) => failure,
        };
        // A key all of whose lines were taken out is now empty, which is no problem of the
        // user's: it becomes an empty mapping (on the same line, so no line moves).
        if let Some(at) = failure.line
            && emptied(&original, &lines, at)
        {
            lines[at - 1].push_str(" {}");
            continue;
        }
        let (error, blame) = explain(&original, &current, failure);
        let Some(blame) = blame else {
            errors.push(error);
            break;
        };
        if !errors.contains(&error) {
            errors.push(error);
        }
        if !blank(&mut lines, blame) {
            break;
        }
    }
    (None, errors)
}

/// A problem as serde-saphyr reports it: the field path, the message, the line.
struct Failure {
    error: ConfigError,
    line: Option<usize>,
}

fn parse_once(text: &str) -> Result<FileConfig, Failure> {
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
                .filter(|path| path != "." && !path.contains('?'))
                .unwrap_or_else(|| "(file)".to_owned());
            let line = err
                .location()
                .and_then(|location| usize::try_from(location.line()).ok())
                .filter(|line| *line > 0);
            // The first line of serde-saphyr's message is the cause with its location; the rest
            // is a source snippet that is noise in a one-line error.
            let message = err.to_string();
            let first = message.lines().next().unwrap_or("invalid YAML").trim();
            Err(Failure {
                error: ConfigError::new(path, fix_hint_for_parse_error(first)),
                line,
            })
        }
    }
}

/// Whether line `at` (1-based) is a key whose value, on the lines under it, was all taken out.
fn emptied(original: &[&str], lines: &[String], at: usize) -> bool {
    let Some(key) = at.checked_sub(1).and_then(|first| lines.get(first)) else {
        return false;
    };
    if !key.trim_end().ends_with(':') {
        return false;
    }
    let indent = indentation(key);
    let under: Vec<usize> = (at..lines.len())
        .take_while(|&n| lines[n].trim().is_empty() || indentation(&lines[n]) > indent)
        .collect();
    under.iter().all(|&n| lines[n].trim().is_empty())
        && under
            .iter()
            .any(|&n| original.get(n).is_some_and(|line| !line.trim().is_empty()))
}

/// The error to report for `failure` in `current` (the text with the keys reported before taken
/// out; `lines`, the file as written, for the hints), and the line whose key to leave out before
/// parsing again (`None`: nothing to leave out).
fn explain(lines: &[&str], current: &str, failure: Failure) -> (ConfigError, Option<usize>) {
    let Failure { error, line } = failure;
    let text = current;
    // A key indented deeper than its siblings continues the value before it: YAML reads
    // `enabled: true` and `  leaseName: x` below it as the one value "true leaseName: x". Blame
    // the key the user misplaced, on its own line.
    if let Some(at) = line
        && let Some((key, continued)) = continuation_key(lines, at)
    {
        let parent = error.field.rsplit_once('.').map(|(parent, _)| parent);
        let field = match parent {
            Some(parent) => format!("{parent}.{key}"),
            None => key.to_owned(),
        };
        let sibling = lines
            .get(at - 1)
            .map(|text| {
                text.trim_start()
                    .split(':')
                    .next()
                    .unwrap_or_default()
                    .trim()
            })
            .unwrap_or_default();
        let error = ConfigError::new(
            field,
            format!(
                "line {continued}: `{key}` is indented deeper than `{sibling}` (line {at}), so \
                 YAML reads it as part of that value; indent it as `{sibling}` is"
            ),
        );
        return (error, Some(at));
    }
    if error.field == "(file)"
        && error.message.contains("did not find expected key")
        && let Some(at) = line
        && let Some(message) = misaligned(lines, at)
    {
        return (ConfigError::new(error.field, message), Some(at));
    }
    let blame = locate(text, &error.field).or(line);
    let unknown = error.message.contains("unknown field `");
    let mut message = match unknown_field_hint(&error.message) {
        Some(hint) => {
            let at = line
                .map(|line| format!("line {line}: "))
                .unwrap_or_default();
            format!("{at}{hint}")
        }
        None => error.message,
    };
    if unknown && let Some((key, at)) = line.and_then(|line| dedented_from(lines, line)) {
        message.push_str(&format!(
            " (if it belongs to `{key}` on line {at}, indent it under that key)"
        ));
    }
    (ConfigError::new(error.field, message), blame)
}

/// When line `at` (1-based) holds `key: value` whose plain value runs on into a deeper-indented
/// `other: ...` line, that key and the line it is on.
fn continuation_key<'a>(lines: &[&'a str], at: usize) -> Option<(&'a str, usize)> {
    let here = lines.get(at.checked_sub(1)?)?;
    let (_, value) = here.split_once(": ")?;
    let value = value.trim();
    if value.is_empty() || value.starts_with(['|', '>', '[', '{', '"', '\'', '&', '*', '!', '#']) {
        return None;
    }
    let indent = indentation(here);
    let (offset, next) = lines
        .iter()
        .enumerate()
        .skip(at)
        .find(|(_, line)| !line.trim().is_empty())?;
    if indentation(next) <= indent {
        return None;
    }
    let key = next.trim_start().split_once(':')?.0;
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    plain.then_some((key, offset + 1))
}

/// The last line before line `at` (1-based) that is neither blank nor a comment, with its
/// offset.
fn line_before<'a>(lines: &[&'a str], at: usize) -> Option<(usize, &'a str)> {
    lines
        .iter()
        .enumerate()
        .take(at.checked_sub(1)?)
        .rev()
        .find(|(_, line)| !line.trim().is_empty() && !line.trim_start().starts_with('#'))
        .map(|(offset, line)| (offset, *line))
}

/// When line `at` (1-based) holds a key whose indentation is none of the enclosing keys' nor
/// their children's (YAML's "did not find expected key"), what to say about it.
fn misaligned(lines: &[&str], at: usize) -> Option<String> {
    let here = lines.get(at.checked_sub(1)?)?;
    let key = here.trim_start().split_once(':')?.0.trim();
    if key.is_empty() || key.starts_with(['-', '#']) {
        return None;
    }
    let indent = indentation(here);
    let (offset, before) = line_before(lines, at)?;
    let other = before.trim_start().split_once(':')?.0.trim();
    let other_indent = indentation(before);
    (indent != other_indent).then(|| {
        format!(
            "line {at}: `{key}` is indented {indent} spaces and `{other}` on line {} \
             {other_indent}: align `{key}` with the keys it belongs with",
            offset + 1
        )
    })
}

/// For an unknown key on line `at` (1-based): the key just before it, at the same indentation,
/// with nothing under it, which it may have been meant to be under.
fn dedented_from<'a>(lines: &[&'a str], at: usize) -> Option<(&'a str, usize)> {
    let here = lines.get(at.checked_sub(1)?)?;
    let (offset, before) = line_before(lines, at)?;
    let (key, value) = before.trim_start().split_once(':')?;
    (indentation(before) == indentation(here) && value.trim().is_empty())
        .then_some((key.trim(), offset + 1))
}

fn indentation(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

/// Blanks line `at` (1-based) and the lines indented under it; `false` when it is blank
/// already (nothing left to take out).
fn blank(lines: &mut [String], at: usize) -> bool {
    let Some(first) = at.checked_sub(1).filter(|first| *first < lines.len()) else {
        return false;
    };
    if lines[first].trim().is_empty() {
        return false;
    }
    // A sequence item's own keys sit two columns right of its dash.
    let mut indent = indentation(&lines[first]);
    if lines[first].trim_start().starts_with("- ") {
        indent += 1;
    }
    lines[first].clear();
    for line in lines.iter_mut().skip(first + 1) {
        if !line.trim().is_empty() && indentation(line) <= indent {
            break;
        }
        line.clear();
    }
    true
}

/// The line (1-based) of the key at `path` (`loops.systemNamespaces.namespaces[0].name`) in
/// `text`, or of the deepest key of it that is there. A scan of the block structure, enough
/// for configuration files: flow collections (`{...}`, `[...]`) count as their key's line.
pub fn locate(text: &str, path: &str) -> Option<usize> {
    if path.is_empty() || path.starts_with('(') || path.starts_with('-') {
        return None;
    }
    let nodes = scan(text);
    let mut parent: Option<usize> = None;
    let mut rest = path;
    let mut found = None;
    while !rest.is_empty() {
        let children = nodes.iter().enumerate().filter(|(_, n)| n.parent == parent);
        let step = if let Some(index) = rest.strip_prefix('[') {
            let (number, after) = index.split_once(']')?;
            let number: usize = number.parse().ok()?;
            let item = children
                .filter(|(_, node)| node.key.is_none())
                .nth(number)
                .map(|(at, _)| at);
            item.map(|item| (item, after))
        } else {
            // The longest key that the path goes on from, so keys holding dots are found.
            children
                .filter_map(|(at, node)| {
                    let key = node.key.as_deref()?;
                    let after = rest.strip_prefix(key)?;
                    (after.is_empty() || after.starts_with(['.', '['])).then_some((at, after, key))
                })
                .max_by_key(|(_, _, key)| key.len())
                .map(|(at, after, _)| (at, after))
        };
        let Some((at, after)) = step else {
            break;
        };
        found = Some(nodes[at].line);
        parent = Some(at);
        rest = after.strip_prefix('.').unwrap_or(after);
    }
    found
}

/// A key (or a sequence item, `key: None`) of the block structure.
struct Node {
    key: Option<String>,
    line: usize,
    column: usize,
    parent: Option<usize>,
}

fn scan(text: &str) -> Vec<Node> {
    let mut nodes: Vec<Node> = Vec::new();
    // The open nodes, innermost last.
    let mut open: Vec<usize> = Vec::new();
    for (number, line) in text.split('\n').enumerate() {
        let content = line.trim_start_matches(' ');
        if content.is_empty() || content.starts_with('#') || content.starts_with("---") {
            continue;
        }
        let mut column = line.len() - content.len();
        let mut content = content;
        loop {
            let item = content == "-" || content.starts_with("- ");
            // An item is the child of the key it sits under, even at that key's column.
            while let Some(&top) = open.last() {
                let node = &nodes[top];
                let closes = if item {
                    node.column > column || (node.column == column && node.key.is_none())
                } else {
                    node.column >= column
                };
                if !closes {
                    break;
                }
                open.pop();
            }
            if !item {
                break;
            }
            nodes.push(Node {
                key: None,
                line: number + 1,
                column,
                parent: open.last().copied(),
            });
            open.push(nodes.len() - 1);
            let after = content.get(1..).unwrap_or_default();
            let rest = after.trim_start_matches(' ');
            column += 1 + after.len() - rest.len();
            content = rest;
            if content.is_empty() {
                break;
            }
        }
        if content.is_empty() || content.starts_with('-') && content.len() == 1 {
            continue;
        }
        let Some((key, _)) = content.split_once(':') else {
            continue;
        };
        let key = key.trim().trim_matches(['"', '\'']);
        if key.is_empty() || content.starts_with(['{', '[']) {
            continue;
        }
        nodes.push(Node {
            key: Some(key.to_owned()),
            line: number + 1,
            column,
            parent: open.last().copied(),
        });
        open.push(nodes.len() - 1);
    }
    nodes
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

/// The text of `--config`.
pub(super) fn read_text(path: &Path) -> Result<String, ConfigErrors> {
    std::fs::read_to_string(path).map_err(|err| {
        ConfigErrors::from(ConfigError::new(
            "--config",
            format!(
                "cannot read {}: {err} (check the path, or leave --config out to use the \
                 defaults)",
                path.display()
            ),
        ))
    })
}
