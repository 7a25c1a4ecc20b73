//! Adversarial checks of `nn::backward` (gradients equal to `loss.backward()`'s) and of
//! `threads::in_pool`: shared weights, dtypes, strided variables, errors and panics midway,
//! nesting, threads.

mod common;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Module, Shape, Tensor, Var};
use candle_nn::{Linear, VarBuilder, VarMap};
use candle_parallel::{activation_checkpointing, nn, threads};

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Both stores hold a gradient for each of `vars`, equal within `tol` (0: bit for bit).
fn same_grads(loss: &Tensor, vars: &[&Tensor], tol: f64) {
    let ours = nn::backward(loss).unwrap();
    let theirs = loss.backward().unwrap();
    for (i, v) in vars.iter().enumerate() {
        let a = ours
            .get(v)
            .unwrap_or_else(|| panic!("var {i}: no gradient from nn::backward"));
        let b = theirs.get(v).expect("candle's gradient");
        assert_eq!(a.dims(), b.dims(), "var {i}: shape");
        assert_eq!(a.dtype(), b.dtype(), "var {i}: dtype");
        for (x, y) in flat(a).iter().zip(flat(b)) {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "var {i}: {x} vs {y}"
            );
        }
    }
}

fn model(dtype: DType) -> (VarMap, Linear, Linear) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let a = candle_nn::linear(16, 16, vb.pp("a")).unwrap();
    let b = candle_nn::linear(16, 8, vb.pp("b")).unwrap();
    (varmap, a, b)
}

#[test]
fn shared_weight_and_weight_used_by_a_candle_op() {
    let (_m, a, b) = model(DType::F32);
    let x = Tensor::randn(0f32, 1.0, (5, 16), &Device::Cpu).unwrap();
    // a used twice, and its weight also by candle's ops.
    let h = nn::linear_relu(&nn::linear_gelu(&x, &a).unwrap(), &a).unwrap();
    let y = nn::linear(&h, &b).unwrap();
    let loss = (y.sqr().unwrap().sum_all().unwrap() + a.weight().sqr().unwrap().sum_all().unwrap())
        .unwrap();
    same_grads(&loss, &[a.weight(), a.bias().unwrap(), b.weight()], 1e-5);
    // the weight as its own input: w . w^T
    let sq = nn::linear(a.weight(), &Linear::new(a.weight().clone(), None)).unwrap();
    same_grads(&sq.sqr().unwrap().sum_all().unwrap(), &[a.weight()], 1e-5);
}

#[test]
fn single_use_is_bit_for_bit() {
    let (_m, a, b) = model(DType::F32);
    let x = Tensor::randn(0f32, 1.0, (7, 16), &Device::Cpu).unwrap();
    let loss = nn::linear(&nn::linear_relu(&x, &a).unwrap(), &b)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    same_grads(
        &loss,
        &[a.weight(), a.bias().unwrap(), b.weight(), b.bias().unwrap()],
        0.0,
    );
}

#[test]
fn other_dtypes() {
    for dtype in [DType::F16, DType::BF16, DType::F64] {
        let (_m, a, b) = model(dtype);
        let x = Tensor::randn(0f32, 1.0, (4, 16), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let loss = nn::linear(&nn::linear_relu(&x, &a).unwrap(), &b)
            .unwrap()
            .sum_all()
            .unwrap();
        same_grads(&loss, &[a.weight(), a.bias().unwrap(), b.weight()], 0.0);
    }
}

#[test]
fn transposed_var_rank3_empty_batch_var_input() {
    let w = Var::from_tensor(
        &Tensor::randn(0f32, 1.0, (16, 8), &Device::Cpu)
            .unwrap()
            .t()
            .unwrap(),
    )
    .unwrap();
    // candle's Var::from_tensor copies into a contiguous tensor: a strided variable cannot be made
    assert!(w.as_tensor().is_contiguous());
    let lin = Linear::new(w.as_tensor().clone(), None);
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 3, 16), &Device::Cpu).unwrap()).unwrap();
    let loss = nn::linear_gelu(x.as_tensor(), &lin)
        .unwrap()
        .sum_all()
        .unwrap();
    same_grads(&loss, &[w.as_tensor(), x.as_tensor()], 0.0);
    // empty batch
    let (_m, a, _) = model(DType::F32);
    let e = Tensor::zeros((0, 16), DType::F32, &Device::Cpu).unwrap();
    let loss = nn::linear(&e, &a).unwrap().sum_all().unwrap();
    same_grads(&loss, &[a.weight(), a.bias().unwrap()], 0.0);
    // layer norm over a Var input, rank 3
    let ln = nn::layer_norm(
        16,
        1e-5,
        VarBuilder::from_varmap(&_m, DType::F32, &Device::Cpu).pp("ln"),
    )
    .unwrap();
    let loss = ln
        .forward(x.as_tensor())
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    same_grads(&loss, &[x.as_tensor()], 1e-6);
}

/// Identity whose backward fails (or panics) or runs a plain `backward()` of its own.
struct Probe {
    mode: u8,
    inner: Option<(Tensor, Tensor)>,
    inner_found: std::sync::Mutex<Option<bool>>,
}

impl CustomOp1 for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = s.as_slice::<f32>()?;
        let v = match l.contiguous_offsets() {
            Some((a, b)) => v[a..b].to_vec(),
            None => candle_core::bail!("contiguous only"),
        };
        Ok((CpuStorage::F32(v), l.shape().clone()))
    }
    fn bwd(&self, _a: &Tensor, _r: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        match self.mode {
            0 => candle_core::bail!("probe fails on purpose"),
            1 => panic!("probe panics on purpose"),
            _ => {
                let (loss, w) = self.inner.as_ref().unwrap();
                let grads = loss.backward()?;
                *self.inner_found.lock().unwrap() = Some(grads.get(w).is_some());
                Ok(Some(g.clone()))
            }
        }
    }
}

fn probe(mode: u8, inner: Option<(Tensor, Tensor)>) -> Probe {
    Probe {
        mode,
        inner,
        inner_found: std::sync::Mutex::new(None),
    }
}

#[test]
fn failure_midway_leaves_the_next_backward_right() {
    let (_m, a, b) = model(DType::F32);
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 16), &Device::Cpu).unwrap()).unwrap();
    for mode in [0u8, 1] {
        // the probe sits below `a`: a's backward has handed its gradients over when it fails
        let h = x.as_tensor().apply_op1(probe(mode, None)).unwrap();
        let loss = nn::linear(&h, &a).unwrap().sum_all().unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| nn::backward(&loss)));
        assert!(matches!(r, Ok(Err(_)) | Err(_)));
        let loss = nn::linear(&nn::linear(x.as_tensor(), &a).unwrap(), &b)
            .unwrap()
            .sum_all()
            .unwrap();
        same_grads(&loss, &[a.weight(), b.weight(), x.as_tensor()], 0.0);
    }
}

#[test]
fn plain_backward_inside_a_custom_op_during_nn_backward() {
    let (_m, a, _) = model(DType::F32);
    let (_m2, inner, _) = model(DType::F32);
    let xi = Tensor::randn(0f32, 1.0, (3, 16), &Device::Cpu).unwrap();
    let inner_loss = nn::linear(&xi, &inner).unwrap().sum_all().unwrap();
    let x = Tensor::randn(0f32, 1.0, (4, 16), &Device::Cpu).unwrap();
    let op = std::sync::Arc::new(probe(2, Some((inner_loss, inner.weight().clone()))));
    struct Shared(std::sync::Arc<Probe>);
    impl CustomOp1 for Shared {
        fn name(&self) -> &'static str {
            "shared-probe"
        }
        fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            self.0.cpu_fwd(s, l)
        }
        fn bwd(&self, a: &Tensor, r: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
            self.0.bwd(a, r, g)
        }
    }
    let h = nn::linear(&x, &a)
        .unwrap()
        .apply_op1(Shared(op.clone()))
        .unwrap();
    let outer = nn::backward(&h.sum_all().unwrap()).unwrap();
    let inner_found = op.inner_found.lock().unwrap().unwrap();
    let leaked = outer.get(inner.weight()).is_some();
    assert!(
        inner_found && !leaked,
        "the inner plain backward found its weight's gradient: {inner_found}; the outer store \
         got the inner weight's gradient: {leaked}"
    );
}

#[test]
fn several_threads_at_once() {
    let (_m, a, b) = model(DType::F32);
    let x = Tensor::randn(0f32, 1.0, (64, 16), &Device::Cpu).unwrap();
    let loss = || {
        nn::linear(&nn::linear_relu(&x, &a).unwrap(), &b)
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let want = flat(loss().backward().unwrap().get(a.weight()).unwrap());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..20 {
                    let g = nn::backward(&loss()).unwrap();
                    assert_eq!(flat(g.get(a.weight()).unwrap()), want);
                }
            });
        }
    });
}

/// A plain backward that rayon runs on a worker while that worker waits inside the layer
/// backward of an nn::backward (work stealing) must still get its gradients.
#[test]
fn plain_backward_stolen_by_a_worker_inside_nn_backward() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let big = candle_nn::linear(512, 512, vb.pp("big")).unwrap();
    let small = candle_nn::linear(16, 16, vb.pp("small")).unwrap();
    let xb = Tensor::randn(0f32, 1.0, (256, 512), &Device::Cpu).unwrap();
    let xs = Tensor::randn(0f32, 1.0, (4, 16), &Device::Cpu).unwrap();
    let missing = std::sync::atomic::AtomicUsize::new(0);
    threads::in_pool(|| {
        let rounds = std::env::var("BREAKER_ROUNDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30);
        for _ in 0..rounds {
            let jobs: Vec<usize> = (0..64).collect();
            use rayon::prelude::*;
            rayon::join(
                || {
                    for _ in 0..3 {
                        let l = nn::linear(&xb, &big).unwrap().sum_all().unwrap();
                        nn::backward(&l).unwrap();
                    }
                },
                || {
                    jobs.par_iter().for_each(|_| {
                        let l = nn::linear(&xs, &small).unwrap().sum_all().unwrap();
                        if l.backward().unwrap().get(small.weight()).is_none() {
                            missing.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    })
                },
            );
        }
    });
    assert_eq!(
        missing.into_inner(),
        0,
        "plain backwards that lost the weight's gradient"
    );
}

struct Block(Linear);
impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        nn::linear_relu(x, &self.0)
    }
}

#[test]
fn nested_checkpoints_match_the_plain_model() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let outer = activation_checkpointing::checkpoint(vb.pp("outer"), |vb| {
        let inner = activation_checkpointing::checkpoint(vb.pp("in"), |vb| {
            Ok(Block(candle_nn::linear(16, 16, vb.pp("l"))?))
        })?;
        let last = Block(candle_nn::linear(16, 16, vb.pp("last"))?);
        Ok((inner, last))
    })
    .unwrap();
    let x = Tensor::randn(0f32, 1.0, (6, 16), &Device::Cpu).unwrap();
    let y = outer
        .forward_with(&x, |(i, l), x| l.forward(&i.forward(x)?))
        .unwrap();
    let ours = nn::backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
    let (i, l) = outer.module();
    let plain = l.forward(&i.module().forward(&x).unwrap()).unwrap();
    let theirs = plain.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    for (name, v) in varmap.data().lock().unwrap().iter() {
        let a = ours
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        let b = theirs.get(v.as_tensor()).unwrap();
        for (p, q) in flat(a).iter().zip(flat(b)) {
            assert!((p - q).abs() < 1e-5 * (1.0 + q.abs()), "{name}: {p} vs {q}");
        }
    }
}

struct Net {
    a: Linear,
    b: Linear,
}
impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // `a` twice: one variable, two gradients
        let h = nn::linear(&nn::linear_relu(x, &self.a)?, &self.a)?;
        nn::linear_gelu(&h, &self.b)
    }
}
fn net(vb: VarBuilder) -> candle_core::Result<Net> {
    Ok(Net {
        a: candle_nn::linear(8, 8, vb.pp("a"))?,
        b: candle_nn::linear(8, 4, vb.pp("b"))?,
    })
}

/// DDP over 2 thread ranks, inside `in_pool` (a child process under RAYON_NUM_THREADS=1 too):
/// the averaged gradients equal one process's plain backward over the whole batch.
#[test]
fn ddp_in_pool_matches_plain_backward() {
    use candle_parallel::ddp::DdpConfig;
    use candle_parallel::distributed;
    use candle_parallel::init::seeded_var_builder;
    use candle_parallel::DistributedDataParallel;
    if std::env::var("BREAKER_CASE").as_deref() != Ok("ddp") {
        for threads in ["1", "2"] {
            let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
            cmd.args([
                "ddp_in_pool_matches_plain_backward",
                "--exact",
                "--nocapture",
            ])
            .env("BREAKER_CASE", "ddp")
            .env("RAYON_NUM_THREADS", threads);
            let out = common::run(cmd, std::time::Duration::from_secs(120));
            assert!(
                out.status.success(),
                "RAYON_NUM_THREADS={threads}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        return;
    }
    let x = Tensor::randn(0f32, 1.0, (12, 8), &Device::Cpu).unwrap();
    let varmap = VarMap::new();
    let model = net(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
    let want = model
        .forward(&x)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
        .backward()
        .unwrap();
    let want: Vec<(String, Vec<f64>)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), flat(want.get(v.as_tensor()).unwrap())))
        .collect();
    let got = threads::in_pool(|| {
        distributed::spawn_threads(2, |pg| {
            let varmap = VarMap::new();
            net(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu))?;
            let config = DdpConfig {
                bucket_cap_mb: 1e-4,
                first_bucket_mb: 1e-4,
                ..DdpConfig::default()
            };
            let model =
                DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, net)?;
            let mine = x.narrow(0, 6 * pg.rank(), 6)?;
            let l = model.forward_t(&mine, true)?.sqr()?.mean_all()?;
            let g = model.backward(&l)?;
            let out: Vec<(String, Vec<f64>)> = varmap
                .data()
                .lock()
                .unwrap()
                .iter()
                .map(|(n, v)| {
                    (
                        n.clone(),
                        g.get(v.as_tensor()).map(flat).unwrap_or_default(),
                    )
                })
                .collect();
            Ok(out)
        })
        .unwrap()
    });
    for rank in got {
        for (name, w) in &want {
            let g = &rank.iter().find(|(n, _)| n == name).unwrap().1;
            assert_eq!(g.len(), w.len(), "{name}: no gradient");
            for (p, q) in g.iter().zip(w) {
                assert!((p - q).abs() < 1e-5 * (1.0 + q.abs()), "{name}: {p} vs {q}");
            }
        }
    }
}

/// Gradient accumulation over several nn::backward calls, and a scaled loss (GradScaler).
#[test]
fn accumulation_and_scaler() {
    use candle_parallel::amp::{GradScaler, GradScalerConfig};
    let varmap = VarMap::new();
    let model = net(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    let vars = varmap.all_vars();
    let xs: Vec<Tensor> = (0..3)
        .map(|_| Tensor::randn(0f32, 1.0, (5, 8), &Device::Cpu).unwrap())
        .collect();
    let scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let mut sum_ours: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut sum_plain: Vec<Option<Tensor>> = vec![None; vars.len()];
    for x in &xs {
        let l = scaler
            .scale(&model.forward(x).unwrap().sum_all().unwrap())
            .unwrap();
        let (o, p) = (nn::backward(&l).unwrap(), l.backward().unwrap());
        for (i, v) in vars.iter().enumerate() {
            let add = |acc: &mut Option<Tensor>, g: &Tensor| {
                *acc = Some(match acc.take() {
                    Some(a) => (a + g).unwrap(),
                    None => g.clone(),
                })
            };
            add(&mut sum_ours[i], o.get(v.as_tensor()).expect("ours"));
            add(&mut sum_plain[i], p.get(v.as_tensor()).expect("plain"));
        }
    }
    for (a, b) in sum_ours.iter().zip(&sum_plain) {
        for (p, q) in flat(a.as_ref().unwrap())
            .iter()
            .zip(flat(b.as_ref().unwrap()))
        {
            assert!((p - q).abs() <= 1e-6 * (1.0 + q.abs()), "{p} vs {q}");
        }
    }
}

/// Identity whose backward lets rayon run a pending job on this thread (as any rayon wait
/// inside a backward may: a split that waits for a stolen piece runs other jobs meanwhile).
struct Yield;
impl CustomOp1 for Yield {
    fn name(&self) -> &'static str {
        "yield"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Probe::cpu_fwd(&probe(0, None), s, l)
    }
    fn bwd(&self, _a: &Tensor, _r: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let _ = rayon::yield_local();
        Ok(Some(g.clone()))
    }
}

/// The same worker runs a plain backward of another model while an nn::backward waits in
/// rayon (deterministic with one thread and `yield_local`).
#[test]
fn plain_backward_run_by_rayon_while_nn_backward_waits() {
    let (_m, a, _) = model(DType::F32);
    let (_m2, small, _) = model(DType::F32);
    let x = Tensor::randn(0f32, 1.0, (4, 16), &Device::Cpu).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let (outer, found) = pool.install(|| {
        rayon::join(
            || {
                let h = nn::linear(&x, &a).unwrap().apply_op1(Yield).unwrap();
                nn::backward(&h.sum_all().unwrap()).unwrap()
            },
            || {
                let l = nn::linear(&x, &small).unwrap().sum_all().unwrap();
                l.backward().unwrap().get(small.weight()).is_some()
            },
        )
    });
    let leaked = outer.get(small.weight()).is_some();
    assert!(
        found && !leaked,
        "the other job's plain backward found its weight's gradient: {found}; the nn::backward's \
         store got that weight's gradient: {leaked}"
    );
}

struct Sharded {
    unit: candle_parallel::fsdp::Unit<Net>,
    head: Linear,
}
impl Module for Sharded {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        nn::linear(&self.unit.forward(x)?, &self.head)
    }
}
fn sharded(vb: VarBuilder) -> candle_core::Result<Sharded> {
    Ok(Sharded {
        unit: candle_parallel::fsdp::unit(vb.pp("u"), net)?,
        head: candle_nn::linear(4, 4, vb.pp("head"))?,
    })
}

/// Each variable of `varmap` after one SGD step of lr 1 on `mean(out²)` by one process's
/// plain backward.
fn after_one_step_of_lr_1(varmap: &VarMap, out: &Tensor) -> Vec<(String, Vec<f64>)> {
    let g = out.sqr().unwrap().mean_all().unwrap().backward().unwrap();
    let data = varmap.data().lock().unwrap();
    data.iter()
        .map(|(n, v)| {
            let stepped = (v.as_tensor() - g.get(v.as_tensor()).unwrap()).unwrap();
            (n.clone(), flat(&stepped))
        })
        .collect()
}

/// Every rank's parameters (by name) within 1e-5 of `want`.
fn assert_ranks_match(got: Vec<Vec<(String, Vec<f64>)>>, want: &[(String, Vec<f64>)]) {
    for rank in got {
        for (name, w) in want {
            let p = &rank
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("{name}"))
                .1;
            for (p, q) in p.iter().zip(w) {
                assert!((p - q).abs() < 1e-5 * (1.0 + q.abs()), "{name}: {p} vs {q}");
            }
        }
    }
}

/// FSDP over 2 thread ranks (a unit whose weight is used twice, a root layer), inside in_pool:
/// one SGD step of lr 1 moves each parameter by one process's plain-backward gradient.
#[test]
fn fsdp_step_matches_plain_backward() {
    use candle_nn::Optimizer;
    use candle_parallel::distributed;
    use candle_parallel::fsdp::FsdpConfig;
    use candle_parallel::optim::{Sgd, SgdConfig};
    use candle_parallel::FullyShardedDataParallel;
    let x = Tensor::randn(0f32, 1.0, (12, 8), &Device::Cpu).unwrap();
    let varmap = VarMap::new();
    let model = sharded(candle_parallel::init::seeded_var_builder(
        &varmap,
        3,
        DType::F32,
        &Device::Cpu,
    ))
    .unwrap();
    let want = after_one_step_of_lr_1(&varmap, &model.forward(&x).unwrap());
    let got = threads::in_pool(|| {
        distributed::spawn_threads(2, |pg| {
            let config = FsdpConfig {
                seed: Some(3),
                ..FsdpConfig::default()
            };
            let f = FullyShardedDataParallel::with_config(
                &VarMap::new(),
                &pg,
                &Device::Cpu,
                config,
                sharded,
            )?;
            let mut opt = Sgd::new(
                f.parameters(),
                SgdConfig {
                    lr: 1.0,
                    ..SgdConfig::default()
                },
            )?;
            let mine = x.narrow(0, 6 * pg.rank(), 6)?;
            let l = f.forward_t(&mine, true)?.sqr()?.mean_all()?;
            opt.step(&f.backward(&l)?)?;
            Ok(f.full_parameters()?
                .into_iter()
                .map(|(n, t)| (n, flat(&t)))
                .collect::<Vec<_>>())
        })
        .unwrap()
    });
    assert_ranks_match(got, &want);
}

/// ZeRO-2 over 2 thread ranks inside in_pool: one SGD step of lr 1 (a weight used twice).
#[test]
fn zero2_step_matches_plain_backward() {
    use candle_nn::Optimizer;
    use candle_parallel::ddp::{DdpConfig, Sharding};
    use candle_parallel::distributed;
    use candle_parallel::init::seeded_var_builder;
    use candle_parallel::optim::{Sgd, SgdConfig};
    use candle_parallel::DistributedDataParallel;
    let x = Tensor::randn(0f32, 1.0, (12, 8), &Device::Cpu).unwrap();
    let varmap = VarMap::new();
    let model = net(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
    let want = after_one_step_of_lr_1(&varmap, &model.forward(&x).unwrap());
    let got = threads::in_pool(|| {
        distributed::spawn_threads(2, |pg| {
            let varmap = VarMap::new();
            net(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu))?;
            let config = DdpConfig {
                sharding: Sharding::Zero2,
                bucket_cap_mb: 1e-4,
                ..DdpConfig::default()
            };
            let model =
                DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, net)?;
            let mut opt = Sgd::new(
                model.parameters(),
                SgdConfig {
                    lr: 1.0,
                    ..SgdConfig::default()
                },
            )?;
            let mine = x.narrow(0, 6 * pg.rank(), 6)?;
            let l = model.forward_t(&mine, true)?.sqr()?.mean_all()?;
            opt.step(&model.backward(&l)?)?;
            model.gather_parameters()?;
            let out: Vec<(String, Vec<f64>)> = varmap
                .data()
                .lock()
                .unwrap()
                .iter()
                .map(|(n, v)| (n.clone(), flat(v.as_tensor())))
                .collect();
            Ok(out)
        })
        .unwrap()
    });
    assert_ranks_match(got, &want);
}

/// The norms and the convolution: bit for bit where each variable gets one gradient; a norm
/// weight shared by a LayerNorm and an RmsNorm and also used by candle's ops.
#[test]
fn norms_and_conv() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ln = nn::layer_norm(16, 1e-5, vb.pp("ln")).unwrap();
    let rms = nn::rms_norm(16, 1e-5, vb.pp("rms")).unwrap();
    let conv = nn::conv2d(
        3,
        4,
        3,
        candle_nn::Conv2dConfig {
            padding: 1,
            ..Default::default()
        },
        vb.pp("c"),
    )
    .unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 5, 16), &Device::Cpu).unwrap();
    let loss = rms
        .forward(&ln.forward(&x).unwrap())
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    let vars: Vec<Tensor> = varmap
        .all_vars()
        .iter()
        .map(|v| v.as_tensor().clone())
        .collect();
    let used: Vec<&Tensor> = vars.iter().filter(|v| v.dims() == [16]).collect();
    same_grads(&loss, &used, 0.0);
    let img = Tensor::randn(0f32, 1.0, (2, 3, 8, 8), &Device::Cpu).unwrap();
    let loss = conv
        .forward(&img)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    let cv: Vec<&Tensor> = vars.iter().filter(|v| v.dims() != [16]).collect();
    same_grads(&loss, &cv, 0.0);
    // one weight for both norms, plus candle's use of it
    let w = Var::from_tensor(&Tensor::randn(1f32, 0.1, 16, &Device::Cpu).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::randn(0f32, 0.1, 16, &Device::Cpu).unwrap()).unwrap();
    let ln2 = nn::LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5);
    let rms2 = nn::RmsNorm::new(w.as_tensor().clone(), 1e-5);
    let y = rms2.forward(&ln2.forward(&x).unwrap()).unwrap();
    let loss = (y.sqr().unwrap().sum_all().unwrap() + w.as_tensor().sum_all().unwrap()).unwrap();
    same_grads(&loss, &[w.as_tensor(), b.as_tensor()], 1e-5);
}

/// DataParallel over 3 CPU replicas of a model whose weight is used twice, inside in_pool.
#[test]
fn data_parallel_replicas() {
    use candle_parallel::parallel::DataParallel;
    let x = Tensor::randn(0f32, 1.0, (10, 8), &Device::Cpu).unwrap();
    let varmap = VarMap::new();
    let dp = DataParallel::new(&varmap, vec![Device::Cpu; 3], net).unwrap();
    let vars: Vec<Tensor> = dp
        .parameters()
        .iter()
        .map(|v| v.as_tensor().clone())
        .collect();
    let loss = threads::in_pool(|| dp.forward(&x).unwrap().sqr().unwrap().mean_all().unwrap());
    let ours = threads::in_pool(|| nn::backward(&loss).unwrap());
    let single = net(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    let plain = single
        .forward(&x)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
        .backward()
        .unwrap();
    for (i, v) in vars.iter().enumerate() {
        let a = ours
            .get(v)
            .unwrap_or_else(|| panic!("var {i}: no gradient"));
        for (p, q) in flat(a).iter().zip(flat(plain.get(v).unwrap())) {
            assert!(
                (p - q).abs() < 1e-5 * (1.0 + q.abs()),
                "var {i}: {p} vs {q}"
            );
        }
    }
}
