"""The options of :func:`seqshard.make_loader`, in groups, each default in one place, every value
checked once, when the options are made.

A group is given whole, as a dict of its options or as its class
(``make_loader(..., audio={"features": "fbank"}, workers=Workers(num_workers=4))``); an option
given alone by its name (``features="fbank"``, as ``hyper-p.json`` gives them) is sorted into its
group by :data:`GROUP_OF`. Each group checks its own values (numbers by their rule in
``checks.RULES``, flags, choices); :class:`LoaderOptions` checks what involves several groups.
What involves the data (the shards' fields, a tokenizer) is checked once more, when the
loader's readers are set up (``pipeline/workers/setup.py``).
"""

from __future__ import annotations

import difflib
import math
import multiprocessing
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, ClassVar

from .checks import RULES, check_fields, check_number
from .device import check_device, same_device
from .errors import ConfigError, counted, option
from .features.fbank import FbankOptions
from .features.frontend import AudioOptions, Cmvn, SpecAugmentOptions
from .features.speaker_cmvn import SpeakerCmvn
from .formats.budgets import budgets_from
from .formats.remote.access import RemoteAccess
from .formats.remote.cache import parse_bytes

UNEVEN_MODES = ("stop", "repeat", "join")
START_METHODS = tuple(multiprocessing.get_all_start_methods())
DEFAULT_BATCH_FRAMES = 20000  # when neither batch_size nor batch_frames is given
CACHE_LIMIT = "a size such as '200GB' or '500MiB', or a number of bytes > 0"
SPEAKER = "speaker"  # cmvn="speaker": each sample's speaker statistics (pack --cmvn-scp)


class OptionGroup:
    """A frozen group of options: numbers and flags are checked (numpy numbers become Python's,
    so that states stay JSON) before the group's own :meth:`check`."""

    #: the group's options that only change how fast batches come, not which ones
    runtime_only: ClassVar[tuple[str, ...]] = ()
    #: numeric options that also take a word (``num_workers="auto"``)
    words: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __post_init__(self) -> None:
        for name, allowed in self.words.items():
            value = getattr(self, name)
            if isinstance(value, str) and value not in allowed:
                named = " or ".join(repr(word) for word in allowed)
                raise ConfigError(f"{name} must be a whole number or {named}, got {value!r}.")
        check_fields(self, skip=[name for name in self.words if isinstance(getattr(self, name), str)])
        self.check()

    def check(self) -> None:
        """What the group's values must satisfy together (ConfigError naming the option)."""


@dataclass(frozen=True)
class BudgetWindow:
    """A sort window that follows the budget: samples are read until they fill ``batches``
    batches (unpadded: the sum of :meth:`BatchCost.share`) and number ``min_samples``, and
    never more than ``max_samples`` of them (the memory bound). Above a budget of about
    ``min_samples / batches`` samples a window holds ``batches`` times the budget, and
    padding stays about the same whatever the budget."""

    batches: int = 64
    min_samples: int = 2000
    max_samples: int = 16384

    def __post_init__(self) -> None:
        check_number("sort window batches", self.batches, whole=True, at_least=1)
        check_number("sort window min_samples", self.min_samples, whole=True, at_least=1)
        check_number("sort window max_samples", self.max_samples, whole=True, at_least=self.min_samples)

    def scaled(self, share: float) -> BudgetWindow:
        """This window at ``share`` of its batches and samples (a growing stream's first
        windows), each at least 1."""
        if share >= 1:
            return self
        return BudgetWindow(
            max(1, round(self.batches * share)),
            max(1, math.ceil(self.min_samples * share)),
            max(1, math.ceil(self.max_samples * share)),
        )

    def samples(self, mean_share: float) -> int:
        """Samples of a window whose samples fill ``mean_share`` of a batch each on average."""
        wanted = math.ceil(self.batches / mean_share) if mean_share > 0 else self.max_samples
        return min(self.max_samples, max(self.min_samples, wanted))


@dataclass(frozen=True)
class Batching(OptionGroup):
    """How samples become batches: a fixed count or a budget of padded frames (``batch_frames``,
    20000 when neither is given; ``quadratic_frames`` makes the cost grow with the square of the
    length; ``budgets``, one per length bucket, as ``seqshard calibrate`` finds them), cut from
    length-sorted windows (``sort_window``: ``None`` sizes each window to hold
    64 batches, 2,000 to 16,384 samples, so padding stays low at any budget; a number fixes
    the window's samples); samples over the budget
    go ``"alone"`` or are ``"drop"``ped; ``bucket_sync`` gives every rank batches of one length
    bucket (of ``num_buckets``, drawn from a shared seed) at most steps; ``grow_windows``: each epoch's first sort and
    shuffle windows are small and grow, so its first batch comes early (the sort windows
    in fewer steps in an epoch of few windows: ``recipe.sort_growth``)."""

    batch_size: int | None = None
    batch_frames: int | None = None
    quadratic_frames: float | None = None
    sort_window: int | None = None
    oversize: str = "alone"
    bucket_sync: bool = False
    num_buckets: int = 8
    grow_windows: bool = True
    budgets: str | dict | None = None  # per length bucket (`seqshard calibrate`): a file, its dict, or Budgets

    def __post_init__(self) -> None:
        if self.budgets is not None:
            object.__setattr__(self, "budgets", budgets_from(self.budgets))
        elif self.batch_size is None and self.batch_frames is None:
            object.__setattr__(self, "batch_frames", DEFAULT_BATCH_FRAMES)
        super().__post_init__()

    def check(self) -> None:
        if self.batch_size is not None and self.batch_frames is not None:
            raise ConfigError(
                "give exactly one of batch_size (fixed) or batch_frames (dynamic, padded frames per batch)."
            )
        if self.budgets is not None and (self.batch_size, self.batch_frames, self.quadratic_frames) != (None,) * 3:
            raise ConfigError(
                "budgets gives each length bucket its own padded frames per batch: give it without batch_size, "
                "batch_frames or quadratic_frames."
            )
        largest_window = BudgetWindow().max_samples if self.sort_window is None else self.sort_window
        if self.batch_size is not None and self.batch_size > largest_window:
            raise ConfigError(
                f"batch_size {self.batch_size} is above sort_window {largest_window}: batches are cut from windows "
                "of at most that many samples, so none could be full. Raise sort_window."
            )
        if self.batch_size is not None and self.quadratic_frames is not None:
            raise ConfigError("quadratic_frames shapes a batch_frames budget; with batch_size it would do nothing.")
        if self.oversize not in ("alone", "drop"):
            raise ConfigError(f"oversize must be 'alone' or 'drop', got {self.oversize!r}.")


@dataclass(frozen=True)
class Shuffling(OptionGroup):
    """Randomness: the epoch's shard order and the ``shuffle_window`` (samples) are drawn from
    ``seed``; ``interleave`` shards are read at once; ``split_shards`` cuts shards between
    readers at utterance boundaries (False: whole shards, as CAT and WebDataset deal them)."""

    shuffle: bool = True
    seed: int = 0
    shuffle_window: int = 3000
    interleave: int = 4
    split_shards: bool = True


@dataclass(frozen=True)
class Limits(OptionGroup):
    """Bounds a sample must meet, lengths in the batching measure's unit (frames for feature
    shards); ``None`` means no bound. Checked in this order; a sample out of bounds is counted
    under ``filtered.<reason>``."""

    min_frames: int | None = None
    max_frames: int | None = None
    max_tokens: int | None = None
    min_frames_per_token: float | None = None
    max_frames_per_token: float | None = None

    def check(self) -> None:
        if None not in (self.min_frames, self.max_frames) and self.min_frames > self.max_frames:  # type: ignore[operator]
            raise ConfigError(
                f"min_frames {self.min_frames} is above max_frames {self.max_frames}: nothing would pass."
            )

    @property
    def active(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    @property
    def count_tokens(self) -> bool:
        """Whether a bound counts label tokens (which needs a tokenizer)."""
        return any(v is not None for v in (self.max_tokens, self.min_frames_per_token, self.max_frames_per_token))

    def violation(self, length: int, tokens: int | None) -> str | None:
        """The name of the first bound broken by a sample of ``length`` with ``tokens`` label
        tokens (None when not tokenized), or None."""
        if self.min_frames is not None and length < self.min_frames:
            return "too_few_frames"
        if self.max_frames is not None and length > self.max_frames:
            return "too_many_frames"
        if tokens is None:
            return None
        if self.max_tokens is not None and tokens > self.max_tokens:
            return "too_many_tokens"
        if tokens > 0:
            ratio = length / tokens
            if self.min_frames_per_token is not None and ratio < self.min_frames_per_token:
                return "too_few_frames_per_token"
            if self.max_frames_per_token is not None and ratio > self.max_frames_per_token:
                return "too_many_frames_per_token"
        return None


@dataclass(frozen=True)
class Text(OptionGroup):
    """How label text becomes tokens (``text=``): a units file's ``split`` (``"char"``/``"word"``, else chosen
    from the units), ``strip_spaces`` before tokenizing."""

    split: str | None = None
    strip_spaces: bool = False

    def check(self) -> None:
        if self.split not in (None, "char", "word"):
            raise ConfigError(f"split must be 'char', 'word' or None (chosen from the units), got {self.split!r}.")


@dataclass(frozen=True)
class Reading(OptionGroup):
    """Which fields are read (``fields``: names or member suffixes as ``inspect`` lists them;
    None: the shards' own), which is the feature field, and the folder relative paths in
    lists read directly are taken from (``path_root``; None: the current folder, else the
    list's)."""

    runtime_only = ("path_root",)  # where the files are, not which samples: a moved corpus resumes

    fields: tuple[str, ...] | None = None
    feature_field: str | None = None
    path_root: str | None = None

    def check(self) -> None:
        if self.fields is not None and (isinstance(self.fields, str) or not self.fields):
            raise ConfigError(f"fields must be a non-empty list of field names, got {self.fields!r}.")
        if not isinstance(self.feature_field, (str, type(None))):
            raise ConfigError(f"feature_field must be a field name or None, got {self.feature_field!r}.")
        if self.path_root is not None:
            if not isinstance(self.path_root, (str, os.PathLike)) or not os.path.isdir(self.path_root):
                raise ConfigError(
                    f"path_root must be a folder (where relative paths of lists start), got {self.path_root!r}."
                )
            object.__setattr__(self, "path_root", os.fspath(self.path_root))


@dataclass(frozen=True)
class Collation(OptionGroup):
    """How a batch is laid out: ``dtype`` of the padded features, ``pad_label`` padding ``labels``."""

    dtype: str = "float32"
    pad_label: int = -1

    def check(self) -> None:
        if self.dtype not in ("float32", "float16"):
            raise ConfigError(f"dtype must be 'float32' or 'float16', got {self.dtype!r}.")


@dataclass(frozen=True)
class Audio(OptionGroup):
    """How audio becomes model input (README, Audio): ``features="fbank"`` on the fly (else
    padded waveforms), resampling, speed perturbation, noise, CMVN, SpecAugment, a channel;
    ``feature_device`` makes fbank, CMVN and SpecAugment in torch where the batch is handed
    over (``"cuda"``: on the GPU, with ``device="cuda"``) instead of in the workers."""

    runtime_only = ("feature_device",)

    features: str | None = None
    num_mel_bins: int = 80
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    dither: float = 0.0
    resample_to: int | None = None
    speed_perturb: tuple[float, ...] | None = None
    noise: Any = None
    noise_snr: tuple[float, float] = (5.0, 20.0)
    noise_prob: float = 1.0
    cmvn: str | None = None
    cmvn_norm_vars: bool = False
    spec_augment: bool | dict[str, Any] = False
    channel: int | None = None
    feature_device: str | None = None

    def check(self) -> None:
        object.__setattr__(self, "feature_device", check_device("feature_device", self.feature_device))
        if self.feature_device is not None and self.features != "fbank":
            raise ConfigError(
                f"feature_device={self.feature_device!r} says where fbank is made: it needs features='fbank'."
            )
        if self.feature_device is not None and self.cmvn == SPEAKER:
            raise ConfigError(
                "cmvn='speaker' applies each speaker's statistics in the workers, to features made there: "
                "leave feature_device out (fbank in the workers), or use a global cmvn file."
            )
        if self.speed_perturb is not None and not isinstance(self.speed_perturb, (tuple, list)):
            raise ConfigError(
                f"speed_perturb must be a list of factors (e.g. [0.9, 1.0, 1.1]), got {self.speed_perturb!r}."
            )
        for factor in self.speed_perturb or ():
            check_number("speed_perturb factors", factor, at_least=0.5, at_most=2, what="in [0.5, 2]")
        if not isinstance(self.noise_snr, (tuple, list)) or len(self.noise_snr) != 2:
            raise ConfigError(f"noise_snr must be (low, high) in dB, got {self.noise_snr!r}.")
        for bound in self.noise_snr:
            check_number("noise_snr", bound, what="(low, high) in dB, finite numbers")
        if not isinstance(self.cmvn, (str, os.PathLike, type(None))):
            raise ConfigError(f"cmvn must be a path, 'speaker' or None, got {self.cmvn!r}.")
        if self.cmvn_norm_vars and self.cmvn != SPEAKER:
            raise ConfigError(
                "cmvn_norm_vars is Kaldi's --norm-vars for cmvn='speaker'; a `seqshard cmvn` file always divides by "
                "the standard deviation: leave cmvn_norm_vars out."
            )
        self.parsed()

    def parsed(self) -> AudioOptions:
        """The audio options as the stages use them (fbank options, factors, loaded CMVN, masks)."""
        if self.features not in (None, "fbank"):
            raise ConfigError(f"features must be 'fbank' or None, got {self.features!r}.")
        try:
            fbank = FbankOptions(
                sample_rate=float(self.resample_to or FbankOptions.sample_rate),
                num_mel_bins=self.num_mel_bins,
                frame_length_ms=self.frame_length_ms,
                frame_shift_ms=self.frame_shift_ms,
                dither=self.dither,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.noise_snr[0] > self.noise_snr[1]:
            raise ConfigError(f"noise_snr must be (low, high) in dB, got {self.noise_snr!r}.")
        return AudioOptions(
            self.features,
            fbank,
            self.resample_to,
            tuple(float(f) for f in self.speed_perturb or ()),
            self.noise,
            tuple(self.noise_snr),
            self.noise_prob,
            SpeakerCmvn(self.cmvn_norm_vars) if self.cmvn == SPEAKER else Cmvn.load(self.cmvn) if self.cmvn else None,
            _spec_augment(self.spec_augment),
            self.channel,
        )


def _spec_augment(masks: Any) -> SpecAugmentOptions | None:
    if isinstance(masks, dict):
        known = SpecAugmentOptions.__dataclass_fields__
        unknown = set(masks) - set(known)
        if unknown:
            raise ConfigError(
                f"spec_augment: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}."
            )
        for name, value in masks.items():
            check_number(f"spec_augment {name}", value, whole=isinstance(known[name].default, int))
        return SpecAugmentOptions(**masks)
    if isinstance(masks, bool):
        return SpecAugmentOptions() if masks else None
    raise ConfigError(f"spec_augment must be True, False or a dict of mask options, got {masks!r}.")


@dataclass(frozen=True)
class Pipeline(OptionGroup):
    """Stages of the user's: ``transforms`` (functions, ``keep_if(...)``, Stage classes) where
    the default recipe says, or a whole ``recipe`` (README, Recipes)."""

    transforms: tuple[Any, ...] = ()
    recipe: Callable[..., Any] | None = None

    def check(self) -> None:
        if not isinstance(self.transforms, (tuple, list)):
            raise ConfigError(f"transforms must be a list of transforms, got {self.transforms!r}.")
        for transform in self.transforms:
            if not callable(transform) and not callable(getattr(transform, "predicate", None)):
                raise ConfigError(
                    f"transforms takes functions (sample -> sample), keep_if(...) and Stage subclasses, not {transform!r}."
                )
        if self.recipe is not None and not callable(self.recipe):
            raise ConfigError(f"recipe must be a function (reader) -> Stage, got {self.recipe!r}.")


@dataclass(frozen=True)
class BadData(OptionGroup):
    """``skip_bad``: count and skip bad samples and damaged shards instead of stopping, within
    ``max_bad_shards`` (a fraction of the shards below 1, or a count) per epoch;
    ``check_finite``: drop samples whose features hold NaN or infinity (``dropped.non_finite``)."""

    skip_bad: bool = False
    max_bad_shards: float = 0.05
    check_finite: bool = False

    def shard_budget(self, num_shards: int) -> int:
        """How many bad (damaged, missing) shards an epoch may skip before the run stops."""
        if self.max_bad_shards >= 1:
            return int(self.max_bad_shards)
        return int(self.max_bad_shards * num_shards)

    def over_budget(self, damaged: int, missing: int, shards: int) -> str:
        """Why a run stops: the epoch's bad shards and what ``max_bad_shards`` allows, in numbers."""
        share = self.max_bad_shards
        allowed = f"{self.shard_budget(shards)} that {option('max_bad_shards', share)} allows"
        if share < 1:
            allowed += f" ({share * 100:g}% of {shards}, rounded down)"
        return (
            f"{damaged + missing} of {counted(shards, 'selected shard')} {'was' if damaged + missing == 1 else 'were'} "
            f"bad this epoch ({damaged} damaged, "
            f"{missing} missing): more than the {allowed}. The warnings above name them; repair or re-upload "
            "them, or raise max_bad_shards."
        )


@dataclass(frozen=True)
class Remote(OptionGroup):
    """How remote shards are read (README, Remote shards): fsspec ``storage_options``, a local
    cache (``cache_dir``, ``cache_limit``), retries and timeout, and whether ``pipe:`` commands
    may run. None of it changes which batches come out."""

    runtime_only = (
        "storage_options",
        "cache_dir",
        "cache_limit",
        "remote_retries",
        "remote_timeout",
        "remote_min_rate",
        "allow_pipes",
    )

    storage_options: dict[str, Any] | None = None
    cache_dir: str | None = None
    cache_limit: str | int | None = None
    remote_retries: int = 4
    remote_timeout: float = 60.0
    remote_min_rate: float = 256 << 10  # a request's body slower than this over its last remote_timeout: stalled
    allow_pipes: bool = False

    def check(self) -> None:
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError(
                f"storage_options must be a dict of fsspec options (e.g. {{'anon': True}}), got {self.storage_options!r}."
            )
        if not isinstance(self.cache_dir, (str, os.PathLike, type(None))):
            raise ConfigError(f"cache_dir must be a path or None, got {self.cache_dir!r}.")
        if self.cache_limit is None:
            return
        if self.cache_dir is None:
            raise ConfigError("cache_limit needs cache_dir (where remote shards are kept).")
        if isinstance(self.cache_limit, str):
            try:
                limit = parse_bytes(self.cache_limit)
            except (ValueError, OverflowError):
                limit = None
        else:
            limit = check_number("cache_limit", self.cache_limit, above=0, what=CACHE_LIMIT)
        if limit is None or limit <= 0:
            raise ConfigError(f"cache_limit must be {CACHE_LIMIT}, got {self.cache_limit!r}.")

    def access(self) -> RemoteAccess:
        """How a loader with these options reads remote shards (made in each process that reads)."""
        from .formats.remote.cache import ShardCache

        cache = ShardCache(self.cache_dir, self.cache_limit) if self.cache_dir is not None else None
        return RemoteAccess(
            storage_options=dict(self.storage_options or {}),
            retries=self.remote_retries,
            timeout_s=self.remote_timeout,
            min_rate=self.remote_min_rate,
            cache=cache,
            allow_pipes=self.allow_pipes,
        )


@dataclass(frozen=True)
class Workers(OptionGroup):
    """The worker processes of each rank and how batches reach the training process
    (``device="cuda"``: on the GPU, copied one ahead). Only ``num_workers`` changes which
    batches come out (it sets the readers); ``"auto"`` chooses it when the loader is made
    (``pipeline/rank/auto.py``)."""

    words: ClassVar[dict[str, tuple[str, ...]]] = {"num_workers": ("auto",)}

    runtime_only = (
        "prefetch_factor",
        "persistent_workers",
        "pin_memory",
        "multiprocessing_context",
        "timeout",
        "shared_slots",
        "device",
    )

    num_workers: int | str = 2
    prefetch_factor: int = 4
    persistent_workers: bool = False
    pin_memory: bool = False
    multiprocessing_context: str | None = None
    timeout: float = 0
    shared_slots: bool = True
    device: str | None = None

    def check(self) -> None:
        object.__setattr__(self, "device", check_device("device", self.device))
        if self.timeout and not self.num_workers:
            raise ConfigError(
                f"timeout={self.timeout!r} bounds the wait for a worker's batch, and num_workers=0 makes batches in "
                "this process: give num_workers > 0, or leave timeout at 0."
            )
        if self.multiprocessing_context is not None and self.multiprocessing_context not in START_METHODS:
            raise ConfigError(
                f"multiprocessing_context must be one of {', '.join(START_METHODS)} or None, "
                f"got {self.multiprocessing_context!r}."
            )

    @property
    def readers(self) -> int:
        """Readers per rank: one per worker process, one without workers."""
        if isinstance(self.num_workers, str):
            raise ConfigError("num_workers='auto' is chosen when the loader is made; these options were not resolved.")
        return max(1, self.num_workers)


@dataclass(frozen=True)
class Epochs(OptionGroup):
    """How an epoch ends across ranks (``uneven``: ``"stop"`` together, ``"repeat"`` the data
    without end, ``"join"`` each rank alone) and how long it is (``epoch_steps``,
    ``epoch_hours``, or for a mix ``epoch_source``: one pass's worth of that source)."""

    uneven: str = "stop"
    epoch_steps: int | None = None
    epoch_hours: float | None = None
    epoch_source: int | str | None = None

    def check(self) -> None:
        if self.uneven not in UNEVEN_MODES:
            raise ConfigError(f"uneven must be one of {UNEVEN_MODES}, got {self.uneven!r}.")
        lengths = [n for n in ("epoch_steps", "epoch_hours", "epoch_source") if getattr(self, n) is not None]
        if len(lengths) > 1:
            raise ConfigError(
                f"give at most one of epoch_steps, epoch_hours or epoch_source (got {', '.join(lengths)})."
            )
        if self.uneven == "repeat" and not lengths:
            raise ConfigError(
                "uneven='repeat' needs epoch_steps or epoch_hours (the epoch length, the same on every rank)."
            )
        if self.epoch_source is not None and self.uneven != "repeat":
            raise ConfigError("epoch_source is for mixed sources (make_loader(seqshard.mux([...]), ...)).")
        if isinstance(self.epoch_source, bool) or not isinstance(self.epoch_source, (int, str, type(None))):
            raise ConfigError(
                f"epoch_source must be a mixed source's position or pattern text, got {self.epoch_source!r}."
            )
        if self.uneven == "join" and self.epoch_hours is not None:
            raise ConfigError(
                "epoch_hours counts hours over all ranks, which needs the ranks to talk; "
                "uneven='join' does not: use epoch_steps, or uneven='stop'."
            )

    @property
    def continues_stream(self) -> bool:
        """Whether each reader's stream goes on across epochs (``"repeat"``, and every mix)."""
        return self.uneven == "repeat"


GROUPS: dict[str, type[OptionGroup]] = {
    "batching": Batching,
    "shuffling": Shuffling,
    "limits": Limits,
    "text": Text,
    "reading": Reading,
    "collation": Collation,
    "audio": Audio,
    "pipeline": Pipeline,
    "bad_data": BadData,
    "remote": Remote,
    "workers": Workers,
    "epochs": Epochs,
}
RENAMED_GROUPS = {"labels": "text"}  # old group keywords (make_loader's labels= is Kaldi text files)
GROUP_OF: dict[str, str] = {option.name: group for group, kind in GROUPS.items() for option in fields(kind)}  # type: ignore[arg-type]
# The numeric loader options (their rules: checks.RULES, one table for pack and every loader).
NUMBERS: dict[str, dict[str, Any]] = {name: RULES[name] for name in GROUP_OF if name in RULES}
SEQUENCES = ("fields", "transforms", "speed_perturb", "noise_snr")  # lists are taken as tuples


@dataclass(frozen=True, init=False)
class LoaderOptions:
    """Every option of a shard loader, by group; made from whole groups (``workers={"num_workers":
    0}``, ``workers=Workers(num_workers=0)``) or flat names (``num_workers=0``). ``mixed=True`` for the
    options of a mix (``seqshard.mux``): its stream never runs out, so ``uneven`` is
    ``"repeat"`` and an epoch length is needed."""

    mixed: bool
    batching: Batching
    shuffling: Shuffling
    limits: Limits
    text: Text
    reading: Reading
    collation: Collation
    audio: Audio
    pipeline: Pipeline
    bad_data: BadData
    remote: Remote
    workers: Workers
    epochs: Epochs

    def __init__(self, *, mixed: bool = False, **given: Any) -> None:
        given = {RENAMED_GROUPS.get(name, name): value for name, value in given.items()}
        flat = {name: value for name, value in given.items() if name not in GROUPS}
        _refuse_unknown(flat, GROUP_OF, "loader option(s)")
        for group in GROUPS:
            if isinstance(given.get(group), dict):  # a group spelled as a dict: its options by name
                options = given.pop(group)
                _refuse_unknown(options, GROUPS[group].__dataclass_fields__, f"option(s) of {group}=")  # type: ignore[attr-defined]
                twice = sorted(set(flat) & set(options))
                if twice:
                    raise ConfigError(f"give {', '.join(twice)} once: alone, or inside {group}=.")
                flat.update(options)
        if callable(flat.get("transforms")):
            flat["transforms"] = (flat["transforms"],)  # one transform given alone
        for name in SEQUENCES:
            if isinstance(flat.get(name), list):
                flat[name] = tuple(flat[name])
        if mixed:
            _check_mixed(flat)
        elif flat.get("epoch_source") is not None:
            raise ConfigError("epoch_source is for mixed sources (make_loader(seqshard.mux([...]), ...)).")
        object.__setattr__(self, "mixed", mixed)
        for group, kind in GROUPS.items():
            mine = {name: value for name, value in flat.items() if GROUP_OF[name] == group}
            made = given.get(group)
            if made is not None and not isinstance(made, kind):
                raise ConfigError(f"{group}= takes {kind.__name__}(...) or a dict of its options, got {made!r}.")
            if made is not None and mine:  # a group's class holds all its options (each default too)
                raise ConfigError(f"give {', '.join(sorted(mine))} inside {group}=, or {group}= not at all.")
            object.__setattr__(self, group, made if made is not None else kind(**mine))
        self._check_across()

    def _check_across(self) -> None:
        if self.batching.bucket_sync and self.epochs.uneven == "join":
            raise ConfigError("bucket_sync needs the ranks to step together; it cannot be used with uneven='join'.")
        made, handed = self.audio.feature_device, self.workers.device or "cpu"
        if made is not None and not same_device(made, handed):
            raise ConfigError(
                f"feature_device={made!r} makes the features where batches are handed over, which is {handed!r} "
                f"(device={self.workers.device!r}): give device={made!r}, or feature_device={handed!r}."
            )

    def flat(self) -> dict[str, Any]:
        """Every option by its flat name."""
        return {name: getattr(getattr(self, group), name) for name, group in GROUP_OF.items()}

    def replace(self, **flat: Any) -> LoaderOptions:
        """These options with some changed (by flat name)."""
        return LoaderOptions(mixed=self.mixed, **{**self.flat(), **flat})

    def batch_defining(self) -> dict[str, Any]:
        """The options a saved state must agree with (all but the runtime-only ones), JSON-safe:
        functions and classes (transforms, recipe) by their qualified names."""
        described = {}
        for name, value in self.flat().items():
            if name in GROUPS[GROUP_OF[name]].runtime_only:
                continue
            if name == "transforms":
                value = [qualified_name(t) for t in value]
            elif name == "recipe":
                value = None if value is None else qualified_name(value)
            elif name == "budgets":
                value = None if value is None else value.to_json()
            elif name in SEQUENCES and value is not None:
                value = list(value)
            described[name] = value
        return described

    @staticmethod
    def option_fields() -> Iterator[Field]:
        """Every option's dataclass field (name, default, type annotation), group by group."""
        for kind in GROUPS.values():
            yield from fields(kind)  # type: ignore[arg-type]

    @staticmethod
    def default_of(name: str) -> Any:
        """The default of option ``name`` (``MISSING`` for none)."""
        option = GROUPS[GROUP_OF[name]].__dataclass_fields__[name]  # type: ignore[attr-defined]
        return option.default if option.default is not MISSING else MISSING


def _refuse_unknown(given: dict[str, Any], known: Iterable[str], what: str) -> None:
    """ConfigError naming the names of ``given`` not ``known`` (``what`` they should be), with
    the closest known name of each."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        close = [m for name in unknown for m in difflib.get_close_matches(name, list(known), n=1)]
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown {what}: {', '.join(unknown)}.{hint}")


def _check_mixed(flat: dict[str, Any]) -> None:
    """A mix is an endless stream of its sources: its epochs are cut by a length."""
    if flat.get("uneven", "repeat") != "repeat":
        raise ConfigError(
            "a mux is an endless stream of its sources: its epochs are cut by epoch_steps, epoch_hours or "
            f"epoch_source, not by uneven={flat['uneven']!r}."
        )
    if all(flat.get(n) is None for n in ("epoch_steps", "epoch_hours", "epoch_source")):
        raise ConfigError(
            "a mux never runs out: give epoch_steps, epoch_hours or epoch_source (one pass's worth of one source)."
        )
    flat["uneven"] = "repeat"


def qualified_name(item: Any) -> str:
    """A function's or class's importable name (``keep_if(...)`` by its predicate)."""
    target = getattr(item, "predicate", item)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
    return f"keep_if({name})" if target is not item else name


def __getattr__(name: str) -> Any:
    if name == "Labels":  # the text group's old name
        warnings.warn("seqshard.options.Labels is now seqshard.options.Text (text=)", DeprecationWarning, stacklevel=2)
        return Text
    raise AttributeError(f"module 'seqshard.options' has no attribute {name!r}")
