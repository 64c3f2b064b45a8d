"""Training prompts from JSON / JSONL files: Alpaca, ShareGPT, GSM8K, MBPP and plain `prompt` records.

Evaluation sets (HumanEval, MT-Bench, Spec-Bench, GSM8K test) are refused: a draft trained on them would
report acceptance on data it has seen. MBPP is split by task id; only the training range is read.
"""
from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flashdraft.train.code_prompts import code_instructions

MBPP_TRAIN_IDS = (601, 974)  # inclusive; 1-600 hold MBPP's test, validation and few-shot splits
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_STYLE = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                   "```python\n{code}\n```")
BUILTIN_CODE = "code"  # a --data entry naming the built-in code instructions
EVAL_FILE_MARKERS = ("humaneval", "mt_bench", "mt-bench", "spec_bench", "spec-bench", "gsm8k_test", "gsm8k-test")


@dataclass
class TrainPrompt:
    id: str  # stable across runs: file name and record index (plus a variant suffix)
    source: str
    text: str


def read_json_records(path: Path) -> list[dict]:
    """Records of a .json array (read item by item, so a truncated file still yields its complete items)
    or of a .jsonl file; either may be gzipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return list(iter_json_array(stripped))
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e})") from None
    return rows


def iter_json_array(text: str) -> Iterator[dict]:
    decoder = json.JSONDecoder()
    i = 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the file is cut off inside this item
        yield item


def parse_id_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"task id range must look like 601-974, got {text!r}") from None


def check_not_eval(path: Path, rows: list[dict]) -> None:
    name = path.name.lower()
    if any(m in name for m in EVAL_FILE_MARKERS):
        raise ValueError(f"{path}: looks like an evaluation set; never train a draft on it")
    first = rows[0] if rows else {}
    if "canonical_solution" in first or "entry_point" in first:
        raise ValueError(f"{path}: HumanEval records are evaluation data; never train a draft on them")
    if "turns" in first and ("question_id" in first or "category" in first):
        raise ValueError(f"{path}: MT-Bench / Spec-Bench records are evaluation data; never train a draft on them")


def mbpp_native(row: dict) -> str:
    tests = "\n".join(row.get("test_list") or [])
    return f"{row['text']}\nYour code should pass these tests:\n\n{tests}"


def mbpp_signature_style(row: dict) -> str | None:
    """The MBPP task as a function stub with a docstring, in the code-completion style of HumanEval-like
    prompts (built from the MBPP row only)."""
    code = str(row.get("code", "")).replace("\r\n", "\n")
    defs = [line for line in code.splitlines() if line.startswith("def ")]
    if not defs:
        return None
    examples = "\n".join(f"    >>> {t.removeprefix('assert ').strip()}" for t in (row.get("test_list") or [])[:2])
    stub = f'{defs[-1].rstrip()}\n    """ {row["text"].strip()}\n{examples}\n    """\n'
    return HUMANEVAL_STYLE.format(code=stub)


def prompts_from_record(row: dict, key: str, index: int, mbpp_ids: tuple[int, int]) -> list[TrainPrompt]:
    """The training prompts of one record (none when it is in no known format or out of range)."""
    if isinstance(row.get("conversations"), list):  # ShareGPT: the first human turn
        for turn in row["conversations"]:
            if isinstance(turn, dict) and turn.get("from", turn.get("role")) in ("human", "user"):
                text = str(turn.get("value", turn.get("content", ""))).strip()
                return [TrainPrompt(f"{key}:{index}", "sharegpt", text)] if text else []
        return []
    if "instruction" in row:  # Alpaca
        extra = str(row.get("input") or "").strip()
        text = str(row["instruction"]).strip() + (f"\n\n{extra}" if extra else "")
        return [TrainPrompt(f"{key}:{index}", "alpaca", text)]
    if "question" in row:  # GSM8K train; half with the step-by-step suffix chat front ends add
        text = str(row["question"]).strip() + (GSM8K_SUFFIX if index % 2 else "")
        return [TrainPrompt(f"{key}:{index}", "gsm8k", text)]
    if "text" in row and "task_id" in row:  # MBPP
        if not mbpp_ids[0] <= int(row["task_id"]) <= mbpp_ids[1]:
            return []
        out = [TrainPrompt(f"{key}:{index}", "mbpp", mbpp_native(row))]
        stub = mbpp_signature_style(row)
        if stub:
            out.append(TrainPrompt(f"{key}:{index}:stub", "mbpp", stub))
        return out
    if isinstance(row.get("prompt"), str):
        pid = str(row["id"]) if row.get("id") is not None else f"{key}:{index}"
        return [TrainPrompt(pid, str(row.get("source", "prompt")), row["prompt"].strip())]
    return []


def load_prompts(paths: list[str], mbpp_ids: tuple[int, int] = MBPP_TRAIN_IDS) -> list[TrainPrompt]:
    """All training prompts of the files, in file order, without duplicate texts."""
    if mbpp_ids[0] < MBPP_TRAIN_IDS[0]:
        raise ValueError(f"MBPP task ids below {MBPP_TRAIN_IDS[0]} are evaluation data; never train on them")
    prompts: list[TrainPrompt] = []
    for entry in paths:
        if entry == BUILTIN_CODE:
            prompts += [TrainPrompt(f"code:{i}", "code", t) for i, t in enumerate(code_instructions())]
            continue
        path = Path(entry)
        if not path.is_file():
            raise FileNotFoundError(f"training data file not found: {entry}")
        rows = read_json_records(path)
        check_not_eval(path, rows)
        found = [p for i, row in enumerate(rows) if isinstance(row, dict)
                 for p in prompts_from_record(row, path.name, i, mbpp_ids)]
        if not found and rows:
            raise ValueError(f"{path}: no prompts found (expected Alpaca, ShareGPT, GSM8K, MBPP or `prompt` records)")
        prompts += found
    seen: set[str] = set()
    unique = []
    for p in prompts:
        if p.text and p.text not in seen:
            seen.add(p.text)
            unique.append(p)
    return unique


def shuffled(prompts: list[TrainPrompt], seed: int, limit: int | None = None) -> list[TrainPrompt]:
    """A seeded shuffle, so a time-limited run processes a mix of every source."""
    out = list(prompts)
    random.Random(seed).shuffle(out)
    return out if limit is None else out[:limit]
