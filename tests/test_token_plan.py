"""The token loader's epoch plan (``seqshard/tokens/token_epochs.py``) against the algorithm its
docstring defines, written out here one sentence at a time in plain Python: the same batches,
in the same order, on every rank, for the same seed; and its vectorised pieces (the packed sort,
the run-wise greedy cut) against what they stand for."""

import numpy as np
import pytest

from seqshard import TokenPair, make_token_loader, mux
from seqshard.formats.peers.mmidx import TokenDataset, TokenDatasetWriter
from seqshard.seeds import Seed, stage_rng
from seqshard.tokens.token_epochs import cut_batches, lexsorted


def _dataset(path, lengths, seed):
    rng = np.random.default_rng(seed)
    writer = TokenDatasetWriter(path, np.uint16)
    writer.add_many([rng.integers(3, 500, size=n) for n in lengths])
    writer.finish()
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three translation pairs of 300, 120 and 40 sentences (lengths 0-40, many repeated, so
    that runs of one length fill several batches), and one monolingual dataset."""
    root = tmp_path_factory.mktemp("plan")
    rng = np.random.default_rng(7)
    made = []
    for number, count in enumerate((300, 120, 40)):
        src = rng.integers(0, 41, size=count)
        tgt = np.clip(src + rng.integers(-4, 5, size=count), 0, 45)
        made.append(
            TokenPair(
                _dataset(root / f"p{number}.src", src, 2 * number),
                _dataset(root / f"p{number}.tgt", tgt, 2 * number + 1),
                tgt_lang_id=7 if number == 1 else None,
            )
        )
    mono = _dataset(root / "mono", rng.integers(0, 30, size=250), 99)
    return made, mono


def _largest_remainder(shares, total):
    exact = [share * total for share in shares]
    counts = [int(np.floor(value)) for value in exact]
    by_remainder = sorted(range(len(shares)), key=lambda n: -(exact[n] - counts[n]))  # Python's sort is stable
    for n in by_remainder[: total - sum(counts)]:
        counts[n] += 1
    return counts


def _reference(pairs, shares, epoch, world, max_tokens, max_sentences, max_positions, seed, virtual_size, shuffle):
    """Each rank's batches as lists of (source, index), the drops and the leftovers, one sentence
    at a time as the plan module's docstring says."""
    lengths = []
    for pair in pairs:
        src = [int(n) + (pair.src_lang_id is not None) for n in TokenDataset(pair.src).sizes]
        tgt = [int(n) + (pair.tgt_lang_id is not None) for n in TokenDataset(pair.tgt).sizes] if pair.tgt else None
        lengths.append((src, tgt))
    if shares is None:
        sentences = [(0, i) for i in range(len(lengths[0][0]))]
    else:
        sentences = []
        sizes = [len(src) for src, _ in lengths]
        for number, count in enumerate(_largest_remainder(list(shares), virtual_size or sum(sizes))):
            rng = stage_rng(seed, Seed.TOKEN_VIRTUAL, epoch, number)
            drawn = []
            while len(drawn) < count:  # without repetition until the source is used up, then again
                drawn += rng.permutation(sizes[number]).tolist()[: count - len(drawn)]
            sentences += [(number, i) for i in drawn]

    def sides(sentence):
        src, tgt = lengths[sentence[0]]
        return src[sentence[1]], (tgt[sentence[1]] if tgt else None)

    def longest(sentence):
        return max(length for length in sides(sentence) if length is not None)

    too_long = [s for s in sentences if longest(s) > max_positions]
    over = [s for s in sentences if max_tokens < longest(s) <= max_positions]
    kept = [s for s in sentences if longest(s) <= min(max_positions, max_tokens)]
    kept.sort(key=lambda s: (longest(s), sides(s)[1] or 0, sides(s)[0]))  # stable: ties keep the epoch's order
    batches, batch = [], []
    for sentence in kept:
        grown = len(batch) + 1
        if batch and (grown * longest(sentence) > max_tokens or grown > min(max_sentences or max_tokens, max_tokens)):
            batches.append(batch)
            batch = []
        batch.append(sentence)
    if batch:
        batches.append(batch)
    usable = len(batches) // world * world
    ranks = []
    for rank in range(world):
        numbers = np.arange(rank, usable, world)
        if shuffle:
            numbers = stage_rng(seed, Seed.TOKEN_BATCH_ORDER, epoch, rank).permutation(numbers)
        ranks.append([batches[n] for n in numbers])
    dropped = {name: len(found) for name, found in (("too_long", too_long), ("over_max_tokens", over)) if found}
    return ranks, dropped, sum(len(b) for b in batches[usable:])


CASES = [
    dict(max_tokens=120, max_sentences=None, max_positions=1024, seed=0, virtual_size=None, shuffle=True),
    dict(max_tokens=60, max_sentences=4, max_positions=35, seed=3, virtual_size=None, shuffle=True),
    dict(max_tokens=30, max_sentences=None, max_positions=1024, seed=1, virtual_size=None, shuffle=False),
    dict(max_tokens=200, max_sentences=None, max_positions=40, seed=2, virtual_size=900, shuffle=True),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("source", ["one pair", "mix", "monolingual"])
@pytest.mark.parametrize(("epoch", "world"), [(0, 1), (1, 3)])
def test_the_plan_is_the_algorithm_of_its_docstring(corpora, case, source, epoch, world):
    made, mono = corpora
    options = {k: v for k, v in case.items() if k != "virtual_size"}
    if source == "mix":
        mixed = mux(made, weights=[3, 2, 1])
        loaders = [
            make_token_loader(mixed, virtual_size=case["virtual_size"], rank=r, world_size=world, **options)
            for r in range(world)
        ]
        pairs, shares = made, loaders[0].batching.sources.shares
    else:
        pair = made[0] if source == "one pair" else TokenPair(mono)
        loaders = [make_token_loader(pair, rank=r, world_size=world, **options) for r in range(world)]
        pairs, shares = [pair], None
    ranks, dropped, left = _reference(pairs, shares, epoch, world, **case)
    assert sum(len(batches) for batches in ranks) > world  # batches to compare
    for rank, loader in enumerate(loaders):
        loader.set_epoch(epoch)
        plan = loader.plan()
        taken = [[(int(plan.source[p]), int(plan.index[p])) for p in plan.batch(n)] for n in plan.ranks[rank]]
        assert taken == ranks[rank]
        ids = [batch["id"].tolist() for batch in loader]
        sizes = [TokenDataset(pair.src).sizes + (pair.src_lang_id is not None) for pair in pairs]
        longest_first = [sorted(batch, key=lambda sentence: -sizes[sentence[0]][sentence[1]]) for batch in ranks[rank]]
        assert ids == [[index for _, index in batch] for batch in longest_first]  # rows as fairseq's collater
        assert (plan.dropped, plan.left) == (dropped, left)


def test_the_packed_sort_is_numpys_lexsort():
    rng = np.random.default_rng(0)
    for count, top in ((0, 1), (1, 0), (1000, 3), (5000, 300), (5000, 70000), (300, 2**31 - 1)):
        keys = [rng.integers(0, top + 1, size=count).astype(np.int32) for _ in range(3)]
        expected = np.lexsort(keys)
        order, primary = lexsorted(keys)
        assert np.array_equal(order, expected) and np.array_equal(primary, keys[-1][expected])
        positions = np.sort(rng.choice(10 * count + 1, size=count, replace=False))
        order, primary = lexsorted(keys, positions)
        assert np.array_equal(order, positions[expected]) and np.array_equal(primary, keys[-1][expected])


@pytest.mark.parametrize("max_sentences", [None, 1, 5])
@pytest.mark.parametrize("max_tokens", [1, 9, 100])
def test_the_run_wise_cut_is_the_greedy_cut(max_tokens, max_sentences):
    rng = np.random.default_rng(max_tokens)
    for top in (0, 3, 12, 150):
        lengths = np.sort(rng.integers(0, top + 1, size=400)).astype(np.int32)
        bounds, count = [0], 0
        for position, length in enumerate(lengths.tolist()):
            cap = min(max_tokens // max(lengths[bounds[-1]], 1), max_sentences or max_tokens)
            if count and ((count + 1) * length > max_tokens or count + 1 > cap):
                bounds.append(position)
                count = 0
            count += 1
        bounds.append(len(lengths))
        assert cut_batches(lengths, max_tokens, max_sentences).tolist() == bounds
