//! Server-side jobs: a replay, a purge or a reconcile dry run started from
//! the page runs in this process, not in the browser tab, so closing the tab
//! does not stop it. Each job publishes its view on a watch channel (the
//! page follows it over server-sent events) and stops at its cancel token.
//! Jobs are kept in this process's memory (the last [`KEPT`]); a restart
//! forgets them, and cancels those running (a replay stops between letters;
//! what it has not replayed stays in the DLQ).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Jobs kept for the page: running ones and the latest that ended.
pub(crate) const KEPT: usize = 50;

/// Progress lines a job keeps (the latest).
const LINES: usize = 20;

/// How long the console waits, at shutdown, for its cancelled jobs to stop.
const STOP_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Kind {
    Replay,
    Purge,
    ReconcileDryRun,
}

impl Kind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Replay => "replay",
            Self::Purge => "purge",
            Self::ReconcileDryRun => "reconcile-dry-run",
        }
    }

    /// The action in the audit log's words (`replay started`, …).
    pub(crate) fn action(self) -> &'static str {
        match self {
            Self::Replay => "replay",
            Self::Purge => "purge",
            Self::ReconcileDryRun => "reconcile dry run",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum JobState {
    Running,
    Done,
    Failed,
    Cancelled,
}

impl JobState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

/// What the page shows of a job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct JobView {
    pub(crate) id: u64,
    pub(crate) kind: Kind,
    /// The token's name that started it.
    pub(crate) who: String,
    /// What it acts on, in words (`group 3f2a…`, `4 letters`).
    pub(crate) target: String,
    pub(crate) state: JobState,
    pub(crate) started_ms: u64,
    pub(crate) ended_ms: Option<u64>,
    /// Units done and, once known, in all (letters replayed of matching).
    pub(crate) done: u64,
    pub(crate) total: Option<u64>,
    /// The latest progress lines, oldest first.
    pub(crate) lines: Vec<String>,
    /// The operation's report when it ended, as JSON.
    pub(crate) result: Option<serde_json::Value>,
    pub(crate) error: Option<String>,
}

impl JobView {
    /// A job just started: running, nothing done yet.
    pub(crate) fn new(id: u64, kind: Kind, who: &str, target: String) -> Self {
        Self {
            id,
            kind,
            who: who.to_owned(),
            target,
            state: JobState::Running,
            started_ms: now_ms(),
            ended_ms: None,
            done: 0,
            total: None,
            lines: Vec::new(),
            result: None,
            error: None,
        }
    }

    /// `replayed 3 of 10`, for the page.
    pub(crate) fn progress(&self) -> String {
        let verb = match self.kind {
            Kind::Replay => "replayed",
            Kind::Purge => "purged",
            Kind::ReconcileDryRun => "runs",
        };
        match self.total {
            Some(total) => format!("{verb} {} of {total}", self.done),
            None => format!("{verb} {}", self.done),
        }
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        let mut json = serde_json::to_value(self).unwrap_or_default();
        if let Some(object) = json.as_object_mut() {
            object.insert("progress".into(), self.progress().into());
        }
        json
    }

    /// Adds a progress line, dropping the oldest beyond [`LINES`].
    pub(crate) fn line(&mut self, line: String) {
        if self.lines.len() == LINES {
            self.lines.remove(0);
        }
        self.lines.push(line);
    }
}

/// One job: its view's channel and its cancel token.
pub(crate) struct Job {
    view: watch::Sender<JobView>,
    cancel: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Job {
    pub(crate) fn view(&self) -> JobView {
        self.view.borrow().clone()
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<JobView> {
        self.view.subscribe()
    }

    /// Asks the job to stop; it ends as `cancelled` at its next step.
    pub(crate) fn cancel(&self) {
        self.cancel.cancel();
    }
}

/// What a job's task gets: its cancel token and a way to update its view.
#[derive(Clone)]
pub(crate) struct Progress {
    view: watch::Sender<JobView>,
    pub(crate) cancel: CancellationToken,
}

impl Progress {
    pub(crate) fn update(&self, f: impl FnOnce(&mut JobView)) {
        self.view.send_modify(f);
    }

    /// Ends the job: `done` with its report, `cancelled` when its token
    /// fired, or `failed` with the error.
    pub(crate) fn end(&self, outcome: Result<serde_json::Value, String>) {
        let cancelled = self.cancel.is_cancelled();
        self.view.send_modify(|v| {
            v.ended_ms = Some(now_ms());
            match outcome {
                Ok(result) => {
                    v.state = if cancelled {
                        JobState::Cancelled
                    } else {
                        JobState::Done
                    };
                    v.result = Some(result);
                }
                Err(error) => {
                    v.state = JobState::Failed;
                    v.error = Some(error);
                }
            }
        });
    }
}

/// The jobs of this console process.
#[derive(Default)]
pub(crate) struct Jobs {
    next: AtomicU64,
    by_id: Mutex<BTreeMap<u64, Arc<Job>>>,
    /// Fired at shutdown: every job's token is a child of it.
    all: CancellationToken,
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Jobs {
    /// Starts `run` as a job of `kind` for `who`; its id. The oldest ended
    /// jobs beyond [`KEPT`] are forgotten.
    pub(crate) fn start<F>(
        &self,
        kind: Kind,
        who: &str,
        target: String,
        run: impl FnOnce(Progress) -> F,
    ) -> u64
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let (view, _) = watch::channel(JobView::new(id, kind, who, target));
        let cancel = self.all.child_token();
        let task = tokio::spawn(run(Progress {
            view: view.clone(),
            cancel: cancel.clone(),
        }));
        let job = Arc::new(Job {
            view,
            cancel,
            task: Mutex::new(Some(task)),
        });
        let mut jobs = self.by_id.lock().unwrap_or_else(PoisonError::into_inner);
        jobs.insert(id, job);
        while jobs.len() > KEPT {
            let oldest_ended = jobs
                .iter()
                .find(|(_, j)| j.view.borrow().state != JobState::Running)
                .map(|(id, _)| *id);
            match oldest_ended {
                Some(id) => jobs.remove(&id),
                None => break,
            };
        }
        id
    }

    pub(crate) fn get(&self, id: u64) -> Option<Arc<Job>> {
        self.by_id
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned()
    }

    /// Every job's view, newest first.
    pub(crate) fn views(&self) -> Vec<JobView> {
        let jobs = self.by_id.lock().unwrap_or_else(PoisonError::into_inner);
        jobs.values().rev().map(|j| j.view()).collect()
    }

    /// Cancels every job and waits (at most [`STOP_WAIT`]) for them to stop.
    pub(crate) async fn stop(&self) {
        self.all.cancel();
        let tasks: Vec<JoinHandle<()>> = {
            let jobs = self.by_id.lock().unwrap_or_else(PoisonError::into_inner);
            jobs.values()
                .filter_map(|j| j.task.lock().unwrap_or_else(PoisonError::into_inner).take())
                .collect()
        };
        if tasks.is_empty() {
            return;
        }
        let waited = tokio::time::timeout(STOP_WAIT, futures_util::future::join_all(tasks)).await;
        if waited.is_err() {
            tracing::warn!(
                wait = ?STOP_WAIT,
                "console: jobs still running at shutdown were left to stop with the process"
            );
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_job_reports_progress_and_ends_cancelled_when_asked() {
        let jobs = Jobs::default();
        let id = jobs.start(Kind::Replay, "ops", "group g".into(), |p| async move {
            p.update(|v| {
                v.total = Some(3);
                v.done = 1;
                v.line("replayed d1".into());
            });
            p.cancel.cancelled().await;
            p.end(Ok(serde_json::json!({"replayed": 1})));
        });
        let job = jobs.get(id).unwrap();
        let mut rx = job.subscribe();
        rx.wait_for(|v| v.done == 1).await.unwrap();
        assert_eq!(job.view().progress(), "replayed 1 of 3");
        job.cancel();
        let ended = rx
            .wait_for(|v| v.state != JobState::Running)
            .await
            .unwrap()
            .clone();
        assert_eq!(ended.state, JobState::Cancelled);
        assert_eq!(ended.who, "ops");
        assert!(ended.ended_ms.is_some());
        assert_eq!(jobs.views().len(), 1);
        assert_eq!(jobs.views()[0].json()["state"], "cancelled");
    }

    #[tokio::test]
    async fn only_ended_jobs_are_forgotten_and_shutdown_cancels_the_rest() {
        let jobs = Jobs::default();
        let running = jobs.start(Kind::Replay, "ops", "all".into(), |p| async move {
            p.cancel.cancelled().await;
            p.end(Ok(serde_json::Value::Null));
        });
        for _ in 0..KEPT + 5 {
            let id = jobs.start(Kind::Purge, "ops", "1 letter".into(), |p| async move {
                p.end(Err("refused".into()));
            });
            let mut rx = jobs.get(id).unwrap().subscribe();
            rx.wait_for(|v| v.state == JobState::Failed).await.unwrap();
        }
        assert_eq!(jobs.views().len(), KEPT);
        assert!(jobs.get(running).is_some(), "a running job is kept");
        jobs.stop().await;
        assert_eq!(jobs.get(running).unwrap().view().state, JobState::Cancelled);
    }
}
