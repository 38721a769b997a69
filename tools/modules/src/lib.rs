//! Module import cycles of a crate, found from its source alone.
//!
//! A crate is read from its root file (`src/lib.rs` or `src/main.rs`) through
//! its `mod` declarations. Every path a module names — in `use` items (globs
//! included) and in its code — is resolved to the module that defines the
//! item: `crate::`, `self::` and `super::` paths, a child module's name, a
//! name brought in by `use`, and re-exports (`pub use a::Thing` in a parent,
//! followed to `a`). Paths of other crates are left out, and so is test-only
//! code (`#[cfg(test)]` items and modules).
//!
//! Cycles are looked for among the children of each module, each child with
//! all of its descendants: a folder module whose file re-exports its child
//! while the child uses the parent's items is one node, not a cycle. Paths
//! inside macro invocations are not read (they are token streams).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A module's path inside its crate: `[]` is the root, `["dedup", "tests"]`
/// is `crate::dedup::tests`.
pub type ModPath = Vec<String>;

/// What stops a crate from being read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}: does not parse as Rust: {cause}")]
    Parse { path: PathBuf, cause: syn::Error },
    #[error("{parent}: `mod {name};` has no file ({name}.rs or {name}/mod.rs)")]
    MissingModule { parent: PathBuf, name: String },
}

/// One module: its children and what it names.
#[derive(Debug, Default)]
struct Module {
    children: BTreeSet<String>,
    /// Names brought in by `use`: alias → the path as written.
    uses: BTreeMap<String, Vec<String>>,
    /// Every path it names, as written (use leaves, globs, code paths).
    refs: Vec<Vec<String>>,
}

/// A crate's modules, by path.
#[derive(Debug, Default)]
pub struct Crate {
    modules: BTreeMap<ModPath, Module>,
}

/// Modules that import each other in a circle: children of `parent`, with the
/// imports that tie them (importer → imported: the names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cycle {
    pub parent: ModPath,
    pub members: Vec<String>,
    pub ties: Vec<(String, String, BTreeSet<String>)>,
}

impl fmt::Display for Cycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = if self.parent.is_empty() {
            "crate".to_owned()
        } else {
            format!("crate::{}", self.parent.join("::"))
        };
        write!(f, "in {at}: {}", self.members.join(" ↔ "))?;
        for (from, to, names) in &self.ties {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            write!(f, "; {from} → {to} ({})", names.join(", "))?;
        }
        Ok(())
    }
}

impl Crate {
    /// Reads the crate whose root file is `root`.
    pub fn load(root: &Path) -> Result<Self, Error> {
        let mut krate = Self::default();
        let dir = root.parent().unwrap_or(Path::new(".")).to_path_buf();
        krate.load_file(root, &dir, Vec::new())?;
        Ok(krate)
    }

    fn load_file(&mut self, file: &Path, dir: &Path, path: ModPath) -> Result<(), Error> {
        let text = std::fs::read_to_string(file).map_err(|cause| Error::Read {
            path: file.to_path_buf(),
            cause,
        })?;
        let parsed = syn::parse_file(&text).map_err(|cause| Error::Parse {
            path: file.to_path_buf(),
            cause,
        })?;
        self.load_items(&parsed.items, file, dir, path)
    }

    fn load_items(
        &mut self,
        items: &[syn::Item],
        file: &Path,
        dir: &Path,
        path: ModPath,
    ) -> Result<(), Error> {
        let mut module = Module::default();
        let mut nested = Vec::new();
        for item in items {
            if is_test_only(item_attrs(item)) {
                continue;
            }
            match item {
                syn::Item::Mod(m) => {
                    let name = m.ident.to_string();
                    module.children.insert(name.clone());
                    nested.push(m);
                }
                syn::Item::Use(u) => {
                    let mut leaves = Vec::new();
                    flatten_use(&u.tree, &mut Vec::new(), &mut leaves);
                    for (alias, full) in leaves {
                        if let Some(alias) = alias {
                            module.uses.insert(alias, full.clone());
                        }
                        module.refs.push(full);
                    }
                }
                other => {
                    let mut paths = PathCollector::default();
                    paths.visit_item(other);
                    module.refs.extend(paths.found);
                }
            }
        }
        self.modules.insert(path.clone(), module);
        for m in nested {
            let name = m.ident.to_string();
            let mut child = path.clone();
            child.push(name.clone());
            match &m.content {
                Some((_, items)) => {
                    self.load_items(items, file, &dir.join(&name), child)?;
                }
                None => {
                    let (child_file, child_dir) =
                        module_file(dir, &name).ok_or_else(|| Error::MissingModule {
                            parent: file.to_path_buf(),
                            name: name.clone(),
                        })?;
                    self.load_file(&child_file, &child_dir, child)?;
                }
            }
        }
        Ok(())
    }

    /// Every import of one module by another: (importer, imported, name).
    fn imports(&self) -> Vec<(ModPath, ModPath, String)> {
        let mut out = Vec::new();
        for (from, module) in &self.modules {
            for raw in &module.refs {
                let Some(target) = self.resolve(from, raw, 0) else {
                    continue;
                };
                if &target != from {
                    let name = raw.last().cloned().unwrap_or_default();
                    out.push((from.clone(), target, name));
                }
            }
        }
        out
    }

    /// The module that defines what `raw`, written in `from`, names; `None`
    /// for another crate's paths.
    fn resolve(&self, from: &ModPath, raw: &[String], depth: usize) -> Option<ModPath> {
        let absolute = self.absolute(from, raw)?;
        self.follow(&absolute, depth)
    }

    /// `raw` as a path from the crate root, when it is this crate's.
    fn absolute(&self, from: &ModPath, raw: &[String]) -> Option<Vec<String>> {
        let first = raw.first()?;
        match first.as_str() {
            "crate" => Some(raw[1..].to_vec()),
            "self" => Some([from.as_slice(), &raw[1..]].concat()),
            "super" => {
                let mut base = from.clone();
                let mut rest = raw;
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop();
                    rest = &rest[1..];
                }
                Some([base.as_slice(), rest].concat())
            }
            name => {
                let module = self.modules.get(from)?;
                if module.children.contains(name) {
                    Some([from.as_slice(), raw].concat())
                } else if module.uses.contains_key(name) {
                    // Resolved by `follow` through the alias.
                    Some([from.as_slice(), raw].concat())
                } else {
                    None
                }
            }
        }
    }

    /// Walks `absolute` down the module tree, through `use` aliases (and so
    /// re-exports), to the module that defines its item.
    fn follow(&self, absolute: &[String], depth: usize) -> Option<ModPath> {
        if depth > 32 {
            return None;
        }
        let mut current: ModPath = Vec::new();
        for (i, segment) in absolute.iter().enumerate() {
            let module = self.modules.get(&current)?;
            if module.children.contains(segment) {
                current.push(segment.clone());
                continue;
            }
            if let Some(target) = module.uses.get(segment) {
                let mut aliased = target.clone();
                aliased.extend_from_slice(&absolute[i + 1..]);
                return self.resolve(&current, &aliased, depth + 1);
            }
            return Some(current);
        }
        Some(current)
    }

    /// The import cycles among the children of every module.
    pub fn cycles(&self) -> Vec<Cycle> {
        let imports = self.imports();
        let mut cycles = Vec::new();
        for (parent, module) in &self.modules {
            if module.children.len() < 2 {
                continue;
            }
            let mut ties: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
            for (from, to, name) in &imports {
                let (Some(a), Some(b)) = (child_under(parent, from), child_under(parent, to))
                else {
                    continue;
                };
                if a != b {
                    ties.entry((a, b)).or_default().insert(name.clone());
                }
            }
            let nodes: Vec<String> = module.children.iter().cloned().collect();
            for members in strongly_connected(&nodes, &ties) {
                let in_cycle: BTreeSet<&String> = members.iter().collect();
                let cycle_ties = ties
                    .iter()
                    .filter(|((a, b), _)| in_cycle.contains(a) && in_cycle.contains(b))
                    .map(|((a, b), names)| (a.clone(), b.clone(), names.clone()))
                    .collect();
                cycles.push(Cycle {
                    parent: parent.clone(),
                    members,
                    ties: cycle_ties,
                });
            }
        }
        cycles
    }
}

/// The child of `parent` that `path` lies in (itself or a descendant).
fn child_under(parent: &ModPath, path: &ModPath) -> Option<String> {
    (path.len() > parent.len() && path.starts_with(parent)).then(|| path[parent.len()].clone())
}

/// The strongly connected groups of two or more nodes (Tarjan), each sorted.
fn strongly_connected(
    nodes: &[String],
    ties: &BTreeMap<(String, String), BTreeSet<String>>,
) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: BTreeMap<&'a str, Vec<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        groups: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).cloned().unwrap_or_default() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    group.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    self.groups.push(group);
                }
            }
        }
    }
    let mut edges: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in ties.keys() {
        edges.entry(a.as_str()).or_default().push(b.as_str());
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        groups: Vec::new(),
    };
    for node in nodes {
        if !walk.index.contains_key(node.as_str()) {
            walk.visit(node);
        }
    }
    walk.groups.sort();
    walk.groups
}

/// The file and directory of module `name` declared in a module whose
/// children live in `dir`.
fn module_file(dir: &Path, name: &str) -> Option<(PathBuf, PathBuf)> {
    let flat = dir.join(format!("{name}.rs"));
    if flat.is_file() {
        return Some((flat, dir.join(name)));
    }
    let folder = dir.join(name).join("mod.rs");
    folder.is_file().then(|| (folder, dir.join(name)))
}

/// The leaves of a `use` tree: (the name it binds, the path as written). A
/// glob binds no name; `self` in a group binds the group's module.
fn flatten_use(
    tree: &syn::UseTree,
    prefix: &mut Vec<String>,
    out: &mut Vec<(Option<String>, Vec<String>)>,
) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            flatten_use(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            if name == "self" {
                let alias = prefix.last().cloned();
                out.push((alias, prefix.clone()));
            } else {
                let mut full = prefix.clone();
                full.push(name.clone());
                out.push((Some(name), full));
            }
        }
        syn::UseTree::Rename(r) => {
            let mut full = prefix.clone();
            full.push(r.ident.to_string());
            let alias = r.rename.to_string();
            out.push(((alias != "_").then_some(alias), full));
        }
        syn::UseTree::Glob(_) => out.push((None, prefix.clone())),
        syn::UseTree::Group(g) => {
            for tree in &g.items {
                flatten_use(tree, prefix, out);
            }
        }
    }
}

/// Paths of two or more segments in code (single names come through `use`).
#[derive(Default)]
struct PathCollector {
    found: Vec<Vec<String>>,
}

impl<'ast> Visit<'ast> for PathCollector {
    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.segments.len() > 1 {
            self.found
                .push(path.segments.iter().map(|s| s.ident.to_string()).collect());
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_item_mod(&mut self, _: &'ast syn::ItemMod) {}

    fn visit_attribute(&mut self, _: &'ast syn::Attribute) {}

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test_only(&f.attrs) {
            syn::visit::visit_impl_item_fn(self, f);
        }
    }
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    match item {
        syn::Item::Const(i) => &i.attrs,
        syn::Item::Enum(i) => &i.attrs,
        syn::Item::Fn(i) => &i.attrs,
        syn::Item::Impl(i) => &i.attrs,
        syn::Item::Mod(i) => &i.attrs,
        syn::Item::Static(i) => &i.attrs,
        syn::Item::Struct(i) => &i.attrs,
        syn::Item::Trait(i) => &i.attrs,
        syn::Item::Type(i) => &i.attrs,
        syn::Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// `#[cfg(test)]`, or a `cfg` that needs `test` (`cfg(all(test, …))`).
fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("cfg") && {
            let mut test = false;
            let _ = attr.parse_nested_meta(|meta| {
                test |= meta.path.is_ident("test")
                    || (meta.path.is_ident("all") && nested_has_test(&meta));
                Ok(())
            });
            test
        }
    })
}

fn nested_has_test(meta: &syn::meta::ParseNestedMeta<'_>) -> bool {
    let mut test = false;
    let _ = meta.parse_nested_meta(|inner| {
        test |= inner.path.is_ident("test");
        if inner.input.peek(syn::token::Paren) {
            let _ = inner.parse_nested_meta(|_| Ok(()));
        }
        Ok(())
    });
    test
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A throwaway crate of `files` (path → text) under the system's temp dir.
    struct Planted(PathBuf);

    impl Planted {
        fn new(name: &str, files: &[(&str, &str)]) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("shardline-modules-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            for (path, text) in files {
                let file = dir.join(path);
                std::fs::create_dir_all(file.parent().unwrap()).unwrap();
                std::fs::write(file, text).unwrap();
            }
            Self(dir)
        }

        fn cycles(&self) -> Vec<Cycle> {
            Crate::load(&self.0.join("lib.rs")).unwrap().cycles()
        }
    }

    impl Drop for Planted {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn members(cycles: &[Cycle]) -> Vec<Vec<&str>> {
        cycles
            .iter()
            .map(|c| c.members.iter().map(String::as_str).collect())
            .collect()
    }

    #[test]
    fn a_cycle_through_crate_paths_is_caught_with_its_ties() {
        let planted = Planted::new(
            "crate-paths",
            &[
                ("lib.rs", "mod a;\nmod b;\n"),
                ("a.rs", "use crate::b::Bee;\npub struct Ay;\n"),
                (
                    "b.rs",
                    "pub struct Bee;\nfn f() -> crate::a::Ay { todo!() }\n",
                ),
            ],
        );
        let cycles = planted.cycles();
        assert_eq!(members(&cycles), [["a", "b"]]);
        let text = cycles[0].to_string();
        assert!(
            text.contains("a → b (Bee)") && text.contains("b → a (Ay)"),
            "{text}"
        );
    }

    #[test]
    fn super_glob_and_reexported_paths_are_resolved() {
        let planted = Planted::new(
            "super-glob-reexport",
            &[
                ("lib.rs", "mod a;\nmod b;\nmod c;\npub use c::Sea;\n"),
                ("a.rs", "use super::b::*;\n"),
                ("b.rs", "use crate::Sea;\npub fn bee() {}\n"),
                ("c.rs", "pub struct Sea;\nfn f() { super::a::g(); }\n"),
            ],
        );
        // a → b (glob), b → c (re-export), c → a (super): one circle of three.
        assert_eq!(members(&planted.cycles()), [["a", "b", "c"]]);
    }

    #[test]
    fn a_use_of_a_child_module_by_name_and_a_renamed_import_count() {
        let planted = Planted::new(
            "by-name",
            &[
                ("lib.rs", "mod a;\nmod b;\nuse b as bee;\n"),
                ("a.rs", "use crate::bee::Bee as B;\nfn f(_: B) {}\n"),
                (
                    "b.rs",
                    "pub struct Bee;\nuse super::a;\nfn g() { a::h(); }\n",
                ),
            ],
        );
        assert_eq!(members(&planted.cycles()), [["a", "b"]]);
    }

    #[test]
    fn one_way_imports_and_a_folder_module_with_its_children_are_no_cycle() {
        let planted = Planted::new(
            "no-cycle",
            &[
                ("lib.rs", "mod a;\nmod b;\n"),
                ("a.rs", "use crate::b::Bee;\n"),
                (
                    "b/mod.rs",
                    "mod inner;\npub use inner::Bee;\npub struct Hive;\n",
                ),
                ("b/inner.rs", "use super::Hive;\npub struct Bee(Hive);\n"),
            ],
        );
        assert_eq!(planted.cycles(), []);
    }

    #[test]
    fn test_only_code_is_left_out() {
        let planted = Planted::new(
            "tests",
            &[
                ("lib.rs", "mod a;\nmod b;\n"),
                ("a.rs", "use crate::b::Bee;\n"),
                (
                    "b.rs",
                    "pub struct Bee;\n#[cfg(test)]\nmod tests { use crate::a::*; }\n#[cfg(test)]\nuse crate::a::Ay;\n",
                ),
            ],
        );
        assert_eq!(planted.cycles(), []);
    }

    #[test]
    fn a_cycle_between_nested_siblings_is_reported_under_their_parent() {
        let planted = Planted::new(
            "nested",
            &[
                ("lib.rs", "mod x;\n"),
                ("x.rs", "mod y;\nmod z;\n"),
                ("x/y.rs", "use super::z::Zed;\npub struct Why;\n"),
                ("x/z.rs", "pub struct Zed(crate::x::y::Why);\n"),
            ],
        );
        let cycles = planted.cycles();
        assert_eq!(members(&cycles), [["y", "z"]]);
        assert_eq!(cycles[0].parent, ["x"]);
        assert!(cycles[0].to_string().starts_with("in crate::x: y ↔ z"));
    }

    #[test]
    fn a_missing_module_file_is_an_error_naming_it() {
        let planted = Planted::new("missing", &[("lib.rs", "mod gone;\n")]);
        let error = Crate::load(&planted.0.join("lib.rs")).unwrap_err();
        assert!(
            error.to_string().contains("`mod gone;` has no file"),
            "{error}"
        );
    }
}
