"""``with_structured_output`` for :class:`~ctx_integrations.langchain.ChatContextOfExperts`, as ``ChatOpenAI`` has it.

Every method is held by constrained decoding, so the parsed value is valid against the schema (unless the
answer is cut by ``max_tokens``): ``json_schema`` (the default) binds ``response_format`` with the schema,
``function_calling`` binds the schema as the one tool the model must call, ``json_mode`` binds JSON mode
(any JSON object; held to the schema as well when one is given, where OpenAI's JSON mode leaves that to the
prompt). An answer cut before its value was complete (``max_tokens``, a stop string) raises
:class:`~ctx_integrations.errors.IncompleteStructuredOutputError` instead of parsing to ``None`` (no complete
call) or to the part that was written (LangChain's JSON parser reads partial JSON). ``include_raw=True``
returns ``{"raw", "parsed", "parsing_error"}`` as LangChain's chat models do (the error as ``parsing_error``).
Written after langchain-openai's ``BaseChatOpenAI.with_structured_output``, with LangChain's own parsers.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

from ctx_integrations.errors import IncompleteStructuredOutputError, InvalidOptionError

METHODS = ("json_schema", "function_calling", "json_mode")


def _is_pydantic(schema: Any) -> bool:
    return isinstance(schema, type) and issubclass(schema, BaseModel)


def complete(message: AIMessage) -> AIMessage:
    """``message`` if its answer ran to the end of its format (``finish_reason == "eos"``), else the error."""
    reason = message.response_metadata.get("finish_reason")
    if reason != "eos":
        raise IncompleteStructuredOutputError(
            f"the structured answer was cut before it was complete (finish_reason {reason!r}): raise max_tokens, "
            f"drop stop strings, or bound the schema's strings and arrays (maxLength, maxItems); it reads "
            f"{message.text[:200]!r}", message.text)
    return message


def structured_runnable(model: Any, schema: Any, *, method: str = "json_schema", include_raw: bool = False,
                        bind_tools: Callable[..., Runnable], **kwargs: Any) -> Runnable:
    """``model`` bound to produce ``schema`` (a pydantic class, a TypedDict, a JSON schema or an OpenAI function
    dict) with ``method``, then parsed; ``bind_tools`` is the model's own."""
    if method not in METHODS:
        raise InvalidOptionError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if schema is None and method != "json_mode":
        raise InvalidOptionError(f"with_structured_output(method={method!r}) needs a schema")
    pydantic = _is_pydantic(schema)
    traced = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}} if schema else {}
    if method == "function_calling":
        name = convert_to_openai_tool(schema)["function"]["name"]
        llm = bind_tools([schema], tool_choice=name, parallel_tool_calls=False, **traced, **kwargs)
        parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                            else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
    else:
        response_format: dict[str, Any] = {"type": "json_object"}
        if schema is not None:  # json_mode too: OpenAI's only promises JSON, this one can keep to the schema as well
            function = convert_to_openai_tool(schema)["function"]
            response_format = {"type": "json_schema", "json_schema": {"name": function["name"],
                                                                      "schema": function.get("parameters", {})}}
        llm = model.bind(response_format=response_format, **traced, **kwargs)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    parser = RunnableLambda(complete) | parser
    if not include_raw:
        return llm | parser
    if method == "function_calling":  # the chat model raises on a call max_tokens cut: here it is the parsing_error
        llm = llm.with_fallbacks([RunnableLambda(_cut_call_message)],
                                 exceptions_to_handle=(IncompleteStructuredOutputError,))
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")


def _cut_call_message(_: Any) -> AIMessage:
    """The raw message of a call ``max_tokens`` cut (the chat model raised instead of returning it): no calls and
    ``finish_reason="length"``, so ``include_raw=True`` reports the cut as its ``parsing_error``, as for the other
    methods."""
    return AIMessage(content="", response_metadata={"finish_reason": "length"})
