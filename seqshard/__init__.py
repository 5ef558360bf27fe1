"""seqshard: pack Kaldi-style speech datasets into indexed tar shards and stream them into
PyTorch training at disk speed (see README.md).

Importing the package is cheap; torch and the other heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "pack_data": "seqshard.prep.pack",
    "add_field": "seqshard.prep.add_field",
    "make_loader": "seqshard.loader",
    "mux": "seqshard.mix",
    "Mux": "seqshard.mix",
    "TokenDataset": "seqshard.formats.peers.mmidx",
    "TokenPair": "seqshard.tokens.pairs",
    "token_pairs": "seqshard.tokens.databin",
    "UnitsTokenizer": "seqshard.text.tokenizers",
    "make_token_loader": "seqshard.tokens.loader",
    "TokenLoader": "seqshard.tokens.loader",
    "binarize": "seqshard.prep.binarize",
    "build_loaders": "seqshard.app.config",
    "calibrate": "seqshard.tools.calibrate",
    "split_batch": "seqshard.pipeline.stages.split",
    "ShardLoader": "seqshard.loader",
    "Loader": "seqshard.protocol",
    "PlannedBatches": "seqshard.protocol",
    "LoaderOptions": "seqshard.options",
    "MapStyleLoader": "seqshard.scp_dataset",
    "Sample": "seqshard.pipeline.stages.sample",
    "Stage": "seqshard.pipeline.stages.base",
    "Reader": "seqshard.pipeline.workers.recipe",
    "default_recipe": "seqshard.pipeline.workers.recipe",
    "keep_if": "seqshard.pipeline.workers.recipe",
    "stage_rng": "seqshard.seeds",
    "Seed": "seqshard.seeds",
    "plan_epoch": "seqshard.pipeline.plan",
    "ScpDataset": "seqshard.scp_dataset",
    "make_scp_loader": "seqshard.scp_dataset",
    "ShardTable": "seqshard.pipeline.plan",
    "UTTS_PER_FILE": "seqshard.prep.plan",
    "PackReport": "seqshard.prep.report",
    "ShardIndex": "seqshard.formats.index",
    "SeqshardError": "seqshard.errors",
    "InputError": "seqshard.errors",
    "ShardError": "seqshard.errors",
    "OutputError": "seqshard.errors",
    "ConfigError": "seqshard.errors",
    "StateMismatchError": "seqshard.errors",
}

_MODULES = ("testing",)  # seqshard.testing.ListSource after `import seqshard`

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"seqshard.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'seqshard' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
