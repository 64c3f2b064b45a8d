"""Sampling parameters, the filtered target distribution, and seeded sampling without host syncs."""
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to a token's logit; -inf bans it
    # llama.cpp's penalties over the last `repeat_last_n` tokens of prompt and output (-1: all of them; 0: off)
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (None: no)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1 or self.presence_penalty != 0
                                            or self.frequency_penalty != 0)

    @property
    def adjusted(self) -> bool:
        """Whether logits change before the filters (logit_bias or penalties)."""
        return bool(self.logit_bias) or self.penalized

    def validate(self) -> None:
        """Every field within BOUNDS (see there), so the arithmetic on float32 logits stays finite."""
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be >= 0 and at most {MAX_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not MIN_REPEAT_PENALTY <= self.repeat_penalty <= MAX_REPEAT_PENALTY:
            raise ValueError(f"repeat_penalty must be > 0, between {MIN_REPEAT_PENALTY:g} and "
                             f"{MAX_REPEAT_PENALTY:g}, got {self.repeat_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g}, "
                                 f"got {getattr(self, name)}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1, got {self.repeat_last_n}")
        bad = next((b for b in self.logit_bias.values() if not (-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                                                                or b == float("-inf"))), None)
        if bad is not None:
            raise ValueError(f"logit_bias values must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g} "
                             f"(false bans a token), got {bad}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"the number of top log-probabilities must be between 0 and {MAX_LOGPROBS}, "
                             f"got {self.logprobs}")


# BOUNDS. Each field is bounded so that float32 logits stay finite under every combination the bounds allow: a
# model's logits are well below 1e4 in magnitude; a bias adds at most MAX_LOGIT_BIAS, the repeat penalty scales by
# at most MAX_REPEAT_PENALTY, the frequency penalty subtracts at most MAX_PENALTY per occurrence (a window holds at
# most the context, < 1e7 tokens), the presence penalty MAX_PENALTY once: |logit| < 2e4 * 1e4 + 1e7 * 1e4 + 1e4,
# about 1e11, and divided by a temperature >= MIN_TEMPERATURE, below 1e16, far from float32's 3.4e38. The bounds
# are generous: OpenAI allows a bias in [-100, 100], penalties in [-2, 2] and a temperature in [0, 2]; llama.cpp
# has no bounds (its extremes overflow float into NaN). A bias of 1e4 already decides softmax in float32 (exp
# underflows below -104), so nothing is lost. A temperature below MIN_TEMPERATURE samples greedily (as vLLM's
# 1e-5); dividing by it would overflow.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4
MAX_LOGIT_BIAS = 1e4
MAX_PENALTY = 1e4  # presence and frequency penalties, either sign
MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY = 1e-4, 1e4
MAX_LOGPROBS = 100


def logit_bias_row(p: SamplingParams, vocab_size: int, device: torch.device | str) -> Tensor | None:
    """logit_bias as one [V] row to add (ids outside the vocabulary are the caller's to reject)."""
    if not p.logit_bias:
        return None
    row = torch.zeros(vocab_size, device=device)
    ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
    row[ids.to(device)] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32).to(device)
    return row


def penalty_counts(history: list[int], drafted: Tensor, rows: int, p: SamplingParams, vocab_size: int) -> Tensor:
    """[rows, V] occurrences of each token in the penalty window of every row: row i's window is the last
    `repeat_last_n` tokens of `history` followed by drafted[:i] (the prefix that row's logits were computed on).
    The window is never wider than the tokens that exist (-1 or any larger width: all of them), whatever the width
    asked for."""
    device = drafted.device
    extra = drafted[:rows - 1]
    existing = len(history) + rows - 1
    width = existing if p.repeat_last_n < 0 else min(p.repeat_last_n, existing)
    if width <= 0:
        return torch.zeros(rows, vocab_size, device=device)
    tail = history[-width:]
    seq = torch.cat([torch.full((width - len(tail),), vocab_size, dtype=torch.long, device=device),
                     torch.tensor(tail, dtype=torch.long, device=device), extra.long()])
    windows = seq[len(seq) - (rows - 1) - width:].unfold(0, width, 1)  # [rows, width]; vocab_size pads
    counts = torch.zeros(rows, vocab_size + 1, device=device)
    return counts.scatter_add_(1, windows, torch.ones_like(windows, dtype=counts.dtype))[:, :vocab_size]


def adjust_logits(logits: Tensor, p: SamplingParams, bias: Tensor | None, history: list[int],
                  drafted: Tensor | None = None) -> Tensor:
    """logit_bias, then llama.cpp's repeat / frequency / presence penalties, per row of logits [R, V]: row i
    follows `history` + drafted[:i] (a verify block), so every position is penalised by its own prefix."""
    logits = logits.float()
    if bias is not None:
        logits = logits + bias[:logits.shape[-1]]
    if p.penalized and (history or drafted is not None and len(drafted)):
        if drafted is None:
            drafted = torch.empty(0, dtype=torch.long, device=logits.device)
        counts = penalty_counts(history, drafted, logits.shape[0], p, logits.shape[-1])
        seen = counts > 0
        repeated = torch.where(logits <= 0, logits * p.repeat_penalty, logits / p.repeat_penalty)
        logits = torch.where(seen, repeated, logits) - counts * p.frequency_penalty - seen * p.presence_penalty
    return logits


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token, its log-probability, the `top` most likely (token, log-probability)) per row of the model's own
    distribution (raw logits, before bias, penalties and filters, as llama-server's default and vLLM's)."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    best = logp.topk(min(top, logp.shape[-1]), dim=-1) if top else None
    chosen_l = chosen.tolist()
    if best is None:
        return [(t, c, []) for t, c in zip(tokens, chosen_l)]
    ids, values = best.indices.tolist(), best.values.tolist()
    return [(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen_l, ids, values)]


def candidates(logits: Tensor, p: SamplingParams) -> tuple[Tensor, Tensor | None]:
    """The tokens the filters may keep, as (their logits [N, C] in float32, their ids [N, C], or None when they are
    the whole vocabulary in its own order). With top-k, exactly the k largest logits, sorted descending: a tie at
    the k-th logit is cut by topk's order, as llama.cpp truncates at k. Without top-k but with top-p, the whole
    vocabulary sorted descending (top-p needs the order; no bounded shortcut is exact without a host round trip).
    Otherwise the whole vocabulary unsorted."""
    logits = logits.float()
    if 0 < p.top_k < logits.shape[-1]:
        return logits.topk(p.top_k, dim=-1)
    if p.top_p < 1.0:
        return logits.sort(dim=-1, descending=True)
    return logits, None


def filtered_candidates(logits: Tensor, p: SamplingParams) -> tuple[Tensor, Tensor | None]:
    """(probabilities [N, C], ids [N, C] or None) of `candidates` after top-p and min-p and the temperature.
    top-p keeps a candidate while the mass before it, in the candidates' renormalised softmax, is below top_p
    (the first is always kept); min-p keeps p_i >= min_p * p_max, i.e. l_i >= l_max + log(min_p): a ratio, so
    the same whichever set the probabilities are normalised over (llama.cpp renormalises after top-p).
    Fixed shapes and no host synchronisation, so it can run inside a captured CUDA graph."""
    values, ids = candidates(logits, p)
    keep = None
    if p.top_p < 1.0:  # values are sorted descending here
        probs = values.softmax(-1)
        keep = probs.cumsum(-1) - probs < p.top_p
        keep[:, 0] = True  # the first is kept whatever top_p is (a subnormal top_p is 0 in float32)
    if p.min_p > 0:
        best = values[:, :1] if ids is not None else values.max(-1, keepdim=True).values
        above = values >= best + math.log(p.min_p)
        keep = above if keep is None else keep & above
    scaled = values / p.temperature
    if keep is not None:
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return scaled.softmax(-1), ids


def filtered_probs(logits: Tensor, p: SamplingParams) -> Tensor:
    """The distribution every emitted token follows, [N, V]: top-k, top-p and min-p applied to softmax(logits),
    then the temperature applied to what survives (llama.cpp's sampler order); one-hot on argmax_rows when greedy.
    Built from the same candidates as `sample`, so the two agree on every tie."""
    if p.greedy:
        out = torch.zeros_like(logits, dtype=torch.float32)
        return out.scatter_(-1, argmax_rows(logits)[:, None], 1.0)
    probs, ids = filtered_candidates(logits, p)
    if ids is None:
        return probs
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, ids, probs)


ARGMAX_CHUNKS = 64


def argmax_rows(x: Tensor) -> Tensor:
    """torch.argmax over the last dim of [N, V] (first index on ties). On a GPU a long row is cut into chunks first:
    torch's reduction gives each row one thread block, 36 us for 15 rows of a 128k vocabulary on an H200."""
    if not x.is_cuda or x.shape[-1] % ARGMAX_CHUNKS or x.shape[-1] < 64 * ARGMAX_CHUNKS:
        return x.argmax(-1)
    return chunked_argmax(x)


def chunked_argmax(x: Tensor) -> Tensor:
    width = x.shape[-1] // ARGMAX_CHUNKS
    values, index = x.unflatten(-1, (ARGMAX_CHUNKS, width)).max(-1)  # the first maximum of each chunk
    best = values.argmax(-1, keepdim=True)  # the first chunk holding the row's maximum
    return (best * width + index.gather(-1, best)).squeeze(-1)


class NoTokenToSample(RuntimeError):
    """A row of logits with no finite choice: NaN or +inf in it (the model's arithmetic overflowed), or every token
    at -inf (logit_bias or a grammar banned them all). An error for the request, never a token."""


def check_sampled(tokens: list[int]) -> None:
    """Raise NoTokenToSample where `sample` flagged a row (a negative id)."""
    if any(t < 0 for t in tokens):
        raise NoTokenToSample("no token can be sampled: the logits hold NaN or +inf (the model's output overflowed) "
                              "or every token is banned (logit_bias, grammar)")


def sample(logits: Tensor, p: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """One token per row of logits [N, V]: argmax when greedy, else an exponential race over the filtered
    distribution (equivalent to multinomial, but with no host synchronisation). With top-k the race runs over the
    k candidates only, [N, k], and the winner's id is gathered. A row with no finite choice (NaN or +inf in it, or
    nothing above -inf) gives -1, which check_sampled turns into an error once the tokens reach the host."""
    if p.greedy:  # argmax picks a NaN where a row has one, so the picked logit alone tells a row with no choice
        pick = argmax_rows(logits)
        return torch.where(logits.gather(-1, pick[:, None])[:, 0].isfinite(), pick, -1)
    probs, ids = filtered_candidates(logits, p)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    pick = argmax_rows(probs / noise)
    pick = pick if ids is None else ids.gather(-1, pick[:, None]).squeeze(-1)
    return torch.where(probs.isnan().any(-1), -1, pick)
