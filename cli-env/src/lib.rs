//! A clap command line's environment fallbacks by one rule, set in one place
//! for every command instead of flag by flag: the flag `--NAME` reads the
//! variable `PREFIX_NAME` (upper case, `-` as `_`), shown in help by name only.
//! Variables renamed to the rule are read for one more release, with a warning.

use std::collections::BTreeMap;
use std::ffi::OsString;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, ArgMatches, Command};

/// The variable of the flag `--LONG`: `variable("SHARDLINE", "drain-timeout")`
/// is `SHARDLINE_DRAIN_TIMEOUT`.
pub fn variable(prefix: &str, long: &str) -> String {
    format!("{prefix}_{}", long.to_uppercase().replace('-', "_"))
}

/// CMD and its subcommands with every long flag's variable but those of
/// EXCEPT (flag, why). Help shows the variable's name only: an unset one is not
/// "set to empty", a secret is not printed. A switch's variable takes true or
/// false, yes or no, on or off, 1 or 0 (any case); anything else is refused.
pub fn with_variables(cmd: Command, prefix: &str, except: &[(&str, &str)]) -> Command {
    cmd.mut_args(|arg| {
        let long = arg
            .get_long()
            .filter(|long| except.iter().all(|(flag, _)| flag != long));
        let Some(name) = long.map(|long| variable(prefix, long)) else {
            return arg;
        };
        let switch = matches!(arg.get_action(), ArgAction::SetTrue);
        let arg = arg.env(name).hide_env_values(true);
        match switch {
            true => arg.value_parser(BoolishValueParser::new()),
            false => arg,
        }
    })
    .mut_subcommands(|sub| with_variables(sub, prefix, except))
}

/// A variable renamed to the rule: its old name, the subcommands whose flag
/// `--flag` read it.
#[derive(Debug, Clone, Copy)]
pub struct Renamed {
    pub old: &'static str,
    pub commands: &'static [&'static str],
    pub flag: &'static str,
}

impl Renamed {
    pub const fn new(
        old: &'static str,
        commands: &'static [&'static str],
        flag: &'static str,
    ) -> Self {
        Self {
            old,
            commands,
            flag,
        }
    }
}

/// What to say, when one of the subcommands runs, about an old variable that is set.
pub type Warning = (&'static [&'static str], String);

/// The old variables set in ENV whose flag's variable is not become that
/// flag's default (a flag given and its variable still win), each with its
/// warning; one set beside its new name is ignored, with a warning.
pub fn renamed(
    mut cmd: Command,
    prefix: &str,
    table: &[Renamed],
    env: &BTreeMap<String, OsString>,
) -> (Command, Vec<Warning>) {
    let mut warnings = Vec::new();
    for &Renamed {
        old,
        commands,
        flag,
    } in table
    {
        let Some(value) = env.get(old) else { continue };
        let new = variable(prefix, flag);
        if env.contains_key(&new) {
            warnings.push((commands, format!("warning: {old} is ignored: {new} is set")));
            continue;
        }
        cmd = cmd.mut_subcommands(|sub| match commands.contains(&sub.get_name()) {
            true => sub.mut_args(|arg| match arg.get_long() == Some(flag) {
                // The value came from the environment: help never shows it.
                true => arg.default_value(value).hide_default_value(true),
                false => arg,
            }),
            false => sub,
        });
        let warning = format!("warning: {old} is read for one more release; set {new}");
        warnings.push((commands, warning));
    }
    (cmd, warnings)
}

/// The process's arguments and environment matched against CMD (the old
/// variables of TABLE read, their warnings printed to stderr for the
/// subcommand that runs), or clap's message and exit code (help and version too).
pub fn matches(cmd: Command, prefix: &str, table: &[Renamed]) -> (Command, ArgMatches) {
    let env = std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value)))
        .filter(|(name, _)| name.starts_with(prefix))
        .collect();
    let (mut cmd, warnings) = renamed(cmd, prefix, table, &env);
    let matches = cmd
        .try_get_matches_from_mut(std::env::args_os())
        .unwrap_or_else(|e| e.exit());
    let run = matches.subcommand_name().unwrap_or_default();
    for (_, warning) in warnings.iter().filter(|(of, _)| of.contains(&run)) {
        eprintln!("{warning}");
    }
    (cmd, matches)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Arg;

    fn cli() -> Command {
        let window = || Arg::new("window").long("window").default_value("1");
        let cmd = Command::new("t")
            .arg(
                Arg::new("dry-run")
                    .long("dry-run")
                    .action(ArgAction::SetTrue)
                    .global(true),
            )
            .subcommand(Command::new("publish").arg(window()))
            .subcommand(Command::new("reconcile").arg(window()))
            .subcommand(
                Command::new("purge").arg(Arg::new("yes").long("yes").action(ArgAction::SetTrue)),
            );
        with_variables(cmd, "T", &[("yes", "typed each time")])
    }

    const TABLE: &[Renamed] = &[Renamed {
        old: "T_PUBLISH_WINDOW",
        commands: &["publish"],
        flag: "window",
    }];

    fn env(vars: &[(&str, &str)]) -> BTreeMap<String, OsString> {
        vars.iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
            .collect()
    }

    fn window(env: &BTreeMap<String, OsString>, args: &[&str]) -> String {
        let (cmd, _) = renamed(cli(), "T", TABLE, env);
        let m = cmd.try_get_matches_from(args).unwrap();
        let (_, sub) = m.subcommand().unwrap();
        sub.get_one::<String>("window").unwrap().clone()
    }

    #[test]
    fn every_flag_reads_its_variable_but_the_exceptions() {
        let mut cmd = cli();
        cmd.build();
        let arg = |sub: &str, id: &str| {
            let sub = cmd.find_subcommand(sub).unwrap();
            let arg = sub.get_arguments().find(|a| a.get_id() == id).unwrap();
            (
                arg.get_env().map(|v| v.to_string_lossy().into_owned()),
                arg.is_hide_env_values_set(),
            )
        };
        assert_eq!(arg("publish", "window"), (Some("T_WINDOW".into()), true));
        assert_eq!(arg("reconcile", "window"), (Some("T_WINDOW".into()), true));
        assert_eq!(arg("purge", "dry-run"), (Some("T_DRY_RUN".into()), true));
        assert_eq!(arg("purge", "yes"), (None, false));
        let help = cmd
            .find_subcommand_mut("publish")
            .unwrap()
            .render_help()
            .to_string();
        assert!(help.contains("[env: T_WINDOW]"), "{help}");
    }

    #[test]
    fn a_switch_variable_is_a_boolean_in_words_or_digits() {
        let mut cmd = cli();
        cmd.build();
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == "dry-run")
            .unwrap()
            .clone();
        let parse = |value: &str| {
            let probe = arg
                .clone()
                .env(None::<&str>)
                .global(false)
                .default_value(value.to_owned());
            Command::new("p")
                .arg(probe)
                .try_get_matches_from(["p"])
                .map(|m| m.get_flag("dry-run"))
                .ok()
        };
        for (value, want) in [
            ("true", true),
            ("YES", true),
            ("on", true),
            ("1", true),
            ("false", false),
            ("No", false),
            ("off", false),
            ("0", false),
        ] {
            assert_eq!(parse(value), Some(want), "{value}");
        }
        assert_eq!(parse(""), None);
        assert_eq!(parse("maybe"), None);
    }

    #[test]
    fn an_old_variable_is_read_for_its_commands_while_the_new_one_is_unset() {
        let old = env(&[("T_PUBLISH_WINDOW", "7")]);
        let (_, warnings) = renamed(cli(), "T", TABLE, &old);
        let said = "warning: T_PUBLISH_WINDOW is read for one more release; set T_WINDOW";
        assert_eq!(warnings, [(&["publish"][..], said.to_owned())]);
        assert_eq!(window(&old, &["t", "publish"]), "7");
        assert_eq!(window(&old, &["t", "publish", "--window", "9"]), "9");
        assert_eq!(window(&old, &["t", "reconcile"]), "1");
        assert_eq!(window(&env(&[]), &["t", "publish"]), "1");
    }

    #[test]
    fn an_old_variable_beside_its_new_name_is_ignored_with_a_warning() {
        let both = env(&[("T_PUBLISH_WINDOW", "7"), ("T_WINDOW", "9")]);
        let (_, warnings) = renamed(cli(), "T", TABLE, &both);
        let said = "warning: T_PUBLISH_WINDOW is ignored: T_WINDOW is set";
        assert_eq!(warnings, [(&["publish"][..], said.to_owned())]);
        // T_WINDOW is clap's to read, from the process: here unset.
        assert_eq!(window(&both, &["t", "publish"]), "1");
    }
}
