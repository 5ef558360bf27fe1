"""Token datasets: the MMIDIDX byte layout, Megatron's own files, binarize, and the token-budget
loader (fairseq batch keys, equal batches per rank, exact and elastic resume, temperature mixes)."""

import json
import struct

import numpy as np
import pytest
import sentencepiece

from conftest import REALDATA
from seqshard import TokenDataset, TokenPair, binarize, make_token_loader, mux
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError, ShardError, StateMismatchError
from seqshard.formats.peers.mmidx import TokenDatasetWriter
from seqshard.tokens.pair_collate import CollateRules, collate_pairs

BPE = REALDATA / "tokenizers/librispeech.train_960_unigram5000.bpemodel"
MEGATRON = REALDATA / "megatron"
WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".upper().split()


def test_writer_matches_the_layout_built_by_hand_from_the_spec(tmp_path):
    sequences = [[5, 6, 7], [], [65000, 1], [9]]
    writer = TokenDatasetWriter(tmp_path / "d", np.uint16)
    for sequence in sequences:
        writer.add(np.array(sequence))
    writer.finish()
    sizes = [3, 0, 2, 1]
    pointers = [0, 6, 6, 10]  # byte offsets: uint16 tokens
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 4)
        + struct.pack("<Q", 5)
        + struct.pack("<4i", *sizes)
        + struct.pack("<4q", *pointers)
        + struct.pack("<5q", 0, 1, 2, 3, 4)  # one document per sequence
    )
    assert (tmp_path / "d.idx").read_bytes() == expected
    assert (tmp_path / "d.bin").read_bytes() == np.array([5, 6, 7, 65000, 1, 9], dtype="<u2").tobytes()
    dataset = TokenDataset(tmp_path / "d")
    assert [list(dataset[i]) for i in range(len(dataset))] == sequences
    assert not list(tmp_path.glob(".*"))  # no temporary left


@pytest.mark.parametrize(
    ("name", "dtype", "count", "tokens"),
    [
        ("ag_news_prompt_inputs_document", np.int32, 100, 5945),
        ("ag_news_prompt_targets_document", np.int32, 100, 244),
        ("meg-gpt2-openwebtext_text_document", np.uint16, 1000, 1361845),
    ],
)
def test_megatron_files_read_and_rewrite_byte_for_byte(tmp_path, name, dtype, count, tokens):
    dataset = TokenDataset(MEGATRON / name)
    assert (len(dataset), dataset.num_tokens, dataset.dtype) == (count, tokens, np.dtype(dtype))
    if name.endswith("targets_document"):
        assert list(dataset[0]) == [126148, 2]  # as Megatron-DeepSpeed's README of the file says
    assert not dataset[0].flags.writeable  # a view of the mapped file
    writer = TokenDatasetWriter(tmp_path / name, dataset.dtype)
    writer.add_many([dataset[i] for i in range(len(dataset))])
    writer.finish()
    for suffix in (".idx", ".bin"):
        assert (tmp_path / (name + suffix)).read_bytes() == (MEGATRON / (name + suffix)).read_bytes()


def test_damaged_token_files_are_named(tmp_path):
    for suffix in (".bin", ".idx"):
        (tmp_path / f"d{suffix}").write_bytes((MEGATRON / f"ag_news_prompt_targets_document{suffix}").read_bytes())
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-4])
    with pytest.raises(ShardError, match=r"d.bin: holds 972 bytes where its index says 976"):
        TokenDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(b"NOTMMIDX" + (tmp_path / "d.idx").read_bytes()[8:])
    with pytest.raises(ShardError, match="bad magic"):
        TokenDataset(tmp_path / "d")
    idx = bytearray((MEGATRON / "ag_news_prompt_targets_document.idx").read_bytes())
    idx[17] = 7
    (tmp_path / "d.idx").write_bytes(bytes(idx))
    with pytest.raises(ShardError, match="7 means float64 to fairseq but float32 to Megatron"):
        TokenDataset(tmp_path / "d")
    with pytest.raises(ConfigError, match="does not exist"):
        TokenDataset(tmp_path / "nothing")


def _text(path, lines, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as stream:
        for _ in range(lines):
            stream.write(" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) + "\n")
    return path


@pytest.mark.parametrize("jobs", [1, 3])
def test_binarize_is_the_tokenizer_plus_eos_line_for_line(tmp_path, jobs):
    text = _text(tmp_path / "train.txt", 3000)
    with open(text, "a", encoding="utf-8") as stream:
        stream.write("\nLAST LINE WITHOUT NEWLINE")
    report = binarize(text, tmp_path / "train", BPE, jobs=jobs, progress=False)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(BPE))
    lines = text.read_text(encoding="utf-8").split("\n")
    assert report.lines == report.sequences == len(lines) == 3002 and report.empty_lines == 1
    dataset = TokenDataset(tmp_path / "train")
    for number, line in enumerate(lines):
        assert list(dataset[number]) == processor.encode(line) + [processor.eos_id()]
    assert report.tokens == dataset.num_tokens and dataset.dtype == np.uint16
    assert list(dataset.doc_index) == list(range(3003))
    if jobs > 1:
        single = binarize(text, tmp_path / "single", BPE, jobs=1, progress=False)
        assert single.tokens == report.tokens
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"single{suffix}").read_bytes() == (tmp_path / f"train{suffix}").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_binarize_bad_input(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"GOOD LINE\nGOOD\nBAD \xff LINE\n")
    with pytest.raises(InputError, match=r"bad.txt:3: the line is not UTF-8 \(byte 4 of the line\)") as error:
        binarize(tmp_path / "bad.txt", tmp_path / "bad", BPE, progress=False)
    assert "skip_bad" not in str(error.value)
    assert not list(tmp_path.glob("bad.bin")) and not list(tmp_path.glob(".bad*"))
    (tmp_path / "units").write_text("<unk> 0\nA 1\nB 2\n")
    (tmp_path / "ab.txt").write_text("A B\nB C\n")
    with pytest.raises(ConfigError, match="has no end-of-sentence id: pass eos_id='ID'"):
        binarize(tmp_path / "ab.txt", tmp_path / "ab", tmp_path / "units", progress=False)
    report = binarize(tmp_path / "ab.txt", tmp_path / "ab", tmp_path / "units", append_eos=False, progress=False)
    assert [list(TokenDataset(tmp_path / "ab")[i]) for i in range(2)] == [[1, 0, 2], [2, 0, 0]]  # chars; space: unk
    assert report.unknown_tokens == 3
    assert main(["binarize", "--in", str(tmp_path / "ab.txt"), "--out", str(tmp_path / "c"), "--tokenizer",
                 str(tmp_path / "units"), "--quiet"]) != 0  # fmt: skip
    assert "pass --eos-id ID, or --no-eos" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Two parallel corpora (de->en 600 lines, fr->en 150 lines), binarized side by side."""
    root = tmp_path_factory.mktemp("pairs")
    made = {}
    for name, lines, seed in (("de", 600, 1), ("fr", 150, 2)):
        for side, offset in (("src", 0), ("tgt", 100)):
            _text(root / f"{name}.{side}.txt", lines, seed + offset)
            binarize(root / f"{name}.{side}.txt", root / f"{name}.{side}", BPE, progress=False)
        made[name] = (str(root / f"{name}.src"), str(root / f"{name}.tgt"))
    return made


def _padded(batch):
    return batch["src_tokens"].numel(), batch["target"].numel()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_stay_within_max_tokens_and_cover_the_corpus_once(pairs, num_workers):
    src, tgt = pairs["de"]
    loader = make_token_loader(src, tgt, max_tokens=300, max_positions=64, num_workers=num_workers)
    seen = []
    for batch in loader:
        assert max(_padded(batch)) <= 300
        seen.extend(batch["id"].tolist())
    stats = loader.stats()
    assert len(seen) == len(set(seen))
    assert len(seen) + sum(stats["dropped"].values()) + stats["left"] == 600 == stats["epoch_sentences"]
    assert stats["steps"] == len(loader.plan().ranks[0])


def test_equal_batch_counts_per_rank_and_nothing_shared(pairs):
    src, tgt = pairs["de"]
    ranks = [make_token_loader(src, tgt, max_tokens=300, rank=r, world_size=3, seed=5) for r in range(3)]
    ids = [[i for b in loader for i in b["id"].tolist()] for loader in ranks]
    steps = [loader.stats()["steps"] for loader in ranks]
    assert len(set(steps)) == 1 and steps[0] > 0
    flat = [i for rank in ids for i in rank]
    assert len(flat) == len(set(flat))
    plan = ranks[0].plan()
    assert len(flat) + plan.left + sum(plan.dropped.values()) == 600
    # each rank gets short and long batches alike (dealt before shuffling)
    means = [
        np.mean([ranks[0].plan().src_len[p].max() for n in plan.ranks[r] for p in [plan.batch(n)]]) for r in range(3)
    ]
    assert max(means) - min(means) < 0.2 * np.mean(means)


def test_collate_on_a_hand_checked_example():
    rules = CollateRules(pad_id=1, eos_id=2, left_pad_source=True)
    batch = collate_pairs(
        np.array([7, 3]),
        [np.array([10, 11, 2]), np.array([12, 2])],
        [np.array([20, 21, 22, 2]), np.array([23, 2])],
        rules,
    )
    assert batch["id"].tolist() == [7, 3] and batch["nsentences"] == 2 and batch["ntokens"] == 6
    assert batch["src_tokens"].tolist() == [[10, 11, 2], [1, 12, 2]]
    assert batch["src_lengths"].tolist() == [3, 2]
    assert batch["target"].tolist() == [[20, 21, 22, 2], [23, 2, 1, 1]]
    assert batch["prev_output_tokens"].tolist() == [[2, 20, 21, 22], [2, 23, 1, 1]]
    assert batch["net_input"]["prev_output_tokens"] is batch["prev_output_tokens"]
    right = collate_pairs(np.array([0]), [np.array([5, 2]), np.array([2])], None, CollateRules(left_pad_source=False))
    assert right["src_tokens"].tolist() == [[5, 2], [2, 1]] and "target" not in right and right["ntokens"] == 3


def test_language_tokens_are_prepended_and_counted_in_lengths(pairs):
    src, tgt = pairs["fr"]
    loader = make_token_loader(src, tgt, max_tokens=400, src_lang_id=4990, tgt_lang_id=4991, left_pad_source=False)
    batch = next(iter(loader))
    raw = TokenDataset(src)
    for row, index in enumerate(batch["id"].tolist()):
        length = int(batch["src_lengths"][row])
        assert batch["src_tokens"][row, 0] == 4990 and length == len(raw[index]) + 1
        assert batch["target"][row, 0] == 4991 and batch["prev_output_tokens"][row, 1] == 4991


def test_long_pairs_are_dropped_and_counted(pairs):
    src, tgt = pairs["de"]
    loader = make_token_loader(src, tgt, max_tokens=1000, max_positions=12)
    kept = sum(b["nsentences"] for b in loader)
    longest = np.maximum(TokenDataset(src).sizes, TokenDataset(tgt).sizes)
    assert loader.stats()["dropped"] == {"too_long": int((longest > 12).sum())}
    assert kept + loader.stats()["left"] == int((longest <= 12).sum())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_mid_epoch(pairs, num_workers):
    src, tgt = pairs["de"]
    options = dict(max_tokens=250, seed=2, num_workers=num_workers)
    full = make_token_loader(src, tgt, **options)
    full.set_epoch(3)
    expected = [b["id"].tolist() for b in full]
    for cut in (0, 1, len(expected) // 2, len(expected)):
        loader = make_token_loader(src, tgt, **options)
        loader.set_epoch(3)
        iterator = iter(loader)
        head = [next(iterator)["id"].tolist() for _ in range(cut)]
        state = json.loads(json.dumps(loader.state_dict()))
        resumed = make_token_loader(src, tgt, **options)
        resumed.load_state_dict(state)
        if cut == len(expected):  # saved after the last batch: the state starts the next epoch (issue 16 #10)
            full.set_epoch(4)
            assert resumed.epoch == 4 and [b["id"].tolist() for b in resumed] == [b["id"].tolist() for b in full]
            continue
        assert resumed.epoch == 3 and len(resumed) == len(expected)  # len(): the whole epoch (the Loader protocol)
        assert resumed.planned_batches().remaining == len(expected) - cut
        assert head + [b["id"].tolist() for b in resumed] == expected, cut


def test_skip_batches_after_a_resume_gives_the_later_batches_unbuilt(pairs):
    src, tgt = pairs["de"]
    options = dict(max_tokens=250, seed=2)
    expected = [b["id"].tolist() for b in make_token_loader(src, tgt, **options)]
    loader = make_token_loader(src, tgt, **options)
    iterator = iter(loader)
    next(iterator)
    resumed = make_token_loader(src, tgt, **options)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.skip_batches(3) == 3 and resumed.stats()["skipped"] == 3
    again = make_token_loader(src, tgt, **options)
    again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))  # the skip is in the state
    assert [b["id"].tolist() for b in again] == expected[4:]
    assert again.stats()["skipped"] == 3 and again.stats()["steps"] == len(expected)
    assert make_token_loader(src, tgt, **options).skip_batches(10**6) == len(expected)  # no further than the epoch


def test_elastic_resume_from_two_ranks_to_three_loses_and_repeats_nothing(pairs):
    src, tgt = pairs["de"]
    options = dict(max_tokens=250, seed=9)
    old = [make_token_loader(src, tgt, rank=r, world_size=2, **options) for r in range(2)]
    taken = []
    for loader in old:
        iterator = iter(loader)
        taken += [i for _ in range(4) for i in next(iterator)["id"].tolist()]
    state = old[0].state_dict(gather=False)
    state["deals"][-1]["steps"][1] = old[1].state_dict(gather=False)["deals"][-1]["steps"][1]  # as gathered
    with pytest.raises(StateMismatchError, match="needs every rank's step"):
        make_token_loader(src, tgt, rank=0, world_size=3, **options).load_state_dict(
            old[1].state_dict(gather=False), strict=False
        )
    with pytest.raises(StateMismatchError, match="pass strict=False"):
        make_token_loader(src, tgt, rank=0, world_size=3, **options).load_state_dict(state)
    new = [make_token_loader(src, tgt, rank=r, world_size=3, **options) for r in range(3)]
    for loader in new:
        loader.load_state_dict(state, strict=False)
    rest = [[i for b in loader for i in b["id"].tolist()] for loader in new]
    assert len({len(r) > 0 for r in rest}) == 1
    counts = [loader.stats()["steps"] for loader in new]
    assert len(set(counts)) == 1  # equal steps on the new ranks too
    everything = taken + [i for r in rest for i in r]
    assert len(everything) == len(set(everything))  # nothing twice
    plan = old[0].plan()
    dealt = sum(len(plan.batch(n)) for n in range(plan.num_batches))
    redealt_left = dealt - plan.left - len(everything)
    assert 0 <= redealt_left < max(len(plan.batch(n)) for n in range(plan.num_batches)) * 3  # < 1 batch per new rank


def test_temperature_mix_shares_and_virtual_epochs(pairs):
    mixed = mux([TokenPair(*pairs["de"], 4990, 4991), TokenPair(*pairs["fr"], 4992, 4993)], temperature=3)
    loader = make_token_loader(mixed, max_tokens=400, virtual_size=3000, seed=1)
    per_source = loader.stats()["epoch_sentences_per_source"]
    shares = np.array([600, 150]) ** (1 / 3)
    shares = shares / shares.sum()
    assert list(per_source.values()) == [round(3000 * shares[0]), 3000 - round(3000 * shares[0])]
    sources = []
    for batch in loader:
        sources += batch["source"].tolist()
        first = batch["src_tokens"][batch["src_tokens"] != 1].reshape(-1)
        assert set(batch["source"].tolist()) <= {0, 1} and first.numel() > 0
    assert abs(np.mean(np.array(sources) == 1) - shares[1]) < 0.02
    fr = [i for b in loader for i, s in zip(b["id"].tolist(), b["source"].tolist()) if s == 1]
    assert len(set(fr)) == 150  # the small corpus is upsampled: every sentence, some twice
    epoch0 = loader.plan(0).index.copy()
    loader.set_epoch(1)
    assert not np.array_equal(loader.plan().index, epoch0)  # drawn anew each epoch
    again = make_token_loader(mixed, max_tokens=400, virtual_size=3000, seed=1)
    assert np.array_equal(again.plan(0).index, epoch0)  # a pure function of (seed, epoch)


def test_bad_pairs(pairs, tmp_path):
    src, _ = pairs["de"]
    _, short = pairs["fr"]
    with pytest.raises(ConfigError, match=r"holds 600 sequences but .* 150: a translation pair needs one target"):
        make_token_loader(src, short)
    with pytest.raises(ConfigError, match=r"^max_tokens must be >= 1, got 0\.$"):
        make_token_loader(src, max_tokens=0)
