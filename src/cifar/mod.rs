//! CIFAR-10: the binary-format reader, an embedded synthetic stand-in, and the tutorial's Net.
//!
//! The reader takes the binary version (`cifar-10-batches-bin`: `data_batch_1.bin` ..
//! `data_batch_5.bin`, `test_batch.bin`; records of 1 label byte and 3072 pixel bytes in CHW
//! order) with any number of records per file. Batches are normalised as the PyTorch tutorial
//! does: `(x / 255 - 0.5) / 0.5`.
//!
//! Without the files, [`synthetic`] makes a deterministic CIFAR-shaped dataset of 10 classes
//! (objects in scenes, among clutter) that the tutorial's CNN learns about as it learns
//! CIFAR-10: no download needed.
//!
//! ```rust
//! use candle_core::Device;
//! use candle_parallel::cifar;
//! # fn main() -> candle_parallel::Result<()> {
//! let data = cifar::synthetic(64, 16, 0);
//! assert_eq!((data.train.len(), data.test.len()), (64, 16));
//! let (images, labels) = data.train.batch(&[0, 1, 2], &Device::Cpu)?;
//! assert_eq!(images.dims(), [3, 3, 32, 32]);
//! assert_eq!(labels.dims(), [3]);
//! # Ok(()) }
//! ```

mod error;
mod net;
mod reader;
mod synthetic;

pub use error::Error;
pub use net::{Net, NetBn};
pub use reader::{load, read_batch_file, write_batch_file, TEST_FILE, TRAIN_FILES};
pub use synthetic::synthetic;

use crate::error::Result;
use candle_core::{Device, Tensor};

/// Image side length.
pub const SIDE: usize = 32;
/// Colour channels.
pub const CHANNELS: usize = 3;
/// Bytes of one image (3 × 32 × 32, CHW).
pub const IMAGE_BYTES: usize = CHANNELS * SIDE * SIDE;
/// Bytes of one record of the binary format: the label, then the image.
pub const RECORD_BYTES: usize = 1 + IMAGE_BYTES;
/// The class names, by label.
pub const CLASSES: [&str; 10] = [
    "plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
];

/// A set of labelled images, kept as bytes and normalised batch by batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Split {
    /// `len() * IMAGE_BYTES` pixel bytes, image after image, each CHW.
    pub images: Vec<u8>,
    /// One label in `0..10` per image.
    pub labels: Vec<u8>,
}

/// The training and test splits.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cifar10 {
    /// The training images (50,000 in the real dataset).
    pub train: Split,
    /// The test images (10,000 in the real dataset).
    pub test: Split,
}

impl Split {
    /// The number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The first `n` images (all of them when `n` is larger).
    pub fn take(&self, n: usize) -> Split {
        let n = n.min(self.len());
        Split {
            images: self.images[..n * IMAGE_BYTES].to_vec(),
            labels: self.labels[..n].to_vec(),
        }
    }

    /// The images at `indices` as an f32 tensor `(B, 3, 32, 32)` normalised to `[-1, 1]` and
    /// their labels as a u32 tensor `(B,)`, on `device`.
    pub fn batch(&self, indices: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let mut pixels = Vec::with_capacity(indices.len() * IMAGE_BYTES);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            if i >= self.len() {
                return Err(crate::Error::InvalidArgument {
                    what: "CIFAR-10 batch index",
                    detail: format!("index {i} is past the split's {} images", self.len()),
                });
            }
            let image = &self.images[i * IMAGE_BYTES..(i + 1) * IMAGE_BYTES];
            pixels.extend(image.iter().map(|&p| (f32::from(p) / 255.0 - 0.5) / 0.5));
            labels.push(u32::from(self.labels[i]));
        }
        let b = indices.len();
        let images = Tensor::from_vec(pixels, (b, CHANNELS, SIDE, SIDE), &Device::Cpu)?;
        let labels = Tensor::from_vec(labels, b, &Device::Cpu)?;
        Ok((images.to_device(device)?, labels.to_device(device)?))
    }
}
