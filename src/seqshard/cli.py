"""The ``seqshard`` command: pack, inspect, verify, index, add-field, binarize, cmvn, calibrate, config, demo."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__
from .errors import SeqshardError, command_line_flags, counted

# Python parameter names whose command-line flag is spelled differently (messages name the flag).
RENAMED_FLAGS = {
    "f_scps": "--scp",
    "wav_scp": "--wav-scp",
    "f_labels": "--text",
    "d_out": "--out",
    "num_frames_files": "--num-frames",
    "source": "--from",
    "append_eos": "--no-eos",
}


def _pack(args: argparse.Namespace) -> int:
    from .prep.executors import parse_settings
    from .prep.pack import pack_data

    report = pack_data(
        args.scp,
        args.text,
        args.out,
        fmt=args.fmt,
        filter_group=args.filter_group,
        utts_per_file=args.utts_per_file,
        shuffle=not args.no_shuffle,
        seed=args.seed,
        dtype=args.dtype,
        jobs=args.jobs,
        executor=args.executor,
        executor_options=parse_settings(args.executor_option),
        num_parts=args.num_parts,
        part=args.part,
        skip_bad=args.skip_bad,
        escape_keys=args.escape_keys,
        allow_pipes=args.allow_pipes,
        path_map=args.path_map,
        path_root=args.path_root,
        num_frames_files=args.num_frames,
        max_open=args.max_open,
        overwrite=args.overwrite,
        progress=not args.quiet,
        wav_scp=args.wav_scp,
        segments=args.segments,
        audio_format=args.audio_format,
        features=args.features,
        num_mel_bins=args.num_mel_bins,
        resample_to=args.resample_to,
        channel=args.channel,
        manifest=args.manifest,
        hf=args.hf,
        split=args.split,
        audio_column=args.audio_column,
        text_column=args.text_column,
        id_column=args.id_column,
        fields=args.fields,
        utt2spk=args.utt2spk,
        cmvn_scp=args.cmvn_scp,
    )
    print(json.dumps(report.to_json(), indent=1) if args.json else report.format_text())
    return 0


def _add_field(args: argparse.Namespace) -> int:
    from .prep.add_field import add_field
    from .prep.pack import parse_path_map

    report = add_field(
        args.folder,
        args.name,
        args.source,
        kind=args.format,
        allow_missing=args.allow_missing,
        overwrite=args.overwrite,
        jobs=args.jobs,
        path_root=args.path_root,
        path_map=parse_path_map(args.path_map),
        allow_pipes=args.allow_pipes,
        progress=not args.quiet,
    )
    print(json.dumps(report.to_json(), indent=1) if args.json else report.format_text())
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .tools.inspect import format_text, plot_lengths, summarize, to_json

    summary = to_json(summarize(args.patterns, jobs=args.jobs, progress=not args.quiet))
    print(json.dumps(summary, indent=1) if args.json else format_text(summary))
    if args.plot:
        plot_lengths(summary, args.plot)
        print(f"length histogram written to {args.plot}", file=sys.stderr)
    problems = [
        f"{counted(len(summary[name]), 'selected shard', 'is')} {what}"
        for name, what in (("missing_shards", "missing"), ("damaged_shards", "damaged or cut short"))
        if summary[name]
    ]
    if problems:
        print(f"seqshard inspect: {'; '.join(problems)}: the counts are incomplete", file=sys.stderr)
        return 1
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .tools.verify import format_result, verify

    result = verify(args.patterns, jobs=args.jobs, progress=not args.quiet)
    print(format_result(result))
    return 0 if result.ok else 1


def _index(args: argparse.Namespace) -> int:
    from .tools.reindex import rebuild_index

    written = rebuild_index(args.folder, jobs=args.jobs, progress=not args.quiet, move_sidecars=args.move_sidecars)
    for path in written:
        print(f"wrote {path}")
    return 0


def _binarize(args: argparse.Namespace) -> int:
    from .prep.binarize import binarize

    report = binarize(
        args.input,
        args.out,
        args.tokenizer,
        dictionary=args.dictionary,
        layout=args.layout,
        jobs=args.jobs,
        append_eos=not args.no_eos,
        eos_id=args.eos_id,
        split=args.split,
        progress=not args.quiet,
    )
    print(json.dumps(report.to_json(), indent=1) if args.json else report.format_text())
    return 0


def _cmvn(args: argparse.Namespace) -> int:
    from .tools.cmvn import compute_cmvn, write_cmvn

    options = {"features": args.features, "skip_bad": args.skip_bad, "num_workers": args.workers}
    if args.features:
        options.update(num_mel_bins=args.num_mel_bins, resample_to=args.resample_to, channel=args.channel)
    stats = compute_cmvn(args.patterns, max_utts=args.max_utts, **options)
    write_cmvn(stats, args.out)
    dropped = sum(stats.dropped.values())
    print(
        f"wrote {args.out}: mean and std of {counted(len(stats.mean), 'dimension')} over "
        f"{counted(stats.utterances, 'utterance')} ({counted(stats.frames, 'frame')})"
        + (f"; {dropped} skipped as bad ({stats.dropped})" if dropped else "")
    )
    if stats.floored:
        print(f"seqshard cmvn: {counted(stats.floored, 'dimension', 'is')} constant; std set to 1e-5", file=sys.stderr)
    if stats.non_finite_frames:
        print(
            f"seqshard cmvn: {counted(stats.non_finite_frames, 'frame')} of {counted(stats.non_finite_utterances, 'utterance')} "
            f"hold NaN or infinity and are left out of the statistics (first: {', '.join(stats.non_finite_keys)}); the "
            "loader's check_finite=True drops such utterances in training",
            file=sys.stderr,
        )
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from .tools.calibrate import HEADER, calibrate

    if args.max_memory is not None and args.memory_fraction is not None:
        print("seqshard calibrate: error: give --memory-fraction or --max-memory, not both", file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())  # --step names a module of the working folder, as `python -m` finds it
    print(HEADER, flush=True)
    calibrate(
        args.patterns,
        args.step,
        out=args.out,
        device=args.device,
        memory_fraction=args.memory_fraction,
        max_memory=args.max_memory,
        buckets=args.buckets,
        dim=args.dim,
        vocab_size=args.vocab_size,
        max_batch_size=args.max_batch_size,
        max_step_seconds=args.max_step_seconds,
        time_limit=args.time_limit,
        report=lambda line: print(line, flush=True),
    )
    print(f"wrote {args.out}: make_loader(..., budgets={args.out!r}) cuts each bucket's batches under its budget")
    return 0


def _config(args: argparse.Namespace) -> int:
    from .app.config import check_data, explain

    if args.explain:
        print(explain(args.file))
    else:
        check_data(args.file)
        print(f"{args.file}: OK (seqshard config --explain {args.file} shows every setting)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .app.demo import run_demo

    run_demo(args.out, num_utts=args.utts, num_workers=args.workers, train_epochs=args.train_epochs)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seqshard",
        description="Pack Kaldi-style speech data into indexed tar shards and stream them into PyTorch training.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"seqshard {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (skips, resumed shards, planning)")
    # options spelled in full only: a prefix (--utts-per-fil) that one day matches a second option must not
    # silently change meaning, and a typo must not pass for an option
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False)
    )
    for add in (
        _pack_command,
        _add_field_command,
        _inspect_command,
        _verify_command,
        _index_command,
        _binarize_command,
        _cmvn_command,
        _calibrate_command,
        _config_command,
        _demo_command,
    ):
        add(commands)
    return parser


def _pack_command(commands: Any) -> None:
    pack = commands.add_parser("pack", help="pack feats.scp + text into shuffled, indexed tar shards")
    _pack_inputs(pack)
    _pack_layout(pack)
    _pack_running(pack)
    _pack_reading(pack)
    pack.add_argument("--max-open", type=int, default=256, help="shards written at once per job (default: %(default)s)")
    pack.add_argument(
        "--overwrite", action="store_true", help="replace a pack made in --out from other inputs or options"
    )
    pack.add_argument("--json", action="store_true", help="print the report as JSON")
    pack.add_argument("--quiet", action="store_true", help="no progress bars")
    pack.set_defaults(run=_pack)


def _pack_inputs(pack: argparse.ArgumentParser) -> None:
    """The pack command's options of what is packed: Kaldi tables, audio (and fbank made
    from it), NeMo manifests, Hugging Face datasets."""
    pack.add_argument("--scp", nargs="+", action="extend", help="Kaldi feats.scp file(s); repeat or list several")
    pack.add_argument("--wav-scp", nargs="+", action="extend", help="Kaldi wav.scp file(s) of audio, instead of --scp")
    pack.add_argument(
        "--segments", nargs="+", action="extend", help="Kaldi segments file(s) cutting the wav.scp's recordings"
    )
    pack.add_argument(
        "--audio-format",
        choices=["flac", "keep"],
        default="flac",
        help="flac: integer PCM as FLAC, lossy (MP3, Ogg) and float audio as its original bytes; keep: all as "
        "their original bytes (default: %(default)s)",
    )
    pack.add_argument("--features", choices=["fbank"], help="store Kaldi-compatible fbank computed from the audio")
    pack.add_argument("--num-mel-bins", type=int, default=80, help="fbank mel bins (default: %(default)s)")
    pack.add_argument("--resample-to", type=int, metavar="HZ", help="resample audio to this rate for fbank")
    pack.add_argument("--channel", type=int, help="keep this channel of multi-channel audio (default: mix down)")
    pack.add_argument(
        "--manifest",
        nargs="+",
        action="extend",
        help="NeMo manifest(s), instead of --scp/--wav-scp and --text (braces and NeMo's _OP_/_CL_ expand)",
    )
    pack.add_argument(
        "--hf", metavar="PATH", help="a Hugging Face dataset: save_to_disk folder, parquet or arrow file(s) or a glob"
    )
    pack.add_argument("--split", help="the dataset's split (default: its only one, else train)")
    pack.add_argument("--audio-column", help="the dataset's audio column (default: the first audio column)")
    pack.add_argument("--text-column", help="the text column (default: text, sentence, transcript, ...)")
    pack.add_argument("--id-column", help="the key column (default: id when there is one, else row numbers)")
    pack.add_argument("--fields", metavar="A,B", help="keep these manifest keys (dataset columns) as fields NAME.json")
    pack.add_argument("--text", nargs="+", action="extend", help="Kaldi text file(s): 'UTT-ID label words'")


def _pack_layout(pack: argparse.ArgumentParser) -> None:
    """The pack command's options of where and how the shards are written."""
    pack.add_argument("--out", required=True, help="output folder")
    pack.add_argument("--fmt", default="data-%05d.tar", help="shard file name pattern (default: %(default)s)")
    pack.add_argument(
        "--filter-group",
        action="append",
        metavar="LOW:HIGH",
        help="length group in frames (seconds for audio), [LOW, HIGH); repeat for several sub-folders LOW_HIGH/",
    )
    pack.add_argument("--utts-per-file", type=int, default=2000, help="utterances per shard (default: %(default)s)")
    pack.add_argument("--seed", type=int, default=0, help="seed of the global shuffle (default: %(default)s)")
    pack.add_argument("--no-shuffle", action="store_true", help="keep input order (shards then follow the scp's order)")
    pack.add_argument(
        "--dtype",
        choices=["float32", "float16"],
        default="float32",
        help="stored feature type; float16 halves the IO (default: %(default)s, lossless)",
    )


def _pack_running(pack: argparse.ArgumentParser) -> None:
    """The pack command's options of where the pack runs, in how many parts."""
    pack.add_argument(
        "--jobs", type=int, default=1, help="processes on this machine (--executor processes:N; default: %(default)s)"
    )
    pack.add_argument(
        "--executor",
        metavar="ENGINE",
        help="where the tasks run: processes:N, dask://HOST:PORT, dask-local:N, ray, ray://HOST:PORT or slurm",
    )
    pack.add_argument(
        "--executor-option",
        action="append",
        metavar="KEY=VALUE",
        help="a setting of the engine (e.g. slurm_partition=cpu, timeout_min=120, mem_gb=16); repeat for several",
    )
    pack.add_argument(
        "--num-parts", type=int, default=1, help="split the pack into this many parts (e.g. a Slurm array)"
    )
    pack.add_argument("--part", type=int, default=0, help="which part this run packs, 0-based")


def _pack_reading(pack: argparse.ArgumentParser) -> None:
    """The pack command's options of how the inputs are read: bad utterances, keys,
    commands, paths, lengths, speakers."""
    pack.add_argument(
        "--skip-bad", action="store_true", help="skip and count bad utterances instead of stopping at the first"
    )
    pack.add_argument(
        "--escape-keys", action="store_true", help="percent-encode '.', '/' and '%%' in keys instead of refusing them"
    )
    pack.add_argument(
        "--allow-pipes", action="store_true", help="run shell commands found in the scp ('cmd |' entries)"
    )
    pack.add_argument(
        "--path-map",
        action="append",
        metavar="OLD=NEW",
        help="rewrite ark path prefix OLD to NEW (data dirs made on another machine)",
    )
    pack.add_argument(
        "--path-root", help="take relative ark paths from this folder (default: the current folder, as Kaldi does)"
    )
    pack.add_argument(
        "--num-frames",
        action="append",
        metavar="FILE",
        help="utt2num_frames file(s); default: utt2num_frames next to each scp, else matrix headers",
    )
    pack.add_argument("--utt2spk", help="Kaldi utt2spk: record each utterance's speaker (field spk)")
    pack.add_argument(
        "--cmvn-scp",
        help="Kaldi cmvn.scp (by speaker with --utt2spk, else by utterance): record each utterance's CMVN statistics "
        "(field cmvn) for make_loader(cmvn='speaker')",
    )


def _add_field_command(commands: Any) -> None:
    add_field = commands.add_parser(
        "add-field", help="add a field (alignments, speaker labels, ...) to packed shards as sidecar shards"
    )
    add_field.add_argument("folder", help="the pack's output folder (its sub-folders with index.json are done too)")
    add_field.add_argument("--name", required=True, help="the field's name (letters, digits, '_'), e.g. ali")
    add_field.add_argument(
        "--from",
        dest="source",
        nargs="+",
        required=True,
        metavar="SOURCE",
        help='Kaldi scp (matrices or vectors), text-style file (KEY value...), or JSON lines ({"key": ...})',
    )
    add_field.add_argument("--format", choices=["scp", "text", "jsonl"], help="the source's kind (default: by suffix)")
    add_field.add_argument(
        "--allow-missing", action="store_true", help="samples whose key the source lacks get no such field"
    )
    add_field.add_argument("--overwrite", action="store_true", help="replace a field set of this name")
    add_field.add_argument("--jobs", type=int, default=1, help="processes writing sidecars (default: %(default)s)")
    add_field.add_argument("--path-root", help="take relative ark paths of an scp from this folder")
    add_field.add_argument("--path-map", action="append", metavar="OLD=NEW", help="rewrite ark path prefixes")
    add_field.add_argument("--allow-pipes", action="store_true", help="run shell commands found in the scp")
    add_field.add_argument("--json", action="store_true", help="print the report as JSON")
    add_field.add_argument("--quiet", action="store_true", help="no progress bars")
    add_field.set_defaults(run=_add_field)


def _inspect_command(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="counts, hours and length percentiles of shards; exit 1 if a selected shard is missing or damaged",
        description="Counts, hours and length percentiles of shards, from their index.json (unindexed shards are "
        "read). Exit status: 0 when every selected shard is there and reads cleanly; 1 when a selected shard is "
        "missing or an unindexed shard is damaged or cut short (what could be read is still printed, marked "
        "MISSING / DAMAGED / INCOMPLETE; `seqshard verify` checks indexed shards fully).",
    )
    inspect.add_argument(
        "patterns", nargs="+", help="shard patterns, e.g. 'data/{10_1000,1000_2000}/data-*.tar' or a folder"
    )
    inspect.add_argument(
        "--json", action="store_true", help="print JSON (num_utts, num_frames, num_shards, hours, ...)"
    )
    inspect.add_argument("--plot", metavar="PNG", help="write a histogram of utterance lengths")
    inspect.add_argument("--jobs", type=int, default=1, help="processes for reading unindexed shards")
    inspect.add_argument("--quiet", action="store_true", help="no progress bars")
    inspect.set_defaults(run=_inspect)


def _verify_command(commands: Any) -> None:
    verify = commands.add_parser(
        "verify", help="read shards fully and check them against their index; exit 1 if any is damaged"
    )
    verify.add_argument("patterns", nargs="+", help="shard patterns or folders")
    verify.add_argument("--jobs", type=int, default=1, help="processes reading shards")
    verify.add_argument("--quiet", action="store_true", help="no progress bars")
    verify.set_defaults(run=_verify)


def _index_command(commands: Any) -> None:
    index = commands.add_parser(
        "index", help="build index.json for a folder of shards (merges a pack's parts; reads foreign shards)"
    )
    index.add_argument("folder", help="the folder (its sub-folders with shards are indexed too)")
    index.add_argument("--jobs", type=int, default=1, help="processes reading shards")
    index.add_argument(
        "--move-sidecars",
        action="store_true",
        help="move add-field sidecars of the old layout (data-00042.NAME.tar) to fields/NAME/data-00042.tar",
    )
    index.add_argument("--quiet", action="store_true", help="no progress bars")
    index.set_defaults(run=_index)


def _binarize_command(commands: Any) -> None:
    binarize = commands.add_parser(
        "binarize",
        help="tokenize a text file (a sentence per line) into PREFIX.bin/.idx (Megatron's or fairseq's mmap layout)",
    )
    binarize.add_argument("--in", dest="input", required=True, help="the text file, UTF-8, one sentence per line")
    binarize.add_argument(
        "--out", required=True, help="output prefix: writes PREFIX.bin, PREFIX.idx and PREFIX.json (the ids used)"
    )
    binarize.add_argument(
        "--tokenizer",
        help="a SentencePiece .model, or a units file (token id per line); with --dict, the SentencePiece model "
        "whose pieces the dictionary lists (leave it out for text already split into pieces)",
    )
    binarize.add_argument(
        "--dict",
        "--dictionary",
        dest="dictionary",
        help="a fairseq dict.txt: store its ids (<s> 0, <pad> 1, </s> 2, <unk> 3, then its lines), as fairseq-preprocess does",
    )
    binarize.add_argument(
        "--layout",
        choices=["megatron", "fairseq"],
        default="megatron",
        help="the .idx layout: Megatron's (with a document index) or fairseq's MMapIndexedDataset (default: %(default)s)",
    )
    binarize.add_argument(
        "--split", choices=["char", "word"], help="how a units file splits text (default: from the units)"
    )
    binarize.add_argument(
        "--jobs", type=int, default=1, help="processes encoding parts of the file (default: %(default)s)"
    )
    binarize.add_argument("--no-eos", action="store_true", help="do not append the end-of-sentence id to each line")
    binarize.add_argument("--eos-id", type=int, help="the end-of-sentence id (default: the tokenizer's)")
    binarize.add_argument("--json", action="store_true", help="print the report as JSON")
    binarize.add_argument("--quiet", action="store_true", help="no progress bars")
    binarize.set_defaults(run=_binarize)


def _cmvn_command(commands: Any) -> None:
    cmvn = commands.add_parser("cmvn", help="global CMVN statistics of a shard set, for the loader's cmvn= option")
    cmvn.add_argument("patterns", nargs="+", help="shard patterns, folders or .list files")
    cmvn.add_argument("-o", "--out", required=True, help="the JSON file to write (mean and std per dimension)")
    cmvn.add_argument("--features", choices=["fbank"], help="audio shards: compute fbank as the loader will")
    cmvn.add_argument("--num-mel-bins", type=int, default=80, help="fbank bins (default: %(default)s)")
    cmvn.add_argument("--resample-to", type=int, help="resample audio to this rate first (Hz)")
    cmvn.add_argument("--channel", type=int, help="audio channel to use (default: mix down)")
    cmvn.add_argument("--max-utts", type=int, help="stop after this many utterances (default: all)")
    cmvn.add_argument("--workers", type=int, default=0, help="DataLoader workers (default: %(default)s)")
    cmvn.add_argument("--skip-bad", action="store_true", help="count and skip bad samples instead of stopping")
    cmvn.set_defaults(run=_cmvn)


def _calibrate_command(commands: Any) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="find each length bucket's largest batch a training step fits in memory (budgets for make_loader)",
    )
    calibrate.add_argument("patterns", nargs="+", help="shard patterns or folders (their index.json gives lengths)")
    calibrate.add_argument(
        "--step",
        required=True,
        help="MODULE:FUNCTION or FILE.py:FUNCTION, a training step (forward and backward) on a batch dict",
    )
    calibrate.add_argument("-o", "--out", required=True, help="the budgets file to write (JSON)")
    calibrate.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when there is one)")
    calibrate.add_argument(
        "--memory-fraction",
        type=float,
        help="a step may peak at this fraction of the GPU's memory (default: 0.9), or on CPU of the memory "
        "available when calibrate starts (default: 0.5)",
    )
    calibrate.add_argument(
        "--max-memory", type=int, help="bytes a step may peak at (GPU: allocated; CPU: the process's resident memory)"
    )
    calibrate.add_argument("--buckets", type=int, default=8, help="length buckets (default: %(default)s)")
    calibrate.add_argument("--dim", type=int, help="feature dimension (default: the index's)")
    calibrate.add_argument(
        "--vocab-size", type=int, default=2, help="label ids of the synthetic batches are below it (default: 2)"
    )
    calibrate.add_argument(
        "--max-batch-size", type=int, help="samples a batch may hold (default and most: the largest sort window's)"
    )
    calibrate.add_argument(
        "--max-step-seconds",
        type=float,
        help="a batch whose step takes longer does not fit (default: --time-limit over 16 steps a bucket)",
    )
    calibrate.add_argument(
        "--time-limit", type=float, default=600.0, help="seconds the whole calibration may take (default: %(default)s)"
    )
    calibrate.set_defaults(run=_calibrate)


def _config_command(commands: Any) -> None:
    config = commands.add_parser(
        "config",
        help="check a hyper-p.json (train.option; that its Kaldi data dirs' arks can be read and its shard "
        "patterns select shards); --explain prints every setting",
    )
    config.add_argument("file", help="the hyper-p.json file")
    config.add_argument("--explain", action="store_true", help="print the resolved settings, set or default")
    config.set_defaults(run=_config)


def _demo_command(commands: Any) -> None:
    demo = commands.add_parser("demo", help="make a small Kaldi dataset, pack it, stream it, and say what happened")
    demo.add_argument("--out", default="seqshard-demo", help="working folder (default: %(default)s)")
    demo.add_argument("--utts", type=int, default=1200, help="utterances in the demo dataset")
    demo.add_argument("--workers", type=int, default=2, help="worker processes")
    demo.add_argument(
        "--train-epochs", type=int, default=6, help="epochs of the example model (2 processes); 0: no training"
    )
    demo.set_defaults(run=_demo)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    with command_line_flags(RENAMED_FLAGS):  # messages name --flags, not Python parameters
        try:
            return args.run(args)
        except SeqshardError as error:
            print(f"seqshard {args.command}: error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"seqshard {args.command}: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # whoever read the output stopped (`seqshard inspect ... | head`)
            _discard_output()
            return 128 + signal.SIGPIPE  # the status of a command that SIGPIPE ended, as for other tools


def _discard_output() -> None:
    """Send what is left to write (and the flush at exit) to /dev/null, so that a closed pipe
    raises nothing more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        os.dup2(devnull, stream.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
