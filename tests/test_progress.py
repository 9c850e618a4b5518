"""Progress a person can see — llama-server's ``prompt_progress`` (asked
with ``return_progress``), the reply's live token count, and the speculative-decoding
acceptance rate in the usage line. Against the real llama-server with a long prompt;
the browser side is tests/test_search_versions_browser.py. Case C60 (a long prompt with no byte
for minutes): ``return_progress`` is asked (tests/test_completions.py checks the body) and
the server's progress arrives while it reads, before the first token."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from machines_app.demo_models import packaged_model_paths
from machines_app.transports import LocalTransport
from sessions_app.completions import CompletionClient, Progress, TextDelta, Usage, parse_chunk
from sessions_app.live.sentences import progress_text, usage_line

from .conftest import wait_for


def test_a_progress_chunk_is_read_and_said_in_words():
    chunk = {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
             "object": "chat.completion.chunk",
             "prompt_progress": {"total": 4210, "cache": 0, "processed": 1536, "time_ms": 812}}
    assert parse_chunk(chunk) == [Progress(total=4210, processed=1536, cache=0)]
    assert progress_text({"phase": "prompt", "processed": 1536, "total": 4210}) == \
        "reading the conversation: 1,536 / 4,210 tokens"
    assert progress_text({"phase": "reply", "tokens": 1}) == "writing the reply: 1 token"
    assert progress_text({"phase": "reply", "tokens": 87}) == "writing the reply: 87 tokens"
    for odd in ({}, {"phase": "prompt", "processed": 3, "total": 0}, {"phase": "reply", "tokens": "9"},
                {"phase": "prompt", "processed": True, "total": 5}, {"phase": "x", "tokens": 3}):
        assert progress_text(odd) == ""


def test_the_usage_line_says_how_many_drafted_tokens_the_model_kept():
    chunk = {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 64},
             "timings": {"predicted_n": 64, "predicted_per_second": 51.5, "draft_n": 63, "draft_n_accepted": 45}}
    [usage] = parse_chunk(chunk)
    assert (usage.draft_n, usage.draft_n_accepted) == (63, 45)
    line = usage_line({**usage.as_payload(), "seed": 7})
    assert "reply 64 tokens · 51.5 tok/s · draft 71% accepted (45 of 63) · seed 7" in line
    assert "draft" not in usage_line({"prompt_tokens": 3, "draft_n": 0, "draft_n_accepted": 0})
    assert "draft" not in usage_line({"prompt_tokens": 3})


def serve(llama_server_bin, tmp_path, *flags: str):
    """The real llama-server with SmolLM2 and ``flags``; its URL while the test runs."""
    port = LocalTransport().free_port()
    log = open(tmp_path / "server.log", "wb")
    process = subprocess.Popen(
        [llama_server_bin, "-m", str(packaged_model_paths()["smollm2"]), "--host", "127.0.0.1", "--port", str(port),
         "-t", "2", "--no-warmup", *flags],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 120, what="llama-server to load SmolLM2")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def real_server(llama_server_bin, tmp_path):
    """A small batch, so a long prompt is read in steps."""
    yield from serve(llama_server_bin, tmp_path, "-c", "8192", "-b", "256", "-ub", "256")


@pytest.fixture
def drafting_server(llama_server_bin, tmp_path):
    """Speculative decoding with SmolLM2 drafting for itself (same vocabulary): llama-server
    reports the drafted and accepted tokens in ``timings``, as with a draft model or MTP."""
    model = str(packaged_model_paths()["smollm2"])
    yield from serve(llama_server_bin, tmp_path, "-c", "2048", "-md", model, "--spec-type", "draft-simple")


def test_the_real_server_reports_drafted_and_accepted_tokens_and_the_usage_line_says_them(drafting_server):
    messages = [{"role": "user", "content": "Count from 1 to 20."}]
    deltas = list(CompletionClient(drafting_server).stream(messages, sampling={"max_tokens": 24, "seed": 1,
                                                                               "temperature": 0}))
    usage = next(d for d in deltas if isinstance(d, Usage))
    assert usage.draft_n and usage.draft_n > 0 and 0 <= usage.draft_n_accepted <= usage.draft_n, usage
    rate = round(100 * usage.draft_n_accepted / usage.draft_n)
    assert f"draft {rate}% accepted ({usage.draft_n_accepted} of {usage.draft_n})" in usage_line(usage.as_payload())


def test_the_real_server_reports_how_far_it_has_read_a_long_prompt(real_server):
    story = " ".join(f"Line {n}: the quick brown fox jumps over the lazy dog near river number {n}." for n in range(120))
    messages = [{"role": "user", "content": story + "\n\nSay OK."}]
    started = time.monotonic()
    deltas = list(CompletionClient(real_server).stream(messages, sampling={"max_tokens": 8, "seed": 1}))
    progress = [d for d in deltas if isinstance(d, Progress)]
    first_text = next(i for i, d in enumerate(deltas) if isinstance(d, TextDelta))
    usage = next(d for d in deltas if isinstance(d, Usage))
    assert usage.prompt_tokens > 2000, usage  # long enough to be read in several steps
    assert len(progress) >= 3, (progress, time.monotonic() - started)
    assert {p.total for p in progress} == {usage.prompt_tokens}
    steps = [p.processed for p in progress]
    assert steps == sorted(steps) and steps[-1] == usage.prompt_tokens and steps[0] < usage.prompt_tokens
    assert all(isinstance(d, Progress) for d in deltas[:len(progress)])  # all before the reply
    assert first_text >= len(progress)
