"""Mixing sources: seqshard.mux shares (weights, temperature, nesting), the block schedule, and
mixed loaders (proportions across workers and ranks, per-source epochs, exact resume)."""

import json
from collections import Counter

import numpy as np
import pytest

from conftest import write_kaldi_dir
from gloo_ranks import run_ranks
from seqshard import make_loader, mux, pack_data
from seqshard.errors import ConfigError, StateMismatchError
from seqshard.mix import BLOCK, GROUP, flatten, next_block
from seqshard.pipeline.stages.base import Stage
from seqshard.pipeline.stages.mixing import Mix
from seqshard.pipeline.stages.sample import Sample

SMALL = dict(shuffle_window=16, sort_window=8, interleave=2)


def test_shares_from_weights_temperature_and_nesting():
    leaves, shares = flatten(mux(["a", "b"], weights=[3, 1]), len)
    assert leaves == ["a", "b"] and shares.tolist() == [0.75, 0.25]
    sizes = {"x": 900, "y": 100}
    _, by_size = flatten(mux(["x", "y"]), sizes.get)
    _, flat = flatten(mux(["x", "y"], temperature=2), sizes.get)
    assert by_size.tolist() == pytest.approx([0.9, 0.1]) and flat.tolist() == pytest.approx([0.75, 0.25])
    leaves, nested = flatten(mux([mux(["a", "b"], weights=[1, 3]), "c"], weights=[0.6, 0.4]), len)
    assert leaves == ["a", "b", "c"] and nested.tolist() == pytest.approx([0.15, 0.45, 0.4])
    for bad, message in (
        (dict(weights=[1]), "2 sources but 1 weights"),
        (dict(weights=[1, -1]), ">= 0"),
        (dict(weights=[1, 1], temperature=2), "not both"),
        (dict(temperature=0), "> 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            mux(["a", "b"], **bad)


@pytest.mark.parametrize("seed", range(4))
def test_every_prefix_of_the_schedule_is_within_one_sample_of_its_target(seed):
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.ones(int(rng.integers(2, 40))) * 0.5)
    counts = np.zeros(len(shares))
    taken = []
    for block in range(300):
        picks = next_block(shares, counts, seed, block, 7)
        assert len(picks) == BLOCK
        for pick in picks:
            taken.append(pick)
        counts += np.bincount(picks, minlength=len(shares))
        assert np.abs(counts - shares * counts.sum()).max() < 1.0
    again = np.zeros(len(shares))
    assert np.array_equal(next_block(shares, again, seed, 0, 7), taken[:BLOCK])  # a function of its arguments


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three packed corpora of 60, 30 and 15 utterances (keys start with their name)."""
    root = tmp_path_factory.mktemp("mix")
    for name, speakers in (("a", 12), ("b", 6), ("c", 3)):
        data = write_kaldi_dir(root / f"kaldi-{name}", speakers=speakers, per_speaker=5, prefix=name)
        pack_data(data.scp, data.text, root / name, utts_per_file=7, progress=False)
    return {name: str(root / name) for name in "abc"}


def _shares(keys):
    counts = Counter(k[0] for k in keys)
    return {name: counts[name] / len(keys) for name in counts}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_realised_mixture_matches_the_weights(sources, num_workers):
    mixed = mux([mux([sources["a"], sources["b"]], weights=[1, 1]), sources["c"]], weights=[0.8, 0.2])
    loader = make_loader(mixed, batch_size=8, epoch_steps=500, num_workers=num_workers, **SMALL)
    batches = [batch["keys"] for batch in loader]
    keys = [k for batch in batches for k in batch]
    # a window can hold copies of a source's utterance (a pass ends inside it): copies go to
    # different batches, so a few batches are short
    assert 3600 <= len(keys) <= 4000 and all(len(set(b)) == len(b) for b in batches)
    shares = _shares(keys)
    for name, target in (("a", 0.4), ("b", 0.4), ("c", 0.2)):
        assert abs(shares[name] - target) <= 0.01, shares
    stats = loader.stats()["sources"]
    assert sum(s["utts"] for s in stats.values()) == len(keys)
    assert stats[sources["c"]]["passes"] == pytest.approx(stats[sources["c"]]["utts_total"] / 15)
    assert stats[sources["c"]]["passes"] > 50  # the small source went round many times
    assert all(s["hours"] > 0 for s in stats.values())


def test_mixture_across_two_ranks(sources, tmp_path):
    pattern = {"mux": [sources["a"], sources["b"], sources["c"]], "weights": [0.5, 0.3, 0.2]}
    options = dict(batch_size=8, epoch_steps=250, num_workers=2, **SMALL)
    ranks = run_ranks(2, {"pattern": pattern, "options": options, "epochs": [0]}, tmp_path / "run")
    batches = [step["keys"] for rank in ranks for step in rank["epochs"][0]["steps"]]
    keys = [k for batch in batches for k in batch]
    assert 3600 <= len(keys) <= 4000 and all(len(set(b)) == len(b) for b in batches)
    shares = _shares(keys)
    for name, target in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
        assert abs(shares[name] - target) <= 0.01, shares


def test_temperature_needs_indexed_sources_and_sizes(sources):
    loader = make_loader(mux([sources["a"], sources["c"]], temperature=1), batch_size=8, epoch_steps=200, **SMALL)
    shares = _shares([k for b in loader for k in b["keys"]])
    assert abs(shares["a"] - 60 / 75) <= 0.01


def test_an_epoch_can_be_one_pass_of_a_source(sources):
    mixed = mux([sources["a"], sources["c"]], weights=[0.75, 0.25])
    loader = make_loader(mixed, batch_size=4, epoch_source=sources["c"], num_workers=2, **SMALL)
    totals = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        keys = [k for b in loader for k in b["keys"]]
        c = sum(k.startswith("c") for k in keys)
        assert 15 <= c < 15 + 2 * 4  # one pass's worth, give or take the last batch of each worker
        totals.append(loader.stats()["sources"][sources["c"]]["utts_total"])
    assert totals[0] < totals[1] < totals[2]  # the stream goes on across epochs
    with pytest.raises(ConfigError, match="is not one of the mixed sources"):
        make_loader(mixed, batch_size=4, epoch_source="nowhere")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_of_a_mixed_loader(sources, num_workers):
    mixed = mux([sources["a"], sources["b"], sources["c"]], weights=[0.5, 0.3, 0.2])
    options = dict(batch_size=4, epoch_steps=40, num_workers=num_workers, seed=3, **SMALL)
    uninterrupted = make_loader(mixed, **options)
    first = [b["keys"] for b in uninterrupted]
    uninterrupted.set_epoch(1)
    second = [b["keys"] for b in uninterrupted]
    loader = make_loader(mixed, **options)
    iterator = iter(loader)
    head = [next(iterator)["keys"] for _ in range(17)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make_loader(mixed, **options)
    resumed.load_state_dict(state)
    assert head + [b["keys"] for b in resumed] == first
    resumed.set_epoch(1)
    assert [b["keys"] for b in resumed] == second
    other_weights = make_loader(mux([sources["a"], sources["b"], sources["c"]], weights=[0.2, 0.3, 0.5]), **options)
    with pytest.raises(StateMismatchError, match="mix was"):
        other_weights.load_state_dict(state)


@pytest.mark.parametrize("mixed", [True, False])
def test_a_stream_kept_across_epochs_gives_what_a_restore_gives(sources, monkeypatch, mixed):
    """Without workers an endless stream (a mix, uneven="repeat") goes on across epochs as it
    is; its batches are those of loaders rebuilt from the saved state at each epoch, and a
    state from elsewhere in the stream is restored, not ignored."""
    import seqshard.pipeline.workers.worker as worker

    built = []
    build = worker.build_pipeline
    monkeypatch.setattr(worker, "build_pipeline", lambda *a, **k: built.append(1) or build(*a, **k))
    patterns = mux([sources["a"], sources["b"]], weights=[0.6, 0.4]) if mixed else [sources["a"], sources["b"]]
    options = dict(batch_size=4, epoch_steps=11, num_workers=0, seed=5, **SMALL)
    if not mixed:
        options["uneven"] = "repeat"
    kept = make_loader(patterns, **options)
    epochs, states = [], []
    for epoch in range(3):
        states.append(json.loads(json.dumps(kept.state_dict())))
        kept.set_epoch(epoch)
        epochs.append([b["keys"] for b in kept])
    assert len(built) == 1  # built once, then continued
    for epoch in range(3):
        rebuilt = make_loader(patterns, **options)
        if epoch:
            rebuilt.load_state_dict(states[epoch])
        rebuilt.set_epoch(epoch)
        assert [b["keys"] for b in rebuilt] == epochs[epoch]
    kept.load_state_dict(states[1])  # back to the end of epoch 0: rebuilt from that state
    kept.set_epoch(1)
    assert [b["keys"] for b in kept] == epochs[1]


def test_what_a_mix_refuses(sources):
    mixed = mux([sources["a"], sources["b"]], weights=[1, 1])
    with pytest.raises(ConfigError, match="never runs out: give epoch_steps, epoch_hours or epoch_source"):
        make_loader(mixed, batch_size=4)
    with pytest.raises(ConfigError, match="not by uneven='stop'"):
        make_loader(mixed, batch_size=4, epoch_steps=5, uneven="stop")
    with pytest.raises(ConfigError, match="epoch_source is for mixed sources"):
        make_loader(sources["a"], batch_size=4, epoch_source=0)
    with pytest.raises(ConfigError, match="appears twice"):
        make_loader(mux([sources["a"], sources["a"]]), batch_size=4, epoch_steps=5)


def test_no_batch_holds_an_utterance_twice_when_a_window_spans_passes(sources):
    """Default windows (2000) hold many passes of these 15-105-utterance sources: copies of one
    utterance sort next to each other, and must still go to different batches."""
    for workers in (0, 2):
        loader = make_loader(mux([sources["b"], sources["c"]], weights=[0.5, 0.5]), batch_size=4,
                             num_workers=workers, epoch_steps=60)  # fmt: skip
        batches = [b["keys"] for b in loader]
        assert len(batches) == 60 and all(len(set(keys)) == len(keys) for keys in batches)
        assert sum(map(len, batches)) >= 0.9 * 240


def test_cutting_batches_keeps_copies_apart():
    from seqshard.pipeline.stages.batching import FixedSize, cut_batches

    keys = ["a", "a", "a", "b", "c", "c", "d"]
    batches, oversize = cut_batches([1, 1, 1, 2, 3, 3, 4], FixedSize(3), keys)
    assert not oversize and sorted(i for b in batches for i in b) == list(range(7))
    assert all(len({keys[i] for i in b}) == len(b) for b in batches)
    assert cut_batches([1, 2, 3], FixedSize(2))[0] == [[0, 1], [2]]  # without keys: as before


def _keys_of_units(table, units):
    """The keys a list of units reads (shard by shard, by position)."""
    from seqshard.formats.tar import SampleStream

    found = []
    for unit in units:
        with SampleStream(table.shards[unit.shard].path) as stream:
            for ordinal, sample in enumerate(stream):
                stop = unit.stop if unit.stop is not None else ordinal + 1
                if unit.first() <= ordinal < stop and (ordinal - unit.start) % unit.step == 0:
                    found.append(sample.key)
    return found


def test_a_mix_resumes_elastically_with_other_workers(sources):
    """What the saved readers held of each source's pass is read once by the new readers,
    before the stream goes on (issue 18: mixes resume elastically as single sources do)."""
    from seqshard.pipeline.epoch_plan import Unit

    mixed = mux([sources["a"], sources["c"]], weights=[0.5, 0.5])
    options = dict(batch_size=4, epoch_steps=100, num_workers=2, seed=1, **SMALL)
    loader = make_loader(mixed, **options)
    iterator = iter(loader)
    head = [k for _ in range(3) for k in next(iterator)["keys"]]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    resumed = make_loader(mixed, **{**options, "num_workers": 1})
    with pytest.raises(StateMismatchError, match="num_workers"):
        resumed.load_state_dict(state)
    resumed.load_state_dict(state, strict=False)
    (carry,) = resumed.state_dict()["ranks"]["0"]["carry"]  # what the saved readers held: one worker reads it now
    carried = {source: _keys_of_units(resumed.table, [Unit.from_json(u) for u in units]) for source, _, units in carry}
    a_keys = sorted(k for k in head if k.startswith("a")) + carried[0]
    assert sorted(a_keys) == sorted(f"a{s:03d}-utt{u:03d}" for s in range(12) for u in range(5))  # a's pass 0, once
    batches = [b["keys"] for b in resumed]
    assert len(batches) == 100 - 3 and all(len(set(b)) == len(b) for b in batches)
    assert all(k[0] in "ac" for b in batches for k in b)


def test_a_recipe_of_the_users_works_with_a_mix(sources):
    from seqshard.extend import default_recipe

    seen = []

    def counting_recipe(reader):
        seen.append(type(reader.read()).__name__)
        return default_recipe(reader)

    mixed = mux([sources["a"], sources["b"]], weights=[1, 1])
    loader = make_loader(mixed, batch_size=4, epoch_steps=20, num_workers=0, recipe=counting_recipe, **SMALL)
    keys = [k for b in loader for k in b["keys"]]
    assert len(keys) == 80 and {k[0] for k in keys} == {"a", "b"} and "Mix" in seen


class _Numbered(Stage):
    """An endless source of samples keyed NAME-0, NAME-1, ... (its state: the next number)."""

    def __init__(self, name):
        super().__init__(None)
        self.name = name
        self.at = 0

    def reset(self, state=None):
        super().reset(state)
        self.at = (state or {}).get("at", 0)

    def next(self):
        self.at += 1
        return Sample(f"{self.name}-{self.at - 1}")

    def get_state(self):
        return {"at": self.at}


def test_the_mix_stage_takes_next_block_and_resumes_across_groups_of_blocks():
    """Mix draws the orders of GROUP blocks at once: what it takes is still next_block's
    schedule, and a restore anywhere (around a group's end too) goes on exactly."""
    shares = [0.5, 0.3, 0.2]

    def mix():
        stage = Mix([_Numbered(name) for name in "abc"], shares, 7, 1, 2, 3)
        stage.reset()
        return stage

    total = BLOCK * (GROUP + 2)
    whole = mix()
    taken = [whole.next().key for _ in range(total)]
    counts = np.zeros(3)
    for block in range(total // BLOCK):
        picks = next_block(np.array(shares), counts, 7, block, 1, 2, 3)
        got = ["abc".index(key[0]) for key in taken[block * BLOCK : (block + 1) * BLOCK]]
        assert got == picks.tolist()
        counts += np.bincount(picks, minlength=3)
    assert whole.taken() == counts.tolist()
    for cut in (1, BLOCK * GROUP - 1, BLOCK * GROUP, BLOCK * GROUP + 5):
        head = mix()
        for _ in range(cut):
            head.next()
        resumed = Mix([_Numbered(name) for name in "abc"], shares, 7, 1, 2, 3)
        resumed.reset(json.loads(json.dumps(head.get_state())))
        assert [resumed.next().key for _ in range(total - cut)] == taken[cut:]


def test_windows_that_hold_more_than_a_pass_of_a_source_are_said(sources, caplog):
    """Default windows (3,000 + 2,000 samples) over sources of 60 and 30 utterances: copies
    share windows, and the warning names the source and the windows that would not."""
    import logging

    with caplog.at_level(logging.WARNING, logger="seqshard"):
        make_loader(mux([sources["a"], sources["b"]], weights=[2, 1]), batch_size=4, epoch_steps=5, num_workers=2)
    said = [r.getMessage() for r in caplog.records if "its windows hold" in r.getMessage()]
    assert len(said) == 2 and sources["a"] in said[0] and "each of the 2 readers reads about 30" in said[0]
    assert "lower shuffle_window and sort_window to 45 together" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        make_loader(
            mux([sources["a"], sources["b"]], weights=[2, 1]), batch_size=4, epoch_steps=5, num_workers=0, **SMALL
        )
    assert not [r for r in caplog.records if "its windows hold" in r.getMessage()]
