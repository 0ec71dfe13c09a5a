"""Driver of the real-engine tests: tiny models, seeded workloads, one engine process per side.

A ``Group`` is one engine configuration and the cases it serves; ``run_side`` serves it with
one scheduler (vLLM's own or ``DFlashRsScheduler``) in a fresh ``serve.py`` process, its
EngineCore in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

The targets are tiny transformers with seeded random weights written as safetensors, built to
fall into short loops that depend on the context (``target_weights``). vLLM's dummy weights
(uniform in +-1e-3) would make a near-bigram model whose greedy output hardly depends on the
context: a scheduler that corrupted the KV cache could go unnoticed. The drafters are
config.json-only directories loaded with dummy weights (``draft_load_config``): only the
acceptance of their drafts depends on their weights.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

SERVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py")
SIDES = ("vllm", "dflash-rs")
VOCAB = 2048
#: Prompt tokens avoid bos (1), eos (2) and the DFlash mask id (VOCAB - 1).
LOW, HIGH = 3, VOCAB - 2

QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
LLAMA: dict[str, Any] = {**QWEN3, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
MODELS: dict[str, dict[str, Any]] = {
    "qwen3": QWEN3,
    "llama": LLAMA,
    # 1-layer DFlash drafter reading target layers 1 and 2 of the Qwen3 target.
    "dflash": {
        **QWEN3,
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 1,
        "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": VOCAB - 1},
    },
    # 1-layer EAGLE-1 head of the Llama target.
    "eagle": {**LLAMA, "architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1},
}
TARGETS = ("qwen3", "llama")
#: Engine arguments of every group (the CPU attention backend needs blocks of 32k tokens).
BASE_ENGINE: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "block_size": 32,
    "kv_cache_memory_bytes": 64 << 20,
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
    "max_model_len": 1024,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "seed": 0,
    "disable_log_stats": False,
}


def target_weights(
    config: dict[str, Any],
    seed: int,
    branch_scale: float = 2.5,
    sharpness: float = 3.0,
    cycle: int = 4,
) -> dict[str, np.ndarray]:
    """Seeded weights of a Llama/Qwen3 checkpoint (HF names).

    The residual stream carries the current token's embedding; the LM head maps it to the next
    token of a fixed permutation made of ``cycle``-long cycles, so greedy outputs fall into
    short loops (n-gram drafts get accepted). Attention and MLP branches (N(0, 1/fan_in)
    weights, outputs scaled by ``branch_scale``; attention logits by ``sharpness``, through
    the q projection or Qwen3's q norm) make the next token also depend on the context.
    """
    rng = np.random.default_rng(seed)
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    qk_norm = config["model_type"] == "qwen3"

    def linear(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return rng.normal(0.0, scale * cols**-0.5, (rows, cols)).astype(np.float32)

    embed = rng.normal(0.0, 1.0, (VOCAB, h)).astype(np.float32)
    order = rng.permutation(VOCAB)
    nxt = np.empty(VOCAB, np.int64)  # token -> its successor in its cycle
    for c in range(0, VOCAB, cycle):
        ring = order[c : c + cycle]
        nxt[ring] = np.roll(ring, -1)
    lm_head = np.empty_like(embed)
    lm_head[nxt] = embed  # logit of nxt[x] is |e_x|^2 when the stream holds e_x
    w = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": linear(q, h, 1.0 if qk_norm else sharpness),
            p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h),
            p + "self_attn.o_proj.weight": linear(h, q, branch_scale),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": linear(h, inter, branch_scale),
        }
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = np.full(hd, sharpness, np.float32)
            w[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
    w["model.norm.weight"] = np.ones(h, np.float32)
    return w


#: LoRA adapters written per target (``lora-<target>-<i>`` in the model paths, i from 1).
NUM_LORAS = 3


def write_models(root: str) -> dict[str, str]:
    """Writes one directory per entry of ``MODELS`` (weights for ``TARGETS``) and
    ``NUM_LORAS`` LoRA adapters per target; returns name -> path."""
    from safetensors.numpy import save_file

    paths = {}
    for seed, (name, config) in enumerate(MODELS.items()):
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        if name in TARGETS:
            save_file(target_weights(config, seed), os.path.join(path, "model.safetensors"))
            for i in range(1, NUM_LORAS + 1):
                paths[f"lora-{name}-{i}"] = write_lora(root, name, config, 100 * seed + i)
        paths[name] = path
    return paths


#: LoRA adapters (PEFT format) the real-engine tests generate for the targets: rank and the
#: projections they adapt.
LORA_RANK = 8
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_weights(config: dict[str, Any], seed: int, scale: float = 0.5) -> dict[str, np.ndarray]:
    """Seeded LoRA A/B matrices of rank ``LORA_RANK`` for every projection of ``config``'s
    layers (PEFT names). B is not zero, so each adapter changes the model's outputs."""
    rng = np.random.default_rng(seed)
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    w = {}
    for i in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            part = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            p = f"base_model.model.model.layers.{i}.{part}.{module}."
            a = rng.normal(0.0, fan_in**-0.5, (LORA_RANK, fan_in))
            b = rng.normal(0.0, scale * LORA_RANK**-0.5, (fan_out, LORA_RANK))
            w[p + "lora_A.weight"] = a.astype(np.float32)
            w[p + "lora_B.weight"] = b.astype(np.float32)
    return w


def write_lora(root: str, target: str, config: dict[str, Any], seed: int) -> str:
    """Writes a LoRA adapter directory (``adapter_config.json`` + safetensors) for the model
    ``target`` (at ``config``); returns its path."""
    from safetensors.numpy import save_file

    path = os.path.join(root, f"lora-{target}-{seed}")
    os.makedirs(path, exist_ok=True)
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_MODULES),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": target,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter, f)
    save_file(lora_weights(config, seed), os.path.join(path, "adapter_model.safetensors"))
    return path


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW, HIGH) for _ in range(n)]


def request(prompt: list[int], **params: Any) -> dict[str, Any]:
    """One request of a case; ``priority``, ``wave`` and ``arrive`` are not sampling params."""
    r: dict[str, Any] = {"prompt": prompt}
    for key in ("priority", "wave", "arrive", "lora", "embeds"):
        if key in params:
            r[key] = params.pop(key)
    r["params"] = params
    return r


@dataclass
class Group:
    """One engine configuration (``target`` model, ``spec`` or none, extra engine arguments)
    and the cases both schedulers serve with it, in order."""

    name: str
    target: str
    cases: list[dict[str, Any]]
    spec: Optional[dict[str, Any]] = None
    engine: dict[str, Any] = field(default_factory=dict)
    #: Publish KV-cache events (ZMQ, with replay) and record them (``serve.EventSubscriber``).
    kv_events: bool = False
    #: Compile structured-output grammars at arrival (``serve.compile_grammars_at_arrival``).
    sync_grammars: bool = False

    def spec_json(self, models: dict[str, str], scheduler: str, out: str) -> dict[str, Any]:
        engine = {**BASE_ENGINE, **self.engine, "model": models[self.target]}
        if self.spec is not None:
            spec = dict(self.spec)
            if "model" in spec:
                spec["model"] = models[spec["model"]]
                spec.setdefault("draft_load_config", {"load_format": "dummy"})
            engine["speculative_config"] = spec
        loras = {k: v for k, v in models.items() if k.startswith(f"lora-{self.target}-")}
        return {
            "engine": engine,
            "scheduler": scheduler,
            "cases": self.cases,
            "out": out,
            "kv_events": self.kv_events,
            "sync_grammars": self.sync_grammars,
            "loras": loras,
        }


def run_side(
    group: Group, models: dict[str, str], root: str, scheduler: str, timeout: float
) -> dict[str, Any]:
    """Serves ``group`` with one scheduler in a fresh process; returns ``serve.py``'s result
    (``error`` holds the log tail if the process died)."""
    out = os.path.join(root, f"{group.name}-{scheduler}.json")
    log = os.path.join(root, f"{group.name}-{scheduler}.log")
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # The same string hashes in both processes (serve.py also fixes the request ids).
        "PYTHONHASHSEED": "0",
    }
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    spec = json.dumps(group.spec_json(models, scheduler, out))
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                [sys.executable, SERVE, spec],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout,
                check=False,
            )
            status = f"exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    with open(log) as f:
        tail = f.read()[-4000:]
    return {"error": f"serve.py {status} without a result ({log}):\n{tail}"}
