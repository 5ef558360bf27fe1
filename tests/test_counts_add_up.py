"""What the loader reports adds up: for every rank, and summed over ranks,
utts + dropped + filtered + left = planned, after an elastic resume too; missing shards are
counted with their utterances; ``max_bad_shards`` is one budget whatever the world size."""

import json
import time
from pathlib import Path

import pytest
from test_unread_warning import write_shards

from gloo_ranks import kill, run_ranks, start_ranks
from seqshard import make_loader
from seqshard.errors import ShardError

SIZES = [30, 22, 17, 25, 11]
ALL = sum(SIZES)


def adds_up(rank: dict) -> bool:
    return (
        rank["utts"] + sum(rank["dropped"].values()) + sum(rank["filtered"].values()) + rank["left"] == rank["planned"]
    )


def test_an_elastic_resume_counts_the_whole_epoch_once(tmp_path):
    """2 workers -> 1, with a length filter dropping samples before and after the save."""
    pattern = write_shards(tmp_path / "shards", SIZES)
    options = dict(batch_size=3, shuffle_window=10, sort_window=7, seed=5, max_frames=30)
    loader = make_loader(pattern, num_workers=2, **options)
    before = 0
    for step, batch in enumerate(loader, 1):
        before += len(batch["keys"])
        if step == 12:
            state = loader.state_dict()
            break
    loader.close()
    resumed = make_loader(pattern, num_workers=1, **options)
    resumed.load_state_dict(state, strict=False)
    still = resumed.planned_utts()
    after = sum(len(batch["keys"]) for batch in resumed)
    (rank,) = resumed.last_summary["ranks"]
    assert rank["filtered"]["too_many_frames"] > 0 and rank["left"] == 0 and adds_up(rank)
    assert rank["planned"] == ALL and rank["utts"] == before + after
    assert still == after + rank["filtered"]["too_many_frames"] - state_filtered(
        state
    )  # what the resume had left to take


def state_filtered(state: dict) -> int:
    return sum(w["stats"].get("filtered.too_many_frames", 0) for r in state["ranks"].values() for w in r["workers"])


def saved_by_two_ranks(pattern: str, options: dict, steps: int) -> tuple[dict, int]:
    """A state saved by two ranks (uneven='join' needs no process group) after ``steps``
    steps each, and how many utterances they had handed out."""
    state, handed = {"ranks": {}}, 0
    for rank in range(2):
        loader = make_loader(pattern, rank=rank, world_size=2, uneven="join", **options)
        for _, batch in zip(range(steps), loader):
            handed += len(batch["keys"])
        saved = loader.state_dict(gather=False)
        loader.close()
        state = {**saved, "ranks": {**state["ranks"], **saved["ranks"]}}
    return state, handed


@pytest.mark.distributed
def test_an_elastic_resume_from_two_ranks_to_three_leaves_no_negative_counts(tmp_path):
    """Resumed on 3 ranks that stop together: what a rank leaves unread is its own, never
    hidden by another rank's negative count, and the ranks add up to the epoch."""
    pattern = write_shards(tmp_path / "shards", SIZES)
    options = dict(batch_size=3, num_workers=0, split_shards=False, seed=5)
    state, handed = saved_by_two_ranks(pattern, options, 4)
    (tmp_path / "state.json").write_text(json.dumps(state))
    config = {"pattern": pattern, "options": options, "epochs": [0], "resume": str(tmp_path / "state.json")}
    ranks = run_ranks(3, {**config, "elastic": True}, tmp_path / "three")
    summaries = ranks[0]["epochs"][0]["summary"]["ranks"]
    read = sum(len(step["keys"]) for r in ranks for step in r["epochs"][0]["steps"])
    assert all(adds_up(r) and r["left"] >= 0 for r in summaries), summaries
    assert sum(r["planned"] for r in summaries) == ALL
    assert sum(r["utts"] for r in summaries) == handed + read
    assert sum(r["left"] for r in summaries) == ALL - handed - read > 0  # the ranks stopped together


def damage(folder: Path, *numbers: int) -> None:
    for number in numbers:
        (folder / f"data-{number:05d}.tar").write_bytes(b"")  # unreadable when opened


@pytest.fixture
def bad_set(tmp_path) -> tuple[Path, str]:
    """5 shards, one missing (listed in the index), one damaged that two ranks share."""
    pattern = write_shards(tmp_path / "shards", [5, 40, 5, 5, 5])
    (tmp_path / "shards" / "data-00004.tar").unlink()
    damage(tmp_path / "shards", 1)
    return tmp_path / "shards", pattern


BAD = dict(batch_size=2, num_workers=0, shuffle=False, skip_bad=True, max_bad_shards=2)


def test_a_missing_shard_counts_its_utterances_as_dropped(bad_set):
    _, pattern = bad_set
    loader = make_loader(pattern, **BAD)
    read = sum(len(batch["keys"]) for batch in loader)
    (rank,) = loader.last_summary["ranks"]
    assert rank["dropped"] == {"damaged": 40, "missing": 5} and loader.stats()["dropped"] == rank["dropped"]
    assert rank["utts"] == read == 15 and rank["planned"] == 60 and rank["left"] == 0 and adds_up(rank)


@pytest.mark.distributed
def test_a_count_of_bad_shards_is_the_same_budget_on_two_ranks(bad_set, tmp_path):
    """One missing shard and one damaged shard split between the ranks (met on both) are 2
    bad shards, within max_bad_shards=2, as in one process."""
    _, pattern = bad_set
    ranks = run_ranks(2, {"pattern": pattern, "options": BAD, "epochs": [0]}, tmp_path / "two")
    summaries = ranks[0]["epochs"][0]["summary"]["ranks"]
    assert [r["dropped"].get("damaged", 0) > 0 for r in summaries] == [True, True]  # both met the damaged shard
    assert all(adds_up(r) for r in summaries) and sum(r["planned"] for r in summaries) == 60
    assert summaries[0]["dropped"]["missing"] == 5 and "missing" not in summaries[1]["dropped"]


@pytest.mark.distributed
def test_more_bad_shards_than_the_count_stop_every_rank_as_one_process_stops(bad_set, tmp_path):
    folder, pattern = bad_set
    damage(folder, 0)
    problem = (
        "3 of 5 selected shards were bad this epoch (2 damaged, 1 missing): "
        "more than the 2 that max_bad_shards=2 allows."
    )
    with pytest.raises(ShardError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        list(make_loader(pattern, **BAD))
    processes = start_ranks(2, {"pattern": pattern, "options": BAD, "epochs": [0]}, tmp_path / "two")
    deadline = time.monotonic() + 60
    try:
        logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode() for p in processes]
    finally:
        kill(processes)
    assert [p.returncode != 0 for p in processes] == [True, True]
    assert all(problem in log for log in logs), logs[0][-2000:]


def test_the_default_share_of_one_shard_is_said_in_numbers(tmp_path):
    pattern = write_shards(tmp_path / "shards", [6])
    damage(tmp_path / "shards", 0)
    with pytest.raises(ShardError) as error:
        list(make_loader(pattern, batch_size=2, num_workers=0, skip_bad=True))
    assert (
        "1 of 1 selected shard was bad this epoch (1 damaged, 0 missing): more than the 0 that "
        "max_bad_shards=0.05 allows (5% of 1, rounded down)."
    ) in str(error.value)


def test_join_mode_says_which_epoch_its_summary_is_of(tmp_path):
    pattern = write_shards(tmp_path / "shards", [7, 5])
    loader = make_loader(pattern, batch_size=2, num_workers=0, uneven="join")
    loader.set_epoch(3)
    list(loader)
    assert loader.last_summary["epoch"] == 3 and loader.last_summary["ranks"][0]["left"] == 0


def test_an_exact_resume_keeps_the_damaged_shards_met_before_it_in_the_epoch_budget(tmp_path):
    """max_bad_shards=1 and two damaged shards: stopping, whether or not the epoch was resumed
    between the two."""
    pattern = write_shards(tmp_path / "shards", [6, 6, 6, 6])
    damage(tmp_path / "shards", 1, 3)
    options = dict(
        batch_size=2, num_workers=0, shuffle=False, shuffle_window=2, sort_window=2, skip_bad=True, max_bad_shards=1
    )
    loader = make_loader(pattern, **options)
    for _ in loader:
        if loader.stats()["damaged_shards"] == 1:
            state = loader.state_dict()
            break
    resumed = make_loader(pattern, **options)
    resumed.load_state_dict(state)
    with pytest.raises(ShardError, match="2 damaged, 0 missing"):
        list(resumed)
