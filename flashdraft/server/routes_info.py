"""Status and information routes: health, models, props, slots, metrics, tokenize, detokenize."""
import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from flashdraft.engine import synthetic
from flashdraft.server import protocol as P
from flashdraft.server.protocol import ApiError
from flashdraft.server.state import BUILD_INFO, read_json, server_state
from flashdraft.server.tools import tool_format

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # load balancers check with HEAD
@router.api_route("/v1/health", methods=["GET", "HEAD"])
async def health(request: Request) -> dict:
    state = server_state(request)
    state.require()
    return {"status": "ok"}

@router.api_route("/v1/models", methods=["GET", "HEAD"])
@router.api_route("/models", methods=["GET", "HEAD"])
async def models(request: Request) -> dict:
    state = server_state(request)
    engine, _ = state.require()
    cfg = engine.target.cfg
    n_params = sum(p.numel() for p in engine.target.parameters())
    size = sum(p.numel() * p.element_size() for p in engine.target.parameters())
    meta = {"vocab_type": 2, "n_vocab": cfg.vocab_size, "n_ctx_train": cfg.max_position_embeddings,
            "n_embd": cfg.hidden_size, "n_params": n_params, "size": size}
    return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                        "created": int(state.started), "owned_by": "llamacpp",
                                        "meta": meta}]}

@router.api_route("/props", methods=["GET", "HEAD"])
async def props(request: Request) -> dict:
    state = server_state(request)
    engine, scheduler = state.require()
    s = state.settings
    spec = engine.draft is not None and s.speculative
    return {
        "default_generation_settings": {
            "n_ctx": engine.ctx_size,
            "params": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                       "n_predict": s.n_predict, "seed": s.seed}},
        "total_slots": engine.n_slots,
        "model_path": engine.model_path,
        "model_alias": state.model_name,
        "draft_model_path": engine.draft_path,
        "speculative": {"type": engine.draft.name if spec else "none",
                        "block_size": engine.draft_block if spec else None,
                        "draft_window": engine.draft_window if spec else None,
                        # drafts accepted at random for benchmarking: answers are not the model's output
                        **({"synthetic_acceptance": {"rates": engine.synth_rates,
                                                     "mean_length": synthetic.mean_length(engine.synth_rates)}}
                           if spec and engine.synth_rates else {})},
        "reasoning": s.reasoning,
        "chat_template": engine.tokenizer.chat_template,
        "chat_template_caps": {"supports_tools": tool_format(engine.tokenizer.chat_template) is not None,
                               "tool_call_format": tool_format(engine.tokenizer.chat_template)},
        "modalities": {"vision": False, "audio": False},
        "build_info": BUILD_INFO,
        "memory_bytes": engine.memory,
    }

@router.api_route("/slots", methods=["GET", "HEAD"])
async def slots(request: Request) -> list[dict]:
    state = server_state(request)
    engine, scheduler = state.require()
    if request.query_params.get("fail_on_no_slot") in ("1", "true") and scheduler.free_slots == 0:
        raise ApiError(503, "no slot available")
    defaults = P.sampling_params({}, state.settings, (), engine.tokenizer, engine.target.cfg.vocab_size)
    out = []
    spec = engine.draft is not None and state.settings.speculative
    for i, job in enumerate(scheduler.slots):
        p = job.request.params if job else defaults
        n_decoded = job.n_decoded if job else 0
        out.append({"id": i, "id_task": job.task if job else -1, "n_ctx": engine.ctx_size,
                    "speculative": spec, "is_processing": job is not None,
                    "params": P.generation_settings(p, engine.ctx_size, spec),
                    "next_token": {"has_next_token": job is not None,
                                   "has_new_line": job.has_new_line if job else False,
                                   "n_remain": max(p.max_tokens - n_decoded, 0) if job else 0,
                                   "n_decoded": n_decoded}})
    return out

@router.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(request: Request) -> Response:
    state = server_state(request)
    if not state.settings.metrics:
        raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
    _, scheduler = state.require()
    engine = scheduler.engine
    return PlainTextResponse(scheduler.metrics.prometheus(engine.memory), media_type="text/plain; version=0.0.4")

@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state = server_state(request)
    engine, _ = state.require()
    body = await read_json(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "'content' is required and must be a string")
    add_special, with_pieces = P.get_bool(body, "add_special", False), P.get_bool(body, "with_pieces", False)

    def answer() -> Response:  # off the event loop: the content may be megabytes, the answer millions of ids
        ids = engine.tokenizer.encode(content, add_special=add_special)
        if with_pieces:
            return JSONResponse({"tokens": [{"id": t, "piece": engine.tokenizer.decode([t], skip_special=False)}
                                            for t in ids]})
        return JSONResponse({"tokens": ids})
    return await asyncio.to_thread(answer)

@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state = server_state(request)
    engine, _ = state.require()
    body = await read_json(request)
    tokens = body.get("tokens")

    def answer() -> Response:  # off the event loop: the ids may be millions
        if not P.is_token_list(tokens):
            raise ApiError(400, "'tokens' is required and must be an array of token ids")
        P.check_token_ids(tokens, engine.target.cfg.vocab_size, "'tokens'")
        return JSONResponse({"content": engine.tokenizer.decode(tokens, skip_special=False)})
    return await asyncio.to_thread(answer)
