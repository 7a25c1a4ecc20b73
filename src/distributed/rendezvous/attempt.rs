//! A fresh key space for each attempt of a job, in a store that outlives attempts.
//!
//! torchrun's agent serves one TCPStore for its whole run, and a restart (`--max-restarts`)
//! starts every rank again on it: the keys of the attempts before (claimed ranks, addresses
//! of processes now dead) are still there. torch 2.x's own workers keep no per-attempt prefix
//! (the cause of pytorch#135712), and `TORCHELASTIC_RESTART_COUNT` cannot name the attempt:
//! each agent counts its own restarts, and agents that restarted because another node's
//! workers failed count differently.
//!
//! So the ranks agree on the attempt through the store itself. Rank 0 opens a new attempt:
//! `attempts` counts them, and the count `n` is fresh, so `attempt/<n>/` is empty. Every other
//! rank announces itself with a nonce of its own (it takes a ticket from the counter `hellos`,
//! then writes `hello/<ticket>` = "<rank> <nonce>") and waits for `welcome/<nonce>`, which
//! only a rank 0 that has seen this nonce can write, so only this attempt's. Rank 0 welcomes
//! every hello it finds (old ones too: nobody waits for those) until every rank has joined
//! the new attempt. Only ranks of one attempt are alive at a time: torchrun stops a worker
//! group before it starts the next.

use super::store::{ranks_named, Store};
use crate::error::{Error, Result};
use crate::rng::fresh_seed;
use std::time::{Duration, Instant};

/// How often rank 0 looks for new hellos.
const POLL: Duration = Duration::from_millis(10);

/// Agrees with the other ranks on this attempt of the job: returns the store with its keys
/// under the attempt's own prefix. `joined(rank)` is the key each rank sets (in that scope)
/// once it has joined: rank 0 welcomes others until every rank has set its key.
pub(crate) fn enter_attempt(
    store: &Store,
    rank: usize,
    world: usize,
    timeout: Duration,
    joined: &dyn Fn(usize) -> String,
) -> Result<(Store, u64)> {
    let deadline = Instant::now() + timeout;
    let attempt = if rank == 0 {
        let attempt = store.add("attempts", 1)? as u64;
        let scoped = store.scoped(&scope(attempt));
        welcome_everyone(store, &scoped, attempt, world, deadline, joined)?;
        attempt
    } else {
        be_welcomed(store, rank, deadline)?
    };
    Ok((store.scoped(&scope(attempt)), attempt))
}

fn scope(attempt: u64) -> String {
    format!("attempt/{attempt}/")
}

/// A rank other than 0: announces itself and waits for rank 0 to name the attempt.
fn be_welcomed(store: &Store, rank: usize, deadline: Instant) -> Result<u64> {
    let nonce = format!("{:016x}", fresh_seed());
    let ticket = store.add("hellos", 1)?;
    store.set(
        &format!("hello/{ticket}"),
        format!("{rank} {nonce}").as_bytes(),
    )?;
    let welcome = format!("welcome/{nonce}");
    let started = Instant::now();
    let timeout = deadline.saturating_duration_since(started);
    let mut said = Duration::ZERO;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if store
            .wait(&[&welcome], left.min(Duration::from_secs(1)))?
            .is_empty()
        {
            let value = store.get(&welcome, Duration::ZERO)?;
            return std::str::from_utf8(&value)
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| Error::Rendezvous {
                    detail: format!(
                        "{} holds an invalid attempt number {:?} under {welcome:?}",
                        store.describe(),
                        String::from_utf8_lossy(&value)
                    ),
                });
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(Error::Rendezvous {
                detail: format!(
                    "rank {rank} waited {} s in {} for rank 0 to open this attempt of the job, \
                     and it never did: check that rank 0 started (torchrun's log names every \
                     worker it started)",
                    timeout.as_secs(),
                    store.describe()
                ),
            });
        }
        if waited >= said + Duration::from_secs(30) {
            said = waited;
            log::info!(
                "rank {rank} is still waiting for rank 0 in {}, {} s so far; the rendezvous \
                 timeout is {} s",
                store.describe(),
                waited.as_secs(),
                timeout.as_secs()
            );
        }
    }
}

/// Rank 0: welcomes every hello into `attempt` until each rank has set its `joined` key in
/// `scoped`.
fn welcome_everyone(
    store: &Store,
    scoped: &Store,
    attempt: u64,
    world: usize,
    deadline: Instant,
    joined: &dyn Fn(usize) -> String,
) -> Result<()> {
    let keys: Vec<String> = (1..world).map(joined).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let number = attempt.to_string();
    let mut next_ticket = 1i64;
    // Tickets taken whose hello rank 0 has not read yet. A ticket is taken just before its
    // hello is written; one whose rank died in between stays here, checked at each look.
    let mut pending: Vec<i64> = Vec::new();
    loop {
        let tickets = store.add("hellos", 0)?;
        pending.extend(next_ticket..=tickets);
        next_ticket = next_ticket.max(tickets + 1);
        let mut unread = Vec::new();
        for ticket in pending {
            let key = format!("hello/{ticket}");
            if !store.check(&[&key])? {
                unread.push(ticket);
                continue;
            }
            let hello = store.get(&key, Duration::ZERO)?;
            if let Some((_, nonce)) = std::str::from_utf8(&hello)
                .ok()
                .and_then(|h| h.split_once(' '))
            {
                store.set(&format!("welcome/{nonce}"), number.as_bytes())?;
            }
        }
        pending = unread;
        if scoped.check(&refs)? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let missing = scoped.wait(&refs, Duration::ZERO)?;
            let ranks: Vec<usize> = (1..world)
                .filter(|r| missing.contains(&joined(*r)))
                .collect();
            return Err(Error::Rendezvous {
                detail: format!(
                    "{} of {world} ranks joined attempt {attempt} in {} within the rendezvous \
                     timeout; {} never came. Check that torchrun started every worker",
                    world - ranks.len(),
                    store.describe(),
                    ranks_named(&ranks)
                ),
            });
        }
        std::thread::sleep(POLL);
    }
}
