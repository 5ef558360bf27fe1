"""Language-model blocks (``make_token_loader(prefix, block_size=N)``): every token a target
once per epoch, blocks shuffled per epoch, ranks even, exact and elastic resume, and drops said
out loud; on the real Megatron openwebtext file that the sentence batching cut by 45%."""

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

import gloo_ranks
from conftest import REALDATA
from seqshard import TokenDataset, make_token_loader
from seqshard.errors import ConfigError
from seqshard.formats.peers.mmidx import TokenDatasetWriter
from seqshard.tokens.blocks import BlockRules, plan_blocks

OPENWEBTEXT = REALDATA / "megatron/meg-gpt2-openwebtext_text_document"
HARNESS = Path(__file__).parent / "token_ddp_harness.py"


def _lm(path, lengths, eos=2, seed=0):
    """Documents of ``lengths`` tokens (ids 3..999), each ending with ``eos``."""
    rng = np.random.default_rng(seed)
    writer = TokenDatasetWriter(path, np.uint16)
    writer.add_many([np.append(rng.integers(3, 1000, size=n - 1), eos) for n in lengths])
    writer.finish()
    return str(path)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """8,001 tokens in 300 documents of 2 or more tokens: 250 blocks of 32, one token after them."""
    lengths = np.random.default_rng(1).integers(2, 50, size=300)
    lengths[-1] += 8001 - lengths.sum()
    return _lm(tmp_path_factory.mktemp("lm") / "lm", lengths)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_token_is_a_target_once_in_shifted_overlapping_blocks(lm, num_workers):
    tokens = TokenDataset(lm).tokens
    loader = make_token_loader(lm, block_size=32, max_tokens=32 * 5, num_workers=num_workers)
    targets = []
    for batch in loader:
        assert batch["input"].shape == batch["target"].shape == (5, 32) and batch["input"].dtype.is_signed
        assert (batch["input"][:, 1:] == batch["target"][:, :-1]).all()
        for row, block in enumerate(batch["id"].tolist()):
            assert batch["input"][row].tolist() == tokens[32 * block : 32 * block + 32].tolist()
            assert batch["target"][row].tolist() == tokens[32 * block + 1 : 32 * block + 33].tolist()
            targets.extend(range(32 * block + 1, 32 * block + 33))
        assert batch["src_tokens"] is not None and batch["net_input"]["src_lengths"].tolist() == [32] * 5
        assert batch["src_mask"].all() and batch["ntokens"] == 160
    assert sorted(targets) == list(range(1, 8001))  # 250 blocks in 50 batches: each token after the first once
    stats = loader.stats()
    assert (stats["epoch_blocks"], stats["epoch_tokens"], stats["dropped"], stats["left"]) == (250, 8000, {}, 0)
    assert stats["epoch_documents"] == 300 and stats["blocks"] == 250 and stats["tokens"] == 8000


def test_blocks_are_shuffled_each_epoch_from_the_seed(lm):
    def order(epoch, seed=0):
        loader = make_token_loader(lm, block_size=32, max_tokens=64, seed=seed)
        loader.set_epoch(epoch)
        return [i for batch in loader for i in batch["id"].tolist()]

    first = order(0)
    assert sorted(first) == list(range(250)) and first != sorted(first)
    assert order(0) == first and order(1) != first and order(0, seed=1) != first
    unshuffled = make_token_loader(lm, block_size=32, max_tokens=64, shuffle=False)
    assert [i for batch in unshuffled for i in batch["id"].tolist()] == list(range(250))


def test_ranks_take_as_many_batches_and_share_no_block(lm, caplog):
    loaders = [make_token_loader(lm, block_size=32, max_tokens=96, rank=r, world_size=3) for r in range(3)]
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        taken = [[i for batch in loader for i in batch["id"].tolist()] for loader in loaders]
    assert [len(t) for t in taken] == [81, 81, 81] and len(
        {i for t in taken for i in t}
    ) == 243  # 83 batches of 3: 81 each
    assert loaders[0].stats()["left"] == 7  # 250 - 243 blocks, other ones each epoch
    assert "7 blocks (224 tokens) left out so that each of 3 ranks takes as many batches of 3 blocks" in caplog.text
    assert "max_tokens // block_size" in caplog.text  # 2.8% of the epoch: said, naming the options


def test_a_partial_last_block_is_dropped_counted_and_warned_about(tmp_path, caplog):
    lm = _lm(tmp_path / "lm", [30, 30, 30])  # 89 targets: 2 blocks of 40, 9 tokens after them
    loader = make_token_loader(lm, block_size=40, max_tokens=40)
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        assert sum(len(b["id"]) for b in loader) == 2
    assert loader.stats()["dropped"] == {"partial_block": 9}
    assert "9 of 89 tokens (10.1%) are no target: 9 after the last whole block of block_size=40" in caplog.text


def test_wrong_block_options_are_named(lm, tmp_path, caplog):
    with pytest.raises(ConfigError, match="max_tokens 100 holds no block of block_size 128"):
        make_token_loader(lm, block_size=128, max_tokens=100)
    with pytest.raises(ConfigError, match="block_size 2048 is longer than max_positions 1024"):
        make_token_loader(lm, block_size=2048, max_tokens=4096, max_positions=1024)
    with pytest.raises(ConfigError, match="block_size reads one language-model dataset"):
        make_token_loader(lm, lm, block_size=8)
    with pytest.raises(ConfigError, match="block_size must be"):
        make_token_loader(lm, block_size=0)
    writer = TokenDatasetWriter(tmp_path / "bare", np.uint16)
    writer.add_many([[5, 6, 7], [8, 9], [10, 11, 12]])  # no end-of-sentence id
    writer.finish()
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        make_token_loader(str(tmp_path / "bare"), block_size=2, max_tokens=2)
    assert "each document runs into the next" in caplog.text


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_mid_epoch(lm, num_workers):
    options = dict(block_size=32, max_tokens=96, seed=4, num_workers=num_workers)
    full = make_token_loader(lm, **options)
    full.set_epoch(2)
    expected = [b["id"].tolist() for b in full]
    for cut in (1, 40):
        loader = make_token_loader(lm, **options)
        loader.set_epoch(2)
        iterator = iter(loader)
        head = [next(iterator)["id"].tolist() for _ in range(cut)]
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        resumed = make_token_loader(lm, **options)
        resumed.load_state_dict(state)
        assert head + [b["id"].tolist() for b in resumed] == expected
    with pytest.raises(Exception, match="other rules"):
        make_token_loader(lm, **{**options, "block_size": 16}).load_state_dict(state)


def test_elastic_resume_from_two_ranks_to_three_loses_and_repeats_nothing(lm):
    options = dict(block_size=32, max_tokens=64, seed=9)
    old = [make_token_loader(lm, rank=r, world_size=2, **options) for r in range(2)]
    taken = []
    for loader in old:
        iterator = iter(loader)
        taken += [i for _ in range(20) for i in next(iterator)["id"].tolist()]
    state = old[0].state_dict(gather=False)
    state["deals"][-1]["steps"][1] = 20  # as gathered
    new = [make_token_loader(lm, rank=r, world_size=3, **options) for r in range(3)]
    for loader in new:
        loader.load_state_dict(state, strict=False)
    rest = [[i for b in loader for i in b["id"].tolist()] for loader in new]
    assert len({len(r) for r in rest}) == 1
    everything = taken + [i for r in rest for i in r]
    assert len(everything) == len(set(everything)) and len(everything) >= 250 - 2 * 3  # < 1 batch per new rank left


def test_openwebtext_blocks_use_every_document(caplog):
    """Megatron's own file: sentence batching drops 450 of 1,000 documents (max_positions 1024);
    blocks of 1,024 use every token but the 948 after the last block and one block of 4 left for
    the ranks."""
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        sentences = make_token_loader(OPENWEBTEXT, pad_id=50256)
        assert sum(b["nsentences"] for b in sentences) == 550
    assert "450 longer than max_positions=1024 dropped" in caplog.text and "block_size=N" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        blocks = make_token_loader(OPENWEBTEXT, block_size=1024)
        assert sum(b["ntokens"] for b in blocks) == 1_359_872 and len(blocks) == 332
    assert blocks.stats()["dropped"] == {"partial_block": 948} and blocks.stats()["left"] == 1
    assert caplog.text == ""  # 0.14% not used: below the warning's 1%


def test_the_plan_of_a_billion_tokens_is_one_array_of_blocks():
    started = time.perf_counter()
    plan = plan_blocks(10**9, BlockRules(1024, 8), epoch=3, world_size=8)
    assert time.perf_counter() - started < 2
    assert plan.blocks == 976_562 and plan.order.nbytes == 8 * plan.blocks and plan.dropped == {"partial_block": 511}
    assert {len(r) for r in plan.ranks} == {15_258}


def test_two_gloo_ranks_on_openwebtext(tmp_path, monkeypatch):
    monkeypatch.setattr(gloo_ranks, "HARNESS", HARNESS)
    config = {"prefix": str(OPENWEBTEXT), "options": {"block_size": 1024, "max_tokens": 2048}, "save_at": 100}
    ranks = gloo_ranks.run_ranks(2, config, tmp_path / "run")
    assert [r["len"] for r in ranks] == [332, 332] and [len(r["steps"]) for r in ranks] == [332, 332]
    blocks = [i for r in ranks for step in r["steps"] for i in step]
    assert len(blocks) == len(set(blocks)) == 1328  # of 1,329: one left so that the ranks stay even
    state = ranks[0]["state"]
    assert state["deals"][-1]["steps"] == [100, 100]  # gathered from both ranks
    (tmp_path / "state.json").write_text(json.dumps(state))
    resumed = make_token_loader(OPENWEBTEXT, block_size=1024, max_tokens=2048, rank=0, world_size=1)
    resumed.load_state_dict(state, strict=False)  # elastic: 2 ranks -> 1
    rest = [i for batch in resumed for i in batch["id"].tolist()]
    before = [i for r in ranks for step in r["steps"][:100] for i in step]
    assert sorted(before + rest) == sorted(blocks)


def test_a_drop_of_two_percent_by_max_positions_is_warned(tmp_path, caplog):
    lm = _lm(tmp_path / "lm", [5] * 98 + [40, 40])  # 2 of 100 sentences longer than max_positions
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        assert sum(b["nsentences"] for b in make_token_loader(lm, max_positions=30)) == 98
    assert "2 of 100 sentences (2%) are not read: 2 longer than max_positions=30 dropped" in caplog.text


FAIRSEQ_BLOCKS = REALDATA / "fairseq/token_blocks.npz"  # fairseq 0.12.2's TokenBlockDataset wrote them
MEGATRON = REALDATA / "megatron"


@pytest.mark.parametrize(
    ("case", "prefix", "size"),
    [
        ("ag_news_7", "ag_news_prompt_inputs_document", 7),  # no eos between documents: 14 blocks start with one
        ("ag_news_100", "ag_news_prompt_inputs_document", 100),
        ("openwebtext_1024", "meg-gpt2-openwebtext_text_document", 1024),  # megatron's style: 0 of 1,330 the same
    ],
)
def test_fairseq_blocks_are_those_of_fairseqs_own_token_block_dataset(case, prefix, size):
    made = np.load(FAIRSEQ_BLOCKS)
    loader = make_token_loader(
        MEGATRON / prefix, block_size=size, block_style="fairseq", max_tokens=size, shuffle=False, pad_id=1, eos_id=2
    )
    batches = list(loader)
    assert [b["id"].item() for b in batches] == list(range(len(made[f"{case}.lengths"])))  # the last one kept
    assert [b["ntokens"] for b in batches] == made[f"{case}.lengths"].tolist()
    source = np.concatenate([b["input"][b["src_mask"]].numpy() for b in batches])
    target = np.concatenate([b["target"][b["target_mask"]].numpy() for b in batches])
    if f"{case}.source" in made:
        assert np.array_equal(source, made[f"{case}.source"]) and np.array_equal(target, made[f"{case}.target"])
    else:
        for name, array in (("source", source), ("target", target)):
            assert hashlib.sha256(array.astype("<i8").tobytes()).hexdigest() == str(made[f"{case}.{name}_sha256"])
    last = batches[-1]
    assert (last["input"][~last["src_mask"]] == 1).all() and last["src_lengths"].tolist() == [len(target) % size]
    stream = TokenDataset(MEGATRON / prefix).tokens
    megatrons = [
        (stream[k * size : k * size + size], stream[k * size + 1 : k * size + size + 1]) for k in range(len(batches))
    ]
    same = sum(
        np.array_equal(b["input"][0], i) and np.array_equal(b["target"][0], t) for b, (i, t) in zip(batches, megatrons)
    )
    assert same == 0  # none is a block of Megatron's style (the default)
    stats = loader.stats()
    assert (stats["epoch_tokens"], stats["tokens"], stats["dropped"]) == (len(target), len(target), {})


def test_fairseq_blocks_need_a_pad_that_is_no_token_and_megatrons_none(caplog):
    with pytest.raises(ConfigError, match=r"pad_id 1 \(fairseq's padding\) is a token of .*openwebtext"):
        make_token_loader(OPENWEBTEXT, block_size=1024, block_style="fairseq")
    with pytest.raises(ConfigError, match="block_style must be one of 'megatron', 'fairseq', got 'gpt'"):
        make_token_loader(OPENWEBTEXT, block_size=1024, block_style="gpt")
    with pytest.raises(ConfigError, match="block_style='fairseq' cuts language-model blocks: give block_size=N"):
        make_token_loader(OPENWEBTEXT, block_style="fairseq", pad_id=0)
