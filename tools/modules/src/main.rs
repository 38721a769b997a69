//! `module-cycles ROOT…`: reads each crate from its root file (`src/lib.rs`,
//! `src/main.rs`) and prints the module import cycles it finds, one line each.
//! Exit 0 when there are none, 1 when there are, 2 when a crate cannot be read.

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let roots: Vec<String> = std::env::args().skip(1).collect();
    if roots.is_empty() {
        eprintln!("usage: module-cycles CRATE_ROOT_FILE…  (e.g. worker/src/lib.rs)");
        return ExitCode::from(2);
    }
    let mut found = 0;
    for root in &roots {
        let krate = match shardline_modules::Crate::load(Path::new(root)) {
            Ok(krate) => krate,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        };
        for cycle in krate.cycles() {
            found += 1;
            println!("{root}: module cycle {cycle}");
        }
    }
    if found == 0 {
        println!("no module cycles in {} crate(s)", roots.len());
        ExitCode::SUCCESS
    } else {
        println!(
            "{found} module cycle(s): stages call forward only; move what both sides need, or invert the call"
        );
        ExitCode::FAILURE
    }
}
