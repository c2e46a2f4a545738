"""Client-key authentication and authorization at the HTTP face.

``authenticate`` runs first in every model route, before the body is read: with client keys configured, a
request without a valid key (``Authorization: Bearer`` or ``x-api-key``, ``gateway.core.keys``) is refused
with 401 in the protocol's own error shape (the app's handler picks it by path) after one SHA-256 and one
dictionary probe: no body read, no engine work, no state kept. ``authorize`` runs once the body names the
model: a model the key may not use is 404 ``model_not_found`` on the OpenAI face (OpenAI answers the same
for a model a key cannot see, so keys cannot probe which models exist) and 403 ``permission_error`` on the
Anthropic face (Anthropic's answer for a key without access); then the key's tenant becomes the cache salt
and its limits are checked (429 with ``Retry-After``, ``gateway.service.limits``).

Tenant rules (``gateway.core.tenants``): the salt is the key's ``tenant``; ``x-prefixgate-tenant`` from a
``trusted`` key picks the sub-tenant ``<tenant>/<header>`` (a configured tenant has no ``/``, so even a
trusted key cannot enter another key's tenant); from any other key the header is ignored and counted. The
header is read as ``gateway.core.headers.tenant`` reads it (UTF-8 when it is), in keyed and open mode alike.
With no keys configured the gateway runs open and the header is the salt, as before.
"""

from __future__ import annotations

from starlette.requests import Request

from gateway.core.errors import AuthenticationError, ModelNotFoundError, PermissionDeniedError
from gateway.core.headers import check_tenant
from gateway.core.headers import tenant as header_tenant
from gateway.core.keys import ClientKey, presented_key
from gateway.core.request import ChatRequest
from gateway.core.tenants import accounting_tenant, sub_tenant
from gateway.http.request_context import gateway_of

ANTHROPIC_PATH_PREFIX = "/v1/messages"


def authenticate(http_request: Request) -> ClientKey | None:
    """The client key of the request; None when the gateway runs open (no keys configured).

    Raises:
        AuthenticationError: keys are configured and none or an unknown one was presented (401).
    """
    gateway = gateway_of(http_request)
    if not gateway.keys:
        return None
    presented = presented_key(http_request.headers)
    key = gateway.keys.lookup(presented)
    if key is None:
        anthropic = http_request.url.path.startswith(ANTHROPIC_PATH_PREFIX)
        if presented is None:
            raise AuthenticationError(
                "x-api-key header is required"
                if anthropic
                else "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        raise AuthenticationError("invalid x-api-key" if anthropic else "Incorrect API key provided.")
    http_request.state.client_key = key
    return key


def authorize(http_request: Request, request: ChatRequest, key: ClientKey | None, admit: bool = True) -> None:
    """Apply ``key`` to a parsed request: model access, tenant (cache salt), and (``admit``) its limits.

    Raises:
        ModelNotFoundError: the key may not use the model (OpenAI face, 404).
        PermissionDeniedError: the key may not use the model (Anthropic face, 403).
        RateLimitError: a limit of the key is reached (429, ``retry_after_s`` for rpm / tpm).
    """
    if key is None:  # open mode: the client's header is the cache salt
        check_tenant(request.tenant)
        _narrow_by_cache_salt(request)
        return
    gateway = gateway_of(http_request)
    http_request.state.tenant = key.tenant  # for the log line of a request refused below
    if not key.allows(request.model):
        if http_request.url.path.startswith(ANTHROPIC_PATH_PREFIX):
            raise PermissionDeniedError(
                f"Your API key does not have permission to use model {request.model!r}."
            )
        raise ModelNotFoundError(request.model)
    header = header_tenant(http_request.headers)  # UTF-8 decoded as in open mode
    if header and key.trusted:
        request.tenant = sub_tenant(key.tenant, check_tenant(header))
    else:
        request.tenant = key.tenant
        if header:
            gateway.clients.record_tenant_header_ignored(key)
    _narrow_by_cache_salt(request)
    request.client_key = key.name
    http_request.state.tenant = request.tenant
    if admit:
        gateway.clients.admit(key, accounting_tenant(request.tenant, request.cache_salt))


def _narrow_by_cache_salt(request: ChatRequest) -> None:
    """A body's ``cache_salt`` (vLLM, SGLang) as a sub-tenant of the tenant chosen so far: ``<tenant>/<salt>``.
    It only narrows: every key stays inside its own tenant (configured tenants have no ``/``,
    ``gateway.core.tenants``), and requests with different salts never share cached prefixes (a front gateway
    with ``cache_salt: true`` sends its tenant in it)."""
    if request.cache_salt:
        request.tenant = sub_tenant(request.tenant, request.cache_salt)


def visible_models(http_request: Request, key: ClientKey | None) -> list[str]:
    """The configured model names ``key`` may use (all when open)."""
    names = gateway_of(http_request).registry.names()
    return names if key is None else [name for name in names if key.allows(name)]
