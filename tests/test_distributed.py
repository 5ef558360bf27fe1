"""Multi-rank behaviour with real processes talking through torch.distributed (gloo, CPU)."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from gloo_ranks import kill, run_ranks, start_ranks
from seqshard.formats.npy import npy_parts
from seqshard.formats.table import ShardTable
from seqshard.formats.tar import ShardWriter
from seqshard.pipeline.plan import plan_epoch, planned_utts
from seqshard.tools.index import rebuild_index

pytestmark = pytest.mark.distributed
DIM = 4


def write_shards(folder: Path, sizes: list[int], seed: int = 0) -> str:
    """Shards of ``sizes`` utterances (keys s<shard>u<i>), indexed; returns the pattern."""
    rng = np.random.default_rng(seed)
    for number, size in enumerate(sizes):
        writer = ShardWriter(folder / f"data-{number:05d}.tar")
        for i in range(size):
            array = rng.standard_normal((int(rng.integers(5, 40)), DIM)).astype(np.float32)
            writer.add(f"s{number}u{i:03d}", [("feats.npy", list(npy_parts(array))), ("txt", [b"x"])])
        writer.commit()
    rebuild_index(folder, progress=False)
    return f"{folder}/data-*.tar"


def keys_of(epoch_record) -> list[str]:
    return [k for step in epoch_record["steps"] for k in step["keys"]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_stop_mode_ends_every_rank_together_and_counts_what_was_left(tmp_path, world_size):
    pattern = write_shards(tmp_path / "shards", [60, 6, 6, 6])
    options = dict(batch_size=1, num_workers=2, split_shards=False, shuffle_window=100, sort_window=100, seed=1)
    ranks = run_ranks(world_size, {"pattern": pattern, "options": options, "epochs": [0, 1]}, tmp_path / "run")
    table = ShardTable.from_patterns(pattern)
    for epoch_number, epoch in enumerate([0, 1]):
        plan = plan_epoch(table, epoch, 1, world_size, 2, True, split_shards=False)
        planned = [sum(planned_utts(table, worker) for worker in rank_plan) for rank_plan in plan]
        assert max(planned) >= 2 * min(planned)  # deliberately uneven: one rank gets far less
        steps = min(planned)  # batch_size 1: a rank has as many batches as utterances
        seen = [keys_of(r["epochs"][epoch_number]) for r in ranks]
        assert [len(s) for s in seen] == [steps] * world_size
        flat = [k for s in seen for k in s]
        assert len(flat) == len(set(flat))  # no utterance on two ranks
        summary = ranks[0]["epochs"][epoch_number]["summary"]["ranks"]
        assert [s["left"] for s in summary] == [p - steps for p in planned]
        assert sum(s["left"] for s in summary) + len(flat) == 78


def test_stop_mode_counts_what_is_left_of_unindexed_shards(tmp_path):
    pattern = write_shards(tmp_path / "shards", [40, 6, 6, 6, 6])
    (tmp_path / "shards" / "index.json").unlink()  # shards from another tool: sizes unknown when planning
    options = dict(batch_size=1, num_workers=2, shuffle_window=100, sort_window=100, seed=1)
    ranks = run_ranks(2, {"pattern": pattern, "options": options, "epochs": [0, 1]}, tmp_path / "run")
    for number in range(2):
        seen = [keys_of(r["epochs"][number]) for r in ranks]
        summary = ranks[0]["epochs"][number]["summary"]["ranks"]
        assert all("planned" in s and "left" in s for s in summary)
        assert sum(s["planned"] for s in summary) == 64
        assert [s["left"] for s in summary] == [s["planned"] - len(k) for s, k in zip(summary, seen)]
        assert sum(s["left"] for s in summary) > 0  # the 40-utterance shard makes one rank run long


def test_a_rank_with_no_data_at_all_does_not_hang(tmp_path):
    pattern = write_shards(tmp_path / "shards", [1])  # one utterance for 3 ranks x 2 workers
    options = dict(batch_size=2, num_workers=2)
    ranks = run_ranks(3, {"pattern": pattern, "options": options, "epochs": [0, 1]}, tmp_path / "run", timeout=90)
    for epoch in range(2):
        assert [len(r["epochs"][epoch]["steps"]) for r in ranks] == [0, 0, 0]
        assert sorted(s["planned"] for s in ranks[0]["epochs"][epoch]["summary"]["ranks"]) == [0, 0, 1]
        assert sum(s["left"] for s in ranks[0]["epochs"][epoch]["summary"]["ranks"]) == 1


def test_balanced_plans_leave_almost_nothing_behind(tmp_path):
    pattern = write_shards(tmp_path / "shards", [40, 3, 25, 9, 31])
    options = dict(batch_size=2, num_workers=2, shuffle_window=8, sort_window=6)
    ranks = run_ranks(2, {"pattern": pattern, "options": options, "epochs": [0]}, tmp_path / "run")
    seen = [keys_of(r["epochs"][0]) for r in ranks]
    flat = [k for s in seen for k in s]
    assert len(flat) == len(set(flat)) and len(flat) >= 108 - 4
    assert len(ranks[0]["epochs"][0]["steps"]) == len(ranks[1]["epochs"][0]["steps"])


@pytest.mark.slow
@pytest.mark.parametrize("bucket_sync", [False, True])
def test_sigkill_mid_epoch_then_resume_gives_the_uninterrupted_batches(tmp_path, bucket_sync):
    pattern = write_shards(tmp_path / "shards", [30, 22, 17, 25, 11])
    options = dict(
        batch_frames=90, num_workers=2, shuffle_window=10, sort_window=7, seed=5, bucket_sync=bucket_sync, num_buckets=3
    )
    job = {"pattern": pattern, "options": options, "epochs": [0, 1]}
    full = run_ranks(2, job, tmp_path / "full")

    out = tmp_path / "killed"
    processes = start_ranks(2, {**job, "save_at": [1, 6], "sleep": 0.05}, out)
    deadline = time.monotonic() + 90
    while (
        not (out / "state.json").exists() and time.monotonic() < deadline and all(p.poll() is None for p in processes)
    ):
        time.sleep(0.01)
    time.sleep(0.2)  # a few more steps run after the save, as in real training
    kill(processes)  # SIGKILL, mid-epoch
    assert (out / "state.json").exists(), "the job never saved its state"
    assert all(p.returncode == -9 for p in processes)

    resumed = run_ranks(2, {**job, "epochs": [1], "resume": str(out / "state.json")}, tmp_path / "resumed")
    for rank in range(2):
        before = json.loads((out / f"before-rank{rank}.json").read_text())
        assert [s["keys"] for s in before[-1]["steps"]] + [s["keys"] for s in resumed[rank]["epochs"][0]["steps"]] == [
            s["keys"] for s in full[rank]["epochs"][1]["steps"]
        ]


def test_elastic_resume_from_two_ranks_to_three_loses_and_repeats_nothing(tmp_path):
    pattern = write_shards(tmp_path / "shards", [30, 22, 17, 25, 11])
    options = dict(batch_size=3, num_workers=2, shuffle_window=10, sort_window=7, seed=5)
    out = tmp_path / "two"
    processes = start_ranks(
        2, {"pattern": pattern, "options": options, "epochs": [0], "save_at": [0, 5], "sleep": 0.05}, out
    )
    deadline = time.monotonic() + 90
    while (
        not (out / "state.json").exists() and time.monotonic() < deadline and all(p.poll() is None for p in processes)
    ):
        time.sleep(0.01)
    time.sleep(0.1)
    kill(processes)
    before = [
        k
        for rank in range(2)
        for step in json.loads((out / f"before-rank{rank}.json").read_text())[-1]["steps"]
        for k in step["keys"]
    ]
    assert len(before) >= 2 * 5  # 5 steps on each rank before the save
    resumed = run_ranks(
        3,
        {
            "pattern": pattern,
            "options": {**options, "uneven": "join"},
            "epochs": [0],
            "resume": str(out / "state.json"),
            "elastic": True,
        },
        tmp_path / "three",
    )
    after = [k for r in resumed for k in keys_of(r["epochs"][0])]
    assert sorted(before + after) == sorted(
        f"s{s}u{i:03d}" for s, n in enumerate([30, 22, 17, 25, 11]) for i in range(n)
    )


def test_repeat_mode_gives_every_rank_the_same_number_of_steps(tmp_path):
    pattern = write_shards(tmp_path / "shards", [30, 4, 4])
    options = dict(
        batch_size=2,
        num_workers=2,
        split_shards=False,
        uneven="repeat",
        epoch_steps=25,
        shuffle_window=8,
        sort_window=8,
    )
    ranks = run_ranks(2, {"pattern": pattern, "options": options, "epochs": [0, 1]}, tmp_path / "run")
    for rank in ranks:
        assert [len(e["steps"]) for e in rank["epochs"]] == [25, 25]
    small = min(ranks, key=lambda r: len(set(keys_of(r["epochs"][0]))))
    keys = keys_of(small["epochs"][0]) + keys_of(small["epochs"][1])
    assert len(keys) > len(set(keys))  # the rank with little data went round it again


def test_repeat_mode_by_hours_stops_all_ranks_at_the_same_step(tmp_path):
    pattern = write_shards(tmp_path / "shards", [30, 20])
    hours = 200 * 0.01 / 3600  # 200 frames of 10 ms, counted over all ranks
    options = dict(batch_size=2, num_workers=0, uneven="repeat", epoch_hours=hours)
    ranks = run_ranks(2, {"pattern": pattern, "options": options, "epochs": [0]}, tmp_path / "run")
    assert len(ranks[0]["epochs"][0]["steps"]) == len(ranks[1]["epochs"][0]["steps"]) > 0
    frames = sum(r["epochs"][0]["stats"]["utts"] for r in ranks)
    assert frames > 0


def test_join_mode_lets_ranks_run_out_unevenly_under_torch_join(tmp_path):
    pattern = write_shards(tmp_path / "shards", [50, 2, 2, 2])
    options = dict(batch_size=3, num_workers=2, split_shards=False, uneven="join")
    ranks = run_ranks(
        2, {"pattern": pattern, "options": options, "epochs": [0, 1], "join": True, "dim": DIM}, tmp_path / "run"
    )
    table = ShardTable.from_patterns(pattern)
    for epoch in range(2):
        planned = [
            sum(planned_utts(table, w) for w in rank)
            for rank in plan_epoch(table, epoch, 0, 2, 2, True, split_shards=False)
        ]
        assert max(planned) > 5 * min(planned)
        # every rank read all of its data (no early stop), and none waited forever
        assert [len(keys_of(r["epochs"][epoch])) for r in ranks] == planned


def test_bucket_sync_gives_all_ranks_the_same_length_bucket_each_step(tmp_path):
    pattern = write_shards(tmp_path / "shards", [40, 40, 40, 40], seed=3)
    options = dict(
        batch_size=4, num_workers=2, bucket_sync=True, num_buckets=3, shuffle_window=16, sort_window=16, seed=2
    )
    ranks = run_ranks(2, {"pattern": pattern, "options": options, "epochs": [0]}, tmp_path / "run")
    from seqshard.pipeline.workers.setup import bucket_bounds

    bounds = bucket_bounds(ShardTable.from_patterns(pattern), 3)
    steps = [r["epochs"][0]["steps"] for r in ranks]
    assert len(steps[0]) == len(steps[1]) > 10
    for left, right in zip(*steps):
        assert np.searchsorted(bounds, left["frames"], side="right") == np.searchsorted(
            bounds, right["frames"], side="right"
        )
    flat = [k for s in steps for step in s for k in step["keys"]]
    assert len(flat) == len(set(flat))


def test_loader_collective_is_cheap(tmp_path):
    pattern = write_shards(tmp_path / "shards", [8, 8])
    ranks = run_ranks(
        2,
        {"pattern": pattern, "options": dict(batch_size=2, num_workers=0), "epochs": [0], "measure_collective": True},
        tmp_path / "run",
    )
    print(f"\nloader all-reduce on loopback gloo: {[round(r['collective_ms'], 3) for r in ranks]} ms per step")
    assert all(r["collective_ms"] > 0 for r in ranks)


def test_ranks_given_other_shards_are_told_so(tmp_path):
    pattern = write_shards(tmp_path / "shards", [10, 10])
    other = write_shards(tmp_path / "other", [10, 10], seed=1)
    config = {
        "pattern": pattern,
        "pattern_of_rank": {"1": other},
        "options": dict(batch_size=2, num_workers=0),
        "epochs": [0],
    }
    processes = start_ranks(2, config, tmp_path / "run")
    deadline = time.monotonic() + 90
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill(processes)
    logs = [p.stdout.read().decode(errors="replace") for p in processes]
    assert all(p.returncode != 0 for p in processes)
    assert any("rank(s) [1] made their loader with other shards or options than rank 0" in log for log in logs), logs


@pytest.mark.parametrize("source", ["shards", "data.list"])
def test_audio_with_fbank_and_speed_perturbation_over_three_ranks(tmp_path, source):
    from conftest import write_audio_dir
    from seqshard import pack_data

    data = write_audio_dir(tmp_path / "d", utts=24, seconds=(0.3, 0.8))
    if source == "shards":
        pack_data(None, data.text, tmp_path / "shards", wav_scp=data.wav_scp, utts_per_file=4, progress=False)
        pattern = str(tmp_path / "shards")
    else:
        lines = [json.dumps({"key": k, "wav": str(data.root / f"{k}.wav"), "txt": data.labels[k]}) for k in data.keys]
        pattern = str(tmp_path / "data.list")
        Path(pattern).write_text("\n".join(lines) + "\n")
    options = dict(batch_size=2, num_workers=2, features="fbank", num_mel_bins=DIM, speed_perturb=[0.9, 1.1], seed=2)
    ranks = run_ranks(3, {"pattern": pattern, "options": options, "epochs": [0]}, tmp_path / "run")
    seen = [keys_of(r["epochs"][0]) for r in ranks]
    flat = [k for s in seen for k in s]
    assert len(flat) == len(set(flat)) and set(flat) <= set(data.keys)
    assert len({len(r["epochs"][0]["steps"]) for r in ranks}) == 1  # every rank stops at the same step
    summary = ranks[0]["epochs"][0]["summary"]["ranks"]
    assert sum(s["left"] for s in summary) + len(flat) == 24
