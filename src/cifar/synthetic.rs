//! A deterministic, CIFAR-shaped synthetic dataset, generated in code (no download).
//!
//! Each of the 10 classes has a fixed prototype image: a few coloured blobs over a tinted,
//! striped background. A sample is its class's prototype moved by up to two pixels, sometimes
//! mirrored, with random contrast and tint, a second prototype of another class blended in, and
//! strong pixel noise. A CNN must learn colours and shapes that survive those changes.
//!
//! The class signal is deliberately strong: from PyTorch's initialisation at lr 0.01 the
//! tutorial's Net sits on a loss plateau (ln 10) for its first ~60-90 steps whatever the data,
//! and the default run's first epoch (100 steps of 128) must end well past it.
//!
//! Every sample is generated from its own seed (the dataset seed, the split and its index), so
//! a larger dataset starts with the same images as a smaller one with the same seed.

use super::{Cifar10, Split, CHANNELS, IMAGE_BYTES, SIDE};
use crate::rng::{splitmix64, Rng};

/// Seeds the class prototypes: the same for every dataset seed, so train and test agree.
const PROTOTYPE_SEED: u64 = 0xC1FA_2010;

/// A synthetic dataset of `train` training and `test` test images, fixed by `seed`.
pub fn synthetic(train: usize, test: usize, seed: u64) -> Cifar10 {
    let prototypes: Vec<Vec<f32>> = (0..10).map(prototype).collect();
    Cifar10 {
        train: split(&prototypes, train, seed, 1),
        test: split(&prototypes, test, seed, 2),
    }
}

/// A class's prototype, `CHANNELS * SIDE * SIDE` values around [-1, 1].
fn prototype(class: u64) -> Vec<f32> {
    let mut rng = Rng::new(PROTOTYPE_SEED.wrapping_add(class));
    let tint: Vec<f64> = (0..CHANNELS).map(|_| rng.uniform_in(-1.0, 1.0)).collect();
    let (freq, angle) = (rng.uniform_in(0.25, 0.7), rng.uniform_in(0.0, 3.15));
    let (fx, fy, phase) = (
        freq * angle.cos(),
        freq * angle.sin(),
        rng.uniform_in(0.0, 6.3),
    );
    let stripes: Vec<f64> = (0..CHANNELS).map(|_| rng.uniform_in(-0.35, 0.35)).collect();
    let blobs: Vec<(f64, f64, f64, Vec<f64>)> = (0..3)
        .map(|_| {
            let (cx, cy) = (rng.uniform_in(7.0, 25.0), rng.uniform_in(7.0, 25.0));
            let sigma = rng.uniform_in(2.5, 6.0);
            let colour = (0..CHANNELS).map(|_| rng.uniform_in(-1.0, 1.0)).collect();
            (cx, cy, sigma, colour)
        })
        .collect();
    let mut image = vec![0f32; IMAGE_BYTES];
    for y in 0..SIDE {
        for x in 0..SIDE {
            let (xf, yf) = (x as f64, y as f64);
            let wave = (fx * xf + fy * yf + phase).sin();
            for c in 0..CHANNELS {
                let mut v = tint[c] + stripes[c] * wave;
                for (cx, cy, sigma, colour) in &blobs {
                    let d2 = (xf - cx).powi(2) + (yf - cy).powi(2);
                    v += colour[c] * (-d2 / (2.0 * sigma * sigma)).exp();
                }
                image[(c * SIDE + y) * SIDE + x] = v as f32;
            }
        }
    }
    image
}

fn split(prototypes: &[Vec<f32>], n: usize, seed: u64, stream: u64) -> Split {
    let mut out = Split {
        images: Vec::with_capacity(n * IMAGE_BYTES),
        labels: Vec::with_capacity(n),
    };
    let mut mix = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream;
    let base = splitmix64(&mut mix);
    let mut pixels = vec![0f32; IMAGE_BYTES];
    for i in 0..n {
        let mut rng = Rng::new(base ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let label = rng.below(10) as usize;
        sample(prototypes, label, &mut rng, &mut pixels);
        out.labels.push(label as u8);
        out.images.extend(pixels.iter().map(|&v| {
            let byte = ((v * 0.5 + 0.5) * 255.0).round();
            byte.clamp(0.0, 255.0) as u8
        }));
    }
    out
}

/// Draws one image of class `label` into `out`.
fn sample(prototypes: &[Vec<f32>], label: usize, rng: &mut Rng, out: &mut [f32]) {
    let mut other = rng.below(9) as usize;
    if other >= label {
        other += 1;
    }
    let shift = |rng: &mut Rng| rng.below(5) as isize - 2;
    let (dx, dy, flip) = (shift(rng), shift(rng), rng.below(4) == 0);
    let (odx, ody) = (shift(rng), shift(rng));
    let contrast = rng.uniform_in(1.0, 1.6) as f32;
    let blend = rng.uniform_in(0.0, 0.7) as f32;
    let tint: Vec<f32> = (0..CHANNELS)
        .map(|_| rng.uniform_in(-0.3, 0.3) as f32)
        .collect();
    let at = |image: &[f32], c: usize, y: isize, x: isize| -> f32 {
        let clamp = |v: isize| v.clamp(0, SIDE as isize - 1) as usize;
        image[(c * SIDE + clamp(y)) * SIDE + clamp(x)]
    };
    for c in 0..CHANNELS {
        for y in 0..SIDE as isize {
            for x in 0..SIDE as isize {
                let sx = if flip { SIDE as isize - 1 - x } else { x };
                let main = at(&prototypes[label], c, y + dy, sx + dx);
                let extra = at(&prototypes[other], c, y + ody, x + odx);
                let noise = 0.5 * rng.normal() as f32;
                out[(c * SIDE + y as usize) * SIDE + x as usize] =
                    contrast * main + blend * extra + tint[c] + noise;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_deterministic_and_prefix_stable() {
        let a = synthetic(40, 10, 5);
        assert_eq!(a, synthetic(40, 10, 5));
        let b = synthetic(20, 10, 5);
        assert_eq!(b.train, a.train.take(20));
        assert_eq!(b.test, a.test);
        assert_ne!(synthetic(40, 10, 6).train, a.train);
    }

    #[test]
    fn classes_are_balanced_and_pixels_spread() {
        let d = synthetic(2000, 0, 0);
        let mut counts = [0usize; 10];
        for &l in &d.train.labels {
            counts[l as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (150..250).contains(&c)),
            "{counts:?}"
        );
        let mean =
            d.train.images.iter().map(|&p| f64::from(p)).sum::<f64>() / d.train.images.len() as f64;
        assert!((60.0..200.0).contains(&mean), "{mean}");
        let saturated = d
            .train
            .images
            .iter()
            .filter(|&&p| p == 0 || p == 255)
            .count();
        assert!(
            saturated * 3 < d.train.images.len(),
            "too many clipped pixels: {saturated}"
        );
    }
}
