"""A worker's error, caught by the training process, leaves nothing behind: the loader's
workers are stopped once the error is handled (not at a later garbage collection, which could
run in a worker forked for the next loader: "Exception ignored ... can only test a child
process"), and the next loader's workers start and end cleanly."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

SCRIPT = """
import multiprocessing
import sys
from seqshard import make_loader
from seqshard.errors import ShardError

damaged, whole = sys.argv[1], sys.argv[2]
try:
    for batch in make_loader(damaged, batch_size=2, num_workers=2):
        pass
except ShardError as error:
    print("caught:", error)
print("workers left:", len(multiprocessing.active_children()))
for batch in make_loader(whole, batch_size=2, num_workers=2):  # new workers, forked after the error
    pass
print("second loader done")
"""


def test_a_caught_worker_error_leaves_no_exception_behind(packed, tmp_path):
    damaged = shutil.copytree(packed.out, tmp_path / "shards")
    second = damaged / "data-00001.tar"
    data = bytearray(second.read_bytes())
    data[3000:3400] = b"\xff" * 400  # a member header in the second shard: a checksum mismatch
    second.write_bytes(bytes(data))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(damaged), str(packed.out / "data-00000.tar")],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "caught:" in done.stdout and "tar header checksum mismatch" in done.stdout, done.stdout
    assert "workers left: 0" in done.stdout and "second loader done" in done.stdout, done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr
