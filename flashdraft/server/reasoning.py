"""A leading `<think>...</think>` of the output goes to `reasoning_content` (llama.cpp's deepseek reasoning
format), also when streamed: tags split across deltas are held back until they are complete."""

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Templates that force thinking end the prompt with an open <think> tag (the model writes no tag)."""
    return prompt_tail.rstrip().endswith(OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkSplitter:
    def __init__(self, thinking_open: bool = False):
        self.state = "think" if thinking_open else "start"
        self.buffer = ""
        self.reasoning_started = False

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be emitted now."""
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.state, self.buffer = "think", head[len(OPEN):]
            elif not OPEN.startswith(head):
                self.state = "answer"
        if self.state == "think":
            if not self.reasoning_started:  # as llama.cpp, no leading whitespace in reasoning_content
                self.buffer = self.buffer.lstrip()
                self.reasoning_started = bool(self.buffer)
            if CLOSE in self.buffer:
                reasoning, rest = self.buffer.split(CLOSE, 1)
                self.state, self.buffer = "after", rest
            else:
                keep = _partial_suffix(self.buffer, CLOSE)
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


def split_reasoning(text: str, thinking_open: bool = False) -> tuple[str, str]:
    splitter = ThinkSplitter(thinking_open)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.flush()
    return r1 + r2, c1 + c2
