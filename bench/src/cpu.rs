//! CPU time of processes from `/proc/<pid>/stat` (Linux): the bench's own
//! process (the worker), the publisher child, and the broker and Redis when
//! they run on this host and their `stat` is readable.

use std::time::Duration;

/// `USER_HZ`, the unit of `utime`/`stime` in `/proc/<pid>/stat`: 100 on every
/// Linux architecture's user ABI.
const TICKS_PER_SECOND: u64 = 100;

/// User plus system CPU time of the whole process, all threads.
pub(crate) fn of_pid(pid: &str) -> Option<Duration> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// This process's CPU time.
pub(crate) fn own() -> Option<Duration> {
    of_pid("self")
}

/// `utime + stime` of a `stat` line. The command name may hold spaces and
/// parentheses, so the fields are counted after its last `)`.
fn parse_stat(stat: &str) -> Option<Duration> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    // After the name: state is field 3; utime and stime are fields 14 and 15.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis(
        (utime + stime) * 1000 / TICKS_PER_SECOND,
    ))
}

/// A service measured alongside: a process named `comm`; when several are
/// (a `rabbitmqctl` also runs as `beam.smp`, Sentinel tests start more Redis
/// servers), the ones whose command line contains `hint`, then the oldest.
#[derive(Debug, Clone)]
pub(crate) struct Service {
    pid: Option<String>,
}

impl Service {
    pub(crate) fn find(comm: &str, hint: Option<&str>) -> Self {
        Self {
            pid: find_pid(comm, hint),
        }
    }

    pub(crate) fn cpu(&self) -> Option<Duration> {
        of_pid(self.pid.as_deref()?)
    }
}

fn find_pid(comm: &str, hint: Option<&str>) -> Option<String> {
    let found: Vec<(String, String, u64)> = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let pid = entry.file_name().into_string().ok()?;
            pid.bytes().all(|b| b.is_ascii_digit()).then_some(())?;
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            (name.trim_end() == comm).then_some(())?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let started = start_time(&stat)?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            Some((
                pid,
                String::from_utf8_lossy(&cmdline).replace('\0', " "),
                started,
            ))
        })
        .collect();
    let hinted: Vec<&(String, String, u64)> = found
        .iter()
        .filter(|(_, cmdline, _)| hint.is_some_and(|h| cmdline.contains(h)))
        .collect();
    let candidates = if hinted.is_empty() {
        found.iter().collect()
    } else {
        hinted
    };
    candidates
        .into_iter()
        .min_by_key(|(_, _, started)| *started)
        .map(|(pid, _, _)| pid.clone())
}

/// `starttime` (field 22) of a `stat` line, in ticks since boot.
fn start_time(stat: &str) -> Option<u64> {
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// CPU time used between two readings, when both were readable.
pub(crate) fn spent(before: Option<Duration>, after: Option<Duration>) -> Option<Duration> {
    Some(after?.saturating_sub(before?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_name() {
        let stat =
            "2982 (beam.smp) S 1 2981 2981 0 -1 4194304 32479 0 1 0 245 193 0 0 20 0 20 0 461";
        assert_eq!(parse_stat(stat), Some(Duration::from_millis(4380)));
        let odd = "7 (a) b (c) R 1 1 1 0 -1 0 0 0 0 0 3 4 0 0 20 0 1 0 9";
        assert_eq!(parse_stat(odd), Some(Duration::from_millis(70)));
        assert_eq!(parse_stat("7 (short) R 1"), None);
        assert_eq!(start_time(stat), Some(461));
    }

    #[test]
    fn this_process_has_a_cpu_time() {
        assert!(own().is_some());
        assert_eq!(spent(None, Some(Duration::ZERO)), None);
        assert_eq!(
            spent(Some(Duration::from_secs(1)), Some(Duration::from_secs(3))),
            Some(Duration::from_secs(2))
        );
    }
}
