"""``seqshard index``: build or rebuild ``index.json`` for folders of shards.

For a folder written by ``seqshard pack`` (also one packed in parts on several machines) the
pack journal already describes each finished shard; shards it does not describe, and shards
made by other tools, are read in full. A NeMo tarred set's index comes from its manifest
(entries per tar, lengths from their durations: ``formats/peers/nemo_tarred.py``).

Sidecars of ``add-field`` in the old layout (``data-00042.NAME.tar`` beside the shard, which
globs of the shards select) are moved to ``fields/NAME/data-00042.tar`` on request: each gets
its new name as a second link, the index naming the new names is saved, and only then are the
old names removed, so a run killed at any point leaves an index whose files all exist (run
it again to finish).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from ..checks import read_number, shown
from ..errors import ConfigError, SeqshardError, ShardError, counted, listed
from ..formats.files import inside, read_json, remove_stale_temporaries, writing
from ..formats.index import ShardIndex
from ..formats.index_entries import MAX_DIM, FieldSet, ShardEntry, SidecarEntry, sidecar_name
from ..formats.lock import FolderLocks, refuse_if_held
from ..formats.members import load_table
from ..formats.pack_state import STATE_DIR, pack_root, planned_shards
from ..formats.patterns import (
    FIELD_SET_NAME,
    FIELDS_DIR,
    SHARD_SUFFIXES,
    old_layout_sidecar,
    shard_subfolders,
    shards_in_folder,
)
from ..formats.peers.nemo_tarred import nemo_index
from ..formats.peers.shar import is_shar_folder
from ..formats.selection import dangling_shard_links, is_sidecar
from ..formats.tar import member_table
from ..prep.inputs import FEATURE_MEMBER, pack_facts
from ..prep.job import PackOptions
from ..prep.journal import finished_shards
from .parallel import map_shards
from .scan import ShardScan, scan_shard

_LOG = logging.getLogger("seqshard")


def shard_folders(root: Path) -> list[Path]:
    """``root`` and its direct sub-folders that hold shard files."""
    return [f for f in [root, *shard_subfolders(root)] if shards_in_folder(f)]


def rebuild_index(root: str | Path, jobs: int = 1, progress: bool = True, move_sidecars: bool = False) -> list[Path]:
    """Write ``index.json`` in ``root`` and in each sub-folder of it that holds shards;
    ``move_sidecars`` moves sidecars of the old layout to the new one (module docstring)."""
    if "://" in str(root):
        raise ConfigError(
            f"{root}: `seqshard index` writes index.json beside the shards, so it needs a local folder: run it on a "
            "local copy (or a mounted bucket) and upload the index.json it writes."
        )
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder.")
    if is_shar_folder(root):
        raise ConfigError(
            f"{root} is a Lhotse Shar folder: seqshard reads what it holds from its cuts files and needs no "
            f"index.json (`seqshard inspect {root}` shows it)."
        )
    nemo = nemo_index(root)
    if nemo is not None:  # counts and lengths are the manifest's (its durations), as NeMo reads them
        missing = [entry.name for entry in nemo.shards if not (root / entry.name).is_file()]
        if missing:
            raise ConfigError(
                f"{root}: the NeMo manifest has entries of {counted(len(missing), 'tar')} the folder lacks "
                f"({listed(missing)}): restore them, or remove their entries "
                "from the manifest."
            )
        nemo.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        nemo.created_by = f"seqshard {__version__} index (a NeMo tarred set's manifest)"
        with FolderLocks([root], "seqshard index"):
            return [nemo.save(root)]
    folders = shard_folders(root)
    if not folders:
        refuse_if_held(root, "seqshard index")
        raise ConfigError(f"{root} holds no shard files ({', '.join(SHARD_SUFFIXES)}), nor do its sub-folders.")
    for folder in folders:
        inside(root, folder)  # nothing is written through a link out of the folder
        dangling = dangling_shard_links(folder)
        if dangling:  # an index without them would hide those shards for good
            raise ConfigError(
                f"{folder}: {counted(len(dangling), 'link')} named like a shard point at nothing "
                f"({listed([f'{p.name} -> {os.readlink(p)}' for p in dangling])}): mount or restore what they point "
                "at, or remove the links, then index again."
            )
    with FolderLocks([root, *folders, *filter(None, [pack_root(root)])], "seqshard index"):
        return _rebuild(root, folders, jobs, progress, move_sidecars)


def _rebuild(root: Path, folders: list[Path], jobs: int, progress: bool, move_sidecars: bool) -> list[Path]:
    """:func:`rebuild_index` once its folders are locked."""
    for folder in folders:  # what killed writers left (this one holds the folders alone)
        for written in [folder, *(folder / FIELDS_DIR).glob("*")]:
            remove_stale_temporaries(inside(root, written), older_than=0)
    journal = finished_shards(root) if (root / STATE_DIR).is_dir() else {}
    _refuse_unfinished_pack(root, journal)
    run = _pack_run(root)
    return [_index_folder(root, folder, journal, run, jobs, progress, move_sidecars) for folder in folders]


def _index_folder(
    root: Path, folder: Path, journal: dict, run: dict | None, jobs: int, progress: bool, move_sidecars: bool
) -> Path:
    """Write ``folder``'s index.json from the pack journal's records and scans of the shards
    it does not describe; its path."""
    previous = _previous_index(folder)
    old_sidecars = _old_layout_sidecars(folder, previous)
    if move_sidecars:
        _link_new_names(folder, old_sidecars, previous)
    elif old_sidecars:
        _LOG.warning(
            "%s: %s in the old layout of add-field (e.g. %s), which globs of the shards such as "
            "data-*.tar select (WebDataset readers take them for shards); `seqshard index --move-sidecars %s` "
            "moves them to fields/NAME/",
            folder,
            counted(len(old_sidecars), "sidecar", "is"),
            old_sidecars[0][0].name,
            root,
        )
    found_old = {path.name for path, _, _ in old_sidecars}  # judged once (on their keys) just above
    listed = previous.sidecar_names() if previous else None
    shards = [
        s
        for s in shards_in_folder(folder)
        if s.name not in found_old and (old_layout_sidecar(s) is not None or not is_sidecar(s, previous, listed))
    ]
    prefix = "" if folder == root else f"{folder.name}/"
    entries, feature, fields = _described(folder, shards, journal, run, prefix, previous, jobs, progress)
    feature.setdefault("field", FEATURE_MEMBER if journal else None)
    feature.setdefault("frame_shift_ms", 10.0)
    if feature["field"] is None:
        _LOG.warning(
            "%s: the shards hold no feature field (.npy array) and no audio: frame counts and hours are unknown",
            folder,
        )
    field_sets = _keep_field_sets(folder, previous, entries) if previous else _found_field_sets(root, folder, entries)
    index = ShardIndex(
        shards=[entries[s.name] for s in shards],
        feature=feature,
        fields=list(fields),
        field_sets=field_sets,
        escaped_keys=previous.escaped_keys if previous else bool((run or {}).get("escape_keys", False)),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        created_by=f"seqshard {__version__} index",
        source={
            **(previous.source if previous else {}),
            "rebuilt_from": "pack journal and shards" if journal else "shards",
            **({"pack": run} if run else {}),
        },
    )
    written = index.save(folder)
    if move_sidecars:  # the index names the new names only now
        for path, _, _ in old_sidecars:
            path.unlink(missing_ok=True)
    return written


def _described(
    folder: Path,
    shards: list[Path],
    journal: dict,
    run: dict | None,
    prefix: str,
    previous: ShardIndex | None,
    jobs: int,
    progress: bool,
) -> tuple[dict[str, ShardEntry], dict, dict[str, None]]:
    """Each shard's entry (the journal's record, else a scan of it), the feature and the
    fields they hold (added to the previous index's)."""
    entries: dict[str, ShardEntry] = {}
    feature: dict = dict(previous.feature) if previous else {}
    fields: dict[str, None] = dict.fromkeys(previous.fields if previous else [])
    to_scan = []
    for shard in shards:
        record = journal.get(prefix + shard.name)
        if record is not None:
            _ensure_table(shard)
            entries[shard.name] = ShardEntry.from_json(record)
            facts, packed = _packed_facts(record, run)
            for name, value in facts.items():
                feature.setdefault(name, value)
            fields.update(dict.fromkeys([*packed, *record.get("members", ())]))
        else:
            to_scan.append(shard)
    for shard, scan in zip(to_scan, map_shards(scan_shard, to_scan, jobs, f"index {folder}", progress)):
        if scan.problems:
            raise ConfigError(f"{shard} is damaged, not indexing it: {'; '.join(scan.problems)}")
        if scan.table is not None:
            scan.table.save(shard)
        entries[shard.name] = scan.entry
        fields.update(dict.fromkeys(scan.fields))
        if scan.audio:  # lengths are durations in 10 ms frames, as a pack of audio records
            feature.setdefault("field", "audio")
            feature.setdefault("kind", "audio")
        elif scan.feature_field:
            feature.setdefault("field", scan.feature_field)
            feature.setdefault("dim", scan.dim)
            feature.setdefault("dtype", scan.dtype)
    return entries, feature, fields


def _packed_facts(record: dict, run: dict | None) -> tuple[dict, list[str]]:
    """The dataset facts and fields ``seqshard pack`` wrote for the shard of a journal record:
    features of its dim, or (dim 0) the audio stored as its options say."""
    try:
        dim = read_number("its feature dim", record.get("dim"), whole=True, at_least=0, at_most=MAX_DIM)
        members = record.get("members", [])
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise ValueError(f"its members are {shown(members)}, not a list of names")
    except ValueError as error:
        raise ConfigError(
            f"{record.get('name')!r} in the pack journal: {error}: the journal was not written by seqshard, or was "
            "altered. Fix: pack again into a new folder."
        ) from None
    return pack_facts(int(dim or 0), {**asdict(PackOptions()), "dtype": record.get("dtype"), **(run or {})})


def _ensure_table(shard: Path) -> None:
    """Give a shard the journal describes the member table its headers give, unless it has it
    (the packer writes one with each shard; a shard edited since gets a new one)."""
    if not shard.name.endswith(".tar"):
        return
    try:
        table = member_table(shard)
    except ShardError as error:
        raise ConfigError(f"{shard} is damaged, not indexing it: {error}") from None
    try:
        stored = load_table(shard)
    except ShardError:
        stored = None
    if stored is None or not stored.same_as(table):
        table.save(shard)


def _old_layout_sidecars(folder: Path, previous: ShardIndex | None) -> list[tuple[Path, str, str]]:
    """``(file, shard name, field set)`` of each sidecar in the old layout in ``folder`` (on
    evidence: ``selection.is_sidecar``)."""
    found = ((path, old_layout_sidecar(path)) for path in sorted(folder.glob("*.tar")))
    listed = previous.sidecar_names() if previous else None
    return [(path, *names) for path, names in found if names is not None and is_sidecar(path, previous, listed)]


def _link_new_names(folder: Path, old: list[tuple[Path, str, str]], previous: ShardIndex | None) -> None:
    """Give each old-layout sidecar its new name too, and point ``previous``'s entries there."""
    for path, shard, field_set in old:
        new = inside(folder, folder / sidecar_name(shard, field_set))
        with writing(new):
            new.parent.mkdir(parents=True, exist_ok=True)
            if new.exists():
                if not os.path.samefile(path, new):
                    raise ConfigError(
                        f"{path} and {new} are both sidecars of field set {field_set!r} of {shard}: delete the one "
                        "that is not current (`seqshard verify` names one that differs from the index), then run again."
                    )
                continue
            try:
                os.link(path, new)
            except OSError:  # no hard links on this file system: rename (a killed run is finished by a rerun)
                os.replace(path, new)
    for entry in previous.shards if previous else []:
        for field_set, car in entry.sidecars.items():
            if (folder / sidecar_name(entry.name, field_set)).is_file():
                car.name = sidecar_name(entry.name, field_set)


def _keep_field_sets(folder: Path, previous: ShardIndex | None, entries: dict[str, ShardEntry]) -> dict[str, FieldSet]:
    """The field sets of the index being replaced, with each sidecar measured again."""
    if previous is None:
        return {}
    for name in previous.field_sets:
        for shard_name, entry in entries.items():
            old = previous.entry(shard_name)
            car = old.sidecars.get(name) if old else None
            if car is None or not (folder / car.name).is_file():
                raise ConfigError(
                    f"{folder / shard_name} has no file for field set {name!r}; add the field again with "
                    f"`seqshard add-field {folder} --name {name} --overwrite ...`."
                )
            entry.sidecars[name], _ = _measured_sidecar(folder, car.name)
    return dict(previous.field_sets)


def _found_field_sets(root: Path, folder: Path, entries: dict[str, ShardEntry]) -> dict[str, FieldSet]:
    """The field sets in ``folder``'s ``fields/NAME/`` when no index names them (it was lost):
    each sidecar measured; a set's fields from its members, its layout from add-field's
    journal; a shard without its sidecar (or with fewer samples) makes the set allow missing."""
    found: dict[str, FieldSet] = {}
    directories = sorted((folder / FIELDS_DIR).iterdir()) if (folder / FIELDS_DIR).is_dir() else []
    for directory in directories:
        name = directory.name
        if not directory.is_dir() or not FIELD_SET_NAME.fullmatch(name):
            continue
        suffixes: dict[str, None] = {}
        missing = False
        for shard_name, entry in entries.items():
            if not (folder / sidecar_name(shard_name, name)).is_file():
                missing = True
                continue
            entry.sidecars[name], scan = _measured_sidecar(folder, sidecar_name(shard_name, name))
            suffixes.update(dict.fromkeys(scan.fields))
            missing |= scan.entry.num_utts < entry.num_utts
        if not suffixes:
            continue
        records = finished_shards(root, f"field-{name}") if (root / STATE_DIR).is_dir() else {}
        layout = next((r["layout"] for r in records.values() if r.get("layout")), {})
        digest = next((r["source"] for r in records.values() if r.get("source")), "")  # adding it again: nothing to do
        facts = {"fields": list(suffixes), "source": f"{FIELDS_DIR}/{name}", "allow_missing": missing}
        try:
            found[name] = FieldSet.from_json({**facts, "digest": digest, "layout": layout})
        except ValueError as error:
            raise ConfigError(f"{root / STATE_DIR}: add-field's journal of field set {name!r}: {error}") from None
        _LOG.warning("%s: field set %r found in %s/%s/ and indexed again", folder, name, FIELDS_DIR, name)
    return found


def _measured_sidecar(folder: Path, name: str) -> tuple[SidecarEntry, ShardScan]:
    """Sidecar ``name`` in ``folder`` read in full (its member table saved): its index entry
    and its scan; ConfigError when it is damaged."""
    scan = scan_shard(folder / name)
    if scan.problems:
        raise ConfigError(f"{folder / name} is damaged, not indexing it: {'; '.join(scan.problems)}")
    if scan.table is not None:
        scan.table.save(folder / name, folder)
    measured = scan.entry
    return SidecarEntry(name, measured.bytes, measured.checksum, measured.first_key, measured.last_key), scan


def _refuse_unfinished_pack(root: Path, journal: dict[str, dict]) -> None:
    """An index of a pack whose parts have not all finished would make loaders read part of
    the data as if it were all of it: refuse, naming the shards still to be written (a shard
    the journal records as empty, every utterance dropped while writing, has no file)."""
    planned = planned_shards(root)
    if planned is None:
        return
    absent = [
        (root / group / name if group else root / name)
        for group, shards in planned.items()
        for name in shards
        if not (root / group / name if group else root / name).is_file()
        and (f"{group}/{name}" if group else name) not in journal
    ]
    if absent:
        total = sum(len(shards) for shards in planned.values())
        shown = listed(absent)
        raise ConfigError(
            f"the pack in {root} is unfinished: {len(absent)} of its {total} planned shards are not written yet ({shown}). "
            "Fix: run the pack command of the missing part(s) again (with the same --num-parts and --part); the last "
            "part to finish writes the indexes itself."
        )


def _previous_index(folder: Path) -> ShardIndex | None:
    """The index being replaced, if it can be read (its dataset facts are kept)."""
    try:
        return ShardIndex.load(folder)
    except SeqshardError:
        return None


def _pack_run(root: Path) -> dict | None:
    """The options the pack in ``root`` recorded (whether it escaped keys, ...), or None when
    none was recorded; ConfigError naming the file when it cannot be read."""
    run_file = root / STATE_DIR / "run.json"
    if not run_file.is_file():
        return None
    try:
        options = read_json(run_file, "restore it, or pack again into a new folder.", kind=dict).get("options")
        if not isinstance(options, dict) or not isinstance(options.get("escape_keys", False), bool):
            raise ValueError("its options are not the pack's")
        _check_fact_options(options)
    except (OSError, ValueError, RecursionError, AttributeError) as error:
        raise ConfigError(
            f"{run_file}: unreadable ({str(error)[:200]}): it says how the pack stored keys, which the index must "
            "record. Fix: restore it, or pack again into a new folder."
        ) from None
    return options


def _check_fact_options(options: dict) -> None:
    """ValueError unless the options that index.json records (``pack_facts``) are a pack's."""
    try:
        PackOptions(**{name: options[name] for name in ("dtype", "audio_format", "features") if name in options})
    except ConfigError as error:
        raise ValueError(str(error)) from None
    read_number("its resample_to", options.get("resample_to"), optional=True, whole=True, above=0)
