//! Checks every collective of a process group against values computed locally. Used by the
//! multi-process (TCP) and the in-process tests, so both backends meet one standard.

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

fn as_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
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
