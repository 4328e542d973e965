//! The layout rules of the product crates: no module refers back to a module that refers to it,
//! and the base layer of `reconcilers` (everything but the loops) names no loop, so a loop can
//! be read, changed or removed without touching the layer every loop stands on.

use std::collections::BTreeSet;
use std::path::Path;

use e2e::layout::{ModuleGraph, files_under};

/// The loop modules of `reconcilers`: each owns a `LoopSection` and its `Reconciler`s.
const LOOPS: [&str; 6] = [
    "apiserver_endpoints",
    "clusterip_repair",
    "kubernetes_service",
    "nodeport_repair",
    "service_cidr",
    "system_namespaces",
];

fn graph(krate: &str) -> ModuleGraph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src");
    ModuleGraph::read(&src).unwrap_or_else(|err| panic!("reading {}: {err}", src.display()))
}

#[test]
fn the_product_crates_have_no_module_cycle() {
    for krate in ["reconcilers", "controllers"] {
        let cycles = graph(krate).cycles();
        assert!(
            cycles.is_empty(),
            "{krate}/src has modules that refer to each other: {cycles:?}"
        );
    }
}

/// A file's lines before its trailing `#[cfg(test)]` section.
fn code_lines(text: &str) -> usize {
    let code = match text.find("\n#[cfg(test)]") {
        Some(at) => &text[..at],
        None => text,
    };
    code.lines().count()
}

/// A file longer than this, not counting its tests, is split by concern.
const MAX_LINES: usize = 1_000;

#[test]
fn no_product_file_is_over_a_thousand_lines_without_its_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let sources = ["reconcilers", "controllers"].map(|krate| root.join(krate).join("src"));
    let mut long = Vec::new();
    for path in files_under(&sources).expect("the product sources") {
        let text = std::fs::read_to_string(&path).expect("source file");
        let lines = code_lines(&text);
        if lines > MAX_LINES && path.file_name().is_some_and(|n| n != "tests.rs") {
            long.push(format!("{} ({lines} lines)", path.display()));
        }
    }
    assert!(long.is_empty(), "files over {MAX_LINES} lines: {long:?}");
}

#[test]
fn the_files_of_a_module_import_their_siblings_by_name() {
    for krate in ["reconcilers", "controllers"] {
        let globs = graph(krate).glob_imports;
        assert!(
            globs.is_empty(),
            "{krate}/src files import their parent with `use super::*`, hiding which siblings \
             they use: {globs:?}"
        );
    }
}

#[test]
fn the_base_layer_names_no_loop() {
    let graph = graph("reconcilers");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../reconcilers/src");
    let mut modules: BTreeSet<String> = BTreeSet::new();
    for entry in std::fs::read_dir(&src).expect("reconcilers/src") {
        let path = entry.expect("entry").path();
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        if let Some(stem) = stem
            && stem != "lib"
        {
            modules.insert(stem);
        }
    }
    for looped in LOOPS {
        assert!(
            modules.contains(looped),
            "{looped} is listed as a loop but reconcilers/src has no such module"
        );
    }
    let mut offences = Vec::new();
    for base in modules.iter().filter(|m| !LOOPS.contains(&m.as_str())) {
        for target in graph.refers_to(base) {
            let target_root = target.split('/').next().unwrap_or(&target);
            if LOOPS.contains(&target_root) {
                offences.push(format!("{base} -> {target}"));
            }
        }
    }
    assert!(
        offences.is_empty(),
        "base modules of reconcilers name loops: {offences:?}"
    );
}

/// Every loop module has the files ARCHITECTURE.md names, so a reader who knows one loop knows
/// where to look in the next: `mod.rs` (the loop), `section.rs` (its one configuration type),
/// `plan.rs` (the pure decisions) and `apply.rs` (the writes); a module holding several loops
/// that share the section has one `<name>_loop.rs` per loop, never just one.
#[test]
fn every_loop_module_has_the_same_files() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../reconcilers/src");
    let mut missing = Vec::new();
    for looped in LOOPS {
        let files: BTreeSet<String> = std::fs::read_dir(src.join(looped))
            .unwrap_or_else(|err| panic!("reconcilers/src/{looped}: {err}"))
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        for file in ["mod.rs", "section.rs", "plan.rs", "apply.rs"] {
            if !files.contains(file) {
                missing.push(format!("{looped}/{file}"));
            }
        }
        if files.iter().filter(|f| f.ends_with("_loop.rs")).count() == 1 {
            missing.push(format!(
                "{looped}/<name>_loop.rs for each of its loops (or its one loop in mod.rs)"
            ));
        }
    }
    assert!(missing.is_empty(), "loop modules lack: {missing:?}");
}

/// Code and docs cite upstream by its own files and functions, which a reader can open; section
/// numbers of notes outside the repository point nowhere.
#[test]
fn code_and_docs_cite_no_section_numbers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut roots = vec![
        root.join("reconcilers"),
        root.join("controllers"),
        root.join("e2e"),
        root.join("docs"),
        root.join("charts"),
        root.join("deploy"),
    ];
    for file in [
        "README.md",
        "TESTING.md",
        "ARCHITECTURE.md",
        "BENCHMARKS.md",
    ] {
        roots.push(root.join(file));
    }
    let mut citing = Vec::new();
    for path in files_under(&roots).expect("the repository's files") {
        let wanted = path.extension().is_some_and(|ext| {
            ["rs", "md", "py", "sh", "yaml", "tpl"].contains(&&*ext.to_string_lossy())
        });
        if !wanted || path.ends_with("tests/layout.rs") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for (number, line) in text.lines().enumerate() {
            if line.contains('\u{a7}') {
                citing.push(format!("{}:{}", path.display(), number + 1));
            }
        }
    }
    assert!(citing.is_empty(), "section numbers cited at {citing:?}");
}

/// Every repository path the docs name in backticks exists (a `::item` after a file is allowed).
#[test]
fn the_docs_name_only_paths_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut docs = vec![
        root.join("README.md"),
        root.join("TESTING.md"),
        root.join("ARCHITECTURE.md"),
        root.join("BENCHMARKS.md"),
        root.join("controllers/CONFIG.md"),
        root.join("e2e/apiserver-sim/README.md"),
    ];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        docs.push(entry.expect("entry").path());
    }
    const TOP: [&str; 9] = [
        "controllers/",
        "reconcilers/",
        "e2e/",
        "charts/",
        "deploy/",
        "docs/",
        "testdata/",
        ".ci/",
        ".github/",
    ];
    let mut missing = Vec::new();
    for doc in docs {
        let text = std::fs::read_to_string(&doc).expect("doc");
        for quoted in text.split('`').skip(1).step_by(2) {
            if !TOP.iter().any(|top| quoted.starts_with(top)) || quoted.contains('*') {
                continue;
            }
            let path = quoted.split("::").next().unwrap_or(quoted);
            let path = path.split_whitespace().next().unwrap_or(path);
            let path = path.trim_end_matches([':', '.', ',']);
            if !root.join(path).exists() {
                missing.push(format!("{}: {path}", doc.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs name paths that do not exist: {missing:?}"
    );
}
