"""Training data: corpus reading, a cached byte-level BPE tokenizer, deterministic batches.

Public API (the local trainer and the distributed runtime both use it)::

    data = load_data(DataConfig(paths=(), val_fraction=0.05, cache_dir=None), vocab_size)
    inputs, targets = get_micro_batch(data, "train", seed, step, micro_batch, B, T)

The names are imported on first use, so ``shoal data prepare`` (which needs only
:mod:`shoal.data.prepare`) never imports torch: that keeps its memory and start-up small.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "EOT_TOKEN": "shoal.data.tokens",
    "DataConfig": "shoal.data.tokens",
    "TokenData": "shoal.data.tokens",
    "batch_seed": "shoal.data.sampler",
    "check_batch_shape": "shoal.data.sampler",
    "default_corpus_path": "shoal.data.text",
    "get_micro_batch": "shoal.data.sampler",
    "get_window": "shoal.data.sampler",
    "load_data": "shoal.data.tokens",
    "read_corpus": "shoal.data.text",
    "resolve_cache_dir": "shoal.data.tokens",
    "resolve_sources": "shoal.data.text",
    "train_tokenizer": "shoal.data.tokens",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
