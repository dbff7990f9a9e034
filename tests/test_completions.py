"""POST /v1/completions (OpenAI's legacy text completions) on the embedded SmolLM2, greedy.

The route runs on the chat engine's own path (engine/request.py ``ChatJob.raw_prompt``): the
prompt's tokens as they stand, KV reuse and continuous batching as for chat. Checked against a
cold server (PROMPT_CACHE_MAX_ENTRIES_GLOBAL=0) for the same prompts: greedy text equal, reuse
exact where the tokens say it, stop strings cut exactly, the legacy logprobs shape, a stream that
concatenates to the whole reply, OpenAI-shaped 400s after which the server keeps serving. The
official openai SDK (``client.completions.create``) is the client where it is installed.
"""
from __future__ import annotations

import threading

import pytest

from mlxstack.server.openai.completions import DEFAULT_MAX_TOKENS, fim_ids, fim_parts
from tests.conftest import LiveServer, engine_settings, http_json

openai = pytest.importorskip("openai")

P = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def warm(embedded_model_path):
    server = LiveServer(engine_settings(None))
    yield server
    server.close()


@pytest.fixture(scope="module")
def cold(embedded_model_path):
    server = LiveServer(engine_settings(None, prompt_cache_max_entries_global=0))
    yield server
    server.close()


def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tok(warm):
    return warm.app.loaded.tokenizer


def complete(server, **kw):
    kw.setdefault("model", "SmolLM2-135M-Instruct")
    kw.setdefault("temperature", 0)
    return client(server).completions.create(**kw)


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ------------------------------------------------------------------ text, reuse, parity
def test_greedy_text_equals_a_cold_server_and_an_extension_reuses_the_cache(warm, cold, tok):
    prompt = "Once upon a time, in a small village by the sea, there lived"
    first = complete(warm, prompt=prompt, max_tokens=12)
    assert first.object == "text_completion" and first.choices[0].finish_reason == "length"
    assert first.choices[0].text == complete(cold, prompt=prompt, max_tokens=12).choices[0].text
    assert first.choices[0].text.startswith(" ")           # the reply continues the text: its space kept
    ids = tok.encode(prompt)
    assert first.usage.prompt_tokens == len(ids) and first.usage.completion_tokens == 12
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    # the next prompt holds the first and its reply: the entry (prompt + the reply's tokens) is reused
    longer = prompt + first.choices[0].text + " One day"
    second = complete(warm, prompt=longer, max_tokens=12)
    assert second.choices[0].text == complete(cold, prompt=longer, max_tokens=12).choices[0].text
    reply_ids = tok.encode(first.choices[0].text)
    assert tok.decode(ids + reply_ids) == prompt + first.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens == lcp(tok.encode(longer), ids + reply_ids)
    assert second.usage.prompt_tokens_details.cached_tokens > len(ids)


def test_a_token_id_prompt_is_the_text_prompts_tokens_and_reuse_is_exact(warm, cold, tok):
    prompt = "A recipe for bread: first, take some flour, water, salt and yeast, then mix them in a bowl and"
    assert len(tok.encode(prompt)) > 16       # reuse is looked up by 16-token blocks (PROMPT_CACHE_BLOCK_SIZE)
    ids = tok.encode(prompt)
    as_text = complete(warm, prompt=prompt, max_tokens=8)
    as_ids = complete(warm, prompt=ids, max_tokens=8)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == len(ids)
    assert as_ids.usage.prompt_tokens_details.cached_tokens == len(ids) - 1   # at least one token is computed
    # a branch after the prompt: exactly the prompt's tokens are reused
    zebra = tok.encode(" zebra")[0]
    assert zebra != tok.encode(as_text.choices[0].text)[0]
    branch = complete(warm, prompt=[ids + [zebra]], max_tokens=8)      # a list holding one prompt
    assert branch.usage.prompt_tokens_details.cached_tokens == len(ids)
    assert branch.choices[0].text == complete(cold, prompt=ids + [zebra], max_tokens=8).choices[0].text


def test_max_tokens_defaults_to_16(warm):
    reply = complete(warm, prompt="List the numbers: 1, 2, 3, 4,")
    assert reply.usage.completion_tokens == DEFAULT_MAX_TOKENS == 16
    assert reply.choices[0].finish_reason == "length"


def test_concurrent_completions_are_batched_and_answer_as_alone(warm, cold):
    prompts = ["The best way to learn a language is", "My favourite fruit is the apple because",
               "In 1492, Columbus"]
    alone = [complete(cold, prompt=p, max_tokens=10).choices[0].text for p in prompts]
    out: dict[int, str] = {}

    def go(i):
        out[i] = complete(warm, prompt=prompts[i], max_tokens=10).choices[0].text

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [out[i] for i in range(len(prompts))] == alone


# ------------------------------------------------------------------ stop, echo, logprobs
def test_stop_strings_cut_exactly(warm):
    full = complete(warm, prompt=P, max_tokens=16).choices[0].text
    assert full.startswith(" Berlin.")
    cut = complete(warm, prompt=P, max_tokens=16, stop=".")
    assert cut.choices[0].text == full.split(".")[0] == " Berlin" and cut.choices[0].finish_reason == "stop"
    two = complete(warm, prompt=P, max_tokens=16, stop=["capital", " of"])
    assert two.choices[0].text == full[:min(full.index("capital"), full.index(" of"))]


def test_echo_prepends_the_prompt(warm, tok):
    plain = complete(warm, prompt=P, max_tokens=6).choices[0].text
    echoed = complete(warm, prompt=P, max_tokens=6, echo=True)
    assert echoed.choices[0].text == P + plain
    ids = tok.encode(P)
    assert complete(warm, prompt=ids, max_tokens=6, echo=True).choices[0].text == tok.decode(ids) + plain


def test_logprobs_legacy_shape_and_counts(warm):
    reply = complete(warm, prompt=P, max_tokens=8, logprobs=3)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert reply.usage.completion_tokens == 8
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == choice.text
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0
        assert top[token] == value == max(top.values())          # greedy: the chosen token is the likeliest
    # logprobs 0: each token's own logprob, no alternatives
    zero = complete(warm, prompt=P, max_tokens=4, logprobs=0).choices[0].logprobs
    assert len(zero.tokens) == 4 and zero.top_logprobs == [{}] * 4
    assert zero.token_logprobs == lp.token_logprobs[:4]
    # a stop string: the tokens the text shows
    cut = complete(warm, prompt=P, max_tokens=8, logprobs=1, stop=".").choices[0]
    assert cut.text == " Berlin" and cut.logprobs.tokens == [" Berlin"] and cut.logprobs.text_offset == [0]


# ------------------------------------------------------------------ streaming
def test_stream_concatenates_to_the_whole_reply_with_usage(warm):
    for echo in (False, True):
        whole = complete(warm, prompt=P, max_tokens=10, echo=echo)
        chunks = list(complete(warm, prompt=P, max_tokens=10, echo=echo, stream=True,
                               stream_options={"include_usage": True}))
        assert all(c.object == "text_completion" for c in chunks)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_frames_end_with_done_and_carry_logprobs(warm):
    status, raw, headers = http_json(warm.base + "/v1/completions", {"prompt": P, "max_tokens": 5, "stream": True,
                                                                     "logprobs": 2, "temperature": 0})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    frames = [f[len("data: "):] for f in raw.strip().split("\n\n")]
    assert frames[-1] == "[DONE]"
    import json

    chunks = [json.loads(f) for f in frames[:-1]]
    with_lp = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert len(with_lp) == 1 and len(with_lp[0]["choices"][0]["logprobs"]["tokens"]) == 5
    assert "usage" in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------ fill in the middle
def test_fim_prompt_is_prefix_suffix_middle(warm, tok):
    vocab = {"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3, "a": 4}
    assert fim_ids(vocab) == (1, 2, 3)
    assert fim_ids({"<|fim_prefix|>": 7, "<|fim_suffix|>": 8, "<|fim_middle|>": 9}) == (7, 8, 9)
    assert fim_ids({"<fim_prefix>": 1}) is None and fim_ids(tok.get_vocab()) is None   # SmolLM2 has none
    assert fim_parts(["def f(", ], "    return x", (1, 2, 3)) == [1, "def f(", 2, "    return x", 3]
    # the engine encodes mixed parts as they stand: ids as given, text without leading tokens in between
    engine = warm.app.engine
    assert engine.raw_tokens([5, "def f(", 6, "x", 7]) == [5, *tok.encode("def f("), 6, *tok.encode("x"), 7]


# ------------------------------------------------------------------ errors
BAD = [
    ({"prompt": ["one", "two"]}, "prompt", "unsupported_parameter"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "unsupported_parameter"),
    ({}, "prompt", None),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": 7}, "prompt", None),
    ({"prompt": [1, "a"]}, "prompt", None),
    ({"prompt": [1, True]}, "prompt", None),
    ({"prompt": [10**9]}, "prompt", None),
    ({"prompt": [-1]}, "prompt", None),
    ({"prompt": P, "n": 2}, "n", "unsupported_parameter"),
    ({"prompt": P, "best_of": 3}, "best_of", "unsupported_parameter"),
    ({"prompt": P, "suffix": "x"}, "suffix", "unsupported_parameter"),
    ({"prompt": P, "suffix": 3}, "suffix", None),
    ({"prompt": P, "echo": True, "logprobs": 1}, "echo", "unsupported_parameter"),
    ({"prompt": P, "echo": "yes"}, "echo", None),
    ({"prompt": P, "logprobs": 21}, "logprobs", None),
    ({"prompt": P, "logprobs": True}, "logprobs", None),
    ({"prompt": P, "temperature": 9}, "temperature", None),
    ({"prompt": P, "max_tokens": 0}, "max_tokens", None),
    ({"prompt": P, "stop": [""]}, "stop", None),
    ({"prompt": [1] * 9000}, "prompt", "context_length_exceeded"),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_an_openai_shaped_400_and_the_server_keeps_serving(warm, body, param, code):
    status, reply, _ = http_json(warm.base + "/v1/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert error["message"]
    assert http_json(warm.base + "/v1/completions", {"prompt": P, "max_tokens": 1})[0] == 200


def test_the_sdk_raises_bad_request_naming_the_param(warm):
    with pytest.raises(openai.BadRequestError) as err:
        complete(warm, prompt=P, suffix="def")
    assert err.value.body["param"] == "suffix"


def test_request_log_names_the_front(warm):
    complete(warm, prompt="Front door check:", max_tokens=2)
    recent = http_json(warm.base + "/v1/cache/stats")[1]["recent"][-1]
    assert recent["api"] == "completions" and recent["session"].startswith("completion:")


# ------------------------------------------------------------------ the front door's repairs (pure)
def test_the_front_door_carries_a_token_prompt_and_reads_the_openai_providers_wrapped_400():
    import json

    from mlxstack.routing.front_door import backend_error, carry_token_prompt

    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        carried = json.loads(carry_token_prompt(json.dumps({"model": "m", "prompt": prompt, "max_tokens": 3}).encode()))
        assert carried["mlxstack_prompt"] == [5, 6, 7] and isinstance(carried["prompt"], str)
        assert carried["model"] == "m" and carried["max_tokens"] == 3
    for body in ({"prompt": "text"}, {"prompt": ["a"]}, {"prompt": [True]}, {"prompt": []}, [1], "x"):
        assert carry_token_prompt(json.dumps(body).encode()) is None
    assert carry_token_prompt(b"{not json") is None
    ours = {"error": {"message": "'suffix' is not supported", "type": "invalid_request_error", "param": "suffix",
                      "code": "unsupported_parameter"}}
    wrapped = {"error": {"message": f"litellm.BadRequestError: OpenAIException - Error code: 400 - {ours!r}\n\n"
                                    "LiteLLM: model group 'm' failed with the error above.", "param": None, "code": "400"}}
    assert json.loads(backend_error(json.dumps(wrapped).encode())) == ours
    odd = {"error": {"message": "OpenAIException - Error code: 400 - {__import__('os')}", "param": None}}
    assert backend_error(json.dumps(odd).encode()) is None      # a literal or nothing: never evaluated


# ------------------------------------------------------------------ through LiteLLM on a real port
@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    from tests.test_e2e_stack import Stack

    s = Stack(tmp_path_factory.mktemp("completions"), str(embedded_model_path.parent))
    yield s
    s.stop()


def test_through_litellm_text_reuse_token_prompts_stream_and_errors(stack, warm, tok):
    """LiteLLM's text_completion route forwards to the backend's /v1/completions; the front door
    carries a token-id prompt past it (LiteLLM takes only strings) and hands the server's own 400
    through (LiteLLM words it without ``param``)."""
    from tests.test_e2e_stack import KEY, MODEL

    oai = openai.OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0, timeout=300)
    prompt = "The three primary colours of paint are red, yellow and blue. Mixing red with yellow paint gives"
    ids = tok.encode(prompt)
    assert len(ids) > 16
    direct = complete(warm, prompt=prompt, max_tokens=10).choices[0].text
    first = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert first.choices[0].text == direct and first.usage.prompt_tokens == len(ids)
    again = oai.completions.create(model=MODEL, prompt=ids + tok.encode(" orange"), max_tokens=10, temperature=0)
    assert again.usage.prompt_tokens == len(ids) + 1
    assert again.usage.prompt_tokens_details.cached_tokens >= len(ids)
    assert again.choices[0].text == complete(warm, prompt=ids + tok.encode(" orange"), max_tokens=10,
                                             extra_body={"cache_salt": "cold-ref"}).choices[0].text
    chunks = list(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == direct
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt=prompt, suffix="x")
    assert err.value.body["param"] == "suffix" and err.value.body["code"] == "unsupported_parameter"
