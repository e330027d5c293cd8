"""Training data: corpus reading, a cached byte-level BPE tokenizer, deterministic batches.

Public API (the local trainer and the distributed runtime both use it)::

    data = load_data(DataConfig(paths=(), val_fraction=0.05, cache_dir=None), vocab_size)
    inputs, targets = get_micro_batch(data, "train", seed, step, micro_batch, B, T)
"""

from shoal.data.sampler import batch_seed, check_batch_shape, get_micro_batch
from shoal.data.text import default_corpus_path, read_corpus, resolve_sources
from shoal.data.tokens import (
    EOT_TOKEN,
    DataConfig,
    TokenData,
    load_data,
    resolve_cache_dir,
    train_tokenizer,
)

__all__ = [
    "EOT_TOKEN",
    "DataConfig",
    "TokenData",
    "batch_seed",
    "check_batch_shape",
    "default_corpus_path",
    "get_micro_batch",
    "load_data",
    "read_corpus",
    "resolve_cache_dir",
    "resolve_sources",
    "train_tokenizer",
]
