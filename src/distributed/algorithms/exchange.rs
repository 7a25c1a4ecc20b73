//! Whole tensors between two ranks, for point-to-point messages and all-to-all: a message is a
//! header frame (part 0: the dtype and shape, as [`Meta`]) and the elements' bytes in frames of
//! at most [`CHUNK_BYTES`] (parts 1, 2, ...). The receiver learns what was sent from the header,
//! so a receive that expected something else is an error naming both, never a reinterpretation.

use super::Links;
use crate::distributed::reduce_op::check_dtype;
use crate::distributed::transport::host_buf::{with_raw_bytes, HostBuf};
use crate::distributed::transport::wire::{FrameKind, Tag};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor};
use std::str::FromStr;

/// Bytes per data frame: large enough to move at the link's speed, small enough that the
/// receiver copies one while the next is on the wire.
pub(crate) const CHUNK_BYTES: usize = 4 << 20;

/// What a message carries: its dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Meta {
    pub dtype: DType,
    pub dims: Vec<usize>,
}

impl Meta {
    pub fn of(t: &Tensor) -> Self {
        Self {
            dtype: t.dtype(),
            dims: t.dims().to_vec(),
        }
    }

    /// The message's size in bytes.
    pub fn bytes(&self) -> usize {
        self.dims.iter().product::<usize>() * self.dtype.size_in_bytes()
    }

    /// "f32 [4, 8]", as the crate names tensors in messages.
    pub fn describe(&self) -> String {
        format!("{} {:?}", self.dtype.as_str(), self.dims)
    }

    /// The header's bytes: "f32 4,8" ("f32 " for a scalar).
    fn encode(&self) -> Vec<u8> {
        let dims: Vec<String> = self.dims.iter().map(usize::to_string).collect();
        format!("{} {}", self.dtype.as_str(), dims.join(",")).into_bytes()
    }

    fn decode(bytes: &[u8], from: usize) -> Result<Self> {
        let bad = || Error::Mismatch {
            detail: format!(
                "rank {from} sent a message header this rank cannot read ({:?}): the ranks run \
                 different versions of candle-parallel, or disagree on what is a message",
                String::from_utf8_lossy(bytes)
            ),
        };
        let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
        let (dtype, dims) = text.split_once(' ').ok_or_else(bad)?;
        let dtype = DType::from_str(dtype).map_err(|_| bad())?;
        let dims = if dims.is_empty() {
            Vec::new()
        } else {
            dims.split(',')
                .map(|d| d.parse::<usize>().map_err(|_| bad()))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Self { dtype, dims })
    }
}

fn tag(kind: FrameKind, seq: u64, part: u64) -> Tag {
    Tag { kind, seq, part }
}

/// Sends `meta`'s header as message `seq` (of frames of `kind`) to `peer`.
pub(crate) fn send_meta(
    links: &impl Links,
    peer: usize,
    kind: FrameKind,
    seq: u64,
    meta: &Meta,
) -> Result<()> {
    links.send(peer, tag(kind, seq, 0), &meta.encode())
}

/// Waits for the header of message `seq` from `peer`.
pub(crate) fn recv_meta(
    links: &impl Links,
    peer: usize,
    kind: FrameKind,
    seq: u64,
) -> Result<Meta> {
    links.recv_with(peer, tag(kind, seq, 0), |b| Meta::decode(b, peer))?
}

/// Sends `t` (header and elements) as message `seq` to `peer`.
pub(crate) fn send(
    links: &impl Links,
    peer: usize,
    kind: FrameKind,
    seq: u64,
    t: &Tensor,
) -> Result<()> {
    let meta = Meta::of(t);
    with_raw_bytes(t, |bytes| {
        send_meta(links, peer, kind, seq, &meta)?;
        for (i, chunk) in bytes.chunks(CHUNK_BYTES).enumerate() {
            links.send(peer, tag(kind, seq, i as u64 + 1), chunk)?;
        }
        Ok(())
    })
}

/// Receives the elements of message `seq` from `peer`, whose header said `meta`, as a tensor on
/// `device`. Floats land in the tensor's own buffer (one copy from the transport); integers
/// take a second copy.
pub(crate) fn recv_body(
    links: &impl Links,
    peer: usize,
    kind: FrameKind,
    seq: u64,
    meta: &Meta,
    device: &Device,
) -> Result<Tensor> {
    let n = meta.dims.iter().product::<usize>();
    let fill = |dst: &mut [u8]| -> Result<()> {
        for (i, part) in dst.chunks_mut(CHUNK_BYTES).enumerate() {
            links.recv_with(peer, tag(kind, seq, i as u64 + 1), |b| {
                super::expect_len(b, part.len(), peer)?;
                part.copy_from_slice(b);
                Ok::<(), Error>(())
            })??;
        }
        Ok(())
    };
    if check_dtype(meta.dtype).is_ok() {
        let mut buf = HostBuf::zeros(meta.dtype, n);
        fill(buf.bytes_mut(0..n))?;
        return buf.into_tensor(&Shape::from(meta.dims.clone()), device);
    }
    let mut buf = vec![0u8; meta.bytes()];
    fill(&mut buf)?;
    Ok(Tensor::from_raw_buffer(
        &buf, meta.dtype, &meta.dims, device,
    )?)
}

/// Consumes the elements of message `seq` from `peer` without keeping them (a receive that
/// failed its check), so that nothing of it stays behind.
pub(crate) fn skip_body(
    links: &impl Links,
    peer: usize,
    kind: FrameKind,
    seq: u64,
    meta: &Meta,
) -> Result<()> {
    for i in 0..meta.bytes().div_ceil(CHUNK_BYTES) {
        links.recv_with(peer, tag(kind, seq, i as u64 + 1), |_| ())?;
    }
    Ok(())
}

/// Checks a received header against what the receive expected (`None`: anything).
pub(crate) fn check_expected(
    expect: Option<&Meta>,
    got: &Meta,
    sender: usize,
    receiver: usize,
    seq: u64,
) -> Result<()> {
    match expect {
        Some(want) if want != got => Err(Error::P2pMismatch {
            sender,
            receiver,
            seq,
            expected: want.describe(),
            sent: got.describe(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_for_every_rank_of_tensor() -> Result<()> {
        for dims in [vec![], vec![0], vec![3], vec![2, 0, 5], vec![4, 1, 7, 2]] {
            for dtype in [DType::U8, DType::I64, DType::BF16, DType::F64] {
                let meta = Meta {
                    dtype,
                    dims: dims.clone(),
                };
                assert_eq!(Meta::decode(&meta.encode(), 1)?, meta);
            }
        }
        let err = Meta::decode(b"f33 2,3", 4).unwrap_err().to_string();
        assert!(err.contains("rank 4") && err.contains("f33 2,3"), "{err}");
        Ok(())
    }
}
