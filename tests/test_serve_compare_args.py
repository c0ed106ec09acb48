"""``benchmarks/serve_compare.py --baseline-src``: argument checks and the shadowing probe.

No server is started: only the parser, the contender list and the child-process import check.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def sc():
    sys.path.insert(0, str(BENCH))  # serve_compare imports its sibling run_env
    try:
        spec = importlib.util.spec_from_file_location("serve_compare", BENCH / "serve_compare.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["serve_compare"] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("serve_compare", None)
        sys.path.remove(str(BENCH))


@pytest.fixture
def fake_src(tmp_path: Path) -> Path:
    """A ``src/`` folder whose ``vllm_unified`` is an empty package."""
    pkg = tmp_path / "src" / "vllm_unified"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    return tmp_path / "src"


def test_baseline_src_parsed_and_shadowing_checked(sc, fake_src: Path, capsys) -> None:
    ap = sc.make_parser()
    args = ap.parse_args(["--only", "ours", "--baseline-src", str(fake_src)])
    sc.check_args(ap, args)
    assert args.baseline_src == fake_src.resolve()
    shown = capsys.readouterr().out
    assert f"vllm_unified from {fake_src.resolve() / 'vllm_unified'}" in shown
    # Without the flag nothing is checked and no baseline contender exists.
    plain = ap.parse_args([])
    sc.check_args(ap, plain)
    assert plain.baseline_src is None


def test_baseline_runs_right_before_ours_with_the_same_command(sc, fake_src: Path) -> None:
    ap = sc.make_parser()
    args = ap.parse_args(["--only", "ours", "--baseline-src", str(fake_src)])
    contenders = sc.build_contenders(args, Path("model.gguf"), Path("model_dir"))
    assert [c.name for c in contenders] == [sc.BASELINE, "ours"]
    base, ours = contenders
    assert base.cmd == ours.cmd and base.body == ours.body
    assert base.env["PYTHONPATH"].split(os.pathsep)[0] == str(fake_src)
    assert {k: v for k, v in base.env.items() if k != "PYTHONPATH"} == {
        k: v for k, v in ours.env.items() if k != "PYTHONPATH"}


def test_shadowing_that_does_not_take_effect_fails(sc, fake_src: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if importlib.util.find_spec("vllm_unified") is None:
        pytest.skip("vllm_unified not installed")
    with pytest.raises(SystemExit, match="did not shadow"):
        sc.check_shadowing(fake_src, env)  # PYTHONPATH not set: the installed package wins
    assert sc.check_shadowing(fake_src, sc.baseline_env(env, fake_src)).is_relative_to(
        fake_src.resolve())


@pytest.mark.parametrize("argv", [["--only", "native"], []])
def test_bad_baseline_arguments_are_refused(sc, tmp_path: Path, fake_src: Path, argv) -> None:
    ap = sc.make_parser()
    src = fake_src if argv else tmp_path / "no-package"  # --only native / not a src folder
    args = ap.parse_args([*argv, "--baseline-src", str(src)])
    with pytest.raises(SystemExit):
        sc.check_args(ap, args)
