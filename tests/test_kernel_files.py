"""The GPU kernel files: each found, read by a wrapper, shipped, and fully substituted.

The kernel text lives in ``kernels/`` folders beside the wrappers
(:mod:`vllm_unified.gpu_dialect`, "Kernel files"). These tests build every kernel instance
the wrappers can make (``kernel_instances.record``, MLX's kernel constructors replaced by
recorders: no GPU) and check what MLX would get, not the kernels' behaviour (the Metal
emulation tests do that).
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
from kernel_instances import record

from vllm_unified import gpu_dialect as gd

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vllm_unified"
KERNEL_FILES = sorted(p for p in PACKAGE.rglob("kernels/*") if p.is_file())


def _package_of(path: Path) -> str:
    return ".".join(path.parent.parent.relative_to(PACKAGE.parent).parts)


@pytest.fixture(scope="module")
def instances():
    return record()


def test_every_instance_is_fully_substituted(instances):
    names = {(i.dialect, i.name) for i in instances}
    assert len(names) == len(instances) == 20
    for inst in instances:
        for text in (inst.source, inst.header):
            assert not re.search(r"@[A-Z][A-Z0-9_]*@", text), inst.name
            assert "//@ " not in text, inst.name
        assert inst.header.startswith(gd.dialect_header(inst.dialect)), inst.name


def test_every_kernel_file_is_read_by_a_wrapper(instances):
    """After every instance was built, reading every file on disk reads nothing new: no file
    lies unused (and each one's text is what the wrappers got)."""
    assert len(KERNEL_FILES) >= 15
    before = gd.kernel_file.cache_info().currsize
    for path in KERNEL_FILES:
        assert gd.kernel_file(_package_of(path), path.name) == path.read_text(encoding="utf-8")
    assert gd.kernel_file.cache_info().currsize == before


def test_kernel_files_are_package_data():
    """Each file matches a package-data pattern of pyproject.toml (so it is in the wheel)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["*"]
    for path in KERNEL_FILES:
        rel = path.relative_to(path.parent.parent).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel
        assert path.suffix in (".h", ".inc") and path.read_text().strip(), rel


def test_the_paged_kernels_share_one_body():
    from vllm_unified.kv.gpu import paged, paged_quant

    shared = gd.kernel_sections(gd.kernel_file("vllm_unified.kv.gpu", "paged_attention.inc"))
    lines = [line for line in shared["BODY"].splitlines() if line and "@" not in line]
    for source in (paged.kernel_source(False), paged.kernel_source(True), paged_quant.SOURCE):
        body = iter(source.splitlines())
        assert all(line in body for line in lines)  # in order


def test_render_fills_named_placeholders_only():
    assert gd.render("a @X@ b\n@Y@\nc\n", X="1", Y="") == "a 1 b\nc\n"
    assert gd.render("@Y@\n", Y="two\nlines\n") == "two\nlines\n"
    assert gd.render("@X@ @K@\n", keep=("K",), X="@K@") == "@K@ @K@\n"
    with pytest.raises(ValueError, match=r"without a value: \['Y'\]"):
        gd.render("@X@ @Y@", X="1")
    with pytest.raises(ValueError, match=r"for no placeholder: \['Z'\]"):
        gd.render("@X@", X="1", Z="2")
    with pytest.raises(ValueError, match="must end in a newline"):
        gd.render("@X@\n", X="no newline")
    with pytest.raises(ValueError, match=r"left unfilled: \['Q'\]"):
        gd.render("@X@", X="@Q@")


def test_sections_and_missing_files():
    assert gd.kernel_sections("// about\n//@ A\nx\n//@ B\n//@ C\ny\n") == \
        {"A": "x\n", "B": "", "C": "y\n"}
    with pytest.raises(ValueError, match="names unique"):
        gd.kernel_sections("//@ A\n//@ A\n")
    with pytest.raises(ValueError, match="at least one"):
        gd.kernel_sections("no sections\n")
    with pytest.raises(FileNotFoundError, match="no_such.inc"):
        gd.kernel_file("vllm_unified.kv.gpu", "no_such.inc")


def test_instances_refuse_unfilled_placeholders():
    with pytest.raises(ValueError, match=r"source has unfilled placeholders \['X'\]"):
        gd.instance_source("x = @X@;", dialect="cuda")
    with pytest.raises(ValueError, match="header has unfilled"):
        gd.instance_source("", dialect="metal", header="@H@")
