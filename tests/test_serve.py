"""The OpenAI-compatible server, through the ``openai`` client and raw HTTP, on 127.0.0.1.

Completions and chat, streamed and not, from the sync and the async client, equal offline greedy
``LLM.generate`` token for token (and their log-probabilities equal the engine's); the server-sent events are
framed as OpenAI frames them; every bad request gets an OpenAI-shaped 400/404/413 naming its field, and
neither crashes the server nor disturbs a request in flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest
from serve_helpers import metric_values, serving, states_kept

from minipd import LLM, SamplingParams

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py", num_kv_blocks=256)


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm) as server:
        yield server


def offline(llm: LLM, prompt, **params):
    return llm.generate(prompt, SamplingParams(temperature=0, **params), use_tqdm=False)[0]


def sse_events(response: httpx.Response) -> list[str]:
    """The events of a server-sent stream, checking the framing: ``data: ...`` lines, each followed by a blank one."""
    raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    return [e[len("data: "):] for e in events[:-1]]


def test_completions_equal_offline_greedy_streamed_or_not(llm, server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    want = offline(llm, PROMPT, max_tokens=20, logprobs=2)
    whole = client.completions.create(model="tiny-py", prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == want.finish_reason
    assert whole.usage.prompt_tokens == len(want.prompt_token_ids) and whole.usage.completion_tokens == 20
    got_logprobs = whole.choices[0].logprobs.token_logprobs
    assert all(math.isclose(a, b[t], abs_tol=1e-5) for a, b, t in zip(got_logprobs, want.logprobs, want.token_ids,
                                                                       strict=True))
    assert whole.choices[0].logprobs.text_offset[0] == 0
    chunks = list(client.completions.create(model="tiny-py", prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # Token ids as the prompt, stop strings, a seed: the engine's own semantics.
    ids = llm.tokenizer.encode(PROMPT)
    assert client.completions.create(model="tiny-py", prompt=ids, max_tokens=12, temperature=0).choices[0].text == \
        offline(llm, ids, max_tokens=12).text
    seeded = dict(max_tokens=12, temperature=0.8, seed=7)
    assert client.completions.create(model="tiny-py", prompt=PROMPT, **seeded).choices[0].text == \
        llm.generate(PROMPT, SamplingParams(**seeded), use_tqdm=False)[0].text
    stopped = client.completions.create(model="tiny-py", prompt=PROMPT, max_tokens=30, temperature=0, stop=["\n"])
    assert "\n" not in stopped.choices[0].text and stopped.choices[0].text == offline(llm, PROMPT, max_tokens=30,
                                                                                       stop=["\n"]).text


def test_chat_from_the_async_client_streamed_or_not(llm, server):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class."}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        whole = await client.chat.completions.create(model="tiny-py", messages=messages, max_tokens=16,
                                                     temperature=0, logprobs=True, top_logprobs=3)
        stream = await client.chat.completions.create(model="tiny-py", messages=messages, max_completion_tokens=16,
                                                      temperature=0, stream=True)
        chunks = [c async for c in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == want.text
    assert whole.usage.completion_tokens == len(want.token_ids)
    content = whole.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) and all(len(c.top_logprobs) == 3 for c in content)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_async_completions_and_a_sync_chat_stream_with_usage_equal_offline_greedy(llm, server):
    want = offline(llm, PROMPT, max_tokens=18)
    messages = [{"role": "user", "content": "Reverse a string."}]
    want_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        try:
            whole = await client.completions.create(model="tiny-py", prompt=PROMPT, max_tokens=18, temperature=0)
            stream = await client.completions.create(model="tiny-py", prompt=PROMPT, max_tokens=18, temperature=0,
                                                     stream=True)
            return whole, [c async for c in stream]
        finally:
            await client.close()

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(want.prompt_token_ids) and whole.usage.completion_tokens == 18
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert len(chunks) == 18 and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # not asked for
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    chat = list(client.chat.completions.create(model="tiny-py", messages=messages, max_tokens=12, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == want_chat.text
    assert chat[-1].choices == [] and [c for c in chat if not c.choices] == [chat[-1]]
    assert (chat[-1].usage.prompt_tokens, chat[-1].usage.completion_tokens, chat[-1].usage.total_tokens) == \
        (len(want_chat.prompt_token_ids), 12, len(want_chat.prompt_token_ids) + 12)
    assert all(c.usage is None for c in chat[:-1])


def test_sampling_fields_take_effect_through_the_server(llm, server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    def complete(**fields):
        return client.completions.create(model="tiny-py", prompt=PROMPT, **fields)

    greedy = offline(llm, PROMPT, max_tokens=24, ignore_eos=True)
    sampled = complete(max_tokens=24, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert sampled.choices[0].text != greedy.text  # (so that the two below show top_k and top_p at work)
    top_k = complete(max_tokens=24, temperature=1.0, seed=11, extra_body={"top_k": 1, "ignore_eos": True})
    assert top_k.choices[0].text == greedy.text
    top_p = complete(max_tokens=24, temperature=1.0, seed=11, top_p=1e-6, extra_body={"ignore_eos": True})
    assert top_p.choices[0].text == greedy.text
    # stop_token_ids: the request ends at the first such token (counted, as vLLM counts it).
    ids = greedy.token_ids
    stop_id = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    at = ids.index(stop_id)
    stopped = complete(max_tokens=24, temperature=0, extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == at + 1
    assert stopped.choices[0].text == offline(llm, PROMPT, max_tokens=24, stop_token_ids=[stop_id]).text
    # min_tokens keeps the stop (and the end of sequence) away until that many tokens are out.
    held = complete(max_tokens=24, temperature=0, extra_body={"stop_token_ids": [stop_id], "min_tokens": at + 6})
    assert held.usage.completion_tokens >= at + 6
    assert held.choices[0].text == offline(llm, PROMPT, max_tokens=24, stop_token_ids=[stop_id],
                                           min_tokens=at + 6).text


def test_a_request_whose_client_hangs_up_before_its_reply_is_aborted(llm, server):
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with states_kept(llm.engine.processor) as states:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up (and closes its connection)
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        gone = time.perf_counter()
        deadline = time.monotonic() + 5
        while not (states and all(s.finished for s in states.values())) and time.monotonic() < deadline:
            time.sleep(0.01)
    (state,) = states.values()
    assert state.finished and state.finish_reason == "abort", state.finish_reason
    assert len(state.token_ids) < 900
    assert state.metrics.finish_time - gone < 1.0, state.metrics.finish_time - gone  # at once, not at the end
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_metrics_report_load_and_prefix_cache_with_their_values(llm, server):
    label = (("model_name", "tiny-py"),)

    def scrape() -> dict:
        return metric_values(httpx.get(f"{server.url}/metrics", timeout=10).text)

    idle = scrape()
    assert idle[("vllm:num_requests_running", label)] == 0 and idle[("vllm:num_requests_waiting", label)] == 0
    assert idle[("vllm:kv_cache_usage_perc", label)] == 0
    # Mid-run: a long stream is running and holds blocks.
    body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as client, \
            client.stream("POST", "/v1/completions", json=body) as running:
        lines = running.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        busy = scrape()
    assert busy[("vllm:num_requests_running", label)] == 1 and busy[("vllm:num_requests_waiting", label)] == 0
    assert 0 < busy[("vllm:kv_cache_usage_perc", label)] < 1
    # The prefix cache: a long prompt sent twice is looked up in full and found the second time.
    prompt = llm.tokenizer.encode("def add(a, b):\n    return a + b\n\n" * 12)
    block = llm.engine.block_manager.block_size
    assert len(prompt) > 4 * block
    before = scrape()
    for _ in range(2):
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                          timeout=30).status_code == 200
    after = scrape()
    queries = after[("vllm:prefix_cache_queries_total", label)] - before[("vllm:prefix_cache_queries_total", label)]
    hits = after[("vllm:prefix_cache_hits_total", label)] - before[("vllm:prefix_cache_hits_total", label)]
    assert queries >= 2 * len(prompt) - 2, (queries, len(prompt))
    assert 0 < hits <= queries and hits >= (len(prompt) - 1) // block * block - block, (hits, len(prompt))
    assert after[("vllm:kv_cache_usage_perc", label)] == 0 and after[("vllm:num_requests_running", label)] == 0


def test_server_sent_events_are_framed_as_openai_frames_them(llm, server):
    want = offline(llm, PROMPT, max_tokens=10)
    body = {"model": "tiny-py", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c for c in chunks if c["choices"] == []]
    assert len(usage) == 1 and usage[0] is chunks[-1]  # exactly one usage chunk, the last before [DONE]
    assert usage[0]["usage"] == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": 10,
                                 "total_tokens": len(want.prompt_token_ids) + 10}
    assert all(c["usage"] is None for c in chunks[:-1])  # the others carry a null usage, as OpenAI's do
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    chat = {"model": "tiny-py", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=30) as response:
        chat_chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert chat_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chat_chunks[1:])
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chat_chunks[0]["id"] for c in chat_chunks)
    # A chat stream with include_usage: the role first, one usage chunk last with the engine's real counts.
    messages = [{"role": "user", "content": "A stack class."}]
    want_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0]
    chat = {"model": "tiny-py", "messages": messages, "max_tokens": 7, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=30) as response:
        chat_chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert chat_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chat_chunks[1:-1])
    final = [c for c in chat_chunks if c["choices"] == []]
    assert len(final) == 1 and final[0] is chat_chunks[-1]
    prompt_len = len(want_chat.prompt_token_ids)
    assert prompt_len == len(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages)))
    assert final[0]["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 7, "total_tokens": prompt_len + 7}
    assert all(c["usage"] is None for c in chat_chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chat_chunks[:-1]) == want_chat.text
    assert chat_chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert len(chat_chunks) == 1 + 7 + 1  # the role, a chunk per token, the usage


BAD = [  # (path, body or raw bytes, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": "all"}, 400, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": -2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 9}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 9}, 400, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": PROMPT, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x " * 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
    ("/v1/completions", {"model": 3, "prompt": PROMPT}, 400, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": "yes"}, 400,
     "add_generation_prompt"),
    ("/detokenize", {"tokens": [-5]}, 400, "tokens"),
    ("/v1/completions", b"{" + b" " * (5 << 20) + b"}", 413, None),
    ("/v1/nowhere", {}, 404, None),
]


def test_bad_requests_name_their_field_and_harm_nobody(llm, server):
    want = offline(llm, PROMPT, max_tokens=60, ignore_eos=True)
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as client, \
            client.stream("POST", "/v1/completions", json=body) as in_flight:
        lines = in_flight.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # admitted and running
        for path, payload, status, param in BAD:
            if isinstance(payload, bytes):
                response = client.post(path, content=payload, headers={"content-type": "application/json"})
            else:
                response = client.post(path, json=payload)
            assert response.status_code == status, (path, payload if len(str(payload)) < 200 else "...", response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
            assert error["param"] == param, (payload if len(str(payload)) < 200 else "...", error)
        rest = [first, *(line for line in lines if line.startswith("data: "))]
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in rest if line != "data: [DONE]")
    assert text == want.text  # the request in flight went on untouched
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert llm.engine.block_manager.num_used_blocks == 0


def test_models_tokenize_detokenize_and_health(llm, server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny-py"] and models["data"][0]["max_model_len"] > 0
        tokens = client.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["tokens"] == llm.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
        chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}]))
        assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
        assert client.get("/health").json() == {"status": "ok"}
        metrics = client.get("/metrics").text
        assert 'vllm:num_requests_running{model_name="tiny-py"}' in metrics


def test_an_admission_rule_turns_requests_away_while_the_server_is_full(llm):
    seen = []

    def rule(load) -> bool:
        seen.append(load)
        return load.in_flight < 2

    # As long as the model allows: shorter streams (200 tokens) could end, all their chunks buffered in the
    # sockets, before the third request came (seen on a machine that decodes a token in under a millisecond).
    body = {"prompt": PROMPT, "max_tokens": llm.max_model_len - len(llm.tokenizer.encode(PROMPT)), "ignore_eos": True,
            "stream": True}
    with serving(llm, admission=rule) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as one, \
                client.stream("POST", "/v1/completions", json=body) as two:
            lines = [one.iter_lines(), two.iter_lines()]  # (kept: dropping one would close its connection)
            assert all(next(it).startswith("data: ") for it in lines)  # both admitted and streaming
            refused = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailable"
            assert seen[-1].in_flight == 2 and seen[-1].running >= 1, seen[-1]
        # Both hung up: they are over, and the next request gets in.
        deadline = time.monotonic() + 5
        while server.api.load().in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        again = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert again.status_code == 200, (again.text, seen[-1])
        assert server.api.num_refused == 1 and server.api.load().in_flight == 0


def test_the_serve_command_refuses_bad_options_before_loading(capsys):
    from minipd.cli import main

    assert main(["serve", "--kv-transfer", "pull"]) == 2
    assert "--kv-transfer apply to a disaggregated engine" in capsys.readouterr().err
    assert main(["serve", "--option", "not an option"]) == 2
    assert "NAME=VALUE" in capsys.readouterr().err
    assert main(["serve", "--decode-workers", "2"]) == 2
    assert "--decode-workers apply to a disaggregated engine" in capsys.readouterr().err
    assert main(["serve", "--max-in-flight", "0"]) == 2
    assert main(["loadgen", "--goodput", "latency:5"]) == 2
    assert "ttft:MS" in capsys.readouterr().err


def test_a_chat_without_a_token_limit_may_use_the_rest_of_the_context(llm, server):
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    prompt_len = len(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages)))
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=llm.max_model_len - prompt_len),
                    use_tqdm=False)[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    got = client.chat.completions.create(model="tiny-py", messages=messages, temperature=0)  # no max_tokens
    assert got.choices[0].message.content == want.text and got.usage.completion_tokens == len(want.token_ids)
    assert len(want.token_ids) > 16  # (so the test shows more than completions' legacy default of 16)


def test_a_request_too_big_for_the_kv_pool_names_what_to_lower():
    small = LLM("tiny-py", num_kv_blocks=8)  # 8 blocks: far fewer tokens than the model's context
    capacity = 8 * small.engine.block_manager.block_size
    with serving(small) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        cases = [("/v1/completions", {"prompt": [5] * (capacity + 10), "max_tokens": 1}, "prompt"),
                 ("/v1/completions", {"prompt": [5] * 10, "max_tokens": capacity + 10}, "max_tokens"),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "max_completion_tokens": capacity + 10}, "max_completion_tokens"),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * (capacity + 10)}],
                                           "max_tokens": 1}, "messages")]
        for path, body, param in cases:
            response = client.post(path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and "KV blocks" in error["message"], error
        ok = client.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert small.engine.block_manager.num_used_blocks == 0


def test_a_chunked_body_over_the_limit_without_content_length_gets_413(server):
    def body():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * (1 << 20)
        yield b'"}'

    response = httpx.post(f"{server.url}/v1/completions", content=body(), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in response.request.headers
    assert response.status_code == 413 and response.json()["error"]["type"] == "RequestTooLarge"
    assert httpx.get(f"{server.url}/health").status_code == 200


def parsed_options(*argv: str) -> dict:
    import argparse

    from minipd.serve.server import add_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return engine_options(parser.parse_args(list(argv)))


def test_kv_and_moe_options_pass_through_to_the_engine():
    assert parsed_options() == {}
    assert parsed_options("--kv-cache-dtype", "int8") == {"kv_cache_dtype": "int8"}
    assert parsed_options("--expert-parallel-size", "2") == {"expert_parallel_size": 2}
    assert parsed_options("--model", "tiny-py-moe", "--expert-parallel-size", "2", "--kv-cache-dtype", "int4_per_token",
                          "--num-kv-blocks", "64") == {"expert_parallel_size": 2, "kv_cache_dtype": "int4_per_token",
                                                      "num_kv_blocks": 64}
    assert parsed_options("--prefill-workers", "1", "--kv-transfer-dtype", "int8", "--kv-transport", "torch") == \
        {"num_prefill_workers": 1, "num_decode_workers": 1, "kv_transfer_dtype": "int8", "kv_transport": "torch"}
    assert parsed_options("--prefill-workers", "2", "--decode-workers", "3", "--kv-transfer", "push") == \
        {"num_prefill_workers": 2, "num_decode_workers": 3, "kv_transfer": "push"}
    assert parsed_options("--option", "max_num_seqs=64", "--option", "enable_prefix_caching=false", "--option",
                          "kv_cache_dtype=int8", "--option", "kv_lease_s=2.5") == \
        {"max_num_seqs": 64, "enable_prefix_caching": False, "kv_cache_dtype": "int8", "kv_lease_s": 2.5}
    with pytest.raises(ValueError, match=r"--decode-workers.*--prefill-workers"):
        parsed_options("--decode-workers", "2")  # (was ignored: a colocated engine was served)
    with pytest.raises(ValueError, match="--kv-transfer-dtype"):
        parsed_options("--kv-transfer-dtype", "int8")


def test_a_moe_model_with_an_int8_kv_cache_serves_what_the_engine_computes():
    from minipd.serve.server import BackgroundServer, build_engine

    want = LLM("tiny-py-moe", kv_cache_dtype="int8").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    engine = build_engine("tiny-py-moe", parsed_options("--model", "tiny-py-moe", "--kv-cache-dtype", "int8"))
    try:
        assert engine.llm.engine.config.kv_cache_dtype == "int8"
        with BackgroundServer(engine, "tiny-py-moe", grace=1.0) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            got = client.completions.create(model="tiny-py-moe", prompt=PROMPT, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
    finally:
        engine.shutdown()
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 16


def test_a_client_gone_before_the_answer_gets_499_not_an_internal_error():
    """The disconnect watcher wins the race: the work is cancelled and waited for, and the answer is 499 (no
    ``InvalidStateError`` from asking a task that is still unwinding for its result)."""
    from minipd.serve.app import until_disconnect

    unwound = []

    class GoneRequest:
        async def receive(self) -> dict:
            return {"type": "http.disconnect"}

    async def work():
        try:
            await asyncio.sleep(30)
        finally:
            unwound.append(True)

    response = asyncio.run(asyncio.wait_for(until_disconnect(GoneRequest(), work()), timeout=10))
    assert response.status_code == 499 and unwound == [True]
