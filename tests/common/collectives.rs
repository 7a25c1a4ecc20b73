//! Checks every collective of a process group against values computed locally. Used by the
//! multi-process (TCP) and the in-process tests, so both backends meet one standard.

use super::as_f64;
use candle_core::{DType, Device, Tensor};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};

pub const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
pub const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

/// Rank `rank`'s input: small integers in [-4, 4], so sums and products are exact in every
/// dtype, bf16 included.
pub fn values(rank: usize, len: usize) -> Vec<f64> {
    (0..len)
        .map(|i| ((rank * 7 + i * 3) % 9) as f64 - 4.0)
        .collect()
}

pub fn input(rank: usize, shape: &[usize], dtype: DType) -> Tensor {
    let len = shape.iter().product();
    Tensor::from_vec(values(rank, len), shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn reduce(world: usize, len: usize, op: ReduceOp) -> Vec<f64> {
    let all: Vec<Vec<f64>> = (0..world).map(|r| values(r, len)).collect();
    (0..len)
        .map(|i| {
            let xs = all.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => xs.sum(),
                ReduceOp::Avg => xs.sum::<f64>() / world as f64,
                ReduceOp::Max => xs.fold(f64::MIN, f64::max),
                ReduceOp::Min => xs.fold(f64::MAX, f64::min),
                ReduceOp::Product => xs.product(),
            }
        })
        .collect()
}

fn assert_close(got: &Tensor, want: &[f64], tol: f64, what: &str) {
    let got = as_f64(got);
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}: element {i} is {g}, want {w}"
        );
    }
}

/// Runs every collective with every op and dtype and checks the numbers.
pub fn check_collectives(pg: &ProcessGroup) {
    let (rank, world) = (pg.rank(), pg.world_size());
    for dtype in DTYPES {
        let avg_tol = if matches!(dtype, DType::F16 | DType::BF16) {
            1e-2
        } else {
            1e-6
        };
        let mut shapes = vec![vec![5, 3], vec![1031]];
        if dtype == DType::F32 {
            shapes.push(vec![300_000]); // several pipelined segments per chunk
        }
        for shape in &shapes {
            let len: usize = shape.iter().product();
            let x = input(rank, shape, dtype);
            for op in OPS {
                let what = format!("all_reduce({op}) {dtype:?} {shape:?}");
                let y = pg.all_reduce(&x, op).unwrap();
                assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype), "{what}");
                let tol = if op == ReduceOp::Avg { avg_tol } else { 0.0 };
                assert_close(&y, &reduce(world, len, op), tol, &what);
            }
            for root in 0..world {
                let y = pg.broadcast(&x, root).unwrap();
                assert_close(
                    &y,
                    &values(root, len),
                    0.0,
                    &format!("broadcast {root} {dtype:?}"),
                );
            }
            let all = pg.all_gather(&x).unwrap();
            assert_eq!(all.len(), world);
            for (r, t) in all.iter().enumerate() {
                assert_eq!(t.dims(), x.dims());
                assert_close(
                    t,
                    &values(r, len),
                    0.0,
                    &format!("all_gather part {r} {dtype:?}"),
                );
            }
        }
        let x = input(rank, &[2 * world, 3], dtype);
        let y = pg.reduce_scatter(&x, ReduceOp::Sum).unwrap();
        assert_eq!(y.dims(), [2, 3]);
        let full = reduce(world, 6 * world, ReduceOp::Sum);
        assert_close(
            &y,
            &full[rank * 6..rank * 6 + 6],
            0.0,
            &format!("reduce_scatter {dtype:?}"),
        );
    }
    let a = input(rank, &[4], DType::F32);
    let b = input(rank + 1, &[2, 3], DType::F32);
    let many = pg.all_reduce_many(&[a, b], ReduceOp::Sum).unwrap();
    assert_eq!(many[1].dims(), [2, 3]);
    assert_close(
        &many[0],
        &reduce(world, 4, ReduceOp::Sum),
        0.0,
        "all_reduce_many 0",
    );
    let shifted: Vec<f64> = (0..6)
        .map(|i| (1..=world).map(|r| values(r, 6)[i]).sum())
        .collect();
    assert_close(&many[1], &shifted, 0.0, "all_reduce_many 1");
    pg.barrier().unwrap();
}

/// Checks that mismatched calls fail on every rank and that the group stays usable.
pub fn check_mismatches(pg: &ProcessGroup) {
    let rank = pg.rank();
    let shape: &[usize] = if rank == 1 { &[4, 2] } else { &[4, 3] };
    let err = pg
        .all_reduce(&input(rank, shape, DType::F32), ReduceOp::Sum)
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("mismatch") && msg.contains("[4, 2]") && msg.contains("[4, 3]"),
        "{msg}"
    );

    let dtype = if rank == 0 { DType::F64 } else { DType::F32 };
    let err = pg
        .all_reduce(&input(rank, &[3], dtype), ReduceOp::Sum)
        .unwrap_err();
    assert!(err.to_string().contains("f64"), "{err}");

    let op = if rank == 0 {
        ReduceOp::Max
    } else {
        ReduceOp::Sum
    };
    let err = pg
        .all_reduce(&input(rank, &[3], DType::F32), op)
        .unwrap_err();
    assert!(err.to_string().contains("all_reduce(max)"), "{err}");

    // A call that is invalid on one rank only (an integer tensor) fails everywhere too.
    let t = if rank == 0 {
        Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap()
    } else {
        input(rank, &[3], DType::F32)
    };
    let err = pg.all_reduce(&t, ReduceOp::Sum).unwrap_err();
    if rank == 0 {
        assert!(err.to_string().contains("U32"), "{err}");
    } else {
        assert!(err.to_string().contains("invalid on this rank"), "{err}");
    }

    // The group is still usable afterwards.
    let y = pg
        .all_reduce(&input(rank, &[3], DType::F32), ReduceOp::Sum)
        .unwrap();
    assert_close(
        &y,
        &reduce(pg.world_size(), 3, ReduceOp::Sum),
        0.0,
        "after mismatches",
    );
}

/// Collectives in flight together: several `_async` calls of different sizes waited in reverse
/// order, blocking calls interleaved (which run after the calls issued before them), and a
/// `Work` dropped without waiting.
pub fn check_async(pg: &ProcessGroup) {
    let (rank, world) = (pg.rank(), pg.world_size());
    let sizes = [1usize, 1031, 300_000, 7];
    let works: Vec<_> = sizes
        .iter()
        .map(|&n| {
            let x = input(rank, &[n], DType::F32);
            (n, pg.all_reduce_async(&x, ReduceOp::Sum).unwrap())
        })
        .collect();
    let gathered = pg.all_gather_async(&input(rank, &[3], DType::F64)).unwrap();
    // Dropped unwaited: it still runs, in its place, and breaks nothing.
    drop(
        pg.all_reduce_async(&input(rank, &[64], DType::F32), ReduceOp::Max)
            .unwrap(),
    );
    // A blocking call issued after the async ones runs after them.
    let root = world - 1;
    let b = pg.broadcast(&input(rank, &[5], DType::BF16), root).unwrap();
    assert_close(
        &b,
        &values(root, 5),
        0.0,
        "blocking broadcast among async calls",
    );
    for (n, w) in &works {
        assert!(
            w.is_completed(),
            "all_reduce of {n} issued before a finished blocking call"
        );
    }
    for (n, w) in works.into_iter().rev() {
        let y = w.wait().unwrap();
        assert_eq!(y.dims(), [n]);
        assert_close(
            &y,
            &reduce(world, n, ReduceOp::Sum),
            0.0,
            &format!("async all_reduce of {n}"),
        );
    }
    let parts = gathered.wait().unwrap();
    for (r, t) in parts.iter().enumerate() {
        assert_close(t, &values(r, 3), 0.0, "async all_gather");
    }
    let many = pg
        .all_reduce_many_async(
            &[
                input(rank, &[2], DType::F16),
                input(rank, &[3, 2], DType::F16),
            ],
            ReduceOp::Avg,
        )
        .unwrap();
    let barrier = pg.barrier_async().unwrap();
    let many = many.wait().unwrap();
    barrier.wait().unwrap();
    assert_close(
        &many[0],
        &reduce(world, 2, ReduceOp::Avg),
        1e-2,
        "async many 0",
    );
    assert_close(
        &many[1],
        &reduce(world, 6, ReduceOp::Avg),
        1e-2,
        "async many 1",
    );
    // An invalid call fails at once on this rank, and the group stays usable.
    let err = pg
        .broadcast_async(&input(rank, &[2], DType::F32), world)
        .unwrap_err();
    assert!(err.to_string().contains("not in the group"), "{err}");
    let y = pg
        .all_reduce(&input(rank, &[4], DType::F32), ReduceOp::Sum)
        .unwrap();
    assert_close(
        &y,
        &reduce(world, 4, ReduceOp::Sum),
        0.0,
        "after async calls",
    );
}

/// Rank `rank`'s values at the special positions of [`check_special_values`].
fn special(rank: usize, world: usize) -> Vec<f64> {
    let last = world - 1;
    let pick = |cond: bool, a: f64, b: f64| if cond { a } else { b };
    vec![
        pick(rank == 0, f64::NAN, 1.0),     // NaN on the first rank
        pick(rank == last, f64::NAN, -3.0), // NaN on the last rank
        f64::INFINITY,                      // +inf everywhere
        pick(
            rank == 0,
            f64::INFINITY,
            pick(rank == 1, f64::NEG_INFINITY, 2.0),
        ), // +inf and -inf
        -0.0,                               // -0 everywhere
        pick(rank == 0, -0.0, 0.0),         // -0 and +0
        1.375 * (rank + 1) as f64,          // exact non-integers
        -2.5 + rank as f64,                 // negative non-integers
        0.1 * (rank + 1) as f64,            // non-integers that round
        pick(rank == last, f64::NEG_INFINITY, 0.5), // -inf on the last rank
    ]
}

/// The rule every backend follows, folded in rank order in f64.
fn reference(op: ReduceOp, xs: &[f64]) -> f64 {
    let max = |a: f64, b: f64| {
        if a.is_nan() || b.is_nan() {
            f64::NAN
        } else if a == b {
            if a.is_sign_negative() {
                b
            } else {
                a
            }
        } else {
            a.max(b)
        }
    };
    let min = |a: f64, b: f64| {
        if a.is_nan() || b.is_nan() {
            f64::NAN
        } else if a == b {
            if a.is_sign_negative() {
                a
            } else {
                b
            }
        } else {
            a.min(b)
        }
    };
    let mut acc = xs[0];
    for &x in &xs[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + x,
            ReduceOp::Product => acc * x,
            ReduceOp::Max => max(acc, x),
            ReduceOp::Min => min(acc, x),
        };
    }
    if op == ReduceOp::Avg {
        acc / xs.len() as f64
    } else {
        acc
    }
}

/// NaN, infinities, signed zeros, integer-valued and non-integer values through every
/// reduction, in every dtype: every backend must give the same answer (NaN propagates, also
/// through `Max` and `Min`; `-0 < +0`).
pub fn check_special_values(pg: &ProcessGroup) {
    let (rank, world) = (pg.rank(), pg.world_size());
    let len = special(0, world).len();
    for dtype in DTYPES {
        // What each rank's values are once in this dtype.
        let all: Vec<Vec<f64>> = (0..world)
            .map(|r| {
                let t = Tensor::new(special(r, world), &Device::Cpu).unwrap();
                as_f64(&t.to_dtype(dtype).unwrap())
            })
            .collect();
        let x = Tensor::new(special(rank, world), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for op in OPS {
            let got = as_f64(&pg.all_reduce(&x, op).unwrap());
            for i in 0..len {
                let column: Vec<f64> = all.iter().map(|v| v[i]).collect();
                let want = reference(op, &column);
                let g = got[i];
                let what = format!("{op} {dtype:?} position {i} of {column:?}");
                if want.is_nan() {
                    assert!(g.is_nan(), "{what}: got {g}, want NaN");
                } else if want == 0.0 {
                    assert!(
                        g == 0.0 && g.is_sign_negative() == want.is_sign_negative(),
                        "{what}: got {g:?}, want {want:?}"
                    );
                } else if want.is_infinite() {
                    assert_eq!(g, want, "{what}");
                } else {
                    // Exact for the dyadic values; rounding for 0.1 and half-precision sums.
                    let tol = if matches!(dtype, DType::F16 | DType::BF16) {
                        1e-2
                    } else {
                        1e-6
                    };
                    assert!(
                        (g - want).abs() <= tol * want.abs().max(1.0),
                        "{what}: got {g}, want {want}"
                    );
                }
            }
        }
    }
}

/// `new_group`: a second group of the whole world used from another thread at the same time
/// as this one, a subset of the ranks (renumbered in list order) while the others do other
/// work, and invalid lists refused on every rank.
pub fn check_new_group(pg: &ProcessGroup) {
    let (rank, world) = (pg.rank(), pg.world_size());
    let everyone: Vec<usize> = (0..world).collect();
    let second = pg
        .new_group(&everyone)
        .unwrap()
        .expect("every rank is a member");
    assert_eq!((second.rank(), second.world_size()), (rank, world));
    std::thread::scope(|s| {
        let other = s.spawn(|| {
            for i in 0..20 {
                let x = input(rank + i, &[257], DType::F32);
                let y = second.all_reduce(&x, ReduceOp::Sum).unwrap();
                let want: Vec<f64> = (0..257)
                    .map(|k| (0..world).map(|r| values(r + i, 257)[k]).sum())
                    .collect();
                assert_close(&y, &want, 0.0, "second group, other thread");
            }
        });
        for i in 0..20 {
            let x = input(rank + 2 * i, &[31], DType::F64);
            let y = pg
                .all_reduce_async(&x, ReduceOp::Max)
                .unwrap()
                .wait()
                .unwrap();
            let want: Vec<f64> = (0..31)
                .map(|k| {
                    (0..world)
                        .map(|r| values(r + 2 * i, 31)[k])
                        .fold(f64::MIN, f64::max)
                })
                .collect();
            assert_close(&y, &want, 0.0, "first group, this thread");
        }
        other.join().unwrap();
    });
    // A subset, listed out of order: [0, 2] of three ranks, [1, 0] of two.
    let members: Vec<usize> = if world == 3 {
        vec![0, 2]
    } else {
        (0..world).rev().collect()
    };
    let sub = pg.new_group(&members).unwrap();
    match members.iter().position(|&m| m == rank) {
        Some(i) => {
            let sub = sub.expect("a member gets the group");
            assert_eq!((sub.rank(), sub.world_size()), (i, members.len()));
            let x = input(rank, &[9], DType::F32);
            let y = sub.all_reduce(&x, ReduceOp::Sum).unwrap();
            let want: Vec<f64> = (0..9)
                .map(|k| members.iter().map(|&m| values(m, 9)[k]).sum())
                .collect();
            assert_close(&y, &want, 0.0, "subset all_reduce");
            let from = sub.broadcast(&x, 0).unwrap();
            assert_close(
                &from,
                &values(members[0], 9),
                0.0,
                "subset broadcast from its rank 0",
            );
        }
        None => {
            assert!(sub.is_none(), "rank {rank} is not a member");
            // Other work meanwhile, on the parent group's thread of this process.
            let busy = Tensor::ones((256, 256), DType::F32, &Device::Cpu).unwrap();
            busy.matmul(&busy).unwrap();
        }
    }
    for bad in [vec![0, 0], vec![world], vec![]] {
        let err = pg.new_group(&bad).unwrap_err().to_string();
        assert!(err.contains("new_group"), "{bad:?}: {err}");
    }
    // The parent group still works for everyone.
    let y = pg
        .all_reduce(&input(rank, &[3], DType::F32), ReduceOp::Sum)
        .unwrap();
    assert_close(
        &y,
        &reduce(world, 3, ReduceOp::Sum),
        0.0,
        "parent after new_group",
    );
}
