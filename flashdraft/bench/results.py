"""What one benchmark request produced, and the loop that sends every prompt to every system."""
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from flashdraft.bench.prompts import Prompt


@dataclass
class Turn:
    text: str
    tokens: int  # completion tokens
    decode_ms: float  # time over which they were produced (first token to last), as `timings.predicted_ms`
    ttft_ms: float
    prompt_tokens: int = 0
    finish_reason: str = ""
    source: str = "engine"  # where tokens/decode_ms come from: engine, server (its `timings`) or client
    draft_n: int = 0
    draft_n_accepted: int = 0
    verify_steps: int = 0  # 0 when unknown
    acceptance_histogram: list[int] = field(default_factory=list)  # [k] = verify steps that committed k tokens
    token_ids: list[int] | None = None
    timings: dict | None = None  # the engine's or the server's own `timings` object
    client: dict | None = None  # client-side measurements over HTTP: tokens, decode_ms, ttft_ms

    def measured_by_client(self) -> "Turn":
        if self.source != "server" or not self.client:
            return self
        d = asdict(self)
        d.update(tokens=self.client["tokens"], decode_ms=self.client["decode_ms"], source="client")
        return Turn(**d)


@dataclass
class Result:
    system: str
    prompt_id: str
    category: str
    run: int
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.turns)

    @property
    def text(self) -> str:
        return "\n\n".join(t.text for t in self.turns)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Result":
        return Result(**{**d, "turns": [Turn(**t) for t in d["turns"]]})


class RequestFailed(Exception):
    """One request failed (for example a prompt longer than the context); the bench goes on."""


class BenchAborted(Exception):
    """A system can no longer answer (unreachable, died, server error); the bench stops here."""


Generate = Callable[[list[dict]], Turn]


@dataclass
class System:
    name: str
    generate: Generate


def run_conversation(system: System, prompt: Prompt, run: int) -> Result:
    """Every turn of the prompt; later turns continue the conversation with this system's own answers."""
    result = Result(system.name, prompt.id, prompt.category, run)
    messages: list[dict] = []
    for user in prompt.turns:
        messages.append({"role": "user", "content": user})
        try:
            turn = system.generate(list(messages))
        except RequestFailed as e:
            result.error = str(e)
            return result
        result.turns.append(turn)
        messages.append({"role": "assistant", "content": turn.text})
    return result


def run_all(systems: list[System], prompts: list[Prompt], runs: int,
            on_result: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """Each run, each prompt, each system in turn (interleaved, so drift hits every system alike).
    on_result sees each result as it comes, so a caller keeps them when BenchAborted propagates."""
    results: list[Result] = []
    for run in range(runs):
        for prompt in prompts:
            for system in systems:
                result = run_conversation(system, prompt, run)
                results.append(result)
                on_result(result)
    return results
