//! The fields of the text log format, each value escaped and capped.
//!
//! tracing's text formatter writes a field given by its `Display` (`error = %err`) and the
//! message as they are, so a newline in an API's error forges a log line of its own and an ESC
//! sequence reaches whoever reads the log in a terminal (the JSON format escapes both). The
//! reports that carry a tenant's text sanitize it where they take it in
//! ([`reconcilers::sanitize`]); this formatter holds the same for every other line (a loop's
//! own warning with an API error in it, a library's), so no log line in text format spans two
//! lines, holds a control character or a URL's userinfo, or grows without bound.

use std::fmt;

use reconcilers::sanitize::Sanitized;
use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;

/// The most bytes of one field's value in a log line: longer than any message the controller
/// composes (lists of tenants included), far shorter than what an API may send.
pub const MAX_FIELD_BYTES: usize = 4096;

/// The text format's field formatter: `message name=value ...`, as tracing's default one
/// writes them, each value through [`Sanitized`].
#[derive(Clone, Copy, Debug, Default)]
pub struct EscapedFields;

impl<'writer> FormatFields<'writer> for EscapedFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = Visitor {
            writer,
            result: Ok(()),
            first: true,
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct Visitor<'writer> {
    writer: Writer<'writer>,
    result: fmt::Result,
    first: bool,
}

impl Visitor<'_> {
    fn write(&mut self, field: &Field, value: &str) {
        let name = field.name();
        // The `log` crate's metadata, which the event's own header already shows.
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        let separator = if self.first { "" } else { " " };
        self.first = false;
        let value = Sanitized::within(value, MAX_FIELD_BYTES);
        self.result = match name {
            "message" => write!(self.writer, "{separator}{value}"),
            name => {
                let name = name.strip_prefix("r#").unwrap_or(name);
                write!(self.writer, "{separator}{name}={value}")
            }
        };
    }
}

impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.write(field, value);
        } else {
            self.write(field, &format!("{value:?}"));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.write(field, &value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.write(field, &format!("{value:?}"));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn logged(log: impl FnOnce()) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(EscapedFields)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        String::from_utf8(captured.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn a_hostile_field_or_message_stays_on_its_line_without_controls() {
        let status = format!(
            "boom\nFORGED level=ERROR all good\r\x1b[31mred\u{202e} https://u:topsecret@h/ {}",
            "x".repeat(1024 * 1024)
        );
        let output = logged(|| {
            let span = tracing::info_span!("tenant", tenant = %"t/a\nFORGED");
            let _entered = span.enter();
            tracing::warn!(error = %status, reason = "deleted", "pass failed: {status}");
        });
        let lines: Vec<&str> = output.lines().collect();
        assert_eq!(lines.len(), 1, "{output:.2000}");
        let line = lines[0];
        assert!(line.contains("pass failed: boom\\nFORGED"), "{line:.300}");
        assert!(
            line.contains(" error=boom\\nFORGED level=ERROR all good\\r\\u{1b}[31mred\\u{202e}")
        );
        assert!(line.contains("tenant=t/a\\nFORGED"), "{line:.300}");
        assert!(line.contains(" reason=\"deleted\""), "{line:.300}");
        assert!(!line.contains("topsecret"), "{line:.300}");
        assert!(!line.chars().any(char::is_control), "{line:.300}");
        assert!(line.len() < 3 * (MAX_FIELD_BYTES + 64), "{}", line.len());
    }
}
