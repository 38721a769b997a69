//! Where the binaries under test and the scratch files are.
//!
//! The kit is a library, so cargo's `CARGO_BIN_EXE_…` and `CARGO_TARGET_TMPDIR`
//! (set for integration tests only) are not available to it. Both are derived
//! from the running test executable instead, `target/<profile>/deps/<test>-<hash>`.

use std::path::{Path, PathBuf};

/// `target/<profile>`: the directory of the running test's binaries.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let deps = exe.parent().expect("the test executable has a directory");
    // Integration tests live in `deps/`; a binary run from `target/<profile>` itself works too.
    if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps/ has a parent").to_owned()
    } else {
        deps.to_owned()
    }
}

/// The path of binary `name` of this workspace, `target/<profile>/<name>`, as
/// cargo builds it for the integration tests of its package. Fails loudly if it
/// is not there (a binary behind a feature the build did not enable: pass
/// `env!("CARGO_BIN_EXE_…")` instead).
pub fn cargo_bin(name: &str) -> PathBuf {
    let path = profile_dir().join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "binary `{name}` not found at {}: it is built with the integration tests of its \
         package (cargo test --test …); a binary with required-features needs them enabled",
        path.display()
    );
    path
}

/// The `shardline` binary.
pub fn shardline() -> PathBuf {
    cargo_bin("shardline")
}

/// `target/tmp/testkit/<what>`, created: logs and files of helper processes,
/// kept after the run for a look at a failure.
pub fn scratch(what: &str) -> PathBuf {
    let dir = profile_dir()
        .parent()
        .map_or_else(std::env::temp_dir, Path::to_path_buf)
        .join("tmp")
        .join("testkit")
        .join(what);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The repository's `scripts/` directory (the kit sits at `testkit/`).
pub fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit/ sits in the repository")
        .join("scripts")
}
