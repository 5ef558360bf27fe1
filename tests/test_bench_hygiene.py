"""The benchmarks measure what they say (issue 19, item 6): a child's own peak memory, a
planning probe that runs, and no dependence on the test suite ([bench] installs no pytest)."""

import ast
import mmap
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import kaldiio
import numpy as np
import pytest

BENCH = Path(__file__).parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import pack  # noqa: E402
from common import pss_kb, run_measured, vm_kb  # noqa: E402

sys.path.remove(str(BENCH))  # bench's module names (fields, loader, ...) stay out of the other tests' way

TEST_ONLY = {"conftest", "pytest", "hypothesis", "gloo_ranks"}  # modules of tests/ and what only [test] installs


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benches_import_nothing_from_the_test_suite(script):
    tree = ast.parse(script.read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & TEST_ONLY


def test_a_child_reports_its_own_peak_not_its_parents():
    """ru_maxrss of a child keeps the pages it was forked with: a small child of a large
    parent reported the parent's peak."""
    ballast = np.ones(300 << 20, np.uint8)  # 300 MB in this process
    _, peak_mb = run_measured(["-c", "x = bytearray(50 << 20)"])
    assert ballast.sum() and 50 <= peak_mb < 150


TOUCH = """
import mmap, sys
with open(sys.argv[1], "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
    sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page
    print(flush=True)
    sys.stdin.read()
"""


def test_pss_divides_mapped_pages_among_the_processes_that_map_them(tmp_path):
    """RSS counts a mapped shard's pages in full in every process that touched them; PSS
    divides them: a second process mapping the same 64 MB halves this one's share."""
    path = tmp_path / "shard"
    path.write_bytes(os.urandom(64 << 20))
    with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, len(mapped), 4096)) >= 0
        alone_pss, alone_rss = pss_kb(), vm_kb("VmRSS")
        command = [sys.executable, "-c", TOUCH, str(path)]
        other = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            other.stdout.readline()  # it has touched every page
            shared_pss, shared_rss = pss_kb(), vm_kb("VmRSS")
        finally:
            other.communicate("")
    assert abs(shared_rss - alone_rss) < 8_000
    assert 24_000 < alone_pss - shared_pss < 48_000  # half of 64 MB in kB (and of the libraries both map)


def test_the_planning_probe_runs_and_counts_bytes_per_utterance(tmp_path):
    ark, scp = tmp_path / "m.ark", tmp_path / "m.scp"
    with kaldiio.WriteHelper(f"ark,scp:{ark},{scp}") as writer:
        writer("u0", np.zeros((5, 2), np.float32))
    found = pack.plan_memory(tmp_path / "plan", SimpleNamespace(scp=scp), (2000, 20000))
    assert set(found["peak_rss_mb"]) == {2000, 20000} and 0 < found["bytes_per_utt"] < 2000
