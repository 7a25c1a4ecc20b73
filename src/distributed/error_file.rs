//! The error file: how a rank tells the launcher why it failed (torchrun's
//! `TORCHELASTIC_ERROR_FILE`).
//!
//! A launcher (`candle-run`, `launch::spawn`) gives each rank a file name in
//! [`ERROR_FILE_VAR`]. A rank that fails writes its error there ([`record_error`]), and a rank
//! whose process group broke because a peer was lost notes that first (`note_loss`), so that
//! when several ranks fail the launcher reports the one that failed first, not those that lost
//! it. Outside a launcher both do nothing.

/// The environment variable naming the file where a rank records why it failed.
pub const ERROR_FILE_VAR: &str = "CANDLE_PARALLEL_ERROR_FILE";

/// Records `error` for the launcher, when this process is a rank started by one, so that when
/// several ranks fail the launcher can report the one that failed first. `launch::spawn` does
/// this for its ranks; other programs may call it before exiting with an error. Does nothing
/// outside a launcher.
pub fn record_error(error: &dyn std::fmt::Display) {
    if let Some(path) = std::env::var_os(ERROR_FILE_VAR) {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let _ = std::fs::write(path, format!("{nanos}\n{error}"));
    }
}

/// Notes, for the launcher, that this rank's process group broke because it lost `rank` (or
/// for another reason, `None`): a failure of this rank is then a consequence, not the cause.
/// The first note wins.
pub(crate) fn note_loss(rank: Option<usize>) {
    if let Some(path) = std::env::var_os(ERROR_FILE_VAR) {
        let mut path = path;
        path.push(".lost");
        let note = rank.map_or_else(|| "?".to_string(), |r| r.to_string());
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, note.as_bytes()));
    }
}
