"""Write a Llama-family model with random weights to a folder, as a stand-in for a real checkpoint.

    python examples/make_random_model.py --out /tmp/llama-small --size small
    python examples/make_random_model.py --out /tmp/llama-bench --size bench --dtype float32

The examples, tests and benchmark load the result with `AutoModelForCausalLM.from_pretrained(DIR)`,
exactly as they would load real weights; any real checkpoint path works in its place. The weights
come from a fixed seed, so the same size, dtype and seed give the same model bit for bit.

Sizes:
    small   4 layers, hidden 256, 8 heads, 2 KV heads (GQA), vocab 4096: ~5M parameters, for tests
            and examples. Initialised with std 0.1 rather than Llama's 0.02 so that greedy decoding
            depends visibly on the context (at 0.02 a random model repeats one token).
    bench   8 layers, hidden 1024, intermediate 2816, 16 heads, 4 KV heads, vocab 32000, 8192
            positions: ~156M parameters, for bench/bench_ttft.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
    },
    "bench": {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 8192,
    },
}

DTYPES = ("float32", "bfloat16", "float16")


def make_random_model(out: str | Path, *, size: str = "small", dtype: str = "float32", seed: int = 0) -> Path:
    """Builds the model for `size` with weights drawn from `seed`, saves it (safetensors) to `out`.

    Returns:
        The folder, ready for `AutoModelForCausalLM.from_pretrained`.
    """
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    # No token is special to a model without a tokenizer: an eos id would stop generation at random.
    config = LlamaConfig(**SIZES[size], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    out = Path(out)
    model.save_pretrained(out)
    return out


def parameter_count(size: str) -> int:
    """Parameters of a model of `size` (built on the meta device: nothing is allocated)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SIZES[size]))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to write (created)")
    p.add_argument(
        "--size", choices=sorted(SIZES), default="small", help="model size, see Sizes above (default %(default)s)"
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the weights (default %(default)s)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights: same seed, same model (default %(default)s)"
    )
    args = p.parse_args()
    out = make_random_model(args.out, size=args.size, dtype=args.dtype, seed=args.seed)
    params = parameter_count(args.size)
    print(f"wrote a random {args.size} Llama ({params / 1e6:.1f}M parameters, {args.dtype}) to {out}")


if __name__ == "__main__":
    main()
