//! Our CPU convolution and max-pooling against candle's, with their gradients.

mod common;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Conv2dConfig;
use candle_parallel::nn;
use candle_parallel::rng::Rng;
use common::{as_f64, max_abs, max_abs_diff};
use std::sync::{Mutex, MutexGuard};

/// Held by every test: one of them switches our kernels off for the whole process.
fn kernels_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Switches our kernels on or off for its lifetime, and back on when dropped (also when the
/// test panics, so that the next test holding the lock gets ours).
struct OwnKernels;

impl OwnKernels {
    fn set(on: bool) -> Self {
        nn::use_own_cpu_kernels(on);
        Self
    }
}

impl Drop for OwnKernels {
    fn drop(&mut self) {
        nn::use_own_cpu_kernels(true);
    }
}

fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The gradients of `sum(y * weights)`: every input's gradient for the loss weights `weights`.
fn weighted_grads(y: &Tensor, weights: &Tensor) -> GradStore {
    (y * weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
}

/// The largest difference relative to the largest magnitude (at least 1).
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    max_abs_diff(a, b) / max_abs(b).max(1.0)
}

#[derive(Debug, Clone, Copy)]
struct Case {
    n: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    k: usize,
    padding: usize,
    stride: usize,
    dilation: usize,
    groups: usize,
}

impl Case {
    fn config(&self) -> Conv2dConfig {
        Conv2dConfig {
            padding: self.padding,
            stride: self.stride,
            dilation: self.dilation,
            groups: self.groups,
            ..Default::default()
        }
    }
}

const fn case(
    n: usize,
    c_in: usize,
    (h, w): (usize, usize),
    c_out: usize,
    k: usize,
    (padding, stride, dilation, groups): (usize, usize, usize, usize),
) -> Case {
    Case {
        n,
        c_in,
        h,
        w,
        c_out,
        k,
        padding,
        stride,
        dilation,
        groups,
    }
}

const CASES: [Case; 8] = [
    case(2, 3, (32, 32), 6, 5, (0, 1, 1, 1)), // the Net's first layer
    case(2, 6, (14, 14), 16, 5, (0, 1, 1, 1)), // its second
    case(1, 3, (7, 9), 4, 3, (1, 1, 1, 1)),   // batch 1, odd sizes, padding
    case(3, 4, (11, 10), 6, 3, (2, 2, 1, 2)), // stride 2, groups 2
    case(2, 2, (9, 9), 3, 3, (1, 1, 2, 1)),   // dilation 2
    case(2, 6, (8, 8), 6, 1, (0, 1, 1, 3)),   // 1x1, groups 3
    case(2, 4, (10, 7), 4, 3, (1, 3, 1, 4)),  // depthwise, stride 3
    case(1, 1, (5, 5), 2, 5, (0, 1, 1, 1)),   // the kernel covers the image
];

/// The convolution by loops, in f64: the output, and the input and weight gradients of
/// `sum(weights * output)`.
fn naive_conv(x: &Tensor, w: &Tensor, c: &Case, weights: &Tensor) -> (Tensor, Tensor, Tensor) {
    let (xv, wv, gv) = (as_f64(x), as_f64(w), as_f64(weights));
    let (cig, cog) = (c.c_in / c.groups, c.c_out / c.groups);
    let span = |k: usize| c.dilation * (k - 1) + 1;
    let ho = (c.h + 2 * c.padding - span(c.k)) / c.stride + 1;
    let wo = (c.w + 2 * c.padding - span(c.k)) / c.stride + 1;
    let mut out = vec![0f64; c.n * c.c_out * ho * wo];
    let mut dx = vec![0f64; xv.len()];
    let mut dw = vec![0f64; wv.len()];
    for b in 0..c.n {
        for o in 0..c.c_out {
            let grp = o / cog;
            for oh in 0..ho {
                for ow in 0..wo {
                    let oi = ((b * c.c_out + o) * ho + oh) * wo + ow;
                    for ci in 0..cig {
                        for kh in 0..c.k {
                            for kw in 0..c.k {
                                let ih =
                                    (oh * c.stride + kh * c.dilation) as isize - c.padding as isize;
                                let iw =
                                    (ow * c.stride + kw * c.dilation) as isize - c.padding as isize;
                                if ih < 0 || iw < 0 || ih >= c.h as isize || iw >= c.w as isize {
                                    continue;
                                }
                                let xi = ((b * c.c_in + grp * cig + ci) * c.h + ih as usize) * c.w
                                    + iw as usize;
                                let wi = ((o * cig + ci) * c.k + kh) * c.k + kw;
                                out[oi] += xv[xi] * wv[wi];
                                dx[xi] += gv[oi] * wv[wi];
                                dw[wi] += gv[oi] * xv[xi];
                            }
                        }
                    }
                }
            }
        }
    }
    let t = |v: Vec<f64>, shape: &[usize]| {
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    (
        t(out, &[c.n, c.c_out, ho, wo]),
        t(dx, x.dims()),
        t(dw, w.dims()),
    )
}

#[test]
fn conv2d_matches_candle_and_a_direct_computation_with_its_gradients() {
    let _serial = kernels_lock();
    for (i, c) in CASES.iter().enumerate() {
        let x = Var::from_tensor(&random(&[c.n, c.c_in, c.h, c.w], i as u64)).unwrap();
        let w = Var::from_tensor(&random(
            &[c.c_out, c.c_in / c.groups, c.k, c.k],
            100 + i as u64,
        ))
        .unwrap();
        let cfg = c.config();
        let ours = nn::conv2d_forward(x.as_tensor(), w.as_tensor(), &cfg).unwrap();
        let candle = x
            .as_tensor()
            .conv2d(w.as_tensor(), c.padding, c.stride, c.dilation, c.groups)
            .unwrap();
        assert!(
            rel_diff(&ours, &candle) <= 1e-4,
            "{c:?}: output against candle"
        );
        // A loss that weighs every output differently.
        let weights = random(candle.dims(), 200 + i as u64);
        let (out, dx, dw) = naive_conv(x.as_tensor(), w.as_tensor(), c, &weights);
        assert!(rel_diff(&ours, &out) <= 1e-4, "{c:?}: output");
        let g = weighted_grads(&ours, &weights);
        for (name, v, want) in [("input", &x, &dx), ("weight", &w, &dw)] {
            let d = rel_diff(g.get(v).unwrap(), want);
            assert!(d <= 1e-4, "{c:?}: {name} gradient off by {d}");
        }
        // candle's own autograd, where it works (candle 0.11's convolution backward fails
        // for a stride with a width its output padding does not fit, as in the 11x10 case).
        if let Ok(gc) = (&candle * &weights).unwrap().sum_all().unwrap().backward() {
            for (name, v) in [("input", &x), ("weight", &w)] {
                let d = rel_diff(g.get(v).unwrap(), gc.get(v).unwrap());
                assert!(d <= 1e-4, "{c:?}: {name} gradient off candle's by {d}");
            }
        }
    }
}

#[test]
fn the_input_gradient_is_computed_exactly_when_something_needs_it() {
    let _serial = kernels_lock();
    let c = CASES[2];
    let cfg = c.config();
    let images = random(&[c.n, c.c_in, c.h, c.w], 1);
    let w = Var::from_tensor(&random(&[c.c_out, c.c_in, c.k, c.k], 2)).unwrap();
    let weights = random(&[c.n, c.c_out, c.h, c.w], 3);
    let loss = |x: &Tensor| {
        (nn::conv2d_forward(x, w.as_tensor(), &cfg).unwrap() * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
    };
    // Plain images: no input gradient, and the weight's is right.
    let g = loss(&images).backward().unwrap();
    assert!(g.get(&images).is_none());
    let reference = Var::from_tensor(&images).unwrap();
    let g_ref = (reference
        .as_tensor()
        .conv2d(w.as_tensor(), c.padding, 1, 1, 1)
        .unwrap()
        * &weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(rel_diff(g.get(&w).unwrap(), g_ref.get(&w).unwrap()) <= 1e-4);
    // The output of a tracked op: its variable gets the gradient through the convolution.
    let v = Var::from_tensor(&images).unwrap();
    let g = loss(&(v.as_tensor() * 2.0).unwrap()).backward().unwrap();
    let want = (g_ref.get(&reference).unwrap() * 2.0).unwrap();
    assert!(rel_diff(g.get(&v).expect("the input gradient reached it"), &want) <= 1e-4);
}

/// Max-pooling by loops: outputs and the gradient of `sum(weights * outputs)`.
fn naive_pool(x: &Tensor, k: usize, s: usize, weights: &Tensor) -> (Tensor, Tensor) {
    let (n, c, h, w) = x.dims4().unwrap();
    let (ho, wo) = ((h - k) / s + 1, (w - k) / s + 1);
    let xv = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let wv = weights.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut out = vec![0f32; n * c * ho * wo];
    let mut dx = vec![0f32; n * c * h * w];
    for p in 0..n * c {
        for oh in 0..ho {
            for ow in 0..wo {
                let mut best = p * h * w + oh * s * w + ow * s;
                for kh in 0..k {
                    for kw in 0..k {
                        let j = p * h * w + (oh * s + kh) * w + ow * s + kw;
                        if xv[j] > xv[best] {
                            best = j;
                        }
                    }
                }
                let o = (p * ho + oh) * wo + ow;
                out[o] = xv[best];
                dx[best] += wv[o];
            }
        }
    }
    (
        Tensor::from_vec(out, (n, c, ho, wo), &Device::Cpu).unwrap(),
        Tensor::from_vec(dx, (n, c, h, w), &Device::Cpu).unwrap(),
    )
}

#[test]
fn max_pool2d_matches_candle_and_a_direct_computation() {
    let _serial = kernels_lock();
    // (shape, kernel, stride, whether candle's backward applies: a kernel equal to the stride
    // and sizes that divide)
    let cases: [(&[usize], usize, usize, bool); 5] = [
        (&[2, 3, 8, 8], 2, 2, true),
        (&[1, 4, 6, 6], 3, 3, true),
        (&[2, 6, 28, 28], 2, 2, true), // the Net's
        (&[1, 2, 7, 9], 2, 2, false),  // odd sizes
        (&[2, 2, 7, 7], 3, 2, false),  // overlapping windows
    ];
    for (i, (shape, k, s, candle_grad)) in cases.into_iter().enumerate() {
        let x = Var::from_tensor(&random(shape, 10 + i as u64)).unwrap();
        let ours = nn::max_pool2d_with_stride(x.as_tensor(), k, s).unwrap();
        let want = x.as_tensor().max_pool2d_with_stride(k, s).unwrap();
        assert_eq!(rel_diff(&ours, &want), 0.0, "{shape:?} k {k} s {s}: output");
        let weights = random(want.dims(), 50 + i as u64);
        let g = weighted_grads(&ours, &weights);
        let (naive_out, naive_dx) = naive_pool(x.as_tensor(), k, s, &weights);
        assert_eq!(rel_diff(&ours, &naive_out), 0.0);
        assert!(
            rel_diff(g.get(&x).unwrap(), &naive_dx) <= 1e-6,
            "{shape:?}: gradient"
        );
        // Where our kernel does not apply (here f64; CUDA likewise), candle's ops composed
        // so that the gradient is the same.
        let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
        let y64 = nn::max_pool2d_with_stride(x64.as_tensor(), k, s).unwrap();
        assert_eq!(y64.dtype(), DType::F64);
        let y64_as_f32 = y64.to_dtype(DType::F32).unwrap();
        assert_eq!(
            rel_diff(&y64_as_f32, &naive_out),
            0.0,
            "{shape:?}: f64 output"
        );
        let w64 = weights.to_dtype(DType::F64).unwrap();
        let g64 = weighted_grads(&y64, &w64);
        let dx64 = g64.get(&x64).unwrap().to_dtype(DType::F32).unwrap();
        assert!(
            rel_diff(&dx64, &naive_dx) <= 1e-6,
            "{shape:?}: f64 gradient"
        );
        if candle_grad {
            // candle 0.11's max-pool backward scales every gradient by 1 / kernel^2 (it
            // multiplies by the average of the max mask instead of dividing by its count):
            // ours, the direct computation's and PyTorch's are that times kernel^2.
            let gc = weighted_grads(&want, &weights);
            let scaled = (g.get(&x).unwrap() / (k * k) as f64).unwrap();
            assert!(rel_diff(&scaled, gc.get(&x).unwrap()) <= 1e-6, "{shape:?}");
        }
    }
}

#[test]
fn the_conv2d_layer_matches_candle_nn_with_the_same_variables_and_bias_gradient() {
    let _serial = kernels_lock();
    use candle_core::Module;
    use candle_nn::{VarBuilder, VarMap};
    for (i, c) in [CASES[0], CASES[3], CASES[6]].iter().enumerate() {
        let cfg = c.config();
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let ours = nn::conv2d(c.c_in, c.c_out, c.k, cfg, vb.pp("conv")).unwrap();
        // candle-nn finds the same variables under the same names.
        let theirs = candle_nn::conv2d(c.c_in, c.c_out, c.k, cfg, vb.pp("conv")).unwrap();
        assert_eq!(varmap.all_vars().len(), 2);
        let x = Var::from_tensor(&random(&[c.n, c.c_in, c.h, c.w], 300 + i as u64)).unwrap();
        let (y, want) = (
            ours.forward(x.as_tensor()).unwrap(),
            theirs.forward(x.as_tensor()).unwrap(),
        );
        assert!(rel_diff(&y, &want) <= 1e-4, "{c:?}: output");
        let weights = random(want.dims(), 400 + i as u64);
        let g = weighted_grads(&y, &weights);
        // The bias gradient: the loss weights summed per output channel.
        let bias = ours.bias().unwrap();
        let db = weights.sum((0, 2, 3)).unwrap();
        assert!(
            rel_diff(g.get(bias).unwrap(), &db) <= 1e-4,
            "{c:?}: bias gradient"
        );
        let (_, dx, dw) = naive_conv(x.as_tensor(), ours.weight(), c, &weights);
        assert!(rel_diff(g.get(ours.weight()).unwrap(), &dw) <= 1e-4);
        assert!(rel_diff(g.get(x.as_tensor()).unwrap(), &dx) <= 1e-4);
    }
}

#[test]
fn bad_shapes_are_errors_that_say_what_is_wrong() {
    let _serial = kernels_lock();
    let x = random(&[1, 4, 8, 8], 1);
    let cfg = Conv2dConfig {
        groups: 3,
        ..Default::default()
    };
    let err = nn::conv2d_forward(&x, &random(&[6, 1, 3, 3], 2), &cfg).unwrap_err();
    assert!(err.to_string().contains("3 groups"), "{err}");
    let err = nn::conv2d_forward(&x, &random(&[2, 4, 9, 9], 2), &Default::default()).unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    let conv = nn::Conv2d::new(
        random(&[2, 4, 3, 3], 2),
        Some(random(&[3], 3)),
        Default::default(),
    );
    let err = candle_core::Module::forward(&conv, &x).unwrap_err();
    assert!(
        err.to_string().contains("one value per output channel"),
        "{err}"
    );
    let err = nn::max_pool2d(&x, 9).unwrap_err();
    assert!(!err.to_string().is_empty());
}

#[test]
fn candle_kernels_can_be_chosen_for_the_whole_process() {
    let _serial = kernels_lock();
    // Told apart by candle 0.11's max-pool gradient, 1 / kernel^2 of ours.
    let x = Var::from_tensor(&random(&[1, 2, 4, 4], 5)).unwrap();
    let grad = || {
        let g = nn::max_pool2d(x.as_tensor(), 2)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        g.get(&x)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    assert!(nn::own_cpu_kernels());
    assert_eq!(grad(), 8.0); // one per output
    nn::use_own_cpu_kernels(false);
    let (candle, conv) = (
        grad(),
        nn::conv2d_forward(
            x.as_tensor(),
            &random(&[3, 2, 3, 3], 6),
            &Default::default(),
        ),
    );
    nn::use_own_cpu_kernels(true);
    assert_eq!(candle, 2.0);
    assert_eq!(conv.unwrap().dims(), [1, 3, 2, 2]);
    assert!(nn::own_cpu_kernels());
}

/// Values in {-1, 0, 1}: convolutions of these give exact zeros and ties.
fn small_integers(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.normal() * 1.5).round().clamp(-1.0, 1.0) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

#[test]
fn the_fused_conv_relu_pool_block_equals_the_three_ops_with_gradients() {
    let _serial = kernels_lock();
    use candle_core::Module;
    // (case, pooling kernel, input needs a gradient, integer values, bias shift)
    let cases = [
        (CASES[0], 2, false, false, 0.0), // the Net's first block: the images need no gradient
        (CASES[1], 2, true, false, 0.0),  // its second
        (
            case(3, 3, (9, 11), 5, 3, (0, 1, 1, 1)),
            2,
            true,
            false,
            -0.5,
        ), // odd sizes: 7x9
        (
            case(2, 4, (11, 10), 6, 3, (2, 2, 1, 2)),
            3,
            true,
            false,
            0.3,
        ), // stride, groups
        (case(5, 2, (8, 8), 3, 3, (1, 1, 1, 1)), 2, true, true, 0.0), // exact ties and zeros
        (case(1, 2, (6, 6), 2, 3, (0, 1, 1, 1)), 2, true, false, -9.0), // the ReLU stops all
        (case(2, 4, (9, 8), 6, 3, (0, 1, 1, 2)), 2, true, false, 0.1), // groups, read directly
        (case(3, 3, (12, 13), 7, 5, (0, 1, 1, 1)), 2, true, true, 0.0), // ties, read directly
    ];
    for (i, &(c, kernel, input_grad, integers, shift)) in cases.iter().enumerate() {
        let seed = 700 + 10 * i as u64;
        let make = |shape: &[usize], s: u64| {
            if integers {
                small_integers(shape, s)
            } else {
                random(shape, s)
            }
        };
        let x = Var::from_tensor(&make(&[c.n, c.c_in, c.h, c.w], seed)).unwrap();
        let w = Var::from_tensor(&make(&[c.c_out, c.c_in / c.groups, c.k, c.k], seed + 1)).unwrap();
        let b = Var::from_tensor(&(make(&[c.c_out], seed + 2) + shift).unwrap()).unwrap();
        let conv = nn::Conv2d::new(
            w.as_tensor().clone(),
            Some(b.as_tensor().clone()),
            c.config(),
        );
        let input = if input_grad {
            x.as_tensor().clone()
        } else {
            x.as_tensor().detach()
        };
        let fused = conv.forward_relu_max_pool2d(&input, kernel).unwrap();
        let apart = nn::max_pool2d(&conv.forward(&input).unwrap().relu().unwrap(), kernel).unwrap();
        assert_eq!(fused.dims(), apart.dims(), "{c:?}");
        // Sums in another order (the fused op reads the image directly where it can); exact
        // with small integers, so that ties are ties in both.
        let tolerance = if integers { 0.0 } else { 1e-5 };
        assert!(rel_diff(&fused, &apart) <= tolerance, "{c:?}: output");
        let tolerance = 1e-5; // the loss weights are not integers
        let weights = random(fused.dims(), seed + 3);
        let (gf, ga) = (
            weighted_grads(&fused, &weights),
            weighted_grads(&apart, &weights),
        );
        for (name, v) in [("weight", &w), ("bias", &b)] {
            let (f, a) = (
                gf.get(v.as_tensor()).unwrap(),
                ga.get(v.as_tensor()).unwrap(),
            );
            assert!(rel_diff(f, a) <= tolerance, "{c:?}: {name} gradient");
        }
        if input_grad {
            let (f, a) = (
                gf.get(x.as_tensor()).unwrap(),
                ga.get(x.as_tensor()).unwrap(),
            );
            assert!(rel_diff(f, a) <= tolerance, "{c:?}: input gradient");
        } else {
            assert!(gf.get(x.as_tensor()).is_none());
        }
        if shift < -5.0 {
            // Nothing passes the ReLU: no gradient reaches the weights.
            assert_eq!(max_abs(gf.get(w.as_tensor()).unwrap()), 0.0);
        }
    }
    // Off our kernels (as on a GPU) the method composes the three ops.
    nn::use_own_cpu_kernels(false);
    let c = CASES[1];
    let conv = nn::Conv2d::new(
        random(&[16, 6, 5, 5], 1),
        Some(random(&[16], 2)),
        c.config(),
    );
    let x = random(&[2, 6, 14, 14], 3);
    let fallback = conv.forward_relu_max_pool2d(&x, 2);
    nn::use_own_cpu_kernels(true);
    let fused = conv.forward_relu_max_pool2d(&x, 2).unwrap();
    assert!(rel_diff(&fallback.unwrap(), &fused) <= 1e-5);
}

/// The CIFAR Net as it was written before its blocks were fused: convolution, ReLU and
/// max-pooling as three ops, then the linear layers, over the variables of `varmap`.
fn unfused_net(varmap: &candle_nn::VarMap, x: &Tensor) -> candle_core::Result<Tensor> {
    use candle_core::Module;
    let vars = varmap.data().lock().unwrap();
    let var = |name: &str| vars[name].as_tensor().clone();
    let conv = |name: &str| {
        let bias = var(&format!("{name}.bias"));
        nn::Conv2d::new(
            var(&format!("{name}.weight")),
            Some(bias),
            Default::default(),
        )
    };
    let fc = |name: &str| {
        let bias = var(&format!("{name}.bias"));
        candle_nn::Linear::new(var(&format!("{name}.weight")), Some(bias))
    };
    let x = nn::max_pool2d(&conv("conv1").forward(x)?.relu()?, 2)?;
    nn::max_pool2d(&conv("conv2").forward(&x)?.relu()?, 2)?
        .flatten_from(1)?
        .apply(&fc("fc1"))?
        .relu()?
        .apply(&fc("fc2"))?
        .relu()?
        .apply(&fc("fc3"))
}

#[test]
fn the_net_trains_as_with_the_unfused_blocks() {
    let _serial = kernels_lock();
    use candle_core::Module;
    use candle_nn::{loss, Optimizer};
    let seeded = || seeded_with_sgd(0, 0.01, |vb| candle_parallel::cifar::Net::new(vb).unwrap());
    let (fused_vars, net, mut fused_opt) = seeded();
    let (plain_vars, _, mut plain_opt) = seeded();
    let labels: Vec<u32> = (0..12).map(|i| i % 10).collect();
    let y = Tensor::from_vec(labels, 12, &Device::Cpu).unwrap();
    for step in 0..4 {
        let x = random(&[12, 3, 32, 32], 900 + step);
        let fused = loss::cross_entropy(&net.forward(&x).unwrap(), &y).unwrap();
        let plain = loss::cross_entropy(&unfused_net(&plain_vars, &x).unwrap(), &y).unwrap();
        let (a, b) = (
            fused.to_scalar::<f32>().unwrap(),
            plain.to_scalar::<f32>().unwrap(),
        );
        assert!((a - b).abs() <= 1e-6, "step {step}: loss {a} against {b}");
        fused_opt.backward_step(&fused).unwrap();
        plain_opt.backward_step(&plain).unwrap();
    }
    assert_same_variables(&fused_vars, &plain_vars, 1e-6, "4 steps");
}

/// A model `build` makes from a VarMap seeded with `seed`, the VarMap, and SGD with momentum 0.9
/// at `lr` over its variables: the two sides of a training comparison, built alike.
fn seeded_with_sgd<M>(
    seed: u64,
    lr: f64,
    build: impl FnOnce(candle_nn::VarBuilder) -> M,
) -> (candle_nn::VarMap, M, candle_parallel::optim::Sgd) {
    use candle_nn::Optimizer;
    use candle_parallel::optim::{Sgd, SgdConfig};
    let varmap = candle_nn::VarMap::new();
    let model = build(candle_parallel::init::seeded_var_builder(
        &varmap,
        seed,
        DType::F32,
        &Device::Cpu,
    ));
    let config = SgdConfig {
        lr,
        momentum: 0.9,
        ..Default::default()
    };
    let opt = Sgd::new(varmap.all_vars(), config).unwrap();
    (varmap, model, opt)
}

/// Asserts that every variable of `ours` is within `tol` of `theirs`'s of the same name,
/// `after` some training.
fn assert_same_variables(
    ours: &candle_nn::VarMap,
    theirs: &candle_nn::VarMap,
    tol: f32,
    after: &str,
) {
    let (ours, theirs) = (ours.data().lock().unwrap(), theirs.data().lock().unwrap());
    for (name, v) in ours.iter() {
        let diff = max_abs_diff(v.as_tensor(), theirs[name].as_tensor());
        assert!(diff <= tol, "{name} differs by {diff} after {after}");
    }
}

/// An MLP at a batch smaller than its layers' widths (16 rows into 300 and 200 outputs: the
/// forward's few-row products, on `few_rows`' kernel where the CPU has AVX-512) trains through
/// `nn::linear_relu` and `nn::linear` as through candle-nn's `Linear` and `relu`: the same loss
/// within 1e-5 at each of 20 steps of SGD with momentum, and the same weights after them.
#[test]
fn a_few_row_mlp_trains_as_through_candle_nn_for_20_steps() {
    let _serial = kernels_lock();
    use candle_core::Module;
    use candle_nn::{loss, Linear, Optimizer};
    let widths = [64, 300, 200, 10];
    let seeded = || {
        seeded_with_sgd(7, 0.05, |vb| {
            (0..3)
                .map(|i| {
                    candle_nn::linear(widths[i], widths[i + 1], vb.pp(format!("fc{i}"))).unwrap()
                })
                .collect::<Vec<Linear>>()
        })
    };
    let (ours_vars, ours, mut ours_opt) = seeded();
    let (theirs_vars, theirs, mut theirs_opt) = seeded();
    let labels: Vec<u32> = (0..16).map(|i| (i * 7) % 10).collect();
    let y = Tensor::from_vec(labels, 16, &Device::Cpu).unwrap();
    for step in 0..20 {
        let x = random(&[16, 64], 1_000 + step);
        let h = nn::linear_relu(&x, &ours[0]).unwrap();
        let h = nn::linear_relu(&h, &ours[1]).unwrap();
        let ours_loss = loss::cross_entropy(&nn::linear(&h, &ours[2]).unwrap(), &y).unwrap();
        let h = theirs[0].forward(&x).unwrap().relu().unwrap();
        let h = theirs[1].forward(&h).unwrap().relu().unwrap();
        let theirs_loss = loss::cross_entropy(&theirs[2].forward(&h).unwrap(), &y).unwrap();
        let (a, b) = (
            ours_loss.to_scalar::<f32>().unwrap(),
            theirs_loss.to_scalar::<f32>().unwrap(),
        );
        assert!((a - b).abs() <= 1e-5, "step {step}: loss {a} against {b}");
        ours_opt.backward_step(&ours_loss).unwrap();
        theirs_opt.backward_step(&theirs_loss).unwrap();
    }
    assert_same_variables(&ours_vars, &theirs_vars, 1e-5, "20 steps");
}

#[test]
fn the_fused_linear_layer_equals_candle_nn_linear_and_relu_with_gradients() {
    let _serial = kernels_lock();
    use candle_core::Module;
    // (batch, inputs, outputs, ReLU, the input needs a gradient)
    let cases = [
        (7, 13, 5, true, true),
        (7, 13, 5, false, true),
        (128, 400, 120, true, true), // the Net's fc1
        (3, 84, 10, false, false),   // its fc3 on a leaf input
        // Few rows through wide layers: the forward of both on `few_rows`' kernel where the
        // CPU has AVX-512 (else in blocks of 128 columns over the threads, last blocks of 44
        // and 104), the input gradient of the second in blocks of 128 (the last of 1 column);
        // a single row stays with `gemm`.
        (5, 70, 300, true, true),
        (4, 257, 1000, false, true),
        (1, 1, 1, true, true),
        (0, 4, 3, true, true), // an empty batch
    ];
    for (i, &(n, k, o, relu, input_grad)) in cases.iter().enumerate() {
        let seed = 1000 + 10 * i as u64;
        let x = Var::from_tensor(&random(&[n, k], seed)).unwrap();
        let w = Var::from_tensor(&random(&[o, k], seed + 1)).unwrap();
        let b = Var::from_tensor(&random(&[o], seed + 2)).unwrap();
        let layer = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
        let input = if input_grad {
            x.as_tensor().clone()
        } else {
            x.as_tensor().detach()
        };
        let (fused, apart) = if relu {
            let apart = layer.forward(&input).unwrap().relu().unwrap();
            (nn::linear_relu(&input, &layer).unwrap(), apart)
        } else {
            (
                nn::linear(&input, &layer).unwrap(),
                layer.forward(&input).unwrap(),
            )
        };
        assert_eq!(fused.dims(), [n, o]);
        if n == 0 {
            let g = fused.sum_all().unwrap().backward().unwrap();
            assert_eq!(max_abs(g.get(w.as_tensor()).unwrap()), 0.0);
            continue;
        }
        let case = format!("{n}x{k} -> {o}, relu {relu}");
        assert!(rel_diff(&fused, &apart) <= 1e-5, "{case}: output");
        let weights = random(&[n, o], seed + 3);
        let (gf, ga) = (
            weighted_grads(&fused, &weights),
            weighted_grads(&apart, &weights),
        );
        for (name, v) in [("weight", &w), ("bias", &b), ("input", &x)] {
            match (gf.get(v.as_tensor()), ga.get(v.as_tensor())) {
                (Some(f), Some(a)) => assert!(rel_diff(f, a) <= 1e-5, "{case}: {name} gradient"),
                (None, None) => assert!(name == "input" && !input_grad, "{case}: {name}"),
                _ => panic!("{case}: the {name} gradient is in one store only"),
            }
        }
    }
}

/// `nn::linear_gelu` (one op: the product, the bias and the exact GELU, its backward through
/// the GELU's derivative in place) equals `gelu_erf` of candle-nn's `Linear`, values and every
/// gradient, on odd shapes, a rank-3 non-contiguous input, without a bias, in f32, f16 and bf16,
/// with our kernels and with candle's.
#[test]
fn the_fused_linear_gelu_equals_the_gelu_of_candle_nn_linear_with_gradients() {
    let _serial = kernels_lock();
    use candle_core::Module;
    for own in [true, false] {
        let _kernels = OwnKernels::set(own);
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 5e-3), (DType::BF16, 3e-2)] {
            // (input shape, outputs, bias)
            let cases: [(&[usize], usize, bool); 4] = [
                (&[7, 13], 5, true),
                (&[2, 9, 16], 64, true), // rank 3 (made non-contiguous below)
                (&[33, 3], 17, false),
                (&[1, 1], 1, true),
            ];
            for (i, &(shape, o, bias)) in cases.iter().enumerate() {
                let case = format!("{shape:?} -> {o}, bias {bias}, {dtype:?}, own {own}");
                let seed = 3000 + 10 * i as u64;
                let k = *shape.last().unwrap();
                let x = match shape.len() {
                    // The same values, laid out (batch, k, time) and transposed back.
                    3 => random(&[shape[0], shape[2], shape[1]], seed)
                        .transpose(1, 2)
                        .unwrap(),
                    _ => random(shape, seed),
                };
                let x = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
                let w =
                    Var::from_tensor(&random(&[o, k], seed + 1).to_dtype(dtype).unwrap()).unwrap();
                let b = Var::from_tensor(&random(&[o], seed + 2).to_dtype(dtype).unwrap()).unwrap();
                let layer = candle_nn::Linear::new(
                    w.as_tensor().clone(),
                    bias.then(|| b.as_tensor().clone()),
                );
                let input = if shape.len() == 3 {
                    x.as_tensor()
                        .transpose(1, 2)
                        .unwrap()
                        .transpose(1, 2)
                        .unwrap()
                } else {
                    x.as_tensor().clone()
                };
                let fused = nn::linear_gelu(&input, &layer).unwrap();
                let apart = nn::ops::gelu_erf(&layer.forward(&input).unwrap()).unwrap();
                assert_eq!(
                    (fused.dims(), fused.dtype()),
                    (apart.dims(), dtype),
                    "{case}"
                );
                let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                assert!(
                    rel_diff(&f32(&fused), &f32(&apart)) <= tol,
                    "{case}: output"
                );
                let mut out_shape = shape.to_vec();
                *out_shape.last_mut().unwrap() = o;
                let weights = random(&out_shape, seed + 3).to_dtype(dtype).unwrap();
                let (gf, ga) = (
                    weighted_grads(&fused, &weights),
                    weighted_grads(&apart, &weights),
                );
                for (name, v) in [("weight", &w), ("bias", &b), ("input", &x)] {
                    match (gf.get(v.as_tensor()), ga.get(v.as_tensor())) {
                        (Some(f), Some(a)) => {
                            let d = rel_diff(&f32(f), &f32(a));
                            assert!(d <= 4.0 * tol, "{case}: {name} gradient off by {d}")
                        }
                        (None, None) => assert!(name == "bias" && !bias, "{case}: {name}"),
                        _ => panic!("{case}: the {name} gradient is in one store only"),
                    }
                }
            }
        }
    }
}

/// A half layer widens its inputs inside its op: its output and every gradient are the f32
/// layer's on the widened values, each rounded once to the half type, bit for bit (linear, with
/// a ReLU, with a GELU; few rows through a wide layer, a rank-3 non-contiguous input, no bias).
/// The products here are too small for the AMX tiles, which round a bf16 layer's gradient at the
/// product where an f32 layer keeps it.
#[test]
fn half_linear_layers_are_the_f32_layer_rounded_once() {
    let _serial = kernels_lock();
    type Layer = fn(&Tensor, &candle_nn::Linear) -> candle_core::Result<Tensor>;
    let layers: [(&str, Layer); 3] = [
        ("linear", nn::linear),
        ("linear_relu", nn::linear_relu),
        ("linear_gelu", nn::linear_gelu),
    ];
    // (input shape, outputs, bias)
    let cases: [(&[usize], usize, bool); 4] = [
        (&[7, 13], 5, true),
        (&[5, 70], 300, true),
        (&[2, 9, 16], 24, true),
        (&[33, 3], 17, false),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (name, layer_fn) in layers {
            for (i, &(shape, o, bias)) in cases.iter().enumerate() {
                let case = format!("{name} {shape:?} -> {o}, bias {bias}, {dtype:?}");
                let seed = 5000 + 10 * i as u64;
                let k = *shape.last().unwrap();
                let half = |t: Tensor| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap();
                let x = half(match shape.len() {
                    3 => random(&[shape[0], shape[2], shape[1]], seed),
                    _ => random(shape, seed),
                });
                let (w, b) = (
                    half(random(&[o, k], seed + 1)),
                    half(random(&[o], seed + 2)),
                );
                let wide = |v: &Var| Var::from_tensor(&v.to_dtype(DType::F32).unwrap()).unwrap();
                let (x32, w32, b32) = (wide(&x), wide(&w), wide(&b));
                let input = |x: &Var| match shape.len() {
                    3 => x.as_tensor().transpose(1, 2).unwrap(),
                    _ => x.as_tensor().clone(),
                };
                let layer = |w: &Var, b: &Var| {
                    candle_nn::Linear::new(
                        w.as_tensor().clone(),
                        bias.then(|| b.as_tensor().clone()),
                    )
                };
                let y = layer_fn(&input(&x), &layer(&w, &b)).unwrap();
                let y32 = layer_fn(&input(&x32), &layer(&w32, &b32)).unwrap();
                assert_eq!(y.dtype(), dtype, "{case}");
                let bits = |t: &Tensor| {
                    t.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(
                    bits(&y),
                    bits(&y32.to_dtype(dtype).unwrap()),
                    "{case}: output"
                );
                let weights = random(y.dims(), seed + 3).to_dtype(dtype).unwrap();
                let g = weighted_grads(&y, &weights);
                let g32 = weighted_grads(&y32, &weights.to_dtype(DType::F32).unwrap());
                for (what, v, v32) in [
                    ("input", &x, &x32),
                    ("weight", &w, &w32),
                    ("bias", &b, &b32),
                ] {
                    match (g.get(v.as_tensor()), g32.get(v32.as_tensor())) {
                        (Some(got), Some(want)) => {
                            assert_eq!(got.dtype(), dtype, "{case}: {what} gradient");
                            assert_eq!(
                                bits(got),
                                bits(&want.to_dtype(dtype).unwrap()),
                                "{case}: {what} gradient"
                            );
                        }
                        (None, None) => assert!(what == "bias" && !bias, "{case}: {what}"),
                        _ => panic!("{case}: the {what} gradient is in one store only"),
                    }
                }
            }
        }
    }
}

/// The linear layer and the convolution sum their gradients over the batch in f32 for f16 and
/// bf16 (as torch does), with our kernels and with candle's: a bias (and a weight) over 4096
/// rows of ones gets 4096, where candle's sums in the element type stop at 256 (bf16) and 2048
/// (f16). Inputs of rank 3 and layers without a bias take the same path.
#[test]
fn linear_and_conv_gradients_sum_in_f32_in_every_dtype() {
    let _serial = kernels_lock();
    use candle_core::Module;
    let ones = |shape: &[usize], dtype| Tensor::ones(shape, dtype, &Device::Cpu).unwrap();
    let values = |t: &Tensor| as_f64(t);
    for own in [true, false] {
        let _kernels = OwnKernels::set(own);
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let case = format!("{dtype:?}, our kernels {own}");
            let w = Var::from_tensor(&ones(&[2, 3], dtype)).unwrap();
            let b = Var::from_tensor(&ones(&[2], dtype)).unwrap();
            for (x, bias) in [
                (ones(&[4096, 3], dtype), true),
                (ones(&[2, 2048, 3], dtype), false),
            ] {
                let layer = candle_nn::Linear::new(
                    w.as_tensor().clone(),
                    bias.then(|| b.as_tensor().clone()),
                );
                let y = nn::linear(&x, &layer).unwrap();
                assert_eq!(
                    (y.dtype(), &y.dims()[..y.rank() - 1]),
                    (dtype, &x.dims()[..x.rank() - 1])
                );
                assert_eq!(values(&y)[0], if bias { 4.0 } else { 3.0 }, "{case}");
                let grads = y.sum_all().unwrap().backward().unwrap();
                assert_eq!(
                    values(grads.get(&w).unwrap()),
                    [4096.0; 6],
                    "{case}: weight"
                );
                if bias {
                    assert_eq!(values(grads.get(&b).unwrap()), [4096.0; 2], "{case}: bias");
                }
            }
            if !own && dtype == DType::BF16 {
                continue; // candle has no bf16 convolution on the CPU
            }
            let cw = Var::from_tensor(&ones(&[1, 1, 1, 1], dtype)).unwrap();
            let cb = Var::from_tensor(&ones(&[1], dtype)).unwrap();
            let conv = nn::Conv2d::new(
                cw.as_tensor().clone(),
                Some(cb.as_tensor().clone()),
                Default::default(),
            );
            let y = conv.forward(&ones(&[4, 1, 32, 32], dtype)).unwrap();
            assert_eq!(y.dtype(), dtype);
            let grads = y.sum_all().unwrap().backward().unwrap();
            assert_eq!(
                values(grads.get(&cb).unwrap()),
                [4096.0],
                "{case}: conv bias"
            );
            assert_eq!(
                values(grads.get(&cw).unwrap()),
                [4096.0],
                "{case}: conv weight"
            );
        }
    }
}

/// A batch of no rows gives the weight and the bias zero gradients (torch's), in every dtype,
/// with our kernels and with candle's (whose product of no rows is untracked zeros).
#[test]
fn an_empty_batch_gives_the_linear_layer_zero_gradients() {
    let _serial = kernels_lock();
    for own in [true, false] {
        let _kernels = OwnKernels::set(own);
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let var = |shape: &[usize], seed| {
                Var::from_tensor(&random(shape, seed).to_dtype(dtype).unwrap()).unwrap()
            };
            let (x, w, b) = (var(&[0, 5], 1), var(&[3, 5], 2), var(&[3], 3));
            let layer = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
            for relu in [false, true] {
                let y = if relu {
                    nn::linear_relu(x.as_tensor(), &layer).unwrap()
                } else {
                    nn::linear_gelu(x.as_tensor(), &layer).unwrap()
                };
                assert_eq!((y.dims(), y.dtype()), (&[0, 3][..], dtype));
                let grads = y.sum_all().unwrap().backward().unwrap();
                for (name, v) in [("weight", &w), ("bias", &b)] {
                    let g = grads.get(v).unwrap_or_else(|| {
                        panic!("{dtype:?} own {own} relu {relu}: no {name} gradient")
                    });
                    assert_eq!(g.dims(), v.dims());
                    assert_eq!(max_abs(g), 0.0);
                }
            }
        }
    }
}

/// The gradients of every variable by `nn::backward` and by candle's `backward`, each in f64.
fn both_stores(loss: &Tensor, vars: &[(&str, &Var)]) -> Vec<(String, Vec<f64>, Vec<f64>)> {
    let (ours, candles) = (nn::backward(loss).unwrap(), loss.backward().unwrap());
    vars.iter()
        .map(|(name, v)| {
            let get = |g: &GradStore| {
                let t = g.get(v.as_tensor());
                let t = t.unwrap_or_else(|| panic!("{name}: no gradient"));
                as_f64(&t.flatten_all().unwrap())
            };
            (name.to_string(), get(&ours), get(&candles))
        })
        .collect()
}

/// `nn::backward` stores the gradients our layers hand it straight into the store, where
/// candle's walk adds each to zeros: the same gradients, bit for bit where a variable gets one
/// gradient (a weight used once), within rounding where it gets several (a layer applied twice,
/// a weight also used by a candle op); weights in bf16 (not variables inside the op, converted
/// first) take candle's way; a plain `backward` afterwards still gets every gradient.
#[test]
fn backward_stores_the_layers_gradients_as_candles_walk_would() {
    let _serial = kernels_lock();
    let var = |shape: &[usize], seed: u64| Var::from_tensor(&random(shape, seed)).unwrap();
    let (w1, b1, w2, b2, w3) = (
        var(&[24, 16], 1),
        var(&[24], 2),
        var(&[24, 24], 3),
        var(&[24], 4),
        var(&[5, 24], 5),
    );
    let x = var(&[2, 7, 16], 6);
    let fc = |w: &Var, b: Option<&Var>| {
        candle_nn::Linear::new(w.as_tensor().clone(), b.map(|b| b.as_tensor().clone()))
    };
    let (fc1, fc2, fc3) = (fc(&w1, Some(&b1)), fc(&w2, Some(&b2)), fc(&w3, None));
    let g = random(&[2, 7, 5], 7);
    let vars = [
        ("w1", &w1),
        ("b1", &b1),
        ("w2", &w2),
        ("b2", &b2),
        ("w3", &w3),
        ("x", &x),
    ];

    // Each variable once.
    let h = nn::linear_relu(x.as_tensor(), &fc1).unwrap();
    let h = nn::linear_gelu(&h, &fc2).unwrap();
    let loss = (nn::linear(&h, &fc3).unwrap() * &g)
        .unwrap()
        .sum_all()
        .unwrap();
    for (name, ours, candles) in both_stores(&loss, &vars) {
        assert_eq!(ours, candles, "{name}: one use");
    }

    // fc2 applied twice, w1 also squared by a candle op, x transposed first (not contiguous).
    let xt = x.as_tensor().transpose(0, 1).unwrap();
    let h = nn::linear_relu(&xt, &fc1).unwrap();
    let h = nn::linear_relu(&nn::linear_relu(&h, &fc2).unwrap(), &fc2).unwrap();
    let out = nn::linear(&h, &fc3).unwrap().transpose(0, 1).unwrap();
    let penalty = w1.as_tensor().sqr().unwrap().sum_all().unwrap();
    let loss = ((out * &g).unwrap().sum_all().unwrap() + penalty).unwrap();
    for (name, ours, candles) in both_stores(&loss, &vars) {
        let scale = candles.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let diff = ours
            .iter()
            .zip(&candles)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= 1e-6 * scale,
            "{name}: several uses differ by {diff}"
        );
    }

    // bf16 weights: converted inside the layer, so candle routes their gradients.
    let w16 = Var::from_tensor(&w3.as_tensor().to_dtype(DType::BF16).unwrap()).unwrap();
    let layer = candle_nn::Linear::new(w16.as_tensor().clone(), None);
    let h16 = h.to_dtype(DType::BF16).unwrap();
    let loss = nn::linear(&h16, &layer).unwrap().sum_all().unwrap();
    let [(_, ours, candles)] = both_stores(&loss, &[("w16", &w16)]).try_into().unwrap();
    assert_eq!(ours, candles, "bf16 weight");
}
