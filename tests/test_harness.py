"""The test harness in-process (the app's test client and in-memory streams, on the
autojump MockClock): directives and their 400s, the bytes and timing of every fault mode,
scripted answers, paced faults that leave the engine idle, faults at a seeded rate, and
engine kill / restart / slowdown. The same modes on real sockets are in
``test_harness_wire.py``."""

from __future__ import annotations

import itertools
import json
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from inference_lab.api.text import VOCABULARY
from inference_lab.core.config import FAULT_MODES, FaultConfig, load_model_config
from inference_lab.errors import ApiError, ConfigError
from inference_lab.serve import ServeSettings, load_settings, settings_from_env
from inference_lab.serve.harness.answers import FLUSH_GRACE
from inference_lab.serve.harness.control import parse_engine_command
from inference_lab.serve.harness.directives import (
    FAULT_HEADER,
    Script,
    ScriptedCall,
    find_script,
    parse_fault_header,
)
from inference_lab.serve.harness.frames import CANCELLED_499, ERROR_400_IN_SSE, ERROR_ENVELOPE_200
from tests.conftest import (
    CONFIGS,
    GPT,
    LLAMA,
    Served,
    ServeFactory,
    Stream,
    chat_body,
    make_settings,
)
from tests.harness_util import chat_frame, content_frames, head_of
from tests.serve_util import assert_idle

DONE = b"data: [DONE]\n\n"


def harness_settings(*models: str, **scheduler: Any) -> ServeSettings:
    return attrs.evolve(make_settings(*models, **scheduler), enable_test_harness=True)


def stream_body(max_tokens: int = 20, **extra: Any) -> dict[str, Any]:
    return chat_body(max_tokens=max_tokens, stream=True, **extra)


def open_stream(
    s: Served,
    body: dict[str, Any],
    fault: str | None = None,
    path: str = "/v1/chat/completions",
) -> AbstractAsyncContextManager[Stream]:
    """``Served.stream`` with an ``x-inference-lab-fault`` header (when ``fault``)."""
    headers = ((FAULT_HEADER, fault.encode()),) if fault is not None else ()
    return s.stream(body, path, headers=headers)


async def run_fault(
    s: Served, fault: str | None, body: dict[str, Any] | None = None, **kw: Any
) -> Stream:
    async with open_stream(s, body if body is not None else stream_body(), fault, **kw) as st:
        await st.read_all()
    return st


def token_times(st: Stream) -> list[float]:
    """Arrival times of the content frames, torn writes left out."""
    return [
        t
        for t, data in st.chunks
        if data.endswith(b"\n\n")
        for frame in data.split(b"\n\n")
        if b'"delta":{"content"' in frame
    ]


async def post_json(s: Served, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    response = await s.client.post(path, json=body, headers=headers)
    return response.status_code, json.loads(await response.get_data())


# -- directives ----------------------------------------------------------------------------------


def test_header_defaults_and_full_grammar() -> None:
    assert parse_fault_header(b"stall") == FaultConfig(mode="stall")
    assert parse_fault_header(b"stall") == FaultConfig(
        mode="stall", after_chunks=3, delay_ms=10, utf8=False, paced=False
    )
    parsed = parse_fault_header(
        b" cut_mid_frame ; after_chunks=12; delay_ms=0 ;utf8=true;paced=true"
    )
    assert parsed == FaultConfig(
        mode="cut_mid_frame", after_chunks=12, delay_ms=0, utf8=True, paced=True
    )
    assert [parse_fault_header(m.encode()).mode for m in FAULT_MODES] == list(FAULT_MODES)
    assert len(FAULT_MODES) == 11


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (b"", "empty"),
        (b"explode", "unknown mode 'explode'"),
        (b"STALL", "unknown mode 'STALL'"),
        (b"stall;bogus=1", "unknown parameter 'bogus'"),
        (b"stall;rate=0.5", "unknown parameter 'rate'"),
        (b"stall;after_chunks", "expected key=value"),
        (b"stall;after_chunks=lots", "after_chunks must be an integer >= 0, got 'lots'"),
        (b"stall;after_chunks=-1", "after_chunks must be an integer >= 0"),
        (b"stall;delay_ms=1.5", "delay_ms must be an integer >= 0"),
        (b"stall;after_chunks=100001", "after_chunks must be <= 100000"),
        (b"stall;paced=yes", "paced must be true or false, got 'yes'"),
        (b"stall;utf8=true", "utf8 applies to mode cut_mid_frame only"),
        (b"stall;delay_ms=1;delay_ms=2", "delay_ms is given twice"),
    ],
)
def test_malformed_header_is_a_400_naming_the_problem(value: bytes, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_fault_header(value)
    assert (info.value.status, info.value.code) == (400, "invalid_fault_directive")
    assert fragment in info.value.message, info.value.message


def test_last_well_formed_marker_across_messages_wins() -> None:
    raw = {
        "messages": [
            {"role": "system", "content": 'x <<respond:{"text":"first"}'},
            {"role": "user", "content": [{"type": "text", "text": '<<respond: {"text":"second"}'}]},
            {"role": "user", "content": '<<respond:{"text":"third"} and <<respond:{"txt":"bad"}'},
            {"role": "user", "content": "<<respond:{not json"},
        ]
    }
    assert find_script(raw) == Script(text="third")
    assert find_script({"messages": [{"role": "user", "content": "plain"}]}) is None
    assert find_script({"messages": [{"role": "user", "content": "<<respond:[1]"}]}) is None


def test_marker_tool_calls_get_compact_arguments_and_the_finish_reason_rule() -> None:
    raw = {
        "messages": [
            {
                "role": "user",
                "content": '<<respond:{"tool_calls":[{"name":"f","arguments":{"a": [1, 2]}},'
                '{"name":"g","arguments":"{broken","id":"mine"},{"name":"h"}],'
                '"finish_reason":"weird"}',
            }
        ]
    }
    script = find_script(raw)
    assert script == Script(
        tool_calls=(
            ScriptedCall(name="f", arguments='{"a":[1,2]}'),
            ScriptedCall(name="g", arguments="{broken", id="mine"),
            ScriptedCall(name="h", arguments="{}"),
        ),
        finish_reason="weird",
    )
    assert script.reason == "tool_calls"
    assert Script(text="x").reason == "stop"
    assert Script(text="x", finish_reason="length").reason == "length"
    assert Script(tool_calls=script.tool_calls, finish_reason="stop").reason == "stop"


async def test_harness_off_refuses_the_header_ignores_markers_and_has_no_control_route(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Off by default: the header is a 400 saying so, a marker is prompt text for the
    engine, and POST /control/engine is an unknown path."""
    async with serve(make_settings()) as s:
        status, body = await post_json(
            s, "/v1/chat/completions", stream_body(), **{"x-inference-lab-fault": "stall"}
        )
        assert status == 400
        assert body["error"]["code"] == "invalid_fault_directive"
        assert "--enable-test-harness" in body["error"]["message"]
        marker = chat_body('<<respond:{"text":"scripted"}', max_tokens=3)
        status, body = await post_json(s, "/v1/chat/completions", marker)
        assert status == 200
        assert body["choices"][0]["message"]["content"] == "the of and"
        assert s.runtime().snapshot().admitted == 1
        status, body = await post_json(s, "/control/engine", {"model": GPT, "action": "kill"})
        assert status == 404
        assert body["error"]["code"] == "not_found"
        assert s.runtime().snapshot().alive


async def test_header_on_non_streaming_is_400_and_unknown_model_still_404(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(harness_settings()) as s:
        status, body = await post_json(
            s, "/v1/chat/completions", chat_body(), **{"x-inference-lab-fault": "stall"}
        )
        assert (status, body["error"]["code"]) == (400, "invalid_fault_directive")
        assert "streaming requests only" in body["error"]["message"]
        assert body["error"]["param"] == "stream"
        status, body = await post_json(
            s,
            "/v1/chat/completions",
            stream_body(model="nope"),
            **{"x-inference-lab-fault": "bogus_mode"},
        )
        assert (status, body["error"]["code"]) == (404, "model_not_found")
        status, body = await post_json(
            s, "/v1/chat/completions", stream_body(), **{"x-inference-lab-fault": "bogus_mode"}
        )
        assert (status, body["error"]["code"]) == (400, "invalid_fault_directive")
        assert "unknown mode 'bogus_mode'" in body["error"]["message"]
        assert s.runtime().snapshot().admitted == 0


# -- every mode's bytes and timing ---------------------------------------------------------------


async def test_cut_between_frames_sends_role_and_n_frames_delay_apart_then_closes(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Role frame at once, ``after_chunks`` content frames ``delay_ms`` apart, one more
    delay and the flush grace, then the body ends without its last message."""
    async with serve(harness_settings()) as s:
        start = trio.current_time()
        st = await run_fault(s, "cut_between_frames;after_chunks=4;delay_ms=20")
        assert st.status == 200 and st.headers["content-type"] == "text/event-stream"
        times = [round(t - start, 9) for t, _ in st.chunks]
        assert times == [0.0, 0.02, 0.04, 0.06, 0.08]
        assert trio.current_time() - start == pytest.approx(0.1 + FLUSH_GRACE)
        frames = [data for _, data in st.chunks]
        head = head_of(frames[0])
        assert frames == [chat_frame(head, {"role": "assistant"}), *content_frames(head, 4)]
        assert s.runtime().snapshot().admitted == 0  # the engine never saw it


@pytest.mark.parametrize(
    ("mode", "ending"),
    [
        ("error_envelope_200", ERROR_ENVELOPE_200 + DONE),
        ("error_400_in_sse", ERROR_400_IN_SSE),
        ("cancelled_499", CANCELLED_499),
    ],
)
async def test_error_endings_are_exact_and_end_the_body(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock, mode: str, ending: bytes
) -> None:
    async with serve(harness_settings()) as s:
        st = await run_fault(s, f"{mode};delay_ms=0")
        frames = [data for _, data in st.chunks]
        head = head_of(frames[0])
        assert frames == [chat_frame(head, {"role": "assistant"}), *content_frames(head, 3), ending]
    assert (
        b'"code":502' in ERROR_ENVELOPE_200 and b'"Provider returned error"' in ERROR_ENVELOPE_200
    )
    assert b'"code":400' in ERROR_400_IN_SSE
    assert CANCELLED_499 == (
        b'data: {"error":{"code":499,"message":"CancelledError: ","type":"request_cancelled"}}\n\n'
    )


async def test_no_done_and_no_usage_endings(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """no_done: finish frame and the usage asked for, no [DONE]; no_usage: finish frame
    and [DONE], never usage."""
    body = stream_body(stream_options={"include_usage": True})
    async with serve(harness_settings()) as s:
        st = await run_fault(s, "no_done;after_chunks=2;delay_ms=0", body)
        frames = [data for _, data in st.chunks]
        head = head_of(frames[0])
        assert frames[:-1] == [chat_frame(head, {"role": "assistant"}), *content_frames(head, 2)]
        finish = chat_frame(head, {}, b',"finish_reason":"stop"')
        assert frames[-1].startswith(finish)
        usage_frame = frames[-1][len(finish) :]
        assert usage_frame.startswith(head + b'"choices":[],"usage":{')
        assert json.loads(usage_frame[6:])["usage"]["completion_tokens"] == 2
        assert usage_frame.endswith(b"}}\n\n")

        st = await run_fault(s, "no_usage;after_chunks=2;delay_ms=0", body)
        frames = [data for _, data in st.chunks]
        head = head_of(frames[0])
        assert frames[-1] == chat_frame(head, {}, b',"finish_reason":"stop"') + DONE
        assert b"usage" not in st.body_bytes()


async def test_cut_mid_frame_sends_half_of_the_next_frame(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(harness_settings()) as s:
        st = await run_fault(s, "cut_mid_frame;delay_ms=0")
        frames = [data for _, data in st.chunks]
        head = head_of(frames[0])
        full = content_frames(head, 4)[3]
        assert frames[-1] == full[: len(full) // 2]
        assert frames[:-1] == [chat_frame(head, {"role": "assistant"}), *content_frames(head, 3)]

        st = await run_fault(s, "cut_mid_frame;delay_ms=0;utf8=true")
        torn = st.chunks[-1][1]
        assert torn.endswith(b'"content":"caf\xc3')  # 'é' is C3 A9: the cut splits it
        with pytest.raises(UnicodeDecodeError):
            torn.decode()


async def test_mid_reasoning_and_mid_tool_call_frames(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(harness_settings()) as s:
        st = await run_fault(s, "mid_reasoning;delay_ms=0")
        frames = [data for _, data in st.chunks]
        head = head_of(frames[0])
        assert frames[1:] == [
            chat_frame(head, {"reasoning_content": VOCABULARY[i] + " "}) for i in range(3)
        ]
        st = await run_fault(s, "mid_tool_call;after_chunks=4;delay_ms=0")
        deltas = [json.loads(data[6:])["choices"][0]["delta"] for _, data in st.chunks[1:]]
        assert deltas[0] == {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_fault_0",
                    "type": "function",
                    "function": {"name": "get_current_weather", "arguments": ""},
                }
            ]
        }
        arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
        assert arguments == '{"location":"San Francisco, CA","notes":"and to '
        with pytest.raises(json.JSONDecodeError):
            json.loads(arguments)


async def test_stall_keeps_the_stream_open_until_the_client_leaves(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(harness_settings()) as s:
        async with open_stream(s, stream_body(), "stall;delay_ms=0") as st:
            for _ in range(4):
                await st.next_chunk()
            with trio.move_on_after(3600):  # an hour of virtual time: nothing more comes
                await st.next_chunk()
            assert not st.ended and not st.app_done.is_set()
            await st.disconnect()
            assert st.app_done.is_set()


async def test_completions_flavour_has_no_role_frame_and_text_partials(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    body = {"model": GPT, "prompt": "hi", "max_tokens": 5, "stream": True}
    async with serve(harness_settings()) as s:
        st = await run_fault(s, "mid_tool_call;delay_ms=0", body, path="/v1/completions")
        texts = [json.loads(data[6:])["choices"][0]["text"] for _, data in st.chunks]
        assert texts == [
            '{"name":"get_current_weather","arguments":{"location":"San Francisco, CA","notes":"',
            "of ",
            "and ",
        ]
        st = await run_fault(s, "no_usage;delay_ms=0;after_chunks=1", body, path="/v1/completions")
        last = json.loads(st.chunks[-1][1].removesuffix(DONE)[6:])
        assert last["object"] == "text_completion"
        assert last["choices"] == [{"text": "", "index": 0, "finish_reason": "stop"}]


async def test_bypassing_faults_and_scripts_are_never_529(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """With the queue bound reached, a plain request is a 529; a fault that bypasses the
    engine and a scripted answer are served, and nothing new enters the engine."""
    async with serve(harness_settings(max_num_seqs=1, max_waiting=1)) as s:
        rt = s.runtime()
        async with open_stream(s, stream_body(2000)) as running:
            await running.next_chunk()
            await trio.testing.wait_all_tasks_blocked()
            async with open_stream(s, stream_body(5)) as waiting:
                await waiting.next_chunk()
                await trio.testing.wait_all_tasks_blocked()
                assert rt.snapshot().depth == 1
                status, _ = await post_json(s, "/v1/chat/completions", chat_body())
                assert status == 529
                st = await run_fault(s, "no_usage;delay_ms=0")
                assert st.status == 200 and st.body_bytes().endswith(DONE)
                status, body = await post_json(
                    s, "/v1/chat/completions", chat_body('<<respond:{"text":"ok"}')
                )
                assert (status, body["choices"][0]["message"]["content"]) == (200, "ok")
                status, _ = await post_json(
                    s,
                    "/v1/chat/completions",
                    stream_body(),
                    **{"x-inference-lab-fault": "stall;paced=true"},
                )
                assert status == 529  # a paced fault is admitted like any request
                assert rt.snapshot().admitted == 2


# -- scripted answers ----------------------------------------------------------------------------


async def test_scripted_answer_non_streaming_is_exact(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    content = (
        'call it <<respond:{"text":"Paris.","tool_calls":[{"name":"lookup",'
        '"arguments":{"city":"Paris"}},{"name":"log","id":"x1"}]}'
    )
    async with serve(harness_settings()) as s:
        start = trio.current_time()
        status, body = await post_json(s, "/v1/chat/completions", chat_body(content))
        assert trio.current_time() == start  # immediate
        assert status == 200
        assert body["object"] == "chat.completion" and body["model"] == GPT
        assert body["choices"] == [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Paris.",
                    "tool_calls": [
                        {
                            "id": "call_directive_0",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": '{"city":"Paris"}'},
                        },
                        {
                            "id": "x1",
                            "type": "function",
                            "function": {"name": "log", "arguments": "{}"},
                        },
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
        assert body["usage"]["completion_tokens"] > 0
        assert s.runtime().snapshot().admitted == 0


async def test_scripted_answer_streams_role_content_calls_finish_with_usage_done(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    content = (
        '<<respond:{"text":"hi","tool_calls":[{"name":"f","arguments":[1]}],"finish_reason":"stop"}'
    )
    async with serve(harness_settings()) as s:
        async with open_stream(s, chat_body(content, stream=True)) as st:
            await st.read_all()
        assert len(st.chunks) == 1  # one write, at once
        frames = st.frames()
        assert frames[-1] == b"[DONE]"
        decoded = [json.loads(f) for f in frames[:-1]]
        assert [d["choices"][0]["delta"] for d in decoded] == [
            {"role": "assistant"},
            {"content": "hi"},
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_directive_0",
                        "type": "function",
                        "function": {"name": "f", "arguments": "[1]"},
                    }
                ]
            },
            {},
        ]
        assert decoded[-1]["choices"][0]["finish_reason"] == "stop"
        assert set(decoded[-1]["usage"]) == {
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "prompt_tokens_details",
        }
        assert all("usage" not in d for d in decoded[:-1])
        assert len({d["id"] for d in decoded}) == 1


# -- paced faults --------------------------------------------------------------------------------


async def test_paced_fault_is_paced_like_the_model_and_leaves_the_engine_idle(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The content frames of a paced fault arrive when a normal stream's tokens do; at
    ``after_chunks`` the engine request is aborted (slot and blocks back at once)."""
    async with serve(harness_settings()) as s:
        rt = s.runtime()
        async with open_stream(s, stream_body(50)) as normal:
            await normal.read_all()
        # (token gaps: a request may arrive while an aborted one's step is in flight)
        reference = [t - normal.token_times()[0] for t in normal.token_times()]
        for mode in ("cut_between_frames", "no_done", "stall", "reset", "cut_mid_frame"):
            async with open_stream(s, stream_body(50), f"{mode};paced=true;after_chunks=6") as st:
                while len(token_times(st)) < 6:
                    await st.next_chunk()
                await trio.testing.wait_all_tasks_blocked()
                assert_idle(rt)  # aborted at the sixth token, even while stalled
                if mode != "stall":
                    await st.read_all()
            times = [t - token_times(st)[0] for t in token_times(st)][:6]
            assert times == pytest.approx(reference[:6], abs=1e-9), mode
            assert_idle(rt)
        assert rt.engine.statistics().aborted == 5
        assert rt.engine.statistics().finished == 1


async def test_paced_fault_ends_early_when_the_request_finishes_first(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    body = stream_body(2, stream_options={"include_usage": True})
    async with serve(harness_settings()) as s:
        st = await run_fault(s, "no_done;paced=true;after_chunks=5", body)
        payloads = [json.loads(p) for p in st.frames()]
        assert payloads[-2]["choices"][0]["finish_reason"] == "length"
        assert payloads[-1]["usage"]["completion_tokens"] == 2
        assert_idle(s.runtime())
        assert s.runtime().engine.statistics().finished == 1


async def test_paced_fault_client_leaving_and_fit_refusal_leak_nothing(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(harness_settings()) as s:
        rt = s.runtime()
        async with open_stream(s, stream_body(1000), "no_done;paced=true;after_chunks=500") as st:
            while len(st.token_times()) < 3:
                await st.next_chunk()
            assert rt.snapshot().running == 1
        await trio.testing.wait_all_tasks_blocked()
        assert_idle(rt)
        status, body = await post_json(
            s,
            "/v1/chat/completions",
            stream_body(10_000_000),
            **{"x-inference-lab-fault": "stall;paced=true"},
        )
        assert (status, body["error"]["code"]) == (400, "context_length_exceeded")
        assert_idle(rt)


# -- faults from the model config, at a rate -----------------------------------------------------


def test_fault_table_loads_from_a_model_config(tmp_path: Path) -> None:
    text = (CONFIGS / "gpt-oss-20b.toml").read_text()
    path = tmp_path / "m.toml"
    path.write_text(text + '\n[fault]\nmode = "no_done"\nrate = 0.05\npaced = true\n')
    profiles = CONFIGS.parent / "hardware_profiles"
    config = load_model_config(path, profiles)
    assert config.fault == FaultConfig(mode="no_done", rate=0.05, paced=True)
    settings = load_settings(config=path, hardware="b200")
    assert settings.faults == ((GPT, config.fault),) and not settings.enable_test_harness
    for bad, fragment in [
        ('mode = "explode"', "fault.mode: must be one of"),
        ('mode = "stall"\nrate = 1.5', "fault.rate: must be <= 1"),
        ('mode = "stall"\nutf8 = true', "fault.utf8: applies to mode cut_mid_frame only"),
        ('mode = "stall"\nafter_chunks = "3"', "fault.after_chunks"),
        ('mode = "stall"\nseed = 3', "fault.seed: unknown key"),
    ]:
        path.write_text(text + f"\n[fault]\n{bad}\n")
        with pytest.raises(ConfigError, match=fragment):
            load_model_config(path, profiles)


async def test_fault_table_applies_to_its_rate_of_streaming_requests_seeded(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """rate = 0.25 over 200 streaming requests of that model: the same seeded draws each
    time, about a quarter faulted; non-streaming requests and other models untouched.
    The table applies with the harness off."""
    fault = FaultConfig(mode="no_usage", delay_ms=0, after_chunks=1, rate=0.25)
    settings = attrs.evolve(make_settings(GPT, LLAMA), faults=((GPT, fault),), seed=7)
    outcomes = []
    for _ in range(2):
        async with serve(settings) as s:
            pattern = []
            for _ in range(200):
                st = await run_fault(s, None, stream_body(2))
                pattern.append(len(st.frames()) == 4)  # role, 1 token, finish, [DONE]
            outcomes.append(pattern)
            faulted = sum(pattern)
            assert s.runtime(GPT).snapshot().admitted == 200 - faulted
            status, _ = await post_json(s, "/v1/chat/completions", chat_body())
            assert status == 200
            st = await run_fault(s, None, stream_body(2, model=LLAMA))
            assert len(st.frames()) == 5
            assert s.runtime(LLAMA).snapshot().admitted == 1
    assert outcomes[0] == outcomes[1]
    assert 30 <= sum(outcomes[0]) <= 70


# -- engine control ------------------------------------------------------------------------------


def test_engine_command_validation() -> None:
    assert parse_engine_command({"model": GPT, "action": "kill"}).action == "kill"
    command = parse_engine_command({"model": GPT, "action": "slowdown", "factor": 3})
    assert command.factor == 3.0
    for raw, param in [
        ({"model": GPT, "action": "explode"}, "action"),
        ({"model": GPT}, "action"),
        ({"action": "kill"}, "model"),
        ({"model": GPT, "action": "slowdown"}, "factor"),
        ({"model": GPT, "action": "slowdown", "factor": 0}, "factor"),
        ({"model": GPT, "action": "slowdown", "factor": -1}, "factor"),
        ({"model": GPT, "action": "slowdown", "factor": True}, "factor"),
        ({"model": GPT, "action": "slowdown", "factor": "3"}, "factor"),
        ({"model": GPT, "action": "slowdown", "factor": 1e9}, "factor"),
        ({"model": GPT, "action": "kill", "factor": 2}, "factor"),
        ({"model": GPT, "action": "kill", "extra": 1}, "extra"),
    ]:
        with pytest.raises(ApiError) as info:
            parse_engine_command(raw)
        assert (info.value.status, info.value.param) == (400, param), raw


async def test_kill_fails_like_a_crash_then_restart_serves_again_as_configured(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(harness_settings(GPT, LLAMA, max_waiting=64)) as s:
        s.runtime(GPT).set_capacity(max_num_seqs=2, max_waiting=3)
        async with open_stream(s, stream_body(500)) as live:
            while len(live.token_times()) < 2:
                await live.next_chunk()
            status, body = await post_json(s, "/control/engine", {"model": GPT, "action": "kill"})
            assert status == 200
            assert body == {"model": GPT, "action": "kill", "alive": False, "step_time_factor": 1.0}
            await live.read_all()
        frames = live.frames()
        assert frames[-1] == b"[DONE]"
        error = json.loads(frames[-2])["error"]
        assert error["code"] == "engine_failed"
        assert error["message"] == (
            f"The engine for model '{GPT}' failed: EngineKilled: "
            "the engine was killed on request (test harness)"
        )
        status, body = await post_json(s, "/v1/chat/completions", chat_body())
        assert (status, body["error"]["code"]) == (503, "engine_unavailable")
        status, health = await s.get_json("/health")
        assert (status, health["models"]) == (503, {GPT: "stopped", LLAMA: "running"})
        old = s.runtime(GPT)

        status, body = await post_json(s, "/control/engine", {"model": GPT, "action": "restart"})
        assert (status, body["alive"]) == (200, True)
        assert s.runtime(GPT) is not old
        status, health = await s.get_json("/health")
        assert status == 200
        status, body = await post_json(s, "/v1/chat/completions", chat_body(max_tokens=3))
        assert (status, body["choices"][0]["message"]["content"]) == (200, "the of and")
        status, capacity = await s.get_json("/control/capacity")
        gpt = next(entry for entry in capacity if entry["model"] == GPT)
        assert (gpt["max_num_seqs"], gpt["max_waiting"]) == (256, 64)  # as configured
        assert_idle(s.runtime(GPT))

        status, body = await post_json(s, "/control/engine", {"model": GPT, "action": "restart"})
        assert status == 200  # a restart of a live model works too
        status, _ = await post_json(s, "/v1/chat/completions", chat_body(max_tokens=2))
        assert status == 200


async def test_engine_control_errors(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    async with serve(harness_settings()) as s:
        status, body = await post_json(s, "/control/engine", {"model": "nope", "action": "kill"})
        assert (status, body["error"]["code"]) == (404, "model_not_found")
        status, body = await post_json(s, "/control/engine", {"model": GPT, "action": "pause"})
        assert (status, body["error"]["param"]) == (400, "action")
        status, body = await post_json(
            s, "/control/engine", {"model": GPT, "action": "slowdown", "factor": 0}
        )
        assert (status, body["error"]["param"]) == (400, "factor")
        response = await s.client.get("/control/engine")
        assert response.status_code == 405
        assert s.runtime().snapshot().alive


async def test_engine_control_is_behind_the_control_token(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """The control plane's token rule covers POST /control/engine like every /control/*."""
    settings = attrs.evolve(harness_settings(), control_token="s3cret")
    kill = {"model": GPT, "action": "kill"}
    async with serve(settings) as s:
        status, _ = await post_json(s, "/control/engine", kill)
        assert status == 401
        status, _ = await post_json(s, "/control/engine", kill, authorization="Bearer wrong")
        assert status == 403
        assert s.runtime().snapshot().alive
        status, body = await post_json(s, "/control/engine", kill, authorization="Bearer s3cret")
        assert (status, body["alive"]) == (200, False)


_LONE = itertools.count()


async def lone_request_e2e(s: Served) -> float:
    """E2E of a lone request of 4,000 characters; each call's prompt differs from the first
    character on, so no call finds an earlier one's blocks in the prefix cache."""
    start = trio.current_time()
    text = f"{next(_LONE):04d}" + "x" * 3996
    status, _ = await post_json(s, "/v1/chat/completions", chat_body(text, max_tokens=64))
    assert status == 200
    return trio.current_time() - start


async def test_slowdown_multiplies_a_lone_requests_e2e_and_one_restores(
    serve: ServeFactory, autojump_clock: trio.testing.MockClock
) -> None:
    """Every step costs factor x its roofline time: a lone request's E2E triples (on the
    MockClock: exactly, up to float rounding); factor 1 gives the original back."""
    async with serve(harness_settings()) as s:
        base = await lone_request_e2e(s)
        assert base > 0.01
        status, body = await post_json(
            s, "/control/engine", {"model": GPT, "action": "slowdown", "factor": 3}
        )
        assert (status, body["step_time_factor"]) == (200, 3.0)
        slow = await lone_request_e2e(s)
        assert slow == pytest.approx(3 * base, rel=1e-9)
        await post_json(s, "/control/engine", {"model": GPT, "action": "slowdown", "factor": 1})
        assert await lone_request_e2e(s) == pytest.approx(base, rel=1e-9)
        await post_json(s, "/control/engine", {"model": GPT, "action": "slowdown", "factor": 2.5})
        await post_json(s, "/control/engine", {"model": GPT, "action": "restart"})
        assert await lone_request_e2e(s) == pytest.approx(base, rel=1e-9)  # a fresh engine


# -- settings ------------------------------------------------------------------------------------


def test_environment_switch_for_the_harness() -> None:
    env = {"INFERENCE_LAB_CONFIG": str(CONFIGS / "gpt-oss-20b.toml")}
    assert not settings_from_env(env).enable_test_harness
    for value in ("1", "true", "ON"):
        settings = settings_from_env({**env, "INFERENCE_LAB_ENABLE_TEST_HARNESS": value})
        assert settings.enable_test_harness
    assert not settings_from_env(
        {**env, "INFERENCE_LAB_ENABLE_TEST_HARNESS": "0"}
    ).enable_test_harness
    with pytest.raises(ConfigError, match="INFERENCE_LAB_ENABLE_TEST_HARNESS: must be one of"):
        settings_from_env({**env, "INFERENCE_LAB_ENABLE_TEST_HARNESS": "maybe"})
