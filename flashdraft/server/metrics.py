"""Server-wide counters and their Prometheus text (llama.cpp's `llamacpp:*` names)."""
from dataclasses import dataclass, field

from flashdraft.engine.engine import Completion


@dataclass
class Metrics:
    prompt_tokens_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_tokens_max: int = 0
    requests_processing: int = 0
    requests_deferred: int = 0
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_draft_tokens_by: dict[str, int] = field(default_factory=dict)  # per drafter (a chain's members)
    spec_accepted_tokens_by: dict[str, int] = field(default_factory=dict)

    def record(self, c: Completion) -> None:
        t, s = c.timings, c.spec
        self.prompt_tokens_total += t.prompt_n
        self.prompt_seconds_total += t.prompt_ms / 1e3
        self.tokens_predicted_total += t.predicted_n
        self.tokens_predicted_seconds_total += t.predicted_ms / 1e3
        self.n_tokens_max = max(self.n_tokens_max, t.cache_n + t.prompt_n + t.predicted_n)
        # target forward passes: the prefill, one per verify step, one per plainly decoded token
        verified = sum(s.acceptance_lengths)
        plain = max(t.predicted_n - 1 - verified, 0)
        self.n_decode_total += (1 if t.prompt_n else 0) + len(s.acceptance_lengths) + plain
        self.spec_drafts_total += len(s.draft_steps)
        self.spec_draft_tokens_total += s.draft_n
        self.spec_accepted_tokens_total += s.draft_n_accepted
        for total, part in ((self.spec_draft_tokens_by, s.drafted_by), (self.spec_accepted_tokens_by, s.accepted_by)):
            for name, n in part.items():
                total[name] = total.get(name, 0) + n
        per_pos = s.accepted_per_position
        if len(self.spec_accepted_per_position) < len(per_pos):
            self.spec_accepted_per_position += [0] * (len(per_pos) - len(self.spec_accepted_per_position))
        for i, n in enumerate(per_pos):
            self.spec_accepted_per_position[i] += n

    def prometheus(self, memory: dict[str, int] | None = None) -> str:
        """memory: the engine's byte counts (weights, kv_cache, kv_per_token, ...), reported as flashdraft: gauges."""
        prompt_rate = self.prompt_tokens_total / self.prompt_seconds_total if self.prompt_seconds_total else 0.0
        gen_rate = (self.tokens_predicted_total / self.tokens_predicted_seconds_total
                    if self.tokens_predicted_seconds_total else 0.0)
        rows = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", self.prompt_tokens_total),
            ("prompt_seconds_total", "counter", "Prompt process time", self.prompt_seconds_total),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.",
             self.tokens_predicted_total),
            ("tokens_predicted_seconds_total", "counter", "Predict process time",
             self.tokens_predicted_seconds_total),
            ("n_decode_total", "counter", "Total number of target forward passes.", self.n_decode_total),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", prompt_rate),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.", gen_rate),
            ("requests_processing", "gauge", "Number of requests processing.", self.requests_processing),
            ("requests_deferred", "gauge", "Number of requests deferred.", self.requests_deferred),
            ("n_tokens_max", "counter", "Largest observed n_tokens.", self.n_tokens_max),
            ("spec_decode_num_drafts_total", "counter", "Number of speculative drafts (verify steps).",
             self.spec_drafts_total),
            ("spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens proposed.",
             self.spec_draft_tokens_total),
            ("spec_decode_num_accepted_tokens_total", "counter", "Number of draft tokens accepted.",
             self.spec_accepted_tokens_total),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {value}"]
        name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f"# HELP {name} Number of accepted draft tokens at each draft position.", f"# TYPE {name} counter"]
        lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(self.spec_accepted_per_position)]
        for name, help_text, values in (
                ("flashdraft:spec_decode_num_draft_tokens_by_drafter_total", "Draft tokens proposed, by drafter.",
                 self.spec_draft_tokens_by),
                ("flashdraft:spec_decode_num_accepted_tokens_by_drafter_total", "Draft tokens accepted, by drafter.",
                 self.spec_accepted_tokens_by)):
            if values:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                lines += [f'{name}{{drafter="{d}"}} {n}' for d, n in sorted(values.items())]
        for key, value in (memory or {}).items():
            lines += [f"# HELP flashdraft:{key}_bytes GPU/CPU memory: {key.replace('_', ' ')} (bytes).",
                      f"# TYPE flashdraft:{key}_bytes gauge", f"flashdraft:{key}_bytes {value}"]
        return "\n".join(lines) + "\n"
