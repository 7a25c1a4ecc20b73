//! Why a mesh broke ([`Broken`]): the rank it lost, if any, and the story; and how the reason
//! travels to the peers in an `Abort` frame.

use crate::error::Error;

/// Why the mesh broke.
#[derive(Clone, Debug)]
pub(crate) struct Broken {
    /// The rank that was lost, when one was.
    pub lost: Option<usize>,
    pub detail: String,
}

impl Broken {
    /// The error that describes the broken mesh.
    pub fn error(&self) -> Error {
        match self.lost {
            Some(rank) => Error::PeerLost {
                rank,
                detail: self.detail.clone(),
            },
            None => Error::Aborted {
                reason: self.detail.clone(),
            },
        }
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut b = self
            .lost
            .map_or(u32::MAX, |r| r as u32)
            .to_le_bytes()
            .to_vec();
        b.extend_from_slice(self.detail.as_bytes());
        b
    }

    pub(super) fn decode(payload: &[u8], from: usize) -> Self {
        let lost = payload
            .get(..4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .filter(|&r| r != u32::MAX)
            .map(|r| r as usize);
        let detail = String::from_utf8_lossy(payload.get(4..).unwrap_or(&[])).into_owned();
        Self {
            lost,
            detail: format!("{detail} (reported by rank {from})"),
        }
    }
}
