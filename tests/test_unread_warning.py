"""uneven="stop" warns once per epoch when the ranks left much of it unread (issue 17, item 8), and
so does the token loader when its plan leaves much of an epoch out."""

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from gloo_ranks import kill, start_ranks
from seqshard import make_loader, make_token_loader
from seqshard.formats.npy import npy_parts
from seqshard.formats.peers.mmidx import TokenDatasetWriter
from seqshard.formats.tar import ShardWriter
from seqshard.options import LoaderOptions
from seqshard.pipeline.rank.accounts import unread_warning
from seqshard.tools.reindex import rebuild_index


def write_shards(folder: Path, sizes: list[int]) -> str:
    rng = np.random.default_rng(0)
    for number, size in enumerate(sizes):
        writer = ShardWriter(folder / f"data-{number:05d}.tar")
        for i in range(size):
            array = rng.standard_normal((int(rng.integers(5, 40)), 4)).astype(np.float32)
            writer.add(f"s{number}u{i:03d}", [("feats.npy", list(npy_parts(array))), ("txt", [b"x"])])
        writer.commit()
    rebuild_index(folder, progress=False)
    return f"{folder}/data-*.tar"


def run_logged(world_size: int, config: dict, out: Path, timeout: float = 120) -> list[str]:
    """Run a job to the end; each rank's output (stdout and stderr, where warnings go)."""
    processes = start_ranks(world_size, config, out)
    deadline = time.monotonic() + timeout
    try:
        logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode() for p in processes]
    except Exception:
        kill(processes)
        raise
    for rank, (process, log) in enumerate(zip(processes, logs)):
        assert process.returncode == 0, f"rank {rank} failed:\n{log[-3000:]}"
    return logs


@pytest.mark.distributed
def test_stopping_ranks_that_leave_much_unread_are_warned(tmp_path):
    """Whole shards of 30 and 6 utterances: one rank runs out after 6 steps and both stop."""
    pattern = write_shards(tmp_path / "shards", [30, 6])
    options = dict(batch_size=1, num_workers=0, split_shards=False)
    logs = run_logged(2, {"pattern": pattern, "options": options, "epochs": [0]}, tmp_path / "run")
    assert logs[0].count("left unread") == 1 and "unread" not in logs[1]
    assert "epoch 0: 24 of 36 planned utterances (67%) were left unread (rank 0: 24 of its 30)" in logs[0]
    assert "split_shards=True" in logs[0] and "uneven='join'" in logs[0]


def test_the_warning_needs_more_than_five_percent_left():
    config = LoaderOptions(batch_frames=1000, split_shards=True, num_workers=1)
    ranks = [{"rank": 0, "planned": 50, "left": 0}, {"rank": 1, "planned": 50, "left": 5}]
    assert unread_warning(3, ranks, config) is None
    ranks[1]["left"] = 6
    warning = unread_warning(3, ranks, config)
    assert warning.startswith("seqshard epoch 3: 6 of 100 planned utterances (6%) were left unread (rank 1: 6 of")
    assert "a smaller batch_frames" in warning and "split_shards" not in warning and "num_workers" not in warning
    assert unread_warning(3, [{"rank": 0, "planned": 50}], config) is None  # unknown: shards without an index


def test_an_epoch_cut_by_its_length_is_not_a_loss(tmp_path, caplog):
    pattern = write_shards(tmp_path / "shards", [20])
    loader = make_loader(pattern, batch_size=1, num_workers=0, epoch_steps=3)
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        assert len(list(loader)) == 3
    assert loader.last_summary["ranks"][0]["left"] == 17 and "unread" not in caplog.text


def test_a_token_epoch_that_leaves_much_unread_is_warned(tmp_path, caplog):
    """29 sentences in 6 batches for 4 ranks: 2 batches (5 sentences) are left out."""
    writer = TokenDatasetWriter(tmp_path / "lm", np.uint16)
    for length in range(1, 30):
        writer.add(np.arange(length) + 3)
    writer.finish()
    loader = make_token_loader(str(tmp_path / "lm"), max_tokens=100, rank=0, world_size=4)
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        assert sum(len(batch["id"]) for batch in loader) == 10
    assert loader.stats()["left"] == 5
    assert "token epoch 0: 5 of 29 sentences (17%) are not read: 5 in the last batches" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        list(make_token_loader(str(tmp_path / "lm"), max_tokens=100, rank=0, world_size=1))
    assert "not read" not in caplog.text
