"""Token batches built many at a time (one gather per source for a group of batches) against
fairseq's collater written out here row by row: the same arrays, whichever grouping, with and
without workers, with language tokens, empty sequences and either padding side."""

import numpy as np
import pytest

from seqshard import TokenPair, make_token_loader, mux
from seqshard.formats.peers.mmidx import TokenDataset, TokenDatasetWriter

PAD, EOS = 1, 2


def _dataset(path, lengths, seed):
    rng = np.random.default_rng(seed)
    writer = TokenDatasetWriter(path, np.uint16 if seed % 2 else np.int32)  # two dtypes in one mix
    writer.add_many([rng.integers(3, 60000 if seed % 2 else 90000, size=n) for n in lengths])
    writer.finish()
    return str(path)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Three pairs (one with empty sequences on both sides), language tokens on some sides."""
    root = tmp_path_factory.mktemp("batches")
    rng = np.random.default_rng(3)
    pairs = []
    for number, (count, lang) in enumerate(((200, (None, 9)), (90, (5, None)), (60, (4, 8)))):
        src = rng.integers(0 if number == 0 else 1, 25, size=count)
        tgt = rng.integers(0 if number == 0 else 1, 25, size=count)
        pairs.append(
            TokenPair(
                _dataset(root / f"p{number}.src", src, 2 * number),
                _dataset(root / f"p{number}.tgt", tgt, 2 * number + 1),
                *lang,
            )
        )
    return pairs


def _row(pair, side, index):
    dataset = TokenDataset(pair.src if side == "src" else pair.tgt)
    lang = pair.src_lang_id if side == "src" else pair.tgt_lang_id
    return ([lang] if lang is not None else []) + dataset[index].tolist()


def _fairseq(pairs, ids, sources, left_pad_source):
    """fairseq's LanguagePairDataset.collater of these rows, with our masks: rows sorted longest
    source first (``src_lengths.sort(descending=True)``; ties here in their given order)."""
    src = [_row(pairs[s], "src", i) for s, i in zip(sources, ids)]
    order = sorted(range(len(ids)), key=lambda r: -len(src[r]))
    ids, sources, src = [ids[r] for r in order], [sources[r] for r in order], [src[r] for r in order]
    tgt = [_row(pairs[s], "tgt", i) for s, i in zip(sources, ids)]

    def pad(rows, left):
        width = max(len(r) for r in rows)
        matrix = [[PAD] * (width - len(r)) + r if left else r + [PAD] * (width - len(r)) for r in rows]
        mask = [
            [False] * (width - len(r)) + [True] * len(r) if left else [True] * len(r) + [False] * (width - len(r))
            for r in rows
        ]
        return matrix, mask

    src_tokens, src_mask = pad(src, left_pad_source)
    target, target_mask = pad(tgt, False)
    previous, _ = pad([([EOS] + r[:-1]) if r else [] for r in tgt], False)
    return {
        "id": list(ids),
        "nsentences": len(ids),
        "ntokens": sum(len(r) for r in tgt),
        "src_tokens": src_tokens,
        "src_lengths": [len(r) for r in src],
        "src_mask": src_mask,
        "target": target,
        "target_mask": target_mask,
        "prev_output_tokens": previous,
        "source": list(sources),
    }


@pytest.mark.parametrize(("num_workers", "left_pad_source"), [(0, True), (0, False), (2, True)])
def test_batches_are_fairseqs_collater_row_by_row(made, num_workers, left_pad_source):
    loader = make_token_loader(
        mux(made, weights=[3, 2, 1]), max_tokens=160, seed=4, num_workers=num_workers, left_pad_source=left_pad_source,
        pad_id=PAD, eos_id=EOS,
    )  # fmt: skip
    batches = list(loader)
    assert len(batches) > 2 * 16  # more than two groups
    for batch in batches:
        expected = _fairseq(made, batch["id"].tolist(), batch["source"].tolist(), left_pad_source)
        for key, value in expected.items():
            got = batch[key]
            assert (got.tolist() if hasattr(got, "tolist") else got) == value, key
        assert {batch[k].dtype for k in ("id", "src_tokens", "src_lengths", "target", "prev_output_tokens")} == {
            batch["id"].dtype
        } and str(batch["id"].dtype) == "torch.int64"
        assert batch["net_input"]["src_tokens"] is batch["src_tokens"]


def test_any_grouping_builds_the_same_batches(made):
    loader = make_token_loader(mux(made, weights=[1, 1, 1]), max_tokens=100, seed=2)
    dataset = loader.batching.batches(loader.plan())
    numbers = [int(n) for n in loader.plan().ranks[0]]
    one_by_one = [dataset[n] for n in numbers]
    for size in (2, 7, len(numbers)):
        grouped = [b for at in range(0, len(numbers), size) for b in dataset.__getitems__(numbers[at : at + size])]
        for alone, together in zip(one_by_one, grouped, strict=True):
            assert alone.keys() == together.keys()
            for key in alone:
                assert (
                    np.array_equal(alone[key], together[key])
                    and np.asarray(alone[key]).dtype == np.asarray(together[key]).dtype
                )


def test_a_batch_of_empty_sequences_only(tmp_path):
    src = _dataset(tmp_path / "s", [0, 0, 0, 2], 1)
    tgt = _dataset(tmp_path / "t", [0, 0, 0, 3], 3)
    loader = make_token_loader(src, tgt, max_tokens=3, shuffle=False, pad_id=PAD, eos_id=EOS)
    first = next(iter(loader))
    assert first["src_tokens"].shape == (3, 0) and first["prev_output_tokens"].shape == (3, 0)
    assert first["ntokens"] == 0 and first["src_lengths"].tolist() == [0, 0, 0]
