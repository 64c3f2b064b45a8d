"""In process: every prompt with speculation off (baseline), then through each drafter's engine (DFlash, MTP,
n-gram lookup: engines over the same target weights)."""
import sys

from flashdraft.bench.results import RequestFailed, System, Turn
from flashdraft.engine.engine import Completion, Engine, Request
from flashdraft.engine.sampling import SamplingParams


def prompt_ids(engine: Engine, messages: list[dict], reasoning: str | None) -> list[int]:
    tok = engine.tokenizer
    if tok.chat_template:
        from flashdraft.formats.chat import chat_ids
        return chat_ids(tok, messages, reasoning)
    return tok.encode("\n\n".join(m["content"] for m in messages), add_special=True)


def turn_of(c: Completion) -> Turn:
    t = c.timings
    turn = Turn(text=c.text, tokens=t.predicted_n, decode_ms=t.predicted_ms, ttft_ms=t.prompt_ms,
                prompt_tokens=t.prompt_n, finish_reason=c.finish_reason, source="engine",
                token_ids=list(c.token_ids), timings=t.to_dict())
    if c.spec.acceptance_lengths:
        s = c.speculative_summary()
        turn.draft_n, turn.draft_n_accepted = s["draft_n"], s["draft_n_accepted"]
        turn.verify_steps, turn.acceptance_histogram = s["verify_steps"], s["acceptance_histogram"]
    return turn


def engine_system(engine: Engine, name: str, speculative: bool, params: SamplingParams,
                  reasoning: str | None) -> System:
    def generate(messages: list[dict]) -> Turn:
        try:
            ids = prompt_ids(engine, messages, reasoning)
            p = SamplingParams(**{**params.__dict__, "stop": list(params.stop)})
            return turn_of(engine.generate(Request(prompt_ids=ids, params=p, speculative=speculative)))
        except ValueError as e:
            raise RequestFailed(str(e)) from e
    return System(name, generate)


def engine_systems(engines: list[tuple[str, Engine]], params: SamplingParams, reasoning: str | None) -> list[System]:
    """Plain decoding (through the first engine, speculation off), then each (drafter name, engine)."""
    first = engines[0][1]
    if not first.tokenizer.chat_template:
        print("note: the model has no chat template; prompts are sent as raw text", file=sys.stderr)
    return [engine_system(first, "baseline", False, params, reasoning),
            *(engine_system(engine, name, True, params, reasoning) for name, engine in engines)]


def warm_up(systems: list[System], text: str, n: int = 1) -> None:
    for _ in range(n):
        for s in systems:
            try:
                s.generate([{"role": "user", "content": text}])
            except RequestFailed:
                pass
