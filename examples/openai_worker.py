"""A small OpenAI-compatible worker: a transformers model behind HTTP, a prefill or decode worker for kvcache.

    python examples/make_chat_model.py --out /tmp/chat-tiny
    python examples/openai_worker.py --model /tmp/chat-tiny --role prefill --kvcache 127.0.0.1:51051 --port 8100
    python examples/openai_worker.py --model /tmp/chat-tiny --role decode  --kvcache 127.0.0.1:51051 --port 8200
    kvcache-router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --kvcache 127.0.0.1:51051

It plays the part vLLM plays in docker/docker-compose.yml, on a CPU, with the endpoints the router uses:

    POST /v1/completions, /v1/chat/completions   greedy decoding, `stream: true` for server-sent events
    POST /tokenize                               as vLLM's: {"prompt"} or {"messages"} -> {"tokens", "count", ...}
    GET  /v1/models, /health                     the served model; 200 while serving
    GET  /kvcache/namespace                      the kvcache namespace this worker stores under (Namespace.to_dict())

Per request, through the transformers connector (docs/transformers.md): the longest stored prefix of
the prompt is loaded (at most all tokens but the last), the rest of the prompt is computed, then, on a
`prefill` worker, the prompt's KV is saved to kvcache, and `max_tokens` tokens are decoded greedily. A
decode worker never saves. A prefill worker answers with `kv_transfer_params` naming what it stored,
as vLLM's connector does; a decode worker accepts and ignores them (the transformers connector's save
is synchronous: when the prefill answers, its chunks are stored).

Only greedy decoding: sampling parameters (temperature, top_p, ...) are accepted and ignored, `n` must
be 1, and there is no end-of-sequence token, so every completion has `max_tokens` tokens (default 16).
`return_token_ids: true` adds `prompt_token_ids` and each choice's `token_ids` (vLLM's extension);
`cache_salt` is part of the namespace the request's KV goes under, as in vLLM.
`--api-key` protects /v1/* as vLLM's does. The model runs one request at a time on one thread; at
most --max-queue requests wait, more get 503.
The first line printed is "openai-worker serving MODEL (ROLE) on HOST:PORT".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from kvcache_core.keys import Namespace

log = logging.getLogger("openai_worker")

MAX_BODY_BYTES = 4 << 20


class RequestError(Exception):
    """A request this worker refuses; becomes an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def error_response(status: int, message: str, *, code: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


@dataclass(slots=True)
class Generation:
    """What one request computed.

    Attributes:
        tokens: The new tokens.
        cached_tokens: Prompt tokens whose KV came from kvcache.
        stored_chunks: Chunks of the prompt saved (prefill workers), or None when the save failed.
        namespace: The namespace of the request's KV (the worker's, with the request's cache_salt).
    """

    namespace: Namespace
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    stored_chunks: int | None = 0


class Engine:
    """The model, its tokenizer and its kvcache connector; `generate` runs on the one model thread."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from kvcache_client import KVCacheClient
        from kvcache_connectors.transformers import TransformersKVConnector, namespace_for_model

        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(args.threads)
        self.role = args.role
        self.name = args.served_model_name or args.model
        self.model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.max_model_len = self.model.config.max_position_embeddings
        self.namespace = namespace_for_model(self.model, model_id=self.name, chunk_tokens=args.chunk_tokens)
        self.client = KVCacheClient(args.kvcache, timeout_s=args.kvcache_timeout_s)
        self._connector_type = TransformersKVConnector
        self.delay_s = args.delay_s
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def encode(self, body: dict[str, Any], *, chat: bool) -> list[int]:
        """The prompt's token ids: a completion's `prompt` (text or ids), or a chat's rendered `messages`."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(400, "messages must be a non-empty list", code="invalid_messages", param="messages")
            rendered = []
            for m in messages:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise RequestError(400, "each message needs a role", code="invalid_messages", param="messages")
                content = m.get("content") or ""
                if isinstance(content, list):  # content parts: the text ones
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                if not isinstance(content, str):
                    raise RequestError(400, "message content must be text", code="invalid_messages", param="messages")
                rendered.append({"role": m["role"], "content": content})
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        vocab = self.model.config.vocab_size
        if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            return list(prompt)
        raise RequestError(
            400, "prompt must be one string or one list of token ids", code="invalid_prompt", param="prompt"
        )

    def piece(self, token: int) -> str:
        """A token's text: a space and its word."""
        return " " + self.tokenizer.convert_ids_to_tokens(token)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        on_token: Callable[[int], None],
        cancelled: threading.Event,
        cache_salt: str,
    ) -> Generation:
        """Greedy decoding after the prompt, loading its stored prefix and (prefill) saving its KV.

        The request's `cache_salt` is part of the namespace its KV goes under, as in vLLM.
        """
        import torch
        from transformers import DynamicCache

        from kvcache_client import KVCacheError
        from kvcache_connectors.transformers import cache_kwargs

        if self.delay_s:
            time.sleep(self.delay_s)
        out = Generation(namespace=replace(self.namespace, cache_salt=cache_salt))
        connector = self._connector_type(self.client, out.namespace)
        with torch.no_grad():
            cache, out.cached_tokens = connector.load(prompt)
            cache = cache if cache is not None else DynamicCache()
            kw = cache_kwargs(self.model, cache)
            ids = torch.tensor([prompt[out.cached_tokens :]])
            logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw).logits[0, -1]
            if self.role == "prefill":
                try:
                    connector.save(prompt, cache)
                    out.stored_chunks = len(self.client.chunk_keys(prompt, out.namespace))
                except KVCacheError as exc:  # the decode worker will compute the prompt itself
                    log.warning("saving the prompt's KV failed: %s", exc)
                    out.stored_chunks = None
            token = int(logits.argmax())
            while True:
                out.tokens.append(token)
                on_token(token)
                if len(out.tokens) == max_tokens or cancelled.is_set():
                    break
                ids = torch.tensor([[token]])
                token = int(self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw).logits[0, -1].argmax())
        return out

    def handoff(self, prompt: list[int], out: Generation) -> dict[str, Any] | None:
        """kv_transfer_params of a prefill answer, in the vLLM connector's form (docs/vllm.md)."""
        if self.role != "prefill" or not out.stored_chunks:
            return None
        last_key = self.client.chunk_keys(prompt, out.namespace)[out.stored_chunks - 1]
        return {"kvcache_handoff": {"chunks": out.stored_chunks, "last_key": last_key.hex()}}


class Worker:
    """The HTTP side: validation, OpenAI response bodies, SSE."""

    def __init__(self, engine: Engine, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.pending = 0

    def app(self, api_key: str | None) -> web.Application:
        @web.middleware
        async def check_key(request: web.Request, handler: Any) -> web.StreamResponse:
            # As vLLM's --api-key: the OpenAI routes need the key, /health and the rest do not.
            authorized = request.headers.get("Authorization") == f"Bearer {api_key}"
            if api_key and request.path.startswith("/v1/") and not authorized:
                return error_response(401, "a valid API key is required", code="invalid_api_key")
            return await handler(request)

        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[check_key])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/kvcache/namespace", self.namespace)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _: web.Request) -> web.Response:
        card = {
            "id": self.engine.name,
            "object": "model",
            "created": 0,
            "owned_by": "kvcache-examples",
            "max_model_len": self.engine.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def namespace(self, _: web.Request) -> web.Response:
        return web.json_response(self.engine.namespace.to_dict())

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            raise RequestError(400, "the body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.engine.name:
            raise RequestError(404, f"the model `{model}` does not exist", code="model_not_found", param="model")
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            tokens = self.engine.encode(body, chat="messages" in body)
        except RequestError as exc:
            return error_response(exc.status, str(exc), code=exc.code, param=exc.param)
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = self.engine.encode(body, chat=chat)
            max_tokens = self._max_tokens(body, chat=chat, prompt_tokens=len(prompt))
            body["cache_salt"] = body.get("cache_salt") or ""
            if not isinstance(body["cache_salt"], str):
                raise RequestError(400, "cache_salt must be a string", code="invalid_cache_salt", param="cache_salt")
            if body.get("n", 1) != 1:
                raise RequestError(400, "this worker generates one choice (n = 1)", code="invalid_n", param="n")
            if self.pending >= self.max_queue:
                raise RequestError(503, "the worker's queue is full", code="overloaded")
        except RequestError as exc:
            return error_response(exc.status, str(exc), code=exc.code, param=exc.param)
        self.pending += 1
        try:
            if body.get("stream"):
                return await self._stream(request, body, prompt, max_tokens, chat=chat)
            return await self._complete(body, prompt, max_tokens, chat=chat)
        finally:
            self.pending -= 1

    def _max_tokens(self, body: dict[str, Any], *, chat: bool, prompt_tokens: int) -> int:
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        value = body.get(name)
        value = 16 if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(400, f"{name} must be a positive integer", code="invalid_max_tokens", param=name)
        limit = self.engine.max_model_len
        if prompt_tokens + value > limit:
            raise RequestError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + value} tokens ({prompt_tokens} in the prompt, {value} in the completion).",
                code="context_length_exceeded",
                param="messages" if chat else "prompt",
            )
        return value

    async def _run(
        self,
        body: dict[str, Any],
        prompt: list[int],
        max_tokens: int,
        on_token: Callable[[int], None],
        cancelled: threading.Event,
    ) -> Generation:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.engine.executor, self.engine.generate, prompt, max_tokens, on_token, cancelled, body["cache_salt"]
        )

    def _envelope(self, body: dict[str, Any], *, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if chat else "text_completion"
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": f"{kind}.chunk" if chat and chunk else kind,
            "created": int(time.time()),
            "model": self.engine.name,
        }

    async def _complete(self, body: dict[str, Any], prompt: list[int], max_tokens: int, *, chat: bool) -> web.Response:
        out = await self._run(body, prompt, max_tokens, lambda _: None, threading.Event())
        text = "".join(self.engine.piece(t) for t in out.tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        answer = self._envelope(body, chat=chat, chunk=False)
        answer["choices"] = [choice]
        if body.get("return_token_ids"):
            choice["token_ids"] = out.tokens
            answer["prompt_token_ids"] = prompt
        answer["usage"] = self._usage(prompt, out)
        answer["kv_transfer_params"] = self.engine.handoff(prompt, out)
        return web.json_response(answer)

    def _usage(self, prompt: list[int], out: Generation) -> dict[str, Any]:
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out.tokens),
            "total_tokens": len(prompt) + len(out.tokens),
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }

    async def _stream(
        self, request: web.Request, body: dict[str, Any], prompt: list[int], max_tokens: int, *, chat: bool
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int] = asyncio.Queue()
        cancelled = threading.Event()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        envelope = self._envelope(body, chat=chat, chunk=True)
        with_ids = bool(body.get("return_token_ids"))
        # OpenAI's stream_options.include_usage: every chunk carries "usage": null, and one last chunk
        # (no choices) the usage; without it no chunk has usage.
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        if include_usage:
            envelope["usage"] = None

        async def send(choice: dict[str, Any], **extra: Any) -> None:
            await response.write(f"data: {json.dumps({**envelope, 'choices': [choice], **extra})}\n\n".encode())

        def on_token(token: int) -> None:  # on the model thread
            loop.call_soon_threadsafe(queue.put_nowait, token)

        job = asyncio.ensure_future(self._run(body, prompt, max_tokens, on_token, cancelled))
        try:
            if chat:
                await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            for _ in range(max_tokens):
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the generation ended (an error, or cancelled) before this token
                    getter.cancel()
                    break
                token = getter.result()
                choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
                piece = self.engine.piece(token)
                choice.update({"delta": {"content": piece}} if chat else {"text": piece})
                if with_ids:
                    choice["token_ids"] = [token]
                await send(choice)
            out = await job
            last: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            last.update({"delta": {}} if chat else {"text": ""})
            extra: dict[str, Any] = {"prompt_token_ids": prompt} if with_ids else {}
            await send(last, **extra)
            if include_usage:
                usage = {**envelope, "choices": [], "usage": self._usage(prompt, out)}
                await response.write(f"data: {json.dumps(usage)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        finally:
            cancelled.set()  # a client that went away stops the generation at the next token
        await response.write_eof()
        return response


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder with its tokenizer (examples/make_chat_model.py)")
    p.add_argument("--served-model-name", help="the model's name in requests and the namespace (default: --model)")
    p.add_argument("--role", choices=("prefill", "decode"), required=True, help="prefill saves KV; decode only loads")
    p.add_argument("--kvcache", default="127.0.0.1:51051", help="kvcache server host:port (default %(default)s)")
    p.add_argument("--kvcache-timeout-s", type=float, default=10.0, help="deadline of each kvcache call")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per kvcache chunk (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default %(default)s)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* (as vLLM's --api-key)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    p.add_argument("--max-queue", type=int, default=32, help="generation requests waiting at most (default 32)")
    p.add_argument(
        "--delay-s", type=float, default=0.0, help="extra seconds per generation, to mimic a slower model (default 0)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = Worker(Engine(args), args.max_queue)

    async def serve() -> None:
        runner = web.AppRunner(worker.app(args.api_key), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"openai-worker serving {worker.engine.name} ({args.role}) on {host}:{port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
