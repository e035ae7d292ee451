/* inference-lab: chart helpers shared by the live dashboard and sim reports (uPlot). */
"use strict";

window.LabCharts = (function () {
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#6b7280"];

  /** A uPlot plugin drawing a dashed vertical line, labelled, at each marker's x. */
  function markersPlugin(getMarkers) {
    return {
      hooks: {
        draw: [
          (u) => {
            const markers = getMarkers();
            if (!markers || !markers.length) return;
            const ctx = u.ctx;
            const top = u.bbox.top;
            const bottom = u.bbox.top + u.bbox.height;
            ctx.save();
            ctx.strokeStyle = "#b45309";
            ctx.fillStyle = "#b45309";
            ctx.lineWidth = Math.max(1, devicePixelRatio);
            ctx.setLineDash([5 * devicePixelRatio, 4 * devicePixelRatio]);
            ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
            ctx.textAlign = "left";
            ctx.textBaseline = "top";
            markers.forEach((m, i) => {
              const x = Math.round(u.valToPos(m.x, "x", true));
              if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
              ctx.beginPath();
              ctx.moveTo(x, top);
              ctx.lineTo(x, bottom);
              ctx.stroke();
              // labels on three staggered rows, so that close changes stay readable
              const y = top + (2 + (i % 3) * 13) * devicePixelRatio;
              ctx.fillText(m.label, x + 4 * devicePixelRatio, y);
            });
            ctx.restore();
          },
        ],
      },
    };
  }

  /**
   * A line chart in `parent`: `spec.series` is a list of {label, stroke?, dash?, stepped?};
   * `spec.time` true for a wall-clock x axis (unix seconds), false for plain seconds;
   * `spec.markers` a function returning [{x, label}] drawn as vertical lines.
   */
  function lineChart(parent, spec) {
    const box = document.createElement("div");
    box.className = "chart";
    box.id = spec.id || "";
    const h = document.createElement("h3");
    h.textContent = spec.title;
    box.appendChild(h);
    parent.appendChild(box);
    const series = [{ label: spec.xLabel || (spec.time ? "time" : "s") }];
    spec.series.forEach((s, i) => {
      const entry = {
        label: s.label,
        stroke: s.stroke || COLORS[i % COLORS.length],
        width: 1.5,
        spanGaps: false,
        points: { show: false },
      };
      if (s.dash) entry.dash = s.dash;
      if (s.stepped) entry.paths = uPlot.paths.stepped({ align: 1 });
      if (s.fill) entry.fill = s.fill;
      series.push(entry);
    });
    const opts = {
      width: Math.max(280, box.clientWidth || parent.clientWidth || 480),
      height: spec.height || 200,
      scales: { x: { time: !!spec.time }, y: spec.yRange ? { range: spec.yRange } : {} },
      axes: [
        { label: spec.time ? "" : spec.xLabel || "" },
        { label: spec.yLabel || "", size: 60 },
      ],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      series: series,
      plugins: spec.markers ? [markersPlugin(spec.markers)] : [],
    };
    const empty = series.map(() => []);
    const chart = new uPlot(opts, spec.data || empty, box);
    chart.labBox = box;
    return chart;
  }

  /** Keep every chart as wide as its box. */
  function fitWidths(charts) {
    const resize = () => {
      for (const c of charts) {
        const w = Math.max(280, c.labBox.clientWidth);
        if (Math.abs(w - c.width) > 2) c.setSize({ width: w, height: c.height });
      }
    };
    window.addEventListener("resize", resize);
    return resize;
  }

  /** A number for a tile or a table: "–" for null, else with `digits` decimals. */
  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString("en-US", {
      minimumFractionDigits: digits || 0,
      maximumFractionDigits: digits || 0,
    });
  }

  return { COLORS, lineChart, fitWidths, fmt, markersPlugin };
})();
