"""A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it.

vLLM applies the tokenizer's template to /v1/chat/completions messages; so does
kvengine when the --model folder has one (`chat_template.jinja`, or the
"chat_template" of tokenizer_config.json). Without one, the plain template in
protocol.render_chat stays.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template cannot be loaded (at start-up) or rendered for these messages (a 400)."""


def _token_text(value) -> str | None:
    # tokenizer_config.json stores a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick(template) -> str | None:
    """A template string; a list of named templates (older configs) gives its "default"."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return None


def _raise_exception(message):
    raise ChatTemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The environment transformers compiles chat templates in.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template is not a valid Jinja2 template: {err}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as err:
            raise ChatTemplateError(f"the chat template failed on these messages: {err!r}") from None


def load_chat_template(model_dir: str | Path | None) -> ChatTemplate | None:
    """The folder's chat template, or None when it has none (or there is no folder)."""
    if model_dir is None:
        return None
    folder = Path(model_dir)
    config_file = folder / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ChatTemplateError(f"{config_file}: not valid JSON ({err})") from None
    jinja_file = folder / "chat_template.jinja"  # where transformers >= 4.47 saves it
    source = jinja_file.read_text() if jinja_file.is_file() else _pick(config.get("chat_template"))
    if not source:
        return None
    tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
    return ChatTemplate(source, {k: v for k, v in tokens.items() if v is not None})
