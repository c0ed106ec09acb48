"""The import graph of src/vllm_unified (scripts/check_imports.py): no cycle between modules or
packages, every import of our own modules inside a function says why it is lazy, vLLM only
through compat.py and patches.py; and the checker itself finds each kind of violation."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_imports.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop("check_imports", None)
    return mod


def test_source_tree_passes() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 violation(s)" in out.stdout


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_checker_reports_each_violation(tmp_path: Path) -> None:
    pkg = tmp_path / "fake"
    _write(pkg, {
        "__init__.py": "",
        "a.py": "from fake import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fake.a import X\n",
        "c.py": "def f():\n    from fake import a\n    return a\n",
        "d.py": "def f():\n    # lazy: a reason\n    from fake import a\n    return a\n",
        "g.py": "def f():\n    from fake import a  # lazy:\n    return a\n",
        "e.py": "import vllm.config\n",
        "compat.py": "from vllm import envs\n",
        "sub/__init__.py": "",
        "sub/x.py": "from ..top import Y\n",
        "top.py": "from fake.sub import x\n",
    })
    problems = _checker().check(pkg)
    text = "\n".join(problems)
    assert "module cycle [fake.a <-> fake.b]" in text, text
    assert "b.py:3: module cycle" in text  # under TYPE_CHECKING too
    assert "module cycle [fake.sub.x <-> fake.top]" in text  # relative import resolved
    assert "package cycle [sub <-> top]" in text
    assert any(p.endswith("c.py:2: import of fake.a inside a function without a '# lazy: "
                          "<reason>' comment") for p in problems), text
    assert "g.py:2: import of fake.a inside a function" in text  # an empty reason is none
    assert "d.py" not in text  # a reasoned lazy import is allowed
    assert "e.py:1: imports vLLM (vllm.config)" in text
    assert "compat.py" not in text


def test_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    pkg = tmp_path / "fake"
    _write(pkg, {"__init__.py": "", "a.py": "import os\nfrom fake import b\n", "b.py": "x = 1\n"})
    assert _checker().check(pkg) == []
