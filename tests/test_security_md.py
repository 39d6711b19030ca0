"""SECURITY.md names, for each promise, the test that holds it: every test file and test it
names exists (a renamed or deleted test turns its promise into one nobody holds), and every
module it names as enforcing a promise exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "SECURITY.md").read_text()


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_test_security_md_names_exists() -> None:
    named = 0
    for cell in re.findall(r"`([^`]+)`", TEXT):
        for ref in re.split(r",\s*", cell):
            m = re.fullmatch(r"(tests/[\w/]+\.py)(?:::(\w+))?", ref)
            if not m:
                continue
            path = ROOT / m.group(1)
            assert path.is_file(), f"SECURITY.md names {m.group(1)}, which does not exist"
            if m.group(2):
                assert m.group(2) in _tests_in(path), f"SECURITY.md names {ref}: no such test"
                named += 1
    # Short forms: "`::name`" after a full one names a test of the same file.
    for path, rest in re.findall(r"`(tests/[\w/]+\.py)::\w+`((?:,\s*`::\w+`)+)", TEXT):
        for name in re.findall(r"`::(\w+)`", rest):
            assert name in _tests_in(ROOT / path), f"SECURITY.md names {path}::{name}: no such test"
            named += 1
    assert named >= 60


def test_every_module_security_md_names_exists() -> None:
    modules = set(re.findall(r"`(stasis/[\w/]+\.py|charts/[\w/.-]+)`", TEXT))
    assert len(modules) >= 25
    for module in modules:
        assert (ROOT / module).exists(), f"SECURITY.md names {module}, which does not exist"
