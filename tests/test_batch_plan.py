"""Batches known before reading: heaviest_batches names batches the epoch yields, skip_batches
after a resume gives exactly the uninterrupted run's later batches, both from the shards'
member tables (which record each utterance's length), and what the plan cannot see is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import pack_small
from seqshard import make_loader
from seqshard.formats.members import load_table, table_path
from seqshard.formats.tar import member_table
from seqshard.pipeline.rank.planned import NotPlannable
from seqshard.tools.reindex import rebuild_index

OPTIONS = dict(batch_frames=200, shuffle_window=20, sort_window=30, seed=3)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """120 utterances of 5-59 frames in shards of 9."""
    return pack_small(tmp_path_factory.mktemp("plan"), utts_per_file=9, speakers=10, per_speaker=12)


def shapes(loader) -> list[tuple[int, int]]:
    return [(len(batch["keys"]), int(batch["feat_lens"].max())) for batch in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_heaviest_batches_are_batches_the_epoch_yields(shards, num_workers):
    loader = make_loader(shards.pattern, num_workers=num_workers, **OPTIONS)
    loader.set_epoch(1)
    planned = loader.heaviest_batches(10**6, by=lambda batch: -batch.step)  # every batch, in order
    heaviest, longest = loader.heaviest_batches(3), loader.heaviest_batches(1, by="longest")
    yielded = shapes(loader)
    assert [(b.size, b.longest) for b in planned] == yielded and len(yielded) > 10
    assert [b.step for b in planned] == list(range(1, len(yielded) + 1))
    assert [b.padded for b in heaviest] == sorted((n * t for n, t in yielded), reverse=True)[:3]
    assert longest[0].longest == max(t for _, t in yielded)


def test_with_ranks_that_stop_together_the_plan_ends_where_the_first_rank_runs_out(shards):
    alone = [
        shapes(make_loader(shards.pattern, num_workers=0, rank=r, world_size=2, uneven="join", **OPTIONS))
        for r in (0, 1)
    ]
    end = min(map(len, alone))
    assert len(alone[0]) != len(alone[1])  # else the test shows nothing
    for rank in (0, 1):
        stopping = make_loader(shards.pattern, num_workers=0, rank=rank, world_size=2, **OPTIONS)
        planned = stopping.heaviest_batches(10**6, by=lambda batch: -batch.step)
        assert [(b.size, b.longest) for b in planned] == alone[rank][:end]


@pytest.mark.parametrize(("num_workers", "world_size"), [(0, 1), (2, 2)])
def test_skip_batches_after_a_resume_gives_the_uninterrupted_runs_later_batches(shards, num_workers, world_size):
    def loader():
        rank = world_size - 1
        return make_loader(
            shards.pattern, num_workers=num_workers, rank=rank, world_size=world_size, uneven="join", **OPTIONS
        )

    uninterrupted = [batch["keys"] for batch in loader()]
    first = loader()
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict(gather=False)
    first.close()
    resumed = loader()
    resumed.load_state_dict(state)
    assert resumed.skip_batches(4) == 4
    assert resumed.heaviest_batches(1, by="size")[0].step > 7  # the plan knows where the next iteration starts
    moved = resumed.state_dict(gather=False)  # the skip is in the state
    again = loader()
    again.load_state_dict(moved)
    assert [batch["keys"] for batch in again] == uninterrupted[7:]
    stats, summary = again.stats(), again.last_summary["ranks"][0]
    skipped = sum(len(keys) for keys in uninterrupted[3:7])
    assert stats["skipped"] == {"batches": 4, "utts": skipped} and stats["steps"] == len(uninterrupted)
    assert summary["utts"] + summary["skipped"] + summary["left"] == summary["planned"] and summary["left"] == 0
    past = loader()
    assert past.skip_batches(10**6) == len(uninterrupted) and past.heaviest_batches() == []  # not past the epoch


def test_an_elastic_resume_after_skipped_batches_keeps_them_counted(shards):
    """The first rank's summary after an elastic resume counts the saved epoch's past, the
    batches moved past unread included: nothing is left over (and what a rank surely has left,
    for the ranks' agreement on the epoch's end, is not more than it has)."""
    first = make_loader(shards.pattern, num_workers=0, **OPTIONS)
    assert first.skip_batches(4) == 4
    iterator = iter(first)
    taken = [k for _ in range(2) for k in next(iterator)["keys"]]
    state = first.state_dict(gather=False)
    skipped = first.stats()["skipped"]
    first.close()
    summaries, read = [], []
    for rank in (0, 1):
        loader = make_loader(shards.pattern, num_workers=0, rank=rank, world_size=2, uneven="join", **OPTIONS)
        loader.load_state_dict(state, strict=False)
        read += [k for batch in loader for k in batch["keys"]]
        summaries += loader.last_summary["ranks"]
    assert summaries[0]["skipped"] == skipped["utts"] > 0 and len(taken) + len(read) + skipped["utts"] == 120
    assert [s["left"] for s in summaries] == [0, 0]
    assert all(s["utts"] + s["skipped"] + s["left"] == s["planned"] for s in summaries)


def test_what_the_plan_cannot_see_is_refused(shards, tmp_path):
    with pytest.raises(NotPlannable, match="transforms= may change or drop samples"):
        make_loader(shards.pattern, num_workers=0, transforms=[_identity], **OPTIONS).heaviest_batches()
    with pytest.raises(NotPlannable, match="skip_bad"):
        make_loader(shards.pattern, num_workers=0, skip_bad=True, **OPTIONS).skip_batches(1)
    # shards whose member tables record no lengths (made from their headers alone)
    folder = tmp_path / "old"
    shutil.copytree(shards.out, folder)
    for shard in sorted(folder.glob("data-*.tar")):
        member_table(shard).save(shard)
    with pytest.raises(NotPlannable, match=r"data-\d+\.tar records no utterance lengths.*seqshard index"):
        make_loader(f"{folder}/data-*.tar", num_workers=0, **OPTIONS).heaviest_batches()
    # `seqshard index` on shards without a pack journal reads them and records the lengths
    shutil.rmtree(folder / ".seqshard-pack")
    shutil.rmtree(table_path(next(folder.glob("*.tar"))).parent)
    (folder / "index.json").unlink()
    rebuild_index(folder, progress=False)
    for shard in sorted(folder.glob("data-*.tar")):
        assert np.array_equal(load_table(shard).lengths, load_table(shards.out / shard.name).lengths)
    made = make_loader(f"{folder}/data-*.tar", num_workers=0, **OPTIONS)
    assert made.heaviest_batches(2) == make_loader(shards.pattern, num_workers=0, **OPTIONS).heaviest_batches(2)


def _identity(sample):
    return sample


def test_lengths_recorded_by_the_packer_are_the_utterances(shards):
    lengths = {}
    for shard in sorted(Path(shards.out).glob("data-*.tar")):
        table = load_table(shard)
        lengths.update(zip(table.keys, table.lengths.tolist()))
    assert lengths == {key: len(array) for key, array in shards.data.arrays.items()}
