//! What the tests of the deployment files share (`tests/compose.rs`,
//! `tests/kubernetes.rs`, each with `#[path]`): the repository's files, the settings
//! a container gives shardline, and the real CLI they are checked against.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Subcommands a container may run (the long-running and one-shot ones).
pub(crate) const SUBCOMMANDS: &[&str] = &["topology", "worker", "load", "publish"];
/// The image's entrypoint (`Dockerfile`).
pub(crate) const ENTRYPOINT: &str = "/usr/local/bin/shardline";

pub(crate) fn repo_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(name)
}

pub(crate) fn read(name: &str) -> String {
    let path = repo_file(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The value of `--flag V` or `--flag=V`.
pub(crate) fn flag_value(args: &[String], flag: &str) -> Option<String> {
    let prefix = format!("{flag}=");
    args.iter().enumerate().find_map(|(i, arg)| {
        if arg == flag {
            args.get(i + 1).cloned()
        } else {
            arg.strip_prefix(&prefix).map(str::to_owned)
        }
    })
}

/// `SHARDLINE_DRAIN_TIMEOUT` → `--drain-timeout`: every flag's environment fallback
/// is `SHARDLINE_` and the flag's name.
fn flag_of(var: &str) -> Option<String> {
    let name = var.strip_prefix("SHARDLINE_")?;
    Some(format!("--{}", name.to_ascii_lowercase().replace('_', "-")))
}

/// What shardline takes for `flag`: the flag in ARGS, else its `SHARDLINE_*`
/// variable in ENV (the flag wins, as in clap).
pub(crate) fn setting(
    args: &[String],
    env: &BTreeMap<String, String>,
    flag: &str,
) -> Option<String> {
    flag_value(args, flag).or_else(|| {
        env.iter()
            .find(|(var, _)| flag_of(var).as_deref() == Some(flag))
            .map(|(_, value)| value.clone())
    })
}

/// `shardline ARGS... --help` with exactly ENV: clap parses every flag and value before
/// it, so an unknown flag or a bad value fails here rather than in a container.
///
/// clap reads no environment for `--help`, so each `SHARDLINE_*` variable must also be
/// one the command lists (a misspelt one would be ignored in a container), and runs
/// once more as its flag (`--drain-timeout 10s`) so that its value is parsed too,
/// unless ARGS give that flag already.
pub(crate) fn cli_accepts(args: &[String], env: &BTreeMap<String, String>) -> Result<(), String> {
    let help = run_help(args, env)?;
    let mut with_flags = args.to_vec();
    for (var, value) in env {
        let Some(flag) = flag_of(var) else { continue };
        let listed =
            help.contains(&format!("[env: {var}]")) || help.contains(&format!("[env: {var}="));
        if !listed {
            return Err(format!("`shardline {}` reads no {var}", args.join(" ")));
        }
        if flag_value(args, &flag).is_some() || args.contains(&flag) {
            continue;
        }
        if help.contains(&format!("{flag} <")) {
            with_flags.extend([flag, value.clone()]);
        } else if !["", "0", "false", "no", "off"].contains(&value.as_str()) {
            with_flags.push(flag);
        }
    }
    run_help(&with_flags, &BTreeMap::new()).map(drop)
}

/// The help text of `shardline ARGS... --help` run with ENV and no other
/// `SHARDLINE_*` variable.
fn run_help(args: &[String], env: &BTreeMap<String, String>) -> Result<String, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shardline"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("SHARDLINE_") {
            cmd.env_remove(key);
        }
    }
    let output = cmd.args(args).arg("--help").envs(env).output().unwrap();
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "`shardline {} --help` exited {}: {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}
