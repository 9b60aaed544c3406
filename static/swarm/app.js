// GGUF Swarm dashboard glue: live throughput and batching-per-hop plots (seeded from history), latency plot
// of recent answers.
// The playground has its own script, playground.js.
(function () {
  "use strict";
  const WINDOW = 600; // points kept per series

  function colour(i) { return `hsl(${(i * 137) % 360} 60% 45%)`; }

  // A plot of per-node series, seeded from a json_script of {node id: [[t, v1, v2, ...], ...]} and
  // sampled every 3 s from the node rows' data attributes (kept current by the fleet websocket).
  // `fields` name, per point value, the row attribute and how its series is drawn (label suffix,
  // uPlot scale, dash); every series of one node shares the node's colour.
  function startLiveChart(el, { seedId, title, fields, axes }) {
    const seed = JSON.parse(document.getElementById(seedId)?.textContent || "{}");
    const points = new Map(); // node id -> [[t, v1, v2, ...], ...]
    Object.entries(seed).forEach(([id, pts]) => points.set(id, pts.slice(-WINDOW)));
    let plot = null;
    function draw() {
      const ids = [...points.keys()];
      const xs = [...new Set(ids.flatMap((id) => points.get(id).map((p) => p[0])))].sort((a, b) => a - b);
      const data = [xs];
      const series = [{}];
      ids.forEach((id, i) => {
        const m = new Map(points.get(id).map((p) => [p[0], p]));
        fields.forEach((f, k) => {
          data.push(xs.map((x) => (m.has(x) ? m.get(x)[k + 1] ?? null : null)));
          const s = { label: id + (f.suffix || ""), stroke: colour(i) };
          if (f.scale) s.scale = f.scale;
          if (f.dash) s.dash = f.dash;
          series.push(s);
        });
      });
      if (plot) plot.destroy();
      plot = new uPlot({
        title, width: el.clientWidth || 800, height: 200, spanGaps: true, series, ...(axes ? { axes } : {}),
      }, data, el);
    }
    function sample() {
      const now = Date.now() / 1000;
      document.querySelectorAll("tr.node[data-node]").forEach((tr) => {
        const id = tr.dataset.node;
        if (!points.has(id)) points.set(id, []);
        const pts = points.get(id);
        pts.push([now, ...fields.map((f) => parseFloat(tr.dataset[f.attr] || "0") || 0)]);
        if (pts.length > WINDOW) pts.shift();
      });
      draw();
    }
    sample();
    setInterval(sample, 3000);
  }

  const THROUGHPUT = {
    seedId: "throughput-history", title: "Throughput per node (tokens/s)", fields: [{ attr: "tokS" }],
  };
  // Batch size (steps per backend call) on the left axis; queue wait and compute, in ms, on the right.
  const BATCHING = {
    seedId: "batching-history",
    title: "Batching per hop: batch size (solid), queue wait (dashed) and compute (dotted) in ms",
    fields: [
      { attr: "batchSteps", suffix: " batch", scale: "steps" },
      { attr: "queueWaitMs", suffix: " wait ms", scale: "ms", dash: [6, 4] },
      { attr: "batchComputeMs", suffix: " compute ms", scale: "ms", dash: [2, 3] },
    ],
    axes: [{}, { scale: "steps", label: "batch size" }, { scale: "ms", side: 1, label: "ms", grid: { show: false } }],
  };

  function drawLatency(el) {
    const rows = [...document.querySelectorAll("#generations tr.generation")].reverse();
    if (!rows.length) return;
    const xs = rows.map((r) => parseFloat(r.dataset.ts));
    const data = [xs, rows.map((r) => parseFloat(r.dataset.ttft)), rows.map((r) => parseFloat(r.dataset.toks))];
    el.innerHTML = "";
    new uPlot({
      title: "Recent answers: time to first token (ms) and tokens/s", width: el.clientWidth || 800, height: 180,
      series: [{}, { label: "TTFT ms", stroke: colour(1), scale: "ms" },
               { label: "tok/s", stroke: colour(2), scale: "tps" }],
      axes: [{}, { scale: "ms" }, { scale: "tps", side: 1 }],
    }, data, el);
  }

  document.addEventListener("DOMContentLoaded", () => {
    if (!window.uPlot) return;
    const chart = document.getElementById("throughput-chart");
    if (chart) startLiveChart(chart, THROUGHPUT);
    const batching = document.getElementById("batching-chart");
    if (batching) startLiveChart(batching, BATCHING);
  });

  document.addEventListener("htmx:afterSwap", (e) => {
    const latency = document.getElementById("latency-chart");
    if (latency && window.uPlot && e.target.id === "generations") drawLatency(latency);
  });
})();
