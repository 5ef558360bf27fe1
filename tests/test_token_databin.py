"""NLLB's data_bin: directions found in every shard folder, one folder read per epoch, language
tokens prepended, temperature across directions, exact and elastic resume.

fairseq does not build here, so its rules are written in this file from its source
(facebookresearch/fairseq @ 3d262bb2, ``fairseq/data/multilingual/multilingual_data_manager.py``:
``_get_shard_num_dict``, ``get_shard_id``, ``load_lang_dataset``; ``multilingual_utils.py``:
``get_lang_tok``, ``augment_dictionary``; ``sampling_method.py``: ``temperature_sampling``) and
the data_bin is written by seqshard's own fairseq-layout binarize with a dict.txt."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict

import numpy as np
import pytest

from seqshard import ConfigError, StateMismatchError, TokenDataset, binarize, make_token_loader, mux, token_pairs

LANGS = ("deu_Latn", "eng_Latn", "tur_Latn")
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o"]
# sentences per direction in each shard folder (deu_Latn-tur_Latn only in the first)
SHARDS = {
    "shard000": {("eng_Latn", "tur_Latn"): 9, ("eng_Latn", "deu_Latn"): 6, ("deu_Latn", "tur_Latn"): 4},
    "shard001": {("eng_Latn", "tur_Latn"): 7, ("eng_Latn", "deu_Latn"): 3},
}


# -- fairseq's rules, written from its source -----------------------------------------------
def fairseq_shard_counts(split: str, paths: list[str]) -> dict[str, int]:
    """``MultilingualDatasetManager._get_shard_num_dict``."""
    shards: dict[str, int] = defaultdict(int)
    for path in paths:
        directions = set()
        for f in os.listdir(path):
            if f.startswith(split) and f.endswith(".idx"):
                directions.add(f.split(".")[-3])
        for direction in directions:
            shards[direction] += 1
    return shards


def fairseq_shard_path(paths: list[str], num_shards: int, epoch: int) -> str:
    """``get_split_data_path`` with ``get_shard_id``: fairseq's epochs count from 1."""
    return paths[(epoch - 1) % num_shards]


def fairseq_lang_tok(lang: str) -> str:
    """``get_lang_tok(lang, lang_tok_style="multilingual")``."""
    return f"__{lang}__"


def fairseq_dictionary(path, languages: list[str]) -> dict[str, int]:
    """``Dictionary.load`` (<s> <pad> </s> <unk>, then a symbol per line) and
    ``augment_dictionary`` (``add_symbol`` of each language token: a new one goes last)."""
    symbols = ["<s>", "<pad>", "</s>", "<unk>"]
    for line in path.read_text(encoding="utf-8").splitlines():
        symbols.append(line.rsplit(" ", 1)[0])
    ids = {symbol: number for number, symbol in enumerate(symbols)}
    for lang in languages:
        ids.setdefault(fairseq_lang_tok(lang), len(ids))
    return ids


def fairseq_temperature(sizes: list[int], temperature: float) -> np.ndarray:
    """``temperature_sampling``, normalised as ``SampledMultiDataset`` does."""
    total = sum(sizes)
    ratios = np.array([(size / total) ** (1.0 / temperature) for size in sizes])
    return ratios / ratios.sum()


# -- a small data_bin ---------------------------------------------------------------------------
def write_data_bin(root, dictionary_langs=LANGS):
    """Two shard folders, three directions; every dict.{lang}.txt holds the words and the
    language tokens of ``dictionary_langs``; sentence n of side L of a direction is made
    from (direction, n, L), so each row of a batch can be told apart."""
    rng = np.random.default_rng(0)
    dictionary = "".join(f"{word} {100 - n}\n" for n, word in enumerate(WORDS))
    dictionary += "".join(f"{fairseq_lang_tok(lang)} 1\n" for lang in dictionary_langs)
    for shard, directions in SHARDS.items():
        folder = root / shard
        folder.mkdir(parents=True)
        for lang in LANGS:
            (folder / f"dict.{lang}.txt").write_text(dictionary, encoding="utf-8")
        for (src, tgt), count in directions.items():
            for lang in (src, tgt):
                lines = [" ".join(rng.choice(WORDS, size=rng.integers(1, 9))) for _ in range(count)]
                text = root / f"{shard}.{src}-{tgt}.{lang}.txt"
                text.write_text("\n".join(lines) + "\n", encoding="utf-8")
                prefix = folder / f"train.{src}-{tgt}.{lang}"
                binarize(text, prefix, None, dictionary=folder / f"dict.{lang}.txt", layout="fairseq", progress=False)
                os.remove(f"{prefix}.json")  # NLLB's data_bin has none: ids come from the dictionaries
    return root


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return write_data_bin(tmp_path_factory.mktemp("data_bin"))


def rows_read(loader):
    """(direction name, index, src row, tgt row) of every row of an epoch."""
    names = [direction.name for direction in loader.batching.sources.leaves]
    rows = []
    for batch in loader:
        for row, (index, source) in enumerate(zip(batch["id"].tolist(), batch["source"].tolist())):
            src = batch["src_tokens"][row][batch["src_mask"][row]].tolist()
            tgt = batch["target"][row][batch["target_mask"][row]].tolist()
            rows.append((names[source], index, src, tgt))
    return rows


# -- tests ---------------------------------------------------------------------------------------
def test_every_direction_of_every_shard_folder_as_fairseq_counts_and_rotates_them(data_bin):
    found = token_pairs(data_bin)
    paths = [str(data_bin / shard) for shard in SHARDS]
    counts = fairseq_shard_counts("train", paths)
    assert (
        {d.name: len(d.folders) for d in found}
        == dict(counts)
        == {
            "deu_Latn-tur_Latn": 1,
            "eng_Latn-deu_Latn": 2,
            "eng_Latn-tur_Latn": 2,
        }
    )
    for direction in found:
        for epoch in range(5):  # seqshard's epoch e is fairseq's e + 1
            assert direction.folder(epoch) == fairseq_shard_path(paths, counts[direction.name], epoch + 1)
    assert found.folders == tuple(paths) and found.dictionaries["tur_Latn"] == f"{paths[0]}/dict.tur_Latn.txt"
    ids = fairseq_dictionary(data_bin / "shard000/dict.eng_Latn.txt", sorted(LANGS))
    assert found.lang_tokens == {fairseq_lang_tok(lang): ids[fairseq_lang_tok(lang)] for lang in LANGS}
    pair = found["eng_Latn-tur_Latn"].shards[1][0].pair  # NLLB's --encoder-langtok src --decoder-langtok
    assert (pair.src_lang_id, pair.tgt_lang_id) == (ids["__eng_Latn__"], ids["__tur_Latn__"])
    assert pair.src == f"{paths[1]}/train.eng_Latn-tur_Latn.eng_Latn"


def test_each_epoch_reads_its_shard_folder_once_with_language_tokens_prepended(data_bin):
    found = token_pairs(data_bin)
    loader = make_token_loader(found, max_tokens=40, seed=3)
    assert loader.stats()["ids"] == {"pad_id": 1, "eos_id": 2, "pad_from": "dictionary", "eos_from": "dictionary"}
    opened = {}
    for epoch, shard in [(0, "shard000"), (1, "shard001"), (2, "shard000")]:
        loader.set_epoch(epoch)
        rows = rows_read(loader)
        expected = {
            direction.name: SHARDS[shard].get((direction.src_lang, direction.tgt_lang), 4)  # deu-tur: its one folder
            for direction in found
        }
        read = defaultdict(set)
        for name, index, src, tgt in rows:
            part = found[name].parts(epoch)[0].pair
            for side in (part.src, part.tgt):
                opened.setdefault(side, TokenDataset(side)) if side not in opened else None
            assert src == [part.src_lang_id, *opened[part.src][index].tolist()]
            assert tgt == [part.tgt_lang_id, *opened[part.tgt][index].tolist()]
            read[name].add(index)
        assert {name: len(indices) for name, indices in read.items()} == expected  # each sentence once
        assert len(rows) + loader.stats()["left"] == sum(expected.values())
        assert found["eng_Latn-tur_Latn"].folder(epoch).endswith(shard)


def test_a_reversed_pair_and_a_dictionary_without_language_tokens(tmp_path):
    root = write_data_bin(tmp_path / "data_bin", dictionary_langs=("eng_Latn",))
    found = token_pairs(root, lang_pairs="tur_Latn-eng_Latn", langs=["tur_Latn", "deu_Latn", "eng_Latn"])
    direction = found["tur_Latn-eng_Latn"]
    part = direction.shards[0][0].pair
    assert part.src == f"{root}/shard000/train.eng_Latn-tur_Latn.tur_Latn"  # fairseq reads the reversed files
    ids = fairseq_dictionary(root / "shard000/dict.tur_Latn.txt", ["tur_Latn", "deu_Latn", "eng_Latn"])
    assert (part.src_lang_id, part.tgt_lang_id) == (ids["__tur_Latn__"], ids["__eng_Latn__"])
    assert ids["__tur_Latn__"] == len(WORDS) + 5  # appended after the dictionary and its one language token


def test_temperature_across_directions_shares_as_fairseq(data_bin):
    found = token_pairs(data_bin)
    sizes = [sum(SHARDS[s].get((d.src_lang, d.tgt_lang), 0) for s in SHARDS) for d in found]
    loader = make_token_loader(mux(found, temperature=5), max_tokens=40, virtual_size=200)
    shares = fairseq_temperature(sizes, 5)
    assert np.allclose(loader.batching.sources.shares, shares)
    per_direction = loader.stats()["epoch_sentences_per_source"]
    assert np.abs(np.array(list(per_direction.values())) - 200 * shares).max() < 1
    assert {row[0] for row in rows_read(loader)} == {d.name for d in found}


def test_every_folder_each_epoch_by_option(data_bin):
    found = token_pairs(data_bin, shards="all")
    loader = make_token_loader(found, max_tokens=40)
    read = {(name, index, tuple(src)) for name, index, src, _ in rows_read(loader)}
    assert len(read) + loader.stats()["left"] == sum(sum(d.values()) for d in SHARDS.values())


def test_resume_exact_and_on_other_world_sizes_across_shard_folders(data_bin):
    found = token_pairs(data_bin)
    options = dict(max_tokens=24, seed=5)
    whole = make_token_loader(found, **options)
    whole.set_epoch(1)
    expected = [(b["id"].tolist(), b["source"].tolist()) for b in whole]
    loader = make_token_loader(found, **options)
    loader.set_epoch(1)
    iterator = iter(loader)
    head = [(b["id"].tolist(), b["source"].tolist()) for b in (next(iterator), next(iterator))]
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = make_token_loader(token_pairs(data_bin), **options)
    resumed.load_state_dict(state)
    assert head + [(b["id"].tolist(), b["source"].tolist()) for b in resumed] == expected

    two = [make_token_loader(found, rank=r, world_size=2, **options) for r in range(2)]
    taken = []
    for rank_loader in two:
        rank_loader.set_epoch(1)
        batch = next(iter(rank_loader))
        taken += list(zip(batch["source"].tolist(), batch["id"].tolist()))
    state = two[0].state_dict(gather=False)
    state["deals"][-1]["steps"][1] = two[1].state_dict(gather=False)["deals"][-1]["steps"][1]
    one = make_token_loader(found, **options)
    one.load_state_dict(state, strict=False)
    rest = [pair for b in one for pair in zip(b["source"].tolist(), b["id"].tolist())]
    everything = taken + rest
    assert len(everything) == len(set(everything))  # nothing twice
    plan = two[0].plan()
    planned = sum(SHARDS["shard001"].values()) + SHARDS["shard000"][("deu_Latn", "tur_Latn")] - plan.left
    widest = max(len(plan.batch(n)) for n in range(plan.num_batches))
    assert 0 <= planned - len(everything) < widest  # what the redeal leaves: less than a batch


def test_a_state_of_another_data_bin_is_refused(data_bin, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(data_bin, other)
    (other / "shard001/train.eng_Latn-deu_Latn.eng_Latn.bin").unlink()
    (other / "shard001/train.eng_Latn-deu_Latn.eng_Latn.idx").unlink()
    with pytest.raises(ConfigError, match=r"train\.eng_Latn-deu_Latn\.eng_Latn\.idx is missing"):
        token_pairs(other)
    shutil.rmtree(other / "shard001")
    state = make_token_loader(token_pairs(data_bin), max_tokens=40).state_dict()
    with pytest.raises(StateMismatchError, match="other pairs"):
        make_token_loader(token_pairs(other), max_tokens=40).load_state_dict(state)
    with pytest.raises(ConfigError, match="lang_pairs: fra_Latn-eng_Latn is not in"):
        token_pairs(data_bin, lang_pairs=["fra_Latn-eng_Latn"])


@pytest.mark.parametrize("largest", [7, 30])
def test_ids_past_the_dictionary_are_refused_not_taken_for_language_tokens(tmp_path, largest):
    """A .bin made with a larger dictionary: id 7 was served as the language token that
    augment_dictionary numbers 7 here, id 30 as a word no embedding has."""
    from seqshard.formats.peers.mmidx import TokenDatasetWriter

    folder = tmp_path / "data_bin" / "shard000"
    folder.mkdir(parents=True)
    for lang in ("aaa_Latn", "bbb_Latn"):
        (folder / f"dict.{lang}.txt").write_text("x 5\ny 4\nz 3\n")  # ids 4-6; language tokens get 7 and 8
        writer = TokenDatasetWriter(folder / f"train.aaa_Latn-bbb_Latn.{lang}", np.uint16, layout="fairseq")
        writer.add_many([[4, 5, 2], [6, largest if lang == "bbb_Latn" else 4, 2]])
        writer.finish()
    with pytest.raises(
        ConfigError, match=rf"bbb_Latn\.bin holds token id {largest}, but .*dict\.bbb_Latn\.txt has 7 ids"
    ):
        token_pairs(tmp_path / "data_bin")
