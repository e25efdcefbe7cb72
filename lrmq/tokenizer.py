"""HF-compatible tokenizer without transformers: `tokenizers` for ids, jinja2 for chat templates.

Chat templates render exactly as `transformers.PreTrainedTokenizerBase.apply_chat_template` does
(sandboxed jinja2, trim_blocks/lstrip_blocks, `raise_exception`, a non-escaping `tojson`).
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any, Sequence

import tokenizers

from lrmq import paths

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(v: Any) -> str | None:
    # tokenizer_config.json stores special tokens as "..." or {"content": "...", ...} (AddedToken).
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def _read_json(path: str) -> dict:
    """A tokenizer metadata file: one line naming the file (and line) when it is not a JSON object."""
    return paths.read_json(path, what="tokenizer file")


def _pick_template(t: Any, source: str) -> str | None:
    # A list of {"name", "template"} (multiple named templates): transformers uses "default".
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{source}: chat_template has named templates {sorted(map(str, named))} but no 'default'")
    raise ValueError(f"{source}: chat_template must be a string or a list, found {type(t).__name__}")


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant spans for masks; rendering ignores it.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` plus the special-token and chat-template metadata of an HF dir."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        generation_config: dict | None = None,
        clean_up_tokenization_spaces: bool = False,
        name: str = "<tokenizer>",
    ):
        self._tok = tok
        self.name = name
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        self.generation_config = dict(generation_config or {})
        self._cleanup = clean_up_tokenization_spaces
        self.chat_template_source = "chat template"  # the file it came from, for error messages

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            what = ("is a file, expected a checkpoint or tokenizer directory" if os.path.isfile(path)
                    else "directory does not exist" if not os.path.isdir(path) else "no tokenizer.json in it")
            raise FileNotFoundError(f"tokenizer directory {path!r}: {what}")
        text = paths.decode_utf8(paths.read_bytes(tj, "tokenizer file"), tj)
        try:
            tok = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception: "expected `,` or `}` at line 1 column 5"
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise paths.FileFormatError(f"{tj}: not a tokenizers file ({first})") from None

        cfg_path = os.path.join(path, "tokenizer_config.json")
        # exists, not isfile: a directory where a tokenizer file belongs is reported, not skipped
        cfg = _read_json(cfg_path) if os.path.exists(cfg_path) else {}
        special = {k: _token_str(cfg.get(k)) for k in _SPECIAL_NAMES}
        special_map_path = os.path.join(path, "special_tokens_map.json")  # older saves keep them here
        if os.path.exists(special_map_path):
            for k, v in _read_json(special_map_path).items():
                if k in _SPECIAL_NAMES and special.get(k) is None:
                    special[k] = _token_str(v)

        # Same precedence as transformers: the standalone .jinja file wins over the JSON field.
        template = _pick_template(cfg.get("chat_template"), cfg_path)
        template_source = cfg_path
        jinja_path = os.path.join(path, "chat_template.jinja")
        ct_json = os.path.join(path, "chat_template.json")
        if os.path.exists(jinja_path):
            template = paths.decode_utf8(paths.read_bytes(jinja_path, "chat template"), jinja_path)
            template_source = jinja_path
        elif os.path.exists(ct_json):
            template = _pick_template(_read_json(ct_json).get("chat_template"), ct_json)
            template_source = ct_json

        gen_path = os.path.join(path, "generation_config.json")
        gen = _read_json(gen_path) if os.path.exists(gen_path) else {}

        out = cls(
            tok,
            special_tokens=special,
            chat_template=template,
            generation_config=gen,
            clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)),
            name=path,
        )
        out.chat_template_source = template_source
        for k, v in out.special_tokens.items():
            if tok.token_to_id(v) is None:
                raise ValueError(f"{cfg_path}: {k} {v!r} is not in the vocabulary of {tj}")
        return out

    # ------------------------------------------------------------------ ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Tokens including added/special ones (a model's embedding table may be padded larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        t = self.special_tokens.get(name)
        return None if t is None else self._tok.token_to_id(t)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: generation_config's eos_token_id(s), then the tokenizer's eos."""
        ids: list[int] = []
        g = self.generation_config.get("eos_token_id")
        for i in (g if isinstance(g, list) else [g]):
            if i is not None and i not in ids:
                ids.append(int(i))
        t = self._special_id("eos_token")
        if t is not None and t not in ids:
            ids.append(t)
        return tuple(ids)

    @property
    def bos_id(self) -> int | None:
        t = self._special_id("bos_token")
        if t is not None:
            return t
        g = self.generation_config.get("bos_token_id")
        return int(g) if isinstance(g, int) else None

    @property
    def pad_id(self) -> int:
        """pad_token, else generation_config's pad_token_id, else the first eos id."""
        t = self._special_id("pad_token")
        if t is not None:
            return t
        g = self.generation_config.get("pad_token_id")
        if isinstance(g, int):
            return g
        if self.eos_ids:
            return self.eos_ids[0]
        raise ValueError(f"{self.name}: no pad token, pad_token_id or eos token to pad with")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def batch_encode(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        # transformers only applies this WordPiece-era cleanup to non-BPE models.
        if self._cleanup and type(self._tok.model).__name__ != "BPE":
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def batch_decode(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in seqs]

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Renders messages to a prompt string; extra kwargs (e.g. enable_thinking) reach the template."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"{self.name}: tokenizer has no chat template (tokenizer_config.json/chat_template.jinja)")
        if not template.strip():
            raise ValueError(f"{self.chat_template_source if chat_template is None else 'chat template'}: the chat "
                             "template is empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TypeError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
        # Special tokens first so explicit kwargs win, as in transformers.
        variables = {**self.special_tokens, **kwargs}
        source = self.chat_template_source if chat_template is None else "chat template"
        try:
            return _compile_template(template).render(
                messages=[dict(m) for m in messages],
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as e:
            if not type(e).__module__.startswith("jinja2"):
                raise
            # jinja2's TemplateError: a syntax error, raise_exception(), an undefined name: name the file
            line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{source}{line}: chat template error ({first})") from None
