"""kvcache-router end to end: real processes, real HTTP, a real model.

A kvcache server, a prefill and a decode worker (examples/openai_worker.py, each its own process with
its own copy of a random-weight Llama and its tokenizer) and the router, all on free loopback ports.
Every answer is checked token for token against `model.generate` in this process; what the router
did is checked in its response headers and in its /metrics.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples._support import KVCacheServerProcess, OpenAIWorkerProcess, RouterProcess
from examples.make_chat_model import make_chat_model, vocabulary_words

pytestmark = pytest.mark.timeout(180)

CHUNK = 16
NEW_TOKENS = 6
FAST_HEALTH = ("--set", "workers.health_interval_s=0.2", "--set", "workers.health_timeout_s=1")


# -- processes ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_chat_model(tmp_path_factory.mktemp("chat-model"), size="tiny", seed=0))


@pytest.fixture(scope="module")
def kv_server() -> Iterator[str]:
    with KVCacheServerProcess(ram_capacity="256MiB") as server:
        yield server.target


@pytest.fixture(scope="module")
def prefill(model_dir: str, kv_server: str) -> Iterator[OpenAIWorkerProcess]:
    with OpenAIWorkerProcess(model_dir, "prefill", kv_server, "--chunk-tokens", str(CHUNK)) as worker:
        yield worker


@pytest.fixture(scope="module")
def decode(model_dir: str, kv_server: str) -> Iterator[OpenAIWorkerProcess]:
    with OpenAIWorkerProcess(model_dir, "decode", kv_server, "--chunk-tokens", str(CHUNK)) as worker:
        yield worker


@pytest.fixture(scope="module")
def router(prefill: OpenAIWorkerProcess, decode: OpenAIWorkerProcess, kv_server: str) -> Iterator[RouterProcess]:
    with RouterProcess([prefill.url], [decode.url], kv_server, "--set", "http.max_body_bytes=65536") as r:
        yield r


class Reference:
    """The model and tokenizer in this process: what one process generates without any cache."""

    def __init__(self, model_dir: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.name = model_dir

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def generate(self, tokens: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([tokens]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
        return out[0, len(tokens) :].tolist()

    def text(self, tokens: list[int]) -> str:
        return "".join(" " + t for t in self.tokenizer.convert_ids_to_tokens(tokens))


@pytest.fixture(scope="module")
def ref(model_dir: str) -> Reference:
    return Reference(model_dir)


_words = vocabulary_words()


def words(n: int, seed: int) -> str:
    """`n` vocabulary words, the same for the same seed: a prompt of exactly n tokens."""
    return " ".join(_words[(seed * 7919 + i * 104729) % len(_words)] for i in range(n))


# -- HTTP --------------------------------------------------------------------------------------------


def post(
    url: str, body: bytes | dict[str, Any], timeout_s: float = 60, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def events(raw: bytes) -> list[Any]:
    """The data of each server-sent event; "[DONE]" last."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(router: RouterProcess, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (0 when absent)."""
    status, text = get(f"{router.url}/metrics")
    assert status == 200
    for line in text.decode().splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if got == labels:
            return float(m.group(3))
    return 0.0


def wait_for_metric(router: RouterProcess, value: float, name: str, **labels: str) -> None:
    deadline = time.monotonic() + 30
    while metric(router, name, **labels) != value:
        assert time.monotonic() < deadline, f"{name}{labels} never became {value}"
        time.sleep(0.05)


def completion(
    router: RouterProcess, prompt: str, *, stream: bool = False, **extra: Any
) -> tuple[dict, list[int], str]:
    """(headers, token ids, text) of one /v1/completions through the router."""
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "return_token_ids": True, "stream": stream, **extra}
    status, headers, raw = post(f"{router.url}/v1/completions", body)
    assert status == 200, raw
    if not stream:
        (choice,) = json.loads(raw)["choices"]
        return headers, choice["token_ids"], choice["text"]
    assert headers["Content-Type"].startswith("text/event-stream")
    chunks = events(raw)
    assert chunks[-1] == "[DONE]"
    tokens = [t for c in chunks[:-1] for t in c["choices"][0].get("token_ids", [])]
    return headers, tokens, "".join(c["choices"][0]["text"] for c in chunks[:-1])


# -- routing and exactness ---------------------------------------------------------------------------


def test_completion_prefilled_then_repeated_skips_prefill(router: RouterProcess, ref: Reference) -> None:
    prompt = words(3 * CHUNK + 5, seed=1)  # four chunks, the last one partial
    tokens = ref.encode(prompt)
    want = ref.generate(tokens)
    skipped = metric(router, "kvcache_router_prefill_skipped_total")

    headers, got, text = completion(router, prompt)
    assert (got, text) == (want, ref.text(want))
    assert headers["X-KVCache-Route"] == "prefill" and headers["X-KVCache-Prefill-Skipped"] == "false"
    assert headers["X-KVCache-Prompt-Tokens"] == str(len(tokens))
    assert headers["X-KVCache-Cached-Tokens"] == "0"
    assert headers["X-KVCache-Prefill-Attempts"] == "1"
    assert headers["X-KVCache-Prefill-Worker"] and headers["X-KVCache-Decode-Worker"]

    headers, got, text = completion(router, prompt)
    assert (got, text) == (want, ref.text(want))
    assert headers["X-KVCache-Route"] == "skip" and headers["X-KVCache-Prefill-Skipped"] == "true"
    assert headers["X-KVCache-Cached-Tokens"] == str(len(tokens))  # the partial tail too: stored by the prefill
    assert headers["X-KVCache-Prefill-Attempts"] == "0" and "X-KVCache-Prefill-Worker" not in headers
    assert metric(router, "kvcache_router_prefill_skipped_total") == skipped + 1
    assert metric(router, "kvcache_router_requests_total", code="200", endpoint="completions", route="skip") >= 1


def test_decode_worker_loads_what_the_prefill_stored(
    router: RouterProcess, decode: OpenAIWorkerProcess, ref: Reference
) -> None:
    """The hand-off itself: after the router's prefill the decode worker computes only the last prompt token."""
    prompt = words(2 * CHUNK + 3, seed=2)
    tokens = ref.encode(prompt)
    status, headers, raw = post(f"{router.url}/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS})
    assert status == 200 and headers["X-KVCache-Route"] == "prefill"
    answer = json.loads(raw)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tokens) - 1
    assert answer["choices"][0]["text"] == ref.text(ref.generate(tokens))


def test_streamed_completion_gives_the_same_tokens(router: RouterProcess, ref: Reference) -> None:
    prompt = words(2 * CHUNK + 9, seed=3)
    want = ref.generate(ref.encode(prompt))
    headers, got, text = completion(router, prompt, stream=True)
    assert (got, text) == (want, ref.text(want))
    assert headers["X-KVCache-Route"] == "prefill"
    headers, got, text = completion(router, prompt, stream=True)
    assert (got, text) == (want, ref.text(want))
    assert headers["X-KVCache-Route"] == "skip"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_usage_only_with_stream_options_include_usage(
    router: RouterProcess, ref: Reference, include_usage: bool
) -> None:
    prompt = words(CHUNK + 3, seed=30 + include_usage)
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "stream": True,
            "stream_options": {"include_usage": include_usage}}  # fmt: skip
    status, _, raw = post(f"{router.url}/v1/completions", body)
    assert status == 200, raw
    chunks = events(raw)
    assert chunks[-1] == "[DONE]"
    if not include_usage:
        assert not [c for c in chunks[:-1] if "usage" in c]
        return
    *tokens, usage = chunks[:-1]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in tokens)
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == len(ref.encode(prompt))
    assert usage["usage"]["completion_tokens"] == NEW_TOKENS
    assert usage["usage"]["total_tokens"] == len(ref.encode(prompt)) + NEW_TOKENS


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completion_gives_the_tokens_of_the_chat_template(
    router: RouterProcess, ref: Reference, stream: bool
) -> None:
    messages = [
        {"role": "system", "content": words(2 * CHUNK, seed=4)},
        {"role": "user", "content": words(7, seed=5 + stream)},
    ]
    tokens = ref.chat_tokens(messages)
    want = ref.text(ref.generate(tokens))
    body = {"model": ref.name, "messages": messages, "max_tokens": NEW_TOKENS, "stream": stream}
    status, headers, raw = post(f"{router.url}/v1/chat/completions", body)
    assert status == 200, raw
    assert headers["X-KVCache-Prompt-Tokens"] == str(len(tokens))
    if stream:
        chunks = events(raw)
        assert chunks[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    else:
        answer = json.loads(raw)
        assert answer["object"] == "chat.completion"
        text = answer["choices"][0]["message"]["content"]
    assert text == want


def test_shared_system_prompt_skips_prefill_for_a_new_question(router: RouterProcess, ref: Reference) -> None:
    system = words(3 * CHUNK, seed=6)  # three whole chunks, shared
    first, second = f"{system} {words(5, seed=7)}", f"{system} {words(9, seed=8)}"
    headers, _, _ = completion(router, first)
    assert headers["X-KVCache-Route"] == "prefill"
    headers, got, _ = completion(router, second)
    assert headers["X-KVCache-Route"] == "skip"  # only the question's chunk is left to compute
    assert headers["X-KVCache-Cached-Tokens"] == str(3 * CHUNK)
    assert got == ref.generate(ref.encode(second))


def test_prompt_of_token_ids_is_looked_up_as_it_is(router: RouterProcess, ref: Reference) -> None:
    tokens = ref.encode(words(2 * CHUNK + 5, seed=12))
    body = {"prompt": tokens, "max_tokens": NEW_TOKENS, "return_token_ids": True}
    for route in ("prefill", "skip"):
        status, headers, raw = post(f"{router.url}/v1/completions", body)
        assert status == 200 and headers["X-KVCache-Route"] == route
        assert headers["X-KVCache-Prompt-Tokens"] == str(len(tokens))
        assert json.loads(raw)["choices"][0]["token_ids"] == ref.generate(tokens)


def test_cache_salt_separates_key_spaces(router: RouterProcess, ref: Reference) -> None:
    prompt = words(2 * CHUNK + 2, seed=9)
    assert completion(router, prompt)[0]["X-KVCache-Route"] == "prefill"
    headers, got, _ = completion(router, prompt, cache_salt="tenant-b")
    assert headers["X-KVCache-Route"] == "prefill" and headers["X-KVCache-Cached-Tokens"] == "0"
    assert got == ref.generate(ref.encode(prompt))
    headers, got, _ = completion(router, prompt, cache_salt="tenant-b")  # the salted KV is stored now
    assert headers["X-KVCache-Route"] == "skip" and got == ref.generate(ref.encode(prompt))
    headers, _, _ = completion(router, prompt, cache_salt="tenant-c")
    assert headers["X-KVCache-Route"] == "prefill"


def test_models_and_health(router: RouterProcess, ref: Reference) -> None:
    status, raw = get(f"{router.url}/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [ref.name]
    status, raw = get(f"{router.url}/health")
    assert status == 200 and json.loads(raw)["status"] == "ok"


# -- bad requests --------------------------------------------------------------------------------------


def _error(status: int, raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_errors_and_the_router_stays_up(router: RouterProcess, ref: Reference) -> None:
    url = f"{router.url}/v1/completions"
    status, headers, raw = post(url, {"model": "no-such-model", "prompt": "bada"})
    assert status == 404 and _error(status, raw)["code"] == "model_not_found"
    assert headers["X-KVCache-Route"] == "none"
    status, _, raw = post(url, b'{"prompt": "bada", ')
    assert status == 400 and _error(status, raw)["code"] == "invalid_json"
    status, _, raw = post(url, b"[1, 2]")
    assert status == 400 and _error(status, raw)["code"] == "invalid_json"
    status, _, raw = post(url, {"prompt": words(600, seed=10), "max_tokens": 4})  # the context is 512
    error = _error(status, raw)
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    status, _, raw = post(
        f"{router.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": words(20, 1)}], "max_tokens": 500},
    )
    assert status == 400 and _error(status, raw)["param"] == "messages"
    status, _, raw = post(url, {"prompt": "x" * 70000})  # http.max_body_bytes is 64 KiB here
    assert status == 413 and _error(status, raw)["code"] == "request_too_large"
    status, _, raw = post(url, {"prompt": {"not": "a prompt"}})  # the worker's own refusal, passed through
    assert status == 400 and _error(status, raw)["code"] == "invalid_prompt"

    status, _, raw = post(f"{router.url}/v1/embeddings", {"input": "bada"})
    assert status == 404 and _error(status, raw)["code"] == "not_found"

    assert metric(router, "kvcache_router_requests_total", code="404", endpoint="completions", route="none") >= 1
    assert get(f"{router.url}/health")[0] == 200
    prompt = words(CHUNK + 1, seed=11)
    assert completion(router, prompt)[1] == ref.generate(ref.encode(prompt))


# -- failures ------------------------------------------------------------------------------------------


def test_prefill_worker_killed_mid_run_fails_no_request(
    model_dir: str, kv_server: str, prefill: OpenAIWorkerProcess, decode: OpenAIWorkerProcess, ref: Reference
) -> None:
    """Requests in flight on a prefill worker that dies are retried on the other one, and it is ejected."""
    slow = OpenAIWorkerProcess(model_dir, "prefill", kv_server, "--chunk-tokens", str(CHUNK), "--delay-s", "5")
    with slow, RouterProcess([slow.url, prefill.url], [decode.url], kv_server, *FAST_HEALTH) as router:
        prompts = [words(2 * CHUNK + 4, seed=100 + i) for i in range(4)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(completion, router, p) for p in prompts]
            deadline = time.monotonic() + 30
            while (
                in_flight := metric(router, "kvcache_router_worker_outstanding", role="prefill", worker=slow.url)
            ) < 1:
                assert time.monotonic() < deadline, "no request reached the slow prefill worker"
                time.sleep(0.02)
            assert slow.proc is not None
            slow.proc.send_signal(signal.SIGKILL)  # mid-prefill: it sleeps 5 s before computing
            results = [f.result(timeout=60) for f in futures]
        for prompt, (headers, got, _) in zip(prompts, results, strict=True):
            assert got == ref.generate(ref.encode(prompt))
            assert headers["X-KVCache-Route"] == "prefill"
            assert headers["X-KVCache-Prefill-Worker"] == prefill.url
        retried = sum(h["X-KVCache-Prefill-Attempts"] == "2" for h, _, _ in results)
        assert retried >= in_flight
        assert metric(router, "kvcache_router_prefill_retries_total") == retried
        # Out of rotation: by a refused connection, or by its failed health checks, whichever came first.
        wait_for_metric(router, 0, "kvcache_router_worker_healthy", role="prefill", worker=slow.url)
        assert metric(router, "kvcache_router_worker_ejections_total", role="prefill", worker=slow.url) == 1
        # Later requests never try the dead worker.
        headers, got, _ = completion(router, words(2 * CHUNK + 6, seed=120))
        assert headers["X-KVCache-Prefill-Attempts"] == "1" and headers["X-KVCache-Prefill-Worker"] == prefill.url


def test_hung_prefill_worker_times_out_then_fails_its_health_checks(
    model_dir: str, kv_server: str, prefill: OpenAIWorkerProcess, decode: OpenAIWorkerProcess, ref: Reference
) -> None:
    """A worker that accepts connections but never answers (SIGSTOP): the prefill deadline, then ejection."""
    with OpenAIWorkerProcess(model_dir, "prefill", kv_server, "--chunk-tokens", str(CHUNK)) as hung:
        assert hung.proc is not None
        # Health checks too rare to matter: the request's own deadline must save it.
        slow_checks = ("--set", "workers.health_interval_s=600", "--set", "workers.prefill_timeout_s=1")
        with RouterProcess([hung.url, prefill.url], [decode.url], kv_server, *slow_checks) as router:
            hung.proc.send_signal(signal.SIGSTOP)
            try:
                outcomes = [completion(router, words(2 * CHUNK + 1, seed=700 + i)) for i in range(2)]
            finally:
                hung.proc.send_signal(signal.SIGCONT)
            # Least outstanding with ties taken in turn: one of the two tried the hung worker first.
            attempts = sorted(h["X-KVCache-Prefill-Attempts"] for h, _, _ in outcomes)
            assert attempts == ["1", "2"]
            assert {h["X-KVCache-Prefill-Worker"] for h, _, _ in outcomes} == {prefill.url}
            assert (
                metric(
                    router, "kvcache_router_upstream_failures_total", role="prefill", worker=hung.url, reason="timeout"
                )
                == 1
            )
        with RouterProcess([hung.url, prefill.url], [decode.url], kv_server, *FAST_HEALTH) as router:
            hung.proc.send_signal(signal.SIGSTOP)
            try:
                wait_for_metric(router, 0, "kvcache_router_worker_healthy", role="prefill", worker=hung.url)
                for i in range(3):  # none of them waits for the hung worker
                    prompt = words(2 * CHUNK + 2, seed=710 + i)
                    headers, got, _ = completion(router, prompt)
                    assert (
                        headers["X-KVCache-Prefill-Attempts"] == "1"
                        and headers["X-KVCache-Prefill-Worker"] == prefill.url
                    )
                    assert got == ref.generate(ref.encode(prompt))
            finally:
                hung.proc.send_signal(signal.SIGCONT)
            wait_for_metric(router, 1, "kvcache_router_worker_healthy", role="prefill", worker=hung.url)  # back
            assert metric(router, "kvcache_router_worker_ejections_total", role="prefill", worker=hung.url) == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_healthy_prefill_worker_falls_back_to_decode_only(
    kv_server: str, decode: OpenAIWorkerProcess, ref: Reference
) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    with RouterProcess([dead], [decode.url], kv_server, *FAST_HEALTH) as router:
        prompt = words(3 * CHUNK + 1, seed=200)
        headers, got, _ = completion(router, prompt, stream=True)
        assert got == ref.generate(ref.encode(prompt))
        assert headers["X-KVCache-Route"] == "decode-only" and headers["X-KVCache-Prefill-Attempts"] == "0"
        assert metric(router, "kvcache_router_decode_only_total") == 1
        assert metric(router, "kvcache_router_worker_healthy", role="prefill", worker=dead) == 0
        assert get(f"{router.url}/health")[0] == 200  # decode-only still serves


def test_kvcache_down_routes_as_uncached(
    prefill: OpenAIWorkerProcess, decode: OpenAIWorkerProcess, ref: Reference
) -> None:
    with RouterProcess([prefill.url], [decode.url], f"127.0.0.1:{_closed_port()}") as router:
        prompt = words(2 * CHUNK + 7, seed=300)
        headers, got, _ = completion(router, prompt)
        assert got == ref.generate(ref.encode(prompt))
        assert headers["X-KVCache-Route"] == "prefill" and headers["X-KVCache-Lookup"] == "failed"
        assert "X-KVCache-Cached-Tokens" not in headers
        assert metric(router, "kvcache_router_lookup_failures_total", stage="lookup") == 1
        assert router.stop() == 0  # SIGTERM: a clean exit


def test_no_decode_worker_is_a_503(prefill: OpenAIWorkerProcess, kv_server: str) -> None:
    with RouterProcess([prefill.url], [f"http://127.0.0.1:{_closed_port()}"], kv_server, *FAST_HEALTH) as router:
        status, raw = get(f"{router.url}/health")
        assert status == 503 and json.loads(raw)["status"] == "unavailable"
        status, _, raw = post(f"{router.url}/v1/completions", {"prompt": words(3, 1)})
        assert status == 503 and json.loads(raw)["error"]["code"] == "no_worker"


def test_client_disconnect_mid_stream_releases_the_decode_worker(
    router: RouterProcess, decode: OpenAIWorkerProcess
) -> None:
    body = json.dumps({"prompt": words(CHUNK, seed=400), "max_tokens": 400, "stream": True}).encode()
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"data: " not in received:  # the stream has started
            piece = s.recv(65536)
            assert piece, received
            received += piece
        assert metric(router, "kvcache_router_worker_outstanding", role="decode", worker=decode.url) == 1
    deadline = time.monotonic() + 30
    while metric(router, "kvcache_router_worker_outstanding", role="decode", worker=decode.url) != 0:
        assert time.monotonic() < deadline, "the decode call outlived its client"
        time.sleep(0.05)


def test_namespace_from_the_config_for_workers_that_do_not_publish_it(
    model_dir: str, kv_server: str, prefill: OpenAIWorkerProcess, decode: OpenAIWorkerProcess, ref: Reference
) -> None:
    """What a router in front of vLLM does ([namespace] in its config): the same keys, the same skip."""
    namespace = {"model_id": model_dir, "kv_dtype": "float32", "chunk_tokens": CHUNK, "num_layers": 2}
    namespace |= {"num_kv_heads": 2, "head_size": 16}
    flags = [f"--set=namespace.{k}={v}" for k, v in namespace.items()] + ["--set=kvcache.namespace_source=config"]
    with RouterProcess([prefill.url], [decode.url], kv_server, *flags) as router:
        prompt = words(2 * CHUNK + 11, seed=500)
        assert completion(router, prompt)[0]["X-KVCache-Route"] == "prefill"
        headers, got, _ = completion(router, prompt)
        assert headers["X-KVCache-Route"] == "skip" and got == ref.generate(ref.encode(prompt))


def test_the_clients_api_key_reaches_the_workers(model_dir: str, kv_server: str, ref: Reference) -> None:
    """Workers started with an API key (vLLM's --api-key) get the client's Authorization header."""
    args = ("--chunk-tokens", str(CHUNK), "--api-key", "sesame")
    with (
        OpenAIWorkerProcess(model_dir, "decode", kv_server, *args) as locked,
        RouterProcess([], [locked.url], kv_server) as router,
    ):
        body = {"prompt": words(CHUNK + 3, seed=600), "max_tokens": NEW_TOKENS}
        status, _, raw = post(f"{router.url}/v1/completions", body)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"  # the worker's, unchanged
        status, headers, raw = post(f"{router.url}/v1/completions", body, headers={"Authorization": "Bearer sesame"})
        assert status == 200 and headers["X-KVCache-Route"] == "decode-only"
        assert json.loads(raw)["choices"][0]["text"] == ref.text(ref.generate(ref.encode(body["prompt"])))


def test_requests_beyond_the_concurrency_bound_wait_then_get_503(
    kv_server: str, prefill: OpenAIWorkerProcess, decode: OpenAIWorkerProcess
) -> None:
    bound = ("--set", "http.max_concurrent_requests=1", "--set", "http.queue_timeout_s=0.2")
    with RouterProcess([prefill.url], [decode.url], kv_server, *bound) as router:
        body = json.dumps({"prompt": words(CHUNK, seed=800), "max_tokens": 480, "stream": True}).encode()
        host, port = router.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            received = b""
            while b"data: " not in received:  # the one slot is taken, for 480 tokens
                piece = s.recv(65536)
                assert piece, received
                received += piece
            status, _, raw = post(f"{router.url}/v1/completions", {"prompt": words(3, seed=801)})
            assert status == 503 and json.loads(raw)["error"]["code"] == "overloaded"
        assert metric(router, "kvcache_router_requests_total", code="503", endpoint="completions", route="none") == 1


def test_each_request_is_one_log_line_under_its_request_id(
    kv_server: str, prefill: OpenAIWorkerProcess, decode: OpenAIWorkerProcess
) -> None:
    with RouterProcess([prefill.url], [decode.url], kv_server, "--log-level", "info") as router:
        prompt = words(2 * CHUNK + 3, seed=900)
        for request_id in ("req-1", "req-2"):
            status, headers, _ = post(
                f"{router.url}/v1/completions", {"prompt": prompt}, headers={"X-Request-Id": request_id}
            )
            assert status == 200 and headers["X-Request-Id"] == request_id
        deadline = time.monotonic() + 10
        while "req-2 " not in (log := router.stderr_tail(100_000)):  # written once the answer is out
            assert time.monotonic() < deadline, log
            time.sleep(0.05)
    first = re.search(r"req-1 completions 200 route=prefill prompt_tokens=35 cached_tokens=0 lookup=ok (.*)\n", log)
    assert first, log
    assert re.fullmatch(
        rf"prefill={prefill.url} attempts=1 decode={decode.url} ttft_s=[\d.]+ total_s=[\d.]+", first.group(1)
    ), first.group(1)
    second = re.search(r"req-2 completions 200 route=skip prompt_tokens=35 cached_tokens=35 lookup=ok (.*)\n", log)
    assert second and second.group(1).startswith(f"prefill=- attempts=0 decode={decode.url} "), log
