"""What a stage or a recipe of your own is written with: the place to extend seqshard's loader.

- :class:`Stage`: a pipeline stage (``reset(state)``, ``next()``, ``get_state()``; the contract
  in ``pipeline/stages/base.py``), built as ``cls(source, reader)`` when given in
  ``transforms=``; :class:`Sample`: what flows through (``sample.key``, ``sample.fields``).
- :class:`Reader`: what a recipe composes a reader's pipeline from (``reader.read()``,
  ``reader.labels()``, ``reader.transforms()``, ``reader.filter_lengths()``,
  ``reader.shuffle()``, ``reader.batch()``, ``reader.sample_rng(...)``);
  :func:`default_recipe`: the recipe used unless ``pipeline={"recipe": ...}`` gives another;
  :func:`keep_if`: a filter for ``transforms=``, counted by name.
- :func:`stage_rng` and :class:`Seed`: the only source of randomness (your own stages' ids
  from :data:`USER_IDS`, 100, on), so exact and elastic resume hold.
- :func:`split_batch`: a batch cut into pieces that fit memory (gradient accumulation).
- :func:`plan_epoch` and :class:`ShardTable`: each reader's units of an epoch, from the shards'
  indexes (batches known before reading).

``seqshard.testing.assert_resumes_everywhere`` checks a stage at every position. See
docs/architecture.md for the tiers and the path of a batch.
"""

from __future__ import annotations

from .pipeline.epoch_plan import ShardTable, plan_epoch
from .pipeline.stages.base import Stage
from .pipeline.stages.sample import Sample
from .pipeline.stages.split import split_batch
from .pipeline.workers.recipe import Reader, default_recipe, keep_if
from .seeds import USER_IDS, Seed, stage_rng

__all__ = ["USER_IDS", "Reader", "Sample", "Seed", "ShardTable", "Stage", "default_recipe", "keep_if", "plan_epoch"]
__all__ += ["split_batch", "stage_rng"]
