//! What the CIFAR-10 examples share: their training flags, the data they load, the progress
//! bar, and the per-batch test numbers.

use anyhow::{Context, Result};
use candle_core::{DType, Tensor, D};
use candle_nn::loss;
use candle_parallel::cifar::{self, Cifar10, Split};
use candle_parallel::optim::{FiniteLoss, SgdConfig};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};

/// The training flags of the CIFAR-10 examples (PyTorch tutorial defaults).
#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Folder with the CIFAR-10 binary files (data_batch_1.bin .. test_batch.bin); without it
    /// an embedded synthetic CIFAR-shaped dataset is used.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Passes over the training set.
    #[arg(long, default_value_t = 10)]
    pub epochs: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.01)]
    pub lr: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Use only the first N training images (synthetic default: 12800).
    #[arg(long)]
    pub train_size: Option<usize>,
    /// Use only the first N test images (synthetic default: 1000).
    #[arg(long)]
    pub test_size: Option<usize>,
    /// Seed of the initial weights, the shuffling and the synthetic data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save the trained weights here (safetensors, written atomically); they load into a
    /// plain `Net`.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also write the dataset used into this folder, in the CIFAR-10 binary format
    /// (data_batch_1.bin .. data_batch_5.bin, test_batch.bin): for
    /// scripts/torch_cifar_synthetic.py, which trains PyTorch's Net on the same images.
    #[arg(long, value_name = "DIR")]
    pub save_data: Option<PathBuf>,
    /// Draw the training loss (averaged over each epoch), the test loss and the test accuracy
    /// per epoch into this SVG file at the end of the run.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Go on training when a step's loss is NaN or infinite (by default the run stops with an
    /// error naming the step, before it saves anything).
    #[arg(long)]
    pub allow_non_finite: bool,
}

impl TrainArgs {
    /// The watch over the losses, unless `--allow-non-finite`.
    pub fn finite_loss(&self, device: &candle_core::Device) -> Result<Option<FiniteLoss>> {
        Ok(match self.allow_non_finite {
            true => None,
            false => Some(FiniteLoss::new(device)?),
        })
    }
}

/// The synthetic default: 100 steps of 128 per epoch, so the first epoch ends past the initial
/// loss plateau.
const SYNTHETIC_TRAIN: usize = 12_800;
const SYNTHETIC_TEST: usize = 1_000;

impl TrainArgs {
    /// The dataset: the files under `--data-dir`, or the synthetic one; cut to the sizes asked.
    pub fn load_data(&self) -> Result<Cifar10> {
        let data = match &self.data_dir {
            Some(dir) => cifar::load(dir)?,
            None => cifar::synthetic(
                self.train_size.unwrap_or(SYNTHETIC_TRAIN),
                self.test_size.unwrap_or(SYNTHETIC_TEST),
                self.seed,
            ),
        };
        let take =
            |split: &Split, n: Option<usize>| n.map_or_else(|| split.clone(), |n| split.take(n));
        let data = Cifar10 {
            train: take(&data.train, self.train_size),
            test: take(&data.test, self.test_size),
        };
        anyhow::ensure!(
            !data.train.is_empty(),
            "the training set is empty (--train-size 0, or empty training files)"
        );
        anyhow::ensure!(
            !data.test.is_empty(),
            "the test set is empty (--test-size 0, or an empty test_batch.bin): evaluation needs \
             at least one image"
        );
        if let Some(dir) = &self.save_data {
            save_data(&data, dir)?;
        }
        Ok(data)
    }

    /// What `data` (loaded with these flags) is, for a chart: "synthetic CIFAR-shaped data"
    /// or "CIFAR-10", and how many images each split holds.
    pub fn data_name(&self, data: &Cifar10) -> String {
        let what = if self.data_dir.is_some() {
            "CIFAR-10"
        } else {
            "synthetic CIFAR-shaped data"
        };
        format!(
            "{what}, {} training and {} test images",
            data.train.len(),
            data.test.len()
        )
    }

    /// The tutorial's SGD with these flags.
    pub fn sgd(&self) -> SgdConfig {
        SgdConfig {
            lr: self.lr,
            momentum: self.momentum,
            ..Default::default()
        }
    }
}

/// Writes `data` into `dir` in the CIFAR-10 binary format: the training images spread over the
/// five training files, the test images in the test file. Each file is written under a name of
/// its own and renamed, so ranks writing the same data at once leave whole files.
fn save_data(data: &Cifar10, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let files = cifar::TRAIN_FILES.len();
    let per_file = data.train.len().div_ceil(files);
    let parts = (0..files).map(|f| {
        let range =
            (f * per_file).min(data.train.len())..((f + 1) * per_file).min(data.train.len());
        Split {
            images: data.train.images
                [range.start * cifar::IMAGE_BYTES..range.end * cifar::IMAGE_BYTES]
                .to_vec(),
            labels: data.train.labels[range].to_vec(),
        }
    });
    let named = cifar::TRAIN_FILES
        .iter()
        .zip(parts)
        .chain([(&cifar::TEST_FILE, data.test.clone())]);
    for (name, split) in named {
        let path = dir.join(name);
        let temporary = dir.join(format!("{name}.{}.tmp", std::process::id()));
        cifar::write_batch_file(&temporary, &split)?;
        std::fs::rename(&temporary, &path)
            .with_context(|| format!("renaming {} to {}", temporary.display(), path.display()))?;
    }
    Ok(())
}

/// A progress bar over `len` images, showing the images per second.
pub fn progress_bar(len: usize, epoch: usize, epochs: usize) -> Result<ProgressBar> {
    let bar = ProgressBar::new(len as u64).with_style(
        ProgressStyle::with_template(
            "epoch {msg} [{bar:30}] {pos}/{len} images, {per_sec}, eta {eta}",
        )?
        .progress_chars("=> "),
    );
    bar.set_message(format!("{epoch}/{epochs}"));
    Ok(bar)
}

/// The summed cross-entropy of a batch's `logits` against `labels`, and how many it got right.
pub fn loss_and_correct(logits: &Tensor, labels: &Tensor) -> Result<(f64, usize)> {
    let mean = loss::cross_entropy(logits, labels)?.to_scalar::<f32>()?;
    let correct = logits
        .argmax(D::Minus1)?
        .eq(labels)?
        .to_dtype(DType::U32)?
        .sum_all()?
        .to_scalar::<u32>()? as usize;
    Ok((f64::from(mean) * labels.dim(0)? as f64, correct))
}

/// The seed's test line.
pub fn print_test_line(loss_sum: f64, correct: usize, n: usize) {
    println!(
        "Test set: Average loss: {:.4}, Accuracy: {correct}/{n} ({:.0}%)",
        loss_sum / n.max(1) as f64,
        100.0 * correct as f64 / n.max(1) as f64
    );
}
