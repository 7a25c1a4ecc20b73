//! A single-node Slurm cluster of a test's own (Debian's slurm-wlm and munge), as
//! `/work/shared/scripts/slurm-single-node.sh` starts one, but private: its own munge socket
//! and key, its own ports, configuration and state in a temporary folder, daemons in the
//! foreground as children of the test (killed with it, and by [`Cluster`]'s drop, with every
//! process its jobs left). It needs root; without it or the programs, [`Cluster::start`] says
//! why (see `engines::unavailable`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running cluster; dropping it stops everything it started.
pub struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    /// munged, slurmctld, slurmd.
    daemons: Vec<(String, Child)>,
}

/// Where `program` is: on the PATH, or in the sbin folders root's PATH may lack.
fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn hostname() -> Result<String, String> {
    let out = Command::new("hostname")
        .arg("-s")
        .output()
        .map_err(|e| format!("hostname: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Starts `program args` as a daemon child of this test, its output in `log`, killed if the
/// test dies.
fn daemon(program: &Path, args: &[&str], conf: &Path, log: &Path) -> Result<Child, String> {
    use std::os::unix::process::CommandExt;
    let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("SLURM_CONF", conf)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
        .stderr(log_file);
    // SAFETY: prctl is async-signal-safe, as code between fork and exec must be.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn()
        .map_err(|e| format!("starting {}: {e}", program.display()))
}

/// Waits up to `limit` for `ready`, returning whether it came.
fn wait_until(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if ready() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ready()
}

impl Cluster {
    /// Starts munged, slurmctld and slurmd, and waits until the node is idle.
    pub fn start(name: &str) -> Result<Cluster, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("a Slurm cluster of the test's own needs root".into());
        }
        let program = |p: &str| {
            find(p).ok_or_else(|| format!("{p} is not installed (apt-get install slurm-wlm munge)"))
        };
        let (munged, slurmctld, slurmd) = (
            program("munged")?,
            program("slurmctld")?,
            program("slurmd")?,
        );
        for client in ["srun", "sbatch", "sinfo", "scancel", "squeue"] {
            program(client)?;
        }
        let host = hostname()?;
        let dir = super::temp_dir(&format!("slurm-{name}"));
        let mut cluster = Cluster {
            conf: dir.join("slurm.conf"),
            dir: dir.clone(),
            daemons: Vec::new(),
        };
        for sub in ["state", "spool"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(|e| e.to_string())?;
        }
        let key = dir.join("munge.key");
        let mut bytes = vec![0u8; 1024];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
            .and_then(|()| std::fs::write(&key, &bytes))
            .and_then(|()| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))
            })
            .map_err(|e| format!("writing munge's key: {e}"))?;
        let socket = dir.join("munge.socket");
        let d = |p: &str| dir.join(p).display().to_string();
        let args = [
            "-F".to_string(),
            "--force".into(),
            format!("--socket={}", socket.display()),
            format!("--key-file={}", key.display()),
            format!("--pid-file={}", d("munged.pid")),
            format!("--log-file={}", d("munged.log")),
            format!("--seed-file={}", d("munged.seed")),
        ];
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = daemon(&munged, &refs, &cluster.conf, &dir.join("munged.out"))?;
        cluster.daemons.push(("munged".into(), child));
        if !wait_until(Duration::from_secs(10), || socket.exists()) {
            return Err(format!("munged did not start: {}", cluster.logs()));
        }
        let (ctld_port, d_port) = (super::free_port(), super::free_port());
        let conf = format!(
            "ClusterName=cptest\n\
             SlurmctldHost={host}(127.0.0.1)\n\
             SlurmctldPort={ctld_port}\n\
             SlurmdPort={d_port}\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             AuthType=auth/munge\n\
             AuthInfo=socket={socket}\n\
             CredType=cred/munge\n\
             MpiDefault=none\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             SwitchType=switch/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\n\
             SlurmdParameters=config_overrides\n\
             ReturnToService=2\n\
             StateSaveLocation={state}\n\
             SlurmdSpoolDir={spool}\n\
             SlurmctldPidFile={ctld_pid}\n\
             SlurmdPidFile={d_pid}\n\
             NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN\n\
             PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP \
             OverSubscribe=YES\n",
            socket = socket.display(),
            state = d("state"),
            spool = d("spool"),
            ctld_pid = d("slurmctld.pid"),
            d_pid = d("slurmd.pid"),
        );
        std::fs::write(&cluster.conf, conf).map_err(|e| e.to_string())?;
        let conf_path = cluster.conf.display().to_string();
        let child = daemon(
            &slurmctld,
            &["-D", "-i", "-f", &conf_path],
            &cluster.conf,
            &dir.join("slurmctld.out"),
        )?;
        cluster.daemons.push(("slurmctld".into(), child));
        let child = daemon(
            &slurmd,
            &["-D", "-N", &host, "-f", &conf_path],
            &cluster.conf,
            &dir.join("slurmd.out"),
        )?;
        cluster.daemons.push(("slurmd".into(), child));
        let idle = wait_until(Duration::from_secs(60), || {
            cluster
                .command("sinfo")
                .args(["-h", "-o", "%T"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
        });
        if !idle {
            return Err(format!(
                "the node did not become idle within 60 s: {}",
                cluster.logs()
            ));
        }
        Ok(cluster)
    }

    /// `program` (srun, sbatch...) talking to this cluster.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(find(program).unwrap_or_else(|| program.into()));
        cmd.env("SLURM_CONF", &self.conf)
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null());
        cmd
    }

    /// A folder of the cluster's own, for job outputs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The daemons' output so far, for messages.
    pub fn logs(&self) -> String {
        ["munged.out", "slurmctld.out", "slurmd.out"]
            .iter()
            .map(|f| {
                let text = std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- {f}:\n{}", tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every process whose environment names this cluster's configuration (job steps, their
    /// tasks, slurmstepd), but this test.
    fn job_processes(&self) -> Vec<u32> {
        let me = std::process::id();
        let want = format!("SLURM_CONF={}", self.conf.display());
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| pid != me)
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == want.as_bytes()))
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self
            .command("scancel")
            .args(["--full", "--user=root"])
            .output();
        let daemons: Vec<u32> = self.daemons.iter().map(|(_, c)| c.id()).collect();
        for (_, child) in self.daemons.iter_mut().rev() {
            // SAFETY: kill has no preconditions; the pid is our own child's.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (_, child) in self.daemons.iter_mut() {
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        for pid in self.job_processes() {
            if !daemons.contains(&pid) {
                // SAFETY: as above; a process of this cluster's jobs.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
