"""Prose (docstrings plus comments) stays at most a tenth of the code's non-blank lines."""

from __future__ import annotations

import ast
import io
import tokenize

from harness.paths import ROOT

TREES = (ROOT / "service" / "visenc", ROOT / "clients" / "visenc_client")
MAX_PROSE_SHARE = 0.10
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def prose_lines(source: str) -> tuple[int, int]:
    """(prose lines, non-blank lines) of one module: comment lines plus docstring lines."""
    lines = source.splitlines()
    prose = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, DOCUMENTED) and ast.get_docstring(node, clean=False) is not None:
            doc = node.body[0]
            prose.update(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1))
    return sum(1 for i in prose if lines[i - 1].strip()), sum(1 for line in lines if line.strip())


def test_prose_share_is_bounded() -> None:
    counts = {p: prose_lines(p.read_text()) for tree in TREES for p in sorted(tree.rglob("*.py"))}
    prose = sum(n for n, _ in counts.values())
    lines = sum(total for _, total in counts.values())
    worst = sorted(counts, key=lambda p: counts[p][0] / max(counts[p][1], 1), reverse=True)[:5]
    print(
        f"prose: {prose} of {lines} non-blank lines ({prose / lines:.1%}); most: "
        + ", ".join(f"{p.relative_to(ROOT)} {counts[p][0]}/{counts[p][1]}" for p in worst)
    )
    assert prose / lines <= MAX_PROSE_SHARE, f"prose is {prose / lines:.1%} of the code, over {MAX_PROSE_SHARE:.0%}"


def test_prose_count_sees_comments_and_docstrings() -> None:
    source = '"""Module.\n\nMore."""\n\nx = 1  # note\n\n\ndef f():\n    """One."""\n    # two\n    return x\n'
    assert prose_lines(source) == (5, 7)
