"""Engine: the one interface the CLI, the server and the bench use."""
import collections
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from flashdraft.engine.config import EngineConfig, compile_enabled
from flashdraft.layers.compile import preload_compiler
from flashdraft.layers.quantized import FEW_ROWS
from flashdraft.engine import synthetic
from flashdraft.engine.adaptive import AcceptancePrior, batch_width, candidate_widths, measure_costs
from flashdraft.engine.pacing import SlicePacer
from flashdraft.engine.generate import (SlotState, SpecStats, StepPlan, advance_plain, advance_speculative, finish,
                                        first_token, new_slot_state, open_slot, plan, prefill, prefill_slice, run_slot,
                                        step_plain, step_speculative)
from flashdraft.engine.grammar import Constraint, Grammar
from flashdraft.engine.lockstep import from_rank0, in_lockstep
from flashdraft.engine.sampling import SamplingParams, fresh_seed
from flashdraft.engine.steps import SLICE_WIDTH, BatchKey, PlainKey, SpecKey, Steps
from flashdraft.quant.kv_types import FLOAT_KV_TYPES

log = logging.getLogger("flashdraft")


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    speculative: bool = True
    block_size: int | None = None
    cache_prompt: bool = True  # reuse the K/V of a slot's previous tokens that start this prompt (llama-server's)
    grammar: Grammar | None = None  # constrain the output (engine/grammar.py)
    cancel: threading.Event = field(default_factory=threading.Event)
    # the most drafted tokens a verify step checks (llama.cpp's per-request speculative.n_max): a fixed width of
    # n + 1 in place of the adaptive one (None: the engine's); a lookup drafter's gate still picks its steps
    draft_n_max: int | None = None
    slot: int | None = None  # set by the engine: the cache slot that holds the request's prompt


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class SlotPool:
    """The free cache slots and the tokens whose K/V each slot holds (llama-server's prompt cache). A request
    takes the free slot whose tokens share the longest prefix with its prompt, when that prefix is at least
    `similarity` of the prompt (--slot-prompt-similarity), else the free slot used least recently. The drafter
    observes speculative requests only, so each slot also records how many of its tokens the drafter's state
    holds; a speculative request reuses no more than that. `reusable(slot, held, n)`: how many of the first n of
    its `held` tokens a slot's caches can keep (models.interface.ModelState.reusable; default: all n)."""

    def __init__(self, n_slots: int, similarity: float, reusable=None):
        self.reusable = reusable or (lambda slot, held, n: n)
        self.cond = threading.Condition()
        self.free = list(range(n_slots))
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self.drafted = [0] * n_slots  # leading tokens of `tokens` that the drafter's state holds
        self.similarity = similarity

    def count(self) -> int:
        with self.cond:
            return len(self.free)

    def acquire(self, prompt: list[int], reuse: bool, timeout: float | None = None,
                speculative: bool = False) -> tuple[int, int]:
        """(slot, how many leading prompt tokens its cache already holds: never the whole prompt, whose last
        token must run to give the first logits; for a speculative request, also no more than the drafter's state
        holds)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.free, timeout):
                raise TimeoutError("no free slot")
            shared = {s: common_prefix(self.tokens[s], prompt) for s in self.free}
            best = max(self.free, key=lambda s: shared[s])  # the first such in least-recently-used order
            slot = best if shared[best] > 0 and shared[best] >= self.similarity * len(prompt) else self.free[0]
            self.free.remove(slot)
            cached = max(0, min(shared[slot], len(prompt) - 1)) if reuse else 0
            if speculative:
                cached = min(cached, self.drafted[slot])
            cached = self.reusable(slot, len(self.tokens[slot]), cached)
            self.tokens[slot] = prompt[:cached]  # what stays valid while the request overwrites the rest
            self.drafted[slot] = min(self.drafted[slot], shared[slot])
            return slot, cached

    def release(self, slot: int, tokens: list[int] | None = None, speculative: bool = False) -> None:
        """Return a slot whose cache now holds `tokens` (None: as at acquire); after a speculative request the
        drafter's state holds them too."""
        with self.cond:
            if tokens is not None:
                self.tokens[slot] = tokens
                if speculative:
                    self.drafted[slot] = len(tokens)
            self.free.append(slot)  # the end: most recently used
            self.cond.notify()


@dataclass
class Timings:
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    synthetic: bool = False  # drafts accepted at random (engine/synthetic.py): the text is not the model's output
    draft_n_accepted_by: dict | None = None  # per drafter (a chain's members): which proposed the accepted tokens

    def to_dict(self) -> dict:
        d = dict(cache_n=self.cache_n, prompt_n=self.prompt_n, prompt_ms=self.prompt_ms,
                 prompt_per_token_ms=self.prompt_ms / max(self.prompt_n, 1),
                 prompt_per_second=1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
                 predicted_n=self.predicted_n, predicted_ms=self.predicted_ms,
                 predicted_per_token_ms=self.predicted_ms / max(self.predicted_n, 1),
                 predicted_per_second=1e3 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0)
        if self.draft_n > 0:
            d.update(draft_n=self.draft_n, draft_n_accepted=self.draft_n_accepted)
            if self.draft_n_accepted_by:
                d.update(draft_n_accepted_by=dict(self.draft_n_accepted_by))
        if self.synthetic:
            d.update(synthetic_acceptance=True)
        return d


# One generated token's log-probability: (token id, log-probability, [(alternative id, log-probability)]).
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens not reported before (no EOS)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length", or "cancelled"
    stop_word: str | None
    timings: Timings
    spec: SpecStats
    logprobs: list[TokenLogprob] | None = None  # per generated token, EOS left out (when the request asks)

    def speculative_summary(self) -> dict:
        """Per-request acceptance statistics (acceptance length includes the bonus token)."""
        s = self.spec
        steps = len(s.acceptance_lengths)
        histogram = [0] * (s.block_size + 1)
        for a in s.acceptance_lengths:
            histogram[a] += 1
        return dict(
            block_size=s.block_size, verify_steps=steps, draft_n=s.draft_n, draft_n_accepted=s.draft_n_accepted,
            mean_acceptance_length=sum(s.acceptance_lengths) / steps if steps else 0.0,
            acceptance_rate=s.draft_n_accepted / s.draft_n if s.draft_n else 0.0,
            acceptance_histogram=histogram,
            per_position_acceptance=[c / steps for c in s.accepted_per_position] if steps else [],
            # the widths the steps took (the anchor and the drafted tokens checked), plain steps as width 1
            verify_widths={str(w): n for w, n in sorted(collections.Counter(
                [len(d) + 1 for d in s.draft_steps] + [1] * s.plain_steps).items())},
            drafted_by=dict(s.drafted_by), accepted_by=dict(s.accepted_by),
        )


class Output:
    """One request's output as its tokens come: EOS and stop strings end it, text goes out in deltas once no stop
    string can still begin in it, with the log-probabilities of the tokens not reported before; then the
    Completion with its timings."""

    def __init__(self, tokenizer, req: Request, logprobs: list | None, stats: SpecStats, synthetic_run: bool):
        from flashdraft.formats.tokenizer import IncrementalDetokenizer
        self.req, self.logprobs, self.stats, self.synthetic = req, logprobs, stats, synthetic_run
        self.eos = set() if req.params.ignore_eos else set(tokenizer.eos_ids)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStrings(req.params.stop)
        self.tokens: list[int] = []
        self.text, self.emitted, self.reported = "", 0, 0  # reported: logprobs already handed out in deltas
        self.stop_word: str | None = None
        self.finish = "length"
        self.cached = 0
        self.t0 = time.perf_counter()
        self.t_first: float | None = None

    def begin(self, cached: int) -> None:
        self.cached, self.t0 = cached, time.perf_counter()

    def push(self, new: list[int]) -> Delta | None:
        """A step's tokens: the delta to hand out, if any (`finish` becomes "stop" at EOS or a stop string)."""
        end = next((i for i, t in enumerate(new) if t in self.eos), None)
        if end is not None:  # keep the EOS token in the ids, not in the text (nor its logprob)
            new, self.finish = new[:end + 1], "stop"
            if self.logprobs is not None:
                del self.logprobs[len(self.tokens) + end:]
        self.tokens += new
        piece = self.detok.push(new if end is None else new[:end])
        self.text += piece
        hit = self.stops.push(piece)
        if hit is not None:
            self.text, self.stop_word, self.finish = self.text[:hit[0]], hit[1], "stop"
        safe = len(self.text) if self.finish == "stop" else len(self.text) - self.stops.held
        if not new and safe <= self.emitted:
            return None
        # every step's tokens go out, with the text they let out (none: an incomplete character, a special token,
        # a stop string's possible start), as llama-server's stream has an event per token (here per step: a
        # verify step's accepted tokens come together)
        delta = Delta(self.text[self.emitted:max(safe, self.emitted)], new,
                      self.logprobs[self.reported:] if self.logprobs is not None else [])
        self.emitted, self.reported = max(safe, self.emitted), len(self.logprobs or ())
        return delta

    def held(self) -> list[int]:
        """The tokens the slot's cache holds: the prompt and every output token but the last (not run yet)."""
        return self.req.prompt_ids + self.tokens[:-1]

    def end(self) -> Iterator[Delta | Completion]:
        """What is left to hand out, then the Completion."""
        t_end = time.perf_counter()
        t_first = self.t_first or t_end
        prompt = self.req.prompt_ids
        timings = Timings(prompt_n=len(prompt) - self.cached, cache_n=self.cached,
                          prompt_ms=1e3 * (t_first - self.t0), predicted_n=len(self.tokens),
                          predicted_ms=1e3 * (t_end - t_first), draft_n=self.stats.draft_n,
                          draft_n_accepted=self.stats.draft_n_accepted, synthetic=self.synthetic,
                          draft_n_accepted_by=dict(self.stats.accepted_by))
        logprobs = self.logprobs
        if logprobs is not None:
            del logprobs[len(self.tokens):]  # a cancelled step may have reported tokens it never handed out
        if self.emitted < len(self.text) or logprobs and self.reported < len(logprobs):
            yield Delta(self.text[self.emitted:], [], logprobs[self.reported:] if logprobs is not None else [])
        yield Completion(text=self.text, token_ids=self.tokens, prompt_ids=list(prompt), finish_reason=self.finish,
                         stop_word=self.stop_word, timings=timings, spec=self.stats, logprobs=logprobs)


@dataclass(eq=False)
class Task:
    """A request in the engine loop: queued, then running in a slot (`state`), its events handed to `post`."""
    req: Request
    seed: int | None
    post: Callable[[object], None]
    state: SlotState | None = None
    out: Output | None = None
    cached: int = 0
    held: list[int] = field(default_factory=list)
    error: Exception | None = None
    released: threading.Event = field(default_factory=threading.Event)  # its slot is back


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r} (choose auto, float32, bfloat16, float16)")
    return names[dtype]


def keep_quantized(config: EngineConfig) -> bool:
    """Whether GGUF matrices (the target's, and a GGUF draft's) stay in their block format (EngineConfig.weights):
    "auto" keeps them on CUDA, where the GGUF kernels are faster than the expanded weights (8B Q4_K_M on an H100,
    one lease: decode 3.47 against 6.54 ms, verify(16) 4.38 against 6.79 ms; docs/PERF.md), and expands them on the
    CPU."""
    if config.weights not in ("auto", "quantized", "dequantized"):
        raise ValueError(f"weights {config.weights!r}: choose auto, quantized or dequantized")
    cuda = config.device.startswith("cuda")
    if config.weights == "quantized" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--quantized: the GGUF kernels run on CUDA (on the CPU only under TRITON_INTERPRET=1)")
    return config.weights == "quantized" if config.weights != "auto" else cuda


def sampling_seed(p: SamplingParams) -> int | None:
    """The request's seed, a fresh one when it asks for a random seed, None when greedy."""
    if p.greedy:
        return None
    return p.seed if p.seed is not None and p.seed >= 0 else fresh_seed()


class StopStrings:
    """The stop strings of one request, matched as the text grows by an Aho-Corasick automaton: the cost per
    character of new text does not depend on how many stop strings there are or how long they are.

    push(piece) takes the text's next piece and answers what the text so far gives: the earliest stop string
    found in it (its start in the whole text and the string: the first occurrence that starts earliest, the
    shorter one of two that start at the same place) or None, and `held`, the length of the longest suffix of
    the text that is a proper prefix of a stop string (text not yet safe to emit)."""

    def __init__(self, stops: list[str]):
        stops = [s for s in stops if s]
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.word: list[str | None] = [None]  # the stop string a state spells, if it is one
        for s in stops:
            state = 0
            for ch in s:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.word.append(None)
                state = nxt
            self.word[state] = s
        # fail: the longest proper suffix that is a state; out: the longest stop string that is a suffix
        self.fail = [0] * len(self.goto)
        self.out: list[str | None] = list(self.word)
        queue = list(self.goto[0].values())
        for state in queue:  # breadth first: a state's fail is shallower, so done before it
            for ch, nxt in self.goto[state].items():
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                g = self.goto[f].get(ch, 0)
                self.fail[nxt] = g if g != nxt else 0
                if self.out[nxt] is None:
                    self.out[nxt] = self.out[self.fail[nxt]]
                queue.append(nxt)
        self.state = 0
        self.length = 0  # characters pushed so far
        self.held = 0

    def push(self, piece: str) -> tuple[int, str] | None:
        goto, fail, out = self.goto, self.fail, self.out
        state, best = self.state, None
        if len(goto) == 1:  # no stop strings
            self.length += len(piece)
            return None
        for i, ch in enumerate(piece, self.length):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            word = out[state]  # the longest stop string ending here starts earliest
            if word is not None:
                start = i + 1 - len(word)
                if best is None or start < best[0]:
                    best = (start, word)
        self.state, self.length = state, self.length + len(piece)
        self.held = self.depth[state] if best is None else 0
        return best


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (quantized weights' blocks included), each storage once (tied or
    shared tensors)."""
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]}.values())


# the most prompt tokens read in one engine step while other slots decode (llama.cpp's -ub default); engine.pacing
# sizes each slice below it to keep the streams' pause within a share of their step
INTERLEAVED_PREFILL = 512
# slices of a made-up prompt read at start-up, a fresh one and then over the cache: the kernels a slice's shape takes
# (row counts a multiple of 16 or not, up to FEW_ROWS and past it; the split kernel's query tiles) compile then, not
# while streams wait on a slice (1.4-3 s a first slice on the Gemma 4 31B shape, 2026-12-07 H100)
WARM_SLICES = (32, 16, 24, 48, FEW_ROWS + 8)
SLOW_STEP_S = 1.0  # an engine step past this many seconds logs what it ran
# A stream that has handed out fewer tokens than this keeps no pace yet: a prompt of at most INTERLEAVED_PREFILL
# tokens is read whole beside such streams only (prompts that come together, an agent's parallel calls, all start
# decoding sooner; -np 8 on the Gemma 4 31B shape: 5.3 s of a 16.7 s round went to reading eight prompts in slices
# beside the first streams, 2026-12-07 H100)
YOUNG_TOKENS = 16

# GPU memory a context must leave for the step graphs, the drafter's state and the CUDA workspaces (what the 31B shape's
# graphs and workspaces took beside its caches)
RESERVE_BYTES = 1 << 30


def largest_context(target, config: EngineConfig) -> int:
    """The largest context per slot (a multiple of 256) whose caches fit the free GPU memory, less RESERVE_BYTES:
    cache bytes are a fixed part (sliding windows' rings) plus a part per position, read off two small caches."""
    types = (config.cache_type_k, config.cache_type_v)
    small = [target.new_state(config.n_slots, n, types).bytes for n in (512, 1024)]
    per_position = (small[1] - small[0]) / 512
    free = torch.cuda.mem_get_info(torch.device(config.device))[0] - RESERVE_BYTES - (small[0] - 512 * per_position)
    return max(0, int(free / per_position) // 256 * 256) if per_position > 0 else 0


class Engine:
    """`draft`: a draft.interface.Drafter (None: plain decoding), read through that interface only."""

    def __init__(self, target, tokenizer, draft=None, config: EngineConfig | None = None):
        config = config or EngineConfig()
        self.config = config
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.device, self.ctx_size, self.n_slots = config.device, config.ctx_size, config.n_slots
        if self.device.startswith("cuda"):
            index = torch.device(self.device).index
            self._cuda_index = torch.cuda.current_device() if index is None else index
        self.block_size = config.block_size
        if config.draft_n_max is not None and draft is not None and config.draft:
            self.block_size = min(config.draft_n_max, draft.block_size - 1) + 1
            if config.draft_n_max >= draft.block_size:  # as llama.cpp's DFlash
                log.warning("requested draft size (n_max=%d) exceeds the trained block size %d -- clamping to %d",
                            config.draft_n_max, draft.block_size, draft.block_size - 1)
        self.draft_window = config.draft_window
        self.model_path, self.draft_path = config.model, config.draft
        block_size, draft_window = self.block_size, config.draft_window
        if block_size is not None and draft is not None and not 1 <= block_size <= draft.block_size:
            raise ValueError(f"--block-size must be between 1 and the draft's block size {draft.block_size}")
        if draft_window is not None and draft_window < 1:
            raise ValueError("--draft-window must be at least 1")
        self.rank, self.world_size = target.rank, target.world_size
        # Costs are timed per process, and ranks must take the same steps: no adaptive width under TP.
        self.adaptive = config.adaptive and draft is not None and self.world_size == 1
        self.width_costs: dict[int, float] | None = None
        self.batch_costs: dict[int, dict[int, float]] = {}  # batch size -> width -> cost (measure_batch_costs)
        if self.world_size > 1 and config.n_slots != 1:
            raise ValueError("tensor parallelism runs one request at a time: use one slot")
        try:
            self.state = target.new_state(config.n_slots, config.ctx_size, (config.cache_type_k, config.cache_type_v))
            if draft is not None:
                draft.setup_cache(min(draft_window or config.ctx_size, config.ctx_size), config.n_slots,
                                  cache_dtypes=(FLOAT_KV_TYPES.get(config.draft_cache_type_k),
                                                FLOAT_KV_TYPES.get(config.draft_cache_type_v)))
        except RuntimeError as e:  # torch.OutOfMemoryError, or the CPU allocator's refusal
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
            cuda = config.device.startswith("cuda")
            room = (f"the {torch.cuda.mem_get_info(torch.device(config.device))[0] / 1e9:.1f} GB of GPU memory left "
                    "after the weights" if cuda else "this machine's memory")
            fits = largest_context(target, config) if cuda else 0
            hint = f" (at most about {fits} tokens a slot fit)" if fits else ""
            raise ValueError(f"the KV caches for {config.n_slots} slot(s) of {config.ctx_size} tokens "
                             f"({config.cache_type_k}/{config.cache_type_v}) do not fit {room}: lower --ctx-size"
                             f"{hint} or --parallel, or take a smaller --cache-type-k/--cache-type-v (q8_0, q5_0, "
                             "q4_1, ...)") from None
        self.steps = Steps(target, self.state, draft, config.device, config.n_slots)
        self.synth_rates = self._synthetic_rates(config)
        self.startup_s = {}
        self.slots = SlotPool(config.n_slots, config.slot_prompt_similarity, self.state.reusable)
        self._wake = threading.Condition()  # the engine loop waits on it for requests
        self._incoming: collections.deque[Task] = collections.deque()
        self._active: list[Task] = []
        self._loop_thread: threading.Thread | None = None
        self.stopped: RuntimeError | None = None  # set when the engine thread ends (it never should)
        # prompt slices beside other slots: graph replays of SLICE_WIDTH tokens where every cache is by position and
        # steps are captured, else eager passes
        self.pacer = SlicePacer(least=SLICE_WIDTH, most=INTERLEAVED_PREFILL,
                                whole_pass=not (self.state.by_position and self.steps.static))
        self.prior = AcceptancePrior()  # where a request's acceptance estimates start
        self._decode_started: float | None = None  # the last step that read no prompt began then

    def _synthetic_rates(self, config: EngineConfig) -> list[float]:
        """The synthetic acceptance rates the command line asks for ([]: real acceptance), resolved for this
        engine's drafts; logged with llama.cpp's warning."""
        if config.synth_len is None and not config.synth_rates:
            return []
        if self.draft is None:
            raise ValueError("--spec-synth-len / --spec-synth-rates need speculative decoding: a draft (-md) or "
                             "--spec-type ngram-mod")
        rates = synthetic.resolve_rates(config.synth_len, config.synth_rates, self.draft_block - 1)
        log.warning(synthetic.WARNING)
        log.info("synthetic acceptance: n_max = %d, mean length = %.6f, rates = [%s]", len(rates),
                 synthetic.mean_length(rates), ", ".join(f"{r:.6g}" for r in rates))
        return rates

    @staticmethod
    def load(config: EngineConfig) -> "Engine":
        from flashdraft.formats.loader import load_target, make_drafter
        torch_dtype = resolve_dtype(config.dtype, config.device)
        quantized = keep_quantized(config)
        t = time.perf_counter()
        compiler = preload_compiler() if compile_enabled(config) else None
        target, tokenizer, model_path = load_target(config.model, config.device, torch_dtype, progress=config.progress,
                                                    quantized=quantized)
        log.info("model read in %.1f s", time.perf_counter() - t)
        drafter = make_drafter(config.spec_type, config.draft, target, config.device, torch_dtype, quantized,
                               config.draft_params, config.draft_embed_scale, source=model_path)
        engine = Engine(target, tokenizer, drafter, dataclasses.replace(config, model=str(model_path)))
        engine.startup_s["load"] = time.perf_counter() - t
        log.info("weights and caches ready in %.1f s", engine.startup_s["load"])
        if compile_enabled(config):
            compiler.join()
        return engine._ready()

    def with_drafter(self, drafter, **config) -> "Engine":
        """Another engine over the same target weights (caches of its own) with this drafter (None: plain), ready
        as Engine.load's: `flashdraft bench` compares drafters in one run."""
        engine = Engine(self.target, self.tokenizer, drafter, dataclasses.replace(self.config, **config))
        engine.startup_s["load"] = 0.0
        return engine._ready()

    def _ready(self) -> "Engine":
        """Compiled layers, captured step graphs and measured step costs, as the configuration asks."""
        target, drafter, config = self.target, self.draft, self.config
        if compile_enabled(config):  # shapes are static only where graphs bucket them
            from flashdraft.formats.named import cache_dir
            # compiled kernels kept beside the models (not in /tmp): a later start, after a reboot too, reuses them
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
            widths = ({1} | ({self.draft_block} if drafter is not None else set())
                      | ({SLICE_WIDTH} if self.n_slots > 1 else set()))  # a prompt's slices beside other slots
            target.compile_layers(tuple(widths | target.compiled_widths))
            if drafter is not None:
                drafter.compile_layers((self.draft_block,))
        if self.steps.static:
            log.info("capturing the decode steps' CUDA graphs%s (--no-compile: a faster first start)",
                     " over torch.compile'd layers" if compile_enabled(config) else "")
            self.warmup()
            log.info("step graphs ready in %.1f s", self.startup_s["warmup"])
        if self.adaptive:  # warmup's speculative request may have timed the widths already, never the batches
            if self.width_costs is None:
                self.measure_width_costs()
            if self.n_slots > 1 and not self.batch_costs:
                self.measure_batch_costs()
            self._release_cached()
        return self

    def resized(self, ctx_size: int) -> "Engine":
        """The same weights with caches for another context size per slot."""
        return Engine(self.target, self.tokenizer, self.draft, dataclasses.replace(self.config, ctx_size=ctx_size))

    @property
    def draft_block(self) -> int:
        return self.block_size or self.draft.block_size

    @property
    def memory(self) -> dict[str, int]:
        """Bytes of weights and caches (what start-up logs and /props reports)."""
        out = dict(weights=module_bytes(self.target), kv_cache=self.state.bytes,
                   kv_per_token=sum(c.bytes_per_token for c in self.state.layers) // max(self.n_slots, 1))
        if self.draft is not None:
            out["draft_weights"] = module_bytes(self.draft) if isinstance(self.draft, torch.nn.Module) else 0
            out["draft_cache"] = self.draft.state.bytes
        if self.device.startswith("cuda"):  # the rest the caching allocator holds: activations, CUDA graph pools
            held = torch.cuda.memory_reserved(self.device)
            out["workspace"] = max(0, held - sum(n for name, n in out.items() if name != "kv_per_token"))
        return out

    def measure_width_costs(self, slot: int | None = None) -> dict[int, float]:
        """Time one step of every candidate verify width (once per engine; the adaptive controller's costs) on
        `slot`, or on a free slot that is then left holding nothing to reuse: the timed steps overwrite its
        caches (a recurrent state whatever the positions)."""
        if slot is None:
            slot, _ = self.slots.acquire([], reuse=False)
            try:
                return self.measure_width_costs(slot)
            finally:
                self.slots.release(slot, [])
        block = self.draft_block
        pos = max(0, min(64, self.ctx_size - block - 1))

        def run_width(w: int) -> None:
            attn_len = self.steps.attended(pos + w)
            if w == 1:
                self.steps.run_key(PlainKey(slot, attn_len, True))
            else:
                self.steps.run_key(SpecKey(slot, attn_len, block, w))

        with torch.inference_mode():
            self.width_costs = measure_costs(run_width, candidate_widths(block, self.steps.static), self._sync)
        return self.width_costs

    def measure_batch_costs(self) -> dict[int, dict[int, float]]:
        """Each candidate width's step time for every batch size 2..n_slots, relative to that batch's plain step
        (engine.adaptive.batch_width), on the slots 0..B-1, which must be free and are left holding nothing."""
        block = self.draft_block
        taken = [self.slots.acquire([], reuse=False)[0] for _ in range(self.n_slots)]
        try:
            with torch.inference_mode():
                for rows in range(2, self.n_slots + 1):
                    def run_width(w: int) -> None:
                        if w == 1:
                            self.steps.run_key(BatchKey(rows, self.steps.target_length(self.steps.attended(64 + w)),
                                                        True))
                        else:  # in the groups step() runs
                            most = max(1, FEW_ROWS // w)
                            for first in range(0, rows, most):
                                slots = tuple(range(first, min(rows, first + most)))
                                self.steps.run_key(self.steps.spec_batch_key(slots, block, w) if len(slots) > 1 else
                                                   SpecKey(slots[0], self.steps.attended(64 + w), block, w))

                    widths = candidate_widths(block, self.steps.static)
                    self.batch_costs[rows] = measure_costs(run_width, widths, self._sync)
        finally:
            for slot in taken:
                self.slots.release(slot, [])
        return self.batch_costs

    def warmup(self, max_tokens: int = 8) -> float:
        """Capture the step graphs of every key the decode loop uses (on CUDA) and run a short generation per
        mode, so that no request pays for graph capture. Returns the seconds it took."""
        t = time.perf_counter()
        with torch.inference_mode():
            if self.steps.static:
                block = self.draft_block if self.draft is not None else 1
                keys = self.steps.warmup_keys(self.n_slots, block, self.adaptive)
                for i, key in enumerate(keys):
                    self.steps.run_key(key)
                    if i == 0 or (i + 1) % 8 == 0 or i + 1 == len(keys):  # the first: compiled layers loaded
                        log.info("captured %d of %d step graphs (%.1f s)", i + 1, len(keys), time.perf_counter() - t)
            defaults = SamplingParams(max_tokens=max_tokens, **(self.config.warmup_sampling or {}))
            params = [SamplingParams(max_tokens=max_tokens)] + ([defaults] if not defaults.greedy else [])
            for speculative in ([True] if self.draft is not None else [False]):  # as the server's requests
                for p in params:
                    self.generate(Request(prompt_ids=[0, 1, 2, 3], params=p, speculative=speculative))
            if self.steps.static:
                self.steps.warm_samplers(range(self.n_slots), params, sorted({1, block}))
            self._warm_prompt_slices()
        self.prior = AcceptancePrior()  # a made-up prompt's acceptance says nothing of the requests'
        self._sync()
        self._release_cached()
        self.startup_s["warmup"] = time.perf_counter() - t
        return self.startup_s["warmup"]

    def _warm_prompt_slices(self) -> None:
        """Read a made-up prompt in WARM_SLICES on a free slot (with the drafter observing, as a speculative request's
        prompt), which is then left holding nothing to reuse."""
        slot, _ = self.slots.acquire([], reuse=False)
        try:
            ids = torch.arange(sum(WARM_SLICES), device=self.device) % self.target.cfg.vocab_size
            if self.draft is not None:
                self.draft.reset(slot, keep=0)
            start = 0
            for size in WARM_SLICES:
                if start + size >= self.ctx_size:
                    break
                prefill(self.target, self.state, ids, slot, start, self.draft, start + size, size)
                start += size
        finally:
            self.slots.release(slot, [])

    @property
    def free_slot_count(self) -> int:
        return self.slots.count()

    def stream(self, req: Request) -> Iterator[Delta | Completion]:
        """Yield text deltas, then the Completion. Closing the iterator early frees the slot.
        Under tensor parallelism every rank calls this together, and all of them run rank 0's request."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        task = self.submit(req, events.put)
        over = False
        try:
            while not over:
                event = events.get()
                if isinstance(event, BaseException):
                    over = True
                    raise event
                over = isinstance(event, Completion)
                yield event
        finally:
            if not over:
                req.cancel.set()
                task.released.wait()  # the slot is back before the caller goes on

    def follow(self) -> None:
        """Tensor-parallel ranks other than 0: run the requests that rank 0 streams, until it calls
        `stop_followers` (for a server, whose requests only rank 0 sees)."""
        while (shared := self._share_request(None, None)) is not None:
            for _ in self._stream_in_slot(*shared):
                pass

    def stop_followers(self, timeout: float = 60.0) -> None:
        """Rank 0: end the other ranks' `follow`, once the request in progress (if any) is over."""
        slot, _ = self.slots.acquire([], reuse=False, timeout=timeout)
        try:
            self._share_request(None, None)
        finally:
            self.slots.release(slot)

    def _share_request(self, req: Request | None, seed: int | None) -> tuple[Request, int | None] | None:
        """Rank 0's request and seed on every rank (None: rank 0 has no more)."""
        fields = None if req is None else (req.prompt_ids, req.params, req.speculative, req.block_size,
                                           req.cache_prompt, req.grammar)
        extra = None if req is None else dict(draft_n_max=req.draft_n_max)
        shared = from_rank0(None if fields is None else (fields, extra, seed))
        if shared is None:
            return None
        if self.rank == 0:
            return req, seed
        fields, extra, seed = shared
        return Request(*fields, **extra), seed

    def _stream_in_slot(self, req: Request, seed: int | None) -> Iterator[Delta | Completion]:
        """Tensor parallelism: the request on this thread, every rank stepping in lockstep."""
        slot, cached, speculative = self._take_slot(req)
        held: list[int] = list(req.prompt_ids[:cached])  # the tokens the slot's cache holds (grows as it runs)
        try:
            yield from self._run(req, slot, seed, cached, held)
        finally:
            self.slots.release(slot, held, speculative)
            if self.free_slot_count == self.n_slots:  # idle: what the prompt's activations left cached goes back
                self._release_cached()

    def _take_slot(self, req: Request) -> tuple[int, int, bool]:
        """The slot the request runs in (req.slot), how many prompt tokens its cache holds, whether it speculates;
        a speculative request's width costs are measured first, before a slot's cache is taken for the prompt."""
        speculative = req.speculative and self.draft is not None
        if speculative and self.adaptive and self.width_costs is None:
            self.measure_width_costs()
        req.slot, cached = self.slots.acquire(req.prompt_ids, req.cache_prompt, speculative=speculative)
        return req.slot, cached, speculative

    def generate(self, req: Request) -> Completion:
        for event in self.stream(req):
            if isinstance(event, Completion):
                return event
        raise RuntimeError("generation ended without a result")

    def _slot_state(self, req: Request, slot: int, seed: int | None) -> tuple[SlotState, Output]:
        """The request's decode state in `slot` and its output's bookkeeping."""
        p = req.params
        speculative = req.speculative and self.draft is not None
        stats = SpecStats()
        controller = None
        # a lookup drafter's gate decides where it drafts (draft/interface.Drafter.host_gate), else the controller
        make_gate = getattr(self.draft, "host_gate", None) if speculative and self.adaptive else None
        gate = make_gate(list(req.prompt_ids)) if make_gate is not None else None
        if speculative and self.adaptive and gate is None and not req.block_size and req.draft_n_max is None:
            controller = self.prior.controller(self.width_costs)  # costs measured before the slot was taken
        logprobs: list[TokenLogprob] | None = [] if p.logprobs is not None else None
        constraint = None if req.grammar is None else Constraint(self.tokenizer, req.grammar,
                                                                 self.target.cfg.vocab_size)
        synthetic_run = speculative and bool(self.synth_rates)
        rule = {} if not synthetic_run else dict(accept_rule=synthetic.SyntheticAcceptance(
            synthetic.conditional(self.synth_rates), set(self.tokenizer.eos_ids),
            p.seed if p.seed is not None and p.seed >= 0 else None))
        prompt = torch.tensor(req.prompt_ids, dtype=torch.long, device=self.device)
        state = new_slot_state(self.steps, prompt, p, slot=slot, speculative=speculative,
                               block_size=req.block_size or self.block_size, stats=stats, max_len=self.ctx_size,
                               seed=seed, controller=controller, logprobs=logprobs, constraint=constraint,
                               max_width=None if req.draft_n_max is None else req.draft_n_max + 1, gate=gate,
                               **rule)
        return state, Output(self.tokenizer, req, logprobs, stats, synthetic_run)

    def _run(self, req: Request, slot: int, seed: int | None, cached: int,
             held: list[int]) -> Iterator[Delta | Completion]:
        """One request's steps on this thread (tensor parallelism). `cached`: leading prompt tokens the slot's
        cache already holds; `held` receives the tokens it holds when the run ends or is closed."""
        s, out = self._slot_state(req, slot, seed)
        steps = in_lockstep(run_slot(self.steps, s, cached), self.device)
        out.begin(cached)
        try:
            for new in steps:
                if out.t_first is None:
                    self._sync()
                    out.t_first = time.perf_counter()
                if (delta := out.push(new)) is not None:
                    yield delta
                if out.finish == "stop":
                    break
                if req.cancel.is_set():
                    out.finish = "cancelled"
                    break
        finally:
            steps.close()
            if out.t_first is not None:
                held[:] = out.held()
        self._sync()
        yield from out.end()

    # ------------------------------------------------------------------ the engine loop: one step over every slot
    def submit(self, req: Request, post: Callable[[object], None]) -> Task:
        """Check a request and queue it for the engine loop; `post` receives its events on the loop's thread (Delta,
        then a Completion; or an exception), the last one once its slot is back."""
        req.params.validate()
        if len(req.prompt_ids) >= self.ctx_size:
            raise ValueError(f"the prompt has {len(req.prompt_ids)} tokens, which does not fit the "
                             f"context of {self.ctx_size} tokens")
        task = Task(req, sampling_seed(req.params), post)
        with self._wake:
            if self.stopped is not None:
                raise self.stopped
            if self._loop_thread is None:
                self._loop_thread = threading.Thread(target=self._loop, name="engine", daemon=True)
                self._loop_thread.start()
            self._incoming.append(task)
            self._wake.notify_all()
        return task

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is queued or running; False if some still are after `timeout` seconds."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._incoming and not self._active, timeout)

    def _loop(self) -> None:
        try:
            if self.device.startswith("cuda"):  # a new thread starts on device 0; "cuda" means the loading thread's
                torch.cuda.set_device(self._cuda_index)
            with torch.inference_mode():
                while True:
                    with self._wake:
                        self._wake.wait_for(lambda: self._incoming or self._active)
                        alone = self._incoming.popleft() if self.world_size > 1 else None
                    try:
                        self._run_alone(alone) if alone is not None else self.step()
                    except Exception:  # a request's own failure goes to it (_fail); this is the engine's
                        log.exception("engine step failed")
        except BaseException as e:  # no request may wait for a thread that is gone
            log.exception("the engine thread stopped")
            self._stopped(e)

    def _stopped(self, error: BaseException) -> None:
        """The engine thread ended: every queued and running request fails with `error`, and so do later ones."""
        with self._wake:
            self.stopped = RuntimeError(f"the engine stopped: {type(error).__name__}: {error}")
            tasks = list(self._incoming) + list(self._active)
            self._incoming.clear()
            self._active.clear()
            self._wake.notify_all()
        for task in tasks:
            task.released.set()
            task.post(self.stopped)

    def _run_alone(self, task: Task) -> None:
        """Tensor parallelism: one request at a time, every rank stepping in lockstep (Engine.follow)."""
        self._active.append(task)
        try:
            req, seed = self._share_request(task.req, task.seed)
            for event in self._stream_in_slot(req, seed):
                if isinstance(event, Completion):
                    task.released.set()
                task.post(event)
        except Exception as e:
            task.released.set()
            task.post(e)
        finally:
            task.released.set()
            with self._wake:
                self._active.remove(task)
                self._wake.notify_all()

    def step(self) -> None:
        """One engine step: admit waiting requests into free slots, one decode step for every slot past its prompt
        (plain steps of several slots batched into one target call), then a slice of a prompt being read (its first
        token once it is all in)."""
        started = time.perf_counter()
        self._admit()
        for job in [j for j in self._active if j.req.cancel.is_set()]:
            job.out.finish = "cancelled"
            self._finish(job)
        plans = self._plan()
        planned = time.perf_counter()
        self._decode(plans)
        decoded = time.perf_counter()
        reading = self._reading()
        read_from = reading.state.prefilled if reading else 0
        paced = self._paced(plans, reading)
        self._prefill(reading, decoding=paced)
        self._timed(started, planned, decoded, plans, reading, read_from, paced)

    @staticmethod
    def _paced(plans: list[tuple[Task, StepPlan]], reading: "Task | None") -> bool:
        """Whether the prompt being read goes in paced slices: beside a stream that keeps a pace (YOUNG_TOKENS out),
        or beside any stream where more than INTERLEAVED_PREFILL of its tokens are left."""
        if not plans or reading is None:
            return False
        long = len(reading.state.prompt) - reading.state.prefilled > INTERLEAVED_PREFILL
        return long or any(job.state.produced >= YOUNG_TOKENS for job, _ in plans)

    def _plan(self) -> list[tuple[Task, StepPlan]]:
        """Each slot past its prompt: its step (a slot whose answer ends without one hands out its tokens here)."""
        running = [j for j in self._active if j.state.token_t is not None]
        batch = self._batch_width(running)
        plans = []
        for job in running:
            c = job.state.controller
            # a slot's own width where it has no controller, and for the probe it is due where nothing pays: due
            # after as many more plain steps as slots step together (a lone probe beside a batch costs every slot a
            # step; four slots each probing as often as one alone: 4% of command 2's aggregate, 2026-12-07 H100)
            probe = (batch == 1 and c is not None and c.current == 1
                     and c.steps_at_current >= c.probe_interval * len(running))
            want = None if batch is None or c is None or probe else batch
            try:
                p = plan(self.steps, job.state, want)
            except Exception as e:
                self._fail(job, e)
                continue
            if isinstance(p, list):
                self._hand_out(job, p)
            else:
                plans.append((job, p))
        return plans

    def _decode(self, plans: list[tuple[Task, StepPlan]]) -> None:
        """The plain steps as one call; the speculative ones grouped by (width, block), a group's slots in calls of
        at most FEW_ROWS product rows (a row keeps its solo bits); a block cut short by the context's end alone."""
        plain = [(job, p) for job, p in plans if p.width <= 1]
        if len(plain) > 1:
            self._plain_batch(plain)
        else:
            for job, p in plain:
                self._guarded(job, lambda: step_plain(self.steps, job.state, p))
        groups: dict[tuple[int, int], list[tuple[Task, StepPlan]]] = {}
        for job, p in plans:
            if p.width > 1:
                key = (p.width, job.state.block) if p.room >= job.state.block else (-1, job.req.slot)
                groups.setdefault(key, []).append((job, p))
        for (width, _), group in groups.items():
            most = max(1, FEW_ROWS // max(width, 1))
            for part in (group[i:i + most] for i in range(0, len(group), most)):
                if len(part) > 1:
                    self._speculative_batch(part)
                else:
                    job, p = part[0]
                    self._guarded(job, lambda: step_speculative(self.steps, job.state, p))

    def _timed(self, started: float, planned: float, decoded: float, plans: list[tuple[Task, StepPlan]],
               reading: "Task | None", read_from: int, paced: bool) -> None:
        """The step's times to the prompt pacer (engine.pacing), and a warning where it took long. `paced`: the
        prompt read was a paced slice (Engine._paced)."""
        ended = time.perf_counter()
        if plans and reading is None:  # decode steps alone: the pacer's measure of what a slice may delay
            if self._decode_started is not None:
                self.pacer.observe_step(started - self._decode_started)
            self._decode_started = started
        else:
            self._decode_started = None
            if plans and reading is not None and paced:  # decode steps and a slice, timed to the slice's end
                self.pacer.observe_slice(reading.state.prefilled - read_from, ended - started)
        if ended - started > SLOW_STEP_S:  # a graph captured late, a compile, a long prompt: what streams waited for
            widths = collections.Counter(p.width for _, p in plans)
            s = reading.state if reading else None
            log.warning("engine step took %.1f s: admitting and planning %.2f s; steps of widths %s %.2f s; %s %.2f s",
                        ended - started, planned - started, dict(sorted(widths.items())) or "none", decoded - planned,
                        f"prompt of slot {s.slot} from {read_from} to {s.prefilled} of {len(s.prompt)}" if s
                        else "no prompt", ended - decoded)

    def _batch_width(self, running: list[Task]) -> int | None:
        """The verify width for slots that step together (engine.adaptive.batch_width over their controllers and
        the costs measured at this batch size); None: each slot its own."""
        costs = self.batch_costs.get(len(running))
        controllers = [j.state.controller for j in running if j.state.controller is not None]
        if costs is None or len(controllers) < 2:
            return None
        return batch_width(controllers, costs)

    def _admit(self) -> None:
        while True:
            with self._wake:
                if not self._incoming or not self.slots.count():
                    return
                job = self._incoming.popleft()
            req = job.req
            if req.cancel.is_set():  # gone before it started
                job.released.set()
                job.post(Completion("", [], list(req.prompt_ids), "cancelled", None, Timings(), SpecStats()))
                continue
            try:
                slot, cached, _ = self._take_slot(req)
            except Exception as e:
                job.released.set()
                job.post(e)
                continue
            job.cached = cached
            job.held = list(req.prompt_ids[:cached])
            with self._wake:
                self._active.append(job)
            try:
                job.state, job.out = self._slot_state(req, slot, job.seed)
                if job.state.budget <= 0:
                    self._finish(job)
                    continue
                job.out.begin(cached)
                open_slot(self.steps, job.state, cached)
            except Exception as e:
                self._fail(job, e)

    def _reading(self) -> "Task | None":
        """The first request whose prompt is still being read."""
        return next((j for j in self._active if j.state is not None and j.state.token_t is None), None)

    def _prefill(self, job: "Task | None", decoding: bool) -> None:
        """The next slice of `job`'s prompt: all of it when no slot decodes, else as many tokens as the pacer
        allows, so that the running streams go on a step at a time meanwhile."""
        if job is None:
            return
        s = job.state
        try:
            if decoding:
                logits = prefill_slice(self.steps, s, self.pacer.size(), beside=True)
                self._sync()  # the step is timed whole (engine.pacing)
            else:
                logits = prefill_slice(self.steps, s, len(s.prompt))
            if logits is None:
                return
            first = first_token(self.steps, s, logits)
        except Exception as e:
            self._fail(job, e)
            return
        self._sync()
        job.out.t_first = time.perf_counter()
        self._hand_out(job, first)

    def _plain_batch(self, batch: list[tuple[Task, StepPlan]]) -> None:
        follow = any(p.follow for _, p in batch)
        attn_len = max(p.attn_len for _, p in batch)
        self._run_batch(batch, lambda states: self.steps.plain_batch(states, attn_len, follow),
                        lambda s, p, i, logits, features, positions: advance_plain(
                            self.steps, s, p, logits[i:i + 1], None if features is None else features[i:i + 1],
                            positions[i:i + 1]))

    def _speculative_batch(self, batch: list[tuple[Task, StepPlan]]) -> None:
        for job, _ in batch:
            job.state.following.flush()  # the drafter proposes from every committed position
        self._run_batch(batch, lambda states: self.steps.speculative_batch(states, [p.live for _, p in batch],
                                                                           batch[0][1].width, states[0].block),
                        lambda s, p, i, ids, logits, features, positions: advance_speculative(
                            self.steps, s, p, ids[i], logits[i], None if features is None else features[i],
                            positions[i]))

    def _run_batch(self, batch: list[tuple[Task, StepPlan]], run: Callable, advance: Callable) -> None:
        """One call for the batch's slots (`run`), then each slot's own acceptance and output (`advance` with its
        row index); a failed call fails every request in it."""
        try:
            out = run([job.state for job, _ in batch])
        except Exception as e:
            for job, _ in batch:
                self._fail(job, e)
            return
        for i, (job, p) in enumerate(batch):
            self._guarded(job, lambda: advance(job.state, p, i, *out))

    def _guarded(self, job: "Task", run: Callable[[], list[int]]) -> None:
        try:
            new = run()
        except Exception as e:
            self._fail(job, e)
            return
        self._hand_out(job, new)

    def _hand_out(self, job: "Task", new: list[int]) -> None:
        if new and (delta := job.out.push(new)) is not None:
            job.post(delta)
        if job.out.finish == "stop" or job.state.done:
            self._finish(job)

    def _fail(self, job: "Task", error: Exception) -> None:
        job.error = error
        self._finish(job)

    def _finish(self, job: "Task") -> None:
        """The request ends: its slot goes back holding its tokens, and its last events go out."""
        speculative = job.state is not None and job.state.speculative
        try:
            if job.state is not None:
                finish(job.state)
                if job.state.controller is not None:
                    self.prior.learn(job.state.controller)
            if job.out is not None and job.out.t_first is not None:
                job.held = job.out.held()
            self._sync()
        finally:
            self.slots.release(job.req.slot, job.held, speculative)
            job.released.set()
        events = [job.error] if job.error is not None else list(job.out.end())
        with self._wake:
            self._active.remove(job)
            idle = not self._active and not self._incoming
        if idle:  # what the prompt's activations left cached goes back
            self._release_cached()
        for event in events:
            job.post(event)
        with self._wake:
            self._wake.notify_all()

    def _release_cached(self) -> None:
        """Give back what the caching allocator keeps from eager runs (before each graph capture, and after the
        requests when no slot is busy; the graphs' own pool stays): the process then holds what it uses
        (nvidia-smi's figure; a prefill's activations left the Gemma 4 31B shape's 294 MiB more)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
