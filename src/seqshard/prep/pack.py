"""``pack_data``: Kaldi features + labels -> indexed, globally shuffled tar shards.

The work runs as waves of small tasks (``waves.py``) on any executor: this process, ``jobs``
processes, a Dask or Ray cluster, Slurm through submitit (``executors.py``), or ``--num-parts P
--part I`` runs of an array job sharing one folder. A rerun of the same command after a crash
redoes only unfinished tasks. The run that finds every shard finished writes each folder's
``index.json`` and the report.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..checks import check_rule
from ..errors import ConfigError, InputError, SeqshardError, Where, counted, listed, option
from ..formats.files import inside, read_json, remove_stale_temporaries, write_json_atomic, writing
from ..formats.index import ShardIndex
from ..formats.index_entries import ShardEntry
from ..formats.lock import FolderLock
from ..formats.pack_state import PLANNED_NAME, REPORT_NAME, STATE_DIR, planned_record
from ..formats.peers.nemo import manifest_files
from ..progress import Progress
from .chunks import Chunk
from .executors import open_executor
from .inputs import DURATIONS_FILE, NUM_FRAMES_FILE, AudioSource, FeatureSource, Utterance
from .job import UTTS_PER_FILE, PackJob, PackOptions, PackSource, ShardTask, parse_groups
from .journal import finished_shards, shard_written
from .layout import GroupOrder, group_orders
from .nemo_source import ManifestSource
from .owned import describe_foreign, foreign_entries, in_the_way, recorded, remove_previous_pack
from .report import GroupTotals, PackReport, summarize_records
from .rows import TableLines
from .waves import Totals, Waves, plan_chunks, totals_of, with_buckets
from .write import DEFAULT_MAX_OPEN

_LOG = logging.getLogger("seqshard")
RUN_FILE = "run.json"
ADDED_OPTIONS = ("utt2spk", "cmvn_scp", "fields")  # left out of a run's record while unset


def pack_data(
    f_scps: str | Path | Sequence[str | Path] | None,
    f_labels: str | Path | Sequence[str | Path] | None,
    d_out: str | Path,
    fmt: str = "data-%05d.tar",
    filter_group: Sequence[str] | str | None = None,
    *,
    utts_per_file: int = UTTS_PER_FILE,
    shuffle: bool = True,
    seed: int = 0,
    dtype: str = "float32",
    jobs: int = 1,
    executor: Any = None,
    executor_options: Mapping[str, str] | None = None,
    num_parts: int = 1,
    part: int = 0,
    skip_bad: bool = False,
    escape_keys: bool = False,
    allow_pipes: bool = False,
    path_map: Mapping[str, str] | Sequence[str] | None = None,
    path_root: str | Path | None = None,
    num_frames_files: Sequence[str | Path] | None = None,
    max_open: int = DEFAULT_MAX_OPEN,
    overwrite: bool = False,
    progress: bool = True,
    wav_scp: str | Path | Sequence[str | Path] | None = None,
    segments: str | Path | Sequence[str | Path] | None = None,
    audio_format: str = "flac",
    features: str | None = None,
    num_mel_bins: int = 80,
    resample_to: int | None = None,
    channel: int | None = None,
    manifest: str | Path | Sequence[str | Path] | None = None,
    hf: str | Path | None = None,
    split: str | None = None,
    audio_column: str | None = None,
    text_column: str | None = None,
    id_column: str | None = None,
    fields: Sequence[str] | str | None = None,
    utt2spk: str | Path | None = None,
    cmvn_scp: str | Path | None = None,
) -> PackReport:
    """Pack ``feats.scp`` file(s), or audio named by ``wav_scp`` file(s) (cut by ``segments``),
    with ``text`` file(s) into tar shards under ``d_out``; or the audio and texts of NeMo
    manifest(s) (``manifest``), or of a Hugging Face dataset (``hf``: a ``save_to_disk``
    folder, parquet or arrow files; ``split``, ``audio_column``, ``text_column``,
    ``id_column``), with no text files. ``fields`` keeps a manifest's other keys (a dataset's
    other columns) as fields ``NAME.json``.

    ``filter_group=["10:1000", "1000:2000"]`` writes utterances of ``[10, 1000)`` frames (for
    audio: seconds) to ``d_out/10_1000/`` and so on (others are dropped and counted); without it
    all go to ``d_out``. Audio is stored as FLAC when it is integer PCM and as its original bytes
    when FLAC cannot hold it exactly (MP3, Ogg, float; ``audio_format="keep"``: always the
    original bytes), or as fbank features computed now (``features="fbank"``, ``num_mel_bins``,
    ``resample_to``). ``utt2spk`` and ``cmvn_scp`` (Kaldi's) record each utterance's speaker
    and its speaker's CMVN statistics, for the loader's ``cmvn="speaker"``.
    ``executor``: where the tasks run: a ``concurrent.futures``-style executor (dask's, submitit's,
    :class:`~seqshard.prep.executors.RayExecutor`) or a name (``processes:N``, ``dask://HOST:PORT``,
    ``dask-local:N``, ``ray``, ``ray://HOST:PORT``, ``slurm``, with ``executor_options``); default
    ``jobs`` processes.
    Each folder gets ``index.json``; ``d_out/pack_report.json`` says what happened. Bad input
    raises InputError naming file, line and key, unless ``skip_bad`` (then it is counted in the
    report). See README for every option.
    """
    given = dict(locals())  # the arguments by name, before any other name is bound
    started = time.perf_counter()
    inputs = {"f_scps": f_scps, "wav_scp": wav_scp, "manifest": manifest, "hf": hf}
    text_files = _text_files(inputs, f_labels)
    _check_running(jobs, executor, num_parts, part, max_open, overwrite)
    options = _pack_options(given)
    d_out = Path(d_out)
    source = _source(inputs, segments, options, (split, audio_column, text_column, id_column), d_out)
    job = _job(source, text_files, options, _made_folder(d_out))
    digest = getattr(source, "content_hash", content_hash)  # a dataset's files are too large to read twice
    described = _describe_run(options, _identity_inputs(job), digest)
    command = "seqshard pack" + (f" (part {part} of {num_parts})" if num_parts > 1 else "")
    with FolderLock(d_out, command, shared=num_parts > 1) as lock:
        run = _claim_folder(d_out, options, described, overwrite, lock)
        return _run_tasks(job, run, given, started)


def _made_folder(d_out: Path) -> Path:
    """``d_out``, made where it is not (ConfigError when it is a file)."""
    if d_out.exists() and not d_out.is_dir():
        raise ConfigError(f"{option('d_out', d_out)}: {d_out} is a file, not a folder.")
    with writing(d_out):
        d_out.mkdir(parents=True, exist_ok=True)
    return d_out


def _run_tasks(job: PackJob, run: dict[str, Any], given: Mapping[str, Any], started: float) -> PackReport:
    """The pack's tasks run where :func:`pack_data`'s arguments ``given`` say (an executor, or
    one opened for the run), this part's; its report."""
    executor = given["executor"]
    engine = executor if executor is not None and not isinstance(executor, str) else None
    with Progress(given["progress"]) as bars, contextlib.ExitStack() as stack:
        if engine is None:
            folder = job.d_out / STATE_DIR / "submitit"
            engine = stack.enter_context(open_executor(executor, given["jobs"], given["executor_options"], folder))
        prepare = getattr(job.source, "prepare", None)
        if prepare is not None:  # a dataset's rows file: its key and text columns, read once
            prepare()
        chunks = plan_chunks(job, bars.bar)
        job = replace(with_buckets(job, chunks), run=run["fingerprint"][:16])
        waves = Waves(job, chunks, engine, bars, given["part"], given["num_parts"], given["max_open"])
        return _pack_waves(waves, run, list(job.text_files), started)


#: pack_data's arguments that are options of the pack as they are given
_OPTIONS_AS_GIVEN = (
    "fmt", "utts_per_file", "shuffle", "seed", "dtype", "skip_bad", "allow_pipes",
    "audio_format", "features", "num_mel_bins", "resample_to", "channel",
)  # fmt: skip


def _pack_options(given: Mapping[str, Any]) -> PackOptions:
    """The options among :func:`pack_data`'s arguments ``given`` that change what a pack writes."""
    num_frames_files, fields = given["num_frames_files"], given["fields"]
    return PackOptions(
        **{name: given[name] for name in _OPTIONS_AS_GIVEN},
        groups=parse_groups(given["filter_group"], seconds=given["f_scps"] is None),
        escape_keys=given["escape_keys"] or given["manifest"] is not None,  # a manifest's keys are its file names
        path_map=parse_path_map(given["path_map"]),
        path_root=str(given["path_root"]) if given["path_root"] else None,
        num_frames_files=tuple(str(p) for p in _as_paths(num_frames_files, "num_frames_files"))
        if num_frames_files
        else (),
        fields=tuple(fields.split(",") if isinstance(fields, str) else fields or ()),
        utt2spk=str(given["utt2spk"]) if given["utt2spk"] else None,
        cmvn_scp=str(given["cmvn_scp"]) if given["cmvn_scp"] else None,
    )


def _text_files(inputs: Mapping[str, Any], f_labels: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """The text files, checked against the one input given (a manifest's or a dataset's texts
    come with it)."""
    if sum(value is not None for value in inputs.values()) != 1:
        raise ConfigError(
            f"give either {option('f_scps', '...')} (features), {option('wav_scp', '...')} (audio), "
            f"{option('manifest', '...')} (NeMo manifests) or {option('hf', '...')} (a Hugging Face dataset): one input."
        )
    texts_inside = inputs["manifest"] is not None or inputs["hf"] is not None
    if texts_inside and f_labels is not None:
        raise ConfigError(
            f"{option('f_labels', '...')}: the texts come from the "
            f"{'manifest' if inputs['manifest'] is not None else 'dataset'}; leave the text files out."
        )
    if not texts_inside and f_labels is None:
        raise ConfigError(f"{option('f_labels', '...')}: give the text file(s) with the labels.")
    return [] if f_labels is None else _as_paths(f_labels, "f_labels")


def _check_running(jobs: int, executor: Any, num_parts: int, part: int, max_open: int, overwrite: bool) -> None:
    """ConfigError when where and in how many parts the pack runs do not go together."""
    check_rule("jobs", jobs)
    if overwrite and num_parts > 1:
        raise ConfigError(
            f"{option('overwrite')} cannot be combined with {option('num_parts', num_parts)} (each part would delete "
            "the others' work); empty the output folder first."
        )
    if executor is not None and jobs != 1:
        raise ConfigError(
            f"give either jobs or executor: {option('jobs', jobs)} is {option('executor', f'processes:{jobs}')}."
        )
    if jobs < 1 or num_parts < 1 or not 0 <= part < num_parts or max_open < 1:
        raise ConfigError(
            f"need jobs >= 1, max_open >= 1 and 0 <= part < num_parts (got {option('jobs', jobs)}, "
            f"{option('part', part)}, {option('num_parts', num_parts)}, {option('max_open', max_open)})."
        )


def _claim_folder(
    d_out: Path, options: PackOptions, described: dict[str, Any], overwrite: bool, lock: FolderLock
) -> dict[str, Any]:
    """``d_out``, locked, made ready for the run ``described`` (no link out of it, the previous
    pack removed with ``overwrite``, killed writers' temporaries removed, foreign files refused)
    and claimed: the run's record; then the lock shared with the pack's other parts."""
    groups = [d_out / g.name for g in options.groups]
    folders = [d_out / STATE_DIR, *groups]
    for folder in folders:
        inside(d_out, folder)  # nothing is written (or removed) through a link out of the folder
    if overwrite:
        removed = remove_previous_pack(d_out)
        _LOG.info("%s: removed %d files of the previous pack", d_out, removed)
    for folder in [d_out, *folders]:
        if folder.is_dir():
            remove_stale_temporaries(folder)
    _refuse_foreign_files(d_out, groups or [d_out], options.fmt)
    run = _claim_output(d_out, described, alone=lock.alone)
    lock.share()
    return run


def _source(
    inputs: Mapping[str, Any],
    segments: str | Path | Sequence[str | Path] | None,
    options: PackOptions,
    columns: tuple[str | None, ...],
    d_out: Path,
) -> PackSource:
    """What the pack reads: feature matrices, audio (cut by segments), NeMo manifests or a
    Hugging Face dataset (``columns``: its split, audio, text and id columns)."""
    f_scps, wav_scp = inputs["f_scps"], inputs["wav_scp"]
    if options.fields and inputs["manifest"] is None and inputs["hf"] is None:
        raise ConfigError(f"{option('fields', '...')}: for NeMo manifests and Hugging Face datasets.")
    if segments is not None and f_scps is None and wav_scp is None:
        raise ConfigError(f"{option('segments', '...')}: cuts the recordings of {option('wav_scp', '...')}.")
    if inputs["hf"] is None and any(c is not None for c in columns):
        raise ConfigError(
            f"{option('split', '...')} and the column options: for a Hugging Face dataset ({option('hf', '...')})."
        )
    if f_scps is not None:
        audio_only = [
            option(name, value)
            for name, value in (("segments", "..."), ("features", "fbank"), ("resample_to", "HZ"), ("channel", "N"))
            if getattr(options, name, None) is not None or (name == "segments" and segments is not None)
        ]
        if audio_only:
            raise ConfigError(
                f"{', '.join(audio_only)}: for audio input; give the audio with {option('wav_scp', '...')}."
            )
        return FeatureSource(_as_paths(f_scps, "f_scps"), options)
    if options.audio_format == "keep" and options.features is None:
        changes = [option(name, "...") for name in ("resample_to", "channel") if getattr(options, name) is not None]
        if changes:
            raise ConfigError(
                f"{option('audio_format', 'keep')} stores each file's original bytes, so it cannot apply "
                f"{', '.join(changes)}: use {option('audio_format', 'flac')} (lossless), or leave them out."
            )
    if inputs["manifest"] is not None:
        return ManifestSource(manifest_files(inputs["manifest"]), options)
    if inputs["hf"] is not None:
        from .hf_source import DatasetSource

        return DatasetSource(inputs["hf"], *columns, options, d_out)
    return AudioSource(
        _as_paths(wav_scp, "wav_scp"), _as_paths(segments, "segments") if segments is not None else [], options
    )


def _job(source: PackSource, text_files: list[Path], options: PackOptions, d_out: Path) -> PackJob:
    """What every task of the pack is handed (its bucket count is set once the inputs are counted)."""
    utt2spk, cmvn_scp = (
        _as_paths(path, name)[0] if path else None
        for path, name in ((options.utt2spk, "utt2spk"), (options.cmvn_scp, "cmvn_scp"))
    )
    length_files, seconds = source.length_files() if options.groups else ([], False)
    return PackJob(
        d_out=d_out,
        options=options,
        source=source,
        text_files=tuple(text_files),
        length_files=tuple(length_files),
        seconds=seconds,
        buckets=1,
        lengths_at_scan=bool(options.groups) and (not length_files or source.texts_inside),
        utt2spk=utt2spk,
        cmvn_scp=cmvn_scp,
    )


def _pack_waves(waves: Waves, run: dict[str, Any], text_files: Sequence[Path], started: float) -> PackReport:
    """Scan, plan and write this run's share; then, once every shard is finished, each
    folder's index and the report."""
    job = waves.job
    options, d_out = job.options, job.d_out
    scans = waves.scan()
    if not sum(record["lines"] for chunk, record in zip(waves.chunks, scans) if chunk.table == "utts"):
        raise InputError(
            Where(", ".join(map(str, job.source.files))),
            "empty_input",
            "the input files hold no entries.",
            "check that you gave the right feats.scp, wav.scp or segments.",
            skippable=False,
        )
    buckets = waves.buckets()
    totals = totals_of(scans, buckets, waves.chunks)
    if totals.label_issues.get("empty_label"):  # kept (a silent recording may have none), but never unannounced
        count = totals.label_issues["empty_label"]
        _LOG.warning("%s empty, packed as empty texts (first: %s)", counted(count, "label", "is"), totals.first_empty)
    orders = group_orders(buckets, max(1, len(options.groups)))
    tasks = _shard_tasks(job, orders)
    _record_plan(d_out, run, tasks, [b["digest"] for b in buckets], [g.name for g in options.groups] or [""])
    dim = job.source.dim(_first_utterances(job, waves.chunks, buckets))
    speakers = job.speakers()
    if speakers is not None and not options.skip_bad:  # before a shard is written
        try:
            speakers.check_all(dim)
        finally:
            speakers.close()
    done = finished_shards(d_out)
    todo = [t for t in tasks if _relative(t) not in done]
    if len(todo) < len(tasks):
        _LOG.info("%d of the %d shards are already finished; writing %d", len(tasks) - len(todo), len(tasks), len(todo))
    waves.write(todo, orders, dim)

    records = finished_shards(d_out)
    complete = _write_indexes(job, tasks, records, dim, text_files)
    report = _report(job, totals, tasks, records, waves.written, complete, time.perf_counter() - started, dim)
    report.resumed_utts = waves.resumed
    if complete:
        for state in (d_out / STATE_DIR).glob("partial-*.json"):  # a checkpoint that ended after its shard
            state.unlink(missing_ok=True)
        write_json_atomic(d_out / REPORT_NAME, report.to_json(), d_out)
    else:
        write_json_atomic(d_out / STATE_DIR / f"report-part{waves.part}.json", report.to_json(), d_out)
    if complete and report.packed == 0:
        reasons = ", ".join(f"{reason}={count}" for reason, count in report.dropped.items())
        raise SeqshardError(
            f"nothing was packed: all {report.input_utts} utterances were dropped ({reasons}); "
            f"see {d_out / REPORT_NAME} and the warnings above."
        )
    return report


def _shard_tasks(job: PackJob, orders: Sequence[GroupOrder]) -> list[ShardTask]:
    """Every shard of the pack: a group's order cut into runs of ``utts_per_file``."""
    tasks: list[ShardTask] = []
    per_file = job.options.utts_per_file
    for name, order in zip([g.name for g in job.options.groups] or [""], orders):
        folder = job.d_out / name if name else job.d_out
        for index in range(-(-order.size // per_file)):
            planned = min(per_file, order.size - index * per_file)
            tasks.append(ShardTask(len(tasks), name, index, folder / (job.options.fmt % index), planned))
    return tasks


def _first_utterances(job: PackJob, chunks: list[Chunk], buckets: Sequence[dict[str, Any]]) -> Iterator[Utterance]:
    """The first planned utterances, in input order (the dataset's dim is that of the first that reads)."""
    first = sorted(tuple(row) for record in buckets for row in record["first"])
    with contextlib.closing(TableLines(job, chunks)) as lines:
        for chunk, line, offset in first:
            key, value = lines.record("utts", chunk, offset, line)
            yield Utterance(key, value, lines.where(chunk, line, key))


def _as_paths(value: str | Path | Sequence[str | Path], name: str) -> list[Path]:
    paths = [Path(value)] if isinstance(value, (str, Path)) else [Path(v) for v in value]
    if not paths:
        raise ConfigError(f"{option(name, '...')}: give at least one file.")
    for path in paths:
        if path.is_dir():
            raise ConfigError(
                f"{path} is a folder; {option(name, '...')} takes files (e.g. {path / 'feats.scp'} or {path / 'text'})."
            )
        if path.exists() and not path.is_file():
            raise ConfigError(
                f"{path} is not a regular file (a pipe?): pack reads its inputs more than once; write it to a file first."
            )
        if not path.is_file():
            raise InputError(
                Where(path),
                "missing_input",
                "the file does not exist.",
                f"check {option(name, path)}.",
                skippable=False,
            )
    return paths


def parse_path_map(path_map: Mapping[str, str] | Sequence[str] | None) -> tuple[tuple[str, str], ...]:
    """``OLD=NEW`` prefix rewrites (or a mapping) as pairs."""
    if not path_map:
        return ()
    if isinstance(path_map, Mapping):
        return tuple(path_map.items())
    pairs = []
    for item in path_map:
        old, sep, new = str(item).partition("=")
        if not sep or not old:
            raise ConfigError(f"path_map {item!r}: expected 'OLD_PREFIX=NEW_PREFIX'.")
        pairs.append((old, new))
    return tuple(pairs)


def _identity_inputs(job: PackJob) -> list[Path]:
    """The files whose content decides what a pack writes (inputs, text, length files, speakers)."""
    lengths = [Path(f) for f in job.options.num_frames_files] or [
        Path(f).parent / name
        for f in job.source.files
        for name in (NUM_FRAMES_FILE, DURATIONS_FILE)
        if (Path(f).parent / name).is_file()
    ]
    speakers = [p for p in (job.utt2spk, job.cmvn_scp) if p is not None]
    return [*job.source.files, *job.text_files, *dict.fromkeys(lengths), *speakers]


def _describe_run(
    options: PackOptions, inputs: Sequence[Path], digest: Callable[[Path], str] | None = None
) -> dict[str, Any]:
    """What a pack is made from: its options and its inputs' content (not their mtimes).

    ``skip_bad`` is left out: it does not change a shard that was written without a skip, and
    what it changes in the plan is caught by comparing plans (see ``_record_plan``).
    """
    described_options = json.loads(json.dumps(asdict(options)))
    del described_options["skip_bad"]
    digest = digest or content_hash
    for name in ADDED_OPTIONS:  # unset, they change nothing: a pack begun before they existed resumes
        if described_options[name] in (None, []):
            del described_options[name]
    files = [{"path": str(p.resolve()), "bytes": p.stat().st_size, "blake2b": digest(p)} for p in inputs]
    identity = hashlib.sha256(json.dumps([described_options, [f["blake2b"] for f in files]]).encode()).hexdigest()
    return {"options": described_options, "inputs": files, "fingerprint": identity}


def content_hash(path: Path) -> str:
    """A digest of a file's bytes (identity follows content, not mtimes)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb", buffering=0) as stream:
        while chunk := stream.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _refuse_foreign_files(d_out: Path, folders: list[Path], fmt: str) -> None:
    """Refuse to write where files that no pack here wrote would be written over, or mixed
    with this pack's shards (another corpus copied into the folder)."""
    blocking = in_the_way(recorded(d_out), [f for f in folders if f.is_dir()], fmt)
    if blocking:
        shown = listed(blocking)
        raise ConfigError(
            f"{d_out} holds files that this pack would write over or mix its shards with, and that no pack here "
            f"wrote: {shown}. Fix: move them elsewhere (another corpus copied here?), or pack into a new output "
            f"folder; {option('overwrite')} removes only what an earlier pack in the folder wrote."
        )


def _claim_output(d_out: Path, described: dict[str, Any], alone: bool) -> dict[str, Any]:
    """Record what this folder is being packed from (``described``). A folder holding shards
    packed from other inputs or options is refused; one where no shard file was written yet (a
    run that failed before its first shard, or one that kept nothing) is taken over, unless
    other parts are packing into it (not ``alone``). Returns the run record."""
    run_file = d_out / STATE_DIR / RUN_FILE
    if run_file.exists():
        previous = read_json(run_file, "restore it, or pack into a new folder.", kind=dict)
        if previous.get("fingerprint") == described["fingerprint"]:
            return previous
        differences = "; ".join(_run_differences(previous, described))
        if _any_shard_written(d_out):
            raise ConfigError(
                f"{d_out} holds shards packed from other inputs or options ({differences}; see {run_file}). Use a new "
                f"output folder, or pass {option('overwrite')} to replace them (only what that pack wrote)."
                + describe_foreign(foreign_entries(recorded(d_out)))
            )
        if not alone:
            raise ConfigError(
                f"{d_out} is being packed by other parts from other inputs or options ({differences}; see {run_file}): "
                "run every part with the same inputs and options."
            )
        _LOG.info("%s: the earlier run packed no shard; starting afresh with these inputs and options", d_out)
        _forget_empty_shards(d_out)
    described = {**described, "created": _now()}
    with writing(run_file.parent):
        run_file.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_file, described, d_out)
    return described


def _run_differences(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
    found = [
        f"{key} was {previous.get('options', {}).get(key)!r}, now {value!r}"
        for key, value in current["options"].items()
        if previous.get("options", {}).get(key) != value
    ]
    before = {f["path"]: f.get("blake2b") for f in previous.get("inputs", [])}
    found += [
        f"{f['path']} changed" for f in current["inputs"] if f["path"] in before and before[f["path"]] != f["blake2b"]
    ]
    if {f["path"] for f in current["inputs"]} != set(before):
        found.append("other input files")
    return found or ["other inputs"]


def _record_plan(
    d_out: Path, run: dict[str, Any], tasks: Sequence[ShardTask], digests: Sequence[str], group_names: Sequence[str]
) -> None:
    """Check the plan against the one the finished shards were written from, then record it
    (``run.json``) and the shards it plans (``planned.json``, read by the loader and ``index``
    to name what an unfinished pack still lacks)."""
    digest = hashlib.blake2b("".join(digests).encode(), digest_size=16)
    for task in tasks:
        digest.update(f"{task.group}/{task.path.name}:{task.num_planned}\n".encode())
    if run.get("plan") not in (None, digest.hexdigest()):
        if _any_shard_written(d_out):
            raise ConfigError(
                f"{d_out} holds shards of another plan: with these options other utterances go into its shards (did "
                f"{option('skip_bad')} change which utterances are dropped?). Use a new output folder, or pass "
                f"{option('overwrite')} to replace them."
            )
        _forget_empty_shards(d_out)
    if run.get("plan") != digest.hexdigest():
        run["plan"] = digest.hexdigest()
        write_json_atomic(d_out / STATE_DIR / RUN_FILE, run, d_out)
    groups: dict[str, list[tuple[str, int]]] = {name: [] for name in group_names}
    for task in tasks:
        groups[task.group].append((task.path.name, task.num_planned))
    write_json_atomic(d_out / STATE_DIR / PLANNED_NAME, planned_record(groups), d_out)


def _any_shard_written(d_out: Path) -> bool:
    return any(shard_written(record) for record in finished_shards(d_out).values())


def _forget_empty_shards(d_out: Path) -> None:
    """Drop the journals of an earlier run that wrote no shard file: the shards they record as
    empty (every utterance dropped) were planned from other inputs or another plan."""
    for journal in [*(d_out / STATE_DIR).glob("journal-*.jsonl"), *(d_out / STATE_DIR).glob("partial-*.json")]:
        with writing(journal):
            journal.unlink()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _relative(task: ShardTask) -> str:
    return f"{task.group}/{task.path.name}" if task.group else task.path.name


def _write_indexes(
    job: PackJob, tasks: Sequence[ShardTask], records: dict[str, dict[str, Any]], dim: int, text_files: Sequence[Path]
) -> bool:
    """Write ``index.json`` in every group folder whose shards are all finished (listing those
    written: a shard whose utterances were all dropped while writing has no file)."""
    complete = True
    options, source = job.options, job.source
    facts, fields = source.facts(dim)
    for name in [g.name for g in options.groups] or [""]:
        mine = [t for t in tasks if t.group == name]
        if any(_relative(t) not in records for t in mine):
            complete = False
            continue
        folder = job.d_out / name if name else job.d_out
        folder.mkdir(parents=True, exist_ok=True)
        written = [records[_relative(t)] for t in mine if shard_written(records[_relative(t)])]
        members = dict.fromkeys(m for record in written for m in record.get("members", ()))
        index = ShardIndex(
            escaped_keys=options.escape_keys,
            fields=list(dict.fromkeys([*fields, *members])),
            shards=[ShardEntry.from_json(record) for record in written],
            feature=facts,
            created=_now(),
            created_by=f"seqshard {__version__} pack",
            source={
                source.kind: [str(p) for p in source.files],
                "text": [str(p) for p in text_files],
                "group": name,
                "shuffle": options.shuffle,
                "seed": options.seed,
                "utts_per_file": options.utts_per_file,
            },
        )
        index.save(folder)
    return complete


def _report(
    job: PackJob,
    totals: Totals,
    tasks: Sequence[ShardTask],
    records: dict[str, dict[str, Any]],
    written: list[ShardTask],
    complete: bool,
    wall: float,
    dim: int,
) -> PackReport:
    options = job.options
    mine = [records[_relative(t)] for t in tasks if _relative(t) in records]
    groups, skipped, histogram, audio_stored = summarize_records(mine)
    dropped = dict(totals.dropped)
    for reason, count in skipped.items():
        dropped[reason] = dropped.get(reason, 0) + count
    written_now = [
        records[_relative(t)] for t in written if _relative(t) in records and shard_written(records[_relative(t)])
    ]
    packed = sum(g.utts for g in groups.values())
    frames = sum(g.frames for g in groups.values())
    return PackReport(
        output=str(job.d_out),
        complete=complete,
        input_utts=totals.input_utts,
        packed=packed,
        dropped=dict(sorted((reason, count) for reason, count in dropped.items() if count)),
        label_issues=dict(sorted(totals.label_issues.items())),
        frames_file_issues=dict(sorted(totals.frames_file_issues.items())),
        num_labels=totals.num_labels,
        groups={name: groups.get(name) or GroupTotals() for name in [g.name for g in options.groups] or [""]},
        shards_total=len(tasks),
        shards_done=len(mine),
        shards_empty=sum(not shard_written(record) for record in mine),
        audio_stored=audio_stored,
        shards_written_now=len(written_now),
        bytes_written_now=sum(r["bytes"] for r in written_now),
        wall_seconds=wall,
        dim=dim,
        dtype=options.dtype if dim or job.source.kind == "features" else f"audio ({options.audio_format})",
        float16_saved_bytes=frames * dim * 2 if options.dtype == "float16" else 0,
        length_hist=histogram,
    )
