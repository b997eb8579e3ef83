// The Run page's live timeline: the journal entries that commit after the page was made are
// added to its table as they come, from the run's event stream (GET /api/runs/{id}/events,
// Server-Sent Events). EventSource reconnects by itself and sends the last id it received
// (Last-Event-ID), so no entry is shown twice or missed; the stream, and this, stop at the
// run's terminal entry. Without script the page shows the timeline as it was when loaded.
(function () {
  "use strict";
  var table = document.querySelector("table.timeline[data-events]");
  if (!table || !window.EventSource) { return; }
  var body = table.tBodies[0];
  var empty = document.getElementById("timeline-empty");
  var ends = table.getAttribute("data-ends").split(" ");
  var source = new EventSource(table.getAttribute("data-events") + "?after=" +
                               table.getAttribute("data-after"));
  function cell(row, text, tag) {
    var td = row.insertCell(-1);
    var inner = tag ? td.appendChild(document.createElement(tag)) : td;
    if (tag === "pre") { inner.className = "json small"; }
    inner.textContent = text;
  }
  function when(iso) {
    var moment = new Date(iso);
    return isNaN(moment) ? iso : moment.toISOString().slice(0, 19).replace("T", " ") + "Z";
  }
  function add(event) {
    var e = JSON.parse(event.data);
    var row = body.insertRow(-1);
    var payload = JSON.stringify(e.payload, null, 2);
    row.className = "live";
    row.setAttribute("data-seq", e.seq);
    cell(row, String(e.seq));
    cell(row, when(e.at));
    cell(row, e.position === null ? "" : String(e.position));
    cell(row, e.kind, "code");
    cell(row, e.name || "");
    cell(row, payload.length > 2000 ? payload.slice(0, 2000) + "\n…" : payload, "pre");
    table.hidden = false;
    if (empty) { empty.remove(); empty = null; }
    if (ends.indexOf(e.kind) >= 0) { finish(e.kind); }
  }
  function finish(how) {
    source.close();
    table.setAttribute("data-ended", how);
  }
  table.getAttribute("data-kinds").split(" ").forEach(function (kind) {
    source.addEventListener(kind, add);
  });
  source.addEventListener("stream.error", function () { finish("stream.error"); });
})();
