"""Typed message classes with exact validation and one canonical msgpack form.

A message class is a frozen dataclass whose fields carry a :class:`Spec` (type
bounds).  On the wire a message is a msgpack *array* of its field values in
declaration order (nested messages likewise), so the same object always gives
the same bytes.  Decoding checks every field's exact type and range and then
re-encodes: bytes that are not in canonical form are refused, which closes the
door on malleable encodings of a signed payload.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, TypeVar

import msgpack

from .errors import ProtocolError

T = TypeVar("T", bound="Message")

# Hard ceilings for the msgpack parser itself; per-type caps are stricter.
_MAX_RAW = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Spec:
    """Bounds for one field.

    ``lo``/``hi`` bound ints and floats (inclusive); ``max_len`` bounds bytes,
    str and list lengths; ``min_len`` the same from below; ``exact_len`` pins a
    bytes length (hashes, keys, signatures); ``item`` bounds list items.
    """

    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None
    min_len: int = 0
    exact_len: int | None = None
    item: Spec | None = None


def spec(*, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """Field helper: ``x: int = spec(lo=0, hi=10)``; ``default`` only serves
    constructors in code (the wire always carries every field)."""
    return dataclasses.field(default=default, metadata={"spec": Spec(**kwargs)})


class Message:
    """Base of every wire class. Subclasses are frozen dataclasses."""

    TYPE_ID: ClassVar[int] = 0  # 0 = nested only, never sent as an envelope body
    MAX_BYTES: ClassVar[int] = 1024

    def to_wire(self) -> list[Any]:
        return [_to_wire(getattr(self, f.name)) for f in dataclasses.fields(self)]  # type: ignore[arg-type]

    def encode(self) -> bytes:
        """Canonical bytes of this message."""
        return pack(self.to_wire())

    @classmethod
    def from_wire(cls: type[T], value: Any, path: str = "") -> T:
        name = path or cls.__name__
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        if not isinstance(value, list):
            raise ProtocolError(f"field:{name}", "expected an array")
        if len(value) != len(fields):
            raise ProtocolError(f"field:{name}", f"expected {len(fields)} fields, got {len(value)}")
        hints = _hints(cls)
        kwargs = {}
        for f, raw in zip(fields, value):
            fspec = f.metadata.get("spec", Spec())
            kwargs[f.name] = _check(raw, hints[f.name], fspec, f"{name}.{f.name}")
        obj = cls(**kwargs)
        obj.validate()
        return obj

    @classmethod
    def decode(cls: type[T], data: bytes) -> T:
        """Decode and validate canonical bytes; anything else raises ProtocolError."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProtocolError("type", "expected bytes")
        if len(data) > cls.MAX_BYTES:
            raise ProtocolError("size", f"{cls.__name__} is {len(data)} bytes, cap {cls.MAX_BYTES}")
        obj = cls.from_wire(unpack(bytes(data)))
        if obj.encode() != bytes(data):
            raise ProtocolError("canonical", f"{cls.__name__} bytes are not in canonical form")
        return obj

    def validate(self) -> None:
        """Cross-field rules; subclasses override and raise ProtocolError."""


def pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True, use_single_float=False, strict_types=False)
    return packed


def unpack(data: bytes) -> Any:
    """msgpack-decode peer bytes; any failure becomes ProtocolError('encoding')."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=_MAX_RAW,
            max_str_len=_MAX_RAW,
            max_array_len=1_000_000,
            max_map_len=0,  # the protocol never uses maps
            max_ext_len=0,  # nor extension types
        )
    except Exception as exc:  # msgpack raises many kinds; none may escape
        raise ProtocolError("encoding", f"not valid msgpack: {type(exc).__name__}: {exc}") from None


def _to_wire(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_wire()
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    return value


_HINT_CACHE: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINT_CACHE.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINT_CACHE[cls] = hints
    return hints


def _check(raw: Any, hint: Any, s: Spec, path: str) -> Any:
    rule = f"field:{path}"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw is None:
            return None
        if len(args) != 1:
            raise ProtocolError(rule, "unsupported union")
        return _check(raw, args[0], s, path)
    if origin in (list, tuple):
        (item_hint,) = typing.get_args(hint)[:1]
        if not isinstance(raw, list):
            raise ProtocolError(rule, "expected an array")
        _check_len(len(raw), s, rule)
        item_spec = s.item or Spec()
        return tuple(_check(v, item_hint, item_spec, f"{path}[{i}]") for i, v in enumerate(raw))
    if isinstance(hint, type) and issubclass(hint, Message):
        return hint.from_wire(raw, path)
    if hint is bool:
        if not isinstance(raw, bool):
            raise ProtocolError(rule, "expected a boolean")
        return raw
    if hint is int:
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise ProtocolError(rule, "expected an integer")
        _check_range(raw, s, rule)
        return raw
    if hint is float:
        if not isinstance(raw, float):
            raise ProtocolError(rule, "expected a float")
        if not math.isfinite(raw):
            raise ProtocolError(rule, "not a finite number")
        _check_range(raw, s, rule)
        return raw
    if hint is str:
        if not isinstance(raw, str):
            raise ProtocolError(rule, "expected a string")
        _check_len(len(raw), s, rule)
        return raw
    if hint is bytes:
        if not isinstance(raw, bytes):
            raise ProtocolError(rule, "expected bytes")
        _check_len(len(raw), s, rule)
        return raw
    raise ProtocolError(rule, f"unsupported field type {hint!r}")


def _check_len(n: int, s: Spec, rule: str) -> None:
    if s.exact_len is not None and n != s.exact_len:
        raise ProtocolError(rule, f"length {n}, must be {s.exact_len}")
    if n < s.min_len:
        raise ProtocolError(rule, f"length {n} below minimum {s.min_len}")
    if s.max_len is not None and n > s.max_len:
        raise ProtocolError(rule, f"length {n} above maximum {s.max_len}")


def _check_range(v: float, s: Spec, rule: str) -> None:
    if s.lo is not None and v < s.lo:
        raise ProtocolError(rule, f"{v} below minimum {s.lo}")
    if s.hi is not None and v > s.hi:
        raise ProtocolError(rule, f"{v} above maximum {s.hi}")
