"""The gateway's ``Canonicalizer``: the transcript memory scoped by model and tenant, skipped with the rules
off; the learner's rules joined per model+tenant in mode ``apply`` only; a refused Redis only counted."""

from __future__ import annotations

from engine.api import SamplingParams
from gateway.config.schema import LearningConfig, TranscriptConfig
from gateway.core.request import ChatRequest
from gateway.service.canonicalize import Canonicalizer

SYSTEM = "You are the assistant of the shop.\nCurrent time: 09:45:{s}\nBe brief and polite, always."


def request(turn: int, tenant: str = "a", rules: bool = True, model: str = "m") -> ChatRequest:
    messages = [{"role": "system", "content": SYSTEM.format(s=10 + turn)}, {"role": "user", "content": "hi"}]
    for k in range(turn):
        messages += [{"role": "assistant", "content": f"reply {k}"}, {"role": "user", "content": f"q {k}"}]
    return ChatRequest(
        model=model, messages=messages, params=SamplingParams(), tenant=tenant, rules_enabled=rules
    )


def test_the_memory_is_scoped_by_model_and_tenant_and_skipped_with_rules_off():
    canon = Canonicalizer(["default"])
    first = request(0)
    canon.apply(first)
    second = request(1)
    canon.apply(second)
    assert second.canonical.history.reused_turns == 1
    assert second.messages[: len(first.messages)] == first.messages  # history never moves
    other_tenant = request(1, tenant="b")
    canon.apply(other_tenant)
    other_model = request(1, model="n")
    canon.apply(other_model)
    assert other_tenant.canonical.history.reused_turns == 0 == other_model.canonical.history.reused_turns
    lookups = canon.memory.stats.lookups
    off = request(2, rules=False)
    canon.apply(off)
    assert canon.memory.stats.lookups == lookups and off.messages == request(2).messages
    assert Canonicalizer.scope(first) == "m\0a"


def test_learned_rules_join_only_in_mode_apply():
    texts = [
        f"You are the support assistant of the shop. The customer's favourite colour is {c} and every answer "
        "mentions it once. Answer briefly."
        for c in ("teal", "amber", "olive", "coral")
    ]
    for mode, joined in (("suggest", False), ("apply", True)):
        canon = Canonicalizer(["default"], learning=LearningConfig(mode=mode))
        for text in texts:
            done = ChatRequest(
                model="m",
                messages=[{"role": "system", "content": text}, {"role": "user", "content": "hi"}],
                params=SamplingParams(),
            )
            canon.apply(done)
            canon.learn(done)
        base = len(canon.ruleset_for("x", "")) if canon.ruleset_for("x", "") else 0
        assert (len(canon.ruleset_for("m", "")) > base) is joined
        assert canon.ruleset_for("m", "") is canon.ruleset_for("m", "")  # built once per slot set
        assert len(canon.stats()["learned"]["slots"]) == 1
        assert "teal" not in canon.learned_yaml()


def test_a_refused_redis_is_counted_and_a_rules_off_config_learns_nothing():
    canon = Canonicalizer(["default"], TranscriptConfig(redis_url="redis://127.0.0.1:1/0"))
    canon.apply(request(0))  # the refused connection is counted, not raised
    assert canon.stats()["transcript"]["redis"]["errors"] >= 1
    canon.close()
    plain = Canonicalizer([])
    done = request(0)
    plain.apply(done)
    plain.learn(done)
    assert plain.learner.footprint()["sampled_texts"] == 0 and plain.stats()["transcript"]["redis"] is None


def test_the_memory_is_scoped_by_the_end_user_the_client_names():
    def named(turn: int, user: str | None, safety: str | None = None) -> ChatRequest:
        done = request(turn)
        done.user = user
        if safety is not None:
            done.openai_body = {"safety_identifier": safety}
        return done

    canon = Canonicalizer(["default"])
    canon.apply(named(0, "alice"))
    bob = named(1, "bob")
    canon.apply(bob)  # the same stable form as Alice's next turn: Alice's history is not his
    alice = named(1, "alice")
    canon.apply(alice)
    assert bob.canonical.history.reused_turns == 0 and alice.canonical.history.reused_turns == 1
    assert Canonicalizer.scope(named(0, "alice")) == "m\0a\0user:alice"
    assert Canonicalizer.scope(named(0, None, "sid-1")) == "m\0a\0user:sid-1"
    assert Canonicalizer.scope(named(0, None)) == Canonicalizer.tenant_scope(named(0, None)) == "m\0a"
