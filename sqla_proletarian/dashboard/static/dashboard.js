// The overview's live figures: polls the JSON of the queues every few seconds and updates
// the table in place (rows added, removed or reordered by queue name), with a small uPlot
// chart per queue of what succeeded and failed each minute of the last hour. Text goes in
// with textContent only: a queue name is never read as HTML.
(function () {
  "use strict";
  var table = document.getElementById("queues");
  if (!table) return;
  var body = table.tBodies[0];
  var blank = document.getElementById("queue-row");
  var empty = document.getElementById("no-queues");
  var stamp = document.getElementById("generated-at");
  var state = document.getElementById("refresh-status");
  var source = table.getAttribute("data-source");
  var every = Number(table.getAttribute("data-refresh-ms")) || 5000;
  var charts = {};
  var minutes = [];

  function pausedText(paused) {
    return paused === null ? "\u2014" : paused ? "paused" : "no";
  }

  function chartFor(row, queue, data) {
    var series = [minutes, data.chart.succeeded, data.chart.failed];
    if (charts[queue]) {
      charts[queue].setData(series);
      return;
    }
    var place = row.querySelector(".chart");
    if (!place || typeof uPlot === "undefined") return;
    charts[queue] = new uPlot({
      width: 180,
      height: 40,
      legend: { show: false },
      cursor: { show: false },
      scales: { x: { time: true } },
      axes: [{ show: false }, { show: false }],
      series: [
        {},
        { label: "succeeded", stroke: "#2b8a3e", fill: "rgba(43,138,62,0.15)", width: 1 },
        { label: "failed", stroke: "#c92a2a", width: 1 },
      ],
    }, series, place);
  }

  function fill(row, data) {
    row.setAttribute("data-queue", data.queue);
    row.querySelectorAll("[data-field]").forEach(function (cell) {
      var name = cell.getAttribute("data-field");
      cell.textContent = name === "paused" ? pausedText(data.paused) : String(data[name]);
      var link = cell.getAttribute("data-link");
      if (link !== null) cell.setAttribute("href", link + encodeURIComponent(data.queue));
    });
    row.querySelectorAll("input[name=queue]").forEach(function (input) {
      input.value = data.queue;
    });
    var pause = row.querySelector(".pause");
    var resume = row.querySelector(".resume");
    if (pause) pause.hidden = data.paused === true;
    if (resume) resume.hidden = data.paused !== true;
    var total = data.chart.succeeded.reduce(add, 0) + data.chart.failed.reduce(add, 0);
    row.querySelector(".chart").setAttribute("title", total + " finished in the last hour");
  }

  function add(a, b) {
    return a + b;
  }

  function render(data) {
    minutes = data.minutes;
    var rows = {};
    Array.prototype.forEach.call(body.rows, function (row) {
      rows[row.getAttribute("data-queue")] = row;
    });
    var seen = {};
    data.queues.forEach(function (queue) {
      var row = rows[queue.queue];
      if (!row) row = blank.content.firstElementChild.cloneNode(true);
      fill(row, queue);
      body.appendChild(row); // in the data's order: sorted by queue name
      chartFor(row, queue.queue, queue);
      seen[queue.queue] = true;
    });
    Object.keys(rows).forEach(function (name) {
      if (!seen[name]) {
        body.removeChild(rows[name]);
        if (charts[name]) charts[name].destroy();
        delete charts[name];
      }
    });
    empty.hidden = data.queues.length > 0;
    stamp.textContent = data.updated;
    stamp.setAttribute("datetime", data.generated_at);
    var lag = document.getElementById("replica-lag");
    if (lag && data.replica_lag) lag.textContent = data.replica_lag.text;
  }

  function refresh() {
    if (document.hidden) return;
    fetch(source, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.json();
      })
      .then(function (data) {
        render(data);
        state.textContent = "";
      })
      .catch(function (error) {
        state.textContent = "Refresh failed (" + error.message + "); retrying.";
      });
  }

  render(JSON.parse(document.getElementById("overview-data").textContent));
  setInterval(refresh, every);
})();
