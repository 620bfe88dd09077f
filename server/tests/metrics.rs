//! `/metrics` as Prometheus users read it: checked by the real `promtool
//! check metrics` (Debian's `prometheus` package, which `make deps`
//! installs), latencies as histograms whose counts agree with the request
//! counters, OpenMetrics for a scraper that asks for it, and the Grafana
//! dashboard in contrib/ naming only series kvtier exports.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{client, payload, promtool_check, start, test_args};

/// `GET /metrics` over HTTP/1.1 with `accept` (if any): (content type, body).
fn scrape(url: &str, accept: Option<&str>) -> (String, String) {
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    let request = format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{accept}Connection: close\r\n\r\n");
    let answer = common::exchange(url.trim_start_matches("http://"), request.as_bytes(), Duration::from_secs(10));
    let (head, body) = answer.split_once("\r\n\r\n").expect("a response head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let content_type = head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("content-type: ").map(str::to_string)).unwrap();
    (content_type, body.to_string())
}

/// The value of the one sample named exactly `series` (labels included).
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

/// Every series name a scrape (text format 0.0.4) declares in its `# TYPE`
/// lines, a family with no sample yet included; a histogram `h` also as
/// `h_bucket`, `h_sum` and `h_count`.
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (name, kind) in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' ')) {
        if kind == "histogram" {
            names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}")));
        }
        names.insert(name.to_string());
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_pass_promtool_and_latencies_are_histograms_that_agree_with_the_counters() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(&dir.path().join("data")));
    let c = client(&server, false);
    let keys: Vec<String> = (0..12).map(|i| format!("m-{i}")).collect();
    for k in &keys {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    for k in &keys {
        assert!(c.get(k).await.unwrap().is_some(), "{k}");
    }
    assert!(c.get("never-stored").await.unwrap().is_none());

    // Prometheus' text format by default, and promtool finds nothing to say.
    let (content_type, text) = scrape(&server.url, None);
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    assert!(!text.contains("# EOF"));
    let (ok, said) = promtool_check(&text);
    assert!(ok && said.trim().is_empty(), "promtool check metrics: {said}");

    // A histogram per route: `+Inf` is the count, the buckets never fall,
    // and the count is the route's requests.
    for (route, n) in [("put_block", keys.len()), ("get_block", keys.len() + 1)] {
        let series =
            |suffix: &str, extra: &str| format!("kvtier_request_duration_seconds_{suffix}{{{extra}transport=\"http\",route=\"{route}\"}}");
        let count = sample(&text, &series("count", ""));
        assert_eq!(count, n as f64, "{route}");
        assert_eq!(sample(&text, &format!("kvtier_http_requests_total{{route=\"{route}\"}}")), count, "{route}");
        assert_eq!(sample(&text, &series("bucket", "le=\"+Inf\",")), count, "{route}");
        assert!(sample(&text, &series("sum", "")) > 0.0, "{route}");
        let buckets: Vec<f64> = text
            .lines()
            .filter(|l| {
                l.starts_with("kvtier_request_duration_seconds_bucket{") && l.contains(&format!("transport=\"http\",route=\"{route}\""))
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(buckets.len(), 20, "19 bounds from 10 µs to 10 s and +Inf: {buckets:?}");
        assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{route}: {buckets:?}");
        assert!(text.contains(&format!("le=\"0.00001\",transport=\"http\",route=\"{route}\"")), "the first bound is 10 µs");
        assert!(text.contains(&format!("le=\"10.0\",transport=\"http\",route=\"{route}\"")), "the last finite bound is 10 s");
    }
    // The engine's side: each block written to the log once.
    let nvme_writes = sample(&text, "kvtier_tier_service_duration_seconds_count{tier=\"nvme\",op=\"write\"}");
    assert_eq!(nvme_writes, keys.len() as f64);
    assert_eq!(sample(&text, "kvtier_tier_service_duration_seconds_count{tier=\"nvme\",op=\"read\"}"), keys.len() as f64);
    // No latency as a quantile gauge any more.
    assert!(!text.contains("quantile="), "a quantile gauge is still exported");

    // OpenMetrics for a scraper that asks (a Prometheus server does).
    let (content_type, om) = scrape(&server.url, Some("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3"));
    assert!(content_type.starts_with("application/openmetrics-text"), "{content_type}");
    assert!(om.ends_with("# EOF\n"));
    assert!(om.contains("# TYPE kvtier_http_requests counter"), "OpenMetrics names a counter family without _total");

    // Both front doors' series, the socket's too.
    assert!(text.contains("kvtier_request_duration_seconds_count{transport=\"local\",route="), "the socket's latencies");
    assert!(server.stop().success());
}

/// Every query of contrib/grafana/kvtier-dashboard.json names only series
/// a running kvtier exports (a histogram by its `_bucket`, `_sum` or
/// `_count` samples, a counter by `_total`). No Grafana is installed here
/// (its packages are not in this machine's registries), so the dashboard
/// is checked against a real scrape rather than loaded. The server runs
/// with the features whose series the dashboard shows: a RAM tier, the
/// local socket, a trace directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_of_the_grafana_dashboard_names_an_exported_series() {
    let dashboard_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../contrib/grafana/kvtier-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dashboard_path).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut args = test_args(&dir.path().join("data"));
    common::set_flag(&mut args, "--ram-gb", "0.01");
    args.extend(["--trace-dir".to_string(), dir.path().join("trace").display().to_string()]);
    let server = start(&args);
    let c = client(&server, false);
    c.put("d-0", vec![payload("d-0")]).await.unwrap();
    let (_, text) = scrape(&server.url, None);
    assert!(server.stop().success());
    let exported = exported_names(&text);

    let mut exprs = Vec::new();
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(e) = m.get("expr").and_then(|e| e.as_str()) {
                    out.push(e.to_string());
                }
                m.values().for_each(|v| walk(v, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dashboard, &mut exprs);
    assert!(exprs.len() >= 10, "the dashboard has {} queries", exprs.len());
    let mut named = 0;
    for expr in &exprs {
        let names: Vec<&str> =
            expr.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')).filter(|w| w.starts_with("kvtier_")).collect();
        assert!(!names.is_empty(), "a query that names no kvtier series: {expr}");
        for name in names {
            assert!(exported.contains(name), "{name} (in {expr}) is not exported; exported: {exported:?}");
            named += 1;
        }
    }
    assert!(named >= exprs.len());
}
