//! A worker as a child process, for the tests that need a process: kill -9,
//! SIGTERM, a handler that aborts the process, or the CLI's own output (its
//! log lines, its exit code, the telemetry set up by `main`). Everything else
//! runs the worker in-process ([`crate::Worker`]).

use std::fs::File;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::env::TestEnv;
use crate::wait::wait_until;

pub struct ChildWorker {
    pub name: String,
    pub log: PathBuf,
    child: Child,
    pid: u32,
}

impl ChildWorker {
    /// `shardline worker --handler HANDLER --worker-name NAME` on every shard of
    /// `env` with `extra` flags, and small retry delays unless `extra` sets them.
    pub fn start(env: &TestEnv, name: &str, handler: &str, extra: &[&str]) -> Self {
        let mut cmd = env.shardline_command();
        cmd.arg("worker");
        for (flag, value) in [("--retry-base", "10ms"), ("--retry-cap", "100ms")] {
            if !extra.contains(&flag) {
                cmd.args([flag, value]);
            }
        }
        cmd.args(env.global_args())
            .args(["--handler", handler, "--worker-name", name])
            .args(extra);
        Self::spawn(env, name, cmd)
    }

    /// Runs `cmd` (any worker binary, any arguments) as worker `name`, its
    /// stdout and stderr in a log file that is printed when the test fails;
    /// killed on drop.
    pub fn spawn(env: &TestEnv, name: &str, mut cmd: Command) -> Self {
        let log = crate::paths::scratch("workers").join(format!("{}-{name}.log", env.id));
        let file = File::create(&log).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start worker {name} ({cmd:?}): {e}"));
        let pid = child.id().unwrap();
        Self {
            name: name.to_owned(),
            log,
            child,
            pid,
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// SIGKILL: no chance to ack or close anything.
    pub fn kill9(&mut self) {
        self.child.start_kill().unwrap();
    }

    pub fn sigterm(&self) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM {} failed", self.pid);
    }

    /// Waits for the process to exit; fails the test if it is still running after `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.unwrap(),
            Err(_) => panic!(
                "worker {} still running {timeout:?} after being told to stop; log tail:\n{}",
                self.name,
                self.log_tail(40)
            ),
        }
    }

    /// The exit status if the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        format!(
            "---- {} ----\n{}",
            self.log.display(),
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }

    /// Fails the test (with the log tail) if the worker exited.
    pub fn assert_running(&mut self, before: &str) {
        if let Some(status) = self.exited() {
            panic!(
                "worker {} exited ({status}) before {before}; log tail:\n{}",
                self.name,
                self.log_tail(40)
            );
        }
    }

    /// Waits until every shard queue has exactly one (active) consumer, as the
    /// broker sees it by passive declare: this worker's when no other runs.
    /// Fails loudly, at once if the worker exits. Cheap on purpose: tests that
    /// publish first and kill mid-stream need to know early.
    pub async fn wait_consuming(&mut self, env: &TestEnv) {
        let what = format!("worker {} consuming every shard", self.name);
        wait_until(&what, crate::STARTUP, || {
            self.assert_running("consuming every shard");
            async move {
                let counts = env.consumer_counts().await;
                crate::wait::check(counts.iter().all(|n| *n == 1), || {
                    format!("consumers per shard queue {counts:?}")
                })
            }
        })
        .await;
    }
}

impl Drop for ChildWorker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- worker {} log, last 60 lines ----\n{}\n---- end of worker {} log ----",
                self.name,
                self.log_tail(60),
                self.name
            );
        }
        let _ = self.child.start_kill();
    }
}
