// Live regions: each page has one #live element and one server-sent-events stream
// (data-events) that sends the region again, rendered on the server, at the
// server's sampling interval. Nothing here polls.
(function () {
  "use strict";
  var live = document.getElementById("live");
  var status = document.getElementById("live-status");
  function say(text) { if (status) { status.textContent = text; } }
  if (!live || !live.dataset.events) { return; }
  if (!window.EventSource) { say("live updates need a browser with EventSource; reload to refresh"); return; }
  var pending = null;
  function editing() {
    var a = document.activeElement;
    return a && live.contains(a) && /^(INPUT|SELECT|TEXTAREA)$/.test(a.tagName);
  }
  function apply(html) {
    if (editing()) { pending = html; say("live · paused while you edit"); return; }
    // Keep keyboard focus on the same control (ids are stable across renders).
    var a = document.activeElement;
    var keep = a && live.contains(a) && a.id ? a.id : null;
    live.innerHTML = html;
    pending = null;
    live.dataset.updates = String(Number(live.dataset.updates || "0") + 1);
    if (keep) { var again = document.getElementById(keep); if (again) { again.focus(); } }
    say("live · updated " + new Date().toLocaleTimeString());
  }
  live.addEventListener("focusout", function () {
    window.setTimeout(function () { if (pending !== null && !editing()) { apply(pending); } }, 0);
  });
  var source = new EventSource(live.dataset.events);
  source.addEventListener("open", function () { say("live"); });
  source.addEventListener("live", function (e) { apply(e.data); });
  source.addEventListener("gone", function (e) { say("gone: " + e.data); source.close(); });
  source.addEventListener("trouble", function (e) { say("trouble reading Redis: " + e.data); });
  source.addEventListener("error", function () { say("reconnecting…"); });
  window.addEventListener("pagehide", function () { source.close(); });
})();
