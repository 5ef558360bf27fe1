"""The token loader follows seqshard.protocol.Loader, for sentence batches and LM blocks alike:
exact ``planned_batches()`` and ``len()``, a new epoch on re-iteration, a state saved after
the last batch resuming into the next epoch, ``stats()`` and ``close()``."""

import multiprocessing
import time

import numpy as np
import pytest

from seqshard import make_token_loader
from seqshard.formats.peers.mmidx import TokenDatasetWriter
from seqshard.protocol import Loader

MODES = {"sentences": dict(max_tokens=60), "blocks": dict(block_size=8, max_tokens=24)}


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    rng = np.random.default_rng(3)
    prefix = tmp_path_factory.mktemp("protocol") / "lm"
    writer = TokenDatasetWriter(prefix, np.uint16)
    writer.add_many([np.append(rng.integers(3, 500, size=int(n)), 2) for n in rng.integers(1, 15, size=200)])
    writer.finish()
    return str(prefix)


def _ids(loader):
    return [batch["id"].tolist() for batch in loader]


@pytest.mark.parametrize("mode", MODES)
def test_len_and_planned_batches_are_exact(lm, mode):
    loader = make_token_loader(lm, **MODES[mode], rank=1, world_size=2)
    assert isinstance(loader, Loader)
    planned = loader.planned_batches()
    assert planned.exact and planned.total == planned.remaining == len(loader) > 0
    iterator = iter(loader)
    next(iterator)
    assert loader.planned_batches().remaining == len(loader) - 1  # this iteration's rest
    assert len(list(iterator)) == len(loader) - 1
    assert loader.planned_batches().remaining == 0 and loader.stats()["steps"] == len(loader)


@pytest.mark.parametrize("mode", MODES)
def test_iterating_again_without_set_epoch_runs_the_next_epoch(lm, mode):
    loader = make_token_loader(lm, **MODES[mode])
    first, second = _ids(loader), _ids(loader)
    assert loader.epoch == 1 and loader.stats()["epoch"] == 1 and first != second
    reference = make_token_loader(lm, **MODES[mode])
    reference.set_epoch(1)
    assert _ids(reference) == second
    loader.set_epoch(1)  # set_epoch wins: epoch 1 again
    assert _ids(loader) == second and loader.epoch == 1
    broken = make_token_loader(lm, **MODES[mode])
    next(iter(broken))  # an epoch left unfinished starts again from its beginning
    assert _ids(broken) == first and broken.epoch == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_state_saved_after_the_last_batch_resumes_into_the_next_epoch(lm, mode):
    loader = make_token_loader(lm, **MODES[mode])
    count = len(loader)
    iterator = iter(loader)
    for _ in range(count):
        next(iterator)  # the last batch taken, the iteration not yet told that it is over
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["deals"][-1]["steps"] == [0]
    resumed = make_token_loader(lm, **MODES[mode])
    resumed.load_state_dict(state)
    reference = make_token_loader(lm, **MODES[mode])
    reference.set_epoch(1)
    assert resumed.epoch == 1 and len(resumed) == count and _ids(resumed) == _ids(reference)


def test_stats_say_epoch_and_steps(lm):
    loader = make_token_loader(lm, **MODES["blocks"])
    loader.set_epoch(4)
    iterator = iter(loader)
    next(iterator), next(iterator)
    stats = loader.stats()
    assert (stats["epoch"], stats["steps"], stats["steps_in_epoch"], stats["blocks"]) == (4, 2, len(loader), 6)


@pytest.mark.parametrize("mode", MODES)
def test_close_stops_the_workers(lm, mode):
    loader = make_token_loader(lm, **MODES[mode], num_workers=2)
    iterator = iter(loader)
    next(iterator)
    assert len(multiprocessing.active_children()) == 2
    loader.close()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []
    assert len(_ids(loader)) == len(loader)  # iterating again starts them anew (the same epoch: it was not done)
