"""Secrets out of ``argv`` before the header writes it: option values named like secrets,
well-known token shapes, passwords in URLs."""

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
    r"|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,})"
)
_URL_PASSWORD_RE = re.compile(r"(?<=://)([^/@:\s]+):[^/@\s]+@")
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
