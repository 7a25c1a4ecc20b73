//! The examples, run as real processes.

mod common;
#[path = "../examples/common/plot.rs"]
mod plot;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use candle_parallel::cifar::{self, Net};
use candle_parallel::DataParallel;
use common::test_lines;
use std::process::Command;
use std::time::Duration;

/// The sorted input sizes each replica printed, batch by batch, and each batch's outside line.
fn tutorial_batches(devices: usize) -> Vec<(Vec<String>, String)> {
    let mut cmd = Command::new(common::example("dp_tutorial"));
    cmd.args(["--cpu", "--devices", &devices.to_string()]);
    let out = common::run_ok(cmd, Duration::from_secs(60));
    let mut batches = Vec::new();
    let mut inside = Vec::new();
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("\tIn Model: input size ") {
            inside.push(rest.to_string());
        } else if let Some(rest) = line.strip_prefix("Outside: input size ") {
            inside.sort();
            batches.push((std::mem::take(&mut inside), rest.to_string()));
        }
    }
    assert!(
        inside.is_empty(),
        "replica lines after the last batch:\n{out}"
    );
    assert_eq!(out.contains("Let's use"), devices > 1, "{out}");
    batches
}

fn repeat(line: &str, n: usize) -> Vec<String> {
    vec![line.to_string(); n]
}

const FULL: &str = "[30, 5] output_size [30, 2]";
const LAST: &str = "[10, 5] output_size [10, 2]";

/// How many rows of `logits` pick their label.
fn count_correct(logits: &Tensor, labels: &Tensor) -> usize {
    logits
        .argmax(D::Minus1)
        .unwrap()
        .eq(labels)
        .unwrap()
        .to_dtype(DType::U32)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<u32>()
        .unwrap() as usize
}

#[test]
fn tutorial_with_8_devices_splits_30_into_seven_fours_and_a_two() {
    let mut full = repeat("[4, 5] output size [4, 2]", 7);
    full.push("[2, 5] output size [2, 2]".to_string());
    full.sort();
    let batches = tutorial_batches(8);
    assert_eq!(batches.len(), 4);
    for (inside, outside) in &batches[..3] {
        assert_eq!(inside, &full);
        assert_eq!(outside, FULL);
    }
    assert_eq!(batches[3].0, repeat("[2, 5] output size [2, 2]", 5));
    assert_eq!(batches[3].1, LAST);
}

#[test]
fn tutorial_with_2_devices_splits_30_into_two_fifteens() {
    let batches = tutorial_batches(2);
    assert_eq!(batches.len(), 4);
    for (inside, outside) in &batches[..3] {
        assert_eq!(inside, &repeat("[15, 5] output size [15, 2]", 2));
        assert_eq!(outside, FULL);
    }
    assert_eq!(batches[3].0, repeat("[5, 5] output size [5, 2]", 2));
    assert_eq!(batches[3].1, LAST);
}

#[test]
fn tutorial_with_3_devices_splits_10_into_four_four_two() {
    let batches = tutorial_batches(3);
    assert_eq!(batches.len(), 4);
    for (inside, outside) in &batches[..3] {
        assert_eq!(inside, &repeat("[10, 5] output size [10, 2]", 3));
        assert_eq!(outside, FULL);
    }
    let mut last = repeat("[4, 5] output size [4, 2]", 2);
    last.insert(0, "[2, 5] output size [2, 2]".to_string());
    assert_eq!(batches[3].0, last);
    assert_eq!(batches[3].1, LAST);
}

#[test]
fn a_cifar_dp_checkpoint_loads_into_a_plain_net_with_the_same_predictions() {
    let dir = common::temp_dir("cifar-ckpt");
    let path = dir.join("net.safetensors");
    let (train, test, seed) = (512, 200, 3);
    let mut cmd = Command::new(common::example("cifar_dp"));
    cmd.args([
        "--cpu",
        "--devices",
        "2",
        "--epochs",
        "1",
        "--seed",
        &seed.to_string(),
    ])
    .args([
        "--train-size",
        &train.to_string(),
        "--test-size",
        &test.to_string(),
    ])
    .arg("--save")
    .arg(&path);
    let out = common::run_ok(cmd, Duration::from_secs(300));
    assert!(out.contains("Let's use 2 devices!"), "{out}");
    let (_, reported, _) = test_lines(&out);

    // A plain Net loads the checkpoint: same variable names, no `module.` prefix.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu).unwrap() };
    let plain = Net::new(vb).unwrap();
    let data = cifar::synthetic(train, test, seed);
    let indices: Vec<usize> = (0..test).collect();
    let (x, y) = data.test.batch(&indices, &Device::Cpu).unwrap();
    let logits = plain.forward(&x).unwrap();
    let correct = count_correct(&logits, &y);
    assert_eq!(
        correct, reported,
        "the plain Net's accuracy differs from the run's:\n{out}"
    );

    // The same checkpoint under DataParallel gives the same logits.
    let mut varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, vec![Device::Cpu; 3], Net::new).unwrap();
    varmap.load(&path).unwrap();
    let dp_logits = dp.forward_t(&x, false).unwrap();
    let diff = common::max_abs_diff(&dp_logits, &logits);
    assert!(diff <= 1e-6, "logits differ by {diff}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn cifar_ddp_on_2_processes_learns_like_cifar_dp_on_the_same_global_batch() {
    let dir = common::temp_dir("cifar-ddp");
    let path = dir.join("net.safetensors");
    // Two ranks of 64 make the global batch of 128 that cifar_dp takes in one process; with
    // the same seed both shuffle the same way, so they take the same steps.
    let mut cmd = Command::new(common::example("cifar_ddp"));
    cmd.args([
        "--nproc",
        "2",
        "--cpu",
        "--epochs",
        "1",
        "--batch-size",
        "64",
    ])
    .arg("--save")
    .arg(&path);
    let out = common::run_ok(cmd, Duration::from_secs(300));
    assert_eq!(out.matches("Let's use 2 processes!").count(), 1, "{out}");
    let (loss, correct, lines) = test_lines(&out);
    assert_eq!(lines, 1, "only rank 0 prints, once per epoch:\n{out}");
    // One epoch (100 steps) ends just past the Net's initial plateau: about 330.
    assert!(
        correct > 200,
        "{correct}/1000 after one epoch; chance is 100:\n{out}"
    );

    let mut cmd = Command::new(common::example("cifar_dp"));
    cmd.args(["--cpu", "--epochs", "1", "--batch-size", "128"]);
    let (dp_loss, dp_correct, _) = test_lines(&common::run_ok(cmd, Duration::from_secs(300)));
    common::assert_learns_alike((loss, correct), (dp_loss, dp_correct), &out);

    // Rank 0's checkpoint loads into a plain Net, which gets the accuracy the run reported
    // over its sharded test set: every test image counted once.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu).unwrap() };
    let plain = Net::new(vb).unwrap();
    let data = cifar::synthetic(12_800, 1_000, 0);
    let indices: Vec<usize> = (0..1_000).collect();
    let (x, y) = data.test.batch(&indices, &Device::Cpu).unwrap();
    let plain_correct = count_correct(&plain.forward(&x).unwrap(), &y);
    assert_eq!(plain_correct, correct);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn cifar_ddp_with_batch_norm_learns_with_sync_batch_norm_on_2_processes() {
    let mut cmd = Command::new(common::example("cifar_ddp"));
    cmd.args([
        "--nproc",
        "2",
        "--cpu",
        "--epochs",
        "1",
        "--batch-size",
        "32",
    ])
    .args(["--train-size", "6400", "--batch-norm"]);
    let out = common::run_ok(cmd, Duration::from_secs(300));
    let (_, correct, lines) = test_lines(&out);
    assert_eq!(lines, 1, "{out}");
    // BatchNorm has no initial plateau: about 490 after 100 steps.
    assert!(
        correct > 300,
        "{correct}/1000 after 100 steps; chance is 100:\n{out}"
    );
}

#[test]
fn cifar_dp_save_data_writes_the_synthetic_set_in_the_binary_format() {
    // What scripts/torch_cifar_synthetic.py reads: the same images, in the real set's files.
    let dir = common::temp_dir("cifar-save-data");
    let mut cmd = Command::new(common::example("cifar_dp"));
    cmd.args(["--cpu", "--epochs", "1", "--seed", "4"])
        .args(["--train-size", "23", "--test-size", "7", "--save-data"])
        .arg(&dir);
    common::run_ok(cmd, Duration::from_secs(60));
    assert_eq!(cifar::load(&dir).unwrap(), cifar::synthetic(23, 7, 4));
    let first = cifar::read_batch_file(dir.join(cifar::TRAIN_FILES[0])).unwrap();
    assert_eq!(first.len(), 5, "23 images over five files: 5, 5, 5, 5, 3");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_empty_test_set_is_an_error_like_an_empty_training_set() {
    for (flag, what) in [
        ("--test-size", "test set"),
        ("--train-size", "training set"),
    ] {
        let mut cmd = Command::new(common::example("cifar_dp"));
        cmd.args(["--cpu", "--epochs", "1", flag, "0"]);
        let out = common::run(cmd, Duration::from_secs(60));
        assert!(!out.status.success(), "{flag} 0 succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("the {what} is empty")), "{err}");
    }
}

/// A polyline of an SVG chart: its stroke width and points.
struct Polyline {
    width: u32,
    points: Vec<(f64, f64)>,
}

/// The `<polyline>` elements of `svg` (plotters writes every line and dash as one).
fn polylines(svg: &str) -> Vec<Polyline> {
    let attr = |tag: &str, name: &str| -> String {
        let start = tag.find(&format!(" {name}=\"")).expect(name) + name.len() + 3;
        tag[start..].split('"').next().unwrap().to_string()
    };
    svg.split("<polyline")
        .skip(1)
        .map(|tag| {
            let tag = tag.split("/>").next().unwrap();
            let points = attr(tag, "points")
                .split_whitespace()
                .map(|p| {
                    let (x, y) = p.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect();
            Polyline {
                width: attr(tag, "stroke-width").parse().unwrap(),
                points,
            }
        })
        .collect()
}

/// The accuracies (in percent) of every `Test set` line of `out`.
fn accuracies(out: &str) -> Vec<f64> {
    out.lines()
        .filter_map(|l| l.split("Accuracy: ").nth(1))
        .map(|a| {
            let (correct, n) = a.split(' ').next().unwrap().split_once('/').unwrap();
            100.0 * correct.parse::<f64>().unwrap() / n.parse::<f64>().unwrap()
        })
        .collect()
}

/// Checks a training chart of `epochs` epochs (not 2, as the legend's lines have two points):
/// the three series named, each drawn as one thick line through a point per epoch, and the accuracy line (the right panel's) ordered as the
/// run's test lines (a higher accuracy is higher up: a smaller pixel y).
fn check_training_chart(svg: &str, epochs: usize, out: &str) {
    assert!(svg.starts_with("<svg"), "not an SVG:\n{svg}");
    for name in [
        "training loss (mean over the epoch)",
        "test loss",
        "test accuracy",
    ] {
        assert!(svg.contains(name), "no {name:?} in the chart");
    }
    let lines: Vec<Polyline> = polylines(svg)
        .into_iter()
        .filter(|l| l.width == 3 && l.points.len() == epochs)
        .collect();
    assert_eq!(lines.len(), 3, "one line per series");
    assert_eq!(
        svg.matches("<circle").count(),
        3 * epochs,
        "a point per epoch"
    );
    let accuracy = lines
        .iter()
        .find(|l| l.points[0].0 > 500.0)
        .expect("the accuracy panel's line");
    let reported = accuracies(out);
    assert_eq!(reported.len(), epochs, "{out}");
    for i in 0..epochs {
        for j in 0..epochs {
            if reported[i] < reported[j] {
                assert!(
                    accuracy.points[i].1 >= accuracy.points[j].1,
                    "accuracy {reported:?} drawn at {:?}",
                    accuracy.points
                );
            }
        }
    }
}

#[test]
fn cifar_dp_plot_draws_loss_and_accuracy_per_epoch() {
    let dir = common::temp_dir("cifar-dp-plot");
    let path = dir.join("training.svg");
    let mut cmd = Command::new(common::example("cifar_dp"));
    cmd.args([
        "--cpu",
        "--epochs",
        "3",
        "--train-size",
        "512",
        "--test-size",
        "200",
    ])
    .arg("--plot")
    .arg(&path);
    let out = common::run_ok(cmd, Duration::from_secs(120));
    assert!(
        out.contains(&format!("Drew the chart to {}", path.display())),
        "{out}"
    );
    let svg = std::fs::read_to_string(&path).unwrap();
    check_training_chart(&svg, 3, &out);
    assert!(svg.contains("1 CPU replica on"), "the machine is named");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn cifar_ddp_plot_is_drawn_by_rank_0_alone() {
    let dir = common::temp_dir("cifar-ddp-plot");
    let path = dir.join("training.svg");
    let mut cmd = Command::new(common::example("cifar_ddp"));
    cmd.args([
        "--nproc",
        "2",
        "--cpu",
        "--epochs",
        "3",
        "--batch-size",
        "64",
    ])
    .args(["--train-size", "512", "--test-size", "200"])
    .arg("--plot")
    .arg(&path);
    let out = common::run_ok(cmd, Duration::from_secs(120));
    assert_eq!(out.matches("Drew the chart to").count(), 1, "{out}");
    let svg = std::fs::read_to_string(&path).unwrap();
    check_training_chart(&svg, 3, &out);
    assert!(svg.contains("2 processes on"), "the machine is named");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_plot_into_a_missing_folder_fails_before_training_and_names_the_path() {
    let dir = common::temp_dir("cifar-plot-missing");
    let path = dir.join("no-such-folder").join("training.svg");
    for example in ["cifar_dp", "cifar_ddp"] {
        let mut cmd = Command::new(common::example(example));
        cmd.args(["--cpu", "--epochs", "1", "--plot"]).arg(&path);
        let out = common::run(cmd, Duration::from_secs(60));
        assert!(!out.status.success(), "{example} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("cannot write the chart to {}", path.display())),
            "{example}: {err}"
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            !stdout.contains("Epoch"),
            "{example} trained first: {stdout}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_scaling_chart_labels_each_point_with_its_share_of_the_ideal_line() {
    let dir = common::temp_dir("scaling-chart");
    let path = dir.join("scaling.svg");
    let series = [
        plot::Series {
            name: "batch 128".into(),
            points: vec![(1, 100.0), (2, 150.0), (4, 200.0)],
        },
        plot::Series {
            name: "batch 512".into(),
            points: vec![(2, 300.0), (1, 160.0), (4, 560.0)],
        },
    ];
    let chart = plot::Scaling {
        title: "a title",
        subtitle: "first line\nsecond line",
        x_label: "devices",
        series: &series,
    };
    plot::scaling_chart(&path, &chart).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    for text in [
        "a title",
        "first line",
        "second line",
        "devices",
        "batch 128",
        "batch 512",
        ">\nimages/s\n<",
    ] {
        assert!(svg.contains(text), "no {text:?} in the chart");
    }
    // 150 of an ideal 200, 200 of 400; 300 of 320, 560 of 640.
    for share in ["75%", "50%", "94%", "88%"] {
        assert!(svg.contains(&format!(">\n{share}\n<")), "no {share} label");
    }
    let lines = polylines(&svg);
    let measured: Vec<&Polyline> = lines
        .iter()
        .filter(|l| l.width == 3 && l.points.len() == 3)
        .collect();
    assert_eq!(measured.len(), 2, "one line per series");
    // Sorted by count: the second series' points were given out of order.
    for line in &measured {
        assert!(line.points.windows(2).all(|w| w[0].0 < w[1].0));
    }
    // The ideal lines are dashed: many short thinner pieces.
    assert!(lines.iter().filter(|l| l.width == 2).count() > 10);

    // Lines 100x apart get a logarithmic axis.
    let series = [
        series[0].clone(),
        plot::Series {
            name: "big".into(),
            points: vec![(1, 10_000.0), (2, 19_000.0)],
        },
    ];
    let chart = plot::Scaling {
        series: &series,
        ..chart
    };
    plot::scaling_chart(&path, &chart).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.contains("images/s (log scale)"));
    assert!(svg.contains(">\n95%\n<"));

    let missing = dir.join("missing").join("scaling.svg");
    let err = plot::scaling_chart(&missing, &chart).unwrap_err();
    assert!(
        format!("{err:#}").contains(&missing.display().to_string()),
        "{err:#}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_model_parallel_tutorial_trains_as_one_device_plain_and_pipelined() {
    let mut cmd = Command::new(common::example("model_parallel"));
    cmd.args([
        "--cpu",
        "--steps",
        "4",
        "--hidden",
        "32",
        "--split-sizes",
        "7,50",
    ]);
    let out = common::run_ok(cmd, Duration::from_secs(120));
    assert!(out.contains("ToyModel: outputs [20, 5]"), "{out}");
    for mode in [
        "| one device |",
        "| model parallel |",
        "| pipelined | 7 |",
        "| pipelined | 50 |",
    ] {
        assert!(out.contains(mode), "no row `{mode}` in:\n{out}");
    }
    let worst: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("max weight difference from one device: "))
        .unwrap_or_else(|| panic!("no difference line in:\n{out}"))
        .parse()
        .unwrap();
    assert!(worst <= 1e-5, "{worst} away from one device:\n{out}");
}
