//! Opening a loadgen HTML report in headless Chromium, as a person would
//! (the driver: `kvtier_test_support::browser`, shared with the loadgen's
//! tests), and checking that it renders: no console message, no file pulled in,
//! every chart in the DOM with its points and curves drawn, and the first
//! series color really on the screen.

use std::path::Path;

use kvtier_loadgen::report::PALETTE;
use kvtier_test_support::browser::{self, PageView};

/// Viewport of the screenshot, CSS pixels: two 760-pixel charts side by
/// side, and the first rows of charts of every report.
pub const WINDOW_PX: (u32, u32) = (1600, 1400);

/// Writes `html` to `dir/NAME.html`, opens it in Chromium (screenshot in
/// `dir/NAME.png`) and asserts that it renders: no console message, no
/// other file loaded, as many `<svg>` charts in the DOM as in `html`, each
/// with its data points drawn (every `<svg>` of a report has data: a chart
/// without is a `<p class="empty">` note) and a curve through every series
/// of two or more points ([`browser::Chart::series_without_curves`]; a
/// series of one point, such as a replay shorter than one time bucket, is
/// only its marker), and more than 200 pixels of the first palette color
/// on the screen beyond the 40 that each of its legend samples covers (a
/// curve, not only legends). Fails, never skips, without Chromium:
/// `make deps` installs it. With `KVTIER_REPORT_SHOTS=DIR` in the
/// environment, the page and its screenshot are also copied to DIR (for
/// the docs). Returns what the browser saw.
pub fn assert_report_renders(html: &str, dir: &Path, name: &str) -> PageView {
    assert!(browser::chromium().is_some(), "no chromium on PATH: run `make deps` (it installs the `chromium` package)");
    let page = dir.join(format!("{name}.html"));
    let shot = dir.join(format!("{name}.png"));
    std::fs::write(&page, html).unwrap();
    let start = std::time::Instant::now();
    let view = browser::open(&page, Some(&shot), WINDOW_PX).unwrap_or_else(|e| panic!("{name}: {e}"));
    eprintln!("{name}: opened in Chromium in {:.2} s", start.elapsed().as_secs_f64());
    if let Some(keep) = std::env::var_os("KVTIER_REPORT_SHOTS") {
        let keep = Path::new(&keep);
        std::fs::create_dir_all(keep).unwrap();
        for file in [&page, &shot] {
            std::fs::copy(file, keep.join(file.file_name().unwrap())).unwrap();
        }
    }
    assert!(view.console_errors.is_empty(), "{name}: console messages: {:?}", view.console_errors);
    assert!(view.file_loads.is_empty(), "{name}: not self-contained, it loaded {:?}", view.file_loads);
    let charts = browser::charts(&view.dom);
    assert_eq!(charts.len(), html.matches("<svg").count(), "{name}: charts in the DOM against the HTML");
    for (i, chart) in charts.iter().enumerate() {
        assert!(chart.markers.iter().any(|m| m.fill.is_some()), "{name}: chart {i} has no data point drawn: {chart:?}");
        let missing = chart.series_without_curves();
        assert!(missing.is_empty(), "{name}: chart {i}: series of colors {missing:?} have points but no curve: {chart:?}");
    }
    let first = (PALETTE[0].0, PALETTE[0].1, PALETTE[0].2);
    let legends = charts.iter().flat_map(|c| &c.lines).filter(|l| l.stroke == Some(first) && l.is_legend_sample()).count();
    let pixels = browser::pixels_of(view.screenshot.as_deref().expect("a screenshot"), first, 8).unwrap();
    eprintln!("{name}: {pixels} pixels of {first:?} on screen, {legends} legend samples of it");
    assert!(
        pixels > 200 + 40 * legends,
        "{name}: {pixels} pixels of the first series color {first:?} on screen, {legends} legend samples of it (screenshot {})",
        shot.display()
    );
    view
}
