//! The distributed checkpoint as a user trying to break it: every dtype, 0-dim and empty
//! tensors, shapes no world divides, boxes and flat ranges mixed, several pieces per rank,
//! pieces replicated on some ranks, saved at every world size from 1 to 5 and loaded at every
//! other, bit for bit; ranks that disagree, pieces that overlap or leave a gap, regions out of
//! bounds, hand-edited indexes, folders that are files or not shared, a rank whose write fails:
//! an error on every rank, never a hang or a partial commit, the previous checkpoint still
//! loading; every pair of layouts (one process, DDP, ZeRO-2, fully sharded, tensor parallel)
//! at changing world sizes with fresh and stepped optimizers, going on as one process would;
//! bf16 models with and without dtype conversion; asynchronous saves mixed with synchronous
//! ones, dropped, repeated, and with evaluation in between. Thread ranks (the host backend).

mod common;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use candle_parallel::checkpoint::distributed::{
    self as dcp, Checkpointer, Index, Region, ShardedTensor, StateDict, Wanted,
};
use candle_parallel::checkpoint::LoadOptions;
use candle_parallel::ddp::{DdpConfig, Sharding};
use candle_parallel::distributed::{self, InitConfig, ProcessGroup};
use candle_parallel::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_parallel::optim::{AdamW, ElementwiseOptimizer, Sgd, SgdConfig};
use candle_parallel::DistributedDataParallel;
use common::layouts::{
    assert_same_files, bits, one_process, tp_plan, varmap_of, Layout, Model, ADAMW,
};
use common::models::{max_diff, SGD};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

/// Thread ranks whose collectives give up after 30 s: a hang fails the test, never stalls it.
fn spawn<T: Send>(
    world: usize,
    f: impl Fn(ProcessGroup) -> candle_parallel::Result<T> + Sync,
) -> candle_parallel::Result<Vec<T>> {
    let config = InitConfig {
        timeout: Duration::from_secs(30),
        ..InitConfig::default()
    };
    distributed::spawn_threads_with_config(world, config, f)
}

/// The files in `dir`, by name.
fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Every dtype, every shape, cut every way.

/// The tensors of the dtype test: every dtype candle saves, 0-dim, empty, 1-D to 4-D, sizes no
/// world from 2 to 5 divides.
fn zoo() -> Vec<(&'static str, Tensor)> {
    let t = |n: usize, shape: &[usize], dtype: DType, offset: f64| {
        Tensor::arange(0f32, n as f32, &Device::Cpu)
            .unwrap()
            .affine(1.0, offset)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .reshape(shape)
            .unwrap()
    };
    vec![
        ("f32.4d", t(60, &[3, 2, 5, 2], DType::F32, -7.25)),
        ("f64.3d", t(105, &[5, 3, 7], DType::F64, 0.125)),
        ("bf16", t(21, &[7, 3], DType::BF16, -3.5)),
        ("f16", t(11, &[11], DType::F16, 0.5)),
        ("u8", t(20, &[4, 5], DType::U8, 200.0)),
        ("u32", t(18, &[9, 2], DType::U32, 70000.0)),
        ("i64", t(27, &[3, 3, 3], DType::I64, -13.0)),
        ("scalar", t(1, &[], DType::F32, 42.0)),
        ("scalar.i64", t(1, &[], DType::I64, -9.0)),
        ("empty", t(0, &[0], DType::F32, 0.0)),
        ("empty.3d", t(0, &[2, 0, 3], DType::F64, 0.0)),
        ("one", t(1, &[1], DType::BF16, 1.0)),
        (
            "a \"quoted\" \\ name, ünïcode #0",
            t(6, &[2, 3], DType::F32, 0.5),
        ),
    ]
}

/// `n` cut into `k` consecutive ranges of uneven lengths (some empty), by `seed`.
fn split(n: usize, k: usize, seed: usize) -> Vec<std::ops::Range<usize>> {
    let mut weights: Vec<usize> = (0..k).map(|i| (i * 5 + seed) % 4).collect();
    if weights.iter().all(|w| *w == 0) {
        weights[0] = 1;
    }
    let total: usize = weights.iter().sum();
    let mut cum = 0;
    let mut start = 0;
    weights
        .iter()
        .map(|w| {
            cum += w;
            let end = n * cum / total;
            let r = start..end;
            start = end;
            r
        })
        .collect()
}

/// The box along dimension `dim` over `range`, whole along the others.
fn rows(shape: &[usize], dim: usize, range: std::ops::Range<usize>) -> Region {
    let mut offsets = vec![0; shape.len()];
    let mut sizes = shape.to_vec();
    offsets[dim] = range.start;
    sizes[dim] = range.len();
    Region::Box { offsets, sizes }
}

/// The regions rank `rank` of `world` holds of a tensor of `shape`, cut by `seed`: boxes along
/// some dimension (each cut again in two: several pieces on a rank; on odd seeds each also held
/// by the next rank: replicated on some ranks), flat ranges (rank 0 holding a second one), or
/// rows as a box on ranks 0 and 1 and the rest as flat ranges. Together the ranks' regions
/// tile the tensor.
fn cut(shape: &[usize], world: usize, rank: usize, seed: usize) -> Vec<Region> {
    let numel: usize = shape.iter().product();
    if shape.is_empty() {
        return match seed % 2 {
            0 if rank == seed % world => vec![Region::whole(shape)],
            0 => vec![],
            _ => vec![Region::Flat { start: 0, len: 1 }],
        };
    }
    if numel == 0 {
        return vec![Region::whole(shape)];
    }
    match seed % 3 {
        0 => {
            let dim = seed % shape.len();
            let ranges = split(shape[dim], world, seed);
            let mut holds = vec![rank];
            if seed % 2 == 1 && world > 1 {
                holds.push((rank + world - 1) % world);
            }
            let mut out = Vec::new();
            for r in holds {
                let block = ranges[r].clone();
                if shape.len() > 1 && !block.is_empty() {
                    // Cut again along the next dimension: two pieces.
                    let other = (dim + 1) % shape.len();
                    let half = shape[other] / 2;
                    for part in [0..half, half..shape[other]] {
                        let Region::Box {
                            mut offsets,
                            mut sizes,
                        } = rows(shape, dim, block.clone())
                        else {
                            unreachable!()
                        };
                        offsets[other] = part.start;
                        sizes[other] = part.len();
                        out.push(Region::Box { offsets, sizes });
                    }
                } else {
                    out.push(rows(shape, dim, block));
                }
            }
            out
        }
        1 => {
            let ranges = split(numel, world + 1, seed);
            let mut out = vec![Region::Flat {
                start: ranges[rank].start,
                len: ranges[rank].len(),
            }];
            if rank == 0 {
                out.push(Region::Flat {
                    start: ranges[world].start,
                    len: ranges[world].len(),
                });
            }
            out
        }
        _ => {
            let h = shape[0] / 2;
            let stride = numel / shape[0];
            let mut out = Vec::new();
            if h > 0 && rank <= 1 {
                out.push(rows(shape, 0, 0..h));
            }
            let rest = split(numel - h * stride, world, seed);
            out.push(Region::Flat {
                start: h * stride + rest[rank].start,
                len: rest[rank].len(),
            });
            out
        }
    }
}

/// The elements of `t` that `region` holds, as the piece of it.
fn take(t: &Tensor, region: &Region) -> Tensor {
    match region {
        Region::Flat { start, len } => t.flatten_all().unwrap().narrow(0, *start, *len).unwrap(),
        Region::Box { offsets, sizes } => {
            let mut p = t.clone();
            for d in 0..sizes.len() {
                p = p.narrow(d, offsets[d], sizes[d]).unwrap();
            }
            p
        }
    }
}

/// Rank `rank`'s state of the zoo, cut by `seed` (each tensor by `seed + its place`).
fn zoo_state(world: usize, rank: usize, seed: usize) -> StateDict {
    let mut s = StateDict::new();
    for (i, (name, t)) in zoo().into_iter().enumerate() {
        let pieces = cut(t.dims(), world, rank, seed + i)
            .into_iter()
            .map(|r| {
                let p = take(&t, &r);
                (r, p)
            })
            .collect();
        s.insert(
            name,
            ShardedTensor::new(t.dims(), t.dtype(), pieces).unwrap(),
        );
    }
    s
}

/// Checks that `loaded` holds exactly the zoo's elements of the regions asked.
fn assert_zoo(loaded: &StateDict, wanted: &BTreeMap<String, Wanted>, context: &str) {
    let zoo: BTreeMap<&str, Tensor> = zoo().into_iter().collect();
    assert_eq!(loaded.len(), wanted.len(), "{context}");
    for (name, want) in wanted {
        let t = loaded.get(name).unwrap();
        assert_eq!(t.pieces().len(), want.regions.len(), "{context} {name}");
        for ((region, piece), asked) in t.pieces().iter().zip(&want.regions) {
            assert_eq!(region, asked);
            let src = &zoo[name.as_str()];
            assert_eq!(piece.dtype(), src.dtype(), "{context} {name}");
            assert_eq!(piece.dims(), region.dims().as_slice(), "{context} {name}");
            assert_eq!(
                bits(piece),
                bits(&take(src, region)),
                "{context}: `{name}` at {region:?}"
            );
        }
    }
}

#[test]
fn every_dtype_and_shape_cut_every_way_round_trips_between_worlds_1_to_5() {
    let dir = common::temp_dir("dcp-adv-zoo");
    for save_world in 1..=5 {
        let sub = dir.join(format!("w{save_world}"));
        spawn(save_world, |pg| {
            let state = zoo_state(save_world, pg.rank(), save_world);
            Checkpointer::for_group(&sub, &pg, &Device::Cpu).save(&state)
        })
        .unwrap();
        // One process reads it whole.
        let whole: BTreeMap<String, Wanted> = zoo()
            .iter()
            .map(|(n, t)| {
                let w = Wanted {
                    shape: t.dims().to_vec(),
                    dtype: None,
                    device: Device::Cpu,
                    regions: vec![Region::whole(t.dims())],
                };
                (n.to_string(), w)
            })
            .collect();
        let loaded = Checkpointer::new(&sub)
            .load(&whole, LoadOptions::default())
            .unwrap();
        assert_zoo(&loaded, &whole, &format!("saved at {save_world}, whole"));
        // Every world size, cut otherwise.
        for load_world in 1..=5 {
            spawn(load_world, |pg| {
                let wanted = zoo_state(load_world, pg.rank(), 7 + load_world).wanted();
                let c = Checkpointer::for_group(&sub, &pg, &Device::Cpu);
                let loaded = c.load(&wanted, LoadOptions::default())?;
                let context = format!(
                    "saved at {save_world}, loaded at {load_world} on rank {}",
                    pg.rank()
                );
                assert_zoo(&loaded, &wanted, &context);
                Ok(())
            })
            .unwrap();
        }
        // Each piece was written once: the files together hold every element once (plus the
        // pieces of empty tensors).
        let index = Index::read(&sub).unwrap();
        assert_eq!(index.world_size(), save_world);
        assert_eq!(index.dtype("u32"), Some(DType::U32));
        assert_eq!(index.shape("empty.3d"), Some(&[2usize, 0, 3][..]));
        assert_eq!(index.shape("scalar"), Some(&[][..]));
    }
    // Nothing at all, saved over a checkpoint: loads as nothing, and the old files are gone.
    let sub = dir.join("w3");
    spawn(3, |pg| {
        let mut c = Checkpointer::for_group(&sub, &pg, &Device::Cpu);
        c.save(&StateDict::new())?;
        assert!(c.load(&BTreeMap::new(), LoadOptions::default())?.is_empty());
        let e = c.load(&zoo_state(3, pg.rank(), 0).wanted(), LoadOptions::default());
        assert!(e.unwrap_err().to_string().contains("no tensor"));
        Ok(())
    })
    .unwrap();
    assert_eq!(listing(&sub), BTreeSet::from([dcp::INDEX_FILE.to_string()]));
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Ranks that disagree; pieces that overlap or leave a gap.

/// A small state: `w` [4, 3] f32 as two row blocks (rank 0: rows 0..2, rank 1: rows 2..4),
/// `b` [5] whole on every rank, each element `step`.
fn small_state(world: usize, rank: usize, step: f32) -> StateDict {
    let w = Tensor::full(step, (4, 3), &Device::Cpu).unwrap();
    let mut s = StateDict::new();
    let ranges = split(4, world, 1);
    let region = rows(&[4, 3], 0, ranges[rank].clone());
    let piece = take(&w, &region);
    s.insert(
        "w",
        ShardedTensor::new(&[4, 3], DType::F32, vec![(region, piece)]).unwrap(),
    );
    s.insert(
        "b",
        ShardedTensor::whole(Tensor::full(step, 5, &Device::Cpu).unwrap()),
    );
    s
}

/// The step the small state in `dir` was saved at, loaded by one process.
fn small_step(dir: &Path) -> f32 {
    let mut want = StateDict::new();
    for (n, shape) in [("w", vec![4, 3]), ("b", vec![5])] {
        let t = Tensor::zeros(shape.as_slice(), DType::F32, &Device::Cpu).unwrap();
        want.insert(n, ShardedTensor::whole(t));
    }
    let loaded = Checkpointer::new(dir)
        .load(&want.wanted(), LoadOptions::default())
        .unwrap();
    let all: Vec<f32> = loaded
        .iter()
        .flat_map(|(_, t)| {
            t.piece()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect();
    assert!(all.iter().all(|x| *x == all[0]), "{all:?}");
    all[0]
}

/// Saves at world 3 with `change` applied to each rank's small state of step 2: every rank must
/// fail, its error containing each of `needles`, and the folder keep the save of step 1 as it
/// was.
fn assert_refused(
    dir: &Path,
    change: impl Fn(usize, &mut StateDict) + Sync,
    needles: &[&str],
    asynchronous: bool,
) {
    let before = listing(dir);
    let errors = spawn(3, |pg| {
        let mut state = small_state(3, pg.rank(), 2.0);
        change(pg.rank(), &mut state);
        let mut c = Checkpointer::for_group(dir, &pg, &Device::Cpu);
        let result = match asynchronous {
            true => c.save_async(&state).and_then(|()| c.wait()),
            false => c.save(&state),
        };
        Ok(result.err().map(|e| e.to_string()))
    })
    .unwrap();
    for (rank, e) in errors.iter().enumerate() {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank} saved: {needles:?}"));
        for n in needles {
            assert!(e.contains(n), "rank {rank}: `{n}` not in: {e}");
        }
    }
    assert_eq!(listing(dir), before, "{needles:?}");
    assert_eq!(small_step(dir), 1.0);
}

#[test]
fn ranks_that_disagree_or_pieces_that_overlap_or_leave_a_gap_fail_on_every_rank() {
    let dir = common::temp_dir("dcp-adv-disagree");
    spawn(3, |pg| {
        Checkpointer::for_group(&dir, &pg, &Device::Cpu).save(&small_state(3, pg.rank(), 1.0))
    })
    .unwrap();
    assert_eq!(small_step(&dir), 1.0);
    for asynchronous in [false, true] {
        // Rank 2 describes `b` with another shape.
        assert_refused(
            &dir,
            |rank, s| {
                if rank == 2 {
                    let t = Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap();
                    s.insert("b", ShardedTensor::whole(t));
                }
            },
            &["`b`", "rank 2", "[5]", "[6]"],
            asynchronous,
        );
        // Rank 1 describes `b` in another dtype.
        assert_refused(
            &dir,
            |rank, s| {
                if rank == 1 {
                    let t = Tensor::zeros(5, DType::F64, &Device::Cpu).unwrap();
                    s.insert("b", ShardedTensor::whole(t));
                }
            },
            &["`b`", "rank 1", "f64"],
            asynchronous,
        );
        // Rank 1's rows of `w` (0..2) reach into rank 2's (2..4): overlapping differently.
        assert_refused(
            &dir,
            |rank, s| {
                if rank == 1 {
                    let region = rows(&[4, 3], 0, 0..3);
                    let t = Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap();
                    let w = ShardedTensor::new(&[4, 3], DType::F32, vec![(region, t)]).unwrap();
                    s.insert("w", w);
                }
            },
            &["`w`", "two different pieces"],
            asynchronous,
        );
        // No rank holds the last row of `w`.
        assert_refused(
            &dir,
            |rank, s| {
                if rank == 2 {
                    let w = ShardedTensor::new(&[4, 3], DType::F32, vec![]).unwrap();
                    s.insert("w", w);
                }
            },
            &["`w`", "in no piece"],
            asynchronous,
        );
        // A flat piece and a box that overlap on one rank.
        assert_refused(
            &dir,
            |rank, s| {
                if rank == 0 {
                    let b = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
                    let pieces = vec![
                        (Region::whole(&[5]), b.clone()),
                        (
                            Region::Flat { start: 4, len: 1 },
                            b.narrow(0, 0, 1).unwrap(),
                        ),
                    ];
                    s.insert("b", ShardedTensor::new(&[5], DType::F32, pieces).unwrap());
                }
            },
            &["`b`", "two different pieces"],
            asynchronous,
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Loading what is not there.

#[test]
fn regions_out_of_bounds_and_dtypes_are_errors_on_every_rank_naming_the_tensor() {
    let dir = common::temp_dir("dcp-adv-bounds");
    spawn(2, |pg| {
        Checkpointer::for_group(&dir, &pg, &Device::Cpu).save(&small_state(2, pg.rank(), 1.0))
    })
    .unwrap();
    let bad_regions = [
        Region::Box {
            offsets: vec![3, 0],
            sizes: vec![2, 3],
        },
        Region::Box {
            offsets: vec![0, 1],
            sizes: vec![4, 3],
        },
        Region::Box {
            offsets: vec![0],
            sizes: vec![4],
        },
        Region::Box {
            offsets: vec![0, 0, 0],
            sizes: vec![4, 3, 1],
        },
        Region::Flat { start: 10, len: 3 },
        Region::Flat {
            start: usize::MAX,
            len: 2,
        },
    ];
    for region in &bad_regions {
        let errors = spawn(2, |pg| {
            let mut wanted = small_state(2, pg.rank(), 0.0).wanted();
            if pg.rank() == 1 {
                wanted.get_mut("w").unwrap().regions.push(region.clone());
            }
            let c = Checkpointer::for_group(&dir, &pg, &Device::Cpu);
            Ok(c.load(&wanted, LoadOptions::default())
                .err()
                .map(|e| e.to_string()))
        })
        .unwrap();
        for (rank, e) in errors.iter().enumerate() {
            let e = e.as_ref().unwrap_or_else(|| panic!("{region:?} loaded"));
            // Rank 1 says what is wrong; the others, that rank 1 failed and why.
            let why = e.contains("past") || e.contains("another rank");
            assert!(e.contains("`w`") && why, "rank {rank}: {e}");
            assert!(rank == 1 || e.contains("rank 1"), "rank {rank}: {e}");
        }
    }
    // Another dtype: an error unless converting, then the values converted.
    let mut wanted = small_state(1, 0, 0.0).wanted();
    wanted.get_mut("w").unwrap().dtype = Some(DType::BF16);
    let c = Checkpointer::new(&dir);
    let e = c
        .load(&wanted, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`w`") && e.contains("convert_dtypes"), "{e}");
    let options = LoadOptions {
        convert_dtypes: true,
    };
    let loaded = c.load(&wanted, options).unwrap();
    let w = loaded.get("w").unwrap();
    assert_eq!(
        (w.dtype(), w.piece().unwrap().dtype()),
        (DType::BF16, DType::BF16)
    );
    assert_eq!(common::as_f64(w.piece().unwrap()), vec![1.0; 12]);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Hand-edited indexes, stored names, files of other checkpoints.

/// Edits the JSON of `dir`'s index with `edit`.
fn edit_index(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(dcp::INDEX_FILE);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// What loading the small state from `dir` says (one process).
fn small_error(dir: &Path) -> String {
    let wanted = small_state(1, 0, 0.0).wanted();
    match std::panic::catch_unwind(|| Checkpointer::new(dir).load(&wanted, LoadOptions::default()))
    {
        Ok(r) => r.err().map(|e| e.to_string()).unwrap_or_default(),
        Err(_) => "PANICKED".into(),
    }
}

#[test]
fn hand_edited_indexes_are_errors_never_panics_or_wrong_values() {
    let dir = common::temp_dir("dcp-adv-index");
    let good = dir.join("good");
    spawn(2, |pg| {
        Checkpointer::for_group(&good, &pg, &Device::Cpu).save(&small_state(2, pg.rank(), 1.0))
    })
    .unwrap();
    let original = std::fs::read(good.join(dcp::INDEX_FILE)).unwrap();
    let restore = || std::fs::write(good.join(dcp::INDEX_FILE), &original).unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "wrong version",
            Box::new(|v| v["version"] = 99.into()),
            &["version 99"],
        ),
        (
            "piece in a missing file",
            Box::new(|v| v["tensors"]["w"]["pieces"][1]["file"] = 7.into()),
            &["`w`", "file 7"],
        ),
        (
            "a box of another rank",
            Box::new(|v| {
                v["tensors"]["w"]["pieces"][0]["region"] =
                    serde_json::json!({"box": {"offsets": [0], "sizes": [2]}})
            }),
            &["`w`"],
        ),
        (
            "a box past the tensor",
            Box::new(|v| {
                v["tensors"]["w"]["pieces"][1]["region"] =
                    serde_json::json!({"box": {"offsets": [3, 0], "sizes": [2, 3]}})
            }),
            &["`w`"],
        ),
        (
            "a flat piece past the tensor",
            Box::new(|v| {
                v["tensors"]["b"]["pieces"][0]["region"] =
                    serde_json::json!({"flat": {"start": 0, "len": 6}})
            }),
            &["`b`"],
        ),
        (
            "a piece dropped",
            Box::new(|v| {
                v["tensors"]["w"]["pieces"]
                    .as_array_mut()
                    .unwrap()
                    .truncate(1)
            }),
            &["`w`", "in no piece"],
        ),
        (
            "a piece named twice",
            Box::new(|v| {
                let p = v["tensors"]["w"]["pieces"][0].clone();
                v["tensors"]["w"]["pieces"].as_array_mut().unwrap().push(p)
            }),
            &["`w`", "two different pieces"],
        ),
        (
            "another dtype",
            Box::new(|v| v["tensors"]["b"]["dtype"] = "f16".into()),
            &["`b`"],
        ),
        (
            "an unknown dtype",
            Box::new(|v| v["tensors"]["b"]["dtype"] = "f17".into()),
            &["`b`", "f17"],
        ),
        (
            "pieces swapped between tensors' keys",
            Box::new(|v| {
                let a = v["tensors"]["w"]["pieces"][0]["key"].clone();
                let b = v["tensors"]["w"]["pieces"][1]["key"].clone();
                v["tensors"]["w"]["pieces"][0]["key"] = b;
                v["tensors"]["w"]["pieces"][1]["key"] = a;
            }),
            &["`w"],
        ),
    ];
    for (what, edit, needles) in cases {
        edit_index(&good, edit);
        let e = small_error(&good);
        assert!(!e.is_empty() && e != "PANICKED", "{what}: {e:?}");
        for n in needles {
            assert!(e.contains(n), "{what}: `{n}` not in: {e}");
        }
        restore();
    }
    // Not JSON at all.
    std::fs::write(good.join(dcp::INDEX_FILE), b"{\"format\": ").unwrap();
    let e = small_error(&good);
    assert!(e.contains("not an index"), "{e}");
    restore();
    assert_eq!(small_step(&good), 1.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tensor_names_with_the_piece_separator_never_share_a_stored_name() {
    // `w`'s pieces on one rank and a tensor named like one of them: each must load its own.
    let dir = common::temp_dir("dcp-adv-names");
    let w = Tensor::arange(0f32, 6., &Device::Cpu)
        .unwrap()
        .reshape((2, 3))
        .unwrap();
    let impostor = Tensor::full(-1f32, (1, 3), &Device::Cpu).unwrap();
    let mut s = StateDict::new();
    let pieces = (0..2)
        .map(|r| {
            let region = rows(&[2, 3], 0, r..r + 1);
            (region.clone(), take(&w, &region))
        })
        .collect();
    s.insert(
        "w",
        ShardedTensor::new(&[2, 3], DType::F32, pieces).unwrap(),
    );
    s.insert("w#0", ShardedTensor::whole(impostor.clone()));
    s.insert("w#1", ShardedTensor::whole(impostor.clone()));
    let mut c = Checkpointer::new(&dir);
    c.save(&s).unwrap();
    let mut want = StateDict::new();
    want.insert("w", ShardedTensor::whole(w.zeros_like().unwrap()));
    want.insert("w#0", ShardedTensor::whole(impostor.zeros_like().unwrap()));
    let loaded = c.load(&want.wanted(), LoadOptions::default()).unwrap();
    assert_eq!(bits(loaded.get("w").unwrap().piece().unwrap()), bits(&w));
    assert_eq!(
        bits(loaded.get("w#0").unwrap().piece().unwrap()),
        bits(&impostor)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Folders that cannot be written, or are not shared; a rank whose write fails.

#[test]
fn a_folder_that_is_a_file_or_not_shared_or_one_ranks_failed_write_fails_every_rank() {
    let dir = common::temp_dir("dcp-adv-folder");
    // The folder is a file.
    let file = dir.join("a-file");
    std::fs::write(&file, b"not a folder").unwrap();
    let errors = spawn(2, |pg| {
        let mut c = Checkpointer::for_group(&file, &pg, &Device::Cpu);
        Ok(c.save(&small_state(2, pg.rank(), 1.0))
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for e in &errors {
        let e = e.as_ref().expect("saved into a file");
        assert!(e.contains("a-file"), "{e}");
    }
    // Rank 1 is given a folder that is a file (its state makes its write fail), rank 0 a good
    // one: both fail, and rank 0's folder keeps its previous checkpoint.
    let good = dir.join("good");
    spawn(2, |pg| {
        Checkpointer::for_group(&good, &pg, &Device::Cpu).save(&small_state(2, pg.rank(), 1.0))
    })
    .unwrap();
    let before = listing(&good);
    for asynchronous in [false, true] {
        let errors = spawn(2, |pg| {
            let to = if pg.rank() == 1 { &file } else { &good };
            let mut c = Checkpointer::for_group(to, &pg, &Device::Cpu);
            let state = small_state(2, pg.rank(), 2.0);
            let r = match asynchronous {
                true => c.save_async(&state).and_then(|()| c.wait()),
                false => c.save(&state),
            };
            Ok(r.err().map(|e| e.to_string()))
        })
        .unwrap();
        for (rank, e) in errors.iter().enumerate() {
            let e = e.as_ref().unwrap_or_else(|| panic!("rank {rank} saved"));
            // Rank 1 says what failed; rank 0, that rank 1 did and why.
            assert!(e.contains("a-file"), "rank {rank}: {e}");
            assert!(rank == 1 || e.contains("rank 1"), "rank {rank}: {e}");
        }
        assert_eq!(listing(&good), before);
        assert_eq!(small_step(&good), 1.0);
    }
    // Each rank given its own folder (a file system that is not shared): the index would name
    // files that are not beside it. The save must fail rather than commit a checkpoint that
    // cannot load.
    let (a, b) = (dir.join("rank0"), dir.join("rank1"));
    let errors = spawn(2, |pg| {
        let to = if pg.rank() == 1 { &b } else { &a };
        let mut c = Checkpointer::for_group(to, &pg, &Device::Cpu);
        Ok(c.save(&small_state(2, pg.rank(), 1.0))
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for (rank, e) in errors.iter().enumerate() {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank}: a save over unshared folders committed"));
        assert!(e.contains("shard-1-of-2"), "rank {rank}: {e}");
    }
    assert!(!a.join(dcp::INDEX_FILE).exists());
    // Nothing committed: no rank leaves its file of that save behind.
    for folder in [&a, &b] {
        let left = listing(folder);
        assert!(left.is_empty(), "{} keeps {left:?}", folder.display());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn processes_whose_one_rank_cannot_write_all_fail_then_save_together() {
    let test = "processes_whose_one_rank_cannot_write_all_fail_then_save_together";
    if common::is_child() {
        let pg = common::join_child();
        let dir = std::path::PathBuf::from(std::env::var("CP_DIR").unwrap());
        let good = dir.join("good");
        let to = if pg.rank() == 1 {
            dir.join("a-file")
        } else {
            good.clone()
        };
        let mut c = Checkpointer::for_group(&to, &pg, &Device::Cpu);
        let e = c
            .save(&small_state(2, pg.rank(), 2.0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("a-file"), "rank {}: {e}", pg.rank());
        let mut c = Checkpointer::for_group(&good, &pg, &Device::Cpu);
        c.save(&small_state(2, pg.rank(), 3.0)).unwrap();
        common::done();
        return;
    }
    let dir = common::temp_dir("dcp-adv-processes");
    std::fs::write(dir.join("a-file"), b"not a folder").unwrap();
    let port = common::free_port();
    let envs = (0..2)
        .map(|r| {
            let mut env = common::rank_env(r, 2, port);
            env.push(("CP_DIR".into(), dir.display().to_string()));
            env
        })
        .collect();
    common::Ranks::start(test, envs).assert_all_pass(Duration::from_secs(60));
    assert_eq!(small_step(&dir.join("good")), 3.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Every layout into every other, changing world sizes, with fresh and stepped optimizers.

const PLAIN_SGD: SgdConfig = SgdConfig {
    lr: 0.05,
    momentum: 0.0,
    dampening: 0.0,
    weight_decay: 0.0,
    nesterov: false,
    maximize: false,
};

/// Runs `hops`: the first layout starts from seed 7 and trains `STEPS` steps (none: a fresh
/// optimizer) and saves; each next loads into fresh weights of another seed (its consolidated
/// state equal bit for bit to the saver's), trains `STEPS` more and saves, the folder reused.
/// The last one's weights equal one process's after all the steps, within 1e-5.
fn hop<O: ElementwiseOptimizer>(
    dir: &Path,
    config: O::Config,
    steps: usize,
    hops: &[(Layout, usize)],
) where
    O::Config: Sync + Copy,
{
    let dcp_dir = dir.join("dcp");
    for (h, &(layout, world)) in hops.iter().enumerate() {
        let saved = dir.join(format!("saved-{h}.safetensors"));
        let back = dir.join(format!("loaded-{h}.safetensors"));
        spawn(world, |pg| {
            let seed = if h == 0 { 7 } else { 100 + h as u64 };
            let (model, mut opt) = Model::new::<O>(&pg, layout, seed, DType::F32, config);
            let mut c = Checkpointer::for_group(&dcp_dir, &pg, &Device::Cpu);
            if h > 0 {
                model.load(&mut opt, &c, LoadOptions::default())?;
                model.save_whole(&opt, &back);
            }
            model.train(&pg, &mut opt, h * steps..(h + 1) * steps);
            let d = max_diff(&model.values(), &one_process::<O>(config, (h + 1) * steps));
            assert!(
                d <= 1e-5,
                "hop {h} ({layout:?} at {world}, rank {}): off one process by {d}",
                pg.rank()
            );
            c.save(&model.state_dict(&opt))?;
            model.save_whole(&opt, &saved);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("hop {h} ({layout:?} at {world}): {e}"));
        if h > 0 {
            let before = dir.join(format!("saved-{}.safetensors", h - 1));
            assert_same_files(&back, &before);
        }
        // The folder holds one save: the index and its files.
        let index = Index::read(&dcp_dir).unwrap();
        assert_eq!(listing(&dcp_dir).len(), index.files().count() + 1);
    }
}

/// Every layout loads every other at another world size.
const HOPS: &[(Layout, usize)] = &[
    (Layout::One, 1),
    (Layout::Zero2, 3),
    (Layout::Fsdp, 5),
    (Layout::Ddp, 2),
    (Layout::Zero2, 4),
    (Layout::One, 1),
    (Layout::Fsdp, 2),
    (Layout::Zero2, 5),
    (Layout::Ddp, 3),
    (Layout::Fsdp, 4),
    (Layout::Ddp, 1),
];

#[test]
fn every_layout_loads_every_other_at_another_world_with_adamw() {
    let dir = common::temp_dir("dcp-adv-hops-adamw");
    hop::<AdamW>(&dir, ADAMW, 1, HOPS);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_adamw_checkpoint_into_sgd_is_refused_on_every_rank_and_changes_nothing() {
    let dir = common::temp_dir("dcp-adv-other-optimizer");
    spawn(2, |pg| {
        let (model, mut opt) = Model::new::<AdamW>(&pg, Layout::Fsdp, 7, DType::F32, ADAMW);
        model.train(&pg, &mut opt, 0..1);
        Checkpointer::for_group(&dir, &pg, &Device::Cpu).save(&model.state_dict(&opt))
    })
    .unwrap();
    let errors = spawn(3, |pg| {
        let (model, mut opt) = Model::new::<Sgd>(&pg, Layout::Zero2, 1, DType::F32, SGD);
        let before = model.values();
        let c = Checkpointer::for_group(&dir, &pg, &Device::Cpu);
        let e = model
            .load(&mut opt, &c, LoadOptions::default())
            .unwrap_err();
        assert_eq!(max_diff(&model.values(), &before), 0.0);
        Ok(e.to_string())
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("Sgd") && e.contains("optimizer state"), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fresh_optimizers_and_sgd_with_and_without_momentum_load_across_layouts() {
    let dir = common::temp_dir("dcp-adv-hops-sgd");
    // Saved before any step: AdamW without state, through every layout.
    hop::<AdamW>(&dir.join("fresh"), ADAMW, 0, HOPS);
    hop::<AdamW>(
        &dir.join("fresh-then-steps"),
        ADAMW,
        1,
        &[(Layout::Fsdp, 3), (Layout::Zero2, 2)],
    );
    let few = &[
        (Layout::Zero2, 3),
        (Layout::Fsdp, 5),
        (Layout::Ddp, 2),
        (Layout::One, 1),
        (Layout::Zero2, 4),
    ];
    hop::<Sgd>(&dir.join("momentum"), SGD, 1, few);
    hop::<Sgd>(&dir.join("plain"), PLAIN_SGD, 1, few);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// bf16 models.

#[test]
fn bf16_models_load_only_on_purpose_into_f32_and_back_bit_for_bit() {
    let dir = common::temp_dir("dcp-adv-bf16");
    let bf16 = dir.join("bf16");
    let saved = dir.join("bf16.safetensors");
    // A bf16 model under ZeRO-2 at 2 with Sgd's momentum after a step.
    spawn(2, |pg| {
        let (model, mut opt) = Model::new::<Sgd>(&pg, Layout::Zero2, 7, DType::BF16, SGD);
        model.train(&pg, &mut opt, 0..1);
        Checkpointer::for_group(&bf16, &pg, &Device::Cpu).save(&model.state_dict(&opt))?;
        model.save_whole(&opt, &saved);
        Ok(())
    })
    .unwrap();
    let index = Index::read(&bf16).unwrap();
    assert_eq!(index.dtype("l1.weight"), Some(DType::BF16));
    assert_eq!(
        index.dtype("optimizer.state.l1.weight.momentum_buffer"),
        Some(DType::BF16)
    );
    // Into f32 fully sharded at 3: refused on every rank without converting ...
    let errors = spawn(3, |pg| {
        let (model, mut opt) = Model::new::<Sgd>(&pg, Layout::Fsdp, 1, DType::F32, SGD);
        let c = Checkpointer::for_group(&bf16, &pg, &Device::Cpu);
        let r = model.load(&mut opt, &c, LoadOptions::default());
        Ok(r.err().map(|e| e.to_string()))
    })
    .unwrap();
    for e in errors {
        let e = e.expect("bf16 loaded into f32 without converting");
        assert!(e.contains("BF16") && e.contains("convert_dtypes"), "{e}");
    }
    // ... converted on purpose: the bf16 values exactly, then back into bf16 DDP at 1.
    let f32_dir = dir.join("f32");
    let converting = LoadOptions {
        convert_dtypes: true,
    };
    spawn(3, |pg| {
        let (model, mut opt) = Model::new::<Sgd>(&pg, Layout::Fsdp, 1, DType::F32, SGD);
        let c = Checkpointer::for_group(&bf16, &pg, &Device::Cpu);
        model.load(&mut opt, &c, converting)?;
        model.train(&pg, &mut opt, 0..1);
        Checkpointer::for_group(&f32_dir, &pg, &Device::Cpu).save(&model.state_dict(&opt))?;
        Ok(())
    })
    .unwrap();
    spawn(1, |pg| {
        let (model, mut opt) = Model::new::<Sgd>(&pg, Layout::One, 3, DType::BF16, SGD);
        // The bf16 save into a bf16 model in one process: bit for bit.
        let c = Checkpointer::new(&bf16);
        model.load(&mut opt, &c, LoadOptions::default())?;
        let back = dir.join("back.safetensors");
        model.save_whole(&opt, &back);
        assert_same_files(&back, &saved);
        // The f32 checkpoint into the bf16 model: refused, then converted.
        let c = Checkpointer::new(&f32_dir);
        let e = model
            .load(&mut opt, &c, LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("F32") && e.contains("convert_dtypes"), "{e}");
        model.load(&mut opt, &c, converting)?;
        assert_eq!(model.dtype(), DType::BF16);
        model.train(&pg, &mut opt, 1..2);
        Ok(())
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Tensor parallel with the data-parallel layouts.

/// A model with the tensor-parallel names: `fc1` cut by columns, `fc2` by rows, a packed `qkv`.
struct TpModel {
    vars: Vec<Tensor>,
}

fn tp_model(vb: VarBuilder) -> candle_core::Result<TpModel> {
    let shapes: [(&str, &[usize]); 5] = [
        ("fc1.weight", &[8, 4]),
        ("fc1.bias", &[8]),
        ("fc2.weight", &[4, 8]),
        ("fc2.bias", &[4]),
        ("qkv.weight", &[12, 4]),
    ];
    let vars = shapes
        .iter()
        .map(|(n, s)| vb.get_with_hints(*s, n, candle_nn::init::ZERO))
        .collect::<candle_core::Result<_>>()?;
    Ok(TpModel { vars })
}

impl Module for TpModel {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mut out = xs.clone();
        for v in &self.vars {
            out = out.broadcast_add(&v.sum_all()?)?;
        }
        Ok(out)
    }
}

/// The one-process values of the tensor-parallel model, distinct everywhere.
fn tp_whole() -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    let varmap = VarMap::new();
    tp_model(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    for (i, (n, v)) in varmap.data().lock().unwrap().iter().enumerate() {
        let t = Tensor::arange(0f32, v.elem_count() as f32, &Device::Cpu)
            .unwrap()
            .affine(0.01, i as f64)
            .unwrap()
            .reshape(v.dims())
            .unwrap();
        out.insert(n.clone(), t);
    }
    out
}

#[test]
fn tensor_parallel_loads_into_zero2_and_ddp_and_fully_sharded_into_tensor_parallel() {
    let dir = common::temp_dir("dcp-adv-tp");
    let plan = tp_plan();
    let whole = tp_whole();
    // Tensor parallel at 2 saves (a fresh optimizer: weights only).
    spawn(2, |tp| {
        let parts = plan.shard_all(whole.iter().map(|(n, t)| (n.as_str(), t)), &tp)?;
        let varmap = varmap_of(parts);
        let opt = Sgd::new(varmap.all_vars(), SGD)?;
        let mut c = Checkpointer::for_group(dir.join("tp"), &tp, &Device::Cpu);
        c.save(&plan.state_dict(&varmap, &opt, &tp)?)
    })
    .unwrap();
    // ZeRO-2 at 3 and plain DDP at 2 read the boxes as flat chunks and whole tensors.
    let config = |sharding| DdpConfig {
        bucket_cap_mb: 1e-4,
        first_bucket_mb: 1e-4,
        sharding,
        ..DdpConfig::default()
    };
    for (world, sharding) in [(3, Sharding::Zero2), (2, Sharding::None)] {
        spawn(world, |pg| {
            let varmap = VarMap::new();
            tp_model(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
            let ddp = DistributedDataParallel::with_config(
                &varmap,
                &pg,
                &Device::Cpu,
                config(sharding),
                tp_model,
            )?;
            let mut opt = Sgd::new(ddp.parameters(), SGD)?;
            let c = Checkpointer::for_group(dir.join("tp"), &pg, &Device::Cpu);
            ddp.load_state_dict(&mut opt, &c, LoadOptions::default())?;
            ddp.gather_parameters()?;
            for (n, v) in varmap.data().lock().unwrap().iter() {
                assert_eq!(bits(v.as_tensor()), bits(&whole[n]), "{n} at {world}");
            }
            // And saved again under ZeRO-2 / DDP, for tensor parallel at 4.
            let mut c = Checkpointer::for_group(dir.join(format!("dp{world}")), &pg, &Device::Cpu);
            c.save(&ddp.state_dict(&opt)?)
        })
        .unwrap();
    }
    // Fully sharded at 3 saves; tensor parallel at 4 and at 2 load each data-parallel save.
    spawn(3, |pg| {
        let f = FullyShardedDataParallel::with_config(
            &VarMap::new(),
            &pg,
            &Device::Cpu,
            FsdpConfig::default(),
            tp_model,
        )?;
        let c = Checkpointer::for_group(dir.join("dp3"), &pg, &Device::Cpu);
        let mut opt = Sgd::new(f.parameters(), SGD)?;
        f.load_state_dict(&mut opt, &c, LoadOptions::default())?;
        let mut out = Checkpointer::for_group(dir.join("fsdp"), &pg, &Device::Cpu);
        out.save(&f.state_dict(&opt)?)
    })
    .unwrap();
    for from in ["fsdp", "dp2"] {
        for world in [4, 2] {
            spawn(world, |tp| {
                let zeros = whole.iter().map(|(n, t)| (n.as_str(), t));
                let parts = plan.shard_all(zeros, &tp)?;
                let varmap =
                    varmap_of(parts.into_iter().map(|(n, t)| (n, t.zeros_like().unwrap())));
                let mut opt = Sgd::new(varmap.all_vars(), SGD)?;
                let c = Checkpointer::for_group(dir.join(from), &tp, &Device::Cpu);
                plan.load_state_dict(&c, &varmap, &mut opt, &tp, LoadOptions::default())?;
                for (n, v) in varmap.data().lock().unwrap().iter() {
                    let want = plan.shard(n, &whole[n], &tp)?;
                    assert_eq!(
                        bits(v.as_tensor()),
                        bits(&want),
                        "{n} from {from} at {world}"
                    );
                }
                Ok(())
            })
            .unwrap();
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Asynchronous saves.

#[test]
fn asynchronous_saves_mixed_repeated_dropped_and_with_evaluation_between() {
    let dir = common::temp_dir("dcp-adv-async");
    for world in [1, 3] {
        let sub = dir.join(format!("w{world}"));
        let at = |what: &str, rank: usize| sub.with_extension(format!("{what}-{rank}.safetensors"));
        spawn(world, |pg| {
            let (model, mut opt) = Model::new::<AdamW>(&pg, Layout::Zero2, 7, DType::F32, ADAMW);
            let mut c = Checkpointer::for_group(&sub, &pg, &Device::Cpu);
            let reload = |c: &Checkpointer, name: &str| {
                let (fresh, mut o) = Model::new::<AdamW>(&pg, Layout::Fsdp, 1, DType::F32, ADAMW);
                fresh.load(&mut o, c, LoadOptions::default()).unwrap();
                fresh.save_whole(&o, &at(name, pg.rank()));
            };
            // save_async, evaluation, then wait: the state of the save.
            model.train(&pg, &mut opt, 0..2);
            c.save_async(&model.state_dict(&opt))?;
            model.save_whole(&opt, &at("step2", pg.rank()));
            let before = model.evaluate(&pg);
            model.train(&pg, &mut opt, 2..3);
            assert_ne!(before, model.evaluate(&pg));
            c.wait()?;
            c.wait()?;
            reload(&c, "back2");
            // save_async then save: the synchronous one is the folder's.
            c.save_async(&model.state_dict(&opt))?;
            model.train(&pg, &mut opt, 3..4);
            c.save(&model.state_dict(&opt))?;
            model.save_whole(&opt, &at("step4", pg.rank()));
            c.wait()?;
            reload(&c, "back4");
            // Two asynchronous saves in a row: the second is the folder's.
            c.save_async(&model.state_dict(&opt))?;
            model.train(&pg, &mut opt, 4..5);
            c.save_async(&model.state_dict(&opt))?;
            model.save_whole(&opt, &at("step5", pg.rank()));
            model.train(&pg, &mut opt, 5..6);
            c.wait()?;
            reload(&c, "back5");
            // An asynchronous save, then the Checkpointer dropped: it still commits.
            c.save_async(&model.state_dict(&opt))?;
            model.save_whole(&opt, &at("step6", pg.rank()));
            model.train(&pg, &mut opt, 6..7);
            drop(c);
            let c = Checkpointer::for_group(&sub, &pg, &Device::Cpu);
            reload(&c, "back6");
            Ok(())
        })
        .unwrap();
        for step in [2, 4, 5, 6] {
            assert_same_files(
                &at(&format!("back{step}"), 0),
                &at(&format!("step{step}"), 0),
            );
        }
        let index = Index::read(&sub).unwrap();
        assert_eq!(listing(&sub).len(), index.files().count() + 1);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn loads_during_an_asynchronous_save_never_find_files_removed_under_them() {
    // A load while a save is in flight read the previous index while rank 0, committing the
    // new save, removed the previous save's files: "rank 1's file ... is missing", now and
    // then. Loads finish the save in flight first, and read the newest.
    let dir = common::temp_dir("dcp-adv-load-in-flight");
    let state = |step: f32| {
        let mut s = StateDict::new();
        for i in 0..8 {
            let t = Tensor::full(step, (64, 1024), &Device::Cpu).unwrap();
            s.insert(format!("w{i}"), ShardedTensor::whole(t));
        }
        s
    };
    spawn(2, |pg| {
        let mut c = Checkpointer::for_group(&dir, &pg, &Device::Cpu);
        c.save(&state(0.0))?;
        for step in 1..150 {
            c.save_async(&state(step as f32))?;
            for _ in 0..3 {
                let loaded = c.load(&state(0.0).wanted(), LoadOptions::default())?;
                let v = loaded.get("w7").unwrap().piece().unwrap().max_keepdim(0)?;
                assert_eq!(v.flatten_all()?.to_vec1::<f32>()?[0], step as f32);
            }
        }
        c.wait()
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One rank whose optimizer is not over the wrapper's parameters (misuse found only on that
/// rank) fails the load on every rank, at once: no rank waits for it in the load's collectives.
#[test]
fn an_optimizer_of_other_variables_on_one_rank_fails_the_load_on_every_rank() {
    let dir = common::temp_dir("dcp-misuse-one-rank");
    spawn(2, |pg| {
        let (model, opt) = Model::new::<AdamW>(&pg, Layout::Fsdp, 7, DType::F32, ADAMW);
        let mut c = Checkpointer::for_group(&dir, &pg, &Device::Cpu);
        c.save(&model.state_dict(&opt))?;
        for layout in [Layout::Ddp, Layout::Fsdp] {
            let (model, mut opt) = Model::new::<AdamW>(&pg, layout, 9, DType::F32, ADAMW);
            if pg.rank() == 1 {
                let stranger = Var::zeros(3, DType::F32, &Device::Cpu)?;
                opt = AdamW::new(vec![stranger], ADAMW)?;
            }
            let started = std::time::Instant::now();
            let err = model
                .load(&mut opt, &c, LoadOptions::default())
                .unwrap_err()
                .to_string();
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "rank {} waited {:?}",
                pg.rank(),
                started.elapsed()
            );
            match pg.rank() {
                1 => assert!(err.contains("[3]"), "{err}"),
                _ => assert!(err.contains("rank 1 failed"), "{err}"),
            }
        }
        Ok(())
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
