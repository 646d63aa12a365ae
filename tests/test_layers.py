"""The stage layering in pyproject.toml holds, and the check catches an upward import."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(src: Path, config: Path) -> subprocess.CompletedProcess:
    # lint-imports finds the root package on sys.path; PYTHONPATH puts the copy under test first.
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
                          capture_output=True, text=True, env=env, cwd=src.parent)


def _copy_of_the_package(tmp_path: Path) -> Path:
    """The package and its contract in tmp_path, to break on purpose; returns the package folder."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "eaglewire", src / "eaglewire",
                    ignore=shutil.ignore_patterns("drafters", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return src / "eaglewire"


def test_every_stage_imports_only_the_stages_below_it():
    result = _lint(ROOT / "src", ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    package = _copy_of_the_package(tmp_path)
    wiring = package / "wiring.py"  # a low layer importing the engine
    wiring.write_text(wiring.read_text() + "\nfrom .engine import speculative  # noqa\n")
    result = _lint(package.parent, tmp_path / "pyproject.toml")
    assert result.returncode != 0
    assert "eaglewire.wiring -> eaglewire.engine.speculative" in result.stdout


def test_a_new_top_level_module_must_be_placed_in_a_layer(tmp_path):
    package = _copy_of_the_package(tmp_path)
    (package / "unplaced.py").write_text("X = 1\n")
    result = _lint(package.parent, tmp_path / "pyproject.toml")
    assert result.returncode != 0
    assert "unplaced" in result.stdout
