//! The phase benches' timing: medians of repeated runs after a warm-up.

use anyhow::Result;
use std::time::Instant;

/// The median of `xs` (the upper one of an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The median seconds of `steps` runs of `f`, after 3 warm-up runs.
pub fn time(steps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut t = Vec::with_capacity(steps);
    for _ in 0..steps {
        let started = Instant::now();
        f()?;
        t.push(started.elapsed().as_secs_f64());
    }
    Ok(median(t))
}
