//! docs/reference/cli.md, rendered from the command line's own definition:
//! every command's `--help`, so the reference cannot drift from the flags,
//! and the environment fallbacks as `main` sets them (`crate::environment`).

use std::collections::BTreeMap;

use crate::environment::{self, NO_FALLBACK, RENAMED};

/// Every visible command, depth first, as `## shardline …` with its long help.
fn render() -> String {
    let mut cli = environment::command();
    cli.build();
    let mut page = String::from(
        "# Command line\n\n\
         Generated from the `shardline` binary's own help (`src/reference.rs`); do not edit by\n\
         hand. Global flags go before or after the subcommand. The same text is\n\
         `shardline <command> --help`.\n",
    );
    let mut commands = Vec::new();
    walk(&cli, &mut commands);
    page.push_str(&environment_section(&commands));
    page.push_str("\n## Commands\n\n");
    for (name, cmd) in &commands {
        let about = cmd.get_about().map(|a| a.to_string()).unwrap_or_default();
        let anchor = name.replace(' ', "-");
        page.push_str(&format!("- [`{name}`](#{anchor}): {about}\n"));
    }
    for (name, cmd) in commands {
        let help = cmd.clone().render_long_help().to_string();
        let help: Vec<&str> = help.lines().map(str::trim_end).collect();
        page.push_str(&format!(
            "\n## {name}\n\n```text\n{}\n```\n",
            help.join("\n").trim()
        ));
    }
    page
}

/// The rule, its exceptions, the variables several commands read, the old names.
fn environment_section(commands: &[(String, clap::Command)]) -> String {
    let mut page = String::from(
        "\n## Environment variables\n\n\
         Every flag `--NAME` falls back to the variable `SHARDLINE_NAME` (upper case, `-` as `_`),\n\
         shown beside it as `[env: …]` (by name only: help never shows a variable's value); a\n\
         flag given wins over its variable, and the variable over the default. A switch's\n\
         variable takes `true` or `false` (also `yes`/`no`, `on`/`off`, `1`/`0`, any case);\n\
         anything else, empty included, is refused. A repeatable flag takes one value from its\n\
         variable, or a comma-separated list where the flag takes one (`--config-statuses`).\n\n\
         Flags without a variable:\n\n",
    );
    for (flag, why) in NO_FALLBACK {
        let of = commands.iter().filter(|(_, cmd)| has(cmd, flag));
        let of: Vec<String> = of.map(|(name, _)| format!("`{name}`")).collect();
        page.push_str(&format!("- `--{flag}` ({}): {why}.\n", of.join(", ")));
    }
    page.push_str(
        "\nOne name, one variable: the flags of one name in several commands read the same\n\
         variable, so an environment shared by those commands gives all of them its value:\n\n",
    );
    let mut readers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, cmd) in commands {
        let own = cmd.get_arguments().filter(|arg| !arg.is_global_set());
        for var in own.filter_map(|arg| arg.get_env()) {
            let var = var.to_string_lossy().into_owned();
            readers.entry(var).or_default().push(format!("`{name}`"));
        }
    }
    for (var, names) in readers.iter().filter(|(_, names)| names.len() > 1) {
        page.push_str(&format!("- `{var}`: {}\n", names.join(", ")));
    }
    page.push_str(
        "\nRenamed to the rule, the old names are read for one more release when the new one\n\
         is unset, with a warning on stderr:\n\n",
    );
    for renamed in RENAMED {
        let of = renamed
            .commands
            .iter()
            .map(|name| format!("`shardline {name}`"));
        let of = of.collect::<Vec<_>>().join(", ");
        let (old, flag) = (renamed.old, renamed.flag);
        let new = shardline_cli_env::variable(environment::PREFIX, flag);
        page.push_str(&format!("- `{old}` ({of} `--{flag}`): now `{new}`\n"));
    }
    page
}

/// Whether CMD has the flag `--LONG` of its own.
fn has(cmd: &clap::Command, long: &str) -> bool {
    cmd.get_arguments()
        .any(|arg| arg.get_long() == Some(long) && !arg.is_global_set())
}

fn walk(cmd: &clap::Command, into: &mut Vec<(String, clap::Command)>) {
    let name = cmd
        .get_bin_name()
        .unwrap_or_else(|| cmd.get_name())
        .to_owned();
    into.push((name, cmd.clone()));
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() != "help" {
            walk(sub, into);
        }
    }
}

#[test]
fn the_cli_reference_is_current() {
    let page = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/reference/cli.md");
    shardline_docs::generated::check(
        &page,
        &render(),
        "cargo test -p shardline --bin shardline the_cli_reference_is_current",
    )
    .unwrap_or_else(|e| panic!("{e}"));
}
