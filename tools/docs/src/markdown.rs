//! What the check reads from a Markdown page: its links, its anchors (GitHub's
//! heading slugs) and the tests it names. A line-based reader, not a full
//! CommonMark parser: fenced code blocks and inline code spans are skipped for
//! links, and headings are ATX (`#` … `######`).

use std::collections::HashMap;

/// A link target as written, with the 1-based line it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub line: usize,
    pub target: String,
}

/// A test a page names as `path/to/file.rs::fn_name` (or `file.rs::module::fn_name`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NamedTest {
    pub line: usize,
    pub file: String,
    pub name: String,
}

/// Lines outside fenced code blocks, with their 1-based numbers.
fn prose(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut fence: Option<&str> = None;
    text.lines().enumerate().filter_map(move |(i, line)| {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => {
                fence = Some(m);
                None
            }
            (Some(open), Some(m)) if open == m => {
                fence = None;
                None
            }
            (Some(_), _) => None,
            (None, None) => Some((i + 1, line)),
        }
    })
}

/// The line with its inline code spans blanked out (same length, so columns hold).
fn without_code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        let ticks = rest[start..].len() - rest[start..].trim_start_matches('`').len();
        let fence = &rest[start..start + ticks];
        let after = &rest[start + ticks..];
        let Some(end) = after.find(fence) else {
            break;
        };
        out.push_str(&rest[..start]);
        out.extend(std::iter::repeat_n(' ', ticks * 2 + end));
        rest = &after[end + ticks..];
    }
    out.push_str(rest);
    out
}

/// Every link target of the page: inline links and images `[text](target)`,
/// reference definitions `[label]: target`, and HTML `href="…"` / `src="…"`.
pub(crate) fn links(text: &str) -> Vec<Link> {
    let mut found = Vec::new();
    for (line, raw) in prose(text) {
        let code_free = without_code(raw);
        let mut rest = code_free.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let mut depth = 0usize;
            let end = after
                .char_indices()
                .find(|&(_, c)| match c {
                    '(' => {
                        depth += 1;
                        false
                    }
                    ')' if depth == 0 => true,
                    ')' => {
                        depth -= 1;
                        false
                    }
                    _ => false,
                })
                .map_or(after.len(), |(i, _)| i);
            let inside = after[..end].trim();
            let target = match inside.strip_prefix('<') {
                Some(bracketed) => bracketed.split('>').next().unwrap_or_default(),
                None => inside.split_whitespace().next().unwrap_or_default(),
            };
            if !target.is_empty() {
                found.push(Link {
                    line,
                    target: target.to_owned(),
                });
            }
            rest = &after[end..];
        }
        let trimmed = code_free.trim_start();
        if trimmed.starts_with('[')
            && let Some(close) = trimmed.find("]:")
            && !trimmed[1..close].contains('[')
            && let Some(target) = trimmed[close + 2..].split_whitespace().next()
        {
            found.push(Link {
                line,
                target: target.trim_matches(['<', '>']).to_owned(),
            });
        }
        for attribute in ["href=\"", "src=\""] {
            let mut rest = code_free.as_str();
            while let Some(at) = rest.find(attribute) {
                let after = &rest[at + attribute.len()..];
                let end = after.find('"').unwrap_or(after.len());
                found.push(Link {
                    line,
                    target: after[..end].to_owned(),
                });
                rest = &after[end..];
            }
        }
    }
    found
}

/// GitHub's slug of a heading's text: inline markup dropped, lowercased,
/// every character but letters, digits, `-`, `_` and spaces removed, spaces
/// turned into `-`.
pub(crate) fn slug(heading: &str) -> String {
    let mut text = String::with_capacity(heading.len());
    let mut rest = heading;
    // `[text](url)` reads as its text.
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|c| open + c) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|e| close + e) else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor of the page: its headings' slugs (a repeated slug gets `-1`,
/// `-2`, … as on GitHub) and HTML `id="…"` / `name="…"` attributes.
pub(crate) fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut found = Vec::new();
    for (_, line) in prose(text) {
        let hashes = line.len() - line.trim_start_matches('#').len();
        let heading = &line[hashes..];
        if (1..=6).contains(&hashes) && (heading.is_empty() || heading.starts_with([' ', '\t'])) {
            let heading = heading.trim().trim_end_matches('#').trim_end();
            let base = slug(heading);
            let mut candidate = base.clone();
            while seen.contains_key(&candidate) {
                let count = seen.entry(base.clone()).or_insert(0);
                *count += 1;
                candidate = format!("{base}-{count}");
            }
            seen.insert(candidate.clone(), 0);
            found.push(candidate);
        }
        for attribute in [" id=\"", " name=\""] {
            let mut rest = line;
            while let Some(at) = rest.find(attribute) {
                let after = &rest[at + attribute.len()..];
                let end = after.find('"').unwrap_or(after.len());
                found.push(after[..end].to_owned());
                rest = &after[end..];
            }
        }
    }
    found
}

/// Every `path.rs::name` the page mentions, code spans and code blocks
/// included: the last `::` segment is the function, the path is from the
/// repository's root.
pub(crate) fn named_tests(text: &str) -> Vec<NamedTest> {
    let path_char = |c: char| c.is_alphanumeric() || matches!(c, '/' | '_' | '-' | '.');
    let ident_char = |c: char| c.is_alphanumeric() || c == '_';
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut from = 0;
        while let Some(at) = line[from..].find(".rs::").map(|a| from + a) {
            let start = line[..at]
                .char_indices()
                .rev()
                .find(|&(_, c)| !path_char(c))
                .map_or(0, |(i, c)| i + c.len_utf8());
            let mut end = at + ".rs".len();
            while line[end..].starts_with("::") {
                let ident = line[end + 2..]
                    .find(|c: char| !ident_char(c))
                    .map_or(line.len() - end - 2, |n| n);
                if ident == 0 {
                    break;
                }
                end += 2 + ident;
            }
            let cited = &line[start..end];
            if let Some((file, path)) = cited.split_once("::")
                && let Some(name) = path.rsplit("::").next()
                && file.contains('/')
            {
                found.push(NamedTest {
                    line: i + 1,
                    file: file.to_owned(),
                    name: name.to_owned(),
                });
            }
            from = end.max(at + 1);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_follow_github() {
        assert_eq!(
            slug("Scaling the fleet: `--assign auto`"),
            "scaling-the-fleet---assign-auto"
        );
        assert_eq!(slug("Whose fault a failure is"), "whose-fault-a-failure-is");
        assert_eq!(
            slug("Latency: `--latency --rate R`"),
            "latency---latency---rate-r"
        );
        assert_eq!(
            slug("snake_case and [a link](x.md)"),
            "snake_case-and-a-link"
        );
        assert_eq!(slug("Ünïcode §3, too!"), "ünïcode-3-too");
    }

    #[test]
    fn repeated_headings_are_numbered() {
        let text = "# Setup\n## Setup\n```\n# not a heading\n```\n### Setup\n";
        assert_eq!(anchors(text), ["setup", "setup-1", "setup-2"]);
    }

    #[test]
    fn links_outside_code_only() {
        let text = "See [a](a.md#x) and `[b](b.md)`, ![c](img/c.png \"title\").\n\
                    ```\n[d](d.md)\n```\n[ref]: e.md\n<img src=\"f.png\">\n";
        let targets: Vec<_> = links(text).into_iter().map(|l| l.target).collect();
        assert_eq!(targets, ["a.md#x", "img/c.png", "e.md", "f.png"]);
    }

    #[test]
    fn named_tests_are_read_from_code_spans() {
        let text = "one consumer (`tests/fleet/crash.rs::kill_nine`, \
                    `worker/src/gate.rs::tests::holds`)\nnot `gate.rs::x`";
        let named: Vec<_> = named_tests(text)
            .into_iter()
            .map(|t| (t.file, t.name))
            .collect();
        assert_eq!(
            named,
            [
                ("tests/fleet/crash.rs".to_owned(), "kill_nine".to_owned()),
                ("worker/src/gate.rs".to_owned(), "holds".to_owned())
            ]
        );
    }
}
