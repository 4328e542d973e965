//! Both log formats with every value escaped and capped.
//!
//! tracing's text formatter writes a field given by its `Display` (`error = %err`) and the
//! message as they are, so a newline in an API's error forges a log line of its own and an ESC
//! sequence reaches whoever reads the log in a terminal. Its JSON formatter escapes what JSON
//! must (C0 controls, quotes), but passes C1 controls, bidi characters, a URL's userinfo and a
//! megabyte-long message on. The reports that carry a tenant's text sanitize it where they take
//! it in ([`reconcilers::sanitize`]); these hold the same for every other line (a loop's own
//! warning with an API error in it, a library's): [`EscapedFields`] for the text format,
//! [`SanitizedJson`] for the JSON one.

use std::fmt;
use std::io;

use reconcilers::sanitize::Sanitized;
use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FormatFields, MakeWriter};

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

/// The JSON format's writer: each line's strings through [`Sanitized`] (capped at
/// [`MAX_FIELD_BYTES`]) before they reach `M`'s writer. A line with nothing to change is written
/// as it came, in its own key order.
#[derive(Clone, Debug)]
pub struct SanitizedJson<M>(pub M);

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for SanitizedJson<M> {
    type Writer = JsonLine<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        JsonLine {
            inner: self.0.make_writer(),
            line: Vec::new(),
        }
    }
}

/// One event's JSON line: tracing writes it whole, then drops the writer, which writes it on.
pub struct JsonLine<W: io::Write> {
    inner: W,
    line: Vec<u8>,
}

impl<W: io::Write> io::Write for JsonLine<W> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.line.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<W: io::Write> Drop for JsonLine<W> {
    fn drop(&mut self) {
        let line = sanitized_json(&self.line);
        // Nowhere to report a log that cannot be written.
        let _ = self
            .inner
            .write_all(&line)
            .and_then(|()| self.inner.flush());
    }
}

/// `bytes` (JSON lines) with every string sanitized; what is not JSON is sanitized as text.
fn sanitized_json(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len().min(4 * MAX_FIELD_BYTES));
    for line in bytes.split_inclusive(|byte| *byte == b'\n') {
        let text = line.strip_suffix(b"\n").unwrap_or(line);
        match serde_json::from_slice::<serde_json::Value>(text) {
            Ok(mut value) => {
                let lifted = lift_span_fields(&mut value);
                if sanitize_strings(&mut value) | lifted {
                    if serde_json::to_writer(&mut out, &value).is_err() {
                        out.extend_from_slice(b"{}");
                    }
                } else {
                    out.extend_from_slice(text);
                }
            }
            Err(_) => out.extend_from_slice(
                Sanitized::within(&String::from_utf8_lossy(text), MAX_FIELD_BYTES)
                    .as_str()
                    .as_bytes(),
            ),
        }
        out.push(b'\n');
    }
    out
}

/// The span fields a reader filters on, lifted to the line's top level: a loop's lines and a
/// tenant's are found by `.loop` and `.tenant`, wherever tracing nested the span that names them.
const LIFTED_SPAN_FIELDS: [&str; 2] = ["loop", "tenant"];

/// Copies [`LIFTED_SPAN_FIELDS`] from the innermost span that has each to the top level, where
/// tracing writes no key of those names; whether any was copied.
fn lift_span_fields(value: &mut serde_json::Value) -> bool {
    let Some(line) = value.as_object_mut() else {
        return false;
    };
    let mut lifted = false;
    for key in LIFTED_SPAN_FIELDS {
        let found = (line.get("spans").and_then(serde_json::Value::as_array))
            .and_then(|spans| spans.iter().rev().find_map(|span| span.get(key)))
            .cloned();
        if let Some(found) = found
            && !line.contains_key(key)
        {
            line.insert(key.to_owned(), found);
            lifted = true;
        }
    }
    lifted
}

/// Sanitizes every string in `value`; whether any changed.
fn sanitize_strings(value: &mut serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(text) => {
            let sanitized = Sanitized::within(text, MAX_FIELD_BYTES);
            let changed = sanitized.as_str() != text.as_str();
            if changed {
                *text = sanitized.into_string();
            }
            changed
        }
        serde_json::Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, item| sanitize_strings(item) | changed),
        serde_json::Value::Object(fields) => fields
            .values_mut()
            .fold(false, |changed, field| sanitize_strings(field) | changed),
        _ => false,
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

    fn logged_json(log: impl FnOnce()) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(SanitizedJson(move || writer.clone()))
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        String::from_utf8(captured.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn json_lines_keep_no_c1_or_bidi_character_no_userinfo_and_no_megabyte() {
        let status = format!(
            "boom\nFORGED\u{9b}31m\u{202e} https://u:topsecret@h/ {}",
            "x".repeat(1024 * 1024)
        );
        let output = logged_json(|| {
            tracing::warn!(error = %status, "pass failed: {status}");
            tracing::info!(tenant = "t/a", "quiet");
        });
        let lines: Vec<&str> = output.lines().collect();
        assert_eq!(lines.len(), 2, "{output:.2000}");
        let event: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        let error = event["fields"]["error"].as_str().unwrap();
        assert!(
            error.starts_with("boom\\nFORGED\\u{9b}31m\\u{202e} https://***@h/ xxx"),
            "{error:.300}"
        );
        assert!(error.len() < MAX_FIELD_BYTES + 64, "{}", error.len());
        assert!(!lines[0].contains("topsecret"), "{:.300}", lines[0]);
        assert!(
            !lines[0].contains(['\u{9b}', '\u{202e}']),
            "{:.300}",
            lines[0]
        );
        // A line with nothing to change keeps its own order: the timestamp first.
        assert!(lines[1].starts_with("{\"timestamp\":"), "{}", lines[1]);
        assert!(lines[1].contains("\"tenant\":\"t/a\""), "{}", lines[1]);
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

    /// Fails on a JSON object that holds one key twice anywhere (serde_json's `Value` keeps the
    /// last, which is how a loop's name got lost behind the span's own name).
    fn assert_no_repeated_key(line: &str) {
        use serde::Deserialize;
        use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
        struct Checked;
        impl<'de> Visitor<'de> for Checked {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("JSON")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
                let mut seen = std::collections::BTreeSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(serde::de::Error::custom(format!("key {key:?} repeated")));
                    }
                    map.next_value::<Checked>()?;
                }
                Ok(())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
                while seq.next_element::<Checked>()?.is_some() {}
                Ok(())
            }
            fn visit_str<E>(self, _: &str) -> Result<(), E> {
                Ok(())
            }
            fn visit_bool<E>(self, _: bool) -> Result<(), E> {
                Ok(())
            }
            fn visit_i64<E>(self, _: i64) -> Result<(), E> {
                Ok(())
            }
            fn visit_u64<E>(self, _: u64) -> Result<(), E> {
                Ok(())
            }
            fn visit_f64<E>(self, _: f64) -> Result<(), E> {
                Ok(())
            }
            fn visit_unit<E>(self) -> Result<(), E> {
                Ok(())
            }
        }
        impl<'de> serde::Deserialize<'de> for Checked {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any(Checked).map(|()| Checked)
            }
        }
        let mut de = serde_json::Deserializer::from_str(line);
        if let Err(err) = Checked::deserialize(&mut de) {
            panic!("{err} in {line}");
        }
    }

    #[test]
    fn json_lines_name_the_loop_and_tenant_without_repeated_keys() {
        let json = logged_json(|| {
            let tenant = tracing::info_span!("tenant", tenant = %"ns/a");
            let _tenant = tenant.enter();
            let span = tracing::info_span!("loop", r#loop = "system-namespaces");
            let _entered = span.enter();
            tracing::info!(name = "kube-public", "repaired");
        });
        let line = json.lines().next().unwrap();
        assert_no_repeated_key(line);
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(value["span"]["loop"], "system-namespaces", "{line}");
        assert_eq!(value["spans"][0]["tenant"], "ns/a", "{line}");
        // And at the top level, where a reader filters on them.
        assert_eq!(value["loop"], "system-namespaces", "{line}");
        assert_eq!(value["tenant"], "ns/a", "{line}");
        // The check itself can fail.
        let caught = std::panic::catch_unwind(|| assert_no_repeated_key(r#"{"a":{"b":1,"b":2}}"#));
        assert!(caught.is_err());
    }
}
