"""The benchmarks' own measuring helpers measure what they say (issue 19, item 6): checks of
this host and of bench/, not of seqshard, so they live here rather than in the test suite (it
allocates 300 MB and writes 64 MB). A few seconds; prints PASS or FAIL per check and exits 1 if
any check failed.

    python bench/selfcheck.py

    own peak          a child's peak is its own (VmHWM read by bench/peak.py), not its parent's:
                      ru_maxrss keeps the pages a child was forked with (a 50 MB child of a
                      300 MB parent)
    pss shared        PSS divides a mapped file's pages among the processes that map them: a
                      second process mapping the same 64 MB halves this one's share; RSS does not
    planning probe    bench/pack.py's planning probe runs and counts bytes per utterance
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import kaldiio
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).parent))
import pack
from common import check, pss_kb, run_checks, run_measured, vm_kb

TOUCH = """
import mmap, sys
with open(sys.argv[1], "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
    sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page
    print(flush=True)
    sys.stdin.read()
"""


def own_peak() -> None:
    ballast = np.ones(300 << 20, np.uint8)  # 300 MB in this process
    _, peak_mb = run_measured(["-c", "x = bytearray(50 << 20)"])
    check(
        "own peak", bool(ballast.sum()) and 50 <= peak_mb < 150, f"a 50 MB child of a 300 MB parent: {peak_mb:.0f} MB"
    )


def pss_shared(folder: Path) -> None:
    path = folder / "shard"
    path.write_bytes(os.urandom(64 << 20))
    with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page
        alone_pss, alone_rss = pss_kb(), vm_kb("VmRSS")
        command = [sys.executable, "-c", TOUCH, str(path)]
        other = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            other.stdout.readline()  # it has touched every page
            shared_pss, shared_rss = pss_kb(), vm_kb("VmRSS")
        finally:
            other.communicate("")
    rss, pss = shared_rss - alone_rss, alone_pss - shared_pss
    # half of 64 MB in kB (and of the libraries both map); RSS unchanged
    check("pss shared", abs(rss) < 8_000 and 24_000 < pss < 48_000, f"PSS -{pss} kB, RSS {rss:+d} kB")


def planning_probe(folder: Path) -> None:
    ark, scp = folder / "m.ark", folder / "m.scp"
    with kaldiio.WriteHelper(f"ark,scp:{ark},{scp}") as writer:
        writer("u0", np.zeros((5, 2), np.float32))
    found = pack.plan_memory(folder / "plan", SimpleNamespace(scp=scp), (2000, 20000))
    passed = set(found["peak_rss_mb"]) == {2000, 20000} and 0 < found["bytes_per_utt"] < 2000
    check("planning probe", passed, f"{found['bytes_per_utt']:.0f} bytes per utterance")


def main() -> None:
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        parts = (
            ("own peak", own_peak),
            ("pss shared", lambda: pss_shared(Path(folder))),
            ("planning probe", lambda: planning_probe(Path(folder))),
        )
        run_checks(parts, began)


if __name__ == "__main__":
    main()
