"""A leading `<think>...</think>` of the output (or Gemma 4's thought channel, `<|channel>thought ...
<channel|>`) goes to `reasoning_content` (llama.cpp's deepseek reasoning format), also when streamed: tags split
across deltas are held back until they are complete."""

TAGS = {"<think>": "</think>", "<|channel>thought": "<channel|>"}  # opening tag -> closing tag


def prompt_opens_thinking(prompt_tail: str) -> str | None:
    """Templates that force thinking end the prompt with an opening tag (the model writes none): its closing tag."""
    tail = prompt_tail.rstrip()
    return next((close for open_, close in TAGS.items() if tail.endswith(open_)), None)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkSplitter:
    def __init__(self, thinking_open: str | bool | None = None):
        """thinking_open: the closing tag the prompt left open (True: </think>), or None."""
        self.close = "</think>" if thinking_open is True else thinking_open or ""
        self.state = "think" if self.close else "start"
        self.buffer = ""
        self.reasoning_started = False

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be emitted now."""
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buffer.lstrip()
            opened = next((t for t in TAGS if head.startswith(t)), None)
            if opened is not None:
                self.state, self.buffer, self.close = "think", head[len(opened):], TAGS[opened]
            elif not any(t.startswith(head) for t in TAGS):
                self.state = "answer"
        if self.state == "think":
            if not self.reasoning_started:  # as llama.cpp, no leading whitespace in reasoning_content
                self.buffer = self.buffer.lstrip()
                self.reasoning_started = bool(self.buffer)
            if self.close in self.buffer:
                reasoning, rest = self.buffer.split(self.close, 1)
                self.state, self.buffer = "after", rest
            else:
                keep = _partial_suffix(self.buffer, self.close)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        if self.state == "after":  # the whitespace between </think> and the answer is neither
            self.buffer = self.buffer.lstrip()
            if self.buffer:
                self.state = "answer"
        if self.state == "answer":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return {"think": (rest, ""), "after": ("", "")}.get(self.state, ("", rest))


def split_reasoning(text: str, thinking_open: str | bool | None = None) -> tuple[str, str]:
    splitter = ThinkSplitter(thinking_open)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.flush()
    return r1 + r2, c1 + c2
