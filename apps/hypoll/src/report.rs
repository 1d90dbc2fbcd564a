//! The bench's outputs: the table, `--json` and `--plot`.

use std::io::Write;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use crate::alternate::Paired;
use crate::bench::{RunResult, Workload};

/// One row of `--json`.
#[derive(Serialize)]
pub struct JsonRow<'a> {
    pub policy: &'a str,
    pub device: String,
    /// The opened device's own description (io_uring: its completion mode).
    pub device_described: String,
    pub rw: String,
    /// `callback` or `async`.
    pub api: String,
    pub bs: u64,
    pub qd: usize,
    pub cores: usize,
    pub iops: f64,
    pub cpu_pct: f64,
    pub iops_per_cpu_pct: f64,
    pub lat_ns: JsonLatency,
    pub ios: u64,
    pub errors: u64,
    pub mismatches: u64,
    pub sleeps: u64,
    pub interrupt_waits: u64,
    /// Mean wake-up overshoot of the sleeps (actual minus requested), if any.
    pub overshoot_mean_ns: Option<u64>,
    /// Mean requested length of the sleeps, if any.
    pub sleep_mean_ns: Option<u64>,
    pub runs: usize,
    /// Under `--alternate`: the segment length, in ms; the row is this policy's turns.
    pub alternate_ms: Option<u64>,
    /// Under `--alternate`, on the second policy's row: its segments against the first
    /// policy's on either side, as the printed "run N" lines say.
    pub paired: Option<JsonPaired<'a>>,
}

/// The second policy against the first under `--alternate`.
#[derive(Serialize)]
pub struct JsonPaired<'a> {
    /// The first policy.
    pub against: &'a str,
    /// One per run (`--repeat`), `null` for a run where no comparison could be made.
    pub runs: Vec<Option<JsonPairedRun>>,
}

/// One run's comparison (see [`Paired`]).
#[derive(Serialize)]
pub struct JsonPairedRun {
    pub comparisons: usize,
    /// Mean latency over the first policy's (a geometric mean of the comparisons).
    pub latency_ratio: f64,
    /// Its standard error, in percent; `null` with too few comparisons to say.
    pub latency_se_pct: Option<f64>,
    /// CPU less the first policy's, in points of a core per reactor.
    pub cpu_points: f64,
    pub cpu_points_se: Option<f64>,
}

impl From<&Paired> for JsonPairedRun {
    fn from(p: &Paired) -> JsonPairedRun {
        JsonPairedRun {
            comparisons: p.comparisons,
            latency_ratio: p.latency_ratio,
            latency_se_pct: p.latency_log_se.map(|se| 100.0 * se.exp_m1()),
            cpu_points: p.cpu_points,
            cpu_points_se: p.cpu_points_se,
        }
    }
}

#[derive(Serialize)]
pub struct JsonLatency {
    pub mean: f64,
    pub p50: u64,
    pub p99: u64,
    pub p9999: u64,
    pub max: u64,
}

fn us(ns: f64) -> f64 {
    ns / 1_000.0
}

/// Prints one row per policy, with latency and CPU relative to `classic` when it ran.
pub fn print_table(
    out: &mut impl Write,
    work: &Workload,
    rows: &[RunResult],
) -> std::io::Result<()> {
    writeln!(
        out,
        "device {}  rw {}  bs {}  qd {}  cores {}  api {}  runtime {:?} (ramp {:?})",
        work.device_described,
        work.rw,
        work.bs_bytes,
        work.qd,
        work.cores,
        work.api,
        work.runtime,
        work.ramp
    )?;
    if let Some(segment) = work.alternate {
        writeln!(
            out,
            "the two policies take turns every {} ms in each run; each row is one policy's turns",
            segment.as_millis()
        )?;
    }
    writeln!(
        out,
        "{:<24} {:>10} {:>6} {:>10} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>7} {:>6}",
        "policy",
        "IOPS",
        "CPU%",
        "IOPS/CPU%",
        "mean_us",
        "p50_us",
        "p99_us",
        "p9999_us",
        "max_us",
        "lat/cl",
        "cpu/cl",
        "errors"
    )?;
    let classic = rows.iter().find(|r| r.policy == "classic");
    for r in rows {
        let rel = |v: f64, base: Option<f64>| match base {
            Some(b) if b > 0.0 => format!("{:.2}", v / b),
            _ => "-".to_string(),
        };
        writeln!(
            out,
            "{:<24} {:>10.0} {:>6.1} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>7} {:>7} {:>6}",
            r.policy,
            r.iops(),
            r.cpu_pct(),
            r.iops_per_cpu_pct(),
            us(r.mean_ns()),
            us(r.quantile_ns(0.5) as f64),
            us(r.quantile_ns(0.99) as f64),
            us(r.quantile_ns(0.9999) as f64),
            us(r.latency.max() as f64),
            rel(r.mean_ns(), classic.map(RunResult::mean_ns)),
            rel(r.cpu_pct(), classic.map(RunResult::cpu_pct)),
            r.errors + r.mismatches,
        )?;
    }
    Ok(())
}

/// Under `--alternate`: per run, the second policy against the first, segment by segment
/// (`shown_run` is the run the rows are from), and with several runs their mean.
pub fn print_paired(
    out: &mut impl Write,
    work: &Workload,
    rows: &[RunResult],
    paired: &[Option<Paired>],
    shown_run: usize,
) -> std::io::Result<()> {
    let (Some(segment), [first, second]) = (work.alternate, rows) else {
        return Ok(());
    };
    let (a, b) = (&first.policy, &second.policy);
    for (index, p) in paired.iter().enumerate() {
        let run = index + 1;
        let shown = if index == shown_run && paired.len() > 1 {
            " (the rows above)"
        } else {
            ""
        };
        let Some(p) = p else {
            writeln!(
                out,
                "run {run}{shown}: no whole segment of {b} had whole segments of {a} either \
                 side: no comparison"
            )?;
            continue;
        };
        let lat_se = p.latency_log_se.map_or(String::new(), |se| {
            format!(" (SE {:.1} %)", 100.0 * se.exp_m1())
        });
        let cpu_se = p
            .cpu_points_se
            .map_or(String::new(), |se| format!(" (SE {se:.1})"));
        writeln!(
            out,
            "run {run}{shown}: {b} against {a} on either side, {} segments of {} ms: mean \
             latency {:.3} x{lat_se}, CPU {:+.1} points{cpu_se}",
            p.comparisons,
            segment.as_millis(),
            p.latency_ratio,
            p.cpu_points,
        )?;
    }
    let done: Vec<&Paired> = paired.iter().flatten().collect();
    if done.len() >= 2 {
        let logs: Vec<f64> = done.iter().map(|p| p.latency_ratio.ln()).collect();
        let cpus: Vec<f64> = done.iter().map(|p| p.cpu_points).collect();
        let (log_mean, log_se) = mean_and_se(&logs);
        let (cpu_mean, cpu_se) = mean_and_se(&cpus);
        writeln!(
            out,
            "over {} runs: {b} against {a}: mean latency {:.3} x (SE between runs {:.1} %), \
             CPU {cpu_mean:+.1} points (SE {cpu_se:.1})",
            done.len(),
            log_mean.exp(),
            100.0 * log_se.exp_m1(),
        )?;
    }
    Ok(())
}

/// The mean of at least two values and its standard error.
fn mean_and_se(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// The `--json` rows; `paired` is `--alternate`'s comparison per run (empty without it).
pub fn json_rows<'a>(
    work: &Workload,
    rows: &'a [RunResult],
    runs: usize,
    paired: &[Option<Paired>],
) -> Vec<JsonRow<'a>> {
    rows.iter()
        .enumerate()
        .map(|(index, r)| JsonRow {
            policy: &r.policy,
            device: work.device.to_string(),
            device_described: work.device_described.clone(),
            rw: work.rw.to_string(),
            api: work.api.to_string(),
            bs: work.bs_bytes,
            qd: work.qd,
            cores: r.cores,
            iops: r.iops(),
            cpu_pct: r.cpu_pct(),
            iops_per_cpu_pct: r.iops_per_cpu_pct(),
            lat_ns: JsonLatency {
                mean: r.mean_ns(),
                p50: r.quantile_ns(0.5),
                p99: r.quantile_ns(0.99),
                p9999: r.quantile_ns(0.9999),
                max: r.latency.max(),
            },
            ios: r.ios,
            errors: r.errors,
            mismatches: r.mismatches,
            sleeps: r.sleeps,
            interrupt_waits: r.interrupt_waits,
            overshoot_mean_ns: (r.sleeps > 0).then(|| r.overshoot_ns / r.sleeps),
            sleep_mean_ns: (r.sleeps > 0).then(|| r.slept_ns / r.sleeps),
            runs,
            alternate_ms: work
                .alternate
                .map(|segment| u64::try_from(segment.as_millis()).unwrap_or(u64::MAX)),
            paired: (work.alternate.is_some() && index == 1 && rows.len() == 2).then(|| {
                JsonPaired {
                    against: &rows[0].policy,
                    runs: paired.iter().map(|p| p.as_ref().map(Into::into)).collect(),
                }
            }),
        })
        .collect()
}

pub fn write_json(
    path: &Path,
    work: &Workload,
    rows: &[RunResult],
    runs: usize,
    paired: &[Option<Paired>],
) -> Result<(), String> {
    let text = serde_json::to_string_pretty(&json_rows(work, rows, runs, paired))
        .map_err(|e| format!("encoding JSON: {e}"))?;
    std::fs::write(path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Mean latency against CPU %, one labelled point per policy.
pub fn write_plot(path: &Path, work: &Workload, rows: &[RunResult]) -> Result<(), String> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let cpu_max = rows
            .iter()
            .map(RunResult::cpu_pct)
            .fold(0.0, f64::max)
            .max(1.0)
            * 1.1;
        let lat_max = rows
            .iter()
            .map(|r| us(r.mean_ns()))
            .fold(0.0, f64::max)
            .max(1.0)
            * 1.15;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "{} {} bs {} qd {}",
                    work.device, work.rw, work.bs_bytes, work.qd
                ),
                ("sans-serif", 20),
            )
            .margin(20)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..cpu_max, 0.0..lat_max)?;
        chart
            .configure_mesh()
            .x_desc("CPU % per core")
            .y_desc("mean latency (us)")
            .draw()?;
        chart.draw_series(rows.iter().map(|r| {
            let at = (r.cpu_pct(), us(r.mean_ns()));
            EmptyElement::at(at)
                + Circle::new((0, 0), 4, BLUE.filled())
                + Text::new(r.policy.clone(), (6, -14), ("sans-serif", 13))
        }))?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| format!("drawing {}: {e}", path.display()))
}
