"""Plain chat with no documents: the conversation rendered with the model's own chat template, one stream.

The engine's ``generate`` always answers from documents (its prompt layout is prefix + documents +
question); a chat model (LangChain's ``ChatContextOfExperts``, LlamaIndex's ``ExpertDecoderLLM``) must
also answer ``"hello"``. :meth:`Engine.chat <ctx_integrations.engine.core.engine.Engine.chat>` renders the
whole conversation with :func:`conversation_ids` and decodes it as one stream with the identity rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from ctx_integrations.documents import user_text
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.errors import ChatTemplateError, InvalidOptionError

CHAT_MODE = "chat"
_MESSAGE_MARK = "\x00MESSAGE{}\x00"


def conversation_ids(layout: PromptLayout, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, ending with the assistant's turn opener.

    Message contents are user data, like documents and queries: the template is rendered around a
    marker per message, and each content is tokenised as user text, so a control token written in a
    message (``<|im_end|>``, ``<|im_start|>system``) stays text and cannot open a forged turn; only the
    template's own control tokens become control ids.
    """
    if not messages:
        raise InvalidOptionError("no messages were given: pass at least one message")
    contents = [user_text(m.get("content") if isinstance(m, dict) else None, f"message {i}'s content")
                for i, m in enumerate(messages)]
    marked = [{**m, "content": _MESSAGE_MARK.format(i)} for i, m in enumerate(messages)]
    try:
        text = layout.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # templates raise jinja errors of many kinds (e.g. unsupported roles)
        raise ChatTemplateError(f"the chat template could not render this conversation: {error}") from error
    parts: list[tuple[str, bool]] = []
    for i, content in enumerate(contents):
        before, mark, text = text.partition(_MESSAGE_MARK.format(i))
        if not mark:
            raise ChatTemplateError(f"the chat template dropped or altered message {i}; it cannot be tokenised safely")
        parts += [(before, False), (content, True)]
    return layout.encode_parts(parts + [(text, False)])
