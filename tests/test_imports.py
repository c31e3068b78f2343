"""Imports stand at module level; one inside a function says why, in a comment on its line.

An import inside a function hides what a module depends on, defers an import error to the
first call and can hide an import cycle. It stays only for one of `REASONS`, named at the
start of a comment on the import, e.g. ``from vllm import LLM  # import cost: vLLM, ~15 s``.
Checked from the source text (nothing is imported); an import under a module-level `if`,
`try` or `with` counts as module level.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "belayer"

REASONS = {
    # Measured with `python -X importtime`: torch ~2.5 s, vLLM ~15 s, transformers ~2 s,
    # matplotlib ~1 s, against ~1.3 s for all of `belayer --help`.
    "import cost": "a slow import that a path users feel (`belayer --help`, `belayer status`, "
    "a command that does not train or serve) must not pay",
    "cycle": "the imported module imports this one at module level; the layering leaves no way to "
    "break the loop",
    "workflow sandbox": "Temporal workflow code must not import a non-deterministic module at module level",
}

_REASON_COMMENT = re.compile(r"#\s*(" + "|".join(map(re.escape, REASONS)) + r"):")


def imports_without_a_reason(source: str) -> list[tuple[int, str]]:
    """(line, statement) of every import inside a function or class whose lines hold no
    comment that starts with a reason."""
    tree = ast.parse(source)
    module_level = {
        id(node)
        for statement in tree.body
        for node in (
            ast.walk(statement) if isinstance(statement, (ast.If, ast.Try, ast.With)) else [statement]
        )
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    reasoned_lines = {
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and _REASON_COMMENT.match(token.string)
    }
    return [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and id(node) not in module_level
        and not reasoned_lines.intersection(range(node.lineno, node.end_lineno + 1))
    ]


def test_every_import_inside_a_function_has_a_reason():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {statement}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, statement in imports_without_a_reason(path.read_text())
    ]
    assert not found, (
        "imports inside functions: move each to module level, or end its line with a comment "
        "that starts with one of "
        + ", ".join(f"'# {reason}: ...' ({why})" for reason, why in REASONS.items())
        + ":\n"
        + "\n".join(found)
    )
