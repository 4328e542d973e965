//! The module graph of a crate's `src/`, read from its `crate::` and `super::` paths, for the
//! tests that keep the layout honest: no module cycles, and a base layer that names no loop.
//!
//! The graph is read as text, not by the compiler: paths in code count, comments and each file's
//! trailing `#[cfg(test)]` section do not. A top-level module (`x.rs` or `x/`) is one unit;
//! inside a directory module, sibling files are units of their own, so a cycle between two
//! files of one loop is found too. A parent's `mod.rs` referring to its children, and children
//! referring to their parent's items, is how Rust modules are built and is not a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Which module each module's code refers to. Keys and values are module paths relative to the
/// crate root: `section`, `apiserver_endpoints`, `apiserver_endpoints/shutdown`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ModuleGraph {
    pub edges: BTreeMap<String, BTreeSet<String>>,
    /// Files that import their parent with a glob (`use super::*`), which would hide which
    /// sibling they use.
    pub glob_imports: BTreeSet<String>,
}

impl ModuleGraph {
    /// Reads every `.rs` file under `src` (a crate's `src/` directory), skipping `main.rs` and
    /// `bin/` (binaries refer to the library by its crate name).
    pub fn read(src: &Path) -> io::Result<Self> {
        let mut graph = ModuleGraph::default();
        let top: BTreeSet<String> = top_level_modules(src)?;
        for entry in fs::read_dir(src)? {
            let path = entry?.path();
            let name = file_stem(&path);
            if name == "main" || name == "lib" || name == "bin" {
                continue;
            }
            if path.is_dir() {
                let siblings = top_level_modules(&path)?;
                for file in rust_files(&path)? {
                    let stem = file_stem(&file);
                    if stem == "tests" {
                        continue; // a `#[cfg(test)] mod tests;` of its own file
                    }
                    let code = code_of(&fs::read_to_string(&file)?);
                    if stem != "mod" && code.contains("use super::*") {
                        graph.glob_imports.insert(format!("{name}/{stem}"));
                    }
                    let from = if stem == "mod" || !siblings.contains(&stem) {
                        name.clone()
                    } else {
                        format!("{name}/{stem}")
                    };
                    for target in crate_paths(&code) {
                        graph.add(&from, resolve(&target, &name, &top, &siblings));
                    }
                    if stem != "mod" {
                        for target in super_paths(&code) {
                            if siblings.contains(&target) {
                                graph.add(&from, Some(format!("{name}/{target}")));
                            }
                        }
                    }
                }
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let code = code_of(&fs::read_to_string(&path)?);
                for target in crate_paths(&code) {
                    graph.add(&name, resolve(&target, &name, &top, &BTreeSet::new()));
                }
            }
        }
        Ok(graph)
    }

    fn add(&mut self, from: &str, to: Option<String>) {
        let Some(to) = to else { return };
        // A unit's own submodules and its parent are not edges of the graph.
        if to == from || from.starts_with(&format!("{to}/")) || to.starts_with(&format!("{from}/"))
        {
            return;
        }
        self.edges.entry(from.to_owned()).or_default().insert(to);
    }

    /// Every cycle, as the set of modules that reach each other (Tarjan's strongly connected
    /// components of more than one module).
    pub fn cycles(&self) -> Vec<BTreeSet<String>> {
        let mut nodes: BTreeSet<&str> = self.edges.keys().map(String::as_str).collect();
        nodes.extend(self.edges.values().flatten().map(String::as_str));
        let mut tarjan = Tarjan {
            graph: self,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            next: 0,
            components: Vec::new(),
        };
        for node in nodes {
            if !tarjan.index.contains_key(node) {
                tarjan.visit(node);
            }
        }
        tarjan.components
    }

    /// The modules `module` refers to, directly or through its files (`module/...`).
    pub fn refers_to(&self, module: &str) -> BTreeSet<String> {
        let prefix = format!("{module}/");
        self.edges
            .iter()
            .filter(|(from, _)| *from == module || from.starts_with(&prefix))
            .flat_map(|(_, to)| to.iter().cloned())
            .collect()
    }
}

struct Tarjan<'g> {
    graph: &'g ModuleGraph,
    index: BTreeMap<&'g str, usize>,
    low: BTreeMap<&'g str, usize>,
    stack: Vec<&'g str>,
    on_stack: BTreeSet<&'g str>,
    next: usize,
    components: Vec<BTreeSet<String>>,
}

impl<'g> Tarjan<'g> {
    fn visit(&mut self, node: &'g str) {
        self.index.insert(node, self.next);
        self.low.insert(node, self.next);
        self.next += 1;
        self.stack.push(node);
        self.on_stack.insert(node);
        let graph = self.graph;
        for next in graph.edges.get(node).into_iter().flatten() {
            let next = next.as_str();
            if !self.index.contains_key(next) {
                self.visit(next);
                let low = self.low[node].min(self.low[next]);
                self.low.insert(node, low);
            } else if self.on_stack.contains(next) {
                let low = self.low[node].min(self.index[next]);
                self.low.insert(node, low);
            }
        }
        if self.low[node] == self.index[node] {
            let mut component = BTreeSet::new();
            while let Some(member) = self.stack.pop() {
                self.on_stack.remove(member);
                component.insert(member.to_owned());
                if member == node {
                    break;
                }
            }
            if component.len() > 1 {
                self.components.push(component);
            }
        }
    }
}

fn file_stem(path: &Path) -> String {
    path.file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The modules of a directory: its `x.rs` files and `x/` directories, less `mod`, `lib`, `main`.
fn top_level_modules(dir: &Path) -> io::Result<BTreeSet<String>> {
    let mut modules = BTreeSet::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let stem = file_stem(&path);
        let is_module = path.is_dir() || path.extension().is_some_and(|ext| ext == "rs");
        if is_module && !matches!(stem.as_str(), "mod" | "lib" | "main") {
            modules.insert(stem);
        }
    }
    Ok(modules)
}

fn rust_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    Ok(files_under(&[dir.to_path_buf()])?
        .into_iter()
        .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
        .collect())
}

/// Every file under `roots` (a root that is a file is itself), sorted.
pub fn files_under(roots: &[PathBuf]) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending = roots.to_vec();
    while let Some(path) = pending.pop() {
        if path.is_dir() {
            for entry in fs::read_dir(&path)? {
                pending.push(entry?.path());
            }
        } else {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// A file's code: up to its trailing `#[cfg(test)]` section, without comments.
pub fn code_of(text: &str) -> String {
    let text = match text.find("\n#[cfg(test)]") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|line| match line.find("//") {
            // `//` inside a string (a URL) is rare in these crates' paths; a line that starts a
            // comment after code keeps its code.
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths that follow `crate::` in `code`, as their segments: `crate::a::b` gives `[a, b]`,
/// `crate::{a::b, c}` gives `[a, b]` and `[c]`.
pub fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(is_ident) {
            continue; // `$crate::`, `some_crate::`
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = matching_brace(group);
            for item in split_top_level(&group[..end]) {
                paths.push(segments(item));
            }
            rest = &group[end..];
        } else {
            paths.push(segments(rest));
        }
    }
    paths.retain(|path| !path.is_empty());
    paths
}

/// The first segment after each `super::` in `code`.
pub fn super_paths(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("super::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "super::".len()..];
        if before.is_some_and(is_ident) {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = matching_brace(group);
            for item in split_top_level(&group[..end]) {
                found.extend(segments(item).into_iter().next());
            }
        } else {
            found.extend(segments(rest).into_iter().next());
        }
    }
    found
}

fn matching_brace(text: &str) -> usize {
    let mut depth = 0usize;
    for (at, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return at,
            '}' => depth -= 1,
            _ => {}
        }
    }
    text.len()
}

fn split_top_level(text: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (at, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(text[start..at].trim());
                start = at + 1;
            }
            _ => {}
        }
    }
    items.push(text[start..].trim());
    items
}

/// `a::b::c ...` -> `[a, b, c]`; stops at the first character of no path.
fn segments(text: &str) -> Vec<String> {
    let mut segments = Vec::new();
    let mut rest = text.trim_start();
    loop {
        let end = rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        segments.push(rest[..end].to_owned());
        match rest[end..].strip_prefix("::") {
            Some(next) if next.starts_with(is_ident) => rest = next,
            _ => break,
        }
    }
    segments
}

/// The unit a `crate::` path names: `a` or, inside directory `a`, `a/<file>`.
fn resolve(
    path: &[String],
    own_dir: &str,
    top: &BTreeSet<String>,
    siblings: &BTreeSet<String>,
) -> Option<String> {
    let first = path.first()?;
    if !top.contains(first) {
        return None; // an item of the crate root (lib.rs re-exports)
    }
    if first == own_dir
        && let Some(second) = path.get(1)
        && siblings.contains(second)
    {
        return Some(format!("{first}/{second}"));
    }
    Some(first.clone())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let path = dir.path().join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        dir
    }

    #[test]
    fn paths_in_code_are_read_and_comments_and_tests_are_not() {
        let code = code_of(
            "use crate::{a::X, b};\nuse crate::c::d::{E, F};\n// crate::g\nfn f() { crate::h::i(); }\n\
             #[cfg(test)]\nmod tests { use crate::j; }\n",
        );
        let firsts: Vec<String> = crate_paths(&code)
            .into_iter()
            .map(|p| p[0].clone())
            .collect();
        assert_eq!(firsts, ["a", "b", "c", "h"]);
        assert_eq!(
            super_paths("use super::{x::Y, z};\nsuper::w::f();"),
            ["w", "x", "z"].map(String::from).into()
        );
    }

    #[test]
    fn a_cycle_between_modules_and_between_a_loops_files_is_found() {
        let dir = tree(&[
            ("lib.rs", "pub mod base; pub mod looped;"),
            ("base.rs", "use crate::looped::Thing;"),
            ("looped/mod.rs", "use crate::base::X; pub mod a; pub mod b;"),
            ("looped/a.rs", "use super::b::B;"),
            ("looped/b.rs", "use crate::looped::a::A; use super::Parent;"),
        ]);
        let graph = ModuleGraph::read(dir.path()).unwrap();
        let cycles = graph.cycles();
        assert!(
            cycles.contains(&["base", "looped"].map(String::from).into()),
            "{cycles:?}"
        );
        assert!(
            cycles.contains(&["looped/a", "looped/b"].map(String::from).into()),
            "{cycles:?}"
        );
        assert!(graph.refers_to("base").contains("looped"));
    }

    #[test]
    fn a_glob_import_of_the_parent_is_named() {
        let dir = tree(&[
            ("lib.rs", "pub mod looped;"),
            ("looped/mod.rs", "pub mod a; pub mod tests;"),
            ("looped/a.rs", "use super::*;"),
            ("looped/tests.rs", "use super::*;"),
        ]);
        let graph = ModuleGraph::read(dir.path()).unwrap();
        assert_eq!(graph.glob_imports, ["looped/a".to_owned()].into());
    }

    #[test]
    fn a_layered_crate_has_no_cycle() {
        let dir = tree(&[
            ("lib.rs", "pub mod base; pub mod looped;"),
            ("base.rs", "pub struct X;"),
            (
                "looped/mod.rs",
                "use crate::base::X; pub mod a; pub mod b; pub struct Parent;",
            ),
            ("looped/a.rs", "use super::b::B; use super::Parent;"),
            ("looped/b.rs", "use super::Parent;"),
        ]);
        let graph = ModuleGraph::read(dir.path()).unwrap();
        assert_eq!(graph.cycles(), Vec::<BTreeSet<String>>::new());
        assert!(graph.refers_to("base").is_empty());
    }
}
