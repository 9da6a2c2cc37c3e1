"""OpenAI's tool calling on /v1/chat/completions: tools and tool_choice checked, the output constrained (required,
a named function) or parsed (auto), and shaped into `tool_calls`."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field

from pagedserve_common.sampling import SamplingParams, StructuredOutput
from scheduler_svc import json_text
from scheduler_svc.frontend.api import invalid
from scheduler_svc.frontend.tool_parsers import Call, Content, make_parser

MAX_TOOLS = 128  # as OpenAI's API
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS, _FUNCTION_KEYS = {"type", "function"}, {"name", "description", "parameters", "strict"}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
MODES = ("none", "auto", "required")


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools ask of its answer: mode none (text only), auto (the parser finds calls in the
    model's own format), required (one or more calls) or named (a call of `name`)."""

    mode: str
    tools: list[dict]  # as given: they reach the chat template
    parameters: dict[str, dict]  # name -> its arguments' JSON schema
    parallel: bool = True
    name: str = ""  # mode named: the function
    parser: str = "none"  # mode auto: --tool-call-parser

    @property
    def constrained(self) -> bool:
        """Whether the answer is constrained (required, named), not free text that may be parsed (none, auto)."""
        return self.mode in ("required", "named")

    def structured_output(self) -> StructuredOutput | None:
        """The constraint of modes required and named: a JSON schema of the calls (None for none and auto).
        NOTE: required's answer is a JSON array of {"name", "arguments"} objects, named's the arguments alone."""
        if self.mode == "named":
            schema = _closed(self.parameters[self.name])
        elif self.mode == "required":
            options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _closed(params)},
                        "required": ["name", "arguments"], "additionalProperties": False}
                       for name, params in self.parameters.items()]
            schema = {"type": "array", "minItems": 1, "items": options[0] if len(options) == 1 else
                      {"anyOf": options}, **({} if self.parallel else {"maxItems": 1})}
        else:
            return None
        return StructuredOutput("json_schema", json.dumps(schema))

    def shaper(self) -> Shaper:
        """A new shaper for one choice's answer."""
        if self.mode == "named":
            return NamedShaper(self.name)
        if self.mode == "required":
            return RequiredShaper()
        if self.mode == "auto":
            return ParsedShaper(make_parser(self.parser), self.parallel)
        return Shaper()


def _closed(params: dict) -> dict:
    """A function's parameters as the constraint of its arguments: an object schema that does not say whether
    other properties may appear gets additionalProperties false. NOTE: a call's arguments are the function's
    parameters, nothing else; left open, a small model fills the object with keys of its own until max_tokens
    (LangChain's schemas from pydantic models leave it open)."""
    if params.get("type") == "object" and "additionalProperties" not in params and "patternProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def plan(body, parser: str) -> ToolPlan | None:
    """The request's ToolPlan (None without tools). Raises EngineError(INVALID_ARGUMENT) naming tools,
    tool_choice or parallel_tool_calls."""
    if body.tools is None:
        if body.tool_choice not in (None, "none"):
            raise invalid("tool_choice", "tool_choice needs tools")
        if body.parallel_tool_calls is not None:
            raise invalid("parallel_tool_calls", "parallel_tool_calls is only allowed when tools are given")
        return None
    if not body.tools:
        raise invalid("tools", "tools is empty: give at least one tool, or leave tools out")
    if len(body.tools) > MAX_TOOLS:
        raise invalid("tools", f"tools has {len(body.tools)} tools; the limit is {MAX_TOOLS}")
    parameters = {}
    for i, tool in enumerate(body.tools):
        name, params = _tool(i, tool)
        if name in parameters:
            raise invalid("tools", f"tools[{i}].function.name: {name!r} is the name of an earlier tool too")
        parameters[name] = params
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    out = ToolPlan("auto", list(body.tools), parameters, parallel, parser=parser)
    choice = "auto" if body.tool_choice is None else body.tool_choice  # NOTE: OpenAI's default when tools are given
    if isinstance(choice, dict):
        out.mode, out.name = "named", _named(choice, parameters)
    elif choice in MODES:
        out.mode = choice
    else:
        raise invalid("tool_choice", f"tool_choice must be one of {', '.join(MODES)} or "
                                     f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r:.80}")
    if out.mode == "auto" and parser == "none":
        raise invalid("tool_choice", "tool_choice \"auto\" (the default when tools are given) needs the model's "
                                     "tool-call format: start the scheduler with --tool-call-parser (hermes or "
                                     "llama3_json), or send tool_choice \"none\", \"required\" or a named function")
    return out


def _tool(i: int, tool) -> tuple[str, dict]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid("tools", f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    _known_keys(where, tool, _TOOL_KEYS)
    fn = tool["function"]
    _known_keys(f"{where}.function", fn, _FUNCTION_KEYS)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid("tools", f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r:.80}")
    if not isinstance(fn.get("description", ""), str):
        raise invalid("tools", f"{where}.function.description must be a string")
    if not isinstance(fn.get("strict", False), bool):
        raise invalid("tools", f"{where}.function.strict must be a boolean")
    params = fn.get("parameters", NO_PARAMETERS)
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise invalid("tools", f"{where}.function.parameters must be a JSON schema of an object (the arguments)")
    return name, params


def _known_keys(where: str, obj: dict, known: set[str]) -> None:
    extra = sorted(set(obj) - known)
    if extra:
        raise invalid("tools", f"{where}: unknown field {extra[0][:80]!r} (known: {', '.join(sorted(known))})")


def _named(choice: dict, parameters: dict[str, dict]) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid("tool_choice", "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}} "
                                     "to name a function")
    if name not in parameters:
        raise invalid("tool_choice", f"tool_choice names the function {name[:80]!r}, which is not among tools "
                                     f"({', '.join(parameters)})")
    return name


def apply(tool_plan: ToolPlan, sampling: SamplingParams, template_kwargs: dict) -> tuple[SamplingParams, dict]:
    """(sampling with the plan's constraint, the chat template's arguments with the tools). Raises
    EngineError(INVALID_ARGUMENT) naming tool_choice when the request constrains its output another way too."""
    constraint = tool_plan.structured_output()
    if constraint is not None:
        if sampling.structured_output is not None:
            raise invalid("tool_choice", "tool_choice required or a named function constrains the output to tool "
                                         "calls: it cannot be combined with response_format or guided_*")
        sampling = dataclasses.replace(sampling, structured_output=constraint)
    return sampling, {**template_kwargs, "tools": tool_plan.tools}


# -- the answer, as OpenAI's deltas ----------------------------------------------------------------------------
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_delta(index: int, name: str, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


class Shaper:
    """One choice's text as OpenAI's deltas, as it streams: here, content only (no tools, or tool_choice none).
    push(text, finish reason) -> (deltas, the finish reason to report)."""

    num_calls = 0
    opening_content: str | None = ""  # the content of the stream's first delta, with the role

    def push(self, text: str, reason: str | None) -> tuple[list[dict], str | None]:
        return ([{"content": text}] if text else []), reason

    def reason(self, reason: str | None) -> str | None:
        """A model that stopped after calling a tool finished with tool_calls (a cut-off answer stays length)."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason


class ToolShaper(Shaper):
    """An answer that may hold tool calls: its stream opens with content null, as OpenAI's does for a tool call
    (text that follows still accumulates: null, then text, is the text)."""

    opening_content = None


class NamedShaper(ToolShaper):
    """A named function: the whole answer is its arguments (the constraint makes it so), streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name

    def push(self, text: str, reason: str | None) -> tuple[list[dict], str | None]:
        deltas = []
        if not self.num_calls:
            self.num_calls = 1
            deltas.append(_call_delta(0, self.name, ""))
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas, self.reason(reason)


class RequiredShaper(ToolShaper):
    """tool_choice required: the answer is a JSON array of calls, held to its end; one that does not parse (cut
    off by max_tokens) is content."""

    def __init__(self) -> None:
        self._text = ""

    def push(self, text: str, reason: str | None) -> tuple[list[dict], str | None]:
        self._text += text
        if reason is None:
            return [], None
        try:
            calls = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in json_text.loads(self._text)]
        except (ValueError, TypeError, KeyError):
            calls = []
        if not calls:
            return ([{"content": self._text}] if self._text else []), reason
        self.num_calls = len(calls)
        return [_call_delta(i, name, args) for i, (name, args) in enumerate(calls)], self.reason(reason)


class ParsedShaper(ToolShaper):
    """tool_choice auto: the parser's pieces, each call whole in one delta. Blanks next to a call are left out: a
    text's trailing blanks wait for what follows (more text: they go out with it; a call: dropped; the end: they
    go out if the answer called nothing), so that streamed and whole answers agree. With parallel_tool_calls false
    only the first call is returned."""

    def __init__(self, parser, parallel: bool) -> None:
        self.parser = parser
        self.parallel = parallel
        self._blank = ""

    def push(self, text: str, reason: str | None) -> tuple[list[dict], str | None]:
        pieces = self.parser.feed(text) if text else []
        if reason is not None:
            pieces += self.parser.finish()
        deltas = []
        for piece in pieces:
            if isinstance(piece, Content):
                text = self._blank + piece.text
                kept = text.rstrip()
                if kept:
                    deltas.append({"content": kept})
                self._blank = text[len(kept):]
            elif isinstance(piece, Call) and (self.parallel or not self.num_calls):
                deltas.append(_call_delta(self.num_calls, piece.name, piece.arguments))
                self.num_calls += 1
                self._blank = ""
        if reason is not None and self._blank and not self.num_calls:
            deltas.append({"content": self._blank})
        return deltas, self.reason(reason)


@dataclass(slots=True)
class Message:
    """A whole non-streamed assistant message, joined from one choice's deltas."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def add(self, delta: dict) -> None:
        self.content += delta.get("content", "")
        for part in delta.get("tool_calls", ()):
            if part["index"] == len(self.tool_calls):
                self.tool_calls.append({"id": part["id"], "type": "function",
                                        "function": {"name": part["function"]["name"], "arguments": ""}})
            self.tool_calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]

    def to_json(self) -> dict:
        if not self.tool_calls:
            return {"role": "assistant", "content": self.content}
        return {"role": "assistant", "content": self.content or None, "tool_calls": self.tool_calls}


def message(shaper: Shaper, text: str, reason: str | None) -> tuple[dict, str | None]:
    """(the message, its finish reason) of a whole answer: the deltas its stream would have had, joined."""
    deltas, reason = shaper.push(text, reason)
    out = Message()
    for delta in deltas:
        out.add(delta)
    return out.to_json(), reason
