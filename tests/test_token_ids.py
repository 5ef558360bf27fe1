"""Padding and end-of-sentence ids of the token loader: from ``PREFIX.json``, else fairseq's,
never a pad that is a real token of the data unless asked for; masks from lengths, not ids."""

import numpy as np
import pytest

from conftest import REALDATA
from seqshard import TokenDataset, binarize, make_token_loader
from seqshard.errors import ConfigError
from seqshard.formats.peers.mmidx import TokenDatasetWriter

BPE = REALDATA / "tokenizers/librispeech.train_960_unigram5000.bpemodel"
OPENWEBTEXT = REALDATA / "megatron/meg-gpt2-openwebtext_text_document"
LINES = ["THE FIRST GREAT SORROW OF HIS LIFE", "IT WAS", "OF HIS LIFE IT WAS THE FIRST", "GREAT"]


def _sides(tmp_path, dictionary=None):
    for side, lines in (("src", LINES), ("tgt", LINES[::-1])):
        (tmp_path / f"{side}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        binarize(tmp_path / f"{side}.txt", tmp_path / side, BPE, dictionary=dictionary, progress=False)
    return str(tmp_path / "src"), str(tmp_path / "tgt")


def test_a_default_pad_that_is_a_token_of_the_data_is_refused():
    with pytest.raises(ConfigError, match=r"pad_id 1 \(fairseq's padding\) is a token of .*openwebtext_text_document "
                       r"\(1683 times\).*pass pad_id=ID"):  # fmt: skip
        make_token_loader(OPENWEBTEXT)
    batch = next(iter(make_token_loader(OPENWEBTEXT, pad_id=1, max_tokens=2048, shuffle=False)))
    assert batch["src_mask"].sum(dim=1).tolist() == batch["src_lengths"].tolist()  # given explicitly: taken


def test_ids_come_from_the_metadata(tmp_path):
    (tmp_path / "dict.txt").write_text("▁THE 9\n▁FIRST 8\n▁OF 7\n▁HIS 6\nS 5\n", encoding="utf-8")
    src, tgt = _sides(tmp_path, tmp_path / "dict.txt")
    loader = make_token_loader(src, tgt)
    assert (loader.batching.collate.pad_id, loader.batching.collate.eos_id) == (1, 2)  # the fairseq dictionary's
    assert loader.stats()["ids"] == {"pad_id": 1, "eos_id": 2, "pad_from": "metadata", "eos_from": "metadata"}
    (tmp_path / "spm").mkdir()
    src, tgt = _sides(tmp_path / "spm")  # SentencePiece's ids: no pad piece; <s> (1) never in encoded text
    loader = make_token_loader(src, tgt)
    assert (loader.batching.collate.pad_id, loader.batching.collate.eos_id) == (1, 2)
    batch = next(iter(loader))
    assert (batch["prev_output_tokens"][:, 0] == 2).all()
    assert loader.stats()["ids"]["pad_from"] == "metadata"  # <s>: a control symbol, recorded by binarize
    assert make_token_loader(src, tgt, pad_id=7, eos_id=5).stats()["ids"]["pad_from"] == "given"


def test_datasets_whose_metadata_disagree_are_refused(tmp_path):
    (tmp_path / "dict.txt").write_text("▁THE 9\n", encoding="utf-8")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    src, _ = _sides(tmp_path / "a", tmp_path / "dict.txt")  # eos 2 and pad 1
    (tmp_path / "units").write_text("<unk> 0\n</s> 1\nT 2\nH 3\nE 4\n", encoding="utf-8")
    (tmp_path / "b/t.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    binarize(tmp_path / "b/t.txt", tmp_path / "b/t", tmp_path / "units", progress=False)  # eos 1
    with pytest.raises(ConfigError, match=r"PREFIX.json name different eos_ids .*pass eos_id=ID"):
        make_token_loader(src, str(tmp_path / "b/t"))


def test_masks_come_from_lengths_even_where_the_pad_is_a_token(tmp_path):
    writer = TokenDatasetWriter(tmp_path / "s", np.uint16)
    writer.add_many([[7, 7, 2], [7, 2], [5, 6, 7, 7, 2]])
    writer.finish()
    writer = TokenDatasetWriter(tmp_path / "t", np.uint16)
    writer.add_many([[8, 2], [7, 7, 7, 2], [9, 2]])
    writer.finish()
    batch = next(iter(make_token_loader(str(tmp_path / "s"), str(tmp_path / "t"), pad_id=7, shuffle=False)))
    order = batch["id"].tolist()
    assert batch["src_mask"].sum(dim=1).tolist() == [[3, 2, 5][i] for i in order]
    assert batch["target_mask"].sum(dim=1).tolist() == [[2, 4, 2][i] for i in order]
    row = order.index(1)  # [7, 2] left-padded to 5: the mask is False where the pad is, True on the real 7
    assert batch["src_tokens"][row].tolist() == [7, 7, 7, 7, 2]
    assert batch["src_mask"][row].tolist() == [False, False, False, True, True]
    assert batch["target_mask"][order.index(1)].tolist() == [True] * 4
    assert "src_mask" not in batch["net_input"]  # fairseq's models take the three inputs only


def test_binarize_records_a_pad_that_is_no_token_and_the_loader_takes_its_own_files(tmp_path):
    """WeNet's units (<blank> 0, <unk> 1): 1 occurs, so fairseq's pad would be refused (issue 23, item 12)."""
    units = ["<blank>", "<unk>", *"EHIORSTW", "▁", "<sos/eos>"]
    (tmp_path / "units.txt").write_text("".join(f"{u} {n}\n" for n, u in enumerate(units)), encoding="utf-8")
    for side, lines in (("src", LINES), ("tgt", LINES[::-1])):
        (tmp_path / f"{side}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        binarize(tmp_path / f"{side}.txt", tmp_path / side, tmp_path / "units.txt", progress=False)
    src = TokenDataset(tmp_path / "src")
    assert src.meta.pad_id == src.meta.vocab_size == len(units) and 1 in src.tokens  # <unk> (G, F, L, ...) occurs
    loader = make_token_loader(str(tmp_path / "src"), str(tmp_path / "tgt"), shuffle=False)
    assert loader.stats()["ids"] == {"pad_id": 12, "eos_id": 11, "pad_from": "metadata", "eos_from": "metadata"}
    batch = next(iter(loader))
    assert (batch["src_tokens"][~batch["src_mask"]] == 12).all() and (~batch["src_mask"]).any()
    # a PREFIX.json written before pads were recorded: one past its vocabulary, never a token
    for side in ("src", "tgt"):
        path = tmp_path / f"{side}.json"
        path.write_text(path.read_text().replace('"pad_id": 12', '"pad_id": null'))
    old = make_token_loader(str(tmp_path / "src"), str(tmp_path / "tgt")).stats()["ids"]
    assert (old["pad_id"], old["pad_from"]) == (12, "vocab_size")
    writer = TokenDatasetWriter(tmp_path / "bare", np.uint16)  # no PREFIX.json, holding 12
    writer.add_many([[3, 12, 11], [4, 11], [5, 11], [6, 11]])
    writer.finish()
    (tmp_path / "src.json").write_text((tmp_path / "src.json").read_text().replace('"pad_id": null', '"pad_id": 12'))
    with pytest.raises(ConfigError, match=r"pad_id 12 \(the pad the other datasets' PREFIX.json name\) is a token of "
                       r".*bare \(1 times\): .*bare has no PREFIX.json naming a pad .*; pass pad_id=ID"):  # fmt: skip
        make_token_loader(str(tmp_path / "bare"), str(tmp_path / "src"))
