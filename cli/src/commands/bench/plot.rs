//! The scaling table drawn as an SVG: seconds per step against sequence length, log-log, a
//! stateless and a stateful line per backend with their roofline floors beside them.

use std::path::Path;

use anyhow::{bail, Context};
use plotters::prelude::*;
use serde_json::Value;

/// One line of the plot.
struct Series {
    label: String,
    points: Vec<(f64, f64)>,
    color: RGBColor,
    floor: bool,
}

/// Colours per backend: stateless, stateful.
const COLORS: [(RGBColor, RGBColor); 3] = [
    (RGBColor(200, 60, 40), RGBColor(30, 90, 200)),
    (RGBColor(230, 140, 20), RGBColor(20, 150, 100)),
    (RGBColor(150, 50, 160), RGBColor(90, 90, 90)),
];

/// Draws the `rows` of each scaling JSON object in `runs` (one per backend) into `path`.
pub fn scaling_svg(path: &Path, runs: &[Value]) -> anyhow::Result<()> {
    let mut series = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let backend = run["backend"].as_str().unwrap_or("?");
        let rows = run["rows"]
            .as_array()
            .context("a scaling JSON object has `rows`")?;
        let column = |key: &str| -> anyhow::Result<Vec<(f64, f64)>> {
            rows.iter()
                .map(|r| {
                    let seq = r["seq"].as_f64().context("row without `seq`")?;
                    let v = r[key]
                        .as_f64()
                        .with_context(|| format!("row without `{key}`"))?;
                    Ok((seq, v))
                })
                .collect()
        };
        let (less, ful) = COLORS[i % COLORS.len()];
        for (label, key, color, floor) in [
            ("stateless step", "stateless_step_s", less, false),
            ("stateless floor", "floor_stateless_step_s", less, true),
            ("stateful step", "stateful_step_s", ful, false),
            ("stateful floor", "floor_stateful_step_s", ful, true),
        ] {
            series.push(Series {
                label: format!("{backend}: {label}"),
                points: column(key)?,
                color,
                floor,
            });
        }
    }
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if !(x0 > 0.0 && y0 > 0.0 && x1.is_finite() && y1.is_finite()) {
        bail!("nothing positive to plot");
    }

    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("drawing {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "kvsnap: seconds per generated token, stateless redecode vs stateful step",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (x0 / 1.3..x1 * 1.3).log_scale(),
            (y0 / 2.0..y1 * 2.0).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("sequence length (tokens)")
        .y_desc("seconds per step")
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.3}"))
        .draw()
        .map_err(err)?;
    for s in &series {
        let style = if s.floor {
            s.color.mix(0.45).stroke_width(1)
        } else {
            s.color.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), style))
            .map_err(err)?
            .label(&s.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        if !s.floor {
            chart
                .draw_series(
                    s.points
                        .iter()
                        .map(|&p| Circle::new(p, 4, s.color.filled())),
                )
                .map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
