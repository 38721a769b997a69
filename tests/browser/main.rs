//! Browser tests: the console in Debian's headless Chromium, driven by
//! playwright-core (`tests/browser/console.mjs`), against a real fleet.
//!
//! Each test starts a fleet of its own ([`rig::Rig`]: a vhost and Redis
//! prefix, the topology, an in-process worker, a downstream that refuses one
//! event until fixed, the console in-process with an admin and a read-only
//! token) and plays one scenario in the browser ([`driver::Driver`]). The
//! script asks the Rust side to act in `STEP` lines (inject a failure, fix
//! the downstream, publish hostile bodies) and waits for its `OK`, so both
//! sides wait on events, never on time; the Rust side checks what only it
//! sees (the order's events downstream, the DLQ and its index).
//!
//! They are `#[ignore]`d: they need Chromium and playwright-core
//! (`scripts/browser-setup` installs both) and run after the other tests,
//! one at a time:
//!
//! ```sh
//! scripts/browser-setup
//! cargo test --features test-support --test browser -- --ignored --test-threads=1
//! ```
//!
//! - [`fleet_page_shows_every_shard_after_login`]: the login form, every shard, the refresh.
//! - [`a_permanent_failure_appears_as_its_failure_group`]: a dead letter's group on the page.
//! - [`a_group_replayed_from_the_page_restores_the_order`]: fix, replay, job done, group gone, seqs in order.
//! - [`read_only_sees_no_action_and_its_post_is_refused`]: no buttons, 403.
//! - [`without_a_token_the_api_says_401_and_pages_the_login`]: 401, the login page, a wrong token.
//! - [`hostile_bodies_render_as_text`]: `<script>`, bidi, zero-width, invalid UTF-8 on the letter's page.
//!
//! [`screenshots`] is no test: `scripts/screenshots` runs it to draw the
//! console page's pictures (docs/operating/console.md).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod driver;
mod rig;

use std::time::Duration;

use rig::Rig;

/// (a) Log in with the token through the form and see the shards of the
/// running fleet, owned by its worker, before and after the 2 s refresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Chromium and playwright-core (scripts/browser-setup); scripts/test runs it alone"]
async fn fleet_page_shows_every_shard_after_login() {
    Rig::start("browser-fleet").await.run("fleet").await;
}

/// (b) A permanent failure (the downstream answers 422) becomes a dead
/// letter whose failure group appears on the dead-letters page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Chromium and playwright-core (scripts/browser-setup); scripts/test runs it alone"]
async fn a_permanent_failure_appears_as_its_failure_group() {
    Rig::start("browser-group").await.run("failure-group").await;
}

/// (c) Fix the downstream, replay the group from the page: the job ends
/// `done`, the group is gone after a reload, and the order's events arrive
/// downstream in seq order (1, the replayed 2, then 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Chromium and playwright-core (scripts/browser-setup); scripts/test runs it alone"]
async fn a_group_replayed_from_the_page_restores_the_order() {
    Rig::start("browser-replay").await.run("replay").await;
}

/// (d) A read-only token sees no replay button and no release form, and its
/// POST to `api/dlq/replay` with its own CSRF token is refused (403); the
/// letter stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Chromium and playwright-core (scripts/browser-setup); scripts/test runs it alone"]
async fn read_only_sees_no_action_and_its_post_is_refused() {
    Rig::start("browser-readonly").await.run("read-only").await;
}

/// (e) No token: `GET api/fleet` is 401, a page sends to the login page, a
/// wrong token at the form is refused without a cookie.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Chromium and playwright-core (scripts/browser-setup); scripts/test runs it alone"]
async fn without_a_token_the_api_says_401_and_pages_the_login() {
    Rig::start("browser-notoken").await.run("no-token").await;
}

/// (f) Malformed bodies published straight to a shard queue
/// ([`rig::HOSTILE_BYTES`], [`rig::HOSTILE_TEXT`]) render as text on their
/// letter's page: no dialog, `window.__pwned` undefined, no `<script>` in
/// the page, the escapes visible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Chromium and playwright-core (scripts/browser-setup); scripts/test runs it alone"]
async fn hostile_bodies_render_as_text() {
    Rig::start("browser-hostile")
        .await
        .run("hostile-body")
        .await;
}

/// The console page's pictures, `docs/console-fleet.png` and
/// `docs/console-dead-letters.png` (1280x800), of a busy fleet with two
/// failure groups. Only `scripts/screenshots` runs it (it sets
/// `SHARDLINE_SCREENSHOTS_DIR`); `scripts/test` skips it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "draws the console page's pictures: scripts/screenshots"]
async fn screenshots() {
    assert!(
        std::env::var_os("SHARDLINE_SCREENSHOTS_DIR").is_some(),
        "screenshots: run scripts/screenshots (it sets SHARDLINE_SCREENSHOTS_DIR)"
    );
    Rig::start_with("browser-screenshots", Duration::from_millis(50))
        .await
        .run("screenshots")
        .await;
}
