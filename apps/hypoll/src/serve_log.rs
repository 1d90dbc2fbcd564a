//! `hypoll serve`'s log: one line per event on stderr, and the libraries' setting names
//! given as the flags that set them.

use tracing::field::{Field, Visit};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::registry::LookupSpan;

/// The flag that sets a `hypoll_nbd::ServerConfig` field, for the libraries' messages, which name the
/// field (a library cannot know how its user was configured).
pub fn flag_of(setting: &str) -> Option<&'static str> {
    Some(match setting {
        "exports" => "--export",
        "connections_max" => "--max-connections",
        "request_bytes_max" => "--max-request-bytes",
        "connection_bytes_max" => "--max-connection-bytes",
        "unix_mode" => "--unix-mode",
        "tls_certificates" => "--tls-certificates",
        "tls_verify_peer" => "--tls-verify-peer",
        _ => return None,
    })
}

/// `message` about `setting`, with the flag instead of the field name where the message
/// starts with it (`connections_max 0: ...` becomes `--max-connections 0: ...`), else
/// after it.
pub fn with_flag(message: &str, setting: Option<&str>) -> String {
    let Some((setting, flag)) = setting.and_then(|s| Some((s, flag_of(s)?))) else {
        return message.to_string();
    };
    match message.strip_prefix(setting) {
        Some(rest) => format!("{flag}{rest}"),
        None => format!("{flag}: {message}"),
    }
}

/// Logs every `tracing` event (the reactors', the front end's) at `level` or above to
/// stderr, one line each: `hypoll serve: `, the message, then the other fields as
/// `key=value`; a `setting` field, by which a library names the setting it enforces, is
/// written as the flag that sets it (`(--max-connections)`).
pub fn init_log(level: tracing::level_filters::LevelFilter) {
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .event_format(ServeLine)
        .init();
}

struct ServeLine;

impl<S, N> FormatEvent<S, N> for ServeLine
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let mut line = Line::default();
        event.record(&mut line);
        writeln!(writer, "hypoll serve: {}{}", line.message, line.fields)
    }
}

/// An event's message, and its other fields as they follow it.
#[derive(Default)]
struct Line {
    message: String,
    fields: String,
}

impl Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "setting" {
            match flag_of(value) {
                Some(flag) => self.fields.push_str(&format!(" ({flag})")),
                None => self.fields.push_str(&format!(" ({value})")),
            }
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.fields
                .push_str(&format!(" {}={value:?}", field.name()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn a_setting_is_named_by_its_flag() {
        assert_eq!(
            with_flag(
                "connections_max 0: expected 1 to 4096",
                Some("connections_max")
            ),
            "--max-connections 0: expected 1 to 4096"
        );
        assert_eq!(
            with_flag("exports: none given", Some("exports")),
            "--export: none given"
        );
        assert_eq!(with_flag("no such file", None), "no such file");
        assert_eq!(with_flag("odd", Some("not_a_setting")), "odd");
    }

    #[test]
    fn an_event_is_one_line_with_the_flag_of_its_setting() {
        #[derive(Clone, Default)]
        struct Captured(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Captured {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let log = Captured::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .event_format(ServeLine)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(
                setting = "connections_max",
                "peer: refused: 2 connections are open"
            );
            tracing::warn!(core = 3, "I/O timed out; aborting it");
        });
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            text,
            "hypoll serve: peer: refused: 2 connections are open (--max-connections)\n\
             hypoll serve: I/O timed out; aborting it core=3\n"
        );
    }
}
