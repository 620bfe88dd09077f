//! Self-contained HTML reports: tables and SVG charts (plotters) inline in
//! one file, no scripts, no network, readable in any browser.
//!
//! - sweep: tokens/s against concurrency, p50/p99 against concurrency per
//!   operation, server bandwidth against the link, latency histograms at
//!   each target's best level, a table per level;
//! - replay: prefix hit rate and tokens/s over time, latency histograms per
//!   operation and per serving tier, SLA compliance per QoS class;
//! - soak: RSS, open fds, p99 per operation and tokens/s per window.

use std::fmt::Write as _;

use plotters::prelude::*;

use crate::replay::ReplayResults;
use crate::soak::{SoakResults, SoakSample};
use crate::stats::LatencySummary;
use crate::sweep::{LevelResult, SweepResults};

/// Writes `OUT/results.json` and, given one, `OUT/report.html`.
///
/// # Errors
/// The directory or a file cannot be written.
pub fn write_out<T: serde::Serialize>(out: &std::path::Path, results: &T, html: Option<String>) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let file = out.join("results.json");
    std::fs::write(&file, serde_json::to_string_pretty(results).expect("results serialize") + "\n")
        .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    if let Some(html) = html {
        let file = out.join("report.html");
        std::fs::write(&file, html).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    }
    Ok(())
}

/// Chart size in pixels.
const CHART_PX: (u32, u32) = (760, 380);

/// Colors of the series, in order: [`Series::color`] indexes it (modulo
/// its length). Each is an RGB triple, `PALETTE[i].0`, `.1`, `.2` (0–255),
/// for checking a rendered chart's pixels
/// (`kvtier_test_support::browser::pixels_of` in the tests).
pub const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
];

/// One line of a chart.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// `(x, y)` points, in x order.
    pub points: Vec<(f64, f64)>,
    /// Index into the palette.
    pub color: usize,
    /// Dashed (p99 beside a solid p50).
    pub dashed: bool,
}

/// Axes of a chart.
pub struct Axes<'a> {
    /// Chart title.
    pub title: &'a str,
    /// X axis label.
    pub x_desc: &'a str,
    /// Y axis label.
    pub y_desc: &'a str,
    /// Logarithmic x.
    pub x_log: bool,
    /// Logarithmic y.
    pub y_log: bool,
}

/// A line chart as an SVG string (an empty-state note without points),
/// its legend in the upper left.
pub fn line_chart(axes: &Axes, series: &[Series]) -> String {
    line_chart_with_legend(axes, series, SeriesLabelPosition::UpperLeft)
}

/// [`line_chart`] with the legend where the curves leave room (the lower
/// right for curves that rise from the origin).
pub fn line_chart_with_legend(axes: &Axes, series: &[Series], legend: SeriesLabelPosition) -> String {
    let pts = || series.iter().flat_map(|s| s.points.iter()).filter(|(x, y)| x.is_finite() && y.is_finite());
    if pts().next().is_none() {
        return format!("<p class=\"empty\">{}: no data</p>", escape(axes.title));
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts() {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if axes.x_log {
        x0 = (x0.max(1e-9) / 1.3).max(1e-9);
        x1 *= 1.3;
    } else if x1 - x0 < 1e-9 {
        x1 = x0 + 1.0;
    }
    if axes.y_log {
        y0 = (y0.max(1e-9) / 1.5).max(1e-9);
        y1 *= 1.5;
    } else {
        y0 = y0.min(0.0);
        y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, CHART_PX).into_drawing_area();
        let _ = draw(&root, axes, series, (x0, x1), (y0, y1), legend);
        let _ = root.present();
    }
    svg
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn draw(
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    axes: &Axes,
    series: &[Series],
    x: (f64, f64),
    y: (f64, f64),
    legend: SeriesLabelPosition,
) -> DrawResult {
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(root);
    builder.caption(axes.title, ("sans-serif", 18)).margin(12).x_label_area_size(42).y_label_area_size(78);
    // The four axis combinations are four coordinate types.
    macro_rules! plot {
        ($xr:expr, $yr:expr) => {{
            let mut chart = builder.build_cartesian_2d($xr, $yr)?;
            chart
                .configure_mesh()
                .x_desc(axes.x_desc)
                .y_desc(axes.y_desc)
                .x_label_formatter(&|v| short(*v))
                .y_label_formatter(&|v| short(*v))
                .light_line_style(WHITE)
                .bold_line_style(RGBColor(225, 225, 225))
                .draw()?;
            for s in series {
                let color = PALETTE[s.color % PALETTE.len()];
                let style = ShapeStyle::from(&color).stroke_width(2);
                let points: Vec<(f64, f64)> = s.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
                let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 20, y)], style);
                if s.dashed {
                    chart.draw_series(DashedLineSeries::new(points.clone(), 6, 4, style))?.label(s.name.clone()).legend(legend);
                } else {
                    chart.draw_series(LineSeries::new(points.clone(), style))?.label(s.name.clone()).legend(legend);
                }
                chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
            chart.configure_series_labels().position(legend.clone()).background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
        }};
    }
    match (axes.x_log, axes.y_log) {
        (false, false) => plot!(x.0..x.1, y.0..y.1),
        (true, false) => plot!((x.0..x.1).log_scale(), y.0..y.1),
        (false, true) => plot!(x.0..x.1, (y.0..y.1).log_scale()),
        (true, true) => plot!((x.0..x.1).log_scale(), (y.0..y.1).log_scale()),
    }
    Ok(())
}

/// A number in a few characters: 1.2k, 3.4M, 0.05.
fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        trim(format!("{:.2}", v / 1e9)) + "G"
    } else if a >= 1e6 {
        trim(format!("{:.2}", v / 1e6)) + "M"
    } else if a >= 1e3 {
        trim(format!("{:.2}", v / 1e3)) + "k"
    } else if a >= 1.0 || a == 0.0 {
        trim(format!("{v:.2}"))
    } else {
        format!("{v:.3}")
    }
}

fn trim(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Escapes text for HTML.
pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Latency distributions (`[upper_us, count]` buckets per name) as one
/// series each of `(upper_us, % of operations)`, colored from `first_color`.
fn distribution_series<'a>(named: impl IntoIterator<Item = (&'a str, &'a [(u64, u64)])>, first_color: usize) -> Vec<Series> {
    named
        .into_iter()
        .enumerate()
        .map(|(i, (name, buckets))| {
            let total: u64 = buckets.iter().map(|b| b.1).sum();
            let points =
                if total == 0 { Vec::new() } else { buckets.iter().map(|&(us, n)| (us as f64, 100.0 * n as f64 / total as f64)).collect() };
            Series { name: name.to_string(), points, color: first_color + i, dashed: false }
        })
        .collect()
}

fn ms(us: u64) -> String {
    format!("{:.2}", us as f64 / 1e3)
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:24px;max-width:1600px;color:#222}\
h1{font-size:22px}h2{font-size:18px;margin-top:28px}table{border-collapse:collapse;margin:8px 0;font-size:13px}\
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}\
.charts{display:flex;flex-wrap:wrap;gap:12px}.charts svg{border:1px solid #ddd}.bad{color:#b00;font-weight:bold}\
.note{color:#555;font-size:13px}.empty{color:#888}";

pub(crate) fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title><style>{STYLE}</style></head>\n<body><h1>{t}</h1>\n{body}</body></html>\n",
        t = escape(title)
    )
}

fn latency_row(name: &str, l: &LatencySummary) -> String {
    format!(
        "<tr><td class=l>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        escape(name),
        l.count,
        ms(l.p50_us),
        ms(l.p95_us),
        ms(l.p99_us),
        ms(l.max_us),
        format_args!("{:.2}", l.mean_us / 1e3)
    )
}

const LATENCY_HEAD: &str =
    "<tr><th class=l>operation</th><th>count</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th><th>max ms</th><th>mean ms</th></tr>";

/// The sweep report.
pub fn sweep_html(r: &SweepResults) -> String {
    let c = &r.config;
    let mut b = String::new();
    let _ = write!(
        b,
        "<p class=note>Closed-loop sweep, iteration = {} lookups + {} reads + {} writes; {} s warm-up + {} s measured per level; \
         block {} bytes / {} tokens ({}); working set {} blocks in chains of {} (+{} never-stored keys per lookup); \
         SLA p99 ≤ {} ms; link: {}.</p>",
        c.mix.lookups,
        c.mix.reads,
        c.mix.writes,
        c.warmup_s,
        c.duration_s,
        c.block_bytes,
        c.block_tokens,
        escape(&c.model),
        c.working_set_blocks,
        c.chain_blocks,
        c.lookup_extra_blocks,
        c.sla_ms,
        match r.link.bytes_per_s {
            Some(bps) => format!("{:.2} GB/s ({})", bps / 1e9, escape(&r.link.source)),
            None => escape(&r.link.source),
        }
    );
    if let Some(e) = &r.error {
        let _ = write!(b, "<p class=bad>Run failed: {}</p>", escape(e));
    }
    // Summary per target.
    b.push_str("<h2>Summary</h2><table><tr><th class=l>target</th><th class=l>protocol</th><th>connections</th><th>best tokens/s</th><th>saturation</th><th>operating point (SLA)</th><th>capacity</th><th>errors</th><th class=l>status</th></tr>");
    for t in &r.targets {
        let best = t.levels.iter().map(|l| l.tokens_per_s).fold(0.0, f64::max);
        let a = &t.analysis;
        let _ = write!(
            b,
            "<tr><td class=l>{}</td><td class=l>{}</td><td>{}</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=l>{}</td></tr>",
            escape(&t.target),
            escape(&t.protocol),
            t.connections,
            best,
            a.saturation.as_ref().map_or("—".into(), |s| format!(
                "c={} ({:.0} tokens/s){}",
                s.concurrency,
                s.tokens_per_s,
                if s.reached { "" } else { ", not reached" }
            )),
            a.operating_point
                .as_ref()
                .map_or("none under the SLA".into(), |o| format!("c={} ({:.0} tokens/s, p99 {:.1} ms)", o.concurrency, o.tokens_per_s, o.worst_p99_ms)),
            a.capacity.as_ref().map_or("—".into(), |k| format!(
                "{} instances for {:.0} tokens/s ({})",
                k.instances, k.target_tokens_per_s, k.basis
            )),
            t.levels.iter().map(|l| l.errors + l.wrong_bytes).sum::<u64>(),
            t.error.as_ref().map_or("ok".to_string(), |e| format!("<span class=bad>{}</span>", escape(e))),
        );
    }
    b.push_str("</table>");

    let xy = |f: &dyn Fn(&LevelResult) -> Option<f64>, t: &crate::sweep::TargetResult| {
        t.levels.iter().filter_map(|l| f(l).map(|y| (l.concurrency as f64, y))).collect::<Vec<_>>()
    };
    b.push_str("<h2>Throughput and latency against concurrency</h2><div class=charts>");
    let tps: Vec<Series> = r
        .targets
        .iter()
        .enumerate()
        .map(|(i, t)| Series { name: t.target.clone(), points: xy(&|l| Some(l.tokens_per_s), t), color: i, dashed: false })
        .collect();
    b.push_str(&line_chart(&Axes { title: "tokens/s", x_desc: "concurrency", y_desc: "tokens/s", x_log: true, y_log: false }, &tps));
    type Pick = fn(&LevelResult) -> &LatencySummary;
    let ops: [(&str, Pick); 3] = [("lookup", |l| &l.latency.lookup), ("read", |l| &l.latency.read), ("write", |l| &l.latency.write)];
    for (op, pick) in ops {
        let mut series = Vec::new();
        for (i, t) in r.targets.iter().enumerate() {
            let has = |l: &LevelResult| pick(l).count > 0;
            series.push(Series {
                name: format!("{} p50", t.target),
                points: xy(&|l| has(l).then(|| pick(l).p50_us as f64 / 1e3), t),
                color: i,
                dashed: false,
            });
            series.push(Series {
                name: format!("{} p99", t.target),
                points: xy(&|l| has(l).then(|| pick(l).p99_us as f64 / 1e3), t),
                color: i,
                dashed: true,
            });
        }
        let title = format!("{op} latency p50 (solid) and p99 (dashed)");
        b.push_str(&line_chart(&Axes { title: &title, x_desc: "concurrency", y_desc: "ms", x_log: true, y_log: true }, &series));
    }
    let mut bw = Vec::new();
    for (i, t) in r.targets.iter().enumerate() {
        bw.push(Series {
            name: format!("{} out", t.target),
            points: xy(&|l| l.server.as_ref().map(|s| s.out_bytes_per_s / 1e9), t),
            color: i,
            dashed: false,
        });
        bw.push(Series {
            name: format!("{} in", t.target),
            points: xy(&|l| l.server.as_ref().map(|s| s.in_bytes_per_s / 1e9), t),
            color: i,
            dashed: true,
        });
    }
    if let (Some(link), Some(first)) = (r.link.bytes_per_s, r.targets.iter().find(|t| !t.levels.is_empty())) {
        let xs: Vec<f64> = first.levels.iter().map(|l| l.concurrency as f64).collect();
        bw.push(Series {
            name: format!("link ({})", r.link.source),
            points: xs.iter().map(|&x| (x, link / 1e9)).collect(),
            color: 5,
            dashed: true,
        });
    }
    b.push_str(&line_chart(&Axes { title: "server bandwidth", x_desc: "concurrency", y_desc: "GB/s", x_log: true, y_log: false }, &bw));
    b.push_str("</div><h2>Latency distribution at each target's best level</h2><div class=charts>");
    for t in &r.targets {
        let Some(best) = t.levels.iter().max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s)) else { continue };
        let h = &best.histograms;
        let series = distribution_series([("lookup", &h.lookup[..]), ("read", &h.read[..]), ("write", &h.write[..])], 0);
        let title = format!("{} at c={}", t.target, best.concurrency);
        b.push_str(&line_chart(
            &Axes {
                title: &title,
                x_desc: "latency µs (bucket upper bound, powers of 2)",
                y_desc: "% of operations",
                x_log: true,
                y_log: false,
            },
            &series,
        ));
    }
    b.push_str("</div>");
    for t in &r.targets {
        let _ = write!(
            b,
            "<h2>{} ({}, {} connections)</h2><p class=note>preload: {} blocks in {:.1} s</p>",
            escape(&t.target),
            escape(&t.protocol),
            t.connections,
            t.preload.blocks,
            t.preload.elapsed_s
        );
        b.push_str(
            "<table><tr><th>concurrency</th><th>iterations/s</th><th>tokens/s</th><th>lookup p50/p99 ms</th><th>read p50/p99 ms</th>\
             <th>write p50/p99 ms</th><th>hit rate</th><th>read misses</th><th>errors</th><th>server in / out GB/s</th><th>link share out</th>\
             <th>Little's law L = X·W</th></tr>",
        );
        for l in &t.levels {
            let pp = |s: &LatencySummary| format!("{} / {}", ms(s.p50_us), ms(s.p99_us));
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{:.1}</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}%</td><td>{}</td><td{}>{}</td><td>{}</td><td>{}</td><td>{:.2} ({:.2}×)</td></tr>",
                l.concurrency,
                l.iterations_per_s,
                l.tokens_per_s,
                pp(&l.latency.lookup),
                pp(&l.latency.read),
                pp(&l.latency.write),
                l.prefix_hit_rate * 100.0,
                l.read_misses,
                if l.errors + l.wrong_bytes > 0 { " class=bad" } else { "" },
                l.errors + l.wrong_bytes,
                l.server.as_ref().map_or("—".into(), |s| format!("{:.2} / {:.2}", s.in_bytes_per_s / 1e9, s.out_bytes_per_s / 1e9)),
                l.server.as_ref().and_then(|s| s.out_link_share).map_or("—".into(), |s| format!("{:.0}%", s * 100.0)),
                l.littles_law.predicted_concurrency,
                l.littles_law.ratio,
            );
        }
        b.push_str("</table>");
        if let Some(e) = t.levels.iter().find_map(|l| l.first_error.as_ref()) {
            let _ = write!(b, "<p class=bad>first error: {}</p>", escape(e));
        }
    }
    page("kvtier-loadgen sweep", &b)
}

/// The replay report.
pub fn replay_html(r: &ReplayResults) -> String {
    let mut b = String::new();
    let _ = write!(
        b,
        "<p class=note>{} ({}, {}) · {} users · {} s · generation {} · dataset {} ({} conversations) · block {} bytes / {} tokens ({})</p>",
        escape(&r.target),
        escape(&r.target_kind),
        escape(&r.protocol),
        r.users,
        r.duration_s,
        r.generation_mode.name(),
        escape(&r.dataset_path.display().to_string()),
        r.dataset_conversations,
        r.block_bytes,
        r.block_tokens,
        escape(&r.model)
    );
    if let Some(e) = r.error.as_ref().or(r.first_error.as_ref()) {
        let _ = write!(b, "<p class=bad>{} errors; first: {}</p>", r.errors, escape(e));
    }
    let _ = write!(
        b,
        "<table><tr><th>turns</th><th>requests</th><th>errors</th><th>503 refusals (retried)</th><th>wrong bytes</th><th>prefix hit rate</th><th>tokens/s</th>\
         <th>storage tokens/s</th><th>read GB/s</th><th>write GB/s</th></tr><tr><td>{}</td><td>{}</td><td{}>{}</td><td>{}</td><td>{}</td><td>{:.1}%</td>\
         <td>{:.0}</td><td>{:.0}</td><td>{:.2}</td><td>{:.2}</td></tr></table>",
        r.turns,
        r.requests,
        if r.errors > 0 { " class=bad" } else { "" },
        r.errors,
        r.refusals,
        r.wrong_bytes,
        r.prefix_hit_rate * 100.0,
        r.tokens_per_s,
        r.storage_tokens_per_s,
        r.read_bytes_per_s / 1e9,
        r.write_bytes_per_s / 1e9
    );
    b.push_str("<h2>Latency</h2><table>");
    b.push_str(LATENCY_HEAD);
    b.push_str(&latency_row("lookup", &r.lookup_latency));
    b.push_str(&latency_row("GET", &r.get_latency));
    b.push_str(&latency_row("PUT", &r.put_latency));
    for (tier, l) in &r.get_latency_by_tier {
        b.push_str(&latency_row(&format!("GET from {tier}"), l));
    }
    b.push_str("</table><h2>SLA per QoS class</h2><table><tr><th class=l>class</th><th>users</th><th>turns</th><th>p95 SLA ms</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th><th>turns within SLA</th><th class=l>met</th></tr>");
    for q in &r.qos {
        let _ = write!(
            b,
            "<tr><td class=l>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}%</td><td class=l>{}</td></tr>",
            q.class.name(),
            q.users,
            q.turn_latency.count,
            q.sla_p95_ms,
            ms(q.turn_latency.p50_us),
            ms(q.turn_latency.p95_us),
            ms(q.turn_latency.p99_us),
            q.within_sla * 100.0,
            if q.met { "yes".to_string() } else { "<span class=bad>no</span>".to_string() }
        );
    }
    b.push_str("</table><p class=note>Turn storage latency: the lookup, the GETs of the prefix hits and the PUTs of the prompt's missed blocks.</p>");
    if let Some(o) = &r.oracle {
        let tiers = |m: &std::collections::BTreeMap<String, u64>| m.iter().map(|(t, n)| format!("{t} {n}")).collect::<Vec<_>>().join(", ");
        let _ = write!(
            b,
            "<h2>Policy oracle</h2><table><tr><th></th><th>prefix hit rate</th><th>GETs by tier</th></tr>\
             <tr><td class=l>predicted</td><td>{:.2}%</td><td class=l>{}</td></tr><tr><td class=l>measured</td><td>{:.2}%</td><td class=l>{}</td></tr></table>\
             <p class=note>{} of {} lookups and {} of {} GETs disagreed with the simulation{}.</p>",
            o.predicted_hit_rate * 100.0,
            escape(&tiers(&o.predicted_gets_by_tier)),
            o.measured_hit_rate * 100.0,
            escape(&tiers(&o.measured_gets_by_tier)),
            o.lookup_mismatches,
            o.lookups_checked,
            o.get_mismatches,
            o.gets_checked,
            o.first_mismatch.as_ref().map_or(String::new(), |m| format!("; first: {}", escape(m)))
        );
    }
    b.push_str("<h2>Over time</h2><div class=charts>");
    let hit: Vec<(f64, f64)> = r.timeline.iter().filter(|p| p.tokens_looked_up > 0).map(|p| (p.t_s, p.prefix_hit_rate * 100.0)).collect();
    let cumulative: Vec<(f64, f64)> = {
        let (mut looked, mut hits) = (0u64, 0u64);
        r.timeline
            .iter()
            .filter_map(|p| {
                looked += p.tokens_looked_up;
                hits += p.tokens_hit;
                (looked > 0).then(|| (p.t_s, 100.0 * hits as f64 / looked as f64))
            })
            .collect()
    };
    let title = format!("prefix hit rate ({} s buckets)", r.timeline_bucket_s);
    b.push_str(&line_chart(
        &Axes { title: &title, x_desc: "seconds", y_desc: "% of tokens looked up", x_log: false, y_log: false },
        &[
            Series { name: "per bucket".into(), points: hit, color: 0, dashed: false },
            Series { name: "cumulative".into(), points: cumulative, color: 1, dashed: true },
        ],
    ));
    let tps: Vec<(f64, f64)> = r.timeline.iter().map(|p| (p.t_s, p.tokens_per_s)).collect();
    b.push_str(&line_chart(
        &Axes { title: "tokens/s (blocks read + written)", x_desc: "seconds", y_desc: "tokens/s", x_log: false, y_log: false },
        &[Series { name: "tokens/s".into(), points: tps, color: 2, dashed: false }],
    ));
    b.push_str("</div><h2>Latency distributions</h2><div class=charts>");
    let h = &r.histograms;
    let ops = distribution_series([("lookup", &h.lookup[..]), ("GET", &h.get[..]), ("PUT", &h.put[..])], 0);
    let x_desc = "latency µs (bucket upper bound, powers of 2)";
    b.push_str(&line_chart(&Axes { title: "per operation", x_desc, y_desc: "% of operations", x_log: true, y_log: false }, &ops));
    let tiers = distribution_series(h.get_by_tier.iter().map(|(tier, bk)| (tier.as_str(), &bk[..])), 3);
    b.push_str(&line_chart(&Axes { title: "GET per serving tier", x_desc, y_desc: "% of GETs", x_log: true, y_log: false }, &tiers));
    b.push_str("</div>");
    page("kvtier-loadgen replay", &b)
}

/// The soak report: RSS, open fds, p99 per operation and tokens/s per
/// window (restarts listed and counted per row), and the verdict.
pub fn soak_html(r: &SoakResults) -> String {
    let mut b = String::new();
    let c = &r.config;
    let _ = write!(
        b,
        "<p class=note>{} windows of {} s · concurrency {} · working set {} MiB · block {} bytes · restart every {} windows \
         (SIGTERM and SIGKILL in turn) · serve args: {}</p>",
        c.windows,
        c.window_s,
        c.concurrency,
        c.working_set_mib,
        r.block_bytes,
        c.restart_every,
        escape(&c.serve_args.join(" "))
    );
    if r.passed {
        let _ = write!(b, "<p>Verdict: <b>flat and clean</b>.</p>");
    } else {
        let _ = write!(b, "<p class=bad>Verdict: {}</p>", escape(&r.problems.join("; ")));
    }
    let _ = write!(
        b,
        "<table><tr><th class=l>figure</th><th>early median</th><th>late median</th><th>late / early</th></tr>\
         <tr><td class=l>RSS MiB</td><td>{:.1}</td><td>{:.1}</td><td>{:.2}</td></tr>\
         <tr><td class=l>open fds</td><td>{:.0}</td><td>{:.0}</td><td>{:.2}</td></tr>\
         <tr><td class=l>iteration p99 ms</td><td>{:.2}</td><td>{:.2}</td><td>{:.2}</td></tr></table>\
         <p class=note>Early: first third of windows; late: last third. {} errors, {} wrong blocks; restarts: {}.</p>",
        r.rss.early / 1048576.0,
        r.rss.late / 1048576.0,
        r.rss.ratio,
        r.fds.early,
        r.fds.late,
        r.fds.ratio,
        r.iteration_p99.early / 1e3,
        r.iteration_p99.late / 1e3,
        r.iteration_p99.ratio,
        r.errors,
        r.wrong_bytes,
        r.restarts
            .iter()
            .map(|x| format!("after window {} ({}, {:.0} ms)", x.after_window, x.signal, x.restart_ms))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let minutes = |s: &SoakSample| s.elapsed_s / 60.0;
    let line = |name: &str, color: usize, f: &dyn Fn(&SoakSample) -> f64| Series {
        name: name.into(),
        points: r.samples.iter().map(|s| (minutes(s), f(s))).collect(),
        color,
        dashed: false,
    };
    let axes = |title: &'static str, y_desc: &'static str| Axes { title, x_desc: "minutes", y_desc, x_log: false, y_log: false };
    let rss = |s: &SoakSample| s.rss_bytes as f64 / 1048576.0;
    let fds = |s: &SoakSample| s.open_fds as f64;
    b.push_str("<div class=charts>");
    b.push_str(&line_chart(&axes("Server RSS", "MiB"), &[line("RSS", 0, &rss)]));
    b.push_str(&line_chart(&axes("Open file descriptors", "fds"), &[line("fds", 1, &fds)]));
    b.push_str(&line_chart(
        &axes("p99 latency per window", "ms"),
        &[
            line("lookup", 0, &|s| s.lookup_p99_us as f64 / 1e3),
            line("read", 1, &|s| s.read_p99_us as f64 / 1e3),
            line("write", 2, &|s| s.write_p99_us as f64 / 1e3),
            line("iteration", 4, &|s| s.iteration_p99_us as f64 / 1e3),
        ],
    ));
    b.push_str(&line_chart(&axes("Throughput", "tokens/s"), &[line("tokens/s", 0, &|s| s.tokens_per_s)]));
    b.push_str("</div>");
    b.push_str(
        "<table><tr><th>window</th><th>minute</th><th>restarts</th><th>RSS MiB</th><th>fds</th><th>tokens/s</th>\
         <th>lookup p99 ms</th><th>read p99 ms</th><th>write p99 ms</th><th>iteration p99 ms</th><th>errors</th><th>wrong</th></tr>",
    );
    for s in &r.samples {
        let _ = write!(
            b,
            "<tr><td>{}</td><td>{:.1}</td><td>{}</td><td>{:.1}</td><td>{}</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            s.window,
            minutes(s),
            s.restarts,
            rss(s),
            s.open_fds,
            s.tokens_per_s,
            ms(s.lookup_p99_us),
            ms(s.read_p99_us),
            ms(s.write_p99_us),
            ms(s.iteration_p99_us),
            s.errors,
            s.wrong_bytes
        );
    }
    b.push_str("</table>");
    page("kvtier-loadgen soak", &b)
}

/// The sizing report (`kvtier-loadgen size`): a chart per curve with its
/// knee and the judged size marked, and a table per tier.
pub fn size_html(r: &crate::size::SizeReport) -> String {
    use crate::size::{CurveReport, SizePoint};
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut b = String::new();
    let _ = write!(
        b,
        "<p class=note>{} records over {:.1} s · {} distinct blocks of {} bytes / {} tokens ({}) · {} shards · source {} · traces {}</p>",
        r.records,
        r.duration_s,
        r.distinct_blocks,
        r.block_bytes,
        r.block_tokens,
        escape(&r.model),
        r.shards,
        escape(&r.source),
        escape(&r.traces.join(", "))
    );
    b.push_str(
        "<h2>Per tier</h2><table><tr><th class=l>tier</th><th>judged</th><th>hit ratio</th><th>knee</th><th>90%</th><th>95%</th><th>99%</th>\
         <th>tokens saved / GB</th><th class=l>what the hit ratio counts</th></tr>",
    );
    let cell = |p: &SizePoint| format!("{} ({:.1}%)", crate::size::human_bytes(p.bytes), p.hit_ratio * 100.0);
    for t in &r.tiers {
        let _ = write!(
            b,
            "<tr><td class=l>{}</td><td>{}</td><td>{:.1}%</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0}</td><td class=l>{}</td></tr>",
            t.tier,
            crate::size::human_bytes(t.configured.bytes),
            t.configured.hit_ratio * 100.0,
            t.knee.as_ref().map_or("—".into(), cell),
            cell(&t.reach[0]),
            cell(&t.reach[1]),
            cell(&t.reach[2]),
            t.tokens_saved_per_gb,
            escape(&t.measure)
        );
    }
    b.push_str("</table><p class=note>90/95/99%: the smallest size reaching that share of the hit ratio of an unbounded tier. Knee: Kneedle, where each further GiB starts to buy less than the average one.</p>");
    let series = |c: &CurveReport, color: usize, dashed: bool, name: &str| Series {
        name: name.to_string(),
        points: c.points.iter().map(|p| (gib(p.bytes), p.hit_ratio * 100.0)).collect(),
        color,
        dashed,
    };
    let marker = |name: String, bytes: u64, top: f64, color: usize| Series {
        name,
        points: vec![(gib(bytes), 0.0), (gib(bytes), top * 100.0)],
        color,
        dashed: true,
    };
    b.push_str("<h2>Curves</h2><div class=charts>");
    let memory = r.memory.as_ref().or(r.memory_shards.as_ref());
    if let Some(m) = memory {
        let mut s = Vec::new();
        if let Some(e) = &r.memory {
            s.push(series(e, 0, false, "LRU, exact"));
        }
        if let Some(e) = &r.memory_shards {
            s.push(series(e, 1, true, "LRU, SHARDS"));
        }
        if let Some(p) = &r.policy {
            s.push(series(p, 2, false, "kvtier's policy (simulated; x: RAM)"));
        }
        if let Some(k) = &m.knee {
            s.push(marker(format!("knee {}", crate::size::human_bytes(k.bytes)), k.bytes, k.hit_ratio, 3));
        }
        s.push(marker(
            format!("judged GPU + RAM {}", crate::size::human_bytes(r.gpu_bytes + r.ram_bytes)),
            r.gpu_bytes + r.ram_bytes,
            1.0,
            4,
        ));
        b.push_str(&line_chart_with_legend(
            &Axes {
                title: "GETs served from memory",
                x_desc: "memory tier size, GiB (GPU + RAM)",
                y_desc: "% of GETs",
                x_log: false,
                y_log: false,
            },
            &s,
            SeriesLabelPosition::LowerRight,
        ));
    }
    let p = &r.prefix;
    let mut s = vec![series(p, 0, false, "LRU, exact")];
    if let Some(k) = &p.knee {
        s.push(marker(format!("knee {}", crate::size::human_bytes(k.bytes)), k.bytes, k.hit_ratio, 3));
    }
    if r.disk_bytes > 0 {
        s.push(marker(format!("judged disk {}", crate::size::human_bytes(r.disk_bytes)), r.disk_bytes, 1.0, 4));
    }
    b.push_str(&line_chart_with_legend(
        &Axes {
            title: "prefix hits (tokens) by store capacity",
            x_desc: "NVMe log size, GiB",
            y_desc: "% of tokens looked up",
            x_log: false,
            y_log: false,
        },
        &s,
        SeriesLabelPosition::LowerRight,
    ));
    b.push_str("</div><h2>Landmarks</h2><table><tr><th class=l>curve</th><th class=l>method</th><th>unbounded</th><th>knee</th><th>90%</th><th>95%</th><th>99%</th><th>seconds</th></tr>");
    for c in [r.memory.as_ref(), r.memory_shards.as_ref(), Some(&r.prefix), r.policy.as_ref()].into_iter().flatten() {
        let _ = write!(
            b,
            "<tr><td class=l>{}</td><td class=l>{}</td><td>{:.1}%</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.2}</td></tr>",
            escape(&c.name),
            escape(&c.method),
            c.unbounded_hit_ratio * 100.0,
            c.knee.as_ref().map_or("—".into(), cell),
            cell(&c.reach_90),
            cell(&c.reach_95),
            cell(&c.reach_99),
            c.seconds
        );
    }
    b.push_str("</table>");
    page("kvtier-loadgen size", &b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_test_support::browser::{charts, chromium, open, pixels_of};

    #[test]
    fn charts_render_svg_with_every_series_named() {
        let s = [
            Series { name: "alpha".into(), points: vec![(1.0, 10.0), (2.0, 20.0), (4.0, 25.0)], color: 0, dashed: false },
            Series { name: "beta".into(), points: vec![(1.0, 5.0), (4.0, 30.0)], color: 1, dashed: true },
        ];
        for (x_log, y_log) in [(false, false), (true, false), (true, true)] {
            let svg = line_chart(&Axes { title: "t<1>", x_desc: "x", y_desc: "y", x_log, y_log }, &s);
            assert!(svg.starts_with("<svg") && svg.contains("alpha") && svg.contains("beta"), "{svg:.200}");
            assert!(svg.contains("<polyline") || svg.contains("<path"), "no line drawn");
        }
        assert!(line_chart(&Axes { title: "none", x_desc: "", y_desc: "", x_log: true, y_log: true }, &[]).contains("no data"));
    }

    /// A chart as a browser draws it: its curves in the DOM, its colors
    /// on the screen ([`kvtier_test_support::browser`]).
    #[test]
    fn a_chart_is_found_in_the_dom_and_its_curves_on_the_screen() {
        assert!(chromium().is_some(), "no chromium on PATH: run `make deps` (it installs the `chromium` package)");
        let dir = tempfile::tempdir().unwrap();
        let series = [
            Series { name: "alpha".into(), points: vec![(1.0, 10.0), (2.0, 20.0), (4.0, 25.0)], color: 0, dashed: false },
            Series { name: "beta".into(), points: vec![(1.0, 5.0), (4.0, 30.0)], color: 1, dashed: true },
            Series { name: "empty".into(), points: vec![], color: 2, dashed: false },
        ];
        let svg = line_chart(&Axes { title: "t", x_desc: "x", y_desc: "y", x_log: false, y_log: false }, &series);
        let view =
            open(&kvtier_test_support::browser::html_page(dir.path(), "chart.html", &svg), Some(&dir.path().join("chart.png")), (800, 420))
                .unwrap();
        assert!(view.console_errors.is_empty(), "{:?}", view.console_errors);
        let charts = charts(&view.dom);
        assert_eq!(charts.len(), 1);
        let color = |i: usize| (PALETTE[i].0, PALETTE[i].1, PALETTE[i].2);
        let curves = charts[0].curves();
        assert_eq!(curves.iter().filter(|l| l.stroke == Some(color(0))).count(), 1, "alpha: one polyline");
        assert!(curves.iter().filter(|l| l.stroke == Some(color(1))).count() > 5, "beta: dashes");
        assert_eq!(curves.iter().filter(|l| l.stroke == Some(color(2))).count(), 0, "empty: its legend sample only");
        assert_eq!(charts[0].markers.iter().filter(|m| m.fill == Some(color(0))).count(), 3, "alpha: a marker per point");
        assert_eq!(charts[0].series_without_curves(), vec![]);
        let png = view.screenshot.unwrap();
        for (i, min) in [(0, 200), (1, 100)] {
            let n = pixels_of(&png, color(i), 8).unwrap();
            assert!(n > min, "{n} pixels of color {i}");
        }
        assert!(pixels_of(&png, color(4), 8).unwrap() == 0);
    }

    #[test]
    fn short_numbers() {
        assert_eq!(short(1500.0), "1.5k");
        assert_eq!(short(2_000_000.0), "2M");
        assert_eq!(short(12.0), "12");
        assert_eq!(short(0.05), "0.050");
    }
}
