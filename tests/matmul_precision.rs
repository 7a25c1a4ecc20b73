//! `nn::set_float32_matmul_precision(Medium)` (torch's `"medium"`) and bf16 layers on AMX
//! tiles: the linear layers' products equal an f64 reference over bf16-rounded operands (the
//! output, and the gradients of the input, the weight and the bias), differ from the f32
//! products, and a small MLP trains to within bf16's reach of its f32 losses; in a layer of 6
//! rows, the forward and the input gradient on the tiles, the weight gradient (a sum over the
//! 6 rows) in f32 as `amx::worth` decides; the same layer over bf16 and f16 tensors. One test
//! in its own binary: the precision is process-wide. Where the CPU has no AMX tiles, `Medium`
//! must change nothing: the test checks that instead.

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{Linear, Optimizer};
use candle_parallel::nn::{self, MatmulPrecision};
use candle_parallel::rng::Rng;

/// `len` standard normal values.
fn normals(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.normal() as f32).collect()
}

/// `t`'s values rounded to bf16, in f64.
fn bf16_f64(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(DType::BF16)?.to_dtype(DType::F64)
}

/// The largest |a - b| over the largest |b| (at least 1).
fn relative(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f64>()?;
    let scale = b.abs()?.max_all()?.to_scalar::<f64>()?.max(1.0);
    Ok(diff / scale)
}

/// One layer's output and the gradients of `sum(y * r)` for x, w and b, with candle's f32 ops
/// applied to `x`, `w` (strided: a transposed copy viewed back) and `b`.
fn layer_and_grads(x: &Var, w: &Var, b: &Var, r: &Tensor) -> Result<Vec<Tensor>> {
    let w_view = w.as_tensor().t()?.contiguous()?.t()?;
    let y = nn::linear_gelu(
        x.as_tensor(),
        &Linear::new(w_view, Some(b.as_tensor().clone())),
    )?;
    let grads = (&y * r)?.sum_all()?.backward()?;
    let mut out = vec![y];
    for v in [x, w, b] {
        out.push(grads.get(v).expect("every input gets a gradient").clone());
    }
    Ok(out)
}

/// The same in f64 from bf16-rounded operands of each product, as the tiles compute: the
/// layer's input and weight; in backward, the gradient at the product (after GELU's
/// derivative) with the weight, and with the input.
fn reference(x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor) -> Result<Vec<Tensor>> {
    let (xr, wr) = (bf16_f64(x)?, bf16_f64(w)?);
    let (y, g) = forward_and_gradient_at_product(x, w, b, r)?;
    let gr = bf16_f64(&g.to_dtype(DType::F32)?)?;
    let dx = gr.matmul(&wr)?;
    let dw = gr.t()?.matmul(&xr)?;
    let db = g.sum(0)?;
    Ok(vec![y, dx, dw, db])
}

/// The layer's output and the gradient at its product (after GELU's derivative), in f64, the
/// forward's product from bf16-rounded operands.
fn forward_and_gradient_at_product(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    r: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (xr, wr) = (bf16_f64(x)?, bf16_f64(w)?);
    let b = b.to_dtype(DType::F64)?;
    let pre = xr.matmul(&wr.t()?)?.broadcast_add(&b)?;
    let y = pre.gelu_erf()?;
    // d gelu(u) / du = Φ(u) + u φ(u).
    let phi = ((pre.sqr()? * -0.5)?.exp()? / (2.0 * std::f64::consts::PI).sqrt())?;
    let cdf = (((&pre / 2f64.sqrt())?.erf()? + 1.0)? * 0.5)?;
    let g = (r.to_dtype(DType::F64)? * (cdf + (&pre * phi)?)?)?;
    Ok((y, g))
}

/// Losses of 20 SGD steps of a 3-layer MLP (128 -> 256 -> 160 -> 10, GELU) on 512 fixed rows:
/// the first two layers' products large enough for the tiles.
fn mlp_losses() -> anyhow::Result<Vec<f32>> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(7);
    let mut layer = |i: usize, o: usize| -> Result<(Var, Var, Linear)> {
        let scale = 1.0 / (i as f32).sqrt();
        let w: Vec<f32> = normals(&mut rng, o * i).iter().map(|v| v * scale).collect();
        let (w, b) = (
            Var::from_vec(w, (o, i), &dev)?,
            Var::zeros(o, DType::F32, &dev)?,
        );
        let linear = Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
        Ok((w, b, linear))
    };
    let (mut vars, mut layers) = (Vec::new(), Vec::new());
    for (i, o) in [(128, 256), (256, 160), (160, 10)] {
        let (w, b, linear) = layer(i, o)?;
        vars.extend([w, b]);
        layers.push(linear);
    }
    let x = Tensor::from_vec(normals(&mut rng, 512 * 128), (512, 128), &dev)?;
    let labels: Vec<u32> = (0..512).map(|i| (i * 7 % 10) as u32).collect();
    let labels = Tensor::from_vec(labels, 512, &dev)?;
    let mut sgd = candle_nn::SGD::new(vars, 0.5)?;
    let mut losses = Vec::new();
    for _ in 0..20 {
        let h = nn::linear_gelu(&x, &layers[0])?;
        let h = nn::linear_gelu(&h, &layers[1])?;
        let logits = nn::linear(&h, &layers[2])?;
        let loss = candle_nn::loss::cross_entropy(&logits, &labels)?;
        losses.push(loss.to_scalar::<f32>()?);
        sgd.backward_step(&loss)?;
    }
    Ok(losses)
}

#[test]
fn medium_precision_rounds_the_products_operands_to_bf16_and_trains() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(3);
    // Odd sizes (none a multiple of a tile), each product large enough for the tiles.
    let (n, k, o) = (301, 171, 290);
    let x = Var::from_vec(normals(&mut rng, n * k), (n, k), &dev)?;
    let w = Var::from_vec(normals(&mut rng, o * k), (o, k), &dev)?;
    let b = Var::from_vec(normals(&mut rng, o), o, &dev)?;
    let r = Tensor::from_vec(normals(&mut rng, n * o), (n, o), &dev)?;

    assert_eq!(nn::float32_matmul_precision(), MatmulPrecision::Highest);
    let highest = layer_and_grads(&x, &w, &b, &r)?;
    let losses_highest = mlp_losses()?;
    // A few rows through a wide layer: its forward and input gradient are large enough for
    // the tiles, its weight gradient (a sum over 6 rows) is not and stays f32.
    let (fn_, fk, fo) = (6, 1030, 700);
    let fx = Var::from_vec(normals(&mut rng, fn_ * fk), (fn_, fk), &dev)?;
    let fw = Var::from_vec(normals(&mut rng, fo * fk), (fo, fk), &dev)?;
    let fb = Var::from_vec(normals(&mut rng, fo), fo, &dev)?;
    let fr = Tensor::from_vec(normals(&mut rng, fn_ * fo), (fn_, fo), &dev)?;
    let few_highest = layer_and_grads(&fx, &fw, &fb, &fr)?;
    nn::set_float32_matmul_precision(MatmulPrecision::Medium);
    let medium = layer_and_grads(&x, &w, &b, &r)?;
    let few_medium = layer_and_grads(&fx, &fw, &fb, &fr)?;
    let losses_medium = mlp_losses()?;
    // Empty products under Medium (no rows and no outputs over 200 inputs; no inputs): zeros.
    for (n, k, o) in [(0, 200, 0), (0, 0, 150), (4, 0, 150)] {
        let xs = Var::zeros((n, k), DType::F32, &dev)?;
        let ws = Var::ones((o, k), DType::F32, &dev)?;
        let y = nn::linear(xs.as_tensor(), &Linear::new(ws.as_tensor().clone(), None))?;
        assert_eq!(y.dims(), [n, o]);
        let grads = y.sum_all()?.backward()?;
        let dw = grads.get(&ws).expect("the weight gets a gradient");
        assert_eq!(dw.dims(), [o, k]);
        assert_eq!(dw.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    }
    nn::set_float32_matmul_precision(MatmulPrecision::Highest);

    // Half-precision tensors through the few-row layer: bf16 on the tiles where there are
    // some (forward and input gradient), f16 in f32 (the forward on `few_rows`' kernel where
    // the CPU has AVX-512, the input gradient by blocks of columns); the weight
    // gradient, a sum over 6 rows, in f32 for both. Each against f64 products of the same
    // half-precision values, every result rounded once to its dtype (2^-8 relative for bf16,
    // 2^-11 for f16; measured 2.2e-3 to 3.0e-3 and 2.3e-4 to 3.4e-4).
    for (dtype, tol) in [(DType::BF16, 8e-3), (DType::F16, 1e-3)] {
        let half = |t: &Tensor| t.to_dtype(dtype);
        let wide = |t: &Tensor| t.to_dtype(dtype)?.to_dtype(DType::F64);
        let hx = Var::from_tensor(&half(fx.as_tensor())?)?;
        let hw = Var::from_tensor(&half(fw.as_tensor())?)?;
        let hr = half(&fr)?;
        let y = nn::linear(hx.as_tensor(), &Linear::new(hw.as_tensor().clone(), None))?;
        assert_eq!((y.dtype(), y.dims()), (dtype, &[fn_, fo][..]));
        let grads = (&y * &hr)?.sum_all()?.backward()?;
        let (xw, ww, rw) = (wide(fx.as_tensor())?, wide(fw.as_tensor())?, wide(&fr)?);
        let want = [
            ("output", y.clone(), xw.matmul(&ww.t()?)?),
            (
                "input gradient",
                grads.get(&hx).unwrap().clone(),
                rw.matmul(&ww)?,
            ),
            (
                "weight gradient",
                grads.get(&hw).unwrap().clone(),
                rw.t()?.matmul(&xw)?,
            ),
        ];
        for (name, got, want) in want {
            assert_eq!(got.dtype(), dtype, "{dtype:?} few rows: {name}");
            let err = relative(&got, &want)?;
            assert!(
                err < tol,
                "{dtype:?} few rows: {name}: {err:e} from the reference"
            );
        }
    }

    // Each result's name and its tolerance against the bf16 reference: f32 sums of up to 301
    // products, well inside 1e-5 of the largest value; for the two products of the backward,
    // 1e-4: their operand, the gradient through GELU, is computed in f32 here and in f64 in the
    // reference, and where the two fall either side of a bf16 rounding boundary one product
    // moves by 2^-8 (measured 1.2e-5).
    let results = [
        ("output", 1e-5),
        ("input gradient", 1e-4),
        ("weight gradient", 1e-4),
        ("bias gradient", 1e-5),
    ];
    if !nn::bf16_tiles_available() {
        eprintln!("no AMX tiles here: checking that Medium changes nothing");
        for ((h, m), (name, _)) in highest.iter().zip(&medium).zip(results) {
            assert_eq!(relative(m, h)?, 0.0, "{name}");
        }
        assert_eq!(losses_medium, losses_highest);
        for ((h, m), (name, _)) in few_highest.iter().zip(&few_medium).zip(results) {
            assert_eq!(relative(m, h)?, 0.0, "few rows: {name}");
        }
        return Ok(());
    }
    let few = [
        fx.as_tensor(),
        fw.as_tensor(),
        fb.as_tensor(),
        &fr.to_dtype(DType::F64)?,
    ];
    let mut few_want = reference(few[0], few[1], few[2], few[3])?;
    // The weight gradient: f32 products of the gradient at the product (from the tiled
    // forward) and x.
    let (_, g) = forward_and_gradient_at_product(few[0], few[1], few[2], few[3])?;
    few_want[2] = g.t()?.matmul(&fx.as_tensor().to_dtype(DType::F64)?)?;
    for (i, (name, tol)) in results.iter().enumerate() {
        let (h, m, want) = (&few_highest[i], &few_medium[i], &few_want[i]);
        // Medium moved each result from f32's, the weight gradient through its operand.
        assert!(relative(m, h)? > 1e-5, "few rows: {name} as in f32");
        let err = relative(m, want)?;
        assert!(err < *tol, "few rows: {name}: {err:e} from the reference");
    }
    let want = reference(
        x.as_tensor(),
        w.as_tensor(),
        b.as_tensor(),
        &r.to_dtype(DType::F64)?,
    )?;
    for (((h, m), want), (name, tol)) in highest.iter().zip(&medium).zip(&want).zip(results) {
        let err = relative(m, want)?;
        assert!(err < tol, "{name}: {err:e} from the bf16 reference");
        // bf16 operands move the result visibly, and no more (measured 3e-3 to 2e-2 of the
        // largest value).
        let moved = relative(m, h)?;
        assert!(
            moved > 1e-5 && moved < 3e-2,
            "{name}: {moved:e} from the f32 products"
        );
    }
    // The MLP learns the same: losses fall alike, within bf16's reach of f32's.
    for (step, (m, h)) in losses_medium.iter().zip(&losses_highest).enumerate() {
        assert!(
            (m - h).abs() <= 1e-2 * h.abs(),
            "step {step}: loss {m} under Medium, {h} in f32"
        );
    }
    assert!(
        losses_medium[19] < 0.9 * losses_medium[0],
        "{losses_medium:?}"
    );
    assert_ne!(losses_medium, losses_highest);

    // bf16 layers run on the tiles too: the product of bf16 x and w equals the reference.
    // (Too small a product stays f32: that the bf16 layer tests in tests/layers.rs cover.)
    let (xb, wb) = (x.to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
    let y = nn::linear(&xb, &Linear::new(wb, None))?;
    let want = bf16_f64(x.as_tensor())?.matmul(&bf16_f64(w.as_tensor())?.t()?)?;
    assert_eq!(y.dtype(), DType::BF16);
    // One bf16 rounding of the output: 2^-8 relative.
    assert!(relative(&y, &want)? < 8e-3);
    Ok(())
}
