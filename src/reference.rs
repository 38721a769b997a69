//! docs/reference/cli.md, rendered from the command line's own definition:
//! every command's `--help`, so the reference cannot drift from the flags.

use clap::CommandFactory;

use crate::Cli;

/// Every visible command, depth first, as `## shardline …` with its long help.
fn render() -> String {
    let mut cli = hide_env_values(Cli::command());
    cli.build();
    let mut page = String::from(
        "# Command line\n\n\
         Generated from the `shardline` binary's own help (`src/reference.rs`); do not edit by\n\
         hand. Every flag falls back to the environment variable shown as `[env: …]`; global\n\
         flags go before or after the subcommand. The same text is `shardline <command> --help`.\n",
    );
    let mut commands = Vec::new();
    walk(&cli, &mut commands);
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

/// The environment of whoever renders the page must not show in it.
fn hide_env_values(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|arg| arg.hide_env_values(true))
        .mut_subcommands(hide_env_values)
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
