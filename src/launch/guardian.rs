//! The guardian: a small process that cleans up after the launcher when the launcher itself
//! dies without doing so (SIGKILL, a crash).
//!
//! The kernel kills each rank when the launcher dies (`PR_SET_PDEATHSIG`), but not what the
//! rank started: those are re-parented and live on. So the launcher starts, beside the ranks,
//! a `/bin/sh` that reads from a pipe the process group of every rank it starts (a rank's
//! whole tree, unless something in it made a group of its own), and forgets the group of a
//! rank that ended (an elastic job's round), whose number the system may give to another
//! process. When the launcher ends normally it writes `done` and the guardian exits; when the
//! pipe closes without it (the
//! launcher died), the guardian sends SIGTERM to every group, SIGKILL after the grace period,
//! and removes the launcher's temporary folder. The guardian has a process group of its own
//! and ignores the terminal's signals, so that a Ctrl-C or a hang-up that kills the launcher
//! does not kill it too.

use std::io::Write;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

/// The guardian's script: `$1` the grace period in seconds, `$2` the folder to remove.
const SCRIPT: &str = r#"
trap '' HUP INT TERM QUIT
groups=
while IFS= read -r line; do
  case $line in
    done) exit 0 ;;
    group\ *) groups="$groups ${line#group }" ;;
    forget\ *)
      kept=
      for g in $groups; do [ "$g" = "${line#forget }" ] || kept="$kept $g"; done
      groups=$kept ;;
  esac
done
for g in $groups; do kill -TERM "-$g" 2>/dev/null; done
waited=0
while [ "$waited" -lt "$1" ]; do
  alive=
  for g in $groups; do kill -0 "-$g" 2>/dev/null && alive=1; done
  [ -z "$alive" ] && break
  sleep 1
  waited=$((waited + 1))
done
for g in $groups; do kill -KILL "-$g" 2>/dev/null; done
rm -rf -- "$2"
"#;

/// A running guardian; see the module documentation.
pub(crate) struct Guardian {
    child: Child,
    pipe: Option<ChildStdin>,
}

impl Guardian {
    /// Starts a guardian that, should the launcher die, stops the groups it is told about
    /// with `grace` between SIGTERM and SIGKILL and removes `folder`. `None` where no shell
    /// can be started: the ranks still die with the launcher, only their children may not.
    pub fn start(grace: Duration, folder: &Path) -> Option<Self> {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(SCRIPT)
            .arg("candle-run-guardian")
            .arg(grace.as_secs().max(1).to_string())
            .arg(folder)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .ok()?;
        let pipe = child.stdin.take();
        Some(Self { child, pipe })
    }

    /// Tells the guardian about the process group `pgid`.
    pub fn watch(&mut self, pgid: u32) {
        self.say(&format!("group {pgid}"));
    }

    /// Tells the guardian that the process group `pgid` is gone: it must not signal that
    /// number again, which the system may give to an unrelated process.
    pub fn forget(&mut self, pgid: u32) {
        self.say(&format!("forget {pgid}"));
    }

    fn say(&mut self, line: &str) {
        if let Some(p) = self.pipe.as_mut() {
            let _ = writeln!(p, "{line}").and_then(|()| p.flush());
        }
    }
}

impl Drop for Guardian {
    /// The launcher is done: the guardian exits without touching anything.
    fn drop(&mut self) {
        if let Some(mut p) = self.pipe.take() {
            let _ = p.write_all(b"done\n").and_then(|()| p.flush());
        }
        let _ = self.child.wait();
    }
}
