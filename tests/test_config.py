"""hyper-p.json: build_loaders from seed 01's keys, the map-style switch, dev sets, mixes, and
every wrong key or type refused by name; seqshard config --explain."""

import json

import pytest

from conftest import write_kaldi_dir
from seqshard import make_loader, pack_data
from seqshard.app.config import build_loaders, explain, load_config
from seqshard.cli import main as cli
from seqshard.errors import ConfigError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("config")
    train = write_kaldi_dir(root / "train", speakers=5, per_speaker=6)
    dev = write_kaldi_dir(root / "dev", speakers=2, per_speaker=4, seed=3, prefix="dev")
    pack_data(train.scp, train.text, root / "shards", utts_per_file=7, progress=False)
    pack_data(dev.scp, dev.text, root / "dev-shards", utts_per_file=4, progress=False)
    units = root / "units.txt"
    characters = sorted({ch for label in train.labels.values() for ch in label if ch != " "})
    units.write_text("<blank> 0\n<unk> 1\n▁ 2\n" + "".join(f"{ch} {i + 3}\n" for i, ch in enumerate(characters)))
    return {"root": root, "train": train, "dev": dev, "units": str(units)}


def hyper(corpus, **option):
    base = {"large_dataset": True, "trset": f"{corpus['root']}/shards/data-*.tar", "tokenizer": corpus["units"]}
    return {"data": {"ignored": True}, "train": {"bin": "cat.ctc.train", "option": {**base, **option}}}


def keys(loader, epoch=0):
    loader.set_epoch(epoch)
    return [k for batch in loader for k in batch["keys"]]


def test_large_dataset_gives_make_loader_with_the_same_options(corpus, tmp_path):
    path = tmp_path / "hyper-p.json"
    path.write_text(json.dumps(hyper(corpus, batch_size=4, num_workers=0, seed=3, shuffle_window=10)))
    train, dev = build_loaders(path)
    direct = make_loader(f"{corpus['root']}/shards/data-*.tar", corpus["units"], batch_size=4, num_workers=0, seed=3,
                         shuffle_window=10)  # fmt: skip
    assert dev is None
    assert keys(train) == keys(direct) and len(keys(train)) == 30
    batch = next(iter(train))
    assert {"feats", "feat_lens", "labels", "label_lens", "keys"} <= set(batch)


def test_large_dataset_false_gives_the_map_style_loader_over_feats_scp(corpus):
    config = hyper(corpus, large_dataset=False, trset=str(corpus["train"].root), batch_size=4, num_workers=0)
    train, _ = build_loaders(config)
    first, second = keys(train, 0), keys(train, 1)
    assert sorted(first) == sorted(corpus["train"].keys) and first != second  # shuffled per epoch
    batch = next(iter(train))
    assert batch["feats"].shape[0] == 4 and batch["labels"].shape[0] == 4
    with pytest.raises(ConfigError, match="batch_frames is for shards, and large_dataset is false"):
        load_config(hyper(corpus, large_dataset=False, trset=str(corpus["train"].root), batch_frames=1000))
    with pytest.raises(ConfigError, match="epoch_steps is for shards, and large_dataset is not set"):
        unset = hyper(corpus, trset=str(corpus["train"].root), batch_size=4, epoch_steps=3)
        del unset["train"]["option"]["large_dataset"]
        load_config(unset)
    with pytest.raises(ConfigError, match="not a Kaldi data dir"):
        build_loaders(hyper(corpus, large_dataset=False, batch_size=4))


def test_dev_sets_in_file_order_from_a_data_dir_or_shards(corpus):
    _, dev = build_loaders(hyper(corpus, batch_size=4, devset=str(corpus["dev"].root)))
    assert keys(dev) == corpus["dev"].keys == keys(dev, 1)  # the ordinary way, in file order
    _, dev = build_loaders(hyper(corpus, batch_size=4, devset=f"{corpus['root']}/dev-shards", dev_batch_size=3))
    first = keys(dev)
    assert sorted(first) == sorted(corpus["dev"].keys) and keys(dev, 1) == first  # shuffle=False
    explicit = {"feats": str(corpus["dev"].scp), "text": str(corpus["dev"].text)}
    _, dev = build_loaders(hyper(corpus, batch_size=4, devset=explicit))
    assert keys(dev) == corpus["dev"].keys


def test_a_mix_in_trset(corpus):
    by_source = {"mux": [f"{corpus['root']}/shards", f"{corpus['root']}/dev-shards"], "weights": [1, 1]}
    train, _ = build_loaders(hyper(corpus, trset=by_source, batch_size=4, num_workers=0, epoch_source=1))
    assert sum(k.startswith("dev") for k in keys(train)) >= 8  # an epoch: one pass's worth of the dev shards
    trset = {"mux": [f"{corpus['root']}/shards", f"{corpus['root']}/dev-shards"], "weights": [0.5, 0.5]}
    small = dict(shuffle_window=8, sort_window=8, interleave=2)
    train, _ = build_loaders(hyper(corpus, trset=trset, batch_size=4, num_workers=0, epoch_steps=50, **small))
    seen = keys(train)
    assert len(seen) >= 180 and abs(sum(k.startswith("dev") for k in seen) / len(seen) - 0.5) <= 0.05
    with pytest.raises(ConfigError, match="is a mix"):
        build_loaders(hyper(corpus, trset={"sources": ["a"]}, batch_size=4, epoch_steps=3))
    with pytest.raises(ConfigError, match="trset is a mix, which never runs out"):
        load_config(hyper(corpus, trset=by_source, batch_size=4))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"num_worker": 2}, r"train\.option\.num_worker is not a setting\. Did you mean 'num_workers'"),
        ({"num_workers": "2"}, r"train\.option: num_workers must be a whole number or 'auto', got '2'"),
        ({"shuffle": "yes"}, r"train\.option\.shuffle must be true or false"),
        ({"uneven": "sometimes"}, r"uneven must be one of"),
        ({"batch_frames": 100, "batch_size": 4}, r"exactly one of batch_size"),
        ({"recipe": "my.recipe"}, r"train\.option\.recipe is a Python object"),
        ({"epochs": 2.5}, r"train\.option\.epochs must be a whole number"),
        ({"lr": "fast"}, r"train\.option\.lr must be a number"),
        ({"large_dataset": "true"}, r"train\.option\.large_dataset must be true or false"),
        ({"epochs": -1}, r"train\.option\.epochs must be > 0"),
        ({"remote_timeout": 0}, r"remote_timeout must be a number of seconds > 0"),
        ({"remote_retries": -1}, r"remote_retries must be a whole number >= 0"),
        ({"storage_options": "anon"}, r"train\.option\.storage_options must be an object or null"),
    ],
)
def test_wrong_keys_and_types_are_named(corpus, option, message):
    with pytest.raises(ConfigError, match=message):
        load_config(hyper(corpus, **option))


def test_structure_errors(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"train\.option\.trset is required"):
        load_config({"train": {"option": {"large_dataset": True}}})
    with pytest.raises(ConfigError, match="no 'train' section"):
        load_config({"data": {}})
    with pytest.raises(ConfigError, match=r"train\.opton is not a key of 'train'"):
        load_config({"train": {"opton": {}}})
    bad = tmp_path / "bad.json"
    bad.write_text('{"train": {"option": {"trset": "x",}}}')
    with pytest.raises(ConfigError, match=r"bad\.json:1: not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match=r"devset = .* does not exist"):
        build_loaders(hyper(corpus, batch_size=4, devset=str(tmp_path / "nodev")))


def test_explain_marks_what_is_set_and_what_is_default(corpus, tmp_path, capsys):
    text = explain(hyper(corpus, batch_size=4, epochs=5))
    assert "batch_size             4" in text and "(set)" in text
    assert "shuffle_window         3000" in text and "epochs                 5" in text
    assert "lr                     0.001" in text
    map_style = explain(hyper(corpus, large_dataset=False, trset="x", batch_size=4))
    assert "not used (shards only)" in map_style
    path = tmp_path / "hyper-p.json"
    path.write_text(json.dumps(hyper(corpus, batch_size=4)))
    assert cli(["config", "--explain", str(path)]) == 0
    assert "max_bad_shards" in capsys.readouterr().out
    path.write_text(json.dumps(hyper(corpus, batch_sise=4)))
    assert cli(["config", str(path)]) == 1
    assert "batch_sise is not a setting. Did you mean 'batch_size'" in capsys.readouterr().err
