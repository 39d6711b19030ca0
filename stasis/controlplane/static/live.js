// Refreshes the page's live part (#live) in place every few seconds: the server answers the
// same URL with only that part when asked with X-Stasis-Fragment. Paused while the user is in a
// field of it (choosing a node to migrate to) and while the tab is hidden.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live || !live.firstElementChild) { return; }
  var every = parseInt(live.getAttribute("data-refresh-ms") || "3000", 10);
  function busy() {
    var a = document.activeElement;
    return a && live.contains(a) && /^(INPUT|SELECT|TEXTAREA)$/.test(a.tagName);
  }
  function refresh() {
    if (busy() || document.hidden) { setTimeout(refresh, every); return; }
    fetch(location.href, { headers: { "X-Stasis-Fragment": "1" }, credentials: "same-origin" })
      .then(function (r) {
        if (r.status === 401) { location.href = "/ui/login"; return null; }
        return r.ok ? r.text() : null;
      })
      .then(function (html) {
        if (html !== null && html !== undefined && !busy()) { live.innerHTML = html; }
      })
      .catch(function () { /* the next round tries again */ })
      .then(function () { setTimeout(refresh, every); });
  }
  setTimeout(refresh, every);
})();
