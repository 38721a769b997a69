//! The documentation check: every relative link of README.md, ARCHITECTURE.md
//! and `docs/**/*.md` points at a file that exists, every `#anchor` into a
//! Markdown page names one of its headings (GitHub's slugs), and every test a
//! page names as `path/to/file.rs::fn_name` is a `fn` of that file.
//!
//! - `markdown`: what is read from a page (links, anchors, named tests).
//! - [`generated`]: the reference pages rendered from the code, held to their
//!   committed copies.

pub mod generated;
mod markdown;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Component, Path, PathBuf};

/// What stops the pages from being read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {cause}")]
pub struct Error {
    path: PathBuf,
    cause: std::io::Error,
}

/// One thing wrong, at a page's line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The page, relative to the root.
    pub page: PathBuf,
    /// 1-based.
    pub line: usize,
    pub what: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.page.display(), self.line, self.what)
    }
}

/// The pages of a repository, read once.
#[derive(Debug)]
pub struct Site {
    root: PathBuf,
    /// Relative path → text.
    pages: BTreeMap<PathBuf, String>,
}

impl Site {
    /// Reads README.md and ARCHITECTURE.md (when present) and every `.md` under `docs/`.
    pub fn load(root: &Path) -> Result<Self, Error> {
        let mut paths = Vec::new();
        for top in ["README.md", "ARCHITECTURE.md"] {
            if root.join(top).is_file() {
                paths.push(PathBuf::from(top));
            }
        }
        collect_markdown(root, Path::new("docs"), &mut paths)?;
        let mut pages = BTreeMap::new();
        for path in paths {
            let text = read(&root.join(&path))?;
            pages.insert(path, text);
        }
        Ok(Self {
            root: root.to_owned(),
            pages,
        })
    }

    /// The pages read, relative to the root.
    pub fn pages(&self) -> Vec<&Path> {
        self.pages.keys().map(PathBuf::as_path).collect()
    }

    /// Every broken link, missing anchor and missing test, in page order.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        for (page, text) in &self.pages {
            for link in markdown::links(text) {
                if let Some(what) = self.broken(page, &link.target) {
                    problems.push(Problem {
                        page: page.clone(),
                        line: link.line,
                        what,
                    });
                }
            }
            for test in markdown::named_tests(text) {
                if let Some(what) = self.missing_test(&test.file, &test.name) {
                    problems.push(Problem {
                        page: page.clone(),
                        line: test.line,
                        what,
                    });
                }
            }
        }
        problems
    }

    /// Why a link from `page` is broken, if it is.
    fn broken(&self, page: &Path, target: &str) -> Option<String> {
        let scheme = target
            .split_once(':')
            .is_some_and(|(s, _)| !s.is_empty() && !s.contains(['/', '#', '.']));
        if scheme || target.starts_with("//") {
            return None;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target, None),
        };
        let file = if path.is_empty() {
            page.to_owned()
        } else {
            let base = match path.strip_prefix('/') {
                Some(_) => PathBuf::new(),
                None => page.parent().map(Path::to_owned).unwrap_or_default(),
            };
            let Some(file) = normalize(&base.join(percent_decoded(path.trim_start_matches('/'))))
            else {
                return Some(format!("link `{target}` leaves the repository"));
            };
            if !self.root.join(&file).exists() {
                return Some(format!(
                    "broken link `{target}`: no file {}",
                    file.display()
                ));
            }
            file
        };
        let anchor = anchor.filter(|a| !a.is_empty())?;
        if file.extension().is_none_or(|e| e != "md") {
            return None;
        }
        let text = match self.pages.get(&file) {
            Some(text) => text.clone(),
            None => read(&self.root.join(&file)).ok()?,
        };
        let anchor = percent_decoded(anchor).to_lowercase();
        if markdown::anchors(&text).contains(&anchor) {
            None
        } else {
            Some(format!(
                "broken anchor `{target}`: {} has no heading whose anchor is `#{anchor}`",
                file.display()
            ))
        }
    }

    /// Why a named test does not exist, if it does not.
    fn missing_test(&self, file: &str, name: &str) -> Option<String> {
        let Ok(source) = read(&self.root.join(file)) else {
            return Some(format!(
                "names test `{file}::{name}`, but there is no {file}"
            ));
        };
        let defined = source.match_indices(&format!("fn {name}")).any(|(at, m)| {
            source[at + m.len()..].starts_with(['(', '<'])
                && !source[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_')
        });
        (!defined).then(|| format!("names test `{file}::{name}`, but {file} has no `fn {name}`"))
    }
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|cause| Error {
        path: path.to_owned(),
        cause,
    })
}

/// Adds every `.md` under `root/dir` (relative paths), in name order.
fn collect_markdown(root: &Path, dir: &Path, into: &mut Vec<PathBuf>) -> Result<(), Error> {
    let full = root.join(dir);
    if !full.is_dir() {
        return Ok(());
    }
    let entries = std::fs::read_dir(&full).map_err(|cause| Error {
        path: full.clone(),
        cause,
    })?;
    let mut names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
    names.sort();
    for name in names {
        let path = dir.join(&name);
        if root.join(&path).is_dir() {
            collect_markdown(root, &path, into)?;
        } else if path.extension().is_some_and(|e| e == "md") {
            into.push(path);
        }
    }
    Ok(())
}

/// `a/./b/../c` → `a/c`; `None` when `..` climbs above the root.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => out.pop().then_some(())?,
            Component::Normal(part) => out.push(part),
            _ => {}
        }
    }
    Some(out)
}

/// `%20` and the like, as a browser reads them; anything malformed stays as written.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A throwaway repository: files planted under a fresh temporary directory.
    struct Planted(PathBuf);

    impl Planted {
        fn new(name: &str, files: &[(&str, &str)]) -> Self {
            let root =
                std::env::temp_dir().join(format!("shardline-docs-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            for (path, text) in files {
                let path = root.join(path);
                std::fs::create_dir_all(path.parent().unwrap_or(&root)).unwrap();
                std::fs::write(path, text).unwrap();
            }
            Self(root)
        }

        fn problems(&self) -> Vec<String> {
            Site::load(&self.0)
                .unwrap()
                .problems()
                .iter()
                .map(Problem::to_string)
                .collect()
        }
    }

    impl Drop for Planted {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const SOUND: &[(&str, &str)] = &[
        (
            "README.md",
            "# shardline\n[concepts](docs/concepts.md#shards-and-order), \
             [flags](docs/reference/cli.md), [here](#shardline), [web](https://x.org/a#b)\n",
        ),
        (
            "ARCHITECTURE.md",
            "## Invariants\n- one consumer per shard (`tests/fleet/crash.rs::kill_nine`)\n",
        ),
        (
            "docs/concepts.md",
            "# Concepts\n## Shards and order\n[back](../README.md), [arch](../ARCHITECTURE.md#invariants)\n",
        ),
        (
            "docs/reference/cli.md",
            "# CLI\n[up](../concepts.md#concepts)\n",
        ),
        (
            "tests/fleet/crash.rs",
            "#[tokio::test]\nasync fn kill_nine() {}\nfn kill_nine_twice() {}\n",
        ),
    ];

    fn with(changed: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut files: Vec<_> = SOUND
            .iter()
            .filter(|(path, _)| !changed.iter().any(|(p, _)| p == path))
            .copied()
            .collect();
        files.extend_from_slice(changed);
        files
    }

    #[test]
    fn a_sound_tree_passes() {
        assert_eq!(
            Planted::new("sound", SOUND).problems(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_broken_link_is_caught() {
        let planted = Planted::new(
            "link",
            &with(&[(
                "docs/concepts.md",
                "# Concepts\n## Shards and order\nsee [gone](operating/gone.md)\n",
            )]),
        );
        assert_eq!(
            planted.problems(),
            ["docs/concepts.md:3: broken link `operating/gone.md`: no file docs/operating/gone.md"]
        );
    }

    #[test]
    fn a_broken_anchor_is_caught() {
        let planted = Planted::new(
            "anchor",
            &with(&[(
                "README.md",
                "# shardline\n\n[concepts](docs/concepts.md#shards-and-orders) [self](#nowhere)\n",
            )]),
        );
        assert_eq!(
            planted.problems(),
            [
                "README.md:3: broken anchor `docs/concepts.md#shards-and-orders`: docs/concepts.md has no heading whose anchor is `#shards-and-orders`",
                "README.md:3: broken anchor `#nowhere`: README.md has no heading whose anchor is `#nowhere`",
            ]
        );
    }

    #[test]
    fn a_missing_test_is_caught() {
        let planted = Planted::new(
            "test",
            &with(&[(
                "ARCHITECTURE.md",
                "## Invariants\n- one consumer (`tests/fleet/crash.rs::kill_nine_at_32`)\n\
                 - acked after commit (`tests/fleet/ack.rs::acks`)\n",
            )]),
        );
        assert_eq!(
            planted.problems(),
            [
                "ARCHITECTURE.md:2: names test `tests/fleet/crash.rs::kill_nine_at_32`, but tests/fleet/crash.rs has no `fn kill_nine_at_32`",
                "ARCHITECTURE.md:3: names test `tests/fleet/ack.rs::acks`, but there is no tests/fleet/ack.rs",
            ]
        );
    }

    #[test]
    fn a_link_above_the_root_is_caught() {
        let planted = Planted::new(
            "above",
            &with(&[("docs/reference/cli.md", "# CLI\n[x](../../../etc/passwd)\n")]),
        );
        assert_eq!(
            planted.problems(),
            ["docs/reference/cli.md:2: link `../../../etc/passwd` leaves the repository"]
        );
    }
}
