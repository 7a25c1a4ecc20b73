//! The distributed checkpoint: saved under one layout at one world size, loaded under every
//! other (fully sharded at 4 into ZeRO-2 at 3, DDP at 2, fully sharded at 3 and 1, one
//! process; fully sharded at 4 into [dp 2, tp 2] parts; tensor parallel at 2 into tensor
//! parallel at 4 and one process; pipeline stages into one process), the loaded state equal bit for bit to what was saved and training going on as
//! if never stopped; a process killed while saving leaves the previous checkpoint; torn, foreign
//! and corrupt files are errors naming the file and tensor; an asynchronous save holds the state
//! of its step while training goes on. Over thread ranks (the host backend, real sockets) and
//! real processes.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{loss, Module, Optimizer, VarMap};
use candle_parallel::checkpoint::distributed::{
    self as dcp, Checkpointer, Index, Region, ShardedTensor, StateDict,
};
use candle_parallel::checkpoint::{self, LoadOptions};
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamW, ElementwiseOptimizer};
use candle_parallel::tensor_parallel::ParallelPlan;
use common::layouts::{
    assert_same_files, names_of, one_process, tp_plan, varmap_of, Layout, Model, ADAMW, ROWS,
};
use common::models::{batch, max_diff, mlp_uneven, values};
use common::{done, is_child, join_child, Ranks};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

/// Removes a test's folder, or with `CP_KEEP_DCP=FOLDER` moves it to `FOLDER/name`, for
/// `scripts/torch_dcp_twin.py`.
fn keep_or_remove(dir: &Path, name: &str) {
    match std::env::var_os("CP_KEEP_DCP") {
        Some(keep) => {
            std::fs::create_dir_all(&keep).unwrap();
            std::fs::rename(dir, Path::new(&keep).join(name)).unwrap()
        }
        None => std::fs::remove_dir_all(dir).unwrap(),
    }
}

/// Saves fully sharded at world 4 after 5 steps (the distributed checkpoint, and the
/// consolidated file to compare with).
fn save_fully_sharded(pg: &ProcessGroup, dir: &Path) {
    let (model, mut opt) = Model::new::<AdamW>(pg, Layout::Fsdp, 7, DType::F32, ADAMW);
    model.train(pg, &mut opt, 0..5);
    let mut c = Checkpointer::for_group(dir.join("dcp"), pg, &Device::Cpu);
    c.save(&model.state_dict(&opt)).unwrap();
    model.save_whole(&opt, &dir.join("saved.safetensors"));
}

/// Loads the distributed checkpoint under `layout` (fresh weights of another seed first): the
/// state equals the saved one bit for bit, and 5 more steps end where one process's 10 do.
fn load_and_go_on(pg: &ProcessGroup, layout: Layout, dir: &Path) {
    let (model, mut opt) = Model::new::<AdamW>(pg, layout, 99, DType::F32, ADAMW);
    let c = Checkpointer::for_group(dir.join("dcp"), pg, &Device::Cpu);
    model.load(&mut opt, &c, LoadOptions::default()).unwrap();
    let name = format!("{layout:?}-{}.safetensors", pg.world_size());
    model.save_whole(&opt, &dir.join(&name));
    model.train(pg, &mut opt, 5..10);
    let d = max_diff(&model.values(), &one_process::<AdamW>(ADAMW, 10));
    assert!(
        d <= 1e-5,
        "rank {} ({layout:?} at {}): differs from one process by {d}",
        pg.rank(),
        pg.world_size()
    );
}

#[test]
fn fully_sharded_at_4_loads_into_zero2_at_3_ddp_at_2_fully_sharded_at_3_and_1_and_one_process() {
    let dir = common::temp_dir("dcp-layouts");
    distributed::spawn_threads(4, |pg| {
        save_fully_sharded(&pg, &dir);
        Ok(())
    })
    .unwrap();
    // Four ranks, four files; every piece once.
    let index = Index::read(dir.join("dcp")).unwrap();
    assert_eq!((index.world_size(), index.files().count()), (4, 4));
    assert_eq!(index.shape("l2.weight"), Some(&[13usize, 13][..]));
    assert!(index.contains("optimizer.state.l1.weight.exp_avg_sq"));
    for (layout, world) in [
        (Layout::Zero2, 3),
        (Layout::Ddp, 2),
        (Layout::Fsdp, 3),
        (Layout::Fsdp, 1),
    ] {
        distributed::spawn_threads(world, |pg| {
            load_and_go_on(&pg, layout, &dir);
            Ok(())
        })
        .unwrap();
        let name = format!("{layout:?}-{world}.safetensors");
        assert_same_files(&dir.join(name), &dir.join("saved.safetensors"));
    }
    // A plain candle program, one process.
    let varmap = VarMap::new();
    let m = mlp_uneven(seeded_var_builder(&varmap, 99, DType::F32, &Device::Cpu)).unwrap();
    let mut o = AdamW::new(varmap.all_vars(), ADAMW).unwrap();
    let c = Checkpointer::new(dir.join("dcp"));
    dcp::load_training_state(&c, &varmap, &mut o, LoadOptions::default()).unwrap();
    checkpoint::save_training_state(&varmap, &o, dir.join("plain.safetensors")).unwrap();
    assert_same_files(
        &dir.join("plain.safetensors"),
        &dir.join("saved.safetensors"),
    );
    for step in 5..10 {
        let (x, y) = batch(step, ROWS);
        o.backward_step(&loss::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap())
            .unwrap();
    }
    let d = max_diff(&values(&varmap), &one_process::<AdamW>(ADAMW, 10));
    assert!(d <= 1e-5, "one process from the checkpoint differs by {d}");
    // And what one process saves, four fully sharded ranks load.
    let mut c = Checkpointer::new(dir.join("one"));
    c.save(&dcp::training_state(&varmap, &o).unwrap()).unwrap();
    assert_eq!(Index::read(dir.join("one")).unwrap().files().count(), 1);
    distributed::spawn_threads(4, |pg| {
        let (model, mut opt) = Model::new::<AdamW>(&pg, Layout::Fsdp, 5, DType::F32, ADAMW);
        let c = Checkpointer::for_group(dir.join("one"), &pg, &Device::Cpu);
        model.load(&mut opt, &c, LoadOptions::default()).unwrap();
        assert_eq!(max_diff(&model.values(), &values(&varmap)), 0.0);
        Ok(())
    })
    .unwrap();
    keep_or_remove(&dir, "fully-sharded");
}

#[test]
fn processes_save_fully_sharded_at_4_and_load_zero2_at_3() {
    let test = "processes_save_fully_sharded_at_4_and_load_zero2_at_3";
    if is_child() {
        let pg = join_child();
        let dir = PathBuf::from(std::env::var("CP_DIR").unwrap());
        match std::env::var("CP_PHASE").unwrap().as_str() {
            "save" => save_fully_sharded(&pg, &dir),
            _ => load_and_go_on(&pg, Layout::Zero2, &dir),
        }
        done();
        return;
    }
    let dir = common::temp_dir("dcp-processes");
    for (phase, world) in [("save", 4), ("load", 3)] {
        let port = common::free_port();
        let envs = (0..world)
            .map(|r| {
                let mut env = common::rank_env(r, world, port);
                env.push(("CP_DIR".into(), dir.display().to_string()));
                env.push(("CP_PHASE".into(), phase.into()));
                env
            })
            .collect();
        Ranks::start(test, envs).assert_all_pass(LIMIT);
    }
    assert_same_files(
        &dir.join("Zero2-3.safetensors"),
        &dir.join("saved.safetensors"),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The one-process values of the tensor-parallel tests' variables.
fn tp_whole() -> Vec<(&'static str, Tensor)> {
    let t = |n: usize, shape: &[usize]| {
        Tensor::arange(0f32, n as f32, &Device::Cpu)
            .unwrap()
            .affine(0.01, -0.1)
            .unwrap()
            .reshape(shape)
            .unwrap()
    };
    vec![
        ("fc1.weight", t(32, &[8, 4])),
        ("fc1.bias", t(8, &[8])),
        ("fc2.weight", t(32, &[4, 8])),
        ("fc2.bias", t(4, &[4])),
        ("qkv.weight", t(48, &[12, 4])),
    ]
}

/// Two AdamW steps on a loss whose gradients are elementwise (`sum(v²·(1 + v))`): a rank's
/// gradients are exactly its parts of the one-process ones, so its steps are too.
fn tp_steps(varmap: &VarMap, opt: &mut AdamW) {
    for _ in 0..2 {
        let mut l = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for v in varmap.all_vars() {
            let v = v.as_tensor();
            l = (l
                + (v.sqr().unwrap() * (v + 1.0).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap())
            .unwrap();
        }
        opt.backward_step(&l).unwrap();
    }
}

#[test]
fn tensor_parallel_at_2_loads_at_4_and_into_one_process_and_pipeline_stages_too() {
    let dir = common::temp_dir("dcp-tp");
    let plan = tp_plan();
    // One process: the reference.
    let whole = tp_whole();
    let one = varmap_of(
        whole
            .iter()
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect::<Vec<_>>(),
    );
    let mut one_opt = AdamW::new(one.all_vars(), ADAMW).unwrap();
    tp_steps(&one, &mut one_opt);
    checkpoint::save_training_state(&one, &one_opt, dir.join("one.safetensors")).unwrap();
    // Tensor parallel over 2 ranks, each with a data-parallel twin holding the same parts
    // (a [dp 2, tp 2] mesh flattened: ranks 0, 1 and 2, 3 hold the same pieces).
    distributed::spawn_threads(4, |pg| {
        let first = pg.new_group(&[0, 1])?;
        let second = pg.new_group(&[2, 3])?;
        let tp = first.or(second).unwrap();
        let parts = plan.shard_all(whole.iter().map(|(n, t)| (*n, t)), &tp)?;
        let varmap = varmap_of(parts.into_iter().collect::<Vec<_>>());
        let mut opt = AdamW::new(varmap.all_vars(), ADAMW)?;
        tp_steps(&varmap, &mut opt);
        let mut c = Checkpointer::for_group(dir.join("tp2"), &pg, &Device::Cpu);
        c.save(&plan.state_dict(&varmap, &opt, &tp)?)?;
        Ok(())
    })
    .unwrap();
    // Replicated pieces once: the biases of fc2 whole in one file, and no piece twice.
    let index = Index::read(dir.join("tp2")).unwrap();
    assert_eq!(index.shape("qkv.weight"), Some(&[12usize, 4][..]));
    // Into one process: the same state as the one-process steps.
    let back = varmap_of(
        whole
            .iter()
            .map(|(n, t)| (n.to_string(), t.zeros_like().unwrap()))
            .collect::<Vec<_>>(),
    );
    let mut back_opt = AdamW::new(back.all_vars(), ADAMW).unwrap();
    let c = Checkpointer::new(dir.join("tp2"));
    dcp::load_training_state(&c, &back, &mut back_opt, LoadOptions::default()).unwrap();
    checkpoint::save_training_state(&back, &back_opt, dir.join("back.safetensors")).unwrap();
    assert_same_files(&dir.join("back.safetensors"), &dir.join("one.safetensors"));
    // Into tensor parallel over 4: each rank's parts are the plan's cut of the one-process
    // values, and so is its optimizer state.
    let stepped: HashMap<String, Tensor> = one
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let one_state = one_opt.state();
    let one_names = names_of(&one, &one_opt);
    distributed::spawn_threads(4, |tp| {
        let zeros = whole.iter().map(|(n, t)| (*n, t));
        let parts = plan.shard_all(zeros, &tp)?;
        let varmap = varmap_of(
            parts
                .into_iter()
                .map(|(n, t)| (n, t.zeros_like().unwrap()))
                .collect::<Vec<_>>(),
        );
        let mut opt = AdamW::new(varmap.all_vars(), ADAMW)?;
        let c = Checkpointer::for_group(dir.join("tp2"), &tp, &Device::Cpu);
        plan.load_state_dict(&c, &varmap, &mut opt, &tp, LoadOptions::default())?;
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let want = plan.shard(name, &stepped[name], &tp)?;
            assert_eq!(
                common::as_f64(var.as_tensor()),
                common::as_f64(&want),
                "{name}"
            );
        }
        let state = opt.state();
        assert_eq!(state.scalars, one_state.scalars);
        let names = names_of(&varmap, &opt);
        for (name, states) in names.iter().zip(&state.per_var) {
            let j = one_names.iter().position(|n| n == name).unwrap();
            for (s, t) in states {
                let want = plan.shard(name, &one_state.per_var[j][s], &tp)?;
                assert_eq!(common::as_f64(t), common::as_f64(&want), "{name}.{s}");
            }
        }
        Ok(())
    })
    .unwrap();
    // Pipeline stages: two ranks, each with its own layers whole; one process loads both.
    distributed::spawn_threads(2, |pg| {
        let mine: Vec<(String, Tensor)> = stepped
            .iter()
            .filter(|(n, _)| n.starts_with(if pg.rank() == 0 { "fc" } else { "qkv" }))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        let stage = varmap_of(mine);
        let opt = AdamW::new(stage.all_vars(), ADAMW)?;
        let mut c = Checkpointer::for_group(dir.join("stages"), &pg, &Device::Cpu);
        c.save(&dcp::training_state(&stage, &opt)?)?;
        Ok(())
    })
    .unwrap();
    let index = Index::read(dir.join("stages")).unwrap();
    assert_eq!(index.files().count(), 2);
    let all = varmap_of(
        whole
            .iter()
            .map(|(n, t)| (n.to_string(), t.zeros_like().unwrap()))
            .collect::<Vec<_>>(),
    );
    let mut opt = AdamW::new(Vec::new(), ADAMW).unwrap();
    dcp::load_training_state(
        &Checkpointer::new(dir.join("stages")),
        &all,
        &mut opt,
        LoadOptions::default(),
    )
    .unwrap();
    for (name, var) in all.data().lock().unwrap().iter() {
        assert_eq!(
            common::as_f64(var.as_tensor()),
            common::as_f64(&stepped[name]),
            "{name}"
        );
    }
    keep_or_remove(&dir, "tensor-parallel");
}

/// A state of about 8 MB whose every element is `step`.
fn numbered_state(step: usize) -> StateDict {
    let mut s = StateDict::new();
    for i in 0..4 {
        let t = Tensor::full(step as f32, (512, 1024), &Device::Cpu).unwrap();
        s.insert(format!("w{i}"), ShardedTensor::whole(t));
    }
    s
}

/// The step of a loaded numbered state, checking that all of it is of one step.
fn loaded_step(dir: &Path) -> candle_parallel::Result<f32> {
    let c = Checkpointer::new(dir);
    let loaded = c.load(&numbered_state(0).wanted(), LoadOptions::default())?;
    let mut steps = Vec::new();
    for (name, t) in loaded.iter() {
        let v = t.piece().unwrap().flatten_all()?.to_vec1::<f32>()?;
        assert!(v.iter().all(|x| *x == v[0]), "`{name}` mixes steps");
        steps.push(v[0]);
    }
    assert!(
        steps.iter().all(|s| *s == steps[0]),
        "tensors of several saves: {steps:?}"
    );
    Ok(steps[0])
}

#[test]
fn a_process_killed_while_saving_leaves_the_previous_checkpoint_loadable() {
    let test = "a_process_killed_while_saving_leaves_the_previous_checkpoint_loadable";
    if is_child() {
        let dir = PathBuf::from(std::env::var("CP_DIR").unwrap());
        let mut c = Checkpointer::new(&dir);
        for step in 1.. {
            c.save(&numbered_state(step)).unwrap();
            println!("saved {step}");
        }
        return;
    }
    let dir = common::temp_dir("dcp-killed");
    let mut cut_short = 0;
    for round in 0..4u64 {
        let mut ranks = Ranks::start(
            test,
            vec![vec![("CP_DIR".into(), dir.display().to_string())]],
        );
        ranks.wait_for(0, "saved 2", LIMIT);
        // Somewhere inside a later save (each takes some milliseconds).
        std::thread::sleep(Duration::from_millis(7 + 13 * round));
        ranks.kill(0);
        drop(ranks);
        // A save cut short leaves a temporary file, or a file no index names.
        let index = Index::read(&dir).unwrap();
        let named: Vec<&str> = index.files().collect();
        cut_short += std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f != "index.json" && !named.contains(&f.as_str()))
            .count();
        let step = loaded_step(&dir).unwrap();
        assert!(step >= 2.0, "round {round}: loaded step {step}");
    }
    assert!(
        cut_short > 0,
        "no kill landed inside a save: the test did not test"
    );
    let index = Index::read(&dir).unwrap();
    let files: Vec<String> = index.files().map(String::from).collect();
    Checkpointer::new(&dir).save(&numbered_state(100)).unwrap();
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left.len(), 2, "the index and one file: {left:?}");
    assert!(files.iter().all(|f| !left.contains(f)), "{left:?}");
    assert_eq!(loaded_step(&dir).unwrap(), 100.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn torn_foreign_and_corrupt_files_are_errors_naming_the_file_and_tensor() {
    let dir = common::temp_dir("dcp-torn");
    let save = |to: &Path, step| {
        distributed::spawn_threads(2, |pg| {
            // Each rank holds half of every tensor's rows.
            let mut s = StateDict::new();
            for (name, t) in numbered_state(step) {
                let t = t.piece().unwrap().clone();
                let region = Region::Box {
                    offsets: vec![256 * pg.rank(), 0],
                    sizes: vec![256, 1024],
                };
                let piece = t.narrow(0, 256 * pg.rank(), 256)?;
                s.insert(
                    name,
                    ShardedTensor::new(&[512, 1024], DType::F32, vec![(region, piece)])?,
                );
            }
            Checkpointer::for_group(to, &pg, &Device::Cpu).save(&s)?;
            Ok(())
        })
        .unwrap();
    };
    save(&dir, 3);
    assert_eq!(loaded_step(&dir).unwrap(), 3.0);
    let index = Index::read(&dir).unwrap();
    let file = dir.join(index.files().nth(1).unwrap());
    let bytes = std::fs::read(&file).unwrap();
    let err = |what: &str| loaded_step(&dir).unwrap_err().to_string() + what;
    // Torn: cut short.
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let e = err("");
    assert!(
        e.contains(&*file.to_string_lossy()) && e.contains("torn"),
        "{e}"
    );
    // A flipped bit in a piece.
    let mut flipped = bytes.clone();
    let at = flipped.len() - 100;
    flipped[at] ^= 4;
    std::fs::write(&file, &flipped).unwrap();
    let e = err("");
    assert!(
        e.contains(&*file.to_string_lossy())
            && e.contains("does not match the checksum")
            && e.contains("`w"),
        "{e}"
    );
    // Another save's file of the same name and length.
    let other = common::temp_dir("dcp-torn-other");
    save(&other, 4);
    let theirs = Index::read(&other).unwrap();
    let their_file = other.join(theirs.files().nth(1).unwrap());
    std::fs::copy(&their_file, &file).unwrap();
    let e = err("");
    assert!(e.contains("of save") && e.contains("two saves"), "{e}");
    // Missing.
    std::fs::remove_file(&file).unwrap();
    let e = err("");
    assert!(
        e.contains("rank 1's file of this checkpoint is missing"),
        "{e}"
    );
    // A tensor the checkpoint lacks, or of another shape.
    std::fs::write(&file, &bytes).unwrap();
    let c = Checkpointer::new(&dir);
    let mut wanted = numbered_state(0).wanted();
    wanted.get_mut("w0").unwrap().shape = vec![1024, 512];
    let e = c
        .load(&wanted, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`w0` has shape [512, 1024] in the checkpoint and [1024, 512] here"),
        "{e}"
    );
    let mut wanted = numbered_state(0).wanted();
    let w = wanted.remove("w0").unwrap();
    wanted.insert("w9".into(), w);
    let e = c
        .load(&wanted, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tensor `w9`"), "{e}");
    // No save at all.
    let e = Checkpointer::new(dir.join("nothing"))
        .index()
        .unwrap_err()
        .to_string();
    assert!(e.contains("index.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&other).unwrap();
}

#[test]
fn an_asynchronous_save_holds_its_steps_state_while_training_goes_on() {
    let dir = common::temp_dir("dcp-async");
    for world in [1, 2] {
        let sub = dir.join(format!("w{world}"));
        let results = distributed::spawn_threads(world, |pg| {
            let (model, mut opt) = Model::new::<AdamW>(&pg, Layout::Zero2, 7, DType::F32, ADAMW);
            model.train(&pg, &mut opt, 0..3);
            let mut c = Checkpointer::for_group(&sub, &pg, &Device::Cpu);
            c.save_async(&model.state_dict(&opt))?;
            model.save_whole(
                &opt,
                &sub.with_extension(format!("at3-{}.safetensors", pg.rank())),
            );
            // Training changes the weights in place while the thread writes.
            model.train(&pg, &mut opt, 3..6);
            c.wait()?;
            let (fresh, mut fresh_opt) =
                Model::new::<AdamW>(&pg, Layout::Fsdp, 1, DType::F32, ADAMW);
            fresh.load(&mut fresh_opt, &c, LoadOptions::default())?;
            fresh.save_whole(
                &fresh_opt,
                &sub.with_extension(format!("back-{}.safetensors", pg.rank())),
            );
            // A second asynchronous save replaces the first; dropping waits for it.
            c.save_async(&model.state_dict(&opt))?;
            Ok(())
        })
        .unwrap();
        assert_eq!(results.len(), world);
        assert_same_files(
            &sub.with_extension("back-0.safetensors"),
            &sub.with_extension("at3-0.safetensors"),
        );
        // The second save is the folder's: one index, the files of one save.
        let index = Index::read(&sub).unwrap();
        let files = std::fs::read_dir(&sub).unwrap().count();
        assert_eq!(files, index.files().count() + 1);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tensor-parallel test's variables as a model fully sharded training can run: `fc2` after
/// `fc1`, plus the first columns of `qkv`.
struct Cut {
    fc1: candle_nn::Linear,
    fc2: candle_nn::Linear,
    qkv: candle_nn::Linear,
}

fn cut(vb: candle_nn::VarBuilder) -> candle_core::Result<Cut> {
    Ok(Cut {
        fc1: candle_nn::linear(4, 8, vb.pp("fc1"))?,
        fc2: candle_nn::linear(8, 4, vb.pp("fc2"))?,
        qkv: candle_nn::linear_no_bias(4, 12, vb.pp("qkv"))?,
    })
}

impl Module for Cut {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.apply(&self.fc1)?.relu()?.apply(&self.fc2)?;
        h + x.apply(&self.qkv)?.narrow(1, 0, 4)?
    }
}

/// Each rank's parts of `whole` (by name) as `plan` cuts them over `tp`.
fn parts_of(
    plan: &ParallelPlan,
    whole: &HashMap<String, Tensor>,
    name: &str,
    tp: &ProcessGroup,
) -> Tensor {
    plan.shard(name, &whole[name], tp).unwrap()
}

#[test]
fn fully_sharded_at_4_loads_into_data_parallel_2_by_tensor_parallel_2() {
    let dir = common::temp_dir("dcp-fsdp-tp");
    distributed::spawn_threads(4, |pg| {
        let config = FsdpConfig {
            seed: Some(3),
            ..FsdpConfig::default()
        };
        let f =
            FullyShardedDataParallel::with_config(&VarMap::new(), &pg, &Device::Cpu, config, cut)?;
        let mut opt = AdamW::new(f.parameters(), ADAMW)?;
        for step in 0..3 {
            let x = Tensor::randn(0f32, 1., (2, 4), &Device::Cpu)?.affine(1.0, step as f64)?;
            let l = f.forward_t(&x, true)?.sqr()?.mean_all()?;
            opt.step(&f.backward(&l)?)?;
        }
        Checkpointer::for_group(dir.join("dcp"), &pg, &Device::Cpu).save(&f.state_dict(&opt)?)?;
        f.save_checkpoint(&opt, dir.join("whole.safetensors"))?;
        Ok(())
    })
    .unwrap();
    let whole = checkpoint::read(dir.join("whole.safetensors")).unwrap();
    let plan = tp_plan();
    distributed::spawn_threads(4, |pg| {
        // [dp 2, tp 2]: ranks 0, 1 and 2, 3 are tensor-parallel pairs.
        let first = pg.new_group(&[0, 1])?;
        let second = pg.new_group(&[2, 3])?;
        let tp = first.or(second).unwrap();
        let names = [
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
            "fc2.bias",
            "qkv.weight",
        ];
        let varmap = varmap_of(
            names
                .iter()
                .map(|n| {
                    (
                        n.to_string(),
                        parts_of(&plan, &whole, n, &tp).zeros_like().unwrap(),
                    )
                })
                .collect::<Vec<_>>(),
        );
        let mut opt = AdamW::new(varmap.all_vars(), ADAMW)?;
        let c = Checkpointer::for_group(dir.join("dcp"), &pg, &Device::Cpu);
        plan.load_state_dict(&c, &varmap, &mut opt, &tp, LoadOptions::default())?;
        let data = varmap.data().lock().unwrap();
        for name in names {
            let want = parts_of(&plan, &whole, name, &tp);
            assert_eq!(
                common::as_f64(data[name].as_tensor()),
                common::as_f64(&want),
                "{name}"
            );
        }
        let state = opt.state();
        for (v, states) in opt.vars().iter().zip(&state.per_var) {
            let name = data
                .iter()
                .find(|(_, w)| w.as_tensor().id() == v.as_tensor().id())
                .unwrap()
                .0;
            assert_eq!(states.len(), 2, "{name}: AdamW's two moments");
            for (s, t) in states {
                let key = format!("optimizer.state.{name}.{s}");
                // Cut as its parameter is.
                let want = plan.shard(name, &whole[&key], &tp)?;
                assert_eq!(common::as_f64(t), common::as_f64(&want), "{key}");
            }
        }
        assert_eq!(state.scalars["step"], 3.0);
        Ok(())
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
