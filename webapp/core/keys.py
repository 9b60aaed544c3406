"""The control plane's Ed25519 keys: the route-token signing key (ROUTE_KEY_PEM(_FILE) or a 0600 file)
and the release public key that enrolling nodes pin.

In core because two apps need it: fleet hands its public half to enrolling nodes, routing signs with it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from agent.wire import routetoken
from webapp.core.files import write_once


def release_public_key() -> str:
    """The base64 release public key nodes pin at enrollment ("" when releases are not configured).

    RELEASE_PUBLIC_KEY when set (the private half stays on the admin's machine); else the public half
    of RELEASE_SIGNING_KEY_FILE (the web host signs uploads itself). Neither: agents never auto-update.
    """
    from agent.wire import release

    if settings.RELEASE_PUBLIC_KEY:
        release.load_public_key(settings.RELEASE_PUBLIC_KEY)  # refuse a malformed setting early
        return str(settings.RELEASE_PUBLIC_KEY).strip()
    if settings.RELEASE_SIGNING_KEY_FILE:
        return release.public_key_b64(release.load_private_key(Path(settings.RELEASE_SIGNING_KEY_FILE)))
    return ""


@lru_cache(maxsize=1)
def route_signing_key() -> Ed25519PrivateKey:
    """Loaded once per process; generated into the data dir (mode 0600) on first start."""
    pem = settings.ROUTE_KEY_PEM
    if pem:
        key = serialization.load_pem_private_key(pem.encode(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ImproperlyConfigured("ROUTE_KEY_PEM is not an Ed25519 private key")
        return key
    path = Path(settings.ROUTE_KEY_PATH)
    if not path.exists():
        write_once(path, routetoken.private_key_pem(routetoken.generate_key()))
    return routetoken.load_private_key(path)
