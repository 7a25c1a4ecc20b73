//! The transformer example, run as real processes: one process and two with the same global
//! batch take the same steps, and what it saves loads into a plain model.

mod common;
#[path = "../examples/common/transformer.rs"]
mod transformer;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::process::Command;
use std::time::Duration;
use transformer::{Config, SortTask, Transformer, VOCAB};

/// A small model and task, so that a run takes about a second.
const SMALL: [&str; 15] = [
    "--cpu",
    "--layers",
    "1",
    "--dim",
    "32",
    "--heads",
    "2",
    "--digits",
    "4",
    "--train-size",
    "1024",
    "--test-size",
    "200",
    "--epochs",
    "3",
];

/// Each epoch's training loss and held-out exact matches, as the run printed them.
fn epochs(extra: &[&str]) -> (Vec<f64>, Vec<usize>, String) {
    let mut cmd = Command::new(common::example("transformer_ddp"));
    cmd.args(SMALL).args(extra);
    let out = common::run_ok(cmd, Duration::from_secs(120));
    let losses: Vec<f64> = out
        .lines()
        .filter_map(|l| l.split("train loss ").nth(1))
        .map(|s| {
            s.split(',')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("cannot parse the loss in {s:?}"))
        })
        .collect();
    let matches: Vec<usize> = out
        .lines()
        .filter_map(|l| l.strip_prefix("Held-out: exact match "))
        .map(|s| {
            s.split('/')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("cannot parse the exact matches in {s:?}"))
        })
        .collect();
    assert_eq!(
        losses.len(),
        3,
        "one loss line per epoch, rank 0 only:\n{out}"
    );
    assert_eq!(matches.len(), 3, "one held-out line per epoch:\n{out}");
    (losses, matches, out)
}

fn assert_same_steps(a: &(Vec<f64>, Vec<usize>, String), b: &(Vec<f64>, Vec<usize>, String)) {
    for (la, lb) in a.0.iter().zip(&b.0) {
        assert!(
            (la - lb).abs() <= 1e-4 * la.abs().max(1.0),
            "losses differ:\n{}\n---\n{}",
            a.2,
            b.2
        );
    }
    for (ma, mb) in a.1.iter().zip(&b.1) {
        assert!(
            ma.abs_diff(*mb) <= 2,
            "exact matches differ:\n{}\n---\n{}",
            a.2,
            b.2
        );
    }
}

#[test]
fn two_processes_print_the_losses_of_one_with_the_same_global_batch() {
    let one = epochs(&["--nproc", "1", "--batch-size", "32"]);
    assert!(!one.2.contains("Let's use"), "{}", one.2);
    // Training works at all: the loss falls, and the model sorts some held-out samples.
    assert!(
        one.0[2] < 0.8 * one.0[0],
        "the loss did not fall:\n{}",
        one.2
    );
    assert!(one.1[2] > one.1[0], "no held-out progress:\n{}", one.2);

    let two = epochs(&["--nproc", "2", "--batch-size", "16"]);
    assert_eq!(
        two.2.matches("Let's use 2 processes!").count(),
        1,
        "{}",
        two.2
    );
    assert_same_steps(&one, &two);

    // Two micro-batches of 8 on each of two ranks, summed under no_sync: the same steps again,
    // plain and fully sharded.
    for sharding in ["none", "full"] {
        let accumulated = epochs(&[
            "--nproc",
            "2",
            "--batch-size",
            "8",
            "--accumulate",
            "2",
            "--sharding",
            sharding,
        ]);
        assert_same_steps(&one, &accumulated);
    }

    // A different global batch takes different steps: the comparison above can tell.
    let other = epochs(&["--nproc", "2", "--batch-size", "32"]);
    assert!(
        (other.0[0] - one.0[0]).abs() > 1e-3,
        "a global batch of 64 printed the losses of 32:\n{}",
        other.2
    );
}

#[test]
fn activation_checkpointing_takes_exactly_the_steps_without_it_under_every_sharding() {
    for sharding in ["none", "zero2", "full"] {
        let base = ["--nproc", "2", "--batch-size", "16", "--sharding", sharding];
        let plain = epochs(&base);
        let recomputed = epochs(&[&base[..], &["--activation-checkpointing"]].concat());
        assert_eq!(
            (&plain.0, &plain.1),
            (&recomputed.0, &recomputed.1),
            "{sharding}:\n{}\n---\n{}",
            plain.2,
            recomputed.2
        );
    }
}

/// Each epoch's training loss of a 201-step run (3 epochs of 67, a global batch of 32) over
/// `nproc` processes, with `extra`.
fn losses_over_201_steps(nproc: usize, extra: &[&str]) -> (Vec<f64>, String) {
    let (batch, nproc) = ((32 / nproc).to_string(), nproc.to_string());
    let mut cmd = Command::new(common::example("transformer_ddp"));
    let small = [
        "--cpu", "--layers", "1", "--dim", "32", "--heads", "2", "--digits", "4",
    ];
    let data = ["--train-size", "2144", "--test-size", "50", "--epochs", "3"];
    cmd.args(small)
        .args(data)
        .args(["--batch-size", &batch, "--nproc", &nproc])
        .args(extra);
    let out = common::run_ok(cmd, Duration::from_secs(300));
    let losses = out
        .lines()
        .filter_map(|l| l.split("train loss ").nth(1))
        .map(|s| s.split(',').next().unwrap().parse().unwrap())
        .collect();
    (losses, out)
}

#[test]
fn bf16_and_f16_mixed_precision_track_f32_over_200_steps_under_every_sharding() {
    let (f32_losses, out) = losses_over_201_steps(1, &[]);
    assert_eq!(f32_losses.len(), 3, "{out}");
    let runs: [(usize, &[&str]); 4] = [
        (1, &["--precision", "bf16"]),
        (1, &["--precision", "f16"]),
        (2, &["--precision", "bf16", "--sharding", "zero2"]),
        (2, &["--precision", "f16", "--sharding", "full"]),
    ];
    for (nproc, extra) in runs {
        let (losses, mixed) = losses_over_201_steps(nproc, extra);
        // f32 master weights: within 2% of the f32 run's loss at every epoch (pure bf16
        // weights plateau far above it).
        assert_eq!(losses.len(), 3, "{mixed}");
        // And it did compute in half precision: not f32's numbers to the last digit.
        assert_ne!(losses, f32_losses, "{extra:?}\n{mixed}");
        for (a, b) in losses.iter().zip(&f32_losses) {
            assert!(
                (a - b).abs() <= 0.02 * b,
                "{extra:?}: {losses:?} against f32's {f32_losses:?}\n{mixed}"
            );
        }
    }
}

/// Half precision on the CPU in a build without the CPU's conversion instructions: the run
/// says once which flags to build with (on this CPU; where the build has them or the CPU has
/// not, it says nothing), and an f32 run never does.
#[test]
fn half_precision_in_a_build_that_slows_it_names_the_flags_once() {
    use candle_parallel::nn::half_build_flags_missing;
    for (precision, dtype) in [
        ("bf16", DType::BF16),
        ("f16", DType::F16),
        ("f32", DType::F32),
    ] {
        let mut cmd = Command::new(common::example("transformer_ddp"));
        // Warnings shown whatever the caller's RUST_LOG says.
        cmd.args(SMALL)
            .args(["--precision", precision])
            .env("RUST_LOG", "warn");
        let out = common::run(cmd, Duration::from_secs(120));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{precision}: {err}");
        let said: Vec<&str> = err.lines().filter(|l| l.contains("slow path")).collect();
        match half_build_flags_missing(dtype) {
            Some(flags) => {
                assert_eq!(
                    said.len(),
                    1,
                    "{precision}: once, not {}:\n{err}",
                    said.len()
                );
                let wanted = format!("-C target-feature={flags}");
                assert!(
                    said[0].contains(&wanted) && said[0].contains(&format!("{dtype:?}")),
                    "{precision}: the dtype and {wanted} named:\n{err}"
                );
            }
            None => assert!(said.is_empty(), "{precision}: nothing to say here:\n{err}"),
        }
    }
}

#[test]
fn bf16_compression_trains_to_nearly_the_same_losses() {
    let plain = epochs(&["--nproc", "2", "--batch-size", "16"]);
    let bf16 = epochs(&[
        "--nproc",
        "2",
        "--batch-size",
        "16",
        "--compression",
        "bf16",
    ]);
    let diffs: Vec<f64> = plain
        .0
        .iter()
        .zip(&bf16.0)
        .map(|(a, b)| (a - b).abs())
        .collect();
    // Rounded gradients change the steps a little (so the flag took effect), not the training.
    assert!(
        diffs.iter().any(|&d| d > 0.0),
        "bf16 changed nothing:\n{}",
        bf16.2
    );
    assert!(
        diffs.iter().all(|&d| d < 1e-2),
        "bf16 trained differently:\n{}\n---\n{}",
        plain.2,
        bf16.2
    );
}

#[test]
fn the_saved_model_loads_into_a_plain_transformer_that_sorts_as_reported() {
    let dir = common::temp_dir("transformer-save");
    let path = dir.join("tf.safetensors");
    let path_arg = path.to_str().unwrap();
    let (_, matches, out) = epochs(&["--nproc", "2", "--batch-size", "16", "--save", path_arg]);
    assert!(out.contains("Saved the model to"), "{out}");

    // Plain names: a Transformer built straight from the file, no DDP, no prefix.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu).unwrap() };
    let config = Config {
        vocab: VOCAB,
        max_len: 8,
        dim: 32,
        heads: 2,
        layers: 1,
        checkpoint_every: 0,
    };
    let model = Transformer::new(config, vb).unwrap();
    let (_, test) = SortTask::generate(4, 1024, 200, 0);
    let all: Vec<usize> = (0..test.size()).collect();
    let (inputs, answers) = test.batch(&all, &Device::Cpu).unwrap();
    let correct = test.exact_matches(&model, &inputs, &answers).unwrap();
    assert_eq!(correct, matches[2], "the run reported otherwise:\n{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_width_that_heads_do_not_divide_is_an_error_naming_the_flags() {
    let mut cmd = Command::new(common::example("transformer_ddp"));
    cmd.args(["--cpu", "--dim", "30", "--heads", "4"]);
    let out = common::run(cmd, Duration::from_secs(60));
    assert!(!out.status.success(), "--dim 30 --heads 4 succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--dim 30 is not a multiple of --heads 4"),
        "{err}"
    );
}

/// The numbers of the run's last line, `memory per rank: parameters P MiB, gradients G MiB,
/// optimizer O MiB, peak RSS R MiB`.
fn memory_line(out: &str) -> [f64; 4] {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("memory per rank: "))
        .unwrap_or_else(|| panic!("no memory line:\n{out}"));
    let values: Vec<f64> = line
        .split(", ")
        .map(|part| {
            let words: Vec<&str> = part.split(' ').collect();
            words[words.len() - 2].parse().unwrap()
        })
        .collect();
    values.try_into().unwrap()
}

#[test]
fn fully_sharded_takes_the_steps_of_ddp_and_keeps_a_shard_of_the_state() {
    let ddp = epochs(&["--nproc", "2", "--batch-size", "16"]);
    let full = epochs(&["--nproc", "2", "--batch-size", "16", "--sharding", "full"]);
    assert_same_steps(&ddp, &full);
    let (d, f) = (memory_line(&ddp.2), memory_line(&full.2));
    // Parameters, gradients and AdamW's moments: each rank keeps about half.
    for i in 0..3 {
        assert!(
            (f[i] - d[i] / 2.0).abs() <= 0.01 * d[i] + 0.01,
            "memory column {i}: {} with full sharding, {} without:\n{}",
            f[i],
            d[i],
            full.2
        );
    }
    assert!(f[3] > 0.0, "no peak RSS:\n{}", full.2);
}

#[test]
fn a_memory_budget_that_only_full_sharding_fits_is_checked_and_said() {
    // 13,739 parameters: 0.21 MiB of AdamW state unsharded, 0.10 MiB per rank over 2.
    let args = [
        "--nproc",
        "2",
        "--batch-size",
        "16",
        "--memory-budget",
        "0.15",
    ];
    let mut cmd = Command::new(common::example("transformer_ddp"));
    cmd.args(SMALL).args(args);
    let out = common::run(cmd, Duration::from_secs(120));
    assert!(!out.status.success(), "DDP ran over its budget");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("over the --memory-budget of 0.15 MiB"),
        "{err}"
    );
    let (_, _, out) = epochs(&[&args[..], &["--sharding", "full"]].concat());
    assert!(
        out.contains(
            "takes 0.21 MiB and does not fit; with --sharding full over 2 ranks each keeps 0.10 MiB, \
             which fits"
        ),
        "{out}"
    );
}

/// The model the tensor-parallel runs train: 4 heads, so that 4 ranks can share them.
const CUT: [&str; 17] = [
    "--cpu",
    "--layers",
    "2",
    "--dim",
    "32",
    "--heads",
    "4",
    "--digits",
    "4",
    "--train-size",
    "640",
    "--test-size",
    "50",
    "--epochs",
    "1",
    "--warmup",
    "0.2",
];

/// 20 steps (640 samples, a global batch of 32) with `extra`: the loss line's value, the saved
/// weights and the output.
fn twenty_steps(extra: &[&str], dir: &std::path::Path) -> (f64, Vec<(String, Tensor)>, String) {
    let path = dir.join(format!("{}.safetensors", extra.join("_").replace('-', "")));
    let mut cmd = Command::new(common::example("transformer_ddp"));
    cmd.args(CUT).args(extra).arg("--save").arg(&path);
    let out = common::run_ok(cmd, Duration::from_secs(120));
    let loss = out
        .lines()
        .find_map(|l| l.split("train loss ").nth(1))
        .and_then(|s| s.split(',').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no loss line:\n{out}"));
    let mut weights: Vec<(String, Tensor)> = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    (loss, weights, out)
}

#[test]
fn tensor_parallel_on_dp_by_tp_meshes_takes_the_steps_of_one_process_and_saves_its_weights() {
    let dir = common::temp_dir("transformer-tp");
    for clip in [&[][..], &["--clip-grad-norm", "0.5"][..]] {
        let (one, want, _) = twenty_steps(&[clip, &["--batch-size", "32"]].concat(), &dir);
        let runs: [(&[&str], &str); 5] = [
            (
                &["--tensor-parallel", "2", "--batch-size", "16"],
                "Mesh [dp 2, tp 2]",
            ),
            (
                &[
                    "--tensor-parallel",
                    "2",
                    "--sequence-parallel",
                    "--batch-size",
                    "16",
                ],
                "Mesh [dp 2, tp 2]: each block cut over 2 ranks, sequence parallel",
            ),
            (
                &[
                    "--tensor-parallel",
                    "2",
                    "--sequence-parallel",
                    "--sharding",
                    "zero2",
                ],
                "Mesh [dp 2, tp 2]",
            ),
            (
                &["--tensor-parallel", "4", "--batch-size", "32"],
                "Mesh [dp 1, tp 4]",
            ),
            (
                &[
                    "--tensor-parallel",
                    "4",
                    "--sequence-parallel",
                    "--batch-size",
                    "32",
                ],
                "Mesh [dp 1, tp 4]",
            ),
        ];
        for (flags, mesh) in runs {
            let batch: &[&str] = match flags.contains(&"--batch-size") {
                true => &[],
                false => &["--batch-size", "16"],
            };
            let extra = [clip, &["--nproc", "4"], flags, batch].concat();
            let (loss, got, out) = twenty_steps(&extra, &dir);
            assert!(out.contains(mesh), "{out}");
            // Each rank holds 1/tp of the blocks' cut weights (the packed projection's and the
            // MLP's first layer's weights and biases, the other two layers' weights) and the
            // rest whole: layers 2, dim 32, vocabulary 11, 8 positions.
            let tp: usize = flags[1].parse().unwrap();
            let (d, layers) = (32, 2);
            let cut = layers * (3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d);
            let total = 11 * d + 8 * d + layers * (12 * d * d + 13 * d) + 2 * d + d * 11 + 11;
            let line = format!("Parameters per rank: {} of {total}", total - cut + cut / tp);
            assert!(out.contains(&line), "{line}:\n{out}");
            assert!(
                (loss - one).abs() <= 1e-5,
                "{extra:?}: loss {loss} against one process's {one}\n{out}"
            );
            // The parts put back together: the one-process model's names, shapes and values.
            assert_eq!(got.len(), want.len(), "{extra:?}");
            for ((name, a), (want_name, b)) in got.iter().zip(&want) {
                assert_eq!(name, want_name, "{extra:?}");
                assert_eq!(a.dims(), b.dims(), "{extra:?}: {name}");
                // The keys' bias adds the same score to a query's every key, which softmax
                // ignores: its gradient is zero but for float noise, which AdamW's division
                // by the noise's own size turns into full steps. Compare the queries' and the
                // values' biases.
                let (a, b) = match name.ends_with("attn.qkv.bias") {
                    true => {
                        let ends = |t: &Tensor| {
                            let d = t.dim(0).unwrap() / 3;
                            Tensor::cat(
                                &[t.narrow(0, 0, d).unwrap(), t.narrow(0, 2 * d, d).unwrap()],
                                0,
                            )
                            .unwrap()
                        };
                        (ends(a), ends(b))
                    }
                    false => (a.clone(), b.clone()),
                };
                let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
                let diff = diff.to_scalar::<f32>().unwrap();
                assert!(
                    diff <= 1e-5,
                    "{extra:?}: {name} differs by {diff} after 20 steps"
                );
            }
        }
    }
    // And the file loads into a plain Transformer.
    let saved = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("sequenceparallel"))
        .unwrap();
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[&saved], DType::F32, &Device::Cpu).unwrap()
    };
    let config = Config {
        vocab: VOCAB,
        max_len: 8,
        dim: 32,
        heads: 4,
        layers: 2,
        checkpoint_every: 0,
    };
    Transformer::new(config, vb).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tensor_parallel_flags_that_cannot_work_are_errors_naming_them() {
    let cases: [(&[&str], &str); 5] = [
        (
            &[
                "--nproc",
                "4",
                "--tensor-parallel",
                "3",
                "--heads",
                "3",
                "--dim",
                "33",
            ],
            "--tensor-parallel 3 must divide the 4 processes",
        ),
        (
            &[
                "--nproc",
                "4",
                "--tensor-parallel",
                "4",
                "--heads",
                "2",
                "--dim",
                "32",
            ],
            "--tensor-parallel 4 must divide --heads 2 and --dim 32",
        ),
        (
            &["--sequence-parallel", "--heads", "2", "--dim", "32"],
            "--sequence-parallel splits the sequence over the --tensor-parallel ranks",
        ),
        (
            &[
                "--nproc",
                "4",
                "--tensor-parallel",
                "4",
                "--sequence-parallel",
                "--digits",
                "3",
            ],
            "needs a sequence (2 x --digits = 6) that is a multiple of 4",
        ),
        (
            &[
                "--nproc",
                "4",
                "--tensor-parallel",
                "2",
                "--sharding",
                "full",
            ],
            "--tensor-parallel runs with --sharding none or zero2",
        ),
    ];
    for (flags, want) in cases {
        let mut cmd = Command::new(common::example("transformer_ddp"));
        cmd.args([
            "--cpu",
            "--epochs",
            "1",
            "--train-size",
            "64",
            "--test-size",
            "8",
        ]);
        cmd.args(flags);
        let out = common::run(cmd, Duration::from_secs(60));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} succeeded");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
}

#[test]
fn held_out_samples_that_leave_none_to_train_on_are_an_error_not_a_hang() {
    let mut cmd = Command::new(common::example("transformer_ddp"));
    cmd.args([
        "--cpu",
        "--digits",
        "1",
        "--train-size",
        "64",
        "--test-size",
        "50",
    ]);
    let out = common::run(cmd, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("take all 10 samples of 1 digits (--digits), leaving none to train on"),
        "{err}"
    );
}
