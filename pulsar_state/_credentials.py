"""One set of credentials and TLS settings for every connection a manager makes.

The binary client gets ``authentication`` and the TLS options through its ``client_options``;
the admin REST client gets the same token (or ``admin_headers``) and trust store.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ._admin import AdminClient, HeaderSource, admin_ssl_context
from ._errors import ConfigurationError
from ._pulsar import client_authentication

__all__ = ["admin_client", "check_admin_headers", "secured_client_options", "warn_if_rest_blind"]

logger = logging.getLogger(__name__)


def secured_client_options(
    client_options: dict[str, Any] | None,
    authentication: Any,
    trust_certs: str | None,
    validate_hostname: bool | None,
) -> dict[str, Any]:
    """``client_options`` plus the binary client's credentials and TLS settings."""
    options = dict(client_options or {})
    binary_auth, _token = client_authentication(authentication)
    if binary_auth is not None:
        if "authentication" in options:
            raise ConfigurationError(
                "authentication given twice: pass it as authentication= only (it covers the "
                "admin REST calls too), not also in client_options"
            )
        options["authentication"] = binary_auth
    for key, value in (
        ("tls_trust_certs_file_path", trust_certs),
        ("tls_validate_hostname", validate_hostname),
    ):
        if value is None:
            continue
        if key in options and options[key] != value:
            raise ConfigurationError(
                f"{key} given twice, differently (argument and client_options)"
            )
        options[key] = value
    trust = options.get("tls_trust_certs_file_path")
    if trust is not None and not (isinstance(trust, str) and os.path.isfile(trust)):
        raise ConfigurationError(f"tls_trust_certs_file_path={trust!r} is not a readable file")
    if not isinstance(options.get("tls_validate_hostname", False), bool):
        raise ConfigurationError("tls_validate_hostname must be True or False")
    return options


def check_admin_headers(admin_headers: HeaderSource | None) -> None:
    if admin_headers is not None and not (
        callable(admin_headers) or isinstance(admin_headers, dict)
    ):
        raise ConfigurationError(
            "admin_headers= takes a dict of headers or a function returning one, not "
            f"{type(admin_headers).__name__}"
        )


def admin_client(
    admin_url: str,
    authentication: Any,
    admin_headers: HeaderSource | None,
    client_options: dict[str, Any],
) -> AdminClient:
    """The admin REST client with the same credentials and trust as the binary client."""
    _binary_auth, token = client_authentication(authentication)
    context = None
    if admin_url.lower().startswith("https:"):
        context = admin_ssl_context(
            client_options.get("tls_trust_certs_file_path"),
            bool(client_options.get("tls_validate_hostname", False)),
        )
    return AdminClient(admin_url, token=token, headers_source=admin_headers, ssl_context=context)


def warn_if_rest_blind(admin: AdminClient, client_options: dict[str, Any], topic: str) -> bool:
    """Warn (and return True) when the binary client has credentials the REST calls lack."""
    # A pulsar.Authentication object's credentials stay inside the C++ client.
    rest_blind = not admin.authenticated and "authentication" in client_options
    if rest_blind:
        logger.warning(
            "the Pulsar client of %s has credentials but the admin REST calls to %s "
            "have none (a pulsar.Authentication object cannot lend them): they will be "
            "refused on a secured cluster. Pass a token as authentication= or the "
            "REST headers as admin_headers=",
            topic,
            admin.admin_url,
        )
    return rest_blind
