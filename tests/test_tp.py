"""Tensor parallelism on the CPU: two gloo ranks give the logits, features and tokens of one process; rank 0
alone decides when a generation stops; `flashdraft serve --tp 2` answers as a one-process server does."""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashdraft.engine.engine import EngineConfig, Completion, Engine, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.formats.loader import build_target
from flashdraft.launch import free_port, run_tensor_parallel
from flashdraft.models.llama import LlamaConfig
from flashdraft.models.llama import Llama
from tiny import interrupt, make_draft, make_target, wait_healthy, forward1

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 3, 99, 42, 7, 7, 13, 250, 31, 8, 64]

CONFIGS = {
    "llama-gqa-biases": LlamaConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3,
                                    num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True,
                                    mlp_bias=True),
    "qwen3-tied-odd-vocab": LlamaConfig(arch="qwen3", vocab_size=97, hidden_size=64, intermediate_size=128,
                                        num_layers=3, num_heads=8, num_kv_heads=2, head_dim=8, qk_norm=True,
                                        tie_word_embeddings=True),
    "mistral-window": LlamaConfig(arch="mistral", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                                  num_heads=2, num_kv_heads=2, head_dim=16, sliding_window=6),
}


def random_target(cfg: LlamaConfig) -> Llama:
    torch.manual_seed(0)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    return model.eval()


def steps_of(model: Llama) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Logits and captured features of a chunked prefill, two decode steps and a verify block of five."""
    state = model.new_state(1, 64)
    ids = torch.tensor(PROMPT) % model.cfg.vocab_size
    out = []
    with torch.inference_mode():
        for start, end, fresh in [(0, 8, True), (8, 12, False), (12, 13, False), (13, 14, False), (14, 19, False)]:
            chunk = ids[start:end] if end <= len(ids) else torch.arange(start, end) % model.cfg.vocab_size
            out.append(forward1(model, state, chunk, torch.arange(start, end), capture=[0, 2 % model.cfg.num_layers],
                                fresh=fresh))
    return out


def sharded_forward_errors(device: str) -> dict[str, list[float]]:
    """Per model: the largest logits difference between this rank's sharded target and the whole one, and
    the largest features difference relative to the features' size (the residual stream grows to tens,
    where summing in another order moves the last bits)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = {}
    for name, cfg in CONFIGS.items():
        full = random_target(cfg)
        shard = build_target(cfg, full.state_dict().items(), device, torch.float32, rank, world)
        assert shard.model.layers[0].self_attn.num_heads == cfg.num_heads // world
        assert shard.lm_head.weight.shape[0] == -(-cfg.vocab_size // world)
        errors[name] = [0.0, 0.0]
        for (want, want_feats), (got, got_feats) in zip(steps_of(full), steps_of(shard), strict=True):
            feature_error = (got_feats - want_feats).abs().max() / want_feats.abs().max()
            errors[name] = [max(errors[name][0], float((got - want).abs().max())), max(errors[name][1], float(feature_error))]
    return errors


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    target = make_target(root / "target")
    return target, make_draft(root / "draft", target)


REQUESTS = [  # (request, how many events rank 0 reads before closing the stream; None: all)
    (dict(prompt_ids=[5, 6, 7, 8, 9], params=dict(max_tokens=24, ignore_eos=True)), None),
    (dict(prompt_ids=[5, 6, 7, 8, 9], params=dict(max_tokens=12, ignore_eos=True), speculative=False), None),
    (dict(prompt_ids=[11, 12, 13], params=dict(max_tokens=16, temperature=0.9, seed=7)), None),
    (dict(prompt_ids=[11, 12, 13], params=dict(max_tokens=200, ignore_eos=True)), 2),  # closed early
    (dict(prompt_ids=[40, 41, 42, 43], params=dict(max_tokens=12, temperature=1.0, top_k=20, seed=-1)), None),
    (dict(prompt_ids=[1, 2, 3, 4, 5, 6, 7], params=dict(max_tokens=16, stop=["a"])), None),
]


def engine_request(spec: dict) -> Request:
    return Request(**{**spec, "params": SamplingParams(**spec["params"])})


def run_requests(engine: Engine) -> list[list[int]]:
    """Each request's tokens; a request read to its `events` limit is closed there (a client that went away)."""
    tokens = []
    for spec, events in REQUESTS:
        stream = engine.stream(engine_request(spec))
        got = []
        for i, event in enumerate(stream):
            if events is not None and i == events:
                stream.close()
                break
            got += event.token_ids if not isinstance(event, Completion) else []
        tokens.append(got)
    return tokens


def two_rank_checks(target: str, draft: str, out: str, device: str) -> int:
    """The sharded forward errors; then rank 0 streams requests that only it knows of while the other rank
    follows (the server's protocol); then every rank streams the same requests itself (the command line's)."""
    errors = sharded_forward_errors(device)
    engine = Engine.load(EngineConfig(target, draft, device=device, ctx_size=512))
    if engine.rank == 0:
        followed = run_requests(engine)
        engine.stop_followers()
    else:
        engine.follow()
        followed = None
    together = run_requests(engine)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, together)
    if engine.rank == 0:
        Path(out).write_text(json.dumps(dict(errors=errors, followed=followed, together=everyone)))
    return 0


@pytest.fixture(scope="module")
def two_ranks(models, tmp_path_factory) -> dict:
    """What two gloo ranks computed (one run for all the tests below: starting ranks takes seconds)."""
    target, draft = models
    out = tmp_path_factory.mktemp("tp-run") / "results.json"
    assert run_tensor_parallel(functools.partial(two_rank_checks, str(target), str(draft), str(out)), 2, "cpu") == 0
    return json.loads(out.read_text())


def test_two_ranks_compute_what_one_process_computes(two_ranks):
    for name, (logits_error, features_error) in two_ranks["errors"].items():
        assert logits_error < 1e-5 and features_error < 1e-5, name


def test_engine_on_two_ranks_gives_the_tokens_of_one(models, two_ranks):
    target, draft = models
    got = two_ranks
    want = run_requests(Engine.load(EngineConfig(str(target), str(draft), device="cpu", ctx_size=512)))
    random_seed = [i for i, (spec, _) in enumerate(REQUESTS) if spec["params"].get("seed") == -1]
    for tokens in [got["followed"], *got["together"]]:
        assert [t for i, t in enumerate(tokens) if i not in random_seed] == \
               [t for i, t in enumerate(want) if i not in random_seed]
    # a request closed early on rank 0 stops the other rank too: the requests after it still match
    assert got["together"][0] == got["together"][1]  # the random seed too: rank 0 draws it for both


def test_heads_that_do_not_split_are_a_one_line_error():
    cfg = CONFIGS["llama-gqa-biases"]
    with pytest.raises(ValueError) as e:
        Llama(cfg, rank=0, world_size=3)
    assert str(e.value) == ("tensor parallelism over 3 ranks needs the model's attention heads 4, KV heads 2 "
                            "to be divisible by 3")
    with pytest.raises(ValueError, match="one request at a time"):
        Engine(Llama(cfg, rank=0, world_size=2), tokenizer=None, config=EngineConfig(n_slots=2))


# ---- the command lines


def started(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_serve_tp2_answers_as_one_process(models):
    import httpx
    import openai
    from flashdraft.formats.chat import render_prompt
    target, draft = models
    url = f"http://127.0.0.1:{free_port()}"
    proc = started([sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(target), "--spec-draft-model", str(draft),
                    "--tp", "2", "--device", "cpu", "--port", url.rsplit(":", 1)[1], "-c", "1024"])
    question = "The quick brown fox"
    engine = Engine.load(EngineConfig(str(target), str(draft), device="cpu", ctx_size=1024))
    prompt = render_prompt(engine.tokenizer, question, chat=True)
    expected = engine.generate(Request(prompt, SamplingParams(max_tokens=16)))
    try:
        wait_healthy(proc, url)
        messages = [{"role": "user", "content": question}]
        # a sampled stream that the client leaves: rank 0 stops it, and the other rank with it
        body = {"messages": messages, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and next(r.iter_lines()).startswith("data: ")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=16)
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.completion_tokens == len(expected.token_ids) and reply.usage.prompt_tokens == len(prompt)
    finally:
        log = interrupt(proc, 60)
    assert "tensor-parallel over 2 ranks" in log and "cancelled: the client went away" in log
    assert "Traceback" not in log, log


@pytest.mark.slow  # two processes start and load the model
def test_generate_tp2_matches_one_process(models):
    target, draft = models
    cmd = [sys.executable, "-m", "flashdraft.cli", "generate", "-m", str(target), "--draft", str(draft), "--device",
           "cpu", "--ctx-size", "512", "--prompt", "def add(a, b):", "-n", "20", "--json"]
    one, two = started(cmd), started(cmd + ["--tp", "2"])
    (out_one, _), (out_two, _) = one.communicate(timeout=300), two.communicate(timeout=300)
    assert one.returncode == 0 and two.returncode == 0, out_two
    result_one, result_two = (json.loads(out.strip().splitlines()[-1]) for out in (out_one, out_two))
    assert result_two["token_ids"] == result_one["token_ids"] and result_two["text"] == result_one["text"]


@pytest.mark.slow  # two gloo ranks start
def test_tp_benchmark_smoke(tmp_path):
    out = tmp_path / "tp.json"
    run = subprocess.run([sys.executable, "benchmarks/tp.py", "--tiny", "--device", "cpu", "--out", str(out)], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "tensor-parallel over 2 ranks" in run.stdout and "verify16/decode" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["ctx"] for r in rows] == [64, 300] and all(r["decode_tok_s"] > 0 for r in rows)
