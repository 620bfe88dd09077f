//! Opening a page in a real headless browser (Debian's `chromium`), as a
//! person would, to prove that a report renders (the loadgen's reports, in
//! `loadgen/tests/browser.rs` and the server's tests through
//! `server/tests/common/browser.rs`): what the browser parsed
//! ([`PageView::dom`]), what it said on the console
//! ([`PageView::console_errors`]), which other files the page pulled in
//! ([`PageView::file_loads`]) and what it drew ([`PageView::screenshot`],
//! checked with [`pixels_of`]); [`charts`] finds the curves of each inline
//! SVG chart in the DOM.
//!
//! Chromium is driven through its command line, no DevTools protocol:
//! `--dump-dom` prints the DOM after load, `--screenshot` writes a PNG of
//! the viewport, and `--enable-logging=stderr` prints every console
//! message as an `INFO:CONSOLE` log line (the level, `log` or `error`, is
//! not in that line, so every console message counts). A resource that
//! fails to load (`<img src=missing.png>`) puts nothing on the console
//! there, which is why the file loads are logged too
//! (`--vmodule=file_url_loader_factory=1`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one browser run may take before it is killed.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// The browser executables looked for on `PATH`, in order.
const NAMES: [&str; 3] = ["chromium", "chromium-browser", "google-chrome"];

/// The first of `chromium`, `chromium-browser`, `google-chrome` found as an
/// executable file on `PATH`; `None` when there is none (`make deps`
/// installs `chromium`).
pub fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    NAMES.iter().find_map(|name| {
        std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| {
            use std::os::unix::fs::PermissionsExt;
            p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// A page as the browser saw it.
#[derive(Debug, Clone, Default)]
pub struct PageView {
    /// The serialized DOM after load (`--dump-dom`): HTML as the browser
    /// parsed it, SVG elements included.
    pub dom: String,
    /// Every console message, in order, each as Chromium logs it:
    /// `"text", source: URL (line)`. Chromium's log does not say whether a
    /// message came from `console.log` or `console.error`, so all count; an
    /// uncaught exception is one too (`"Uncaught ReferenceError: …"`).
    pub console_errors: Vec<String>,
    /// `file://` URLs the page loaded besides itself (images, styles,
    /// scripts), whether or not they exist: a self-contained report has
    /// none.
    pub file_loads: Vec<String>,
    /// The screenshot as PNG bytes, `window_px` pixels, when one was asked
    /// for.
    pub screenshot: Option<Vec<u8>>,
}

/// Opens the HTML file `html` in headless Chromium, viewport `window_px`
/// (width, height in CSS pixels, device scale factor 1), and returns its
/// DOM after load, its console messages and the other files it loaded;
/// with `screenshot`, also writes a PNG of the viewport (the top
/// `window_px.1` pixels of the page) there and returns its bytes.
///
/// One browser run does both (`--dump-dom` and `--screenshot` together),
/// with a throwaway profile in a temporary directory; about a second.
///
/// Errors: no browser on `PATH` (the message says to run `make deps`),
/// `html` missing, the browser failing to start or exiting with an error
/// (its log's tail is in the message), or running past [`TIMEOUT`] (it is
/// killed, with every process it started, and the message says so).
pub fn open(html: &Path, screenshot: Option<&Path>, window_px: (u32, u32)) -> Result<PageView, String> {
    open_within(html, screenshot, window_px, TIMEOUT)
}

/// [`open`] with its own time limit.
fn open_within(html: &Path, screenshot: Option<&Path>, window_px: (u32, u32), timeout: Duration) -> Result<PageView, String> {
    let browser = chromium().ok_or("no chromium on PATH: run `make deps` (it installs the `chromium` package)")?;
    let html = html.canonicalize().map_err(|e| format!("{}: {e}", html.display()))?;
    let url = file_url(&html);
    let scratch = Scratch::new()?;
    let mut cmd = Command::new(&browser);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--enable-logging=stderr",
        "--v=0",
        "--vmodule=file_url_loader_factory=1",
        "--dump-dom",
    ]);
    cmd.arg(format!("--user-data-dir={}", scratch.0.join("profile").display()));
    cmd.arg(format!("--window-size={},{}", window_px.0, window_px.1));
    if let Some(png) = screenshot {
        if png.exists() {
            std::fs::remove_file(png).map_err(|e| format!("{}: {e}", png.display()))?;
        }
        cmd.arg(format!("--screenshot={}", png.display()));
    }
    cmd.arg(&url);
    let out_path = scratch.0.join("stdout");
    let err_path = scratch.0.join("stderr");
    let file = |p: &Path| std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()));
    cmd.stdin(Stdio::null()).stdout(file(&out_path)?).stderr(file(&err_path)?);
    // Its own process group, so that a timeout kills the renderers and the
    // GPU process too (Debian's `chromium` is a shell script that does not
    // always exec).
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|e| format!("{}: {e}", browser.display()))?;
    let group = child.id() as libc::pid_t;
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() < timeout => std::thread::sleep(Duration::from_millis(25)),
            Ok(None) => {
                // SAFETY: kill(2) on the process group this function started.
                unsafe { libc::kill(-group, libc::SIGKILL) };
                let _ = child.wait();
                return Err(format!("{} did not finish {url} within {:.0} s: killed", browser.display(), timeout.as_secs_f64()));
            }
            Err(e) => return Err(format!("waiting for {}: {e}", browser.display())),
        }
    };
    // Whatever it left behind (nothing, normally) goes too.
    // SAFETY: as above.
    unsafe { libc::kill(-group, libc::SIGKILL) };
    let dom = std::fs::read_to_string(&out_path).map_err(|e| format!("{}: {e}", out_path.display()))?;
    let log = String::from_utf8_lossy(&std::fs::read(&err_path).unwrap_or_default()).into_owned();
    if !status.success() || dom.is_empty() {
        let tail: Vec<&str> = log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
        return Err(format!("{} on {url}: {status}, {} bytes of DOM; log tail:\n{}", browser.display(), dom.len(), tail.join("\n")));
    }
    let (console_errors, file_loads) = parse_log(&log, &url);
    let screenshot = match screenshot {
        Some(png) => Some(std::fs::read(png).map_err(|e| format!("no screenshot from {}: {}: {e}", browser.display(), png.display()))?),
        None => None,
    };
    Ok(PageView { dom, console_errors, file_loads, screenshot })
}

/// `file://` URL of an absolute path, with the bytes a URL cannot hold
/// percent-encoded.
fn file_url(path: &Path) -> String {
    let mut url = String::from("file://");
    for &b in path.as_os_str().as_encoded_bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            url.push(b as char);
        } else {
            url.push_str(&format!("%{b:02X}"));
        }
    }
    url
}

/// The console messages and the `file://` loads other than `page` in a
/// Chromium stderr log.
fn parse_log(log: &str, page: &str) -> (Vec<String>, Vec<String>) {
    let (mut console, mut loads) = (Vec::new(), Vec::new());
    for line in log.lines() {
        // `[pid:tid:date/time:INFO:CONSOLE:1] "text", source: URL (1)`
        // (older versions: `INFO:CONSOLE(1)]`).
        let Some(at) = line.find(":CONSOLE") else {
            if let Some(at) = line.find("FileURLLoader::Start: ") {
                let loaded = line[at + "FileURLLoader::Start: ".len()..].trim();
                if loaded != page {
                    loads.push(loaded.to_string());
                }
            }
            continue;
        };
        let rest = &line[at..];
        console.push(rest.find("] ").map_or(rest, |i| &rest[i + 2..]).to_string());
    }
    (console, loads)
}

/// A temporary directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch, String> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir =
            std::env::temp_dir().join(format!("kvtier-browser-{}-{}-{nanos}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How many pixels of the PNG image `png` are within `tolerance` of the
/// color `rgb` on each of the three channels (alpha ignored; grayscale,
/// palette and 16-bit images are converted to 8-bit RGB first). A 2-pixel
/// antialiased line of a color has pixels of exactly that color along its
/// middle; `tolerance` takes in the ones blended a little with the
/// background.
///
/// Errors: `png` is not a PNG image the `png` crate can decode.
pub fn pixels_of(png: &[u8], rgb: (u8, u8, u8), tolerance: u8) -> Result<usize, String> {
    let mut decoder = png::Decoder::new(std::io::Cursor::new(png));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(|e| format!("not a PNG image: {e}"))?;
    let mut buf = vec![0; reader.output_buffer_size().ok_or("PNG image too large")?];
    let frame = reader.next_frame(&mut buf).map_err(|e| format!("PNG image: {e}"))?;
    let bytes = &buf[..frame.buffer_size()];
    let near = |a: u8, b: u8| a.abs_diff(b) <= tolerance;
    let matches = |r: u8, g: u8, b: u8| near(r, rgb.0) && near(g, rgb.1) && near(b, rgb.2);
    let count = match frame.color_type {
        png::ColorType::Rgb => bytes.chunks_exact(3).filter(|p| matches(p[0], p[1], p[2])).count(),
        png::ColorType::Rgba => bytes.chunks_exact(4).filter(|p| matches(p[0], p[1], p[2])).count(),
        png::ColorType::Grayscale => bytes.iter().filter(|&&v| matches(v, v, v)).count(),
        png::ColorType::GrayscaleAlpha => bytes.chunks_exact(2).filter(|p| matches(p[0], p[0], p[0])).count(),
        png::ColorType::Indexed => return Err("PNG image still indexed after expansion".into()),
    };
    Ok(count)
}

/// One `<svg>` element of a DOM: a chart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chart {
    /// Its `<polyline>` and `<path>` elements, in document order (plotters
    /// draws every line as one `<polyline>`: a series, a dash of a dashed
    /// series, an axis or grid line, a legend sample).
    pub lines: Vec<Line>,
    /// Its `<circle>` elements, in document order: the reports mark every
    /// data point with one, filled in its series' color.
    pub markers: Vec<Marker>,
}

/// A `<circle>` of a chart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Marker {
    /// Its `fill` attribute as an RGB color (`#rrggbb`), `None` when it
    /// has none or another form.
    pub fill: Option<(u8, u8, u8)>,
    /// Its center `(cx, cy)` in SVG user units (pixels of the chart).
    pub center: (f64, f64),
}

/// A `<polyline>` or `<path>` of a chart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Line {
    /// Its `stroke` attribute as an RGB color (`#rrggbb`), `None` when it
    /// has none or another form.
    pub stroke: Option<(u8, u8, u8)>,
    /// Its points in SVG user units (pixels of the chart): the `points`
    /// of a polyline; for a path, the number pairs of `d` taken in order,
    /// which is exact for the `M`/`L` paths of line charts.
    pub points: Vec<(f64, f64)>,
}

impl Line {
    /// Whether it draws something: at least 2 points, not all the same.
    pub fn is_drawn(&self) -> bool {
        self.points.windows(2).any(|w| w[0] != w[1])
    }

    /// Whether it is colored (red, green and blue not all equal): a data
    /// series rather than an axis, grid line or border, which are black,
    /// gray or white.
    pub fn is_colored(&self) -> bool {
        self.stroke.is_some_and(|(r, g, b)| !(r == g && g == b))
    }

    /// Whether it is a legend sample: the 20-pixel horizontal stroke of 2
    /// points that the reports' legend draws beside each series name, data
    /// or not (`kvtier_loadgen::report::line_chart`). At stroke width 2 it
    /// covers 40 pixels of the series color on screen.
    pub fn is_legend_sample(&self) -> bool {
        let p = &self.points;
        p.len() == 2 && p[0].1 == p[1].1 && (p[1].0 - p[0].0).abs() == 20.0
    }
}

impl Chart {
    /// Its curves: colored lines ([`Line::is_colored`]) that draw
    /// something ([`Line::is_drawn`]) and are not legend samples
    /// ([`Line::is_legend_sample`]); a dashed series is one curve per dash.
    pub fn curves(&self) -> Vec<&Line> {
        self.lines.iter().filter(|l| l.is_colored() && l.is_drawn() && !l.is_legend_sample()).collect()
    }

    /// The colors whose data points ([`Chart::markers`]) stand at two or
    /// more x positions, so that a curve must join them, but which have no
    /// curve ([`Chart::curves`]); empty when every such series is drawn.
    /// A series of a single point has no curve to draw, only its marker
    /// (a replay shorter than one time bucket, a sweep of one level).
    /// Two series of one color (p50 and p99) count as one: one curve of
    /// the color is enough.
    pub fn series_without_curves(&self) -> Vec<(u8, u8, u8)> {
        let mut colors: Vec<(u8, u8, u8)> = self.markers.iter().filter_map(|m| m.fill).collect();
        colors.sort_unstable();
        colors.dedup();
        colors.retain(|&c| {
            let x0 = self.markers.iter().find(|m| m.fill == Some(c)).map(|m| m.center.0);
            let spread = self.markers.iter().any(|m| m.fill == Some(c) && Some(m.center.0) != x0);
            spread && !self.curves().iter().any(|l| l.stroke == Some(c))
        });
        colors
    }
}

/// Writes `dir/name`, a minimal HTML page whose body is `body`, for a
/// test to [`open`]; returns its path.
///
/// # Panics
/// When the file cannot be written (a test helper).
pub fn html_page(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>t</title></head><body>{body}</body></html>\n"),
    )
    .unwrap();
    path
}

/// The `<svg>` elements of `dom` (HTML, as [`PageView::dom`]) with their
/// lines, in document order. A plain scan of the markup, no HTML parser:
/// it expects what browsers and plotters write (double-quoted attributes,
/// no nested `<svg>`).
pub fn charts(dom: &str) -> Vec<Chart> {
    let mut charts = Vec::new();
    let mut rest = dom;
    while let Some(start) = find_tag(rest, "svg") {
        let body = &rest[start..];
        let end = body.find("</svg>").map_or(body.len(), |i| i + "</svg>".len());
        let svg = &body[..end];
        let mut lines = Vec::new();
        for (tag, attr) in [("polyline", "points"), ("path", "d")] {
            let mut at = svg;
            while let Some(i) = find_tag(at, tag) {
                let element = &at[i..];
                let open = &element[..element.find('>').map_or(element.len(), |j| j + 1)];
                lines.push((svg.len() - element.len(), line_of(open, attr)));
                at = &element[1..];
            }
        }
        lines.sort_by_key(|(offset, _)| *offset);
        let mut markers = Vec::new();
        let mut at = svg;
        while let Some(i) = find_tag(at, "circle") {
            let element = &at[i..];
            let open = &element[..element.find('>').map_or(element.len(), |j| j + 1)];
            let coordinate = |name: &str| attribute(open, name).and_then(|v| v.trim().parse().ok()).unwrap_or(f64::NAN);
            markers.push(Marker { fill: attribute(open, "fill").and_then(rgb), center: (coordinate("cx"), coordinate("cy")) });
            at = &element[1..];
        }
        charts.push(Chart { lines: lines.into_iter().map(|(_, l)| l).collect(), markers });
        rest = &body[end..];
    }
    charts
}

/// Offset of the next `<tag` element (followed by a space, `/` or `>`).
fn find_tag(s: &str, tag: &str) -> Option<usize> {
    let needle = format!("<{tag}");
    let mut from = 0;
    while let Some(i) = s[from..].find(&needle) {
        let at = from + i;
        match s.as_bytes().get(at + needle.len()) {
            Some(b' ' | b'\t' | b'\n' | b'\r' | b'/' | b'>') => return Some(at),
            _ => from = at + needle.len(),
        }
    }
    None
}

/// The value of attribute `name` in the open tag `open`.
fn attribute<'a>(open: &'a str, name: &str) -> Option<&'a str> {
    let needle = format!(" {name}=\"");
    let start = open.find(&needle)? + needle.len();
    open[start..].find('"').map(|end| &open[start..start + end])
}

/// `#rrggbb` as an RGB triple.
fn rgb(s: &str) -> Option<(u8, u8, u8)> {
    let hex = s.strip_prefix('#').filter(|h| h.len() == 6)?;
    let byte = |i: usize| u8::from_str_radix(&hex[i..i + 2], 16).ok();
    Some((byte(0)?, byte(2)?, byte(4)?))
}

fn line_of(open: &str, points_attr: &str) -> Line {
    let stroke = attribute(open, "stroke").and_then(rgb);
    let numbers: Vec<f64> = attribute(open, points_attr)
        .unwrap_or("")
        .split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == 'e'))
        .filter_map(|t| t.parse().ok())
        .collect();
    Line { stroke, points: numbers.chunks_exact(2).map(|p| (p[0], p[1])).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn browser_or_fail() {
        assert!(chromium().is_some(), "no chromium on PATH: run `make deps` (it installs the `chromium` package)");
    }

    #[test]
    fn console_messages_and_stray_loads_are_caught_and_a_clean_page_has_none() {
        browser_or_fail();
        let dir = tempfile::tempdir().unwrap();
        let boom = open(&html_page(dir.path(), "boom.html", "<p>x</p><script>console.error(\"boom\")</script>"), None, (400, 300)).unwrap();
        assert!(boom.console_errors.iter().any(|e| e.contains("boom")), "{boom:?}");
        let thrown = open(&html_page(dir.path(), "throw.html", "<script>notDefined()</script>"), None, (400, 300)).unwrap();
        assert!(thrown.console_errors.iter().any(|e| e.contains("notDefined")), "{thrown:?}");
        let img = open(&html_page(dir.path(), "img.html", "<img src=\"missing.png\">"), None, (400, 300)).unwrap();
        assert!(img.file_loads.iter().any(|u| u.ends_with("/missing.png")), "{img:?}");
        let start = Instant::now();
        let clean = open(&html_page(dir.path(), "clean é.html", "<p>clean</p>"), Some(&dir.path().join("clean.png")), (400, 300)).unwrap();
        eprintln!("one page open with a screenshot: {:?}", start.elapsed());
        assert!(clean.console_errors.is_empty() && clean.file_loads.is_empty(), "{clean:?}");
        assert!(clean.dom.contains("<p>clean</p>"), "{}", clean.dom);
        let png = clean.screenshot.unwrap();
        let white = pixels_of(&png, (255, 255, 255), 0).unwrap();
        assert!(white > 400 * 300 * 9 / 10 && white < 400 * 300, "{white} white pixels of {}", 400 * 300);
    }

    #[test]
    fn a_page_that_never_finishes_loading_is_killed_at_the_time_limit() {
        browser_or_fail();
        let dir = tempfile::tempdir().unwrap();
        let hang = html_page(dir.path(), "hang.html", "<script>while (true) {}</script>");
        let start = Instant::now();
        let e = open_within(&hang, None, (400, 300), Duration::from_secs(3)).unwrap_err();
        assert!(e.contains("within 3 s: killed"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
    }

    #[test]
    fn svg_markup_is_scanned_for_lines() {
        let dom = "<p>x</p><svg width=\"10\"><polyline fill=\"none\" stroke=\"#1F77B4\" points=\"0,0 5,5 \"></polyline>\
                   <path stroke=\"#000000\" d=\"M 1 2 L 3 4\"></path><polyline stroke=\"#D62728\" points=\"1,1 21,1 \"/></svg>\
                   <svgx></svgx><svg><polyline stroke=\"red\" points=\"3,3 3,3\"/></svg>";
        let c = charts(dom);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].lines.len(), 3);
        assert_eq!(c[0].lines[1], Line { stroke: Some((0, 0, 0)), points: vec![(1.0, 2.0), (3.0, 4.0)] });
        assert_eq!(c[0].curves(), vec![&c[0].lines[0]], "the black path is an axis, the 20-pixel stroke a legend sample");
        assert!(!c[1].lines[0].is_drawn() && c[1].lines[0].stroke.is_none());
        // Markers: one point needs no curve, two points at different x do.
        let markers =
            "<svg><circle cx=\"5\" cy=\"6\" r=\"3\" fill=\"#1F77B4\"></circle><circle cx=\"5\" cy=\"9\" r=\"3\" fill=\"#1F77B4\"/>\
                       <circle cx=\"1\" cy=\"1\" fill=\"#D62728\"/><circle cx=\"2\" cy=\"1\" fill=\"#D62728\"/></svg>";
        let m = &charts(markers)[0];
        assert_eq!(m.markers[0], Marker { fill: Some((0x1F, 0x77, 0xB4)), center: (5.0, 6.0) });
        assert_eq!(m.series_without_curves(), vec![(0xD6, 0x27, 0x28)]);
        assert_eq!(file_url(Path::new("/a b/é.html")), "file:///a%20b/%C3%A9.html");
        let (console, loads) = parse_log(
            "[1:1:1126/1:INFO:CONSOLE:1] \"boom\", source: file:///p.html (1)\nx FileURLLoader::Start: file:///p.html\n\
             y FileURLLoader::Start: file:///q.png\n",
            "file:///p.html",
        );
        assert_eq!((console, loads), (vec!["\"boom\", source: file:///p.html (1)".to_string()], vec!["file:///q.png".to_string()]));
    }
}
