//! The command line as a newcomer meets it: what lands in a log file, what the
//! exit codes say.

use std::time::Duration;

use shardline_testkit::{ChildWorker, TestEnv};

/// A log written to a file (or a pipe, or a CI log) is plain text: no ANSI
/// escape, although `NO_COLOR` is not set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_written_to_a_file_holds_no_escape_byte() {
    let env = TestEnv::new("colour").await;
    env.apply_topology().await;
    let mut cmd = env.shardline_command();
    cmd.env_remove("NO_COLOR")
        .arg("worker")
        .args(env.global_args())
        .args(["--handler", "noop", "--worker-name", "colour"]);
    let mut worker = ChildWorker::spawn(&env, "colour", cmd);
    worker.wait_consuming(&env).await;
    worker.sigterm();
    let status = worker.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0), "{}", worker.log_tail(20));

    let log = std::fs::read(&worker.log).unwrap();
    let text = String::from_utf8_lossy(&log);
    assert!(text.contains("INFO"), "no log line to judge:\n{text}");
    assert!(
        !log.contains(&0x1b),
        "the log file holds ANSI escapes:\n{}",
        text.escape_debug()
    );
}

/// A demo that succeeds prints its report and no ERROR line, with the
/// `RUST_LOG=error` `scripts/demo` sets: the 404s the shard-count check
/// expects and lapin's lines about connections it closes are not errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_that_succeeds_prints_no_error_line() {
    let env = TestEnv::new("demo-quiet").await;
    let out = env
        .shardline_command()
        .env("RUST_LOG", "error")
        .args(["demo", "--orders", "40", "--events-per-order", "3"])
        .args(env.global_args())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("result: OK"), "{stdout}");
    assert!(
        !stderr.contains("ERROR") && !stdout.contains("ERROR"),
        "a successful demo printed an error line:\n{stderr}"
    );
}
