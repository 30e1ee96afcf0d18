"""What reaches output: secrets masked (:func:`redact`), control characters escaped
(:func:`printable`).

:func:`redact` is the one masking function of the library: every message that may carry a
URL, transport options or the text of an exception raised while using them goes through it
before it is logged, raised to a worker's exit, shown by ``manage.py check``, printed by the
``celery steplock`` commands or shown on the admin page. What it masks, and where:
docs/security.md ("Secrets in output").
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping
from urllib.parse import quote, unquote

__all__ = [
    "MASK",
    "MIN_SECRET",
    "redact",
    "redact_options",
    "secrets_of",
    "url_secrets",
    "printable",
]

#: What a masked secret becomes.
MASK = "***"
#: Known secret values shorter than this (characters) are masked only where they stand in
#: a URL or a key/value pair, never as bare words.
MIN_SECRET = 4

# Any scheme, also one missing its colon (``rediss//``): the "//" starts the credentials.
_SCHEME = r"(?:(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*:?)?//"
# Schemes of servers that take credentials, also written without the "//" (``redis:pw@h``,
# ``redis:/:pw@h``): the scheme's colon (and one slash) start the credentials.
_CRED_SCHEME = (
    r"(?<![A-Za-z0-9+.\-])(?i:(?:[a-z0-9.\-]+\+)?(?:rediss?|sentinel|unix|amqps?|"
    r"pyamqp|sqs|mongodb|postgres(?:ql)?|mysql|sqla|db|cache)(?:\+[a-z0-9.\-]+)?)"
    r":/?(?!/)"
)
_START = re.compile(rf"{_SCHEME}|{_CRED_SCHEME}")
# Where an unquoted URL's text ends at the latest: the next URL of a list or of the line.
_NEXT = re.compile(rf"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://|;{_SCHEME}|\n")
# The previous form of the pattern, kept for code that imported it.
_URL = re.compile(rf"({_SCHEME})((?:(?!;{_SCHEME})\S)*)")
_SECRET_KEY = r"(?:\w+_)?(?:password|passwd|pwd|secret)"
_QUERY_SECRET = re.compile(rf"(?i)([?&;])({_SECRET_KEY})=([^&#]*)")
_VALUE = r"""b?'(?:[^'\\]|\\.)*'|b?"(?:[^"\\]|\\.)*"|[^\s,&;)}\]]+"""
# 'password': 'x'   ('password', 'x')   password='x'   password=x
_PAIR = re.compile(
    rf"""(?i)(?:(['"])\b({_SECRET_KEY})\1(\s*[:=]\s*|\s*,\s*)"""
    rf"""|()\b({_SECRET_KEY})(\s*[:=]\s*))({_VALUE})"""
)


def _mask_value(value: str) -> str:
    if value[:1] in "'\"":
        return f"{value[0]}{MASK}{value[0]}"
    if value[:2] in ("b'", 'b"'):
        return f"b{value[1]}{MASK}{value[1]}"
    return MASK


def _mask_body(body: str) -> str:
    """A URL's text after its scheme with its credentials (everything up to its last ``@``,
    the user name kept) and secret query parameters masked."""
    body = _QUERY_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}={MASK}", body)
    at = body.rfind("@")
    if at >= 0:
        userinfo = body[:at]
        user = userinfo.split(":", 1)[0] if ":" in userinfo else None
        body = (MASK if user is None else f"{user}:{MASK}") + body[at:]
    return body


def _mask_url(match: re.Match) -> str:
    return match.group(1) + _mask_body(match.group(2))


def _url_end(text: str, begin: int, pos: int) -> int:
    """Where the URL whose scheme starts at ``begin`` and whose credentials start at ``pos``
    ends: at the quote closing it when a quote opens it (as in a repr: an escaped quote
    does not close it), else at the next URL or the end of the line. A password may hold
    quotes, spaces and any punctuation, so nothing else ends it: when in doubt, more is
    masked."""
    limit = text.find("\n", pos)
    limit = len(text) if limit < 0 else limit
    following = _NEXT.search(text, pos, limit)
    limit = following.start() if following else limit
    opening = text[begin - 1] if begin else ""
    if opening not in ("'", '"'):
        return limit
    i = pos
    while i < limit and text[i] != opening:
        i += 2 if text[i] == "\\" else 1
    if i >= limit:
        return limit
    # A quote that does not close the URL: text quoted without escaping (``"{url}"``) of a
    # password holding that quote. The URL then runs on to an "@" after the quote.
    run = re.match(r"\S*", text[i + 1 : limit]).group(0)  # type: ignore[union-attr]
    if "@" in run:
        return i + 1 + len(run)
    if "@" not in text[pos:i] and "@" in text[i:limit]:
        return limit
    return i


def _mask_urls(text: str) -> str:
    out, done, pos = [], 0, 0
    while True:
        match = _START.search(text, pos)
        if match is None:
            break
        end = _url_end(text, match.start(), match.end())
        if "@" in text[match.end() : end] or "=" in text[match.end() : end]:
            out += [text[done : match.end()], _mask_body(text[match.end() : end])]
            done = end
        pos = max(end, match.end())
    return "".join(out) + text[done:]


def redact(value: Any, secrets: Iterable[str] = ()) -> str:
    """A value as text with every secret masked as :data:`MASK`; never raises.

    Masked: the credentials of every URL of any scheme, including schemes the library
    refuses and typos (``sentinel://:pw@h;sentinel://:pw@h2``, ``redis+sentinel://``,
    ``rediss//``, ``redis:pw@h``, ``redis:/:pw@h``): everything up to the URL's last ``@``,
    the user name kept, whatever the password holds; a URL ends at the quote that closes it,
    at the next URL or at the end of the line (when in doubt, more is masked), and a one-word
    credential (``redis://word@host``) is masked too. Query parameters and ``key=value`` /
    ``'key': value`` pairs whose key names a password or a secret (``password``,
    ``ssl_password``, ``sentinel_password``, ``passwd``, ``pwd``, ``client_secret``). Each of
    ``secrets`` of at least :data:`MIN_SECRET` characters, in whatever form the text quotes
    it (as is, URL-encoded, decoded, as a repr shows it). Values are masked, never names: a
    setting's name standing where a value would (``steplock_name_secret:
    steplock_name_secret``) stays; the scheme, host, port and database stay, so a message
    still says which server it is about.

    Args:
        value: A string (as it is), an exception (``str(exc)``) or anything else (its
            ``repr``).
        secrets: Known secret values, e.g. :func:`secrets_of`.

    Returns:
        The masked text.
    """
    if isinstance(value, str):
        text = value
    elif isinstance(value, BaseException):
        text = str(value)
    else:
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - a repr that fails shows nothing of the value
            text = f"<{type(value).__name__}>"
    for secret in sorted(
        {s for s in _forms(secrets) if len(s) >= MIN_SECRET}, key=len, reverse=True
    ):
        text = text.replace(secret, MASK)
    text = _mask_urls(text)
    return _PAIR.sub(_mask_pair, text)


# A setting's name standing where a pair's value would (masked values, never names).
_NAME = re.compile(r"(?i)(?:celery_)?steplock_[a-z_]+")


def _mask_pair(match: re.Match) -> str:
    quote_, key, sep = match.group(1, 2, 3) if match.group(2) is not None else match.group(4, 5, 6)
    if _NAME.fullmatch(match.group(7)) or match.group(7).lower() == key.lower():
        # "setting steplock_name_secret: steplock_name_secret (...)": a name, not a value.
        return match.group(0)
    return f"{quote_}{key}{quote_}{sep}{_mask_value(match.group(7))}"


def _forms(secrets: Iterable[str]) -> Iterable[str]:
    """Each secret as a text may quote it: as is, URL-encoded, decoded, as in a repr."""
    for secret in secrets:
        if not isinstance(secret, str) or not secret:
            continue
        yield secret
        yield quote(secret, safe="")
        yield unquote(secret)
        yield repr(secret)[1:-1]


def redact_options(options: Any) -> Any:
    """Options with their secrets masked, for showing them as a dict.

    Args:
        options: Transport or TLS options: dicts, lists, tuples, nested.

    Returns:
        A copy with the value of every key naming a password or secret replaced by
        :data:`MASK`, and URLs in string values redacted.
    """
    if isinstance(options, Mapping):
        return {
            k: MASK
            if isinstance(k, str) and re.fullmatch(_SECRET_KEY, k, re.I) and v is not None
            else redact_options(v)
            for k, v in options.items()
        }
    if isinstance(options, (list, tuple)):
        return type(options)(redact_options(v) for v in options)
    if isinstance(options, str):
        return redact(options)
    return options


def url_secrets(url: Any) -> list[str]:
    """The secret values of a URL, for :func:`redact`.

    Args:
        url: One URL or a ``;``-separated list of them, or a list or tuple of those.

    Returns:
        The password of each URL (its whole credentials when they are one word, everything
        up to the URL's last ``@``) and its secret query parameters; ``[]`` for anything
        else than a string, list or tuple.
    """
    if isinstance(url, (list, tuple)):
        return [s for u in url for s in url_secrets(u)]
    if not isinstance(url, str):
        return []
    found = []
    # One value: each URL of a ";" list runs to the next one; its credentials are everything
    # between "//" (or the scheme's colon) and its last "@", whatever they hold.
    for part in re.split(rf";(?={_SCHEME})", url):
        start = _START.search(part)
        found += _credentials(part[start.end() :] if start else part)
    # And each word, for a value that is not one URL (more secrets mask more, never less).
    for word in re.split(r"[\s;]+", url):
        start = _START.search(word)
        found += _credentials(word[start.end() :] if start else word)
    return [s for s in dict.fromkeys(found) if s]


def _credentials(body: str) -> list[str]:
    found = [query.group(3) for query in _QUERY_SECRET.finditer(body)]
    body = _QUERY_SECRET.sub("", body)
    at = body.rfind("@")
    if at >= 0:
        userinfo = body[:at]
        found.append(userinfo.split(":", 1)[1] if ":" in userinfo else userinfo)
    return found


def _option_secrets(options: Any) -> list[str]:
    found = []
    if isinstance(options, Mapping):
        for key, value in options.items():
            if isinstance(key, str) and re.fullmatch(_SECRET_KEY, key, re.I):
                if isinstance(value, bytes):
                    value = value.decode("utf-8", "replace")
                if isinstance(value, str):
                    found.append(value)
            else:
                found += _option_secrets(value)
    elif isinstance(options, (list, tuple)):
        # [("password", "x")]: a pair given where a dict was expected.
        if (
            len(options) == 2
            and isinstance(options[0], str)
            and re.fullmatch(_SECRET_KEY, options[0], re.I)
            and isinstance(options[1], str)
        ):
            found.append(options[1])
        else:
            for value in options:
                found += _option_secrets(value)
    elif isinstance(options, str):
        found += url_secrets(options)
    return found


#: The settings whose values may hold secrets (URLs, transport and TLS options).
_SECRET_SETTINGS = (
    "steplock_redis_url",
    "steplock_redis_transport_options",
    "steplock_redis_use_ssl",
    "broker_url",
    "broker_transport_options",
    "broker_use_ssl",
    "result_backend",
    "result_backend_transport_options",
)


def secrets_of(app: Any) -> tuple[str, ...]:
    """The secret values of a Celery app's configuration, for :func:`redact`; never raises.

    Args:
        app: The Celery app.

    Returns:
        The passwords of the lease store's, the broker's and the result backend's URLs and
        of their transport and TLS options (``password``, ``sentinel_kwargs.password``,
        ``ssl_password``), read as given (nothing is validated).
    """
    found: list[str] = []
    conf = getattr(app, "conf", None)
    if conf is None:
        return ()
    namespace = getattr(app, "namespace", None)
    for name in _SECRET_SETTINGS:
        names = [name] + ([f"{namespace}_{name.upper()}"] if namespace else [])
        for key in names:
            try:
                value = conf.get(key)
            except Exception:  # noqa: BLE001 - a setting that cannot be read has no secret
                continue
            found += _option_secrets(value)
    return tuple(dict.fromkeys(found))


def _escape(char: str) -> str:
    if char == "\\":
        return "\\\\"
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char)
    if named:
        return named
    code = ord(char)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else (f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    )


def _unsafe(char: str) -> bool:
    # Not printable (str.isprintable): control characters (ANSI escapes, newlines, carriage
    # returns), format characters (bidirectional overrides reorder what the terminal shows,
    # zero-width ones hide text), line and paragraph separators; and the backslash, so that
    # an escape in the output is never ambiguous.
    return char == "\\" or not char.isprintable()


def printable(value: Any) -> str:
    """A value as one line a terminal shows as it is.

    Args:
        value: Anything (``str()`` of it; None as ``"None"``).

    Returns:
        The text with every character that is not printable (control characters: ANSI
        escape sequences, ``\\n``, ``\\r``, ``\\t``; format characters: bidirectional
        overrides, zero-width characters; line and paragraph separators) and the backslash
        written as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``, ``\\\\``).
        Printable text, spaces and non-ASCII letters stay as they are.
    """
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape(c) if _unsafe(c) else c for c in text)
