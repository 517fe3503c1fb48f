"""Who may use `attnslim serve`'s server: its API key and the address it listens on, decided before vLLM starts.

The policy (README, "Serving"), so that a server never runs without a key by accident:
- The key comes from exactly one of `--api-key-file PATH` (recommended), the `VLLM_API_KEY` environment variable
  (vLLM's own way to keep a key off a command line), or `--api-key KEY`. The last is visible to every user of the
  machine in `ps` until vLLM replaces attnslim's process (seconds, minutes while a packaged model is converted), so
  it is accepted with a warning. Two sources at once are refused instead of one silently winning; an empty key is
  refused, as vLLM would read it as "no key".
- vLLM gets the key only through VLLM_API_KEY in its environment (readable by the same user and root), never argv.
- `--host ""` (an unset shell variable) is refused: vLLM would listen on every interface.
- On a loopback host (the default 127.0.0.1) a server without a key is allowed: only this machine can reach it.
  Any other host without a key is refused unless `--no-api-key` says that is meant (a private network, or a proxy
  that authenticates); then a warning is printed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from attnslim.errors import AttnslimError, first_line
from attnslim.safe_files import regular_file

KEY_ENV = "VLLM_API_KEY"
KEY_FILE_LIMIT = 4096  # bytes; a key is tens of characters
KEY_ADVICE = "put the key in a file only you can read and give --api-key-file PATH, or export VLLM_API_KEY"


@dataclass(frozen=True)
class Access:
    """The server's key (None: no key) and where it came from, whether the host is loopback, and what to warn."""

    key: str | None
    source: str | None
    loopback: bool
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.key is not None:
            return f"clients must send the API key from {self.source}"
        return "no API key: this machine only" if self.loopback else "no API key (--no-api-key): open to the network"


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (127.0.0.0/8, ::1; "localhost" resolves to them).
    A name that does not resolve is not loopback (the port probe then refuses it)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_key(key: str, source: str) -> str:
    """The key, or an AttnslimError that names `source` (never the key): empty, or characters a client cannot send
    in an `Authorization: Bearer` header (whitespace, control, non-ASCII)."""
    if not key:
        raise AttnslimError(f"the API key from {source} is empty; give a key, or leave it out (unset {KEY_ENV}) to "
                            "serve without one")
    if not all("!" <= c <= "~" for c in key):
        raise AttnslimError(f"the API key from {source} contains whitespace, control or non-ASCII characters, which "
                            "clients cannot send in an Authorization header; use printable ASCII (e.g. the output "
                            "of `openssl rand -hex 32`)")
    return key


def read_key_file(path: Path) -> tuple[str, list[str]]:
    """(the key in `path`, warnings): a regular file of at most KEY_FILE_LIMIT bytes, the key on its first line
    (surrounding whitespace and the final newline are not part of it). A warning when others may read the file."""
    regular_file(path, "--api-key-file")
    try:
        with open(path, "rb") as f:
            raw = f.read(KEY_FILE_LIMIT + 1)
        mode = os.stat(path).st_mode
    except OSError as err:
        raise AttnslimError(f"--api-key-file {path} cannot be read ({first_line(err)}); check its "
                            "permissions") from None
    if len(raw) > KEY_FILE_LIMIT:
        raise AttnslimError(f"--api-key-file {path} is larger than {KEY_FILE_LIMIT} bytes, not a key file; give the "
                            "file that holds only the key")
    try:
        key = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise AttnslimError(f"--api-key-file {path} is not text; give the file that holds only the key") from None
    warnings = []
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warnings.append(f"--api-key-file {path} can be read by other users (mode {stat.S_IMODE(mode):o}); "
                        f"`chmod 600 {path}`")
    return check_key(key, f"--api-key-file {path}"), warnings


def check_access(host: str, port: int, api_key: str | None, api_key_file: Path | None, no_api_key: bool,
                 environ: Mapping[str, str]) -> Access:
    """The key and the host checked against the policy above; an AttnslimError naming the fix otherwise."""
    if not host.strip():
        raise AttnslimError("--host is empty (an unset shell variable?); an empty host makes vLLM listen on every "
                            "interface. Give 127.0.0.1 (this machine only, the default), or 0.0.0.0 or this "
                            "machine's address to serve other machines (with a key)")
    warnings: list[str] = []
    given: list[tuple[str, str]] = []
    if api_key is not None:
        given.append(("--api-key", api_key))
        warnings.append(f"--api-key shows the key to every user of this machine (`ps`) until vLLM starts; {KEY_ADVICE}")
    if api_key_file is not None:
        key, file_warnings = read_key_file(Path(api_key_file).expanduser())
        given.append((f"--api-key-file {api_key_file}", key))
        warnings += file_warnings
    if KEY_ENV in environ:
        given.append((KEY_ENV, environ[KEY_ENV]))
    if len(given) > 1:
        raise AttnslimError(f"the API key is given {len(given)} ways ({', '.join(s for s, _ in given)}); give it one "
                            f"way (unset {KEY_ENV} in this shell if it should not be used)")
    if no_api_key and given:
        raise AttnslimError(f"--no-api-key contradicts the key from {given[0][0]}; drop one of them")
    loopback = is_loopback(host)
    if given:
        source, key = given[0]
        return Access(check_key(key, source), source, loopback, tuple(warnings))
    if not loopback and not no_api_key:
        raise AttnslimError(f"--host {host} can be reached from other machines, and no API key is given: anyone who "
                            f"reaches port {port} could use the server. Give a key ({KEY_ADVICE}), or serve on "
                            "127.0.0.1, or pass --no-api-key to serve without a key on purpose (a private network, "
                            "or a proxy that authenticates)")
    if not loopback:
        warnings.append(f"serving on {host} with no API key (--no-api-key): anyone who reaches port {port} can use "
                        "the server")
    return Access(None, None, loopback, tuple(warnings))
