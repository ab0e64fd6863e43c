"""Choose the shaped link: kernel namespaces when possible, else the labelled userspace fallback."""

from __future__ import annotations

import sys

from scd_serve.bench.netns import NetnsLink
from scd_serve.bench.tbproxy import ProxyLink
from scd_serve.errors import Unavailable


def open_link(force_fallback: bool = False):
    """An entered link object (NetnsLink or ProxyLink); the caller must call .down()."""
    reason = "--no-netns given" if force_fallback else NetnsLink.available()
    if reason is None:
        try:
            return NetnsLink().up()
        except Unavailable as exc:
            reason = exc.message
    print(f"bench: network namespaces unavailable ({reason}); using the in-process "
          f"userspace token-bucket proxy instead - results are labelled as such", file=sys.stderr)
    return ProxyLink(reason).up()
