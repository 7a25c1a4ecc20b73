//! A small logger for the [`log`] facade, writing to stderr: what `candle-run` and the
//! examples install, so that the library's messages (rendezvous progress, DDP's report of
//! parameters without a gradient) show by default.
//!
//! The library itself only talks through `log`'s macros and never installs a logger: a
//! program that has its own (`env_logger`, `tracing-subscriber`'s `log` bridge, …) keeps it,
//! and gets our messages there. A program without one calls [`init`] once, first thing in
//! `main`.
//!
//! The level is `info` unless `RUST_LOG` says otherwise, with `env_logger`'s syntax for the
//! common cases: comma-separated directives, each a level (`warn`), a target with a level
//! (`candle_parallel::ddp=debug`), or a bare target (all its levels). The most specific target
//! that matches a message decides.
//!
//! ```rust
//! candle_parallel::logging::init();
//! log::info!("shown: the default level is info");
//! log::debug!("not shown unless RUST_LOG asks for debug");
//! ```

use log::{LevelFilter, Log, Metadata, Record};
use std::io::Write;
use std::sync::OnceLock;

/// The environment variable that sets the levels (`env_logger`'s).
pub const ENV_VAR: &str = "RUST_LOG";

/// Installs the stderr logger, with the levels `RUST_LOG` sets (default `info`). Does nothing
/// when the program already installed a logger, so that calling it twice (or after one's own)
/// is harmless.
pub fn init() {
    let spec = std::env::var(ENV_VAR).unwrap_or_default();
    let filter = FILTER.get_or_init(|| Filter::parse(&spec));
    if log::set_logger(&StderrLogger).is_ok() {
        log::set_max_level(filter.max_level());
    }
}

static FILTER: OnceLock<Filter> = OnceLock::new();

/// Which messages pass: a default level and levels per target.
#[derive(Debug, PartialEq)]
struct Filter {
    default: LevelFilter,
    /// (target, level), longest target first.
    targets: Vec<(String, LevelFilter)>,
}

impl Filter {
    /// Parses `RUST_LOG`'s value; directives it cannot read are ignored, with a line saying so.
    fn parse(spec: &str) -> Self {
        let mut default = LevelFilter::Info;
        let mut targets = Vec::new();
        for directive in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            match directive.split_once('=') {
                Some((target, level)) => match level.trim().parse::<LevelFilter>() {
                    Ok(level) => targets.push((target.trim().to_string(), level)),
                    Err(_) => eprintln!(
                        "candle-parallel: ignoring `{directive}` in {ENV_VAR}: `{level}` is not \
                         a level (off, error, warn, info, debug, trace)"
                    ),
                },
                None => match directive.parse::<LevelFilter>() {
                    Ok(level) => default = level,
                    // A bare target: everything it says.
                    Err(_) => targets.push((directive.to_string(), LevelFilter::Trace)),
                },
            }
        }
        targets.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        Self { default, targets }
    }

    /// The level for messages of `target`.
    fn level(&self, target: &str) -> LevelFilter {
        self.targets
            .iter()
            .find(|(t, _)| {
                target
                    .strip_prefix(t.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
            })
            .map_or(self.default, |(_, level)| *level)
    }

    /// The most verbose level any target gets.
    fn max_level(&self) -> LevelFilter {
        self.targets
            .iter()
            .map(|(_, level)| *level)
            .fold(self.default, std::cmp::max)
    }
}

/// Writes `LEVEL target: message` lines to stderr.
struct StderrLogger;

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        FILTER
            .get()
            .is_some_and(|f| metadata.level() <= f.level(metadata.target()))
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        // One write per line, so that lines of several threads do not mix.
        let line = format!(
            "{} {}: {}\n",
            record.level(),
            record.target(),
            record.args()
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {
        let _ = std::io::stderr().flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_rust_log_shows_info_and_above() {
        let f = Filter::parse("");
        assert_eq!(f.level("candle_parallel::ddp"), LevelFilter::Info);
        assert_eq!(f.max_level(), LevelFilter::Info);
    }

    #[test]
    fn the_most_specific_target_decides_and_only_at_a_module_boundary() {
        let f = Filter::parse("warn, candle_parallel=debug ,candle_parallel::ddp=error,my_app");
        assert_eq!(f.level("candle_parallel::ddp::reducer"), LevelFilter::Error);
        assert_eq!(f.level("candle_parallel::distributed"), LevelFilter::Debug);
        assert_eq!(f.level("candle_parallel"), LevelFilter::Debug);
        assert_eq!(f.level("candle_parallelism"), LevelFilter::Warn);
        assert_eq!(f.level("my_app::train"), LevelFilter::Trace);
        assert_eq!(f.level("other"), LevelFilter::Warn);
        assert_eq!(f.max_level(), LevelFilter::Trace);
    }

    #[test]
    fn off_silences_and_a_bad_level_is_ignored() {
        let f = Filter::parse("off,candle_parallel=loud");
        assert_eq!(f.level("candle_parallel"), LevelFilter::Off);
        assert_eq!(f.max_level(), LevelFilter::Off);
    }
}
