"""A request's hold on its key's budget: the cost estimate it reserves before its backend is asked
(``gateway.service.usage_estimate``), released exactly once when it ends, whichever way (the pipeline charges
the actual cost separately). Invariant: a key's ``reserved_usd`` is the sum of its live holds."""

from __future__ import annotations

from gateway.core.request import ChatRequest
from gateway.core.tenants import accounting_tenant
from gateway.service.gateway import Gateway
from gateway.service.usage_estimate import estimate_prompt_tokens, output_cap, reservation_usd


class BudgetHold:
    """The cost estimate one request holds against its key's budget (``ClientUsage.reserve``), from before
    its backend is asked until it ends; ``release`` gives it back once (later calls do nothing).

    Attributes:
        amount_usd: the reserved estimate (0.0: nothing held; the key has no budget, or the model no prices).
        prompt_tokens: the local estimate of the prompt's tokens the reservation priced, when one was made.
    """

    def __init__(
        self,
        gateway: Gateway,
        request: ChatRequest,
        amount_usd: float = 0.0,
        prompt_tokens: int | None = None,
    ) -> None:
        self._gateway = gateway
        self._key = request.client_key
        self.amount_usd = amount_usd
        self.prompt_tokens = prompt_tokens
        self._held = prompt_tokens is not None

    @classmethod
    def reserve(cls, gateway: Gateway, request: ChatRequest) -> BudgetHold:
        """Reserve ``request``'s cost estimate (``gateway.service.usage_estimate``: prompt tokens at the input
        price plus its output cap at the output price) when its key has a budget and its model prices.

        Raises:
            QuotaExceededError: spend + reservations + this estimate would pass the key's budget.
        """
        prices = gateway.stats.prices(request.model)
        if prices is None or not gateway.clients.has_budget(request.client_key):
            return cls(gateway, request)
        prompt_tokens = estimate_prompt_tokens(request)
        amount = reservation_usd(prices, prompt_tokens, output_cap(request))
        gateway.clients.reserve(
            request.client_key, accounting_tenant(request.tenant, request.cache_salt), amount
        )
        return cls(gateway, request, amount, prompt_tokens)

    def release(self) -> None:
        """Give the reservation back (once); the request's actual cost is charged separately."""
        if self._held:
            self._held = False
            self._gateway.clients.release(self._key, self.amount_usd)
