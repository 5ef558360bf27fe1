"""hyper-p.json read as written (a key given twice, NaN and Infinity refused with their line),
every value of its own JSON type and finite (mixes part by part, map-style sizes, the trainer's
keys and its --set), and Kaldi dev sets checked when the loaders are made (relative ark paths,
path_root and path_map)."""

import gc
import json

import pytest

from conftest import write_kaldi_dir
from seqshard import pack_data
from seqshard.app.config import build_loaders, check_data, load_config, read_json
from seqshard.cli import main as cli
from seqshard.errors import ConfigError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    train = write_kaldi_dir(root / "train", speakers=2, per_speaker=4)
    pack_data(train.scp, train.text, root / "shards", utts_per_file=4, progress=False)
    units = root / "units.txt"
    characters = sorted({ch for label in train.labels.values() for ch in label if ch != " "})
    units.write_text("<blank> 0\n<unk> 1\n▁ 2\n" + "".join(f"{ch} {i + 3}\n" for i, ch in enumerate(characters)))
    return {"root": root, "train": train, "units": str(units)}


def hyper(corpus, **option):
    base = {"large_dataset": True, "trset": f"{corpus['root']}/shards/data-*.tar", "tokenizer": corpus["units"]}
    return {"train": {"option": {**base, **option}}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"train": {"option": {\n  "trset": "a",\n  "lr": NaN}}}', r":3: 'lr' holds NaN"),
        ('{"train": {"option": {\n  "trset": "a",\n  "lr": -Infinity}}}', r":3: 'lr' holds -Infinity"),
        ('{"train": {"option": {\n  "trset": "a",\n  "lr": 1e400}}}', r":3: 'lr' holds Infinity"),
        ('{"train": {"option": {\n  "noise_snr": [5, NaN]}}}', r":2: 'noise_snr' holds NaN"),
        ('{"train": {"option": {\n  "lr": 0.1,\n  "epochs": 3,\n  "lr": 0.2}}}', r":4: 'lr' is given twice .*2 and 4"),
        ('{"train": {"option": {"trset": "a"}},\n "train": {}}', r":2: 'train' is given twice"),
        ('{"train": {"option": {"trset": {"mux": ["a"],\n "weights": [1], "weights": [2]}}}}', r":2: 'weights' is "),
    ],
)
def test_json_as_written(tmp_path, text, message):
    path = tmp_path / "hyper-p.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"hyper-p\.json{message}"):
        load_config(path)
    assert cli(["config", str(path)]) == 1


def test_json_values_that_are_fine_still_read(tmp_path):
    path = tmp_path / "hyper-p.json"
    path.write_text('{"data": {"a": [1.5, -2e10, null]},\n "train": {"option": {"trset": "x", "lr": 1e-300, "b": {}}}}')
    assert read_json(path)["train"]["option"] == {"trset": "x", "lr": 1e-300, "b": {}}


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"lr": float("nan")}, r"train\.option\.lr must be a finite number, got NaN"),
        ({"quadratic_frames": float("inf")}, r"train\.option\.quadratic_frames must be a finite number"),
        ({"speed_perturb": [0.9, float("nan")]}, r"train\.option\.speed_perturb\[1\] must be a finite number"),
        ({"epoch_hours": float("nan"), "uneven": "repeat"}, r"train\.option\.epoch_hours must be a finite number"),
        ({"hidden": 10**18}, r"train\.option\.hidden must be <= 8192, got 1000000000000000000"),
        ({"warmup_steps": 10**400}, r"train\.option\.warmup_steps must be <= 2147483647, got 1000\S*\.\.\."),
        ({"layers": 0}, r"train\.option\.layers must be > 0, got 0"),
        ({"dev_batch_size": 0}, r"train\.option\.dev_batch_size must be > 0"),
        ({"trset": ["a/*.tar", 5]}, r"train\.option\.trset must be a string or a list of strings or an object"),
        ({"labels": [1]}, r"train\.option\.labels must be a string or a list of strings or null"),
        ({"path_map": {"/old": 3}}, r"train\.option\.path_map must be an object of strings"),
        ({"path_map": ["/old"]}, r"train\.option\.path_map '/old': expected 'OLD_PREFIX=NEW_PREFIX'"),
    ],
)
def test_every_value_typed_finite_and_in_range(corpus, option, message):
    with pytest.raises(ConfigError, match=message):
        load_config(hyper(corpus, **option))


MIX = {"epoch_steps": 3, "batch_size": 2}


@pytest.mark.parametrize(
    ("trset", "message"),
    [
        ({"mux": "a/*.tar"}, r"trset\.mux must be a non-empty list of sources .*got \"a/\*\.tar\""),
        ({"mux": ["a/*.tar", 5]}, r"trset\.mux\[1\] must be a pattern .* or a mix \(an object\), got 5"),
        ({"mux": ["a", {"mux": ["b", None]}]}, r"trset\.mux\[1\]\.mux\[1\] must be a pattern"),
        ({"mux": ["a", "b"], "weights": ["3", "1"]}, r"trset\.weights must be a list of numbers, got \[\"3\", \"1\"\]"),
        ({"mux": ["a", "b"], "weights": [True, False]}, r"trset\.weights must be a list of numbers, got \[true, fal"),
        ({"mux": ["a", "b"], "weights": [1, float("inf")]}, r"trset\.weights\[1\] must be a finite number"),
        ({"mux": ["a", "b"], "weights": [1]}, r"train\.option\.trset: mux has 2 sources but 1 weights"),
        ({"mux": ["a", "b"], "temperature": "2"}, r"trset\.temperature must be a number > 0, got \"2\""),
        ({"mux": ["a", "b"], "temperature": 0}, r"train\.option\.trset: mux temperature must be > 0"),
    ],
)
def test_mixes_are_checked_part_by_part(corpus, trset, message):
    with pytest.raises(ConfigError, match=message):
        load_config(hyper(corpus, trset=trset, **MIX))


def test_map_style_sizes_are_checked_as_make_loader_checks_them(corpus):
    kaldi = {"large_dataset": False, "trset": str(corpus["train"].root), "num_workers": 0}
    with pytest.raises(ConfigError, match=r"train\.option: batch_size must be >= 1, got 0"):
        build_loaders(hyper(corpus, **kaldi, batch_size=0))  # it gave batches of 16
    with pytest.raises(ConfigError, match=r"batch_size must be >= 1, got -2"):
        load_config(hyper(corpus, **kaldi, batch_size=-2))
    with pytest.raises(ConfigError, match=r"num_workers must be >= 0"):
        load_config(hyper(corpus, **{**kaldi, "num_workers": -1}))
    train, _ = build_loaders(hyper(corpus, **kaldi, batch_size=3))
    assert [len(b["keys"]) for b in train] == [3, 3, 2]
    train, _ = build_loaders(hyper(corpus, **kaldi))
    assert [len(b["keys"]) for b in train] == [8]  # 16 when not given


def test_the_trainers_set_values_are_read_and_checked_as_the_files(corpus, tmp_path):
    from seqshard.app.train_setup import load_settings
    from seqshard.app.trainer import parse_args

    path = tmp_path / "hyper-p.json"
    path.write_text(json.dumps(hyper(corpus)))
    for item, message in [
        ("lr=NaN", r"--set lr=NaN: train\.option\.lr must be a finite number"),
        ('lr="0.5"', r"--set lr=\"0\.5\": train\.option\.lr must be a number, got \"0\.5\""),
        ("hiden=64", r"--set hiden=64: train\.option\.hiden is not a setting\. Did you mean 'hidden'"),
        ("lr", r"--set lr: expected KEY=JSON"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_settings(parse_args(["--config", str(path), f"--set={item}"]), 0)
    config, name = load_settings(parse_args(["--config", str(path), "--set=lr=0.5", "--set=hidden=64"]), 0)
    assert load_config(config, name=name).trainer["lr"] == 0.5 and name == f"{path} with --set"
    mix = ["--config", str(path), '--set=trset={"mux": "a"}', "--set=epoch_steps=3"]
    config, name = load_settings(parse_args(mix), 0)
    with pytest.raises(ConfigError, match=r"hyper-p\.json with --set: train\.option\.trset\.mux must be a non-empty"):
        load_config(config, name=name)
    path.write_text('{"train": {"option": {"lr": 1,\n"lr": 2}}}')
    with pytest.raises(ConfigError, match=r"hyper-p\.json:2: 'lr' is given twice"):
        load_settings(parse_args(["--config", str(path)]), 0)


@pytest.fixture
def relative_dev(tmp_path, monkeypatch):
    """A Kaldi dev dir under recipe/ whose feats.scp names its arks relative to recipe/ (as
    Kaldi recipes write them), and a current folder elsewhere."""
    recipe = tmp_path / "recipe"
    dev = write_kaldi_dir(recipe / "data" / "dev", speakers=2, per_speaker=3, seed=3, prefix="dev")
    dev.scp.write_text(dev.scp.read_text().replace(f"{recipe}/", ""))
    assert "data/dev/raw_feats.1.ark:" in dev.scp.read_text()
    monkeypatch.chdir(tmp_path)
    return recipe, dev


def test_a_dev_set_whose_arks_cannot_be_read_fails_when_the_loaders_are_made(corpus, relative_dev, tmp_path, capsys):
    recipe, dev = relative_dev
    config = hyper(corpus, batch_size=4, num_workers=0, devset=str(dev.root))
    with pytest.raises(ConfigError, match=r"train\.option\.devset cannot be read: .*feats\.scp:1 .*cannot open ark"):
        build_loaders(config)  # it failed after an epoch of training, in the dev pass
    path = tmp_path / "hyper-p.json"
    path.write_text(json.dumps(config))
    assert cli(["config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "relative ark paths start from the current folder" in err, err
    assert "set train.option.path_root to their folder" in err

    for fix in ({"path_root": str(recipe)}, {"path_map": {"data/": f"{recipe}/data/"}}):
        path.write_text(json.dumps(hyper(corpus, batch_size=4, num_workers=0, devset=str(dev.root), **fix)))
        assert cli(["config", str(path)]) == 0
        _, loader = build_loaders(path)
        assert [k for batch in loader for k in batch["keys"]] == dev.keys


def test_kaldi_sets_given_as_objects_name_a_missing_file(corpus, tmp_path):
    devset = {"feats": str(corpus["train"].scp), "text": str(tmp_path / "no-text")}
    with pytest.raises(ConfigError, match=r"train\.option\.devset\.text: '.*no-text' is not a file"):
        build_loaders(hyper(corpus, batch_size=4, devset=devset))
    kaldi = {"large_dataset": False, "trset": {"feats": [str(tmp_path / "a.scp")]}, "num_workers": 0}
    with pytest.raises(ConfigError, match=r"train\.option\.trset\.feats: '.*a\.scp' is not a file"):
        build_loaders(hyper(corpus, **kaldi))  # it was a FileNotFoundError traceback


def test_a_map_style_train_set_takes_path_root_too(corpus, relative_dev, tmp_path):
    recipe, dev = relative_dev
    kaldi = {"large_dataset": False, "trset": str(dev.root), "batch_size": 4, "num_workers": 0}
    path = tmp_path / "hyper-p.json"
    path.write_text(json.dumps(hyper(corpus, **kaldi)))
    assert cli(["config", str(path)]) == 1  # the check reads the map-style train set too
    train, _ = build_loaders(hyper(corpus, **kaldi, path_root=str(recipe)))
    assert sorted(k for batch in train for k in batch["keys"]) == sorted(dev.keys)


def test_a_map_style_workers_error_keeps_its_type(corpus, tmp_path):
    from seqshard.errors import InputError

    broken = write_kaldi_dir(tmp_path / "broken", speakers=2, per_speaker=4, arks=2)
    (broken.root / "raw_feats.2.ark").unlink()
    kaldi = {"large_dataset": False, "trset": str(broken.root), "batch_size": 2, "num_workers": 2, "shuffle": False}
    train, _ = build_loaders(hyper(corpus, **kaldi))
    with pytest.raises(InputError, match=r"raw_feats\.2\.ark'?: No such file") as caught:
        list(train)  # it was torch's RuntimeError("Caught InputError in DataLoader worker process 0 ...")
    assert "skip_bad" not in str(caught.value)  # which the map-style loader does not take
    # the traceback's frames hold torch's iterator, which stops its workers when collected:
    # collected here, not by a garbage collection during a later test (which waited 10 s)
    del caught
    gc.collect()


def test_config_checks_that_train_and_dev_shard_patterns_select_shards(corpus, tmp_path, capsys):
    path = tmp_path / "hyper-p.json"
    shards = f"{corpus['root']}/shards"
    for option, message in [
        (
            {"trset": f"{corpus['root']}/shards/0_10"},
            r"train\.option\.trset: 1 selected shard.*shards/0_10 \(named in the pattern, but it does not exist",
        ),
        ({"trset": [f"{shards}/data-*.tar", f"{shards}/dta-*.tar"]}, r"train\.option\.trset: .*dta-\*\.tar"),
        (
            {"trset": {"mux": [f"{shards}/data-*.tar", {"mux": [f"{shards}/nope-*.tar"]}]}, **MIX},
            r"train\.option\.trset: .*nope-\*\.tar' .*selects no shard",
        ),
        ({"devset": f"{shards}/data-0009*.tar"}, r"train\.option\.devset: .*data-0009\*\.tar' .*selects no shard"),
    ]:
        path.write_text(json.dumps(hyper(corpus, **option)))
        assert cli(["config", str(path)]) == 1, option  # it printed OK; only build_loaders failed
        assert "OK" not in capsys.readouterr().out
        with pytest.raises(ConfigError, match=message):
            check_data(path)
    path.write_text(json.dumps(hyper(corpus, devset=f"{shards}/data-00001.tar")))
    assert cli(["config", str(path)]) == 0 and "OK" in capsys.readouterr().out


def test_config_names_a_missing_train_shard_unless_skip_bad(corpus, tmp_path):
    shards = tmp_path / "shards"
    pack_data(corpus["train"].scp, corpus["train"].text, shards, utts_per_file=4, progress=False)
    (shards / "data-00001.tar").unlink()
    with pytest.raises(ConfigError, match=r"trset: 1 selected shard is missing, first .*data-00001\.tar"):
        check_data(hyper(corpus, trset=str(shards)))
    check_data(hyper(corpus, trset=str(shards), skip_bad=True))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("elsewhere/data-*.tar", r"epoch_source 'elsewhere/data-\*\.tar' is not one of the mixed sources"),
        (2, r"epoch_source 2 is not one of the mixed sources"),
        (1, r"epoch_source '.*data-00001\.tar' has weight 0 in the mux"),
    ],
)
def test_config_refuses_an_epoch_source_the_loader_would_refuse(corpus, spec, message):
    """`seqshard config` said OK for it (issue 23, item 20): one check for both."""
    shards = f"{corpus['root']}/shards"
    trset = {"mux": [f"{shards}/data-00000.tar", f"{shards}/data-00001.tar"], "weights": [1, 0]}
    config = hyper(corpus, trset=trset, epoch_source=spec)
    with pytest.raises(ConfigError, match=message):
        check_data(config)
    with pytest.raises(ConfigError, match=message):
        build_loaders(config)
    check_data(hyper(corpus, trset=trset, epoch_source=0))


def test_a_config_nested_too_deeply_is_refused_not_recursed_into(tmp_path, corpus):
    """A RecursionError before (issue 23, item 20)."""
    deep = tmp_path / "deep.json"
    deep.write_text('{"train": {"option": {"trset": ' + "[" * 100_000 + "]" * 100_000 + "}}}")
    with pytest.raises(ConfigError, match=r"deep.json: lists and objects nest deeper than 64 levels"):
        load_config(deep)
    mix = f"{corpus['root']}/shards/data-*.tar"
    for _ in range(2000):
        mix = {"mux": [mix]}
    with pytest.raises(ConfigError, match=r"the config: lists and objects nest deeper than 64 levels"):
        build_loaders(hyper(corpus, trset=mix, **MIX))
