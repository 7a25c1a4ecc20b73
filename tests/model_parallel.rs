//! Model parallel in one process: a perceptron cut into 2 and 3 stages on CPU "devices" (each
//! stage's forward on a thread of its own when pipelined) computes the one-device model's
//! gradients and trains as it does; the pipelined stages run at the same time; misuse is a
//! typed error.

mod common;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, loss, Linear, Optimizer, VarMap};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::model_parallel::{ModelParallel, Stage};
use candle_parallel::optim::Sgd;
use candle_parallel::Error;
use common::models::{batch, max_diff, values, Values, CLASSES, IN, SGD};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

const HIDDEN: usize = 16;
const ROWS: usize = 13;
const STEPS: usize = 20;

/// The perceptron's three layers, their variables on `devices[i]` for layer `i`, initialised
/// from one seed and their names (so the same on any device).
fn layers(varmap: &VarMap, devices: [&Device; 3]) -> [Linear; 3] {
    let vb = |d: &Device| seeded_var_builder(varmap, 7, DType::F32, d);
    [
        linear(IN, HIDDEN, vb(devices[0]).pp("l1")).unwrap(),
        linear(HIDDEN, HIDDEN, vb(devices[1]).pp("l2")).unwrap(),
        linear(HIDDEN, CLASSES, vb(devices[2]).pp("l3")).unwrap(),
    ]
}

fn relu(layer: Linear) -> impl Module + Send + Sync {
    move |x: &Tensor| layer.forward(x)?.relu()
}

/// The perceptron on one device, as one module.
fn one_device(varmap: &VarMap) -> impl Module {
    let cpu = Device::Cpu;
    let [l1, l2, l3] = layers(varmap, [&cpu; 3]);
    move |x: &Tensor| l3.forward(&l2.forward(&l1.forward(x)?.relu()?)?.relu()?)
}

/// The perceptron cut into `stages` (2: l1 l2 | l3; 3: l1 | l2 | l3), each stage on a CPU
/// "device" of its own.
fn model_parallel(varmap: &VarMap, stages: usize) -> ModelParallel {
    let devices = [Device::Cpu, Device::Cpu, Device::Cpu];
    let [l1, l2, l3] = layers(varmap, [&devices[0], &devices[1], &devices[2]]);
    let stages = if stages == 2 {
        let (l1, l2) = (relu(l1), relu(l2));
        vec![
            Stage::new(&devices[0], move |x: &Tensor| l2.forward(&l1.forward(x)?)),
            Stage::new(&devices[1], l3),
        ]
    } else {
        vec![
            Stage::new(&devices[0], relu(l1)),
            Stage::new(&devices[1], relu(l2)),
            Stage::new(&devices[2], l3),
        ]
    };
    ModelParallel::new(stages).unwrap()
}

/// The gradient of every variable of `varmap` for `loss`, by name.
fn gradients(varmap: &VarMap, loss: &Tensor) -> Values {
    let grads = loss.backward().unwrap();
    let vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    let mut out: Vec<(String, Vec<f32>)> = vars
        .into_iter()
        .map(|(n, v)| {
            let g = grads.get(&v).expect("every variable gets a gradient");
            (n, g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn step_loss(model: &dyn Module, step: usize) -> Tensor {
    let (x, y) = batch(step, ROWS);
    loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap()
}

/// Gradients of the first step, then the variables after `STEPS` steps of SGD with momentum.
fn train(varmap: &VarMap, model: &dyn Module) -> (Values, Values) {
    let grads = gradients(varmap, &step_loss(model, 0));
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    for step in 0..STEPS {
        opt.backward_step(&step_loss(model, step)).unwrap();
    }
    (grads, values(varmap))
}

#[test]
fn two_and_three_stages_plain_and_pipelined_equal_the_one_device_model() {
    let plain = VarMap::new();
    let (want_grads, want) = train(&plain, &one_device(&plain));
    // Micro-batches of 13 rows: 13 (one); 5, 5, 3 (three); 3, 3, 3, 3, 1 (five).
    for stages in [2, 3] {
        for split in [None, Some(13), Some(5), Some(3)] {
            let varmap = VarMap::new();
            let mut model = model_parallel(&varmap, stages);
            if let Some(split) = split {
                model = model.with_split_size(split).unwrap();
            }
            let (grads, got) = train(&varmap, &model);
            let what = format!("{stages} stages, split_size {split:?}");
            let d = max_diff(&grads, &want_grads);
            assert!(d <= 1e-5, "{what}: gradients {d} away from one device's");
            let d = max_diff(&got, &want);
            assert!(
                d <= 1e-5,
                "{what}: {d} away from one device after {STEPS} steps"
            );
        }
    }
}

/// What the stages of the concurrency test saw: which (stage, micro-batch) forwards started.
#[derive(Default)]
struct Log {
    started: Mutex<Vec<(usize, usize)>>,
    changed: Condvar,
}

impl Log {
    fn start(&self, stage: usize, micro_batch: usize) {
        self.started.lock().unwrap().push((stage, micro_batch));
        self.changed.notify_all();
    }

    /// Waits (up to 10 s) until stage `stage` has started micro-batch `micro_batch`.
    fn seen(&self, stage: usize, micro_batch: usize) -> bool {
        let started = self.started.lock().unwrap();
        let (started, _) = self
            .changed
            .wait_timeout_while(started, Duration::from_secs(10), |s| {
                !s.contains(&(stage, micro_batch))
            })
            .unwrap();
        started.contains(&(stage, micro_batch))
    }
}

/// A stage that numbers the micro-batches it sees and logs each start; `check` runs inside
/// its forward.
fn logging_stage(
    stage: usize,
    log: &Arc<Log>,
    check: impl Fn(usize) + Send + Sync + 'static,
) -> Stage {
    let (log, count) = (log.clone(), Mutex::new(0));
    Stage::new(&Device::Cpu, move |x: &Tensor| {
        let j = {
            let mut c = count.lock().unwrap();
            *c += 1;
            *c - 1
        };
        log.start(stage, j);
        check(j);
        x + 1.0
    })
}

#[test]
fn pipelined_stages_run_at_the_same_time() {
    // Stage 1 computes micro-batch 0 only once stage 0 has started micro-batch 1: possible
    // only if the two run at once (one after the other, stage 1 would wait forever).
    let log = Arc::new(Log::default());
    let overlapped = Arc::new(Mutex::new(None));
    let (l, o) = (log.clone(), overlapped.clone());
    let model = ModelParallel::new(vec![
        logging_stage(0, &log, |_| {}),
        logging_stage(1, &log, move |j| {
            if j == 0 {
                *o.lock().unwrap() = Some(l.seen(0, 1));
            }
        }),
    ])
    .unwrap()
    .with_split_size(2)
    .unwrap();
    let x = Tensor::arange(0f32, 6., &Device::Cpu)
        .unwrap()
        .reshape((6, 1))
        .unwrap();
    let out = model.forward(&x).unwrap();
    assert_eq!(
        out.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        [2., 3., 4., 5., 6., 7.],
        "the micro-batches come back in order"
    );
    assert_eq!(*overlapped.lock().unwrap(), Some(true), "stage 1 waited 10 s on micro-batch 0 and stage 0 did not start micro-batch 1: the stages ran one after the other");
}

#[test]
fn misuse_is_a_typed_error_that_says_what_to_do() {
    assert!(matches!(ModelParallel::new(vec![]), Err(Error::NoDevices)));
    let varmap = VarMap::new();
    let model = model_parallel(&varmap, 2);
    let err = model_parallel(&varmap, 2).with_split_size(0).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                what: "split_size",
                ..
            }
        ),
        "{err}"
    );
    let model = model.with_split_size(5).unwrap();
    let empty = Tensor::zeros((0, IN), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        model.forward(&empty),
        Err(Error::EmptyBatch { dim: 0, .. })
    ));
    // Input of the wrong width: stage 0 fails on the first micro-batch, and says so.
    let wide = Tensor::zeros((10, IN + 1), DType::F32, &Device::Cpu).unwrap();
    let err = model.forward(&wide).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Stage {
                stage: 0,
                micro_batch: Some(0),
                ..
            }
        ),
        "{err}"
    );
    // A stage that panics on the second micro-batch: an error naming it, not a panic.
    let log = Arc::new(Log::default());
    let panicking = ModelParallel::new(vec![
        logging_stage(0, &log, |_| {}),
        logging_stage(1, &log, |j| {
            assert!(j != 1, "stage 1 refuses micro-batch 1")
        }),
        logging_stage(2, &log, |_| {}),
    ])
    .unwrap()
    .with_split_size(1)
    .unwrap();
    let err = panicking
        .forward(&Tensor::zeros((4, 1), DType::F32, &Device::Cpu).unwrap())
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            Error::Stage {
                stage: 1,
                micro_batch: Some(1),
                ..
            }
        ) && text.contains("panicked")
            && text.contains("refuses micro-batch 1"),
        "{text}"
    );
    // Unpipelined, a failing stage is named too.
    let plain = model_parallel(&VarMap::new(), 3);
    let err = plain.forward(&wide).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Stage {
                stage: 0,
                micro_batch: None,
                ..
            }
        ),
        "{err}"
    );
}

/// The pipelined model's forward can be used as a candle `Module` and gives the plain one's
/// outputs.
#[test]
fn the_pipelined_forward_is_a_module_with_the_plain_forwards_outputs() {
    let varmap = VarMap::new();
    let plain = model_parallel(&varmap, 3);
    let (x, _) = batch(3, ROWS);
    let want = plain.forward(&x).unwrap();
    let piped = model_parallel(&varmap, 3).with_split_size(4).unwrap();
    let got = Module::forward(&piped, &x).unwrap();
    assert_eq!(got.dims(), [ROWS, CLASSES]);
    assert!(common::max_abs_diff(&got, &want) <= 1e-6);
}
