//! Text from outside the process, made fit to report.
//!
//! An API server's messages and object names, and in management mode everything a tenant
//! Secret's writer or a tenant's API server says, are written by someone who may be hostile.
//! Copied as they are into a log line, an event note, a metric label or `/readyz`, a newline
//! would forge a whole log line, an ESC sequence would reach an operator's terminal, a
//! megabyte-long Status message would be copied into every report, and a URL's
//! `user:password@` would be logged in clear. [`Sanitized`] is such text as it may be reported:
//!
//! - control characters (C0 and C1, `\n`, `\r`, ESC, DEL) and the characters that change how
//!   text around them is shown (bidi and other format characters, line and paragraph
//!   separators, spaces other than ` `, combining marks) are written as Rust's `escape_debug`
//!   writes them (`\n`, `\u{1b}`, `\u{202e}`); quotes and backslashes stay as they are, so a
//!   message stays readable and still cannot span two lines;
//! - a URL's userinfo is replaced by `***` wherever it appears in the text;
//! - at most [`MAX_BYTES`] bytes are kept, never part of a character or of an escape, followed
//!   by a marker saying how much was cut.

use std::fmt;

/// The most bytes of one piece of outside text that are reported (escapes included): the most
/// that fits an event note (1 KiB) with the marker (under 40 bytes), as the messages composed
/// around such text need (a refused credential plugin's failure quotes its whole command line),
/// and short enough that a hostile server cannot fill logs or `/readyz` with it. Counted in
/// bytes, not characters, so that no text of any script makes a note too long.
pub const MAX_BYTES: usize = 960;

/// What replaces a URL's userinfo.
const REDACTED: &str = "***";

/// Outside text, escaped, without userinfo and capped (see [the module](self)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sanitized(String);

impl Sanitized {
    /// `text`, capped at [`MAX_BYTES`].
    pub fn new(text: &str) -> Sanitized {
        Sanitized::within(text, MAX_BYTES)
    }

    /// What `value` displays (an error, a URL), capped at [`MAX_BYTES`].
    pub fn of(value: impl fmt::Display) -> Sanitized {
        Sanitized::new(&value.to_string())
    }

    /// `text`, capped at `max` bytes (plus the marker, when cut).
    pub fn within(text: &str, max: usize) -> Sanitized {
        let text = without_userinfo(text);
        let mut out = String::with_capacity(text.len().min(max) + 32);
        let mut kept = 0;
        for (at, c) in text.char_indices() {
            let escaped = needs_escape(c);
            let width = if escaped {
                c.escape_debug().len()
            } else {
                c.len_utf8()
            };
            if kept + width > max {
                let cut = text.len() - at;
                out.push_str(&format!("...[{cut} more bytes cut]"));
                break;
            }
            if escaped {
                out.extend(c.escape_debug());
            } else {
                out.push(c);
            }
            kept += width;
        }
        Sanitized(out)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

/// [`Sanitized::new`]: outside text as it may be reported.
pub fn sanitize(text: &str) -> Sanitized {
    Sanitized::new(text)
}

impl fmt::Display for Sanitized {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<Sanitized> for String {
    fn from(text: Sanitized) -> String {
        text.0
    }
}

impl AsRef<str> for Sanitized {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Whether `c` is shown escaped: every character `escape_debug` escapes (controls, format
/// characters such as the bidi overrides, separators, combining marks), except the quotes and
/// the backslash, which are printable.
fn needs_escape(c: char) -> bool {
    !matches!(c, '"' | '\'' | '\\') && c.escape_debug().len() > 1
}

/// `text` with the userinfo of every URL in it (`scheme://user:password@host`) replaced by
/// [`REDACTED`]. An authority ends where RFC 3986 says it must (`/`, `?`, `#`) or at a
/// character no URL holds (whitespace, a control, `"`, `<`, `>`, `\`, `^`, a backquote, `{`,
/// `|`, `}`), so a password with any other character is still taken whole; the last `@` before
/// that end ends the userinfo.
fn without_userinfo(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("://") {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(scheme_end) = rest.find("://") {
        let authority_start = scheme_end + 3;
        out.push_str(&rest[..authority_start]);
        let after = &rest[authority_start..];
        let authority_len = after
            .find(|c: char| {
                matches!(
                    c,
                    '/' | '?' | '#' | '"' | '<' | '>' | '\\' | '^' | '`' | '{' | '|' | '}'
                ) || c.is_whitespace()
                    || c.is_control()
            })
            .unwrap_or(after.len());
        let authority = &after[..authority_len];
        match authority.rfind('@') {
            Some(at) => {
                out.push_str(REDACTED);
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        // Searching on after the authority keeps this linear whatever the text holds.
        rest = &after[authority_len..];
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newline_or_carriage_return_cannot_start_a_line() {
        let text = sanitize("pass failed\nFORGED level=ERROR all good\r\nmore");
        assert_eq!(
            text.as_str(),
            "pass failed\\nFORGED level=ERROR all good\\r\\nmore"
        );
        assert!(!text.as_str().contains(['\n', '\r']));
    }

    #[test]
    fn escape_and_other_controls_are_shown_escaped() {
        let text = sanitize("\x1b[31mred\x1b[0m \x07\x08\x7f \u{85}\u{9b}31m\t\0");
        assert_eq!(
            text.as_str(),
            "\\u{1b}[31mred\\u{1b}[0m \\u{7}\\u{8}\\u{7f} \\u{85}\\u{9b}31m\\t\\0"
        );
        assert!(!text.as_str().chars().any(char::is_control), "{text}");
    }

    #[test]
    fn bidi_and_format_characters_are_shown_escaped() {
        // A right-to-left override would show "txt.exe" as "exe.txt"; the others are
        // invisible, or break a line as a newline does.
        let text = sanitize("a\u{202e}txt.exe\u{2066}\u{200b}\u{feff}\u{2028}\u{2029}\u{a0}b");
        assert_eq!(
            text.as_str(),
            "a\\u{202e}txt.exe\\u{2066}\\u{200b}\\u{feff}\\u{2028}\\u{2029}\\u{a0}b"
        );
    }

    #[test]
    fn ordinary_text_quotes_and_backslashes_stay_as_they_are() {
        for text in [
            "Secret tenants/a key \"value\" is refused: clusters[c].cluster.server",
            "services \"kubernetes\" is forbidden: C:\\path 'x' ünïcödé 日本語",
        ] {
            assert_eq!(sanitize(text).as_str(), text);
        }
    }

    #[test]
    fn long_text_is_cut_with_a_marker_saying_how_much() {
        let long = format!("{}{}", "a".repeat(MAX_BYTES), "b".repeat(1024 * 1024));
        let text = sanitize(&long);
        assert_eq!(
            text.as_str(),
            format!("{}...[1048576 more bytes cut]", "a".repeat(MAX_BYTES))
        );
        // Escapes count: the cap bounds what is written, not what was read.
        let text = sanitize(&"\n".repeat(MAX_BYTES));
        assert_eq!(
            text.as_str(),
            format!(
                "{}...[{} more bytes cut]",
                "\\n".repeat(MAX_BYTES / 2),
                MAX_BYTES / 2
            )
        );
        assert_eq!(
            sanitize(&"a".repeat(MAX_BYTES)).as_str(),
            "a".repeat(MAX_BYTES)
        );
    }

    #[test]
    fn a_cut_never_splits_a_character_or_an_escape() {
        let text = Sanitized::within("ab\u{1b}cd", 4);
        assert_eq!(text.as_str(), "ab...[3 more bytes cut]");
        let text = Sanitized::within("日本語", 8);
        assert_eq!(text.as_str(), "日本...[3 more bytes cut]");
    }

    #[test]
    fn userinfo_in_a_url_never_appears() {
        assert_eq!(
            sanitize("https://user:secret@127.0.0.1:6443/api").as_str(),
            "https://***@127.0.0.1:6443/api"
        );
        // As kube's client configuration holds a kubeconfig's server.
        let server: http::Uri = "https://admin:topsecret@192.0.2.10:6443"
            .parse()
            .unwrap_or_default();
        assert_eq!(
            Sanitized::of(&server).as_str(),
            "https://***@192.0.2.10:6443/"
        );
    }

    #[test]
    fn userinfo_in_the_middle_of_an_error_message_never_appears() {
        let message = "tenant started server=https://u:p4ss;w,rd!@192.0.2.10:6443 then \
                       \"etcd://root:secret@192.0.2.11:2379\" and https://a@b:secret@h/x, \
                       no URL: user:secret@ stays";
        let text = sanitize(message);
        assert_eq!(
            text.as_str(),
            "tenant started server=https://***@192.0.2.10:6443 then \
             \"etcd://***@192.0.2.11:2379\" and https://***@h/x, no URL: user:secret@ stays"
        );
        assert!(!text.as_str().contains("p4ss"), "{text}");
    }

    #[test]
    fn userinfo_cut_by_the_cap_never_appears_in_part() {
        let message = format!("{}https://user:secret@h", "a".repeat(MAX_BYTES - 10));
        let text = sanitize(&message);
        assert!(!text.as_str().contains("sec"), "{text}");
        assert!(!text.as_str().contains("user"), "{text}");
    }

    #[test]
    fn a_text_of_many_schemes_is_read_in_linear_time() {
        // Not a timing assertion: a quadratic scan of 8 MiB would not end in any test run.
        let text = "://".repeat(8 * 1024 * 1024 / 3);
        assert!(sanitize(&text).as_str().len() < MAX_BYTES + 64);
    }
}
