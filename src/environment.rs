//! Every flag's environment fallback by one rule, `--NAME` reads
//! `SHARDLINE_NAME` ([`shardline_cli_env`]): its exceptions and the variables
//! renamed to it, still read for one release.

use clap::{CommandFactory as _, FromArgMatches as _};
use shardline_cli_env::Renamed;
use shardline_connect::redact;

use crate::Cli;

pub(crate) const PREFIX: &str = "SHARDLINE";

/// Flags that read no variable, and why (the reference lists them).
pub(crate) const NO_FALLBACK: &[(&str, &str)] = &[(
    "yes",
    "it confirms a deletion for good: a variable left set would confirm every later `dlq purge`",
)];

/// Variables renamed to the rule, read for one more release.
pub(crate) const RENAMED: &[Renamed] = &[
    Renamed::new("SHARDLINE_PUBLISH_WINDOW", &["publish", "load"], "window"),
    Renamed::new("SHARDLINE_CONSOLE_LISTEN", &["console"], "listen"),
    Renamed::new("SHARDLINE_CONSOLE_TOKEN_FILE", &["console"], "token-file"),
    Renamed::new("SHARDLINE_CONSOLE_BASE_PATH", &["console"], "base-path"),
];

/// The command line with every flag's variable (`main` and the reference),
/// its defaults shown redacted.
pub(crate) fn command() -> clap::Command {
    redacted_defaults(shardline_cli_env::with_variables(
        Cli::command(),
        PREFIX,
        NO_FALLBACK,
    ))
}

/// CMD with every default that holds a password (`--amqp-url`'s
/// `guest:guest`) hidden from clap's `[default: …]` and named in the flag's
/// help instead, redacted.
fn redacted_defaults(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|arg| {
        let given: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let shown: Vec<String> = given.iter().map(|v| redact(v)).collect();
        if shown == given {
            return arg;
        }
        let note = format!("[default: {}]", shown.join(", "));
        let help = arg
            .get_help()
            .map_or_else(|| note.clone(), |help| format!("{help} {note}"));
        let long = arg.get_long_help().map(|long| format!("{long}\n\n{note}"));
        let arg = arg.hide_default_value(true).help(help);
        match long {
            Some(long) => arg.long_help(long),
            None => arg,
        }
    })
    .mut_subcommands(redacted_defaults)
}

/// The command line and the environment parsed, or clap's message and exit code.
pub(crate) fn parse() -> Cli {
    let (mut cmd, mut matches) = shardline_cli_env::matches(command(), PREFIX, RENAMED);
    Cli::from_arg_matches_mut(&mut matches).unwrap_or_else(|e| e.format(&mut cmd).exit())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::ffi::OsString;
    use std::path::PathBuf;
    use std::time::Duration;

    use clap::{ArgAction, FromArgMatches as _};

    use super::{NO_FALLBACK, PREFIX, RENAMED, command, redact};
    use crate::{Cli, Command};

    fn variable(long: &str) -> String {
        shardline_cli_env::variable(PREFIX, long)
    }

    fn renamed(
        cmd: clap::Command,
        env: &BTreeMap<String, OsString>,
    ) -> (clap::Command, Vec<shardline_cli_env::Warning>) {
        shardline_cli_env::renamed(cmd, PREFIX, RENAMED, env)
    }

    /// Every command as run (global flags included), with its name.
    fn commands() -> Vec<(String, clap::Command)> {
        fn walk(cmd: &clap::Command, name: String, into: &mut Vec<(String, clap::Command)>) {
            for sub in cmd.get_subcommands() {
                walk(sub, format!("{name} {}", sub.get_name()), into);
            }
            into.push((name, cmd.clone()));
        }
        let mut cli = command();
        cli.build();
        let mut all = Vec::new();
        walk(&cli, "shardline".into(), &mut all);
        all
    }

    fn flags(cmd: &clap::Command) -> impl Iterator<Item = (&str, &clap::Arg)> {
        cmd.get_arguments()
            .filter(|arg| {
                !matches!(
                    arg.get_action(),
                    ArgAction::Help
                        | ArgAction::HelpLong
                        | ArgAction::HelpShort
                        | ArgAction::Version
                )
            })
            .filter_map(|arg| Some((arg.get_long()?, arg)))
    }

    fn env(vars: &[(&str, &str)]) -> BTreeMap<String, OsString> {
        vars.iter()
            .map(|(name, value)| ((*name).to_owned(), OsString::from(value)))
            .collect()
    }

    fn parse(env: &BTreeMap<String, OsString>, args: &[&str]) -> Cli {
        let (mut cmd, _) = renamed(command(), env);
        let matches = cmd
            .try_get_matches_from_mut(std::iter::once("shardline").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        Cli::from_arg_matches(&matches).unwrap()
    }

    fn window(cli: Cli) -> String {
        match cli.command {
            Command::Publish(args) => args.window.to_string(),
            Command::Load(args) => args.window.to_string(),
            Command::Reconcile(args) => format!("{:?}", args.orders.window),
            Command::Console(args) => format!("{:?}", args.orders.window),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_flag_reads_shardline_and_its_long_name_but_the_exceptions() {
        let mut checked = 0;
        for (name, cmd) in commands() {
            let mut seen = BTreeMap::new();
            for (long, arg) in flags(&cmd) {
                checked += 1;
                let read = arg.get_env().map(|var| var.to_string_lossy().into_owned());
                if NO_FALLBACK.iter().any(|(flag, _)| *flag == long) {
                    assert_eq!(read, None, "`{name} --{long}` must read no variable");
                    continue;
                }
                assert_eq!(read, Some(variable(long)), "`{name} --{long}`");
                assert!(
                    arg.is_hide_env_values_set(),
                    "`{name} --{long}` shows its value"
                );
                if matches!(arg.get_action(), ArgAction::SetTrue) {
                    let words = arg
                        .get_value_parser()
                        .possible_values()
                        .into_iter()
                        .flatten();
                    let words: Vec<_> = words.map(|v| v.get_name().to_owned()).collect();
                    assert!(
                        words.contains(&"yes".into()),
                        "`{name} --{long}`: {words:?}"
                    );
                }
                if let Some(other) = seen.insert(variable(long), long) {
                    panic!("`{name}`: --{other} and --{long} read one variable");
                }
            }
        }
        assert!(checked > 130, "only {checked} flags seen");
        assert_eq!(variable("drain-timeout"), "SHARDLINE_DRAIN_TIMEOUT");
    }

    #[test]
    fn help_shows_no_defaults_password() {
        for (name, mut cmd) in commands() {
            for (long, arg) in flags(&cmd) {
                let defaults = arg.get_default_values().iter();
                let secret = defaults
                    .map(|v| v.to_string_lossy())
                    .any(|v| redact(&v) != v);
                assert!(
                    !secret || arg.is_hide_default_value_set(),
                    "`{name} --{long}` shows its default"
                );
            }
            for help in [cmd.render_help(), cmd.render_long_help()] {
                let help = help.to_string();
                assert!(!help.contains("guest:guest"), "`{name}`:\n{help}");
                if name == "shardline worker" {
                    let shown = "[default: amqp://guest:***@127.0.0.1:5672/%2f]";
                    assert!(help.contains(shown), "`{name}`:\n{help}");
                }
            }
        }
    }

    #[test]
    fn the_parsed_command_line_shows_no_password() {
        const CANARY: &str = "Canary7q9Zx";
        let amqp = format!("amqp://u:{CANARY}@h/v");
        let redis = format!("redis://:{CANARY}@h");
        let management = format!("http://u:{CANARY}@h:15672");
        let handler = format!("http://u:{CANARY}@h/events");
        let orders = format!("postgres://u:{CANARY}@h/orders");
        let globals = [
            "--amqp-url",
            &amqp,
            "--redis-url",
            &redis,
            "--management-url",
            &management,
        ];
        for command in [
            vec!["worker", "--handler", &handler],
            vec!["reconcile", "--orders-url", &orders],
            vec!["console", "--orders-url", &orders],
            vec!["outbox", "install", "--database-url", &orders],
        ] {
            let args: Vec<&str> = command.iter().copied().chain(globals).collect();
            let cli = parse(&BTreeMap::new(), &args);
            let shown = format!("{cli:?}");
            assert!(!shown.contains(CANARY), "{shown}");
        }
    }

    #[test]
    fn the_exceptions_and_the_renamed_variables_name_flags_that_exist() {
        let all = commands();
        let has = |command: &str, long: &str| {
            all.iter()
                .any(|(name, cmd)| name.ends_with(command) && flags(cmd).any(|(l, _)| l == long))
        };
        for (long, _) in NO_FALLBACK {
            assert!(has("", long), "--{long}");
        }
        for renamed in RENAMED {
            let long = renamed.flag;
            assert_ne!(renamed.old, variable(long));
            for command in renamed.commands {
                assert!(
                    has(&format!("shardline {command}"), long),
                    "{command} --{long}"
                );
            }
        }
    }

    #[test]
    fn an_old_variable_is_read_for_its_commands_while_the_new_one_is_unset() {
        let old = env(&[("SHARDLINE_PUBLISH_WINDOW", "7")]);
        let (_, warnings) = renamed(command(), &old);
        assert_eq!(
            warnings,
            [(
                &["publish", "load"][..],
                "warning: SHARDLINE_PUBLISH_WINDOW is read for one more release; set SHARDLINE_WINDOW".to_owned()
            )]
        );
        assert_eq!(
            window(parse(
                &old,
                &["publish", "--order-id", "o-1", "--event", "e"]
            )),
            "7"
        );
        assert_eq!(
            window(parse(
                &old,
                &["load", "--orders", "1", "--events-per-order", "1"]
            )),
            "7"
        );
        // The flag still wins; another command's --window is another flag.
        let given = [
            "publish",
            "--order-id",
            "o-1",
            "--event",
            "e",
            "--window",
            "9",
        ];
        assert_eq!(window(parse(&old, &given)), "9");
        let reconcile = ["reconcile", "--orders-url", "postgres://db/o"];
        assert_eq!(
            window(parse(&old, &reconcile)),
            format!("{:?}", Duration::from_secs(86_400))
        );
    }

    #[test]
    fn the_new_variable_wins_over_the_old_one_which_is_then_ignored_with_a_warning() {
        let both = env(&[("SHARDLINE_PUBLISH_WINDOW", "7"), ("SHARDLINE_WINDOW", "9")]);
        let (_, warnings) = renamed(command(), &both);
        assert_eq!(warnings.len(), 1);
        assert_eq!(
            warnings[0].1,
            "warning: SHARDLINE_PUBLISH_WINDOW is ignored: SHARDLINE_WINDOW is set"
        );
        // SHARDLINE_WINDOW itself is clap's to read (from the process): here the default.
        let default = shardline_publisher::Config::default().window.to_string();
        assert_eq!(
            window(parse(
                &both,
                &["publish", "--order-id", "o-1", "--event", "e"]
            )),
            default
        );
    }

    #[test]
    fn the_consoles_old_variables_are_read_for_one_more_release() {
        let old = env(&[
            ("SHARDLINE_CONSOLE_LISTEN", "0.0.0.0:9000"),
            ("SHARDLINE_CONSOLE_TOKEN_FILE", "/run/tokens"),
            ("SHARDLINE_CONSOLE_BASE_PATH", "/console"),
            ("SHARDLINE_CONSOLE_TOKENS", "a:admin:t"),
        ]);
        let (_, warnings) = renamed(command(), &old);
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        let Command::Console(args) = parse(&old, &["console"]).command else {
            panic!("not the console")
        };
        assert_eq!(args.listen.to_string(), "0.0.0.0:9000");
        assert_eq!(args.token_file, Some(PathBuf::from("/run/tokens")));
        assert_eq!(args.base_path, "/console");
        let Command::Console(args) = parse(&old, &["console", "--base-path", "/x"]).command else {
            panic!("not the console")
        };
        assert_eq!(args.base_path, "/x");
    }
}
