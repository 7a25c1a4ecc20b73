//! In-process groups: ranks as threads of this test.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::distributed::{self, Backend, InitConfig, ReduceOp};
use candle_parallel::Error;
use common::collectives::{
    check_async, check_collectives, check_mismatches, check_new_group, check_special_values,
};
use std::time::{Duration, Instant};

#[test]
fn every_collective_matches_local_values_for_1_to_4_thread_ranks() {
    for world in 1..=4 {
        let ranks = distributed::spawn_threads(world, |pg| {
            assert_eq!(pg.backend(), Backend::InProcess);
            check_collectives(&pg);
            Ok(pg.rank())
        })
        .unwrap();
        assert_eq!(ranks, (0..world).collect::<Vec<_>>());
    }
}

#[test]
fn mismatches_fail_on_every_thread_rank_and_the_group_recovers() {
    for world in [2, 3] {
        distributed::spawn_threads(world, |pg| {
            check_mismatches(&pg);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn a_rank_that_leaves_early_is_named_by_the_others() {
    let results = distributed::spawn_threads(3, |pg| {
        if pg.rank() == 2 {
            return Ok(None); // leaves without joining the all-reduce
        }
        let x = Tensor::new(&[1f32], &Device::Cpu)?;
        Ok(Some(
            pg.all_reduce(&x, ReduceOp::Sum).unwrap_err().to_string(),
        ))
    })
    .unwrap();
    for msg in results.iter().take(2) {
        let msg = msg.as_ref().unwrap();
        assert!(
            msg.contains("rank 2 was lost") && msg.contains("its closure returned"),
            "{msg}"
        );
    }
}

#[test]
fn a_panicking_rank_fails_the_spawn_and_releases_the_others() {
    let started = Instant::now();
    let err = distributed::spawn_threads(2, |pg| {
        if pg.rank() == 1 {
            panic!("rank 1 exploded");
        }
        pg.barrier()
    })
    .unwrap_err();
    assert!(matches!(err, Error::RankFailed { rank: 1, .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn closures_may_return_their_own_error_type_and_the_cause_still_wins() {
    // anyhow's `?` works inside; rank 1's own error is returned, not rank 0's report of losing
    // rank 1 (which arrives later and is, to spawn_threads, an opaque anyhow::Error too).
    let err = distributed::spawn_threads_with_error(2, |pg| -> anyhow::Result<u32> {
        if pg.rank() == 1 {
            let steps: u32 = "ten".parse()?;
            return Ok(steps);
        }
        pg.barrier()?; // fails only once rank 1 has left
        Ok(0)
    })
    .unwrap_err();
    assert!(err.is::<std::num::ParseIntError>(), "{err:#}");

    let values = distributed::spawn_threads_with_error(3, |pg| -> anyhow::Result<f32> {
        let x = Tensor::new(&[pg.rank() as f32], &Device::Cpu)?;
        Ok(pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0])
    })
    .unwrap();
    assert_eq!(values, [3.0, 3.0, 3.0]);

    // The group's own failures arrive converted: a panic, and a world size of 0.
    let err = distributed::spawn_threads_with_error(2, |pg| -> anyhow::Result<()> {
        if pg.rank() == 0 {
            panic!("rank 0 exploded");
        }
        Ok(pg.barrier()?)
    })
    .unwrap_err();
    let ours = err
        .downcast_ref::<Error>()
        .expect("a candle_parallel::Error");
    assert!(matches!(ours, Error::RankFailed { rank: 0, .. }), "{ours}");
    let err =
        distributed::spawn_threads_with_error(0, |_| -> anyhow::Result<()> { Ok(()) }).unwrap_err();
    assert!(err.to_string().contains("world size"), "{err}");
}

#[test]
fn a_late_rank_makes_the_wait_time_out_naming_the_call() {
    let options = InitConfig {
        timeout: Duration::from_millis(200),
        ..Default::default()
    };
    let results =
        distributed::spawn_threads_with_config(2, options, |pg| -> candle_parallel::Result<_> {
            if pg.rank() == 1 {
                std::thread::sleep(Duration::from_millis(800));
                return Ok(String::new());
            }
            Ok(pg.barrier().unwrap_err().to_string())
        })
        .unwrap();
    // The message names the call that waited, which the transport alone does not know.
    assert!(
        results[0].starts_with("timed out after 200ms") && results[0].ends_with("(barrier)"),
        "{}",
        results[0]
    );
}

#[test]
fn gradients_flow_through_the_differentiable_all_reduce() {
    // y = all_reduce(w_r * x_r) summed: d(sum_k c_k * y)/dw_r = x_r * all_reduce(c)_k summed.
    let grads = distributed::spawn_threads(3, |pg| {
        let r = pg.rank() as f64;
        let w = Var::new(&[1f64 + r, 2.0], &Device::Cpu)?;
        let x = Tensor::new(&[r + 1.0, 1.0], &Device::Cpu)?;
        let y = pg.all_reduce_differentiable(&(w.as_tensor() * &x)?, ReduceOp::Sum)?;
        let c = Tensor::new(&[r + 1.0, 10.0], &Device::Cpu)?; // a rank-dependent loss weight
        let loss = (y * c)?.sum_all()?;
        let grads = loss.backward()?;
        Ok(grads.get(&w).unwrap().to_vec1::<f64>()?)
    })
    .unwrap();
    // sum over ranks of c = [1+2+3, 30]; gradient of w_r = x_r * that.
    for (r, g) in grads.iter().enumerate() {
        assert_eq!(g, &[(r as f64 + 1.0) * 6.0, 30.0], "rank {r}");
    }
    let err = distributed::spawn_threads(1, |pg| {
        let x = Tensor::zeros(2, DType::F32, &Device::Cpu)?;
        pg.all_reduce_differentiable(&x, ReduceOp::Max).map(|_| ())
    })
    .unwrap_err();
    assert!(err.to_string().contains("use sum or avg"), "{err}");
}

#[test]
fn async_calls_in_flight_give_exact_results_for_1_to_4_thread_ranks() {
    for world in 1..=4 {
        distributed::spawn_threads(world, |pg| {
            check_async(&pg);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn nan_infinities_and_signed_zeros_follow_the_one_rule_for_1_to_3_thread_ranks() {
    for world in 1..=3 {
        distributed::spawn_threads(world, |pg| {
            check_special_values(&pg);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn new_groups_of_thread_ranks_run_beside_their_parent() {
    for world in [2, 3] {
        distributed::spawn_threads(world, |pg| {
            check_new_group(&pg);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn a_rank_that_leaves_while_an_async_call_is_in_flight_is_named_by_wait() {
    let results = distributed::spawn_threads(3, |pg| {
        let x = Tensor::ones(1000, DType::F32, &Device::Cpu)?;
        if pg.rank() == 1 {
            return Ok(None); // leaves without joining
        }
        let work = pg.all_reduce_async(&x, ReduceOp::Sum)?;
        Ok(Some(work.wait().unwrap_err()))
    })
    .unwrap();
    for err in results.into_iter().flatten() {
        assert!(matches!(err, Error::PeerLost { rank: 1, .. }), "{err}");
    }
}
