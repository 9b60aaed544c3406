"""The one validator of sampling parameters and completion lengths, for the API and the playground alike.

Pure functions (no Django, no I/O). The ranges are OpenAI's where it has one (temperature 0-2, top_p
0-1, a seed any signed or unsigned 64-bit integer); the llama.cpp-style extensions (top_k, min_p,
repeat_penalty) are bounded where larger values change nothing useful. Both front ends show the same
error text; only the playground's form sends numbers as strings (`form=True`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.wire.sampling import SamplingParams


@dataclass(frozen=True)
class Limit:
    """The closed range a parameter must lie in, and whether it must be whole."""

    lo: float
    hi: float
    integer: bool = False


LIMITS = {
    "temperature": Limit(0.0, 2.0),
    "top_p": Limit(0.0, 1.0),
    "top_k": Limit(0, 1000, integer=True),
    "min_p": Limit(0.0, 1.0),
    "repeat_penalty": Limit(0.5, 2.0),
    "seed": Limit(-(2**63), 2**64 - 1, integer=True),
    # A completion length on its own; whether it fits the model's context is checked once that is known.
    "max_tokens": Limit(1, 2**31, integer=True),
}
U64 = 2**64 - 1


class ParamError(ValueError):
    """A parameter of the wrong type or out of its range; `param` names it, `code` is OpenAI's."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _show(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _from_form(v: str) -> Any:
    """A form value as the number it spells (whole numbers stay exact); the text itself if none."""
    for cast in (int, float):
        try:
            return cast(v.strip())
        except ValueError:
            continue
    return v


def number(
    values: Mapping[str, Any], name: str, limit: Limit | None = None, form: bool = False
) -> int | float | None:
    """`values[name]` checked against its limit (LIMITS[name] unless given); None when absent."""
    lim = limit or LIMITS[name]
    v = values.get(name)
    if form and isinstance(v, str):
        v = None if not v.strip() else _from_form(v)
    if v is None:
        return None
    kind = "an integer" if lim.integer else "a number"
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise ParamError(f"'{name}' must be {kind}", name, "invalid_type")
    if lim.integer and not (isinstance(v, int) or v.is_integer()):
        raise ParamError(f"'{name}' must be {kind}", name, "invalid_type")
    if not (lim.lo <= v <= lim.hi):  # also refuses NaN, which compares false to everything
        raise ParamError(
            f"'{name}' must be between {_show(lim.lo)} and {_show(lim.hi)}, not {_show(v)}", name
        )
    return int(v) if lim.integer else float(v)


def parse_sampling(
    values: Mapping[str, Any], default_temperature: float = 0.0, form: bool = False
) -> SamplingParams:
    """The sampler's parameters from a request; raises ParamError naming the first bad one.

    top_p 0 lets only the most likely token through, so it is greedy. Without a seed, sampling at a
    temperature draws a fresh one (each call differs, as with OpenAI); a given seed repeats exactly.
    """
    d = SamplingParams()
    temperature = number(values, "temperature", form=form)
    top_p = number(values, "top_p", form=form)
    seed = number(values, "seed", form=form)
    t = default_temperature if temperature is None else float(temperature)
    if top_p == 0.0:
        t, top_p = 0.0, None
    if seed is None:
        seed = secrets.randbits(63) if t > 0 else 0
    return SamplingParams(
        temperature=t,
        top_k=int(number(values, "top_k", form=form) or d.top_k),
        top_p=d.top_p if top_p is None else float(top_p),
        min_p=float(number(values, "min_p", form=form) or d.min_p),
        repeat_penalty=float(number(values, "repeat_penalty", form=form) or d.repeat_penalty),
        seed=int(seed) & U64,  # OpenAI's seeds are signed; the wire's are unsigned 64-bit
    )
