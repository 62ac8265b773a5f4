"""Parsing and formatting of rates, sizes and quotas as users write them.

Rates follow tc's spelling (`100mbit`, `1gbit`, `500kbit`, `1.5gbit`); sizes accept SI and
binary suffixes (`2TB`, `512MiB`); egress quotas are a size per period (`2TB/month`).
"""

from __future__ import annotations

import re

from vpscluster.errors import UserError

_RATE_UNITS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    # tc also accepts bytes per second spelled "bps" (kbps = kilobytes/s).
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,
}
_SIZE_UNITS = {
    "b": 1, "": 1,
    "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
    "p": 1e15, "pb": 1e15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_PERIOD_SECONDS = {"day": 86400, "week": 7 * 86400, "month": 30 * 86400}
_NUM = r"(\d+(?:\.\d+)?)"


def parse_rate_bits(text: str | int | float, what: str = "rate") -> float:
    """`100mbit` -> 1e8 bits per second."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise UserError(f"{what}: {text} must be positive")
        return float(text)
    m = re.fullmatch(_NUM + r"\s*([a-z]+)", str(text).strip().lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise UserError(f"{what}: {text!r} is not a rate; write it like tc does, e.g. 100mbit or 1gbit")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if value <= 0:
        raise UserError(f"{what}: {text!r} must be positive")
    return value


def parse_rate_mbit(text: str | int | float, what: str = "rate") -> float:
    """`1gbit` -> 1000.0 (Mbit/s)."""
    return parse_rate_bits(text, what) / 1e6


def parse_size_bytes(text: str | int | float, what: str = "size") -> float:
    """`2TB` -> 2e12, `512MiB` -> 536870912."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = re.fullmatch(_NUM + r"\s*([a-z]*)", str(text).strip().lower())
    if not m or m.group(2) not in _SIZE_UNITS:
        raise UserError(f"{what}: {text!r} is not a size; write e.g. 500GB, 2TB or 512MiB")
    return float(m.group(1)) * _SIZE_UNITS[m.group(2)]


def parse_quota(text: str, what: str = "egress_quota") -> tuple[float, float]:
    """`2TB/month` -> (2e12 bytes, 2592000 seconds)."""
    parts = str(text).strip().lower().split("/")
    if len(parts) != 2 or parts[1].strip() not in _PERIOD_SECONDS:
        raise UserError(f"{what}: {text!r} is not a quota; write a size per day, week or month, e.g. 2TB/month")
    return parse_size_bytes(parts[0], what), float(_PERIOD_SECONDS[parts[1].strip()])


def parse_list(text: str, parse, what: str, count: int | None = None) -> list:
    """`50mbit,200mbit` -> [parse('50mbit'), ...]; one value is repeated `count` times."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise UserError(f"{what}: empty value")
    values = [parse(s, what) for s in items]
    if count is not None:
        if len(values) == 1:
            values = values * count
        elif len(values) != count:
            raise UserError(f"{what}: {len(values)} values given for {count} nodes; give one value or one per node")
    return values


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def format_rate_mbit(mbit: float) -> str:
    return f"{mbit / 1000:.2f} Gbit/s" if mbit >= 1000 else f"{mbit:.1f} Mbit/s"
