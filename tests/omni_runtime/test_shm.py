"""Shared-memory transfer: slot reuse, release rules, lost segments, and the wire encoding around it.

What needs a second process is in test_processes.py."""

from __future__ import annotations

import gc

import msgspec
import numpy as np
import pytest

from omni_runtime import shm
from omni_runtime.media import ImageItem
from omni_runtime.messages import Payload, StageOutput, StageRequest
from omni_runtime.serialization import Encoder, inbound_decoder, outbound_decoder

BIG = shm.SHM_MIN_BYTES  # floats of this count: 4x the threshold


def put(pool: shm.ShmPool, arr: np.ndarray) -> shm.ShmHandle:
    handle = pool.put(arr, arr.dtype.str, False)
    assert handle is not None
    return handle


def test_a_released_slot_is_reused_and_its_generation_moves_on(pool):
    arr = np.arange(BIG, dtype=np.float32)
    h1 = put(pool, arr)
    assert shm.pending(h1)
    out = shm.read(h1)
    assert np.array_equal(out, arr) and out.flags.writeable
    assert not shm.pending(h1)
    h2 = put(pool, arr * 2)
    assert h2.name == h1.name and h2.gen == h1.gen + 1
    assert pool.stats()["segments"] == 1


def test_a_busy_slot_is_never_handed_out_twice(pool):
    arr = np.ones(BIG, dtype=np.float32)
    handles = [put(pool, arr) for _ in range(3)]
    assert len({h.name for h in handles}) == 3
    for h in handles:
        shm.read(h)
    # Three free segments now: the next array reuses one instead of creating a fourth.
    put(pool, arr)
    assert pool.stats()["segments"] == 3


def test_release_is_idempotent_and_a_stale_release_does_nothing(pool):
    arr = np.zeros(BIG, dtype=np.float32)
    old = put(pool, arr)
    assert shm.release(old) and not shm.release(old)
    new = put(pool, arr)
    assert new.name == old.name
    # A late release of the recycled slot's previous generation must not free the new array.
    assert not shm.release(old)
    assert shm.pending(new)
    with pytest.raises(shm.ShmLostError, match="already released"):
        shm.read(old)


def test_a_full_pool_returns_none_so_the_array_travels_as_a_frame(engine):
    pool = shm.ShmPool(engine + "-tiny", max_segments=2)
    try:
        arr = np.zeros(BIG, dtype=np.float32)
        held = [put(pool, arr), put(pool, arr)]
        assert pool.put(arr, arr.dtype.str, False) is None
        assert pool.stats()["fallbacks"] == 1
        shm.read(held[0])
        assert pool.put(arr, arr.dtype.str, False) is not None
    finally:
        pool.close()


def test_a_free_segment_too_small_is_replaced_at_the_cap(engine):
    pool = shm.ShmPool(engine + "-grow", max_segments=1)
    try:
        small = put(pool, np.zeros(BIG, dtype=np.float32))
        shm.read(small)
        big = put(pool, np.zeros(shm.MIN_SEGMENT_BYTES, dtype=np.float32))  # 4 MiB: does not fit
        assert big.name != small.name
        assert shm.segment_names(engine + "-grow-") == [big.name]
    finally:
        pool.close()


def test_close_unlinks_every_segment_even_while_busy(engine):
    pool = shm.ShmPool(engine + "-c")
    h = put(pool, np.zeros(BIG, dtype=np.float32))
    pool.close()
    assert shm.segment_names(engine + "-c-") == []
    with pytest.raises(shm.ShmLostError, match="is gone"):
        shm.read(h)


# --------------------------------------------------------------------------- the wire


def test_encoder_puts_large_arrays_in_shared_memory_and_the_worker_maps_them(engine, pool):
    import torch

    big = np.random.default_rng(0).standard_normal((4, 8192)).astype(np.float32)
    latents = torch.randn(2, 4, 64, 64)
    half = torch.randn(256, 256).to(torch.bfloat16)
    mid = np.ones(1024, dtype=np.uint8)  # under the threshold: a frame
    enc = Encoder(pool)
    msg = StageRequest(
        request_id="r", prompt="p", params={}, inputs={"big": big, "lat": latents, "bf": half, "mid": mid}
    )
    frames = enc.encode(msg)
    assert len(frames) == 2 and len(frames[0]) < 1024  # header + the mid-size frame
    assert len(enc.handles) == 3 and all(shm.pending(h) for h in enc.handles)
    out = inbound_decoder(engine).decode([bytes(f) for f in frames])
    assert np.array_equal(out.inputs["big"], big)
    assert isinstance(out.inputs["lat"], torch.Tensor) and torch.equal(out.inputs["lat"], latents)
    assert out.inputs["bf"].dtype == torch.bfloat16 and torch.equal(out.inputs["bf"], half)
    assert np.array_equal(out.inputs["mid"], mid)
    # Mapped, not copied: the slots stay the worker's until it drops the arrays.
    assert all(shm.pending(h) for h in enc.handles)
    del out
    assert not any(shm.pending(h) for h in enc.handles)


def test_a_mapped_array_frees_its_slot_only_when_its_last_alias_goes(engine, pool):
    import torch

    arr = np.arange(BIG, dtype=np.float32)
    handle = put(pool, arr)
    mapped = shm.map_array(handle)
    assert mapped.flags.writeable and np.array_equal(mapped, arr)
    view = mapped.reshape(4, -1)[1:]
    tensor = torch.from_numpy(mapped)
    del mapped
    assert shm.pending(handle)
    del view
    assert shm.pending(handle)
    tensor += 1  # the slot is the consumer's until released: writing to it is fine
    del tensor
    assert not shm.pending(handle)
    # The producer gets the same slot back for its next array.
    assert put(pool, arr).name == handle.name


def test_without_a_pool_arrays_are_frames_as_before():
    big = np.arange(BIG, dtype=np.float32)
    frames = Encoder().encode(StageOutput(request_id="r", payload=Payload(tensors={"x": big})))
    assert len(frames) == 2
    assert np.array_equal(outbound_decoder().decode(frames).payload.tensors["x"], big)


def test_refs_are_taken_handed_off_or_released_when_dropped(engine):
    producer = shm.ShmPool(shm.replica_prefix(engine, 0, 0, 0))
    relay = shm.ShmPool(shm.orchestrator_prefix(engine))
    try:
        arr = np.arange(BIG, dtype=np.float32)
        frames = Encoder(producer).encode(
            StageOutput(request_id="r", payload=Payload(tensors={"a": arr, "b": arr + 1, "c": arr + 2}))
        )
        out = outbound_decoder(engine).decode(frames)
        refs = out.payload.tensors
        assert all(isinstance(r, shm.ShmRef) for r in refs.values())
        handles = {k: r.handle for k, r in refs.items()}
        # take: an owned copy, slot freed.
        assert np.array_equal(refs["a"].take(), arr) and not shm.pending(handles["a"])
        # hand-off: the same handle goes on, no copy into the relay's pool; the receiver frees it.
        relay_enc = Encoder(relay)
        fwd = relay_enc.encode(StageRequest(request_id="r", prompt="", params={}, inputs={"b": refs["b"]}))
        assert relay_enc.handles == [handles["b"]] and relay.stats()["segments"] == 0
        assert shm.pending(handles["b"])
        assert np.array_equal(inbound_decoder(engine).decode(fwd).inputs["b"], arr + 1)
        assert not shm.pending(handles["b"])
        with pytest.raises(RuntimeError, match="already handed off"):
            refs["b"].take()
        # dropped: garbage collection releases it.
        assert shm.pending(handles["c"])
        del out, refs
        gc.collect()
        assert not shm.pending(handles["c"])
    finally:
        producer.close()
        relay.close()


def test_a_ref_to_a_dead_producers_segment_is_copied_not_handed_off(engine):
    producer = shm.ShmPool(shm.replica_prefix(engine, 0, 0, 0))
    relay = shm.ShmPool(shm.orchestrator_prefix(engine))
    arr = np.arange(BIG, dtype=np.float32)
    out = outbound_decoder(engine).decode(
        Encoder(producer).encode(StageOutput(request_id="r", payload=Payload(tensors={"a": arr})))
    )
    producer.close()  # as the orchestrator does once a crashed replica has exited
    try:
        enc = Encoder(relay)
        frames = enc.encode(StageRequest(request_id="r", prompt="", params={}, inputs={"a": out.payload.tensors["a"]}))
        # Still readable through our mapping; re-sent from the relay's own pool.
        assert [h.name.startswith(relay.prefix) for h in enc.handles] == [True]
        assert np.array_equal(inbound_decoder(engine).decode(frames).inputs["a"], arr)
    finally:
        relay.close()


def test_a_handle_to_a_vanished_segment_fails_that_message_with_its_contents(engine, pool):
    frames = Encoder(pool).encode(
        StageRequest(request_id="r9", prompt="p", params={}, inputs={"x": np.zeros(BIG, np.float32)})
    )
    pool.close()
    with pytest.raises(shm.ShmLostError, match="is gone") as info:
        inbound_decoder(engine).decode(frames)
    assert info.value.message.request_id == "r9"


def test_handles_to_foreign_segments_are_refused(engine, pool):
    x = np.zeros(BIG, np.float32)
    frames = Encoder(pool).encode(StageOutput(request_id="r", payload=Payload(tensors={"x": x})))
    with pytest.raises(msgspec.DecodeError, match="not this engine's"):
        outbound_decoder(shm.engine_prefix()).decode(frames)
    frames = Encoder(pool).encode(StageRequest(request_id="r", prompt="", params={}, inputs={"x": x}))
    with pytest.raises(msgspec.DecodeError, match="not this engine's"):
        inbound_decoder(None).decode(frames)


def test_a_failed_encode_gives_its_slots_back(pool):
    enc = Encoder(pool)
    with pytest.raises(msgspec.EncodeError):
        enc.encode(
            StageOutput(request_id="r", payload=Payload(tensors={"a": np.zeros(BIG, np.float32), "b": object()}))
        )
    assert pool.stats()["busy"] == 0


def test_materialize_walks_structs_and_containers(engine, pool):
    arr = np.arange(BIG, dtype=np.float32)
    out = outbound_decoder(engine).decode(
        Encoder(pool).encode(
            StageOutput(request_id="r", payload=Payload(media=[ImageItem(data=arr)], tensors={"t": arr}, text="x"))
        )
    )
    plain = shm.materialize(out)
    assert isinstance(plain, StageOutput) and plain.payload.text == "x"
    assert np.array_equal(plain.payload.media[0].data, arr) and np.array_equal(plain.payload.tensors["t"], arr)
    assert pool.stats()["busy"] == 0
    assert shm.materialize(plain) is plain  # nothing left to copy
