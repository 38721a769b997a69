//! `shardline console` in-process against a running worker and a dead
//! letter it made: tokens, the session cookie, Host/Origin/CSRF checks, the
//! security headers, the JSON API, and hostile index text rendered as text.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use reqwest::StatusCode;
use reqwest::header::{self, HeaderMap};
use shardline_ops::ReconcileConfig;
use shardline_testkit::console::{ADMIN, ServedConsole, VIEWER};
use shardline_testkit::dlq::{wait_depth, wait_indexed};
use shardline_testkit::wait::check;
use shardline_testkit::{
    ChildWorker, Downstream, Event, OrdersDb, PROCESSING, Publisher, STARTUP, TestEnv, wait_until,
};

/// The console of `env` and an HTTP client that does not follow redirects.
struct Console {
    addr: SocketAddr,
    served: ServedConsole,
    http: reqwest::Client,
}

impl Console {
    async fn start(env: &TestEnv) -> Self {
        Self::start_with(env, None).await
    }

    /// With the order database of a reconcile dry run.
    async fn start_with(env: &TestEnv, reconcile: Option<ReconcileConfig>) -> Self {
        let served = ServedConsole::start(env, reconcile).await;
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        Self {
            addr: served.addr,
            served,
            http,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Logs in through the form; the session cookie (`name=value`) and the
    /// whole `Set-Cookie`.
    async fn login(&self, token: &str, extra: &[(&str, &str)]) -> (String, String) {
        let mut req = self
            .http
            .post(self.url("/login"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(format!("token={token}"));
        for (name, value) in extra {
            req = req.header(*name, *value);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::SEE_OTHER);
        assert_eq!(resp.headers()[header::LOCATION], "/");
        let set = resp.headers()[header::SET_COOKIE]
            .to_str()
            .unwrap()
            .to_owned();
        let cookie = set.split(';').next().unwrap().to_owned();
        (cookie, set)
    }

    async fn get(&self, path: &str, cookie: &str) -> reqwest::Response {
        self.http
            .get(self.url(path))
            .header(header::COOKIE, cookie)
            .send()
            .await
            .unwrap()
    }

    /// An admin's session cookie and its CSRF token.
    async fn admin_session(&self) -> (String, String) {
        let (cookie, _) = self.login(ADMIN, &[]).await;
        let csrf = self.json("/api/me", &cookie).await["csrf"]
            .as_str()
            .unwrap()
            .to_owned();
        (cookie, csrf)
    }

    /// The page at `path`, as text.
    async fn page(&self, path: &str, cookie: &str) -> String {
        self.get(path, cookie).await.text().await.unwrap()
    }

    async fn json(&self, path: &str, cookie: &str) -> serde_json::Value {
        let resp = self.get(path, cookie).await;
        assert_eq!(resp.status(), StatusCode::OK, "GET {path}");
        serde_json::from_str(&resp.text().await.unwrap()).unwrap()
    }

    async fn stop(self) {
        self.served.stop().await;
    }
}

/// `field` of the first item of the JSON array `list` whose `reason` is `reason`.
fn by_reason(list: &serde_json::Value, reason: &str, field: &str) -> String {
    list.as_array()
        .unwrap()
        .iter()
        .find(|item| item["reason"] == reason)
        .unwrap_or_else(|| panic!("no {reason} item in {list:#}"))[field]
        .as_str()
        .unwrap()
        .to_owned()
}

fn assert_security_headers(headers: &HeaderMap) {
    let csp = headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
    assert!(csp.starts_with("default-src 'self'"), "{csp}");
    assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    assert_eq!(headers[header::REFERRER_POLICY], "same-origin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_serves_the_fleet_and_its_dead_letters_behind_a_token() {
    let env = TestEnv::new("console").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let x = Event::new("console-x", 1, env.shards);
    let downstream =
        Downstream::failing_until_fixed(x.key(), Arc::new(AtomicBool::new(false))).await;
    let mut worker = env.start_worker("w1", &downstream, |_| {}).await;
    Publisher::connect(&env)
        .await
        .publish(std::slice::from_ref(&x))
        .await;
    wait_depth(&env, &conn, 1, PROCESSING).await;
    wait_indexed(&env, 1, PROCESSING).await;

    let console = Console::start(&env).await;

    // Without a token: the API says 401, a page sends to the login form;
    // every response carries the security headers.
    let resp = console
        .http
        .get(console.url("/api/fleet"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_security_headers(resp.headers());
    let resp = console.http.get(console.url("/")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::SEE_OTHER);
    assert_eq!(resp.headers()[header::LOCATION], "/login");
    let resp = console
        .http
        .get(console.url("/login"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_security_headers(resp.headers());
    assert!(resp.text().await.unwrap().contains("name=\"token\""));
    let wrong = console
        .http
        .get(console.url("/api/me"))
        .bearer_auth("admin-token-0123456780")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    let refused = console
        .http
        .post(console.url("/login"))
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body("token=not-a-token-at-all")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert!(refused.headers().get(header::SET_COOKIE).is_none());

    // Login: an HttpOnly, SameSite=Strict cookie on the base path; Secure
    // when a proxy says the request came over TLS.
    let (cookie, set) = console.login(ADMIN, &[]).await;
    assert!(set.starts_with("shardline_session="), "{set}");
    assert!(set.contains("HttpOnly"), "{set}");
    assert!(set.contains("SameSite=Strict"), "{set}");
    assert!(set.contains("Path=/"), "{set}");
    assert!(!set.contains("Secure"), "{set}");
    let (_, behind_tls) = console
        .login(ADMIN, &[("x-forwarded-proto", "https")])
        .await;
    assert!(behind_tls.contains("; Secure"), "{behind_tls}");
    let me = console.json("/api/me", &cookie).await;
    assert_eq!(me["name"], "ops", "{me}");
    assert_eq!(me["role"], "admin", "{me}");
    let csrf = me["csrf"].as_str().unwrap().to_owned();
    assert_eq!(csrf.len(), 64, "{me}");

    // The fleet: every shard with its owner, the worker's breaker.
    let (on, session, shards) = (&console, cookie.as_str(), usize::from(env.shards.get()));
    let fleet = wait_until(
        "every shard owned by w1 in /api/fleet",
        PROCESSING,
        || async move {
            let fleet = on.json("/api/fleet", session).await;
            let listed = fleet["shards"].as_array().cloned().unwrap_or_default();
            let owned = listed.iter().filter(|s| s["owner"] == "w1").count();
            check(listed.len() == shards && owned == shards, || {
                format!("{fleet:#}")
            })
            .map(|()| fleet)
        },
    )
    .await;
    assert_eq!(fleet["shards"][0]["level"], "OK", "{fleet:#}");
    assert_eq!(fleet["workers"][0]["worker"], "w1", "{fleet:#}");
    assert_eq!(fleet["dead_letter_queue"]["messages"], 1, "{fleet:#}");
    assert_eq!(fleet["dead_letter_queue"]["indexed"], 1, "{fleet:#}");
    let page = console.get("/", &cookie).await;
    assert_eq!(page.status(), StatusCode::OK);
    assert_security_headers(page.headers());
    let page = page.text().await.unwrap();
    assert!(page.contains("<td>w1</td>"), "{page}");
    assert!(page.contains("class=\"level-ok\""), "{page}");
    let fragment = console.page("/fragment/fleet", &cookie).await;
    assert!(fragment.contains("<td>w1</td>"), "{fragment}");

    // The dead letter's failure group and its letter.
    let groups = console.json("/api/dlq/groups", &cookie).await;
    let group = &groups["groups"][0];
    assert_eq!(groups["groups"].as_array().unwrap().len(), 1, "{groups:#}");
    assert_eq!(group["reason"], "handler", "{groups:#}");
    assert_eq!(group["count"], 1, "{groups:#}");
    assert_eq!(group["orders"], 1, "{groups:#}");
    assert!(group["first_failed_at"].is_string(), "{groups:#}");
    let id = group["group"].as_str().unwrap();
    let letters = console
        .json(&format!("/api/dlq/letters?group={id}&reason="), &cookie)
        .await;
    assert_eq!(
        letters["letters"][0]["order_id"], "console-x",
        "{letters:#}"
    );
    assert_eq!(letters["letters"][0]["seq"], 1, "{letters:#}");
    assert_eq!(
        letters["dead_letters"], letters["letters"],
        "one name with `dlq list --json`, the old one still served"
    );
    let by_order = console
        .json("/api/dlq/letters?order=console-x&reason=handler", &cookie)
        .await;
    assert_eq!(by_order["letters"].as_array().unwrap().len(), 1);
    let none = console
        .json("/api/dlq/letters?reason=decode", &cookie)
        .await;
    assert_eq!(none["letters"].as_array().unwrap().len(), 0, "{none:#}");
    let later = console
        .json("/api/dlq/letters?from=2999-01-01T00:00:00Z", &cookie)
        .await;
    assert_eq!(later["letters"].as_array().unwrap().len(), 0, "{later:#}");
    let bad = console.get("/api/dlq/letters?shard=x", &cookie).await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);

    // The action: admin with the session's CSRF token only, same origin only.
    let release = |cookie: &str| {
        console
            .http
            .post(console.url("/api/dlq/release"))
            .header(header::COOKIE, cookie)
            .header(header::CONTENT_TYPE, "application/json")
            .body(r#"{"order_id": "console-x"}"#)
    };
    let no_csrf = release(cookie.as_str()).send().await.unwrap();
    assert_eq!(no_csrf.status(), StatusCode::FORBIDDEN);
    let wrong_csrf = release(cookie.as_str())
        .header("x-csrf-token", "0".repeat(64))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong_csrf.status(), StatusCode::FORBIDDEN);
    let foreign = release(cookie.as_str())
        .header("x-csrf-token", &csrf)
        .header(header::ORIGIN, "http://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(foreign.status(), StatusCode::FORBIDDEN);
    assert_security_headers(foreign.headers());
    let released = release(cookie.as_str())
        .header("x-csrf-token", &csrf)
        .header(header::ORIGIN, format!("http://{}", console.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(released.status(), StatusCode::OK);
    let released: serde_json::Value =
        serde_json::from_str(&released.text().await.unwrap()).unwrap();
    assert_eq!(released["order_id"], "console-x", "{released}");
    assert_eq!(released["letters_in_dlq"], 1, "{released}");

    // A read-only token looks but may not act, by cookie or by bearer.
    let viewer = console
        .http
        .get(console.url("/api/fleet"))
        .bearer_auth(VIEWER)
        .send()
        .await
        .unwrap();
    assert_eq!(viewer.status(), StatusCode::OK);
    let viewer_post = console
        .http
        .post(console.url("/api/dlq/release"))
        .bearer_auth(VIEWER)
        .header(header::CONTENT_TYPE, "application/json")
        .body(r#"{"order_id": "console-x"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(viewer_post.status(), StatusCode::FORBIDDEN);
    let (viewer_cookie, _) = console.login(VIEWER, &[]).await;
    let viewer_csrf = console.json("/api/me", &viewer_cookie).await["csrf"]
        .as_str()
        .unwrap()
        .to_owned();
    let viewer_post = release(viewer_cookie.as_str())
        .header("x-csrf-token", &viewer_csrf)
        .send()
        .await
        .unwrap();
    assert_eq!(viewer_post.status(), StatusCode::FORBIDDEN);
    let viewer_page = console.get("/dead-letters", &viewer_cookie).await;
    assert!(!viewer_page.text().await.unwrap().contains("id=\"release\""));

    // DNS rebinding: a foreign Host is refused before anything else;
    // localhost on the console's port is fine.
    let rebound = console
        .http
        .get(console.url("/login"))
        .header(
            header::HOST,
            format!("evil.example:{}", console.addr.port()),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), StatusCode::MISDIRECTED_REQUEST);
    assert_security_headers(rebound.headers());
    let rebound = console
        .http
        .get(console.url("/api/fleet"))
        .header(header::HOST, "evil.example")
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), StatusCode::MISDIRECTED_REQUEST);
    let local = console
        .http
        .get(console.url("/login"))
        .header(header::HOST, format!("localhost:{}", console.addr.port()))
        .send()
        .await
        .unwrap();
    assert_eq!(local.status(), StatusCode::OK);

    // Hostile text in the index (a group's description) renders as text.
    let hostile =
        "handler\n<script>alert(1)</script>\u{202e}gnp.exe\u{200b}\0<img src=x onerror=alert(1)>";
    let mut redis = env.redis().await;
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(env.keys().dlq_groups())
        .arg("hostile00001")
        .arg(hostile)
        .cmd("ZADD")
        .arg(env.keys().dlq_group("hostile00001"))
        .arg(1)
        .arg("no-such-letter")
        .query_async(&mut redis)
        .await
        .unwrap();
    let page = console.get("/dead-letters", &cookie).await;
    assert_eq!(page.status(), StatusCode::OK);
    assert_security_headers(page.headers());
    let page = page.text().await.unwrap();
    assert!(
        page.contains(
            "&lt;script&gt;alert(1)&lt;/script&gt;\\u{202e}gnp.exe\\u{200b}\\u{0}&lt;img"
        ),
        "{page}"
    );
    assert!(
        !page.contains("<script>alert") && !page.contains("<img"),
        "{page}"
    );
    assert!(!page.contains(['\u{202e}', '\u{200b}', '\0']), "{page}");
    assert!(page.contains("id=\"release\""), "an admin sees the action");

    // Logout ends the session (the form's CSRF field).
    let out = console
        .http
        .post(console.url("/logout"))
        .header(header::COOKIE, &cookie)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(format!("csrf={csrf}"))
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        console.get("/api/me", &cookie).await.status(),
        StatusCode::UNAUTHORIZED
    );

    console.stop().await;
    worker.assert_running().await;
}

impl Console {
    /// A POST of `body` as JSON with the session's CSRF token.
    async fn post(&self, path: &str, cookie: &str, csrf: &str, body: &str) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .header(header::COOKIE, cookie)
            .header("x-csrf-token", csrf)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap()
    }

    /// Follows job `id`'s server-sent events to its `end` event; the job's
    /// last view and how many `progress` events came before.
    async fn follow(&self, id: u64, cookie: &str) -> (serde_json::Value, usize) {
        use futures_util::StreamExt as _;
        let resp = self.get(&format!("/api/jobs/{id}/events"), cookie).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "text/event-stream");
        let mut stream = resp.bytes_stream();
        let (mut text, mut progress) = (String::new(), 0);
        let follow = async {
            while let Some(chunk) = stream.next().await {
                text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
                while let Some(end) = text.find("\n\n") {
                    let event: String = text.drain(..end + 2).collect();
                    let data = event
                        .lines()
                        .find_map(|l| l.strip_prefix("data: "))
                        .unwrap_or("null");
                    if event.starts_with("event: end") {
                        return serde_json::from_str::<serde_json::Value>(data).unwrap();
                    }
                    progress += usize::from(event.starts_with("event: progress"));
                }
            }
            panic!("the events of job {id} ended without an end event: {text}");
        };
        let view = tokio::time::timeout(PROCESSING, follow).await.unwrap();
        (view, progress)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_replays_and_purges_as_jobs_shows_a_letter_and_audits_every_action() {
    let env = TestEnv::new("console-jobs").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let event = Event::new("jobs-a", 1, env.shards);
    let fixed = Arc::new(AtomicBool::new(false));
    // The event fails for good until fixed.
    let downstream = Downstream::failing_until_fixed(event.key(), Arc::clone(&fixed)).await;
    let mut worker = env.start_worker("w1", &downstream, |_| {}).await;
    let publisher = Publisher::connect(&env).await;
    publisher.publish(std::slice::from_ref(&event)).await;
    wait_depth(&env, &conn, 1, PROCESSING).await;
    // A body that is not an envelope: a letter of another group, to purge.
    publisher
        .publish_raw(0, b"<script>window.__pwned=1</script>\xff")
        .await;
    wait_depth(&env, &conn, 2, PROCESSING).await;
    wait_indexed(&env, 2, PROCESSING).await;

    let console = Console::start(&env).await;
    let (cookie, csrf) = console.admin_session().await;
    let groups = console.json("/api/dlq/groups", &cookie).await;
    let group_of = |reason: &str| by_reason(&groups["groups"], reason, "group");
    let (handler, decode) = (group_of("handler"), group_of("decode"));

    // A letter's detail comes from the DLQ: headers, body (hex when not
    // UTF-8), trace id, attempts; the search finds it by id and by order.
    let handler_letter = console
        .json(&format!("/api/dlq/letters?group={handler}"), &cookie)
        .await["letters"][0]
        .clone();
    let id = handler_letter["id"].as_str().unwrap().to_owned();
    let detail = console
        .json(&format!("/api/dlq/letter/{id}"), &cookie)
        .await;
    assert_eq!(detail["order_id"], "jobs-a", "{detail:#}");
    assert_eq!(detail["body"]["encoding"], "utf-8", "{detail:#}");
    assert!(
        detail["trace_id"].as_str().is_some_and(|t| t.len() == 32),
        "{detail:#}"
    );
    assert!(
        detail["headers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["name"] == "x-fail-reason" && h["value"] == "handler"),
        "{detail:#}"
    );
    for q in [id.as_str(), "jobs-a"] {
        let found = console
            .json(&format!("/api/dlq/letters?q={q}"), &cookie)
            .await;
        assert_eq!(
            found["letters"].as_array().unwrap().len(),
            1,
            "q={q}: {found:#}"
        );
    }
    let decode_letter = console
        .json(&format!("/api/dlq/letters?group={decode}"), &cookie)
        .await["letters"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let raw = console
        .json(&format!("/api/dlq/letter/{decode_letter}"), &cookie)
        .await;
    assert_eq!(raw["body"]["encoding"], "hex", "{raw:#}");
    let page = console
        .page(&format!("/dead-letters/letter/{decode_letter}"), &cookie)
        .await;
    assert!(
        page.contains("<pre id=\"body\" class=\"hex\">3c 73 63"),
        "{page}"
    );
    assert!(!page.contains("<script>window"), "{page}");
    assert_eq!(
        console
            .get("/api/dlq/letter/no-such-letter", &cookie)
            .await
            .status(),
        StatusCode::NOT_FOUND
    );
    let filtered = console
        .page(&format!("/dead-letters?group={handler}"), &cookie)
        .await;
    assert!(
        filtered.contains(&format!("data-letter=\"{id}\"")),
        "{filtered}"
    );
    assert!(!filtered.contains(&format!("data-letter=\"{decode_letter}\"")));

    // An action needs a selection; a purge needs a confirmation.
    let nothing = console.post("/api/dlq/replay", &cookie, &csrf, "{}").await;
    assert_eq!(nothing.status(), StatusCode::BAD_REQUEST);
    let body = format!(r#"{{"ids": ["{decode_letter}"]}}"#);
    let unconfirmed = console.post("/api/dlq/purge", &cookie, &csrf, &body).await;
    assert_eq!(unconfirmed.status(), StatusCode::BAD_REQUEST);
    let unconfirmed: serde_json::Value =
        serde_json::from_str(&unconfirmed.text().await.unwrap()).unwrap();
    assert_eq!(unconfirmed["would_purge"], 1, "{unconfirmed}");
    wait_depth(&env, &conn, 2, PROCESSING).await;
    let viewer = console
        .http
        .post(console.url("/api/dlq/replay"))
        .bearer_auth(VIEWER)
        .header(header::CONTENT_TYPE, "application/json")
        .body(format!(r#"{{"group": "{handler}"}}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(viewer.status(), StatusCode::FORBIDDEN);

    // Purge, confirmed: a job that removes the letter and its index entry.
    let body = format!(r#"{{"ids": ["{decode_letter}"], "confirm": true}}"#);
    let started = console.post("/api/dlq/purge", &cookie, &csrf, &body).await;
    assert_eq!(started.status(), StatusCode::ACCEPTED);
    let job: serde_json::Value = serde_json::from_str(&started.text().await.unwrap()).unwrap();
    let (purged, _) = console.follow(job["job"].as_u64().unwrap(), &cookie).await;
    assert_eq!(purged["state"], "done", "{purged:#}");
    assert_eq!(purged["done"], 1, "{purged:#}");
    wait_depth(&env, &conn, 1, PROCESSING).await;

    // Fix the downstream and replay the handler group as a job: the event
    // arrives, the group empties, the job's events said how far it got.
    fixed.store(true, std::sync::atomic::Ordering::SeqCst);
    let body = format!(r#"{{"group": "{handler}", "rate": 100}}"#);
    let started = console.post("/api/dlq/replay", &cookie, &csrf, &body).await;
    assert_eq!(started.status(), StatusCode::ACCEPTED);
    let job: serde_json::Value = serde_json::from_str(&started.text().await.unwrap()).unwrap();
    let job = job["job"].as_u64().unwrap();
    let (replayed, _) = console.follow(job, &cookie).await;
    assert_eq!(replayed["state"], "done", "{replayed:#}");
    assert_eq!(replayed["who"], "ops", "{replayed:#}");
    assert_eq!(replayed["progress"], "replayed 1 of 1", "{replayed:#}");
    assert_eq!(replayed["result"]["replayed"], 1, "{replayed:#}");
    let key = event.key();
    downstream
        .wait_for("the event after the replay", PROCESSING, |calls| {
            calls.iter().any(|c| c.ok() && c.key() == key)
        })
        .await;
    wait_depth(&env, &conn, 0, PROCESSING).await;
    let groups = console.json("/api/dlq/groups", &cookie).await;
    assert_eq!(groups["groups"].as_array().unwrap().len(), 0, "{groups:#}");
    let jobs = console.json("/api/jobs", &cookie).await;
    assert_eq!(jobs["jobs"].as_array().unwrap().len(), 2, "{jobs:#}");
    assert_eq!(jobs["jobs"][0]["kind"], "replay", "newest first: {jobs:#}");
    let ended = console
        .post(&format!("/api/jobs/{job}/cancel"), &cookie, &csrf, "{}")
        .await;
    assert_eq!(ended.status(), StatusCode::CONFLICT);

    // The audit log: who did what, newest first.
    let audit = console.json("/api/audit", &cookie).await;
    let actions: Vec<(&str, &str)> = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["who"].as_str().unwrap(), e["action"].as_str().unwrap()))
        .collect();
    assert_eq!(
        actions,
        [
            ("ops", "replay finished"),
            ("ops", "replay started"),
            ("ops", "purge finished"),
            ("ops", "purge started"),
        ],
        "{audit:#}"
    );
    let page = console.page("/audit", &cookie).await;
    assert!(
        page.contains("<td class=\"action\">replay finished</td>"),
        "{page}"
    );
    let runs = console.json("/api/reconcile/runs", &cookie).await;
    assert_eq!(runs["dry_run_available"], false, "{runs:#}");
    let no_dry_run = console
        .post("/api/reconcile/dry-run", &cookie, &csrf, "{}")
        .await;
    assert_eq!(no_dry_run.status(), StatusCode::NOT_FOUND);
    let history = console.json("/api/fleet/history", &cookie).await;
    assert!(
        !history["samples"].as_array().unwrap().is_empty(),
        "{history:#}"
    );
    let fleet = console.page("/", &cookie).await;
    assert!(fleet.contains("<svg id=\"backlog-chart\""), "{fleet}");
    assert!(fleet.contains("<tr data-shard=\"0\">"), "{fleet}");

    console.stop().await;
    worker.assert_running().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_runs_a_reconcile_dry_run_as_a_job_and_shows_the_recorded_runs() {
    let env = TestEnv::new("console-reconcile").await;
    env.apply_topology().await;
    let db = OrdersDb::new(&env).await;
    // Paid an hour ago; the fleet never processed its payment.
    db.set("dry-1", "PAID", std::time::Duration::from_secs(3600))
        .await;
    let config = ReconcileConfig {
        orders_url: db.url(),
        dry_run: true,
        ..ReconcileConfig::default()
    };
    let console = Console::start_with(&env, Some(config)).await;
    let (cookie, csrf) = console.admin_session().await;
    let page = console.page("/reconcile", &cookie).await;
    assert!(page.contains("id=\"reconcile-dry-run\""), "{page}");
    let started = console
        .post("/api/reconcile/dry-run", &cookie, &csrf, "{}")
        .await;
    assert_eq!(started.status(), StatusCode::ACCEPTED);
    let job: serde_json::Value = serde_json::from_str(&started.text().await.unwrap()).unwrap();
    let (ran, _) = console.follow(job["job"].as_u64().unwrap(), &cookie).await;
    assert_eq!(ran["state"], "done", "{ran:#}");
    assert_eq!(ran["kind"], "reconcile-dry-run", "{ran:#}");
    assert_eq!(ran["result"]["dry_run"], true, "{ran:#}");
    assert_eq!(ran["result"]["counts"]["drifted"], 1, "{ran:#}");
    assert_eq!(ran["result"]["counts"]["emitted"], 0, "{ran:#}");
    assert_eq!(
        ran["result"]["drift"][0]["compensation"], "would_emit",
        "{ran:#}"
    );

    // A run `reconcile --interval` recorded shows on the page.
    let run = shardline_ops::RunSummary {
        at_ms: 1_796_119_200_000,
        took_ms: 1500,
        dry_run: false,
        scanned: 7,
        fresh: 1,
        drifted: 2,
        emitted: 2,
        pending: 1,
        error: None,
    };
    shardline_ops::reconcile::record_run(&env.ops_fleet(), &run)
        .await
        .unwrap();
    let runs = console.json("/api/reconcile/runs", &cookie).await;
    assert_eq!(runs["dry_run_available"], true, "{runs:#}");
    assert_eq!(runs["runs"][0]["scanned"], 7, "{runs:#}");
    let page = console.page("/reconcile", &cookie).await;
    assert!(page.contains("<table id=\"reconcile-runs\">"), "{page}");
    let audit = console.json("/api/audit", &cookie).await;
    assert_eq!(
        audit["entries"][0]["action"], "reconcile dry run finished",
        "{audit:#}"
    );
    console.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_replay_stops_between_letters_and_leaves_the_rest_in_the_dlq() {
    let env = TestEnv::new("console-cancel").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let fixed = Arc::new(AtomicBool::new(false));
    let on = Arc::clone(&fixed);
    let downstream = Downstream::scripted(move |_, _| {
        if on.load(std::sync::atomic::Ordering::SeqCst) {
            shardline_testkit::Reply::ok()
        } else {
            shardline_testkit::Reply::status(422)
        }
    })
    .await;
    let mut worker = env.start_worker("w1", &downstream, |_| {}).await;
    let events: Vec<Event> = ["cancel-a", "cancel-b", "cancel-c"]
        .iter()
        .map(|o| Event::new(o, 1, env.shards))
        .collect();
    Publisher::connect(&env).await.publish(&events).await;
    wait_depth(&env, &conn, 3, PROCESSING).await;
    wait_indexed(&env, 3, PROCESSING).await;
    fixed.store(true, std::sync::atomic::Ordering::SeqCst);

    let console = Console::start(&env).await;
    let (cookie, csrf) = console.admin_session().await;
    let groups = console.json("/api/dlq/groups", &cookie).await;
    assert_eq!(groups["groups"][0]["count"], 3, "{groups:#}");
    let group = groups["groups"][0]["group"].as_str().unwrap().to_owned();
    // One letter every 5 s: the cancel comes in the pause after the first.
    let body = format!(r#"{{"group": "{group}", "rate": 0.2}}"#);
    let started = console.post("/api/dlq/replay", &cookie, &csrf, &body).await;
    assert_eq!(started.status(), StatusCode::ACCEPTED);
    let job: serde_json::Value = serde_json::from_str(&started.text().await.unwrap()).unwrap();
    let job = job["job"].as_u64().unwrap();
    let (on, session) = (&console, cookie.as_str());
    wait_until("the first letter replayed", PROCESSING, || async move {
        let view = on.json(&format!("/api/jobs/{job}"), session).await;
        check(view["done"] == 1, || format!("{view:#}"))
    })
    .await;
    let cancel = console
        .post(&format!("/api/jobs/{job}/cancel"), &cookie, &csrf, "{}")
        .await;
    assert_eq!(cancel.status(), StatusCode::OK);
    let (ended, _) = console.follow(job, &cookie).await;
    assert_eq!(ended["state"], "cancelled", "{ended:#}");
    assert_eq!(ended["done"], 1, "{ended:#}");
    assert_eq!(ended["result"]["cancelled"], true, "{ended:#}");
    // The two letters it did not reach stay, in the DLQ and in the index.
    wait_depth(&env, &conn, 2, PROCESSING).await;
    let groups = console.json("/api/dlq/groups", &cookie).await;
    assert_eq!(groups["groups"][0]["count"], 2, "{groups:#}");
    let audit = console.json("/api/audit", &cookie).await;
    let mut actions: Vec<&str> = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    // The cancel and the job's end are written concurrently: either first.
    assert_eq!(actions.pop(), Some("replay started"), "{audit:#}");
    actions.sort_unstable();
    assert_eq!(actions, ["job cancelled", "replay cancelled"], "{audit:#}");
    console.stop().await;
    worker.assert_running().await;
}

/// Failed logins are throttled by the client's address as a trusted proxy
/// forwards it (the form and wrong bearer tokens alike), logged with it and
/// the proxy, never with what was typed; a malformed CIDR stops the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_are_throttled_by_client_address_and_logged_without_the_token() {
    let env = TestEnv::new("console-throttle").await;
    env.apply_topology().await;
    let bad = env
        .cli(&["console", "--trusted-proxy", "127.0.0.1/8,10.0.0.0/33"])
        .await;
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("--trusted-proxy") && stderr.contains("10.0.0.0/33"),
        "{stderr}"
    );

    let port = shardline_testkit::broker::free_port();
    let mut cmd = env.shardline_command();
    cmd.arg("console")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--trusted-proxy", "127.0.0.1"])
        // A wait long enough that no slow request outlives it.
        .args(["--login-backoff", "60s"])
        .args(env.global_args())
        .env("SHARDLINE_CONSOLE_TOKENS", format!("ops:admin:{ADMIN}"));
    let mut console = ChildWorker::spawn(&env, "console", cmd);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_until("the console answers", STARTUP, || async {
        match http.get(format!("{base}/login")).send().await {
            Ok(r) if r.status() == StatusCode::OK => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    const WRONG: &str = "wrong-token-canary-5f3e9a7c41";
    // The client's own X-Forwarded-For entry (left) is not believed; the
    // address the trusted proxy appended is.
    let bearer = |from: &str, token: &str| {
        http.get(format!("{base}/api/me"))
            .bearer_auth(token)
            .header("x-forwarded-for", format!("198.51.100.99, {from}"))
            .send()
    };
    for n in 1..=5 {
        let refused = bearer("203.0.113.7", WRONG).await.unwrap();
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "failure {n}");
    }
    let held = bearer("203.0.113.7", ADMIN).await.unwrap();
    assert_eq!(held.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(held.headers()[header::RETRY_AFTER], "60");
    // Another client of the same proxy is not held.
    let other = bearer("203.0.113.8", ADMIN).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);

    // The form, from a third client: five refusals, then a wait.
    let form = |token: &str| {
        http.post(format!("{base}/login"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header("x-forwarded-for", "2001:db8::5")
            .body(format!("token={token}"))
            .send()
    };
    for n in 1..=5 {
        assert_eq!(
            form(WRONG).await.unwrap().status(),
            StatusCode::UNAUTHORIZED,
            "form {n}"
        );
    }
    let held = form(ADMIN).await.unwrap();
    assert_eq!(held.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(held.headers().contains_key(header::RETRY_AFTER));
    assert!(held.text().await.unwrap().contains("id=\"throttled\""));

    let log = wait_until("the refusals are logged", STARTUP, || async {
        let log = console.log_text();
        let form_logged = log
            .lines()
            .any(|l| l.contains("login with a wrong token") && l.contains("2001:db8::5"));
        match form_logged {
            true => Ok(log),
            false => Err(log),
        }
    })
    .await;
    let bearer_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("wrong bearer token"))
        .collect();
    assert_eq!(bearer_lines.len(), 5, "{log}");
    for line in bearer_lines {
        assert!(line.contains("WARN"), "{line}");
        assert!(
            line.contains("203.0.113.7") && line.contains("127.0.0.1"),
            "{line}"
        );
        assert!(!line.contains("198.51.100.99"), "the spoofed entry: {line}");
    }
    assert!(
        !log.contains(WRONG),
        "a typed token reached the log:\n{log}"
    );
    assert!(!log.contains(ADMIN), "a token reached the log:\n{log}");
    console.sigterm();
    console.wait_exit(STARTUP).await;
}

/// A read-only token sees a letter's index metadata only, by page and API;
/// an admin sees its headers and body. The detail reads only the first
/// letters of the DLQ: one further back is reported as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_token_sees_a_letters_metadata_and_the_letter_read_is_bounded() {
    let env = TestEnv::new("console-viewer").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let event = Event::new("viewer-a", 1, env.shards);
    let downstream =
        Downstream::failing_until_fixed(event.key(), Arc::new(AtomicBool::new(false))).await;
    let mut worker = env.start_worker("w1", &downstream, |_| {}).await;
    let publisher = Publisher::connect(&env).await;
    publisher.publish(std::slice::from_ref(&event)).await;
    wait_depth(&env, &conn, 1, PROCESSING).await;
    publisher
        .publish_raw(0, b"secret-body-not-an-envelope")
        .await;
    wait_depth(&env, &conn, 2, PROCESSING).await;
    wait_indexed(&env, 2, PROCESSING).await;

    let served = ServedConsole::start_configured(&env, |c| c.letters_read = 1).await;
    let console = Console {
        addr: served.addr,
        served,
        http: reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap(),
    };
    let (admin, _) = console.login(ADMIN, &[]).await;
    let (viewer, _) = console.login(VIEWER, &[]).await;
    let letters = console.json("/api/dlq/letters", &admin).await["letters"].clone();
    let (first, second) = (
        by_reason(&letters, "handler", "id"),
        by_reason(&letters, "decode", "id"),
    );

    let full = console
        .json(&format!("/api/dlq/letter/{first}"), &admin)
        .await;
    assert_eq!(full["order_id"], "viewer-a", "{full:#}");
    assert!(
        full["body"]["text"].is_string() && full["headers"].is_array(),
        "{full:#}"
    );
    let meta = console
        .json(&format!("/api/dlq/letter/{first}"), &viewer)
        .await;
    for field in [
        "reason",
        "error",
        "order_id",
        "seq",
        "event",
        "shard",
        "first_failed_at",
        "trace_id",
        "attempts",
    ] {
        assert_eq!(meta[field], full[field], "{field}: {meta:#}");
    }
    assert_eq!(meta["metadata_only"], true, "{meta:#}");
    for hidden in ["body", "headers", "routing_key"] {
        assert!(
            meta.get(hidden).is_none(),
            "read-only sees {hidden}: {meta:#}"
        );
    }
    let page = console
        .page(&format!("/dead-letters/letter/{first}"), &viewer)
        .await;
    assert!(
        page.contains("id=\"metadata-only\"") && page.contains("id=\"attempts\""),
        "{page}"
    );
    assert!(
        !page.contains("id=\"body\"") && !page.contains("id=\"headers\""),
        "{page}"
    );
    let page = console
        .page(&format!("/dead-letters/letter/{first}"), &admin)
        .await;
    assert!(
        page.contains("id=\"body\"") && page.contains("id=\"headers\""),
        "{page}"
    );

    // The second letter is past the bound of one for an admin's read; the
    // index still has it for a read-only token, without its body.
    let beyond = console
        .get(&format!("/api/dlq/letter/{second}"), &admin)
        .await;
    assert_eq!(beyond.status(), StatusCode::NOT_FOUND);
    let beyond: serde_json::Value = serde_json::from_str(&beyond.text().await.unwrap()).unwrap();
    assert_eq!(beyond["not_within"], 1, "{beyond:#}");
    assert!(
        beyond["error"]
            .as_str()
            .unwrap()
            .contains("is not within the first 1 letters of the DLQ"),
        "{beyond:#}"
    );
    let page = console
        .page(&format!("/dead-letters/letter/{second}"), &admin)
        .await;
    assert!(
        page.contains("id=\"not-within\"") && !page.contains("id=\"not-found\""),
        "{page}"
    );
    let meta = console
        .json(&format!("/api/dlq/letter/{second}"), &viewer)
        .await;
    assert_eq!(meta["reason"], "decode", "{meta:#}");
    assert!(!meta.to_string().contains("secret-body"), "{meta:#}");
    assert_eq!(
        console
            .get("/api/dlq/letter/no-such-letter", &viewer)
            .await
            .status(),
        StatusCode::NOT_FOUND
    );
    // Every letter is back in the DLQ, in order.
    wait_depth(&env, &conn, 2, PROCESSING).await;
    console.stop().await;
    worker.assert_running().await;
}

/// A request whose body stalls after its headers is closed after the
/// body-read timeout; the console answers the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_body_is_closed_after_the_body_read_timeout() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let env = TestEnv::new("console-stall").await;
    env.apply_topology().await;
    let timeout = std::time::Duration::from_secs(1);
    let served =
        ServedConsole::start_configured(&env, |c| c.limits.body_read_timeout = timeout).await;
    let mut stream = tokio::net::TcpStream::connect(served.addr).await.unwrap();
    let request = format!(
        "POST /login HTTP/1.1\r\nHost: {}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ntoken=",
        served.addr
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let sent = std::time::Instant::now();
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(timeout * 10, async {
        while stream.read(&mut buf).await.unwrap_or(0) > 0 {}
    })
    .await;
    assert!(
        closed.is_ok(),
        "the connection is still open after {:?}",
        sent.elapsed()
    );
    // Sooner than the idle (5 s) and header (10 s) timeouts.
    let took = sent.elapsed();
    assert!(
        took >= timeout && took < timeout * 4,
        "closed after {took:?}"
    );
    let login = reqwest::get(format!("http://{}/login", served.addr))
        .await
        .unwrap();
    assert_eq!(login.status(), StatusCode::OK);
    served.stop().await;
}
