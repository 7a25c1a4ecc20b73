//! Agreement on the collective about to run: every rank sends a description of its call (kind,
//! op, dtype, shapes, root) to every other rank and compares. When they differ, every rank
//! returns the same error listing each rank's call, and no data moves, so the group stays
//! usable. As each rank waits for all others, this is also a barrier.

use super::Links;
use crate::distributed::transport::wire::{FrameKind, Tag};
use crate::error::{Error, Result};

/// Checks that every rank describes collective `seq` as `desc`.
pub(crate) fn check(links: &impl Links, seq: u64, desc: &str) -> Result<()> {
    let (n, r) = (links.world(), links.rank());
    let tag = Tag {
        kind: FrameKind::Desc,
        seq,
        part: 0,
    };
    for p in (0..n).filter(|&p| p != r) {
        links.send(p, tag, desc.as_bytes())?;
    }
    let mut all = vec![String::new(); n];
    all[r] = desc.to_string();
    for p in (0..n).filter(|&p| p != r) {
        all[p] = links.recv_with(p, tag, |b| String::from_utf8_lossy(b).into_owned())?;
    }
    if all.iter().all(|d| d == desc) {
        Ok(())
    } else {
        Err(Error::Mismatch {
            detail: describe(seq, &all),
        })
    }
}

/// "collective #3: ranks 0, 2 called all_reduce(sum) f32 \[4\]; rank 1 called broadcast ...".
pub(crate) fn describe(seq: u64, calls: &[String]) -> String {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, call) in calls.iter().enumerate() {
        match groups.iter_mut().find(|(c, _)| *c == call.as_str()) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((call, vec![rank])),
        }
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(call, ranks)| {
            let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
            let who = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{who} {} called {call}", list.join(", "))
        })
        .collect();
    format!("collective #{seq}: {}", parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::algorithms::testing::run;

    #[test]
    fn agreeing_ranks_pass_and_a_mismatch_fails_everywhere_with_one_message() {
        let ok = run(3, |l| check(l, 1, "all_reduce(sum) f32 [4]").is_ok());
        assert_eq!(ok, [true, true, true]);
        let errs = run(3, |l| {
            let desc = if l.rank() == 1 {
                "all_reduce(sum) f32 [5]"
            } else {
                "all_reduce(sum) f32 [4]"
            };
            check(l, 7, desc).unwrap_err().to_string()
        });
        assert!(errs.windows(2).all(|w| w[0] == w[1]), "{errs:?}");
        assert_eq!(
            errs[0],
            "collective mismatch between ranks: collective #7: ranks 0, 2 called \
             all_reduce(sum) f32 [4]; rank 1 called all_reduce(sum) f32 [5]"
        );
    }
}
