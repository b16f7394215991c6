"""The whole LongBench harness against a fake OpenAI-compatible server on 127.0.0.1.

The fake server decodes the token ids it receives with the same (tiny, locally trained) tokenizer and
answers like a perfect reader of the fixture text, so scores are known in advance; it also records
every request, so the tests can check exactly what was sent (template, chat template, truncation).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pagedweight.longbench.cli import main as cli_main
from pagedweight.longbench.datasets import get_spec
from pagedweight.longbench.engine_backend import EngineBackend
from pagedweight.longbench.fixtures import FixtureOptions, make_fixtures
from pagedweight.longbench.metrics import MetricDependencyError, rouge_score
from pagedweight.longbench.predictions import predictions_path, read_predictions
from pagedweight.longbench.prompts import PromptOptions, render_prompt
from pagedweight.longbench.data import load_dataset
from pagedweight.longbench.runner import LongBenchRunConfig, run_longbench

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (lossless decode) with a BOS post-processor and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus_dir = tmp_path_factory.mktemp("corpus")
    corpus = [p.read_text() for p in make_fixtures(corpus_dir, FixtureOptions(samples_per_file=1)).values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def perfect_reader_answer(prompt: str) -> str:
    """What a model that reads the fixture text perfectly answers; deliberately wrong when the fact was cut."""
    if "The following is an abstract." in prompt:
        abstract = prompt.split("The following is an abstract.", 1)[1]
        name = re.search(r"describes (\w+),", abstract)
        paragraphs = dict((m.group(2), m.group(1)) for m in re.finditer(r"Paragraph (\d+): (\w+) is a small town", prompt))
        return f"Paragraph {paragraphs.get(name.group(1), '0') if name else '0'}"
    if "pass key" in prompt:
        key = re.search(r"The pass key is (\d+)\.", prompt)
        return f"The pass key is {key.group(1) if key else 'unknown'}."
    if question := re.search(r"In which year was (\w+) founded\?", prompt):
        year = re.search(rf"{question.group(1)} is a small town .*? founded in (\d+)", prompt)
        return year.group(1) if year else "I do not know"
    if query := re.search(r"What did the group say about (\w+)\?", prompt):
        return f"They said {query.group(1)} has about many inhabitants."
    if prompt.rstrip().endswith("Summary:"):
        return "Anna will bring the cake.\nDialogue: something the scorer must ignore"
    return "unrecognized prompt"


@dataclass
class FakeServerState:
    tokenizer: Any
    tokenizer_dir: Path
    requests: list[dict[str, Any]] = field(default_factory=list)
    fail_after: int | None = None  # answer HTTP 500 once this many requests succeeded
    max_model_len: int = 200000
    garbage_response: bool = False
    served: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _make_handler(state: FakeServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/model_info":
                self._json(200, {"model_path": str(state.tokenizer_dir), "tokenizer_path": str(state.tokenizer_dir)})
            elif self.path == "/v1/models":
                self._json(200, {"data": [{"id": "fake-model", "max_model_len": state.max_model_len}]})
            elif self.path == "/server_info":
                self._json(200, {
                    "version": "fake", "context_length": 200000, "internal_states": [{"big": 1}],
                    "enable_paged_weight": True, "paged_weight_bits": 4, "paged_weight_path": None, "unrelated": 1,
                })  # fmt: skip
            else:
                self._json(404, {"detail": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                if state.fail_after is not None and state.served >= state.fail_after:
                    self._json(500, {"object": "error", "message": "scheduler crashed"})
                    return
                state.served += 1
                state.requests.append({"path": self.path, **body})
            if self.path == "/v1/completions":
                prompt = state.tokenizer.decode(body["prompt"], skip_special_tokens=False)
                prompt_tokens = len(body["prompt"])
            elif self.path == "/v1/chat/completions":
                prompt = body["messages"][0]["content"]
                prompt_tokens = len(state.tokenizer(prompt).input_ids)
            else:
                self._json(404, {"detail": "not found"})
                return
            if state.garbage_response:
                self.send_response(200)
                self.send_header("Content-Length", "9")
                self.end_headers()
                self.wfile.write(b"not json!")
                return
            answer = perfect_reader_answer(prompt)
            chat = self.path == "/v1/chat/completions"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(answer.split())}
            if not body.get("stream"):
                choice = {"message": {"role": "assistant", "content": answer}} if chat else {"text": answer}
                self._json(200, {"choices": [{**choice, "index": 0, "finish_reason": "stop"}], "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            words = answer.split(" ")
            for i, word in enumerate(words):
                piece = word if i == 0 else " " + word
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                finish = "stop" if i == len(words) - 1 else None
                chunk = {"choices": [{**delta, "index": 0, "finish_reason": finish}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def server(tokenizer: Any, tokenizer_dir: Path) -> Iterator[tuple[str, FakeServerState]]:
    state = FakeServerState(tokenizer=tokenizer, tokenizer_dir=tokenizer_dir)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(state))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


SMALL = FixtureOptions(samples_per_file=3, retrieval_paragraphs=8, passkey_filler_repeats=20, story_paragraphs=4, transcript_turns=4)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    make_fixtures(tmp_path / "data", SMALL)
    return tmp_path / "data"


def run_cli(base_url: str, data_dir: Path, out: Path, *extra: str) -> int:
    return cli_main(
        ["run", "--data-dir", str(data_dir), "--out", str(out), "--base-url", base_url, "--no-progress",
         "--max-prompt-tokens", "100000", *extra]
    )  # fmt: skip


def _decoded_prompts(state: FakeServerState, needle: str) -> list[str]:
    return [
        state.tokenizer.decode(r["prompt"], skip_special_tokens=False)
        for r in state.requests
        if r["path"] == "/v1/completions" and needle in state.tokenizer.decode(r["prompt"])
    ]


def test_full_run_scores_templates_and_report(server, data_dir: Path, tmp_path: Path, tokenizer) -> None:
    base_url, state = server
    out = tmp_path / "out"
    assert run_cli(base_url, data_dir, out, "--datasets", "narrativeqa,qmsum,passage_retrieval_en,passkey") == 0

    assert len(state.requests) == 12
    assert all(r["temperature"] == 0.0 and r["model"] == "fake-model" for r in state.requests)
    assert {r["max_tokens"] for r in state.requests} == {128, 512, 32}

    # narrativeqa: the official template inside the tokenizer's chat template, one BOS, sent as ids.
    sample = load_dataset(data_dir, "narrativeqa")[0]
    expected = "<s><|user|>" + render_prompt(get_spec("narrativeqa"), sample) + "<|assistant|>"
    assert expected in _decoded_prompts(state, sample.input)
    first = next(r for r in state.requests if sample.input in tokenizer.decode(r["prompt"]))
    assert first["prompt"].count(tokenizer.bos_token_id) == 1

    report = json.loads((out / "results.json").read_text())
    scores = report["scores"]
    assert scores["narrativeqa"]["score"] == 100.0 and scores["narrativeqa"]["n_scored"] == 3
    assert scores["passage_retrieval_en"]["score"] == 100.0
    assert scores["passkey"]["score"] == 100.0 and scores["passkey"]["official"] is False
    qmsum_expected = [
        rouge_score(perfect_reader_answer(render_prompt(get_spec("qmsum"), s)), s.answers[0])
        for s in load_dataset(data_dir, "qmsum")
    ]
    assert scores["qmsum"]["score"] == round(100 * sum(qmsum_expected) / 3, 2)
    assert 0 < scores["qmsum"]["score"] < 100
    # The average is over the official datasets only (passkey is project-defined).
    assert report["average"] == round((100 + 100 + scores["qmsum"]["score"]) / 3, 2)
    assert report["server"]["model_info"]["tokenizer_path"] == str(state.tokenizer_dir)
    assert report["server"]["server_args"] == {
        "version": "fake", "context_length": 200000,
        "enable_paged_weight": True, "paged_weight_bits": 4, "paged_weight_path": None,
    }  # fmt: skip
    assert report["settings"]["max_prompt_tokens"] == 100000
    assert report["this_run"]["n_requests"] == 12 and report["this_run"]["ttft_mean_s"] is None
    assert report["this_run"]["output_tokens"] > 0
    table = (out / "results.md").read_text()
    assert "| passage_retrieval_en | retrieval_score | 3 | 100.00 |" in table
    assert "passkey (synthetic)" in table


def test_prompts_are_truncated_in_the_middle_like_pred_py(server, data_dir: Path, tmp_path: Path, tokenizer) -> None:
    base_url, state = server
    out = tmp_path / "out"
    assert cli_main(
        ["run", "--data-dir", str(data_dir), "--out", str(out), "--base-url", base_url, "--no-progress",
         "--datasets", "narrativeqa", "--max-prompt-tokens", "65"]
    ) == 0  # fmt: skip
    for sample in load_dataset(data_dir, "narrativeqa"):
        full_ids = tokenizer(render_prompt(get_spec("narrativeqa"), sample)).input_ids
        assert len(full_ids) > 65
        # half = int(65 / 2) = 32 tokens from each end; the BOS among the first 32 is skipped when decoding.
        kept = tokenizer.decode(full_ids[:32], skip_special_tokens=True) + tokenizer.decode(full_ids[-32:], skip_special_tokens=True)
        assert "<s><|user|>" + kept + "<|assistant|>" in _decoded_prompts(state, kept[-40:])
        assert kept.startswith("You are given a story") and kept.endswith("Answer:")
    records = read_predictions(predictions_path(out, "narrativeqa"))
    assert all(r.truncated and r.original_prompt_tokens > 65 for r in records.values())
    # The founding-year sentence sits in the cut middle, so the perfect reader cannot answer.
    assert json.loads((out / "results.json").read_text())["scores"]["narrativeqa"]["score"] == 0.0


def test_resume_after_a_server_failure_asks_only_unanswered_samples(server, data_dir: Path, tmp_path: Path, capsys) -> None:
    base_url, state = server
    out = tmp_path / "out"
    state.fail_after = 2
    assert run_cli(base_url, data_dir, out, "--datasets", "passage_retrieval_en,passkey", "--concurrency", "1") == 2
    err = capsys.readouterr().err
    assert "passage_retrieval_en sample" in err and "HTTP 500" in err and "scheduler crashed" in err
    assert len(read_predictions(predictions_path(out, "passage_retrieval_en"))) == 2

    state.fail_after, state.requests = None, []
    assert run_cli(base_url, data_dir, out, "--datasets", "passage_retrieval_en,passkey", "--concurrency", "1") == 0
    assert len(state.requests) == 1 + 3  # the one unanswered retrieval sample, then all passkey samples
    lines = predictions_path(out, "passage_retrieval_en").read_text().splitlines()
    assert len(lines) == 3 and len({json.loads(line)["_id"] for line in lines}) == 3
    report = json.loads((out / "results.json").read_text())
    assert report["scores"]["passage_retrieval_en"]["score"] == 100.0
    assert report["this_run"]["n_requests"] == 4  # timing covers this invocation only

    state.requests = []
    assert run_cli(base_url, data_dir, out, "--datasets", "passage_retrieval_en,passkey") == 0
    assert state.requests == []  # everything answered: nothing is sent


def test_resume_with_other_prompt_settings_is_refused(server, data_dir: Path, tmp_path: Path, capsys) -> None:
    base_url, _ = server
    out = tmp_path / "out"
    assert run_cli(base_url, data_dir, out, "--datasets", "passkey", "--limit", "1") == 0
    code = cli_main(
        ["run", "--data-dir", str(data_dir), "--out", str(out), "--base-url", base_url, "--no-progress",
         "--datasets", "passkey", "--max-prompt-tokens", "5000"]
    )  # fmt: skip
    assert code == 2
    assert "max_prompt_tokens: 100000 -> 5000" in capsys.readouterr().err


def test_streaming_records_time_to_first_token(server, data_dir: Path, tmp_path: Path) -> None:
    base_url, state = server
    out = tmp_path / "out"
    assert run_cli(base_url, data_dir, out, "--datasets", "passkey,narrativeqa", "--stream") == 0
    assert all(r["stream"] for r in state.requests)
    records = list(read_predictions(predictions_path(out, "passkey")).values())
    assert all(r.ttft_s is not None and 0 <= r.ttft_s <= r.latency_s for r in records)
    assert all(r.pred.startswith("The pass key is ") and r.completion_tokens == 5 for r in records)
    report = json.loads((out / "results.json").read_text())
    assert report["scores"]["passkey"]["score"] == 100.0 and report["scores"]["narrativeqa"]["score"] == 100.0
    assert report["this_run"]["ttft_mean_s"] is not None and report["this_run"]["ttft_p99_s"] is not None


def test_chat_api_and_the_datasets_that_get_no_chat_template(server, data_dir: Path, tmp_path: Path, tokenizer) -> None:
    base_url, state = server
    samsum = {
        "input": "Dialogue: Tom: Who brings the cake?\nAnna: I will.\nSummary: ",
        "context": "Dialogue: Bob: Lunch?\nEve: Sure.\nSummary: Bob and Eve will have lunch.",
        "answers": ["Anna will bring the cake."], "length": 20, "dataset": "samsum", "language": "en",
        "all_classes": None, "_id": "samsum-0",
    }  # fmt: skip
    (data_dir / "samsum.jsonl").write_text(json.dumps(samsum) + "\n")
    out = tmp_path / "out"
    assert run_cli(base_url, data_dir, out, "--datasets", "narrativeqa,samsum", "--api", "chat") == 0

    chat = [r for r in state.requests if r["path"] == "/v1/chat/completions"]
    assert len(chat) == 3
    assert chat[0]["messages"][0]["content"].startswith("You are given a story")
    completions = [r for r in state.requests if r["path"] == "/v1/completions"]
    assert len(completions) == 1  # samsum: raw prompt, tokenized with BOS as pred.py does, no chat template
    prompt = tokenizer.decode(completions[0]["prompt"], skip_special_tokens=False)
    assert prompt == "<s>" + render_prompt(get_spec("samsum"), load_dataset(data_dir, "samsum")[0])
    assert completions[0]["max_tokens"] == 128
    report = json.loads((out / "results.json").read_text())
    assert report["scores"]["samsum"]["score"] == pytest.approx(100.0, abs=0.01)  # second line ignored
    assert report["scores"]["narrativeqa"]["score"] == 100.0


def test_tokenizer_without_chat_template_needs_no_chat_template_flag(server, data_dir: Path, tmp_path: Path, tokenizer_dir: Path, capsys) -> None:
    from transformers import AutoTokenizer

    base_url, state = server
    plain = tmp_path / "plain_tokenizer"
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = None
    tok.save_pretrained(plain)
    out = tmp_path / "out"
    assert run_cli(base_url, data_dir, out, "--datasets", "passkey", "--tokenizer", str(plain)) == 2
    assert "--no-chat-template" in capsys.readouterr().err
    assert state.requests == []
    assert run_cli(base_url, data_dir, tmp_path / "out2", "--datasets", "passkey", "--tokenizer", str(plain), "--no-chat-template") == 0
    assert tok.decode(state.requests[0]["prompt"], skip_special_tokens=False).startswith("<s>There is an important")


def test_longbench_e_reports_length_buckets(server, tmp_path: Path) -> None:
    base_url, _ = server
    data = tmp_path / "data"
    make_fixtures(data, FixtureOptions(samples_per_file=3))
    out = tmp_path / "out"
    assert cli_main(
        ["run", "--data-dir", str(data), "--out", str(out), "--base-url", base_url, "--no-progress",
         "--longbench-e", "--max-prompt-tokens", "200000"]
    ) == 0  # fmt: skip
    score = json.loads((out / "results.json").read_text())["scores"]["passage_retrieval_en_e"]
    assert score["bucket_counts"] == {"0-4k": 1, "4-8k": 1, "8k+": 1}
    assert score["length_buckets"] == {"0-4k": 100.0, "4-8k": 100.0, "8k+": 100.0}
    assert "| 0-4k | 4-8k | 8k+ |" in (out / "results.md").read_text()


class FakeEngine:
    """The part of sglang.Engine's generate() the harness uses."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[list[list[int]], list[dict[str, Any]]]] = []

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.calls.append((input_ids, sampling_params))
        return [
            {
                "text": perfect_reader_answer(self.tokenizer.decode(ids)),
                "meta_info": {"finish_reason": {"type": "stop"}, "prompt_tokens": len(ids), "completion_tokens": 4},
            }
            for ids in input_ids
        ]


def test_engine_backend_runs_the_same_pipeline(data_dir: Path, tmp_path: Path, tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    config = LongBenchRunConfig(
        data_dir=data_dir,
        out_dir=tmp_path / "out",
        datasets=("passage_retrieval_en", "passkey"),
        prompt=PromptOptions(max_prompt_tokens=100000, endpoint="completions"),
        tokenizer="test-tokenizer",
        model="fake-engine",
    )
    report = run_longbench(config, EngineBackend(engine, batch_size=2), tokenizer, show_progress=False)
    assert [len(ids) for ids, _ in engine.calls] == [2, 1, 2, 1]
    assert engine.calls[0][1][0] == {"max_new_tokens": 32, "temperature": 0.0}
    assert {s.dataset: s.score for s in report.scores} == {"passage_retrieval_en": 100.0, "passkey": 100.0}
    record = next(iter(read_predictions(predictions_path(config.out_dir, "passkey")).values()))
    assert record.finish_reason == "stop" and record.completion_tokens == 4


def test_zh_datasets_are_refused_without_jieba(monkeypatch, tmp_path: Path, tokenizer) -> None:
    import pagedweight.longbench.runner as runner

    monkeypatch.setattr(runner, "jieba_available", lambda: False)
    config = LongBenchRunConfig(
        data_dir=tmp_path, out_dir=tmp_path / "out", datasets=("multifieldqa_zh",),
        prompt=PromptOptions(max_prompt_tokens=1000, endpoint="completions"), tokenizer="t", model="m",
    )  # fmt: skip
    with pytest.raises(MetricDependencyError, match="pip install jieba"):
        run_longbench(config, EngineBackend(FakeEngine(tokenizer)), tokenizer, show_progress=False)


def test_unreachable_server_is_a_clear_error(data_dir: Path, tmp_path: Path, capsys) -> None:
    assert run_cli("http://127.0.0.1:9", data_dir, tmp_path / "out") == 2
    assert "cannot reach the SGLang server at http://127.0.0.1:9" in capsys.readouterr().err


def test_prompt_longer_than_the_server_context_is_refused_before_sending(server, data_dir: Path, tmp_path: Path, capsys) -> None:
    base_url, state = server
    state.max_model_len = 100
    assert run_cli(base_url, data_dir, tmp_path / "out", "--datasets", "passkey") == 2
    assert "exceed the server's context length 100; lower --max-prompt-tokens" in capsys.readouterr().err
    assert state.requests == []


def test_malformed_server_response_names_the_sample(server, data_dir: Path, tmp_path: Path, capsys) -> None:
    base_url, state = server
    state.garbage_response = True
    assert run_cli(base_url, data_dir, tmp_path / "out", "--datasets", "passkey", "--concurrency", "1") == 2
    err = capsys.readouterr().err
    assert "passkey sample" in err and "JSONDecodeError" in err
