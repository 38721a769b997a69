//! The command line as a newcomer meets it: what lands in a log file, what the
//! exit codes say (docs/reference/exit-codes.md): a flag value refused after
//! parsing exits 2 like clap's own refusals, a failure exits 1, each in one
//! `error:` line on stderr with nothing before it.

use std::process::Output;
use std::time::Duration;

use shardline_testkit::{ChildWorker, SHARDS, TestEnv};

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

/// The one line a failed command printed, after checking its exit code:
/// stderr holds `error: …` and nothing else (no log line before it).
fn error_line(out: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        matches!(lines.as_slice(), [line] if line.starts_with("error: ")),
        "not one error line:\n{stderr}"
    );
    lines[0].to_owned()
}

/// `worker` with these flags, on the environment's broker and Redis.
async fn worker(env: &TestEnv, flags: &[&str]) -> Output {
    env.cli(&[&["worker"], flags].concat()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_names_no_handler_is_a_usage_error() {
    let env = TestEnv::new("exit-handler").await;
    let line = error_line(&worker(&env, &["--handler", "ftp://x"]).await, 2);
    assert_eq!(
        line,
        "error: --handler must be an http(s):// URL, `log` or `noop`, got `ftp://x`"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assignment_beyond_the_shard_count_is_a_usage_error() {
    let env = TestEnv::new("exit-assign").await;
    let beyond = format!("0-{}", SHARDS + 12);
    let out = worker(&env, &["--handler", "noop", "--assign", &beyond]).await;
    let line = error_line(&out, 2);
    assert!(
        line.starts_with("error: --assign: ") && line.contains(&format!("with {SHARDS} shards")),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_of_0_is_a_usage_error() {
    let env = TestEnv::new("exit-prefetch").await;
    let out = worker(&env, &["--handler", "noop", "--prefetch", "0"]).await;
    assert_eq!(error_line(&out, 2), "error: --prefetch must be at least 1");
}

/// A console opened beyond this machine without the host names people
/// reach it by refuses to start, naming the flag (nothing is bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_beyond_loopback_without_allowed_hosts_is_a_usage_error() {
    let env = TestEnv::new("exit-console-listen").await;
    let out = env.cli(&["console", "--listen", "0.0.0.0:0"]).await;
    let line = error_line(&out, 2);
    assert!(
        line.starts_with("error: --allowed-host: required to listen on 0.0.0.0:0"),
        "{line}"
    );
}

/// A password the broker refuses: the line says ACCESS_REFUSED and whom it
/// refused, with the password redacted, and no warning that the broker "did
/// not answer" comes before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_password_is_one_line_naming_access_refused() {
    let env = TestEnv::new("exit-refused").await;
    let wrong = env.amqp_url.replacen("guest:guest@", "guest:wr0ng@", 1);
    assert_ne!(wrong, env.amqp_url);
    for command in [&["topology", "apply"][..], &["worker", "--handler", "noop"]] {
        let mut cmd = env.shardline_command();
        cmd.args(command)
            .args(env.global_args_with(&wrong, shardline_testkit::env::REDIS_URL));
        let line = error_line(&cmd.output().await.unwrap(), 1);
        assert!(
            line.contains(&format!("amqp://guest:***@127.0.0.1:{}/", env.amqp_port()))
                && line.contains("ACCESS_REFUSED: the broker refused user guest")
                && !line.contains("wr0ng"),
            "{command:?}: {line}"
        );
    }
}

/// A port nothing listens on: one line naming the URL and "connection
/// refused" (the probe's "version unknown" warning is not printed before it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_port_is_one_line_naming_connection_refused() {
    let env = TestEnv::new("exit-closed").await;
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let mut cmd = env.shardline_command();
    cmd.args(["topology", "apply"])
        .args(env.global_args_with(&url, shardline_testkit::env::REDIS_URL));
    let line = error_line(&cmd.output().await.unwrap(), 1);
    assert!(
        line.contains(&format!("amqp://guest:***@127.0.0.1:{port}/%2f"))
            && line.contains("connection refused"),
        "{line}"
    );
}
