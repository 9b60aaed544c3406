// GGUF Swarm dashboard glue: live throughput plot (seeded from history), latency plot of recent answers.
// The playground has its own script, playground.js.
(function () {
  "use strict";
  const WINDOW = 600; // points kept per series

  function colour(i) { return `hsl(${(i * 137) % 360} 60% 45%)`; }

  function startThroughputChart(el) {
    const seed = JSON.parse(document.getElementById("throughput-history")?.textContent || "{}");
    const points = new Map(); // node id -> [[t, v], ...]
    Object.entries(seed).forEach(([id, pts]) => points.set(id, pts.slice(-WINDOW)));
    let plot = null;
    function draw() {
      const ids = [...points.keys()];
      const xs = [...new Set(ids.flatMap((id) => points.get(id).map((p) => p[0])))].sort((a, b) => a - b);
      const data = [xs, ...ids.map((id) => {
        const m = new Map(points.get(id).map((p) => [p[0], p[1]]));
        return xs.map((x) => (m.has(x) ? m.get(x) : null));
      })];
      if (plot) plot.destroy();
      plot = new uPlot({
        title: "Throughput per node (tokens/s)", width: el.clientWidth || 800, height: 200,
        spanGaps: true,
        series: [{}, ...ids.map((id, i) => ({ label: id, stroke: colour(i) }))],
      }, data, el);
    }
    function sample() {
      const now = Date.now() / 1000;
      document.querySelectorAll("tr.node[data-node]").forEach((tr) => {
        const id = tr.dataset.node;
        if (!points.has(id)) points.set(id, []);
        const pts = points.get(id);
        pts.push([now, parseFloat(tr.dataset.tokS || "0")]);
        if (pts.length > WINDOW) pts.shift();
      });
      draw();
    }
    sample();
    setInterval(sample, 3000);
  }

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
    const chart = document.getElementById("throughput-chart");
    if (chart && window.uPlot) startThroughputChart(chart);
  });

  document.addEventListener("htmx:afterSwap", (e) => {
    const latency = document.getElementById("latency-chart");
    if (latency && window.uPlot && e.target.id === "generations") drawLatency(latency);
  });
})();
