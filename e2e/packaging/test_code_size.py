"""code_size.py measures what it says in its header: it runs, every hop of the path it follows
is found, its lexer tells code from comments and strings, no product function is over 100
lines, and ARCHITECTURE.md states the path's figures as the script measures them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import code_size
from harness import ROOT


def test_it_runs_and_prints_every_figure():
    run = subprocess.run(
        [sys.executable, str(ROOT / "e2e" / "packaging" / "code_size.py"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(run.stdout)
    assert set(figures["product_lines"]) == {"controllers", "reconcilers"}
    assert figures["product_lines_total"] == sum(figures["product_lines"].values())
    areas = figures["product_lines_by_area"]
    assert sum(areas.values()) == figures["product_lines_total"], areas
    assert "reconcilers/src/system_namespaces" in areas and "controllers/src/runner.rs" in areas
    assert all(lines > 1000 for lines in figures["product_lines"].values()), figures
    path = figures["system_namespaces_path"]
    assert path["hops"] == len(code_size.PATH_HOPS)
    assert path["files"][0] == "controllers/src/main.rs"
    assert path["files"][-1] == "reconcilers/src/system_namespaces/apply.rs"
    assert "Section" in path["types"], path


def test_no_product_function_is_over_100_lines():
    long = code_size.measure()["functions_over_100_lines"]
    assert long == [], "split these functions: " + ", ".join(
        f"{f['file']}:{f['line']} fn {f['fn']} ({f['lines']} lines)" for f in long
    )


def test_the_lexer_counts_code_lines_and_finds_test_modules(tmp_path):
    source = tmp_path / "lib.rs"
    source.write_text(
        "//! A crate.\n"
        "\n"
        "/// A function.\n"
        "pub fn one() -> &'static str {\n"
        '    "}// not a comment {"\n'
        "}\n"
        "/* a block\n"
        "   comment */\n"
        "fn two(c: char) -> bool { c == '{' }\n"
        "#[cfg(test)]\n"
        "mod tests {\n"
        "    #[test]\n"
        "    fn it() { assert!(super::two('}')); }\n"
        "}\n"
    )
    parsed = code_size.Source(source)
    ranges, modules = code_size.test_ranges(parsed)
    assert ranges == [(9, 13)] and modules == []
    skip = {line for lo, hi in ranges for line in range(lo, hi + 1)}
    assert code_size.code_lines(parsed, skip) == 4
    assert [(name, line, length) for name, line, length in code_size.functions(parsed, skip)] == [
        ("one", 4, 3),
        ("two", 9, 1),
    ]


def test_architecture_states_the_paths_figures_as_measured():
    text = " ".join((ROOT / "ARCHITECTURE.md").read_text().split())
    match = re.search(r"(\d+) hops in (\d+) files, naming (\d+) project types", text)
    assert match, "ARCHITECTURE.md states the path's hops, files and types"
    path = code_size.measure()["system_namespaces_path"]
    measured = (path["hops"], len(path["files"]), len(path["types"]))
    stated = tuple(int(figure) for figure in match.groups())
    assert stated == measured, (
        f"ARCHITECTURE.md says {stated[0]} hops, {stated[1]} files, {stated[2]} types; "
        f"code_size.py measures {measured[0]}, {measured[1]}, {measured[2]}: update the text"
    )
