"""Secrets that can ride inside a URL, and their one redaction.

A URL may carry credentials in its userinfo (``s3://KEY:SECRET@bucket/p``,
``nats://user:pass@host``) or in its query (``?sig=...``, ``X-Amz-Signature=...``). Whatever
prints a URL, or text that may quote one (errors, log lines, a replica's ``degraded_reason``),
prints it through ``redact_url`` / ``redact_urls``; whatever must refuse such a URL compares the
URL with its redaction (``has_secrets``), so the rule of what counts as a secret lives here alone.
"""

from __future__ import annotations

import re

MASK = "***"
# Query parameters whose values are secrets: SAS signatures, presigned S3 URLs, tokens, keys.
_SECRET_PARAM = re.compile(r"sig|signature|token|secret|passw|pwd|key|credential|auth", re.IGNORECASE)
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """``url`` with its userinfo and the values of secret-looking query parameters replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    head, mark, query = rest.partition("?")
    query, hash_, fragment = query.partition("#")
    if not mark:
        head, hash_, fragment = head.partition("#")
    first = head.find("@")
    # The userinfo ends at the authority's last "@". An AWS secret may hold "/", which ends the
    # authority for a URL parser: a "KEY:SECRET" before the first "@" is userinfo all the same. A
    # user name alone may be an access key id: all of the userinfo goes.
    if first >= 0 and ("/" not in head[:first] or ":" in head[:first]):
        head = f"{MASK}@{head[head.rfind('@') + 1 :]}"
    if mark:
        query = "&".join(
            f"{name}={MASK}" if eq and _SECRET_PARAM.search(name) else f"{name}{eq}{value}"
            for name, eq, value in (p.partition("=") for p in query.split("&"))
        )
    return f"{scheme}://{head}{mark}{query}{hash_}{fragment}"


def redact_urls(text: str) -> str:
    """Free text (an error message, a reason) with every URL in it redacted."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def has_secrets(url: str) -> bool:
    """Whether ``url`` carries credentials that ``redact_url`` would hide."""
    return redact_url(url) != url
