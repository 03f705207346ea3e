"""The streaming design that every format shares: a stream that takes the output one character at a
time, sends content and call pieces as soon as they are certain, and falls back to content when the
text turns out not to be tool-call output."""

from __future__ import annotations

import abc
import dataclasses
import logging

from cluster.openai.tool_parsers.base import StreamDelta, ToolCallDelta, ToolCallStream, new_call_id
from cluster.openai.tool_parsers.scanner import (
    JSON_WHITESPACE,
    CallObjectScanner,
    ScanError,
    marker_prefix_len,
)

logger = logging.getLogger(__name__)


# The states of CallSequence, each naming what the next non-whitespace character must be.
_SEQ_OPEN, _SEQ_FIRST, _SEQ_OBJECT, _SEQ_AFTER, _SEQ_NEXT, _SEQ_DONE = range(6)


@dataclasses.dataclass
class CallSequence:
    """The state of a sequence of at least one JSON call object: `[obj, obj]` with opener "[",
    separator "," and closer "]", or Llama 3's `obj; obj` with no opener or closer (it ends with
    the output). Whitespace may surround every part. `ScanningStream._step_sequence` drives it."""

    opener: str | None
    separator: str
    closer: str | None
    state: int = _SEQ_FIRST
    call: CallObjectScanner | None = None

    def __post_init__(self) -> None:
        if self.opener is not None:
            self.state = _SEQ_OPEN

    @property
    def complete(self) -> bool:
        """Whether the sequence may end here: after its closer, or after a call if it has none."""
        return self.state == (_SEQ_DONE if self.closer is not None else _SEQ_AFTER)


class ScanningStream(ToolCallStream):
    """A stream that scans the output text one character at a time.

    A format implements `_step(pos)` (take `self._text[pos]`) and `_end()` (the output ended) with
    the helpers below, and may override `_advance` to take a run of content at once. Either raises
    `ScanError` when the text is not, or stops being, tool-call output; the stream then falls back:
    the text it still held back, and all text after it, goes out as content. Held back is whatever
    lies after `self._sent`: every character before that was sent as content or as part of a call,
    or dropped on purpose. So output that falls back before any call started is streamed whole as
    content, as the whole extraction returns it.

    Content that is whitespace only is held back until some other character follows, since the
    whole extraction reports such content as None.
    """

    def __init__(self) -> None:
        self._text = ""
        self._sent = 0
        self._content_started = False
        self._calls = 0
        self._delta = StreamDelta()
        # The call whose JSON object is being scanned: its index once named, and how far into the
        # text its arguments have been sent.
        self._call_index: int | None = None
        self._args_sent = 0
        self.fell_back = False

    @abc.abstractmethod
    def _step(self, pos: int) -> None:
        """Take the character at `self._text[pos]`."""

    @abc.abstractmethod
    def _end(self) -> None:
        """The output ended: send or drop what is held back, or raise `ScanError` if incomplete."""

    def feed(self, delta_text: str) -> StreamDelta:
        """The next piece of the output text; returns what can be sent now."""
        start = len(self._text)
        self._text += delta_text
        if not self.fell_back:
            try:
                pos = start
                while pos < len(self._text):
                    pos = self._advance(pos)
            except ScanError as exc:
                self._fall_back(exc)
        return self._take()

    def finish(self) -> StreamDelta:
        """The end of the output: returns what was held back and can now be sent."""
        if not self.fell_back:
            try:
                self._end()
            except ScanError as exc:
                self._fall_back(exc)
        return self._take()

    def _fall_back(self, exc: ScanError) -> None:
        logger.debug("no more tool calls in this output: %s", exc)
        self.fell_back = True

    def _take(self) -> StreamDelta:
        if self.fell_back:
            self._send_content(len(self._text))
        delta, self._delta = self._delta, StreamDelta()
        return delta

    def _send_content(self, end: int) -> None:
        """Send `self._text[self._sent:end]` as content (unless it is whitespace only so far)."""
        piece = self._text[self._sent : end]
        if not piece or (not self._content_started and piece.isspace()):
            return
        self._content_started = True
        self._delta.content += piece
        self._sent = end

    def _advance(self, pos: int) -> int:
        """Take the text from `pos` on: the character there, or a longer run at once (content
        states); returns where to go on."""
        self._step(pos)
        return pos + 1

    def _scan_content(self, pos: int, marker: str) -> tuple[int, bool]:
        """Take the text from `pos` on as content, which ends where `marker` first appears: sends
        all of it but a possible beginning of the marker. Returns where to go on, and whether the
        marker was found (its text stays held back until a call starts, so that falling back
        before that sends it as content)."""
        # A marker ending before `pos` would have been found by an earlier call.
        found = self._text.find(marker, max(0, pos - len(marker) + 1))
        if found != -1:
            self._send_content(found)
            return found + len(marker), True
        end = len(self._text)
        self._send_content(end - marker_prefix_len(self._text, 0, end, marker))
        return end, False

    def _drop(self, end: int) -> None:
        """Mark the text before `end` as dealt with: it is no longer held back."""
        self._sent = max(self._sent, end)

    def _start_call(self, name: str, end: int) -> int:
        """Send a new call's first delta (its id and name), the text before `end` having made it;
        returns its index."""
        index = self._calls
        self._calls += 1
        self._delta.tool_calls.append(ToolCallDelta(index=index, id=new_call_id(), name=name))
        self._drop(end)
        return index

    def _send_arguments(self, index: int, fragment: str) -> None:
        """Send the next fragment of call `index`'s arguments, merged into this step's last delta
        when that one is the same call's."""
        if not fragment:
            return
        pieces = self._delta.tool_calls
        if pieces and pieces[-1].index == index:
            pieces[-1].arguments += fragment
        else:
            pieces.append(ToolCallDelta(index=index, arguments=fragment))

    def _begin_call_object(self, pos: int) -> CallObjectScanner:
        """A scanner for the call object whose "{" is at `pos` (not yet taken)."""
        self._call_index = None
        self._args_sent = 0
        return CallObjectScanner(pos)

    def _send_arguments_text(self, start: int, end: int) -> None:
        """Send the current call's arguments text up to `end`, the arguments starting at `start`."""
        assert self._call_index is not None
        start = max(start, self._args_sent)
        if end > start:
            self._send_arguments(self._call_index, self._text[start:end])
            self._args_sent = end

    def _step_call_object(self, call: CallObjectScanner, pos: int) -> bool:
        """Take `self._text[pos]` into a call object, sending its name once known and its arguments
        text as it arrives (held until the name is known, should the arguments come first);
        True once the object is complete."""
        call.step(self._text, pos)
        if self._call_index is None and call.name is not None:
            self._call_index = self._start_call(call.name, pos + 1)
        if self._call_index is not None:
            span = call.args_span(pos + 1)
            if span is not None:
                self._send_arguments_text(*span)
            self._drop(pos + 1)
        if not call.done:
            return False
        assert self._call_index is not None, "a complete call object has a name"
        if call.args_start is None:
            self._send_arguments(self._call_index, "{}")
        return True

    def _step_sequence(self, seq: CallSequence, pos: int) -> None:
        """Take `self._text[pos]` into a sequence of call objects."""
        ch = self._text[pos]
        if seq.state == _SEQ_OBJECT:
            assert seq.call is not None
            if self._step_call_object(seq.call, pos):
                seq.state = _SEQ_AFTER
        elif ch in JSON_WHITESPACE:
            pass
        elif seq.state == _SEQ_OPEN and ch == seq.opener:
            seq.state = _SEQ_FIRST
        elif seq.state in (_SEQ_FIRST, _SEQ_NEXT) and ch == "{":
            seq.call = self._begin_call_object(pos)
            self._step_call_object(seq.call, pos)
            seq.state = _SEQ_OBJECT
        elif seq.state == _SEQ_AFTER and ch == seq.separator:
            seq.state = _SEQ_NEXT
        elif seq.state == _SEQ_AFTER and ch == seq.closer:
            seq.state = _SEQ_DONE
            self._drop(pos + 1)
        else:
            raise ScanError(f"unexpected {ch!r} in a list of calls")
