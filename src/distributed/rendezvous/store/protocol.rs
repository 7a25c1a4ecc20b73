//! The store's protocol, which its client and server share: bounds, request and reply codes,
//! the keys and refusals both sides know, and how requests are encoded.

use crate::distributed::transport::wire::put_bytes;
use crate::error::{Error, Result};
use std::time::Duration;

/// The key where the store notes the last refused connection: the server writes it, a client
/// reads it to explain a wait that ran out.
pub(crate) const REFUSED_KEY: &str = "refused";

/// The refusal a client retries: the store is going away, the next job's is coming.
pub(crate) const SHUTTING_DOWN: &str = "the store at this address is shutting down";

/// The refusal a client retries: strangers hold every place for a handshake just now.
pub(crate) const BUSY: &str =
    "the store at this address is busy with other connections' handshakes";

/// How long a client retries a program that accepts its connections and closes them without
/// a word. The store always answers before it closes (accepted, refused, [`SHUTTING_DOWN`],
/// [`BUSY`]); only a connection caught as the store stops (or one it has no thread for) is
/// closed unanswered, and the next one is then refused. So a run of such closes this long is
/// another program's doing.
pub(crate) const HANG_UP_LIMIT: Duration = Duration::from_secs(5);

/// Whether a client should try again after the store refused it for `reason`.
pub(crate) fn worth_retrying(reason: &str) -> bool {
    reason.starts_with(SHUTTING_DOWN) || reason.starts_with(BUSY)
}

pub(crate) const MAX_KEY: usize = 4096;
pub(crate) const MAX_VALUE: usize = 64 << 20;
pub(crate) const MAX_KEYS: usize = 1 << 16;
/// How long a connecting client may take to say hello.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) const SET: u8 = 1;
pub(crate) const GET: u8 = 2;
pub(crate) const ADD: u8 = 3;
pub(crate) const WAIT: u8 = 4;
pub(crate) const COMPARE_SET: u8 = 5;
pub(crate) const DELETE: u8 = 6;

pub(crate) const OK: u8 = 0;
pub(crate) const TIMED_OUT: u8 = 1;

pub(crate) fn millis(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

pub(crate) fn put_key(req: &mut Vec<u8>, key: &str) -> Result<()> {
    if key.len() > MAX_KEY {
        return Err(Error::InvalidArgument {
            what: "store key",
            detail: format!("{} bytes; keys are at most {MAX_KEY} bytes", key.len()),
        });
    }
    put_bytes(req, key.as_bytes());
    Ok(())
}

pub(crate) fn put_value(req: &mut Vec<u8>, value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE {
        return Err(Error::InvalidArgument {
            what: "store value",
            detail: format!(
                "{} bytes; values are at most {MAX_VALUE} bytes",
                value.len()
            ),
        });
    }
    put_bytes(req, value);
    Ok(())
}
