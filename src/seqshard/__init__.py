"""seqshard: pack Kaldi-style speech datasets into indexed tar shards and stream them into
PyTorch training at disk speed (see README.md).

Importing the package is cheap; torch and the other heavy modules load on first use. Beside
these names: :mod:`seqshard.options` (the loader's option groups), :mod:`seqshard.extend`
(what a stage or a recipe of your own is written with), :mod:`seqshard.errors`,
:mod:`seqshard.testing`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "pack_data": "seqshard.prep.pack",
    "add_field": "seqshard.prep.add_field",
    "binarize": "seqshard.prep.binarize",
    "calibrate": "seqshard.tools.calibrate",
    "make_loader": "seqshard.loader",
    "make_scp_loader": "seqshard.scp_dataset",
    "make_token_loader": "seqshard.tokens.token_loader",
    "build_loaders": "seqshard.app.config",
    "mux": "seqshard.mix",
    "token_pairs": "seqshard.tokens.databin",
    "TokenPair": "seqshard.tokens.pairs",
    "TokenDataset": "seqshard.formats.peers.mmidx",
    "UnitsTokenizer": "seqshard.text.tokenizers",
    "ScpDataset": "seqshard.scp_dataset",
    "ShardIndex": "seqshard.formats.index",
    "Loader": "seqshard.protocol",
    "ShardLoader": "seqshard.loader",
    "TokenLoader": "seqshard.tokens.token_loader",
    "MapStyleLoader": "seqshard.scp_dataset",
    "SeqshardError": "seqshard.errors",
    "ConfigError": "seqshard.errors",
    "InputError": "seqshard.errors",
    "ShardError": "seqshard.errors",
    "StateMismatchError": "seqshard.errors",
}

# Names once exported here, and where they are now: still found (``seqshard.Stage``), with a
# DeprecationWarning naming the new import.
_MOVED = {
    **dict.fromkeys(
        ("Stage", "Sample", "Reader", "default_recipe", "keep_if", "stage_rng", "Seed", "split_batch", "plan_epoch"),
        "seqshard.extend",
    ),
    "ShardTable": "seqshard.extend",
    "LoaderOptions": "seqshard.options",
    "OutputError": "seqshard.errors",
    "Mux": "seqshard.mix",
    "PlannedBatches": "seqshard.protocol",
    "PackReport": "seqshard.prep.report",
    "UTTS_PER_FILE": "seqshard.prep.job",
}

_MODULES = ("testing", "extend", "options", "errors")  # seqshard.extend.Stage after `import seqshard`

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"seqshard.{name}")
    module = _EXPORTS.get(name)
    if module is None and name in _MOVED:
        module = _MOVED[name]
        warnings.warn(f"seqshard.{name} moved: use `from {module} import {name}`.", DeprecationWarning, stacklevel=2)
    if module is None:
        raise AttributeError(f"module 'seqshard' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
