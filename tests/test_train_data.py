"""Training prompts (formats, the MBPP split, refusal of evaluation sets) and `make-data` records."""
import json
from pathlib import Path

import pytest
import torch

from flashdraft.train.code_prompts import code_instructions
from flashdraft.train.data import main as make_data_main
from flashdraft.train.prompts import load_prompts, read_json_records

TRAINING_FILES = ("gsm8k_train.jsonl", "alpaca_5000.json", "mbpp.jsonl")
EVALUATION_FILES = ("HumanEval.jsonl.gz", "mt_bench_question.jsonl", "spec_bench_question.jsonl")


pytestmark = pytest.mark.usefixtures("one_thread")


def write(path: Path, rows, array=False) -> Path:
    path.write_text(json.dumps(rows) if array else "".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_formats(tmp_path):
    alpaca = write(tmp_path / "alpaca.json", [{"instruction": "Sort these", "input": "3, 1, 2", "output": "x"},
                                              {"instruction": "Say hi", "input": "", "output": "hi"}], array=True)
    sharegpt = write(tmp_path / "sg.json", [{"id": "a", "conversations": [
        {"from": "human", "value": "What is DFlash?"}, {"from": "gpt", "value": "..."},
        {"from": "human", "value": "second turn"}]}], array=True)
    gsm = write(tmp_path / "gsm8k_train.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?"}])
    mbpp = write(tmp_path / "mbpp.jsonl", [
        {"task_id": 12, "text": "eval task", "code": "def f(x):\n    return x", "test_list": ["assert f(1) == 1"]},
        {"task_id": 700, "text": "Write a function to double x.", "code": "def double(x):\r\n  return 2*x",
         "test_list": ["assert double(2) == 4", "assert double(0) == 0"]}])
    plain = write(tmp_path / "plain.jsonl", [{"prompt": "Write a haiku."}, {"prompt": "Sort these\n\n3, 1, 2"}])
    prompts = load_prompts([str(p) for p in (alpaca, sharegpt, gsm, mbpp, plain)])
    texts = {p.text: p for p in prompts}
    assert "Sort these\n\n3, 1, 2" in texts and "Say hi" in texts
    assert texts["What is DFlash?"].source == "sharegpt"
    assert "1+1?" in texts and any(t.startswith("2+2?") and "step by step" in t for t in texts)
    mbpp_texts = [p.text for p in prompts if p.source == "mbpp"]
    assert len(mbpp_texts) == 2 and not any("eval task" in t for t in mbpp_texts)  # only task ids 601-974
    assert any("def double(x):" in t and ">>> double(2) == 4" in t for t in mbpp_texts)
    assert "Write a haiku." in texts
    assert len(prompts) == len(texts)  # the duplicate plain prompt is dropped
    assert len({p.id for p in prompts}) == len(prompts)
    with pytest.raises(ValueError, match="evaluation"):
        load_prompts([str(mbpp)], mbpp_ids=(1, 974))


def test_evaluation_sets_are_refused(tmp_path):
    humaneval = write(tmp_path / "problems.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():",
                                                     "canonical_solution": "", "entry_point": "f"}])
    mtbench = write(tmp_path / "questions.jsonl", [{"question_id": 81, "category": "writing", "turns": ["a", "b"]}])
    named = write(tmp_path / "spec_bench_question.jsonl", [{"prompt": "x"}])
    for path in (humaneval, mtbench, named):
        with pytest.raises(ValueError, match="evaluation"):
            load_prompts([str(path)])


def test_truncated_json_array_keeps_complete_items(tmp_path):
    text = json.dumps([{"instruction": f"task {i}"} for i in range(5)])
    path = tmp_path / "cut.json"
    path.write_text(text[:text.index("task 4") - 5])
    assert [r["instruction"] for r in read_json_records(path)] == [f"task {i}" for i in range(4)]


def test_code_instructions_avoid_the_seed_subjects():
    prompts = code_instructions()
    assert len(prompts) >= 300 and len(set(prompts)) == len(prompts)
    lowered = " ".join(prompts).lower()
    for subject in ("task store", "key-value", "linked list"):
        assert subject not in lowered


def test_code_instructions_name_no_humaneval_function():
    import gzip
    import re
    from data_files import data_dir
    with gzip.open(data_dir("HumanEval.jsonl.gz") / "HumanEval.jsonl.gz", "rt") as f:
        names = {json.loads(line)["entry_point"] for line in f if line.strip()}
    text = "\n".join(code_instructions())
    assert not [n for n in names if re.search(rf"\b{re.escape(n)}\(", text)]


def test_shared_training_files():
    from data_files import data_dir
    folder = data_dir(*TRAINING_FILES, *EVALUATION_FILES)
    files = [str(folder / f) for f in TRAINING_FILES]
    prompts = load_prompts(files)
    by_source = {}
    for p in prompts:
        by_source[p.source] = by_source.get(p.source, 0) + 1
    assert by_source["gsm8k"] > 7000 and by_source["alpaca"] > 4500
    assert 374 <= by_source["mbpp"] <= 2 * 374  # task ids 601-974, native and stub forms
    for name in EVALUATION_FILES:
        with pytest.raises(ValueError, match="evaluation"):
            load_prompts([str(folder / name)])


# ---------------------------------------------------------------------------------------------------------
# make-data on a tiny target
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target_folder(tmp_path_factory):
    from tiny import make_target
    return make_target(tmp_path_factory.mktemp("target"), layers=3, std=0.15)


def check_records(rows, tokenizer, max_new):
    from flashdraft.formats.chat import chat_ids
    for row in rows:
        ids, mask, n = row["input_ids"], row["loss_mask"], row["prompt_len"]
        assert len(ids) == len(mask) and set(mask[:n]) <= {0} and set(mask[n:]) == {1}
        assert ids[:n] == chat_ids(tokenizer, [{"role": "user", "content": row["prompt_text"]}])
        assert tokenizer.decode(ids[:n], skip_special=False).endswith("<|im_start|>assistant\n")
        response = ids[n:]
        assert 1 <= len(response) <= max_new
        if row["finish"] == "stop":
            assert response[-1] in tokenizer.eos_ids and not set(response[:-1]) & set(tokenizer.eos_ids)
        else:
            assert len(response) == max_new


@pytest.mark.parametrize("backend", ["batched", "hf", "flashdraft"])
def test_make_data_records_and_resume(tiny_target_folder, tmp_path, backend):
    if backend == "hf":
        pytest.importorskip("transformers")
    from flashdraft.formats.loader import load_target
    prompts = write(tmp_path / "p.jsonl", [{"prompt": f"Write {w} code"} for w in ("some", "more", "fast", "good")])
    out = tmp_path / "data.jsonl"
    common = ["-m", str(tiny_target_folder), "--data", str(prompts), "--out", str(out), "--device", "cpu",
              "--gen-backend", backend, "--gen-batch-size", "3", "--max-new-tokens", "12"]
    assert make_data_main(common + ["--limit", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2
    assert make_data_main(common) == 0  # resumes: only the two missing prompts are answered
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and len({r["id"] for r in rows}) == 4
    _, tokenizer, _ = load_target(str(tiny_target_folder))
    source = {f"p.jsonl:{i}": json.loads(line)["prompt"] for i, line in enumerate(prompts.read_text().splitlines())}
    for r in rows:
        r["prompt_text"] = source[r["id"]]
    check_records(rows, tokenizer, 12)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_generation_backends_agree(tmp_path, arch):
    """Batched decoding with left padding (ours, and transformers generate) gives flashdraft's own greedy
    answers, prompt by prompt."""
    from tiny import make_target
    folder = make_target(tmp_path / "target", arch=arch, layers=3, std=0.15)
    if arch == "mistral":  # a window shorter than the sequences, so the sliding mask matters
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(config, sliding_window=24)))
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "x" * k + " code"} for k in (1, 7, 20)])
    backends = ["batched", "flashdraft"] + (["hf"] if arch == "llama" else [])
    results = {}
    for backend in backends:
        out = tmp_path / f"{backend}.jsonl"
        make_data_main(["-m", str(folder), "--data", str(prompts), "--out", str(out), "--device", "cpu",
                        "--gen-backend", backend, "--gen-batch-size", "3", "--max-new-tokens", "30"])
        results[backend] = {json.loads(l)["id"]: json.loads(l)["input_ids"] for l in out.read_text().splitlines()}
    for backend in backends[1:]:
        assert results[backend] == results["batched"], backend


@pytest.mark.slow
def test_smollm2_records(smollm2_gguf, tmp_path):
    """The real target: ChatML prompts, batched answers equal to the engine's own greedy ones."""
    from flashdraft.formats.loader import load_target
    from flashdraft.train.data import GenOptions, generate_records
    from flashdraft.train.prompts import TrainPrompt
    target, tokenizer, _ = load_target(str(smollm2_gguf))
    prompts = [TrainPrompt(f"p{i}", "test", t) for i, t in
               enumerate(["What is 2 + 3?", "Write a Python function that reverses a string.", "Say hi."])]
    rows = {}
    for backend in ("batched", "flashdraft"):
        out = tmp_path / f"{backend}.jsonl"
        generate_records(target, tokenizer, prompts, out, GenOptions(backend=backend, max_new_tokens=12))
        rows[backend] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_ids"] for r in rows["batched"]] == [r["input_ids"] for r in rows["flashdraft"]]
    for r in rows["batched"]:
        prompt = tokenizer.decode(r["input_ids"][:r["prompt_len"]], skip_special=False)
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\n" + next(
            p.text for p in prompts if p.id == r["id"]) + "<|im_end|>\n<|im_start|>assistant\n")
        assert sum(r["loss_mask"]) == len(r["input_ids"]) - r["prompt_len"]


def test_pool_refill_matches_one_prompt_at_a_time(tmp_path, monkeypatch):
    """Rows refilled mid-run (fewer rows than prompts, prompts of different lengths) give each prompt the
    answer it gets alone."""
    from tiny import make_target

    from flashdraft.formats.loader import load_target
    from flashdraft.train.batchgen import batch_generate
    target, _, _ = load_target(str(make_target(tmp_path / "target", layers=2, std=0.15)))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 11, 6, 1, 9)]
    unstopped = batch_generate(target, prompts, 20, [-1], rows=5)
    eos = [unstopped[0][5], unstopped[2][12]]  # some answers end early, at different steps
    alone = [batch_generate(target, [p], 20, eos, rows=1)[0] for p in prompts]
    assert batch_generate(target, prompts, 20, eos, rows=2) == alone
    assert batch_generate(target, prompts, 20, eos, rows=5) == alone
    import flashdraft.train.batchgen as batchgen
    monkeypatch.setattr(batchgen, "PREFILL_ROWS", 2)  # the first fill prefilled in groups
    assert batch_generate(target, prompts, 20, eos, rows=5) == alone
    assert any(a[-1] in eos for a in alone) and any(len(a) == 20 for a in alone)
    sampled = batch_generate(target, prompts, 20, eos, rows=2, temperature=1.0)
    assert all(1 <= len(a) <= 20 and not set(a[:-1]) & set(eos) for a in sampled)
