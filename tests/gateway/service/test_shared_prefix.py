"""Which leading messages a ``shared_prefixes:`` declaration makes public."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from engine.api import SamplingParams
from gateway.config.schema import SharedPrefix
from gateway.core.request import ChatRequest
from gateway.service.shared_prefix import content_hash, mark_public_prefix, public_messages


@dataclass
class Seg:
    level: int
    end_message: int
    end_part: int | None = None
    end_char: int | None = None


@dataclass
class Canon:
    segments: list
    applied: dict = field(default_factory=dict)
    material: bytes = b"system prompt"

    def stable_prefix_material(self, level: int = 3) -> bytes:
        return self.material


def request(canonical, kind="chat") -> ChatRequest:
    r = ChatRequest(model="m", messages=[{"role": "system", "content": "s"}] * 3, params=SamplingParams())
    r.canonical, r.kind = canonical, kind
    return r


SEGMENTS = [Seg(1, 2), Seg(2, 3, end_part=0, end_char=10), Seg(4, 3)]


def test_segment_rule_and_content_hash_declarations():
    digest = hashlib.sha256(b"system prompt").hexdigest()
    assert content_hash(Canon(SEGMENTS)) == digest
    assert public_messages(request(Canon(SEGMENTS)), [SharedPrefix("segment", "1")]) == (2, "segment:1")
    # a documents segment ending inside a message adds nothing: whole messages only
    assert public_messages(request(Canon(SEGMENTS)), [SharedPrefix("segment", "2")]) == (2, "segment:2")
    rule = [SharedPrefix("rule", "product-prompt")]
    assert public_messages(request(Canon(SEGMENTS)), rule) == (0, "")
    assert public_messages(request(Canon(SEGMENTS, {"product-prompt": 1})), rule)[0] == 2
    assert public_messages(request(Canon(SEGMENTS)), [SharedPrefix("content_hash", digest)])[0] == 2
    assert public_messages(request(Canon(SEGMENTS)), [SharedPrefix("content_hash", "0" * 64)]) == (0, "")


def test_nothing_public_without_a_match():
    assert public_messages(request(None), [SharedPrefix("segment", "1")]) == (0, "")
    assert public_messages(request(Canon(SEGMENTS), kind="completion"), [SharedPrefix("segment", "1")]) == (
        0,
        "",
    )
    assert public_messages(request(Canon([Seg(1, 0), Seg(4, 3)])), [SharedPrefix("segment", "1")]) == (0, "")
    r = request(Canon(SEGMENTS))
    mark_public_prefix(r, [])
    assert (r.shared_prefix_messages, r.shared_salt) == (0, "")
