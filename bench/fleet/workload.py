"""Traffic for the fleet simulator: sessions over Zipf-distributed shared prefixes, bursts, a hot prefix.

A *prefix* is a system prompt (a few hundred to ~1,200 tokens of deterministic text). A *session* picks one
(Zipf with exponent ``zipf_s`` over ``n_prefixes``; during the hot window a share ``hot_share`` of sessions
take one extra prefix that nobody used before), then sends ``turns`` requests: each resends the whole
conversation so far (system, earlier user messages and the replies it got) plus a new user message, after a
think time. Sessions start as a Poisson process whose rate is raised ``burst_factor`` times during the burst
window. Everything is drawn from one seeded ``random.Random``: the same config gives the same sessions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the traffic (counts are exact, times are in real seconds after scaling)."""

    n_sessions: int = 120
    n_prefixes: int = 32
    zipf_s: float = 1.1
    prefix_words: tuple[int, int] = (250, 900)
    turns: tuple[int, int] = (1, 6)
    user_words: tuple[int, int] = (15, 50)
    max_tokens: int = 16
    think_s: float = 0.05
    burst_window: tuple[float, float] = (0.2, 0.3)
    burst_factor: float = 3.0
    hot_window: tuple[float, float] = (0.45, 0.6)
    hot_share: float = 0.5
    seed: int = 18


@dataclass(frozen=True)
class Session:
    """One conversation: its start offset (s), prefix id and user messages."""

    start_s: float
    prefix_id: int
    system: str
    user_messages: tuple[str, ...]


_VOCAB = (
    "the model cache block prefix token request replica gateway route policy load queue decode prefill "
    "system user assistant document answer question context history window tenant latency tail hit miss "
    "share index event stream bound ring hash chain fleet server engine batch schedule step memory page"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(
        rng.choice(_VOCAB) + (str(rng.randrange(100)) if rng.random() < 0.3 else "") for _ in range(words)
    )


def prefix_text(prefix_id: int, seed: int, words: int) -> str:
    """The system prompt of ``prefix_id`` (deterministic in ``(prefix_id, seed)``)."""
    rng = random.Random(f"prefix-{seed}-{prefix_id}")
    return f"You are assistant #{prefix_id}. " + _text(rng, words)


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalized weights ``1 / k**s`` for ranks ``k = 1..n``."""
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def mean_turns(cfg: WorkloadConfig) -> float:
    """Expected requests per session (turns are uniform in ``cfg.turns``)."""
    return (cfg.turns[0] + cfg.turns[1]) / 2


def build_sessions(cfg: WorkloadConfig, session_rate: float) -> list[Session]:
    """The sessions of one run, sorted by start time.

    Args:
        cfg: traffic shape.
        session_rate: mean session starts per real second outside the burst window (> 0).

    Raises:
        ValueError: ``session_rate <= 0``.
    """
    if session_rate <= 0:
        raise ValueError("session_rate must be > 0")
    rng = random.Random(cfg.seed)
    weights = zipf_weights(cfg.n_prefixes, cfg.zipf_s)
    lengths = [rng.randint(*cfg.prefix_words) for _ in range(cfg.n_prefixes + 1)]
    expected = cfg.n_sessions / session_rate
    sessions: list[Session] = []
    t = 0.0
    for i in range(cfg.n_sessions):
        frac = i / cfg.n_sessions
        rate = session_rate * (
            cfg.burst_factor if cfg.burst_window[0] <= t / expected < cfg.burst_window[1] else 1
        )
        t += rng.expovariate(rate)
        if cfg.hot_window[0] <= frac < cfg.hot_window[1] and rng.random() < cfg.hot_share:
            pid = cfg.n_prefixes  # the hot prefix, new at the window's start
        else:
            pid = rng.choices(range(cfg.n_prefixes), weights)[0]
        turns = rng.randint(*cfg.turns)
        users = tuple(_text(rng, rng.randint(*cfg.user_words)) for _ in range(turns))
        sessions.append(Session(t, pid, prefix_text(pid, cfg.seed, lengths[pid]), users))
    return sessions
