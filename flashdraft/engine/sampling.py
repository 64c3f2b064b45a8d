"""Sampling parameters, the filtered target distribution, and sampling without host syncs: counter-based noise
keyed by (seed, token position, vocabulary id), so a token depends only on its seed, its position and its logits,
and the whole sampler as fixed-shape tensor code (`DeviceSampler`: one CUDA graph per shape, see engine/steps.py)."""
import math
import os
import secrets
from dataclasses import dataclass, field
from functools import cache, lru_cache

import numpy as np
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
    follows `history` + drafted[:i] (a verify block), so every position is penalised by its own prefix. (The decode
    loop does the same on the device: DeviceSampler, with the window's counts kept there.)"""
    logits = logits.float()
    if bias is not None:
        logits = logits + bias[:logits.shape[-1]]
    if p.penalized and (history or drafted is not None and len(drafted)):
        if drafted is None:
            drafted = torch.empty(0, dtype=torch.long, device=logits.device)
        counts = penalty_counts(history, drafted, logits.shape[0], p, logits.shape[-1])
        logits = penalize(logits, counts, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)
    return logits


def penalize(logits: Tensor, counts: Tensor, repeat: Tensor | float, frequency: Tensor | float,
             presence: Tensor | float) -> Tensor:
    """llama.cpp's penalties on float32 logits [R, V] given each token's occurrences in the window, counts [R, V]:
    a seen token's logit divided by `repeat` (multiplied where it is <= 0), minus frequency x count and presence."""
    seen = counts > 0
    repeated = torch.where(logits <= 0, logits * repeat, logits / repeat)
    return torch.where(seen, repeated, logits) - counts * frequency - seen * presence


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
    return candidates_of(logits, p.top_k, p.top_p < 1.0)


def candidates_of(logits: Tensor, top_k: int, top_p: bool) -> tuple[Tensor, Tensor | None]:
    """`candidates` for a top-k (0: off) and whether top-p is on."""
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        return logits.topk(top_k, dim=-1)
    if top_p:
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


def greedy_tokens(logits: Tensor) -> Tensor:
    """argmax_rows, -1 where the picked logit is not finite (argmax picks a NaN where a row has one, +inf where it
    has one, -inf where every token is banned)."""
    pick = argmax_rows(logits)
    return torch.where(logits.gather(-1, pick[:, None])[:, 0].isfinite(), pick, -1)


def sample(logits: Tensor, p: SamplingParams, generator: torch.Generator | None = None, seed: int | None = None,
           positions: Tensor | None = None) -> Tensor:
    """One token per row of logits [N, V]: argmax when greedy, else the Gumbel-max race over the filtered
    distribution (`race`: equivalent to multinomial, with no host synchronisation). With `seed`, row i's noise is
    keyed by (seed, positions[i], vocabulary id) (positions default to 0); without, each row gets a fresh seed drawn
    from `generator` (the device's default one when None). A row with no finite choice (NaN or +inf in it, or nothing
    above -inf) gives -1, which check_sampled turns into an error once the tokens reach the host."""
    if p.greedy:
        return greedy_tokens(logits)
    rows, device = logits.shape[0], logits.device
    if seed is None:
        seeds = torch.randint(0, 2 ** 62, (rows,), generator=generator, device=device)
    else:
        seeds = torch.full((1,), seed & (2 ** 63 - 1), dtype=torch.long, device=device)
    if positions is None:
        positions = torch.zeros(rows, dtype=torch.long, device=device)
    return draw(logits, top_k_of(p, logits.shape[-1]), p.top_p < 1.0, p.min_p > 0, _settings(p, str(device)),
                seeds, positions)


def draw(logits: Tensor, top_k: int, top_p: bool, min_p: bool, settings: Tensor, seeds: Tensor, positions: Tensor,
         position_offset: int = 0) -> Tensor:
    """A token per row of logits [N, V] (see `race`): the candidates (`candidates_of`), then the race over them."""
    values, ids = candidates_of(logits, top_k, top_p)
    return race(values, ids, settings, seeds, positions, sorted_=ids is not None, top_p=top_p, min_p=min_p,
                position_offset=position_offset, vocab=logits.shape[-1])


# settings: the float parameters of a sampled request, as one float32 tensor on the device (DeviceSampler keeps its
# own and overwrites it per request, so that its captured graphs read each request's values)
TEMPERATURE, TOP_P, LOG_MIN_P, REPEAT, FREQUENCY, PRESENCE = range(6)


def settings_of(p: SamplingParams, device: torch.device | str) -> Tensor:
    """float32 [6]: temperature, top_p, log(min_p) (-inf when off), repeat, frequency and presence penalties; each
    rounded to float32 as the float32 arithmetic of filtered_candidates and adjust_logits rounds the Python floats."""
    return torch.tensor([p.temperature if not p.greedy else 1.0, p.top_p,
                         math.log(p.min_p) if p.min_p > 0 else float("-inf"), p.repeat_penalty,
                         p.frequency_penalty, p.presence_penalty], dtype=torch.float32).to(device)


def _settings(p: SamplingParams, device: str) -> Tensor:
    """settings_of, made once per values and device: `sample` inside a graph's capture (a caller's own graph, as
    train/batchgen.py's) finds the tensor its warm-up run made, and copies nothing from the host."""
    return _settings_cached((p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.frequency_penalty,
                             p.presence_penalty), device)


@lru_cache(maxsize=64)
def _settings_cached(values: tuple, device: str) -> Tensor:
    temperature, top_k, top_p, min_p, repeat, frequency, presence = values
    return settings_of(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                      repeat_penalty=repeat, frequency_penalty=frequency,
                                      presence_penalty=presence), device)


def top_k_of(p: SamplingParams, vocab: int) -> int:
    """The top-k that narrows the candidates (0: none; a k of the whole vocabulary or more keeps all)."""
    return p.top_k if 0 < p.top_k < vocab else 0


# ---- the race: Gumbel-max over counter-based noise (kernels/sampling.py runs it on CUDA in one launch) ----

M32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32's round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # its key increments (Weyl)


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit halves of a * m for a holding 32-bit values in int64 and a 32-bit constant m, through
    16-bit halves of m so that no product leaves int64 (in place where it can: on the CPU each new large tensor
    costs its page faults)."""
    t1, t2 = a * (m >> 16), a * (m & 0xFFFF)  # each < 2^48
    hi = (t2 >> 16).add_(t1).bitwise_right_shift_(16)
    lo = t1.bitwise_and_(0xFFFF).bitwise_left_shift_(16).add_(t2).bitwise_and_(M32)
    return hi, lo


def philox(seeds: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, rounds: int = 10) -> tuple[Tensor, ...]:
    """Philox4x32-`rounds` (Random123's, as Triton's tl.philox) on int64 tensors holding 32-bit values (broadcast):
    key (seeds' low and high 32 bits, seeds in [0, 2^63)), counter (c0, c1, c2, c3); the four output words. On the
    CPU through NumPy's unsigned arithmetic (a third of the operations: no product needs splitting)."""
    if seeds.device.type == "cpu":
        return _philox_numpy(seeds, c0, c1, c2, c3, rounds)
    return _philox_torch(seeds, c0, c1, c2, c3, rounds)


def _philox_torch(seeds: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, rounds: int) -> tuple[Tensor, ...]:
    k0, k1 = seeds & M32, (seeds >> 32) & M32
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & M32, (k1 + PHILOX_W1) & M32
    return c0, c1, c2, c3


def _philox_numpy(seeds: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, rounds: int) -> tuple[Tensor, ...]:
    seeds = seeds.numpy().astype(np.uint64)
    k0, k1 = (seeds & np.uint64(M32)).astype(np.uint32), (seeds >> np.uint64(32)).astype(np.uint32)
    c0, c1, c2, c3 = (c.numpy().astype(np.uint32) for c in (c0, c1, c2, c3))
    m0, m1, w0, w1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1), np.uint32(PHILOX_W0), np.uint32(PHILOX_W1)
    with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as it should
        for _ in range(rounds):
            p0, p1 = c0.astype(np.uint64) * m0, c2.astype(np.uint64) * m1
            c0, c1 = (p1 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0, p1.astype(np.uint32)
            c2, c3 = (p0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1, p0.astype(np.uint32)
            k0, k1 = k0 + w0, k1 + w1
    shape = np.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    return tuple(torch.from_numpy(np.broadcast_to(c, shape).astype(np.int64)) for c in (c0, c1, c2, c3))


def _gumbel(r: Tensor) -> Tensor:
    u = (r >> 9).float().mul_(2.0 ** -23).add_(2.0 ** -24)  # (2 r' + 1) / 2^24 in (0, 1), exact in float32
    return u.log_().neg_().log_().neg_()


def gumbel_noise(seeds: Tensor, ids: Tensor, positions: Tensor) -> Tensor:
    """Gumbel(0, 1) noise float32 of vocabulary `ids` at token `positions` under `seeds` (int64, broadcast): word
    id % 4 of Philox4x32-10(key seed, counter (id / 4, position, 0, 0)), 23 bits as u = (2 r + 1) / 2^24 in (0, 1),
    then -log(-log u); the kernel's noise bit for bit, up to the rounding of its logarithm."""
    ids = ids.long()
    zero = torch.zeros((), dtype=torch.long, device=ids.device)
    w0, w1, w2, w3 = philox(seeds, ids >> 2, positions & M32, zero, zero)
    word = ids & 3
    return _gumbel(torch.where(word == 0, w0, torch.where(word == 1, w1, torch.where(word == 2, w2, w3))))


def gumbel_rows(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """gumbel_noise of every id 0 .. vocab - 1, [R, vocab], for seeds and positions [R, 1]: one Philox call a
    counter, its four words for four ids."""
    zero = torch.zeros((), dtype=torch.long, device=seeds.device)
    counters = torch.arange(-(-vocab // 4), device=seeds.device)
    words = torch.stack(philox(seeds, counters, positions & M32, zero, zero), -1)  # [R, vocab / 4, 4]
    return _gumbel(words.flatten(-2)[:, :vocab])


def race(values: Tensor, ids: Tensor | None, settings: Tensor, seeds: Tensor, positions: Tensor, *, sorted_: bool,
         top_p: bool, min_p: bool, position_offset: int = 0, vocab: int | None = None) -> Tensor:
    """tokens [R] int64 of candidates values [R, C] float32 (sorted descending with their ids [R, C], or a whole row
    in vocabulary order with ids None): top-p (the mass before a candidate, in the candidates' softmax, below
    top_p; the first always kept), min-p (l >= l_max + log(min_p)), then the temperature, as filtered_candidates;
    then the kept candidate with the largest l / T + g, g the Gumbel noise of (seeds[r], positions[r] +
    position_offset, its id) (`gumbel_noise`). -1 where a row holds a NaN or its largest candidate is +-inf.
    settings: `settings_of`'s tensor (or its first three); seeds: int64 [R] or [1]; positions: int64 [R]; vocab:
    the logits' width.
    On CUDA one Triton launch (kernels/sampling.race), elsewhere `race_reference`."""
    if (values.is_cuda or INTERPRETED) and _kernels() is not None:
        return _kernels().race(values, ids, settings, seeds, positions, sorted_=sorted_, top_p=top_p, min_p=min_p,
                               position_offset=position_offset)
    return race_reference(values, ids, settings, seeds, positions, sorted_=sorted_, top_p=top_p, min_p=min_p,
                          position_offset=position_offset, vocab=vocab, compact=values.device.type == "cpu")


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs the kernel on CPU tensors (tests)


@cache
def _kernels():
    try:
        from flashdraft.kernels import sampling
    except ImportError:  # no Triton: the torch operations
        return None
    return sampling


def race_reference(values: Tensor, ids: Tensor | None, settings: Tensor, seeds: Tensor, positions: Tensor, *,
                   sorted_: bool, top_p: bool, min_p: bool, position_offset: int = 0, vocab: int | None = None,
                   compact: bool = False) -> Tensor:
    """`race` in torch operations, fixed shapes. vocab: the logits' width (ids are below it; None: the candidates'
    count without ids, unknown with them). `compact` computes the noise of the kept candidates only where they are few (a data-dependent shape,
    for the CPU, where Philox in int64 operations costs ~0.1 us a token)."""
    rows, c = values.shape
    best = values[:, :1] if sorted_ else values.amax(-1, keepdim=True)  # NaN where a row holds one
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_p:  # values are sorted descending here
        probs = values.softmax(-1)
        keep = probs.cumsum(-1) - probs < settings[TOP_P]
        keep[:, 0] = True  # the first is kept whatever top_p is (a subnormal top_p is 0 in float32)
    if min_p:
        keep = keep & (values >= best + settings[LOG_MIN_P])
    scaled = values / settings[TEMPERATURE]
    seeds = seeds.expand(rows)[:, None]
    positions = positions[:, None] + position_offset
    # the noise of each candidate (a Philox call each, its word picked), or of whole rows (a call per four ids) and
    # gathered, whichever computes fewer
    live = keep & (values > float("-inf"))
    each = 2 * (int(live.sum()) if compact else live.numel())
    vocab = vocab or (c if ids is None else None)  # unknown: no whole rows
    whole = rows * (vocab // 4 + 1) if vocab else float("inf")
    if compact and each < whole:
        r, k = live.nonzero(as_tuple=True)
        score = torch.full_like(scaled, float("-inf"))
        score[r, k] = scaled[r, k] + gumbel_noise(seeds[r, 0], k if ids is None else ids[r, k], positions[r, 0])
    else:
        if ids is None or each >= whole:
            noise = gumbel_rows(seeds, positions, vocab)
            noise = noise if ids is None else noise.gather(-1, ids)
        else:
            noise = gumbel_noise(seeds, ids, positions)
        score = torch.where(keep, scaled + noise, float("-inf"))
    pick = argmax_rows(score)
    token = pick if ids is None else ids.gather(-1, pick[:, None])[:, 0]
    return torch.where(best[:, 0].isfinite() & ~values.isnan().any(-1), token, -1)


def llama_top(top_k: int, top_p: float) -> tuple[int, float]:
    """llama.cpp's top-k and top-p as SamplingParams holds them: top_k <= 0 is off (vLLM clients send -1), and
    top_p 0 keeps only the most likely token."""
    return (max(top_k, 0), top_p) if top_p > 0 else (1, 1.0)


def fresh_seed() -> int:
    """A random seed for a request that asks for none (seeds are 63-bit: Philox's key, in an int64 tensor)."""
    return secrets.randbits(63)


# ---- a slot's sampler on the device, for the decode loop ----

@dataclass(frozen=True)
class SamplerKey:
    """What changes a DeviceSampler call's shapes or its operations: one captured CUDA graph each (engine/steps.py).
    Everything else (temperature, top-p, min-p, the penalties' values, the seed, the bias row) is read from the
    device at each call."""
    slot: int
    rows: int
    greedy: bool
    top_k: int  # 0: no top-k
    top_p: bool
    min_p: bool
    biased: bool
    penalized: bool
    commit: bool  # a one-row call that also writes its token into the penalties' record (DeviceSampler)


WHOLE_HISTORY = 1 << 40  # the window of repeat_last_n = -1: no position is that far back


class DeviceSampler:
    """A slot's sampler, as fixed-shape tensor code over state on the device that each request overwrites in place
    (`begin`), so that graphs captured once serve every request: the settings (`settings_of`), the seed, the
    logit_bias row, and for the penalties the slot's tokens by position (`seq`: prompt and output) and their counts
    over the window ending at position `upto` (`counts` [V + 1], the last column a pad that counts nothing). Each row
    of a verify block sees the counts of its own prefix (the drafted tokens before it enter the window, as many of
    the oldest leave it), as adjust_logits does from a host list. Tokens enter the counts as they commit: a one-row
    call writes its token into `seq` and the next call counts it; a verify block's committed tokens come through
    `commit`. Every call can run twice (a graph's warm-up before its capture) and draw the same tokens."""

    def __init__(self, vocab: int, max_len: int, device: torch.device | str):
        self.vocab, self.max_len, self.device = vocab, max_len, device
        self.params = SamplingParams()
        self.settings = torch.ones(6, device=device)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        self.bias: Tensor | None = None  # allocated by the first request that needs it, then kept (graphs read it)
        self.seq: Tensor | None = None
        self.counts: Tensor | None = None
        self.window = torch.zeros(1, dtype=torch.long, device=device)
        self.upto = torch.zeros(1, dtype=torch.long, device=device)

    def begin(self, p: SamplingParams, seed: int, prompt: Tensor) -> None:
        """A new request with `prompt` [n] (its first token to draw is at position n)."""
        self.params = p
        self.settings.copy_(settings_of(p, "cpu"))
        self.seed.fill_(seed & (2 ** 63 - 1))
        if p.logit_bias:
            if self.bias is None:
                self.bias = torch.zeros(self.vocab, device=self.device)
            self.bias.copy_(logit_bias_row(p, self.vocab, self.device))
        if p.penalized:
            if self.seq is None:
                self.seq = torch.zeros(self.max_len + 1, dtype=torch.long, device=self.device)
                self.counts = torch.zeros(self.vocab + 1, device=self.device)
            n = len(prompt)
            window = self.window_of(p)
            self.window.fill_(window)
            self.upto.fill_(n)
            self.seq[:n].copy_(prompt)
            self.counts.zero_()
            tail = prompt[max(0, n - window):].long()
            self.counts.index_add_(0, tail, torch.ones(len(tail), device=self.device))

    @staticmethod
    def window_of(p: SamplingParams) -> int:
        """repeat_last_n, where -1 or any width past every context is WHOLE_HISTORY."""
        return WHOLE_HISTORY if p.repeat_last_n < 0 else min(p.repeat_last_n, WHOLE_HISTORY)

    def key(self, slot: int, rows: int, commit: bool) -> SamplerKey:
        p = self.params
        sampled = not p.greedy
        return SamplerKey(slot, rows, p.greedy, top_k_of(p, self.vocab) if sampled else 0, sampled and p.top_p < 1.0,
                          sampled and p.min_p > 0, bool(p.logit_bias), p.penalized, commit and p.penalized)

    def __call__(self, key: SamplerKey, logits: Tensor, positions: Tensor, drafted: Tensor | None = None) -> Tensor:
        """tokens [R] for logits [R, V] at `positions` [R] (row r's logits follow the token at positions[r]; its
        token is drawn at positions[r] + 1); drafted [R - 1]: the tokens rows 1.. follow (penalties only).
        Fixed shapes, no host synchronisation: on CUDA one captured graph per key."""
        x = self.adjust(key, logits, positions, drafted)
        if key.greedy:
            tokens = greedy_tokens(x)
        else:
            tokens = draw(x, key.top_k, key.top_p, key.min_p, self.settings, self.seed, positions, position_offset=1)
        if key.commit:  # counted by the next call (`window_counts`)
            self.seq.index_copy_(0, positions + 1, torch.where(tokens < 0, self.vocab, tokens))
        return tokens

    def adjust(self, key: SamplerKey, logits: Tensor, positions: Tensor, drafted: Tensor | None = None) -> Tensor:
        """logits [R, V] in float32 after logit_bias and the penalties (adjust_logits' arithmetic)."""
        x = logits.float()
        if key.biased:
            x = x + self.bias
        if key.penalized:
            s = self.settings
            x = penalize(x, self.window_counts(key.rows, positions, drafted), s[REPEAT], s[FREQUENCY], s[PRESENCE])
        return x

    def window_counts(self, rows: int, positions: Tensor, drafted: Tensor | None) -> Tensor:
        """[rows, V]: each row's window counts: row 0 those of the tokens before positions[0] + 1, row i also of
        drafted[:i], less the tokens that leave a window of repeat_last_n. First brings `counts` up to
        positions[0] + 1: the token a one-row call drew last is written in `seq` but not yet counted."""
        length = positions[:1] + 1  # committed tokens; row 0 follows them
        behind = (self.upto == length - 1).float()
        last = self.seq.gather(0, length - 1)
        self.counts.index_add_(0, last, behind)
        self.counts.index_add_(0, self._leaving(length - 1), -behind)
        self.upto.copy_(torch.where(behind > 0, length, self.upto))
        counts = self.counts[None]
        if rows > 1:
            j = torch.arange(rows - 1, device=positions.device)
            at = length - self.window + j  # the position leaving the window as drafted[j] enters it
            in_seq = self.seq.gather(0, at.clamp(0, self.max_len))
            in_draft = drafted.gather(0, (at - length).clamp(0, rows - 2))  # tiny windows: a drafted token leaves
            leaving = torch.where(at < 0, self.vocab, torch.where(at < length, in_seq, in_draft))
            step = torch.zeros(rows * (self.vocab + 1), device=positions.device)  # [rows, V + 1]: row i's changes
            one = torch.ones(rows - 1, device=positions.device)
            step.index_add_(0, (j + 1) * (self.vocab + 1) + drafted.long(), one)
            step.index_add_(0, (j + 1) * (self.vocab + 1) + leaving, -one)
            counts = counts + step.view(rows, -1).cumsum(0)
        return counts[:, :self.vocab]

    def _leaving(self, position: Tensor) -> Tensor:
        """The token that leaves the window as the one at `position` enters it (the pad where none does)."""
        at = position - self.window
        return torch.where(at >= 0, self.seq.gather(0, at.clamp(min=0)), self.vocab)

    def commit(self, tokens: list[int], position: int) -> None:
        """A verify step's committed tokens, at positions `position`, `position` + 1, ... (eager: their number is
        known on the host only; the verify call has brought the counts up to `position`)."""
        if not self.params.penalized:
            return
        n = self.window_of(self.params)
        new = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self.seq[position:position + len(tokens)] = new
        one = torch.ones(len(tokens), device=self.device)
        self.counts.index_add_(0, new, one)
        gone = [q - n for q in range(position, position + len(tokens)) if q >= n]
        if gone:
            self.counts.index_add_(0, self.seq[torch.tensor(gone, device=self.device)], -one[:len(gone)])
        self.upto.fill_(position + len(tokens))
