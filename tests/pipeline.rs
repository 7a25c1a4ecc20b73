//! Pipeline parallel over real processes (and threads where that is enough): 20 SGD steps of a
//! four-layer perceptron cut into 2 or 4 stages equal 20 steps of the whole model in one
//! process, under GPipe, 1F1B and interleaved 1F1B, alone and on a [dp 2, pp 2] layout (the
//! replicas' gradients averaged, or reduce-scattered under ZeRO-2); a rank killed in the middle
//! of a schedule is named by every other rank; the examples print one process's losses.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, loss, Linear, Optimizer, VarMap};
use candle_parallel::distributed::{self, DeviceMesh, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::Sgd;
use candle_parallel::pipeline::{
    all_reduce_gradients, FullyShardedStage, PipelineSchedule, PipelineStage, Schedule, Zero2,
};
use candle_parallel::Error;
use common::models::{batch, share, values, Values, CLASSES, IN, SGD};
use common::{done, is_child, join_child, Ranks, DONE};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);
const STEPS: usize = 20;
const LAYERS: usize = 4;
const SEED: u64 = 3;

/// Layers `range` of the perceptron 8 -> 16 -> 16 -> 16 -> 4 (ReLU between), named as in the
/// whole model (`layers.2.weight`).
struct Part {
    layers: Vec<(Linear, bool)>,
}

fn part(varmap: &VarMap, range: std::ops::Range<usize>) -> Part {
    let vb = seeded_var_builder(varmap, SEED, DType::F32, &Device::Cpu);
    let width = |i: usize| match i {
        0 => IN,
        LAYERS => CLASSES,
        _ => 16,
    };
    let layers = range
        .map(|i| {
            let l = linear(width(i), width(i + 1), vb.pp(format!("layers.{i}"))).unwrap();
            (l, i + 1 < LAYERS)
        })
        .collect();
    Part { layers }
}

impl Module for Part {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = x.clone();
        for (l, relu) in &self.layers {
            x = x.apply(l)?;
            if *relu {
                x = x.relu()?;
            }
        }
        Ok(x)
    }
}

fn cross_entropy(out: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    loss::cross_entropy(out, y)
}

/// The whole model trained in one process on the whole batches of `rows` rows.
fn one_process(rows: usize) -> (Values, Vec<f32>) {
    let varmap = VarMap::new();
    let model = part(&varmap, 0..LAYERS);
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, rows);
        let loss = cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    (values(&varmap), losses)
}

/// This rank's stages of a pipeline of `n_stages` stages over `pp` (each of `LAYERS / n_stages`
/// layers), with the VarMaps holding them.
fn stages(
    pp: &ProcessGroup,
    schedule: Schedule,
    n_stages: usize,
) -> Vec<(VarMap, PipelineStage<Part>)> {
    let per = LAYERS / n_stages;
    schedule
        .stages_of(pp.world_size(), pp.rank())
        .into_iter()
        .map(|s| {
            let varmap = VarMap::new();
            let module = part(&varmap, s * per..(s + 1) * per);
            let stage = PipelineStage::new(module, &varmap, s, n_stages, pp).unwrap();
            (varmap, stage)
        })
        .collect()
}

/// How the replicas of a stage (along "dp") combine their gradients.
#[derive(Clone, Copy)]
enum Dp<'a> {
    /// One pipeline, no replicas.
    None,
    /// Averaged after each step (DDP's result).
    AllReduce(&'a ProcessGroup),
    /// Reduce-scattered, each replica stepping its pieces (ZeRO-2).
    Zero2(&'a ProcessGroup),
}

/// Trains this rank's stages for [`STEPS`] steps of `rows` rows each (this replica's share
/// along `dp`) and checks that they end as the whole model trained in one process, within
/// 1e-5, and the losses too.
fn train_and_compare(pp: &ProcessGroup, dp: Dp, schedule: Schedule, n_stages: usize, rows: usize) {
    let mine = stages(pp, schedule, n_stages);
    let refs: Vec<&PipelineStage<Part>> = mine.iter().map(|(_, s)| s).collect();
    let params: Vec<_> = refs.iter().flat_map(|s| s.parameters()).collect();
    let zero = match dp {
        Dp::Zero2(g) => Some(Zero2::new(&params, g).unwrap()),
        _ => None,
    };
    let stepped = zero
        .as_ref()
        .map_or(params.clone(), |z| z.pieces().to_vec());
    let mut opt = Sgd::new(stepped.clone(), SGD).unwrap();
    let pipeline = PipelineSchedule::new(schedule, 4, cross_entropy).unwrap();
    let group = match dp {
        Dp::None => None,
        Dp::AllReduce(g) | Dp::Zero2(g) => Some(g),
    };
    let replicas = group.map_or(1, |g| g.world_size());
    let replica = group.map_or(0, |g| g.rank());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = share(step, replicas, rows / replicas, replica);
        let mut out = pipeline.step(&refs, Some(&x), Some(&y)).unwrap();
        match (dp, &zero) {
            (Dp::AllReduce(g), _) => {
                all_reduce_gradients(&mut out.grads, &params, g).unwrap();
                opt.step(&out.grads).unwrap();
            }
            (Dp::Zero2(_), Some(z)) => {
                opt.step(&z.reduce_scatter(&out.grads).unwrap()).unwrap();
                z.gather().unwrap();
            }
            _ => opt.step(&out.grads).unwrap(),
        }
        losses.extend(out.loss());
    }
    if let Some(g) = group {
        // The optimizer stepped 1/dp of each parameter under ZeRO-2, all of it otherwise.
        let stepped: usize = stepped.iter().map(|v| v.elem_count()).sum();
        let whole: usize = params.iter().map(|v| v.elem_count()).sum();
        let most = match dp {
            Dp::Zero2(_) => whole.div_ceil(g.world_size()) + params.len(),
            _ => whole,
        };
        assert!(
            stepped <= most,
            "{stepped} of {whole} elements stepped here"
        );
    }
    let (want, want_losses) = one_process(rows);
    for (varmap, stage) in &mine {
        let got = values(varmap);
        for (name, v) in &got {
            let (_, w) = want
                .iter()
                .find(|(n, _)| n == name)
                .expect("a variable of the model");
            let diff = v
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "stage {} {name}: {diff}", stage.stage_index());
        }
    }
    if refs.iter().any(|s| s.is_last()) && group.is_none() {
        for (step, (a, b)) in losses.iter().zip(&want_losses).enumerate() {
            assert!((a - b).abs() < 1e-5, "step {step}: loss {a} against {b}");
        }
        assert_eq!(losses.len(), STEPS);
    }
}

/// The child side of a pipeline test over processes: the world is the pipeline.
fn pipeline_child(schedule: Schedule) {
    let pg = join_child();
    let n_stages = pg.world_size() * schedule.stages_per_rank();
    train_and_compare(&pg, Dp::None, schedule, n_stages, 16);
    done();
}

#[test]
fn gpipe_over_2_processes_trains_as_one_process() {
    if is_child() {
        return pipeline_child(Schedule::GPipe);
    }
    Ranks::world("gpipe_over_2_processes_trains_as_one_process", 2).assert_all_pass(LIMIT);
}

#[test]
fn one_f_one_b_over_2_processes_trains_as_one_process() {
    if is_child() {
        return pipeline_child(Schedule::OneFOneB);
    }
    Ranks::world("one_f_one_b_over_2_processes_trains_as_one_process", 2).assert_all_pass(LIMIT);
}

#[test]
fn gpipe_over_4_processes_trains_as_one_process() {
    if is_child() {
        return pipeline_child(Schedule::GPipe);
    }
    Ranks::world("gpipe_over_4_processes_trains_as_one_process", 4).assert_all_pass(LIMIT);
}

#[test]
fn one_f_one_b_over_4_processes_trains_as_one_process() {
    if is_child() {
        return pipeline_child(Schedule::OneFOneB);
    }
    Ranks::world("one_f_one_b_over_4_processes_trains_as_one_process", 4).assert_all_pass(LIMIT);
}

#[test]
fn interleaved_1f1b_two_stages_on_each_of_2_threads_trains_as_one_process() {
    let schedule = Schedule::Interleaved1F1B { stages_per_rank: 2 };
    distributed::spawn_threads(2, |pg| {
        train_and_compare(&pg, Dp::None, schedule, 4, 16);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_pipeline_of_one_rank_holding_every_stage_trains_as_one_process() {
    let schedule = Schedule::Interleaved1F1B { stages_per_rank: 4 };
    distributed::spawn_threads(1, |pg| {
        train_and_compare(&pg, Dp::None, schedule, 4, 16);
        Ok(())
    })
    .unwrap();
}

/// The "pp" and "dp" groups of a [dp 2, pp 2] mesh (torch's layout: ranks =
/// arange(4).reshape(2, 2), pipelines [0, 1] and [2, 3], replicas [0, 2] and [1, 3]).
fn mesh_groups(world: &ProcessGroup) -> (ProcessGroup, ProcessGroup) {
    let mesh = DeviceMesh::new(world, &[("dp", 2), ("pp", 2)]).unwrap();
    let (pp, dp) = (mesh.get_group("pp").unwrap(), mesh.get_group("dp").unwrap());
    (pp.clone(), dp.clone())
}

#[test]
fn dp_2_by_pp_2_over_4_processes_trains_as_one_process() {
    if is_child() {
        let world = join_child();
        let (pp, dp) = mesh_groups(&world);
        assert_eq!((dp.rank(), pp.rank()), (world.rank() / 2, world.rank() % 2));
        train_and_compare(&pp, Dp::AllReduce(&dp), Schedule::OneFOneB, 2, 32);
        return done();
    }
    Ranks::world("dp_2_by_pp_2_over_4_processes_trains_as_one_process", 4).assert_all_pass(LIMIT);
}

#[test]
fn dp_2_by_pp_2_with_zero2_along_dp_over_4_processes_trains_as_one_process() {
    if is_child() {
        let world = join_child();
        let (pp, dp) = mesh_groups(&world);
        train_and_compare(&pp, Dp::Zero2(&dp), Schedule::GPipe, 2, 32);
        return done();
    }
    Ranks::world(
        "dp_2_by_pp_2_with_zero2_along_dp_over_4_processes_trains_as_one_process",
        4,
    )
    .assert_all_pass(LIMIT);
}

/// [`train_and_compare`] with each stage fully sharded along `dp`: between steps a replica
/// holds 1/dp of its stages' parameters; each step gathers the stages, runs the schedule,
/// reduce-scatters the gradients to the pieces, steps them, and drops the gathered stages. The
/// pipeline is evaluated between steps too. The stages end as the whole model trained in one
/// process, within 1e-5.
fn train_fully_sharded(pp: &ProcessGroup, dp: &ProcessGroup, schedule: Schedule, rows: usize) {
    let n_stages = pp.world_size() * schedule.stages_per_rank();
    let per = LAYERS / n_stages;
    let sharded: Vec<_> = schedule
        .stages_of(pp.world_size(), pp.rank())
        .into_iter()
        .map(|s| {
            let build = move |vb: candle_nn::VarBuilder| -> candle_core::Result<Part> {
                let width = |i: usize| match i {
                    0 => IN,
                    LAYERS => CLASSES,
                    _ => 16,
                };
                let layers = (s * per..(s + 1) * per)
                    .map(|i| {
                        let l = linear(width(i), width(i + 1), vb.pp(format!("layers.{i}")))?;
                        Ok((l, i + 1 < LAYERS))
                    })
                    .collect::<candle_core::Result<_>>()?;
                Ok(Part { layers })
            };
            // Initialised as the one-process model is; the VarMap goes at the end of the scope.
            let varmap = VarMap::new();
            part(&varmap, s * per..(s + 1) * per);
            FullyShardedStage::new(&varmap, build, s, n_stages, pp, dp).unwrap()
        })
        .collect();
    let pieces: Vec<candle_core::Var> = sharded.iter().flat_map(|s| s.pieces().to_vec()).collect();
    let held: usize = pieces.iter().map(|v| v.elem_count()).sum();
    let whole: usize = (0..n_stages)
        .filter(|s| s % pp.world_size() == pp.rank())
        .map(|s| {
            (s * per..(s + 1) * per)
                .map(|i| {
                    let w = |i: usize| match i {
                        0 => IN,
                        LAYERS => CLASSES,
                        _ => 16,
                    };
                    w(i) * w(i + 1) + w(i + 1)
                })
                .sum::<usize>()
        })
        .sum();
    assert!(
        held <= whole.div_ceil(dp.world_size()) + 2 * per * schedule.stages_per_rank(),
        "a replica holds {held} of its stages' {whole} elements between steps"
    );
    let mut opt = Sgd::new(pieces, SGD).unwrap();
    let pipeline = PipelineSchedule::new(schedule, 4, cross_entropy).unwrap();
    for step in 0..STEPS {
        let (x, y) = share(step, dp.world_size(), rows / dp.world_size(), dp.rank());
        let stages: Vec<PipelineStage<Part>> =
            sharded.iter().map(|s| s.gather().unwrap()).collect();
        let refs: Vec<&PipelineStage<Part>> = stages.iter().collect();
        let out = pipeline.step(&refs, Some(&x), Some(&y)).unwrap();
        let mut grads = candle_core::backprop::GradStore::default();
        for (s, stage) in sharded.iter().zip(&stages) {
            let g = s.reduce_scatter(stage, &out.grads).unwrap();
            for piece in s.pieces() {
                grads.insert(piece.as_tensor(), g.get(piece.as_tensor()).unwrap().clone());
            }
        }
        opt.step(&grads).unwrap();
        drop(stages);
        if step == STEPS / 2 {
            // An evaluation between steps: the gathered stages, forwards only.
            let stages: Vec<_> = sharded.iter().map(|s| s.gather().unwrap()).collect();
            let refs: Vec<&PipelineStage<Part>> = stages.iter().collect();
            let eval = pipeline.eval(&refs, Some(&x), Some(&y)).unwrap();
            if refs.iter().any(|s| s.is_last()) {
                assert_eq!(eval.losses.len(), 4);
                assert!(eval.losses.iter().all(|l| l.is_finite()));
            }
        }
    }
    let (want, _) = one_process(rows);
    for s in &sharded {
        let stage = s.gather().unwrap();
        for (name, var) in stage.named_parameters() {
            let got = var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let (_, w) = want
                .iter()
                .find(|(n, _)| n == name)
                .expect("a variable of the model");
            let diff = got
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "stage {} {name}: {diff}", s.stage_index());
        }
    }
}

#[test]
fn dp_2_by_pp_2_fully_sharded_along_dp_over_4_processes_trains_as_one_process() {
    if is_child() {
        let world = join_child();
        let (pp, dp) = mesh_groups(&world);
        train_fully_sharded(&pp, &dp, Schedule::OneFOneB, 32);
        return done();
    }
    Ranks::world(
        "dp_2_by_pp_2_fully_sharded_along_dp_over_4_processes_trains_as_one_process",
        4,
    )
    .assert_all_pass(LIMIT);
}

#[test]
fn interleaved_stages_fully_sharded_over_2_replicas_of_threads_train_as_one_process() {
    // [dp 2, pp 2] in threads, two stages per rank: four sharded stages per pipeline.
    distributed::spawn_threads(4, |world| {
        let (pp, dp) = mesh_groups(&world);
        train_fully_sharded(
            &pp,
            &dp,
            Schedule::Interleaved1F1B { stages_per_rank: 2 },
            32,
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn ranks_that_run_different_schedules_fail_with_a_mismatch_not_a_hang() {
    let errors = distributed::spawn_threads_with_error(2, |pg| {
        let mine = stages(&pg, Schedule::GPipe, 2);
        let stage = &mine[0].1;
        let m = [4, 2][pg.rank()];
        let pipeline = PipelineSchedule::new(Schedule::GPipe, m, cross_entropy).unwrap();
        let (x, y) = batch(0, 16);
        Ok::<_, Error>(
            pipeline
                .step(&[stage], Some(&x), Some(&y))
                .err()
                .map(|e| e.to_string()),
        )
    })
    .unwrap();
    for e in errors {
        let e = e.expect("a mismatch");
        assert!(e.contains("different schedules"), "{e}");
    }
}

/// A rank that evaluates while the others take a training step (after steps that agreed)
/// would leave gradients unread for its next step: every rank fails with a mismatch instead.
#[test]
fn a_rank_evaluating_while_the_others_train_fails_with_a_mismatch_on_every_rank() {
    let errors = distributed::spawn_threads_with_error(2, |pg| {
        let mine = stages(&pg, Schedule::OneFOneB, 2);
        let stage = &mine[0].1;
        let pipeline = PipelineSchedule::new(Schedule::OneFOneB, 4, cross_entropy).unwrap();
        let (x, y) = batch(0, 16);
        pipeline.step(&[stage], Some(&x), Some(&y)).unwrap();
        let second = match pg.rank() {
            0 => pipeline.eval(&[stage], Some(&x), Some(&y)).err(),
            _ => pipeline.step(&[stage], Some(&x), Some(&y)).err(),
        };
        Ok::<_, Error>(second.map(|e| e.to_string()))
    })
    .unwrap();
    for e in errors {
        let e = e.expect("a mismatch");
        assert!(
            e.contains("different calls") && e.contains("an evaluation"),
            "{e}"
        );
    }
}

#[test]
fn a_rank_killed_mid_schedule_is_named_by_every_other_rank() {
    if is_child() {
        let pg = join_child();
        let mine = stages(&pg, Schedule::OneFOneB, 4);
        let refs: Vec<&PipelineStage<Part>> = mine.iter().map(|(_, s)| s).collect();
        let pipeline = PipelineSchedule::new(Schedule::OneFOneB, 4, cross_entropy).unwrap();
        let (x, y) = batch(0, 16);
        let started = Instant::now();
        let mut steps = 0;
        let err = loop {
            match pipeline.step(&refs, Some(&x), Some(&y)) {
                Ok(_) if started.elapsed() < Duration::from_secs(60) => {}
                Ok(_) => panic!("rank 2 was never killed"),
                Err(e) => break e,
            }
            steps += 1;
            if steps == 2 {
                println!("stepping");
            }
        };
        assert!(
            matches!(err, Error::PeerLost { rank: 2, .. }),
            "rank {}: {err}",
            pg.rank()
        );
        println!("rank {} failed: {err}", pg.rank());
        done();
        // Stay a moment, so that the others learn of rank 2 and not of this rank's exit.
        std::thread::sleep(Duration::from_secs(2));
        return;
    }
    let mut ranks = Ranks::world("a_rank_killed_mid_schedule_is_named_by_every_other_rank", 4);
    for r in 0..4 {
        ranks.wait_for(r, "stepping", LIMIT);
    }
    let killed = Instant::now();
    ranks.kill(2);
    for r in [0, 1, 3] {
        ranks.wait_for(r, DONE, Duration::from_secs(30));
    }
    let noticed = killed.elapsed();
    let ended = ranks.wait(LIMIT);
    for r in [0, 1, 3] {
        assert!(ended[r].status.success(), "rank {r}:\n{}", ended[r].output);
    }
    assert!(
        noticed < Duration::from_secs(30),
        "the others took {noticed:?}"
    );
}

/// The `train loss` values of an example's output.
fn train_losses(out: &str) -> Vec<f64> {
    out.lines()
        .filter_map(|l| l.split("train loss ").nth(1))
        .map(|l| l.split(',').next().unwrap().parse().unwrap())
        .collect()
}

/// `transformer_pp` over 2 processes under `schedule` prints the losses `transformer_ddp`
/// prints in one process, ends with the memory line, and draws its chart.
fn transformer_pp_matches_one_process(schedule: &str) {
    let small = [
        "--train-size",
        "256",
        "--test-size",
        "50",
        "--epochs",
        "2",
        "--layers",
        "2",
        "--dim",
        "32",
    ];
    let mut one = std::process::Command::new(common::example("transformer_ddp"));
    one.args(small);
    let one = common::run_ok(one, LIMIT);
    let chart = common::temp_dir(&format!("pp-chart-{schedule}")).join("pp.svg");
    let mut pp = std::process::Command::new(common::example("transformer_pp"));
    pp.args(small)
        .args([
            "--pipeline",
            "2",
            "--schedule",
            schedule,
            "--compare",
            "--plot",
        ])
        .arg(&chart);
    let out = common::run_ok(pp, LIMIT);
    let (want, got) = (train_losses(&one), train_losses(&out));
    assert_eq!(want.len(), 2, "{one}");
    assert_eq!(got.len(), 2, "{out}");
    for (a, b) in got.iter().zip(&want) {
        assert!(
            (a - b).abs() < 1e-5,
            "pipeline {a} against one process {b}\n{out}"
        );
    }
    let last = out.lines().last().unwrap_or_default();
    assert!(last.starts_with("memory per rank: parameters"), "{out}");
    assert!(out.contains("bubble: measured"), "{out}");
    assert!(out.contains("in 2 processes against"), "{out}");
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("backward"),
        "{chart:?}"
    );
}

#[test]
fn transformer_pp_1f1b_over_2_processes_prints_the_losses_of_one_process() {
    transformer_pp_matches_one_process("1f1b");
}

#[test]
fn transformer_pp_gpipe_over_2_processes_prints_the_losses_of_one_process() {
    transformer_pp_matches_one_process("gpipe");
}

#[test]
fn the_model_parallel_tutorial_as_a_pipeline_matches_one_process() {
    let out = common::run_ok(
        std::process::Command::new(common::example("pp_tutorial")),
        LIMIT,
    );
    assert_eq!(out.matches("loss").count(), 10, "{out}");
    assert_eq!(out.matches("against one process").count(), 2, "{out}");
}

/// `transformer_pp` with `extra` (20 steps of a global batch of 32), its one loss line.
fn transformer_pp_loss(extra: &[&str]) -> (f64, String) {
    let small = [
        "--train-size",
        "640",
        "--test-size",
        "50",
        "--epochs",
        "1",
        "--layers",
        "2",
        "--dim",
        "32",
        "--heads",
        "2",
        "--digits",
        "4",
    ];
    let mut cmd = std::process::Command::new(common::example("transformer_pp"));
    cmd.args(small).args(extra);
    let out = common::run_ok(cmd, LIMIT);
    let losses = train_losses(&out);
    assert_eq!(losses.len(), 1, "one loss line, from one rank:\n{out}");
    (losses[0], out)
}

#[test]
fn a_dp_by_pp_by_tp_mesh_of_8_processes_takes_the_steps_of_one_process() {
    let (one, _) = transformer_pp_loss(&["--batch-size", "32"]);
    for (extra, mesh) in [
        (
            &[
                "--pipeline",
                "2",
                "--data-parallel",
                "2",
                "--tensor-parallel",
                "2",
            ][..],
            "mesh [dp 2, pp 2, tp 2]",
        ),
        (
            &["--pipeline", "2", "--tensor-parallel", "2"][..],
            "mesh [dp 1, pp 2, tp 2]",
        ),
    ] {
        let batch = if extra.contains(&"--data-parallel") {
            "16"
        } else {
            "32"
        };
        let (loss, out) = transformer_pp_loss(&[extra, &["--batch-size", batch]].concat());
        assert!(out.contains(mesh), "{out}");
        assert!(
            (loss - one).abs() <= 1e-5,
            "{mesh}: loss {loss} against one process's {one}\n{out}"
        );
    }
}
