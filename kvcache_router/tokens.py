"""A request's prompt as token ids: what the router keys its Lookup with.

The router asks a worker (`POST /tokenize`, vLLM's endpoint) rather than tokenizing locally: the
worker's own tokenization (chat template, special tokens, its tokenizer's version) is by definition
what its connector keys. A prompt given as token ids is used as it is; a batch of prompts has no
single prefix and is not looked up.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

# What a request's tokens depend on besides its text: sent to /tokenize as they came (vLLM's names).
TOKENIZE_FIELDS = (
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)

_MAX_TOKEN_ID = (1 << 32) - 1


def given_tokens(body: dict[str, Any], *, chat: bool) -> list[int] | None:
    """The prompt when the request gives it as token ids (a completion's `prompt: [ids]`), else None."""
    prompt = body.get("prompt")
    if chat or not isinstance(prompt, list) or not prompt:
        return None
    if all(type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in prompt):
        return prompt
    return None


def needs_tokenizer(body: dict[str, Any], *, chat: bool) -> bool:
    """Whether the prompt is text (or chat messages) that only a tokenizer turns into token ids."""
    return chat or isinstance(body.get("prompt"), str)


async def tokenize(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    chat: bool,
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
) -> tuple[list[int], int] | None:
    """The prompt's token ids and the model's context length (0: unknown) from the worker at `url`.

    Returns None when the worker refuses or answers something else: a refusal never fails the
    request, since the completion endpoint, not /tokenize, has the last word on what it accepts.

    Raises:
        aiohttp.ClientConnectionError: the worker could not be reached (the caller ejects it).
    """
    query: dict[str, Any] = {k: body[k] for k in TOKENIZE_FIELDS if k in body}
    if chat:
        query.setdefault("add_generation_prompt", True)
    try:
        async with session.post(f"{url}/tokenize", json=query, headers=headers, timeout=timeout) as resp:
            data = await resp.read()
            if resp.status != 200:
                log.info("tokenize on %s answered %d: routing as uncached", url, resp.status)
                return None
        answer = json.loads(data)
        tokens = answer["tokens"]
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in tokens):
            raise ValueError("tokens is not a list of token ids")
        return tokens, int(answer.get("max_model_len") or 0)
    except aiohttp.ClientConnectionError:
        raise
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("tokenize on %s failed: %s: %s", url, type(exc).__name__, exc)
        return None
