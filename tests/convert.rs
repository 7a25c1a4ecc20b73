//! The README's "Convert your training loop": `examples/mlp.rs` (one process) and
//! `examples/mlp_ddp.rs` (DistributedDataParallel) train alike, and the README shows the DDP
//! program as it is, with the true count of the lines the conversion changed.

mod common;

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const RUN: &str = env!("CARGO_BIN_EXE_candle-run");

/// The epoch losses and the test accuracy line a run printed (rank prefixes removed).
fn report(out: &str) -> (Vec<f64>, String) {
    let mut losses = Vec::new();
    let mut accuracy = None;
    for line in out.lines() {
        let line = line.strip_prefix("[rank0]: ").unwrap_or(line);
        if let Some((_, loss)) = line.split_once(": training loss ") {
            losses.push(loss.parse().expect("a loss"));
        } else if line.starts_with("test accuracy: ") {
            assert!(accuracy.is_none(), "two accuracy lines:\n{out}");
            accuracy = Some(line.to_string());
        }
    }
    (
        losses,
        accuracy.unwrap_or_else(|| panic!("no accuracy line:\n{out}")),
    )
}

fn weights(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).expect("a checkpoint")
}

#[test]
fn the_ddp_program_trains_as_the_one_process_program_on_2_and_4_ranks() {
    let dir = common::temp_dir("convert");
    let one_path = dir.join("one.safetensors");
    let mut cmd = Command::new(common::example("mlp"));
    cmd.arg(&one_path);
    let (one_losses, one_accuracy) = report(&common::run_ok(cmd, Duration::from_secs(60)));
    assert_eq!(one_losses.len(), 6);
    assert!(
        one_losses[5] < one_losses[0] / 3.0,
        "the MLP does not learn: {one_losses:?}"
    );

    // launch::spawn's 2 ranks, then candle-run's 4 (a global batch of 64 either way).
    let two_path = dir.join("two.safetensors");
    let mut two = Command::new(common::example("mlp_ddp"));
    two.arg(&two_path);
    let four_path = dir.join("four.safetensors");
    let mut four = Command::new(RUN);
    four.args(["--nproc-per-node", "4", "--master-port"])
        .arg(common::free_port().to_string())
        .arg(common::example("mlp_ddp"))
        .arg(&four_path);
    for (cmd, path) in [(two, &two_path), (four, &four_path)] {
        let desc = format!("{cmd:?}");
        let out = common::run_ok(cmd, Duration::from_secs(120));
        let (losses, accuracy) = report(&out);
        assert_eq!(
            losses.len(),
            one_losses.len(),
            "{desc}: only rank 0 prints:\n{out}"
        );
        for (a, b) in losses.iter().zip(&one_losses) {
            assert!(
                (a - b).abs() < 2e-6,
                "{desc}: {losses:?} against {one_losses:?}"
            );
        }
        assert_eq!(accuracy, one_accuracy, "{desc}");
        // Rank 0 saved the weights of the one-process run.
        let (ddp, one) = (weights(path), weights(&one_path));
        assert_eq!(ddp.len(), 6);
        for (name, t) in &ddp {
            let diff = common::max_abs_diff(t, &one[name]);
            assert!(diff < 1e-5, "{desc}: {name} differs by {diff}");
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The lines of code of a Rust file: neither blank nor only a comment.
fn code_lines(source: &str) -> Vec<&str> {
    source
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with("//"))
        .collect()
}

/// (added, removed) lines of the shortest line diff from `a` to `b` (a longest common
/// subsequence, as `diff` finds).
fn diff_counts(a: &[&str], b: &[&str]) -> (usize, usize) {
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let common = lcs[0][0];
    (b.len() - common, a.len() - common)
}

#[test]
fn the_readme_shows_the_ddp_program_as_it_is_with_its_true_diff_count() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    let (readme, one, ddp) = (
        read("README.md"),
        read("examples/mlp.rs"),
        read("examples/mlp_ddp.rs"),
    );
    assert!(
        readme.contains(&format!("```rust\n{ddp}```\n")),
        "README.md must show examples/mlp_ddp.rs whole, in a ```rust block"
    );
    let (added, removed) = diff_counts(&code_lines(&one), &code_lines(&ddp));
    let claim = format!("{added} lines of code added and {removed} removed");
    assert!(
        readme.contains(&claim),
        "README.md must say \"{claim}\" (the diff of examples/mlp.rs and mlp_ddp.rs)"
    );
    assert!(added > 0 && removed > 0);
}
