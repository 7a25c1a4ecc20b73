//! Checkpoints that cannot load wrong, each fault made for real on the checkpoints of a real job
//! (`cifar_ddp`, 2 ranks under `candle-run`): a flipped data byte and a changed dtype are
//! refused naming the file and the tensor; a file without checksums whose dtype changed is
//! refused naming both dtypes; a disk too small for the next checkpoint (a real tmpfs) says so on
//! every rank and in the job's last line, with the folder and the sizes; what killed saves leave
//! behind is gone after the next resume; a loss that stops being a number stops the run naming
//! the step; a run resumed at an epoch's end says so instead of printing an empty epoch.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const RUN: &str = env!("CARGO_BIN_EXE_candle-run");
const LIMIT: Duration = Duration::from_secs(120);

/// 2 ranks of 32 over 640 images: 10 steps an epoch.
const ARGS: [&str; 7] = [
    "--cpu",
    "--batch-size",
    "32",
    "--train-size",
    "640",
    "--test-size",
    "64",
];

/// `candle-run --nproc-per-node 2 cifar_ddp ARGS --epochs EPOCHS --checkpoint-every EVERY
/// --checkpoint-dir CKPT [extra]`.
fn job_of(ckpt: &Path, epochs: usize, every: usize, extra: &[&str]) -> Command {
    let mut cmd = Command::new(RUN);
    cmd.args(["--nproc-per-node", "2"])
        .arg(common::example("cifar_ddp"))
        .args(ARGS)
        .args(["--epochs", &epochs.to_string()])
        .args(["--checkpoint-every", &every.to_string()])
        .arg("--checkpoint-dir")
        .arg(ckpt)
        .args(extra)
        .env("RUST_BACKTRACE", "0");
    cmd
}

/// One epoch, a checkpoint every 5 steps.
fn job(ckpt: &Path, extra: &[&str]) -> Command {
    job_of(ckpt, 1, 5, extra)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The state file of the checkpoint `latest` names.
fn latest_state(ckpt: &Path) -> PathBuf {
    let name = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    ckpt.join(name.trim()).join("state.safetensors")
}

/// The header of a safetensors file, and where its data starts.
fn header(bytes: &[u8]) -> (String, usize) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (String::from_utf8(bytes[8..8 + n].to_vec()).unwrap(), 8 + n)
}

/// A job that resumes from a corrupted checkpoint fails within seconds, every rank and the
/// launcher's last line naming the file and `needle`.
fn refused(ckpt: &Path, needles: &[&str]) {
    let started = std::time::Instant::now();
    let out = common::run(job(ckpt, &[]), LIMIT);
    let all = text(&out);
    assert!(!out.status.success(), "resumed from a corrupt file:\n{all}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    let last = String::from_utf8_lossy(&out.stderr)
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    for needle in needles {
        assert!(
            last.contains(needle),
            "last line {last:?} lacks {needle:?}:\n{all}"
        );
        for rank in 0..2 {
            let said = all
                .lines()
                .any(|l| l.starts_with(&format!("[rank{rank}]")) && l.contains(needle));
            assert!(said, "rank {rank} did not name {needle:?}:\n{all}");
        }
    }
    assert!(!all.contains("Resumed at step"), "{all}");
}

#[test]
fn a_flipped_data_byte_or_a_changed_dtype_is_refused_naming_the_file_and_the_tensor() {
    let dir = common::temp_dir("ckpt-corrupt");
    let ckpt = dir.join("ckpt");
    common::run_ok(job(&ckpt, &[]), LIMIT);
    let state = latest_state(&ckpt);
    let good = std::fs::read(&state).unwrap();
    let (head, data) = header(&good);
    let file = state.display().to_string();

    // 64 flipped bytes in the middle of the data.
    let mut flipped = good.clone();
    let middle = data + (good.len() - data) / 2;
    for b in &mut flipped[middle..middle + 64] {
        *b ^= 0x5a;
    }
    std::fs::write(&state, &flipped).unwrap();
    refused(
        &ckpt,
        &[&file, "does not match the checksum", "nothing was loaded"],
    );

    // One header byte: a bias read as I32 instead of F32, the data untouched.
    let bias = head
        .find("\"fc3.bias\":{\"dtype\":\"F32\"")
        .expect("fc3.bias in the header");
    let mut retyped = good.clone();
    let at = 8 + bias + "\"fc3.bias\":{\"dtype\":\"".len();
    retyped[at] = b'I';
    std::fs::write(&state, &retyped).unwrap();
    refused(&ckpt, &[&file, "`fc3.bias` does not match", "I32"]);

    // A file without checksums (another program's) with that dtype: refused for the dtype.
    let tensors = candle_core::safetensors::load_buffer(&good, &candle_core::Device::Cpu).unwrap();
    let mut plain: Vec<(String, candle_core::Tensor)> = tensors.into_iter().collect();
    for (name, t) in &mut plain {
        if name == "fc3.bias" {
            *t = t.to_dtype(candle_core::DType::I64).unwrap();
        }
    }
    let bytes = safetensors::serialize(plain.iter().map(|(n, t)| (n.as_str(), t)), None).unwrap();
    std::fs::write(&state, bytes).unwrap();
    refused(
        &ckpt,
        &["`fc3.bias` is I64 in the file and F32 in the model"],
    );

    // The good file resumes.
    std::fs::write(&state, &good).unwrap();
    let out = common::run_ok(job(&ckpt, &[]), LIMIT);
    assert!(out.contains("Resumed at step 10"), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A tmpfs mounted at a fresh folder, unmounted when dropped (whatever happens).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(name: &str, bytes: u64) -> Option<Self> {
        let dir = common::temp_dir(name);
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED: cannot mount a tmpfs here (needs root and the mount syscall)");
            let _ = std::fs::remove_dir_all(&dir);
            return None;
        }
        Some(Self(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_disk_too_small_for_the_next_checkpoint_says_which_folder_and_how_much() {
    // How big one checkpoint of this job is, measured on a real disk.
    let dir = common::temp_dir("ckpt-size");
    common::run_ok(job(&dir.join("ckpt"), &[]), LIMIT);
    let one: u64 = std::fs::read_dir(latest_state(&dir.join("ckpt")).parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    std::fs::remove_dir_all(&dir).unwrap();
    // Room for one checkpoint and a half: the second cannot be written beside the first.
    let Some(disk) = Tmpfs::mount("ckpt-full", one * 3 / 2 + 64 * 1024) else {
        return;
    };
    let ckpt = disk.0.join("ckpt");
    let out = common::run(job(&ckpt, &[]), LIMIT);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("Checkpoint at step 5 saved"), "{all}");
    let folder = ckpt.join("step-000000000010").display().to_string();
    let last = String::from_utf8_lossy(&out.stderr)
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    for needle in [
        "no space left to write",
        folder.as_str(),
        "needs room for both",
    ] {
        assert!(
            last.contains(needle),
            "last line {last:?} lacks {needle:?}:\n{all}"
        );
        for rank in 0..2 {
            assert!(
                all.lines()
                    .any(|l| l.starts_with(&format!("[rank{rank}]")) && l.contains(needle)),
                "rank {rank} did not say {needle:?}:\n{all}"
            );
        }
    }
    // The sizes are numbers, with units.
    assert!(last.contains(" kB") || last.contains(" MB"), "{last}");
    // The checkpoint at step 5 is still the one to resume from, and nothing half-written stays.
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap().trim(),
        "step-000000000005"
    );
    assert_eq!(temporaries(&ckpt), Vec::<String>::new());
}

/// Every temporary file of a save under `dir`.
fn temporaries(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in walk(dir) {
        let name = entry.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with('.') && name.contains(".tmp-") {
            found.push(entry.display().to_string());
        }
    }
    found
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

/// The process id of a process that has ended.
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn what_killed_saves_leave_is_gone_after_the_next_resume_which_resumes_from_latest() {
    let dir = common::temp_dir("ckpt-leftovers");
    let ckpt = dir.join("ckpt");
    common::run_ok(job(&ckpt, &[]), LIMIT);
    let state = latest_state(&ckpt);
    let last = state.parent().unwrap().to_path_buf();
    let pid = dead_pid();
    // What a kill at each step of a save leaves: a half-written `latest`, a temporary state
    // file in the last checkpoint's folder, and a newer folder never completed, holding a
    // temporary file and a progress file.
    std::fs::write(ckpt.join(format!(".latest.tmp-{pid}")), "step-0000").unwrap();
    std::fs::write(
        last.join(format!(".state.safetensors.tmp-{pid}")),
        b"half a file",
    )
    .unwrap();
    let newer = ckpt.join("step-000000000015");
    std::fs::create_dir_all(&newer).unwrap();
    std::fs::write(newer.join(format!(".state.safetensors.tmp-{pid}")), b"x").unwrap();
    std::fs::copy(
        last.join("rank-0-of-2.progress.safetensors"),
        newer.join("rank-0-of-2.progress.safetensors"),
    )
    .unwrap();
    let out = common::run_ok(job_of(&ckpt, 2, 5, &[]), LIMIT);
    assert!(out.contains("Resumed at step 10"), "{out}");
    assert_eq!(temporaries(&ckpt), Vec::<String>::new(), "{out}");
    assert!(!newer.exists(), "the incomplete checkpoint is still there");

    // A whole job killed mid-run (SIGKILL to the launcher; the kernel kills its ranks), in the
    // middle of its saves (one every step), then resumed: nothing of the killed saves stays.
    let cmd = job_of(&ckpt, 6, 1, &[]);
    let ranks = common::Ranks::spawn(vec![cmd]);
    ranks.wait_for(0, "Checkpoint at step 25 saved", LIMIT);
    Command::new("kill")
        .args(["-KILL", &ranks.pid(0).to_string()])
        .status()
        .unwrap();
    drop(ranks.wait(LIMIT));
    let out = common::run_ok(job_of(&ckpt, 6, 5, &[]), LIMIT);
    assert!(out.contains("Resumed at step"), "{out}");
    assert_eq!(temporaries(&ckpt), Vec::<String>::new(), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_loss_that_is_not_a_number_stops_the_run_naming_the_step_unless_allowed() {
    let dir = common::temp_dir("ckpt-nan");
    let huge = ["--lr", "1e30"];
    let out = common::run(job(&dir.join("ckpt"), &huge), LIMIT);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("the training loss is") && all.contains("at step "),
        "{all}"
    );
    // Nothing was saved after the loss went bad: the first checkpoint comes at step 5, and
    // the loss is gone by then or the run stopped at that check.
    let allowed = common::run_ok(
        job(
            &dir.join("ckpt2"),
            &[&huge[..], &["--allow-non-finite"]].concat(),
        ),
        LIMIT,
    );
    assert!(allowed.contains("Epoch 1/1"), "{allowed}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_run_resumed_at_an_epochs_end_says_so_instead_of_an_empty_epoch() {
    let dir = common::temp_dir("ckpt-boundary");
    let ckpt = dir.join("ckpt");
    // One epoch of 10 steps, the last checkpoint at step 10: the epoch's end.
    common::run_ok(job(&ckpt, &[]), LIMIT);
    let out = common::run_ok(job_of(&ckpt, 2, 5, &[]), LIMIT);
    assert!(
        out.contains("Resumed at step 10 (epoch 1, 320 images"),
        "{out}"
    );
    assert!(
        out.contains("Epoch 1/2: trained before the restart"),
        "{out}"
    );
    assert!(!out.contains("Epoch 1/2: 0 images/s"), "{out}");
    assert!(out.contains("Epoch 2/2: "), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
}
