/* inference-lab: a sim report's charts, drawn from the JSON embedded in #page-data. */
"use strict";

(function () {
  const { lineChart, fitWidths } = window.LabCharts;
  const data = JSON.parse(document.getElementById("page-data").textContent);
  const charts = [];

  function perSecond(counts, cols) {
    return counts.map((c, i) => {
      const span = cols.t_end_s[i] - cols.t_start_s[i];
      return span > 0 ? c / span : null;
    });
  }

  function seriesCharts() {
    const parent = document.getElementById("series-charts");
    const note = document.getElementById("series-note");
    if (!data.series) {
      note.textContent = "No series in this report.";
      return;
    }
    const cols = data.series.columns;
    note.textContent = `One point per ${data.series.interval_s} s of simulated time ` +
      `(${cols.t_end_s.length} points); counts are per interval, queues and KV usage at its end, ` +
      "latencies over the requests that finished in it.";
    const x = cols.t_end_s;
    const add = (id, title, yLabel, series, values, yRange) => {
      charts.push(lineChart(parent, {
        id: id, title: title, yLabel: yLabel, xLabel: "simulated s", time: false,
        yRange: yRange, series: series, data: [x, ...values],
      }));
    };
    add("s-arrivals", "requests per second", "req/s",
      [{ label: "arrivals" }, { label: "finished" }, { label: "refused (max_waiting)" }],
      [perSecond(cols.arrivals, cols), perSecond(cols.finished, cols), perSecond(cols.refused, cols)]);
    add("s-queues", "running and waiting", "requests",
      [{ label: "running" }, { label: "waiting" }], [cols.running, cols.waiting]);
    add("s-kv", "KV cache usage", "%",
      [{ label: "at interval end" }, { label: "mean over steps" }],
      [cols.kv_usage.map((v) => v * 100), cols.kv_usage_mean.map((v) => (v === null ? null : v * 100))],
      [0, 100]);
    add("s-preemptions", "preemptions per interval", "preemptions",
      [{ label: "preemptions", stepped: true }], [cols.preemptions]);
    add("s-throughput", "throughput", "tok/s",
      [{ label: "output tok/s" }, { label: "computed tok/s (prefill + decode)" }],
      [cols.output_tokens_per_s, cols.computed_tokens_per_s]);
    add("s-ttft", "TTFT of requests finishing in each interval (ms)", "ms",
      [{ label: "p50" }, { label: "p90" }, { label: "p99" }],
      [cols.ttft_p50_ms, cols.ttft_p90_ms, cols.ttft_p99_ms]);
    add("s-tpot", "TPOT of requests finishing in each interval (ms)", "ms",
      [{ label: "p50" }, { label: "p99" }], [cols.tpot_p50_ms, cols.tpot_p99_ms]);
    const pc = data.show_prefix_cache;
    if (pc) {
      add("s-prefix", "prefix-cache hit rate (tokens looked up in each interval)", "%",
        [{ label: "hit rate" }], [cols.prefix_hit_rate.map((v) => (v === null ? null : v * 100))],
        [0, 100]);
    }
    const n = data.series.replicas;
    if (n > 1) {
      document.getElementById("replica-section").hidden = false;
      const rparent = document.getElementById("replica-charts");
      const radd = (id, title, yLabel, field, scale, yRange) => {
        const series = [];
        const values = [];
        for (let i = 0; i < n; i++) {
          series.push({ label: `replica ${i}` });
          values.push(cols[`r${i}_${field}`].map((v) => (v === null ? null : v * scale)));
        }
        charts.push(lineChart(rparent, {
          id: id, title: title, yLabel: yLabel, xLabel: "simulated s", time: false,
          yRange: yRange, series: series, data: [x, ...values],
        }));
      };
      radd("r-running", "running per replica", "requests", "running", 1);
      radd("r-waiting", "waiting per replica", "requests", "waiting", 1);
      radd("r-kv", "KV cache usage per replica", "%", "kv_usage", 100, [0, 100]);
      if (pc) radd("r-prefix", "prefix-cache hit rate per replica", "%", "prefix_hit_rate", 100, [0, 100]);
    }
  }

  function latencyCharts() {
    const parent = document.getElementById("latency-charts");
    const names = [["ttft", "TTFT"], ["tpot", "TPOT"], ["e2e", "E2E"], ["queue", "queue"]];
    const cdfX = [];
    for (const [key, label] of names) {
      const cdf = data.cdf[key];
      if (!cdf.ms.length) continue;
      charts.push(lineChart(parent, {
        id: `cdf-${key}`, title: `${label}: cumulative distribution`, xLabel: "ms", yLabel: "fraction",
        time: false, yRange: [0, 1], series: [{ label: `${label} CDF` }], data: [cdf.ms, cdf.p],
      }));
      cdfX.push(key);
    }
    for (const [key, label] of names) {
      const h = data.histograms[key];
      if (!h.ms.length) continue;
      charts.push(lineChart(parent, {
        id: `hist-${key}`, title: `${label}: histogram`, xLabel: "ms", yLabel: "requests",
        time: false, series: [{ label: "requests", stepped: true, fill: "rgba(37,99,235,0.15)" }],
        data: [h.ms, h.count],
      }));
    }
    return cdfX;
  }

  seriesCharts();
  latencyCharts();
  fitWidths(charts)();
  document.body.dataset.charts = String(charts.length);
})();
