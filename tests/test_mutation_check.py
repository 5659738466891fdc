"""scripts/mutation_check.py's machinery (the faults themselves run on request, not here): a fault is
planted exactly where its text is, and the copy's tests import bnb_mps from the copy, not from the
working tree the editable install's finder points at."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from script_loader import load_script

mutation_check = load_script("mutation_check.py")
REPO = Path(__file__).resolve().parents[1]


def test_a_fault_is_planted_once_and_only_where_its_text_is_unique(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\nb = 2\nb = 2\n")
    planted = mutation_check.Fault("X", "m.py", "a = 1", "a = 0", ("t",), "x")
    assert mutation_check.plant(tmp_path, planted) == "a = 1\nb = 2\nb = 2\n"
    assert (tmp_path / "m.py").read_text() == "a = 0\nb = 2\nb = 2\n"
    for old in ("b = 2", "c = 3"):
        with pytest.raises(LookupError, match="occurs [02] times"):
            mutation_check.plant(tmp_path, mutation_check.Fault("Y", "m.py", old, "", ("t",), "y"))


def test_the_faults_name_files_and_tests_that_exist():
    ids = [f.id for f in mutation_check.FAULTS]
    assert len(ids) == len(set(ids))
    for f in mutation_check.FAULTS:
        assert (REPO / f.file).is_file() and f.old != f.new, f.id
        assert (REPO / f.file).read_text(encoding="utf-8").count(f.old) == 1, f"{f.id}: its text went stale"
        assert (REPO / f.tests[0].split("::")[0]).is_file(), f.id


def test_the_copy_imports_bnb_mps_from_itself(tmp_path):
    """The fault the isolation guards against: PYTHONPATH alone loses to the editable finder, so a
    planted fault would be tested against the untouched working tree."""
    copy, env = mutation_check.make_copy(tmp_path)
    assert (copy / "bnb_mps" / "ops" / "tuning.py").is_file() and not (copy / "build").exists()
    (copy / "bnb_mps" / "_version.py").write_text('__version__ = "planted"\n')
    out = subprocess.run([sys.executable, "-c", "import bnb_mps, bnb_mps.ops; print(bnb_mps.__version__); "
                          "print(bnb_mps.ops.__file__)"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    version, ops_file = out.stdout.split()[-2:]
    assert version == "planted" and Path(ops_file).is_relative_to(copy)
