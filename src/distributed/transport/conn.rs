//! A connection to a peer: TCP, or a Unix-domain socket when both ranks share a machine.
//!
//! Ranks on one machine (the same kernel boot and network namespace) talk over abstract Unix
//! sockets, which move data at about twice the rate of TCP over loopback because they skip the
//! TCP/IP stack; ranks on other machines use TCP. A rank that cannot reach a peer's Unix socket
//! (another container, say) falls back to TCP. The algorithms see no difference.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Duration;

#[cfg(target_os = "linux")]
use std::os::unix::net::{UnixListener, UnixStream};

/// A stream to one peer.
pub(crate) enum Conn {
    Tcp(TcpStream),
    #[cfg(target_os = "linux")]
    Unix(UnixStream),
}

macro_rules! each {
    ($self:expr, $s:ident => $e:expr) => {
        match $self {
            Conn::Tcp($s) => $e,
            #[cfg(target_os = "linux")]
            Conn::Unix($s) => $e,
        }
    };
}

impl Conn {
    pub fn try_clone(&self) -> std::io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            #[cfg(target_os = "linux")]
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }

    pub fn shutdown(&self) {
        let _ = each!(self, s => s.shutdown(Shutdown::Both));
    }

    pub fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        each!(self, s => s.set_read_timeout(d))
    }

    pub fn set_write_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        each!(self, s => s.set_write_timeout(d))
    }

    pub fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        each!(self, s => s.set_nonblocking(on))
    }

    /// Settings for collectives: no Nagle delay on TCP, and over loopback a congestion control
    /// that does not pace ([`LOOPBACK_CONGESTION`]).
    pub fn tune(&self) -> std::io::Result<()> {
        match self {
            Conn::Tcp(s) => {
                if s.peer_addr()?.ip().is_loopback() {
                    set_congestion(s, LOOPBACK_CONGESTION);
                }
                s.set_nodelay(true)
            }
            #[cfg(target_os = "linux")]
            Conn::Unix(_) => Ok(()),
        }
    }

    /// "tcp" or "unix", for messages and tests.
    pub fn kind(&self) -> &'static str {
        match self {
            Conn::Tcp(_) => "tcp",
            #[cfg(target_os = "linux")]
            Conn::Unix(_) => "unix",
        }
    }
}

impl crate::distributed::transport::wire::TimedRead for Conn {
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        Conn::set_read_timeout(self, d)
    }
    fn read_some(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Read for &Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        each!(*self, s => { let mut s = s; s.read(buf) })
    }
}

impl Write for &Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        each!(*self, s => { let mut s = s; s.write(buf) })
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        each!(*self, s => { let mut s = s; s.write_vectored(bufs) })
    }
    fn flush(&mut self) -> std::io::Result<()> {
        each!(*self, s => { let mut s = s; s.flush() })
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (&*self).write(buf)
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        (&*self).flush()
    }
}

/// The TCP congestion control of connections between ranks of one machine.
///
/// Many systems default to BBR, which paces a connection's packets at the bandwidth it
/// estimates. Over loopback there is no link to be fair to, and collectives send in bursts
/// (a segment, then a wait for the peer's) whose pacing only leaves the cores idle: measured on
/// two cores (`benches/allreduce_bandwidth.rs`, two ranks, TCP only), Reno takes a 16 MiB
/// all-reduce from 1.3 to 1.9 GB/s. Reno is built into every Linux kernel and allowed to
/// unprivileged processes. Connections to other machines keep the system's choice.
pub(crate) const LOOPBACK_CONGESTION: &str = "reno";

/// Sets `s`'s congestion control to `name` (Linux), keeping the system's where that fails.
fn set_congestion(s: &TcpStream, name: &str) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: setsockopt reads `name.len()` bytes from a live buffer of that length; the
        // descriptor belongs to `s`, which outlives the call.
        let rc = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_CONGESTION,
                name.as_ptr().cast(),
                name.len() as libc::socklen_t,
            )
        };
        if rc != 0 {
            log::debug!(
                "keeping the system's TCP congestion control on a loopback connection: setting \
                 {name:?} failed ({})",
                std::io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (s, name);
}

/// The TCP congestion control of `s`, where it can be read (Linux).
#[cfg(all(test, target_os = "linux"))]
fn congestion(s: &TcpStream) -> Option<String> {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 32];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `buf`, which is that long, and
    // stores the length it wrote in `len`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    (rc == 0).then(|| {
        let name = &buf[..(len as usize).min(buf.len())];
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        String::from_utf8_lossy(&name[..end]).into_owned()
    })
}

/// What identifies a machine for Unix sockets: the kernel's boot id and this process's network
/// namespace (abstract Unix sockets are per namespace). `None` where it cannot be told.
pub(crate) fn host_identity() -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let netns = std::fs::read_link("/proc/self/ns/net").ok()?;
        Some(format!("{}@{}", boot.trim(), netns.display()))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The listeners a rank accepts peers on.
pub(crate) struct Listeners {
    tcp: TcpListener,
    #[cfg(target_os = "linux")]
    unix: Option<(UnixListener, String)>,
}

impl Listeners {
    /// A TCP listener on `ip` and, when `unix` is set and possible, an abstract Unix socket
    /// named after `job` and `rank`.
    pub fn bind(ip: std::net::IpAddr, job: u64, rank: usize, unix: bool) -> std::io::Result<Self> {
        let tcp = TcpListener::bind((ip, 0))?;
        tcp.set_nonblocking(true)?;
        #[cfg(target_os = "linux")]
        let unix = unix
            .then(|| {
                use std::os::linux::net::SocketAddrExt;
                let name = format!("candle-parallel/{job:016x}/{rank}");
                let addr =
                    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).ok()?;
                let l = UnixListener::bind_addr(&addr).ok()?;
                l.set_nonblocking(true).ok()?;
                Some((l, name))
            })
            .flatten();
        #[cfg(not(target_os = "linux"))]
        let _ = (job, rank, unix);
        Ok(Self {
            tcp,
            #[cfg(target_os = "linux")]
            unix,
        })
    }

    /// Where peers reach this rank: `tcp=IP:PORT`, and `unix=NAME host=ID` when available.
    pub fn address(&self) -> std::io::Result<String> {
        let mut a = format!("tcp={}", self.tcp.local_addr()?);
        #[cfg(target_os = "linux")]
        if let (Some((_, name)), Some(host)) = (&self.unix, host_identity()) {
            a.push_str(&format!(" unix={name} host={host}"));
        }
        Ok(a)
    }

    /// A pending connection, if any (never blocks).
    pub fn accept(&self) -> Option<Conn> {
        #[cfg(target_os = "linux")]
        if let Some((l, _)) = &self.unix {
            if let Ok((s, _)) = l.accept() {
                return Some(Conn::Unix(s));
            }
        }
        self.tcp.accept().ok().map(|(s, _)| Conn::Tcp(s))
    }
}

/// A peer's published address.
pub(crate) struct PeerAddress {
    pub tcp: std::net::SocketAddr,
    pub unix: Option<String>,
    pub host: Option<String>,
}

impl PeerAddress {
    pub fn parse(text: &str) -> Option<Self> {
        let field = |key: &str| {
            text.split_whitespace()
                .find_map(|f| f.strip_prefix(key).map(str::to_string))
        };
        Some(Self {
            tcp: field("tcp=")?.parse().ok()?,
            unix: field("unix="),
            host: field("host="),
        })
    }

    /// Connects over the Unix socket when the peer shares this machine (and `unix` is
    /// allowed), else over TCP; `timeout` bounds the TCP connect.
    pub fn connect(&self, unix: bool, timeout: Duration) -> std::io::Result<Conn> {
        #[cfg(target_os = "linux")]
        if let (true, Some(name), Some(host)) = (unix, &self.unix, &self.host) {
            if host_identity().as_deref() == Some(host.as_str()) {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
                if let Ok(s) = UnixStream::connect_addr(&addr) {
                    return Ok(Conn::Unix(s));
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = unix;
        TcpStream::connect_timeout(&self.tcp, timeout).map(Conn::Tcp)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn loopback_connections_use_the_unpaced_congestion_control() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = Conn::Tcp(TcpStream::connect(l.local_addr().unwrap()).unwrap());
        let (b, _) = l.accept().unwrap();
        a.tune().unwrap();
        let Conn::Tcp(a) = &a else { unreachable!() };
        assert_eq!(congestion(a).as_deref(), Some(LOOPBACK_CONGESTION));
        assert!(a.nodelay().unwrap());
        // The other end keeps the system's until tuned itself.
        assert!(congestion(&b).is_some());
    }
}
