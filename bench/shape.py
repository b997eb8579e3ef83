"""The code's shape: the longest classes and modules of ``orchestrator/`` and the spread of
function lengths (lines from ``def`` to the last line of the body, docstrings included).

    python -m bench.shape [--top 5] [--json]

Targets for the shape, not a lint rule: no class above about 300 lines, no module above about
600, functions p90 at most 30 lines.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "orchestrator"


@dataclass
class Shape:
    classes: list[tuple[int, str]]  # (lines, module:class), longest first
    modules: list[tuple[int, str]]
    functions: list[int]  # lengths, shortest first

    def summary(self, top: int) -> dict[str, object]:
        deciles = statistics.quantiles(self.functions, n=10)
        return {"classes": self.classes[:top], "modules": self.modules[:top],
                "functions": {"count": len(self.functions),
                              "median": statistics.median(self.functions),
                              "p90": deciles[8], "max": self.functions[-1]}}


def measure(root: Path = ROOT) -> Shape:
    classes: list[tuple[int, str]] = []
    modules: list[tuple[int, str]] = []
    functions: list[int] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(root.parent))
        modules.append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text)):
            end = getattr(node, "end_lineno", None) or 0
            if isinstance(node, ast.ClassDef):
                classes.append((end - node.lineno + 1, f"{name}:{node.name}"))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append(end - node.lineno + 1)
    return Shape(sorted(classes, reverse=True), sorted(modules, reverse=True), sorted(functions))


def main() -> None:
    parser = argparse.ArgumentParser(description="The code's shape (see the module docstring).")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shape = measure()
    if args.json:
        print(json.dumps(shape.summary(args.top), indent=2))
        return
    for title, rows in (("longest classes", shape.classes), ("longest modules", shape.modules)):
        print(f"{title}:")
        for lines, name in rows[: args.top]:
            print(f"  {lines:5d}  {name}")
    deciles = statistics.quantiles(shape.functions, n=10)
    print(f"functions: {len(shape.functions)}, median {statistics.median(shape.functions)} "
          f"lines, p90 {deciles[8]:.0f}, longest {shape.functions[-1]}")


if __name__ == "__main__":
    main()
