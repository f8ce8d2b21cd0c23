"""Plain chat with no documents: the conversation rendered with the model's own chat template, one stream.

The engine's ``generate`` always answers from documents (its prompt layout is prefix + documents +
question); a chat model (LangChain's ``ChatContextOfExperts``, LlamaIndex's ``ExpertDecoderLLM``) must
also answer ``"hello"``. :meth:`Engine.chat <ctx_integrations.engine.core.engine.Engine.chat>` renders the
whole conversation with :func:`conversation_ids` and decodes it as one stream with the identity rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from ctx_integrations.errors import ChatTemplateError, InvalidOptionError

CHAT_MODE = "chat"


def conversation_ids(tokenizer: object, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, ending with the assistant's turn opener."""
    if not messages:
        raise InvalidOptionError("no messages were given: pass at least one message")
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    except Exception as error:  # templates raise jinja errors of many kinds (e.g. unsupported roles)
        raise ChatTemplateError(f"the chat template could not render this conversation: {error}") from error
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
