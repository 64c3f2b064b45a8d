"""How much a step drafts, as llama.cpp's flags and requests say it: `--spec-draft-n-max` on the command line and
`speculative.n_max` / `speculative.n_min` / `speculative.p_min` per request (0 turns speculation off for that request), and
`speculative.type` ("none": off for that request)."""
import httpx
import pytest

from flashdraft.engine.engine import Engine, EngineConfig, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.server.app import create_app
from flashdraft.server.main import load_engine, parse_settings
from test_server import DEVICE, load, models, serving, settings  # noqa: F401  (models: a fixture shared by the run)


def test_spec_draft_n_max_sets_the_block_as_llama_cpp(models, caplog):
    """--spec-draft-n-max N: a draft model drafts N tokens a step (a verify block of N + 1), clamped with
    llama.cpp's warning to the draft's trained block; synthetic lengths resolve against it."""
    target, draft = models
    s, notes = parse_settings(["-m", str(target), "-md", str(draft), "--device", DEVICE, "-c", "512",
                               "--spec-draft-n-max", "3", "--spec-synth-len", "4", "--spec-draft-n-min", "2",
                               "--draft-p-min", "0.75"])
    assert s.draft_n_max == 3 and notes[0] == ("ignoring --spec-draft-n-min 2: the adaptive verify width "
                                               "(--spec-dm-adaptive) decides when drafting pays")
    assert len(notes) == 2 and notes[1].startswith("ignoring --draft-p-min 0.75: a step's drafted tokens")
    engine = load_engine(s)
    assert engine.draft_block == 4 and engine.synth_rates == [1.0, 1.0, 1.0]
    done = engine.generate(Request(list(range(3, 20)), SamplingParams(max_tokens=40, ignore_eos=True)))
    assert max(len(d) for d in done.spec.draft_steps) == 3
    clamped = Engine.load(EngineConfig(str(target), str(draft), device=DEVICE, ctx_size=512, draft_n_max=99))
    assert clamped.draft_block == clamped.draft.block_size
    assert "exceeds the trained block size" in caplog.text
    with pytest.raises(ValueError, match="both set the verify block"):
        parse_settings(["-m", str(target), "-md", str(draft), "--spec-draft-n-max", "3", "--block-size", "4"])


PROMPT = [5, 17, 42, 99, 7, 63, 12, 5, 17, 42]


def test_speculative_n_max_per_request(models):
    """A request's speculative.n_max caps each verify step at n_max drafted tokens (clamped to the draft's block),
    0 runs it without speculation, and the greedy text stays the plain text; mistakes are 400s naming the field."""
    engine = load(models, draft=True, n_slots=1, slot_ctx=512, dtype="float32")
    plain = engine.generate(Request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), speculative=False))
    with serving(create_app(engine, settings())) as url:
        def complete(**extra):
            body = {"prompt": PROMPT, "n_predict": 40, "ignore_eos": True, "temperature": 0, "return_tokens": True}
            return httpx.post(url + "/completion", json={**body, **extra}, timeout=60)

        for n_max, most in ((2, 2), (3, 3), (99, engine.draft_block - 1)):
            r = complete(**{"speculative.n_max": n_max, "speculative.n_min": 1, "speculative.p_min": 0.5}).json()
            spec = r["speculative"]
            assert r["tokens"] == plain.token_ids
            assert spec["verify_steps"] > 0 and spec["draft_n"] <= most * spec["verify_steps"]
            assert len(spec["per_position_acceptance"]) == most  # the widest step drafted `most` tokens
            assert max(map(int, spec["verify_widths"])) == most + 1 and "1" not in spec["verify_widths"]
        off = complete(**{"speculative.n_max": 0}).json()
        assert off["tokens"] == plain.token_ids and "draft_n" not in off["timings"]
        # speculative.type: "none" turns it off for this request, the server's own type (or an alias) keeps it on
        off = complete(**{"speculative.type": "none"}).json()
        assert off["tokens"] == plain.token_ids and "draft_n" not in off["timings"]
        for same in ("dflash", "draft-dflash"):
            on = complete(**{"speculative.type": same}).json()
            assert on["tokens"] == plain.token_ids and on["speculative"]["verify_steps"] > 0
        for bad, words in (({"speculative.n_max": -1}, "'speculative.n_max' must be >= 0"),
                           ({"speculative.n_max": "4"}, "'speculative.n_max' must be an integer"),
                           ({"speculative.n_max": 2, "speculative.n_min": 3}, "'speculative.n_min' (3) must not"),
                           ({"speculative.p_min": 1.5}, "'speculative.p_min' must be between 0.0 and 1.0"),
                           ({"speculative.p_min": "0.5"}, "'speculative.p_min' must be a number"),
                           ({"speculative.type": "ngram-mod"}, "'speculative.type' 'ngram-mod' is not available: "
                                                               "this server drafts with dflash"),
                           ({"speculative.type": 3}, "'speculative.type' must be a string")):
            r = complete(**bad)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
