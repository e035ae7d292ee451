"""vLLM's pooling routes (``docs/serve.md#pooling-models``) on a pooling model:
``/v1/rerank`` (and ``/rerank``, ``/v2/rerank``), ``/v1/score``, ``/classify`` and
``/pooling`` -- their bodies, their refusals, their bounds and their price (each item one
prefill step). Time-dependent tests run on the autojump MockClock; Cohere's SDK reranks
on a real socket."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import attrs
import cohere
import numpy as np
import pytest
import trio
import trio.testing

from inference_lab.api.pooling import MAX_ITEMS, NUM_CLASSES, relevance
from inference_lab.api.requests import count_text_tokens
from inference_lab.core.config import load_deployment
from inference_lab.errors import ConfigError
from inference_lab.serve.settings import load_settings
from inference_lab.serve.settings_env import settings_from_env
from tests.conftest import CONFIGS, GPT, ServeFactory, chat_body, make_settings
from tests.serve_util import running_server

RERANKER = "Qwen3-Reranker-0.6B"
RERANKER_CONFIG = CONFIGS / "pooling" / f"{RERANKER}.toml"
DOCS = [
    "Paris is the capital of France.",
    "Bananas are rich in potassium.",
    "The capital of Japan is Tokyo.",
]
QUERY = "What is the capital of France?"


def settings(**scheduler: Any) -> Any:
    """gpt-oss-20b (generative) and the reranker (a pooling model)."""
    reranker = load_deployment(RERANKER_CONFIG, "b200")
    if scheduler:
        reranker = attrs.evolve(reranker, scheduler=attrs.evolve(reranker.scheduler, **scheduler))
    base = make_settings()
    return attrs.evolve(
        base, deployments=(base.deployments[0], reranker), pooling_models=frozenset({RERANKER})
    )


async def post(s: Any, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = await s.post(path, body)
    return response.status_code, json.loads(await response.get_data())


def pair_tokens(query: str, doc: str) -> int:
    """Rule 1's prompt of a (query, document) pair under the byte rule."""
    return count_text_tokens(query) + count_text_tokens(doc) + 1  # (no special tokens here)


async def test_rerank_answers_in_cohere_and_jina_shape_on_every_path(
    serve: ServeFactory,
) -> None:
    """Results sorted by relevance (the document that shares the query's words first),
    each with its index, document text and score in 0..1; ``top_n`` keeps the best;
    ``usage`` counts every pair's prompt; the three paths give the same scores."""
    async with serve(settings()) as s:
        status, full = await post(
            s, "/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCS}
        )
        _, top = await post(
            s, "/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCS, "top_n": 1}
        )
        _, v2 = await post(s, "/v2/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCS})
    assert status == 200
    assert full["id"].startswith("rerank-") and full["model"] == RERANKER
    results = full["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0 < x < 1 for x in scores)
    assert [r["index"] for r in results] == [0, 2, 1]  # France, then a capital, then fruit
    assert results[0]["document"] == {"text": DOCS[0]}
    assert scores[0] == pytest.approx(relevance(0, RERANKER, QUERY, DOCS[0]), abs=1e-8)
    assert top["results"] == results[:1]
    assert v2["results"] == results
    prompt = sum(pair_tokens(QUERY, d) for d in DOCS)
    assert full["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt}


async def test_score_pairs_one_to_many_and_many_to_many(serve: ServeFactory) -> None:
    """``text_1`` against each ``text_2`` (1:N), pairwise (N:N), and the ``queries`` /
    ``documents`` spelling; a mismatched N:M is a 400 naming the second field."""
    async with serve(settings()) as s:
        status, one_n = await post(
            s, "/v1/score", {"model": RERANKER, "text_1": QUERY, "text_2": DOCS}
        )
        _, n_n = await post(
            s, "/score", {"model": RERANKER, "queries": [QUERY, "fruit"], "documents": DOCS[:2]}
        )
        bad, error = await post(
            s, "/v1/score", {"model": RERANKER, "text_1": ["a", "b"], "text_2": DOCS}
        )
    assert status == 200 and one_n["id"].startswith("score-") and one_n["object"] == "list"
    assert [d["index"] for d in one_n["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in one_n["data"])
    expected = [relevance(0, RERANKER, QUERY, d) for d in DOCS]
    assert [d["score"] for d in one_n["data"]] == pytest.approx(expected, abs=1e-8)
    assert [d["score"] for d in n_n["data"]] == pytest.approx(
        [relevance(0, RERANKER, QUERY, DOCS[0]), relevance(0, RERANKER, "fruit", DOCS[1])],
        abs=1e-8,
    )
    prompt = sum(pair_tokens(QUERY, d) for d in DOCS)
    assert one_n["usage"]["prompt_tokens"] == prompt == one_n["usage"]["total_tokens"]
    assert bad == 400 and error["error"]["param"] == "text_2"


async def test_classify_and_pooling(serve: ServeFactory) -> None:
    """``/classify``: labels with probabilities summing to 1 (logits without activation);
    ``/pooling``: the ``/v1/embeddings`` vector, or the probabilities for ``task:
    classify``."""
    async with serve(settings()) as s:
        status, classified = await post(s, "/classify", {"model": RERANKER, "input": ["a", "b"]})
        _, logits = await post(
            s, "/classify", {"model": RERANKER, "input": "a", "use_activation": False}
        )
        _, pooled = await post(s, "/pooling", {"model": RERANKER, "input": "hello"})
        _, embedded = await post(s, "/v1/embeddings", {"model": RERANKER, "input": "hello"})
        _, probs = await post(s, "/pooling", {"model": RERANKER, "input": "a", "task": "classify"})
    assert status == 200 and classified["id"].startswith("classify-")
    for item in classified["data"]:
        assert item["num_classes"] == NUM_CLASSES == len(item["probs"])
        assert sum(item["probs"]) == pytest.approx(1.0, abs=1e-6)
        assert item["label"] == f"LABEL_{int(np.argmax(item['probs']))}"
    raw = np.array(logits["data"][0]["probs"])
    softmax = np.exp(raw) / np.exp(raw).sum()
    assert softmax.tolist() == pytest.approx(classified["data"][0]["probs"], abs=1e-6)
    assert pooled["id"].startswith("pool-") and pooled["data"][0]["object"] == "pooling"
    assert pooled["data"][0]["data"] == embedded["data"][0]["embedding"]
    assert len(pooled["data"][0]["data"]) == 1024  # the reranker's hidden_dim
    assert probs["data"][0]["data"] == classified["data"][0]["probs"]
    usage = count_text_tokens("a") + count_text_tokens("b")
    assert classified["usage"]["prompt_tokens"] == usage


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/rerank", {"model": GPT, "query": "q", "documents": ["d"]}, 400, "model"),
        ("/v1/score", {"model": GPT, "text_1": "q", "text_2": "d"}, 400, "model"),
        ("/classify", {"model": GPT, "input": "x"}, 400, "model"),
        ("/pooling", {"model": GPT, "input": "x"}, 400, "model"),
        ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]}, 404, "model"),
        ("/v1/rerank", {"model": RERANKER, "query": "q"}, 400, "documents"),
        ("/v1/rerank", {"model": RERANKER, "query": 3, "documents": ["d"]}, 400, "query"),
        ("/v1/rerank", {"model": RERANKER, "query": "q", "documents": [{"x": 1}]}, 400, "documents[0]"),
        ("/v1/rerank", {"model": RERANKER, "query": "q", "documents": ["d"], "top_n": -1}, 400, "top_n"),
        ("/v1/score", {"model": RERANKER, "text_1": "q"}, 400, "text_1"),
        ("/pooling", {"model": RERANKER, "input": "x", "task": "token_embed"}, 400, "task"),
        ("/pooling", {"model": RERANKER, "messages": [{"role": "user"}]}, 400, "messages"),
        ("/classify", {"model": RERANKER, "input": "x", "use_activation": 1}, 400, "use_activation"),
        ("/v1/score", {"model": RERANKER, "text_1": "q", "text_2": "d", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ],
)  # fmt: skip
async def test_bad_requests_are_refused_naming_the_field(
    serve: ServeFactory, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    async with serve(settings()) as s:
        got, error = await post(s, path, body)
        assert s.runtime(RERANKER).snapshot().admitted == 0
    assert (got, error["error"]["param"]) == (status, param)
    if param == "model" and status == 400:
        assert error["error"]["code"] == "model_not_supported"
        assert "--pooling-models" in error["error"]["message"]


async def test_items_are_bounded_and_each_must_fit(serve: ServeFactory) -> None:
    """More than MAX_ITEMS documents is a 400 before any work; a pair past the model's
    context is a 400 naming its document; ``truncate_prompt_tokens`` caps each pair."""
    too_many = {"model": RERANKER, "query": "q", "documents": ["d"] * (MAX_ITEMS + 1)}
    long_doc = "word " * 50_000
    async with serve(settings()) as s:
        status, error = await post(s, "/v1/rerank", too_many)
        assert status == 400 and error["error"]["param"] == "documents"
        assert f"{MAX_ITEMS:,}" in error["error"]["message"]
        status, error = await post(
            s, "/v1/rerank", {"model": RERANKER, "query": "q", "documents": ["d", long_doc]}
        )
        assert status == 400 and error["error"]["code"] == "context_length_exceeded"
        assert error["error"]["param"] == "documents[1]"
        assert s.runtime(RERANKER).snapshot().admitted == 0
        status, capped = await post(
            s,
            "/v1/rerank",
            {
                "model": RERANKER,
                "query": "q",
                "documents": [long_doc],
                "truncate_prompt_tokens": 512,
            },
        )
    assert status == 200 and capped["usage"]["prompt_tokens"] == 512


async def test_a_pair_costs_one_prefill_step(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Alone on an idle engine, a rerank of one document answers when the prefill over
    its pair's positions ends: the time a one-token completion of as many tokens takes;
    N documents are N engine requests."""
    doc = "x " * 300
    async with serve(settings()) as s:
        t0 = trio.current_time()
        status, _ = await post(
            s, "/v1/rerank", {"model": RERANKER, "query": "q", "documents": [doc]}
        )
        reranked = trio.current_time() - t0
        stats = s.runtime(RERANKER).statistics().engine
        assert status == 200 and (stats.finished, stats.steps) == (1, 1)
        await post(s, "/v1/rerank", {"model": RERANKER, "query": "q", "documents": DOCS})
        assert s.runtime(RERANKER).snapshot().admitted == 1 + len(DOCS)
    async with serve(settings()) as s:
        t0 = trio.current_time()
        prompt = list(range(pair_tokens("q", doc)))
        response = await s.post(
            "/v1/completions", {"model": RERANKER, "prompt": prompt, "max_tokens": 1}
        )
        assert response.status_code == 200
        completed = trio.current_time() - t0
    assert reranked == pytest.approx(completed, rel=1e-12) and reranked > 0


async def test_a_batch_is_admitted_whole_or_refused_whole(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With the batch full and one waiting place, a rerank of two documents is a 529 and
    nothing of it stays admitted."""
    async with serve(settings(max_num_seqs=1, max_waiting=1)) as s:
        rt = s.runtime(RERANKER)
        body = chat_body(max_tokens=60, stream=True, model=RERANKER)
        async with s.stream(body) as running:
            await running.next_chunk()
            await running.next_chunk()
            before = rt.snapshot()
            status, error = await post(
                s, "/v1/rerank", {"model": RERANKER, "query": "q", "documents": ["a", "b"]}
            )
            assert status == 529 and error["error"]["code"] == "queue_saturated"
            after = rt.snapshot()
            assert (after.admitted, after.queued) == (before.admitted, before.queued)
            await running.read_all()


def test_pooling_models_are_named_or_all() -> None:
    """``--pooling-models`` takes served names or ``all``; an unknown name is an error
    naming the flag and the served models."""
    one = load_settings(config=RERANKER_CONFIG, pooling_models="all")
    assert one.pooling_models == frozenset({RERANKER})
    named = load_settings(config=RERANKER_CONFIG, pooling_models=f" {RERANKER} ")
    assert named.pooling_models == frozenset({RERANKER})
    assert load_settings(config=RERANKER_CONFIG).pooling_models == frozenset()
    with pytest.raises(ConfigError, match=r"--pooling-models: no served model is named 'x'"):
        load_settings(
            config=RERANKER_CONFIG,
            pooling_models="x",
            labels={"pooling_models": "--pooling-models"},
        )
    env = {"INFERENCE_LAB_CONFIG": str(RERANKER_CONFIG), "INFERENCE_LAB_POOLING_MODELS": "all"}
    assert settings_from_env(env).pooling_models == frozenset({RERANKER})


@pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")
async def test_cohere_sdk_reranks() -> None:
    """Cohere's v2 client (``POST /v2/rerank``) reads the answer: results best first, the
    scores the server computed."""
    with trio.fail_after(60):
        async with running_server(settings()) as (url, _, _state):

            def call() -> Any:
                client = cohere.ClientV2(api_key="unused", base_url=url)
                return client.rerank(model=RERANKER, query=QUERY, documents=DOCS, top_n=2)

            response = await trio.to_thread.run_sync(call)
    assert [r.index for r in response.results] == [0, 2]
    for result in response.results:
        expected = relevance(0, RERANKER, QUERY, DOCS[result.index])
        assert math.isclose(result.relevance_score, expected, abs_tol=1e-8)
