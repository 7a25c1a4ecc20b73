//! DeviceMesh: torch's layout (against torch 2.15's own `init_device_mesh`, printed by
//! scripts/torch_device_mesh.py), its groups over thread ranks and real processes, and the data
//! parallel wrappers along its "dp" dimension: DDP, ZeRO-2 and fully sharded training average
//! gradients within each "dp" group only.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::ddp::{DdpConfig, Sharding};
use candle_parallel::distributed::{self, DeviceMesh, MeshLayout, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::Sgd;
use candle_parallel::{DistributedDataParallel, FsdpConfig, FullyShardedDataParallel};
use common::engines::python_or_skip;
use common::models::{batch, max_diff, mlp, values, Values, SGD};
use common::{done, is_child, join_child, Ranks};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

/// The global ranks of the members of `group`, in its rank order, found by an all-gather.
fn members(group: &ProcessGroup, rank: usize) -> Vec<usize> {
    let me = Tensor::new(&[rank as f32], &Device::Cpu).unwrap();
    group
        .all_gather(&me)
        .unwrap()
        .iter()
        .map(|t| t.to_vec1::<f32>().unwrap()[0] as usize)
        .collect()
}

/// One rank's line of scripts/torch_device_mesh.py, as ours would print it: its coordinate and
/// the members of its group along each dimension, found through the groups themselves.
fn line(mesh: &DeviceMesh, rank: usize) -> String {
    let label: Vec<String> = mesh
        .layout()
        .dim_names()
        .iter()
        .zip(mesh.layout().shape())
        .map(|(n, s)| format!("{n}:{s}"))
        .collect();
    let join = |v: &[usize]| {
        v.iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut out = format!(
        "mesh {} rank {rank} coordinate {}",
        label.join(","),
        join(mesh.coordinate())
    );
    for name in mesh.layout().dim_names() {
        let group = mesh.get_group(name).unwrap();
        assert_eq!(group.rank(), mesh.local_rank(name).unwrap());
        assert_eq!(group.world_size(), mesh.size(name).unwrap());
        out += &format!(" {name} {}", join(&members(group, rank)));
    }
    out
}

/// "dp:2,tp:4" as dimensions.
fn parse_dims(label: &str) -> Vec<(String, usize)> {
    label
        .split(',')
        .map(|d| {
            let (n, s) = d.split_once(':').unwrap();
            (n.to_string(), s.parse().unwrap())
        })
        .collect()
}

#[test]
fn meshes_lay_ranks_out_and_group_them_as_torchs_device_mesh() {
    let Some(python) = python_or_skip() else {
        return;
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/torch_device_mesh.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(script);
    let torch = common::run_ok(cmd, LIMIT);
    let torch: Vec<&str> = torch.lines().filter(|l| l.starts_with("mesh ")).collect();
    let mut labels: Vec<&str> = torch.iter().map(|l| l.split(' ').nth(1).unwrap()).collect();
    labels.dedup();
    assert!(labels.len() >= 5, "torch printed {labels:?}");
    for label in labels {
        let dims = parse_dims(label);
        let dims: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        let world = MeshLayout::new(&dims).unwrap().world_size();
        let ours = distributed::spawn_threads(world, |pg| {
            let mesh = DeviceMesh::new(&pg, &dims)?;
            Ok(line(&mesh, pg.rank()))
        })
        .unwrap();
        let want: Vec<&str> = torch
            .iter()
            .filter(|l| l.split(' ').nth(1) == Some(label))
            .copied()
            .collect();
        assert_eq!(ours, want, "mesh {label}: ours, then torch's");
    }
}

/// A [dp 2, x 2] mesh of a world of 4: coordinates, groups along each dimension and flattened,
/// as the layout says.
fn check_mesh(pg: &ProcessGroup) {
    let mesh = DeviceMesh::new(pg, &[("dp", 2), ("x", 2)]).unwrap();
    let rank = pg.rank();
    assert_eq!(mesh.coordinate(), [rank / 2, rank % 2]);
    assert_eq!(
        members(mesh.get_group("dp").unwrap(), rank),
        [rank % 2, rank % 2 + 2]
    );
    assert_eq!(
        members(mesh.get_group("x").unwrap(), rank),
        [rank - rank % 2, rank - rank % 2 + 1]
    );
    let all = mesh.flatten(&["dp", "x"]).unwrap();
    assert_eq!(members(&all, rank), [0, 1, 2, 3]);
    let err = mesh.get_group("tp").unwrap_err().to_string();
    assert!(err.contains("`tp`") && err.contains("dp, x"), "{err}");
    // A shape that does not hold the world is refused on every rank, saying so.
    let err = DeviceMesh::new(pg, &[("dp", 3), ("x", 2)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("6 ranks but the group has 4"), "{err}");
}

#[test]
fn a_mesh_of_4_thread_ranks_groups_them_by_dimension() {
    distributed::spawn_threads(4, |pg| {
        check_mesh(&pg);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_mesh_of_4_processes_groups_them_by_dimension_and_trains_along_dp() {
    let test = "a_mesh_of_4_processes_groups_them_by_dimension_and_trains_along_dp";
    if is_child() {
        let pg = join_child();
        check_mesh(&pg);
        along_dp(&pg, Wrapper::Ddp);
        done();
        return;
    }
    Ranks::world(test, 4).assert_all_pass(LIMIT);
}

const PER: usize = 6;
const STEPS: usize = 20;

/// Step `step`'s batch of the data the "dp" group at index `x` of the "x" dimension trains on:
/// each group has its own.
fn group_batch(x: usize, step: usize, rows: usize) -> (Tensor, Tensor) {
    batch(100 * x + step, rows)
}

/// One process training on the whole of group `x`'s data.
fn reference(x: usize) -> Values {
    let varmap = VarMap::new();
    let model = mlp(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    for step in 0..STEPS {
        let (xs, ys) = group_batch(x, step, 2 * PER);
        let l = loss::cross_entropy(&model.forward(&xs).unwrap(), &ys).unwrap();
        opt.backward_step(&l).unwrap();
    }
    values(&varmap)
}

#[derive(Clone, Copy, Debug)]
enum Wrapper {
    Ddp,
    Zero2,
    Fsdp,
}

/// Trains along "dp" of a [dp 2, x 2] mesh, each rank on its share of its dp group's data, and
/// checks the result against one process on that group's data.
fn along_dp(pg: &ProcessGroup, wrapper: Wrapper) {
    let mesh = DeviceMesh::new(pg, &[("dp", 2), ("x", 2)]).unwrap();
    let dp = mesh.get_group("dp").unwrap();
    let (d, x) = (
        mesh.local_rank("dp").unwrap(),
        mesh.local_rank("x").unwrap(),
    );
    let share = |step| {
        let (xs, ys) = group_batch(x, step, 2 * PER);
        (
            xs.narrow(0, d * PER, PER).unwrap(),
            ys.narrow(0, d * PER, PER).unwrap(),
        )
    };
    let varmap = VarMap::new();
    let got: Values = match wrapper {
        Wrapper::Ddp | Wrapper::Zero2 => {
            mlp(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
            let sharding = match wrapper {
                Wrapper::Zero2 => Sharding::Zero2,
                _ => Sharding::None,
            };
            let config = DdpConfig {
                sharding,
                ..DdpConfig::default()
            };
            let model =
                DistributedDataParallel::with_config(&varmap, dp, &Device::Cpu, config, mlp)
                    .unwrap();
            let mut opt = Sgd::new(model.parameters(), SGD).unwrap();
            for step in 0..STEPS {
                let (xs, ys) = share(step);
                let l = loss::cross_entropy(&model.forward_t(&xs, true).unwrap(), &ys).unwrap();
                opt.step(&model.backward(&l).unwrap()).unwrap();
            }
            values(&varmap)
        }
        Wrapper::Fsdp => {
            let config = FsdpConfig {
                seed: Some(7),
                ..FsdpConfig::default()
            };
            let model =
                FullyShardedDataParallel::with_config(&varmap, dp, &Device::Cpu, config, mlp)
                    .unwrap();
            let mut opt = Sgd::new(model.parameters(), SGD).unwrap();
            for step in 0..STEPS {
                let (xs, ys) = share(step);
                let l = loss::cross_entropy(&model.forward_t(&xs, true).unwrap(), &ys).unwrap();
                opt.step(&model.backward(&l).unwrap()).unwrap();
            }
            let mut full: Values = model
                .full_parameters()
                .unwrap()
                .into_iter()
                .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
                .collect();
            full.sort_by(|a, b| a.0.cmp(&b.0));
            full
        }
    };
    let want = reference(x);
    let d_own = max_diff(&got, &want);
    assert!(
        d_own <= 1e-5,
        "{wrapper:?}, rank {} (dp {d}, x {x}): {d_own} away from one process on its group's data",
        pg.rank()
    );
    let d_other = max_diff(&got, &reference(1 - x));
    assert!(
        d_other > 1e-3,
        "{wrapper:?}, rank {}: only {d_other} away from the other dp group's training: were \
         gradients averaged over the whole world?",
        pg.rank()
    );
}

#[test]
fn ddp_zero2_and_fsdp_along_dp_of_a_2_by_2_mesh_average_within_each_dp_group() {
    for wrapper in [Wrapper::Ddp, Wrapper::Zero2, Wrapper::Fsdp] {
        distributed::spawn_threads(4, |pg| {
            along_dp(&pg, wrapper);
            Ok(())
        })
        .unwrap();
    }
}
