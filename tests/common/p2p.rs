//! Checks of point-to-point messages and all-to-all that run on any process group (threads or
//! processes), each rank computing what it should receive from what its peers sent.

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_parallel::distributed::{P2pOp, ProcessGroup, ReduceOp};
use candle_parallel::Error;

/// Every dtype a message carries.
pub const DTYPES: [DType; 9] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

/// Rank `rank`'s message number `k`: values that say who sent it and which it is, exactly
/// representable in every dtype (below 256).
pub fn message(rank: usize, k: usize, dims: &[usize], dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((rank * 37 + k * 11 + i * 3) % 251) as f32)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn assert_same(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(values(got), values(want), "{what}: values");
}

/// Messages around the ring, blocking, asynchronous and batched, in every dtype and odd shapes;
/// then a message between ranks 0 and 1 only, after which collectives of the whole group still
/// line up.
pub fn check_p2p(pg: &ProcessGroup) {
    let (me, n) = (pg.rank(), pg.world_size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    // Every dtype, a transposed (non-contiguous) view: the receiver gets the view's elements.
    for (k, dtype) in DTYPES.into_iter().enumerate() {
        let sent = message(me, k, &[5, 3], dtype).t().unwrap();
        let want = message(prev, k, &[5, 3], dtype).t().unwrap();
        // Even ranks send first, odd ones receive first: blocking calls in both orders.
        let got = if me % 2 == 0 {
            pg.send(&sent, next).unwrap();
            pg.recv(prev, (3, 5), dtype).unwrap()
        } else {
            let got = pg.recv(prev, (3, 5), dtype).unwrap();
            pg.send(&sent, next).unwrap();
            got
        };
        assert_same(&got, &want, &format!("{dtype:?} from rank {prev}"));
        assert!(got.device().is_cpu());
    }
    // Several messages in flight before the receiver looks: they arrive in order, whatever
    // their shapes, a scalar and an empty one among them.
    let shapes: [&[usize]; 4] = [&[], &[0, 4], &[7], &[2, 3, 4]];
    let sends: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(k, dims)| {
            pg.send_async(&message(me, 20 + k, dims, DType::F32), next)
                .unwrap()
        })
        .collect();
    for (k, dims) in shapes.iter().enumerate() {
        let got = pg.recv_as_sent(prev).unwrap();
        assert_same(&got, &message(prev, 20 + k, dims, DType::F32), "in flight");
    }
    for w in sends {
        w.wait().unwrap();
    }
    // Both directions with both neighbours in one batch, large enough to fill any buffer.
    let big = 3 << 20; // 12 MiB of f32
    let to_next = message(me, 30, &[big], DType::F32);
    let to_prev = message(me, 31, &[big], DType::F32);
    let got = pg
        .batch_isend_irecv(vec![
            P2pOp::send(&to_next, next),
            P2pOp::send(&to_prev, prev),
            P2pOp::recv(prev, big, DType::F32),
            P2pOp::recv(next, big, DType::F32),
        ])
        .unwrap()
        .wait()
        .unwrap();
    assert!(got[0].is_none() && got[1].is_none());
    assert_same(
        got[2].as_ref().unwrap(),
        &message(prev, 30, &[big], DType::F32),
        "batch from prev",
    );
    assert_same(
        got[3].as_ref().unwrap(),
        &message(next, 31, &[big], DType::F32),
        "batch from next",
    );
    // Ranks 0 and 1 talk; the others do not see it, and the next collective lines up.
    match me {
        0 => pg.send(&message(0, 40, &[4], DType::F32), 1).unwrap(),
        1 => {
            let got = pg.recv(0, 4, DType::F32).unwrap();
            assert_same(&got, &message(0, 40, &[4], DType::F32), "0 to 1");
        }
        _ => {}
    }
    let x = Tensor::new(&[me as f32], &Device::Cpu).unwrap();
    let sum = pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    assert_eq!(sum.to_vec1::<f32>().unwrap(), [(n * (n - 1) / 2) as f32]);
}

/// A receive that expects another shape or dtype fails naming both, and the message after it
/// still arrives whole. Needs two ranks or more; ranks 0 and 1 take part.
pub fn check_p2p_mismatch(pg: &ProcessGroup) {
    match pg.rank() {
        0 => {
            pg.send(&message(0, 50, &[2, 3], DType::F32), 1).unwrap();
            pg.send(&message(0, 51, &[4], DType::F16), 1).unwrap();
            pg.send(&message(0, 52, &[5], DType::I64), 1).unwrap();
        }
        1 => {
            let err = pg.recv(0, (3, 2), DType::F32).unwrap_err();
            assert!(
                matches!(
                    &err,
                    Error::P2pMismatch { sender: 0, receiver: 1, expected, sent, .. }
                        if expected == "f32 [3, 2]" && sent == "f32 [2, 3]"
                ),
                "{err}"
            );
            let err = pg.recv(0, 4, DType::F32).unwrap_err().to_string();
            assert!(err.contains("f32 [4]") && err.contains("f16 [4]"), "{err}");
            let got = pg.recv(0, 5, DType::I64).unwrap();
            assert_same(&got, &message(0, 52, &[5], DType::I64), "after mismatches");
        }
        _ => {}
    }
}

/// Misuse fails on the calling rank with a typed error, and issues nothing.
pub fn check_p2p_misuse(pg: &ProcessGroup) {
    let (me, n) = (pg.rank(), pg.world_size());
    let x = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    for bad in [me, n, n + 5] {
        let err = pg.send(&x, bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let err = pg.recv(bad, 2, DType::F32).unwrap_err();
        assert!(err.to_string().contains(&format!("rank {bad}")), "{err}");
    }
    let err = pg.all_to_all(&vec![x.clone(); n + 1]).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("one per rank of the group ({n})")),
        "{err}"
    );
    let err = pg
        .all_to_all_single(&x, &vec![1; n + 1], &vec![0; n])
        .unwrap_err();
    assert!(err.to_string().contains("input_splits"), "{err}");
    let err = pg
        .all_to_all_single(&x, &vec![3; n], &vec![0; n])
        .unwrap_err();
    assert!(err.to_string().contains("add up to"), "{err}");
    // Every rank called the same failing all_to_all: the group is still in step.
    pg.barrier().unwrap();
}

/// All-to-all with uneven and empty splits, as lists and as one tensor.
pub fn check_all_to_all(pg: &ProcessGroup) {
    let (me, n) = (pg.rank(), pg.world_size());
    // Rank r sends rank p a block of (r + 2p) % 3 rows: some empty, all different.
    let rows = |r: usize, p: usize| (r + 2 * p) % 3;
    let block = |r: usize, p: usize, dtype| message(r, 60 + p, &[rows(r, p), 4], dtype);
    for dtype in [DType::F32, DType::I64, DType::BF16] {
        let inputs: Vec<Tensor> = (0..n).map(|p| block(me, p, dtype)).collect();
        let got = pg.all_to_all(&inputs).unwrap();
        assert_eq!(got.len(), n);
        for (r, t) in got.iter().enumerate() {
            assert_same(
                t,
                &block(r, me, dtype),
                &format!("{dtype:?} block from rank {r}"),
            );
        }
    }
    let input = Tensor::cat(
        &(0..n).map(|p| block(me, p, DType::F32)).collect::<Vec<_>>(),
        0,
    )
    .unwrap();
    let in_splits: Vec<usize> = (0..n).map(|p| rows(me, p)).collect();
    let out_splits: Vec<usize> = (0..n).map(|r| rows(r, me)).collect();
    let got = pg
        .all_to_all_single(&input, &in_splits, &out_splits)
        .unwrap();
    let mut at = 0;
    for (r, &k) in out_splits.iter().enumerate() {
        assert_same(
            &got.i(at..at + k).unwrap(),
            &block(r, me, DType::F32),
            "single",
        );
        at += k;
    }
    assert_eq!(at, got.dim(0).unwrap());
    // Wrong output splits: named with both sides.
    if n > 1 {
        let mut wrong = out_splits.clone();
        let p = (me + 1) % n;
        wrong[p] += 1;
        let err = pg
            .all_to_all_single(&input, &in_splits, &wrong)
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("rank {me} expected")) && msg.contains(&format!("from rank {p}")),
            "{msg}"
        );
    }
}
