"""Prompts to token ids: raw text, or messages through the model's chat template."""


def template_kwargs(reasoning: str | None, extra: dict | None = None) -> dict:
    kwargs = dict(extra or {})
    if reasoning in ("on", "off") and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = reasoning == "on"
    return kwargs


def chat_ids(tokenizer, messages: list[dict], reasoning: str | None = None, extra: dict | None = None,
             limit: int | None = None) -> list[int]:
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; use a raw prompt instead")
    kwargs = template_kwargs(reasoning, extra)
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and isinstance(last.get("content"), str) and last["content"]:
        # llama-server's prefill: a final assistant message is continued, not closed by the template
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
        cut = text.rfind(last["content"])
        if cut < 0:
            raise ValueError("the chat template changed the final assistant message, so it cannot be continued")
        text = text[:cut + len(last["content"])]
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    # the template writes BOS itself where the model wants one
    return tokenizer.encode(text, add_special=False, limit=limit)


def render_prompt(tokenizer, prompt: str, chat: bool = False, system: str | None = None,
                  reasoning: str | None = None) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt, add_special=True)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return chat_ids(tokenizer, messages, reasoning)
