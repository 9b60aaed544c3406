// GGUF Swarm dashboard glue: throughput plot fed by live node rows, chat form reset after sending.
(function () {
  "use strict";
  const WINDOW = 120; // points kept (one per 3 s)

  function startThroughputChart(el) {
    const series = new Map(); // node id -> values
    const xs = [];
    let plot = null;
    function sample() {
      const rows = document.querySelectorAll("tr.node[data-node]");
      xs.push(Date.now() / 1000);
      rows.forEach((tr) => {
        const id = tr.dataset.node;
        if (!series.has(id)) series.set(id, new Array(xs.length - 1).fill(null));
      });
      series.forEach((vals, id) => {
        const tr = document.getElementById("node-" + id);
        vals.push(tr ? parseFloat(tr.dataset.tokS || "0") : null);
      });
      if (xs.length > WINDOW) { xs.shift(); series.forEach((v) => v.shift()); }
      const ids = [...series.keys()];
      const data = [xs.slice(), ...ids.map((id) => series.get(id).slice())];
      if (!plot || plot.series.length !== ids.length + 1) {
        if (plot) plot.destroy();
        plot = new uPlot({
          title: "Throughput per node (tok/s)", width: el.clientWidth || 800, height: 200,
          series: [{}, ...ids.map((id, i) => ({ label: id, stroke: `hsl(${(i * 137) % 360} 60% 45%)` }))],
        }, data, el);
      } else {
        plot.setData(data);
      }
    }
    sample();
    setInterval(sample, 3000);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const chart = document.getElementById("throughput-chart");
    if (chart && window.uPlot) startThroughputChart(chart);
  });

  document.addEventListener("htmx:wsAfterSend", (e) => {
    const form = e.target.closest ? e.target.closest("#chat-form") : null;
    if (form) form.querySelector("textarea").value = "";
  });
})();
