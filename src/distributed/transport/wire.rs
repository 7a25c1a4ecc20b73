//! The bytes on our sockets: bounded reads, the connection handshake, and frame headers.
//!
//! Every connection, to the store or between peers, opens with a [`Hello`] carrying the job
//! token (`CANDLE_PARALLEL_TOKEN`); a connection with another token, or one that is not ours at
//! all, is answered with a refusal and closed. Every length read from a socket is checked
//! against a bound before anything is allocated. The token keeps stray connections (another
//! job, a port scanner) out; it is not a defence against an attacker who can read the network.

use crate::error::Error;
use std::io::{Read, Write};

const MAGIC: &[u8; 4] = b"CPAR";
/// The reply's first bytes, so that a client tells our store or peer from another program.
const REPLY_MAGIC: &[u8; 4] = b"CPRE";
const VERSION: u16 = 2;
/// Connections between accept and an accepted hello, at most, per listener: strangers cannot
/// hold more threads and descriptors than this.
pub(crate) const MAX_HANDSHAKES: usize = 32;
/// The longest token accepted.
pub(crate) const MAX_TOKEN: usize = 1024;
/// The longest message in a refusal or an abort.
pub(crate) const MAX_TEXT: usize = 64 * 1024;
/// The largest frame payload between peers.
pub(crate) const MAX_FRAME: usize = 64 << 20;

/// What a connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    Store = 1,
    Peer = 2,
}

/// The first message on every connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub purpose: Purpose,
    pub token: String,
    /// The job's id, from the store (0 on store connections).
    pub job: u64,
    pub from_rank: u32,
    pub to_rank: u32,
    pub world_size: u32,
}

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

pub(crate) fn read_u8(r: &mut impl Read) -> std::io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub(crate) fn read_u16(r: &mut impl Read) -> std::io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_le_bytes(b))
}

pub(crate) fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub(crate) fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Reads a length, refusing it when it exceeds `max`.
pub(crate) fn read_len(r: &mut impl Read, max: usize, what: &str) -> std::io::Result<usize> {
    let len = read_u32(r)? as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{what} of {len} bytes exceeds the limit of {max}"),
        ));
    }
    Ok(len)
}

/// Reads a length-prefixed byte string of at most `max` bytes.
pub(crate) fn read_bytes(r: &mut impl Read, max: usize, what: &str) -> std::io::Result<Vec<u8>> {
    let len = read_len(r, max, what)?;
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Reads a length-prefixed UTF-8 string of at most `max` bytes.
pub(crate) fn read_string(r: &mut impl Read, max: usize, what: &str) -> std::io::Result<String> {
    String::from_utf8(read_bytes(r, max, what)?).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{what} is not UTF-8"),
        )
    })
}

pub(crate) fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(bytes);
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(32 + self.token.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.push(self.purpose as u8);
        put_bytes(&mut b, self.token.as_bytes());
        b.extend_from_slice(&self.job.to_le_bytes());
        b.extend_from_slice(&self.from_rank.to_le_bytes());
        b.extend_from_slice(&self.to_rank.to_le_bytes());
        b.extend_from_slice(&self.world_size.to_le_bytes());
        b
    }

    /// Reads a hello; the error says why the bytes are not one of ours.
    pub fn read(r: &mut impl Read) -> std::io::Result<Self> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let mut magic = [0u8; 4];
        r.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(bad("not a candle-parallel connection (bad magic)".into()));
        }
        let version = read_u16(r)?;
        if version != VERSION {
            return Err(bad(format!(
                "protocol version {version}, expected {VERSION}: all ranks must run the same \
                 candle-parallel version"
            )));
        }
        let purpose = match read_u8(r)? {
            1 => Purpose::Store,
            2 => Purpose::Peer,
            p => return Err(bad(format!("unknown connection purpose {p}"))),
        };
        Ok(Self {
            purpose,
            token: read_string(r, MAX_TOKEN, "token")?,
            job: read_u64(r)?,
            from_rank: read_u32(r)?,
            to_rank: read_u32(r)?,
            world_size: read_u32(r)?,
        })
    }
}

/// Compares tokens in time independent of where they differ.
pub(crate) fn token_matches(expected: &str, got: &str) -> bool {
    let (a, b) = (expected.as_bytes(), got.as_bytes());
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// Answers a hello: accepted, or refused with the reason.
pub(crate) fn write_reply(w: &mut impl Write, refusal: Option<&str>) -> std::io::Result<()> {
    let mut b = REPLY_MAGIC.to_vec();
    b.push(u8::from(refusal.is_some()));
    put_bytes(&mut b, refusal.unwrap_or("").as_bytes());
    w.write_all(&b)?;
    w.flush()
}

/// Why a handshake did not give an answer.
#[derive(Debug)]
pub(crate) enum NoAnswer {
    /// The connection closed or was reset before the answer: the other side may be shutting
    /// down or busy; trying again may work.
    Closed(std::io::Error),
    /// Nothing came within the handshake's time: not one of ours, or a hung process.
    Silent,
    /// Something answered that is not one of ours; the text shows what it sent.
    Foreign(String),
}

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed(e) => write!(f, "the connection closed during the handshake ({e})"),
            Self::Silent => f.write_str("it accepted the connection but never answered"),
            Self::Foreign(sent) => {
                write!(f, "it answered with {sent}, not candle-parallel's protocol")
            }
        }
    }
}

/// Reads the answer to a hello: `Ok(None)` when accepted, `Ok(Some(reason))` when refused.
pub(crate) fn read_reply(r: &mut impl Read) -> Result<Option<String>, NoAnswer> {
    let classify = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => NoAnswer::Silent,
        _ => NoAnswer::Closed(e),
    };
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < magic.len() {
        match r.read(&mut magic[got..]) {
            Ok(0) if got == 0 => {
                return Err(NoAnswer::Closed(std::io::ErrorKind::UnexpectedEof.into()))
            }
            Ok(0) => return Err(NoAnswer::Foreign(shown(&magic[..got]))),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if got > 0 => {
                let _ = e;
                return Err(NoAnswer::Foreign(shown(&magic[..got])));
            }
            Err(e) => return Err(classify(e)),
        }
    }
    if &magic != REPLY_MAGIC {
        return Err(NoAnswer::Foreign(shown(&magic)));
    }
    let refused = read_u8(r).map_err(classify)? != 0;
    let reason = read_string(r, MAX_TEXT, "refusal").map_err(classify)?;
    Ok(refused.then_some(reason))
}

/// Bytes as a quoted, printable string: `"HTTP"`.
fn shown(bytes: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(bytes))
}

/// A reader over `stream` whose reads all end by one deadline: a handshake cannot be drawn out
/// by a peer that sends a byte at a time.
pub(crate) struct Deadline<'a, S> {
    stream: &'a S,
    deadline: std::time::Instant,
}

impl<'a, S> Deadline<'a, S> {
    pub fn new(stream: &'a S, within: std::time::Duration) -> Self {
        Self {
            stream,
            deadline: std::time::Instant::now() + within,
        }
    }
}

/// A stream whose reads can be bounded in time.
pub(crate) trait TimedRead {
    fn set_read_timeout(&self, d: Option<std::time::Duration>) -> std::io::Result<()>;
    fn read_some(&self, buf: &mut [u8]) -> std::io::Result<usize>;
}

impl TimedRead for std::net::TcpStream {
    fn set_read_timeout(&self, d: Option<std::time::Duration>) -> std::io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, d)
    }
    fn read_some(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut s = self;
        s.read(buf)
    }
}

impl<S: TimedRead> Read for Deadline<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the handshake took too long",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read_some(buf)
    }
}

/// A bounded count of handshakes in progress.
#[derive(Default)]
pub(crate) struct HandshakeSlots(std::sync::atomic::AtomicUsize);

/// One handshake's place, given back on drop.
pub(crate) struct HandshakeSlot(std::sync::Arc<HandshakeSlots>);

impl HandshakeSlots {
    /// A place for one more handshake, unless [`MAX_HANDSHAKES`] are in progress.
    pub fn take(self: &std::sync::Arc<Self>) -> Option<HandshakeSlot> {
        use std::sync::atomic::Ordering;
        let taken = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_HANDSHAKES).then_some(n + 1)
            })
            .is_ok();
        taken.then(|| HandshakeSlot(self.clone()))
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The kinds of frame between peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FrameKind {
    /// Collective payload.
    Data = 1,
    /// A collective's descriptor, for the cross-rank check.
    Desc = 2,
    /// "I am alive."
    Heartbeat = 3,
    /// The sender's group broke; the payload says why.
    Abort = 4,
    /// The sender is shutting down cleanly.
    Bye = 5,
    /// A point-to-point message (`seq`: its number among those from the sender to the
    /// receiver), outside the group's collective order.
    P2p = 6,
    /// An all-to-all's payload between two ranks (`seq`: the collective's).
    Exchange = 7,
}

impl FrameKind {
    /// Whether frames of this kind belong to the group's collective order, where a frame of an
    /// earlier collective still unconsumed means the ranks disagree.
    pub fn in_collective_order(self) -> bool {
        matches!(self, FrameKind::Data | FrameKind::Desc)
    }
}

/// Which frame this is: its kind, the collective it belongs to (`seq`), and which piece of that
/// collective (`part`: for a ring, the step and the segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tag {
    pub kind: FrameKind,
    pub seq: u64,
    pub part: u64,
}

impl Tag {
    /// A tag for frames outside any collective (heartbeats, aborts, goodbyes).
    pub fn control(kind: FrameKind) -> Self {
        Self {
            kind,
            seq: 0,
            part: 0,
        }
    }
}

/// A frame header: kind, collective sequence number, part, payload length.
/// A data frame of collective `seq`, piece `part`.
pub(crate) fn data(seq: u64, part: u64) -> Tag {
    Tag {
        kind: FrameKind::Data,
        seq,
        part,
    }
}

pub(crate) const HEADER: usize = 21;

pub(crate) fn encode_header(tag: Tag, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = tag.kind as u8;
    h[1..9].copy_from_slice(&tag.seq.to_le_bytes());
    h[9..17].copy_from_slice(&tag.part.to_le_bytes());
    h[17..21].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

pub(crate) fn read_header(r: &mut impl Read) -> std::io::Result<(Tag, usize)> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h)?;
    let kind = match h[0] {
        1 => FrameKind::Data,
        2 => FrameKind::Desc,
        3 => FrameKind::Heartbeat,
        4 => FrameKind::Abort,
        5 => FrameKind::Bye,
        6 => FrameKind::P2p,
        7 => FrameKind::Exchange,
        k => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unknown frame kind {k}"),
            ))
        }
    };
    let seq = u64::from_le_bytes(h[1..9].try_into().expect("8 bytes"));
    let part = u64::from_le_bytes(h[9..17].try_into().expect("8 bytes"));
    let len = u32::from_le_bytes(h[17..21].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {MAX_FRAME}"),
        ));
    }
    Ok((Tag { kind, seq, part }, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_strangers_are_recognised() {
        let hello = Hello {
            purpose: Purpose::Peer,
            token: "s3cret".into(),
            job: 42,
            from_rank: 3,
            to_rank: 1,
            world_size: 4,
        };
        let bytes = hello.encode();
        assert_eq!(Hello::read(&mut bytes.as_slice()).unwrap(), hello);
        let err = Hello::read(&mut &b"GET / HTTP/1.1\r\n"[..]).unwrap_err();
        assert!(err.to_string().contains("bad magic"));
    }

    #[test]
    fn oversized_lengths_are_refused_before_allocating() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.push(2);
        bytes.extend_from_slice(&u32::MAX.to_le_bytes()); // a 4 GiB token
        let err = Hello::read(&mut bytes.as_slice()).unwrap_err();
        assert!(err.to_string().contains("exceeds the limit"), "{err}");
        let tag = Tag {
            kind: FrameKind::Data,
            seq: 1,
            part: 3,
        };
        let mut header = encode_header(tag, 0);
        assert_eq!(read_header(&mut header.as_slice()).unwrap(), (tag, 0));
        header[17..21].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(read_header(&mut header.as_slice()).is_err());
    }

    #[test]
    fn token_comparison_needs_equal_tokens() {
        assert!(token_matches("abc", "abc"));
        assert!(token_matches("", ""));
        assert!(!token_matches("abc", "abd"));
        assert!(!token_matches("abc", "ab"));
        assert!(!token_matches("", "x"));
    }

    #[test]
    fn replies_carry_the_refusal_reason_and_foreign_answers_are_told_apart() {
        let mut buf = Vec::new();
        write_reply(&mut buf, Some("wrong token")).unwrap();
        assert_eq!(
            read_reply(&mut buf.as_slice()).unwrap().as_deref(),
            Some("wrong token")
        );
        buf.clear();
        write_reply(&mut buf, None).unwrap();
        assert_eq!(read_reply(&mut buf.as_slice()).unwrap(), None);
        let http = read_reply(&mut &b"HTTP/1.1 400 Bad Request"[..]).unwrap_err();
        assert!(http.to_string().contains("\"HTTP\""), "{http}");
        assert!(matches!(
            read_reply(&mut &b""[..]).unwrap_err(),
            NoAnswer::Closed(_)
        ));
    }

    #[test]
    fn handshake_slots_are_bounded_and_given_back() {
        let slots = std::sync::Arc::new(HandshakeSlots::default());
        let taken: Vec<_> = (0..MAX_HANDSHAKES).map(|_| slots.take().unwrap()).collect();
        assert!(slots.take().is_none());
        drop(taken);
        assert!(slots.take().is_some());
    }
}
