//! The error file: how a rank tells its launcher why it failed.
//!
//! Two launchers read one:
//! - `candle-run` (and `launch::spawn`) gives each rank a file in [`ERROR_FILE_VAR`]: the time
//!   in nanoseconds and the message; a rank whose process group broke because a peer was lost
//!   notes that beside it (`.lost`), so that when several ranks fail the launcher reports the
//!   one that failed first, not those that lost it;
//! - torchrun gives each worker a file in [`TORCH_ERROR_FILE_VAR`] (`TORCHELASTIC_ERROR_FILE`)
//!   and reads it as torch's `ErrorHandler` writes it: JSON, `{"message": {"message": ...,
//!   "extraInfo": {"py_callstack": ..., "timestamp": "<seconds>"}}}`. Its summary names as
//!   the root cause the failed worker with the earliest timestamp (a worker without a file
//!   counts from when torchrun saw it end; ties go to the lowest rank). So a rank that failed
//!   because it lost a peer records its failure [`CONSEQUENCE_DELAY`] late, and says so: the
//!   peer it lost, which failed first, is named.
//!
//! [`record_error`] writes both when their variables are set; `launch::spawn` calls it for
//! its ranks, other programs may call it before exiting with an error. The backends note a
//! lost peer (`note_loss`) as soon as they see it. Outside a launcher both do nothing.
//!
//! ```
//! # fn main() -> std::io::Result<()> {
//! let file = std::env::temp_dir().join(format!("doc-error-{}.json", std::process::id()));
//! std::env::set_var("TORCHELASTIC_ERROR_FILE", &file);
//! candle_parallel::distributed::error_file::record_error(&"the data set is empty");
//! let json = std::fs::read_to_string(&file)?;
//! assert!(json.starts_with(r#"{"message": {"message": "the data set is empty""#), "{json}");
//! std::fs::remove_file(file)
//! # }
//! ```

use std::fmt::Display;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The environment variable naming the file where a rank records why it failed for
/// `candle-run`.
pub const ERROR_FILE_VAR: &str = "CANDLE_PARALLEL_ERROR_FILE";

/// torchrun's variable naming the file where a worker records why it failed (JSON, as torch's
/// `ErrorHandler` writes it).
pub const TORCH_ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// How much later than it happened a rank that lost a peer dates its failure in torchrun's
/// error file: more than torchrun's timestamps (whole seconds) and its polling (0.1 s) can
/// blur, so that the peer that failed first keeps the earliest time.
pub const CONSEQUENCE_DELAY: Duration = Duration::from_secs(5);

/// The first peer this process's group lost, and when.
struct Loss {
    what: String,
    at: Duration,
}

static LOSS: OnceLock<Loss> = OnceLock::new();

fn now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// A path from `var`, when set and not empty (torchrun sets it empty without a log folder).
fn path_in(var: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(var).filter(|p| !p.is_empty())
}

/// Records `error` for the launcher, when this process is a rank started by one (`candle-run`
/// or torchrun), so that when several ranks fail the launcher can report the one that failed
/// first. `launch::spawn` does this for its ranks; other programs may call it before exiting
/// with an error. Does nothing outside a launcher.
pub fn record_error(error: &dyn Display) {
    if let Some(path) = path_in(ERROR_FILE_VAR) {
        write_whole(path, format!("{}\n{error}", now().as_nanos()));
    }
    if path_in(TORCH_ERROR_FILE_VAR).is_some() {
        let at = LOSS.get().map_or_else(now, |loss| loss.at);
        write_torch(&error.to_string(), at);
    }
}

/// Notes, for the launcher, that this rank's process group broke because it lost `rank` (or
/// for another reason, `None`), as `detail` says: a failure of this rank is then a
/// consequence, not the cause. The first note wins.
pub(crate) fn note_loss(rank: Option<usize>, detail: &str) {
    if let Some(path) = path_in(ERROR_FILE_VAR) {
        let mut path = path;
        path.push(".lost");
        let note = rank.map_or_else(|| "?".to_string(), |r| r.to_string());
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, note.as_bytes()));
    }
    let what = match rank {
        Some(r) => format!("lost rank {r}: {detail}"),
        None => format!("saw its process group break: {detail}"),
    };
    let loss = Loss {
        what,
        at: now() + CONSEQUENCE_DELAY,
    };
    if LOSS.set(loss).is_ok() && path_in(TORCH_ERROR_FILE_VAR).is_some() {
        // Written now: a program that ends without calling `record_error` still tells
        // torchrun why.
        let loss = LOSS.get().expect("just set");
        write_torch(&format!("this rank {}", loss.what), loss.at);
    }
}

/// Writes torchrun's error file: `message`, dated `at` (seconds since the epoch). A note on
/// the delay goes with a consequence's message.
fn write_torch(message: &str, at: Duration) {
    let Some(path) = path_in(TORCH_ERROR_FILE_VAR) else {
        return;
    };
    let late = LOSS.get().is_some_and(|l| l.at == at);
    let mut shown = format!("{message}\n");
    if late {
        shown.push_str(&format!(
            "(this record is dated {} s after the loss, so that torchrun names the rank that \
             failed first as the root cause)\n",
            CONSEQUENCE_DELAY.as_secs()
        ));
    }
    let json = format!(
        r#"{{"message": {{"message": {}, "extraInfo": {{"py_callstack": {}, "timestamp": "{}"}}}}}}"#,
        json_string(message),
        json_string(&shown),
        at.as_secs()
    );
    write_whole(path, json);
}

/// Writes `text` to `path` whole or not at all (a file beside it, renamed over it): the
/// launcher may read it the moment this process ends, which may be while another of its
/// threads writes.
fn write_whole(path: std::ffi::OsString, text: String) {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut part = path.clone();
    part.push(format!(".part-{}-{n}", std::process::id()));
    if std::fs::write(&part, text).is_ok() {
        let _ = std::fs::rename(&part, &path);
    } else {
        let _ = std::fs::remove_file(&part);
    }
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::json_string;

    #[test]
    fn strings_are_escaped_as_json_wants() {
        assert_eq!(json_string("a\"b\\c\nd\u{1}é"), r#""a\"b\\c\nd\u0001é""#);
    }
}
