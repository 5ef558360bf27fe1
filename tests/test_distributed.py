"""Multi-rank behaviour with real processes talking through torch.distributed (gloo, CPU)."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from gloo_ranks import kill, run_ranks, start_ranks
from seqshard import make_loader
from seqshard.formats.npy import npy_parts
from seqshard.formats.table import ShardTable
from seqshard.formats.tar import ShardWriter
from seqshard.pipeline.epoch_plan import plan_epoch, planned_utts
from seqshard.tools.reindex import rebuild_index

pytestmark = pytest.mark.distributed
DIM = 4


def write_shards(folder: Path, sizes: list[int], seed: int = 0, prefix: str = "s") -> str:
    """Shards of ``sizes`` utterances (keys <prefix><shard>u<i>), indexed; returns the pattern."""
    rng = np.random.default_rng(seed)
    for number, size in enumerate(sizes):
        writer = ShardWriter(folder / f"data-{number:05d}.tar")
        for i in range(size):
            array = rng.standard_normal((int(rng.integers(5, 40)), DIM)).astype(np.float32)
            writer.add(f"{prefix}{number}u{i:03d}", [("feats.npy", list(npy_parts(array))), ("txt", [b"x"])])
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


def test_bucket_sync_gives_the_ranks_one_length_bucket_at_most_steps_without_talking(tmp_path):
    """Each reader hands out its k-th batch from the bucket a shared seed draws for k: the ranks'
    batches are of one bucket at most steps (by chance at a third without), with no collective
    but the epoch's few, every utterance once."""
    pattern = write_shards(tmp_path / "shards", [300] * 8, seed=3)
    from seqshard.pipeline.workers.setup import bucket_bounds

    bounds = bucket_bounds(ShardTable.from_patterns(pattern), 4)
    same = {}
    for sync in (False, True):
        options = dict(batch_frames=90, num_workers=2, bucket_sync=sync, num_buckets=4, seed=2)
        ranks = run_ranks(2, {"pattern": pattern, "options": options, "epochs": [0]}, tmp_path / f"run{sync}")
        steps = [r["epochs"][0]["steps"] for r in ranks]
        assert len(steps[0]) == len(steps[1]) > 300
        buckets = np.searchsorted(bounds, [[s["frames"] for s in rank] for rank in steps], side="right")
        same[sync] = float(np.mean(buckets[0] == buckets[1]))
        assert max(r["epochs"][0]["collectives"] for r in ranks) <= len(steps[0]) / 16
        flat = [k for s in steps for step in s for k in step["keys"]]
        assert len(flat) == len(set(flat))
    assert same[True] >= 0.85 and same[False] <= 0.5, same


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


# -- where the ranks agree on an epoch's end: a few collectives an epoch ---------------------

HOURS = 23000 * 0.01 / 3600  # 23,000 frames of 10 ms over all ranks: about 130 steps on 2 ranks
AGREEMENT_CASES = {
    "exact": dict(batch_size=4),
    "sort windows": dict(batch_frames=90, sort_window=40, shuffle_window=40),
    "skip_bad": dict(batch_size=4, skip_bad=True, max_bad_shards=2),
    "epoch_hours": dict(batch_size=4, uneven="repeat", epoch_hours=HOURS),
    "epoch_source": dict(batch_size=4, epoch_source=1),
    "bucket_sync": dict(batch_frames=90, bucket_sync=True, num_buckets=4),
    "epoch_steps past the data": dict(batch_size=4, epoch_steps=1000),
    "epoch_hours, stopping": dict(batch_frames=90, epoch_hours=HOURS),
}


@pytest.fixture(scope="module")
def agreement_data(tmp_path_factory) -> dict[str, str]:
    """1,200 utterances in 8 shards (and the same with a third of one shard cut off), and a
    second source of 400 for a mux."""
    root = tmp_path_factory.mktemp("agreement")
    damaged = write_shards(root / "damaged", [150] * 8)
    shard = root / "damaged" / "data-00003.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # cut short
    return {
        "plain": write_shards(root / "plain", [150] * 8),
        "damaged": damaged,
        "other": write_shards(root / "other", [100] * 4, seed=1, prefix="o"),
    }


def first_step_reaching(per_step: list[int], target: float) -> int:
    """The first step after which the running sum of ``per_step`` reaches ``target``."""
    return int(np.searchsorted(np.cumsum(per_step), target)) + 1


THREE_RANKS = ("exact", "sort windows", "skip_bad", "epoch_hours, stopping")  # where a third rank's share differs most


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "world_size"), [(case, 2) for case in AGREEMENT_CASES] + [(case, 3) for case in THREE_RANKS]
)
def test_the_ranks_end_every_epoch_together_in_a_few_collectives(tmp_path, agreement_data, case, world_size):
    """Every rank takes the same steps, ending where "stop" ends (each rank's own stream cut
    where the first runs out: "join" gives each rank's whole stream) or where the epoch's
    length is reached (within two steps), in at most max(4, steps / 16) collectives an epoch:
    none but the summary with an exact count, one more in the first epoch (the ranks compare
    their options)."""
    options = {**AGREEMENT_CASES[case], "num_workers": 2, "seed": 1}
    pattern: str | dict = agreement_data["damaged" if case == "skip_bad" else "plain"]
    if case == "epoch_source":
        pattern = {"mux": [agreement_data["plain"], agreement_data["other"]], "weights": [1, 1]}
    ranks = run_ranks(world_size, {"pattern": pattern, "options": options, "epochs": [0, 1]}, tmp_path / "run")
    stopping = options.get("uneven", "stop") == "stop" and case != "epoch_source"
    for number in (0, 1):
        epochs = [r["epochs"][number] for r in ranks]
        steps = len(epochs[0]["steps"])
        assert [len(e["steps"]) for e in epochs] == [steps] * world_size
        made = [e["collectives"] for e in epochs]
        first = 1 if number == 0 else 0
        assert max(made) <= max(4, steps / 16) + first, (case, steps, made)
        if case in ("exact", "epoch_source", "epoch_hours"):
            print(f"\n{case}, {world_size} ranks, epoch {number}: {steps} steps, collectives {made}")
        if case == "exact":
            assert made == [1 + first] * world_size  # the epoch's summary alone
        if stopping and case != "bucket_sync":
            joined = {**options, "uneven": "join", "epoch_hours": None}
            streams = [
                [b["keys"] for b in _epoch_of(make_loader(pattern, rank=r, world_size=world_size, **joined), number)]
                for r in range(world_size)
            ]
            assert [[s["keys"] for s in e["steps"]] for e in epochs] == [s[:steps] for s in streams]
            if "epoch_hours" not in options:
                assert steps == min(len(s) for s in streams) > 0
        if "epoch_hours" in options:
            per_step = [sum(e["steps"][i]["length"] for e in epochs) for i in range(steps)]
            assert (
                first_step_reaching(per_step, HOURS * 3.6e5)
                <= steps
                <= first_step_reaching(per_step, HOURS * 3.6e5) + 2
            )
        if case == "epoch_source":
            per_step = [sum(k.startswith("o") for e in epochs for k in e["steps"][i]["keys"]) for i in range(steps)]
            assert first_step_reaching(per_step, 400) <= steps <= first_step_reaching(per_step, 400) + 2


def _epoch_of(loader, epoch: int) -> list[dict]:
    loader.set_epoch(epoch)
    return list(loader)


def test_a_rank_left_short_by_a_damaged_shard_repeats_its_last_batch_and_ends_with_the_others(tmp_path):
    """Under skip_bad a rank counts on half of what its samples left would make; a shard cut
    short after a third leaves it with less than that: it hands out its last batch again up to
    the agreed step, says so and counts it, and both ranks end the epoch at the same step."""
    pattern = write_shards(tmp_path / "shards", [200, 100, 100])
    shard = tmp_path / "shards" / "data-00000.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # found as its reader gets there
    options = dict(
        batch_size=2,
        num_workers=0,
        split_shards=False,
        shuffle_window=4,
        sort_window=4,
        skip_bad=True,
        max_bad_shards=1,
    )
    ranks = run_ranks(2, {"pattern": pattern, "options": options, "epochs": [0]}, tmp_path / "run")
    epochs = [r["epochs"][0] for r in ranks]
    assert len(epochs[0]["steps"]) == len(epochs[1]["steps"])
    short = next(r for r, e in enumerate(epochs) if e["stats"]["repeated"])
    steps = epochs[short]["steps"]
    repeated = epochs[short]["stats"]["repeated"]
    assert 0 < repeated < len(steps) and all(s["keys"] == steps[-1]["keys"] for s in steps[-repeated:])
    keys = [k for s in steps[:-repeated] for k in s["keys"]]
    assert len(keys) == len(set(keys)) and all(k.startswith("s0") for k in keys)
    summary = epochs[0]["summary"]["ranks"][short]
    assert summary["repeated"] == repeated and summary["dropped"]["damaged"] + summary["utts"] == 200
    log = (tmp_path / "run" / f"rank{short}.log").read_text()
    assert "its readers ran out at step" in log and "hands out its last batch again" in log


def test_a_state_saved_with_batches_taken_ahead_resumes_exactly_and_elastically(tmp_path):
    """Near its end a rank takes batches ahead to count them: a state saved then holds them
    (``held``); an exact resume gives the batches of the uninterrupted run and an elastic one
    (2 -> 3 ranks) reads every utterance not handed out exactly once."""
    sizes = [30, 22, 17, 25, 11]
    pattern = write_shards(tmp_path / "shards", sizes)
    options = dict(batch_frames=90, num_workers=2, shuffle_window=10, sort_window=7, seed=5)
    job = {"pattern": pattern, "options": options, "epochs": [0]}
    full = run_ranks(2, job, tmp_path / "full")
    steps = len(full[0]["epochs"][0]["steps"])
    out = tmp_path / "saved"
    run_ranks(2, {**job, "save_at": [0, steps - 2]}, out)
    state = json.loads((out / "state.json").read_text())
    assert any(position["held"] for position in state["ranks"].values())  # saved with batches taken ahead
    resumed = run_ranks(2, {**job, "resume": str(out / "state.json")}, tmp_path / "resumed")
    before = [json.loads((out / f"before-rank{rank}.json").read_text())[-1]["steps"] for rank in range(2)]
    for rank in range(2):
        assert [s["keys"] for s in before[rank] + resumed[rank]["epochs"][0]["steps"]] == [
            s["keys"] for s in full[rank]["epochs"][0]["steps"]
        ]
    elastic = {**job, "options": {**options, "uneven": "join"}, "resume": str(out / "state.json"), "elastic": True}
    three = run_ranks(3, elastic, tmp_path / "three")
    after = [k for r in three for k in keys_of(r["epochs"][0])]
    handed = [k for rank in before for s in rank for k in s["keys"]]
    assert sorted(handed + after) == sorted(f"s{s}u{i:03d}" for s, n in enumerate(sizes) for i in range(n))


def test_samples_dropped_as_read_do_not_leave_a_rank_short_of_the_agreed_end(tmp_path):
    """check_finite drops samples the index counts: an epoch of a fixed batch size is then not
    exactly known, and a rank whose shard holds many non-finite samples ends the epoch with the
    others where its data does, without handing out a batch twice."""
    folder = tmp_path / "shards"
    rng = np.random.default_rng(0)
    for number in range(2):
        writer = ShardWriter(folder / f"data-{number:05d}.tar")
        for i in range(60):
            array = rng.standard_normal((int(rng.integers(5, 40)), DIM)).astype(np.float32)
            if number == 0 and i % 2 == 0:
                array[0, 0] = np.nan
            writer.add(f"s{number}u{i:03d}", [("feats.npy", list(npy_parts(array))), ("txt", [b"x"])])
        writer.commit()
    rebuild_index(folder, progress=False)
    options = dict(
        batch_size=2, num_workers=0, split_shards=False, shuffle_window=4, sort_window=4, check_finite=True, seed=1
    )
    ranks = run_ranks(2, {"pattern": f"{folder}/data-*.tar", "options": options, "epochs": [0]}, tmp_path / "run")
    epochs = [r["epochs"][0] for r in ranks]
    assert [len(e["steps"]) for e in epochs] == [15, 15]  # 30 finite samples on one rank: 15 batches
    assert [e["stats"]["repeated"] for e in epochs] == [0, 0]
    assert sorted(e["stats"]["dropped"].get("non_finite", 0) for e in epochs) == [0, 30]
