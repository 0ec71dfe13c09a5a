"""Config-only model directories for offline vLLM runs: a tiny Llama target, EAGLE and DFlash
drafts, and a tiny byte-level tokenizer.

Standard library only (``write_tokenizer`` imports ``tokenizers`` when called): the vLLM
driver (``vllm_driver.py``), which runs in a vLLM venv without dflash_rs, imports this file as a
sibling module. ``offline_vllm`` builds vLLM's configs on these directories.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, Optional

__all__ = [
    "DRAFTS",
    "TOKENIZER_VOCAB",
    "VOCAB",
    "write_model_dirs",
    "write_tokenizer",
]

VOCAB = 32000

_TARGET: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
}
#: Each draft model's config: the target's, with these keys replaced.
DRAFTS: Dict[str, Dict[str, Any]] = {
    "eagle": {"num_hidden_layers": 1},
    "eagle3": {"num_hidden_layers": 1},
    "dflash": {
        "num_hidden_layers": 1,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "head_dim": 16,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": VOCAB - 1},
    },
}

#: The special tokens of ``write_tokenizer``'s tokenizer, at the target config's ids.
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
#: Its vocabulary: the special tokens, then one token per byte (no merges).
TOKENIZER_VOCAB = len(_SPECIAL_TOKENS) + 256


def write_model_dirs(root: str, drafts: Optional[Iterable[str]] = None) -> Dict[str, str]:
    """Writes config.json-only checkpoints under ``root``: ``target`` and one per draft
    (``drafts``: names of ``DRAFTS``, all by default)."""
    names = list(DRAFTS) if drafts is None else list(drafts)
    dirs = {}
    for name, extra in (("target", {}), *((n, DRAFTS[n]) for n in names)):
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**_TARGET, **extra}, f)
        dirs[name] = path
    return dirs


def write_tokenizer(path: str) -> None:
    """Saves a tiny byte-level BPE tokenizer (``tokenizers``) in the model directory ``path``:
    ``tokenizer.json`` and ``tokenizer_config.json``. Ids 0-2 are ``<unk>``, ``<s>`` and
    ``</s>`` (the target's BOS 1 and EOS 2), then one token per byte, with no merges: every
    string encodes, deterministically, within the model's vocabulary (``TOKENIZER_VOCAB``
    tokens, ``VOCAB`` above it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": _TARGET["max_position_embeddings"],
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
