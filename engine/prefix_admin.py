"""What an engine does with its prefix cache besides serving requests: warming (prefill and keep, optionally
pinned), the prefix catalog (list and drop cached prefixes by prefix key, tenant or model, in RAM and every
tier), flushing and closing the KV tiers. ``PrefixAdmin`` is a base of ``engine.llm_engine.LLMEngine`` and works on
its state (``kv``, ``tiers``, ``catalog``, ``input``, ``config``); it holds none of its own. Never called from
the step loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from engine.api import SamplingParams, WarmResult
from engine.block_hash import ExtraKeys, LayeredKeys
from engine.kv_tiers.catalog import RECORD_REFRESH_S, CachedPrefix, PrefixRecord
from engine.kv_tiers.policy import level_of_blocks


class PrefixAdmin:
    """Warming, pins, the prefix catalog and the tiers' lifetime of an ``LLMEngine`` (see the module docstring)."""

    def warm(
        self,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        level_ends: Sequence[tuple[int, str]] | None = None,
        pin: bool = False,
        prefix_key: str | None = None,
    ) -> WarmResult:
        """Prefill a prompt and keep its blocks cached (pinned in RAM with ``pin``); steps the engine until
        it is done (other requests step too). For a synchronously driven engine; ``AsyncEngine.warm`` is the
        same through the step loop.

        Returns:
            The prefix key, the tokens now cached (whole blocks), the pin, the tokens a longer prompt
            starting with ``prompt_token_ids`` reuses (``reusable_tokens``) and the tokens this warm prefilled
            (``computed_tokens``).

        Raises:
            InvalidRequestError, PromptTooLongError: the prompt cannot be served (nothing is queued).
            PinCapError: ``pin`` and the prompt's blocks would exceed the pin cap (checked before prefill).
        """
        prompt = list(prompt_token_ids)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.check_prompt(prompt, params)
        self.check_level_ends(level_ends)
        if pin:
            self.check_pin_room(len(prompt) // self.kv.block_size, prefix_key)
        req = self.add_checked_request(prompt, params, cache_salt=cache_salt, level_ends=level_ends)
        while not req.is_finished:
            self.step()
        result = self.finish_warm(prompt, req.extra_keys, pin, prefix_key, level_ends)
        return dataclasses.replace(result, computed_tokens=len(prompt) - req.num_cached_tokens)

    def finish_warm(
        self,
        prompt: list[int],
        extra_keys: ExtraKeys,
        pin: bool,
        prefix_key: str | None,
        level_ends: Sequence[tuple[int, str]] | None = None,
        shared_tokens: int | None = None,
    ) -> WarmResult:
        """After a warming request finished: look its full blocks up, pin them when asked, name the prefix
        (listed with the longest level of ``level_ends``, as its blocks were tagged), and count what a
        following request reuses.

        Args:
            shared_tokens: leading tokens of ``prompt`` a following request shares (``AsyncEngine.warm``: up
                to where the next turn departs from the generation prompt); None = all of them.

        Raises:
            PinCapError: the pin cap was reached meanwhile (nothing pinned).
        """
        hashes = self.kv.block_hashes(prompt, extra_keys)
        hit = self.kv.find_cached_prefix(prompt, hashes, extra_keys)
        key = prefix_key or (hashes[-1].hex() if hashes else "")
        # one pin per listed prefix: a prefix warmed again keeps its pin on the same blocks, and a pin on blocks
        # no longer listed under the key (its prompt changed) is replaced or released, never left unreachable
        old = self.catalog.get(key) if hashes else None
        old_pin = old.pin_id if old is not None else None
        held = self.kv.pins.blocks_of(old_pin)
        same = held is not None and [b.block_id for b in held] == [b.block_id for b in hit._blocks]
        pin_id, pinned = None, 0
        if same:
            pin_id, pinned = old_pin, len(held)
        elif pin and hit.num_blocks:
            pin_id = f"pin-{next(self._pin_ids)}"
            pinned = self.kv.pins.pin(pin_id, hit, replaces=old_pin)
        elif held is not None and hashes:
            self.kv.pins.unpin(old_pin)
        if hashes:
            self._record_prefix(key, hashes, extra_keys, level_ends, len(prompt), pin_id)
        reusable = self.reusable_tokens(prompt, hashes, extra_keys, shared_tokens)
        return WarmResult(key, len(prompt), hit.num_tokens, pinned, pin_id, reusable)

    def check_pin_room(self, num_blocks: int, prefix_key: str | None) -> None:
        """Raise ``PinCapError`` unless a prefix of ``num_blocks`` blocks could be pinned under ``prefix_key`` now:
        the blocks of a pin the key holds already are counted as released (``finish_warm`` reuses or replaces
        it)."""
        rec = self.catalog.get(prefix_key) if prefix_key else None
        held = self.kv.pins.blocks_of(rec.pin_id if rec is not None else None)
        self.kv.pins.check_room(num_blocks - (len(held) if held is not None else 0))

    def reusable_tokens(
        self,
        prompt: list[int],
        hashes: Sequence[bytes],
        extra_keys: ExtraKeys,
        shared_tokens: int | None = None,
    ) -> int:
        """Tokens a request whose prompt starts with ``prompt[:shared_tokens]`` and goes on past it reuses from
        the cache now: the scheduler's own lookup (whole blocks, then the longest partial entry) of those
        tokens followed by one more. A lookup never covers a prompt's last token, so the extra token (its
        value is never compared) lets it cover all of them, as it does for a longer following prompt."""
        n = len(prompt) if shared_tokens is None else max(0, min(shared_tokens, len(prompt)))
        if n == 0:
            return 0
        probe = [*prompt[:n], prompt[n - 1]]
        return self.kv.find_cached_prefix(
            probe, list(hashes[: n // self.kv.block_size]), extra_keys, partial=True
        ).num_tokens

    def unpin(self, pin_id: str) -> bool:
        """Release a pin made by ``warm(pin=True)``. Returns False when unknown."""
        for rec in self.catalog.select():
            if rec.pin_id == pin_id:
                rec.pin_id = None
        return self.kv.pins.unpin(pin_id)

    def _record_prefix(
        self,
        key: str,
        hashes: Sequence[bytes],
        extra_keys: ExtraKeys,
        level_ends: Sequence[tuple[int, str]] | None,
        num_prompt_tokens: int,
        pin_id: str | None = None,
    ) -> None:
        """List the prompt's stable head (up to its last level end; all full blocks without levels), under the
        request's own model id and tenant (a layered request's private keys: its public blocks are shared)."""
        bs = self.kv.block_size
        end = min(level_ends[-1][0], num_prompt_tokens) if level_ends else num_prompt_tokens
        n = min(end // bs, len(hashes))
        policies = self.config.tier_policies
        levels = level_of_blocks(n, bs, level_ends, policies.default_level)
        level, _ = policies.resolve("disk", frozenset().union(*levels) if levels else frozenset())
        own = extra_keys.private if isinstance(extra_keys, LayeredKeys) else tuple(extra_keys)
        model_id, salt = (own + ("", ""))[:2]
        now = self.tier_clock()
        rec = PrefixRecord(key, str(model_id), str(salt), level, list(hashes[:n]), n * bs, now, pin_id)
        old = self.catalog.get(key)
        rec.saved_at = old.saved_at if old is not None else 0.0
        evicted = self.catalog.record(rec)
        changed = old is None or (old.block_hashes, old.level, old.tenant, old.model_id) != (
            rec.block_hashes,
            rec.level,
            rec.tenant,
            rec.model_id,
        )
        if self.tiers is not None:  # kept down too, for a restart (engine.kv_tiers.catalog)
            if changed or now - rec.saved_at >= RECORD_REFRESH_S:
                rec.saved_at = now
                self.tiers.stack.save_record(rec)
            for gone in evicted:
                self.tiers.stack.forget_record(gone.prefix_key)

    def list_cached(
        self, *, prefix_key: str | None = None, tenant: str | None = None, model_id: str | None = None
    ) -> list[CachedPrefix]:
        """The listed prefixes matching every filter given, with where their blocks are now and when the
        soonest of them expires per tier. ``tiers["ram"]`` is the tokens of the leading blocks the pool holds;
        a tier's, the tokens of the servable head it holds (its copies of those blocks and the blocks a lookup
        would read from it after them, ``TierStack.presence``). A prefix cached nowhere now (evicted from RAM,
        expired or pushed out of every tier) is not listed: it keeps its catalog record, and is listed again
        once requests cache it again. A tier that cannot answer (Redis down) lists 0 and keeps the row listed:
        its blocks may be there (before, such rows vanished while the tier was down, a trial). Never any text.
        O(listed blocks) pool lookups and tier checks, in growing chunks per tier (``TierStack.presence``)."""
        out = []
        bs = self.kv.block_size
        for rec in self.catalog.select(prefix_key=prefix_key, tenant=tenant, model_id=model_id):
            ram = self.kv.count_cached_leading(rec.block_hashes)
            where = {"ram": ram * bs}
            expires: dict[str, float | None] = {}
            unknown: dict[str, str] = {}
            if self.tiers is not None:
                presence = self.tiers.stack.presence(rec.block_hashes, unknown, ram_blocks=ram)
                for name, (n, expires_at) in presence.items():
                    where[name] = n * bs
                    expires[name] = expires_at
            if not any(where.values()) and not unknown:
                continue  # cached nowhere now (a trial: such rows were listed with their full token count)
            out.append(
                CachedPrefix(
                    rec.prefix_key,
                    rec.model_id,
                    rec.tenant,
                    rec.level,
                    rec.num_tokens,
                    where,
                    rec.last_use,
                    expires,
                    rec.pin_id is not None,
                )
            )
        return out

    def drop_cached(
        self, *, prefix_key: str | None = None, tenant: str | None = None, model_id: str | None = None
    ) -> dict[str, Any]:
        """Drop cached prefixes in RAM and in every tier: by prefix key (its blocks), or every block of a
        tenant and/or a model. Pins on them are released; blocks a running request holds stay in RAM (they
        are its KV) but leave the tiers. A tier that fails (Redis down) costs nothing else: RAM and the other
        tiers are dropped all the same, and the tier is named in ``skipped_tiers``; the prefixes' records stay
        in the catalog then, so the same call made again once the tier is back finds and drops what it still
        holds (before, the records were gone and a second call dropped nothing while the tier went on
        serving the prefix, a trial).

        Returns:
            ``{"prefixes": listed prefixes dropped, "ram": blocks, "disk": entries, "redis": entries}``, and
            ``"skipped_tiers": {tier: reason}`` when a tier could not be (fully) dropped.

        Raises:
            ValueError: no filter given (dropping everything needs ``reset_prefix_cache``).
        """
        if prefix_key is None and tenant is None and model_id is None:
            raise ValueError("give a prefix key, a tenant or a model to drop")
        recs = self.catalog.select(prefix_key=prefix_key, tenant=tenant, model_id=model_id)
        skipped: dict[str, str] = {}
        for rec in recs:
            if rec.pin_id is not None:
                self.kv.pins.unpin(rec.pin_id)
                rec.pin_id = None
        out: dict[str, Any] = {"prefixes": len(recs)}
        if prefix_key is not None:  # the listed prefix's own blocks (the filters chose the records)
            chain = [h for rec in recs for h in rec.block_hashes]
            doomed = set(chain)
            out["ram"] = self.kv.drop_unreferenced_where(lambda b: b.block_hash in doomed)
            if self.tiers is not None:
                out |= self.tiers.stack.delete_chain(chain, skipped)
        else:

            def owned(extra_keys: tuple) -> bool:
                keys = tuple(extra_keys) + ("", "")
                return (model_id is None or keys[0] == model_id) and (tenant is None or keys[1] == tenant)

            out["ram"] = self.kv.drop_unreferenced_where(lambda b: owned(b.extra_keys))
            if self.tiers is not None:
                out |= self.tiers.stack.drop_where(lambda m: owned(m.extra_keys), skipped)
        if not skipped:  # every tier dropped its blocks: the records go (kept for a retry otherwise)
            for rec in recs:
                self.catalog.remove(rec.prefix_key)
                if self.tiers is not None:
                    self.tiers.stack.delete_record(rec.prefix_key, skipped)
        if skipped:
            out["skipped_tiers"] = skipped
        return out

    def flush_tiers(self, write_cached: bool = True, timeout_s: float = 60.0) -> bool:
        """Write every cached block down (when ``write_cached``) and wait for the write-back queue to drain
        (a gateway persisting its cache; tests). False on timeout; True at once without tiers."""
        return self.tiers.flush(write_cached, timeout_s) if self.tiers is not None else True

    def tier_stats(self) -> dict[str, int]:
        """Tier counters (``engine.kv_tiers.counters``); empty without tiers."""
        return self.tiers.stats() if self.tiers is not None else {}

    def close(self) -> None:
        """Release the tiers: write cached blocks down (``tier_flush_on_close``), stop their threads. The
        engine must not step afterwards. Idempotent."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
            self.scheduler.admission_gate = None
