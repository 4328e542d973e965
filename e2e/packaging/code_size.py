#!/usr/bin/env python3
"""How big the product code is, how long its functions are, and how far one setting travels.

Run from anywhere: `python3 e2e/packaging/code_size.py` (`--json` for the figures as JSON,
`--areas` for the product lines of each module directory as well).
It prints three things, each defined here so that anyone gets the same numbers:

1. Product lines of code per crate outside e2e/ (`controllers`, `reconcilers`) and their total.
   Product code is every `.rs` file under the crate's `src/`, less test code: an item carrying
   `#[cfg(test)]` (a `mod tests { ... }`, a helper `fn`, a `use`) and the file of a
   `#[cfg(test)] mod name;`. `tests/` and `benches/` are not product code. A line counts when,
   once comments (`//`, `///`, `//!`, `/* */`) are taken out, something is left on it that is
   not white space; a line inside a string literal counts.

2. Product functions longer than 100 lines: a function's length is the number of lines from its
   `fn` line to the line of its closing brace, both included (doc comments and attributes above
   it are not counted).

3. The flag-to-write path of `loops.systemNamespaces`: the functions and types its value passes
   through, from the command line that names the file (`--config`) to the API call that creates
   a namespace. They are listed in `PATH_HOPS` below, in the order the value reaches them: `main`
   parsing the flags, the file read, parsed, merged and validated into the effective
   configuration, the loop built from it, the runner that calls the loop, the loop's pass, its
   plan and its write. Each hop is one item of one file: a function (`fn name`, or `Type::name`
   for a method of an `impl` of `Type`), a type (`struct`, `enum` or `trait`), or a
   `macro_rules!`. The script fails when a hop is not found, so the list cannot go stale.
   - *files on the path*: the distinct files of the hops;
   - *project types on the path*: the distinct names of the types the product code defines
     (`struct`, `enum`, `trait`, `union`, and `type` aliases outside `impl` and `trait` blocks)
     that occur as a word in the code of the hops (comments and string literals taken out).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CRATES = ("controllers", "reconcilers")
MAX_FUNCTION_LINES = 100

# The path of `loops.systemNamespaces`, in order: (file, item).
PATH_HOPS: list[tuple[str, str]] = [
    ("controllers/src/main.rs", "fn main"),
    ("controllers/src/cli.rs", "struct Cli"),
    ("controllers/src/cli.rs", "fn execute"),
    ("controllers/src/config/settings.rs", "struct ConfigArgs"),
    ("controllers/src/cli.rs", "fn run_command"),
    ("controllers/src/cli.rs", "fn load_config"),
    ("controllers/src/config/merge.rs", "Config::load"),
    ("controllers/src/config/merge.rs", "Config::load_text"),
    ("controllers/src/config/file.rs", "fn parse_file_all"),
    ("controllers/src/config/settings.rs", "struct FileConfig"),
    ("controllers/src/config/merge.rs", "Config::merge"),
    ("controllers/src/config/mod.rs", "struct Config"),
    ("controllers/src/config/mod.rs", "macro loop_list"),
    ("controllers/src/config/mod.rs", "Loops::validate"),
    ("reconcilers/src/section.rs", "struct Settings"),
    ("reconcilers/src/section.rs", "trait LoopSection"),
    ("reconcilers/src/system_namespaces/section.rs", "struct Section"),
    ("reconcilers/src/system_namespaces/section.rs", "Section::validate"),
    ("controllers/src/process.rs", "Controller::start"),
    ("controllers/src/runner.rs", "fn build_runner"),
    ("controllers/src/runner.rs", "fn build_cluster_loops"),
    ("reconcilers/src/section.rs", "struct BuildContext"),
    ("reconcilers/src/system_namespaces/section.rs", "Section::build"),
    ("reconcilers/src/system_namespaces/mod.rs", "struct SystemNamespacesLoop"),
    ("reconcilers/src/system_namespaces/mod.rs", "SystemNamespacesLoop::new"),
    ("controllers/src/runner.rs", "Runner::new"),
    ("controllers/src/process.rs", "Controller::spawn_single"),
    ("controllers/src/runner.rs", "Runner::run"),
    ("controllers/src/runner.rs", "LoopTask::run"),
    ("controllers/src/runner.rs", "LoopTask::pass"),
    ("controllers/src/runner.rs", "fn run_pass"),
    ("controllers/src/runner.rs", "fn invoke"),
    ("reconcilers/src/system_namespaces/mod.rs", "SystemNamespacesLoop::reconcile"),
    ("reconcilers/src/system_namespaces/mod.rs", "SystemNamespacesLoop::pass"),
    ("reconcilers/src/system_namespaces/plan.rs", "fn assess"),
    ("reconcilers/src/system_namespaces/apply.rs", "SystemNamespacesLoop::apply"),
]

CODE, STRING, COMMENT = 0, 1, 2


class Source:
    """One file, each character classed as code, string literal or comment."""

    def __init__(self, path: Path):
        self.path = path
        self.text = path.read_text()
        self.kinds = classify(self.text)
        # The text with comments and string literals blanked (newlines kept): braces and words
        # found in it are code.
        self.code = "".join(
            ch if kind == CODE or ch == "\n" else " " for ch, kind in zip(self.text, self.kinds)
        )
        self.line_starts = [0] + [i + 1 for i, ch in enumerate(self.text) if ch == "\n"]

    def line_of(self, offset: int) -> int:
        """0-based line of a character offset."""
        lo, hi = 0, len(self.line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.line_starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def item_end(self, start: int) -> int:
        """The offset just past the item starting at `start`: its matching `}` or, for an item
        without a body, its `;` (brackets and parentheses balanced on the way)."""
        depth = 0
        i = start
        code = self.code
        while i < len(code):
            ch = code[i]
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif ch == ";" and depth == 0:
                return i + 1
            elif ch == "{" and depth == 0:
                return self.matching_brace(i) + 1
            i += 1
        raise ValueError(f"{self.path}: unterminated item at offset {start}")

    def matching_brace(self, open_at: int) -> int:
        depth = 0
        for i in range(open_at, len(self.code)):
            if self.code[i] == "{":
                depth += 1
            elif self.code[i] == "}":
                depth -= 1
                if depth == 0:
                    return i
        raise ValueError(f"{self.path}: unbalanced brace at offset {open_at}")


def classify(text: str) -> list[int]:
    """Code, string or comment, per character (a small Rust lexer: nested block comments, raw
    strings, byte strings, char literals versus lifetimes)."""
    kinds = [CODE] * len(text)
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            kinds[i:end] = [COMMENT] * (end - i)
            i = end
        elif text.startswith("/*", i):
            depth, j = 0, i
            while j < n:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                    if depth == 0:
                        break
                else:
                    j += 1
            kinds[i:j] = [COMMENT] * (j - i)
            i = j
        elif (raw := re.match(r'b?r(#*)"', text[i : i + 260])) and not is_ident(text, i - 1):
            close = '"' + raw.group(1)
            end = text.find(close, i + raw.end())
            end = n if end < 0 else end + len(close)
            kinds[i:end] = [STRING] * (end - i)
            i = end
        elif ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            kinds[i : j + 1] = [STRING] * (j + 1 - i)
            i = j + 1
        elif ch == "'":
            literal = re.match(r"'(\\(u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'", text[i : i + 12])
            if literal:
                kinds[i : i + literal.end()] = [STRING] * literal.end()
                i += literal.end()
            else:  # a lifetime or a label
                i += 1
        else:
            i += 1
    return kinds


def is_ident(text: str, at: int) -> bool:
    return at >= 0 and (text[at].isalnum() or text[at] == "_")


def test_ranges(source: Source) -> tuple[list[tuple[int, int]], list[str]]:
    """The line ranges (0-based, inclusive) of `#[cfg(test)]` items, and the modules declared
    `#[cfg(test)] mod name;` (whose files are test code)."""
    ranges, modules = [], []
    for found in re.finditer(r"#\[cfg\(test\)\]", source.code):
        at = found.end()
        # Further attributes of the same item.
        while attribute := re.match(r"\s*#\[", source.code[at:]):
            at = source.code.index("]", at + attribute.end()) + 1
            while source.code.count("[", found.end(), at) > source.code.count("]", found.end(), at):
                at = source.code.index("]", at) + 1
        end = source.item_end(at)
        declared = re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", source.code[at:end])
        if declared:
            modules.append(declared.group(1))
        ranges.append((source.line_of(found.start()), source.line_of(end - 1)))
    return ranges, modules


def module_file(parent: Path, name: str) -> Path | None:
    base = parent.parent if parent.name in ("mod.rs", "lib.rs", "main.rs") else parent.with_suffix("")
    for candidate in (base / f"{name}.rs", base / name / "mod.rs"):
        if candidate.exists():
            return candidate
    return None


def product_files(crate: str) -> dict[Path, tuple[Source, set[int]]]:
    """Every product file of `crate` with the 0-based lines that are test code."""
    sources = {path: Source(path) for path in sorted((ROOT / crate / "src").rglob("*.rs"))}
    excluded_files: set[Path] = set()
    test_lines: dict[Path, set[int]] = {}
    for path, source in sources.items():
        ranges, modules = test_ranges(source)
        test_lines[path] = {line for lo, hi in ranges for line in range(lo, hi + 1)}
        for module in modules:
            if (file := module_file(path, module)) is not None:
                excluded_files.add(file)
    # A test module's own submodules are test code too.
    excluded = {
        path for path in sources if any(path == ex or ex.parent / ex.stem in path.parents for ex in excluded_files)
    }
    return {path: (sources[path], test_lines[path]) for path in sources if path not in excluded}


def code_lines(source: Source, skip: set[int]) -> int:
    lines = source.text.split("\n")
    count, offset = 0, 0
    for number, line in enumerate(lines):
        kinds = source.kinds[offset : offset + len(line)]
        if number not in skip and any(k != COMMENT and not ch.isspace() for ch, k in zip(line, kinds)):
            count += 1
        offset += len(line) + 1
    return count


def functions(source: Source, skip: set[int]):
    """(name, first line (1-based), length in lines) of every function with a body."""
    for found in re.finditer(r"\bfn\s+(\w+)", source.code):
        first = source.line_of(found.start())
        if first in skip:
            continue
        end = source.item_end(found.start())
        if source.code[end - 1] != "}":
            continue  # a declaration without a body
        yield found.group(1), first + 1, source.line_of(end - 1) - first + 1


def block_ranges(source: Source, keyword: str) -> list[tuple[int, int]]:
    """Character ranges of the bodies of `impl` or `trait` blocks."""
    ranges = []
    for found in re.finditer(rf"^[ \t]*(?:pub(?:\([^)]*\))?\s+)?{keyword}\b", source.code, re.M):
        end = source.item_end(found.start())
        ranges.append((found.start(), end))
    return ranges


def defined_types(files) -> set[str]:
    names = set()
    for source, skip in files:
        blocks = block_ranges(source, "impl") + block_ranges(source, "trait")
        for found in re.finditer(r"\b(struct|enum|trait|union|type)\s+([A-Z]\w*)", source.code):
            if source.line_of(found.start()) in skip:
                continue
            if found.group(1) == "type" and any(lo < found.start() < hi for lo, hi in blocks):
                continue  # an associated type
            names.add(found.group(2))
    return names


def hop_text(source: Source, item: str) -> str:
    kind, _, name = item.partition(" ")
    if "::" in item:
        owner, method = item.split("::")
        for block in re.finditer(rf"\bimpl\b[^{{;]*?\b{owner}\b[^{{;]*\{{", source.code):
            lo, hi = block.end(), source.matching_brace(block.end() - 1)
            found = re.compile(rf"\bfn\s+{method}\b").search(source.code, lo, hi)
            if found:
                return source.code[found.start() : source.item_end(found.start())]
        raise LookupError(f"{source.path.relative_to(ROOT)}: no {item}")
    pattern = {
        "fn": rf"\bfn\s+{name}\b",
        "struct": rf"\bstruct\s+{name}\b",
        "enum": rf"\benum\s+{name}\b",
        "trait": rf"\btrait\s+{name}\b",
        "macro": rf"\bmacro_rules!\s*{name}\b",
    }[kind]
    found = re.search(pattern, source.code)
    if not found:
        raise LookupError(f"{source.path.relative_to(ROOT)}: no {item}")
    return source.code[found.start() : source.item_end(found.start())]


def area(path: Path) -> str:
    """A file's area: its module directory under `src/` (a loop, `config`, `tenants`), or the
    file itself for a module of one file."""
    parts = path.relative_to(ROOT).parts
    return "/".join(parts[:3]) if len(parts) > 3 else "/".join(parts)


def measure() -> dict:
    per_crate, per_area, long_functions, every_file = {}, {}, [], []
    for crate in CRATES:
        files = product_files(crate)
        per_crate[crate] = sum(code_lines(source, skip) for source, skip in files.values())
        for path, (source, skip) in files.items():
            every_file.append((source, skip))
            per_area[area(path)] = per_area.get(area(path), 0) + code_lines(source, skip)
            for name, line, length in functions(source, skip):
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(
                        {"file": str(path.relative_to(ROOT)), "line": line, "fn": name, "lines": length}
                    )
    types = defined_types(every_file)
    path_files, path_types = [], set()
    for file, item in PATH_HOPS:
        text = hop_text(Source(ROOT / file), item)
        if file not in path_files:
            path_files.append(file)
        path_types |= {word for word in re.findall(r"\b[A-Z]\w*\b", text) if word in types}
    return {
        "product_lines": per_crate,
        "product_lines_total": sum(per_crate.values()),
        "product_lines_by_area": dict(sorted(per_area.items(), key=lambda item: (-item[1], item[0]))),
        "functions_over_100_lines": long_functions,
        "system_namespaces_path": {
            "hops": len(PATH_HOPS),
            "files": path_files,
            "types": sorted(path_types),
        },
    }


def main() -> int:
    figures = measure()
    if "--json" in sys.argv[1:]:
        print(json.dumps(figures, indent=2))
        return 0
    print("product lines of code (neither blank nor comment, test code left out):")
    for crate, lines in figures["product_lines"].items():
        print(f"  {crate:<12} {lines:>6}")
    print(f"  {'total':<12} {figures['product_lines_total']:>6}")
    if "--areas" in sys.argv[1:]:
        print("product lines by area (a module directory under src/, or a one-file module):")
        for name, lines in figures["product_lines_by_area"].items():
            print(f"  {lines:>6} {name}")
    long = figures["functions_over_100_lines"]
    print(f"product functions over {MAX_FUNCTION_LINES} lines: {len(long)}")
    for function in long:
        print(f"  {function['file']}:{function['line']} fn {function['fn']} ({function['lines']} lines)")
    path = figures["system_namespaces_path"]
    print(
        f"loops.systemNamespaces from flag to write: {path['hops']} hops, "
        f"{len(path['files'])} files, {len(path['types'])} project types"
    )
    print("  files: " + " ".join(path["files"]))
    print("  types: " + " ".join(path["types"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
