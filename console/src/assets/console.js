// shardline console: refreshes the fleet section every 2 s (the server
// renders and escapes it), sends the actions (replay, purge, release,
// reconcile dry run, cancel) with the session's CSRF token, and follows
// running jobs over server-sent events. Every text it sets goes in as
// textContent; HTML comes only from the console's own fragments.
(function () {
  "use strict";

  function csrf() {
    var meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.getAttribute("content") : "";
  }

  // POSTs `body` as JSON; resolves to {ok, status, json}.
  function post(url, body) {
    return fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf() },
      body: JSON.stringify(body || {})
    }).then(function (r) {
      return r.json().then(
        function (j) { return { ok: r.ok, status: r.status, json: j }; },
        function () { return { ok: r.ok, status: r.status, json: {} }; }
      );
    });
  }

  // Replaces `target`'s content with the HTML at `src` (a fragment of ours).
  function refresh(target, src, then) {
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
          target.innerHTML = html;
          if (then) { then(); }
        }
      })
      .catch(function () {});
  }

  var fleet = document.getElementById("fleet");
  if (fleet) {
    setInterval(function () { refresh(fleet, fleet.getAttribute("data-src")); }, 2000);
  }

  // The groups and letters again, after a job changed them.
  function refreshIndexView() {
    var view = document.getElementById("index-view");
    if (!view) { return; }
    fetch(window.location.href, { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("index-view");
        if (fresh) {
          view.innerHTML = fresh.innerHTML;
          bindIndexView();
        }
      })
      .catch(function () {});
  }

  var jobs = document.getElementById("jobs");
  var following = {};

  // Follows one running job's events until it ends.
  function follow(el) {
    var id = el.getAttribute("data-job");
    if (following[id] || el.getAttribute("data-state") !== "running") { return; }
    following[id] = true;
    var source = new EventSource(jobs.getAttribute("data-api") + id + "/events");
    function show(e) {
      var view = JSON.parse(e.data);
      var current = jobs.querySelector('.job[data-job="' + id + '"]') || el;
      current.setAttribute("data-state", view.state);
      current.className = "job job-" + view.state;
      current.querySelector(".state").textContent = view.state;
      current.querySelector(".progress").textContent = view.progress;
      current.querySelector(".lines").textContent = view.lines.join("\n");
      if (view.state !== "running") {
        var cancel = current.querySelector(".cancel");
        if (cancel) { cancel.remove(); }
        if (view.error) {
          var p = document.createElement("p");
          p.className = "error";
          p.textContent = view.error;
          current.insertBefore(p, current.querySelector(".lines"));
        }
      }
    }
    source.addEventListener("progress", show);
    source.addEventListener("end", function (e) {
      show(e);
      source.close();
      delete following[id];
      refreshIndexView();
    });
    source.onerror = function () {
      // The console went away or the job is gone: stop; a reload shows it.
      source.close();
      delete following[id];
    };
  }

  function bindJobs() {
    if (!jobs) { return; }
    Array.prototype.forEach.call(jobs.querySelectorAll(".job"), function (el) {
      follow(el);
      var cancel = el.querySelector(".cancel");
      if (cancel) {
        cancel.addEventListener("click", function () {
          cancel.disabled = true;
          post(jobs.getAttribute("data-api") + el.getAttribute("data-job") + "/cancel");
        });
      }
    });
  }

  function refreshJobs() {
    if (jobs) { refresh(jobs, jobs.getAttribute("data-src"), bindJobs); }
  }

  var say = document.getElementById("action-result");

  function report(text) {
    if (say) { say.textContent = text; }
  }

  // Starts a job with `body` at `path` (under api/) and shows it.
  function start(path, body) {
    var api = document.querySelector(".actions").getAttribute("data-api");
    return post(api + path, body).then(function (r) {
      if (r.status === 202) {
        report("started job " + r.json.job);
        refreshJobs();
      } else {
        report("refused: " + (r.json.error || r.status));
      }
      return r;
    });
  }

  function rate() {
    var input = document.getElementById("replay-rate");
    var value = input ? parseFloat(input.value) : NaN;
    return isNaN(value) ? null : value;
  }

  function selected() {
    return Array.prototype.map.call(
      document.querySelectorAll("input.select:checked"),
      function (box) { return box.value; }
    );
  }

  function bindIndexView() {
    Array.prototype.forEach.call(document.querySelectorAll("button.replay-group"), function (b) {
      b.addEventListener("click", function () {
        b.disabled = true;
        start("dlq/replay", { group: b.getAttribute("data-group"), rate: rate() });
      });
    });
    var all = document.getElementById("select-all");
    if (all) {
      all.addEventListener("change", function () {
        Array.prototype.forEach.call(document.querySelectorAll("input.select"), function (box) {
          box.checked = all.checked;
        });
      });
    }
    var replaySelected = document.getElementById("replay-selected");
    if (replaySelected) {
      replaySelected.addEventListener("click", function () {
        var ids = selected();
        if (ids.length === 0) { report("select letters first"); return; }
        start("dlq/replay", { ids: ids, rate: rate() });
      });
    }
    var purge = document.getElementById("purge-selected");
    var confirmBox = document.getElementById("purge-confirm");
    if (purge && confirmBox) {
      var pending = [];
      purge.addEventListener("click", function () {
        pending = selected();
        if (pending.length === 0) { report("select letters first"); return; }
        // Without "confirm" the console deletes nothing and says how many it would.
        start("dlq/purge", { ids: pending }).then(function (r) {
          if (r.status === 400 && typeof r.json.would_purge === "number") {
            document.getElementById("purge-confirm-text").textContent =
              "Purge " + r.json.would_purge + " letter(s) for good? They cannot be replayed afterwards.";
            confirmBox.hidden = false;
            report("");
          }
        });
      });
      document.getElementById("purge-confirm-yes").addEventListener("click", function () {
        confirmBox.hidden = true;
        start("dlq/purge", { ids: pending, confirm: true });
      });
      document.getElementById("purge-confirm-no").addEventListener("click", function () {
        confirmBox.hidden = true;
        report("nothing purged");
      });
    }
  }

  bindIndexView();
  bindJobs();

  var dryRun = document.getElementById("reconcile-dry-run");
  if (dryRun) {
    dryRun.addEventListener("click", function () {
      post(dryRun.getAttribute("data-api")).then(function (r) {
        report(r.status === 202 ? "started job " + r.json.job : "refused: " + (r.json.error || r.status));
        refreshJobs();
      });
    });
  }

  var release = document.getElementById("release");
  if (release) {
    release.addEventListener("submit", function (e) {
      e.preventDefault();
      var out = document.getElementById("release-result");
      post(release.getAttribute("data-api"), { order_id: release.elements["order_id"].value })
        .then(function (r) {
          out.textContent = r.ok
            ? "released: held by " + r.json.held_by.length + " letter(s), " + r.json.letters_in_dlq + " letter(s) of the order stay in the DLQ"
            : "refused: " + (r.json.error || r.status);
        })
        .catch(function (err) { out.textContent = "failed: " + err; });
    });
  }
})();
