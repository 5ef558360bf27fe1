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
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "caught:" in done.stdout and "tar header checksum mismatch" in done.stdout, done.stdout
    assert "workers left: 0" in done.stdout and "second loader done" in done.stdout, done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr


SHM_SCRIPT = """
import resource, signal, sys
from seqshard import make_loader
from seqshard.errors import SeqshardError

# Files of at most 16 kB: shared memory beyond that cannot be allocated, as in a full /dev/shm
# (torch's allocation of a segment fails; the same call, the same path, another errno)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))
for slots in (True, False):
    try:
        for batch in make_loader(sys.argv[1], batch_size=48, num_workers=1, shuffle=False, shared_slots=slots):
            pass
    except SeqshardError as error:
        print("caught:", type(error).__name__, error)
batches = sum(1 for _ in make_loader(sys.argv[1], batch_size=48, num_workers=0, shuffle=False))
print("without workers:", batches, "batches")
"""


def test_shared_memory_that_cannot_be_allocated_is_said_with_the_options_that_need_less(packed):
    """A full /dev/shm gave torch's traceback only (issue 30, item 14): here the ring of batch
    slots, then (without slots) a batch pickled into shared memory by a worker, cannot be
    allocated, for real, in a process whose files may not exceed 16 kB."""
    done = subprocess.run(
        [sys.executable, "-c", SHM_SCRIPT, str(packed.out)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    *caught, alone = done.stdout.splitlines()
    assert alone == "without workers: 1 batches", (done.stdout, done.stderr)  # its batch slots are its own memory
    assert [line.split(" (")[0] for line in caught] == [
        "caught: SharedMemoryError the batch slots of 1 reader(s)",
        "caught: SharedMemoryError a batch too large for its slot",
    ], (done.stdout, done.stderr)
    for line in caught:
        assert "could not be allocated in shared memory (/dev/shm has" in line and "</torch_" in line, line
        assert "Fix: fewer num_workers or a smaller prefetch_factor" in line, line
        assert "smaller batches" in line and "--shm-size" in line, line
