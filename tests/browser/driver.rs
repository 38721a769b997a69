//! The browser side of a scenario as a child process, `node
//! tests/browser/console.mjs <scenario>`, spoken to in lines: it prints
//! `VERSION …`, then `STEP <name>` whenever the fleet must act and waits for
//! `OK [value]` on its stdin, and ends with `PASS` or `FAIL <reason>`. Its
//! stderr (playwright's errors, stack traces) goes to a log file, shown
//! when the scenario fails.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Bound on the wait for the script's next line: its own waits end sooner
/// (20 s for the page, 60 s for a replay job), so this only catches a hang.
const NEXT_LINE: Duration = Duration::from_secs(180);

pub(crate) struct Driver {
    scenario: String,
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    log: PathBuf,
}

impl Driver {
    /// Starts `scenario` with `vars` in its environment.
    pub(crate) fn spawn(scenario: &str, vars: &[(&str, String)], log: PathBuf) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/console.mjs");
        let stderr = std::fs::File::create(&log).unwrap();
        let mut child = Command::new("node")
            .arg(&script)
            .arg(scenario)
            .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("the browser tests need `node` on PATH (apt-get install -y nodejs): {e}")
            });
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            scenario: scenario.to_owned(),
            child,
            stdin,
            lines,
            log,
        }
    }

    /// The next step the script asks for; `None` once it passed. Fails the
    /// test with the script's reason when it fails or stops talking.
    pub(crate) async fn step(&mut self) -> Option<String> {
        loop {
            let line = match tokio::time::timeout(NEXT_LINE, self.lines.next_line()).await {
                Ok(Ok(Some(line))) => line,
                Ok(Ok(None)) => self.fail("it ended without PASS or FAIL"),
                Ok(Err(e)) => self.fail(&format!("reading its output: {e}")),
                Err(_) => self.fail(&format!("no line for {NEXT_LINE:?}")),
            };
            if let Some(step) = line.strip_prefix("STEP ") {
                return Some(step.to_owned());
            }
            if line == "PASS" {
                let status = self.child.wait().await.unwrap();
                assert!(
                    status.success(),
                    "scenario {}: PASS, then {status}",
                    self.scenario
                );
                return None;
            }
            if let Some(reason) = line.strip_prefix("FAIL ") {
                self.fail(reason);
            }
            // `VERSION …` and anything else: into the test's output.
            eprintln!("browser {}: {line}", self.scenario);
        }
    }

    /// Tells the script its step is done, with `value` when not empty.
    pub(crate) async fn ok(&mut self, value: &str) {
        let line = if value.is_empty() {
            "OK\n".to_owned()
        } else {
            format!("OK {value}\n")
        };
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        self.stdin.flush().await.unwrap();
    }

    fn fail(&self, reason: &str) -> ! {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let log = log.trim();
        if log.is_empty() {
            panic!("browser scenario {}: {reason}", self.scenario);
        }
        panic!(
            "browser scenario {}: {reason}\n---- its stderr ({}) ----\n{log}",
            self.scenario,
            self.log.display()
        );
    }
}
