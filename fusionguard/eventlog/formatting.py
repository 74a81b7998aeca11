"""Text formatting shared by ``summary()`` and ``fusionguard report``: one table layout, one
unit style (automatic decimal units, ``×`` for counts), one escape for untrusted text."""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Optional

# C0 (except newline, handled by the caller), DEL, C1, the bidirectional overrides and marks
# (RLM / LRM, ALM) that can make a terminal or a page show text other than what is there, and the
# invisible ones: zero-width spaces and joiners, the line / paragraph separators, the BOM.
# Also the other invisible format characters: soft hyphen, combining grapheme joiner, Hangul
# fillers, Mongolian vowel separator, variation selectors, interlinear annotation, and the tag
# characters (U+E0000-U+E007F: invisible ASCII, hidden text).
UNSAFE_ABOVE_C0 = (
    "\x7f-\x9f\xad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u2028-\u202e\u2060-\u206f\u3164"
    "\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb\U000e0000-\U000e007f\U000e0100-\U000e01ef"
)  # (JSON escapes C0 itself)
_CONTROL = re.compile(f"[\x00-\x1f{UNSAFE_ABOVE_C0}]")


def escape(text: str) -> str:
    """``text`` with control characters (ESC, newline, ...) written as ``\\xNN`` / ``\\uNNNN`` /
    ``\\UNNNNNNNN``: a log's strings never move the cursor, recolour or forge lines in a terminal."""

    def sub(m: "re.Match[str]") -> str:
        c = ord(m.group())
        return f"\\x{c:02x}" if c < 0x100 else (f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}")

    return _CONTROL.sub(sub, text)


def human_bytes(n: Optional[float], signed: bool = False, unknown: str = "-") -> str:
    """``123 B``, ``1.23 KB`` ... ``TB`` (decimal units, as the README's figures); ``unknown`` for None."""
    if n is None:
        return unknown
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    try:
        value = abs(float(n))
    except OverflowError:  # an int past float's range (a hostile log): never a traceback
        return f"{sign}>1e308 B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            body = f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
            return sign + body
        value /= 1000
    return f"{n} B"  # pragma: no cover


def site_text(site: Any, unknown: Optional[str] = None) -> Optional[str]:
    """``file:line in function`` of a call-site record (``unknown`` when there is none: a log's
    record may lack it or hold anything)."""
    if not isinstance(site, dict) or not site.get("file"):
        return unknown
    return f"{site.get('file')}:{site.get('line')} in {site.get('function')}"


def causes_text(causes: Optional[Dict[str, Any]]) -> str:
    return ", ".join(f"{k}×{v}" for k, v in (causes or {}).items()) or "-"


def mem_text(med: Any, mx: Any) -> str:
    if med is None and mx is None:
        return "-"
    return f"{human_bytes(med)} / {human_bytes(mx)}"


def count_text(n: Optional[int]) -> str:
    return "-" if n is None else f"{n:,}"


def table(headers: List[str], rows: List[List[str]], right: Iterable[int] = ()) -> List[str]:
    """Columns padded to their widest cell, two spaces apart, a dashed rule under the header."""
    right = set(right)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: List[str]) -> str:
        return "  ".join(c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]
