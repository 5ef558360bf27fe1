"""Every numeric option of the loaders is checked when the loader is made: its kind (not a bool,
not a string), finite, in range, with seqshard's ConfigError naming it, never a TypeError or
ValueError from Python or torch later on; and an epoch that could never end is refused
(issue 17, item 12)."""

import json
import shutil
from dataclasses import fields

import numpy as np
import pytest

from conftest import pack_small, write_kaldi_dir
from seqshard import make_loader, make_scp_loader, make_token_loader, mux, pack_data
from seqshard.checks import check_number
from seqshard.errors import ConfigError
from seqshard.features.fbank import FbankOptions
from seqshard.formats.peers.mmidx import TokenDatasetWriter
from seqshard.formats.tar import ShardWriter
from seqshard.options import NUMBERS, Batching, LoaderOptions, Workers
from seqshard.tools.reindex import rebuild_index

NAN, INF = float("nan"), float("inf")
NOT_NUMBERS = ["3", True, None, [1]]

# Out-of-range values of each numeric make_loader option (any kind, NaN and infinity are refused
# for all of them); options that need others to be checked at all come with those.
OUT_OF_RANGE = {
    "batch_size": [0, -4, 2.5],
    "batch_frames": [0, 2.5],
    "quadratic_frames": [0, -1],
    "seed": [-1, 1.5],
    "shuffle_window": [0],
    "sort_window": [0],
    "interleave": [0],
    "min_frames": [-1],
    "max_frames": [0],
    "max_tokens": [0],
    "min_frames_per_token": [0],
    "max_frames_per_token": [-2.0],
    "pad_label": [1.5],
    "num_mel_bins": [2, 80.0, 10**9],
    "frame_length_ms": [0, -25],
    "frame_shift_ms": [0],
    "dither": [-1.0],
    "resample_to": [100, 16000.5],
    "noise_prob": [-0.1, 1.5],
    "channel": [-1],
    "max_bad_shards": [-1],
    "remote_retries": [-1, 2.5],
    "remote_timeout": [0],
    "remote_min_rate": [0, -5],
    "num_workers": [-1, 10**18, 1.5],
    "prefetch_factor": [0, 10**9],
    "timeout": [-1],
    "epoch_steps": [0, 2.5],
    "epoch_hours": [0, -1],
    "num_buckets": [0, 10**9],  # bucket_bounds cut 10**9 bounds, one at a time
}
NEEDS = {"quadratic_frames": dict(batch_frames=1000), "batch_frames": {}, "batch_size": {}}


def loader_cases():
    for name in NUMBERS:
        for value in [*NOT_NUMBERS, NAN, INF, -INF, *OUT_OF_RANGE[name]]:
            if value is None and LoaderOptions.default_of(name) is None:
                continue  # None is that option's default
            yield name, value


def test_numpy_numbers_are_taken_as_pythons_so_states_stay_json():
    config = LoaderOptions(batch_size=np.int64(4), seed=np.int64(1), noise_prob=np.float64(0.5))
    assert json.loads(json.dumps(config.batch_defining()))["seed"] == 1 and type(config.batching.batch_size) is int


def test_the_table_covers_every_numeric_loader_option():
    numeric = {
        f.name
        for f in LoaderOptions.option_fields()
        if (isinstance(f.default, (int, float)) and not isinstance(f.default, bool)) or f.name in NUMBERS
    }
    assert numeric <= set(OUT_OF_RANGE) == set(NUMBERS)


@pytest.mark.parametrize(("name", "value"), list(loader_cases()))
def test_a_bad_number_for_a_loader_option_is_named(name, value):
    options = NEEDS.get(name, dict(batch_size=4))
    with pytest.raises(ConfigError, match=rf"^{name}\b"):
        make_loader("no/such/*.tar", **{**options, name: value})


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("resample_to", 500, r"resample_to must be a sample rate in Hz \(a whole number >= 1000\), got 500\."),
        ("channel", -1, r"channel must be >= 0, got -1\."),
        ("num_mel_bins", 2, r"num_mel_bins must be >= 3, got 2\."),
        ("seed", -1, r"seed must be >= 0, got -1\."),
    ],
)
def test_an_option_of_pack_and_loader_has_one_rule_and_one_message(tmp_path, name, value, message):
    """Pack took a sample rate of 500 Hz (its own rule: at least 1 Hz) that the loader refuses."""
    from seqshard import pack_data

    with pytest.raises(ConfigError, match=message):
        make_loader("no/such/*.tar", batch_size=4, **{name: value})
    (tmp_path / "text").write_text("a hello\n")
    (tmp_path / "wav.scp").write_text(f"a {tmp_path / 'a.wav'}\n")
    with pytest.raises(ConfigError, match=message):
        pack_data(
            None, tmp_path / "text", tmp_path / "out", wav_scp=tmp_path / "wav.scp", progress=False, **{name: value}
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(speed_perturb=1.1), "speed_perturb must be a list of factors"),
        (dict(speed_perturb=[0.9, "1.1"]), "speed_perturb factors must be in"),
        (dict(speed_perturb=[0.9, NAN]), "speed_perturb factors must be in"),
        (dict(noise_snr=5), r"noise_snr must be \(low, high\)"),
        (dict(noise_snr=[5, INF]), "noise_snr must be"),
        (dict(noise_snr=["5", 10]), "noise_snr must be"),
        (dict(spec_augment={"freq_masks": NAN}), "spec_augment freq_masks must be a whole number"),
        (dict(spec_augment={"max_time_ratio": "0.2"}), "spec_augment max_time_ratio must be a number"),
        (dict(spec_augment="yes"), "spec_augment must be True, False or a dict"),
        (dict(cache_dir="c", cache_limit=NAN), "cache_limit must be a size"),
        (dict(cache_dir="c", cache_limit=-5), "cache_limit must be a size"),
        (dict(cache_dir="c", cache_limit="1.2.3GB"), "cache_limit must be a size"),
        (dict(cache_dir="c", cache_limit="0GB"), "cache_limit must be a size"),
        (dict(timeout=5, num_workers=0), "timeout=5 bounds the wait for a worker's batch"),
        (dict(multiprocessing_context="threads"), "multiprocessing_context must be one of"),
        (dict(shared_slots="no"), "shared_slots must be True or False"),
        (dict(bucket_sync=1), "bucket_sync must be True or False"),
        (dict(batch_size=64, sort_window=32), "batch_size 64 is above sort_window 32"),
        (dict(quadratic_frames=100.0), "with batch_size it would do nothing"),
        (dict(rank="0", world_size=2), "rank must be a whole number"),
        (dict(world_size=0), "world_size must be >= 1"),
        (dict(split="chars"), "split must be 'char', 'word' or None"),
        (dict(feature_field=5), "feature_field must be a field name"),
        (dict(cmvn=5), "cmvn must be a path"),
        (dict(cache_dir=5), "cache_dir must be a path"),
        (dict(transforms=5), "transforms must be a list"),
        (dict(labels=["text", 5]), "labels must be a Kaldi text file or a list of them"),
        (dict(device="gpu"), "device must be None, 'cpu', 'cuda' or 'cuda:N'"),
        (dict(feature_device="cpu"), "feature_device='cpu' says where fbank is made: it needs features='fbank'"),
        (dict(features="fbank", feature_device="cuda"), "give device='cuda', or feature_device='cpu'"),
        (dict(features="fbank", feature_device="cuda:1", device="cuda:0"), "give device='cuda:1'"),
        (dict(features="fbank", feature_device="cpu", cmvn="speaker"), "cmvn='speaker' applies each speaker's"),
    ],
)
def test_other_options_are_named(options, message):
    with pytest.raises(ConfigError, match=message):
        make_loader("no/such/*.tar", **{"batch_size": 4, **options})


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tokens") / "lm"
    writer = TokenDatasetWriter(prefix, np.uint16)
    for length in range(1, 30):
        writer.add(np.arange(length) + 3)
    writer.finish()
    return str(prefix)


TOKEN_OPTIONS = {
    "max_tokens": [0, 100.5],
    "max_sentences": [0, 2.5],
    "max_positions": [0],
    "virtual_size": [0],
    "seed": [-1],
    "src_lang_id": [-1],
    "pad_id": [-1, 1.0],
    "eos_id": [-1],
    "num_workers": [-1, 10**18],
    "rank": [-1],
    "world_size": [0],
}


@pytest.mark.parametrize(
    ("name", "value"),
    [(name, value) for name, bad in TOKEN_OPTIONS.items() for value in ["3", True, NAN, INF, *bad]],
)
def test_a_bad_number_for_a_token_loader_option_is_named(tokens, name, value):
    with pytest.raises(ConfigError, match=rf"^{name}\b"):
        make_token_loader(tokens, **{name: value})


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("max_tokens", 0, r"^max_tokens must be >= 1, got 0\.$"),
        ("seed", 1.5, r"^seed must be a whole number, got 1\.5\.$"),
        ("num_workers", -1, r"^num_workers must be >= 0 and <= 1024, got -1\.$"),
    ],
)
def test_an_option_of_both_loaders_has_one_rule_and_one_message(tokens, name, value, message):
    """The token loader said ">= 1" where the shard loader said "> 0" (three option systems)."""
    with pytest.raises(ConfigError, match=message):
        make_loader("no/such/*.tar", batch_size=4, **{name: value})
    with pytest.raises(ConfigError, match=message):
        make_token_loader(tokens, **{name: value})
    with pytest.raises(ConfigError, match=r"^max_positions must be >= 1, got 0\.$"):
        make_token_loader(tokens, max_positions=0)


def test_max_sentences_caps_batches_and_nan_is_not_taken_for_no_cap(tokens):
    capped = make_token_loader(tokens, max_tokens=400, max_sentences=3)
    assert max(len(batch["id"]) for batch in capped) == 3
    with pytest.raises(ConfigError, match="max_sentences must be a whole number or None, got nan"):
        make_token_loader(tokens, max_tokens=400, max_sentences=NAN)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(batch_size=0), "batch_size must be >= 1"),
        (dict(batch_size=-3), "batch_size must be >= 1"),
        (dict(batch_size=NAN), "batch_size must be a whole number"),
        (dict(num_workers=-1), "num_workers must be >= 0"),
        (dict(num_workers=10**18), "num_workers must be >= 0 and <= 1024"),
        (dict(pad_label="x"), "pad_label must be a whole number"),
    ],
)
def test_map_style_loader_sizes_are_checked(kaldi_dir, options, message):
    with pytest.raises(ConfigError, match=message):
        make_scp_loader(kaldi_dir.scp, kaldi_dir.text, **options)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(sources=["a", "b"], weights=["3", "1"]), "mux weights must be a number, got '3'"),
        (dict(sources=["a", "b"], weights=[True, False]), "mux weights must be a number, got True"),
        (dict(sources=["a", "b"], weights=[1, NAN]), "mux weights must be a finite number"),
        (dict(sources=["a", "b"], weights="31"), "mux weights must be a list of numbers"),
        (dict(sources=["a", "b"], temperature=INF), "mux temperature must be a finite number"),
        (dict(sources=["a", "b"], temperature="2"), "mux temperature must be a number"),
        (dict(sources="a/*.tar"), "mux takes a list of sources"),
        (dict(sources=["a", 5]), "a mux source is a pattern .* not 5"),
    ],
)
def test_mux_values_keep_their_types(arguments, message):
    with pytest.raises(ConfigError, match=message):
        mux(**arguments)


@pytest.mark.parametrize("name", [f.name for f in fields(FbankOptions)])
def test_every_fbank_option_of_the_wrong_kind_is_named(name):
    with pytest.raises(ConfigError, match=rf"^{name} must be"):
        FbankOptions(**{name: "x" if name != "window" else None})


def test_fbank_sizes_are_bounded_before_anything_is_allocated():
    with pytest.raises(ConfigError, match="num_mel_bins=1000000000 is too many for a 512-point FFT"):
        FbankOptions(num_mel_bins=10**9)
    with pytest.raises(ConfigError, match=r"frame_length_ms=25.0 at sample_rate=1e\+40 gives .* samples; at most"):
        FbankOptions(sample_rate=1e40)


def test_the_checker_names_the_option_and_what_it_must_be():
    assert check_number("n", 3, whole=True, at_least=1) == 3
    assert check_number("n", None, optional=True) is None
    assert type(check_number("n", np.int64(3), whole=True)) is int
    assert type(check_number("n", np.float32(0.5))) is float and type(check_number("n", 2)) is int
    for value, message in [
        (True, "n must be a number, got True."),
        ("1", "n must be a number, got '1'."),
        (INF, "n must be a finite number, got inf."),
        (0, "n must be >= 1 and <= 8, got 0."),
    ]:
        with pytest.raises(ConfigError) as error:
            check_number("n", value, at_least=1, at_most=8)
        assert str(error.value) == message
    with pytest.raises(ConfigError, match=r"^n must be seconds > 0, got -1\.$"):
        check_number("n", -1, above=0, what="seconds > 0")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("never")
    return [pack_small(root / name, speakers=2, per_speaker=4, prefix=name).pattern for name in "abc"]


def test_epochs_that_could_never_end_are_refused_when_the_loader_is_made(sources):
    a, b, c = sources
    with pytest.raises(ConfigError, match="epoch_hours must be a finite number, got nan"):
        make_loader(a, batch_size=2, uneven="repeat", epoch_hours=NAN)
    with pytest.raises(ConfigError, match=r"epoch_source '.*' has weight 0 in the mux, so .* would never end"):
        make_loader(mux([a, b], weights=[1, 0]), batch_size=2, epoch_source=b)
    nested = mux([mux([a, b], weights=[1, 0]), c], weights=[1, 1])
    with pytest.raises(ConfigError, match="has weight 0 in the mux"):
        make_loader(nested, batch_size=2, epoch_source=1)  # b, the second leaf
    loader = make_loader(mux([a, b], weights=[1, 0]), batch_size=2, epoch_source=a, num_workers=0)
    assert sum(len(batch["keys"]) for batch in loader) >= 8  # the read source ends the epoch


def test_an_epoch_source_without_utterances_is_refused(sources, tmp_path):
    ShardWriter(tmp_path / "data-00000.tar").commit()  # an indexed shard of no samples
    rebuild_index(tmp_path, progress=False)
    with pytest.raises(ConfigError, match="holds no utterances, so every epoch would be empty"):
        make_loader(mux([sources[0], f"{tmp_path}/data-*.tar"], weights=[1, 1]), batch_size=2, epoch_source=1)


def test_a_flat_option_and_its_group_give_the_same_options():
    """Groups are the main spelling; every flat name works through one mapping (GROUP_OF)."""
    from seqshard.options import Audio, Text

    flat = LoaderOptions(features="fbank", resample_to=16000, num_workers=0, split="char", uneven="join")
    as_dicts = LoaderOptions(
        audio={"features": "fbank", "resample_to": 16000},
        workers={"num_workers": 0},
        text={"split": "char"},
        epochs={"uneven": "join"},
    )
    as_groups = LoaderOptions(
        audio=Audio(features="fbank", resample_to=16000), num_workers=0, text=Text(split="char"), uneven="join"
    )
    assert flat == as_dicts == as_groups and flat.text.split == "char"
    with pytest.deprecated_call(match="Text"):
        from seqshard.options import Labels
    assert (
        LoaderOptions(labels=Labels(split="char"), features="fbank", resample_to=16000, num_workers=0, uneven="join")
        == flat
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(featurs="fbank"), r"unknown loader option\(s\): featurs\. Did you mean features\?"),
        (dict(audio={"featurs": "fbank"}), r"unknown option\(s\) of audio=: featurs\. Did you mean features\?"),
        (dict(audio={"features": "fbank"}, features="fbank"), r"give features once: alone, or inside audio="),
        (dict(workers=dict(num_workers=0), num_workers=1), r"give num_workers once: alone, or inside workers="),
        (dict(workers=Workers(), num_workers=1), r"give num_workers inside workers=, or workers= not at all"),
        (dict(audio=5), r"audio= takes Audio\(\.\.\.\) or a dict of its options, got 5"),
    ],
)
def test_a_misspelt_or_doubled_option_is_named(options, message):
    with pytest.raises(ConfigError, match=message):
        make_loader("no/such/*.tar", **options)


def test_make_loader_takes_the_groups_and_the_options_most_runs_set():
    import inspect

    from seqshard.options import GROUPS

    parameters = inspect.signature(make_loader).parameters
    assert len(parameters) <= 24 and set(GROUPS) <= set(parameters)


def test_make_loader_takes_a_flat_name_and_its_group_alike(sources):
    flat = make_loader(sources[0], batch_size=2, num_workers=0, sort_window=4, min_frames=1, skip_bad=True)
    grouped = make_loader(
        sources[0],
        batch_size=2,
        workers={"num_workers": 0},
        batching={"sort_window": 4},
        limits={"min_frames": 1},
        bad_data={"skip_bad": True},
    )
    assert flat.options == grouped.options and flat.options.batching.batch_size == 2
    assert [b["keys"] for b in flat] == [b["keys"] for b in grouped]
    with pytest.raises(ConfigError, match=r"give batch_size inside batching=, or batching= not at all"):
        make_loader(sources[0], batch_size=2, batching=Batching(sort_window=4))


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(jobs=5000), r"jobs must be >= 1 and <= 1024, got 5000"),
        (dict(executor="dask-local:100000"), r"expected a number of workers from 1 to 1024 after ':'"),
        (dict(executor="processes:100000"), r"expected a number of workers from 1 to 1024 after ':'"),
        (dict(executor="slurm"), r"executor='slurm'"),  # no Slurm here: named, not submitit's RuntimeError
    ],
)
def test_pack_refuses_a_machine_it_cannot_have_before_starting_it(tmp_path, setting, message):
    """dask-local:100000 started a hundred thousand processes; slurm without srun raised a raw
    RuntimeError from submitit."""
    data = write_kaldi_dir(tmp_path / "k", speakers=1, per_speaker=2, dim=2, frames=(2, 4))
    if setting.get("executor") == "slurm" and shutil.which("srun"):
        pytest.skip("this machine has Slurm")
    with pytest.raises(ConfigError, match=message):
        pack_data(data.scp, data.text, tmp_path / "out", progress=False, **setting)
