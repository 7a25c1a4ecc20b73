//! Watching the peers: the thread reading each connection (which notices a peer's loss) and
//! the heartbeat thread (which keeps connections audible and notices silent peers).

use super::broken::Broken;
use super::peer::Frame;
use super::state::MeshState;
use crate::distributed::transport::conn::Conn;
use crate::distributed::transport::wire::{encode_header, read_header, FrameKind, Tag};
use crate::util::sync::lock;
use std::io::{BufReader, Read, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl MeshState {
    /// The reading end of the connection to `peer`.
    pub(super) fn receive(&self, peer: usize, stream: Conn) {
        let mut r = BufReader::with_capacity(64 << 10, stream);
        let error = loop {
            let (tag, len) = match read_header(&mut r) {
                Ok(h) => h,
                Err(e) => break e,
            };
            let mut payload = {
                let mut st = lock(&self.state);
                st.last_seen[peer] = Instant::now();
                st.pool.pop().unwrap_or_default()
            };
            // Pooled buffers stay initialised, so reading into them costs no zero-filling
            // (only growth is filled, once).
            payload.resize(len, 0);
            if let Err(e) = r.read_exact(&mut payload) {
                break e;
            }
            let mut st = lock(&self.state);
            st.last_seen[peer] = Instant::now();
            match tag.kind {
                FrameKind::Heartbeat => st.pool.push(payload),
                FrameKind::Bye => {
                    st.departed[peer] = true;
                    st.pool.push(payload);
                }
                FrameKind::Abort => {
                    let (reason, lost) = match self.did_not_run() {
                        Some(own) => (own, None),
                        None => {
                            let reason = Broken::decode(&payload, peer);
                            let lost = reason.lost.or(Some(peer));
                            (reason, lost)
                        }
                    };
                    if st.broken.is_none() && !st.leaving {
                        (self.on_lost)(lost, &reason.detail);
                    }
                    st.broken.get_or_insert(reason);
                }
                FrameKind::Data | FrameKind::Desc | FrameKind::P2p | FrameKind::Exchange => {
                    st.inbox[peer].push_back(Frame { tag, payload })
                }
            }
            drop(st);
            self.changed.notify_all();
            if tag.kind == FrameKind::Abort {
                self.ring_all_doorbells();
            } else {
                self.ring_doorbell(peer);
            }
        };
        let (closing, departed) = {
            let st = lock(&self.state);
            (st.closing, st.departed[peer])
        };
        if closing {
            return;
        }
        if departed {
            self.changed.notify_all();
            self.ring_doorbell(peer);
            return;
        }
        let detail = match error.kind() {
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted => {
                "its connection closed: the process exited, crashed or was killed".to_string()
            }
            _ => format!("reading from it failed: {error}"),
        };
        self.fail(self.did_not_run().unwrap_or(Broken {
            lost: Some(peer),
            detail,
        }));
    }

    /// Sends heartbeats to quiet connections and declares silent peers lost, within
    /// `peer_timeout` of their last frame: it wakes at the next heartbeat or at the earliest
    /// moment a peer could be overdue, whichever comes first. A process that did not run for
    /// longer than `peer_timeout` itself (stopped, frozen, starved) says so, rather than blame
    /// the peers whose frames it could not read meanwhile.
    pub(super) fn heartbeat(&self) {
        let interval = (self.options.peer_timeout / 5)
            .clamp(Duration::from_millis(20), Duration::from_secs(5));
        let (stop, cv) = &self.stop;
        let mut stopped = lock(stop);
        loop {
            // Checked under the lock before every wait: a stop set before this thread first
            // waits must not be missed.
            if *stopped {
                return;
            }
            let wait = self.until_next_deadline().min(interval);
            stopped = cv
                .wait_timeout(stopped, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if *stopped {
                return;
            }
            // Checked before this tick counts as running: the reader threads, woken with this
            // one, then blame this process too.
            if let Some(own) = self.did_not_run() {
                self.fail(own);
                return;
            }
            let gap = self.ran_ago();
            self.last_ran_ms.store(self.now_ms(), Ordering::SeqCst);
            let now = Instant::now();
            if gap > wait + interval {
                // This process was held up for a while: the peers' frames may wait unread in
                // the sockets. Give them the time this process lost.
                let mut st = lock(&self.state);
                for seen in st.last_seen.iter_mut() {
                    *seen = (*seen).max(now - wait);
                }
            }
            let overdue = {
                let st = lock(&self.state);
                if st.broken.is_some() {
                    None
                } else {
                    (0..self.world).find(|&p| {
                        p != self.rank
                            && !st.departed[p]
                            && st.last_seen[p].elapsed() > self.options.peer_timeout
                    })
                }
            };
            if let Some(p) = overdue {
                self.fail(Broken {
                    lost: Some(p),
                    detail: format!(
                        "no message or heartbeat from it for {:?}: the process hangs, was \
                         stopped, or the network is down",
                        self.options.peer_timeout
                    ),
                });
            }
            let now = self.now_ms();
            let header = encode_header(Tag::control(FrameKind::Heartbeat), 0);
            for w in self.writers() {
                if now.saturating_sub(w.last_sent_ms.load(Ordering::Relaxed))
                    >= interval.as_millis() as u64
                {
                    if let Ok(mut s) = w.stream.try_lock() {
                        let _ = s.write_all(&header);
                        w.last_sent_ms.store(now, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// The time until the first live peer could be overdue (a millisecond at least).
    fn until_next_deadline(&self) -> Duration {
        let st = lock(&self.state);
        let earliest = (0..self.world)
            .filter(|&p| p != self.rank && !st.departed[p])
            .map(|p| st.last_seen[p] + self.options.peer_timeout)
            .min();
        earliest.map_or(Duration::from_secs(3600), |d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        })
    }
}
