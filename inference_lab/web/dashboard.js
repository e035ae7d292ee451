/* inference-lab: the live dashboard. Reads /control/dashboard/events (Server-Sent Events):
   an `init` event with the model's samples so far, then one `sample` per tick, and `end`
   when the server shuts down. Nothing is polled. */
"use strict";

(function () {
  const { lineChart, fitWidths, fmt } = window.LabCharts;
  const params = new URLSearchParams(window.location.search);
  const token = params.get("token");
  const $ = (id) => document.getElementById(id);

  // The series each chart draws: [chart id, title, y label, [[sample key, label, opts]]]
  const CHARTS = [
    ["c-requests", "requests", "requests", [
      ["running", "running"], ["queued", "queued"],
      ["max_num_seqs", "max_num_seqs", { dash: [6, 4], stepped: true, stroke: "#6b7280" }],
    ]],
    ["c-kv", "KV cache usage", "%", [["kv_pct", "KV usage %"]], [0, 100]],
    ["c-rates", "requests per second", "req/s", [
      ["admitted_per_s", "admitted"], ["refused_per_s", "refused 529"],
      ["aborted_per_s", "aborted"], ["unavailable_per_s", "refused 503"],
    ]],
    ["c-tokens", "output tokens per second", "tok/s", [["tokens_per_s", "output tok/s"]]],
    ["c-ttft", "TTFT over the last 10 s (ms)", "ms", [
      ["ttft_p50_ms", "p50"], ["ttft_p90_ms", "p90"], ["ttft_p99_ms", "p99"],
    ]],
    ["c-e2e", "E2E over the last 10 s (ms)", "ms", [
      ["e2e_p50_ms", "p50"], ["e2e_p90_ms", "p90"], ["e2e_p99_ms", "p99"],
    ]],
    ["c-lag", "pacing lag (ms)", "ms", [["lag_mean_ms", "mean"], ["lag_max_ms", "max"]]],
  ];
  const TILE_KEYS = [
    "running", "max_num_seqs", "queued", "waiting_places", "max_waiting", "admitted_per_s",
    "admitted", "refused_per_s", "refused", "unavailable_per_s", "aborted_per_s", "aborted",
    "tokens_per_s", "finished_per_s", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms",
    "e2e_p99_ms", "latency_n", "lag_mean_ms", "lag_max_ms",
  ];
  const DIGITS = {
    admitted_per_s: 1, refused_per_s: 1, unavailable_per_s: 1, aborted_per_s: 1,
    tokens_per_s: 0, finished_per_s: 1, ttft_p50_ms: 1, ttft_p99_ms: 1, e2e_p50_ms: 0,
    e2e_p99_ms: 0, lag_mean_ms: 2, lag_max_ms: 2,
  };

  let source = null;
  let info = null; // the init event's settings
  let markers = [];
  let columns = null; // x and one array per series of every chart
  let charts = [];
  let pending = false;

  function eventsUrl(model) {
    const q = new URLSearchParams({ model: model });
    if (token) q.set("token", token);
    return window.location.pathname.replace(/\/+$/, "") + "/events?" + q.toString();
  }

  function setStatus(state, text) {
    const el = $("status");
    el.dataset.state = state;
    el.textContent = text;
  }

  function setBanner(text) {
    const el = $("banner");
    el.hidden = !text;
    el.textContent = text || "";
  }

  function buildCharts() {
    const parent = $("charts");
    parent.textContent = "";
    columns = { x: [] };
    charts = CHARTS.map(([id, title, yLabel, series, yRange]) => {
      for (const [key] of series) columns[key] = [];
      return lineChart(parent, {
        id: id, title: title, yLabel: yLabel, time: true, yRange: yRange,
        series: series.map(([key, label, opts]) => Object.assign({ label: label }, opts || {})),
        markers: () => markers,
      });
    });
    fitWidths(charts)();
  }

  function push(sample) {
    const limit = info ? info.ring_samples : 1200;
    columns.x.push(info.started_unix + sample.t);
    const values = Object.assign({ kv_pct: sample.kv_usage * 100 }, sample);
    for (const [, , , series] of CHARTS) {
      for (const [key] of series) columns[key].push(values[key] === undefined ? null : values[key]);
    }
    if (columns.x.length > limit) {
      for (const key of Object.keys(columns)) columns[key].shift();
    }
    for (const change of sample.changes || []) addChange(change);
  }

  function addChange(change) {
    const label = `max_num_seqs ${change.max_num_seqs} · max_waiting ${change.max_waiting}`;
    markers.push({ x: info.started_unix + change.t, label: `seqs ${change.max_num_seqs} · waiting ${change.max_waiting}` });
    const list = $("changes");
    const none = list.querySelector(".none");
    if (none) none.remove();
    const item = document.createElement("li");
    item.className = "change";
    const when = new Date((info.started_unix + change.t) * 1000).toLocaleTimeString();
    item.textContent = `${when}: ${label}`;
    list.appendChild(item);
  }

  function redraw() {
    pending = false;
    CHARTS.forEach(([, , , series], i) => {
      charts[i].setData([columns.x, ...series.map(([key]) => columns[key])]);
    });
  }

  function showNow(sample) {
    for (const key of TILE_KEYS) {
      const el = $("v-" + key);
      if (!el) continue;
      el.dataset.value = sample[key] === null || sample[key] === undefined ? "" : sample[key];
      el.textContent = fmt(sample[key], DIGITS[key] || 0);
    }
    const kv = $("v-kv_usage");
    kv.dataset.value = sample.kv_usage;
    kv.textContent = fmt(sample.kv_usage * 100, 1) + " %";
    const hit = $("v-prefix_hit_rate");
    hit.textContent = sample.prefix_hit_rate === null ? "–" : fmt(sample.prefix_hit_rate * 100, 1) + " %";
    if (!sample.alive) {
      setBanner(`The engine of ${info.model} is not running: its requests are refused ` +
        "with 503 (engine_unavailable), and it reports nothing running or queued.");
    } else if (sample.draining) {
      setBanner("The server is shutting down: new requests get 503.");
    } else if (sample.host_behind) {
      setBanner(`The host is not keeping up with ${info.model}: over the last second, 1 % of ` +
        `engine events were handled ${fmt(sample.lag_p99_ms, 1)} ms or more late (above ` +
        `${fmt(info.lag_warn_ms, 0)} ms). Clients see latencies above the model's by about ` +
        "that much; every answer says how late in its inference-lab-pacing-lag-ms header.");
    } else {
      setBanner("");
    }
  }

  function onInit(event) {
    info = JSON.parse(event.data);
    markers = [];
    $("changes").innerHTML = '<li class="none">none yet (POST /control/capacity)</li>';
    $("interval").textContent = info.interval;
    $("rate-window").textContent = info.rate_window;
    for (const el of document.querySelectorAll(".latency-window")) el.textContent = info.latency_window;
    const select = $("model");
    if (select.options.length !== info.models.length) {
      select.textContent = "";
      for (const name of info.models) {
        const opt = document.createElement("option");
        opt.value = name;
        opt.textContent = name;
        select.appendChild(opt);
      }
    }
    select.value = info.model;
    if (!params.get("model")) {
      // the server chose the busiest model: keep it across a reload
      params.set("model", info.model);
      window.history.replaceState(null, "", "?" + params.toString());
    }
    document.title = `${info.model} · inference-lab dashboard`;
    buildCharts();
    for (const change of info.changes) addChange(change);
    for (const sample of info.history) push(Object.assign({}, sample, { changes: [] }));
    if (info.history.length) showNow(info.history[info.history.length - 1]);
    redraw();
    setStatus("live", "live");
  }

  function onSample(event) {
    const sample = JSON.parse(event.data);
    push(sample);
    showNow(sample);
    if (!pending) {
      pending = true;
      window.requestAnimationFrame(redraw);
    }
  }

  function connect(model) {
    if (source) source.close();
    setStatus("connecting", "connecting…");
    source = new EventSource(eventsUrl(model));
    source.addEventListener("init", onInit);
    source.addEventListener("sample", onSample);
    source.addEventListener("end", (event) => {
      source.close();
      setStatus("ended", "server stopped");
      setBanner(`The server stopped (${JSON.parse(event.data).reason}); the charts keep its last samples.`);
    });
    source.onerror = () => {
      if (source.readyState === EventSource.CLOSED) {
        setStatus("lost", "disconnected");
        setBanner("The dashboard's event stream was refused or closed: reload the page.");
      } else {
        setStatus("lost", "reconnecting…");
      }
    };
  }

  $("model").addEventListener("change", (event) => {
    const model = event.target.value;
    params.set("model", model);
    window.history.replaceState(null, "", "?" + params.toString());
    connect(model);
  });
  connect(params.get("model") || "");
})();
