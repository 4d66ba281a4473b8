"""The documentation: the site builds strictly (broken links and unknown references fail),
every Python block of ``docs/`` and the README runs, the command reference is the
parser's, the README is a front page, and every public name has a docstring."""

import importlib
import inspect
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CONTINUES = "# continues the block above"
NO_TEST = re.compile(r"<!-- no-test: (.+?) -->\s*$")


def blocks(page: Path) -> list[tuple[int, str, str]]:
    """``(line, code, reason)`` of each Python block; ``reason`` is why it is not run
    (``<!-- no-test: why -->`` on the line before it), else empty."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NO_TEST.search(before)
        out.append((text[: m.start()].count("\n") + 1, m.group(1), skip.group(1) if skip else ""))
    return out


WITH_CODE = [p for p in PAGES if blocks(p)]


@pytest.mark.slow
@pytest.mark.parametrize("page", WITH_CODE, ids=[str(p.relative_to(ROOT)) for p in WITH_CODE])
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    """Every block runs alone, as a reader who copies it runs it (a fresh namespace, an
    empty folder), unless its first line says ``# continues the block above``: then it
    runs after that block, in its namespace. A block marked ``no-test`` says why it
    cannot run here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for line, code, reason in blocks(page):
        if reason:
            assert len(reason) > 10, f"{page.name}:{line}: say why the block cannot run"
            continue
        if not code.startswith(CONTINUES):
            namespace = {"__name__": "__docs__"}
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(ROOT)}, the block at line {line} failed: {e!r}") from e
        ran += 1
    assert ran, f"{page.name}: every block is marked no-test"


def test_few_blocks_are_left_unrun():
    skipped = [(p.name, line) for p in PAGES for line, _, reason in blocks(p) if reason]
    total = sum(len(blocks(p)) for p in PAGES)
    assert total >= 30 and len(skipped) <= total // 5, skipped


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "leantrain" / "index.html").is_file()


def test_the_command_reference_is_the_parsers():
    page = runpy.run_path(str(ROOT / "docs" / "cli_reference.py"))
    assert (ROOT / page["PAGE"]).read_text() == page["render"](), (
        "the command changed: run .venv/bin/python docs/cli_reference.py > docs/guides/command-reference.md")


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 6000, len(text)
    first = text.split("```")[1]
    assert "make demo" in first and "make test" in first
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), target


REFERENCED = ["leantrain", "leantrain.optim", "leantrain.io.weights", "leantrain.io.torchlean", "leantrain.metrics",
              "leantrain.collate", "leantrain.check", "leantrain.errors"]


def undocumented() -> list[str]:
    """Public names of the reference's modules, and the public methods and properties of
    their classes, without a docstring (an override may inherit its base's)."""
    out = []
    for name in REFERENCED:
        mod = importlib.import_module(name)
        for attr in mod.__all__:
            obj = getattr(mod, attr)
            if inspect.ismodule(obj) or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not inspect.getdoc(obj):
                out.append(f"{name}.{attr}")
            if inspect.isclass(obj):
                for key, member in vars(obj).items():
                    if key.startswith("_"):
                        continue
                    if isinstance(member, (classmethod, staticmethod)):
                        member = member.__func__
                    if isinstance(member, property):
                        member = member.fget
                    if inspect.isfunction(member) and not inspect.getdoc(getattr(obj, key)):
                        out.append(f"{name}.{attr}.{key}")
    return out


def test_every_public_name_has_a_docstring():
    assert undocumented() == []


def test_the_reference_names_every_public_name():
    """#70: every class and function a referenced module exports (``__all__``) has its
    entry in the generated reference, under any of its names (``::: module.name``, or a
    module documented whole, whose ``__all__`` mkdocstrings lists): no public name is
    missing from the reference."""
    import re

    pages = "\n".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    documented = set()
    for entry in re.findall(r"^::: ([\w.]+)", pages, flags=re.M):
        parts = entry.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break
        documented.add(id(obj))
        if inspect.ismodule(obj) and entry != "leantrain":
            documented.update(id(getattr(obj, a)) for a in getattr(obj, "__all__", ()))
    missing = [f"{name}.{attr}" for name in REFERENCED for attr in importlib.import_module(name).__all__
               if (inspect.isclass(obj := getattr(importlib.import_module(name), attr)) or inspect.isfunction(obj))
               and id(getattr(obj, "__wrapped__", obj)) not in documented]  # a constructor: as its class
    assert missing == []
