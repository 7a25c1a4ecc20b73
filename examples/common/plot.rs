//! The charts the benches and examples draw with `--plot FILE.svg`: images/s against devices or
//! processes beside the ideal linear line (`benches/dp_throughput.rs`,
//! `benches/ddp_throughput.rs`), loss and accuracy per epoch (`examples/cifar_dp.rs`,
//! `examples/cifar_ddp.rs`), training losses per step of several runs on one chart
//! (`benches/largest_model.rs`), and a pipeline's schedule, stages by time
//! (`examples/transformer_pp.rs`).
//!
//! Drawn with plotters' SVG backend, which writes text as `<text>` elements for the viewer to
//! render: no font files or fontconfig are needed to draw. Included by `#[path]` from each
//! bench and example, so each uses only a part of it.

#![allow(dead_code)]

use anyhow::{ensure, Context, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordu32;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

/// One measured line: `points` are (devices or processes, images/s).
#[derive(Clone, Debug)]
pub struct Series {
    /// The legend's name, e.g. "batch 128" or "net".
    pub name: String,
    pub points: Vec<(u32, f64)>,
}

/// What a scaling chart shows: `series` against `x_label` ("devices", "processes").
pub struct Scaling<'a> {
    pub title: &'a str,
    /// The machine and the setup, e.g. "CPU replicas on 2 cores (AMD EPYC 7B13)".
    pub subtitle: &'a str,
    pub x_label: &'a str,
    pub series: &'a [Series],
}

/// One training run's loss per step, for [`loss_chart`].
#[derive(Clone, Debug)]
pub struct LossCurve {
    /// The legend's name, e.g. "ours, bf16 + checkpointing + fully sharded".
    pub name: String,
    /// The loss at each step, from step 1.
    pub losses: Vec<f64>,
    /// The colour's index: runs to compare take one colour, one solid and one dashed.
    pub colour: usize,
    /// Drawn dashed (and so in the legend): the second of a pair that shares a colour.
    pub dashed: bool,
}

/// One epoch of a training run.
#[derive(Clone, Copy, Debug)]
pub struct Epoch {
    pub epoch: usize,
    /// The training loss averaged over the epoch's images.
    pub train_loss: f64,
    /// The average loss over the test set after the epoch.
    pub test_loss: f64,
    /// The test accuracy after the epoch, in percent.
    pub test_accuracy: f64,
}

// plotters writes a font size as 1/1.24 of the size given: these come out at 21, 15 and 15 px.
const TITLE: (&str, u32) = ("sans-serif", 26);
const SUBTITLE: (&str, u32) = ("sans-serif", 18);
const LABELS: (&str, u32) = ("sans-serif", 18);

/// Fails, naming `path`, when the chart could not be written there: checked before a run, so
/// a mistyped folder does not cost the run.
pub fn check_path(path: &Path) -> Result<()> {
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    ensure!(
        folder.is_dir(),
        "cannot write the chart to {}: the folder {} does not exist",
        path.display(),
        folder.display()
    );
    ensure!(
        !path.is_dir(),
        "cannot write the chart to {}: it is a folder; give a file name such as {}",
        path.display(),
        path.join("chart.svg").display()
    );
    Ok(())
}

/// The CPU in words: "2 cores (AMD EPYC 7B13)", or "2 cores" where its model is unknown.
pub fn cpu_description() -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| {
                    m.replace("(R)", "")
                        .replace("(TM)", "")
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .join(" ")
                })
        })
        .filter(|m| !m.is_empty());
    let cores = format!("{cores} core{}", if cores == 1 { "" } else { "s" });
    match model {
        Some(model) => format!("{cores} ({model})"),
        None => cores,
    }
}

/// GPU 0's name as `nvidia-smi` reports it, or "GPU" where it cannot be asked.
pub fn gpu_name() -> String {
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader", "--id=0"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "GPU".to_string())
}

/// Writes `svg` to `path`, naming the path on failure.
fn write(path: &Path, svg: String) -> Result<()> {
    std::fs::write(path, svg).with_context(|| format!("writing the chart to {}", path.display()))
}

/// Draws `title` and the lines of `subtitle` centred at the top of `root` and returns the area
/// below them.
fn heading<'a>(
    root: &DrawingArea<SVGBackend<'a>, Shift>,
    title: &str,
    subtitle: &str,
) -> Result<DrawingArea<SVGBackend<'a>, Shift>> {
    root.fill(&WHITE)?;
    let (width, _) = root.dim_in_pixel();
    let centre = Pos::new(HPos::Center, VPos::Top);
    let x = width as i32 / 2;
    root.draw(&Text::new(
        title.to_string(),
        (x, 12),
        TextStyle::from(TITLE.into_font()).pos(centre),
    ))?;
    let mut y = 42;
    for line in subtitle.lines() {
        root.draw(&Text::new(
            line.to_string(),
            (x, y),
            TextStyle::from(SUBTITLE.into_font())
                .color(&RGBColor(80, 80, 80))
                .pos(centre),
        ))?;
        y += 20;
    }
    Ok(root.split_vertically(y + 8).1)
}

/// The images/s of `series` against the device or process count, each beside its ideal
/// linear line (its images/s at the smallest count, times the count over that count, dashed,
/// in the same colour), with each later point labelled by its share of the ideal. The y axis
/// is logarithmic when the lines differ by more than 20x (models of very different speed).
pub fn scaling_chart(path: &Path, chart: &Scaling) -> Result<()> {
    let points = || chart.series.iter().flat_map(|s| s.points.iter());
    ensure!(
        points().next().is_some(),
        "no measurements to chart in {}",
        path.display()
    );
    ensure!(
        points().all(|&(n, rate)| n > 0 && rate.is_finite() && rate > 0.0),
        "a device count of 0 or an images/s that is not positive in {:?}",
        chart.series
    );
    let max_n = points().map(|p| p.0).max().unwrap_or(1);
    let ideal: Vec<Vec<(u32, f64)>> = chart.series.iter().map(|s| ideal_line(s, max_n)).collect();
    let all = || points().chain(ideal.iter().flatten());
    let lo = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let hi = all().map(|p| p.1).fold(0f64, f64::max);
    let mut counts: Vec<u32> = points().map(|p| p.0).collect();
    counts.sort_unstable();
    counts.dedup();
    // One step of room either side, so no point sits on the frame.
    let x = (0..max_n + 1).with_key_points(counts);

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 600)).into_drawing_area();
        let area = heading(&root, chart.title, chart.subtitle)?;
        let (plot, key) = area.split_horizontally(690);
        if hi / lo > 20.0 {
            let y = (lo / 1.5..hi * 1.5).log_scale();
            draw_scaling(&plot, x, (y, "images/s (log scale)"), chart, &ideal)?;
        } else {
            draw_scaling(&plot, x, (0.0..hi * 1.1, "images/s"), chart, &ideal)?;
        }
        let mut entries: Vec<Entry> = chart
            .series
            .iter()
            .enumerate()
            .map(|(i, s)| Entry::line(&s.name, colour(i)))
            .collect();
        let grey = RGBColor(90, 90, 90).to_rgba();
        entries.push(Entry {
            name: "ideal (linear) of each".into(),
            colour: grey,
            mark: Mark::Dashed,
        });
        entries.push(Entry {
            name: "n%: share of the ideal".into(),
            colour: grey,
            mark: Mark::None,
        });
        legend(&key.margin(20, 0, 0, 0), &entries)?;
        root.present()?;
    }
    write(path, svg)
}

/// The ideal linear line of `s`: its images/s at its smallest count, scaled to each count up
/// to `max_n`.
fn ideal_line(s: &Series, max_n: u32) -> Vec<(u32, f64)> {
    let base = s.points.iter().min_by_key(|p| p.0).copied();
    base.map_or_else(Vec::new, |(n0, rate0)| {
        (n0..=max_n)
            .map(|n| (n, rate0 * f64::from(n) / f64::from(n0)))
            .collect()
    })
}

/// The colour of the `i`th line: Tableau's ten, which read apart on white and in print.
fn colour(i: usize) -> RGBAColor {
    const TEN: [(u8, u8, u8); 10] = [
        (31, 119, 180),
        (255, 127, 14),
        (44, 160, 44),
        (214, 39, 40),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (188, 189, 34),
        (23, 190, 207),
    ];
    let (r, g, b) = TEN[i % TEN.len()];
    RGBColor(r, g, b).to_rgba()
}

fn draw_scaling<Y>(
    area: &DrawingArea<SVGBackend, Shift>,
    x: WithKeyPointsU32,
    (y, y_label): (Y, &str),
    chart: &Scaling,
    ideal: &[Vec<(u32, f64)>],
) -> Result<()>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut c = ChartBuilder::on(area)
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)?;
    c.configure_mesh()
        .x_desc(chart.x_label)
        .y_desc(y_label)
        .axis_desc_style(LABELS)
        .label_style(LABELS)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(TRANSPARENT)
        .draw()?;
    for (i, (s, ideal)) in chart.series.iter().zip(ideal).enumerate() {
        let colour = colour(i);
        c.draw_series(DashedLineSeries::new(
            ideal.iter().copied(),
            8,
            6,
            colour.stroke_width(2),
        ))?;
        let mut points = s.points.clone();
        points.sort_by_key(|p| p.0);
        c.draw_series(LineSeries::new(
            points.iter().copied(),
            colour.stroke_width(3),
        ))?;
        c.draw_series(points.iter().map(|&p| Circle::new(p, 5, colour.filled())))?;
    }
    share_labels(&c, chart)
}

/// Labels each point after a series' first with its share of the series' ideal, to the right
/// of the point; labels that would overlap at one count are moved apart.
fn share_labels<X, Y>(
    c: &ChartContext<SVGBackend, Cartesian2d<X, Y>>,
    chart: &Scaling,
) -> Result<()>
where
    X: Ranged<ValueType = u32>,
    Y: Ranged<ValueType = f64>,
{
    let area = c.plotting_area().strip_coord_spec();
    let (x0, y0) = area.get_base_pixel();
    // (pixel x, pixel y, label, colour) of every labelled point, in the plotting area.
    let mut labels = Vec::new();
    for (i, s) in chart.series.iter().enumerate() {
        let mut points = s.points.clone();
        points.sort_by_key(|p| p.0);
        let (n0, rate0) = points[0];
        for &(n, rate) in &points[1..] {
            let share = rate / (rate0 * f64::from(n) / f64::from(n0));
            let (x, y) = c.backend_coord(&(n, rate));
            labels.push((x - x0, y - y0, format!("{:.0}%", 100.0 * share), colour(i)));
        }
    }
    labels.sort_by_key(|l| (l.0, l.1));
    const LINE: i32 = 20;
    let mut below = (i32::MIN, i32::MIN);
    for (x, y, text, colour) in labels {
        let y = if x == below.0 {
            y.max(below.1 + LINE)
        } else {
            y
        };
        below = (x, y);
        area.draw(&Text::new(
            text,
            (x + 10, y),
            TextStyle::from(LABELS.into_font())
                .color(&colour)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    Ok(())
}

type WithKeyPointsU32 = plotters::coord::combinators::WithKeyPoints<RangedCoordu32>;

/// A line of a legend.
struct Entry {
    name: String,
    colour: RGBAColor,
    mark: Mark,
}

/// What a legend entry shows before its name.
enum Mark {
    Solid,
    Dashed,
    /// Nothing: the entry is a note.
    None,
}

impl Entry {
    fn line(name: &str, colour: RGBAColor) -> Self {
        Self {
            name: name.to_string(),
            colour,
            mark: Mark::Solid,
        }
    }
}

/// Draws `entries` one under the other in `area`, beside the plot rather than over its lines.
fn legend(area: &DrawingArea<SVGBackend, Shift>, entries: &[Entry]) -> Result<()> {
    let left = Pos::new(HPos::Left, VPos::Center);
    for (i, e) in entries.iter().enumerate() {
        let y = 30 + 26 * i as i32;
        let style = e.colour.stroke_width(3);
        let line = vec![(0, y), (34, y)];
        match e.mark {
            Mark::Solid => area.draw(&PathElement::new(line, style))?,
            Mark::Dashed => area.draw(&DashedPathElement::new(line, 8, 5, style))?,
            Mark::None => {}
        }
        let x = if matches!(e.mark, Mark::None) { 0 } else { 44 };
        area.draw(&Text::new(
            e.name.clone(),
            (x, y),
            TextStyle::from(LABELS.into_font()).pos(left),
        ))?;
    }
    Ok(())
}

/// Two panels against the epoch: the training loss (averaged over each epoch) and the test
/// loss on the left, the test accuracy on the right.
pub fn training_chart(path: &Path, title: &str, subtitle: &str, epochs: &[Epoch]) -> Result<()> {
    ensure!(
        !epochs.is_empty(),
        "no epochs to chart in {}",
        path.display()
    );
    let last = epochs.iter().map(|e| e.epoch).max().unwrap_or(1) as u32;
    let x = || (0..last + 1).with_key_points(epochs.iter().map(|e| e.epoch as u32).collect());
    let max_loss = epochs
        .iter()
        .flat_map(|e| [e.train_loss, e.test_loss])
        .filter(|l| l.is_finite())
        .fold(0f64, f64::max)
        .max(1e-3);

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 540)).into_drawing_area();
        let area = heading(&root, title, subtitle)?;
        let (left, right) = area.split_horizontally(500);
        let loss: [Line; 2] = [
            ("training loss (mean over the epoch)", |e| e.train_loss),
            ("test loss", |e| e.test_loss),
        ];
        let loss_axis = Axis {
            range: 0.0..max_loss * 1.1,
            label: "loss",
            decimals: 2,
        };
        panel(&left, x(), loss_axis, &loss, 0, epochs)?;
        let accuracy: [Line; 1] = [("test accuracy", |e| e.test_accuracy)];
        let accuracy_axis = Axis {
            range: 0.0..100.0,
            label: "accuracy (%)",
            decimals: 0,
        };
        panel(&right, x(), accuracy_axis, &accuracy, 2, epochs)?;
        root.present()?;
    }
    write(path, svg)
}

/// The loss of each of `curves` against the step, on a logarithmic axis (a loss that falls from
/// 2 to 0.001 shows its whole course), the legend below.
pub fn loss_chart(path: &Path, title: &str, subtitle: &str, curves: &[LossCurve]) -> Result<()> {
    let values = || curves.iter().flat_map(|c| c.losses.iter().copied());
    ensure!(
        values().any(|v| v.is_finite() && v > 0.0),
        "no positive finite loss to chart in {}",
        path.display()
    );
    let lo = values()
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold(f64::INFINITY, f64::min);
    let hi = values().filter(|v| v.is_finite()).fold(0f64, f64::max);
    let steps = curves.iter().map(|c| c.losses.len()).max().unwrap_or(1) as u32;
    let mut svg = String::new();
    {
        let height = 560 + 26 * curves.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (1000, height)).into_drawing_area();
        let area = heading(&root, title, subtitle)?;
        let (plot, key) =
            area.split_vertically(area.dim_in_pixel().1 - 30 - 26 * curves.len() as u32);
        let mut c = ChartBuilder::on(&plot)
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(80)
            // From a power of ten: plotters labels a log axis from the first power of ten in
            // its range, so a range from 0.2 would show no label below 1.
            .build_cartesian_2d(
                1..steps + 1,
                (floor_power_of_ten(lo / 1.5)..hi * 1.5).log_scale(),
            )?;
        c.configure_mesh()
            .x_desc("step")
            .y_desc("training loss (log scale)")
            .axis_desc_style(LABELS)
            .label_style(LABELS)
            .y_label_formatter(&|v| {
                // As many decimals as the value's first significant digit needs: 0.03, 0.2, 3.
                let decimals = (-v.log10().floor()).max(0.0) as usize;
                format!("{v:.decimals$}")
            })
            .light_line_style(TRANSPARENT)
            .draw()?;
        let mut entries = Vec::new();
        for curve in curves {
            let colour = colour(curve.colour);
            // A step whose loss was not finite (or 0) leaves a gap rather than a spike.
            let points: Vec<(u32, f64)> = (1..)
                .zip(curve.losses.iter().copied())
                .filter(|p| p.1.is_finite() && p.1 > 0.0)
                .collect();
            let style = colour.stroke_width(2);
            if curve.dashed {
                c.draw_series(DashedLineSeries::new(points, 8, 5, style))?;
            } else {
                c.draw_series(LineSeries::new(points, style))?;
            }
            entries.push(Entry {
                name: curve.name.clone(),
                colour,
                mark: if curve.dashed {
                    Mark::Dashed
                } else {
                    Mark::Solid
                },
            });
        }
        legend(&key.margin(-20, 0, 100, 0), &entries)?;
        root.present()?;
    }
    write(path, svg)
}

/// A hair below the largest power of ten not above `v` (positive): plotters takes the ceiling
/// of the start's logarithm, and `log10(0.1)` may come out a hair above -1 (the ceiling: 0).
fn floor_power_of_ten(v: f64) -> f64 {
    10f64.powf(v.log10().floor()) * 0.999
}

/// A line of a panel of the training chart: its name and the value it takes from an epoch.
type Line = (&'static str, fn(&Epoch) -> f64);

/// The y axis of a panel of the training chart.
struct Axis {
    range: std::ops::Range<f64>,
    label: &'static str,
    /// Decimals of its tick labels.
    decimals: usize,
}

/// One panel of the training chart: each of `lines` against the epoch, in colours from
/// `first_colour` on, and their legend below.
fn panel(
    area: &DrawingArea<SVGBackend, Shift>,
    x: WithKeyPointsU32,
    y: Axis,
    lines: &[Line],
    first_colour: usize,
    epochs: &[Epoch],
) -> Result<()> {
    let (plot, key) = area.split_vertically(area.dim_in_pixel().1 - 60);
    let mut c = ChartBuilder::on(&plot)
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d(x, y.range)?;
    c.configure_mesh()
        .x_desc("epoch")
        .y_desc(y.label)
        .axis_desc_style(LABELS)
        .label_style(LABELS)
        .y_label_formatter(&|v| format!("{v:.*}", y.decimals))
        .light_line_style(TRANSPARENT)
        .draw()?;
    let mut entries = Vec::new();
    for (i, (name, value)) in lines.iter().enumerate() {
        let colour = colour(first_colour + i);
        // A resumed run's first epoch may have had no step left: no training loss.
        let points: Vec<(u32, f64)> = epochs
            .iter()
            .map(|e| (e.epoch as u32, value(e)))
            .filter(|p| p.1.is_finite())
            .collect();
        c.draw_series(LineSeries::new(
            points.iter().copied(),
            colour.stroke_width(3),
        ))?;
        c.draw_series(points.iter().map(|&p| Circle::new(p, 5, colour.filled())))?;
        entries.push(Entry::line(name, colour));
    }
    // The legend sits under the x axis's label, lined up with the plot.
    legend(&key.margin(-20, 0, 80, 0), &entries)
}

/// One computation of a pipeline step, for [`schedule_chart`].
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// The row: the pipeline rank that ran it.
    pub rank: usize,
    /// A forward (drawn in the first colour) or a backward (the second).
    pub forward: bool,
    /// The micro-batch, written in the box.
    pub microbatch: usize,
    /// When it started and ended, in milliseconds from the step's start.
    pub start_ms: f64,
    pub end_ms: f64,
}

/// A pipeline step as a chart of ranks (rows, rank 0 at the top) by time: a box per forward
/// and backward, with its micro-batch, and the white between them the bubble.
pub fn schedule_chart(path: &Path, title: &str, subtitle: &str, spans: &[Span]) -> Result<()> {
    ensure!(
        !spans.is_empty(),
        "no computation to chart in {}",
        path.display()
    );
    let ranks = spans.iter().map(|s| s.rank).max().unwrap_or(0) + 1;
    let end = spans.iter().map(|s| s.end_ms).fold(0f64, f64::max);
    let mut svg = String::new();
    {
        let height = 260 + 70 * ranks as u32;
        let root = SVGBackend::with_string(&mut svg, (1000, height)).into_drawing_area();
        let area = heading(&root, title, subtitle)?;
        let (plot, key) = area.split_vertically(area.dim_in_pixel().1 - 80);
        let mut c = ChartBuilder::on(&plot)
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(0f64..end * 1.02, (ranks as f64 - 0.5)..-0.5f64)?;
        c.configure_mesh()
            .x_desc("time in the step (ms)")
            .y_desc("pipeline rank")
            .axis_desc_style(LABELS)
            .label_style(LABELS)
            .y_labels(ranks)
            // Rows sit at whole numbers; a tick between them stays unlabelled.
            .y_label_formatter(&|v| match (v - v.round()).abs() < 1e-9 {
                true => format!("{}", v.round()),
                false => String::new(),
            })
            .disable_x_mesh()
            .light_line_style(TRANSPARENT)
            .draw()?;
        let centre = Pos::new(HPos::Center, VPos::Center);
        for s in spans {
            let fill = colour(usize::from(!s.forward));
            let (top, bottom) = (s.rank as f64 - 0.4, s.rank as f64 + 0.4);
            c.draw_series(std::iter::once(Rectangle::new(
                [(s.start_ms, top), (s.end_ms, bottom)],
                fill.filled(),
            )))?;
            c.draw_series(std::iter::once(Rectangle::new(
                [(s.start_ms, top), (s.end_ms, bottom)],
                WHITE.stroke_width(1),
            )))?;
            c.draw_series(std::iter::once(Text::new(
                s.microbatch.to_string(),
                ((s.start_ms + s.end_ms) / 2.0, s.rank as f64),
                LABELS.into_font().color(&WHITE).pos(centre),
            )))?;
        }
        let entries = [
            Entry::line("forward (micro-batch in the box)", colour(0)),
            Entry::line("backward", colour(1)),
        ];
        legend(&key.margin(-20, 0, 100, 0), &entries)?;
        root.present()?;
    }
    write(path, svg)
}
