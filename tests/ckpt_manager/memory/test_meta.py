"""A slot's meta as `MetaEncoder` writes it: parsed back whole, self-checked, and its tensor
records encoded once per plan ([Note: a meta is encoded once, its records once per plan])."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ckpt_manager._format.checksum import ChecksumAlgorithm
from ckpt_manager._format.shard_file import plan_layout
from ckpt_manager._memory import meta
from ckpt_manager._memory.meta import MetaEncoder, SlotMeta
from ckpt_manager._memory.plan import MemoryPlan, TensorRecord


def _plan(num_tensors: int) -> MemoryPlan:
    layout = plan_layout([(f"t{i}", torch.float32, (3,)) for i in range(num_tensors)])
    records = {
        slot.key: TensorRecord("tensor", "float32", (3,), (3,), None, None, slot.offset, 12)
        for slot in layout.slots
    }
    return MemoryPlan(layout, layout.total_bytes, (), records, "ab12", "cd34")


def _encode(encoder: MetaEncoder, plan: MemoryPlan, step: int, **extra: Any) -> bytes:
    tree = ["d", [["model", ["T", "t0"]], ["data", ["v", {"epoch": 1, "pos": step}]]]]
    return encoder.encode(
        **extra,
        run_id="r",
        rank=1,
        world_size=2,
        step=step,
        plan=plan,
        algorithm=ChecksumAlgorithm.CRC32C,
        checksum=0xDEADBEEF,
        tree=tree,
        rank_local_trees=[["v", 0.5]],
    )


def test_an_encoded_meta_parses_back_and_a_changed_value_is_refused() -> None:
    plan = _plan(4)
    raw = json.loads(_encode(MetaEncoder(), plan, 7))
    parsed = SlotMeta.parse(raw)
    assert (parsed.run_id, parsed.rank, parsed.world_size, parsed.step) == ("r", 1, 2, 7)
    assert parsed.checksum == 0xDEADBEEF
    assert parsed.records == plan.records
    assert parsed.tree[1][1][1] == ["v", {"epoch": 1, "pos": 7}]
    assert parsed.rank_local_trees == [["v", 0.5]]
    raw["tree"][1][1][1][1]["pos"] = 8  # a flipped skeleton value
    with pytest.raises(ValueError, match="meta checksum mismatch"):
        SlotMeta.parse(raw)


def _count_canonical(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every value `meta` encodes canonically from now on."""
    encoded: list[Any] = []
    canonical = meta._canonical

    def counting(value: Any) -> str:
        encoded.append(value)
        return canonical(value)

    monkeypatch.setattr(meta, "_canonical", counting)
    return encoded


def test_the_records_are_encoded_once_per_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = _count_canonical(monkeypatch)
    plan, encoder = _plan(50), MetaEncoder()

    def records_encoded() -> int:
        return sum(1 for v in encoded if isinstance(v, dict) and set(v) == set(plan.records))

    first = _encode(encoder, plan, 1)
    second = _encode(encoder, plan, 2)
    assert records_encoded() == 1
    assert SlotMeta.parse(json.loads(second)).step == 2
    assert json.loads(first)["tensors"] == json.loads(second)["tensors"]
    _encode(encoder, _plan(50), 3)  # another plan (a new layout): encoded afresh
    assert records_encoded() == 2


def test_a_meta_file_is_checked_on_its_bytes_without_encoding_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # [Note: a signed meta's text is checked as it is]
    data = _encode(MetaEncoder(), _plan(4), 7)
    encoded = _count_canonical(monkeypatch)
    parsed = meta.parse_meta_file(data)
    assert encoded == []
    assert parsed.meta == SlotMeta.parse(json.loads(data))
    assert (parsed.raw, parsed.data) == (json.loads(data), data)
    # A flipped digit anywhere, the trailer's included, is refused either way.
    for at in (data.index(b'"step":7') + 7, len(data) - 3):
        flipped = bytearray(data)
        flipped[at] = ord("8") if flipped[at] != ord("8") else ord("9")
        with pytest.raises(ValueError, match="meta checksum mismatch"):
            meta.parse_meta_file(bytes(flipped))


def test_a_meta_in_another_form_is_checked_by_encoding_it() -> None:
    raw = json.loads(_encode(MetaEncoder(), _plan(4), 7))
    spaced = json.dumps(raw, indent=1).encode()  # not the signed form: keys unsorted, spaces
    assert meta.parse_meta_file(spaced).meta.step == 7
    raw["step"] = 8
    with pytest.raises(ValueError, match="meta checksum mismatch"):
        meta.parse_meta_file(json.dumps(raw).encode())
    with pytest.raises(ValueError, match="not a JSON object"):
        meta.parse_meta_file(b"[1, 2]")
    with pytest.raises(ValueError):
        meta.parse_meta_file(b'{"format": "trainingd-memory-slot", "format')


def test_a_stamped_meta_is_encoded_once_and_parses_back_in_its_signed_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed = meta.parse_meta_file(_encode(MetaEncoder(), _plan(4), 7))
    encoded = _count_canonical(monkeypatch)
    stamped = meta.stamp(parsed, origin=meta.ORIGIN_REPLICA, replica_round=3)
    assert len(encoded) == 1
    assert stamped.meta.origin == meta.ORIGIN_REPLICA
    assert stamped.raw["replica_round"] == 3
    assert stamped.meta == parsed.meta._replace(origin=meta.ORIGIN_REPLICA)
    again = meta.parse_meta_file(stamped.data)
    assert len(encoded) == 1  # checked on its bytes
    assert (again.raw, again.meta) == (stamped.raw, stamped.meta)
    # The same result as `restamp` on the JSON object.
    assert meta.restamp(parsed.raw, origin=meta.ORIGIN_REPLICA, replica_round=3) == stamped.raw


def test_a_snapshot_kept_on_its_node_says_so_and_others_carry_no_field() -> None:
    # [Note: under `auto` a durable save between two snapshots stays on its node]
    plan = _plan(2)
    shared = json.loads(_encode(MetaEncoder(), plan, 7))
    assert "replicate" not in shared  # a replicated snapshot's meta is what it was before
    assert SlotMeta.parse(shared).replicate is True
    kept = meta.parse_meta_file(_encode(MetaEncoder(), plan, 7, replicate=False))
    assert kept.raw["replicate"] is False
    assert kept.meta.replicate is False
    # The field is signed like the rest: a meta whose flag was flipped does not verify.
    flipped = {**kept.raw, "replicate": True}
    with pytest.raises(ValueError, match="meta checksum mismatch"):
        SlotMeta.parse(flipped)
    # A value that is not true or false is refused with its reason, even correctly signed.
    body = {k: v for k, v in shared.items() if k != "meta_checksum"}
    body["replicate"] = "no"
    with pytest.raises(ValueError, match="replicate is not true or false: 'no'"):
        SlotMeta.parse({**body, "meta_checksum": meta._meta_checksum(body)})
