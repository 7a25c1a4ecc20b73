//! PyTorch's TCPStore wire protocol (torch ≥ 2.2, the version torchrun's agent serves), as its
//! client speaks it (`torch/csrc/distributed/c10d/TCPStore.cpp`; the query codes are
//! `c10d::detail::QueryType` in `TCPStoreBackend.hpp`, served alike by the libuv backend,
//! torch's default, and the older one).
//!
//! A connection opens with `VALIDATE` and a magic number, which gets no answer. Each request
//! is then a query code followed by its arguments, little-endian: a key or value is a `u64`
//! length and its bytes, a count is a `u64`. Answers carry no status: `GET`, `COMPARE_SET` and
//! `MULTI_GET` answer with values, `ADD` and `DELETE_KEY` with an `i64`, `CHECK` with a byte
//! (`READY` or `NOT_READY`), `WAIT` with a byte once every key exists (`STOP_WAITING`), and
//! `SET`/`MULTI_SET` with nothing. A wait has no timeout of its own: the client ends it with
//! `CANCEL_WAIT`, which answers `WAIT_CANCELED` (after a `STOP_WAITING` if the keys arrived
//! first). Counters are kept as decimal text. torch's clients put `/` before every key, so
//! ours do too: a key set here reads the same from Python's `TCPStore`.

use crate::error::{Error, Result};
use std::io::Read;

/// The answer-less first request of every connection.
pub(crate) const VALIDATE: u8 = 0;
pub(crate) const SET: u8 = 1;
pub(crate) const COMPARE_SET: u8 = 2;
pub(crate) const GET: u8 = 3;
pub(crate) const ADD: u8 = 4;
pub(crate) const CHECK: u8 = 5;
pub(crate) const WAIT: u8 = 6;
pub(crate) const DELETE_KEY: u8 = 8;
pub(crate) const MULTI_GET: u8 = 10;
pub(crate) const MULTI_SET: u8 = 11;
pub(crate) const CANCEL_WAIT: u8 = 12;

/// `VALIDATE`'s argument (`c10d::detail::validationMagicNumber`).
pub(crate) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// `CHECK`'s answers.
pub(crate) const READY: u8 = 0;
pub(crate) const NOT_READY: u8 = 1;

/// `WAIT`'s and `CANCEL_WAIT`'s answers.
pub(crate) const STOP_WAITING: u8 = 0;
pub(crate) const WAIT_CANCELED: u8 = 1;

/// The prefix torch's TCPStore client puts before every key (`TCPStore::keyPrefix_`).
pub(crate) const KEY_PREFIX: &str = "/";

/// The libuv server's limits (`MAX_STRING_LEN`, `MAX_PAYLOAD_LEN`, `MAX_KEY_COUNT`): a request
/// beyond them makes it close the connection, so they are refused here with a reason first.
pub(crate) const MAX_KEY: usize = 8 * 1024;
pub(crate) const MAX_VALUE: usize = 8 << 20;
pub(crate) const MAX_KEYS: usize = 128 * 1024;

/// A request being built.
pub(crate) struct Request(Vec<u8>);

impl Request {
    pub fn new(query: u8) -> Self {
        Self(vec![query])
    }

    /// The connection's opening: `VALIDATE` and the magic number.
    pub fn validate() -> Self {
        let mut r = Self::new(VALIDATE);
        r.0.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        r
    }

    /// Appends a key, with torch's client prefix.
    pub fn key(mut self, key: &str) -> Result<Self> {
        let len = KEY_PREFIX.len() + key.len();
        if len > MAX_KEY {
            return Err(Error::InvalidArgument {
                what: "store key",
                detail: format!("{len} bytes; torch's TCPStore takes keys of at most {MAX_KEY}"),
            });
        }
        self.0.extend_from_slice(&(len as u64).to_le_bytes());
        self.0.extend_from_slice(KEY_PREFIX.as_bytes());
        self.0.extend_from_slice(key.as_bytes());
        Ok(self)
    }

    /// Appends a value.
    pub fn value(mut self, value: &[u8]) -> Result<Self> {
        if value.len() > MAX_VALUE {
            return Err(Error::InvalidArgument {
                what: "store value",
                detail: format!(
                    "{} bytes; torch's TCPStore takes values of at most {MAX_VALUE}",
                    value.len()
                ),
            });
        }
        self.0
            .extend_from_slice(&(value.len() as u64).to_le_bytes());
        self.0.extend_from_slice(value);
        Ok(self)
    }

    /// Appends a count of keys (or key-value pairs) to follow.
    pub fn count(mut self, n: usize) -> Result<Self> {
        if n > MAX_KEYS {
            return Err(Error::InvalidArgument {
                what: "store keys",
                detail: format!("{n} in one request; torch's TCPStore takes at most {MAX_KEYS}"),
            });
        }
        self.0.extend_from_slice(&(n as u64).to_le_bytes());
        Ok(self)
    }

    /// Appends an `i64` (`ADD`'s amount).
    pub fn int(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Reads a value (a `u64` length and the bytes).
pub(crate) fn read_value(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_VALUE as u64 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a value of {len} bytes, above torch's limit of {MAX_VALUE}"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Reads an `i64` answer.
pub(crate) fn read_int(r: &mut impl Read) -> std::io::Result<i64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

/// Reads a one-byte answer that must be one of `expected`.
pub(crate) fn read_code(r: &mut impl Read, expected: &[u8], what: &str) -> std::io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    if expected.contains(&b[0]) {
        Ok(b[0])
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{what} answered {}, expected one of {expected:?}", b[0]),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_framed_as_torchs_client_frames_them() {
        // SET "/k" = "v": code, u64 length of the prefixed key, the key, u64 length, the value.
        let r = Request::new(SET).key("k").unwrap().value(b"v").unwrap();
        let mut want = vec![1u8];
        want.extend_from_slice(&2u64.to_le_bytes());
        want.extend_from_slice(b"/k");
        want.extend_from_slice(&1u64.to_le_bytes());
        want.push(b'v');
        assert_eq!(r.bytes(), want);
        let v = Request::validate();
        assert_eq!(v.bytes(), [0, 0xCE, 0xF7, 0x85, 0x3C]);
        let add = Request::new(ADD).key("").unwrap().int(-2);
        assert_eq!(&add.bytes()[10..], (-2i64).to_le_bytes());
    }

    #[test]
    fn oversized_requests_and_answers_are_refused_with_the_limit() {
        let long = "k".repeat(MAX_KEY);
        let err = Request::new(GET).key(&long).err().unwrap().to_string();
        assert!(err.contains("8192"), "{err}");
        let err = Request::new(CHECK).count(MAX_KEYS + 1).err().unwrap();
        assert!(err.to_string().contains("131072"), "{err}");
        let mut huge = (u64::MAX).to_le_bytes().to_vec();
        huge.extend_from_slice(b"...");
        let err = read_value(&mut huge.as_slice()).unwrap_err();
        assert!(err.to_string().contains("above torch's limit"), "{err}");
        let err = read_code(&mut [7u8].as_slice(), &[READY, NOT_READY], "CHECK").unwrap_err();
        assert!(err.to_string().contains("CHECK answered 7"), "{err}");
    }
}
