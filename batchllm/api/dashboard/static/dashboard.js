// Each element with data-live-url is the live part of its page: while it says something runs
// (data-running="1"), fetch a fresh copy every two seconds and put it in its place; a list with
// nothing running (data-running="idle") looks every four seconds, for new jobs. The server
// renders everything; a finished job's copy says data-running="0" and the fetching stops.
(function () {
  "use strict";
  var tick = 0;
  function refresh(part) {
    var running = part.dataset.running;
    if (running === "0" || part.dataset.busy === "1") return;
    if (running === "idle" && tick % 2 !== 0) return;
    part.dataset.busy = "1";
    fetch(part.dataset.liveUrl, { credentials: "same-origin" })
      .then(function (response) {
        if (response.status === 401) { window.location.reload(); return null; }
        return response.ok ? response.text() : null;
      })
      .then(function (html) {
        if (html === null) { part.dataset.busy = "0"; return; }
        part.outerHTML = html;
      })
      .catch(function () { part.dataset.busy = "0"; });
  }
  window.setInterval(function () {
    tick += 1;
    document.querySelectorAll("[data-live-url]").forEach(refresh);
  }, 2000);
})();
