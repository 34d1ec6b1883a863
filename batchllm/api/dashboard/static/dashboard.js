// Each element with data-live-url is the live part of its page: while it says something runs
// (data-running="1"), fetch a fresh copy every two seconds and put it in its place. The server
// renders everything; a finished job's copy says data-running="0" and the fetching stops.
(function () {
  "use strict";
  function refresh(part) {
    if (part.dataset.running !== "1" || part.dataset.busy === "1") return;
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
    document.querySelectorAll("[data-live-url]").forEach(refresh);
  }, 2000);
})();
