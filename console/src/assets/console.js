// shardline console: refreshes the fleet table every 2 s (the server renders
// and escapes it) and sends the release action with the session's CSRF token.
(function () {
  "use strict";
  var fleet = document.getElementById("fleet");
  if (fleet) {
    var src = fleet.getAttribute("data-src");
    setInterval(function () {
      fetch(src, { credentials: "same-origin" })
        .then(function (r) {
          if (r.status === 401) {
            window.location.reload();
            return null;
          }
          return r.ok ? r.text() : null;
        })
        .then(function (html) {
          if (html !== null) {
            fleet.innerHTML = html;
          }
        })
        .catch(function () {});
    }, 2000);
  }

  var release = document.getElementById("release");
  if (release) {
    release.addEventListener("submit", function (e) {
      e.preventDefault();
      var out = document.getElementById("release-result");
      var csrf = document.querySelector('meta[name="csrf-token"]').getAttribute("content");
      fetch(release.getAttribute("data-api"), {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify({ order_id: release.elements["order_id"].value })
      })
        .then(function (r) {
          return r.json().then(function (j) {
            out.textContent = r.ok
              ? "released: held by " + j.held_by.length + " letter(s), " + j.letters_in_dlq + " letter(s) of the order stay in the DLQ"
              : "refused: " + (j.error || r.status);
          });
        })
        .catch(function (err) {
          out.textContent = "failed: " + err;
        });
    });
  }
})();
