"""Answers that end like a model's: without a ``--workload`` a prose answer's length is
drawn from the default length model (``api/lengths.py``), one seeded generator per model,
capped by ``max_tokens`` (``finish_reason: length`` only then, ``stop`` below it); vLLM's
``ignore_eos`` and ``min_tokens`` decide it as vLLM's sampler does; ``--run-to-max-tokens``
restores answers that run to their cap; JSON answers draw nothing."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import trio

from inference_lab.api.lengths import (
    CHAT_LOG_MEAN_TOKENS,
    DEFAULT_ANSWER_LENGTHS,
    SPREAD,
    median_tokens,
)
from inference_lab.core.config import LognormalDist
from inference_lab.serve import load_settings, settings_from_env
from tests.conftest import CONFIGS, GPT, ServeFactory, chat_body, make_settings


def expected_lengths(count: int, cap: int, seed: int = 0) -> list[int]:
    """What the server's generator for one model draws, in order: ``min(draw, cap)``."""
    rng = np.random.default_rng(seed)
    return [max(1, min(int(DEFAULT_ANSWER_LENGTHS.sample(rng, 1)[0]), cap)) for _ in range(count)]


async def post(s: Any, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    response = await s.post(path, body)
    return response.status_code, json.loads(await response.get_data())


def test_the_default_distribution_is_the_documented_lognormal() -> None:
    """A lognormal of sigma 1.0 whose mean is LMSYS-Chat-1M's 214.5 tokens per response:
    median 130, one answer in four past 256 tokens."""
    dist = DEFAULT_ANSWER_LENGTHS
    assert isinstance(dist, LognormalDist)
    assert (dist.mean, dist.std_dev) == (4.8683, SPREAD) == (4.8683, 1.0)
    assert math.exp(dist.mean + dist.std_dev**2 / 2) == pytest.approx(
        CHAT_LOG_MEAN_TOKENS, rel=1e-4
    )
    assert round(median_tokens(dist)) == 130
    draws = dist.sample(np.random.default_rng(1), 200_000)
    assert np.mean(draws > 256) == pytest.approx(0.249, abs=0.005)
    assert np.mean(draws) == pytest.approx(CHAT_LOG_MEAN_TOKENS, rel=0.02)


async def test_prose_lengths_are_drawn_and_end_stop_below_the_cap(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Sequential answers take the model's draws in order: ``stop`` below ``max_tokens``,
    ``length`` exactly when the draw reached it; chat and completions alike, streamed or
    not, and the text is that many placeholder tokens."""
    cap = 256
    expected = expected_lengths(40, cap)
    assert any(n == cap for n in expected) and any(n < cap for n in expected)
    got: list[tuple[int, str]] = []
    async with serve(make_settings(run_to_max_tokens=False)) as s:
        for i in range(40):
            if i % 4 == 3:
                async with s.stream(chat_body(max_tokens=cap, stream=True)) as stream:
                    await stream.read_all()
                frames = [json.loads(p) for p in stream.frames()[:-1]]
                text = "".join(f["choices"][0]["delta"].get("content", "") for f in frames)
                got.append((len(frames) - 2, frames[-1]["choices"][0]["finish_reason"]))
                assert len(text.split(" ")) == len(frames) - 2
                continue
            if i % 4 == 1:
                _, body = await post(
                    s, {"model": GPT, "prompt": "hi", "max_tokens": cap}, "/v1/completions"
                )
            else:
                _, body = await post(s, chat_body(max_tokens=cap))
            got.append((body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]))
    assert [n for n, _ in got] == expected
    assert [r for _, r in got] == ["length" if n == cap else "stop" for n in expected]


async def test_seed_ignore_eos_min_tokens_and_run_to_max_tokens(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """``--seed`` reseeds the generator; ``ignore_eos`` runs to ``max_tokens`` and draws
    nothing (the next answer gets the first draw); ``min_tokens`` is a floor on the draw;
    ``--run-to-max-tokens`` makes every prose answer run to its cap."""
    async with serve(make_settings(run_to_max_tokens=False, seed=5)) as s:
        _, forced = await post(s, chat_body(max_tokens=300, ignore_eos=True))
        _, drawn = await post(s, chat_body(max_tokens=1000))
        _, floored = await post(s, chat_body(max_tokens=1000, min_tokens=900))
    first, second = expected_lengths(2, 1000, seed=5)
    assert (forced["usage"]["completion_tokens"], forced["choices"][0]["finish_reason"]) == (
        300,
        "length",
    )
    assert drawn["usage"]["completion_tokens"] == first
    assert floored["usage"]["completion_tokens"] == max(second, 900)
    async with serve(make_settings(run_to_max_tokens=True)) as s:
        _, capped = await post(s, chat_body(max_tokens=77))
    assert (capped["usage"]["completion_tokens"], capped["choices"][0]["finish_reason"]) == (
        77,
        "length",
    )


async def test_min_tokens_above_max_tokens_and_bad_length_fields_are_400s(
    serve: ServeFactory,
) -> None:
    """``min_tokens`` above ``max_tokens`` is a 400 naming ``min_tokens`` (vLLM's check); a
    non-boolean ``ignore_eos`` or a negative ``min_tokens`` too."""
    async with serve(make_settings(run_to_max_tokens=False)) as s:
        for extra, param in (
            ({"min_tokens": 11}, "min_tokens"),
            ({"min_tokens": -1}, "min_tokens"),
            ({"ignore_eos": "yes"}, "ignore_eos"),
        ):
            status, body = await post(s, chat_body(max_tokens=10, **extra))
            assert status == 400 and body["error"]["param"] == param, body
            status, body = await post(
                s, {"model": GPT, "prompt": "x", "max_tokens": 10, **extra}, "/v1/completions"
            )
            assert status == 400 and body["error"]["param"] == param, body


async def test_a_stop_string_still_caps_the_draw(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A stop string ends the answer where it completes when the draw reaches it
    (``finish_reason: stop``, the text cut before it)."""
    async with serve(make_settings(run_to_max_tokens=False)) as s:
        _, body = await post(s, chat_body(max_tokens=500, stop=["many"], min_tokens=100))
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"].endswith("she ")
    assert body["usage"]["completion_tokens"] == 46  # the token in which "many" completes


async def test_responses_complete_and_json_answers_draw_nothing(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """A prose Responses answer below its ``max_output_tokens`` is ``completed`` (the SDK's
    ``get_final_response`` then returns); a structured output is as long as its document
    whatever the draws (its length is not drawn)."""
    expected = expected_lengths(3, 256)
    async with serve(make_settings(run_to_max_tokens=False)) as s:
        statuses = []
        for _ in range(3):
            _, body = await post(
                s, {"model": GPT, "input": "hi", "max_output_tokens": 256}, "/v1/responses"
            )
            statuses.append((body["status"], body["usage"]["output_tokens"]))
        request = chat_body(max_tokens=1000, response_format={"type": "json_object"})
        _, first = await post(s, request)
        _, second = await post(s, request)
    assert [n for _, n in statuses] == expected
    assert [status for status, _ in statuses] == [
        "incomplete" if n == 256 else "completed" for n in expected
    ]
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"]
    assert first["choices"][0]["finish_reason"] == "stop"


def test_the_length_and_reasoning_flags_parse_and_read_the_environment() -> None:
    """``--run-to-max-tokens`` / ``INFERENCE_LAB_RUN_TO_MAX_TOKENS`` and
    ``--no-reasoning-content`` / ``INFERENCE_LAB_NO_REASONING_CONTENT``; both off by
    default."""
    import argparse

    from inference_lab.serve import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--run-to-max-tokens", "--no-reasoning-content"])
    assert args.run_to_max_tokens and args.no_reasoning_content
    defaults = parser.parse_args(["serve"])
    assert not defaults.run_to_max_tokens and not defaults.no_reasoning_content
    config = str(CONFIGS / "gpt-oss-20b.toml")
    plain = settings_from_env({"INFERENCE_LAB_CONFIG": config})
    assert (plain.run_to_max_tokens, plain.reasoning_content) == (False, True)
    flagged = settings_from_env(
        {
            "INFERENCE_LAB_CONFIG": config,
            "INFERENCE_LAB_RUN_TO_MAX_TOKENS": "1",
            "INFERENCE_LAB_NO_REASONING_CONTENT": "yes",
        }
    )
    assert (flagged.run_to_max_tokens, flagged.reasoning_content) == (True, False)
    loaded = load_settings(config=config, run_to_max_tokens=True, reasoning_content=False)
    assert (loaded.run_to_max_tokens, loaded.reasoning_content) == (True, False)
