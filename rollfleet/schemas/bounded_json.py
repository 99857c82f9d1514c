"""Decoding input that nobody here wrote, within bounds: size and nesting depth.

Every parser of nested data (``json``, msgspec) recurses once per level, so a small document of
``[[[[...`` nested deeper than the interpreter's recursion limit raises ``RecursionError``: not a
typed error, and one that ends whatever task met it (a worker's version follow task, a decode on
the request path). Documents nested deeper than ``MAX_DEPTH`` are refused before any parser
sees them, with the caller's typed error; nothing we read (an index, a safetensors header, a
sidecar, an acknowledgement, a job's ``extra``) comes near that depth.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from rollfleet.schemas.errors import InvalidRequest, RollfleetError

MAX_DEPTH = 64

_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")
_json_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def json_depth_within(raw: bytes | str, max_depth: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects at most ``max_depth`` deep, found
    without recursing (nor looping in Python per byte): every byte but a bracket or a quote
    dropped, then strings, then innermost pairs removed one level per pass. Malformed text whose
    brackets do not pair up is left for the parser to refuse."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if data.count(b"[") + data.count(b"{") <= max_depth:  # (no more openers than that: no deeper)
        return True
    # Escaped backslashes, then escaped quotes, go first: every quote left delimits a string.
    marks = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    # Any two quotes in a row are an empty string or the seam of two strings (whatever stood
    # between them is gone): dropping them keeps every bracket inside a string inside one.
    brackets = b"".join(marks.replace(b'""', b"").split(b'"')[::2])
    too_deep = re.compile(rb"[\[{]{%d}" % (max_depth + 1))  # that many openers in a row
    for _ in range(max_depth):
        if not brackets:
            return True
        if too_deep.search(brackets):
            return False
        brackets, removed = _EMPTY_PAIR.subn(b"", brackets)
        if not removed:
            return True
    return not brackets


def depth_within(value: object, max_depth: int = MAX_DEPTH) -> bool:
    """Whether a decoded value (lists, tuples and dicts of plain data) nests at most
    ``max_depth`` deep; walked with a stack of its own, so any depth is safe to look at."""
    if not isinstance(value, dict | list | tuple):
        return True
    if not any(isinstance(v, dict | list | tuple) for v in (value.values() if isinstance(value, dict) else value)):
        return max_depth >= 1  # a flat container, the usual case (an empty ``extra``): one level
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth + 1 > max_depth:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


class _DuplicateKey(ValueError):
    pass


def _members_in_text(data: bytes) -> int:
    """How many name/value pairs a valid JSON text holds, counted without parsing it: its colons
    outside strings (escapes dropped first, as in ``json_depth_within``)."""
    marks = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(marks.split(b'"')[::2]).count(b":")


def _members_decoded(value: Any) -> int:
    """How many name/value pairs the dicts of a value msgspec decoded hold (only dicts and lists
    nest in it), or fewer: a list is looked into only when its first item is a list or a dict (so
    a long list of numbers costs nothing). Fewer is safe for ``_load_unique``: it can only send a
    body down the exact path."""
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            count += len(item)
            stack += [v for v in item.values() if type(v) is dict or type(v) is list]
        elif type(item) is list and item and (type(item[0]) is dict or type(item[0]) is list):
            stack += [v for v in item if type(v) is dict or type(v) is list]
    return count


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _DuplicateKey(f"the key {twice!r} appears twice in one object")
    return out


def load_json(
    raw: bytes | str,
    *,
    what: str,
    max_bytes: int,
    type_: Any = None,
    error: type[RollfleetError] = InvalidRequest,
    max_depth: int = MAX_DEPTH,
    refuse_duplicate_keys: bool = False,
) -> Any:
    """``raw`` decoded as JSON (and validated as ``type_`` when given, by msgspec), or ``error``
    naming ``what`` when it is too large, nested too deep, not JSON, or not a ``type_``.
    ``refuse_duplicate_keys``: an object with a key twice is an ``error`` naming the key (JSON
    allows it, and ``json.loads`` keeps the last value: which one a writer meant is a guess)."""
    if len(raw) > max_bytes:
        raise error(f"{what} is {len(raw)} bytes, over the limit of {max_bytes}")
    if not json_depth_within(raw, max_depth):
        raise error(f"{what} nests deeper than {max_depth} levels")
    try:
        if type_ is None and refuse_duplicate_keys:
            return _load_unique(raw)
        if type_ is None:
            return json.loads(raw)
        decoder = _json_decoders.get(type_)
        if decoder is None:
            decoder = _json_decoders[type_] = msgspec.json.Decoder(type_)
        return decoder.decode(raw)
    except RecursionError:  # (cannot happen within MAX_DEPTH; kept typed should a limit change)
        raise error(f"{what} nests deeper than this process can decode") from None
    except msgspec.ValidationError as exc:
        raise error(f"{what} has an invalid field: {exc}") from None
    except _DuplicateKey as exc:
        raise error(f"{what}: {exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:  # (msgspec.DecodeError is a ValueError)
        raise error(f"{what} is not valid JSON: {exc}") from None


def _load_unique(raw: bytes | str) -> Any:
    """JSON with no key twice in any object, decoded as ``json.loads`` would (a body on a server's
    request path: msgspec decodes it in a fraction of the time). msgspec's value is kept only when
    every name/value pair of the text is in it; anything else (a key twice, text msgspec refuses
    that ``json.loads`` reads, such as ``NaN``, a byte-order mark or UTF-16) is decoded again by
    ``json.loads``, which gives the same value or error as ever."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    try:
        value = msgspec.json.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        value = _load_unique  # (a marker: not decoded)
    if value is not _load_unique and _members_decoded(value) == _members_in_text(data):
        return value
    return json.loads(raw, object_pairs_hook=_unique_keys)
