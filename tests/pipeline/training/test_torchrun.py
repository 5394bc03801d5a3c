"""pipeline/training/torchrun.py: torchrun as the launcher runs it."""

import subprocess
import sys

from tests.conftest import ROOT


def test_a_rank_that_fails_in_one_line_gives_its_exit_code_and_no_torchrun_traceback(tmp_path):
    rank = tmp_path / "rank.py"
    rank.write_text("import sys\nprint('error: stage x (rank 0) failed: a bad param', file=sys.stderr)\nsys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline.training.torchrun", "--standalone", "--nproc_per_node=1",
                           "--max_restarts=0", str(rank)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: stage x (rank 0) failed: a bad param" in proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_a_rank_that_succeeds_exits_zero(tmp_path):
    rank = tmp_path / "rank.py"
    rank.write_text("import os\nprint('rank', os.environ['RANK'])\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline.training.torchrun", "--standalone", "--nproc_per_node=2",
                           "--max_restarts=0", str(rank)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]
