#!/usr/bin/env python3
"""Checks lib/'s #include lines against docs/ARCHITECTURE.md's arrow table.

A file of module M may include its own headers and those of the modules the
table's "uses" column names for M, nothing else, and nothing outside lib/
(tools/ above all). The table is also compared with lib/meson.build's module
list, whose link checks enforce the same arrows for calls: the two cannot
drift apart.

  check_includes.py SOURCE_ROOT [--file PATH --as MODULE]

--file checks one more file as if it belonged to MODULE; with
--expect-refused the check passes only when that file is refused for an
arrow (the test that a forbidden include is caught). Exit 0 when every include is allowed, 1 with a
line per offending include otherwise, 3 when the table cannot be read.
"""

import argparse
import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def read_table(root):
    text = (root / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Modules and their arrows", 1)
    if len(section) < 2:
        print("check_includes: docs/ARCHITECTURE.md has no 'Modules and their arrows' section", file=sys.stderr)
        sys.exit(3)
    arrows = {}
    for line in section[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`\w+`", cells[0]):
            continue
        arrows[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[2]))
    if not arrows:
        print("check_includes: no arrow table in docs/ARCHITECTURE.md", file=sys.stderr)
        sys.exit(3)
    # The column may name other things in backquotes (`ParamInfo`): only modules count.
    return {name: uses & set(arrows) for name, uses in arrows.items()}


def read_meson(root):
    text = (root / "lib" / "meson.build").read_text()
    entries = re.findall(r"\[\s*'(\w+)',\s*(?:files\([^)]*\)|\w+),\s*\[([^\]]*)\]", text, re.DOTALL)
    modules = {name: set(re.findall(r"'(\w+)'", uses)) for name, uses in entries}
    # oci is a library of its own, on core alone.
    if re.search(r"libcfmo_oci_deps = \[module_deps\['core'\]", text):
        modules["oci"] = {"core"}
    return modules


def check_file(path, module, arrows, lib_modules, shown):
    problems = []
    for target in INCLUDE.findall(path.read_text(errors="replace")):
        first = target.split("/", 1)[0]
        if target.startswith("../") or first == "tools":
            problems.append(f"{shown}: includes '{target}': nothing in lib/ includes tools/ or reaches outside lib/")
        elif "/" in target and first in lib_modules:
            if first != module and first not in arrows.get(module, set()):
                problems.append(
                    f"{shown}: includes '{target}': module {module} may not use {first} "
                    f"(docs/ARCHITECTURE.md allows {', '.join(sorted(arrows.get(module, set()))) or 'nothing'})")
        elif not (path.parent / target).exists():
            problems.append(f"{shown}: includes '{target}', which is no header of lib/")
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=pathlib.Path)
    parser.add_argument("--file", type=pathlib.Path)
    parser.add_argument("--as", dest="module")
    parser.add_argument("--expect-refused", action="store_true",
                        help="exit 0 only when --file is refused for an arrow and nothing else is wrong")
    args = parser.parse_args()
    root = args.root
    arrows = read_table(root)
    modules = read_meson(root)
    problems = []
    if set(arrows) != set(modules):
        problems.append(f"the arrow table names {sorted(arrows)}, lib/meson.build builds {sorted(modules)}")
    for name in sorted(set(arrows) & set(modules)):
        if arrows[name] != modules[name]:
            problems.append(f"module {name}: the arrow table says it uses {sorted(arrows[name])}, "
                            f"lib/meson.build links {sorted(modules[name])}")
    lib = root / "lib"
    lib_modules = {d.name for d in lib.iterdir() if d.is_dir()}
    for path in sorted(lib.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu") or not path.is_file():
            continue
        rel = path.relative_to(lib)
        if len(rel.parts) < 2:
            continue  # lib/arrows_link_check.cpp belongs to no module
        problems += check_file(path, rel.parts[0], arrows, lib_modules, f"lib/{rel}")
    if args.file:
        extra = check_file(args.file, args.module, arrows, lib_modules, str(args.file))
        if args.expect_refused:
            for p in problems:
                print(p, file=sys.stderr)
            refused = [p for p in extra if f"module {args.module} may not use" in p]
            print(refused[0] if refused else f"{args.file}: not refused as a file of {args.module}", file=sys.stderr)
            return 0 if refused and not problems else 1
        problems += extra
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
