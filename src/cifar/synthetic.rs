//! A deterministic, CIFAR-shaped synthetic dataset, generated in code (no download), that the
//! tutorial's Net learns about as it learns CIFAR-10.
//!
//! Every image is an object of its class in a scene, among smaller objects of other classes:
//! - **Scenes** are a sky, a road, a room or a meadow: two colours split by a tilted horizon,
//!   with a wave texture, mixed with random colours. Classes share them as in CIFAR-10 (planes,
//!   birds and ships over sky; cars and trucks on roads; cats and dogs in rooms; deer, frogs
//!   and horses in meadows), so the scene alone tells a class from at best a few others.
//! - **Objects**: each class has four kinds, each two to four parts (ellipses, boxes,
//!   triangles, rings). The classes of a scene share one colour of their palettes; the other
//!   is half the class's own. An object is drawn at a random place, size, angle and mirroring,
//!   with its colours scaled and tinted, or, in 30% of images, any colours at all.
//! - **Clutter**: up to two smaller objects of other classes, behind the main one, and pixel
//!   noise.
//!
//! The scenes are the easy signal: from PyTorch's initialisation at lr 0.01 the Net sits on a
//! loss plateau (ln 10) for its first ~60-90 steps, and the scenes' large differences between
//! class means are what moves it off soonest. Telling the objects of a scene apart is the
//! hard part, learnt slowly. With `cifar_dp`'s defaults (12,800 images, batch 128, SGD 0.01,
//! momentum 0.9) the test accuracy is about 30-40% after the first epoch and about 60% after
//! ten, as on CIFAR-10; `scripts/torch_cifar_synthetic.py` trains PyTorch's Net on the same
//! images for comparison.
//!
//! Every sample is generated from its own seed (the dataset seed, the split and its index), so
//! a larger dataset starts with the same images as a smaller one with the same seed. The
//! objects' shapes and colours are the same for every dataset seed, so train and test agree.

use super::{Cifar10, Split, CHANNELS, IMAGE_BYTES, SIDE};
use crate::rng::{splitmix64, Rng};
use std::f64::consts::{PI, TAU};

/// Seeds the objects' shapes and palettes: the same for every dataset seed.
const OBJECT_SEED: u64 = 0xC1FA_2010;
/// Kinds of object per class.
const KINDS: usize = 4;
/// The scene of each class, by label (plane, car, bird, cat, deer, dog, frog, horse, ship,
/// truck): sky, road, room, meadow.
const SCENE_OF: [usize; 10] = [0, 1, 0, 2, 3, 2, 3, 3, 0, 1];

/// A backdrop: `top` above the horizon (`horizon` pixels from the top), `bottom` below.
struct Scene {
    top: [f32; 3],
    bottom: [f32; 3],
    horizon: f32,
}

/// Sky, road, room and meadow, in the `[-1, 1]` range of normalised pixels.
const SCENES: [Scene; 4] = [
    Scene {
        top: [-0.1, 0.2, 0.9],
        bottom: [-0.5, -0.2, 0.3],
        horizon: 24.0,
    },
    Scene {
        top: [0.1, 0.1, 0.1],
        bottom: [-0.6, -0.6, -0.5],
        horizon: 14.0,
    },
    Scene {
        top: [0.6, 0.3, -0.1],
        bottom: [0.0, -0.4, -0.7],
        horizon: 19.0,
    },
    Scene {
        top: [0.3, 0.5, 0.8],
        bottom: [-0.5, 0.3, -0.6],
        horizon: 9.0,
    },
];
/// How far each image's backdrop is pulled from random colours towards its scene's.
const SCENE_WEIGHT: f32 = 0.8;
/// The share of images whose object has colours unrelated to its class.
const RECOLOURED: f64 = 0.3;
/// The standard deviation of the (uniform) pixel noise.
const NOISE: f32 = 0.15;

/// A synthetic dataset of `train` training and `test` test images, fixed by `seed`.
pub fn synthetic(train: usize, test: usize, seed: u64) -> Cifar10 {
    let objects: Vec<Vec<Object>> = (0..10).map(class_objects).collect();
    Cifar10 {
        train: split(&objects, train, seed, 1),
        test: split(&objects, test, seed, 2),
    }
}

#[derive(Clone, Copy, Debug)]
enum Shape {
    Ellipse,
    Box,
    Triangle,
    Ring,
}

/// A filled shape of an object, placed in the object's frame (pixels at scale 1).
#[derive(Clone, Debug)]
struct Part {
    shape: Shape,
    x: f32,
    y: f32,
    rx: f32,
    ry: f32,
    angle: f32,
    colour: [f32; 3],
}

/// The parts of an object, drawn in order (the first, the body, is the largest).
type Object = Vec<Part>;

fn colour(rng: &mut Rng, lo: f64, hi: f64) -> [f32; 3] {
    [0, 1, 2].map(|_| rng.uniform_in(lo, hi) as f32)
}

/// The kinds of object of `class`.
fn class_objects(class: u64) -> Vec<Object> {
    // The classes of a scene share one palette colour and half of the other.
    let scene = SCENE_OF[class as usize] as u64;
    let mut scene_rng = Rng::new(OBJECT_SEED.wrapping_add(1000 + scene));
    let mut class_rng = Rng::new(OBJECT_SEED.wrapping_add(3000 + class));
    let shared = colour(&mut scene_rng, -1.0, 1.0);
    let scene_own = colour(&mut scene_rng, -1.0, 1.0);
    let class_own = colour(&mut class_rng, -1.0, 1.0);
    let own = [0, 1, 2].map(|c| scene_own[c] + 0.5 * (class_own[c] - scene_own[c]));
    let palette = [shared, own];
    let mut rng = Rng::new(OBJECT_SEED.wrapping_add(class));
    (0..KINDS)
        .map(|_| {
            let parts = 2 + rng.below(3);
            (0..parts)
                .map(|i| {
                    let shape = match rng.below(4) {
                        0 => Shape::Ellipse,
                        1 => Shape::Box,
                        2 => Shape::Triangle,
                        _ => Shape::Ring,
                    };
                    // The body near the centre, smaller parts around it.
                    let (reach, lo, hi) = if i == 0 {
                        (2.0, 5.0, 9.0)
                    } else {
                        (7.0, 2.0, 5.5)
                    };
                    let base = palette[rng.below(2) as usize];
                    Part {
                        shape,
                        x: rng.uniform_in(-reach, reach) as f32,
                        y: rng.uniform_in(-reach, reach) as f32,
                        rx: rng.uniform_in(lo, hi) as f32,
                        ry: rng.uniform_in(lo, hi) as f32,
                        angle: rng.uniform_in(0.0, PI) as f32,
                        colour: base.map(|c| c + rng.uniform_in(-0.25, 0.25) as f32),
                    }
                })
                .collect()
        })
        .collect()
}

/// Where and how an object is drawn: its centre, scale, rotation, mirroring, and the gain and
/// shift applied to its colours.
struct Placement {
    x: f32,
    y: f32,
    scale: f32,
    angle: f32,
    flip: bool,
    gain: [f32; 3],
    shift: [f32; 3],
}

impl Placement {
    /// A placement at `(x, y)` and `scale` with a random angle, mirroring and colour change.
    fn random(rng: &mut Rng, x: f32, y: f32, scale: f32) -> Self {
        Placement {
            x,
            y,
            scale,
            angle: rng.uniform_in(-0.6, 0.6) as f32,
            flip: rng.below(2) == 0,
            gain: colour(rng, 0.6, 1.2),
            shift: colour(rng, -0.25, 0.25),
        }
    }
}

/// Draws `object` over `canvas` (`CHANNELS * SIDE * SIDE` values), its edges anti-aliased.
fn draw(canvas: &mut [f32], object: &Object, at: &Placement) {
    let (sin, cos) = at.angle.sin_cos();
    for part in object {
        let (px, part_angle) = if at.flip {
            (-part.x, -part.angle)
        } else {
            (part.x, part.angle)
        };
        let cx = at.x + at.scale * (cos * px - sin * part.y);
        let cy = at.y + at.scale * (sin * px + cos * part.y);
        let (rx, ry) = (part.rx * at.scale, part.ry * at.scale);
        let (ps, pc) = (part_angle + at.angle).sin_cos();
        let reach = rx.max(ry) * 1.5 + 1.0;
        let span = |c: f32| {
            let lo = (c - reach).floor().max(0.0) as usize;
            let hi = ((c + reach).ceil().max(0.0) as usize).min(SIDE - 1);
            lo..=hi
        };
        let col: [f32; 3] = [0, 1, 2].map(|c| part.colour[c] * at.gain[c] + at.shift[c]);
        let small = rx.min(ry);
        for y in span(cy) {
            for x in span(cx) {
                let (dx, dy) = (x as f32 - cx, y as f32 - cy);
                let (u, v) = (pc * dx + ps * dy, pc * dy - ps * dx);
                // About the signed distance to the edge, in pixels (negative inside).
                let distance = match part.shape {
                    Shape::Ellipse => ((u / rx).hypot(v / ry) - 1.0) * small,
                    Shape::Box => (u.abs() - rx).max(v.abs() - ry),
                    Shape::Triangle => {
                        let side =
                            (u.abs() * 2.0 * ry - (v + ry) * rx) / (4.0 * ry * ry + rx * rx).sqrt();
                        (v - ry).max(side)
                    }
                    Shape::Ring => ((u / rx).hypot(v / ry) - 1.0).abs() * small - 0.3 * small,
                };
                let cover = (0.5 - distance).clamp(0.0, 1.0);
                if cover > 0.0 {
                    for (c, &value) in col.iter().enumerate() {
                        let p = &mut canvas[(c * SIDE + y) * SIDE + x];
                        *p += cover * (value - *p);
                    }
                }
            }
        }
    }
}

fn split(objects: &[Vec<Object>], n: usize, seed: u64, stream: u64) -> Split {
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
        sample(objects, label, &mut rng, &mut pixels);
        out.labels.push(label as u8);
        out.images.extend(pixels.iter().map(|&v| {
            let byte = ((v * 0.5 + 0.5) * 255.0).round();
            byte.clamp(0.0, 255.0) as u8
        }));
    }
    out
}

/// Draws one image of class `label` into `out`.
fn sample(objects: &[Vec<Object>], label: usize, rng: &mut Rng, out: &mut [f32]) {
    backdrop(&SCENES[SCENE_OF[label]], rng, out);
    // Clutter: smaller objects of other classes, anywhere.
    for _ in 0..rng.below(3) {
        let mut other = rng.below(9) as usize;
        if other >= label {
            other += 1;
        }
        let kind = rng.below(KINDS as u64) as usize;
        let (x, y) = (rng.uniform_in(2.0, 30.0), rng.uniform_in(2.0, 30.0));
        let scale = rng.uniform_in(0.35, 0.65);
        let at = Placement::random(rng, x as f32, y as f32, scale as f32);
        draw(out, &objects[other][kind], &at);
    }
    // The object, near the centre.
    let kind = rng.below(KINDS as u64) as usize;
    let (x, y) = (rng.uniform_in(9.5, 21.5), rng.uniform_in(9.5, 21.5));
    let scale = rng.uniform_in(0.6, 1.2);
    let mut at = Placement::random(rng, x as f32, y as f32, scale as f32);
    if rng.uniform() < RECOLOURED {
        at.gain = colour(rng, -1.0, 1.0);
    }
    draw(out, &objects[label][kind], &at);
    // Uniform noise, four values from each draw.
    for chunk in out.chunks_mut(4) {
        let bits = rng.next_u64();
        for (j, p) in chunk.iter_mut().enumerate() {
            let h = ((bits >> (16 * j)) & 0xFFFF) as f32 / 65536.0;
            *p += NOISE * 12f32.sqrt() * (h - 0.5);
        }
    }
}

/// Paints `scene` into `out`: its colours mixed with random ones, a horizon moved and tilted
/// at random, and a wave texture of random frequency, direction and colour.
fn backdrop(scene: &Scene, rng: &mut Rng, out: &mut [f32]) {
    let mut top = colour(rng, -0.8, 0.8);
    let mut bottom = colour(rng, -0.8, 0.8);
    for c in 0..CHANNELS {
        top[c] += SCENE_WEIGHT * (scene.top[c] - top[c]);
        bottom[c] += SCENE_WEIGHT * (scene.bottom[c] - bottom[c]);
    }
    let horizon = scene.horizon + rng.uniform_in(-3.0, 3.0) as f32;
    let tilt = rng.uniform_in(-0.3, 0.3) as f32;
    let freq = rng.uniform_in(0.3, 1.2) as f32;
    let (ws, wc) = (rng.uniform_in(0.0, TAU) as f32).sin_cos();
    let phase = rng.uniform_in(0.0, TAU) as f32;
    let texture = colour(rng, -0.3, 0.3);
    let centre = (SIDE as f32 - 1.0) / 2.0;
    for y in 0..SIDE {
        for x in 0..SIDE {
            let (xf, yf) = (x as f32 - centre, y as f32 - centre);
            let below = (y as f32 - horizon + tilt * xf + 0.5).clamp(0.0, 1.0);
            let wave = (freq * (wc * xf + ws * yf) + phase).sin();
            for c in 0..CHANNELS {
                out[(c * SIDE + y) * SIDE + x] =
                    top[c] + below * (bottom[c] - top[c]) + texture[c] * wave;
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
