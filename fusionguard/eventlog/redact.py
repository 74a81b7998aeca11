"""Secrets out of what fusionguard writes: ``argv`` in the header (option values named like
secrets), and every string of every event (``redact_text``: messages, tracebacks, evidence,
paths): well-known token shapes, bearer tokens, passwords in URLs, ``--password=...`` options."""

from __future__ import annotations

import re
from typing import Any, List

REDACTED = "<redacted>"
#: An option (``--name`` / ``name=``) whose name contains one of these has its value redacted.
SECRET_WORDS = ("token", "key", "secret", "password", "passwd", "auth", "credential")
#: Well-known token shapes, redacted wherever they appear (Hugging Face, OpenAI / Anthropic,
#: GitHub, GitLab, Slack, AWS access key ids, JWTs) and passwords inside URLs.
_TOKEN_RE = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_\-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|glpat-[A-Za-z0-9_\-]{16,}|xox[abprs]-[A-Za-z0-9\-]{10,}|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}|AIza[0-9A-Za-z_\-]{35})"
)
#: ``Bearer <token>`` (an HTTP Authorization header in an error message).
_BEARER_RE = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9\-._~+/]{8,}=*")
#: A value: quoted (``"two words"``, ``'x'``) or up to the next space, quote, comma or semicolon.
_VALUE = r"(?:\"[^\"\n]*\"|'[^'\n]*'|(?![-\s])[^\s'\",;&]+)"
#: An option named like a secret inside free text: ``--password=v``, ``--api-key v``, ``--password "v"``.
_TEXT_OPTION_RE = re.compile(
    r"(?i)(?<![\w-])(--?[A-Za-z0-9_.\-]*(?:token|key|secret|password|passwd|auth|credential)[A-Za-z0-9_.\-]*)(=|\s+)" + _VALUE
)
#: ``NAME=v`` / ``name: v`` without dashes (an environment variable, a config line): only names
#: that end like a secret (``PASSWORD``, ``aws_secret_access_key``, ``hf_token``, ``credentials``),
#: never a bare ``key`` / ``token`` (``key=layers.0``, "unexpected token: ')'") nor ``num_key_value_heads=8``.
_TEXT_ASSIGN_RE = re.compile(
    r"(?i)(?<![\w\-.])([A-Za-z0-9_.]*(?:password|passwd|secret|[a-z0-9]_?(?:api|access|secret|private|auth)_?key|[a-z0-9]_?token"
    r"|credentials?))(\s*[=:]\s*)" + _VALUE
)
#: A URL's query parameter named like a secret: ``?token=v``, ``&api_key=v``, ``&sig=v`` (a signed URL).
_QUERY_RE = re.compile(
    r"(?i)([?&][A-Za-z0-9_.\-]*(?:token|key|secret|password|passwd|auth|credential|signature|sig)[A-Za-z0-9_.\-]*=)[^&#\s'\"]+"
)
#: An HTTP ``Authorization`` header's credentials (``Basic dXNlcjpw...``, ``Digest ...``, a bare token).
_AUTH_HEADER_RE = re.compile(r"(?i)\b(authorization\s*[:=]\s*(?:(?:basic|bearer|digest|token)\s+)?)[^\s'\",;]+")
#: Something that may hold a secret, lower-cased: the cheap first look (substring tests: a few
#: microseconds an event; most strings hold none of these).
_MARKERS = (
    "hf_",
    "sk-",
    "gh",
    "glpat-",
    "xox",
    "akia",
    "asia",
    "eyj",
    "aiza",
    "bearer",
    "://",
    "token",
    "key",
    "secret",
    "passw",
    "auth",
    "credential",
    "sig",
)
_URL_PASSWORD_RE = re.compile(r"(?<=://)([^/@:\s]*):[^/@\s]+@")
_OPTION_RE = re.compile(r"^([-+]{0,2}[A-Za-z0-9_.\-]+)=(.*)$", re.S)  # --x=v, x=v, Hydra +x=v / ++x=v


def _secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def redact_argv(argv: List[Any]) -> List[str]:
    """``argv`` with secret-looking values replaced by ``<redacted>``: the value of an option
    whose name contains token / key / secret / password / passwd / auth / credential (``--x=v``,
    ``x=v`` / ``+x=v`` / ``++x=v`` (Hydra) and ``--x v``), any well-known token shape, the password of a URL. Harmless
    arguments (``--lr 3e-4``) stay readable."""
    out: List[str] = []
    hide_next = False
    for raw in argv:
        arg = str(raw)
        if hide_next and not (arg.startswith("-") and len(arg) > 1 and not arg[1:2].isdigit()):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        m = _OPTION_RE.match(arg)
        if m and _secret_name(m.group(1)):
            out.append(f"{m.group(1)}={REDACTED}")
            continue
        if arg.startswith("-") and _secret_name(arg):
            hide_next = True  # --api-key VALUE
        arg = _TOKEN_RE.sub(REDACTED, arg)
        out.append(_URL_PASSWORD_RE.sub(lambda mm: f"{mm.group(1)}:{REDACTED}@", arg))
    return out


def redact_text(text: str) -> str:
    """``text`` with secrets replaced by ``<redacted>``: token shapes (Hugging Face, OpenAI,
    GitHub, GitLab, Slack, AWS and Google keys, JWTs), ``Bearer`` tokens, the password of a URL,
    the value of an option named like a secret (``--password=v``, ``--api-key v``)."""
    lowered = text.lower()
    if not any(m in lowered for m in _MARKERS):
        return text
    text = _TOKEN_RE.sub(REDACTED, text)
    text = _BEARER_RE.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _URL_PASSWORD_RE.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    text = _AUTH_HEADER_RE.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    text = _QUERY_RE.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    text = _TEXT_OPTION_RE.sub(lambda m: f"{m.group(1)}{'=' if m.group(2) == '=' else ' '}{REDACTED}", text)
    return _TEXT_ASSIGN_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def redact_value(value: Any) -> Any:
    """``value`` (an event's field: a string, or lists and dicts of them) with ``redact_text``
    applied to every string in it; other values as they are."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(v) for v in value]
    return value
