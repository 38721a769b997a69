//! `doc-check [ROOT]`: checks the documentation of the repository at ROOT (the
//! current directory by default) and prints each problem on a line of its own.
//! Exit 0 when there are none, 1 when there are, 2 when a page cannot be read.

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let root = std::env::args().nth(1).unwrap_or_else(|| ".".to_owned());
    let site = match shardline_docs::Site::load(Path::new(&root)) {
        Ok(site) => site,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let problems = site.problems();
    for problem in &problems {
        println!("{problem}");
    }
    if problems.is_empty() {
        println!(
            "{} pages: every relative link and anchor resolves, every named test exists",
            site.pages().len()
        );
        ExitCode::SUCCESS
    } else {
        println!(
            "{} problem(s): mend the link or anchor, or name the test as `path/to/file.rs::fn_name`",
            problems.len()
        );
        ExitCode::FAILURE
    }
}
