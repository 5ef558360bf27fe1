"""``binarize --dict``: the ids of a fairseq ``dict.txt`` for a real SentencePiece model's pieces,
byte for byte what fairseq-preprocess writes, checked against fairseq 0.12.2's rules written
here from its code (``Dictionary.add_from_file``, ``encode_line``, ``tokenize_line``); and the
``PREFIX.json`` binarize leaves beside the files."""

import json
import logging
import re

import numpy as np
import pytest
import sentencepiece
from test_token_layouts import fairseq_read, fairseq_write

from conftest import REALDATA
from seqshard import TokenDataset, binarize, make_token_loader
from seqshard.cli import main
from seqshard.errors import ConfigError, ShardError
from seqshard.text.fairseq_dict import FairseqDictionary

BPE = REALDATA / "tokenizers/librispeech.train_960_unigram5000.bpemodel"
LEFT_OUT = ("▁AND", "▁OF", "▁TO")  # pieces the dictionary lacks: <unk>
LINES = [
    "THE FIRST GREAT SORROW OF HIS LIFE",
    "",
    "AND IT WAS TO BE THE ß OF 日本 AND OF HIS",  # ß: a piece SentencePiece does not know, but the dict does
    "  SPACES   AROUND  ",
    "IT WAS THE FIRST",
]


def fairseq_dictionary(path):
    """fairseq's Dictionary.load: specials 0-3, then each line's word, rsplit at its last space."""
    symbols = ["<s>", "<pad>", "</s>", "<unk>"]
    indices = {s: i for i, s in enumerate(symbols)}
    with open(path, encoding="utf-8") as stream:
        for line in stream.readlines():
            line, field = line.rstrip().rsplit(" ", 1)
            overwrite = field == "#fairseq:overwrite"
            if overwrite:
                line, field = line.rsplit(" ", 1)
            int(field)
            assert overwrite or line not in indices
            indices[line] = len(symbols)
            symbols.append(line)
    return indices


def fairseq_encode_line(indices, line):
    words = re.sub(r"\s+", " ", line).strip().split()
    return [indices.get(word, 3) for word in words] + [2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The text, its spm_encode'd pieces and a dict.txt of the model's pieces (a few left out,
    one surface piece added, one piece moved with #fairseq:overwrite)."""
    root = tmp_path_factory.mktemp("dict")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(BPE))
    (root / "train.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    pieces = [" ".join(processor.encode(line, out_type=str)) for line in LINES]  # spm_encode --output_format=piece
    (root / "train.spm.txt").write_text("\n".join(pieces) + "\n", encoding="utf-8")
    vocabulary = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    kept = [p for p in vocabulary if p not in ("<unk>", "<s>", "</s>") and p not in LEFT_OUT]
    rows = [f"{piece} {1000 - n // 10}" for n, piece in enumerate(kept)] + ["ß 3", "▁THE 1 #fairseq:overwrite"]
    (root / "dict.txt").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return root


def test_dict_ids_are_what_fairseq_preprocess_writes(corpus, tmp_path, caplog):
    indices = fairseq_dictionary(corpus / "dict.txt")
    expected = [fairseq_encode_line(indices, line) for line in (corpus / "train.spm.txt").read_text().splitlines()]
    fairseq_write(tmp_path / "fairseq", expected)  # uint16: fairseq's dtype for a vocabulary below 65,500
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        report = binarize(
            corpus / "train.txt",
            tmp_path / "ours",
            BPE,
            dictionary=corpus / "dict.txt",
            layout="fairseq",
            progress=False,
        )
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"fairseq{suffix}").read_bytes()
    assert fairseq_read(tmp_path / "ours") == expected
    the = indices["▁THE"]
    assert the == max(indices.values()) and expected[0][0] == the  # the overwritten line's id, the last one
    assert indices["ß"] in expected[2] and 3 in expected[2]  # ß from the dict; 日本 and the left-out pieces unknown
    unknown = sum(ids.count(3) for ids in expected)
    assert report.unknown_tokens == unknown > 0 and report.vocab_size == len(FairseqDictionary(corpus / "dict.txt"))
    assert f"{unknown} of {report.tokens} tokens" in caplog.text and "stored as <unk> (3)" in caplog.text
    # the same ids from text already split into pieces (no tokenizer), through the command line
    assert main(["binarize", "--in", str(corpus / "train.spm.txt"), "--out", str(tmp_path / "split"), "--dict",
                 str(corpus / "dict.txt"), "--layout", "fairseq", "--quiet"]) == 0  # fmt: skip
    assert (tmp_path / "split.bin").read_bytes() == (tmp_path / "fairseq.bin").read_bytes()


def test_binarize_records_the_ids_it_used(corpus, tmp_path):
    binarize(corpus / "train.txt", tmp_path / "d", BPE, dictionary=corpus / "dict.txt", progress=False)
    meta = json.loads((tmp_path / "d.json").read_text())
    assert {k: meta[k] for k in ("layout", "dtype", "bos_id", "pad_id", "eos_id", "unk_id", "eos_appended")} == {
        "layout": "megatron", "dtype": "uint16", "bos_id": 0, "pad_id": 1, "eos_id": 2, "unk_id": 3, "eos_appended": True
    }  # fmt: skip
    assert meta["dictionary"]["path"] == str(corpus / "dict.txt") and len(meta["dictionary"]["sha256"]) == 64
    assert meta["tokenizer"]["path"] == str(BPE)
    dataset = TokenDataset(tmp_path / "d")
    assert (meta["sequences"], meta["tokens"]) == (len(dataset), dataset.num_tokens) and dataset.meta.pad_id == 1
    binarize(corpus / "train.txt", tmp_path / "s", BPE, progress=False)  # SentencePiece's ids: no pad piece, <s> pads
    meta = TokenDataset(tmp_path / "s").meta
    assert (meta.vocab_size, meta.pad_id, meta.bos_id, meta.eos_id, meta.unk_id) == (5000, 1, 1, 2, 0)  # pad: <s>
    assert meta.dictionary is None and meta.tokenizer["path"] == str(BPE)
    (tmp_path / "d.json").replace(tmp_path / "s.json")  # metadata of other files
    with pytest.raises(ShardError, match=r"s.json: describes .* it belongs to other files"):
        TokenDataset(tmp_path / "s").meta  # noqa: B018


def test_a_bad_dictionary_line_is_named(tmp_path, corpus):
    (tmp_path / "dup.txt").write_text("A 5\nB 4\nA 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"dup.txt:3: 'A' again; .* #fairseq:overwrite"):
        FairseqDictionary(tmp_path / "dup.txt")
    (tmp_path / "nocount.txt").write_text("A 5\nB\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"nocount.txt:2: expected 'PIECE COUNT'"):
        FairseqDictionary(tmp_path / "nocount.txt")
    (tmp_path / "units").write_text("<unk> 0\nA 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="maps the pieces of a SentencePiece model"):
        binarize(corpus / "train.txt", tmp_path / "x", tmp_path / "units", dictionary=corpus / "dict.txt")
    overwritten = FairseqDictionary(corpus / "dict.txt")
    assert len(overwritten) == 4 + len((corpus / "dict.txt").read_text().splitlines())
    assert np.array_equal([overwritten.index(p) for p in ("<s>", "<pad>", "</s>", "<unk>", "nothing")], [0, 1, 2, 3, 3])


@pytest.mark.parametrize(("layout", "num_workers"), [("fairseq", 0), ("megatron", 2)])
def test_a_parallel_corpus_from_the_command_line_to_batches(corpus, tmp_path, layout, num_workers):
    """As a fairseq user: binarize both sides with the dictionary, then batch them."""
    (tmp_path / "train.en").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    (tmp_path / "train.de").write_text("\n".join(reversed(LINES)) + "\n", encoding="utf-8")
    for side in ("de", "en"):
        assert main(["binarize", "--in", str(tmp_path / f"train.{side}"), "--out", str(tmp_path / f"data.{side}"),
                     "--tokenizer", str(BPE), "--dict", str(corpus / "dict.txt"), "--layout", layout, "--json",
                     "--quiet"]) == 0  # fmt: skip
    src, tgt = TokenDataset(tmp_path / "data.de"), TokenDataset(tmp_path / "data.en")
    loader = make_token_loader(str(tmp_path / "data.de"), str(tmp_path / "data.en"), num_workers=num_workers)
    assert (loader.batching.collate.pad_id, loader.batching.collate.eos_id) == (1, 2)  # from PREFIX.json
    seen = []
    for batch in loader:
        for row, index in enumerate(batch["id"].tolist()):
            mask = batch["src_mask"][row]
            assert batch["src_tokens"][row][mask].tolist() == src[index].tolist()
            assert (batch["src_tokens"][row][~mask] == 1).all()
            assert batch["target"][row][batch["target_mask"][row]].tolist() == tgt[index].tolist()
            seen.append(index)
    assert sorted(seen) == list(range(len(LINES)))
