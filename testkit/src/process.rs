//! A helper server as a child process (redis-server, socat), its output in a
//! log file, killed and reaped on drop; its log is printed when a test fails.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

pub struct Helper {
    what: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Helper {
    /// Spawns `cmd` with stdout and stderr appended to `log`. Fails loudly,
    /// naming the package to install, if the program is missing.
    pub fn spawn(what: &str, cmd: &mut Command, log: PathBuf) -> Self {
        let file = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "this test needs `{what}` on PATH (apt-get install {what}): cannot run it: {e}"
                )
            });
        Self {
            what: what.to_owned(),
            child: Some(child),
            log,
        }
    }

    /// Fails the test, with the log, if the process exited.
    pub fn assert_running(&mut self) {
        if let Some(status) = self
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
        {
            panic!(
                "{} exited ({status}); its output:\n{}",
                self.what,
                self.log_text()
            );
        }
    }

    /// SIGKILL, and waits until the process is gone.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            eprintln!(
                "---- {} output ({}) ----\n{}\n---- end of {} output ----",
                self.what,
                self.log.display(),
                self.log_text(),
                self.what
            );
        }
        self.kill9();
    }
}

/// Fails the test, naming `what` and showing its output, unless the command
/// exited 0; its stdout otherwise.
pub fn assert_exited_ok(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed with {}:\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
