"""Write a random-weight Llama together with a tokenizer and a chat template, for the OpenAI worker.

    python examples/make_chat_model.py --out /tmp/chat-tiny --size tiny
    python examples/make_chat_model.py --out /tmp/chat-bench --size bench

examples/openai_worker.py serves text, so unlike examples/make_random_model.py (token ids only) the
folder also holds a tokenizer, built offline with the `tokenizers` library: a word-level vocabulary
of made-up words ("bada", "kilo", ...), four special tokens and a chat template. Everything is
fixed: the same size and seed give the same model and tokenizer bit for bit on every machine, and
`AutoModelForCausalLM.from_pretrained(DIR)` / `AutoTokenizer.from_pretrained(DIR)` load them as
they load a real checkpoint.

Text is split on whitespace; a word outside the vocabulary reads as `[UNK]`. A token's text is a
space and its word, so a completion's text is the concatenation of its tokens' texts.

Sizes:
    tiny    2 layers, hidden 64, 4 heads, 2 KV heads, 512 positions: for tests (~0.2M parameters).
    bench   6 layers, hidden 512, 8 heads, 2 KV heads, 4096 positions: for bench/bench_router.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("[UNK]", "<|system|>", "<|user|>", "<|assistant|>")
WORDS = 1020
"""Words in the vocabulary; with the special tokens the vocabulary has 1024 entries."""

# One line per message, the role as a special token; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    },
    "bench": {
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    },
}


def vocabulary_words() -> list[str]:
    """The made-up words of the vocabulary: consonant-vowel syllable pairs, in a fixed order."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return ["".join(pair) for pair in itertools.islice(itertools.product(syllables, repeat=2), WORDS)]


def make_tokenizer(out: Path) -> int:
    """Writes tokenizer.json and tokenizer_config.json (with the chat template) to `out`; returns the vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *vocabulary_words()])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
        "model_max_length": 1 << 30,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return len(vocab)


def make_chat_model(out: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """Builds the tokenizer and a float32 Llama of `size` with weights drawn from `seed`, saved to `out`.

    Returns:
        The folder, ready for `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
    """
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    transformers.utils.logging.disable_progress_bar()
    out = Path(out)
    vocab_size = make_tokenizer(out)
    # Std 0.1 rather than Llama's 0.02, so that greedy decoding depends visibly on the context; no
    # eos token, so that every completion runs to max_tokens.
    config = LlamaConfig(
        **SIZES[size],
        vocab_size=vocab_size,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to write (created)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    args = p.parse_args()
    print(f"wrote a random {args.size} Llama with its tokenizer to {make_chat_model(args.out, size=args.size)}")


if __name__ == "__main__":
    main()
