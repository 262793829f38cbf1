"""What an SGLang program imports and calls outside the language itself: module paths,
``RuntimeEndpoint`` URLs, the benchmark helpers, and clear refusals of what is not here."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

try:
    import radixlm as sgl
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm as sgl

from radixlm.client import TritonClient
from radixlm.http_client import HttpTritonClient
from radixlm.testing import FakeBackend


def test_programs_find_sglangs_names_under_the_same_module_paths():
    from radixlm.api import set_default_backend
    from radixlm.lang.backend.runtime_endpoint import RuntimeEndpoint
    from radixlm.lang.choices import greedy_token_selection
    from radixlm.lang.interpreter import ProgramState, ProgramStateGroup
    from radixlm.lang.ir import REGEX_FLOAT, REGEX_INT, REGEX_STR
    from radixlm.test.test_utils import add_common_sglang_args_and_parse, select_sglang_backend
    from radixlm.utils import download_and_cache_file, dump_state_text, read_jsonl

    assert set_default_backend is sgl.set_default_backend
    assert RuntimeEndpoint is sgl.RuntimeEndpoint
    assert greedy_token_selection is sgl.greedy_token_selection
    assert (ProgramState, ProgramStateGroup) == (sgl.ProgramState, sgl.ForkGroup)
    assert (REGEX_INT, REGEX_FLOAT, REGEX_STR) == (sgl.REGEX_INT, sgl.REGEX_FLOAT, sgl.REGEX_STR)
    assert callable(add_common_sglang_args_and_parse) and callable(select_sglang_backend)
    assert callable(download_and_cache_file) and callable(dump_state_text)
    assert callable(read_jsonl)


@pytest.mark.parametrize("url, transport, address", [
    ("http://127.0.0.1:8000", HttpTritonClient, "http://127.0.0.1:8000"),
    ("https://models.example:443/", HttpTritonClient, "https://models.example:443"),
    ("127.0.0.1:8001", TritonClient, "127.0.0.1:8001"),
    ("grpc://10.0.0.5:9001", TritonClient, "10.0.0.5:9001"),
])
def test_runtime_endpoint_talks_http_or_grpc_by_the_urls_scheme(url, transport, address):
    endpoint = sgl.RuntimeEndpoint(url)  # connects on first use, not here
    assert isinstance(endpoint.client, transport)
    assert endpoint.client.url == address and endpoint.client.model == "llm"


def test_runtime_endpoint_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="scheme"):
        sgl.RuntimeEndpoint("ftp://host:21")
    with pytest.raises(ValueError, match="api_key"):
        sgl.RuntimeEndpoint("grpc://host:8001", api_key="secret")
    with pytest.raises(ValueError, match="chat_template_name"):
        sgl.RuntimeEndpoint("http://host:8000", chat_template_name="vicuna")
    chatml = sgl.RuntimeEndpoint("http://host:8000", chat_template_name="chatml")
    assert chatml.get_chat_template() == sgl.ChatTemplate.chatml()


def test_benchmark_helpers_parse_sglangs_flags_and_build_an_http_endpoint(monkeypatch):
    from radixlm.test.test_utils import add_common_sglang_args_and_parse, select_sglang_backend

    monkeypatch.setattr(sys, "argv", ["bench", "--parallel", "4", "--num-questions", "3"])
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-questions", type=int, default=10)
    args = add_common_sglang_args_and_parse(parser)
    assert (args.parallel, args.num_questions, args.backend) == (4, 3, "srt")
    backend = select_sglang_backend(args)
    assert isinstance(backend.client, HttpTritonClient)
    assert backend.client.url == "http://127.0.0.1:8000"
    args.backend = "gpt-4"
    with pytest.raises(ValueError, match="gpt-4"):
        select_sglang_backend(args)


def test_global_config_default_backend_is_set_default_backends():
    backend = FakeBackend()
    sgl.global_config.default_backend = backend
    try:
        assert sgl.get_default_backend() is backend
        sgl.set_default_backend(None)
        assert sgl.global_config.default_backend is None
    finally:
        sgl.set_default_backend(None)


def test_images_videos_and_in_process_servers_are_refused_with_what_to_do_instead():
    with pytest.raises(NotImplementedError, match="text-only"):
        sgl.image("cat.png")
    with pytest.raises(NotImplementedError, match="text-only"):
        sgl.video("clip.mp4", 8)
    with pytest.raises(RuntimeError, match="RuntimeEndpoint"):
        sgl.Runtime(model_path="meta-llama/Llama-2-7b-chat-hf")
    with pytest.raises(NotImplementedError, match="RuntimeEndpoint"):
        sgl.OpenAI("gpt-3.5-turbo-instruct")

    @sgl.function
    def prog(s):
        s += "x"

    with pytest.raises(NotImplementedError, match="radix cache"):
        prog.cache()
    with pytest.raises(NotImplementedError, match="cache"):
        sgl.flush_cache(FakeBackend())
    assert sgl.flush_cache() is False  # no backend at all


def test_role_begin_and_end_build_the_same_turns_as_the_role_functions():
    @sgl.function
    def split_turn(s):
        s += sgl.system_begin() + "Be brief." + sgl.system_end()
        s += sgl.user_begin()
        s += "Hi"
        s += sgl.user_end()
        s += sgl.assistant_begin() + sgl.gen("a") + sgl.assistant_end()

    @sgl.function
    def whole_turn(s):
        s += sgl.system("Be brief.") + sgl.user("Hi") + sgl.assistant(sgl.gen("a"))

    backend = FakeBackend()
    assert split_turn.run(backend=backend).text() == whole_turn.run(backend=backend).text()


def test_num_api_spec_tokens_is_accepted_and_programs_run_as_usual():
    @sgl.function(num_api_spec_tokens=64)
    def prog(s):
        s += "Name:" + sgl.gen("name", stop="\n")

    sgl.set_default_backend(FakeBackend())
    try:
        state = prog()
        state.sync()
        assert state["name"] == "ok"
    finally:
        sgl.set_default_backend(None)


def test_read_jsonl_and_dump_state_text_round_trip(tmp_path):
    from radixlm.utils import dump_state_text, read_jsonl

    data = tmp_path / "q.jsonl"
    data.write_text('{"q": 1}\n# a comment\n{"q": 2}\n')
    assert read_jsonl(str(data)) == [{"q": 1}, {"q": 2}]

    @sgl.function
    def prog(s, q):
        s += f"q={q} " + sgl.gen("a")

    states = prog.run_batch([{"q": 1}, {"q": 2}], backend=FakeBackend())
    out = tmp_path / "out.txt"
    dump_state_text(str(out), states + [["not", "a", "state"]])
    text = out.read_text()
    assert "q=1 ok" in text and "q=2 ok" in text and json.dumps("not")[1:-1] in text
