"""One chat choice's stream under a tool plan (server/tools.py): which deltas its text becomes as it is generated.

The last delta is built from the same `tool_message` as the answer without streaming, so a client that accumulates
the deltas (the official `openai` client's stream helpers do) gets the same message:

- "none": the text, as content deltas.
- named: the call's arguments as they are generated; the first piece carries the call's id, type and name.
- "required": nothing until the output ends (the array is parsed whole), then every call, each in one piece.
- "auto": content up to where a call may begin (the parser's `certain_content`) as it comes; the rest when the output
  ends, then every call the parser found, each in one piece. Leading whitespace is held back (a text of calls only
  has no content).
"""

from __future__ import annotations

from looped_spec.server.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, ToolCall
from looped_spec.server.tools import ToolPlan, new_tool_call_id, tool_message


class ToolCallStream:
    """The deltas of one choice: feed each engine output's new text in turn."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.content_sent = 0  # characters of the text already sent as content ("auto")
        self.call_id: str | None = None  # the named call's id, once its first piece is sent
        self.started = False  # its role chunk is sent

    def delta(self, new_text: str, finished: bool, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """The delta for this output (None: nothing to send yet) and, when `finished`, the choice's finish reason."""
        self.text += new_text
        mode = self.plan.mode
        if mode == "none":
            return (DeltaMessage(content=new_text) if new_text else None), finish_reason if finished else None
        if mode == "named":
            return self._named(new_text, finished, finish_reason)
        if not finished:
            return (self._certain_content() if mode == "auto" else None), None
        message = tool_message(self.plan, self.text, finish_reason)
        rest = (message.content or "")[self.content_sent :]
        calls = [whole_call(k, call) for k, call in enumerate(message.tool_calls or [])]
        delta = DeltaMessage(content=rest or None, tool_calls=calls or None) if rest or calls else None
        return delta, message.finish_reason

    def _named(
        self, new_text: str, finished: bool, finish_reason: str | None
    ) -> tuple[DeltaMessage | None, str | None]:
        reason = tool_message(self.plan, self.text, finish_reason).finish_reason if finished else None
        if not new_text and (self.call_id is not None or not finished):
            return None, reason
        piece = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new_text))
        if self.call_id is None:  # the first piece names the call (with no text at all: arguments "")
            self.call_id = new_tool_call_id()
            function = DeltaFunctionCall(name=self.plan.function_name, arguments=new_text)
            piece = DeltaToolCall(index=0, id=self.call_id, type="function", function=function)
        return DeltaMessage(tool_calls=[piece]), reason

    def _certain_content(self) -> DeltaMessage | None:
        certain = self.plan.parser.certain_content(self.text)
        if not certain.strip() or len(certain) <= self.content_sent:
            return None
        piece = certain[self.content_sent :]
        self.content_sent = len(certain)
        return DeltaMessage(content=piece)


def whole_call(index: int, call: ToolCall) -> DeltaToolCall:
    """A finished call as one delta piece."""
    function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
    return DeltaToolCall(index=index, id=call.id, type="function", function=function)
